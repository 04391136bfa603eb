//! The scheduler's side of the disk tier: which evicted blocks go down to it,
//! and which blocks a starting request takes back from it.
//!
//! The scheduler decides, the engine moves the bytes: blocks the index evicts
//! (full, published, so their content hash is known) are listed as *saves*;
//! a match that stops before a prompt's end continues block by block into the
//! tier (a lookup by name). A request that finds blocks there starts *loading*:
//! it takes fresh blocks for them, the reader thread reads and checks them
//! while other requests' steps run, and the request sits out of the batches
//! until a later [`Scheduler::schedule`](super::Scheduler::schedule) collects
//! the run, lists it as *loads* into those blocks and lets the request
//! prefill from there (a step with nothing else to run waits for a run). The
//! engine takes both lists after `schedule` and before the runner runs the
//! batch ([`Scheduler::take_tier_work`](super::Scheduler::take_tier_work)):
//! saves first (an evicted block's pages may be the very block a load or the
//! batch writes next), then loads. The runner never sees the tier.
//!
//! A block evicted in the same `schedule` call that a later request of that
//! call would load is not in the tier yet: that request recomputes it (a miss,
//! never a wrong hit). A loading request that is preempted or aborted forgets
//! its run; the run's blocks, read later, are dropped.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::events::EventLog;
use crate::Result;
use crate::batch::RequestId;
use crate::events::Medium;
use crate::index::block_hash::FleetHasher;
use crate::kv::BlockId;
use crate::tier::{Loaded, ReadDone, TierReader, TierWriter};

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

/// A request whose blocks the reader thread is reading.
#[derive(Debug)]
pub(super) struct Loading {
    id: RequestId,
    /// The fresh blocks the run's blocks go into, in order.
    blocks: Vec<BlockId>,
    /// Index-owned blocks before them.
    shared: usize,
    /// Prompt tokens past the pool's match (the tier query, in tokens).
    asked: usize,
}

/// The tier a scheduler writes evicted blocks to and continues matches into.
#[derive(Debug)]
pub(super) struct SchedTier {
    pub(super) writer: Arc<TierWriter>,
    reader: TierReader,
    /// Runs being read, by ticket.
    loading: HashMap<u64, Loading>,
    next_ticket: u64,
    pub(super) work: TierWork,
    pub(super) tokens: TierTokens,
}

impl SchedTier {
    pub(super) fn new(writer: Arc<TierWriter>) -> Result<Self> {
        let reader = TierReader::start(Arc::clone(&writer))?;
        Ok(SchedTier {
            writer,
            reader,
            loading: HashMap::new(),
            next_ticket: 0,
            work: TierWork::default(),
            tokens: TierTokens::default(),
        })
    }
}

