//! The attention layout for a few lane rows (decode): keys in lanes for the
//! scores (each key tile's K transposed once), dims in lanes for `acc`. Per
//! element it computes exactly what [`super::rows_in_lanes`] computes.

#![allow(
    clippy::needless_range_loop,
    reason = "register tiles: one index walks several fixed-size arrays (accumulators, loaded vectors, row pointers) in step"
)]

use std::ops::Range;

use super::kv_tile::TileRows;
use super::{Call, Job, KEY_TILE};
use crate::backend::cpu::lanes::{self, Lanes};
use crate::backend::{AttnHeads, AttnSeq};

/// `acc_r = acc_r · α_r` (when `alpha` is given), then `acc_r = v_j · p_r[j] + acc_r`
/// (fused) for `j` in `keys`, in order, on `DV` 8-lane vectors of dims from `dv0·8`:
/// per element the same operations as [`super::rows_in_lanes`]'s `pv_block`.
///
/// # Safety
/// `acc[r]` read/writable for `(dv0 + DV) · 8` floats, `p[r]` readable at every
/// index of `keys`, `vals[j]` readable for `(dv0 + DV) · 8` floats.
#[inline(always)]
unsafe fn weigh<L: Lanes, const R: usize, const DV: usize>(
    l: L, acc: [*mut f32; R], p: [*const f32; R], alpha: Option<[f32; R]>, vals: &[*const f32],
    keys: Range<usize>, dv0: usize,
) {
    let mut a = [[l.zero(); DV]; R];
    // SAFETY: the caller keeps the contract above: every row and key pointer is in bounds.
    unsafe {
        for r in 0..R {
            for d in 0..DV {
                a[r][d] = l.load(acc[r].add((dv0 + d) * 8));
            }
            if let Some(alpha) = alpha {
                let s = l.splat(alpha[r]);
                for d in 0..DV {
                    a[r][d] = l.mul(a[r][d], s);
                }
            }
        }
        for j in keys {
            let vj = vals[j];
            let vv: [L::V; DV] = std::array::from_fn(|d| l.load(vj.add((dv0 + d) * 8)));
            for r in 0..R {
                let pj = l.splat_at(p[r].add(j));
                for d in 0..DV {
                    a[r][d] = l.mul_add(vv[d], pj, a[r][d]);
                }
            }
        }
        for r in 0..R {
            for d in 0..DV {
                l.store(acc[r].add((dv0 + d) * 8), a[r][d]);
            }
        }
    }
}

/// [`weigh`] over all `hd / 8` vectors, `DV` at a time, then one at a time.
///
/// # Safety
/// As [`weigh`] with `dv0 + DV` replaced by `hd / 8`.
#[inline(always)]
unsafe fn weigh_all<L: Lanes, const R: usize, const DV: usize>(
    l: L, acc: [*mut f32; R], p: [*const f32; R], alpha: Option<[f32; R]>, vals: &[*const f32],
    keys: Range<usize>, hd: usize,
) {
    let nv = hd / 8;
    let mut dv0 = 0;
    // SAFETY: as `weigh`, which this calls with `dv0 + DV <= hd / 8`.
    unsafe {
        while dv0 + DV <= nv {
            weigh::<L, R, DV>(l, acc, p, alpha, vals, keys.clone(), dv0);
            dv0 += DV;
        }
        while dv0 < nv {
            weigh::<L, R, 1>(l, acc, p, alpha, vals, keys.clone(), dv0);
            dv0 += 1;
        }
    }
}

