//! The talker one step at a time, many replies per forward, with the thinker's
//! text arriving while the talker speaks.
//!
//! [`Talker::generate`](crate::model::talker::Talker::generate) runs a whole reply in
//! one call. An engine instead runs the talker inside its own step loop,
//! interleaved with the thinker: after each thinker step, one
//! [`Talker::step`](crate::model::talker::Talker::step) for every speaking request,
//! all of them in one batched talker forward. Each request's state is a
//! [`TalkerSeq`](crate::model::talker::TalkerSeq): its
//! prompt, the `trailing_text_hidden` rows known so far, its samplers and the
//! codes it has produced.
//!
//! Why readiness exists: HF's decode step `s` (the forward that samples the
//! talker's code `s + 1`) adds `trailing_text_hidden[s]`, the projected embedding
//! of reply token `s + 1`, to the fed-back codec embeddings. The talker may start
//! as soon as its prompt is known, but decode step `s` has to wait until that
//! row exists (or the thinker finished, after which missing rows are
//! `tts_pad_embed`). A seq whose row is missing is simply left out of the step
//! ([`TalkerSeq::is_ready`](crate::model::talker::TalkerSeq::is_ready)); since every row's result is independent of the
//! batch it runs in (on the CPU bit for bit), the codes do not depend on how the
//! thinker's and the talker's steps interleave.

use std::num::NonZeroUsize;
use std::sync::Arc;

use ndarray::{Array2, ArrayView2, s};

use super::inputs::{TalkerInputs, TalkerOutput};
use super::{Prediction, Talker};
use crate::backend::Backend;
use crate::batch::{EmbedRows, RequestId, ScheduledBatch, ScheduledSeq};
use crate::error::{BackendError, Component, RunnerError};
use crate::kv::{BlockId, BlockTable};
use crate::model::CaptureName;
use crate::model::talker::TalkerConfig;
use crate::prompt::Positions;
use crate::runner::{ModelRunner, SeqOutput};
use crate::sample::{FinishReason, Sampler, SamplingParams, TalkerSampling, apply_repetition_penalty};
use crate::{Error, Result};

/// Where a [`TalkerSeq`]'s KV lives in talker pages the caller owns: the block
/// table (in position order) and how many of the prompt's first rows it already
/// holds (KV and final-normed hidden rows of the same rows: a reused prefix).
///
/// The table may grow between steps ([`TalkerSeq::extend_blocks`]); each step
/// needs it to cover [`TalkerSeq::next_positions`], the whole reply
/// [`TalkerSeq::positions_needed`] (`prompt rows + max_new_tokens - 1`).
#[derive(Debug, Clone)]
pub struct TalkerBlocks {
    pub block_table: BlockTable,
    /// Prompt rows already in the pages; at most `rows - 1` are skipped (the
    /// last prompt row always runs, for its logits).
    pub num_cached: usize,
}

/// Where a [`TalkerSeq`] stands.
#[derive(Debug, Clone)]
enum Phase {
    /// Prompt rows `next..` have yet to run.
    Prefill { next: usize },
    /// The last frame is complete; its codec embedding sum `[1, hidden]` waits
    /// for its trailing row to become the next decode row.
    Decode { embed_sum: Array2<f32> },
    /// Sampled the codec EOS or reached `max_new_tokens`.
    Done(FinishReason),
}

