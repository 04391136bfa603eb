//! Time to first token (the whole prefill), cached vs uncached, measured in
//! the same run: vLLM's shared-prefix workload (`prefix_repetition`), its
//! long-prefix variant, the 4-round multimodal conversation (`multi_round`),
//! the cost of capturing hidden states and of restoring a prefix from the
//! disk tier (`tier_restore`).
//!
//! Every figure is a median over `runs`, and every ratio compares two medians
//! of the same process on the same model.

mod tier;

use std::path::Path;
use std::sync::Arc;

use ndarray::{Array2, ArrayD, IxDyn};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{HarnessError, Result};
use crate::scenarios::{MultiRound, SCENARIOS_FILE, Scenarios};
use omniprefix::backend::{Backend, Dtype};
use omniprefix::canon::{ItemContent, ItemLayout, ItemSpec, Modality, TensorView};
use omniprefix::engine::{Engine, EngineConfig, ItemInput, Output, Request, millis};
use omniprefix::model::{Config, Thinker};
use omniprefix::prompt::{OmniTokens, TenantSalt};
use omniprefix::sched::SchedulerConfig;

/// What to measure.
#[derive(Debug, Clone, PartialEq)]
pub struct TtftOptions {
    /// Shared-prefix length of `prefix_repetition` (default: scenarios.json, 256).
    pub prefix: Option<usize>,
    /// Suffix length (default: scenarios.json, 256).
    pub suffix: Option<usize>,
    /// Prefix length of the long variant.
    pub long_prefix: usize,
    /// Timed runs per figure; reports hold medians.
    pub runs: usize,
    /// Untimed runs of each figure before the timed ones (same sizes, fresh ids).
    pub warmup: usize,
    /// Which workloads run (in the fixed order of [`Workload`]); empty = all.
    pub workloads: Vec<Workload>,
    /// `prefix_repetition*` and `multi_round` capture no hidden states (only the
    /// last row's logits come back) instead of the engine's three default points.
    pub no_capture: bool,
    /// Divides image/video grid sides and audio length (by its square) of
    /// `multi_round`'s items; 1 = the real Qwen3-Omni token counts.
    pub mm_scale: u32,
    /// Tokens per KV block.
    pub block_size: usize,
    /// The element type of the K/V pages.
    pub kv_dtype: Dtype,
    pub seed: u64,
}

impl Default for TtftOptions {
    fn default() -> Self {
        TtftOptions {
            prefix: None,
            suffix: None,
            long_prefix: 2048,
            runs: 3,
            warmup: 0,
            workloads: Vec::new(),
            no_capture: false,
            mm_scale: 4,
            block_size: omniprefix::kv::DEFAULT_BLOCK_SIZE,
            kv_dtype: Dtype::F32,
            seed: 0,
        }
    }
}

/// A workload of `bench ttft`, named as in its reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// `prefix_repetition`: prefix + suffix, the prefix shared.
    #[value(name = "prefix_repetition")]
    PrefixRepetition,
    /// `prefix_repetition_long`: the long prefix + suffix.
    #[value(name = "prefix_repetition_long")]
    PrefixRepetitionLong,
    /// `multi_round.round1..4`: the multimodal conversation (needs the
    /// model's vocabulary to hold its special ids).
    #[value(name = "multi_round")]
    MultiRound,
    /// `capture_overhead`: three captured layers against none.
    #[value(name = "capture_overhead")]
    CaptureOverhead,
    /// `tier_restore`: the long prefix restored from the disk tier against
    /// recomputed (and against the pool).
    #[value(name = "tier_restore")]
    TierRestore,
}

impl TtftOptions {
    fn runs(&self, workload: Workload) -> bool {
        self.workloads.is_empty() || self.workloads.contains(&workload)
    }

    /// The capture of the timed workloads' engines: the default, or none.
    fn capture(&self) -> Option<Vec<omniprefix::model::CaptureName>> {
        self.no_capture.then(Vec::new)
    }
}

