//! Host pages: each layer's K and V in the pages' element type (f32, bf16 or
//! f16), and the captured hidden states in f32.

use ndarray::Array2;

use super::check::{expect_cols, expect_rows, row_index};
use super::lanes::{Lanes, widen_bf16};
use crate::Result;
use crate::backend::{FloatSlice, FloatVec, PagesSpec};
use crate::kv::BlockId;

// One layer's K (or V) pages as the attention kernel reads them. These two are the
// CPU kernels' own (they take SIMD lanes), so they live here rather than with the type.
impl FloatSlice<'_> {
    /// Elements `off..off + dst.len()` widened into `dst` (exact).
    #[inline(always)]
    pub(crate) fn widen_into<L: Lanes>(self, l: L, off: usize, dst: &mut [f32]) {
        let n = dst.len();
        match self {
            FloatSlice::F32(b) => dst.copy_from_slice(&b[off..off + n]),
            FloatSlice::Bf16(b) => widen_bf16(&b[off..off + n], dst),
            FloatSlice::F16(b) => l.widen_f16(&b[off..off + n], dst),
        }
    }

    /// Asks for the cache lines of elements `off..off + len` (no effect on results).
    #[inline(always)]
    pub(crate) fn prefetch<L: Lanes>(self, l: L, off: usize, len: usize) {
        match self {
            FloatSlice::F32(b) => (0..len).step_by(16).for_each(|i| l.prefetch(b[off + i..].as_ptr())),
            FloatSlice::Bf16(b) => {
                (0..len).step_by(32).for_each(|i| l.prefetch(b[off + i..].as_ptr().cast()))
            }
            FloatSlice::F16(b) => (0..len).step_by(32).for_each(|i| l.prefetch(b[off + i..].as_ptr().cast())),
        }
    }
}

/// K/V pages per layer (`[num_blocks, block_size, kv_heads, head_dim]` flat, in
/// `spec.kv_dtype`) and the hidden pages (`[num_blocks, block_size, captured, hidden]` flat, f32).
#[derive(Debug, Clone)]
pub struct CpuPages {
    pub(crate) spec: PagesSpec,
    pub(crate) k: Vec<FloatVec>,
    pub(crate) v: Vec<FloatVec>,
    pub(crate) hidden: Vec<f32>,
}

/// Checks every non-negative slot is in range (before anything is written).
fn check_slots(op: &'static str, slots: &[i64], num_slots: usize) -> Result<()> {
    for &s in slots.iter().filter(|&&s| s >= 0) {
        row_index(op, "slot", s, num_slots)?;
    }
    Ok(())
}

impl CpuPages {
    /// Zero-filled pages of `spec`'s sizes.
    pub(crate) fn new(spec: PagesSpec) -> Result<Self> {
        let kv = spec.num_slots() * spec.kv_width();
        // `alloc_pages` checked `kv_dtype` is a float type.
        let zeros = FloatVec::zeros(spec.kv_dtype, kv)?;
        Ok(Self {
            spec,
            k: vec![zeros.clone(); spec.num_layers],
            v: vec![zeros; spec.num_layers],
            hidden: vec![0.0; spec.num_slots() * spec.captured * spec.hidden],
        })
    }

    fn layer_index(&self, op: &'static str, layer: usize) -> Result<usize> {
        row_index(op, "layer", layer as i64, self.spec.num_layers)
    }

    /// Layer `layer`'s K and V pages.
    pub(crate) fn kv(&self, op: &'static str, layer: usize) -> Result<(FloatSlice<'_>, FloatSlice<'_>)> {
        let l = self.layer_index(op, layer)?;
        Ok((self.k[l].view(), self.v[l].view()))
    }

    pub(crate) fn write_kv(
        &mut self, layer: usize, k: &Array2<f32>, v: &Array2<f32>, slots: &[i64],
    ) -> Result<()> {
        const OP: &str = "write_kv";
        let l = self.layer_index(OP, layer)?;
        let width = self.spec.kv_width();
        for (what, t) in [("k", k), ("v", v)] {
            expect_rows(OP, what, t, slots.len())?;
            expect_cols(OP, what, t, width)?;
        }
        check_slots(OP, slots, self.spec.num_slots())?;
        for (i, &s) in slots.iter().enumerate() {
            let Ok(s) = usize::try_from(s) else { continue };
            for (page, t) in [(&mut self.k[l], k), (&mut self.v[l], v)] {
                page.write(s * width, t.row(i).iter().copied());
            }
        }
        Ok(())
    }

    fn capture_index(&self, op: &'static str, capture: usize) -> Result<usize> {
        row_index(op, "capture", capture as i64, self.spec.captured)
    }

    fn hidden_range(&self, slot: usize, capture: usize) -> std::ops::Range<usize> {
        let h = self.spec.hidden;
        let start = (slot * self.spec.captured + capture) * h;
        start..start + h
    }

