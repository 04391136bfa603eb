//! What a loaded model is, as a digest: the disk tier's files carry it, so a
//! block computed by one model is never served to another.

use std::cell::RefCell;

use crate::Dtype;
use crate::Result;
use crate::model::weights::{StoredTensor, WeightSource};
use crate::tier::ModelId;

/// Bytes of each tensor's data folded into the identity: names, shapes and
/// dtypes alone would not tell two fine-tunes (or two random seeds) of one
/// architecture apart, and the head of every tensor does at no extra read.
const SAMPLE_BYTES: usize = 4096;

/// A [`WeightSource`] that records each tensor a loader reads, then digests them.
pub(crate) struct Recording<'a> {
    inner: &'a dyn WeightSource,
    seen: RefCell<Vec<Vec<u8>>>,
}

impl<'a> Recording<'a> {
    pub(crate) fn new(inner: &'a dyn WeightSource) -> Self {
        Recording { inner, seen: RefCell::default() }
    }

    /// The identity of the tensors read, whatever the order they were read in.
    pub(crate) fn identity(&self, extra: &[&[u8]]) -> ModelId {
        let mut parts = self.seen.borrow().clone();
        parts.sort_unstable();
        parts.extend(extra.iter().map(|e| e.to_vec()));
        ModelId::of(parts)
    }
}

impl WeightSource for Recording<'_> {
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn load_stored(&self, name: &str) -> Result<StoredTensor> {
        let t = self.inner.load_stored(name)?;
        let view = t.data.view();
        let bytes = view.as_bytes();
        let sample = &bytes[..bytes.len().min(SAMPLE_BYTES)];
        let part = format!("{name} {:?} {}", t.shape, view.dtype()).into_bytes();
        self.seen.borrow_mut().push([&part[..], sample].concat());
        Ok(t)
    }

    fn stored_dtype(&self, name: &str) -> Option<Dtype> {
        self.inner.stored_dtype(name)
    }
}
