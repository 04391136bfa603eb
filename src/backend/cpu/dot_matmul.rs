//! `x @ w^T` as one dot product per output element, for weights stored in any
//! [`Element`] type (f32, bf16, f16) and accumulated in f32: the CPU's one dot
//! kernel ([`block`]).
//!
//! Every element goes through the same operations whatever rows and columns
//! share the call: 8 lanes of multiply-adds over `k` in steps of 8, the lanes
//! summed in a fixed tree, then the tail in order. So a row's result never
//! depends on its batch (cached and uncached prefills agree to the last bit),
//! and a decode step reads each weight once for all of its rows.
//!
//! A task owns a tile of the output: a block of `x` rows sized to stay in L2
//! and a range of weight rows. It takes the weight [`PANEL`] rows at a time
//! (widened to f32 into a buffer that stays in cache when they are half
//! precision, in place when they are f32) and multiplies every row of its block
//! by each panel, [`MR`] rows of `x` by [`NR`] weight rows per kernel call
//! (12 accumulators). The weight therefore crosses memory in its stored width,
//! once per row block: once per decode step.

use half::{bf16, f16};
use ndarray::{Array2, ArrayView2};
use rayon::prelude::*;

use super::lanes::{LaneKernel, Lanes, Simd};

/// Weight rows taken at a time.
const PANEL: usize = 12;
/// Rows of `x` per kernel call.
const MR: usize = 4;
/// Weight rows per kernel call (4 x 3 accumulators, 3 weight vectors and one `x`
/// vector fill the 16 AVX registers without spilling).
const NR: usize = 3;
/// Bytes of `x` rows one task multiplies per panel (fits L2 beside the panel).
const ROW_BLOCK_BYTES: usize = 160 << 10;
/// How many panels ahead the weight is prefetched: 3 gave 45-49 decode tokens/s on
/// the bf16 bench checkpoint against 39-41 without prefetching and 40-44 at 1 or 7.
const PREFETCH_AHEAD: usize = 3;
/// Tasks per thread: enough to balance uneven tiles.
const TASKS_PER_THREAD: usize = 4;

/// A stored weight element that widens exactly to f32.
pub(crate) trait Element: Copy + Send + Sync {
    /// `src` as f32: itself for f32, else widened into `buf` (grown as needed).
    fn as_f32<'a, L: Lanes>(l: L, src: &'a [Self], buf: &'a mut Vec<f32>) -> &'a [f32];
}

impl Element for f32 {
    #[inline(always)]
    fn as_f32<'a, L: Lanes>(_: L, src: &'a [f32], _: &'a mut Vec<f32>) -> &'a [f32] {
        src
    }
}

impl Element for bf16 {
    #[inline(always)]
    fn as_f32<'a, L: Lanes>(_: L, src: &'a [bf16], buf: &'a mut Vec<f32>) -> &'a [f32] {
        let dst = scratch(buf, src.len());
        super::lanes::widen_bf16(src, dst);
        dst
    }
}

impl Element for f16 {
    #[inline(always)]
    fn as_f32<'a, L: Lanes>(l: L, src: &'a [f16], buf: &'a mut Vec<f32>) -> &'a [f32] {
        let dst = scratch(buf, src.len());
        // 8 at a time with F16C where the lanes have it.
        l.widen_f16(src, dst);
        dst
    }
}

/// The first `len` floats of `buf`, grown (never shrunk or cleared) to hold them.
#[inline(always)]
fn scratch(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}

/// The output pointer tasks write disjoint tiles through.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: tasks write disjoint elements (distinct tiles), and the output outlives the parallel loop.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

/// `x @ w^T`: `x [m, k]` f32, `w [n, k]` of `T` → `[m, n]` f32.
pub(crate) fn matmul_t<T: Element>(x: ArrayView2<'_, f32>, w: ArrayView2<'_, T>) -> Array2<f32> {
    matmul_t_with(Simd::detect(), x, w)
}

