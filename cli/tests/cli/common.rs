//! Helpers the harness test files share.

use std::path::{Path, PathBuf};

/// A test's result: an error fails the test with its message.
pub type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// A tiny checkpoint under `fixtures/tiny` (made by the fixture scripts).
pub fn fixture(model: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny").join(model)
}

/// A path as a command-line argument.
pub fn p(path: &Path) -> &str {
    path.to_str().unwrap_or_default()
}

/// `hidden --model MODEL --request REQUEST`, then `rest`: where the `hidden` tests' command lines start.
pub fn hidden_args<'a>(model: &'a Path, request: &'a Path, rest: &[&'a str]) -> Vec<&'a str> {
    ["hidden", "--model", p(model), "--request", p(request)].into_iter().chain(rest.iter().copied()).collect()
}

/// A fresh, empty scratch folder for test `test` of test file `file` (one per process).
pub fn scratch(file: &str, test: &str) -> TestResult<PathBuf> {
    let dir = std::env::temp_dir().join(format!("omniprefix-{file}-{}-{test}", std::process::id()));
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// `v[key]` of a JSON report as a whole number; a missing or mistyped key fails the test by name.
pub fn u(v: &serde_json::Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} in {v}"))
}

/// `v[key]` of a JSON report as a float; a missing or mistyped key fails the test by name.
pub fn f(v: &serde_json::Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("{key} in {v}"))
}
