//! Token sampling for generation: the per-request [`SamplingParams`], their
//! admission [`check`](SamplingParams::check), and the seeded [`Sampler`] that
//! turns one row of logits into one token id.
//!
//! The filters follow Hugging Face `transformers` (`SuppressTokensLogitsProcessor`,
//! then `TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`, applied
//! in that order); the random draw is this crate's own (see [`Sampler`]), so
//! seeded runs are reproducible here, not token-for-token equal to `torch.multinomial`.
//!
//! A reply must not contain a placeholder id (image, audio or video pad): the
//! next round re-sends it as text, and the prompt builder rejects a pad outside
//! an item span. So the engine suppresses [`placeholder_ids`] unless a request
//! sets [`SamplingParams::allow_special_ids`].

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::Result;
use crate::canon::Modality;
use crate::error::RequestError;
use crate::prompt::OmniTokens;

/// How one request generates: how many tokens, how they are drawn, when it stops.
///
/// Deserializes from JSON with every field optional (missing fields take the
/// [`Default`]: 16 tokens, greedy) and unknown fields rejected, so a misspelt
/// parameter is an error rather than silently ignored:
///
/// ```
/// use omniprefix::sample::SamplingParams;
///
/// let params: SamplingParams =
///     serde_json::from_str(r#"{"max_tokens": 32, "temperature": 0.7, "top_p": 0.9, "seed": 7}"#)?;
/// assert_eq!((params.max_tokens, params.top_k, params.ignore_eos), (32, None, false));
/// params.check(1000)?;
///
/// // A prompt of 100 tokens and 32 generated ones need 100 + 32 - 1 positions:
/// // the last token is sampled but never runs (unless `run_last_token`).
/// assert_eq!(params.positions_needed(100), 131);
///
/// // Placeholder ids are masked unless `allow_special_ids`.
/// assert_eq!(params.suppressed_ids(&[502, 500, 501]), [500, 501, 502]);
/// assert!(SamplingParams { allow_special_ids: true, ..params.clone() }.suppressed_ids(&[500]).is_empty());
/// // `suppress_ids` (HF `suppress_tokens`) adds to them.
/// let banned = SamplingParams { suppress_ids: vec![7, 500], ..params.clone() };
/// assert_eq!(banned.suppressed_ids(&[500, 501]), [7, 500, 501]);
///
/// // The checkpoint's eos ids stop generation unless `stop` replaces them.
/// assert_eq!(params.stop_ids(&[2, 3]), &[2, 3]);
/// assert!(SamplingParams { ignore_eos: true, ..params }.stop_ids(&[2, 3]).is_empty());
/// assert!(serde_json::from_str::<SamplingParams>(r#"{"temprature": 0.7}"#).is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// Tokens to generate at most (the stop token, when one ends the request, included); >= 1.
    pub max_tokens: usize,
    /// Softmax temperature; 0 = greedy (argmax, lowest index on ties). Must be finite and >= 0.
    pub temperature: f32,
    /// Keep only the `k` largest logits (and any equal to the k-th); `None` = off; `Some(0)` is an error.
    pub top_k: Option<usize>,
    /// Nucleus sampling: keep the most probable tokens whose mass reaches `top_p`;
    /// `None` = 1.0 (off). Must lie in (0, 1].
    pub top_p: Option<f32>,
    /// Seed of the request's [`Sampler`]; `None` = a random seed per request (reported back).
    pub seed: Option<u64>,
    /// Token ids that end generation; `None` = the checkpoint's eos ids. Each must be below the vocab size.
    pub stop: Option<Vec<u32>>,
    /// Don't stop on stop ids: generate exactly `max_tokens` tokens.
    pub ignore_eos: bool,
    /// Also run the last sampled token through the model (its KV and hidden rows),
    /// which costs one position more.
    pub run_last_token: bool,
    /// Let the sampler draw the model's placeholder ids (image, video and audio
    /// pads, see [`placeholder_ids`]). Off by default: the engine then gives
    /// them `-inf` logits before any other filter (HF `suppress_tokens`), so a
    /// reply can be re-sent as the next round's prompt, where a pad outside an
    /// item span is rejected. Turn it on only to see the model's raw choices.
    pub allow_special_ids: bool,
    /// Ids never sampled (HF `suppress_tokens`): they get `-inf` logits before
    /// any other filter, as the placeholder ids do. Each must be below the vocab
    /// size, and at least one id must stay drawable.
    pub suppress_ids: Vec<u32>,
}

