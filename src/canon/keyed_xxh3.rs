//! Streaming keyed xxh3-128 that picks its SIMD path at run time.
//!
//! xxhash-rust fixes its SIMD path when it is compiled (SSE2 on a default x86-64
//! build); twox-hash detects AVX2 when it runs. With the fingerprint and the
//! check digest in one pass, that is the difference between ~2.2× and ~1.5× a
//! plain read of the bytes on this project's machine.
//!
//! twox-hash 2.1's streaming hasher finishes inputs of at most 240 bytes with
//! its default secret, not the one it was given, which would leave short items
//! unkeyed. Their bytes are kept here and hashed one-shot with the secret, so
//! every length gets the XXH3 reference digest (the tests compare against
//! xxhash-rust's one-shot function).

use twox_hash::XxHash3_128;

use super::key::SECRET_BYTES;

/// Inputs up to this length take XXH3's short path (twox-hash's `CUTOFF`).
const SHORT_INPUT: usize = 240;

/// An xxh3-128 hasher under a custom secret, fed in pieces.
#[derive(Clone)]
pub(crate) struct KeyedXxh3 {
    hasher: XxHash3_128,
    secret: [u8; SECRET_BYTES],
    head: [u8; SHORT_INPUT],
    len: usize,
}

impl KeyedXxh3 {
    /// A hasher keyed by `secret`.
    pub(crate) fn new(secret: [u8; SECRET_BYTES]) -> Self {
        let hasher = XxHash3_128::with_seed_and_secret(0, secret.to_vec())
            .unwrap_or_else(|_| unreachable!("a {SECRET_BYTES}-byte secret is above xxh3's 136-byte minimum"));
        KeyedXxh3 { hasher, secret, head: [0; SHORT_INPUT], len: 0 }
    }

    /// Hashes the next piece of the input.
    pub(crate) fn update(&mut self, bytes: &[u8]) {
        if self.len < SHORT_INPUT {
            let n = (SHORT_INPUT - self.len).min(bytes.len());
            self.head[self.len..self.len + n].copy_from_slice(&bytes[..n]);
        }
        self.len = self.len.saturating_add(bytes.len());
        self.hasher.write(bytes);
    }

    /// The digest of everything fed so far.
    pub(crate) fn digest128(&self) -> u128 {
        if self.len <= SHORT_INPUT {
            XxHash3_128::oneshot_with_secret(&self.secret, &self.head[..self.len])
                .unwrap_or_else(|_| unreachable!("a {SECRET_BYTES}-byte secret is above xxh3's 136-byte minimum"))
        } else {
            self.hasher.finish_128()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use xxhash_rust::xxh3::xxh3_128_with_secret;

    #[test]
    fn equals_the_reference_one_shot_digest_for_every_length_and_split() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut secret = [0u8; SECRET_BYTES];
        rng.fill(&mut secret[..]);
        let data: Vec<u8> = (0..300_000).map(|_| rng.random()).collect();
        let lengths = (0..=600).chain([1023, 1024, 1025, 4096, 65_537, 300_000]);
        for len in lengths {
            let piece = rng.random_range(1..=300);
            let mut h = KeyedXxh3::new(secret);
            for chunk in data[..len].chunks(piece) {
                h.update(chunk);
            }
            assert_eq!(h.digest128(), xxh3_128_with_secret(&data[..len], &secret), "length {len}, pieces of {piece}");
        }
    }

    #[test]
    fn short_inputs_are_keyed() {
        let mut rng = ChaCha8Rng::seed_from_u64(8);
        let mut secrets = [[0u8; SECRET_BYTES]; 2];
        secrets.iter_mut().for_each(|s| rng.fill(&mut s[..]));
        for len in [0, 3, 16, 128, 240] {
            let input = vec![0xA5; len];
            let [a, b] = secrets.map(|secret| {
                let mut h = KeyedXxh3::new(secret);
                h.update(&input);
                h.digest128()
            });
            assert_ne!(a, b, "a {len}-byte input must depend on the secret");
        }
    }
}
