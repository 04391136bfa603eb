//! Dense ops of a forward: `x @ W^T`, bias and residual adds, RMSNorm (rows and
//! per head), SwiGLU.

use crate::Result;
use crate::backend::wgpu::context::GpuContext;
use crate::backend::wgpu::kernel_params::{EwParams, MatmulParams, NormParams};
use crate::backend::wgpu::pipelines::Shader;
use crate::backend::wgpu::tensor::GpuTensor;

/// Rows and columns of one matmul output tile (`TM`, `TN` in `matmul.wgsl`).
pub(crate) const MATMUL_TILE: usize = 64;
const ELEMENTWISE_WG: u64 = 256;

impl GpuContext {
    /// `x @ w^T`: `x [n, in]`, `w [out, in]` (HF Linear layout, f32 or f16) → `[n, out]`,
    /// accumulated in f32.
    /// A split `w` (larger than one binding) is multiplied block by block, each
    /// block writing its own columns of the output.
    pub fn matmul_xwt(&self, x: &GpuTensor, w: &GpuTensor) -> Result<GpuTensor> {
        x.expect_cols("matmul_t", "x", w.cols)?;
        let y = self.zeros([x.rows, w.rows])?;
        if y.is_empty() {
            return Ok(y);
        }
        let x_buffer = self.whole(x, "matmul_t")?;
        for (row0, rows, w_block) in w.row_blocks() {
            self.matmul_block(x, x_buffer, (w, w_block, rows), &y, row0)?;
        }
        Ok(y)
    }

    /// `y[:, y_col0 .. y_col0 + n_out] = x @ w_block^T` for a block of `n_out` rows of `w`.
    fn matmul_block(
        &self, x: &GpuTensor, x_buffer: &wgpu::Buffer,
        (w, w_block, n_out): (&GpuTensor, &wgpu::Buffer, usize), y: &GpuTensor, y_col0: usize,
    ) -> Result<()> {
        let params = MatmulParams {
            m: x.rows as u32,
            n: n_out as u32,
            k: x.cols as u32,
            w_lo: 0,
            w_hi: n_out as u32,
            e0: 0,
            in_div: 1,
            y_stride: y.cols as u32,
            y_col0: y_col0 as u32,
            _pad: [0; 3],
        };
        let pipeline = self.pipeline(Shader::Matmul, "matmul_xwt", &[("W_F16", w.is_f16().into())])?;
        let uniform = self.uniform(&params);
        let what = || format!("matmul [{}, {}] x [{n_out}, {}]^T workgroup grid", x.rows, x.cols, x.cols);
        let groups = self.tile_grid(n_out.div_ceil(MATMUL_TILE), x.rows.div_ceil(MATMUL_TILE), what)?;
        let bindings = [(0, &uniform), (1, x_buffer), (2, w_block), (3, self.whole(y, "matmul_t")?)];
        self.dispatch_xy("matmul_t", &pipeline, &bindings, groups)
    }

    /// A 2-D workgroup grid, or [`GpuError::TooLarge`](crate::error::GpuError::TooLarge) naming `what` when a side
    /// exceeds the adapter's workgroups per dimension.
    pub(crate) fn tile_grid(&self, x: usize, y: usize, what: impl FnOnce() -> String) -> Result<(u32, u32)> {
        let max = self.limits.max_compute_workgroups_per_dimension;
        match (u32::try_from(x), u32::try_from(y)) {
            (Ok(gx), Ok(gy)) if gx <= max && gy <= max => Ok((gx, gy)),
            _ => Err(crate::error::GpuError::TooLarge {
                adapter: self.adapter_name.clone(),
                what: what(),
                requested: x.max(y) as u64,
                limit: "max_compute_workgroups_per_dimension",
                max: max.into(),
            }
            .into()),
        }
    }

