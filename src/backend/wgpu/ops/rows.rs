//! Dense row movement by index: embedding lookup, gather, scatter.

use crate::Result;
use crate::backend::wgpu::context::GpuContext;
use crate::backend::wgpu::kernel_params::DenseRowParams;
use crate::backend::wgpu::pipelines::Shader;
use crate::backend::wgpu::tensor::GpuTensor;
use crate::error::BackendError;

const ROWS_WG: u64 = 256;

/// Checks every index lies in `0..bound`.
fn check_indices(op: &'static str, what: &'static str, indices: &[u32], bound: usize) -> Result<()> {
    match indices.iter().find(|&&i| i as usize >= bound) {
        Some(&i) => Err(BackendError::OpIndex { op, what, index: i.into(), bound }.into()),
        None => Ok(()),
    }
}

impl GpuContext {
    fn move_rows(
        &self, op: &'static str, entry: &'static str, src: &GpuTensor, indices: &[u32], dst: &GpuTensor,
    ) -> Result<()> {
        let src_buffer = self.whole(src, op)?;
        self.move_rows_of(op, entry, (src_buffer, src.rows, src.cols, false), indices, dst)
    }

    /// [`Self::move_rows`] with the source given as `(buffer, rows, cols, f16)`: one
    /// row block of a split (or f16) table. Indices at or past `rows` are skipped by the kernel.
    fn move_rows_of(
        &self, op: &'static str, entry: &'static str,
        (src, src_rows, cols, src_f16): (&wgpu::Buffer, usize, usize, bool), indices: &[u32],
        dst: &GpuTensor,
    ) -> Result<()> {
        if indices.is_empty() || cols == 0 {
            return Ok(());
        }
        let pipeline = self.pipeline(Shader::Rows, entry, &[("SRC_F16", src_f16.into())])?;
        let params = DenseRowParams {
            n_rows: indices.len() as u32,
            width: cols as u32,
            src_rows: src_rows as u32,
            dst_rows: dst.rows as u32,
        };
        let uniform = self.uniform(&params);
        let index_buffer = self.storage_from("row indices", indices)?;
        let bindings = [(0, &uniform), (1, &index_buffer), (2, src), (3, self.whole(dst, op)?)];
        self.dispatch(op, &pipeline, &bindings, ((indices.len() * cols) as u64).div_ceil(ROWS_WG))
    }

    /// `out[i] = x[rows[i]]` → `[rows.len(), cols]`.
    pub fn gather_rows(&self, x: &GpuTensor, rows: &[u32]) -> Result<GpuTensor> {
        check_indices("gather_rows", "row", rows, x.rows)?;
        let out = self.zeros([rows.len(), x.cols])?;
        self.move_rows("gather_rows", "gather_dense", x, rows, &out)?;
        Ok(out)
    }

    /// `out[i] = table[ids[i]]` (token embedding lookup; the table f32 or f16).
    pub fn embedding(&self, table: &GpuTensor, ids: &[u32]) -> Result<GpuTensor> {
        check_indices("embedding", "token id", ids, table.rows)?;
        let out = self.zeros([ids.len(), table.cols])?;
        // A split table: each row block gathers the ids that fall in it (block-local
        // ids; the others are out of its range and skipped).
        for (row0, rows, block) in table.row_blocks() {
            let local: Vec<u32> = ids
                .iter()
                .map(|&id| (id as usize).checked_sub(row0).map_or(u32::MAX, |i| i as u32))
                .collect();
            self.move_rows_of(
                "embedding",
                "gather_dense",
                (block, rows, table.cols, table.is_f16()),
                &local,
                &out,
            )?;
        }
        Ok(out)
    }

    /// `dst[rows[i]] = src[i]` (item embedding rows into the step's inputs).
    pub fn scatter_rows(&self, dst: &GpuTensor, rows: &[u32], src: &GpuTensor) -> Result<()> {
        src.expect_rows("scatter_rows", "src", rows.len())?;
        src.expect_cols("scatter_rows", "src", dst.cols)?;
        check_indices("scatter_rows", "row", rows, dst.rows)?;
        self.move_rows("scatter_rows", "scatter_dense", src, rows, dst)
    }
}
