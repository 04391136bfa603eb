//! The talker's frame loop, as HF `Qwen3OmniMoeTalkerForConditionalGeneration.generate`
//! runs it: prefill the talker prompt; then per frame sample the first code from
//! the last row's `codec_head` logits (repetition penalty over the codes so far,
//! the special codec ids but EOS suppressed), let the code predictor complete the
//! frame from the last row's final-normed hidden state, and feed back the sum of
//! the frame's 16 codec embeddings plus the next `trailing_text_hidden` row (or
//! `tts_pad_embed` once they run out) as the next decode row.
//!
//! The talker's KV lives in paged KV run by the thinker's [`ModelRunner`](crate::runner::ModelRunner), so a
//! caller holding a prefilled prefix (pages + block table) can start after it.

use std::sync::Arc;

use ndarray::{Array2, s};

use super::Talker;
use crate::backend::Backend;
use crate::batch::{EmbedRows, ScheduledBatch, ScheduledSeq};
use crate::error::{BackendError, RunnerError};
use crate::kv::BlockTable;
use crate::model::{CaptureName, CaptureSpec};
use crate::prompt::Positions;
use crate::runner::{ModelRunner, SeqOutput};
use crate::sample::{FinishReason, Sampler, TalkerSampling, apply_repetition_penalty};
use crate::{Error, Result};

/// Block size of the pages [`Talker::generate`] allocates for itself.
const BLOCK: usize = 16;

/// The talker prompt and what its decode steps add (HF `talker.generate`'s
/// `inputs_embeds`, 3-D positions, `trailing_text_hidden`, `tts_pad_embed`).
#[derive(Debug, Clone)]
pub struct TalkerInputs {
    /// Prefill rows `[rows, hidden]`.
    pub embeds: Array2<f32>,
    /// The (temporal, height, width) rotary position of each prefill row.
    pub positions: Vec<[i64; 3]>,
    /// Decode row at sequence index `p` has position `p + rope_delta` on every axis.
    pub rope_delta: i64,
    /// `[n, hidden]`: decode step `s` adds row `s` while `s < n`...
    pub trailing_text_hidden: Array2<f32>,
    /// ...and this `[1, hidden]` row after that.
    pub tts_pad_embed: Array2<f32>,
}

impl TalkerInputs {
    /// Inputs with 1-D positions `0..rows` (a prompt without multimodal items).
    pub fn linear(
        embeds: Array2<f32>, trailing_text_hidden: Array2<f32>, tts_pad_embed: Array2<f32>,
    ) -> Self {
        let positions = (0..embeds.nrows() as i64).map(|p| [p; 3]).collect();
        TalkerInputs { embeds, positions, rope_delta: 0, trailing_text_hidden, tts_pad_embed }
    }

    fn check(&self, hidden: usize) -> Result<()> {
        let bad = |what: String| Err(Error::Runner(RunnerError::InvalidBatch { request: 0, what }));
        let rows = self.embeds.nrows();
        if rows == 0 {
            return bad("the talker prompt has no rows".into());
        }
        if self.positions.len() != rows {
            return bad(format!("{} positions for {rows} talker prompt rows", self.positions.len()));
        }
        for (what, m, n) in [
            ("talker prompt", &self.embeds, None),
            ("trailing_text_hidden", &self.trailing_text_hidden, None),
            ("tts_pad_embed", &self.tts_pad_embed, Some(1)),
        ] {
            if m.ncols() != hidden || n.is_some_and(|n| m.nrows() != n) {
                return bad(format!("{what} is {:?}, the talker is {hidden} wide", m.shape()));
            }
        }
        Ok(())
    }
}

