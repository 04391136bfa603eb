//! One wgpu device per test binary, shared through a `OnceLock` (opening one costs
//! tens of milliseconds on lavapipe).
//!
//! Without an adapter the GPU tests print a loud skip message and pass, unless
//! `OMNIPREFIX_REQUIRE_GPU=1` (CI) makes them fail. Run with `WGPU_BACKEND=vulkan`
//! on machines with lavapipe.

use std::io::Write;
use std::sync::{Arc, OnceLock};

use omniprefix::backend::wgpu::{GpuContext, GpuOptions, WgpuBackend};

/// The shared device with the adapter's own binding limit, or `None` (after a loud
/// message) when there is no adapter and the environment does not require one.
pub fn gpu() -> Option<WgpuBackend> {
    gpu_with(None)
}

/// The shared device per binding cap (`None`: the adapter's own limit).
pub fn gpu_with(cap: Option<u64>) -> Option<WgpuBackend> {
    static DEFAULT: OnceLock<Option<WgpuBackend>> = OnceLock::new();
    static CAPPED: OnceLock<Option<WgpuBackend>> = OnceLock::new();
    let cell = if cap.is_some() { &CAPPED } else { &DEFAULT };
    shared(cell, GpuOptions { max_binding_bytes: cap, ..Default::default() })
}

/// A device opened as if the adapter lacked the f16 conversions (f32 storage only).
#[allow(dead_code)] // only the kernel tests check the fallback
pub fn gpu_without_f16() -> Option<WgpuBackend> {
    static WITHOUT_F16: OnceLock<Option<WgpuBackend>> = OnceLock::new();
    shared(&WITHOUT_F16, GpuOptions { without_f16: true, ..Default::default() })
}

/// A device opened as if the adapter lacked subgroups (decode takes the portable
/// kernel), per binding cap as [`gpu_with`].
#[allow(dead_code)] // only the kernel tests check the fallback
pub fn gpu_without_subgroups(cap: Option<u64>) -> Option<WgpuBackend> {
    static DEFAULT: OnceLock<Option<WgpuBackend>> = OnceLock::new();
    static CAPPED: OnceLock<Option<WgpuBackend>> = OnceLock::new();
    let cell = if cap.is_some() { &CAPPED } else { &DEFAULT };
    shared(cell, GpuOptions { max_binding_bytes: cap, without_subgroups: true, ..Default::default() })
}

fn shared(cell: &OnceLock<Option<WgpuBackend>>, options: GpuOptions) -> Option<WgpuBackend> {
    cell.get_or_init(|| match GpuContext::new(&options) {
        Ok(ctx) => Some(WgpuBackend::from_context(Arc::new(ctx))),
        Err(e) => {
            if std::env::var("OMNIPREFIX_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("OMNIPREFIX_REQUIRE_GPU=1 but no GPU device: {e}");
            }
            // Straight to stderr: the harness would swallow eprintln! of a passing test.
            let _ = writeln!(
                std::io::stderr(),
                "\n!!!!!!!! SKIPPING wgpu tests: no GPU adapter ({e}) !!!!!!!!\n"
            );
            None
        }
    })
    .clone()
}
