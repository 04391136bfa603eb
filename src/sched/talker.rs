//! The talker's prefix cache: its own KV block pool and prefix index, keyed
//! so that a later round reuses every earlier user turn's talker KV and never
//! a wrong one.
//!
//! **Why not a second [`Scheduler`].** The scheduler owns the *thinker's*
//! sequences: it admits requests, chunks their prefills within a token
//! budget, emits the runner's batches, grows sequences by sampled tokens,
//! caches their replies and partly filled last blocks, parks and preempts.
//! None of that fits the talker, whose prefill and decode run as one call
//! ([`Talker::generate_in`](crate::model::talker::Talker::generate_in)) over a
//! block table and a count of cached rows, whose decode rows are codec sums
//! (no ids to key), and of whose prompt only the user rows may be cached. What
//! the two share is below the lifecycle: the [`BlockPool`], a [`PrefixIndex`]
//! (radix or hash chain: matching, validation of item identities, locks, LRU
//! eviction all live there), and the scheduler's contract checks on a match
//! and its commit path (`checked_match`, `insert_full_blocks`), which this
//! owner calls rather than copies.
//!
//! **The key.** Talker KV of prompt row `k` is a function of the talker's
//! input rows `0..=k`, their positions and the talker's weights. Text rows are
//! `text_projection(embed(id))`: a function of the thinker id alone. Item rows
//! are `hidden_projection(accept-layer rows)`, and those depend on the *whole*
//! thinker prefix before them (the system turn included, though the talker
//! drops it). [`talker_key`] therefore keys the user rows as a
//! [`CanonicalPrompt`] whose atoms are the thinker's user text ids
//! ([`Atom::Text`]) and, for each item's run of user rows, an [`Atom::Item`]
//! whose identity fingerprints *that item's accept-layer rows* (their `f32`
//! bytes) with the item's modality and layout, under the engine's
//! [`Fingerprinter`] and so its validation policy: equal identities (as the
//! index confirms a fingerprint hit) mean bit-equal rows, so bit-equal talker
//! input rows; positions are [`positions_from_atoms`] of these atoms, which
//! equal the [`TalkerLayout`]'s (checked). This is exact where keying by the
//! thinker prefix is not: a thinker prefix recomputed in another chunking (its
//! own cache evicted) may give accept rows that differ in the last bit; here
//! that is a miss, so the talker's codes equal a cache-off run over the same
//! rows, bit for bit. Two thinker prefixes that differ only where the talker
//! cannot see it (another system turn over text-only user turns) give equal
//! talker rows and share KV, rightly.
//!
//! **What is cached.** Only full blocks of the user rows: the assistant rows
//! (speaker, first reply token) and the decode rows are never indexed. A
//! match reuses whole blocks only (the talker runs no copy-on-write copies).
//!
//! **Protocol** (per spoken reply): [`talker_key`] → [`TalkerCache::begin`]
//! (match, pin, allocate prompt + decode rows) → `generate_in` with
//! [`TalkerSlot::block_table`] and [`TalkerSlot::num_cached`] →
//! [`TalkerCache::commit`] (after the prefill ran) → [`TalkerCache::release`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use fxhash::{FxHashMap, FxHashSet};
use ndarray::{Array2, ArrayView2};

use super::commit::insert_full_blocks;
use super::step::{checked_match, pinned_part};
use super::talker_tier::TalkerTier;
use crate::Result;
use crate::canon::{Fingerprinter, ItemContent, ItemIdentity, ItemSpec, ProcessorParams, TensorView};
use crate::error::{BackendError, Component, ConfigError, InvariantViolation, RequestError, SchedError};
use crate::index::{IndexStats, PrefixIndex, PrefixMatch};
use crate::kv::{BlockId, BlockPool, BlockTable};
use crate::prompt::{Atom, CanonicalPrompt, IndexMap, ItemSpan, OmniTokens, positions_from_atoms};
use crate::speech::TalkerLayout;

#[cfg(doc)]
use super::Scheduler;

/// The processor parameter that sets a talker item identity apart from the
/// thinker's identity of the same item (different bytes: accept-layer rows).
pub const TALKER_KEY_PARAM: &str = "omniprefix.talker_key";

/// Sizes of a [`TalkerCache`]: the talker's pages
/// ([`Talker::alloc_pages`](crate::model::talker::Talker::alloc_pages)) are
/// allocated with the same two numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TalkerCacheConfig {
    /// Blocks in the talker's pool (default 256).
    pub num_blocks: usize,
    /// Talker rows per block (default 16); must equal the index's.
    pub block_size: usize,
}

