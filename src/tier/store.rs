//! A bounded directory of tier files, shared by the processes of one host.
//!
//! **Names.** Block `hash` of one [`Identity`] lives in `<hash:016x>-<ns>.blk`,
//! `ns` a short digest of the identity: the name is a function of the content's
//! identity, so two writers of one block write the same bytes under the same
//! name, and engines of different models or keys sharing a directory never
//! replace each other's files. A write goes to `.tmp-<pid>-<n>` (created with
//! `O_EXCL`, never a `.blk` name) and is renamed into place: a reader sees the
//! whole file or none, and a crash leaves only a temp file, which the next
//! eviction pass removes once it is old.
//!
//! **The bound across processes.** `.lock` (mode 0600) is held with `flock`
//! (std's `File::lock`) around each rename and eviction; it also holds the
//! apparent bytes of the `.blk` files, so a writer that still fits needs no
//! directory scan. One that does not scans, deletes the least recently used
//! files (by mtime; a hit refreshes it) down to 15/16 of the bound, and writes
//! the scanned total back, which also repairs the count after files were
//! removed behind the store's back. The directory thus holds at most
//! `tier_bytes` of `.blk` files, plus one temp file per writer in flight.
//!
//! **Reads take no lock.** A reader opens the file by name and checks it
//! ([`file::decode`]); a rename or an eviction under it leaves its open file whole.
//! A file that fails a check is a miss, counted in `errors`, and deleted.
//!
//! Files are read with `read`, not memory-mapped: a block is checksummed and
//! copied into pages once, so one pass over its bytes is the floor either way,
//! and a read costs no page-table work for a file used once.
//!
//! Nothing is fsynced: after a power loss a file may be torn or empty, and its
//! checksum then makes it a miss.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use super::file::{self, HEADER_BYTES, Identity, Rejected};
use crate::error::{Component, ConfigError, IoError, Result};

/// The lock file, also holding the directory's apparent `.blk` bytes (u64 LE).
const LOCK_NAME: &str = ".lock";
/// Prefix of files being written; never a block's name.
const TMP_PREFIX: &str = ".tmp-";
/// Suffix of every block file.
const BLOCK_SUFFIX: &str = ".blk";
/// A temp file this old is a crashed writer's and is removed by eviction passes.
const STALE_TMP: Duration = Duration::from_secs(600);

/// Counters of a tier (shared by every handle of one store).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierStats {
    /// Blocks served (from a file or the write queue).
    pub hits: u64,
    /// Blocks looked up and not found (a rejected file counts here too).
    pub misses: u64,
    /// Files that failed a check (deleted) or could not be read or written.
    pub errors: u64,
    /// Blocks written to a file.
    pub written: u64,
    /// Blocks the writer dropped because its queue was full.
    pub write_drops: u64,
    /// Files deleted to keep the bound.
    pub evicted: u64,
    /// Apparent bytes of the directory's block files, as last seen under the lock.
    pub bytes: u64,
}

impl TierStats {
    /// The counters of two stores on one directory (the thinker's and the
    /// talker's files): summed, with the directory's bytes as the later look saw them.
    pub fn merged(self, other: TierStats) -> TierStats {
        TierStats {
            hits: self.hits + other.hits,
            misses: self.misses + other.misses,
            errors: self.errors + other.errors,
            written: self.written + other.written,
            write_drops: self.write_drops + other.write_drops,
            evicted: self.evicted + other.evicted,
            bytes: self.bytes.max(other.bytes),
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) hits: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) written: AtomicU64,
    pub(crate) write_drops: AtomicU64,
    pub(crate) evicted: AtomicU64,
    pub(crate) bytes: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// A block read back from the tier: its file's bytes, header included.
#[derive(Debug, Clone)]
pub struct TierBlock(Vec<u8>);

impl TierBlock {
    /// The block's payload, as it was handed to [`TierStore::put`].
    pub fn payload(&self) -> &[u8] {
        &self.0[HEADER_BYTES..]
    }
}

/// What a [`TierStore::put`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Put {
    /// The block is now on disk.
    Written,
    /// A file of this block was already there (another writer's, or ours).
    AlreadyThere,
}