/// One workload's medians (one JSON line of `bench ttft --json`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TtftReport {
    pub workload: String,
    /// The backend the model ran on (`cpu`, `wgpu`).
    pub backend: &'static str,
    /// The dtype the weight matrices were stored in (`f32`, `bf16`, `f16`).
    pub dtype: &'static str,
    /// MiB of all weights as stored.
    pub weight_mib: f64,
    /// Tokens of the measured prompt that a cache could serve (shared with earlier prompts).
    pub prefix: usize,
    /// The rest of the prompt.
    pub suffix: usize,
    pub runs: usize,
    pub ttft_uncached_ms: f64,
    pub ttft_cached_ms: f64,
    /// Median cached tokens of the cached run.
    pub cached_tokens: usize,
    /// Uncached fraction of the prompt: what the cached/uncached ratio would be
    /// if time were proportional to computed tokens.
    pub ideal_ratio: f64,
    /// `ttft_cached_ms / ttft_uncached_ms`.
    pub ratio: f64,
    /// `ratio / ideal_ratio` (target ≤ 1.3 for the long prefix).
    pub ratio_over_ideal: f64,
    /// Model FLOPs of the cached prefill over the uncached one: the floor when
    /// every op runs at the same FLOP rate (the suffix still attends to the prefix).
    pub flop_ratio: f64,
    /// Median scheduler time (match, allocate, commit) of the cached run.
    pub cached_schedule_ms: f64,
    /// Median preprocess time (fingerprints, prompt layout) of the cached run.
    pub cached_preprocess_ms: f64,
}

/// Forward FLOPs of positions `computed..len` of a prompt (multiply-adds count
/// two): projections, attention over every visible position, MLP or routed
/// experts, and the last row's logits.
pub fn prefill_flops(cfg: &Config, computed: usize, len: usize) -> f64 {
    let (h, hd) = (cfg.hidden_size as f64, cfg.head_dim as f64);
    let (q, kv) = (cfg.num_attention_heads as f64 * hd, cfg.num_key_value_heads as f64 * hd);
    let new = len.saturating_sub(computed) as f64;
    // Sum over new rows i of the keys they see: computed + i + 1.
    let visible = new * computed as f64 + new * (new + 1.0) / 2.0;
    let mut total = 0.0;
    for layer in 0..cfg.num_hidden_layers {
        let mlp = match &cfg.moe {
            Some(m) if cfg.is_sparse_layer(layer) => {
                2.0 * h * m.num_experts as f64
                    + 6.0 * h * m.moe_intermediate_size as f64 * m.num_experts_per_tok as f64
            }
            _ => 6.0 * h * cfg.intermediate_size as f64,
        };
        total += new * (2.0 * h * (2.0 * q + 2.0 * kv) + mlp) + 4.0 * q * visible;
    }
    total + 2.0 * h * cfg.vocab_size as f64
}

/// Prefill time with three captured layers against none.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CaptureReport {
    pub workload: String,
    /// The backend the model ran on (`cpu`, `wgpu`).
    pub backend: &'static str,
    pub prompt_tokens: usize,
    pub runs: usize,
    pub ttft_no_capture_ms: f64,
    pub ttft_capture_ms: f64,
    /// Captured points of the capturing run.
    pub captured: usize,
    /// `ttft_capture / ttft_no_capture - 1` (target ≤ 0.05).
    pub capture_overhead: f64,
}

/// The embedded benchmark model: Qwen3 shape (hidden 512, 8 layers, 8 heads,
/// 4 KV heads, head_dim 64, intermediate 1536, the Qwen vocabulary of 151936)
/// with Qwen3-Omni-style interleaved M-RoPE sections scaled to head_dim 64.
pub fn bench_model() -> Config {
    Config {
        intermediate_size: 1536,
        mrope_section: Some([12, 10, 10]),
        mrope_interleaved: true,
        ..Config::tiny_qwen3(512, 8, 8, 4, 151_936)
    }
}

