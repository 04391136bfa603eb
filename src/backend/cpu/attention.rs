//! Varlen causal attention over paged K/V (the reference for the GPU kernel).

use ndarray::Array2;
use rayon::prelude::*;

use super::check::{expect_cols, row_index};
use super::pages::CpuPages;
use super::softmax::causal_softmax;
use crate::backend::{AttnHeads, AttnSeq};
use crate::Result;
use crate::error::BackendError;

const OP: &str = "paged_attention";

/// Checks one sequence against the step and the pages; returns its slots in position order.
fn seq_slots(seq: &AttnSeq<'_>, rows: usize, pages: &CpuPages) -> Result<Vec<usize>> {
    let spec = pages.spec;
    let end = seq.query_start.checked_add(seq.num_new).filter(|&e| e <= rows);
    if end.is_none() {
        return Err(BackendError::OpIndex { op: OP, what: "query end", index: seq.query_start.saturating_add(seq.num_new) as i64, bound: rows + 1 }.into());
    }
    let len = seq.num_computed.saturating_add(seq.num_new);
    let blocks_needed = len.div_ceil(spec.block_size);
    if seq.block_table.len() < blocks_needed {
        return Err(BackendError::OpIndex { op: OP, what: "position (block table too short)", index: len as i64 - 1, bound: seq.block_table.len() * spec.block_size }.into());
    }
    for &b in &seq.block_table[..blocks_needed] {
        row_index(OP, "block", b as i64, spec.num_blocks)?;
    }
    Ok((0..len).map(|j| seq.block_table[j / spec.block_size] as usize * spec.block_size + j % spec.block_size).collect())
}

/// Query rows per score tile: bounds the `[tile, len]` score matrix of one head.
const QUERY_TILE: usize = 256;

/// Attention of the query heads that share KV head `kv_head`, for one sequence:
/// `group` blocks of `[num_new, head_dim]`, flat, in head order.
///
/// The KV head's keys and values are gathered from the pages once for the whole
/// group. Scores and the weighted sum are matrix products (`Q·Kᵀ`, `P·V`) over
/// the keys a query tile can see, so the CPU reference runs at matmul speed;
/// keys past a row's causal limit are masked to zero weight.
fn kv_group_attention(q: &Array2<f32>, (k, v): (&[f32], &[f32]), seq: &AttnSeq<'_>, slots: &[usize], kv_head: usize, heads: AttnHeads) -> Vec<f32> {
    let hd = heads.head_dim;
    let width = heads.kv_heads * hd;
    let group = heads.num_heads / heads.kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    // This KV head's keys and values, contiguous in position order.
    let gather = |page: &[f32]| -> Array2<f32> {
        let mut flat = Vec::with_capacity(slots.len() * hd);
        for &s in slots {
            let start = s * width + kv_head * hd;
            flat.extend_from_slice(&page[start..start + hd]);
        }
        Array2::from_shape_vec((slots.len(), hd), flat).expect("gathered rows are head_dim wide")
    };
    let (keys, values) = (gather(k), gather(v));
    let mut out = vec![0.0f32; group * seq.num_new * hd];
    for (g, head_out) in out.chunks_exact_mut(seq.num_new * hd).enumerate() {
        let head = kv_head * group + g;
        for tile_start in (0..seq.num_new).step_by(QUERY_TILE) {
            let tile_end = (tile_start + QUERY_TILE).min(seq.num_new);
            let rows = seq.query_start + tile_start..seq.query_start + tile_end;
            let qh = q.slice(ndarray::s![rows, head * hd..(head + 1) * hd]);
            // Keys visible to the tile's last row; earlier rows mask the tail.
            let visible = seq.num_computed + tile_end;
            let mut scores = qh.dot(&keys.slice(ndarray::s![..visible, ..]).t());
            for (r, mut row) in scores.rows_mut().into_iter().enumerate() {
                let limit = seq.num_computed + tile_start + r + 1;
                causal_softmax(row.as_slice_mut().expect("a fresh product is row-major"), limit, scale);
            }
            let tile_out = scores.dot(&values.slice(ndarray::s![..visible, ..]));
            let dst = &mut head_out[tile_start * hd..tile_end * hd];
            for (d, x) in dst.iter_mut().zip(tile_out.iter()) {
                *d = *x;
            }
        }
    }
    out
}