/// [`matmul_t`] on the lanes of `simd`.
fn matmul_t_with<T: Element>(simd: Simd, x: ArrayView2<'_, f32>, w: ArrayView2<'_, T>) -> Array2<f32> {
    let (m, k, n) = (x.nrows(), x.ncols(), w.nrows());
    assert_eq!(w.ncols(), k, "dot matmul_t: x and w disagree on k");
    let mut out = Array2::<f32>::zeros((m, n));
    if m == 0 || n == 0 {
        return out;
    }
    let x = x.as_standard_layout();
    let w = w.as_standard_layout();
    let (Some(xs), Some(ws)) = (x.as_slice(), w.as_slice()) else { unreachable!("standard layout is contiguous") };
    let rows_per_block = (ROW_BLOCK_BYTES / (4 * k.max(1))).max(MR) / MR * MR;
    let row_blocks = m.div_ceil(rows_per_block);
    let threads = rayon::current_num_threads().max(1);
    let col_chunks = (threads * TASKS_PER_THREAD).div_ceil(row_blocks).max(1);
    let cols_per_chunk = n.div_ceil(col_chunks).next_multiple_of(PANEL);
    let tiles: Vec<(usize, usize)> =
        (0..row_blocks).flat_map(|r| (0..n.div_ceil(cols_per_chunk)).map(move |c| (r, c))).collect();
    let out_ptr = Out(out.as_mut_ptr());
    tiles.into_par_iter().for_each(|(rb, cc)| {
        let tile = Tile {
            rows: rb * rows_per_block..(m).min((rb + 1) * rows_per_block),
            cols: cc * cols_per_chunk..n.min((cc + 1) * cols_per_chunk),
            k,
            n,
        };
        simd.run(TileTask { xs, ws, tile, out: out_ptr });
    });
    out
}

/// One task's share of the output.
struct Tile {
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    k: usize,
    n: usize,
}

/// One tile of one [`matmul_t_with`] call. Only that function makes one: its
/// tiles lie inside `xs`, `ws` and `out` (`[m, k]`, `[n, k]`, `[m, n]`), and no
/// two tasks share a tile.
struct TileTask<'a, T> {
    xs: &'a [f32],
    ws: &'a [T],
    tile: Tile,
    out: Out,
}

impl<T: Element> LaneKernel for TileTask<'_, T> {
    type Out = ();
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) {
        // SAFETY: the tile lies inside `out`, `xs` and `ws` and no other task writes it
        // (`TileTask`'s contract).
        unsafe { run_tile(l, self.xs, self.ws, &self.tile, self.out) }
    }
}

