//! The contract between the scheduler and the runner: what to run this step.
//!
//! The scheduler fills it from the cache state it owns; the runner executes it
//! and never imports the scheduler, the index or the pool.

use std::ops::Range;
use std::sync::Arc;

use ndarray::Array2;

use crate::index::BlockId;
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
    /// covers at least `num_computed_tokens + token_ids.len()` positions.
    pub block_table: Vec<BlockId>,
    /// Positions whose KV is already in pages (cached prefix and earlier chunks).
    pub num_computed_tokens: usize,
    /// Token ids of the new positions (placeholder ids where `embeds` applies).
    pub token_ids: Vec<u32>,
    /// Item embeddings replacing the token embeddings at some new positions.
    pub embeds: Vec<EmbedRows>,
    /// Position ids of the new positions.
    pub positions: Positions,
    /// Pool slot (`block * block_size + offset`) of each new position.
    pub slot_mapping: Vec<i64>,
    /// Length of the whole prompt.
    pub prompt_len: usize,
    /// True on the step that completes the prompt: the runner returns outputs then.
    pub emits_output: bool,
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
