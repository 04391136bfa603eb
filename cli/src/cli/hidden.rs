//! `omniprefix hidden`: run warm-up requests, then a request, and write its
//! full hidden states (`hidden.<L>`, `hidden.final`) and last-row logits.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Args;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

use omniprefix::backend::Backend;
use omniprefix::backend::auto::{BackendKind, SelectedBackend, select};
use omniprefix::engine::{Engine, EngineConfig, Output};
use omniprefix::error::{CheckpointError, Error, IoError};
use crate::error::{HarnessError, Result};
use omniprefix::model::{CaptureName, Config};
use omniprefix::request_file::RequestFile;

/// Arguments of `omniprefix hidden`.
#[derive(Debug, Clone, Args)]
pub struct HiddenArgs {
    /// Checkpoint folder (`config.json` + safetensors).
    #[arg(long)]
    pub model: PathBuf,
    /// The request file (JSON, see `docs/request-format.md`).
    #[arg(long)]
    pub request: PathBuf,
    /// Output safetensors file.
    #[arg(long)]
    pub out: PathBuf,
    /// Warm-up request files, run in order before the request.
    #[arg(long)]
    pub warm: Vec<PathBuf>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Blocks in the KV pool.
    #[arg(long, default_value_t = 1024)]
    pub num_blocks: usize,
    /// Turn prefix caching off (every request computes every position).
    #[arg(long)]
    pub no_cache: bool,
    /// Reuse only whole cached blocks (no copy-on-write of a partly matched block).
    #[arg(long)]
    pub block_aligned: bool,
    /// Where the model runs: `cpu`, `wgpu` (an error without an adapter, never a
    /// silent CPU fallback) or `auto` (wgpu when an adapter exists, else cpu).
    #[arg(long, default_value_t = BackendKind::Cpu)]
    pub backend: BackendKind,
    /// Captured points: comma-separated layers (`0,2`), `final`, or `all`.
    /// Default: `0`, the middle layer, `final`.
    #[arg(long)]
    pub capture: Option<String>,
}

/// Parses `--capture` for a model of `num_layers` layers: `all`, or a comma
/// list of `L`, `hidden.L` and `final`.
pub fn parse_capture(spec: &str, num_layers: usize) -> Result<Vec<CaptureName>> {
    if spec.trim() == "all" {
        return Ok((0..=num_layers).map(CaptureName::Hidden).chain([CaptureName::Final]).collect());
    }
    spec.split(',')
        .map(str::trim)
        .map(|part| match part.parse::<usize>() {
            Ok(layer) => Ok(CaptureName::Hidden(layer)),
            Err(_) => part.parse::<CaptureName>(),
        })
        .collect::<omniprefix::Result<_>>()
        .map_err(HarnessError::from)
}

/// The name a captured point is written under: `hidden.<L>` or `hidden.final`.
pub fn tensor_name(name: CaptureName) -> String {
    match name {
        CaptureName::Hidden(layer) => format!("hidden.{layer}"),
        CaptureName::Final => "hidden.final".into(),
    }
}

/// Runs the command, printing `num_cached_tokens` and the output shapes to `out`.
pub fn run(args: &HiddenArgs, out: &mut dyn Write) -> Result<()> {
    let model = Config::from_file(&args.model.join("config.json"))?;
    let capture = args.capture.as_deref().map(|s| parse_capture(s, model.num_hidden_layers)).transpose()?;
    let config = EngineConfig {
        block_size: args.block_size,
        num_blocks: args.num_blocks,
        capture,
        cache: !args.no_cache,
        token_granular_reuse: !args.block_aligned,
        ..Default::default()
    };
    let selection = select(args.backend)?;
    let stdout_err = |source| Error::Io(IoError::write("stdout", source));
    writeln!(out, "backend: {}", selection.reason).map_err(stdout_err)?;
    let output = match selection.backend {
        SelectedBackend::Cpu(cpu) => run_on(Arc::new(cpu), args, config)?,
        SelectedBackend::Wgpu(gpu) => run_on(Arc::new(gpu), args, config)?,
    };
    write_output(&output, &args.out)?;
    writeln!(out, "num_cached_tokens: {}", output.num_cached_tokens).map_err(stdout_err)?;
    for (name, h) in &output.hidden {
        writeln!(out, "{}: [{}, {}]", tensor_name(*name), h.nrows(), h.ncols()).map_err(stdout_err)?;
    }
    writeln!(out, "logits: [1, {}] (last position)", output.last_logits.len()).map_err(stdout_err)?;
    Ok(())
}

/// Runs the warm-up requests, then the request, on one backend.
fn run_on<B: Backend>(backend: Arc<B>, args: &HiddenArgs, config: EngineConfig) -> Result<Output> {
    let mut engine = Engine::from_dir_on(backend, &args.model, config)?;
    for warm in &args.warm {
        let file = RequestFile::load(warm)?;
        engine.prefill(file.request(engine.tokens()))?;
    }
    let file = RequestFile::load(&args.request)?;
    Ok(engine.prefill(file.request(engine.tokens()))?)
}

/// Writes every captured point as f32 `[seq_len, hidden]` and `logits` `[1, vocab]`.
fn write_output(output: &Output, path: &Path) -> Result<()> {
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = output
        .hidden
        .iter()
        .map(|(name, h)| {
            let bytes = h.iter().flat_map(|v| v.to_le_bytes()).collect();
            (tensor_name(*name), vec![h.nrows(), h.ncols()], bytes)
        })
        .collect();
    let logits = output.last_logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    tensors.push(("logits".into(), vec![1, output.last_logits.len()], logits));
    let st_err = |e: safetensors::SafeTensorError| Error::Checkpoint(CheckpointError::Safetensors { path: path.display().to_string(), message: e.to_string() });
    let views = tensors
        .iter()
        .map(|(name, shape, bytes)| Ok((name.clone(), TensorView::new(Dtype::F32, shape.clone(), bytes).map_err(st_err)?)))
        .collect::<omniprefix::Result<Vec<_>>>()?;
    Ok(safetensors::tensor::serialize_to_file(views, &None, path).map_err(st_err)?)
}
