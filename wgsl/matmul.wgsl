// y = x @ W^T with W in the layout of HF linear weights ([out, in], row-major).
//
//   matmul_xwt:    y[m, y_col0 + n] = sum_k x[m, k] * w[n, k]
//                  (y_col0: the output columns of one block of a weight split over
//                  several buffers).
//   matmul_routed: the grouped expert matmul of a MoE block. Expert e owns the rows
//                  e * n .. (e + 1) * n of the stacked weight and a list of routed slots
//                  expert_slots[e * m .. e * m + expert_counts[e]] (m = list capacity);
//                  for each listed slot s: y[s, :] = x[s / in_div, :] @ w_e^T.
//                  Every slot appears in exactly one list, so y is written once per row.
//                  A stacked weight larger than one binding is bound one row block at a
//                  time: the bound buffer holds its rows w_lo .. w_hi, the dispatch covers
//                  experts e0 .., and each writes only the columns whose weight rows the
//                  block holds (an expert cut by a block edge is finished by the next).
//
// 64x64 output tiles per workgroup of 16x16 invocations, each computing a 4x4 block
// (rows ty + 16 i, cols tx + 16 j); K is walked in steps of 16 through workgroup memory.
// The entry points only differ in which x row feeds, and which y row receives, each tile row.
//
// W_F16: w holds f16 pairs (see f16_pairs.wgsl, the prelude); otherwise f32 bits.
// Either way the product accumulates in f32.

const TM: u32 = 64u;
const TN: u32 = 64u;
const TK: u32 = 16u;
const NO_ROW: u32 = 0xffffffffu;

override W_F16: bool = false;

// p: MatmulParams (uniform, binding 0), declared once in src/backend/wgpu/kernel_params.rs
// and composed before this file.
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<u32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
// matmul_routed
@group(0) @binding(4) var<storage, read> expert_counts: array<u32>;
@group(0) @binding(5) var<storage, read> expert_slots: array<u32>;

var<workgroup> x_tile: array<f32, 1024>; // [TM][TK]
var<workgroup> w_tile: array<f32, 1024>; // [TN][TK]
// The x row and the y row of each of the tile's TM rows (NO_ROW: padding).
var<workgroup> x_rows: array<u32, 64>;
var<workgroup> y_rows: array<u32, 64>;

// Element i of w as f32.
fn w_at(i: u32) -> f32 {
    if (W_F16) {
        return unpack_f16_pair(w[i >> 1u])[i & 1u];
    }
    return bitcast<f32>(w[i]);
}

// Whether weight row `row` is in the bound buffer.
fn w_row_bound(row: u32) -> bool {
    return row >= p.w_lo && row < p.w_hi;
}

// The 4x4 block of this invocation of tile rows x_rows x weight rows w_row0 + col0 ..,
// after x_rows / y_rows are set and a barrier (rows outside the bound buffer read 0).
fn tile_product(lid: vec3<u32>, li: u32, col0: u32, w_row0: u32) -> array<f32, 16> {
    var acc: array<f32, 16>;
    for (var k0 = 0u; k0 < p.k; k0 += TK) {
        for (var t = 0u; t < 4u; t++) {
            let e = li + t * 256u;
            let r = e / TK;
            let c = k0 + e % TK;
            var xv = 0.0;
            let xr = x_rows[r];
            if (xr != NO_ROW && c < p.k) {
                xv = x[xr * p.k + c];
            }
            x_tile[e] = xv;
            var wv = 0.0;
            let w_row = w_row0 + col0 + r;
            if (col0 + r < p.n && c < p.k && w_row_bound(w_row)) {
                wv = w_at((w_row - p.w_lo) * p.k + c);
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
    return acc;
}

// Stores the columns of the tile whose weight rows (w_row0 + column) the buffer holds.
fn store_tile(acc: array<f32, 16>, lid: vec3<u32>, col0: u32, w_row0: u32) {
    for (var i = 0u; i < 4u; i++) {
        let r = y_rows[lid.y + 16u * i];
        for (var j = 0u; j < 4u; j++) {
            let c = col0 + lid.x + 16u * j;
            if (r != NO_ROW && c < p.n && w_row_bound(w_row0 + c)) {
                y[r * p.y_stride + p.y_col0 + c] = acc[i * 4u + j];
            }
        }
    }
}

@compute @workgroup_size(16, 16)
fn matmul_xwt(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    if (li < TM) {
        let r = wid.y * TM + li;
        let row = select(NO_ROW, r, r < p.m);
        x_rows[li] = row;
        y_rows[li] = row;
    }
    workgroupBarrier();
    let col0 = wid.x * TN;
    store_tile(tile_product(lid, li, col0, 0u), lid, col0, 0u);
}

// Workgroup grid: x over column tiles, y over (expert - e0, row tile of its list).
@compute @workgroup_size(16, 16)
fn matmul_routed(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row_tiles = (p.m + TM - 1u) / TM;
    let e = p.e0 + wid.y / row_tiles;
    let row0 = (wid.y % row_tiles) * TM;
    let count = expert_counts[e];
    // Tiles past the end of an expert's list have nothing to do (uniform per workgroup).
    if (row0 >= count) {
        return;
    }
    if (li < TM) {
        var xr = NO_ROW;
        var yr = NO_ROW;
        if (row0 + li < count) {
            yr = expert_slots[e * p.m + row0 + li];
            xr = yr / p.in_div;
        }
        x_rows[li] = xr;
        y_rows[li] = yr;
    }
    workgroupBarrier();
    let col0 = wid.x * TN;
    store_tile(tile_product(lid, li, col0, e * p.n), lid, col0, e * p.n);
}