impl Default for TalkerCacheConfig {
    fn default() -> Self {
        TalkerCacheConfig { num_blocks: 256, block_size: crate::kv::DEFAULT_BLOCK_SIZE }
    }
}

/// Counters and occupancy of a [`TalkerCache`], named like the thinker's
/// ([`SchedulerStats`](super::SchedulerStats)): the engine's
/// `omniprefix_talker_prefix_cache_queries` counter reads `query_rows`,
/// `omniprefix_talker_prefix_cache_hits` reads `hit_rows`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct TalkerCacheStats {
    /// Slots begun (each matched its key once).
    pub queries: u64,
    /// User rows those slots looked up.
    pub query_rows: u64,
    /// Slots that reused at least one row.
    pub hits: u64,
    /// Rows reused (not recomputed), from the pool or the disk tier.
    pub hit_rows: u64,
    /// Of those, rows whose KV was read from the disk tier.
    pub tier_hit_rows: u64,
    /// `begin`s refused for want of blocks (nothing changed).
    pub refusals: u64,
    /// Blocks the index gave back (under pool pressure or by [`TalkerCache::evict`]).
    pub evicted_blocks: u64,
    pub blocks_free: usize,
    pub blocks_in_use: usize,
    pub blocks_cached: usize,
    /// Slots begun and not released.
    pub live_slots: usize,
}

/// One talker run's share of the cache, from [`TalkerCache::begin`] to
/// [`TalkerCache::release`]: the block table to run the talker over and how
/// many leading prompt rows already hold their KV.
#[derive(Debug)]
pub struct TalkerSlot {
    cache: u64,
    id: u64,
    key: Arc<CanonicalPrompt>,
    block_table: BlockTable,
    /// `[..num_shared]` index-owned (pinned by `lock`), the rest private pool blocks.
    num_shared: usize,
    num_cached: usize,
    total_rows: usize,
    lock: Option<PrefixMatch>,
    /// The key's full blocks' content hashes, with a tier (else empty).
    tier_hashes: Vec<u64>,
}

impl TalkerSlot {
    /// The blocks of the talker's prompt and decode rows, for
    /// [`TalkerKv::block_table`](crate::model::talker::TalkerKv). A
    /// [`commit`](TalkerCache::commit) may swap a block for the index's copy of
    /// the same content: a run that goes on after a commit takes this again.
    pub fn block_table(&self) -> &BlockTable {
        &self.block_table
    }

    /// Leading prompt rows whose KV is in the pages already
    /// ([`TalkerKv::num_cached`](crate::model::talker::TalkerKv)): whole blocks of user rows.
    pub fn num_cached(&self) -> usize {
        self.num_cached
    }

    /// Rows of the key: the user rows, the most that can be cached.
    pub fn user_rows(&self) -> usize {
        self.key.len()
    }

    /// Positions the block table covers (prompt and decode rows).
    pub fn total_rows(&self) -> usize {
        self.total_rows
    }

    /// The slot's id (named in errors).
    pub fn id(&self) -> u64 {
        self.id
    }
}

/// Tells caches apart, so a slot is only ever given back to its own.
static NEXT_CACHE: AtomicU64 = AtomicU64::new(1);

/// The talker's KV block pool and prefix index: the one owner of talker cache
/// state, beside (never sharing with) the thinker's [`Scheduler`].
///
/// ```
/// use omniprefix::index::radix::{RadixConfig, RadixIndex};
/// use omniprefix::prompt::CanonicalPrompt;
/// use omniprefix::sched::{TalkerCache, TalkerCacheConfig};
///
/// let key = |ids: Vec<u32>| CanonicalPrompt::text(0, ids);
/// let index = RadixIndex::new(RadixConfig { block_size: 4 })?;
/// let mut cache = TalkerCache::new(TalkerCacheConfig { num_blocks: 16, block_size: 4 }, Box::new(index))?;
/// // Round 1: 10 user rows, then 9 assistant rows and 5 decode rows.
/// let mut slot = cache.begin(key((0..10).collect()), 24)?.expect("the pool is empty");
/// assert_eq!((slot.num_cached(), slot.block_table().len()), (0, 6));
/// // ... Talker::generate_in over slot.block_table() from slot.num_cached() ...
/// assert_eq!(cache.commit(&mut slot)?, 2); // the two full blocks of user rows
/// cache.release(slot)?;
/// // Round 2 starts with round 1's user rows: it reuses their full blocks.
/// let slot = cache.begin(key((0..10).chain(50..60).collect()), 34)?.expect("blocks are free");
/// assert_eq!(slot.num_cached(), 8);
/// cache.release(slot)?;
/// assert_eq!((cache.stats().hit_rows, cache.stats().query_rows), (8, 30));
/// cache.validate().map_err(omniprefix::Error::from)?;
/// # Ok::<(), omniprefix::Error>(())
/// ```
pub struct TalkerCache {
    id: u64,
    block_size: usize,
    pool: BlockPool,
    index: Box<dyn PrefixIndex>,
    /// How many live locks pin each index-owned block (what eviction cannot take).
    pinned: FxHashMap<BlockId, u32>,
    live: FxHashSet<u64>,
    next_slot: u64,
    stats: TalkerCacheStats,
    /// The disk tier under the pool ([`TalkerCache::attach_tier`]).
    pub(super) tier: Option<TalkerTier>,
}

