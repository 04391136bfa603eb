//! Medians of the match paths of one workload, with ratios from the same run.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use super::fixture::MatchFixture;
use crate::error::Result;
use crate::workloads::{Media, Workload, WorkloadName};
use omniprefix::index::ValidationPolicy;

/// What to measure and how often.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MatchOptions {
    /// Fingerprint threads of the omniprefix paths (the hash chain runs on one, as vLLM does).
    pub threads: usize,
    /// Timed runs per path after one untimed warm-up run; the report holds medians.
    pub runs: usize,
    /// Validation policy of the omniprefix paths.
    pub policy: ValidationPolicy,
    /// Seed of the text ids.
    pub seed: u64,
}

impl Default for MatchOptions {
    fn default() -> Self {
        MatchOptions { threads: 1, runs: 11, policy: ValidationPolicy::default(), seed: 0 }
    }
}

/// Warm `omniprefix` medians of `mixed` under each validation policy, from the same run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PolicyFigures {
    pub second_digest: u64,
    pub exact_bytes: u64,
    pub unvalidated: u64,
}

/// One line of `bench match --json`: medians in nanoseconds.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MatchReport {
    pub workload: String,
    pub threads: usize,
    pub runs: usize,
    pub policy: ValidationPolicy,
    /// Expanded length of the measured request.
    pub prompt_tokens: usize,
    /// Bytes the measured request carries (raw items + unexpanded token ids).
    pub input_bytes: usize,
    /// One plain single-threaded read of `input_bytes`.
    pub read_floor_ns: u64,
    /// Preprocess (canonicalise + fingerprint + build) + match on an empty index.
    pub omniprefix_cold_ns: u64,
    /// Preprocess + validated match on the warm index.
    pub omniprefix_warm_ns: u64,
    /// vLLM's path, single-threaded: BLAKE3 mm hashes + SHA-256 block chain + lookup.
    pub hashchain_ns: u64,
    /// Radix match alone on the warm index.
    pub radix_match_ns: u64,
    /// Block chain + lookup alone (mm hashes known).
    pub hashchain_chain_ns: u64,
    /// Tokens the warm radix match reports (exact, not block-aligned).
    pub matched_tokens_warm: usize,
    /// Tokens the warm hash chain reports (whole blocks).
    pub hashchain_matched_tokens_warm: usize,
    /// Radix index-structure bytes per cached token (excluding KV and retained bytes).
    pub index_bytes_per_token: f64,
    pub cold_over_read_floor: f64,
    pub warm_over_read_floor: f64,
    pub hashchain_over_warm: f64,
    pub chain_over_radix_match: f64,
    /// `mixed` only: warm medians under every validation policy.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub warm_ns_by_policy: Option<PolicyFigures>,
}

/// Median wall time of `runs` calls of `f` (at least one) after one untimed call.
pub fn median_ns<T>(runs: usize, mut f: impl FnMut() -> Result<T>) -> Result<u64> {
    black_box(f()?);
    let mut times = Vec::with_capacity(runs.max(1));
    for _ in 0..runs.max(1) {
        let start = Instant::now();
        black_box(f()?);
        times.push(u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX));
    }
    times.sort_unstable();
    Ok(times[times.len() / 2])
}

fn ratio(num: u64, den: u64) -> f64 {
    num as f64 / den.max(1) as f64
}

/// Measures every path of workload `name` over `media`.
///
/// ```
/// use std::sync::Arc;
/// use omniprefix_cli::bench::{MatchOptions, measure};
/// use omniprefix_cli::workloads::{Media, MediaScale, WorkloadName};
///
/// let media = Arc::new(Media::generate(MediaScale::Tiny, 0)?);
/// let options = MatchOptions { runs: 1, ..Default::default() };
/// let report = measure(WorkloadName::Text1k, &media, &options)?;
/// assert_eq!((report.prompt_tokens, report.matched_tokens_warm), (1024, 921));
/// # Ok::<(), omniprefix_cli::HarnessError>(())
/// ```
pub fn measure(name: WorkloadName, media: &Arc<Media>, options: &MatchOptions) -> Result<MatchReport> {
    let runs = options.runs;
    let fixture = |policy| -> Result<MatchFixture> {
        MatchFixture::new(Workload::new(name, Arc::clone(media), options.seed)?, options.threads, policy)
    };
    let mut f = fixture(options.policy)?;
    let read_floor_ns = median_ns(runs, || Ok(f.read_floor()))?;
    let omniprefix_cold_ns = median_ns(runs, || f.omniprefix_cold())?;
    let omniprefix_warm_ns = median_ns(runs, || f.omniprefix_warm())?;
    let hashchain_ns = median_ns(runs, || f.hashchain())?;
    let radix_match_ns = median_ns(runs, || Ok(f.radix_match()))?;
    let hashchain_chain_ns = median_ns(runs, || f.hashchain_chain())?;
    let warm_ns_by_policy = if name == WorkloadName::Mixed {
        let warm = |policy| -> Result<u64> {
            let mut f = fixture(policy)?;
            median_ns(runs, || f.omniprefix_warm())
        };
        Some(PolicyFigures {
            second_digest: warm(ValidationPolicy::SecondDigest)?,
            exact_bytes: warm(ValidationPolicy::ExactBytes)?,
            unvalidated: warm(ValidationPolicy::Unvalidated)?,
        })
    } else {
        None
    };
    Ok(MatchReport {
        workload: name.to_string(),
        threads: f.threads(),
        runs,
        policy: f.policy(),
        prompt_tokens: f.prompt().len(),
        input_bytes: f.workload.input_bytes(),
        read_floor_ns,
        omniprefix_cold_ns,
        omniprefix_warm_ns,
        hashchain_ns,
        radix_match_ns,
        hashchain_chain_ns,
        matched_tokens_warm: f.omniprefix_warm()?.tokens,
        hashchain_matched_tokens_warm: f.hashchain_chain()?.tokens,
        index_bytes_per_token: f.radix_bytes_per_token(),
        cold_over_read_floor: ratio(omniprefix_cold_ns, read_floor_ns),
        warm_over_read_floor: ratio(omniprefix_warm_ns, read_floor_ns),
        hashchain_over_warm: ratio(hashchain_ns, omniprefix_warm_ns),
        chain_over_radix_match: ratio(hashchain_chain_ns, radix_match_ns),
        warm_ns_by_policy,
    })
}
