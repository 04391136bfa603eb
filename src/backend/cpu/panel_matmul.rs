//! `x @ w^T` for weights packed once into column panels: the CPU's one matrix
//! product, for f32, bf16 and f16 weights, accumulated in f32.
//!
//! At upload a weight `[n, k]` (HF Linear layout) is rearranged ([`pack`]) into
//! panels of [`PANEL`] output columns, each stored step-major (`[k / STEP][PANEL][STEP]`,
//! zero-padded past `n` and `k`). A step is one `k` for f32 and f16 weights and a pair
//! of `k` for bf16 ones: the layout `vdpbf16ps` reads. A kernel call multiplies a few
//! rows of `x` by one or more panels: for each step in order it broadcasts the step's
//! `x` of a row and adds its products with the panel's step of weights into the row's
//! accumulators, one fused multiply-add per `k` (or one `vdpbf16ps` per pair).
//!
//! So every output element is the same chain, `fma(x[k-1], w[k-1], … fma(x[0],
//! w[0], 0))` over `k` in order, except that a bf16 weight's chain takes each pair's
//! second product first (`vdpbf16ps`'s order) and reads `x` rounded to bf16 (as
//! torch's bf16 products do). That holds whatever rows, panels, tiles, threads or vector
//! width share the call: a row's result never depends on its batch (cached and
//! uncached prefills agree to the last bit), every build (AVX512-BF16, AVX-512, AVX2,
//! portable) gives the same bits, and the tests hold all of them to that chain
//! written as a scalar loop.
//!
//! Packing once is what makes a decode step cheap: each call reads the weight in
//! place, in its stored width, once for all of its rows (the `gemm` crate this
//! replaced packed every weight again on every call). Panels are taken in groups
//! that stay in L2 while every row of a block passes over them, so a prefill
//! reuses each weight from cache.

use std::borrow::Cow;
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

/// A stored weight element, and what the products read of `x` beside it.
pub(crate) trait Element: Copy + Default + Send + Sync {
    /// `k` per step of the product (a panel row): 1, or 2 where the weights are
    /// stored in pairs (bf16, the layout `vdpbf16ps` reads).
    const STEP: usize;
    /// What the products read of `x`: f32 as given, or rounded to bf16 beside bf16 weights.
    type X: Copy + Default + Send + Sync + Into<f32>;
    /// One step of `x` in every lane.
    type Splat<W: Wide>: Copy;
    /// One step of `W::WIDTH` columns of weights, as loaded.
    type Loaded<W: Wide>: Copy;
    /// `x` (rows of `k`) as the products read it: rows of `k` rounded up to [`Self::STEP`], zero-padded.
    fn activations(x: &[f32], k: usize) -> Cow<'_, [Self::X]>;
    /// # Safety
    /// `x` must be valid for reading `STEP` elements.
    unsafe fn splat<W: Wide>(w: W, x: *const Self::X) -> Self::Splat<W>;
    /// # Safety
    /// `p` must be valid for reading `STEP * W::WIDTH` elements.
    unsafe fn load<W: Wide>(w: W, p: *const Self) -> Self::Loaded<W>;
    /// `acc` plus one step's products, each a fused multiply-add, the step's last `k` first.
    fn update<W: Wide>(w: W, acc: W::V, x: Self::Splat<W>, weights: Self::Loaded<W>) -> W::V;
    /// The element as packed and multiplied (bf16 subnormals become zero, as `vdpbf16ps` reads them).
    fn packed(self) -> Self;
    fn to_f32(self) -> f32;
}

/// The f32 and f16 weights: one `k` a step, `x` as given, each weight widened.
macro_rules! element_widened {
    ($t:ty, $load:ident) => {
        impl Element for $t {
            const STEP: usize = 1;
            type X = f32;
            type Splat<W: Wide> = W::V;
            type Loaded<W: Wide> = W::V;
            fn activations(x: &[f32], _k: usize) -> Cow<'_, [f32]> {
                Cow::Borrowed(x)
            }
            #[inline(always)]
            unsafe fn splat<W: Wide>(w: W, x: *const f32) -> W::V {
                // SAFETY: forwarded from the caller.
                unsafe { w.splat_at(x) }
            }
            #[inline(always)]
            unsafe fn load<W: Wide>(w: W, p: *const $t) -> W::V {
                // SAFETY: forwarded from the caller.
                unsafe { w.$load(p) }
            }
            #[inline(always)]
            fn update<W: Wide>(w: W, acc: W::V, x: W::V, weights: W::V) -> W::V {
                w.mul_add(x, weights, acc)
            }
            fn packed(self) -> Self {
                self
            }
            #[inline(always)]
            fn to_f32(self) -> f32 {
                self.into()
            }
        }
    };
}
element_widened!(f32, load);
element_widened!(f16, load_f16);

