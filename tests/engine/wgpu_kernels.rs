//! Every wgpu kernel against the CPU reference backend on seeded random shapes:
//! random block tables, non-aligned lengths, empty and full prefixes, mixed
//! prefill + decode batches, GQA ratios 1/2/4, pools split over several bindings.
//! Decode runs through the subgroup kernel where the device has subgroups (lavapipe
//! must) and through the portable kernel on a device opened `without_subgroups`.
//!
//! Without an adapter these tests print a loud skip message and pass, unless
//! `OMNIPREFIX_REQUIRE_GPU=1` (CI) makes them fail (see `shared_gpu`). Run with
//! `WGPU_BACKEND=vulkan` on machines with lavapipe. Case counts scale with `PROPTEST_CASES`.

use crate::shared_gpu;

use std::io::Write;
use std::sync::Arc;

use ndarray::Array2;
use omniprefix::backend::cpu::CpuBackend;
use omniprefix::backend::wgpu::{WgpuBackend, prefill_slots, prefill_tiles};
use omniprefix::backend::{
    AttnHeads, AttnSeq, Backend, Dtype, HostWeight, MoeWeights, PagesSpec, RopeKind, RopePositions, RopeSpec,
};
use omniprefix::error::{BackendError, ConfigError, GpuError};
use omniprefix::index::BlockId;
use omniprefix::{Error, Result};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use shared_gpu::{gpu, gpu_with, gpu_without_f16, gpu_without_subgroups};

const TOL: f32 = 1e-4;

/// Binding cap small enough to split the test pools into several chunks.
const SMALL_BINDING: u64 = 4096;

fn rand_matrix(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Array2<f32> {
    Array2::from_shape_fn((rows, cols), |_| rng.random::<f32>() * 2.0 - 1.0)
}

/// Asserts `got ≈ want` element-wise, relative to magnitude; names the first failing index.
fn assert_close(what: &str, got: &Array2<f32>, want: &Array2<f32>) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    for ((idx, g), w) in got.indexed_iter().zip(want.iter()) {
        assert!(
            (g - w).abs() <= TOL * (1.0 + w.abs()),
            "{what}: first mismatch at {idx:?}: gpu {g} vs cpu {w}"
        );
    }
}

/// The same op on both backends, downloaded.
fn both(
    gpu: &WgpuBackend, f_gpu: impl FnOnce(&WgpuBackend) -> Result<<WgpuBackend as Backend>::Tensor>,
    f_cpu: impl FnOnce(&CpuBackend) -> Result<Array2<f32>>,
) -> (Array2<f32>, Array2<f32>) {
    let g = f_gpu(gpu).and_then(|t| gpu.download(&t)).expect("gpu op");
    let c = f_cpu(&CpuBackend).expect("cpu op");
    (g, c)
}

/// A sequence of a random attention batch.
#[derive(Debug, Clone)]
struct SeqCase {
    num_computed: usize,
    num_new: usize,
    table: Vec<BlockId>,
}

/// Random varlen batch over a shuffled block pool: each sequence gets distinct blocks.
fn random_batch(rng: &mut ChaCha8Rng, spec: &PagesSpec, lens: &[(usize, usize)]) -> Vec<SeqCase> {
    let mut free: Vec<BlockId> = (0..spec.num_blocks as BlockId).collect();
    free.shuffle(rng);
    lens.iter()
        .map(|&(num_computed, num_new)| {
            let blocks = (num_computed + num_new).div_ceil(spec.block_size);
            let table = free.split_off(free.len() - blocks);
            SeqCase { num_computed, num_new, table }
        })
        .collect()
}

/// Slots of positions `range` of a sequence.
fn slots(seq: &SeqCase, range: std::ops::Range<usize>, block_size: usize) -> Vec<i64> {
    range.map(|j| (seq.table[j / block_size] as usize * block_size + j % block_size) as i64).collect()
}

/// Writes prefix K/V, then the new rows' K/V, on both backends; returns q and the batch.
struct AttnSetup {
    gpu_pages: <WgpuBackend as Backend>::Pages,
    cpu_pages: <CpuBackend as Backend>::Pages,
    q: Array2<f32>,
    seqs: Vec<SeqCase>,
}

fn setup_attention(
    gpu: &WgpuBackend, rng: &mut ChaCha8Rng, spec: PagesSpec, heads: AttnHeads, layer: usize,
    lens: &[(usize, usize)],
) -> AttnSetup {
    let seqs = random_batch(rng, &spec, lens);
    let mut gpu_pages = gpu.alloc_pages(spec).expect("gpu pages");
    let mut cpu_pages = CpuBackend.alloc_pages(spec).expect("cpu pages");
    for seq in &seqs {
        // The prefix first (an earlier step), then the new rows (this step).
        for range in [0..seq.num_computed, seq.num_computed..seq.num_computed + seq.num_new] {
            let s = slots(seq, range.clone(), spec.block_size);
            let k = rand_matrix(rng, s.len(), spec.kv_width());
            let v = rand_matrix(rng, s.len(), spec.kv_width());
            let (gk, gv) = (gpu.upload(k.view()).unwrap(), gpu.upload(v.view()).unwrap());
            gpu.write_kv(&mut gpu_pages, layer, &gk, &gv, &s).expect("gpu write_kv");
            CpuBackend.write_kv(&mut cpu_pages, layer, &k, &v, &s).expect("cpu write_kv");
        }
    }
    let total: usize = seqs.iter().map(|s| s.num_new).sum();
    let q = rand_matrix(rng, total, heads.num_heads * heads.head_dim);
    AttnSetup { gpu_pages, cpu_pages, q, seqs }
}

fn attn_seqs(seqs: &[SeqCase]) -> Vec<AttnSeq<'_>> {
    let mut start = 0;
    seqs.iter()
        .map(|s| {
            let a = AttnSeq {
                query_start: start,
                num_new: s.num_new,
                num_computed: s.num_computed,
                block_table: &s.table,
            };
            start += s.num_new;
            a
        })
        .collect()
}

fn random_lens(rng: &mut ChaCha8Rng, block_size: usize, n: usize) -> Vec<(usize, usize)> {
    (0..n)
        .map(|i| match i % 4 {
            0 => (0, rng.random_range(1..12)), // empty prefix
            1 => (block_size * rng.random_range(1..3), rng.random_range(1..7)), // full blocks cached
            2 => (rng.random_range(1..30), 1), // decode row
            _ => (rng.random_range(1..25), rng.random_range(2..9)), // non-aligned prefix
        })
        .collect()
}

/// Pages of K/V only (no captured rows): `num_layers` layers of `num_blocks`
/// blocks of `block_size` slots, `kv_heads` heads of `head_dim`, in `kv_dtype`.
fn kv_pages(
    num_layers: usize, num_blocks: usize, block_size: usize, kv_heads: usize, head_dim: usize,
    kv_dtype: Dtype,
) -> PagesSpec {
    PagesSpec { num_layers, num_blocks, block_size, kv_heads, head_dim, captured: 0, hidden: 0, kv_dtype }
}

#[test]
fn paged_attention_matches_cpu_for_mixed_batches_and_gqa() {
    let Some(gpu) = gpu() else { return };
    mixed_batches_match_cpu(&gpu, Dtype::F32, 1);
}

/// f16 pages: `write_kv` rounds on both backends, attention widens to f32.
#[test]
fn f16_pages_match_cpu_f16_pages_for_mixed_batches_and_gqa() {
    let Some(gpu) = gpu() else { return };
    mixed_batches_match_cpu(&gpu, Dtype::F16, 13);
}

/// Random varlen batches (GQA 1/2/4/8/3/6, odd block sizes) over pages of `kv_dtype`:
/// the routed kernels and the prefill kernel alone against the CPU.
fn mixed_batches_match_cpu(gpu: &WgpuBackend, kv_dtype: Dtype, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for case in 0..u64::from(support::cases(6)) {
        let group = [1, 2, 4, 8, 3, 6][case as usize % 6];
        let kv_heads = rng.random_range(1..3);
        let head_dim = [8, 12, 16][rng.random_range(0..3)];
        let block_size = [4, 5, 16][rng.random_range(0..3)];
        let heads = AttnHeads { num_heads: kv_heads * group, kv_heads, head_dim };
        let spec = kv_pages(2, 40, block_size, kv_heads, head_dim, kv_dtype);
        let n_seqs = rng.random_range(1..5);
        let lens = random_lens(&mut rng, block_size, n_seqs);
        let s = setup_attention(gpu, &mut rng, spec, heads, 1, &lens);
        let seqs = attn_seqs(&s.seqs);
        let q_gpu = gpu.upload(s.q.view()).unwrap();
        let got = gpu.download(&gpu.paged_attention(&q_gpu, &s.gpu_pages, 1, heads, &seqs).unwrap()).unwrap();
        let want = CpuBackend.paged_attention(&s.q, &s.cpu_pages, 1, heads, &seqs).unwrap();
        assert_close(
            &format!("{kv_dtype} case {case} {heads:?} block {block_size} lens {lens:?}"),
            &got,
            &want,
        );

        // The prefill kernel alone handles every row too (decode rows included).
        let kv = s.gpu_pages.layer("test", 1).unwrap();
        let prefill = gpu.context().paged_prefill_attention(&q_gpu, kv, heads, &seqs).unwrap();
        assert_close(
            &format!("{kv_dtype} case {case} prefill kernel"),
            &gpu.download(&prefill).unwrap(),
            &want,
        );
    }
}

