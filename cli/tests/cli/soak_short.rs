//! A short soak in CI: 2000 requests with Zipf prefix reuse (text, images,
//! audio) through a pool far smaller than the working set. Nothing leaks,
//! the cache is reused, eviction runs, and the index stays bounded.
//! `SOAK_REQUESTS=100000 cargo test --release --test cli soak_short:: -- --ignored`
//! runs the full soak and prints its JSON report.

use super::common::TestResult;
use omniprefix_cli::Result;
use omniprefix_cli::soak::{SoakOptions, run_soak};

/// A test that can also fail outside omniprefix (output that is not the JSON it should be).

#[test]
fn short_soak_leaks_nothing_and_reuses_under_eviction() -> Result<()> {
    let options =
        SoakOptions { requests: 2000, pool_blocks: 256, prefixes: 1024, seed: 7, ..SoakOptions::default() };
    let report = run_soak(&options)?;
    report.check()?;
    assert_eq!(report.leaked_blocks, 0);
    assert!(
        report.working_set_blocks > 4 * options.pool_blocks,
        "working set {} blocks",
        report.working_set_blocks
    );
    assert!(report.evicted_blocks > 0, "{report:?}");
    assert!(report.hit_rate > 0.3 && report.hit_rate <= 1.0, "hit rate {}", report.hit_rate);
    assert!(report.hit_tokens > 0 && report.hit_tokens < report.prompt_tokens);
    // The index never owns more blocks than the pool has, so its nodes stay bounded.
    for s in &report.samples {
        assert!(s.cached_blocks as usize <= options.pool_blocks, "{s:?}");
        assert!(s.index_nodes as usize <= 2 * options.pool_blocks + 64, "{s:?}");
    }
    assert_eq!(report.samples.last().map(|s| s.requests), Some(2000));
    Ok(())
}

#[test]
fn same_seed_same_figures() -> Result<()> {
    let options =
        SoakOptions { requests: 300, pool_blocks: 64, prefixes: 128, seed: 3, ..SoakOptions::default() };
    let (a, b) = (run_soak(&options)?, run_soak(&options)?);
    assert_eq!((a.hits, a.hit_tokens, a.evicted_blocks), (b.hits, b.hit_tokens, b.evicted_blocks));
    Ok(())
}

/// `omniprefix bench soak --json` with `args`, in this process; its report.
fn bench_soak(args: &[&str]) -> TestResult<serde_json::Value> {
    use clap::Parser;
    let cli = omniprefix_cli::cli::Cli::try_parse_from(
        ["omniprefix", "bench", "soak", "--json"].iter().chain(args),
    )?;
    let mut out = Vec::new();
    omniprefix_cli::cli::run(cli, &mut out)?;
    Ok(serde_json::from_slice(&out)?)
}

#[test]
fn bench_soak_cli_prints_json_with_zero_leaks() -> TestResult {
    let json = bench_soak(&["--requests", "400", "--pool-blocks", "64", "--prefixes", "256"])?;
    assert_eq!(json["requests"], 400);
    assert_eq!(json["leaked_blocks"], 0);
    assert!(json["evicted_blocks"].as_u64().is_some_and(|e| e > 0), "{json}");
    assert!(json["peak_rss_kib"].as_u64().is_some());
    Ok(())
}

#[test]
fn soak_publishes_kv_events_without_drops_and_reports_the_index_size() -> TestResult {
    let key = "5a".repeat(32);
    let json = bench_soak(&[
        "--requests",
        "600",
        "--pool-blocks",
        "64",
        "--prefixes",
        "256",
        "--kv-events",
        "tcp://127.0.0.1:0",
        "--kv-replay",
        "tcp://127.0.0.1:0",
        "--fingerprint-key",
        &key,
    ])?;
    let index_blocks = json["index_blocks"].as_u64().ok_or("index_blocks")?;
    let published = json["published_blocks"].as_u64().ok_or("published_blocks")?;
    // The pool is full of cached blocks at the end; most of them full (published) ones.
    assert!(index_blocks <= 64 && index_blocks > 32, "{json}");
    assert!(published <= index_blocks && published > index_blocks / 2, "{json}");
    let stats = &json["kv_events"];
    assert_eq!(stats["dropped"], 0, "{json}");
    assert!(stats["batches"].as_u64().is_some_and(|b| b > 100), "{json}");
    assert_eq!(stats["published"], stats["batches"], "{json}");
    Ok(())
}

#[test]
fn port_zero_binds_free_ports_and_stderr_names_them() -> TestResult {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_omniprefix"))
        .args(["bench", "soak", "--requests", "50", "--pool-blocks", "64", "--prefixes", "16", "--json"])
        .args(["--kv-events", "tcp://127.0.0.1:0", "--kv-replay", "tcp://127.0.0.1:0"])
        .output()?;
    let stderr = String::from_utf8(out.stderr)?;
    assert!(out.status.success(), "{stderr}");
    let port = |endpoint: &str| -> TestResult<u16> {
        Ok(endpoint.strip_prefix("tcp://127.0.0.1:").ok_or("loopback")?.parse()?)
    };
    let (publisher, replay) = stderr
        .strip_prefix("kv events: publishing on ")
        .and_then(|rest| rest.strip_suffix('\n')?.split_once(", replay on "))
        .ok_or_else(|| format!("one line naming both endpoints: {stderr:?}"))?;
    let (p, r) = (port(publisher)?, port(replay)?);
    assert!(p != 0 && r != 0 && p != r, "{stderr}");
    assert_eq!(
        stderr,
        format!("kv events: publishing on tcp://127.0.0.1:{p}, replay on tcp://127.0.0.1:{r}\n")
    );
    // stdout stays the one JSON report.
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(json["kv_events"]["dropped"], 0, "{json}");
    Ok(())
}

#[test]
#[ignore = "full soak: run in release with SOAK_REQUESTS"]
fn full_soak_from_env() -> Result<()> {
    let requests = std::env::var("SOAK_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(100_000);
    let report = run_soak(&SoakOptions { requests, ..SoakOptions::default() })?;
    println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default());
    report.check()
}
