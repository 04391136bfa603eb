//! The contract between the scheduler and the runner: what to run this step,
//! and the one place a prompt's inputs are cut into a chunk.
//!
//! The scheduler fills it from the cache state it owns; the runner executes it
//! and never imports the scheduler, the index or the pool. Both cut chunks
//! with [`chunk`] (positions via [`Positions::slice`], item rows via
//! [`clip_embeds`], slots via [`BlockTable`]), so what the scheduler emits and
//! what a caller builds by hand cannot differ.

use std::ops::Range;
use std::sync::Arc;

use ndarray::Array2;

use crate::error::{RequestError, Result};
use crate::kv::{BlockId, BlockTable};
use crate::model::Config;
use crate::prompt::Positions;

/// Caller-chosen id of a request.
pub type RequestId = u64;

/// An item's DeepStack rows (Qwen3-VL / Qwen3-Omni vision items): one
/// `[rows, hidden]` array per level, row-aligned with the item's embeddings.
/// Level `i` is added to the item's positions after decoder layer `i`.
pub type DeepStack = Arc<Vec<Array2<f32>>>;

/// Item embeddings to place at some of this step's positions.
#[derive(Debug, Clone)]
pub struct EmbedRows {
    /// Offset of the first row within this step's new tokens.
    pub step_offset: usize,
    /// The item's whole embedding sequence `[rows, hidden]` (shared, not copied).
    pub embeddings: Arc<Array2<f32>>,
    /// Which rows of `embeddings` go to `step_offset..step_offset + rows.len()`.
    pub rows: Range<usize>,
    /// The item's DeepStack levels, if any: the same `rows` of each level are
    /// added after the matching decoder layer.
    pub deepstack: Option<DeepStack>,
}

/// Copy one whole KV block (all layers' K/V and hidden pages) before the step
/// runs: copy-on-write for a match that ends inside a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: BlockId,
    pub dst: BlockId,
}

/// One sequence's share of a step (varlen batching).
#[derive(Debug, Clone)]
pub struct ScheduledSeq {
    pub request: RequestId,
    /// Blocks holding this sequence's KV in position order, cached prefix first;
    /// covers at least `num_computed_tokens + token_ids.len()` positions. The
    /// new positions' pool slots are [`ScheduledSeq::slots`].
    pub block_table: BlockTable,
    /// Positions whose KV is already in pages (cached prefix and earlier chunks).
    pub num_computed_tokens: usize,
    /// Token ids of the new positions (placeholder ids where `embeds` applies).
    pub token_ids: Vec<u32>,
    /// Item embeddings replacing the token embeddings at some new positions.
    pub embeds: Vec<EmbedRows>,
    /// Position ids of the new positions (stored by run; the runner
    /// materialises them for the step).
    pub positions: Positions,
    /// Length of the sequence as known now: the prompt plus the generated
    /// tokens appended so far.
    pub seq_len: usize,
    /// True on a step that ends at `seq_len`: the runner returns the hidden
    /// rows from `output_from` and the last position's logits (to sample from).
    pub emits_output: bool,
    /// First position whose hidden rows the step returns when it emits:
    /// 0 for a prompt's first output (cached rows come from the hidden
    /// pages), the new position for a decode step; rows handed out before a
    /// preemption are not handed out again.
    pub output_from: usize,
}

impl ScheduledSeq {
    /// Prompt positions of the new tokens.
    pub fn new_positions(&self) -> Range<usize> {
        self.num_computed_tokens..self.num_computed_tokens + self.token_ids.len()
    }

    /// Pool slot (`block * block_size + offset`) of each new position.
    pub fn slots(&self) -> Vec<i64> {
        self.block_table.slots(self.new_positions())
    }
}

/// Everything the runner executes in one step.
#[derive(Debug, Clone, Default)]
pub struct ScheduledBatch {
    /// Block copies to perform before any sequence runs.
    pub copies: Vec<BlockCopy>,
    pub seqs: Vec<ScheduledSeq>,
}

