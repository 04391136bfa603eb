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
