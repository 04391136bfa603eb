//! Varlen causal attention over paged K/V (the reference for the GPU kernel).
//!
//! Flash-style: K and V rows are read in place from the pages (a key tile is
//! [`KEY_TILE`] positions, found through the block table), scores of a tile are
//! folded into each query row's running softmax (max `m`, sum `l`, weighted sum
//! `acc`) and never held for the whole prefix. A job is one sequence, one KV
//! head and a tile of query rows; its lane rows are (query row, query head of
//! the KV head's group) pairs, so each K/V tile is loaded once for every query
//! head that shares it. Jobs run in parallel on rayon.
//!
//! # One row, one arithmetic
//!
//! Cached and uncached prefills, decode and every chunking must agree to the
//! last bit, so a query row's result depends only on its position `p`, its q row
//! and the K/V rows at positions `0..=p`:
//! * key tiles are fixed by absolute position (tile `t` is positions
//!   `t·KEY_TILE .. (t+1)·KEY_TILE`); a row at `p` sees tiles `0..=p / KEY_TILE`,
//!   the last one up to `p` only;
//! * a score is an 8-lane chain of fused multiply-adds over `head_dim` (lane `l`
//!   takes dims `≡ l mod 8`) then the fixed tree [`lanes::tree_sum`];
//! * a tile's softmax update is lane-wise over the tile's positions (lane = position
//!   mod 8, summed in the same tree), and `acc` gets `acc · α` then one
//!   multiply-add per visible key, in position order;
//! * the kernels that process 1, 2 or 4 rows at once (or 4 or 8 keys) run these
//!   same per-element chains; keys past a row's limit never touch its state.
//!
//! So neither the rows sharing a step or a job, nor `num_computed`, nor the batch
//! change any row's arithmetic.

use std::ops::Range;

use ndarray::Array2;
use rayon::prelude::*;

use super::check::{expect_cols, row_index};
use super::fast_exp::exp;
use super::lanes::{self, Lanes, Portable};
use super::pages::CpuPages;
use crate::backend::{AttnHeads, AttnSeq};
use crate::Result;
use crate::error::BackendError;

const OP: &str = "paged_attention";

/// Positions per key tile; tile boundaries are multiples of it (a multiple of 8).
const KEY_TILE: usize = 64;
/// Lane rows (query rows × group heads) per job, about: bounds a job's state and
/// score buffers to a few tens of KiB.
const JOB_ROWS: usize = 32;

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
    k: &'a [f32],
    v: &'a [f32],
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

/// A job's running state: per lane row its q (scaled), limit, `m`, `l`, `acc`,
/// and the tile's scores / probabilities.
struct State {
    /// Floats per q / acc row: `head_dim` rounded up to a multiple of 8 (zero padded).
    dp: usize,
    q: Vec<f32>,
    /// Exclusive key limit of each lane row: its position + 1.
    limit: Vec<usize>,
    m: Vec<f32>,
    l: Vec<f32>,
    alpha: Vec<f32>,
    acc: Vec<f32>,
    /// `[rows, KEY_TILE]` scores, then probabilities, of the current tile.
    s: Vec<f32>,
}

/// Visible keys of the tile starting at `j0` for a row with limit `limit` (> j0).
#[inline(always)]
fn visible(limit: usize, j0: usize) -> usize {
    (limit - j0).min(KEY_TILE)
}

