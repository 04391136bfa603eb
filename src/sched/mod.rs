//! The scheduler: the one owner of all cache state (prefix index + block pool).
//!
//! Lifecycle of a request (a *sequence*: its prompt, then the tokens it
//! generates): [`Scheduler::admit`] checks it (every check, once, in
//! `admission`) and queues it; [`Scheduler::schedule`] matches its prefix the
//! first time it is picked (so it sees everything cached by then), pins the
//! match, allocates blocks for a chunk within the step's token budget and
//! emits a [`ScheduledBatch`](crate::batch::ScheduledBatch); [`Scheduler::complete`] advances it after the
//! runner ran the batch, commits its newly full blocks into the index and
//! reports it *ready* once every known token ran. A ready sequence either
//! grows by the token sampled from its last logits ([`Scheduler::append`]:
//! it decodes, one token per step) or ends ([`Scheduler::finish`], which also
//! caches its last, partly filled block); [`Scheduler::abort`] drops it at any
//! point.
//!
//! One token budget per step, as in vLLM V1's unified scheduler: decode
//! tokens of running sequences first, then their prefill chunks, then waiting
//! requests. A step that carries decode tokens adds at most
//! `SchedulerConfig::prefill_cap` prefill tokens, so a long prompt is chunked
//! across steps instead of stalling every decode behind it (vLLM's
//! `long_prefill_token_threshold`, SGLang's mixed chunks). With a cap a step
//! also prefills at most one prompt longer than the cap among requests that
//! will decode, so prompts that arrive together start one after another and
//! their replies do not finish in lockstep (vLLM's
//! `max_long_partial_prefills = 1`); prefill-only requests still pack.
//!
//! Blocks are never lost: a request's block table is a prefix of index-owned
//! blocks (pinned by one index lock) followed by private pool blocks. Only
//! blocks whose KV was written enter the index: full ones as soon as they
//! fill, the partly filled last one when the sequence finishes, so an aborted
//! request leaves no partial block behind and a follow-up that re-sends the
//! prompt and the reply reuses every position that ran.
//!
//! Several batches out: `schedule` may be called again before the last batch
//! completes. A copy-on-write source stays pinned until the batch holding its
//! copy completes, so the completion of an earlier batch (or a finish) may
//! want to cache positions that grow that pinned, partly filled block, which
//! the index refuses. That commit is then deferred, not failed: the blocks stay
//! the request's own and are committed at its next completion or its finish,
//! if the pin is gone by then (a finish that still meets it leaves those
//! positions uncached).
//!
//! Progress: when the free list runs dry the scheduler evicts unlocked index
//! entries, then *parks* ready sequences that wait for their next token (the
//! newest first: its last block is cached as at a finish and its blocks are
//! released; `append` queues it to recompute), then preempts
//! (recompute-style) the newest running requests, so the oldest one always
//! progresses and a sequence nobody appends to cannot starve the others. A preempted sequence resumes by recomputing
//! its prompt and generated tokens, reusing whatever of them is still cached. An index may pin more than a match reports
//! (the radix tree locks whole nodes), so a request that finds itself alone
//! and still short restarts, and a request that cannot start while nothing
//! runs starts without reuse and takes all its blocks at once: any prompt of
//! at most `num_blocks` blocks finishes.

mod admission;
mod check;
mod commit;
mod config;
mod events;
mod lifecycle;
mod request;
mod step;
mod talker;
mod talker_tier;
mod tier;

use std::collections::VecDeque;
use std::sync::Arc;

use fxhash::{FxHashMap, FxHashSet};

use crate::batch::{EmbedRows, RequestId};
use crate::error::{Component, ConfigError, InvariantViolation, Result, SchedError};
use crate::events::{KvEvent, Medium};
use crate::index::block_hash::FleetHasher;
use crate::index::{IndexStats, PrefixIndex, PrefixMatch};
use crate::kv::{BlockId, BlockPool, BlockTable};
use events::EventLog;

pub use admission::{Checked, RequestChecks};

pub use config::{PrefillCap, SchedulerConfig, SchedulerStats};
pub use request::Request;
pub use talker::{
    TALKER_KEY_PARAM, TalkerCache, TalkerCacheConfig, TalkerCacheStats, TalkerSlot, talker_key,
};
pub use tier::{TierTokens, TierWork};

/// The scheduler's prefix index answered against the [`PrefixIndex`]
/// contract (a bug in that index): the scheduler stops rather than hand out
/// blocks it cannot account for.
fn index_broke(what: String) -> InvariantViolation {
    Component::Scheduler.violation(format!("the prefix index broke its contract: {what}"))
}

