//! `omniprefix bench serve --quick` in process: one JSON line per (workload,
//! cache mode, arrival), exact output token counts, cache hits only with
//! caching on, both concurrencies and a Poisson run, the stand-in encoder
//! called on encoder-cache misses only, and bad arguments as errors.

use clap::Parser;

use super::common::{TestResult, f, u};
use omniprefix_cli::HarnessError;
use omniprefix_cli::cli::{Cli, run};

fn serve(args: &[&str]) -> Result<String, HarnessError> {
    let base = ["omniprefix", "bench", "serve", "--quick", "--threads", "1"];
    let mut out = Vec::new();
    run(Cli::try_parse_from(base.iter().chain(args))?, &mut out)?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn lines(stdout: &str) -> TestResult<Vec<serde_json::Value>> {
    Ok(stdout.lines().map(serde_json::from_str).collect::<Result<_, _>>()?)
}

#[test]
fn quick_run_reports_both_cache_modes_at_concurrency_1_and_4() -> TestResult {
    let lines = lines(&serve(&["--json"])?)?;
    let keys: Vec<(String, bool, u64)> = lines
        .iter()
        .map(|l| {
            (
                l["workload"].as_str().unwrap_or_default().to_string(),
                l["cache"].as_bool().unwrap_or_default(),
                u(l, "concurrency"),
            )
        })
        .collect();
    let want: Vec<(String, bool, u64)> = ["prefix_repetition", "multi_round"]
        .into_iter()
        .flat_map(|w| {
            [1, 4].into_iter().flat_map(move |c| [(w.to_string(), true, c), (w.to_string(), false, c)])
        })
        .collect();
    assert_eq!(keys, want);
    for l in &lines {
        // --quick: 2 prefixes x 3 prompts, or 2 conversations x 4 rounds; 8 tokens each, eos ignored.
        let requests = if l["workload"] == "multi_round" { 8 } else { 6 };
        assert_eq!((u(l, "requests"), u(l, "output_tokens")), (requests, requests * 8), "{l}");
        assert!(l["rate"].is_null());
        for key in ["ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "output_tokens_per_s"] {
            assert!(f(l, key) > 0.0, "{key} in {l}");
        }
        assert!(
            f(l, "ttft_ms_p50") <= f(l, "ttft_ms_p99") && f(l, "itl_ms_p50") <= f(l, "itl_ms_p99"),
            "{l}"
        );
        if l["cache"] == false {
            assert_eq!((u(l, "cached_tokens"), f(l, "hit_rate")), (0, 0.0), "{l}");
        }
    }
    for pair in lines.chunks(2) {
        let (on, off) = (&pair[0], &pair[1]);
        assert!(f(on, "hit_rate") > f(off, "hit_rate"), "caching on reuses prompt tokens: {on}");
        // Greedy replies do not depend on caching, so both modes send the same prompts.
        assert_eq!(u(on, "prompt_tokens"), u(off, "prompt_tokens"));
    }
    // Each multi_round round re-sends the previous prompt and its 8-token reply:
    // with caching on all of it is found (only round 1 of each conversation misses).
    let multi = &lines[4];
    assert!(f(multi, "hit_rate") > 0.5, "{multi}");
    Ok(())
}

#[test]
fn poisson_arrivals_and_the_table() -> TestResult {
    // With KV events: each engine (cache on, then off) publishes on its own port-0 socket.
    let events = ["--kv-events", "tcp://127.0.0.1:0", "--fingerprint-key", &"3c".repeat(32)];
    let args =
        [&["--json", "--workload", "prefix_repetition", "--rate", "200", "--output-len", "3"][..], &events]
            .concat();
    let json = lines(&serve(&args)?)?;
    assert_eq!(json.len(), 2);
    assert!(
        json.iter()
            .all(|l| l["concurrency"].is_null() && f(l, "rate") == 200.0 && u(l, "output_tokens") == 18)
    );
    for l in &json {
        let stats = &l["kv_events"];
        assert!(
            u(stats, "published") > 0 && u(stats, "dropped") == 0 && stats["published"] == stats["batches"],
            "{l}"
        );
    }
    let table = serve(&[
        "--workload",
        "multi_round",
        "--concurrency",
        "2",
        "--conversations",
        "1",
        "--output-len",
        "2",
    ])?;
    assert!(table.starts_with("backend: cpu"), "{table}");
    assert_eq!(table.lines().filter(|l| l.starts_with("multi_round")).count(), 2, "{table}");
    Ok(())
}

#[test]
fn the_stand_in_encoder_runs_on_encoder_cache_misses_only() -> TestResult {
    let json = lines(&serve(&["--json", "--workload", "multi_round", "--encoder-ms", "50"])?)?;
    assert_eq!(json.len(), 4, "cache on and off at concurrency 1 and 4");
    for l in &json {
        assert_eq!((u(l, "encoder_ms"), u(l, "requests"), u(l, "output_tokens")), (50, 8, 64), "{l}");
        // The conversation brings an image, an audio and a video, one per round (the
        // 4th adds none), the same in both conversations: each is encoded once one
        // after another, and at most once per conversation when both run at once.
        let calls = u(l, "encoder_calls");
        if u(l, "concurrency") == 1 {
            assert_eq!(calls, 3, "{l}");
        } else {
            assert!((3..=6).contains(&calls), "{l}");
        }
        // A miss costs the encoder's 50 ms before the request reaches the engine.
        assert!(f(l, "ttft_ms_p99") >= 50.0, "{l}");
    }
    Ok(())
}

/// The JSON names the policy: the default cap (a thirty-second of the budget) starts one
/// long prompt a step; a cap equal to the budget turns both rules off.
#[test]
fn the_scheduling_policy_is_reported() -> TestResult {
    let run = |extra: &[&str]| -> TestResult<Vec<serde_json::Value>> {
        let args = [
            &["--json", "--workload", "prefix_repetition", "--concurrency", "1", "--output-len", "2"][..],
            extra,
        ]
        .concat();
        lines(&serve(&args)?)
    };
    for l in run(&[])? {
        assert_eq!(
            (u(&l, "max_tokens_per_step"), u(&l, "prefill_cap"), u(&l, "long_prefills_per_step")),
            (2048, 64, 1),
            "{l}"
        );
    }
    for l in run(&["--prefill-cap", "2048"])? {
        assert_eq!(u(&l, "prefill_cap"), 2048, "{l}");
        assert!(l["long_prefills_per_step"].is_null(), "{l}");
    }
    Ok(())
}

#[test]
fn bad_arguments_are_errors_before_anything_runs() {
    assert!(
        matches!(serve(&["--workload", "mixed"]), Err(HarnessError::UnknownWorkload { name, .. }) if name == "mixed")
    );
    assert!(matches!(serve(&["--concurrency", "0"]), Err(HarnessError::Args(_))));
    assert!(matches!(serve(&["--rate=-2"]), Err(HarnessError::Args(_))));
    assert!(matches!(serve(&["--rate", "0"]), Err(HarnessError::Args(_))));
}

/// `many_clients --quick`: 8 conversations × 4 rounds on four engines. The requests are the
/// same on each (greedy replies do not depend on where the KV came from); pool + tier keeps at
/// least pool-only's hit rate from round 3 on, and after the restart (before round 3) the
/// rebuilt engine's first round hits the tier.
#[test]
fn many_clients_runs_four_engines_and_a_restart_hits_the_tier() -> TestResult {
    let lines = lines(&serve(&["--json", "--workload", "many_clients"])?)?;
    let clients: Vec<&serde_json::Value> = lines.iter().map(|l| &l["many_clients"]).collect();
    let engines: Vec<&str> = clients.iter().map(|c| c["engine"].as_str().unwrap_or_default()).collect();
    assert_eq!(engines, ["pool", "pool_tier", "unbounded", "restart"]);
    let rounds = |c: &serde_json::Value| c["rounds"].as_array().cloned().unwrap_or_default();
    for (l, c) in lines.iter().zip(&clients) {
        assert_eq!(l["workload"], "many_clients", "{l}");
        assert_eq!((u(l, "requests"), u(l, "output_tokens"), u(c, "conversations")), (32, 256, 8), "{l}");
        let rs = rounds(c);
        assert_eq!(rs.len(), 4, "{c}");
        for (i, r) in rs.iter().enumerate() {
            assert_eq!((u(r, "round"), u(r, "requests")), (i as u64 + 1, 8), "{r}");
            assert!(f(r, "ttft_ms_p50") > 0.0 && (0.0..=1.0).contains(&f(r, "hit_rate")), "{r}");
            let same = &rounds(clients[0])[i];
            assert_eq!(
                r["prompt_tokens"],
                same["prompt_tokens"],
                "round {}: the same prompts on every engine",
                i + 1
            );
        }
        let (pool, working_set) = (u(c, "pool_blocks"), u(c, "working_set_blocks"));
        if c["engine"] == "unbounded" {
            assert!(pool >= working_set, "{c}");
        } else {
            assert!(pool < working_set, "the small pool cannot hold every conversation: {c}");
        }
        let tiered = c["engine"] == "pool_tier" || c["engine"] == "restart";
        assert_eq!(c["tier"].is_object(), tiered, "{c}");
        if !tiered {
            assert!(rs.iter().all(|r| u(r, "tier_hit_tokens") == 0), "{c}");
        }
    }
    let (pool, tier, unbounded) = (rounds(clients[0]), rounds(clients[1]), rounds(clients[2]));
    for i in 2..4 {
        let (p, t) = (f(&pool[i], "hit_rate"), f(&tier[i], "hit_rate"));
        assert!(t >= p, "round {}: pool + tier {t} against pool alone {p}", i + 1);
        assert!(f(&unbounded[i], "hit_rate") >= p, "round {}: the ceiling", i + 1);
    }
    assert!(
        tier.iter().any(|r| u(r, "tier_hit_tokens") > 0),
        "the small pool evicts, the tier serves: {tier:?}"
    );
    let restart = clients[3];
    assert_eq!(u(restart, "restart_round"), 3, "{restart}");
    let first = &rounds(restart)[2];
    assert!(
        u(first, "tier_hit_tokens") > 0 && f(first, "hit_rate") > 0.0,
        "the rebuilt engine hits the tier: {first}"
    );
    Ok(())
}

/// The table of `many_clients`: the usual rows, then one row per round with a column pair per engine.
#[test]
fn many_clients_prints_a_row_per_round() -> TestResult {
    let table =
        serve(&["--workload", "many_clients", "--clients", "2", "--rounds", "2", "--output-len", "2"])?;
    assert_eq!(table.lines().filter(|l| l.starts_with("many_clients ")).count(), 4, "{table}");
    let header = table.lines().find(|l| l.starts_with("round")).unwrap_or_default();
    for engine in ["pool", "pool_tier", "unbounded", "restart"] {
        assert!(header.contains(engine), "{table}");
    }
    let rows: Vec<&str> = table.lines().skip_while(|l| !l.starts_with("round")).skip(1).collect();
    assert_eq!(rows.len(), 2, "{table}");
    assert!(rows[1].contains('*'), "the restart's first round is marked: {table}");
    Ok(())
}
