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
use crate::backend::cpu::lanes::Simd;
#[cfg(target_arch = "x86_64")]
use crate::backend::cpu::lanes::{Avx2, Avx512};

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
    /// The build of the stripe kernel (the widest the CPU runs, unless a test picks one).
    build: Simd,
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
        Self::on(Simd::detect(), secrets)
    }

    /// [`KeyedXxh3::with_secrets`] on a given build of the stripe kernel.
    fn on(build: Simd, secrets: [[u8; SECRET_BYTES]; N]) -> Self {
        let state = State {
            acc: [INITIAL_ACC; N],
            block_stripes: 0,
            pending: [0; STRIPE],
            pending_len: 0,
            tail: [0; STRIPE],
            head: [0; SHORT_INPUT],
            len: 0,
        };
        KeyedXxh3 { secrets, build, state }
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
            s.block_stripes = accumulate(self.build, &mut s.acc, &stripe, &self.secrets, s.block_stripes);
            s.pending_len = 0;
        }
        // Every stripe but the one holding the last byte seen so far.
        let stripes = (rest.len() - 1) / STRIPE;
        let (body, left) = rest.split_at(stripes * STRIPE);
        s.block_stripes = accumulate(self.build, &mut s.acc, body, &self.secrets, s.block_stripes);
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
            let data = lanes(&s.tail);
            let key = lanes(&secret[LAST_STRIPE_SECRET..]);
            let acc = Portable.add(Portable.step(*acc, data, key), Portable.swap_pairs(data));
            let low = merge(&acc, secret, MERGE_LOW_SECRET, len.wrapping_mul(PRIME64_1));
            let high = merge(&acc, secret, MERGE_HIGH_SECRET, !len.wrapping_mul(PRIME64_2));
            *digest = (u128::from(high) << 64) | u128::from(low);
        }
        out
    }
}

/// Accumulates whole stripes into every accumulator set on `build`, the
/// first one at stripe `position` of its block, scrambling at every block
/// end; returns the position in the block after the last one.
fn accumulate<const N: usize>(
    build: Simd, acc: &mut [[u64; 8]; N], stripes: &[u8], secrets: &[[u8; SECRET_BYTES]; N], position: usize,
) -> usize {
    debug_assert!(stripes.len().is_multiple_of(STRIPE));
    match build {
        Simd::Portable => accumulate_on(Portable, acc, stripes, secrets, position),
        // SAFETY: the token proves the CPU has AVX2, the entry point's only requirement.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2(l) => unsafe { accumulate_avx2(l, acc, stripes, secrets, position) },
        // SAFETY: the token proves the CPU has AVX-512F and AVX-512BW, the entry point's requirements.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512(z) => unsafe { accumulate_avx512(z, acc, stripes, secrets, position) },
        // SAFETY: as `Avx512`'s (the bf16 products play no part here).
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512Bf16(b) => unsafe { accumulate_avx512(b.fma_pairs(), acc, stripes, secrets, position) },
    }
}

/// [`accumulate_on`] compiled with AVX2: two 256-bit words a stripe.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn accumulate_avx2<const N: usize>(
    l: Avx2, acc: &mut [[u64; 8]; N], stripes: &[u8], secrets: &[[u8; SECRET_BYTES]; N], position: usize,
) -> usize {
    accumulate_on(l, acc, stripes, secrets, position)
}

/// [`accumulate_on`] compiled with AVX-512: one 512-bit word a stripe.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
fn accumulate_avx512<const N: usize>(
    z: Avx512, acc: &mut [[u64; 8]; N], stripes: &[u8], secrets: &[[u8; SECRET_BYTES]; N], position: usize,
) -> usize {
    accumulate_on(z, acc, stripes, secrets, position)
}

