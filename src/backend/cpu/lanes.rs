//! Eight f32 lanes for the CPU attention kernels: AVX2 + FMA registers where the
//! CPU has them ([`Avx2`]), plain arrays elsewhere ([`Portable`]); and the widest
//! registers the CPU has ([`Wide`]: 16 lanes with AVX-512) for the matrix products
//! and the prefill attention layout. Products over bf16 weights take the weights in
//! pairs ([`Wide::dot_bf16_pairs`]): one `vdpbf16ps` where the CPU has AVX512-BF16,
//! two fused multiply-adds elsewhere, with the same bits.
//!
//! Kernels are written once, generic over [`Wide`] (reaching 8-lane [`Lanes`]
//! through [`Wide::narrow`] where they need a fixed count), and marked `#[inline(always)]`
//! so that inside a `#[target_feature(enable = "avx2,fma")]` entry point every
//! operation becomes one instruction. A machine always takes the same
//! implementation, and each operation here is lane-wise or a fixed tree, so a
//! kernel's result for one element never depends on the other lanes.

/// An 8-lane f32 vector type and its operations. The value itself is a token:
/// holding one proves the CPU supports the implementation.
pub(crate) trait Lanes: Copy + Send + Sync {
    type V: Copy;
    fn zero(self) -> Self::V;
    fn splat(self, x: f32) -> Self::V;
    /// # Safety
    /// `p` must be valid for reading 8 floats.
    unsafe fn load(self, p: *const f32) -> Self::V;
    /// `*p` in every lane.
    ///
    /// # Safety
    /// `p` must be valid for reading one float.
    unsafe fn splat_at(self, p: *const f32) -> Self::V;
    /// # Safety
    /// `p` must be valid for writing 8 floats.
    unsafe fn store(self, p: *mut f32, v: Self::V);
    fn to_array(self, v: Self::V) -> [f32; 8];
    fn add(self, a: Self::V, b: Self::V) -> Self::V;
    fn sub(self, a: Self::V, b: Self::V) -> Self::V;
    fn mul(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a * b + c`, rounded once on every build (a fused multiply-add).
    fn mul_add(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// `dst[i] = src[i]` widened from f16 (exact; same lengths).
    #[inline(always)]
    fn widen_f16(self, src: &[half::f16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    }
    /// `b > a ? b : a`, lane by lane.
    fn max(self, a: Self::V, b: Self::V) -> Self::V;
    /// `x` where `a < b`, `y` elsewhere, lane by lane.
    fn select_lt(self, a: Self::V, b: Self::V, x: Self::V, y: Self::V) -> Self::V;
    /// Lanes `n..8` replaced by `fill` (`n <= 8`).
    fn keep_first(self, v: Self::V, n: usize, fill: f32) -> Self::V;
    /// [`super::fast_exp::exp`] of each lane, to the last bit.
    fn exp(self, x: Self::V) -> Self::V;
    /// The 8 × 8 transpose: lane `j` of result `i` is lane `i` of `x[j]`.
    fn transpose8(self, x: [Self::V; 8]) -> [Self::V; 8];
    /// A hint to bring the cache line at `p` closer (no effect on results; any address).
    #[inline(always)]
    fn prefetch(self, p: *const f32) {
        let _ = p;
    }
}

/// The lanes this CPU runs, found once: the one CPU-feature token every kernel
/// dispatches on (canon's byte kernels too). A machine always takes the same build, so a result never
/// depends on which call computed it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Simd {
    /// [`Portable`] lanes: any CPU.
    Portable,
    /// [`Avx2`] lanes; holding the token proves AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2(Avx2),
    /// [`Avx512`] lanes (16 wide; their [`Wide::narrow`] lanes are [`Avx2`]);
    /// holding the token proves AVX-512F and AVX-512BW as well as AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    Avx512(Avx512),
    /// [`Avx512`] lanes whose bf16 pairs take one `vdpbf16ps`; holding the token
    /// proves AVX512-BF16 as well.
    #[cfg(target_arch = "x86_64")]
    Avx512Bf16(Avx512<DpPairs>),
}

/// The variable that caps the build every kernel takes (`portable`, `avx2`, `avx512` or
/// `avx512bf16`, as [`simd_builds`](super::simd_builds) names them), so a benchmark can
/// time a slower build on the same machine. Unset, or naming a build this CPU lacks,
/// the best one runs.
pub const SIMD_ENV: &str = "OMNIPREFIX_SIMD";

/// A kernel written once over [`Wide`] lanes; [`Simd::run_wide`] compiles it for
/// each build.
pub(crate) trait WideKernel {
    type Out;
    /// The kernel on lanes `w`. Mark it `#[inline(always)]`, so that it (and the
    /// `#[inline(always)]` code it calls) is compiled inside the build's entry point
    /// with that build's CPU features.
    fn run<W: Wide>(self, w: W) -> Self::Out;
}

impl Simd {
    /// The build every kernel runs: the best this CPU has, or the one [`SIMD_ENV`]
    /// names where the CPU has it (decided once per process).
    pub(crate) fn detect() -> Self {
        static CHOSEN: std::sync::OnceLock<Simd> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let all = Self::all();
            let best = *all.last().unwrap_or(&Simd::Portable);
            let Ok(name) = std::env::var(SIMD_ENV) else { return best };
            let found = all.into_iter().find(|s| s.name() == name.trim());
            if found.is_none() {
                let why = if Self::NAMES.contains(&name.trim()) {
                    "this CPU lacks that build"
                } else {
                    "no such build"
                };
                eprintln!(
                    "{SIMD_ENV}={name}: {why} (builds: {}); running {}",
                    Self::NAMES.join(", "),
                    best.name()
                );
            }
            found.unwrap_or(best)
        })
    }

    /// Every build this CPU runs, the portable one first and the best last (tests run each).
    pub(crate) fn all() -> Vec<Self> {
        let mut all = vec![Simd::Portable];
        #[cfg(target_arch = "x86_64")]
        if let Some(l) = Avx2::new() {
            all.push(Simd::Avx2(l));
            if let Some(z) = Avx512::new(l) {
                all.push(Simd::Avx512(z));
                if let Some(b) = z.with_bf16() {
                    all.push(Simd::Avx512Bf16(b));
                }
            }
        }
        all
    }

    /// Every build's name, in [`Simd::all`]'s order, whether this CPU runs it or not.
    pub(crate) const NAMES: [&'static str; 4] = ["portable", "avx2", "avx512", "avx512bf16"];

    /// The build's name (one of [`Simd::NAMES`]), as [`SIMD_ENV`] and test reports give it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Simd::Portable => "portable",
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2(_) => "avx2",
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512(_) => "avx512",
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512Bf16(_) => "avx512bf16",
        }
    }

    /// Runs `kernel` on this build's widest lanes.
    #[inline]
    pub(crate) fn run_wide<K: WideKernel>(self, kernel: K) -> K::Out {
        match self {
            Simd::Portable => kernel.run(Portable),
            // SAFETY: the tokens prove the CPU has the entry points' features.
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2(l) => unsafe { run_wide_avx2(l, kernel) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the `Avx512` token proves the CPU has the entry point's features.
            Simd::Avx512(z) => unsafe { run_avx512(z, kernel) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the `Avx512<DpPairs>` token proves the CPU has the entry point's features.
            Simd::Avx512Bf16(b) => unsafe { run_avx512_bf16(b, kernel) },
        }
    }
}

/// The AVX2 entry point of a [`WideKernel`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn run_wide_avx2<K: WideKernel>(l: Avx2, kernel: K) -> K::Out {
    kernel.run(l)
}