/// Median of `values` (the mean of the middle two for an even count).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

fn median_usize(values: Vec<usize>) -> usize {
    median(values.into_iter().map(|v| v as f64).collect()).round() as usize
}

pub use tier::TierRestoreReport;

/// What `bench ttft` measured: one report per prompt workload, then the
/// capture and tier figures (`None` when not selected).
#[derive(Debug, Clone, PartialEq)]
pub struct TtftReports {
    pub prompts: Vec<TtftReport>,
    pub capture: Option<CaptureReport>,
    pub tier: Option<TierRestoreReport>,
}

/// Runs the selected workloads (all by default) on `thinker` and returns
/// their reports in a fixed order.
pub fn run_all<B: Backend>(
    backend: Arc<B>, thinker: Arc<Thinker<B>>, tokens: Option<OmniTokens>, options: &TtftOptions,
) -> Result<TtftReports> {
    let bench = Bench { backend, thinker, tokens, options: options.clone() };
    let sc = Scenarios::load()?;
    let prefix = options.prefix.unwrap_or(sc.prefix_repetition.prefix_len);
    let suffix = options.suffix.unwrap_or(sc.prefix_repetition.suffix_len);
    let mut reports = Vec::new();
    if options.runs(Workload::PrefixRepetition) {
        reports.push(bench.prefix_repetition("prefix_repetition", prefix, suffix)?);
    }
    if options.runs(Workload::PrefixRepetitionLong) {
        reports.push(bench.prefix_repetition("prefix_repetition_long", options.long_prefix, suffix)?);
    }
    if options.runs(Workload::MultiRound) {
        reports.extend(bench.multi_round(&sc.multi_round)?);
    }
    let capture = match options.runs(Workload::CaptureOverhead) {
        true => Some(bench.capture_overhead(prefix + suffix)?),
        false => None,
    };
    // A backend without a tier skips it when every workload runs, and says why when it is asked for.
    let tier_asked = options.workloads.contains(&Workload::TierRestore);
    let tier = match tier_asked || (options.workloads.is_empty() && bench.backend.tier_capable()) {
        true => Some(bench.tier_restore(options.long_prefix, suffix)?),
        false => None,
    };
    Ok(TtftReports { prompts: reports, capture, tier })
}

struct Bench<B: Backend> {
    backend: Arc<B>,
    thinker: Arc<Thinker<B>>,
    tokens: Option<OmniTokens>,
    options: TtftOptions,
}

impl<B: Backend> Bench<B> {
    fn engine(
        &self, cache: bool, capture: Option<Vec<omniprefix::model::CaptureName>>, max_prompt: usize,
    ) -> Result<Engine<B>> {
        self.engine_on(cache, capture, max_prompt, None)
    }

    /// [`engine`](Self::engine) with a disk tier in `tier_dir` (`None`: none).
    fn engine_on(
        &self, cache: bool, capture: Option<Vec<omniprefix::model::CaptureName>>, max_prompt: usize,
        tier_dir: Option<&Path>,
    ) -> Result<Engine<B>> {
        let block_size = self.options.block_size;
        // Room for three prompts at once; older runs' entries are evicted (LRU).
        let num_blocks = (3 * max_prompt.div_ceil(block_size)).max(64);
        let config = EngineConfig {
            scheduler: SchedulerConfig {
                block_size,
                num_blocks,
                max_tokens_per_step: max_prompt.max(1),
                ..Default::default()
            },
            capture,
            cache,
            tokens: self.tokens.clone(),
            kv_dtype: self.options.kv_dtype,
            tier_dir: tier_dir.map(Path::to_path_buf),
            ..Default::default()
        };
        let mut engine = Engine::new(Arc::clone(&self.backend), Arc::clone(&self.thinker), config)?;
        // Untimed: thread pools and allocator warm up before the clock runs.
        engine.run(Request { tenant: TenantSalt::MAX / 2, ..Request::text(vec![1; 32]) })?;
        Ok(engine)
    }

