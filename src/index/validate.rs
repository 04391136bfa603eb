//! Collision validation: a fingerprint hit is confirmed before it is used.
//!
//! The radix index keys children on an item's fingerprint, so two different
//! items whose fingerprints collide would otherwise share KV. Every hit is
//! therefore confirmed here against the identity the index retained at
//! insert, with the [`Evidence`](crate::canon::Evidence) both identities carry; a rejected hit is a
//! miss, never a wrong hit.
//!
//! There is no policy argument: the policy is given once, to the
//! [`Fingerprinter`](crate::canon::Fingerprinter), and travels in the evidence
//! it computes, so an index cannot be configured to expect evidence its
//! fingerprinter does not make.

use crate::canon::{Evidence, ItemIdentity};

/// Why a fingerprint hit was not confirmed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// The fingerprints themselves differ (not a hit at all).
    FingerprintMismatch,
    /// Modality, layout or row count differ: the items cannot be the same.
    MetadataMismatch,
    /// The identities carry evidence of different policies (they were made by
    /// differently configured fingerprinters), so neither confirms the other.
    MixedEvidence,
    /// Both second digests are present and differ.
    DigestMismatch,
    /// Both retained byte strings are present and differ.
    BytesMismatch,
}

/// Confirms that `query` is the same item as the `cached` one, with the
/// evidence both carry.
///
/// `Unvalidated` evidence on both sides trusts the fingerprint alone (research
/// baseline). Otherwise the items must have equal modality, layout and row
/// count, and evidence of the same policy that agrees: equal second digests
/// (`SecondDigest`) or equal retained canonical bytes (`ExactBytes`,
/// pointer-equal fast path before the memcmp).
///
/// ```
/// use omniprefix::canon::{Evidence, Fingerprint, ItemIdentity, ItemLayout, Modality};
/// use omniprefix::index::validate::{confirm, Rejection};
///
/// let item = |evidence| ItemIdentity {
///     fingerprint: Fingerprint(7),
///     evidence,
///     modality: Modality::Audio,
///     layout: ItemLayout::Audio { mel_frames: 400 },
///     num_tokens: 50,
///     content_bytes: 0,
/// };
/// let digest = |check| item(Evidence::SecondDigest(Fingerprint(check)));
/// assert_eq!(confirm(&digest(1), &digest(1)), Ok(()));
/// assert_eq!(confirm(&digest(1), &digest(2)), Err(Rejection::DigestMismatch));
/// assert_eq!(confirm(&digest(1), &item(Evidence::Unvalidated)), Err(Rejection::MixedEvidence));
/// assert_eq!(confirm(&item(Evidence::Unvalidated), &item(Evidence::Unvalidated)), Ok(()));
/// ```
pub fn confirm(cached: &ItemIdentity, query: &ItemIdentity) -> Result<(), Rejection> {
    if cached.fingerprint != query.fingerprint {
        return Err(Rejection::FingerprintMismatch);
    }
    if std::ptr::eq(cached, query) {
        return Ok(());
    }
    if let (Evidence::Unvalidated, Evidence::Unvalidated) = (&cached.evidence, &query.evidence) {
        return Ok(());
    }
    if cached.modality != query.modality
        || cached.layout != query.layout
        || cached.num_tokens != query.num_tokens
    {
        return Err(Rejection::MetadataMismatch);
    }
    match (&cached.evidence, &query.evidence) {
        (Evidence::SecondDigest(a), Evidence::SecondDigest(b)) if a == b => Ok(()),
        (Evidence::SecondDigest(_), Evidence::SecondDigest(_)) => Err(Rejection::DigestMismatch),
        (Evidence::ExactBytes(a), Evidence::ExactBytes(b))
            if std::ptr::eq(a.as_ptr(), b.as_ptr()) && a.len() == b.len() =>
        {
            Ok(())
        }
        (Evidence::ExactBytes(a), Evidence::ExactBytes(b)) if a[..] == b[..] => Ok(()),
        (Evidence::ExactBytes(_), Evidence::ExactBytes(_)) => Err(Rejection::BytesMismatch),
        _ => Err(Rejection::MixedEvidence),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canon::{Fingerprint, ItemLayout, Modality};
    use std::sync::Arc;

    fn identity(fp: u128, evidence: Evidence) -> ItemIdentity {
        ItemIdentity {
            fingerprint: Fingerprint(fp),
            evidence,
            modality: Modality::Image,
            layout: ItemLayout::Image { grid_thw: [1, 4, 4] },
            num_tokens: 4,
            content_bytes: 4,
        }
    }

    fn digest(fp: u128, check: u128) -> ItemIdentity {
        identity(fp, Evidence::SecondDigest(Fingerprint(check)))
    }

    fn bytes(fp: u128, bytes: &[u8]) -> ItemIdentity {
        identity(fp, Evidence::ExactBytes(Arc::from(bytes)))
    }

    #[test]
    fn second_digest_confirms_equal_and_rejects_different() {
        assert_eq!(confirm(&digest(1, 5), &digest(1, 5)), Ok(()));
        assert_eq!(confirm(&digest(1, 5), &digest(1, 6)), Err(Rejection::DigestMismatch));
    }

    #[test]
    fn exact_bytes_compares_content_and_shares_pointer_fast_path() {
        let a = bytes(1, b"abcd");
        let mut shared = a.clone();
        shared.content_bytes = 99;
        assert_eq!(confirm(&a, &shared), Ok(()));
        assert_eq!(confirm(&a, &bytes(1, b"abcd")), Ok(()));
        assert_eq!(confirm(&a, &bytes(1, b"abce")), Err(Rejection::BytesMismatch));
    }

    #[test]
    fn evidence_of_different_policies_never_confirms() {
        let kinds = [digest(1, 5), bytes(1, b"x"), identity(1, Evidence::Unvalidated)];
        for (i, a) in kinds.iter().enumerate() {
            for (j, b) in kinds.iter().enumerate() {
                let expected = if i == j { Ok(()) } else { Err(Rejection::MixedEvidence) };
                assert_eq!(confirm(a, b), expected, "{:?} vs {:?}", a.evidence.policy(), b.evidence.policy());
            }
        }
    }

    #[test]
    fn metadata_must_agree_and_fingerprints_must_match() {
        let a = bytes(1, b"x");
        let mut other_layout = a.clone();
        other_layout.layout = ItemLayout::Image { grid_thw: [1, 8, 2] };
        assert_eq!(confirm(&a, &other_layout), Err(Rejection::MetadataMismatch));
        let mut other_modality = digest(1, 5);
        other_modality.modality = Modality::Video;
        assert_eq!(confirm(&digest(1, 5), &other_modality), Err(Rejection::MetadataMismatch));
        let bare = identity(1, Evidence::Unvalidated);
        assert_eq!(confirm(&bare, &identity(2, Evidence::Unvalidated)), Err(Rejection::FingerprintMismatch));
        let mut bare_video = bare.clone();
        bare_video.modality = Modality::Video;
        assert_eq!(confirm(&bare, &bare_video), Ok(()), "unvalidated trusts the fingerprint alone");
    }
}
