//! No wrong hit under forced fingerprint collisions.
//!
//! Items get a WEAK fingerprint (2 low bits of their content id) while their
//! second digest and retained bytes come from the true content. With
//! validation on, every match must equal the brute-force oracle's longest
//! common prefix with a cached prompt of the same tenant; with validation off
//! the same generator must find wrong hits (so this fuzzer can fail).

use support::cases;
use support::index_oracle as common;

use common::{ItemModel, Ledger, Oracle, Piece, pieces};
use omniprefix::index::radix::{RadixConfig, RadixIndex};
use omniprefix::index::{PrefixIndex, ValidationPolicy};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestRng, TestRunner};

const BS: usize = 4;
const WEAK: ItemModel = ItemModel { rows: 3, fp_bits: Some(2), policy: ValidationPolicy::SecondDigest };

/// Inserts (tenant, pieces, fraction of full blocks to cache), then queries
/// (tenant, which insert to start from, how many of its pieces to keep, extra pieces).
type Scenario = (Vec<(u64, Vec<Piece>, f64)>, Vec<(u64, Index, usize, Vec<Piece>)>);

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        prop::collection::vec((0..2u64, pieces(3, 8, 5), 0.0..=1.0f64), 1..8),
        prop::collection::vec((0..2u64, any::<Index>(), 0..5usize, pieces(3, 8, 3)), 1..8),
    )
}

/// What one scenario showed under one policy.
#[derive(Debug, Default)]
struct Report {
    /// Matches longer than the oracle allows.
    wrong_hits: usize,
    /// Matches shorter than the oracle (validated policies must have none).
    short_hits: usize,
    validation_failures: u64,
    /// Ledger or invariant violations.
    errors: Vec<String>,
}

/// `policy` is the fingerprinter's: it decides the evidence the items carry.
fn run(policy: ValidationPolicy, (inserts, queries): &Scenario) -> Report {
    let mut report = Report::default();
    let items = WEAK.with_policy(policy);
    let config = RadixConfig { block_size: BS };
    let Ok(mut index) = RadixIndex::new(config) else {
        report.errors.push("config rejected".into());
        return report;
    };
    let (mut oracle, mut ledger, mut next_id) = (Oracle::default(), Ledger::default(), 0u32);
    for (tenant, p, frac) in inserts {
        let (prompt, truth) = items.build(*tenant, p);
        let k = ((truth.len() / BS) as f64 * frac) as usize;
        let blocks: Vec<u32> = (next_id..next_id + k as u32).collect();
        next_id += k as u32;
        match index.insert(&prompt, &blocks) {
            Ok(out) => ledger.adopt(*tenant, &truth, BS, &blocks, &out.adopted),
            Err(e) => report.errors.push(format!("insert failed: {e}")),
        }
        oracle.insert(*tenant, &truth[..k * BS]);
    }
    for (tenant, base, keep, extra) in queries {
        let (_, base_pieces, _) = &inserts[base.index(inserts.len())];
        let mut q: Vec<Piece> = base_pieces.iter().take(*keep).cloned().collect();
        q.extend(extra.iter().cloned());
        let (prompt, truth) = items.build(*tenant, &q);
        let m = index.match_prefix(&prompt);
        let expected = oracle.longest(*tenant, &truth);
        if m.tokens > expected {
            report.wrong_hits += 1;
        } else if m.tokens < expected {
            report.short_hits += 1;
        } else if let Err(e) = ledger.check(*tenant, &truth, BS, &m) {
            report.errors.push(e);
        }
    }
    if let Err(e) = index.validate() {
        report.errors.push(e.to_string());
    }
    report.validation_failures = index.stats().validation_failures;
    report
}

fn validated_matches_equal_oracle(policy: ValidationPolicy) {
    let config = Config { cases: cases(256), ..Config::default() };
    proptest!(config, |(s in scenario())| {
        let r = run(policy, &s);
        prop_assert!(r.errors.is_empty(), "{:?}", r.errors);
        prop_assert_eq!((r.wrong_hits, r.short_hits), (0, 0));
    });
}

#[test]
fn second_digest_never_gives_a_wrong_hit() {
    validated_matches_equal_oracle(ValidationPolicy::SecondDigest);
}

#[test]
fn exact_bytes_never_gives_a_wrong_hit() {
    validated_matches_equal_oracle(ValidationPolicy::ExactBytes);
}

/// The same generator with validation off finds wrong hits, and with it on
/// the collisions it meets show up as validation failures instead.
#[test]
fn unvalidated_fingerprints_do_give_wrong_hits() {
    let config = Config { cases: cases(256), ..Config::default() };
    let mut runner =
        TestRunner::new_with_rng(config.clone(), TestRng::deterministic_rng(config.rng_algorithm));
    let (mut wrong, mut failures) = (0, 0);
    for _ in 0..config.cases {
        let s = scenario().new_tree(&mut runner).expect("strategy yields a value").current();
        wrong += run(ValidationPolicy::Unvalidated, &s).wrong_hits;
        let checked = run(ValidationPolicy::SecondDigest, &s);
        assert_eq!(checked.wrong_hits, 0);
        failures += checked.validation_failures;
    }
    assert!(wrong > 0, "the weak-fingerprint fuzzer found no wrong hit without validation");
    assert!(failures > 0, "no collision reached validation");
}