    /// Random ids that are plain text for the engine's model.
    fn text(&self, engine: &Engine<B>, rng: &mut ChaCha8Rng, n: usize) -> Vec<u32> {
        let limit = text_id_limit(engine.tokens(), engine.model_config().vocab_size);
        (0..n).map(|_| rng.random_range(0..limit)).collect()
    }

    /// Per run: a prompt with a new prefix (uncached: nothing of it is cached),
    /// then another prompt with the same prefix and a new suffix (cached).
    fn prefix_repetition(&self, workload: &str, prefix: usize, suffix: usize) -> Result<TtftReport> {
        let mut engine = self.engine(true, self.options.capture(), prefix + suffix)?;
        let mut rng = ChaCha8Rng::seed_from_u64(self.options.seed);
        let mut samples = Samples::default();
        for run in 0..self.options.warmup + self.options.runs.max(1) {
            let shared = self.text(&engine, &mut rng, prefix);
            let mut first = shared.clone();
            first.extend(self.text(&engine, &mut rng, suffix));
            let mut second = shared;
            second.extend(self.text(&engine, &mut rng, suffix));
            let uncached = engine.run(Request::text(first))?;
            let cached = engine.run(Request::text(second))?;
            if run >= self.options.warmup {
                samples.push(&uncached, &cached);
            }
        }
        Ok(report(
            workload,
            self.backend.name(),
            &self.thinker,
            prefix,
            suffix,
            self.options.runs.max(1),
            samples,
        ))
    }

    /// Per run (its own tenant): rounds 1..4 in order on a caching engine, and
    /// each round alone on an engine with caching off.
    fn multi_round(&self, scenario: &MultiRound) -> Result<Vec<TtftReport>> {
        let probe = self.engine(false, None, 64)?;
        let (model_tokens, vocab, hidden) =
            (probe.tokens().clone(), probe.model_config().vocab_size, probe.model_config().hidden_size);
        drop(probe);
        let media = Media::new(self.options.mm_scale, hidden, self.options.seed)?;
        let rounds: Vec<(Vec<u32>, Vec<&MediaItem>)> = scenario
            .rounds
            .iter()
            .map(|r| {
                let ids = map_ids(&r.token_ids_unexpanded, &model_tokens, vocab);
                let items = r.items_in_order.iter().map(|&m| media.get(m)).collect::<Result<Vec<_>>>()?;
                Ok((ids, items))
            })
            .collect::<Result<_>>()?;
        let longest =
            rounds.iter().map(|(ids, items)| ids.len() + items.iter().map(|i| i.tokens).sum::<usize>()).max();
        let longest = longest.unwrap_or(0);
        let mut cached_engine = self.engine(true, self.options.capture(), longest)?;
        let mut uncached_engine = self.engine(false, self.options.capture(), longest)?;
        let n = rounds.len();
        let (mut samples, mut lens) = (vec![Samples::default(); n], vec![0; n]);
        for run in 0..self.options.warmup + self.options.runs.max(1) {
            for (k, (ids, items)) in rounds.iter().enumerate() {
                let request = |tenant| Request {
                    tenant,
                    token_ids: ids.clone(),
                    items: items.iter().map(|m| m.input()).collect(),
                    ..Default::default()
                };
                let cached = cached_engine.run(request(run as TenantSalt + 1))?;
                let uncached = uncached_engine.run(request(0))?;
                lens[k] = cached.prompt_len;
                if run >= self.options.warmup {
                    samples[k].push(&uncached, &cached);
                }
            }
        }
        let runs = self.options.runs.max(1);
        Ok(samples
            .into_iter()
            .zip(lens)
            .enumerate()
            .map(|(k, (samples, len))| {
                let hit = median_usize(samples.hits.clone());
                let name = format!("multi_round.round{}", k + 1);
                report(&name, self.backend.name(), &self.thinker, hit, len.saturating_sub(hit), runs, samples)
            })
            .collect())
    }

