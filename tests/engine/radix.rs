//! Behaviour of the radix index on hand-made cases: payload placement across
//! splits, collision siblings, locking, LRU eviction, bad input, structure size.

use support::index_oracle as common;

use std::sync::Arc;

use common::{ItemModel, Piece};
use omniprefix::error::{CacheError, ConfigError, RequestError};
use omniprefix::index::radix::{RadixConfig, RadixIndex};
use omniprefix::index::{PrefixIndex, ValidationPolicy};
use omniprefix::prompt::CanonicalPrompt;
use omniprefix::{Error, Result};

const STRONG: ItemModel = ItemModel { rows: 3, fp_bits: None, policy: ValidationPolicy::SecondDigest };

fn index(block_size: usize) -> Result<RadixIndex> {
    RadixIndex::new(RadixConfig { block_size })
}

fn text(tenant: u64, ids: &[u32]) -> CanonicalPrompt {
    STRONG.build(tenant, &[Piece::Text(ids.to_vec())]).0
}

fn valid(ix: &RadixIndex) -> Result<()> {
    ix.validate().map_err(Error::from)
}

#[test]
fn zero_block_size_is_a_config_error() {
    let err = RadixIndex::new(RadixConfig { block_size: 0 }).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Config(ConfigError::Invalid { component: "radix index", field: "block_size", .. })
        ),
        "{err}"
    );
}

#[test]
fn split_keeps_block_ids_with_the_side_holding_their_last_token() -> Result<()> {
    let mut ix = index(4)?;
    ix.insert(&text(0, &[1, 2, 3, 4, 5, 6, 7, 8]), &[10, 11])?;
    // Diverges at position 6, inside block 1: the node splits at 6. Block 0
    // was cached by the first insert, so the second one's id 20 is a duplicate.
    let second = ix.insert(&text(0, &[1, 2, 3, 4, 5, 6, 9, 9]), &[20, 21])?;
    assert_eq!((second.adopted, second.duplicates), (vec![21], vec![20]));
    valid(&ix)?;
    let a = ix.match_prefix(&text(0, &[1, 2, 3, 4, 5, 6, 7, 8]));
    assert_eq!((a.tokens, a.blocks), (8, vec![10, 11]));
    let b = ix.match_prefix(&text(0, &[1, 2, 3, 4, 5, 6, 9, 9]));
    assert_eq!((b.tokens, b.blocks), (8, vec![10, 21]));
    let partial = ix.match_prefix(&text(0, &[1, 2, 3, 4, 5, 6, 0]));
    assert_eq!((partial.tokens, partial.aligned_tokens, partial.blocks.len()), (6, 4, 2));
    assert_eq!(partial.blocks[0], 10);
    assert!([11, 21].contains(&partial.blocks[1]));
    assert_eq!(ix.stats().cached_blocks, 3);
    Ok(())
}

