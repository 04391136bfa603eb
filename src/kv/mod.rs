//! KV cache bookkeeping: the block pool that hands out block ids.
//!
//! Page storage (per-layer K/V and hidden pages indexed by these ids) lives in
//! the backend; only the scheduler mutates the pool.

mod pool;

pub use pool::{BlockPool, BlockState};