#[test]
fn decode_attention_split_kv_matches_cpu_for_every_split_length() {
    let Some(gpu) = gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    for (group, kv_dtype) in [(1, Dtype::F32), (2, Dtype::F32), (4, Dtype::F32), (2, Dtype::F16)] {
        let heads = AttnHeads { num_heads: 2 * group, kv_heads: 2, head_dim: 16 };
        let spec = kv_pages(1, 64, 8, 2, 16, kv_dtype);
        // Long, short, block-aligned and single-key contexts in one decode batch.
        let lens = [(149, 1), (7, 1), (64, 1), (0, 1)];
        let s = setup_attention(&gpu, &mut rng, spec, heads, 0, &lens);
        let seqs = attn_seqs(&s.seqs);
        let want = CpuBackend.paged_attention(&s.q, &s.cpu_pages, 0, heads, &seqs).unwrap();
        let q_gpu = gpu.upload(s.q.view()).unwrap();
        let kv = s.gpu_pages.layer("test", 0).unwrap();
        for split_len in [1, 7, 64, 150, 4096] {
            let out = gpu.context().paged_decode_attention(&q_gpu, kv, heads, &seqs, split_len).unwrap();
            assert_close(
                &format!("{kv_dtype} group {group} split_len {split_len}"),
                &gpu.download(&out).unwrap(),
                &want,
            );
        }
    }
}

/// (GQA group, KV heads, head dim, page dtype) of the subgroup decode tests: every group
/// size, head dims that are no multiple of any subgroup size (3, 12, 40; f16 pages need
/// an even width), and 128 and 256 once.
const DECODE_CASES: [(usize, usize, usize, Dtype); 11] = [
    (1, 2, 12, Dtype::F32),
    (2, 1, 40, Dtype::F16),
    (4, 2, 12, Dtype::F16),
    (8, 1, 40, Dtype::F32),
    (1, 1, 40, Dtype::F16),
    (2, 2, 3, Dtype::F32),
    (8, 2, 12, Dtype::F16),
    (4, 1, 40, Dtype::F32),
    (2, 2, 128, Dtype::F32),
    (8, 1, 256, Dtype::F16),
    (4, 3, 5, Dtype::F32),
];

/// Split lengths the decode tests pass to `paged_decode_attention`: one key per split,
/// splits ending mid-tile, one 64-key tile, and a single split.
const SPLIT_LENS: [usize; 5] = [1, 5, 64, 97, 4096];

/// The shared device, checked to run decode through the subgroup kernel. On lavapipe
/// (which has `Features::SUBGROUP`) under `OMNIPREFIX_REQUIRE_GPU=1` a device without
/// subgroups fails loudly: CI must not test only the fallback. Elsewhere `None` after a
/// loud message.
fn subgroup_gpu(cap: Option<u64>) -> Option<WgpuBackend> {
    let gpu = gpu_with(cap)?;
    let ctx = gpu.context();
    if ctx.has_subgroups() {
        return Some(gpu);
    }
    let info = ctx.adapter_info();
    let lavapipe = info.name.contains("llvmpipe") || info.driver.contains("llvmpipe");
    if lavapipe && std::env::var("OMNIPREFIX_REQUIRE_GPU").as_deref() == Ok("1") {
        panic!(
            "OMNIPREFIX_REQUIRE_GPU=1 on lavapipe, which has Features::SUBGROUP, but subgroups are off: {info:?}"
        );
    }
    let _ = writeln!(
        std::io::stderr(),
        "\n!!!!!!!! SKIPPING subgroup decode test: adapter {} has no subgroups !!!!!!!!\n",
        ctx.adapter_name()
    );
    None
}

/// Random decode contexts for `block_size`: empty, block-aligned, short and long (past
/// several 64-key tiles), 3 to 5 sequences.
fn random_decode_lens(rng: &mut ChaCha8Rng, block_size: usize) -> Vec<(usize, usize)> {
    let n = rng.random_range(3..6);
    (0..n)
        .map(|i| match i % 4 {
            0 => (rng.random_range(130..300), 1),
            1 => (0, 1),
            2 => (block_size * rng.random_range(1..9), 1),
            _ => (rng.random_range(1..70), 1),
        })
        .collect()
}

/// Every [`DECODE_CASES`] shape on a random decode batch (seeded by `seed`), through
/// `paged_decode_attention` at every [`SPLIT_LENS`] and through the routed
/// `paged_attention`, against the CPU. Returns the GPU outputs in order.
fn decode_batches_match_cpu(gpu: &WgpuBackend, seed: u64) -> Vec<Array2<f32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let kernel = if gpu.context().has_subgroups() { "subgroup" } else { "portable" };
    let mut outputs = Vec::new();
    for (case, &(group, kv_heads, head_dim, kv_dtype)) in DECODE_CASES.iter().enumerate() {
        let block_size = [4, 5, 16][case % 3];
        let heads = AttnHeads { num_heads: kv_heads * group, kv_heads, head_dim };
        let lens = random_decode_lens(&mut rng, block_size);
        let num_blocks = lens.iter().map(|&(c, n)| (c + n).div_ceil(block_size)).sum::<usize>() + 3;
        let spec = kv_pages(1, num_blocks, block_size, kv_heads, head_dim, kv_dtype);
        let s = setup_attention(gpu, &mut rng, spec, heads, 0, &lens);
        let seqs = attn_seqs(&s.seqs);
        let want = CpuBackend.paged_attention(&s.q, &s.cpu_pages, 0, heads, &seqs).unwrap();
        let q_gpu = gpu.upload(s.q.view()).unwrap();
        let kv = s.gpu_pages.layer("test", 0).unwrap();
        let what = format!("{kernel} kernel, {kv_dtype} {heads:?} block {block_size} lens {lens:?}");
        for split_len in SPLIT_LENS {
            let out = gpu.context().paged_decode_attention(&q_gpu, kv, heads, &seqs, split_len).unwrap();
            let out = gpu.download(&out).unwrap();
            assert_close(&format!("{what} split_len {split_len}"), &out, &want);
            outputs.push(out);
        }
        let routed =
            gpu.download(&gpu.paged_attention(&q_gpu, &s.gpu_pages, 0, heads, &seqs).unwrap()).unwrap();
        assert_close(&format!("{what} routed"), &routed, &want);
        outputs.push(routed);
    }
    outputs
}

/// CI on lavapipe (`OMNIPREFIX_REQUIRE_GPU=1`) runs decode through the subgroup kernel,
/// not only the fallback; `without_subgroups` turns it off.
#[test]
fn subgroups_are_on_where_the_adapter_has_them() {
    let Some(gpu) = subgroup_gpu(None) else { return };
    assert!(gpu.context().has_subgroups());
    let Some(capped) = subgroup_gpu(Some(SMALL_BINDING)) else { return };
    assert!(capped.context().has_subgroups());
    for cap in [None, Some(SMALL_BINDING)] {
        let portable = gpu_without_subgroups(cap).expect("a device opens with the option as without it");
        assert!(!portable.context().has_subgroups(), "without_subgroups, cap {cap:?}");
    }
}

#[test]
fn subgroup_decode_matches_cpu_for_gqa_head_dims_dtypes_and_splits() {
    let Some(gpu) = subgroup_gpu(None) else { return };
    decode_batches_match_cpu(&gpu, 21);
}

/// A device opened `without_subgroups` takes the portable kernel and gives the subgroup
/// kernel's results on the same batches.
#[test]
fn without_subgroups_decode_takes_the_portable_kernel_with_the_same_results() {
    let Some(portable) = gpu_without_subgroups(None) else { return };
    assert!(!portable.context().has_subgroups(), "without_subgroups must turn subgroups off");
    let fallback = decode_batches_match_cpu(&portable, 21);
    let Some(gpu) = subgroup_gpu(None) else { return };
    let subgroup = decode_batches_match_cpu(&gpu, 21);
    assert_eq!(fallback.len(), subgroup.len());
    for (i, (a, b)) in fallback.iter().zip(&subgroup).enumerate() {
        assert_close(&format!("portable vs subgroup output {i}"), a, b);
    }
}

