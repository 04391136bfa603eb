//! Question: what does reading the cached prefix K/V straight from pages save, per
//! backend, against the two alternatives an engine without a paged kernel has?
//!
//! For a prompt of `prefix + suffix` positions whose K/V are all in pages (one layer,
//! 16 query heads / 4 KV heads / head_dim 64, 16-token blocks in a shuffled block table):
//! * `paged_prefix`: the suffix queries attend over prefix-from-pages + suffix (what
//!   a cached prefill does);
//! * `recompute_full`: every prompt position is a query (no prefix caching);
//! * `gather_then_dense`: the sequence's blocks are first copied into a contiguous
//!   run of blocks (the gather), then attention reads that dense K/V;
//! * `decode`: one query at the last position, reading every K/V byte of the sequence
//!   once per KV head; throughput = K/V bytes read;
//! * `copy_kv`: a buffer-to-buffer copy of the same K/V bytes; throughput = bytes read
//!   plus bytes written (STREAM "copy" convention). Decode bandwidth / copy bandwidth
//!   is the fraction of the memory roofline decode attention reaches.
//!
//! Sizes (prefix/suffix): 2048/256 and 8192/512. `OMNIPREFIX_ATTN_BENCH_SCALE=k`
//! divides both by `k` (lavapipe and the CPU reference are slow; numbers there are
//! for regression tracking only). Runs on the wgpu adapter when there is one and on
//! the CPU backend; every measured op is followed by a device synchronisation.
//!
//! `WGPU_BACKEND=vulkan cargo bench --bench attention`

use std::hint::black_box;

use criterion::{
    BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main, measurement::WallTime,
};
use ndarray::Array2;
use omniprefix::backend::cpu::CpuBackend;
use omniprefix::backend::wgpu::WgpuBackend;
use omniprefix::backend::{AttnHeads, AttnSeq, Backend, Dtype, PagesSpec};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const HEADS: AttnHeads = AttnHeads { num_heads: 16, kv_heads: 4, head_dim: 64 };
const BLOCK: usize = 16;
const SIZES: [(usize, usize); 2] = [(2048, 256), (8192, 512)];

/// A backend under test and how to wait for its queued work.
trait Timed: Backend {
    fn sync(&self);
    /// One plain copy of `src` into `dst`.
    fn copy(&self, src: &Self::Tensor, dst: &mut Self::Tensor);
}

impl Timed for CpuBackend {
    fn sync(&self) {}
    fn copy(&self, src: &Array2<f32>, dst: &mut Array2<f32>) {
        dst.assign(src);
    }
}

impl Timed for WgpuBackend {
    fn sync(&self) {
        self.context().synchronize().expect("synchronize");
    }
    fn copy(&self, src: &Self::Tensor, dst: &mut Self::Tensor) {
        self.context().copy_tensor(src, dst).expect("copy");
    }
}

