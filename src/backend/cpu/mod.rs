//! The CPU reference backend: ndarray matrices, products over weights packed
//! once into panels (see `panel_matmul`), flash-style attention
//! over the pages in place, parallel over (sequence, KV head, query tile).
//!
//! Every op here is the semantic reference the GPU backend is tested against.

mod attention;
mod check;
pub mod conv;
pub(crate) mod dense_attention;
mod fast_exp;
mod fast_sin;
pub(crate) mod lanes;
mod moe;
mod packed_weight;
mod pages;
mod panel_matmul;
mod rope;

use ndarray::{Array2, ArrayView2, Axis, parallel::prelude::*};

use crate::Result;
use crate::backend::{
    AttnHeads, AttnSeq, Backend, Conv1dSpec, ConvTranspose1dSpec, Dtype, HostWeight, MoeWeights, PagesSpec,
    RopePositions, RopeSpec, add_sigmoid_gated_host, check_shape,
};
use crate::kv::BlockId;
use check::{expect_cols, expect_rows, row_index};
pub use lanes::SIMD_ENV;
pub use packed_weight::PackedWeight;
pub use pages::CpuPages;

/// The CPU's kernel builds: which it runs, and which it has, by name.
///
/// ```
/// let builds = omniprefix::backend::cpu::simd_builds();
/// assert_eq!(builds.available[0], "portable");
/// assert!(builds.available.contains(&builds.running));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimdBuilds {
    /// The build every kernel runs (the best available, unless [`SIMD_ENV`] caps it).
    pub running: &'static str,
    /// Every build this CPU runs, slowest first: `portable`, then `avx2`, `avx512`, `avx512bf16` as it has them.
    pub available: Vec<&'static str>,
}

/// This CPU's [`SimdBuilds`] (detected once per process).
pub fn simd_builds() -> SimdBuilds {
    SimdBuilds {
        running: lanes::Simd::detect().name(),
        available: lanes::Simd::all().into_iter().map(lanes::Simd::name).collect(),
    }
}

/// The ndarray reference backend.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

impl CpuBackend {
    /// A CPU backend (uses rayon's global pool).
    pub fn new() -> Self {
        CpuBackend
    }
}

/// `x * sigmoid(x)`.
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + fast_exp::exp(-x))
}

/// `silu(gate) * up` of a fused `[n, 2I]` product, rows in parallel.
pub(crate) fn swiglu(gate_up: ArrayView2<'_, f32>) -> Array2<f32> {
    let inter = gate_up.ncols() / 2;
    let mut out = Array2::zeros((gate_up.nrows(), inter));
    out.axis_iter_mut(Axis(0)).into_par_iter().zip(gate_up.axis_iter(Axis(0)).into_par_iter()).for_each(
        |(mut o, gu)| {
            let (gate, up) = gu.split_at(Axis(0), inter);
            ndarray::Zip::from(&mut o).and(&gate).and(&up).for_each(|o, &g, &u| *o = silu(g) * u);
        },
    );
    out
}

/// RMSNorm of each `width`-column group of each row, in place, scaled by `w`.
fn rms_norm_groups(x: &mut Array2<f32>, w: &[f32], width: usize, eps: f32) {
    x.axis_iter_mut(Axis(0)).into_par_iter().for_each(|mut row| {
        debug_assert!(row.as_slice_mut().is_some(), "rows are contiguous in standard layout");
        if let Some(row) = row.as_slice_mut() {
            for group in row.chunks_exact_mut(width) {
                let ms = group.iter().map(|v| v * v).sum::<f32>() / width as f32;
                let inv = 1.0 / (ms + eps).sqrt();
                for (v, g) in group.iter_mut().zip(w) {
                    *v = *v * inv * g;
                }
            }
        }
    });
}