impl TalkerCache {
    /// A talker cache over `index` with an empty pool of `config.num_blocks` blocks.
    pub fn new(config: TalkerCacheConfig, index: Box<dyn PrefixIndex>) -> Result<Self> {
        ConfigError::require_positive("talker cache", "block_size", config.block_size)?;
        ConfigError::require_index_block_size("talker cache", config.block_size, index.block_size())?;
        Ok(TalkerCache {
            id: NEXT_CACHE.fetch_add(1, Ordering::Relaxed),
            block_size: config.block_size,
            pool: BlockPool::new(config.num_blocks)?,
            index,
            pinned: FxHashMap::default(),
            live: FxHashSet::default(),
            next_slot: 0,
            stats: TalkerCacheStats::default(),
            tier: None,
        })
    }

    /// Talker rows per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Starts a talker run over the talker prompt keyed by `key` (its user
    /// rows, see [`talker_key`]) whose prompt and decode rows span
    /// `total_rows` positions (`prompt rows + max_new_tokens - 1`, what
    /// [`TalkerKv`](crate::model::talker::TalkerKv) must cover; more than the
    /// key's rows).
    ///
    /// Matches the key (validated by the index: a fingerprint that fails
    /// validation is a miss), keeps the whole blocks of the match, pins them
    /// and allocates the rest, evicting unpinned cached blocks (least recently
    /// used first) when the free list is short. When the blocks cannot be
    /// found even so (other live slots pin them) it tries once more without
    /// reuse, and then answers `Ok(None)`: *not now*, with no block changing
    /// hands (the index's clocks and counters saw the lookup); retry after a
    /// [`release`](Self::release), or run this reply uncached.
    ///
    /// Errors, with nothing changed: more blocks than the whole pool
    /// ([`RequestError::RequestTooLarge`]); `total_rows` not above the key's rows
    /// ([`SchedError::TalkerRows`]).
    pub fn begin(&mut self, key: CanonicalPrompt, total_rows: usize) -> Result<Option<TalkerSlot>> {
        let bs = self.block_size;
        let user_rows = key.len();
        if total_rows <= user_rows {
            return Err(SchedError::TalkerRows { user_rows, total_rows }.into());
        }
        let needed = total_rows.div_ceil(bs);
        if needed > self.pool.num_blocks() {
            return Err(RequestError::RequestTooLarge {
                id: None,
                needed,
                num_blocks: self.pool.num_blocks(),
            }
            .into());
        }
        let m = if user_rows == 0 { PrefixMatch::default() } else { checked_match(&mut *self.index, &key)? };
        // Whole blocks only: the talker runs no copy-on-write copy.
        let mut cached = m.aligned_tokens;
        let mut lock = (cached > 0).then(|| pinned_part(m, cached, bs));
        if let Some(l) = &lock {
            self.lock(l);
        }
        let fresh = match self.take(needed - cached / bs)? {
            Some(fresh) => fresh,
            None => {
                if let Some(l) = lock.take() {
                    self.unlock(&l);
                }
                cached = 0;
                match self.take(needed)? {
                    Some(fresh) => fresh,
                    None => {
                        self.stats.refusals += 1;
                        return Ok(None);
                    }
                }
            }
        };
        let shared = cached / bs;
        // Past the pool's blocks, the tier's: read into the first fresh blocks.
        let mut tier_hashes = Vec::new();
        if let Some(tier) = self.tier.as_mut() {
            tier_hashes = tier.block_hashes(&key, bs);
            let loads = tier.read(&tier_hashes, shared);
            cached += loads.len() * bs;
            self.stats.tier_hit_rows += (loads.len() * bs) as u64;
            tier.work.loads.extend(fresh.iter().copied().zip(loads));
        }
        let mut block_table =
            BlockTable::new(lock.as_ref().map_or(&[][..], |l| &l.blocks[..shared]).to_vec(), bs);
        block_table.extend(fresh);
        self.stats.queries += 1;
        self.stats.query_rows += user_rows as u64;
        if cached > 0 {
            self.stats.hits += 1;
            self.stats.hit_rows += cached as u64;
        }
        let id = self.next_slot;
        self.next_slot += 1;
        self.live.insert(id);
        Ok(Some(TalkerSlot {
            cache: self.id,
            id,
            key: Arc::new(key),
            block_table,
            num_shared: shared,
            num_cached: cached,
            total_rows,
            lock,
            tier_hashes,
        }))
    }

