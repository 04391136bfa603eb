//! `x @ w^T` on the CPU: the `gemm` crate's packed kernels for model-sized
//! weights, dot products for vocabulary-sized ones.
//!
//! Weights of [`GEMM_MIN_COLS`] up to [`DOT_MIN_COLS`] rows (output columns) go
//! through one `gemm` call over the whole product: it packs each operand once,
//! picks its AVX2 / AVX-512 / NEON kernel at run time and splits the output
//! tiles (never `k`) over rayon's threads. Vocabulary-sized weights take the
//! dot kernel ([`super::dot_matmul`]) instead: packing the 151936-row lm_head
//! to multiply the one last row cost more than the multiply. It reads each
//! weight row once for all rows of `x`, with 8-lane fused multiply-adds where
//! the CPU has them, so a decode step of 8 sequences costs about what one does
//! (the weight read, not the multiply, bounds it). Weights narrower than [`GEMM_MIN_COLS`]
//! (a MoE router, test models) stay on ndarray's `matrixmultiply`.
//!
//! The path depends on the weight only, never on the row count, and on every
//! path an element's sum runs over `k` in an order fixed by `k` alone: a row's
//! result is the same to the last bit whatever rows share the product, which is
//! what keeps cached and uncached prefills bit-identical on this backend.
//! `gemm` keeps that for its main path (its `k` blocks depend on `k` and the
//! cache sizes; tiles and threads only change which elements a kernel call
//! writes), but it has other paths for tiny products: a gemv for one row and
//! horizontal dot kernels when `rows * cols <= 256`, whose sums run in another
//! order. [`GEMM_MIN_COLS`] and [`GEMM_MIN_ROWS`] (fewer rows are padded with
//! zero rows) keep every call on the main path; the tests check it bit for bit.

use ndarray::{Array2, ArrayView2, Axis, linalg::general_mat_mul, parallel::prelude::*, s};

use crate::backend::{FloatSlice, WeightView};

/// Weights with at least this many rows (output columns) take the dot kernel.
const DOT_MIN_COLS: usize = 16_384;
/// Weights with fewer rows than this stay on `matrixmultiply`: with at least
/// [`GEMM_MIN_ROWS`] rows a `gemm` call then has `rows * cols > 256` and more
/// than 64 columns, so it takes neither the horizontal kernels nor the small-size
/// `k` blocking.
const GEMM_MIN_COLS: usize = 128;
/// Fewer rows than this are padded with zero rows, so `gemm` never takes its
/// one-row gemv (a decode step of one sequence would otherwise sum in another order).
const GEMM_MIN_ROWS: usize = 4;
/// Fewest output columns per task on the `matrixmultiply` path.
const MIN_COLS_PER_TASK: usize = 64;

/// `x @ w^T` for a weight in any stored dtype: f32 through [`matmul_t`], half
/// precision through the dot kernel (each weight decides its path, never the rows).
pub(crate) fn matmul_weight(x: ArrayView2<'_, f32>, w: WeightView<'_>) -> Array2<f32> {
    match w.elements() {
        FloatSlice::F32(e) => matmul_t(x, w.matrix(e)),
        FloatSlice::Bf16(e) => super::dot_matmul::matmul_t(x, w.matrix(e)),
        FloatSlice::F16(e) => super::dot_matmul::matmul_t(x, w.matrix(e)),
    }
}

/// `x @ w^T` for an f32 weight, on the path its row count picks.
pub(crate) fn matmul_t(x: ArrayView2<'_, f32>, w: ArrayView2<'_, f32>) -> Array2<f32> {
    match w.nrows() {
        n if n >= DOT_MIN_COLS => super::dot_matmul::matmul_t(x, w),
        n if n >= GEMM_MIN_COLS => gemm_t(x, w),
        _ => matrixmultiply_t(x, w),
    }
}

