//! The crate's error type: one [`Error`] that wraps one enum per layer that fails.
//!
//! | variant | enum | what failed |
//! | --- | --- | --- |
//! | [`Error::Request`] | [`RequestError`] | what a caller sent: items, prompt, token ids, placeholders, embeddings, DeepStack rows, sizes, tenant, sampling parameters |
//! | [`Error::RequestFile`] | [`RequestFileError`] | a request file (JSON) or the safetensors it names |
//! | [`Error::Checkpoint`] | [`CheckpointError`] | a model checkpoint: `config.json`, safetensors, weights |
//! | [`Error::Config`] | [`ConfigError`] | a setting of the engine, scheduler, pool or backend choice, or a capture point |
//! | [`Error::Sched`] | [`SchedError`] | the scheduler protocol: request ids, batches handed back, a stopped engine |
//! | [`Error::Runner`] | [`RunnerError`] | a batch built by hand for the model runner |
//! | [`Error::Cache`] | [`CacheError`] | the prefix index or the KV block pool used against its contract |
//! | [`Error::Invariant`] | [`InvariantViolation`] | a bug: a `validate()` check, or a component that broke its contract |
//! | [`Error::Backend`] | [`BackendError`] | a backend op given operands of the wrong shape or an index out of range |
//! | [`Error::Gpu`] | [`GpuError`] | the wgpu device: adapter, limits, shaders, device-side failures |
//! | [`Error::Io`] | [`IoError`] | a file (or stream) read or written, with its path |
//! | [`Error::Events`] | [`EventsError`] | the KV-event publisher: its endpoints, its thread |
//! | [`Error::ThreadPool`] | — | a worker thread pool could not start |
//!
//! Every family converts into [`Error`] with `From`, so a site reads
//! `return Err(RequestError::EmptyPrompt.into())` or `.map_err(|e| IoError::read(path, e))?`.
//! Each variant names what was wrong and where (item, position, tensor, file, op).
//! A request is named by the id its caller chose, and not at all where the
//! caller has no id for it yet (an engine numbers only the requests it accepts).
//!
//! This module sits below every other: it imports no layer of the crate, only
//! the leaf [`Modality`].

use std::fmt;
use std::path::Path;

use crate::modality::Modality;

