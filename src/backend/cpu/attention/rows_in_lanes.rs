//! The attention layout for many lane rows (prefill): lane rows in SIMD lanes,
//! q and `acc` transposed (`[dim, lanes]`). A score is a broadcast key element
//! times 8 rows' q, a weighted sum a broadcast value element times 8 rows'
//! probabilities; max, `exp` and sums are lane-wise, with no horizontal
//! reduction anywhere. Its arithmetic is the one [`super`] states.

use super::kv_tile::TileRows;
use super::{Call, Job, KEY_TILE};
use crate::backend::cpu::lanes::Lanes;
use crate::backend::{AttnHeads, AttnSeq};

/// A job's running state, lane rows in SIMD lanes: lane row `r` is query row
/// `r / group`, head `r % group`; `rpad` lanes (a multiple of 8), the padding
/// lanes copies of the last row's limit with zero q.
struct State {
    rpad: usize,
    /// Floats between rows of the `[·, rpad]` buffers: `rpad` plus a 64-byte skew,
    /// so that a power-of-two lane count does not map every row to the same L1 sets.
    stride: usize,
    /// `[head_dim, rpad]`: the scaled q rows, transposed.
    qt: Vec<f32>,
    /// Exclusive key limit of each lane row (its position + 1).
    limit: Vec<usize>,
    m: Vec<f32>,
    l: Vec<f32>,
    alpha: Vec<f32>,
    /// `[head_dim, rpad]`: the weighted sums, transposed.
    acc: Vec<f32>,
    /// `[KEY_TILE, rpad]`: the tile's scores, then its probabilities.
    st: Vec<f32>,
}

/// Scores of `NK` keys against `8·RV` lane rows: `st[i][r] = Σ_d k_i[d] · q_r[d]`
/// as one multiply-add chain over `d` in order.
///
/// # Safety
/// `qt` and `st` point at lane `rv0` of their `[·, rpad]` buffers (`qt` for
/// `hd` rows, `st` for `NK`); `keys` hold `NK` rows of `hd` floats.
#[inline(always)]
unsafe fn qk_block<L: Lanes, const NK: usize, const RV: usize>(l: L, qt: *const f32, rpad: usize, keys: &[*const f32], hd: usize, st: *mut f32) {
    let kp: [*const f32; NK] = std::array::from_fn(|i| keys[i]);
    let mut acc = [[l.zero(); RV]; NK];
    for d in 0..hd {
        // SAFETY: d < hd rows of qt, 8·RV lanes from rv0 < rpad; key rows hold hd floats.
        let qv: [L::V; RV] = std::array::from_fn(|v| unsafe { l.load(qt.add(d * rpad + v * 8)) });
        for i in 0..NK {
            let kb = unsafe { l.splat_at(kp[i].add(d)) };
            for v in 0..RV {
                acc[i][v] = l.mul_add(kb, qv[v], acc[i][v]);
            }
        }
    }
    for i in 0..NK {
        for v in 0..RV {
            unsafe { l.store(st.add(i * rpad + v * 8), acc[i][v]) };
        }
    }
}

/// [`qk_block`] over all `keys`: 4 (two lane vectors) or 6 (one) at a time, then
/// 2 and 1. LLVM loads every key's broadcast before the multiply-adds, so
/// `NK · (RV + 1) + RV` registers must fit in 16.
///
/// # Safety
/// As [`qk_block`], `st` valid for `keys.len()` rows.
#[inline(always)]
unsafe fn qk_rows<L: Lanes, const RV: usize>(l: L, qt: *const f32, rpad: usize, keys: &[*const f32], hd: usize, st: *mut f32) {
    let n = keys.len();
    let mut j = 0;
    unsafe {
        if RV == 1 {
            while j + 6 <= n {
                qk_block::<L, 6, RV>(l, qt, rpad, &keys[j..], hd, st.add(j * rpad));
                j += 6;
            }
        }
        while j + 4 <= n {
            qk_block::<L, 4, RV>(l, qt, rpad, &keys[j..], hd, st.add(j * rpad));
            j += 4;
        }
        if j + 2 <= n {
            qk_block::<L, 2, RV>(l, qt, rpad, &keys[j..], hd, st.add(j * rpad));
            j += 2;
        }
        if j < n {
            qk_block::<L, 1, RV>(l, qt, rpad, &keys[j..], hd, st.add(j * rpad));
        }
    }
}

