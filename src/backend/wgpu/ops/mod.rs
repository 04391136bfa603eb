//! The kernels, one file per concern; each is a set of methods on
//! [`GpuContext`](super::GpuContext).

/// Paged attention: prefill and split-KV decode.
pub mod attention;
/// Matmul, bias and residual adds, RMSNorm, SwiGLU.
pub mod dense;
/// Router top-k, expert combine and the MoE block.
pub mod moe;
/// Rows in and out of paged pools; block copy-on-write.
pub mod paging;
/// Rotary embeddings.
pub mod rope;
/// Embedding lookup, row gather and scatter.
pub mod rows;