/// Takes the tile's weight rows a panel at a time (widened when they are half
/// precision) and multiplies every row of the tile by each panel.
///
/// # Safety
/// `xs` holds `[m, k]` with `tile.rows` inside `m`; `ws` holds `[n, k]` with
/// `tile.cols` inside `n`; `out` points at `[m, n]` and no other task writes the tile.
#[inline(always)]
unsafe fn run_tile<L: Lanes, T: Element>(l: L, xs: &[f32], ws: &[T], tile: &Tile, out: Out) {
    let k = tile.k;
    let mut buf = Vec::new();
    for c0 in tile.cols.clone().step_by(PANEL) {
        let pc = PANEL.min(tile.cols.end - c0);
        let panel = T::as_f32(l, &ws[c0 * k..(c0 + pc) * k], &mut buf);
        // Ask for the weight bytes PREFETCH_AHEAD panels on now, so memory streams them in
        // while this panel computes (a decode step is bound by that stream; prefetches never fault).
        let ahead = c0 + pc + PREFETCH_AHEAD * PANEL;
        let next = &ws[(ahead * k).min(ws.len())..((ahead + PANEL) * k).min(ws.len())];
        let line_elems = 64 / std::mem::size_of::<T>();
        for i in (0..next.len()).step_by(line_elems) {
            l.prefetch(next[i..].as_ptr().cast());
        }
        if tile.rows.len() == 1 && pc == PANEL {
            // One row (a decode step): the whole panel at once, so PANEL independent
            // accumulator chains hide the multiply-add latency (the same operations per element).
            let r = tile.rows.start;
            // SAFETY: row r and every panel row hold k floats.
            let sums = unsafe { block::<L, 1, PANEL>(l, [xs[r * k..].as_ptr()], std::array::from_fn(|j| panel[j * k..].as_ptr()), k) };
            for (j, &v) in sums[0].iter().enumerate() {
                // SAFETY: (r, c0 + j) lies in the tile, inside `[m, n]`.
                unsafe { *out.0.add(r * tile.n + c0 + j) = v };
            }
            continue;
        }
        for r0 in tile.rows.clone().step_by(MR) {
            let rm = MR.min(tile.rows.end - r0);
            for j0 in (0..pc).step_by(NR) {
                let jn = NR.min(pc - j0);
                let x = |i: usize| xs[(r0 + i.min(rm - 1)) * k..].as_ptr();
                let w = |j: usize| panel[(j0 + j.min(jn - 1)) * k..].as_ptr();
                // SAFETY: each pointer starts a full row of k floats (rows past the end
                // repeat the last one and are computed but not stored).
                let sums: [[f32; NR]; MR] = unsafe { dots(l, std::array::from_fn(x), std::array::from_fn(w), k, rm, jn) };
                for (i, row) in sums.iter().enumerate().take(rm) {
                    for (j, &v) in row.iter().enumerate().take(jn) {
                        // SAFETY: (r0 + i, c0 + j0 + j) lies in the tile, inside `[m, n]`.
                        unsafe { *out.0.add((r0 + i) * tile.n + c0 + j0 + j) = v };
                    }
                }
            }
        }
    }
}

/// The dot products of `rm` rows by `jn` weight rows, through the kernel shaped
/// for them (a product's operations never depend on the shape).
///
/// # Safety
/// Every pointer starts `k` readable floats.
#[inline(always)]
unsafe fn dots<L: Lanes>(l: L, x: [*const f32; MR], w: [*const f32; NR], k: usize, rm: usize, jn: usize) -> [[f32; NR]; MR] {
    let mut out = [[0f32; NR]; MR];
    macro_rules! kernel {
        ($r:literal, $c:literal) => {{
            // SAFETY: forwarded from the caller.
            let s = unsafe { block::<L, $r, $c>(l, std::array::from_fn(|i| x[i]), std::array::from_fn(|j| w[j]), k) };
            for i in 0..$r {
                out[i][..$c].copy_from_slice(&s[i]);
            }
        }};
    }
    match (rm, jn) {
        (4, 3) => kernel!(4, 3),
        (4, 2) => kernel!(4, 2),
        (4, _) => kernel!(4, 1),
        (3, 3) => kernel!(3, 3),
        (3, 2) => kernel!(3, 2),
        (3, _) => kernel!(3, 1),
        (2, 3) => kernel!(2, 3),
        (2, 2) => kernel!(2, 2),
        (2, _) => kernel!(2, 1),
        (_, 3) => kernel!(1, 3),
        (_, 2) => kernel!(1, 2),
        _ => kernel!(1, 1),
    }
    out
}

