//! The scheduler as a state machine, with a real (tiny, random) model: random
//! admit / schedule+run / complete / finish / abort / evict sequences over
//! three tenants, a 4-token text vocabulary plus two images, and a pool of a
//! few blocks. After every operation the pool, the radix index and the
//! scheduler pass `validate()` (which also rejects a block shared across
//! tenants); every request that finishes returns hidden states and logits
//! equal to its uncached run (1e-5 relative); at the end no block is leaked
//! and no index lock is left behind.
//!
//! Cases default to 64 (under a second); scale with `PROPTEST_CASES`.

mod tiny_model;

use std::collections::{HashMap, VecDeque};

use omniprefix::batch::{RequestId, ScheduledBatch};
use omniprefix::index::radix::{RadixConfig, RadixIndex};
use omniprefix::runner::{Outputs, PromptInputs, SeqOutput};
use omniprefix::sched::{Scheduler, SchedulerConfig};
use omniprefix::{Error, backend::cpu::CpuPages};
use proptest::prelude::*;
use tiny_model::{IMAGE_UNIT, TinyModel, equal_outputs, request};

#[derive(Debug, Clone)]
enum Op {
    /// Shared base `base` followed by `tail`, for `tenant`.
    Admit { base: usize, tail: Vec<u32>, tenant: u64 },
    /// Build a batch and run it on the model (completed later).
    Schedule,
    /// Complete the oldest outstanding batch.
    Complete,
    /// Finish the `k`-th completed request (checking its outputs).
    Finish(usize),
    /// Abort the `k`-th live request.
    Abort(usize),
    /// Evict up to `n` unread cached blocks.
    Evict(usize),
}

#[derive(Debug, Clone)]
struct Case {
    config: SchedulerConfig,
    bases: Vec<Vec<u32>>,
    ops: Vec<Op>,
    seed: u64,
}

fn unit() -> impl Strategy<Value = u32> {
    prop_oneof![6 => 0u32..4, 1 => IMAGE_UNIT..IMAGE_UNIT + 2]
}

fn case() -> impl Strategy<Value = Case> {
    let config = (6usize..14, prop_oneof![Just(2usize), Just(4)], 1usize..12, 1usize..4, any::<bool>()).prop_map(
        |(num_blocks, block_size, max_tokens_per_step, max_seqs_per_step, token_granular_reuse)| SchedulerConfig {
            num_blocks,
            block_size,
            max_tokens_per_step,
            max_seqs_per_step,
            token_granular_reuse,
        },
    );
    let bases = prop::collection::vec(prop::collection::vec(unit(), 0..8), 1..4);
    let op = prop_oneof![
        3 => (0usize..4, prop::collection::vec(unit(), 1..6), 0u64..3)
            .prop_map(|(base, tail, tenant)| Op::Admit { base, tail, tenant }),
        4 => Just(Op::Schedule),
        4 => Just(Op::Complete),
        2 => (0usize..8).prop_map(Op::Finish),
        1 => (0usize..8).prop_map(Op::Abort),
        1 => (1usize..4).prop_map(Op::Evict),
    ];
    (config, bases, prop::collection::vec(op, 1..50), any::<u64>())
        .prop_map(|(config, bases, ops, seed)| Case { config, bases, ops, seed })
}

/// The scheduler, the model and what the test tracks beside them.
struct Machine<'m> {
    sched: Scheduler,
    model: &'m TinyModel,
    pages: CpuPages,
    /// Batches run but not yet completed, with the outputs they produced.
    outstanding: VecDeque<(ScheduledBatch, Vec<SeqOutput>)>,
    inputs: HashMap<RequestId, PromptInputs>,
    /// Outputs of requests whose prompt completed, until they are finished.
    outputs: HashMap<RequestId, SeqOutput>,
    live: Vec<RequestId>,
    completed: Vec<RequestId>,
    next_id: RequestId,
    finished: usize,
}

fn fail(e: Error) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

impl<'m> Machine<'m> {
    fn new(config: SchedulerConfig, model: &'m TinyModel) -> Result<Self, TestCaseError> {
        let index = RadixIndex::new(RadixConfig { block_size: config.block_size, ..Default::default() }).map_err(fail)?;
        Ok(Self {
            sched: Scheduler::new(config, Box::new(index)).map_err(fail)?,
            pages: model.pages(config.num_blocks, config.block_size).map_err(fail)?,
            model,
            outstanding: VecDeque::new(),
            inputs: HashMap::new(),
            outputs: HashMap::new(),
            live: Vec::new(),
            completed: Vec::new(),
            next_id: 0,
            finished: 0,
        })
    }

