use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use super::*;
use crate::tier::file::tests::identity;
use crate::tier::file::{FORMAT_VERSION, encode};
use crate::tier::scratch::Scratch;

/// A payload that says which block it is, so a wrong hit is visible.
pub(crate) fn payload_of(id: &Identity, hash: u64) -> Vec<u8> {
    let seed = hash.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..id.layout.payload_bytes()).map(|i| (seed >> (i % 8 * 8)) as u8 ^ i as u8).collect()
}

/// Apparent bytes of every file in `dir` but the lock file, and how many temp files.
fn dir_bytes(dir: &Path) -> (u64, usize) {
    let mut total = 0;
    let mut temps = 0;
    for entry in fs::read_dir(dir).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == LOCK_NAME {
            continue;
        }
        temps += usize::from(name.starts_with(TMP_PREFIX));
        total += entry.metadata().map(|m| m.len()).unwrap_or(0);
    }
    (total, temps)
}

fn mode(path: &Path) -> u32 {
    fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[test]
fn round_trip_private_and_already_there() {
    let dir = Scratch::new("round");
    let id = identity(1, 2);
    let store = TierStore::open(&dir.0, 16 * id.layout.file_bytes(), id).unwrap();
    assert_eq!(mode(&dir.0), 0o700);
    let payload = payload_of(&id, 9);
    assert_eq!(store.put(9, &payload).unwrap(), Put::Written);
    assert_eq!(store.put(9, &payload).unwrap(), Put::AlreadyThere);
    assert_eq!(store.get(9).unwrap().payload(), &payload[..]);
    assert!(store.get(10).is_none());
    assert_eq!(mode(&store.path_of(9)), 0o600);
    assert_eq!(mode(&dir.0.join(LOCK_NAME)), 0o600);
    let stats = store.stats();
    assert_eq!((stats.hits, stats.misses, stats.errors, stats.written), (1, 1, 0, 1));
    assert_eq!(stats.bytes, id.layout.file_bytes());
    // A payload of the wrong size is a bug of the caller, refused.
    assert!(store.put(11, &payload[1..]).is_err());
    // A second store (a restart) sees the block.
    drop(store);
    let again = TierStore::open(&dir.0, 16 * id.layout.file_bytes(), id).unwrap();
    assert_eq!(again.get(9).unwrap().payload(), &payload[..]);
    assert_eq!(again.stats().bytes, id.layout.file_bytes());
}

#[test]
fn every_corruption_is_a_counted_miss_and_deleted() {
    let dir = Scratch::new("corrupt");
    let id = identity(1, 2);
    let store = TierStore::open(&dir.0, 16 * id.layout.file_bytes(), id).unwrap();
    let good = encode(&id, 5, &payload_of(&id, 5));
    let mut flipped = good.clone();
    flipped[HEADER_BYTES + 3] ^= 1;
    let mut old_version = good.clone();
    old_version[8..12].copy_from_slice(&(FORMAT_VERSION - 1).to_le_bytes());
    let cases: [(&str, Vec<u8>); 6] = [
        ("flipped payload byte", flipped),
        ("truncated", good[..good.len() - 7].to_vec()),
        ("another model", encode(&identity(3, 2), 5, &payload_of(&id, 5))),
        ("another key", encode(&identity(1, 4), 5, &payload_of(&id, 5))),
        ("an older format", old_version),
        ("empty (torn)", Vec::new()),
    ];
    for (n, (what, bytes)) in cases.into_iter().enumerate() {
        fs::write(store.path_of(5), bytes).unwrap();
        assert!(store.get(5).is_none(), "{what} was served");
        let stats = store.stats();
        assert_eq!((stats.errors, stats.misses, stats.hits), (n as u64 + 1, n as u64 + 1, 0), "{what}");
        assert!(!store.path_of(5).exists(), "{what} was not deleted");
        assert_eq!(store.take_departed(), [5], "{what}: KV events must say block 5 left");
    }
    // The good file is still served after all that.
    fs::write(store.path_of(5), good).unwrap();
    assert!(store.get(5).is_some());
}

#[test]
fn bound_holds_and_eviction_keeps_the_recently_used() {
    let dir = Scratch::new("bound");
    let id = identity(1, 2);
    let block = id.layout.file_bytes();
    let bound = 10 * block + block / 2;
    let store = TierStore::open(&dir.0, bound, id).unwrap();
    for hash in 0..40u64 {
        store.put(hash, &payload_of(&id, hash)).unwrap();
        let (bytes, temps) = dir_bytes(&dir.0);
        assert!(bytes <= bound, "{bytes} bytes on disk after block {hash}, bound {bound}");
        assert_eq!(temps, 0);
        assert_eq!(store.stats().bytes, bytes);
        // Block 0 is read after every write (mtimes are coarse: sleep past a tick).
        std::thread::sleep(Duration::from_millis(5));
        assert!(store.get(0).is_some(), "the most recently used block was evicted at {hash}");
    }
    assert!(store.stats().evicted >= 29);
    // Every eviction is a departure of its block, block 0 (kept in use) never.
    let departed = store.take_departed();
    assert_eq!(departed.len() as u64, store.stats().evicted);
    assert!(departed.contains(&1) && !departed.contains(&0), "{departed:?}");
    assert!(store.take_departed().is_empty());
    assert!(store.get(1).is_none(), "the least recently used block survived");
    assert!(store.get(39).is_some());
}

#[test]
fn bad_directories_and_bounds_are_config_errors() {
    let scratch = Scratch::new("bad");
    let id = identity(1, 2);
    let field = |r: Result<TierStore>| match r {
        Err(crate::Error::Config(ConfigError::Invalid { field, .. })) => field,
        other => panic!("expected a config error, got {other:?}"),
    };
    fs::create_dir_all(&scratch.0).unwrap();
    let file_path = scratch.0.join("a-file");
    fs::write(&file_path, b"x").unwrap();
    assert_eq!(field(TierStore::open(&file_path, 1 << 20, id)), "tier_dir");
    assert_eq!(field(TierStore::open(&scratch.0.join("t"), 0, id)), "tier_bytes");
    assert_eq!(field(TierStore::open(&scratch.0.join("t"), id.layout.file_bytes() - 1, id)), "tier_bytes");
    let open_dir = scratch.0.join("world");
    fs::create_dir(&open_dir).unwrap();
    fs::set_permissions(&open_dir, fs::Permissions::from_mode(0o777)).unwrap();
    assert_eq!(field(TierStore::open(&open_dir, 1 << 20, id)), "tier_dir");
    fs::set_permissions(&open_dir, fs::Permissions::from_mode(0o770)).unwrap();
    assert_eq!(field(TierStore::open(&open_dir, 1 << 20, id)), "tier_dir");
    // Readable by others but writable by its owner only: made private.
    fs::set_permissions(&open_dir, fs::Permissions::from_mode(0o755)).unwrap();
    TierStore::open(&open_dir, 1 << 20, id).unwrap();
    assert_eq!(mode(&open_dir), 0o700);
    // Unwritable: only meaningful where permissions bind (not as root).
    let read_only = scratch.0.join("ro");
    fs::create_dir(&read_only).unwrap();
    fs::set_permissions(&read_only, fs::Permissions::from_mode(0o500)).unwrap();
    if fs::write(read_only.join("probe"), b"").is_err() {
        assert_eq!(field(TierStore::open(&read_only, 1 << 20, id)), "tier_dir");
    }
    fs::set_permissions(&read_only, fs::Permissions::from_mode(0o700)).unwrap();
}

#[test]
fn stale_temp_files_are_removed_fresh_ones_kept() {
    let dir = Scratch::new("temps");
    let id = identity(1, 2);
    let block = id.layout.file_bytes();
    let store = TierStore::open(&dir.0, 2 * block, id).unwrap();
    let stale = dir.0.join(format!("{TMP_PREFIX}1-1"));
    let fresh = dir.0.join(format!("{TMP_PREFIX}1-2"));
    fs::write(&stale, b"half").unwrap();
    fs::write(&fresh, b"half").unwrap();
    let old = SystemTime::now() - STALE_TMP - Duration::from_secs(5);
    File::options().write(true).open(&stale).unwrap().set_modified(old).unwrap();
    for hash in 0..4 {
        store.put(hash, &payload_of(&id, hash)).unwrap();
    }
    assert!(!stale.exists());
    assert!(fresh.exists());
}

/// Environment variable that turns [`two_processes_child`] into a worker on that directory.
const CHILD_DIR: &str = "OMNIPREFIX_TIER_TEST_CHILD_DIR";
const SHARED_BLOCKS: u64 = 48;
const SHARED_BOUND_BLOCKS: u64 = 20;

/// Run by [`two_processes_share_a_directory`] in child processes (a no-op otherwise):
/// writes and reads an overlapping set of blocks in a shared directory, and
/// fails on any wrong payload, any rejected file or a directory over its bound.
#[test]
fn two_processes_child() {
    let Some(dir) = std::env::var_os(CHILD_DIR) else { return };
    let dir = PathBuf::from(dir);
    let id = identity(1, 2);
    let block = id.layout.file_bytes();
    let store = TierStore::open(&dir, SHARED_BOUND_BLOCKS * block, id).unwrap();
    let seed = u64::from(std::process::id());
    let mut hits = 0;
    for i in 0..400u64 {
        let hash = (i * 7 + seed) % SHARED_BLOCKS;
        store.put(hash, &payload_of(&id, hash)).unwrap();
        let probe = (i * 13 + seed * 3) % SHARED_BLOCKS;
        if let Some(b) = store.get(probe) {
            assert_eq!(b.payload(), &payload_of(&id, probe)[..], "block {probe} read wrong");
            hits += 1;
        }
        if i % 16 == 0 {
            // One temp file per writer in flight: two processes here.
            let (bytes, _) = dir_bytes(&dir);
            assert!(bytes <= (SHARED_BOUND_BLOCKS + 2) * block, "{bytes} bytes on disk");
        }
    }
    assert_eq!(store.stats().errors, 0, "a file failed its check");
    assert!(hits > 0);
}

#[test]
fn two_processes_share_a_directory() {
    if std::env::var_os(CHILD_DIR).is_some() {
        return;
    }
    let dir = Scratch::new("shared");
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|_| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "tier::store::tests::two_processes_child",
                    "--test-threads=1",
                    "--nocapture",
                ])
                .env(CHILD_DIR, &dir.0)
                .spawn()
                .unwrap()
        })
        .collect();
    for mut child in children {
        let status = child.wait().unwrap();
        assert!(status.success(), "a child process failed: {status}");
    }
    let id = identity(1, 2);
    let block = id.layout.file_bytes();
    let (bytes, temps) = dir_bytes(&dir.0);
    assert!(
        bytes <= SHARED_BOUND_BLOCKS * block,
        "{bytes} bytes left, bound {}",
        SHARED_BOUND_BLOCKS * block
    );
    assert_eq!(temps, 0);
    // The count the lock file holds is the truth, and every file left is whole.
    let store = TierStore::open(&dir.0, SHARED_BOUND_BLOCKS * block, id).unwrap();
    assert_eq!(store.stats().bytes, bytes);
    let served = (0..SHARED_BLOCKS)
        .filter_map(|h| store.get(h).map(|b| assert_eq!(b.payload(), &payload_of(&id, h)[..])))
        .count();
    assert_eq!(served as u64 * block, bytes);
    assert_eq!(store.stats().errors, 0);
}
