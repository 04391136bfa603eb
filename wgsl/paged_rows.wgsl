// Row movement between dense row-major tensors and one chunk of a paged pool.
//
// A pool holds `slots` of `slot_stride` f32 each (`slot = block * block_size + offset`);
// large pools are split into chunks of whole blocks, each its own buffer, and the host
// dispatches once per chunk: only slots in `slot_base .. slot_base + slot_count` land in
// the bound chunk. A negative slot means "skip this row".
//   write_kv:     rows [n, kv_heads * head_dim], slot_stride = kv_heads * head_dim
//   write_hidden: rows [n, hidden], slot_stride = captured * hidden, slot_offset = layer * hidden
// An f16 pool (K/V pages) holds two halves per 32-bit word (see f16_pairs.wgsl, the
// prelude); scatter_rows_f16 writes one whole word per invocation, so rows never race on a
// word (width, slot_stride and slot_offset are even there).

const WG: u32 = 256u;

// p: RowParams (uniform, binding 0), declared once in src/backend/wgpu/kernel_params.rs
// and composed before this file.
@group(0) @binding(1) var<storage, read> slots: array<i32>;
// scatter_rows
@group(0) @binding(2) var<storage, read> rows_in: array<f32>;
@group(0) @binding(3) var<storage, read_write> pool_out: array<f32>;
// gather_rows
@group(0) @binding(4) var<storage, read> pool_in: array<f32>;
@group(0) @binding(5) var<storage, read_write> rows_out: array<f32>;
// scatter_rows_f16
@group(0) @binding(6) var<storage, read_write> pool_out_f16: array<u32>;

// Pool element of (row r, column c), or -1 when the row's slot is skipped or in another chunk.
fn pool_index(r: u32, c: u32) -> i32 {
    let slot = slots[r];
    if (slot < 0) {
        return -1;
    }
    let s = u32(slot);
    if (s < p.slot_base || s - p.slot_base >= p.slot_count) {
        return -1;
    }
    return i32((s - p.slot_base) * p.slot_stride + p.slot_offset + c);
}

@compute @workgroup_size(WG)
fn scatter_rows(inv: Invocation) {
    let idx = flat_index(inv);
    if (idx >= p.n_rows * p.width) {
        return;
    }
    let at = pool_index(idx / p.width, idx % p.width);
    if (at >= 0) {
        pool_out[u32(at)] = rows_in[idx];
    }
}

@compute @workgroup_size(WG)
fn gather_rows(inv: Invocation) {
    let idx = flat_index(inv);
    if (idx >= p.n_rows * p.width) {
        return;
    }
    let at = pool_index(idx / p.width, idx % p.width);
    if (at >= 0) {
        rows_out[idx] = pool_in[u32(at)];
    }
}

@compute @workgroup_size(WG)
fn scatter_rows_f16(inv: Invocation) {
    let pair = flat_index(inv);
    let pairs_per_row = p.width / 2u;
    if (pair >= p.n_rows * pairs_per_row) {
        return;
    }
    let r = pair / pairs_per_row;
    let c = 2u * (pair % pairs_per_row);
    let at = pool_index(r, c);
    if (at >= 0) {
        let e = r * p.width + c;
        pool_out_f16[u32(at) >> 1u] = pack_f16_pair(vec2<f32>(rows_in[e], rows_in[e + 1u]));
    }
}
