//! Time to first audio (TTFA) of a spoken multi-round voice chat, through the
//! served engine, caching on and off, at several concurrencies.
//!
//! The model is a full Omni model with seeded random weights whose three
//! stages keep the release's structure, scaled down together (see [`Shapes`]):
//! the thinker of `bench ttft`, a Mixture-of-Experts talker with a shared
//! expert and a code predictor, and code2wav with the release's sliding
//! window and upsampling (1920 samples a frame at 24 kHz).
//!
//! Caching on and off are two engines alive side by side; each concurrency runs
//! on the one, then the other, so that their ratio compares runs seconds apart.
//!
//! Every figure is measured from what the engine hands a caller: the events
//! of its handle (times taken as they arrive) and the [`Timings`] of its
//! output. Nothing here assumes when the engine starts speaking or whether
//! the talker reuses a prefix: the report says what happened (talker rows,
//! cached rows, when the reply's last token came, when the first audio did),
//! so the same command measures the engine as it changes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ndarray::Array2;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{HarnessError, Result};
use crate::serve::percentile;
use crate::ttft::{MediaItem, text_id_limit};
use omniprefix::backend::{Backend, Dtype};
use omniprefix::canon::Modality;
use omniprefix::engine::{
    Engine, EngineConfig, Event, ItemInput, Request, ServedEngine, ServedOptions, Timings, millis,
};
use omniprefix::error::Component;
use omniprefix::model::code2wav::{Code2Wav, Code2WavConfig, Code2WavStream};
use omniprefix::model::talker::{Talker, TalkerConfig, TalkerInputs};
use omniprefix::model::{Config, Thinker};
use omniprefix::prompt::{OmniTokens, TenantSalt};
use omniprefix::sample::{SamplingParams, TalkerSampling};
use omniprefix::sched::{PrefillCap, SchedulerConfig};
use omniprefix::speech::{ChatIds, SpeechOptions, SpeechStage};

/// Qwen3-Omni's chat ids (the root of its `config.json`): the thinker's vocabulary.
pub const QWEN3_OMNI_CHAT: ChatIds = ChatIds {
    im_start_token_id: 151_644,
    user_token_id: 872,
    assistant_token_id: 77_091,
    tts_pad_token_id: 151_671,
    tts_bos_token_id: 151_672,
    tts_eos_token_id: 151_673,
};
/// `<|im_end|>`, `\n` and `system` in Qwen's vocabulary.
const IM_END: u32 = 151_645;
const NEWLINE: u32 = 198;
const SYSTEM: u32 = 8948;

/// The prefill cap `bench ttfa` serves with: 256 tokens, an eighth of the default
/// step budget, where text serving's default is a 32nd (64). The cap bounds how long
/// reply tokens wait behind prompts; a spoken reply's token is needed only by its
/// talker frame (80 ms of audio), and a new turn (here 123 tokens) then prefills in
/// one step instead of two. Measured back to back on 2 AVX2 cores: c=8's TTFA p50
/// (rounds 2..) 609 ms at 64 and 318 ms at 256 (`--prefill-cap` reruns either).
pub const SPEECH_PREFILL_CAP: PrefillCap = PrefillCap::Tokens(256);

/// How big the embedded model is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Size {
    /// The release's structure at a quarter of its widths (the shapes `bench ttfa` prints).
    Bench,
    /// A few-layer model of the same structure for tests.
    Tiny,
}

/// What to measure.
#[derive(Debug, Clone, PartialEq)]
pub struct TtfaOptions {
    pub size: Size,
    /// Rounds per conversation (round 1 opens it; each later one re-sends it).
    pub rounds: usize,
    /// Closed-loop runs: conversations in flight.
    pub concurrency: Vec<usize>,
    /// Conversations per run (at least the run's concurrency).
    pub conversations: usize,
    /// Thinker reply tokens per round (eos ignored).
    pub max_tokens: usize,
    /// Talker frames per reply (its max_new_tokens is one more: the last code makes no frame).
    pub frames: usize,
    /// Divides the image's grid sides and the audio's length (by its square).
    pub mm_scale: u32,
    /// Frames code2wav waits for before its first decode, and per later decode.
    pub first_chunk: usize,
    pub chunk: usize,
    pub block_size: usize,
    /// Prefill tokens a step that carries reply tokens may add ([`SPEECH_PREFILL_CAP`] by default).
    pub prefill_cap: PrefillCap,
    /// The engine's [`EngineConfig::audio_yield`] (`None`: decode each chunk when due).
    pub audio_yield: Option<Duration>,
    pub kv_dtype: Dtype,
    /// Weight dtype of the three stages (`None`: f32).
    pub dtype: Option<Dtype>,
    pub seed: u64,
}

impl TtfaOptions {
    /// The defaults of `size`: 4 rounds at c = 1, 4, 8 (bench) or 2 rounds at c = 1, 2 (tiny).
    pub fn new(size: Size) -> Self {
        let speech = SpeechOptions::default();
        let bench = size == Size::Bench;
        TtfaOptions {
            size,
            rounds: if bench { 4 } else { 2 },
            concurrency: if bench { vec![1, 4, 8] } else { vec![1, 2] },
            conversations: if bench { 4 } else { 2 },
            max_tokens: if bench { 16 } else { 4 },
            frames: if bench { 16 } else { 4 },
            mm_scale: if bench { 2 } else { 8 },
            first_chunk: if bench { speech.first_chunk } else { 2 },
            chunk: if bench { speech.chunk } else { 2 },
            block_size: omniprefix::kv::DEFAULT_BLOCK_SIZE,
            prefill_cap: SPEECH_PREFILL_CAP,
            audio_yield: Some(omniprefix::engine::DEFAULT_AUDIO_YIELD),
            kv_dtype: Dtype::F32,
            dtype: None,
            seed: 0,
        }
    }
}

