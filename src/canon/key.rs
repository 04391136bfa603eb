//! The key of the fingerprint, and the two independent xxh3 secrets derived
//! from it (fingerprint and check digest).

use crate::error::ConfigError;

/// Size of an xxh3 custom secret (the crate's `DEFAULT_SECRET_SIZE`).
pub(crate) const SECRET_BYTES: usize = 192;

/// A 32-byte key. Fingerprints made with different keys are unrelated, so a
/// per-index random key stops a client from crafting colliding items offline.
///
/// ```
/// use omniprefix::canon::FingerprintKey;
/// assert_eq!(FingerprintKey::fixed(7), FingerprintKey::fixed(7));
/// assert_ne!(FingerprintKey::fixed(7), FingerprintKey::fixed(8));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct FingerprintKey([u8; 32]);

impl FingerprintKey {
    /// A fresh key from the OS-seeded thread RNG: the default, one per index.
    pub fn random() -> Self {
        FingerprintKey(rand::random())
    }

    /// A reproducible key derived from `seed`, for research runs and tests.
    pub fn fixed(seed: u64) -> Self {
        FingerprintKey(blake3::derive_key("omniprefix 2026 fixed fingerprint key", &seed.to_le_bytes()))
    }

    /// A key given verbatim.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        FingerprintKey(bytes)
    }

    /// The key bytes (to persist an index together with its key).
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// A key given as 64 hex digits: the fleet key every replica and frontend
    /// shares (`--fingerprint-key HEX`); anything else is a [`ConfigError`].
    ///
    /// ```
    /// use omniprefix::canon::FingerprintKey;
    /// let key = FingerprintKey::from_hex(&"ab".repeat(32))?;
    /// assert_eq!(key.as_bytes(), &[0xab; 32]);
    /// assert!(FingerprintKey::from_hex("abc").is_err());
    /// # Ok::<(), omniprefix::error::ConfigError>(())
    /// ```
    pub fn from_hex(text: &str) -> Result<Self, ConfigError> {
        let invalid = |found: String| ConfigError::Invalid {
            component: "fingerprint key",
            field: "hex",
            expected: "64 hex digits (32 bytes)".into(),
            found,
        };
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(text.trim(), &mut bytes)
            .map_err(|e| invalid(format!("{} characters ({e})", text.trim().len())))?;
        Ok(FingerprintKey(bytes))
    }

    /// An xxh3 secret for one purpose; different contexts give independent secrets.
    fn secret(&self, context: &str) -> [u8; SECRET_BYTES] {
        let mut secret = [0u8; SECRET_BYTES];
        let mut hasher = blake3::Hasher::new_derive_key(context);
        hasher.update(&self.0);
        hasher.finalize_xof().fill(&mut secret);
        secret
    }

    /// Secret of the fingerprint digest.
    pub(crate) fn fingerprint_secret(&self) -> [u8; SECRET_BYTES] {
        self.secret("omniprefix 2026 item fingerprint xxh3 secret")
    }

    /// Secret of the independent check digest (`SecondDigest` validation).
    pub(crate) fn check_secret(&self) -> [u8; SECRET_BYTES] {
        self.secret("omniprefix 2026 item check digest xxh3 secret")
    }
}

impl std::fmt::Debug for FingerprintKey {
    /// Never prints the key itself.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FingerprintKey(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_keyed_and_independent() {
        let a = FingerprintKey::fixed(1);
        assert_eq!(a.fingerprint_secret(), FingerprintKey::fixed(1).fingerprint_secret());
        assert_ne!(a.fingerprint_secret(), a.check_secret());
        assert_ne!(a.fingerprint_secret(), FingerprintKey::fixed(2).fingerprint_secret());
        assert_ne!(FingerprintKey::random(), FingerprintKey::random());
        assert_eq!(format!("{a:?}"), "FingerprintKey(..)");
    }
}
