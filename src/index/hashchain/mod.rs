//! The baseline: a byte-exact port of vLLM V1 prefix-cache hashing.
//!
//! Every full block of a prompt gets `hash(parent, tokens, extra_keys)`
//! (canonical CBOR, SHA-256 by default); multimodal items enter as
//! `("mm", mm_hash, block_start - offset)` extra keys on every block they
//! overlap, the tenant as `("cache_salt", salt)` on block 0. Lookup is one
//! hash-map probe per block that stops at the first miss, as vLLM's
//! `find_longest_cache_hit`. Results are block granular only.
//!
//! Mapping from a [`CanonicalPrompt`](crate::prompt::CanonicalPrompt): item
//! `i`'s placeholder range runs from its first span's start to its last
//! span's end, and its mm identifier is the hex of its fingerprint (vLLM's
//! caller-supplied multimodal uuid) unless explicit mm hashes are given
//! ([`match_with_mm_hashes`](crate::index::hashchain::HashChainIndex::match_with_mm_hashes),
//! the baseline path over raw media hashed with
//! [`hash_mm_item`](crate::index::hashchain::hash_mm_item)). Tenant 0 is the
//! unsalted default; any other tenant `t` salts block 0 with `tenant-{t:016x}`.
//! Like the trait, the index reports what is cached: vLLM's "recompute the
//! last prompt token" cap belongs to the scheduler.
//!
//! ```
//! use omniprefix::index::hashchain::HashChainIndex;
//! use omniprefix::index::PrefixIndex;
//! # use omniprefix::prompt::{CanonicalPrompt, IndexMap, Positions};
//! # let tokens: Vec<u32> = (0..40).collect();
//! # let prompt = CanonicalPrompt { tenant: 0, atoms: vec![], token_ids: tokens,
//! #     items: vec![], index_map: IndexMap::default(), positions: Positions::linear(0) };
//! let mut index = HashChainIndex::new(16).unwrap();
//! assert_eq!(index.match_prefix(&prompt).tokens, 0);
//! index.insert(&prompt, &[7, 8]).unwrap();
//! let m = index.match_prefix(&prompt);
//! assert_eq!((m.tokens, m.blocks), (32, vec![7, 8]));
//! ```

mod block_hash;
mod cbor;
mod mm_hasher;

use std::collections::BTreeSet;

use fxhash::FxHashMap;

pub use block_hash::{
    BlockHash, BlockHasher, BlockKeyRequest, DEFAULT_NONE_HASH_SEED, ExtraKey, HashFn, MmPlaceholder,
    hash_block_tokens, none_hash,
};
pub use mm_hasher::{Kwarg, MmHashAlgorithm, MmMedia, hash_kwargs, hash_mm_item};

use super::{BlockId, IndexStats, InsertOutcome, MatchHandle, PrefixIndex, PrefixMatch};
use crate::Result;
use crate::error::{CacheError, Component, InvariantViolation};
use crate::prompt::{CanonicalPrompt, TenantSalt};

/// One cached block.
#[derive(Debug, Clone)]
struct Entry {
    block: BlockId,
    /// The previous block of the chain (`None` for block 0).
    parent: Option<BlockHash>,
    /// Cached blocks whose parent is this one.
    children: u32,
    /// Outstanding `lock`s.
    refs: u32,
    /// Logical clock of the last match / insert that touched it.
    last_used: u64,
}

impl Entry {
    /// Only unlocked chain tails may go: evicting an inner block would leave
    /// its descendants unreachable but still holding KV.
    fn evictable(&self) -> bool {
        self.refs == 0 && self.children == 0
    }
}

/// vLLM's hash-chain prefix cache: block hash → block, LRU eviction of tails.
#[derive(Debug, Clone)]
pub struct HashChainIndex {
    hasher: BlockHasher,
    entries: FxHashMap<BlockHash, Entry>,
    by_block: FxHashMap<BlockId, BlockHash>,
    /// `(last_used, block)` of every evictable entry, oldest first.
    evictable: BTreeSet<(u64, BlockId)>,
    clock: u64,
    stats: IndexStats,
}

/// The cache salt vLLM would receive for a tenant; tenant 0 is the unsalted default.
fn tenant_salt(tenant: TenantSalt) -> Option<String> {
    (tenant != 0).then(|| format!("tenant-{tenant:016x}"))
}

/// The mm identifier of an item from its fingerprint (a caller-supplied uuid in vLLM terms).
fn fingerprint_hashes(prompt: &CanonicalPrompt) -> Vec<String> {
    prompt.items.iter().map(|it| format!("{:032x}", it.fingerprint.0)).collect()
}

