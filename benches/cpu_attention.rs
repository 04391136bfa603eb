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
//! `cargo bench --bench cpu_attention`

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ndarray::Array2;
use omniprefix::backend::cpu::{CpuBackend, CpuPages};
use omniprefix::backend::{AttnHeads, AttnSeq, Backend, PagesSpec};
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
fn filled_pages(b: &CpuBackend, heads: AttnHeads, seqs: usize, len: usize, rng: &mut ChaCha8Rng) -> (CpuPages, Vec<Vec<u32>>) {
    let per_seq = len.div_ceil(BLOCK);
    let spec = PagesSpec {
        num_layers: 1,
        num_blocks: seqs * per_seq,
        block_size: BLOCK,
        kv_heads: heads.kv_heads,
        head_dim: heads.head_dim,
        captured: 0,
        hidden: 0,
    };
    let mut pages = b.alloc_pages(spec).expect("pages");
    let mut all: Vec<u32> = (0..spec.num_blocks as u32).collect();
    all.shuffle(rng);
    let tables: Vec<Vec<u32>> = all.chunks(per_seq).map(<[u32]>::to_vec).collect();
    for table in &tables {
        let slots: Vec<i64> = (0..len).map(|j| (table[j / BLOCK] as usize * BLOCK + j % BLOCK) as i64).collect();
        let width = spec.kv_width();
        let (k, v) = (random(rng, len, width), random(rng, len, width));
        b.write_kv(&mut pages, 0, &k, &v, &slots).expect("write_kv");
    }
    (pages, tables)
}

fn cpu_attention(c: &mut Criterion) {
    let b = CpuBackend::new();
    for kv_heads in [8, 4] {
        let heads = AttnHeads { num_heads: NUM_HEADS, kv_heads, head_dim: HEAD_DIM };
        let q_width = NUM_HEADS * HEAD_DIM;
        let mut rng = ChaCha8Rng::seed_from_u64(kv_heads as u64);
        let mut group = c.benchmark_group(format!("cpu_attention_{NUM_HEADS}h_{kv_heads}kv_d{HEAD_DIM}"));
        group.sample_size(10);
        let attend = |q: &Array2<f32>, pages: &CpuPages, seqs: &[AttnSeq<'_>]| {
            black_box(b.paged_attention(q, pages, 0, heads, seqs).expect("attention"));
        };

        let (cached, new) = (2048, 256);
        let (pages, tables) = filled_pages(&b, heads, 1, cached + new, &mut rng);
        let q = random(&mut rng, new, q_width);
        let seq = [AttnSeq { query_start: 0, num_new: new, num_computed: cached, block_table: &tables[0] }];
        group.throughput(Throughput::Elements(new as u64));
        group.bench_function(format!("prefill_cached/{cached}+{new}"), |t| t.iter(|| attend(&q, &pages, &seq)));
        let all = cached + new;
        let q = random(&mut rng, all, q_width);
        let seq = [AttnSeq { query_start: 0, num_new: all, num_computed: 0, block_table: &tables[0] }];
        group.throughput(Throughput::Elements(all as u64));
        group.bench_function(format!("prefill_uncached/0+{all}"), |t| t.iter(|| attend(&q, &pages, &seq)));
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
        group.bench_function(format!("decode/{nseq}x{len}"), |t| t.iter(|| attend(&q, &pages, &seqs)));
        group.finish();
    }
}

criterion_group!(benches, cpu_attention);
criterion_main!(benches);
