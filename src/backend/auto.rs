//! Choosing a backend at run time (`--backend cpu|wgpu|auto`).
//!
//! `wgpu` never falls back: a missing adapter, a missing limit or a failed device
//! request is the typed error itself. `auto` takes wgpu when a device opens on a
//! hardware adapter and the CPU backend otherwise (no device, or a software
//! rasteriser such as lavapipe, which is slower than the CPU backend), and always
//! says which it chose and why.

use std::fmt;
use std::str::FromStr;

use crate::backend::cpu::CpuBackend;
use crate::backend::wgpu::WgpuBackend;
use crate::error::{ConfigError, GpuError};
use crate::{Error, Result};

/// The backend a caller asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// The ndarray reference backend.
    Cpu,
    /// The wgpu backend; an error when no suitable adapter exists.
    Wgpu,
    /// wgpu when a suitable hardware adapter exists, else cpu.
    #[default]
    Auto,
}

impl FromStr for BackendKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "wgpu" => Ok(Self::Wgpu),
            "auto" => Ok(Self::Auto),
            other => Err(ConfigError::Invalid {
                component: "backend",
                field: "backend",
                expected: "cpu, wgpu or auto".into(),
                found: other.into(),
            }
            .into()),
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Cpu => "cpu",
            Self::Wgpu => "wgpu",
            Self::Auto => "auto",
        })
    }
}

/// An opened backend (callers are generic over [`crate::backend::Backend`], so they
/// match on this once and run the generic code with the concrete type).
#[derive(Debug, Clone)]
pub enum SelectedBackend {
    Cpu(CpuBackend),
    Wgpu(WgpuBackend),
}

/// The backend chosen for a [`BackendKind`], and a line saying why (for logs).
#[derive(Debug, Clone)]
pub struct Selection {
    pub backend: SelectedBackend,
    pub reason: String,
}

/// Opens the backend `kind` asks for with the default wgpu adapter.
///
/// ```
/// use omniprefix::backend::auto::{BackendKind, SelectedBackend, select};
/// let chosen = select("cpu".parse::<BackendKind>()?)?;
/// assert!(matches!(chosen.backend, SelectedBackend::Cpu(_)));
/// println!("backend: {}", chosen.reason);
/// # Ok::<(), omniprefix::Error>(())
/// ```
pub fn select(kind: BackendKind) -> Result<Selection> {
    select_with(kind, WgpuBackend::new)
}

/// [`select`] with the way to open a wgpu device passed in (tests inject failures).
pub fn select_with(kind: BackendKind, open_wgpu: impl FnOnce() -> Result<WgpuBackend>) -> Result<Selection> {
    let cpu = |reason: String| Selection { backend: SelectedBackend::Cpu(CpuBackend::new()), reason };
    let wgpu = |gpu: WgpuBackend, asked: &str| {
        let reason = format!("wgpu on {} ({asked})", gpu.context().adapter_name());
        Selection { backend: SelectedBackend::Wgpu(gpu), reason }
    };
    match kind {
        BackendKind::Cpu => Ok(cpu("cpu (asked for cpu)".into())),
        BackendKind::Wgpu => Ok(wgpu(open_wgpu()?, "asked for wgpu")),
        // A fallback is the expected outcome on a machine without a GPU: the line
        // says what was found, in the tone of a choice rather than of a failure.
        BackendKind::Auto => match open_wgpu() {
            Ok(gpu) if is_software(gpu.context().adapter_name()) => Ok(cpu(format!(
                "cpu (auto: the adapter found, {}, renders in software, slower than the CPU backend)",
                gpu.context().adapter_name()
            ))),
            Ok(gpu) => Ok(wgpu(gpu, "auto: a hardware adapter is available")),
            Err(Error::Gpu(GpuError::Unavailable { .. })) => {
                Ok(cpu("cpu (auto: no GPU adapter found)".into()))
            }
            Err(e) => Ok(cpu(format!("cpu (auto: the GPU adapter cannot run the kernels: {e})"))),
        },
    }
}

/// Adapters that expose Vulkan or GL but rasterise on the CPU (Mesa llvmpipe /
/// lavapipe, SwiftShader).
const SOFTWARE_ADAPTERS: [&str; 3] = ["llvmpipe", "lavapipe", "swiftshader"];

/// Whether `adapter` (a name as wgpu reports it) rasterises on the CPU.
pub fn is_software(adapter: &str) -> bool {
    let name = adapter.to_lowercase();
    SOFTWARE_ADAPTERS.iter().any(|s| name.contains(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_adapter() -> Result<WgpuBackend> {
        Err(GpuError::Unavailable { backends: "VULKAN".into(), reason: "no driver".into() }.into())
    }

    #[test]
    fn kinds_parse_and_print_and_reject_unknown_names() {
        for kind in [BackendKind::Cpu, BackendKind::Wgpu, BackendKind::Auto] {
            assert_eq!(kind.to_string().parse::<BackendKind>().unwrap(), kind);
        }
        let err = "metal".parse::<BackendKind>().unwrap_err();
        assert!(
            matches!(&err, Error::Config(ConfigError::Invalid { field: "backend", found, .. }) if found == "metal"),
            "{err}"
        );
    }

    #[test]
    fn wgpu_without_adapter_is_the_error_not_a_cpu_fallback() {
        let err = select_with(BackendKind::Wgpu, no_adapter).unwrap_err();
        assert!(
            matches!(&err, Error::Gpu(GpuError::Unavailable { reason, .. }) if reason == "no driver"),
            "{err}"
        );
    }

    #[test]
    fn auto_without_adapter_chooses_cpu_in_one_calm_line() {
        let chosen = select_with(BackendKind::Auto, no_adapter).unwrap();
        assert!(matches!(chosen.backend, SelectedBackend::Cpu(_)));
        assert_eq!(chosen.reason, "cpu (auto: no GPU adapter found)");
    }

    #[test]
    fn auto_names_what_keeps_a_present_adapter_from_running() {
        let too_small = || -> Result<WgpuBackend> {
            Err(GpuError::Op {
                adapter: "A (Vulkan)".into(),
                op: "request_device",
                message: "out of memory".into(),
            }
            .into())
        };
        let chosen = select_with(BackendKind::Auto, too_small).unwrap();
        assert!(matches!(chosen.backend, SelectedBackend::Cpu(_)));
        assert!(
            chosen.reason.starts_with("cpu (auto: the GPU adapter cannot run the kernels: ")
                && chosen.reason.contains("out of memory"),
            "{}",
            chosen.reason
        );
    }

    #[test]
    fn software_rasterisers_are_recognised_by_name() {
        assert!(is_software("llvmpipe (LLVM 15.0.6, 256 bits) (Vulkan)"));
        assert!(is_software("SwiftShader Device (Subzero) (Vulkan)"));
        assert!(!is_software("NVIDIA H200 (Vulkan)"));
        assert!(!is_software("Apple M2 (Metal)"));
    }

    #[test]
    fn cpu_never_opens_a_gpu() {
        let chosen =
            select_with(BackendKind::Cpu, || -> Result<WgpuBackend> { panic!("cpu must not open a device") })
                .unwrap();
        assert!(matches!(chosen.backend, SelectedBackend::Cpu(_)));
    }
}