/// Scores of `R` lane rows against keys `0..n` of the tile (in groups of `NK`,
/// `R · NK = 8`): `s[r][j] = q_r · k_j`. Keys past `n` in the last group repeat
/// key `n - 1` and their scores land in the row's tile padding (masked later).
///
/// # Safety
/// `q[r]` readable for `dp` floats, `s[r]` writable for `KEY_TILE`, `keys[..n]`
/// readable for `dp` floats each; `n >= 1`, `dp % 8 == 0`, `KEY_TILE % NK == 0`.
#[inline(always)]
unsafe fn scores<L: Lanes, const R: usize, const NK: usize>(l: L, q: [*const f32; R], s: [*mut f32; R], keys: &[*const f32], n: usize, dp: usize) {
    debug_assert!(R * NK == 8 && n >= 1 && n <= keys.len());
    let mut j = 0;
    while j < n {
        let k: [*const f32; NK] = std::array::from_fn(|i| keys[(j + i).min(n - 1)]);
        let mut acc = [l.zero(); 8];
        let mut c = 0;
        while c < dp {
            // SAFETY: c + 8 <= dp, within every q and key row (the contract).
            let kv: [L::V; NK] = std::array::from_fn(|i| unsafe { l.load(k[i].add(c)) });
            for r in 0..R {
                let qv = unsafe { l.load(q[r].add(c)) };
                for i in 0..NK {
                    acc[r * NK + i] = l.mul_add(qv, kv[i], acc[r * NK + i]);
                }
            }
            c += 8;
        }
        let sums = l.to_array(l.reduce8(acc));
        for r in 0..R {
            for i in 0..NK {
                // SAFETY: j + i < j + NK <= KEY_TILE (j is a multiple of NK below n <= KEY_TILE).
                unsafe { *s[r].add(j + i) = sums[r * NK + i] };
            }
        }
        j += NK;
    }
}

/// `acc_r = acc_r · α_r` (when `alpha` is given), then `acc_r += p_r[j] · v_j` for
/// `j` in `keys`, in order, on `DV` 8-lane vectors of `acc` from vector `dv0`.
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
    for r in 0..R {
        for d in 0..DV {
            // SAFETY: within acc[r] (the contract).
            a[r][d] = unsafe { l.load(acc[r].add((dv0 + d) * 8)) };
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
        let vv: [L::V; DV] = std::array::from_fn(|d| unsafe { l.load(vj.add((dv0 + d) * 8)) });
        for r in 0..R {
            let pj = l.splat(unsafe { *p[r].add(j) });
            for d in 0..DV {
                a[r][d] = l.mul_add(pj, vv[d], a[r][d]);
            }
        }
    }
    for r in 0..R {
        for d in 0..DV {
            unsafe { l.store(acc[r].add((dv0 + d) * 8), a[r][d]) };
        }
    }
}

/// [`weigh`] over all `dp / 8` vectors of `acc`, `DV` at a time, then one at a time.
///
/// # Safety
/// As [`weigh`] with `dv0 + DV` replaced by `dp / 8`.
#[inline(always)]
unsafe fn weigh_all<L: Lanes, const R: usize, const DV: usize>(
    l: L,
    acc: [*mut f32; R],
    p: [*const f32; R],
    alpha: Option<[f32; R]>,
    vals: &[*const f32],
    keys: Range<usize>,
    dp: usize,
) {
    let nv = dp / 8;
    let mut dv0 = 0;
    while dv0 + DV <= nv {
        unsafe { weigh::<L, R, DV>(l, acc, p, alpha, vals, keys.clone(), dv0) };
        dv0 += DV;
    }
    while dv0 < nv {
        unsafe { weigh::<L, R, 1>(l, acc, p, alpha, vals, keys.clone(), dv0) };
        dv0 += 1;
    }
}

