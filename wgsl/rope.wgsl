// Rotary embedding in place on x [n, heads * head_dim], rotate-half pairs (d, d + head_dim/2).
//
// positions: [3, n] i32 rows (temporal, height, width); plain RoPE reads row 0 only.
// inv_freq: [head_dim / 2], computed once on the host (the same f32 values the CPU uses).
// Which position row drives frequency i:
//   mode 0 (plain):        row 0
//   mode 1 (interleaved, Qwen3-Omni apply_interleaved_mrope): row 1 if i % 3 == 1 and
//          i < 3 * sec1; row 2 if i % 3 == 2 and i < 3 * sec2; else row 0
//   mode 2 (sectioned, Qwen2-VL): row 0 for i < sec0, row 1 for i < sec0 + sec1, else row 2

const WG: u32 = 256u;

// p: RopeParams (uniform, binding 0), declared once in src/backend/wgpu/kernel_params.rs
// and composed before this file.
@group(0) @binding(1) var<storage, read> positions: array<i32>;
@group(0) @binding(2) var<storage, read> inv_freq: array<f32>;
@group(0) @binding(3) var<storage, read_write> x: array<f32>;

fn position_row(i: u32) -> u32 {
    if (p.mode == 1u) {
        if (i % 3u == 1u && i < 3u * p.sec1) {
            return 1u;
        }
        if (i % 3u == 2u && i < 3u * p.sec2) {
            return 2u;
        }
        return 0u;
    }
    if (p.mode == 2u) {
        if (i < p.sec0) {
            return 0u;
        }
        if (i < p.sec0 + p.sec1) {
            return 1u;
        }
        return 2u;
    }
    return 0u;
}

@compute @workgroup_size(WG)
fn rope(inv: Invocation) {
    let half = p.head_dim / 2u;
    let idx = flat_index(inv);
    if (idx >= p.n * p.heads * half) {
        return;
    }
    let i = idx % half;
    let head_row = idx / half; // token * heads + head
    let token = head_row / p.heads;
    let pos = f32(positions[position_row(i) * p.n + token]);
    let angle = pos * inv_freq[i];
    let c = cos(angle);
    let s = sin(angle);
    let base = head_row * p.head_dim;
    let x1 = x[base + i];
    let x2 = x[base + i + half];
    x[base + i] = x1 * c - x2 * s;
    x[base + i + half] = x2 * c + x1 * s;
}
