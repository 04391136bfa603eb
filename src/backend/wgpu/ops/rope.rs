//! Rotary embedding (plain, sectioned and interleaved M-RoPE) in place.

use crate::Result;
use crate::backend::wgpu::context::GpuContext;
use crate::backend::wgpu::kernel_params::RopeParams;
use crate::backend::wgpu::pipelines::Shader;
use crate::backend::wgpu::tensor::GpuTensor;
use crate::backend::{RopeKind, RopePositions, RopeSpec};
use crate::error::BackendError;

const ROPE_WG: u64 = 256;

/// The kernel's mode number and sections.
fn mode(kind: RopeKind) -> (u32, [usize; 3]) {
    match kind {
        RopeKind::Plain => (0, [0; 3]),
        RopeKind::Interleaved(s) => (1, s),
        RopeKind::Sectioned(s) => (2, s),
    }
}

impl GpuContext {
    /// Rotates every head of `x [n, heads * head_dim]` in place by its row's positions
    /// (see [`crate::backend::Backend::rope`]).
    pub fn rope(&self, x: &GpuTensor, spec: &RopeSpec, pos: RopePositions<'_>) -> Result<()> {
        let hd = spec.head_dim;
        if hd == 0 || !hd.is_multiple_of(2) || !x.cols.is_multiple_of(hd) {
            return Err(x.shape_error("rope", "x", format!("[n, heads * {hd}] with even head_dim")));
        }
        let mut positions = Vec::with_capacity(3 * x.rows);
        for (what, axis) in [("positions.t", pos.t), ("positions.h", pos.h), ("positions.w", pos.w)] {
            if axis.len() != x.rows {
                return Err(BackendError::OpShape {
                    op: "rope",
                    what,
                    expected: format!("[{}]", x.rows),
                    found: vec![axis.len()],
                }
                .into());
            }
            for &p in axis {
                let p32 = i32::try_from(p).map_err(|_| BackendError::OpIndex {
                    op: "rope",
                    what,
                    index: p,
                    bound: i32::MAX as usize,
                })?;
                positions.push(p32);
            }
        }
        let half = hd / 2;
        if x.is_empty() {
            return Ok(());
        }
        let inv_freq: Vec<f32> = (0..half).map(|i| spec.inv_freq(i)).collect();
        let (mode, sections) = mode(spec.kind);
        let params = RopeParams {
            n: x.rows as u32,
            heads: (x.cols / hd) as u32,
            head_dim: hd as u32,
            mode,
            sec: sections.map(|s| s.min(half) as u32),
            _pad: 0,
        };
        let pipeline = self.pipeline(Shader::Rope, "rope", &[])?;
        let uniform = self.uniform(&params);
        let pos_buffer = self.storage_from("rope positions", &positions)?;
        let freq_buffer = self.storage_from("rope inv_freq", &inv_freq)?;
        let bindings = [(0, &uniform), (1, &pos_buffer), (2, &freq_buffer), (3, self.whole(x, "rope")?)];
        self.dispatch("rope", &pipeline, &bindings, ((x.len() / 2) as u64).div_ceil(ROPE_WG))
    }
}
