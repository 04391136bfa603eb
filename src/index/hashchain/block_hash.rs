//! vLLM V1 block hashing: `NONE_HASH`, `hash_block_tokens` and the per-block
//! extra keys (LoRA name, multimodal items, cache salt), chained over full blocks.
//!
//! Each full block's hash is `hash_fn((parent_hash, tokens, extra_keys))` over
//! canonical CBOR, with the chain seeded by `NONE_HASH = hash_fn(seed)`.
//! Partial trailing blocks are never hashed (vLLM caches full blocks only).

use sha2::{Digest, Sha256};

use super::cbor;
use crate::Result;
use crate::error::ConfigError;

/// The serialise-then-digest functions vLLM offers for prefix caching.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HashFn {
    /// `sha256_cbor`: SHA-256 of canonical CBOR (32-byte hashes). vLLM's default.
    #[default]
    Sha256Cbor,
    /// `xxhash_cbor`: XXH3-128 of canonical CBOR, big-endian digest (16-byte hashes).
    XxhashCbor,
}

impl HashFn {
    /// Digests already-encoded CBOR bytes.
    fn digest(self, encoded: &[u8]) -> BlockHash {
        match self {
            HashFn::Sha256Cbor => BlockHash::from_slice(&Sha256::digest(encoded)),
            HashFn::XxhashCbor => BlockHash::from_slice(&xxhash_rust::xxh3::xxh3_128(encoded).to_be_bytes()),
        }
    }
}

/// A block hash as vLLM's `BlockHash` bytes: 32 bytes (SHA-256) or 16 (XXH3-128).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash {
    bytes: [u8; 32],
    len: u8,
}

impl BlockHash {
    /// `digest` is at most 32 bytes (both hash functions guarantee it).
    fn from_slice(digest: &[u8]) -> Self {
        debug_assert!(digest.len() <= 32);
        let mut bytes = [0u8; 32];
        bytes[..digest.len()].copy_from_slice(digest);
        BlockHash { bytes, len: digest.len() as u8 }
    }

