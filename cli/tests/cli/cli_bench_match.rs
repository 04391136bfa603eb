//! `omniprefix bench match` run in process on tiny media: argument errors are
//! typed, and every JSON line has every field (no timing assertions).

use super::common::TestResult;
use clap::Parser;
use omniprefix_cli::cli::{Cli, run};
use omniprefix_cli::{HarnessError, Result};

fn run_args(args: &[&str]) -> Result<String> {
    let cli = Cli::try_parse_from(["omniprefix", "bench", "match"].iter().chain(args))?;
    let mut out = Vec::new();
    run(cli, &mut out)?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

const FIELDS: [&str; 20] = [
    "workload",
    "threads",
    "runs",
    "policy",
    "prompt_tokens",
    "input_bytes",
    "read_floor_ns",
    "omniprefix_cold_ns",
    "omniprefix_warm_ns",
    "hashchain_ns",
    "radix_match_ns",
    "hashchain_chain_ns",
    "matched_tokens_warm",
    "hashchain_matched_tokens_warm",
    "index_bytes_per_token",
    "cold_over_read_floor",
    "warm_over_read_floor",
    "hashchain_over_warm",
    "chain_over_radix_match",
    "warm_ns_by_policy",
];

#[test]
fn json_lines_carry_every_field() -> TestResult {
    let out = run_args(&["--workload", "all", "--scale", "tiny", "--runs", "1", "--threads", "2", "--json"])?;
    let lines: Vec<serde_json::Value> = out.lines().map(serde_json::from_str).collect::<Result<_, _>>()?;
    let names: Vec<&str> = lines.iter().filter_map(|l| l["workload"].as_str()).collect();
    assert_eq!(names, ["mixed", "image", "audio", "video", "text1k", "text8k", "text32k", "multi_round"]);
    for line in &lines {
        for field in FIELDS {
            let expected = field != "warm_ns_by_policy" || line["workload"] == "mixed";
            assert_eq!(line.get(field).is_some(), expected, "{field} in {line}");
        }
        assert_eq!((line["threads"].as_u64(), line["runs"].as_u64()), (Some(2), Some(1)));
        assert_eq!(line["policy"], "second_digest");
    }
    let tokens = |i: usize, f: &str| lines[i][f].as_u64();
    // mixed: 8546 tokens, all 534 full blocks cached by both indexes.
    assert_eq!((tokens(0, "prompt_tokens"), tokens(0, "matched_tokens_warm")), (Some(8546), Some(8544)));
    assert_eq!(tokens(0, "hashchain_matched_tokens_warm"), Some(8544));
    for policy in ["second_digest", "exact_bytes", "unvalidated"] {
        assert!(lines[0]["warm_ns_by_policy"][policy].as_u64().is_some(), "{policy}");
    }
    // text32k: 90 % shared with the warm-up request (radix exact, chain whole blocks).
    assert_eq!((tokens(6, "prompt_tokens"), tokens(6, "matched_tokens_warm")), (Some(32768), Some(29491)));
    assert_eq!(tokens(6, "hashchain_matched_tokens_warm"), Some(29488));
    // multi_round: round 4 re-sends rounds 1-3.
    assert!(tokens(7, "matched_tokens_warm") > Some(8000));
    Ok(())
}

#[test]
fn table_output_has_a_header_and_one_row() -> Result<()> {
    let out =
        run_args(&["--workload", "audio", "--scale", "tiny", "--runs", "1", "--policy", "exact-bytes"])?;
    let rows: Vec<&str> = out.lines().collect();
    assert_eq!(rows.len(), 2);
    assert!(rows[0].starts_with("workload") && rows[1].starts_with("audio"));
    Ok(())
}

#[test]
fn unknown_workload_is_a_typed_error() {
    let err = run_args(&["--workload", "text64k", "--scale", "tiny", "--json"]);
    assert!(
        matches!(err, Err(HarnessError::UnknownWorkload { ref name, .. }) if name == "text64k"),
        "{err:?}"
    );
}

#[test]
fn bad_arguments_are_rejected_by_the_parser() {
    for args in [
        vec!["--workload", "mixed", "--runs", "0"],
        vec!["--workload", "mixed", "--threads", "0"],
        vec!["--workload", "mixed", "--threads", "two"],
        vec!["--workload", "mixed", "--policy", "trust-me"],
        vec!["--workload", "mixed", "--scale", "huge"],
        vec!["--runs", "3"],
    ] {
        let parsed = Cli::try_parse_from(["omniprefix", "bench", "match"].into_iter().chain(args.clone()));
        assert!(parsed.is_err(), "{args:?} parsed");
    }
}
