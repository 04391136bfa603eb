//! Streaming keyed xxh3-128: one digest, or several of the same bytes in one pass.
//!
//! `SecondDigest` validation needs the fingerprint and an independent check
//! digest of every item byte. Two separate hashers would read each piece
//! twice and repeat the per-byte work; [`KeyedXxh3<2>`] loads every 64-byte
//! stripe once and feeds it to both accumulator sets (on AVX2, picked at run
//! time, about three quarters of the cost of two passes). Each digest is
//! exactly XXH3-128 under its secret (the tests compare against xxhash-rust's
//! one-shot function for every length and split): inputs of at most 240 bytes
//! take XXH3's short path one-shot (twox-hash), longer ones its long path,
//! streamed here.
//!
//! Streaming rule: stripe `k` (bytes `64k .. 64k + 64`) is accumulated once
//! more than `64(k + 1)` bytes were seen, so at the end exactly the stripes of
//! the one-shot long path are done (`(len - 1) / 64` of them, scrambled after
//! every 16th) and 1 to 64 bytes are pending; the final stripe is the last 64
//! bytes of the input, which the state keeps.
//!
//! The state without the secrets is small and plain ([`KeyedXxh3::checkpoint`]),
//! so a caller can hash a piece optimistically and roll it back.

use twox_hash::XxHash3_128;

use super::key::SECRET_BYTES;

/// Inputs up to this length take XXH3's short path.
const SHORT_INPUT: usize = 240;
const STRIPE: usize = 64;
/// Stripes per block with a 192-byte secret: `(192 - 64) / 8`.
const STRIPES_PER_BLOCK: usize = (SECRET_BYTES - STRIPE) / 8;

const PRIME32_1: u64 = 0x9E37_79B1;
const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
/// XXH3's initial accumulators: PRIME32_3, PRIME64_1 to PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1.
const INITIAL_ACC: [u64; 8] = [
    0xC2B2_AE3D,
    PRIME64_1,
    PRIME64_2,
    0x1656_67B1_9E37_79F9,
    0x85EB_CA77_C2B2_AE63,
    0x85EB_CA77,
    0x27D4_EB2F_1656_67C5,
    PRIME32_1,
];

/// Secret offsets of XXH3's long path.
const SCRAMBLE_SECRET: usize = SECRET_BYTES - STRIPE;
const LAST_STRIPE_SECRET: usize = SECRET_BYTES - STRIPE - 7;
const MERGE_LOW_SECRET: usize = 11;
const MERGE_HIGH_SECRET: usize = SECRET_BYTES - STRIPE - 11;

/// `N` xxh3-128 digests of one input, each under its own secret, fed in pieces.
#[derive(Clone)]
pub(crate) struct KeyedXxh3<const N: usize = 1> {
    secrets: [[u8; SECRET_BYTES]; N],
    state: State<N>,
}

/// Everything that changes as bytes are fed (what a checkpoint copies).
#[derive(Clone, Copy)]
pub(crate) struct State<const N: usize> {
    acc: [[u64; 8]; N],
    /// Stripes of the current block already accumulated (`0..16`).
    block_stripes: usize,
    /// Bytes seen but not yet accumulated (at most one stripe).
    pending: [u8; STRIPE],
    pending_len: usize,
    /// The last 64 bytes seen (the final stripe of the long path).
    tail: [u8; STRIPE],
    /// The first bytes, for the short path.
    head: [u8; SHORT_INPUT],
    len: usize,
}

impl KeyedXxh3<1> {
    /// A hasher keyed by `secret`.
    pub(crate) fn new(secret: [u8; SECRET_BYTES]) -> Self {
        Self::with_secrets([secret])
    }

    /// The digest of everything fed so far.
    pub(crate) fn digest128(&self) -> u128 {
        let [digest] = self.digests();
        digest
    }
}

impl<const N: usize> KeyedXxh3<N> {
    /// Hashers keyed by `secrets`, one digest each.
    pub(crate) fn with_secrets(secrets: [[u8; SECRET_BYTES]; N]) -> Self {
        let state = State {
            acc: [INITIAL_ACC; N],
            block_stripes: 0,
            pending: [0; STRIPE],
            pending_len: 0,
            tail: [0; STRIPE],
            head: [0; SHORT_INPUT],
            len: 0,
        };
        KeyedXxh3 { secrets, state }
    }

    /// The state after everything fed so far, to [`KeyedXxh3::rollback`] to.
    pub(crate) fn checkpoint(&self) -> State<N> {
        self.state
    }

    /// Forgets everything fed since `checkpoint` was taken.
    pub(crate) fn rollback(&mut self, checkpoint: State<N>) {
        self.state = checkpoint;
    }

