//! `Engine::metrics()` / `ServedEngine::metrics()`: the Prometheus text agrees
//! with the calls made (prompt tokens queried and hit, one TTFT per request,
//! one ITL per gap between two tokens) and with the engine's own counters.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use omniprefix::engine::{Engine, EngineConfig, Request, ServedOptions};
use omniprefix::model::Config;
use omniprefix::sample::SamplingParams;
use omniprefix::sched::SchedulerConfig;

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

fn engine() -> TestResult<Engine> {
    let config = EngineConfig {
        scheduler: SchedulerConfig { block_size: 4, num_blocks: 32, ..Default::default() },
        ..Default::default()
    };
    Ok(Engine::random(Config::tiny_qwen3(32, 2, 4, 2, 600), 1, config)?)
}

/// Every sample line of the text: name (with labels) → value.
fn samples(text: &str) -> TestResult<HashMap<String, f64>> {
    let mut out = HashMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (name, value) = line.rsplit_once(' ').ok_or_else(|| format!("not a sample: {line}"))?;
        out.insert(name.to_string(), value.parse()?);
    }
    Ok(out)
}

fn get(samples: &HashMap<String, f64>, name: &str) -> TestResult<f64> {
    samples.get(name).copied().ok_or_else(|| format!("no sample {name}").into())
}

#[test]
fn metrics_count_what_ran() -> TestResult {
    let mut engine = engine()?;
    let prompts: [Vec<u32>; 3] = [(0..10).collect(), (0..14).collect(), (100..109).collect()];
    let generated = [5, 3, 1];
    for (prompt, n) in prompts.iter().zip(generated) {
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(n) };
        engine.run(Request::text(prompt.clone()).generate(params))?;
    }
    engine.run(Request::text((0..6).collect()))?;
    let m = samples(&engine.metrics()?)?;
    let stats = engine.stats();
    // Queried: every prompt once; hit: the second prompt reuses the first's 10 positions and more.
    assert_eq!(get(&m, "omniprefix_prefix_cache_queries_total")?, (10 + 14 + 9 + 6) as f64);
    assert_eq!(get(&m, "omniprefix_prefix_cache_hits_total")?, stats.sched.hit_tokens as f64);
    assert!(stats.sched.hit_tokens >= 10 + 5);
    assert_eq!(get(&m, "omniprefix_num_preemptions_total")?, 0.0);
    assert_eq!(get(&m, "omniprefix_kv_events_dropped_total")?, 0.0);
    // Text only: no item was encoded or served from the encoder cache.
    assert_eq!(
        (get(&m, "omniprefix_encoder_calls_total")?, get(&m, "omniprefix_encoder_cache_hits_total")?),
        (0.0, 0.0)
    );
    // One TTFT per request (the prefill's at its output), one ITL per gap.
    assert_eq!(get(&m, "omniprefix_time_to_first_token_seconds_count")?, 4.0);
    assert_eq!(get(&m, "omniprefix_inter_token_latency_seconds_count")?, 6.0 /* 4 + 2 + 0 gaps */);
    assert_eq!(get(&m, "omniprefix_inter_token_latency_seconds_bucket{le=\"+Inf\"}")?, 6.0);
    assert_eq!(get(&m, "omniprefix_num_requests_running")?, 0.0);
    assert_eq!(get(&m, "omniprefix_num_requests_waiting")?, 0.0);
    let used = (stats.sched.blocks_in_use + stats.sched.blocks_cached) as f64 / 32.0;
    assert_eq!(get(&m, "omniprefix_kv_cache_usage_ratio")?, used);
    assert!(used > 0.0);
    Ok(())
}

#[test]
fn a_served_engine_reports_a_held_request_as_running() -> TestResult {
    let served = engine()?.serve(ServedOptions { buffer_events: 1, ..ServedOptions::default() })?;
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(20) };
    let handle = served.submit(Request::text((0..8).collect()).generate(params))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while handle.buffered() < 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    let m = samples(&served.metrics()?)?;
    assert_eq!(get(&m, "omniprefix_num_requests_running")?, 1.0, "held, unread");
    assert_eq!(get(&m, "omniprefix_time_to_first_token_seconds_count")?, 1.0);
    assert_eq!(get(&m, "omniprefix_prefix_cache_queries_total")?, 8.0);
    Ok(())
}
