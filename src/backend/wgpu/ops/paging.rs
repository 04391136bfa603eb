//! Rows in and out of paged pools (`write_kv`, `write_hidden`, `gather_hidden`) and
//! block copy-on-write (`copy_blocks`), chunk by chunk.

use std::collections::HashSet;

use crate::backend::wgpu::context::GpuContext;
use crate::backend::wgpu::kernel_params::{CopyParams, RowParams};
use crate::backend::wgpu::pipelines::Shader;
use crate::backend::wgpu::pool::PagedPool;
use crate::backend::wgpu::tensor::GpuTensor;
use crate::error::BackendError;
use crate::kv::BlockId;
use crate::{Error, Result};

const ROWS_WG: u64 = 256;
const COPY_WG: u64 = 256;

/// Where rows go inside each slot of a pool.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlotColumns {
    /// First f32 of the moved part inside a slot.
    pub offset: usize,
    /// f32 moved per row.
    pub width: usize,
}

/// Which way rows move, and the dense side's buffer.
#[derive(Clone, Copy)]
enum Direction<'a> {
    /// Dense rows into the pool (`scatter_rows`).
    Scatter(&'a wgpu::Buffer),
    /// Pool into dense rows (`gather_rows`).
    Gather(&'a wgpu::Buffer),
}

/// Entry point of `paged_rows.wgsl`, its dense-side and pool bindings, and the
/// pool elements each invocation moves.
struct RowKernel {
    entry: &'static str,
    rows_binding: u32,
    pool_binding: u32,
    elems_per_invocation: usize,
}

impl Direction<'_> {
    /// The kernel moving rows this way for `pool`; rows are only ever gathered from
    /// f32 pools (hidden states), and f16 pools are written a packed word at a time.
    fn kernel(self, op: &'static str, pool: &PagedPool, cols: SlotColumns) -> Result<RowKernel> {
        let kernel = |entry, rows_binding, pool_binding, elems_per_invocation| RowKernel {
            entry,
            rows_binding,
            pool_binding,
            elems_per_invocation,
        };
        match (self, pool.is_f16()) {
            (Direction::Scatter(_), false) => Ok(kernel("scatter_rows", 2, 3, 1)),
            (Direction::Gather(_), false) => Ok(kernel("gather_rows", 5, 4, 1)),
            (Direction::Scatter(_), true)
                if cols.width.is_multiple_of(2) && cols.offset.is_multiple_of(2) =>
            {
                Ok(kernel("scatter_rows_f16", 2, 6, 2))
            }
            _ => Err(BackendError::OpShape {
                op,
                what: "f16 pool columns (only whole even-width slots are written, never read, as rows)",
                expected: "scatter of even width at an even offset".into(),
                found: vec![cols.offset, cols.width],
            }
            .into()),
        }
    }
}

/// Checks every non-negative slot lies in `0..num_slots` and converts to the kernels' i32.
pub(crate) fn checked_slots(op: &'static str, slots: &[i64], num_slots: usize) -> Result<Vec<i32>> {
    slots
        .iter()
        .map(|&s| {
            if s < 0 {
                return Ok(-1);
            }
            usize::try_from(s)
                .ok()
                .filter(|&u| u < num_slots)
                .and_then(|u| i32::try_from(u).ok())
                .ok_or(Error::Backend(BackendError::OpIndex { op, what: "slot", index: s, bound: num_slots }))
        })
        .collect()
}

impl GpuContext {
    /// Runs the row kernel once per chunk that holds at least one of `slots`.
    fn rows_per_chunk(
        &self, op: &'static str, direction: Direction<'_>, pool: &PagedPool, slots: &[i32], cols: SlotColumns,
    ) -> Result<()> {
        let RowKernel { entry, rows_binding, pool_binding, elems_per_invocation } =
            direction.kernel(op, pool, cols)?;
        let (Direction::Scatter(rows) | Direction::Gather(rows)) = direction;
        let pipeline = self.pipeline(Shader::PagedRows, entry, &[])?;
        let slot_buffer = self.storage_from("slots", slots)?;
        for (c, chunk) in pool.chunks.iter().enumerate() {
            let base = c * pool.blocks_per_chunk * pool.block_size;
            let count = pool.blocks_in_chunk(c) * pool.block_size;
            let touched = slots.iter().any(|&s| s >= 0 && (base..base + count).contains(&(s as usize)));
            if !touched {
                continue;
            }
            let params = RowParams {
                n_rows: slots.len() as u32,
                width: cols.width as u32,
                slot_stride: pool.slot_elems as u32,
                slot_offset: cols.offset as u32,
                slot_base: base as u32,
                slot_count: count as u32,
                _pad: [0; 2],
            };
            let uniform = self.uniform(&params);
            let invocations = (slots.len() * cols.width / elems_per_invocation) as u64;
            self.dispatch(
                op,
                &pipeline,
                &[(0, &uniform), (1, &slot_buffer), (rows_binding, rows), (pool_binding, chunk)],
                invocations.div_ceil(ROWS_WG),
            )?;
        }
        Ok(())
    }