    /// Hashes the next piece of the input into every digest.
    pub(crate) fn update(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        let s = &mut self.state;
        if s.len < SHORT_INPUT {
            let n = (SHORT_INPUT - s.len).min(bytes.len());
            s.head[s.len..s.len + n].copy_from_slice(&bytes[..n]);
        }
        s.len = s.len.saturating_add(bytes.len());
        if bytes.len() >= STRIPE {
            s.tail.copy_from_slice(&bytes[bytes.len() - STRIPE..]);
        } else {
            s.tail.copy_within(bytes.len().., 0);
            s.tail[STRIPE - bytes.len()..].copy_from_slice(bytes);
        }
        let mut rest = bytes;
        if s.pending_len > 0 {
            let n = (STRIPE - s.pending_len).min(rest.len());
            s.pending[s.pending_len..s.pending_len + n].copy_from_slice(&rest[..n]);
            s.pending_len += n;
            rest = &rest[n..];
            if rest.is_empty() {
                return;
            }
            // A full pending stripe with more input after it.
            let stripe = s.pending;
            s.block_stripes = accumulate(&mut s.acc, &stripe, &self.secrets, s.block_stripes);
            s.pending_len = 0;
        }
        // Every stripe but the one holding the last byte seen so far.
        let stripes = (rest.len() - 1) / STRIPE;
        let (body, left) = rest.split_at(stripes * STRIPE);
        s.block_stripes = accumulate(&mut s.acc, body, &self.secrets, s.block_stripes);
        s.pending[..left.len()].copy_from_slice(left);
        s.pending_len = left.len();
    }

    /// The digests of everything fed so far, in the order of the secrets.
    pub(crate) fn digests(&self) -> [u128; N] {
        let s = &self.state;
        if s.len <= SHORT_INPUT {
            return self.secrets.map(|secret| {
                XxHash3_128::oneshot_with_secret(&secret, &s.head[..s.len]).unwrap_or_else(|_| {
                    unreachable!("a {SECRET_BYTES}-byte secret is above xxh3's 136-byte minimum")
                })
            });
        }
        let len = s.len as u64;
        let mut out = [0u128; N];
        for ((digest, acc), secret) in out.iter_mut().zip(&s.acc).zip(&self.secrets) {
            let mut acc = *acc;
            accumulate_lanes(&mut acc, &lanes(&s.tail), secret, LAST_STRIPE_SECRET);
            let low = merge(&acc, secret, MERGE_LOW_SECRET, len.wrapping_mul(PRIME64_1));
            let high = merge(&acc, secret, MERGE_HIGH_SECRET, !len.wrapping_mul(PRIME64_2));
            *digest = (u128::from(high) << 64) | u128::from(low);
        }
        out
    }
}

/// Accumulates whole stripes into every accumulator set, the first one at
/// stripe `position` of its block, scrambling at every block end; returns
/// the position in the block after the last one.
fn accumulate<const N: usize>(
    acc: &mut [[u64; 8]; N], stripes: &[u8], secrets: &[[u8; SECRET_BYTES]; N], position: usize,
) -> usize {
    debug_assert!(stripes.len().is_multiple_of(STRIPE));
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked above), the only requirement
        // of a `target_feature(enable = "avx2")` function.
        return unsafe { accumulate_avx2(acc, stripes, secrets, position) };
    }
    accumulate_portable(acc, stripes, secrets, position)
}

fn accumulate_portable<const N: usize>(
    acc: &mut [[u64; 8]; N], stripes: &[u8], secrets: &[[u8; SECRET_BYTES]; N], mut position: usize,
) -> usize {
    for stripe in stripes.chunks_exact(STRIPE) {
        let data = lanes(stripe);
        for (acc, secret) in acc.iter_mut().zip(secrets) {
            accumulate_lanes(acc, &data, secret, position * 8);
        }
        position += 1;
        if position == STRIPES_PER_BLOCK {
            for (acc, secret) in acc.iter_mut().zip(secrets) {
                scramble(acc, secret);
            }
            position = 0;
        }
    }
    position
}