/// A decoder's shape, as printed and reported.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DecoderShape {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Dense MLP width (0 when every layer is MoE).
    pub intermediate: usize,
    /// Routed experts, experts per token, expert width, shared-expert width (0: dense).
    pub experts: usize,
    pub experts_per_token: usize,
    pub expert_intermediate: usize,
    pub shared_expert_intermediate: usize,
    pub vocab: usize,
}

impl DecoderShape {
    fn of(c: &Config) -> Self {
        let moe = c.moe.as_ref();
        DecoderShape {
            hidden: c.hidden_size,
            layers: c.num_hidden_layers,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            intermediate: if moe.is_some() { 0 } else { c.intermediate_size },
            experts: moe.map_or(0, |m| m.num_experts),
            experts_per_token: moe.map_or(0, |m| m.num_experts_per_tok),
            expert_intermediate: moe.map_or(0, |m| m.moe_intermediate_size),
            shared_expert_intermediate: moe.map_or(0, |m| m.shared_expert_intermediate_size),
            vocab: c.vocab_size,
        }
    }

    fn line(&self) -> String {
        let mlp = match self.experts {
            0 => format!("mlp {}", self.intermediate),
            n => format!(
                "{n} experts top-{} of {} + shared {}",
                self.experts_per_token, self.expert_intermediate, self.shared_expert_intermediate
            ),
        };
        format!(
            "hidden {} x {} layers, {}/{} heads of {}, {mlp}, vocab {}",
            self.hidden, self.layers, self.heads, self.kv_heads, self.head_dim, self.vocab
        )
    }
}

/// The shapes of the embedded model's stages.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Shapes {
    pub thinker: DecoderShape,
    pub talker: DecoderShape,
    pub code_predictor: DecoderShape,
    pub code_groups: usize,
    /// The thinker layer the talker reads at item rows.
    pub accept_hidden_layer: usize,
    pub code2wav_hidden: usize,
    pub code2wav_layers: usize,
    pub code2wav_heads: usize,
    pub code2wav_intermediate: usize,
    pub code2wav_window: usize,
    pub code2wav_upsampling_ratios: Vec<usize>,
    pub code2wav_upsample_rates: Vec<usize>,
    pub code2wav_decoder_dim: usize,
    pub samples_per_frame: usize,
    pub sample_rate: u32,
    /// MiB of the thinker's weights as stored.
    pub thinker_mib: f64,
}

impl Shapes {
    fn lines(&self) -> Vec<String> {
        vec![
            format!("thinker:        {}", self.thinker.line()),
            format!(
                "talker:         {} (reads thinker layer {})",
                self.talker.line(),
                self.accept_hidden_layer
            ),
            format!("code predictor: {}, {} code groups", self.code_predictor.line(), self.code_groups),
            format!(
                "code2wav:       hidden {} x {} layers, {} heads, mlp {}, window {}, upsample {:?}x{:?}, decoder {} ({} samples/frame at {} Hz)",
                self.code2wav_hidden,
                self.code2wav_layers,
                self.code2wav_heads,
                self.code2wav_intermediate,
                self.code2wav_window,
                self.code2wav_upsample_rates,
                self.code2wav_upsampling_ratios,
                self.code2wav_decoder_dim,
                self.samples_per_frame,
                self.sample_rate
            ),
        ]
    }
}

/// The embedded model's configs: the thinker, the talker and code2wav.
pub struct OmniConfigs {
    pub thinker: Config,
    pub talker: TalkerConfig,
    pub code2wav: Code2WavConfig,
}

/// The embedded model of `size`.
///
/// Release (Qwen3-Omni-30B-A3B) → bench: the thinker is `bench ttft`'s (hidden
/// 2048 → 512, 48 → 8 layers, dense); the talker 1024 → 256 wide, 20 → 4
/// layers, 128 experts top-6 + a shared expert (expert 384 → 96, shared 768 →
/// 192), its code predictor 5 → 1 layer; code2wav 1024 → 256 wide, 8 → 2
/// sliding-window layers (window 72), decoder 1536 → 384 with the release's
/// upsampling (8,5,4,3)×(2,2): 1920 samples a frame. Head dims are 64; the
/// codec sizes (2048 codes × 16 groups, 3072 talker ids) are the release's.
pub fn omni_configs(size: Size) -> Result<OmniConfigs> {
    let bench = size == Size::Bench;
    let thinker = if bench {
        crate::ttft::bench_model()
    } else {
        Config {
            intermediate_size: 128,
            mrope_section: Some([2, 3, 3]),
            mrope_interleaved: true,
            ..Config::tiny_qwen3(64, 2, 4, 2, 151_936)
        }
    };
    // (talker hidden, layers, heads, kv heads, head_dim, mrope, experts, top-k, expert, shared, predictor layers)
    let t = if bench {
        (256, 4, 8, 1, 64, [12, 10, 10], 128, 6, 96, 192, 1)
    } else {
        (32, 1, 4, 1, 16, [2, 3, 3], 8, 2, 16, 16, 1)
    };
    let (hidden, layers, heads, kv, hd, mrope, experts, top_k, expert, shared, cp_layers) = t;
    let accept = if bench { 3 } else { 1 };
    let json = serde_json::json!({"talker_config": {
        "text_config": {"model_type": "qwen3_omni_moe_talker_text", "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": hd, "vocab_size": 3072, "rms_norm_eps": 1e-6,
            "num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": expert,
            "shared_expert_intermediate_size": shared, "norm_topk_prob": true,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": mrope,
                "interleaved": true}},
        "code_predictor_config": {"model_type": "qwen3_omni_moe_talker_code_predictor", "hidden_size": hidden,
            "intermediate_size": 3 * hidden, "num_hidden_layers": cp_layers, "num_attention_heads": heads,
            "num_key_value_heads": (heads / 2).max(1), "head_dim": hd, "vocab_size": 2048, "num_code_groups": 16,
            "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}},
        "num_code_groups": 16, "thinker_hidden_size": thinker.hidden_size, "accept_hidden_layer": accept,
        "codec_eos_token_id": 2150, "codec_nothink_id": 2155, "codec_think_bos_id": 2156,
        "codec_think_eos_id": 2157, "codec_pad_id": 2148, "codec_bos_id": 2149,
        "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303}, "spatial_merge_size": 2}});
    let talker = TalkerConfig::from_json_str(&json.to_string())?;
    let release = Code2WavConfig::qwen3_omni();
    let code2wav = if bench {
        Code2WavConfig {
            hidden_size: 256,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 4,
            head_dim: 64,
            intermediate_size: 768,
            decoder_dim: 384,
            ..release
        }
    } else {
        Code2WavConfig {
            hidden_size: 32,
            num_hidden_layers: 1,
            num_attention_heads: 2,
            num_key_value_heads: 2,
            head_dim: 16,
            intermediate_size: 64,
            decoder_dim: 32,
            ..release
        }
    };
    code2wav.validate()?;
    Ok(OmniConfigs { thinker, talker, code2wav })
}

/// The machine the figures were measured on.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MachineInfo {
    pub cpu_model: String,
    /// Threads the process may run on.
    pub cores: usize,
    /// The SIMD features the CPU backend's kernels care about (from /proc/cpuinfo).
    pub cpu_features: Vec<String>,
    /// The `backend:` line (what ran the model and why).
    pub backend: String,
    pub threads: usize,
}

impl MachineInfo {
    pub fn describe(backend: String) -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |key: &str| {
            cpuinfo.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == key).then(|| v.trim().to_string())
            })
        };
        let flags = field("flags").unwrap_or_default();
        let wanted = ["avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"];
        MachineInfo {
            cpu_model: field("model name").unwrap_or_else(|| "unknown".into()),
            cores: std::thread::available_parallelism().map_or(1, usize::from),
            cpu_features: wanted
                .iter()
                .filter(|w| flags.split_whitespace().any(|f| f == **w))
                .map(|w| w.to_string())
                .collect(),
            backend,
            threads: rayon::current_num_threads(),
        }
    }
}

