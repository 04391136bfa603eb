//! The Qwen MoE block on the CPU: softmax router, top-k, optional renormalisation,
//! experts run over the rows routed to them, combined in expert order.

use ndarray::Array2;

use super::PackedWeight;
use super::swiglu;
use crate::Result;
use crate::backend::MoeWeights;
use crate::error::BackendError;

/// Top-k experts and weights of one row of router probabilities (ties to the lower id).
pub(crate) fn route(probs: &[f32], top_k: usize, norm_topk_prob: bool) -> Vec<(usize, f32)> {
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    let mut picked: Vec<(usize, f32)> = order.into_iter().take(top_k).map(|e| (e, probs[e])).collect();
    if norm_topk_prob {
        let sum: f32 = picked.iter().map(|p| p.1).sum();
        for p in &mut picked {
            p.1 /= sum;
        }
    }
    picked
}

/// Softmax of one row of logits.
fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

/// See [`crate::backend::Backend::moe`].
pub(crate) fn forward(x: &Array2<f32>, w: &MoeWeights<PackedWeight>) -> Result<Array2<f32>> {
    const OP: &str = "moe";
    let (e, hidden) = (w.num_experts, x.ncols());
    let bad = |what: &'static str, expected: String, t: &PackedWeight| -> crate::Error {
        BackendError::OpShape { op: OP, what, expected, found: t.shape().to_vec() }.into()
    };
    w.check_top_k(OP)?;
    if w.router.shape() != [e, hidden] {
        return Err(bad("router", format!("[{e}, {hidden}]"), &w.router));
    }
    let [gu_rows, gu_cols] = w.gate_up.shape();
    if gu_cols != hidden || !gu_rows.is_multiple_of(2 * e) {
        return Err(bad("gate_up", format!("[{e} * 2I, {hidden}]"), &w.gate_up));
    }
    let inter = gu_rows / (2 * e);
    if w.down.shape() != [e * hidden, inter] {
        return Err(bad("down", format!("[{}, {inter}]", e * hidden), &w.down));
    }
    let logits = w.router.matmul_all(x.view());
    // Per expert: the rows routed to it and their weights.
    let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
    for (r, row) in logits.rows().into_iter().enumerate() {
        let probs = softmax(&row.to_vec());
        for (expert, weight) in route(&probs, w.top_k, w.norm_topk_prob) {
            routed[expert].push((r, weight));
        }
    }
    let mut out = Array2::zeros(x.raw_dim());
    for (expert, rows) in routed.iter().enumerate().filter(|(_, rows)| !rows.is_empty()) {
        let xs = Array2::from_shape_fn((rows.len(), hidden), |(i, c)| x[[rows[i].0, c]]);
        let gate_up = w.gate_up.matmul_t(xs.view(), expert * 2 * inter..(expert + 1) * 2 * inter);
        let y = w.down.matmul_t(swiglu(gate_up.view()).view(), expert * hidden..(expert + 1) * hidden);
        for (i, &(r, weight)) in rows.iter().enumerate() {
            out.row_mut(r).scaled_add(weight, &y.row(i));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::test_support::rand_rows_from;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    /// Dense reference: every expert on every row, weights from a naive top-k.
    fn naive(x: &Array2<f32>, w: &MoeWeights<Array2<f32>>, inter: usize) -> Array2<f32> {
        let (e, h) = (w.num_experts, x.ncols());
        let mut out = Array2::zeros(x.raw_dim());
        for r in 0..x.nrows() {
            let logits: Vec<f64> =
                (0..e).map(|j| (0..h).map(|c| x[[r, c]] as f64 * w.router[[j, c]] as f64).sum()).collect();
            let max = logits.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = logits.iter().map(|l| (l - max).exp()).sum();
            let probs: Vec<f64> = logits.iter().map(|l| (l - max).exp() / z).collect();
            let mut chosen: Vec<usize> = Vec::new();
            for _ in 0..w.top_k {
                let best = (0..e).filter(|j| !chosen.contains(j)).fold(None, |b: Option<usize>, j| match b {
                    Some(b) if probs[b] >= probs[j] => Some(b),
                    _ => Some(j),
                });
                chosen.extend(best);
            }
            let total: f64 = chosen.iter().map(|&j| probs[j]).sum();
            for &j in &chosen {
                let weight = if w.norm_topk_prob { probs[j] / total } else { probs[j] };
                let mut act = vec![0f64; inter];
                for (i, a) in act.iter_mut().enumerate() {
                    let g: f64 =
                        (0..h).map(|c| x[[r, c]] as f64 * w.gate_up[[j * 2 * inter + i, c]] as f64).sum();
                    let u: f64 = (0..h)
                        .map(|c| x[[r, c]] as f64 * w.gate_up[[j * 2 * inter + inter + i, c]] as f64)
                        .sum();
                    *a = g / (1.0 + (-g).exp()) * u;
                }
                for c in 0..h {
                    let d: f64 = (0..inter).map(|i| act[i] * w.down[[j * h + c, i]] as f64).sum();
                    out[[r, c]] += (weight * d) as f32;
                }
            }
        }
        out
    }

    #[test]
    fn matches_naive_reference_with_and_without_renormalisation() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let (e, h, inter, n) = (6, 12, 5, 9);
        for (top_k, norm) in [(1, true), (2, true), (2, false), (6, false)] {
            let w = MoeWeights::random(&mut rng, e, h, inter, top_k, norm);
            let x = rand_rows_from(&mut rng, n, h);
            let got = forward(
                &x,
                &w.try_map(|t| Ok::<_, ()>(PackedWeight::pack(&crate::backend::HostWeight::from(t.clone()))))
                    .unwrap(),
            )
            .unwrap();
            let want = naive(&x, &w, inter);
            for ((r, c), g) in got.indexed_iter() {
                assert!(
                    (g - want[[r, c]]).abs() <= 1e-4 * (1.0 + want[[r, c]].abs()),
                    "top_k {top_k} norm {norm} at ({r},{c}): {g} vs {}",
                    want[[r, c]]
                );
            }
        }
    }

    #[test]
    fn route_renormalises_and_breaks_ties_low() {
        let picked = route(&[0.1, 0.3, 0.3, 0.3], 2, true);
        assert_eq!(picked.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((picked[0].1 - 0.5).abs() < 1e-6);
        let raw = route(&[0.1, 0.3, 0.2, 0.4], 2, false);
        assert_eq!(raw, vec![(3, 0.4), (1, 0.3)]);
    }

    /// A top-k of 0 or past the experts is a typed shape error naming `top_k`.
    #[test]
    fn a_top_k_outside_the_experts_is_a_shape_error() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let x = rand_rows_from(&mut rng, 2, 12);
        for top_k in [0, 7] {
            let w = MoeWeights::random(&mut rng, 6, 12, 5, top_k, true);
            let packed =
                w.try_map(|t| Ok::<_, ()>(PackedWeight::pack(&crate::backend::HostWeight::from(t.clone()))));
            let err = forward(&x, &packed.unwrap()).unwrap_err();
            assert!(
                matches!(
                    &err,
                    crate::Error::Backend(BackendError::OpShape { op: "moe", what: "top_k", found, .. })
                        if found == &vec![top_k]
                ),
                "{err}"
            );
        }
    }
}