/// Runs one job of a few lane rows (at most [`super::ROW_PATH_MAX`]) with
/// `head_dim % 8 == 0`, keys in lanes instead of rows: each tile's K rows are transposed once into
/// `[head_dim, KEY_TILE]`, a row's scores are 8 keys per multiply-add, its
/// weighted sum 8 dims per multiply-add. Per element these are exactly the
/// operations of the lane-per-row path: the same multiply-add chain over `d`
/// for a score, the same `max`, `exp`, sums in key order and `acc` chain.
#[inline(always)]
pub(super) fn run<L: Lanes>(l: L, call: &Call<'_>, seq: &AttnSeq<'_>, job: &Job) -> Vec<f32> {
    let AttnHeads { num_heads, kv_heads, head_dim: hd } = call.heads;
    let group = num_heads / kv_heads;
    let nrows = job.rows.len() * group;
    debug_assert!(nrows <= super::ROW_PATH_MAX && hd.is_multiple_of(8));
    let scale = 1.0 / (hd as f32).sqrt();
    let mut q = vec![0.0f32; nrows * hd];
    let mut limit = Vec::with_capacity(nrows);
    for (r, (q_head, lim)) in job.lane_rows(call, seq).enumerate() {
        for (d, x) in q[r * hd..][..hd].iter_mut().zip(q_head) {
            *d = x * scale;
        }
        limit.push(lim);
    }
    let mut m = vec![f32::NEG_INFINITY; nrows];
    let mut lsum = vec![0.0f32; nrows];
    let mut alpha = vec![0.0f32; nrows];
    let mut acc = vec![0.0f32; nrows * hd];
    let mut p = vec![0.0f32; nrows * KEY_TILE];
    let mut kt = vec![0.0f32; hd * KEY_TILE];
    let mut tile_rows = TileRows::new(call);
    let end = job.key_end(seq);
    for j0 in (0..end).step_by(KEY_TILE) {
        let nk = (end - j0).min(KEY_TILE);
        tile_rows.load(l, call, seq, job, j0..j0 + nk);
        let (keys, vals) = (&tile_rows.keys, &tile_rows.vals);
        // kt[d][j] = k_j[d], 8 keys × 8 dims at a time (keys past nk repeat the last).
        let groups = nk.div_ceil(8);
        for kg in 0..groups {
            let rows: [*const f32; 8] = std::array::from_fn(|i| keys[(kg * 8 + i).min(nk - 1)]);
            for c in (0..hd).step_by(8) {
                // SAFETY: key rows hold hd floats, c + 8 <= hd; kt holds hd rows of KEY_TILE.
                unsafe {
                    let x = l.transpose8(rows.map(|r| l.load(r.add(c))));
                    for (i, xi) in x.into_iter().enumerate() {
                        l.store(kt.as_mut_ptr().add((c + i) * KEY_TILE + kg * 8), xi);
                    }
                }
            }
        }
        for r in 0..nrows {
            let n = limit[r].saturating_sub(j0).min(KEY_TILE);
            if n == 0 {
                continue;
            }
            let pr = &mut p[r * KEY_TILE..(r + 1) * KEY_TILE];
            let qr = &q[r * hd..(r + 1) * hd];
            // Scores of keys 0..n, 8 per lane vector (all 8 vectors at once).
            let used = n.div_ceil(8);
            let mut sc = [l.zero(); KEY_TILE / 8];
            for (d, &qd) in qr.iter().enumerate() {
                let qb = l.splat(qd);
                for (g, s) in sc.iter_mut().enumerate().take(used) {
                    // SAFETY: kt row d holds KEY_TILE floats.
                    *s = l.mul_add(unsafe { l.load(kt.as_ptr().add(d * KEY_TILE + g * 8)) }, qb, *s);
                }
            }
            let mut mx = l.splat(m[r]);
            for (g, s) in sc.iter().enumerate().take(used) {
                mx = l.max(mx, l.keep_first(*s, n - g * 8, f32::NEG_INFINITY));
            }
            let m_new = lanes::tree_max(l.to_array(mx));
            let a = l.to_array(l.exp(l.splat(m[r] - m_new)))[0];
            let mv = l.splat(m_new);
            for (g, s) in sc.iter().enumerate().take(used) {
                // SAFETY: p row holds KEY_TILE floats.
                unsafe { l.store(pr.as_mut_ptr().add(g * 8), l.exp(l.sub(*s, mv))) };
            }
            let mut sum = lsum[r] * a;
            for &pj in &pr[..n] {
                sum += pj;
            }
            lsum[r] = sum;
            m[r] = m_new;
            alpha[r] = a;
        }
        // acc = acc·α + Σ p·v over each row's visible keys: blocks of rows over the
        // keys all of them see, then each row alone over the rest.
        let (ap, pp) = (acc.as_mut_ptr(), p.as_ptr());
        let first = (0..nrows).find(|&r| limit[r] > j0).unwrap_or(nrows);
        let mut r = first;
        while r < nrows {
            let width = if r + 4 <= nrows {
                4
            } else if r + 2 <= nrows {
                2
            } else {
                1
            };
            let common = limit[r].saturating_sub(j0).min(KEY_TILE);
            // SAFETY: `r + i < nrows` and `acc` holds `nrows` rows of `hd` floats.
            let a = |i: usize| unsafe { ap.add((r + i) * hd) };
            // SAFETY: `r + i < nrows` and `p` holds `nrows` rows of `KEY_TILE` floats.
            let pr = |i: usize| unsafe { pp.add((r + i) * KEY_TILE) };
            let al = |i: usize| alpha[r + i];
            // SAFETY: acc rows hold hd floats, p rows KEY_TILE, vals[..n] hold hd floats.
            unsafe {
                match width {
                    4 => weigh_all::<L, 4, 2>(
                        l,
                        [a(0), a(1), a(2), a(3)],
                        [pr(0), pr(1), pr(2), pr(3)],
                        Some([al(0), al(1), al(2), al(3)]),
                        vals,
                        0..common,
                        hd,
                    ),
                    2 => weigh_all::<L, 2, 4>(
                        l,
                        [a(0), a(1)],
                        [pr(0), pr(1)],
                        Some([al(0), al(1)]),
                        vals,
                        0..common,
                        hd,
                    ),
                    _ => weigh_all::<L, 1, 8>(l, [a(0)], [pr(0)], Some([al(0)]), vals, 0..common, hd),
                }
                for i in 0..width {
                    let n = limit[r + i].saturating_sub(j0).min(KEY_TILE);
                    if n > common {
                        weigh_all::<L, 1, 8>(l, [a(i)], [pr(i)], None, vals, common..n, hd);
                    }
                }
            }
            r += width;
        }
    }
    let mut out = vec![0.0f32; nrows * hd];
    for (r, o) in out.chunks_exact_mut(hd).enumerate() {
        let inv = 1.0 / lsum[r];
        for (x, a) in o.iter_mut().zip(&acc[r * hd..(r + 1) * hd]) {
            *x = a * inv;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    use super::super::tests::{fill, kv_spec};
    use super::super::{Call, Job, OP, ROW_PATH_MAX, rows_in_lanes};
    use super::*;
    use crate::backend::Dtype;
    use crate::backend::cpu::lanes::{Simd, Wide, WideKernel};
    use crate::backend::test_support::rand_rows_from;

    /// One job through both layouts.
    struct BothLayouts<'a> {
        call: &'a Call<'a>,
        seq: &'a AttnSeq<'a>,
        job: &'a Job,
    }

    impl WideKernel for BothLayouts<'_> {
        type Out = (Vec<f32>, Vec<f32>);
        #[inline(always)]
        fn run<W: Wide>(self, w: W) -> Self::Out {
            (
                run(w.narrow(), self.call, self.seq, self.job),
                rows_in_lanes::run(w, self.call, self.seq, self.job),
            )
        }
    }

    /// What the module promises: per element the operations of the rows-in-lanes
    /// layout, so a few-row job gives the same bits through either one, on every
    /// build, for each page type, group size and position (inside, on and across
    /// key tiles).
    #[test]
    fn a_few_rows_give_the_bits_of_the_rows_in_lanes_layout() {
        let mut rng = ChaCha8Rng::seed_from_u64(13);
        let hd = 64;
        for kv_dtype in [Dtype::F32, Dtype::F16, Dtype::Bf16] {
            for (num_heads, kv_heads) in [(4, 4), (4, 2), (8, 2)] {
                let heads = AttnHeads { num_heads, kv_heads, head_dim: hd };
                let lens = [1, 3, 64, 65, 130, 200];
                let spec = kv_spec(40, 16, kv_heads, hd, kv_dtype);
                let (pages, tables, _) = fill(&mut rng, spec, &lens);
                let (k, v) = pages.kv(OP, 1).unwrap();
                let group = num_heads / kv_heads;
                let new = ROW_PATH_MAX / group;
                let q = rand_rows_from(&mut rng, new, num_heads * hd);
                let call = Call {
                    q: q.as_slice().unwrap(),
                    q_cols: q.ncols(),
                    k,
                    v,
                    heads,
                    block_size: spec.block_size,
                };
                for (&len, table) in lens.iter().zip(&tables) {
                    for rows in (1..=new.min(len)).map(|n| 0..n) {
                        let seq = AttnSeq {
                            query_start: 0,
                            num_new: rows.end,
                            num_computed: len - rows.end,
                            block_table: table,
                        };
                        for kv_head in 0..kv_heads {
                            let job = Job { seq: 0, kv_head, rows: rows.clone() };
                            for simd in Simd::all() {
                                let (keys, lanes) =
                                    simd.run_wide(BothLayouts { call: &call, seq: &seq, job: &job });
                                let same = keys.iter().zip(&lanes).all(|(a, b)| a.to_bits() == b.to_bits());
                                assert!(
                                    same && keys.len() == lanes.len(),
                                    "{simd:?} {kv_dtype} {num_heads}/{kv_heads} len {len} rows {rows:?} kv head {kv_head}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
