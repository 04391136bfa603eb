//! Unit tests of the hash-chain index: insert / match / lock / evict, tenant
//! isolation, duplicates, multimodal extra keys; `validate()` after every op.

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::canon::{Evidence, Fingerprint, ItemIdentity, ItemLayout, Modality};
use crate::error::{CacheError, Error};
use crate::prompt::{IndexMap, ItemSpan, Positions};

const BS: usize = 4;

fn text_prompt(tenant: TenantSalt, tokens: &[u32]) -> CanonicalPrompt {
    CanonicalPrompt {
        tenant,
        atoms: vec![],
        token_ids: tokens.to_vec(),
        items: vec![],
        index_map: IndexMap::default(),
        positions: Positions::linear(tokens.len()),
    }
}

fn item(fp: u128, n: usize) -> Arc<ItemIdentity> {
    Arc::new(ItemIdentity {
        fingerprint: Fingerprint(fp),
        evidence: Evidence::Unvalidated,
        modality: Modality::Image,
        layout: ItemLayout::Image { grid_thw: [1, 2, 2] },
        num_tokens: n,
        content_bytes: 0,
    })
}

/// `len` pad tokens (id 9) with one item of `n` rows at `start`, text around it.
fn mm_prompt(fp: u128, len: usize, start: usize, n: usize) -> CanonicalPrompt {
    let mut p = text_prompt(0, &(0..len as u32).collect::<Vec<_>>());
    for t in &mut p.token_ids[start..start + n] {
        *t = 9;
    }
    p.items = vec![item(fp, n)];
    p.index_map.spans = vec![ItemSpan { item: 0, rows: 0..n as u32, start: start as u32 }];
    p
}

fn index() -> HashChainIndex {
    HashChainIndex::new(BS).unwrap()
}

fn ok(ix: &HashChainIndex) {
    if let Err(e) = ix.validate() {
        panic!("invariant broken: {e}");
    }
}

#[test]
fn insert_then_match_is_block_granular() {
    let mut ix = index();
    let p = text_prompt(0, &(0..11).collect::<Vec<_>>());
    let out = ix.insert(&p, &[1, 2]).unwrap();
    ok(&ix);
    assert_eq!(out.adopted, [1, 2]);
    assert!(out.duplicates.is_empty());
    // Shares 9 tokens: block 0 and 1 full, the 10th differs inside block 2.
    let mut q = (0..11).collect::<Vec<u32>>();
    q[9] = 99;
    let m = ix.match_prefix(&text_prompt(0, &q));
    ok(&ix);
    assert_eq!((m.tokens, m.aligned_tokens, m.blocks.clone()), (8, 8, vec![1, 2]));
    // A change in block 0 breaks the chain for every later block.
    q[0] = 77;
    assert_eq!(ix.match_prefix(&text_prompt(0, &q)).blocks, Vec::<BlockId>::new());
    let s = ix.stats();
    assert_eq!((s.queries, s.hits, s.hit_tokens, s.query_tokens, s.cached_blocks), (2, 1, 8, 22, 2));
}

/// vLLM caches full blocks only: the partly filled last block of a
/// finished sequence comes back to the caller, a round loses up to a block.
#[test]
fn insert_partial_caches_the_full_blocks_and_hands_the_partial_one_back() {
    let mut ix = index();
    let p = text_prompt(0, &(0..14).collect::<Vec<_>>());
    let out = ix.insert_partial(&p, &[1, 2, 3], 10).unwrap();
    ok(&ix);
    assert_eq!((out.adopted, out.duplicates, out.released), (vec![1, 2], vec![3], vec![]));
    assert_eq!((out.cached.tokens, out.cached.blocks), (8, vec![1, 2]), "cached: the full blocks");
    assert_eq!(ix.match_prefix(&p).tokens, 8);
    // The full block over those positions, once cached, is the index's own.
    ix.insert(&p, &[1, 2, 4]).unwrap();
    let own = ix.insert_partial(&p, &[1, 2, 4], 10).unwrap();
    assert_eq!((own.adopted.len(), own.duplicates.len()), (0, 0));
    let copy = ix.insert_partial(&p, &[5, 6, 7], 10).unwrap();
    assert_eq!((copy.adopted, copy.duplicates), (vec![], vec![5, 6, 7]));
    // Bad arguments change nothing.
    let before = ix.stats();
    let err = ix.insert_partial(&p, &[5, 6], 10).unwrap_err();
    assert!(matches!(
        err,
        Error::Cache(CacheError::PartialBlockCount { blocks: 2, tokens: 10, block_size: BS })
    ));
    let err = ix.insert_partial(&p, &[5, 6, 7, 8], 15).unwrap_err();
    assert!(matches!(err, Error::Cache(CacheError::TokensExceedPrompt { tokens: 15, prompt_len: 14 })));
    let err = ix.insert_partial(&p, &[5, 6, 5], 10).unwrap_err();
    assert!(matches!(err, Error::Cache(CacheError::BlockAlreadyCached { block: 5 })));
    let other = text_prompt(0, &[9; 10]);
    let err = ix.insert_partial(&other, &[5, 6, 4], 10).unwrap_err();
    assert!(
        matches!(err, Error::Cache(CacheError::BlockAlreadyCached { block: 4 })),
        "owned under other content"
    );
    assert_eq!(ix.stats(), before);
    ok(&ix);
}

