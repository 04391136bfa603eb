//! After the runner ran a batch: advance its sequences, commit their newly
//! full blocks into the index (and, at a sequence's end, its partly filled
//! last block), give released blocks back to the pool, and reset the cache.

use fxhash::FxHashSet;

use crate::batch::{RequestId, ScheduledBatch};
use crate::error::{CacheError, Error, InvariantViolation, Result, SchedError};
use crate::index::{PrefixIndex, PrefixMatch};
use crate::kv::{BlockId, BlockPool, BlockState};
use crate::prompt::CanonicalPrompt;

use super::step::pinned_part;
use super::{Phase, Scheduler, index_broke};

impl Scheduler {
    /// Records that the runner executed `batch`: advances each request, commits
    /// its newly full blocks into the index and returns the requests that are
    /// now ready (every known token ran; the runner returned their outputs).
    /// Each must be [`append`](Self::append)ed to or [`finish`](Self::finish)ed
    /// before it runs again. A batch that is not the one handed out is
    /// rejected before anything changes.
    pub fn complete(&mut self, batch: &ScheduledBatch) -> Result<Vec<RequestId>> {
        let mut seen = FxHashSet::default();
        for seq in &batch.seqs {
            let id = seq.request;
            if !seen.insert(id) {
                return Err(SchedError::BatchMismatch {
                    id,
                    what: "occurrences in the batch",
                    expected: 1,
                    found: 2,
                }
                .into());
            }
            if self.aborted_in_flight.contains(&id) {
                continue;
            }
            let t = self.requests.get(&id).ok_or(SchedError::UnknownRequest { id })?;
            let found = seq.token_ids.len();
            match t.in_flight {
                None => {
                    return Err(
                        SchedError::BatchMismatch { id, what: "new tokens", expected: 0, found }.into()
                    );
                }
                Some(chunk) if chunk != found => {
                    return Err(
                        SchedError::BatchMismatch { id, what: "new tokens", expected: chunk, found }.into()
                    );
                }
                Some(_) if t.num_computed != seq.num_computed_tokens => {
                    return Err(SchedError::BatchMismatch {
                        id,
                        what: "num_computed_tokens",
                        expected: t.num_computed,
                        found: seq.num_computed_tokens,
                    }
                    .into());
                }
                Some(_) => {}
            }
        }
        // The batch's copies ran: copy-on-write sources need no pin any more,
        // so no partly filled cached block is locked when the commits below
        // insert (an insert may extend such a block's leaf).
        for seq in &batch.seqs {
            if !self.aborted_in_flight.contains(&seq.request) {
                self.unpin_copy_source(seq.request)?;
            }
        }
        let mut ready = Vec::new();
        for seq in &batch.seqs {
            let id = seq.request;
            if self.aborted_in_flight.remove(&id) {
                continue;
            }
            let t = self.tracked_mut(id)?;
            t.num_computed += t.in_flight.take().unwrap_or(0);
            let done = t.num_computed == t.req.prompt.len();
            if done {
                t.delivered = t.num_computed;
            }
            self.commit_full_blocks(id)?;
            if done {
                self.tracked_mut(id)?.phase = Phase::Ready;
                self.running.retain(|&r| r != id);
                ready.push(id);
            }
        }
        Ok(ready)
    }

    /// Inserts the request's full computed blocks into the index and pins
    /// what the insert reports as cached (no second match); blocks the index
    /// already had are swapped for its copies and freed.
    pub(super) fn commit_full_blocks(&mut self, id: RequestId) -> Result<()> {
        let bs = self.config.block_size;
        let t = self.requests.get_mut(&id).ok_or(SchedError::UnknownRequest { id })?;
        let n_full = t.num_computed / bs;
        if n_full <= t.num_shared {
            return Ok(());
        }
        let who = format!("request {id}");
        let table = &mut t.block_table[..];
        let Some(done) = insert_full_blocks(
            &mut *self.index,
            &mut self.pool,
            &t.req.prompt,
            table,
            t.num_shared,
            n_full,
            &who,
        )?
        else {
            // Another request's copy-on-write source is in the way; retried
            // at this request's next completion and at its finish.
            return Ok(());
        };
        if let Some(log) = self.events.as_mut() {
            log.stored(&t.req.prompt, &t.req.item_routing, bs, &mut t.block_hashes, &done.adopted_at);
        }
        if let Some(old) = t.lock.replace(done.lock) {
            self.index.unlock(&old);
        }
        t.num_shared = n_full;
        self.reclaim_released(&done.released)
    }

    /// Caches a finishing sequence's last, partly filled block: every
    /// position that ran is then reusable (the full blocks are in already).
    pub(super) fn commit_partial_tail(&mut self, id: RequestId) -> Result<()> {
        let bs = self.config.block_size;
        let t = self.requests.get_mut(&id).ok_or(SchedError::UnknownRequest { id })?;
        let n = t.num_computed;
        let n_blocks = n.div_ceil(bs);
        if n % bs == 0 || n_blocks <= t.num_shared {
            return Ok(());
        }
        let outcome = match self.index.insert_partial(&t.req.prompt, &t.block_table[..n_blocks], n) {
            // Another request's copy-on-write source is in the way: these
            // positions are not cached (the insert changed nothing).
            Err(e) if grows_pinned_partial_block(&e) => return Ok(()),
            result => result?,
        };
        let tail = t.block_table[n_blocks - 1];
        for &b in &outcome.adopted {
            if b != tail {
                return Err(adopted_unoffered(&format!("request {id}"), b).into());
            }
            self.pool.adopt_by_index(b)?;
            // The index owns it now: releasing the request must not free it.
            t.num_shared = n_blocks;
        }
        self.reclaim_released(&outcome.released)
    }