/// One request's talker state for [`Talker::step`]: the prompt, the
/// `trailing_text_hidden` rows known so far, the samplers, the codes so far and
/// the finish reason.
///
/// **`tts_eos` is the caller's business**, as in [`TalkerInputs`]: HF's trailing
/// rows are the reply's projected text rows *and then* the projected `tts_eos`
/// row, so when the thinker is done the caller pushes that row with
/// [`push_trailing`](Self::push_trailing) and then calls
/// [`finish_trailing`](Self::finish_trailing); every row after the pushed ones
/// is `tts_pad_embed`.
///
/// ```
/// use std::sync::Arc;
/// use ndarray::Array2;
/// use omniprefix::backend::cpu::CpuBackend;
/// use omniprefix::kv::BlockTable;
/// use omniprefix::model::talker::{Talker, TalkerBlocks, TalkerConfig, TalkerInputs, TalkerSeq};
/// use omniprefix::sample::TalkerSampling;
///
/// let backend = Arc::new(CpuBackend::new());
/// let talker = Talker::random(&*backend, TalkerConfig::tiny(), 3)?;
/// let runner = talker.runner(&backend)?;
/// let sampling = TalkerSampling { max_new_tokens: 6, ..TalkerSampling::greedy() };
/// let (prompt, text) = (Array2::from_elem((5, 32), 0.1), Array2::from_elem((3, 32), 0.2));
/// // Each reply needs 5 prompt rows + 6 - 1 positions: three blocks of 4.
/// let mut pages = talker.alloc_pages(&backend, 6, 4)?;
///
/// // The talker can start before the thinker made any trailing row...
/// let inputs = TalkerInputs::linear(prompt.clone(), Array2::zeros((0, 32)), Array2::zeros((1, 32)));
/// let blocks = |ids: Vec<u32>| TalkerBlocks { block_table: BlockTable::new(ids, 4), num_cached: 0 };
/// let mut a = TalkerSeq::new(talker.config(), 1, inputs.clone(), &sampling, blocks(vec![0, 1, 2]))?;
/// let mut b = TalkerSeq::new(talker.config(), 2, inputs, &sampling, blocks(vec![3, 4, 5]))?;
/// let frames = talker.step(&backend, &runner, &mut pages, &mut [&mut a, &mut b])?;
/// assert!(frames.iter().all(|f| f.as_ref().is_none_or(|f| f.len() == 16)));
/// // ...but its first decode step needs trailing row 0 (unless it already stopped).
/// assert!(!a.is_ready());
/// a.push_trailing(text.slice(ndarray::s![0..1, ..]))?;
/// assert!(a.is_ready() || a.is_finished());
/// // When the thinker is done: its last rows, HF's tts_eos row (here zeros), then finish.
/// for seq in [&mut a, &mut b] {
///     seq.push_trailing(text.view())?;
///     seq.push_trailing(Array2::zeros((1, 32)).view())?;
///     seq.finish_trailing();
/// }
/// while !(a.is_finished() && b.is_finished()) {
///     talker.step(&backend, &runner, &mut pages, &mut [&mut a, &mut b])?;
/// }
/// let out = a.into_output().expect("finished");
/// assert_eq!(out.sampled.len(), out.codes.ncols() + 1);
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct TalkerSeq {
    request: RequestId,
    hidden: usize,
    groups: usize,
    embeds: Arc<Array2<f32>>,
    positions: Positions,
    rope_delta: i64,
    /// Row-major `[trailing_rows, hidden]`.
    trailing: Vec<f32>,
    trailing_rows: usize,
    trailing_done: bool,
    tts_pad: Array2<f32>,
    max_new_tokens: usize,
    repetition_penalty: f32,
    talker_params: SamplingParams,
    cp_params: SamplingParams,
    talker_sampler: Sampler,
    cp_sampler: Sampler,
    block_table: BlockTable,
    prefill_chunk: Option<NonZeroUsize>,
    phase: Phase,
    sampled: Vec<u32>,
    /// Row-major `[frames, groups]`.
    frames: Vec<u32>,
    past_hidden: Vec<f32>,
    step_embeds: Vec<f32>,
}

