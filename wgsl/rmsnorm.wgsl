// y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight   (f32, Qwen RMSNorm).
// Whole hidden rows use dim = hidden; per-head qk-norm views [n, heads * head_dim] as
// n * heads rows of dim = head_dim with a head_dim weight.

const WG: u32 = 64u;

// p: NormParams (uniform, binding 0), declared once in src/backend/wgpu/kernel_params.rs
// and composed before this file.
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(WG)
fn rms_norm(inv: Invocation) {
    let lid = inv.lid;
    let r = workgroup_index(inv);
    if (r >= p.rows) {
        return;
    }
    let base = r * p.dim;
    var ss = 0.0;
    for (var d = lid; d < p.dim; d += WG) {
        let v = x[base + d];
        ss += v * v;
    }
    partial[lid] = ss;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride) {
            partial[lid] += partial[lid + stride];
        }
        workgroupBarrier();
    }
    let inv_rms = inverseSqrt(partial[0] / f32(p.dim) + p.eps);
    for (var d = lid; d < p.dim; d += WG) {
        y[base + d] = x[base + d] * inv_rms * weight[d];
    }
}
