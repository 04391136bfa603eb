//! Question: how much of a prefill does a cached prefix save on the CPU backend?
//!
//! The same 512-token prompt runs (a) uncached, one whole-prompt step, and (b) with
//! its first 448 positions already in pages (`num_computed_tokens = 448`), the
//! step computing only the last 64 while still returning full `[512, hidden]`
//! hidden states. The performance model says (b)/(a) should approach the uncached
//! fraction (64/512) plus the cost of reading the prefix KV and gathering hidden rows.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, Throughput, criterion_group};
use omniprefix::backend::cpu::CpuBackend;
use omniprefix::batch::ScheduledBatch;
use omniprefix::kv::BlockTable;
use omniprefix::model::{CaptureSpec, Config, Thinker};
use omniprefix::prompt::Positions;
use omniprefix::runner::{ModelRunner, PromptInputs};

const LEN: usize = 512;
const CACHED: usize = 448;
const BLOCK: usize = 16;

/// Positions `a..b` of the prompt as one step over a contiguous block table.
fn step(prompt: &PromptInputs, a: usize, b: usize) -> ScheduledBatch {
    let table = BlockTable::new((0..(LEN / BLOCK) as u32).collect(), BLOCK);
    let seq = prompt.step(1, table, a..b).expect("step inside the prompt");
    ScheduledBatch { copies: vec![], seqs: vec![seq] }
}

fn prefill(c: &mut Criterion) {
    let backend = Arc::new(CpuBackend::new());
    let cfg = Config::tiny_qwen3(256, 4, 8, 2, 2048);
    let layers = cfg.num_hidden_layers;
    let thinker = Arc::new(Thinker::random(&*backend, cfg, 7).expect("random model"));
    let runner = ModelRunner::new(backend, thinker, CaptureSpec::default_for(layers)).expect("runner");
    let prompt = PromptInputs {
        token_ids: (0..LEN as u32).map(|i| (i * 7919) % 2048).collect(),
        embeds: vec![],
        positions: Positions::linear(LEN),
    };

    let mut group = c.benchmark_group("prefill_512_tokens");
    group.sample_size(10);
    group.throughput(Throughput::Elements(LEN as u64));
    let mut pages = runner.alloc_pages(LEN / BLOCK, BLOCK).expect("pages");
    let whole = step(&prompt, 0, LEN);
    group.bench_function("uncached", |b| {
        b.iter(|| black_box(runner.execute(&whole, &mut pages).expect("step")))
    });
    runner.execute(&step(&prompt, 0, CACHED), &mut pages).expect("prefix");
    let suffix = step(&prompt, CACHED, LEN);
    group.bench_function("cached_prefix_448", |b| {
        b.iter(|| black_box(runner.execute(&suffix, &mut pages).expect("step")))
    });
    group.finish();
}

criterion_group!(benches, prefill);
