//! vLLM's `MultiModalHasher.hash_kwargs`: BLAKE3 over a framed serialisation of
//! keyword arguments, used to derive each multimodal item's `mm_hash` from its
//! RAW media (decoded pixels, waveform, frames).
//!
//! The framing follows vLLM's `iter_item_to_bytes`: every leaf contributes its
//! dotted key path (UTF-8) followed by its value bytes; a numpy array is the
//! dict `{"dtype": dtype.str, "shape": shape, "data": raw bytes}` under the key
//! `ndarray`; shape entries are `np.array(int).tobytes()` (little-endian i64);
//! a PIL image is `{"mode": mode, "data": np.asarray(image)}` under `image`.

use ndarray::ArrayView3;

use crate::canon::{Modality, TensorView};
use crate::{Error, Result};

/// Raw media in the form vLLM receives it.
#[derive(Debug, Clone)]
pub enum MmMedia<'a> {
    /// A PIL image in mode `RGB`: `H x W x 3` u8 pixels (no palette, no EXIF ImageID).
    PilRgb(ArrayView3<'a, u8>),
    /// A numpy array (image HWC, waveform, video THWC); bf16 is hashed the
    /// way vLLM hashes a bf16 `torch.Tensor` (numpy has no bfloat16).
    Array(TensorView<'a>),
}

/// One keyword argument of `hash_kwargs`.
#[derive(Debug, Clone)]
pub enum Kwarg<'a> {
    Str(&'a str),
    Media(MmMedia<'a>),
}

/// `MultiModalHasher.hash_kwargs("blake3", **kwargs)`: hex BLAKE3 digest.
///
/// ```
/// use omniprefix::index::hashchain::{hash_kwargs, Kwarg};
/// let h = hash_kwargs(&[("model_id", Kwarg::Str("m"))]).unwrap();
/// assert_eq!(h, blake3::hash(b"model_idm").to_hex().to_string());
/// ```
pub fn hash_kwargs(kwargs: &[(&str, Kwarg<'_>)]) -> Result<String> {
    let mut hasher = blake3::Hasher::new();
    for (key, value) in kwargs {
        serialize_kwarg(key, value, &mut |b: &[u8]| {
            hasher.update(b);
        })?;
    }
    Ok(hasher.finalize().to_hex().to_string())
}

/// The `mm_hash` of one item as vLLM's processor computes it:
/// `hash_kwargs(model_id=model_id, <modality>=media)`.
pub fn hash_mm_item<'a>(model_id: &'a str, modality: Modality, media: MmMedia<'a>) -> Result<String> {
    let key = match modality {
        Modality::Image => "image",
        Modality::Audio => "audio",
        Modality::Video => "video",
    };
    hash_kwargs(&[("model_id", Kwarg::Str(model_id)), (key, Kwarg::Media(media))])
}

/// `iter_item_to_bytes(key, value)` for one keyword argument.
fn serialize_kwarg(key: &str, value: &Kwarg<'_>, sink: &mut dyn FnMut(&[u8])) -> Result<()> {
    sink(key.as_bytes());
    match value {
        Kwarg::Str(s) => sink(s.as_bytes()),
        Kwarg::Media(MmMedia::PilRgb(pixels)) => {
            let (_, _, channels) = pixels.dim();
            if channels != 3 {
                return Err(Error::MediaShape {
                    what: "PIL RGB image",
                    expected: "H x W x 3".into(),
                    found: pixels.shape().to_vec(),
                });
            }
            sink(b"image.mode");
            sink(b"RGB");
            sink(b"image.data");
            serialize_ndarray(&TensorView::U8(pixels.view().into_dyn()), sink);
        }
        Kwarg::Media(MmMedia::Array(view)) => serialize_ndarray(view, sink),
    }
    Ok(())
}

/// `serialize_item` of an array: numpy's framing, or torch's for bf16.
fn serialize_ndarray(view: &TensorView<'_>, sink: &mut dyn FnMut(&[u8])) {
    match view {
        TensorView::U8(v) => {
            ndarray_header("|u1", v.shape(), sink);
            match v.as_slice() {
                Some(s) => sink(s),
                None => write_elements(v.iter().map(|x| [*x]), sink),
            }
        }
        TensorView::I32(v) => {
            ndarray_header("<i4", v.shape(), sink);
            write_le(v.as_slice(), || v.iter().map(|x| x.to_le_bytes()), sink);
        }
        TensorView::I64(v) => {
            ndarray_header("<i8", v.shape(), sink);
            write_le(v.as_slice(), || v.iter().map(|x| x.to_le_bytes()), sink);
        }
        TensorView::F16(v) => {
            ndarray_header("<f2", v.shape(), sink);
            write_le(v.as_slice(), || v.iter().map(|x| x.to_le_bytes()), sink);
        }
        TensorView::F32(v) => {
            ndarray_header("<f4", v.shape(), sink);
            write_le(v.as_slice(), || v.iter().map(|x| x.to_le_bytes()), sink);
        }
        TensorView::BF16(v) => {
            // numpy has no bfloat16: vLLM hashes the bf16 torch.Tensor as
            // {"original_dtype", "original_shape", "data": its bytes as u8}.
            sink(b"tensor.original_dtype");
            sink(b"torch.bfloat16");
            for (i, &d) in v.shape().iter().enumerate() {
                sink(format!("tensor.original_shape.{i}").as_bytes());
                sink(&(d as i64).to_le_bytes());
            }
            sink(b"tensor.data");
            ndarray_header("|u1", &[v.len() * 2], sink);
            write_elements(v.iter().map(|x| x.to_bits().to_le_bytes()), sink);
        }
    }
}

/// The `dtype` and `shape` entries, then the `data` key.
fn ndarray_header(dtype: &str, shape: &[usize], sink: &mut dyn FnMut(&[u8])) {
    sink(b"ndarray.dtype");
    sink(dtype.as_bytes());
    for (i, &d) in shape.iter().enumerate() {
        sink(format!("ndarray.shape.{i}").as_bytes());
        sink(&(d as i64).to_le_bytes());
    }
    sink(b"ndarray.data");
}

/// Raw bytes of a contiguous slice on little-endian hosts (one update, like
/// vLLM's memoryview), else element by element in C order.
fn write_le<T, I, const N: usize>(
    slice: Option<&[T]>,
    elements: impl FnOnce() -> I,
    sink: &mut dyn FnMut(&[u8]),
) where
    T: bytemuck::Pod,
    I: Iterator<Item = [u8; N]>,
{
    match slice {
        Some(s) if cfg!(target_endian = "little") => sink(bytemuck::cast_slice(s)),
        _ => write_elements(elements(), sink),
    }
}

/// Streams elements' bytes in C order through a small staging buffer.
fn write_elements<const N: usize>(elements: impl Iterator<Item = [u8; N]>, sink: &mut dyn FnMut(&[u8])) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array3, ArrayD, IxDyn, ShapeBuilder};

    /// Collects the framed byte stream instead of hashing it.
    fn frames(kwargs: &[(&str, Kwarg<'_>)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (k, v) in kwargs {
            serialize_kwarg(k, v, &mut |b: &[u8]| out.extend_from_slice(b)).unwrap();
        }
        out
    }

    /// Hand-built stream for a 1x2 f32 array, from vLLM's `iter_item_to_bytes`.
    #[test]
    fn ndarray_framing_is_key_then_value() {
        let a = ArrayD::from_shape_vec(IxDyn(&[1, 2]), vec![1.0f32, -2.0]).unwrap();
        let got = frames(&[("audio", Kwarg::Media(MmMedia::Array(TensorView::F32(a.view()))))]);
        let mut want = b"audio".to_vec();
        want.extend_from_slice(b"ndarray.dtype<f4ndarray.shape.0");
        want.extend_from_slice(&1i64.to_le_bytes());
        want.extend_from_slice(b"ndarray.shape.1");
        want.extend_from_slice(&2i64.to_le_bytes());
        want.extend_from_slice(b"ndarray.data");
        want.extend_from_slice(&1.0f32.to_le_bytes());
        want.extend_from_slice(&(-2.0f32).to_le_bytes());
        assert_eq!(got, want);
    }

    /// A non-contiguous view hashes like its C-order copy (numpy `tobytes`).
    #[test]
    fn strided_views_hash_like_contiguous_copies() {
        let f = Array3::from_shape_vec((2, 3, 3).f(), (0u8..18).collect()).unwrap();
        let c = f.as_standard_layout().to_owned();
        let hf = hash_mm_item("m", Modality::Image, MmMedia::PilRgb(f.view())).unwrap();
        let hc = hash_mm_item("m", Modality::Image, MmMedia::PilRgb(c.view())).unwrap();
        assert_eq!(hf, hc);
        let af = hash_mm_item("m", Modality::Image, MmMedia::Array(TensorView::U8(f.view().into_dyn())));
        assert_ne!(af.unwrap(), hf, "PIL and ndarray framings differ");
    }

    #[test]
    fn pil_image_needs_three_channels() {
        let a = Array3::<u8>::zeros((2, 2, 4));
        let err = hash_mm_item("m", Modality::Image, MmMedia::PilRgb(a.view())).unwrap_err();
        assert!(matches!(err, Error::MediaShape { what: "PIL RGB image", .. }));
    }
}
