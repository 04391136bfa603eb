//! Slicing a validated request into the inputs of one prefill chunk.

use std::ops::Range;
use std::sync::Arc;

use ndarray::Array2;

use crate::batch::{DeepStack, EmbedRows};
use crate::index::BlockId;
use crate::prompt::{IndexMap, Positions};

/// Position ids of `range` (bounds checked at admission).
pub(super) fn slice_positions(positions: &Positions, range: Range<usize>) -> Positions {
    let cut = |v: &Vec<i64>| {
        debug_assert!(range.end <= v.len(), "positions validated at admission");
        v.get(range.clone()).unwrap_or_default().to_vec()
    };
    match positions {
        Positions::Linear(p) => Positions::Linear(cut(p)),
        Positions::Mrope {
            t,
            h,
            w,
            rope_delta,
        } => Positions::Mrope {
            t: cut(t),
            h: cut(h),
            w: cut(w),
            rope_delta: *rope_delta,
        },
    }
}

/// Item rows whose positions fall in `range`, with offsets relative to the chunk
/// (and the item's DeepStack levels, sliced by the same rows in the runner).
pub(super) fn embeds_in(
    index_map: &IndexMap,
    embeddings: &[Arc<Array2<f32>>],
    deepstack: &[Option<DeepStack>],
    range: Range<usize>,
) -> Vec<EmbedRows> {
    index_map
        .spans
        .iter()
        .filter_map(|span| {
            let start = span.start as usize;
            let lo = start.max(range.start);
            let hi = (start + span.rows.len()).min(range.end);
            let embeddings = embeddings.get(span.item as usize)?;
            (lo < hi).then(|| {
                let first_row = span.rows.start as usize + (lo - start);
                EmbedRows {
                    step_offset: lo - range.start,
                    embeddings: Arc::clone(embeddings),
                    rows: first_row..first_row + (hi - lo),
                    deepstack: deepstack.get(span.item as usize).cloned().flatten(),
                }
            })
        })
        .collect()
}

/// Pool slot of every position in `range`, given a block table that covers it.
pub(super) fn slot_mapping(
    block_table: &[BlockId],
    block_size: usize,
    range: Range<usize>,
) -> Vec<i64> {
    range
        .map(|pos| {
            let block = block_table.get(pos / block_size).copied();
            debug_assert!(block.is_some(), "block table covers the chunk");
            block.map_or(-1, |b| (b as usize * block_size + pos % block_size) as i64)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::ItemSpan;

    #[test]
    fn embeds_are_clipped_to_the_chunk() {
        let emb = Arc::new(Array2::<f32>::zeros((6, 2)));
        let map = IndexMap {
            placeholders: (3u32..9).collect(),
            // Item 0 rows 0..4 at positions 3..7, rows 4..6 at 7..9 (an interleaved split).
            spans: vec![
                ItemSpan {
                    item: 0,
                    rows: 0..4,
                    start: 3,
                },
                ItemSpan {
                    item: 0,
                    rows: 4..6,
                    start: 7,
                },
            ],
        };
        let levels: DeepStack = Arc::new(vec![Array2::zeros((6, 2))]);
        let got = embeds_in(&map, std::slice::from_ref(&emb), &[Some(Arc::clone(&levels))], 5..8);
        let rows: Vec<_> = got
            .iter()
            .map(|e| (e.step_offset, e.rows.clone()))
            .collect();
        assert_eq!(rows, vec![(0, 2..4), (2, 4..5)]);
        assert!(got.iter().all(|e| e.deepstack.as_ref().is_some_and(|d| Arc::ptr_eq(d, &levels))));
        assert!(embeds_in(&map, &[emb], &[], 5..8).iter().all(|e| e.deepstack.is_none()));
    }

    #[test]
    fn slots_follow_the_block_table() {
        assert_eq!(slot_mapping(&[7, 2], 4, 2..6), vec![30, 31, 8, 9]);
    }

    #[test]
    fn mrope_slices_keep_the_delta() {
        let p = Positions::Mrope {
            t: vec![0, 1, 2],
            h: vec![0, 1, 1],
            w: vec![0, 2, 2],
            rope_delta: -3,
        };
        let want = Positions::Mrope {
            t: vec![1, 2],
            h: vec![1, 1],
            w: vec![2, 2],
            rope_delta: -3,
        };
        assert_eq!(slice_positions(&p, 1..3), want);
    }
}
