//! `omniprefix demo`: runs the demo workloads three ways, prints a table per
//! workload and optionally writes the JSON report.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Args;

use crate::demo::{
    DemoOptions, DemoReport, DemoScale, DemoWorkload, ModelChoice, SpokenChatOptions, default_speech_model,
    has_talker, print_tables, run_demo, run_spoken_chat,
};
use crate::error::{HarnessError, Result, output};
use omniprefix::backend::Backend;
use omniprefix::backend::auto::{BackendKind, SelectedBackend, select};
use omniprefix::backend::wgpu::WgpuBackend;
use omniprefix::error::IoError;

/// Arguments of `demo`.
///
/// `--backend auto` takes the wgpu adapter when there is a hardware one and the
/// CPU backend otherwise (no adapter, or a software rasteriser), and says which.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Where the model runs: `cpu`, `wgpu`, or `auto` (wgpu on a hardware adapter, else the CPU).
    #[arg(long, default_value_t = BackendKind::Auto)]
    pub backend: BackendKind,
    /// A Hugging Face checkpoint directory instead of the seeded random thinker.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// CI size: a tiny model and tiny items, finishes in seconds.
    #[arg(long)]
    pub quick: bool,
    /// rfc_text_pair, multi_round, prefix_repetition (comma-separated), or all.
    #[arg(long, default_value = "all")]
    pub workload: String,
    /// Temporal grid steps of the video item (the real clip has 10; ignored with --quick).
    #[arg(long, default_value_t = crate::demo::DEFAULT_VIDEO_GRID_T,
          value_parser = clap::value_parser!(u32).range(1..=10))]
    pub video_grid_t: u32,
    /// Fingerprint threads.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub threads: u16,
    /// The full Omni checkpoint (with a talker) of the spoken chat. Default: `--model` when it
    /// has a talker, else the repository's `fixtures/tiny/omni_audio` when it is there.
    #[arg(long, conflicts_with = "no_speech")]
    pub speech_model: Option<PathBuf>,
    /// Rounds of the spoken chat (each re-sends the conversation and asks for audio).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=3))]
    pub speech_rounds: u16,
    /// Skip the spoken chat.
    #[arg(long)]
    pub no_speech: bool,
}

impl DemoArgs {
    /// The spoken chat's checkpoint: `--speech-model`, else `--model` with a talker, else the
    /// repository's tiny one; `None` with `--no-speech` or when there is none.
    fn speech_model(&self) -> Result<Option<PathBuf>> {
        if self.no_speech {
            return Ok(None);
        }
        if let Some(dir) = &self.speech_model {
            if !has_talker(dir)? {
                return Err(
                    omniprefix::error::RequestError::NoTalker { model: dir.display().to_string() }.into()
                );
            }
            return Ok(Some(dir.clone()));
        }
        if let Some(dir) = &self.model
            && has_talker(dir)?
        {
            return Ok(Some(dir.clone()));
        }
        Ok(default_speech_model())
    }
}

/// Checks the arguments, picks the backend, runs the demo, prints the tables
/// and writes the report. Every input is checked before the (long) run starts.
pub fn run(args: &DemoArgs, out: &mut dyn Write) -> Result<()> {
    let workloads = crate::workloads::select::<DemoWorkload>(&args.workload)?;
    let model = match &args.model {
        Some(dir) => {
            // Fails early with the loader's own error when the config is missing or unsupported.
            omniprefix::model::Config::from_file(&dir.join("config.json"))?;
            ModelChoice::Dir(dir.clone())
        }
        None => ModelChoice::Random,
    };
    if let Some(path) = &args.json {
        check_writable(path)?;
    }
    let speech = args.speech_model()?.map(|dir| SpokenChatOptions {
        rounds: usize::from(args.speech_rounds),
        ..SpokenChatOptions::new(dir)
    });
    let options = DemoOptions {
        workloads,
        scale: if args.quick { DemoScale::quick() } else { DemoScale::full(args.video_grid_t)? },
        fingerprint_threads: usize::from(args.threads),
        show_progress: !args.quick,
        ..DemoOptions::quick()
    };
    let selection = select(args.backend)?;
    writeln!(out, "backend: {}", selection.reason).map_err(output)?;
    let report = match selection.backend {
        SelectedBackend::Cpu(cpu) => {
            run_on(Arc::new(cpu), "cpu".into(), &model, &options, speech.as_ref(), out)?
        }
        SelectedBackend::Wgpu(gpu) => run_wgpu(gpu, &model, &options, speech.as_ref(), out)?,
    };
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report)
            .map_err(|source| HarnessError::Report { what: "the demo report".into(), source })?;
        std::fs::write(path, json + "\n").map_err(|source| IoError::write(path, source))?;
        writeln!(out, "report written to {}", path.display()).map_err(output)?;
    }
    Ok(())
}

fn run_wgpu(
    gpu: WgpuBackend, model: &ModelChoice, options: &DemoOptions, speech: Option<&SpokenChatOptions>,
    out: &mut dyn Write,
) -> Result<DemoReport> {
    let label = format!("wgpu: {}", gpu.context().adapter_name());
    run_on(Arc::new(gpu), label, model, options, speech, out)
}

/// The demo's workloads, then the spoken chat on the same backend, then the tables.
fn run_on<B: Backend>(
    backend: Arc<B>, label: String, model: &ModelChoice, options: &DemoOptions,
    speech: Option<&SpokenChatOptions>, out: &mut dyn Write,
) -> Result<DemoReport> {
    out.flush().map_err(output)?;
    let mut report = run_demo(Arc::clone(&backend), label, model, options)?;
    if let Some(speech) = speech {
        report.spoken_chat = Some(run_spoken_chat(backend, speech)?);
    }
    print_tables(&report, out).map_err(output)?;
    Ok(report)
}

/// Creates (or truncates) `path` now, so an unwritable path fails before the run.
fn check_writable(path: &Path) -> Result<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map(drop)
        .map_err(|source| IoError::write(path, source).into())
}