    /// The digest bytes, as Python's `bytes` value.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// Lower-case hex of the digest (what `bytes.hex()` prints).
    pub fn to_hex(&self) -> String {
        self.as_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// One element of a block's `extra_keys` tuple.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtraKey<'a> {
    /// `("lora", lora_name)`.
    Lora(&'a str),
    /// `("mm", mm_hash, block_start - item_offset)`: an item overlapping the block.
    Mm { hash: &'a str, offset: i64 },
    /// `("cache_salt", salt)`: on block 0 only.
    CacheSalt(&'a str),
}

impl ExtraKey<'_> {
    fn encode(&self, out: &mut Vec<u8>) {
        match *self {
            ExtraKey::Lora(name) => {
                cbor::array(out, 2);
                cbor::text(out, "lora");
                cbor::text(out, name);
            }
            ExtraKey::Mm { hash, offset } => {
                cbor::array(out, 3);
                cbor::text(out, "mm");
                cbor::text(out, hash);
                cbor::int(out, offset);
            }
            ExtraKey::CacheSalt(salt) => {
                cbor::array(out, 2);
                cbor::text(out, "cache_salt");
                cbor::text(out, salt);
            }
        }
    }
}

/// `NONE_HASH`: the parent of block 0, `hash_fn(seed)` (vLLM: `init_none_hash`
/// with `PYTHONHASHSEED` as the seed).
///
/// ```
/// use omniprefix::index::hashchain::{none_hash, HashFn};
/// let h = none_hash(HashFn::Sha256Cbor, "vllm-none-hash");
/// assert!(h.to_hex().starts_with("9bd96a48"));
/// ```
pub fn none_hash(hash_fn: HashFn, seed: &str) -> BlockHash {
    let mut out = Vec::with_capacity(seed.len() + 9);
    cbor::text(&mut out, seed);
    hash_fn.digest(&out)
}

/// `hash_block_tokens(hash_fn, parent, tokens, extra_keys)`: the hash of one
/// block, chained on its parent. An empty `extra_keys` is encoded as `None`,
/// as vLLM does.
pub fn hash_block_tokens(
    hash_fn: HashFn, parent: &BlockHash, tokens: &[u32], extra_keys: &[ExtraKey<'_>],
) -> BlockHash {
    let mut buf = Vec::with_capacity(64 + tokens.len() * 5);
    hash_block_into(&mut buf, hash_fn, parent, tokens, extra_keys)
}

/// [`hash_block_tokens`] reusing `buf` for the encoding.
fn hash_block_into(
    buf: &mut Vec<u8>, hash_fn: HashFn, parent: &BlockHash, tokens: &[u32], extra_keys: &[ExtraKey<'_>],
) -> BlockHash {
    buf.clear();
    cbor::array(buf, 3);
    cbor::bytes(buf, parent.as_bytes());
    cbor::array(buf, tokens.len());
    for &t in tokens {
        cbor::uint(buf, u64::from(t));
    }
    if extra_keys.is_empty() {
        cbor::null(buf);
    } else {
        cbor::array(buf, extra_keys.len());
        for key in extra_keys {
            key.encode(buf);
        }
    }
    hash_fn.digest(buf)
}

/// Where one multimodal item's placeholder tokens sit, and its identifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmPlaceholder<'a> {
    /// The item's mm hash (vLLM's `mm_feature.identifier`).
    pub hash: &'a str,
    /// First placeholder position.
    pub offset: usize,
    /// Number of placeholder positions from `offset`.
    pub length: usize,
}

/// Everything of a request that enters its block hashes.
#[derive(Debug, Clone, Copy, Default)]
pub struct BlockKeyRequest<'a> {
    /// The prompt's token ids; only full blocks are hashed.
    pub tokens: &'a [u32],
    /// Items sorted by `offset` (the order vLLM keeps `mm_features` in).
    pub mm_items: &'a [MmPlaceholder<'a>],
    /// `request.cache_salt`: an extra key of block 0.
    pub cache_salt: Option<&'a str>,
    /// `request.lora_request.lora_name`: an extra key of every block.
    pub lora_name: Option<&'a str>,
}

/// A configured block hasher: hash function, block size and `NONE_HASH`.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    hash_fn: HashFn,
    block_size: usize,
    none_hash: BlockHash,
}

/// vLLM's seed for `NONE_HASH` in the reference vectors (`PYTHONHASHSEED`).
pub const DEFAULT_NONE_HASH_SEED: &str = "vllm-none-hash";

impl BlockHasher {
    /// A hasher over blocks of `block_size` tokens; `block_size` must be positive.
    pub fn new(hash_fn: HashFn, block_size: usize, seed: &str) -> Result<Self> {
        ConfigError::require_positive("block hasher", "block_size", block_size)?;
        Ok(BlockHasher { hash_fn, block_size, none_hash: none_hash(hash_fn, seed) })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The chain's root parent.
    pub fn none_hash(&self) -> BlockHash {
        self.none_hash
    }

    /// Hashes of the first `max_blocks` full blocks of `req` (fewer when the
    /// request has fewer full blocks); vLLM's `get_request_block_hasher`.
    ///
    /// ```
    /// use omniprefix::index::hashchain::{BlockHasher, BlockKeyRequest, HashFn};
    /// let hasher = BlockHasher::new(HashFn::Sha256Cbor, 16, "vllm-none-hash").unwrap();
    /// let tokens: Vec<u32> = (100..148).collect();
    /// let hashes = hasher.request_block_hashes(
    ///     &BlockKeyRequest { tokens: &tokens, ..Default::default() },
    ///     usize::MAX,
    /// );
    /// assert_eq!(hashes.len(), 3);
    /// assert!(hashes[0].to_hex().starts_with("c78a554a"));
    /// ```
    pub fn request_block_hashes(&self, req: &BlockKeyRequest<'_>, max_blocks: usize) -> Vec<BlockHash> {
        let n = (req.tokens.len() / self.block_size).min(max_blocks);
        let mut hashes = Vec::with_capacity(n);
        let mut buf = Vec::with_capacity(64 + self.block_size * 5);
        let mut keys = Vec::new();
        let mut mm_cursor = 0;
        let mut parent = self.none_hash;
        for (i, tokens) in req.tokens.chunks_exact(self.block_size).take(n).enumerate() {
            let start = i * self.block_size;
            keys.clear();
            mm_cursor = block_extra_keys(req, start, start + self.block_size, mm_cursor, &mut keys);
            parent = hash_block_into(&mut buf, self.hash_fn, &parent, tokens, &keys);
            hashes.push(parent);
        }
        hashes
    }
}

/// Pushes the extra keys of block `[start, end)` in vLLM's order (LoRA,
/// multimodal items, cache salt on block 0) and returns the first item that
/// may still overlap a later block (vLLM's `start_mm_idx` cursor).
fn block_extra_keys<'a>(
    req: &BlockKeyRequest<'a>, start: usize, end: usize, mut cursor: usize, keys: &mut Vec<ExtraKey<'a>>,
) -> usize {
    if let Some(name) = req.lora_name {
        keys.push(ExtraKey::Lora(name));
    }
    while let Some(item) = req.mm_items.get(cursor) {
        let item_end = item.offset + item.length;
        if item.offset >= end {
            break;
        }
        if item_end > start {
            // Positions are prompt indices, far below i64::MAX.
            keys.push(ExtraKey::Mm { hash: item.hash, offset: start as i64 - item.offset as i64 });
        }
        if item_end > end {
            break; // the item continues into the next block
        }
        cursor += 1;
    }
    if start == 0
        && let Some(salt) = req.cache_salt
    {
        keys.push(ExtraKey::CacheSalt(salt));
    }
    cursor
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    #[test]
    fn none_hash_xxhash_matches_python_xxhash() {
        // xxhash.xxh3_128_digest(cbor2.dumps("vllm-none-hash", canonical=True))
        let h = none_hash(HashFn::XxhashCbor, DEFAULT_NONE_HASH_SEED);
        assert_eq!(h.to_hex(), "a4e364baa0791a6f63bbf917db9b700d");
        assert_eq!(h.as_bytes().len(), 16);
    }

    #[test]
    fn zero_block_size_is_rejected() {
        let err = BlockHasher::new(HashFn::Sha256Cbor, 0, "s").unwrap_err();
        assert!(
            matches!(
                err,
                Error::Config(ConfigError::Invalid { component: "block hasher", field: "block_size", .. })
            ),
            "{err}"
        );
    }

    /// Extra keys per block: an item overlapping two blocks appears in both,
    /// with `block_start - offset`; an item ending on a block boundary does not
    /// leak into the next block; LoRA first, salt last and on block 0 only.
    #[test]
    fn extra_keys_follow_vllm_order_and_overlap() {
        let tokens = vec![0u32; 48];
        let items = [
            MmPlaceholder { hash: "a", offset: 4, length: 12 }, // ends at 16
            MmPlaceholder { hash: "b", offset: 20, length: 20 }, // blocks 1, 2
        ];
        let req = BlockKeyRequest {
            tokens: &tokens,
            mm_items: &items,
            cache_salt: Some("s"),
            lora_name: Some("l"),
        };
        let mut per_block = Vec::new();
        let mut cursor = 0;
        for b in 0..3 {
            let mut keys = Vec::new();
            cursor = block_extra_keys(&req, b * 16, b * 16 + 16, cursor, &mut keys);
            per_block.push(keys);
        }
        assert_eq!(
            per_block[0],
            [ExtraKey::Lora("l"), ExtraKey::Mm { hash: "a", offset: -4 }, ExtraKey::CacheSalt("s")]
        );
        assert_eq!(per_block[1], [ExtraKey::Lora("l"), ExtraKey::Mm { hash: "b", offset: -4 }]);
        assert_eq!(per_block[2], [ExtraKey::Lora("l"), ExtraKey::Mm { hash: "b", offset: 12 }]);
    }

    #[test]
    fn partial_blocks_are_not_hashed_and_max_blocks_caps() {
        let hasher = BlockHasher::new(HashFn::Sha256Cbor, 4, "seed").unwrap();
        let tokens: Vec<u32> = (0..11).collect();
        let req = BlockKeyRequest { tokens: &tokens, ..Default::default() };
        let all = hasher.request_block_hashes(&req, usize::MAX);
        assert_eq!(all.len(), 2);
        assert_eq!(hasher.request_block_hashes(&req, 1), all[..1]);
        assert_eq!(all[0], hash_block_tokens(HashFn::Sha256Cbor, &hasher.none_hash(), &tokens[..4], &[]));
        assert_eq!(all[1], hash_block_tokens(HashFn::Sha256Cbor, &all[0], &tokens[4..8], &[]));
    }
}
