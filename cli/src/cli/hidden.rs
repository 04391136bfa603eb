//! `omniprefix hidden`: run warm-up requests, then a request, and write its
//! full hidden states (`hidden.<L>`, `hidden.final`) and last-row logits.
//!
//! The request-file engine setup here ([`EngineArgs`](crate::cli::hidden::EngineArgs), [`on_selected_backend`](crate::cli::hidden::on_selected_backend),
//! [`write_tensors`](crate::cli::hidden::write_tensors)) is shared with `omniprefix generate`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Args;
use ndarray::Array2;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

use super::fleet::{self, FleetArgs};
use super::runtime::{BackendJob, Ran, RuntimeArgs};
use super::tier::TierArgs;
use crate::error::{Result, output};
use omniprefix::backend::Backend;
use omniprefix::engine::{Engine, EngineConfig, Output};
use omniprefix::error::{CheckpointError, Error};
use omniprefix::events::PublisherStats;
use omniprefix::model::{CaptureName, Config};
use omniprefix::request_file::RequestFile;
use omniprefix::sched::SchedulerConfig;

/// What `hidden` and `generate` share: the checkpoint, the request files, the
/// cache and the backend, so both build their engine the same way.
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Checkpoint folder (`config.json` + safetensors).
    #[arg(long)]
    pub model: PathBuf,
    /// The request file (JSON, see `docs/request-format.md`). `hidden` needs it; `generate`
    /// takes it or a text prompt (`--prompt`, `--messages`).
    #[arg(long)]
    pub request: Option<PathBuf>,
    /// A warm-up request file, run before the request; repeat the flag for
    /// several (`--warm a.json --warm b.json` runs them in that order).
    #[arg(long)]
    pub warm: Vec<PathBuf>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = SchedulerConfig::default().block_size)]
    pub block_size: usize,
    /// Blocks in the KV pool.
    #[arg(long, default_value_t = SchedulerConfig::default().num_blocks)]
    pub num_blocks: usize,
    /// Turn prefix caching off (every request computes every position).
    #[arg(long)]
    pub no_cache: bool,
    /// Reuse only whole cached blocks (no copy-on-write of a partly matched block).
    #[arg(long)]
    pub block_aligned: bool,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    /// Captured points: comma-separated layers (`0,2`), `final`, or `all`.
    /// Default: `0`, the middle layer, `final`.
    #[arg(long)]
    pub capture: Option<String>,
    #[command(flatten)]
    pub fleet: FleetArgs,
    #[command(flatten)]
    pub tier: TierArgs,
}

impl EngineArgs {
    /// The engine configuration these arguments ask for (reads the checkpoint's config for `--capture all`).
    pub fn engine_config(&self) -> Result<EngineConfig> {
        let model = Config::from_file(&self.model.join("config.json"))?;
        let capture = self
            .capture
            .as_deref()
            .map(|s| CaptureName::parse_list(s, model.num_hidden_layers))
            .transpose()?;
        let mut config = EngineConfig {
            scheduler: SchedulerConfig {
                block_size: self.block_size,
                num_blocks: self.num_blocks,
                token_granular_reuse: !self.block_aligned,
                ..Default::default()
            },
            capture,
            cache: !self.no_cache,
            dtype: self.runtime.dtype.0,
            kv_dtype: self.runtime.kv_dtype,
            ..Default::default()
        };
        self.fleet.apply(&mut config)?;
        self.tier.apply(&mut config, self.fleet.fingerprint_key.is_some())?;
        Ok(config)
    }
}

/// Work for an engine on whichever backend `--backend` selected (a trait, not a
/// closure, because the engine's type differs per backend).
pub trait EngineJob: Send {
    /// What the job hands back to its command.
    type Output: Send;
    /// Runs on a fresh engine over `args.model`.
    fn run<B: Backend>(self, engine: &mut Engine<B>, args: &EngineArgs) -> Result<Self::Output>;
}

/// What a job on the selected backend returns.
pub struct JobRun<T> {
    /// Why that backend was chosen.
    pub reason: String,
    pub output: T,
    /// The KV-event publisher's final counters (after the linger), with `--kv-events`.
    pub kv_events: Option<PublisherStats>,
}

/// Selects the backend, builds the engine, runs `job` in the `--threads` pool
/// (`purpose` names it), then closes the engine's KV-event sockets (after `--linger-s`).
pub fn on_selected_backend<J: EngineJob>(
    purpose: &'static str, args: &EngineArgs, job: J,
) -> Result<JobRun<J::Output>> {
    let config = args.engine_config()?;
    let Ran { reason, output: (output, kv_events) } =
        args.runtime.run(purpose, OnEngine { job, args, config })?;
    Ok(JobRun { reason, output, kv_events })
}

