//! The engine's Prometheus metrics, with vLLM's meanings: prefix-cache
//! queries and hits counted in prompt tokens, preemptions, dropped KV events,
//! running and waiting requests, KV-cache usage, and TTFT / inter-token
//! latency histograms (one ITL observation per gap between two tokens of a
//! request), and time to first audio for requests that speak. The counters and gauges are read from their owners when the text
//! is rendered; only the histograms are kept here, observed as tokens come out.

use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use super::config::EngineStats;
use crate::error::{Component, Result};

/// vLLM's TTFT buckets (seconds).
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's inter-token latency buckets (seconds), with finer steps below 10 ms
/// for small models.
const ITL_BUCKETS: [f64; 22] = [
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0,
];

/// The latency histograms, observed by the engine as it emits tokens.
#[derive(Debug)]
pub(super) struct Latencies {
    ttft: Histogram,
    itl: Histogram,
    /// Time to first audio, of requests that asked for audio.
    ttfa: Histogram,
}

impl Default for Latencies {
    fn default() -> Self {
        Latencies {
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            ttfa: Histogram::new(TTFT_BUCKETS),
        }
    }
}

impl Latencies {
    /// A request's first token (a prefill: its output), `elapsed` after it was submitted.
    pub(super) fn first_token(&self, elapsed: Duration) {
        self.ttft.observe(elapsed.as_secs_f64());
    }

    /// A speaking request's first audio sample, `elapsed` after it was submitted
    /// (TTFT's buckets: the same scale, a few steps later).
    pub(super) fn first_audio(&self, elapsed: Duration) {
        self.ttfa.observe(elapsed.as_secs_f64());
    }

    /// The gap between two consecutive tokens of one request.
    pub(super) fn inter_token(&self, gap: Duration) {
        self.itl.observe(gap.as_secs_f64());
    }
}

/// What the gauges and counters read at render time.
pub(super) struct Reading<'a> {
    pub(super) stats: &'a EngineStats,
    pub(super) num_blocks: usize,
    /// KV events the publisher dropped (`None`: no publisher).
    pub(super) kv_events_dropped: Option<u64>,
    /// The disk tier's load latencies (`None`: no tier; its counters are in `stats`).
    pub(super) tier_load_seconds: Option<&'a Histogram>,
}

/// Registers each `(name, help, value)` row as a counter.
fn counters<const N: usize>(registry: &mut Registry, rows: [(&str, &str, u64); N]) {
    for (name, help, value) in rows {
        registry.register(name, help, ConstCounter::new(value));
    }
}

/// The metrics as Prometheus text (OpenMetrics, ending in `# EOF`).
pub(super) fn render(latencies: &Latencies, r: Reading<'_>) -> Result<String> {
    let s = &r.stats.sched;
    let mut registry = Registry::with_prefix("omniprefix");
    counters(
        &mut registry,
        [
            (
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache (each time a request starts)",
                s.query_tokens,
            ),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache", s.hit_tokens),
            ("num_preemptions", "Requests whose blocks were taken back (recomputed later)", s.preemptions),
            (
                "encoder_cache_hits",
                "Items of admitted requests whose embeddings came from the encoder cache",
                r.stats.encoder_cache_hits,
            ),
            ("encoder_calls", "Items the encoder ran for (encoder-cache misses)", r.stats.encoder_calls),
            (
                "kv_events_dropped",
                "KV events the publisher dropped (0 without a publisher)",
                r.kv_events_dropped.unwrap_or(0),
            ),
        ],
    );
    registry.register(
        "num_requests_running",
        "Requests admitted and not waiting",
        ConstGauge::new(s.running),
    );
    registry.register("num_requests_waiting", "Requests waiting to start", ConstGauge::new(s.waiting));
    let used = (s.blocks_in_use + s.blocks_cached) as f64 / r.num_blocks.max(1) as f64;
    registry.register(
        "kv_cache_usage_ratio",
        "KV blocks in use or cached over the pool",
        ConstGauge::<f64>::new(used),
    );
    if let Some(t) = &r.stats.talker {
        counters(
            &mut registry,
            [
                (
                    "talker_prefix_cache_queries",
                    "Talker prompt rows looked up in the talker's prefix cache",
                    t.query_rows,
                ),
                (
                    "talker_prefix_cache_hits",
                    "Talker prompt rows whose KV came from the talker's prefix cache",
                    t.hit_rows,
                ),
            ],
        );
        if r.stats.tier.is_some() {
            counters(
                &mut registry,
                [(
                    "talker_tier_hits",
                    "Talker prompt rows whose KV was loaded from the disk tier (of the cache's hits)",
                    t.tier_hit_rows,
                )],
            );
        }
    }
    if let (Some(t), Some(loads)) = (&r.stats.tier, r.tier_load_seconds) {
        counters(
            &mut registry,
            [
                ("tier_hits", "Prompt tokens whose KV and rows were loaded from the disk tier", t.hit_tokens),
                (
                    "tier_misses",
                    "Prompt tokens past the pool's match that the disk tier did not hold",
                    t.query_tokens - t.hit_tokens,
                ),
                (
                    "tier_errors",
                    "Tier files that failed a check (deleted) or could not be read or written",
                    t.files.errors,
                ),
                (
                    "tier_write_drops",
                    "Evicted blocks not written to the tier because its write queue was full",
                    t.files.write_drops,
                ),
            ],
        );
        registry.register(
            "tier_bytes",
            "Apparent bytes of the tier directory's block files",
            ConstGauge::new(t.files.bytes as i64),
        );
        registry.register_with_unit(
            "tier_load",
            "Reading and checking one block from the tier",
            Unit::Seconds,
            loads.clone(),
        );
    }
    registry.register_with_unit(
        "time_to_first_token",
        "From submission to the first token (a prefill: to its output)",
        Unit::Seconds,
        latencies.ttft.clone(),
    );
    registry.register_with_unit(
        "inter_token_latency",
        "Between two consecutive tokens of a request",
        Unit::Seconds,
        latencies.itl.clone(),
    );
    registry.register_with_unit(
        "time_to_first_audio",
        "From submission to the first audio sample of a request that asked for audio",
        Unit::Seconds,
        latencies.ttfa.clone(),
    );
    let mut text = String::new();
    encode(&mut text, &registry)
        .map_err(|e| Component::Engine.violation(format!("encoding the metrics: {e}")))?;
    Ok(text)
}
