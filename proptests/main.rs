//! The property suites and proptest-based fuzz targets, one binary (they were 13, each linking
//! the whole engine). A file is a module; run one with `cargo test --test proptests index_ops::`.
//! Case counts stay per suite (`PROPTEST_CASES`, `FUZZ_SECONDS`, ...), and each suite's
//! `.proptest-regressions` file stays beside its source file. Shared helpers: the `support` crate.

mod caching_invisible;
mod collision;
mod fuzz_canon;
mod fuzz_loader;
mod fuzz_request_file;
mod generation_invisible;
mod index_ops;
mod pool_invariants;
mod prompt_positions;
mod radix_vs_hashchain;
mod runner_chunking;
mod sched_state_machine;
mod served_threads;
mod speech_cache;
mod talker_cache;
mod tier_invisible;