/// A bounded, checked directory of evicted blocks, shared on one host.
///
/// ```
/// use omniprefix::tier::{BlockLayout, Identity, ModelId, TierStore};
/// use omniprefix::Dtype;
/// let dir = std::env::temp_dir().join(format!("omniprefix-doc-tier-{}", std::process::id()));
/// let layout = BlockLayout { block_size: 4, layers: 1, kv_heads: 1, head_dim: 2, kv_dtype: Dtype::F32, captured: 0, hidden: 0, item_width: 0 };
/// let id = Identity { model: ModelId::of(["tiny"]), key: [7; 16], layout };
/// let store = TierStore::open(&dir, 64 * layout.file_bytes(), id)?;
/// let payload = vec![1u8; layout.payload_bytes()];
/// store.put(42, &payload)?;
/// assert_eq!(store.get(42).map(|b| b.payload().to_vec()), Some(payload));
/// assert!(store.get(43).is_none());
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Debug)]
pub struct TierStore {
    dir: PathBuf,
    identity: Identity,
    /// The identity's part of every file name.
    namespace: String,
    bound: u64,
    /// The lock file; the mutex orders this process's threads, `flock` the processes
    /// (a second `flock` on the same open file would not wait).
    lock: Mutex<File>,
    next_tmp: AtomicU64,
    pub(crate) counters: Counters,
    /// Blocks of this identity whose files this process deleted (evicted or
    /// rejected) since the last [`take_departed`](Self::take_departed): KV events say they left.
    departed: Mutex<Vec<u64>>,
}

impl TierStore {
    /// Opens (creating it 0700 if absent) the tier directory `dir`, bounded to
    /// `bound` apparent bytes, for blocks of `identity`.
    ///
    /// A [`ConfigError`] on field `tier_dir` for a path that is not a directory,
    /// is group- or world-writable, or cannot be written; on field `tier_bytes`
    /// for a bound below one block's file.
    pub fn open(dir: &Path, bound: u64, identity: Identity) -> Result<Self> {
        let block = identity.layout.file_bytes();
        if bound < block {
            return Err(
                invalid("tier_bytes", format!("at least one block's file ({block} bytes)"), bound).into()
            );
        }
        let dir = prepare_dir(dir)?;
        let lock_path = dir.join(LOCK_NAME);
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&lock_path)
            .map_err(|e| match e.kind() {
                ErrorKind::PermissionDenied | ErrorKind::ReadOnlyFilesystem => {
                    invalid("tier_dir", "a directory this process can write".into(), dir.display()).into()
                }
                _ => crate::Error::from(IoError::write(&lock_path, e)),
            })?;
        let namespace = namespace(&identity);
        let store = TierStore {
            dir,
            identity,
            namespace,
            bound,
            lock: Mutex::new(lock),
            next_tmp: AtomicU64::new(0),
            counters: Counters::default(),
            departed: Mutex::new(Vec::new()),
        };
        // Recount at open: files may have come or gone while no engine ran.
        store.locked(|lock| {
            let total = store.evict_until(0, store.bound)?;
            write_usage(lock, total);
            Ok(())
        })?;
        Ok(store)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The bound in apparent bytes.
    pub fn bound(&self) -> u64 {
        self.bound
    }

    /// What every file of this store must say about itself.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// The counters (the byte count as this process last saw it under the lock).
    pub fn stats(&self) -> TierStats {
        let c = &self.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TierStats {
            hits: load(&c.hits),
            misses: load(&c.misses),
            errors: load(&c.errors),
            written: load(&c.written),
            write_drops: load(&c.write_drops),
            evicted: load(&c.evicted),
            bytes: load(&c.bytes),
        }
    }

    /// The path block `hash` is stored under.
    pub fn path_of(&self, hash: u64) -> PathBuf {
        self.dir.join(format!("{hash:016x}-{}{BLOCK_SUFFIX}", self.namespace))
    }

    /// The block hash of a file name [`path_of`](Self::path_of) gives, if it is this identity's.
    fn hash_of(&self, name: &str) -> Option<u64> {
        let (hash, rest) = name.split_once('-')?;
        let namespace = rest.strip_suffix(BLOCK_SUFFIX)?;
        (hash.len() == 16 && namespace == self.namespace)
            .then(|| u64::from_str_radix(hash, 16).ok())
            .flatten()
    }