/// The AVX-512 entry point: `kernel` (inlined) compiled with AVX-512F, AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn run_avx512<K: WideKernel>(z: Avx512, kernel: K) -> K::Out {
    kernel.run(z)
}

/// The AVX512-BF16 entry point: `kernel` (inlined) compiled with AVX512-BF16 beside [`run_avx512`]'s features.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma,f16c")]
fn run_avx512_bf16<K: WideKernel>(b: Avx512<DpPairs>, kernel: K) -> K::Out {
    kernel.run(b)
}

/// The widest f32 vector the CPU has, for kernels that need no fixed lane count
/// (the matrix products, the prefill attention layout). Every operation is
/// lane-wise and does what the [`Lanes`] one of the same name does, so a lane's
/// result is the same whatever the width.
pub(crate) trait Wide: Copy + Send + Sync {
    type V: Copy;
    /// Lanes per vector (8 or 16).
    const WIDTH: usize;
    /// The 8-lane build of the same CPU, for the parts of a kernel written over [`Lanes`].
    type Narrow: Lanes;
    fn narrow(self) -> Self::Narrow;
    fn zero(self) -> Self::V;
    fn splat(self, x: f32) -> Self::V;
    /// `*p` in every lane.
    ///
    /// # Safety
    /// `p` must be valid for reading one float.
    unsafe fn splat_at(self, p: *const f32) -> Self::V;
    /// # Safety
    /// `p` must be valid for reading `WIDTH` floats.
    unsafe fn load(self, p: *const f32) -> Self::V;
    /// An activation pair `x[c], x[c + 1]` (bf16) in every lane, as [`Wide::dot_bf16_pairs`] takes it.
    type Bf16Pair: Copy;
    /// `WIDTH` weight pairs `w[j][c], w[j][c + 1]` (bf16, interleaved), as [`Wide::dot_bf16_pairs`] takes them.
    type Bf16Pairs: Copy;
    /// The two bf16 at `p` in every lane.
    ///
    /// # Safety
    /// `p` must be valid for reading 2 elements.
    unsafe fn splat_bf16_pair(self, p: *const half::bf16) -> Self::Bf16Pair;
    /// `2 * WIDTH` bf16 from `p`: lane `j`'s pair is elements `2j` and `2j + 1`.
    ///
    /// # Safety
    /// `p` must be valid for reading `2 * WIDTH` elements.
    unsafe fn load_bf16_pairs(self, p: *const half::bf16) -> Self::Bf16Pairs;
    /// Lane `j`: `fma(x0, w0, fma(x1, w1, acc))` with `(x0, x1)` the pair `x` and
    /// `(w0, w1)` lane `j`'s pair of `w`, both widened (exact): the second product
    /// first, as `vdpbf16ps` adds them, each rounded once. (`vdpbf16ps` also reads a
    /// subnormal as zero and flushes a subnormal result: callers keep their inputs
    /// normal or zero, and its results agree with the other builds' in f32's normal range.)
    fn dot_bf16_pairs(self, acc: Self::V, x: Self::Bf16Pair, w: Self::Bf16Pairs) -> Self::V;
    /// `WIDTH` f16 widened (exact).
    ///
    /// # Safety
    /// `p` must be valid for reading `WIDTH` elements.
    unsafe fn load_f16(self, p: *const half::f16) -> Self::V;
    /// `a * b + c`, rounded once on every build (a fused multiply-add).
    fn mul_add(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// # Safety
    /// `p` must be valid for writing `WIDTH` floats.
    unsafe fn store(self, p: *mut f32, v: Self::V);
    fn add(self, a: Self::V, b: Self::V) -> Self::V;
    fn sub(self, a: Self::V, b: Self::V) -> Self::V;
    fn mul(self, a: Self::V, b: Self::V) -> Self::V;
    /// `b > a ? b : a`, lane by lane (as [`Lanes::max`]).
    fn max(self, a: Self::V, b: Self::V) -> Self::V;
    /// `x` where `a < b`, `y` elsewhere, lane by lane.
    fn select_lt(self, a: Self::V, b: Self::V, x: Self::V, y: Self::V) -> Self::V;
    /// [`super::fast_exp::exp`] of each lane, to the last bit.
    fn exp(self, x: Self::V) -> Self::V;
    /// A hint to bring the cache line at `p` closer (no effect on results; any address).
    #[inline(always)]
    fn prefetch(self, p: *const u8) {
        let _ = p;
    }
}

/// The [`Wide`] operations that are the [`Lanes`] ones, for a type that is both
/// with the same 8-lane vector.
macro_rules! wide_as_lanes {
    (binary: $($op:ident),*) => {
        $(
            #[inline(always)]
            fn $op(self, a: Self::V, b: Self::V) -> Self::V {
                Lanes::$op(self, a, b)
            }
        )*
    };
    () => {
        type Narrow = Self;
        #[inline(always)]
        fn narrow(self) -> Self {
            self
        }
        #[inline(always)]
        fn zero(self) -> Self::V {
            Lanes::zero(self)
        }
        #[inline(always)]
        fn splat(self, x: f32) -> Self::V {
            Lanes::splat(self, x)
        }
        #[inline(always)]
        unsafe fn splat_at(self, p: *const f32) -> Self::V {
            // SAFETY: the caller's contract is the one of `Lanes::splat_at`.
            unsafe { Lanes::splat_at(self, p) }
        }
        #[inline(always)]
        unsafe fn load(self, p: *const f32) -> Self::V {
            // SAFETY: WIDTH is 8: the caller's contract is the one of `Lanes::load`.
            unsafe { Lanes::load(self, p) }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32, v: Self::V) {
            // SAFETY: WIDTH is 8: the caller's contract is the one of `Lanes::store`.
            unsafe { Lanes::store(self, p, v) }
        }
        #[inline(always)]
        fn mul_add(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V {
            Lanes::mul_add(self, a, b, c)
        }
        wide_as_lanes!(binary: add, sub, mul, max);
        #[inline(always)]
        fn select_lt(self, a: Self::V, b: Self::V, x: Self::V, y: Self::V) -> Self::V {
            Lanes::select_lt(self, a, b, x, y)
        }
        #[inline(always)]
        fn exp(self, x: Self::V) -> Self::V {
            Lanes::exp(self, x)
        }
    };
}

/// `dst[i] = src[i]` widened from bf16 (exact): bf16 is the top half of an f32, so
/// this is a shift, which vectorises to two instructions per 8 inside an AVX2 kernel.
#[inline(always)]
pub(crate) fn widen_bf16(src: &[half::bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits(u32::from(s.to_bits()) << 16);
    }
}

/// The two bf16 at `p`, widened (exact).
///
/// # Safety
/// `p` must be valid for reading 2 elements.
#[inline(always)]
unsafe fn bf16_pair(p: *const half::bf16) -> [f32; 2] {
    // SAFETY: the caller guarantees 2 readable elements.
    let [a, b] = unsafe { p.cast::<[half::bf16; 2]>().read_unaligned() };
    [a.to_f32(), b.to_f32()]
}

/// Largest lane (no NaN).
#[inline(always)]
pub(crate) fn tree_max(a: [f32; 8]) -> f32 {
    let m = |x: f32, y: f32| if y > x { y } else { x };
    m(m(m(a[0], a[1]), m(a[2], a[3])), m(m(a[4], a[5]), m(a[6], a[7])))
}

/// Arrays of 8 floats and separate multiply and add: any CPU.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Portable;

impl Lanes for Portable {
    type V = [f32; 8];
    #[inline(always)]
    fn zero(self) -> [f32; 8] {
        [0.0; 8]
    }
    #[inline(always)]
    fn splat(self, x: f32) -> [f32; 8] {
        [x; 8]
    }
    #[inline(always)]
    unsafe fn load(self, p: *const f32) -> [f32; 8] {
        // SAFETY: the caller guarantees 8 readable floats at `p`.
        unsafe { p.cast::<[f32; 8]>().read_unaligned() }
    }
    #[inline(always)]
    unsafe fn splat_at(self, p: *const f32) -> [f32; 8] {
        // SAFETY: the caller guarantees one readable float at `p`.
        [unsafe { *p }; 8]
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: [f32; 8]) {
        // SAFETY: the caller guarantees 8 writable floats at `p`.
        unsafe { p.cast::<[f32; 8]>().write_unaligned(v) }
    }
    #[inline(always)]
    fn to_array(self, v: [f32; 8]) -> [f32; 8] {
        v
    }
    #[inline(always)]
    fn add(self, a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| a[i] + b[i])
    }
    #[inline(always)]
    fn sub(self, a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| a[i] - b[i])
    }
    #[inline(always)]
    fn mul(self, a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| a[i] * b[i])
    }
    #[inline(always)]
    fn mul_add(self, a: [f32; 8], b: [f32; 8], c: [f32; 8]) -> [f32; 8] {
        // Fused like the vector builds, so every build gives the same bits.
        std::array::from_fn(|i| a[i].mul_add(b[i], c[i]))
    }
    #[inline(always)]
    fn max(self, a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| if b[i] > a[i] { b[i] } else { a[i] })
    }
    #[inline(always)]
    fn select_lt(self, a: [f32; 8], b: [f32; 8], x: [f32; 8], y: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| if a[i] < b[i] { x[i] } else { y[i] })
    }
    #[inline(always)]
    fn keep_first(self, v: [f32; 8], n: usize, fill: f32) -> [f32; 8] {
        std::array::from_fn(|i| if i < n { v[i] } else { fill })
    }
    #[inline(always)]
    fn exp(self, x: [f32; 8]) -> [f32; 8] {
        x.map(super::fast_exp::exp)
    }
    #[inline(always)]
    fn transpose8(self, x: [[f32; 8]; 8]) -> [[f32; 8]; 8] {
        std::array::from_fn(|i| std::array::from_fn(|j| x[j][i]))
    }
}