/// [`accumulate_portable`] with AVX2: each stripe is loaded once as two
/// 256-bit words and its lane swap is shared by every digest; the
/// accumulators stay in registers for the whole call.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn accumulate_avx2<const N: usize>(
    acc: &mut [[u64; 8]; N], stripes: &[u8], secrets: &[[u8; SECRET_BYTES]; N], mut position: usize,
) -> usize {
    use std::arch::x86_64::{
        __m256i, _mm256_add_epi64, _mm256_loadu_si256, _mm256_mul_epu32, _mm256_set1_epi64x,
        _mm256_setzero_si256, _mm256_shuffle_epi32, _mm256_slli_epi64, _mm256_srli_epi64,
        _mm256_storeu_si256, _mm256_xor_si256,
    };
    /// Two 256-bit words from the first 64 bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn load(bytes: &[u8]) -> [__m256i; 2] {
        let (lo, hi) = bytes[..STRIPE].split_at(32);
        // SAFETY: each half is 32 readable bytes; the loads are unaligned.
        unsafe { [_mm256_loadu_si256(lo.as_ptr().cast()), _mm256_loadu_si256(hi.as_ptr().cast())] }
    }
    /// `acc + (swapped + lo32(data ^ key) * hi32(data ^ key))`, per 64-bit
    /// lane: one add on the accumulator's dependency chain per stripe.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn step(acc: __m256i, data: __m256i, swapped: __m256i, key: __m256i) -> __m256i {
        let value = _mm256_xor_si256(data, key);
        let product = _mm256_mul_epu32(value, _mm256_srli_epi64::<32>(value));
        _mm256_add_epi64(acc, _mm256_add_epi64(swapped, product))
    }
    /// One stripe into every accumulator set, under the keys at `offset`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn stripe_into<const N: usize>(
        regs: &mut [[__m256i; 2]; N], stripe: &[u8], secrets: &[[u8; SECRET_BYTES]; N], offset: usize,
    ) {
        let [d0, d1] = load(stripe);
        let s0 = _mm256_shuffle_epi32::<0b01_00_11_10>(d0);
        let s1 = _mm256_shuffle_epi32::<0b01_00_11_10>(d1);
        for j in 0..N {
            let [k0, k1] = load(&secrets[j][offset..]);
            regs[j] = [step(regs[j][0], d0, s0, k0), step(regs[j][1], d1, s1, k1)];
        }
    }
    /// `((acc ^ acc >> 47) ^ key) * PRIME32_1`, per 64-bit lane.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn scramble(acc: __m256i, key: __m256i) -> __m256i {
        let x = _mm256_xor_si256(_mm256_xor_si256(acc, _mm256_srli_epi64::<47>(acc)), key);
        let prime = _mm256_set1_epi64x(PRIME32_1 as i64);
        let low = _mm256_mul_epu32(x, prime);
        let high = _mm256_mul_epu32(_mm256_srli_epi64::<32>(x), prime);
        _mm256_add_epi64(low, _mm256_slli_epi64::<32>(high))
    }
    let mut regs = [[_mm256_setzero_si256(); 2]; N];
    let mut scramble_keys = [[_mm256_setzero_si256(); 2]; N];
    for j in 0..N {
        regs[j] = load(bytemuck::cast_slice(&acc[j][..]));
        scramble_keys[j] = load(&secrets[j][SCRAMBLE_SECRET..]);
    }
    let mut rest = stripes;
    while !rest.is_empty() {
        if position == 0 && rest.len() >= STRIPE * STRIPES_PER_BLOCK {
            // A whole block: the secret offsets are the loop's constants.
            let (block, later) = rest.split_at(STRIPE * STRIPES_PER_BLOCK);
            for (i, stripe) in block.chunks_exact(STRIPE).enumerate() {
                stripe_into(&mut regs, stripe, secrets, i * 8);
            }
            rest = later;
            position = STRIPES_PER_BLOCK;
        } else {
            let (stripe, later) = rest.split_at(STRIPE);
            stripe_into(&mut regs, stripe, secrets, position * 8);
            rest = later;
            position += 1;
        }
        if position == STRIPES_PER_BLOCK {
            for j in 0..N {
                regs[j] =
                    [scramble(regs[j][0], scramble_keys[j][0]), scramble(regs[j][1], scramble_keys[j][1])];
            }
            position = 0;
        }
    }
    for (words, [lo, hi]) in acc.iter_mut().zip(regs) {
        let (first_half, second_half) = words.split_at_mut(4);
        // SAFETY: each half is four u64s, 32 writable bytes; the stores are unaligned.
        unsafe {
            _mm256_storeu_si256(first_half.as_mut_ptr().cast(), lo);
            _mm256_storeu_si256(second_half.as_mut_ptr().cast(), hi);
        }
    }
    position
}

/// The eight little-endian words of a stripe.
#[inline(always)]
fn lanes(stripe: &[u8]) -> [u64; 8] {
    let mut out = [0u64; 8];
    for (word, bytes) in out.iter_mut().zip(stripe.chunks_exact(8)) {
        let mut le = [0u8; 8];
        le.copy_from_slice(bytes);
        *word = u64::from_le_bytes(le);
    }
    out
}

