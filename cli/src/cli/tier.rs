//! `--tier-dir` and `--tier-bytes`: the disk tier under the KV pool.

use std::path::PathBuf;

use clap::Args;

use omniprefix::engine::EngineConfig;
use omniprefix::tier::tier_key;

use crate::error::Result;

/// The engine's disk tier.
#[derive(Debug, Clone, Default, Args)]
pub struct TierArgs {
    /// Keep blocks the KV pool evicts in this directory (created 0700), shared by
    /// the workers of this host and found again after a restart. Without
    /// `--fingerprint-key`, the key kept in DIR/fleet.key is used (created once).
    #[arg(long, value_name = "DIR")]
    pub tier_dir: Option<PathBuf>,
    /// The tier's bound in bytes of its files: a number with an optional unit
    /// (`512MiB`, `8GiB`, `10GB`).
    #[arg(long, value_name = "SIZE", requires = "tier_dir", value_parser = parse_bytes)]
    pub tier_bytes: Option<u64>,
}

/// A size such as `8GiB`, `512 MiB`, `10GB` or `1048576`.
///
/// ```
/// use omniprefix_cli::cli::tier::parse_bytes;
/// assert_eq!(parse_bytes("8GiB"), Ok(8 << 30));
/// assert_eq!(parse_bytes("1024"), Ok(1024));
/// assert!(parse_bytes("lots").is_err());
/// ```
pub fn parse_bytes(text: &str) -> std::result::Result<u64, String> {
    parse_size::parse_size(text).map_err(|e| format!("{text:?}: {e} (e.g. 512MiB, 8GiB)"))
}

impl TierArgs {
    /// Sets the engine's tier from these arguments; with a tier and no fleet key
    /// given (`key_given` false), the key kept in the tier directory.
    pub fn apply(&self, config: &mut EngineConfig, key_given: bool) -> Result<()> {
        let Some(dir) = &self.tier_dir else { return Ok(()) };
        config.tier_dir = Some(dir.clone());
        if let Some(bytes) = self.tier_bytes {
            config.tier_bytes = bytes;
        }
        if !key_given {
            config.fingerprint_key = tier_key(dir)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tier_without_a_key_takes_the_directorys() {
        let dir = std::env::temp_dir().join(format!("omniprefix-cli-tier-{}", std::process::id()));
        let args = TierArgs { tier_dir: Some(dir.clone()), tier_bytes: Some(1 << 20) };
        let (mut a, mut b) = (EngineConfig::default(), EngineConfig::default());
        args.apply(&mut a, false).unwrap();
        args.apply(&mut b, false).unwrap();
        assert_eq!(a.fingerprint_key, b.fingerprint_key, "two runs on one directory share its key");
        assert_eq!((a.tier_dir.as_deref(), a.tier_bytes), (Some(dir.as_path()), 1 << 20));
        let mut given = EngineConfig::default();
        let key = given.fingerprint_key.clone();
        args.apply(&mut given, true).unwrap();
        assert_eq!(given.fingerprint_key, key, "a given key is kept");
        std::fs::remove_dir_all(&dir).ok();
    }
}