/// Everything that can go wrong in omniprefix, by the layer that failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// What a caller sent cannot be served.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// A request file or one of the tensor files it names.
    #[error(transparent)]
    RequestFile(#[from] RequestFileError),
    /// A model checkpoint that cannot be loaded.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A setting that cannot work.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The scheduler's protocol was not followed.
    #[error(transparent)]
    Sched(#[from] SchedError),
    /// A hand-built batch does not fit itself, the model or the pages.
    #[error(transparent)]
    Runner(#[from] RunnerError),
    /// The prefix index or the block pool was used against its contract.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// A `validate()` check failed, or a component broke its contract (an
    /// internal bug, reported instead of panicking).
    #[error(transparent)]
    Invariant(#[from] InvariantViolation),
    /// A backend op refused its operands.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The GPU device failed or cannot run the kernels.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// A file or stream could not be read or written.
    #[error(transparent)]
    Io(#[from] IoError),
    /// The KV-event publisher cannot start.
    #[error(transparent)]
    Events(#[from] EventsError),
    /// A worker thread pool could not start.
    #[error("cannot start {threads} {purpose} threads: {source}")]
    ThreadPool { purpose: &'static str, threads: usize, source: rayon::ThreadPoolBuildError },
}

impl Error {
    /// This error without a request id in it (see [`RequestError::unnamed`]).
    pub(crate) fn unnamed(self) -> Self {
        match self {
            Error::Request(e) => Error::Request(e.unnamed()),
            other => other,
        }
    }
}

/// The KV-event publisher ([`crate::events`]) at startup: the engine refuses
/// to start rather than run without the stream it was asked for.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EventsError {
    /// An endpoint that is not a `tcp://host:port` ZMQ address.
    #[error("KV events {socket} endpoint {endpoint:?} is not a tcp://host:port address: {reason}")]
    BadEndpoint { socket: &'static str, endpoint: String, reason: String },
    /// The endpoint parsed but cannot be bound (a port in use, an address not on this host).
    #[error("KV events {socket} endpoint {endpoint}: cannot bind: {reason}")]
    Bind { socket: &'static str, endpoint: String, reason: String },
    /// The publisher's thread or its runtime could not start.
    #[error("KV events publisher cannot start: {reason}")]
    Start { reason: String },
}

/// The message of a caught panic (`&str` or `String` payloads; a placeholder otherwise).
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with no message".into())
}

/// Crate-wide result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a unit test returns when it can also fail for reasons outside the engine
/// (a fixture that does not parse, a test array of the wrong shape).
#[cfg(test)]
pub(crate) type TestResult<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

/// What a caller sent: items, the prompt, its token ids and placeholders, the
/// embeddings and DeepStack rows of its items, and what admission checks.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    // ---- items ----
    /// A tensor's shape does not fit what its layout says.
    #[error("item {item} ({modality:?}): shape {found:?} does not fit {expected}")]
    ShapeMismatch { item: usize, modality: Modality, expected: String, found: Vec<usize> },
    /// NaN or ±Inf inside an item's content.
    #[error("item {item}: non-finite value at flat index {index}")]
    NonFinite { item: usize, index: usize },
    /// NaN or ±Inf in an item's embeddings or DeepStack rows (given with the
    /// request or returned by its encoder): cached, they would poison every later hit.
    #[error("item {item}: non-finite {what} value at row {row}, column {column}")]
    NonFiniteEmbeddings { item: usize, what: EmbeddingPart, row: usize, column: usize },
    /// An item with no bytes or no rows.
    #[error("item {item}: empty ({what})")]
    EmptyItem { item: usize, what: &'static str },
    /// An item whose content is too large to count in bytes (a broadcast view, say).
    #[error("item {item}: {elements} elements of {element_bytes} bytes overflow a byte count")]
    ItemTooLarge { item: usize, elements: usize, element_bytes: usize },
    /// Raw media whose shape does not fit what it claims to be.
    #[error("{what}: shape {found:?} where {expected} was expected")]
    MediaShape { what: &'static str, expected: String, found: Vec<usize> },
    /// An image/video grid whose h or w does not divide by the merge size, so
    /// its patches do not merge into whole tokens on an `h/merge x w/merge` grid.
    #[error("item {item}: grid t·h·w {grid_thw:?}: h and w are not divisible by the merge size {merge}")]
    GridNotMergeable { item: usize, grid_thw: [u32; 3], merge: u32 },
    /// A layout field that cannot describe the item: a layout kind of another
    /// modality (`kind`), a time step that is not finite and positive or
    /// places frames past the M-RoPE range (`seconds_per_grid`), a grid whose
    /// token count overflows (`grid_thw`), a declared token count that is not
    /// the layout's (`num_tokens`).
    #[error("item {item}: layout field {field} is invalid: expected {expected}, found {found}")]
    InvalidLayout { item: usize, field: &'static str, expected: String, found: String },
    /// An item of one modality where another was required.
    #[error("item {item}: modality {found:?} where {expected:?} was required")]
    ItemModalityMismatch { item: usize, expected: Modality, found: Modality },
    /// An item's routing hash (the frontend's name of it, e.g. Dynamo's
    /// `extra_args["mm_hashes"]`) that is not 16 hex digits. `found` is the
    /// caller's text, cut to its first 40 characters.
    #[error("item {item}: routing hash {found:?} is not 16 hex digits")]
    InvalidRoutingHash { item: usize, found: String },

    // ---- the prompt ----
    /// A prompt with no tokens at all.
    #[error("empty prompt: no tokens")]
    EmptyPrompt,
    /// A prompt longer than positions can address (`u32`).
    #[error("prompt of {positions} positions exceeds u32::MAX")]
    PromptTooLong { positions: usize },
    /// A placeholder id used as plain text, outside any item span.
    #[error("position {position}: placeholder id {token} in text, outside any item span")]
    StrayPlaceholder { position: usize, token: u32 },
    /// A token id at or past the vocabulary size.
    #[error("position {position}: token id {token} is not below the vocab size {vocab_size}")]
    TokenOutOfVocab { position: usize, token: u32, vocab_size: u32 },
    /// A run of expanded placeholders whose length disagrees with its item's layout.
    #[error(
        "item {item} at position {position}: {found} placeholder tokens where its layout needs {expected}"
    )]
    PlaceholderCountMismatch { item: usize, position: usize, expected: usize, found: usize },
    /// A placeholder with no item of its modality left to fill it.
    #[error(
        "position {position}: {modality:?} placeholder but all {available} {modality:?} item(s) are used"
    )]
    MissingItem { position: usize, modality: Modality, available: usize },
    /// Items that no placeholder asked for.
    #[error("{count} {modality:?} item(s) have no placeholder; first unused is item {first}")]
    UnusedItems { first: usize, modality: Modality, count: usize },
    /// A video with interleaved audio that does not follow the Qwen3-Omni layout.
    #[error("audio-in-video of item {item} at position {position}: expected {expected}, found {found}")]
    MalformedAudioInVideo { item: usize, position: usize, expected: String, found: String },
    /// Atoms that do not describe whole items in row order.
    #[error("atom {atom}: {problem}")]
    MalformedAtoms { atom: usize, problem: &'static str },
    /// A prompt whose atoms cover a different number of tokens than its token ids.
    #[error("prompt atoms cover {atoms} tokens but token_ids has {tokens}")]
    AtomsLengthMismatch { atoms: usize, tokens: usize },
    /// A position range that does not lie inside the prompt.
    #[error("position range {start}..{end} is outside a prompt of {len} positions")]
    PositionRangeOutOfBounds { start: usize, end: usize, len: usize },
    /// A prompt whose parts disagree in length or point outside it.
    #[error("{}{what} is {found}, expected {expected}", Named(*.id))]
    PromptMismatch { id: Option<u64>, what: &'static str, expected: usize, found: usize },

    // ---- embeddings ----
    /// An item that brought no embeddings, missed the encoder cache and had no encoder to run.
    #[error(
        "item {item}: no embeddings given, none cached for its fingerprint and no encoder to compute them"
    )]
    MissingEmbeddings { item: usize },
    /// A request's embeddings disagree with its prompt's items or index map.
    #[error("{}item {item}: {what} is {found}, expected {expected}", Named(*.id))]
    EmbeddingMismatch { id: Option<u64>, item: usize, what: &'static str, expected: usize, found: usize },
    /// An item's DeepStack rows disagree with its embeddings, the other items or the model.
    #[error("{}item {item}, DeepStack level {level}: {what} is {found}, expected {expected}", Named(*.id))]
    DeepStackMismatch {
        id: Option<u64>,
        item: usize,
        level: usize,
        what: &'static str,
        expected: usize,
        found: usize,
    },

    // ---- admission ----
    /// A sequence longer than the model's context: the prompt plus the
    /// positions its generated tokens may take (every sampled token but the
    /// last runs, unless `run_last_token`).
    #[error(
        "{}a prompt of {prompt_len} positions + {max_new_tokens} generated positions = {len}, \
         over the model context of {max}", Named(*.id)
    )]
    ContextTooLong { id: Option<u64>, prompt_len: usize, max_new_tokens: usize, len: usize, max: usize },
    /// A token appended past the request's `max_new_tokens`.
    #[error("request {id}: cannot grow past its {max_new_tokens} new tokens")]
    GenerationLimit { id: u64, max_new_tokens: usize },
    /// A request that needs more blocks than the whole pool holds.
    #[error("{}the sequence needs {needed} blocks but the pool holds {num_blocks}", Named(*.id))]
    RequestTooLarge { id: Option<u64>, needed: usize, num_blocks: usize },
    /// A tenant salt outside the configured set, when salts are required.
    #[error("{}tenant {tenant} is not one of the known tenants", Named(*.id))]
    UnknownTenant { id: Option<u64>, tenant: u64 },

    // ---- generation ----
    /// A sampling parameter outside its domain (`max_tokens` of 0, a negative or
    /// non-finite temperature, `top_p` outside (0, 1], `top_k` of 0).
    #[error("sampling parameter {param} = {found}: expected {expected}")]
    InvalidSampling { param: &'static str, expected: &'static str, found: String },
    /// A stop token id at or past the vocabulary size.
    #[error("stop token id {id} is not below the vocab size {vocab_size}")]
    StopIdOutOfVocab { id: u32, vocab_size: usize },

    // ---- speech ----
    /// Audio asked of a prompt that opens no assistant turn
    /// (`<|im_start|>assistant` and a newline): the talker has no reply to speak.
    #[error("audio output needs a prompt ending in an assistant turn opening; none in {prompt_len} tokens")]
    NoAssistantTurn { prompt_len: usize },
    /// Audio asked of a reply too short to speak: the talker's prompt needs the
    /// assistant opening and a first reply token that ran (4 rows).
    #[error("audio output needs a reply of at least 2 tokens; the assistant turn has {rows} rows that ran")]
    ReplyTooShort { rows: usize },
    /// Audio asked of a request that generates nothing (a prefill).
    #[error("audio output needs a generation: a prefill has no reply to speak")]
    AudioNeedsGeneration,
    /// Audio asked of a checkpoint without a talker and code2wav.
    #[error("audio output needs a checkpoint with a talker; {model} has none")]
    NoTalker { model: String },
    /// A speaker the checkpoint does not name.
    #[error("unknown speaker {speaker:?}; the checkpoint names {known:?}")]
    UnknownSpeaker { speaker: String, known: Vec<String> },
    /// A codec code given to code2wav outside its codebook (`0..codebook_size`): a
    /// talker or a corrupt checkpoint produced a code the vocoder has no embedding for.
    #[error(
        "codec code {code} of quantizer {quantizer}, frame {frame} is outside the codebook 0..{codebook_size}"
    )]
    CodecCodeOutOfRange { quantizer: usize, frame: usize, code: i64, codebook_size: usize },
}

impl RequestError {
    /// This error without the request id it names: for a caller that never
    /// saw the id (an engine numbers requests itself and returns the number
    /// only once it accepts one).
    pub(crate) fn unnamed(mut self) -> Self {
        use RequestError::*;
        match &mut self {
            PromptMismatch { id, .. }
            | EmbeddingMismatch { id, .. }
            | DeepStackMismatch { id, .. }
            | ContextTooLong { id, .. }
            | RequestTooLarge { id, .. }
            | UnknownTenant { id, .. } => *id = None,
            _ => {}
        }
        self
    }
}

/// The prefix of a message about one request: `request 7: ` for the id its
/// caller chose, nothing where the caller has no id for it (a request an
/// engine refused before numbering it).
struct Named(Option<u64>);

impl fmt::Display for Named {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(id) => write!(f, "request {id}: "),
            None => Ok(()),
        }
    }
}

