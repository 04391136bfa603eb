//! `x @ w^T` on the CPU, split over output columns.
//!
//! Each rayon task multiplies all rows of `x` by its own slice of `w`, so the
//! weight is packed once per product. (Splitting rows into 32-row chunks packed
//! the whole weight once per chunk: 27 % of a 2304-token prefill went to packing.)
//! Vocabulary-sized weights take dot products instead: packing the 151936-row
//! lm_head to multiply the one last row cost more than the multiply. Each
//! weight row is read once for all rows of `x` (four at a time), with 8-lane
//! fused multiply-adds where the CPU has them, so a decode step of 8 sequences
//! costs about what one does (the weight read, not the multiply, bounds it).
//!
//! The path depends on the weight only, never on the row count, and on either
//! path an element's sum runs over `k` in an order fixed by `k` alone: a row's
//! result is the same to the last bit whatever rows share the product, which is
//! what keeps cached and uncached prefills bit-identical on this backend.

use ndarray::{Array2, ArrayView2, Axis, linalg::general_mat_mul, parallel::prelude::*};

/// Weights with at least this many rows (output columns) take dot products.
const DOT_MIN_COLS: usize = 16_384;
/// Fewest output columns per task, so small products stay whole.
const MIN_COLS_PER_TASK: usize = 64;

pub(crate) fn matmul_t(x: ArrayView2<'_, f32>, w: ArrayView2<'_, f32>) -> Array2<f32> {
    let (m, n) = (x.nrows(), w.nrows());
    let mut out = Array2::zeros((m, n));
    let dots = n >= DOT_MIN_COLS;
    // Dot products are memory-bound: more, smaller tasks balance the threads better.
    let tasks = rayon::current_num_threads().max(1) * if dots { 8 } else { 1 };
    let cols = n.div_ceil(tasks).max(MIN_COLS_PER_TASK);
    out.axis_chunks_iter_mut(Axis(1), cols)
        .into_par_iter()
        .zip(w.axis_chunks_iter(Axis(0), cols).into_par_iter())
        .for_each(|(mut o, wc)| {
            if dots {
                dot_rows(x, wc, &mut o);
            } else {
                general_mat_mul(1.0, &x, &wc.t(), 0.0, &mut o);
            }
        });
    out
}

/// `o[i, j] = x[i] · w[j]` for every row pair, each weight row loaded once
/// for four rows of `x`. Every element goes through the same arithmetic
/// ([`dots`]) whatever rows share the call.
fn dot_rows(x: ArrayView2<'_, f32>, w: ArrayView2<'_, f32>, o: &mut ndarray::ArrayViewMut2<'_, f32>) {
    let x = x.as_standard_layout();
    let w = w.as_standard_layout();
    let (Some(xs), Some(ws)) = (x.as_slice(), w.as_slice()) else { return };
    let k = w.ncols();
    let rows: Vec<&[f32]> = xs.chunks_exact(k.max(1)).collect();
    let fma = fma_available();
    for (j, w_row) in ws.chunks_exact(k.max(1)).enumerate() {
        for (g, group) in rows.chunks(4).enumerate() {
            let sums = match *group {
                [a, b, c, d] => dots(fma, w_row, [a, b, c, d]).to_vec(),
                _ => group.iter().map(|r| dots(fma, w_row, [r])[0]).collect(),
            };
            for (i, s) in sums.into_iter().enumerate() {
                o[[g * 4 + i, j]] = s;
            }
        }
    }
}

/// Whether the AVX2 + FMA build of [`dot_lanes`] can run (checked once).
fn fma_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `w · xs[r]` for `N` rows: the AVX2 + FMA build of [`dot_lanes`] when
/// `fma`, the portable one otherwise (a machine always takes the same one).
fn dots<const N: usize>(fma: bool, w: &[f32], xs: [&[f32]; N]) -> [f32; N] {
    #[cfg(target_arch = "x86_64")]
    if fma && xs.iter().all(|x| x.len() >= w.len()) {
        // SAFETY: `fma_available` confirmed AVX2 and FMA on this CPU, and the rows are long enough.
        return unsafe { dots_fma(w, xs) };
    }
    let _ = fma;
    dot_lanes(w, xs)
}

/// [`dot_lanes`] with 8-lane AVX2 registers and fused multiply-adds.
///
/// # Safety
/// The CPU must have AVX2 and FMA, and every row of `xs` at least `w.len()` elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots_fma<const N: usize>(w: &[f32], xs: [&[f32]; N]) -> [f32; N] {
    use std::arch::x86_64::{_mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps, _mm256_storeu_ps};
    let full = w.len() / 8 * 8;
    let mut acc = [_mm256_setzero_ps(); N];
    let mut c = 0;
    while c < full {
        // SAFETY: c + 8 <= w.len() <= every row's length (the caller's contract).
        let wv = unsafe { _mm256_loadu_ps(w.as_ptr().add(c)) };
        for (a, x) in acc.iter_mut().zip(&xs) {
            *a = _mm256_fmadd_ps(wv, unsafe { _mm256_loadu_ps(x.as_ptr().add(c)) }, *a);
        }
        c += 8;
    }
    let mut out = [0f32; N];
    for ((o, a), x) in out.iter_mut().zip(&acc).zip(xs) {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *a) };
        *o = reduce(&lanes, &w[full..], &x[full..w.len()], f32::mul_add);
    }
    out
}

/// Eight lanes of multiply-adds over `k` in steps of 8, the lanes summed in
/// a fixed tree, then the tail: an element's result depends on its two rows
/// alone, never on `N` or the other rows.
#[inline(always)]
fn dot_lanes<const N: usize>(w: &[f32], xs: [&[f32]; N]) -> [f32; N] {
    let (w8, w_tail) = w.as_chunks::<8>();
    let x8 = xs.map(|x| x.as_chunks::<8>().0);
    let mut acc = [[0f32; 8]; N];
    for (c, wl) in w8.iter().enumerate() {
        for (a, x) in acc.iter_mut().zip(&x8) {
            let Some(xl) = x.get(c) else { continue };
            for l in 0..8 {
                a[l] += wl[l] * xl[l];
            }
        }
    }
    let mut out = [0f32; N];
    for ((o, a), x) in out.iter_mut().zip(&acc).zip(xs) {
        let tail = x.get(w8.len() * 8..w.len()).unwrap_or_default();
        *o = reduce(a, w_tail, tail, |a, b, c| a * b + c);
    }
    out
}

/// The lanes summed in a fixed tree, then the tail's products added in order.
#[inline(always)]
fn reduce(lanes: &[f32; 8], w_tail: &[f32], x_tail: &[f32], madd: impl Fn(f32, f32, f32) -> f32) -> f32 {
    let a = lanes;
    let mut s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    for (wk, xk) in w_tail.iter().zip(x_tail) {
        s = madd(*wk, *xk, s);
    }
    s
}
