//! The CPU reference backend: ndarray matrices, matrixmultiply products split
//! over rayon, attention parallel over (sequence, head).
//!
//! Every op here is the semantic reference the GPU backend is tested against.

mod attention;
mod check;
mod moe;
mod pages;
mod rope;

use ndarray::{Array2, ArrayView2, Axis, linalg::general_mat_mul, parallel::prelude::*};

use crate::Result;
use crate::backend::{AttnHeads, AttnSeq, Backend, MoeWeights, PagesSpec, RopePositions, RopeSpec};
use crate::index::BlockId;
use check::{expect_cols, expect_rows, row_index};
pub use pages::CpuPages;

/// Rows per parallel task of a matrix product.
const MATMUL_ROW_CHUNK: usize = 32;

/// The ndarray reference backend.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

impl CpuBackend {
    /// A CPU backend (uses rayon's global pool).
    pub fn new() -> Self {
        CpuBackend
    }
}

/// `x @ w^T`, rows split over rayon tasks (each row's result does not depend on the split).
pub(crate) fn matmul_t(x: ArrayView2<'_, f32>, w: ArrayView2<'_, f32>) -> Array2<f32> {
    let mut out = Array2::zeros((x.nrows(), w.nrows()));
    if x.nrows() <= MATMUL_ROW_CHUNK {
        general_mat_mul(1.0, &x, &w.t(), 0.0, &mut out);
    } else {
        out.axis_chunks_iter_mut(Axis(0), MATMUL_ROW_CHUNK)
            .into_par_iter()
            .zip(x.axis_chunks_iter(Axis(0), MATMUL_ROW_CHUNK).into_par_iter())
            .for_each(|(mut o, xc)| general_mat_mul(1.0, &xc, &w.t(), 0.0, &mut o));
    }
    out
}

/// `x * sigmoid(x)`.
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `silu(gate) * up` of a fused `[n, 2I]` product.
pub(crate) fn swiglu(gate_up: ArrayView2<'_, f32>) -> Array2<f32> {
    let inter = gate_up.ncols() / 2;
    let (gate, up) = gate_up.split_at(Axis(1), inter);
    let mut out = gate.to_owned();
    out.zip_mut_with(&up, |g, &u| *g = silu(*g) * u);
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

    fn shape(&self, t: &Array2<f32>) -> [usize; 2] {
        [t.nrows(), t.ncols()]
    }

    fn alloc_pages(&self, spec: PagesSpec) -> Result<CpuPages> {
        Ok(CpuPages::new(spec))
    }

    fn pages_spec(&self, pages: &CpuPages) -> PagesSpec {
        pages.spec
    }

    fn embedding(&self, table: &Array2<f32>, ids: &[u32]) -> Result<Array2<f32>> {
        let rows: Vec<u32> = ids.to_vec();
        self.gather_rows(table, &rows).map_err(|e| match e {
            crate::Error::OpIndex { index, bound, .. } => {
                crate::Error::OpIndex { op: "embedding", what: "token id", index, bound }
            }
            other => other,
        })
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

    fn matmul_t(&self, x: &Array2<f32>, w: &Array2<f32>) -> Result<Array2<f32>> {
        expect_cols("matmul_t", "x", x, w.ncols())?;
        Ok(matmul_t(x.view(), w.view()))
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
        if head_dim == 0 || x.ncols() % head_dim != 0 {
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
        if gate_up.ncols() % 2 != 0 {
            return Err(check::shape_error("swiglu", "gate_up", "[n, 2I]".into(), gate_up));
        }
        Ok(swiglu(gate_up.view()))
    }

    fn moe(&self, x: &Array2<f32>, w: &MoeWeights<Array2<f32>>) -> Result<Array2<f32>> {
        moe::forward(x, w)
    }

    fn write_kv(
        &self,
        pages: &mut CpuPages,
        layer: usize,
        k: &Array2<f32>,
        v: &Array2<f32>,
        slots: &[i64],
    ) -> Result<()> {
        pages.write_kv(layer, k, v, slots)
    }

    fn paged_attention(
        &self,
        q: &Array2<f32>,
        pages: &CpuPages,
        layer: usize,
        heads: AttnHeads,
        seqs: &[AttnSeq<'_>],
    ) -> Result<Array2<f32>> {
        attention::paged_attention(q, pages, layer, heads, seqs)
    }

    fn write_hidden(&self, pages: &mut CpuPages, capture: usize, x: &Array2<f32>, slots: &[i64]) -> Result<()> {
        pages.write_hidden(capture, x, slots)
    }

    fn gather_hidden(&self, pages: &CpuPages, capture: usize, slots: &[i64]) -> Result<Array2<f32>> {
        pages.gather_hidden(capture, slots)
    }

    fn copy_blocks(&self, pages: &mut CpuPages, copies: &[(BlockId, BlockId)]) -> Result<()> {
        pages.copy_blocks(copies)
    }
}
