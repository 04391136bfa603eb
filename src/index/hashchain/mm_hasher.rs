//! vLLM's `MultiModalHasher.hash_kwargs`: a digest (BLAKE3 by default) over a
//! framed serialisation of keyword arguments, which derives each multimodal
//! item's `mm_hash` from its RAW media (decoded pixels, waveform, frames).
//!
//! The framing (vLLM 0.33) is uniquely decodable: every byte chunk is preceded
//! by its length as 8 little-endian bytes, and every value by a tag — `0`
//! None, `1` sequence (then its length), `2` mapping (then its length, then
//! framed key + value pairs), `3` leaf. Keyword arguments go in sorted key
//! order, each as framed key + value. A numpy array is the leaf
//! `"ndarray" → {"dtype": dtype.str, "shape": (..), "data": raw bytes}`; a PIL
//! image the leaf `"image" → {"mode": mode, "data": np.asarray(image)}`;
//! integers are `np.array(int).tobytes()` (little-endian i64).

use ndarray::{ArrayView3, ArrayViewD};
use sha2::{Digest, Sha256, Sha512};

use crate::Result;
use crate::canon::{Modality, TensorView};
use crate::error::RequestError;

const TAG_SEQUENCE: u8 = 1;
const TAG_MAPPING: u8 = 2;
const TAG_LEAF: u8 = 3;

/// The digest `hash_kwargs` feeds the framed stream to (vLLM's `mm_hasher_algorithm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MmHashAlgorithm {
    #[default]
    Blake3,
    Sha256,
    Sha512,
}

