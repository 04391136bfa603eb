// In-place elementwise ops on acc with a second operand rhs:
//   add_assign: acc[i] += rhs[i]                (residual add)
//   bias_add:   acc[i] += rhs[i % width]        (linear bias over rows of `width`)
//   swiglu:     acc[r, c] = silu(rhs[r, c]) * rhs[r, width + c]
//               (rhs = fused gate/up product [rows, 2 * width], gate columns first;
//                acc = output [rows, width])

const WG: u32 = 256u;

// p: EwParams (uniform, binding 0), declared once in src/backend/wgpu/kernel_params.rs
// and composed before this file.
@group(0) @binding(1) var<storage, read_write> acc: array<f32>;
@group(0) @binding(2) var<storage, read> rhs: array<f32>;

@compute @workgroup_size(WG)
fn add_assign(inv: Invocation) {
    let i = flat_index(inv);
    if (i < p.len) {
        acc[i] += rhs[i];
    }
}

@compute @workgroup_size(WG)
fn bias_add(inv: Invocation) {
    let i = flat_index(inv);
    if (i < p.len) {
        acc[i] += rhs[i % p.width];
    }
}

@compute @workgroup_size(WG)
fn swiglu(inv: Invocation) {
    let i = flat_index(inv);
    if (i < p.len) {
        let base = (i / p.width) * 2u * p.width + i % p.width;
        let g = rhs[base];
        acc[i] = g / (1.0 + exp(-g)) * rhs[base + p.width];
    }
}
