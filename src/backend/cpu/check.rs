//! Operand checks shared by the CPU ops: each returns the structured error the
//! `Backend` contract promises.

use ndarray::Array2;

use crate::error::BackendError;
use crate::{Error, Result};

/// A shape error for operand `what` of `op`.
pub(crate) fn shape_error(
    op: &'static str, what: &'static str, expected: String, found: &Array2<f32>,
) -> Error {
    BackendError::OpShape { op, what, expected, found: found.shape().to_vec() }.into()
}

/// `t` must have `rows` rows.
pub(crate) fn expect_rows(op: &'static str, what: &'static str, t: &Array2<f32>, rows: usize) -> Result<()> {
    if t.nrows() == rows { Ok(()) } else { Err(shape_error(op, what, format!("[{rows}, _]"), t)) }
}

/// `t` must have `cols` columns.
pub(crate) fn expect_cols(op: &'static str, what: &'static str, t: &Array2<f32>, cols: usize) -> Result<()> {
    if t.ncols() == cols { Ok(()) } else { Err(shape_error(op, what, format!("[_, {cols}]"), t)) }
}

/// `index` must lie in `0..bound`; returns it as a usize.
pub(crate) fn row_index(op: &'static str, what: &'static str, index: i64, bound: usize) -> Result<usize> {
    usize::try_from(index)
        .ok()
        .filter(|&i| i < bound)
        .ok_or(BackendError::OpIndex { op, what, index, bound }.into())
}
