//! The canonical byte stream of a tensor: logical row-major order,
//! little-endian, `-0.0` folded into `+0.0`, NaN/±Inf rejected.
//!
//! Bytes are pushed into a [`ByteSink`] in bounded pieces so the digests eat
//! them while they are hot in cache: contiguous integer tensors are passed
//! straight from their slice (no copy); contiguous floats are passed in place
//! 64 KiB at a time and then scanned while still in cache, and a piece that
//! holds a `-0.0` or a NaN/Inf is rolled back out of the sink and folded
//! through a 64 KiB staging buffer (NaN/Inf error out there); strided views
//! always go through the staging buffer, which is only allocated when used.
//! Any element range can be emitted on its own, which is what lets the
//! fingerprint tree hash fixed-size chunks in parallel.

use std::ops::Range;

use ndarray::{ArrayView1, ArrayViewD, Axis, Ix1, Slice};

use super::simd::{Vectorised, vectorise};
use super::{Dtype, TensorView};
use crate::backend::cpu::lanes::Simd;
use crate::error::{Error, RequestError, Result};

/// Bytes of the staging buffer floats and strided views are encoded into.
pub const STAGING_BYTES: usize = 64 * 1024;

/// Something that consumes canonical bytes in order (digests, a retained copy),
/// and can forget what it consumed since a mark.
pub(crate) trait ByteSink {
    /// Where the sink is: enough to roll back to it.
    type Mark;
    fn consume(&mut self, bytes: &[u8]);
    fn mark(&self) -> Self::Mark;
    /// Forgets everything consumed since `mark` was taken.
    fn rollback(&mut self, mark: Self::Mark);
}

/// An element type with a canonical little-endian encoding.
pub(crate) trait CanonElem: bytemuck::Pod + Send + Sync {
    /// The canonical bit pattern, stored little-endian in memory.
    type Bits: bytemuck::Pod + Default;
    /// Whether values need folding / a finiteness check (floats do).
    const IS_FLOAT: bool;
    /// Whether this element is finite (always true for integers).
    fn finite(self) -> bool;
    /// Canonical bits, little-endian in memory; `-0.0` becomes `+0.0`.
    fn canonical(self) -> Self::Bits;
    /// Whether every value's native bits already are its canonical bits
    /// (finite and not `-0.0`; byte order is checked separately).
    fn all_native_canonical(piece: &[Self]) -> bool;
}

macro_rules! int_elem {
    ($t:ty) => {
        impl CanonElem for $t {
            type Bits = $t;
            const IS_FLOAT: bool = false;
            #[inline(always)]
            fn finite(self) -> bool {
                true
            }
            #[inline(always)]
            fn canonical(self) -> $t {
                self.to_le()
            }
            #[inline(always)]
            fn all_native_canonical(_: &[$t]) -> bool {
                true
            }
        }
    };
}
int_elem!(u8);
int_elem!(i32);
int_elem!(i64);

macro_rules! float_elem {
    ($t:ty, $bits:ty, $exponent:expr, $sign:expr) => {
        impl CanonElem for $t {
            type Bits = $bits;
            const IS_FLOAT: bool = true;
            #[inline(always)]
            fn finite(self) -> bool {
                self.to_bits() & $exponent != $exponent
            }
            #[inline(always)]
            fn canonical(self) -> $bits {
                let bits = self.to_bits();
                // -0.0 is the sign bit alone; fold it into +0.0.
                let folded = if bits == $sign { 0 } else { bits };
                folded.to_le()
            }
            /// Branch-free and without per-element booleans, so it vectorises
            /// to two operations per lane and chain: the largest magnitude must
            /// stay below the all-ones exponent (finite), and no value may be
            /// the sign bit alone (`-0.0`, the only one whose flipped sign is 0).
            #[inline(always)]
            fn all_native_canonical(piece: &[$t]) -> bool {
                let (mut max_magnitude, mut min_flipped): ($bits, $bits) = (0, <$bits>::MAX);
                for value in piece {
                    let bits = value.to_bits();
                    max_magnitude = max_magnitude.max(bits & !$sign);
                    min_flipped = min_flipped.min(bits ^ $sign);
                }
                max_magnitude < $exponent && min_flipped != 0
            }
        }
    };
}
float_elem!(half::f16, u16, 0x7c00u16, 0x8000u16);
float_elem!(half::bf16, u16, 0x7f80u16, 0x8000u16);
float_elem!(f32, u32, 0x7f80_0000u32, 0x8000_0000u32);