fn scale() -> usize {
    std::env::var("OMNIPREFIX_ATTN_BENCH_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&k| k > 0)
        .unwrap_or(1)
}

fn random(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Array2<f32> {
    Array2::from_shape_fn((rows, cols), |_| rng.random::<f32>() * 2.0 - 1.0)
}

/// Benches one prompt shape on one backend.
fn bench_shape<B: Timed>(group: &mut BenchmarkGroup<'_, WallTime>, b: &B, prefix: usize, suffix: usize) {
    let len = prefix + suffix;
    let blocks = len.div_ceil(BLOCK);
    let kv_width = HEADS.kv_heads * HEADS.head_dim;
    let q_width = HEADS.num_heads * HEADS.head_dim;
    let mut rng = ChaCha8Rng::seed_from_u64(len as u64);
    // Blocks 0..blocks receive the gather; the sequence lives, shuffled, in the rest.
    let mut table: Vec<u32> = (blocks as u32..2 * blocks as u32).collect();
    table.shuffle(&mut rng);
    let dense: Vec<u32> = (0..blocks as u32).collect();
    let spec = PagesSpec {
        num_layers: 1,
        num_blocks: 2 * blocks,
        block_size: BLOCK,
        kv_heads: HEADS.kv_heads,
        head_dim: HEADS.head_dim,
        captured: 0,
        hidden: 0,
        kv_dtype: Dtype::F32,
    };
    let mut pages = b.alloc_pages(spec).expect("pages");
    let slots: Vec<i64> = (0..len).map(|j| (table[j / BLOCK] as usize * BLOCK + j % BLOCK) as i64).collect();
    let up = |m: Array2<f32>| b.upload(m.view()).expect("upload");
    let (k, v) = (up(random(&mut rng, len, kv_width)), up(random(&mut rng, len, kv_width)));
    b.write_kv(&mut pages, 0, &k, &v, &slots).expect("write_kv");
    let q_full = up(random(&mut rng, len, q_width));
    let q_suffix = up(random(&mut rng, suffix, q_width));
    let q_one = up(random(&mut rng, 1, q_width));
    let gather: Vec<(u32, u32)> = table.iter().copied().zip(dense.iter().copied()).collect();

    let seq =
        |num_new, num_computed, block_table| AttnSeq { query_start: 0, num_new, num_computed, block_table };
    let attend = |q: &B::Tensor, pages: &B::Pages, s: AttnSeq<'_>| {
        let out = b.paged_attention(q, pages, 0, HEADS, &[s]).expect("attention");
        b.sync();
        black_box(out);
    };
    let label = |case: &str| format!("{}/{case}/{prefix}+{suffix}", b.name());

    group.throughput(Throughput::Elements(suffix as u64));
    group.bench_function(label("paged_prefix"), |t| {
        t.iter(|| attend(&q_suffix, &pages, seq(suffix, prefix, &table)))
    });
    group.bench_function(label("gather_then_dense"), |t| {
        t.iter(|| {
            b.copy_blocks(&mut pages, &gather).expect("gather");
            attend(&q_suffix, &pages, seq(suffix, prefix, &dense));
        })
    });
    group.throughput(Throughput::Elements(len as u64));
    group
        .bench_function(label("recompute_full"), |t| t.iter(|| attend(&q_full, &pages, seq(len, 0, &table))));

    let kv_bytes = (2 * len * kv_width * std::mem::size_of::<f32>()) as u64;
    group.throughput(Throughput::Bytes(kv_bytes));
    group.bench_function(label("decode"), |t| t.iter(|| attend(&q_one, &pages, seq(1, len - 1, &table))));
    let kv_both = up(Array2::zeros((2 * len, kv_width)));
    let mut copy_dst = up(Array2::zeros((2 * len, kv_width)));
    group.throughput(Throughput::Bytes(2 * kv_bytes));
    group.bench_function(label("copy_kv"), |t| {
        t.iter(|| {
            b.copy(&kv_both, &mut copy_dst);
            b.sync();
        })
    });
}

fn attention(c: &mut Criterion) {
    let gpu = match WgpuBackend::new() {
        Ok(gpu) => {
            eprintln!("attention bench on {}", gpu.context().adapter_name());
            Some(gpu)
        }
        Err(e) => {
            eprintln!("!!!! no wgpu adapter ({e}): attention bench runs on the CPU backend only !!!!");
            None
        }
    };
    let k = scale();
    for (prefix, suffix) in SIZES {
        let (prefix, suffix) = (prefix / k, (suffix / k).max(1));
        let mut group = c.benchmark_group(format!("attention_{prefix}+{suffix}"));
        group.sample_size(10);
        if let Some(gpu) = &gpu {
            bench_shape(&mut group, gpu, prefix, suffix);
        }
        bench_shape(&mut group, &CpuBackend, prefix, suffix);
        group.finish();
    }
}

criterion_group!(benches, attention);
criterion_main!(benches);