#[test]
fn duplicates_and_reused_ids_on_insert() -> Result<()> {
    let mut ix = index(4)?;
    let p = text(0, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
    let first = ix.insert(&p, &[1, 2])?;
    assert_eq!((first.adopted, first.duplicates), (vec![1, 2], vec![]));
    let again = ix.insert(&p, &[3, 4])?;
    assert_eq!((again.adopted, again.duplicates), (vec![], vec![3, 4]));
    // The ids a match returned are the index's own: neither adopted nor duplicate.
    let longer = ix.insert(&p, &[1, 2, 5])?;
    assert_eq!((longer.adopted, longer.duplicates), (vec![5], vec![]));
    assert_eq!(ix.match_prefix(&p).blocks, vec![1, 2, 5]);
    valid(&ix)
}

/// Insert reports the prefix as now cached (the index's ids, duplicates
/// swapped for them), and locking that report pins exactly those blocks,
/// with no second match: whether the insert extended a leaf, added a child
/// under a split, or found everything cached already.
#[test]
fn insert_reports_the_cached_prefix_ready_to_lock() -> Result<()> {
    let mut ix = index(4)?;
    let p = text(0, &(0..16).collect::<Vec<u32>>());
    let first = ix.insert(&p, &[1, 2])?;
    assert_eq!((first.cached.tokens, first.cached.aligned_tokens, first.cached.blocks), (8, 8, vec![1, 2]));
    // Extends the leaf in place; 20 duplicates block 1.
    let longer = ix.insert(&p, &[20, 21, 22])?;
    assert_eq!((longer.adopted, longer.duplicates), (vec![22], vec![20, 21]));
    assert_eq!((longer.cached.tokens, longer.cached.blocks.clone()), (12, vec![1, 2, 22]));
    ix.lock(&longer.cached);
    // A sibling under a split at token 9 (inside block 2), and a re-insert of cached blocks.
    let mut other: Vec<u32> = (0..16).collect();
    other[9] = 99;
    let sibling = ix.insert(&text(0, &other), &[30, 31, 32, 33])?;
    assert_eq!(sibling.cached.blocks, vec![1, 2, 32, 33]);
    let recommit = ix.insert(&p, &[1])?;
    assert_eq!((recommit.cached.tokens, recommit.cached.blocks.clone()), (4, vec![1]));
    ix.lock(&recommit.cached);
    ix.lock(&sibling.cached);
    valid(&ix)?;
    assert_eq!(ix.evict(usize::MAX), Vec::<u32>::new(), "every cached block is pinned");
    ix.unlock(&sibling.cached);
    let mut freed = ix.evict(usize::MAX);
    freed.sort_unstable();
    assert_eq!(freed, vec![32, 33], "only the sibling's own blocks were pinned by it alone");
    ix.unlock(&longer.cached);
    ix.unlock(&recommit.cached);
    valid(&ix)?;
    let mut freed = ix.evict(usize::MAX);
    freed.sort_unstable();
    assert_eq!(freed, vec![1, 2, 22]);
    assert_eq!(ix.stats().nodes, 0);
    Ok(())
}

#[test]
fn bad_inserts_are_typed_errors_and_change_nothing() -> Result<()> {
    let mut ix = index(4)?;
    let p = text(0, &[1, 2, 3, 4, 5, 6, 7, 8]);
    ix.insert(&p, &[1])?;
    let before = ix.stats();
    let err = ix.insert(&p, &[1, 2, 3]).unwrap_err();
    assert!(matches!(err, Error::Cache(CacheError::BlocksExceedPrompt { blocks: 3, full_blocks: 2 })));
    let err = ix.insert(&text(0, &[9; 8]), &[7, 7]).unwrap_err();
    assert!(
        matches!(err, Error::Cache(CacheError::BlockAlreadyCached { block: 7 })),
        "repeated in one insert"
    );
    let err = ix.insert(&text(0, &[9; 8]), &[2, 1]).unwrap_err();
    assert!(
        matches!(err, Error::Cache(CacheError::BlockAlreadyCached { block: 1 })),
        "owned under other content"
    );
    let mut broken = p.clone();
    broken.token_ids.pop();
    let err = ix.insert(&broken, &[5]).unwrap_err();
    assert!(matches!(err, Error::Request(RequestError::AtomsLengthMismatch { atoms: 8, tokens: 7 })));
    assert_eq!(ix.stats(), before);
    valid(&ix)
}

#[test]
fn tenants_never_share_entries() -> Result<()> {
    let mut ix = index(4)?;
    ix.insert(&text(1, &[1, 2, 3, 4]), &[1])?;
    assert_eq!(ix.match_prefix(&text(2, &[1, 2, 3, 4])).tokens, 0);
    let own = ix.insert(&text(2, &[1, 2, 3, 4]), &[2])?;
    assert_eq!(own.adopted, vec![2]);
    assert_eq!(ix.match_prefix(&text(1, &[1, 2, 3, 4])).blocks, vec![1]);
    assert_eq!(ix.match_prefix(&text(2, &[1, 2, 3, 4])).blocks, vec![2]);
    valid(&ix)
}

#[test]
fn colliding_items_coexist_as_siblings_and_count_failures() -> Result<()> {
    let weak = ItemModel { rows: 3, fp_bits: Some(1), policy: ValidationPolicy::SecondDigest };
    let item = |content| [Piece::Text(vec![7]), Piece::Item { content, split: 0 }];
    for policy in [ValidationPolicy::SecondDigest, ValidationPolicy::ExactBytes] {
        let (a, _) = weak.with_policy(policy).build(0, &item(0));
        let (b, _) = weak.with_policy(policy).build(0, &item(2));
        assert_eq!(a.items[0].fingerprint, b.items[0].fingerprint);
        let mut ix = index(2)?;
        ix.insert(&a, &[1, 2])?;
        let miss = ix.match_prefix(&b);
        assert_eq!((miss.tokens, ix.stats().validation_failures), (1, 1), "{policy:?}");
        // Block 0 holds text 7 and the item's row 0, so it differs too.
        let sibling = ix.insert(&b, &[3, 4])?;
        assert_eq!((sibling.adopted, sibling.duplicates), (vec![3, 4], vec![]));
        assert_eq!(ix.match_prefix(&a).blocks, vec![1, 2]);
        assert_eq!(ix.match_prefix(&b).blocks, vec![3, 4]);
        valid(&ix)?;
    }
    let trusting_items = weak.with_policy(ValidationPolicy::Unvalidated);
    let (a, _) = trusting_items.build(0, &item(0));
    let (b, _) = trusting_items.build(0, &item(2));
    let mut trusting = index(2)?;
    trusting.insert(&a, &[1, 2])?;
    assert_eq!(trusting.match_prefix(&b).tokens, 4, "without validation the collision is a wrong hit");
    Ok(())
}

#[test]
fn a_long_item_span_matches_whole_and_split_atoms_agree() -> Result<()> {
    let big = ItemModel { rows: 7200, ..STRONG };
    let (cached, _) = big.build(0, &[Piece::Text(vec![1, 2]), Piece::Item { content: 5, split: 0 }]);
    let (query, _) = big.build(0, &[Piece::Text(vec![1, 2]), Piece::Item { content: 5, split: 3001 }]);
    let mut ix = index(16)?;
    let blocks: Vec<u32> = (0..7202 / 16).collect();
    ix.insert(&cached, &blocks)?;
    let m = ix.match_prefix(&query);
    assert_eq!((m.tokens, m.blocks), (7202 / 16 * 16, blocks));
    assert_eq!(ix.stats().nodes, 2, "one root and one node for text + item span");
    Ok(())
}

#[test]
fn locks_pin_the_path_and_stale_handles_do_nothing() -> Result<()> {
    let mut ix = index(4)?;
    let p = text(0, &[1, 2, 3, 4, 5, 6, 7, 8]);
    ix.insert(&p, &[1, 2])?;
    ix.insert(&text(0, &[1, 2, 3, 4, 9, 9, 9, 9]), &[1, 3])?;
    let m = ix.match_prefix(&p);
    ix.lock(&m);
    ix.lock(&m);
    assert_eq!(ix.evict(10), vec![3]);
    ix.unlock(&m);
    assert!(ix.evict(10).is_empty(), "still locked once");
    ix.unlock(&m);
    ix.unlock(&m);
    valid(&ix)?;
    let mut freed = ix.evict(10);
    freed.sort_unstable();
    assert_eq!(freed, vec![1, 2]);
    ix.lock(&m);
    ix.insert(&p, &[4, 5])?;
    valid(&ix)?;
    let mut forged = ix.match_prefix(&p);
    forged.blocks = vec![4, 9];
    ix.lock(&forged);
    assert_eq!(ix.evict(10).len(), 2, "stale or forged matches must not lock anything");
    Ok(())
}

#[test]
fn a_lock_ending_inside_a_long_edge_pins_only_the_matched_blocks() -> Result<()> {
    let mut ix = index(4)?;
    let p = text(0, &(0..16).collect::<Vec<u32>>());
    ix.insert(&p, &[1, 2, 3, 4])?;
    // Shares 6 tokens with the one 16-token edge: blocks 1 and 2 (2 partly).
    let m = ix.match_prefix(&text(0, &[0, 1, 2, 3, 4, 5, 9, 9]));
    assert_eq!((m.tokens, m.blocks.clone()), (6, vec![1, 2]));
    ix.lock(&m);
    valid(&ix)?;
    let mut freed = ix.evict(usize::MAX);
    freed.sort_unstable();
    assert_eq!(freed, vec![3, 4], "exactly the blocks beyond the match are evictable");
    valid(&ix)?;
    let again = ix.match_prefix(&p);
    assert_eq!((again.tokens, again.blocks), (8, vec![1, 2]), "the matched blocks stay cached");
    // The match's own node was evicted; unlock still releases what lock pinned.
    ix.unlock(&m);
    valid(&ix)?;
    let mut freed = ix.evict(usize::MAX);
    freed.sort_unstable();
    assert_eq!(freed, vec![1, 2]);
    assert_eq!(ix.stats().nodes, 0);
    Ok(())
}

/// Issue 22: a lock splits the node its match ended in and the match's handle
/// stays with the lower part. Once that part is evicted, a shorter lock of the
/// same match (the scheduler's, when it unpins a copy-on-write source) must
/// still pin its blocks, found by their ids, not silently pin nothing.
#[test]
fn a_shorter_lock_of_a_match_whose_handle_went_stale_still_pins() -> Result<()> {
    let mut ix = index(4)?;
    ix.insert(&text(0, &(0..16).collect::<Vec<u32>>()), &[1, 2, 3, 4])?;
    let m = ix.match_prefix(&text(0, &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 99]));
    assert_eq!((m.tokens, m.blocks.clone()), (10, vec![1, 2, 3]));
    ix.lock(&m);
    assert_eq!(ix.evict(usize::MAX), vec![4], "the part the handle names is gone");
    let mut shared = m.clone();
    shared.blocks.truncate(2);
    (shared.tokens, shared.aligned_tokens) = (8, 8);
    ix.lock(&shared);
    ix.unlock(&m);
    valid(&ix)?;
    assert_eq!(ix.evict(usize::MAX), vec![3], "blocks 1 and 2 are pinned by the shorter lock");
    ix.unlock(&shared);
    valid(&ix)?;
    let mut freed = ix.evict(usize::MAX);
    freed.sort_unstable();
    assert_eq!(freed, vec![1, 2]);
    Ok(())
}

