//! The allocator policy of the binaries built on the engine (feature `mimalloc`).
//!
//! With the feature on, the process's Rust allocations go to mimalloc, and
//! [`keep_freed_pages`] tells it to keep freed memory for reuse instead of
//! handing it back to the kernel: glibc's malloc (and mimalloc's default purge,
//! 10 ms after a free) made each decode step fault its logits in again, 175,733
//! page faults in a 64-step `bench serve` run against 934 with purging off.
//! The CLI and the Python module call it once at start.
//!
//! Loading weights is the exception: each packed matrix is made beside its
//! host copy, and kept freed pages of those copies (one layer's stacked
//! experts is 0.8 GB at the release's widths) are never reused at other sizes,
//! so a real-width bf16 thinker peaked at 1.64 × its checkpoint file. While
//! weights load (`while_loading`, around `Thinker::load`), freed pages go
//! back at once: 1.19 × (`scripts/real_width_rss.py`).
//!
//! Without the feature both calls change nothing.

#[cfg(feature = "mimalloc")]
mod policy {
    use std::sync::Mutex;

    #[global_allocator]
    static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

    /// `mi_option_purge_delay`'s index in mimalloc's `mi_option_e` (the binding has no constant for it).
    const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

    /// Whether freed pages are kept (asked, and not overridden by
    /// `MIMALLOC_PURGE_DELAY`), and how many loads are running.
    static STATE: Mutex<(bool, usize)> = Mutex::new((false, 0));

    fn set_purge_delay(ms: i64) {
        // SAFETY: sets an allocator option; mimalloc reads it when it next purges.
        unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, ms as std::ffi::c_long) };
    }

    pub fn keep_freed_pages() {
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            return;
        }
        let mut state = STATE.lock().unwrap_or_else(|p| p.into_inner());
        state.0 = true;
        if state.1 == 0 {
            set_purge_delay(-1);
        }
    }

    pub fn while_loading<T>(load: impl FnOnce() -> T) -> T {
        {
            let mut state = STATE.lock().unwrap_or_else(|p| p.into_inner());
            state.1 += 1;
            if state.0 {
                set_purge_delay(0);
            }
        }
        // Restores the policy however `load` ends (an error or a panic).
        struct Done;
        impl Drop for Done {
            fn drop(&mut self) {
                let mut state = STATE.lock().unwrap_or_else(|p| p.into_inner());
                state.1 -= 1;
                if state.0 && state.1 == 0 {
                    set_purge_delay(-1);
                }
            }
        }
        let _done = Done;
        load()
    }
}

/// Keeps freed memory for reuse from now on (except while weights load),
/// unless `MIMALLOC_PURGE_DELAY` says otherwise. A no-op without the `mimalloc` feature.
pub fn keep_freed_pages() {
    #[cfg(feature = "mimalloc")]
    policy::keep_freed_pages();
}

/// Runs `load` with freed pages handed back at once, so the transient host
/// copies of weights do not stay resident after they are packed.
pub(crate) fn while_loading<T>(load: impl FnOnce() -> T) -> T {
    #[cfg(feature = "mimalloc")]
    return policy::while_loading(load);
    #[cfg(not(feature = "mimalloc"))]
    load()
}
