//! Random admit / schedule / complete / finish / abort sequences over a tiny
//! vocabulary and two images (so prompts share prefixes and blocks) and a
//! small pool (so eviction and preemption happen). After every operation the
//! scheduler's `validate` must pass, and the shadow runner must read the right
//! KV for every reused position and get the right token or image row for every
//! new one. At the end no block is leaked, every request that was not aborted
//! finishes, and a prompt as long as the pool still fits (no index lock
//! outlived its request).
//!
//! Case count: `PROPTEST_CASES` (default 64).

mod support;

use std::collections::VecDeque;

use omniprefix::Error;
use omniprefix::batch::{RequestId, ScheduledBatch};
use omniprefix::index::PrefixIndex;
use omniprefix::index::radix::{RadixConfig, RadixIndex};
use omniprefix::sched::{Scheduler, SchedulerConfig};
use proptest::prelude::*;
use support::{IMAGE_MARKER, ReferenceIndex, ShadowPages, request};

#[derive(Debug, Clone)]
enum Op {
    /// A prompt made of shared base `base` followed by `tail`, for `tenant`
    /// (ids from `IMAGE_MARKER` up stand for images).
    Admit {
        base: usize,
        tail: Vec<u32>,
        tenant: u64,
    },
    /// Build a batch and run it on the shadow pages (completed later).
    Schedule,
    /// Complete the oldest outstanding batch.
    Complete,
    /// Finish the `k`-th completed request.
    Finish(usize),
    /// Abort the `k`-th live request.
    Abort(usize),
}

#[derive(Debug, Clone)]
struct Case {
    config: SchedulerConfig,
    bases: Vec<Vec<u32>>,
    ops: Vec<Op>,
}

fn case() -> impl Strategy<Value = Case> {
    let config = (
        6usize..16,
        prop_oneof![Just(2usize), Just(4)],
        1usize..20,
        1usize..4,
        any::<bool>(),
    )
        .prop_map(
            |(
                num_blocks,
                block_size,
                max_tokens_per_step,
                max_seqs_per_step,
                token_granular_reuse,
            )| SchedulerConfig {
                num_blocks,
                block_size,
                max_tokens_per_step,
                max_seqs_per_step,
                token_granular_reuse,
            },
        );
    // Mostly text from 3 tokens, now and then one of 2 images (3 rows each).
    let unit = || prop_oneof![8 => 0u32..3, 1 => IMAGE_MARKER..=u32::MAX];
    let bases = prop::collection::vec(prop::collection::vec(unit(), 0..10), 1..4);
    let op = prop_oneof![
        3 => (0usize..4, prop::collection::vec(unit(), 1..8), 0u64..2)
            .prop_map(|(base, tail, tenant)| Op::Admit { base, tail, tenant }),
        4 => Just(Op::Schedule),
        4 => Just(Op::Complete),
        2 => (0usize..8).prop_map(Op::Finish),
        1 => (0usize..8).prop_map(Op::Abort),
    ];
    (config, bases, prop::collection::vec(op, 1..60)).prop_map(|(config, bases, ops)| Case {
        config,
        bases,
        ops,
    })
}

/// The state the test keeps beside the scheduler.
struct Harness {
    sched: Scheduler,
    pages: ShadowPages,
    outstanding: VecDeque<ScheduledBatch>,
    live: Vec<RequestId>,
    completed: Vec<RequestId>,
    next_id: RequestId,
}

impl Harness {
    fn new(config: SchedulerConfig, index: Box<dyn PrefixIndex>) -> Result<Self, TestCaseError> {
        let sched =
            Scheduler::new(config, index).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let pages = ShadowPages::new(config.num_blocks, config.block_size);
        Ok(Self {
            sched,
            pages,
            outstanding: VecDeque::new(),
            live: Vec::new(),
            completed: Vec::new(),
            next_id: 0,
        })
    }