#[test]
fn a_trimmed_match_pins_its_prefix_and_inserts_past_a_pin_stay_evictable() -> Result<()> {
    let mut ix = index(4)?;
    let p = text(0, &(0..8).collect::<Vec<u32>>());
    ix.insert(&p, &[1, 2])?;
    let full = ix.match_prefix(&p);
    // As the scheduler does: lock only the part the request reads.
    let mut first = full.clone();
    first.blocks.truncate(1);
    (first.tokens, first.aligned_tokens) = (4, 4);
    ix.lock(&first);
    ix.lock(&full);
    // Extends the locked leaf [4, 8): the new blocks must not join the pin.
    ix.insert(&text(0, &(0..16).collect::<Vec<u32>>()), &[1, 2, 3, 4])?;
    valid(&ix)?;
    let mut freed = ix.evict(usize::MAX);
    freed.sort_unstable();
    assert_eq!(freed, vec![3, 4]);
    ix.unlock(&full);
    valid(&ix)?;
    assert_eq!(ix.evict(usize::MAX), vec![2], "block 1 is still pinned by the trimmed lock");
    ix.unlock(&full);
    ix.unlock(&first);
    ix.unlock(&first);
    valid(&ix)?;
    assert_eq!(ix.evict(usize::MAX), vec![1], "extra unlocks change nothing");
    Ok(())
}

