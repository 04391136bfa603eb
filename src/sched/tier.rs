//! The scheduler's side of the disk tier: which evicted blocks go down to it,
//! and which blocks a starting request takes back from it.
//!
//! The scheduler decides, the engine moves the bytes: blocks the index evicts
//! (full, published, so their content hash is known) are listed as *saves*;
//! a match that stops before a prompt's end continues block by block into the
//! tier, and each block found there is read (and checked) at once and listed as
//! a *load* into a freshly allocated block. The engine takes both lists after
//! [`Scheduler::schedule`](super::Scheduler::schedule) and before the runner
//! runs the batch ([`Scheduler::take_tier_work`](super::Scheduler::take_tier_work)):
//! saves first (an evicted block's pages may be the very block a load or the
//! batch writes next), then loads. The runner never sees the tier.
//!
//! A block evicted in the same `schedule` call that a later request of that
//! call would load is not in the tier yet: that request recomputes it (a miss,
//! never a wrong hit).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::events::EventLog;
use crate::batch::RequestId;
use crate::events::Medium;
use crate::index::block_hash::FleetHasher;
use crate::kv::BlockId;
use crate::tier::{Loaded, TierWriter};

/// What the engine does to pages before the next batch runs.
#[derive(Debug, Default)]
pub struct TierWork {
    /// Blocks to copy out to the tier, with their content hashes (in eviction order).
    pub saves: Vec<(BlockId, u64)>,
    /// Blocks to fill from the tier, with the payloads read.
    pub loads: Vec<(BlockId, Loaded)>,
    /// How long each load's read and check took.
    pub load_times: Vec<Duration>,
}

/// Token counters of the tier as the scheduler uses it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierTokens {
    /// Prompt tokens past the pool's match looked up in the tier (requests whose
    /// pool match ended before their last full block).
    pub query_tokens: u64,
    /// Of those, tokens whose KV and rows were loaded from the tier.
    pub hit_tokens: u64,
}

/// The tier a scheduler writes evicted blocks to and continues matches into.
#[derive(Debug)]
pub(super) struct SchedTier {
    pub(super) writer: Arc<TierWriter>,
    pub(super) work: TierWork,
    pub(super) tokens: TierTokens,
}

impl SchedTier {
    pub(super) fn new(writer: Arc<TierWriter>) -> Self {
        SchedTier { writer, work: TierWork::default(), tokens: TierTokens::default() }
    }

    /// The blocks of `hashes` (consecutive, from the first) the tier holds, read
    /// and checked now, up to the first miss.
    pub(super) fn read_run(&mut self, hashes: &[u64]) -> Vec<Loaded> {
        let mut run = Vec::new();
        for &hash in hashes {
            let t0 = Instant::now();
            let Some(block) = self.writer.get(hash) else { break };
            self.work.load_times.push(t0.elapsed());
            run.push(block);
        }
        run
    }
}

impl super::Scheduler {
    /// Makes the scheduler save the blocks its index evicts to `writer`, and
    /// continue matches into it. The block hashes are the fleet key's
    /// (`hasher`); the KV-event log keeps them (recording events that nobody
    /// publishes when the engine has no publisher: it drains them every step).
    pub fn with_tier(mut self, writer: Arc<TierWriter>, hasher: FleetHasher, medium: Medium) -> Self {
        self.events.get_or_insert_with(|| EventLog::new(hasher, medium)).keep_for_disk();
        self.tier = Some(SchedTier::new(writer));
        self
    }

    /// The saves and loads listed since the last call: the engine runs them
    /// on the pages before the batch [`schedule`](Self::schedule) returned.
    pub fn take_tier_work(&mut self) -> TierWork {
        self.tier.as_mut().map(|t| std::mem::take(&mut t.work)).unwrap_or_default()
    }

    /// The tier's token counters (`None` without a tier).
    pub fn tier_tokens(&self) -> Option<TierTokens> {
        self.tier.as_ref().map(|t| t.tokens)
    }

    /// The tier's writer, if any.
    pub fn tier(&self) -> Option<&Arc<TierWriter>> {
        self.tier.as_ref().map(|t| &t.writer)
    }

