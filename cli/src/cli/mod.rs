//! The `omniprefix` command line: one module per subcommand.
//!
//! `main` parses, runs, and turns an error into one line on stderr and a
//! non-zero exit code; subcommands write their output to the writer they are
//! given, so tests can run them in process.

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::error::Result;

/// `omniprefix bench match`.
pub mod bench_match;
/// `omniprefix block-hashes`.
pub mod block_hashes;
/// `omniprefix demo`.
pub mod demo;
/// `--fingerprint-key` and the KV-event flags.
pub mod fleet;
/// `omniprefix generate`.
pub mod generate;
/// `omniprefix gpu-info` and `omniprefix bench parity` (hidden: `scripts/gpu_bench.sh` runs them).
pub mod gpu_check;
/// Quiet display probes on a machine without a display.
pub mod headless;
/// `omniprefix hidden`.
pub mod hidden;
/// The model the benchmarks load.
pub mod model_load;
/// `--threads`, `--backend`, `--dtype`, `--kv-dtype`: where and how the model runs.
pub mod runtime;
/// `omniprefix bench serve`.
pub mod serve;
/// `omniprefix bench soak`.
pub mod soak;
/// `--tier-dir` and `--tier-bytes`: the disk tier.
pub mod tier;
/// `omniprefix bench ttfa`.
pub mod ttfa;
/// `omniprefix bench ttft`.
pub mod ttft;

/// Prefix caching for multimodal (Omni) LLM inference.
#[derive(Debug, Parser)]
#[command(name = "omniprefix", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// Top-level subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Runs the demo workloads three ways (radix, hash chain, no cache) and prints a table per workload.
    Demo(demo::DemoArgs),
    /// Full hidden states of a request (after optional warm-up requests) into a safetensors file.
    Hidden(hidden::HiddenArgs),
    /// Generate tokens for a request (after optional warm-up requests): tokens, cache reuse, TTFT and ITL.
    Generate(generate::GenerateArgs),
    /// The block hashes an engine publishes for a request's full blocks, without a model (a router's frontend side).
    BlockHashes(block_hashes::BlockHashesArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// The wgpu adapter, its driver and limits, as one JSON line (for `scripts/gpu_bench.sh`).
    #[command(hide = true)]
    GpuInfo(gpu_check::GpuInfoArgs),
    /// The CPU kernels' builds (the one running, the ones this CPU has), as one JSON line (for `scripts/cpu_report.sh`).
    #[command(hide = true)]
    CpuInfo(gpu_check::CpuInfoArgs),
}

/// `omniprefix bench ...`.
#[derive(Debug, Subcommand)]
// Parsed once per process: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum BenchCommand {
    /// Match cost per workload: omniprefix (cold, warm) vs the read floor and vLLM's hash chain.
    Match(bench_match::MatchArgs),
    /// Time to first token, cached vs uncached, on shared-prefix and multi-round workloads.
    Ttft(ttft::TtftArgs),
    /// Time to first audio of a spoken multi-round voice chat, caching on and off, at several concurrencies.
    Ttfa(ttfa::TtfaArgs),
    /// Zipf prefix reuse under eviction pressure, no model compute: hit rate, evictions, peak memory, leaks.
    Soak(soak::SoakArgs),
    /// `vllm bench serve` on the generation API: TTFT/ITL percentiles, output tokens/s, hit rate, cache on and off.
    Serve(serve::ServeArgs),
    /// A checkpoint on wgpu against the CPU backend, same dtypes, as one JSON line (for `scripts/gpu_bench.sh`).
    #[command(hide = true)]
    Parity(gpu_check::ParityArgs),
}

/// Runs a parsed command line, writing its output to `out`.
pub fn run(cli: Cli, out: &mut dyn Write) -> Result<()> {
    match cli.command {
        Command::Bench(BenchCommand::Match(args)) => bench_match::run(&args, out),
        Command::Demo(args) => demo::run(&args, out),
        Command::Hidden(args) => hidden::run(&args, out),
        Command::Generate(args) => generate::run(&args, out),
        Command::BlockHashes(args) => block_hashes::run(&args, out),
        Command::Bench(BenchCommand::Ttft(args)) => ttft::run(&args, out),
        Command::Bench(BenchCommand::Ttfa(args)) => ttfa::run(&args, out),
        Command::Bench(BenchCommand::Soak(args)) => soak::run(&args, out),
        Command::Bench(BenchCommand::Serve(args)) => serve::run(&args, out),
        Command::GpuInfo(args) => gpu_check::info(&args, out),
        Command::CpuInfo(args) => gpu_check::cpu_info(&args, out),
        Command::Bench(BenchCommand::Parity(args)) => gpu_check::parity(&args, out),
    }
}

/// The binary's entry point: parse `std::env::args`, run, report errors in one line.
pub fn main() -> ExitCode {
    let _runtime_dir = headless::quiet_display_probes();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version are "errors" that print to stdout and exit 0.
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    let stdout = std::io::stdout();
    match run(cli, &mut stdout.lock()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", e.to_string().replace('\n', " "));
            ExitCode::from(2)
        }
    }
}
