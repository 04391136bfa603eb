//! The `omniprefix` binary; everything lives in [`omniprefix_cli::cli`].

/// Keeps freed activations for reuse instead of returning them to the kernel
/// (see the dependency's note in `cli/Cargo.toml`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    omniprefix_cli::cli::main()
}
