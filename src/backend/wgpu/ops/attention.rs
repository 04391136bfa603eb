//! Paged attention: prefill (any number of new rows per sequence, in query tiles whose
//! TQ query slots are (row, head) pairs of one GQA group, see
//! [`prefill_slots`](crate::backend::wgpu::prefill_slots), so each K/V tile read into
//! workgroup memory serves every head of the group) and decode (one row per sequence,
//! GQA groups sharing K/V reads, split-KV with a reduce pass).
//!
//! Decode's partial pass has two kernels with the same bindings and partial layout:
//! `paged_decode_subgroup` (`wgsl/paged_decode_subgroup.wgsl`) where the device has
//! subgroups ([`has_subgroups`](crate::backend::wgpu::GpuContext::has_subgroups)): the
//! lanes of a subgroup split one key's head dims, so K reads are coalesced, and
//! `subgroupAdd` reduces the dots; otherwise the portable `paged_decode_partial`, one key
//! per invocation. Both feed `paged_decode_reduce`.

use crate::Result;
use crate::backend::wgpu::context::GpuContext;
use crate::backend::wgpu::kernel_params::AttnParams;
use crate::backend::wgpu::pipelines::Shader;
use crate::backend::wgpu::pool::PagedPool;
use crate::backend::wgpu::tensor::GpuTensor;
use crate::backend::{AttnHeads, AttnSeq};
use crate::error::{BackendError, GpuError};

const OP: &str = "paged_attention";
/// Head dims up to this are supported (decode keeps 4 dims per invocation of 64; prefill
/// tiles shrink to fit, see [`prefill_tiles`]).
pub const MAX_HEAD_DIM: usize = 256;
/// Query heads per KV head up to this are supported (decode keeps a group in one workgroup).
pub const MAX_GQA_GROUP: usize = 8;
/// Keys per decode split before contexts are split across workgroups.
const DECODE_SPLIT_KEYS: usize = 512;
/// Most splits per (sequence, KV head).
const MAX_DECODE_SPLITS: usize = 64;
/// Floats of the prefill kernel's query tile, K/V tile and score tile (`qt_sh`, `kvt_sh`,
/// `st_sh` in the shader): 16 KiB of workgroup memory, the WebGPU default.
const PREFILL_Q_TILE: usize = 1024;
const PREFILL_KV_TILE: usize = 2048;
const PREFILL_SCORE_TILE: usize = 1024;
/// Most query rows and keys per prefill tile.
const MAX_TILE_ROWS: usize = 16;
const MAX_TILE_KEYS: usize = 64;

/// K and V pools of one layer, as the attention kernels read them.
#[derive(Debug, Clone, Copy)]
pub struct KvPools<'a> {
    pub k: &'a PagedPool,
    pub v: &'a PagedPool,
}

/// Keys per split of a decode call whose longest context is `max_visible`.
pub fn decode_split_len(max_visible: usize) -> usize {
    DECODE_SPLIT_KEYS.max(max_visible.div_ceil(MAX_DECODE_SPLITS))
}

/// Checks heads, `q` and every sequence against the pools (the CPU backend's checks,
/// plus the kernels' own size limits).
fn validate(q: &GpuTensor, kv: KvPools<'_>, heads: AttnHeads, seqs: &[AttnSeq<'_>]) -> Result<()> {
    let pool = kv.k;
    let kv_width = heads.kv_heads * heads.head_dim;
    if heads.kv_heads == 0 || !heads.num_heads.is_multiple_of(heads.kv_heads) || kv_width != pool.slot_elems {
        return Err(BackendError::OpShape {
            op: OP,
            what: "heads (num_heads, kv_heads, head_dim)",
            expected: format!("kv_heads dividing num_heads, kv_heads * head_dim = {}", pool.slot_elems),
            found: vec![heads.num_heads, heads.kv_heads, heads.head_dim],
        }
        .into());
    }
    if heads.head_dim == 0 || heads.head_dim > MAX_HEAD_DIM {
        return Err(
            GpuError::Unsupported { what: "head_dim", value: heads.head_dim, supported: "1..=256" }.into()
        );
    }
    let group = heads.num_heads / heads.kv_heads;
    if group > MAX_GQA_GROUP {
        return Err(
            GpuError::Unsupported { what: "num_heads / kv_heads", value: group, supported: "1..=8" }.into()
        );
    }
    q.expect_cols(OP, "q", heads.num_heads * heads.head_dim)?;
    if kv.v.dtype() != pool.dtype() || kv.v.slot_elems != pool.slot_elems {
        return Err(BackendError::OpShape {
            op: OP,
            what: "V pool (dtype and slot width as the K pool's)",
            expected: format!("{} slots of {}", pool.dtype(), pool.slot_elems),
            found: vec![kv.v.slot_elems],
        }
        .into());
    }
    for seq in seqs {
        let end = seq.query_start.checked_add(seq.num_new).filter(|&e| e <= q.rows);
        if end.is_none() {
            let index = seq.query_start.saturating_add(seq.num_new) as i64;
            return Err(BackendError::OpIndex { op: OP, what: "query end", index, bound: q.rows + 1 }.into());
        }
        let len = seq.num_computed.saturating_add(seq.num_new);
        if u32::try_from(len).is_err() {
            return Err(BackendError::OpIndex {
                op: OP,
                what: "position",
                index: len as i64,
                bound: u32::MAX as usize,
            }
            .into());
        }
        let needed = len.div_ceil(pool.block_size);
        let Some(table) = seq.block_table.get(..needed) else {
            let bound = seq.block_table.len() * pool.block_size;
            return Err(BackendError::OpIndex {
                op: OP,
                what: "position (block table too short)",
                index: len as i64 - 1,
                bound,
            }
            .into());
        };
        if let Some(&b) = table.iter().find(|&&b| b as usize >= pool.num_blocks) {
            return Err(BackendError::OpIndex {
                op: OP,
                what: "block",
                index: b.into(),
                bound: pool.num_blocks,
            }
            .into());
        }
    }
    Ok(())
}