    /// Caches the full blocks of the slot's user rows, once the talker's
    /// prefill wrote their KV (call it after `generate_in` returns, or, with a
    /// step-wise talker, after the prefill step, and read
    /// [`TalkerSlot::block_table`] again: blocks the index already held under
    /// the same key replace the slot's copies, which go back to the pool).
    /// Blocks with assistant or decode rows are never cached. Returns the
    /// blocks the index adopted. A second commit adds nothing.
    pub fn commit(&mut self, slot: &mut TalkerSlot) -> Result<usize> {
        self.check_live(slot)?;
        let n_full = slot.key.len() / self.block_size;
        if n_full <= slot.num_shared {
            return Ok(0);
        }
        let who = format!("talker slot {}", slot.id);
        let table = &mut slot.block_table[..];
        let Some(done) = insert_full_blocks(
            &mut *self.index,
            &mut self.pool,
            &slot.key,
            table,
            slot.num_shared,
            n_full,
            &who,
        )?
        else {
            // Only a locked partly filled block refuses an insert, and this
            // index never holds one: nothing is cached this time.
            return Ok(0);
        };
        self.pin(&done.lock);
        if let Some(old) = slot.lock.replace(done.lock) {
            self.unlock(&old);
        }
        slot.num_shared = n_full;
        if let Some(tier) = self.tier.as_mut() {
            tier.cached(&slot.tier_hashes, &slot.block_table[..n_full]);
        }
        for &b in &done.released {
            self.pool.reclaim_evicted(b)?;
        }
        Ok(done.adopted_at.len())
    }

    /// Ends a slot: its pin goes, its cached blocks stay (evictable, least
    /// recently used first), its private blocks (never committed, or holding
    /// assistant and decode rows) go back to the free list.
    pub fn release(&mut self, slot: TalkerSlot) -> Result<()> {
        self.check_live(&slot)?;
        if let Some(l) = &slot.lock {
            self.unlock(l);
        }
        for &b in &slot.block_table[slot.num_shared..] {
            self.pool.release(b)?;
        }
        self.live.remove(&slot.id);
        Ok(())
    }

    /// Gives up to `max_blocks` cached blocks no live slot pins back to the
    /// free list (least recently used first); returns how many. Only the
    /// talker's blocks: the thinker's pool and index are another owner's.
    pub fn evict(&mut self, max_blocks: usize) -> Result<usize> {
        let evicted = self.index.evict(max_blocks);
        self.stats.evicted_blocks += evicted.len() as u64;
        if let Some(tier) = self.tier.as_mut() {
            tier.evicted(&evicted);
        }
        for &b in &evicted {
            self.pool.reclaim_evicted(b)?;
        }
        Ok(evicted.len())
    }

    /// Counters and occupancy.
    pub fn stats(&self) -> TalkerCacheStats {
        TalkerCacheStats {
            blocks_free: self.pool.num_free(),
            blocks_in_use: self.pool.num_in_use(),
            blocks_cached: self.pool.num_indexed(),
            live_slots: self.live.len(),
            ..self.stats.clone()
        }
    }

    /// The talker index's own counters (`validation_failures` among them).
    pub fn index_stats(&self) -> IndexStats {
        self.index.stats()
    }

    /// Checks the pool, the index, and that every pinned block is the index's.
    pub fn validate(&self) -> std::result::Result<(), InvariantViolation> {
        self.pool.validate()?;
        self.index.validate()?;
        if self.pool.num_indexed() as u64 != self.index.stats().cached_blocks {
            return Err(Component::Scheduler.violation(format!(
                "talker cache: the pool counts {} indexed blocks, the index {}",
                self.pool.num_indexed(),
                self.index.stats().cached_blocks
            )));
        }
        for &b in self.pinned.keys() {
            if !matches!(self.pool.state(b), Ok(crate::kv::BlockState::Indexed)) {
                return Err(
                    Component::Scheduler.violation(format!("talker cache: pinned block {b} is not cached"))
                );
            }
        }
        if let Some(b) = self
            .tier
            .iter()
            .flat_map(|t| t.kept())
            .find(|&&b| !matches!(self.pool.state(b), Ok(crate::kv::BlockState::Indexed)))
        {
            return Err(Component::Scheduler
                .violation(format!("talker cache: block {b} keeps a tier hash but is not cached")));
        }
        if self.live.is_empty() && !self.pinned.is_empty() {
            return Err(Component::Scheduler.violation("talker cache: blocks pinned with no live slot"));
        }
        Ok(())
    }

