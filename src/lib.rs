//! # omniprefix
//!
//! Prefix caching for multimodal ("Omni") LLM inference.
//!
//! Data flow: `prompt` (preprocess: canonical atoms, index map, positions) →
//! `sched` (owns the prefix `index` and the `kv` block pool) → `runner` on a
//! `backend` → full hidden states.

pub mod backend;
pub mod batch;
pub mod bench;
pub mod canon;
pub mod cli;
pub mod demo;
pub mod engine;
pub mod error;
/// The harness's error type (CLI, demo, benchmarks, workloads); not part of the engine's API.
pub mod harness_error;
pub mod index;
pub mod preprocess;
pub mod kv;
pub mod request_file;
pub mod prompt;
pub mod sched;
pub mod model;
pub mod runner;
pub mod workloads;
pub mod soak;
pub mod ttft;

pub use error::{Error, Result};
