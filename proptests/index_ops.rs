//! Random operation sequences against the radix index.
//!
//! Insert / match / lock / unlock / evict over several tenants, with a tiny
//! vocabulary so prompts share prefixes. After every operation the index's own
//! invariant checker must pass; the harness also checks, against a ledger of
//! adopted blocks and a brute-force oracle, that locked blocks are never
//! evicted, that evicted ids are never matched again until re-inserted, that
//! tenants never share a block, and that matches never exceed (and, before any
//! eviction, equal) the oracle's longest common prefix. Locks take a match
//! trimmed to a random number of its blocks (as the scheduler pins only what a
//! request reads), and once eviction runs dry exactly the pinned blocks remain.
//!
//! Partial inserts cache a prefix of any length (a finished sequence's last,
//! partly filled block): the ledger then records how far each block is valid,
//! every released block must be a cached partial block that the insert's
//! content extends, and an insert may fail only by growing a partial block a
//! live lock pins.

use support::cases;
use support::index_oracle as common;

use std::collections::HashSet;

use common::{ItemModel, Ledger, Oracle, Piece, Truth, pieces};
use omniprefix::Error;
use omniprefix::error::CacheError;
use omniprefix::index::radix::{RadixConfig, RadixIndex};
use omniprefix::index::{BlockId, PrefixIndex, PrefixMatch, ValidationPolicy};
use proptest::prelude::*;
use proptest::sample::Index;

const BS: usize = 4;
/// Collision-free fingerprints, and weak ones that force colliding siblings
/// (so splits and evictions also run on shared head keys).
/// The harness gives them the evidence of each of the validating policies.
const MODELS: [ItemModel; 2] = [
    ItemModel { rows: 3, fp_bits: None, policy: ValidationPolicy::SecondDigest },
    ItemModel { rows: 3, fp_bits: Some(1), policy: ValidationPolicy::SecondDigest },
];
const POLICIES: [ValidationPolicy; 2] = [ValidationPolicy::SecondDigest, ValidationPolicy::ExactBytes];

#[derive(Debug, Clone)]
enum Op {
    /// Cache a fraction of the prompt's full blocks, or with `partial` a
    /// fraction of its positions (`insert_partial`); `reuse` passes the ids a
    /// match returned for the cached part (as a scheduler does) instead of fresh ones;
    /// `lock` pins what the insert reports cached (as a scheduler's commit does).
    Insert {
        tenant: u64,
        base: Index,
        keep: usize,
        extra: Vec<Piece>,
        frac: f64,
        reuse: bool,
        lock: bool,
        partial: bool,
    },
    /// `lock` pins the match's first `pin` blocks (an `Index` over 0..=blocks).
    Match {
        tenant: u64,
        base: Index,
        keep: usize,
        extra: Vec<Piece>,
        lock: bool,
        pin: Index,
    },
    Unlock(Index),
    Evict(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let derived = || (0..3u64, any::<Index>(), 0..5usize, pieces(4, 6, 4));
    prop_oneof![
        4 => (derived(), 0.0..=1.0f64, any::<bool>(), any::<bool>(), any::<bool>()).prop_map(
            |((tenant, base, keep, extra), frac, reuse, lock, partial)| {
                Op::Insert { tenant, base, keep, extra, frac, reuse, lock, partial }
            }
        ),
        4 => (derived(), any::<bool>(), any::<Index>()).prop_map(|((tenant, base, keep, extra), lock, pin)| {
            Op::Match { tenant, base, keep, extra, lock, pin }
        }),
        1 => any::<Index>().prop_map(Op::Unlock),
        2 => (0..8usize).prop_map(Op::Evict),
    ]
}

/// The first `blocks` blocks of `m` (its tokens cut to match), keeping its handle.
fn trimmed(m: PrefixMatch, blocks: usize) -> PrefixMatch {
    let tokens = m.tokens.min(blocks * BS);
    PrefixMatch {
        tokens,
        aligned_tokens: tokens / BS * BS,
        blocks: m.blocks[..blocks].to_vec(),
        handle: m.handle,
    }
}

/// The harness: the index under test plus everything needed to judge it.
struct Harness {
    index: RadixIndex,
    items: ItemModel,
    oracle: Oracle,
    ledger: Ledger,
    /// Prompts inserted so far, to derive sharing queries from.
    history: Vec<Vec<Piece>>,
    /// Live locks, with the truth of the prompt each came from.
    locked: Vec<(PrefixMatch, Vec<Truth>)>,
    free: Vec<BlockId>,
    next_id: BlockId,
    evicted_any: bool,
}

impl Harness {
    fn new(items: ItemModel, policy: ValidationPolicy) -> Result<Self, TestCaseError> {
        let config = RadixConfig { block_size: BS };
        let index = RadixIndex::new(config).map_err(|e| TestCaseError::fail(e.to_string()))?;
        Ok(Harness {
            index,
            items: items.with_policy(policy),
            oracle: Oracle::default(),
            ledger: Ledger::default(),
            history: Vec::new(),
            locked: Vec::new(),
            free: Vec::new(),
            next_id: 0,
            evicted_any: false,
        })
    }

