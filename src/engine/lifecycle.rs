//! The core's request lifecycle: prepare → submit (admission against the
//! pool) → steps (schedule → run → complete → sample) → one [`Output`];
//! abort at any point.

use std::sync::Arc;
use std::time::Instant;

use super::Engine;
use super::generation::{Decoding, Next};
use super::output::{Event, Output, Timings, TokenEvent, last_rows};
use super::prepare::{Prepared, Preparer};
use super::request::Request;
use crate::backend::Backend;
use crate::batch::{RequestId, ScheduledBatch};
use crate::error::{Component, Error, Result, SchedError};
use crate::prompt::Positions;
use crate::runner::SeqOutput;
use crate::sample::FinishReason;

/// A submitted request until its output is handed out.
pub(super) struct Pending {
    timings: Timings,
    started: Instant,
    /// The prompt's positions (by run): the output's are cut from them.
    positions: Positions,
    /// `None` for a prefill.
    decoding: Option<Decoding>,
    /// Cached prompt tokens of the run that completed the prompt.
    num_cached: Option<usize>,
    /// Logits of the last position that ran.
    last_logits: Vec<f32>,
    /// While held, a sampled token is kept instead of appended, so the
    /// sequence stops generating (a served engine's backpressure).
    held: bool,
    /// The token sampled while held, appended on release.
    deferred: Option<u32>,
}

impl<B: Backend> Engine<B> {
    /// Prepares `request` for [`submit_prepared`](Self::submit_prepared): fingerprints
    /// its items, builds its canonical prompt, runs every check that reads no
    /// scheduler state and calls the encoder for items that need one. Needs
    /// only `&self`; on error nothing changed.
    pub fn prepare(&self, request: Request<'_>) -> Result<Prepared> {
        self.preparer.prepare(request)
    }

    /// What preparation needs, for threads that prepare requests beside the loop.
    pub(super) fn preparer(&self) -> Arc<Preparer> {
        Arc::clone(&self.preparer)
    }

    /// Prepares and submits `request`; its events come from [`step`](Self::step).
    pub fn submit(&mut self, request: Request<'_>) -> Result<RequestId> {
        let prepared = self.prepare(request)?;
        self.submit_prepared(prepared)
    }

    /// Admits a prepared request (the id is free, it fits the pool) and
    /// caches its fresh encoder outputs; on error nothing changes, and the
    /// error names no request id (the caller gets the id only from success).
    pub fn submit_prepared(&mut self, prepared: Prepared) -> Result<RequestId> {
        let Prepared { checked, fresh, cache_hits, encoded, generate, speech, started, preprocess } =
            prepared;
        let id = checked.request().id;
        let positions = checked.request().prompt.positions.clone();
        let speech = speech.map(|s| (s, checked.request().prompt.clone()));
        self.sched.admit_checked(checked).map_err(Error::unnamed)?;
        // Admitted: only now does anything change.
        self.preparer.admitted(fresh, cache_hits, encoded);
        let eos = &self.runner.thinker().config().eos_token_ids;
        let special = crate::sample::placeholder_ids(self.preparer.tokens());
        let decoding = generate.map(|(params, seed)| Decoding::new(params, seed, eos, &special));
        let timings = Timings { preprocess, ..Default::default() };
        let pending = Pending {
            timings,
            started,
            positions,
            decoding,
            num_cached: None,
            last_logits: Vec::new(),
            held: false,
            deferred: None,
        };
        self.pending.insert(id, pending);
        if let (Some(talkers), Some((checked, prompt))) = (self.talkers.as_mut(), speech) {
            talkers.add(id, checked, prompt, started);
        }
        Ok(id)
    }

    /// Drops a submitted request at any point (waiting, prefilling or
    /// decoding): its blocks and locks go back, its partly written blocks
    /// never enter the index, and no event of it follows.
    pub fn abort(&mut self, id: RequestId) -> Result<()> {
        let talking = self.talkers.as_ref().is_some_and(|t| t.contains(id));
        let thinking = self.pending.remove(&id).is_some();
        if !thinking && !talking {
            return Err(SchedError::UnknownRequest { id }.into());
        }
        if let Some(talkers) = self.talkers.as_mut() {
            talkers.abort(id)?;
        }
        if thinking { self.sched.abort(id) } else { Ok(()) }
    }

