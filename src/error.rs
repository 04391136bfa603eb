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
}

/// Crate-wide result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
