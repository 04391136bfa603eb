//! `omniprefix bench soak`: many requests with Zipf prefix reuse through the
//! scheduler under eviction pressure, checked for leaked blocks (see [`crate::soak`]).

use std::io::Write;

use clap::Args;

use super::fleet::{self, FleetArgs};
use crate::error::{HarnessError, Result, output};
use crate::soak::{SoakOptions, SoakReport, run_soak};

/// Arguments of `omniprefix bench soak`.
#[derive(Debug, Clone, Args)]
pub struct SoakArgs {
    /// Requests to drive.
    #[arg(long, default_value_t = 100_000)]
    pub requests: usize,
    /// KV blocks in the pool (far fewer than the working set).
    #[arg(long, default_value_t = omniprefix::sched::SchedulerConfig::default().num_blocks)]
    pub pool_blocks: usize,
    /// Distinct shared prefixes the Zipf law draws from.
    #[arg(long, default_value_t = 4096)]
    pub prefixes: usize,
    /// Zipf exponent of prefix popularity.
    #[arg(long, default_value_t = 1.0)]
    pub zipf: f64,
    /// Seed of every random choice.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The whole report as one JSON object instead of a summary.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub fleet: FleetArgs,
}

/// Runs the soak, prints the report and fails (non-zero exit) on leaked blocks.
pub fn run(args: &SoakArgs, out: &mut dyn Write) -> Result<()> {
    let options = SoakOptions {
        requests: args.requests,
        pool_blocks: args.pool_blocks,
        prefixes: args.prefixes,
        zipf_exponent: args.zipf,
        seed: args.seed,
        kv_events: args.fleet.kv_events()?,
        fingerprint_key: args.fleet.key()?,
        ..SoakOptions::default()
    };
    let report = run_soak(&options)?;
    let written = if args.json {
        serde_json::to_string(&report)
            .map_err(|source| HarnessError::Report { what: "the soak report".into(), source })
            .and_then(|json| writeln!(out, "{json}").map_err(output))
    } else {
        summary(&report, out).map_err(output)
    };
    written?;
    report.check()
}

fn summary(r: &SoakReport, out: &mut dyn Write) -> std::io::Result<()> {
    let last = r.samples.last();
    writeln!(out, "requests         {}", r.requests)?;
    writeln!(out, "hit rate         {:.4} (requests reusing >= 1 token)", r.hit_rate)?;
    writeln!(
        out,
        "token hit rate   {:.4} ({} of {} prompt tokens)",
        r.token_hit_rate, r.hit_tokens, r.prompt_tokens
    )?;
    writeln!(
        out,
        "evicted blocks   {} (pool {}, working set {})",
        r.evicted_blocks, r.options.pool_blocks, r.working_set_blocks
    )?;
    writeln!(
        out,
        "index nodes      {} at the end (max {})",
        last.map_or(0, |s| s.index_nodes),
        r.samples.iter().map(|s| s.index_nodes).max().unwrap_or(0)
    )?;
    writeln!(out, "peak RSS         {} KiB", r.peak_rss_kib)?;
    writeln!(out, "index blocks     {} at the end ({} published)", r.index_blocks, r.published_blocks)?;
    if let Some(stats) = &r.kv_events {
        writeln!(out, "{}", fleet::summary(stats))?;
    }
    writeln!(out, "leaked blocks    {}", r.leaked_blocks)?;
    writeln!(out, "seconds          {:.2}", r.seconds)
}
