//! Varlen causal attention over paged K/V (the reference for the GPU kernel).
//!
//! Flash-style: K and V rows are read in place from the pages (a key tile is
//! [`KEY_TILE`] positions, each row found through the block table; nothing is
//! gathered), each tile's scores are folded into every query row's running
//! softmax (max `m`, sum `l`, weighted sum `acc`) and never held for more than
//! one tile. A job is one sequence, one KV head and a tile of query rows; its
//! lane rows are (query row, query head of the KV head's group) pairs, so each
//! K/V tile is read once for all query heads that share it. Jobs run on rayon,
//! sized so each reads its K/V once while the call still has ~2 jobs a thread.
//!
//! Two layouts, one arithmetic:
//! * [`run_job`]: lane rows in SIMD lanes (q and `acc` transposed, `[dim, lanes]`).
//!   A score is a broadcast key element times 8 rows' q, a weighted sum a
//!   broadcast value element times 8 rows' probabilities; max, `exp` and sums
//!   are lane-wise, with no horizontal reduction anywhere.
//! * [`run_job_rows`] (decode: at most [`ROW_PATH_MAX`] lane rows): keys in lanes
//!   for scores (the tile's K transposed once), dims in lanes for `acc`.
//!
//! # One row, one arithmetic
//!
//! Cached and uncached prefills, decode and every chunking must agree to the
//! last bit, so a query row's result depends only on its position `p`, its q row
//! and the K/V rows at positions `0..=p`. For a row, both layouts compute exactly:
//! * `q' = q · (1/√d)`; tiles `t = 0..=p / KEY_TILE` (absolute positions
//!   `t·KEY_TILE..`), the last one up to `p`;
//! * score `s_j = fma(k_j[d], q'[d], ·)` chained over `d = 0, 1, …` from 0;
//! * `m' = max(m, max_j s_j)`, `α = exp(m − m')`, `p_j = exp(s_j − m')`
//!   ([`super::fast_exp::exp`]'s operations, lane-wise);
//! * `l = l·α`, then `l += p_j` in key order; `acc[d] = acc[d]·α`, then
//!   `acc[d] = fma(v_j[d], p_j, acc[d])` in key order; at the end `acc · (1/l)`.
//!
//! Keys past a row's limit never touch its state (masked lanes keep their old
//! value), so neither the rows sharing a step or a job, nor `num_computed`, nor
//! the batch, nor the job size change any row's arithmetic.

use std::ops::Range;

use ndarray::Array2;
use rayon::prelude::*;

use super::check::{expect_cols, row_index};
use super::lanes::{self, LaneKernel, Lanes, Simd};
use super::pages::{CpuPages, KvRows};
use crate::backend::{AttnHeads, AttnSeq};
use crate::Result;
use crate::error::BackendError;

const OP: &str = "paged_attention";

/// Positions per key tile; tile boundaries are multiples of it.
const KEY_TILE: usize = 64;

/// Most lane rows (query rows × group heads) per job: bounds a job's state
/// (`qt`, `acc`, scores: 3 × 64 KiB at head_dim 64) to L2.
const MAX_JOB_LANES: usize = 256;

/// Query rows per job, a multiple of 8. Each job reads its sequence's K/V once,
/// so jobs are as large as they can be while the call still has about two per
/// thread. Any size gives every row the same arithmetic.
fn query_tile(seqs: &[AttnSeq<'_>], kv_heads: usize, group: usize) -> usize {
    let longest = seqs.iter().map(|s| s.num_new).max().unwrap_or(0);
    let want_jobs = 2 * rayon::current_num_threads().max(1);
    let per_pair = want_jobs.div_ceil((seqs.len() * kv_heads).max(1));
    let rows = longest.div_ceil(per_pair).next_multiple_of(8);
    let cap = (MAX_JOB_LANES / group).max(8) / 8 * 8;
    rows.clamp(8, cap)
}

/// Checks one sequence against the step and the pages.
fn check_seq(seq: &AttnSeq<'_>, rows: usize, pages: &CpuPages) -> Result<()> {
    let spec = pages.spec;
    let end = seq.query_start.checked_add(seq.num_new).filter(|&e| e <= rows);
    if end.is_none() {
        return Err(BackendError::OpIndex { op: OP, what: "query end", index: seq.query_start.saturating_add(seq.num_new) as i64, bound: rows + 1 }.into());
    }
    let len = seq.num_computed.saturating_add(seq.num_new);
    let blocks_needed = len.div_ceil(spec.block_size);
    if seq.block_table.len() < blocks_needed {
        return Err(BackendError::OpIndex { op: OP, what: "position (block table too short)", index: len as i64 - 1, bound: seq.block_table.len() * spec.block_size }.into());
    }
    for &b in &seq.block_table[..blocks_needed] {
        row_index(OP, "block", b as i64, spec.num_blocks)?;
    }
    Ok(())
}

/// What every job of one call shares.
struct Call<'a> {
    /// `q` flat, standard layout, `q_cols` floats a row.
    q: &'a [f32],
    q_cols: usize,
    /// Layer K and V pages, `[num_blocks, block_size, kv_heads, head_dim]` flat.
    k: KvRows<'a>,
    v: KvRows<'a>,
    heads: AttnHeads,
    block_size: usize,
}

