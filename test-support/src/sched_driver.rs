//! The scheduler state machine both scheduler suites drive
//! (`proptests/pool_invariants.rs` with a shadow runner, and
//! `proptests/sched_state_machine.rs` with a real tiny model): random admit /
//! schedule / run / complete / append / finish / abort / evict operations,
//! `validate()` after each, the drain that runs every live request to its
//! end, and the checks that no block leaked and no index lock outlived its
//! request. What runs the batches and what is checked about their results is
//! the suite's [`Runner`].
//!
//! A scheduled batch runs later (an explicit `Run`, or before it completes),
//! so evictions and further batches happen between scheduling a batch and
//! running it, as in an engine that builds the next step while the last one
//! runs. Until a batch completes, no later batch may write a block it copies
//! from (its copy-on-write sources stay pinned). Ready sequences grow by
//! `Append` (decode), so reply blocks that fill during decode are committed
//! and published. After each completion the event consumer must hold every
//! full block the completed sequences computed, hashed from the driver's own
//! copy of their tokens (prompt and appended tokens), not from the
//! scheduler's map of what it published.

use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::Range;

use omniprefix::Error;
use omniprefix::batch::{RequestId, ScheduledBatch};
use omniprefix::canon::FingerprintKey;
use omniprefix::error::RequestError;
use omniprefix::events::KvEvent;
use omniprefix::index::block_hash::FleetHasher;
use omniprefix::prompt::{Atom, CanonicalPrompt};
use omniprefix::sched::{PrefillCap, Request, Scheduler, SchedulerConfig};
use proptest::prelude::*;

/// `PROPTEST_CASES` cases (default `default_cases`), no failure files (integration
/// targets have no lib.rs beside them to persist failures next to).
pub fn proptest_config(default_cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases: crate::cases(default_cases),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Pools of `num_blocks` blocks of 2 or 4 tokens, step budgets of
/// `max_tokens_per_step` tokens and 1 to 3 sequences, a prefill cap or none, either
/// reuse granularity.
pub fn scheduler_config(
    num_blocks: Range<usize>, max_tokens_per_step: Range<usize>,
) -> impl Strategy<Value = SchedulerConfig> {
    let cap = prop::option::of(1usize..64);
    (num_blocks, prop_oneof![Just(2usize), Just(4)], max_tokens_per_step, 1usize..4, cap, any::<bool>())
        .prop_map(
            |(num_blocks, block_size, max_tokens_per_step, max_seqs_per_step, cap, token_granular_reuse)| {
                SchedulerConfig {
                    num_blocks,
                    block_size,
                    max_tokens_per_step,
                    max_seqs_per_step,
                    // Any cap from 1 to the budget, the default's, or none.
                    prefill_cap: match cap {
                        Some(c) if c % 8 == 7 => PrefillCap::Auto,
                        Some(c) => PrefillCap::Tokens(1 + c % max_tokens_per_step),
                        None => PrefillCap::Off,
                    },
                    token_granular_reuse,
                }
            },
        )
}

/// New tokens an admitted request may generate (`Append`s it accepts).
pub const MAX_NEW_TOKENS: usize = 4;

#[derive(Debug, Clone)]
pub enum Op {
    /// A prompt made of shared base `base` followed by `tail`, for `tenant`
    /// (what the units mean is the runner's).
    Admit { base: usize, tail: Vec<u32>, tenant: u64 },
    /// Build a batch (run and completed later).
    Schedule,
    /// Run the oldest batch that was scheduled and not run yet.
    Run,
    /// Complete the oldest outstanding batch (running it first if it has not run).
    Complete,
    /// Grow the `k`-th completed (ready) request by the text token of `unit`,
    /// as decode does; past `MAX_NEW_TOKENS` it must be refused.
    Append { k: usize, unit: u32 },
    /// Evict up to `n` unread cached blocks.
    Evict(usize),
    /// Finish the `k`-th completed request.
    Finish(usize),
    /// Abort the `k`-th live request.
    Abort(usize),
}

/// Operations in the proportions both suites use; admitted tails are
/// `tail_len` units long, for a tenant in `tenants`.
pub fn op(
    unit: impl Strategy<Value = u32>, tail_len: Range<usize>, tenants: Range<u64>,
) -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..4, prop::collection::vec(unit, tail_len), tenants)
            .prop_map(|(base, tail, tenant)| Op::Admit { base, tail, tenant }),
        4 => Just(Op::Schedule),
        2 => Just(Op::Run),
        4 => Just(Op::Complete),
        2 => (0usize..8, 0u32..4).prop_map(|(k, unit)| Op::Append { k, unit }),
        2 => (0usize..8).prop_map(Op::Finish),
        1 => (0usize..8).prop_map(Op::Abort),
        1 => (1usize..4).prop_map(Op::Evict),
    ]
}

