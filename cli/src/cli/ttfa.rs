//! `omniprefix bench ttfa`: time to first audio of a spoken multi-round voice
//! chat through the served engine, caching on and off (see [`crate::ttfa`]).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;

use super::runtime::{BackendJob, Ran, RuntimeArgs};
use crate::error::{HarnessError, Result, output};
use crate::ttfa::{MachineInfo, Size, TtfaOptions, TtfaReport, omni_configs, run as run_ttfa, table};
use omniprefix::backend::Backend;
use omniprefix::error::IoError;
use omniprefix::sched::PrefillCap;

/// Arguments of `omniprefix bench ttfa`.
#[derive(Debug, Clone, Args)]
pub struct TtfaArgs {
    /// CI size: `--size tiny` and its small workload (2 rounds, 2 conversations, c = 1,2).
    #[arg(long)]
    pub quick: bool,
    /// The embedded random Omni model: `bench` (the release's structure at a quarter of
    /// its widths) or `tiny`.
    #[arg(long, value_enum)]
    pub size: Option<Size>,
    /// Closed-loop runs: conversations in flight, comma-separated (default 1,4,8).
    #[arg(long, value_delimiter = ',')]
    pub concurrency: Option<Vec<usize>>,
    /// Conversations per run (at least its concurrency; default 4).
    #[arg(long)]
    pub conversations: Option<usize>,
    /// Rounds per conversation (default 4).
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Thinker reply tokens per round, eos ignored (default 16).
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Talker frames per reply (default 16; 1920 samples each).
    #[arg(long)]
    pub frames: Option<usize>,
    /// Frames code2wav waits for before its first decode (default: the engine's, 1).
    #[arg(long)]
    pub first_chunk: Option<usize>,
    /// Most frames a later code2wav decode waits for (default: the engine's, 25; chunks
    /// double up to it).
    #[arg(long)]
    pub chunk: Option<usize>,
    /// Divide the image's grid sides (the audio's length by the square) by this (default 2).
    #[arg(long)]
    pub mm_scale: Option<u32>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = omniprefix::kv::DEFAULT_BLOCK_SIZE)]
    pub block_size: usize,
    /// Prefill tokens a step that carries reply tokens may add (default 256, see
    /// `SPEECH_PREFILL_CAP`; text serving's default is 64).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub prefill_cap: Option<u64>,
    /// Milliseconds a playing reply's code2wav decodes may wait past its audio while
    /// another awaits its first audio (default 1000, the engine's), or `off`: never.
    #[arg(long, value_parser = parse_audio_yield)]
    pub audio_yield_ms: Option<AudioYield>,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    /// Seed of the weights, ids and media.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also write the report as one JSON object to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

impl TtfaArgs {
    fn options(&self) -> TtfaOptions {
        let size = self.size.unwrap_or(if self.quick { Size::Tiny } else { Size::Bench });
        let d = TtfaOptions::new(size);
        TtfaOptions {
            size,
            rounds: self.rounds.unwrap_or(d.rounds),
            concurrency: self.concurrency.clone().unwrap_or(d.concurrency),
            conversations: self.conversations.unwrap_or(d.conversations),
            max_tokens: self.max_tokens.unwrap_or(d.max_tokens),
            frames: self.frames.unwrap_or(d.frames),
            mm_scale: self.mm_scale.unwrap_or(d.mm_scale),
            first_chunk: self.first_chunk.unwrap_or(d.first_chunk),
            chunk: self.chunk.unwrap_or(d.chunk),
            block_size: self.block_size,
            prefill_cap: self.prefill_cap.map_or(d.prefill_cap, |n| PrefillCap::Tokens(n as usize)),
            audio_yield: self.audio_yield_ms.map_or(d.audio_yield, |y| y.0),
            kv_dtype: self.runtime.kv_dtype,
            dtype: self.runtime.dtype.0,
            seed: self.seed,
        }
    }
}

/// Runs the benchmark, prints the table and (with `--json`) writes the report.
pub fn run(args: &TtfaArgs, out: &mut dyn Write) -> Result<()> {
    let options = args.options();
    let Ran { reason, output: mut report } = args.runtime.run("bench ttfa", Measure { options: &options })?;
    report.machine.backend = reason;
    for line in table(&report) {
        writeln!(out, "{line}").map_err(output)?;
    }
    if let Some(path) = &args.json {
        let text = to_json(&report)?;
        std::fs::write(path, text + "\n").map_err(|e| IoError::write(path, e))?;
    }
    Ok(())
}

struct Measure<'a> {
    options: &'a TtfaOptions,
}

impl BackendJob for Measure<'_> {
    type Output = TtfaReport;

    fn run<B: Backend + 'static>(self, backend: Arc<B>) -> Result<TtfaReport> {
        let configs = omni_configs(self.options.size)?;
        let machine = MachineInfo::describe(backend.name().to_string());
        run_ttfa(backend, configs, self.options, machine)
    }
}

fn to_json(report: &TtfaReport) -> Result<String> {
    serde_json::to_string_pretty(report)
        .map_err(|source| HarnessError::Report { what: "the ttfa report".into(), source })
}

/// `--audio-yield-ms`: milliseconds, or `off`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AudioYield(pub Option<std::time::Duration>);

fn parse_audio_yield(s: &str) -> std::result::Result<AudioYield, String> {
    if s == "off" {
        return Ok(AudioYield(None));
    }
    let ms: u64 =
        s.parse().map_err(|_| format!("`{s}` is neither a whole number of milliseconds nor `off`"))?;
    Ok(AudioYield(Some(std::time::Duration::from_millis(ms))))
}