/// Milliseconds of one round's requests in one run.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct RoundReport {
    pub round: usize,
    pub requests: usize,
    /// Medians over the round's requests.
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub talker_prompt_rows: usize,
    pub talker_cached_rows: usize,
    pub frames: usize,
    pub audio_samples: usize,
    /// From just before `submit` to the first `Event::Audio` the handle yields: what a caller waits.
    pub ttfa_ms_p50: f64,
    pub ttfa_ms_p99: f64,
    /// The engine's own `Timings::ttfa` (from the start of preparation to the first chunk's making).
    pub engine_ttfa_ms_p50: f64,
    pub engine_ttfa_ms_p99: f64,
    /// The engine's `Timings::ttft`.
    pub ttft_ms_p50: f64,
    /// The engine's time of the reply's last token.
    pub reply_end_ms_p50: f64,
    /// To `Event::Finished`, caller side.
    pub total_ms_p50: f64,
    /// Silence a listener playing each chunk as it arrives hears after the
    /// first audio (chunks later than the audio before them lasts), per request.
    pub stall_ms_p50: f64,
    pub stall_ms_p99: f64,
}

/// One (cache mode, concurrency) run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RunReport {
    pub cache: bool,
    pub concurrency: usize,
    pub conversations: usize,
    pub duration_s: f64,
    pub rounds: Vec<RoundReport>,
    /// Rounds 2.. pooled.
    pub later_rounds: RoundReport,
    /// Caller TTFA p50 over every request of the run.
    pub ttfa_ms_p50_all: f64,
    /// At the run's end: the talker's accept layer as the thinker keeps it
    /// (rows at item positions only, `stats().item_capture`), and the tokens the
    /// pool caches; paging that layer would cost `hidden × 4` bytes at every one.
    pub accept_rows_held: usize,
    pub accept_bytes_held: usize,
    pub pool_tokens_cached: usize,
}

/// Medians (ms) of where the first audio's time went, rounds 2.. of one run,
/// from the engine's timings and the handle's events.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Breakdown {
    pub cache: bool,
    pub concurrency: usize,
    /// Preparation (fingerprints, prompt, checks), `Timings::preprocess`.
    pub prepare_ms: f64,
    /// Preparation to the first reply token (queue + thinker prefill + first sample): `Timings::ttft - preprocess`.
    pub thinker_prefill_ms: f64,
    /// The first reply token to the first audio chunk made (`Timings::ttfa - ttft`):
    /// the talker waits for the reply's first token to run, then its prefill, its
    /// first frames (each waiting for a reply token to run) and code2wav's first
    /// chunk. The engine does not report that split: see the probe.
    pub first_token_to_audio_ms: f64,
    /// For context: the reply's last token minus the first audio chunk made (positive:
    /// the audio started before the reply ended, as the talker streams beside the thinker).
    pub audio_before_reply_end_ms: f64,
    /// The first chunk made (`Timings::ttfa`) to its `Event::Audio` reaching the caller.
    pub audio_delivery_ms: f64,
    /// The caller's TTFA (sum of the above, up to rounding of medians).
    pub ttfa_ms: f64,
}

/// The talker and code2wav of the same model timed alone at the measured
/// shapes, outside the engine (no events: direct calls), to split
/// `first_token_to_audio_ms`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StageProbe {
    /// Talker prompt rows timed (the median of the cached rounds 2.., c=1, uncached).
    pub talker_rows: usize,
    /// Talker prefill of those rows + its first frame (first code + the code predictor).
    pub talker_prefill_first_frame_ms: f64,
    /// Each later frame (median).
    pub talker_frame_ms: f64,
    /// code2wav's decode of its first chunk (`first_chunk` frames).
    pub code2wav_first_chunk_ms: f64,
    /// code2wav's one pass over the reply's frames, per frame (the cost every chunk after the first pays).
    pub code2wav_ms_per_frame: f64,
    /// Talker prefill + frames up to `first_chunk` + the first decode.
    pub first_audio_after_talker_start_ms: f64,
}