/// The eight 64-bit lanes of a stripe in one build's registers; the value is
/// the build's token. Every operation is lane-wise (or swaps lanes in pairs),
/// so each build computes XXH3's long path to the bit.
trait Stripes: Copy {
    /// A stripe's eight lanes.
    type V: Copy;
    /// The first 64 bytes of `bytes`, as eight little-endian words.
    fn load(self, bytes: &[u8]) -> Self::V;
    fn load_words(self, words: &[u64; 8]) -> Self::V;
    fn store_words(self, v: Self::V) -> [u64; 8];
    /// Lane `i` of the result is lane `i ^ 1` of `v`.
    fn swap_pairs(self, v: Self::V) -> Self::V;
    /// `a + b`, per lane (wrapping).
    fn add(self, a: Self::V, b: Self::V) -> Self::V;
    /// `acc + lo32(data ^ key) * hi32(data ^ key)`, per lane: XXH3's stripe
    /// step without the swapped data, which [`accumulate_on`] adds per block.
    fn step(self, acc: Self::V, data: Self::V, key: Self::V) -> Self::V;
    /// `((acc ^ acc >> 47) ^ key) * PRIME32_1`, per lane.
    fn scramble(self, acc: Self::V, key: Self::V) -> Self::V;
}

/// XXH3's accumulate loop on build `s`: each stripe is loaded once for every
/// digest, and the accumulators and the scramble keys stay in registers for
/// the whole call.
///
/// XXH3 adds each stripe's lane-swapped data to every accumulator; sums wrap,
/// so the order of the adds is free until a scramble reads the accumulators.
/// The stripes' data is therefore summed once (one add a stripe, no swap) and
/// the swapped sum added to every accumulator before each scramble and at the
/// end: for two digests 9 vector operations a stripe instead of 11. Inlined into each build's entry
/// point, so it is compiled with that build's features: neither it nor what
/// it calls may hold a closure (one would be compiled without them, and its
/// intrinsics become calls).
#[inline(always)]
fn accumulate_on<S: Stripes, const N: usize>(
    s: S, acc: &mut [[u64; 8]; N], stripes: &[u8], secrets: &[[u8; SECRET_BYTES]; N], mut position: usize,
) -> usize {
    let zero = s.load_words(&[0; 8]);
    let (mut regs, mut scramble_keys) = ([zero; N], [zero; N]);
    for j in 0..N {
        regs[j] = s.load_words(&acc[j]);
        scramble_keys[j] = s.load(&secrets[j][SCRAMBLE_SECRET..]);
    }
    // The data of the stripes since the last scramble (or the call's start).
    let mut sum = zero;
    let mut rest = stripes;
    while !rest.is_empty() {
        if position == 0 && rest.len() >= STRIPE * STRIPES_PER_BLOCK {
            // A whole block: the secret offsets are the loop's constants.
            let (block, later) = rest.split_at(STRIPE * STRIPES_PER_BLOCK);
            for (i, stripe) in block.chunks_exact(STRIPE).enumerate() {
                sum = stripe_into(s, &mut regs, sum, stripe, secrets, i * 8);
            }
            rest = later;
            position = STRIPES_PER_BLOCK;
        } else {
            let (stripe, later) = rest.split_at(STRIPE);
            sum = stripe_into(s, &mut regs, sum, stripe, secrets, position * 8);
            rest = later;
            position += 1;
        }
        if position == STRIPES_PER_BLOCK {
            let swapped = s.swap_pairs(sum);
            for j in 0..N {
                regs[j] = s.scramble(s.add(regs[j], swapped), scramble_keys[j]);
            }
            sum = zero;
            position = 0;
        }
    }
    let swapped = s.swap_pairs(sum);
    for j in 0..N {
        acc[j] = s.store_words(s.add(regs[j], swapped));
    }
    position
}

/// One stripe into every accumulator set, under the keys at `offset`; returns
/// `sum` plus the stripe's data.
#[inline(always)]
fn stripe_into<S: Stripes, const N: usize>(
    s: S, regs: &mut [S::V; N], sum: S::V, stripe: &[u8], secrets: &[[u8; SECRET_BYTES]; N], offset: usize,
) -> S::V {
    let data = s.load(stripe);
    for j in 0..N {
        regs[j] = s.step(regs[j], data, s.load(&secrets[j][offset..]));
    }
    s.add(sum, data)
}

