//! `omniprefix bench serve`: TTFT, ITL, output tokens/s and hit rate under
//! Poisson or closed-loop arrivals, caching on and off (see [`crate::serve`]).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;

use omniprefix::backend::Backend;
use omniprefix::model::Config;
use omniprefix::prompt::OmniTokens;

use super::fleet::FleetArgs;
use super::model_load::load_thinker;
use super::runtime::{BackendJob, Ran, RuntimeArgs};
use crate::error::{HarnessError, Result, output};
use crate::serve::{
    Arrival, ClientsReport, ServeOptions, ServeReport, ServeWorkload, clients_model, run_serve,
};
use crate::ttft::bench_model;
use crate::workloads::select;

/// Arguments of `omniprefix bench serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// prefix_repetition, multi_round, many_clients (comma-separated), or all
    /// (the first two; many_clients runs only when named).
    #[arg(long, default_value = "all")]
    pub workload: String,
    /// Closed loop: requests in flight, comma-separated for several runs
    /// (default 1,8; 1,4 with --quick; none when only --rate is given).
    #[arg(long, value_delimiter = ',')]
    pub concurrency: Option<Vec<usize>>,
    /// Open loop: Poisson arrivals per second, comma-separated for several runs.
    #[arg(long, value_delimiter = ',')]
    pub rate: Option<Vec<f64>>,
    /// CI size: a tiny model, short prompts and replies, few requests.
    #[arg(long)]
    pub quick: bool,
    /// Checkpoint folder; default: a random model (`bench ttft`'s, or a tiny one with --quick).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Random model: hidden size (its heads keep head_dim 64, 16 with --quick).
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Random model: decoder layers.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Random model: vocabulary (Qwen3-Omni's special ids need 151676; a smaller one uses ids 500-506).
    #[arg(long)]
    pub vocab: Option<usize>,
    /// prefix_repetition: tokens of each shared prefix.
    #[arg(long)]
    pub prefix_len: Option<usize>,
    /// prefix_repetition: tokens of each random suffix.
    #[arg(long)]
    pub suffix_len: Option<usize>,
    /// prefix_repetition: shared prefixes.
    #[arg(long)]
    pub num_prefixes: Option<usize>,
    /// prefix_repetition: prompts per prefix.
    #[arg(long)]
    pub prompts_per_prefix: Option<usize>,
    /// Tokens generated per request (exactly: eos is ignored, as `vllm bench serve` does).
    #[arg(long)]
    pub output_len: Option<usize>,
    /// multi_round: conversations (4 rounds each).
    #[arg(long)]
    pub conversations: Option<usize>,
    /// multi_round, many_clients: divide the image/video grid sides (audio by the square) by this.
    #[arg(long)]
    pub mm_scale: Option<u32>,
    /// many_clients: conversations, each its own tenant (default 64; 8 with --quick).
    #[arg(long)]
    pub clients: Option<usize>,
    /// many_clients: rounds of each conversation (default 6; 4 with --quick).
    #[arg(long)]
    pub rounds: Option<usize>,
    /// many_clients: requests in flight within a round (default 4; 2 with --quick).
    #[arg(long)]
    pub client_concurrency: Option<usize>,
    /// Milliseconds the stand-in encoder sleeps per item it encodes (an
    /// encoder-cache miss), on the thread that submits the request.
    #[arg(long, default_value_t = 0)]
    pub encoder_ms: u64,
    /// Sequences per scheduler step (the decode batch).
    #[arg(long)]
    pub max_seqs: Option<usize>,
    /// New tokens per scheduler step (the chunked-prefill budget; default 2048).
    #[arg(long)]
    pub max_tokens_per_step: Option<usize>,
    /// Prefill tokens a step that carries decodes may add; a step also prefills one
    /// generating prompt longer than this at a time (default: a thirty-second of the budget;
    /// the budget itself: uncapped).
    #[arg(long)]
    pub prefill_cap: Option<usize>,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    /// Seed of the weights, prompts, media and arrivals.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// One JSON object per (workload, cache mode, arrival) line instead of a table.
    #[arg(long)]
    pub json: bool,
    /// With --json: add every inter-token gap with its time (`itl_trace`: [s since the run started, ms]).
    #[arg(long)]
    pub trace: bool,
    #[command(flatten)]
    pub fleet: FleetArgs,
}