/// Placeholder range of each item (first span start to last span end), sorted by offset.
fn placeholders<'a>(prompt: &CanonicalPrompt, mm_hashes: &'a [String]) -> Result<Vec<MmPlaceholder<'a>>> {
    if mm_hashes.len() != prompt.items.len() {
        return Err(CacheError::MmHashCount { expected: prompt.items.len(), found: mm_hashes.len() }.into());
    }
    let mut ranges: Vec<Option<(usize, usize)>> = vec![None; prompt.items.len()];
    for (i, span) in prompt.index_map.spans.iter().enumerate() {
        let slot = ranges.get_mut(span.item as usize).ok_or(CacheError::SpanItemOutOfRange {
            span: i,
            item: span.item,
            items: prompt.items.len(),
        })?;
        let start = span.start as usize;
        let end = start + span.rows.len();
        *slot = Some(match *slot {
            Some((s, e)) => (s.min(start), e.max(end)),
            None => (start, end),
        });
    }
    let mut out: Vec<MmPlaceholder<'a>> = ranges
        .iter()
        .zip(mm_hashes)
        .filter_map(|(r, h)| r.map(|(s, e)| MmPlaceholder { hash: h, offset: s, length: e - s }))
        .collect();
    out.sort_by_key(|p| p.offset);
    Ok(out)
}

impl HashChainIndex {
    /// An empty index with vLLM's defaults: `sha256_cbor` and the vectors' `NONE_HASH` seed.
    pub fn new(block_size: usize) -> Result<Self> {
        Ok(Self::with_hasher(BlockHasher::new(HashFn::Sha256Cbor, block_size, DEFAULT_NONE_HASH_SEED)?))
    }

    /// An empty index over a configured hasher.
    pub fn with_hasher(hasher: BlockHasher) -> Self {
        HashChainIndex {
            hasher,
            entries: FxHashMap::default(),
            by_block: FxHashMap::default(),
            evictable: BTreeSet::new(),
            clock: 0,
            stats: IndexStats::default(),
        }
    }

    /// Hashes of the first `max_blocks` full blocks of `prompt`, with item `i`
    /// identified by `mm_hashes[i]` (the whole vLLM request hashing path).
    pub fn block_hashes_upto(
        &self, prompt: &CanonicalPrompt, mm_hashes: &[String], max_blocks: usize,
    ) -> Result<Vec<BlockHash>> {
        let mm_items = placeholders(prompt, mm_hashes)?;
        let salt = tenant_salt(prompt.tenant);
        let req = BlockKeyRequest {
            tokens: &prompt.token_ids,
            mm_items: &mm_items,
            cache_salt: salt.as_deref(),
            lora_name: None,
        };
        Ok(self.hasher.request_block_hashes(&req, max_blocks))
    }

    /// Hashes of every full block of `prompt` (see [`Self::block_hashes_upto`]).
    pub fn block_hashes(&self, prompt: &CanonicalPrompt, mm_hashes: &[String]) -> Result<Vec<BlockHash>> {
        self.block_hashes_upto(prompt, mm_hashes, usize::MAX)
    }

    /// `match_prefix` with items identified by `mm_hashes` (e.g. from
    /// [`hash_mm_item`] over raw media) instead of their fingerprints.
    pub fn match_with_mm_hashes(
        &mut self, prompt: &CanonicalPrompt, mm_hashes: &[String],
    ) -> Result<PrefixMatch> {
        let hashes = self.block_hashes(prompt, mm_hashes)?;
        Ok(self.lookup(prompt.len(), &hashes))
    }

    /// `insert` with items identified by `mm_hashes`.
    pub fn insert_with_mm_hashes(
        &mut self, prompt: &CanonicalPrompt, mm_hashes: &[String], blocks: &[BlockId],
    ) -> Result<InsertOutcome> {
        let full = prompt.len() / self.hasher.block_size();
        if blocks.len() > full {
            return Err(CacheError::BlocksExceedPrompt { blocks: blocks.len(), full_blocks: full }.into());
        }
        let hashes = self.block_hashes_upto(prompt, mm_hashes, blocks.len())?;
        self.adopt(&hashes, blocks)
    }

