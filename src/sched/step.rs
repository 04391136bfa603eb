//! Building a step: one token budget, decode tokens of running sequences
//! first, then their prefill chunks, then waiting requests (the prefill
//! tokens capped once the step carries a decode), each matched
//! against the index when it starts and given blocks (evicting, then
//! preempting the newest, when the pool runs dry).

use crate::batch::{self, BlockCopy, RequestId, ScheduledBatch};
use crate::error::{Result, SchedError};
use crate::index::{PrefixIndex, PrefixMatch};
use crate::kv::{BlockId, BlockTable};
use crate::prompt::CanonicalPrompt;

use super::{Phase, Scheduler, Tracked, index_broke};

impl Scheduler {
    /// Builds the next step within one token budget: the decode tokens of
    /// running sequences first, then their prefill chunks (both oldest first),
    /// then waiting requests in arrival order; once the step carries a decode,
    /// its prefill tokens are capped at `prefill_cap`. With a cap, a step also
    /// prefills at most one *long* prompt (more than `prefill_cap` tokens left,
    /// of a request that will decode; prefill-only requests pack as before):
    /// prompts that arrive together then start one after another instead of
    /// all in one step, so their replies do not run in lockstep and the next
    /// arrivals do not queue behind each other again (vLLM's
    /// `max_long_partial_prefills = 1`). A sequence whose blocks cannot be
    /// found waits; an empty batch means nothing can run now.
    pub fn schedule(&mut self) -> Result<ScheduledBatch> {
        // Requests whose tier reads finished prefill from what was read.
        self.tier_collect_loads(false)?;
        let mut batch = ScheduledBatch::default();
        let remaining = |t: &Tracked| t.req.prompt.len() - t.num_computed;
        let (decodes, prefills): (Vec<RequestId>, Vec<RequestId>) = self
            .running
            .iter()
            .copied()
            .filter(|id| self.requests.contains_key(id))
            .partition(|id| self.requests.get(id).is_some_and(|t| remaining(t) == 1));
        let mut budget = self.config.max_tokens_per_step;
        let mut long = LongPrefills::new(&self.config);
        self.schedule_running(&decodes, &mut budget, &mut long, &mut batch)?;
        // A step that carries decode tokens adds at most `prefill_cap` prefill tokens.
        if !batch.seqs.is_empty() {
            budget = budget.min(self.config.prefill_cap_tokens().unwrap_or(usize::MAX));
        }
        self.schedule_running(&prefills, &mut budget, &mut long, &mut batch)?;
        while let Some(&id) = self.waiting.front() {
            let emitted = batch.seqs.len();
            if budget == 0
                || emitted >= self.config.max_seqs_per_step
                || !self.start(id, budget, &mut long, &mut batch)?
            {
                break;
            }
            // A request that started loading from the tier emitted nothing yet.
            budget -= batch.seqs.get(emitted).map_or(0, |s| s.token_ids.len());
        }
        // Nothing else to run: wait for a tier read that a request waits on.
        if batch.seqs.is_empty() && self.tier_collect_loads(true)? {
            return self.schedule();
        }
        Ok(batch)
    }

    /// Emits the next chunk of each running sequence of `ids` (in order)
    /// within `budget`, taking blocks for it (preempting newer sequences when
    /// short); a sequence whose blocks cannot be found waits.
    fn schedule_running(
        &mut self, ids: &[RequestId], budget: &mut usize, long: &mut LongPrefills, batch: &mut ScheduledBatch,
    ) -> Result<()> {
        for &id in ids {
            if *budget == 0 || batch.seqs.len() >= self.config.max_seqs_per_step {
                break;
            }
            // An earlier reservation may have preempted it.
            let Some(i) = self.running.iter().position(|&r| r == id) else { continue };
            let t = self.requests.get(&id).ok_or(SchedError::UnknownRequest { id })?;
            let left = t.req.prompt.len() - t.num_computed;
            let decodes = t.req.max_new_tokens > 0;
            if t.in_flight.is_some() || self.tier_is_loading(id) || !long.admit(left, decodes) {
                continue;
            }
            let chunk = left.min(*budget);
            let need =
                (t.num_computed + chunk).div_ceil(self.config.block_size).saturating_sub(t.block_table.len());
            if let Some(fresh) = self.reserve(need, Some(i))? {
                self.tracked_mut(id)?.block_table.extend(fresh);
                self.emit(id, chunk, batch)?;
                *budget -= chunk;
            }
        }
        Ok(())
    }

