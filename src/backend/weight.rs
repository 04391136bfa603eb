//! Weight matrices in the precision they are stored in: f32, or bf16 / f16 at
//! half the bytes. Activations stay f32 and every product accumulates in f32;
//! only the stored weight (or K/V page) is narrower.
//!
//! A decode step reads every weight once, so at batch 1 the bytes of the weights
//! bound its speed: half-precision weights halve them.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};
use ndarray::{Array2, ArrayView2, Axis, concatenate, s};

/// The element type stored data has: weight matrices (`EngineConfig::dtype`) and
/// K/V pages (`EngineConfig::kv_dtype`). Arithmetic stays f32 either way.
///
/// ```
/// use omniprefix::backend::Dtype;
/// assert_eq!("bf16".parse::<Dtype>(), Ok(Dtype::Bf16));
/// assert_eq!(Dtype::F16.to_string(), "f16");
/// assert_eq!(Dtype::Bf16.bytes(), 2);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    /// Bytes of one element.
    pub fn bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }

    /// `auto` (`None`: the checkpoint's own dtype) or a dtype name, as `--dtype`
    /// and the Python package's `dtype=` take it.
    ///
    /// ```
    /// use omniprefix::backend::Dtype;
    /// assert_eq!(Dtype::parse_or_auto("auto"), Ok(None));
    /// assert_eq!(Dtype::parse_or_auto("f16"), Ok(Some(Dtype::F16)));
    /// assert!(Dtype::parse_or_auto("fp8").is_err());
    /// ```
    pub fn parse_or_auto(s: &str) -> Result<Option<Dtype>, UnknownDtype> {
        if s == "auto" { Ok(None) } else { s.parse().map(Some) }
    }

    /// The name the CLI, the Python package and the reports use.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A dtype name that is not `f32`, `bf16` or `f16`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("dtype `{0}`: expected auto, f32, bf16 or f16")]
pub struct UnknownDtype(pub String);

impl FromStr for Dtype {
    type Err = UnknownDtype;
    fn from_str(s: &str) -> Result<Self, UnknownDtype> {
        match s {
            "f32" => Ok(Dtype::F32),
            "bf16" => Ok(Dtype::Bf16),
            "f16" => Ok(Dtype::F16),
            other => Err(UnknownDtype(other.to_string())),
        }
    }
}

/// A host weight matrix `[rows, cols]` (HF Linear layout `[out, in]`) in its stored type.
///
/// ```
/// use ndarray::array;
/// use omniprefix::backend::{HostWeight, Dtype};
/// let w = HostWeight::F32(array![[1.0f32, 0.1], [3.0, -2.5]]).to_dtype(Dtype::Bf16);
/// assert_eq!(w.dtype(), Dtype::Bf16);
/// assert_eq!(w.to_f32()[[0, 1]], 0.10009765625); // 0.1 rounded to 8 mantissa bits
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
        r * c * self.dtype().bytes()
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
    pub fn to_dtype(self, dtype: Dtype) -> HostWeight {
        if self.dtype() == dtype {
            return self;
        }
        let wide = self.into_f32();
        match dtype {
            Dtype::F32 => HostWeight::F32(wide),
            Dtype::Bf16 => HostWeight::Bf16(wide.mapv(bf16::from_f32)),
            Dtype::F16 => HostWeight::F16(wide.mapv(f16::from_f32)),
        }
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
        let parts: Vec<HostWeight> = parts.into_iter().map(|p| p.to_dtype(dtype)).collect();
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
