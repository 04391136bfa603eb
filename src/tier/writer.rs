//! The tier's writer thread: blocks leave the step path at once and reach disk later.
//!
//! [`TierWriter::submit`] never blocks: it puts the block in a bounded queue, or,
//! the queue full, drops it from the tier and counts the drop (the block is
//! then recomputed if asked for again: a cost, never a wrong answer). Until a
//! queued block is on disk, [`TierWriter::get`] serves it from the queue, so a
//! block is readable from the moment the pool lets it go. Dropping the writer
//! (or [`TierWriter::flush`]) writes everything queued before it returns.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::store::{TierBlock, TierStats, TierStore};
use crate::Result;

/// One block waiting for the writer: its hash and payload.
type Pending = Arc<Mutex<HashMap<u64, Arc<[u8]>>>>;

enum Job {
    Write(u64, Arc<[u8]>),
    /// Everything sent before it is written: answer on the channel.
    Flush(SyncSender<()>),
}

/// A block from the tier: read back from a file, or still in the write queue.
#[derive(Debug, Clone)]
pub enum Loaded {
    /// Checked and read from its file.
    File(TierBlock),
    /// Not yet written: the payload as it was submitted.
    Queued(Arc<[u8]>),
}

impl Loaded {
    /// The block's payload.
    pub fn payload(&self) -> &[u8] {
        match self {
            Loaded::File(block) => block.payload(),
            Loaded::Queued(payload) => payload,
        }
    }
}