/// Decode over K/V pools split into two chunks (a 4 KiB binding cap), f32 and f16 pages,
/// through the subgroup kernel and the portable one.
#[test]
fn decode_over_two_chunk_pools_matches_cpu_in_both_kernels() {
    let Some(gpu) = subgroup_gpu(Some(SMALL_BINDING)) else { return };
    let Some(portable) = gpu_without_subgroups(Some(SMALL_BINDING)) else { return };
    // K blocks: 4 slots x 2 heads x 12 dims x 4 B = 384 B → 10 blocks per chunk (f16: 21).
    for (kv_dtype, num_blocks, seed) in [(Dtype::F32, 20, 31), (Dtype::F16, 30, 32)] {
        let heads = AttnHeads { num_heads: 8, kv_heads: 2, head_dim: 12 };
        let spec = kv_pages(1, num_blocks, 4, 2, 12, kv_dtype);
        for backend in [&gpu, &portable] {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let s = setup_attention(backend, &mut rng, spec, heads, 0, &[(37, 1), (0, 1), (20, 1), (11, 1)]);
            let kv = s.gpu_pages.layer("test", 0).unwrap();
            assert_eq!(kv.k.num_chunks(), 2, "K pool must be split");
            let seqs = attn_seqs(&s.seqs);
            let want = CpuBackend.paged_attention(&s.q, &s.cpu_pages, 0, heads, &seqs).unwrap();
            let q_gpu = backend.upload(s.q.view()).unwrap();
            let kernel = if backend.context().has_subgroups() { "subgroup" } else { "portable" };
            // Split lengths with few enough partials to fit the small binding too.
            for split_len in [19, 30, 4096] {
                let out =
                    backend.context().paged_decode_attention(&q_gpu, kv, heads, &seqs, split_len).unwrap();
                let what = format!("{kernel} kernel, two-chunk {kv_dtype} pool, split_len {split_len}");
                assert_close(&what, &backend.download(&out).unwrap(), &want);
            }
            let routed = backend.paged_attention(&q_gpu, &s.gpu_pages, 0, heads, &seqs).unwrap();
            assert_close(
                &format!("{kernel} kernel, two-chunk {kv_dtype} pool, routed"),
                &backend.download(&routed).unwrap(),
                &want,
            );
        }
    }
}

#[test]
fn long_contexts_span_several_key_tiles_in_both_kernels() {
    let Some(gpu) = gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    // Contexts of 1..3 tiles of 64 keys, prefixes ending mid-tile and on a tile edge.
    let heads = AttnHeads { num_heads: 4, kv_heads: 2, head_dim: 8 };
    let spec = kv_pages(1, 128, 4, 2, 8, Dtype::F32);
    let s = setup_attention(&gpu, &mut rng, spec, heads, 0, &[(130, 5), (64, 3), (0, 70), (191, 1)]);
    let seqs = attn_seqs(&s.seqs);
    let want = CpuBackend.paged_attention(&s.q, &s.cpu_pages, 0, heads, &seqs).unwrap();
    let q = gpu.upload(s.q.view()).unwrap();
    let routed = gpu.paged_attention(&q, &s.gpu_pages, 0, heads, &seqs).unwrap();
    assert_close("long contexts, routed", &gpu.download(&routed).unwrap(), &want);
    let kv = s.gpu_pages.layer("test", 0).unwrap();
    let prefill = gpu.context().paged_prefill_attention(&q, kv, heads, &seqs).unwrap();
    assert_close("long contexts, prefill kernel", &gpu.download(&prefill).unwrap(), &want);
}

/// Lens that put the prefill kernel's tile edges (`rows` query rows per tile, KT keys)
/// where bugs hide: num_new below, equal to and above `rows` (several query tiles, the
/// last partial when rows > 1), prefixes on a K tile edge and mid tile, rows straddling a
/// K tile edge, a decode row.
fn tile_edge_lens(rng: &mut ChaCha8Rng, rows: usize, kt: usize) -> Vec<(usize, usize)> {
    let mut lens = vec![
        (kt, rows), // equal, prefix on an edge
        (kt + rng.random_range(1..kt.max(2)), 2 * rows + rng.random_range(1..rows.max(2))), // above, last tile partial
        (rng.random_range(0..kt), (rows - 1).max(2)), // below (or 2 one-row tiles)
        (kt - 1, rows + 1),                           // row 0 sees exactly KT keys
        (rng.random_range(1..2 * kt), 1),             // decode row
    ];
    lens.shuffle(rng);
    lens
}

/// `lens` through the prefill kernel alone and through the routed kernels, against the CPU.
fn prefill_matches_cpu(
    gpu: &WgpuBackend, rng: &mut ChaCha8Rng, spec: PagesSpec, heads: AttnHeads, lens: &[(usize, usize)],
    what: &str,
) {
    let s = setup_attention(gpu, rng, spec, heads, 0, lens);
    let seqs = attn_seqs(&s.seqs);
    let want = CpuBackend.paged_attention(&s.q, &s.cpu_pages, 0, heads, &seqs).unwrap();
    let q = gpu.upload(s.q.view()).unwrap();
    let kv = s.gpu_pages.layer("test", 0).unwrap();
    let prefill = gpu.context().paged_prefill_attention(&q, kv, heads, &seqs).unwrap();
    assert_close(&format!("{what}, prefill kernel"), &gpu.download(&prefill).unwrap(), &want);
    let routed = gpu.paged_attention(&q, &s.gpu_pages, 0, heads, &seqs).unwrap();
    assert_close(&format!("{what}, routed"), &gpu.download(&routed).unwrap(), &want);
}

/// The tiled prefill kernel on random batches at its tile edges, f32 and f16 pages, odd
/// block sizes: head dims with every tile shape (8 and 12: TQ 16 / KT 64; 24; 40: KT 51;
/// 128: 8 / 16; 256: 4 / 8) crossed with GQA groups that fill a tile's query slots with
/// several rows (1, 2, 4, 8 at TQ 16), leave slots idle (3 and 6 do not divide TQ), are
/// one row per tile (8 at TQ 8, 2 at TQ 4) or split over workgroups (8 and 5 at TQ 4);
/// then random head dims 1..=256 and groups 1..=8.
#[test]
fn tiled_prefill_matches_cpu_at_tile_edges_for_every_head_dim() {
    let Some(gpu) = gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let fixed = [
        (8, 1),
        (24, 2),
        (40, 4),
        (64, 8),
        (128, 8),
        (256, 8),
        (256, 5),
        (12, 3),
        (128, 3),
        (16, 6),
        (256, 2),
    ];
    let mut shapes: Vec<(usize, usize, Dtype)> =
        fixed.iter().flat_map(|&(d, g)| [(d, g, Dtype::F32), (d, g, Dtype::F16)]).collect();
    for case in 0..u64::from(support::cases(6)) {
        let kv_dtype = [Dtype::F32, Dtype::F16][case as usize % 2];
        shapes.push((rng.random_range(1..=256), rng.random_range(1..=8), kv_dtype));
    }
    for (case, (head_dim, group, kv_dtype)) in shapes.into_iter().enumerate() {
        // f16 pages hold whole pairs: an odd head_dim needs an even number of KV heads.
        let kv_heads = if kv_dtype == Dtype::F16 && head_dim % 2 == 1 { 2 } else { rng.random_range(1..3) };
        let block_size = [4, 5, 16][rng.random_range(0..3)];
        let heads = AttnHeads { num_heads: kv_heads * group, kv_heads, head_dim };
        let tiles = prefill_tiles(head_dim);
        let (rows, tile_heads) = prefill_slots(tiles.0, group);
        let lens = tile_edge_lens(&mut rng, rows, tiles.1);
        let num_blocks = lens.iter().map(|&(c, n)| (c + n).div_ceil(block_size)).sum::<usize>() + 3;
        let spec = kv_pages(1, num_blocks, block_size, kv_heads, head_dim, kv_dtype);
        let what = format!(
            "case {case} {kv_dtype} {heads:?} tiles {tiles:?} slots {rows} x {tile_heads} block {block_size} lens {lens:?}"
        );
        prefill_matches_cpu(&gpu, &mut rng, spec, heads, &lens, &what);
    }
}

/// The tiled prefill kernel reads K/V tiles whose keys lie in both chunks of a pool
/// split over two bindings, f32 and f16 pages, GQA groups 1, 2 and 8 (one K/V tile for
/// several heads, whose slots then hold fewer rows).
#[test]
fn tiled_prefill_reads_tiles_across_pool_chunks() {
    let Some(gpu) = gpu_with(Some(SMALL_BINDING)) else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(18);
    let (tq, kt) = prefill_tiles(8);
    for group in [1, 2, 8] {
        let heads = AttnHeads { num_heads: group, kv_heads: 1, head_dim: 8 };
        let (rows, _) = prefill_slots(tq, group);
        for (kv_dtype, elem_bytes) in [(Dtype::F32, 4), (Dtype::F16, 2)] {
            // Blocks of 4 slots x 8 dims: two chunks' worth under the small binding.
            let num_blocks = 2 * SMALL_BINDING as usize / (4 * 8 * elem_bytes);
            let spec = kv_pages(1, num_blocks, 4, 1, 8, kv_dtype);
            // q and out must fit the small binding too: at most 1024 floats (49 rows of 8,
            // 25 of 16, 8 of 64 here).
            let lens = [(kt, rows), (kt + 6, rows + 1), (0, (rows - 1).max(2)), (13, 1)];
            assert!(lens.iter().map(|l| l.1).sum::<usize>() * group * 8 <= 1024, "q fits the small binding");
            let pages = gpu.alloc_pages(spec).unwrap();
            assert_eq!(pages.layer("test", 0).unwrap().k.num_chunks(), 2, "K pool must be split");
            let what = format!("split {kv_dtype} pool, group {group}, tiles {tq} x {kt}, {rows} rows");
            prefill_matches_cpu(&gpu, &mut rng, spec, heads, &lens, &what);
        }
    }
}

