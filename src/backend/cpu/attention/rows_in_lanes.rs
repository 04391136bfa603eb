//! The attention layout for many lane rows (prefill): lane rows in SIMD lanes,
//! q and `acc` transposed (`[dim, lanes]`), on the CPU's widest lanes ([`Wide`]:
//! `W::WIDTH`, 16 with AVX-512). A score is a broadcast key element times
//! `WIDTH` rows' q, a weighted sum a broadcast value element times `WIDTH` rows'
//! probabilities; max, `exp` and sums are lane-wise, with no horizontal
//! reduction anywhere, so the width never changes a row's bits. Its arithmetic
//! is the one [`super`] states.

#![allow(
    clippy::needless_range_loop,
    reason = "register tiles: one index walks several fixed-size arrays (accumulators, loaded vectors, row pointers) in step"
)]
#![allow(
    clippy::too_many_arguments,
    reason = "kernel entry points take the tile's raw pointers and sizes one by one"
)]

use super::kv_tile::TileRows;
use super::{Call, Job, KEY_TILE};
use crate::backend::cpu::lanes::Wide;
use crate::backend::{AttnHeads, AttnSeq};

/// A job's running state, lane rows in SIMD lanes: lane row `r` is query row
/// `r / group`, head `r % group`; `rpad` lanes (a multiple of `W::WIDTH`), the padding
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

/// Scores of `NK` keys against `WIDTH·RV` lane rows: `st[i][r] = Σ_d k_i[d] · q_r[d]`
/// as one multiply-add chain over `d` in order.
///
/// # Safety
/// `qt` and `st` point at lane `rv0` of their `[·, rpad]` buffers (`qt` for
/// `hd` rows, `st` for `NK`); `keys` hold `NK` rows of `hd` floats.
#[inline(always)]
unsafe fn qk_block<W: Wide, const NK: usize, const RV: usize>(
    w: W, qt: *const f32, rpad: usize, keys: &[*const f32], hd: usize, st: *mut f32,
) {
    let kp: [*const f32; NK] = std::array::from_fn(|i| keys[i]);
    let mut acc = [[w.zero(); RV]; NK];
    for d in 0..hd {
        // SAFETY: d < hd rows of qt, WIDTH·RV lanes from rv0 < rpad; key rows hold hd floats.
        let qv: [W::V; RV] = std::array::from_fn(|v| unsafe { w.load(qt.add(d * rpad + v * W::WIDTH)) });
        for i in 0..NK {
            // SAFETY: `d < hd` and each key row holds `hd` floats (the caller's contract).
            let kb = unsafe { w.splat_at(kp[i].add(d)) };
            for v in 0..RV {
                acc[i][v] = w.mul_add(kb, qv[v], acc[i][v]);
            }
        }
    }
    for i in 0..NK {
        for v in 0..RV {
            // SAFETY: `i < NK` rows of `st`, `WIDTH * RV` lanes within `rpad` (the caller's contract).
            unsafe { w.store(st.add(i * rpad + v * W::WIDTH), acc[i][v]) };
        }
    }
}

/// [`qk_block`] over all `keys`: 4 (two lane vectors) or 6 (one) at a time, then
/// 2 and 1; with 16 lanes (AVX-512, 32 registers) 8 or 12 first. LLVM loads
/// every key's broadcast before the multiply-adds, so `NK · (RV + 1) + RV`
/// registers must fit in 16 (32 with AVX-512).
///
/// # Safety
/// As [`qk_block`], `st` valid for `keys.len()` rows.
#[inline(always)]
unsafe fn qk_rows<W: Wide, const RV: usize>(
    w: W, qt: *const f32, rpad: usize, keys: &[*const f32], hd: usize, st: *mut f32,
) {
    let n = keys.len();
    let mut j = 0;
    // SAFETY: each block reads `NK` keys from `j`, with `j + NK <= n`, and `st` holds `n` rows.
    unsafe {
        if W::WIDTH == 16 && RV == 1 {
            while j + 12 <= n {
                qk_block::<W, 12, RV>(w, qt, rpad, &keys[j..], hd, st.add(j * rpad));
                j += 12;
            }
        }
        if W::WIDTH == 16 {
            while j + 8 <= n {
                qk_block::<W, 8, RV>(w, qt, rpad, &keys[j..], hd, st.add(j * rpad));
                j += 8;
            }
        }
        if RV == 1 {
            while j + 6 <= n {
                qk_block::<W, 6, RV>(w, qt, rpad, &keys[j..], hd, st.add(j * rpad));
                j += 6;
            }
        }
        while j + 4 <= n {
            qk_block::<W, 4, RV>(w, qt, rpad, &keys[j..], hd, st.add(j * rpad));
            j += 4;
        }
        if j + 2 <= n {
            qk_block::<W, 2, RV>(w, qt, rpad, &keys[j..], hd, st.add(j * rpad));
            j += 2;
        }
        if j < n {
            qk_block::<W, 1, RV>(w, qt, rpad, &keys[j..], hd, st.add(j * rpad));
        }
    }
}

