//! `omniprefix bench ttft`: time to first token, cached vs uncached (see [`crate::ttft`]).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;

use super::model_load::load_thinker;
use super::runtime::{BackendJob, Ran, RuntimeArgs};
use crate::error::{HarnessError, Result, output};
use crate::ttft::{TtftOptions, TtftReports, Workload, bench_model, run_all};
use omniprefix::backend::Backend;

/// Arguments of `omniprefix bench ttft`.
#[derive(Debug, Clone, Args)]
pub struct TtftArgs {
    /// Checkpoint folder; default: the embedded random Qwen3-shaped model (see `docs/benchmarks.md`, "TTFT benchmark").
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Shared-prefix length (default: fixtures/scenarios.json, 256).
    #[arg(long)]
    pub prefix: Option<usize>,
    /// Suffix length (default: fixtures/scenarios.json, 256).
    #[arg(long)]
    pub suffix: Option<usize>,
    /// Prefix length of the long variant.
    #[arg(long, default_value_t = 2048)]
    pub long_prefix: usize,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    /// Timed runs per figure (medians are reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Untimed runs of each figure before the timed ones.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// Run only these workloads (comma-separated; default: all). `multi_round`
    /// needs a vocabulary that holds the Qwen3-Omni special ids (or the checkpoint's own).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub workloads: Vec<Workload>,
    /// Capture no hidden states in `prefix_repetition*` and `multi_round` (default:
    /// the engine's three default points, gathered every prefill).
    #[arg(long)]
    pub no_capture: bool,
    /// Divide multi_round's image/video grid sides (and audio length by its square) by this.
    #[arg(long, default_value_t = 4)]
    pub mm_scale: u32,
    /// Tokens per KV block.
    #[arg(long, default_value_t = omniprefix::kv::DEFAULT_BLOCK_SIZE)]
    pub block_size: usize,
    /// Seed of the random ids, media and (embedded model) weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Runs the benchmark and prints one line per workload.
pub fn run(args: &TtftArgs, out: &mut dyn Write) -> Result<()> {
    let options = TtftOptions {
        prefix: args.prefix,
        suffix: args.suffix,
        long_prefix: args.long_prefix,
        runs: args.runs,
        warmup: args.warmup,
        workloads: args.workloads.clone(),
        no_capture: args.no_capture,
        mm_scale: args.mm_scale,
        block_size: args.block_size,
        kv_dtype: args.runtime.kv_dtype,
        seed: args.seed,
    };
    let Ran { reason, output: TtftReports { prompts: reports, capture, tier } } =
        args.runtime.run("bench ttft", Measure { args, options: &options })?;
    if args.json {
        for r in &reports {
            writeln!(out, "{}", to_json(r)?).map_err(output)?;
        }
        if let Some(capture) = &capture {
            writeln!(out, "{}", to_json(capture)?).map_err(output)?;
        }
        if let Some(tier) = &tier {
            writeln!(out, "{}", to_json(tier)?).map_err(output)?;
        }
        return Ok(());
    }
    writeln!(out, "backend: {reason}").map_err(output)?;
    if !reports.is_empty() {
        writeln!(
            out,
            "{:<26} {:>6} {:>6} {:>10} {:>10} {:>7} {:>6} {:>6} {:>6} {:>6}",
            "workload", "prefix", "suffix", "uncached", "cached", "hit", "ideal", "flops", "ratio", "r/ide"
        )
        .map_err(output)?;
    }
    for r in &reports {
        writeln!(
            out,
            "{:<26} {:>6} {:>6} {:>8.1}ms {:>8.1}ms {:>7} {:>6.3} {:>6.3} {:>6.3} {:>6.2}",
            r.workload,
            r.prefix,
            r.suffix,
            r.ttft_uncached_ms,
            r.ttft_cached_ms,
            r.cached_tokens,
            r.ideal_ratio,
            r.flop_ratio,
            r.ratio,
            r.ratio_over_ideal
        )
        .map_err(output)?;
    }
    if let Some(capture) = capture {
        writeln!(
            out,
            "capture_overhead ({} tokens, {} points): {:.1} ms vs {:.1} ms without = {:+.1} %",
            capture.prompt_tokens,
            capture.captured,
            capture.ttft_capture_ms,
            capture.ttft_no_capture_ms,
            capture.capture_overhead * 100.0
        )
        .map_err(output)?;
    }
    let Some(t) = tier else { return Ok(()) };
    writeln!(
        out,
        "tier_restore ({} of {}+{} tokens from the tier): restore {:.4} ms/token vs recompute {:.4} = {:.4} \
         (in TTFT {:.4} ms/token; TTFT computed {:.1} / restored {:.1} / pooled {:.1} ms)",
        t.restored_tokens,
        t.prefix,
        t.suffix,
        t.restore_ms_per_token,
        t.recompute_ms_per_token,
        t.restore_over_recompute,
        t.restore_ttft_ms_per_token,
        t.ttft_computed_ms,
        t.ttft_restored_ms,
        t.ttft_pooled_ms
    )
    .map_err(output)
}

/// Loads the model on the backend and runs the selected workloads.
struct Measure<'a> {
    args: &'a TtftArgs,
    options: &'a TtftOptions,
}

impl BackendJob for Measure<'_> {
    type Output = TtftReports;

    fn run<B: Backend + 'static>(self, backend: Arc<B>) -> Result<Self::Output> {
        let args = self.args;
        let (thinker, tokens) =
            load_thinker(&*backend, args.model.as_deref(), bench_model(), args.seed, args.runtime.dtype)?;
        run_all(backend, Arc::new(thinker), tokens, self.options)
    }
}

/// One report as one JSON line.
fn to_json<T: serde::Serialize>(report: &T) -> Result<String> {
    serde_json::to_string(report)
        .map_err(|source| HarnessError::Report { what: "a ttft report".into(), source })
}
