// y[m, n] = sum_k x[m, k] * w[w_row0 + n, k]   (x @ W^T, the layout of HF linear weights;
// w_row0 selects a row block of a stacked weight, e.g. one expert of a MoE layer).
//
// 64x64 output tiles per workgroup of 16x16 invocations, each computing a 4x4 block
// (rows ty + 16 i, cols tx + 16 j); K is walked in steps of 16 through workgroup memory.

struct MatmulParams {
    m: u32,
    n: u32,
    k: u32,
    w_row0: u32,
}

const TM: u32 = 64u;
const TN: u32 = 64u;
const TK: u32 = 16u;

@group(0) @binding(0) var<uniform> p: MatmulParams;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

var<workgroup> x_tile: array<f32, 1024>; // [TM][TK]
var<workgroup> w_tile: array<f32, 1024>; // [TN][TK]

@compute @workgroup_size(16, 16)
fn matmul_xwt(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row0 = wid.y * TM;
    let col0 = wid.x * TN;
    var acc: array<f32, 16>;
    for (var k0 = 0u; k0 < p.k; k0 += TK) {
        for (var t = 0u; t < 4u; t++) {
            let e = li + t * 256u;
            let r = e / TK;
            let c = k0 + e % TK;
            var xv = 0.0;
            if (row0 + r < p.m && c < p.k) {
                xv = x[(row0 + r) * p.k + c];
            }
            x_tile[e] = xv;
            var wv = 0.0;
            if (col0 + r < p.n && c < p.k) {
                wv = w[(p.w_row0 + col0 + r) * p.k + c];
            }
            w_tile[e] = wv;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk++) {
            var xs: array<f32, 4>;
            var ws: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                xs[i] = x_tile[(lid.y + 16u * i) * TK + kk];
                ws[i] = w_tile[(lid.x + 16u * i) * TK + kk];
            }
            for (var i = 0u; i < 4u; i++) {
                for (var j = 0u; j < 4u; j++) {
                    acc[i * 4u + j] += xs[i] * ws[j];
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let r = row0 + lid.y + 16u * i;
        for (var j = 0u; j < 4u; j++) {
            let c = col0 + lid.x + 16u * j;
            if (r < p.m && c < p.n) {
                y[r * p.n + c] = acc[i * 4u + j];
            }
        }
    }
}