/// Eight plain lanes (the [`Lanes`] ones), so every build of a [`WideKernel`]
/// gives the same bits.
impl Wide for Portable {
    type V = [f32; 8];
    const WIDTH: usize = 8;
    wide_as_lanes!();
    type Bf16Pair = [f32; 2];
    type Bf16Pairs = [half::bf16; 16];
    #[inline(always)]
    unsafe fn splat_bf16_pair(self, p: *const half::bf16) -> [f32; 2] {
        // SAFETY: forwarded from the caller.
        unsafe { bf16_pair(p) }
    }
    #[inline(always)]
    unsafe fn load_bf16_pairs(self, p: *const half::bf16) -> [half::bf16; 16] {
        // SAFETY: the caller guarantees 16 readable elements at `p`.
        unsafe { p.cast::<[half::bf16; 16]>().read_unaligned() }
    }
    #[inline(always)]
    fn dot_bf16_pairs(self, acc: [f32; 8], [x0, x1]: [f32; 2], w: [half::bf16; 16]) -> [f32; 8] {
        std::array::from_fn(|j| x0.mul_add(w[2 * j].to_f32(), x1.mul_add(w[2 * j + 1].to_f32(), acc[j])))
    }
    #[inline(always)]
    unsafe fn load_f16(self, p: *const half::f16) -> [f32; 8] {
        // SAFETY: the caller guarantees 8 readable elements at `p`.
        unsafe { p.cast::<[half::f16; 8]>().read_unaligned() }.map(half::f16::to_f32)
    }
}