    /// `find_longest_cache_hit`: probe block by block, stop at the first miss.
    fn lookup(&mut self, query_tokens: usize, hashes: &[BlockHash]) -> PrefixMatch {
        self.clock += 1;
        let tick = self.clock;
        let mut blocks = Vec::new();
        for h in hashes {
            let Some(e) = self.entries.get_mut(h) else {
                break;
            };
            if e.evictable() {
                self.evictable.remove(&(e.last_used, e.block));
                self.evictable.insert((tick, e.block));
            }
            e.last_used = tick;
            blocks.push(e.block);
        }
        let tokens = blocks.len() * self.hasher.block_size();
        self.stats.queries += 1;
        self.stats.query_tokens += query_tokens as u64;
        if !blocks.is_empty() {
            self.stats.hits += 1;
            self.stats.hit_tokens += tokens as u64;
        }
        PrefixMatch { tokens, aligned_tokens: tokens, blocks, handle: MatchHandle(tick) }
    }

    /// Adopts `blocks[i]` for `hashes[i]` where that hash is new. Checks
    /// everything before changing anything.
    fn adopt(&mut self, hashes: &[BlockHash], blocks: &[BlockId]) -> Result<InsertOutcome> {
        debug_assert_eq!(hashes.len(), blocks.len());
        let mut seen = BTreeSet::new();
        for (h, &b) in hashes.iter().zip(blocks) {
            if !seen.insert(b) {
                return Err(CacheError::BlockAlreadyCached { block: b }.into());
            }
            if self.by_block.get(&b).is_some_and(|owner| owner != h) {
                return Err(CacheError::BlockAlreadyCached { block: b }.into());
            }
        }
        self.clock += 1;
        let tick = self.clock;
        let mut out = InsertOutcome::default();
        let mut cached = Vec::with_capacity(blocks.len());
        let mut parent: Option<BlockHash> = None;
        for (h, &b) in hashes.iter().zip(blocks) {
            if let Some(e) = self.entries.get_mut(h) {
                cached.push(e.block);
                if e.evictable() {
                    self.evictable.remove(&(e.last_used, e.block));
                    self.evictable.insert((tick, e.block));
                }
                e.last_used = tick;
                // A block the index already owns under this hash (re-commit
                // after a hit) is neither adopted nor a duplicate.
                if e.block != b {
                    out.duplicates.push(b);
                }
            } else {
                if let Some(p) = parent.and_then(|p| self.entries.get_mut(&p)) {
                    if p.evictable() {
                        self.evictable.remove(&(p.last_used, p.block));
                    }
                    p.children += 1;
                }
                self.entries.insert(*h, Entry { block: b, parent, children: 0, refs: 0, last_used: tick });
                self.by_block.insert(b, *h);
                self.evictable.insert((tick, b));
                out.adopted.push(b);
                cached.push(b);
            }
            parent = Some(*h);
        }
        self.stats.cached_blocks = self.entries.len() as u64;
        if !cached.is_empty() {
            let tokens = cached.len() * self.hasher.block_size();
            out.cached =
                PrefixMatch { tokens, aligned_tokens: tokens, blocks: cached, handle: MatchHandle(tick) };
        }
        Ok(out)
    }

    /// Applies `f` to the refcount of every still-cached block of `m`, keeping
    /// the evictable set in step.
    fn update_refs(&mut self, m: &PrefixMatch, f: impl Fn(u32) -> u32) {
        for b in &m.blocks {
            let Some(e) = self.by_block.get(b).and_then(|h| self.entries.get_mut(h)) else {
                continue; // evicted since the match: nothing to pin or release
            };
            let was = e.evictable();
            e.refs = f(e.refs);
            match (was, e.evictable()) {
                (true, false) => {
                    self.evictable.remove(&(e.last_used, e.block));
                }
                (false, true) => {
                    self.evictable.insert((e.last_used, e.block));
                }
                _ => {}
            }
        }
    }
}

impl PrefixIndex for HashChainIndex {
    fn block_size(&self) -> usize {
        self.hasher.block_size()
    }

    /// Items are identified by their fingerprints. A prompt whose index map
    /// names an item it does not have cannot be hashed and matches nothing.
    fn match_prefix(&mut self, prompt: &CanonicalPrompt) -> PrefixMatch {
        let mm = fingerprint_hashes(prompt);
        let hashes = self.block_hashes(prompt, &mm).unwrap_or_default();
        self.lookup(prompt.len(), &hashes)
    }

    fn insert(&mut self, prompt: &CanonicalPrompt, blocks: &[BlockId]) -> Result<InsertOutcome> {
        let mm = fingerprint_hashes(prompt);
        self.insert_with_mm_hashes(prompt, &mm, blocks)
    }

