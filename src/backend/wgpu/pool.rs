//! Paged pools on the device: `num_blocks` blocks of `block_size` slots of
//! `slot_elems` f32 (or f16, two per 32-bit word: K/V pages), split into chunks of
//! whole blocks when one storage binding cannot hold them all.

use crate::backend::Dtype;
use crate::backend::wgpu::context::GpuContext;
use crate::backend::wgpu::tensor::widen;
use crate::error::GpuError;
use crate::{Error, Result};

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

/// Plans a pool of `num_blocks` blocks of `block_elems` 4-byte words over buffers of at most
/// `max_binding_bytes`; at most `max_chunks` buffers when every chunk must be bound at once.
pub fn plan_pool(
    adapter: &str, what: &str, num_blocks: usize, block_elems: usize, max_binding_bytes: u64,
    max_chunks: Option<usize>,
) -> Result<PoolPlan> {
    let block_bytes = (block_elems as u64).saturating_mul(4);
    let total = block_bytes.saturating_mul(num_blocks as u64);
    let too_large = |limit: &'static str, max: u64| {
        Error::Gpu(GpuError::TooLarge {
            adapter: adapter.to_string(),
            what: what.to_string(),
            requested: total,
            limit,
            max,
        })
    };
    if block_bytes > max_binding_bytes {
        return Err(GpuError::TooLarge {
            adapter: adapter.to_string(),
            what: format!("one block of {what}"),
            requested: block_bytes,
            limit: "max_storage_buffer_binding_size",
            max: max_binding_bytes,
        }
        .into());
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
    /// [`Dtype::F32`], or [`Dtype::F16`] (K/V pages; `slot_elems` is even).
    pub(crate) dtype: Dtype,
}

impl PagedPool {
    /// Number of buffers the pool is split into.
    pub fn num_chunks(&self) -> usize {
        self.chunks.len()
    }

    /// How the elements are stored.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Whether the elements are f16 (the kernels' `*_F16` override constants).
    pub(crate) fn is_f16(&self) -> bool {
        self.dtype == Dtype::F16
    }

    /// Elements of one block.
    pub(crate) fn block_elems(&self) -> usize {
        self.block_size.saturating_mul(self.slot_elems)
    }

    /// 4-byte words of one block (slots never share a word: f16 slots are of even length).
    pub(crate) fn block_words(&self) -> usize {
        self.block_elems().saturating_mul(self.dtype.size_bytes()) / 4
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
    /// A zero-filled pool of `dtype` (f32, or f16 with an even `slot_elems`: two
    /// halves per 32-bit word, so that writing a slot never touches another's word);
    /// `max_chunks` bounds the buffers it may be split into.
    pub(crate) fn alloc_pool(
        &self, what: &str, (num_blocks, block_size, slot_elems): (usize, usize, usize), dtype: Dtype,
        max_chunks: Option<usize>,
    ) -> Result<PagedPool> {
        if dtype == Dtype::F16 && !slot_elems.is_multiple_of(2) {
            return Err(GpuError::Unsupported {
                what: "slot width (kv_heads * head_dim) of f16 pages",
                value: slot_elems,
                supported: "even widths (two halves per 32-bit word)",
            }
            .into());
        }
        let mut pool =
            PagedPool { chunks: Vec::new(), blocks_per_chunk: 0, num_blocks, block_size, slot_elems, dtype };
        let block_words = pool.block_words();
        let plan =
            plan_pool(&self.adapter_name, what, num_blocks, block_words, self.max_binding_bytes, max_chunks)?;
        pool.blocks_per_chunk = plan.blocks_per_chunk;
        for c in 0..plan.chunks {
            let len = pool.blocks_in_chunk(c) * block_words;
            pool.chunks.push(self.zeros([1, len])?.into_buffer());
        }
        Ok(pool)
    }

    /// The whole pool back on the host, in block order, widened to f32 (tests and debugging).
    pub fn download_pool(&self, pool: &PagedPool) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(pool.num_blocks * pool.block_elems());
        for (c, chunk) in pool.chunks.iter().enumerate() {
            let bytes = self.read_buffer(chunk, (pool.blocks_in_chunk(c) * pool.block_words() * 4) as u64)?;
            out.extend(widen(&bytes, pool.dtype, pool.blocks_in_chunk(c) * pool.block_elems())?);
        }
        Ok(out)
    }
}
