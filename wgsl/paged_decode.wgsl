// Prelude of the attention kernels (paged_attention.wgsl, whose paged_decode_partial is a
// split-KV decode, and paged_decode_subgroup.wgsl), compiled after paged_kv.wgsl: their
// shared declarations (constants, bindings, workgroup arrays), and what the two split-KV
// decodes share once a tile's scores are in `s_sh`. Only the way the scores arrive differs
// between them. The kernel file declares HEAD_DIM and NUM_HEADS (override constants).

const WG: u32 = 64u;
const DIMS_PER_THREAD: u32 = 4u; // MAX_HEAD_DIM (256) / WG
const MAX_GROUP: u32 = 8u;
const NEG_BIG: f32 = -3.0e38;

// p: AttnParams (uniform, binding 0), declared once in src/backend/wgpu/kernel_params.rs
// and composed before this file.
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> row_info: array<u32>;
@group(0) @binding(3) var<storage, read> k0: array<u32>;
@group(0) @binding(4) var<storage, read> k1: array<u32>;
@group(0) @binding(5) var<storage, read> v0: array<u32>;
@group(0) @binding(6) var<storage, read> v1: array<u32>;
@group(0) @binding(8) var<storage, read_write> part: array<f32>;

var<workgroup> q_sh: array<f32, 2048>; // MAX_GROUP * MAX_HEAD_DIM
var<workgroup> s_sh: array<f32, 512>;  // MAX_GROUP * WG (`[group, WG]` scores)

// One split-KV decode job: the GQA group of KV head `kvh` of row `r`, over keys
// begin..end of the row's visible keys (split `split` of p.n_splits), in block table `table`.
struct DecodeJob {
    kvh: u32,
    split: u32,
    r: u32,
    group: u32,
    table: u32,
    begin: u32,
    end: u32,
}

// The job of the invocation's workgroup (KV head fastest, then split, then row). A dispatch rounded up
// past the last row gives `r >= p.n_rows`: the caller returns, and nothing else is read.
fn decode_job(inv: Invocation) -> DecodeJob {
    let flat = workgroup_index(inv);
    let rest = flat / NUM_KV_HEADS;
    var job: DecodeJob;
    job.kvh = flat % NUM_KV_HEADS;
    job.split = rest % p.n_splits;
    job.r = rest / p.n_splits;
    job.group = NUM_HEADS / NUM_KV_HEADS;
    if (job.r >= p.n_rows) {
        return job;
    }
    let visible = row_info[3u * job.r + 1u];
    job.table = row_info[3u * job.r + 2u];
    job.begin = min(job.split * p.split_len, visible);
    job.end = min(job.begin + p.split_len, visible);
    return job;
}

// The workgroup's job, with its group's query rows in `q_sh` (`[group, HEAD_DIM]`) once every
// invocation has passed the barrier; a job past the last row (`r >= p.n_rows`) loads nothing.
// Called by every invocation of the workgroup (the barrier needs them all).
fn decode_begin(inv: Invocation) -> DecodeJob {
    let job = decode_job(inv);
    let lid = inv.lid;
    if (job.r < p.n_rows) {
        let q_row = row_info[3u * job.r];
        for (var e = lid; e < job.group * HEAD_DIM; e += WG) {
            q_sh[e] = q[(q_row * NUM_HEADS + job.kvh * job.group) * HEAD_DIM + e];
        }
    }
    workgroupBarrier();
    return job;
}

// The fold's start: no key seen yet.
fn decode_state() -> DecodeState {
    var st: DecodeState;
    for (var g = 0u; g < MAX_GROUP; g++) {
        st.m[g] = NEG_BIG;
    }
    return st;
}

// One workgroup's online softmax, per head g of the GQA group: max `m[g]`, sum `l[g]`,
// weighted V sums `acc[g * DIMS_PER_THREAD + i]` of dims lid + i * WG.
struct DecodeState {
    m: array<f32, MAX_GROUP>,
    l: array<f32, MAX_GROUP>,
    acc: array<f32, 32>, // MAX_GROUP * DIMS_PER_THREAD
}

// Folds the scores of keys t0..t0 + n_t (in s_sh) into `st`: rescale by the new max,
// then add each key's probability and its V row, in key order.
fn decode_fold(st: ptr<function, DecodeState>, group: u32, table: u32, kvh: u32, t0: u32, n_t: u32, lid: u32) {
    var m_new: array<f32, MAX_GROUP>;
    for (var g = 0u; g < group; g++) {
        m_new[g] = (*st).m[g];
        for (var t = 0u; t < n_t; t++) {
            m_new[g] = max(m_new[g], s_sh[g * WG + t]);
        }
        let corr = exp((*st).m[g] - m_new[g]);
        (*st).l[g] *= corr;
        for (var i = 0u; i < DIMS_PER_THREAD; i++) {
            (*st).acc[g * DIMS_PER_THREAD + i] *= corr;
        }
        (*st).m[g] = m_new[g];
    }
    for (var t = 0u; t < n_t; t++) {
        let at = kv_at(table, t0 + t, kvh);
        var pr: array<f32, MAX_GROUP>;
        for (var g = 0u; g < group; g++) {
            pr[g] = exp(s_sh[g * WG + t] - (*st).m[g]);
            (*st).l[g] += pr[g];
        }
        for (var i = 0u; i < DIMS_PER_THREAD; i++) {
            let d = lid + i * WG;
            if (d < HEAD_DIM) {
                let v = load_v(at, d);
                for (var g = 0u; g < group; g++) {
                    (*st).acc[g * DIMS_PER_THREAD + i] += pr[g] * v;
                }
            }
        }
    }
}

// Writes split `split`'s partial of row r, KV head kvh: each head's unnormalised V sums,
// then its (m, l), where paged_decode_reduce merges the splits.
fn decode_write_partial(st: ptr<function, DecodeState>, group: u32, r: u32, kvh: u32, split: u32, lid: u32) {
    for (var g = 0u; g < group; g++) {
        let pr_idx = (r * NUM_HEADS + kvh * group + g) * p.n_splits + split;
        for (var i = 0u; i < DIMS_PER_THREAD; i++) {
            let d = lid + i * WG;
            if (d < HEAD_DIM) {
                part[pr_idx * HEAD_DIM + d] = (*st).acc[g * DIMS_PER_THREAD + i];
            }
        }
        if (lid == 0u) {
            part[p.part_ml_offset + 2u * pr_idx] = (*st).m[g];
            part[p.part_ml_offset + 2u * pr_idx + 1u] = (*st).l[g];
        }
    }
}