/// Which of an item's encoder outputs a [`RequestError::NonFiniteEmbeddings`] is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmbeddingPart {
    Embeddings,
    DeepStack { level: usize },
}

impl fmt::Display for EmbeddingPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EmbeddingPart::Embeddings => f.write_str("embedding"),
            EmbeddingPart::DeepStack { level } => write!(f, "DeepStack level {level}"),
        }
    }
}

/// A request file (JSON) or a tensor file it names.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RequestFileError {
    /// A request file that is not valid JSON or does not follow the request format.
    #[error("request file {path}: {message}")]
    Format { path: String, message: String },
    /// A tensor file a request file names that is not valid safetensors.
    #[error("request tensors {path}: {message}")]
    Safetensors { path: String, message: String },
    /// A tensor a request file names is not in the safetensors file it names.
    #[error("{path}: no tensor `{tensor}`")]
    TensorNotInFile { path: String, tensor: String },
    /// A tensor a request file names has the wrong dtype or shape for its role.
    #[error("{path}, tensor `{tensor}`: {found} where {expected} was expected")]
    Tensor { path: String, tensor: String, expected: String, found: String },
}

/// A model checkpoint: `config.json`, the safetensors files, the weights in them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A model `config.json` that is not valid JSON or lacks a required field.
    #[error("model config: {0}")]
    ConfigParse(String),
    /// A model config field whose value this crate does not implement.
    #[error("model config field `{field}` = {value}: {reason}")]
    UnsupportedConfig { field: &'static str, value: String, reason: &'static str },
    /// A safetensors file (or its index) that cannot be parsed.
    #[error("safetensors {path}: {message}")]
    Safetensors { path: String, message: String },
    /// A weight the model needs is absent from the checkpoint.
    #[error("weight `{name}` is missing from the checkpoint")]
    MissingTensor { name: String },
    /// A weight whose shape differs from what the config implies.
    #[error("weight `{name}`: shape {found:?} where {expected:?} was expected")]
    TensorShape { name: String, expected: Vec<usize>, found: Vec<usize> },
    /// A weight stored in a dtype the loader does not convert.
    #[error("weight `{name}`: dtype {found} (only f32, f16 and bf16 are accepted)")]
    TensorDtype { name: String, found: String },
    /// Weights that cannot be reshaped or fused into the layout the model runs
    /// (gate/up stacking, fused experts).
    #[error("weight `{name}`: {problem}")]
    WeightLayout { name: String, problem: String },
}

