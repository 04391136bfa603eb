//! Prefix indexes: which leading part of a prompt is cached, and in which KV blocks.
//!
//! Two implementations side by side: the validated radix tree over atoms (the
//! main matcher) and a byte-exact port of vLLM's hash chain (the baseline).

/// 64-bit content hashes of full KV blocks under the fleet key (what KV events carry).
pub mod block_hash;
/// Byte-exact port of vLLM V1 block hashing and its hash-map prefix cache (the baseline).
pub mod hashchain;
/// The validated radix tree over atoms: the main matcher.
pub mod radix;
/// Collision validation of fingerprint hits.
pub mod validate;

use crate::Result;
use crate::error::{CacheError, InvariantViolation};
use crate::prompt::CanonicalPrompt;

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
    /// block_size` tokens (block aligned; for
    /// [`insert_partial`](PrefixIndex::insert_partial) of its `tokens`, with
    /// `ceil(tokens / block_size)` blocks, as a match reports them) whose
    /// `blocks` are the index's ids at each position (the offered id, or the
    /// cached one it duplicated), ready to [`lock`](PrefixIndex::lock) without
    /// matching again. Empty when no block was given.
    pub cached: PrefixMatch,
    /// Blocks the index gave up: a cached partly filled last block that a
    /// longer or full block over the same positions superseded. The caller
    /// returns them to the free list.
    pub released: Vec<BlockId>,
}

/// Checks the arguments of [`PrefixIndex::insert_partial`]: `tokens` within a
/// prompt of `prompt_len` positions and exactly `ceil(tokens / block_size)` blocks.
pub fn check_partial_args(block_size: usize, prompt_len: usize, blocks: usize, tokens: usize) -> Result<()> {
    if tokens > prompt_len {
        return Err(CacheError::TokensExceedPrompt { tokens, prompt_len }.into());
    }
    if blocks != tokens.div_ceil(block_size) {
        return Err(CacheError::PartialBlockCount { blocks, tokens, block_size }.into());
    }
    Ok(())
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
///
/// `Send`, so that an engine (and its scheduler) can move to the thread that
/// serves it: a worker pool, or a Python call that releases the GIL.
pub trait PrefixIndex: Send {
    /// Tokens per KV block.
    fn block_size(&self) -> usize;
    /// Longest cached prefix of `prompt` (validated). Touches LRU clocks and stats only.
    fn match_prefix(&mut self, prompt: &CanonicalPrompt) -> PrefixMatch;
    /// Caches the first `blocks.len()` full blocks of `prompt` (KV already
    /// written) and returns them as now cached ([`InsertOutcome::cached`]).
    fn insert(&mut self, prompt: &CanonicalPrompt, blocks: &[BlockId]) -> Result<InsertOutcome>;
    /// Caches the first `tokens` positions of `prompt` held by `blocks`
    /// (`blocks.len() == tokens.div_ceil(block_size)`; the last block may be
    /// partly filled): a finished sequence's last block, so a follow-up that
    /// re-sends the history reuses every position that ran. Superseded
    /// partial blocks come back in [`InsertOutcome::released`]; on error
    /// nothing changes.
    ///
    /// The default caches the full blocks only, as vLLM does, and hands the
    /// partial block back in `duplicates` (it must be the caller's own: a
    /// matched block ending inside the match is copied before it is written).
    fn insert_partial(
        &mut self, prompt: &CanonicalPrompt, blocks: &[BlockId], tokens: usize,
    ) -> Result<InsertOutcome> {
        let bs = self.block_size();
        check_partial_args(bs, prompt.len(), blocks.len(), tokens)?;
        let full = tokens / bs;
        if let Some(&partial) = blocks.get(full)
            && blocks[..full].contains(&partial)
        {
            return Err(CacheError::BlockAlreadyCached { block: partial }.into());
        }
        let mut outcome = self.insert(prompt, &blocks[..full])?;
        outcome.duplicates.extend(blocks.get(full).copied());
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