/// What a suite runs batches on, and what it checks along the way.
pub trait Runner {
    /// What running a batch produced, kept until the batch is completed.
    type Output;
    /// Request `id` of `tenant` over `units`; the runner notes what it needs to know of it.
    fn request(&mut self, id: RequestId, tenant: u64, units: &[u32]) -> Request;
    /// Runs a batch (possibly empty), in scheduling order.
    fn run(&mut self, batch: &ScheduledBatch) -> Result<Self::Output, TestCaseError>;
    /// The text token id an appended `unit` stands for.
    fn token(&self, unit: u32) -> u32 {
        unit
    }
    /// Ready request `id` grew by `token`; `prompt` is its whole sequence now.
    fn appended(&mut self, _id: RequestId, _token: u32, _prompt: &CanonicalPrompt) {}
    /// The batch that produced `output` completed the prompts of `done`.
    fn completed(&mut self, _output: Self::Output, _done: &[RequestId]) -> Result<(), TestCaseError> {
        Ok(())
    }
    /// Request `id` is about to be finished: the place to check what it produced.
    fn finishing(&mut self, _id: RequestId) -> Result<(), TestCaseError> {
        Ok(())
    }
    /// Request `id` was aborted.
    fn aborted(&mut self, _id: RequestId) {}
}

/// The scheduler, the suite's runner and what the test tracks beside them.
pub struct Machine<R: Runner> {
    pub sched: Scheduler,
    pub runner: R,
    /// Batches scheduled but not yet completed, oldest first, with what
    /// running them produced (`None`: not run yet).
    outstanding: VecDeque<(ScheduledBatch, Option<R::Output>)>,
    /// Admitted, neither finished nor aborted.
    live: Vec<RequestId>,
    /// Prompt completed, waiting to be finished.
    completed: Vec<RequestId>,
    next_id: RequestId,
    /// Requests finished so far.
    pub finished: usize,
    /// Every admitted request's whole-prompt positions, materialised.
    positions: HashMap<RequestId, Vec<[i64; 3]>>,
    /// Every admitted request's sequence (prompt and appended tokens), kept
    /// by the driver itself.
    prompts: HashMap<RequestId, CanonicalPrompt>,
    /// Tokens appended to each request.
    generated: HashMap<RequestId, usize>,
    /// Admitted requests that may generate (`max_new_tokens > 0`): the ones
    /// whose long prompts the prefill cap starts one a step.
    will_decode: HashSet<RequestId>,
    /// Requests and computed lengths the last completion checks the events of.
    committed: Vec<(RequestId, usize)>,
    /// Rebuilds the cache from the scheduler's KV events, when it records them.
    events: Option<EventConsumer>,
}

/// A router's view of one scheduler, rebuilt from its KV events alone: the
/// hashes it holds. Each event is checked as it is applied: a stored block is
/// new and its parent is cached, a removed one was cached, and the hash of a
/// text-only block is recomputed from the documented bytes (salt or parent,
/// then `'T'`, count, ids) with BLAKE3 directly, an oracle independent of the
/// library's hasher.
pub struct EventConsumer {
    cached: HashSet<u64>,
    hash_key: [u8; 32],
    tenants: Vec<u64>,
    /// The library's hasher, for blocks holding item rows.
    hasher: FleetHasher,
}

impl EventConsumer {
    /// A consumer for a fleet under `key` whose requests use `tenants`.
    pub fn new(key: &FingerprintKey, tenants: Vec<u64>) -> Self {
        let hash_key = blake3::derive_key("omniprefix 2026 kv block hash", key.as_bytes());
        EventConsumer { cached: HashSet::new(), hash_key, tenants, hasher: FleetHasher::new(key) }
    }