/// [`Stripes`] as plain words, for any CPU (and the final stripe of every build).
#[derive(Clone, Copy)]
struct Portable;

impl Stripes for Portable {
    type V = [u64; 8];
    #[inline(always)]
    fn load(self, bytes: &[u8]) -> [u64; 8] {
        lanes(bytes)
    }
    #[inline(always)]
    fn load_words(self, words: &[u64; 8]) -> [u64; 8] {
        *words
    }
    #[inline(always)]
    fn store_words(self, v: [u64; 8]) -> [u64; 8] {
        v
    }
    #[inline(always)]
    fn swap_pairs(self, v: [u64; 8]) -> [u64; 8] {
        std::array::from_fn(|i| v[i ^ 1])
    }
    #[inline(always)]
    fn add(self, a: [u64; 8], b: [u64; 8]) -> [u64; 8] {
        std::array::from_fn(|i| a[i].wrapping_add(b[i]))
    }
    #[inline(always)]
    fn step(self, acc: [u64; 8], data: [u64; 8], key: [u64; 8]) -> [u64; 8] {
        std::array::from_fn(|i| {
            let value = data[i] ^ key[i];
            acc[i].wrapping_add((value & 0xFFFF_FFFF).wrapping_mul(value >> 32))
        })
    }
    #[inline(always)]
    fn scramble(self, acc: [u64; 8], key: [u64; 8]) -> [u64; 8] {
        std::array::from_fn(|i| ((acc[i] ^ (acc[i] >> 47)) ^ key[i]).wrapping_mul(PRIME32_1))
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Avx2, Avx512, PRIME32_1, STRIPE, Stripes};

    // Every `unsafe` block below is sound because an `Avx2` token exists only
    // where the CPU has AVX2, and a load or store touches exactly the 64 bytes
    // that the slice index or the array type bounds.
    impl Stripes for Avx2 {
        type V = [__m256i; 2];
        #[inline(always)]
        fn load(self, bytes: &[u8]) -> [__m256i; 2] {
            let (lo, hi) = bytes[..STRIPE].split_at(32);
            // SAFETY: the CPU has the token's features; 2 × 32 readable bytes.
            unsafe { [_mm256_loadu_si256(lo.as_ptr().cast()), _mm256_loadu_si256(hi.as_ptr().cast())] }
        }
        #[inline(always)]
        fn load_words(self, words: &[u64; 8]) -> [__m256i; 2] {
            self.load(bytemuck::cast_slice(words))
        }
        #[inline(always)]
        fn store_words(self, [lo, hi]: [__m256i; 2]) -> [u64; 8] {
            let mut words = [0u64; 8];
            let (first, second) = words.split_at_mut(4);
            // SAFETY: the CPU has the token's features; 2 × 32 writable bytes.
            unsafe {
                _mm256_storeu_si256(first.as_mut_ptr().cast(), lo);
                _mm256_storeu_si256(second.as_mut_ptr().cast(), hi);
            }
            words
        }
        #[inline(always)]
        fn swap_pairs(self, [lo, hi]: [__m256i; 2]) -> [__m256i; 2] {
            // SAFETY: the CPU has the token's features.
            unsafe { [_mm256_shuffle_epi32::<0b01_00_11_10>(lo), _mm256_shuffle_epi32::<0b01_00_11_10>(hi)] }
        }
        #[inline(always)]
        fn add(self, a: [__m256i; 2], b: [__m256i; 2]) -> [__m256i; 2] {
            // SAFETY: the CPU has the token's features.
            unsafe { [_mm256_add_epi64(a[0], b[0]), _mm256_add_epi64(a[1], b[1])] }
        }
        #[inline(always)]
        fn step(self, acc: [__m256i; 2], data: [__m256i; 2], key: [__m256i; 2]) -> [__m256i; 2] {
            [step(self, acc[0], data[0], key[0]), step(self, acc[1], data[1], key[1])]
        }
        #[inline(always)]
        fn scramble(self, acc: [__m256i; 2], key: [__m256i; 2]) -> [__m256i; 2] {
            [scramble(self, acc[0], key[0]), scramble(self, acc[1], key[1])]
        }
    }

