//! `omniprefix._omniprefix`: the Python extension over the omniprefix engine.
//!
//! | module | what it binds |
//! | --- | --- |
//! | [`engine`] | `Engine` (prefill, generate, stream) |
//! | [`stream`] | `Stream`: one request's events, and its result |
//! | [`pump`] | `EventPump`: one reader for many streams (`AsyncEngine`'s) |
//! | [`outputs`] | `Output`, `Generation`, `AudioChunk` |
//! | [`item`] | `Item` and the borrowed item specs of one call |
//! | [`matcher`] | `fingerprint`, `Prompt`, `PrefixIndex`, `Match` |
//! | [`kv_events`] | `block_hashes`: a request's KV event block hashes, without a model |
//! | [`arrays`] | numpy in (token ids, content views, float matrices) and out |
//! | [`options`] | engine and matcher keyword options |
//! | [`errors`] | the exception classes; panics become `InternalError` |

use pyo3::prelude::*;

mod arrays;
mod engine;
mod errors;
mod item;
mod kv_events;
mod matcher;
mod options;
mod outputs;
mod pump;
mod stream;

#[pymodule]
fn _omniprefix(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // The Rust side's allocator (the engine's `mimalloc` feature); Python objects keep Python's.
    omniprefix::alloc::keep_freed_pages();
    errors::register(m)?;
    m.add_class::<engine::PyEngine>()?;
    m.add_class::<stream::Stream>()?;
    m.add_class::<pump::EventPump>()?;
    m.add_class::<outputs::PyOutput>()?;
    m.add_class::<outputs::PyGeneration>()?;
    m.add_class::<outputs::PyAudioChunk>()?;
    m.add_class::<item::Item>()?;
    m.add_class::<matcher::Prompt>()?;
    m.add_class::<matcher::PyPrefixIndex>()?;
    m.add_class::<matcher::PyMatch>()?;
    m.add_class::<matcher::InsertOutcome>()?;
    m.add_function(wrap_pyfunction!(matcher::fingerprint, m)?)?;
    m.add_function(wrap_pyfunction!(matcher::vllm_uuids, m)?)?;
    m.add_function(wrap_pyfunction!(kv_events::block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(engine::checkpoint_context_len, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("DEFAULT_BLOCK_SIZE", omniprefix::kv::DEFAULT_BLOCK_SIZE)?;
    Ok(())
}