impl Dtype {
    /// Stable tag of the dtype in canonical headers (never reorder).
    pub(crate) fn tag(self) -> u8 {
        match self {
            Dtype::U8 => 1,
            Dtype::I32 => 2,
            Dtype::I64 => 3,
            Dtype::F16 => 4,
            Dtype::Bf16 => 5,
            Dtype::F32 => 6,
        }
    }
}

impl TensorView<'_> {
    /// Element type of the view.
    pub fn dtype(&self) -> Dtype {
        match self {
            TensorView::U8(_) => Dtype::U8,
            TensorView::I32(_) => Dtype::I32,
            TensorView::I64(_) => Dtype::I64,
            TensorView::F16(_) => Dtype::F16,
            TensorView::BF16(_) => Dtype::Bf16,
            TensorView::F32(_) => Dtype::F32,
        }
    }

    /// Logical shape of the view.
    pub fn shape(&self) -> &[usize] {
        match self {
            TensorView::U8(v) => v.shape(),
            TensorView::I32(v) => v.shape(),
            TensorView::I64(v) => v.shape(),
            TensorView::F16(v) => v.shape(),
            TensorView::BF16(v) => v.shape(),
            TensorView::F32(v) => v.shape(),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape().iter().product()
    }

    /// Whether the view has no elements (some dimension is 0).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Length of the canonical byte stream (elements × dtype size),
    /// saturating for broadcast views too large to have one.
    pub fn canonical_len(&self) -> usize {
        self.len().saturating_mul(self.dtype().size_bytes())
    }
}

/// Emits canonical bytes `bytes` (a range of the canonical stream, aligned to
/// the element size) of item `item` into `sink`.
pub(crate) fn emit_tensor(
    item: usize, view: &TensorView<'_>, bytes: Range<usize>, sink: &mut impl ByteSink,
) -> Result<()> {
    let size = view.dtype().size_bytes();
    debug_assert!(bytes.start.is_multiple_of(size) && bytes.end.is_multiple_of(size));
    let elems = bytes.start / size..bytes.end / size;
    match view {
        TensorView::U8(v) => emit_range(item, v, elems, sink),
        TensorView::I32(v) => emit_range(item, v, elems, sink),
        TensorView::I64(v) => emit_range(item, v, elems, sink),
        TensorView::F16(v) => emit_range(item, v, elems, sink),
        TensorView::BF16(v) => emit_range(item, v, elems, sink),
        TensorView::F32(v) => emit_range(item, v, elems, sink),
    }
}

fn emit_range<T: CanonElem>(
    item: usize, view: &ArrayViewD<'_, T>, elems: Range<usize>, sink: &mut impl ByteSink,
) -> Result<()> {
    let mut encoder = Encoder::<T, _>::new(item, elems.start, sink);
    walk(view.view(), elems, &mut encoder)?;
    encoder.flush();
    Ok(())
}

/// Visits elements `elems` (flat row-major indices) of `view` in logical
/// order, handing contiguous runs and strided lanes to the encoder.
fn walk<T: CanonElem, S: ByteSink>(
    view: ArrayViewD<'_, T>, elems: Range<usize>, encoder: &mut Encoder<'_, T, S>,
) -> Result<()> {
    if elems.is_empty() {
        return Ok(());
    }
    if let Some(run) = view.as_slice().and_then(|all| all.get(elems.clone())) {
        return encoder.push_slice(run);
    }
    if let Ok(lane) = view.clone().into_dimensionality::<Ix1>() {
        let part = lane.slice_axis(Axis(0), Slice::from(elems));
        return encoder.push_lane(part);
    }
    // ndim >= 2 and not standard layout: recurse over the outer axis.
    let inner: usize = view.shape().iter().skip(1).product();
    if inner == 0 {
        return Ok(());
    }
    for outer in elems.start / inner..elems.end.div_ceil(inner) {
        let base = outer * inner;
        let lo = elems.start.saturating_sub(base);
        let hi = (elems.end - base).min(inner);
        walk(view.index_axis(Axis(0), outer), lo..hi, encoder)?;
    }
    Ok(())
}