    /// `need` blocks off the free list, evicting unpinned cached blocks when
    /// short; `None`, with nothing evicted, when even every unpinned cached
    /// block would not do.
    fn take(&mut self, need: usize) -> Result<Option<Vec<BlockId>>> {
        let evictable = self.pool.num_indexed().saturating_sub(self.pinned.len());
        if self.pool.num_free() + evictable < need {
            return Ok(None);
        }
        while self.pool.num_free() < need {
            if self.evict(need - self.pool.num_free())? == 0 {
                break;
            }
        }
        Ok(self.pool.allocate(need))
    }

    fn lock(&mut self, m: &PrefixMatch) {
        self.index.lock(m);
        self.pin(m);
    }

    fn pin(&mut self, m: &PrefixMatch) {
        for &b in &m.blocks {
            *self.pinned.entry(b).or_default() += 1;
        }
    }

    fn unlock(&mut self, m: &PrefixMatch) {
        self.index.unlock(m);
        for b in &m.blocks {
            if let Some(n) = self.pinned.get_mut(b) {
                *n -= 1;
                if *n == 0 {
                    self.pinned.remove(b);
                }
            }
        }
    }

    fn check_live(&self, slot: &TalkerSlot) -> Result<()> {
        if slot.cache != self.id || !self.live.contains(&slot.id) {
            return Err(SchedError::UnknownTalkerSlot { slot: slot.id }.into());
        }
        Ok(())
    }
}

/// The key of a talker prompt's user rows (see the module docs): `layout` is
/// [`TalkerLayout::of`] `thinker` (the thinker's prompt, without its reply),
/// `accept_rows` the thinker's accept-layer rows of at least the prompt's
/// positions, `fingerprinter` the engine's (its key and validation policy),
/// `tokens` the model's special ids. One pass over each user item's accept
/// rows; text rows cost nothing.
///
/// Errors: `accept_rows` too short for the prompt
/// ([`BackendError::OpShape`]), non-finite accept rows (the fingerprinter's
/// [`RequestError`]), or a layout that is not `thinker`'s (an [`InvariantViolation`]).
pub fn talker_key(
    layout: &TalkerLayout, thinker: &CanonicalPrompt, accept_rows: ArrayView2<'_, f32>,
    fingerprinter: &Fingerprinter, tokens: &OmniTokens,
) -> Result<CanonicalPrompt> {
    let user = &layout.user;
    if accept_rows.nrows() < thinker.len() {
        return Err(BackendError::OpShape {
            op: "talker key",
            what: "accept-layer rows",
            expected: format!("[>={}, hidden]", thinker.len()),
            found: accept_rows.shape().to_vec(),
        }
        .into());
    }
    let mismatch = || Component::Scheduler.violation("talker key: the layout is not of this thinker prompt");
    // Each thinker item's talker identity, made on its first user atom.
    let mut identities: Vec<Option<(u32, Arc<ItemIdentity>)>> = vec![None; thinker.items.len()];
    let mut atoms = Vec::new();
    let mut items = Vec::new();
    let mut index_map = IndexMap::default();
    let mut token_ids = Vec::with_capacity(user.len());
    let mut next = user.iter().copied().peekable();
    let mut start = 0;
    for atom in &thinker.atoms {
        let end = start + atom.len();
        let row = token_ids.len();
        while let Some(pos) = next.next_if(|&p| p < end) {
            token_ids.push(*thinker.token_ids.get(pos).ok_or_else(mismatch)?);
        }
        let kept = token_ids.len() - row;
        match atom {
            Atom::Text(_) if kept > 0 => match atoms.last_mut() {
                Some(Atom::Text(run)) => run.extend_from_slice(&token_ids[row..]),
                _ => atoms.push(Atom::Text(token_ids[row..].to_vec())),
            },
            Atom::Item { id, rows } if kept > 0 => {
                if kept != rows.len() {
                    return Err(mismatch().into());
                }
                let item = thinker.items.iter().position(|it| Arc::ptr_eq(it, id)).ok_or_else(mismatch)?;
                let (index, identity) = match &identities[item] {
                    Some(made) => made.clone(),
                    None => {
                        let identity = Arc::new(item_identity(thinker, item, accept_rows, fingerprinter)?);
                        let made = (items.len() as u32, identity);
                        items.push(Arc::clone(&made.1));
                        identities[item] = Some(made.clone());
                        made
                    }
                };
                index_map.placeholders.insert_range(row as u32..(row + kept) as u32);
                index_map.spans.push(ItemSpan { item: index, rows: rows.clone(), start: row as u32 });
                atoms.push(Atom::Item { id: identity, rows: rows.clone() });
            }
            _ => {}
        }
        start = end;
    }
    if token_ids.len() != user.len() || layout.is_item.len() != user.len() {
        return Err(mismatch().into());
    }
    let positions = positions_from_atoms(&atoms, tokens, thinker.positions.kind())?;
    if layout.positions.slice(0..user.len())? != positions {
        return Err(Component::Scheduler
            .violation("talker key: positions of the key's atoms differ from the talker layout's")
            .into());
    }
    Ok(CanonicalPrompt { tenant: thinker.tenant, atoms, token_ids, items, index_map, positions })
}

