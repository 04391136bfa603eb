//! Weight matrices in the precision they are stored in: f32, or bf16 / f16 at
//! half the bytes. Activations stay f32 and every product accumulates in f32;
//! only the stored weight (or K/V page) is narrower.
//!
//! A decode step reads every weight once, so at batch 1 the bytes of the weights
//! bound its speed: half-precision weights halve them.

use half::{bf16, f16};
use ndarray::{Array2, ArrayView2, Axis, concatenate, s};

pub use crate::dtype::{Dtype, UnknownDtype};
use crate::error::Component;

/// A host weight matrix `[rows, cols]` (HF Linear layout `[out, in]`) in its stored type.
///
/// ```
/// use ndarray::array;
/// use omniprefix::backend::{HostWeight, Dtype};
/// let w = HostWeight::F32(array![[1.0f32, 0.1], [3.0, -2.5]]).to_dtype(Dtype::Bf16)?;
/// assert_eq!(w.dtype(), Dtype::Bf16);
/// assert_eq!(w.to_f32()[[0, 1]], 0.10009765625); // 0.1 rounded to 8 mantissa bits
/// assert!(w.to_dtype(Dtype::I32).is_err()); // weights are stored in a float type
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub enum HostWeight {
    F32(Array2<f32>),
    Bf16(Array2<bf16>),
    F16(Array2<f16>),
}

impl HostWeight {
    pub fn dtype(&self) -> Dtype {
        match self {
            HostWeight::F32(_) => Dtype::F32,
            HostWeight::Bf16(_) => Dtype::Bf16,
            HostWeight::F16(_) => Dtype::F16,
        }
    }

    /// `[rows, cols]`.
    pub fn shape(&self) -> [usize; 2] {
        let v = self.view();
        [v.nrows(), v.ncols()]
    }

    /// Bytes the elements occupy.
    pub fn bytes(&self) -> usize {
        let [r, c] = self.shape();
        r * c * self.dtype().size_bytes()
    }

    /// A borrowed view.
    pub fn view(&self) -> WeightView<'_> {
        match self {
            HostWeight::F32(a) => WeightView::F32(a.view()),
            HostWeight::Bf16(a) => WeightView::Bf16(a.view()),
            HostWeight::F16(a) => WeightView::F16(a.view()),
        }
    }

    /// The same matrix stored as `dtype` (round to nearest even when narrowing).
    ///
    /// `dtype` was validated as a float type where the user gave it
    /// ([`Thinker::load_as`](crate::model::Thinker::load_as) checks it against the
    /// backend's [`Backend::weight_dtypes`](super::Backend::weight_dtypes)), so an
    /// integer one here is an [`InvariantViolation`](crate::error::InvariantViolation).
    pub fn to_dtype(self, dtype: Dtype) -> crate::Result<HostWeight> {
        if self.dtype() == dtype {
            return Ok(self);
        }
        let wide = self.into_f32();
        Ok(match dtype {
            Dtype::F32 => HostWeight::F32(wide),
            Dtype::Bf16 => HostWeight::Bf16(wide.mapv(bf16::from_f32)),
            Dtype::F16 => HostWeight::F16(wide.mapv(f16::from_f32)),
            Dtype::U8 | Dtype::I32 | Dtype::I64 => {
                return Err(Component::Storage.violation(format!("weights stored as {dtype}: not a float type")).into());
            }
        })
    }

    /// The matrix widened to f32 (exact).
    pub fn to_f32(&self) -> Array2<f32> {
        self.view().to_f32()
    }

    fn into_f32(self) -> Array2<f32> {
        match self {
            HostWeight::F32(a) => a,
            other => other.to_f32(),
        }
    }

    /// The parts stacked row-wise (fused gate/up, stacked experts), in the first
    /// part's dtype; `None` when they disagree on columns or there are none.
    pub fn stack(parts: Vec<HostWeight>) -> Option<HostWeight> {
        let dtype = parts.first()?.dtype();
        // The first part's dtype is a float one, so no conversion fails.
        let parts: Vec<HostWeight> = parts.into_iter().map(|p| p.to_dtype(dtype).ok()).collect::<Option<_>>()?;
        macro_rules! cat {
            ($variant:ident) => {{
                let views: Vec<_> = parts.iter().filter_map(|p| if let HostWeight::$variant(a) = p { Some(a.view()) } else { None }).collect();
                concatenate(Axis(0), &views).ok().map(HostWeight::$variant)
            }};
        }
        match dtype {
            Dtype::F32 => cat!(F32),
            Dtype::Bf16 => cat!(Bf16),
            Dtype::F16 => cat!(F16),
            Dtype::U8 | Dtype::I32 | Dtype::I64 => None,
        }
    }
}

