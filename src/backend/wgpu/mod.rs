//! The wgpu backend: the WGSL kernels of top-level `wgsl/` (f32; subgroups only in
//! decode attention, where the adapter has them) behind a typed Rust layer.
//!
//! * [`GpuContext`] opens one adapter with its own limits and caches pipelines by
//!   (shader, entry point, override constants); its methods are the kernels, one per op.
//! * [`WgpuBackend`] implements [`crate::backend::Backend`] on top of it.
//! * Paged pools larger than one storage binding are split into chunks of whole
//!   blocks ([`pool::plan_pool`]); attention binds at most two chunks per pool.
//!
//! Every failure (no adapter, a missing limit, a pool too large, a rejected shader,
//! a device error) is a typed [`crate::Error`], never a panic.

mod backend;
mod context;
mod kernel_params;
pub mod ops;
mod params;
mod pipelines;
pub mod pool;
mod tensor;

pub use backend::{WgpuBackend, WgpuPages};
pub use context::{GpuContext, GpuOptions, check_limits};
pub use ops::attention::{KvPools, decode_split_len, prefill_slots, prefill_tiles};
pub use ops::moe::Routing;
pub use pipelines::Shader;
pub use pool::{PagedPool, PoolPlan, plan_pool};
pub use tensor::GpuTensor;
