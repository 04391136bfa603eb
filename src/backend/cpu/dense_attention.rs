//! Dense causal attention over one sequence's K/V rows, with an optional
//! sliding window: the code2wav transformer's attention (HF
//! `create_sliding_window_causal_mask`), which needs no pages.
//!
//! Each query row is one rayon task that walks its visible keys in ascending
//! position (scores, their max, `exp`, the sum, the weighted sum of values),
//! so its result depends only on its q row and the K/V rows it sees: a stream
//! that attends a chunk's queries to cached keys gets the bits one pass gets.

use ndarray::{Array2, ArrayView2, Axis, parallel::prelude::*};

use crate::Result;
use crate::backend::AttnHeads;
use crate::error::BackendError;

/// `softmax(q kᵀ / √d) v` per head, queries at the last `Tq` of `Tk` positions.
///
/// `q [Tq, num_heads*head_dim]`, `k`, `v [Tk, kv_heads*head_dim]`, `Tq <= Tk`:
/// query row `r` is position `p = Tk - Tq + r` and sees key `j` iff `j <= p` and,
/// with a window `w`, `j > p - w` (HF's sliding-window mask `i - w < j <= i`: `w`
/// keys, itself included). Query head `h` reads KV head `h / (num_heads / kv_heads)`.
pub(crate) fn causal_attention(
    q: ArrayView2<'_, f32>, k: ArrayView2<'_, f32>, v: ArrayView2<'_, f32>, heads: AttnHeads,
    window: Option<usize>,
) -> Result<Array2<f32>> {
    const OP: &str = "causal_attention";
    let AttnHeads { num_heads, kv_heads, head_dim } = heads;
    let shape = |what, expected: String, found: &[usize]| -> crate::Error {
        BackendError::OpShape { op: OP, what, expected, found: found.to_vec() }.into()
    };
    if num_heads == 0 || kv_heads == 0 || head_dim == 0 || !num_heads.is_multiple_of(kv_heads) {
        return Err(shape(
            "heads",
            "num_heads a positive multiple of kv_heads".into(),
            &[num_heads, kv_heads, head_dim],
        ));
    }
    if window == Some(0) {
        return Err(shape("window", "None or > 0".into(), &[0]));
    }
    if q.ncols() != num_heads * head_dim {
        return Err(shape("q", format!("[n, {num_heads} * {head_dim}]"), q.shape()));
    }
    let kv_width = kv_heads * head_dim;
    if k.ncols() != kv_width || k.nrows() < q.nrows() {
        return Err(shape("k", format!("[>= {}, {kv_width}]", q.nrows()), k.shape()));
    }
    if v.dim() != k.dim() {
        return Err(shape("v", format!("[{}, {kv_width}]", k.nrows()), v.shape()));
    }
    let (k, v) = (k.as_standard_layout(), v.as_standard_layout());
    let (Some(ks), Some(vs)) = (k.as_slice(), v.as_slice()) else {
        unreachable!("standard-layout arrays are contiguous")
    };
    let offset = k.nrows() - q.nrows();
    let group = num_heads / kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut out = Array2::zeros((q.nrows(), num_heads * head_dim));
    out.axis_iter_mut(Axis(0))
        .into_par_iter()
        .zip(q.axis_iter(Axis(0)).into_par_iter())
        .enumerate()
        .for_each(|(r, (mut o, qr))| {
            let p = offset + r;
            let first = window.map_or(0, |w| (p + 1).saturating_sub(w));
            let mut scores = vec![0.0f32; p + 1 - first];
            for h in 0..num_heads {
                let kv = (h / group) * head_dim;
                let qh = qr.slice(ndarray::s![h * head_dim..(h + 1) * head_dim]);
                let mut max = f32::NEG_INFINITY;
                for (s, j) in scores.iter_mut().zip(first..=p) {
                    let kj = &ks[j * kv_width + kv..j * kv_width + kv + head_dim];
                    *s = qh.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale;
                    max = max.max(*s);
                }
                let mut sum = 0.0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let mut oh = o.slice_mut(ndarray::s![h * head_dim..(h + 1) * head_dim]);
                for (&s, j) in scores.iter().zip(first..=p) {
                    let vj = &vs[j * kv_width + kv..j * kv_width + kv + head_dim];
                    for (acc, &x) in oh.iter_mut().zip(vj) {
                        *acc += s * x;
                    }
                }
                let inv = 1.0 / sum;
                oh.mapv_inplace(|x| x * inv);
            }
        });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use crate::backend::test_support::rand_rows;

    /// Masked softmax attention written plainly in f64.
    fn naive(
        q: &Array2<f32>, k: &Array2<f32>, v: &Array2<f32>, heads: AttnHeads, window: Option<usize>,
    ) -> Array2<f32> {
        let AttnHeads { num_heads, kv_heads, head_dim: d } = heads;
        let offset = k.nrows() - q.nrows();
        Array2::from_shape_fn((q.nrows(), num_heads * d), |(r, col)| {
            let (h, e) = (col / d, col % d);
            let g = h / (num_heads / kv_heads);
            let i = offset + r;
            let visible: Vec<usize> =
                (0..k.nrows()).filter(|&j| j <= i && window.is_none_or(|w| i < j + w)).collect();
            let scores: Vec<f64> = visible
                .iter()
                .map(|&j| {
                    (0..d).map(|x| (q[[r, h * d + x]] * k[[j, g * d + x]]) as f64).sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            (visible.iter().zip(&weights).map(|(&j, w)| w * v[[j, g * d + e]] as f64).sum::<f64>() / total)
                as f32
        })
    }

    #[test]
    fn matches_masked_softmax_and_rows_do_not_depend_on_the_chunk() {
        let heads = AttnHeads { num_heads: 4, kv_heads: 2, head_dim: 8 };
        let (q, k, v) = (rand_rows(1, 20, 32), rand_rows(2, 20, 16), rand_rows(3, 20, 16));
        for window in [None, Some(1), Some(5), Some(40)] {
            let all = causal_attention(q.view(), k.view(), v.view(), heads, window).unwrap();
            let want = naive(&q, &k, &v, heads, window);
            for (g, w) in all.iter().zip(&want) {
                assert!((g - w).abs() < 1e-5, "window {window:?}: {g} vs {w}");
            }
            // The last 7 queries against all keys: the rows one pass gives, bit for bit.
            let tail =
                causal_attention(q.slice(ndarray::s![13.., ..]), k.view(), v.view(), heads, window).unwrap();
            assert_eq!(tail, all.slice(ndarray::s![13.., ..]), "window {window:?}");
            if let Some(w) = window.filter(|&w| w <= 13) {
                // ... and against only the keys a window still sees.
                let keys = ndarray::s![13 + 1 - w.., ..];
                let cut = causal_attention(
                    q.slice(ndarray::s![13.., ..]),
                    k.slice(keys),
                    v.slice(keys),
                    heads,
                    window,
                )
                .unwrap();
                assert_eq!(cut.row(0), all.row(13), "window {w}");
            }
        }
    }

    #[test]
    fn rejects_bad_shapes() {
        let heads = AttnHeads { num_heads: 4, kv_heads: 2, head_dim: 8 };
        let (q, k) = (rand_rows(1, 5, 32), rand_rows(2, 5, 16));
        let what = |r: Result<Array2<f32>>| match r {
            Err(Error::Backend(BackendError::OpShape { op: "causal_attention", what, .. })) => what,
            other => panic!("expected a shape error, got {other:?}"),
        };
        assert_eq!(what(causal_attention(q.view(), k.view(), rand_rows(3, 4, 16).view(), heads, None)), "v");
        assert_eq!(what(causal_attention(q.view(), rand_rows(2, 4, 16).view(), k.view(), heads, None)), "k");
        assert_eq!(what(causal_attention(rand_rows(1, 5, 16).view(), k.view(), k.view(), heads, None)), "q");
        assert_eq!(what(causal_attention(q.view(), k.view(), k.view(), heads, Some(0))), "window");
        let bad = AttnHeads { num_heads: 3, ..heads };
        assert_eq!(what(causal_attention(q.view(), k.view(), k.view(), bad, None)), "heads");
    }
}
