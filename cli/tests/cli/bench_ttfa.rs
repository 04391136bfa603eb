//! `omniprefix bench ttfa --quick` in process: the JSON report's fields, every
//! (cache, concurrency) run with every round, audio of the asked length in every
//! request, cache hits only with caching on, and the table on stdout.

use clap::Parser;

use super::common::{TestResult, f, u};
use omniprefix_cli::cli::{Cli, run};

#[test]
fn quick_run_reports_ttfa_per_round_cache_on_and_off() -> TestResult {
    let dir = std::env::temp_dir().join(format!("omniprefix-ttfa-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("ttfa.json");
    let path_arg = path.to_string_lossy().into_owned();
    let args = ["omniprefix", "bench", "ttfa", "--quick", "--threads", "1", "--json", &path_arg];
    let mut out = Vec::new();
    run(Cli::try_parse_from(args)?, &mut out)?;
    let stdout = String::from_utf8_lossy(&out);
    assert!(stdout.contains("TTFA p50 rounds 2.., c=1: cached / uncached"), "{stdout}");
    assert!(stdout.contains("machine: ") && stdout.contains("talker:"), "{stdout}");

    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    std::fs::remove_dir_all(&dir)?;
    assert_eq!(r["bench"], "ttfa");
    assert_eq!(r["size"], "tiny");
    // --quick: 2 rounds, 4-token replies, 4 frames of 1920 samples, c = 1, 2.
    assert_eq!((u(&r, "rounds"), u(&r, "max_tokens"), u(&r, "frames")), (2, 4, 4));
    assert_eq!(u(&r["shapes"], "samples_per_frame"), 1920);
    assert!(r["machine"]["cpu_model"].is_string() && r["machine"]["cpu_features"].is_array());
    let runs = r["runs"].as_array().ok_or("runs")?;
    let keys: Vec<(bool, u64)> = runs.iter().map(|x| (x["cache"] == true, u(x, "concurrency"))).collect();
    assert_eq!(keys, [(true, 1), (true, 2), (false, 1), (false, 2)]);
    for x in runs {
        let rounds = x["rounds"].as_array().ok_or("rounds")?;
        assert_eq!(rounds.len(), 2, "{x}");
        for round in rounds.iter().chain([&x["later_rounds"]]) {
            assert_eq!(u(round, "requests"), 2, "{round}");
            assert_eq!(u(round, "frames"), 4, "{round}");
            // code2wav's causal convolutions trim the edge: under 1920 samples a frame, over 3.
            assert!((3 * 1920..=4 * 1920).contains(&u(round, "audio_samples")), "{round}");
            assert!(u(round, "talker_prompt_rows") > 0, "{round}");
            for key in ["ttfa_ms_p50", "ttfa_ms_p99", "engine_ttfa_ms_p50", "ttft_ms_p50", "reply_end_ms_p50"]
            {
                assert!(f(round, key) > 0.0, "{key} in {round}");
            }
            assert!(f(round, "ttfa_ms_p50") <= f(round, "ttfa_ms_p99"), "{round}");
            assert!((0.0..=f(round, "stall_ms_p99")).contains(&f(round, "stall_ms_p50")), "{round}");
            // The caller hears the audio no sooner than the engine makes it.
            assert!(f(round, "ttfa_ms_p50") >= f(round, "engine_ttfa_ms_p50"), "{round}");
        }
        let (r1, r2) = (&rounds[0], &rounds[1]);
        assert!(u(r2, "prompt_tokens") > u(r1, "prompt_tokens"), "round 2 re-sends round 1: {x}");
        if x["cache"] == true {
            // Round 2 re-sends round 1's prompt and reply: all but the reply's last token is found.
            assert!(u(r2, "cached_tokens") >= u(r1, "prompt_tokens"), "{x}");
        } else {
            assert_eq!((u(r1, "cached_tokens"), u(r2, "cached_tokens")), (0, 0), "{x}");
        }
    }
    for key in [
        "later_rounds_cached_over_uncached_c1",
        "ttfa_p50_top_c_over_c1_cached",
        "ttfa_p50_top_c_over_c1_uncached",
    ] {
        assert!(f(&r, key) > 0.0, "{key}");
    }
    assert_eq!(u(&r, "top_c"), 2);
    assert_eq!(u(&r, "prefill_cap"), 256, "bench ttfa serves with SPEECH_PREFILL_CAP");
    assert_eq!(r["cached_over_uncached_c1_by_round"].as_array().map(Vec::len), Some(2));
    let breakdown = r["breakdown"].as_array().ok_or("breakdown")?;
    assert_eq!(breakdown.len(), 2);
    for b in breakdown {
        for key in [
            "prepare_ms",
            "thinker_prefill_ms",
            "first_token_to_audio_ms",
            "audio_before_reply_end_ms",
            "audio_delivery_ms",
            "ttfa_ms",
        ] {
            assert!(f(b, key).is_finite(), "{key} in {b}");
        }
    }
    let probe = &r["probe"];
    assert!(
        f(probe, "talker_prefill_first_frame_ms") > 0.0
            && f(probe, "code2wav_first_chunk_ms") > 0.0
            && f(probe, "code2wav_ms_per_frame") > 0.0,
        "{probe}"
    );
    assert!(!r["not_exposed"].as_array().ok_or("not_exposed")?.is_empty());
    Ok(())
}
