//! Fuzz target: canonicalisation and fingerprinting of multimodal items.
//!
//! Random dtypes, shapes (zero sides included), values (NaN, ±Inf, -0.0
//! included), modalities and layouts (mismatched kinds, zero grids, absurd
//! time steps), each given in three memory layouts — standard, permuted and
//! stepped strides, reversed axis. Properties: `identify` never panics; it
//! fails with a typed input error exactly when one layout does; equal logical
//! content gives equal fingerprints and check digests whatever the strides and
//! the sign of zero; changing one element changes the fingerprint.
//!
//! Cases default to 256; `scripts/fuzz.sh` runs it for a time budget.

use support::fuzz as fuzz_common;

use half::{bf16, f16};
use ndarray::{ArrayD, ArrayViewD, Axis, IxDyn, Slice};
use omniprefix::Error;
use omniprefix::canon::{
    FingerprintKey, Fingerprinter, ItemContent, ItemIdentity, ItemLayout, ItemSpec, Modality, TensorView,
};
use omniprefix::error::RequestError;
use omniprefix::index::ValidationPolicy;
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    dtype: u8,
    shape: Vec<usize>,
    /// Raw material of the values (cycled).
    raw: Vec<u64>,
    /// (flat index, kind): NaN, +Inf, -Inf, -0.0, +0.0 written over a float value.
    specials: Vec<(usize, u8)>,
    modality: u8,
    layout_kind: u8,
    grid: [u32; 3],
    seconds: f32,
    mel_frames: u32,
    /// Rotation of the axes of the permuted twin.
    rotate: usize,
}

fn case() -> impl Strategy<Value = Case> {
    let shape = prop::collection::vec(prop_oneof![1 => Just(0usize), 8 => 1usize..5], 1..=4);
    let grid = prop_oneof![
        3 => Just([1u32, 2, 2]),
        1 => Just([1u32, 4, 4]),
        2 => [0u32..5, 0u32..5, 0u32..5],
        1 => [any::<u32>(), any::<u32>(), any::<u32>()],
    ];
    let seconds =
        prop_oneof![Just(1.0f32), Just(0.5), Just(0.0), Just(-1.0), Just(f32::NAN), Just(f32::INFINITY)];
    let mel = prop_oneof![1u32..400, Just(0), any::<u32>()];
    (
        (
            0u8..6,
            shape,
            prop::collection::vec(any::<u64>(), 1..16),
            prop::collection::vec((any::<usize>(), 0u8..5), 0..3),
        ),
        (
            prop_oneof![Just(0u8), Just(1), Just(2)],
            prop_oneof![8 => Just(3u8), 1 => 0u8..3],
            grid,
            seconds,
            mel,
            0usize..4,
        ),
    )
        .prop_map(
            |((dtype, shape, raw, specials), (modality, layout_kind, grid, seconds, mel_frames, rotate))| {
                Case { dtype, shape, raw, specials, modality, layout_kind, grid, seconds, mel_frames, rotate }
            },
        )
}

impl Case {
    fn modality(&self) -> Modality {
        [Modality::Image, Modality::Audio, Modality::Video][self.modality as usize % 3]
    }

    /// The layout: of the item's own kind (`layout_kind` 3), or of another kind.
    fn layout(&self) -> ItemLayout {
        let kind = if self.layout_kind == 3 { self.modality } else { self.layout_kind };
        match kind {
            0 => ItemLayout::Image { grid_thw: self.grid },
            1 => ItemLayout::Audio { mel_frames: self.mel_frames },
            _ => ItemLayout::Video { grid_thw: self.grid, seconds_per_grid: self.seconds },
        }
    }

    fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Float values with the specials written in.
    fn floats(&self) -> Vec<f32> {
        let mut v: Vec<f32> =
            (0..self.len()).map(|i| (self.raw[i % self.raw.len()] % 2001) as f32 / 8.0 - 125.0).collect();
        for &(at, kind) in &self.specials {
            if let Some(x) = v.get_mut(at % self.len().max(1)) {
                *x = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 0.0][kind as usize];
            }
        }
        v
    }

    fn ints(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.len()).map(|i| self.raw[i % self.raw.len()])
    }
}

