//! Weight matrices in the precision they are stored in: f32, or bf16 / f16 at
//! half the bytes. Activations stay f32 and every product accumulates in f32;
//! only the stored weight (or K/V page) is narrower.
//!
//! A decode step reads every weight once, so at batch 1 the bytes of the weights
//! bound its speed: half-precision weights halve them.

use ndarray::{Array2, ArrayView2, ErrorKind, ShapeError};

use super::floats::{FloatSlice, FloatVec};
pub use crate::dtype::{Dtype, UnknownDtype};

/// A host weight matrix `[rows, cols]` (HF Linear layout `[out, in]`): its shape
/// and its elements, row-major, in their stored type.
///
/// ```
/// use ndarray::array;
/// use omniprefix::backend::{HostWeight, Dtype};
/// let w = HostWeight::from_f32(array![[1.0f32, 0.1], [3.0, -2.5]]).to_dtype(Dtype::Bf16)?;
/// assert_eq!((w.dtype(), w.shape(), w.bytes()), (Dtype::Bf16, [2, 2], 8));
/// assert_eq!(w.to_f32()[[0, 1]], 0.10009765625); // 0.1 rounded to 8 mantissa bits
/// assert!(w.to_dtype(Dtype::I32).is_err()); // weights are stored in a float type
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct HostWeight {
    shape: [usize; 2],
    elements: FloatVec,
}

/// `elements` (row-major, as many as `shape` holds) as an ndarray view.
fn matrix<T>(shape: [usize; 2], elements: &[T]) -> ArrayView2<'_, T> {
    ArrayView2::from_shape(shape, elements).expect("a weight holds rows * cols elements")
}

impl HostWeight {
    /// A `[rows, cols]` weight of `elements` (row-major); an error when their
    /// number is not `rows * cols`.
    pub fn new(shape: [usize; 2], elements: FloatVec) -> Result<HostWeight, ShapeError> {
        if shape[0].checked_mul(shape[1]) != Some(elements.len()) {
            return Err(ShapeError::from_kind(ErrorKind::IncompatibleShape));
        }
        Ok(HostWeight { shape, elements })
    }

    /// An f32 weight, in the order of `a`'s rows (no copy when `a` is row-major).
    pub fn from_f32(a: Array2<f32>) -> HostWeight {
        let shape = [a.nrows(), a.ncols()];
        let elements = if a.is_standard_layout() {
            let (mut v, offset) = a.into_raw_vec_and_offset();
            // Row-major: the elements are contiguous from `offset`.
            v.drain(..offset.unwrap_or(0).min(v.len()));
            v.truncate(shape[0] * shape[1]);
            v
        } else {
            a.iter().copied().collect()
        };
        HostWeight { shape, elements: FloatVec::F32(elements) }
    }

    pub fn dtype(&self) -> Dtype {
        self.elements.dtype()
    }

    /// `[rows, cols]`.
    pub fn shape(&self) -> [usize; 2] {
        self.shape
    }

    /// Bytes the elements occupy.
    pub fn bytes(&self) -> usize {
        self.elements.len() * self.dtype().size_bytes()
    }

    /// The elements, row-major.
    pub fn elements(&self) -> &FloatVec {
        &self.elements
    }

    /// A borrowed view.
    pub fn view(&self) -> WeightView<'_> {
        WeightView { shape: self.shape, elements: self.elements.view() }
    }

    /// The same matrix stored as `dtype` (round to nearest even when narrowing).
    ///
    /// `dtype` was validated as a float type where the user gave it
    /// ([`Thinker::load_as`](crate::model::Thinker::load_as) checks it against the
    /// backend's [`Backend::weight_dtypes`](super::Backend::weight_dtypes)), so an
    /// integer one here is an [`InvariantViolation`](crate::error::InvariantViolation).
    pub fn to_dtype(self, dtype: Dtype) -> crate::Result<HostWeight> {
        Ok(HostWeight { shape: self.shape, elements: self.elements.to_dtype(dtype)? })
    }

    /// The matrix widened to f32 (exact).
    pub fn to_f32(&self) -> Array2<f32> {
        self.view().to_f32()
    }

    /// The parts stacked row-wise (fused gate/up, stacked experts), in the first
    /// part's dtype; `None` when they disagree on columns or there are none.
    pub fn stack(parts: Vec<HostWeight>) -> Option<HostWeight> {
        let [_, cols] = parts.first()?.shape;
        let dtype = parts[0].dtype();
        if parts.iter().any(|p| p.shape[1] != cols) {
            return None;
        }
        // The first part's dtype is a float one, so no conversion fails.
        let parts: Vec<HostWeight> =
            parts.into_iter().map(|p| p.to_dtype(dtype).ok()).collect::<Option<_>>()?;
        let rows = parts.iter().map(|p| p.shape[0]).sum();
        let views: Vec<FloatSlice<'_>> = parts.iter().map(|p| p.elements.view()).collect();
        HostWeight::new([rows, cols], FloatVec::concat(&views)?).ok()
    }
}