/// `acc[d][r] = acc[d][r] · α_r`, then `acc[d][r] = v_j[d] · p_j[r] + acc[d][r]`
/// (fused) for every key `j` in order, for dims `d0..d0+DB` and `WIDTH·RV` lanes; with
/// `MASK`, lanes whose visible count `n` is not above `j` keep their `acc`.
///
/// # Safety
/// `acc`, `alpha`, `pt` point at lane `rv0` (`acc` at dim row `d0`); `vals` rows
/// hold `d0 + DB` floats; `pt` holds `vals.len()` rows.
#[inline(always)]
unsafe fn pv_block<W: Wide, const DB: usize, const RV: usize, const MASK: bool>(
    w: W, acc: *mut f32, rpad: usize, alpha: *const f32, pt: *const f32, vals: &[*const f32], d0: usize,
    n: [W::V; RV],
) {
    let mut a = [[w.zero(); RV]; DB];
    // SAFETY: the caller keeps the contract above (lanes from `rv0`, `d0 + DB` floats a row).
    unsafe {
        let al: [W::V; RV] = std::array::from_fn(|v| w.load(alpha.add(v * W::WIDTH)));
        for d in 0..DB {
            for v in 0..RV {
                a[d][v] = w.mul(w.load(acc.add(d * rpad + v * W::WIDTH)), al[v]);
            }
        }
        for (j, &vj) in vals.iter().enumerate() {
            let pv: [W::V; RV] = std::array::from_fn(|v| w.load(pt.add(j * rpad + v * W::WIDTH)));
            let jv = w.splat(j as f32);
            for d in 0..DB {
                let vb = w.splat_at(vj.add(d0 + d));
                for v in 0..RV {
                    let next = w.mul_add(vb, pv[v], a[d][v]);
                    a[d][v] = if MASK { w.select_lt(jv, n[v], next, a[d][v]) } else { next };
                }
            }
        }
        for d in 0..DB {
            for v in 0..RV {
                w.store(acc.add(d * rpad + v * W::WIDTH), a[d][v]);
            }
        }
    }
}

/// [`pv_block`] over all `hd` dims: 6 (one lane vector) or 4 (two) at a time,
/// then 2 and 1; 4 then 1 when masking (more registers). With 16 lanes (32
/// registers) 12 (one vector) or 8 first, 8 when masking.
///
/// # Safety
/// As [`pv_block`] with `acc` at dim row 0 and `vals` rows of `hd` floats.
#[inline(always)]
unsafe fn pv_rows<W: Wide, const RV: usize>(
    w: W, acc: *mut f32, rpad: usize, alpha: *const f32, pt: *const f32, vals: &[*const f32], hd: usize,
    n: Option<[W::V; RV]>,
) {
    let mut d0 = 0;
    // SAFETY: `d0 < hd` dim rows of `acc`, each `rpad` floats (the caller's contract).
    let at = |d0: usize| unsafe { acc.add(d0 * rpad) };
    // SAFETY: each block covers dims `d0 .. d0 + DB <= hd`, within the caller's contract.
    unsafe {
        match n {
            Some(n) => {
                while W::WIDTH == 16 && d0 + 8 <= hd {
                    pv_block::<W, 8, RV, true>(w, at(d0), rpad, alpha, pt, vals, d0, n);
                    d0 += 8;
                }
                while d0 + 4 <= hd {
                    pv_block::<W, 4, RV, true>(w, at(d0), rpad, alpha, pt, vals, d0, n);
                    d0 += 4;
                }
                while d0 < hd {
                    pv_block::<W, 1, RV, true>(w, at(d0), rpad, alpha, pt, vals, d0, n);
                    d0 += 1;
                }
            }
            None => {
                let n = [w.zero(); RV];
                // As in `qk_rows`: DB · (RV + 1) + RV registers.
                while W::WIDTH == 16 && RV == 1 && d0 + 12 <= hd {
                    pv_block::<W, 12, RV, false>(w, at(d0), rpad, alpha, pt, vals, d0, n);
                    d0 += 12;
                }
                while W::WIDTH == 16 && d0 + 8 <= hd {
                    pv_block::<W, 8, RV, false>(w, at(d0), rpad, alpha, pt, vals, d0, n);
                    d0 += 8;
                }
                while RV == 1 && d0 + 6 <= hd {
                    pv_block::<W, 6, RV, false>(w, at(d0), rpad, alpha, pt, vals, d0, n);
                    d0 += 6;
                }
                while d0 + 4 <= hd {
                    pv_block::<W, 4, RV, false>(w, at(d0), rpad, alpha, pt, vals, d0, n);
                    d0 += 4;
                }
                if d0 + 2 <= hd {
                    pv_block::<W, 2, RV, false>(w, at(d0), rpad, alpha, pt, vals, d0, n);
                    d0 += 2;
                }
                if d0 < hd {
                    pv_block::<W, 1, RV, false>(w, at(d0), rpad, alpha, pt, vals, d0, n);
                }
            }
        }
    }
}