#[test]
fn eviction_takes_least_recently_used_leaves_first_and_never_more_than_asked() -> Result<()> {
    let mut ix = index(4)?;
    let a = text(0, &[1; 12]);
    let b = text(0, &[2; 12]);
    ix.insert(&a, &[1, 2, 3])?;
    ix.insert(&b, &[4, 5, 6])?;
    ix.match_prefix(&a);
    assert_eq!(ix.evict(2), vec![5, 6], "b is older; its tail goes first");
    assert_eq!(ix.match_prefix(&b).blocks, vec![4]);
    assert_eq!(ix.evict(1), vec![3], "b was just touched, so a is older now");
    let stats = ix.stats();
    assert_eq!((stats.evicted_blocks, stats.cached_blocks), (3, 3));
    valid(&ix)
}

#[test]
fn index_bytes_stay_under_16_per_cached_text_token() -> Result<()> {
    let ids: Vec<u32> = (0..32_768u32).map(|i| i.wrapping_mul(2_654_435_761) % 151_000).collect();
    let mut ix = index(16)?;
    let blocks: Vec<u32> = (0..2048).collect();
    ix.insert(&text(3, &ids), &blocks)?;
    let bytes = ix.stats().index_bytes as f64;
    let per_token = bytes / 32_768.0;
    println!("index_bytes = {bytes} ({per_token:.2} B per cached text token)");
    assert!(per_token <= 16.0, "{per_token} bytes per token");
    assert!(per_token >= 4.0, "the estimate must at least count the token ids");
    Ok(())
}

