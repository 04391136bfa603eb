//! The per-request decode state the engine keeps between steps: the sampler
//! and the stop rule, and the hidden rows of every position that ran. The
//! generated tokens themselves live in one place, the scheduler's sequence
//! (they are text atoms of it); only the count is kept here.

use std::time::Duration;

use ndarray::Array2;

use crate::error::{Component, Error, Result};
use crate::model::CaptureName;
use crate::sample::{FinishReason, Sampler, SamplingParams};

/// A generating request's state between steps.
#[derive(Debug)]
pub(super) struct Decoding {
    pub(super) params: SamplingParams,
    sampler: Sampler,
    pub(super) seed: u64,
    /// Stop ids in force (empty with `ignore_eos`).
    stop: Vec<u32>,
    /// Ids the sampler masks: `suppress_ids` and, unless `allow_special_ids`, the placeholders.
    suppressed: Vec<u32>,
    /// Tokens sampled so far.
    pub(super) sampled: usize,
    pub(super) token_times: Vec<Duration>,
    /// Per capture, the rows of every position that ran so far, row-major.
    rows: Vec<Vec<f32>>,
    /// Set once it stopped while its last token still runs (`run_last_token`).
    pub(super) stopping: Option<FinishReason>,
}

/// What the engine does with a ready sequence.
pub(super) enum Next {
    /// Append the token and decode on.
    Continue(u32),
    /// Append the token, run it, then finish (the reason is kept in `stopping`).
    RunLast(u32),
    /// Finish now; with the token just sampled, which never runs (not appended).
    Finish(FinishReason, Option<u32>),
}

impl Decoding {
    /// `special`: the ids a reply must not contain ([`crate::sample::placeholder_ids`]),
    /// masked unless the request allows them.
    pub(super) fn new(params: SamplingParams, seed: u64, eos: &[u32], special: &[u32]) -> Self {
        let stop = params.stop_ids(eos).to_vec();
        let suppressed = params.suppressed_ids(special);
        Decoding {
            sampler: Sampler::new(seed),
            params,
            seed,
            stop,
            suppressed,
            sampled: 0,
            token_times: Vec::new(),
            rows: Vec::new(),
            stopping: None,
        }
    }

    /// Appends the rows a step handed out (positions that ran, in order).
    pub(super) fn add_rows(&mut self, hidden: &[(CaptureName, Array2<f32>)]) {
        self.rows.resize_with(hidden.len(), Vec::new);
        for (rows, (_, h)) in self.rows.iter_mut().zip(hidden) {
            rows.extend(h.iter());
        }
    }

    /// The rows of capture `capture` (of `width` columns) of every position
    /// that ran so far, the prompt's first.
    pub(super) fn rows(&self, capture: usize, width: usize) -> Option<ndarray::ArrayView2<'_, f32>> {
        let rows = self.rows.get(capture)?;
        ndarray::ArrayView2::from_shape((rows.len() / width.max(1), width), rows).ok()
    }

    /// Samples the next token from `logits` and decides what follows.
    pub(super) fn sample(&mut self, logits: &[f32], elapsed: Duration) -> Next {
        let token = self.sampler.sample(logits, &self.params, &self.suppressed);
        self.sampled += 1;
        self.token_times.push(elapsed);
        let reason = if self.stop.contains(&token) {
            Some(FinishReason::Stop)
        } else if self.sampled >= self.params.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        match reason {
            None => Next::Continue(token),
            Some(r) if self.params.run_last_token => {
                self.stopping = Some(r);
                Next::RunLast(token)
            }
            Some(r) => Next::Finish(r, Some(token)),
        }
    }

    /// The accumulated rows as one `[positions, hidden]` array per capture.
    pub(super) fn take_hidden(
        &mut self, names: &[CaptureName], hidden: usize,
    ) -> Result<Vec<(CaptureName, Array2<f32>)>> {
        names
            .iter()
            .zip(std::mem::take(&mut self.rows))
            .map(|(&name, rows)| {
                let n = rows.len() / hidden.max(1);
                let array = Array2::from_shape_vec((n, hidden), rows)
                    .map_err(|e| Error::from(Component::Engine.violation(format!("{name} rows: {e}"))))?;
                Ok((name, array))
            })
            .collect()
    }
}
