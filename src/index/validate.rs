//! Collision validation: a fingerprint hit is confirmed before it is used.
//!
//! The radix index keys children on an item's fingerprint, so two different
//! items whose fingerprints collide would otherwise share KV. Every hit is
//! therefore confirmed here, per [`ValidationPolicy`], against the identity the
//! index retained at insert; a rejected hit is a miss, never a wrong hit.

use crate::canon::ItemIdentity;
use crate::index::ValidationPolicy;

/// Why a fingerprint hit was not confirmed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// The fingerprints themselves differ (not a hit at all).
    FingerprintMismatch,
    /// Modality, layout or row count differ: the items cannot be the same.
    MetadataMismatch,
    /// The policy needs evidence (second digest or retained bytes) one side lacks.
    MissingEvidence,
    /// Both second digests are present and differ.
    DigestMismatch,
    /// Both retained byte strings are present and differ.
    BytesMismatch,
}

/// Confirms that `query` is the same item as the `cached` one under `policy`.
///
/// `Unvalidated` trusts the fingerprint alone (research baseline). The two
/// validating policies also require equal modality, layout and row count, then
/// compare the second digests (`SecondDigest`) or the retained canonical bytes
/// (`ExactBytes`, pointer-equal fast path before the memcmp).
///
/// ```
/// use std::sync::Arc;
/// use omniprefix::canon::{Fingerprint, ItemIdentity, ItemLayout, Modality};
/// use omniprefix::index::ValidationPolicy;
/// use omniprefix::index::validate::{confirm, Rejection};
///
/// let item = |check: u128| ItemIdentity {
///     fingerprint: Fingerprint(7),
///     check: Some(Fingerprint(check)),
///     retained: None,
///     modality: Modality::Audio,
///     layout: ItemLayout::Audio { mel_frames: 400 },
///     num_tokens: 50,
///     content_bytes: 0,
/// };
/// assert_eq!(confirm(ValidationPolicy::SecondDigest, &item(1), &item(1)), Ok(()));
/// assert_eq!(
///     confirm(ValidationPolicy::SecondDigest, &item(1), &item(2)),
///     Err(Rejection::DigestMismatch)
/// );
/// assert_eq!(confirm(ValidationPolicy::Unvalidated, &item(1), &item(2)), Ok(()));
/// ```
pub fn confirm(
    policy: ValidationPolicy,
    cached: &ItemIdentity,
    query: &ItemIdentity,
) -> Result<(), Rejection> {
    if cached.fingerprint != query.fingerprint {
        return Err(Rejection::FingerprintMismatch);
    }
    if std::ptr::eq(cached, query) || policy == ValidationPolicy::Unvalidated {
        return Ok(());
    }
    if cached.modality != query.modality
        || cached.layout != query.layout
        || cached.num_tokens != query.num_tokens
    {
        return Err(Rejection::MetadataMismatch);
    }
    match policy {
        ValidationPolicy::SecondDigest => match (cached.check, query.check) {
            (Some(a), Some(b)) if a == b => Ok(()),
            (Some(_), Some(_)) => Err(Rejection::DigestMismatch),
            _ => Err(Rejection::MissingEvidence),
        },
        ValidationPolicy::ExactBytes => match (&cached.retained, &query.retained) {
            (Some(a), Some(b)) if std::ptr::eq(a.as_ptr(), b.as_ptr()) && a.len() == b.len() => {
                Ok(())
            }
            (Some(a), Some(b)) if a[..] == b[..] => Ok(()),
            (Some(_), Some(_)) => Err(Rejection::BytesMismatch),
            _ => Err(Rejection::MissingEvidence),
        },
        ValidationPolicy::Unvalidated => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canon::{Fingerprint, ItemLayout, Modality};
    use std::sync::Arc;

    fn identity(fp: u128, check: Option<u128>, bytes: Option<&[u8]>) -> ItemIdentity {
        ItemIdentity {
            fingerprint: Fingerprint(fp),
            check: check.map(Fingerprint),
            retained: bytes.map(Arc::from),
            modality: Modality::Image,
            layout: ItemLayout::Image { grid_thw: [1, 4, 4] },
            num_tokens: 4,
            content_bytes: bytes.map_or(0, <[u8]>::len),
        }
    }

    #[test]
    fn second_digest_confirms_equal_and_rejects_different_or_missing() {
        let p = ValidationPolicy::SecondDigest;
        assert_eq!(confirm(p, &identity(1, Some(5), None), &identity(1, Some(5), None)), Ok(()));
        assert_eq!(
            confirm(p, &identity(1, Some(5), None), &identity(1, Some(6), None)),
            Err(Rejection::DigestMismatch)
        );
        assert_eq!(
            confirm(p, &identity(1, None, None), &identity(1, Some(6), None)),
            Err(Rejection::MissingEvidence)
        );
    }

    #[test]
    fn exact_bytes_compares_content_and_shares_pointer_fast_path() {
        let p = ValidationPolicy::ExactBytes;
        let a = identity(1, None, Some(b"abcd"));
        let mut shared = a.clone();
        shared.check = Some(Fingerprint(99));
        assert_eq!(confirm(p, &a, &shared), Ok(()));
        assert_eq!(confirm(p, &a, &identity(1, None, Some(b"abcd"))), Ok(()));
        assert_eq!(
            confirm(p, &a, &identity(1, None, Some(b"abce"))),
            Err(Rejection::BytesMismatch)
        );
        assert_eq!(
            confirm(p, &a, &identity(1, Some(1), None)),
            Err(Rejection::MissingEvidence)
        );
    }

    #[test]
    fn metadata_must_agree_and_fingerprints_must_match() {
        let a = identity(1, Some(5), Some(b"x"));
        let mut other_layout = a.clone();
        other_layout.layout = ItemLayout::Image { grid_thw: [1, 8, 2] };
        assert_eq!(
            confirm(ValidationPolicy::ExactBytes, &a, &other_layout),
            Err(Rejection::MetadataMismatch)
        );
        let mut other_modality = a.clone();
        other_modality.modality = Modality::Video;
        assert_eq!(
            confirm(ValidationPolicy::SecondDigest, &a, &other_modality),
            Err(Rejection::MetadataMismatch)
        );
        assert_eq!(
            confirm(ValidationPolicy::Unvalidated, &a, &identity(2, Some(5), Some(b"x"))),
            Err(Rejection::FingerprintMismatch)
        );
        assert_eq!(confirm(ValidationPolicy::Unvalidated, &a, &other_modality), Ok(()));
    }
}