    pub(crate) fn write_hidden(&mut self, capture: usize, x: &Array2<f32>, slots: &[i64]) -> Result<()> {
        const OP: &str = "write_hidden";
        let c = self.capture_index(OP, capture)?;
        expect_rows(OP, "x", x, slots.len())?;
        expect_cols(OP, "x", x, self.spec.hidden)?;
        check_slots(OP, slots, self.spec.num_slots())?;
        let x = x.as_standard_layout();
        let rows = x.as_slice().unwrap_or_default().chunks_exact(self.spec.hidden);
        for (&s, row) in slots.iter().zip(rows) {
            let Ok(s) = usize::try_from(s) else { continue };
            let range = self.hidden_range(s, c);
            self.hidden[range].copy_from_slice(row);
        }
        Ok(())
    }

    pub(crate) fn gather_hidden(&self, capture: usize, slots: &[i64]) -> Result<Array2<f32>> {
        const OP: &str = "gather_hidden";
        let c = self.capture_index(OP, capture)?;
        check_slots(OP, slots, self.spec.num_slots())?;
        // Row by row into a fresh buffer: a prefill gathers every position of its
        // prompt, so zero-filling the output first would write it twice.
        let h = self.spec.hidden;
        let mut out = Vec::with_capacity(slots.len() * h);
        for &s in slots {
            match usize::try_from(s) {
                Ok(s) => out.extend_from_slice(&self.hidden[self.hidden_range(s, c)]),
                Err(_) => out.resize(out.len() + h, 0.0),
            }
        }
        Ok(Array2::from_shape_vec((slots.len(), h), out).expect("one row of `hidden` per slot"))
    }

    pub(crate) fn copy_blocks(&mut self, copies: &[(BlockId, BlockId)]) -> Result<()> {
        const OP: &str = "copy_blocks";
        for &(src, dst) in copies {
            for b in [src, dst] {
                row_index(OP, "block", b as i64, self.spec.num_blocks)?;
            }
        }
        let bs = self.spec.block_size;
        let kv_block = bs * self.spec.kv_width();
        let hidden_block = bs * self.spec.captured * self.spec.hidden;
        for &(src, dst) in copies {
            let (src, dst) = (src as usize, dst as usize);
            for page in self.k.iter_mut().chain(self.v.iter_mut()) {
                page.copy_within(src * kv_block..(src + 1) * kv_block, dst * kv_block);
            }
            self.hidden.copy_within(src * hidden_block..(src + 1) * hidden_block, dst * hidden_block);
        }
        Ok(())
    }

    /// Block `block`'s K and V of every layer, then its hidden rows, appended to
    /// `out` as stored bytes (the disk tier's payload, [`crate::tier::BlockLayout`]'s order).
    pub(crate) fn export_block(&self, block: BlockId, out: &mut Vec<u8>) -> Result<()> {
        let (kv, hidden) = self.block_ranges("export_block", block)?;
        for (k, v) in self.k.iter().zip(&self.v) {
            out.extend_from_slice(k.view().slice(kv.clone()).as_bytes());
            out.extend_from_slice(v.view().slice(kv.clone()).as_bytes());
        }
        out.extend_from_slice(bytemuck::cast_slice(&self.hidden[hidden]));
        Ok(())
    }

    /// Writes `bytes` (as [`export_block`](Self::export_block) made them) into block `block`.
    pub(crate) fn import_block(&mut self, block: BlockId, bytes: &[u8]) -> Result<()> {
        const OP: &str = "import_block";
        let (kv, hidden) = self.block_ranges(OP, block)?;
        let kv_bytes = kv.len() * self.spec.kv_dtype.size_bytes();
        let expected = 2 * self.spec.num_layers * kv_bytes + hidden.len() * 4;
        if bytes.len() != expected {
            return Err(crate::error::BackendError::OpCount {
                op: OP,
                what: "payload bytes",
                expected,
                found: bytes.len(),
            }
            .into());
        }
        let mut parts = bytes.chunks_exact(kv_bytes.max(1));
        for page in self.k.iter_mut().zip(self.v.iter_mut()).flat_map(|(k, v)| [k, v]) {
            if let Some(part) = parts.next() {
                page.bytes_mut(kv.clone()).copy_from_slice(part);
            }
        }
        let hidden_bytes = &bytes[2 * self.spec.num_layers * kv_bytes..];
        bytemuck::cast_slice_mut::<f32, u8>(&mut self.hidden[hidden]).copy_from_slice(hidden_bytes);
        Ok(())
    }

    /// The element ranges of block `block` in a K/V page and in the hidden page.
    fn block_ranges(
        &self, op: &'static str, block: BlockId,
    ) -> Result<(std::ops::Range<usize>, std::ops::Range<usize>)> {
        let b = row_index(op, "block", block as i64, self.spec.num_blocks)?;
        let kv_block = self.spec.block_size * self.spec.kv_width();
        let hidden_block = self.spec.block_size * self.spec.captured * self.spec.hidden;
        Ok((b * kv_block..(b + 1) * kv_block, b * hidden_block..(b + 1) * hidden_block))
    }
}