/// A setting of the engine, scheduler, block pool or backend choice, or a capture point.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A setting of `component` that cannot work.
    #[error("{component} config: {field} must be {expected}, found {found}")]
    Invalid { component: &'static str, field: &'static str, expected: String, found: String },
    /// A capture point that is neither `hidden.<layer>` nor `final`.
    #[error("capture `{spec}`: expected `hidden.<layer>` or `final`")]
    CaptureSyntax { spec: String },
    /// A capture point that names no layer of the model.
    #[error("capture `hidden.{layer}`: the model has {num_layers} layers (valid 0..={num_layers})")]
    CaptureLayer { layer: usize, num_layers: usize },
}

impl ConfigError {
    /// `Ok` for a positive `value` of `component`'s `field` (a block size, a
    /// per-step limit), else [`ConfigError::Invalid`].
    pub fn require_positive(
        component: &'static str, field: &'static str, value: usize,
    ) -> Result<(), ConfigError> {
        if value == 0 {
            return Err(ConfigError::Invalid {
                component,
                field,
                expected: "positive".into(),
                found: "0".into(),
            });
        }
        Ok(())
    }

    /// `Ok` where a cache's `block_size` is its prefix index's, else
    /// [`ConfigError::Invalid`]: a cache and its index count tokens per block alike.
    pub fn require_index_block_size(
        component: &'static str, block_size: usize, index_block_size: usize,
    ) -> Result<(), ConfigError> {
        if block_size != index_block_size {
            return Err(ConfigError::Invalid {
                component,
                field: "block_size",
                expected: format!("the index's block size {index_block_size}"),
                found: block_size.to_string(),
            });
        }
        Ok(())
    }
}

