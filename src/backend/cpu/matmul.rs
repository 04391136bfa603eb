//! `x @ w^T` on the CPU, split over output columns.
//!
//! Each rayon task multiplies all rows of `x` by its own slice of `w`, so the
//! weight is packed once per product. (Splitting rows into 32-row chunks packed
//! the whole weight once per chunk: 27 % of a 2304-token prefill went to packing.)
//! Vocabulary-sized weights take plain dot products instead: packing the
//! 151936-row lm_head to multiply the one last row cost more than the multiply.
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
                for (j, w_row) in wc.rows().into_iter().enumerate() {
                    for (i, x_row) in x.rows().into_iter().enumerate() {
                        o[[i, j]] = x_row.dot(&w_row);
                    }
                }
            } else {
                general_mat_mul(1.0, &x, &wc.t(), 0.0, &mut o);
            }
        });
    out
}
