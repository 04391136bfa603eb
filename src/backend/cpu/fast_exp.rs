//! A vectorisable `exp` for the CPU backend's softmax and SiLU.
//!
//! libm's `expf` is a call per element that the compiler cannot vectorise; this
//! one is branch-free arithmetic, so loops over it become SIMD.

/// `exp(x)`, relative error ≤ 2e-7, for `x` in [−87, 88]; outside, `x` is
/// clamped to that range (so no inf, NaN or subnormal comes out).
///
/// `x = n·ln2 + r` with `|r| ≤ ln2/2`, `exp(r)` by its degree-7 Taylor polynomial
/// (truncation error < 1e-8 there), times `2^n` built in the exponent bits.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n·LN2_HI is exact for |n| < 2^9 (Cody–Waite).
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5·2^23: adding it rounds to an integer held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let n = t.to_bits() as i32 - ROUND.to_bits() as i32;
    p * f32::from_bits(((n + 127) << 23) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_f64_to_2e7_relative_over_its_range() {
        let mut worst = 0.0f64;
        for i in -870_000..=880_000 {
            let x = i as f32 * 1e-4;
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 2e-7, "worst relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-1e4) > 0.0 && exp(-1e4) < 1e-37);
        assert!(exp(1e4).is_finite() && exp(1e4) > 1e38);
    }
}
