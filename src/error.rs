//! The crate's one error type. Variants name what was wrong and where.

use crate::canon::{Dtype, Modality};

/// Everything that can go wrong in omniprefix, with the facts needed to fix it.
///
/// Helpers add variants here as their modules need them; keep them structured
/// (expected vs found, which item / tensor / field).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor's dtype is not the one the caller promised or the op supports.
    #[error("item {item}: dtype {found:?} where {expected} was expected")]
    DtypeMismatch { item: usize, expected: String, found: Dtype },
    /// A tensor's shape does not fit what its layout says.
    #[error("item {item} ({modality:?}): shape {found:?} does not fit {expected}")]
    ShapeMismatch { item: usize, modality: Modality, expected: String, found: Vec<usize> },
    /// NaN or ±Inf inside an item's content.
    #[error("item {item}: non-finite value at flat index {index}")]
    NonFinite { item: usize, index: usize },
    /// An item with no bytes or no rows.
    #[error("item {item}: empty ({what})")]
    EmptyItem { item: usize, what: &'static str },
    /// A block size of zero tokens.
    #[error("block size must be positive, found {found}")]
    InvalidBlockSize { found: usize },
    /// More blocks handed to `insert` than the prompt has full blocks.
    #[error("{blocks} blocks given for a prompt with {full_blocks} full blocks")]
    BlocksExceedPrompt { blocks: usize, full_blocks: usize },
    /// A block id the index already owns (under other content), or repeated in one insert.
    #[error("block {block} is already cached under other content or repeated")]
    BlockAlreadyCached { block: u32 },
    /// One multimodal hash per prompt item was expected.
    #[error("{found} multimodal hashes for a prompt with {expected} items")]
    MmHashCount { expected: usize, found: usize },
    /// An index-map span names an item the prompt does not have.
    #[error("index map span {span} names item {item}, prompt has {items} items")]
    SpanItemOutOfRange { span: usize, item: u32, items: usize },
    /// Raw media whose shape does not fit what it claims to be.
    #[error("{what}: shape {found:?} where {expected} was expected")]
    MediaShape { what: &'static str, expected: String, found: Vec<usize> },
    /// A prompt whose atoms cover a different number of tokens than its token ids.
    #[error("prompt atoms cover {atoms} tokens but token_ids has {tokens}")]
    AtomsLengthMismatch { atoms: usize, tokens: usize },
    /// An image/video grid whose t·h·w patches do not merge into whole tokens.
    #[error("item {item}: grid t·h·w {grid_thw:?} is not divisible by merge {merge}x{merge}")]
    GridNotMergeable { item: usize, grid_thw: [u32; 3], merge: u32 },
    /// A layout field that cannot describe any item (wrong kind for the modality, non-finite time step).
    #[error("item {item}: layout field {field} is invalid: expected {expected}, found {found}")]
    InvalidLayout { item: usize, field: &'static str, expected: &'static str, found: String },
    /// Anything else about a request that cannot be canonicalised.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A prompt with no tokens at all.
    #[error("empty prompt: no tokens")]
    EmptyPrompt,
    /// A placeholder id used as plain text, outside any item span.
    #[error("position {position}: placeholder id {token} in text, outside any item span")]
    StrayPlaceholder { position: usize, token: u32 },
    /// A token id at or past the vocabulary size.
    #[error("position {position}: token id {token} is not below the vocab size {vocab_size}")]
    TokenOutOfVocab { position: usize, token: u32, vocab_size: u32 },
    /// A run of expanded placeholders whose length disagrees with its item's layout.
    #[error("item {item} at position {position}: {found} placeholder tokens where its layout needs {expected}")]
    PlaceholderCountMismatch { item: usize, position: usize, expected: usize, found: usize },
    /// A placeholder with no item of its modality left to fill it.
    #[error("position {position}: {modality:?} placeholder but all {available} {modality:?} item(s) are used")]
    MissingItem { position: usize, modality: Modality, available: usize },
    /// Items that no placeholder asked for.
    #[error("{count} {modality:?} item(s) have no placeholder; first unused is item {first}")]
    UnusedItems { first: usize, modality: Modality, count: usize },
    /// An item of one modality where another was required.
    #[error("item {item}: modality {found:?} where {expected:?} was required")]
    ItemModalityMismatch { item: usize, expected: Modality, found: Modality },
    /// An item whose layout cannot be placed (grid not divisible by the merge size,
    /// token count disagreeing with the layout, non-finite seconds per grid...).
    #[error("item {item}: invalid layout: expected {expected}, found {found}")]
    LayoutMismatch { item: usize, expected: String, found: String },
    /// A video with interleaved audio that does not follow the Qwen3-Omni layout.
    #[error("audio-in-video of item {item} at position {position}: expected {expected}, found {found}")]
    MalformedAudioInVideo { item: usize, position: usize, expected: String, found: String },
    /// Atoms that do not describe whole items in row order.
    #[error("atom {atom}: {problem}")]
    MalformedAtoms { atom: usize, problem: &'static str },
    /// A position range that does not lie inside the prompt.
    #[error("position range {start}..{end} is outside a prompt of {len} positions")]
    PositionRangeOutOfBounds { start: usize, end: usize, len: usize },

    // ---- kv block pool and scheduler ----
    /// A block id outside the pool.
    #[error("block {block} is outside the pool of {num_blocks} blocks")]
    BlockOutOfRange { block: u32, num_blocks: usize },
    /// A pool operation on a block in the wrong state (e.g. releasing a free block).
    #[error("block pool: cannot {op} block {block} while it is {state}")]
    BlockStateMisuse { op: &'static str, block: u32, state: String },
    /// A scheduler or pool setting that cannot work.
    #[error("scheduler config: {field} must be {expected}, found {found}")]
    InvalidConfig { field: &'static str, expected: String, found: String },
    /// A request id that is already admitted.
    #[error("request {id} is already admitted")]
    DuplicateRequest { id: u64 },
    /// A request id the scheduler does not know.
    #[error("request {id} is not admitted")]
    UnknownRequest { id: u64 },
    /// A prompt longer than the model's context.
    #[error("request {id}: prompt of {len} tokens exceeds the model context of {max}")]
    ContextTooLong { id: u64, len: usize, max: usize },
    /// A tenant salt outside the configured set, when salts are required.
    #[error("request {id}: tenant {tenant} is not one of the known tenants")]
    UnknownTenant { id: u64, tenant: u64 },
    /// Blocks still held by no request and not by the index after every request finished.
    #[error("{leaked} of {num_blocks} blocks leaked (neither free nor owned by the index)")]
    BlocksLeaked { leaked: usize, num_blocks: usize },
    /// A request that needs more blocks than the whole pool holds.
    #[error("request {id} needs {needed} blocks but the pool holds {num_blocks}")]
    RequestTooLarge { id: u64, needed: usize, num_blocks: usize },
    /// A request's embeddings disagree with its prompt's items or index map.
    #[error("request {id}, item {item}: {what} is {found}, expected {expected}")]
    EmbeddingMismatch { id: u64, item: usize, what: &'static str, expected: usize, found: usize },
    /// An item's DeepStack rows disagree with its embeddings, the other items or the model.
    #[error("request {id}, item {item}, DeepStack level {level}: {what} is {found}, expected {expected}")]
    DeepStackMismatch { id: u64, item: usize, level: usize, what: &'static str, expected: usize, found: usize },
    /// A prompt whose parts disagree in length or point outside it.
    #[error("request {id}: {what} is {found}, expected {expected}")]
    PromptMismatch { id: u64, what: &'static str, expected: usize, found: usize },
    /// `finish` on a request whose prompt has not been fully computed.
    #[error("request {id} is not finished: {computed} of {len} tokens computed")]
    RequestNotFinished { id: u64, computed: usize, len: usize },
    /// A completed batch that is not the one the scheduler handed out.
    #[error("completed batch, request {id}: {what} is {found}, scheduled {expected}")]
    BatchMismatch { id: u64, what: &'static str, expected: usize, found: usize },
    /// The prefix index broke its contract (an internal bug, reported instead of panicking).
    #[error("prefix index broke its contract: {0}")]
    IndexContract(String),
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    /// A model `config.json` that is not valid JSON or lacks a required field.
    #[error("model config: {0}")]
    ConfigParse(String),
    /// A model config field whose value this crate does not implement.
    #[error("model config field `{field}` = {value}: {reason}")]
    UnsupportedConfig { field: &'static str, value: String, reason: &'static str },
    /// A safetensors file that cannot be parsed.
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
    /// A backend op called with operands of incompatible shapes.
    #[error("backend op {op}: {what} has shape {found:?} where {expected} was expected")]
    OpShape { op: &'static str, what: &'static str, expected: String, found: Vec<usize> },
    /// A backend op given an index outside its operand (row, slot, block, layer).
    #[error("backend op {op}: {what} {index} out of range 0..{bound}")]
    OpIndex { op: &'static str, what: &'static str, index: i64, bound: usize },
    /// A capture point that names no layer of the model.
    #[error("capture `hidden.{layer}`: the model has {num_layers} layers (valid 0..={num_layers})")]
    CaptureLayer { layer: usize, num_layers: usize },
    /// A scheduled sequence whose fields disagree with each other or the model.
    #[error("request {request}: {what}")]
    InvalidBatch { request: u64, what: String },
    /// A GPU / device failure (adapter, buffer mapping, shader compilation).
    #[error("device: {0}")]
    Device(String),
    /// No GPU adapter could be obtained (no driver, or none of the requested backends).
    #[error("no GPU adapter for backends {backends}: {reason}")]
    GpuUnavailable { backends: String, reason: String },
    /// The adapter offers less of a limit than the kernels need.
    #[error("GPU adapter `{adapter}`: limit {limit} is {available}, the kernels need {required}")]
    GpuLimit { adapter: String, limit: &'static str, required: u64, available: u64 },
    /// A buffer or paged pool larger than the device can allocate or bind.
    #[error("GPU adapter `{adapter}`: {what} needs {requested} bytes, over {limit} = {max} bytes")]
    GpuTooLarge { adapter: String, what: String, requested: u64, limit: &'static str, max: u64 },
    /// A shader module or pipeline the device rejected.
    #[error("GPU adapter `{adapter}`: shader {shader}, entry point {entry}: {message}")]
    ShaderCompile { adapter: String, shader: String, entry: String, message: String },
    /// A device-side failure while running an op (validation, out of memory, mapping, lost device).
    #[error("GPU adapter `{adapter}`: {op}: {message}")]
    GpuOp { adapter: String, op: &'static str, message: String },
    /// A model shape outside what the GPU kernels implement.
    #[error("GPU kernels: {what} = {value} is unsupported (supported: {supported})")]
    GpuUnsupported { what: &'static str, value: usize, supported: &'static str },
    /// A workload name `bench match` does not know.
    #[error("unknown workload {name:?}; known: {known}")]
    UnknownWorkload { name: String, known: String },
    /// An embedded fixture that does not hold what the code expects.
    #[error("fixture {file}: {problem}")]
    Fixture { file: &'static str, problem: String },
    /// Writing output (a report, a table) failed.
    #[error("cannot write the output: {0}")]
    Write(#[from] std::io::Error),

    // ---- engine and request files ----
    /// An item that brought no embeddings, missed the encoder cache and had no encoder to run.
    #[error("item {item}: no embeddings given, none cached for its fingerprint and no encoder to compute them")]
    MissingEmbeddings { item: usize },
    /// Requests are pending but the scheduler can run none of them (an internal bug).
    #[error("engine stalled: {pending} request(s) pending but the scheduler emitted an empty step")]
    EngineStalled { pending: usize },
    /// A request file that is not valid JSON or does not follow the request format.
    #[error("request file {path}: {message}")]
    RequestFormat { path: String, message: String },
    /// A tensor a request file names is not in the safetensors file it names.
    #[error("{path}: no tensor `{tensor}`")]
    TensorNotInFile { path: String, tensor: String },
    /// A tensor a request file names has the wrong dtype or shape for its role.
    #[error("{path}, tensor `{tensor}`: {found} where {expected} was expected")]
    RequestTensor { path: String, tensor: String, expected: String, found: String },
}

/// Crate-wide result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
