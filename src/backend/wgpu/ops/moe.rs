//! The Qwen MoE block: router softmax + top-k on the device, experts run over the
//! rows routed to them, results combined with the routing weights.

use bytemuck::{Pod, Zeroable};

use crate::backend::MoeWeights;
use crate::backend::wgpu::context::GpuContext;
use crate::backend::wgpu::pipelines::Shader;
use crate::backend::wgpu::tensor::GpuTensor;
use crate::{Error, Result};

const OP: &str = "moe";
const ROUTER_WG: u64 = 64;
const COMBINE_WG: u64 = 256;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct MoeParams {
    tokens: u32,
    experts: u32,
    top_k: u32,
    renormalize: u32,
    width: u32,
    _pad: [u32; 3],
}

/// Per-token routing: `ids[t * top_k + j]` and `weights [tokens, top_k]`.
#[derive(Debug)]
pub struct Routing {
    pub ids: Vec<u32>,
    pub weights: GpuTensor,
}

/// Checks the MoE weights against `x` and returns the expert intermediate size.
fn intermediate_size(x: &GpuTensor, w: &MoeWeights<GpuTensor>) -> Result<usize> {
    let (e, hidden) = (w.num_experts, x.cols);
    if w.top_k == 0 || w.top_k > e {
        return Err(Error::OpShape { op: OP, what: "top_k", expected: format!("1..={e}"), found: vec![w.top_k] });
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
            return Err(Error::OpShape {
                op: "router_topk",
                what: "top_k",
                expected: format!("1..={}", logits.cols),
                found: vec![top_k],
            });
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
            let bindings = [(0, &uniform), (1, &logits.buffer), (2, &ids.buffer), (3, &weights.buffer)];
            self.dispatch("router_topk", &pipeline, &bindings, (logits.rows as u64).div_ceil(ROUTER_WG))?;
        }
        let id_bytes = self.read_buffer(&ids.buffer, (ids.len() * 4) as u64)?;
        Ok(Routing { ids: bytemuck::pod_collect_to_vec(&id_bytes), weights })
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
        let bindings = [(0, &uniform), (4, &weights.buffer), (5, &expert_out.buffer), (6, &out.buffer)];
        self.dispatch("expert_combine", &pipeline, &bindings, (out.len() as u64).div_ceil(COMBINE_WG))?;
        Ok(out)
    }

    /// The MoE block (see [`crate::backend::Backend::moe`]).
    pub fn moe(&self, x: &GpuTensor, w: &MoeWeights<GpuTensor>) -> Result<GpuTensor> {
        let inter = intermediate_size(x, w)?;
        let hidden = x.cols;
        let logits = self.matmul_xwt(x, &w.router)?;
        let routing = self.router_topk(&logits, w.top_k, w.norm_topk_prob)?;
        // Rows of the [tokens * top_k, hidden] expert output each expert fills.
        let mut routed: Vec<(Vec<u32>, Vec<u32>)> = vec![(Vec::new(), Vec::new()); w.num_experts];
        for (slot, &expert) in routing.ids.iter().enumerate() {
            let Some((tokens, slots)) = routed.get_mut(expert as usize) else {
                return Err(Error::OpIndex {
                    op: OP,
                    what: "routed expert",
                    index: expert.into(),
                    bound: w.num_experts,
                });
            };
            tokens.push((slot / w.top_k) as u32);
            slots.push(slot as u32);
        }
        let expert_out = self.zeros([x.rows * w.top_k, hidden])?;
        for (expert, (tokens, slots)) in routed.iter().enumerate().filter(|(_, r)| !r.0.is_empty()) {
            let xs = self.gather_rows(x, tokens)?;
            let gate_up = self.matmul_rows(&xs, &w.gate_up, expert * 2 * inter, 2 * inter)?;
            let act = self.swiglu(&gate_up)?;
            let y = self.matmul_rows(&act, &w.down, expert * hidden, hidden)?;
            self.scatter_rows(&expert_out, slots, &y)?;
        }
        self.expert_combine(&routing.weights, &expert_out)
    }
}
