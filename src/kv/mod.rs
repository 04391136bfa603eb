//! KV cache bookkeeping: block ids, the block tables that map a sequence's
//! positions to pool slots, and the block pool that hands out the ids.
//!
//! Page storage (per-layer K/V and hidden pages indexed by these ids) lives in
//! the backend, except a capture kept only at item positions ([`ItemCapture`]);
//! only the scheduler mutates the pool.

mod block_table;
mod item_capture;
mod pool;

pub use block_table::{BlockId, BlockTable};
pub use item_capture::ItemCapture;

/// Tokens per KV block unless a caller says otherwise: vLLM's default, and the
/// default of every config and command that takes a block size.
pub const DEFAULT_BLOCK_SIZE: usize = 16;
pub use pool::{BlockPool, BlockState};