#[test]
fn the_index_keeps_one_reference_to_an_item_not_a_copy() -> Result<()> {
    let (p, _) = STRONG.build(0, &[Piece::Item { content: 1, split: 0 }, Piece::Text(vec![1])]);
    let before = Arc::strong_count(&p.items[0]);
    let mut ix = index(4)?;
    ix.insert(&p, &[9])?;
    assert_eq!(Arc::strong_count(&p.items[0]), before + 1);
    Ok(())
}

// ---- partial leaves: a finished sequence's partly filled last block ----

fn upto(n: u32) -> CanonicalPrompt {
    text(0, &(0..n).collect::<Vec<u32>>())
}

/// `upto(n)` with position `at` changed.
fn diverging(n: u32, at: usize) -> CanonicalPrompt {
    let mut ids: Vec<u32> = (0..n).collect();
    ids[at] = 99;
    text(0, &ids)
}

#[test]
fn a_partial_tail_is_matched_token_granular_by_a_longer_prompt() -> Result<()> {
    let mut ix = index(4)?;
    let out = ix.insert_partial(&upto(10), &[1, 2, 3], 10)?;
    assert_eq!((out.adopted, out.duplicates, out.released), (vec![1, 2, 3], vec![], vec![]));
    assert_eq!((out.cached.tokens, out.cached.aligned_tokens, out.cached.blocks), (10, 8, vec![1, 2, 3]));
    valid(&ix)?;
    let m = ix.match_prefix(&upto(14));
    assert_eq!((m.tokens, m.aligned_tokens, m.blocks), (10, 8, vec![1, 2, 3]));
    let inside = ix.match_prefix(&diverging(14, 9));
    assert_eq!((inside.tokens, inside.blocks), (9, vec![1, 2, 3]));
    assert_eq!(ix.stats().cached_blocks, 3);
    Ok(())
}