/// Whether every element's native bits are its canonical bits (finite, not
/// `-0.0`): one read-only scan, with the widest vectors the CPU has.
fn all_canonical<T: CanonElem>(piece: &[T]) -> bool {
    all_canonical_on(Simd::detect(), piece)
}

/// [`CanonElem::all_native_canonical`] compiled for `build` (the compiler
/// vectorises the scan with its registers: 512-bit ones on AVX-512).
fn all_canonical_on<T: CanonElem>(build: Simd, piece: &[T]) -> bool {
    struct Scan<'p, T>(&'p [T]);
    impl<T: CanonElem> Vectorised for Scan<'_, T> {
        type Out = bool;
        #[inline(always)]
        fn run(self) -> bool {
            T::all_native_canonical(self.0)
        }
    }
    vectorise(build, Scan(piece))
}

/// Writes the canonical bits of `src` to `dst` (same lengths), `-0.0`
/// folded, compiled for `build`; returns whether every element is finite.
fn fold_on<T: CanonElem>(build: Simd, src: &[T], dst: &mut [T::Bits]) -> bool {
    struct Fold<'p, T: CanonElem>(&'p [T], &'p mut [T::Bits]);
    impl<T: CanonElem> Vectorised for Fold<'_, T> {
        type Out = bool;
        #[inline(always)]
        fn run(self) -> bool {
            let mut all_finite = true;
            for (d, &s) in self.1.iter_mut().zip(self.0) {
                all_finite &= s.finite();
                *d = s.canonical();
            }
            all_finite
        }
    }
    debug_assert_eq!(src.len(), dst.len());
    vectorise(build, Fold(src, dst))
}

/// Turns elements into canonical bytes through a bounded staging buffer.
struct Encoder<'s, T: CanonElem, S: ByteSink> {
    item: usize,
    /// Flat row-major index of the next element pushed (for `NonFinite`).
    next_index: usize,
    /// Allocated on first use: clean contiguous content never needs it.
    staging: Vec<T::Bits>,
    filled: usize,
    sink: &'s mut S,
}

impl<'s, T: CanonElem, S: ByteSink> Encoder<'s, T, S> {
    /// Elements per staging buffer (and per scanned piece).
    const CAPACITY: usize = if STAGING_BYTES / std::mem::size_of::<T::Bits>() > 0 {
        STAGING_BYTES / std::mem::size_of::<T::Bits>()
    } else {
        1
    };

    fn new(item: usize, first_index: usize, sink: &'s mut S) -> Self {
        Encoder { item, next_index: first_index, staging: Vec::new(), filled: 0, sink }
    }

    /// The staging buffer, allocated the first time it is needed.
    fn staging(&mut self) -> &mut [T::Bits] {
        if self.staging.is_empty() {
            self.staging = vec![T::Bits::default(); Self::CAPACITY];
        }
        &mut self.staging
    }

    /// Integers on little-endian hosts are already canonical: hash in place.
    const ZERO_COPY: bool = !T::IS_FLOAT && cfg!(target_endian = "little");

    fn push_slice(&mut self, run: &[T]) -> Result<()> {
        if Self::ZERO_COPY {
            self.pass_through(run);
            return Ok(());
        }
        if !cfg!(target_endian = "little") {
            return self.stage(run);
        }
        for piece in run.chunks(Self::CAPACITY) {
            // Most float pieces hold no -0.0 and no NaN/Inf. The digests read
            // the piece in place first (its first read from memory, which
            // their own work hides), then a read-only scan proves it clean
            // while it is still in cache; a piece that is not is rolled back
            // and staged (folded, or rejected with the element's index).
            self.flush();
            let mark = self.sink.mark();
            self.sink.consume(bytemuck::cast_slice(piece));
            if all_canonical(piece) {
                self.next_index += piece.len();
            } else {
                self.sink.rollback(mark);
                self.stage(piece)?;
            }
        }
        Ok(())
    }

    /// Hands elements whose native bytes are canonical straight to the sink.
    fn pass_through(&mut self, run: &[T]) {
        self.flush();
        self.sink.consume(bytemuck::cast_slice(run));
        self.next_index += run.len();
    }

