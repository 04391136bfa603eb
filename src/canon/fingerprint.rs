//! Keyed fingerprints of items in one pass over their bytes.
//!
//! The fingerprint is xxh3-128 under a secret derived from the
//! [`FingerprintKey`]; the check digest (for `SecondDigest` validation) is
//! xxh3-128 under an independently derived secret, computed by the same
//! hasher from the same loads of each stripe. Content above [`TREE_THRESHOLD`] bytes is
//! hashed as a tree of fixed [`TREE_CHUNK`]-byte leaves, so the digest depends
//! on the content only, never on the thread count.

use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;

use super::header::encode_header;
use super::key::FingerprintKey;
use super::keyed_xxh3::{KeyedXxh3, State};
use super::layout::{LayoutRules, check_shape};
use super::stream::{ByteSink, emit_tensor};
use super::{Evidence, Fingerprint, ItemContent, ItemIdentity, ItemSpec, TensorView, ValidationPolicy};
use crate::error::{Error, RequestError, Result};

/// Content longer than this is hashed as a tree of chunks (on any thread count).
pub const TREE_THRESHOLD: usize = 4 << 20;
/// Leaf size of the tree; a constant so fingerprints never depend on threads.
pub const TREE_CHUNK: usize = 1 << 20;

/// Tag hashed after the header in a tree root, before the leaf digests.
const TREE_TAG: &[u8] = b"omniprefix/tree/v1";

/// The plain read floor: sums the bytes as little-endian `u64` words. Benches
/// and `bench match` report hashing throughput against this one definition.
///
/// ```
/// use omniprefix::canon::read_floor;
/// let mut bytes = vec![0u8; 20];
/// bytes[0] = 1;
/// bytes[8] = 2;
/// bytes[19] = 3; // tail bytes count as themselves
/// assert_eq!(read_floor(&bytes), 6);
/// ```
///
/// Words are summed 64 bytes at a time into eight lanes, so the loop does
/// four 16-byte loads an iteration: a two-load loop ran at 100 or 58 GB/s on
/// the same cache-resident bytes depending only on where the linker put it
/// (whether it crossed a 64-byte line), which moved every ratio against it.
#[inline(never)]
pub fn read_floor(bytes: &[u8]) -> u64 {
    let (head, words, tail) = bytemuck::pod_align_to::<u8, u64>(bytes);
    let edges = head.iter().chain(tail).fold(0u64, |acc, &b| acc.wrapping_add(u64::from(b)));
    let lines = words.chunks_exact(8);
    let rest = lines.remainder().iter().fold(edges, |acc, &w| acc.wrapping_add(u64::from_le(w)));
    let lanes = lines.fold([0u64; 8], |mut lanes, line| {
        for (lane, &w) in lanes.iter_mut().zip(line) {
            *lane = lane.wrapping_add(u64::from_le(w));
        }
        lanes
    });
    lanes.iter().fold(rest, |acc, &lane| acc.wrapping_add(lane))
}

/// Computes [`ItemIdentity`]s: the keyed fingerprint plus the validation
/// material its [`ValidationPolicy`] needs, on a fixed number of threads.
///
/// ```
/// use omniprefix::canon::{Evidence, Fingerprinter, FingerprintKey, ItemContent, ItemLayout, ItemSpec, Modality, TensorView, ValidationPolicy};
/// use ndarray::{ArrayD, IxDyn};
///
/// let fp = Fingerprinter::new(FingerprintKey::fixed(0), 1, ValidationPolicy::SecondDigest)?;
/// let pixels = ArrayD::<u8>::zeros(IxDyn(&[56, 56, 3]));
/// let item = ItemSpec {
///     modality: Modality::Image,
///     layout: ItemLayout::Image { grid_thw: [1, 4, 4] },
///     content: ItemContent::Tensor(TensorView::U8(pixels.view())),
///     params: Default::default(),
/// };
/// let id = fp.identify(0, &item)?;
/// assert_eq!(id.num_tokens, 4);
/// assert!(matches!(id.evidence, Evidence::SecondDigest(_)));
/// assert_eq!(id.fingerprint, fp.identify(0, &item)?.fingerprint);
/// # Ok::<(), omniprefix::Error>(())
/// ```
pub struct Fingerprinter {
    key: FingerprintKey,
    fingerprint_secret: [u8; super::key::SECRET_BYTES],
    check_secret: [u8; super::key::SECRET_BYTES],
    policy: ValidationPolicy,
    threads: usize,
    /// Workers for tree leaves ([`shared_pool`]); `None` hashes on the caller's thread.
    pool: Option<Arc<rayon::ThreadPool>>,
}

