//! The shaders of `wgsl/` and a cache of compute pipelines keyed by
//! (shader, entry point, override constants): each is compiled once per device.
//!
//! Every kernel is compiled after a prelude with the f16 pair conversions
//! (`wgsl/f16_pairs.wgsl`), or, on a device that lacks them
//! (`DownlevelFlags::SHADER_F16_IN_F32`), after stubs (`wgsl/f16_pairs_absent.wgsl`):
//! the f32 kernels then still compile and f16 storage is refused. The attention kernels
//! also share the page-reading helpers of `wgsl/paged_kv.wgsl`, a second prelude, and
//! `wgsl/paged_decode.wgsl`, a third: their parameters, bindings and workgroup arrays, and the
//! split-KV decode steps (softmax fold, partial write).
//! `wgsl/paged_decode_subgroup.wgsl` uses subgroup operations and is compiled only on a
//! device opened with `Features::SUBGROUP` ([`Shader::needs_subgroups`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::backend::wgpu::context::GpuContext;
use crate::{Error, Result};
use crate::error::GpuError;

/// One WGSL file of `wgsl/`, compiled into the binary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Shader {
    PagedRows,
    CopyBlocks,
    PagedAttention,
    PagedDecodeSubgroup,
    Matmul,
    RmsNorm,
    Rope,
    Elementwise,
    Rows,
    Moe,
}

impl Shader {
    /// Every shader (every kernel file of `wgsl/`).
    pub const ALL: [Shader; 10] = [
        Shader::PagedRows,
        Shader::CopyBlocks,
        Shader::PagedAttention,
        Shader::PagedDecodeSubgroup,
        Shader::Matmul,
        Shader::RmsNorm,
        Shader::Rope,
        Shader::Elementwise,
        Shader::Rows,
        Shader::Moe,
    ];

    /// File name inside `wgsl/`.
    pub fn name(self) -> &'static str {
        match self {
            Shader::PagedRows => "paged_rows.wgsl",
            Shader::CopyBlocks => "copy_blocks.wgsl",
            Shader::PagedAttention => "paged_attention.wgsl",
            Shader::PagedDecodeSubgroup => "paged_decode_subgroup.wgsl",
            Shader::Matmul => "matmul.wgsl",
            Shader::RmsNorm => "rmsnorm.wgsl",
            Shader::Rope => "rope.wgsl",
            Shader::Elementwise => "elementwise.wgsl",
            Shader::Rows => "rows.wgsl",
            Shader::Moe => "moe.wgsl",
        }
    }

    /// WGSL source of the kernel file alone.
    pub fn kernel_source(self) -> &'static str {
        match self {
            Shader::PagedRows => include_str!("../../../wgsl/paged_rows.wgsl"),
            Shader::CopyBlocks => include_str!("../../../wgsl/copy_blocks.wgsl"),
            Shader::PagedAttention => include_str!("../../../wgsl/paged_attention.wgsl"),
            Shader::PagedDecodeSubgroup => include_str!("../../../wgsl/paged_decode_subgroup.wgsl"),
            Shader::Matmul => include_str!("../../../wgsl/matmul.wgsl"),
            Shader::RmsNorm => include_str!("../../../wgsl/rmsnorm.wgsl"),
            Shader::Rope => include_str!("../../../wgsl/rope.wgsl"),
            Shader::Elementwise => include_str!("../../../wgsl/elementwise.wgsl"),
            Shader::Rows => include_str!("../../../wgsl/rows.wgsl"),
            Shader::Moe => include_str!("../../../wgsl/moe.wgsl"),
        }
    }

    /// Whether the kernel uses subgroup operations (needs `Features::SUBGROUP`).
    pub fn needs_subgroups(self) -> bool {
        matches!(self, Shader::PagedDecodeSubgroup)
    }

    /// WGSL source as compiled: the f16 pair prelude (`f16_pairs`: the device has the
    /// conversions) or its stubs; the entry builtins (all but the matrix products); the
    /// page-reading helpers and the split-KV decode steps for the attention kernels; then
    /// the kernel.
    pub fn source(self, f16_pairs: bool) -> String {
        let prelude = if f16_pairs { F16_PAIRS } else { F16_PAIRS_ABSENT };
        let shared = match self {
            Shader::PagedAttention | Shader::PagedDecodeSubgroup => [INVOCATION, PAGED_KV, PAGED_DECODE].join("\n"),
            Shader::Matmul => String::new(),
            Shader::PagedRows
            | Shader::CopyBlocks
            | Shader::RmsNorm
            | Shader::Rope
            | Shader::Elementwise
            | Shader::Rows
            | Shader::Moe => INVOCATION.to_string(),
        };
        format!("{prelude}\n{shared}\n{}", self.kernel_source())
    }
}