impl SamplingParams {
    /// Greedy decoding of at most `max_tokens` tokens; everything else default.
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams {
            max_tokens,
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: None,
            stop: None,
            ignore_eos: false,
            run_last_token: false,
            allow_special_ids: false,
            suppress_ids: Vec::new(),
        }
    }

    /// The positions a sequence of `prompt_len` prompt tokens occupies when it
    /// generates `max_tokens` tokens: `prompt_len + max_tokens - 1`, since the
    /// last sampled token never runs, `+ 1` when [`run_last_token`](Self::run_last_token)
    /// runs it too. Saturates instead of overflowing.
    pub fn positions_needed(&self, prompt_len: usize) -> usize {
        prompt_len.saturating_add(self.max_tokens).saturating_sub(usize::from(!self.run_last_token))
    }

    /// Checks the parameters against the model's `vocab_size` (the context is
    /// admission's: [`positions_needed`](Self::positions_needed) is what it checks).
    ///
    /// Errors, each a [`RequestError`] naming the bad field, in this order:
    /// [`InvalidSampling`](RequestError::InvalidSampling) for `max_tokens` of 0,
    /// a temperature that is negative or not finite, `top_p` outside (0, 1]
    /// (NaN included), `top_k` of `Some(0)`;
    /// [`StopIdOutOfVocab`](RequestError::StopIdOutOfVocab) for a `stop` id
    /// `>= vocab_size`; [`InvalidSampling`](RequestError::InvalidSampling) for a
    /// `suppress_ids` id `>= vocab_size` or a `suppress_ids` that bans every id.
    pub fn check(&self, vocab_size: usize) -> Result<()> {
        let invalid =
            |param, expected, found: String| RequestError::InvalidSampling { param, expected, found };
        if self.max_tokens == 0 {
            return Err(invalid("max_tokens", "at least 1", "0".into()).into());
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(invalid("temperature", "finite and >= 0", self.temperature.to_string()).into());
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Err(invalid("top_p", "in (0, 1]", p.to_string()).into());
        }
        if self.top_k == Some(0) {
            return Err(invalid("top_k", "at least 1 (or none)", "0".into()).into());
        }
        if let Some(&id) = self.stop.iter().flatten().find(|&&id| id as usize >= vocab_size) {
            return Err(RequestError::StopIdOutOfVocab { id, vocab_size }.into());
        }
        if let Some(&id) = self.suppress_ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(invalid("suppress_ids", "ids below the vocab size", id.to_string()).into());
        }
        let mut banned = self.suppress_ids.clone();
        banned.sort_unstable();
        banned.dedup();
        if banned.len() >= vocab_size {
            return Err(invalid(
                "suppress_ids",
                "at least one id left to sample",
                format!("all {vocab_size} ids"),
            )
            .into());
        }
        Ok(())
    }

    /// The stop ids in force given the checkpoint's `eos` ids: [`stop`](Self::stop)
    /// when given, else `eos`; empty when [`ignore_eos`](Self::ignore_eos).
    pub fn stop_ids<'a>(&'a self, eos: &'a [u32]) -> &'a [u32] {
        if self.ignore_eos { &[] } else { self.stop.as_deref().unwrap_or(eos) }
    }

    /// The ids the sampler masks given the model's `special` ids (what
    /// [`placeholder_ids`] returns), sorted and distinct: [`suppress_ids`](Self::suppress_ids)
    /// and `special`, the latter not with [`allow_special_ids`](Self::allow_special_ids).
    pub fn suppressed_ids(&self, special: &[u32]) -> Vec<u32> {
        let special = if self.allow_special_ids { &[][..] } else { special };
        let mut ids: Vec<u32> = self.suppress_ids.iter().chain(special).copied().collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

/// The ids a reply must not contain: the image, video and audio placeholder
/// (pad) ids of `tokens`, exactly those the prompt builder rejects as text
/// ([`RequestError::StrayPlaceholder`] from `PromptBuilder::push_text`; a
/// re-sent reply holding one takes an item it does not have). Wrapper ids
/// (`vision_start`, `audio_end`, ...) are text and stay allowed. Ids at or past
/// the vocabulary size are harmless: masking ignores them.
///
/// ```
/// use omniprefix::prompt::OmniTokens;
/// use omniprefix::sample::placeholder_ids;
///
/// assert_eq!(placeholder_ids(&OmniTokens::tiny()), [500, 501, 502]);
/// ```
pub fn placeholder_ids(tokens: &OmniTokens) -> [u32; 3] {
    [Modality::Image, Modality::Video, Modality::Audio].map(|m| tokens.pad_id(m))
}

/// Parses a list of token ids written with commas and inclusive ranges, as
/// the CLI's `--suppress-ids` takes it: `"151643-151644,151646-152063"` or
/// `"3, 7-9"` (spaces around items are ignored; an empty string is no ids).
///
/// ```
/// use omniprefix::sample::parse_id_ranges;
///
/// assert_eq!(parse_id_ranges("3, 7-9")?, [3, 7, 8, 9]);
/// assert!(parse_id_ranges("")?.is_empty());
/// assert!(parse_id_ranges("9-7").is_err());
/// # Ok::<(), omniprefix::Error>(())
/// ```
pub fn parse_id_ranges(spec: &str) -> Result<Vec<u32>> {
    let bad = |item: &str| RequestError::InvalidSampling {
        param: "suppress_ids",
        expected: "comma-separated ids or inclusive ranges LO-HI with LO <= HI",
        found: item.to_string(),
    };
    let id = |text: &str, item: &str| text.trim().parse::<u32>().map_err(|_| bad(item));
    let mut ids = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|item| !item.is_empty()) {
        match item.split_once('-') {
            Some((lo, hi)) => {
                let (lo, hi) = (id(lo, item)?, id(hi, item)?);
                if lo > hi {
                    return Err(bad(item).into());
                }
                ids.extend(lo..=hi);
            }
            None => ids.push(id(item, item)?),
        }
    }
    Ok(ids)
}

impl Default for SamplingParams {
    /// 16 tokens, greedy.
    fn default() -> Self {
        Self::greedy(16)
    }
}

/// Why a generation ended. Serializes as `"stop"` / `"length"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// A stop id was generated (it is the last generated token).
    Stop,
    /// `max_tokens` tokens were generated (or the request could not grow further).
    Length,
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        })
    }
}

/// A fresh random seed, for a request that did not bring one (report it back so
/// the run can be repeated).
pub fn random_seed() -> u64 {
    rand::rng().random()
}

/// One request's token sampler: a seeded random stream and the filters of
/// [`SamplingParams`].
///
/// The stream is ChaCha8 (`rand_chacha::ChaCha8Rng`, a named, stable algorithm:
/// the same seed gives the same stream on every platform and version of this
/// crate), keyed by `SeedableRng::seed_from_u64(seed)`. Each sampled token
/// (temperature > 0) takes exactly one draw, a `f64` in [0, 1) (the top 53 bits
/// of one `u64`, times 2^-53), whatever the filters keep; greedy tokens take
/// none. So a sampler kept with its request continues the same stream after a
/// preemption, and a run repeats given its seed, logits and parameters.
///
/// Every token, greedy or sampled, first masks the `suppressed` ids given to
/// [`sample`](Sampler::sample) (HF `SuppressTokensLogitsProcessor`, which
/// `generate` runs before the warpers): their logits count as `-inf`; ids at or
/// past the row's length are ignored. Greedy is then the argmax.
///
/// Sampling a token (temperature > 0), in this order:
/// 1. NaN and suppressed logits count as `-inf`; each logit is divided by the temperature (in `f32`, as HF).
/// 2. top-k (HF `TopKLogitsWarper`): logits below the k-th largest are removed,
///    so ties with the k-th are kept; `k` above the vocab size keeps everything.
/// 3. softmax in `f64`, with the maximum subtracted. When some logits are `+inf`
///    (an overflowing division), they share the mass equally and the rest get none.
/// 4. top-p (HF `TopPLogitsWarper`): tokens sorted by ascending probability
///    (ties by ascending index), cumulative sums formed, tokens whose cumulative
///    probability is `<= 1 - top_p` removed; the most probable token always stays.
/// 5. the draw `u` picks the first token, in ascending token-id order, at which
///    the cumulative kept mass exceeds `u` times the total kept mass.
///
/// Nothing left to choose from (every logit NaN, `-inf` or suppressed, or none
/// at all): the lowest id that is not suppressed, in both modes (token 0 when
/// nothing is suppressed; 0 as well when every id is). HF would return 0 when
/// greedy and fail when sampling; a suppressed id is never the fallback while
/// any other id exists, so a reply stays re-sendable.
///
/// ```
/// use omniprefix::sample::{Sampler, SamplingParams};
///
/// let logits = [0.5, 2.0, -1.0, 2.0];
/// // Greedy: the first of the largest logits, no randomness used.
/// assert_eq!(Sampler::new(0).sample(&logits, &SamplingParams::greedy(8), &[]), 1);
/// // Suppressed ids are never drawn: the next best wins.
/// assert_eq!(Sampler::new(0).sample(&logits, &SamplingParams::greedy(8), &[1]), 3);
/// assert_eq!(Sampler::new(0).sample(&logits, &SamplingParams::greedy(8), &[1, 3]), 0);
///
/// // Seeded sampling repeats exactly.
/// let params = SamplingParams { temperature: 0.8, top_k: Some(3), seed: Some(42), ..Default::default() };
/// let draw = |seed, suppressed: &[u32]| {
///     let mut sampler = Sampler::new(seed);
///     (0..20).map(|_| sampler.sample(&logits, &params, suppressed)).collect::<Vec<u32>>()
/// };
/// assert_eq!(draw(42, &[]), draw(42, &[]));
/// assert!(draw(42, &[]).iter().all(|&t| t != 2)); // top-k 3 removed the smallest logit
/// assert!(draw(42, &[1, 3]).iter().all(|&t| t != 1 && t != 3));
/// ```
#[derive(Debug, Clone)]
pub struct Sampler {
    rng: ChaCha8Rng,
}

