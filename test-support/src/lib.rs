//! Helpers shared by the engine's integration tests (`tests/engine/`), property
//! suites (`proptests/`) and benches (`benches/`), one crate instead of modules
//! pulled across folders with `#[path]`. The root package depends on it as
//! `support` (a dev-dependency), so a test says `use support::tiny_model::...`.

// Only tests link this crate: the API lints of a published library do not apply
// (`index_oracle::Ledger::len` needs no `is_empty`).
#![allow(clippy::len_without_is_empty)]

pub mod fuzz;
pub mod images;
pub mod index_oracle;
pub mod items;
pub mod reference;
pub mod sampling;
pub mod sched;
pub mod sched_driver;
pub mod tiny_model;

/// A property suite's case count: `PROPTEST_CASES` if set, else the suite's default, sized for
/// CI on two cores (a nightly-size run is one variable away).
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}