    /// Notes that this process deleted the file `path` of a block.
    fn departed(&self, path: &Path) {
        if let Some(hash) = path.file_name().and_then(|n| self.hash_of(&n.to_string_lossy())) {
            self.departed.lock().unwrap_or_else(|p| p.into_inner()).push(hash);
        }
    }

    /// The blocks of this identity whose files this process deleted since the
    /// last call (evicted for the bound, or failing a check), oldest first.
    /// Another process's evictions in a shared directory are not seen here.
    pub fn take_departed(&self) -> Vec<u64> {
        std::mem::take(&mut *self.departed.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Block `hash`, if a file of it is here and passes every check. A file that
    /// fails one is deleted and counted in `errors`; either way a miss is counted.
    pub fn get(&self, hash: u64) -> Option<TierBlock> {
        let path = self.path_of(hash);
        let read = File::open(&path).and_then(|mut f| {
            let mut bytes = Vec::with_capacity(HEADER_BYTES + self.identity.layout.payload_bytes());
            f.read_to_end(&mut bytes)?;
            Ok((f, bytes))
        });
        let outcome = match read {
            Ok((f, bytes)) => match file::decode(&self.identity, hash, &bytes) {
                Ok(_) => {
                    // Recency for eviction; best effort (a file evicted meanwhile is gone anyway).
                    let _ = f.set_modified(SystemTime::now());
                    Some(TierBlock(bytes))
                }
                Err(why) => {
                    self.reject(&path, why);
                    None
                }
            },
            Err(e) if e.kind() == ErrorKind::NotFound => None,
            Err(_) => {
                bump(&self.counters.errors);
                None
            }
        };
        bump(if outcome.is_some() { &self.counters.hits } else { &self.counters.misses });
        outcome
    }

    /// Writes block `hash` with `payload` (atomically: temp file, then rename
    /// under the lock), evicting the least recently used files first if the
    /// bound would be passed. A block already on disk is left as it is.
    pub fn put(&self, hash: u64, payload: &[u8]) -> Result<Put> {
        let layout = &self.identity.layout;
        if !layout.fits(payload.len()) {
            let expected = layout.payload_bytes();
            let what = format!(
                "block {hash:016x}: payload of {} bytes, its layout's pages take {expected} (item width {})",
                payload.len(),
                layout.item_width
            );
            return Err(Component::Tier.violation(what).into());
        }
        let target = self.path_of(hash);
        if target.exists() {
            return Ok(Put::AlreadyThere);
        }
        let bytes = file::encode(&self.identity, hash, payload);
        let tmp = self.dir.join(format!(
            "{TMP_PREFIX}{}-{}",
            std::process::id(),
            self.next_tmp.fetch_add(1, Ordering::Relaxed)
        ));
        let written = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| f.write_all(&bytes));
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(IoError::write(&tmp, e).into());
        }
        let size = bytes.len() as u64;
        let outcome = self.locked(|lock| {
            if target.exists() {
                return Ok(Put::AlreadyThere);
            }
            let mut usage = read_usage(lock);
            if usage.is_none_or(|u| u + size > self.bound) {
                // Down to 15/16 of the bound, so the next writes need no scan.
                usage = Some(self.evict_until(size, self.bound - self.bound / 16)?);
            }
            fs::rename(&tmp, &target).map_err(|e| IoError::write(&target, e))?;
            write_usage(lock, usage.unwrap_or(0) + size);
            Ok(Put::Written)
        });
        if !matches!(outcome, Ok(Put::Written)) {
            let _ = fs::remove_file(&tmp);
        }
        if let Ok(Put::Written) = outcome {
            bump(&self.counters.written);
        }
        outcome
    }

    /// Runs `f` holding the lock file, in this process (mutex) and across processes (`flock`).
    fn locked<T>(&self, f: impl FnOnce(&File) -> Result<T>) -> Result<T> {
        let guard = self.lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let path = || self.dir.join(LOCK_NAME);
        guard.lock().map_err(|e| IoError::write(path(), e))?;
        let out = f(&guard);
        self.counters.bytes.store(read_usage(&guard).unwrap_or(0), Ordering::Relaxed);
        guard.unlock().map_err(|e| IoError::write(path(), e))?;
        out
    }