impl TalkerSeq {
    /// A seq for the talker of `config`: `inputs` holds its prompt and the
    /// trailing rows known so far (`[0, hidden]` for none), `blocks` its KV.
    /// Its samplers are seeded as [`Talker::generate`]'s (`seed`, `seed + 1`).
    ///
    /// Errors: `sampling` out of range ([`RequestError::InvalidSampling`](crate::error::RequestError::InvalidSampling));
    /// inputs of the wrong width or with positions that do not match the
    /// prompt ([`RunnerError::InvalidBatch`] naming `request`).
    pub fn new(
        config: &TalkerConfig, request: RequestId, inputs: TalkerInputs, sampling: &TalkerSampling,
        blocks: TalkerBlocks,
    ) -> Result<Self> {
        sampling.check()?;
        let hidden = config.text.hidden_size;
        inputs.check(request, hidden)?;
        let rows = inputs.embeds.nrows();
        let trailing_rows = inputs.trailing_text_hidden.nrows();
        Ok(TalkerSeq {
            request,
            hidden,
            groups: config.num_code_groups,
            positions: Positions::given(inputs.positions, inputs.rope_delta),
            rope_delta: inputs.rope_delta,
            trailing: inputs.trailing_text_hidden.iter().copied().collect(),
            trailing_rows,
            trailing_done: false,
            tts_pad: inputs.tts_pad_embed,
            max_new_tokens: sampling.max_new_tokens,
            repetition_penalty: sampling.repetition_penalty,
            talker_params: sampling.talker_params(),
            cp_params: sampling.predictor_params(),
            talker_sampler: Sampler::new(sampling.seed),
            cp_sampler: Sampler::new(sampling.seed.wrapping_add(1)),
            block_table: blocks.block_table,
            prefill_chunk: None,
            phase: Phase::Prefill { next: blocks.num_cached.min(rows - 1) },
            sampled: Vec::new(),
            frames: Vec::new(),
            past_hidden: Vec::new(),
            step_embeds: Vec::new(),
            embeds: Arc::new(inputs.embeds),
        })
    }

    /// The same seq running its prompt at most `rows` rows per step (a prompt
    /// chunk; only the step that runs the last prompt row produces a frame). The
    /// codes are the same whatever the chunking.
    pub fn with_prefill_chunk(mut self, rows: NonZeroUsize) -> Self {
        self.prefill_chunk = Some(rows);
        self
    }

    /// The caller's id of this request (what [`RunnerError::InvalidBatch`] names).
    pub fn request(&self) -> RequestId {
        self.request
    }

    /// Appends `trailing_text_hidden` rows `[n, hidden]` as the thinker makes
    /// them (the projected embedding of reply token `s + 1` is row `s`), then
    /// the `tts_eos` row when the thinker is done.
    ///
    /// Errors ([`RunnerError::InvalidBatch`]): rows of another width, or rows after
    /// [`finish_trailing`](Self::finish_trailing) (the seq may already have used
    /// `tts_pad_embed` in their place).
    pub fn push_trailing(&mut self, rows: ArrayView2<'_, f32>) -> Result<()> {
        if self.trailing_done {
            return Err(self.invalid("trailing rows pushed after finish_trailing".into()));
        }
        if rows.ncols() != self.hidden {
            return Err(self.invalid(format!(
                "trailing rows are {:?}, the talker is {} wide",
                rows.shape(),
                self.hidden
            )));
        }
        self.trailing.extend(rows.iter());
        self.trailing_rows += rows.nrows();
        Ok(())
    }

    /// Marks the thinker done: decode steps past the pushed trailing rows add
    /// `tts_pad_embed` (push HF's `tts_eos` row first).
    pub fn finish_trailing(&mut self) {
        self.trailing_done = true;
    }

    /// Trailing rows pushed so far.
    pub fn trailing_rows(&self) -> usize {
        self.trailing_rows
    }

    /// Whether [`finish_trailing`](Self::finish_trailing) was called.
    pub fn trailing_finished(&self) -> bool {
        self.trailing_done
    }

    /// Whether the next [`Talker::step`] runs this seq: its prompt (or a chunk of
    /// it) is pending, or decode step `s` (`s` = frames so far − 1) is pending
    /// and trailing row `s` was pushed or the trailing rows are finished.
    pub fn is_ready(&self) -> bool {
        match &self.phase {
            Phase::Prefill { .. } => true,
            Phase::Decode { .. } => self.trailing_done || self.trailing_rows > self.decode_step(),
            Phase::Done(_) => false,
        }
    }

    /// Whether the seq sampled the codec EOS or reached `max_new_tokens`.
    pub fn is_finished(&self) -> bool {
        matches!(self.phase, Phase::Done(_))
    }

    /// `Stop` (codec EOS) or `Length` (`max_new_tokens`) once finished.
    pub fn finish(&self) -> Option<FinishReason> {
        match self.phase {
            Phase::Done(reason) => Some(reason),
            _ => None,
        }
    }

    /// Rows the next step runs for this seq (0 when it is not ready).
    pub fn next_rows(&self) -> usize {
        match &self.phase {
            Phase::Prefill { next } => self.prefill_end(*next) - next,
            Phase::Decode { .. } if self.is_ready() => 1,
            _ => 0,
        }
    }