    /// [`Stripes::step`] on half a stripe.
    #[inline(always)]
    fn step(_: Avx2, acc: __m256i, data: __m256i, key: __m256i) -> __m256i {
        // SAFETY: the CPU has the token's features.
        unsafe {
            let value = _mm256_xor_si256(data, key);
            _mm256_add_epi64(acc, _mm256_mul_epu32(value, _mm256_srli_epi64::<32>(value)))
        }
    }

    /// [`Stripes::scramble`] on half a stripe.
    #[inline(always)]
    fn scramble(_: Avx2, acc: __m256i, key: __m256i) -> __m256i {
        // SAFETY: the CPU has the token's features.
        unsafe {
            let x = _mm256_xor_si256(_mm256_xor_si256(acc, _mm256_srli_epi64::<47>(acc)), key);
            let prime = _mm256_set1_epi64x(PRIME32_1 as i64);
            let low = _mm256_mul_epu32(x, prime);
            let high = _mm256_mul_epu32(_mm256_srli_epi64::<32>(x), prime);
            _mm256_add_epi64(low, _mm256_slli_epi64::<32>(high))
        }
    }

    // Every `unsafe` block below is sound because an `Avx512` token exists only
    // where the CPU has AVX-512F and AVX-512BW, and a load or store touches
    // exactly the 64 bytes that the slice index or the array type bounds.
    impl Stripes for Avx512 {
        type V = __m512i;
        #[inline(always)]
        fn load(self, bytes: &[u8]) -> __m512i {
            // SAFETY: the CPU has the token's features; 64 readable bytes.
            unsafe { _mm512_loadu_si512(bytes[..STRIPE].as_ptr().cast()) }
        }
        #[inline(always)]
        fn load_words(self, words: &[u64; 8]) -> __m512i {
            // SAFETY: the CPU has the token's features; 64 readable bytes.
            unsafe { _mm512_loadu_si512(words.as_ptr().cast()) }
        }
        #[inline(always)]
        fn store_words(self, v: __m512i) -> [u64; 8] {
            let mut words = [0u64; 8];
            // SAFETY: the CPU has the token's features; 64 writable bytes.
            unsafe { _mm512_storeu_si512(words.as_mut_ptr().cast(), v) };
            words
        }
        #[inline(always)]
        fn swap_pairs(self, v: __m512i) -> __m512i {
            // SAFETY: the CPU has the token's features.
            unsafe { _mm512_shuffle_epi32::<_MM_PERM_BADC>(v) }
        }
        #[inline(always)]
        fn add(self, a: __m512i, b: __m512i) -> __m512i {
            // SAFETY: the CPU has the token's features.
            unsafe { _mm512_add_epi64(a, b) }
        }
        /// As xxhash.h's `XXH3_accumulate_512_avx512`, less the swapped data.
        #[inline(always)]
        fn step(self, acc: __m512i, data: __m512i, key: __m512i) -> __m512i {
            // SAFETY: the CPU has the token's features.
            unsafe {
                let value = _mm512_xor_si512(data, key);
                _mm512_add_epi64(acc, _mm512_mul_epu32(value, _mm512_shuffle_epi32::<_MM_PERM_CDAB>(value)))
            }
        }
        /// As xxhash.h's `XXH3_scrambleAcc_avx512`: the xor-shift-xor is one
        /// ternary logic operation (`0x96` is `a ^ b ^ c`).
        #[inline(always)]
        fn scramble(self, acc: __m512i, key: __m512i) -> __m512i {
            // SAFETY: the CPU has the token's features.
            unsafe {
                let x = _mm512_ternarylogic_epi64::<0x96>(acc, _mm512_srli_epi64::<47>(acc), key);
                let prime = _mm512_set1_epi64(PRIME32_1 as i64);
                let low = _mm512_mul_epu32(x, prime);
                let high = _mm512_mul_epu32(_mm512_shuffle_epi32::<_MM_PERM_CDAB>(x), prime);
                _mm512_add_epi64(low, _mm512_slli_epi64::<32>(high))
            }
        }
    }
}