/// Folds the tile starting at `j0` into rows `r0..` of `st`: scores, softmax
/// update, weighted values. `keys` / `vals` point at the tile's rows that exist.
#[inline(always)]
fn fold_tile<L: Lanes>(l: L, st: &mut State, r0: usize, j0: usize, keys: &[*const f32], vals: &[*const f32]) {
    let rows = st.limit.len();
    let dp = st.dp;
    let qp = |st: &State, r: usize| st.q[r * dp..].as_ptr();
    // Scores: pairs of rows × 4 keys, a last odd row × 8 keys. Rows are in position
    // order, so a block's last row sees the most keys.
    let mut r = r0;
    while r < rows {
        let (s_ptr, n) = (st.s.as_mut_ptr(), visible(st.limit[(r + 1).min(rows - 1)], j0));
        debug_assert!(n <= keys.len());
        // SAFETY: q rows hold dp floats, s rows KEY_TILE, keys[..n] exist (n is at most
        // the keys of the job's last row) and hold dp floats.
        unsafe {
            if r + 1 < rows {
                scores::<L, 2, 4>(l, [qp(st, r), qp(st, r + 1)], [s_ptr.add(r * KEY_TILE), s_ptr.add((r + 1) * KEY_TILE)], keys, n, dp);
            } else {
                scores::<L, 1, 8>(l, [qp(st, r)], [s_ptr.add(r * KEY_TILE)], keys, n, dp);
            }
        }
        r += 2;
    }
    // Softmax update of each row over its visible keys; p replaces s.
    for r in r0..rows {
        let n = visible(st.limit[r], j0);
        let row = &mut st.s[r * KEY_TILE..(r + 1) * KEY_TILE];
        let mut mx = l.splat(f32::NEG_INFINITY);
        for (c, chunk) in row.chunks_exact(8).enumerate().take(n.div_ceil(8)) {
            // SAFETY: a chunk holds 8 floats.
            let x = l.keep_first(unsafe { l.load(chunk.as_ptr()) }, n - c * 8, f32::NEG_INFINITY);
            mx = l.max(mx, x);
        }
        let m_old = st.m[r];
        let m_new = lanes::tree_max(l.to_array(mx)).max(m_old);
        let alpha = exp(m_old - m_new);
        let m_vec = l.splat(m_new);
        let mut sum = l.zero();
        for (c, chunk) in row.chunks_exact_mut(8).enumerate().take(n.div_ceil(8)) {
            // SAFETY: a chunk holds 8 floats.
            let e = l.keep_first(l.exp(l.sub(unsafe { l.load(chunk.as_ptr()) }, m_vec)), n - c * 8, 0.0);
            unsafe { l.store(chunk.as_mut_ptr(), e) };
            sum = l.add(sum, e);
        }
        st.l[r] = st.l[r] * alpha + lanes::tree_sum(l.to_array(sum));
        st.m[r] = m_new;
        st.alpha[r] = alpha;
    }
    // acc = acc·α + Σ p·v: blocks of 4, 2, 1 rows over the keys all of them see,
    // then each row alone over the rest of its keys.
    let (acc, p) = (st.acc.as_mut_ptr(), st.s.as_ptr());
    let mut r = r0;
    while r < rows {
        let width = if r + 4 <= rows { 4 } else if r + 2 <= rows { 2 } else { 1 };
        let common = visible(st.limit[r], j0);
        let a = |i: usize| unsafe { acc.add((r + i) * dp) };
        let pp = |i: usize| unsafe { p.add((r + i) * KEY_TILE) };
        let al = |i: usize| st.alpha[r + i];
        // SAFETY: acc rows hold dp floats, p rows KEY_TILE, vals[..common] exist with dp floats.
        unsafe {
            match width {
                4 => weigh_all::<L, 4, 2>(l, [a(0), a(1), a(2), a(3)], [pp(0), pp(1), pp(2), pp(3)], Some([al(0), al(1), al(2), al(3)]), vals, 0..common, dp),
                2 => weigh_all::<L, 2, 4>(l, [a(0), a(1)], [pp(0), pp(1)], Some([al(0), al(1)]), vals, 0..common, dp),
                _ => weigh_all::<L, 1, 8>(l, [a(0)], [pp(0)], Some([al(0)]), vals, 0..common, dp),
            }
            for i in 0..width {
                let n = visible(st.limit[r + i], j0);
                if n > common {
                    weigh_all::<L, 1, 8>(l, [a(i)], [pp(i)], None, vals, common..n, dp);
                }
            }
        }
        r += width;
    }
}