/// `acc[d][r] = acc[d][r] · α_r`, then `acc[d][r] = v_j[d] · p_j[r] + acc[d][r]`
/// (fused) for every key `j` in order, for dims `d0..d0+DB` and `8·RV` lanes; with
/// `MASK`, lanes whose visible count `n` is not above `j` keep their `acc`.
///
/// # Safety
/// `acc`, `alpha`, `pt` point at lane `rv0` (`acc` at dim row `d0`); `vals` rows
/// hold `d0 + DB` floats; `pt` holds `vals.len()` rows.
#[inline(always)]
unsafe fn pv_block<L: Lanes, const DB: usize, const RV: usize, const MASK: bool>(
    l: L,
    acc: *mut f32,
    rpad: usize,
    alpha: *const f32,
    pt: *const f32,
    vals: &[*const f32],
    d0: usize,
    n: [L::V; RV],
) {
    let mut a = [[l.zero(); RV]; DB];
    unsafe {
        let al: [L::V; RV] = std::array::from_fn(|v| l.load(alpha.add(v * 8)));
        for d in 0..DB {
            for v in 0..RV {
                a[d][v] = l.mul(l.load(acc.add(d * rpad + v * 8)), al[v]);
            }
        }
        for (j, &vj) in vals.iter().enumerate() {
            let pv: [L::V; RV] = std::array::from_fn(|v| l.load(pt.add(j * rpad + v * 8)));
            let jv = l.splat(j as f32);
            for d in 0..DB {
                let vb = l.splat_at(vj.add(d0 + d));
                for v in 0..RV {
                    let next = l.mul_add(vb, pv[v], a[d][v]);
                    a[d][v] = if MASK { l.select_lt(jv, n[v], next, a[d][v]) } else { next };
                }
            }
        }
        for d in 0..DB {
            for v in 0..RV {
                l.store(acc.add(d * rpad + v * 8), a[d][v]);
            }
        }
    }
}

/// [`pv_block`] over all `hd` dims: 6 (one lane vector) or 4 (two) at a time,
/// then 2 and 1; 4 then 1 when masking (more registers).
///
/// # Safety
/// As [`pv_block`] with `acc` at dim row 0 and `vals` rows of `hd` floats.
#[inline(always)]
unsafe fn pv_rows<L: Lanes, const RV: usize>(l: L, acc: *mut f32, rpad: usize, alpha: *const f32, pt: *const f32, vals: &[*const f32], hd: usize, n: Option<[L::V; RV]>) {
    let mut d0 = 0;
    let at = |d0: usize| unsafe { acc.add(d0 * rpad) };
    unsafe {
        match n {
            Some(n) => {
                while d0 + 4 <= hd {
                    pv_block::<L, 4, RV, true>(l, at(d0), rpad, alpha, pt, vals, d0, n);
                    d0 += 4;
                }
                while d0 < hd {
                    pv_block::<L, 1, RV, true>(l, at(d0), rpad, alpha, pt, vals, d0, n);
                    d0 += 1;
                }
            }
            None => {
                let n = [l.zero(); RV];
                // As in `qk_rows`: DB · (RV + 1) + RV registers.
                while RV == 1 && d0 + 6 <= hd {
                    pv_block::<L, 6, RV, false>(l, at(d0), rpad, alpha, pt, vals, d0, n);
                    d0 += 6;
                }
                while d0 + 4 <= hd {
                    pv_block::<L, 4, RV, false>(l, at(d0), rpad, alpha, pt, vals, d0, n);
                    d0 += 4;
                }
                if d0 + 2 <= hd {
                    pv_block::<L, 2, RV, false>(l, at(d0), rpad, alpha, pt, vals, d0, n);
                    d0 += 2;
                }
                if d0 < hd {
                    pv_block::<L, 1, RV, false>(l, at(d0), rpad, alpha, pt, vals, d0, n);
                }
            }
        }
    }
}