    /// The hashes of the first `blocks` blocks of `prompt`: text-only
    /// blocks from the documented bytes (BLAKE3 here), the chain after the
    /// first block holding item rows from the library's hasher.
    fn expected_hashes(&self, prompt: &CanonicalPrompt, block_size: usize, blocks: usize) -> Vec<u64> {
        let mut text: Vec<Option<u32>> = Vec::with_capacity(prompt.len());
        for atom in &prompt.atoms {
            match atom {
                Atom::Text(ids) => text.extend(ids.iter().map(|&t| Some(t))),
                Atom::Item { rows, .. } => text.extend(rows.clone().map(|_| None)),
            }
        }
        let mut hashes: Vec<u64> = Vec::with_capacity(blocks);
        for chunk in text.chunks_exact(block_size).take(blocks) {
            let Some(ids) = chunk.iter().copied().collect::<Option<Vec<u32>>>() else { break };
            hashes.push(match hashes.last() {
                Some(&parent) => self.text_block_hash(1, parent, &ids),
                None => self.text_block_hash(0, prompt.tenant, &ids),
            });
        }
        self.hasher.extend(prompt, block_size, blocks, &mut hashes);
        hashes
    }

    fn text_block_hash(&self, root: u8, salt_or_parent: u64, ids: &[u32]) -> u64 {
        let mut message = vec![root];
        message.extend_from_slice(&salt_or_parent.to_le_bytes());
        message.push(b'T');
        message.extend_from_slice(&(ids.len() as u32).to_le_bytes());
        for id in ids {
            message.extend_from_slice(&id.to_le_bytes());
        }
        let digest = blake3::keyed_hash(&self.hash_key, &message);
        u64::from_le_bytes(digest.as_bytes()[..8].try_into().unwrap_or_default())
    }

    fn apply(&mut self, event: &KvEvent) -> Result<(), TestCaseError> {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                extra_keys,
                ..
            } => {
                prop_assert_eq!(token_ids.len(), block_hashes.len() * block_size);
                let mut parent = *parent_block_hash;
                if let Some(p) = parent {
                    prop_assert!(self.cached.contains(&p), "stored under parent {p:#x}, which is not cached");
                }
                for (i, &hash) in block_hashes.iter().enumerate() {
                    prop_assert!(self.cached.insert(hash), "block {hash:#x} stored twice");
                    let text_only = extra_keys.as_ref().is_none_or(|per_block| per_block[i].is_none());
                    if text_only {
                        let ids = &token_ids[i * block_size..(i + 1) * block_size];
                        let ok = match parent {
                            Some(p) => self.text_block_hash(1, p, ids) == hash,
                            None => self.tenants.iter().any(|&t| self.text_block_hash(0, t, ids) == hash),
                        };
                        prop_assert!(ok, "block {hash:#x} is not the documented hash of its ids {ids:?}");
                    }
                    parent = Some(hash);
                }
            }
            KvEvent::BlockRemoved { block_hashes, .. } => {
                for hash in block_hashes {
                    prop_assert!(self.cached.remove(hash), "block {hash:#x} removed but not cached");
                }
            }
            KvEvent::AllBlocksCleared => self.cached.clear(),
        }
        Ok(())
    }
}

fn fail(e: Error) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

impl<R: Runner> Machine<R> {
    pub fn new(sched: Scheduler, runner: R) -> Self {
        Self {
            sched,
            runner,
            outstanding: VecDeque::new(),
            live: Vec::new(),
            completed: Vec::new(),
            next_id: 0,
            finished: 0,
            positions: HashMap::new(),
            prompts: HashMap::new(),
            generated: HashMap::new(),
            will_decode: HashSet::new(),
            committed: Vec::new(),
            events: None,
        }
    }

    /// Checks after every operation that `consumer`, fed the scheduler's KV
    /// events, holds exactly the blocks the scheduler says its index holds
    /// (the scheduler must have been built [`with_kv_events`](Scheduler::with_kv_events)).
    pub fn with_event_consumer(mut self, consumer: EventConsumer) -> Self {
        self.events = Some(consumer);
        self
    }