/// The scheduler's protocol: which requests exist, which batch was handed out,
/// whether anything can run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SchedError {
    /// A request id that is already admitted.
    #[error("request {id} is already admitted")]
    DuplicateRequest { id: u64 },
    /// A request id the scheduler does not know.
    #[error("request {id} is not admitted")]
    UnknownRequest { id: u64 },
    /// `finish` on a request whose prompt has not been fully computed.
    #[error("request {id} is not finished: {computed} of {len} tokens computed")]
    RequestNotFinished { id: u64, computed: usize, len: usize },
    /// A completed batch that is not the one the scheduler handed out.
    #[error("completed batch, request {id}: {what} is {found}, scheduled {expected}")]
    BatchMismatch { id: u64, what: &'static str, expected: usize, found: usize },
    /// The cache cannot be reset while requests hold parts of it.
    #[error("cannot reset the cache: {requests} request(s) are admitted")]
    CacheInUse { requests: usize },
    /// `Engine::run` on an engine with other requests pending (their events would be lost).
    #[error("the engine has {pending} other request(s) pending: step it instead of running one request")]
    Busy { pending: usize },
    /// A served engine's loop is gone (the engine was dropped, or it panicked).
    #[error("the served engine has stopped: {reason}")]
    Stopped { reason: String },
    /// A step failed and dropped this request with the others of its batch.
    #[error("request {id} was dropped by a failed step: {reason}")]
    StepFailed { id: u64, reason: String },
    /// A served engine whose step panicked: its state can no longer be
    /// trusted, so every pending and later call fails with this (vLLM's
    /// `EngineDeadError`). A server should withdraw and restart the engine.
    #[error("the engine is dead: {reason}")]
    EngineDead { reason: String },
    /// A talker slot its [`TalkerCache`](crate::sched::TalkerCache) did not
    /// hand out, or one it already released.
    #[error("talker slot {slot} is not live in this talker cache")]
    UnknownTalkerSlot { slot: u64 },
    /// A talker prompt that does not hold its key's user rows and at least one more row.
    #[error("a talker prompt of {total_rows} rows cannot hold {user_rows} user rows and the rows after them")]
    TalkerRows { user_rows: usize, total_rows: usize },
}

