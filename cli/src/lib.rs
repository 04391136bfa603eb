//! # omniprefix-cli
//!
//! The harnesses around the [`omniprefix`] engine: the `omniprefix` command
//! line, the demo, `bench match` / `bench ttft` / `bench soak`, and the seeded
//! workload generators they share. None of this is the engine's API: a thinker
//! stage depends on `omniprefix` alone.

/// The `omniprefix` command line: one module per subcommand.
pub mod cli;
/// Match measurement shared by `bench match` and `benches/match.rs`.
pub mod bench;
/// `omniprefix demo`: every claim on embedded workloads, with tables.
pub mod demo;
/// The harness's error type: the engine's errors plus the harness's own.
pub mod error;
/// `fixtures/scenarios.json`, parsed once for every harness.
pub mod scenarios;
/// `omniprefix bench soak`: sustained load through a small pool.
pub mod soak;
/// `omniprefix bench ttft`: time to first token, cached vs uncached.
pub mod ttft;
/// Seeded workloads of the real Qwen3-Omni shapes.
pub mod workloads;

pub use error::{HarnessError, Result};

// Engine modules under their engine names, so harness code reads `crate::engine::Engine`.
use omniprefix::{backend, batch, canon, engine, index, model, preprocess, prompt, request_file, sched};
