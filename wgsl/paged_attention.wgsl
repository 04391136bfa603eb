// Paged attention over KV pages `[num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]`.
//
// Every query row reads its keys through its sequence's block table: the cached prefix
// and the suffix written this step alike. `q` / `out` are `[rows, NUM_HEADS * HEAD_DIM]`.
// The decode entry points describe rows in `row_info` as u32 triples
//   [q_row, visible, table_offset]
// where `visible` is how many keys the row attends to (causal with offset:
// num_computed + i + 1 for new row i); the prefill entry point describes query tiles
// (up to TQ_ROWS consecutive new rows of one sequence) as u32 quads
//   [q_row0, n_q, visible0, table_offset]
// where row i < n_q of the tile is q row q_row0 + i and sees visible0 + i keys. Either
// way `row_info[table_offset..]` is the sequence's block table. A pool bigger than one
// storage binding is split into two chunks of `blocks_per_chunk` whole blocks.
//
// Entry points:
//   paged_prefill_attention: one workgroup per (query tile, kv head, head subset): its
//     TQ query slots are (row, query head) pairs of the tile's rows and TQ_HEADS heads of
//     the GQA group, so each K and V tile of KT keys read into workgroup memory (16 KiB
//     in all) serves every head of the group; online softmax per slot.
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
// Prefill tile sizes, set by the host for HEAD_DIM (ops/attention.rs, prefill_tiles):
// TQ query slots, a power of two <= min(16, 1024 / HEAD_DIM), KT <= min(64, 2048 / HEAD_DIM).
// Slot s holds row s / TQ_HEADS of the tile and head s % TQ_HEADS of the workgroup's head
// subset (prefill_slots): TQ_HEADS = min(group, TQ) heads, TQ_ROWS = max(1, TQ / group)
// rows; slots past TQ_ROWS * TQ_HEADS, and heads past the group's last, are idle.
override TQ: u32 = 16u;
override KT: u32 = 32u;
override TQ_ROWS: u32 = 16u;
override TQ_HEADS: u32 = 1u;

const MAX_HEAD_DIM: u32 = 256u;
// Head dims one prefill invocation accumulates: TQ * HEAD_DIM / WG <= 1024 / 64.
const ACC_PER_THREAD: u32 = 16u;

// AttnParams `p` (binding 0) is composed from Rust (ops/attention.rs); q, row_info, the K/V
// pages (bindings 1-6), `part` (8), `q_sh` and `s_sh` are declared in paged_decode.wgsl,
// which both attention kernels share.
@group(0) @binding(7) var<storage, read_write> out: array<f32>;
@group(0) @binding(9) var<storage, read> part_in: array<f32>;
// Prefill tiles, 16 KiB in all: queries, one K or V tile, scores.
var<workgroup> qt_sh: array<f32, 1024>;  // TQ * HEAD_DIM
var<workgroup> kvt_sh: array<f32, 2048>; // KT * HEAD_DIM
var<workgroup> st_sh: array<f32, 1024>;  // TQ * KT

// kv_at, load_k, load_v: see paged_kv.wgsl, the prelude this file is compiled after;
// DecodeState, decode_fold, decode_write_partial: see paged_decode.wgsl, the next one.

// The query slots of a workgroup: slot s is row row_of(s) of the tile and query head
// head0 + s % TQ_HEADS; live while that row is < n_q and that head is in the group.
fn row_of(s: u32) -> u32 {
    return s / TQ_HEADS;
}

fn slot_live(s: u32, n_q: u32, heads_left: u32) -> bool {
    return s < TQ_ROWS * TQ_HEADS && row_of(s) < n_q && s % TQ_HEADS < heads_left;
}

// Loads the slots' queries into qt_sh (`[TQ, HEAD_DIM]`), pre-scaled by 1/sqrt(HEAD_DIM);
// idle slots are zero. `heads_left`: heads of the group from head0 on.
fn load_q_tile(lid: u32, q_row0: u32, n_q: u32, head0: u32, heads_left: u32) {
    for (var e = lid; e < TQ * HEAD_DIM; e += WG) {
        let s = e / HEAD_DIM;
        var x = 0.0;
        if (slot_live(s, n_q, heads_left)) {
            let h = head0 + s % TQ_HEADS;
            x = q[((q_row0 + row_of(s)) * NUM_HEADS + h) * HEAD_DIM + e % HEAD_DIM] * p.scale;
        }
        qt_sh[e] = x;
    }
}

// Loads keys t0..t0 + n_t of kv head `kvh` into kvt_sh (`[n_t, HEAD_DIM]`): K or V pages.
fn load_kv_tile(lid: u32, table: u32, t0: u32, n_t: u32, kvh: u32, is_v: bool) {
    for (var e = lid; e < n_t * HEAD_DIM; e += WG) {
        let at = kv_at(table, t0 + e / HEAD_DIM, kvh);
        if (is_v) {
            kvt_sh[e] = load_v(at, e % HEAD_DIM);
        } else {
            kvt_sh[e] = load_k(at, e % HEAD_DIM);
        }
    }
}