    /// Uncached prefill of one prompt with the default three captured points against none.
    fn capture_overhead(&self, len: usize) -> Result<CaptureReport> {
        let mut with = self.engine(false, None, len)?;
        let mut without = self.engine(false, Some(vec![]), len)?;
        let mut rng = ChaCha8Rng::seed_from_u64(self.options.seed ^ 0xC0FFEE);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for run in 0..self.options.warmup + self.options.runs.max(1) {
            let ids = self.text(&with, &mut rng, len);
            // Alternate so drift in machine load hits both sides alike.
            let capture_ms = millis(with.run(Request::text(ids.clone()))?.timings.total);
            let none_ms = millis(without.run(Request::text(ids))?.timings.total);
            if run >= self.options.warmup {
                a.push(capture_ms);
                b.push(none_ms);
            }
        }
        let (capture_ms, none_ms) = (median(a), median(b));
        Ok(CaptureReport {
            workload: "capture_overhead".into(),
            backend: self.backend.name(),
            prompt_tokens: len,
            runs: self.options.runs.max(1),
            ttft_no_capture_ms: none_ms,
            ttft_capture_ms: capture_ms,
            captured: with.capture().len(),
            capture_overhead: capture_ms / none_ms - 1.0,
        })
    }
}

/// Per-run samples of one workload.
#[derive(Default, Clone)]
struct Samples {
    uncached_ms: Vec<f64>,
    cached_ms: Vec<f64>,
    hits: Vec<usize>,
    schedule_ms: Vec<f64>,
    preprocess_ms: Vec<f64>,
}

impl Samples {
    fn push(&mut self, uncached: &Output, cached: &Output) {
        self.uncached_ms.push(millis(uncached.timings.total));
        self.cached_ms.push(millis(cached.timings.total));
        self.hits.push(cached.num_cached_tokens);
        self.schedule_ms.push(millis(cached.timings.schedule));
        self.preprocess_ms.push(millis(cached.timings.preprocess));
    }
}

fn report<B: Backend>(
    workload: &str, backend: &'static str, thinker: &Thinker<B>, prefix: usize, suffix: usize, runs: usize,
    samples: Samples,
) -> TtftReport {
    let cfg = thinker.config();
    let (u, c) = (median(samples.uncached_ms), median(samples.cached_ms));
    let cached_tokens = median_usize(samples.hits);
    let total = (prefix + suffix).max(1);
    let ideal_ratio = (total - cached_tokens.min(total)) as f64 / total as f64;
    let ratio = c / u;
    TtftReport {
        workload: workload.into(),
        backend,
        dtype: thinker.dtype().name(),
        weight_mib: thinker.weight_bytes() as f64 / (1u64 << 20) as f64,
        prefix,
        suffix,
        runs,
        ttft_uncached_ms: u,
        ttft_cached_ms: c,
        cached_tokens,
        ideal_ratio,
        ratio,
        ratio_over_ideal: ratio / ideal_ratio,
        flop_ratio: prefill_flops(cfg, cached_tokens, total) / prefill_flops(cfg, 0, total),
        cached_schedule_ms: median(samples.schedule_ms),
        cached_preprocess_ms: median(samples.preprocess_ms),
    }
}

/// Ids below this are plain text for the model: below its vocabulary and its
/// smallest special id.
pub(crate) fn text_id_limit(tokens: &OmniTokens, vocab: usize) -> u32 {
    let specials = [
        tokens.image_token_id,
        tokens.video_token_id,
        tokens.audio_token_id,
        tokens.vision_start_token_id,
        tokens.vision_end_token_id,
        tokens.audio_start_token_id,
        tokens.audio_end_token_id,
    ];
    let smallest = specials.into_iter().min().unwrap_or(u32::MAX);
    // Qwen's regular BPE ranks end at 151643; the rest are control tokens.
    smallest.min(151_643).min(u32::try_from(vocab).unwrap_or(u32::MAX)).max(1)
}

