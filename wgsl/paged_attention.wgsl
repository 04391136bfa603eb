// Paged attention over KV pages `[num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]`.
//
// Every query row reads its keys through its sequence's block table: the cached prefix
// and the suffix written this step alike. Rows are described in `row_info` (u32 triples):
//   [q_row, visible, table_offset]
// `q_row` indexes `q` / `out` (`[rows, NUM_HEADS * HEAD_DIM]`), `visible` is how many
// keys the row attends to (causal with offset: num_computed + i + 1 for new row i),
// and `row_info[table_offset..]` is the sequence's block table. A pool bigger than one
// storage binding is split into two chunks of `blocks_per_chunk` whole blocks.
//
// Entry points:
//   paged_prefill_attention: one workgroup per (row, query head); online softmax over
//     tiles of WG keys.
//   paged_decode_partial: one workgroup per (row, kv head, split); all query heads of the
//     GQA group share each K/V element read; writes partial (max, sum, acc) per split.
//   paged_decode_reduce: merges the splits of each (row, head).
// Nothing here needs subgroups; all softmax math is f32. Where the device has subgroups,
// decode's partials come from paged_decode_subgroup.wgsl instead (same bindings and
// partial layout; coalesced K reads), and paged_decode_reduce merges them the same way.
// KV_F16: the pages hold f16 pairs (see f16_pairs.wgsl, the prelude); otherwise f32 bits.
// Every product and sum is f32.

override HEAD_DIM: u32 = 64u;
override NUM_HEADS: u32 = 1u;
override NUM_KV_HEADS: u32 = 1u;
override BLOCK_SIZE: u32 = 16u;
override KV_F16: bool = false;

const WG: u32 = 64u;
const MAX_HEAD_DIM: u32 = 256u;
const DIMS_PER_THREAD: u32 = 4u; // MAX_HEAD_DIM / WG
const MAX_GROUP: u32 = 8u;
const NEG_BIG: f32 = -3.0e38;

