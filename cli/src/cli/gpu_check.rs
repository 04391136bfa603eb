//! The hidden commands `scripts/gpu_bench.sh` runs on whatever adapter wgpu opens:
//! `omniprefix gpu-info` (the adapter, its driver, limits and subgroups, as one JSON line),
//! `omniprefix cpu-info` (the CPU kernels' builds, for `scripts/cpu_report.sh`) and
//! `omniprefix bench parity` (a checkpoint on wgpu against the CPU backend, same
//! weight and K/V dtypes, every capture and the last logits, as one JSON line).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use serde::Serialize;
use serde_json::json;

use omniprefix::backend::cpu::CpuBackend;
use omniprefix::backend::wgpu::{GpuContext, GpuOptions, WgpuBackend};
use omniprefix::backend::{Backend, Dtype};
use omniprefix::batch::ScheduledBatch;
use omniprefix::kv::BlockTable;
use omniprefix::model::{CaptureName, CaptureSpec, Thinker};
use omniprefix::prompt::Positions;
use omniprefix::runner::{ModelRunner, PromptInputs};

use super::runtime::DtypeArg;
use crate::error::{HarnessError, Result, output};

/// Arguments of `omniprefix gpu-info` (none: it opens the adapter `WGPU_BACKEND` names).
#[derive(Debug, Clone, Args)]
pub struct GpuInfoArgs {}

/// Prints the adapter wgpu opens as one JSON line.
pub fn info(_args: &GpuInfoArgs, out: &mut dyn Write) -> Result<()> {
    let ctx = GpuContext::new(&GpuOptions::default())?;
    let (i, l) = (ctx.adapter_info(), ctx.limits());
    let line = json!({
        "kind": "adapter",
        "adapter": ctx.adapter_name(),
        "name": i.name,
        "api": format!("{:?}", i.backend),
        "device_type": format!("{:?}", i.device_type),
        "vendor": i.vendor,
        "device": i.device,
        "driver": i.driver,
        "driver_info": i.driver_info,
        "stored_dtypes": ctx.stored_dtypes().iter().map(|d| d.name()).collect::<Vec<_>>(),
        // Whether decode attention takes the subgroup kernel, and the sizes the adapter reports.
        "subgroups": ctx.has_subgroups(),
        "subgroup_size": { "min": i.subgroup_min_size, "max": i.subgroup_max_size },
        "limits": {
            "max_storage_buffer_binding_size": l.max_storage_buffer_binding_size,
            "max_buffer_size": l.max_buffer_size,
            "max_storage_buffers_per_shader_stage": l.max_storage_buffers_per_shader_stage,
            "max_compute_workgroup_storage_size": l.max_compute_workgroup_storage_size,
            "max_compute_invocations_per_workgroup": l.max_compute_invocations_per_workgroup,
            "max_compute_workgroups_per_dimension": l.max_compute_workgroups_per_dimension,
        },
    });
    writeln!(out, "{line}").map_err(output)
}

/// Arguments of `omniprefix cpu-info` (none).
#[derive(Debug, Clone, Args)]
pub struct CpuInfoArgs {}

/// Prints the CPU's kernel builds (the one running and the ones it has) as one JSON line.
pub fn cpu_info(_args: &CpuInfoArgs, out: &mut dyn Write) -> Result<()> {
    let builds = omniprefix::backend::cpu::simd_builds();
    let line = json!({
        "kind": "cpu",
        "simd_running": builds.running,
        "simd_available": builds.available,
        "threads": rayon::current_num_threads(),
    });
    writeln!(out, "{line}").map_err(output)
}