/// `R x C` dot products of length `k`: lanes of multiply-adds over whole
/// groups of 8, the lanes summed in a fixed tree, then the tail in order.
///
/// # Safety
/// Every pointer starts `k` readable floats.
#[inline(always)]
unsafe fn block<L: Lanes, const R: usize, const C: usize>(l: L, x: [*const f32; R], w: [*const f32; C], k: usize) -> [[f32; C]; R] {
    let full = k / 8 * 8;
    let mut acc = [[l.zero(); C]; R];
    let mut c = 0;
    while c < full {
        // SAFETY: c + 8 <= k.
        let wv: [L::V; C] = std::array::from_fn(|j| unsafe { l.load(w[j].add(c)) });
        for (a, xp) in acc.iter_mut().zip(&x) {
            // SAFETY: c + 8 <= k.
            let xv = unsafe { l.load(xp.add(c)) };
            for (a, wv) in a.iter_mut().zip(&wv) {
                *a = l.mul_add(*wv, xv, *a);
            }
        }
        c += 8;
    }
    std::array::from_fn(|i| {
        std::array::from_fn(|j| {
            let a = l.to_array(acc[i][j]);
            let mut s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
            for t in full..k {
                // SAFETY: t < k.
                s = l.mul_add_one(unsafe { *w[j].add(t) }, unsafe { *x[i].add(t) }, s);
            }
            s
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::test_support::{pool, rand_rows};
    use ndarray::s;

    /// Each element type against an f64 oracle on the widened weights, on every
    /// build this CPU runs, and the invariant that keeps caching invisible: a row's
    /// result is the same to the last bit alone, in any batch, at any offset and
    /// with any thread count.
    fn check<T: Element + std::fmt::Debug>(narrow: fn(f32) -> T, widen: fn(T) -> f32) {
        const ALL: usize = 200;
        // k below, at and across lane groups, with tails; n below a panel, odd, and vocabulary-like.
        for (n, k) in [(1, 7), (5, 8), (37, 29), (64, 512), (130, 100), (1000, 64)] {
            let w = rand_rows(n as u64, n, k).mapv(narrow);
            let x = rand_rows(k as u64 + 9, ALL, k);
            for simd in Simd::all() {
                let product = |x: ArrayView2<'_, f32>| matmul_t_with(simd, x, w.view());
                let all = pool(2).install(|| product(x.view()));
                assert_eq!(all.dim(), (ALL, n));
                assert_eq!(pool(1).install(|| product(x.view())), all, "{simd:?} n {n} k {k}: 1 thread differs from 2");
                for r in [0, 101, ALL - 1] {
                    for c in [0, n / 2, n - 1] {
                        let want: f64 = (0..k).map(|i| f64::from(x[[r, i]]) * f64::from(widen(w[[c, i]]))).sum();
                        let tol = 1e-5 * (k as f64).sqrt().max(1.0);
                        assert!((f64::from(all[[r, c]]) - want).abs() < tol, "{simd:?} n {n} k {k}: ({r},{c}) {} vs {want}", all[[r, c]]);
                    }
                }
                for m in [1, 2, 3, 4, 17] {
                    for start in [0, 5, ALL - m] {
                        let got = pool(2).install(|| product(x.slice(s![start..start + m, ..])));
                        assert!(got == all.slice(s![start..start + m, ..]), "{simd:?} n {n} k {k}: rows {start}..+{m} differ from the same rows of {ALL}");
                    }
                }
            }
        }
    }

    #[test]
    fn f32_products_match_f64_and_rows_do_not_depend_on_their_batch() {
        check(|x| x, |x| x);
    }

    #[test]
    fn bf16_products_match_f64_and_rows_do_not_depend_on_their_batch() {
        check(bf16::from_f32, bf16::to_f32);
    }

    #[test]
    fn f16_products_match_f64_and_rows_do_not_depend_on_their_batch() {
        check(f16::from_f32, f16::to_f32);
    }

    #[test]
    fn widening_is_exact() {
        use super::super::lanes::Portable;
        let vals = [0.0f32, -0.0, 1.0, -2.5, 3.3, 1e-8, 65504.0, f32::MIN_POSITIVE];
        let mut buf = Vec::new();
        let b: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(bf16::as_f32(Portable, &b, &mut buf), b.iter().map(|v| v.to_f32()).collect::<Vec<_>>());
        let h: Vec<f16> = vals.iter().map(|&v| f16::from_f32(v)).collect();
        assert_eq!(f16::as_f32(Portable, &h, &mut buf), h.iter().map(|v| v.to_f32()).collect::<Vec<_>>());
        assert_eq!(f32::as_f32(Portable, &vals, &mut buf), vals, "f32 rows are read as they are");
    }
}
