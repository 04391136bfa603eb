//! The `omniprefix` binary; everything lives in [`omniprefix_cli::cli`].

/// Keeps freed activations for reuse instead of returning them to the kernel
/// (see the dependency's note in `cli/Cargo.toml`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay`'s index in mimalloc's `mi_option_e` (the binding has no constant for it).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

fn main() -> std::process::ExitCode {
    keep_freed_pages();
    omniprefix_cli::cli::main()
}

/// Tells mimalloc never to hand freed pages back to the kernel, unless
/// `MIMALLOC_PURGE_DELAY` says otherwise. By default it purges them 10 ms after a
/// free, so each decode step's logits (8 × 151936 floats, one step every ~20 ms)
/// faulted in again, zeroed by the kernel: 175,733 page faults in a 64-step
/// `bench serve` run against 934 with purging off. The price: the process keeps
/// its peak memory, as an engine with a preallocated KV pool does anyway.
fn keep_freed_pages() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets an allocator option; mimalloc reads it when it next purges.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
}