    /// Frees blocks the index gave up (evicted, or a cached partial block
    /// that a longer one superseded; no request reads them) and records the
    /// published ones as removed.
    pub(super) fn reclaim_released(&mut self, released: &[BlockId]) -> Result<()> {
        let saved = self.tier_save(released);
        self.free_to_pool(released)?;
        if let Some(log) = self.events.as_mut() {
            log.removed(released, &saved);
        }
        Ok(())
    }

    /// Returns blocks the index no longer owns to the free list.
    pub(super) fn free_to_pool(&mut self, blocks: &[BlockId]) -> Result<()> {
        for &b in blocks {
            self.pool.reclaim_evicted(b)?;
        }
        Ok(())
    }

    /// Once a step's copies ran, a request's copy-on-write source needs no
    /// pin: its lock shrinks to the shared blocks (none when it has none).
    pub(super) fn unpin_copy_source(&mut self, id: RequestId) -> Result<()> {
        let bs = self.config.block_size;
        let t = self.requests.get_mut(&id).ok_or(SchedError::UnknownRequest { id })?;
        if t.lock.as_ref().is_none_or(|m| m.blocks.len() <= t.num_shared) {
            return Ok(());
        }
        let Some(old) = t.lock.take() else { return Ok(()) };
        let kept = (t.num_shared > 0).then(|| pinned_part(old.clone(), t.num_shared * bs, bs));
        if let Some(m) = &kept {
            self.index.lock(m);
        }
        self.index.unlock(&old);
        t.lock = kept;
        Ok(())
    }

    /// Drops every cached block (an `AllBlocksCleared` event); refused with
    /// [`SchedError::CacheInUse`], nothing changed, while any request is admitted.
    /// Returns the number of blocks freed.
    pub fn reset_cache(&mut self) -> Result<usize> {
        if !self.requests.is_empty() || !self.aborted_in_flight.is_empty() {
            return Err(SchedError::CacheInUse {
                requests: self.requests.len() + self.aborted_in_flight.len(),
            }
            .into());
        }
        let evicted = self.index.evict(usize::MAX);
        self.stats.evicted_blocks += evicted.len() as u64;
        self.free_to_pool(&evicted)?;
        if let Some(log) = self.events.as_mut() {
            log.cleared();
        }
        Ok(evicted.len())
    }
}

/// Whether an insert failed only because it would grow a cached partly
/// filled block that another request pins as the copy-on-write source of a
/// batch still out (see "Several batches out" in the module docs).
fn grows_pinned_partial_block(e: &Error) -> bool {
    matches!(e, Error::Cache(CacheError::LockedPartialBlock { .. }))
}

/// What [`insert_full_blocks`] did.
pub(super) struct Inserted {
    /// The lock it took on the inserted prefix (the caller replaces its old
    /// lock by it and unlocks the old one).
    pub(super) lock: PrefixMatch,
    /// `(table index, block)` of each block the index adopted, ascending.
    pub(super) adopted_at: Vec<(usize, BlockId)>,
    /// Blocks the index gave up (superseded partial blocks): back to the free list.
    pub(super) released: Vec<BlockId>,
}

/// Commits `table[..n_full]` (the first `n_full` full blocks of `prompt`,
/// KV written; `table[..num_shared]` already index-owned) into `index`: the
/// index adopts what it did not have ([`BlockPool::adopt_by_index`]), the
/// blocks it already had replace the caller's copies in `table` (which go
/// back to `pool`), and the inserted prefix is locked without a second match.
/// `None`, with nothing changed, when the insert would grow a partly filled
/// block another lock pins (see "Several batches out"). `who` names the
/// caller in contract errors. The one commit path of the thinker's
/// [`Scheduler`] and the talker's [`TalkerCache`](super::TalkerCache).
pub(super) fn insert_full_blocks(
    index: &mut dyn PrefixIndex, pool: &mut BlockPool, prompt: &CanonicalPrompt, table: &mut [BlockId],
    num_shared: usize, n_full: usize, who: &str,
) -> Result<Option<Inserted>> {
    let bs = index.block_size();
    let outcome = match index.insert(prompt, &table[..n_full]) {
        Err(e) if grows_pinned_partial_block(&e) => return Ok(None),
        result => result?,
    };
    let m = outcome.cached;
    if m.tokens != n_full * bs || m.aligned_tokens != m.tokens || m.blocks.len() != n_full {
        let matched = m.aligned_tokens / bs;
        return Err(
            index_broke(format!("{who}: {matched} of {n_full} just inserted blocks match again")).into()
        );
    }
    let mut adopted_at = Vec::with_capacity(outcome.adopted.len());
    for &b in &outcome.adopted {
        let Some(i) = table[num_shared..n_full].iter().position(|&x| x == b) else {
            return Err(adopted_unoffered(who, b).into());
        };
        pool.adopt_by_index(b)?;
        adopted_at.push((num_shared + i, b));
    }
    adopted_at.sort_unstable();
    index.lock(&m);
    for (slot, &new) in table[num_shared..n_full].iter_mut().zip(&m.blocks[num_shared..]) {
        let old = *slot;
        if old != new {
            if matches!(pool.state(old)?, BlockState::InUse { .. }) {
                pool.release(old)?;
            }
            *slot = new;
        }
        if pool.state(new)? != BlockState::Indexed {
            return Err(
                index_broke(format!("match returned block {new}, which the index does not own")).into()
            );
        }
    }
    Ok(Some(Inserted { lock: m, adopted_at, released: outcome.released }))
}

/// An insert that adopted a block the request did not offer.
fn adopted_unoffered(who: &str, block: BlockId) -> InvariantViolation {
    index_broke(format!("insert adopted block {block}, which {who} did not offer"))
}
