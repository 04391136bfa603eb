//! `omniprefix demo`: the three claims in one run.
//!
//! A seeded random-weight Omni-style thinker (or a checkpoint) runs the
//! `rfc_text_pair`, the 4-round multimodal conversation and a
//! `prefix_repetition` batch three ways — omniprefix's radix index, vLLM's
//! hash chain, and no cache — and reports per request: cached tokens, the cost
//! of matching against one plain read of the input, TTFT against the uncached
//! run, and how far the returned full hidden states are from the uncached ones.
//!
//! ```
//! use std::sync::Arc;
//! use omniprefix::backend::cpu::CpuBackend;
//! use omniprefix_cli::demo::{DemoOptions, ModelChoice, run_demo};
//!
//! let options = DemoOptions::quick();
//! let report = run_demo(Arc::new(CpuBackend::new()), "cpu".into(), &ModelChoice::Random, &options)?;
//! let rfc = &report.workloads[0]; // rfc_text_pair: rows per way, then per request
//! let radix = rfc.rows.iter().filter(|r| r.way.as_str() == "radix").nth(1).expect("two requests");
//! assert_eq!((radix.prompt_tokens, radix.cached_tokens), (57, 46));
//! assert!(radix.max_rel_diff_hidden <= 1e-4);
//! # Ok::<(), omniprefix_cli::HarnessError>(())
//! ```

mod machine;
mod pipeline;
mod report;
mod speech;
mod workloads;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressStyle};

use crate::bench::median_ns;
use crate::error::Result;
use crate::workloads::{RequestPlan, conversation_turns};
use omniprefix::backend::Backend;
use omniprefix::canon::{FingerprintKey, Modality};
use omniprefix::model::{Config, Thinker};

pub use machine::Machine;
pub use pipeline::{BLOCK_SIZE, ItemEmbeddings, RequestRun, Way, WayInputs, run_conversation, run_way};
pub use report::{
    DemoReport, MediaInfo, ModelInfo, RequestFacts, Row, Summary, WorkloadReport, print_summary,
    print_tables, rel_diff, workload_rows,
};
pub use speech::{
    SPOKEN_TURNS, SpokenChatOptions, SpokenChatReport, SpokenRound, default_speech_model, has_talker,
    print_spoken_chat, run_spoken_chat, spoken_summary_line,
};
pub use workloads::{DemoScale, DemoWorkload, Wave, demo_media, expanded_len, waves};

/// Temporal grid steps of the default demo's video: all 10 of the real clip
/// (20 s, 20 frames of 1280x720, 7200 tokens); the whole demo takes ~20 s on 2 cores.
/// Fewer steps (`--video-grid-t`) make a quicker run.
pub const DEFAULT_VIDEO_GRID_T: u32 = 10;

/// Which thinker runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelChoice {
    /// Seeded random weights of [`demo_config`].
    Random,
    /// A Hugging Face checkpoint directory (`config.json` + safetensors).
    Dir(PathBuf),
}

/// What the demo runs and how.
#[derive(Debug, Clone, PartialEq)]
pub struct DemoOptions {
    pub workloads: Vec<DemoWorkload>,
    pub scale: DemoScale,
    /// Seed of the weights, media, item embeddings, text ids and fingerprint key.
    pub seed: u64,
    /// Threads of the fingerprinter.
    pub fingerprint_threads: usize,
    /// Draw progress bars on stderr (they hide themselves when it is not a terminal).
    pub show_progress: bool,
}

impl DemoOptions {
    /// The default demo: every workload, real item shapes, the video cut to
    /// [`DEFAULT_VIDEO_GRID_T`] grid steps.
    pub fn full() -> Result<Self> {
        Ok(DemoOptions {
            workloads: DemoWorkload::value_variants().to_vec(),
            scale: DemoScale::full(DEFAULT_VIDEO_GRID_T)?,
            seed: 0x0de0,
            fingerprint_threads: 1,
            show_progress: true,
        })
    }

    /// The CI demo: every workload at [`DemoScale::quick`], no progress bars.
    pub fn quick() -> Self {
        DemoOptions {
            workloads: DemoWorkload::value_variants().to_vec(),
            scale: DemoScale::quick(),
            seed: 0x0de0,
            fingerprint_threads: 1,
            show_progress: false,
        }
    }

    fn is_quick(&self) -> bool {
        !self.scale.full_media
    }
}

/// The random demo thinker: Qwen3-Omni-style (MoE with 8 experts, top-2,
/// interleaved M-RoPE, qk-norm) with Qwen's real vocabulary; hidden 256 and
/// 4 layers, or hidden 64 and 2 layers for `quick`.
pub fn demo_config(quick: bool) -> Config {
    const QWEN_VOCAB: usize = 151_936;
    let (hidden, layers, heads, kv_heads) = if quick { (64, 2, 4, 2) } else { (256, 4, 4, 2) };
    Config {
        tie_word_embeddings: true,
        ..Config::tiny_qwen3_omni_moe(hidden, layers, heads, kv_heads, QWEN_VOCAB, 8, 2)
    }
}

