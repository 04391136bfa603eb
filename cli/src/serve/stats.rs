//! What one `bench serve` run reports: per-request samples in, percentiles
//! and throughput out (one JSON line per workload, cache mode and arrival).

use std::time::Duration;

use serde::Serialize;

use super::arrival::Arrival;

/// The `p`-th percentile (0..=100) of `values` with linear interpolation
/// between the closest ranks (numpy's default, which `vllm bench serve` uses);
/// NaN when empty.
///
/// ```
/// use omniprefix_cli::serve::percentile;
/// assert_eq!(percentile(&[4.0, 1.0, 3.0, 2.0], 50.0), 2.5);
/// assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0, 5.0], 99.0), 4.96);
/// assert!(percentile(&[], 50.0).is_nan());
/// ```
pub fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let Some(last) = sorted.len().checked_sub(1) else { return f64::NAN };
    let rank = p.clamp(0.0, 100.0) / 100.0 * last as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// What the harness saw of one finished request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestSample {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub output_tokens: usize,
    /// Arrival to the step that returned the first token.
    pub ttft: Duration,
    /// Gaps between the steps that returned consecutive tokens.
    pub itl: Vec<Duration>,
    /// When each gap of `itl` ended, from the start of the run.
    pub itl_at: Vec<Duration>,
}

/// Every inter-token gap of a run as `[seconds since its start, gap in ms]`, by time.
pub fn itl_trace(samples: &[RequestSample]) -> Vec<[f64; 2]> {
    let mut trace: Vec<[f64; 2]> = samples
        .iter()
        .flat_map(|s| {
            s.itl_at.iter().zip(&s.itl).map(|(at, gap)| [at.as_secs_f64(), gap.as_secs_f64() * 1e3])
        })
        .collect();
    trace.sort_by(|a, b| a[0].total_cmp(&b[0]));
    trace
}

/// One line of `bench serve --json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServeReport {
    pub workload: String,
    /// The backend the model ran on (`cpu`, `wgpu`).
    pub backend: &'static str,
    /// Prefix caching on or off (the same model, seed and requests otherwise).
    pub cache: bool,
    /// Closed loop: requests in flight (`None` for a Poisson run).
    pub concurrency: Option<usize>,
    /// Open loop: Poisson arrivals per second (`None` for a closed-loop run).
    pub rate: Option<f64>,
    /// The scheduling policy: new tokens per step, and the prefill tokens a
    /// step that carries decodes may add (equal to the budget: uncapped).
    pub max_tokens_per_step: usize,
    pub prefill_cap: usize,
    /// Prompts longer than the cap a step may prefill (1 under a cap; `null` uncapped).
    pub long_prefills_per_step: Option<usize>,
    pub requests: usize,
    pub prompt_tokens: usize,
    /// Prompt tokens served from the cache.
    pub cached_tokens: usize,
    /// `cached_tokens / prompt_tokens`.
    pub hit_rate: f64,
    pub output_tokens: usize,
    /// From the first arrival to the last token.
    pub duration_s: f64,
    pub request_throughput: f64,
    /// `output_tokens / duration_s`.
    pub output_tokens_per_s: f64,
    pub ttft_ms_p50: f64,
    pub ttft_ms_p99: f64,
    pub itl_ms_p50: f64,
    pub itl_ms_p99: f64,
    /// What the stand-in encoder slept per item it encoded.
    pub encoder_ms: u64,
    /// Items the stand-in encoder was called for (encoder-cache misses).
    pub encoder_calls: u64,
    /// The KV-event publisher's counters, with `--kv-events`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<omniprefix::events::PublisherStats>,
    /// With `--trace`: every inter-token gap as `[seconds since the run started, ms]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub itl_trace: Option<Vec<[f64; 2]>>,
    /// `many_clients`: which engine ran, its pool against the working set, and each round.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub many_clients: Option<ClientsReport>,
}

/// The engines `many_clients` compares on the same requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClientsEngine {
    /// A pool of about a tenth of the working set, no tier: the fall.
    Pool,
    /// The same pool over a disk tier in a fresh directory.
    PoolTier,
    /// A pool that holds the whole working set: the ceiling.
    Unbounded,
    /// Pool + tier, the engine dropped and rebuilt on the same directory and key halfway.
    Restart,
}

impl ClientsEngine {
    /// Every engine, in the order they run and are printed.
    pub const ALL: [ClientsEngine; 4] =
        [ClientsEngine::Pool, ClientsEngine::PoolTier, ClientsEngine::Unbounded, ClientsEngine::Restart];

    /// The name the report and the table use.
    pub fn name(self) -> &'static str {
        match self {
            ClientsEngine::Pool => "pool",
            ClientsEngine::PoolTier => "pool_tier",
            ClientsEngine::Unbounded => "unbounded",
            ClientsEngine::Restart => "restart",
        }
    }
}

/// What one `many_clients` engine saw: its sizes and every round's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClientsReport {
    pub engine: ClientsEngine,
    pub conversations: usize,
    /// Closed loop: requests in flight within a round.
    pub concurrency: usize,
    /// KV blocks of the pool, and of every conversation's last round together.
    pub pool_blocks: usize,
    pub working_set_blocks: usize,
    /// `restart`: the first round (1-based) run by the rebuilt engine.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub restart_round: Option<usize>,
    /// The tier's counters of the last engine (after a restart, the rebuilt one's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<omniprefix::engine::TierEngineStats>,
    pub rounds: Vec<RoundReport>,
}