    /// Admits a new request; a prompt longer than the whole pool must be
    /// refused with `RequestTooLarge` and change nothing. Returns whether it was admitted.
    pub fn admit(
        &mut self, tenant: u64, units: &[u32], max_new_tokens: usize,
    ) -> Result<bool, TestCaseError> {
        let req = Request { max_new_tokens, ..self.runner.request(self.next_id, tenant, units) };
        self.next_id += 1;
        let cfg = *self.sched.config();
        let too_large = (req.prompt.len() + max_new_tokens).div_ceil(cfg.block_size) > cfg.num_blocks;
        let before = (self.sched.stats(), self.sched.index_stats());
        let id = req.id;
        let positions = req.prompt.positions.iter().collect();
        let prompt = req.prompt.clone();
        match self.sched.admit(req) {
            Ok(()) => {
                self.live.push(id);
                self.positions.insert(id, positions);
                self.prompts.insert(id, prompt);
                if max_new_tokens > 0 {
                    self.will_decode.insert(id);
                }
                Ok(true)
            }
            Err(Error::Request(RequestError::RequestTooLarge { .. })) if too_large => {
                prop_assert_eq!(
                    (self.sched.stats(), self.sched.index_stats()),
                    before,
                    "rejected admit changed state"
                );
                Ok(false)
            }
            Err(e) => Err(fail(e)),
        }
    }

    /// Applies `op` (prompt bases from `bases`), then validates the scheduler.
    pub fn apply(&mut self, op: &Op, bases: &[Vec<u32>]) -> Result<(), TestCaseError> {
        match op {
            Op::Admit { base, tail, tenant } => {
                let mut units = bases[base % bases.len()].clone();
                units.extend(tail);
                self.admit(*tenant, &units, MAX_NEW_TOKENS)?;
            }
            Op::Schedule => {
                // Which live requests run (hold blocks) and how far, before the step.
                let before: HashMap<RequestId, (bool, usize)> = self
                    .live
                    .iter()
                    .map(|&id| {
                        let holds = self.sched.block_table(id).is_some_and(|t| !t.is_empty());
                        (id, (holds, self.sched.num_computed_tokens(id).unwrap_or(0)))
                    })
                    .collect();
                let batch = self.sched.schedule().map_err(fail)?;
                self.check_copy_sources_untouched(&batch)?;
                self.check_prefill_cap(&batch, &before)?;
                // Every chunk carries the prompt's positions over exactly its range.
                for seq in &batch.seqs {
                    let range = seq.new_positions();
                    let want = self.positions.get(&seq.request).and_then(|p| p.get(range.clone()));
                    let got: Vec<[i64; 3]> = seq.positions.iter().collect();
                    prop_assert_eq!(
                        Some(&got[..]),
                        want,
                        "request {}: positions of {:?}",
                        seq.request,
                        range
                    );
                }
                if batch.seqs.is_empty() {
                    self.runner.run(&batch)?;
                } else {
                    self.outstanding.push_back((batch, None));
                }
            }
            Op::Run => {
                if let Some((batch, output)) = self.outstanding.iter_mut().find(|(_, o)| o.is_none()) {
                    *output = Some(self.runner.run(batch)?);
                }
            }
            Op::Complete => {
                if let Some((batch, output)) = self.outstanding.pop_front() {
                    let output = match output {
                        Some(output) => output,
                        None => self.runner.run(&batch)?,
                    };
                    let done = self.sched.complete(&batch).map_err(fail)?;
                    self.runner.completed(output, &done)?;
                    // Every full block these sequences computed is committed
                    // now, unless a batch still out pins a copy-on-write
                    // source in the way (the scheduler then defers it).
                    if self.outstanding.iter().all(|(b, _)| b.copies.is_empty()) {
                        self.committed = batch
                            .seqs
                            .iter()
                            .filter(|s| self.live.contains(&s.request))
                            .map(|s| (s.request, s.num_computed_tokens + s.token_ids.len()))
                            .collect();
                    }
                    self.completed.extend(done);
                }
            }
            Op::Append { k, unit } => {
                if !self.completed.is_empty() {
                    let i = k % self.completed.len();
                    let id = self.completed[i];
                    let token = self.runner.token(*unit);
                    let generated = self.generated.get(&id).copied().unwrap_or(0);
                    let before = (self.sched.stats(), self.sched.num_computed_tokens(id));
                    match self.sched.append(id, token) {
                        Ok(()) => {
                            prop_assert!(
                                generated < MAX_NEW_TOKENS,
                                "request {id} grew past its max_new_tokens"
                            );
                            self.completed.remove(i);
                            self.generated.insert(id, generated + 1);
                            let prompt =
                                self.prompts.get_mut(&id).ok_or_else(|| TestCaseError::fail("no prompt"))?;
                            prompt.push_text(token);
                            self.positions.insert(id, prompt.positions.iter().collect());
                            self.runner.appended(id, token, prompt);
                        }
                        Err(Error::Request(RequestError::GenerationLimit { .. }))
                            if generated == MAX_NEW_TOKENS =>
                        {
                            prop_assert_eq!((self.sched.stats(), self.sched.num_computed_tokens(id)), before);
                        }
                        Err(e) => return Err(fail(e)),
                    }
                }
            }
            Op::Evict(n) => {
                let cached = self.sched.stats().blocks_cached;
                let freed = self.sched.evict(*n).map_err(fail)?;
                prop_assert!(freed <= *n);
                prop_assert_eq!(self.sched.stats().blocks_cached, cached - freed);
            }
            Op::Finish(k) => {
                if !self.completed.is_empty() {
                    let id = self.completed.remove(k % self.completed.len());
                    self.runner.finishing(id)?;
                    self.sched.finish(id).map_err(fail)?;
                    self.live.retain(|&r| r != id);
                    self.finished += 1;
                }
            }
            Op::Abort(k) => {
                if !self.live.is_empty() {
                    let id = self.live.remove(k % self.live.len());
                    self.sched.abort(id).map_err(fail)?;
                    self.completed.retain(|&r| r != id);
                    self.runner.aborted(id);
                }
            }
        }
        self.validate()
    }