    /// Writes row `i` of `rows [slots.len(), cols.width]` into slot `slots[i]` at
    /// `cols.offset`; negative slots skip their row.
    pub(crate) fn scatter_to_pool(
        &self, op: &'static str, pool: &PagedPool, rows: &GpuTensor, slots: &[i64], cols: SlotColumns,
    ) -> Result<()> {
        rows.expect_rows(op, "rows", slots.len())?;
        rows.expect_cols(op, "rows", cols.width)?;
        let slots = checked_slots(op, slots, pool.num_slots())?;
        self.rows_per_chunk(op, Direction::Scatter(self.whole(rows, op)?), pool, &slots, cols)
    }

    /// Reads slot `slots[i]` at `cols` into row `i` of a new `[slots.len(), cols.width]`
    /// tensor; rows of negative slots stay zero.
    pub(crate) fn gather_from_pool(
        &self, op: &'static str, pool: &PagedPool, slots: &[i64], cols: SlotColumns,
    ) -> Result<GpuTensor> {
        let slots = checked_slots(op, slots, pool.num_slots())?;
        let out = self.zeros([slots.len(), cols.width])?;
        self.rows_per_chunk(op, Direction::Gather(self.whole(&out, op)?), pool, &slots, cols)?;
        Ok(out)
    }

    /// Copies whole blocks `src → dst` of one pool with the semantics of doing them in
    /// order: pairs run together only while no pair reads or overwrites a block an
    /// earlier pair of the same batch writes or reads.
    pub(crate) fn copy_pool_blocks(&self, pool: &PagedPool, copies: &[(BlockId, BlockId)]) -> Result<()> {
        let mut batch: Vec<(usize, usize)> = Vec::new();
        let (mut read, mut written) = (HashSet::new(), HashSet::new());
        for &(src, dst) in copies {
            let (src, dst) = (src as usize, dst as usize);
            if src == dst {
                continue;
            }
            if written.contains(&src) || written.contains(&dst) || read.contains(&dst) {
                self.copy_block_batch(pool, &batch)?;
                batch.clear();
                read.clear();
                written.clear();
            }
            read.insert(src);
            written.insert(dst);
            batch.push((src, dst));
        }
        self.copy_block_batch(pool, &batch)
    }

    /// Copies independent block pairs: inside one chunk with the kernel, across chunks
    /// with buffer copies.
    fn copy_block_batch(&self, pool: &PagedPool, pairs: &[(usize, usize)]) -> Result<()> {
        let block_words = pool.block_words();
        if pairs.is_empty() || block_words == 0 {
            return Ok(());
        }
        let bpc = pool.blocks_per_chunk;
        let block_bytes = (block_words * 4) as u64;
        let mut across = Vec::new();
        for (c, chunk) in pool.chunks.iter().enumerate() {
            let local: Vec<u32> = pairs
                .iter()
                .filter(|&&(s, d)| s / bpc == c && d / bpc == c)
                .flat_map(|&(s, d)| [(s % bpc) as u32, (d % bpc) as u32])
                .collect();
            if local.is_empty() {
                continue;
            }
            let pipeline = self.pipeline(Shader::CopyBlocks, "copy_blocks", &[])?;
            let n_pairs = local.len() / 2;
            let params =
                CopyParams { n_pairs: n_pairs as u32, block_words: block_words as u32, _pad: [0; 2] };
            let uniform = self.uniform(&params);
            let pair_buffer = self.storage_from("copy pairs", &local)?;
            let groups = ((n_pairs * block_words) as u64).div_ceil(COPY_WG);
            self.dispatch("copy_blocks", &pipeline, &[(0, &uniform), (1, &pair_buffer), (2, chunk)], groups)?;
        }
        across.extend(pairs.iter().filter(|&&(s, d)| s / bpc != d / bpc));
        if across.is_empty() {
            return Ok(());
        }
        self.scoped("copy_blocks", || {
            let mut encoder = self.device.create_command_encoder(&Default::default());
            for &(s, d) in &across {
                encoder.copy_buffer_to_buffer(
                    &pool.chunks[s / bpc],
                    (s % bpc) as u64 * block_bytes,
                    &pool.chunks[d / bpc],
                    (d % bpc) as u64 * block_bytes,
                    block_bytes,
                );
            }
            encoder.finish()
        })
        .map(|commands| self.submit(commands))
    }
}