/// What [`exp_lanes`] needs of a vector build beyond [`Wide`].
#[cfg(target_arch = "x86_64")]
trait ExpBits: Wide {
    /// `x.clamp(lo, hi)` as [`f32::clamp`] computes it: max, then min.
    fn clamp(self, x: Self::V, lo: f32, hi: f32) -> Self::V;
    /// `2^n` where `t = n + round` holds the integer `n` in its low mantissa bits,
    /// built in the exponent bits.
    fn pow2(self, t: Self::V, round: f32) -> Self::V;
}

/// The operations of [`super::fast_exp::exp`], in its order, on every lane: the
/// one `exp` of the vector builds (8 or 16 lanes).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn exp_lanes<W: ExpBits>(w: W, x: W::V) -> W::V {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0;
    let c = |v: f32| w.splat(v);
    let x = w.clamp(x, -87.0, 88.0);
    let t = w.add(w.mul(x, c(LOG2E)), c(ROUND));
    let n = w.sub(t, c(ROUND));
    let r = w.sub(w.sub(x, w.mul(n, c(LN2_HI))), w.mul(n, c(LN2_LO)));
    let step = |acc: W::V, k: f32| w.add(c(k), w.mul(r, acc));
    let mut p = c(1.0 / 5040.0);
    for k in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = step(p, k);
    }
    w.mul(p, w.pow2(t, ROUND))
}

/// Writes [`i256`] and [`i512`]: one name per x86 intrinsic at each register width,
/// so that the operations the AVX2 and AVX-512 builds share are written once
/// ([`x86_float_ops`]): `i256::add_ps` is `_mm256_add_ps`, `i512::add_ps` is `_mm512_add_ps`.
#[cfg(target_arch = "x86_64")]
macro_rules! x86_width_names {
    ($($name:ident: $at256:ident, $at512:ident;)*) => {
        /// The 256-bit intrinsics under their width-free names.
        mod i256 {
            $(pub(super) use std::arch::x86_64::$at256 as $name;)*
        }
        /// The 512-bit intrinsics under their width-free names.
        mod i512 {
            $(pub(super) use std::arch::x86_64::$at512 as $name;)*
        }
    };
}

#[cfg(target_arch = "x86_64")]
x86_width_names! {
    add_epi32: _mm256_add_epi32, _mm512_add_epi32;
    add_ps: _mm256_add_ps, _mm512_add_ps;
    and_si: _mm256_and_si256, _mm512_and_si512;
    castps_si: _mm256_castps_si256, _mm512_castps_si512;
    castsi_ps: _mm256_castsi256_ps, _mm512_castsi512_ps;
    fmadd_ps: _mm256_fmadd_ps, _mm512_fmadd_ps;
    loadu_ps: _mm256_loadu_ps, _mm512_loadu_ps;
    max_ps: _mm256_max_ps, _mm512_max_ps;
    min_ps: _mm256_min_ps, _mm512_min_ps;
    mul_ps: _mm256_mul_ps, _mm512_mul_ps;
    set1_epi32: _mm256_set1_epi32, _mm512_set1_epi32;
    set1_ps: _mm256_set1_ps, _mm512_set1_ps;
    setzero_ps: _mm256_setzero_ps, _mm512_setzero_ps;
    slli_epi32: _mm256_slli_epi32, _mm512_slli_epi32;
    storeu_ps: _mm256_storeu_ps, _mm512_storeu_ps;
    sub_epi32: _mm256_sub_epi32, _mm512_sub_epi32;
    sub_ps: _mm256_sub_ps, _mm512_sub_ps;
}

