//! `omniprefix demo --quick`: the report's invariants, and bad input as typed errors.

use std::sync::Arc;

use super::common::TestResult;
use clap::Parser;
use omniprefix::Error;
use omniprefix::backend::cpu::CpuBackend;
use omniprefix::error::{CheckpointError, IoError, RequestError};
use omniprefix_cli::cli::{Cli, run};
use omniprefix_cli::demo::{DemoOptions, DemoReport, ModelChoice, Row, Way, WorkloadReport, run_demo};
use omniprefix_cli::{HarnessError, Result};

fn quick_report(model: &ModelChoice) -> Result<DemoReport> {
    run_demo(Arc::new(CpuBackend::new()), "cpu".into(), model, &DemoOptions::quick())
}

fn workload<'a>(report: &'a DemoReport, name: &str) -> &'a WorkloadReport {
    report.workloads.iter().find(|w| w.name == name).unwrap_or_else(|| panic!("no workload {name}"))
}

fn rows(w: &WorkloadReport, way: Way) -> Vec<&Row> {
    w.rows.iter().filter(|r| r.way == way).collect()
}

#[test]
fn quick_demo_reuses_the_cache_and_returns_the_uncached_hidden_states() -> Result<()> {
    let report = quick_report(&ModelChoice::Random)?;
    let hidden = report.model.hidden_size;
    assert_eq!(report.workloads.len(), 3);
    for w in &report.workloads {
        assert_eq!(rows(w, Way::NoCache).len(), rows(w, Way::Radix).len());
        for r in &w.rows {
            assert!(
                r.max_rel_diff_hidden <= 1e-4,
                "{} {:?} request {}: {}",
                w.name,
                r.way,
                r.request,
                r.max_rel_diff_hidden
            );
            assert!(r.max_rel_diff_logits <= 1e-4, "{} {:?} request {}", w.name, r.way, r.request);
            assert_eq!(r.hidden_shapes.len(), 3, "hidden.0, the middle layer and final");
            // A conversation round also runs its reply's tokens but the last (8 generated with --quick).
            let rows = if w.name == "multi_round" { r.prompt_tokens + 7 } else { r.prompt_tokens };
            assert!(r.hidden_shapes.iter().all(|(_, s)| *s == [rows, hidden]), "{:?}", r.hidden_shapes);
            assert!(r.same_reply_as_no_cache, "{} {:?} request {}", w.name, r.way, r.request);
            assert!(r.cached_tokens < r.prompt_tokens);
            if r.way == Way::NoCache {
                assert_eq!(r.cached_tokens, 0);
            }
        }
        for (radix, chain) in rows(w, Way::Radix).into_iter().zip(rows(w, Way::HashChain)) {
            assert_eq!(radix.request, chain.request);
            assert!(chain.cached_tokens <= radix.cached_tokens, "{} request {}", w.name, radix.request);
        }
    }
    // The RFC pair shares 46 tokens: radix reuses all of them, the block-granular chain 32.
    let rfc = workload(&report, "rfc_text_pair");
    assert_eq!(rows(rfc, Way::Radix)[1].cached_tokens, 46);
    assert_eq!(rows(rfc, Way::HashChain)[1].cached_tokens, 32);
    // Every later round reuses the whole earlier conversation's prefix.
    let multi = rows(workload(&report, "multi_round"), Way::Radix);
    assert_eq!(multi[0].cached_tokens, 0);
    assert!(multi[1..].iter().all(|r| r.cached_tokens > 0), "{multi:?}");
    // Each later round re-sends the previous reply: the 7 of its 8 tokens that ran are cached (radix).
    assert!(multi[1..].iter().all(|r| (r.reply_tokens, r.reply_cached) == (8, 7)), "{multi:?}");
    let s = &report.summary;
    assert_eq!((s.reply_tokens, s.radix_reply_cached), (24, 21));
    assert!(
        s.same_replies && s.max_rel_diff <= 1e-4 && s.radix_cached_tokens > s.hash_chain_cached_tokens,
        "{s:?}"
    );
    // The batch spans several steps, so a prompt whose prefix an earlier step cached reuses it.
    let batch = rows(workload(&report, "prefix_repetition"), Way::Radix);
    assert!(batch.iter().any(|r| r.cached_tokens >= 32), "{batch:?}");
    Ok(())
}