    /// One in-place elementwise entry of `elementwise.wgsl` over `len` outputs.
    fn elementwise(
        &self, op: &'static str, entry: &'static str, acc: &GpuTensor, rhs: &GpuTensor, width: usize,
    ) -> Result<()> {
        let len = acc.len();
        if len == 0 {
            return Ok(());
        }
        let pipeline = self.pipeline(Shader::Elementwise, entry, &[])?;
        let uniform = self.uniform(&EwParams { len: len as u32, width: width as u32, _pad: [0; 2] });
        let bindings = [(0, &uniform), (1, self.whole(acc, op)?), (2, self.whole(rhs, op)?)];
        self.dispatch(op, &pipeline, &bindings, (len as u64).div_ceil(ELEMENTWISE_WG))
    }

    /// `x[i, j] += bias[0, j]`.
    pub fn add_bias(&self, x: &GpuTensor, bias: &GpuTensor) -> Result<()> {
        bias.expect_rows("add_bias", "bias", 1)?;
        bias.expect_cols("add_bias", "bias", x.cols)?;
        self.elementwise("add_bias", "bias_add", x, bias, x.cols)
    }

    /// `x += y` (residual add), same shapes.
    pub fn add_assign(&self, x: &GpuTensor, y: &GpuTensor) -> Result<()> {
        y.expect_rows("add", "y", x.rows)?;
        y.expect_cols("add", "y", x.cols)?;
        self.elementwise("add", "add_assign", x, y, x.cols)
    }

    /// `silu(gate) * up` of a fused `gate_up [n, 2I]` (gate columns first) → `[n, I]`.
    pub fn swiglu(&self, gate_up: &GpuTensor) -> Result<GpuTensor> {
        if !gate_up.cols.is_multiple_of(2) {
            return Err(gate_up.shape_error("swiglu", "gate_up", "[n, 2I]".into()));
        }
        let out = self.zeros([gate_up.rows, gate_up.cols / 2])?;
        self.elementwise("swiglu", "swiglu", &out, gate_up, gate_up.cols / 2)?;
        Ok(out)
    }

    /// RMSNorm of whole rows: `x [n, d]`, `w [1, d]` → `[n, d]`.
    pub fn rms_norm(&self, x: &GpuTensor, w: &GpuTensor, eps: f32) -> Result<GpuTensor> {
        w.expect_rows("rms_norm", "weight", 1)?;
        w.expect_cols("rms_norm", "weight", x.cols)?;
        self.rms_norm_groups(x, w, x.cols, eps)
    }

    /// RMSNorm of each `head_dim` group of columns (Qwen3 qk-norm): `w [1, head_dim]`.
    pub fn rms_norm_heads(
        &self, x: &GpuTensor, w: &GpuTensor, head_dim: usize, eps: f32,
    ) -> Result<GpuTensor> {
        w.expect_rows("rms_norm_heads", "weight", 1)?;
        w.expect_cols("rms_norm_heads", "weight", head_dim)?;
        if head_dim == 0 || !x.cols.is_multiple_of(head_dim) {
            return Err(x.shape_error("rms_norm_heads", "x", format!("[n, k * {head_dim}]")));
        }
        self.rms_norm_groups(x, w, head_dim, eps)
    }

    fn rms_norm_groups(&self, x: &GpuTensor, w: &GpuTensor, dim: usize, eps: f32) -> Result<GpuTensor> {
        let y = self.zeros(x.shape())?;
        let rows = x.len().checked_div(dim).unwrap_or(0);
        if rows == 0 {
            return Ok(y);
        }
        let pipeline = self.pipeline(Shader::RmsNorm, "rms_norm", &[])?;
        let uniform = self.uniform(&NormParams { rows: rows as u32, dim: dim as u32, eps, _pad: 0 });
        let op = "rms_norm";
        let bindings =
            [(0, &uniform), (1, self.whole(x, op)?), (2, self.whole(w, op)?), (3, self.whole(&y, op)?)];
        self.dispatch("rms_norm", &pipeline, &bindings, rows as u64)?;
        Ok(y)
    }
}
