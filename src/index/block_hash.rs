//! Block hashes a router can compute: a 64-bit content chain over each full
//! KV block, keyed by the fleet's fingerprint key.
//!
//! These are the hashes the scheduler publishes in its KV events
//! ([`crate::events`]) and the ones a frontend computes for a request before it
//! picks a replica. They depend only on content (token ids, item fingerprints
//! and rows, the tenant salt) and on the 32-byte key the whole fleet shares, so
//! every replica and every frontend agrees without exchanging anything.
//!
//! Byte for byte (also in docs/scale-out.md, "Block hashes"):
//!
//! * `hash_key = BLAKE3.derive_key(context = "omniprefix 2026 kv block hash", key_material = fleet key)`.
//! * The message of block `i` (positions `i*bs .. (i+1)*bs`) starts with
//!   `0x00 ‖ tenant salt (u64 LE)` for `i = 0` and `0x01 ‖ parent hash (u64 LE)` otherwise,
//!   then lists the block's positions as maximal runs, in order:
//!   * text: `'T' ‖ n (u32 LE) ‖ n token ids (u32 LE each)`;
//!   * item rows: `'I' ‖ fingerprint (16 bytes, big-endian: the bytes of its 32-digit hex)
//!     ‖ first row (u32 LE) ‖ n rows (u32 LE)`.
//!
//!   A run is maximal: consecutive text positions form one run, and consecutive rows
//!   of one item form one run, however the prompt's atoms cut them.
//! * `hash = u64 LE of the first 8 bytes of BLAKE3.keyed_hash(hash_key, message)`.

use crate::canon::{Fingerprint, FingerprintKey};
use crate::prompt::{Atom, CanonicalPrompt};

/// Context string of the key derivation (domain separation from the fingerprints).
const HASH_KEY_CONTEXT: &str = "omniprefix 2026 kv block hash";

/// One maximal run of a block's positions.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Run<'a> {
    Text(Vec<&'a [u32]>),
    Item { fingerprint: Fingerprint, first_row: u32, rows: u32 },
}

/// Computes block hashes under one fleet key.
///
/// ```
/// use omniprefix::canon::FingerprintKey;
/// use omniprefix::index::block_hash::FleetHasher;
/// use omniprefix::prompt::{OmniTokens, PromptBuilder};
///
/// let text = |n: u32| {
///     let mut b = PromptBuilder::new(OmniTokens::qwen3_omni()).with_tenant(7);
///     b.push_text(&(0..n).collect::<Vec<u32>>())?;
///     b.into_prompt()
/// };
/// let hasher = FleetHasher::new(&FingerprintKey::fixed(1));
/// let hashes = hasher.block_hashes(&text(40)?, 16);
/// assert_eq!(hashes.len(), 2); // full blocks only
/// // A longer prompt with the same start shares the chain.
/// assert_eq!(hasher.block_hashes(&text(48)?, 16)[..2], hashes[..]);
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Clone)]
pub struct FleetHasher {
    key: [u8; 32],
}

impl std::fmt::Debug for FleetHasher {
    /// Never prints the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FleetHasher(..)")
    }
}

impl FleetHasher {
    /// A hasher under the fleet key `key` (the engines' fingerprint key).
    pub fn new(key: &FingerprintKey) -> Self {
        FleetHasher { key: blake3::derive_key(HASH_KEY_CONTEXT, key.as_bytes()) }
    }

    /// The hashes of every full block of `prompt`, in order.
    pub fn block_hashes(&self, prompt: &CanonicalPrompt, block_size: usize) -> Vec<u64> {
        let mut hashes = Vec::new();
        self.extend(prompt, block_size, prompt.len() / block_size.max(1), &mut hashes);
        hashes
    }

    /// Extends `hashes` (the chain of `prompt`'s first `hashes.len()` blocks) to
    /// its first `blocks` blocks; never past the prompt's full blocks.
    pub fn extend(&self, prompt: &CanonicalPrompt, block_size: usize, blocks: usize, hashes: &mut Vec<u64>) {
        if block_size == 0 {
            return;
        }
        let blocks = blocks.min(prompt.len() / block_size);
        let mut message = Vec::with_capacity(16 + 5 * block_size);
        for i in hashes.len()..blocks {
            message.clear();
            match i.checked_sub(1).and_then(|p| hashes.get(p)) {
                None => {
                    message.push(0);
                    message.extend_from_slice(&prompt.tenant.to_le_bytes());
                }
                Some(parent) => {
                    message.push(1);
                    message.extend_from_slice(&parent.to_le_bytes());
                }
            }
            for run in block_runs(prompt, i * block_size..(i + 1) * block_size) {
                encode_run(&run, &mut message);
            }
            let digest = blake3::keyed_hash(&self.key, &message);
            let mut first = [0u8; 8];
            first.copy_from_slice(&digest.as_bytes()[..8]);
            hashes.push(u64::from_le_bytes(first));
        }
    }
}