#[test]
fn decode_kernel_rejects_rows_that_are_not_single_tokens() {
    let Some(gpu) = gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let heads = AttnHeads { num_heads: 2, kv_heads: 1, head_dim: 8 };
    let spec = kv_pages(1, 8, 4, 1, 8, Dtype::F32);
    let s = setup_attention(&gpu, &mut rng, spec, heads, 0, &[(3, 2)]);
    let q = gpu.upload(s.q.view()).unwrap();
    let kv = s.gpu_pages.layer("test", 0).unwrap();
    let err = gpu.context().paged_decode_attention(&q, kv, heads, &attn_seqs(&s.seqs), 64).unwrap_err();
    assert!(matches!(err, Error::Backend(BackendError::OpShape { what: "num_new", .. })), "{err}");
}

#[test]
fn attention_rejects_bad_tables_and_unsupported_heads() {
    let Some(gpu) = gpu() else { return };
    let spec = kv_pages(1, 4, 4, 1, 8, Dtype::F32);
    let pages = gpu.alloc_pages(spec).unwrap();
    let heads = AttnHeads { num_heads: 2, kv_heads: 1, head_dim: 8 };
    let q = gpu.upload(Array2::zeros((3, 16)).view()).unwrap();
    let seq = |table: &'static [BlockId]| AttnSeq {
        query_start: 0,
        num_new: 3,
        num_computed: 2,
        block_table: table,
    };
    let err = gpu.paged_attention(&q, &pages, 0, heads, &[seq(&[0])]).unwrap_err();
    assert!(
        matches!(err, Error::Backend(BackendError::OpIndex { what: "position (block table too short)", .. })),
        "{err}"
    );
    let err = gpu.paged_attention(&q, &pages, 0, heads, &[seq(&[0, 9])]).unwrap_err();
    assert!(
        matches!(err, Error::Backend(BackendError::OpIndex { what: "block", index: 9, bound: 4, .. })),
        "{err}"
    );
    let err = gpu.paged_attention(&q, &pages, 1, heads, &[seq(&[0, 1])]).unwrap_err();
    assert!(matches!(err, Error::Backend(BackendError::OpIndex { what: "layer", index: 1, .. })), "{err}");
    let wide = AttnHeads { num_heads: 16, kv_heads: 1, head_dim: 8 };
    let q_wide = gpu.upload(Array2::zeros((3, 128)).view()).unwrap();
    let err = gpu.paged_attention(&q_wide, &pages, 0, wide, &[seq(&[0, 1])]).unwrap_err();
    assert!(
        matches!(err, Error::Gpu(GpuError::Unsupported { what: "num_heads / kv_heads", value: 16, .. })),
        "{err}"
    );
}

#[test]
fn hidden_pages_and_copy_blocks_match_cpu() {
    let Some(gpu) = gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    for case in 0..u64::from(support::cases(6)) {
        // f32 and f16 K/V pages in turn (hidden pages are f32 either way).
        let kv_dtype = [Dtype::F32, Dtype::F16][case as usize % 2];
        let spec = PagesSpec {
            num_layers: 2,
            num_blocks: 12,
            block_size: 4,
            kv_heads: 1,
            head_dim: 4,
            captured: 3,
            hidden: 5,
            kv_dtype,
        };
        let mut gp = gpu.alloc_pages(spec).unwrap();
        let mut cp = CpuBackend.alloc_pages(spec).unwrap();
        let n = rng.random_range(1..20);
        let slots: Vec<i64> = (0..n).map(|_| rng.random_range(-3..spec.num_slots() as i64)).collect();
        for capture in 0..spec.captured {
            let x = rand_matrix(&mut rng, n, spec.hidden);
            gpu.write_hidden(&mut gp, capture, &gpu.upload(x.view()).unwrap(), &slots).unwrap();
            CpuBackend.write_hidden(&mut cp, capture, &x, &slots).unwrap();
            let k = rand_matrix(&mut rng, n, spec.kv_width());
            let (gk, layer) = (gpu.upload(k.view()).unwrap(), capture % 2);
            gpu.write_kv(&mut gp, layer, &gk, &gk, &slots).unwrap();
            CpuBackend.write_kv(&mut cp, layer, &k, &k, &slots).unwrap();
        }
        // In-order copies, including a chain (a block copied, then copied on) and a self copy.
        let copies: Vec<(BlockId, BlockId)> =
            vec![(1, 2), (2, 3), (5, 5), (rng.random_range(0..12), 7), (7, 0)];
        gpu.copy_blocks(&mut gp, &copies).unwrap();
        CpuBackend.copy_blocks(&mut cp, &copies).unwrap();
        let read: Vec<i64> = (-1..spec.num_slots() as i64).collect();
        for capture in 0..spec.captured {
            let (g, c) = both(
                &gpu,
                |b| b.gather_hidden(&gp, capture, &read),
                |b| b.gather_hidden(&cp, capture, &read),
            );
            assert_close(&format!("case {case} capture {capture} copies {copies:?}"), &g, &c);
        }
        // K/V after the copies, read back through attention over every slot of a table.
        let heads = AttnHeads { num_heads: 1, kv_heads: 1, head_dim: 4 };
        let table: Vec<BlockId> = (0..12).collect();
        let q = rand_matrix(&mut rng, 1, 4);
        let seq = [AttnSeq { query_start: 0, num_new: 1, num_computed: 47, block_table: &table }];
        for layer in 0..2 {
            let (g, c) = both(
                &gpu,
                |b| b.paged_attention(&b.upload(q.view())?, &gp, layer, heads, &seq),
                |b| b.paged_attention(&q, &cp, layer, heads, &seq),
            );
            assert_close(&format!("case {case} {kv_dtype} layer {layer} after copies"), &g, &c);
        }
    }
}

#[test]
fn pools_split_over_bindings_behave_like_one_pool() {
    let Some(gpu) = gpu_with(Some(SMALL_BINDING)) else { return };
    // K/V blocks: 4 slots x 2 heads x 8 dims x 4 B = 256 B → 16 blocks per chunk, 2 chunks;
    // hidden blocks: 4 x 2 x 24 x 4 B = 768 B → 5 blocks per chunk, 5 chunks.
    let spec = PagesSpec {
        num_layers: 1,
        num_blocks: 24,
        block_size: 4,
        kv_heads: 2,
        head_dim: 8,
        captured: 2,
        hidden: 24,
        kv_dtype: Dtype::F32,
    };
    split_pools_match_cpu(&gpu, spec, 5);
    // Three chunks' worth of KV cannot be bound by the attention kernels.
    let big = PagesSpec { num_blocks: 33, ..spec };
    let err = gpu.alloc_pages(big).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Gpu(GpuError::TooLarge { limit: "max_storage_buffer_binding_size x bound chunks", .. })
        ),
        "{err}"
    );
}

#[test]
fn f16_pools_split_over_bindings_behave_like_one_pool() {
    let Some(gpu) = gpu_with(Some(SMALL_BINDING)) else { return };
    // f16 K/V blocks: 4 slots x 4 heads x 8 dims x 2 B = 256 B → 16 blocks per chunk, 2 chunks.
    let spec = PagesSpec {
        num_layers: 1,
        num_blocks: 24,
        block_size: 4,
        kv_heads: 4,
        head_dim: 8,
        captured: 2,
        hidden: 24,
        kv_dtype: Dtype::F16,
    };
    split_pools_match_cpu(&gpu, spec, 14);
    // Half the bytes per block: 33 blocks still need three chunks, 32 fit two.
    assert!(gpu.alloc_pages(PagesSpec { num_blocks: 32, ..spec }).is_ok());
    let err = gpu.alloc_pages(PagesSpec { num_blocks: 33, ..spec }).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Gpu(GpuError::TooLarge { limit: "max_storage_buffer_binding_size x bound chunks", .. })
        ),
        "{err}"
    );
}

