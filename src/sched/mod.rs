//! The scheduler: the one owner of all cache state (prefix index + block pool).
//!
//! Lifecycle of a request (a *sequence*: its prompt, then the tokens it
//! generates): [`Scheduler::admit`] checks it (every check, once, in
//! `admission`) and queues it; [`Scheduler::schedule`] matches its prefix the
//! first time it is picked (so it sees everything cached by then), pins the
//! match, allocates blocks for a chunk within the step's token budget and
//! emits a [`ScheduledBatch`]; [`Scheduler::complete`] advances it after the
//! runner ran the batch, commits its newly full blocks into the index and
//! reports it *ready* once every known token ran. A ready sequence either
//! grows by the token sampled from its last logits ([`Scheduler::append`]:
//! it decodes, one token per step) or ends ([`Scheduler::finish`], which also
//! caches its last, partly filled block); [`Scheduler::abort`] drops it at any
//! point.
//!
//! One token budget per step, as in vLLM V1's unified scheduler: decode
//! tokens of running sequences first, then their prefill chunks, then waiting
//! requests.
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
//! entries, then preempts (recompute-style) the newest running requests, so the
//! oldest one always progresses. A preempted sequence resumes by recomputing
//! its prompt and generated tokens, reusing whatever of them is still cached. An index may pin more than a match reports
//! (the radix tree locks whole nodes), so a request that finds itself alone
//! and still short restarts, and a request that cannot start while nothing
//! runs starts without reuse and takes all its blocks at once: any prompt of
//! at most `num_blocks` blocks finishes.

mod admission;
mod check;
mod config;
mod events;
mod request;

use std::collections::VecDeque;

use fxhash::{FxHashMap, FxHashSet};

use crate::batch::{self, BlockCopy, EmbedRows, ModelShape, RequestId, ScheduledBatch};
use crate::error::{CacheError, ConfigError, Error, RequestError, Result, SchedError};
use crate::events::{KvEvent, Medium};
use crate::index::block_hash::FleetHasher;
use crate::index::{IndexStats, PrefixIndex, PrefixMatch};
use crate::kv::{BlockId, BlockPool, BlockState, BlockTable};
use crate::prompt::{TenantSalt, out_of_vocab};
use admission::PoolLimits;
use events::EventLog;

pub use admission::{Checked, RequestChecks};

pub use config::{SchedulerConfig, SchedulerStats};
pub use request::Request;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Waiting,
    Running,
    /// Every known token ran; blocks held until [`Scheduler::append`] (it
    /// decodes on) or [`Scheduler::finish`].
    Ready,
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
/// use omniprefix::prompt::{Atom, CanonicalPrompt, IndexMap, Positions};
/// use omniprefix::sched::{Request, Scheduler, SchedulerConfig};
///
/// let text = |id, ids: Vec<u32>| Request {
///     id,
///     prompt: CanonicalPrompt {
///         tenant: 0,
///         atoms: vec![Atom::Text(ids.clone())],
///         positions: Positions::linear(ids.len()),
///         token_ids: ids,
///         items: vec![],
///         index_map: IndexMap::default(),
///     },
///     item_embeddings: vec![],
///     item_deepstack: vec![],
///     hidden_size: None, max_new_tokens: 0,
/// };
/// let config = SchedulerConfig {
///     num_blocks: 8,
///     block_size: 4,
///     max_tokens_per_step: 6,
///     max_seqs_per_step: 2,
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
    admission: RequestChecks,
    arrivals: u64,
    stats: SchedulerStats,
    /// KV events, when asked for ([`Scheduler::with_kv_events`]).
    events: Option<EventLog>,
}

impl Scheduler {
    /// A scheduler over `index` with an empty pool of `config.num_blocks` blocks.
    pub fn new(config: SchedulerConfig, index: Box<dyn PrefixIndex>) -> Result<Self> {
        let positive = |field, value: usize| {
            if value == 0 {
                Err(Error::Config(ConfigError::Invalid {
                    component: "scheduler",
                    field,
                    expected: "positive".into(),
                    found: "0".into(),
                }))
            } else {
                Ok(())
            }
        };
        positive("block_size", config.block_size)?;
        positive("max_tokens_per_step", config.max_tokens_per_step)?;
        positive("max_seqs_per_step", config.max_seqs_per_step)?;
        if config.block_size != index.block_size() {
            return Err(ConfigError::Invalid {
                component: "scheduler",
                field: "block_size",
                expected: format!("the index's block size {}", index.block_size()),
                found: config.block_size.to_string(),
            }.into());
        }
        Ok(Self {
            pool: BlockPool::new(config.num_blocks)?,
            config,
            index,
            requests: FxHashMap::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            aborted_in_flight: FxHashSet::default(),
            admission: RequestChecks::default(),
            arrivals: 0,
            stats: SchedulerStats::default(),
            events: None,
        })
    }

