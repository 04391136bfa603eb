//! What a scheduler is sized by, and what it counts.

/// Prefill tokens a step that carries decode tokens may add. It bounds how long
/// a decode waits behind prompts, which are then chunked across steps; each step
/// still gives the prompt at the head of the queue up to this many tokens, so new
/// requests keep moving. With a cap below the budget a step prefills at most one
/// prompt that has more than the cap left among requests that will decode (shorter
/// ones and prefill-only requests pack beside it), so a burst of long generations
/// is started one by one rather than all in one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillCap {
    /// A thirty-second of `max_tokens_per_step`, at least 1: 64 of the default
    /// 2048 (`scripts/prefill_policy.sh` measured 32, 64 and 128).
    #[default]
    Auto,
    /// This many tokens: positive, and at most `max_tokens_per_step`.
    Tokens(usize),
    /// No cap: a step's whole budget may go to prompts.
    Off,
}

/// Sizes and switches of a scheduler (and of an engine's, which holds one).
///
/// ```
/// use omniprefix::sched::{PrefillCap, SchedulerConfig};
/// let config = SchedulerConfig { block_size: 4, max_tokens_per_step: 512, ..Default::default() };
/// assert_eq!((config.num_blocks, config.prefill_cap), (1024, PrefillCap::Auto));
/// assert_eq!(config.prefill_cap_tokens(), Some(16));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SchedulerConfig {
    /// Blocks in the KV pool (default 1024).
    pub num_blocks: usize,
    /// Tokens per block (default 16); must equal the index's.
    pub block_size: usize,
    /// Chunked-prefill budget: new tokens per step across all sequences (default 2048).
    pub max_tokens_per_step: usize,
    /// Sequences per step (default 8).
    pub max_seqs_per_step: usize,
    /// Prefill tokens a step that carries decode tokens may add (default
    /// [`PrefillCap::Auto`]).
    #[serde(default)]
    pub prefill_cap: PrefillCap,
    /// Reuse a match that ends inside a block by copying that block
    /// (copy-on-write) instead of recomputing the whole block (default on).
    pub token_granular_reuse: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            num_blocks: 1024,
            block_size: crate::kv::DEFAULT_BLOCK_SIZE,
            max_tokens_per_step: 2048,
            max_seqs_per_step: 8,
            prefill_cap: PrefillCap::Auto,
            token_granular_reuse: true,
        }
    }
}

impl SchedulerConfig {
    /// The cap in tokens ([`PrefillCap`] resolved against the budget); `None`: uncapped.
    pub fn prefill_cap_tokens(&self) -> Option<usize> {
        match self.prefill_cap {
            PrefillCap::Auto => Some((self.max_tokens_per_step / 32).max(1)),
            PrefillCap::Tokens(cap) => Some(cap),
            PrefillCap::Off => None,
        }
    }

    /// How many prompts with more than the prefill cap's tokens left, of requests
    /// that will decode, one step may prefill (see [`Scheduler::schedule`](super::Scheduler::schedule)): 1 under
    /// a cap below the budget, `None` (no limit) uncapped.
    ///
    /// ```
    /// use omniprefix::sched::{PrefillCap, SchedulerConfig};
    /// let config = SchedulerConfig { prefill_cap: PrefillCap::Tokens(64), ..Default::default() };
    /// assert_eq!(config.long_prefills_per_step(), Some(1));
    /// assert_eq!(SchedulerConfig { prefill_cap: PrefillCap::Tokens(2048), ..config }.long_prefills_per_step(), None);
    /// assert_eq!(SchedulerConfig { prefill_cap: PrefillCap::Off, ..config }.long_prefills_per_step(), None);
    /// ```
    pub fn long_prefills_per_step(&self) -> Option<usize> {
        self.prefill_cap_tokens().filter(|&cap| cap < self.max_tokens_per_step).map(|_| 1)
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
    /// Requests admitted and queued, not started (or sent back by a preemption).
    pub waiting: usize,
    /// Requests admitted and not waiting: scheduled to run, or ready or parked
    /// between two steps (vLLM's `num_requests_running`; the metrics' gauge).
    pub running: usize,
}