#[test]
fn a_longer_partial_insert_grows_the_leaf_and_releases_the_old_partial_block() -> Result<()> {
    let mut ix = index(4)?;
    ix.insert_partial(&upto(10), &[1, 2, 3], 10)?;
    // The ids a match returned for the full blocks, a copy (4) of the partial one.
    let out = ix.insert_partial(&upto(14), &[1, 2, 4, 5], 14)?;
    assert_eq!((out.adopted, out.duplicates, out.released), (vec![4, 5], vec![], vec![3]));
    assert_eq!((out.cached.tokens, out.cached.blocks), (14, vec![1, 2, 4, 5]));
    valid(&ix)?;
    assert_eq!(ix.match_prefix(&upto(20)).blocks, vec![1, 2, 4, 5]);
    assert_eq!(ix.match_prefix(&upto(10)).blocks, vec![1, 2, 4]);
    let stats = ix.stats();
    assert_eq!((stats.cached_blocks, stats.evicted_blocks, stats.nodes), (4, 0, 2), "grown in place");
    Ok(())
}

#[test]
fn a_full_insert_through_a_partial_leaf_releases_its_partial_block() -> Result<()> {
    let mut ix = index(4)?;
    ix.insert_partial(&upto(10), &[1, 2, 3], 10)?;
    let out = ix.insert(&upto(16), &[11, 12, 13, 14])?;
    assert_eq!((out.adopted, out.duplicates, out.released), (vec![13, 14], vec![11, 12], vec![3]));
    assert_eq!(
        (out.cached.tokens, out.cached.aligned_tokens, out.cached.blocks),
        (16, 16, vec![1, 2, 13, 14])
    );
    valid(&ix)?;
    assert_eq!(ix.match_prefix(&upto(16)).blocks, vec![1, 2, 13, 14]);
    assert_eq!(ix.stats().cached_blocks, 4);
    Ok(())
}

#[test]
fn divergence_inside_the_partial_block_keeps_both() -> Result<()> {
    let mut ix = index(4)?;
    ix.insert_partial(&upto(10), &[1, 2, 3], 10)?;
    let full = ix.insert(&diverging(12, 9), &[11, 12, 13])?;
    assert_eq!((full.adopted, full.duplicates, full.released), (vec![13], vec![11, 12], vec![]));
    let partial = ix.insert_partial(&diverging(11, 8), &[21, 22, 23], 11)?;
    assert_eq!((partial.adopted, partial.duplicates, partial.released), (vec![23], vec![21, 22], vec![]));
    valid(&ix)?;
    let m = ix.match_prefix(&upto(14));
    assert_eq!((m.tokens, m.blocks), (10, vec![1, 2, 3]));
    let m = ix.match_prefix(&diverging(14, 9));
    assert_eq!((m.tokens, m.blocks), (12, vec![1, 2, 13]));
    let m = ix.match_prefix(&diverging(14, 8));
    assert_eq!((m.tokens, m.blocks), (11, vec![1, 2, 23]));
    // Ends on a boundary inside the shared part: the last block is any of them.
    let m = ix.match_prefix(&text(0, &[0, 1, 2, 3, 4, 5, 6, 7, 50]));
    assert_eq!((m.tokens, m.blocks), (8, vec![1, 2]));
    assert_eq!(ix.stats().cached_blocks, 5);
    Ok(())
}

#[test]
fn eviction_trims_a_partial_leaf_to_its_block_boundary_first() -> Result<()> {
    let mut ix = index(4)?;
    ix.insert_partial(&upto(10), &[1, 2, 3], 10)?;
    ix.insert(&text(0, &[7; 8]), &[4, 5])?;
    ix.match_prefix(&upto(10));
    assert_eq!(ix.evict(1), vec![5], "the full leaf is older");
    assert_eq!(ix.evict(1), vec![4]);
    assert_eq!(ix.evict(1), vec![3], "the partial block goes first");
    valid(&ix)?;
    let m = ix.match_prefix(&upto(10));
    assert_eq!((m.tokens, m.blocks), (8, vec![1, 2]), "the leaf now ends on the boundary");
    // Trimming several blocks at once, the partial one included.
    ix.insert_partial(&upto(10), &[1, 2, 3], 10)?;
    assert_eq!(ix.evict(2), vec![2, 3]);
    valid(&ix)?;
    assert_eq!(ix.match_prefix(&upto(10)).tokens, 4);
    assert_eq!(ix.evict(5), vec![1]);
    let stats = ix.stats();
    assert_eq!((stats.cached_blocks, stats.evicted_blocks, stats.nodes), (0, 6, 0));
    valid(&ix)
}

