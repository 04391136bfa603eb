//! The `omniprefix` binary; everything lives in [`omniprefix_cli::cli`].

fn main() -> std::process::ExitCode {
    omniprefix_cli::cli::main()
}
