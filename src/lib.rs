//! # omniprefix
//!
//! Prefix caching for multimodal ("Omni") LLM inference.
//!
//! Data flow: `prompt` (preprocess: canonical atoms, index map, positions) →
//! `sched` (owns the prefix `index` and the `kv` block pool) → `runner` on a
//! `backend` → full hidden states.

pub mod backend;
pub mod batch;
pub mod canon;
pub mod engine;
pub mod error;
pub mod events;
pub mod index;
pub mod preprocess;
pub mod kv;
pub mod request_file;
pub mod prompt;
pub mod sched;
pub mod model;
pub mod runner;
pub mod sample;

pub use error::{Error, Result};

/// The Rust examples of the README and of `docs/engine.md`, compiled and run by
/// `cargo test --doc` so that they cannot rot.
#[cfg(doctest)]
#[allow(dead_code)]
mod doc_examples {
    #[doc = include_str!("../README.md")]
    struct Readme;
    #[doc = include_str!("../docs/engine.md")]
    struct EngineDoc;
}