/// `bench ttfa`'s report (`--json`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TtfaReport {
    pub bench: &'static str,
    pub machine: MachineInfo,
    pub size: Size,
    pub shapes: Shapes,
    pub dtype: &'static str,
    pub rounds: usize,
    pub max_tokens: usize,
    pub frames: usize,
    pub first_chunk: usize,
    pub chunk: usize,
    /// The scheduler's prefill cap in tokens (`None`: uncapped).
    pub prefill_cap: Option<usize>,
    /// Milliseconds a playing reply's decodes may wait past its audio for
    /// another's first audio (`None`: they never wait).
    pub audio_yield_ms: Option<f64>,
    pub mm_scale: u32,
    pub image_tokens: usize,
    pub audio_tokens: usize,
    pub runs: Vec<RunReport>,
    /// Caller TTFA p50, rounds 2.., c=1: cached / uncached (the headline).
    pub later_rounds_cached_over_uncached_c1: f64,
    /// Per round, the same ratio at c=1.
    pub cached_over_uncached_c1_by_round: Vec<f64>,
    /// Caller TTFA p50 (all rounds) at the highest concurrency over c=1: caching on, off.
    pub top_c: usize,
    pub ttfa_p50_top_c_over_c1_cached: f64,
    pub ttfa_p50_top_c_over_c1_uncached: f64,
    pub breakdown: Vec<Breakdown>,
    pub probe: Option<StageProbe>,
    /// Phases the engine does not report, named so a reader does not look for them.
    pub not_exposed: Vec<&'static str>,
}

/// One request's figures.
#[derive(Debug, Clone, Default)]
struct Sample {
    round: usize,
    prompt_tokens: usize,
    cached_tokens: usize,
    talker_prompt_rows: usize,
    talker_cached_rows: usize,
    frames: usize,
    audio_samples: usize,
    ttfa: Duration,
    /// See [`RoundReport::stall_ms_p50`].
    stall: Duration,
    timings: Timings,
    total: Duration,
}

/// One conversation's items: an image, then one audio per round.
struct Conversation {
    tenant: TenantSalt,
    system: Vec<u32>,
    image: MediaItem,
    audio: Vec<MediaItem>,
    /// The user's words per round.
    words: Vec<Vec<u32>>,
}

/// Runs the benchmark on `thinker` (and a talker and code2wav of `configs`).
pub fn run<B: Backend + 'static>(
    backend: Arc<B>, configs: OmniConfigs, options: &TtfaOptions, machine: MachineInfo,
) -> Result<TtfaReport> {
    let o = options;
    let thinker = Arc::new(Thinker::random_as(&*backend, configs.thinker.clone(), o.seed, o.dtype)?);
    let bench = Bench::new(backend, thinker, &configs, o)?;
    let mut runs = Vec::new();
    let mut samples_c1 = Vec::new();
    // Both engines live at once, and each concurrency runs caching on, then off, back to
    // back: a shared machine's speed drifts over minutes, and a ratio of runs taken minutes
    // apart measured the drift as much as the cache.
    let engines = [true, false]
        .into_iter()
        .map(|cache| Ok((cache, bench.engine(cache)?.serve(ServedOptions::default())?)))
        .collect::<Result<Vec<_>>>()?;
    for (cache, served) in &engines {
        bench.warm(served, *cache)?;
    }
    for &c in &o.concurrency {
        for (cache, served) in &engines {
            let (report, samples) = bench.run(served, *cache, c.max(1))?;
            if c == 1 {
                samples_c1.push((*cache, samples));
            }
            runs.push(report);
        }
    }
    drop(engines);
    // Reported caching on first, then off, each by concurrency, as before.
    runs.sort_by_key(|r| (!r.cache, r.concurrency));
    let probe = Some(bench.probe(&runs)?);
    let find = |cache: bool, c: usize| runs.iter().find(|r| r.cache == cache && r.concurrency == c);
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    let (on1, off1) = (find(true, 1), find(false, 1));
    let later = match (on1, off1) {
        (Some(a), Some(b)) => ratio(a.later_rounds.ttfa_ms_p50, b.later_rounds.ttfa_ms_p50),
        _ => f64::NAN,
    };
    let by_round = match (on1, off1) {
        (Some(a), Some(b)) => {
            a.rounds.iter().zip(&b.rounds).map(|(x, y)| ratio(x.ttfa_ms_p50, y.ttfa_ms_p50)).collect()
        }
        _ => Vec::new(),
    };
    let top_c = o.concurrency.iter().copied().max().unwrap_or(1);
    let over_c1 = |cache: bool| match (find(cache, top_c), find(cache, 1)) {
        (Some(t), Some(one)) => ratio(t.ttfa_ms_p50_all, one.ttfa_ms_p50_all),
        _ => f64::NAN,
    };
    let breakdown = samples_c1.iter().map(|(cache, s)| breakdown(*cache, 1, s)).collect();
    Ok(TtfaReport {
        bench: "ttfa",
        machine,
        size: o.size,
        shapes: bench.shapes.clone(),
        dtype: bench.thinker.dtype().name(),
        rounds: o.rounds,
        max_tokens: o.max_tokens,
        frames: o.frames,
        first_chunk: o.first_chunk,
        chunk: o.chunk,
        prefill_cap: SchedulerConfig { prefill_cap: o.prefill_cap, ..Default::default() }
            .prefill_cap_tokens(),
        audio_yield_ms: o.audio_yield.map(millis),
        mm_scale: o.mm_scale,
        image_tokens: bench.image_tokens,
        audio_tokens: bench.audio_tokens,
        later_rounds_cached_over_uncached_c1: later,
        cached_over_uncached_c1_by_round: by_round,
        top_c,
        ttfa_p50_top_c_over_c1_cached: over_c1(true),
        ttfa_p50_top_c_over_c1_uncached: over_c1(false),
        runs,
        breakdown,
        probe,
        not_exposed: vec![
            "talker prefill, talker frames and code2wav chunks inside the engine: no event or timing marks them (the probe times them outside)",
            "when the talker starts: inferred from the reply's last token time and Timings::ttfa only",
        ],
    })
}

