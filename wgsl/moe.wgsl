// Mixture-of-experts routing and combination.
//   router_topk: per token, softmax over `experts` router logits (f32), then the top_k
//     experts in order of (probability desc, expert index asc); with `renormalize` the
//     chosen probabilities are divided by their sum (Qwen3-MoE norm_topk_prob).
//   expert_lists: per expert e, the routing slots s = t * top_k + j (ascending) with
//     topk_ids[s] == e, at lists[e * tokens ..], and their number at counts[e]; the
//     grouped matmul (matmul_routed in matmul.wgsl) reads them, so routing never leaves
//     the device.
//   expert_combine: out[t, :] = sum_j weights[t, j] * expert_out[t * top_k + j, :]

const WG: u32 = 64u;

// p: MoeParams (uniform, binding 0), declared once in src/backend/wgpu/kernel_params.rs
// and composed before this file.
// router_topk
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> topk_ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> topk_weights: array<f32>;
// expert_combine
@group(0) @binding(4) var<storage, read> weights_in: array<f32>;
@group(0) @binding(5) var<storage, read> expert_out: array<f32>;
@group(0) @binding(6) var<storage, read_write> combined: array<f32>;
// expert_lists
@group(0) @binding(7) var<storage, read> routed_ids: array<u32>;
@group(0) @binding(8) var<storage, read_write> list_counts: array<u32>;
@group(0) @binding(9) var<storage, read_write> list_slots: array<u32>;

// True when (pa, a) comes after (pb, b) in (probability desc, index asc) order.
fn ranks_after(pa: f32, a: u32, pb: f32, b: u32) -> bool {
    return pa < pb || (pa == pb && a > b);
}

@compute @workgroup_size(WG)
fn router_topk(inv: Invocation) {
    let t = flat_index(inv);
    if (t >= p.tokens) {
        return;
    }
    let base = t * p.experts;
    var mx = logits[base];
    for (var e = 1u; e < p.experts; e++) {
        mx = max(mx, logits[base + e]);
    }
    var denom = 0.0;
    for (var e = 0u; e < p.experts; e++) {
        denom += exp(logits[base + e] - mx);
    }
    // Walk down the ranking: each pick is the best expert ranking after the previous pick.
    var prev_p = 2.0;
    var prev_e = 0u;
    var chosen_sum = 0.0;
    for (var j = 0u; j < p.top_k; j++) {
        var best_p = -1.0;
        var best_e = 0u;
        for (var e = 0u; e < p.experts; e++) {
            let pe = exp(logits[base + e] - mx) / denom;
            let after_prev = j == 0u || ranks_after(pe, e, prev_p, prev_e);
            if (after_prev && ranks_after(best_p, best_e, pe, e)) {
                best_p = pe;
                best_e = e;
            }
        }
        topk_ids[t * p.top_k + j] = best_e;
        topk_weights[t * p.top_k + j] = best_p;
        chosen_sum += best_p;
        prev_p = best_p;
        prev_e = best_e;
    }
    if (p.renormalize != 0u) {
        for (var j = 0u; j < p.top_k; j++) {
            topk_weights[t * p.top_k + j] /= chosen_sum;
        }
    }
}

@compute @workgroup_size(256)
fn expert_combine(inv: Invocation) {
    let lid = inv.lid;
    let i = workgroup_index(inv) * 256u + lid;
    if (i >= p.tokens * p.width) {
        return;
    }
    let t = i / p.width;
    let d = i % p.width;
    var sum = 0.0;
    for (var j = 0u; j < p.top_k; j++) {
        sum += weights_in[t * p.top_k + j] * expert_out[(t * p.top_k + j) * p.width + d];
    }
    combined[i] = sum;
}

// One invocation per expert; each scans every slot, so lists come out in slot order.
@compute @workgroup_size(WG)
fn expert_lists(inv: Invocation) {
    let e = flat_index(inv);
    if (e >= p.experts) {
        return;
    }
    var n = 0u;
    for (var s = 0u; s < p.tokens * p.top_k; s++) {
        if (routed_ids[s] == e) {
            list_slots[e * p.tokens + n] = s;
            n++;
        }
    }
    list_counts[e] = n;
}
