//! The builds of canon's per-byte kernels (the keyed xxh3 stripes, the float
//! scan): portable code, AVX2 and AVX-512, picked once per process.
//!
//! A [`Build`] holds a token whose existence proves the CPU runs that build,
//! so a kernel can be handed one explicitly (the tests run every build the
//! CPU has against the portable one) and the hot path asks [`Build::detect`],
//! which checks the CPU once. A machine always takes the same build, and every
//! build gives the same bytes, so a digest never depends on which one ran.

use std::sync::OnceLock;

/// One build of the kernels; holding a token proves the CPU runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Build {
    /// Plain Rust, any CPU.
    Portable,
    /// 256-bit registers: the CPU has AVX2.
    #[cfg(target_arch = "x86_64")]
    Avx2(Avx2),
    /// 512-bit registers: the CPU has AVX-512F and AVX-512BW (and AVX2).
    #[cfg(target_arch = "x86_64")]
    Avx512(Avx512),
}

/// Proof that the CPU has AVX2 (only [`Build`]'s detection makes one).
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Avx2(());

/// Proof that the CPU has AVX-512F, AVX-512BW and AVX2 (only [`Build`]'s
/// detection makes one).
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Avx512(());

/// The names of the builds, in [`Build::all`]'s order.
#[cfg(test)]
pub(crate) const BUILD_NAMES: [&str; 3] = ["portable", "avx2", "avx512"];

impl Build {
    /// The widest build this CPU runs (the CPU is asked once per process).
    pub(crate) fn detect() -> Self {
        static BEST: OnceLock<Build> = OnceLock::new();
        *BEST.get_or_init(|| Self::all().pop().unwrap_or(Build::Portable))
    }

    /// Every build this CPU runs, portable first, widest last.
    pub(crate) fn all() -> Vec<Self> {
        let mut all = vec![Build::Portable];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            all.push(Build::Avx2(Avx2(())));
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                all.push(Build::Avx512(Avx512(())));
            }
        }
        all
    }

    /// The build's name, as `OMNIPREFIX_REQUIRE_SIMD` spells it.
    #[cfg(test)]
    pub(crate) fn name(self) -> &'static str {
        match self {
            Build::Portable => "portable",
            #[cfg(target_arch = "x86_64")]
            Build::Avx2(_) => "avx2",
            #[cfg(target_arch = "x86_64")]
            Build::Avx512(_) => "avx512",
        }
    }

    /// Runs `kernel`, compiled for this build's CPU features (the compiler
    /// vectorises its loops with the build's registers).
    #[inline]
    pub(crate) fn vectorise<K: Vectorised>(self, kernel: K) -> K::Out {
        match self {
            Build::Portable => kernel.run(),
            // SAFETY: the token proves the CPU has AVX2.
            #[cfg(target_arch = "x86_64")]
            Build::Avx2(_) => unsafe { vectorise_avx2(kernel) },
            // SAFETY: the token proves the CPU has AVX-512F, AVX-512BW and AVX2.
            #[cfg(target_arch = "x86_64")]
            Build::Avx512(_) => unsafe { vectorise_avx512(kernel) },
        }
    }
}

/// A loop written once in plain Rust, for [`Build::vectorise`] to compile per
/// build. Mark `run` `#[inline(always)]` (and what it calls on the hot path),
/// so it is compiled inside the build's entry point with that build's features.
pub(crate) trait Vectorised {
    type Out;
    fn run(self) -> Self::Out;
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn vectorise_avx2<K: Vectorised>(kernel: K) -> K::Out {
    kernel.run()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
fn vectorise_avx512<K: Vectorised>(kernel: K) -> K::Out {
    kernel.run()
}

/// The builds a test runs: every one this CPU has. Each one it lacks is
/// printed as `NOT RUN` by name, and fails the test when the comma-separated
/// `OMNIPREFIX_REQUIRE_SIMD` names it (as a CI machine known to have it should).
#[cfg(test)]
pub(crate) fn builds_run(test: &str) -> Vec<Build> {
    let all = Build::all();
    let have: Vec<&str> = all.iter().map(|b| b.name()).collect();
    crate::builds_run::report_missing(test, &BUILD_NAMES, &have);
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_detected_build_is_the_widest_and_every_build_is_named() {
        let all = Build::all();
        assert_eq!(all[0], Build::Portable);
        assert_eq!(all.last(), Some(&Build::detect()));
        let names: Vec<_> = all.iter().map(|b| b.name()).collect();
        assert_eq!(names, BUILD_NAMES[..all.len()]);
    }
}