/// A [`TierStore`] with a writer thread in front of it.
///
/// ```
/// use omniprefix::tier::{BlockLayout, Identity, ModelId, TierStore, TierWriter};
/// use omniprefix::Dtype;
/// let dir = std::env::temp_dir().join(format!("omniprefix-doc-writer-{}", std::process::id()));
/// let layout = BlockLayout { block_size: 4, layers: 1, kv_heads: 1, head_dim: 2, kv_dtype: Dtype::F32, captured: 0, hidden: 0, item_width: 0 };
/// let id = Identity { model: ModelId::of(["tiny"]), key: [7; 16], layout };
/// let writer = TierWriter::start(TierStore::open(&dir, 64 * layout.file_bytes(), id)?, 8)?;
/// assert!(writer.submit(5, vec![3u8; layout.payload_bytes()].into()));
/// assert!(writer.get(5).is_some()); // at once, from the queue or the file
/// writer.flush();
/// assert_eq!(writer.stats().written, 1);
/// # drop(writer); std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Debug)]
pub struct TierWriter {
    store: Arc<TierStore>,
    pending: Pending,
    /// `None` once dropping.
    queue: Option<SyncSender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl TierWriter {
    /// Starts the writer thread over `store`, with room for `capacity` queued blocks (at least 1).
    pub fn start(store: TierStore, capacity: usize) -> Result<Self> {
        let store = Arc::new(store);
        let pending: Pending = Arc::default();
        let (queue, jobs) = sync_channel(capacity.max(1));
        let thread = std::thread::Builder::new()
            .name("omniprefix-tier-writer".into())
            .spawn({
                let (store, pending) = (Arc::clone(&store), Arc::clone(&pending));
                move || write_loop(&store, &pending, jobs)
            })
            .map_err(|e| crate::error::IoError::write(store.dir(), e))?;
        Ok(TierWriter { store, pending, queue: Some(queue), thread: Some(thread) })
    }

    /// The store written to.
    pub fn store(&self) -> &TierStore {
        &self.store
    }

    /// The store's counters, drops included.
    pub fn stats(&self) -> TierStats {
        self.store.stats()
    }

    /// Queues block `hash` for writing; `false` (a counted drop) when the queue is full.
    pub fn submit(&self, hash: u64, payload: Arc<[u8]>) -> bool {
        let sent = self.enqueue(hash, payload, |queue, job| queue.try_send(job).is_ok());
        if !sent {
            self.store.counters.write_drops.fetch_add(1, Ordering::Relaxed);
        }
        sent
    }

    /// Queues block `hash` for writing, waiting for room when the queue is
    /// full: for a spill (a drop, a restart), where nothing else waits and a
    /// dropped block would be a lost hit. `false` only once the writer stops.
    pub fn submit_waiting(&self, hash: u64, payload: Arc<[u8]>) -> bool {
        self.enqueue(hash, payload, |queue, job| queue.send(job).is_ok())
    }

    /// Makes `payload` readable at once, then hands it to the writer with
    /// `send`; whatever `send` does not take is forgotten again.
    fn enqueue(
        &self, hash: u64, payload: Arc<[u8]>, send: impl FnOnce(&SyncSender<Job>, Job) -> bool,
    ) -> bool {
        let Some(queue) = &self.queue else { return false };
        lock(&self.pending).insert(hash, Arc::clone(&payload));
        let sent = send(queue, Job::Write(hash, Arc::clone(&payload)));
        if !sent {
            forget(&self.pending, hash, &payload);
        }
        sent
    }

    /// Block `hash`: from the write queue if it is still there, else from its file (checked).
    pub fn get(&self, hash: u64) -> Option<Loaded> {
        if let Some(payload) = lock(&self.pending).get(&hash).cloned() {
            self.store.counters.hits.fetch_add(1, Ordering::Relaxed);
            return Some(Loaded::Queued(payload));
        }
        self.store.get(hash).map(Loaded::File)
    }

    /// Whether block `hash` is queued or has a file (no check, no counters): for
    /// a match that only needs to know how far the tier may reach.
    pub fn contains(&self, hash: u64) -> bool {
        lock(&self.pending).contains_key(&hash) || self.store.path_of(hash).exists()
    }

    /// Returns once every block submitted before it is written (or failed).
    pub fn flush(&self) {
        let Some(queue) = &self.queue else { return };
        let (done, wait) = sync_channel(1);
        if queue.send(Job::Flush(done)).is_ok() {
            let _ = wait.recv();
        }
    }
}

impl Drop for TierWriter {
    /// Writes what is queued, then stops the thread.
    fn drop(&mut self) {
        drop(self.queue.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn write_loop(store: &TierStore, pending: &Pending, jobs: Receiver<Job>) {
    for job in jobs {
        match job {
            Job::Write(hash, payload) => {
                if store.put(hash, &payload).is_err() {
                    store.counters.errors.fetch_add(1, Ordering::Relaxed);
                }
                forget(pending, hash, &payload);
            }
            Job::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
}

/// Takes `hash` off the pending map if it still holds this very payload (a later
/// submit of the same block keeps its own entry).
fn forget(pending: &Pending, hash: u64, payload: &Arc<[u8]>) {
    let mut map = lock(pending);
    if map.get(&hash).is_some_and(|p| Arc::ptr_eq(p, payload)) {
        map.remove(&hash);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use std::fs::File;

    use super::*;
    use crate::tier::file::tests::identity;
    use crate::tier::scratch::Scratch;
    use crate::tier::store::tests::payload_of;

    #[test]
    fn a_full_queue_drops_and_counts_queued_blocks_are_readable_at_once() {
        let dir = Scratch::new("writer-drops");
        let id = identity(1, 2);
        let store = TierStore::open(&dir.0, 64 * id.layout.file_bytes(), id).unwrap();
        // Another holder of the directory lock (as another process would be) stalls the writer.
        let other = File::options().read(true).write(true).open(dir.0.join(".lock")).unwrap();
        other.lock().unwrap();
        let writer = TierWriter::start(store, 2).unwrap();
        let accepted: Vec<u64> = (0..10).filter(|&h| writer.submit(h, payload_of(&id, h).into())).collect();
        // One block in the stalled writer's hands, two queued: the rest dropped.
        assert!(accepted.len() <= 3, "{accepted:?}");
        assert_eq!(writer.stats().write_drops, 10 - accepted.len() as u64);
        for &h in &accepted {
            let got = writer.get(h).expect("a queued block is readable at once");
            assert!(matches!(got, Loaded::Queued(_)));
            assert_eq!(got.payload(), &payload_of(&id, h)[..]);
            assert!(writer.contains(h));
        }
        other.unlock().unwrap();
        writer.flush();
        assert_eq!(writer.stats().written, accepted.len() as u64);
        for &h in &accepted {
            assert!(matches!(writer.get(h), Some(Loaded::File(_))));
        }
    }

    #[test]
    fn dropping_the_writer_writes_what_is_queued() {
        let dir = Scratch::new("writer-drop");
        let id = identity(1, 2);
        let bound = 64 * id.layout.file_bytes();
        let writer = TierWriter::start(TierStore::open(&dir.0, bound, id).unwrap(), 32).unwrap();
        for h in 0..20 {
            assert!(writer.submit(h, payload_of(&id, h).into()));
        }
        drop(writer);
        let store = TierStore::open(&dir.0, bound, id).unwrap();
        for h in 0..20 {
            assert_eq!(store.get(h).unwrap().payload(), &payload_of(&id, h)[..]);
        }
    }
}
