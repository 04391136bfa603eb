//! The talker cache's side of the disk tier, as the scheduler's
//! ([`super::tier`]) is the thinker's: the full blocks the talker index evicts
//! go down to the tier under their content hash (the fleet key's hash of the
//! talker key, [`super::talker_key`]), and a talker match that stops before
//! the key's last full block continues into it.
//!
//! The talker's files carry the talker's own identity (its weights and the
//! thinker's, whose embeddings and accept rows feed it) and page layout, so
//! they share the directory, its bound and its lock with the thinker's files
//! and are never taken for them. Reads are synchronous: a talker starts once
//! per spoken reply, between thinker steps, and reads a few blocks.

use std::sync::Arc;

use fxhash::FxHashMap;

use super::TalkerCache;
use super::tier::TierWork;
use crate::index::block_hash::FleetHasher;
use crate::kv::BlockId;
use crate::prompt::CanonicalPrompt;
use crate::tier::{Loaded, TierWriter, read_run};

/// The tier under a [`TalkerCache`].
#[derive(Debug)]
pub(super) struct TalkerTier {
    pub(super) writer: Arc<TierWriter>,
    hasher: FleetHasher,
    /// The content hash of every full block the talker index holds: what an
    /// evicted block is saved under.
    hashes: FxHashMap<BlockId, u64>,
    pub(super) work: TierWork,
}

impl TalkerTier {
    pub(super) fn new(writer: Arc<TierWriter>, hasher: FleetHasher) -> Self {
        TalkerTier { writer, hasher, hashes: FxHashMap::default(), work: TierWork::default() }
    }

    /// The content hashes of `key`'s full blocks (computed once a slot: its
    /// read and its commit both use them).
    pub(super) fn block_hashes(&self, key: &CanonicalPrompt, block_size: usize) -> Vec<u64> {
        self.hasher.block_hashes(key, block_size)
    }

    /// The run of `hashes` (a key's full blocks) from block `from` on that the
    /// tier holds, read and checked now, up to the first it lacks or that fails
    /// its check.
    pub(super) fn read(&mut self, hashes: &[u64], from: usize) -> Vec<Loaded> {
        let found: Vec<u64> =
            hashes.iter().skip(from).copied().take_while(|&h| self.writer.contains(h)).collect();
        let (blocks, times) = read_run(&self.writer, &found);
        self.work.load_times.extend(times);
        blocks
    }

    /// Records `hashes` (a key's full blocks, in order) for `blocks`, which the
    /// index now holds as the key's first blocks.
    pub(super) fn cached(&mut self, hashes: &[u64], blocks: &[BlockId]) {
        self.hashes.extend(blocks.iter().copied().zip(hashes.iter().copied()));
    }

    /// Lists the blocks the index evicted as saves (each under its hash).
    pub(super) fn evicted(&mut self, blocks: &[BlockId]) {
        let saves = blocks.iter().filter_map(|b| self.hashes.remove(b).map(|h| (*b, h)));
        self.work.saves.extend(saves);
    }

    /// Blocks whose hash is kept: each must be the index's.
    pub(super) fn kept(&self) -> impl Iterator<Item = &BlockId> {
        self.hashes.keys()
    }
}

impl TalkerCache {
    /// Makes the cache save the blocks its index evicts from now on to
    /// `writer` (the talker's own tier store), and continue matches into it;
    /// `hasher`: the fleet key's, as the thinker's blocks are hashed.
    pub fn attach_tier(&mut self, writer: Arc<TierWriter>, hasher: FleetHasher) {
        self.tier = Some(TalkerTier::new(writer, hasher));
    }

    /// The saves and loads listed since the last call, for the talker's pages:
    /// saves first (an evicted block may be the very block a load or the next
    /// talker step writes), then loads, before the talker runs again.
    pub fn take_tier_work(&mut self) -> TierWork {
        self.tier.as_mut().map(|t| std::mem::take(&mut t.work)).unwrap_or_default()
    }

    /// The tier's writer, if any.
    pub fn tier(&self) -> Option<&Arc<TierWriter>> {
        self.tier.as_ref().map(|t| &t.writer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canon::FingerprintKey;
    use crate::index::radix::{RadixConfig, RadixIndex};
    use crate::sched::TalkerCacheConfig;
    use crate::tier::scratch::{Scratch, payload_held, writer_holding};

    fn key(ids: Vec<u32>) -> CanonicalPrompt {
        CanonicalPrompt::text(0, ids)
    }

    fn hasher() -> FleetHasher {
        FleetHasher::new(&FingerprintKey::fixed(1))
    }

    #[test]
    fn evicted_blocks_go_down_under_their_hash_and_a_later_match_reads_them_back() -> crate::Result<()> {
        let dir = Scratch::new("talker-tier");
        let index = RadixIndex::new(RadixConfig { block_size: 4 })?;
        let mut cache =
            TalkerCache::new(TalkerCacheConfig { num_blocks: 8, block_size: 4 }, Box::new(index))?;
        cache.attach_tier(writer_holding(&dir, &[]), hasher());
        // Round 1: 10 user rows, two full blocks cached, then evicted.
        let round1 = key((0..10).collect());
        let mut slot = cache.begin(round1.clone(), 14)?.expect("an empty pool");
        cache.commit(&mut slot)?;
        let cached = slot.block_table()[..2].to_vec();
        cache.release(slot)?;
        assert_eq!(cache.evict(usize::MAX)?, 2);
        let hashes = hasher().block_hashes(&round1, 4);
        let saves = cache.take_tier_work().saves;
        assert_eq!(saves, cached.into_iter().zip(hashes.iter().copied()).collect::<Vec<_>>());
        // The engine writes them (here: a payload that names each block).
        let writer = Arc::clone(cache.tier().expect("a tier"));
        for &h in &hashes {
            writer.submit_waiting(h, payload_held(h).into());
        }
        // Round 2 starts with round 1's rows: its first two blocks come from the tier.
        let slot = cache.begin(key((0..10).chain(20..26).collect()), 20)?.expect("blocks are free");
        assert_eq!(slot.num_cached(), 8);
        let loads: Vec<(BlockId, Vec<u8>)> =
            cache.take_tier_work().loads.into_iter().map(|(b, l)| (b, l.payload().to_vec())).collect();
        let want: Vec<(BlockId, Vec<u8>)> =
            slot.block_table()[..2].iter().copied().zip(hashes.iter().map(|&h| payload_held(h))).collect();
        assert_eq!(loads, want);
        assert_eq!((cache.stats().tier_hit_rows, cache.stats().hit_rows), (8, 8));
        cache.release(slot)?;
        cache.validate()?;
        Ok(())
    }
}