    fn admit(&mut self, tenant: u64, units: &[u32]) -> Result<(), TestCaseError> {
        let (req, inputs) = request(self.next_id, tenant, units);
        self.next_id += 1;
        let cfg = *self.sched.config();
        let too_large = req.prompt.len().div_ceil(cfg.block_size) > cfg.num_blocks;
        let before = (self.sched.stats(), self.sched.index_stats());
        let id = req.id;
        match self.sched.admit(req) {
            Ok(()) => {
                self.live.push(id);
                self.inputs.insert(id, inputs);
            }
            Err(Error::RequestTooLarge { .. }) if too_large => {
                prop_assert_eq!((self.sched.stats(), self.sched.index_stats()), before, "rejected admit changed state");
            }
            Err(e) => return Err(fail(e)),
        }
        Ok(())
    }

    fn apply(&mut self, op: &Op, bases: &[Vec<u32>]) -> Result<(), TestCaseError> {
        match op {
            Op::Admit { base, tail, tenant } => {
                let mut units = bases[base % bases.len()].clone();
                units.extend(tail);
                self.admit(*tenant, &units)?;
            }
            Op::Schedule => {
                let batch = self.sched.schedule().map_err(fail)?;
                if !batch.seqs.is_empty() {
                    let outs = self.model.execute(&batch, &mut self.pages).map_err(fail)?;
                    self.outstanding.push_back((batch, outs));
                }
            }
            Op::Complete => {
                if let Some((batch, outs)) = self.outstanding.pop_front() {
                    let done = self.sched.complete(&batch).map_err(fail)?;
                    for out in outs.into_iter().filter(|o| done.contains(&o.request)) {
                        self.outputs.insert(out.request, out);
                    }
                    prop_assert!(done.iter().all(|id| self.outputs.contains_key(id)), "a request completed without outputs");
                    self.completed.extend(done);
                }
            }
            Op::Finish(k) => {
                if !self.completed.is_empty() {
                    let id = self.completed.remove(k % self.completed.len());
                    self.check_outputs(id)?;
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
                    self.outputs.remove(&id);
                }
            }
            Op::Evict(n) => {
                let cached = self.sched.stats().blocks_cached;
                let freed = self.sched.evict(*n).map_err(fail)?;
                prop_assert!(freed <= *n);
                prop_assert_eq!(self.sched.stats().blocks_cached, cached - freed);
            }
        }
        self.sched.validate().map_err(TestCaseError::fail)
    }

    /// The request's cached-run outputs equal its uncached run.
    fn check_outputs(&mut self, id: RequestId) -> Result<(), TestCaseError> {
        let got = self.outputs.remove(&id).ok_or_else(|| TestCaseError::fail(format!("no outputs for {id}")))?;
        let inputs = self.inputs.get(&id).ok_or_else(|| TestCaseError::fail(format!("no inputs for {id}")))?;
        let want: Outputs = self.model.uncached(inputs).map_err(fail)?;
        equal_outputs(&got, &want).map_err(|m| TestCaseError::fail(format!("request {id}: {m}")))
    }

    /// Completes what is outstanding, then runs every live request to the end.
    fn drain(&mut self) -> Result<(), TestCaseError> {
        while !self.outstanding.is_empty() {
            self.apply(&Op::Complete, &[])?;
        }
        for _ in 0..500 {
            while !self.completed.is_empty() {
                self.apply(&Op::Finish(0), &[])?;
            }
            if self.live.is_empty() {
                return Ok(());
            }
            self.apply(&Op::Schedule, &[])?;
            prop_assert!(!self.outstanding.is_empty(), "live requests {:?} but nothing can be scheduled", self.live);
            self.apply(&Op::Complete, &[])?;
        }
        Err(TestCaseError::fail(format!("requests {:?} never finished", self.live)))
    }

    /// Every block is free or index-owned, and a fresh tenant's prompt as
    /// long as the pool still runs (so no index lock outlived its request).
    fn check_nothing_left(&mut self) -> Result<(), TestCaseError> {
        let cfg = *self.sched.config();
        let stats = self.sched.stats();
        prop_assert_eq!(stats.blocks_in_use, 0, "blocks leaked: {:?}", stats);
        prop_assert_eq!(stats.blocks_free + stats.blocks_cached, cfg.num_blocks);
        let units: Vec<u32> = (0..(cfg.num_blocks * cfg.block_size) as u32).map(|i| (i * 7 / 3) % 4).collect();
        self.admit(99, &units)?;
        self.drain()?;
        prop_assert_eq!(self.sched.stats().blocks_cached, cfg.num_blocks);
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(64),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_operations_keep_invariants_and_outputs_equal_uncached(case in case()) {
        let model = TinyModel::new(case.seed).map_err(fail)?;
        let mut m = Machine::new(case.config, &model)?;
        for op in &case.ops {
            m.apply(op, &case.bases)?;
        }
        m.drain()?;
        m.check_nothing_left()?;
        prop_assert!(m.finished > 0);
    }
}
