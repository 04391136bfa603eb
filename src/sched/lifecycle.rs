//! A request's life in the scheduler: admitted (checked, queued), grown by
//! sampled tokens, finished (its last block cached) or aborted, and the
//! bookkeeping that takes it out of every list.

use crate::batch::RequestId;
use crate::error::{RequestError, Result, SchedError};
use crate::kv::BlockTable;
use crate::prompt::out_of_vocab;

use super::admission::PoolLimits;
use super::{Checked, Phase, Request, Scheduler, Tracked};

impl Scheduler {
    /// Queues a request after checking it can ever run and every chunk of it
    /// is well-formed for the runner; on error nothing changes.
    pub fn admit(&mut self, req: Request) -> Result<()> {
        let checked = self.admission.check(req)?;
        self.admit_checked(checked)
    }

    /// [`admit`](Self::admit) for a request that already passed its
    /// [`RequestChecks`](super::RequestChecks) (an engine runs them while it prepares the request,
    /// off the step loop): only the checks that read the scheduler's state
    /// remain, the id is free and the sequence fits the pool.
    pub fn admit_checked(&mut self, checked: Checked) -> Result<()> {
        let Checked(req) = checked;
        let pool = PoolLimits {
            // An id aborted while its batch is out stays taken until that batch completes.
            id_taken: self.requests.contains_key(&req.id) || self.aborted_in_flight.contains(&req.id),
            num_blocks: self.pool.num_blocks(),
            block_size: self.config.block_size,
        };
        pool.check(&req)?;
        let id = req.id;
        let prompt_len = req.prompt.len();
        let tracked = Tracked {
            embeds: req.placed_embeds(),
            req,
            phase: Phase::Waiting,
            block_table: BlockTable::empty(self.config.block_size),
            num_shared: 0,
            num_computed: 0,
            num_cached: 0,
            prompt_len,
            in_flight: None,
            lock: None,
            delivered: 0,
            arrival: self.arrivals,
            block_hashes: Vec::new(),
        };
        self.arrivals += 1;
        self.requests.insert(id, tracked);
        self.waiting.push_back(id);
        Ok(())
    }

    /// Grows ready sequence `id` by `token` (sampled from its last logits):
    /// it runs in a later step as a decode token, at the next decode position
    /// (a parked one first recomputes what it gave up).
    /// Errors, with nothing changed, for a sequence that is not ready, a token
    /// outside the vocabulary, or one beyond the request's `max_new_tokens`.
    pub fn append(&mut self, id: RequestId, token: u32) -> Result<()> {
        let t = self.requests.get(&id).ok_or(SchedError::UnknownRequest { id })?;
        let len = t.req.prompt.len();
        if !matches!(t.phase, Phase::Ready | Phase::Parked) {
            return Err(SchedError::RequestNotFinished { id, computed: t.num_computed, len }.into());
        }
        let limit = t.prompt_len + t.req.max_new_tokens;
        if len >= limit {
            return Err(RequestError::GenerationLimit { id, max_new_tokens: t.req.max_new_tokens }.into());
        }
        if let Some(model) = self.admission.model()
            && out_of_vocab(&[token], model.vocab_size).is_some()
        {
            let vocab_size = u32::try_from(model.vocab_size).unwrap_or(u32::MAX);
            return Err(RequestError::TokenOutOfVocab { position: len, token, vocab_size }.into());
        }
        let arrival = t.arrival;
        let t = self.tracked_mut(id)?;
        t.req.prompt.push_text(token);
        if t.phase == Phase::Parked {
            // Its blocks went to others: it recomputes first, like a preempted sequence.
            t.phase = Phase::Waiting;
            self.waiting.push_front(id);
        } else {
            t.phase = Phase::Running;
            self.enter_running(id, arrival);
        }
        Ok(())
    }

    /// Ends a ready (or parked) sequence: its last, partly filled block enters
    /// the index (a later match copies it on write), then its locks and blocks
    /// are released (its blocks stay cached).
    pub fn finish(&mut self, id: RequestId) -> Result<()> {
        let t = self.requests.get(&id).ok_or(SchedError::UnknownRequest { id })?;
        if !matches!(t.phase, Phase::Ready | Phase::Parked) {
            return Err(SchedError::RequestNotFinished {
                id,
                computed: t.num_computed,
                len: t.req.prompt.len(),
            }
            .into());
        }
        // Full blocks a pinned copy-on-write source held back, if it is gone now.
        self.commit_full_blocks(id)?;
        self.commit_partial_tail(id)?;
        self.remove(id)
    }

    /// Drops a request in any phase; its partly written blocks go back to the
    /// free list, never into the index. A batch already handed out that holds
    /// it may still be completed (its share is ignored).
    pub fn abort(&mut self, id: RequestId) -> Result<()> {
        let t = self.requests.get(&id).ok_or(SchedError::UnknownRequest { id })?;
        if t.in_flight.is_some() {
            self.aborted_in_flight.insert(id);
        }
        self.remove(id)
    }

    /// Gives up to `max_blocks` cached blocks that no request reads back to
    /// the free list (least recently used first), e.g. to shrink the cache
    /// or drop a tenant's data; returns how many were freed. Blocks pinned by
    /// running requests are never taken.
    pub fn evict(&mut self, max_blocks: usize) -> Result<usize> {
        let evicted = self.index.evict(max_blocks);
        self.stats.evicted_blocks += evicted.len() as u64;
        self.reclaim_released(&evicted)?;
        Ok(evicted.len())
    }

    /// Puts `id` into the running list at its admission order (oldest first:
    /// preemption takes the newest, so a resumed old sequence keeps its rank).
    pub(super) fn enter_running(&mut self, id: RequestId, arrival: u64) {
        let requests = &self.requests;
        let at = self.running.partition_point(|r| requests.get(r).is_some_and(|t| t.arrival < arrival));
        self.running.insert(at, id);
    }

    /// Unpins and frees everything a request holds and forgets it.
    pub(super) fn remove(&mut self, id: RequestId) -> Result<()> {
        self.release_cache_state(id)?;
        self.waiting.retain(|&r| r != id);
        self.running.retain(|&r| r != id);
        self.requests.remove(&id);
        Ok(())
    }

    /// Gives up a request's index lock and private blocks.
    pub(super) fn release_cache_state(&mut self, id: RequestId) -> Result<()> {
        // A run still being read for it would land in blocks it no longer holds.
        self.tier_forget_load(id);
        let t = self.requests.get_mut(&id).ok_or(SchedError::UnknownRequest { id })?;
        if let Some(m) = t.lock.take() {
            self.index.unlock(&m);
        }
        for &b in &t.block_table[t.num_shared..] {
            self.pool.release(b)?;
        }
        t.block_table.clear();
        t.num_shared = 0;
        Ok(())
    }
}
