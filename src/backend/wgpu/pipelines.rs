//! The shaders of `wgsl/` and a cache of compute pipelines keyed by
//! (shader, entry point, override constants): each is compiled once per device.
//!
//! Every kernel is compiled after a prelude with the f16 pair conversions
//! (`wgsl/f16_pairs.wgsl`), or, on a device that lacks them
//! (`DownlevelFlags::SHADER_F16_IN_F32`), after stubs (`wgsl/f16_pairs_absent.wgsl`):
//! the f32 kernels then still compile and f16 storage is refused. Next comes the kernel's
//! uniform params struct and its binding `p`, written from the Rust struct the host
//! uploads ([`Shader::params`], see [`crate::backend::wgpu::params`]). The attention kernels
//! also share the page-reading helpers of `wgsl/paged_kv.wgsl`, a second prelude, and
//! `wgsl/paged_decode.wgsl`, a third: their constants, bindings and workgroup arrays, and the
//! split-KV decode steps (softmax fold, partial write).
//! `wgsl/paged_decode_subgroup.wgsl` uses subgroup operations and is compiled only on a
//! device opened with `Features::SUBGROUP` ([`Shader::needs_subgroups`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::backend::wgpu::kernel_params::{
    AttnParams, CopyParams, DenseRowParams, EwParams, MatmulParams, MoeParams, NormParams, RopeParams,
    RowParams,
};
use crate::backend::wgpu::params::ParamsLayout;

/// A file of `wgsl/`, compiled into the binary: (name inside `wgsl/`, source).
macro_rules! wgsl_file {
    ($name:literal) => {
        ($name, include_str!(concat!("../../../wgsl/", $name)))
    };
}

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
        self.file().0
    }

    /// WGSL source of the kernel file alone.
    pub fn kernel_source(self) -> &'static str {
        self.file().1
    }

    /// The kernel file: name inside `wgsl/` and source.
    fn file(self) -> (&'static str, &'static str) {
        match self {
            Shader::PagedRows => wgsl_file!("paged_rows.wgsl"),
            Shader::CopyBlocks => wgsl_file!("copy_blocks.wgsl"),
            Shader::PagedAttention => wgsl_file!("paged_attention.wgsl"),
            Shader::PagedDecodeSubgroup => wgsl_file!("paged_decode_subgroup.wgsl"),
            Shader::Matmul => wgsl_file!("matmul.wgsl"),
            Shader::RmsNorm => wgsl_file!("rmsnorm.wgsl"),
            Shader::Rope => wgsl_file!("rope.wgsl"),
            Shader::Elementwise => wgsl_file!("elementwise.wgsl"),
            Shader::Rows => wgsl_file!("rows.wgsl"),
            Shader::Moe => wgsl_file!("moe.wgsl"),
        }
    }

    /// The uniform parameters the kernel binds as `p` (binding 0), declared in Rust by
    /// `wgsl_params!` in `kernel_params.rs`.
    pub(crate) fn params(self) -> &'static ParamsLayout {
        match self {
            Shader::PagedRows => &RowParams::LAYOUT,
            Shader::CopyBlocks => &CopyParams::LAYOUT,
            Shader::PagedAttention | Shader::PagedDecodeSubgroup => &AttnParams::LAYOUT,
            Shader::Matmul => &MatmulParams::LAYOUT,
            Shader::RmsNorm => &NormParams::LAYOUT,
            Shader::Rope => &RopeParams::LAYOUT,
            Shader::Elementwise => &EwParams::LAYOUT,
            Shader::Rows => &DenseRowParams::LAYOUT,
            Shader::Moe => &MoeParams::LAYOUT,
        }
    }

    /// Whether the kernel uses subgroup operations (needs `Features::SUBGROUP`).
    pub fn needs_subgroups(self) -> bool {
        matches!(self, Shader::PagedDecodeSubgroup)
    }

    /// The files of `wgsl/` that are no kernel but composed before kernels by
    /// [`Shader::source`]: name inside `wgsl/` and source.
    pub const PRELUDES: [(&'static str, &'static str); 5] =
        [F16_PAIRS, F16_PAIRS_ABSENT, INVOCATION, PAGED_KV, PAGED_DECODE];

    /// WGSL source as compiled: the f16 pair prelude (`f16_pairs`: the device has the
    /// conversions) or its stubs; the params struct and its binding `p`; the entry builtins
    /// (all but the matrix products); the page-reading helpers and the split-KV decode
    /// steps for the attention kernels; then the kernel.
    pub fn source(self, f16_pairs: bool) -> String {
        let prelude = if f16_pairs { F16_PAIRS } else { F16_PAIRS_ABSENT };
        let shared: &[(&str, &str)] = match self {
            Shader::PagedAttention | Shader::PagedDecodeSubgroup => &[INVOCATION, PAGED_KV, PAGED_DECODE],
            Shader::Matmul => &[],
            Shader::PagedRows
            | Shader::CopyBlocks
            | Shader::RmsNorm
            | Shader::Rope
            | Shader::Elementwise
            | Shader::Rows
            | Shader::Moe => &[INVOCATION],
        };
        let mut parts = vec![prelude.1.to_string(), self.params().wgsl()];
        parts.extend(shared.iter().map(|&(_, source)| source.to_string()));
        parts.push(self.kernel_source().to_string());
        parts.join("\n")
    }
}

/// Page-reading helpers (block table lookup, f32 / f16 page elements) of the attention kernels.
const PAGED_KV: (&str, &str) = wgsl_file!("paged_kv.wgsl");

/// What the attention kernels share: constants, bindings and workgroup arrays, and, once a
/// tile's scores are in, the split-KV decode's online softmax fold with the V rows and its
/// partial write.
const PAGED_DECODE: (&str, &str) = wgsl_file!("paged_decode.wgsl");

/// The builtins an entry point takes (`Invocation`) over a 2-D dispatch of workgroups, the
/// workgroup's index and an element-wise kernel's element: every kernel but the matrix products.
const INVOCATION: (&str, &str) = wgsl_file!("invocation.wgsl");

/// The f16 pair conversions every kernel may call.
const F16_PAIRS: (&str, &str) = wgsl_file!("f16_pairs.wgsl");
/// Stubs of [`F16_PAIRS`] for devices without the conversions.
const F16_PAIRS_ABSENT: (&str, &str) = wgsl_file!("f16_pairs_absent.wgsl");

/// Cache key: the constants are kept in call order (callers pass them in a fixed order).
type PipelineKey = (Shader, &'static str, Vec<(&'static str, u32)>);

/// Compiled shader modules and pipelines of one device.
#[derive(Default)]
pub struct PipelineCache {
    pub(super) modules: Mutex<HashMap<Shader, wgpu::ShaderModule>>,
    pub(super) pipelines: Mutex<HashMap<PipelineKey, Arc<wgpu::ComputePipeline>>>,
}

/// Locks a cache map; a poisoned lock only means another thread panicked mid-insert
/// of a complete value, so the map is still consistent.
pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