    /// Positions the block table must cover for the next step.
    pub fn next_positions(&self) -> usize {
        match &self.phase {
            Phase::Prefill { next } => self.prefill_end(*next),
            Phase::Decode { .. } => self.embeds.nrows() + self.decode_step() + 1,
            Phase::Done(_) => 0,
        }
    }

    /// Positions the whole reply may need: prompt rows + `max_new_tokens` − 1
    /// (the last sampled code never runs).
    pub fn positions_needed(&self) -> usize {
        self.embeds.nrows() + self.max_new_tokens - 1
    }

    /// Talker prompt rows.
    pub fn prompt_rows(&self) -> usize {
        self.embeds.nrows()
    }

    /// The block table.
    pub fn block_table(&self) -> &BlockTable {
        &self.block_table
    }

    /// Replaces the block table with `table`, which must hold the same KV at
    /// every position written so far (a prefix cache swapping a block for its
    /// indexed twin after a commit).
    pub fn set_block_table(&mut self, table: BlockTable) {
        self.block_table = table;
    }

    /// Whether the whole prompt has run (the seq is decoding or finished): the
    /// moment its full prompt blocks can be committed to a prefix cache.
    pub fn prompt_done(&self) -> bool {
        !matches!(self.phase, Phase::Prefill { .. })
    }

    /// Appends blocks to the block table (for KV allocated as the reply grows).
    pub fn extend_blocks(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        self.block_table.extend(blocks);
    }

    /// Every first code sampled so far, the last one (EOS or the one at the
    /// length limit, which gets no frame) included once finished.
    pub fn sampled(&self) -> &[u32] {
        &self.sampled
    }

    /// Complete frames so far.
    pub fn num_frames(&self) -> usize {
        self.frames.len() / self.groups.max(1)
    }

    /// Frame `f`'s `num_code_groups` codes.
    pub fn frame(&self, f: usize) -> Option<&[u32]> {
        self.frames.get(f * self.groups..(f + 1) * self.groups)
    }

    /// The whole run as [`Talker::generate`] returns it, once finished (`None` before).
    pub fn into_output(self) -> Option<TalkerOutput> {
        let finish = self.finish()?;
        let (n, groups, hidden) = (self.num_frames(), self.groups, self.hidden);
        // Every frame has its decode row once the seq sampled past it, so the
        // lengths agree by construction.
        let codes = Array2::from_shape_vec((n, groups), self.frames).ok()?;
        Some(TalkerOutput {
            codes: codes.reversed_axes().as_standard_layout().into_owned(),
            past_hidden: Array2::from_shape_vec((n, hidden), self.past_hidden).ok()?,
            step_embeds: Array2::from_shape_vec((n, hidden), self.step_embeds).ok()?,
            sampled: self.sampled,
            finish,
        })
    }

    /// The decode step pending in `Decode`: the index of the last frame.
    fn decode_step(&self) -> usize {
        self.sampled.len().saturating_sub(1)
    }

    fn prefill_end(&self, next: usize) -> usize {
        let rows = self.embeds.nrows();
        self.prefill_chunk.map_or(rows, |c| rows.min(next.saturating_add(c.get())))
    }

    fn invalid(&self, what: String) -> Error {
        RunnerError::InvalidBatch { request: self.request, what }.into()
    }