impl ServeArgs {
    /// `--quick` or the full sizes, with every size flag given applied on top.
    pub fn options(&self) -> Result<ServeOptions> {
        let workloads = self.workloads()?;
        let base = match (self.quick, Self::many_clients_alone(&workloads)) {
            (quick, true) => ServeOptions::many_clients(quick)?,
            (true, false) => ServeOptions::quick()?,
            (false, false) => ServeOptions::full()?,
        };
        let mut arrivals: Vec<Arrival> =
            self.rate.iter().flatten().map(|&rate| Arrival::Poisson { rate }).collect();
        let concurrency = match (&self.concurrency, arrivals.is_empty()) {
            (Some(c), _) => c.iter().map(|&c| Arrival::Concurrency(c)).collect(),
            (None, true) => base.arrivals.clone(),
            (None, false) => Vec::new(),
        };
        arrivals.splice(0..0, concurrency);
        for &a in &arrivals {
            let bad = match a {
                Arrival::Concurrency(c) => (c == 0).then(|| format!("--concurrency {c}: must be at least 1")),
                Arrival::Poisson { rate } => (!(rate.is_finite() && rate > 0.0))
                    .then(|| format!("--rate {rate}: must be a positive number")),
            };
            if let Some(problem) = bad {
                return Err(HarnessError::Args(clap::Error::raw(
                    clap::error::ErrorKind::ValueValidation,
                    problem,
                )));
            }
        }
        Ok(ServeOptions {
            workloads,
            arrivals,
            prefix_len: self.prefix_len.unwrap_or(base.prefix_len),
            suffix_len: self.suffix_len.unwrap_or(base.suffix_len),
            num_prefixes: self.num_prefixes.unwrap_or(base.num_prefixes),
            prompts_per_prefix: self.prompts_per_prefix.unwrap_or(base.prompts_per_prefix),
            output_len: self.output_len.unwrap_or(base.output_len),
            conversations: self.conversations.unwrap_or(base.conversations),
            mm_scale: self.mm_scale.unwrap_or(base.mm_scale),
            clients: self.clients.unwrap_or(base.clients),
            client_rounds: self.rounds.unwrap_or(base.client_rounds),
            client_concurrency: self.client_concurrency.unwrap_or(base.client_concurrency),
            max_seqs: self.max_seqs.unwrap_or(base.max_seqs),
            max_tokens_per_step: self.max_tokens_per_step.unwrap_or(base.max_tokens_per_step),
            prefill_cap: self.prefill_cap.or(base.prefill_cap),
            kv_dtype: self.runtime.kv_dtype,
            seed: self.seed,
            fingerprint_key: self.fleet.key()?,
            kv_events: self.fleet.kv_events()?,
            encoder_ms: self.encoder_ms,
            trace: self.trace,
            ..base
        })
    }

    /// `--workload`: named workloads, or `all`, the ones that compare caching on and off.
    fn workloads(&self) -> Result<Vec<ServeWorkload>> {
        if self.workload == "all" {
            return Ok(ServeWorkload::ALL.to_vec());
        }
        select::<ServeWorkload>(&self.workload)
    }

    /// `many_clients` alone takes its own sizes and model (so its four engines × 384 requests run in minutes).
    fn many_clients_alone(workloads: &[ServeWorkload]) -> bool {
        workloads == [ServeWorkload::ManyClients]
    }

    /// The random model: `bench ttft`'s (hidden 512, 8 layers, Qwen's vocabulary),
    /// [`clients_model`]'s for `many_clients` alone, or, with `--quick`, hidden 32,
    /// 2 layers, 600 ids; heads keep their head_dim. `options` are [`ServeArgs::options`]'
    /// (so the workloads are parsed once).
    pub fn random_model(&self, options: &ServeOptions) -> Config {
        let clients_only = Self::many_clients_alone(&options.workloads);
        let base = match (self.quick, clients_only) {
            (true, _) => Config::tiny_qwen3(32, 2, 2, 1, 600),
            (false, true) => clients_model(),
            (false, false) => bench_model(),
        };
        let hidden = self.hidden.unwrap_or(base.hidden_size);
        let heads = (hidden / base.head_dim).max(1);
        let kv_ratio = (base.num_attention_heads / base.num_key_value_heads).max(1);
        Config {
            intermediate_size: base.intermediate_size * hidden / base.hidden_size,
            mrope_section: base.mrope_section,
            mrope_interleaved: base.mrope_interleaved,
            ..Config::tiny_qwen3(
                hidden,
                self.layers.unwrap_or(base.num_hidden_layers),
                heads,
                (heads / kv_ratio).max(1),
                self.vocab.unwrap_or(base.vocab_size),
            )
        }
    }
}

