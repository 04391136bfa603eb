//! What a scheduler is sized by, and what it counts.

/// Sizes and switches of a scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SchedulerConfig {
    /// Blocks in the KV pool.
    pub num_blocks: usize,
    /// Tokens per block; must equal the index's.
    pub block_size: usize,
    /// Chunked-prefill budget: new tokens per step across all sequences.
    pub max_tokens_per_step: usize,
    /// Sequences per step.
    pub max_seqs_per_step: usize,
    /// Prefill tokens a step that carries decode tokens may add (`None`: the
    /// rest of the budget). Bounds how long a decode waits behind prompts,
    /// which are then chunked across steps; each step still gives the prompt
    /// at the head of the queue up to this many tokens, so new requests keep
    /// moving. With a cap a step prefills at most one prompt that has more
    /// than this many tokens left among requests that will decode (shorter
    /// ones and prefill-only requests pack beside it), so a burst of long
    /// generations is started one by one rather than all in one step.
    /// Must be positive and at most `max_tokens_per_step`.
    #[serde(default)]
    pub prefill_cap: Option<usize>,
    /// Reuse a match that ends inside a block by copying that block
    /// (copy-on-write) instead of recomputing the whole block.
    pub token_granular_reuse: bool,
}

impl SchedulerConfig {
    /// How many prompts with more than `prefill_cap` tokens left, of requests
    /// that will decode, one step may prefill (see [`Scheduler::schedule`](super::Scheduler::schedule)): 1 under
    /// a cap below the budget, `None` (no limit) uncapped.
    ///
    /// ```
    /// use omniprefix::sched::SchedulerConfig;
    /// let config = SchedulerConfig { num_blocks: 64, block_size: 16, max_tokens_per_step: 2048, max_seqs_per_step: 8, prefill_cap: Some(64), token_granular_reuse: true };
    /// assert_eq!(config.long_prefills_per_step(), Some(1));
    /// assert_eq!(SchedulerConfig { prefill_cap: Some(2048), ..config }.long_prefills_per_step(), None);
    /// ```
    pub fn long_prefills_per_step(&self) -> Option<usize> {
        self.prefill_cap.filter(|&cap| cap < self.max_tokens_per_step).map(|_| 1)
    }
}

/// Counters and occupancy of a scheduler.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct SchedulerStats {
    /// Requests matched against the index when they started running.
    pub queries: u64,
    /// Prompt tokens of those requests (vLLM's `prefix_cache_queries`).
    pub query_tokens: u64,
    /// Of those, requests that reused at least one cached token.
    pub hits: u64,
    /// Cached tokens reused (not recomputed).
    pub hit_tokens: u64,
    /// Blocks the index gave back under pool pressure.
    pub evicted_blocks: u64,
    /// Running requests sent back to the queue to free blocks.
    pub preemptions: u64,
    /// Copy-on-write block copies emitted.
    pub block_copies: u64,
    pub blocks_free: usize,
    pub blocks_in_use: usize,
    pub blocks_cached: usize,
    pub waiting: usize,
    pub running: usize,
}