#[test]
fn duplicates_and_recommits() {
    let mut ix = index();
    let p = text_prompt(0, &(0..12).collect::<Vec<_>>());
    ix.insert(&p, &[1, 2]).unwrap();
    // Another request computed the same first two blocks into 5, 6 and a new third into 7.
    let out = ix.insert(&p, &[5, 6, 7]).unwrap();
    ok(&ix);
    assert_eq!(out.adopted, [7]);
    assert_eq!(out.duplicates, [5, 6]);
    // Re-committing blocks the index owns is neither adoption nor duplication.
    let out = ix.insert(&p, &[1, 2, 7]).unwrap();
    assert_eq!((out.adopted.len(), out.duplicates.len()), (0, 0));
    let m = ix.match_prefix(&p);
    assert_eq!(m.blocks, [1, 2, 7]);
    assert_eq!(
        (out.cached.tokens, out.cached.blocks),
        (m.tokens, m.blocks),
        "insert reports what a match finds"
    );
    ok(&ix);
}

#[test]
fn bad_inserts_are_typed_errors_without_state_change() {
    let mut ix = index();
    let p = text_prompt(0, &(0..9).collect::<Vec<_>>());
    let err = ix.insert(&p, &[1, 2, 3]).unwrap_err();
    assert!(matches!(err, Error::Cache(CacheError::BlocksExceedPrompt { blocks: 3, full_blocks: 2 })));
    let err = ix.insert(&p, &[4, 4]).unwrap_err();
    assert!(matches!(err, Error::Cache(CacheError::BlockAlreadyCached { block: 4 })));
    ix.insert(&p, &[1]).unwrap();
    // Block 1 already holds other content.
    let q = text_prompt(0, &(50..59).collect::<Vec<_>>());
    let err = ix.insert(&q, &[3, 1]).unwrap_err();
    assert!(matches!(err, Error::Cache(CacheError::BlockAlreadyCached { block: 1 })));
    assert_eq!(ix.stats().cached_blocks, 1);
    assert!(ix.match_prefix(&q).blocks.is_empty());
    ok(&ix);
    let mut bad = mm_prompt(1, 12, 2, 4);
    bad.index_map.spans[0].item = 3;
    let err = ix.insert(&bad, &[8]).unwrap_err();
    assert!(matches!(err, Error::Cache(CacheError::SpanItemOutOfRange { span: 0, item: 3, items: 1 })));
    let err = ix.match_with_mm_hashes(&mm_prompt(1, 12, 2, 4), &[]).unwrap_err();
    assert!(matches!(err, Error::Cache(CacheError::MmHashCount { expected: 1, found: 0 })));
    assert_eq!(ix.stats().cached_blocks, 1);
    ok(&ix);
}

#[test]
fn tenants_never_share() {
    let mut ix = index();
    let tokens: Vec<u32> = (0..8).collect();
    ix.insert(&text_prompt(1, &tokens), &[1, 2]).unwrap();
    assert!(ix.match_prefix(&text_prompt(2, &tokens)).blocks.is_empty());
    assert!(ix.match_prefix(&text_prompt(0, &tokens)).blocks.is_empty());
    assert_eq!(ix.match_prefix(&text_prompt(1, &tokens)).blocks, [1, 2]);
    ok(&ix);
}

/// Same placeholder token ids, different item content: only the mm extra key tells them apart.
#[test]
fn items_with_equal_placeholders_do_not_share_blocks() {
    let mut ix = index();
    let a = mm_prompt(0xaaaa, 12, 2, 6);
    ix.insert(&a, &[1, 2, 3]).unwrap();
    let b = mm_prompt(0xbbbb, 12, 2, 6);
    assert_eq!(a.token_ids, b.token_ids);
    assert!(ix.match_prefix(&b).blocks.is_empty(), "item starts in block 0");
    assert_eq!(ix.match_prefix(&a).blocks, [1, 2, 3]);
    // Item in block 1 only: block 0 is shared, block 1 is not.
    let c = mm_prompt(0xaaaa, 12, 5, 2);
    let d = mm_prompt(0xcccc, 12, 5, 2);
    ix.insert(&c, &[4, 5, 6]).unwrap();
    assert_eq!(ix.match_prefix(&d).blocks, [4]);
    // The raw-media path: explicit mm hashes replace fingerprints.
    let raw = vec!["feed".to_string()];
    ix.insert_with_mm_hashes(&d, &raw, &[7, 8]).unwrap();
    assert_eq!(ix.match_with_mm_hashes(&d, &raw).unwrap().blocks, [4, 8]);
    ok(&ix);
}

