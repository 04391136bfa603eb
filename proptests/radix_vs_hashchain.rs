//! The two prefix indexes and a brute-force oracle agree on random workloads.
//!
//! Tiny vocabulary and few item contents force sharing. Both indexes get the
//! same inserts; for every query the radix index must report exactly the
//! oracle's longest common prefix with a cached prompt of the same tenant, and
//! the hash chain (block granular, as vLLM is) exactly that length rounded
//! down to whole blocks — the radix index's `aligned_tokens`.
//!
//! Some inserts are partial (`insert_partial`, a finished sequence's partly
//! filled last block). There the two differ by design: the radix index caches
//! the partial block, the hash chain (as vLLM) only the full ones and hands the
//! partial block back. So the radix index answers the exact oracle, the hash
//! chain the oracle of the block-aligned prefixes, and on every insert both
//! treat the full blocks alike.

use support::cases;
use support::index_oracle as common;

use common::{ItemModel, Oracle, Piece, pieces};
use omniprefix::index::hashchain::HashChainIndex;
use omniprefix::index::radix::{RadixConfig, RadixIndex};
use omniprefix::index::{PrefixIndex, ValidationPolicy};
use proptest::prelude::*;
use proptest::sample::Index;

const BS: usize = 4;
const STRONG: ItemModel = ItemModel { rows: 3, fp_bits: None, policy: ValidationPolicy::SecondDigest };

type Inserts = Vec<(u64, Vec<Piece>, f64, bool)>;
type Queries = Vec<(u64, Index, usize, Vec<Piece>)>;

fn workload() -> impl Strategy<Value = (Inserts, Queries)> {
    (
        prop::collection::vec((0..3u64, pieces(3, 4, 6), 0.0..=1.0f64, prop::bool::weighted(0.3)), 1..10),
        prop::collection::vec((0..3u64, any::<Index>(), 0..6usize, pieces(3, 4, 3)), 1..10),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(128)))]

    #[test]
    fn radix_hashchain_and_oracle_agree((inserts, queries) in workload()) {
        let mut radix = RadixIndex::new(RadixConfig { block_size: BS })
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut chain = HashChainIndex::new(BS).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut oracle = Oracle::default();
        let mut aligned_oracle = Oracle::default();
        let mut next_block = 0u32;
        for (tenant, p, frac, partial) in &inserts {
            let (prompt, truth) = STRONG.build(*tenant, p);
            let tokens = if *partial {
                (truth.len() as f64 * frac) as usize
            } else {
                ((truth.len() / BS) as f64 * frac) as usize * BS
            };
            let (k, full) = (tokens.div_ceil(BS), tokens / BS);
            let blocks: Vec<u32> = (next_block..next_block + k as u32).collect();
            next_block += k as u32;
            let (r, h) = if *partial {
                (radix.insert_partial(&prompt, &blocks, tokens), chain.insert_partial(&prompt, &blocks, tokens))
            } else {
                (radix.insert(&prompt, &blocks), chain.insert(&prompt, &blocks))
            };
            let r = r.map_err(|e| TestCaseError::fail(format!("radix insert: {e}")))?;
            let h = h.map_err(|e| TestCaseError::fail(format!("chain insert: {e}")))?;
            // Full blocks alike; the partial block is the chain's duplicate.
            let full_part = |v: &[u32]| v.iter().filter(|b| blocks[..full].contains(b)).copied().collect::<Vec<u32>>();
            prop_assert_eq!(full_part(&r.adopted), full_part(&h.adopted));
            prop_assert_eq!(full_part(&r.duplicates), full_part(&h.duplicates));
            prop_assert_eq!(h.adopted.len() + h.duplicates.len(), k);
            prop_assert!(h.released.is_empty());
            if k > full {
                prop_assert!(h.duplicates.contains(&blocks[full]), "the chain hands the partial block back");
            }
            prop_assert_eq!(h.cached.tokens, if k == 0 { 0 } else { full * BS });
            prop_assert_eq!(&r.cached.blocks[..full.min(r.cached.blocks.len())], &h.cached.blocks[..]);
            oracle.insert(*tenant, &truth[..tokens]);
            aligned_oracle.insert(*tenant, &truth[..full * BS]);
        }
        for (tenant, base, keep, extra) in &queries {
            let (_, base_pieces, _, _) = &inserts[base.index(inserts.len())];
            let mut q: Vec<Piece> = base_pieces.iter().take(*keep).cloned().collect();
            q.extend(extra.iter().cloned());
            let (prompt, truth) = STRONG.build(*tenant, &q);
            let expected = oracle.longest(*tenant, &truth);
            let aligned = aligned_oracle.longest(*tenant, &truth) / BS * BS;
            let r = radix.match_prefix(&prompt);
            let h = chain.match_prefix(&prompt);
            prop_assert_eq!(r.tokens, expected, "radix exact length vs oracle for {:?}", q);
            prop_assert_eq!(r.aligned_tokens, expected / BS * BS);
            prop_assert_eq!(h.tokens, aligned, "hash chain vs aligned oracle (block granular) for {:?}", q);
            prop_assert_eq!(h.aligned_tokens, h.tokens);
            prop_assert_eq!(h.blocks.len(), h.tokens / BS);
        }
        radix.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
        chain.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}