    /// True while some submitted request has not finished.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty() || self.talkers.as_ref().is_some_and(|t| !t.is_empty())
    }

    /// True while request `id` has not finished (nor been aborted).
    pub(crate) fn is_pending(&self, id: RequestId) -> bool {
        self.pending.contains_key(&id) || self.talkers.as_ref().is_some_and(|t| t.contains(id))
    }

    /// True while a step would make progress: some request is pending and not
    /// parked by [`hold`](Self::hold) with a token waiting.
    pub(crate) fn has_runnable(&self) -> bool {
        self.thinker_runnable() || self.talkers.as_ref().is_some_and(|t| t.has_work())
    }

    /// True while a thinker step would make progress.
    fn thinker_runnable(&self) -> bool {
        self.pending.values().any(|p| p.deferred.is_none())
    }

    /// Holds (`true`) or releases a generating request: while held, the next
    /// token it samples is kept instead of appended, so it stops generating
    /// after at most one more token (its blocks stay until another request
    /// needs them: the scheduler parks it); on release that token is appended
    /// and it decodes on. Unknown ids are ignored.
    pub(crate) fn hold(&mut self, id: RequestId, held: bool) -> Result<()> {
        let Some(p) = self.pending.get_mut(&id) else { return Ok(()) };
        p.held = held;
        match p.deferred.take() {
            Some(token) if !held => self.sched.append(id, token),
            deferred => {
                p.deferred = deferred;
                Ok(())
            }
        }
    }

    /// Runs one step of the pipeline after admission (schedule → run →
    /// complete → sample → output) and returns what it produced: sampled
    /// tokens and finished requests. Empty when nothing can run. A runner
    /// failure aborts the batch's requests (their blocks go back to the pool)
    /// and is returned.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        if self.has_runnable() {
            // On a thread of rayon's pool, which the CPU kernels split their work over:
            // the caller's thread sleeps, so the step's serial parts (scheduling,
            // sampling) do not share the cores with the pool's spinning idle workers
            // (docs/engine.md, "Threads": +10-30 % decode tokens/s on 2 cores).
            rayon::scope(|_| self.step_into(&mut events))?;
        }
        Ok(events)
    }

    /// Submits `request` to an idle engine and steps until it finishes.
    /// Refused with [`SchedError::Busy`], nothing changed, while other
    /// requests are pending (their events would be lost): use
    /// [`step`](Self::step) or [`run_all`](Self::run_all) then.
    pub fn run(&mut self, request: Request<'_>) -> Result<Output> {
        if self.has_pending() {
            return Err(SchedError::Busy { pending: self.pending.len().max(1) }.into());
        }
        let id = self.submit(request)?;
        let outputs = self.run_all()?;
        outputs.into_iter().find(|o| o.request == id).ok_or_else(|| SchedError::UnknownRequest { id }.into())
    }

    /// Steps until no request can run and returns the finished requests'
    /// outputs in the order they finished (token events are dropped: each
    /// output holds its tokens and rows).
    pub fn run_all(&mut self) -> Result<Vec<Output>> {
        let mut outputs = Vec::new();
        while self.has_runnable() {
            for event in self.step()? {
                if let Event::Finished(output) = event {
                    outputs.push(output);
                }
            }
        }
        Ok(outputs)
    }

    /// One step of the pipeline after admission, its events appended to `events`.
    fn step_into(&mut self, events: &mut Vec<Event>) -> Result<()> {
        let thinker_ran = self.thinker_runnable();
        if thinker_ran {
            self.thinker_step(events)?;
        }
        let latencies = &self.latencies;
        if let Some(talkers) = self.talkers.as_mut() {
            talkers.step(events, thinker_ran, |ttfa| latencies.first_audio(ttfa))?;
        }
        Ok(())
    }

    /// The thinker's part of a step, its events appended to `events`.
    fn thinker_step(&mut self, events: &mut Vec<Event>) -> Result<()> {
        let t0 = Instant::now();
        let batch = self.sched.schedule()?;
        if batch.seqs.is_empty() {
            return Err(crate::sched::stalled(self.pending.len()).into());
        }
        if let Err(e) = self.run_tier_work() {
            self.abort_batch(&batch);
            return Err(e);
        }
        // The tier's reads (in `schedule`) and page copies count as scheduling:
        // cache work the batch waits for, not the model's.
        let schedule = t0.elapsed();
        let t1 = Instant::now();
        let outputs = match self.runner.execute_scheduled(&batch, &mut self.pages, self.item_capture.as_mut())
        {
            Ok(outputs) => outputs,
            Err(e) => {
                self.abort_batch(&batch);
                return Err(e);
            }
        };
        let forward = t1.elapsed();
        let t2 = Instant::now();
        let ready = self.sched.complete(&batch)?;
        let schedule = schedule + t2.elapsed();
        for seq in &batch.seqs {
            if let Some(p) = self.pending.get_mut(&seq.request) {
                p.timings.schedule += schedule;
                p.timings.forward += forward;
            }
        }
        for out in outputs {
            if !ready.contains(&out.request) {
                let what = format!(
                    "the runner returned outputs of request {}, which the batch did not finish",
                    out.request
                );
                return Err(Component::Engine.violation(what).into());
            }
            self.on_ready(out, events)?;
        }
        self.publish_kv_events();
        Ok(())
    }

    /// A sequence whose known tokens all ran: a prefill ends; a generation
    /// samples its next token and decodes on, or ends.
    fn on_ready(&mut self, out: SeqOutput, events: &mut Vec<Event>) -> Result<()> {
        let id = out.request;
        let Some(p) = self.pending.get_mut(&id) else { return Ok(()) };
        let num_cached = *p.num_cached.get_or_insert_with(|| self.sched.num_cached_tokens(id).unwrap_or(0));
        let elapsed = p.started.elapsed();
        let SeqOutput { hidden, last_logits, items, .. } = out;
        let Some(d) = p.decoding.as_mut() else {
            self.latencies.first_token(elapsed);
            p.last_logits = last_logits;
            self.sched.finish(id)?;
            return self.finish_output(id, num_cached, Some(hidden), None, Vec::new(), events);
        };
        d.add_rows(&hidden);
        if let Some(talkers) = self.talkers.as_mut().filter(|t| t.wants_prompt_rows(id)) {
            let accept = talkers.stage().accept_capture();
            let width = self.runner.thinker().config().hidden_size;
            // The item-position rows, or the capture's where it pages that layer.
            let rows = match (items, self.runner.capture().index_of(accept)) {
                (Some(items), None) => Some(items.dense(p.positions.len())),
                (_, c) => c.and_then(|c| d.rows(c, width)).map(|r| r.to_owned()),
            };
            if let Some(rows) = rows {
                talkers.on_prompt_rows(id, rows);
            }
        }
        let next = match d.stopping {
            // Its last token just ran (`run_last_token`).
            Some(reason) => Next::Finish(reason, None),
            None => {
                let next = d.sample(&last_logits, elapsed);
                match d.token_times[..] {
                    [first] => self.latencies.first_token(first),
                    [.., before, last] => self.latencies.inter_token(last.saturating_sub(before)),
                    [] => {}
                }
                let index = d.sampled - 1;
                let position = p.positions.len() + index - 1;
                let (Next::Continue(token) | Next::RunLast(token) | Next::Finish(_, Some(token))) = next
                else {
                    return Err(Component::Engine
                        .violation(format!("request {id}: a sample that is no token"))
                        .into());
                };
                let finish_reason = match next {
                    Next::Continue(_) => None,
                    Next::RunLast(_) => d.stopping,
                    Next::Finish(reason, _) => Some(reason),
                };
                if let Some(talkers) = self.talkers.as_mut() {
                    talkers.on_token(id, token, finish_reason.is_some());
                }
                events.push(Event::Token(TokenEvent {
                    request: id,
                    token,
                    index,
                    position,
                    hidden: last_rows(&hidden),
                    finish_reason,
                }));
                next
            }
        };
        p.last_logits = last_logits;
        match next {
            Next::Continue(token) | Next::RunLast(token) if p.held => {
                p.deferred = Some(token);
                Ok(())
            }
            Next::Continue(token) | Next::RunLast(token) => self.sched.append(id, token),
            Next::Finish(reason, last) => {
                // The reply: what the sequence grew by, and the last token if it never ran.
                let mut tokens = self.sched.generated_tokens(id).map(<[u32]>::to_vec).unwrap_or_default();
                tokens.extend(last);
                self.sched.finish(id)?;
                self.finish_output(id, num_cached, None, Some(reason), tokens, events)
            }
        }
    }

    /// A request's end: its output with what ran (positions from the prompt's,
    /// cut like every chunk's), its `tokens` (read from the scheduler's
    /// sequence before it finished), and where the time went. A prefill hands
    /// its rows in `hidden`; a generation's were gathered step by step.
    fn finish_output(
        &mut self, id: RequestId, num_cached: usize,
        hidden: Option<Vec<(crate::model::CaptureName, ndarray::Array2<f32>)>>,
        finish_reason: Option<FinishReason>, tokens: Vec<u32>, events: &mut Vec<Event>,
    ) -> Result<()> {
        let Some(mut p) = self.pending.remove(&id) else { return Ok(()) };
        let prompt_len = p.positions.len();
        let computed_positions = p.positions.slice(num_cached..prompt_len)?;
        let total = p.started.elapsed();
        let mut timings = Timings { total, ttft: total, ..p.timings };
        let (seed, hidden) = match (p.decoding.take(), hidden) {
            (Some(mut d), _) => {
                let names = self.runner.capture().points().to_vec();
                let hidden = d.take_hidden(&names, self.model_config().hidden_size)?;
                timings.ttft = d.token_times.first().copied().unwrap_or_default();
                timings.token_times = std::mem::take(&mut d.token_times);
                (Some(d.seed), hidden)
            }
            (None, hidden) => (None, hidden.unwrap_or_default()),
        };
        self.finished += 1;
        let output = Output {
            request: id,
            tokens,
            finish_reason,
            seed,
            hidden,
            last_logits: p.last_logits,
            num_cached_tokens: num_cached,
            prompt_len,
            computed_positions,
            timings,
            speech: None,
        };
        // A speaking request's output waits for its speech.
        let output = match self.talkers.as_mut() {
            Some(talkers) => talkers.on_thinker_done(output),
            None => Some(output),
        };
        events.extend(output.map(Event::Finished));
        Ok(())
    }

    fn abort_batch(&mut self, batch: &ScheduledBatch) {
        for seq in &batch.seqs {
            // The request is known to the scheduler (it was just scheduled).
            let _ = self.sched.abort(seq.request);
            self.pending.remove(&seq.request);
        }
    }
}