/// See [`crate::backend::Backend::paged_attention`].
pub(crate) fn paged_attention(q: &Array2<f32>, pages: &CpuPages, layer: usize, heads: AttnHeads, seqs: &[AttnSeq<'_>]) -> Result<Array2<f32>> {
    let spec = pages.spec;
    if heads.kv_heads != spec.kv_heads || heads.head_dim != spec.head_dim || heads.kv_heads == 0 || !heads.num_heads.is_multiple_of(heads.kv_heads) {
        return Err(BackendError::OpShape {
            op: OP,
            what: "heads (num_heads, kv_heads, head_dim)",
            expected: format!("kv_heads {} dividing num_heads, head_dim {}", spec.kv_heads, spec.head_dim),
            found: vec![heads.num_heads, heads.kv_heads, heads.head_dim],
        }.into());
    }
    expect_cols(OP, "q", q, heads.num_heads * heads.head_dim)?;
    let (k, v) = pages.kv(OP, layer)?;
    let slots = seqs.iter().map(|s| seq_slots(s, q.nrows(), pages)).collect::<Result<Vec<_>>>()?;
    let jobs: Vec<(usize, usize)> = (0..seqs.len()).flat_map(|s| (0..heads.kv_heads).map(move |kh| (s, kh))).collect();
    let results: Vec<Vec<f32>> = jobs
        .par_iter()
        .map(|&(s, kh)| kv_group_attention(q, (k, v), &seqs[s], &slots[s], kh, heads))
        .collect();
    let hd = heads.head_dim;
    let group = heads.num_heads / heads.kv_heads;
    let mut out = Array2::zeros(q.raw_dim());
    for (&(s, kh), res) in jobs.iter().zip(&results) {
        let per_head = seqs[s].num_new * hd;
        if per_head == 0 {
            continue;
        }
        for (g, head_res) in res.chunks_exact(per_head).enumerate() {
            let h = kh * group + g;
            for (i, row) in head_res.chunks_exact(hd).enumerate() {
                let mut dst = out.row_mut(seqs[s].query_start + i);
                for (d, x) in dst.iter_mut().skip(h * hd).zip(row) {
                    *d = *x;
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::backend::PagesSpec;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn rand_rows(rng: &mut ChaCha8Rng, r: usize, c: usize) -> Array2<f32> {
        Array2::from_shape_fn((r, c), |_| rng.random::<f32>() * 2.0 - 1.0)
    }

    /// Dense causal attention of one sequence (f64): q `[new, H*d]`, k/v `[len, KH*d]`.
    fn dense(q: &Array2<f32>, k: &Array2<f32>, v: &Array2<f32>, computed: usize, heads: AttnHeads) -> Array2<f64> {
        let d = heads.head_dim;
        let group = heads.num_heads / heads.kv_heads;
        let mut out = Array2::zeros((q.nrows(), q.ncols()));
        for i in 0..q.nrows() {
            for h in 0..heads.num_heads {
                let kh = h / group;
                let scores: Vec<f64> = (0..=computed + i)
                    .map(|j| (0..d).map(|c| q[[i, h * d + c]] as f64 * k[[j, kh * d + c]] as f64).sum::<f64>() / (d as f64).sqrt())
                    .collect();
                let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for (j, s) in scores.iter().enumerate() {
                    for c in 0..d {
                        out[[i, h * d + c]] += (s - max).exp() / z * v[[j, kh * d + c]] as f64;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn matches_dense_causal_reference_over_random_block_tables() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let d = 8;
        for (num_heads, kv_heads) in [(4, 4), (4, 2), (4, 1)] {
            let heads = AttnHeads { num_heads, kv_heads, head_dim: d };
            let spec = PagesSpec { num_layers: 2, num_blocks: 24, block_size: 4, kv_heads, head_dim: d, captured: 0, hidden: 1 };
            let mut pages = CpuPages::new(spec);
            // (computed, new): empty prefix, non-aligned lengths, a one-token step.
            let shapes = [(0usize, 7usize), (5, 6), (8, 1), (13, 9)];
            let mut blocks: Vec<u32> = (0..spec.num_blocks as u32).collect();
            blocks.shuffle(&mut rng);
            let mut next_block = 0;
            let mut q_all = Vec::new();
            let mut expected = Vec::new();
            let mut tables = Vec::new();
            for &(computed, new) in &shapes {
                let len = computed + new;
                let nb = len.div_ceil(spec.block_size);
                let table: Vec<u32> = blocks[next_block..next_block + nb].to_vec();
                next_block += nb;
                let k = rand_rows(&mut rng, len, kv_heads * d);
                let v = rand_rows(&mut rng, len, kv_heads * d);
                let slots: Vec<i64> = (0..len).map(|j| (table[j / 4] as usize * 4 + j % 4) as i64).collect();
                pages.write_kv(1, &k, &v, &slots).unwrap();
                let q = rand_rows(&mut rng, new, num_heads * d);
                expected.push(dense(&q, &k, &v, computed, heads));
                q_all.push(q);
                tables.push(table);
            }
            let views: Vec<_> = q_all.iter().map(|q| q.view()).collect();
            let q = ndarray::concatenate(ndarray::Axis(0), &views).unwrap();
            let mut start = 0;
            let seqs: Vec<AttnSeq<'_>> = shapes
                .iter()
                .zip(&tables)
                .map(|(&(computed, new), table)| {
                    let s = AttnSeq { query_start: start, num_new: new, num_computed: computed, block_table: table };
                    start += new;
                    s
                })
                .collect();
            let got = paged_attention(&q, &pages, 1, heads, &seqs).unwrap();
            for (s, want) in seqs.iter().zip(&expected) {
                for ((i, c), w) in want.indexed_iter() {
                    let g = got[[s.query_start + i, c]] as f64;
                    assert!((g - w).abs() < 1e-5, "heads {num_heads}/{kv_heads} row {i} col {c}: {g} vs {w}");
                }
            }
        }
    }

    #[test]
    fn rejects_a_short_block_table_and_a_bad_block() {
        let spec = PagesSpec { num_layers: 1, num_blocks: 2, block_size: 4, kv_heads: 1, head_dim: 2, captured: 0, hidden: 1 };
        let pages = CpuPages::new(spec);
        let heads = AttnHeads { num_heads: 1, kv_heads: 1, head_dim: 2 };
        let q = Array2::zeros((3, 2));
        let short = [AttnSeq { query_start: 0, num_new: 3, num_computed: 4, block_table: &[0] }];
        assert!(matches!(paged_attention(&q, &pages, 0, heads, &short), Err(Error::Backend(BackendError::OpIndex { op: OP, .. }))));
        let bad = [AttnSeq { query_start: 0, num_new: 3, num_computed: 0, block_table: &[7] }];
        assert!(matches!(paged_attention(&q, &pages, 0, heads, &bad), Err(Error::Backend(BackendError::OpIndex { what: "block", index: 7, .. }))));
        assert!(matches!(paged_attention(&q, &pages, 1, heads, &[]), Err(Error::Backend(BackendError::OpIndex { what: "layer", .. }))));
    }
}