impl Sampler {
    /// A sampler whose stream is ChaCha8 seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Sampler { rng: ChaCha8Rng::seed_from_u64(seed) }
    }

    /// The next token for one row of `logits` (one per vocab id) under
    /// `params`, never one of `suppressed` while another id exists (the engine
    /// passes [`SamplingParams::suppressed_ids`] of [`placeholder_ids`]).
    /// Never panics: NaN logits count as `-inf` (see [`Sampler`]).
    pub fn sample(&mut self, logits: &[f32], params: &SamplingParams, suppressed: &[u32]) -> u32 {
        if params.temperature == 0.0 {
            return argmax(logits, suppressed).unwrap_or_else(|| fallback(logits.len(), suppressed));
        }
        // The draw comes first, so every sampled token takes exactly one.
        let u: f64 = self.rng.random();
        let probs = filtered_probs(logits, params, suppressed);
        pick(&probs, u).unwrap_or_else(|| fallback(logits.len(), suppressed))
    }
}

/// The token when nothing is left to choose from: the lowest id of `0..len`
/// not in `suppressed`; 0 when there is none.
fn fallback(len: usize, suppressed: &[u32]) -> u32 {
    let banned = Banned::new(suppressed);
    (0..len as u32).find(|&id| !banned.contains(id)).unwrap_or(0)
}

/// A set of suppressed ids that answers `contains` in `O(log n)`, so a long
/// `suppress_ids` list (a whole special range) costs little per logit.
struct Banned(Vec<u32>);

impl Banned {
    fn new(ids: &[u32]) -> Self {
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        Banned(ids)
    }

    fn contains(&self, id: u32) -> bool {
        self.0.binary_search(&id).is_ok()
    }
}

/// NaN as `-inf`.
fn clean(x: f32) -> f32 {
    if x.is_nan() { f32::NEG_INFINITY } else { x }
}

/// The first index of the largest logit (NaN and `suppressed` ids = `-inf`);
/// `None` when all are `-inf` or there are none.
fn argmax(logits: &[f32], suppressed: &[u32]) -> Option<u32> {
    let first = |skip: Option<&Banned>| {
        let mut best = None;
        let mut value = f32::NEG_INFINITY;
        for (i, &x) in logits.iter().enumerate() {
            let x = clean(x);
            if x > value && !skip.is_some_and(|s| s.contains(i as u32)) {
                best = Some(i as u32);
                value = x;
            }
        }
        best
    };
    // Masking only lowers logits, so an unmasked argmax that is not suppressed
    // stays the first of the largest: scan with the mask only when it matters.
    match first(None) {
        Some(best) if suppressed.contains(&best) => first(Some(&Banned::new(suppressed))),
        best => best,
    }
}

/// Logits as the filters see them: NaN and `suppressed` ids as `-inf`
/// (HF `SuppressTokensLogitsProcessor`), then divided by the temperature.
fn scaled_logits(logits: &[f32], t: f32, suppressed: &[u32]) -> Vec<f32> {
    let mut scaled: Vec<f32> = logits.iter().map(|&x| clean(x)).collect();
    for &id in suppressed {
        if let Some(x) = scaled.get_mut(id as usize) {
            *x = f32::NEG_INFINITY;
        }
    }
    scaled.iter_mut().for_each(|x| *x /= t);
    scaled
}

