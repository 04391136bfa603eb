//! Host pages: flat f32 buffers for each layer's K and V and for captured hidden states.

use ndarray::Array2;

use super::check::{expect_cols, expect_rows, row_index};
use crate::backend::PagesSpec;
use crate::kv::BlockId;
use crate::Result;

/// K/V pages per layer (`[num_blocks, block_size, kv_heads, head_dim]` flat) and the
/// hidden pages (`[num_blocks, block_size, captured, hidden]` flat).
#[derive(Debug, Clone)]
pub struct CpuPages {
    pub(crate) spec: PagesSpec,
    pub(crate) k: Vec<Vec<f32>>,
    pub(crate) v: Vec<Vec<f32>>,
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
    pub(crate) fn new(spec: PagesSpec) -> Self {
        let kv = spec.num_slots() * spec.kv_width();
        Self {
            spec,
            k: vec![vec![0.0; kv]; spec.num_layers],
            v: vec![vec![0.0; kv]; spec.num_layers],
            hidden: vec![0.0; spec.num_slots() * spec.captured * spec.hidden],
        }
    }

    fn layer_index(&self, op: &'static str, layer: usize) -> Result<usize> {
        row_index(op, "layer", layer as i64, self.spec.num_layers)
    }

    /// Layer `layer`'s K and V buffers.
    pub(crate) fn kv(&self, op: &'static str, layer: usize) -> Result<(&[f32], &[f32])> {
        let l = self.layer_index(op, layer)?;
        Ok((&self.k[l], &self.v[l]))
    }

    pub(crate) fn write_kv(&mut self, layer: usize, k: &Array2<f32>, v: &Array2<f32>, slots: &[i64]) -> Result<()> {
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
            let range = s * width..(s + 1) * width;
            for (page, t) in [(&mut self.k[l], k), (&mut self.v[l], v)] {
                for (dst, src) in page[range.clone()].iter_mut().zip(t.row(i)) {
                    *dst = *src;
                }
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
        for (i, &s) in slots.iter().enumerate() {
            let Ok(s) = usize::try_from(s) else { continue };
            let range = self.hidden_range(s, c);
            for (dst, src) in self.hidden[range].iter_mut().zip(x.row(i)) {
                *dst = *src;
            }
        }
        Ok(())
    }

    pub(crate) fn gather_hidden(&self, capture: usize, slots: &[i64]) -> Result<Array2<f32>> {
        const OP: &str = "gather_hidden";
        let c = self.capture_index(OP, capture)?;
        check_slots(OP, slots, self.spec.num_slots())?;
        let mut out = Array2::zeros((slots.len(), self.spec.hidden));
        for (i, &s) in slots.iter().enumerate() {
            let Ok(s) = usize::try_from(s) else { continue };
            for (dst, src) in out.row_mut(i).iter_mut().zip(&self.hidden[self.hidden_range(s, c)]) {
                *dst = *src;
            }
        }
        Ok(out)
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
}