    /// Records KV events ([`take_kv_events`](Self::take_kv_events)): a
    /// `BlockStored` for every full block the index adopts, hashed by `hasher`
    /// (the fleet key's [`FleetHasher`]), a `BlockRemoved` when it leaves.
    /// `medium` says where the pages live.
    pub fn with_kv_events(mut self, hasher: FleetHasher, medium: Medium) -> Self {
        self.events = Some(EventLog::new(hasher, medium));
        self
    }

    /// The KV events recorded since the last call (none unless
    /// [`with_kv_events`](Self::with_kv_events)); the engine publishes them once per step.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(EventLog::take).unwrap_or_default()
    }

    /// The hashes of the published blocks the index holds now, ascending:
    /// what a consumer of the events must have rebuilt.
    pub fn cached_block_hashes(&self) -> Vec<u64> {
        let mut hashes: Vec<u64> = self.events.as_ref().map_or_else(Vec::new, |e| e.published().values().copied().collect());
        hashes.sort_unstable();
        hashes
    }

    /// Drops every cached block (an `AllBlocksCleared` event); refused with
    /// [`SchedError::CacheInUse`], nothing changed, while any request is admitted.
    /// Returns the number of blocks freed.
    pub fn reset_cache(&mut self) -> Result<usize> {
        if !self.requests.is_empty() || !self.aborted_in_flight.is_empty() {
            return Err(SchedError::CacheInUse { requests: self.requests.len() + self.aborted_in_flight.len() }.into());
        }
        let evicted = self.index.evict(usize::MAX);
        self.stats.evicted_blocks += evicted.len() as u64;
        self.free_to_pool(&evicted)?;
        if let Some(log) = self.events.as_mut() {
            log.cleared();
        }
        Ok(evicted.len())
    }

    /// Rejects prompts longer than `max_context` positions (the model's
    /// `max_position_embeddings`) at admission with [`RequestError::ContextTooLong`].
    pub fn with_max_context(mut self, max_context: usize) -> Self {
        self.admission = self.admission.with_max_context(max_context);
        self
    }

    /// Admits only requests the model `shape` can run: token ids (placeholders
    /// included) in its vocabulary, embeddings of its width, DeepStack levels
    /// as many as it takes. The engine sets this, so the batches it hands the
    /// runner need no second check.
    pub fn with_model(mut self, shape: ModelShape) -> Self {
        self.admission = self.admission.with_model(shape);
        self
    }

    /// Makes tenant salts mandatory: only prompts salted with one of `tenants`
    /// are admitted, others get [`RequestError::UnknownTenant`] (a typo'd or forged
    /// salt would otherwise silently open a cache of its own).
    pub fn require_known_tenants(mut self, tenants: impl IntoIterator<Item = TenantSalt>) -> Self {
        self.admission = self.admission.with_known_tenants(tenants);
        self
    }

    /// The configuration in force.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Queues a request after checking it can ever run and every chunk of it
    /// is well-formed for the runner; on error nothing changes.
    pub fn admit(&mut self, req: Request) -> Result<()> {
        let checked = self.admission.check(req)?;
        self.admit_checked(checked)
    }

    /// [`admit`](Self::admit) for a request that already passed its
    /// [`RequestChecks`] (an engine runs them while it prepares the request,
    /// off the step loop): only the checks that read the scheduler's state
    /// remain, the id is free and the sequence fits the pool.
    pub fn admit_checked(&mut self, checked: Checked) -> Result<()> {
        let Checked(req) = checked;
        let pool = PoolLimits {
            // An id aborted while its batch is out stays taken until that batch completes.
            id_taken: self.requests.contains_key(&req.id) || self.aborted_in_flight.contains(&req.id),
            num_blocks: self.pool.num_blocks(),
            block_size: self.config.block_size,
        };
        pool.check(&req)?;
        let id = req.id;
        let prompt_len = req.prompt.len();
        let tracked = Tracked {
            embeds: req.placed_embeds(),
            req,
            phase: Phase::Waiting,
            block_table: BlockTable::empty(self.config.block_size),
            num_shared: 0,
            num_computed: 0,
            num_cached: 0,
            prompt_len,
            in_flight: None,
            lock: None,
            delivered: 0,
            arrival: self.arrivals,
            block_hashes: Vec::new(),
        };
        self.arrivals += 1;
        self.requests.insert(id, tracked);
        self.waiting.push_back(id);
        Ok(())
    }

    /// Builds the next step within one token budget: the decode tokens of
    /// running sequences first, then their prefill chunks (both oldest first),
    /// then waiting requests in arrival order. A sequence whose blocks cannot
    /// be found waits; an empty batch means nothing can run now.
    pub fn schedule(&mut self) -> Result<ScheduledBatch> {
        let mut batch = ScheduledBatch::default();
        let mut budget = self.config.max_tokens_per_step;
        let remaining = |t: &Tracked| t.req.prompt.len() - t.num_computed;
        let mut order: Vec<RequestId> = Vec::with_capacity(self.running.len());
        for decode in [true, false] {
            order.extend(self.running.iter().copied().filter(|id| {
                self.requests.get(id).is_some_and(|t| (remaining(t) == 1) == decode)
            }));
        }
        for id in order {
            if budget == 0 || batch.seqs.len() >= self.config.max_seqs_per_step {
                break;
            }
            // An earlier reservation may have preempted it.
            let Some(i) = self.running.iter().position(|&r| r == id) else { continue };
            let t = self.requests.get(&id).ok_or(SchedError::UnknownRequest { id })?;
            if t.in_flight.is_some() {
                continue;
            }
            let chunk = remaining(t).min(budget);
            let need = (t.num_computed + chunk)
                .div_ceil(self.config.block_size)
                .saturating_sub(t.block_table.len());
            if let Some(fresh) = self.reserve(need, Some(i))? {
                self.tracked_mut(id)?.block_table.extend(fresh);
                self.emit(id, chunk, &mut batch)?;
                budget -= chunk;
            }
        }
        while let Some(&id) = self.waiting.front() {
            if budget == 0
                || batch.seqs.len() >= self.config.max_seqs_per_step
                || !self.start(id, budget, &mut batch)?
            {
                break;
            }
            budget -= batch.seqs.last().map_or(0, |s| s.token_ids.len());
        }
        Ok(batch)
    }

    /// Records that the runner executed `batch`: advances each request, commits
    /// its newly full blocks into the index and returns the requests that are
    /// now ready (every known token ran; the runner returned their outputs).
    /// Each must be [`append`](Self::append)ed to or [`finish`](Self::finish)ed
    /// before it runs again. A batch that is not the one handed out is
    /// rejected before anything changes.
    pub fn complete(&mut self, batch: &ScheduledBatch) -> Result<Vec<RequestId>> {
        let mut seen = FxHashSet::default();
        for seq in &batch.seqs {
            let id = seq.request;
            if !seen.insert(id) {
                return Err(SchedError::BatchMismatch {
                    id,
                    what: "occurrences in the batch",
                    expected: 1,
                    found: 2,
                }.into());
            }
            if self.aborted_in_flight.contains(&id) {
                continue;
            }
            let t = self.requests.get(&id).ok_or(SchedError::UnknownRequest { id })?;
            let found = seq.token_ids.len();
            match t.in_flight {
                None => {
                    return Err(SchedError::BatchMismatch {
                        id,
                        what: "new tokens",
                        expected: 0,
                        found,
                    }.into());
                }
                Some(chunk) if chunk != found => {
                    return Err(SchedError::BatchMismatch {
                        id,
                        what: "new tokens",
                        expected: chunk,
                        found,
                    }.into());
                }
                Some(_) if t.num_computed != seq.num_computed_tokens => {
                    return Err(SchedError::BatchMismatch {
                        id,
                        what: "num_computed_tokens",
                        expected: t.num_computed,
                        found: seq.num_computed_tokens,
                    }.into());
                }
                Some(_) => {}
            }
        }
        // The batch's copies ran: copy-on-write sources need no pin any more,
        // so no partly filled cached block is locked when the commits below
        // insert (an insert may extend such a block's leaf).
        for seq in &batch.seqs {
            if !self.aborted_in_flight.contains(&seq.request) {
                self.unpin_copy_source(seq.request)?;
            }
        }
        let mut ready = Vec::new();
        for seq in &batch.seqs {
            let id = seq.request;
            if self.aborted_in_flight.remove(&id) {
                continue;
            }
            let t = self.tracked_mut(id)?;
            t.num_computed += t.in_flight.take().unwrap_or(0);
            let done = t.num_computed == t.req.prompt.len();
            if done {
                t.delivered = t.num_computed;
            }
            self.commit_full_blocks(id)?;
            if done {
                self.tracked_mut(id)?.phase = Phase::Ready;
                self.running.retain(|&r| r != id);
                ready.push(id);
            }
        }
        Ok(ready)
    }

    /// Grows ready sequence `id` by `token` (sampled from its last logits):
    /// it runs in a later step as a decode token, at the next decode position.
    /// Errors, with nothing changed, for a sequence that is not ready, a token
    /// outside the vocabulary, or one beyond the request's `max_new_tokens`.
    pub fn append(&mut self, id: RequestId, token: u32) -> Result<()> {
        let t = self.requests.get(&id).ok_or(SchedError::UnknownRequest { id })?;
        let len = t.req.prompt.len();
        if t.phase != Phase::Ready {
            return Err(SchedError::RequestNotFinished { id, computed: t.num_computed, len }.into());
        }
        let limit = t.prompt_len + t.req.max_new_tokens;
        if len >= limit {
            return Err(RequestError::GenerationLimit { id, max_new_tokens: t.req.max_new_tokens }.into());
        }
        if let Some(model) = self.admission.model()
            && out_of_vocab(&[token], model.vocab_size).is_some()
        {
            let vocab_size = u32::try_from(model.vocab_size).unwrap_or(u32::MAX);
            return Err(RequestError::TokenOutOfVocab { position: len, token, vocab_size }.into());
        }
        let arrival = t.arrival;
        let t = self.tracked_mut(id)?;
        t.req.prompt.push_text(token);
        t.phase = Phase::Running;
        self.enter_running(id, arrival);
        Ok(())
    }

    /// Ends a ready sequence: its last, partly filled block enters the index
    /// (a later match copies it on write), then its locks and blocks are
    /// released (its blocks stay cached).
    pub fn finish(&mut self, id: RequestId) -> Result<()> {
        let t = self.requests.get(&id).ok_or(SchedError::UnknownRequest { id })?;
        if t.phase != Phase::Ready {
            return Err(SchedError::RequestNotFinished {
                id,
                computed: t.num_computed,
                len: t.req.prompt.len(),
            }.into());
        }
        // Full blocks a pinned copy-on-write source held back, if it is gone now.
        self.commit_full_blocks(id)?;
        self.commit_partial_tail(id)?;
        self.remove(id)
    }

    /// Drops a request in any phase; its partly written blocks go back to the
    /// free list, never into the index. A batch already handed out that holds
    /// it may still be completed (its share is ignored).
    pub fn abort(&mut self, id: RequestId) -> Result<()> {
        let t = self.requests.get(&id).ok_or(SchedError::UnknownRequest { id })?;
        if t.in_flight.is_some() {
            self.aborted_in_flight.insert(id);
        }
        self.remove(id)
    }

    /// Gives up to `max_blocks` cached blocks that no request reads back to
    /// the free list (least recently used first), e.g. to shrink the cache
    /// or drop a tenant's data; returns how many were freed. Blocks pinned by
    /// running requests are never taken.
    pub fn evict(&mut self, max_blocks: usize) -> Result<usize> {
        let evicted = self.index.evict(max_blocks);
        self.stats.evicted_blocks += evicted.len() as u64;
        self.reclaim_released(&evicted)?;
        Ok(evicted.len())
    }

    /// The block table of an admitted request (empty while it waits).
    pub fn block_table(&self, id: RequestId) -> Option<&[BlockId]> {
        self.requests.get(&id).map(|t| t.block_table.blocks())
    }

    /// Tokens of a request whose KV is in pages (cached prefix included).
    pub fn num_computed_tokens(&self, id: RequestId) -> Option<usize> {
        self.requests.get(&id).map(|t| t.num_computed)
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
            running: self.running.len(),
            ..self.stats.clone()
        }
    }

    /// The prefix index's own counters.
    pub fn index_stats(&self) -> IndexStats {
        self.index.stats()
    }

    /// Matches a waiting request, pins its cached prefix, allocates its first
    /// chunk and emits it; `false` when blocks are short (it stays queued).
    fn start(&mut self, id: RequestId, budget: usize, batch: &mut ScheduledBatch) -> Result<bool> {
        let bs = self.config.block_size;
        let t = self.requests.get(&id).ok_or(SchedError::UnknownRequest { id })?;
        let len = t.req.prompt.len();
        let m = self.index.match_prefix(&t.req.prompt);
        if m.tokens > len
            || m.blocks.len() != m.tokens.div_ceil(bs)
            || m.aligned_tokens != m.tokens / bs * bs
        {
            return Err(CacheError::InconsistentMatch {
                tokens: m.tokens,
                aligned_tokens: m.aligned_tokens,
                blocks: m.blocks.len(),
                prompt_len: len,
            }
            .into());
        }
        // At least the last token runs, so a fully cached prompt still yields outputs.
        let usable = m.tokens.min(len - 1);
        let mut computed = if self.config.token_granular_reuse {
            usable
        } else {
            usable / bs * bs
        };
        // Pin before evicting so eviction cannot take what was just matched.
        let mut lock = (computed > 0).then(|| pinned_part(m, computed, bs));
        if let Some(m) = &lock {
            self.index.lock(m);
        }
        let mut whole_prompt = false;
        let fresh = loop {
            let upto = if whole_prompt {
                len
            } else {
                computed + (len - computed).min(budget)
            };
            if let Some(fresh) = self.reserve(upto.div_ceil(bs) - computed / bs, None)? {
                break fresh;
            }
            let Some(m) = lock.take() else {
                return Ok(false);
            };
            self.index.unlock(&m);
            // An index may pin more than the match (a whole tree node). When
            // nothing else runs, start without reuse and take every block the
            // prompt needs now, so later locks cannot starve it.
            if !self.running.is_empty() {
                return Ok(false);
            }
            computed = 0;
            whole_prompt = true;
        };
        let shared = computed / bs;
        let chunk = (len - computed).min(budget);
        let copy_src = lock
            .as_ref()
            .filter(|_| computed % bs != 0)
            .and_then(|m| m.blocks.get(shared).copied());
        if let (Some(src), Some(&dst)) = (copy_src, fresh.first()) {
            batch.copies.push(BlockCopy { src, dst });
            self.stats.block_copies += 1;
        }
        self.stats.queries += 1;
        if computed > 0 {
            self.stats.hits += 1;
            self.stats.hit_tokens += computed as u64;
        }
        let t = self.tracked_mut(id)?;
        t.block_table = BlockTable::new(lock.as_ref().map_or(&[][..], |m| &m.blocks[..shared]).to_vec(), bs);
        t.block_table.extend(fresh);
        t.num_shared = shared;
        t.num_computed = computed;
        t.num_cached = computed;
        t.lock = lock;
        t.phase = Phase::Running;
        let arrival = t.arrival;
        self.waiting.pop_front();
        self.enter_running(id, arrival);
        self.emit(id, chunk, batch)?;
        Ok(true)
    }

    /// Puts `id` into the running list at its admission order (oldest first:
    /// preemption takes the newest, so a resumed old sequence keeps its rank).
    fn enter_running(&mut self, id: RequestId, arrival: u64) {
        let requests = &self.requests;
        let at = self.running.partition_point(|r| requests.get(r).is_some_and(|t| t.arrival < arrival));
        self.running.insert(at, id);
    }

    /// Appends request `id`'s next `chunk` tokens to the batch (blocks already
    /// allocated), cut by [`batch::chunk`] like every step.
    fn emit(&mut self, id: RequestId, chunk: usize, batch: &mut ScheduledBatch) -> Result<()> {
        let t = self.tracked_mut(id)?;
        let range = t.num_computed..t.num_computed + chunk;
        let prompt = &t.req.prompt;
        let mut seq = batch::chunk(id, &prompt.token_ids, &t.embeds, &prompt.positions, t.block_table.clone(), range)?;
        seq.output_from = t.delivered;
        batch.seqs.push(seq);
        t.in_flight = Some(chunk);
        Ok(())
    }

    /// Takes `need` blocks from the pool, evicting unlocked index entries and,
    /// when `preempt_after` is given, preempting running requests newer than
    /// that position. `None` when the blocks cannot be found now.
    fn reserve(
        &mut self,
        need: usize,
        preempt_after: Option<usize>,
    ) -> Result<Option<Vec<BlockId>>> {
        loop {
            while self.pool.num_free() < need {
                if self.evict(need - self.pool.num_free())? == 0 {
                    break;
                }
            }
            if let Some(fresh) = self.pool.allocate(need) {
                return Ok(Some(fresh));
            }
            let Some(after) = preempt_after else {
                return Ok(None);
            };
            let newer = self
                .running
                .iter()
                .enumerate()
                .rev()
                .find(|&(j, id)| {
                    j > after && self.requests.get(id).is_some_and(|t| t.in_flight.is_none())
                })
                .map(|(j, _)| j);
            // Alone and still short: its own lock pins more than it reads (an
            // index that locks whole tree nodes). Restarting re-matches, which
            // reuses what it committed and releases the rest.
            let alone = (self.running.len() == 1).then_some(after);
            let Some(j) = newer.or(alone) else {
                return Ok(None);
            };
            let id = self.running.remove(j);
            self.release_cache_state(id)?;
            let t = self.tracked_mut(id)?;
            t.phase = Phase::Waiting;
            t.num_computed = 0;
            t.num_cached = 0;
            self.waiting.push_front(id);
            self.stats.preemptions += 1;
            if j == after {
                return Ok(None);
            }
        }
    }

    /// Inserts the request's full computed blocks into the index and pins
    /// what the insert reports as cached (no second match); blocks the index
    /// already had are swapped for its copies and freed.
    fn commit_full_blocks(&mut self, id: RequestId) -> Result<()> {
        let bs = self.config.block_size;
        let t = self
            .requests
            .get_mut(&id)
            .ok_or(SchedError::UnknownRequest { id })?;
        let n_full = t.num_computed / bs;
        if n_full <= t.num_shared {
            return Ok(());
        }
        let outcome = match self.index.insert(&t.req.prompt, &t.block_table[..n_full]) {
            // Another request's copy-on-write source is in the way; retried
            // at this request's next completion and at its finish.
            Err(e) if grows_pinned_partial_block(&e) => return Ok(()),
            result => result?,
        };
        let m = outcome.cached;
        if m.tokens != n_full * bs || m.aligned_tokens != m.tokens || m.blocks.len() != n_full {
            return Err(CacheError::InsertNotMatched { id, matched: m.aligned_tokens / bs, inserted: n_full }.into());
        }
        let mut adopted_at = Vec::with_capacity(outcome.adopted.len());
        for &b in &outcome.adopted {
            let Some(i) = t.block_table[t.num_shared..n_full].iter().position(|&x| x == b) else {
                return Err(CacheError::AdoptedUnoffered { id, block: b }.into());
            };
            self.pool.adopt_by_index(b)?;
            adopted_at.push((t.num_shared + i, b));
        }
        if let Some(log) = self.events.as_mut() {
            adopted_at.sort_unstable();
            log.stored(&t.req.prompt, bs, &mut t.block_hashes, &adopted_at);
        }
        self.index.lock(&m);
        for i in t.num_shared..n_full {
            let (old, new) = (t.block_table[i], m.blocks[i]);
            if old != new {
                if matches!(self.pool.state(old)?, BlockState::InUse { .. }) {
                    self.pool.release(old)?;
                }
                t.block_table[i] = new;
            }
            if self.pool.state(new)? != BlockState::Indexed {
                return Err(CacheError::MatchedUnownedBlock { block: new }.into());
            }
        }
        if let Some(old) = t.lock.replace(m) {
            self.index.unlock(&old);
        }
        t.num_shared = n_full;
        self.reclaim_released(&outcome.released)
    }

    /// Caches a finishing sequence's last, partly filled block: every
    /// position that ran is then reusable (the full blocks are in already).
    fn commit_partial_tail(&mut self, id: RequestId) -> Result<()> {
        let bs = self.config.block_size;
        let t = self.requests.get_mut(&id).ok_or(SchedError::UnknownRequest { id })?;
        let n = t.num_computed;
        let n_blocks = n.div_ceil(bs);
        if n % bs == 0 || n_blocks <= t.num_shared {
            return Ok(());
        }
        let outcome = match self.index.insert_partial(&t.req.prompt, &t.block_table[..n_blocks], n) {
            // Another request's copy-on-write source is in the way: these
            // positions are not cached (the insert changed nothing).
            Err(e) if grows_pinned_partial_block(&e) => return Ok(()),
            result => result?,
        };
        let tail = t.block_table[n_blocks - 1];
        for &b in &outcome.adopted {
            if b != tail {
                return Err(CacheError::AdoptedUnoffered { id, block: b }.into());
            }
            self.pool.adopt_by_index(b)?;
            // The index owns it now: releasing the request must not free it.
            t.num_shared = n_blocks;
        }
        self.reclaim_released(&outcome.released)
    }

    /// Frees blocks the index gave up (evicted, or a cached partial block
    /// that a longer one superseded; no request reads them) and records the
    /// published ones as removed.
    fn reclaim_released(&mut self, released: &[BlockId]) -> Result<()> {
        self.free_to_pool(released)?;
        if let Some(log) = self.events.as_mut() {
            log.removed(released);
        }
        Ok(())
    }

    /// Returns blocks the index no longer owns to the free list.
    fn free_to_pool(&mut self, blocks: &[BlockId]) -> Result<()> {
        for &b in blocks {
            self.pool.reclaim_evicted(b)?;
        }
        Ok(())
    }

    /// Once a step's copies ran, a request's copy-on-write source needs no
    /// pin: its lock shrinks to the shared blocks (none when it has none).
    fn unpin_copy_source(&mut self, id: RequestId) -> Result<()> {
        let bs = self.config.block_size;
        let t = self.requests.get_mut(&id).ok_or(SchedError::UnknownRequest { id })?;
        if t.lock.as_ref().is_none_or(|m| m.blocks.len() <= t.num_shared) {
            return Ok(());
        }
        let Some(old) = t.lock.take() else { return Ok(()) };
        let kept = (t.num_shared > 0).then(|| pinned_part(old.clone(), t.num_shared * bs, bs));
        if let Some(m) = &kept {
            self.index.lock(m);
        }
        self.index.unlock(&old);
        t.lock = kept;
        Ok(())
    }

    /// Unpins and frees everything a request holds and forgets it.
    fn remove(&mut self, id: RequestId) -> Result<()> {
        self.release_cache_state(id)?;
        self.waiting.retain(|&r| r != id);
        self.running.retain(|&r| r != id);
        self.requests.remove(&id);
        Ok(())
    }

    /// Gives up a request's index lock and private blocks.
    fn release_cache_state(&mut self, id: RequestId) -> Result<()> {
        let t = self
            .requests
            .get_mut(&id)
            .ok_or(SchedError::UnknownRequest { id })?;
        if let Some(m) = t.lock.take() {
            self.index.unlock(&m);
        }
        for &b in &t.block_table[t.num_shared..] {
            self.pool.release(b)?;
        }
        t.block_table.clear();
        t.num_shared = 0;
        Ok(())
    }

    fn tracked_mut(&mut self, id: RequestId) -> Result<&mut Tracked> {
        self.requests
            .get_mut(&id)
            .ok_or(SchedError::UnknownRequest { id }.into())
    }
}

/// Whether an insert failed only because it would grow a cached partly
/// filled block that another request pins as the copy-on-write source of a
/// batch still out (see "Several batches out" in the module docs).
fn grows_pinned_partial_block(e: &Error) -> bool {
    matches!(e, Error::Cache(CacheError::LockedPartialBlock { .. }))
}

/// The part of a match a request actually reads: its first `tokens` tokens.
///
/// An index that locks block by block then pins no more than the request
/// reads (+1 for a copy-on-write source), so restarts stay rare.
fn pinned_part(m: PrefixMatch, tokens: usize, block_size: usize) -> PrefixMatch {
    debug_assert!(tokens <= m.tokens && tokens.div_ceil(block_size) <= m.blocks.len());
    let mut blocks = m.blocks;
    blocks.truncate(tokens.div_ceil(block_size));
    PrefixMatch {
        tokens,
        aligned_tokens: tokens / block_size * block_size,
        blocks,
        handle: m.handle,
    }
}
