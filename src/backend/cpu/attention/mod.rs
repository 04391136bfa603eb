//! Varlen causal attention over paged K/V (the reference for the GPU kernel).
//!
//! Flash-style: K and V rows are read in place from the pages (a key tile is
//! [`KEY_TILE`] positions, each row found through the block table; nothing is
//! gathered), each tile's scores are folded into every query row's running
//! softmax (max `m`, sum `l`, weighted sum `acc`) and never held for more than
//! one tile. A job is one sequence, one KV head and a tile of query rows; its
//! lane rows are (query row, query head of the KV head's group) pairs, so each
//! K/V tile is read once for all query heads that share it. Jobs run on rayon,
//! sized so each reads its K/V once while the call still has ~2 jobs a thread.
//!
//! Two layouts, one arithmetic, a file each:
//! * [`rows_in_lanes`]: lane rows in SIMD lanes (q and `acc` transposed, `[dim, lanes]`),
//!   the widest the CPU has (16 with AVX-512). A score is a broadcast key
//!   element times a vector of rows' q, a weighted sum a broadcast value element
//!   times a vector of rows' probabilities; max, `exp` and sums are lane-wise,
//!   with no horizontal reduction anywhere, so the lane count changes no bit.
//! * [`keys_in_lanes`] (decode: at most [`ROW_PATH_MAX`] lane rows): keys in lanes
//!   for scores (the tile's K transposed once), dims in lanes for `acc`.
//!
//! # One row, one arithmetic
//!
//! Cached and uncached prefills, decode and every chunking must agree to the
//! last bit, so a query row's result depends only on its position `p`, its q row
//! and the K/V rows at positions `0..=p`. For a row, both layouts compute exactly:
//! * `q' = q · (1/√d)`; tiles `t = 0..=p / KEY_TILE` (absolute positions
//!   `t·KEY_TILE..`), the last one up to `p`;
//! * score `s_j = fma(k_j[d], q'[d], ·)` chained over `d = 0, 1, …` from 0;
//! * `m' = max(m, max_j s_j)`, `α = exp(m − m')`, `p_j = exp(s_j − m')`
//!   ([`super::fast_exp::exp`]'s operations, lane-wise);
//! * `l = l·α`, then `l += p_j` in key order; `acc[d] = acc[d]·α`, then
//!   `acc[d] = fma(v_j[d], p_j, acc[d])` in key order; at the end `acc · (1/l)`.
//!
//! Keys past a row's limit never touch its state (masked lanes keep their old
//! value), so neither the rows sharing a step or a job, nor `num_computed`, nor
//! the batch, nor the job size change any row's arithmetic.
//!
//! [`kv_tile`] holds what both read: a key tile's K and V rows.

mod keys_in_lanes;
mod kv_tile;
mod rows_in_lanes;

use std::ops::Range;

use ndarray::Array2;
use rayon::prelude::*;

use super::check::{expect_cols, row_index};
use super::lanes::{Simd, Wide, WideKernel};
use super::pages::CpuPages;
use crate::Result;
use crate::backend::FloatSlice;
use crate::backend::{AttnHeads, AttnSeq};
use crate::error::BackendError;

const OP: &str = "paged_attention";

/// Positions per key tile; tile boundaries are multiples of it.
const KEY_TILE: usize = 64;

/// Most lane rows (query rows × group heads) per job: bounds a job's state
/// (`qt`, `acc`, scores: 3 × 64 KiB at head_dim 64) to L2.
const MAX_JOB_LANES: usize = 256;

