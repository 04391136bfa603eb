//! What an [`Engine`](super::Engine) is sized by, and what it counts.

use std::path::PathBuf;
use std::time::Duration;

use crate::backend::Dtype;
use crate::canon::FingerprintKey;
use crate::error::{ConfigError, Result};
use crate::events::KvEventsConfig;
use crate::index::ValidationPolicy;
use crate::model::CaptureName;
use crate::prompt::{OmniTokens, TenantSalt};
use crate::sched::{SchedulerConfig, SchedulerStats, TalkerCacheConfig, TalkerCacheStats};

/// The default bound of a disk tier (`EngineConfig::tier_bytes`): 8 GiB.
pub const DEFAULT_TIER_BYTES: u64 = 8 << 30;

/// The default [`EngineConfig::audio_yield`]: 1 s.
pub const DEFAULT_AUDIO_YIELD: Duration = Duration::from_millis(1000);

/// Which prefix index the engine's scheduler matches with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IndexKind {
    /// The validated radix tree over atoms (the main matcher).
    #[default]
    Radix,
    /// vLLM V1's SHA-256 block hash chain (the baseline).
    HashChain,
}

/// Sizes and switches of an [`Engine`](super::Engine).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The scheduler's sizes: KV blocks and their size, the step budget, the
    /// prefill cap, token-granular reuse (see [`SchedulerConfig`]; its own
    /// defaults). A request needing more blocks than the pool holds is rejected.
    pub scheduler: SchedulerConfig,
    /// Captured hidden states; `None` = `hidden.0`, `hidden.<L/2>`, `final`.
    pub capture: Option<Vec<CaptureName>>,
    /// Prefix caching on (default). Off: every request runs under its own
    /// private tenant, so nothing is ever shared, and the path is otherwise identical.
    pub cache: bool,
    pub index: IndexKind,
    /// How fingerprint hits are confirmed (radix index only).
    pub validation: ValidationPolicy,
    /// Key of the item fingerprints (default: a fresh random key per engine).
    pub fingerprint_key: FingerprintKey,
    /// Threads that fingerprint one item's bytes.
    pub fingerprint_threads: usize,
    /// Bytes of encoder outputs kept by fingerprint (default 256 MiB).
    pub encoder_cache_bytes: usize,
    /// Special ids of the model; `None` = from the checkpoint's config, else Qwen3-Omni's.
    pub tokens: Option<OmniTokens>,
    /// Tenants a request may name; `None` = any. Another salt is rejected with
    /// `RequestError::UnknownTenant` before anything runs, so a typo'd or forged salt
    /// cannot silently open a cache of its own (checked with caching off too).
    pub known_tenants: Option<Vec<TenantSalt>>,
    /// The dtype weight matrices are stored in; `None` = the checkpoint's own
    /// (f32 for random models, and where the backend cannot store it). A float
    /// type: an integer one is a `ConfigError::Invalid` on field `dtype`.
    pub dtype: Option<Dtype>,
    /// The element type of the K/V pages (default f32; f16 or bf16 halve the KV
    /// memory, attention widens each tile back to f32). Hidden pages stay f32.
    /// A float type: an integer one is a `ConfigError::Invalid` on field `kv_dtype`.
    pub kv_dtype: Dtype,
    /// Publish KV events (vLLM's wire format over ZMQ) for cache-aware routers;
    /// `None` (default) = none. Block hashes are keyed by `fingerprint_key`, which
    /// every replica and frontend of a fleet then shares.
    pub kv_events: Option<KvEventsConfig>,
    /// Load the checkpoint's talker and code2wav, when it has them, so requests
    /// may ask for audio (default on; off saves their memory).
    pub speech: bool,
    /// The talker's KV pool and prefix cache (1024 blocks of 16 rows): a
    /// speaking request needs its talker prompt plus `max_new_tokens - 1` rows.
    pub talker_cache: TalkerCacheConfig,
    /// First audio first: while a speaking request awaits its first audio, a
    /// reply its listener already hears holds its due code2wav decodes until
    /// the audio it sent has played out plus this long, then decodes all it
    /// held in one chunk (default 1 s; zero: only while its audio plays;
    /// `None`: every chunk is decoded as soon as it is due). Batching the held
    /// frames also makes the decodes cheaper: on 2 AVX2 cores `bench ttfa` at
    /// c=8 ends sooner with fewer stalls (docs/engine.md).
    pub audio_yield: Option<Duration>,
    /// The disk tier's directory: blocks the prefix index evicts are kept there
    /// (KV pages and captured rows, checked on every read), so a later request,
    /// another worker of this host, or this engine after a restart reuses them.
    /// `None` (default) = no tier. Created 0700 if absent; one that is a file,
    /// cannot be written or is group- or world-writable is a `ConfigError` on
    /// field `tier_dir`, as is a tier on a backend whose pages it cannot reach
    /// (only the CPU backend's for now) or with `cache` off.
    ///
    /// Files are found again only under the same `fingerprint_key`: an engine
    /// keeps the key it is given (a fresh random one by default, so its files
    /// outlive eviction but not a restart). A caller with no fleet key takes
    /// [`tier_key`](crate::tier::tier_key), the key kept in the directory (the
    /// CLI does so when `--tier-dir` comes without `--fingerprint-key`).
    pub tier_dir: Option<PathBuf>,
    /// The tier's bound in apparent bytes of its files (default 8 GiB); below one
    /// block's file (or 0) is a `ConfigError` on field `tier_bytes`.
    pub tier_bytes: u64,
}

