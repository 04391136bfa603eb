//! Private temp directories for the benchmarks' disk tiers (`tempfile`): 0700,
//! removed with everything in them when dropped, so a run that fails midway
//! leaves nothing behind.

use crate::error::{HarnessError, Result};

/// A fresh directory under the system temp dir whose name starts with `prefix`.
pub fn private_temp_dir(prefix: &str) -> Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .map_err(|e| HarnessError::Engine(omniprefix::error::IoError::write(std::env::temp_dir(), e).into()))
}