impl super::Scheduler {
    /// Makes the scheduler save the blocks its index evicts to `writer`, and
    /// continue matches into it. The block hashes are the fleet key's
    /// (`hasher`); the KV-event log keeps them (recording events that nobody
    /// publishes when the engine has no publisher: it drains them every step).
    /// Fails only when the reader thread cannot start.
    pub fn with_tier(mut self, writer: Arc<TierWriter>, hasher: FleetHasher, medium: Medium) -> Result<Self> {
        self.events.get_or_insert_with(|| EventLog::new(hasher, medium)).keep_for_disk();
        self.tier = Some(SchedTier::new(writer)?);
        Ok(self)
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

    /// Starts reading request `id`'s run `hashes` into `blocks` (its fresh
    /// blocks after `shared` index-owned ones); `asked`: the tier query in tokens.
    pub(super) fn tier_begin_load(
        &mut self, id: RequestId, hashes: Vec<u64>, blocks: Vec<BlockId>, shared: usize, asked: usize,
    ) {
        let Some(tier) = self.tier.as_mut() else { return };
        let ticket = tier.next_ticket;
        tier.next_ticket += 1;
        tier.loading.insert(ticket, Loading { id, blocks, shared, asked });
        tier.reader.submit(ticket, hashes);
    }

    /// Whether request `id` waits for its run from the tier.
    pub(super) fn tier_is_loading(&self, id: RequestId) -> bool {
        self.tier.as_ref().is_some_and(|t| t.loading.values().any(|l| l.id == id))
    }

    /// Forgets request `id`'s run, if it is loading (its blocks are released).
    pub(super) fn tier_forget_load(&mut self, id: RequestId) {
        if let Some(tier) = self.tier.as_mut() {
            tier.loading.retain(|_, l| l.id != id);
        }
    }

    /// Collects the runs the reader has finished (with `wait`, waiting for at
    /// least one that a request still waits on, if any is outstanding) and
    /// lets their requests prefill from what was read. `true` when one did.
    pub(super) fn tier_collect_loads(&mut self, wait: bool) -> Result<bool> {
        let mut applied = false;
        loop {
            let Some(tier) = self.tier.as_mut() else { return Ok(false) };
            let done = if wait && !applied { tier.reader.wait_done() } else { tier.reader.try_done() };
            let Some(done) = done else { return Ok(applied) };
            applied |= self.tier_apply(done)?;
        }
    }

    /// Lists a finished run as loads into its request's blocks and moves the
    /// request's computed prefix past them; `false` for a forgotten run.
    fn tier_apply(&mut self, done: ReadDone) -> Result<bool> {
        let bs = self.config.block_size;
        let Some(tier) = self.tier.as_mut() else { return Ok(false) };
        let Some(Loading { id, blocks, shared, asked }) = tier.loading.remove(&done.ticket) else {
            return Ok(false);
        };
        let read = done.blocks.len();
        tier.work.load_times.extend(done.times);
        tier.tokens.query_tokens += asked as u64;
        tier.tokens.hit_tokens += (read * bs) as u64;
        tier.work.loads.extend(blocks.into_iter().zip(done.blocks));
        let t = self.tracked_mut(id)?;
        // At least the last token runs; a run cut short by a missing or bad
        // file is computed from there, in the blocks reserved for it.
        let computed = ((shared + read) * bs).min(t.req.prompt.len() - 1);
        let from_tier = computed - t.num_computed;
        t.num_computed = computed;
        t.num_cached = computed;
        if from_tier > 0 {
            self.stats.hits += u64::from(shared == 0);
            self.stats.hit_tokens += from_tier as u64;
        }
        Ok(true)
    }

    /// Lists the published blocks of `released` (full, hashed) as saves; returns them.
    pub(super) fn tier_save(&mut self, released: &[BlockId]) -> Vec<BlockId> {
        let (Some(tier), Some(log)) = (self.tier.as_mut(), self.events.as_ref()) else { return Vec::new() };
        let saves: Vec<(BlockId, u64)> =
            released.iter().filter_map(|&b| log.hash_of(b).map(|h| (b, h))).collect();
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
    use crate::canon::FingerprintKey;
    use crate::index::radix::{RadixConfig, RadixIndex};
    use crate::sched::{Scheduler, SchedulerConfig};
    use crate::tier::scratch::{Scratch, payload_held, writer_holding};

    /// A scheduler of 8 blocks of 4, no tier.
    fn sched() -> Scheduler {
        let index = RadixIndex::new(RadixConfig { block_size: 4 }).unwrap();
        Scheduler::new(
            SchedulerConfig { block_size: 4, num_blocks: 8, ..Default::default() },
            Box::new(index),
        )
        .unwrap()
    }

    fn hasher() -> FleetHasher {
        FleetHasher::new(&FingerprintKey::fixed(1))
    }

    /// [`sched`] over a tier in `dir` holding blocks 1, 2 and 3.
    fn sched_over_tier(dir: &Scratch) -> Scheduler {
        sched().with_tier(writer_holding(dir, &[1, 2, 3]), hasher(), Medium::Cpu).unwrap()
    }

    fn text(id: RequestId, len: u32) -> crate::sched::Request {
        crate::sched::Request::new(id, crate::prompt::CanonicalPrompt::text(0, (0..len).collect()))
    }

    #[test]
    fn a_finished_read_moves_its_request_past_the_blocks_read() {
        let dir = Scratch::new("sched-read");
        let mut sched = sched_over_tier(&dir);
        sched.admit(text(1, 14)).unwrap();
        // Blocks 1 and 2 are in the tier, 9 is not: the run stops there.
        sched.tier_begin_load(1, vec![1, 2, 9], vec![5, 6, 7], 0, 14);
        assert!(sched.tier_is_loading(1));
        assert!(sched.tier_collect_loads(true).unwrap());
        assert!(!sched.tier_is_loading(1));
        let work = sched.take_tier_work();
        let loads: Vec<(BlockId, &[u8])> = work.loads.iter().map(|(b, l)| (*b, l.payload())).collect();
        assert_eq!(loads, [(5, &payload_held(1)[..]), (6, &payload_held(2)[..])]);
        assert_eq!(sched.requests[&1].num_computed, 8);
        assert_eq!(sched.tier_tokens().unwrap(), TierTokens { query_tokens: 14, hit_tokens: 8 });
    }

    /// A request preempted (or aborted) while its blocks are read no longer
    /// holds them: the run, when it comes, must land nowhere.
    #[test]
    fn a_read_for_a_request_that_let_its_blocks_go_is_dropped() {
        let dir = Scratch::new("sched-forget");
        let mut sched = sched_over_tier(&dir);
        sched.admit(text(1, 14)).unwrap();
        sched.tier_begin_load(1, vec![1, 2, 3], vec![5, 6, 7], 0, 14);
        sched.release_cache_state(1).unwrap();
        assert!(!sched.tier_is_loading(1));
        assert!(!sched.tier_collect_loads(true).unwrap(), "the only run outstanding was forgotten");
        assert!(sched.take_tier_work().loads.is_empty());
        assert_eq!(sched.requests[&1].num_computed, 0);
        assert_eq!(sched.tier_tokens().unwrap(), TierTokens::default());
    }

    /// The engine gives the scheduler its tier before its KV events: the event log
    /// that replaces the tier's own must still keep what DISK events need.
    #[test]
    fn kv_events_given_after_the_tier_still_publish_its_blocks_on_disk() {
        let dir = Scratch::new("sched-order");
        let writer = writer_holding(&dir, &[]);
        let tier_first = sched()
            .with_tier(Arc::clone(&writer), hasher(), Medium::Cpu)
            .unwrap()
            .with_kv_events(hasher(), Medium::Cpu);
        let events_first =
            sched().with_kv_events(hasher(), Medium::Cpu).with_tier(writer, hasher(), Medium::Cpu).unwrap();
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