/// One job: query rows `rows` (indices among the sequence's new tokens) of
/// sequence `seq`, for the query heads of KV head `kv_head`.
struct Job {
    seq: usize,
    kv_head: usize,
    rows: Range<usize>,
}

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

/// The K and V rows of one key tile: pointers into the pages when they hold f32,
/// else into this job's scratch, where each tile's rows are widened (exactly)
/// before the tile computes, so both page types run the same arithmetic.
struct TileRows {
    keys: Vec<*const f32>,
    vals: Vec<*const f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl TileRows {
    fn new(call: &Call<'_>) -> Self {
        let scratch = if matches!(call.k, KvRows::F32(_)) { 0 } else { KEY_TILE * call.heads.head_dim };
        TileRows { keys: Vec::with_capacity(KEY_TILE), vals: Vec::with_capacity(KEY_TILE), k: vec![0.0; scratch], v: vec![0.0; scratch] }
    }

    /// Points `keys` / `vals` at `positions` (at most [`KEY_TILE`]; `offset(j)` is
    /// position `j`'s element offset in the pages) and asks for the next tile's rows
    /// (below `end`), which then stream in while this tile computes.
    #[inline(always)]
    fn load<L: Lanes>(&mut self, l: L, call: &Call<'_>, positions: Range<usize>, end: usize, offset: impl Fn(usize) -> usize) {
        let hd = call.heads.head_dim;
        self.keys.clear();
        self.vals.clear();
        if let (KvRows::F32(k), KvRows::F32(v)) = (call.k, call.v) {
            for j in positions.clone() {
                let off = offset(j);
                self.keys.push(k[off..off + hd].as_ptr());
                self.vals.push(v[off..off + hd].as_ptr());
            }
        } else {
            for (i, j) in positions.clone().enumerate() {
                call.k.widen_into(l, offset(j), &mut self.k[i * hd..(i + 1) * hd]);
                call.v.widen_into(l, offset(j), &mut self.v[i * hd..(i + 1) * hd]);
            }
            self.keys.extend((0..positions.len()).map(|i| self.k[i * hd..].as_ptr()));
            self.vals.extend((0..positions.len()).map(|i| self.v[i * hd..].as_ptr()));
        }
        for j in positions.start + KEY_TILE..(positions.start + 2 * KEY_TILE).min(end) {
            call.k.prefetch(l, offset(j), hd);
            call.v.prefetch(l, offset(j), hd);
        }
    }
}

/// Runs one job; its output rows, `[rows.len() · group, head_dim]` in (query row,
/// group head) order, which is the row-major layout of the job's output span.
#[inline(always)]
fn run_job<L: Lanes>(l: L, call: &Call<'_>, seq: &AttnSeq<'_>, job: &Job) -> Vec<f32> {
    let AttnHeads { num_heads, kv_heads, head_dim: hd } = call.heads;
    let group = num_heads / kv_heads;
    let width = kv_heads * hd;
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
    for (ri, i) in job.rows.clone().enumerate() {
        let q_row = &call.q[(seq.query_start + i) * call.q_cols..][..call.q_cols];
        for g in 0..group {
            let h = job.kv_head * group + g;
            let r = ri * group + g;
            for (d, x) in q_row[h * hd..(h + 1) * hd].iter().enumerate() {
                st.qt[d * stride + r] = x * scale;
            }
            st.limit.push(seq.num_computed + i + 1);
        }
    }
    let last = *st.limit.last().expect("a job has rows");
    st.limit.resize(rpad, last);
    let mut tile_rows = TileRows::new(call);
    let bs = call.block_size;
    let end = seq.num_computed + job.rows.end;
    let first = seq.num_computed + job.rows.start;
    let row_offset = |j: usize| (seq.block_table[j / bs] as usize * bs + j % bs) * width + job.kv_head * hd;
    for j0 in (0..end).step_by(KEY_TILE) {
        let n = (end - j0).min(KEY_TILE);
        tile_rows.load(l, call, j0..j0 + n, end, row_offset);
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

/// Most lane rows a job takes through [`run_job_rows`] (decode: one query row
/// × a small group); more go through the lane-per-row path of [`run_job`].
const ROW_PATH_MAX: usize = 4;

/// `acc_r = acc_r · α_r` (when `alpha` is given), then `acc_r = v_j · p_r[j] + acc_r`
/// (fused) for `j` in `keys`, in order, on `DV` 8-lane vectors of dims from `dv0·8`:
/// per element the same operations as [`pv_block`].
///
/// # Safety
/// `acc[r]` read/writable for `(dv0 + DV) · 8` floats, `p[r]` readable at every
/// index of `keys`, `vals[j]` readable for `(dv0 + DV) · 8` floats.
#[inline(always)]
unsafe fn weigh<L: Lanes, const R: usize, const DV: usize>(
    l: L,
    acc: [*mut f32; R],
    p: [*const f32; R],
    alpha: Option<[f32; R]>,
    vals: &[*const f32],
    keys: Range<usize>,
    dv0: usize,
) {
    let mut a = [[l.zero(); DV]; R];
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
unsafe fn weigh_all<L: Lanes, const R: usize, const DV: usize>(l: L, acc: [*mut f32; R], p: [*const f32; R], alpha: Option<[f32; R]>, vals: &[*const f32], keys: Range<usize>, hd: usize) {
    let nv = hd / 8;
    let mut dv0 = 0;
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

/// [`run_job`] for a few lane rows (`<= ROW_PATH_MAX`) and `head_dim % 8 == 0`,
/// keys in lanes instead of rows: each tile's K rows are transposed once into
/// `[head_dim, KEY_TILE]`, a row's scores are 8 keys per multiply-add, its
/// weighted sum 8 dims per multiply-add. Per element these are exactly the
/// operations of the lane-per-row path: the same multiply-add chain over `d`
/// for a score, the same `max`, `exp`, sums in key order and `acc` chain.
#[inline(always)]
fn run_job_rows<L: Lanes>(l: L, call: &Call<'_>, seq: &AttnSeq<'_>, job: &Job) -> Vec<f32> {
    let AttnHeads { num_heads, kv_heads, head_dim: hd } = call.heads;
    let group = num_heads / kv_heads;
    let width = kv_heads * hd;
    let nrows = job.rows.len() * group;
    debug_assert!(nrows <= ROW_PATH_MAX && hd.is_multiple_of(8));
    let scale = 1.0 / (hd as f32).sqrt();
    let mut q = vec![0.0f32; nrows * hd];
    let mut limit = Vec::with_capacity(nrows);
    for (ri, i) in job.rows.clone().enumerate() {
        let q_row = &call.q[(seq.query_start + i) * call.q_cols..][..call.q_cols];
        for g in 0..group {
            let h = job.kv_head * group + g;
            for (d, x) in q[(ri * group + g) * hd..][..hd].iter_mut().zip(&q_row[h * hd..(h + 1) * hd]) {
                *d = x * scale;
            }
            limit.push(seq.num_computed + i + 1);
        }
    }
    let mut m = vec![f32::NEG_INFINITY; nrows];
    let mut lsum = vec![0.0f32; nrows];
    let mut alpha = vec![0.0f32; nrows];
    let mut acc = vec![0.0f32; nrows * hd];
    let mut p = vec![0.0f32; nrows * KEY_TILE];
    let mut kt = vec![0.0f32; hd * KEY_TILE];
    let mut tile_rows = TileRows::new(call);
    let bs = call.block_size;
    let end = seq.num_computed + job.rows.end;
    let row_offset = |j: usize| (seq.block_table[j / bs] as usize * bs + j % bs) * width + job.kv_head * hd;
    for j0 in (0..end).step_by(KEY_TILE) {
        let nk = (end - j0).min(KEY_TILE);
        tile_rows.load(l, call, j0..j0 + nk, end, row_offset);
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
            let width = if r + 4 <= nrows { 4 } else if r + 2 <= nrows { 2 } else { 1 };
            let common = limit[r].saturating_sub(j0).min(KEY_TILE);
            let a = |i: usize| unsafe { ap.add((r + i) * hd) };
            let pr = |i: usize| unsafe { pp.add((r + i) * KEY_TILE) };
            let al = |i: usize| alpha[r + i];
            // SAFETY: acc rows hold hd floats, p rows KEY_TILE, vals[..n] hold hd floats.
            unsafe {
                match width {
                    4 => weigh_all::<L, 4, 2>(l, [a(0), a(1), a(2), a(3)], [pr(0), pr(1), pr(2), pr(3)], Some([al(0), al(1), al(2), al(3)]), &vals, 0..common, hd),
                    2 => weigh_all::<L, 2, 4>(l, [a(0), a(1)], [pr(0), pr(1)], Some([al(0), al(1)]), &vals, 0..common, hd),
                    _ => weigh_all::<L, 1, 8>(l, [a(0)], [pr(0)], Some([al(0)]), &vals, 0..common, hd),
                }
                for i in 0..width {
                    let n = limit[r + i].saturating_sub(j0).min(KEY_TILE);
                    if n > common {
                        weigh_all::<L, 1, 8>(l, [a(i)], [pr(i)], None, &vals, common..n, hd);
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

/// One job of one call, run by the build [`Simd::run`] picks.
struct JobTask<'a> {
    call: &'a Call<'a>,
    seq: &'a AttnSeq<'a>,
    job: &'a Job,
}

impl LaneKernel for JobTask<'_> {
    type Out = Vec<f32>;
    /// The row path for a few lane rows, the lane-per-row path otherwise (which
    /// one never changes a row's result).
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) -> Vec<f32> {
        let JobTask { call, seq, job } = self;
        let group = call.heads.num_heads / call.heads.kv_heads;
        if job.rows.len() * group <= ROW_PATH_MAX && call.heads.head_dim.is_multiple_of(8) {
            run_job_rows(l, call, seq, job)
        } else {
            run_job(l, call, seq, job)
        }
    }
}

/// See [`crate::backend::Backend::paged_attention`].
pub(crate) fn paged_attention(q: &Array2<f32>, pages: &CpuPages, layer: usize, heads: AttnHeads, seqs: &[AttnSeq<'_>]) -> Result<Array2<f32>> {
    attention_with(Simd::detect(), q, pages, layer, heads, seqs)
}

fn attention_with(simd: Simd, q: &Array2<f32>, pages: &CpuPages, layer: usize, heads: AttnHeads, seqs: &[AttnSeq<'_>]) -> Result<Array2<f32>> {
    let spec = pages.spec;
    if heads.kv_heads != spec.kv_heads || heads.head_dim != spec.head_dim || heads.kv_heads == 0 || !heads.num_heads.is_multiple_of(heads.kv_heads) {
        return Err(BackendError::OpShape {
            op: OP,
            what: "heads (num_heads, kv_heads, head_dim)",
            expected: format!("kv_heads {} dividing num_heads, head_dim {}", spec.kv_heads, spec.head_dim),
            found: vec![heads.num_heads, heads.kv_heads, heads.head_dim],
        }.into());
    }
    expect_cols(OP, "q", q, heads.num_heads * heads.head_dim)?;
    let (k, v) = pages.kv(OP, layer)?;
    for s in seqs {
        check_seq(s, q.nrows(), pages)?;
    }
    let mut out = Array2::zeros(q.raw_dim());
    let hd = heads.head_dim;
    if hd == 0 || heads.num_heads == 0 {
        return Ok(out);
    }
    let q_std = q.as_standard_layout();
    let call = Call { q: q_std.as_slice().expect("standard layout"), q_cols: q.ncols(), k, v, heads, block_size: spec.block_size };
    let group = heads.num_heads / heads.kv_heads;
    let tile = query_tile(seqs, heads.kv_heads, group);
    let jobs: Vec<Job> = seqs
        .iter()
        .enumerate()
        .flat_map(|(s, seq)| {
            (0..heads.kv_heads).flat_map(move |kv_head| {
                (0..seq.num_new).step_by(tile).map(move |a| Job { seq: s, kv_head, rows: a..(a + tile).min(seq.num_new) })
            })
        })
        .collect();
    let results: Vec<Vec<f32>> = jobs.par_iter().map(|job| simd.run(JobTask { call: &call, seq: &seqs[job.seq], job })).collect();
    let span = group * hd;
    for (job, res) in jobs.iter().zip(&results) {
        let seq = &seqs[job.seq];
        for (i, src) in job.rows.clone().zip(res.chunks_exact(span)) {
            let mut dst = out.row_mut(seq.query_start + i);
            let dst = dst.as_slice_mut().expect("a fresh array is standard layout");
            dst[job.kv_head * span..(job.kv_head + 1) * span].copy_from_slice(src);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::backend::{Dtype, PagesSpec};
    use crate::backend::test_support::rand_rows_from;
    use rand::SeedableRng;
    use rand::seq::SliceRandom;
    use rand_chacha::ChaCha8Rng;

    /// Dense causal attention of one sequence (f64): q `[new, H*d]`, k/v `[len, KH*d]`.
    fn dense(q: &Array2<f32>, k: &Array2<f32>, v: &Array2<f32>, computed: usize, heads: AttnHeads) -> Array2<f64> {
        let d = heads.head_dim;
        let group = heads.num_heads / heads.kv_heads;
        let mut out = Array2::zeros((q.nrows(), q.ncols()));
        for i in 0..q.nrows() {
            for h in 0..heads.num_heads {
                let kh = h / group;
                let scores: Vec<f64> = (0..=computed + i)
                    .map(|j| (0..d).map(|c| q[[i, h * d + c]] as f64 * k[[j, kh * d + c]] as f64).sum::<f64>() / (d as f64).sqrt())
                    .collect();
                let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for (j, s) in scores.iter().enumerate() {
                    for c in 0..d {
                        out[[i, h * d + c]] += (s - max).exp() / z * v[[j, kh * d + c]] as f64;
                    }
                }
            }
        }
        out
    }

    /// Pages with one sequence per entry of `lens` in shuffled blocks; their
    /// tables and K/V (`[len, KH*d]`, position order) as stored: rounded to `spec.kv_dtype`.
    fn fill(rng: &mut ChaCha8Rng, spec: PagesSpec, lens: &[usize]) -> (CpuPages, Vec<Vec<u32>>, Vec<(Array2<f32>, Array2<f32>)>) {
        let mut pages = CpuPages::new(spec);
        let mut blocks: Vec<u32> = (0..spec.num_blocks as u32).collect();
        blocks.shuffle(rng);
        let mut next = 0;
        let (mut tables, mut kvs) = (Vec::new(), Vec::new());
        for &len in lens {
            let nb = len.div_ceil(spec.block_size);
            let table = blocks[next..next + nb].to_vec();
            next += nb;
            let k = rand_rows_from(rng, len, spec.kv_width());
            let v = rand_rows_from(rng, len, spec.kv_width());
            let slots: Vec<i64> = (0..len).map(|j| (table[j / spec.block_size] as usize * spec.block_size + j % spec.block_size) as i64).collect();
            pages.write_kv(1, &k, &v, &slots).unwrap();
            tables.push(table);
            let stored = |x: f32| match spec.kv_dtype {
                Dtype::F32 => x,
                Dtype::Bf16 => half::bf16::from_f32(x).to_f32(),
                Dtype::F16 => half::f16::from_f32(x).to_f32(),
            };
            kvs.push((k.mapv(stored), v.mapv(stored)));
        }
        (pages, tables, kvs)
    }

    #[test]
    fn matches_dense_causal_reference_over_random_block_tables() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        // head_dim 8 and 12 (zero-padded path) on tiny shapes; 64 and 128 across key tiles.
        let cases: &[(usize, usize, &[(usize, usize)])] = &[
            (8, 4, &[(0, 7), (5, 6), (8, 1), (13, 9)]),
            (12, 4, &[(0, 7), (5, 6), (8, 1), (13, 9)]),
            (64, 16, &[(0, 70), (100, 29), (191, 1), (64, 64)]),
            (128, 5, &[(0, 33), (61, 70), (130, 1)]),
        ];
        // f16 and bf16 pages are read back widened: the same math over the rounded K/V.
        for (&(d, block_size, shapes), kv_dtype) in cases.iter().flat_map(|c| [Dtype::F32, Dtype::F16, Dtype::Bf16].map(|t| (c, t))) {
            for (num_heads, kv_heads) in [(4, 4), (4, 2), (4, 1)] {
                let heads = AttnHeads { num_heads, kv_heads, head_dim: d };
                let lens: Vec<usize> = shapes.iter().map(|&(c, n)| c + n).collect();
                let num_blocks = lens.iter().map(|l| l.div_ceil(block_size)).sum::<usize>() + 3;
                let spec = PagesSpec { num_layers: 2, num_blocks, block_size, kv_heads, head_dim: d, captured: 0, hidden: 1, kv_dtype };
                let (pages, tables, kvs) = fill(&mut rng, spec, &lens);
                let mut q_all = Vec::new();
                let mut expected = Vec::new();
                for (&(computed, new), (k, v)) in shapes.iter().zip(&kvs) {
                    let q = rand_rows_from(&mut rng, new, num_heads * d);
                    expected.push(dense(&q, k, v, computed, heads));
                    q_all.push(q);
                }
                let views: Vec<_> = q_all.iter().map(|q| q.view()).collect();
                let q = ndarray::concatenate(ndarray::Axis(0), &views).unwrap();
                let mut start = 0;
                let seqs: Vec<AttnSeq<'_>> = shapes
                    .iter()
                    .zip(&tables)
                    .map(|(&(computed, new), table)| {
                        let s = AttnSeq { query_start: start, num_new: new, num_computed: computed, block_table: table };
                        start += new;
                        s
                    })
                    .collect();
                for simd in Simd::all() {
                    let got = attention_with(simd, &q, &pages, 1, heads, &seqs).unwrap();
                    for (s, want) in seqs.iter().zip(&expected) {
                        for ((i, c), w) in want.indexed_iter() {
                            let g = got[[s.query_start + i, c]] as f64;
                            assert!((g - w).abs() < 1e-5, "{simd:?} {kv_dtype} d {d} heads {num_heads}/{kv_heads} row {i} col {c}: {g} vs {w}");
                        }
                    }
                }
            }
        }
    }

    /// Rows of `attention_with` for sequence `table` (`len` positions, q rows `q`)
    /// computed as the steps `cuts` (consecutive ranges of positions), each step in
    /// a batch with `other` (a sequence of its own placed before it).
    fn stepped(simd: Simd, pages: &CpuPages, heads: AttnHeads, q: &Array2<f32>, table: &[u32], cuts: &[Range<usize>], other: Option<(&Array2<f32>, &[u32], usize)>) -> Array2<f32> {
        let mut out = Array2::zeros(q.raw_dim());
        for cut in cuts {
            let mine = q.slice(ndarray::s![cut.clone(), ..]);
            let mut seqs = Vec::new();
            let batch_q = match other {
                Some((oq, otable, ocomputed)) => {
                    seqs.push(AttnSeq { query_start: 0, num_new: oq.nrows(), num_computed: ocomputed, block_table: otable });
                    ndarray::concatenate(ndarray::Axis(0), &[oq.view(), mine]).unwrap()
                }
                None => mine.to_owned(),
            };
            let start = batch_q.nrows() - cut.len();
            seqs.push(AttnSeq { query_start: start, num_new: cut.len(), num_computed: cut.start, block_table: table });
            let got = attention_with(simd, &batch_q, pages, 1, heads, &seqs).unwrap();
            out.slice_mut(ndarray::s![cut.clone(), ..]).assign(&got.slice(ndarray::s![start.., ..]));
        }
        out
    }

    fn assert_same_bits(a: &Array2<f32>, b: &Array2<f32>, what: &str) {
        for ((i, c), x) in a.indexed_iter() {
            assert_eq!(x.to_bits(), b[[i, c]].to_bits(), "{what}: row {i} col {c}: {x} vs {}", b[[i, c]]);
        }
    }

    #[test]
    fn a_row_is_the_same_to_the_bit_in_any_step_chunking_or_batch() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        // K/V page types in turn over the cases (f16 and bf16 pages go through the widening path).
        let mut kv_dtypes = [Dtype::F32, Dtype::F16, Dtype::Bf16].into_iter().cycle();
        for d in [64, 128] {
            for (num_heads, kv_heads) in [(4, 4), (4, 2), (8, 2)] {
                for block_size in [16, 5] {
                    let kv_dtype = kv_dtypes.next().unwrap_or(Dtype::F32);
                    let heads = AttnHeads { num_heads, kv_heads, head_dim: d };
                    let len: usize = 203;
                    let other_len: usize = 150;
                    let num_blocks = len.div_ceil(block_size) + other_len.div_ceil(block_size) + 4;
                    let spec = PagesSpec { num_layers: 2, num_blocks, block_size, kv_heads, head_dim: d, captured: 0, hidden: 1, kv_dtype };
                    let (pages, tables, _) = fill(&mut rng, spec, &[len, other_len]);
                    let q = rand_rows_from(&mut rng, len, num_heads * d);
                    let other_q = rand_rows_from(&mut rng, 40, num_heads * d);
                    let other = Some((&other_q, &tables[1][..], other_len - 40));
                    for simd in Simd::all() {
                        let whole = stepped(simd, &pages, heads, &q, &tables[0], &[0..len], None);
                        // Cuts on and off key tiles (64) and blocks; a one-row step; a decode tail.
                        let chunks = [0..1, 1..64, 64..65, 65..130, 130..131, 131..200, 200..201, 201..202, 202..203];
                        let chunked = stepped(simd, &pages, heads, &q, &tables[0], &chunks, None);
                        assert_same_bits(&whole, &chunked, &format!("{simd:?} {kv_dtype} d {d} {num_heads}/{kv_heads} bs {block_size}: chunked"));
                        let batched = stepped(simd, &pages, heads, &q, &tables[0], &[0..77, 77..203], other);
                        assert_same_bits(&whole, &batched, &format!("{simd:?} d {d} {num_heads}/{kv_heads} bs {block_size}: batched"));
                        let singles: Vec<Range<usize>> = (0..len).map(|p| p..p + 1).collect();
                        let one_by_one = stepped(simd, &pages, heads, &q, &tables[0], &singles, other);
                        assert_same_bits(&whole, &one_by_one, &format!("{simd:?} d {d} {num_heads}/{kv_heads} bs {block_size}: one row per step"));
                    }
                }
            }
        }
    }

    #[test]
    fn decode_batches_equal_single_sequence_calls() {
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        let heads = AttnHeads { num_heads: 8, kv_heads: 2, head_dim: 64 };
        let lens = [1, 63, 64, 65, 130, 300];
        let num_blocks = lens.iter().map(|l: &usize| l.div_ceil(16)).sum::<usize>();
        let spec = PagesSpec { num_layers: 2, num_blocks, block_size: 16, kv_heads: 2, head_dim: 64, captured: 0, hidden: 1, kv_dtype: Dtype::F32 };
        let (pages, tables, _) = fill(&mut rng, spec, &lens);
        let q = rand_rows_from(&mut rng, lens.len(), 8 * 64);
        let seqs: Vec<AttnSeq<'_>> = lens.iter().zip(&tables).enumerate().map(|(i, (&l, t))| AttnSeq { query_start: i, num_new: 1, num_computed: l - 1, block_table: t }).collect();
        for simd in Simd::all() {
            let all = attention_with(simd, &q, &pages, 1, heads, &seqs).unwrap();
            for (i, s) in seqs.iter().enumerate() {
                let one = attention_with(simd, &q.slice(ndarray::s![i..i + 1, ..]).to_owned(), &pages, 1, heads, &[AttnSeq { query_start: 0, ..*s }]).unwrap();
                assert_same_bits(&all.slice(ndarray::s![i..i + 1, ..]).to_owned(), &one, &format!("{simd:?} seq {i}"));
            }
        }
    }

    #[test]
    fn rejects_a_short_block_table_and_a_bad_block() {
        let spec = PagesSpec { num_layers: 1, num_blocks: 2, block_size: 4, kv_heads: 1, head_dim: 2, captured: 0, hidden: 1, kv_dtype: Dtype::F32 };
        let pages = CpuPages::new(spec);
        let heads = AttnHeads { num_heads: 1, kv_heads: 1, head_dim: 2 };
        let q = Array2::zeros((3, 2));
        let short = [AttnSeq { query_start: 0, num_new: 3, num_computed: 4, block_table: &[0] }];
        assert!(matches!(paged_attention(&q, &pages, 0, heads, &short), Err(Error::Backend(BackendError::OpIndex { op: OP, .. }))));
        let bad = [AttnSeq { query_start: 0, num_new: 3, num_computed: 0, block_table: &[7] }];
        assert!(matches!(paged_attention(&q, &pages, 0, heads, &bad), Err(Error::Backend(BackendError::OpIndex { what: "block", index: 7, .. }))));
        assert!(matches!(paged_attention(&q, &pages, 1, heads, &[]), Err(Error::Backend(BackendError::OpIndex { what: "layer", .. }))));
    }
}