/// A batch handed to [`crate::runner::ModelRunner::execute`] (or cut by
/// [`crate::runner::PromptInputs::step`]) that does not fit itself, the model or
/// the pages; a scheduler's batches fit by construction. The sequence is named
/// by the request id its builder gave it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunnerError {
    /// A sequence whose fields disagree with each other, the model or the pages.
    #[error("batch sequence of request {request}: {what}")]
    InvalidBatch { request: u64, what: String },
}

/// The prefix index or the KV block pool used against its contract. An index
/// that breaks its own contract is a bug: an [`InvariantViolation`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError {
    /// More blocks handed to `insert` than the prompt has full blocks.
    #[error("{blocks} blocks given for a prompt with {full_blocks} full blocks")]
    BlocksExceedPrompt { blocks: usize, full_blocks: usize },
    /// `insert_partial` of more positions than the prompt has.
    #[error("{tokens} tokens to cache from a prompt of {prompt_len} positions")]
    TokensExceedPrompt { tokens: usize, prompt_len: usize },
    /// `insert_partial` given other than `ceil(tokens / block_size)` blocks.
    #[error("{blocks} blocks given for {tokens} tokens at block size {block_size}")]
    PartialBlockCount { blocks: usize, tokens: usize, block_size: usize },
    /// An insert that would extend a cached partly filled block while a lock
    /// pins it (the scheduler drops copy-on-write pins before inserting).
    #[error("insert would extend partial block {block} (cached up to position {end}) while it is locked")]
    LockedPartialBlock { block: u32, end: usize },
    /// A block id the index already owns (under other content), or repeated in one insert.
    #[error("block {block} is already cached under other content or repeated")]
    BlockAlreadyCached { block: u32 },
    /// One multimodal hash per prompt item was expected.
    #[error("{found} multimodal hashes for a prompt with {expected} items")]
    MmHashCount { expected: usize, found: usize },
    /// An index-map span names an item the prompt does not have.
    #[error("index map span {span} names item {item}, prompt has {items} items")]
    SpanItemOutOfRange { span: usize, item: u32, items: usize },
    /// A block id outside the pool.
    #[error("block {block} is outside the pool of {num_blocks} blocks")]
    BlockOutOfRange { block: u32, num_blocks: usize },
    /// A pool operation on a block in the wrong state (e.g. releasing a free block).
    #[error("block pool: cannot {op} block {block} while it is {state}")]
    BlockStateMisuse { op: &'static str, block: u32, state: String },
}

/// The component whose invariants a `validate()` checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Component {
    /// [`crate::kv::BlockPool`].
    BlockPool,
    /// [`crate::index::radix::RadixIndex`].
    RadixIndex,
    /// [`crate::index::hashchain::HashChainIndex`].
    HashChainIndex,
    /// Another [`crate::index::PrefixIndex`] implementation, by name.
    OtherIndex(&'static str),
    /// [`crate::sched::Scheduler`]: its pool, index and request bookkeeping
    /// against each other, the answers of its prefix index, its progress.
    Scheduler,
    /// [`crate::runner::ModelRunner`]: a batch the scheduler built, which fits by construction.
    Runner,
    /// [`crate::engine::Engine`]: the outputs it assembles from the runner's.
    Engine,
    /// Stored weights and K/V pages, whose [`crate::Dtype`] was checked to be a
    /// float type where it was given.
    Storage,
    /// [`crate::tier::TierStore`]: a block handed to it has its layout's size.
    Tier,
}

impl Component {
    /// A broken invariant of this component, described by `what`.
    pub fn violation(self, what: impl Into<String>) -> InvariantViolation {
        InvariantViolation { component: self, what: what.into() }
    }
}

