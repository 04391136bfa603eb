//! Encoder outputs keyed by item fingerprint, so an item seen before skips its
//! (vision / audio) encoder. Bounded by bytes, least-recently-used out first.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use ndarray::Array2;

use crate::batch::DeepStack;
use crate::canon::Fingerprint;

struct Entry {
    value: Arc<Array2<f32>>,
    /// The item's DeepStack levels, kept with its embeddings.
    deepstack: Option<DeepStack>,
    /// Logical clock of the last use (key into `by_use`).
    last_use: u64,
    bytes: usize,
}

/// Fingerprint → encoder output `[rows, hidden]` (with the item's DeepStack levels,
/// if any), at most `capacity_bytes` of f32 data.
///
/// ```
/// use std::sync::Arc;
/// use omniprefix::canon::Fingerprint;
/// use omniprefix::model::EncoderCache;
/// let mut cache = EncoderCache::new(1 << 20);
/// cache.insert(Fingerprint(1), Arc::new(ndarray::Array2::zeros((4, 8))));
/// assert!(cache.get(Fingerprint(1)).is_some());
/// ```
pub struct EncoderCache {
    capacity_bytes: usize,
    used_bytes: usize,
    clock: u64,
    entries: HashMap<Fingerprint, Entry>,
    /// Last-use tick → fingerprint, oldest first.
    by_use: BTreeMap<u64, Fingerprint>,
    /// Items of admitted requests whose rows came from here.
    hits: u64,
}

impl EncoderCache {
    /// An empty cache holding at most `capacity_bytes` of embeddings.
    pub fn new(capacity_bytes: usize) -> Self {
        Self {
            capacity_bytes,
            used_bytes: 0,
            clock: 0,
            entries: HashMap::new(),
            by_use: BTreeMap::new(),
            hits: 0,
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The cached output for `fp`, marking it most recently used.
    pub fn get(&mut self, fp: Fingerprint) -> Option<Arc<Array2<f32>>> {
        self.get_with_deepstack(fp).map(|(value, _)| value)
    }

    /// The cached output for `fp` and its DeepStack levels, marking it most recently used.
    pub fn get_with_deepstack(&mut self, fp: Fingerprint) -> Option<(Arc<Array2<f32>>, Option<DeepStack>)> {
        let now = self.tick();
        let entry = self.entries.get_mut(&fp)?;
        self.by_use.remove(&entry.last_use);
        entry.last_use = now;
        self.by_use.insert(now, fp);
        Some((Arc::clone(&entry.value), entry.deepstack.clone()))
    }

    /// Caches `value` for `fp`, evicting least-recently-used entries to fit.
    /// Returns false (and caches nothing) when `value` alone exceeds the capacity.
    pub fn insert(&mut self, fp: Fingerprint, value: Arc<Array2<f32>>) -> bool {
        self.insert_with_deepstack(fp, value, None)
    }

    /// [`EncoderCache::insert`] with the item's DeepStack levels (counted in the bytes).
    pub fn insert_with_deepstack(
        &mut self, fp: Fingerprint, value: Arc<Array2<f32>>, deepstack: Option<DeepStack>,
    ) -> bool {
        let levels: usize = deepstack.iter().flat_map(|d| d.iter()).map(Array2::len).sum();
        let bytes = (value.len() + levels) * std::mem::size_of::<f32>();
        if bytes > self.capacity_bytes {
            return false;
        }
        self.remove(fp);
        while self.used_bytes + bytes > self.capacity_bytes {
            let Some((_, oldest)) = self.by_use.pop_first() else { break };
            if let Some(e) = self.entries.remove(&oldest) {
                self.used_bytes -= e.bytes;
            }
        }
        let now = self.tick();
        self.by_use.insert(now, fp);
        self.entries.insert(fp, Entry { value, deepstack, last_use: now, bytes });
        self.used_bytes += bytes;
        true
    }

    /// Drops `fp`'s entry if present.
    pub fn remove(&mut self, fp: Fingerprint) -> Option<Arc<Array2<f32>>> {
        let e = self.entries.remove(&fp)?;
        self.by_use.remove(&e.last_use);
        self.used_bytes -= e.bytes;
        Some(e.value)
    }

    /// Counts `n` items of an admitted request served from here (a lookup
    /// alone does not count: the request may still be rejected).
    pub fn record_hits(&mut self, n: u64) {
        self.hits += n;
    }

    /// Items of admitted requests whose rows came from here.
    pub fn hits(&self) -> u64 {
        self.hits
    }

    /// Bytes of embeddings held.
    pub fn used_bytes(&self) -> usize {
        self.used_bytes
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize) -> Arc<Array2<f32>> {
        Arc::new(Array2::from_elem((n, 4), n as f32))
    }

    #[test]
    fn evicts_least_recently_used_within_byte_bound() {
        // Each row is 16 bytes; capacity fits 6 rows.
        let mut c = EncoderCache::new(96);
        assert!(c.insert(Fingerprint(1), rows(2)));
        assert!(c.insert(Fingerprint(2), rows(2)));
        assert!(c.get(Fingerprint(1)).is_some()); // 2 is now the oldest
        assert!(c.insert(Fingerprint(3), rows(3)));
        assert!(c.get(Fingerprint(2)).is_none());
        assert_eq!(c.get(Fingerprint(1)).unwrap()[[0, 0]], 2.0);
        assert_eq!(c.used_bytes(), 80);
        assert!(!c.insert(Fingerprint(4), rows(7)), "larger than the whole cache");
        assert_eq!(c.len(), 2);
        assert!(c.insert(Fingerprint(1), rows(1)), "replace shrinks");
        assert_eq!(c.used_bytes(), 64);
    }

    #[test]
    fn deepstack_levels_stay_with_their_embeddings_and_count_in_bytes() {
        let mut c = EncoderCache::new(96);
        let levels: DeepStack =
            Arc::new(vec![Array2::from_elem((2, 4), 7.0), Array2::from_elem((2, 4), 8.0)]);
        assert!(c.insert_with_deepstack(Fingerprint(1), rows(2), Some(Arc::clone(&levels))));
        assert_eq!(c.used_bytes(), 96, "embeddings and both levels");
        let (value, got) = c.get_with_deepstack(Fingerprint(1)).unwrap();
        assert_eq!(value[[0, 0]], 2.0);
        assert!(got.is_some_and(|g| Arc::ptr_eq(&g, &levels)));
        assert!(c.insert(Fingerprint(2), rows(1)), "evicts the DeepStack entry to fit");
        assert!(c.get(Fingerprint(1)).is_none());
        assert!(matches!(c.get_with_deepstack(Fingerprint(2)), Some((_, None))));
        assert!(!c.insert_with_deepstack(
            Fingerprint(3),
            rows(2),
            Some(Arc::new(vec![Array2::zeros((5, 4))]))
        ));
    }
}
