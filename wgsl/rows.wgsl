// Dense row gather and scatter by index (indices validated on the host; out-of-range
// indices are skipped here as a second line of defence):
//   gather_dense:  dst[r, :] = src[idx[r], :]   (embedding lookup; tokens routed to an expert)
//   scatter_dense: dst[idx[r], :] = src[r, :]   (item embedding rows into the step's inputs)
// SRC_F16: src holds f16 pairs (an f16 embedding table; see f16_pairs.wgsl, the prelude);
// otherwise f32 bits. dst is always f32.

const WG: u32 = 256u;

override SRC_F16: bool = false;

// p: DenseRowParams (uniform, binding 0), declared once in src/backend/wgpu/kernel_params.rs
// and composed before this file.
@group(0) @binding(1) var<storage, read> idx: array<u32>;
@group(0) @binding(2) var<storage, read> src: array<u32>;
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;

// Element i of src as f32.
fn src_at(i: u32) -> f32 {
    if (SRC_F16) {
        return unpack_f16_pair(src[i >> 1u])[i & 1u];
    }
    return bitcast<f32>(src[i]);
}

@compute @workgroup_size(WG)
fn gather_dense(inv: Invocation) {
    let e = flat_index(inv);
    if (e >= p.n_rows * p.width) {
        return;
    }
    let r = e / p.width;
    let src_row = idx[r];
    if (src_row < p.src_rows) {
        dst[e] = src_at(src_row * p.width + e % p.width);
    }
}

@compute @workgroup_size(WG)
fn scatter_dense(inv: Invocation) {
    let e = flat_index(inv);
    if (e >= p.n_rows * p.width) {
        return;
    }
    let r = e / p.width;
    let dst_row = idx[r];
    if (dst_row < p.dst_rows) {
        dst[dst_row * p.width + e % p.width] = src_at(e);
    }
}