/// Query rows per job, a multiple of 8. Each job reads its sequence's K/V once,
/// so jobs are as large as they can be while the call still has about two per
/// thread. Any size gives every row the same arithmetic.
fn query_tile(seqs: &[AttnSeq<'_>], kv_heads: usize, group: usize) -> usize {
    let longest = seqs.iter().map(|s| s.num_new).max().unwrap_or(0);
    let want_jobs = 2 * rayon::current_num_threads().max(1);
    let per_pair = want_jobs.div_ceil((seqs.len() * kv_heads).max(1));
    let rows = longest.div_ceil(per_pair).next_multiple_of(8);
    let cap = (MAX_JOB_LANES / group).max(8) / 8 * 8;
    rows.clamp(8, cap)
}

/// Checks one sequence against the step and the pages.
fn check_seq(seq: &AttnSeq<'_>, rows: usize, pages: &CpuPages) -> Result<()> {
    let spec = pages.spec;
    let end = seq.query_start.checked_add(seq.num_new).filter(|&e| e <= rows);
    if end.is_none() {
        return Err(BackendError::OpIndex {
            op: OP,
            what: "query end",
            index: seq.query_start.saturating_add(seq.num_new) as i64,
            bound: rows + 1,
        }
        .into());
    }
    let len = seq.num_computed.saturating_add(seq.num_new);
    let blocks_needed = len.div_ceil(spec.block_size);
    if seq.block_table.len() < blocks_needed {
        return Err(BackendError::OpIndex {
            op: OP,
            what: "position (block table too short)",
            index: len as i64 - 1,
            bound: seq.block_table.len() * spec.block_size,
        }
        .into());
    }
    for &b in &seq.block_table[..blocks_needed] {
        row_index(OP, "block", b as i64, spec.num_blocks)?;
    }
    Ok(())
}

/// What every job of one call shares.
struct Call<'a> {
    /// `q` flat, standard layout, `q_cols` floats a row.
    q: &'a [f32],
    q_cols: usize,
    /// Layer K and V pages, `[num_blocks, block_size, kv_heads, head_dim]` flat.
    k: FloatSlice<'a>,
    v: FloatSlice<'a>,
    heads: AttnHeads,
    block_size: usize,
}

/// One job: query rows `rows` (indices among the sequence's new tokens) of
/// sequence `seq`, for the query heads of KV head `kv_head`.
struct Job {
    seq: usize,
    kv_head: usize,
    rows: Range<usize>,
}

impl Job {
    /// The job's lane rows in order, (query row, group head) pairs: each one's q
    /// (its head's `head_dim` floats, unscaled) and exclusive key limit (its position + 1).
    #[inline(always)]
    fn lane_rows<'a>(
        &'a self, call: &'a Call<'_>, seq: &'a AttnSeq<'_>,
    ) -> impl Iterator<Item = (&'a [f32], usize)> {
        let hd = call.heads.head_dim;
        let group = call.heads.num_heads / call.heads.kv_heads;
        self.rows.clone().flat_map(move |i| {
            let q_row = &call.q[(seq.query_start + i) * call.q_cols..][..call.q_cols];
            (0..group).map(move |g| {
                let h = self.kv_head * group + g;
                (&q_row[h * hd..(h + 1) * hd], seq.num_computed + i + 1)
            })
        })
    }

    /// Exclusive end of the positions the job reads (its last row's limit).
    fn key_end(&self, seq: &AttnSeq<'_>) -> usize {
        seq.num_computed + self.rows.end
    }
}

/// Most lane rows a job takes through [`keys_in_lanes`] (decode: one query row
/// × a small group); more go through [`rows_in_lanes`].
const ROW_PATH_MAX: usize = 4;

/// One job of one call, run by the build [`Simd::run_wide`] picks.
struct JobTask<'a> {
    call: &'a Call<'a>,
    seq: &'a AttnSeq<'a>,
    job: &'a Job,
}

impl WideKernel for JobTask<'_> {
    type Out = Vec<f32>;
    /// The row path for a few lane rows (on 8 lanes), the lane-per-row path on the
    /// widest lanes otherwise (which one never changes a row's result).
    #[inline(always)]
    fn run<W: Wide>(self, w: W) -> Vec<f32> {
        let JobTask { call, seq, job } = self;
        let group = call.heads.num_heads / call.heads.kv_heads;
        if job.rows.len() * group <= ROW_PATH_MAX && call.heads.head_dim.is_multiple_of(8) {
            keys_in_lanes::run(w.narrow(), call, seq, job)
        } else {
            rows_in_lanes::run(w, call, seq, job)
        }
    }
}

