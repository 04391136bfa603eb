//! `omniprefix bench match`: one report per workload, as JSON lines or a table.

use std::io::Write;
use std::sync::Arc;

use clap::{Args, ValueEnum};

use crate::bench::{MatchOptions, MatchReport, measure};
use crate::error::{HarnessError, Result, output};
use crate::workloads::{Media, MediaScale, WorkloadName, select};
use omniprefix::index::ValidationPolicy;

/// Seed of the generated media and text ids.
const SEED: u64 = 0x5eed;

/// Arguments of `bench match`.
#[derive(Debug, Clone, Args)]
pub struct MatchArgs {
    /// mixed, image, audio, video, text1k, text8k, text32k, multi_round (comma-separated), or all.
    #[arg(long)]
    pub workload: String,
    /// Fingerprint threads of the omniprefix paths (the vLLM baseline stays single-threaded).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub threads: u16,
    /// Timed runs per path (medians are reported), after one warm-up run.
    #[arg(long, default_value_t = 11, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub runs: u32,
    /// Validation policy of the omniprefix paths.
    #[arg(long, value_enum, default_value_t = PolicyArg::SecondDigest)]
    pub policy: PolicyArg,
    /// Media size: the real Qwen3-Omni raw shapes, or tiny tensors with the same layouts.
    #[arg(long, value_enum, default_value_t = ScaleArg::Full)]
    pub scale: ScaleArg,
    /// One JSON object per workload per line instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// [`ValidationPolicy`] on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PolicyArg {
    SecondDigest,
    ExactBytes,
    Unvalidated,
}

impl From<PolicyArg> for ValidationPolicy {
    fn from(p: PolicyArg) -> Self {
        match p {
            PolicyArg::SecondDigest => ValidationPolicy::SecondDigest,
            PolicyArg::ExactBytes => ValidationPolicy::ExactBytes,
            PolicyArg::Unvalidated => ValidationPolicy::Unvalidated,
        }
    }
}

/// [`MediaScale`] on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ScaleArg {
    Full,
    Tiny,
}

impl From<ScaleArg> for MediaScale {
    fn from(s: ScaleArg) -> Self {
        match s {
            ScaleArg::Full => MediaScale::Full,
            ScaleArg::Tiny => MediaScale::Tiny,
        }
    }
}

/// Measures the selected workloads and writes one line per workload as it finishes.
pub fn run(args: &MatchArgs, out: &mut dyn Write) -> Result<()> {
    let workloads = select::<WorkloadName>(&args.workload)?;
    let media = Arc::new(Media::generate(args.scale.into(), SEED)?);
    let options = MatchOptions {
        threads: usize::from(args.threads),
        runs: args.runs as usize,
        policy: args.policy.into(),
        seed: SEED,
    };
    if !args.json {
        write_line(out, &table_header())?;
    }
    for name in workloads {
        let report = measure(name, &media, &options)?;
        if args.json {
            let line = serde_json::to_string(&report).map_err(|source| HarnessError::Report {
                what: format!("the report of {}", report.workload),
                source,
            })?;
            write_line(out, &line)?;
        } else {
            write_line(out, &table_row(&report))?;
        }
    }
    Ok(())
}

/// Writes and flushes one line, so each workload's report appears as soon as it is measured.
fn write_line(out: &mut dyn Write, line: &str) -> Result<()> {
    writeln!(out, "{line}").and_then(|()| out.flush()).map_err(output)
}

fn table_header() -> String {
    format!(
        "{:<12} {:>3} {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>8} {:>9} {:>9}",
        "workload",
        "thr",
        "tokens",
        "MB",
        "floor_us",
        "cold_us",
        "warm_us",
        "vllm_us",
        "cold/fl",
        "warm/fl",
        "vllm/wm",
        "match_us",
        "chain_us"
    )
}

fn table_row(r: &MatchReport) -> String {
    let us = |ns: u64| ns as f64 / 1e3;
    format!(
        "{:<12} {:>3} {:>7} {:>10.2} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>8.2} {:>8.2} {:>8.2} {:>9.1} {:>9.1}",
        r.workload,
        r.threads,
        r.prompt_tokens,
        r.input_bytes as f64 / 1e6,
        us(r.read_floor_ns),
        us(r.omniprefix_cold_ns),
        us(r.omniprefix_warm_ns),
        us(r.hashchain_ns),
        r.cold_over_read_floor,
        r.warm_over_read_floor,
        r.hashchain_over_warm,
        us(r.radix_match_ns),
        us(r.hashchain_chain_ns)
    )
}
