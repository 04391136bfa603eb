//! The harness tests (the `omniprefix` binary, its library, the README's commands), one binary:
//! each test binary links the engine, the CLI library and their dependencies, so one link serves
//! every file here (they were 12 binaries). Run one file with `cargo test --test cli demo_quick::`.

mod bench_serve;
mod bench_ttfa;
mod chat_reference;
mod cli_bench_match;
mod common;
mod demo_quick;
mod engine_cli;
mod generate_audio;
mod generate_cli;
mod generate_text_cli;
mod gpu_bench_quick;
mod preprocess;
mod quickstart;
mod readme_commands;
mod soak_short;