/// Runs one job; its output rows, `[rows.len() · group, head_dim]` in (query row,
/// group head) order, which is the row-major layout of the job's output span.
#[inline(always)]
fn run_job<L: Lanes>(l: L, call: &Call<'_>, seq: &AttnSeq<'_>, job: &Job) -> Vec<f32> {
    let AttnHeads { num_heads, kv_heads, head_dim: hd } = call.heads;
    let group = num_heads / kv_heads;
    let width = kv_heads * hd;
    let dp = hd.next_multiple_of(8);
    let padded = dp != hd;
    let nrows = job.rows.len() * group;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut st = State {
        dp,
        q: vec![0.0; nrows * dp],
        limit: Vec::with_capacity(nrows),
        m: vec![f32::NEG_INFINITY; nrows],
        l: vec![0.0; nrows],
        alpha: vec![0.0; nrows],
        acc: vec![0.0; nrows * dp],
        s: vec![0.0; nrows * KEY_TILE],
    };
    for (ri, i) in job.rows.clone().enumerate() {
        let q_row = &call.q[(seq.query_start + i) * call.q_cols..][..call.q_cols];
        for g in 0..group {
            let h = job.kv_head * group + g;
            let dst = &mut st.q[(ri * group + g) * dp..][..hd];
            for (d, x) in dst.iter_mut().zip(&q_row[h * hd..(h + 1) * hd]) {
                *d = x * scale;
            }
            st.limit.push(seq.num_computed + i + 1);
        }
    }
    // Head dims that are not a multiple of 8 read K/V through a zero-padded copy of the tile.
    let mut stage = if padded { vec![0.0f32; 2 * KEY_TILE * dp] } else { Vec::new() };
    let mut keys: Vec<*const f32> = Vec::with_capacity(KEY_TILE);
    let mut vals: Vec<*const f32> = Vec::with_capacity(KEY_TILE);
    let bs = call.block_size;
    let end = seq.num_computed + job.rows.end;
    let first = seq.num_computed + job.rows.start;
    let row_offset = |j: usize| (seq.block_table[j / bs] as usize * bs + j % bs) * width + job.kv_head * hd;
    let tiles = end.div_ceil(KEY_TILE);
    for t in 0..tiles {
        let j0 = t * KEY_TILE;
        let n = (end - j0).min(KEY_TILE);
        keys.clear();
        vals.clear();
        for j in j0..j0 + n {
            let off = row_offset(j);
            let (kr, vr) = (&call.k[off..off + hd], &call.v[off..off + hd]);
            if padded {
                let jj = j - j0;
                stage[jj * dp..jj * dp + hd].copy_from_slice(kr);
                stage[(KEY_TILE + jj) * dp..(KEY_TILE + jj) * dp + hd].copy_from_slice(vr);
            } else {
                keys.push(kr.as_ptr());
                vals.push(vr.as_ptr());
            }
        }
        if padded {
            keys.extend((0..n).map(|jj| stage[jj * dp..].as_ptr()));
            vals.extend((0..n).map(|jj| stage[(KEY_TILE + jj) * dp..].as_ptr()));
        }
        // The next tile's rows start their way from memory while this one computes.
        if t + 1 < tiles {
            for j in j0 + KEY_TILE..(j0 + 2 * KEY_TILE).min(end) {
                let off = row_offset(j);
                for line in (0..hd).step_by(16) {
                    l.prefetch(call.k[off + line..].as_ptr());
                    l.prefetch(call.v[off + line..].as_ptr());
                }
            }
        }
        // Rows whose position is below the tile have finished.
        let r0 = j0.saturating_sub(first) * group;
        fold_tile(l, &mut st, r0, j0, &keys, &vals);
    }
    let mut out = vec![0.0f32; nrows * hd];
    for (r, o) in out.chunks_exact_mut(hd).enumerate() {
        let inv = 1.0 / st.l[r];
        for (d, a) in o.iter_mut().zip(&st.acc[r * dp..r * dp + hd]) {
            *d = a * inv;
        }
    }
    out
}

/// [`run_job`] compiled for AVX2 + FMA.
///
/// # Safety
/// The CPU must have AVX2 and FMA (an [`lanes::Avx2`] token proves it).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_job_avx2(l: lanes::Avx2, call: &Call<'_>, seq: &AttnSeq<'_>, job: &Job) -> Vec<f32> {
    run_job(l, call, seq, job)
}

/// Which kernel build a machine takes (always the same one on one machine).
#[derive(Debug, Clone, Copy)]
enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2(lanes::Avx2),
}

