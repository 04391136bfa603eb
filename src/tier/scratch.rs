//! A fresh directory per test under the system temp dir, removed on drop: the
//! tier's tests and the engine's tier tests share it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

static NEXT: AtomicU64 = AtomicU64::new(0);

/// A directory path that does not exist yet (the code under test creates it).
pub(crate) struct Scratch(pub(crate) PathBuf);

impl Scratch {
    pub(crate) fn new(name: &str) -> Self {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("omniprefix-tier-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        Scratch(path)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A writer over a fresh store in `dir` (room for 64 blocks of the tests'
/// [`identity(1, 2)`](super::file::tests::identity)), holding `hashes`, each
/// block's payload [`payload_of`](super::store::tests::payload_of) its hash.
pub(crate) fn writer_holding(dir: &Scratch, hashes: &[u64]) -> std::sync::Arc<super::TierWriter> {
    let id = super::file::tests::identity(1, 2);
    let store = super::TierStore::open(&dir.0, 64 * id.layout.file_bytes(), id).expect("a tier store");
    let writer = super::TierWriter::start(store, 8).expect("a tier writer");
    for &hash in hashes {
        assert!(writer.submit(hash, super::store::tests::payload_of(&id, hash).into()));
    }
    writer.flush();
    std::sync::Arc::new(writer)
}

/// The payload [`writer_holding`] gives block `hash`.
pub(crate) fn payload_held(hash: u64) -> Vec<u8> {
    super::store::tests::payload_of(&super::file::tests::identity(1, 2), hash)
}
