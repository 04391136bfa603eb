//! The `omniprefix` binary; everything lives in [`omniprefix_cli::cli`]. Its allocator is the
//! engine's `mimalloc` feature (see `omniprefix::alloc`).

fn main() -> std::process::ExitCode {
    omniprefix::alloc::keep_freed_pages();
    omniprefix_cli::cli::main()
}