impl Kernel {
    fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        if let Some(l) = lanes::Avx2::new() {
            return Kernel::Avx2(l);
        }
        Kernel::Portable
    }

    fn run(self, call: &Call<'_>, seq: &AttnSeq<'_>, job: &Job) -> Vec<f32> {
        match self {
            Kernel::Portable => run_job(Portable, call, seq, job),
            // SAFETY: the token proves AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2(l) => unsafe { run_job_avx2(l, call, seq, job) },
        }
    }
}

/// See [`crate::backend::Backend::paged_attention`].
pub(crate) fn paged_attention(q: &Array2<f32>, pages: &CpuPages, layer: usize, heads: AttnHeads, seqs: &[AttnSeq<'_>]) -> Result<Array2<f32>> {
    attention_with(Kernel::best(), q, pages, layer, heads, seqs)
}

fn attention_with(kernel: Kernel, q: &Array2<f32>, pages: &CpuPages, layer: usize, heads: AttnHeads, seqs: &[AttnSeq<'_>]) -> Result<Array2<f32>> {
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
    let tile = (JOB_ROWS / group).max(1);
    let jobs: Vec<Job> = seqs
        .iter()
        .enumerate()
        .flat_map(|(s, seq)| {
            (0..heads.kv_heads).flat_map(move |kv_head| {
                (0..seq.num_new).step_by(tile).map(move |a| Job { seq: s, kv_head, rows: a..(a + tile).min(seq.num_new) })
            })
        })
        .collect();
    let results: Vec<Vec<f32>> = jobs.par_iter().map(|job| kernel.run(&call, &seqs[job.seq], job)).collect();
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
    use crate::backend::PagesSpec;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn rand_rows(rng: &mut ChaCha8Rng, r: usize, c: usize) -> Array2<f32> {
        Array2::from_shape_fn((r, c), |_| rng.random::<f32>() * 2.0 - 1.0)
    }

    /// Both kernel builds this machine can run.
    fn kernels() -> Vec<Kernel> {
        let mut all = vec![Kernel::Portable];
        if !matches!(Kernel::best(), Kernel::Portable) {
            all.push(Kernel::best());
        }
        all
    }

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
    /// tables and K/V (`[len, KH*d]`, position order).
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
            let k = rand_rows(rng, len, spec.kv_width());
            let v = rand_rows(rng, len, spec.kv_width());
            let slots: Vec<i64> = (0..len).map(|j| (table[j / spec.block_size] as usize * spec.block_size + j % spec.block_size) as i64).collect();
            pages.write_kv(1, &k, &v, &slots).unwrap();
            tables.push(table);
            kvs.push((k, v));
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
        for &(d, block_size, shapes) in cases {
            for (num_heads, kv_heads) in [(4, 4), (4, 2), (4, 1)] {
                let heads = AttnHeads { num_heads, kv_heads, head_dim: d };
                let lens: Vec<usize> = shapes.iter().map(|&(c, n)| c + n).collect();
                let num_blocks = lens.iter().map(|l| l.div_ceil(block_size)).sum::<usize>() + 3;
                let spec = PagesSpec { num_layers: 2, num_blocks, block_size, kv_heads, head_dim: d, captured: 0, hidden: 1 };
                let (pages, tables, kvs) = fill(&mut rng, spec, &lens);
                let mut q_all = Vec::new();
                let mut expected = Vec::new();
                for (&(computed, new), (k, v)) in shapes.iter().zip(&kvs) {
                    let q = rand_rows(&mut rng, new, num_heads * d);
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
                for kernel in kernels() {
                    let got = attention_with(kernel, &q, &pages, 1, heads, &seqs).unwrap();
                    for (s, want) in seqs.iter().zip(&expected) {
                        for ((i, c), w) in want.indexed_iter() {
                            let g = got[[s.query_start + i, c]] as f64;
                            assert!((g - w).abs() < 1e-5, "{kernel:?} d {d} heads {num_heads}/{kv_heads} row {i} col {c}: {g} vs {w}");
                        }
                    }
                }
            }
        }
    }

    /// Rows of `attention_with` for sequence `table` (`len` positions, q rows `q`)
    /// computed as the steps `cuts` (consecutive ranges of positions), each step in
    /// a batch with `other` (a sequence of its own placed before it).
    fn stepped(kernel: Kernel, pages: &CpuPages, heads: AttnHeads, q: &Array2<f32>, table: &[u32], cuts: &[Range<usize>], other: Option<(&Array2<f32>, &[u32], usize)>) -> Array2<f32> {
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
            let got = attention_with(kernel, &batch_q, pages, 1, heads, &seqs).unwrap();
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
        for d in [64, 128] {
            for (num_heads, kv_heads) in [(4, 4), (4, 2), (8, 2)] {
                for block_size in [16, 5] {
                    let heads = AttnHeads { num_heads, kv_heads, head_dim: d };
                    let len: usize = 203;
                    let other_len: usize = 150;
                    let num_blocks = len.div_ceil(block_size) + other_len.div_ceil(block_size) + 4;
                    let spec = PagesSpec { num_layers: 2, num_blocks, block_size, kv_heads, head_dim: d, captured: 0, hidden: 1 };
                    let (pages, tables, _) = fill(&mut rng, spec, &[len, other_len]);
                    let q = rand_rows(&mut rng, len, num_heads * d);
                    let other_q = rand_rows(&mut rng, 40, num_heads * d);
                    let other = Some((&other_q, &tables[1][..], other_len - 40));
                    for kernel in kernels() {
                        let whole = stepped(kernel, &pages, heads, &q, &tables[0], &[0..len], None);
                        // Cuts on and off key tiles (64) and blocks; a one-row step; a decode tail.
                        let chunks = [0..1, 1..64, 64..65, 65..130, 130..131, 131..200, 200..201, 201..202, 202..203];
                        let chunked = stepped(kernel, &pages, heads, &q, &tables[0], &chunks, None);
                        assert_same_bits(&whole, &chunked, &format!("{kernel:?} d {d} {num_heads}/{kv_heads} bs {block_size}: chunked"));
                        let batched = stepped(kernel, &pages, heads, &q, &tables[0], &[0..77, 77..203], other);
                        assert_same_bits(&whole, &batched, &format!("{kernel:?} d {d} {num_heads}/{kv_heads} bs {block_size}: batched"));
                        let singles: Vec<Range<usize>> = (0..len).map(|p| p..p + 1).collect();
                        let one_by_one = stepped(kernel, &pages, heads, &q, &tables[0], &singles, other);
                        assert_same_bits(&whole, &one_by_one, &format!("{kernel:?} d {d} {num_heads}/{kv_heads} bs {block_size}: one row per step"));
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
        let spec = PagesSpec { num_layers: 2, num_blocks, block_size: 16, kv_heads: 2, head_dim: 64, captured: 0, hidden: 1 };
        let (pages, tables, _) = fill(&mut rng, spec, &lens);
        let q = rand_rows(&mut rng, lens.len(), 8 * 64);
        let seqs: Vec<AttnSeq<'_>> = lens.iter().zip(&tables).enumerate().map(|(i, (&l, t))| AttnSeq { query_start: i, num_new: 1, num_computed: l - 1, block_table: t }).collect();
        for kernel in kernels() {
            let all = attention_with(kernel, &q, &pages, 1, heads, &seqs).unwrap();
            for (i, s) in seqs.iter().enumerate() {
                let one = attention_with(kernel, &q.slice(ndarray::s![i..i + 1, ..]).to_owned(), &pages, 1, heads, &[AttnSeq { query_start: 0, ..*s }]).unwrap();
                assert_same_bits(&all.slice(ndarray::s![i..i + 1, ..]).to_owned(), &one, &format!("{kernel:?} seq {i}"));
            }
        }
    }

    #[test]
    fn rejects_a_short_block_table_and_a_bad_block() {
        let spec = PagesSpec { num_layers: 1, num_blocks: 2, block_size: 4, kv_heads: 1, head_dim: 2, captured: 0, hidden: 1 };
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