    /// Matches a waiting request, pins its cached prefix, allocates its first
    /// chunk and emits it (or, with blocks in the tier, starts reading them and
    /// emits nothing yet); `false` when blocks are short or it is a second
    /// long prompt this step (it stays queued).
    pub(super) fn start(
        &mut self, id: RequestId, budget: usize, long: &mut LongPrefills, batch: &mut ScheduledBatch,
    ) -> Result<bool> {
        let bs = self.config.block_size;
        let t = self.requests.get(&id).ok_or(SchedError::UnknownRequest { id })?;
        let len = t.req.prompt.len();
        let decodes = t.req.max_new_tokens > 0;
        let m = checked_match(&mut *self.index, &t.req.prompt)?;
        // At least the last token runs, so a fully cached prompt still yields outputs.
        let usable = m.tokens.min(len - 1);
        let mut computed = if self.config.token_granular_reuse { usable } else { usable / bs * bs };
        // Index-owned blocks the request starts on; past them, blocks read from the tier.
        let mut shared = computed / bs;
        // Only looked up here (no read): a request that cannot start yet reads nothing.
        let mut planned = self.tier_probe(id, m.aligned_tokens / bs, len);
        if !planned.is_empty() {
            shared = m.aligned_tokens / bs;
            computed = ((shared + planned.len()) * bs).min(len - 1);
        }
        if !long.admit(len - computed, decodes) {
            return Ok(false);
        }
        // Pin before evicting so eviction cannot take what was just matched.
        let pinned = if planned.is_empty() { computed } else { shared * bs };
        let mut lock = (pinned > 0).then(|| pinned_part(m, pinned, bs));
        if let Some(m) = &lock {
            self.index.lock(m);
        }
        let mut whole_prompt = false;
        let fresh = loop {
            let upto = if whole_prompt { len } else { computed + (len - computed).min(budget) };
            if let Some(fresh) = self.reserve(upto.div_ceil(bs) - shared, None)? {
                break fresh;
            }
            let m = lock.take();
            if let Some(m) = &m {
                self.index.unlock(m);
            }
            // An index may pin more than the match (a whole tree node). When
            // nothing else runs, start without reuse and take every block the
            // prompt needs now, so later locks cannot starve it.
            if m.is_none() || !self.running.is_empty() {
                return Ok(false);
            }
            computed = 0;
            shared = 0;
            planned.clear();
            whole_prompt = true;
            // Alone in the step, so the long slot is free: take it if the whole prompt is long.
            long.admit(len, decodes);
        };
        if !planned.is_empty() {
            self.start_loading(id, planned, fresh, lock, shared, len)?;
            return Ok(true);
        }
        let reserved_end = (shared + fresh.len()) * bs;
        let chunk = (len - computed).min(budget).min(reserved_end - computed);
        let copy_src =
            lock.as_ref().filter(|_| computed % bs != 0).and_then(|m| m.blocks.get(shared).copied());
        if let (Some(src), Some(&dst)) = (copy_src, fresh.first()) {
            batch.copies.push(BlockCopy { src, dst });
            self.stats.block_copies += 1;
        }
        self.enter_with(id, lock, shared, fresh, computed)?;
        self.emit(id, chunk, batch)?;
        Ok(true)
    }

