//! Question: how fast is the CPU backend's paged attention on the shapes a prefill
//! and a decode step give it?
//!
//! One layer, 8 query heads with 8 or 4 KV heads (MHA and GQA 2), head_dim 64,
//! 16-token blocks in a shuffled block table, K/V already in pages:
//! * `prefill_cached/2048+256`: 256 new queries over 2048 cached + 256 new positions;
//! * `prefill_uncached/0+2304`: the same 2304 positions, all of them queries;
//! * `decode/8x2048`: 8 sequences of 2048 positions, one new query each (the last
//!   position); throughput = K/V bytes read.
//!
//! The same bench runs on any commit (it uses only the public `Backend` API), so a
//! kernel change is measured as before/after on one machine.
//!
//! `cargo bench --bench engine -- cpu_attention_`
//!
//! On a shared machine wall time swings with the other load; with
//! `CPU_ATTENTION_ITERS=n` the bench instead runs each case `n` times and prints
//! the process's CPU time per call (all threads, from `/proc/self/task/*/schedstat`)
//! next to the wall time, which is steadier while other processes take turns.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group};
use ndarray::Array2;
use omniprefix::backend::cpu::{CpuBackend, CpuPages};
use omniprefix::backend::{AttnHeads, AttnSeq, Backend, Dtype, PagesSpec};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const BLOCK: usize = 16;
const HEAD_DIM: usize = 64;
const NUM_HEADS: usize = 8;

fn random(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Array2<f32> {
    Array2::from_shape_fn((rows, cols), |_| rng.random::<f32>() * 2.0 - 1.0)
}

/// Pages holding `seqs` sequences of `len` positions each, in shuffled blocks; their block tables.
fn filled_pages(
    b: &CpuBackend, heads: AttnHeads, seqs: usize, len: usize, rng: &mut ChaCha8Rng,
) -> (CpuPages, Vec<Vec<u32>>) {
    let per_seq = len.div_ceil(BLOCK);
    let spec = PagesSpec {
        num_layers: 1,
        num_blocks: seqs * per_seq,
        block_size: BLOCK,
        kv_heads: heads.kv_heads,
        head_dim: heads.head_dim,
        captured: 0,
        hidden: 0,
        kv_dtype: Dtype::F32,
    };
    let mut pages = b.alloc_pages(spec).expect("pages");
    let mut all: Vec<u32> = (0..spec.num_blocks as u32).collect();
    all.shuffle(rng);
    let tables: Vec<Vec<u32>> = all.chunks(per_seq).map(<[u32]>::to_vec).collect();
    for table in &tables {
        let slots: Vec<i64> =
            (0..len).map(|j| (table[j / BLOCK] as usize * BLOCK + j % BLOCK) as i64).collect();
        let width = spec.kv_width();
        let (k, v) = (random(rng, len, width), random(rng, len, width));
        b.write_kv(&mut pages, 0, &k, &v, &slots).expect("write_kv");
    }
    (pages, tables)
}

/// CPU time of all this process's threads so far, in seconds (Linux; 0 elsewhere).
fn cpu_seconds() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0.0 };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .sum::<f64>()
        / 1e9
}

/// One bench case: criterion's timing, or `CPU_ATTENTION_ITERS` calls timed by CPU time.
fn case(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>, name: String,
    mut f: impl FnMut(),
) {
    match std::env::var("CPU_ATTENTION_ITERS").ok().and_then(|v| v.parse::<usize>().ok()) {
        Some(iters) => {
            f();
            let (cpu, wall) = (cpu_seconds(), std::time::Instant::now());
            for _ in 0..iters {
                f();
            }
            let per = |s: f64| s * 1e3 / iters as f64;
            println!(
                "{}/{name}: cpu {:.3} ms, wall {:.3} ms per call",
                group_name(),
                per(cpu_seconds() - cpu),
                per(wall.elapsed().as_secs_f64())
            );
        }
        None => {
            group.bench_function(name, |t| t.iter(&mut f));
        }
    }
}

thread_local!(static GROUP: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) });

fn group_name() -> String {
    GROUP.with(|g| g.borrow().clone())
}

fn cpu_attention(c: &mut Criterion) {
    let b = CpuBackend::new();
    for kv_heads in [8, 4] {
        let heads = AttnHeads { num_heads: NUM_HEADS, kv_heads, head_dim: HEAD_DIM };
        let q_width = NUM_HEADS * HEAD_DIM;
        let mut rng = ChaCha8Rng::seed_from_u64(kv_heads as u64);
        let name = format!("cpu_attention_{NUM_HEADS}h_{kv_heads}kv_d{HEAD_DIM}");
        GROUP.with(|g| *g.borrow_mut() = name.clone());
        let mut group = c.benchmark_group(name);
        group.sample_size(10);
        let attend = |q: &Array2<f32>, pages: &CpuPages, seqs: &[AttnSeq<'_>]| {
            black_box(b.paged_attention(q, pages, 0, heads, seqs).expect("attention"));
        };

        let (cached, new) = (2048, 256);
        let (pages, tables) = filled_pages(&b, heads, 1, cached + new, &mut rng);
        let q = random(&mut rng, new, q_width);
        let seq = [AttnSeq { query_start: 0, num_new: new, num_computed: cached, block_table: &tables[0] }];
        group.throughput(Throughput::Elements(new as u64));
        case(&mut group, format!("prefill_cached/{cached}+{new}"), || attend(&q, &pages, &seq));
        let all = cached + new;
        let q = random(&mut rng, all, q_width);
        let seq = [AttnSeq { query_start: 0, num_new: all, num_computed: 0, block_table: &tables[0] }];
        group.throughput(Throughput::Elements(all as u64));
        case(&mut group, format!("prefill_uncached/0+{all}"), || attend(&q, &pages, &seq));
        drop(pages);

        let (nseq, len) = (8, 2048);
        let (pages, tables) = filled_pages(&b, heads, nseq, len, &mut rng);
        let q = random(&mut rng, nseq, q_width);
        let seqs: Vec<AttnSeq<'_>> = tables
            .iter()
            .enumerate()
            .map(|(i, t)| AttnSeq { query_start: i, num_new: 1, num_computed: len - 1, block_table: t })
            .collect();
        let kv_bytes = (2 * nseq * len * kv_heads * HEAD_DIM * std::mem::size_of::<f32>()) as u64;
        group.throughput(Throughput::Bytes(kv_bytes));
        case(&mut group, format!("decode/{nseq}x{len}"), || attend(&q, &pages, &seqs));
        group.finish();
    }
}

criterion_group!(benches, cpu_attention);
