//! Quiet display probes on a machine without a display.
//!
//! While wgpu lists adapters, Mesa's Vulkan device-select layer asks
//! libwayland for a compositor, and libwayland prints `error: XDG_RUNTIME_DIR
//! is invalid or not set in the environment.` when that variable is unset (a
//! container, a CI job, an ssh session): alarming, though a compute run needs
//! no display. With the variable set to an empty private directory, the probe
//! finds no compositor socket there and fails without a word.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

/// A private (0700) empty directory that stands in for `XDG_RUNTIME_DIR`,
/// removed on drop.
#[derive(Debug)]
pub struct RuntimeDir(PathBuf);

impl RuntimeDir {
    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for RuntimeDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A stand-in when `current` (the variable's value) is unset or not an
/// absolute path, as libwayland requires; `None` when it is fine as it is, or
/// when no directory can be made under `parent` (the probe then prints its line,
/// and nothing else changes).
pub fn stand_in(current: Option<&OsStr>, parent: &Path) -> Option<RuntimeDir> {
    if current.is_some_and(|dir| Path::new(dir).is_absolute()) {
        return None;
    }
    let dir = parent.join(format!("omniprefix-runtime-{}", std::process::id()));
    let mut builder = std::fs::DirBuilder::new();
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(&dir).ok().map(|()| RuntimeDir(dir))
}

/// Sets `XDG_RUNTIME_DIR` to a [`stand_in`] when it needs one. Call it first
/// thing in `main`, before any thread starts; keep the guard until the end.
pub fn quiet_display_probes() -> Option<RuntimeDir> {
    let dir = stand_in(std::env::var_os("XDG_RUNTIME_DIR").as_deref(), &std::env::temp_dir())?;
    // SAFETY: called at the start of `main`, while the process has one thread,
    // so nothing reads the environment concurrently.
    unsafe { std::env::set_var("XDG_RUNTIME_DIR", dir.path()) };
    Some(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_absolute_dir_is_kept_and_anything_else_gets_a_private_empty_one() {
        let parent = std::env::temp_dir().join(format!("omniprefix-headless-test-{}", std::process::id()));
        std::fs::create_dir_all(&parent).unwrap();
        assert!(stand_in(Some(OsStr::new("/run/user/1000")), &parent).is_none());
        for current in [None, Some(OsStr::new("")), Some(OsStr::new("relative/dir"))] {
            let dir = stand_in(current, &parent).expect("a stand-in");
            let path = dir.path().to_path_buf();
            assert!(path.is_absolute() && path.starts_with(&parent), "{path:?}");
            assert_eq!(std::fs::read_dir(&path).unwrap().count(), 0);
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o700);
            }
            drop(dir);
            assert!(!path.exists(), "removed on drop");
        }
        assert!(stand_in(None, &parent.join("missing")).is_none(), "no directory, no stand-in");
        std::fs::remove_dir(&parent).unwrap();
    }
}
