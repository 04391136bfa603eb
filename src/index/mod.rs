//! Prefix indexes: which leading part of a prompt is cached, and in which KV blocks.
//!
//! Two implementations side by side: the validated radix tree over atoms (the
//! main matcher) and a byte-exact port of vLLM's hash chain (the baseline).

/// Byte-exact port of vLLM V1 block hashing and its hash-map prefix cache (the baseline).
pub mod hashchain;
/// The validated radix tree over atoms: the main matcher.
pub mod radix;
/// Collision validation of fingerprint hits.
pub mod validate;

use crate::prompt::CanonicalPrompt;
use crate::Result;
use crate::error::InvariantViolation;

/// Block ids are defined next to the block tables in [`crate::kv`]; the index stores them.
pub use crate::kv::BlockId;

/// The fingerprinter's policy; re-exported here, where hits are confirmed.
pub use crate::canon::ValidationPolicy;

/// Opaque handle of a match, used to lock / unlock what it reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct MatchHandle(pub u64);

/// The result of a lookup.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Exact number of leading tokens whose KV is cached (may end inside a block).
    pub tokens: usize,
    /// `tokens` rounded down to a whole number of blocks.
    pub aligned_tokens: usize,
    /// Blocks covering `tokens`: `ceil(tokens / block_size)` ids; the last one is
    /// only partly valid when `tokens` is not block aligned.
    pub blocks: Vec<BlockId>,
    /// Handle for `lock` / `unlock`.
    pub handle: MatchHandle,
}

/// What `insert` did with the blocks it was given.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InsertOutcome {
    /// Blocks the index now owns (newly cached).
    pub adopted: Vec<BlockId>,
    /// Blocks the index did not take because equal content was already cached;
    /// the caller still owns them.
    pub duplicates: Vec<BlockId>,
    /// The inserted prefix as it is cached now: a match of `blocks.len() *
    /// block_size` tokens (block aligned) whose `blocks` are the index's ids
    /// at each position (the offered id, or the cached one it duplicated),
    /// ready to [`lock`](PrefixIndex::lock) without matching again. Empty when
    /// no block was given.
    pub cached: PrefixMatch,
    /// Blocks the index gave up (a cached partial block superseded); the caller frees them.
    pub released: Vec<BlockId>,
}

/// Counters every index keeps.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct IndexStats {
    pub queries: u64,
    pub hits: u64,
    pub hit_tokens: u64,
    pub query_tokens: u64,
    /// Fingerprint hits that failed validation (counted as misses).
    pub validation_failures: u64,
    pub evicted_blocks: u64,
    pub cached_blocks: u64,
    pub nodes: u64,
    /// Bytes of index structure (excluding KV and retained item bytes).
    pub index_bytes: u64,
}

/// A prefix cache index. The scheduler is its only owner.
pub trait PrefixIndex {
    /// Tokens per KV block.
    fn block_size(&self) -> usize;
    /// Longest cached prefix of `prompt` (validated). Touches LRU clocks and stats only.
    fn match_prefix(&mut self, prompt: &CanonicalPrompt) -> PrefixMatch;
    /// Caches the first `blocks.len()` full blocks of `prompt` (KV already
    /// written) and returns them as now cached ([`InsertOutcome::cached`]).
    fn insert(&mut self, prompt: &CanonicalPrompt, blocks: &[BlockId]) -> Result<InsertOutcome>;
    /// Caches the first `tokens` positions of `prompt`, held by `blocks`
    /// (the last one may be partly filled). TEMPORARY default until the
    /// index branch lands: full blocks only, the tail comes back as a duplicate.
    fn insert_partial(&mut self, prompt: &CanonicalPrompt, blocks: &[BlockId], tokens: usize) -> Result<InsertOutcome> {
        let full = tokens / self.block_size();
        let mut outcome = self.insert(prompt, &blocks[..full.min(blocks.len())])?;
        outcome.duplicates.extend(blocks.get(full..).into_iter().flatten().copied());
        Ok(outcome)
    }
    /// Pins what `m` reported so eviction cannot take it; reference counted.
    fn lock(&mut self, m: &PrefixMatch);
    /// Releases one `lock` of `m`.
    fn unlock(&mut self, m: &PrefixMatch);
    /// Gives up to `max_blocks` blocks of unlocked least-recently-used entries back.
    fn evict(&mut self, max_blocks: usize) -> Vec<BlockId>;
    /// Counters.
    fn stats(&self) -> IndexStats;
    /// Checks every internal invariant; `Err` names the first one broken.
    fn validate(&self) -> std::result::Result<(), InvariantViolation>;
}
