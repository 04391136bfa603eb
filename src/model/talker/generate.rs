//! The talker's frame loop, as HF `Qwen3OmniMoeTalkerForConditionalGeneration.generate`
//! runs it: prefill the talker prompt; then per frame sample the first code from
//! the last row's `codec_head` logits (repetition penalty over the codes so far,
//! the special codec ids but EOS suppressed), let the code predictor complete the
//! frame from the last row's final-normed hidden state, and feed back the sum of
//! the frame's 16 codec embeddings plus the next `trailing_text_hidden` row (or
//! `tts_pad_embed` once they run out) as the next decode row.
//!
//! The talker's KV lives in paged KV run by the thinker's
//! [`ModelRunner`](crate::runner::ModelRunner), so a caller holding a prefilled
//! prefix (pages + block table) can start after it.
//!
//! [`Talker::generate_in`](crate::model::talker::Talker::generate_in) is a loop of
//! [`Talker::step`](crate::model::talker::Talker::step) over one
//! [`TalkerSeq`](crate::model::talker::TalkerSeq) that has every trailing row up
//! front: the engine's step-wise, batched path and this one are the same code.

use std::sync::Arc;

use super::Talker;
use super::inputs::{TalkerInputs, TalkerOutput};
use super::step::{TalkerBlocks, TalkerSeq};
use crate::Result;
use crate::backend::Backend;
use crate::error::RunnerError;
use crate::kv::BlockTable;
use crate::model::{CaptureName, CaptureSpec};
use crate::runner::ModelRunner;
use crate::sample::TalkerSampling;

/// Block size of the pages [`Talker::generate`] allocates for itself.
const BLOCK: usize = 16;

/// Talker KV a caller owns: pages from [`Talker::alloc_pages`] and the block table
/// of this sequence, whose first `num_cached` positions already hold the KV (and
/// final-normed hidden rows) of the same prompt rows (a reused prefix).
pub struct TalkerKv<'a, B: Backend> {
    pub pages: &'a mut B::Pages,
    /// Must cover `rows + max_new_tokens - 1` positions.
    pub block_table: BlockTable,
    pub num_cached: usize,
}

impl<B: Backend> Talker<B> {
    /// The runner of the talker decoder: captures the final-normed rows (HF's
    /// `hidden_states[-1]`, the code predictor's `past_hidden`).
    pub fn runner(&self, backend: &Arc<B>) -> Result<ModelRunner<B>> {
        let layers = self.model.config().num_hidden_layers;
        ModelRunner::new(backend.clone(), self.model.clone(), CaptureSpec::new([CaptureName::Final], layers)?)
    }

    /// Zero-filled talker pages of `num_blocks` blocks of `block_size` positions.
    pub fn alloc_pages(&self, backend: &Arc<B>, num_blocks: usize, block_size: usize) -> Result<B::Pages> {
        self.runner(backend)?.alloc_pages(num_blocks, block_size)
    }

    /// Generates the codes of `inputs` on pages of its own, calling `on_frame` with
    /// each frame's `num_code_groups` codes as soon as it is complete (an error from
    /// it ends the run with that error). See [`Talker::generate_in`].
    pub fn generate(
        &self, backend: &Arc<B>, inputs: &TalkerInputs, sampling: &TalkerSampling,
        on_frame: impl FnMut(&[u32]) -> Result<()>,
    ) -> Result<TalkerOutput> {
        let positions = inputs.embeds.nrows() + sampling.max_new_tokens.saturating_sub(1);
        let blocks = positions.div_ceil(BLOCK);
        let mut pages = self.alloc_pages(backend, blocks, BLOCK)?;
        let block_table = BlockTable::new((0..blocks as u32).collect(), BLOCK);
        self.generate_in(
            backend,
            TalkerKv { pages: &mut pages, block_table, num_cached: 0 },
            inputs,
            sampling,
            on_frame,
        )
    }

    /// [`Talker::generate`] over caller-owned KV, starting after its `num_cached`
    /// prompt rows (at least the last prompt row runs, for its logits).
    ///
    /// Greedy (`temperature` 0) equals HF's `talker_do_sample=False` code for code.
    /// Errors: `sampling` out of range ([`RequestError::InvalidSampling`](crate::error::RequestError::InvalidSampling)),
    /// inputs or a block table that do not fit ([`RunnerError::InvalidBatch`]), and
    /// whatever `on_frame` returns.
    pub fn generate_in(
        &self, backend: &Arc<B>, kv: TalkerKv<'_, B>, inputs: &TalkerInputs, sampling: &TalkerSampling,
        mut on_frame: impl FnMut(&[u32]) -> Result<()>,
    ) -> Result<TalkerOutput> {
        let blocks = TalkerBlocks { block_table: kv.block_table, num_cached: kv.num_cached };
        let mut seq = TalkerSeq::new(&self.config, 0, inputs.clone(), sampling, blocks)?;
        // Every trailing row (HF's tts_eos included) is in `inputs`.
        seq.finish_trailing();
        let needed = seq.positions_needed();
        if !seq.block_table().covers(needed) {
            return Err(RunnerError::InvalidBatch {
                request: 0,
                what: format!(
                    "talker block table of {} blocks cannot hold {needed} positions",
                    seq.block_table().len()
                ),
            }
            .into());
        }
        let runner = self.runner(backend)?;
        while !seq.is_finished() {
            let frame = self.step(backend, &runner, kv.pages, &mut [&mut seq])?.pop().flatten();
            if let Some(frame) = frame {
                on_frame(&frame)?;
            }
        }
        seq.into_output().ok_or_else(|| {
            crate::error::Component::Runner.violation("a finished talker seq has no output").into()
        })
    }
}