    /// Admits request `id` and has the reader thread read its run `planned`
    /// from the tier into the first of its `fresh` blocks: it prefills once a
    /// later [`schedule`](Self::schedule) collects the run (a file that
    /// vanished or fails its check since the lookup ends the run; those
    /// positions are computed instead, in the blocks already reserved).
    fn start_loading(
        &mut self, id: RequestId, planned: Vec<u64>, fresh: Vec<BlockId>, lock: Option<PrefixMatch>,
        shared: usize, len: usize,
    ) -> Result<()> {
        let bs = self.config.block_size;
        let into = fresh.iter().copied().take(planned.len()).collect();
        self.enter_with(id, lock, shared, fresh, shared * bs)?;
        self.tier_begin_load(id, planned, into, shared, len - shared * bs);
        Ok(())
    }

    /// Moves waiting request `id` to the running list on its `lock`ed first
    /// `shared` blocks and its `fresh` ones, `computed` tokens done; counts the query.
    fn enter_with(
        &mut self, id: RequestId, lock: Option<PrefixMatch>, shared: usize, fresh: Vec<BlockId>,
        computed: usize,
    ) -> Result<()> {
        let bs = self.config.block_size;
        let len = self.requests.get(&id).ok_or(SchedError::UnknownRequest { id })?.req.prompt.len();
        self.stats.queries += 1;
        self.stats.query_tokens += len as u64;
        if computed > 0 {
            self.stats.hits += 1;
            self.stats.hit_tokens += computed as u64;
        }
        let t = self.tracked_mut(id)?;
        t.block_table = BlockTable::new(lock.as_ref().map_or(&[][..], |m| &m.blocks[..shared]).to_vec(), bs);
        t.block_table.extend(fresh);
        t.num_shared = shared;
        t.num_computed = computed;
        t.num_cached = computed;
        t.lock = lock;
        t.phase = Phase::Running;
        let arrival = t.arrival;
        self.waiting.pop_front();
        self.enter_running(id, arrival);
        Ok(())
    }

    /// Appends request `id`'s next `chunk` tokens to the batch (blocks already
    /// allocated), cut by [`batch::chunk`] like every step.
    pub(super) fn emit(&mut self, id: RequestId, chunk: usize, batch: &mut ScheduledBatch) -> Result<()> {
        let t = self.tracked_mut(id)?;
        let range = t.num_computed..t.num_computed + chunk;
        let prompt = &t.req.prompt;
        let mut seq =
            batch::chunk(id, &prompt.token_ids, &t.embeds, &prompt.positions, t.block_table.clone(), range)?;
        seq.output_from = t.delivered;
        batch.seqs.push(seq);
        t.in_flight = Some(chunk);
        Ok(())
    }

    /// Takes `need` blocks from the pool, evicting unlocked index entries,
    /// parking ready sequences and, when `preempt_after` is given, preempting
    /// running requests newer than that position. `None` when the blocks
    /// cannot be found now.
    pub(super) fn reserve(
        &mut self, need: usize, preempt_after: Option<usize>,
    ) -> Result<Option<Vec<BlockId>>> {
        loop {
            while self.pool.num_free() < need {
                if self.evict(need - self.pool.num_free())? == 0 {
                    break;
                }
            }
            if let Some(fresh) = self.pool.allocate(need) {
                return Ok(Some(fresh));
            }
            if self.park_newest_ready()? {
                continue;
            }
            let Some(after) = preempt_after else {
                return Ok(None);
            };
            let newer = self
                .running
                .iter()
                .enumerate()
                .rev()
                .find(|&(j, id)| j > after && self.requests.get(id).is_some_and(|t| t.in_flight.is_none()))
                .map(|(j, _)| j);
            // Alone and still short: its own lock pins more than it reads (an
            // index that locks whole tree nodes). Restarting re-matches, which
            // reuses what it committed and releases the rest.
            let alone = (self.running.len() == 1).then_some(after);
            let Some(j) = newer.or(alone) else {
                return Ok(None);
            };
            let id = self.running.remove(j);
            self.release_cache_state(id)?;
            let t = self.tracked_mut(id)?;
            t.phase = Phase::Waiting;
            t.num_computed = 0;
            t.num_cached = 0;
            self.waiting.push_front(id);
            self.stats.preemptions += 1;
            if j == after {
                return Ok(None);
            }
        }
    }
    /// Parks the newest ready sequence that holds blocks: its computed
    /// positions are cached (its last, partly filled block too, as at a
    /// finish), its lock and private blocks released. `false` when none holds any.
    fn park_newest_ready(&mut self) -> Result<bool> {
        let newest = self
            .requests
            .iter()
            .filter(|(_, t)| t.phase == Phase::Ready && !t.block_table.is_empty())
            .max_by_key(|(_, t)| t.arrival)
            .map(|(&id, _)| id);
        let Some(id) = newest else { return Ok(false) };
        self.commit_full_blocks(id)?;
        self.commit_partial_tail(id)?;
        self.release_cache_state(id)?;
        let t = self.tracked_mut(id)?;
        t.phase = Phase::Parked;
        t.num_computed = 0;
        t.num_cached = 0;
        self.stats.preemptions += 1;
        Ok(true)
    }
}