/// The element-wise operations that are one intrinsic at either width (`$m`:
/// [`i256`] or [`i512`]; `$v` its float vector), for the [`Lanes`] impl of
/// [`Avx2`] and the [`Wide`] impl of [`Avx512`]. Every `unsafe` block needs only
/// the features that the implementing token proves, and pointer validity (for the
/// vector's lanes) is the caller's contract on `load` and `store`.
#[cfg(target_arch = "x86_64")]
macro_rules! x86_float_ops {
    ($m:ident, $v:ty, binary: $($op:ident = $intrinsic:ident),*) => {
        $(
            #[inline(always)]
            fn $op(self, a: $v, b: $v) -> $v {
                // SAFETY: the token proves the CPU features.
                unsafe { $m::$intrinsic(a, b) }
            }
        )*
    };
    ($m:ident, $v:ty) => {
        #[inline(always)]
        fn zero(self) -> $v {
            // SAFETY: the token proves the CPU features.
            unsafe { $m::setzero_ps() }
        }
        #[inline(always)]
        fn splat(self, x: f32) -> $v {
            // SAFETY: the token proves the CPU features.
            unsafe { $m::set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn load(self, p: *const f32) -> $v {
            // SAFETY: the token proves the features; the caller guarantees `p` is valid for the lanes.
            unsafe { $m::loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32, v: $v) {
            // SAFETY: the token proves the features; the caller guarantees `p` is valid for the lanes.
            unsafe { $m::storeu_ps(p, v) }
        }
        x86_float_ops!($m, $v, binary: add = add_ps, sub = sub_ps, mul = mul_ps);
        #[inline(always)]
        fn mul_add(self, a: $v, b: $v, c: $v) -> $v {
            // SAFETY: the token proves the CPU features.
            unsafe { $m::fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        fn max(self, a: $v, b: $v) -> $v {
            // `b > a ? b : a`, like the portable lanes (maxps returns its second operand
            // unless the first is greater).
            // SAFETY: the token proves the CPU features.
            unsafe { $m::max_ps(b, a) }
        }
    };
}

/// [`ExpBits`] for a vector build whose token proves its features (`$m`, `$v`: as [`x86_float_ops`]).
#[cfg(target_arch = "x86_64")]
macro_rules! x86_exp_bits {
    ($m:ident, $v:ty) => {
        #[inline(always)]
        fn clamp(self, x: $v, lo: f32, hi: f32) -> $v {
            // SAFETY: the token proves the CPU features.
            unsafe { $m::min_ps($m::max_ps(x, $m::set1_ps(lo)), $m::set1_ps(hi)) }
        }
        #[inline(always)]
        fn pow2(self, t: $v, round: f32) -> $v {
            // SAFETY: the token proves the CPU features.
            unsafe {
                let n = $m::sub_epi32($m::castps_si(t), $m::set1_epi32(round.to_bits() as i32));
                $m::castsi_ps($m::slli_epi32::<23>($m::add_epi32(n, $m::set1_epi32(127))))
            }
        }
    };
}

/// `acc + x0 · w0 + x1 · w1` lane by lane, where each 32-bit lane of `w` holds a bf16
/// pair (the second element in the top half: that half masked is `w1` as an f32,
/// the lane shifted up `w0`), in [`Wide::dot_bf16_pairs`]' order: the second product
/// first, each rounded once. `$m` as [`x86_float_ops`]; the caller's token proves the features.
#[cfg(target_arch = "x86_64")]
macro_rules! x86_fma_pair_dot {
    ($m:ident, $acc:expr, $x0:expr, $x1:expr, $w:expr) => {{
        let (acc, x0, x1, w) = ($acc, $x0, $x1, $w);
        // SAFETY: the token proves the CPU features.
        unsafe {
            let w1 = $m::castsi_ps($m::and_si(w, $m::set1_epi32(0xFFFF_0000_u32 as i32)));
            let w0 = $m::castsi_ps($m::slli_epi32::<16>(w));
            $m::fmadd_ps(x0, w0, $m::fmadd_ps(x1, w1, acc))
        }
    }};
}

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::Avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) use avx512::{Avx512, DpPairs};

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Lanes, i256};

    /// 256-bit AVX2 registers with fused multiply-add. Only [`Avx2::new`] makes one
    /// (through [`super::Simd::detect`], the one place that asks the CPU).
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Avx2(());

    impl Avx2 {
        /// The token when this CPU has AVX2, FMA and F16C (checked once).
        pub(super) fn new() -> Option<Self> {
            static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            let ok = *AVAILABLE.get_or_init(|| {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            });
            ok.then_some(Avx2(()))
        }
    }

    // SAFETY (every `unsafe` block below): an `Avx2` exists only where the CPU has
    // AVX2 and FMA (`Avx2::new`), so the intrinsics are supported; pointer
    // validity is the caller's contract on `load` / `store`.
    impl Lanes for Avx2 {
        type V = __m256;
        x86_float_ops!(i256, __m256);
        #[inline(always)]
        unsafe fn splat_at(self, p: *const f32) -> __m256 {
            // SAFETY: `Avx2` proves the features; the caller guarantees `p` is valid for 8 floats.
            unsafe { _mm256_broadcast_ss(&*p) }
        }
        #[inline(always)]
        fn to_array(self, v: __m256) -> [f32; 8] {
            let mut a = [0.0f32; 8];
            // SAFETY: `Avx2::new` proved AVX2, FMA and F16C on this CPU. `a` holds 8 floats.
            unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
            a
        }
        #[inline(always)]
        fn widen_f16(self, src: &[half::f16], dst: &mut [f32]) {
            let n = src.len().min(dst.len());
            let full = n / 8 * 8;
            let mut i = 0;
            while i < full {
                // SAFETY: i + 8 <= n for both slices; F16C comes with the token.
                unsafe {
                    let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
                    _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
                }
                i += 8;
            }
            for (d, s) in dst[full..n].iter_mut().zip(&src[full..n]) {
                *d = s.to_f32();
            }
        }
        #[inline(always)]
        fn select_lt(self, a: __m256, b: __m256, x: __m256, y: __m256) -> __m256 {
            // SAFETY: `Avx2::new` proved AVX2, FMA and F16C on this CPU.
            unsafe { _mm256_blendv_ps(y, x, _mm256_cmp_ps::<_CMP_LT_OQ>(a, b)) }
        }
        #[inline(always)]
        fn keep_first(self, v: __m256, n: usize, fill: f32) -> __m256 {
            // SAFETY: `Avx2::new` proved AVX2, FMA and F16C on this CPU.
            unsafe {
                let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), idx));
                _mm256_blendv_ps(_mm256_set1_ps(fill), v, keep)
            }
        }
        #[inline(always)]
        fn exp(self, x: __m256) -> __m256 {
            super::exp_lanes(self, x)
        }
        #[inline(always)]
        fn transpose8(self, x: [__m256; 8]) -> [__m256; 8] {
            // SAFETY: `Avx2::new` proved AVX2, FMA and F16C on this CPU.
            unsafe {
                let t0 = _mm256_unpacklo_ps(x[0], x[1]);
                let t1 = _mm256_unpackhi_ps(x[0], x[1]);
                let t2 = _mm256_unpacklo_ps(x[2], x[3]);
                let t3 = _mm256_unpackhi_ps(x[2], x[3]);
                let t4 = _mm256_unpacklo_ps(x[4], x[5]);
                let t5 = _mm256_unpackhi_ps(x[4], x[5]);
                let t6 = _mm256_unpacklo_ps(x[6], x[7]);
                let t7 = _mm256_unpackhi_ps(x[6], x[7]);
                let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
                let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
                let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
                let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
                let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
                let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
                let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
                let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
                [
                    _mm256_permute2f128_ps::<0x20>(u0, u4),
                    _mm256_permute2f128_ps::<0x20>(u1, u5),
                    _mm256_permute2f128_ps::<0x20>(u2, u6),
                    _mm256_permute2f128_ps::<0x20>(u3, u7),
                    _mm256_permute2f128_ps::<0x31>(u0, u4),
                    _mm256_permute2f128_ps::<0x31>(u1, u5),
                    _mm256_permute2f128_ps::<0x31>(u2, u6),
                    _mm256_permute2f128_ps::<0x31>(u3, u7),
                ]
            }
        }
        #[inline(always)]
        fn prefetch(self, p: *const f32) {
            // SAFETY: a prefetch never faults, whatever the address; SSE is baseline on x86_64.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
        }
    }
}