    fn fresh_id(&mut self) -> BlockId {
        self.free.pop().unwrap_or_else(|| {
            self.next_id += 1;
            self.next_id - 1
        })
    }

    /// Every block a live lock pins.
    fn pinned(&self) -> HashSet<BlockId> {
        self.locked.iter().flat_map(|(m, _)| m.blocks.iter().copied()).collect()
    }

    fn derive(&self, base: &Index, keep: usize, extra: &[Piece]) -> Vec<Piece> {
        let mut q: Vec<Piece> = if self.history.is_empty() {
            Vec::new()
        } else {
            self.history[base.index(self.history.len())].iter().take(keep).cloned().collect()
        };
        q.extend(extra.iter().cloned());
        q
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match op {
            Op::Insert { tenant, base, keep, extra, frac, reuse, lock, partial } => {
                let p = self.derive(base, *keep, extra);
                let (prompt, truth) = self.items.build(*tenant, &p);
                let tokens = if *partial {
                    (truth.len() as f64 * frac) as usize
                } else {
                    ((truth.len() / BS) as f64 * frac) as usize * BS
                };
                let k = tokens.div_ceil(BS);
                // A matched id is reusable where the match covers every position the block carries.
                let reused: Vec<BlockId> = if *reuse {
                    let m = self.index.match_prefix(&prompt);
                    let usable = if tokens <= m.tokens { k } else { m.tokens / BS };
                    m.blocks.into_iter().take(usable).collect()
                } else {
                    Vec::new()
                };
                let fresh: Vec<BlockId> = (reused.len()..k).map(|_| self.fresh_id()).collect();
                let blocks: Vec<BlockId> = reused.iter().chain(&fresh).copied().collect();
                let before = self.index.stats();
                let result = if *partial {
                    self.index.insert_partial(&prompt, &blocks, tokens)
                } else {
                    self.index.insert(&prompt, &blocks)
                };
                self.history.push(p);
                let out = match result {
                    Ok(out) => out,
                    Err(Error::Cache(CacheError::LockedPartialBlock { end, .. })) => {
                        // Only growing a partial block that a live lock pins may fail.
                        let justified = self.locked.iter().any(|(m, t)| {
                            m.tokens <= end
                                && m.tokens > end / BS * BS
                                && !end.is_multiple_of(BS)
                                && tokens > end
                                && truth.get(..m.tokens) == t.get(..m.tokens)
                        });
                        prop_assert!(
                            justified,
                            "insert of {tokens} refused with no locked partial block at {end}"
                        );
                        prop_assert_eq!(self.index.stats(), before, "a refused insert changes nothing");
                        self.free.extend(fresh);
                        self.index.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
                        return Ok(());
                    }
                    Err(e) => return Err(TestCaseError::fail(e.to_string())),
                };
                let fresh_set: HashSet<BlockId> = fresh.iter().copied().collect();
                let mut returned: Vec<BlockId> = out.adopted.iter().chain(&out.duplicates).copied().collect();
                prop_assert!(
                    returned.iter().all(|b| fresh_set.contains(b)),
                    "reused id handed back: {out:?}"
                );
                returned.sort_unstable();
                let mut expected = fresh.clone();
                expected.sort_unstable();
                prop_assert_eq!(returned, expected, "adopted + duplicates must be the fresh ids");
                self.free.extend(out.duplicates.iter().copied());
                let pinned = self.pinned();
                for &b in &out.released {
                    prop_assert!(!pinned.contains(&b), "locked block {b} released");
                    let Some((owner, content)) = self.ledger.take(b) else {
                        return Err(TestCaseError::fail(format!("released block {b} was not cached")));
                    };
                    // Superseded: a partly filled block whose positions the insert covers and goes past.
                    prop_assert!(
                        owner == *tenant
                            && !content.len().is_multiple_of(BS)
                            && content.len() < tokens
                            && truth[..content.len()] == content[..],
                        "released block {b} was not a partial block this insert extends"
                    );
                }
                self.free.extend(out.released.iter().copied());
                self.ledger.adopt_upto(*tenant, &truth, BS, &blocks, &out.adopted, tokens);
                self.oracle.insert(*tenant, &truth[..tokens]);
                // What insert reports cached is the prefix as a match would find it.
                let cached = out.cached;
                prop_assert_eq!(
                    (cached.tokens, cached.aligned_tokens, cached.blocks.len()),
                    (tokens, tokens / BS * BS, k)
                );
                self.ledger.check(*tenant, &truth, BS, &cached).map_err(TestCaseError::fail)?;
                if *lock && k > 0 {
                    self.index.lock(&cached);
                    self.locked.push((cached, truth));
                }
            }
            Op::Match { tenant, base, keep, extra, lock, pin } => {
                let (prompt, truth) = self.items.build(*tenant, &self.derive(base, *keep, extra));
                let m = self.index.match_prefix(&prompt);
                self.ledger.check(*tenant, &truth, BS, &m).map_err(TestCaseError::fail)?;
                let best = self.oracle.longest(*tenant, &truth);
                prop_assert!(m.tokens <= best, "matched {} beyond oracle {best}", m.tokens);
                if !self.evicted_any {
                    prop_assert_eq!(m.tokens, best, "nothing evicted yet, so the match must be complete");
                }
                if *lock {
                    let keep = pin.index(m.blocks.len() + 1);
                    let m = trimmed(m, keep);
                    self.index.lock(&m);
                    self.locked.push((m, truth));
                }
            }
            Op::Unlock(i) => {
                if !self.locked.is_empty() {
                    let (m, _) = self.locked.swap_remove(i.index(self.locked.len()));
                    self.index.unlock(&m);
                }
            }
            Op::Evict(n) => {
                let freed = self.index.evict(*n);
                prop_assert!(freed.len() <= *n);
                let pinned = self.pinned();
                for b in &freed {
                    prop_assert!(!pinned.contains(b), "locked block {b} evicted");
                    prop_assert!(self.ledger.evict(*b), "evicted block {b} was not cached");
                }
                if freed.len() < *n {
                    prop_assert!(self.index.evict(1).is_empty(), "evict stopped early");
                    prop_assert_eq!(
                        self.ledger.ids(),
                        pinned,
                        "run dry, the index must hold exactly the pinned blocks"
                    );
                }
                self.evicted_any |= !freed.is_empty();
                self.free.extend(freed);
            }
        }
        self.index.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let stats = self.index.stats();
        prop_assert_eq!(stats.cached_blocks as usize, self.ledger.len());
        Ok(())
    }

    /// Releases every lock and evicts everything: the index must end empty.
    fn drain(&mut self) -> Result<(), TestCaseError> {
        for (m, _) in std::mem::take(&mut self.locked) {
            self.index.unlock(&m);
        }
        let freed = self.index.evict(usize::MAX);
        for b in &freed {
            prop_assert!(self.ledger.evict(*b), "drained block {b} was not cached");
        }
        prop_assert_eq!(self.ledger.len(), 0, "blocks left in the ledger after a full drain");
        self.index.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let stats = self.index.stats();
        prop_assert_eq!((stats.cached_blocks, stats.nodes), (0, 0));
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(256), ..ProptestConfig::default() })]

    #[test]
    fn random_operations_keep_every_invariant(
        ops in prop::collection::vec(op(), 1..40),
        model in 0..MODELS.len(),
        policy in 0..POLICIES.len(),
    ) {
        let mut h = Harness::new(MODELS[model], POLICIES[policy])?;
        for op in &ops {
            h.apply(op)?;
        }
        h.drain()?;
    }
}