/// The process's fingerprint pool of `threads` workers, built on first use and
/// shared by every [`Fingerprinter`] of that size. Building one spawns its threads,
/// which costs more than hashing a small item; `vllm_uuids(threads=2)` made a
/// fingerprinter, and so a pool, on every call.
fn shared_pool(threads: usize) -> Result<Arc<rayon::ThreadPool>> {
    static POOLS: std::sync::Mutex<Vec<(usize, Arc<rayon::ThreadPool>)>> = std::sync::Mutex::new(Vec::new());
    let mut pools = POOLS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, pool)) = pools.iter().find(|(n, _)| *n == threads) {
        return Ok(Arc::clone(pool));
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("omniprefix-fp-{i}"))
        .build()
        .map_err(|source| Error::ThreadPool { purpose: "fingerprint", threads, source })?;
    let pool = Arc::new(pool);
    pools.push((threads, Arc::clone(&pool)));
    Ok(pool)
}

impl std::fmt::Debug for Fingerprinter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fingerprinter")
            .field("key", &self.key)
            .field("policy", &self.policy)
            .field("threads", &self.threads)
            .finish()
    }
}

/// Where an item's content bytes come from.
#[derive(Clone, Copy)]
enum Content<'v, 'a> {
    Tensor(&'v TensorView<'a>),
    Encoded(&'a [u8]),
}

impl Content<'_, '_> {
    fn emit(&self, item: usize, bytes: Range<usize>, sink: &mut impl ByteSink) -> Result<()> {
        match self {
            Content::Tensor(view) => emit_tensor(item, view, bytes, sink),
            Content::Encoded(all) => {
                debug_assert!(bytes.end <= all.len());
                sink.consume(all.get(bytes).unwrap_or_default());
                Ok(())
            }
        }
    }
}

/// The digests a sink computes.
// One per item, on the stack for one pass over its bytes: boxing the larger
// variant would only add an allocation per item.
#[allow(clippy::large_enum_variant)]
enum Digests {
    /// The fingerprint alone.
    Fingerprint(KeyedXxh3),
    /// The fingerprint and the check digest, from one read of each stripe.
    WithCheck(KeyedXxh3<2>),
}

/// Where a [`DigestSink`] was, to roll an optimistically hashed piece back.
enum Mark {
    Fingerprint(State<1>),
    WithCheck(State<2>),
}

/// Feeds every piece to the fingerprint, the optional check digest and the
/// optional retained copy, in the same pass.
struct DigestSink<'r> {
    digests: Digests,
    retained: Option<&'r mut [u8]>,
    written: usize,
}

impl ByteSink for DigestSink<'_> {
    fn consume(&mut self, bytes: &[u8]) {
        match &mut self.digests {
            Digests::Fingerprint(fingerprint) => fingerprint.update(bytes),
            Digests::WithCheck(both) => both.update(bytes),
        }
        if let Some(dst) = self.retained.as_deref_mut() {
            let end = self.written + bytes.len();
            debug_assert!(end <= dst.len(), "retained buffer sized from the canonical length");
            if let Some(slot) = dst.get_mut(self.written..end) {
                slot.copy_from_slice(bytes);
            }
        }
        self.written += bytes.len();
    }

    type Mark = (Mark, usize);

    fn mark(&self) -> Self::Mark {
        let digests = match &self.digests {
            Digests::Fingerprint(fingerprint) => Mark::Fingerprint(fingerprint.checkpoint()),
            Digests::WithCheck(both) => Mark::WithCheck(both.checkpoint()),
        };
        (digests, self.written)
    }

    /// The retained copy needs no undo: what follows overwrites it from `written`.
    fn rollback(&mut self, (digests, written): Self::Mark) {
        match (&mut self.digests, digests) {
            (Digests::Fingerprint(fingerprint), Mark::Fingerprint(state)) => fingerprint.rollback(state),
            (Digests::WithCheck(both), Mark::WithCheck(state)) => both.rollback(state),
            _ => debug_assert!(false, "a mark of another sink"),
        }
        self.written = written;
    }
}

impl DigestSink<'_> {
    fn finish(&self) -> (u128, Option<u128>) {
        match &self.digests {
            Digests::Fingerprint(fingerprint) => (fingerprint.digest128(), None),
            Digests::WithCheck(both) => {
                let [fingerprint, check] = both.digests();
                (fingerprint, Some(check))
            }
        }
    }
}

impl Fingerprinter {
    /// A fingerprinter hashing with `key` on `threads` threads (0 is taken as
    /// 1), producing the validation material `policy` needs.
    pub fn new(key: FingerprintKey, threads: usize, policy: ValidationPolicy) -> Result<Self> {
        let threads = threads.max(1);
        let pool = if threads > 1 { Some(shared_pool(threads)?) } else { None };
        Ok(Fingerprinter {
            fingerprint_secret: key.fingerprint_secret(),
            check_secret: key.check_secret(),
            key,
            policy,
            threads,
            pool,
        })
    }