fn fingerprinter() -> Fingerprinter {
    match Fingerprinter::new(FingerprintKey::fixed(9), 1, ValidationPolicy::SecondDigest) {
        Ok(f) => f,
        Err(e) => panic!("fingerprinter: {e}"),
    }
}

/// Input errors `identify` may return; anything else is a bug.
fn is_input_error(e: &Error) -> bool {
    matches!(
        e,
        Error::Request(RequestError::NonFinite { .. })
            | Error::Request(RequestError::EmptyItem { .. })
            | Error::Request(RequestError::ShapeMismatch { .. })
            | Error::Request(RequestError::GridNotMergeable { .. })
            | Error::Request(RequestError::InvalidLayout { .. })
    )
}

/// An element type the fuzzer builds tensors of.
trait Element: Copy + PartialEq + std::fmt::Debug + 'static {
    fn view(a: ArrayViewD<'_, Self>) -> TensorView<'_>;
    /// The same value with the other sign of zero, if it is a zero of a float type.
    fn flip_zero(self) -> Self {
        self
    }
    /// A different value.
    fn perturb(self) -> Self;
}

macro_rules! int_element {
    ($t:ty, $variant:ident) => {
        impl Element for $t {
            fn view(a: ArrayViewD<'_, Self>) -> TensorView<'_> {
                TensorView::$variant(a)
            }
            fn perturb(self) -> Self {
                self.wrapping_add(1)
            }
        }
    };
}
int_element!(u8, U8);
int_element!(i32, I32);
int_element!(i64, I64);

macro_rules! float_element {
    ($t:ty, $variant:ident, $from:expr, $to:expr) => {
        impl Element for $t {
            fn view(a: ArrayViewD<'_, Self>) -> TensorView<'_> {
                TensorView::$variant(a)
            }
            fn flip_zero(self) -> Self {
                let x: f32 = $to(self);
                if x == 0.0 { $from(-x) } else { self }
            }
            fn perturb(self) -> Self {
                let x: f32 = $to(self);
                $from(x + 1.0)
            }
        }
    };
}
float_element!(f32, F32, |x: f32| x, |x: f32| x);
float_element!(f16, F16, f16::from_f32, f16::to_f32);
float_element!(bf16, BF16, bf16::from_f32, bf16::to_f32);

fn identify<T: Element>(
    fp: &Fingerprinter, case: &Case, a: ArrayViewD<'_, T>,
) -> Result<ItemIdentity, Error> {
    let spec = ItemSpec {
        modality: case.modality(),
        layout: case.layout(),
        content: ItemContent::Tensor(T::view(a)),
        params: Default::default(),
    };
    fp.identify(0, &spec)
}

/// Same outcome for two layouts of equal content.
fn same(
    what: &str, a: &Result<ItemIdentity, Error>, b: &Result<ItemIdentity, Error>,
) -> Result<(), TestCaseError> {
    match (a, b) {
        (Ok(x), Ok(y)) => {
            prop_assert_eq!(x.fingerprint, y.fingerprint, "{}: fingerprints differ", what);
            prop_assert_eq!(&x.evidence, &y.evidence, "{}: check digests differ", what);
            prop_assert_eq!(x.num_tokens, y.num_tokens);
        }
        (Err(x), Err(y)) => prop_assert_eq!(x.to_string(), y.to_string(), "{}: errors differ", what),
        _ => {
            return Err(TestCaseError::fail(format!(
                "{what}: {:?} vs {:?}",
                a.as_ref().err(),
                b.as_ref().err()
            )));
        }
    }
    Ok(())
}

fn check<T: Element>(case: &Case, values: Vec<T>) -> Result<(), TestCaseError> {
    let fp = fingerprinter();
    let shape = IxDyn(&case.shape);
    let a = ArrayD::from_shape_vec(shape.clone(), values).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let base = identify(&fp, case, a.view());
    if let Err(e) = &base {
        prop_assert!(is_input_error(e), "unexpected error kind: {e:?}");
    }

    // Permuted strides: a standard copy in rotated axis order, viewed back.
    let n = case.shape.len();
    let perm: Vec<usize> = (0..n).map(|i| (i + case.rotate) % n).collect();
    let mut inverse = vec![0; n];
    for (i, &p) in perm.iter().enumerate() {
        inverse[p] = i;
    }
    let permuted = a.view().permuted_axes(perm).as_standard_layout().into_owned();
    same("permuted", &base, &identify(&fp, case, permuted.view().permuted_axes(inverse)))?;

    // Stepped strides: every other row of a buffer twice as long on axis 0.
    let mut wide_shape = case.shape.clone();
    wide_shape[0] *= 2;
    let filler = a.iter().next().copied().map(T::perturb);
    if let Some(filler) = filler {
        let mut wide = ArrayD::from_elem(IxDyn(&wide_shape), filler);
        let every_other = |ax: ndarray::AxisDescription| {
            if ax.axis.index() == 0 { Slice::new(0, None, 2) } else { Slice::from(..) }
        };
        wide.slice_each_axis_mut(every_other).assign(&a);
        same("stepped", &base, &identify(&fp, case, wide.slice_each_axis(every_other)))?;
    }

    // Negative stride: a copy reversed on axis 0, viewed reversed again.
    let mut reversed = a.clone();
    reversed.invert_axis(Axis(0));
    let reversed = reversed.as_standard_layout().into_owned();
    let mut back = reversed.view();
    back.invert_axis(Axis(0));
    same("reversed", &base, &identify(&fp, case, back))?;

    // -0.0 and +0.0 are one value.
    same("zero sign", &base, &identify(&fp, case, a.mapv(T::flip_zero).view()))?;

    // One different element: a different fingerprint.
    if let Ok(id) = &base
        && let Some(first) = a.iter().next().copied()
    {
        let mut changed = a.clone();
        if let Some(x) = changed.iter_mut().next() {
            *x = first.perturb();
        }
        if let Ok(other) = identify(&fp, case, changed.view()) {
            prop_assert_ne!(id.fingerprint, other.fingerprint, "changing element 0 kept the fingerprint");
        }
    }
    Ok(())
}

fn run(case: Case) -> Result<(), TestCaseError> {
    match case.dtype {
        0 => check(&case, case.ints().map(|x| x as u8).collect()),
        1 => check(&case, case.ints().map(|x| x as i32).collect()),
        2 => check(&case, case.ints().map(|x| x as i64).collect()),
        3 => check(&case, case.floats().into_iter().map(f16::from_f32).collect()),
        4 => check(&case, case.floats().into_iter().map(bf16::from_f32).collect()),
        _ => check(&case, case.floats()),
    }
}

#[test]
fn fuzz_canonicalisation() {
    fuzz_common::fuzz("canon", 256, case(), run);
}

#[test]
fn fuzz_encoded_items() {
    let strategy = (prop::collection::vec(any::<u8>(), 0..64), "[a-z0-9/]{0,8}", 0u8..3, any::<u8>());
    fuzz_common::fuzz("canon-encoded", 256, strategy, |(bytes, format, modality, flip)| {
        let fp = fingerprinter();
        let modality = [Modality::Image, Modality::Audio, Modality::Video][modality as usize];
        let layout = match modality {
            Modality::Image => ItemLayout::Image { grid_thw: [1, 2, 2] },
            Modality::Audio => ItemLayout::Audio { mel_frames: 100 },
            Modality::Video => ItemLayout::Video { grid_thw: [2, 2, 2], seconds_per_grid: 1.0 },
        };
        let spec = |bytes: &[u8]| {
            let item = ItemSpec {
                modality,
                layout,
                content: ItemContent::Encoded { bytes, format: &format },
                params: Default::default(),
            };
            fp.identify(0, &item)
        };
        let (a, b) = (spec(&bytes), spec(&bytes.clone()));
        same("encoded", &a, &b)?;
        if let (Ok(x), Some(first)) = (&a, bytes.first()) {
            let mut other = bytes.clone();
            other[0] = first ^ flip.max(1);
            if let Ok(y) = spec(&other) {
                prop_assert_ne!(x.fingerprint, y.fingerprint);
            }
        } else if let Err(e) = &a {
            prop_assert!(is_input_error(e), "unexpected error kind: {e:?}");
        }
        Ok(())
    });
}