/// XXH3's `accumulate_512` of one stripe (as words) under `secret[offset..]`.
#[inline(always)]
fn accumulate_lanes(acc: &mut [u64; 8], data: &[u64; 8], secret: &[u8; SECRET_BYTES], offset: usize) {
    let key = lanes(&secret[offset..offset + STRIPE]);
    for i in 0..8 {
        let value = data[i] ^ key[i];
        let product = (value & 0xFFFF_FFFF).wrapping_mul(value >> 32);
        acc[i] = acc[i].wrapping_add(data[i ^ 1]).wrapping_add(product);
    }
}

fn scramble(acc: &mut [u64; 8], secret: &[u8; SECRET_BYTES]) {
    let key = lanes(&secret[SCRAMBLE_SECRET..]);
    for (a, k) in acc.iter_mut().zip(key) {
        *a ^= *a >> 47;
        *a ^= k;
        *a = a.wrapping_mul(PRIME32_1);
    }
}

fn merge(acc: &[u64; 8], secret: &[u8; SECRET_BYTES], offset: usize, start: u64) -> u64 {
    let key = lanes(&secret[offset..offset + STRIPE]);
    let mut result = start;
    for i in 0..4 {
        let product =
            u128::from(acc[2 * i] ^ key[2 * i]).wrapping_mul(u128::from(acc[2 * i + 1] ^ key[2 * i + 1]));
        result = result.wrapping_add((product as u64) ^ ((product >> 64) as u64));
    }
    avalanche(result)
}

fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 37;
    h = h.wrapping_mul(0x1656_6791_9E37_79F9);
    h ^ (h >> 32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use xxhash_rust::xxh3::xxh3_128_with_secret;

    fn secrets<const N: usize>(seed: u64) -> [[u8; SECRET_BYTES]; N] {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut secrets = [[0u8; SECRET_BYTES]; N];
        secrets.iter_mut().for_each(|s| rng.fill(&mut s[..]));
        secrets
    }

    #[test]
    fn equals_the_reference_one_shot_digest_for_every_length_and_split() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let [secret, check] = secrets::<2>(1);
        let data: Vec<u8> = (0..300_000).map(|_| rng.random()).collect();
        let lengths = (0..=1300).chain([2047, 2048, 2049, 4096, 16_385, 65_537, 300_000]);
        for len in lengths {
            let want = xxh3_128_with_secret(&data[..len], &secret);
            for piece in [rng.random_range(1..=300), 64, 1024, 65_536] {
                let mut one = KeyedXxh3::new(secret);
                let mut two = KeyedXxh3::with_secrets([secret, check]);
                for chunk in data[..len].chunks(piece) {
                    one.update(chunk);
                    two.update(chunk);
                }
                assert_eq!(one.digest128(), want, "length {len}, pieces of {piece}");
                let both = [want, xxh3_128_with_secret(&data[..len], &check)];
                assert_eq!(two.digests(), both, "both digests, length {len}, pieces of {piece}");
            }
        }
    }

    #[test]
    fn short_inputs_are_keyed() {
        let [a, b] = secrets::<2>(8);
        for len in [0, 3, 16, 128, 240] {
            let input = vec![0xA5; len];
            let [x, y] = [a, b].map(|secret| {
                let mut h = KeyedXxh3::new(secret);
                h.update(&input);
                h.digest128()
            });
            assert_ne!(x, y, "a {len}-byte input must depend on the secret");
        }
    }

    #[test]
    fn a_rolled_back_piece_leaves_no_trace() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let pair = secrets::<2>(12);
        let data: Vec<u8> = (0..5000).map(|_| rng.random()).collect();
        for cut in [0, 100, 239, 240, 1000, 1024] {
            let mut h = KeyedXxh3::with_secrets(pair);
            h.update(&data[..cut]);
            let mark = h.checkpoint();
            h.update(&[0xEE; 3000]);
            h.rollback(mark);
            h.update(&data[cut..]);
            assert_eq!(h.digests(), pair.map(|s| xxh3_128_with_secret(&data, &s)), "cut at {cut}");
        }
    }

    #[test]
    fn the_portable_kernel_equals_the_dispatched_one() {
        let mut rng = ChaCha8Rng::seed_from_u64(10);
        let pair = secrets::<2>(13);
        let data: Vec<u8> = (0..STRIPE * 53).map(|_| rng.random()).collect();
        for position in [0, 5, 15] {
            let (mut a, mut b) = ([INITIAL_ACC; 2], [INITIAL_ACC; 2]);
            let end = accumulate(&mut a, &data, &pair, position);
            assert_eq!(end, accumulate_portable(&mut b, &data, &pair, position));
            assert_eq!(a, b, "from stripe {position} of a block");
        }
    }
}