impl From<Array2<f32>> for HostWeight {
    fn from(a: Array2<f32>) -> Self {
        HostWeight::from_f32(a)
    }
}

/// A borrowed weight matrix (or a block of its rows): shape plus row-major
/// elements in their stored type.
#[derive(Debug, Clone, Copy)]
pub struct WeightView<'a> {
    shape: [usize; 2],
    elements: FloatSlice<'a>,
}

impl<'a> WeightView<'a> {
    pub fn dtype(&self) -> Dtype {
        self.elements.dtype()
    }

    pub fn nrows(&self) -> usize {
        self.shape[0]
    }

    pub fn ncols(&self) -> usize {
        self.shape[1]
    }

    /// The elements, row-major: match on it for the stored type, then
    /// [`WeightView::matrix`] gives the matrix of that type.
    pub fn elements(&self) -> FloatSlice<'a> {
        self.elements
    }

    /// `elements`, this view's own as matched out of [`WeightView::elements`], as
    /// the `[rows, cols]` ndarray view the kernels take.
    ///
    /// # Panics
    /// When `elements` is not `rows * cols` long (so not this view's).
    pub fn matrix<T>(&self, elements: &'a [T]) -> ArrayView2<'a, T> {
        matrix(self.shape, elements)
    }

    /// Rows `start..end` (an expert's slice of stacked weights; panics out of bounds).
    pub fn rows(self, start: usize, end: usize) -> WeightView<'a> {
        assert!(start <= end && end <= self.nrows(), "rows {start}..{end} of a weight of {}", self.nrows());
        let cols = self.ncols();
        WeightView { shape: [end - start, cols], elements: self.elements.slice(start * cols..end * cols) }
    }

    /// Row `r` widened to f32 (exact; panics out of bounds).
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        self.rows(r, r + 1).elements.to_f32()
    }

    /// The matrix widened to f32 (exact).
    pub fn to_f32(&self) -> Array2<f32> {
        Array2::from_shape_vec(self.shape, self.elements.to_f32())
            .expect("a weight holds rows * cols elements")
    }
}

/// The error a backend returns for a dtype it does not store: `field` is
/// `"weight dtype"` ([`Backend::upload_weight`](super::Backend::upload_weight)) or
/// `"kv dtype"` ([`Backend::alloc_pages`](super::Backend::alloc_pages)).
pub(crate) fn unsupported_dtype(
    backend: &'static str, field: &'static str, supported: &[Dtype], found: Dtype,
) -> crate::Error {
    let names: Vec<&str> = supported.iter().map(|d| d.name()).collect();
    crate::error::ConfigError::Invalid {
        component: backend,
        field,
        expected: format!("one of {}", names.join(", ")),
        found: found.to_string(),
    }
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use crate::error::Component;

    #[test]
    fn integer_storage_is_a_broken_invariant_not_a_panic() {
        for dtype in [Dtype::U8, Dtype::I32, Dtype::I64] {
            let err = HostWeight::from_f32(Array2::ones((2, 2))).to_dtype(dtype).unwrap_err();
            assert!(matches!(&err, Error::Invariant(v) if v.component == Component::Storage), "{err}");
        }
        let stacked = HostWeight::stack(vec![
            HostWeight::from_f32(Array2::ones((1, 2))),
            HostWeight::from_f32(Array2::zeros((1, 2))).to_dtype(Dtype::F16).unwrap(),
        ]);
        assert_eq!(stacked.map(|w| (w.dtype(), w.shape())), Some((Dtype::F32, [2, 2])));
    }

    #[test]
    fn a_weight_is_its_rows_in_order_whatever_the_source_layout() {
        let a = Array2::from_shape_fn((3, 4), |(r, c)| (r * 4 + c) as f32);
        let transposed = HostWeight::from_f32(a.t().to_owned());
        assert_eq!(transposed.to_f32(), a.t());
        let mut offset = a.clone();
        offset.slice_collapse(ndarray::s![1.., ..]);
        assert_eq!(HostWeight::from_f32(offset).to_f32(), a.slice(ndarray::s![1.., ..]));
        let w = HostWeight::from(a.clone());
        assert_eq!(w.view().rows(1, 3).to_f32(), a.slice(ndarray::s![1..3, ..]));
        assert_eq!(w.view().row_f32(2), vec![8.0, 9.0, 10.0, 11.0]);
        assert!(HostWeight::new([3, 4], FloatVec::F32(vec![0.0; 11])).is_err());
        assert!(HostWeight::new([usize::MAX, 2], FloatVec::F32(vec![])).is_err());
        assert_eq!(
            HostWeight::stack(vec![w.clone(), HostWeight::from_f32(Array2::zeros((1, 3)))]),
            None,
            "columns disagree"
        );
        assert_eq!(HostWeight::stack(vec![]), None);
    }
}