impl Backend for CpuBackend {
    type Tensor = Array2<f32>;
    type Weight = PackedWeight;
    type Pages = CpuPages;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn upload(&self, host: ArrayView2<'_, f32>) -> Result<Array2<f32>> {
        // Standard layout, so row slices are contiguous for every op.
        Ok(host.as_standard_layout().into_owned())
    }

    fn download(&self, t: &Array2<f32>) -> Result<Array2<f32>> {
        Ok(t.clone())
    }

    fn take_to_host(&self, ts: Vec<Array2<f32>>) -> Result<Vec<Array2<f32>>> {
        Ok(ts)
    }

    fn shape(&self, t: &Array2<f32>) -> [usize; 2] {
        [t.nrows(), t.ncols()]
    }

    fn weight_dtypes(&self) -> &'static [Dtype] {
        &[Dtype::F32, Dtype::Bf16, Dtype::F16]
    }

    fn upload_weight(&self, host: HostWeight) -> Result<PackedWeight> {
        Ok(PackedWeight::pack(&host))
    }

    fn alloc_pages(&self, spec: PagesSpec) -> Result<CpuPages> {
        if spec.block_size == 0 {
            return Err(crate::error::BackendError::OpShape {
                op: "alloc_pages",
                what: "block_size",
                expected: "> 0".into(),
                found: vec![spec.block_size],
            }
            .into());
        }
        if !spec.kv_dtype.is_float() {
            return Err(crate::backend::weight::unsupported_dtype(
                "cpu backend",
                "kv dtype",
                self.weight_dtypes(),
                spec.kv_dtype,
            ));
        }
        CpuPages::new(spec)
    }

    fn pages_spec(&self, pages: &CpuPages) -> PagesSpec {
        pages.spec
    }

    fn embedding(&self, table: &PackedWeight, ids: &[u32]) -> Result<Array2<f32>> {
        let [rows, cols] = table.shape();
        let mut out = Array2::zeros((ids.len(), cols));
        for (&id, mut row) in ids.iter().zip(out.rows_mut()) {
            let r = row_index("embedding", "token id", i64::from(id), rows)?;
            let Some(row) = row.as_slice_mut() else {
                unreachable!("rows of a standard-layout array are contiguous")
            };
            table.row_into(r, row);
        }
        Ok(out)
    }

    fn scatter_rows(&self, dst: &mut Array2<f32>, rows: &[u32], src: &Array2<f32>) -> Result<()> {
        expect_rows("scatter_rows", "src", src, rows.len())?;
        expect_cols("scatter_rows", "src", src, dst.ncols())?;
        for &r in rows {
            row_index("scatter_rows", "row", r as i64, dst.nrows())?;
        }
        for (i, &r) in rows.iter().enumerate() {
            dst.row_mut(r as usize).assign(&src.row(i));
        }
        Ok(())
    }

    fn gather_rows(&self, x: &Array2<f32>, rows: &[u32]) -> Result<Array2<f32>> {
        let mut out = Array2::zeros((rows.len(), x.ncols()));
        for (i, &r) in rows.iter().enumerate() {
            let r = row_index("gather_rows", "row", r as i64, x.nrows())?;
            out.row_mut(i).assign(&x.row(r));
        }
        Ok(out)
    }

    fn matmul_t(&self, x: &Array2<f32>, w: &PackedWeight) -> Result<Array2<f32>> {
        expect_cols("matmul_t", "x", x, w.shape()[1])?;
        Ok(w.matmul_all(x.view()))
    }

    fn add_bias(&self, x: &mut Array2<f32>, bias: &Array2<f32>) -> Result<()> {
        expect_rows("add_bias", "bias", bias, 1)?;
        expect_cols("add_bias", "bias", bias, x.ncols())?;
        *x += bias;
        Ok(())
    }

    fn add(&self, x: &mut Array2<f32>, y: &Array2<f32>) -> Result<()> {
        expect_rows("add", "y", y, x.nrows())?;
        expect_cols("add", "y", y, x.ncols())?;
        *x += y;
        Ok(())
    }

    fn rms_norm(&self, x: &Array2<f32>, w: &Array2<f32>, eps: f32) -> Result<Array2<f32>> {
        expect_rows("rms_norm", "weight", w, 1)?;
        expect_cols("rms_norm", "weight", w, x.ncols())?;
        let mut out = x.as_standard_layout().into_owned();
        let w: Vec<f32> = w.iter().copied().collect();
        rms_norm_groups(&mut out, &w, x.ncols().max(1), eps);
        Ok(out)
    }

    fn rms_norm_heads(&self, x: &mut Array2<f32>, w: &Array2<f32>, head_dim: usize, eps: f32) -> Result<()> {
        expect_rows("rms_norm_heads", "weight", w, 1)?;
        expect_cols("rms_norm_heads", "weight", w, head_dim)?;
        if head_dim == 0 || !x.ncols().is_multiple_of(head_dim) {
            return Err(check::shape_error("rms_norm_heads", "x", format!("[n, k * {head_dim}]"), x));
        }
        if !x.is_standard_layout() {
            *x = x.as_standard_layout().into_owned();
        }
        let w: Vec<f32> = w.iter().copied().collect();
        rms_norm_groups(x, &w, head_dim, eps);
        Ok(())
    }

    fn rope(&self, x: &mut Array2<f32>, spec: &RopeSpec, pos: RopePositions<'_>) -> Result<()> {
        rope::apply(x, spec, pos)
    }

    fn swiglu(&self, gate_up: &Array2<f32>) -> Result<Array2<f32>> {
        if !gate_up.ncols().is_multiple_of(2) {
            return Err(check::shape_error("swiglu", "gate_up", "[n, 2I]".into(), gate_up));
        }
        Ok(swiglu(gate_up.view()))
    }

    // The code2wav ops run their kernels on the arrays themselves (the trait's
    // defaults would copy every operand).

    fn causal_conv1d(
        &self, x: &Array2<f32>, w: &Array2<f32>, bias: Option<&Array2<f32>>, spec: Conv1dSpec,
    ) -> Result<Array2<f32>> {
        conv::causal_conv1d(x.view(), w.view(), bias.map(|b| b.view()), spec)
    }

    fn dense_causal_conv1d(
        &self, x: &Array2<f32>, w: &PackedWeight, bias: Option<&Array2<f32>>, spec: Conv1dSpec,
    ) -> Result<Array2<f32>> {
        conv::sum_causal_taps(self.matmul_t(x, w)?.view(), bias.map(|b| b.view()), spec)
    }

    fn causal_conv_transpose1d(
        &self, x: &Array2<f32>, w: &PackedWeight, bias: Option<&Array2<f32>>, spec: ConvTranspose1dSpec,
    ) -> Result<Array2<f32>> {
        conv::sum_transposed_taps(self.matmul_t(x, w)?.view(), bias.map(|b| b.view()), spec)
    }

    fn snake_beta(&self, x: &Array2<f32>, alpha: &Array2<f32>, beta: &Array2<f32>) -> Result<Array2<f32>> {
        conv::snake_beta(x.view(), alpha.view(), beta.view())
    }

    fn layer_norm(&self, x: &Array2<f32>, w: &Array2<f32>, b: &Array2<f32>, eps: f32) -> Result<Array2<f32>> {
        conv::layer_norm(x.view(), w.view(), b.view(), eps)
    }

    fn gelu(&self, x: &Array2<f32>) -> Result<Array2<f32>> {
        Ok(conv::gelu(x.view()))
    }

    fn scale_cols(&self, x: &mut Array2<f32>, scale: &Array2<f32>) -> Result<()> {
        conv::scale_cols(x, scale.view())
    }

    fn clamp(&self, x: &mut Array2<f32>, min: f32, max: f32) -> Result<()> {
        conv::clamp(x, min, max)
    }

    fn causal_attention(
        &self, q: &Array2<f32>, k: &Array2<f32>, v: &Array2<f32>, heads: AttnHeads, window: Option<usize>,
    ) -> Result<Array2<f32>> {
        dense_attention::causal_attention(q.view(), k.view(), v.view(), heads, window)
    }

    fn moe(&self, x: &Array2<f32>, w: &MoeWeights<PackedWeight>) -> Result<Array2<f32>> {
        moe::forward(x, w)
    }

    fn silu(&self, x: &Array2<f32>) -> Result<Array2<f32>> {
        Ok(x.mapv(silu))
    }

    fn add_sigmoid_gated(&self, x: &mut Array2<f32>, y: &Array2<f32>, gate: &Array2<f32>) -> Result<()> {
        let [rows, cols] = [x.nrows(), x.ncols()];
        check_shape("add_sigmoid_gated", "y", [rows, cols], [y.nrows(), y.ncols()])?;
        check_shape("add_sigmoid_gated", "gate", [rows, 1], [gate.nrows(), gate.ncols()])?;
        add_sigmoid_gated_host(x, y, gate);
        Ok(())
    }

    fn write_kv(
        &self, pages: &mut CpuPages, layer: usize, k: &Array2<f32>, v: &Array2<f32>, slots: &[i64],
    ) -> Result<()> {
        pages.write_kv(layer, k, v, slots)
    }

    fn paged_attention(
        &self, q: &Array2<f32>, pages: &CpuPages, layer: usize, heads: AttnHeads, seqs: &[AttnSeq<'_>],
    ) -> Result<Array2<f32>> {
        attention::paged_attention(q, pages, layer, heads, seqs)
    }

    fn write_hidden(
        &self, pages: &mut CpuPages, capture: usize, x: &Array2<f32>, slots: &[i64],
    ) -> Result<()> {
        pages.write_hidden(capture, x, slots)
    }

    fn gather_hidden(&self, pages: &CpuPages, capture: usize, slots: &[i64]) -> Result<Array2<f32>> {
        pages.gather_hidden(capture, slots)
    }

    fn copy_blocks(&self, pages: &mut CpuPages, copies: &[(BlockId, BlockId)]) -> Result<()> {
        pages.copy_blocks(copies)
    }

    fn tier_capable(&self) -> bool {
        true
    }

    fn export_block(&self, pages: &CpuPages, block: BlockId, out: &mut Vec<u8>) -> Result<()> {
        pages.export_block(block, out)
    }

    fn import_block(&self, pages: &mut CpuPages, block: BlockId, bytes: &[u8]) -> Result<()> {
        pages.import_block(block, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use crate::backend::test_support::rand_rows;
    use crate::error::BackendError;
    use ndarray::array;

    #[test]
    fn silu_and_sigmoid_gated_add_match_naive_loops_row_by_row() {
        let b = CpuBackend;
        let x = rand_rows(11, 5, 7);
        let y = rand_rows(12, 5, 7);
        let gate = rand_rows(13, 5, 1).mapv(|g| g * 6.0);
        let naive_silu = |v: f32| v / (1.0 + (-v).exp());
        let s = b.silu(&x).unwrap();
        let mut gated = x.clone();
        b.add_sigmoid_gated(&mut gated, &y, &gate).unwrap();
        for r in 0..5 {
            let sig = 1.0 / (1.0 + (-gate[[r, 0]]).exp());
            for c in 0..7 {
                assert!((s[[r, c]] - naive_silu(x[[r, c]])).abs() <= 1e-6, "silu ({r},{c})");
                let want = x[[r, c]] + sig * y[[r, c]];
                assert!((gated[[r, c]] - want).abs() <= 1e-6, "gated ({r},{c})");
            }
            // A row alone gives the same bits as in the batch.
            let row = |m: &Array2<f32>| m.slice(ndarray::s![r..r + 1, ..]).to_owned();
            assert_eq!(b.silu(&row(&x)).unwrap(), row(&s));
            let mut alone = row(&x);
            b.add_sigmoid_gated(&mut alone, &row(&y), &row(&gate)).unwrap();
            assert_eq!(alone, row(&gated));
        }
        // Bad shapes are typed errors and leave x untouched.
        let before = gated.clone();
        assert!(matches!(
            b.add_sigmoid_gated(&mut gated, &rand_rows(1, 4, 7), &gate),
            Err(Error::Backend(BackendError::OpShape { op: "add_sigmoid_gated", what: "y", .. }))
        ));
        assert!(matches!(
            b.add_sigmoid_gated(&mut gated, &y, &rand_rows(1, 5, 2)),
            Err(Error::Backend(BackendError::OpShape { op: "add_sigmoid_gated", what: "gate", ref found, .. })) if found == &[5, 2]
        ));
        assert_eq!(gated, before);
    }

    /// The host helper behind the trait's defaults (what wgpu runs) equals the CPU kernels.
    #[test]
    fn default_silu_and_gated_add_equal_the_cpu_kernels() {
        let x = rand_rows(21, 3, 6);
        let y = rand_rows(22, 3, 6);
        let gate = rand_rows(23, 3, 1);
        let mut want = x.clone();
        CpuBackend.add_sigmoid_gated(&mut want, &y, &gate).unwrap();
        let mut host = x.clone();
        crate::backend::add_sigmoid_gated_host(&mut host, &y, &gate);
        assert_eq!(host, want);
        let s = CpuBackend.silu(&x).unwrap();
        let d = x.mapv(|v| v / (1.0 + (-v).exp()));
        assert!(s.iter().zip(&d).all(|(a, b)| (a - b).abs() <= 1e-6));
    }

    #[test]
    fn norms_and_swiglu_match_naive_loops() {
        let b = CpuBackend;
        let x = rand_rows(1, 5, 12);
        let w = rand_rows(2, 1, 12);
        let eps = 1e-6;
        let got = b.rms_norm(&x, &w, eps).unwrap();
        let mut heads = x.clone();
        let hw = rand_rows(3, 1, 4);
        b.rms_norm_heads(&mut heads, &hw, 4, eps).unwrap();
        for r in 0..5 {
            let ms: f32 = x.row(r).iter().map(|v| v * v).sum::<f32>() / 12.0;
            for c in 0..12 {
                let want = x[[r, c]] / (ms + eps).sqrt() * w[[0, c]];
                assert!((got[[r, c]] - want).abs() < 1e-5, "rms_norm ({r},{c})");
                let g = c / 4;
                let hms: f32 = (0..4).map(|i| x[[r, g * 4 + i]].powi(2)).sum::<f32>() / 4.0;
                let want = x[[r, c]] / (hms + eps).sqrt() * hw[[0, c % 4]];
                assert!((heads[[r, c]] - want).abs() < 1e-5, "rms_norm_heads ({r},{c})");
            }
        }
        let gu = array![[1.0f32, -2.0, 3.0, 0.5]];
        let s = b.swiglu(&gu).unwrap();
        let silu = |v: f32| v / (1.0 + (-v).exp());
        let want = array![[silu(1.0) * 3.0, silu(-2.0) * 0.5]];
        assert!(s.iter().zip(&want).all(|(g, w)| (g - w).abs() <= 1e-6 * w.abs()), "{s} vs {want}");
        assert!(matches!(
            b.swiglu(&array![[1.0f32, 2.0, 3.0]]),
            Err(Error::Backend(BackendError::OpShape { op: "swiglu", .. }))
        ));
        assert!(matches!(
            b.rms_norm(&x, &hw, eps),
            Err(Error::Backend(BackendError::OpShape { op: "rms_norm", what: "weight", .. }))
        ));
    }

    #[test]
    fn matmul_matches_naive_and_rows_do_not_depend_on_their_batch() {
        let b = CpuBackend;
        // 200 weight rows: a few panels; 16384: many, split over tasks.
        for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            for n in [200, 16_384] {
                let w = b
                    .upload_weight(HostWeight::from_f32(rand_rows(5, n, 9)).to_dtype(dtype).unwrap())
                    .unwrap();
                let wide = w.to_f32();
                let x = rand_rows(4, 70, 9);
                // Beside bf16 weights the products read x rounded to bf16 (as torch does).
                let read = |v: f32| if dtype == Dtype::Bf16 { half::bf16::from_f32(v).to_f32() } else { v };
                let all = b.matmul_t(&x, &w).unwrap();
                assert_eq!(all.dim(), (70, n));
                for r in [0, 33, 69] {
                    for c in (0..n).step_by(n / 50) {
                        let want: f32 = (0..9).map(|k| read(x[[r, k]]) * wide[[c, k]]).sum();
                        assert!((all[[r, c]] - want).abs() < 1e-5, "{dtype} n {n}: ({r},{c})");
                    }
                    let alone = b.matmul_t(&x.slice(ndarray::s![r..r + 1, ..]).to_owned(), &w).unwrap();
                    assert_eq!(
                        alone.row(0),
                        all.row(r),
                        "{dtype} n {n}: row {r} alone differs from row {r} of 70"
                    );
                }
            }
        }
        let x = rand_rows(4, 70, 9);
        assert!(matches!(
            b.matmul_t(&x, &b.upload_weight(rand_rows(6, 6, 8).into()).unwrap()),
            Err(Error::Backend(BackendError::OpShape { op: "matmul_t", what: "x", .. }))
        ));
    }

    #[test]
    fn row_ops_move_the_named_rows_and_reject_bad_indices() {
        let b = CpuBackend;
        let table = Array2::from_shape_fn((6, 3), |(r, c)| (r * 10 + c) as f32);
        for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            // Small integers are exact in every dtype.
            let stored =
                b.upload_weight(HostWeight::from_f32(table.clone()).to_dtype(dtype).unwrap()).unwrap();
            let e = b.embedding(&stored, &[4, 0, 4]).unwrap();
            assert_eq!(e.row(0).to_vec(), vec![40.0, 41.0, 42.0], "{dtype}");
            assert_eq!(e.row(2), e.row(0));
            assert!(matches!(
                b.embedding(&stored, &[6]),
                Err(Error::Backend(BackendError::OpIndex { op: "embedding", index: 6, bound: 6, .. }))
            ));
        }
        let mut dst = Array2::zeros((4, 3));
        b.scatter_rows(&mut dst, &[3, 1], &b.gather_rows(&table, &[2, 5]).unwrap()).unwrap();
        assert_eq!(dst.row(3).to_vec(), vec![20.0, 21.0, 22.0]);
        assert_eq!(dst.row(1).to_vec(), vec![50.0, 51.0, 52.0]);
        assert_eq!(dst.row(0).sum(), 0.0);
        let before = dst.clone();
        let err =
            b.scatter_rows(&mut dst, &[0, 9], &table.slice(ndarray::s![..2, ..]).to_owned()).unwrap_err();
        assert!(matches!(err, Error::Backend(BackendError::OpIndex { op: "scatter_rows", index: 9, .. })));
        assert_eq!(dst, before, "a rejected scatter writes nothing");
    }

    #[test]
    fn pages_write_gather_and_copy_whole_blocks() {
        // Small integers are exact in every K/V dtype.
        for kv_dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            pages_in(kv_dtype);
        }
    }

    #[test]
    fn integer_kv_pages_are_a_config_error() {
        use crate::error::ConfigError;
        let spec = PagesSpec {
            num_layers: 1,
            num_blocks: 2,
            block_size: 2,
            kv_heads: 1,
            head_dim: 2,
            captured: 0,
            hidden: 1,
            kv_dtype: Dtype::F32,
        };
        for kv_dtype in [Dtype::U8, Dtype::I32, Dtype::I64] {
            let err = CpuBackend.alloc_pages(PagesSpec { kv_dtype, ..spec }).unwrap_err();
            assert!(
                matches!(&err, Error::Config(ConfigError::Invalid { component: "cpu backend", field: "kv dtype", found, .. }) if *found == kv_dtype.to_string()),
                "{err}"
            );
        }
        // Inside the backend, past that check, it is a broken invariant.
        let err = pages::CpuPages::new(PagesSpec { kv_dtype: Dtype::I32, ..spec }).unwrap_err();
        assert!(
            matches!(&err, Error::Invariant(v) if v.component == crate::error::Component::Storage),
            "{err}"
        );
    }

    fn pages_in(kv_dtype: Dtype) {
        let b = CpuBackend;
        let spec = PagesSpec {
            num_layers: 2,
            num_blocks: 3,
            block_size: 2,
            kv_heads: 1,
            head_dim: 2,
            captured: 2,
            hidden: 3,
            kv_dtype,
        };
        assert_eq!(spec.bytes(), 2 * 2 * 6 * 2 * kv_dtype.size_bytes() + 6 * 2 * 3 * 4);
        assert!(matches!(
            b.alloc_pages(PagesSpec { block_size: 0, ..spec }),
            Err(Error::Backend(BackendError::OpShape { what: "block_size", .. }))
        ));
        let mut pages = b.alloc_pages(spec).unwrap();
        let kv = Array2::from_shape_fn((3, 2), |(r, c)| (r * 2 + c + 1) as f32);
        b.write_kv(&mut pages, 1, &kv, &kv, &[0, -1, 1]).unwrap();
        assert_eq!(&pages.k[1].view().to_f32()[..6], &[1.0, 2.0, 5.0, 6.0, 0.0, 0.0], "slot -1 skipped");
        assert!(pages.k[0].view().to_f32().iter().all(|&v| v == 0.0), "other layers untouched");
        let h = Array2::from_shape_fn((2, 3), |(r, c)| (r * 3 + c + 1) as f32);
        b.write_hidden(&mut pages, 1, &h, &[1, 0]).unwrap();
        let got = b.gather_hidden(&pages, 1, &[0, 1, -1]).unwrap();
        assert_eq!(got.row(0).to_vec(), vec![4.0, 5.0, 6.0]);
        assert_eq!(got.row(1).to_vec(), vec![1.0, 2.0, 3.0]);
        assert_eq!(got.row(2).sum(), 0.0);
        assert_eq!(b.gather_hidden(&pages, 0, &[0]).unwrap().sum(), 0.0, "capture 0 untouched");
        b.copy_blocks(&mut pages, &[(0, 2)]).unwrap();
        assert_eq!(&pages.k[1].view().to_f32()[8..12], &[1.0, 2.0, 5.0, 6.0]);
        assert_eq!(b.gather_hidden(&pages, 1, &[4, 5]).unwrap(), got.slice(ndarray::s![..2, ..]));
        let before = pages.clone();
        assert!(matches!(
            b.copy_blocks(&mut pages, &[(0, 1), (1, 3)]),
            Err(Error::Backend(BackendError::OpIndex { what: "block", index: 3, .. }))
        ));
        assert_eq!(pages.k, before.k, "a rejected copy list copies nothing");
        assert!(matches!(
            b.write_kv(&mut pages, 0, &kv, &kv, &[0, 1, 6]),
            Err(Error::Backend(BackendError::OpIndex { what: "slot", index: 6, .. }))
        ));
        assert!(matches!(
            b.write_hidden(&mut pages, 2, &h, &[0, 1]),
            Err(Error::Backend(BackendError::OpIndex { what: "capture", .. }))
        ));
    }
}