    /// The hashes of request `id`'s prompt blocks from block `from` on that the
    /// tier holds (full blocks of the prompt only, up to the first it lacks): a
    /// lookup by name, nothing read.
    pub(super) fn tier_probe(&mut self, id: RequestId, from: usize, len: usize) -> Vec<u64> {
        let bs = self.config.block_size;
        let (Some(tier), Some(log), Some(t)) =
            (self.tier.as_ref(), self.events.as_ref(), self.requests.get_mut(&id))
        else {
            return Vec::new();
        };
        let full = len / bs;
        if from >= full {
            return Vec::new();
        }
        log.hasher().extend(&t.req.prompt, bs, full, &mut t.block_hashes);
        t.block_hashes[from..full].iter().copied().take_while(|&h| tier.writer.contains(h)).collect()
    }

    /// The blocks of `hashes` read and checked, up to the first that fails.
    pub(super) fn tier_read(&mut self, hashes: &[u64]) -> Vec<Loaded> {
        self.tier.as_mut().map(|tier| tier.read_run(hashes)).unwrap_or_default()
    }

    /// Lists `loads` into the first of `fresh` and counts a tier query of `asked` tokens.
    pub(super) fn tier_loaded(&mut self, fresh: &[BlockId], loads: Vec<Loaded>, asked: usize) {
        let bs = self.config.block_size as u64;
        let Some(tier) = self.tier.as_mut() else { return };
        tier.tokens.query_tokens += asked as u64;
        tier.tokens.hit_tokens += loads.len() as u64 * bs;
        tier.work.loads.extend(fresh.iter().copied().zip(loads));
    }

    /// Lists the published blocks of `released` (full, hashed) as saves; returns them.
    pub(super) fn tier_save(&mut self, released: &[BlockId]) -> Vec<BlockId> {
        let (Some(tier), Some(log)) = (self.tier.as_mut(), self.events.as_ref()) else { return Vec::new() };
        let published = log.published();
        let saves: Vec<(BlockId, u64)> =
            released.iter().filter_map(|b| published.get(b).map(|&h| (*b, h))).collect();
        let saved = saves.iter().map(|&(b, _)| b).collect();
        tier.work.saves.extend(saves);
        saved
    }

    /// Records, for KV events, the tier's files this process deleted since the last call.
    pub(super) fn note_tier_departures(&mut self) {
        let (Some(tier), Some(log)) = (self.tier.as_ref(), self.events.as_mut()) else { return };
        let gone = tier.writer.store().take_departed();
        if !gone.is_empty() {
            log.left_disk(&gone);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Dtype;
    use crate::canon::FingerprintKey;
    use crate::index::radix::{RadixConfig, RadixIndex};
    use crate::sched::{Scheduler, SchedulerConfig};
    use crate::tier::scratch::Scratch;
    use crate::tier::{BlockLayout, Identity, ModelId, TierStore};

    /// The engine gives the scheduler its tier before its KV events: the event log
    /// that replaces the tier's own must still keep what DISK events need.
    #[test]
    fn kv_events_given_after_the_tier_still_publish_its_blocks_on_disk() {
        let dir = Scratch::new("sched-order");
        let layout = BlockLayout {
            block_size: 4,
            layers: 1,
            kv_heads: 1,
            head_dim: 2,
            kv_dtype: Dtype::F32,
            captured: 0,
            hidden: 0,
        };
        let id = Identity { model: ModelId::of(["tiny"]), key: [7; 16], layout };
        let writer = Arc::new(
            TierWriter::start(TierStore::open(&dir.0, 64 * id.layout.file_bytes(), id).unwrap(), 4).unwrap(),
        );
        let hasher = || FleetHasher::new(&FingerprintKey::fixed(1));
        let sched = || {
            let index = RadixIndex::new(RadixConfig { block_size: 4 }).unwrap();
            Scheduler::new(
                SchedulerConfig { block_size: 4, num_blocks: 8, ..Default::default() },
                Box::new(index),
            )
            .unwrap()
        };
        let tier_first = sched()
            .with_tier(Arc::clone(&writer), hasher(), Medium::Cpu)
            .with_kv_events(hasher(), Medium::Cpu);
        let events_first =
            sched().with_kv_events(hasher(), Medium::Cpu).with_tier(writer, hasher(), Medium::Cpu);
        for s in [tier_first, events_first] {
            assert!(s.events.as_ref().is_some_and(EventLog::keeps_for_disk));
        }
        assert!(
            !sched()
                .with_kv_events(hasher(), Medium::Cpu)
                .events
                .as_ref()
                .is_some_and(EventLog::keeps_for_disk)
        );
    }
}