#[test]
fn locks_pin_and_eviction_takes_lru_tails_first() {
    let mut ix = index();
    let p = text_prompt(0, &(0..12).collect::<Vec<_>>());
    let q = text_prompt(0, &(100..108).collect::<Vec<_>>());
    ix.insert(&p, &[1, 2, 3]).unwrap();
    ix.insert(&q, &[4, 5]).unwrap();
    let m = ix.match_prefix(&p); // p is now the most recent
    ix.lock(&m);
    ok(&ix);
    assert_eq!(ix.evict(10), [5, 4], "locked chain stays, q goes tail first");
    ok(&ix);
    ix.lock(&m);
    ix.unlock(&m);
    assert!(ix.evict(1).is_empty(), "one lock is still held");
    ix.unlock(&m);
    ix.unlock(&m); // extra unlock: saturates, never negative
    ok(&ix);
    assert_eq!(ix.evict(2), [3, 2]);
    assert_eq!(ix.match_prefix(&p).blocks, [1]);
    ok(&ix);
    let s = ix.stats();
    assert_eq!((s.evicted_blocks, s.cached_blocks, s.nodes), (4, 1, 1));
}

/// Branching chains share a parent: the parent is evictable only after all its tails.
#[test]
fn shared_parents_outlive_their_children() {
    let mut ix = index();
    let base: Vec<u32> = (0..4).collect();
    let a = [base.clone(), vec![10, 11, 12, 13]].concat();
    let b = [base.clone(), vec![20, 21, 22, 23]].concat();
    ix.insert(&text_prompt(0, &a), &[1, 2]).unwrap();
    let out = ix.insert(&text_prompt(0, &b), &[3, 4]).unwrap();
    assert_eq!((out.adopted, out.duplicates), (vec![4], vec![3]));
    ok(&ix);
    assert_eq!(ix.evict(1), [2]);
    assert_eq!(ix.match_prefix(&text_prompt(0, &b)).blocks, [1, 4]);
    assert_eq!(ix.evict(5), [4, 1]);
    ok(&ix);
}

/// Random operations over a tiny vocabulary (forcing shared prefixes): the
/// invariants hold after each, and every match is a hole-free chain that a
/// brute-force oracle over the live inserted chains confirms.
#[test]
fn random_ops_keep_invariants_and_match_oracle() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut ix = index();
    let mut next_block: BlockId = 0;
    let mut locked: Vec<PrefixMatch> = Vec::new();
    // Oracle: block id -> (token prefix it ends, tenant).
    let mut owner: FxHashMap<BlockId, (Vec<u32>, TenantSalt)> = FxHashMap::default();
    for _ in 0..400 {
        let len = rng.random_range(0..5 * BS);
        let tokens: Vec<u32> = (0..len).map(|_| rng.random_range(0..2)).collect();
        let tenant = rng.random_range(0..2);
        let p = text_prompt(tenant, &tokens);
        match rng.random_range(0..5) {
            0 | 1 => {
                let n = rng.random_range(0..=len / BS);
                let blocks: Vec<BlockId> = (next_block..next_block + n as u32).collect();
                next_block += n as u32;
                let out = ix.insert(&p, &blocks).unwrap();
                for (i, b) in blocks.iter().enumerate() {
                    if out.adopted.contains(b) {
                        owner.insert(*b, (tokens[..(i + 1) * BS].to_vec(), tenant));
                    }
                }
            }
            2 => {
                let m = ix.match_prefix(&p);
                for (i, b) in m.blocks.iter().enumerate() {
                    let (prefix, t) = &owner[b];
                    assert_eq!((prefix.as_slice(), *t), (&tokens[..(i + 1) * BS], tenant));
                }
                if rng.random_bool(0.5) {
                    ix.lock(&m);
                    locked.push(m);
                }
            }
            3 => {
                if !locked.is_empty() {
                    let m = locked.swap_remove(rng.random_range(0..locked.len()));
                    ix.unlock(&m);
                }
            }
            _ => {
                for b in ix.evict(rng.random_range(0..4)) {
                    assert!(!locked.iter().any(|m| m.blocks.contains(&b)), "evicted locked block {b}");
                    owner.remove(&b);
                }
            }
        }
        ok(&ix);
        assert_eq!(ix.stats().cached_blocks as usize, owner.len());
    }
}
