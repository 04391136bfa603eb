//! The Qwen MoE block, entirely on the device: router softmax + top-k, per-expert
//! lists of the routed rows, a grouped matmul over those lists, and the weighted
//! combine. Nothing is read back to the host between the router and the output.

use crate::Result;
use crate::backend::MoeWeights;
use crate::backend::wgpu::context::GpuContext;
use crate::backend::wgpu::kernel_params::{MatmulParams, MoeParams};
use crate::backend::wgpu::ops::dense::MATMUL_TILE;
use crate::backend::wgpu::pipelines::Shader;
use crate::backend::wgpu::tensor::GpuTensor;
use crate::error::BackendError;

const OP: &str = "moe";
const ROUTER_WG: u64 = 64;
const COMBINE_WG: u64 = 256;

/// Per-token routing, on the device: the chosen experts `ids [tokens, top_k]` (u32
/// bits in the buffer) and their weights `[tokens, top_k]`.
#[derive(Debug)]
pub struct Routing {
    pub ids: GpuTensor,
    pub weights: GpuTensor,
}

impl Routing {
    /// The expert ids on the host, row-major (tests and debugging; the MoE block never reads them back).
    pub fn download_ids(&self, ctx: &GpuContext) -> Result<Vec<u32>> {
        let bytes = ctx.read_buffer(ctx.whole(&self.ids, "download_ids")?, (self.ids.len() * 4) as u64)?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }
}

/// Per expert, the routing slots routed to it, on the device: `slots[e * tokens ..]`
/// holds `counts[e]` slots in ascending order.
struct ExpertLists {
    counts: GpuTensor,
    slots: GpuTensor,
    tokens: usize,
}

/// Checks the MoE weights against `x` and returns the expert intermediate size.
fn intermediate_size(x: &GpuTensor, w: &MoeWeights<GpuTensor>) -> Result<usize> {
    let (e, hidden) = (w.num_experts, x.cols);
    if w.top_k == 0 || w.top_k > e {
        return Err(BackendError::OpShape {
            op: OP,
            what: "top_k",
            expected: format!("1..={e}"),
            found: vec![w.top_k],
        }
        .into());
    }
    if w.router.rows != e {
        return Err(w.router.shape_error(OP, "router", format!("[{e}, {hidden}]")));
    }
    w.router.expect_cols(OP, "router", hidden)?;
    w.gate_up.expect_cols(OP, "gate_up", hidden)?;
    if !w.gate_up.rows.is_multiple_of(2 * e) {
        return Err(w.gate_up.shape_error(OP, "gate_up", format!("[{e} * 2I, {hidden}]")));
    }
    let inter = w.gate_up.rows / (2 * e);
    if w.down.shape() != [e * hidden, inter] {
        return Err(w.down.shape_error(OP, "down", format!("[{}, {inter}]", e * hidden)));
    }
    Ok(inter)
}

impl GpuContext {
    /// Softmax over `logits [tokens, experts]`, the `top_k` most probable experts per
    /// token (ties to the lower id), optionally renormalised to sum to one.
    pub fn router_topk(&self, logits: &GpuTensor, top_k: usize, renormalize: bool) -> Result<Routing> {
        if top_k == 0 || top_k > logits.cols {
            return Err(BackendError::OpShape {
                op: "router_topk",
                what: "top_k",
                expected: format!("1..={}", logits.cols),
                found: vec![top_k],
            }
            .into());
        }
        let weights = self.zeros([logits.rows, top_k])?;
        let ids = self.zeros([logits.rows, top_k])?; // u32 bits in an f32-sized buffer
        if logits.rows > 0 {
            let params = MoeParams {
                tokens: logits.rows as u32,
                experts: logits.cols as u32,
                top_k: top_k as u32,
                renormalize: renormalize.into(),
                width: 0,
                _pad: [0; 3],
            };
            let pipeline = self.pipeline(Shader::Moe, "router_topk", &[])?;
            let uniform = self.uniform(&params);
            let op = "router_topk";
            let bindings = [
                (0, &uniform),
                (1, self.whole(logits, op)?),
                (2, self.whole(&ids, op)?),
                (3, self.whole(&weights, op)?),
            ];
            self.dispatch("router_topk", &pipeline, &bindings, (logits.rows as u64).div_ceil(ROUTER_WG))?;
        }
        Ok(Routing { ids, weights })
    }

    /// Groups the routing slots by expert (see [`ExpertLists`]).
    fn expert_lists(&self, routing: &Routing, num_experts: usize) -> Result<ExpertLists> {
        let (tokens, top_k) = (routing.ids.rows, routing.ids.cols);
        let counts = self.zeros([1, num_experts])?;
        let slots = self.zeros([num_experts, tokens])?;
        let params = MoeParams {
            tokens: tokens as u32,
            experts: num_experts as u32,
            top_k: top_k as u32,
            renormalize: 0,
            width: 0,
            _pad: [0; 3],
        };
        let pipeline = self.pipeline(Shader::Moe, "expert_lists", &[])?;
        let uniform = self.uniform(&params);
        let op = "expert_lists";
        let bindings = [
            (0, &uniform),
            (7, self.whole(&routing.ids, op)?),
            (8, self.whole(&counts, op)?),
            (9, self.whole(&slots, op)?),
        ];
        self.dispatch("expert_lists", &pipeline, &bindings, (num_experts as u64).div_ceil(ROUTER_WG))?;
        Ok(ExpertLists { counts, slots, tokens })
    }

