//! Questions: how fast are the CPU backend's products over weights packed once into
//! panels (`backend::cpu::panel_matmul`), against the `gemm` crate (`--features bench-gemm`; it packs the weight
//! on every call) and ndarray's `matrixmultiply`, at decode (1 and 8 rows) and prefill
//! sizes? And what do bf16 and f16 weights cost against f32 ones?
//!
//! Shapes are `bench ttft`'s embedded Qwen3-shaped model (hidden 512, 8 heads and 4 KV
//! heads of 64, intermediate 1536): q and o `[512, 512]`, k and v `[256, 512]`, the fused
//! gate/up `[3072, 512]`, down `[512, 1536]`, and the untied lm_head `[151936, 512]` at
//! decode sizes, at 256 rows (a cached 2048+256 prompt's suffix) and 2304 (the whole
//! prompt uncached), and 1 and 8 (decode steps). `matrixmultiply` is split as the backend
//! once did: one task per thread, each multiplying all rows by its slice of the weight's rows.
//! Throughput counts floating-point operations (`2 * rows * n * k`).

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use ndarray::{Array2, ArrayView2, Axis, linalg::general_mat_mul, parallel::prelude::*};
use omniprefix::backend::cpu::CpuBackend;
use omniprefix::backend::{Backend, Dtype, HostWeight};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn rand_rows(seed: u64, r: usize, c: usize) -> Array2<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    Array2::from_shape_fn((r, c), |_| rng.random::<f32>() * 2.0 - 1.0)
}

/// `matrixmultiply` over one column slice of `w` per thread.
fn matrixmultiply_split(x: ArrayView2<'_, f32>, w: ArrayView2<'_, f32>) -> Array2<f32> {
    let mut out = Array2::zeros((x.nrows(), w.nrows()));
    let cols = w.nrows().div_ceil(rayon::current_num_threads().max(1)).max(64);
    out.axis_chunks_iter_mut(Axis(1), cols)
        .into_par_iter()
        .zip(w.axis_chunks_iter(Axis(0), cols).into_par_iter())
        .for_each(|(mut o, wc)| general_mat_mul(1.0, &x, &wc.t(), 0.0, &mut o));
    out
}

/// `x @ w^T` in one `gemm` call on rayon's pool (it packs `w` on every call);
/// with `--features bench-gemm` only (its kernels take a minute to compile).
#[cfg(feature = "bench-gemm")]
fn gemm_t(x: ArrayView2<'_, f32>, w: ArrayView2<'_, f32>) -> Array2<f32> {
    let (m, n, k) = (x.nrows(), w.nrows(), w.ncols());
    let (x, w) = (x.as_standard_layout(), w.as_standard_layout());
    let mut out = Array2::<f32>::zeros((m, n));
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: `out` is `[m, n]`, `x` `[m, k]` and `w` `[n, k]`, all contiguous row-major, so every
    // element the strides reach lies inside its buffer; `out` is written, not read, and aliases neither.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
    out
}

fn matmul(c: &mut Criterion) {
    let backend = CpuBackend::new();
    let layers = [("q_o", 512, 512), ("k_v", 256, 512), ("gate_up", 3072, 512), ("down", 512, 1536)];
    let lm_head = ("lm_head", 151_936, 512);
    for rows in [1, 8, 256, 2304] {
        let mut group = c.benchmark_group(format!("matmul_t_{rows}_rows"));
        group.sample_size(10);
        let shapes = if rows <= 8 { [&layers[..], &[lm_head]].concat() } else { layers.to_vec() };
        for (name, n, k) in shapes {
            let w = rand_rows(1, n, k);
            let x = rand_rows(2, rows, k);
            group.throughput(Throughput::Elements((2 * rows * n * k) as u64));
            group.bench_with_input(BenchmarkId::new("matrixmultiply", name), &(), |b, _| {
                b.iter(|| black_box(matrixmultiply_split(x.view(), w.view())))
            });
            #[cfg(feature = "bench-gemm")]
            group.bench_with_input(BenchmarkId::new("gemm", name), &(), |b, _| {
                b.iter(|| black_box(gemm_t(x.view(), w.view())))
            });
            for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
                let host = HostWeight::from_f32(w.clone()).to_dtype(dtype).expect("a float dtype");
                let packed = backend.upload_weight(host).expect("the CPU stores every float dtype");
                group.bench_with_input(BenchmarkId::new(format!("panels_{dtype}"), name), &(), |b, _| {
                    b.iter(|| black_box(backend.matmul_t(&x, &packed).expect("shapes agree")))
                });
            }
        }
        group.finish();
    }
}

criterion_group!(benches, matmul);
