// Split-KV decode attention with subgroup operations: the partial pass of
// paged_attention.wgsl's paged_decode_partial, for devices with Features::SUBGROUP (the
// backend compiles this file only there; it omits `enable subgroups;`, which naga 30
// rejects). Same bindings, AttnParams, row_info layout and partial output layout, so
// paged_decode_reduce merges its splits unchanged. Compiled after the f16 pair prelude,
// paged_kv.wgsl (kv_at, load_k, load_v) and paged_decode.wgsl (DecodeState, decode_fold,
// decode_write_partial: the fold and the partial write both decode kernels share).
//
// paged_decode_subgroup: one workgroup per (row, kv head, split), online softmax in f32
// over tiles of WG keys, as the portable kernel; only the scores differ. The portable
// kernel gives each invocation a whole key (invocation j reads key j's HEAD_DIM elements:
// strided, uncoalesced reads). Here the subgroups of the workgroup take a tile's keys in
// turn (subgroup s: keys s, s + num_subgroups, ...), the lanes of a subgroup split one
// key's head dims (consecutive lanes read consecutive elements: coalesced), every query
// head of the GQA group reuses each K element read, and subgroupAdd reduces each head's
// dot. V reads were coalesced already (invocation i owns dims i, i + WG, ...).
//
// Size-agnostic: lanes are counted with subgroupAdd / subgroupExclusiveAdd over the
// active invocations, so any subgroup size works (4..128, partial subgroups included);
// the dims loop has the same trip count on every lane and masks the tail with selects,
// so every subgroupAdd runs in subgroup-uniform control flow.
// KV_F16: the pages hold f16 pairs; otherwise f32 bits. Every product and sum is f32.

override HEAD_DIM: u32 = 64u;
override NUM_HEADS: u32 = 1u;
override NUM_KV_HEADS: u32 = 1u;
override BLOCK_SIZE: u32 = 16u;
override KV_F16: bool = false;

// WG, MAX_GROUP, DIMS_PER_THREAD, NEG_BIG, the bindings and `q_sh` / `s_sh` are declared in
// paged_decode.wgsl, shared with paged_attention.wgsl; AttnParams `p` is composed from Rust.

@compute @workgroup_size(WG)
fn paged_decode_subgroup(inv: Invocation, @builtin(subgroup_id) sg: u32, @builtin(num_subgroups) n_sg: u32) {
    let lid = inv.lid;
    // Active lanes of this subgroup and this invocation's rank among them.
    let lanes = subgroupAdd(1u);
    let lane = subgroupExclusiveAdd(1u);

    let job = decode_begin(inv);
    if (job.r >= p.n_rows) {
        return;
    }
    var st = decode_state();
    for (var t0 = job.begin; t0 < job.end; t0 += WG) {
        let n_t = min(WG, job.end - t0);
        // Scores of the tile: subgroup sg takes keys sg, sg + n_sg, ...; its lanes job.split
        // the head dims.
        for (var t = sg; t < n_t; t += n_sg) {
            let at = kv_at(job.table, t0 + t, job.kvh);
            var dots: array<f32, MAX_GROUP>;
            for (var d0 = 0u; d0 < HEAD_DIM; d0 += lanes) {
                let d = d0 + lane;
                let dd = min(d, HEAD_DIM - 1u);
                let k = select(0.0, load_k(at, dd), d < HEAD_DIM);
                for (var g = 0u; g < job.group; g++) {
                    dots[g] += q_sh[g * HEAD_DIM + dd] * k;
                }
            }
            for (var g = 0u; g < job.group; g++) {
                let dot = subgroupAdd(dots[g]);
                if (lane == 0u) {
                    s_sh[g * WG + t] = dot * p.scale;
                }
            }
        }
        workgroupBarrier();

        decode_fold(&st, job.group, job.table, job.kvh, t0, n_t, lid);
        workgroupBarrier();
    }
    decode_write_partial(&st, job.group, job.r, job.kvh, job.split, lid);
}