impl ScheduledBatch {
    /// Total number of new tokens across sequences.
    pub fn num_new_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.token_ids.len()).sum()
    }
}

/// What a model accepts: the rules admission checks every request against and
/// the runner checks hand-built batches against, written once.
///
/// ```
/// use omniprefix::batch::ModelShape;
/// use omniprefix::model::Config;
/// let shape = ModelShape::of(&Config::tiny_qwen3(32, 2, 4, 2, 50));
/// assert_eq!((shape.vocab_size, shape.hidden_size, shape.num_layers), (50, 32, 2));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelShape {
    /// Token ids must be below this.
    pub vocab_size: usize,
    /// Width of every embedding and DeepStack row.
    pub hidden_size: usize,
    /// Decoder layers: at most one DeepStack level each.
    pub num_layers: usize,
    /// DeepStack levels the checkpoint's vision encoder produces, when it names them.
    pub deepstack_levels: Option<usize>,
}

impl ModelShape {
    /// The shape of the model `config` describes.
    pub fn of(config: &Config) -> Self {
        ModelShape {
            vocab_size: config.vocab_size,
            hidden_size: config.hidden_size,
            num_layers: config.num_hidden_layers,
            deepstack_levels: config.deepstack_levels,
        }
    }

    /// Why an item with `found` DeepStack levels does not fit the model:
    /// (what, expected). Level `i` is added after decoder layer `i`, so an
    /// item carries at most one level per layer ([`Self::layer_violation`]),
    /// and exactly as many as the checkpoint's vision encoder produces when
    /// its config names them (what a request must bring).
    pub(crate) fn deepstack_count_violation(&self, found: usize) -> Option<(&'static str, usize)> {
        match self.deepstack_levels {
            Some(n) if found != n => {
                Some(("number of levels (the checkpoint's deepstack_visual_indexes)", n))
            }
            _ => self.layer_violation(found),
        }
    }

    /// Why `found` DeepStack levels cannot run on the decoder at all: more
    /// levels than layers (all a hand-built batch must meet; the decoder adds
    /// any count up to its layers).
    pub(crate) fn layer_violation(&self, found: usize) -> Option<(&'static str, usize)> {
        (found > self.num_layers)
            .then_some(("number of levels (at most one per decoder layer)", self.num_layers))
    }
}

/// A DeepStack level whose shape differs from its item's embeddings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LevelMismatch {
    pub(crate) level: usize,
    /// `"rows"` or `"columns"`.
    pub(crate) what: &'static str,
    pub(crate) expected: usize,
    pub(crate) found: usize,
}

impl LevelMismatch {
    /// The first of `levels` that is not `[rows, cols]` (`cols: None` when the width is unknown).
    pub(crate) fn first(levels: &[Array2<f32>], rows: usize, cols: Option<usize>) -> Option<LevelMismatch> {
        levels.iter().enumerate().find_map(|(level, l)| {
            if l.nrows() != rows {
                return Some(LevelMismatch { level, what: "rows", expected: rows, found: l.nrows() });
            }
            let cols = cols.filter(|&c| c != l.ncols())?;
            Some(LevelMismatch { level, what: "columns", expected: cols, found: l.ncols() })
        })
    }
}