/// One round of every conversation: the requests that re-sent history `round`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoundReport {
    /// 1-based.
    pub round: usize,
    pub requests: usize,
    pub prompt_tokens: usize,
    /// Prompt tokens served from the pool or the tier; `hit_rate` is their share.
    pub cached_tokens: usize,
    pub hit_rate: f64,
    /// Of `cached_tokens`, those loaded from the tier during the round.
    pub tier_hit_tokens: u64,
    pub ttft_ms_p50: f64,
}

impl RoundReport {
    /// Hit rate and TTFT p50 of round `round`'s `samples`.
    pub fn new(round: usize, samples: &[RequestSample], tier_hit_tokens: u64) -> Self {
        let prompt_tokens = samples.iter().map(|s| s.prompt_tokens).sum::<usize>();
        let cached_tokens = samples.iter().map(|s| s.cached_tokens).sum::<usize>();
        let ttft: Vec<f64> = samples.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
        RoundReport {
            round,
            requests: samples.len(),
            prompt_tokens,
            cached_tokens,
            hit_rate: cached_tokens as f64 / prompt_tokens.max(1) as f64,
            tier_hit_tokens,
            ttft_ms_p50: percentile(&ttft, 50.0),
        }
    }
}

/// Where a run's report lines come from: its name, settings and samples.
#[derive(Debug, Clone)]
pub struct RunFacts<'a> {
    pub workload: &'a str,
    pub backend: &'static str,
    pub cache: bool,
    pub arrival: Arrival,
    /// The scheduler's step budget and prefill cap beside decodes.
    pub max_tokens_per_step: usize,
    pub prefill_cap: usize,
    pub long_prefills_per_step: Option<usize>,
    pub duration: Duration,
    /// The stand-in encoder's sleep per item, and how many items it encoded.
    pub encoder_ms: u64,
    pub encoder_calls: u64,
}

impl ServeReport {
    /// Percentiles and throughput of `samples`.
    pub fn new(facts: RunFacts<'_>, samples: &[RequestSample]) -> Self {
        let ms = |d: &Duration| d.as_secs_f64() * 1e3;
        let ttft: Vec<f64> = samples.iter().map(|s| ms(&s.ttft)).collect();
        let itl: Vec<f64> = samples.iter().flat_map(|s| s.itl.iter().map(ms)).collect();
        let prompt_tokens = samples.iter().map(|s| s.prompt_tokens).sum::<usize>();
        let cached_tokens = samples.iter().map(|s| s.cached_tokens).sum::<usize>();
        let output_tokens = samples.iter().map(|s| s.output_tokens).sum::<usize>();
        let secs = facts.duration.as_secs_f64();
        let (concurrency, rate) = match facts.arrival {
            Arrival::Concurrency(c) => (Some(c), None),
            Arrival::Poisson { rate } => (None, Some(rate)),
        };
        ServeReport {
            workload: facts.workload.to_string(),
            backend: facts.backend,
            cache: facts.cache,
            concurrency,
            rate,
            max_tokens_per_step: facts.max_tokens_per_step,
            prefill_cap: facts.prefill_cap,
            long_prefills_per_step: facts.long_prefills_per_step,
            requests: samples.len(),
            prompt_tokens,
            cached_tokens,
            hit_rate: cached_tokens as f64 / prompt_tokens.max(1) as f64,
            output_tokens,
            duration_s: secs,
            request_throughput: samples.len() as f64 / secs,
            output_tokens_per_s: output_tokens as f64 / secs,
            ttft_ms_p50: percentile(&ttft, 50.0),
            ttft_ms_p99: percentile(&ttft, 99.0),
            itl_ms_p50: percentile(&itl, 50.0),
            itl_ms_p99: percentile(&itl, 99.0),
            encoder_ms: facts.encoder_ms,
            encoder_calls: facts.encoder_calls,
            kv_events: None,
            itl_trace: None,
            many_clients: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_sums_tokens_and_takes_percentiles_over_every_gap() {
        let ms = Duration::from_millis;
        let sample = |cached, ttft, itl: &[u64]| RequestSample {
            prompt_tokens: 100,
            cached_tokens: cached,
            output_tokens: itl.len() + 1,
            ttft: ms(ttft),
            itl: itl.iter().map(|&v| ms(v)).collect(),
            // Each gap ends 10 ms after the previous one, from ttft on.
            itl_at: (1..=itl.len() as u64).map(|i| ms(ttft + 10 * i)).collect(),
        };
        let arrival = Arrival::Concurrency(2);
        let facts = RunFacts {
            workload: "w",
            backend: "cpu",
            cache: true,
            arrival,
            max_tokens_per_step: 2048,
            prefill_cap: 256,
            long_prefills_per_step: Some(1),
            duration: ms(500),
            encoder_ms: 0,
            encoder_calls: 3,
        };
        let r = ServeReport::new(facts, &[sample(50, 10, &[1, 2]), sample(0, 30, &[3])]);
        assert_eq!((r.requests, r.prompt_tokens, r.cached_tokens, r.output_tokens), (2, 200, 50, 5));
        assert_eq!((r.hit_rate, r.output_tokens_per_s, r.request_throughput), (0.25, 10.0, 4.0));
        assert_eq!((r.ttft_ms_p50, r.itl_ms_p50), (20.0, 2.0));
        assert_eq!((r.concurrency, r.rate, r.encoder_calls), (Some(2), None, 3));
        assert!((r.ttft_ms_p99 - 29.8).abs() < 1e-9);
        // The trace: every gap with its end time, in time order across requests.
        let trace = itl_trace(&[sample(50, 10, &[1, 2]), sample(0, 15, &[3])]);
        assert_eq!(trace, vec![[0.02, 1.0], [0.025, 3.0], [0.03, 2.0]]);
    }
}
