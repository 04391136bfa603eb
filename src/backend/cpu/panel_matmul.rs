//! `x @ w^T` for weights packed once into column panels: the CPU's one matrix
//! product, for f32, bf16 and f16 weights, accumulated in f32.
//!
//! At upload a weight `[n, k]` (HF Linear layout) is rearranged ([`pack`]) into
//! panels of [`PANEL`] output columns, each stored k-major (`[k][PANEL]`,
//! zero-padded past `n`). A kernel call multiplies a few rows of `x` by one or
//! more panels: for each `k` in order it broadcasts `x[r][k]` and adds its
//! products with the panel's row of weights into the row's accumulators, one
//! fused multiply-add each.
//!
//! So every output element is the same chain, `fma(x[k-1], w[k-1], … fma(x[0],
//! w[0], 0))` over `k` in order, whatever rows, panels, tiles, threads or vector
//! width share the call: a row's result never depends on its batch (cached and
//! uncached prefills agree to the last bit), every build (AVX-512, AVX2, portable)
//! gives the same bits, and the tests hold all of them to that chain written as a
//! scalar loop.
//!
//! Packing once is what makes a decode step cheap: each call reads the weight in
//! place, in its stored width, once for all of its rows (the `gemm` crate this
//! replaced packed every weight again on every call). Panels are taken in groups
//! that stay in L2 while every row of a block passes over them, so a prefill
//! reuses each weight from cache.

use std::ops::Range;

use half::{bf16, f16};
use ndarray::{Array2, ArrayView2, s};
use rayon::prelude::*;

use super::lanes::{Simd, Wide, WideKernel};

/// Output columns (weight rows) per panel.
pub(crate) const PANEL: usize = 32;
/// Bytes of `x` rows one task multiplies per panel group (stays in L2 beside the group).
const ROW_BLOCK_BYTES: usize = 192 << 10;
/// Bytes of weight panels taken as a group (stays in L2 while a row block passes).
const PANEL_GROUP_BYTES: usize = 256 << 10;
/// Tasks per thread: enough to balance uneven tiles.
const TASKS_PER_THREAD: usize = 4;
/// Fewest panels a task takes (fewer would cost more in scheduling than they save).
const MIN_PANELS_PER_TASK: usize = 4;
/// How many `k` rows ahead of the multiply-adds each panel is prefetched. A decode
/// step streams the weights from memory; asking ahead keeps that stream full. In a
/// standalone run on this machine (2 threads, shared) the 151936-row lm_head took
/// 6.6-7.3 ms at one row in bf16 against 7.9 without, and 7.6-14 ms at 8 rows
/// against 13.8; 8 and 32 rows ahead were no better.
const PREFETCH_ROWS: usize = 16;

/// A stored weight element that widens exactly to f32.
pub(crate) trait Element: Copy + Default + Send + Sync {
    /// `W::WIDTH` elements from `p`, widened.
    ///
    /// # Safety
    /// `p` must be valid for reading `W::WIDTH` elements.
    unsafe fn load<W: Wide>(w: W, p: *const Self) -> W::V;
    fn to_f32(self) -> f32;
}

