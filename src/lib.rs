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
pub mod index;
pub mod preprocess;
pub mod kv;
pub mod request_file;
pub mod prompt;
pub mod sched;
pub mod model;
pub mod runner;

pub use error::{Error, Result};