/// The eight little-endian words of a stripe.
#[inline(always)]
fn lanes(stripe: &[u8]) -> [u64; 8] {
    let mut out = [0u64; 8];
    for (word, bytes) in out.iter_mut().zip(stripe[..STRIPE].chunks_exact(8)) {
        let mut le = [0u8; 8];
        le.copy_from_slice(bytes);
        *word = u64::from_le_bytes(le);
    }
    out
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
    use crate::builds_run::builds_run;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use xxhash_rust::xxh3::xxh3_128_with_secret;

    fn secrets<const N: usize>(seed: u64) -> [[u8; SECRET_BYTES]; N] {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut secrets = [[0u8; SECRET_BYTES]; N];
        secrets.iter_mut().for_each(|s| rng.fill(&mut s[..]));
        secrets
    }

    /// Every build the CPU has, each a one-digest and a two-digest hasher fed
    /// in pieces of several sizes, against xxhash-rust's one-shot XXH3-128.
    #[test]
    fn equals_the_reference_one_shot_digest_for_every_length_and_split() {
        let test = "equals_the_reference_one_shot_digest_for_every_length_and_split";
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let [secret, check] = secrets::<2>(1);
        let data: Vec<u8> = (0..300_000).map(|_| rng.random()).collect();
        let lengths = (0..=1300).chain([2047, 2048, 2049, 4096, 16_385, 65_537, 300_000]);
        let builds = builds_run(test);
        for len in lengths {
            let want = [secret, check].map(|s| xxh3_128_with_secret(&data[..len], &s));
            for piece in [rng.random_range(1..=300), 64, 1024, 65_536] {
                for &build in &builds {
                    let mut one = KeyedXxh3::on(build, [secret]);
                    let mut two = KeyedXxh3::on(build, [secret, check]);
                    for chunk in data[..len].chunks(piece) {
                        one.update(chunk);
                        two.update(chunk);
                    }
                    let name = build.name();
                    assert_eq!(one.digest128(), want[0], "{name}: length {len}, pieces of {piece}");
                    assert_eq!(two.digests(), want, "{name}: both digests, length {len}, pieces of {piece}");
                }
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

    /// Each build's kernel from every position in a block, over blocks and
    /// partial blocks, for one and two digests: the portable kernel's
    /// accumulators and end position, to the bit.
    #[test]
    fn every_build_of_the_kernel_equals_the_portable_one() {
        let test = "every_build_of_the_kernel_equals_the_portable_one";
        let mut rng = ChaCha8Rng::seed_from_u64(10);
        let pair = secrets::<2>(13);
        let data: Vec<u8> = (0..STRIPE * 53).map(|_| rng.random()).collect();
        let builds = builds_run(test);
        for position in 0..STRIPES_PER_BLOCK {
            for stripes in [1, 15, 16, 17, 53] {
                let data = &data[..stripes * STRIPE];
                let (mut want_one, mut want_two) = ([INITIAL_ACC], [INITIAL_ACC; 2]);
                let end_one = accumulate(Simd::Portable, &mut want_one, data, &[pair[0]], position);
                let end_two = accumulate(Simd::Portable, &mut want_two, data, &pair, position);
                assert_eq!((end_one, end_two), ((position + stripes) % STRIPES_PER_BLOCK, end_one));
                for &build in &builds {
                    let (mut one, mut two) = ([INITIAL_ACC], [INITIAL_ACC; 2]);
                    let at = format!("{}: {stripes} stripes from stripe {position} of a block", build.name());
                    assert_eq!(accumulate(build, &mut one, data, &[pair[0]], position), end_one, "{at}");
                    assert_eq!(accumulate(build, &mut two, data, &pair, position), end_two, "{at}");
                    assert_eq!((one, two), (want_one, want_two), "{at}");
                }
            }
        }
    }
}