    /// This seq's share of the next step, `None` when it is not ready.
    fn scheduled(&self) -> Option<ScheduledSeq> {
        let rows = self.embeds.nrows();
        match &self.phase {
            Phase::Prefill { next } => {
                let (start, end) = (*next, self.prefill_end(*next));
                Some(ScheduledSeq {
                    request: self.request,
                    block_table: self.block_table.clone(),
                    num_computed_tokens: start,
                    token_ids: vec![0; end - start],
                    embeds: vec![EmbedRows {
                        step_offset: 0,
                        embeddings: self.embeds.clone(),
                        rows: start..end,
                        deepstack: None,
                    }],
                    // In range by construction: `start < end <= rows`.
                    positions: self.positions.slice(start..end).ok()?,
                    seq_len: rows,
                    emits_output: end == rows,
                    output_from: rows - 1,
                })
            }
            Phase::Decode { embed_sum } if self.is_ready() => {
                // The next decode row: the frame's embeddings plus this step's text row.
                let s = self.decode_step();
                let mut row = embed_sum.clone();
                match self.trailing.get(s * self.hidden..(s + 1) * self.hidden) {
                    Some(text) => row.iter_mut().zip(text).for_each(|(r, t)| *r += t),
                    None => row += &self.tts_pad,
                }
                let at = rows + s;
                let pos = at as i64 + self.rope_delta;
                Some(ScheduledSeq {
                    request: self.request,
                    block_table: self.block_table.clone(),
                    num_computed_tokens: at,
                    token_ids: vec![0],
                    embeds: vec![EmbedRows {
                        step_offset: 0,
                        embeddings: Arc::new(row),
                        rows: 0..1,
                        deepstack: None,
                    }],
                    positions: Positions::given(vec![[pos; 3]], self.rope_delta),
                    seq_len: at + 1,
                    emits_output: true,
                    output_from: at,
                })
            }
            _ => None,
        }
    }

    /// Applies a step's outcome (computed without touching the seq, so a failed
    /// step leaves every seq as it was).
    fn commit(&mut self, ran: &ScheduledSeq, outcome: Outcome) -> Option<Vec<u32>> {
        if matches!(self.phase, Phase::Decode { .. })
            && let Some(e) = ran.embeds.first()
        {
            self.step_embeds.extend(e.embeddings.iter());
        }
        match outcome {
            Outcome::Chunk { next } => {
                self.phase = Phase::Prefill { next };
                None
            }
            Outcome::Sampled { code0, samplers, next } => {
                self.sampled.push(code0);
                (self.talker_sampler, self.cp_sampler) = *samplers;
                match next {
                    Next::Done(reason) => {
                        self.phase = Phase::Done(reason);
                        None
                    }
                    Next::Frame { frame, past_hidden, embed_sum } => {
                        self.frames.extend_from_slice(&frame);
                        self.past_hidden.extend(past_hidden.iter());
                        self.phase = Phase::Decode { embed_sum };
                        Some(frame)
                    }
                }
            }
        }
    }
}

/// What one step did for one seq.
enum Outcome {
    /// A prompt chunk that did not reach the last prompt row.
    Chunk { next: usize },
    /// The seq sampled a first code (and the samplers moved on).
    /// (Boxed: a sampler's ChaCha state is a few hundred bytes.)
    Sampled { code0: u32, samplers: Box<(Sampler, Sampler)>, next: Next },
}

/// A talker step's seq before the step's frames are predicted: its outcome, or
/// its talker sampler (moved on) while its frame waits for the predictor.
enum Draft {
    Done(Outcome),
    Frame(Sampler),
}

/// What the code predictor starts a frame from: the talker's final-normed row
/// that sampled `code0` (`[1, hidden]`) and the seq's predictor sampling.
struct FrameStart<'a> {
    hidden_row: Array2<f32>,
    code0: u32,
    params: &'a SamplingParams,
}

enum Next {
    Done(FinishReason),
    Frame { frame: Vec<u32>, past_hidden: Array2<f32>, embed_sum: Array2<f32> },
}

