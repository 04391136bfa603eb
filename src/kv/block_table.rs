//! Block ids and block tables: the one place a sequence position becomes a pool slot.

use std::ops::{Deref, DerefMut, Range};

/// Id of one KV block in the pool (and of its pages in every backend).
pub type BlockId = u32;

/// The blocks holding one sequence's KV in position order, with their size.
///
/// Position `p` lives in block `p / block_size` at offset `p % block_size`;
/// its pool slot is `block * block_size + offset`. The scheduler, the runner
/// and the backends all take slots from here, so they cannot disagree.
///
/// ```
/// use omniprefix::kv::BlockTable;
/// let table = BlockTable::new(vec![7, 2], 4);
/// assert_eq!(table.slots(2..6), vec![30, 31, 8, 9]);
/// assert!(table.covers(8) && !table.covers(9));
/// assert_eq!(table[1], 2); // reads like the slice of block ids it wraps
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
    block_size: usize,
}

impl BlockTable {
    /// A table over `blocks` of `block_size` positions each.
    pub fn new(blocks: Vec<BlockId>, block_size: usize) -> Self {
        BlockTable { blocks, block_size }
    }

    /// An empty table (a request that holds no blocks yet).
    pub fn empty(block_size: usize) -> Self {
        Self::new(Vec::new(), block_size)
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The block ids in position order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// True when the table holds positions `0..positions`.
    pub fn covers(&self, positions: usize) -> bool {
        self.blocks.len().saturating_mul(self.block_size) >= positions
    }

    /// Pool slot of position `pos`, or `None` past the table.
    pub fn slot(&self, pos: usize) -> Option<i64> {
        let block = *self.blocks.get(pos / self.block_size.max(1))?;
        Some((block as usize * self.block_size + pos % self.block_size.max(1)) as i64)
    }

    /// Pool slots of positions `range`, which the table must cover (the
    /// scheduler allocates before it emits; the runner checks user batches).
    pub fn slots(&self, range: Range<usize>) -> Vec<i64> {
        debug_assert!(self.covers(range.end), "block table covers positions ..{}", range.end);
        range.map(|pos| self.slot(pos).unwrap_or(-1)).collect()
    }

    /// Appends blocks at the end (a longer prompt part).
    pub fn extend(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        self.blocks.extend(blocks);
    }

    /// Keeps the first `len` blocks.
    pub fn truncate(&mut self, len: usize) {
        self.blocks.truncate(len);
    }

    /// Drops every block.
    pub fn clear(&mut self) {
        self.blocks.clear();
    }
}

impl Deref for BlockTable {
    type Target = [BlockId];

    fn deref(&self) -> &[BlockId] {
        &self.blocks
    }
}

impl DerefMut for BlockTable {
    fn deref_mut(&mut self) -> &mut [BlockId] {
        &mut self.blocks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_block_table() {
        let table = BlockTable::new(vec![7, 2], 4);
        assert_eq!(table.slots(2..6), vec![30, 31, 8, 9]);
        assert_eq!(table.slot(8), None);
        assert_eq!(BlockTable::empty(4).slot(0), None);
    }
}