impl fmt::Display for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Component::BlockPool => f.write_str("block pool"),
            Component::RadixIndex => f.write_str("radix index"),
            Component::HashChainIndex => f.write_str("hash-chain index"),
            Component::OtherIndex(name) => write!(f, "prefix index {name}"),
            Component::Scheduler => f.write_str("scheduler"),
            Component::Runner => f.write_str("model runner"),
            Component::Engine => f.write_str("engine"),
            Component::Storage => f.write_str("weight and page storage"),
            Component::Tier => f.write_str("disk tier"),
        }
    }
}

/// The first broken invariant a `validate()` found, or a contract a component
/// broke at run time, and in which component: a bug, never bad input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{component} invariant broken: {what}")]
pub struct InvariantViolation {
    /// Where the invariant lives.
    pub component: Component,
    /// Which invariant broke, with the ids and counts involved.
    pub what: String,
}

/// A backend op (CPU or GPU) refusing its operands; the op leaves them unchanged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// A backend op called with operands of incompatible shapes.
    #[error("backend op {op}: {what} has shape {found:?} where {expected} was expected")]
    OpShape { op: &'static str, what: &'static str, expected: String, found: Vec<usize> },
    /// A backend op given an index outside its operand (row, slot, block, layer).
    #[error("backend op {op}: {what} {index} out of range 0..{bound}")]
    OpIndex { op: &'static str, what: &'static str, index: i64, bound: usize },
    /// A backend op that returned fewer results than it was asked for.
    #[error("backend op {op}: returned {found} {what} where {expected} were asked for")]
    OpCount { op: &'static str, what: &'static str, expected: usize, found: usize },
}

/// The wgpu device: adapter, limits, shaders and device-side failures.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// No GPU adapter could be obtained (no driver, or none of the requested backends).
    #[error("no GPU adapter for backends {backends}: {reason}")]
    Unavailable { backends: String, reason: String },
    /// The adapter offers less of a limit than the kernels need.
    #[error("GPU adapter `{adapter}`: limit {limit} is {available}, the kernels need {required}")]
    Limit { adapter: String, limit: &'static str, required: u64, available: u64 },
    /// A buffer or paged pool larger than the device can allocate or bind.
    #[error("GPU adapter `{adapter}`: {what} needs {requested} bytes, over {limit} = {max} bytes")]
    TooLarge { adapter: String, what: String, requested: u64, limit: &'static str, max: u64 },
    /// A shader module or pipeline the device rejected.
    #[error("GPU adapter `{adapter}`: shader {shader}, entry point {entry}: {message}")]
    ShaderCompile { adapter: String, shader: String, entry: String, message: String },
    /// A device-side failure while running an op (validation, out of memory, mapping, lost device).
    #[error("GPU adapter `{adapter}`: {op}: {message}")]
    Op { adapter: String, op: &'static str, message: String },
    /// A model shape outside what the GPU kernels implement.
    #[error("GPU kernels: {what} = {value} is unsupported (supported: {supported})")]
    Unsupported { what: &'static str, value: usize, supported: &'static str },
}

/// Whether an io failure happened reading or writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Opening, mapping, listing or reading.
    Read,
    /// Creating, writing or flushing.
    Write,
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Access::Read => "read",
            Access::Write => "write",
        })
    }
}

/// A file or stream that could not be read or written: which, and how.
#[derive(Debug, thiserror::Error)]
#[error("cannot {access} {path}: {source}")]
pub struct IoError {
    /// The file's path as given, or the stream's name (`stdout`).
    pub path: String,
    /// Whether the failure was a read or a write.
    pub access: Access,
    /// What the operating system said.
    #[source]
    pub source: std::io::Error,
}

impl IoError {
    /// Reading `path` (or opening, mapping or listing it) failed.
    pub fn read(path: impl AsRef<Path>, source: std::io::Error) -> Self {
        IoError { path: path.as_ref().display().to_string(), access: Access::Read, source }
    }

    /// Writing `path` (or creating it) failed.
    pub fn write(path: impl AsRef<Path>, source: std::io::Error) -> Self {
        IoError { path: path.as_ref().display().to_string(), access: Access::Write, source }
    }
}
