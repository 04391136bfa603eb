//! One captured point kept only at item positions, per pool slot: the talker's
//! accept layer.
//!
//! The talker reads the thinker's accept-layer rows at the item positions of
//! user turns (HF `hidden_projection(hidden_states[accept_hidden_layer])`);
//! its text rows come from the ids. Paging that layer like the other captures
//! would cost its width at *every* position (8 KiB a token at the release's
//! width, in f32), so it lives here instead: a row per slot whose last write
//! was an item position, nothing for text.
//!
//! The rows follow the pool's blocks the way the backend's pages do, so a
//! cached prefix hands back its item rows exactly as it hands back its K/V:
//! every step clears the slots it writes before storing its item rows (a
//! text position over an old item row leaves nothing behind), a copy-on-write
//! copies a block's rows with its pages, and the disk tier carries them after
//! the block's page bytes ([`ItemCapture::export_block`], [`ItemCapture::import_block`]).
//! A freed block's rows stay until its slots are written again: what is held
//! is at most the item positions among the slots, never a row per token.

use fxhash::FxHashMap;
use ndarray::{Array2, ArrayView2};

use super::BlockId;
use crate::Result;
use crate::error::{BackendError, Component};
use crate::model::CaptureName;

/// Rows of one captured point at item positions, keyed by pool slot.
///
/// ```
/// use ndarray::array;
/// use omniprefix::kv::ItemCapture;
/// use omniprefix::model::CaptureName;
///
/// let mut rows = ItemCapture::new(CaptureName::Hidden(2), 2, 4);
/// // A step wrote slots 4..8 (block 1); slots 5 and 6 were item positions.
/// rows.write(&[4, 5, 6, 7], &[5, 6], array![[1.0, 2.0], [3.0, 4.0]].view())?;
/// let (positions, got) = rows.gather(&[4, 5, 6, 7]);
/// assert_eq!((positions, got), (vec![1, 2], array![[1.0, 2.0], [3.0, 4.0]]));
/// assert_eq!(rows.len(), 2);
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct ItemCapture {
    point: CaptureName,
    width: usize,
    block_size: usize,
    rows: FxHashMap<u64, Box<[f32]>>,
}

impl ItemCapture {
    /// An empty store of `point`'s rows, `width` floats each, over blocks of `block_size` slots.
    pub fn new(point: CaptureName, width: usize, block_size: usize) -> Self {
        ItemCapture { point, width, block_size: block_size.max(1), rows: FxHashMap::default() }
    }

    /// The captured point these rows are of.
    pub fn point(&self) -> CaptureName {
        self.point
    }

    /// Floats in one row.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Slots per block: the pages' block size, which copies and tier bytes go by.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// True when no row is held.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Bytes the rows' values take (what a token costs: its width in f32 at an
    /// item position, nothing at a text position).
    pub fn bytes(&self) -> usize {
        self.rows.len() * self.width * size_of::<f32>()
    }

    /// A step wrote `step_slots`: each loses what it held, then `rows` (one per
    /// slot of `item_slots`, a subset of `step_slots`) are stored.
    ///
    /// Errors ([`BackendError::OpShape`]) when `rows` is not `[item_slots.len(), width]`;
    /// nothing changes then.
    pub fn write(&mut self, step_slots: &[i64], item_slots: &[i64], rows: ArrayView2<'_, f32>) -> Result<()> {
        if rows.dim() != (item_slots.len(), self.width) {
            return Err(BackendError::OpShape {
                op: "item rows",
                what: "rows",
                expected: format!("[{}, {}]", item_slots.len(), self.width),
                found: rows.shape().to_vec(),
            }
            .into());
        }
        for &slot in step_slots {
            self.rows.remove(&(slot as u64));
        }
        for (&slot, row) in item_slots.iter().zip(rows.rows()) {
            self.rows.insert(slot as u64, row.iter().copied().collect());
        }
        Ok(())
    }

    /// The rows held at `slots`: the indices into `slots` that hold one, and
    /// their rows in that order (`[positions.len(), width]`).
    pub fn gather(&self, slots: &[i64]) -> (Vec<usize>, Array2<f32>) {
        let mut positions = Vec::new();
        let mut values = Vec::new();
        for (i, slot) in slots.iter().enumerate() {
            if let Some(row) = self.rows.get(&(*slot as u64)) {
                positions.push(i);
                values.extend_from_slice(row);
            }
        }
        let rows = Array2::from_shape_vec((positions.len(), self.width), values)
            .unwrap_or_else(|_| Array2::zeros((0, self.width)));
        (positions, rows)
    }

    /// Slot `offset` of `block`.
    fn slot(&self, block: BlockId, offset: usize) -> u64 {
        block as u64 * self.block_size as u64 + offset as u64
    }

    /// Copies whole blocks `src → dst` (a copy-on-write), as the pages are copied.
    pub fn copy_blocks(&mut self, copies: &[(BlockId, BlockId)]) {
        for &(src, dst) in copies {
            for offset in 0..self.block_size {
                let row = self.rows.get(&self.slot(src, offset)).cloned();
                let dst_slot = self.slot(dst, offset);
                match row {
                    Some(row) => self.rows.insert(dst_slot, row),
                    None => self.rows.remove(&dst_slot),
                };
            }
        }
    }