impl<B: Backend> Talker<B> {
    /// One talker step for every ready seq of `seqs` ([`TalkerSeq::is_ready`]), in
    /// ONE batched forward of `runner` (a [`Talker::runner`]) over `pages` (from
    /// [`Talker::alloc_pages`]; every seq with its own block table): a seq's
    /// prompt (or its next chunk) or its one decode row. Then, for every seq whose
    /// step reached its last row, HF's sampling of the first code (repetition
    /// penalty over its codes so far, the special codec ids but EOS suppressed)
    /// and the code predictor's frame.
    ///
    /// Returns, per seq of `seqs` in order, the frame (`num_code_groups` codes) it
    /// completed in this step: `None` for a seq that did not run, ran a prompt
    /// chunk, or finished (the code that finishes a reply gets no frame).
    ///
    /// A row's result does not depend on the other seqs of its batch (on the CPU
    /// bit for bit), so seqs stepped together give the codes they give alone.
    /// Seqs must not share blocks they write (the caller owns the pages).
    ///
    /// Errors ([`RunnerError::InvalidBatch`] naming the request): a seq of another
    /// talker's width or group count, a block table that does not cover
    /// [`TalkerSeq::next_positions`], blocks outside `pages`, `runner` not this
    /// talker's. On any error no seq changes; KV written by a failed step is
    /// rewritten identically by the retry.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use ndarray::Array2;
    /// use omniprefix::backend::cpu::CpuBackend;
    /// use omniprefix::kv::BlockTable;
    /// use omniprefix::model::talker::{Talker, TalkerBlocks, TalkerConfig, TalkerInputs, TalkerSeq};
    /// use omniprefix::sample::TalkerSampling;
    ///
    /// let backend = Arc::new(CpuBackend::new());
    /// let talker = Talker::random(&*backend, TalkerConfig::tiny(), 3)?;
    /// let runner = talker.runner(&backend)?;
    /// let sampling = TalkerSampling { max_new_tokens: 4, ..TalkerSampling::greedy() };
    /// let inputs = TalkerInputs::linear(
    ///     Array2::from_elem((5, 32), 0.1), Array2::from_elem((2, 32), 0.2), Array2::zeros((1, 32)));
    /// let blocks = TalkerBlocks { block_table: BlockTable::new(vec![1, 0], 8), num_cached: 0 };
    /// let mut seq = TalkerSeq::new(talker.config(), 7, inputs.clone(), &sampling, blocks)?;
    /// seq.finish_trailing(); // every trailing row (tts_eos included) is in `inputs`
    /// let mut pages = talker.alloc_pages(&backend, 2, 8)?;
    /// let mut frames = Vec::new();
    /// while !seq.is_finished() {
    ///     let out = talker.step(&backend, &runner, &mut pages, &mut [&mut seq])?;
    ///     frames.extend(out.into_iter().flatten());
    /// }
    /// let whole = talker.generate(&backend, &inputs, &sampling, |_: &[u32]| Ok(()))?;
    /// assert_eq!(frames.len(), whole.codes.ncols());
    /// assert_eq!(seq.into_output().unwrap().codes, whole.codes);
    /// # Ok::<(), omniprefix::Error>(())
    /// ```
    pub fn step(
        &self, backend: &Arc<B>, runner: &ModelRunner<B>, pages: &mut B::Pages, seqs: &mut [&mut TalkerSeq],
    ) -> Result<Vec<Option<Vec<u32>>>> {
        let cfg = &self.config;
        let (hidden, groups) = (cfg.text.hidden_size, cfg.num_code_groups);
        let mut frames = vec![None; seqs.len()];
        let mut ran: Vec<usize> = Vec::new();
        let mut batch = ScheduledBatch::default();
        for (i, seq) in seqs.iter().enumerate() {
            if seq.hidden != hidden || seq.groups != groups {
                return Err(seq.invalid(format!(
                    "a talker seq of width {} and {} code groups for a talker of {hidden} and {groups}",
                    seq.hidden, seq.groups
                )));
            }
            if !std::ptr::eq(runner.thinker(), &*self.model) {
                return Err(seq.invalid("the runner does not run this talker".into()));
            }
            let Some(scheduled) = seq.scheduled() else { continue };
            if !seq.block_table.covers(seq.next_positions()) {
                return Err(seq.invalid(format!(
                    "talker block table of {} blocks cannot hold {} positions",
                    seq.block_table.len(),
                    seq.next_positions()
                )));
            }
            ran.push(i);
            batch.seqs.push(scheduled);
        }
        if ran.is_empty() {
            return Ok(frames);
        }
        let outputs = runner.execute(&batch, pages)?;
        let outcomes = self.sample(backend, &batch, outputs, ran.iter().map(|&i| &*seqs[i]))?;
        for ((&i, scheduled), outcome) in ran.iter().zip(&batch.seqs).zip(outcomes) {
            frames[i] = seqs[i].commit(scheduled, outcome);
        }
        Ok(frames)
    }