/// What a driver reports when requests are pending and runnable but
/// [`Scheduler::schedule`] emitted an empty step: admission guarantees that
/// every request alone fits the pool, so this is a bug in the scheduler.
pub fn stalled(pending: usize) -> InvariantViolation {
    Component::Scheduler
        .violation(format!("{pending} request(s) pending but the scheduler emitted an empty step"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Waiting,
    Running,
    /// Every known token ran; blocks held until [`Scheduler::append`] (it
    /// decodes on) or [`Scheduler::finish`].
    Ready,
    /// Ready, but its blocks were taken back for another request while it
    /// waited for its next token (a served stream nobody reads): `append`
    /// queues it to recompute, reusing what is still cached.
    Parked,
}

/// A request and the cache state it holds.
#[derive(Debug)]
struct Tracked {
    req: Request,
    /// The item rows at their prompt positions (chunks clip theirs from these).
    embeds: Vec<EmbedRows>,
    phase: Phase,
    /// `[..num_shared]` index-owned (pinned by `lock`), the rest private pool blocks.
    block_table: BlockTable,
    num_shared: usize,
    num_computed: usize,
    /// Leading tokens reused from the cache by the current run (0 after a restart until rematched).
    num_cached: usize,
    /// Length of the prompt; `req.prompt` grows past it by generated tokens.
    prompt_len: usize,
    /// New tokens of the batch handed out and not yet completed.
    in_flight: Option<usize>,
    lock: Option<PrefixMatch>,
    /// Positions whose hidden rows were handed out (a resumed sequence does
    /// not hand them out again).
    delivered: usize,
    /// Admission order: running sequences are kept sorted by it (oldest first).
    arrival: u64,
    /// Block hashes of the sequence's first blocks, computed once for KV events.
    block_hashes: Vec<u64>,
}

/// Admits requests, matches their prefixes and builds the batches the runner executes.
///
/// ```
/// use omniprefix::index::radix::{RadixConfig, RadixIndex};
/// use omniprefix::prompt::CanonicalPrompt;
/// use omniprefix::sched::{PrefillCap, Request, Scheduler, SchedulerConfig};
///
/// let text = |id, ids: Vec<u32>| Request::new(id, CanonicalPrompt::text(0, ids));
/// let config = SchedulerConfig {
///     num_blocks: 8,
///     block_size: 4,
///     max_tokens_per_step: 6,
///     max_seqs_per_step: 2,
///     prefill_cap: PrefillCap::Off,
///     token_granular_reuse: true,
/// };
/// let index = RadixIndex::new(RadixConfig { block_size: 4 })?;
/// let mut sched = Scheduler::new(config, Box::new(index))?;
/// sched.admit(text(1, (0..10).collect()))?;
/// loop {
///     let batch = sched.schedule()?;
///     if batch.seqs.is_empty() {
///         break;
///     }
///     // ... the runner executes `batch` here ...
///     for id in sched.complete(&batch)? {
///         sched.finish(id)?; // after reading its outputs
///     }
/// }
/// // All 10 positions are cached now: two full blocks and, since `finish`,
/// // the partly filled third (a later match copies it on write).
/// sched.admit(text(2, vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 99]))?;
/// let batch = sched.schedule()?;
/// assert_eq!(batch.seqs[0].num_computed_tokens, 9);
/// assert_eq!(batch.copies.len(), 1);
/// sched.validate().map_err(omniprefix::Error::from)?;
/// # Ok::<(), omniprefix::Error>(())
/// ```
pub struct Scheduler {
    config: SchedulerConfig,
    index: Box<dyn PrefixIndex>,
    pool: BlockPool,
    requests: FxHashMap<RequestId, Tracked>,
    waiting: VecDeque<RequestId>,
    /// Running requests, oldest first.
    running: Vec<RequestId>,
    /// Requests aborted while a batch holding them was out; `complete` skips them.
    aborted_in_flight: FxHashSet<RequestId>,
    /// The request checks, shared with whoever else runs them (an engine's preparation).
    admission: Arc<RequestChecks>,
    arrivals: u64,
    stats: SchedulerStats,
    /// KV events, when asked for ([`Scheduler::with_kv_events`]); kept for a tier too (its block hashes).
    events: Option<EventLog>,
    /// The disk tier, when the engine has one ([`Scheduler::with_tier`]).
    tier: Option<tier::SchedTier>,
}

impl Scheduler {
    /// A scheduler over `index` with an empty pool of `config.num_blocks` blocks.
    pub fn new(config: SchedulerConfig, index: Box<dyn PrefixIndex>) -> Result<Self> {
        let positive = |field, value| ConfigError::require_positive("scheduler", field, value);
        positive("block_size", config.block_size)?;
        positive("max_tokens_per_step", config.max_tokens_per_step)?;
        positive("max_seqs_per_step", config.max_seqs_per_step)?;
        if let Some(cap) = config.prefill_cap_tokens() {
            positive("prefill_cap", cap)?;
            if cap > config.max_tokens_per_step {
                return Err(ConfigError::Invalid {
                    component: "scheduler",
                    field: "prefill_cap",
                    expected: format!("at most max_tokens_per_step ({})", config.max_tokens_per_step),
                    found: cap.to_string(),
                }
                .into());
            }
        }
        ConfigError::require_index_block_size("scheduler", config.block_size, index.block_size())?;
        Ok(Self {
            pool: BlockPool::new(config.num_blocks)?,
            config,
            index,
            requests: FxHashMap::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            aborted_in_flight: FxHashSet::default(),
            admission: Arc::default(),
            arrivals: 0,
            stats: SchedulerStats::default(),
            events: None,
            tier: None,
        })
    }

    /// Records KV events ([`take_kv_events`](Self::take_kv_events)): a
    /// `BlockStored` for every full block the index adopts, hashed by `hasher`
    /// (the fleet key's [`FleetHasher`]), a `BlockRemoved` when it leaves.
    /// `medium` says where the pages live.
    pub fn with_kv_events(mut self, hasher: FleetHasher, medium: Medium) -> Self {
        let mut log = EventLog::new(hasher, medium);
        if self.tier.is_some() {
            // Given in either order, a tier's blocks are published on DISK too.
            log.keep_for_disk();
        }
        self.events = Some(log);
        self
    }

    /// The KV events recorded since the last call (none unless
    /// [`with_kv_events`](Self::with_kv_events)); the engine publishes them once per step.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.note_tier_departures();
        self.events.as_mut().map(EventLog::take).unwrap_or_default()
    }

    /// The hashes of the published blocks the index holds now, ascending:
    /// what a consumer of the events must have rebuilt.
    pub fn cached_block_hashes(&self) -> Vec<u64> {
        let mut hashes: Vec<u64> =
            self.events.as_ref().map_or_else(Vec::new, |e| e.published().map(|(_, h)| h).collect());
        hashes.sort_unstable();
        hashes
    }

    /// Admits only requests that pass `checks` ([`RequestChecks`]: the model's
    /// vocabulary, widths and DeepStack levels, its context, the known tenants);
    /// the default checks only self-consistency. An engine hands its scheduler
    /// the same checks its preparation runs, so both read one set of rules.
    pub fn with_checks(mut self, checks: Arc<RequestChecks>) -> Self {
        self.admission = checks;
        self
    }

    /// The checks admission runs.
    pub fn checks(&self) -> &RequestChecks {
        &self.admission
    }

    /// The configuration in force.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The block table of an admitted request (empty while it waits).
    pub fn block_table(&self, id: RequestId) -> Option<&[BlockId]> {
        self.requests.get(&id).map(|t| t.block_table.blocks())
    }

    /// Tokens of a request whose KV is in pages (cached prefix included).
    pub fn num_computed_tokens(&self, id: RequestId) -> Option<usize> {
        self.requests.get(&id).map(|t| t.num_computed)
    }

    /// The tokens a sequence grew by ([`append`](Self::append)), in order: the
    /// one record of a generation's reply.
    pub fn generated_tokens(&self, id: RequestId) -> Option<&[u32]> {
        self.requests.get(&id).and_then(|t| t.req.prompt.token_ids.get(t.prompt_len..))
    }

    /// Leading tokens of a request whose KV came from the cache in its current
    /// run (a preempted request is matched again when it restarts).
    pub fn num_cached_tokens(&self, id: RequestId) -> Option<usize> {
        self.requests.get(&id).map(|t| t.num_cached)
    }

    /// Counters and occupancy.
    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            blocks_free: self.pool.num_free(),
            blocks_in_use: self.pool.num_in_use(),
            blocks_cached: self.pool.num_indexed(),
            waiting: self.waiting.len(),
            running: self.requests.len() - self.waiting.len(),
            ..self.stats.clone()
        }
    }

    /// The prefix index's own counters.
    pub fn index_stats(&self) -> IndexStats {
        self.index.stats()
    }

    fn tracked_mut(&mut self, id: RequestId) -> Result<&mut Tracked> {
        self.requests.get_mut(&id).ok_or(SchedError::UnknownRequest { id }.into())
    }
}
