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
    /// Anything else about a request that cannot be canonicalised.
    #[error("invalid request: {0}")]
    InvalidRequest(String),

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
    /// A request that needs more blocks than the whole pool holds.
    #[error("request {id} needs {needed} blocks but the pool holds {num_blocks}")]
    RequestTooLarge { id: u64, needed: usize, num_blocks: usize },
    /// A request's embeddings disagree with its prompt's items or index map.
    #[error("request {id}, item {item}: {what} is {found}, expected {expected}")]
    EmbeddingMismatch { id: u64, item: usize, what: &'static str, expected: usize, found: usize },
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
}

/// Crate-wide result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
