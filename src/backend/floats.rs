//! Elements in the float precision they are stored in: one owned buffer
//! ([`FloatVec`]) and one borrowed view of it ([`FloatSlice`]), for checkpoint
//! tensors, weight matrices and K/V pages alike.
//!
//! Each per-precision operation (zeros, rounding from f32, widening to f32, writes
//! and copies) is written here once, so the holders (a shape plus a buffer) only
//! say what their elements mean. Narrowing rounds to nearest even; widening is exact.

use std::ops::Range;

use half::{bf16, f16};

use crate::dtype::Dtype;
use crate::error::Component;

/// Owned elements, row-major, in f32, bf16 or f16.
///
/// ```
/// use omniprefix::backend::{FloatVec, FloatSlice};
/// use omniprefix::Dtype;
/// let mut pages = FloatVec::zeros(Dtype::Bf16, 4)?;
/// pages.write(1, [0.1f32, 2.0].into_iter()); // rounded to bf16 as stored
/// assert_eq!(pages.dtype(), Dtype::Bf16);
/// assert_eq!(pages.view().slice(1..3).to_f32(), vec![0.10009765625, 2.0]);
/// assert!(matches!(pages.view(), FloatSlice::Bf16(e) if e.len() == 4));
/// assert!(FloatVec::zeros(Dtype::I32, 4).is_err()); // only float types are stored
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub enum FloatVec {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

/// Borrowed elements in their stored type: a [`FloatVec`] (or a part of one) as
/// the kernels and uploads read it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FloatSlice<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

/// What storing as an integer dtype is: a broken invariant, since every boundary
/// that takes a stored dtype (`--dtype`, `--kv-dtype`, `alloc_pages`, `load_as`)
/// refuses one first.
fn not_float(dtype: Dtype) -> crate::Error {
    Component::Storage.violation(format!("floats stored as {dtype}: not a float type")).into()
}

impl FloatVec {
    /// `len` zeros stored as `dtype`; an integer `dtype` is an
    /// [`InvariantViolation`](crate::error::InvariantViolation) of [`Component::Storage`].
    pub fn zeros(dtype: Dtype, len: usize) -> crate::Result<FloatVec> {
        Ok(match dtype {
            Dtype::F32 => FloatVec::F32(vec![0.0; len]),
            Dtype::Bf16 => FloatVec::Bf16(vec![bf16::ZERO; len]),
            Dtype::F16 => FloatVec::F16(vec![f16::ZERO; len]),
            Dtype::U8 | Dtype::I32 | Dtype::I64 => return Err(not_float(dtype)),
        })
    }

    /// `values` stored as `dtype` (rounded to nearest even when narrower; f32 is
    /// moved, not copied); errors as [`FloatVec::zeros`].
    pub fn from_f32(values: Vec<f32>, dtype: Dtype) -> crate::Result<FloatVec> {
        Ok(match dtype {
            Dtype::F32 => FloatVec::F32(values),
            Dtype::Bf16 => FloatVec::Bf16(values.into_iter().map(bf16::from_f32).collect()),
            Dtype::F16 => FloatVec::F16(values.into_iter().map(f16::from_f32).collect()),
            Dtype::U8 | Dtype::I32 | Dtype::I64 => return Err(not_float(dtype)),
        })
    }

    pub fn dtype(&self) -> Dtype {
        self.view().dtype()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.view().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A borrowed view of every element.
    pub fn view(&self) -> FloatSlice<'_> {
        match self {
            FloatVec::F32(e) => FloatSlice::F32(e),
            FloatVec::Bf16(e) => FloatSlice::Bf16(e),
            FloatVec::F16(e) => FloatSlice::F16(e),
        }
    }

    /// The same elements stored as `dtype` (through f32: widened exactly, then
    /// rounded); no copy when already so. Errors as [`FloatVec::zeros`].
    pub fn to_dtype(self, dtype: Dtype) -> crate::Result<FloatVec> {
        if self.dtype() == dtype {
            return Ok(self);
        }
        FloatVec::from_f32(self.into_f32(), dtype)
    }

    /// The elements widened to f32 (exact; f32 is moved, not copied).
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            FloatVec::F32(e) => e,
            other => other.view().to_f32(),
        }
    }

    /// Stores `src` from element `start` on, rounded to the stored type (as many
    /// as fit: the rest of `src` is not read).
    pub fn write(&mut self, start: usize, src: impl Iterator<Item = f32>) {
        match self {
            FloatVec::F32(e) => e[start..].iter_mut().zip(src).for_each(|(d, s)| *d = s),
            FloatVec::Bf16(e) => e[start..].iter_mut().zip(src).for_each(|(d, s)| *d = bf16::from_f32(s)),
            FloatVec::F16(e) => e[start..].iter_mut().zip(src).for_each(|(d, s)| *d = f16::from_f32(s)),
        }
    }

    /// The parts one after another, in their common stored type; `None` when there
    /// are none or they are stored in different types.
    pub fn concat(parts: &[FloatSlice<'_>]) -> Option<FloatVec> {
        /// Every part's elements of type `T` joined (one allocation, of the exact size).
        fn join<T: Stored>(parts: &[FloatSlice<'_>]) -> Option<Vec<T>> {
            Some(parts.iter().map(|p| T::of(*p)).collect::<Option<Vec<&[T]>>>()?.concat())
        }
        Some(match parts.first()? {
            FloatSlice::F32(_) => FloatVec::F32(join(parts)?),
            FloatSlice::Bf16(_) => FloatVec::Bf16(join(parts)?),
            FloatSlice::F16(_) => FloatVec::F16(join(parts)?),
        })
    }

    /// Copies elements `src` to `dst..` within the buffer (as [`slice::copy_within`]).
    pub fn copy_within(&mut self, src: Range<usize>, dst: usize) {
        match self {
            FloatVec::F32(e) => e.copy_within(src, dst),
            FloatVec::Bf16(e) => e.copy_within(src, dst),
            FloatVec::F16(e) => e.copy_within(src, dst),
        }
    }

    /// Elements `range` as their stored bytes, to be overwritten in place (the
    /// disk tier restores a block's pages so; host byte order, as [`FloatSlice::as_bytes`]).
    pub fn bytes_mut(&mut self, range: Range<usize>) -> &mut [u8] {
        match self {
            FloatVec::F32(e) => bytemuck::cast_slice_mut(&mut e[range]),
            FloatVec::Bf16(e) => bytemuck::cast_slice_mut(&mut e[range]),
            FloatVec::F16(e) => bytemuck::cast_slice_mut(&mut e[range]),
        }
    }
}

impl<'a> FloatSlice<'a> {
    pub fn dtype(&self) -> Dtype {
        match self {
            FloatSlice::F32(_) => Dtype::F32,
            FloatSlice::Bf16(_) => Dtype::Bf16,
            FloatSlice::F16(_) => Dtype::F16,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            FloatSlice::F32(e) => e.len(),
            FloatSlice::Bf16(e) => e.len(),
            FloatSlice::F16(e) => e.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `range` (panics out of bounds, as slicing does).
    pub fn slice(self, range: Range<usize>) -> FloatSlice<'a> {
        match self {
            FloatSlice::F32(e) => FloatSlice::F32(&e[range]),
            FloatSlice::Bf16(e) => FloatSlice::Bf16(&e[range]),
            FloatSlice::F16(e) => FloatSlice::F16(&e[range]),
        }
    }

    /// The elements as their stored bytes, in host byte order: what the disk
    /// tier writes (a tier is shared by the processes of one host only).
    pub fn as_bytes(self) -> &'a [u8] {
        match self {
            FloatSlice::F32(e) => bytemuck::cast_slice(e),
            FloatSlice::Bf16(e) => bytemuck::cast_slice(e),
            FloatSlice::F16(e) => bytemuck::cast_slice(e),
        }
    }

    /// The elements widened to f32 (exact).
    pub fn to_f32(self) -> Vec<f32> {
        match self {
            FloatSlice::F32(e) => e.to_vec(),
            FloatSlice::Bf16(e) => e.iter().map(|v| v.to_f32()).collect(),
            FloatSlice::F16(e) => e.iter().map(|v| v.to_f32()).collect(),
        }
    }
}

/// A type the buffers store, for code generic over the three.
trait Stored: Copy {
    /// `s`'s elements when it stores this type.
    fn of(s: FloatSlice<'_>) -> Option<&[Self]>;
}

impl Stored for f32 {
    fn of(s: FloatSlice<'_>) -> Option<&[f32]> {
        if let FloatSlice::F32(e) = s { Some(e) } else { None }
    }
}

impl Stored for bf16 {
    fn of(s: FloatSlice<'_>) -> Option<&[bf16]> {
        if let FloatSlice::Bf16(e) = s { Some(e) } else { None }
    }
}

impl Stored for f16 {
    fn of(s: FloatSlice<'_>) -> Option<&[f16]> {
        if let FloatSlice::F16(e) = s { Some(e) } else { None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    #[test]
    fn narrowing_rounds_to_nearest_even_and_widening_is_exact() {
        let values = vec![0.1f32, -2.5, 65504.0, 1.0e-8];
        for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            let stored = FloatVec::from_f32(values.clone(), dtype).unwrap();
            assert_eq!(stored.dtype(), dtype);
            let expected: Vec<f32> = match dtype {
                Dtype::Bf16 => values.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
                Dtype::F16 => values.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
                _ => values.clone(),
            };
            assert_eq!(stored.view().to_f32(), expected, "{dtype}");
            // Widening then narrowing back is the identity.
            assert_eq!(stored.clone().to_dtype(Dtype::F32).unwrap().to_dtype(dtype).unwrap(), stored);
        }
    }

    #[test]
    fn integer_dtypes_are_a_broken_storage_invariant() {
        for dtype in [Dtype::U8, Dtype::I32, Dtype::I64] {
            for err in
                [FloatVec::zeros(dtype, 2).unwrap_err(), FloatVec::from_f32(vec![1.0], dtype).unwrap_err()]
            {
                assert!(matches!(&err, Error::Invariant(v) if v.component == Component::Storage), "{err}");
            }
        }
    }

    #[test]
    fn writes_copies_and_joins_keep_the_stored_type() {
        let mut e = FloatVec::zeros(Dtype::F16, 6).unwrap();
        e.write(4, [1.5f32, 2.5, 9.0].into_iter()); // the third does not fit
        e.copy_within(4..6, 0);
        assert_eq!(e.view().to_f32(), vec![1.5, 2.5, 0.0, 0.0, 1.5, 2.5]);
        let joined = FloatVec::concat(&[e.view().slice(0..2), e.view().slice(4..6)]).unwrap();
        assert_eq!(
            joined,
            FloatVec::F16(vec![
                f16::from_f32(1.5),
                f16::from_f32(2.5),
                f16::from_f32(1.5),
                f16::from_f32(2.5)
            ])
        );
        let other = FloatVec::zeros(Dtype::F32, 1).unwrap();
        assert_eq!(FloatVec::concat(&[e.view(), other.view()]), None, "mixed types do not join");
        assert_eq!(FloatVec::concat(&[]), None);
    }
}
