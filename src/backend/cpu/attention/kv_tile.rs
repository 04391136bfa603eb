//! The K and V rows of one key tile, as both attention layouts read them.

use std::ops::Range;

use super::{Call, Job, KEY_TILE};
use crate::backend::AttnSeq;
use crate::backend::FloatSlice;
use crate::backend::cpu::lanes::Lanes;

/// The K and V rows of one key tile: pointers into the pages when they hold f32,
/// else into this job's scratch, where each tile's rows are widened (exactly)
/// before the tile computes, so both page types run the same arithmetic.
pub(super) struct TileRows {
    pub(super) keys: Vec<*const f32>,
    pub(super) vals: Vec<*const f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl TileRows {
    pub(super) fn new(call: &Call<'_>) -> Self {
        let scratch = if matches!(call.k, FloatSlice::F32(_)) { 0 } else { KEY_TILE * call.heads.head_dim };
        TileRows {
            keys: Vec::with_capacity(KEY_TILE),
            vals: Vec::with_capacity(KEY_TILE),
            k: vec![0.0; scratch],
            v: vec![0.0; scratch],
        }
    }

    /// Points `keys` / `vals` at the rows of `positions` (at most [`KEY_TILE`]) for
    /// `job`'s KV head and asks for the next tile's rows (those the job reads),
    /// which then stream in while this tile computes.
    #[inline(always)]
    pub(super) fn load<L: Lanes>(
        &mut self, l: L, call: &Call<'_>, seq: &AttnSeq<'_>, job: &Job, positions: Range<usize>,
    ) {
        let hd = call.heads.head_dim;
        let (bs, width) = (call.block_size, call.heads.kv_heads * hd);
        // Position j's element offset in the pages.
        let offset = |j: usize| (seq.block_table[j / bs] as usize * bs + j % bs) * width + job.kv_head * hd;
        let end = job.key_end(seq);
        self.keys.clear();
        self.vals.clear();
        if let (FloatSlice::F32(k), FloatSlice::F32(v)) = (call.k, call.v) {
            for j in positions.clone() {
                let off = offset(j);
                self.keys.push(k[off..off + hd].as_ptr());
                self.vals.push(v[off..off + hd].as_ptr());
            }
        } else {
            for (i, j) in positions.clone().enumerate() {
                call.k.widen_into(l, offset(j), &mut self.k[i * hd..(i + 1) * hd]);
                call.v.widen_into(l, offset(j), &mut self.v[i * hd..(i + 1) * hd]);
            }
            self.keys.extend((0..positions.len()).map(|i| self.k[i * hd..].as_ptr()));
            self.vals.extend((0..positions.len()).map(|i| self.v[i * hd..].as_ptr()));
        }
        for j in positions.start + KEY_TILE..(positions.start + 2 * KEY_TILE).min(end) {
            call.k.prefetch(l, offset(j), hd);
            call.v.prefetch(l, offset(j), hd);
        }
    }
}
