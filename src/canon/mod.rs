//! Canonical form and fingerprints of multimodal items.
//!
//! An item (image, audio, video) arrives as an ndarray view of any layout and
//! one of six dtypes, or as encoded bytes plus decode parameters. Its identity
//! is a 128-bit keyed digest over a domain-tagged header (modality, dtype,
//! shape, position-affecting layout, processor params) and the canonical bytes.

use std::collections::BTreeMap;
use std::sync::Arc;

use ndarray::ArrayViewD;

mod fingerprint;
mod header;
mod key;
mod keyed_xxh3;
mod layout;
mod stream;

pub use fingerprint::{Fingerprinter, TREE_CHUNK, TREE_THRESHOLD, read_floor};
pub use header::ITEM_DOMAIN;
pub use key::FingerprintKey;
pub use layout::{SPATIAL_MERGE, audio_tokens, check_shape};
pub use stream::STAGING_BYTES;

/// Which encoder an item feeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Modality {
    Image,
    Audio,
    Video,
}

/// Element type of an item's content tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    U8,
    I32,
    I64,
    F16,
    BF16,
    F32,
}

/// A borrowed tensor of any dimensionality and strides.
#[derive(Debug, Clone)]
pub enum TensorView<'a> {
    U8(ArrayViewD<'a, u8>),
    I32(ArrayViewD<'a, i32>),
    I64(ArrayViewD<'a, i64>),
    F16(ArrayViewD<'a, half::f16>),
    BF16(ArrayViewD<'a, half::bf16>),
    F32(ArrayViewD<'a, f32>),
}

/// The position-affecting layout of an item: it fixes the item's placeholder
/// count and its M-RoPE positions, so it is part of the fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum ItemLayout {
    /// Image patches: grid (t, h, w) in patches before the 2x2 merge.
    Image { grid_thw: [u32; 3] },
    /// Video patches: grid (t, h, w) and seconds per temporal grid step.
    Video { grid_thw: [u32; 3], seconds_per_grid: f32 },
    /// Audio: number of mel frames (100 per second at hop 160, 16 kHz).
    Audio { mel_frames: u32 },
}

/// Processor parameters that change what the encoder sees (resize bounds,
/// sampling rate, decode options). Sorted, so equal maps hash equally.
pub type ProcessorParams = BTreeMap<String, String>;

/// What identifies an item's content.
#[derive(Debug, Clone)]
pub enum ItemContent<'a> {
    /// Decoded media or processed features.
    Tensor(TensorView<'a>),
    /// The encoded bytes a client sent (JPEG, MP4, OGG...) and their container format.
    Encoded { bytes: &'a [u8], format: &'a str },
}

/// One multimodal item as the caller gives it.
#[derive(Debug, Clone)]
pub struct ItemSpec<'a> {
    pub modality: Modality,
    pub layout: ItemLayout,
    pub content: ItemContent<'a>,
    pub params: ProcessorParams,
}

/// A 128-bit keyed digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint(pub u128);

/// What the prefix index keeps of an item, and what it validates a
/// fingerprint hit against.
#[derive(Debug, Clone)]
pub struct ItemIdentity {
    /// The keyed digest the index is keyed on.
    pub fingerprint: Fingerprint,
    /// An independent second digest of the same header + bytes (validation policy `SecondDigest`).
    pub check: Option<Fingerprint>,
    /// The canonical header + bytes (validation policy `ExactBytes`).
    pub retained: Option<Arc<[u8]>>,
    pub modality: Modality,
    pub layout: ItemLayout,
    /// Number of embedding rows (= placeholder tokens) the item occupies.
    pub num_tokens: usize,
    /// Bytes of content that were read to fingerprint it.
    pub content_bytes: usize,
}
