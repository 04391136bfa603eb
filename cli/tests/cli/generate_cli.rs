//! `omniprefix generate` in process on the tiny Qwen3 checkpoint: the JSON
//! report's fields, cache reuse after `--warm`, the `--out` tensors' shapes,
//! and bad sampling flags as the library's typed errors.

use std::path::{Path, PathBuf};

use clap::Parser;
use safetensors::SafeTensors;

use super::common::{TestResult, p};
use omniprefix::Error;
use omniprefix::error::RequestError;
use omniprefix_cli::HarnessError;
use omniprefix_cli::cli::{Cli, run};

/// A scratch folder with a warm-up request and a request sharing its first 8 ids.
fn requests(test: &str) -> TestResult<(PathBuf, PathBuf, PathBuf)> {
    let dir = std::env::temp_dir().join(format!("omniprefix-generate-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (warm, req) = (dir.join("warm.json"), dir.join("req.json"));
    std::fs::write(&warm, r#"{"segments": [{"text": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]}]}"#)?;
    std::fs::write(&req, r#"{"segments": [{"text": [5, 6, 7, 8, 9, 10, 11, 12]}, {"text": [40, 41, 42]}]}"#)?;
    Ok((dir, warm, req))
}

/// Runs `generate` on the tiny dense checkpoint with `args`; stdout on success.
fn generate(req: &Path, args: &[&str]) -> Result<String, HarnessError> {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny/qwen3_dense");
    let base = ["omniprefix", "generate", "--model", p(&model), "--request", p(req), "--block-size", "4"];
    let mut out = Vec::new();
    run(Cli::try_parse_from(base.iter().chain(args))?, &mut out)?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn json(stdout: &str) -> TestResult<serde_json::Value> {
    Ok(serde_json::from_str(stdout.trim())?)
}

#[test]
fn json_report_is_consistent_and_warm_up_is_reused() -> TestResult {
    let (dir, warm, req) = requests("json")?;
    let cold = json(&generate(&req, &["--max-tokens", "6", "--json"])?)?;
    let tokens = cold["tokens"].as_array().ok_or("tokens")?;
    assert!(!tokens.is_empty() && tokens.len() <= 6, "{cold}");
    assert!(tokens.iter().all(|t| t.as_u64().is_some_and(|t| t < 256)), "ids in the vocabulary: {cold}");
    // The checkpoint has no eos ids, so nothing stops it before max_tokens.
    assert_eq!((cold["finish_reason"].as_str(), tokens.len()), (Some("length"), 6));
    assert_eq!((cold["prompt_len"].as_u64(), cold["num_cached_tokens"].as_u64()), (Some(11), Some(0)));
    assert!(cold["ttft_ms"].as_f64().is_some_and(|v| v > 0.0));
    assert!(cold["itl_ms_median"].as_f64().is_some_and(|v| v > 0.0));
    assert!(cold["decode_tokens_per_s"].as_f64().is_some_and(|v| v > 0.0));

    let warmed = json(&generate(&req, &["--max-tokens", "6", "--json", "--warm", p(&warm)])?)?;
    assert_eq!(warmed["num_cached_tokens"].as_u64(), Some(8), "two full blocks of the warm-up: {warmed}");
    assert_eq!(warmed["tokens"], cold["tokens"], "greedy: caching changes nothing generated");

    // Stop on the first token the greedy run produced: one token, reason stop.
    let first = tokens[0].as_u64().ok_or("first token")?.to_string();
    let stopped = json(&generate(&req, &["--max-tokens", "6", "--json", "--stop", &first])?)?;
    assert_eq!(
        (stopped["finish_reason"].as_str(), stopped["tokens"].as_array().map(Vec::len)),
        (Some("stop"), Some(1))
    );
    assert!(stopped["itl_ms_median"].is_null());
    let ignored = json(&generate(&req, &["--max-tokens", "3", "--json", "--stop", &first, "--ignore-eos"])?)?;
    assert_eq!(ignored["tokens"].as_array().map(Vec::len), Some(3));
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn out_holds_every_position_that_ran() -> TestResult {
    let (dir, warm, req) = requests("out")?;
    let out = dir.join("gen.safetensors");
    let args =
        ["--max-tokens", "4", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3"];
    let stdout = generate(
        &req,
        &[&args[..], &["--warm", p(&warm), "--capture", "0,final", "--out", p(&out)]].concat(),
    )?;
    assert!(
        stdout.contains("num_cached_tokens: 8") && stdout.contains("finish_reason: length (seed 3)"),
        "{stdout}"
    );
    let bytes = std::fs::read(&out)?;
    let st = SafeTensors::deserialize(&bytes)?;
    let mut names = st.names();
    names.sort();
    assert_eq!(names, ["hidden.0", "hidden.final"]);
    for name in names {
        // prompt_len + tokens - 1: the last sampled token did not run.
        assert_eq!(st.tensor(name)?.shape(), [11 + 4 - 1, 64], "{name}");
    }
    let again = generate(&req, &[&args[..], &["--warm", p(&warm)]].concat())?;
    let tokens_line = |s: &str| s.lines().find(|l| l.starts_with("tokens:")).map(str::to_string);
    assert_eq!(tokens_line(&stdout), tokens_line(&again), "the same seed samples the same tokens");
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn sampled_runs_print_their_seed_and_greedy_runs_do_not() -> TestResult {
    let (dir, _, req) = requests("seed")?;
    let line = |stdout: &str| stdout.lines().find(|l| l.starts_with("finish_reason")).map(str::to_string);
    let greedy = generate(&req, &["--max-tokens", "2"])?;
    assert_eq!(line(&greedy).as_deref(), Some("finish_reason: length"), "{greedy}");
    let greedy = json(&generate(&req, &["--max-tokens", "2", "--json"])?)?;
    assert!(greedy.get("seed").is_none(), "{greedy}");

    let sampled = generate(&req, &["--max-tokens", "4", "--temperature", "0.8"])?;
    let drawn = line(&sampled)
        .and_then(|l| l.strip_prefix("finish_reason: length (seed ")?.strip_suffix(')')?.parse::<u64>().ok())
        .ok_or_else(|| format!("a drawn seed: {sampled}"))?;
    let again = generate(&req, &["--max-tokens", "4", "--temperature", "0.8", "--seed", &drawn.to_string()])?;
    let tokens_line = |s: &str| s.lines().find(|l| l.starts_with("tokens:")).map(str::to_string);
    assert_eq!(tokens_line(&again), tokens_line(&sampled), "the printed seed repeats the run");
    let sampled =
        json(&generate(&req, &["--max-tokens", "2", "--temperature", "0.8", "--seed", "11", "--json"])?)?;
    assert_eq!(sampled["seed"].as_u64(), Some(11), "{sampled}");
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn bad_sampling_flags_are_the_library_s_typed_errors() -> TestResult {
    let (dir, _, req) = requests("bad")?;
    for (flags, field) in [
        (&["--max-tokens", "4", "--top-p", "0"][..], "top_p"),
        (&["--max-tokens", "4", "--temperature", "-1"], "temperature"),
        (&["--max-tokens", "0"], "max_tokens"),
        (&["--max-tokens", "4", "--top-k", "0"], "top_k"),
    ] {
        let err = generate(&req, flags);
        assert!(
            matches!(&err, Err(HarnessError::Engine(Error::Request(RequestError::InvalidSampling { param, .. }))) if *param == field),
            "{flags:?}: {err:?}"
        );
    }
    let err = generate(&req, &["--max-tokens", "4", "--stop", "256"]);
    assert!(
        matches!(
            err,
            Err(HarnessError::Engine(Error::Request(RequestError::StopIdOutOfVocab {
                id: 256,
                vocab_size: 256
            })))
        ),
        "{err:?}"
    );
    // Through the binary: one `error:` line naming the field, a non-zero exit.
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny/qwen3_dense");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_omniprefix"))
        .args(["generate", "--model", p(&model), "--request", p(&req), "--max-tokens", "4", "--top-p", "0"])
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.lines().count() == 1
            && stderr.starts_with("error: ")
            && stderr.contains("top_p"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