// Scores of query slot i against the keys in kvt_sh its row may see (causal: key t0 + t
// is visible to row r while t0 + t < visible0 + r, for every head of the row), into
// st_sh (`[TQ, KT]`).
fn score_tile(lid: u32, n_q: u32, heads_left: u32, visible0: u32, t0: u32) {
    for (var e = lid; e < TQ * KT; e += WG) {
        let i = e / KT;
        let t = e % KT;
        if (slot_live(i, n_q, heads_left) && t0 + t < visible0 + row_of(i)) {
            // Each key's dot product starts at its own dim, so neighbouring invocations
            // (neighbouring keys, rows HEAD_DIM apart) read different banks of kvt_sh.
            var dot = 0.0;
            var d = t % HEAD_DIM;
            for (var n = 0u; n < HEAD_DIM; n++) {
                dot += qt_sh[i * HEAD_DIM + d] * kvt_sh[t * HEAD_DIM + d];
                d = select(d + 1u, 0u, d + 1u == HEAD_DIM);
            }
            st_sh[e] = dot;
        }
    }
}

// Query tiles (FlashAttention-2 style): one workgroup per (tile, kv head, head subset).
// The slots' queries stay in workgroup memory while K/V tiles of KT keys stream through
// it, each read once for all TQ_HEADS heads; each invocation owns one slot and every
// (WG / TQ)-th head dim of it, with its own running max m and sum l (the lanes of a slot
// compute the same m and l).
@compute @workgroup_size(WG)
fn paged_prefill_attention(inv: Invocation) {
    let lid = inv.lid;
    let flat = workgroup_index(inv);
    let group = NUM_HEADS / NUM_KV_HEADS;
    let subsets = (group + TQ_HEADS - 1u) / TQ_HEADS;
    let sub = flat % subsets;
    let kvh = (flat / subsets) % NUM_KV_HEADS;
    let tile = flat / (subsets * NUM_KV_HEADS);
    if (tile >= p.n_rows) {
        return;
    }
    let q_row0 = row_info[4u * tile];
    let n_q = row_info[4u * tile + 1u];
    let visible0 = row_info[4u * tile + 2u];
    let table = row_info[4u * tile + 3u];
    let head0 = kvh * group + sub * TQ_HEADS;
    let heads_left = group - sub * TQ_HEADS;
    let lanes = WG / TQ;
    let i = lid / lanes;
    let lane = lid % lanes;
    let live = slot_live(i, n_q, heads_left);
    // Keys slot i's row sees; the tile's last row sees the most.
    let visible = visible0 + row_of(i);
    let keys = visible0 + n_q - 1u;
    load_q_tile(lid, q_row0, n_q, head0, heads_left);

    var m = NEG_BIG;
    var l = 0.0;
    var acc: array<f32, ACC_PER_THREAD>;
    for (var t0 = 0u; t0 < keys; t0 += KT) {
        let n_t = min(KT, keys - t0);
        load_kv_tile(lid, table, t0, n_t, kvh, false);
        workgroupBarrier();
        score_tile(lid, n_q, heads_left, visible0, t0);
        workgroupBarrier();
        load_kv_tile(lid, table, t0, n_t, kvh, true);
        workgroupBarrier();

        // Online softmax over the keys of this tile slot i's row sees (none if idle).
        let n_vis = select(0u, min(n_t, visible - min(visible, t0)), live);
        var m_new = m;
        for (var t = 0u; t < n_vis; t++) {
            m_new = max(m_new, st_sh[i * KT + t]);
        }
        let corr = exp(m - m_new);
        l *= corr;
        for (var k = 0u; k < ACC_PER_THREAD; k++) {
            acc[k] *= corr;
        }
        for (var t = 0u; t < n_vis; t++) {
            let pr = exp(st_sh[i * KT + t] - m_new);
            l += pr;
            for (var k = 0u; k < ACC_PER_THREAD; k++) {
                let d = lane + k * lanes;
                if (d < HEAD_DIM) {
                    acc[k] += pr * kvt_sh[t * HEAD_DIM + d];
                }
            }
        }
        m = m_new;
        workgroupBarrier();
    }
    if (live) {
        let out_base = ((q_row0 + row_of(i)) * NUM_HEADS + head0 + i % TQ_HEADS) * HEAD_DIM;
        for (var k = 0u; k < ACC_PER_THREAD; k++) {
            let d = lane + k * lanes;
            if (d < HEAD_DIM) {
                out[out_base + d] = acc[k] / l;
            }
        }
    }
}

@compute @workgroup_size(WG)
fn paged_decode_partial(inv: Invocation) {
    let lid = inv.lid;
    let job = decode_begin(inv);
    if (job.r >= p.n_rows) {
        return;
    }
    var st = decode_state();
    for (var t0 = job.begin; t0 < job.end; t0 += WG) {
        let j = t0 + lid;
        var dots: array<f32, MAX_GROUP>;
        if (j < job.end) {
            let at = kv_at(job.table, j, job.kvh);
            for (var d = 0u; d < HEAD_DIM; d++) {
                let k = load_k(at, d);
                for (var g = 0u; g < job.group; g++) {
                    dots[g] += q_sh[g * HEAD_DIM + d] * k;
                }
            }
        }
        for (var g = 0u; g < job.group; g++) {
            s_sh[g * WG + lid] = select(NEG_BIG, dots[g] * p.scale, j < job.end);
        }
        workgroupBarrier();

        let n_t = min(WG, job.end - t0);
        decode_fold(&st, job.group, job.table, job.kvh, t0, n_t, lid);
        workgroupBarrier();
    }
    decode_write_partial(&st, job.group, job.r, job.kvh, job.split, lid);
}

@compute @workgroup_size(WG)
fn paged_decode_reduce(inv: Invocation) {
    let lid = inv.lid;
    let flat = workgroup_index(inv);
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