/// Prompt positions `range` of a whole prompt's inputs (`token_ids`, item rows
/// `embeds` placed at prompt positions, `positions`) as request `request`'s
/// step over `block_table`, after `range.start` positions are in pages: the
/// one place a chunk is cut, for the scheduler and for hand-built steps alike.
///
/// Errors with [`RequestError::PositionRangeOutOfBounds`] when `range` leaves the prompt.
///
/// ```
/// use omniprefix::batch::chunk;
/// use omniprefix::kv::BlockTable;
/// use omniprefix::prompt::Positions;
///
/// let ids = [5, 6, 7, 8, 9];
/// let seq = chunk(1, &ids, &[], &Positions::linear(5), BlockTable::new(vec![3, 0], 4), 2..5)?;
/// assert_eq!((seq.num_computed_tokens, seq.token_ids.as_slice()), (2, &[7, 8, 9][..]));
/// assert_eq!(seq.slots(), vec![14, 15, 0]);
/// assert!(seq.emits_output);
/// # Ok::<(), omniprefix::Error>(())
/// ```
pub fn chunk(
    request: RequestId, token_ids: &[u32], embeds: &[EmbedRows], positions: &Positions,
    block_table: BlockTable, range: Range<usize>,
) -> Result<ScheduledSeq> {
    let len = token_ids.len();
    let out_of_bounds = || RequestError::PositionRangeOutOfBounds { start: range.start, end: range.end, len };
    let ids = token_ids.get(range.clone()).ok_or_else(out_of_bounds)?;
    let positions = positions.slice(range.clone())?;
    Ok(ScheduledSeq {
        request,
        block_table,
        num_computed_tokens: range.start,
        token_ids: ids.to_vec(),
        embeds: clip_embeds(embeds, range.clone()),
        positions,
        seq_len: len,
        emits_output: range.end == len,
        output_from: 0,
    })
}

/// The rows of `embeds` (placed at prompt positions) that fall in `range`, with
/// offsets relative to the range: the one place item rows are clipped to a chunk.
/// A chunk that starts inside an item takes that item's rows (and DeepStack
/// rows, sliced by the same `rows`) from where the chunk starts.
pub fn clip_embeds(embeds: &[EmbedRows], range: Range<usize>) -> Vec<EmbedRows> {
    embeds
        .iter()
        .filter_map(|e| {
            let (start, end) = (e.step_offset, e.step_offset + e.rows.len());
            let (lo, hi) = (start.max(range.start), end.min(range.end));
            (lo < hi).then(|| EmbedRows {
                step_offset: lo - range.start,
                embeddings: Arc::clone(&e.embeddings),
                rows: e.rows.start + (lo - start)..e.rows.start + (hi - start),
                deepstack: e.deepstack.clone(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    #[test]
    fn embeds_are_clipped_to_the_chunk() {
        let emb = Arc::new(Array2::<f32>::zeros((6, 2)));
        let levels: DeepStack = Arc::new(vec![Array2::zeros((6, 2))]);
        // Item rows 0..4 at positions 3..7, rows 4..6 at 7..9 (an interleaved split).
        let rows = |step_offset, rows| EmbedRows {
            step_offset,
            embeddings: Arc::clone(&emb),
            rows,
            deepstack: Some(Arc::clone(&levels)),
        };
        let got = clip_embeds(&[rows(3, 0..4), rows(7, 4..6)], 5..8);
        let placed: Vec<_> = got.iter().map(|e| (e.step_offset, e.rows.clone())).collect();
        assert_eq!(placed, vec![(0, 2..4), (2, 4..5)]);
        assert!(got.iter().all(|e| e.deepstack.as_ref().is_some_and(|d| Arc::ptr_eq(d, &levels))));
    }

    #[test]
    fn chunks_keep_the_delta_and_reject_ranges_past_the_prompt() {
        let positions = Positions::given(vec![[0, 0, 0], [1, 1, 2], [2, 1, 2]], -3);
        let table = BlockTable::new(vec![0], 4);
        let seq = chunk(1, &[4, 5, 6], &[], &positions, table.clone(), 1..3).unwrap();
        assert_eq!(seq.positions, Positions::given(vec![[1, 1, 2], [2, 1, 2]], -3));
        assert!(matches!(
            chunk(1, &[4, 5, 6], &[], &positions, table, 1..4),
            Err(Error::Request(RequestError::PositionRangeOutOfBounds { start: 1, end: 4, len: 3 }))
        ));
    }
}