struct Bench<'a, B: Backend> {
    backend: Arc<B>,
    thinker: Arc<Thinker<B>>,
    configs: &'a OmniConfigs,
    options: &'a TtfaOptions,
    shapes: Shapes,
    tokens: OmniTokens,
    image_tokens: usize,
    audio_tokens: usize,
}

impl<'a, B: Backend + 'static> Bench<'a, B> {
    fn new(
        backend: Arc<B>, thinker: Arc<Thinker<B>>, configs: &'a OmniConfigs, options: &'a TtfaOptions,
    ) -> Result<Self> {
        let c = &configs.code2wav;
        let shapes = Shapes {
            thinker: DecoderShape::of(thinker.config()),
            talker: DecoderShape::of(&configs.talker.text),
            code_predictor: DecoderShape::of(&configs.talker.code_predictor),
            code_groups: configs.talker.num_code_groups,
            accept_hidden_layer: configs.talker.accept_hidden_layer,
            code2wav_hidden: c.hidden_size,
            code2wav_layers: c.num_hidden_layers,
            code2wav_heads: c.num_attention_heads,
            code2wav_intermediate: c.intermediate_size,
            code2wav_window: c.sliding_window,
            code2wav_upsampling_ratios: c.upsampling_ratios.clone(),
            code2wav_upsample_rates: c.upsample_rates.clone(),
            code2wav_decoder_dim: c.decoder_dim,
            samples_per_frame: c.total_upsample(),
            sample_rate: c.sample_rate,
            thinker_mib: thinker.weight_bytes() as f64 / (1u64 << 20) as f64,
        };
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let image_tokens = MediaItem::random(Modality::Image, options.mm_scale, 1, &mut rng)?.tokens;
        let audio_tokens = MediaItem::random(Modality::Audio, options.mm_scale, 1, &mut rng)?.tokens;
        Ok(Bench {
            backend,
            thinker,
            configs,
            options,
            shapes,
            tokens: OmniTokens::qwen3_omni(),
            image_tokens,
            audio_tokens,
        })
    }

    /// A speech stage over the shared thinker: seeded, so every engine's is the same.
    fn stage(&self) -> Result<SpeechStage<B>> {
        let b = &*self.backend;
        let talker = Talker::random(b, self.configs.talker.clone(), self.options.seed.wrapping_add(10))?;
        let code2wav =
            Code2Wav::random(b, self.configs.code2wav.clone(), self.options.seed.wrapping_add(20))?;
        Ok(SpeechStage::new(
            Arc::clone(&self.backend),
            Arc::clone(&self.thinker),
            talker,
            code2wav,
            QWEN3_OMNI_CHAT,
        ))
    }

    /// The longest prompt of a conversation (its last round, reply included).
    fn longest(&self) -> usize {
        let o = self.options;
        60 + self.image_tokens + o.rounds * (self.audio_tokens + 30 + o.max_tokens)
    }

    fn engine(&self, cache: bool) -> Result<Engine<B>> {
        let o = self.options;
        let in_flight = o.concurrency.iter().copied().max().unwrap_or(1);
        // Every conversation in flight twice over, and room for the cache to keep some.
        let num_blocks = (3 * in_flight + 2) * self.longest().div_ceil(o.block_size) + 64;
        let config = EngineConfig {
            scheduler: SchedulerConfig {
                block_size: o.block_size,
                num_blocks,
                prefill_cap: o.prefill_cap,
                ..Default::default()
            },
            capture: Some(Vec::new()),
            cache,
            tokens: Some(self.tokens.clone()),
            kv_dtype: o.kv_dtype,
            audio_yield: o.audio_yield,
            ..Default::default()
        };
        let engine = Engine::with_speech(
            Arc::clone(&self.backend),
            Arc::clone(&self.thinker),
            config,
            Some(self.stage()?),
        )?;
        Ok(engine)
    }

    fn conversation(&self, index: usize, salt: u64) -> Result<Conversation> {
        let o = self.options;
        let mut rng = ChaCha8Rng::seed_from_u64(o.seed ^ (salt << 32) ^ index as u64);
        let h = self.thinker.config().hidden_size;
        let limit = text_id_limit(&self.tokens, self.thinker.config().vocab_size);
        let text = |rng: &mut ChaCha8Rng, n: usize| -> Vec<u32> {
            (0..n).map(|_| rng.random_range(0..limit)).collect()
        };
        let system = text(&mut rng, 32);
        let words = (0..o.rounds).map(|_| text(&mut rng, 12)).collect();
        let image = MediaItem::random(Modality::Image, o.mm_scale, h, &mut rng)?;
        let audio = (0..o.rounds)
            .map(|_| MediaItem::random(Modality::Audio, o.mm_scale, h, &mut rng))
            .collect::<Result<_>>()?;
        Ok(Conversation { tenant: 1 + (salt << 20) + index as TenantSalt, system, image, audio, words })
    }

    /// One conversation of its own (salt 0 or 1, which no run uses) before any run: the
    /// first requests of a fresh engine touch its pool's pages for the first time, and
    /// caching on ran first, so its round 1 paid that alone (up to 1.5 × caching off's).
    fn warm(&self, served: &ServedEngine, cache: bool) -> Result<()> {
        self.converse(served, &self.conversation(0, u64::from(cache))?).map(drop)
    }

    /// One closed-loop run: `c` callers, each running whole conversations in turn.
    fn run(&self, served: &ServedEngine, cache: bool, c: usize) -> Result<(RunReport, Vec<Sample>)> {
        let o = self.options;
        let conversations = o.conversations.max(c);
        // Fresh conversations (tenants and media) per run: nothing carries over.
        let salt = (c as u64) << 1 | u64::from(cache);
        let convs = (0..conversations).map(|i| self.conversation(i, salt)).collect::<Result<Vec<_>>>()?;
        let next = AtomicUsize::new(0);
        let samples = Mutex::new(Vec::new());
        let start = Instant::now();
        std::thread::scope(|scope| -> Result<()> {
            let workers: Vec<_> = (0..c)
                .map(|_| {
                    scope.spawn(|| -> Result<()> {
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some(conv) = convs.get(i) else { return Ok(()) };
                            let got = self.converse(served, conv)?;
                            samples.lock().unwrap_or_else(|p| p.into_inner()).extend(got);
                        }
                    })
                })
                .collect();
            for w in workers {
                w.join()
                    .map_err(|_| Component::Engine.violation("bench ttfa: a caller thread panicked"))??;
            }
            Ok(())
        })?;
        let duration_s = start.elapsed().as_secs_f64();
        let samples = samples.into_inner().unwrap_or_else(|p| p.into_inner());
        let rounds =
            (1..=o.rounds).map(|r| round_report(r, samples.iter().filter(|s| s.round == r))).collect();
        let later_rounds = round_report(0, samples.iter().filter(|s| s.round >= 2));
        let ttfa_ms_p50_all = median_of(samples.iter().map(|s| millis(s.ttfa)));
        let stats = served.stats()?;
        let held = stats.item_capture.unwrap_or_default();
        let report = RunReport {
            cache,
            concurrency: c,
            conversations,
            duration_s,
            rounds,
            later_rounds,
            ttfa_ms_p50_all,
            accept_rows_held: held.rows,
            accept_bytes_held: held.bytes,
            pool_tokens_cached: stats.sched.blocks_cached * o.block_size,
        };
        Ok((report, samples))
    }

    /// Every round of `conv` in order, each re-sending the whole conversation.
    fn converse(&self, served: &ServedEngine, conv: &Conversation) -> Result<Vec<Sample>> {
        let o = self.options;
        let t = &self.tokens;
        let chat = QWEN3_OMNI_CHAT;
        let mut ids = vec![chat.im_start_token_id, SYSTEM, NEWLINE];
        ids.extend(&conv.system);
        ids.extend([IM_END, NEWLINE]);
        let mut items: Vec<&MediaItem> = Vec::new();
        let mut out = Vec::new();
        for round in 0..o.rounds {
            if round > 0 {
                ids.extend([IM_END, NEWLINE]);
            }
            ids.extend([chat.im_start_token_id, chat.user_token_id, NEWLINE]);
            if round == 0 {
                ids.extend([t.vision_start_token_id, t.image_token_id, t.vision_end_token_id]);
                items.push(&conv.image);
            }
            ids.extend([t.audio_start_token_id, t.audio_token_id, t.audio_end_token_id]);
            items.push(&conv.audio[round]);
            ids.extend(&conv.words[round]);
            ids.extend([IM_END, NEWLINE, chat.im_start_token_id, chat.assistant_token_id, NEWLINE]);
            let (sample, reply) = self.speak(served, conv.tenant, &ids, &items, round + 1)?;
            ids.extend(reply);
            out.push(sample);
        }
        Ok(out)
    }

    /// One spoken round: submit, read the events as they come.
    fn speak(
        &self, served: &ServedEngine, tenant: TenantSalt, ids: &[u32], items: &[&MediaItem], round: usize,
    ) -> Result<(Sample, Vec<u32>)> {
        let o = self.options;
        let vocab = self.thinker.config().vocab_size as u32;
        // Fixed length: eos ignored, and no control id (a reply re-sent must not open a turn).
        let params = SamplingParams {
            ignore_eos: true,
            suppress_ids: (151_643..vocab).collect(),
            seed: Some(o.seed),
            ..SamplingParams::greedy(o.max_tokens)
        };
        let speech = SpeechOptions {
            talker: TalkerSampling { max_new_tokens: o.frames + 1, seed: o.seed, ..TalkerSampling::greedy() },
            first_chunk: o.first_chunk,
            chunk: o.chunk,
            ..SpeechOptions::default()
        };
        let inputs: Vec<ItemInput<'_>> = items.iter().map(|m| m.input()).collect();
        let request = Request { tenant, token_ids: ids.to_vec(), items: inputs, ..Default::default() }
            .generate(params)
            .speak(speech);
        let t0 = Instant::now();
        let mut handle = served.submit(request)?;
        let mut first_audio = None;
        let mut playback = Playback::new(self.configs.code2wav.sample_rate);
        while let Some(event) = handle.recv() {
            match event? {
                Event::Token(_) => {}
                Event::Audio(audio) => {
                    first_audio.get_or_insert_with(|| t0.elapsed());
                    playback.arrived(audio.samples.len());
                }
                Event::Finished(out) => {
                    let speech = out.speech.as_ref();
                    let sample = Sample {
                        round,
                        prompt_tokens: out.prompt_len,
                        cached_tokens: out.num_cached_tokens,
                        talker_prompt_rows: speech.map_or(0, |s| s.talker_prompt_rows),
                        talker_cached_rows: speech.map_or(0, |s| s.talker_cached_rows),
                        frames: speech.map_or(0, |s| s.codes.ncols()),
                        audio_samples: speech.map_or(0, |s| s.audio.len()),
                        ttfa: first_audio.ok_or(HarnessError::NoOutput { what: "a spoken round's audio" })?,
                        stall: playback.stall,
                        timings: out.timings.clone(),
                        total: t0.elapsed(),
                    };
                    return Ok((sample, out.tokens));
                }
            }
        }
        let what = format!("bench ttfa: request {} ended without finishing", handle.id());
        Err(Component::Engine.violation(what).into())
    }

    /// The talker and code2wav alone at the measured talker prompt size.
    fn probe(&self, runs: &[RunReport]) -> Result<StageProbe> {
        let o = self.options;
        let rows = runs
            .iter()
            .find(|r| !r.cache && r.concurrency == 1)
            .or(runs.first())
            .map_or(64, |r| r.later_rounds.talker_prompt_rows.max(r.rounds[0].talker_prompt_rows))
            .max(1);
        let stage = self.stage()?;
        let b = &self.backend;
        let hidden = self.configs.talker.text.hidden_size;
        let mut rng = ChaCha8Rng::seed_from_u64(o.seed ^ 0x9E0B);
        let mut random = |n: usize| Array2::from_shape_simple_fn((n, hidden), || rng.random::<f32>() - 0.5);
        let inputs = TalkerInputs::linear(random(rows), random(o.max_tokens), random(1));
        let sampling =
            TalkerSampling { max_new_tokens: o.frames + 1, seed: o.seed, ..TalkerSampling::greedy() };
        // Once untimed (pages, thread pools), then timed.
        stage.talker().generate(b, &inputs, &sampling, |_: &[u32]| Ok(()))?;
        let start = Instant::now();
        let mut at = Vec::new();
        let mut frames = Vec::new();
        stage.talker().generate(b, &inputs, &sampling, |f: &[u32]| {
            at.push(start.elapsed());
            frames.push(f.to_vec());
            Ok(())
        })?;
        let first = at.first().copied().unwrap_or_default();
        let gaps: Vec<f64> = at.windows(2).map(|w| millis(w[1] - w[0])).collect();
        let groups = self.configs.talker.num_code_groups;
        let code2wav = stage.code2wav();
        let decode_first = || -> Result<Duration> {
            let mut stream = Code2WavStream::new(code2wav, o.first_chunk, o.chunk)?;
            let mut took = Duration::ZERO;
            for f in frames.iter().take(o.first_chunk) {
                let codes = Array2::from_shape_fn((groups, 1), |(q, _)| i64::from(f[q]));
                let t = Instant::now();
                let audio = stream.push(&**b, codes.view())?;
                if !audio.is_empty() {
                    took = t.elapsed();
                    break;
                }
            }
            Ok(took)
        };
        // Once untimed, then timed.
        decode_first()?;
        let c2w = decode_first()?;
        let all = Array2::from_shape_fn((groups, frames.len()), |(q, t)| i64::from(frames[t][q]));
        code2wav.forward(&**b, all.view())?; // untimed: the first pass of this size allocates
        let start = Instant::now();
        code2wav.forward(&**b, all.view())?;
        let per_frame = millis(start.elapsed()) / frames.len().max(1) as f64;
        let until_chunk = at.get(o.first_chunk.saturating_sub(1)).copied().unwrap_or(first);
        Ok(StageProbe {
            talker_rows: rows,
            talker_prefill_first_frame_ms: millis(first),
            talker_frame_ms: percentile(&gaps, 50.0),
            code2wav_first_chunk_ms: millis(c2w),
            code2wav_ms_per_frame: per_frame,
            first_audio_after_talker_start_ms: millis(until_chunk + c2w),
        })
    }
}

