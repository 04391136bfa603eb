//! `omniprefix generate`: run warm-up requests, then a request, generating
//! tokens for each with the same sampling settings; print the tokens, cache
//! reuse and timings, and optionally write the hidden states of every position
//! that ran (prompt + generated tokens but the last) under `hidden`'s names.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use serde::Serialize;

use omniprefix::backend::Backend;
use omniprefix::engine::{Engine, Output, millis};
use omniprefix::request_file::RequestFile;
use omniprefix::sample::{FinishReason, SamplingParams};

use omniprefix::events::PublisherStats;

use super::fleet;
use super::hidden::{EngineArgs, EngineJob, JobRun, hidden_tensors, on_selected_backend, print_shapes, write_tensors};
use crate::error::{HarnessError, Result, output};
use crate::ttft::median;

/// Arguments of `omniprefix generate`.
#[derive(Debug, Clone, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Tokens to generate at most (≥ 1).
    #[arg(long)]
    pub max_tokens: usize,
    /// Softmax temperature; 0 = greedy (argmax).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Sample among the `K` likeliest tokens only.
    #[arg(long, allow_negative_numbers = true)]
    pub top_k: Option<usize>,
    /// Sample from the smallest set of tokens whose probability reaches `P` (0 < P ≤ 1).
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f32>,
    /// Seed of the sampler when `--temperature` is above 0 (default: a random seed, reported back).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Token ids that end generation (default: the checkpoint's eos ids).
    #[arg(long, value_delimiter = ',')]
    pub stop: Option<Vec<u32>>,
    /// Generate `--max-tokens` tokens whatever the stop ids.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Also write the hidden states of every position that ran to this safetensors file.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print one JSON object instead of lines of text.
    #[arg(long)]
    pub json: bool,
}

impl GenerateArgs {
    /// The sampling settings of every request (warm-ups included); the engine checks them.
    pub fn sampling(&self) -> SamplingParams {
        SamplingParams {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
            stop: self.stop.clone(),
            ignore_eos: self.ignore_eos,
            run_last_token: false,
            allow_special_ids: false,
        }
    }
}

/// What `generate --json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct GenerateReport {
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub num_cached_tokens: usize,
    pub finish_reason: FinishReason,
    /// The sampler's seed (the one drawn when `--seed` was not given); left
    /// out of greedy runs, which draw nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Submission to the first token.
    pub ttft_ms: f64,
    /// Median gap between consecutive tokens (`null` with one token).
    pub itl_ms_median: Option<f64>,
    /// Tokens after the first over the time from the first to the last (`null` with one token).
    pub decode_tokens_per_s: Option<f64>,
    pub total_ms: f64,
    /// The KV-event publisher's counters, with `--kv-events`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<PublisherStats>,
}

impl GenerateReport {
    /// The figures of one generation sampled with `params`.
    pub fn of(g: &Output, params: &SamplingParams) -> Self {
        let itl: Vec<f64> = g.timings.itl().into_iter().map(millis).collect();
        let decoded = !itl.is_empty();
        GenerateReport {
            tokens: g.tokens.clone(),
            prompt_len: g.prompt_len,
            num_cached_tokens: g.num_cached_tokens,
            finish_reason: g.finish_reason.unwrap_or(FinishReason::Length),
            seed: g.seed.filter(|_| params.temperature != 0.0),
            ttft_ms: millis(g.timings.ttft),
            itl_ms_median: decoded.then(|| median(itl)),
            decode_tokens_per_s: decoded.then(|| g.timings.decode_tokens_per_s()),
            total_ms: millis(g.timings.total),
            kv_events: None,
        }
    }
}

/// Runs the command: the report to `out`, the hidden states to `--out`.
pub fn run(args: &GenerateArgs, out: &mut dyn Write) -> Result<()> {
    let JobRun { reason, output: generation, kv_events } = on_selected_backend("generate", &args.engine, Generate(args.sampling()))?;
    if let Some(path) = &args.out {
        write_tensors(hidden_tensors(&generation.hidden), path)?;
    }
    let report = GenerateReport { kv_events, ..GenerateReport::of(&generation, &args.sampling()) };
    if args.json {
        let json = serde_json::to_string(&report)
            .map_err(|source| HarnessError::Report { what: "the generate report".into(), source })?;
        return writeln!(out, "{json}").map_err(output);
    }
    writeln!(out, "backend: {reason}").map_err(output)?;
    if let Some(stats) = &report.kv_events {
        writeln!(out, "{}", fleet::summary(stats)).map_err(output)?;
    }
    writeln!(out, "prompt_len: {}", report.prompt_len).map_err(output)?;
    writeln!(out, "tokens: {:?}", report.tokens).map_err(output)?;
    match report.seed {
        Some(seed) => writeln!(out, "finish_reason: {} (seed {seed})", report.finish_reason),
        None => writeln!(out, "finish_reason: {}", report.finish_reason),
    }
    .map_err(output)?;
    let itl = report.itl_ms_median.map_or("-".into(), |v| format!("{v:.2} ms"));
    let rate = report.decode_tokens_per_s.map_or("-".into(), |v| format!("{v:.1} tokens/s"));
    writeln!(out, "ttft: {:.2} ms, itl median: {itl}, decode: {rate}", report.ttft_ms).map_err(output)?;
    if args.out.is_some() {
        print_shapes(out, report.num_cached_tokens, &generation.hidden)
    } else {
        writeln!(out, "num_cached_tokens: {}", report.num_cached_tokens).map_err(output)
    }
}

/// `generate`'s job: each warm-up request, then the request, generated with the same settings.
struct Generate(SamplingParams);

impl EngineJob for Generate {
    type Output = Output;

    fn run<B: Backend>(self, engine: &mut Engine<B>, args: &EngineArgs) -> Result<Output> {
        for warm in &args.warm {
            generate(engine, &RequestFile::load(warm)?, &self.0)?;
        }
        generate(engine, &RequestFile::load(&args.request)?, &self.0)
    }
}

fn generate<B: Backend>(engine: &mut Engine<B>, file: &RequestFile, params: &SamplingParams) -> Result<Output> {
    let request = file.request(engine.tokens());
    Ok(engine.run(request.generate(params.clone()))?)
}