/// The AVX2 registers as [`Wide`] lanes (8 wide).
#[cfg(target_arch = "x86_64")]
mod avx2_wide {
    use std::arch::x86_64::*;

    use super::{Avx2, ExpBits, Lanes, Wide, i256};

    // SAFETY (every `unsafe` block below): an `Avx2` proves AVX2, FMA and F16C;
    // pointer validity is the caller's contract.
    impl Wide for Avx2 {
        type V = __m256;
        const WIDTH: usize = 8;
        wide_as_lanes!();
        type Bf16Pair = [__m256; 2];
        type Bf16Pairs = __m256i;
        #[inline(always)]
        unsafe fn splat_bf16_pair(self, p: *const half::bf16) -> [__m256; 2] {
            // SAFETY: forwarded from the caller.
            unsafe { super::bf16_pair(p) }.map(|x| Lanes::splat(self, x))
        }
        #[inline(always)]
        unsafe fn load_bf16_pairs(self, p: *const half::bf16) -> __m256i {
            // SAFETY: `Avx2` proves the features; the caller guarantees 16 readable elements.
            unsafe { _mm256_loadu_si256(p.cast()) }
        }
        #[inline(always)]
        fn dot_bf16_pairs(self, acc: __m256, [x0, x1]: [__m256; 2], w: __m256i) -> __m256 {
            x86_fma_pair_dot!(i256, acc, x0, x1, w)
        }
        #[inline(always)]
        unsafe fn load_f16(self, p: *const half::f16) -> __m256 {
            // SAFETY: `Avx2` proves the features; the caller guarantees `p` is valid for 8 floats.
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
        }
        #[inline(always)]
        fn prefetch(self, p: *const u8) {
            Lanes::prefetch(self, p.cast())
        }
    }

    impl ExpBits for Avx2 {
        x86_exp_bits!(i256, __m256);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{Avx2, ExpBits, Wide, i512};

    /// 512-bit AVX-512F registers (16 lanes). Only [`Avx512::new`] makes one
    /// (through [`super::Simd::detect`]); it holds the CPU's [`Avx2`] token, its
    /// [`Wide::narrow`] lanes, and `B`, how it multiplies bf16 pairs.
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Avx512<B = FmaPairs>(Avx2, B);

    /// How 16 lanes multiply bf16 pairs ([`Wide::dot_bf16_pairs`]).
    pub(crate) trait Bf16Dot: Copy + Send + Sync {
        type Pair: Copy;
        /// The pair at `p` in every lane.
        ///
        /// # Safety
        /// `p` must be valid for reading 2 elements.
        unsafe fn splat(self, p: *const half::bf16) -> Self::Pair;
        fn dot(self, acc: __m512, x: Self::Pair, w: __m512i) -> __m512;
    }

    /// bf16 pairs as two fused multiply-adds (any AVX-512F CPU).
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct FmaPairs;

    /// bf16 pairs in one `vdpbf16ps`. Only [`Avx512::with_bf16`] makes one: holding
    /// it proves AVX512-BF16.
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct DpPairs(());

    // SAFETY (both impls): an `Avx512<B>` exists only where the CPU has AVX-512F, and
    // a `DpPairs` only where it has AVX512-BF16; pointer validity is the caller's contract.
    impl Bf16Dot for FmaPairs {
        type Pair = [__m512; 2];
        #[inline(always)]
        unsafe fn splat(self, p: *const half::bf16) -> [__m512; 2] {
            // SAFETY: see the impl's note; the caller guarantees 2 readable elements.
            unsafe { super::bf16_pair(p).map(|x| _mm512_set1_ps(x)) }
        }
        #[inline(always)]
        fn dot(self, acc: __m512, [x0, x1]: [__m512; 2], w: __m512i) -> __m512 {
            x86_fma_pair_dot!(i512, acc, x0, x1, w)
        }
    }

    impl Bf16Dot for DpPairs {
        type Pair = __m512i;
        #[inline(always)]
        unsafe fn splat(self, p: *const half::bf16) -> __m512i {
            // SAFETY: see the impl's note; the caller guarantees 2 readable elements (one 32-bit lane).
            unsafe { _mm512_set1_epi32(p.cast::<i32>().read_unaligned()) }
        }
        #[inline(always)]
        fn dot(self, acc: __m512, x: __m512i, w: __m512i) -> __m512 {
            // `vdpbf16ps` adds the pair's second product, then its first, each rounded once
            // (measured bit for bit against that chain of two FMAs on AMD Zen 4, as Intel's manual defines it).
            // SAFETY: see the impl's note; `__m512bh` and `__m512i` are both 512 plain bits.
            unsafe {
                _mm512_dpbf16_ps(
                    acc,
                    std::mem::transmute::<__m512i, __m512bh>(x),
                    std::mem::transmute::<__m512i, __m512bh>(w),
                )
            }
        }
    }

    impl Avx512 {
        /// The token when this CPU (which has AVX2: `l`) has AVX-512F and AVX-512BW
        /// (checked once; canon's byte kernels use BW's byte and word lanes).
        pub(super) fn new(l: Avx2) -> Option<Self> {
            static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            let ok = *AVAILABLE
                .get_or_init(|| is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw"));
            ok.then_some(Avx512(l, FmaPairs))
        }

        /// These lanes with `vdpbf16ps` for bf16 pairs, when this CPU has AVX512-BF16 (checked once).
        pub(super) fn with_bf16(self) -> Option<Avx512<DpPairs>> {
            static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            let ok = *AVAILABLE.get_or_init(|| is_x86_feature_detected!("avx512bf16"));
            ok.then_some(Avx512(self.0, DpPairs(())))
        }
    }