    /// Block `block`'s rows appended to `out` as the disk tier stores them
    /// after the block's page bytes: a `u32` count, the count's `u32` offsets
    /// in the block (ascending), then their rows as little-endian `f32`.
    pub fn export_block(&self, block: BlockId, out: &mut Vec<u8>) {
        let held: Vec<(u32, &[f32])> = (0..self.block_size)
            .filter_map(|o| self.rows.get(&self.slot(block, o)).map(|r| (o as u32, &r[..])))
            .collect();
        out.extend_from_slice(&(held.len() as u32).to_le_bytes());
        for (offset, _) in &held {
            out.extend_from_slice(&offset.to_le_bytes());
        }
        for (_, row) in &held {
            row.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        }
    }

    /// Replaces block `block`'s rows by those [`export_block`](Self::export_block)
    /// wrote into `bytes` (all of them). A malformed tail (a count past the
    /// block, offsets out of order, a length that disagrees) is an invariant
    /// violation of the tier, whose files are checksummed; nothing changes then.
    pub fn import_block(&mut self, block: BlockId, bytes: &[u8]) -> Result<()> {
        let bad = |what: String| Component::Tier.violation(format!("item rows of block {block}: {what}"));
        let word = |at: usize| -> Option<u32> {
            bytes.get(at..at + 4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes)
        };
        let count = word(0).ok_or_else(|| bad("no count".into()))? as usize;
        if count > self.block_size {
            return Err(bad(format!("{count} rows in a block of {}", self.block_size)).into());
        }
        let row_bytes = self.width * size_of::<f32>();
        let expected = 4 + 4 * count + count * row_bytes;
        if bytes.len() != expected {
            return Err(bad(format!("{} bytes where {count} rows take {expected}", bytes.len())).into());
        }
        let offsets: Vec<usize> = (0..count).filter_map(|i| word(4 + 4 * i)).map(|o| o as usize).collect();
        if offsets.iter().zip(offsets.iter().skip(1)).any(|(a, b)| a >= b)
            || offsets.last().is_some_and(|&o| o >= self.block_size)
        {
            return Err(bad(format!("offsets {offsets:?} not ascending within the block")).into());
        }
        for offset in 0..self.block_size {
            self.rows.remove(&self.slot(block, offset));
        }
        let values = &bytes[4 + 4 * count..];
        for (offset, chunk) in offsets.iter().zip(values.chunks_exact(row_bytes.max(1))) {
            let row = chunk.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            self.rows.insert(self.slot(block, *offset), row);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use ndarray::array;

    use super::*;

    fn store() -> ItemCapture {
        ItemCapture::new(CaptureName::Hidden(1), 2, 4)
    }

    #[test]
    fn a_step_clears_the_slots_it_writes_so_text_over_an_item_leaves_nothing() {
        let mut s = store();
        s.write(&[0, 1, 2, 3], &[1, 3], array![[1.0, 1.5], [3.0, 3.5]].view()).unwrap();
        // A later sequence in the same block: slot 1 is text now, slot 2 an item.
        s.write(&[1, 2], &[2], array![[2.0, 2.5]].view()).unwrap();
        let (positions, rows) = s.gather(&[0, 1, 2, 3]);
        assert_eq!(positions, [2, 3]);
        assert_eq!(rows, array![[2.0, 2.5], [3.0, 3.5]]);
        assert_eq!(s.bytes(), 2 * 2 * 4);
        // A row of the wrong width changes nothing.
        assert!(s.write(&[0, 1, 2, 3], &[0], array![[1.0]].view()).is_err());
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn copies_and_tier_bytes_carry_a_block_exactly() {
        let mut s = store();
        s.write(&[4, 5, 6, 7], &[5, 7], array![[5.0, 5.5], [7.0, 7.5]].view()).unwrap();
        // Block 2 holds a stale row; the copy of block 1 over it replaces it.
        s.write(&[8], &[8], array![[9.0, 9.0]].view()).unwrap();
        s.copy_blocks(&[(1, 2)]);
        assert_eq!(s.gather(&[8, 9, 10, 11]), s.gather(&[4, 5, 6, 7]));

        let mut bytes = vec![0xAA];
        s.export_block(1, &mut bytes);
        assert_eq!(bytes.len(), 1 + 4 + 2 * 4 + 2 * 2 * 4);
        let mut other = store();
        other.write(&[12], &[12], array![[1.0, 1.0]].view()).unwrap();
        other.import_block(3, &bytes[1..]).unwrap();
        assert_eq!(other.gather(&[12, 13, 14, 15]), s.gather(&[4, 5, 6, 7]));
        // An empty block round-trips to nothing held.
        let mut empty = Vec::new();
        s.export_block(0, &mut empty);
        other.import_block(3, &empty).unwrap();
        assert!(other.gather(&[12, 13, 14, 15]).0.is_empty());
    }

    #[test]
    fn a_malformed_tier_tail_is_refused_and_changes_nothing() {
        let mut s = store();
        s.write(&[0, 1], &[1], array![[1.0, 2.0]].view()).unwrap();
        let mut good = Vec::new();
        s.export_block(0, &mut good);
        let before = s.gather(&[0, 1, 2, 3]);
        let mut truncated = good.clone();
        truncated.pop();
        let mut past_block = good.clone();
        past_block[4..8].copy_from_slice(&9u32.to_le_bytes());
        let too_many = 5u32.to_le_bytes().to_vec();
        for bad in [&[][..], &truncated[..], &past_block[..], &too_many[..]] {
            assert!(s.import_block(0, bad).is_err(), "{bad:?}");
            assert_eq!(s.gather(&[0, 1, 2, 3]), before);
        }
    }
}