/// Folds the tile starting at `j0` (rows `keys` / `vals`, the ones that exist)
/// into lane vectors `v0..` of `st`.
#[inline(always)]
fn fold_tile<W: Wide>(
    w: W, st: &mut State, v0: usize, j0: usize, keys: &[*const f32], vals: &[*const f32], hd: usize,
) {
    let rpad = st.stride;
    let nk = keys.len();
    let nvec = st.rpad / W::WIDTH;
    // Visible keys of each lane (0 for rows that have finished), and whether a
    // vector needs masking (its first lane, the lowest position, sees fewer than nk).
    // `visible` fills the first WIDTH entries of its (widest) array.
    let visible = |st: &State, v: usize| -> [f32; 16] {
        std::array::from_fn(|i| {
            if i < W::WIDTH {
                (st.limit[v * W::WIDTH + i].saturating_sub(j0)).min(KEY_TILE) as f32
            } else {
                0.0
            }
        })
    };
    let masked = |st: &State, v: usize| st.limit[v * W::WIDTH] < j0 + nk;
    let (qt, stp) = (st.qt.as_ptr(), st.st.as_mut_ptr());
    let mut v = v0;
    // SAFETY (every block below): lane offsets v·WIDTH + WIDTH·RV <= rpad, dim rows < hd,
    // key rows < nk <= KEY_TILE, key/value rows of hd floats (the caller's pointers).
    while v < nvec {
        // SAFETY: lane offsets `v * WIDTH + WIDTH * RV <= rpad`; key rows < `nk` (see above).
        unsafe {
            if v + 2 <= nvec {
                qk_rows::<W, 2>(w, qt.add(v * W::WIDTH), rpad, keys, hd, stp.add(v * W::WIDTH));
            } else {
                qk_rows::<W, 1>(w, qt.add(v * W::WIDTH), rpad, keys, hd, stp.add(v * W::WIDTH));
            }
        }
        v += 2;
    }
    for v in v0..nvec {
        let mask = masked(st, v);
        let n = w.splat(0.0);
        // SAFETY: `visible` returns 16 floats, at least `WIDTH`.
        let n = if mask { unsafe { w.load(visible(st, v).as_ptr()) } } else { n };
        let lane = v * W::WIDTH;
        // SAFETY: `lane + WIDTH <= rpad` and `j < nk <= KEY_TILE` rows of the state (see above).
        unsafe {
            let m_old = w.load(st.m.as_ptr().add(lane));
            let mut mx = m_old;
            for j in 0..nk {
                let s = w.load(st.st.as_ptr().add(j * rpad + lane));
                let s =
                    if mask { w.select_lt(w.splat(j as f32), n, s, w.splat(f32::NEG_INFINITY)) } else { s };
                mx = w.max(mx, s);
            }
            let alpha = w.exp(w.sub(m_old, mx));
            let mut sum = w.mul(w.load(st.l.as_ptr().add(lane)), alpha);
            for j in 0..nk {
                let at = st.st.as_mut_ptr().add(j * rpad + lane);
                let p = w.exp(w.sub(w.load(at), mx));
                let p = if mask { w.select_lt(w.splat(j as f32), n, p, w.zero()) } else { p };
                w.store(at, p);
                sum = w.add(sum, p);
            }
            w.store(st.m.as_mut_ptr().add(lane), mx);
            w.store(st.l.as_mut_ptr().add(lane), sum);
            w.store(st.alpha.as_mut_ptr().add(lane), alpha);
        }
    }
    let (acc, alpha, pt) = (st.acc.as_mut_ptr(), st.alpha.as_ptr(), st.st.as_ptr());
    let mut v = v0;
    while v < nvec {
        let lane = v * W::WIDTH;
        // SAFETY: lane offsets within `rpad`, dims < `hd`, `nk` rows (see above).
        unsafe {
            if v + 2 <= nvec {
                let n = (masked(st, v) || masked(st, v + 1))
                    .then(|| [w.load(visible(st, v).as_ptr()), w.load(visible(st, v + 1).as_ptr())]);
                pv_rows::<W, 2>(w, acc.add(lane), rpad, alpha.add(lane), pt.add(lane), vals, hd, n);
            } else {
                let n = masked(st, v).then(|| [w.load(visible(st, v).as_ptr())]);
                pv_rows::<W, 1>(w, acc.add(lane), rpad, alpha.add(lane), pt.add(lane), vals, hd, n);
            }
        }
        v += 2;
    }
}

/// Runs one job; its output rows, `[rows.len() · group, head_dim]` in (query row,
/// group head) order, which is the row-major layout of the job's output span.
#[inline(always)]
pub(super) fn run<W: Wide>(w: W, call: &Call<'_>, seq: &AttnSeq<'_>, job: &Job) -> Vec<f32> {
    let AttnHeads { num_heads, kv_heads, head_dim: hd } = call.heads;
    let group = num_heads / kv_heads;
    let nrows = job.rows.len() * group;
    let rpad = nrows.next_multiple_of(W::WIDTH);
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
        tile_rows.load(w.narrow(), call, seq, job, j0..j0 + n);
        // Lane vectors all of whose rows are below the tile have finished.
        let v0 = j0.saturating_sub(first) * group / W::WIDTH;
        fold_tile(w, &mut st, v0, j0, &tile_rows.keys, &tile_rows.vals, hd);
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