/// The talker identity of `thinker`'s item `item`: its accept-layer rows, in
/// item row order, fingerprinted with its modality and layout.
fn item_identity(
    thinker: &CanonicalPrompt, item: usize, accept_rows: ArrayView2<'_, f32>, fingerprinter: &Fingerprinter,
) -> Result<ItemIdentity> {
    let source = &thinker.items[item];
    let width = accept_rows.ncols();
    let mut rows = Array2::<f32>::zeros((source.num_tokens, width));
    let mut seen = 0;
    for span in thinker.index_map.spans.iter().filter(|s| s.item as usize == item) {
        for (k, row) in span.rows.clone().enumerate() {
            let pos = span.start as usize + k;
            rows.row_mut(row as usize).assign(&accept_rows.row(pos));
            seen += 1;
        }
    }
    if seen != source.num_tokens {
        return Err(Component::Scheduler
            .violation(format!("talker key: item {item} has {seen} of {} rows placed", source.num_tokens))
            .into());
    }
    let flat = rows.into_shape_with_order(source.num_tokens * width).map_err(|e| {
        Component::Scheduler.violation(format!("talker key: item {item} rows do not flatten: {e}"))
    })?;
    let params: ProcessorParams = [(TALKER_KEY_PARAM.to_string(), format!("accept rows x{width}"))].into();
    let spec = ItemSpec {
        modality: source.modality,
        layout: source.layout,
        content: ItemContent::Tensor(TensorView::F32(flat.view().into_dyn())),
        params,
    };
    fingerprinter.identify(item, &spec)
}

#[cfg(test)]
mod tests {
    use ndarray::{ArrayD, IxDyn};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::canon::{FingerprintKey, ItemLayout, Modality, ValidationPolicy};
    use crate::error::{Error, TestResult};
    use crate::index::radix::{RadixConfig, RadixIndex};
    use crate::prompt::PromptBuilder;
    use crate::speech::ChatIds;

    const CHAT: ChatIds = ChatIds::tiny();
    const WIDTH: usize = 24;

    fn fingerprinter() -> Fingerprinter {
        Fingerprinter::new(FingerprintKey::fixed(0), 1, ValidationPolicy::SecondDigest).unwrap()
    }

    /// A thinker prompt: a system turn `system`, a user turn of text `a`, a
    /// 2x2-merged image (4 rows) and text `b`, then the assistant opening.
    fn thinker(system: u32, a: &[u32], b: &[u32]) -> CanonicalPrompt {
        let pixels = ArrayD::<u8>::from_elem(IxDyn(&[56, 56, 3]), 3);
        let spec = ItemSpec {
            modality: Modality::Image,
            layout: ItemLayout::Image { grid_thw: [1, 4, 4] },
            content: ItemContent::Tensor(TensorView::U8(pixels.view())),
            params: Default::default(),
        };
        let image = Arc::new(fingerprinter().identify(0, &spec).unwrap());
        let mut builder = PromptBuilder::new(OmniTokens::tiny());
        builder.push_text(&[1, system, 5, 6, 1, 2, 5]).unwrap();
        builder.push_text(a).unwrap().push_text(&[503]).unwrap();
        builder.push_item(image).unwrap();
        builder.push_text(&[504]).unwrap().push_text(b).unwrap().push_text(&[6, 1, 3, 5]).unwrap();
        builder.build().unwrap()
    }