#[test]
fn a_lock_ending_in_a_partial_leaf_pins_exactly_its_blocks() -> Result<()> {
    let mut ix = index(4)?;
    ix.insert_partial(&upto(10), &[1, 2, 3], 10)?;
    let m = ix.match_prefix(&upto(14));
    ix.lock(&m);
    valid(&ix)?;
    assert!(ix.evict(usize::MAX).is_empty(), "the copy-on-write source is pinned");
    // A match ending before the partial block pins only the full blocks.
    let short = ix.match_prefix(&diverging(10, 6));
    assert_eq!((short.tokens, short.blocks.clone()), (6, vec![1, 2]));
    ix.lock(&short);
    ix.unlock(&m);
    valid(&ix)?;
    assert_eq!(ix.evict(usize::MAX), vec![3]);
    ix.unlock(&short);
    ix.unlock(&short);
    valid(&ix)?;
    let mut freed = ix.evict(usize::MAX);
    freed.sort_unstable();
    assert_eq!(freed, vec![1, 2]);
    // The report of a partial insert locks as a match does.
    let out = ix.insert_partial(&upto(10), &[1, 2, 3], 10)?;
    ix.lock(&out.cached);
    ix.lock(&out.cached);
    ix.unlock(&out.cached);
    assert!(ix.evict(usize::MAX).is_empty());
    ix.unlock(&out.cached);
    assert_eq!(ix.evict(usize::MAX).len(), 3);
    valid(&ix)
}

#[test]
fn growing_a_locked_partial_leaf_is_a_typed_error_that_changes_nothing() -> Result<()> {
    let mut ix = index(4)?;
    ix.insert_partial(&upto(10), &[1, 2, 3], 10)?;
    let m = ix.match_prefix(&upto(14));
    ix.lock(&m);
    let before = ix.stats();
    let err = ix.insert(&upto(12), &[1, 2, 4]).unwrap_err();
    assert!(matches!(err, Error::Cache(CacheError::LockedPartialBlock { block: 3, end: 10 })), "{err}");
    let err = ix.insert_partial(&upto(11), &[1, 2, 4], 11).unwrap_err();
    assert!(matches!(err, Error::Cache(CacheError::LockedPartialBlock { block: 3, end: 10 })), "{err}");
    assert_eq!(ix.stats(), before);
    valid(&ix)?;
    // Inserts that do not grow it still work: covered, or diverging inside it.
    let covered = ix.insert_partial(&upto(9), &[5, 6, 7], 9)?;
    assert_eq!((covered.adopted, covered.duplicates), (vec![], vec![5, 6, 7]));
    let sibling = ix.insert(&diverging(12, 9), &[1, 2, 8])?;
    assert_eq!((sibling.adopted, sibling.released), (vec![8], vec![]));
    valid(&ix)?;
    ix.unlock(&m);
    let grown = ix.insert(&upto(12), &[1, 2, 4])?;
    assert_eq!((grown.adopted, grown.released), (vec![4], vec![3]));
    valid(&ix)
}