    /// The key (to persist next to an index built with it).
    pub fn key(&self) -> &FingerprintKey {
        &self.key
    }

    /// Which validation material [`Fingerprinter::identify`] produces.
    pub fn policy(&self) -> ValidationPolicy {
        self.policy
    }

    /// Threads used for tree leaves.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Validates `item` (layout vs modality, token count, shape vs layout,
    /// finite floats, non-empty) and computes its identity in one pass over
    /// its bytes. `item_index` is the item's position in the request, named
    /// in errors.
    pub fn identify(&self, item_index: usize, item: &ItemSpec<'_>) -> Result<ItemIdentity> {
        let num_tokens = item.layout.checked_tokens(item_index, item.modality, LayoutRules::QWEN3_OMNI)?;
        let (content, content_bytes) = match &item.content {
            ItemContent::Tensor(view) => {
                check_shape(item_index, item.modality, &item.layout, view)?;
                // Broadcast (stride-0) views can be logically larger than memory.
                let bytes =
                    view.len().checked_mul(view.dtype().size_bytes()).ok_or(RequestError::ItemTooLarge {
                        item: item_index,
                        elements: view.len(),
                        element_bytes: view.dtype().size_bytes(),
                    })?;
                (Content::Tensor(view), bytes)
            }
            ItemContent::Encoded { bytes: [], .. } => {
                return Err(
                    RequestError::EmptyItem { item: item_index, what: "encoded item with no bytes" }.into()
                );
            }
            ItemContent::Encoded { bytes, .. } => (Content::Encoded(bytes), bytes.len()),
        };
        let header = encode_header(item, num_tokens, content_bytes);
        let mut retained: Option<Arc<[u8]>> = (self.policy == ValidationPolicy::ExactBytes)
            .then(|| std::iter::repeat_n(0u8, header.len() + content_bytes).collect());
        // Freshly allocated and not yet shared, so `get_mut` succeeds.
        let retained_bytes = retained.as_mut().and_then(Arc::get_mut);
        let (fingerprint, check) =
            self.digest(item_index, &header, content, content_bytes, retained_bytes)?;
        // The sink computes a check exactly under `SecondDigest`, and `retained`
        // exists exactly under `ExactBytes`, so each arm has its material.
        let evidence = match self.policy {
            ValidationPolicy::Unvalidated => Evidence::Unvalidated,
            ValidationPolicy::SecondDigest => {
                Evidence::SecondDigest(Fingerprint(check.expect("a SecondDigest sink computes the check")))
            }
            ValidationPolicy::ExactBytes => {
                Evidence::ExactBytes(retained.expect("ExactBytes allocates the retained copy"))
            }
        };
        Ok(ItemIdentity {
            fingerprint: Fingerprint(fingerprint),
            evidence,
            modality: item.modality,
            layout: item.layout,
            num_tokens,
            content_bytes,
        })
    }