/// The item rows of `prompt`'s positions `range`, as (fingerprint, first row)
/// per maximal item run: a block's `extra_keys` in a KV event.
pub fn item_runs(prompt: &CanonicalPrompt, range: std::ops::Range<usize>) -> Vec<(Fingerprint, u32)> {
    block_runs(prompt, range)
        .into_iter()
        .filter_map(|run| match run {
            Run::Item { fingerprint, first_row, .. } => Some((fingerprint, first_row)),
            Run::Text(_) => None,
        })
        .collect()
}

/// The maximal runs of `prompt`'s positions `range`.
fn block_runs(prompt: &CanonicalPrompt, range: std::ops::Range<usize>) -> Vec<Run<'_>> {
    let mut runs: Vec<Run<'_>> = Vec::new();
    let mut start = 0;
    for atom in &prompt.atoms {
        let end = start + atom.len();
        let (lo, hi) = (start.max(range.start), end.min(range.end));
        if lo < hi {
            let (a, b) = (lo - start, hi - start);
            match (atom, runs.last_mut()) {
                (Atom::Text(ids), Some(Run::Text(pieces))) => pieces.push(&ids[a..b]),
                (Atom::Text(ids), _) => runs.push(Run::Text(vec![&ids[a..b]])),
                (Atom::Item { id, rows }, last) => {
                    let first_row = rows.start + a as u32;
                    let n = (b - a) as u32;
                    match last {
                        Some(Run::Item { fingerprint, first_row: f, rows: r })
                            if *fingerprint == id.fingerprint && *f + *r == first_row =>
                        {
                            *r += n;
                        }
                        _ => runs.push(Run::Item { fingerprint: id.fingerprint, first_row, rows: n }),
                    }
                }
            }
        }
        if end >= range.end {
            break;
        }
        start = end;
    }
    runs
}

