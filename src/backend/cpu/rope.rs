//! Rotary embedding (1-D, sectioned and interleaved M-RoPE), rotate-half convention.

use ndarray::{Array2, Axis, parallel::prelude::*};

use super::check::shape_error;
use crate::Result;
use crate::backend::{RopePositions, RopeSpec};
use crate::error::BackendError;

/// Rotates every head of `x [n, heads*head_dim]` in place by its row's positions.
pub(crate) fn apply(x: &mut Array2<f32>, spec: &RopeSpec, pos: RopePositions<'_>) -> Result<()> {
    let hd = spec.head_dim;
    if hd == 0 || !hd.is_multiple_of(2) || !x.ncols().is_multiple_of(hd) {
        return Err(shape_error("rope", "x", format!("[n, heads * {hd}] with even head_dim"), x));
    }
    for (what, p) in [("positions.t", pos.t), ("positions.h", pos.h), ("positions.w", pos.w)] {
        if p.len() != x.nrows() {
            return Err(BackendError::OpShape {
                op: "rope",
                what,
                expected: format!("[{}]", x.nrows()),
                found: vec![p.len()],
            }
            .into());
        }
    }
    if !x.is_standard_layout() {
        *x = x.as_standard_layout().into_owned();
    }
    let half = hd / 2;
    let freqs: Vec<(usize, f32)> = (0..half).map(|i| (spec.axis(i), spec.inv_freq(i))).collect();
    x.axis_iter_mut(Axis(0)).into_par_iter().enumerate().for_each(|(r, mut row)| {
        let (cos, sin): (Vec<f32>, Vec<f32>) = freqs
            .iter()
            .map(|&(axis, inv)| {
                let angle = pos.axis(axis)[r] as f32 * inv;
                (angle.cos(), angle.sin())
            })
            .unzip();
        if let Some(row) = row.as_slice_mut() {
            for head in row.chunks_exact_mut(hd) {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (x1, x2) = (a[i], b[i]);
                    a[i] = x1 * cos[i] - x2 * sin[i];
                    b[i] = x2 * cos[i] + x1 * sin[i];
                }
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::RopeKind;
    use crate::error::Error;

    fn spec(kind: RopeKind) -> RopeSpec {
        RopeSpec { theta: 10_000.0, head_dim: 8, kind }
    }

    #[test]
    fn plain_rope_matches_the_formula() {
        let s = spec(RopeKind::Plain);
        let mut x = Array2::from_shape_fn((3, 16), |(r, c)| (r * 16 + c) as f32 * 0.1 - 1.0);
        let orig = x.clone();
        let p = [0i64, 5, 1000];
        apply(&mut x, &s, RopePositions { t: &p, h: &p, w: &p }).unwrap();
        for r in 0..3 {
            for head in 0..2 {
                for i in 0..4 {
                    let theta = p[r] as f64 / 10_000f64.powf(2.0 * i as f64 / 8.0);
                    let (a, b) = (orig[[r, head * 8 + i]] as f64, orig[[r, head * 8 + i + 4]] as f64);
                    let ea = a * theta.cos() - b * theta.sin();
                    let eb = b * theta.cos() + a * theta.sin();
                    assert!((x[[r, head * 8 + i]] as f64 - ea).abs() < 1e-3, "row {r} head {head} i {i}");
                    assert!((x[[r, head * 8 + i + 4]] as f64 - eb).abs() < 1e-3, "row {r} head {head} i {i}");
                }
            }
        }
        // Position 0 is the identity.
        assert_eq!(x.row(0), orig.row(0));
    }

    #[test]
    fn mrope_axis_maps_match_hf() {
        // Qwen3-Omni: head_dim 128, sections [24, 20, 20], interleaved.
        let inter = RopeSpec { theta: 1e6, head_dim: 128, kind: RopeKind::Interleaved([24, 20, 20]) };
        let axes: Vec<usize> = (0..64).map(|i| inter.axis(i)).collect();
        assert_eq!(&axes[..7], &[0, 1, 2, 0, 1, 2, 0]);
        // H covers i % 3 == 1 below 60, W i % 3 == 2 below 60, the tail is temporal.
        assert_eq!(axes.iter().filter(|&&a| a == 1).count(), 20);
        assert_eq!(axes.iter().filter(|&&a| a == 2).count(), 20);
        assert_eq!(&axes[58..], &[1, 2, 0, 0, 0, 0]);
        // Qwen2.5-Omni: head_dim 128, sections [16, 24, 24], contiguous.
        let sect = RopeSpec { theta: 1e6, head_dim: 128, kind: RopeKind::Sectioned([16, 24, 24]) };
        assert_eq!(
            (sect.axis(15), sect.axis(16), sect.axis(39), sect.axis(40), sect.axis(63)),
            (0, 1, 1, 2, 2)
        );
    }

    #[test]
    fn mrope_uses_each_axis_position_for_its_frequencies() {
        // Known values: head_dim 8 (4 frequencies), t=1, h=2, w=3, theta 10000.
        let x0 = Array2::from_shape_fn((1, 8), |(_, c)| if c < 4 { 1.0 } else { 0.0 });
        let (t, h, w) = ([1i64], [2i64], [3i64]);
        let run = |kind| {
            let mut x = x0.clone();
            apply(&mut x, &spec(kind), RopePositions { t: &t, h: &h, w: &w }).unwrap();
            x
        };
        // With a = 1, b = 0 the rotated pair is (cos, sin) of the angle.
        let check = |x: &Array2<f32>, expect_pos: [f64; 4]| {
            for (i, p) in expect_pos.iter().enumerate() {
                let angle = p / 10_000f64.powf(2.0 * i as f64 / 8.0);
                assert!((x[[0, i]] as f64 - angle.cos()).abs() < 1e-5, "freq {i}");
                assert!((x[[0, i + 4]] as f64 - angle.sin()).abs() < 1e-5, "freq {i}");
            }
        };
        // Interleaved [2, 1, 1]: freq 0 T, 1 H, 2 W, 3 T.
        check(&run(RopeKind::Interleaved([2, 1, 1])), [1.0, 2.0, 3.0, 1.0]);
        // Sectioned [2, 1, 1]: freq 0,1 T, 2 H, 3 W.
        check(&run(RopeKind::Sectioned([2, 1, 1])), [1.0, 1.0, 2.0, 3.0]);
    }

    #[test]
    fn wrong_position_count_is_an_error() {
        let mut x = Array2::zeros((2, 8));
        let p = [0i64];
        let err = apply(&mut x, &spec(RopeKind::Plain), RopePositions { t: &p, h: &p, w: &p }).unwrap_err();
        assert!(matches!(err, Error::Backend(BackendError::OpShape { op: "rope", what: "positions.t", .. })));
    }
}