/// Runs the demo on `backend` (described as `backend_label` in the report).
pub fn run_demo<B: Backend>(
    backend: Arc<B>, backend_label: String, model: &ModelChoice, options: &DemoOptions,
) -> Result<DemoReport> {
    let start = Instant::now();
    let (thinker, source) = match model {
        ModelChoice::Random => {
            (Thinker::random(&*backend, demo_config(options.is_quick()), options.seed)?, "random".to_string())
        }
        ModelChoice::Dir(dir) => (Thinker::from_dir(&*backend, dir)?, dir.display().to_string()),
    };
    let model_info = model_info(thinker.config(), source);
    let thinker = Arc::new(thinker);
    let media = demo_media(&options.scale, options.seed)?;
    let embeddings = ItemEmbeddings::random(&media, thinker.config().hidden_size, options.seed);
    let inputs = WayInputs {
        backend: &backend,
        thinker: &thinker,
        media: &media,
        embeddings: &embeddings,
        max_tokens_per_step: options.scale.max_tokens_per_step,
        fingerprint_key: FingerprintKey::fixed(options.seed),
        fingerprint_threads: options.fingerprint_threads,
    };
    // One untimed prefill first, so no way pays the first run's page faults and allocations.
    let warmup = waves(DemoWorkload::RfcTextPair, &options.scale, options.seed)?;
    run_way(&inputs, Way::NoCache, &warmup[..1], &ProgressBar::hidden())?;
    let mut workload_reports = Vec::new();
    for &workload in &options.workloads {
        let waves = waves(workload, &options.scale, options.seed)?;
        let total = waves.iter().flatten().map(|p| expanded_len(p, &media)).sum::<usize>();
        let turns = conversation_turns()?;
        let mut runs = Vec::new();
        // The prompts the reference (no cache, first) sent: a conversation's depend on its replies.
        let mut sent: Option<Vec<RequestPlan>> = None;
        for way in Way::ALL {
            let progress =
                progress_bar(options.show_progress, format!("{workload} / {}", way.as_str()), total);
            let (way_runs, plans) = match workload {
                DemoWorkload::MultiRound => {
                    run_conversation(&inputs, way, &turns, options.scale.reply_tokens, &progress)?
                }
                _ => (run_way(&inputs, way, &waves, &progress)?, waves.iter().flatten().cloned().collect()),
            };
            progress.finish_and_clear();
            sent.get_or_insert(plans);
            runs.push((way, way_runs));
        }
        let facts = sent
            .unwrap_or_default()
            .iter()
            .map(|plan| {
                let read_floor_ns = median_ns(5, || Ok(plan.read_floor(&media)))?;
                Ok(RequestFacts { input_bytes: plan.input_bytes(&media), read_floor_ns })
            })
            .collect::<Result<Vec<_>>>()?;
        workload_reports
            .push(WorkloadReport { name: workload.to_string(), rows: workload_rows(&facts, &runs) });
    }
    let summary = Summary::of(&workload_reports);
    Ok(DemoReport {
        schema: 2,
        quick: options.is_quick(),
        seed: options.seed,
        model: model_info,
        machine: Machine::describe(backend_label),
        block_size: BLOCK_SIZE,
        max_tokens_per_step: options.scale.max_tokens_per_step,
        media: media_info(&media, &options.scale),
        workloads: workload_reports,
        summary,
        spoken_chat: None,
        wall_s: start.elapsed().as_secs_f64(),
    })
}

/// A bar over a workload's prompt tokens (cached ones count when reused).
fn progress_bar(show: bool, label: String, tokens: usize) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(tokens as u64);
    let style = ProgressStyle::with_template("{prefix:>32} [{bar:30}] {pos}/{len} tokens {elapsed}")
        .map(|s| s.progress_chars("=> "))
        .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_prefix(label);
    bar
}

fn model_info(c: &Config, source: String) -> ModelInfo {
    ModelInfo {
        source,
        model_type: c.model_type.clone(),
        hidden_size: c.hidden_size,
        num_layers: c.num_hidden_layers,
        num_heads: c.num_attention_heads,
        num_kv_heads: c.num_key_value_heads,
        vocab_size: c.vocab_size,
        mrope: c.mrope_section.is_some(),
        moe_experts: c.moe.as_ref().map(|m| m.num_experts),
    }
}

fn media_info(media: &crate::workloads::Media, scale: &DemoScale) -> MediaInfo {
    let item = |m: Modality, shape: &[usize]| (shape.to_vec(), media.shapes.layout(m).num_tokens());
    let note = if scale.full_media {
        format!(
            "image and audio at the real Qwen3-Omni shapes; video cut to {} of 10 temporal grid steps ({} frames)",
            scale.video_grid_t.min(10),
            media.video.shape()[0]
        )
    } else {
        "quick: tiny tensors and layouts".to_string()
    };
    MediaInfo {
        image: item(Modality::Image, media.image.shape()),
        audio: item(Modality::Audio, media.audio.shape()),
        video: item(Modality::Video, media.video.shape()),
        note,
    }
}
