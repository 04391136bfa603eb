//! The two prefix indexes and a brute-force oracle agree on random workloads.
//!
//! Tiny vocabulary and few item contents force sharing. Both indexes get the
//! same inserts; for every query the radix index must report exactly the
//! oracle's longest common prefix with a cached prompt of the same tenant, and
//! the hash chain (block granular, as vLLM is) exactly that length rounded
//! down to whole blocks — the radix index's `aligned_tokens`.

mod common;

use common::{cases, pieces, ItemModel, Oracle, Piece};
use omniprefix::index::hashchain::HashChainIndex;
use omniprefix::index::radix::{RadixConfig, RadixIndex};
use omniprefix::index::{PrefixIndex, ValidationPolicy};
use proptest::prelude::*;
use proptest::sample::Index;

const BS: usize = 4;
const STRONG: ItemModel = ItemModel { rows: 3, fp_bits: None, policy: ValidationPolicy::SecondDigest };

type Inserts = Vec<(u64, Vec<Piece>, f64)>;
type Queries = Vec<(u64, Index, usize, Vec<Piece>)>;

fn workload() -> impl Strategy<Value = (Inserts, Queries)> {
    (
        prop::collection::vec((0..3u64, pieces(3, 4, 6), 0.0..=1.0f64), 1..10),
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
        let mut next_block = 0u32;
        for (tenant, p, frac) in &inserts {
            let (prompt, truth) = STRONG.build(*tenant, p);
            let k = ((truth.len() / BS) as f64 * frac) as usize;
            let blocks: Vec<u32> = (next_block..next_block + k as u32).collect();
            next_block += k as u32;
            radix.insert(&prompt, &blocks).map_err(|e| TestCaseError::fail(format!("radix insert: {e}")))?;
            chain.insert(&prompt, &blocks).map_err(|e| TestCaseError::fail(format!("chain insert: {e}")))?;
            oracle.insert(*tenant, &truth[..k * BS]);
        }
        for (tenant, base, keep, extra) in &queries {
            let (_, base_pieces, _) = &inserts[base.index(inserts.len())];
            let mut q: Vec<Piece> = base_pieces.iter().take(*keep).cloned().collect();
            q.extend(extra.iter().cloned());
            let (prompt, truth) = STRONG.build(*tenant, &q);
            let expected = oracle.longest(*tenant, &truth);
            let r = radix.match_prefix(&prompt);
            let h = chain.match_prefix(&prompt);
            prop_assert_eq!(r.tokens, expected, "radix exact length vs oracle for {:?}", q);
            prop_assert_eq!(r.aligned_tokens, expected / BS * BS);
            prop_assert_eq!(h.tokens, expected / BS * BS, "hash chain vs oracle (block granular) for {:?}", q);
            prop_assert_eq!(h.aligned_tokens, h.tokens);
            prop_assert_eq!(h.blocks.len(), h.tokens / BS);
        }
        radix.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
        chain.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}
