//! Sampling settings the property suites draw: greedy, or seeded nucleus sampling.

use omniprefix::sample::SamplingParams;

/// `greedy` as it is without a seed; with one, seeded sampling at temperature 1,
/// top-k 20, top-p 0.95 over the same length, stop rule and suppressed ids: one
/// rule for every suite that checks a cached run against an uncached one, so both
/// sampling paths (the argmax and the seeded draw) are covered alike.
pub fn greedy_or_seeded(greedy: SamplingParams, seed: Option<u64>) -> SamplingParams {
    match seed {
        Some(seed) => SamplingParams {
            temperature: 1.0,
            top_k: Some(20),
            top_p: Some(0.95),
            seed: Some(seed),
            ..greedy
        },
        None => greedy,
    }
}
