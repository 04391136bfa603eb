//! The CPU backend's weights: packed once into column panels at upload
//! ([`super::panel_matmul`]), in their stored type, and multiplied in place.

use std::ops::Range;

use ndarray::{Array2, ArrayView2};

use super::panel_matmul;
use crate::backend::{Dtype, FloatSlice, FloatVec, HostWeight};

/// `$body` with `$e` bound to the elements of a [`FloatSlice`], whatever their
/// type: one generic call written once for the three element types.
macro_rules! with_elements {
    ($slice:expr, $e:ident => $body:expr) => {
        match $slice {
            FloatSlice::F32($e) => $body,
            FloatSlice::Bf16($e) => $body,
            FloatSlice::F16($e) => $body,
        }
    };
}

/// A weight `[rows, cols]` as the CPU backend keeps it: its elements rearranged
/// into panels of output columns, in f32, bf16 or f16. Made by
/// [`Backend::upload_weight`](crate::backend::Backend::upload_weight).
///
/// ```
/// use ndarray::array;
/// use omniprefix::backend::{Backend, HostWeight, cpu::CpuBackend};
/// let cpu = CpuBackend::new();
/// let w = cpu.upload_weight(HostWeight::from_f32(array![[1.0f32, 2.0], [3.0, 4.0], [5.0, 6.0]]))?;
/// assert_eq!(w.shape(), [3, 2]);
/// assert_eq!(cpu.matmul_t(&array![[1.0f32, 1.0]], &w)?, array![[3.0f32, 7.0, 11.0]]);
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct PackedWeight {
    shape: [usize; 2],
    panels: FloatVec,
}

impl PackedWeight {
    /// `host` packed into panels (one pass over its elements).
    pub(crate) fn pack(host: &HostWeight) -> PackedWeight {
        let view = host.view();
        let panels = match view.elements() {
            FloatSlice::F32(e) => FloatVec::F32(panel_matmul::pack(view.matrix(e))),
            FloatSlice::Bf16(e) => FloatVec::Bf16(panel_matmul::pack(view.matrix(e))),
            FloatSlice::F16(e) => FloatVec::F16(panel_matmul::pack(view.matrix(e))),
        };
        PackedWeight { shape: host.shape(), panels }
    }

    /// `[rows, cols]`.
    pub fn shape(&self) -> [usize; 2] {
        self.shape
    }

    pub fn dtype(&self) -> Dtype {
        self.panels.dtype()
    }

    /// Row `r` widened to f32 (exact; an embedding lookup), written into `out`
    /// (`cols` long), so a lookup of many tokens allocates nothing per token.
    pub(crate) fn row_into(&self, r: usize, out: &mut [f32]) {
        let k = self.shape[1];
        with_elements!(self.panels.view(), e => {
            for (o, v) in out.iter_mut().zip(panel_matmul::row_f32(e, k, r)) {
                *o = v;
            }
        })
    }

    /// The matrix widened to f32 (exact).
    pub fn to_f32(&self) -> Array2<f32> {
        let [rows, cols] = self.shape;
        let mut out = Array2::zeros((rows, cols));
        for (r, mut row) in out.rows_mut().into_iter().enumerate() {
            let Some(row) = row.as_slice_mut() else {
                unreachable!("rows of a standard-layout array are contiguous")
            };
            self.row_into(r, row);
        }
        out
    }

    /// `x @ w[rows]^T`: the products with weight rows `rows` only (one expert of
    /// stacked ones), `[x.nrows(), rows.len()]`. `x` has `cols` columns and `rows`
    /// lies inside the weight (the callers check both).
    pub(crate) fn matmul_t(&self, x: ArrayView2<'_, f32>, rows: Range<usize>) -> Array2<f32> {
        let k = self.shape[1];
        with_elements!(self.panels.view(), e => panel_matmul::matmul_t(x, e, k, rows))
    }

    /// `x @ w^T` over every row.
    pub(crate) fn matmul_all(&self, x: ArrayView2<'_, f32>) -> Array2<f32> {
        self.matmul_t(x, 0..self.shape[0])
    }
}

impl From<Array2<f32>> for PackedWeight {
    /// An f32 weight, packed.
    fn from(a: Array2<f32>) -> Self {
        PackedWeight::pack(&HostWeight::from_f32(a))
    }
}
