//! Shared pieces of the index property suites: prompt builders over a tiny
//! vocabulary, item identities with an injectable weak fingerprint, and the
//! brute-force oracles (longest common prefix with any cached prompt, and a
//! ledger of which content each adopted block holds).

#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use omniprefix::canon::{Evidence, Fingerprint, ItemIdentity, ItemLayout, Modality, ValidationPolicy};
use omniprefix::index::{BlockId, PrefixMatch};
use omniprefix::prompt::{Atom, CanonicalPrompt, IndexMap, ItemSpan, Positions, TenantSalt};
use proptest::prelude::*;

/// Placeholder token id of item positions (Qwen image pad).
pub const PAD: u32 = 151_655;

/// What a position really holds: the ground truth the oracle compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Truth {
    Text(u32),
    Row { content: u32, row: u32 },
}

/// A generated prompt piece: a text run, or a whole item (optionally split
/// into two atoms at `split`, as interleaving does).
#[derive(Debug, Clone)]
pub enum Piece {
    Text(Vec<u32>),
    Item { content: u32, split: u32 },
}

/// How items are made: rows per item, how many low bits of the content id
/// the fingerprint keeps (`None`: a collision-free fingerprint), and the
/// policy whose evidence they carry (what a fingerprinter with that policy makes).
#[derive(Debug, Clone, Copy)]
pub struct ItemModel {
    pub rows: u32,
    pub fp_bits: Option<u32>,
    pub policy: ValidationPolicy,
}

impl ItemModel {
    /// The same items with the evidence of `policy`.
    pub const fn with_policy(self, policy: ValidationPolicy) -> Self {
        ItemModel { policy, ..self }
    }

    /// A fresh identity for `content`; its evidence (second digest or
    /// retained bytes) always comes from the true content, only the
    /// fingerprint may be weak.
    pub fn identity(&self, content: u32) -> Arc<ItemIdentity> {
        let fp = match self.fp_bits {
            Some(bits) => u128::from(content & ((1u32 << bits) - 1)),
            None => u128::from(content) | (1u128 << 100),
        };
        let bytes: Vec<u8> = (0..16u32).flat_map(|i| (content ^ (i * 0x9e37)).to_le_bytes()).collect();
        let evidence = match self.policy {
            ValidationPolicy::SecondDigest => Evidence::SecondDigest(Fingerprint(
                u128::from(content).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xabcd,
            )),
            ValidationPolicy::ExactBytes => Evidence::ExactBytes(Arc::from(bytes)),
            ValidationPolicy::Unvalidated => Evidence::Unvalidated,
        };
        Arc::new(ItemIdentity {
            fingerprint: Fingerprint(fp),
            evidence,
            modality: Modality::Image,
            layout: ItemLayout::Image { grid_thw: [1, 2, 2 * self.rows] },
            num_tokens: self.rows as usize,
            content_bytes: 64,
        })
    }

    /// A canonical prompt for `pieces` and the truth of every position.
    pub fn build(&self, tenant: TenantSalt, pieces: &[Piece]) -> (CanonicalPrompt, Vec<Truth>) {
        let mut atoms = Vec::new();
        let mut truth = Vec::new();
        let mut items: Vec<Arc<ItemIdentity>> = Vec::new();
        let mut index_map = IndexMap::default();
        for piece in pieces {
            match piece {
                Piece::Text(ids) => {
                    truth.extend(ids.iter().map(|&t| Truth::Text(t)));
                    atoms.push(Atom::Text(ids.clone()));
                }
                Piece::Item { content, split } => {
                    let id = self.identity(*content);
                    let item = items.len() as u32;
                    items.push(Arc::clone(&id));
                    let cut = split % self.rows;
                    let spans = if cut == 0 { [0..self.rows, 0..0] } else { [0..cut, cut..self.rows] };
                    for rows in spans.into_iter().filter(|r| !r.is_empty()) {
                        let start = truth.len() as u32;
                        index_map.placeholders.insert_range(start..start + rows.len() as u32);
                        index_map.spans.push(ItemSpan { item, rows: rows.clone(), start });
                        truth.extend(rows.clone().map(|row| Truth::Row { content: *content, row }));
                        atoms.push(Atom::Item { id: Arc::clone(&id), rows });
                    }
                }
            }
        }
        let token_ids = truth
            .iter()
            .map(|t| match t {
                Truth::Text(id) => *id,
                Truth::Row { .. } => PAD,
            })
            .collect();
        let positions = Positions::linear(truth.len());
        let prompt = CanonicalPrompt { tenant, atoms, token_ids, items, index_map, positions };
        (prompt, truth)
    }
}