    /// Under the lock: deletes stale temp files, then the least recently used
    /// block files until `incoming` more bytes fit in `target`; the bytes left.
    fn evict_until(&self, incoming: u64, target: u64) -> Result<u64> {
        let listing = fs::read_dir(&self.dir).map_err(|e| IoError::read(&self.dir, e))?;
        let now = SystemTime::now();
        let mut files = Vec::new();
        for entry in listing.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let Ok(meta) = entry.metadata() else { continue };
            let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            if name.starts_with(TMP_PREFIX) {
                if now.duration_since(modified).is_ok_and(|age| age > STALE_TMP) {
                    let _ = fs::remove_file(entry.path());
                }
            } else if name.ends_with(BLOCK_SUFFIX) && meta.is_file() {
                files.push((modified, meta.len(), entry.path()));
            }
        }
        let mut total: u64 = files.iter().map(|f| f.1).sum();
        files.sort_unstable_by(|a, b| a.0.cmp(&b.0).then_with(|| a.2.cmp(&b.2)));
        for (_, len, path) in files {
            if total + incoming <= target {
                break;
            }
            match fs::remove_file(&path) {
                Ok(()) => {
                    bump(&self.counters.evicted);
                    self.departed(&path);
                }
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(IoError::write(&path, e).into()),
            }
            total -= len;
        }
        Ok(total)
    }

    /// A file that failed a check: counted, and deleted (its bytes off the count).
    fn reject(&self, path: &Path, _why: Rejected) {
        bump(&self.counters.errors);
        let _ = self.locked(|lock| {
            if let Ok(meta) = fs::metadata(path)
                && fs::remove_file(path).is_ok()
            {
                self.departed(path);
                if let Some(usage) = read_usage(lock) {
                    write_usage(lock, usage.saturating_sub(meta.len()));
                }
            }
            Ok(())
        });
    }
}

/// The apparent bytes the lock file records; `None` if it records none (a fresh file).
fn read_usage(lock: &File) -> Option<u64> {
    let mut word = [0u8; 8];
    lock.read_exact_at(&mut word, 0).ok().map(|()| u64::from_le_bytes(word))
}

fn write_usage(lock: &File, bytes: u64) {
    // A failed write leaves a stale count; the next pass that does not fit rescans.
    let _ = lock.write_all_at(&bytes.to_le_bytes(), 0);
}

/// The identity's part of a file name: 8 hex digits of a digest of model, key and layout.
fn namespace(id: &Identity) -> String {
    let mut h = blake3::Hasher::new_derive_key("omniprefix 2026 tier file namespace");
    h.update(&id.model.0);
    h.update(&id.key);
    h.update(format!("{:?}", id.layout).as_bytes());
    hex::encode(&h.finalize().as_bytes()[..4])
}

fn invalid(field: &'static str, expected: String, found: impl std::fmt::Display) -> ConfigError {
    ConfigError::Invalid { component: "engine", field, expected, found: found.to_string() }
}

/// Checks (or creates, mode 0700) the tier directory; its canonical path.
pub(super) fn prepare_dir(dir: &Path) -> Result<PathBuf> {
    match fs::metadata(dir) {
        Ok(meta) if !meta.is_dir() => {
            return Err(
                invalid("tier_dir", "a directory".into(), format!("a file: {}", dir.display())).into()
            );
        }
        Ok(meta) if meta.mode() & 0o022 != 0 => {
            return Err(invalid(
                "tier_dir",
                "a directory only its owner may write (mode 0700)".into(),
                format!("mode {:o}: {}", meta.mode() & 0o777, dir.display()),
            )
            .into());
        }
        Ok(meta) => {
            // Readable by others: made private, so the files' 0600 is not undone by a listing.
            if meta.mode() & 0o077 != 0 {
                let _ = fs::set_permissions(dir, fs::Permissions::from_mode(0o700));
            }
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {
            fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(|e| match e.kind() {
                ErrorKind::PermissionDenied | ErrorKind::ReadOnlyFilesystem => {
                    invalid("tier_dir", "a directory this process can create".into(), dir.display()).into()
                }
                _ => crate::Error::from(IoError::write(dir, e)),
            })?;
        }
        Err(e) => return Err(IoError::read(dir, e).into()),
    }
    dir.canonicalize().map_err(|e| IoError::read(dir, e).into())
}

#[cfg(test)]
pub(super) mod tests;