    /// The scheduler's own invariant check, as a test failure; then the
    /// event consumer's view against the scheduler's.
    pub fn validate(&mut self) -> Result<(), TestCaseError> {
        self.sched.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
        if let Some(consumer) = self.events.as_mut() {
            for event in self.sched.take_kv_events() {
                consumer.apply(&event)?;
            }
            let mut rebuilt: Vec<u64> = consumer.cached.iter().copied().collect();
            rebuilt.sort_unstable();
            prop_assert_eq!(
                rebuilt,
                self.sched.cached_block_hashes(),
                "the events' index differs from the scheduler's"
            );
            let bs = self.sched.config().block_size;
            for (id, computed) in std::mem::take(&mut self.committed) {
                let Some(prompt) = self.prompts.get(&id) else { continue };
                for (i, hash) in consumer.expected_hashes(prompt, bs, computed / bs).into_iter().enumerate() {
                    prop_assert!(
                        consumer.cached.contains(&hash),
                        "request {id}: full block {i} ({hash:#x}) of its {computed} computed tokens was never published"
                    );
                }
            }
        }
        Ok(())
    }

    /// The prefill cap's two rules on a step just built (`Scheduler::schedule`):
    /// a step that carries a decode (a running sequence with one token left)
    /// adds at most `prefill_cap` prefill tokens, and a step prefills at most
    /// [`SchedulerConfig::long_prefills_per_step`] prompts with more than
    /// `prefill_cap` tokens left among requests that will decode, whether they
    /// start this step or were already running. `before`: each live request's
    /// (holds blocks, computed tokens) before the step.
    fn check_prefill_cap(
        &self, batch: &ScheduledBatch, before: &HashMap<RequestId, (bool, usize)>,
    ) -> Result<(), TestCaseError> {
        let cfg = *self.sched.config();
        let Some(cap) = cfg.prefill_cap_tokens() else { return Ok(()) };
        prop_assert!(
            cap >= 1 && cap <= cfg.max_tokens_per_step,
            "prefill cap {} outside 1..={}",
            cap,
            cfg.max_tokens_per_step
        );
        let (mut long, mut prefill_tokens, mut decodes) = (Vec::new(), 0, false);
        for seq in &batch.seqs {
            let len = self.prompts.get(&seq.request).map_or(0, CanonicalPrompt::len);
            let left = len - seq.num_computed_tokens;
            let was_running = before
                .get(&seq.request)
                .is_some_and(|&(holds, computed)| holds && computed == seq.num_computed_tokens);
            if was_running && left == 1 {
                decodes = true;
            } else {
                prefill_tokens += seq.token_ids.len();
            }
            if self.will_decode.contains(&seq.request) && left > cap {
                long.push((seq.request, left));
            }
        }
        if let Some(most) = cfg.long_prefills_per_step() {
            prop_assert!(
                long.len() <= most,
                "one step prefills {} long prompts (request, tokens left) {:?} over cap {}; at most {}",
                long.len(),
                long,
                cap,
                most
            );
        }
        if decodes {
            prop_assert!(
                prefill_tokens <= cap,
                "a step with decodes adds {} prefill tokens, over the cap of {}",
                prefill_tokens,
                cap
            );
        }
        Ok(())
    }

