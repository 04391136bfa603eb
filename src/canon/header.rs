//! The canonical header: every fact besides the content bytes that decides
//! what an item means to the model, encoded unambiguously.
//!
//! Layout (all integers little-endian): `u64` body length, then the body:
//! domain tag, modality, content kind (tensor dtype + shape, or encoded
//! format), layout kind and every position-affecting field, the derived token
//! count, the sorted processor params, and the content length. Strings are
//! `u64`-length-prefixed, so no two different headers share an encoding.

use super::{ItemContent, ItemLayout, ItemSpec, Modality};

/// Domain tag: separates item fingerprints from any other use of the key.
pub const ITEM_DOMAIN: &[u8] = b"omniprefix/item/v1";

/// Appends typed fields to a byte buffer.
#[derive(Default)]
struct HeaderWriter(Vec<u8>);

impl HeaderWriter {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn len(&mut self, n: usize) {
        self.u64(n as u64);
    }
    fn bytes(&mut self, b: &[u8]) {
        self.len(b.len());
        self.0.extend_from_slice(b);
    }
}

fn modality_tag(m: Modality) -> u8 {
    match m {
        Modality::Image => 1,
        Modality::Audio => 2,
        Modality::Video => 3,
    }
}

/// Encodes the header of `spec`; `num_tokens` and `content_bytes` are the
/// validated token count and canonical content length.
pub(crate) fn encode_header(spec: &ItemSpec<'_>, num_tokens: usize, content_bytes: usize) -> Vec<u8> {
    let mut w = HeaderWriter::default();
    w.bytes(ITEM_DOMAIN);
    w.u8(modality_tag(spec.modality));
    match &spec.content {
        ItemContent::Tensor(view) => {
            w.u8(b'T');
            w.u8(view.dtype().tag());
            w.len(view.shape().len());
            for &d in view.shape() {
                w.len(d);
            }
        }
        ItemContent::Encoded { format, .. } => {
            w.u8(b'E');
            w.bytes(format.as_bytes());
        }
    }
    match spec.layout {
        ItemLayout::Image { grid_thw } => {
            w.u8(b'I');
            grid_thw.iter().for_each(|&d| w.u32(d));
        }
        ItemLayout::Video { grid_thw, seconds_per_grid } => {
            w.u8(b'V');
            grid_thw.iter().for_each(|&d| w.u32(d));
            w.u32(seconds_per_grid.to_bits());
        }
        ItemLayout::Audio { mel_frames } => {
            w.u8(b'A');
            w.u32(mel_frames);
        }
    }
    w.len(num_tokens);
    w.len(spec.params.len());
    for (k, v) in &spec.params {
        w.bytes(k.as_bytes());
        w.bytes(v.as_bytes());
    }
    w.len(content_bytes);
    let mut out = Vec::with_capacity(8 + w.0.len());
    out.extend_from_slice(&(w.0.len() as u64).to_le_bytes());
    out.extend_from_slice(&w.0);
    out
}