    /// Encodes elements into the staging buffer, folding and checking them.
    fn stage(&mut self, run: &[T]) -> Result<()> {
        let mut rest = run;
        while !rest.is_empty() {
            let room = Self::CAPACITY - self.filled;
            let (piece, tail) = rest.split_at(room.min(rest.len()));
            let filled = self.filled;
            let dst = &mut self.staging()[filled..filled + piece.len()];
            if !fold_on(Simd::detect(), piece, dst) {
                return Err(self.non_finite(piece.iter().copied()));
            }
            self.advance(piece.len());
            rest = tail;
        }
        Ok(())
    }

    fn push_lane(&mut self, lane: ArrayView1<'_, T>) -> Result<()> {
        if let Some(run) = lane.as_slice() {
            return self.push_slice(run);
        }
        let mut start = 0;
        while start < lane.len() {
            let room = Self::CAPACITY - self.filled;
            let end = (start + room).min(lane.len());
            let piece = lane.slice_axis(Axis(0), Slice::from(start..end));
            let filled = self.filled;
            let dst = &mut self.staging()[filled..filled + piece.len()];
            let mut all_finite = true;
            for (d, &s) in dst.iter_mut().zip(piece.iter()) {
                all_finite &= s.finite();
                *d = s.canonical();
            }
            if !all_finite {
                return Err(self.non_finite(piece.iter().copied()));
            }
            self.advance(end - start);
            start = end;
        }
        Ok(())
    }

    /// The error for the first non-finite element of a piece starting at `next_index`.
    fn non_finite(&self, piece: impl Iterator<Item = T>) -> Error {
        let offset = piece.take_while(|s| s.finite()).count();
        Error::Request(RequestError::NonFinite { item: self.item, index: self.next_index + offset })
    }

    fn advance(&mut self, n: usize) {
        self.filled += n;
        self.next_index += n;
        if self.filled == Self::CAPACITY {
            self.flush();
        }
    }

