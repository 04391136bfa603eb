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
mod simd;
mod stream;

/// Element type of an item's content tensor (every one of the six).
pub use crate::dtype::Dtype;
pub use crate::modality::Modality;
pub use fingerprint::{Fingerprinter, TREE_CHUNK, TREE_THRESHOLD, read_floor};
pub use header::ITEM_DOMAIN;
pub use key::FingerprintKey;
pub use layout::{LayoutRules, SPATIAL_MERGE, audio_tokens, check_shape};
pub use stream::STAGING_BYTES;

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

/// The BLAKE3 context that widens a fingerprint to [`Fingerprint::mm_hash_hex`].
const MM_HASH_CONTEXT: &str = "omniprefix 2026-12-02 item identity as a 256-bit mm_hash";

impl Fingerprint {
    /// The item's identity as 64 lowercase hex digits: the width of vLLM's
    /// `mm_hash` (a SHA-256 hex digest) and what a vLLM user passes as
    /// `multi_modal_uuids`; our KV events carry it in `extra_keys`.
    ///
    /// The first 32 digits are the fingerprint itself; the last 32 are derived
    /// from it (BLAKE3 `derive_key`), never padding, so two items that differ
    /// differ in every part a reader may truncate to.
    ///
    /// ```
    /// use omniprefix::canon::Fingerprint;
    /// let hex = Fingerprint(0x0123_4567_89ab_cdef_0011_2233_4455_6677).mm_hash_hex();
    /// assert_eq!(hex.len(), 64);
    /// assert!(hex.starts_with("0123456789abcdef0011223344556677"));
    /// assert_ne!(&hex[32..], "00000000000000000000000000000000");
    /// ```
    pub fn mm_hash_hex(&self) -> String {
        let wide = blake3::derive_key(MM_HASH_CONTEXT, &self.0.to_be_bytes());
        let mut tail = [0u8; 16];
        tail.copy_from_slice(&wide[..16]);
        format!("{:032x}{:032x}", self.0, u128::from_be_bytes(tail))
    }
}

/// How a fingerprint hit is confirmed before it is reported.
///
/// The policy is given once, to the [`Fingerprinter`]: it decides which
/// [`Evidence`] every identity carries, and the prefix index confirms a hit
/// with whatever evidence the two identities hold. An index has no policy of
/// its own, so it cannot disagree with the fingerprinter that feeds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ValidationPolicy {
    /// Compare the canonical bytes retained at insert with the request's.
    ExactBytes,
    /// Compare an independent second digest computed in the same pass.
    #[default]
    SecondDigest,
    /// Trust the fingerprint alone (research only: collisions become wrong hits).
    Unvalidated,
}

/// The validation material of one item, as its fingerprinter's policy made it.
///
/// The policy is carried in the evidence: an identity holds exactly the
/// material of one [`ValidationPolicy`], never a mix, and two identities made
/// under different policies never confirm each other (a miss, not a wrong hit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Evidence {
    /// `Unvalidated`: the fingerprint alone is trusted.
    Unvalidated,
    /// `SecondDigest`: an independent second digest of the same header + bytes.
    SecondDigest(Fingerprint),
    /// `ExactBytes`: the canonical header + bytes.
    ExactBytes(Arc<[u8]>),
}

impl Evidence {
    /// The policy that produces this kind of evidence.
    pub fn policy(&self) -> ValidationPolicy {
        match self {
            Evidence::Unvalidated => ValidationPolicy::Unvalidated,
            Evidence::SecondDigest(_) => ValidationPolicy::SecondDigest,
            Evidence::ExactBytes(_) => ValidationPolicy::ExactBytes,
        }
    }

    /// The second digest, under `SecondDigest`.
    pub fn check(&self) -> Option<Fingerprint> {
        match self {
            Evidence::SecondDigest(check) => Some(*check),
            _ => None,
        }
    }

    /// The retained canonical header + bytes, under `ExactBytes`.
    pub fn retained(&self) -> Option<&Arc<[u8]>> {
        match self {
            Evidence::ExactBytes(bytes) => Some(bytes),
            _ => None,
        }
    }
}

/// What the prefix index keeps of an item, and what it validates a
/// fingerprint hit against.
#[derive(Debug, Clone)]
pub struct ItemIdentity {
    /// The keyed digest the index is keyed on.
    pub fingerprint: Fingerprint,
    /// What a fingerprint hit on this item is confirmed against.
    pub evidence: Evidence,
    pub modality: Modality,
    pub layout: ItemLayout,
    /// Number of embedding rows (= placeholder tokens) the item occupies.
    pub num_tokens: usize,
    /// Bytes of content that were read to fingerprint it.
    pub content_bytes: usize,
}
