//! The `omniprefix` binary; everything lives in [`omniprefix::cli`].

fn main() -> std::process::ExitCode {
    omniprefix::cli::main()
}
