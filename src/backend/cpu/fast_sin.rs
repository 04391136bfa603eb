//! A vectorisable `sin²` for SnakeBeta, code2wav's activation.
//!
//! libm's `sinf` is a call per element that the compiler cannot vectorise; it
//! was a quarter of code2wav's time (every decoder row and channel, at the
//! waveform's rate). This one is branch-free arithmetic below [`SIN_SQUARED_LIMIT`],
//! so a loop over it becomes SIMD; the caller takes libm above it.

/// `|x|` up to which [`sin_squared`] is accurate; beyond, it is not (callers use libm).
pub(crate) const SIN_SQUARED_LIMIT: f32 = 8192.0;

/// `sin(x)²`, absolute error ≤ 5e-7 for `|x| ≤` [`SIN_SQUARED_LIMIT`].
///
/// `sin²` has period π: `x = k·π + r` with `|r| ≤ π/2` (π split in three for
/// Cody–Waite, cephes' constants, so `k·PI_A` and `k·PI_B` are exact for `k <
/// 2^13`), then `sin(r)` by its Taylor polynomial to `r^11` (truncation < 6e-8).
#[inline(always)]
pub(crate) fn sin_squared(x: f32) -> f32 {
    const INV_PI: f32 = std::f32::consts::FRAC_1_PI;
    const PI_A: f32 = 3.140_625;
    const PI_B: f32 = 9.675_026e-4;
    const PI_C: f32 = 1.509_958e-7;
    // 1.5·2^23: adding it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let k = (x * INV_PI + ROUND) - ROUND;
    let r = ((x - k * PI_A) - k * PI_B) - k * PI_C;
    let r2 = r * r;
    let s = r + r
        * r2
        * (-1.0 / 6.0
            + r2 * (1.0 / 120.0
                + r2 * (-1.0 / 5040.0 + r2 * (1.0 / 362_880.0 + r2 * (-1.0 / 39_916_800.0)))));
    s * s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sin_squared_matches_f64_to_5e7_over_its_range() {
        let mut worst = 0.0f64;
        let mut check = |x: f32| {
            let want = (x as f64).sin().powi(2);
            worst = worst.max((sin_squared(x) as f64 - want).abs());
        };
        for i in -2_000_000..=2_000_000 {
            check(i as f32 * 5e-5);
        }
        for i in 0..=1_000_000 {
            let x = i as f32 * (SIN_SQUARED_LIMIT / 1e6);
            check(x);
            check(-x);
        }
        assert!(worst < 5e-7, "worst absolute error {worst:e}");
        assert_eq!(sin_squared(0.0), 0.0);
    }
}