#[test]
fn the_json_report_carries_the_table_numbers_and_the_machine() -> TestResult {
    let dir = std::env::temp_dir().join(format!("omniprefix-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|source| IoError::write(&dir, source))?;
    let path = dir.join("report.json");
    let path_arg = path.display().to_string();
    let mut out = Vec::new();
    run(
        Cli::try_parse_from(["omniprefix", "demo", "--quick", "--backend", "cpu", "--json", &path_arg])?,
        &mut out,
    )?;
    let text = String::from_utf8_lossy(&out);
    assert!(text.contains("== multi_round =="), "{text}");
    // The summary a newcomer reads: one line per claim, after the tables.
    let summary: Vec<&str> = text.lines().skip_while(|l| *l != "== summary ==").skip(1).take(4).collect();
    let starts = [
        "vs the vLLM path: radix reused ",
        "hidden states equal to uncached: yes ",
        "TTFT, last multi_round round: ",
        "reply reuse: 21 of 24 tokens",
    ];
    assert_eq!(summary.len(), 4, "{text}");
    for (line, start) in summary.iter().zip(starts) {
        assert!(line.starts_with(start), "{line:?} should start with {start:?}");
    }
    assert!(summary[1].contains("generated replies identical"), "{text}");
    // The spoken chat (the tiny full Omni checkpoint): its table, then one more summary line.
    assert!(text.contains("== spoken_chat =="), "{text}");
    let spoken = text.lines().skip_while(|l| *l != "== summary ==").nth(5).unwrap_or_default();
    assert!(
        spoken.starts_with("TTFA, last spoken_chat round: ") && spoken.contains(" ms uncached, "),
        "{text}"
    );
    assert!(spoken.ends_with("audio identical to uncached"), "{spoken}");
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&path).map_err(|source| IoError::read(&path_arg, source))?,
    )?;
    assert_eq!(json["machine"]["backend"], "cpu");
    assert!(json["machine"]["cores"].as_u64().is_some_and(|c| c >= 1));
    assert_eq!(json["workloads"][0]["name"], "rfc_text_pair");
    assert_eq!(json["summary"]["radix_reply_cached"].as_u64(), Some(21));
    let row = &json["workloads"][0]["rows"][3];
    assert_eq!((row["way"].as_str(), row["cached_tokens"].as_u64()), (Some("radix"), Some(46)));
    let spoken = &json["spoken_chat"];
    let rounds = spoken["rounds"].as_array().ok_or("spoken_chat rounds")?;
    assert_eq!(rounds.len(), 3, "{spoken}");
    assert_eq!(spoken["sample_rate"].as_u64(), Some(24_000));
    assert_eq!(rounds[0]["cached_tokens"].as_u64(), Some(0), "{spoken}");
    for (i, round) in rounds.iter().enumerate() {
        assert!(round["ttfa_ms"].as_f64().is_some_and(|t| t > 0.0), "round {i}: {round}");
        assert!(round["ttfa_ms_uncached"].as_f64().is_some_and(|t| t > 0.0), "round {i}: {round}");
        assert!(round["codec_frames"].as_u64().is_some_and(|f| f > 0), "round {i}: {round}");
        assert_eq!(round["same_audio_as_uncached"], true, "round {i}: {round}");
        let prompt = round["prompt_tokens"].as_u64().unwrap_or_default();
        if i > 0 {
            // Each round re-sends the conversation: the earlier rounds' prompt is cached.
            let previous = rounds[i - 1]["prompt_tokens"].as_u64().unwrap_or_default();
            let cached = round["cached_tokens"].as_u64().unwrap_or_default();
            assert!(prompt > previous && cached >= previous / 16 * 16, "round {i}: {round}");
        }
    }
    assert!(spoken["last_round_ttfa_ratio"].as_f64().is_some_and(|r| r > 0.0), "{spoken}");
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn a_checkpoint_whose_vocab_cannot_hold_the_prompts_is_a_typed_error() {
    // The tiny test checkpoint has 256 ids; the demo's prompts use Qwen3-Omni's.
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny/omni_thinker");
    let err = quick_report(&ModelChoice::Dir(dir));
    assert!(
        matches!(
            err,
            Err(HarnessError::Engine(Error::Request(RequestError::TokenOutOfVocab { vocab_size: 256, .. })))
        ),
        "{err:?}"
    );
}

fn demo(args: &[&str]) -> Result<()> {
    let cli = Cli::try_parse_from(["omniprefix", "demo", "--quick", "--backend", "cpu"].iter().chain(args))?;
    run(cli, &mut Vec::new())
}

#[test]
fn bad_input_is_a_typed_error_before_anything_runs() -> Result<()> {
    assert!(
        matches!(demo(&["--workload", "rfc"]), Err(HarnessError::UnknownWorkload { name, .. }) if name == "rfc")
    );
    assert!(matches!(
        demo(&["--model", "/nonexistent/omniprefix-model"]),
        Err(HarnessError::Engine(Error::Io(IoError { .. })))
    ));
    let unsupported = std::env::temp_dir().join(format!("omniprefix-unsupported-{}", std::process::id()));
    std::fs::create_dir_all(&unsupported).map_err(|source| IoError::write("tmp", source))?;
    std::fs::write(unsupported.join("config.json"), r#"{"model_type": "llama", "hidden_size": 64}"#)
        .map_err(|source| IoError::write("tmp", source))?;
    let err = demo(&["--model", &unsupported.display().to_string()]);
    std::fs::remove_dir_all(&unsupported).ok();
    assert!(
        matches!(
            err,
            Err(HarnessError::Engine(Error::Checkpoint(
                CheckpointError::UnsupportedConfig { .. } | CheckpointError::ConfigParse(_)
            )))
        ),
        "{err:?}"
    );
    // The spoken chat needs a checkpoint with a talker.
    let thinker = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny/omni_thinker");
    assert!(matches!(
        demo(&["--speech-model", &thinker.display().to_string()]),
        Err(HarnessError::Engine(Error::Request(RequestError::NoTalker { .. })))
    ));
    let unwritable = "/nonexistent-dir/omniprefix/report.json";
    assert!(
        matches!(demo(&["--json", unwritable]), Err(HarnessError::Engine(Error::Io(IoError { path, .. }))) if path == unwritable)
    );
    Ok(())
}

#[test]
fn the_binary_reports_bad_input_in_one_line_with_a_nonzero_exit() -> Result<()> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_omniprefix"))
        .args(["demo", "--quick", "--workload", "mixed"])
        .output()
        .map_err(|source| IoError::read("omniprefix binary", source))?;
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("error: unknown workload \"mixed\""), "{stderr}");
    assert!(!stderr.contains("panicked"));
    Ok(())
}
