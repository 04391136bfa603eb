//! Paged pools on the device: `num_blocks` blocks of `block_size` slots of
//! `slot_elems` f32, split into chunks of whole blocks when one storage binding
//! cannot hold them all.

use crate::backend::wgpu::context::GpuContext;
use crate::{Error, Result};
use crate::error::GpuError;

/// Chunks an attention kernel can bind at once (K and V each): the kernels read
/// `k0`/`k1` and `v0`/`v1`.
pub const ATTENTION_POOL_CHUNKS: usize = 2;

/// How a pool is laid out over buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolPlan {
    /// Whole blocks per buffer (the last buffer may hold fewer).
    pub blocks_per_chunk: usize,
    /// Number of buffers.
    pub chunks: usize,
}

/// Plans a pool of `num_blocks` blocks of `block_elems` f32 over buffers of at most
/// `max_binding_bytes`; at most `max_chunks` buffers when every chunk must be bound at once.
pub fn plan_pool(
    adapter: &str,
    what: &str,
    num_blocks: usize,
    block_elems: usize,
    max_binding_bytes: u64,
    max_chunks: Option<usize>,
) -> Result<PoolPlan> {
    let block_bytes = (block_elems as u64).saturating_mul(4);
    let total = block_bytes.saturating_mul(num_blocks as u64);
    let too_large = |limit: &'static str, max: u64| Error::Gpu(GpuError::TooLarge {
        adapter: adapter.to_string(),
        what: what.to_string(),
        requested: total,
        limit,
        max,
    });
    if block_bytes > max_binding_bytes {
        return Err(GpuError::TooLarge {
            adapter: adapter.to_string(),
            what: format!("one block of {what}"),
            requested: block_bytes,
            limit: "max_storage_buffer_binding_size",
            max: max_binding_bytes,
        }.into());
    }
    let blocks_per_chunk = match max_binding_bytes.checked_div(block_bytes) {
        Some(fit) => usize::try_from(fit).unwrap_or(usize::MAX).min(num_blocks).max(1),
        None => num_blocks.max(1), // zero-sized blocks
    };
    let chunks = num_blocks.div_ceil(blocks_per_chunk).max(1);
    if let Some(max) = max_chunks
        && chunks > max
    {
        let fit = (blocks_per_chunk as u64) * block_bytes * max as u64;
        return Err(too_large("max_storage_buffer_binding_size x bound chunks", fit));
    }
    Ok(PoolPlan { blocks_per_chunk, chunks })
}

/// A paged pool: chunk `c` holds blocks `c * blocks_per_chunk ..`.
#[derive(Debug)]
pub struct PagedPool {
    pub(crate) chunks: Vec<wgpu::Buffer>,
    pub(crate) blocks_per_chunk: usize,
    pub(crate) num_blocks: usize,
    pub(crate) block_size: usize,
    pub(crate) slot_elems: usize,
}

impl PagedPool {
    /// Number of buffers the pool is split into.
    pub fn num_chunks(&self) -> usize {
        self.chunks.len()
    }

    /// f32 elements of one block.
    pub(crate) fn block_elems(&self) -> usize {
        self.block_size * self.slot_elems
    }

    /// Number of slots.
    pub(crate) fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// Blocks held by chunk `c`.
    pub(crate) fn blocks_in_chunk(&self, c: usize) -> usize {
        self.num_blocks.saturating_sub(c * self.blocks_per_chunk).min(self.blocks_per_chunk)
    }
}

impl GpuContext {
    /// A zero-filled pool; `max_chunks` bounds the buffers it may be split into.
    pub(crate) fn alloc_pool(
        &self,
        what: &str,
        num_blocks: usize,
        block_size: usize,
        slot_elems: usize,
        max_chunks: Option<usize>,
    ) -> Result<PagedPool> {
        let block_elems = block_size.saturating_mul(slot_elems);
        let plan = plan_pool(&self.adapter_name, what, num_blocks, block_elems, self.max_binding_bytes, max_chunks)?;
        let mut pool = PagedPool {
            chunks: Vec::with_capacity(plan.chunks),
            blocks_per_chunk: plan.blocks_per_chunk,
            num_blocks,
            block_size,
            slot_elems,
        };
        for c in 0..plan.chunks {
            let len = pool.blocks_in_chunk(c) * block_elems;
            pool.chunks.push(self.zeros([1, len])?.into_buffer());
        }
        Ok(pool)
    }

    /// The whole pool back on the host, in block order (tests and debugging).
    pub fn download_pool(&self, pool: &PagedPool) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(pool.num_blocks * pool.block_elems());
        for (c, chunk) in pool.chunks.iter().enumerate() {
            let bytes = self.read_buffer(chunk, (pool.blocks_in_chunk(c) * pool.block_elems() * 4) as u64)?;
            out.extend(bytemuck::pod_collect_to_vec::<u8, f32>(&bytes));
        }
        Ok(out)
    }
}