/// Folds the tile starting at `j0` (rows `keys` / `vals`, the ones that exist)
/// into lane vectors `v0..` of `st`.
#[inline(always)]
fn fold_tile<L: Lanes>(l: L, st: &mut State, v0: usize, j0: usize, keys: &[*const f32], vals: &[*const f32], hd: usize) {
    let rpad = st.stride;
    let nk = keys.len();
    let nvec = st.rpad / 8;
    // Visible keys of each lane (0 for rows that have finished), and whether a
    // vector needs masking (its first lane, the lowest position, sees fewer than nk).
    let visible = |st: &State, v: usize| -> [f32; 8] { std::array::from_fn(|i| (st.limit[v * 8 + i].saturating_sub(j0)).min(KEY_TILE) as f32) };
    let masked = |st: &State, v: usize| st.limit[v * 8] < j0 + nk;
    let (qt, stp) = (st.qt.as_ptr(), st.st.as_mut_ptr());
    let mut v = v0;
    // SAFETY (every block below): lane offsets v·8 + 8·RV <= rpad, dim rows < hd,
    // key rows < nk <= KEY_TILE, key/value rows of hd floats (the caller's pointers).
    while v < nvec {
        unsafe {
            if v + 2 <= nvec {
                qk_rows::<L, 2>(l, qt.add(v * 8), rpad, keys, hd, stp.add(v * 8));
            } else {
                qk_rows::<L, 1>(l, qt.add(v * 8), rpad, keys, hd, stp.add(v * 8));
            }
        }
        v += 2;
    }
    for v in v0..nvec {
        let mask = masked(st, v);
        let n = l.splat(0.0);
        let n = if mask { unsafe { l.load(visible(st, v).as_ptr()) } } else { n };
        let lane = v * 8;
        unsafe {
            let m_old = l.load(st.m.as_ptr().add(lane));
            let mut mx = m_old;
            for j in 0..nk {
                let s = l.load(st.st.as_ptr().add(j * rpad + lane));
                let s = if mask { l.select_lt(l.splat(j as f32), n, s, l.splat(f32::NEG_INFINITY)) } else { s };
                mx = l.max(mx, s);
            }
            let alpha = l.exp(l.sub(m_old, mx));
            let mut sum = l.mul(l.load(st.l.as_ptr().add(lane)), alpha);
            for j in 0..nk {
                let at = st.st.as_mut_ptr().add(j * rpad + lane);
                let p = l.exp(l.sub(l.load(at), mx));
                let p = if mask { l.select_lt(l.splat(j as f32), n, p, l.zero()) } else { p };
                l.store(at, p);
                sum = l.add(sum, p);
            }
            l.store(st.m.as_mut_ptr().add(lane), mx);
            l.store(st.l.as_mut_ptr().add(lane), sum);
            l.store(st.alpha.as_mut_ptr().add(lane), alpha);
        }
    }
    let (acc, alpha, pt) = (st.acc.as_mut_ptr(), st.alpha.as_ptr(), st.st.as_ptr());
    let mut v = v0;
    while v < nvec {
        let lane = v * 8;
        unsafe {
            if v + 2 <= nvec {
                let n = (masked(st, v) || masked(st, v + 1)).then(|| [l.load(visible(st, v).as_ptr()), l.load(visible(st, v + 1).as_ptr())]);
                pv_rows::<L, 2>(l, acc.add(lane), rpad, alpha.add(lane), pt.add(lane), vals, hd, n);
            } else {
                let n = masked(st, v).then(|| [l.load(visible(st, v).as_ptr())]);
                pv_rows::<L, 1>(l, acc.add(lane), rpad, alpha.add(lane), pt.add(lane), vals, hd, n);
            }
        }
        v += 2;
    }
}

/// Runs one job; its output rows, `[rows.len() · group, head_dim]` in (query row,
/// group head) order, which is the row-major layout of the job's output span.
#[inline(always)]
pub(super) fn run<L: Lanes>(l: L, call: &Call<'_>, seq: &AttnSeq<'_>, job: &Job) -> Vec<f32> {
    let AttnHeads { num_heads, kv_heads, head_dim: hd } = call.heads;
    let group = num_heads / kv_heads;
    let nrows = job.rows.len() * group;
    let rpad = nrows.next_multiple_of(8);
    let stride = rpad + 16;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut st = State {
        rpad,
        stride,
        qt: vec![0.0; hd * stride],
        limit: Vec::with_capacity(rpad),
        m: vec![f32::NEG_INFINITY; rpad],
        l: vec![0.0; rpad],
        alpha: vec![0.0; rpad],
        acc: vec![0.0; hd * stride],
        st: vec![0.0; KEY_TILE * stride],
    };
    for (r, (q, limit)) in job.lane_rows(call, seq).enumerate() {
        for (d, x) in q.iter().enumerate() {
            st.qt[d * stride + r] = x * scale;
        }
        st.limit.push(limit);
    }
    let last = *st.limit.last().expect("a job has rows");
    st.limit.resize(rpad, last);
    let mut tile_rows = TileRows::new(call);
    let end = job.key_end(seq);
    let first = seq.num_computed + job.rows.start;
    for j0 in (0..end).step_by(KEY_TILE) {
        let n = (end - j0).min(KEY_TILE);
        tile_rows.load(l, call, seq, job, j0..j0 + n);
        // Lane vectors all of whose rows are below the tile have finished.
        let v0 = j0.saturating_sub(first) * group / 8;
        fold_tile(l, &mut st, v0, j0, &tile_rows.keys, &tile_rows.vals, hd);
    }
    let mut out = vec![0.0f32; nrows * hd];
    for (r, o) in out.chunks_exact_mut(hd).enumerate() {
        let inv = 1.0 / st.l[r];
        for (d, x) in o.iter_mut().enumerate() {
            *x = st.acc[d * stride + r] * inv;
        }
    }
    out
}