/// Raw media in the form vLLM receives it.
#[derive(Debug, Clone)]
pub enum MmMedia<'a> {
    /// A PIL image in mode `RGB`: `H x W x 3` u8 pixels (no palette, no EXIF ImageID).
    PilRgb(ArrayView3<'a, u8>),
    /// A numpy array (image HWC, waveform, video THWC); bf16 is hashed the
    /// way vLLM hashes a bf16 `torch.Tensor` (numpy has no bfloat16).
    Array(TensorView<'a>),
}

/// One keyword argument value of `hash_kwargs`.
#[derive(Debug, Clone)]
pub enum Kwarg<'a> {
    Str(&'a str),
    Media(MmMedia<'a>),
}

/// `MultiModalHasher.hash_kwargs(algorithm, **kwargs)`: hex digest.
///
/// ```
/// use omniprefix::index::hashchain::{hash_kwargs, Kwarg, MmHashAlgorithm};
/// let h = hash_kwargs(MmHashAlgorithm::Blake3, &[("model_id", Kwarg::Str("m"))]).unwrap();
/// // framed key, leaf tag, framed value
/// let mut want = 8u64.to_le_bytes().to_vec();
/// want.extend_from_slice(b"model_id\x03");
/// want.extend_from_slice(&1u64.to_le_bytes());
/// want.extend_from_slice(b"m");
/// assert_eq!(h, blake3::hash(&want).to_hex().to_string());
/// ```
pub fn hash_kwargs(algorithm: MmHashAlgorithm, kwargs: &[(&str, Kwarg<'_>)]) -> Result<String> {
    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }
    Ok(match algorithm {
        MmHashAlgorithm::Blake3 => {
            let mut h = blake3::Hasher::new();
            serialize_kwargs(kwargs, &mut |b: &[u8]| {
                h.update(b);
            })?;
            h.finalize().to_hex().to_string()
        }
        MmHashAlgorithm::Sha256 => {
            let mut h = Sha256::new();
            serialize_kwargs(kwargs, &mut |b: &[u8]| h.update(b))?;
            hex(&h.finalize())
        }
        MmHashAlgorithm::Sha512 => {
            let mut h = Sha512::new();
            serialize_kwargs(kwargs, &mut |b: &[u8]| h.update(b))?;
            hex(&h.finalize())
        }
    })
}

/// The `mm_hash` of one item as vLLM's processor computes it:
/// `hash_kwargs("blake3", model_id=model_id, <modality>=media)`.
pub fn hash_mm_item<'a>(model_id: &'a str, modality: Modality, media: MmMedia<'a>) -> Result<String> {
    let key = match modality {
        Modality::Image => "image",
        Modality::Audio => "audio",
        Modality::Video => "video",
    };
    hash_kwargs(MmHashAlgorithm::Blake3, &[("model_id", Kwarg::Str(model_id)), (key, Kwarg::Media(media))])
}

type Sink<'s> = &'s mut dyn FnMut(&[u8]);

/// The whole digest input: kwargs in sorted key order (Python `sorted` on str
/// is code-point order, which byte order of UTF-8 preserves).
fn serialize_kwargs(kwargs: &[(&str, Kwarg<'_>)], sink: Sink<'_>) -> Result<()> {
    let mut order: Vec<&(&str, Kwarg<'_>)> = kwargs.iter().collect();
    order.sort_by_key(|(k, _)| *k);
    for (key, value) in order {
        leaf_key(key.as_bytes(), sink);
        match value {
            Kwarg::Str(s) => framed(s.as_bytes(), sink),
            Kwarg::Media(MmMedia::PilRgb(pixels)) => {
                if pixels.dim().2 != 3 {
                    return Err(RequestError::MediaShape {
                        what: "PIL RGB image",
                        expected: "H x W x 3".into(),
                        found: pixels.shape().to_vec(),
                    }
                    .into());
                }
                object_header(b"image", 2, sink);
                str_entry(b"mode", b"RGB", sink);
                leaf_key(b"data", sink);
                serialize_array(&TensorView::U8(pixels.view().into_dyn()), sink);
            }
            Kwarg::Media(MmMedia::Array(view)) => serialize_array(view, sink),
        }
    }
    Ok(())
}

/// A chunk preceded by its length.
fn framed(chunk: &[u8], sink: Sink<'_>) {
    sink(&(chunk.len() as u64).to_le_bytes());
    sink(chunk);
}

/// `"name" → {..}`: the framed name of an object and the header of its mapping, whose
/// `len` framed key + value pairs follow.
fn object_header(name: &[u8], len: u64, sink: Sink<'_>) {
    framed(name, sink);
    sink(&[TAG_MAPPING]);
    sink(&len.to_le_bytes());
}

/// A mapping key whose value is a leaf: the framed key and the leaf tag (the leaf's chunk follows).
fn leaf_key(key: &[u8], sink: Sink<'_>) {
    framed(key, sink);
    sink(&[TAG_LEAF]);
}

/// A mapping entry whose value is a string leaf.
fn str_entry(key: &[u8], value: &[u8], sink: Sink<'_>) {
    leaf_key(key, sink);
    framed(value, sink);
}

/// A leaf `np.array(int).tobytes()`.
fn int_leaf(v: i64, sink: Sink<'_>) {
    sink(&[TAG_LEAF]);
    framed(&v.to_le_bytes(), sink);
}

/// `serialize_item` of an array (after its leaf tag): numpy's framing, or
/// torch's for bf16.
fn serialize_array(view: &TensorView<'_>, sink: Sink<'_>) {
    match view {
        TensorView::U8(v) => ndarray_item("|u1", v, |x| i64::from(*x).to_le_bytes(), sink),
        TensorView::I32(v) => ndarray_item("<i4", v, |x| i64::from(*x).to_le_bytes(), sink),
        TensorView::I64(v) => ndarray_item("<i8", v, |x| x.to_le_bytes(), sink),
        TensorView::F16(v) => ndarray_item("<f2", v, |x| f64::from(x.to_f32()).to_le_bytes(), sink),
        TensorView::F32(v) => ndarray_item("<f4", v, |x| f64::from(*x).to_le_bytes(), sink),
        TensorView::BF16(v) => {
            // numpy has no bfloat16: vLLM hashes the bf16 torch.Tensor as
            // "tensor" → {"original_dtype", "original_shape", "data": u8 view}.
            object_header(b"tensor", 3, sink);
            str_entry(b"original_dtype", b"torch.bfloat16", sink);
            shape_entry(b"original_shape", v.shape(), sink);
            leaf_key(b"data", sink);
            ndarray_header("|u1", &[v.len() * 2], sink);
            framed_elements(v.len() * 2, v.iter().map(|x| x.to_bits().to_le_bytes()), sink);
        }
    }
}

/// `"ndarray" → {"dtype", "shape", "data"}` for an array of `T`. `scalar`
/// renders a 0-d array's `obj.item()` (a Python int or float, so i64 / f64).
fn ndarray_item<T, const N: usize>(
    dtype: &str, v: &ArrayViewD<'_, T>, scalar: impl Fn(&T) -> [u8; 8], sink: Sink<'_>,
) where
    T: bytemuck::Pod + ToLeBytes<N>,
{
    ndarray_header(dtype, v.shape(), sink);
    if v.ndim() == 0 {
        if let Some(x) = v.first() {
            framed(&scalar(x), sink);
        }
        return;
    }
    let nbytes = v.len() * size_of::<T>();
    match v.as_slice() {
        Some(s) if cfg!(target_endian = "little") => framed(bytemuck::cast_slice(s), sink),
        _ => framed_elements(nbytes, v.iter().map(ToLeBytes::to_le), sink),
    }
}

/// The mapping header and `dtype`, `shape` entries, up to the `data` leaf tag.
fn ndarray_header(dtype: &str, shape: &[usize], sink: Sink<'_>) {
    object_header(b"ndarray", 3, sink);
    str_entry(b"dtype", dtype.as_bytes(), sink);
    shape_entry(b"shape", shape, sink);
    leaf_key(b"data", sink);
}

/// A mapping entry whose value is a shape tuple: a sequence of int leaves.
fn shape_entry(key: &[u8], shape: &[usize], sink: Sink<'_>) {
    framed(key, sink);
    sink(&[TAG_SEQUENCE]);
    sink(&(shape.len() as u64).to_le_bytes());
    for &d in shape {
        int_leaf(d as i64, sink);
    }
}

/// One framed chunk of `nbytes` streamed element by element in C order
/// through a staging buffer (strided views, big-endian hosts).
fn framed_elements<const N: usize>(nbytes: usize, elements: impl Iterator<Item = [u8; N]>, sink: Sink<'_>) {
    sink(&(nbytes as u64).to_le_bytes());
    let mut staging = Vec::with_capacity(64 * 1024);
    for e in elements {
        staging.extend_from_slice(&e);
        if staging.len() + N > staging.capacity() {
            sink(&staging);
            staging.clear();
        }
    }
    if !staging.is_empty() {
        sink(&staging);
    }
}

/// Little-endian bytes of one element (numpy's `<` dtypes).
trait ToLeBytes<const N: usize> {
    fn to_le(&self) -> [u8; N];
}

macro_rules! to_le_bytes {
    ($($t:ty => $n:literal),*) => {$(
        impl ToLeBytes<$n> for $t {
            fn to_le(&self) -> [u8; $n] {
                self.to_le_bytes()
            }
        }
    )*};
}
to_le_bytes!(u8 => 1, i32 => 4, i64 => 8, half::f16 => 2, f32 => 4);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use ndarray::{Array3, ArrayD, IxDyn, ShapeBuilder};

    /// Collects the framed byte stream instead of hashing it.
    fn stream(kwargs: &[(&str, Kwarg<'_>)]) -> Vec<u8> {
        let mut out = Vec::new();
        serialize_kwargs(kwargs, &mut |b: &[u8]| out.extend_from_slice(b)).unwrap();
        out
    }

    fn fr(out: &mut Vec<u8>, chunk: &[u8]) {
        out.extend_from_slice(&(chunk.len() as u64).to_le_bytes());
        out.extend_from_slice(chunk);
    }

    /// Hand-built stream for a 2-element f32 array, from vLLM's framing rules.
    #[test]
    fn ndarray_stream_matches_hand_framing() {
        let a = ArrayD::from_shape_vec(IxDyn(&[2]), vec![1.0f32, -2.0]).unwrap();
        let got = stream(&[("audio", Kwarg::Media(MmMedia::Array(TensorView::F32(a.view()))))]);
        let mut want = Vec::new();
        fr(&mut want, b"audio");
        want.push(3);
        fr(&mut want, b"ndarray");
        want.push(2);
        want.extend_from_slice(&3u64.to_le_bytes());
        fr(&mut want, b"dtype");
        want.push(3);
        fr(&mut want, b"<f4");
        fr(&mut want, b"shape");
        want.push(1);
        want.extend_from_slice(&1u64.to_le_bytes());
        want.push(3);
        fr(&mut want, &2i64.to_le_bytes());
        fr(&mut want, b"data");
        want.push(3);
        fr(&mut want, &[1.0f32.to_le_bytes(), (-2.0f32).to_le_bytes()].concat());
        assert_eq!(got, want);
    }

    /// Keyword arguments are hashed in sorted key order, whatever the call order.
    #[test]
    fn kwargs_are_sorted() {
        let a = [("b", Kwarg::Str("1")), ("a", Kwarg::Str("2"))];
        let b = [("a", Kwarg::Str("2")), ("b", Kwarg::Str("1"))];
        assert_eq!(stream(&a), stream(&b));
        let sha = hash_kwargs(MmHashAlgorithm::Sha256, &a).unwrap();
        assert_eq!(sha, hex::encode(Sha256::digest(stream(&a))));
        assert_eq!(hash_kwargs(MmHashAlgorithm::Sha512, &a).unwrap().len(), 128);
    }

    /// A non-contiguous view hashes like its C-order copy (numpy `tobytes`).
    #[test]
    fn strided_views_hash_like_contiguous_copies() {
        let f = Array3::from_shape_vec((2, 3, 3).f(), (0u8..18).collect()).unwrap();
        let c = f.as_standard_layout().to_owned();
        let hf = hash_mm_item("m", Modality::Image, MmMedia::PilRgb(f.view())).unwrap();
        let hc = hash_mm_item("m", Modality::Image, MmMedia::PilRgb(c.view())).unwrap();
        assert_eq!(hf, hc);
        let ff = f.mapv(f32::from);
        let cf = c.mapv(f32::from);
        let h = |a: &Array3<f32>| {
            hash_mm_item("m", Modality::Audio, MmMedia::Array(TensorView::F32(a.view().into_dyn()))).unwrap()
        };
        assert_eq!(h(&ff.as_standard_layout().to_owned()), h(&cf));
        assert_eq!(h(&ff), h(&cf));
        let af = hash_mm_item("m", Modality::Image, MmMedia::Array(TensorView::U8(f.view().into_dyn())));
        assert_ne!(af.unwrap(), hf, "PIL and ndarray framings differ");
    }

    /// bf16 takes torch's path: the original shape, then the bytes as a 1-D u8 array.
    #[test]
    fn bf16_is_hashed_as_torch_bytes() {
        let v = vec![half::bf16::from_f32(1.0), half::bf16::from_f32(-3.5)];
        let a = ArrayD::from_shape_vec(IxDyn(&[1, 2]), v.clone()).unwrap();
        let got = stream(&[("x", Kwarg::Media(MmMedia::Array(TensorView::BF16(a.view()))))]);
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
        let mut tail = Vec::new();
        fr(&mut tail, b"|u1");
        fr(&mut tail, b"shape");
        tail.extend_from_slice(&[1, 1, 0, 0, 0, 0, 0, 0, 0, 3]);
        fr(&mut tail, &4i64.to_le_bytes());
        fr(&mut tail, b"data");
        tail.push(3);
        fr(&mut tail, &bytes);
        assert!(got.ends_with(&tail));
        assert!(got.windows(14).any(|w| w == b"torch.bfloat16"));
    }

    /// A 0-d float array hashes `obj.item()`: a Python float, i.e. 8 bytes f64.
    #[test]
    fn zero_dim_arrays_hash_their_python_scalar() {
        let a = ArrayD::from_shape_vec(IxDyn(&[]), vec![0.5f32]).unwrap();
        let got = stream(&[("x", Kwarg::Media(MmMedia::Array(TensorView::F32(a.view()))))]);
        let mut tail = Vec::new();
        fr(&mut tail, &0.5f64.to_le_bytes());
        assert!(got.ends_with(&tail));
    }

    #[test]
    fn pil_image_needs_three_channels() {
        let a = Array3::<u8>::zeros((2, 2, 4));
        let err = hash_mm_item("m", Modality::Image, MmMedia::PilRgb(a.view())).unwrap_err();
        assert!(matches!(err, Error::Request(RequestError::MediaShape { what: "PIL RGB image", .. })));
    }
}