    fn flush(&mut self) {
        if self.filled > 0 {
            self.sink.consume(bytemuck::cast_slice(&self.staging[..self.filled]));
            self.filled = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builds_run::builds_run;
    use crate::error::TestResult;
    use ndarray::{ArrayD, IxDyn};

    /// Collects the stream, and how many pieces it came in (rolled back ones included).
    #[derive(Default)]
    struct Collect(Vec<u8>, usize);
    impl ByteSink for Collect {
        type Mark = usize;
        fn consume(&mut self, bytes: &[u8]) {
            self.0.extend_from_slice(bytes);
            self.1 += 1;
        }
        fn mark(&self) -> usize {
            self.0.len()
        }
        fn rollback(&mut self, mark: usize) {
            self.0.truncate(mark);
        }
    }

    fn arr<T>(shape: &[usize], data: Vec<T>) -> TestResult<ArrayD<T>> {
        Ok(ArrayD::from_shape_vec(IxDyn(shape), data)?)
    }

    fn canonical(item: usize, view: &TensorView<'_>) -> Result<Vec<u8>> {
        let mut sink = Collect::default();
        emit_tensor(item, view, 0..view.canonical_len(), &mut sink)?;
        Ok(sink.0)
    }

    #[test]
    fn each_dtype_is_little_endian_row_major() -> TestResult {
        let u8s = arr(&[2, 2], vec![1u8, 2, 3, 4])?;
        assert_eq!(canonical(0, &TensorView::U8(u8s.view()))?, vec![1, 2, 3, 4]);
        let i32s = arr(&[2], vec![1i32, -2])?;
        assert_eq!(canonical(0, &TensorView::I32(i32s.view()))?, vec![1, 0, 0, 0, 0xfe, 0xff, 0xff, 0xff]);
        let i64s = arr(&[1], vec![0x0102_0304_0506_0708i64])?;
        assert_eq!(canonical(0, &TensorView::I64(i64s.view()))?, vec![8, 7, 6, 5, 4, 3, 2, 1]);
        let f16s = arr(&[1], vec![half::f16::from_f32(1.0)])?;
        assert_eq!(canonical(0, &TensorView::F16(f16s.view()))?, vec![0x00, 0x3c]);
        let bf16s = arr(&[1], vec![half::bf16::from_f32(1.0)])?;
        assert_eq!(canonical(0, &TensorView::BF16(bf16s.view()))?, vec![0x80, 0x3f]);
        let f32s = arr(&[1], vec![1.0f32])?;
        assert_eq!(canonical(0, &TensorView::F32(f32s.view()))?, vec![0, 0, 0x80, 0x3f]);
        Ok(())
    }

    #[test]
    fn negative_zero_folds_for_every_float_dtype() -> Result<()> {
        let f32s = ArrayD::from_elem(IxDyn(&[3]), -0.0f32);
        assert_eq!(canonical(0, &TensorView::F32(f32s.view()))?, vec![0; 12]);
        let f16s = ArrayD::from_elem(IxDyn(&[3]), half::f16::NEG_ZERO);
        assert_eq!(canonical(0, &TensorView::F16(f16s.view()))?, vec![0; 6]);
        let bf16s = ArrayD::from_elem(IxDyn(&[3]), half::bf16::NEG_ZERO);
        assert_eq!(canonical(0, &TensorView::BF16(bf16s.view()))?, vec![0; 6]);
        Ok(())
    }

    #[test]
    fn non_finite_reports_flat_index_in_logical_order() {
        // Physical order differs from logical order: the error must name the logical index.
        let mut a = ArrayD::<f32>::zeros(IxDyn(&[3, 5]));
        a[[2, 1]] = f32::INFINITY; // logical (transposed) index 1*3+2 = 5
        a[[0, 4]] = f32::NAN; // logical index 4*3+0 = 12
        let t = a.t();
        let err = canonical(7, &TensorView::F32(t));
        assert!(matches!(err, Err(Error::Request(RequestError::NonFinite { item: 7, index: 5 }))), "{err:?}");
        let b = ArrayD::from_elem(IxDyn(&[100_000]), half::f16::ONE);
        let mut b = b;
        b[[70_000]] = half::f16::NEG_INFINITY;
        let err = canonical(1, &TensorView::F16(b.view()));
        assert!(
            matches!(err, Err(Error::Request(RequestError::NonFinite { item: 1, index: 70_000 }))),
            "{err:?}"
        );
        let mut c = ArrayD::from_elem(IxDyn(&[4]), half::bf16::ONE);
        c[[3]] = half::bf16::NAN;
        assert!(matches!(
            canonical(0, &TensorView::BF16(c.view())),
            Err(Error::Request(RequestError::NonFinite { index: 3, .. }))
        ));
    }

    #[test]
    fn strided_views_equal_their_standard_copy() -> TestResult {
        // A THWC u8 video viewed as TCHW, a reversed axis, and a step slice.
        let data: Vec<u8> = (0..2 * 37 * 41 * 3).map(|i| (i * 31 % 251) as u8).collect();
        let a = arr(&[2, 37, 41, 3], data)?;
        let mut permuted = a.view();
        permuted = permuted.permuted_axes(IxDyn(&[0, 3, 1, 2]));
        let standard = permuted.as_standard_layout().to_owned();
        assert_eq!(
            canonical(0, &TensorView::U8(permuted.clone()))?,
            canonical(0, &TensorView::U8(standard.view()))?
        );
        let mut reversed = a.view();
        reversed.invert_axis(Axis(2));
        let stepped =
            reversed.slice_each_axis(|ax| Slice::new(0, None, if ax.axis.index() == 1 { 3 } else { 1 }));
        let copy = stepped.as_standard_layout().to_owned();
        assert_eq!(
            canonical(0, &TensorView::U8(stepped.clone()))?,
            canonical(0, &TensorView::U8(copy.view()))?
        );
        let f = a.mapv(|x| f32::from(x) - 100.0);
        let ft = f.view().permuted_axes(IxDyn(&[3, 2, 1, 0]));
        let fcopy = ft.as_standard_layout().to_owned();
        assert_eq!(canonical(0, &TensorView::F32(ft))?, canonical(0, &TensorView::F32(fcopy.view()))?);
        Ok(())
    }

    #[test]
    fn any_element_range_is_a_slice_of_the_whole_stream() -> Result<()> {
        let a = ArrayD::from_shape_fn(IxDyn(&[7, 9, 5]), |ix| (ix[0] * 45 + ix[1] * 5 + ix[2]) as i32 - 100);
        let t = a.view().permuted_axes(IxDyn(&[2, 0, 1]));
        let view = TensorView::I32(t);
        let whole = canonical(0, &view)?;
        for (lo, hi) in [(0, 4), (4, 80), (76, 300), (296, whole.len())] {
            let mut part = Collect::default();
            emit_tensor(0, &view, lo..hi, &mut part)?;
            assert_eq!(part.0, whole[lo..hi], "byte range {lo}..{hi}");
        }
        Ok(())
    }

    #[test]
    fn clean_and_folded_pieces_interleave_in_order() -> Result<()> {
        // Pieces without -0.0 pass through in place; pieces with one are staged.
        let cap = STAGING_BYTES / 4;
        let mut a = ArrayD::from_shape_fn(IxDyn(&[3 * cap + 5]), |ix| ix[0] as f32 + 0.5);
        for i in [cap + 3, 2 * cap - 1, 3 * cap + 4] {
            a[[i]] = -0.0;
        }
        let expected: Vec<u8> =
            a.iter().flat_map(|&x| if x == 0.0 { [0; 4] } else { x.to_le_bytes() }).collect();
        assert_eq!(canonical(0, &TensorView::F32(a.view()))?, expected);
        Ok(())
    }

    /// On every build the CPU has: the scan is false exactly when some value
    /// is non-finite or `-0.0` (alone, and at lanes across a vector-sized run),
    /// and the fold writes the portable fold's bits and finiteness.
    #[test]
    fn the_clean_scan_flags_exactly_non_finite_values_and_negative_zero() {
        let builds = builds_run("the_clean_scan_flags_exactly_non_finite_values_and_negative_zero");
        fn agrees_on<T: CanonElem + std::fmt::Debug>(builds: &[Simd], values: &[T]) {
            for &v in values {
                let canonical = v.finite() && bytemuck::bytes_of(&v.canonical()) == bytemuck::bytes_of(&v);
                assert_eq!(all_canonical(&[v]), canonical, "{v:?}, the detected build");
                for &build in builds {
                    let name = build.name();
                    assert_eq!(all_canonical_on(build, &[v]), canonical, "{v:?}, {name}");
                    // At every lane of a vector-sized run of clean values (and past it).
                    for at in [0, 7, 31, 32, 63, 64, 127, 128, 200] {
                        let mut run = vec![values[0]; 201];
                        run[at] = v;
                        assert_eq!(all_canonical_on(build, &run), canonical, "{v:?} at {at}, {name}");
                        let mut want = vec![T::Bits::default(); run.len()];
                        let mut got = want.clone();
                        let finite = fold_on(Simd::Portable, &run, &mut want);
                        assert_eq!(finite, v.finite(), "{v:?} at {at}: the portable fold's finiteness");
                        assert_eq!(
                            fold_on(build, &run, &mut got),
                            finite,
                            "{v:?} at {at}, {name}: finiteness"
                        );
                        assert!(
                            bytemuck::cast_slice::<_, u8>(&got) == bytemuck::cast_slice::<_, u8>(&want),
                            "{v:?} at {at}, {name}: folded bits"
                        );
                    }
                }
            }
        }
        let f32s =
            [1.0f32, 0.0, -1.5, f32::MAX, f32::MIN, f32::MIN_POSITIVE, -f32::MIN_POSITIVE, 1e-45, -1e-45]
                .into_iter()
                .chain([
                    -0.0,
                    f32::INFINITY,
                    f32::NEG_INFINITY,
                    f32::NAN,
                    -f32::NAN,
                    f32::from_bits(0x7f80_0001),
                ])
                .collect::<Vec<_>>();
        agrees_on(&builds, &f32s);
        let f16s = f32s
            .iter()
            .map(|&x| half::f16::from_f32(x))
            .chain([half::f16::MAX, half::f16::MIN])
            .collect::<Vec<_>>();
        agrees_on(&builds, &f16s);
        let bf16s = f32s
            .iter()
            .map(|&x| half::bf16::from_f32(x))
            .chain([half::bf16::MAX, half::bf16::MIN])
            .collect::<Vec<_>>();
        agrees_on(&builds, &bf16s);
    }

    #[test]
    fn floats_stream_in_bounded_pieces() -> Result<()> {
        let a = ArrayD::from_elem(IxDyn(&[3 * STAGING_BYTES / 4 + 5]), 1.5f32);
        let mut sink = Collect::default();
        emit_tensor(0, &TensorView::F32(a.view()), 0..a.len() * 4, &mut sink)?;
        assert_eq!(sink.0.len(), a.len() * 4);
        assert_eq!(sink.1, 4, "three full staging buffers and a tail");
        Ok(())
    }
}