impl From<Array2<f32>> for HostWeight {
    fn from(a: Array2<f32>) -> Self {
        HostWeight::F32(a)
    }
}

/// A borrowed weight matrix in its stored type.
#[derive(Debug, Clone, Copy)]
pub enum WeightView<'a> {
    F32(ArrayView2<'a, f32>),
    Bf16(ArrayView2<'a, bf16>),
    F16(ArrayView2<'a, f16>),
}

impl<'a> WeightView<'a> {
    pub fn nrows(&self) -> usize {
        match self {
            WeightView::F32(a) => a.nrows(),
            WeightView::Bf16(a) => a.nrows(),
            WeightView::F16(a) => a.nrows(),
        }
    }

    pub fn ncols(&self) -> usize {
        match self {
            WeightView::F32(a) => a.ncols(),
            WeightView::Bf16(a) => a.ncols(),
            WeightView::F16(a) => a.ncols(),
        }
    }

    /// Rows `start..end` (an expert's slice of stacked weights).
    pub fn rows(self, start: usize, end: usize) -> WeightView<'a> {
        match self {
            WeightView::F32(a) => WeightView::F32(a.slice_move(s![start..end, ..])),
            WeightView::Bf16(a) => WeightView::Bf16(a.slice_move(s![start..end, ..])),
            WeightView::F16(a) => WeightView::F16(a.slice_move(s![start..end, ..])),
        }
    }

    /// Row `r` widened to f32 (exact).
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        match self {
            WeightView::F32(a) => a.row(r).to_vec(),
            WeightView::Bf16(a) => a.row(r).iter().map(|v| v.to_f32()).collect(),
            WeightView::F16(a) => a.row(r).iter().map(|v| v.to_f32()).collect(),
        }
    }

    /// The matrix widened to f32 (exact).
    pub fn to_f32(&self) -> Array2<f32> {
        match self {
            WeightView::F32(a) => a.to_owned(),
            WeightView::Bf16(a) => a.mapv(bf16::to_f32),
            WeightView::F16(a) => a.mapv(f16::to_f32),
        }
    }
}

/// The error a backend returns for a dtype it does not store: `field` is
/// `"weight dtype"` ([`Backend::upload_weight`](super::Backend::upload_weight)) or
/// `"kv dtype"` ([`Backend::alloc_pages`](super::Backend::alloc_pages)).
pub(crate) fn unsupported_dtype(backend: &'static str, field: &'static str, supported: &[Dtype], found: Dtype) -> crate::Error {
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
            let err = HostWeight::F32(Array2::ones((2, 2))).to_dtype(dtype).unwrap_err();
            assert!(matches!(&err, Error::Invariant(v) if v.component == Component::Storage), "{err}");
        }
        let stacked = HostWeight::stack(vec![HostWeight::F32(Array2::ones((1, 2))), HostWeight::F32(Array2::zeros((1, 2))).to_dtype(Dtype::F16).unwrap()]);
        assert_eq!(stacked.map(|w| (w.dtype(), w.shape())), Some((Dtype::F32, [2, 2])));
    }
}