    fn sink<'r>(&self, retained: Option<&'r mut [u8]>) -> DigestSink<'r> {
        let digests = if self.policy == ValidationPolicy::SecondDigest {
            Digests::WithCheck(KeyedXxh3::with_secrets([self.fingerprint_secret, self.check_secret]))
        } else {
            Digests::Fingerprint(KeyedXxh3::new(self.fingerprint_secret))
        };
        DigestSink { digests, retained, written: 0 }
    }

    /// Flat digest of header + content, or a tree above [`TREE_THRESHOLD`].
    fn digest(
        &self, item: usize, header: &[u8], content: Content<'_, '_>, content_bytes: usize,
        retained: Option<&mut [u8]>,
    ) -> Result<(u128, Option<u128>)> {
        if content_bytes <= TREE_THRESHOLD {
            let mut sink = self.sink(retained);
            sink.consume(header);
            content.emit(item, 0..content_bytes, &mut sink)?;
            return Ok(sink.finish());
        }
        let retained_content = retained.map(|all| {
            let (head, rest) = all.split_at_mut(header.len());
            head.copy_from_slice(header);
            rest
        });
        let leaves = self.leaves(item, content, content_bytes, retained_content)?;
        // Each root hashes the header, the tag, the leaf count and its own leaf digests.
        let root = |secret, digests: &mut dyn Iterator<Item = u128>| {
            let mut root = KeyedXxh3::new(secret);
            root.update(header);
            root.update(TREE_TAG);
            root.update(&(leaves.len() as u64).to_le_bytes());
            for digest in digests {
                root.update(&digest.to_le_bytes());
            }
            root.digest128()
        };
        let fingerprint =
            root(self.fingerprint_secret, &mut leaves.iter().map(|(fingerprint, _)| *fingerprint));
        let check = (self.policy == ValidationPolicy::SecondDigest)
            .then(|| root(self.check_secret, &mut leaves.iter().map(|(_, check)| check.unwrap_or_default())));
        Ok((fingerprint, check))
    }

    /// Digests of the fixed-size leaves, in order; the first error in content
    /// order wins, so a NaN is reported at its smallest index on any thread count.
    fn leaves(
        &self, item: usize, content: Content<'_, '_>, content_bytes: usize, retained: Option<&mut [u8]>,
    ) -> Result<Vec<(u128, Option<u128>)>> {
        let count = content_bytes.div_ceil(TREE_CHUNK);
        let regions: Vec<Option<&mut [u8]>> = match retained {
            Some(all) => all.chunks_mut(TREE_CHUNK).map(Some).collect(),
            None => (0..count).map(|_| None).collect(),
        };
        let leaf = |(i, region): (usize, Option<&mut [u8]>)| {
            let start = i * TREE_CHUNK;
            let mut sink = self.sink(region);
            content.emit(item, start..(start + TREE_CHUNK).min(content_bytes), &mut sink)?;
            Ok(sink.finish())
        };
        let results: Vec<Result<(u128, Option<u128>)>> = match &self.pool {
            Some(pool) => pool.install(|| regions.into_par_iter().enumerate().map(leaf).collect()),
            None => regions.into_iter().enumerate().map(leaf).collect(),
        };
        results.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canon::{ItemLayout, Modality, ProcessorParams};
    use crate::error::TestResult;
    use ndarray::{ArrayD, IxDyn};
    use rand::{Rng, SeedableRng};
    use xxhash_rust::xxh3::xxh3_128_with_secret;

    fn fingerprinter(threads: usize, policy: ValidationPolicy) -> Result<Fingerprinter> {
        Fingerprinter::new(FingerprintKey::fixed(42), threads, policy)
    }

    /// Fingerprinters of one size share the process's pool, so making one per call
    /// (as `vllm_uuids` does) spawns no threads after the first.
    #[test]
    fn fingerprinters_of_one_size_share_one_pool() -> TestResult {
        let first = fingerprinter(3, ValidationPolicy::Unvalidated)?;
        let second = Fingerprinter::new(FingerprintKey::fixed(7), 3, ValidationPolicy::SecondDigest)?;
        let (Some(a), Some(b)) = (&first.pool, &second.pool) else {
            return Err("3 threads make a pool".into());
        };
        assert!(Arc::ptr_eq(a, b), "a second fingerprinter of 3 threads built its own pool");
        let other = fingerprinter(2, ValidationPolicy::Unvalidated)?;
        assert!(other.pool.as_ref().is_some_and(|c| !Arc::ptr_eq(a, c) && c.current_num_threads() == 2));
        assert!(fingerprinter(1, ValidationPolicy::Unvalidated)?.pool.is_none());
        Ok(())
    }

    fn image<'a>(view: TensorView<'a>, grid_thw: [u32; 3]) -> ItemSpec<'a> {
        ItemSpec {
            modality: Modality::Image,
            layout: ItemLayout::Image { grid_thw },
            content: ItemContent::Tensor(view),
            params: ProcessorParams::new(),
        }
    }

    fn noise_u8(len: usize, seed: u64) -> Vec<u8> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..len).map(|_| rng.random()).collect()
    }

    /// A copy of `base` changed by `f`.
    fn tweak<'a>(base: &ItemSpec<'a>, f: impl FnOnce(&mut ItemSpec<'a>)) -> ItemSpec<'a> {
        let mut spec = base.clone();
        f(&mut spec);
        spec
    }

    fn fp_of(fp: &Fingerprinter, item: &ItemSpec<'_>) -> Result<Fingerprint> {
        Ok(fp.identify(0, item)?.fingerprint)
    }

    #[test]
    fn the_read_floor_sums_every_word_at_any_offset_and_length() {
        let bytes = noise_u8(1000, 3);
        for start in 0..9 {
            for len in (0..300).chain([600, 991]) {
                let piece = &bytes[start..start + len];
                let (head, words, tail) = bytemuck::pod_align_to::<u8, u64>(piece);
                let want = head
                    .iter()
                    .chain(tail)
                    .map(|&b| u64::from(b))
                    .chain(words.iter().map(|&w| u64::from_le(w)))
                    .fold(0u64, u64::wrapping_add);
                assert_eq!(read_floor(piece), want, "{len} bytes from {start}");
            }
        }
    }

    #[test]
    fn flat_digest_is_xxh3_of_retained_header_and_bytes() -> TestResult {
        let a = ArrayD::from_shape_fn(IxDyn(&[16, 6]), |ix| ix[0] as f32 - ix[1] as f32 * 0.5);
        let item = image(TensorView::F32(a.view()), [1, 4, 4]);
        let exact = fingerprinter(1, ValidationPolicy::ExactBytes)?.identify(3, &item)?;
        let retained = exact.evidence.retained().cloned().ok_or("no retained bytes")?;
        let header = encode_header(&item, 4, 16 * 6 * 4);
        assert_eq!(&retained[..header.len()], &header[..]);
        let body: Vec<u8> = a.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(&retained[header.len()..], &body[..]);
        let key = FingerprintKey::fixed(42);
        assert_eq!(exact.fingerprint.0, xxh3_128_with_secret(&retained, &key.fingerprint_secret()));
        assert_eq!((exact.evidence.check(), exact.num_tokens, exact.content_bytes), (None, 4, 384));
        let second = fingerprinter(1, ValidationPolicy::SecondDigest)?.identify(3, &item)?;
        assert_eq!(second.fingerprint, exact.fingerprint);
        assert_eq!(
            second.evidence,
            Evidence::SecondDigest(Fingerprint(xxh3_128_with_secret(&retained, &key.check_secret())))
        );
        let bare = fingerprinter(1, ValidationPolicy::Unvalidated)?.identify(3, &item)?;
        assert_eq!(bare.evidence, Evidence::Unvalidated);
        assert_eq!(bare.fingerprint, exact.fingerprint);
        Ok(())
    }

    #[test]
    fn fixed_key_reproduces_a_reference_vector() -> TestResult {
        let a = ArrayD::from_shape_vec(IxDyn(&[2, 2, 3]), (0u8..12).collect())?;
        let fp = fp_of(
            &fingerprinter(1, ValidationPolicy::Unvalidated)?,
            &image(TensorView::U8(a.view()), [1, 2, 2]),
        )?;
        assert_eq!(format!("{:032x}", fp.0), REFERENCE_FP);
        Ok(())
    }
    /// Pinned so that any change to the header, stream or key derivation is deliberate.
    const REFERENCE_FP: &str = "dd96ca270db5ec061a91e816c5c3c7f8";

    #[test]
    fn keys_separate_fingerprints() -> Result<()> {
        let a = ArrayD::<u8>::ones(IxDyn(&[8, 8, 3]));
        let item = image(TensorView::U8(a.view()), [1, 2, 2]);
        let fixed = fp_of(&fingerprinter(1, ValidationPolicy::Unvalidated)?, &item)?;
        let again =
            fp_of(&Fingerprinter::new(FingerprintKey::fixed(42), 2, ValidationPolicy::ExactBytes)?, &item)?;
        let other =
            fp_of(&Fingerprinter::new(FingerprintKey::fixed(43), 1, ValidationPolicy::Unvalidated)?, &item)?;
        let random =
            fp_of(&Fingerprinter::new(FingerprintKey::random(), 1, ValidationPolicy::Unvalidated)?, &item)?;
        assert_eq!(fixed, again);
        assert_ne!(fixed, other);
        assert_ne!(fixed, random);
        Ok(())
    }

    #[test]
    fn negative_zero_equals_positive_zero() -> Result<()> {
        let fp = fingerprinter(1, ValidationPolicy::SecondDigest)?;
        let pos = ArrayD::from_elem(IxDyn(&[4, 3]), 0.0f32);
        let mut neg = pos.clone();
        neg[[1, 2]] = -0.0;
        let a = fp.identify(0, &image(TensorView::F32(pos.view()), [1, 2, 2]))?;
        let b = fp.identify(0, &image(TensorView::F32(neg.view()), [1, 2, 2]))?;
        assert_eq!((a.fingerprint, &a.evidence), (b.fingerprint, &b.evidence));
        Ok(())
    }

    /// Floats are hashed in place before they are checked; a piece that holds
    /// a `-0.0` is rolled back and folded, on every policy and both paths.
    #[test]
    fn a_folded_piece_after_clean_ones_hashes_as_its_canonical_copy() -> Result<()> {
        let per_piece = super::super::STAGING_BYTES / 4;
        for len in [3 * per_piece + 17, TREE_THRESHOLD / 4 + 5] {
            let folded = ArrayD::from_shape_fn(IxDyn(&[len]), |ix| {
                if ix[0] % 1000 == 999 { 0.0 } else { ix[0] as f32 * 0.5 }
            });
            let mut signed = folded.clone();
            for at in [per_piece + 999 - per_piece % 1000, len - len % 1000 - 1] {
                signed[[at]] = -0.0;
            }
            for policy in
                [ValidationPolicy::SecondDigest, ValidationPolicy::ExactBytes, ValidationPolicy::Unvalidated]
            {
                let fp = fingerprinter(1, policy)?;
                let a = fp.identify(0, &image(TensorView::F32(signed.view()), [1, 2, 2]))?;
                let b = fp.identify(0, &image(TensorView::F32(folded.view()), [1, 2, 2]))?;
                assert_eq!(
                    (a.fingerprint, &a.evidence),
                    (b.fingerprint, &b.evidence),
                    "{policy:?}, {len} floats"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn every_dtype_fingerprints_and_dtype_is_in_the_header() -> Result<()> {
        let fp = fingerprinter(1, ValidationPolicy::Unvalidated)?;
        let bits = ArrayD::from_elem(IxDyn(&[4, 2]), 0x3f80_0000u32);
        let as_i32 = bits.mapv(|b| b as i32);
        let as_f32 = bits.mapv(f32::from_bits);
        let pairs = bits.mapv(|b| (b >> 16) as u16);
        let as_f16 = pairs.mapv(half::f16::from_bits);
        let as_bf16 = pairs.mapv(half::bf16::from_bits);
        let as_u8 = ArrayD::from_elem(IxDyn(&[4, 8]), 0u8);
        let as_i64 = ArrayD::from_elem(IxDyn(&[4, 1]), 0i64);
        let views = [
            TensorView::U8(as_u8.view()),
            TensorView::I32(as_i32.view()),
            TensorView::I64(as_i64.view()),
            TensorView::F16(as_f16.view()),
            TensorView::BF16(as_bf16.view()),
            TensorView::F32(as_f32.view()),
        ];
        let mut seen = Vec::new();
        for view in views {
            // Raw (non-2-D-float) content of every dtype is accepted; 2-D floats are patch rows.
            let grid = if view.shape()[0] == 4 { [1, 2, 2] } else { [1, 1, 4] };
            let id = fp.identify(0, &image(view.clone(), grid))?;
            assert_eq!(id.content_bytes, view.canonical_len());
            assert!(!seen.contains(&id.fingerprint), "{:?} collides", view.dtype());
            seen.push(id.fingerprint);
        }
        // f16 and bf16 with identical bits, i32 and f32 with identical bits: still distinct.
        assert_eq!(seen.len(), 6);
        Ok(())
    }

    #[test]
    fn every_header_field_changes_the_fingerprint() -> Result<()> {
        let fp = fingerprinter(1, ValidationPolicy::Unvalidated)?;
        let raw = ArrayD::<u8>::from_elem(IxDyn(&[4, 6, 3]), 9);
        let flipped = ArrayD::<u8>::from_elem(IxDyn(&[6, 4, 3]), 9);
        let wave = ArrayD::<f32>::from_elem(IxDyn(&[16_000]), 0.25);
        let base = image(TensorView::U8(raw.view()), [1, 4, 4]);
        let param = |k: &str, v: &str| ProcessorParams::from([(k.to_string(), v.to_string())]);
        let video = |thw: [u32; 3], s: f32| ItemLayout::Video { grid_thw: thw, seconds_per_grid: s };
        let variants = [
            fp_of(&fp, &base)?,
            fp_of(&fp, &tweak(&base, |s| s.content = ItemContent::Tensor(TensorView::U8(flipped.view()))))?, // shape
            fp_of(&fp, &tweak(&base, |s| s.layout = ItemLayout::Image { grid_thw: [2, 4, 4] }))?, // grid t
            fp_of(&fp, &tweak(&base, |s| s.layout = ItemLayout::Image { grid_thw: [1, 2, 8] }))?, // grid h
            fp_of(&fp, &tweak(&base, |s| s.layout = ItemLayout::Image { grid_thw: [1, 4, 8] }))?, // grid w
            fp_of(
                &fp,
                &tweak(&base, |s| {
                    s.modality = Modality::Video;
                    s.layout = video([1, 4, 4], 2.0);
                }),
            )?, // modality + layout kind
            fp_of(
                &fp,
                &tweak(&base, |s| {
                    s.modality = Modality::Video;
                    s.layout = video([1, 4, 4], 0.5);
                }),
            )?, // seconds per grid
            fp_of(&fp, &tweak(&base, |s| s.params = param("max_pixels", "1003520")))?,
            fp_of(&fp, &tweak(&base, |s| s.params = param("max_pixels", "1003521")))?, // param value
            fp_of(&fp, &tweak(&base, |s| s.params = param("max_pixelsx", "003521")))?, // key/value boundary
            fp_of(&fp, &tweak(&base, |s| s.params = param("min_pixels", "1003520")))?, // param key
            fp_of(
                &fp,
                &tweak(&base, |s| {
                    s.modality = Modality::Audio;
                    s.layout = ItemLayout::Audio { mel_frames: 100 };
                    s.content = ItemContent::Tensor(TensorView::F32(wave.view()));
                }),
            )?,
            fp_of(
                &fp,
                &tweak(&base, |s| {
                    s.modality = Modality::Audio;
                    s.layout = ItemLayout::Audio { mel_frames: 101 };
                    s.content = ItemContent::Tensor(TensorView::F32(wave.view()));
                }),
            )?, // mel frames
        ];
        for (i, a) in variants.iter().enumerate() {
            for (j, b) in variants.iter().enumerate().skip(i + 1) {
                assert_ne!(a, b, "variants {i} and {j} collide");
            }
        }
        Ok(())
    }

    #[test]
    fn strided_item_equals_its_standard_copy_on_both_paths() -> Result<()> {
        let fp = fingerprinter(2, ValidationPolicy::SecondDigest)?;
        for (t, h) in [(4, 64), (40, 200)] {
            // (40, 200, 160) f32 = 5.1 MB: above the tree threshold.
            let frames = ArrayD::from_shape_fn(IxDyn(&[t, h, 160]), |ix| {
                (ix[0] * 7 + ix[1] * 3 + ix[2]) as f32 * 0.125
            });
            let view = frames.view().permuted_axes(IxDyn(&[2, 0, 1]));
            let copy = view.as_standard_layout().to_owned();
            let layout = ItemLayout::Video { grid_thw: [2, 2, 2], seconds_per_grid: 1.0 };
            let spec = |v| ItemSpec {
                modality: Modality::Video,
                layout,
                content: ItemContent::Tensor(v),
                params: ProcessorParams::new(),
            };
            let a = fp.identify(0, &spec(TensorView::F32(view.clone())))?;
            let b = fp.identify(0, &spec(TensorView::F32(copy.view())))?;
            assert_eq!((a.fingerprint, &a.evidence), (b.fingerprint, &b.evidence));
        }
        Ok(())
    }

    #[test]
    fn broadcast_view_equals_its_materialised_copy() -> TestResult {
        let fp = fingerprinter(1, ValidationPolicy::SecondDigest)?;
        let row = ArrayD::from_shape_fn(IxDyn(&[1, 7, 3]), |ix| (ix[1] * 3 + ix[2]) as u8);
        let wide = row.broadcast(IxDyn(&[9, 7, 3])).ok_or("broadcast")?;
        let copy = wide.to_owned();
        let a = fp.identify(0, &image(TensorView::U8(wide), [1, 2, 2]))?;
        let b = fp.identify(0, &image(TensorView::U8(copy.view()), [1, 2, 2]))?;
        assert_eq!((a.fingerprint, &a.evidence, a.content_bytes), (b.fingerprint, &b.evidence, 189));
        Ok(())
    }

    #[test]
    fn thread_count_never_changes_the_identity() -> TestResult {
        let bytes = noise_u8(5 * TREE_CHUNK + 12_345, 7);
        let frames =
            ArrayD::from_shape_vec(IxDyn(&[bytes.len() / 3, 3]), bytes[..bytes.len() / 3 * 3].to_vec())?;
        let item = image(TensorView::U8(frames.view()), [1, 2, 2]);
        let ids = [1, 2, 3]
            .into_iter()
            .map(|threads| fingerprinter(threads, ValidationPolicy::ExactBytes)?.identify(0, &item))
            .collect::<Result<Vec<_>>>()?;
        for id in &ids[1..] {
            assert_eq!(id.fingerprint, ids[0].fingerprint);
            assert_eq!(id.evidence, ids[0].evidence);
        }
        let checks = [1, 3]
            .into_iter()
            .map(|threads| fingerprinter(threads, ValidationPolicy::SecondDigest)?.identify(0, &item))
            .collect::<Result<Vec<_>>>()?;
        assert_eq!(checks[0].evidence, checks[1].evidence);
        assert_eq!(checks[0].fingerprint, ids[0].fingerprint);
        // The retained copy is still header + canonical bytes on the tree path.
        let retained = ids[0].evidence.retained().cloned().ok_or("no retained bytes")?;
        assert_eq!(&retained[retained.len() - frames.len()..], frames.as_slice().unwrap_or_default());
        Ok(())
    }

    #[test]
    fn tree_root_hashes_ordered_leaf_digests() -> Result<()> {
        let bytes = noise_u8(TREE_THRESHOLD + 1, 3);
        let fp = fingerprinter(1, ValidationPolicy::Unvalidated)?;
        let id = fp.identify(
            0,
            &ItemSpec {
                modality: Modality::Image,
                layout: ItemLayout::Image { grid_thw: [1, 2, 2] },
                content: ItemContent::Encoded { bytes: &bytes, format: "jpeg" },
                params: ProcessorParams::new(),
            },
        )?;
        let secret = FingerprintKey::fixed(42).fingerprint_secret();
        let header = encode_header(
            &ItemSpec {
                modality: Modality::Image,
                layout: ItemLayout::Image { grid_thw: [1, 2, 2] },
                content: ItemContent::Encoded { bytes: &bytes, format: "jpeg" },
                params: ProcessorParams::new(),
            },
            1,
            bytes.len(),
        );
        let mut root = header;
        root.extend_from_slice(TREE_TAG);
        root.extend_from_slice(&5u64.to_le_bytes());
        for chunk in bytes.chunks(TREE_CHUNK) {
            root.extend_from_slice(&xxh3_128_with_secret(chunk, &secret).to_le_bytes());
        }
        assert_eq!(id.fingerprint.0, xxh3_128_with_secret(&root, &secret));
        Ok(())
    }

    #[test]
    fn non_finite_is_reported_at_its_smallest_index_on_any_thread_count() -> Result<()> {
        let mut a = ArrayD::from_elem(IxDyn(&[TREE_THRESHOLD / 2 + 3]), half::f16::ONE);
        let late = a.len() - 2;
        a[[late]] = half::f16::NAN;
        a[[TREE_CHUNK / 2 + 17]] = half::f16::INFINITY;
        for threads in [1, 3] {
            let err = fingerprinter(threads, ValidationPolicy::ExactBytes)?
                .identify(2, &image(TensorView::F16(a.view()), [1, 2, 2]));
            assert!(
                matches!(err, Err(Error::Request(RequestError::NonFinite { item: 2, index })) if index == TREE_CHUNK / 2 + 17),
                "{err:?}"
            );
        }
        let small = ArrayD::from_shape_fn(IxDyn(&[2, 4]), |ix| {
            if ix[0] == 1 && ix[1] == 1 { f32::NEG_INFINITY } else { 1.0 }
        });
        let err = fingerprinter(1, ValidationPolicy::SecondDigest)?
            .identify(0, &image(TensorView::F32(small.t()), [1, 2, 2]));
        assert!(matches!(err, Err(Error::Request(RequestError::NonFinite { item: 0, index: 3 }))), "{err:?}");
        Ok(())
    }

    #[test]
    fn empty_and_inconsistent_items_are_typed_errors() -> Result<()> {
        let fp = fingerprinter(1, ValidationPolicy::SecondDigest)?;
        let empty = ArrayD::<u8>::zeros(IxDyn(&[3, 0, 3]));
        assert!(matches!(
            fp.identify(4, &image(TensorView::U8(empty.view()), [1, 2, 2])),
            Err(Error::Request(RequestError::EmptyItem { item: 4, .. }))
        ));
        let no_bytes = ItemSpec {
            content: ItemContent::Encoded { bytes: &[], format: "png" },
            ..image(TensorView::U8(empty.view()), [1, 2, 2])
        };
        assert!(matches!(
            fp.identify(1, &no_bytes),
            Err(Error::Request(RequestError::EmptyItem { item: 1, .. }))
        ));
        let pixels = ArrayD::<u8>::zeros(IxDyn(&[2, 2, 3]));
        let audio_layout = ItemSpec {
            layout: ItemLayout::Audio { mel_frames: 100 },
            ..image(TensorView::U8(pixels.view()), [1, 2, 2])
        };
        assert!(matches!(
            fp.identify(0, &audio_layout),
            Err(Error::Request(RequestError::InvalidLayout { field: "kind", .. }))
        ));
        assert!(matches!(
            fp.identify(0, &image(TensorView::U8(pixels.view()), [1, 3, 3])),
            Err(Error::Request(RequestError::GridNotMergeable { .. }))
        ));
        let patches = ArrayD::<f32>::zeros(IxDyn(&[15, 4]));
        assert!(matches!(
            fp.identify(6, &image(TensorView::F32(patches.view()), [1, 4, 4])),
            Err(Error::Request(RequestError::ShapeMismatch { item: 6, .. }))
        ));
        Ok(())
    }

    #[test]
    fn encoded_items_hash_format_and_bytes() -> TestResult {
        let fp = fingerprinter(1, ValidationPolicy::ExactBytes)?;
        let jpeg = noise_u8(10_000, 11);
        let spec = |bytes: &'static [u8], format: &'static str| ItemSpec {
            modality: Modality::Image,
            layout: ItemLayout::Image { grid_thw: [1, 4, 4] },
            content: ItemContent::Encoded { bytes, format },
            params: ProcessorParams::new(),
        };
        let leaked: &'static [u8] = Box::leak(jpeg.into_boxed_slice());
        let a = fp.identify(0, &spec(leaked, "jpeg"))?;
        assert_eq!(a.content_bytes, 10_000);
        let retained = a.evidence.retained().cloned().ok_or("no retained bytes")?;
        assert_eq!(&retained[retained.len() - leaked.len()..], leaked);
        assert_ne!(a.fingerprint, fp.identify(0, &spec(leaked, "png"))?.fingerprint);
        assert_ne!(a.fingerprint, fp.identify(0, &spec(&leaked[1..], "jpeg"))?.fingerprint);
        let decoded = ArrayD::from_shape_vec(IxDyn(&[10_000]), leaked.to_vec())?;
        assert_ne!(
            a.fingerprint,
            fp.identify(0, &image(TensorView::U8(decoded.view()), [1, 4, 4]))?.fingerprint
        );
        Ok(())
    }
}
