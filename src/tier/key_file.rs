//! The fleet key kept in a tier directory, for engines given a `tier_dir` and no key.
//!
//! Tier files are found again only under the key that hashed their blocks, and
//! an engine's default key is fresh per process, so a restart would miss every
//! file. A caller that has no fleet key (the CLI without `--fingerprint-key`)
//! takes this one instead: generated once, kept as 32 raw bytes in
//! `<tier_dir>/fleet.key` (mode 0600, in the 0700 directory), and read by every
//! later engine, and by every worker sharing the directory. Two workers starting
//! together agree: each writes its candidate to a temp file and links it to the
//! real name, which only the first link creates; both then read that one.

use std::fs::{self, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use super::store::prepare_dir;
use crate::canon::FingerprintKey;
use crate::error::{ConfigError, IoError, Result};

/// The key file's name in the tier directory.
pub const KEY_FILE: &str = "fleet.key";

/// The fleet key kept in tier directory `dir`, created (with the directory, 0700) if absent.
///
/// A key file of another size is a [`ConfigError`] on field `tier_dir`: it is
/// not ours, and replacing it would orphan the files made under it.
///
/// ```
/// use omniprefix::tier::tier_key;
/// let dir = std::env::temp_dir().join(format!("omniprefix-doc-key-{}", std::process::id()));
/// let key = tier_key(&dir)?;
/// assert_eq!(tier_key(&dir)?, key); // the same key for the next engine
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), omniprefix::Error>(())
/// ```
pub fn tier_key(dir: &Path) -> Result<FingerprintKey> {
    let dir = prepare_dir(dir)?;
    let path = dir.join(KEY_FILE);
    if !path.exists() {
        let tmp = dir.join(format!(".tmp-key-{}-{}", std::process::id(), rand::random::<u64>()));
        let key = FingerprintKey::random();
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| f.write_all(key.as_bytes()))
            .map_err(|e| IoError::write(&tmp, e))?;
        // `link` fails if the name exists: the first worker's key wins.
        let linked = fs::hard_link(&tmp, &path);
        let _ = fs::remove_file(&tmp);
        match linked {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(IoError::write(&path, e).into()),
        }
    }
    let bytes = fs::read(&path).map_err(|e| IoError::read(&path, e))?;
    let bytes: [u8; 32] = bytes.try_into().map_err(|b: Vec<u8>| ConfigError::Invalid {
        component: "engine",
        field: "tier_dir",
        expected: format!("a directory whose {KEY_FILE} holds a 32-byte key"),
        found: format!("{} bytes in {}", b.len(), path.display()),
    })?;
    Ok(FingerprintKey::from_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::scratch::Scratch;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn one_key_per_directory_private_and_checked() {
        let dir = Scratch::new("key");
        let keys: Vec<FingerprintKey> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4).map(|_| s.spawn(|| tier_key(&dir.0).unwrap())).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(keys.iter().all(|k| *k == keys[0]), "workers starting together disagree");
        let path = dir.0.join(KEY_FILE);
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(fs::read_dir(&dir.0).unwrap().count(), 1, "a temp key file was left");
        fs::write(&path, b"short").unwrap();
        assert!(matches!(
            tier_key(&dir.0),
            Err(crate::Error::Config(ConfigError::Invalid { field: "tier_dir", .. }))
        ));
    }
}
