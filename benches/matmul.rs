//! Questions: how much faster is the CPU backend's `matmul_t` (the `gemm` crate) than the
//! `matrixmultiply` products it replaced, on the products of a real prefill? And what do
//! bf16 and f16 weights (the dot-product kernel, `backend::cpu::dot_matmul`) cost against
//! f32 ones, at decode (1 row) and prefill sizes?
//!
//! Shapes are `bench ttft`'s embedded Qwen3-shaped model (hidden 512, 8 heads and 4 KV
//! heads of 64, intermediate 1536): q and o `[512, 512]`, k and v `[256, 512]`, the fused
//! gate/up `[3072, 512]`, down `[512, 1536]`, at 256 rows (a cached 2048+256 prompt's
//! suffix) and 2304 (the whole prompt uncached), and 1 (a decode step). `matrixmultiply` is the previous code:
//! one task per thread, each multiplying all rows by its slice of the weight's rows.
//! Throughput counts floating-point operations (`2 * rows * n * k`).

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use ndarray::{Array2, ArrayView2, Axis, linalg::general_mat_mul, parallel::prelude::*};
use omniprefix::backend::{Backend, HostWeight, Dtype};
use omniprefix::backend::cpu::CpuBackend;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn rand_rows(seed: u64, r: usize, c: usize) -> Array2<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    Array2::from_shape_fn((r, c), |_| rng.random::<f32>() * 2.0 - 1.0)
}

/// The replaced product: `matrixmultiply` over one column slice of `w` per thread.
fn matrixmultiply_split(x: ArrayView2<'_, f32>, w: ArrayView2<'_, f32>) -> Array2<f32> {
    let mut out = Array2::zeros((x.nrows(), w.nrows()));
    let cols = w.nrows().div_ceil(rayon::current_num_threads().max(1)).max(64);
    out.axis_chunks_iter_mut(Axis(1), cols)
        .into_par_iter()
        .zip(w.axis_chunks_iter(Axis(0), cols).into_par_iter())
        .for_each(|(mut o, wc)| general_mat_mul(1.0, &x, &wc.t(), 0.0, &mut o));
    out
}

fn matmul(c: &mut Criterion) {
    let backend = CpuBackend::new();
    let weights = [("q_o", 512, 512), ("k_v", 256, 512), ("gate_up", 3072, 512), ("down", 512, 1536)];
    for rows in [1, 256, 2304] {
        let mut group = c.benchmark_group(format!("matmul_t_{rows}_rows"));
        group.sample_size(10);
        for (name, n, k) in weights {
            let w = rand_rows(1, n, k);
            let x = rand_rows(2, rows, k);
            group.throughput(Throughput::Elements((2 * rows * n * k) as u64));
            group.bench_with_input(BenchmarkId::new("matrixmultiply", name), &(), |b, _| {
                b.iter(|| black_box(matrixmultiply_split(x.view(), w.view())))
            });
            for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
                let stored = HostWeight::from_f32(w.clone()).to_dtype(dtype).expect("a float dtype");
                let label = if dtype == Dtype::F32 { "gemm".to_string() } else { format!("dot_{dtype}") };
                group.bench_with_input(BenchmarkId::new(label, name), &(), |b, _| {
                    b.iter(|| black_box(backend.matmul_t(&x, &stored).expect("shapes agree")))
                });
            }
        }
        group.finish();
    }
}

criterion_group!(benches, matmul);
criterion_main!(benches);
