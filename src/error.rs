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
    /// Anything else about a request that cannot be canonicalised.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
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
}

/// Crate-wide result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