struct AttnParams {
    n_rows: u32,
    blocks_per_chunk: u32,
    scale: f32,
    n_splits: u32,
    split_len: u32,
    part_ml_offset: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: AttnParams;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> row_info: array<u32>;
@group(0) @binding(3) var<storage, read> k0: array<u32>;
@group(0) @binding(4) var<storage, read> k1: array<u32>;
@group(0) @binding(5) var<storage, read> v0: array<u32>;
@group(0) @binding(6) var<storage, read> v1: array<u32>;
@group(0) @binding(7) var<storage, read_write> out: array<f32>;
@group(0) @binding(8) var<storage, read_write> part: array<f32>;
@group(0) @binding(9) var<storage, read> part_in: array<f32>;

var<workgroup> q_sh: array<f32, 2048>; // MAX_GROUP * MAX_HEAD_DIM
var<workgroup> s_sh: array<f32, 512>;  // MAX_GROUP * WG

// kv_at, load_k, load_v: see paged_kv.wgsl, the prelude this file is compiled after.

@compute @workgroup_size(WG)
fn paged_prefill_attention(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let flat = wid.x + wid.y * nwg.x;
    let h = flat % NUM_HEADS;
    let r = flat / NUM_HEADS;
    if (r >= p.n_rows) {
        return;
    }
    let q_row = row_info[3u * r];
    let visible = row_info[3u * r + 1u];
    let table = row_info[3u * r + 2u];
    let kvh = h / (NUM_HEADS / NUM_KV_HEADS);
    let q_base = (q_row * NUM_HEADS + h) * HEAD_DIM;
    for (var d = lid; d < HEAD_DIM; d += WG) {
        q_sh[d] = q[q_base + d];
    }
    workgroupBarrier();

    var m = NEG_BIG;
    var l = 0.0;
    var acc: array<f32, DIMS_PER_THREAD>;
    for (var t0 = 0u; t0 < visible; t0 += WG) {
        let j = t0 + lid;
        var s = NEG_BIG;
        if (j < visible) {
            let at = kv_at(table, j, kvh);
            var dot = 0.0;
            for (var d = 0u; d < HEAD_DIM; d++) {
                dot += q_sh[d] * load_k(at, d);
            }
            s = dot * p.scale;
        }
        s_sh[lid] = s;
        workgroupBarrier();

        let n_t = min(WG, visible - t0);
        var m_new = m;
        for (var t = 0u; t < n_t; t++) {
            m_new = max(m_new, s_sh[t]);
        }
        let corr = exp(m - m_new);
        l *= corr;
        for (var i = 0u; i < DIMS_PER_THREAD; i++) {
            acc[i] *= corr;
        }
        for (var t = 0u; t < n_t; t++) {
            let pr = exp(s_sh[t] - m_new);
            l += pr;
            let at = kv_at(table, t0 + t, kvh);
            for (var i = 0u; i < DIMS_PER_THREAD; i++) {
                let d = lid + i * WG;
                if (d < HEAD_DIM) {
                    acc[i] += pr * load_v(at, d);
                }
            }
        }
        m = m_new;
        workgroupBarrier();
    }
    for (var i = 0u; i < DIMS_PER_THREAD; i++) {
        let d = lid + i * WG;
        if (d < HEAD_DIM) {
            out[q_base + d] = acc[i] / l;
        }
    }
}

@compute @workgroup_size(WG)
fn paged_decode_partial(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let flat = wid.x + wid.y * nwg.x;
    let kvh = flat % NUM_KV_HEADS;
    let rest = flat / NUM_KV_HEADS;
    let split = rest % p.n_splits;
    let r = rest / p.n_splits;
    if (r >= p.n_rows) {
        return;
    }
    let group = NUM_HEADS / NUM_KV_HEADS;
    let q_row = row_info[3u * r];
    let visible = row_info[3u * r + 1u];
    let table = row_info[3u * r + 2u];
    let begin = min(split * p.split_len, visible);
    let end = min(begin + p.split_len, visible);
    for (var e = lid; e < group * HEAD_DIM; e += WG) {
        q_sh[e] = q[(q_row * NUM_HEADS + kvh * group) * HEAD_DIM + e];
    }
    workgroupBarrier();

    var m: array<f32, MAX_GROUP>;
    var l: array<f32, MAX_GROUP>;
    var acc: array<f32, 32>; // MAX_GROUP * DIMS_PER_THREAD, index g * DIMS_PER_THREAD + i
    for (var g = 0u; g < MAX_GROUP; g++) {
        m[g] = NEG_BIG;
    }
    for (var t0 = begin; t0 < end; t0 += WG) {
        let j = t0 + lid;
        var dots: array<f32, MAX_GROUP>;
        if (j < end) {
            let at = kv_at(table, j, kvh);
            for (var d = 0u; d < HEAD_DIM; d++) {
                let k = load_k(at, d);
                for (var g = 0u; g < group; g++) {
                    dots[g] += q_sh[g * HEAD_DIM + d] * k;
                }
            }
        }
        for (var g = 0u; g < group; g++) {
            s_sh[g * WG + lid] = select(NEG_BIG, dots[g] * p.scale, j < end);
        }
        workgroupBarrier();

        let n_t = min(WG, end - t0);
        var m_new: array<f32, MAX_GROUP>;
        for (var g = 0u; g < group; g++) {
            m_new[g] = m[g];
            for (var t = 0u; t < n_t; t++) {
                m_new[g] = max(m_new[g], s_sh[g * WG + t]);
            }
            let corr = exp(m[g] - m_new[g]);
            l[g] *= corr;
            for (var i = 0u; i < DIMS_PER_THREAD; i++) {
                acc[g * DIMS_PER_THREAD + i] *= corr;
            }
            m[g] = m_new[g];
        }
        for (var t = 0u; t < n_t; t++) {
            let at = kv_at(table, t0 + t, kvh);
            var pr: array<f32, MAX_GROUP>;
            for (var g = 0u; g < group; g++) {
                pr[g] = exp(s_sh[g * WG + t] - m[g]);
                l[g] += pr[g];
            }
            for (var i = 0u; i < DIMS_PER_THREAD; i++) {
                let d = lid + i * WG;
                if (d < HEAD_DIM) {
                    let v = load_v(at, d);
                    for (var g = 0u; g < group; g++) {
                        acc[g * DIMS_PER_THREAD + i] += pr[g] * v;
                    }
                }
            }
        }
        workgroupBarrier();
    }
    for (var g = 0u; g < group; g++) {
        let pr_idx = (r * NUM_HEADS + kvh * group + g) * p.n_splits + split;
        for (var i = 0u; i < DIMS_PER_THREAD; i++) {
            let d = lid + i * WG;
            if (d < HEAD_DIM) {
                part[pr_idx * HEAD_DIM + d] = acc[g * DIMS_PER_THREAD + i];
            }
        }
        if (lid == 0u) {
            part[p.part_ml_offset + 2u * pr_idx] = m[g];
            part[p.part_ml_offset + 2u * pr_idx + 1u] = l[g];
        }
    }
}

@compute @workgroup_size(WG)
fn paged_decode_reduce(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let flat = wid.x + wid.y * nwg.x;
    let h = flat % NUM_HEADS;
    let r = flat / NUM_HEADS;
    if (r >= p.n_rows) {
        return;
    }
    let first = (r * NUM_HEADS + h) * p.n_splits;
    var m = NEG_BIG;
    for (var s = 0u; s < p.n_splits; s++) {
        if (part_in[p.part_ml_offset + 2u * (first + s) + 1u] > 0.0) {
            m = max(m, part_in[p.part_ml_offset + 2u * (first + s)]);
        }
    }
    var weights = 0.0;
    for (var s = 0u; s < p.n_splits; s++) {
        let l = part_in[p.part_ml_offset + 2u * (first + s) + 1u];
        if (l > 0.0) {
            weights += exp(part_in[p.part_ml_offset + 2u * (first + s)] - m) * l;
        }
    }
    let out_base = (row_info[3u * r] * NUM_HEADS + h) * HEAD_DIM;
    for (var d = lid; d < HEAD_DIM; d += WG) {
        var sum = 0.0;
        for (var s = 0u; s < p.n_splits; s++) {
            if (part_in[p.part_ml_offset + 2u * (first + s) + 1u] > 0.0) {
                let w = exp(part_in[p.part_ml_offset + 2u * (first + s)] - m);
                sum += w * part_in[(first + s) * HEAD_DIM + d];
            }
        }
        out[out_base + d] = sum / weights;
    }
}
