//! The engine's integration tests, one binary: each test binary links the whole engine and its
//! dependencies, so one link serves every file here (they were 17 binaries). A file is a module
//! named after what it checks; run one with `cargo test --test engine radix::` (a name filter).
//! The helpers shared with `proptests/` and `benches/` are the `support` crate (`test-support/`).
//! Modules that need a feature are compiled only with it, as `required-features` did.

mod abort_safety;
mod bad_inputs;
mod code2wav_parity;
mod engine_api;
mod engine_full_hidden_states;
mod generation;
mod hf_generate;
mod hf_parity;
#[cfg(feature = "kv-events")]
mod kv_events;
mod metrics;
mod mrope_vectors;
mod radix;
mod scheduler;
mod served;
#[cfg(feature = "wgpu")]
mod shared_gpu;
mod speech_parity;
mod talker_parity;
mod vllm_vectors;
#[cfg(feature = "wgpu")]
mod wgpu_kernels;
#[cfg(feature = "wgpu")]
mod wgpu_model_parity;
#[cfg(feature = "wgpu")]
mod wgsl_portability;
