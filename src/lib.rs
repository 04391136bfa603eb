//! # omniprefix
//!
//! Prefix caching for multimodal ("Omni") LLM inference.
//!
//! Data flow: `prompt` (preprocess: canonical atoms, index map, positions) →
//! `sched` (owns the prefix `index` and the `kv` block pool) → `runner` on a
//! `backend` → full hidden states.

/// The ops a forward needs, behind one trait; the CPU reference backend.
pub mod backend;
/// The scheduler-to-runner contract.
pub mod batch;
/// Match measurement shared by `omniprefix bench match` and the criterion benches.
pub mod bench;
/// Canonical bytes, dtypes and keyed fingerprints of multimodal items.
pub mod canon;
/// The `omniprefix` command line.
pub mod cli;
/// `omniprefix demo`: every workload run three ways, tables and a JSON report.
pub mod demo;
/// The library face of a thinker stage: requests in, full hidden states out.
pub mod engine;
/// The crate's error type.
pub mod error;
/// Prefix indexes over atoms: the validated radix tree and the vLLM hash-chain baseline.
pub mod index;
/// Preprocessing: raw requests into canonical prompts, off the scheduling path.
pub mod preprocess;
/// KV block pool: free list, ref counts, index-owned blocks.
pub mod kv;
/// The JSON request-file format of `omniprefix hidden`.
pub mod request_file;
/// Canonical prompts: atoms, index map, 1-D and M-RoPE position ids.
pub mod prompt;
/// The scheduler: admits requests, matches prefixes, allocates blocks, builds batches.
pub mod sched;
/// The thinker model: config, weights, Qwen-family decoder, encoder cache.
pub mod model;
/// Executes a `ScheduledBatch` on a backend and returns full hidden states.
pub mod runner;
/// Seeded match workloads with the real Qwen3-Omni shapes.
pub mod workloads;
/// Soak test: Zipf prefix reuse under eviction pressure, checked for leaks.
pub mod soak;
/// Time-to-first-token measurement: cached vs uncached, capture overhead.
pub mod ttft;

pub use error::{Error, Result};