    impl<B> Avx512<B> {
        /// These lanes with bf16 pairs as two fused multiply-adds (for kernels with no bf16 products).
        pub(crate) fn fma_pairs(self) -> Avx512 {
            Avx512(self.0, FmaPairs)
        }
    }

    // SAFETY (every `unsafe` block below): an `Avx512` exists only where the CPU has
    // AVX-512F and AVX-512BW (and, beside them, AVX2, FMA and F16C); pointer validity is the caller's contract.
    impl<B: Bf16Dot> Wide for Avx512<B> {
        type V = __m512;
        const WIDTH: usize = 16;
        type Narrow = Avx2;
        x86_float_ops!(i512, __m512);
        #[inline(always)]
        fn narrow(self) -> Avx2 {
            self.0
        }
        #[inline(always)]
        unsafe fn splat_at(self, p: *const f32) -> __m512 {
            // SAFETY: `Avx512` proves the features; the caller guarantees `p` is valid for 16 floats.
            unsafe { _mm512_set1_ps(*p) }
        }
        type Bf16Pair = B::Pair;
        type Bf16Pairs = __m512i;
        #[inline(always)]
        unsafe fn splat_bf16_pair(self, p: *const half::bf16) -> B::Pair {
            // SAFETY: forwarded from the caller.
            unsafe { self.1.splat(p) }
        }
        #[inline(always)]
        unsafe fn load_bf16_pairs(self, p: *const half::bf16) -> __m512i {
            // SAFETY: `Avx512` proves the features; the caller guarantees 32 readable elements.
            unsafe { _mm512_loadu_si512(p.cast()) }
        }
        #[inline(always)]
        fn dot_bf16_pairs(self, acc: __m512, x: B::Pair, w: __m512i) -> __m512 {
            self.1.dot(acc, x, w)
        }
        #[inline(always)]
        unsafe fn load_f16(self, p: *const half::f16) -> __m512 {
            // SAFETY: `Avx512` proves the features; the caller guarantees `p` is valid for 16 floats.
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
        }
        #[inline(always)]
        fn prefetch(self, p: *const u8) {
            // SAFETY: a prefetch never faults, whatever the address; SSE is baseline on x86_64.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
        }
        #[inline(always)]
        fn select_lt(self, a: __m512, b: __m512, x: __m512, y: __m512) -> __m512 {
            // SAFETY: `Avx512::new` proved AVX-512F on this CPU.
            unsafe { _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, b), y, x) }
        }
        #[inline(always)]
        fn exp(self, x: __m512) -> __m512 {
            super::exp_lanes(self, x)
        }
    }

    impl<B: Bf16Dot> ExpBits for Avx512<B> {
        x86_exp_bits!(i512, __m512);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The portable lanes seen only as [`Lanes`] (it is [`Wide`] as well, with methods of the same names).
    fn portable() -> impl Lanes<V = [f32; 8]> {
        Portable
    }

    fn sample<const N: usize>(seed: u32) -> [f32; N] {
        std::array::from_fn(|i| ((seed as usize * 31 + i * 17) % 23) as f32 * 0.37 - 4.0)
    }

    /// Every operation of `l` against the portable lanes (the definition).
    fn same_as_portable<L: Lanes>(l: L) {
        let p = portable();
        let (a, b, c) = (sample(1), sample(2), sample(3));
        // SAFETY: the arrays hold 8 floats.
        let v = |x: [f32; 8]| unsafe { l.load(x.as_ptr()) };
        assert_eq!(l.to_array(l.add(v(a), v(b))), p.add(a, b));
        assert_eq!(l.to_array(l.sub(v(a), v(b))), p.sub(a, b));
        assert_eq!(l.to_array(l.mul(v(a), v(b))), p.mul(a, b));
        assert_eq!(l.to_array(l.max(v(a), v(b))), p.max(a, b));
        let fused: [f32; 8] = std::array::from_fn(|i| a[i].mul_add(b[i], c[i]));
        assert_eq!(l.to_array(l.mul_add(v(a), v(b), v(c))), fused);
        assert_eq!(Lanes::mul_add(p, a, b, c), fused);
        let halves: Vec<half::f16> = (0..21).map(|i| half::f16::from_f32(i as f32 * 0.37 - 3.0)).collect();
        let (mut wide, mut want) = (vec![0f32; 21], vec![0f32; 21]);
        l.widen_f16(&halves, &mut wide);
        p.widen_f16(&halves, &mut want);
        assert_eq!(wide, want, "f16 widening");
        assert_eq!(l.to_array(l.select_lt(v(a), v(b), v(c), v(b))), p.select_lt(a, b, c, b));
        for n in 0..=8 {
            assert_eq!(
                l.to_array(l.keep_first(v(a), n, f32::NEG_INFINITY)),
                p.keep_first(a, n, f32::NEG_INFINITY)
            );
        }
        let xs: [f32; 8] = [-1e4, -87.5, -20.3, -0.0, 0.0, 1.7, 60.2, 1e4];
        assert_eq!(l.to_array(l.exp(v(xs))).map(f32::to_bits), p.exp(xs).map(f32::to_bits));
        for i in -2000..2000 {
            let x = sample(i as u32).map(|s| s * i as f32 * 0.01);
            assert_eq!(
                l.to_array(l.exp(v(x))).map(f32::to_bits),
                p.exp(x).map(f32::to_bits),
                "exp at step {i}"
            );
        }
        let rows: [[f32; 8]; 8] = std::array::from_fn(|k| sample(10 + k as u32).map(|x| x * 1.3e-3 + 7.0));
        assert_eq!(l.transpose8(rows.map(v)).map(|x| l.to_array(x)), p.transpose8(rows));
        assert_eq!(p.transpose8(rows)[2][5], rows[5][2]);
    }