/// A listener who plays each audio chunk as soon as it arrives: the silence it
/// hears after the first chunk, when a chunk comes later than the audio before it ends.
struct Playback {
    sample_rate: f64,
    /// When the audio received so far stops playing (none before the first chunk).
    ends: Option<Instant>,
    stall: Duration,
}

impl Playback {
    fn new(sample_rate: u32) -> Self {
        Playback { sample_rate: f64::from(sample_rate), ends: None, stall: Duration::ZERO }
    }

    fn arrived(&mut self, samples: usize) {
        self.arrived_at(Instant::now(), samples);
    }

    fn arrived_at(&mut self, now: Instant, samples: usize) {
        let start = match self.ends {
            Some(ends) if ends < now => {
                self.stall += now - ends;
                now
            }
            Some(ends) => ends,
            None => now,
        };
        self.ends = Some(start + Duration::from_secs_f64(samples as f64 / self.sample_rate));
    }
}

fn median_of(v: impl Iterator<Item = f64>) -> f64 {
    percentile(&v.collect::<Vec<_>>(), 50.0)
}

fn median_usize(v: impl Iterator<Item = usize>) -> usize {
    let m = median_of(v.map(|x| x as f64));
    if m.is_nan() { 0 } else { m.round() as usize }
}

fn round_report<'s>(round: usize, samples: impl Iterator<Item = &'s Sample> + Clone) -> RoundReport {
    let ms = |f: fn(&Sample) -> f64| samples.clone().map(f).collect::<Vec<f64>>();
    let ttfa = ms(|s| millis(s.ttfa));
    let engine = ms(|s| s.timings.ttfa.map_or(f64::NAN, millis));
    RoundReport {
        round,
        requests: samples.clone().count(),
        prompt_tokens: median_usize(samples.clone().map(|s| s.prompt_tokens)),
        cached_tokens: median_usize(samples.clone().map(|s| s.cached_tokens)),
        talker_prompt_rows: median_usize(samples.clone().map(|s| s.talker_prompt_rows)),
        talker_cached_rows: median_usize(samples.clone().map(|s| s.talker_cached_rows)),
        frames: median_usize(samples.clone().map(|s| s.frames)),
        audio_samples: median_usize(samples.clone().map(|s| s.audio_samples)),
        ttfa_ms_p50: percentile(&ttfa, 50.0),
        ttfa_ms_p99: percentile(&ttfa, 99.0),
        engine_ttfa_ms_p50: percentile(&engine, 50.0),
        engine_ttfa_ms_p99: percentile(&engine, 99.0),
        ttft_ms_p50: percentile(&ms(|s| millis(s.timings.ttft)), 50.0),
        reply_end_ms_p50: percentile(
            &ms(|s| s.timings.token_times.last().map_or(f64::NAN, |t| millis(*t))),
            50.0,
        ),
        total_ms_p50: percentile(&ms(|s| millis(s.total)), 50.0),
        stall_ms_p50: percentile(&ms(|s| millis(s.stall)), 50.0),
        stall_ms_p99: percentile(&ms(|s| millis(s.stall)), 99.0),
    }
}

