//! A fresh directory per test, removed on drop (`tempfile`): the tier's tests
//! and the engine's tier tests share it.

use std::path::PathBuf;

/// A directory path that does not exist yet (the code under test creates it),
/// inside a private temp directory that goes with the value.
pub(crate) struct Scratch(pub(crate) PathBuf, #[allow(dead_code)] tempfile::TempDir);

impl Scratch {
    pub(crate) fn new(name: &str) -> Self {
        let root = tempfile::Builder::new()
            .prefix(&format!("omniprefix-tier-{name}-"))
            .tempdir()
            .expect("a temp dir for a tier test");
        Scratch(root.path().join("tier"), root)
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