    /// A batch just scheduled writes no block that a batch still out (or
    /// another copy of its own) copies from: copy-on-write sources stay
    /// pinned until the batch holding the copy completes. (An aborted
    /// request's copies are exempt: abort gives up its pins at once, which
    /// is safe because batches run in order.)
    fn check_copy_sources_untouched(&self, batch: &ScheduledBatch) -> Result<(), TestCaseError> {
        let bs = self.sched.config().block_size;
        let mut written: HashSet<u32> = batch.copies.iter().map(|c| c.dst).collect();
        for seq in &batch.seqs {
            written.extend(seq.new_positions().map(|p| seq.block_table[p / bs]));
        }
        // A copy belongs to the sequence whose table holds its destination.
        let live_copies = |b: &'_ ScheduledBatch| {
            let copies: Vec<_> = b
                .copies
                .iter()
                .filter(|c| {
                    b.seqs
                        .iter()
                        .any(|s| s.block_table.blocks().contains(&c.dst) && self.live.contains(&s.request))
                })
                .copied()
                .collect();
            copies
        };
        let sources =
            self.outstanding.iter().flat_map(|(b, _)| live_copies(b)).chain(batch.copies.iter().copied());
        for c in sources {
            prop_assert!(
                !written.contains(&c.src),
                "block {} is written while a copy from it is pending",
                c.src
            );
        }
        Ok(())
    }

    /// Completes what is outstanding, then runs every live request to the end
    /// (failing if that takes more than `max_rounds` schedule/complete rounds).
    pub fn drain(&mut self, max_rounds: usize) -> Result<(), TestCaseError> {
        while !self.outstanding.is_empty() {
            self.apply(&Op::Complete, &[])?;
        }
        for _ in 0..max_rounds {
            while !self.completed.is_empty() {
                self.apply(&Op::Finish(0), &[])?;
            }
            if self.live.is_empty() {
                return Ok(());
            }
            self.apply(&Op::Schedule, &[])?;
            prop_assert!(
                !self.outstanding.is_empty(),
                "live requests {:?} but nothing can be scheduled",
                self.live
            );
            self.apply(&Op::Complete, &[])?;
        }
        Err(TestCaseError::fail(format!("requests {:?} never finished", self.live)))
    }

    /// After everything finished: every block is free or owned by the index.
    pub fn check_nothing_leaked(&self) -> Result<(), TestCaseError> {
        let stats = self.sched.stats();
        prop_assert_eq!(stats.blocks_in_use, 0, "blocks leaked: {:?}", stats);
        prop_assert_eq!(stats.blocks_free + stats.blocks_cached, self.sched.config().num_blocks);
        Ok(())
    }

    /// A fresh tenant's prompt of `units`, as long as the whole pool, finishes
    /// only if every cached block can be evicted, i.e. no index lock outlived its request.
    pub fn check_no_lock_left(&mut self, units: &[u32], max_rounds: usize) -> Result<(), TestCaseError> {
        let num_blocks = self.sched.config().num_blocks;
        prop_assert!(self.admit(99, units, 0)?, "a prompt as long as the pool was refused");
        self.drain(max_rounds)?;
        prop_assert_eq!(self.sched.stats().blocks_cached, num_blocks);
        Ok(())
    }
}