/// `x @ w^T` through `matrixmultiply`, one task per slice of the weight's rows.
fn matrixmultiply_t(x: ArrayView2<'_, f32>, w: ArrayView2<'_, f32>) -> Array2<f32> {
    let n = w.nrows();
    let mut out = Array2::zeros((x.nrows(), n));
    let cols = n.div_ceil(rayon::current_num_threads().max(1)).max(MIN_COLS_PER_TASK);
    out.axis_chunks_iter_mut(Axis(1), cols)
        .into_par_iter()
        .zip(w.axis_chunks_iter(Axis(0), cols).into_par_iter())
        .for_each(|(mut o, wc)| general_mat_mul(1.0, &x, &wc.t(), 0.0, &mut o));
    out
}

/// `x @ w^T` in one `gemm` call on rayon's current pool, both operands in
/// standard layout (the same strides for every call, so the same packing
/// choices), fewer than [`GEMM_MIN_ROWS`] rows padded with zero rows.
fn gemm_t(x: ArrayView2<'_, f32>, w: ArrayView2<'_, f32>) -> Array2<f32> {
    let (m, n, k) = (x.nrows(), w.nrows(), w.ncols());
    assert_eq!(x.ncols(), k, "matmul_t: x and w disagree on k");
    if m == 0 {
        return Array2::zeros((0, n));
    }
    if m < GEMM_MIN_ROWS {
        let mut padded = Array2::zeros((GEMM_MIN_ROWS, k));
        padded.slice_mut(s![..m, ..]).assign(&x);
        return gemm_t(padded.view(), w).slice(s![..m, ..]).to_owned();
    }
    let x = x.as_standard_layout();
    let w = w.as_standard_layout();
    let mut out = Array2::<f32>::zeros((m, n));
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: `out` is `[m, n]`, `x` `[m, k]` and `w` `[n, k]`, all contiguous row-major, so
    // every element the strides below reach lies inside its buffer: dst (i, j) at i*n + j,
    // lhs (i, c) at i*k + c, rhs = w^T, (c, j) at j*k + c. `out` is written, not read
    // (`read_dst` false), and aliases neither input.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::test_support::{pool, rand_rows};

    /// The invariant that keeps caching invisible: every row of a product is the
    /// same to the last bit whether it is multiplied alone, in a small batch or in a
    /// large one, at any offset in it and with any thread count, on each path
    /// (`matrixmultiply` below [`GEMM_MIN_COLS`], `gemm`, dot products from
    /// [`DOT_MIN_COLS`]) and for `k` inside one `gemm` block and over several.
    #[test]
    fn rows_are_bit_identical_across_batch_sizes_offsets_and_threads() {
        const ALL: usize = 300;
        let shapes = [
            (GEMM_MIN_COLS - 1, 64),
            (GEMM_MIN_COLS, 9),
            (GEMM_MIN_COLS, 512),
            (200, 300),
            (256, 512),
            (512, 1536),
            (1000, 2100),
            (3072, 512),
            (DOT_MIN_COLS, 12),
        ];
        let (one, two) = (pool(1), pool(2));
        for (n, k) in shapes {
            let w = rand_rows(n as u64, n, k);
            let x = rand_rows(k as u64 + 1, ALL, k);
            let all = two.install(|| matmul_t(x.view(), w.view()));
            assert_eq!(all.dim(), (ALL, n));
            assert_eq!(one.install(|| matmul_t(x.view(), w.view())), all, "n {n} k {k}: 1 thread differs from 2");
            for r in [0, 17, ALL - 1] {
                for c in [0, n / 2, n - 1] {
                    let want: f64 = (0..k).map(|i| x[[r, i]] as f64 * w[[c, i]] as f64).sum();
                    let tol = 1e-5 * (k as f64).sqrt().max(1.0);
                    assert!((all[[r, c]] as f64 - want).abs() < tol, "n {n} k {k}: ({r},{c}) {} vs {want}", all[[r, c]]);
                }
            }
            for m in [1, 2, 3, 17, 256] {
                for start in [0, 5, ALL - m] {
                    let part = x.slice(s![start..start + m, ..]);
                    let got = two.install(|| matmul_t(part, w.view()));
                    assert!(
                        got == all.slice(s![start..start + m, ..]),
                        "n {n} k {k}: rows {start}..{} multiplied as a batch of {m} differ from the same rows of {ALL}",
                        start + m
                    );
                }
            }
        }
    }
}

