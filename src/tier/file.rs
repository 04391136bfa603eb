//! One tier file: a fixed header, then the block's payload (its page bytes,
//! then, where the layout keeps rows at item positions, those rows:
//! [`ItemCapture::export_block`](crate::kv::ItemCapture::export_block)).
//!
//! The header says whose block this is (model identity, fleet-key fingerprint,
//! block hash), how its payload is laid out, and which format wrote it; an
//! xxh3-64 checksum covers the header and the payload together, so a flipped
//! byte anywhere, a torn write or a truncation fails [`decode`]. A file that
//! fails is a miss to the caller (who deletes it), never a wrong hit.
//!
//! All integers are little-endian; the header has no padding.

use crate::Dtype;
use xxhash_rust::xxh3::Xxh3;

/// The first bytes of every tier file.
pub(crate) const MAGIC: [u8; 8] = *b"OPXTIER\0";

/// The format this build writes and reads; a file of any other version is a miss.
pub const FORMAT_VERSION: u32 = 2;

/// Header bytes: magic 8, version 4, model 32, key fingerprint 16, block hash 8,
/// layout 8 × 4, payload length 8, checksum 8.
pub(crate) const HEADER_BYTES: usize = 8 + 4 + 32 + 16 + 8 + 8 * 4 + 8 + 8;

/// Where the checksum sits: the header's last 8 bytes.
const CHECKSUM_AT: usize = HEADER_BYTES - 8;

/// A digest of the model a block was computed by: its weights' names, shapes
/// and dtypes (and its tokenizer, if any). Blocks of another model are misses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModelId(pub [u8; 32]);

impl ModelId {
    /// The identity of a model described by `parts` (each fed in order, length-prefixed,
    /// so `["ab", "c"]` and `["a", "bc"]` differ).
    ///
    /// ```
    /// use omniprefix::tier::ModelId;
    /// let a = ModelId::of(["w.q", "[32, 32]", "f32"]);
    /// assert_eq!(a, ModelId::of(["w.q", "[32, 32]", "f32"]));
    /// assert_ne!(a, ModelId::of(["w.q", "[32, 32]", "bf16"]));
    /// ```
    pub fn of<I: IntoIterator<Item = S>, S: AsRef<[u8]>>(parts: I) -> Self {
        let mut hasher = blake3::Hasher::new_derive_key("omniprefix 2026 tier model identity");
        for part in parts {
            let part = part.as_ref();
            hasher.update(&(part.len() as u64).to_le_bytes());
            hasher.update(part);
        }
        ModelId(*hasher.finalize().as_bytes())
    }
}

/// How a block's payload is laid out: what a reader must agree on before it
/// copies the bytes into its pages. A file with another layout is a miss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockLayout {
    /// Token positions per block.
    pub block_size: u32,
    /// Attention layers (each with a K and a V page).
    pub layers: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Element type of the K/V pages.
    pub kv_dtype: Dtype,
    /// Captured hidden-state points per position (0 for none).
    pub captured: u32,
    /// Width of one captured row (f32 elements).
    pub hidden: u32,
    /// Width of the rows kept only at item positions, after the page bytes
    /// (f32 elements; 0 for none): a variable tail.
    pub item_width: u32,
}

impl BlockLayout {
    /// Bytes of one block's page payload: K and V of every layer, then the
    /// captured rows (f32). Rows at item positions follow when `item_width` is set.
    ///
    /// ```
    /// use omniprefix::tier::BlockLayout;
    /// use omniprefix::Dtype;
    /// let l = BlockLayout { block_size: 4, layers: 2, kv_heads: 1, head_dim: 8, kv_dtype: Dtype::F16, captured: 3, hidden: 16, item_width: 0 };
    /// assert_eq!(l.payload_bytes(), 2 * 2 * 4 * 8 * 2 + 3 * 4 * 16 * 4);
    /// ```
    pub fn payload_bytes(&self) -> usize {
        let bs = self.block_size as usize;
        let kv = 2 * self.layers as usize * bs * self.kv_heads as usize * self.head_dim as usize;
        kv * self.kv_dtype.size_bytes() + self.captured as usize * bs * self.hidden as usize * 4
    }