/// Attention, hidden rows and copies inside and across chunks over `spec`'s pools (24
/// blocks, head_dim 8, split: 2 K chunks, more than 2 hidden chunks), against the CPU.
fn split_pools_match_cpu(gpu: &WgpuBackend, spec: PagesSpec, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let heads = AttnHeads { num_heads: 4, kv_heads: spec.kv_heads, head_dim: 8 };
    let s = setup_attention(gpu, &mut rng, spec, heads, 0, &[(9, 4), (0, 7), (21, 1), (16, 1)]);
    assert_eq!(s.gpu_pages.layer("test", 0).unwrap().k.num_chunks(), 2, "K pool must be split");
    assert!(s.gpu_pages.hidden().num_chunks() > 2, "hidden pool must be split");
    let seqs = attn_seqs(&s.seqs);
    let want = CpuBackend.paged_attention(&s.q, &s.cpu_pages, 0, heads, &seqs).unwrap();
    let got = gpu
        .download(
            &gpu.paged_attention(&gpu.upload(s.q.view()).unwrap(), &s.gpu_pages, 0, heads, &seqs).unwrap(),
        )
        .unwrap();
    assert_close("split pool attention", &got, &want);

    let (mut gp, mut cp) = (s.gpu_pages, s.cpu_pages);
    // Every third slot: touches every chunk while the tensor fits the small binding.
    let all: Vec<i64> = (0..spec.num_slots() as i64).step_by(3).collect();
    let x = rand_matrix(&mut rng, all.len(), spec.hidden);
    gpu.write_hidden(&mut gp, 1, &gpu.upload(x.view()).unwrap(), &all).unwrap();
    CpuBackend.write_hidden(&mut cp, 1, &x, &all).unwrap();
    // Copies inside one chunk and across chunks, with a chain (3 → 2 → 20).
    let copies = [(0, 15), (14, 1), (3, 2), (8, 9), (2, 20), (21, 4)];
    gpu.copy_blocks(&mut gp, &copies).unwrap();
    CpuBackend.copy_blocks(&mut cp, &copies).unwrap();
    let (g, c) = both(gpu, |b| b.gather_hidden(&gp, 1, &all), |b| b.gather_hidden(&cp, 1, &all));
    assert_close("split hidden pool after copies", &g, &c);
    let table: Vec<BlockId> = (0..24).collect();
    let q = rand_matrix(&mut rng, 1, 32);
    let seq = [AttnSeq { query_start: 0, num_new: 1, num_computed: 95, block_table: &table }];
    let (g, c) = both(
        gpu,
        |b| b.paged_attention(&b.upload(q.view())?, &gp, 0, heads, &seq),
        |b| b.paged_attention(&q, &cp, 0, heads, &seq),
    );
    assert_close(&format!("split {} KV pool after copies", spec.kv_dtype), &g, &c);
}

#[test]
fn rejected_writes_leave_pages_unchanged() {
    let Some(gpu) = gpu() else { return };
    let spec = PagesSpec {
        num_layers: 1,
        num_blocks: 2,
        block_size: 4,
        kv_heads: 1,
        head_dim: 4,
        captured: 1,
        hidden: 4,
        kv_dtype: Dtype::F32,
    };
    let mut pages = gpu.alloc_pages(spec).unwrap();
    let ones = gpu.upload(Array2::ones((2, 4)).view()).unwrap();
    let err = gpu.write_kv(&mut pages, 0, &ones, &ones, &[1, 8]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Backend(BackendError::OpIndex { op: "write_kv", what: "slot", index: 8, bound: 8 })
        ),
        "{err}"
    );
    let err = gpu.write_hidden(&mut pages, 0, &ones, &[0, 1, 2]).unwrap_err();
    assert!(matches!(err, Error::Backend(BackendError::OpShape { op: "write_hidden", .. })), "{err}");
    let err = gpu.write_hidden(&mut pages, 1, &ones, &[0, 1]).unwrap_err();
    assert!(matches!(err, Error::Backend(BackendError::OpIndex { what: "capture", index: 1, .. })), "{err}");
    let err = gpu.copy_blocks(&mut pages, &[(0, 1), (1, 2)]).unwrap_err();
    assert!(
        matches!(err, Error::Backend(BackendError::OpIndex { op: "copy_blocks", index: 2, .. })),
        "{err}"
    );
    let kv = pages.layer("test", 0).unwrap();
    assert!(gpu.context().download_pool(kv.k).unwrap().iter().all(|&x| x == 0.0), "K pages changed");
    assert!(
        gpu.context().download_pool(pages.hidden()).unwrap().iter().all(|&x| x == 0.0),
        "hidden pages changed"
    );
}

#[test]
fn dense_ops_match_cpu_on_random_shapes() {
    let Some(gpu) = gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    for case in 0..u64::from(support::cases(6)) {
        let (n, k, m) = (rng.random_range(1..80), rng.random_range(1..70), rng.random_range(1..90));
        let x = rand_matrix(&mut rng, n, k);
        let w = rand_matrix(&mut rng, m, k);
        let (g, c) = both(
            &gpu,
            |b| b.matmul_t(&b.upload(x.view())?, &b.upload(w.view())?),
            |b| b.matmul_t(&x, &w.clone().into()),
        );
        assert_close(&format!("case {case} matmul [{n},{k}] x [{m},{k}]^T"), &g, &c);

        let bias = rand_matrix(&mut rng, 1, k);
        let y = rand_matrix(&mut rng, n, k);
        let (g, c) = both(
            &gpu,
            |b| {
                let mut t = b.upload(x.view())?;
                b.add_bias(&mut t, &b.upload(bias.view())?)?;
                b.add(&mut t, &b.upload(y.view())?)?;
                Ok(t)
            },
            |b| {
                let mut t = x.clone();
                b.add_bias(&mut t, &bias)?;
                b.add(&mut t, &y)?;
                Ok(t)
            },
        );
        assert_close(&format!("case {case} bias + residual"), &g, &c);

        let norm_w = rand_matrix(&mut rng, 1, k);
        let (g, c) = both(
            &gpu,
            |b| b.rms_norm(&b.upload(x.view())?, &b.upload(norm_w.view())?, 1e-6),
            |b| b.rms_norm(&x, &norm_w, 1e-6),
        );
        assert_close(&format!("case {case} rms_norm"), &g, &c);

        let head_dim = [2, 4, 8][case as usize % 3];
        let xh = rand_matrix(&mut rng, n, head_dim * 3);
        let wh = rand_matrix(&mut rng, 1, head_dim);
        let (g, c) = both(
            &gpu,
            |b| {
                let mut t = b.upload(xh.view())?;
                b.rms_norm_heads(&mut t, &b.upload(wh.view())?, head_dim, 1e-6)?;
                Ok(t)
            },
            |b| {
                let mut t = xh.clone();
                b.rms_norm_heads(&mut t, &wh, head_dim, 1e-6)?;
                Ok(t)
            },
        );
        assert_close(&format!("case {case} rms_norm_heads"), &g, &c);

        let gate_up = rand_matrix(&mut rng, n, 2 * m) * 6.0;
        let (g, c) = both(&gpu, |b| b.swiglu(&b.upload(gate_up.view())?), |b| b.swiglu(&gate_up));
        assert_close(&format!("case {case} swiglu"), &g, &c);
    }
}

#[test]
fn row_ops_match_cpu_and_reject_bad_indices() {
    let Some(gpu) = gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let table = rand_matrix(&mut rng, 50, 12);
    let ids: Vec<u32> = (0..17).map(|_| rng.random_range(0..50)).collect();
    let (g, c) = both(
        &gpu,
        |b| b.embedding(&b.upload(table.view())?, &ids),
        |b| b.embedding(&table.clone().into(), &ids),
    );
    assert_close("embedding", &g, &c);
    let (g, c) =
        both(&gpu, |b| b.gather_rows(&b.upload(table.view())?, &ids), |b| b.gather_rows(&table, &ids));
    assert_close("gather_rows", &g, &c);

    let items = rand_matrix(&mut rng, 5, 12);
    let rows = [3u32, 0, 16, 9, 4];
    let base = rand_matrix(&mut rng, 17, 12);
    let (g, c) = both(
        &gpu,
        |b| {
            let mut t = b.upload(base.view())?;
            b.scatter_rows(&mut t, &rows, &b.upload(items.view())?)?;
            Ok(t)
        },
        |b| {
            let mut t = base.clone();
            b.scatter_rows(&mut t, &rows, &items)?;
            Ok(t)
        },
    );
    assert_close("scatter_rows", &g, &c);

    let gt = gpu.upload(table.view()).unwrap();
    let err = gpu.embedding(&gt, &[1, 50]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Backend(BackendError::OpIndex { op: "embedding", what: "token id", index: 50, bound: 50 })
        ),
        "{err}"
    );
    let mut dst = gpu.upload(base.view()).unwrap();
    let err = gpu.scatter_rows(&mut dst, &[0, 1, 2, 3, 17], &gpu.upload(items.view()).unwrap()).unwrap_err();
    assert!(
        matches!(err, Error::Backend(BackendError::OpIndex { op: "scatter_rows", index: 17, .. })),
        "{err}"
    );
    assert_close("scatter_rows rejected", &gpu.download(&dst).unwrap(), &base);
}