/// bf16 weights: `x` rounded to bf16 as well (as torch's bf16 products take it),
/// two `k` a step (one `vdpbf16ps` on AVX512-BF16).
impl Element for bf16 {
    const STEP: usize = 2;
    type X = bf16;
    type Splat<W: Wide> = W::Bf16Pair;
    type Loaded<W: Wide> = W::Bf16Pairs;
    fn activations(x: &[f32], k: usize) -> Cow<'_, [bf16]> {
        if k == 0 {
            return Cow::Owned(Vec::new());
        }
        let kp = k.next_multiple_of(2);
        let mut out = vec![bf16::ZERO; x.len() / k * kp];
        for (o, x) in out.chunks_exact_mut(kp).zip(x.chunks_exact(k)) {
            for (o, &x) in o.iter_mut().zip(x) {
                *o = bf16::from_f32(x).packed();
            }
        }
        Cow::Owned(out)
    }
    #[inline(always)]
    unsafe fn splat<W: Wide>(w: W, x: *const bf16) -> W::Bf16Pair {
        // SAFETY: forwarded from the caller.
        unsafe { w.splat_bf16_pair(x) }
    }
    #[inline(always)]
    unsafe fn load<W: Wide>(w: W, p: *const bf16) -> W::Bf16Pairs {
        // SAFETY: forwarded from the caller.
        unsafe { w.load_bf16_pairs(p) }
    }
    #[inline(always)]
    fn update<W: Wide>(w: W, acc: W::V, x: W::Bf16Pair, weights: W::Bf16Pairs) -> W::V {
        w.dot_bf16_pairs(acc, x, weights)
    }
    fn packed(self) -> Self {
        // A zero exponent with a nonzero fraction is subnormal: keep the sign only.
        if self.to_bits() & 0x7F80 == 0 { bf16::from_bits(self.to_bits() & 0x8000) } else { self }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// Elements a packed `[n, k]` weight occupies (`n` rounded up to whole panels, `k` to whole steps).
pub(crate) fn packed_len<T: Element>(n: usize, k: usize) -> usize {
    n.div_ceil(PANEL) * PANEL * k.next_multiple_of(T::STEP)
}

/// Where element `(j, c)` of a `[_, k]` weight lies once packed: in panel
/// `j / PANEL`, step `c / STEP`, at `(j % PANEL) * STEP + c % STEP` of the step.
fn packed_index<T: Element>(k: usize, j: usize, c: usize) -> usize {
    let step = PANEL * T::STEP;
    j / PANEL * k.next_multiple_of(T::STEP) * PANEL + c / T::STEP * step + j % PANEL * T::STEP + c % T::STEP
}

/// `w [n, k]` rearranged into panels ([`packed_index`]); padding is zero.
pub(crate) fn pack<T: Element>(w: ArrayView2<'_, T>) -> Vec<T> {
    let (n, k) = w.dim();
    let mut data = vec![T::default(); packed_len::<T>(n, k)];
    if k == 0 {
        return data;
    }
    data.par_chunks_mut(k.next_multiple_of(T::STEP) * PANEL).enumerate().for_each(|(p, panel)| {
        let rows = w.slice(s![p * PANEL..n.min((p + 1) * PANEL), ..]);
        for (l, row) in rows.rows().into_iter().enumerate() {
            for (c, &v) in row.iter().enumerate() {
                panel[packed_index::<T>(k, l, c)] = v.packed();
            }
        }
    });
    data
}

/// Row `j` of a packed `[_, k]` weight, widened (an embedding lookup).
pub(crate) fn row_f32<T: Element>(data: &[T], k: usize, j: usize) -> impl Iterator<Item = f32> + '_ {
    (0..k).map(move |c| data[packed_index::<T>(k, j, c)].to_f32())
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
    let xs = T::activations(xs, k);
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
            xs: &xs,
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
/// inside `xs` (`[m, k]`, each row rounded up to whole steps: [`Element::activations`]),
/// `panels` inside `data`, `out` points at `[m, width]` whose column 0 is panel
/// `first`'s, and no two tasks share a tile.
struct TileTask<'a, T: Element> {
    xs: &'a [T::X],
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
    let k = t.k.next_multiple_of(T::STEP);
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
                            let panel = |q: usize| unsafe { t.data.as_ptr().add((p + q) * k * PANEL + col * T::STEP) };
                            let out = |i: usize| {
                                std::array::from_fn(|q| {
                                    // SAFETY: row r0 + i and panel p + q lie in the tile, inside `[m, width]`.
                                    unsafe { t.out.0.add((r0 + i) * t.width + (p + q - t.first) * PANEL + col) }
                                })
                            };
                            // SAFETY: each x pointer starts a row of k elements, each panel pointer
                            // k / STEP steps of PANEL * STEP elements (from column `col`), each out
                            // pointer NV * WIDTH writable floats no other task writes.
                            unsafe {
                                kernel::<W, T, $mr, $np>(w, std::array::from_fn(x), std::array::from_fn(panel), k / T::STEP, std::array::from_fn(out))
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

/// `R` rows of `x` by `NV` vectors of columns of `P` panels: for each step in
/// order, every accumulator takes the step's products ([`Element::update`]). The
/// same operations per element whatever `R`, `P` and the columns.
///
/// # Safety
/// Every `x` pointer starts `steps * STEP` readable elements, every panel pointer
/// `steps` steps of `PANEL * STEP` (it may start inside a step) with
/// `NV * W::WIDTH * STEP` readable from each, every `out` pointer `NV * W::WIDTH`
/// writable floats.
#[inline(always)]
unsafe fn kernel<W: Wide, T: Element, const R: usize, const P: usize>(
    w: W, x: [*const T::X; R], panel: [*const T; P], steps: usize, out: [[*mut f32; P]; R],
) {
    let step = PANEL * T::STEP;
    let mut acc = [[[w.zero(); NV]; P]; R];
    for c in 0..steps {
        for p in &panel {
            // Past the panel's end near the last steps: a prefetch never faults.
            w.prefetch(p.wrapping_add((c + PREFETCH_ROWS / T::STEP) * step).cast());
        }
        let wv: [[T::Loaded<W>; NV]; P] = std::array::from_fn(|q| {
            // SAFETY: c < steps, and `c * step + (v + 1) * WIDTH * STEP` stays inside the panel.
            std::array::from_fn(|v| unsafe { T::load(w, panel[q].add(c * step + v * W::WIDTH * T::STEP)) })
        });
        for (a, xp) in acc.iter_mut().zip(&x) {
            // SAFETY: c < steps.
            let xb = unsafe { T::splat(w, xp.add(c * T::STEP)) };
            for (a, wv) in a.iter_mut().zip(&wv) {
                for (a, wv) in a.iter_mut().zip(wv) {
                    *a = T::update(w, *a, xb, *wv);
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
    use crate::builds_run::builds_run;

    /// The definition every build must meet to the bit: from zero, one fused
    /// multiply-add per `k`, a step at a time in order and each step's last `k`
    /// first, of `x` as the products read it (bf16 beside bf16 weights) and the
    /// weights as packed.
    fn chain<T: Element>(x: &Array2<f32>, w: &Array2<T>) -> Array2<f32> {
        let k = x.ncols();
        let x = x.as_standard_layout();
        let xs = T::activations(x.as_slice().expect("standard layout"), k);
        let kp = k.next_multiple_of(T::STEP);
        Array2::from_shape_fn((x.nrows(), w.nrows()), |(r, j)| {
            let mut acc = 0.0f32;
            for s in (0..k).step_by(T::STEP.max(1)) {
                for c in (s..k.min(s + T::STEP)).rev() {
                    acc = xs[r * kp + c].into().mul_add(w[[j, c]].packed().to_f32(), acc);
                }
            }
            acc
        })
    }

    #[test]
    fn bf16_products_read_x_rounded_and_their_pairs_second_first() {
        // x[0] = 1 + 2^-9 is read as 1 (bf16 keeps 7 fraction bits), so the first pair
        // leaves exactly 1. The second adds 2^-23 (its second product) first: 1 + 2^-23,
        // then 2^-24, a tie rounded to the even 1 + 2^-22. In k order it would be 1, then 1 + 2^-23.
        let t = |e: i32| 2f32.powi(e);
        let x = ndarray::array![[1.0 + t(-9), 0.0, t(-12), t(-12)]];
        let w = ndarray::array![[1.0, 0.0, t(-12), t(-11)]].mapv(bf16::from_f32);
        for simd in Simd::all() {
            let got = matmul_t_on(simd, x.view(), &pack(w.view()), 4, 0..1);
            assert_eq!(got[[0, 0]], 1.0 + t(-22), "{}", simd.name());
        }
        assert_eq!(chain(&x, &w)[[0, 0]], 1.0 + t(-22));
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
            let data = pack(stored.view());
            let x = rand_rows(k as u64 + 9, ALL, k);
            let want = chain(&x, &stored);
            for simd in builds_run("products") {
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

    /// Every row tail of every kernel (1..=16 rows left and more: 8 rows a call on
    /// 16 lanes, 6 on 8) on every build, each at two offsets, with one to five
    /// panels a tile (the 1-row calls take 4, 2 or 1 panels, the 2-row ones 2 or
    /// 1), on one and two threads, and a row block's last rows past a whole block:
    /// each element the fused chain, bit for bit.
    fn check_tails<T: Element + std::fmt::Debug>(test: &str, narrow: fn(f32) -> T) {
        const ALL: usize = 60;
        for (n, k) in [(32, 37), (70, 37), (128, 19), (159, 37)] {
            let stored = rand_rows(n as u64 + 1, n, k).mapv(narrow);
            let data = pack(stored.view());
            let x = rand_rows(k as u64 + 3, ALL, k);
            let want = chain(&x, &stored);
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
        let data = pack(stored.view());
        let x = rand_rows(6, 112, k);
        let want = chain(&x, &stored);
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
        assert_eq!(data.len(), 64 * 12, "45 rows take two whole panels, 11 columns six bf16 pairs");
        for j in [0, 31, 32, 44] {
            let row: Vec<f32> = row_f32(&data, 11, j).collect();
            assert_eq!(row, w.row(j).iter().map(|v| v.to_f32()).collect::<Vec<_>>(), "row {j}");
        }
    }
}
