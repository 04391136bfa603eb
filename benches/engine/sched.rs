//! Scheduler overhead: how long admitting, scheduling, completing and
//! finishing requests takes, with the radix index, when nothing runs the model.
//!
//! Workload: 64 text requests of 1024 tokens sharing a 768-token system prefix
//! (block size 16, chunked prefill budget 8192 tokens per step). Reported per
//! prompt token, against a reference measured in the same run: copying every
//! request's token ids once (the least any scheduler must touch).

use std::hint::black_box;

use criterion::{BatchSize, Criterion, Throughput, criterion_group};
use omniprefix::index::radix::{RadixConfig, RadixIndex};
use omniprefix::prompt::CanonicalPrompt;
use omniprefix::sched::{PrefillCap, Request, Scheduler, SchedulerConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const REQUESTS: u64 = 64;
const LEN: usize = 1024;
const SHARED: usize = 768;

fn requests() -> Vec<Request> {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let prefix: Vec<u32> = (0..SHARED).map(|_| rng.random_range(0..150_000)).collect();
    (0..REQUESTS)
        .map(|id| {
            let mut ids = prefix.clone();
            ids.extend((SHARED..LEN).map(|_| rng.random_range(0..150_000)));
            Request::new(id, CanonicalPrompt::text(0, ids))
        })
        .collect()
}

fn run_all(reqs: Vec<Request>) -> usize {
    let config = SchedulerConfig {
        num_blocks: 8192,
        block_size: 16,
        max_tokens_per_step: 8192,
        max_seqs_per_step: 64,
        prefill_cap: PrefillCap::Off,
        token_granular_reuse: true,
    };
    let index = RadixIndex::new(RadixConfig { block_size: 16 }).expect("valid radix config");
    let mut sched = Scheduler::new(config, Box::new(index)).expect("valid scheduler config");
    for r in reqs {
        sched.admit(r).expect("request fits");
    }
    let mut steps = 0;
    loop {
        let batch = sched.schedule().expect("schedule");
        if batch.seqs.is_empty() {
            return steps;
        }
        for id in sched.complete(&batch).expect("complete") {
            sched.finish(id).expect("finish");
        }
        steps += 1;
    }
}

fn bench(c: &mut Criterion) {
    let reqs = requests();
    let mut group = c.benchmark_group("sched");
    group.throughput(Throughput::Elements(REQUESTS * LEN as u64));
    group.bench_function("reference_copy_token_ids", |b| {
        b.iter(|| reqs.iter().map(|r| black_box(r.prompt.token_ids.clone()).len()).sum::<usize>())
    });
    group.bench_function("admit_schedule_complete_finish", |b| {
        b.iter_batched(|| reqs.clone(), run_all, BatchSize::LargeInput)
    });
    group.finish();
}

criterion_group!(benches, bench);