/// The probabilities after the mask, temperature, top-k, softmax and top-p,
/// unnormalized after top-p (removed tokens are 0); all zero when no logit is
/// finite or `+inf`.
fn filtered_probs(logits: &[f32], params: &SamplingParams, suppressed: &[u32]) -> Vec<f64> {
    let mut scaled = scaled_logits(logits, params.temperature, suppressed);
    if let Some(k) = params.top_k.filter(|&k| k < scaled.len()) {
        let mut sorted = scaled.clone();
        // No NaN is left, so the comparison is total.
        let k = k.max(1);
        let (_, kth, _) = sorted
            .select_nth_unstable_by(k - 1, |a, b| b.partial_cmp(a).unwrap_or(std::cmp::Ordering::Equal));
        let kth = *kth;
        for x in &mut scaled {
            if *x < kth {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    let max = scaled.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<f64> = if max == f32::INFINITY {
        scaled.iter().map(|&x| if x == f32::INFINITY { 1.0 } else { 0.0 }).collect()
    } else if max == f32::NEG_INFINITY {
        return vec![0.0; scaled.len()];
    } else {
        let max = f64::from(max);
        scaled.iter().map(|&x| (f64::from(x) - max).exp()).collect()
    };
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if let Some(top_p) = params.top_p.filter(|&p| p < 1.0) {
        let mut order: Vec<usize> = (0..probs.len()).collect();
        // Stable: equal probabilities stay in ascending index order.
        order.sort_by(|&a, &b| probs[a].partial_cmp(&probs[b]).unwrap_or(std::cmp::Ordering::Equal));
        let cut = 1.0 - f64::from(top_p);
        let mut cumulative = 0.0;
        // The last (most probable) token always stays.
        for &i in &order[..order.len().saturating_sub(1)] {
            cumulative += probs[i];
            if cumulative <= cut {
                probs[i] = 0.0;
            }
        }
    }
    probs
}

/// The first index at which the cumulative mass exceeds `u` times the total;
/// the last positive one when rounding leaves none; `None` when all are zero.
fn pick(probs: &[f64], u: f64) -> Option<u32> {
    let total: f64 = probs.iter().sum();
    if total <= 0.0 || !total.is_finite() {
        return None;
    }
    let target = u * total;
    let mut cumulative = 0.0;
    let mut last = None;
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            cumulative += p;
            last = Some(i as u32);
            if cumulative > target {
                return last;
            }
        }
    }
    last
}

/// HF `RepetitionPenaltyLogitsProcessor` on one row of logits, before any other
/// filter: each distinct id of `previous` (ids past the row ignored) has its logit
/// multiplied by `penalty` when negative, divided by it otherwise (in f32, as torch).
/// The talker applies it over the codes it generated (HF `generate` given only
/// `inputs_embeds` starts with no `input_ids`, so the prompt is not penalised).
///
/// ```
/// use omniprefix::sample::apply_repetition_penalty;
/// let mut logits = [2.0f32, -1.0, 0.5];
/// apply_repetition_penalty(&mut logits, &[0, 1, 0, 9], 2.0);
/// assert_eq!(logits, [1.0, -2.0, 0.5]);
/// ```
pub fn apply_repetition_penalty(logits: &mut [f32], previous: &[u32], penalty: f32) {
    let mut seen = vec![false; logits.len()];
    for &id in previous {
        let id = id as usize;
        let (Some(x), Some(seen)) = (logits.get_mut(id), seen.get_mut(id)) else { continue };
        if std::mem::replace(seen, true) {
            continue;
        }
        *x = if *x < 0.0 { *x * penalty } else { *x / penalty };
    }
}

/// How the talker draws its codes: HF `Qwen3OmniMoeForConditionalGeneration.generate`'s
/// `talker_*` arguments (defaults equal HF's), and the code predictor's draw.
///
/// A temperature of 0 is greedy (HF `talker_do_sample=False`): the repetition
/// penalty and the suppressed ids still apply, and the code predictor is greedy
/// too. Sampling (temperature > 0) draws the predictor's codes with
/// `predictor_top_k` / `predictor_top_p` at `predictor_temperature` (HF: 50, 0.8, 1.0).
///
/// ```
/// use omniprefix::sample::TalkerSampling;
/// let greedy = TalkerSampling { temperature: 0.0, ..TalkerSampling::default() };
/// greedy.check()?;
/// assert_eq!(greedy.talker_params().temperature, 0.0);
/// let bad = TalkerSampling { repetition_penalty: 0.0, ..TalkerSampling::default() };
/// assert!(bad.check().unwrap_err().to_string().contains("repetition_penalty"));
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TalkerSampling {
    /// Softmax temperature of the talker's first code; 0 = greedy. Finite and >= 0.
    pub temperature: f32,
    /// Keep the `k` largest logits; 0 = off (HF).
    pub top_k: usize,
    /// Nucleus mass in (0, 1]; 1 = off.
    pub top_p: f32,
    /// HF `repetition_penalty` over the generated first codes; finite and > 0 (1 = off).
    pub repetition_penalty: f32,
    /// Codes the talker samples at most (the final one, EOS or not, gets no frame): >= 1.
    pub max_new_tokens: usize,
    /// Seed of the talker's and the code predictor's samplers.
    pub seed: u64,
    /// The code predictor's temperature when sampling; finite and > 0.
    pub predictor_temperature: f32,
    /// The code predictor's top-k when sampling; 0 = off.
    pub predictor_top_k: usize,
    /// The code predictor's top-p when sampling, in (0, 1].
    pub predictor_top_p: f32,
}

impl Default for TalkerSampling {
    /// HF's talker defaults: temperature 0.9, top-k 50, top-p 1.0, penalty 1.05, 4096 codes.
    fn default() -> Self {
        TalkerSampling {
            temperature: 0.9,
            top_k: 50,
            top_p: 1.0,
            repetition_penalty: 1.05,
            max_new_tokens: 4096,
            seed: 0,
            predictor_temperature: 1.0,
            predictor_top_k: 50,
            predictor_top_p: 0.8,
        }
    }
}

impl TalkerSampling {
    /// HF's greedy talker (`talker_do_sample=False`): every default but the temperature.
    pub fn greedy() -> Self {
        TalkerSampling { temperature: 0.0, ..Self::default() }
    }

    /// Checks every field; the error is [`RequestError::InvalidSampling`] naming the first bad one.
    pub fn check(&self) -> Result<()> {
        let invalid = |param, expected, found: String| {
            Err(RequestError::InvalidSampling { param, expected, found }.into())
        };
        let positive = |x: f32| x.is_finite() && x > 0.0;
        let unit = |p: f32| p > 0.0 && p <= 1.0;
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return invalid("temperature", "finite and >= 0", self.temperature.to_string());
        }
        if !unit(self.top_p) {
            return invalid("top_p", "in (0, 1]", self.top_p.to_string());
        }
        if !positive(self.repetition_penalty) {
            return invalid("repetition_penalty", "finite and > 0", self.repetition_penalty.to_string());
        }
        if self.max_new_tokens == 0 {
            return invalid("max_new_tokens", "at least 1", "0".into());
        }
        if !positive(self.predictor_temperature) {
            return invalid(
                "predictor_temperature",
                "finite and > 0",
                self.predictor_temperature.to_string(),
            );
        }
        if !unit(self.predictor_top_p) {
            return invalid("predictor_top_p", "in (0, 1]", self.predictor_top_p.to_string());
        }
        Ok(())
    }

    /// The [`Sampler`] filters of the talker's first code.
    pub fn talker_params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: (self.top_k > 0).then_some(self.top_k),
            top_p: Some(self.top_p),
            ..SamplingParams::greedy(self.max_new_tokens)
        }
    }

    /// The [`Sampler`] filters of the code predictor's codes: greedy when the talker is.
    pub fn predictor_params(&self) -> SamplingParams {
        let temperature = if self.temperature == 0.0 { 0.0 } else { self.predictor_temperature };
        SamplingParams {
            temperature,
            top_k: (self.predictor_top_k > 0).then_some(self.predictor_top_k),
            top_p: Some(self.predictor_top_p),
            ..SamplingParams::greedy(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    fn sampled(temperature: f32) -> SamplingParams {
        SamplingParams { temperature, ..SamplingParams::default() }
    }

    fn draws(seed: u64, logits: &[f32], params: &SamplingParams, n: usize) -> Vec<u32> {
        let mut sampler = Sampler::new(seed);
        (0..n).map(|_| sampler.sample(logits, params, &[])).collect()
    }

    /// A row of logits with distinct values, from a seeded stream.
    fn random_logits(seed: u64, n: usize) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-4.0f32..4.0)).collect()
    }

    #[test]
    fn repetition_penalty_matches_the_hf_oracle() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let logits: Vec<f32> = (0..40).map(|_| rng.random_range(-3.0f32..3.0)).collect();
        let previous: Vec<u32> = (0..30).map(|_| rng.random_range(0..45u32)).collect();
        let mut got = logits.clone();
        apply_repetition_penalty(&mut got, &previous, 1.05);
        // HF: gather the previous ids' scores, penalise, scatter (duplicates write the same value).
        let mut want = logits.clone();
        for &id in &previous {
            if let Some(&x) = logits.get(id as usize) {
                want[id as usize] = if x < 0.0 { x * 1.05 } else { x / 1.05 };
            }
        }
        assert_eq!(got, want);
        assert!(got.iter().zip(&logits).any(|(a, b)| a != b));
        let mut unchanged = logits.clone();
        apply_repetition_penalty(&mut unchanged, &[], 1.05);
        assert_eq!(unchanged, logits);
    }

    #[test]
    fn talker_sampling_checks_name_the_field_and_greedy_reaches_the_predictor() {
        assert!(TalkerSampling::default().check().is_ok());
        let d = TalkerSampling::default();
        let cases = [
            (TalkerSampling { temperature: -0.1, ..d.clone() }, "temperature"),
            (TalkerSampling { temperature: f32::NAN, ..d.clone() }, "temperature"),
            (TalkerSampling { top_p: 0.0, ..d.clone() }, "top_p"),
            (TalkerSampling { repetition_penalty: f32::INFINITY, ..d.clone() }, "repetition_penalty"),
            (TalkerSampling { max_new_tokens: 0, ..d.clone() }, "max_new_tokens"),
            (TalkerSampling { predictor_temperature: 0.0, ..d.clone() }, "predictor_temperature"),
            (TalkerSampling { predictor_top_p: 1.5, ..d.clone() }, "predictor_top_p"),
        ];
        for (s, field) in cases {
            assert!(
                matches!(s.check(), Err(Error::Request(RequestError::InvalidSampling { param, .. })) if param == field),
                "{field}"
            );
        }
        assert_eq!(TalkerSampling::greedy().predictor_params().temperature, 0.0);
        let sampled = d.predictor_params();
        assert_eq!((sampled.temperature, sampled.top_k, sampled.top_p), (1.0, Some(50), Some(0.8)));
        let t = d.talker_params();
        assert_eq!((t.temperature, t.top_k, t.top_p), (0.9, Some(50), Some(1.0)));
    }

    #[test]
    fn greedy_is_argmax_with_the_first_of_ties() {
        let greedy = SamplingParams::greedy(4);
        let mut s = Sampler::new(1);
        assert_eq!(s.sample(&[0.1, 3.0, -2.0, 3.0, 2.9], &greedy, &[]), 1);
        assert_eq!(s.sample(&[5.0, 5.0], &greedy, &[]), 0);
        assert_eq!(s.sample(&[-1.0, -0.5, -0.5], &greedy, &[]), 1);
        assert_eq!(s.sample(&[f32::NAN, 1.0, f32::NAN, 2.0], &greedy, &[]), 3);
        assert_eq!(s.sample(&[f32::NEG_INFINITY, f32::INFINITY, f32::INFINITY], &greedy, &[]), 1);
        assert_eq!(s.sample(&[f32::NAN, f32::NAN], &greedy, &[]), 0);
        assert_eq!(s.sample(&[f32::NEG_INFINITY; 3], &greedy, &[]), 0);
        assert_eq!(s.sample(&[], &greedy, &[]), 0);
        // Greedy draws nothing: the stream is where a fresh sampler's is.
        let params = sampled(1.0);
        let logits = random_logits(3, 50);
        assert_eq!(draws(1, &logits, &params, 1)[0], s.sample(&logits, &params, &[]));
    }

    #[test]
    fn same_seed_same_tokens_different_seeds_differ() {
        let logits = random_logits(5, 100);
        let params = SamplingParams { top_k: Some(50), top_p: Some(0.95), ..sampled(1.3) };
        let a = draws(7, &logits, &params, 200);
        assert_eq!(a, draws(7, &logits, &params, 200));
        assert_ne!(a, draws(8, &logits, &params, 200));
        // Not stuck on one token either.
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 10);
    }

    #[test]
    fn one_draw_per_sampled_token_whatever_the_filters_keep() {
        let logits = random_logits(9, 64);
        let wide = sampled(1.0);
        let narrow = SamplingParams { top_k: Some(1), ..sampled(1.0) };
        // Interleaving a top-1 (fully determined) token shifts the stream by one draw.
        let mut s = Sampler::new(11);
        s.sample(&logits, &narrow, &[]);
        let after: Vec<u32> = (0..20).map(|_| s.sample(&logits, &wide, &[])).collect();
        assert_eq!(after, draws(11, &logits, &wide, 21)[1..]);
        // So does an all-NaN row.
        let mut s = Sampler::new(11);
        assert_eq!(s.sample(&[f32::NAN; 8], &wide, &[]), 0);
        assert_eq!((0..20).map(|_| s.sample(&logits, &wide, &[])).collect::<Vec<_>>(), after);
    }

    #[test]
    fn top_k_1_and_tiny_top_p_are_greedy_at_any_temperature() {
        for seed in 0..20 {
            let logits = random_logits(seed, 300);
            let best = argmax(&logits, &[]).unwrap_or(0);
            for t in [0.01, 0.5, 1.0, 3.0, 100.0] {
                let top1 = SamplingParams { top_k: Some(1), ..sampled(t) };
                assert!(draws(seed, &logits, &top1, 20).iter().all(|&x| x == best), "top_k 1, t {t}");
                let tiny_p = SamplingParams { top_p: Some(1e-6), ..sampled(t) };
                assert!(draws(seed, &logits, &tiny_p, 20).iter().all(|&x| x == best), "top_p 1e-6, t {t}");
            }
        }
    }

    #[test]
    fn frequencies_follow_the_softmax() {
        let logits = [1.0f32, 0.0, 2.0, -1.0, 0.5];
        let t = 0.8f64;
        let weights: Vec<f64> = logits.iter().map(|&x| (f64::from(x) / t).exp()).collect();
        let total: f64 = weights.iter().sum();
        let n = 10_000;
        let mut counts = [0usize; 5];
        for token in draws(2024, &logits, &sampled(0.8), n) {
            counts[token as usize] += 1;
        }
        let chi2: f64 = counts
            .iter()
            .zip(&weights)
            .map(|(&c, &w)| {
                let expected = n as f64 * w / total;
                (c as f64 - expected).powi(2) / expected
            })
            .sum();
        // 4 degrees of freedom: P(chi2 > 18.5) = 0.001.
        assert!(chi2 < 18.5, "chi2 {chi2}, counts {counts:?}");
        // A sampler that ignored the temperature (t = 1) would be far off.
        let at_one: Vec<f64> = logits.iter().map(|&x| f64::from(x).exp()).collect();
        let total_one: f64 = at_one.iter().sum();
        let chi2_one: f64 = counts
            .iter()
            .zip(&at_one)
            .map(|(&c, &w)| (c as f64 - n as f64 * w / total_one).powi(2) / (n as f64 * w / total_one))
            .sum();
        assert!(chi2_one > 50.0, "chi2 against t = 1: {chi2_one}");
    }

    fn kept(probs: &[f64]) -> Vec<usize> {
        probs.iter().enumerate().filter(|(_, p)| **p > 0.0).map(|(i, _)| i).collect()
    }

    #[test]
    fn top_k_and_top_p_masks_match_hand_computed_examples() {
        let logits = [1.0f32, 2.0, 3.0, 3.0, 0.0];
        let k = |k| filtered_probs(&logits, &SamplingParams { top_k: Some(k), ..sampled(1.0) }, &[]);
        // The 3rd largest is 2.0: keep 2.0, 3.0, 3.0.
        assert_eq!(kept(&k(3)), vec![1, 2, 3]);
        // The 2nd largest is 3.0: keep both 3.0s; and k = 1 keeps them too (ties with the k-th).
        assert_eq!(kept(&k(2)), vec![2, 3]);
        assert_eq!(kept(&k(1)), vec![2, 3]);
        assert_eq!(kept(&k(5)), vec![0, 1, 2, 3, 4]);
        assert_eq!(kept(&k(99)), vec![0, 1, 2, 3, 4]);
        let p3 = k(3);
        let e = [(-1.0f64).exp(), 1.0, 1.0];
        let z: f64 = e.iter().sum();
        for (i, want) in [(1, e[0] / z), (2, 1.0 / z), (3, 1.0 / z)] {
            assert!((p3[i] - want).abs() < 1e-12, "{i}: {} vs {want}", p3[i]);
        }

        // Probabilities 0.1, 0.2, 0.3, 0.4 (index order 3, 0, 2, 1).
        let logits: Vec<f32> = [0.2f32, 0.4, 0.3, 0.1].iter().map(|p| p.ln()).collect();
        let p = |p| filtered_probs(&logits, &SamplingParams { top_p: Some(p), ..sampled(1.0) }, &[]);
        // Ascending cumulative 0.1, 0.3, 0.6, 1.0; top_p 0.5 drops those <= 0.5: 0.1, 0.3.
        assert_eq!(kept(&p(0.5)), vec![1, 2]);
        // top_p 0.8 drops <= 0.2: only the 0.1.
        assert_eq!(kept(&p(0.8)), vec![0, 1, 2]);
        assert_eq!(kept(&p(0.45)), vec![1, 2]);
        assert_eq!(kept(&p(0.35)), vec![1]);
        assert_eq!(kept(&p(0.3)), vec![1]);
        assert_eq!(kept(&p(1.0)), vec![0, 1, 2, 3]);
        // top-k before top-p: top-k 2 leaves 0.4 / 0.3 -> 4/7, 3/7; top_p 0.5 drops 3/7.
        let both = filtered_probs(
            &logits,
            &SamplingParams { top_k: Some(2), top_p: Some(0.5), ..sampled(1.0) },
            &[],
        );
        assert_eq!(kept(&both), vec![1]);
        let k2 = filtered_probs(
            &logits,
            &SamplingParams { top_k: Some(2), top_p: Some(0.6), ..sampled(1.0) },
            &[],
        );
        assert_eq!(kept(&k2), vec![1, 2]);
        // Equal probabilities at the cut: the lower index is dropped first.
        let flat = filtered_probs(&[0.0; 4], &SamplingParams { top_p: Some(0.5), ..sampled(1.0) }, &[]);
        assert_eq!(kept(&flat), vec![2, 3]);
    }

    #[test]
    fn temperature_applies_before_top_p_and_changes_the_nucleus() {
        // Probabilities 0.5, 0.3, 0.2 at temperature 1.
        let logits: Vec<f32> = [0.5f32, 0.3, 0.2].iter().map(|p| p.ln()).collect();
        let nucleus = |t, top_p| {
            kept(&filtered_probs(&logits, &SamplingParams { top_p: Some(top_p), ..sampled(t) }, &[]))
        };
        // t = 1, top_p 0.6: ascending cumulative 0.2, 0.5, 1.0; cut 0.4 drops only the 0.2.
        assert_eq!(nucleus(1.0, 0.6), vec![0, 1]);
        // t = 0.5 squares the probabilities: 0.25, 0.09, 0.04 over 0.38 = 0.658, 0.237, 0.105;
        // ascending cumulative 0.105, 0.342, 1.0; cut 0.4 drops both smaller ones.
        // (Temperature after top-p would keep the t = 1 nucleus {0, 1}.)
        assert_eq!(nucleus(0.5, 0.6), vec![0]);
        // t = 2 takes square roots: 0.707, 0.548, 0.447 over 1.702 = 0.415, 0.322, 0.263;
        // top_p 0.75 cuts at 0.25, which the smallest (0.263) clears: all three stay,
        // where t = 1 drops the 0.2 (cumulative 0.2 <= 0.25).
        assert_eq!(nucleus(1.0, 0.75), vec![0, 1]);
        assert_eq!(nucleus(2.0, 0.75), vec![0, 1, 2]);
        let p2 = filtered_probs(&logits, &SamplingParams { top_p: Some(0.75), ..sampled(2.0) }, &[]);
        let roots = [0.5f64.sqrt(), 0.3f64.sqrt(), 0.2f64.sqrt()];
        let z: f64 = roots.iter().sum();
        for (i, r) in roots.iter().enumerate() {
            assert!((p2[i] - r / z).abs() < 1e-6, "{i}: {} vs {}", p2[i], r / z);
        }
        // Through the sampler: at t = 0.5 the nucleus is token 0 alone, so every draw is 0
        // (temperature after top-p would draw token 1 about a quarter of the time).
        let draws_half = draws(5, &logits, &SamplingParams { top_p: Some(0.6), ..sampled(0.5) }, 200);
        assert!(draws_half.iter().all(|&t| t == 0), "{draws_half:?}");
        // And at t = 2 with top_p 0.75, token 2 is drawn.
        assert!(draws(5, &logits, &SamplingParams { top_p: Some(0.75), ..sampled(2.0) }, 200).contains(&2));
    }

    #[test]
    fn suppressed_ids_are_masked_before_every_other_filter() {
        let greedy = SamplingParams::greedy(4);
        let mut s = Sampler::new(1);
        let row = [1.0f32, 4.0, 3.0, 4.0, 2.0];
        assert_eq!(s.sample(&row, &greedy, &[1]), 3);
        assert_eq!(s.sample(&row, &greedy, &[3, 1]), 2);
        assert_eq!(
            s.sample(&row, &greedy, &[0]),
            1,
            "a suppressed id that is not the argmax changes nothing"
        );
        assert_eq!(s.sample(&row, &greedy, &[99, 1]), 3, "ids past the row are ignored");
        // The mask comes before top-k (HF runs processors before warpers): with the
        // largest logit suppressed, top-k 2 keeps the next two, not just one.
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let k2 = SamplingParams { top_k: Some(2), ..sampled(1.0) };
        assert_eq!(kept(&filtered_probs(&logits, &k2, &[0])), vec![1, 2]);
        // ... and before top-p: probabilities 0.4, 0.3, 0.2, 0.1 with 0 suppressed are
        // 0.5, 0.333, 0.167; top_p 0.6 cuts at 0.4, dropping only the 0.167.
        let logits: Vec<f32> = [0.4f32, 0.3, 0.2, 0.1].iter().map(|p| p.ln()).collect();
        let p6 = SamplingParams { top_p: Some(0.6), ..sampled(1.0) };
        assert_eq!(kept(&filtered_probs(&logits, &p6, &[0])), vec![1, 2]);
        // Masking is exactly a -inf logit: the same seed draws the same stream.
        let random = random_logits(13, 64);
        let mut masked_by_hand = random.clone();
        let suppressed = [3u32, 17, 40, 63];
        for &id in &suppressed {
            masked_by_hand[id as usize] = f32::NEG_INFINITY;
        }
        for params in [
            sampled(1.3),
            SamplingParams { top_k: Some(5), top_p: Some(0.8), ..sampled(0.7) },
            greedy.clone(),
        ] {
            let mut a = Sampler::new(21);
            let mut b = Sampler::new(21);
            let got: Vec<u32> = (0..300).map(|_| a.sample(&random, &params, &suppressed)).collect();
            let want: Vec<u32> = (0..300).map(|_| b.sample(&masked_by_hand, &params, &[])).collect();
            assert_eq!(got, want);
            assert!(got.iter().all(|t| !suppressed.contains(t)));
        }
        // A row whose mass sits on suppressed ids: the sampler never draws them.
        let mut peaked = vec![0.0f32; 8];
        peaked[2] = 30.0;
        peaked[5] = 30.0;
        let hot = draws(3, &peaked, &sampled(1.0), 100);
        assert!(hot.iter().all(|&t| t == 2 || t == 5));
        let mut s = Sampler::new(3);
        assert!((0..100).map(|_| s.sample(&peaked, &sampled(1.0), &[2, 5])).all(|t| t != 2 && t != 5));
    }

    #[test]
    fn nothing_left_falls_back_to_the_lowest_id_not_suppressed() {
        for params in [SamplingParams::greedy(4), sampled(0.8)] {
            let mut s = Sampler::new(2);
            // Only suppressed ids are finite.
            let row = [f32::NEG_INFINITY, 2.0, f32::NAN, 1.0];
            assert_eq!(s.sample(&row, &params, &[1, 3]), 0);
            assert_eq!(s.sample(&row, &params, &[0, 1, 3]), 2);
            assert_eq!(s.sample(&[f32::NAN; 4], &params, &[0, 1]), 2);
            // Every id suppressed (no legal token exists): 0.
            assert_eq!(s.sample(&[1.0, 2.0], &params, &[0, 1]), 0);
            assert_eq!(s.sample(&[], &params, &[0]), 0);
        }
    }

    #[test]
    fn placeholder_ids_are_the_ids_the_prompt_builder_rejects_as_text() -> crate::Result<()> {
        use crate::prompt::PromptBuilder;
        for tokens in [OmniTokens::tiny(), OmniTokens::qwen3_omni()] {
            let ids = placeholder_ids(&tokens);
            let lowest = *ids.iter().min().unwrap_or(&0);
            for id in lowest.saturating_sub(8)..lowest + 30 {
                let rejected = PromptBuilder::new(tokens.clone()).push_text(&[1, id]).is_err();
                assert_eq!(rejected, ids.contains(&id), "id {id}");
            }
        }
        let params = SamplingParams::default();
        assert_eq!(params.suppressed_ids(&[7, 8]), &[7, 8]);
        assert!(SamplingParams { allow_special_ids: true, ..params }.suppressed_ids(&[7, 8]).is_empty());
        Ok(())
    }

    #[test]
    fn the_draw_picks_in_index_order() {
        let probs = [0.0, 0.25, 0.0, 0.5, 0.25];
        assert_eq!(pick(&probs, 0.0), Some(1));
        assert_eq!(pick(&probs, 0.2499), Some(1));
        assert_eq!(pick(&probs, 0.25), Some(3));
        assert_eq!(pick(&probs, 0.7499), Some(3));
        assert_eq!(pick(&probs, 0.75), Some(4));
        assert_eq!(pick(&probs, 0.999_999), Some(4));
        assert_eq!(pick(&[0.0, 0.0], 0.5), None);
    }

    #[test]
    fn non_finite_logits_do_not_panic() {
        let params = SamplingParams { top_k: Some(2), top_p: Some(0.9), ..sampled(0.7) };
        let mut s = Sampler::new(3);
        for row in [
            vec![f32::NAN, 1.0, f32::NAN, 0.5],
            vec![f32::NAN; 5],
            vec![f32::NEG_INFINITY; 5],
            vec![f32::INFINITY, 0.0, f32::INFINITY],
            vec![],
        ] {
            let token = s.sample(&row, &params, &[]);
            assert!((row.is_empty() && token == 0) || (token as usize) < row.len());
        }
        assert_eq!(
            s.sample(
                &[f32::NAN, 1.0, f32::NAN, 0.5],
                &SamplingParams { top_k: Some(1), ..sampled(1.0) },
                &[]
            ),
            1
        );
        // +inf logits share the mass; the finite ones get none.
        let infs = draws(4, &[1.0, f32::INFINITY, 5.0, f32::INFINITY], &sampled(1.0), 200);
        assert!(infs.iter().all(|&t| t == 1 || t == 3) && infs.contains(&1) && infs.contains(&3));
        // A temperature so small that the division overflows: the largest logits win.
        assert!(draws(4, &[-1.0, 3.0, -2.0], &sampled(1e-40), 50).iter().all(|&t| t == 1));
    }

    fn invalid(err: Error) -> (&'static str, String) {
        match err {
            Error::Request(RequestError::InvalidSampling { param, found, .. }) => (param, found),
            other => panic!("expected InvalidSampling, got {other:?}"),
        }
    }

    #[test]
    fn check_names_each_bad_parameter() {
        let ok = SamplingParams { top_k: Some(5), top_p: Some(1.0), stop: Some(vec![0, 99]), ..sampled(0.5) };
        assert!(ok.check(100).is_ok());
        let bad = |p: SamplingParams| invalid(p.check(100).unwrap_err());
        assert_eq!(bad(SamplingParams { max_tokens: 0, ..ok.clone() }), ("max_tokens", "0".into()));
        assert_eq!(bad(SamplingParams { temperature: -0.1, ..ok.clone() }).0, "temperature");
        assert_eq!(bad(SamplingParams { temperature: f32::NAN, ..ok.clone() }).0, "temperature");
        assert_eq!(bad(SamplingParams { temperature: f32::INFINITY, ..ok.clone() }).0, "temperature");
        for p in [0.0, -0.5, 1.0001, f32::NAN, f32::INFINITY] {
            assert_eq!(bad(SamplingParams { top_p: Some(p), ..ok.clone() }).0, "top_p", "{p}");
        }
        assert!(SamplingParams { top_p: Some(1e-9), ..ok.clone() }.check(100).is_ok());
        assert_eq!(bad(SamplingParams { top_k: Some(0), ..ok.clone() }), ("top_k", "0".into()));
        // Greedy params are checked too (they are still a request's parameters).
        assert_eq!(bad(SamplingParams { top_k: Some(0), ..SamplingParams::greedy(3) }).0, "top_k");

        let out_of_vocab = SamplingParams { stop: Some(vec![3, 100, 200]), ..ok.clone() };
        assert!(matches!(
            out_of_vocab.check(100),
            Err(Error::Request(RequestError::StopIdOutOfVocab { id: 100, vocab_size: 100 }))
        ));
        // The checkpoint's eos ids are not the caller's to check.
        assert!(SamplingParams { stop: None, ..ok.clone() }.check(1).is_ok());
        let ban = |ids: Vec<u32>| SamplingParams { suppress_ids: ids, ..ok.clone() };
        assert!(ban((0..99).collect()).check(100).is_ok(), "one id left is enough");
        assert_eq!(bad(ban((0..100).chain([5]).collect())), ("suppress_ids", "all 100 ids".into()));
        assert_eq!(bad(ban(vec![1, 100])), ("suppress_ids", "100".into()));
    }

    #[test]
    fn id_ranges_parse_commas_and_inclusive_ranges() {
        assert_eq!(
            parse_id_ranges("151643-151644,151646-151648").unwrap(),
            [151643, 151644, 151646, 151647, 151648]
        );
        assert_eq!(parse_id_ranges(" 5 , 2-2 ,").unwrap(), [5, 2]);
        for bad in ["x", "3-", "-3", "4-2", "1,,2-a", "99999999999"] {
            assert_eq!(invalid(parse_id_ranges(bad).unwrap_err()).0, "suppress_ids", "{bad}");
        }
    }

    #[test]
    fn positions_needed_counts_the_positions_that_run() {
        let p = SamplingParams::greedy(16);
        assert_eq!(p.positions_needed(10), 25);
        let run_last = SamplingParams { run_last_token: true, ..p.clone() };
        assert_eq!(run_last.positions_needed(10), 26);
        // One token needs only the prompt's positions.
        assert_eq!(SamplingParams::greedy(1).positions_needed(10), 10);
        let huge = SamplingParams::greedy(usize::MAX);
        assert_eq!(huge.positions_needed(usize::MAX), usize::MAX - 1);
    }

    #[test]
    fn stop_ids_prefer_stop_then_eos_and_ignore_eos_empties_them() {
        let eos = [7u32, 8];
        assert_eq!(SamplingParams::default().stop_ids(&eos), &eos);
        let stop = SamplingParams { stop: Some(vec![1]), ..Default::default() };
        assert_eq!(stop.stop_ids(&eos), &[1]);
        assert_eq!(SamplingParams { stop: Some(vec![]), ..Default::default() }.stop_ids(&eos), &[] as &[u32]);
        assert!(SamplingParams { ignore_eos: true, ..stop }.stop_ids(&eos).is_empty());
    }

    #[test]
    fn serde_round_trips_and_defaults() {
        let d = SamplingParams::default();
        assert_eq!((d.max_tokens, d.temperature, d.allow_special_ids), (16, 0.0, false));
        assert_eq!(d, SamplingParams::greedy(16));
        let full = SamplingParams {
            max_tokens: 5,
            temperature: 0.5,
            top_k: Some(3),
            top_p: Some(0.25),
            seed: Some(u64::MAX),
            stop: Some(vec![1, 2]),
            ignore_eos: true,
            run_last_token: true,
            allow_special_ids: true,
            suppress_ids: vec![4, 9],
        };
        let json = serde_json::to_string(&full).unwrap();
        assert_eq!(serde_json::from_str::<SamplingParams>(&json).unwrap(), full);
        assert_eq!(serde_json::from_str::<SamplingParams>("{}").unwrap(), d);
        assert!(serde_json::from_str::<SamplingParams>(r#"{"topk": 3}"#).is_err());
        assert_eq!(serde_json::to_string(&FinishReason::Stop).unwrap(), r#""stop""#);
        assert_eq!(serde_json::to_string(&FinishReason::Length).unwrap(), r#""length""#);
        assert_eq!(serde_json::from_str::<FinishReason>(r#""length""#).unwrap(), FinishReason::Length);
        assert_eq!(FinishReason::Stop.to_string(), "stop");
    }

    #[test]
    fn random_seeds_differ() {
        assert_ne!(random_seed(), random_seed());
    }
}