fn breakdown(cache: bool, concurrency: usize, samples: &[Sample]) -> Breakdown {
    let later: Vec<&Sample> = samples.iter().filter(|s| s.round >= 2).collect();
    let med = |f: &dyn Fn(&Sample) -> f64| median_of(later.iter().map(|s| f(s)));
    let last = |s: &Sample| s.timings.token_times.last().map_or(f64::NAN, |t| millis(*t));
    let engine_ttfa = |s: &Sample| s.timings.ttfa.map_or(f64::NAN, millis);
    Breakdown {
        cache,
        concurrency,
        prepare_ms: med(&|s| millis(s.timings.preprocess)),
        thinker_prefill_ms: med(&|s| millis(s.timings.ttft.saturating_sub(s.timings.preprocess))),
        first_token_to_audio_ms: med(&|s| engine_ttfa(s) - millis(s.timings.ttft)),
        audio_before_reply_end_ms: med(&|s| last(s) - engine_ttfa(s)),
        audio_delivery_ms: med(&|s| millis(s.ttfa) - engine_ttfa(s)),
        ttfa_ms: med(&|s| millis(s.ttfa)),
    }
}

/// The human table of a report.
pub fn table(r: &TtfaReport) -> Vec<String> {
    let m = &r.machine;
    let mut out = vec![
        format!("backend: {}", m.backend),
        format!(
            "machine: {} ({} cores, {} threads; {})",
            m.cpu_model,
            m.cores,
            m.threads,
            if m.cpu_features.is_empty() { "no AVX2".into() } else { m.cpu_features.join(" ") }
        ),
        format!(
            "model ({:?}, {}): random full Omni; {} rounds, reply {} tokens, {} frames ({} samples), first chunk {} frames; image {} tokens, audio {} tokens; prefill cap {}; audio yield {}",
            r.size,
            r.dtype,
            r.rounds,
            r.max_tokens,
            r.frames,
            r.frames * r.shapes.samples_per_frame,
            r.first_chunk,
            r.image_tokens,
            r.audio_tokens,
            r.prefill_cap.map_or("off".to_string(), |c| format!("{c} tokens")),
            r.audio_yield_ms.map_or("off".to_string(), |ms| format!("{ms:.0} ms"))
        ),
    ];
    out.extend(r.shapes.lines().into_iter().map(|l| format!("  {l}")));
    out.push(format!(
        "{:<5} {:>2} {:>5} {:>6} {:>6} {:>7} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "cache",
        "c",
        "round",
        "prompt",
        "hit",
        "talker",
        "t.hit",
        "ttft p50",
        "reply end",
        "ttfa p50",
        "ttfa p99",
        "eng p50",
        "stall p50"
    ));
    for run in &r.runs {
        for x in run.rounds.iter().chain([&run.later_rounds]) {
            let round = if x.round == 0 { "2..".to_string() } else { x.round.to_string() };
            out.push(format!(
                "{:<5} {:>2} {:>5} {:>6} {:>6} {:>7} {:>7} {:>7.1}ms {:>7.1}ms {:>7.1}ms {:>7.1}ms {:>7.1}ms {:>7.1}ms",
                if run.cache { "on" } else { "off" },
                run.concurrency,
                round,
                x.prompt_tokens,
                x.cached_tokens,
                x.talker_prompt_rows,
                x.talker_cached_rows,
                x.ttft_ms_p50,
                x.reply_end_ms_p50,
                x.ttfa_ms_p50,
                x.ttfa_ms_p99,
                x.engine_ttfa_ms_p50,
                x.stall_ms_p50
            ));
        }
    }
    out.push(format!(
        "TTFA p50 rounds 2.., c=1: cached / uncached = {:.3} (by round: {})",
        r.later_rounds_cached_over_uncached_c1,
        r.cached_over_uncached_c1_by_round.iter().map(|x| format!("{x:.3}")).collect::<Vec<_>>().join(", ")
    ));
    out.push(format!(
        "TTFA p50 at c={} / c=1: {:.2} caching on, {:.2} off",
        r.top_c, r.ttfa_p50_top_c_over_c1_cached, r.ttfa_p50_top_c_over_c1_uncached
    ));
    if let Some(run) = r.runs.iter().find(|run| run.cache && run.pool_tokens_cached > 0) {
        let paged = r.shapes.thinker.hidden * 4;
        out.push(format!(
            "accept layer kept at item positions (c={}, run's end): {} rows, {} bytes over {} cached tokens = {:.0} B a token (paged at every position: {paged} B)",
            run.concurrency,
            run.accept_rows_held,
            run.accept_bytes_held,
            run.pool_tokens_cached,
            run.accept_bytes_held as f64 / run.pool_tokens_cached as f64
        ));
    }
    for b in &r.breakdown {
        out.push(format!(
            "first audio, rounds 2.., c={}, caching {}: prepare {:.1} + thinker prefill {:.1} + first token -> first chunk {:.1} + delivery {:.1} = {:.1} ms ({:.1} ms before the reply's last token)",
            b.concurrency,
            if b.cache { "on" } else { "off" },
            b.prepare_ms,
            b.thinker_prefill_ms,
            b.first_token_to_audio_ms,
            b.audio_delivery_ms,
            b.ttfa_ms,
            b.audio_before_reply_end_ms
        ));
    }
    if let Some(p) = &r.probe {
        out.push(format!(
            "probe (outside the engine, {} talker rows): talker prefill + first frame {:.1} ms, then {:.1} ms/frame; code2wav first chunk {:.1} ms, then {:.1} ms/frame; talker start -> first audio {:.1} ms",
            p.talker_rows,
            p.talker_prefill_first_frame_ms,
            p.talker_frame_ms,
            p.code2wav_first_chunk_ms,
            p.code2wav_ms_per_frame,
            p.first_audio_after_talker_start_ms
        ));
    }
    for n in &r.not_exposed {
        out.push(format!("not exposed by the engine: {n}"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn playback_counts_the_silence_between_late_chunks() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut p = Playback::new(24_000);
        p.arrived_at(t0, 2400); // 100 ms of audio, playing until t0 + 100 ms
        p.arrived_at(t0 + ms(150), 2400); // 50 ms late: plays until 250 ms
        p.arrived_at(t0 + ms(200), 4800); // early: queued, plays until 450 ms
        assert_eq!(p.stall, ms(50));
        p.arrived_at(t0 + ms(500), 240); // 50 ms late again
        assert_eq!(p.stall, ms(100));
    }
}