/// Pieces over `vocab` text tokens and `contents` item contents.
pub fn pieces(vocab: u32, contents: u32, max_pieces: usize) -> impl Strategy<Value = Vec<Piece>> {
    let piece = prop_oneof![
        3 => prop::collection::vec(0..vocab, 1..7).prop_map(Piece::Text),
        2 => (0..contents, 0..4u32).prop_map(|(content, split)| Piece::Item { content, split }),
    ];
    prop::collection::vec(piece, 1..=max_pieces)
}

/// Length of the common prefix of two truth sequences.
pub fn lcp(a: &[Truth], b: &[Truth]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Every prefix ever cached, per tenant: the brute-force matcher.
#[derive(Debug, Default)]
pub struct Oracle {
    cached: Vec<(TenantSalt, Vec<Truth>)>,
}

impl Oracle {
    pub fn insert(&mut self, tenant: TenantSalt, cached_prefix: &[Truth]) {
        self.cached.push((tenant, cached_prefix.to_vec()));
    }

    /// Longest common prefix of `query` with any cached prefix of `tenant`.
    pub fn longest(&self, tenant: TenantSalt, query: &[Truth]) -> usize {
        self.cached.iter().filter(|(t, _)| *t == tenant).map(|(_, c)| lcp(c, query)).max().unwrap_or(0)
    }
}

/// Which content each block the index adopted holds (tenant, truth up to the
/// block's end); a match is checked block by block against it.
#[derive(Debug, Default)]
pub struct Ledger {
    blocks: HashMap<BlockId, (TenantSalt, Vec<Truth>)>,
}

impl Ledger {
    /// Records `adopted` from an insert whose blocks were `blocks` for `truth`.
    pub fn adopt(
        &mut self, tenant: TenantSalt, truth: &[Truth], bs: usize, blocks: &[BlockId], adopted: &[BlockId],
    ) {
        self.adopt_upto(tenant, truth, bs, blocks, adopted, blocks.len() * bs);
    }

    /// [`Self::adopt`] for an insert of the first `tokens` positions (the
    /// last block holds only those it covers).
    pub fn adopt_upto(
        &mut self, tenant: TenantSalt, truth: &[Truth], bs: usize, blocks: &[BlockId], adopted: &[BlockId],
        tokens: usize,
    ) {
        for (i, b) in blocks.iter().enumerate() {
            if adopted.contains(b) {
                self.blocks.insert(*b, (tenant, truth[..((i + 1) * bs).min(tokens)].to_vec()));
            }
        }
    }

    pub fn evict(&mut self, b: BlockId) -> bool {
        self.blocks.remove(&b).is_some()
    }

    /// Removes `b` and returns what it held (tenant, truth up to its last valid position).
    pub fn take(&mut self, b: BlockId) -> Option<(TenantSalt, Vec<Truth>)> {
        self.blocks.remove(&b)
    }

    /// Number of blocks the index should hold.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Ids of the blocks the index should hold.
    pub fn ids(&self) -> HashSet<BlockId> {
        self.blocks.keys().copied().collect()
    }

    /// Every returned block is live, belongs to `tenant`, sits at its own
    /// block position and holds the query's content up to the matched length
    /// (a partly filled block at least that far, so only as the last one).
    pub fn check(
        &self, tenant: TenantSalt, query: &[Truth], bs: usize, m: &PrefixMatch,
    ) -> Result<(), String> {
        if m.blocks.len() != m.tokens.div_ceil(bs) || m.aligned_tokens != m.tokens / bs * bs {
            return Err(format!("match shape {m:?} inconsistent with block size {bs}"));
        }
        if m.tokens > query.len() {
            return Err(format!("matched {} of a {}-token query", m.tokens, query.len()));
        }
        for (j, b) in m.blocks.iter().enumerate() {
            let Some((owner, content)) = self.blocks.get(b) else {
                return Err(format!("block {b} (position {j}) is not owned by the index"));
            };
            if *owner != tenant {
                return Err(format!("block {b} of tenant {owner} returned to tenant {tenant}"));
            }
            let upto = ((j + 1) * bs).min(m.tokens);
            let at_own_position = j * bs < content.len() && content.len() <= (j + 1) * bs;
            if !at_own_position || content.len() < upto || content[..upto] != query[..upto] {
                return Err(format!("block {b} at position {j} holds other content"));
            }
        }
        Ok(())
    }
}
