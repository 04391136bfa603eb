//! # omniprefix-cli
//!
//! The harnesses around the [`omniprefix`] engine: the `omniprefix` command
//! line, the demo, `bench match` / `bench ttft` / `bench ttfa` / `bench soak` / `bench serve`, and the seeded
//! workload generators they share. None of this is the engine's API: a thinker
//! stage depends on `omniprefix` alone.

pub mod bench;
pub mod chat;
pub mod cli;
pub mod demo;
pub mod error;
pub mod scenarios;
pub mod scratch;
pub mod serve;
pub mod soak;
pub mod ttfa;
pub mod ttft;
pub mod workloads;

pub use error::{HarnessError, Result};