    /// The layout of one block of pages allocated as `spec`, with item rows
    /// of `item_width` floats (0 for none).
    pub fn of(spec: &crate::backend::PagesSpec, item_width: usize) -> Self {
        let word = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        BlockLayout {
            block_size: word(spec.block_size),
            layers: word(spec.num_layers),
            kv_heads: word(spec.kv_heads),
            head_dim: word(spec.head_dim),
            kv_dtype: spec.kv_dtype,
            captured: word(spec.captured),
            hidden: word(spec.hidden),
            item_width: word(item_width),
        }
    }

    /// Bytes of one block's file without item rows: its header and page
    /// payload (the least a file takes; the bound counts each file's own size).
    pub fn file_bytes(&self) -> u64 {
        (HEADER_BYTES + self.payload_bytes()) as u64
    }

    /// True when a payload of `len` bytes fits this layout: the page bytes
    /// exactly, plus at least an item-row count where item rows follow.
    pub fn fits(&self, len: usize) -> bool {
        match self.item_width {
            0 => len == self.payload_bytes(),
            _ => len >= self.payload_bytes() + 4,
        }
    }

    fn dtype_tag(dtype: Dtype) -> u32 {
        Dtype::ALL.iter().position(|&d| d == dtype).unwrap_or(usize::MAX) as u32
    }

    fn words(&self) -> [u32; 8] {
        [
            self.block_size,
            self.layers,
            self.kv_heads,
            self.head_dim,
            Self::dtype_tag(self.kv_dtype),
            self.captured,
            self.hidden,
            self.item_width,
        ]
    }
}

/// What a file must say about itself to be served: everything but the block hash
/// is fixed for one engine, so a store holds one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Identity {
    /// The model the blocks were computed by.
    pub model: ModelId,
    /// The fleet key's fingerprint ([`key_fingerprint`]), never the key itself.
    pub key: [u8; 16],
    /// The payload layout.
    pub layout: BlockLayout,
}

/// The fingerprint of a fleet key that tier files carry: a keyed, one-way
/// digest, so a file tells which key made it without revealing the key.
///
/// ```
/// use omniprefix::canon::FingerprintKey;
/// use omniprefix::tier::key_fingerprint;
/// let a = key_fingerprint(&FingerprintKey::fixed(1));
/// assert_eq!(a, key_fingerprint(&FingerprintKey::fixed(1)));
/// assert_ne!(a, key_fingerprint(&FingerprintKey::fixed(2)));
/// assert_ne!(&a[..], &FingerprintKey::fixed(1).as_bytes()[..16]);
/// ```
pub fn key_fingerprint(key: &crate::canon::FingerprintKey) -> [u8; 16] {
    let full = blake3::derive_key("omniprefix 2026 tier fleet-key fingerprint", key.as_bytes());
    let mut out = [0u8; 16];
    out.copy_from_slice(&full[..16]);
    out
}

/// Why a file is not served. Each is a miss; the store counts it and deletes the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejected {
    /// Shorter than its header says, or not a tier file at all.
    Truncated,
    /// The first bytes are not the tier's magic (`OPXTIER\0`).
    NotATierFile,
    /// Written by another format version.
    Version { found: u32 },
    /// Another model's block.
    OtherModel,
    /// Made under another fleet key.
    OtherKey,
    /// Another block under this file's name.
    OtherBlock,
    /// Another layout or dtype.
    OtherLayout,
    /// The checksum does not match: a flipped byte or a torn write.
    Checksum,
}

