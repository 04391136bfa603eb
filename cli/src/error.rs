//! The harness's errors. For now the engine's error type; harness-only
//! failures get their own variants here once the engine sheds them.

pub use omniprefix::{Error, Result};