#[test]
fn rope_plain_sectioned_and_interleaved_match_cpu() {
    let Some(gpu) = gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let kinds = [
        RopeKind::Plain,
        RopeKind::Sectioned([4, 6, 6]),
        RopeKind::Interleaved([6, 5, 5]),
        RopeKind::Interleaved([24, 20, 20]),
    ];
    for kind in kinds {
        let spec = RopeSpec { theta: 1_000_000.0, head_dim: 32, kind };
        let n = rng.random_range(1..40);
        let x = rand_matrix(&mut rng, n, 3 * 32);
        let pos: Vec<Vec<i64>> = (0..3).map(|_| (0..n).map(|_| rng.random_range(0..600)).collect()).collect();
        let p = RopePositions { t: &pos[0], h: &pos[1], w: &pos[2] };
        let (g, c) = both(
            &gpu,
            |b| {
                let mut t = b.upload(x.view())?;
                b.rope(&mut t, &spec, p)?;
                Ok(t)
            },
            |b| {
                let mut t = x.clone();
                b.rope(&mut t, &spec, p)?;
                Ok(t)
            },
        );
        assert_close(&format!("rope {kind:?}"), &g, &c);
    }
    let mut t = gpu.upload(Array2::zeros((2, 8)).view()).unwrap();
    let spec = RopeSpec { theta: 10_000.0, head_dim: 8, kind: RopeKind::Plain };
    let err = gpu.rope(&mut t, &spec, RopePositions { t: &[0], h: &[0], w: &[0] }).unwrap_err();
    assert!(
        matches!(err, Error::Backend(BackendError::OpShape { op: "rope", what: "positions.t", .. })),
        "{err}"
    );
}

#[test]
fn moe_matches_cpu_and_router_breaks_ties_low() {
    let Some(gpu) = gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let (e, h, inter) = (6, 12, 5);
    // 150 tokens: expert lists longer than one 64-row tile; top_k 1 of 6 over 2 tokens
    // leaves experts with empty lists.
    for (top_k, norm, n) in [(1, true, 9), (2, true, 9), (2, false, 150), (6, false, 9), (1, false, 2)] {
        let host = MoeWeights::random(&mut rng, e, h, inter, top_k, norm);
        let dev = MoeWeights {
            router: gpu.upload(host.router.view()).unwrap(),
            gate_up: gpu.upload(host.gate_up.view()).unwrap(),
            down: gpu.upload(host.down.view()).unwrap(),
            num_experts: e,
            top_k,
            norm_topk_prob: norm,
        };
        let x = rand_matrix(&mut rng, n, h);
        let (g, c) = both(
            &gpu,
            |b| b.moe(&b.upload(x.view())?, &dev),
            |b| b.moe(&x, &host.try_map(|t| Ok::<_, omniprefix::Error>(t.clone().into()))?),
        );
        assert_close(&format!("moe top_k {top_k} norm {norm} tokens {n}"), &g, &c);
    }
    // Equal logits: the lower expert ids win, weights renormalised to 1/k.
    let logits = gpu
        .upload(Array2::from_shape_vec((2, 4), vec![0.5, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0]).unwrap().view())
        .unwrap();
    let routing = gpu.context().router_topk(&logits, 2, true).unwrap();
    assert_eq!(routing.download_ids(gpu.context()).unwrap(), vec![1, 2, 0, 1]);
    let weights = gpu.context().download(&routing.weights).unwrap();
    assert!(weights.iter().all(|w| (w - 0.5).abs() < 1e-6), "{weights:?}");
}

#[test]
fn broken_shader_is_a_typed_error() {
    let Some(gpu) = gpu() else { return };
    let err = gpu
        .context()
        .compile_module("broken.wgsl", "@compute @workgroup_size(1) fn main() { let x: f32 = ; }")
        .unwrap_err();
    assert!(
        matches!(&err, Error::Gpu(GpuError::ShaderCompile { shader, .. }) if shader == "broken.wgsl"),
        "{err}"
    );
    let module = gpu.context().compile_module("ok.wgsl", "@compute @workgroup_size(1) fn main() {}").unwrap();
    let err = gpu.context().build_pipeline("ok.wgsl", &module, "missing_entry", &[]).unwrap_err();
    assert!(
        matches!(&err, Error::Gpu(GpuError::ShaderCompile { entry, .. }) if entry == "missing_entry"),
        "{err}"
    );
}

#[test]
fn weights_larger_than_one_binding_split_into_row_blocks() {
    let Some(gpu) = gpu_with(Some(SMALL_BINDING)) else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    // 75 rows x 32 f32 = 9600 B over a 4096 B binding: blocks of 32, 32 and 11 rows.
    let table = rand_matrix(&mut rng, 75, 32);
    let split = gpu.upload(table.view()).unwrap();
    assert!(split.is_split(), "a 9600 B tensor must not fit one 4096 B binding");
    assert_eq!(gpu.download(&split).unwrap(), table, "download joins the row blocks");
    // One wait for several tensors: split, empty and f16 ones come back in order.
    let small = rand_matrix(&mut rng, 3, 5);
    let half = HostWeight::from_f32(small.clone()).to_dtype(Dtype::F16).unwrap();
    let (empty, small_gpu) =
        (gpu.upload(Array2::zeros((0, 4)).view()).unwrap(), gpu.upload(small.view()).unwrap());
    let half_gpu = gpu.upload_weight(half.clone()).unwrap();
    let all = gpu.download_all(&[&small_gpu, &split, &empty, &half_gpu]).unwrap();
    assert_eq!(
        all,
        vec![small, table.clone(), Array2::zeros((0, 4)), half.to_f32()],
        "download_all keeps order and shapes"
    );
    // As a matmul weight: every block writes its own output columns.
    let x = rand_matrix(&mut rng, 5, 32);
    let (g, c) =
        both(&gpu, |b| b.matmul_t(&b.upload(x.view())?, &split), |b| b.matmul_t(&x, &table.clone().into()));
    assert_close("matmul with a split weight", &g, &c);
    // As an embedding table: ids in every block, repeated, first and last rows.
    let ids = [74, 0, 31, 32, 63, 64, 5, 74, 40];
    let (g, c) = both(&gpu, |b| b.embedding(&split, &ids), |b| b.embedding(&table.clone().into(), &ids));
    assert_eq!(g, c, "embedding rows are copied exactly");
    // Every other op needs its operand whole, and says so.
    let err = gpu.gather_rows(&split, &[1, 2]).unwrap_err();
    assert!(
        matches!(&err, Error::Gpu(GpuError::TooLarge { what, .. }) if what.starts_with("gather_rows operand")),
        "{err}"
    );
    let norm = gpu.upload(Array2::from_elem((1, 32), 1.0).view()).unwrap();
    assert!(matches!(gpu.rms_norm(&split, &norm, 1e-6), Err(Error::Gpu(GpuError::TooLarge { .. }))));
    // A single row wider than a binding cannot be split.
    let err = gpu.upload(Array2::zeros((2, 2048)).view()).unwrap_err();
    assert!(
        matches!(err, Error::Gpu(GpuError::TooLarge { requested: 8192, max: SMALL_BINDING, .. })),
        "{err}"
    );
}

/// Stacked MoE experts larger than one binding: the routed matmul binds one row
/// block at a time, and experts cut by a block edge get their columns from both.
#[test]
fn moe_experts_larger_than_one_binding_split_mid_expert() {
    let Some(gpu) = gpu_with(Some(SMALL_BINDING)) else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let (e, h, inter) = (8, 16, 12);
    for dtype in [Dtype::F32, Dtype::F16] {
        // f32: gate_up [192, 16] in blocks of 64 rows (expert 2 of 24 rows is cut at row 64),
        // down [128, 12] in blocks of 85 rows (16-row experts cut at 85 and 170).
        // f16: gate_up in blocks of 128 rows (expert 5 cut); down fits one binding.
        let host = MoeWeights::random(&mut rng, e, h, inter, 2, true);
        let host = host.try_map(|t| HostWeight::from_f32(t.clone()).to_dtype(dtype)).unwrap();
        let dev = host.try_map(|t| gpu.upload_weight(t.clone())).unwrap();
        assert!(dev.gate_up.is_split(), "{dtype}: gate_up must span several bindings");
        assert_eq!(dev.down.is_split(), dtype == Dtype::F32, "{dtype}: down");
        let cpu = host.try_map(|t| CpuBackend.upload_weight(t.clone())).unwrap();
        for n in [1, 9, 21] {
            // 2n x 24 gate_up outputs must fit the capped binding
            let x = rand_matrix(&mut rng, n, h);
            let (g, c) = both(&gpu, |b| b.moe(&b.upload(x.view())?, &dev), |b| b.moe(&x, &cpu));
            assert_close(&format!("{dtype} split moe tokens {n}"), &g, &c);
        }
    }
}