/// An [`EngineJob`] on a fresh engine over `args.model`, as a [`BackendJob`].
struct OnEngine<'a, J> {
    job: J,
    args: &'a EngineArgs,
    config: EngineConfig,
}

impl<J: EngineJob> BackendJob for OnEngine<'_, J> {
    type Output = (J::Output, Option<PublisherStats>);

    fn run<B: Backend + 'static>(self, backend: Arc<B>) -> Result<Self::Output> {
        let mut engine = Engine::from_dir_on(backend, &self.args.model, self.config)?;
        if let Some((endpoint, replay)) = engine.kv_events_endpoints() {
            fleet::announce(endpoint, replay);
        }
        let output = self.job.run(&mut engine, self.args)?;
        Ok((output, engine.close_kv_events()))
    }
}

/// Arguments of `omniprefix hidden`.
#[derive(Debug, Clone, Args)]
#[command(group(clap::ArgGroup::new("hidden_input").args(["request"]).required(true)))]
pub struct HiddenArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Output safetensors file.
    #[arg(long)]
    pub out: PathBuf,
}

/// Runs the command, printing `num_cached_tokens` and the output shapes to `out`.
pub fn run(args: &HiddenArgs, out: &mut dyn Write) -> Result<()> {
    let JobRun { reason, output: result, kv_events } = on_selected_backend("hidden", &args.engine, Prefill)?;
    writeln!(out, "backend: {reason}").map_err(output)?;
    if let Some(stats) = &kv_events {
        writeln!(out, "{}", fleet::summary(stats)).map_err(output)?;
    }
    let mut tensors = hidden_tensors(&result.hidden);
    tensors.push(f32_tensor("logits".into(), vec![1, result.last_logits.len()], &result.last_logits));
    write_tensors(tensors, &args.out)?;
    print_shapes(out, result.num_cached_tokens, &result.hidden)?;
    writeln!(out, "logits: [1, {}] (last position)", result.last_logits.len()).map_err(output)
}

/// `hidden`'s job: the warm-up requests, then the request, each prefilled.
struct Prefill;

impl EngineJob for Prefill {
    type Output = Output;

    fn run<B: Backend>(self, engine: &mut Engine<B>, args: &EngineArgs) -> Result<Output> {
        for warm in &args.warm {
            let file = RequestFile::load(warm)?;
            engine.run(file.request(engine.tokens()))?;
        }
        let file = RequestFile::load(required_request(args)?)?;
        Ok(engine.run(file.request(engine.tokens()))?)
    }
}

/// `--request`, which a command that reads no other prompt requires (its clap group does too).
pub fn required_request(args: &EngineArgs) -> Result<&Path> {
    args.request.as_deref().ok_or_else(|| {
        clap::Error::raw(clap::error::ErrorKind::MissingRequiredArgument, "--request <REQUEST> is required\n")
            .into()
    })
}

/// Prints `num_cached_tokens` and each captured point's shape, one per line.
pub fn print_shapes(
    out: &mut dyn Write, num_cached_tokens: usize, hidden: &[(CaptureName, Array2<f32>)],
) -> Result<()> {
    writeln!(out, "num_cached_tokens: {num_cached_tokens}").map_err(output)?;
    for (name, h) in hidden {
        writeln!(out, "{}: [{}, {}]", name.key(), h.nrows(), h.ncols()).map_err(output)?;
    }
    Ok(())
}

/// One tensor to write: name, dtype, shape, little-endian bytes.
#[derive(Debug, Clone)]
pub struct Tensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// `values` as a named f32 tensor of `shape`.
pub fn f32_tensor<'a>(name: String, shape: Vec<usize>, values: impl IntoIterator<Item = &'a f32>) -> Tensor {
    let bytes = values.into_iter().flat_map(|v| v.to_le_bytes()).collect();
    Tensor { name, dtype: Dtype::F32, shape, bytes }
}

/// Every captured point as `hidden.<L>` / `hidden.final`, `[rows, hidden]`.
pub fn hidden_tensors(hidden: &[(CaptureName, Array2<f32>)]) -> Vec<Tensor> {
    hidden.iter().map(|(name, h)| f32_tensor(name.key(), vec![h.nrows(), h.ncols()], h.iter())).collect()
}

/// Writes `tensors` as one safetensors file.
pub fn write_tensors(tensors: Vec<Tensor>, path: &Path) -> Result<()> {
    let st_err = |e: safetensors::SafeTensorError| {
        Error::Checkpoint(CheckpointError::Safetensors {
            path: path.display().to_string(),
            message: e.to_string(),
        })
    };
    let views = tensors
        .iter()
        .map(|t| Ok((t.name.clone(), TensorView::new(t.dtype, t.shape.clone(), &t.bytes).map_err(st_err)?)))
        .collect::<omniprefix::Result<Vec<_>>>()?;
    Ok(safetensors::tensor::serialize_to_file(views, &None, path).map_err(st_err)?)
}