    /// vLLM caches full blocks only: the full blocks are inserted and the
    /// partly filled last block comes back in `duplicates` (the caller still
    /// owns it and frees it), so each round loses up to a block of reuse;
    /// `cached` reports the full blocks. An id the index already holds
    /// there (a full block over these positions) is in neither list.
    fn insert_partial(
        &mut self, prompt: &CanonicalPrompt, blocks: &[BlockId], tokens: usize,
    ) -> Result<InsertOutcome> {
        let bs = self.hasher.block_size();
        super::check_partial_args(bs, prompt.len(), blocks.len(), tokens)?;
        let full = tokens / bs;
        let mm = fingerprint_hashes(prompt);
        let hashes = self.block_hashes_upto(prompt, &mm, blocks.len())?;
        let partial = blocks.get(full).copied();
        // Checked before anything changes: repeated, or owned under other content.
        if let Some(p) = partial {
            let own = self.by_block.get(&p).is_some_and(|h| hashes.get(full) == Some(h));
            if blocks[..full].contains(&p) || self.by_block.contains_key(&p) && !own {
                return Err(CacheError::BlockAlreadyCached { block: p }.into());
            }
        }
        let mut out = self.adopt(&hashes[..full], &blocks[..full])?;
        if let Some(p) = partial.filter(|p| !self.by_block.contains_key(p)) {
            out.duplicates.push(p);
        }
        Ok(out)
    }

    fn lock(&mut self, m: &PrefixMatch) {
        self.update_refs(m, |r| r.saturating_add(1));
    }

    fn unlock(&mut self, m: &PrefixMatch) {
        self.update_refs(m, |r| r.saturating_sub(1));
    }

    fn evict(&mut self, max_blocks: usize) -> Vec<BlockId> {
        let mut out = Vec::new();
        while out.len() < max_blocks {
            let Some((_, block)) = self.evictable.pop_first() else {
                break;
            };
            let Some(hash) = self.by_block.remove(&block) else {
                break;
            };
            let Some(entry) = self.entries.remove(&hash) else {
                break;
            };
            if let Some(p) = entry.parent.and_then(|p| self.entries.get_mut(&p)) {
                p.children -= 1;
                if p.evictable() {
                    self.evictable.insert((p.last_used, p.block));
                }
            }
            out.push(block);
        }
        self.stats.evicted_blocks += out.len() as u64;
        self.stats.cached_blocks = self.entries.len() as u64;
        out
    }

    fn stats(&self) -> IndexStats {
        let entry = size_of::<BlockHash>() + size_of::<Entry>();
        let reverse = size_of::<BlockId>() + size_of::<BlockHash>();
        let lru = size_of::<(u64, BlockId)>();
        IndexStats {
            nodes: self.entries.len() as u64,
            index_bytes: (self.entries.capacity() * entry
                + self.by_block.capacity() * reverse
                + self.evictable.len() * lru) as u64,
            ..self.stats.clone()
        }
    }

    fn validate(&self) -> std::result::Result<(), InvariantViolation> {
        self.broken_invariant().map_err(|what| Component::HashChainIndex.violation(what))
    }
}

impl HashChainIndex {
    /// The first broken invariant of [`PrefixIndex::validate`], in words.
    fn broken_invariant(&self) -> std::result::Result<(), String> {
        if self.entries.len() != self.by_block.len() {
            return Err(format!("{} entries but {} block ids", self.entries.len(), self.by_block.len()));
        }
        if self.stats.cached_blocks != self.entries.len() as u64 {
            return Err(format!(
                "stats say {} cached, map holds {}",
                self.stats.cached_blocks,
                self.entries.len()
            ));
        }
        let mut children: FxHashMap<BlockHash, u32> = FxHashMap::default();
        for (h, e) in &self.entries {
            if self.by_block.get(&e.block) != Some(h) {
                return Err(format!("block {} does not map back to its hash", e.block));
            }
            if e.last_used > self.clock {
                return Err(format!("block {} used at {} after clock {}", e.block, e.last_used, self.clock));
            }
            if let Some(p) = e.parent {
                if !self.entries.contains_key(&p) {
                    return Err(format!("block {} has an evicted parent: its chain has a hole", e.block));
                }
                *children.entry(p).or_default() += 1;
            }
        }
        for (h, e) in &self.entries {
            let want = children.get(h).copied().unwrap_or(0);
            if e.children != want {
                return Err(format!("block {} counts {} children, has {want}", e.block, e.children));
            }
            if e.evictable() != self.evictable.contains(&(e.last_used, e.block)) {
                return Err(format!(
                    "block {} evictable={} disagrees with the LRU set",
                    e.block,
                    e.evictable()
                ));
            }
        }
        let evictable = self.entries.values().filter(|e| e.evictable()).count();
        if evictable != self.evictable.len() {
            return Err(format!("LRU set holds {} blocks, {evictable} are evictable", self.evictable.len()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