/// The header and payload of block `hash`, ready to write.
pub(crate) fn encode(id: &Identity, hash: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&id.model.0);
    out.extend_from_slice(&id.key);
    out.extend_from_slice(&hash.to_le_bytes());
    for word in id.layout.words() {
        out.extend_from_slice(&word.to_le_bytes());
    }
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    debug_assert_eq!(out.len(), CHECKSUM_AT);
    let sum = checksum(&out, payload);
    out.extend_from_slice(&sum.to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// The payload of `bytes` if it is block `hash` of `id`, else why not.
pub(crate) fn decode<'a>(id: &Identity, hash: u64, bytes: &'a [u8]) -> Result<&'a [u8], Rejected> {
    let Some((header, payload)) = bytes.split_at_checked(HEADER_BYTES) else {
        return Err(if bytes.starts_with(&MAGIC) { Rejected::Truncated } else { Rejected::NotATierFile });
    };
    let mut r = Reader(header);
    if r.take::<8>() != MAGIC {
        return Err(Rejected::NotATierFile);
    }
    let version = u32::from_le_bytes(r.take());
    if version != FORMAT_VERSION {
        return Err(Rejected::Version { found: version });
    }
    // The checksum first: a flipped identity byte then reads as corruption, not as another owner.
    let len = u64::from_le_bytes(header[CHECKSUM_AT - 8..CHECKSUM_AT].try_into().unwrap_or_default());
    if len != payload.len() as u64 {
        return Err(Rejected::Truncated);
    }
    if checksum(&header[..CHECKSUM_AT], payload).to_le_bytes() != header[CHECKSUM_AT..] {
        return Err(Rejected::Checksum);
    }
    if r.take::<32>() != id.model.0 {
        return Err(Rejected::OtherModel);
    }
    if r.take::<16>() != id.key {
        return Err(Rejected::OtherKey);
    }
    if u64::from_le_bytes(r.take()) != hash {
        return Err(Rejected::OtherBlock);
    }
    if id.layout.words().iter().any(|&w| u32::from_le_bytes(r.take()) != w) {
        return Err(Rejected::OtherLayout);
    }
    Ok(payload)
}

fn checksum(header: &[u8], payload: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(header);
    h.update(payload);
    h.digest()
}

/// Reads fixed-size fields off the front of a header already known to be long enough.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        if let Some((head, rest)) = self.0.split_at_checked(N) {
            out.copy_from_slice(head);
            self.0 = rest;
        }
        out
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn identity(model: u8, key: u8) -> Identity {
        Identity {
            model: ModelId([model; 32]),
            key: [key; 16],
            layout: BlockLayout {
                block_size: 4,
                layers: 2,
                kv_heads: 1,
                head_dim: 4,
                kv_dtype: Dtype::F32,
                captured: 1,
                hidden: 8,
                item_width: 0,
            },
        }
    }

    #[test]
    fn round_trip_and_each_rejection() {
        let id = identity(1, 2);
        let payload: Vec<u8> = (0..id.layout.payload_bytes()).map(|i| i as u8).collect();
        let bytes = encode(&id, 77, &payload);
        assert_eq!(bytes.len() as u64, id.layout.file_bytes());
        assert_eq!(decode(&id, 77, &bytes), Ok(&payload[..]));

        assert_eq!(decode(&identity(9, 2), 77, &bytes), Err(Rejected::OtherModel));
        assert_eq!(decode(&identity(1, 9), 77, &bytes), Err(Rejected::OtherKey));
        assert_eq!(decode(&id, 78, &bytes), Err(Rejected::OtherBlock));
        let mut other_layout = id;
        other_layout.layout.kv_dtype = Dtype::F16;
        assert_eq!(decode(&other_layout, 77, &bytes), Err(Rejected::OtherLayout));
        assert_eq!(decode(&id, 77, &bytes[..bytes.len() - 1]), Err(Rejected::Truncated));
        assert_eq!(decode(&id, 77, &bytes[..10]), Err(Rejected::Truncated));
        assert_eq!(decode(&id, 77, b"hello"), Err(Rejected::NotATierFile));

        let mut old = bytes.clone();
        old[8..12].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(decode(&id, 77, &old), Err(Rejected::Version { found: 0 }));

        // Every single flipped byte is caught (the header's by a field or the checksum).
        for at in 0..bytes.len() {
            let mut flipped = bytes.clone();
            flipped[at] ^= 0x10;
            assert!(decode(&id, 77, &flipped).is_err(), "byte {at} flipped was served");
        }
    }
}
