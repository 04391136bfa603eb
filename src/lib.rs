//! # omniprefix
//!
//! Prefix caching for multimodal ("Omni") LLM inference: a thinker stage whose
//! prefix cache is keyed on content (text ids and item fingerprints), whose
//! paged attention reads the cached prefix from pages, and which returns the
//! **full** hidden states of every position, cached ones included.
//!
//! Data flow: `prompt` (preprocess: canonical atoms, index map, positions) →
//! `sched` (owns the prefix `index` and the `kv` block pool) → `runner` on a
//! `backend` → full hidden states. [`Engine`] is the synchronous core;
//! [`ServedEngine`] runs it on its own thread with a handle per request.
//!
//! A first program: a served engine over a tiny random model, a prefill, then
//! a generation streamed token by token with each token's hidden rows.
//!
//! ```
//! use omniprefix::sched::SchedulerConfig;
//! use omniprefix::{Config, Engine, EngineConfig, Event, Request, SamplingParams, ServedOptions};
//!
//! let model = Config::tiny_qwen3(32, 2, 4, 2, 600); // hidden, layers, heads, kv heads, vocab
//! let engine = Engine::random(model, 1, EngineConfig { scheduler: SchedulerConfig { block_size: 4, ..Default::default() }, ..Default::default() })?;
//! let served = engine.serve(ServedOptions::default())?;
//!
//! let system: Vec<u32> = (0..12).collect();
//! let first = served.submit(Request::text(system.clone()))?.wait()?;
//! assert_eq!(first.hidden[0].1.nrows(), 12); // every position's hidden state
//!
//! let prompt = [system, vec![40, 41]].concat();
//! let mut reply = served.submit(Request::text(prompt).generate(SamplingParams::greedy(4)))?;
//! while let Some(event) = reply.recv() {
//!     match event? {
//!         Event::Token(token) => assert_eq!(token.hidden.len(), 3), // rows per captured layer
//!         Event::Finished(out) => assert_eq!(out.num_cached_tokens, 12), // the system prompt hit
//!         Event::Audio(_) => unreachable!("no audio was asked"),
//!     }
//! }
//! # Ok::<(), omniprefix::Error>(())
//! ```

pub mod alloc;
pub mod backend;
pub mod batch;
#[cfg(test)]
mod builds_run;
pub mod canon;
mod dtype;
pub mod engine;
pub mod error;
pub mod events;
pub mod index;
pub mod kv;
mod modality;
pub mod model;
pub mod preprocess;
pub mod prompt;
pub mod request_file;
pub mod runner;
pub mod sample;
pub mod sched;
pub mod speech;
pub mod tier;

pub use dtype::{Dtype, UnknownDtype};
pub use engine::{
    Encoder, EncoderOutput, Engine, EngineConfig, Event, ItemInput, Output, Request, RequestHandle,
    ServedEngine, ServedOptions, Task, TokenEvent,
};
pub use error::{Error, Result};
pub use model::Config;
pub use sample::SamplingParams;

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