/// What a talker run produced.
#[derive(Debug, Clone)]
pub struct TalkerOutput {
    /// Codec codes `[num_code_groups, frames]`: column `f` is frame `f`, row 0 the
    /// talker's code, rows `1..` the code predictor's (what code2wav takes).
    pub codes: Array2<u32>,
    /// The talker's final-normed hidden row each frame's code predictor started from, `[frames, hidden]`.
    pub past_hidden: Array2<f32>,
    /// The decode row fed back after each frame, `[frames, hidden]`.
    pub step_embeds: Array2<f32>,
    /// Every first code the talker sampled, the last one (EOS or the one at the
    /// length limit, which gets no frame) included.
    pub sampled: Vec<u32>,
    /// `Stop` when the talker sampled the codec EOS, `Length` at `max_new_tokens`.
    pub finish: FinishReason,
}

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
        sampling.check()?;
        let cfg = &self.config;
        let hidden = cfg.text.hidden_size;
        inputs.check(hidden)?;
        let rows = inputs.embeds.nrows();
        let needed = rows + sampling.max_new_tokens - 1;
        if !kv.block_table.covers(needed) {
            return Err(RunnerError::InvalidBatch {
                request: 0,
                what: format!(
                    "talker block table of {} blocks cannot hold {needed} positions",
                    kv.block_table.len()
                ),
            }
            .into());
        }
        let runner = self.runner(backend)?;
        let b = &**backend;
        let mut cp_pages = self.code_predictor.alloc_pages(b)?;
        let mut talker_sampler = Sampler::new(sampling.seed);
        let mut cp_sampler = Sampler::new(sampling.seed.wrapping_add(1));
        let (talker_params, cp_params) = (sampling.talker_params(), sampling.predictor_params());
        let suppressed: Vec<u32> = cfg.suppressed_codes().collect();

        let start = kv.num_cached.min(rows - 1);
        let prefill = ScheduledSeq {
            request: 0,
            block_table: kv.block_table.clone(),
            num_computed_tokens: start,
            token_ids: vec![0; rows - start],
            embeds: vec![EmbedRows {
                step_offset: 0,
                embeddings: Arc::new(inputs.embeds.clone()),
                rows: start..rows,
                deepstack: None,
            }],
            positions: Positions::given(inputs.positions[start..].to_vec(), inputs.rope_delta),
            seq_len: rows,
            emits_output: true,
            output_from: rows - 1,
        };
        let mut out = step(&runner, prefill, kv.pages)?;

        let groups = cfg.num_code_groups;
        let mut sampled: Vec<u32> = Vec::new();
        let mut frames: Vec<u32> = Vec::new();
        let mut past_hidden: Vec<f32> = Vec::new();
        let mut step_embeds: Vec<f32> = Vec::new();
        let finish = loop {
            let mut logits = out.last_logits;
            apply_repetition_penalty(&mut logits, &sampled, sampling.repetition_penalty);
            for &id in &suppressed {
                if let Some(x) = logits.get_mut(id as usize) {
                    *x = f32::NEG_INFINITY;
                }
            }
            let code0 = talker_sampler.sample(&logits, &talker_params, &[]);
            sampled.push(code0);
            if code0 == cfg.codec_eos_token_id {
                break FinishReason::Stop;
            }
            if sampled.len() == sampling.max_new_tokens {
                break FinishReason::Length;
            }
            // The frame of code0: the predictor starts from the row that sampled it.
            let hidden_row = final_row(&out.hidden, hidden)?;
            let past = b.upload(hidden_row.view())?;
            let code0_embed = self.model.embed(b, &[code0])?;
            let pred = self.code_predictor.predict(
                b,
                &past,
                &code0_embed,
                &mut cp_pages,
                &cp_params,
                &mut cp_sampler,
            )?;
            let mut frame = Vec::with_capacity(groups);
            frame.push(code0);
            frame.extend_from_slice(&pred.codes);
            on_frame(&frame)?;
            frames.extend_from_slice(&frame);
            past_hidden.extend(hidden_row.iter());

            // The next decode row: the frame's embeddings plus this step's text row.
            let s = sampled.len() - 1;
            let mut row = b.download(&pred.embed_sum)?;
            match inputs.trailing_text_hidden.nrows() > s {
                true => row += &inputs.trailing_text_hidden.slice(s![s..s + 1, ..]),
                false => row += &inputs.tts_pad_embed,
            }
            step_embeds.extend(row.iter());
            let at = rows + s;
            let pos = at as i64 + inputs.rope_delta;
            let decode = ScheduledSeq {
                request: 0,
                block_table: kv.block_table.clone(),
                num_computed_tokens: at,
                token_ids: vec![0],
                embeds: vec![EmbedRows {
                    step_offset: 0,
                    embeddings: Arc::new(row),
                    rows: 0..1,
                    deepstack: None,
                }],
                positions: Positions::given(vec![[pos; 3]], inputs.rope_delta),
                seq_len: at + 1,
                emits_output: true,
                output_from: at,
            };
            out = step(&runner, decode, kv.pages)?;
        };
        let n = sampled.len() - 1;
        let by_frame = Array2::from_shape_vec((n, groups), frames)
            .map_err(|e| crate::error::Component::Runner.violation(format!("talker frames: {e}")))?;
        let shaped = |v: Vec<f32>| {
            Array2::from_shape_vec((n, hidden), v)
                .map_err(|e| crate::error::Component::Runner.violation(format!("talker rows: {e}")))
        };
        Ok(TalkerOutput {
            codes: by_frame.reversed_axes().as_standard_layout().into_owned(),
            past_hidden: shaped(past_hidden)?,
            step_embeds: shaped(step_embeds)?,
            sampled,
            finish,
        })
    }
}

/// Runs one talker step (one sequence) and returns its output.
fn step<B: Backend>(runner: &ModelRunner<B>, seq: ScheduledSeq, pages: &mut B::Pages) -> Result<SeqOutput> {
    let batch = ScheduledBatch { copies: vec![], seqs: vec![seq] };
    runner
        .execute(&batch, pages)?
        .pop()
        .ok_or_else(|| crate::error::Component::Runner.violation("a talker step returned no output").into())
}

/// The last final-normed row of a step's captured hidden rows, `[1, hidden]`.
fn final_row(hidden: &[(CaptureName, Array2<f32>)], width: usize) -> Result<Array2<f32>> {
    let rows = hidden.iter().find(|(name, _)| *name == CaptureName::Final).map(|(_, m)| m);
    match rows {
        Some(m) if m.nrows() > 0 && m.ncols() == width => Ok(m.slice(s![m.nrows() - 1.., ..]).to_owned()),
        _ => Err(BackendError::OpShape {
            op: "talker",
            what: "final hidden rows",
            expected: format!("[>=1, {width}]"),
            found: rows.map_or(vec![], |m| m.shape().to_vec()),
        }
        .into()),
    }
}