    /// Every operation of `w` against the portable lanes, lane by lane over its
    /// `WIDTH` (each 8 of them through the portable [`Lanes`]).
    fn wide_same_as_portable<W: Wide>(w: W) {
        let p = portable();
        let n = W::WIDTH;
        assert!(n == 8 || n == 16);
        // SAFETY: 16 floats readable at each array, WIDTH <= 16.
        let v = |x: [f32; 16]| unsafe { w.load(x.as_ptr()) };
        let bits = |x: W::V| {
            let mut a = [0f32; 16];
            // SAFETY: 16 writable floats, WIDTH <= 16.
            unsafe { w.store(a.as_mut_ptr(), x) };
            a[..n].iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        // The portable operation on each 8 of 16 lanes.
        let half = |x: &[f32; 16], h: usize| -> [f32; 8] { std::array::from_fn(|i| x[h * 8 + i]) };
        let want = |f: &dyn Fn(usize) -> [f32; 8]| -> Vec<u32> {
            let (lo, hi) = (f(0), f(1));
            (0..n).map(|i| if i < 8 { lo[i] } else { hi[i - 8] }.to_bits()).collect()
        };
        let (mut a, mut b, c) = (sample::<16>(1), sample::<16>(2), sample::<16>(3));
        // Equal lanes and signed zeros: `max` and `select_lt` must take the same operand.
        (a[0], b[0], a[1], b[1], a[9], b[9], a[13], b[13]) = (0.0, -0.0, -0.0, 0.0, 2.5, 2.5, -0.0, 0.0);
        assert_eq!(bits(w.add(v(a), v(b))), want(&|h| p.add(half(&a, h), half(&b, h))), "add");
        assert_eq!(bits(w.sub(v(a), v(b))), want(&|h| p.sub(half(&a, h), half(&b, h))), "sub");
        assert_eq!(bits(w.mul(v(a), v(b))), want(&|h| p.mul(half(&a, h), half(&b, h))), "mul");
        assert_eq!(bits(w.max(v(a), v(b))), want(&|h| p.max(half(&a, h), half(&b, h))), "max");
        assert_eq!(bits(w.max(v(b), v(a))), want(&|h| p.max(half(&b, h), half(&a, h))), "max, swapped");
        assert_eq!(
            bits(w.mul_add(v(a), v(b), v(c))),
            want(&|h| Lanes::mul_add(p, half(&a, h), half(&b, h), half(&c, h))),
            "mul_add"
        );
        assert_eq!(
            bits(w.select_lt(v(a), v(b), v(c), v(b))),
            want(&|h| p.select_lt(half(&a, h), half(&b, h), half(&c, h), half(&b, h))),
            "select_lt"
        );
        assert_eq!(
            bits(w.select_lt(v(b), v(a), v(c), v(a))),
            want(&|h| p.select_lt(half(&b, h), half(&a, h), half(&c, h), half(&a, h))),
            "select_lt, swapped"
        );
        assert_eq!(bits(w.splat(-1.25)), want(&|_| p.splat(-1.25)), "splat");
        assert_eq!(bits(w.zero()), want(&|_| p.zero()), "zero");
        // SAFETY: one readable float.
        assert_eq!(bits(unsafe { w.splat_at(&c[5]) }), want(&|_| p.splat(c[5])), "splat_at");
        let edges = [
            -1e4,
            -87.5,
            -87.0,
            -20.3,
            -0.0,
            0.0,
            1.7,
            60.2,
            88.0,
            88.5,
            1e4,
            1e-30,
            -1e-30,
            0.5,
            -0.5,
            f32::MIN_POSITIVE,
        ];
        assert_eq!(bits(w.exp(v(edges))), want(&|h| p.exp(half(&edges, h))), "exp at the edges");
        // bf16 pairs: lane j takes weights 2j and 2j + 1, the second product first.
        let weights: [half::bf16; 32] =
            std::array::from_fn(|i| half::bf16::from_f32(sample::<32>(4)[i] * 0.73));
        let xs = [half::bf16::from_f32(1.37), half::bf16::from_f32(-0.21)];
        // SAFETY: 32 readable weights, 2 readable activations.
        let dotted = unsafe {
            w.dot_bf16_pairs(v(c), w.splat_bf16_pair(xs.as_ptr()), w.load_bf16_pairs(weights.as_ptr()))
        };
        let chain: Vec<u32> = (0..n)
            .map(|j| {
                let (x0, x1, w0, w1) =
                    (xs[0].to_f32(), xs[1].to_f32(), weights[2 * j].to_f32(), weights[2 * j + 1].to_f32());
                x0.mul_add(w0, x1.mul_add(w1, c[j])).to_bits()
            })
            .collect();
        assert_eq!(bits(dotted), chain, "dot_bf16_pairs");
        for i in -3000..3000 {
            let x = sample::<16>(i as u32).map(|s| s * i as f32 * 0.0077);
            assert_eq!(bits(w.exp(v(x))), want(&|h| p.exp(half(&x, h))), "exp at step {i}");
        }
    }

    #[test]
    fn every_build_matches_the_portable_definition() {
        struct SameAsPortable;
        impl WideKernel for SameAsPortable {
            type Out = ();
            fn run<W: Wide>(self, w: W) {
                same_as_portable(w.narrow());
                wide_same_as_portable(w);
            }
        }
        let all = Simd::all();
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx512bf16") {
            assert!(matches!(all.last(), Some(Simd::Avx512Bf16(_))), "this CPU's bf16 build is tested");
        } else if is_x86_feature_detected!("avx512f") {
            assert!(matches!(all.last(), Some(Simd::Avx512(_))), "this CPU's 16-lane build is tested");
        }
        assert_eq!(
            all.iter().map(|s| s.name()).collect::<Vec<_>>(),
            Simd::NAMES[..all.len()],
            "names in order"
        );
        for simd in all {
            simd.run_wide(SameAsPortable);
        }
    }

    #[test]
    fn tree_max_is_the_largest_lane() {
        assert_eq!(tree_max([1.0, 1e8, -1e8, 3.0, 0.5, 0.25, 2.0, -7.0]), 1e8);
        assert_eq!(tree_max([f32::NEG_INFINITY; 8]), f32::NEG_INFINITY);
    }
}