fn encode_run(run: &Run<'_>, out: &mut Vec<u8>) {
    match run {
        Run::Text(pieces) => {
            let n: usize = pieces.iter().map(|p| p.len()).sum();
            out.push(b'T');
            out.extend_from_slice(&(n as u32).to_le_bytes());
            for &id in pieces.iter().flat_map(|p| p.iter()) {
                out.extend_from_slice(&id.to_le_bytes());
            }
        }
        Run::Item { fingerprint, first_row, rows } => {
            out.push(b'I');
            out.extend_from_slice(&fingerprint.0.to_be_bytes());
            out.extend_from_slice(&first_row.to_le_bytes());
            out.extend_from_slice(&rows.to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::canon::{Evidence, ItemIdentity, ItemLayout, Modality};
    use crate::prompt::{IndexMap, Positions};

    fn item(fp: u128, rows: usize) -> Arc<ItemIdentity> {
        Arc::new(ItemIdentity {
            fingerprint: Fingerprint(fp),
            evidence: Evidence::Unvalidated,
            modality: Modality::Image,
            layout: ItemLayout::Image { grid_thw: [1, 2, rows as u32 * 2] },
            num_tokens: rows,
            content_bytes: 0,
        })
    }

    fn prompt(tenant: u64, atoms: Vec<Atom>) -> CanonicalPrompt {
        let len: usize = atoms.iter().map(Atom::len).sum();
        CanonicalPrompt {
            tenant,
            token_ids: vec![5; len],
            atoms,
            items: vec![],
            index_map: IndexMap::default(),
            positions: Positions::linear(len),
        }
    }

    /// The message of block 0 written out by hand: the byte layout docs/scale-out.md documents.
    #[test]
    fn first_block_message_is_the_documented_bytes() {
        let key = FingerprintKey::fixed(3);
        let img = item(0x0123_4567_89ab_cdef_0011_2233_4455_6677, 8);
        let p = prompt(9, vec![Atom::Text(vec![1, 2]), Atom::Item { id: img, rows: 0..2 }]);
        let mut message = vec![0u8];
        message.extend_from_slice(&9u64.to_le_bytes());
        message.push(b'T');
        message.extend_from_slice(&2u32.to_le_bytes());
        message.extend_from_slice(&1u32.to_le_bytes());
        message.extend_from_slice(&2u32.to_le_bytes());
        message.push(b'I');
        message.extend_from_slice(&hex::decode("0123456789abcdef0011223344556677").unwrap());
        message.extend_from_slice(&0u32.to_le_bytes());
        message.extend_from_slice(&2u32.to_le_bytes());
        let hash_key = blake3::derive_key("omniprefix 2026 kv block hash", key.as_bytes());
        let digest = blake3::keyed_hash(&hash_key, &message);
        let want = u64::from_le_bytes(digest.as_bytes()[..8].try_into().unwrap());
        assert_eq!(FleetHasher::new(&key).block_hashes(&p, 4), vec![want]);
    }

    #[test]
    fn runs_are_maximal_however_atoms_cut_them() {
        let h = FleetHasher::new(&FingerprintKey::fixed(1));
        let img = item(77, 8);
        let whole = prompt(
            0,
            vec![
                Atom::Text(vec![1, 2, 3]),
                Atom::Item { id: img.clone(), rows: 0..8 },
                Atom::Text(vec![4; 5]),
            ],
        );
        let cut = prompt(
            0,
            vec![
                Atom::Text(vec![1]),
                Atom::Text(vec![2, 3]),
                Atom::Item { id: img.clone(), rows: 0..3 },
                Atom::Item { id: img, rows: 3..8 },
                Atom::Text(vec![4; 2]),
                Atom::Text(vec![4; 3]),
            ],
        );
        assert_eq!(h.block_hashes(&whole, 4), h.block_hashes(&cut, 4));
        assert_eq!(h.block_hashes(&whole, 4).len(), 4);
    }

    #[test]
    fn hashes_depend_on_content_tenant_key_and_parent() {
        let key = FingerprintKey::fixed(1);
        let h = FleetHasher::new(&key);
        let text = |tenant, ids: Vec<u32>| prompt(tenant, vec![Atom::Text(ids)]);
        let base = h.block_hashes(&text(0, (0..8).collect()), 4);
        assert_ne!(base[0], base[1]);
        // Other tenant: every block differs (the salt is in the chain's root).
        let other = h.block_hashes(&text(1, (0..8).collect()), 4);
        assert!(base.iter().zip(&other).all(|(a, b)| a != b));
        // Other fleet key.
        let keyed = FleetHasher::new(&FingerprintKey::fixed(2)).block_hashes(&text(0, (0..8).collect()), 4);
        assert!(base.iter().zip(&keyed).all(|(a, b)| a != b));
        // Same second block, other first block: the parent changes the second hash.
        let mut ids: Vec<u32> = (0..8).collect();
        ids[0] = 99;
        assert_ne!(h.block_hashes(&text(0, ids), 4)[1], base[1]);
        // Different images under the same placeholder ids differ; the same image twice agrees.
        let a = prompt(0, vec![Atom::Item { id: item(1, 4), rows: 0..4 }]);
        let b = prompt(0, vec![Atom::Item { id: item(2, 4), rows: 0..4 }]);
        assert_ne!(h.block_hashes(&a, 4), h.block_hashes(&b, 4));
        assert_eq!(h.block_hashes(&a, 4), h.block_hashes(&a.clone(), 4));
    }

    #[test]
    fn extend_continues_the_chain_and_item_runs_name_rows() {
        let h = FleetHasher::new(&FingerprintKey::fixed(1));
        let p = prompt(
            0,
            vec![Atom::Text(vec![1, 2]), Atom::Item { id: item(5, 8), rows: 0..8 }, Atom::Text(vec![3; 6])],
        );
        let all = h.block_hashes(&p, 4);
        let mut part = Vec::new();
        h.extend(&p, 4, 1, &mut part);
        h.extend(&p, 4, 99, &mut part);
        assert_eq!(part, all);
        assert_eq!(item_runs(&p, 0..4), vec![(Fingerprint(5), 0)]);
        assert_eq!(item_runs(&p, 4..8), vec![(Fingerprint(5), 2)]);
        assert_eq!(item_runs(&p, 12..16), vec![]);
    }
}