/// f16 weights (matmul, embedding, MoE experts) on random shapes, odd lengths
/// included, against the CPU backend holding the same f16 weights.
#[test]
fn f16_weights_match_cpu_f16_weights() {
    let Some(gpu) = gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    let half = |a: Array2<f32>| HostWeight::from_f32(a).to_dtype(Dtype::F16).unwrap();
    for case in 0..u64::from(support::cases(6)) {
        let (n, k, m) = (rng.random_range(1..80), rng.random_range(1..70), rng.random_range(1..90));
        let x = rand_matrix(&mut rng, n, k);
        let w = half(rand_matrix(&mut rng, m, k));
        let gw = gpu.upload_weight(w.clone()).unwrap();
        assert_eq!(gw.dtype(), Dtype::F16);
        assert_eq!(gpu.download(&gw).unwrap(), w.to_f32(), "case {case}: f16 weights widen exactly");
        let cw = CpuBackend.upload_weight(w).unwrap();
        let (g, c) = both(&gpu, |b| b.matmul_t(&b.upload(x.view())?, &gw), |b| b.matmul_t(&x, &cw));
        assert_close(&format!("case {case} f16 matmul [{n},{k}] x [{m},{k}]^T"), &g, &c);
    }
    // An odd-width table: rows straddle the packed words.
    let table = half(rand_matrix(&mut rng, 50, 13));
    let ids: Vec<u32> = (0..17).map(|_| rng.random_range(0..50)).collect();
    let gt = gpu.upload_weight(table.clone()).unwrap();
    let (g, c) =
        both(&gpu, |b| b.embedding(&gt, &ids), |b| b.embedding(&b.upload_weight(table.clone())?, &ids));
    assert_eq!(g, c, "f16 embedding rows are widened exactly");
    for (top_k, norm, n) in [(2, true, 9), (2, false, 70)] {
        let host = MoeWeights::random(&mut rng, 6, 12, 5, top_k, norm);
        let host = host.try_map(|t| Ok::<_, Error>(half(t.clone()))).unwrap();
        let dev = host.try_map(|t| gpu.upload_weight(t.clone())).unwrap();
        let cpu = host.try_map(|t| CpuBackend.upload_weight(t.clone())).unwrap();
        let x = rand_matrix(&mut rng, n, 12);
        let (g, c) = both(&gpu, |b| b.moe(&b.upload(x.view())?, &dev), |b| b.moe(&x, &cpu));
        assert_close(&format!("f16 moe top_k {top_k} tokens {n}"), &g, &c);
    }
    // Only weights may be f16: any other operand says so.
    let err = gpu.gather_rows(&gt, &[1]).unwrap_err();
    assert!(
        matches!(&err, Error::Config(ConfigError::Invalid { field: "operand dtype", found, .. }) if found == "f16"),
        "{err}"
    );
    let norm = gpu.upload(Array2::ones((1, 13)).view()).unwrap();
    assert!(matches!(gpu.rms_norm(&gt, &norm, 1e-6), Err(Error::Config(ConfigError::Invalid { .. }))));
}

/// An f16 weight larger than one binding splits into row blocks like an f32 one;
/// blocks of an odd element count end in a padding half.
#[test]
fn f16_weights_larger_than_one_binding_split_into_row_blocks() {
    let Some(gpu) = gpu_with(Some(SMALL_BINDING)) else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(16);
    // 75 rows x 33 f16 = 4950 B over 4096 B: blocks of 62 and 13 rows (429 halves, odd).
    let table = HostWeight::from_f32(rand_matrix(&mut rng, 75, 33)).to_dtype(Dtype::F16).unwrap();
    let split = gpu.upload_weight(table.clone()).unwrap();
    assert!(split.is_split(), "4950 B must not fit one 4096 B binding");
    assert_eq!(gpu.download(&split).unwrap(), table.to_f32(), "download joins and widens the row blocks");
    let cpu = CpuBackend.upload_weight(table).unwrap();
    let x = rand_matrix(&mut rng, 5, 33);
    let (g, c) = both(&gpu, |b| b.matmul_t(&b.upload(x.view())?, &split), |b| b.matmul_t(&x, &cpu));
    assert_close("matmul with a split f16 weight", &g, &c);
    let ids = [74, 0, 61, 62, 5, 74];
    let (g, c) = both(&gpu, |b| b.embedding(&split, &ids), |b| b.embedding(&cpu, &ids));
    assert_eq!(g, c, "split f16 embedding rows are widened exactly");
}

/// Whole thinker forwards: the GPU runner, with a cached prefix and chunked prefill,
/// returns the CPU's uncached hidden states and logits (caching invisible on the GPU).
mod forward {
    use super::*;
    use omniprefix::batch::{EmbedRows, ScheduledBatch};
    use omniprefix::kv::BlockTable;
    use omniprefix::model::{CaptureName, CaptureSpec, Config, Thinker};
    use omniprefix::prompt::Positions;
    use omniprefix::runner::{ModelRunner, Outputs, PromptInputs, run_uncached};

    const BS: usize = 4;

    /// `len` random tokens with an item of `rows` rows at position 3 on a 2-wide M-RoPE grid.
    fn prompt(cfg: &Config, len: usize, rows: usize, rng: &mut ChaCha8Rng) -> PromptInputs {
        let token_ids = (0..len).map(|_| rng.random_range(0..cfg.vocab_size as u32)).collect();
        let item = Arc::new(rand_matrix(rng, rows, cfg.hidden_size));
        let embeds = vec![EmbedRows { step_offset: 3, embeddings: item, rows: 0..rows, deepstack: None }];
        let grid =
            |p: i64, f: fn(i64) -> i64| if (3..3 + rows as i64).contains(&p) { 3 + f(p - 3) } else { p };
        let t: Vec<i64> = (0..len as i64).map(|p| grid(p, |_| 0)).collect();
        let h: Vec<i64> = (0..len as i64).map(|p| grid(p, |r| r / 2)).collect();
        let w: Vec<i64> = (0..len as i64).map(|p| grid(p, |r| r % 2)).collect();
        let positions = if cfg.mrope_section.is_some() {
            Positions::given((0..len).map(|i| [t[i], h[i], w[i]]).collect(), 0)
        } else {
            Positions::linear(len)
        };
        PromptInputs { token_ids, embeds, positions }
    }

    /// `got ≈ want` relative to the largest magnitude of `want`.
    fn assert_close_scaled(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= TOL * scale,
                "{what}: first mismatch at flat index {i}: gpu {g} vs cpu {w}"
            );
        }
    }

    fn assert_outputs(
        what: &str, hidden: &[(CaptureName, Array2<f32>)], last_logits: &[f32], want: &Outputs,
    ) {
        assert_eq!(hidden.len(), want.hidden.len(), "{what}: captures");
        for ((name, got), (_, w)) in hidden.iter().zip(&want.hidden) {
            assert_eq!(got.dim(), w.dim(), "{what} {name}: shape");
            assert_close_scaled(&format!("{what} {name}"), got.as_slice().unwrap(), w.as_slice().unwrap());
        }
        assert_close_scaled(&format!("{what} last_logits"), last_logits, &want.last_logits);
    }

    #[test]
    fn cached_chunked_gpu_forward_equals_uncached_cpu_forward() {
        let Some(gpu) = gpu() else { return };
        cached_chunked_forward_matches_cpu(Arc::new(gpu), Dtype::F32, Dtype::F32, 10);
    }

    /// f16 weights and f16 K/V pages on both backends: caching stays invisible on the GPU.
    #[test]
    fn f16_cached_chunked_gpu_forward_equals_uncached_cpu_forward() {
        let Some(gpu) = gpu() else { return };
        cached_chunked_forward_matches_cpu(Arc::new(gpu), Dtype::F16, Dtype::F16, 17);
    }

    /// A dense, an M-RoPE and a MoE tiny model with weights in `dtype` and K/V pages in
    /// `kv_dtype`: the GPU uncached and chunked over a cached prefix against the CPU uncached.
    fn cached_chunked_forward_matches_cpu(gpu: Arc<WgpuBackend>, dtype: Dtype, kv_dtype: Dtype, seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let configs = [
            Config::tiny_qwen3(32, 2, 4, 2, 64),
            Config::tiny_qwen2_omni(32, 2, 4, 1, 64),
            Config::tiny_qwen3_omni_moe(32, 2, 4, 4, 64, 4, 2),
        ];
        for (ci, cfg) in configs.into_iter().enumerate() {
            let n = cfg.num_hidden_layers;
            let capture =
                CaptureSpec::new([CaptureName::Hidden(0), CaptureName::Hidden(n), CaptureName::Final], n)
                    .unwrap();
            let cpu_thinker = Thinker::random_as(&CpuBackend, cfg.clone(), ci as u64, Some(dtype)).unwrap();
            let gpu_thinker =
                Arc::new(Thinker::random_as(&*gpu, cfg.clone(), ci as u64, Some(dtype)).unwrap());
            let p = prompt(&cfg, 19, 6, &mut rng);
            let want = if kv_dtype == Dtype::F32 {
                let want = run_uncached(&cpu_thinker, &CpuBackend, &p, &capture, false).unwrap();
                let uncached = run_uncached(&gpu_thinker, &*gpu, &p, &capture, false).unwrap();
                assert_outputs(
                    &format!("config {ci} uncached"),
                    &uncached.hidden,
                    &uncached.last_logits,
                    &want,
                );
                want
            } else {
                // The uncached forward keeps K/V in f32; the CPU's one-step run over
                // `kv_dtype` pages rounds K/V as the GPU's pages do.
                let cpu = ModelRunner::new(Arc::new(CpuBackend), Arc::new(cpu_thinker), capture.clone())
                    .unwrap()
                    .with_kv_dtype(kv_dtype);
                let mut cpu_pages = cpu.alloc_pages(8, BS).unwrap();
                let step = p.step(1, BlockTable::new((0..5).collect(), BS), 0..19).unwrap();
                let mut outs = cpu
                    .execute(&ScheduledBatch { copies: vec![], seqs: vec![step] }, &mut cpu_pages)
                    .unwrap();
                let out = outs.pop().expect("one output");
                Outputs { hidden: out.hidden, last_logits: out.last_logits, logits: None }
            };

            let runner =
                ModelRunner::new(Arc::clone(&gpu), gpu_thinker, capture).unwrap().with_kv_dtype(kv_dtype);
            let mut blocks: Vec<u32> = (0..8).collect();
            blocks.shuffle(&mut rng);
            let table = &blocks[..19usize.div_ceil(BS)];
            let mut pages = runner.alloc_pages(8, BS).unwrap();
            let mut outs = Vec::new();
            let mut a = 0;
            // A block-aligned cached prefix, a non-aligned chunk, a decode-sized last step.
            for b in [8, 13, 18, 19] {
                outs = runner
                    .execute(
                        &ScheduledBatch {
                            copies: vec![],
                            seqs: vec![p.step(1, BlockTable::new(table.to_vec(), BS), a..b).unwrap()],
                        },
                        &mut pages,
                    )
                    .unwrap();
                a = b;
            }
            assert_eq!(outs.len(), 1, "config {ci}");
            assert_outputs(
                &format!("config {ci} {dtype} weights, {kv_dtype} pages, chunked"),
                &outs[0].hidden,
                &outs[0].last_logits,
                &want,
            );
        }
    }
    /// A vocabulary too large for one binding: the embedding lookup and the tied
    /// lm_head run over the row blocks of the split table and match the CPU.
    #[test]
    fn a_vocabulary_larger_than_one_binding_runs_split() {
        let Some(gpu) = gpu_with(Some(SMALL_BINDING)) else { return };
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        // 256 x 16 f32 = 16 KiB of embedding over 4 KiB bindings: 4 row blocks.
        let cfg = Config::tiny_qwen3(16, 1, 2, 1, 256);
        assert!(cfg.vocab_size * cfg.hidden_size * 4 > SMALL_BINDING as usize);
        let capture = CaptureSpec::default_for(cfg.num_hidden_layers);
        let cpu_thinker = Thinker::random(&CpuBackend, cfg.clone(), 3).unwrap();
        let gpu_thinker = Thinker::random(&gpu, cfg.clone(), 3).unwrap();
        let p = prompt(&cfg, 7, 2, &mut rng);
        let want = run_uncached(&cpu_thinker, &CpuBackend, &p, &capture, false).unwrap();
        let got = run_uncached(&gpu_thinker, &gpu, &p, &capture, false).unwrap();
        assert_outputs("split vocabulary", &got.hidden, &got.last_logits, &want);
    }
}

