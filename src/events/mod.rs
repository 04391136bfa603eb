//! KV events in vLLM's wire format, so existing cache-aware routers (Dynamo's
//! kv-router, llm-d, vLLM's router) can follow what each replica caches.
//!
//! The scheduler records a [`KvEvent`] whenever a full block enters the index
//! (`BlockStored`), leaves it (`BlockRemoved`) or the whole cache is reset
//! (`AllBlocksCleared`); the engine batches a step's events into a
//! [`KvEventBatch`] and hands it to a `KvEventPublisher`, which encodes it
//! exactly as vLLM 0.33's msgspec classes do ([`wire`]) and publishes it over
//! ZMQ PUB with a ROUTER replay endpoint, as vLLM's `ZmqEventPublisher` does.
//!
//! Block hashes are [`crate::index::block_hash`]'s content chain under the
//! fleet key, which a frontend computes for a request without any model.
//!
//! The publisher (ZMQ over `zeromq` on a tokio thread) is the default-on
//! `kv-events` feature; without it an engine asked for events refuses to start.

mod config;
#[cfg(feature = "kv-events")]
mod publisher;
pub mod wire;

pub use config::{KvEventsConfig, KvEventsOptions, PublisherStats};
#[cfg(feature = "kv-events")]
pub use publisher::KvEventPublisher;

/// Where a block's KV lives: what vLLM's `medium` field says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// Host memory (the CPU backend).
    Cpu,
    /// Device memory (the wgpu backend).
    Gpu,
    /// The disk tier under the pool ([`crate::tier`]): blocks the pool evicted,
    /// loadable back (vLLM's offloading connector writes `"DISK"` for its file tier).
    Disk,
}

impl Medium {
    /// The medium of a backend by its name (`"cpu"` → CPU, any other → GPU).
    pub fn of_backend(name: &str) -> Self {
        if name == "cpu" { Medium::Cpu } else { Medium::Gpu }
    }

    /// The string vLLM writes: `"CPU"`, `"GPU"` or `"DISK"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Cpu => "CPU",
            Medium::Gpu => "GPU",
            Medium::Disk => "DISK",
        }
    }
}

/// The item rows in one block: the item's identity and the first of its
/// rows that the block holds (one per maximal run of item rows).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ItemRows {
    /// The extra key naming the item, written as it is: the engine puts
    /// [`crate::canon::Fingerprint::mm_hash_hex`] here (64 hex digits, vLLM's `mm_hash` width).
    pub mm_hash: String,
    pub first_row: u32,
    /// The frontend's hash of the item, when the request brought one
    /// ([`ItemInput::routing_hash`](crate::engine::ItemInput::routing_hash)): the
    /// block's extra keys then start with its [`RoutingHash::marker`], before
    /// every `(mm_hash, first_row)` pair.
    pub routing_hash: Option<RoutingHash>,
}

/// A frontend's name of an item for KV-aware routing: Dynamo's frontend
/// hashes each image URL with `xxh3_64` and forwards the hashes as
/// `extra_args["mm_hashes"]`, 16 lowercase hex digits each, in prompt order.
///
/// Dynamo 1.6.1's relay (`lib/kv-router/src/zmq_wire/extra_keys.rs`,
/// `parse_mm_hash_from_extra_key`) reads a block's image hash only from an
/// extra key in the frontend's *marker* form, 16 hex digits then 48 `"0"`,
/// and takes the first one it can parse: so the engine writes that form first.
///
/// ```
/// use omniprefix::events::RoutingHash;
/// let h = RoutingHash::parse("00112233445566FF").unwrap();
/// assert_eq!(h, RoutingHash(0x0011_2233_4455_66ff));
/// assert_eq!(h.marker(), format!("00112233445566ff{}", "0".repeat(48)));
/// assert_eq!(RoutingHash::parse("00112233445566f"), None); // 15 digits
/// assert_eq!(RoutingHash::parse("+0112233445566ff"), None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RoutingHash(pub u64);

impl RoutingHash {
    /// Hex digits of the hash in its text form.
    pub const DIGITS: usize = 16;
    /// The `"0"`s Dynamo 1.6.1 needs after the digits in an extra key.
    pub const MARKER_ZEROS: usize = 48;

    /// The hash of exactly 16 hex digits (either case); `None` for anything else.
    pub fn parse(text: &str) -> Option<Self> {
        // from_str_radix alone would take a sign and fewer digits.
        if text.len() != Self::DIGITS || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u64::from_str_radix(text, 16).ok().map(RoutingHash)
    }

    /// The extra key Dynamo 1.6.1 reads as this hash: 16 lowercase hex digits, then 48 `"0"`.
    pub fn marker(self) -> String {
        format!("{:016x}{}", self.0, "0".repeat(Self::MARKER_ZEROS))
    }
}

impl std::fmt::Display for RoutingHash {
    /// The 16 lowercase hex digits the frontend sends.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// One KV cache event (vLLM's `BlockStored`, `BlockRemoved`, `AllBlocksCleared`).
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Consecutive full blocks of one sequence entered the cache.
    BlockStored {
        /// One hash per block, in order.
        block_hashes: Vec<u64>,
        /// The hash of the block before the first one; `None` at a sequence's start.
        parent_block_hash: Option<u64>,
        /// The blocks' token ids (placeholder ids at item rows), `block_size` per block.
        token_ids: Vec<u32>,
        block_size: usize,
        medium: Medium,
        /// Per block, the item rows it holds (`None` for a text-only block);
        /// `None` when no block holds item rows (vLLM then leaves the field out).
        /// On the wire a block's keys are the markers of its items' routing
        /// hashes (once each, in row order), then `(mm_hash, first_row)` per run.
        extra_keys: Option<Vec<Option<Vec<ItemRows>>>>,
    },
    /// Blocks left the cache (evicted).
    BlockRemoved { block_hashes: Vec<u64>, medium: Medium },
    /// Every block left the cache.
    AllBlocksCleared,
}

/// One step's events: vLLM's `KVEventBatch [ts, events, data_parallel_rank]`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// Seconds since the Unix epoch when the batch was made.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<u32>,
}

impl KvEventBatch {
    /// A batch of `events` stamped now.
    pub fn now(events: Vec<KvEvent>, data_parallel_rank: Option<u32>) -> Self {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        KvEventBatch { ts, events, data_parallel_rank }
    }
}
