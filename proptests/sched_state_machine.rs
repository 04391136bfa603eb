//! The scheduler as a state machine, with a real (tiny, random) model: random
//! admit / schedule+run / complete / finish / abort / evict sequences over
//! three tenants, a 4-token text vocabulary plus two images, and a pool of a
//! few blocks. After every operation the pool, the radix index and the
//! scheduler pass `validate()` (which also rejects a block shared across
//! tenants); every request that finishes returns hidden states and logits
//! equal to its uncached run (1e-5 relative); at the end no block is leaked
//! and no index lock is left behind. KV events are recorded throughout and a
//! consumer rebuilt from them matches the index after every operation.
//!
//! Cases default to 64 (under a second); scale with `PROPTEST_CASES`.

#[path = "support/sched_driver.rs"]
mod sched_driver;
mod tiny_model;

use std::collections::HashMap;

use omniprefix::batch::{RequestId, ScheduledBatch};
use omniprefix::index::radix::{RadixConfig, RadixIndex};
use omniprefix::runner::{Outputs, PromptInputs, SeqOutput};
use omniprefix::sched::{Request, Scheduler, SchedulerConfig};
use omniprefix::{Error, backend::cpu::CpuPages};
use proptest::prelude::*;
use omniprefix::canon::FingerprintKey;
use omniprefix::events::Medium;
use omniprefix::index::block_hash::FleetHasher;
use sched_driver::{EventConsumer, Machine, Op, Runner, op, scheduler_config};
use tiny_model::{IMAGE_UNIT, TinyModel, equal_outputs, request};

/// Schedule/complete rounds a drain may take before a request counts as stuck.
const DRAIN_ROUNDS: usize = 500;

#[derive(Debug, Clone)]
enum Step {
    /// One of the operations both scheduler suites share.
    Op(Op),
    /// Evict up to `n` unread cached blocks.
    Evict(usize),
}

#[derive(Debug, Clone)]
struct Case {
    config: SchedulerConfig,
    bases: Vec<Vec<u32>>,
    steps: Vec<Step>,
    seed: u64,
}

fn unit() -> impl Strategy<Value = u32> {
    prop_oneof![6 => 0u32..4, 1 => IMAGE_UNIT..IMAGE_UNIT + 2]
}

fn case() -> impl Strategy<Value = Case> {
    let bases = prop::collection::vec(prop::collection::vec(unit(), 0..8), 1..4);
    // The shared operations weigh 14 in all; eviction 1.
    let step = prop_oneof![
        14 => op(unit(), 1..6, 0..3).prop_map(Step::Op),
        1 => (1usize..4).prop_map(Step::Evict),
    ];
    (scheduler_config(6..14, 1..12), bases, prop::collection::vec(step, 1..50), any::<u64>())
        .prop_map(|(config, bases, steps, seed)| Case { config, bases, steps, seed })
}

fn fail(e: Error) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// Runs batches on the tiny model and checks every finished request's
/// outputs against its uncached run.
struct ModelRun<'m> {
    model: &'m TinyModel,
    pages: CpuPages,
    inputs: HashMap<RequestId, PromptInputs>,
    /// Outputs of requests whose prompt completed, until they are finished.
    outputs: HashMap<RequestId, SeqOutput>,
}

impl Runner for ModelRun<'_> {
    type Output = Vec<SeqOutput>;

    fn request(&mut self, id: RequestId, tenant: u64, units: &[u32]) -> Request {
        let (req, inputs) = request(id, tenant, units);
        self.inputs.insert(id, inputs);
        req
    }

    fn run(&mut self, batch: &ScheduledBatch) -> Result<Vec<SeqOutput>, TestCaseError> {
        if batch.seqs.is_empty() {
            return Ok(Vec::new());
        }
        self.model.execute(batch, &mut self.pages).map_err(fail)
    }

    fn completed(&mut self, outs: Vec<SeqOutput>, done: &[RequestId]) -> Result<(), TestCaseError> {
        for out in outs.into_iter().filter(|o| done.contains(&o.request)) {
            self.outputs.insert(out.request, out);
        }
        prop_assert!(done.iter().all(|id| self.outputs.contains_key(id)), "a request completed without outputs");
        Ok(())
    }

    /// The request's cached-run outputs equal its uncached run.
    fn finishing(&mut self, id: RequestId) -> Result<(), TestCaseError> {
        let got = self.outputs.remove(&id).ok_or_else(|| TestCaseError::fail(format!("no outputs for {id}")))?;
        let inputs = self.inputs.get(&id).ok_or_else(|| TestCaseError::fail(format!("no inputs for {id}")))?;
        let want: Outputs = self.model.uncached(inputs).map_err(fail)?;
        equal_outputs(&got, &want).map_err(|m| TestCaseError::fail(format!("request {id}: {m}")))
    }

    fn aborted(&mut self, id: RequestId) {
        self.outputs.remove(&id);
    }
}

fn apply(m: &mut Machine<ModelRun<'_>>, step: &Step, bases: &[Vec<u32>]) -> Result<(), TestCaseError> {
    match step {
        Step::Op(op) => m.apply(op, bases),
        Step::Evict(n) => {
            let cached = m.sched.stats().blocks_cached;
            let freed = m.sched.evict(*n).map_err(fail)?;
            prop_assert!(freed <= *n);
            prop_assert_eq!(m.sched.stats().blocks_cached, cached - freed);
            m.validate()
        }
    }
}

proptest! {
    #![proptest_config(sched_driver::proptest_config(64))]

    #[test]
    fn random_operations_keep_invariants_and_outputs_equal_uncached(case in case()) {
        let model = TinyModel::new(case.seed).map_err(fail)?;
        let cfg = case.config;
        let index = RadixIndex::new(RadixConfig { block_size: cfg.block_size }).map_err(fail)?;
        let key = FingerprintKey::fixed(case.seed);
        let sched = Scheduler::new(cfg, Box::new(index)).map_err(fail)?.with_kv_events(FleetHasher::new(&key), Medium::Cpu);
        let pages = model.pages(cfg.num_blocks, cfg.block_size).map_err(fail)?;
        let run = ModelRun { model: &model, pages, inputs: HashMap::new(), outputs: HashMap::new() };
        // Tenants 0..3 (the ops') and 99 (`check_no_lock_left`'s).
        let mut m = Machine::new(sched, run).with_event_consumer(EventConsumer::new(&key, vec![0, 1, 2, 99]));
        for step in &case.steps {
            apply(&mut m, step, &case.bases)?;
        }
        m.drain(DRAIN_ROUNDS)?;
        m.check_nothing_leaked()?;
        let units: Vec<u32> = (0..(cfg.num_blocks * cfg.block_size) as u32).map(|i| (i * 7 / 3) % 4).collect();
        m.check_no_lock_left(&units, DRAIN_ROUNDS)?;
        prop_assert!(m.finished > 0);
    }
}