/// The one long prompt a step may prefill ([`SchedulerConfig::long_prefills_per_step`](super::SchedulerConfig::long_prefills_per_step)):
/// with a cap below the budget, the prompt of a request that will decode is
/// long when it has more than `cap` tokens left to compute. Prefill-only
/// requests are never long: they do not decode in lockstep afterwards, and
/// packed into one step they share its fixed costs (the weights' read, the
/// lm_head), which serving them one a step would pay again for each.
pub(super) struct LongPrefills {
    cap: Option<usize>,
    taken: bool,
}

impl LongPrefills {
    /// The step's slot under `config`: a threshold only while
    /// [`SchedulerConfig::long_prefills_per_step`](super::SchedulerConfig::long_prefills_per_step) limits long prompts.
    fn new(config: &super::SchedulerConfig) -> Self {
        let cap = config.long_prefills_per_step().and(config.prefill_cap_tokens());
        LongPrefills { cap, taken: false }
    }

    /// Whether a prompt with `left` tokens to compute may prefill this step,
    /// taking the step's long slot when it is long; `decodes`: its request
    /// generates tokens after the prompt.
    fn admit(&mut self, left: usize, decodes: bool) -> bool {
        match self.cap {
            Some(cap) if decodes && left > cap => !std::mem::replace(&mut self.taken, true),
            _ => true,
        }
    }
}

/// `index`'s match of `prompt`, held to the [`PrefixIndex`] contract (within
/// the prompt, `ceil(tokens / block_size)` blocks, aligned tokens rounded
/// down): the one lookup of the thinker's [`Scheduler`] and the talker's
/// [`TalkerCache`](super::TalkerCache).
pub(super) fn checked_match(index: &mut dyn PrefixIndex, prompt: &CanonicalPrompt) -> Result<PrefixMatch> {
    let (bs, len) = (index.block_size(), prompt.len());
    let m = index.match_prefix(prompt);
    if m.tokens > len || m.blocks.len() != m.tokens.div_ceil(bs) || m.aligned_tokens != m.tokens / bs * bs {
        let (tokens, aligned, blocks) = (m.tokens, m.aligned_tokens, m.blocks.len());
        let what = format!(
            "match of {tokens} tokens ({aligned} aligned) with {blocks} blocks for a {len}-token prompt"
        );
        return Err(index_broke(what).into());
    }
    Ok(m)
}

/// The part of a match a request actually reads: its first `tokens` tokens.
///
/// An index that locks block by block then pins no more than the request
/// reads (+1 for a copy-on-write source), so restarts stay rare.
pub(super) fn pinned_part(m: PrefixMatch, tokens: usize, block_size: usize) -> PrefixMatch {
    debug_assert!(tokens <= m.tokens && tokens.div_ceil(block_size) <= m.blocks.len());
    let mut blocks = m.blocks;
    blocks.truncate(tokens.div_ceil(block_size));
    PrefixMatch { tokens, aligned_tokens: tokens / block_size * block_size, blocks, handle: m.handle }
}