    fn accept(seed: u64, rows: usize) -> Array2<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        Array2::from_shape_fn((rows, WIDTH), |_| rng.random::<f32>() - 0.5)
    }

    fn key_of(prompt: &CanonicalPrompt, accept: &Array2<f32>) -> (TalkerLayout, CanonicalPrompt) {
        let layout = TalkerLayout::of(prompt, &CHAT, &OmniTokens::tiny()).unwrap();
        let key = talker_key(&layout, prompt, accept.view(), &fingerprinter(), &OmniTokens::tiny()).unwrap();
        (layout, key)
    }

    fn cache(num_blocks: usize, block_size: usize) -> TalkerCache {
        let index = RadixIndex::new(RadixConfig { block_size }).unwrap();
        TalkerCache::new(TalkerCacheConfig { num_blocks, block_size }, Box::new(index)).unwrap()
    }

    /// Begins, "runs", commits and releases one talker prompt; returns the cached rows.
    fn round(cache: &mut TalkerCache, key: &CanonicalPrompt) -> TestResult<usize> {
        let total = key.len() + 9 + 3;
        let mut slot = cache.begin(key.clone(), total)?.ok_or("pool short")?;
        assert!(slot.block_table().covers(total));
        let cached = slot.num_cached();
        cache.commit(&mut slot)?;
        cache.release(slot)?;
        cache.validate()?;
        Ok(cached)
    }

    #[test]
    fn the_key_is_the_user_rows_with_items_keyed_by_their_accept_rows() -> TestResult {
        let prompt = thinker(4, &[10, 11], &[12, 13, 14]);
        let rows = accept(1, prompt.len());
        let (layout, key) = key_of(&prompt, &rows);
        assert_eq!(key.len(), layout.user.len());
        assert_eq!(key.token_ids[..], layout.ids[..layout.user.len()]);
        assert_eq!(key.positions, layout.positions.slice(0..layout.user.len())?);
        let [Atom::Text(head), Atom::Item { id, rows: item_rows }, Atom::Text(tail)] = &key.atoms[..] else {
            return Err(format!("atoms {:?}", key.atoms).into());
        };
        assert_eq!(head[..], [1, 2, 5, 10, 11, 503]);
        assert_eq!(*item_rows, 0..4);
        assert_eq!(tail[..], [504, 12, 13, 14, 6]);
        // Not the thinker's identity of the image: the talker's is of its accept rows.
        assert_ne!(id.fingerprint, prompt.items[0].fingerprint);
        assert_eq!((id.layout, id.num_tokens), (prompt.items[0].layout, 4));
        // The same rows give the same identity; a system turn that changes the
        // accept rows changes it, though the text rows stay.
        assert_eq!(key_of(&prompt, &rows).1.items[0].fingerprint, id.fingerprint);
        let other = thinker(40, &[10, 11], &[12, 13, 14]);
        let (_, other_key) = key_of(&other, &accept(2, other.len()));
        assert_ne!(other_key.items[0].fingerprint, id.fingerprint);
        // Short accept rows are an error.
        let short = accept(1, prompt.len() - 1);
        assert!(talker_key(&layout, &prompt, short.view(), &fingerprinter(), &OmniTokens::tiny()).is_err());
        Ok(())
    }

    #[test]
    fn a_later_round_reuses_the_full_blocks_of_the_earlier_user_rows() -> TestResult {
        let mut cache = cache(32, 4);
        let one = thinker(4, &[10, 11], &[12, 13, 14]);
        let rows = accept(1, one.len());
        let (_, key1) = key_of(&one, &rows);
        assert_eq!(key1.len(), 15);
        assert_eq!(round(&mut cache, &key1)?, 0);
        // Round 2: the same user rows, then more; its key starts with round 1's.
        let mut two = key1.clone();
        for t in [1u32, 2, 5, 20, 21, 22, 23, 6] {
            two.push_text(t);
        }
        assert_eq!(round(&mut cache, &two)?, 12, "the 3 full blocks of round 1's 15 user rows");
        // The same round again reuses all of its own full blocks.
        assert_eq!(round(&mut cache, &two)?, 20);
        let s = cache.stats();
        assert_eq!((s.queries, s.hits, s.hit_rows, s.query_rows), (3, 2, 32, 15 + 23 + 23));
        assert_eq!((s.blocks_cached, s.blocks_in_use, s.live_slots), (5, 0, 0));
        Ok(())
    }

    #[test]
    fn item_rows_that_differ_by_one_bit_are_a_miss_from_that_item_on() -> TestResult {
        for block_size in [1, 2, 3, 4, 8] {
            let mut cache = cache(64, block_size);
            let prompt = thinker(4, &[10, 11], &[12, 13, 14]);
            let rows = accept(1, prompt.len());
            let (layout, key) = key_of(&prompt, &rows);
            assert_eq!(round(&mut cache, &key)?, 0);
            let first_item = layout.is_item.iter().position(|&m| m).ok_or("no item row")?;
            let item_pos = layout.user[first_item + 2];
            let mut flipped = rows.clone();
            flipped[[item_pos, 7]] = f32::from_bits(flipped[[item_pos, 7]].to_bits() ^ 1);
            let (_, other) = key_of(&prompt, &flipped);
            let cached = round(&mut cache, &other)?;
            assert_eq!(cached, first_item / block_size * block_size, "block size {block_size}");
            // Forced collision: the same fingerprint over other rows fails validation (a miss).
            let mut forged = other.clone();
            let mut id = (*other.items[0]).clone();
            id.fingerprint = key.items[0].fingerprint;
            let id = Arc::new(id);
            forged.items = vec![Arc::clone(&id)];
            for atom in &mut forged.atoms {
                if let Atom::Item { id: slot, .. } = atom {
                    *slot = Arc::clone(&id);
                }
            }
            let failures = cache.index_stats().validation_failures;
            assert_eq!(round(&mut cache, &forged)?, first_item / block_size * block_size);
            assert!(cache.index_stats().validation_failures > failures);
        }
        Ok(())
    }

    #[test]
    fn a_short_pool_refuses_with_nothing_changed_and_bad_calls_are_errors() -> TestResult {
        let mut cache = cache(6, 4);
        let prompt = thinker(4, &[10, 11], &[12, 13, 14]);
        let (_, key) = key_of(&prompt, &accept(1, prompt.len()));
        // Never fits: 25 rows need 7 blocks of 4.
        assert!(matches!(
            cache.begin(key.clone(), 25),
            Err(Error::Request(RequestError::RequestTooLarge { needed: 7, num_blocks: 6, .. }))
        ));
        assert!(matches!(
            cache.begin(key.clone(), key.len()),
            Err(Error::Sched(SchedError::TalkerRows { user_rows: 15, total_rows: 15 }))
        ));
        let mut held = cache.begin(key.clone(), 24)?.ok_or("pool short")?;
        cache.commit(&mut held)?;
        let before = (cache.stats(), cache.index_stats());
        // Six blocks: the held slot pins 3 cached ones and holds 3 private ones.
        let other = {
            let mut p = key.clone();
            p.push_text(30);
            p
        };
        assert!(cache.begin(other.clone(), 24)?.is_none());
        let after = cache.stats();
        assert_eq!((after.refusals, after.queries), (1, before.0.queries));
        assert_eq!(
            (after.blocks_free, after.blocks_in_use, after.blocks_cached, after.live_slots),
            (before.0.blocks_free, before.0.blocks_in_use, before.0.blocks_cached, 1)
        );
        assert_eq!(cache.index_stats().cached_blocks, before.1.cached_blocks);
        cache.validate()?;
        // A slot of another cache, or one released, is refused.
        let mut stranger = self::cache(6, 4);
        let foreign = stranger.begin(key.clone(), 16)?.ok_or("pool short")?;
        assert!(matches!(cache.release(foreign), Err(Error::Sched(SchedError::UnknownTalkerSlot { .. }))));
        cache.release(held)?;
        // Once released, its cached blocks are evictable: the next begin gets its blocks.
        let slot = cache.begin(other, 24)?.ok_or("pool short after release")?;
        assert_eq!(slot.num_cached(), 12);
        cache.release(slot)?;
        cache.validate()?;
        Ok(())
    }

    #[test]
    fn eviction_takes_unpinned_talker_blocks_only() -> TestResult {
        let mut cache = cache(16, 4);
        let prompt = thinker(4, &[10, 11], &[12, 13, 14]);
        let (_, key) = key_of(&prompt, &accept(1, prompt.len()));
        round(&mut cache, &key)?;
        let mut slot = cache.begin(key.clone(), 30)?.ok_or("pool short")?;
        assert_eq!(slot.num_cached(), 12);
        // The pinned prefix stays.
        assert_eq!(cache.evict(usize::MAX)?, 0);
        cache.commit(&mut slot)?;
        cache.release(slot)?;
        assert_eq!(cache.evict(usize::MAX)?, 3);
        assert_eq!(cache.stats().blocks_cached, 0);
        assert_eq!(round(&mut cache, &key)?, 0, "an evicted prefix is recomputed");
        cache.validate()?;
        Ok(())
    }
}