#[test]
fn a_partial_insert_of_a_cached_tail_is_a_duplicate() -> Result<()> {
    let mut ix = index(4)?;
    ix.insert(&upto(12), &[1, 2, 3])?;
    let out = ix.insert_partial(&upto(10), &[4, 5, 6], 10)?;
    assert_eq!((out.adopted, out.duplicates, out.released), (vec![], vec![4, 5, 6], vec![]));
    assert_eq!((out.cached.tokens, out.cached.aligned_tokens, out.cached.blocks), (10, 8, vec![1, 2, 3]));
    // A cached partial block covering at least these positions: [0, 10) is
    // shared, block 2 is held by the full leaf (3) and the partial one (7).
    let split = ix.insert_partial(&diverging(11, 10), &[1, 2, 7], 11)?;
    assert_eq!((split.adopted, split.duplicates), (vec![7], vec![]));
    let out = ix.insert_partial(&diverging(11, 10), &[8, 9, 10], 11)?;
    assert_eq!((out.adopted, out.duplicates, out.cached.blocks), (vec![], vec![8, 9, 10], vec![1, 2, 7]));
    // The index's own ids (from a match) are in neither list, whichever
    // sibling holds the last one.
    for (prompt, last) in [(diverging(11, 10), 7), (upto(12), 3)] {
        let m = ix.match_prefix(&prompt);
        assert_eq!(m.blocks[2], last);
        let own = ix.insert_partial(&prompt, &m.blocks[..3], 9)?;
        assert_eq!((own.adopted, own.duplicates, own.cached.blocks), (vec![], vec![], vec![1, 2, last]));
        assert_eq!((own.cached.tokens, own.cached.aligned_tokens), (9, 8));
    }
    assert_eq!(ix.stats().cached_blocks, 4);
    valid(&ix)
}

#[test]
fn bad_partial_inserts_are_typed_errors_and_change_nothing() -> Result<()> {
    let mut ix = index(4)?;
    ix.insert_partial(&upto(10), &[1, 2, 3], 10)?;
    let before = ix.stats();
    let err = ix.insert_partial(&upto(12), &[4, 5], 10).unwrap_err();
    assert!(matches!(
        err,
        Error::Cache(CacheError::PartialBlockCount { blocks: 2, tokens: 10, block_size: 4 })
    ));
    let err = ix.insert_partial(&upto(12), &[4, 5, 6, 7], 10).unwrap_err();
    assert!(matches!(
        err,
        Error::Cache(CacheError::PartialBlockCount { blocks: 4, tokens: 10, block_size: 4 })
    ));
    let err = ix.insert_partial(&upto(10), &[4, 5, 6], 11).unwrap_err();
    assert!(matches!(err, Error::Cache(CacheError::TokensExceedPrompt { tokens: 11, prompt_len: 10 })));
    let err = ix.insert_partial(&text(0, &[9; 8]), &[4, 4], 6).unwrap_err();
    assert!(matches!(err, Error::Cache(CacheError::BlockAlreadyCached { block: 4 })), "repeated");
    let err = ix.insert_partial(&text(0, &[9; 8]), &[4, 3], 6).unwrap_err();
    assert!(
        matches!(err, Error::Cache(CacheError::BlockAlreadyCached { block: 3 })),
        "owned under other content"
    );
    // Writing past the cached partial block into the index's own id.
    let err = ix.insert_partial(&upto(12), &[1, 2, 3], 12).unwrap_err();
    assert!(
        matches!(err, Error::Cache(CacheError::BlockAlreadyCached { block: 3 })),
        "grows the index's block"
    );
    let mut broken = upto(10);
    broken.token_ids.pop();
    let err = ix.insert_partial(&broken, &[4, 5, 6], 9).unwrap_err();
    assert!(matches!(err, Error::Request(RequestError::AtomsLengthMismatch { atoms: 10, tokens: 9 })));
    assert_eq!(ix.stats(), before);
    valid(&ix)?;
    let empty = ix.insert_partial(&upto(10), &[], 0)?;
    assert_eq!(empty, Default::default());
    assert_eq!(ix.match_prefix(&upto(10)).blocks, vec![1, 2, 3]);
    Ok(())
}