/// Scenario ids (Qwen3-Omni's) in the vocabulary of a model with special ids `to`.
pub(crate) fn map_ids(ids: &[u32], to: &OmniTokens, vocab: usize) -> Vec<u32> {
    let qwen = OmniTokens::qwen3_omni();
    ids.iter().map(|&t| map_token(t, &qwen, to, vocab)).collect()
}

/// A Qwen3-Omni id in the model's vocabulary: special ids to the model's
/// special ids, other ids folded below its text limit.
fn map_token(id: u32, from: &OmniTokens, to: &OmniTokens, vocab: usize) -> u32 {
    let pairs = [
        (from.image_token_id, to.image_token_id),
        (from.video_token_id, to.video_token_id),
        (from.audio_token_id, to.audio_token_id),
        (from.vision_start_token_id, to.vision_start_token_id),
        (from.vision_end_token_id, to.vision_end_token_id),
        (from.audio_start_token_id, to.audio_start_token_id),
        (from.audio_end_token_id, to.audio_end_token_id),
    ];
    match pairs.iter().find(|(f, _)| *f == id) {
        Some(&(_, t)) => t,
        None => id % text_id_limit(to, vocab),
    }
}

/// A synthetic item of `multi_round`: raw content for the fingerprint and
/// random "encoder output" rows for the model.
pub(crate) struct MediaItem {
    modality: Modality,
    layout: ItemLayout,
    content: ArrayD<u8>,
    embeddings: Arc<Array2<f32>>,
    pub(crate) tokens: usize,
}

impl MediaItem {
    pub(crate) fn input(&self) -> ItemInput<'_> {
        ItemInput {
            spec: ItemSpec {
                modality: self.modality,
                layout: self.layout,
                content: ItemContent::Tensor(TensorView::U8(self.content.view())),
                params: Default::default(),
            },
            embeddings: Some(Arc::clone(&self.embeddings)),
            deepstack: None,
            routing_hash: None,
        }
    }

    /// The encoder output [`input`](Self::input) carries.
    pub(crate) fn embeddings(&self) -> Arc<Array2<f32>> {
        Arc::clone(&self.embeddings)
    }
}

/// The image, audio and video of `fixtures/qwen3_omni.json`, scaled down by `scale`.
pub(crate) struct Media {
    items: Vec<MediaItem>,
}

/// Layout and raw content shape of the image, audio and video of
/// `fixtures/qwen3_omni.json`, grid sides divided by `scale` (kept even and at
/// least 2, for the 2x2 merge) and mel frames by `scale²`.
fn scaled_layouts(scale: u32) -> [(Modality, ItemLayout, Vec<usize>); 3] {
    let scale = scale.max(1);
    let side = |s: u32| ((s / scale) / 2 * 2).max(2);
    let (ih, iw, vh, vw) = (side(44), side(80), side(40), side(72));
    let mel = (3000 / (scale * scale)).max(1);
    let px = |s: u32| s as usize * 16;
    [
        (Modality::Image, ItemLayout::Image { grid_thw: [1, ih, iw] }, vec![px(ih), px(iw), 3]),
        (Modality::Audio, ItemLayout::Audio { mel_frames: mel }, vec![mel as usize * 160]),
        (
            Modality::Video,
            ItemLayout::Video { grid_thw: [10, vh, vw], seconds_per_grid: 1.0 },
            vec![20, px(vh), px(vw), 3],
        ),
    ]
}