    /// What each seq that ran samples from its output (the seqs themselves untouched).
    fn sample<'a>(
        &self, backend: &Arc<B>, batch: &ScheduledBatch, outputs: Vec<SeqOutput>,
        seqs: impl Iterator<Item = &'a TalkerSeq>,
    ) -> Result<Vec<Outcome>> {
        let cfg = &self.config;
        let b = &**backend;
        let suppressed: Vec<u32> = cfg.suppressed_codes().collect();
        let mut outputs = outputs.into_iter();
        // Each seq's outcome, or what its frame waits for: the step's frames are predicted together.
        let mut drafts = Vec::with_capacity(batch.seqs.len());
        let mut frames: Vec<FrameStart<'_>> = Vec::new();
        let mut cp_samplers = Vec::new();
        for (scheduled, seq) in batch.seqs.iter().zip(seqs) {
            if !scheduled.emits_output {
                let next = scheduled.num_computed_tokens + scheduled.token_ids.len();
                drafts.push(Draft::Done(Outcome::Chunk { next }));
                continue;
            }
            let out = outputs
                .next()
                .ok_or_else(|| Component::Runner.violation("a talker step returned too few outputs"))?;
            let mut logits = out.last_logits;
            apply_repetition_penalty(&mut logits, &seq.sampled, seq.repetition_penalty);
            for &id in &suppressed {
                if let Some(x) = logits.get_mut(id as usize) {
                    *x = f32::NEG_INFINITY;
                }
            }
            let mut talker_sampler = seq.talker_sampler.clone();
            let code0 = talker_sampler.sample(&logits, &seq.talker_params, &[]);
            let done = if code0 == cfg.codec_eos_token_id {
                Some(FinishReason::Stop)
            } else if seq.sampled.len() + 1 == seq.max_new_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            match done {
                Some(reason) => {
                    let samplers = Box::new((talker_sampler, seq.cp_sampler.clone()));
                    drafts.push(Draft::Done(Outcome::Sampled { code0, samplers, next: Next::Done(reason) }));
                }
                None => {
                    // The frame of code0: the predictor starts from the row that sampled it.
                    let hidden_row = final_row(&out.hidden, cfg.text.hidden_size)?;
                    frames.push(FrameStart { hidden_row, code0, params: &seq.cp_params });
                    cp_samplers.push(seq.cp_sampler.clone());
                    drafts.push(Draft::Frame(talker_sampler));
                }
            }
        }
        let mut predicted = self.predict_frames(b, &frames, &mut cp_samplers)?.into_iter();
        let mut frames = frames.into_iter().zip(cp_samplers);
        let mut outcomes = Vec::with_capacity(drafts.len());
        for draft in drafts {
            let talker_sampler = match draft {
                Draft::Done(outcome) => {
                    outcomes.push(outcome);
                    continue;
                }
                Draft::Frame(sampler) => sampler,
            };
            let (Some((FrameStart { hidden_row, code0, .. }, cp_sampler)), Some(pred)) =
                (frames.next(), predicted.next())
            else {
                return Err(Component::Runner.violation("the code predictor returned too few frames").into());
            };
            let mut frame = Vec::with_capacity(cfg.num_code_groups);
            frame.push(code0);
            frame.extend_from_slice(&pred.codes);
            let next = Next::Frame { frame, past_hidden: hidden_row, embed_sum: pred.embed_sum };
            outcomes.push(Outcome::Sampled { code0, samplers: Box::new((talker_sampler, cp_sampler)), next });
        }
        Ok(outcomes)
    }

    /// The frames of one step in one predictor forward per group, frame `i`
    /// sampling with `samplers[i]` (moved on in place): each frame's prediction.
    fn predict_frames(
        &self, b: &B, frames: &[FrameStart<'_>], samplers: &mut [Sampler],
    ) -> Result<Vec<Prediction>> {
        if frames.is_empty() {
            return Ok(Vec::new());
        }
        let hidden = self.config.text.hidden_size;
        let past = Array2::from_shape_fn((frames.len(), hidden), |(f, c)| frames[f].hidden_row[[0, c]]);
        let code0s: Vec<u32> = frames.iter().map(|f| f.code0).collect();
        let code0_embed = b.download(&self.model.embed(b, &code0s)?)?;
        let params: Vec<&SamplingParams> = frames.iter().map(|f| f.params).collect();
        let mut pages = self.take_predictor_pages(b, frames.len())?;
        let predicted =
            self.code_predictor.predict(b, past.view(), code0_embed.view(), &mut pages, &params, samplers);
        self.put_predictor_pages(pages);
        predicted
    }
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