    /// The grouped expert matmul: for every slot `s` routed to expert `e`,
    /// `out[s] = x[s / in_div] @ w[e * n_out .. (e + 1) * n_out]^T`; `out [tokens * top_k, n_out]`.
    /// A stacked `w` larger than one binding (a real MoE layer's `gate_up`) is bound
    /// one row block at a time; each dispatch covers the experts its block holds rows
    /// of, and an expert cut by a block edge gets its columns from both.
    fn matmul_routed(
        &self, x: &GpuTensor, w: &GpuTensor, lists: &ExpertLists, in_div: usize, out: &GpuTensor,
    ) -> Result<()> {
        let num_experts = lists.counts.cols;
        let n_out = out.cols;
        debug_assert!(w.rows == num_experts * n_out && x.cols == w.cols && in_div > 0);
        if out.is_empty() {
            return Ok(());
        }
        let pipeline = self.pipeline(Shader::Matmul, "matmul_routed", &[("W_F16", w.is_f16().into())])?;
        let row_tiles = lists.tokens.div_ceil(MATMUL_TILE);
        let op = "moe expert matmul";
        for (row0, rows, block) in w.row_blocks() {
            let experts = row0 / n_out..(row0 + rows).div_ceil(n_out);
            let params = MatmulParams {
                m: lists.tokens as u32,
                n: n_out as u32,
                k: x.cols as u32,
                w_lo: row0 as u32,
                w_hi: (row0 + rows) as u32,
                e0: experts.start as u32,
                in_div: in_div as u32,
                y_stride: n_out as u32,
                y_col0: 0,
                _pad: [0; 3],
            };
            let what =
                || format!("MoE expert matmul grid ({} experts x {row_tiles} row tiles)", experts.len());
            let groups =
                self.tile_grid(n_out.div_ceil(MATMUL_TILE), experts.len().saturating_mul(row_tiles), what)?;
            let uniform = self.uniform(&params);
            let bindings = [
                (0, &uniform),
                (1, self.whole(x, op)?),
                (2, block),
                (3, self.whole(out, op)?),
                (4, self.whole(&lists.counts, op)?),
                (5, self.whole(&lists.slots, op)?),
            ];
            self.dispatch_xy(op, &pipeline, &bindings, groups)?;
        }
        Ok(())
    }

    /// `out[t] = sum_j weights[t, j] * expert_out[t * top_k + j]`.
    pub fn expert_combine(&self, weights: &GpuTensor, expert_out: &GpuTensor) -> Result<GpuTensor> {
        let (tokens, top_k) = (weights.rows, weights.cols);
        expert_out.expect_rows("expert_combine", "expert_out", tokens * top_k)?;
        let out = self.zeros([tokens, expert_out.cols])?;
        if out.is_empty() {
            return Ok(out);
        }
        let params = MoeParams {
            tokens: tokens as u32,
            experts: 0,
            top_k: top_k as u32,
            renormalize: 0,
            width: expert_out.cols as u32,
            _pad: [0; 3],
        };
        let pipeline = self.pipeline(Shader::Moe, "expert_combine", &[])?;
        let uniform = self.uniform(&params);
        let op = "expert_combine";
        let bindings = [
            (0, &uniform),
            (4, self.whole(weights, op)?),
            (5, self.whole(expert_out, op)?),
            (6, self.whole(&out, op)?),
        ];
        self.dispatch("expert_combine", &pipeline, &bindings, (out.len() as u64).div_ceil(COMBINE_WG))?;
        Ok(out)
    }

    /// The MoE block (see [`crate::backend::Backend::moe`]).
    pub fn moe(&self, x: &GpuTensor, w: &MoeWeights<GpuTensor>) -> Result<GpuTensor> {
        let inter = intermediate_size(x, w)?;
        let hidden = x.cols;
        if x.rows == 0 {
            return self.zeros([0, hidden]);
        }
        let logits = self.matmul_xwt(x, &w.router)?;
        let routing = self.router_topk(&logits, w.top_k, w.norm_topk_prob)?;
        let lists = self.expert_lists(&routing, w.num_experts)?;
        // One row per routing slot `t * top_k + j`, filled by the expert it was routed to.
        let slots = x.rows * w.top_k;
        let gate_up = self.zeros([slots, 2 * inter])?;
        self.matmul_routed(x, &w.gate_up, &lists, w.top_k, &gate_up)?;
        let act = self.swiglu(&gate_up)?;
        let expert_out = self.zeros([slots, hidden])?;
        self.matmul_routed(&act, &w.down, &lists, 1, &expert_out)?;
        self.expert_combine(&routing.weights, &expert_out)
    }
}
