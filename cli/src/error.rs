//! The error type of the harness: the CLI, the demo, `bench match` / `ttft` /
//! `soak` and the workload generators. It wraps the engine's [`Error`] and adds
//! what only the harness can get wrong (workload names, embedded fixtures,
//! reports, the command line), so the engine's [`Error`] carries none of these.

use omniprefix::Error;
use omniprefix::error::{
    BackendError, CacheError, CheckpointError, ConfigError, EventsError, GpuError, InvariantViolation,
    IoError, RequestError, RequestFileError, SchedError,
};

use crate::chat::ChatError;

/// What can go wrong in the harness: the engine's errors and its own.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HarnessError {
    /// The engine (library) failed.
    #[error(transparent)]
    Engine(#[from] Error),
    /// A checkpoint's tokenizer or chat template, or the messages given to it.
    #[error(transparent)]
    Chat(ChatError),
    /// A command line that does not parse.
    #[error(transparent)]
    Args(#[from] clap::Error),
    /// A workload name `bench match` or the demo does not know.
    #[error("unknown workload {name:?}; known: {known}")]
    UnknownWorkload { name: String, known: String },
    /// An embedded fixture that does not hold what the code expects.
    #[error("fixture {file}: {problem}")]
    Fixture { file: &'static str, problem: String },
    /// Synthetic media whose generated data does not fit its shape.
    #[error("generated {what}: {source}")]
    GeneratedMedia { what: &'static str, source: ndarray::ShapeError },
    /// A workload item for which no synthetic embeddings were made.
    #[error("no synthetic embeddings for {item}")]
    NoEmbeddings { item: String },
    /// A report that cannot be serialised to JSON.
    #[error("cannot serialise {what} to JSON: {source}")]
    Report { what: String, source: serde_json::Error },
    /// A step that should have returned an output returned none.
    #[error("{what} returned no output")]
    NoOutput { what: &'static str },
    /// Blocks held by no request and not by the index after every request finished.
    #[error("{leaked} of {num_blocks} blocks leaked (neither free nor owned by the index)")]
    BlocksLeaked { leaked: usize, num_blocks: usize },
}

/// An unreadable file stays the engine's [`IoError`], wherever it was read.
impl From<ChatError> for HarnessError {
    fn from(e: ChatError) -> Self {
        match e {
            ChatError::Io(io) => HarnessError::Engine(io.into()),
            other => HarnessError::Chat(other),
        }
    }
}

/// The harness's result alias.
pub type Result<T, E = HarnessError> = std::result::Result<T, E>;

/// Lets a harness site build an engine error family directly
/// (`ConfigError::Invalid { .. }.into()`, `.map_err(|e| IoError::write(path, e))?`).
macro_rules! from_family {
    ($($family:ty),* $(,)?) => {$(
        impl From<$family> for HarnessError {
            fn from(e: $family) -> Self {
                HarnessError::Engine(e.into())
            }
        }
    )*};
}

from_family!(
    RequestError,
    RequestFileError,
    CheckpointError,
    ConfigError,
    SchedError,
    CacheError,
    InvariantViolation,
    BackendError,
    GpuError,
    IoError,
    EventsError,
);

/// An io failure writing the harness's output stream (stdout or the writer it was given).
pub fn output(source: std::io::Error) -> HarnessError {
    IoError::write("the output", source).into()
}