/// Page-reading helpers (block table lookup, f32 / f16 page elements) of the attention kernels.
pub const PAGED_KV: &str = include_str!("../../../wgsl/paged_kv.wgsl");

/// What the attention kernels share: parameters, bindings and workgroup arrays, and, once a
/// tile's scores are in, the split-KV decode's online softmax fold with the V rows and its
/// partial write.
pub const PAGED_DECODE: &str = include_str!("../../../wgsl/paged_decode.wgsl");

/// The builtins an entry point takes (`Invocation`) over a 2-D dispatch of workgroups, the
/// workgroup's index and an element-wise kernel's element: every kernel but the matrix products.
pub const INVOCATION: &str = include_str!("../../../wgsl/invocation.wgsl");

/// The f16 pair conversions every kernel may call.
pub const F16_PAIRS: &str = include_str!("../../../wgsl/f16_pairs.wgsl");
/// Stubs of [`F16_PAIRS`] for devices without the conversions.
pub const F16_PAIRS_ABSENT: &str = include_str!("../../../wgsl/f16_pairs_absent.wgsl");

/// Cache key: the constants are kept in call order (callers pass them in a fixed order).
type PipelineKey = (Shader, &'static str, Vec<(&'static str, u32)>);

/// Compiled shader modules and pipelines of one device.
#[derive(Default)]
pub struct PipelineCache {
    modules: Mutex<HashMap<Shader, wgpu::ShaderModule>>,
    pipelines: Mutex<HashMap<PipelineKey, Arc<wgpu::ComputePipeline>>>,
}

impl GpuContext {
    /// The pipeline of `entry` in `shader` with override `constants`, built on first use.
    pub(crate) fn pipeline(
        &self,
        shader: Shader,
        entry: &'static str,
        constants: &[(&'static str, u32)],
    ) -> Result<Arc<wgpu::ComputePipeline>> {
        let key = (shader, entry, constants.to_vec());
        if let Some(found) = lock(&self.pipelines.pipelines).get(&key) {
            return Ok(found.clone());
        }
        if shader.needs_subgroups() && !self.subgroups {
            return Err(Error::Gpu(GpuError::ShaderCompile {
                adapter: self.adapter_name.clone(),
                shader: shader.name().to_string(),
                entry: entry.to_string(),
                message: "needs subgroups (Features::SUBGROUP), which this device was opened without".into(),
            }));
        }
        let module = {
            let mut modules = lock(&self.pipelines.modules);
            match modules.get(&shader) {
                Some(module) => module.clone(),
                None => {
                    let module = self.compile_module(shader.name(), &shader.source(self.f16_pairs))?;
                    modules.insert(shader, module.clone());
                    module
                }
            }
        };
        let pipeline = Arc::new(self.build_pipeline(shader.name(), &module, entry, constants)?);
        lock(&self.pipelines.pipelines).insert(key, pipeline.clone());
        Ok(pipeline)
    }

    /// Compiles WGSL `source`; a rejected shader is [`GpuError::ShaderCompile`], not a panic.
    pub fn compile_module(&self, name: &str, source: &str) -> Result<wgpu::ShaderModule> {
        self.scoped("create_shader_module", || {
            self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(name),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            })
        })
        .map_err(|e| self.shader_error(name, "(module)", e))
    }

    /// Builds a compute pipeline with an automatic layout; failures are [`GpuError::ShaderCompile`].
    pub fn build_pipeline(
        &self,
        name: &str,
        module: &wgpu::ShaderModule,
        entry: &str,
        constants: &[(&str, u32)],
    ) -> Result<wgpu::ComputePipeline> {
        let constants: Vec<(&str, f64)> = constants.iter().map(|&(k, v)| (k, f64::from(v))).collect();
        self.scoped("create_compute_pipeline", || {
            self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: None,
                module,
                entry_point: Some(entry),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants: &constants,
                    zero_initialize_workgroup_memory: false,
                },
                cache: None,
            })
        })
        .map_err(|e| self.shader_error(name, entry, e))
    }

    fn shader_error(&self, shader: &str, entry: &str, e: Error) -> Error {
        let message = match e {
            Error::Gpu(GpuError::Op { message, .. }) => message,
            other => other.to_string(),
        };
        Error::Gpu(GpuError::ShaderCompile {
            adapter: self.adapter_name.clone(),
            shader: shader.to_string(),
            entry: entry.to_string(),
            message,
        })
    }
}

/// Locks a cache map; a poisoned lock only means another thread panicked mid-insert
/// of a complete value, so the map is still consistent.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