impl MediaItem {
    /// A random item of `modality` with the layout [`Media`] gives it at `scale`:
    /// random content (its own fingerprint) and random encoder rows `hidden` wide.
    pub(crate) fn random(
        modality: Modality, scale: u32, hidden: usize, rng: &mut ChaCha8Rng,
    ) -> Result<Self> {
        let (modality, layout, shape) = scaled_layouts(scale)
            .into_iter()
            .find(|(m, _, _)| *m == modality)
            .ok_or_else(|| HarnessError::Fixture {
                file: SCENARIOS_FILE,
                problem: format!("no synthetic layout for {modality:?}"),
            })?;
        let tokens = layout.try_num_tokens(0)?;
        let mut bytes = vec![0u8; shape.iter().product()];
        rng.fill(bytes.as_mut_slice());
        let content = ArrayD::from_shape_vec(IxDyn(&shape), bytes)
            .map_err(|source| HarnessError::GeneratedMedia { what: "ttft media", source })?;
        let embeddings = Array2::from_shape_simple_fn((tokens, hidden), || rng.random::<f32>() * 2.0 - 1.0);
        Ok(MediaItem { modality, layout, content, embeddings: Arc::new(embeddings), tokens })
    }
}

impl Media {
    pub(crate) fn new(scale: u32, hidden: usize, seed: u64) -> Result<Self> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5EED);
        let items = scaled_layouts(scale)
            .into_iter()
            .map(|(modality, _, _)| MediaItem::random(modality, scale, hidden, &mut rng))
            .collect::<Result<_>>()?;
        Ok(Media { items })
    }

    pub(crate) fn get(&self, modality: Modality) -> Result<&MediaItem> {
        self.items.iter().find(|m| m.modality == modality).ok_or_else(|| HarnessError::Fixture {
            file: SCENARIOS_FILE,
            problem: format!("scenario item {modality:?} has no media"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_id_mapping() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        let qwen = OmniTokens::qwen3_omni();
        let tiny = OmniTokens::tiny();
        assert_eq!(map_token(qwen.image_token_id, &qwen, &tiny, 600), tiny.image_token_id);
        assert_eq!(map_token(151_644, &qwen, &tiny, 600), 151_644 % 500);
        assert_eq!(text_id_limit(&tiny, 300), 300);
        assert_eq!(text_id_limit(&qwen, 151_936), 151_643);
    }

    #[test]
    fn scaled_media_have_the_layouts_token_counts() -> Result<()> {
        let media = Media::new(4, 8, 1)?;
        assert_eq!(media.get(Modality::Image)?.tokens, 50); // grid [1, 10, 20]
        assert_eq!(media.get(Modality::Video)?.tokens, 450); // grid [10, 10, 18]
        assert_eq!(media.get(Modality::Audio)?.embeddings.dim(), (media.get(Modality::Audio)?.tokens, 8));
        Ok(())
    }

    #[test]
    fn flops_split_into_linear_and_attention_parts() -> Result<()> {
        // 1 layer, hidden 4, 1 head of 4, intermediate 8, vocab 10.
        let mut cfg = Config::tiny_qwen3(4, 1, 1, 1, 10);
        cfg.intermediate_size = 8;
        let linear_per_row = 2.0 * 4.0 * 16.0 + 6.0 * 4.0 * 8.0;
        let logits = 2.0 * 4.0 * 10.0;
        // Rows 0..3 see 1 + 2 + 3 keys; rows 2..3 of a 3-row prompt see 3.
        assert_eq!(prefill_flops(&cfg, 0, 3), 3.0 * linear_per_row + 4.0 * 4.0 * 6.0 + logits);
        assert_eq!(prefill_flops(&cfg, 2, 3), linear_per_row + 4.0 * 4.0 * 3.0 + logits);
        let full: Vec<usize> = scaled_layouts(1).iter().map(|(_, l, _)| l.num_tokens()).collect();
        assert_eq!(full, vec![880, 390, 7200]);
        Ok(())
    }
}