/// Arguments of `omniprefix bench parity`.
#[derive(Debug, Clone, Args)]
pub struct ParityArgs {
    /// Checkpoint folder (`config.json` + safetensors), e.g. `fixtures/tiny/qwen3_dense`.
    #[arg(long)]
    pub model: PathBuf,
    /// How weight matrices are stored, on both backends.
    #[arg(long, default_value_t = DtypeArg(Some(Dtype::F32)))]
    pub dtype: DtypeArg,
    /// The element type of the K/V pages, on both backends.
    #[arg(long, default_value_t = Dtype::F32, value_parser = Dtype::parse_float)]
    pub kv_dtype: Dtype,
    /// Prompt length (token ids drawn deterministically below the vocabulary size).
    #[arg(long, default_value_t = 24)]
    pub tokens: usize,
}

/// What `bench parity` prints.
#[derive(Debug, Serialize)]
struct ParityReport {
    kind: &'static str,
    model: String,
    adapter: String,
    dtype: String,
    kv_dtype: String,
    tokens: usize,
    outputs: usize,
    /// `max |wgpu - cpu| / max |cpu|` over every output, the worst output's.
    worst_rel_vs_cpu: f32,
    worst_output: String,
}

/// Every capture and the last logits of one uncached step of `prompt`, by name, flattened.
fn outputs<B: Backend>(
    backend: B, args: &ParityArgs, prompt: &PromptInputs,
) -> Result<Vec<(String, Vec<f32>)>> {
    let backend = Arc::new(backend);
    let thinker = Arc::new(Thinker::from_dir_as(&*backend, &args.model, args.dtype.0)?);
    let layers = thinker.config().num_hidden_layers;
    let capture = CaptureSpec::new(CaptureName::every(layers), layers)?;
    let runner = ModelRunner::new(backend, thinker, capture)?.with_kv_dtype(args.kv_dtype);
    const BLOCK: usize = 16;
    let blocks = prompt.token_ids.len().div_ceil(BLOCK);
    let mut pages = runner.alloc_pages(blocks, BLOCK)?;
    let table = BlockTable::new((0..blocks as u32).collect(), BLOCK);
    let step = prompt.step(0, table, 0..prompt.token_ids.len())?;
    let mut outs = runner.execute(&ScheduledBatch { copies: vec![], seqs: vec![step] }, &mut pages)?;
    let out = outs.pop().ok_or(HarnessError::NoOutput { what: "the parity prompt's step" })?;
    let hidden = out.hidden.into_iter().map(|(n, m)| (n.to_string(), m.iter().copied().collect()));
    Ok(hidden.chain([("last_logits".to_string(), out.last_logits)]).collect())
}

/// Runs the checkpoint on wgpu and on the CPU and prints the worst relative error.
pub fn parity(args: &ParityArgs, out: &mut dyn Write) -> Result<()> {
    let gpu = WgpuBackend::new()?;
    let adapter = gpu.context().adapter_name().to_string();
    let vocab = omniprefix::model::Config::from_dir(&args.model)?.vocab_size;
    let token_ids: Vec<u32> = (0..args.tokens).map(|i| ((i * 37 + 11) % vocab.max(1)) as u32).collect();
    let prompt = PromptInputs { token_ids, embeds: vec![], positions: Positions::linear(args.tokens) };
    let got = outputs(gpu, args, &prompt)?;
    let want = outputs(CpuBackend, args, &prompt)?;
    let (mut worst, mut worst_output) = (0f32, String::new());
    for ((name, g), (_, w)) in got.iter().zip(&want) {
        let scale = w.iter().fold(f32::MIN_POSITIVE, |m, x| m.max(x.abs()));
        let err = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
        let err = if err.is_nan() { f32::INFINITY } else { err };
        if err >= worst {
            (worst, worst_output) = (err, name.clone());
        }
    }
    let report = ParityReport {
        kind: "parity",
        model: args.model.display().to_string(),
        adapter,
        dtype: args.dtype.to_string(),
        kv_dtype: args.kv_dtype.to_string(),
        tokens: args.tokens,
        outputs: got.len(),
        worst_rel_vs_cpu: worst,
        worst_output,
    };
    let json = serde_json::to_string(&report)
        .map_err(|source| HarnessError::Report { what: "the parity report".into(), source })?;
    writeln!(out, "{json}").map_err(output)
}