/// See [`crate::backend::Backend::paged_attention`].
pub(crate) fn paged_attention(
    q: &Array2<f32>, pages: &CpuPages, layer: usize, heads: AttnHeads, seqs: &[AttnSeq<'_>],
) -> Result<Array2<f32>> {
    attention_with(Simd::detect(), q, pages, layer, heads, seqs)
}

fn attention_with(
    simd: Simd, q: &Array2<f32>, pages: &CpuPages, layer: usize, heads: AttnHeads, seqs: &[AttnSeq<'_>],
) -> Result<Array2<f32>> {
    let spec = pages.spec;
    if heads.kv_heads != spec.kv_heads
        || heads.head_dim != spec.head_dim
        || heads.kv_heads == 0
        || !heads.num_heads.is_multiple_of(heads.kv_heads)
    {
        return Err(BackendError::OpShape {
            op: OP,
            what: "heads (num_heads, kv_heads, head_dim)",
            expected: format!("kv_heads {} dividing num_heads, head_dim {}", spec.kv_heads, spec.head_dim),
            found: vec![heads.num_heads, heads.kv_heads, heads.head_dim],
        }
        .into());
    }
    expect_cols(OP, "q", q, heads.num_heads * heads.head_dim)?;
    let (k, v) = pages.kv(OP, layer)?;
    for s in seqs {
        check_seq(s, q.nrows(), pages)?;
    }
    let mut out = Array2::zeros(q.raw_dim());
    let hd = heads.head_dim;
    if hd == 0 || heads.num_heads == 0 {
        return Ok(out);
    }
    let q_std = q.as_standard_layout();
    let call = Call {
        q: q_std.as_slice().expect("standard layout"),
        q_cols: q.ncols(),
        k,
        v,
        heads,
        block_size: spec.block_size,
    };
    let group = heads.num_heads / heads.kv_heads;
    let tile = query_tile(seqs, heads.kv_heads, group);
    let jobs: Vec<Job> = seqs
        .iter()
        .enumerate()
        .flat_map(|(s, seq)| {
            (0..heads.kv_heads).flat_map(move |kv_head| {
                (0..seq.num_new).step_by(tile).map(move |a| Job {
                    seq: s,
                    kv_head,
                    rows: a..(a + tile).min(seq.num_new),
                })
            })
        })
        .collect();
    let results: Vec<Vec<f32>> =
        jobs.par_iter().map(|job| simd.run_wide(JobTask { call: &call, seq: &seqs[job.seq], job })).collect();
    let span = group * hd;
    for (job, res) in jobs.iter().zip(&results) {
        let seq = &seqs[job.seq];
        for (i, src) in job.rows.clone().zip(res.chunks_exact(span)) {
            let mut dst = out.row_mut(seq.query_start + i);
            let dst = dst.as_slice_mut().expect("a fresh array is standard layout");
            dst[job.kv_head * span..(job.kv_head + 1) * span].copy_from_slice(src);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::test_support::rand_rows_from;
    use crate::backend::{Dtype, PagesSpec};
    use crate::error::Error;
    use rand::SeedableRng;
    use rand::seq::SliceRandom;
    use rand_chacha::ChaCha8Rng;

    /// One sequence's K and V rows (`[len, KH*d]` each), as stored.
    type KvRows = (Array2<f32>, Array2<f32>);

    /// Dense causal attention of one sequence (f64): q `[new, H*d]`, k/v `[len, KH*d]`.
    fn dense(
        q: &Array2<f32>, k: &Array2<f32>, v: &Array2<f32>, computed: usize, heads: AttnHeads,
    ) -> Array2<f64> {
        let d = heads.head_dim;
        let group = heads.num_heads / heads.kv_heads;
        let mut out = Array2::zeros((q.nrows(), q.ncols()));
        for i in 0..q.nrows() {
            for h in 0..heads.num_heads {
                let kh = h / group;
                let scores: Vec<f64> = (0..=computed + i)
                    .map(|j| {
                        (0..d).map(|c| q[[i, h * d + c]] as f64 * k[[j, kh * d + c]] as f64).sum::<f64>()
                            / (d as f64).sqrt()
                    })
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

    /// The pages the attention tests fill: 2 layers of K/V pages, no hidden captures.
    pub(super) fn kv_spec(
        num_blocks: usize, block_size: usize, kv_heads: usize, head_dim: usize, kv_dtype: Dtype,
    ) -> PagesSpec {
        PagesSpec {
            num_layers: 2,
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
            captured: 0,
            hidden: 1,
            kv_dtype,
        }
    }

    /// Pages with one sequence per entry of `lens` in shuffled blocks; their
    /// tables and K/V (`[len, KH*d]`, position order) as stored: rounded to `spec.kv_dtype`.
    pub(super) fn fill(
        rng: &mut ChaCha8Rng, spec: PagesSpec, lens: &[usize],
    ) -> (CpuPages, Vec<Vec<u32>>, Vec<KvRows>) {
        let mut pages = CpuPages::new(spec).unwrap();
        let mut blocks: Vec<u32> = (0..spec.num_blocks as u32).collect();
        blocks.shuffle(rng);
        let mut next = 0;
        let (mut tables, mut kvs) = (Vec::new(), Vec::new());
        for &len in lens {
            let nb = len.div_ceil(spec.block_size);
            let table = blocks[next..next + nb].to_vec();
            next += nb;
            let k = rand_rows_from(rng, len, spec.kv_width());
            let v = rand_rows_from(rng, len, spec.kv_width());
            let slots: Vec<i64> = (0..len)
                .map(|j| (table[j / spec.block_size] as usize * spec.block_size + j % spec.block_size) as i64)
                .collect();
            pages.write_kv(1, &k, &v, &slots).unwrap();
            tables.push(table);
            let stored = |x: f32| match spec.kv_dtype {
                Dtype::F32 => x,
                Dtype::Bf16 => half::bf16::from_f32(x).to_f32(),
                Dtype::F16 => half::f16::from_f32(x).to_f32(),
                other => panic!("test pages in {other}"),
            };
            kvs.push((k.mapv(stored), v.mapv(stored)));
        }
        (pages, tables, kvs)
    }

    #[test]
    fn matches_dense_causal_reference_over_random_block_tables() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        // head_dim 8 and 12 (zero-padded path) on tiny shapes; 64 and 128 across key tiles.
        // (head_dim, block_size, [(tokens already computed, new tokens)] per sequence)
        type Case = (usize, usize, &'static [(usize, usize)]);
        let cases: &[Case] = &[
            (8, 4, &[(0, 7), (5, 6), (8, 1), (13, 9)]),
            (12, 4, &[(0, 7), (5, 6), (8, 1), (13, 9)]),
            (64, 16, &[(0, 70), (100, 29), (191, 1), (64, 64)]),
            (128, 5, &[(0, 33), (61, 70), (130, 1)]),
        ];
        // f16 and bf16 pages are read back widened: the same math over the rounded K/V.
        for (&(d, block_size, shapes), kv_dtype) in
            cases.iter().flat_map(|c| [Dtype::F32, Dtype::F16, Dtype::Bf16].map(|t| (c, t)))
        {
            for (num_heads, kv_heads) in [(4, 4), (4, 2), (4, 1)] {
                let heads = AttnHeads { num_heads, kv_heads, head_dim: d };
                let lens: Vec<usize> = shapes.iter().map(|&(c, n)| c + n).collect();
                let num_blocks = lens.iter().map(|l| l.div_ceil(block_size)).sum::<usize>() + 3;
                let spec = kv_spec(num_blocks, block_size, kv_heads, d, kv_dtype);
                let (pages, tables, kvs) = fill(&mut rng, spec, &lens);
                let mut q_all = Vec::new();
                let mut expected = Vec::new();
                for (&(computed, new), (k, v)) in shapes.iter().zip(&kvs) {
                    let q = rand_rows_from(&mut rng, new, num_heads * d);
                    expected.push(dense(&q, k, v, computed, heads));
                    q_all.push(q);
                }
                let views: Vec<_> = q_all.iter().map(|q| q.view()).collect();
                let q = ndarray::concatenate(ndarray::Axis(0), &views).unwrap();
                let mut start = 0;
                let seqs: Vec<AttnSeq<'_>> = shapes
                    .iter()
                    .zip(&tables)
                    .map(|(&(computed, new), table)| {
                        let s = AttnSeq {
                            query_start: start,
                            num_new: new,
                            num_computed: computed,
                            block_table: table,
                        };
                        start += new;
                        s
                    })
                    .collect();
                // Every build (8 lanes portable, 8 AVX2, 16 AVX-512) gives the portable one's bits.
                let portable = attention_with(Simd::Portable, &q, &pages, 1, heads, &seqs).unwrap();
                for simd in Simd::all() {
                    let got = attention_with(simd, &q, &pages, 1, heads, &seqs).unwrap();
                    assert_same_bits(
                        &got,
                        &portable,
                        &format!("{simd:?} vs portable: {kv_dtype} d {d} heads {num_heads}/{kv_heads}"),
                    );
                    for (s, want) in seqs.iter().zip(&expected) {
                        for ((i, c), w) in want.indexed_iter() {
                            let g = got[[s.query_start + i, c]] as f64;
                            assert!(
                                (g - w).abs() < 1e-5,
                                "{simd:?} {kv_dtype} d {d} heads {num_heads}/{kv_heads} row {i} col {c}: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Rows of `attention_with` for sequence `table` (`len` positions, q rows `q`)
    /// computed as the steps `cuts` (consecutive ranges of positions), each step in
    /// a batch with `other` (a sequence of its own placed before it).
    fn stepped(
        simd: Simd, pages: &CpuPages, heads: AttnHeads, q: &Array2<f32>, table: &[u32],
        cuts: &[Range<usize>], other: Option<(&Array2<f32>, &[u32], usize)>,
    ) -> Array2<f32> {
        let mut out = Array2::zeros(q.raw_dim());
        for cut in cuts {
            let mine = q.slice(ndarray::s![cut.clone(), ..]);
            let mut seqs = Vec::new();
            let batch_q = match other {
                Some((oq, otable, ocomputed)) => {
                    seqs.push(AttnSeq {
                        query_start: 0,
                        num_new: oq.nrows(),
                        num_computed: ocomputed,
                        block_table: otable,
                    });
                    ndarray::concatenate(ndarray::Axis(0), &[oq.view(), mine]).unwrap()
                }
                None => mine.to_owned(),
            };
            let start = batch_q.nrows() - cut.len();
            seqs.push(AttnSeq {
                query_start: start,
                num_new: cut.len(),
                num_computed: cut.start,
                block_table: table,
            });
            let got = attention_with(simd, &batch_q, pages, 1, heads, &seqs).unwrap();
            out.slice_mut(ndarray::s![cut.clone(), ..]).assign(&got.slice(ndarray::s![start.., ..]));
        }
        out
    }

    fn assert_same_bits(a: &Array2<f32>, b: &Array2<f32>, what: &str) {
        for ((i, c), x) in a.indexed_iter() {
            assert_eq!(x.to_bits(), b[[i, c]].to_bits(), "{what}: row {i} col {c}: {x} vs {}", b[[i, c]]);
        }
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init, reason = "one cut: the whole prompt in one step")]
    fn a_row_is_the_same_to_the_bit_in_any_step_chunking_or_batch() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        // K/V page types in turn over the cases (f16 and bf16 pages go through the widening path).
        let mut kv_dtypes = [Dtype::F32, Dtype::F16, Dtype::Bf16].into_iter().cycle();
        for d in [64, 128] {
            for (num_heads, kv_heads) in [(4, 4), (4, 2), (8, 2)] {
                for block_size in [16, 5] {
                    let kv_dtype = kv_dtypes.next().unwrap_or(Dtype::F32);
                    let heads = AttnHeads { num_heads, kv_heads, head_dim: d };
                    let len: usize = 203;
                    let other_len: usize = 150;
                    let num_blocks = len.div_ceil(block_size) + other_len.div_ceil(block_size) + 4;
                    let spec = kv_spec(num_blocks, block_size, kv_heads, d, kv_dtype);
                    let (pages, tables, _) = fill(&mut rng, spec, &[len, other_len]);
                    let q = rand_rows_from(&mut rng, len, num_heads * d);
                    let other_q = rand_rows_from(&mut rng, 40, num_heads * d);
                    let other = Some((&other_q, &tables[1][..], other_len - 40));
                    let portable = stepped(Simd::Portable, &pages, heads, &q, &tables[0], &[0..len], None);
                    for simd in Simd::all() {
                        let whole = stepped(simd, &pages, heads, &q, &tables[0], &[0..len], None);
                        assert_same_bits(
                            &whole,
                            &portable,
                            &format!(
                                "{simd:?} vs portable: {kv_dtype} d {d} {num_heads}/{kv_heads} bs {block_size}"
                            ),
                        );
                        // Cuts on and off key tiles (64) and blocks; a one-row step; a decode tail.
                        let chunks =
                            [0..1, 1..64, 64..65, 65..130, 130..131, 131..200, 200..201, 201..202, 202..203];
                        let chunked = stepped(simd, &pages, heads, &q, &tables[0], &chunks, None);
                        assert_same_bits(
                            &whole,
                            &chunked,
                            &format!(
                                "{simd:?} {kv_dtype} d {d} {num_heads}/{kv_heads} bs {block_size}: chunked"
                            ),
                        );
                        let batched = stepped(simd, &pages, heads, &q, &tables[0], &[0..77, 77..203], other);
                        assert_same_bits(
                            &whole,
                            &batched,
                            &format!("{simd:?} d {d} {num_heads}/{kv_heads} bs {block_size}: batched"),
                        );
                        let singles: Vec<Range<usize>> = (0..len).map(|p| p..p + 1).collect();
                        let one_by_one = stepped(simd, &pages, heads, &q, &tables[0], &singles, other);
                        assert_same_bits(
                            &whole,
                            &one_by_one,
                            &format!(
                                "{simd:?} d {d} {num_heads}/{kv_heads} bs {block_size}: one row per step"
                            ),
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn decode_batches_equal_single_sequence_calls() {
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        let heads = AttnHeads { num_heads: 8, kv_heads: 2, head_dim: 64 };
        let lens = [1, 63, 64, 65, 130, 300];
        let num_blocks = lens.iter().map(|l: &usize| l.div_ceil(16)).sum::<usize>();
        let spec = kv_spec(num_blocks, 16, 2, 64, Dtype::F32);
        let (pages, tables, _) = fill(&mut rng, spec, &lens);
        let q = rand_rows_from(&mut rng, lens.len(), 8 * 64);
        let seqs: Vec<AttnSeq<'_>> = lens
            .iter()
            .zip(&tables)
            .enumerate()
            .map(|(i, (&l, t))| AttnSeq { query_start: i, num_new: 1, num_computed: l - 1, block_table: t })
            .collect();
        for simd in Simd::all() {
            let all = attention_with(simd, &q, &pages, 1, heads, &seqs).unwrap();
            for (i, s) in seqs.iter().enumerate() {
                let one = attention_with(
                    simd,
                    &q.slice(ndarray::s![i..i + 1, ..]).to_owned(),
                    &pages,
                    1,
                    heads,
                    &[AttnSeq { query_start: 0, ..*s }],
                )
                .unwrap();
                assert_same_bits(
                    &all.slice(ndarray::s![i..i + 1, ..]).to_owned(),
                    &one,
                    &format!("{simd:?} seq {i}"),
                );
            }
        }
    }

    #[test]
    fn rejects_a_short_block_table_and_a_bad_block() {
        let spec = PagesSpec {
            num_layers: 1,
            num_blocks: 2,
            block_size: 4,
            kv_heads: 1,
            head_dim: 2,
            captured: 0,
            hidden: 1,
            kv_dtype: Dtype::F32,
        };
        let pages = CpuPages::new(spec).unwrap();
        let heads = AttnHeads { num_heads: 1, kv_heads: 1, head_dim: 2 };
        let q = Array2::zeros((3, 2));
        let short = [AttnSeq { query_start: 0, num_new: 3, num_computed: 4, block_table: &[0] }];
        assert!(matches!(
            paged_attention(&q, &pages, 0, heads, &short),
            Err(Error::Backend(BackendError::OpIndex { op: OP, .. }))
        ));
        let bad = [AttnSeq { query_start: 0, num_new: 3, num_computed: 0, block_table: &[7] }];
        assert!(matches!(
            paged_attention(&q, &pages, 0, heads, &bad),
            Err(Error::Backend(BackendError::OpIndex { what: "block", index: 7, .. }))
        ));
        assert!(matches!(
            paged_attention(&q, &pages, 1, heads, &[]),
            Err(Error::Backend(BackendError::OpIndex { what: "layer", .. }))
        ));
    }
}
