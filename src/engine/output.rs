//! What the engine hands back: per step [`Event`]s (a sampled token with its
//! hidden rows, or a finished request), and per request one [`Output`].

use std::time::Duration;

use ndarray::Array2;

use crate::batch::RequestId;
use crate::model::CaptureName;
use crate::prompt::Positions;
use crate::sample::FinishReason;
use crate::speech::Speech;

/// What a finished request returns, prefill or generation alike (a prefill
/// simply has no tokens).
#[derive(Debug, Clone)]
pub struct Output {
    pub request: RequestId,
    /// Generated ids, in order (a stop id that ended it included); empty for a prefill.
    pub tokens: Vec<u32>,
    /// Why a generation ended; `None` for a prefill.
    pub finish_reason: Option<FinishReason>,
    /// The sampler's seed (the one given, or the one drawn); `None` for a prefill.
    pub seed: Option<u64>,
    /// Each captured point's hidden states of every position that ran through
    /// the model, cached ones included, in capture order: `[prompt_len, hidden]`
    /// for a prefill, `[prompt_len + tokens.len() - 1, hidden]` for a generation
    /// (one more row when [`run_last_token`](crate::sample::SamplingParams::run_last_token)
    /// ran the last token too).
    pub hidden: Vec<(CaptureName, Array2<f32>)>,
    /// Logits `[vocab]` of the last position that ran (the prompt's last for a prefill).
    pub last_logits: Vec<f32>,
    /// Leading prompt positions whose KV came from the cache (not recomputed).
    pub num_cached_tokens: usize,
    /// Length of the expanded prompt.
    pub prompt_len: usize,
    /// Position ids of the prompt positions that ran (`num_cached_tokens..prompt_len`):
    /// the prompt's positions cut by [`Positions::slice`], as every chunk's were.
    pub computed_positions: Positions,
    pub timings: Timings,
    /// The spoken reply, for a request that asked for audio
    /// ([`Request::speak`](super::Request::speak)).
    pub speech: Option<Speech>,
}

impl Output {
    /// The hidden states captured at `name`, if captured.
    pub fn hidden_at(&self, name: CaptureName) -> Option<&Array2<f32>> {
        self.hidden.iter().find(|(n, _)| *n == name).map(|(_, h)| h)
    }
}

/// Where one request's time went, measured from the start of its preparation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timings {
    /// Preparation: fingerprinting items, the canonical prompt, the encoder calls.
    pub preprocess: Duration,
    /// Scheduler calls (match, allocate, commit) of the steps the request was in,
    /// with the disk tier's reads and page copies before each batch.
    pub schedule: Duration,
    /// Runner steps the request was in (shared with the requests batched with it).
    pub forward: Duration,
    /// To the first sampled token (a generation) or to the output (a prefill).
    pub ttft: Duration,
    /// To each sampled token (empty for a prefill).
    pub token_times: Vec<Duration>,
    /// To the first audio sample, for a request that asked for audio.
    pub ttfa: Option<Duration>,
    /// To the end.
    pub total: Duration,
}

impl Timings {
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
    /// Set on the request's last token, with why it stopped: a reader can end
    /// a reply here, before the `Finished` event (which may come a step later,
    /// with `run_last_token`), without restating the engine's stop rule.
    pub finish_reason: Option<FinishReason>,
}

/// A chunk of a spoken reply, final as soon as it is made: the chunks of a
/// request, in order, are its [`Speech::audio`].
#[derive(Debug, Clone, PartialEq)]
pub struct AudioEvent {
    pub request: RequestId,
    /// Index of the chunk's first sample in the reply's audio.
    pub offset: usize,
    /// Mono samples at `sample_rate`.
    pub samples: Vec<f32>,
    /// Samples a second (code2wav's, 24 kHz in the release): what a player of
    /// the chunks needs before the reply's `Speech` comes.
    pub sample_rate: u32,
}

/// What one engine step produced for one request.
#[derive(Debug, Clone)]
#[expect(
    clippy::large_enum_variant,
    reason = "Finished comes once a request, and callers match and move its Output; a Box would be in every caller's patterns"
)]
pub enum Event {
    /// A generating request sampled a token.
    Token(TokenEvent),
    /// A speaking request made audio.
    Audio(AudioEvent),
    /// A request finished; its last event.
    Finished(Output),
}

impl Event {
    /// The request the event belongs to.
    pub fn request(&self) -> RequestId {
        match self {
            Event::Token(t) => t.request,
            Event::Audio(a) => a.request,
            Event::Finished(o) => o.request,
        }
    }
}

/// The last row of each captured array: the row of the position that just ran.
pub(super) fn last_rows(hidden: &[(CaptureName, Array2<f32>)]) -> Vec<(CaptureName, Vec<f32>)> {
    hidden.iter().filter_map(|(name, h)| Some((*name, h.rows().into_iter().next_back()?.to_vec()))).collect()
}
