//! canon's per-byte kernels (the float scan and fold) compiled per build of the
//! CPU backend's [`Simd`], the one CPU-feature token every kernel dispatches on
//! (the keyed xxh3 stripes take its tokens directly).
//!
//! A machine always takes the same build ([`Simd::detect`], capped by
//! [`SIMD_ENV`](crate::backend::cpu::SIMD_ENV)), and every build gives the same
//! bytes, so a digest never depends on which one ran; the tests run every build
//! the CPU has against the portable one.

use crate::backend::cpu::lanes::Simd;

/// Runs `kernel`, compiled for `simd`'s CPU features (the compiler vectorises
/// its loops with the build's registers: 512-bit ones on AVX-512).
#[inline]
pub(crate) fn vectorise<K: Vectorised>(simd: Simd, kernel: K) -> K::Out {
    match simd {
        Simd::Portable => kernel.run(),
        // SAFETY: the token proves the CPU has AVX2.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2(_) => unsafe { vectorise_avx2(kernel) },
        // SAFETY: the tokens prove the CPU has AVX-512F, AVX-512BW and AVX2.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512(_) | Simd::Avx512Bf16(_) => unsafe { vectorise_avx512(kernel) },
    }
}

/// A loop written once in plain Rust, for [`vectorise`] to compile per build.
/// Mark `run` `#[inline(always)]` (and what it calls on the hot path), so it is
/// compiled inside the build's entry point with that build's features.
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