/// Ops are submitted in batches; results must still follow program order across batch
/// boundaries, through buffer copies, and be complete when downloaded.
#[test]
fn batched_submissions_keep_program_order() {
    let Some(gpu) = gpu() else { return };
    let ctx = gpu.context();
    let mut x = gpu.upload(Array2::zeros((3, 70)).view()).unwrap();
    let one = gpu.upload(Array2::ones((3, 70)).view()).unwrap();
    let snapshot = gpu.upload(Array2::zeros((3, 70)).view()).unwrap();
    for i in 1..=45 {
        gpu.add(&mut x, &one).unwrap();
        if i == 20 {
            ctx.copy_tensor(&x, &snapshot).unwrap();
        }
    }
    assert!(gpu.download(&snapshot).unwrap().iter().all(|&v| v == 20.0), "copy saw the first 20 adds only");
    assert!(gpu.download(&x).unwrap().iter().all(|&v| v == 45.0), "all 45 adds, in order");
    ctx.synchronize().unwrap();
}

#[test]
fn bf16_weights_and_pages_are_a_config_error_on_wgpu() {
    let Some(gpu) = gpu() else { return };
    assert_eq!(gpu.weight_dtypes(), [Dtype::F32, Dtype::F16]);
    let host = HostWeight::from_f32(Array2::ones((4, 4))).to_dtype(Dtype::Bf16).unwrap();
    let Err(err) = gpu.upload_weight(host) else { panic!("a bf16 upload must fail") };
    assert!(
        matches!(&err, Error::Config(ConfigError::Invalid { field: "weight dtype", found, .. }) if found == "bf16"),
        "{err}"
    );
    let cfg = omniprefix::model::Config::tiny_qwen3(32, 2, 4, 2, 50);
    let Err(err) = omniprefix::model::Thinker::random_as(&gpu, cfg.clone(), 1, Some(Dtype::Bf16)) else {
        panic!("a bf16 thinker on wgpu must fail")
    };
    assert!(matches!(&err, Error::Config(ConfigError::Invalid { component: "wgpu", .. })), "{err}");
    let thinker = omniprefix::model::Thinker::random_as(&gpu, cfg.clone(), 1, Some(Dtype::F16))
        .expect("f16 on wgpu loads");
    assert_eq!(thinker.dtype(), Dtype::F16);
    let thinker = omniprefix::model::Thinker::random(&gpu, cfg, 1).expect("auto on wgpu loads");
    assert_eq!(thinker.dtype(), Dtype::F32);
    let spec = kv_pages(1, 2, 4, 1, 4, Dtype::Bf16);
    let Err(err) = gpu.alloc_pages(spec) else { panic!("bf16 pages on wgpu must fail") };
    assert!(
        matches!(&err, Error::Config(ConfigError::Invalid { field: "kv dtype", found, .. }) if found == "bf16"),
        "{err}"
    );
    // f16 pages pack two halves per word: a slot of odd width would share a word with the next.
    let odd = PagesSpec { head_dim: 3, kv_dtype: Dtype::F16, ..spec };
    let Err(err) = gpu.alloc_pages(odd) else { panic!("odd-width f16 pages must fail") };
    assert!(matches!(&err, Error::Gpu(GpuError::Unsupported { value: 3, .. })), "{err}");
    assert!(gpu.alloc_pages(PagesSpec { head_dim: 3, kv_dtype: Dtype::F32, ..spec }).is_ok());
}

/// An adapter without the f16 conversions (`DownlevelFlags::SHADER_F16_IN_F32`, e.g.
/// lavapipe without `SHADER_F16`) refuses f16 with the typed error, and f32 still runs.
#[test]
fn without_f16_conversions_f16_is_a_config_error_and_f32_runs() {
    let Some(gpu) = gpu_without_f16() else { return };
    assert_eq!(gpu.weight_dtypes(), [Dtype::F32]);
    let host = HostWeight::from_f32(Array2::ones((4, 4))).to_dtype(Dtype::F16).unwrap();
    let Err(err) = gpu.upload_weight(host) else { panic!("an f16 upload must fail") };
    assert!(
        matches!(&err, Error::Config(ConfigError::Invalid { field: "weight dtype", found, .. }) if found == "f16"),
        "{err}"
    );
    let spec = kv_pages(1, 2, 4, 1, 4, Dtype::F16);
    let Err(err) = gpu.alloc_pages(spec) else { panic!("f16 pages must fail") };
    assert!(
        matches!(&err, Error::Config(ConfigError::Invalid { field: "kv dtype", found, .. }) if found == "f16"),
        "{err}"
    );
    let cfg = omniprefix::model::Config::tiny_qwen3(32, 2, 4, 2, 50);
    let Err(err) = omniprefix::model::Thinker::random_as(&gpu, cfg.clone(), 1, Some(Dtype::F16)) else {
        panic!("an f16 thinker must fail")
    };
    assert!(matches!(&err, Error::Config(ConfigError::Invalid { component: "wgpu", .. })), "{err}");
    // The kernels compile with the stub prelude and compute f32 as usual.
    let thinker = omniprefix::model::Thinker::random(&gpu, cfg.clone(), 1).expect("f32 loads");
    let cpu = omniprefix::model::Thinker::random(&CpuBackend, cfg, 1).expect("f32 loads");
    let p = omniprefix::runner::PromptInputs {
        token_ids: vec![1, 7, 3, 9, 2],
        embeds: vec![],
        positions: omniprefix::prompt::Positions::linear(5),
    };
    let capture = omniprefix::model::CaptureSpec::default_for(2);
    let got = omniprefix::runner::run_uncached(&thinker, &gpu, &p, &capture, false).unwrap();
    let want = omniprefix::runner::run_uncached(&cpu, &CpuBackend, &p, &capture, false).unwrap();
    let [got, want] = [&got.last_logits, &want.last_logits]
        .map(|l| Array2::from_shape_vec((1, l.len()), l.clone()).unwrap());
    assert_close("f32 forward without f16 conversions", &got, &want);
}