/// Runs every (workload, arrival) with caching on and off; prints JSON lines or a table.
pub fn run(args: &ServeArgs, out: &mut dyn Write) -> Result<()> {
    let options = args.options()?;
    if let Some(n) = args.runtime.threads {
        // The served engine's loop runs on a thread of its own, outside the
        // `--threads` pool, so its forward uses rayon's global pool: size that one
        // too. Only the first call in a process can (the CLI's one run); later ones keep its size.
        let _ = rayon::ThreadPoolBuilder::new().num_threads(n).build_global();
    }
    let Ran { reason, output: reports } =
        args.runtime.run("bench serve", Measure { args, options: &options })?;
    if args.json {
        for r in &reports {
            let line = serde_json::to_string(r)
                .map_err(|source| HarnessError::Report { what: "a serve report".into(), source })?;
            writeln!(out, "{line}").map_err(output)?;
        }
        return Ok(());
    }
    writeln!(out, "backend: {reason}").map_err(output)?;
    print_table(&reports, out)?;
    print_rounds(&reports, out)
}

/// Loads or builds the model on the backend and runs the benchmark.
struct Measure<'a> {
    args: &'a ServeArgs,
    options: &'a ServeOptions,
}

impl BackendJob for Measure<'_> {
    type Output = Vec<ServeReport>;

    fn run<B: Backend + 'static>(self, backend: Arc<B>) -> Result<Vec<ServeReport>> {
        let args = self.args;
        let (thinker, tokens) = load_thinker(
            &*backend,
            args.model.as_deref(),
            args.random_model(self.options),
            args.seed,
            args.runtime.dtype,
        )?;
        let vocab = thinker.config().vocab_size;
        let tokens = tokens
            .unwrap_or_else(|| if vocab > 151_675 { OmniTokens::qwen3_omni() } else { OmniTokens::tiny() });
        run_serve(backend, Arc::new(thinker), tokens, self.options)
    }
}

/// One row per report: workload, cache, arrival, then the figures.
pub fn print_table(reports: &[ServeReport], out: &mut dyn Write) -> Result<()> {
    writeln!(
        out,
        "{:<18} {:>5} {:>9} {:>5} {:>7} {:>9} {:>9} {:>8} {:>8} {:>9} {:>5} {:>4}",
        "workload",
        "cache",
        "arrival",
        "reqs",
        "out",
        "ttft p50",
        "ttft p99",
        "itl p50",
        "itl p99",
        "tok/s",
        "hit",
        "enc"
    )
    .map_err(output)?;
    for r in reports {
        let arrival = match (r.concurrency, r.rate) {
            (Some(c), _) => format!("c={c}"),
            (None, Some(rate)) => format!("{rate}/s"),
            (None, None) => "-".into(),
        };
        writeln!(
            out,
            "{:<18} {:>5} {:>9} {:>5} {:>7} {:>7.1}ms {:>7.1}ms {:>6.2}ms {:>6.2}ms {:>9.1} {:>5.3} {:>4}",
            r.workload,
            if r.cache { "on" } else { "off" },
            arrival,
            r.requests,
            r.output_tokens,
            r.ttft_ms_p50,
            r.ttft_ms_p99,
            r.itl_ms_p50,
            r.itl_ms_p99,
            r.output_tokens_per_s,
            r.hit_rate,
            r.encoder_calls
        )
        .map_err(output)?;
    }
    Ok(())
}

/// `many_clients`: one row per round, a hit rate and TTFT p50 per engine (a `*`
/// marks the restart's first round on the rebuilt engine); nothing without it.
pub fn print_rounds(reports: &[ServeReport], out: &mut dyn Write) -> Result<()> {
    let runs: Vec<&ClientsReport> = reports.iter().filter_map(|r| r.many_clients.as_ref()).collect();
    let Some(first) = runs.first() else { return Ok(()) };
    writeln!(
        out,
        "\nmany_clients: {} conversations, concurrency {}, pool {} of {} blocks ({:.2}; unbounded: all)",
        first.conversations,
        first.concurrency,
        first.pool_blocks,
        first.working_set_blocks,
        first.pool_blocks as f64 / first.working_set_blocks.max(1) as f64
    )
    .map_err(output)?;
    let header: String = runs.iter().map(|r| format!(" {:>10} {:>9}", r.engine.name(), "ttft p50")).collect();
    writeln!(out, "{:<6}{header}", "round").map_err(output)?;
    let rounds = runs.iter().map(|r| r.rounds.len()).max().unwrap_or(0);
    for i in 0..rounds {
        let cells: String = runs
            .iter()
            .map(|r| match r.rounds.get(i) {
                Some(round) => {
                    let mark = if r.restart_round == Some(round.round) { "*" } else { " " };
                    format!(" {:>9.3}{mark} {:>7.1}ms", round.hit_rate, round.ttft_ms_p50)
                }
                None => format!(" {:>10} {:>9}", "-", "-"),
            })
            .collect();
        writeln!(out, "{:<6}{cells}", i + 1).map_err(output)?;
    }
    Ok(())
}
