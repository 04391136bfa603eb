//! What a generating request returns, and the per-request decode state the
//! engine keeps between steps: sampler, tokens so far, and the hidden rows of
//! every position that ran.

use std::time::Duration;

use ndarray::Array2;

use super::Output;
use crate::batch::RequestId;
use crate::error::{Component, Error, Result};
use crate::model::CaptureName;
use crate::sample::{FinishReason, Sampler, SamplingParams};

/// What a finished generation returns.
#[derive(Debug, Clone)]
pub struct Generation {
    pub request: RequestId,
    /// Generated ids, in order (a stop id that ended it included).
    pub tokens: Vec<u32>,
    /// Each captured point's hidden states of every position that ran through
    /// the model: `[prompt_len + tokens.len() - 1, hidden]` (one more row when
    /// [`SamplingParams::run_last_token`] ran the last token too), cached rows included.
    pub hidden: Vec<(CaptureName, Array2<f32>)>,
    /// Leading prompt positions whose KV came from the cache.
    pub num_cached_tokens: usize,
    /// Length of the expanded prompt.
    pub prompt_len: usize,
    pub finish_reason: FinishReason,
    /// The sampler's seed (the one given, or the one drawn for the request).
    pub seed: u64,
    pub timings: GenerationTimings,
}

impl Generation {
    /// The hidden states captured at `name`, if captured.
    pub fn hidden_at(&self, name: CaptureName) -> Option<&Array2<f32>> {
        self.hidden.iter().find(|(n, _)| *n == name).map(|(_, h)| h)
    }
}

/// Where a generation's time went, measured from `submit`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationTimings {
    /// Fingerprinting items and building the canonical prompt.
    pub preprocess: Duration,
    /// Time to first token: submit to the first sampled token.
    pub ttft: Duration,
    /// Submit to each sampled token.
    pub token_times: Vec<Duration>,
    /// Submit to the end.
    pub total: Duration,
}

impl GenerationTimings {
    /// Inter-token latencies: the gaps between consecutive tokens.
    pub fn itl(&self) -> Vec<Duration> {
        self.token_times.windows(2).map(|w| w[1].saturating_sub(w[0])).collect()
    }

    /// Generated tokens after the first per second of decoding (0 with fewer than two tokens).
    pub fn decode_tokens_per_s(&self) -> f64 {
        match (self.token_times.first(), self.token_times.last()) {
            (Some(first), Some(last)) if last > first => {
                (self.token_times.len() - 1) as f64 / (*last - *first).as_secs_f64()
            }
            _ => 0.0,
        }
    }
}

/// One sampled token as it is produced: what a talker consumes.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    pub request: RequestId,
    pub token: u32,
    /// Index among the generated tokens (0 = the first).
    pub index: usize,
    /// The position that ran and whose logits chose this token (the prompt's
    /// last position for the first token).
    pub position: usize,
    /// That position's hidden row at every captured point, in capture order.
    pub hidden: Vec<(CaptureName, Vec<f32>)>,
}

/// What one engine step produced.
#[derive(Debug, Clone)]
pub enum Event {
    /// A generating request sampled a token.
    Token(TokenEvent),
    /// A prefill request finished.
    Prefilled(Output),
    /// A generating request finished.
    Generated(Generation),
}

impl Event {
    /// The request the event belongs to.
    pub fn request(&self) -> RequestId {
        match self {
            Event::Token(t) => t.request,
            Event::Prefilled(o) => o.request,
            Event::Generated(g) => g.request,
        }
    }
}

/// A generating request's state between steps.
#[derive(Debug)]
pub(super) struct Decoding {
    pub(super) params: SamplingParams,
    sampler: Sampler,
    pub(super) seed: u64,
    /// Stop ids in force (empty with `ignore_eos`).
    stop: Vec<u32>,
    /// Ids the sampler masks (empty with `allow_special_ids`).
    suppressed: Vec<u32>,
    pub(super) tokens: Vec<u32>,
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
    /// Finish now.
    Finish(FinishReason),
}

impl Decoding {
    /// `special`: the ids a reply must not contain ([`crate::sample::placeholder_ids`]),
    /// masked unless the request allows them.
    pub(super) fn new(params: SamplingParams, seed: u64, eos: &[u32], special: &[u32]) -> Self {
        let stop = params.stop_ids(eos).to_vec();
        let suppressed = params.suppressed_ids(special).to_vec();
        Decoding {
            sampler: Sampler::new(seed),
            params,
            seed,
            stop,
            suppressed,
            tokens: Vec::new(),
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

    /// Samples the next token from `logits` and decides what follows.
    pub(super) fn sample(&mut self, logits: &[f32], elapsed: Duration) -> Next {
        let token = self.sampler.sample(logits, &self.params, &self.suppressed);
        self.tokens.push(token);
        self.token_times.push(elapsed);
        let reason = if self.stop.contains(&token) {
            Some(FinishReason::Stop)
        } else if self.tokens.len() >= self.params.max_tokens {
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
            Some(r) => Next::Finish(r),
        }
    }

    /// The accumulated rows as one `[positions, hidden]` array per capture.
    pub(super) fn take_hidden(&mut self, names: &[CaptureName], hidden: usize) -> Result<Vec<(CaptureName, Array2<f32>)>> {
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

/// The last row of each captured array: the row of the position that just ran.
pub(super) fn last_rows(hidden: &[(CaptureName, Array2<f32>)]) -> Vec<(CaptureName, Vec<f32>)> {
    hidden
        .iter()
        .filter_map(|(name, h)| Some((*name, h.rows().into_iter().next_back()?.to_vec())))
        .collect()
}
