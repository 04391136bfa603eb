//! The exception classes and the one place a Rust error or panic becomes one.
//!
//! `omniprefix.Error` is the base; each error family of the engine has its
//! subclass, and the message is the Rust error's text. A panic never crosses
//! into Python: [`guard`] catches it and raises `InternalError`.

use std::panic::{AssertUnwindSafe, catch_unwind};

use omniprefix::Error as EngineError;
use omniprefix::error::{EventsError, SchedError};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(omniprefix, Error, PyException, "Base class of every omniprefix error.");
create_exception!(
    omniprefix,
    RequestError,
    Error,
    "A request the engine cannot serve: token ids, items, layouts, embeddings, sampling settings, tenant."
);
create_exception!(
    omniprefix,
    CheckpointError,
    Error,
    "A checkpoint folder that cannot be loaded: missing, config.json, safetensors, weights."
);
create_exception!(
    omniprefix,
    ConfigError,
    Error,
    "An engine or index setting that cannot work (block size, capture point, pool size, a KV events endpoint that cannot be bound)."
);
create_exception!(
    omniprefix,
    CacheError,
    Error,
    "A cache used against its contract (a block inserted twice, more blocks than the prompt has, a reset while requests hold blocks)."
);
create_exception!(
    omniprefix,
    GpuError,
    Error,
    "The wgpu device: no adapter, limits, shaders, device failures."
);
create_exception!(
    omniprefix,
    InternalError,
    Error,
    "A broken invariant or a panic inside the engine: a bug, reported instead of crashing."
);
create_exception!(
    omniprefix,
    EngineDeadError,
    Error,
    "The engine died (a step panicked): every pending and later call raises this. Withdraw it and start a new one."
);

/// The exception class of an engine error's family.
pub fn to_py(error: EngineError) -> PyErr {
    let message = error.to_string();
    match error {
        EngineError::Request(_) | EngineError::RequestFile(_) => RequestError::new_err(message),
        EngineError::Checkpoint(_) | EngineError::Io(_) => CheckpointError::new_err(message),
        // The KV events endpoints are settings too: one that does not parse or cannot be bound (a port in use).
        EngineError::Config(_)
        | EngineError::Events(EventsError::BadEndpoint { .. } | EventsError::Bind { .. }) => {
            ConfigError::new_err(message)
        }
        EngineError::Cache(_) | EngineError::Sched(SchedError::CacheInUse { .. }) => {
            CacheError::new_err(message)
        }
        EngineError::Gpu(_) => GpuError::new_err(message),
        EngineError::Sched(SchedError::EngineDead { .. }) => EngineDeadError::new_err(message),
        _ => InternalError::new_err(message),
    }
}

/// Runs `f`, turning an engine error into its exception and a panic into
/// `InternalError` (with the panic's message).
pub fn guard<T>(f: impl FnOnce() -> Result<T, EngineError>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result.map_err(to_py),
        Err(panic) => Err(InternalError::new_err(format!("internal panic: {}", panic_message(&*panic)))),
    }
}

/// The text a panic carried: the library's one reader of panic payloads.
pub use omniprefix::error::panic_message;

/// Adds the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("RequestError", py.get_type::<RequestError>())?;
    m.add("CheckpointError", py.get_type::<CheckpointError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("CacheError", py.get_type::<CacheError>())?;
    m.add("GpuError", py.get_type::<GpuError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    m.add("EngineDeadError", py.get_type::<EngineDeadError>())?;
    Ok(())
}
