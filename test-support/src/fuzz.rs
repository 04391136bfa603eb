//! The driver of the proptest-based fuzz targets (`proptests/fuzz_*.rs`).
//!
//! cargo-fuzz needs a nightly toolchain, which this project does not use, so
//! the fuzz targets are proptest strategies over structured mutations and
//! arbitrary bytes, run by [`fuzz`]: a fixed number of cases in CI, or as many
//! as fit in `FUZZ_SECONDS` when `scripts/fuzz.sh` runs them. Any panic in a
//! target is a failure, shrunk to a minimal input and reported with its seed.
//!
//! Environment: `PROPTEST_CASES` (cases per batch), `FUZZ_SECONDS` (time
//! budget; batches repeat with fresh seeds until it is spent), `FUZZ_SEED`
//! (first seed; default 0, so CI runs are reproducible).

#![allow(dead_code)]

use std::time::{Duration, Instant};

use proptest::sample::select;
use proptest::strategy::Strategy;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseResult, TestError, TestRng, TestRunner};
use serde_json::{Value, json};

fn env<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// Runs `test` on inputs from `strategy`; prints the number of executions.
/// Panics (failing the calling `#[test]`) with the minimal failing input.
pub fn fuzz<S: Strategy>(
    name: &str, default_cases: u32, strategy: S, test: impl Fn(S::Value) -> TestCaseResult,
) {
    let cases = env("PROPTEST_CASES").unwrap_or(default_cases);
    let budget = env::<f64>("FUZZ_SECONDS").map(Duration::from_secs_f64);
    let first_seed: u64 = env("FUZZ_SEED").unwrap_or(0);
    let started = Instant::now();
    let mut execs = 0u64;
    for batch in 0u64.. {
        let seed = first_seed.wrapping_add(batch);
        let mut bytes = [0u8; 32];
        bytes[..8].copy_from_slice(&seed.to_le_bytes());
        let config = Config { cases, failure_persistence: None, ..Config::default() };
        let mut runner = TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes));
        match runner.run(&strategy, &test) {
            Ok(()) => {}
            Err(TestError::Fail(reason, input)) => {
                panic!("fuzz {name}: seed {seed} fails: {reason}\nminimal input: {input:#?}")
            }
            Err(TestError::Abort(reason)) => panic!("fuzz {name}: seed {seed} aborted: {reason}"),
        }
        execs += u64::from(cases);
        if budget.is_none_or(|b| started.elapsed() >= b) {
            break;
        }
    }
    println!("fuzz {name}: {execs} execs in {:.1} s", started.elapsed().as_secs_f64());
}

/// A JSON value to plant in a file under test, picked uniformly: one of every type
/// (`null`, a bool, -1, 0, `u64::MAX`, `[]`) followed by the target's own `specific`
/// values (sizes, names and objects its format gives meaning to).
pub fn json_value(specific: Vec<Value>) -> impl Strategy<Value = Value> {
    let mut values = vec![Value::Null, json!(true), json!(-1), json!(0), json!(u64::MAX), json!([])];
    values.extend(specific);
    select(values)
}