/// The decode kernels' row descriptions: `[q_row, visible, table_offset]` per row, then the
/// block tables (only the blocks each sequence needs).
fn row_info(seqs: &[&AttnSeq<'_>], block_size: usize) -> Vec<u32> {
    let n_rows: usize = seqs.iter().map(|s| s.num_new).sum();
    let mut rows = Vec::with_capacity(3 * n_rows);
    let mut tables = Vec::new();
    for seq in seqs {
        let table_offset = (3 * n_rows + tables.len()) as u32;
        let len = seq.num_computed + seq.num_new;
        tables.extend_from_slice(&seq.block_table[..len.div_ceil(block_size)]);
        for i in 0..seq.num_new {
            rows.extend([(seq.query_start + i) as u32, (seq.num_computed + i + 1) as u32, table_offset]);
        }
    }
    rows.extend(tables);
    rows
}

/// The prefill kernel's tile sizes for `head_dim` (1..=256): TQ query rows (a power of
/// two, so its 64 invocations split evenly over the rows) and KT keys, as large as the
/// kernel's workgroup tiles allow.
pub fn prefill_tiles(head_dim: usize) -> (usize, usize) {
    let tq = 1 << (PREFILL_Q_TILE / head_dim).min(MAX_TILE_ROWS).ilog2();
    let kt = (PREFILL_KV_TILE / head_dim).min(MAX_TILE_KEYS);
    debug_assert!(tq * kt <= PREFILL_SCORE_TILE, "scores of a tile fit st_sh");
    (tq, kt)
}

/// How the prefill kernel fills a tile's `tq` query slots for GQA groups of `group` query
/// heads: (rows per tile, heads per workgroup). Slot s is row s / heads of the tile and
/// head s % heads of the workgroup's head subset; a group wider than `tq` (head_dim 256,
/// TQ 4, group 8) is split over `group.div_ceil(heads)` workgroups of one row each.
pub fn prefill_slots(tq: usize, group: usize) -> (usize, usize) {
    let heads = group.clamp(1, tq);
    ((tq / heads).max(1), heads)
}

/// The prefill kernel's query tiles: `[q_row0, n_q, visible0, table_offset]` per tile of
/// up to `tq` consecutive new rows of one sequence (row i of a tile sees visible0 + i
/// keys), then the block tables (only the blocks each sequence needs). Also the count.
fn tile_info(seqs: &[&AttnSeq<'_>], block_size: usize, tq: usize) -> (Vec<u32>, usize) {
    let n_tiles: usize = seqs.iter().map(|s| s.num_new.div_ceil(tq)).sum();
    let mut tiles = Vec::with_capacity(4 * n_tiles);
    let mut tables = Vec::new();
    for seq in seqs {
        let table_offset = (4 * n_tiles + tables.len()) as u32;
        let len = seq.num_computed + seq.num_new;
        tables.extend_from_slice(&seq.block_table[..len.div_ceil(block_size)]);
        for row0 in (0..seq.num_new).step_by(tq) {
            let n_q = tq.min(seq.num_new - row0);
            let visible0 = seq.num_computed + row0 + 1;
            tiles.extend([(seq.query_start + row0) as u32, n_q as u32, visible0 as u32, table_offset]);
        }
    }
    tiles.extend(tables);
    (tiles, n_tiles)
}

/// Which kernels an attention call runs.
#[derive(Debug, Clone, Copy)]
enum Route {
    /// Decode for sequences with one new row ([`decode_split_len`] keys per split),
    /// prefill for the rest.
    ByNewRows,
    /// Prefill for every sequence.
    Prefill,
    /// Decode for every sequence (each has one new row), this many keys per split.
    Decode(usize),
}

impl GpuContext {
    /// Varlen causal attention (see [`crate::backend::Backend::paged_attention`]):
    /// sequences with one new row take the decode kernel, the rest the prefill kernel.
    pub fn paged_attention(
        &self, q: &GpuTensor, kv: KvPools<'_>, heads: AttnHeads, seqs: &[AttnSeq<'_>],
    ) -> Result<GpuTensor> {
        self.attention(q, kv, heads, seqs, Route::ByNewRows)
    }

    /// Attention with the prefill kernel for every sequence (one workgroup per query tile,
    /// KV head and head subset; sequences with one new row get a tile of one row).
    pub fn paged_prefill_attention(
        &self, q: &GpuTensor, kv: KvPools<'_>, heads: AttnHeads, seqs: &[AttnSeq<'_>],
    ) -> Result<GpuTensor> {
        self.attention(q, kv, heads, seqs, Route::Prefill)
    }

    /// Attention with the decode kernel: every sequence has one new row; contexts are
    /// split into `split_len`-key parts that are merged by a reduce pass.
    pub fn paged_decode_attention(
        &self, q: &GpuTensor, kv: KvPools<'_>, heads: AttnHeads, seqs: &[AttnSeq<'_>], split_len: usize,
    ) -> Result<GpuTensor> {
        self.attention(q, kv, heads, seqs, Route::Decode(split_len))
    }

    /// Checks the call, then runs the kernels `route` picks into a zeroed output shaped like `q`.
    fn attention(
        &self, q: &GpuTensor, kv: KvPools<'_>, heads: AttnHeads, seqs: &[AttnSeq<'_>], route: Route,
    ) -> Result<GpuTensor> {
        validate(q, kv, heads, seqs)?;
        if let Route::Decode(split_len) = route {
            if let Some(seq) = seqs.iter().find(|s| s.num_new != 1) {
                return Err(BackendError::OpShape {
                    op: "paged_decode_attention",
                    what: "num_new",
                    expected: "1".into(),
                    found: vec![seq.num_new],
                }
                .into());
            }
            if split_len == 0 || u32::try_from(split_len).is_err() {
                return Err(GpuError::Unsupported {
                    what: "split_len",
                    value: split_len,
                    supported: "1..2^32",
                }
                .into());
            }
        }
        let out = self.zeros(q.shape())?;
        let all = || seqs.iter().collect::<Vec<_>>();
        match route {
            Route::ByNewRows => {
                let (decode, prefill): (Vec<&AttnSeq<'_>>, Vec<&AttnSeq<'_>>) =
                    seqs.iter().partition(|s| s.num_new == 1);
                self.run_prefill(q, kv, heads, &prefill, &out)?;
                let max_visible = decode.iter().map(|s| s.num_computed + 1).max().unwrap_or(0);
                self.run_decode(q, kv, heads, &decode, decode_split_len(max_visible), &out)?;
            }
            Route::Prefill => self.run_prefill(q, kv, heads, &all(), &out)?,
            Route::Decode(split_len) => self.run_decode(q, kv, heads, &all(), split_len, &out)?,
        }
        Ok(out)
    }

    fn attention_constants(heads: AttnHeads, kv: KvPools<'_>) -> [(&'static str, u32); 5] {
        [
            ("HEAD_DIM", heads.head_dim as u32),
            ("NUM_HEADS", heads.num_heads as u32),
            ("NUM_KV_HEADS", heads.kv_heads as u32),
            ("BLOCK_SIZE", kv.k.block_size as u32),
            ("KV_F16", kv.k.is_f16().into()),
        ]
    }

    fn attention_params(heads: AttnHeads, kv: KvPools<'_>, n_rows: usize) -> AttnParams {
        AttnParams {
            n_rows: n_rows as u32,
            blocks_per_chunk: kv.k.blocks_per_chunk as u32,
            scale: 1.0 / (heads.head_dim as f32).sqrt(),
            n_splits: 1,
            split_len: 0,
            part_ml_offset: 0,
            _pad: [0; 2],
        }
    }

    /// The bindings the prefill kernel and the decode partial pass share: params (0), q (1),
    /// row or tile info (2), and each pool's two chunks (K 3-4, V 5-6; a pool of one chunk
    /// binds it twice, read-only aliasing).
    fn attention_bindings<'a>(
        &self, uniform: &'a wgpu::Buffer, q: &'a GpuTensor, info: &'a wgpu::Buffer, kv: KvPools<'a>,
    ) -> Result<[(u32, &'a wgpu::Buffer); 7]> {
        let chunks = |pool: &'a PagedPool| {
            debug_assert!(
                !pool.chunks.is_empty() && pool.chunks.len() <= 2,
                "attention pools have 1-2 chunks"
            );
            (&pool.chunks[0], pool.chunks.get(1).unwrap_or(&pool.chunks[0]))
        };
        let ((k0, k1), (v0, v1)) = (chunks(kv.k), chunks(kv.v));
        Ok([(0, uniform), (1, self.whole(q, OP)?), (2, info), (3, k0), (4, k1), (5, v0), (6, v1)])
    }

    /// Prefill kernel over `seqs` (any num_new), writing their rows of `out`.
    fn run_prefill(
        &self, q: &GpuTensor, kv: KvPools<'_>, heads: AttnHeads, seqs: &[&AttnSeq<'_>], out: &GpuTensor,
    ) -> Result<()> {
        let (tq, kt) = prefill_tiles(heads.head_dim);
        let group = heads.num_heads / heads.kv_heads;
        let (tile_rows, tile_heads) = prefill_slots(tq, group);
        let (tiles, n_tiles) = tile_info(seqs, kv.k.block_size, tile_rows);
        if n_tiles == 0 {
            return Ok(());
        }
        let [hd, nh, nkv, bs, f16] = Self::attention_constants(heads, kv);
        let constants = [
            hd,
            nh,
            nkv,
            bs,
            f16,
            ("TQ", tq as u32),
            ("KT", kt as u32),
            ("TQ_ROWS", tile_rows as u32),
            ("TQ_HEADS", tile_heads as u32),
        ];
        let pipeline = self.pipeline(Shader::PagedAttention, "paged_prefill_attention", &constants)?;
        let info = self.storage_from("attention tiles", &tiles)?;
        // `n_rows` counts tiles for this kernel.
        let uniform = self.uniform(&Self::attention_params(heads, kv, n_tiles));
        let [p, q, info, k0, k1, v0, v1] = self.attention_bindings(&uniform, q, &info, kv)?;
        let bindings = [p, q, info, k0, k1, v0, v1, (7, self.whole(out, OP)?)];
        let workgroups = n_tiles * heads.kv_heads * group.div_ceil(tile_heads);
        self.dispatch("paged_prefill_attention", &pipeline, &bindings, workgroups as u64)
    }

    fn run_decode(
        &self, q: &GpuTensor, kv: KvPools<'_>, heads: AttnHeads, seqs: &[&AttnSeq<'_>], split_len: usize,
        out: &GpuTensor,
    ) -> Result<()> {
        let n_rows = seqs.len();
        if n_rows == 0 {
            return Ok(());
        }
        let max_visible = seqs.iter().map(|s| s.num_computed + 1).max().unwrap_or(1);
        let n_splits = max_visible.div_ceil(split_len);
        let partials = n_rows * heads.num_heads * n_splits;
        let part = self.zeros([1, partials * (heads.head_dim + 2)])?;
        let constants = Self::attention_constants(heads, kv);
        let info = self.storage_from("attention rows", &row_info(seqs, kv.k.block_size))?;
        let params = AttnParams {
            n_splits: n_splits as u32,
            split_len: split_len as u32,
            part_ml_offset: (partials * heads.head_dim) as u32,
            ..Self::attention_params(heads, kv, n_rows)
        };
        let uniform = self.uniform(&params);
        let (shader, entry) = if self.has_subgroups() {
            (Shader::PagedDecodeSubgroup, "paged_decode_subgroup")
        } else {
            (Shader::PagedAttention, "paged_decode_partial")
        };
        let partial = self.pipeline(shader, entry, &constants)?;
        let part = part.into_buffer();
        let [p, q, info, k0, k1, v0, v1] = self.attention_bindings(&uniform, q, &info, kv)?;
        let bindings = [p, q, info, k0, k1, v0, v1, (8, &part)];
        self.dispatch(entry, &partial, &bindings, (n_rows * heads.kv_heads * n_splits) as u64)?;
        let reduce = self.pipeline(Shader::PagedAttention, "paged_decode_reduce", &constants)?;
        let bindings = [p, info, (9, &part), (7, self.whole(out, OP)?)];
        self.dispatch("paged_decode_reduce", &reduce, &bindings, (n_rows * heads.num_heads) as u64)
    }
}