impl EngineConfig {
    /// Refuses an integer `dtype` or `kv_dtype`: weights and pages are stored
    /// in a float type (which of them a backend stores, it checks itself).
    pub(crate) fn check_dtypes(&self) -> Result<()> {
        let fields = [("dtype", self.dtype), ("kv_dtype", Some(self.kv_dtype))];
        match fields.into_iter().find_map(|(field, d)| d.filter(|d| !d.is_float()).map(|d| (field, d))) {
            None => Ok(()),
            Some((field, found)) => Err(ConfigError::Invalid {
                component: "engine",
                field,
                expected: "a float dtype (f32, bf16 or f16)".into(),
                found: found.to_string(),
            }
            .into()),
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            scheduler: SchedulerConfig::default(),
            capture: None,
            cache: true,
            index: IndexKind::Radix,
            validation: ValidationPolicy::default(),
            fingerprint_key: FingerprintKey::random(),
            fingerprint_threads: 1,
            encoder_cache_bytes: 256 << 20,
            tokens: None,
            known_tenants: None,
            dtype: None,
            kv_dtype: Dtype::F32,
            kv_events: None,
            speech: true,
            talker_cache: TalkerCacheConfig { num_blocks: 1024, block_size: crate::kv::DEFAULT_BLOCK_SIZE },
            audio_yield: Some(DEFAULT_AUDIO_YIELD),
            tier_dir: None,
            tier_bytes: DEFAULT_TIER_BYTES,
        }
    }
}

/// Counters of an engine, each read from its owner.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct EngineStats {
    /// The scheduler's counters and pool occupancy (queries, hits, hit
    /// tokens, evictions, preemptions, ...).
    #[serde(flatten)]
    pub sched: SchedulerStats,
    /// Items of admitted requests whose embeddings came from the encoder cache.
    pub encoder_cache_hits: u64,
    /// Items of admitted requests the encoder ran for: encoder-cache misses
    /// without given embeddings.
    pub encoder_calls: u64,
    /// Requests that returned their outputs.
    pub finished: u64,
    /// The talker's prefix cache, when the engine speaks (absent from the
    /// serialized stats otherwise, so a thinker-only engine's keys stay as they were).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub talker: Option<TalkerCacheStats>,
    /// The disk tier's counters, when the engine has one (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<super::TierEngineStats>,
    /// The talker's accept layer kept at item positions, when the engine
    /// speaks and does not page that layer (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub item_capture: Option<ItemCaptureStats>,
}

/// What the rows kept only at item positions hold ([`ItemCapture`](crate::kv::ItemCapture)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ItemCaptureStats {
    /// Rows held: one per pool slot whose last write was an item position.
    pub rows: usize,
    /// Bytes of their values (`rows × hidden × 4`).
    pub bytes: usize,
}
