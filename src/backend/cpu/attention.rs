//! Varlen causal attention over paged K/V (the reference for the GPU kernel).

use ndarray::Array2;
use rayon::prelude::*;

use super::check::{expect_cols, row_index};
use super::pages::CpuPages;
use crate::backend::{AttnHeads, AttnSeq};
use crate::{Error, Result};

const OP: &str = "paged_attention";

/// Checks one sequence against the step and the pages; returns its slots in position order.
fn seq_slots(seq: &AttnSeq<'_>, rows: usize, pages: &CpuPages) -> Result<Vec<usize>> {
    let spec = pages.spec;
    let end = seq.query_start.checked_add(seq.num_new).filter(|&e| e <= rows);
    if end.is_none() {
        return Err(Error::OpIndex { op: OP, what: "query end", index: (seq.query_start + seq.num_new) as i64, bound: rows + 1 });
    }
    let len = seq.num_computed + seq.num_new;
    let blocks_needed = len.div_ceil(spec.block_size);
    if seq.block_table.len() < blocks_needed {
        return Err(Error::OpIndex { op: OP, what: "position (block table too short)", index: len as i64 - 1, bound: seq.block_table.len() * spec.block_size });
    }
    for &b in &seq.block_table[..blocks_needed] {
        row_index(OP, "block", b as i64, spec.num_blocks)?;
    }
    Ok((0..len).map(|j| seq.block_table[j / spec.block_size] as usize * spec.block_size + j % spec.block_size).collect())
}

/// Attention of one query head of one sequence: `[num_new, head_dim]` flat.
fn head_attention(q: &Array2<f32>, k: &[f32], v: &[f32], seq: &AttnSeq<'_>, slots: &[usize], head: usize, kv_head: usize, heads: AttnHeads) -> Vec<f32> {
    let hd = heads.head_dim;
    let width = heads.kv_heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    // This KV head's keys and values, contiguous in position order.
    let gather = |page: &[f32]| -> Vec<f32> {
        slots.iter().flat_map(|&s| &page[s * width + kv_head * hd..s * width + (kv_head + 1) * hd]).copied().collect()
    };
    let (keys, values) = (gather(k), gather(v));
    let mut out = vec![0.0f32; seq.num_new * hd];
    let mut scores = Vec::with_capacity(slots.len());
    for i in 0..seq.num_new {
        let qrow = q.row(seq.query_start + i);
        let qh: Vec<f32> = qrow.iter().skip(head * hd).take(hd).copied().collect();
        let visible = seq.num_computed + i + 1;
        scores.clear();
        scores.extend(keys.chunks_exact(hd).take(visible).map(|kj| qh.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale));
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut denom = 0.0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            denom += *s;
        }
        let o = &mut out[i * hd..(i + 1) * hd];
        for (p, vj) in scores.iter().zip(values.chunks_exact(hd)) {
            let w = p / denom;
            for (acc, x) in o.iter_mut().zip(vj) {
                *acc += w * x;
            }
        }
    }
    out
}

/// See [`crate::backend::Backend::paged_attention`].
pub(crate) fn paged_attention(q: &Array2<f32>, pages: &CpuPages, layer: usize, heads: AttnHeads, seqs: &[AttnSeq<'_>]) -> Result<Array2<f32>> {
    let spec = pages.spec;
    if heads.kv_heads != spec.kv_heads || heads.head_dim != spec.head_dim || heads.kv_heads == 0 || heads.num_heads % heads.kv_heads != 0 {
        return Err(Error::OpShape {
            op: OP,
            what: "heads (num_heads, kv_heads, head_dim)",
            expected: format!("kv_heads {} dividing num_heads, head_dim {}", spec.kv_heads, spec.head_dim),
            found: vec![heads.num_heads, heads.kv_heads, heads.head_dim],
        });
    }
    expect_cols(OP, "q", q, heads.num_heads * heads.head_dim)?;
    let (k, v) = pages.kv(OP, layer)?;
    let slots = seqs.iter().map(|s| seq_slots(s, q.nrows(), pages)).collect::<Result<Vec<_>>>()?;
    let group = heads.num_heads / heads.kv_heads;
    let jobs: Vec<(usize, usize)> = (0..seqs.len()).flat_map(|s| (0..heads.num_heads).map(move |h| (s, h))).collect();
    let results: Vec<Vec<f32>> = jobs
        .par_iter()
        .map(|&(s, h)| head_attention(q, k, v, &seqs[s], &slots[s], h, h / group, heads))
        .collect();
    let hd = heads.head_dim;
    let mut out = Array2::zeros(q.raw_dim());
    for (&(s, h), res) in jobs.iter().zip(&results) {
        for (i, row) in res.chunks_exact(hd).enumerate() {
            let mut dst = out.row_mut(seqs[s].query_start + i);
            for (d, x) in dst.iter_mut().skip(h * hd).zip(row) {
                *d = *x;
            }
        }
    }
    Ok(out)
}