    fn apply(&mut self, op: &Op, bases: &[Vec<u32>]) -> Result<(), TestCaseError> {
        let fail = |e: Error| TestCaseError::fail(e.to_string());
        match op {
            Op::Admit { base, tail, tenant } => {
                let mut ids = bases[base % bases.len()].clone();
                ids.extend(tail);
                let req = request(self.next_id, *tenant, &ids);
                self.next_id += 1;
                let cfg = *self.sched.config();
                let needed = req.prompt.len().div_ceil(cfg.block_size);
                let before = self.sched.stats();
                self.pages.register(&req);
                let id = req.id;
                match self.sched.admit(req) {
                    Ok(()) => self.live.push(id),
                    Err(Error::RequestTooLarge { .. }) if needed > cfg.num_blocks => {
                        prop_assert_eq!(self.sched.stats(), before, "rejected admit changed state");
                    }
                    Err(e) => return Err(fail(e)),
                }
            }
            Op::Schedule => {
                let batch = self.sched.schedule().map_err(fail)?;
                prop_assert!(batch.num_new_tokens() <= self.sched.config().max_tokens_per_step);
                prop_assert!(batch.seqs.len() <= self.sched.config().max_seqs_per_step);
                self.pages.run(&batch).map_err(TestCaseError::fail)?;
                if !batch.seqs.is_empty() {
                    self.outstanding.push_back(batch);
                }
            }
            Op::Complete => {
                if let Some(batch) = self.outstanding.pop_front() {
                    self.completed
                        .extend(self.sched.complete(&batch).map_err(fail)?);
                }
            }
            Op::Finish(k) => {
                if !self.completed.is_empty() {
                    let id = self.completed.remove(k % self.completed.len());
                    self.sched.finish(id).map_err(fail)?;
                    self.live.retain(|&r| r != id);
                }
            }
            Op::Abort(k) => {
                if !self.live.is_empty() {
                    let id = self.live.remove(k % self.live.len());
                    self.sched.abort(id).map_err(fail)?;
                    self.completed.retain(|&r| r != id);
                }
            }
        }
        self.sched.validate().map_err(TestCaseError::fail)
    }

    /// Completes what is outstanding, then runs every live request to the end.
    fn drain(&mut self) -> Result<(), TestCaseError> {
        while !self.outstanding.is_empty() {
            self.apply(&Op::Complete, &[])?;
        }
        for _ in 0..2000 {
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
        Err(TestCaseError::fail(format!(
            "requests {:?} never finished",
            self.live
        )))
    }

    /// After everything finished: every block is free or owned by the index.
    fn check_nothing_leaked(&self) -> Result<(), TestCaseError> {
        let stats = self.sched.stats();
        prop_assert_eq!(stats.blocks_in_use, 0, "blocks leaked: {:?}", stats);
        prop_assert_eq!(
            stats.blocks_free + stats.blocks_cached,
            self.sched.config().num_blocks
        );
        prop_assert_eq!((stats.waiting, stats.running), (0, 0));
        Ok(())
    }
}

impl Harness {
    /// A fresh tenant's prompt as long as the whole pool finishes only if
    /// every cached block can be evicted, i.e. no index lock outlived its request.
    fn check_no_lock_left(&mut self) -> Result<(), TestCaseError> {
        let cfg = *self.sched.config();
        let ids: Vec<u32> = (0..(cfg.num_blocks * cfg.block_size) as u32).collect();
        let req = request(self.next_id, 99, &ids);
        self.pages.register(&req);
        self.live.push(req.id);
        self.sched.admit(req).map_err(|e| TestCaseError::fail(e.to_string()))?;
        self.drain()?;
        prop_assert_eq!(self.sched.stats().blocks_cached, cfg.num_blocks);
        Ok(())
    }
}

fn run_case(case: &Case, index: Box<dyn PrefixIndex>) -> Result<(), TestCaseError> {
    let mut h = Harness::new(case.config, index)?;
    for op in &case.ops {
        h.apply(op, &case.bases)?;
    }
    h.drain()?;
    h.check_nothing_leaked()?;
    h.check_no_lock_left()
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(64),
        // Integration targets have no lib.rs beside them to persist failures next to.
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_operations_keep_every_invariant_with_the_reference_index(case in case()) {
        let index = Box::new(ReferenceIndex::new(case.config.block_size));
        run_case(&case, index)?;
    }

    #[test]
    fn random_operations_keep_every_invariant_with_the_radix_index(case in case()) {
        let config = RadixConfig { block_size: case.config.block_size, ..RadixConfig::default() };
        let index = RadixIndex::new(config).map_err(|e| TestCaseError::fail(e.to_string()))?;
        run_case(&case, Box::new(index))?;
    }
}