impl Element for f32 {
    #[inline(always)]
    unsafe fn load<W: Wide>(w: W, p: *const f32) -> W::V {
        // SAFETY: forwarded from the caller.
        unsafe { w.load(p) }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Element for bf16 {
    #[inline(always)]
    unsafe fn load<W: Wide>(w: W, p: *const bf16) -> W::V {
        // SAFETY: forwarded from the caller.
        unsafe { w.load_bf16(p) }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

impl Element for f16 {
    #[inline(always)]
    unsafe fn load<W: Wide>(w: W, p: *const f16) -> W::V {
        // SAFETY: forwarded from the caller.
        unsafe { w.load_f16(p) }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// Elements a packed `[n, k]` weight occupies (`n` rounded up to whole panels).
pub(crate) fn packed_len(n: usize, k: usize) -> usize {
    n.div_ceil(PANEL) * PANEL * k
}

/// `w [n, k]` rearranged into panels: element `(j, c)` lands at
/// `(j / PANEL) * k * PANEL + c * PANEL + j % PANEL`; padding is zero.
pub(crate) fn pack<T: Copy + Default + Send + Sync>(w: ArrayView2<'_, T>) -> Vec<T> {
    let (n, k) = w.dim();
    let mut data = vec![T::default(); packed_len(n, k)];
    if k == 0 {
        return data;
    }
    data.par_chunks_mut(k * PANEL).enumerate().for_each(|(p, panel)| {
        let rows = w.slice(s![p * PANEL..n.min((p + 1) * PANEL), ..]);
        for (l, row) in rows.rows().into_iter().enumerate() {
            for (c, &v) in row.iter().enumerate() {
                panel[c * PANEL + l] = v;
            }
        }
    });
    data
}

/// Row `j` of a packed `[_, k]` weight, widened (an embedding lookup).
pub(crate) fn row_f32<T: Element>(data: &[T], k: usize, j: usize) -> impl Iterator<Item = f32> + '_ {
    let base = j / PANEL * k * PANEL + j % PANEL;
    (0..k).map(move |c| data[base + c * PANEL].to_f32())
}

/// The output pointer tasks write disjoint tiles through.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: tasks write disjoint elements (distinct tiles), and the output outlives the parallel loop.
unsafe impl Send for Out {}
// SAFETY: as for Send: no two tasks touch one element, and none reads another's.
unsafe impl Sync for Out {}

/// `x @ w^T` restricted to output columns `cols`: `x [m, k]` f32, `data` a packed
/// `[n, k]` weight ([`pack`]) with `cols` inside `0..n` → `[m, cols.len()]` f32.
pub(crate) fn matmul_t<T: Element>(
    x: ArrayView2<'_, f32>, data: &[T], k: usize, cols: Range<usize>,
) -> Array2<f32> {
    matmul_t_on(Simd::detect(), x, data, k, cols)
}

/// [`matmul_t`] on the lanes of `simd`.
fn matmul_t_on<T: Element>(
    simd: Simd, x: ArrayView2<'_, f32>, data: &[T], k: usize, cols: Range<usize>,
) -> Array2<f32> {
    let m = x.nrows();
    assert_eq!(x.ncols(), k, "matmul_t: x and w disagree on k");
    let panels = cols.start / PANEL..cols.end.div_ceil(PANEL);
    assert!(panels.end * PANEL * k <= data.len(), "matmul_t: columns {cols:?} outside the packed weight");
    if m == 0 || cols.is_empty() {
        return Array2::zeros((m, cols.len()));
    }
    let width = panels.len() * PANEL;
    let mut out = Array2::<f32>::zeros((m, width));
    let x = x.as_standard_layout();
    let Some(xs) = x.as_slice() else { unreachable!("standard layout is contiguous") };
    // Whole multiples of every kernel's row count, so only a block's last rows take a narrower kernel.
    let rows_per_block = (ROW_BLOCK_BYTES / (4 * k.max(1))).max(24) / 24 * 24;
    let row_blocks = m.div_ceil(rows_per_block);
    let threads = rayon::current_num_threads().max(1);
    let chunks = (threads * TASKS_PER_THREAD).div_ceil(row_blocks).max(1);
    let per_chunk = panels.len().div_ceil(chunks).max(MIN_PANELS_PER_TASK);
    let tiles: Vec<(usize, usize)> =
        (0..row_blocks).flat_map(|r| (0..panels.len().div_ceil(per_chunk)).map(move |c| (r, c))).collect();
    let out_ptr = Out(out.as_mut_ptr());
    let first = panels.start;
    tiles.into_par_iter().for_each(|(rb, pc)| {
        let task = TileTask {
            xs,
            data,
            k,
            rows: rb * rows_per_block..m.min((rb + 1) * rows_per_block),
            panels: first + pc * per_chunk..panels.end.min(first + (pc + 1) * per_chunk),
            first,
            out: out_ptr,
            width,
        };
        simd.run_wide(task);
    });
    let offset = cols.start - first * PANEL;
    if offset == 0 && width == cols.len() {
        out
    } else {
        out.slice(s![.., offset..offset + cols.len()]).to_owned()
    }
}

/// One tile of one [`matmul_t_on`] call. Only that function makes one: `rows` lie
/// inside `xs` (`[m, k]`), `panels` inside `data`, `out` points at `[m, width]`
/// whose column 0 is panel `first`'s, and no two tasks share a tile.
struct TileTask<'a, T> {
    xs: &'a [f32],
    data: &'a [T],
    k: usize,
    rows: Range<usize>,
    panels: Range<usize>,
    first: usize,
    out: Out,
    width: usize,
}

impl<T: Element> WideKernel for TileTask<'_, T> {
    type Out = ();
    #[inline(always)]
    fn run<W: Wide>(self, w: W) {
        // Two vectors of columns per call: with 16 lanes a whole panel, 8 rows (16
        // accumulators of 32 registers); with 8 lanes half a panel at a time, 6 rows
        // (12 accumulators, 2 weight vectors and a broadcast: 15 of 16 registers).
        // SAFETY: `TileTask`'s contract.
        unsafe { if W::WIDTH == 16 { run_tile::<W, T, 8>(w, &self) } else { run_tile::<W, T, 6>(w, &self) } }
    }
}

/// Vectors of columns per kernel call: [`PANEL`] / (`NV` · width) calls cover a panel.
const NV: usize = 2;

/// Takes the tile's panels a group at a time and multiplies every row of the tile
/// by each group, `MR` rows at a time (fewer rows take more panels per call, so a
/// decode step still has independent accumulators to hide the multiply-add latency).
///
/// # Safety
/// `TileTask`'s contract; `NV * W::WIDTH` divides `PANEL`.
#[inline(always)]
unsafe fn run_tile<W: Wide, T: Element, const MR: usize>(w: W, t: &TileTask<'_, T>) {
    assert_eq!(PANEL % (NV * W::WIDTH), 0, "kernel calls cover whole panels");
    let k = t.k;
    let group = (PANEL_GROUP_BYTES / (k.max(1) * PANEL * std::mem::size_of::<T>())).max(1);
    let mut g0 = t.panels.start;
    while g0 < t.panels.end {
        let g1 = t.panels.end.min(g0 + group);
        let mut r0 = t.rows.start;
        while r0 < t.rows.end {
            let rm = MR.min(t.rows.end - r0);
            let mut p = g0;
            while p < g1 {
                macro_rules! call {
                    ($mr:literal, $np:literal) => {{
                        let x = |i: usize| t.xs[(r0 + i) * k..].as_ptr();
                        for col in (0..PANEL).step_by(NV * W::WIDTH) {
                            // SAFETY: panels p..p + $np lie inside the tile's panels, inside `data`.
                            let panel = |q: usize| unsafe { t.data.as_ptr().add((p + q) * k * PANEL + col) };
                            let out = |i: usize| {
                                std::array::from_fn(|q| {
                                    // SAFETY: row r0 + i and panel p + q lie in the tile, inside `[m, width]`.
                                    unsafe { t.out.0.add((r0 + i) * t.width + (p + q - t.first) * PANEL + col) }
                                })
                            };
                            // SAFETY: each x pointer starts a row of k floats, each panel pointer
                            // k rows of PANEL elements (from column `col`), each out pointer
                            // NV * WIDTH writable floats no other task writes.
                            unsafe {
                                kernel::<W, T, $mr, $np>(w, std::array::from_fn(x), std::array::from_fn(panel), k, std::array::from_fn(out))
                            };
                        }
                        p += $np;
                    }};
                }
                let wide = W::WIDTH == 16;
                match (rm, g1 - p) {
                    (1, 4..) if wide => call!(1, 4),
                    (1, 2..) => call!(1, 2),
                    (1, _) => call!(1, 1),
                    (2, 2..) if wide => call!(2, 2),
                    (2, _) => call!(2, 1),
                    (3, _) => call!(3, 1),
                    (4, _) => call!(4, 1),
                    (5, _) => call!(5, 1),
                    (6, _) => call!(6, 1),
                    (7, _) => call!(7, 1),
                    _ => call!(8, 1),
                }
            }
            r0 += rm;
        }
        g0 = g1;
    }
}

/// `R` rows of `x` by `NV` vectors of columns of `P` panels: for each `k` in
/// order, every accumulator takes one fused multiply-add. The same operations per
/// element whatever `R`, `P` and the columns.
///
/// # Safety
/// Every `x` pointer starts `k` readable floats, every panel pointer `k` rows of
/// `PANEL` (it may start inside a row) with `NV * W::WIDTH` readable from each,
/// every `out` pointer `NV * W::WIDTH` writable floats.
#[inline(always)]
unsafe fn kernel<W: Wide, T: Element, const R: usize, const P: usize>(
    w: W, x: [*const f32; R], panel: [*const T; P], k: usize, out: [[*mut f32; P]; R],
) {
    let mut acc = [[[w.zero(); NV]; P]; R];
    for c in 0..k {
        for p in &panel {
            // Past the panel's end near the last rows: a prefetch never faults.
            w.prefetch(p.wrapping_add((c + PREFETCH_ROWS) * PANEL).cast());
        }
        // SAFETY: c < k, so each load stays inside its panel.
        let wv: [[W::V; NV]; P] = std::array::from_fn(|q| {
            // SAFETY: `c * PANEL + v * WIDTH` stays inside the panel, which holds `k * PANEL` weights.
            std::array::from_fn(|v| unsafe { T::load(w, panel[q].add(c * PANEL + v * W::WIDTH)) })
        });
        for (a, xp) in acc.iter_mut().zip(&x) {
            // SAFETY: c < k.
            let xb = unsafe { w.splat_at(xp.add(c)) };
            for (a, wv) in a.iter_mut().zip(&wv) {
                for (a, wv) in a.iter_mut().zip(wv) {
                    *a = w.mul_add(xb, *wv, *a);
                }
            }
        }
    }
    for (a, o) in acc.iter().zip(&out) {
        for (a, o) in a.iter().zip(o) {
            for (v, a) in a.iter().enumerate() {
                // SAFETY: v * WIDTH + WIDTH <= NV * WIDTH floats from o.
                unsafe { w.store(o.add(v * W::WIDTH), *a) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::test_support::{pool, rand_rows};

    /// The definition every build must meet to the bit: one fused multiply-add per
    /// `k`, in order, from zero.
    fn chain(x: &Array2<f32>, w: &Array2<f32>, r: usize, j: usize) -> f32 {
        (0..x.ncols()).fold(0.0f32, |acc, c| x[[r, c]].mul_add(w[[j, c]], acc))
    }

    /// Each element type on every build this CPU runs, against the scalar chain,
    /// and the invariant that keeps caching invisible: a row's result is the same
    /// to the last bit alone, in any batch, at any offset, on any column range and
    /// with any thread count.
    fn check<T: Element + std::fmt::Debug>(narrow: fn(f32) -> T) {
        const ALL: usize = 61;
        // n below, at and across panels; k from 0 to a few hundred.
        for (n, k) in [(1, 7), (5, 0), (32, 8), (37, 29), (64, 512), (130, 100), (1000, 64)] {
            let stored = rand_rows(n as u64, n, k).mapv(narrow);
            let widened = stored.mapv(T::to_f32);
            let data = pack(stored.view());
            let x = rand_rows(k as u64 + 9, ALL, k);
            let want = Array2::from_shape_fn((ALL, n), |(r, j)| chain(&x, &widened, r, j));
            for simd in Simd::all() {
                let product =
                    |x: ArrayView2<'_, f32>, cols: Range<usize>| matmul_t_on(simd, x, &data, k, cols);
                let all = pool(2).install(|| product(x.view(), 0..n));
                assert!(all == want, "{simd:?} n {n} k {k}: differs from the fused chain");
                assert!(
                    pool(1).install(|| product(x.view(), 0..n)) == want,
                    "{simd:?} n {n} k {k}: 1 thread differs"
                );
                for m in [1, 2, 3, 8, 9, 17] {
                    for start in [0, 5, ALL - m] {
                        let got = pool(2).install(|| product(x.slice(s![start..start + m, ..]), 0..n));
                        assert!(
                            got == want.slice(s![start..start + m, ..]),
                            "{simd:?} n {n} k {k}: rows {start}..+{m}"
                        );
                    }
                }
                let cols = n / 3..n - n / 4;
                assert!(
                    product(x.view(), cols.clone()) == want.slice(s![.., cols.clone()]),
                    "{simd:?} n {n} k {k}: columns {cols:?}"
                );
            }
        }
    }

    #[test]
    fn f32_products_are_the_fused_chain_on_every_build_and_batch() {
        check(|x| x);
    }

    #[test]
    fn bf16_products_are_the_fused_chain_on_every_build_and_batch() {
        check(bf16::from_f32);
    }

    #[test]
    fn f16_products_are_the_fused_chain_on_every_build_and_batch() {
        check(f16::from_f32);
    }

    /// The builds `Simd::all()` gives on this CPU, by name; the ones it lacks are
    /// printed as not run (and fail the test when `OMNIPREFIX_REQUIRE_SIMD` names
    /// them, comma-separated, as a CI machine known to have them should).
    fn builds_run(test: &str) -> Vec<Simd> {
        let all = Simd::all();
        let name = |s: &Simd| match s {
            Simd::Portable => "portable",
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2(_) => "avx2",
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512(_) => "avx512",
        };
        let have: Vec<&str> = all.iter().map(name).collect();
        let required = std::env::var("OMNIPREFIX_REQUIRE_SIMD").unwrap_or_default();
        for build in ["portable", "avx2", "avx512"] {
            if !have.contains(&build) {
                eprintln!("{test}: the {build} build NOT RUN: this CPU lacks it");
                assert!(
                    !required.split(',').any(|r| r.trim() == build),
                    "{test}: OMNIPREFIX_REQUIRE_SIMD names {build}, which this CPU lacks"
                );
            }
        }
        all
    }

    /// Every row tail of every kernel (1..=16 rows left and more: 8 rows a call on
    /// 16 lanes, 6 on 8) on every build, each at two offsets, with one to five
    /// panels a tile (the 1-row calls take 4, 2 or 1 panels, the 2-row ones 2 or
    /// 1), on one and two threads, and a row block's last rows past a whole block:
    /// each element the fused chain, bit for bit.
    fn check_tails<T: Element + std::fmt::Debug>(test: &str, narrow: fn(f32) -> T) {
        const ALL: usize = 60;
        for (n, k) in [(32, 37), (70, 37), (128, 19), (159, 37)] {
            let stored = rand_rows(n as u64 + 1, n, k).mapv(narrow);
            let widened = stored.mapv(T::to_f32);
            let data = pack(stored.view());
            let x = rand_rows(k as u64 + 3, ALL, k);
            let want = Array2::from_shape_fn((ALL, n), |(r, j)| chain(&x, &widened, r, j));
            for simd in builds_run(test) {
                for threads in [1, 2] {
                    for m in 1..=48 {
                        for start in [0, ALL - m] {
                            let got = pool(threads).install(|| {
                                matmul_t_on(simd, x.slice(s![start..start + m, ..]), &data, k, 0..n)
                            });
                            if let Some((r, j)) = (0..m)
                                .flat_map(|r| (0..n).map(move |j| (r, j)))
                                .find(|&(r, j)| got[[r, j]].to_bits() != want[[start + r, j]].to_bits())
                            {
                                panic!(
                                    "{simd:?} {threads} thread(s) n {n} k {k}: {m} rows from {start}, row {r} column {j}: {} where the chain gives {}",
                                    got[[r, j]],
                                    want[[start + r, j]]
                                );
                            }
                        }
                    }
                }
            }
        }
        // k = 2048: 96-row blocks, so 97..=112 rows end in a second block's tail.
        let (n, k) = (40, 2048);
        let stored = rand_rows(5, n, k).mapv(narrow);
        let widened = stored.mapv(T::to_f32);
        let data = pack(stored.view());
        let x = rand_rows(6, 112, k);
        let want = Array2::from_shape_fn((112, n), |(r, j)| chain(&x, &widened, r, j));
        for simd in builds_run(test) {
            for m in 97..=112 {
                let got = pool(2).install(|| matmul_t_on(simd, x.slice(s![..m, ..]), &data, k, 0..n));
                assert!(
                    got == want.slice(s![..m, ..]),
                    "{simd:?} n {n} k {k}: {m} rows differ from the fused chain"
                );
            }
        }
    }

    #[test]
    fn f32_products_are_the_fused_chain_for_every_row_tail() {
        check_tails("f32 row tails", |x| x);
    }

    #[test]
    fn bf16_products_are_the_fused_chain_for_every_row_tail() {
        check_tails("bf16 row tails", bf16::from_f32);
    }

    #[test]
    fn f16_products_are_the_fused_chain_for_every_row_tail() {
        check_tails("f16 row tails", f16::from_f32);
    }

    #[test]
    fn packed_rows_read_back_exactly() {
        let w = rand_rows(3, 45, 11).mapv(bf16::from_f32);
        let data = pack(w.view());
        assert_eq!(data.len(), 64 * 11, "45 rows take two whole panels");
        for j in [0, 31, 32, 44] {
            let row: Vec<f32> = row_f32(&data, 11, j).collect();
            assert_eq!(row, w.row(j).iter().map(|v| v.to_f32()).collect::<Vec<_>>(), "row {j}");
        }
    }
}
