//! Executes a [`ScheduledBatch`] on a backend: block copies, embeddings with item
//! rows merged in, every layer writing K/V and captured hidden states into pages
//! (and adding the step's DeepStack rows after the layers that take them),
//! paged attention over prefix-from-pages plus new tokens, and — for sequences
//! whose step ends their known tokens — the hidden states of every position
//! from `output_from` (for a prompt's first output the **full** `[prompt_len,
//! hidden]`, cached rows gathered from the hidden pages; for a decode step its
//! one new row) and the last position's logits, which the engine samples from.
//!
//! A capture kept only at item positions ([`ItemCapture`], the talker's accept
//! layer) is written beside the pages rather than into them: a step clears its
//! slots there, stores its item positions' rows, and an emitting sequence gets
//! the rows its output positions hold ([`SeqOutput::items`]).
//!
//! The runner never touches an index or a pool: everything it needs is in the batch.
//!
//! Batches from the scheduler are well-formed by construction (admission
//! checked their requests against this model), so the engine runs them with
//! debug assertions only. [`ModelRunner::execute`], the entry for batches
//! built by hand (parity tests, benches, callers driving the runner without
//! the scheduler), checks them first: a hand-built batch is untrusted input,
//! and a bad one must be an error that leaves the pages untouched, not a panic.

use std::ops::Range;
use std::sync::Arc;

use ndarray::{Array2, s};

use crate::backend::{AttnSeq, Backend, Dtype, PagesSpec, RopePositions};
use crate::batch::{
    self, BlockCopy, EmbedRows, LevelMismatch, ModelShape, RequestId, ScheduledBatch, ScheduledSeq,
};
use crate::error::{BackendError, Component, RunnerError};
use crate::kv::{BlockId, BlockTable, ItemCapture};
use crate::model::{CaptureName, CaptureSpec, StepMeta, Thinker};
use crate::prompt::{Positions, out_of_vocab};
use crate::{Error, Result};

/// What a sequence whose step ended at its `seq_len` returns.
#[derive(Debug, Clone)]
pub struct SeqOutput {
    pub request: RequestId,
    /// Each captured point's hidden states of positions `output_from..seq_len`, in capture order.
    pub hidden: Vec<(CaptureName, Array2<f32>)>,
    /// Logits `[vocab]` of the sequence's last position.
    pub last_logits: Vec<f32>,
    /// The item-position capture's rows among positions `output_from..seq_len`,
    /// when the step kept one ([`ModelRunner::execute_with_items`]).
    pub items: Option<ItemCaptureRows>,
}

/// Rows of an item-position capture ([`ItemCapture`]) that one output covers.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemCaptureRows {
    /// The captured point.
    pub point: CaptureName,
    /// Sequence positions holding a row, ascending.
    pub positions: Vec<usize>,
    /// Their rows, `[positions.len(), hidden]`.
    pub rows: Array2<f32>,
}

impl ItemCaptureRows {
    /// The rows laid out by position, `[len, hidden]`, zeros where no item sits:
    /// what a reader indexing by position (the talker's prompt) takes.
    pub fn dense(&self, len: usize) -> Array2<f32> {
        let mut out = Array2::zeros((len, self.rows.ncols()));
        for (&pos, row) in self.positions.iter().zip(self.rows.rows()) {
            if pos < len {
                out.row_mut(pos).assign(&row);
            }
        }
        out
    }
}

/// Runs scheduled steps of one thinker on one backend.
///
/// ```
/// use std::sync::Arc;
/// use omniprefix::backend::cpu::CpuBackend;
/// use omniprefix::model::{CaptureSpec, Config, Thinker};
/// use omniprefix::runner::{ModelRunner, PromptInputs, run_uncached};
/// use omniprefix::prompt::Positions;
///
/// let backend = Arc::new(CpuBackend::new());
/// let cfg = Config::tiny_qwen3(32, 2, 4, 2, 50);
/// let thinker = Arc::new(Thinker::random(&*backend, cfg, 1)?);
/// let capture = CaptureSpec::default_for(2);
/// let inputs = PromptInputs { token_ids: vec![3, 1, 4, 1, 5], embeds: vec![], positions: Positions::linear(5) };
/// let out = run_uncached(&thinker, &*backend, &inputs, &capture, false)?;
/// assert_eq!(out.hidden[0].1.dim(), (5, 32));
/// let runner = ModelRunner::new(backend, thinker, capture)?;
/// let _pages = runner.alloc_pages(8, 16)?;
/// # Ok::<(), omniprefix::Error>(())
/// ```
pub struct ModelRunner<B: Backend> {
    backend: Arc<B>,
    thinker: Arc<Thinker<B>>,
    capture: CaptureSpec,
    kv_dtype: Dtype,
}

impl<B: Backend> ModelRunner<B> {
    /// A runner capturing `capture` (checked against the thinker's layer count).
    pub fn new(backend: Arc<B>, thinker: Arc<Thinker<B>>, capture: CaptureSpec) -> Result<Self> {
        let capture = CaptureSpec::new(capture.points().iter().copied(), thinker.config().num_hidden_layers)?;
        Ok(Self { backend, thinker, capture, kv_dtype: Dtype::F32 })
    }

    /// The same runner allocating K/V pages in `kv_dtype` (default f32).
    pub fn with_kv_dtype(self, kv_dtype: Dtype) -> Self {
        Self { kv_dtype, ..self }
    }

    /// Page sizes this runner needs for `num_blocks` blocks of `block_size` positions.
    pub fn pages_spec(&self, num_blocks: usize, block_size: usize) -> PagesSpec {
        PagesSpec {
            kv_dtype: self.kv_dtype,
            ..pages_spec(&self.thinker, &self.capture, num_blocks, block_size)
        }
    }

    /// Allocates zero-filled pages of [`ModelRunner::pages_spec`].
    pub fn alloc_pages(&self, num_blocks: usize, block_size: usize) -> Result<B::Pages> {
        self.backend.alloc_pages(self.pages_spec(num_blocks, block_size))
    }

    /// The captured points, in hidden-page order.
    pub fn capture(&self) -> &CaptureSpec {
        &self.capture
    }

    /// The model this runner executes.
    pub fn thinker(&self) -> &Thinker<B> {
        &self.thinker
    }

    /// The backend this runner executes on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The model and the backend, shared: for a stage that reads the thinker on
    /// another thread (the talker stage embeds reply tokens with it).
    pub fn shared(&self) -> (Arc<B>, Arc<Thinker<B>>) {
        (Arc::clone(&self.backend), Arc::clone(&self.thinker))
    }

    /// Executes one step of a batch built by hand (or by a scheduler that was
    /// not given this model). The whole batch is checked first: an invalid
    /// batch returns [`RunnerError::InvalidBatch`] (or [`BackendError::OpShape`] /
    /// [`BackendError::OpIndex`] for pages or copies that do not fit) and leaves the
    /// pages untouched.
    pub fn execute(&self, batch: &ScheduledBatch, pages: &mut B::Pages) -> Result<Vec<SeqOutput>> {
        self.execute_with_items(batch, pages, None)
    }

    /// [`execute`](Self::execute), also keeping `items`' point at the batch's
    /// item positions in `items` (beside the pages, which must be the ones
    /// `items` follows): each output then says which of its positions hold a
    /// row ([`SeqOutput::items`]). Errors as `execute`.
    pub fn execute_with_items(
        &self, batch: &ScheduledBatch, pages: &mut B::Pages, items: Option<&mut ItemCapture>,
    ) -> Result<Vec<SeqOutput>> {
        let spec = self.backend.pages_spec(pages);
        check_batch(&self.thinker, &self.capture, batch, &spec)?;
        if let Some(store) = &items {
            check_item_rows(&self.thinker, store, &spec)?;
        }
        Ok(run_step(&self.thinker, &*self.backend, &self.capture, batch, pages, items, false)?.outputs)
    }

    /// Executes a batch the scheduler built from requests admitted against
    /// this runner's model ([`RequestChecks::with_model`](crate::sched::RequestChecks::with_model))
    /// on pages this runner allocated: well-formed by construction, so only
    /// debug builds check it.
    pub(crate) fn execute_scheduled(
        &self, batch: &ScheduledBatch, pages: &mut B::Pages, items: Option<&mut ItemCapture>,
    ) -> Result<Vec<SeqOutput>> {
        debug_assert!(
            check_batch(&self.thinker, &self.capture, batch, &self.backend.pages_spec(pages)).is_ok(),
            "a scheduled batch is well-formed by construction"
        );
        Ok(run_step(&self.thinker, &*self.backend, &self.capture, batch, pages, items, false)?.outputs)
    }
}

/// An item-row store fits the model and the pages it follows: its point is one
/// of the forward's, its width the model's, its blocks the pages' (a copy or a
/// tier move of another block size would carry the wrong slots' rows).
fn check_item_rows<B: Backend>(thinker: &Thinker<B>, items: &ItemCapture, spec: &PagesSpec) -> Result<()> {
    let cfg = thinker.config();
    CaptureSpec::new([items.point()], cfg.num_hidden_layers)?;
    for (what, expected, found) in [
        ("store width", cfg.hidden_size, items.width()),
        ("store block size", spec.block_size, items.block_size()),
    ] {
        if found != expected {
            return Err(BackendError::OpShape {
                op: "item rows",
                what,
                expected: expected.to_string(),
                found: vec![found],
            }
            .into());
        }
    }
    Ok(())
}

fn pages_spec<B: Backend>(
    thinker: &Thinker<B>, capture: &CaptureSpec, num_blocks: usize, block_size: usize,
) -> PagesSpec {
    let c = thinker.config();
    PagesSpec {
        num_layers: c.num_hidden_layers,
        num_blocks,
        block_size,
        kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        captured: capture.len(),
        hidden: c.hidden_size,
        kv_dtype: Dtype::F32,
    }
}

/// One whole prompt's inputs, for [`run_uncached`].
#[derive(Debug, Clone)]
pub struct PromptInputs {
    /// One id per position (placeholder ids where `embeds` applies).
    pub token_ids: Vec<u32>,
    /// Item rows; `step_offset` is the prompt position of the first row.
    pub embeds: Vec<EmbedRows>,
    pub positions: Positions,
}

impl PromptInputs {
    /// Prompt positions `range` as one scheduled sequence over `block_table`: the
    /// step a scheduler would emit after `range.start` positions are in pages,
    /// cut by [`batch::chunk`] as the scheduler's are.
    ///
    /// Errors with [`RunnerError::InvalidBatch`] when the range leaves the prompt, the table
    /// cannot hold it, or the positions do not cover the prompt.
    pub fn step(
        &self, request: RequestId, block_table: BlockTable, range: Range<usize>,
    ) -> Result<ScheduledSeq> {
        let len = self.token_ids.len();
        let bad = |what: String| Err(Error::Runner(RunnerError::InvalidBatch { request, what }));
        if range.start > range.end || range.end > len {
            return bad(format!("step {range:?} outside the prompt of {len} positions"));
        }
        if !block_table.covers(range.end) {
            let (blocks, bs) = (block_table.len(), block_table.block_size());
            return bad(format!(
                "block table of {blocks} blocks of {bs} cannot hold {} positions",
                range.end
            ));
        }
        if self.positions.len() != len {
            return bad(format!("positions do not cover the prompt of {len} positions"));
        }
        batch::chunk(request, &self.token_ids, &self.embeds, &self.positions, block_table, range)
    }
}

/// What [`run_uncached`] returns.
#[derive(Debug, Clone)]
pub struct Outputs {
    /// Each captured point's hidden states `[len, hidden]`.
    pub hidden: Vec<(CaptureName, Array2<f32>)>,
    /// Logits of the last position.
    pub last_logits: Vec<f32>,
    /// Logits `[len, vocab]` of every position, when asked for.
    pub logits: Option<Array2<f32>>,
}

/// Block size of the throwaway pages [`run_uncached`] uses.
const UNCACHED_BLOCK: usize = 16;

/// Runs a whole prompt in one step on fresh pages with a contiguous block table:
/// the no-cache reference that cached runs must equal (and the parity tests' entry).
pub fn run_uncached<B: Backend>(
    thinker: &Thinker<B>, backend: &B, inputs: &PromptInputs, capture: &CaptureSpec, all_logits: bool,
) -> Result<Outputs> {
    let capture = CaptureSpec::new(capture.points().iter().copied(), thinker.config().num_hidden_layers)?;
    let len = inputs.token_ids.len();
    let num_blocks = len.div_ceil(UNCACHED_BLOCK);
    let table = BlockTable::new((0..num_blocks as BlockId).collect(), UNCACHED_BLOCK);
    let seq = inputs.step(0, table, 0..len)?;
    let batch = ScheduledBatch { copies: vec![], seqs: vec![seq] };
    let mut pages = backend.alloc_pages(pages_spec(thinker, &capture, num_blocks, UNCACHED_BLOCK))?;
    check_batch(thinker, &capture, &batch, &backend.pages_spec(&pages))?;
    let mut step = run_step(thinker, backend, &capture, &batch, &mut pages, None, all_logits)?;
    let out = step
        .outputs
        .pop()
        .ok_or_else(|| Component::Runner.violation("a whole-prompt step returned no output"))?;
    Ok(Outputs { hidden: out.hidden, last_logits: out.last_logits, logits: step.all_logits })
}

struct StepResult {
    outputs: Vec<SeqOutput>,
    all_logits: Option<Array2<f32>>,
}

/// Checks one hand-built sequence against itself, the model and the pages:
/// what admission guarantees for the scheduler's sequences.
fn check_seq(seq: &ScheduledSeq, spec: &PagesSpec, model: &ModelShape) -> Result<()> {
    let bad = |what: String| Err(RunnerError::InvalidBatch { request: seq.request, what }.into());
    let n = seq.token_ids.len();
    let end = seq.num_computed_tokens.saturating_add(n);
    if end > seq.seq_len {
        return bad(format!(
            "{} computed + {n} new tokens exceed seq_len {}",
            seq.num_computed_tokens, seq.seq_len
        ));
    }
    if seq.emits_output && (end != seq.seq_len || n == 0 || seq.output_from > end) {
        let (len, from) = (seq.seq_len, seq.output_from);
        return bad(format!(
            "emits output from {from} but the step ends at {end} of {len} with {n} new tokens"
        ));
    }
    let table = &seq.block_table;
    if table.block_size() != spec.block_size {
        return bad(format!(
            "block table of {}-position blocks for pages of {}",
            table.block_size(),
            spec.block_size
        ));
    }
    let needed = if seq.emits_output { seq.seq_len } else { end };
    if !table.covers(needed) {
        return bad(format!("block table of {} blocks cannot hold {needed} positions", table.len()));
    }
    if let Some(b) = table.iter().find(|&&b| b as usize >= spec.num_blocks) {
        return bad(format!("block {b} out of range 0..{}", spec.num_blocks));
    }
    if seq.positions.len() != n {
        return bad(format!("positions cover {} entries for {n} new tokens", seq.positions.len()));
    }
    if let Some((_, t)) = out_of_vocab(&seq.token_ids, model.vocab_size) {
        return bad(format!("token id {t} out of vocabulary 0..{}", model.vocab_size));
    }
    for e in &seq.embeds {
        let rows = e.rows.len();
        if e.rows.end > e.embeddings.nrows() || e.step_offset.saturating_add(rows) > n {
            let (total, at) = (e.embeddings.nrows(), e.step_offset);
            return bad(format!(
                "item rows {:?} (of {total}) at step offset {at} do not fit {n} new tokens",
                e.rows
            ));
        }
        if e.embeddings.ncols() != model.hidden_size {
            return bad(format!(
                "item embeddings have {} columns, the model {}",
                e.embeddings.ncols(),
                model.hidden_size
            ));
        }
        let levels = e.deepstack.as_deref().map_or(&[][..], Vec::as_slice);
        if let Some((what, expected)) = model.layer_violation(levels.len()) {
            return bad(format!("{} DeepStack levels; {what}: {expected}", levels.len()));
        }
        let (rows, cols) = e.embeddings.dim();
        if let Some(LevelMismatch { level, what, expected, found }) =
            LevelMismatch::first(levels, rows, Some(cols))
        {
            return bad(format!(
                "DeepStack level {level} has {found} {what}, the item embeddings {expected}"
            ));
        }
    }
    Ok(())
}

/// Checks the pages fit the model and every copy and sequence is valid.
fn check_batch<B: Backend>(
    thinker: &Thinker<B>, capture: &CaptureSpec, batch: &ScheduledBatch, spec: &PagesSpec,
) -> Result<()> {
    // Pages in any K/V element type serve the same model.
    let want = PagesSpec {
        kv_dtype: spec.kv_dtype,
        ..pages_spec(thinker, capture, spec.num_blocks, spec.block_size)
    };
    if *spec != want || spec.block_size == 0 {
        return Err(BackendError::OpShape {
            op: "execute",
            what: "pages",
            expected: format!("{want:?} with block_size > 0"),
            found: vec![
                spec.num_layers,
                spec.num_blocks,
                spec.block_size,
                spec.kv_heads,
                spec.head_dim,
                spec.captured,
                spec.hidden,
            ],
        }
        .into());
    }
    for BlockCopy { src, dst } in &batch.copies {
        if let Some(b) = [src, dst].into_iter().find(|&&b| b as usize >= spec.num_blocks) {
            return Err(BackendError::OpIndex {
                op: "execute",
                what: "copy block",
                index: *b as i64,
                bound: spec.num_blocks,
            }
            .into());
        }
    }
    let model = ModelShape::of(thinker.config());
    batch.seqs.iter().try_for_each(|seq| check_seq(seq, spec, &model))
}

/// Embeds all new tokens of the step and scatters item rows over their placeholders.
fn embed_step<B: Backend>(
    thinker: &Thinker<B>, backend: &B, batch: &ScheduledBatch, starts: &[usize],
) -> Result<B::Tensor> {
    let ids: Vec<u32> = batch.seqs.iter().flat_map(|s| s.token_ids.iter().copied()).collect();
    let mut x = thinker.embed(backend, &ids)?;
    for (seq, &start) in batch.seqs.iter().zip(starts) {
        for e in seq.embeds.iter().filter(|e| !e.rows.is_empty()) {
            let src = backend.upload(e.embeddings.slice(s![e.rows.clone(), ..]))?;
            let first = start + e.step_offset;
            let rows: Vec<u32> = (first..first + e.rows.len()).map(|r| r as u32).collect();
            backend.scatter_rows(&mut x, &rows, &src)?;
        }
    }
    Ok(x)
}

/// Adds DeepStack level `level` of every item row of the step to `x` (after
/// decoder layer `level`): one gather, add and scatter over all sequences.
fn add_deepstack<B: Backend>(
    backend: &B, x: &mut B::Tensor, batch: &ScheduledBatch, starts: &[usize], level: usize,
) -> Result<()> {
    let mut rows = Vec::new();
    let mut parts = Vec::new();
    for (seq, &start) in batch.seqs.iter().zip(starts) {
        for e in &seq.embeds {
            let Some(add) = e.deepstack.as_deref().and_then(|levels| levels.get(level)) else { continue };
            let first = start + e.step_offset;
            rows.extend((first..first + e.rows.len()).map(|r| r as u32));
            parts.push(add.slice(s![e.rows.clone(), ..]));
        }
    }
    if rows.is_empty() {
        return Ok(());
    }
    // Every level has its item's embedding width (checked before the step runs).
    let host = ndarray::concatenate(ndarray::Axis(0), &parts).map_err(|err| {
        Component::Runner.violation(format!("DeepStack rows of one level differ in width: {err}"))
    })?;
    let mut selected = backend.gather_rows(x, &rows)?;
    backend.add(&mut selected, &backend.upload(host.view())?)?;
    backend.scatter_rows(x, &rows, &selected)
}

/// The core of [`ModelRunner::execute`] and [`run_uncached`].
fn run_step<B: Backend>(
    thinker: &Thinker<B>, backend: &B, capture: &CaptureSpec, batch: &ScheduledBatch, pages: &mut B::Pages,
    mut items: Option<&mut ItemCapture>, all_logits: bool,
) -> Result<StepResult> {
    let copies: Vec<_> = batch.copies.iter().map(|c| (c.src, c.dst)).collect();
    backend.copy_blocks(pages, &copies)?;
    if let Some(store) = items.as_deref_mut() {
        store.copy_blocks(&copies);
    }

    let mut starts = Vec::with_capacity(batch.seqs.len());
    let mut total = 0;
    for seq in &batch.seqs {
        starts.push(total);
        total += seq.token_ids.len();
    }
    // The dense [3, n] positions and the slots of this step only.
    let mut axes: [Vec<i64>; 3] = Default::default();
    let mut slots: Vec<i64> = Vec::with_capacity(total);
    for seq in &batch.seqs {
        seq.positions.extend_axes(&mut axes);
        slots.extend(seq.slots());
    }
    let seqs: Vec<AttnSeq<'_>> = batch
        .seqs
        .iter()
        .zip(&starts)
        .map(|(s, &query_start)| AttnSeq {
            query_start,
            num_new: s.token_ids.len(),
            num_computed: s.num_computed_tokens,
            block_table: s.block_table.blocks(),
        })
        .collect();
    let meta = StepMeta {
        positions: RopePositions { t: &axes[0], h: &axes[1], w: &axes[2] },
        slots: &slots,
        seqs: &seqs,
    };

    // The step rows of item positions and their slots, for the item-position capture.
    let item_point = items.as_ref().map(|store| store.point());
    let (item_step_rows, item_slots): (Vec<u32>, Vec<i64>) = match item_point {
        Some(_) => item_step_rows(batch, &starts).map(|row| (row as u32, slots[row])).unzip(),
        None => Default::default(),
    };
    let keep_items = |point: CaptureName| item_point == Some(point) && !item_step_rows.is_empty();
    let mut item_tensor = None;

    let mut x = embed_step(thinker, backend, batch, &starts)?;
    let num_layers = thinker.config().num_hidden_layers;
    let levels = batch
        .seqs
        .iter()
        .flat_map(|s| &s.embeds)
        .filter_map(|e| e.deepstack.as_ref().map(|d| d.len()))
        .max()
        .unwrap_or(0);
    for layer in 0..=num_layers {
        if let Some(c) = capture.index_of(CaptureName::Hidden(layer)) {
            backend.write_hidden(pages, c, &x, &slots)?;
        }
        if keep_items(CaptureName::Hidden(layer)) {
            item_tensor = Some(backend.gather_rows(&x, &item_step_rows)?);
        }
        // HF records a layer's output before its DeepStack add (a forward hook),
        // so `hidden.<layer + 1>` is captured above before the add here.
        if layer > 0 && layer <= levels {
            add_deepstack(backend, &mut x, batch, &starts, layer - 1)?;
        }
        if layer < num_layers {
            thinker.forward_layer(backend, layer, &mut x, &meta, pages)?;
        }
    }

    let final_slot = capture.index_of(CaptureName::Final);
    let normed = match final_slot.is_some() || all_logits || keep_items(CaptureName::Final) {
        true => Some(thinker.final_norm(backend, &x)?),
        false => None,
    };
    if let (Some(c), Some(normed)) = (final_slot, &normed) {
        backend.write_hidden(pages, c, normed, &slots)?;
    }
    if let (true, Some(normed)) = (keep_items(CaptureName::Final), &normed) {
        item_tensor = Some(backend.gather_rows(normed, &item_step_rows)?);
    }
    let emitting: Vec<usize> = (0..batch.seqs.len()).filter(|&i| batch.seqs[i].emits_output).collect();
    let last_rows: Vec<u32> =
        emitting.iter().map(|&i| (starts[i] + batch.seqs[i].token_ids.len() - 1) as u32).collect();
    // Everything the step returns is read back with one take_to_host: one wait per step.
    let last_logits = match (&normed, last_rows.is_empty()) {
        (_, true) => None,
        (Some(n), false) => Some(thinker.logits(backend, &backend.gather_rows(n, &last_rows)?)?),
        (None, false) => Some(
            thinker.logits(backend, &thinker.final_norm(backend, &backend.gather_rows(&x, &last_rows)?)?)?,
        ),
    };
    let mut hidden = Vec::with_capacity(emitting.len() * capture.points().len());
    for &i in &emitting {
        let seq = &batch.seqs[i];
        let out_slots = seq.block_table.slots(seq.output_from..seq.seq_len);
        for c in 0..capture.points().len() {
            hidden.push(backend.gather_hidden(pages, c, &out_slots)?);
        }
    }
    let every_logit = match (all_logits, &normed) {
        (true, Some(n)) => Some(thinker.logits(backend, n)?),
        _ => None,
    };
    let (has_last_logits, has_every_logit) = (last_logits.is_some(), every_logit.is_some());
    let has_item_rows = item_tensor.is_some();
    let reads: Vec<B::Tensor> =
        last_logits.into_iter().chain(hidden).chain(every_logit).chain(item_tensor).collect();
    let asked = reads.len();
    let host = backend.take_to_host(reads)?;
    if host.len() != asked {
        return Err(BackendError::OpCount {
            op: "take_to_host",
            what: "matrices",
            expected: asked,
            found: host.len(),
        }
        .into());
    }
    let mut host = host.into_iter();
    let vocab = thinker.config().vocab_size;
    let last_logits = match has_last_logits {
        true => host.next().unwrap_or_default(),
        false => Array2::zeros((0, vocab)),
    };
    if last_logits.dim() != (emitting.len(), vocab) {
        let found = last_logits.shape().to_vec();
        return Err(BackendError::OpShape {
            op: "take_to_host",
            what: "last logits",
            expected: format!("[{}, {vocab}]", emitting.len()),
            found,
        }
        .into());
    }
    let mut outputs: Vec<SeqOutput> = emitting
        .iter()
        .enumerate()
        .map(|(k, &i)| SeqOutput {
            request: batch.seqs[i].request,
            hidden: capture.points().iter().map(|&name| (name, host.next().unwrap_or_default())).collect(),
            last_logits: last_logits.row(k).to_vec(),
            items: None,
        })
        .collect();
    let all_logits = has_every_logit.then(|| host.next()).flatten();
    if let Some(store) = items {
        let rows = match has_item_rows {
            true => host.next().unwrap_or_default(),
            false => Array2::zeros((0, store.width())),
        };
        store.write(&slots, &item_slots, rows.view())?;
        for (out, &i) in outputs.iter_mut().zip(&emitting) {
            let seq = &batch.seqs[i];
            let (found, rows) = store.gather(&seq.block_table.slots(seq.output_from..seq.seq_len));
            let positions = found.into_iter().map(|k| seq.output_from + k).collect();
            out.items = Some(ItemCaptureRows { point: store.point(), positions, rows });
        }
    }
    Ok(StepResult { outputs, all_logits })
}

/// The step rows (offsets into the step's new tokens) that item embeddings fill.
fn item_step_rows<'a>(batch: &'a ScheduledBatch, starts: &'a [usize]) -> impl Iterator<Item = usize> + 'a {
    batch.seqs.iter().zip(starts).flat_map(|(seq, &start)| {
        seq.embeds.iter().flat_map(move |e| (0..e.rows.len()).map(move |k| start + e.step_offset + k))
    })
}

#[cfg(test)]
mod tests {
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::backend::cpu::{CpuBackend, CpuPages};
    use crate::model::Config;

    const BS: usize = 4;

    /// A prompt of `len` tokens with one item of `rows` rows at position 3 and
    /// M-RoPE-style positions (text diagonal, the item on a 2-wide grid).
    fn prompt(cfg: &Config, len: usize, rows: usize, seed: u64) -> PromptInputs {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let token_ids: Vec<u32> = (0..len).map(|_| rng.random_range(0..cfg.vocab_size as u32)).collect();
        let item = Array2::from_shape_fn((rows + 2, cfg.hidden_size), |_| rng.random::<f32>() * 2.0 - 1.0);
        let embeds = vec![EmbedRows {
            step_offset: 3,
            embeddings: Arc::new(item),
            rows: 1..rows + 1,
            deepstack: None,
        }];
        let grid = (0..len as i64).map(|p| {
            let r = p - 3;
            if (3..3 + rows as i64).contains(&p) { [3, 3 + r / 2, 3 + r % 2] } else { [p; 3] }
        });
        let positions = if cfg.mrope_section.is_some() {
            Positions::given(grid.collect(), 0)
        } else {
            Positions::linear(len)
        };
        PromptInputs { token_ids, embeds, positions }
    }

    /// `p` with `levels` seeded random DeepStack levels on its item.
    fn with_deepstack(mut p: PromptInputs, levels: usize, seed: u64) -> PromptInputs {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        for e in &mut p.embeds {
            let dim = e.embeddings.dim();
            e.deepstack = Some(Arc::new(
                (0..levels)
                    .map(|_| Array2::from_shape_fn(dim, |_| rng.random::<f32>() * 2.0 - 1.0))
                    .collect(),
            ));
        }
        p
    }

    /// Prompt positions `a..b` as one scheduled sequence over `table`.
    fn chunk(p: &PromptInputs, request: RequestId, table: &[u32], a: usize, b: usize) -> ScheduledSeq {
        p.step(request, BlockTable::new(table.to_vec(), BS), a..b).unwrap()
    }

    fn assert_close(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-5 * scale, "{what}: first mismatch at flat index {i}: {g} vs {w}");
        }
    }

    fn assert_same(out: &SeqOutput, want: &Outputs) {
        assert_eq!(out.hidden.len(), want.hidden.len());
        for ((name, got), (wname, w)) in out.hidden.iter().zip(&want.hidden) {
            assert_eq!(name, wname);
            assert_eq!(got.dim(), w.dim(), "{name}: shape");
            assert_close(&name.to_string(), got.as_slice().unwrap(), w.as_slice().unwrap());
        }
        assert_close("last_logits", &out.last_logits, &want.last_logits);
    }

    fn configs() -> Vec<Config> {
        vec![
            Config::tiny_qwen3(32, 2, 4, 2, 64),
            Config::tiny_qwen2_omni(32, 3, 4, 1, 64),
            Config::tiny_qwen3_omni_moe(32, 2, 4, 4, 64, 4, 2),
        ]
    }

    fn runner(cfg: Config, seed: u64) -> ModelRunner<CpuBackend> {
        let backend = Arc::new(CpuBackend::new());
        let n = cfg.num_hidden_layers;
        let thinker = Arc::new(Thinker::random(&*backend, cfg, seed).unwrap());
        let capture = CaptureSpec::new(
            [CaptureName::Hidden(0), CaptureName::Hidden(1), CaptureName::Hidden(n), CaptureName::Final],
            n,
        )
        .unwrap();
        ModelRunner::new(backend, thinker, capture).unwrap()
    }

    /// Runs prompt `p` (23 positions) as request 7 in chunks ending at `cuts`, over
    /// a shuffled block table of fresh pages; returns the last step's outputs.
    fn run_in_chunks(
        r: &ModelRunner<CpuBackend>, p: &PromptInputs, cuts: &[usize], rng: &mut ChaCha8Rng,
    ) -> Vec<SeqOutput> {
        let mut blocks: Vec<u32> = (0..12).collect();
        blocks.shuffle(rng);
        let table = &blocks[..23usize.div_ceil(BS)];
        let mut pages = r.alloc_pages(12, BS).unwrap();
        let mut outs = Vec::new();
        let mut a = 0;
        for &b in cuts {
            let batch = ScheduledBatch { copies: vec![], seqs: vec![chunk(p, 7, table, a, b)] };
            outs = r.execute(&batch, &mut pages).unwrap();
            a = b;
        }
        outs
    }

    #[test]
    fn caching_is_invisible_for_every_chunking() {
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        for (ci, cfg) in configs().into_iter().enumerate() {
            let r = runner(cfg.clone(), ci as u64);
            let p = prompt(&cfg, 23, 6, ci as u64);
            let want = run_uncached(r.thinker(), r.backend(), &p, r.capture(), false).unwrap();
            assert_eq!(want.hidden[0].1.dim(), (23, 32));
            // Cached prefix lengths (block aligned or not) and the chunk cuts after them.
            for cuts in [vec![8, 23], vec![4, 13, 23], vec![5, 6, 19, 23], vec![22, 23]] {
                let outs = run_in_chunks(&r, &p, &cuts, &mut rng);
                assert_eq!(outs.len(), 1, "config {ci} cuts {cuts:?}");
                assert_eq!(outs[0].request, 7);
                assert_same(&outs[0], &want);
            }
        }
    }

    #[test]
    fn deepstack_is_added_after_its_layer_per_chunk_and_caching_stays_invisible() {
        let mut rng = ChaCha8Rng::seed_from_u64(8);
        for (ci, cfg) in configs().into_iter().enumerate() {
            let r = runner(cfg.clone(), 60 + ci as u64);
            let plain = prompt(&cfg, 23, 6, ci as u64);
            let p = with_deepstack(plain.clone(), 2, ci as u64);
            let want = run_uncached(r.thinker(), r.backend(), &p, r.capture(), false).unwrap();
            let without = run_uncached(r.thinker(), r.backend(), &plain, r.capture(), false).unwrap();
            // hidden.0 and hidden.1 (layer 0's output, captured before its add) are
            // untouched; everything after the first add moves, on the item rows first.
            assert_eq!(want.hidden[0].1, without.hidden[0].1, "config {ci}: hidden.0");
            assert_eq!(want.hidden[1].1, without.hidden[1].1, "config {ci}: hidden.1");
            let last = &want.hidden[2].1;
            assert_ne!(last.row(4), without.hidden[2].1.row(4), "config {ci}: item row after the adds");
            assert_eq!(
                last.row(2),
                without.hidden[2].1.row(2),
                "config {ci}: rows before the item see no add"
            );
            for cuts in [vec![4, 23], vec![5, 6, 19, 23], vec![8, 9, 23]] {
                assert_same(&run_in_chunks(&r, &p, &cuts, &mut rng)[0], &want);
            }
        }
    }

    /// `out`'s item-position rows are at `items` exactly and equal its paged
    /// `hidden.1` there (the item store keeps that point).
    fn assert_items(out: &SeqOutput, items: Range<usize>) {
        let kept = out.items.as_ref().expect("the step kept item rows");
        assert_eq!(kept.positions, items.clone().collect::<Vec<_>>());
        let paged = &out.hidden[1];
        assert_eq!(paged.0, CaptureName::Hidden(1));
        for (k, &pos) in kept.positions.iter().enumerate() {
            assert_eq!(kept.rows.row(k), paged.1.row(pos), "item row at {pos}");
        }
        assert_eq!(kept.dense(paged.1.nrows()).row(0), ndarray::Array1::<f32>::zeros(paged.1.ncols()));
    }

    /// Also checks the item-position capture through the same steps: B's copied
    /// block holds an item row from A, which the copy must carry.
    #[test]
    fn shared_prefix_with_copy_on_write_in_a_mixed_batch() {
        for (ci, cfg) in configs().into_iter().enumerate() {
            let r = runner(cfg.clone(), 40 + ci as u64);
            let mut items = ItemCapture::new(CaptureName::Hidden(1), cfg.hidden_size, BS);
            // A's item sits at positions 3..9.
            let a = prompt(&cfg, 14, 6, 1);
            // B shares A's first 10 positions (two full blocks and half of the third).
            let mut b = prompt(&cfg, 19, 4, 2);
            b.token_ids[..10].copy_from_slice(&a.token_ids[..10]);
            b.embeds = a.embeds.clone();
            if cfg.mrope_section.is_some() {
                let shared = a.positions.slice(0..10).unwrap();
                let rest = b.positions.slice(10..19).unwrap();
                b.positions = Positions::given(shared.iter().chain(rest.iter()).collect(), 0);
            }
            let c = prompt(&cfg, 9, 2, 3);
            let mut pages = r.alloc_pages(16, BS).unwrap();
            let table_a = [5u32, 2, 9, 0];
            let outs_a = r
                .execute_with_items(
                    &ScheduledBatch { copies: vec![], seqs: vec![chunk(&a, 1, &table_a, 0, 14)] },
                    &mut pages,
                    Some(&mut items),
                )
                .unwrap();
            assert_same(&outs_a[0], &run_uncached(r.thinker(), r.backend(), &a, r.capture(), false).unwrap());
            assert_items(&outs_a[0], 3..9);
            // B reuses blocks 5 and 2, copies block 9 to 11 and continues at position 10;
            // C's first chunk runs in the same step.
            let table_b = [5u32, 2, 11, 3, 14];
            let table_c = [7u32, 8, 12];
            let batch = ScheduledBatch {
                copies: vec![BlockCopy { src: 9, dst: 11 }],
                seqs: vec![chunk(&c, 3, &table_c, 0, 5), chunk(&b, 2, &table_b, 10, 19)],
            };
            let outs = r.execute_with_items(&batch, &mut pages, Some(&mut items)).unwrap();
            assert_eq!(outs.len(), 1);
            assert_same(&outs[0], &run_uncached(r.thinker(), r.backend(), &b, r.capture(), false).unwrap());
            assert_items(&outs[0], 3..9);
            let outs_c = r
                .execute_with_items(
                    &ScheduledBatch { copies: vec![], seqs: vec![chunk(&c, 3, &table_c, 5, 9)] },
                    &mut pages,
                    Some(&mut items),
                )
                .unwrap();
            assert_same(&outs_c[0], &run_uncached(r.thinker(), r.backend(), &c, r.capture(), false).unwrap());
            assert_items(&outs_c[0], 3..5);
            // Held: A's six (B's five in blocks 5 and 2 are A's), the copy's one, C's two.
            assert_eq!(items.len(), 6 + 1 + 2);
        }
    }

    #[test]
    fn all_logits_end_with_the_last_logits() {
        let cfg = Config::tiny_qwen3(32, 2, 4, 2, 64);
        let r = runner(cfg.clone(), 9);
        let p = prompt(&cfg, 6, 2, 9);
        let out = run_uncached(r.thinker(), r.backend(), &p, r.capture(), true).unwrap();
        let logits = out.logits.unwrap();
        assert_eq!(logits.dim(), (6, 64));
        assert_eq!(logits.row(5).to_vec(), out.last_logits);
    }

    #[test]
    fn a_copies_only_batch_copies_and_returns_nothing() {
        for cfg in configs() {
            let r = runner(cfg.clone(), 2);
            let p = prompt(&cfg, 8, 2, 5);
            let mut pages = r.alloc_pages(4, BS).unwrap();
            r.execute(
                &ScheduledBatch { copies: vec![], seqs: vec![chunk(&p, 1, &[0, 1], 0, 6)] },
                &mut pages,
            )
            .unwrap();
            let outs = r
                .execute(
                    &ScheduledBatch { copies: vec![BlockCopy { src: 1, dst: 3 }], seqs: vec![] },
                    &mut pages,
                )
                .unwrap();
            assert!(outs.is_empty());
            let width = BS * r.pages_spec(4, BS).kv_width();
            for layer in 0..cfg.num_hidden_layers {
                let k = pages.k[layer].view();
                assert_eq!(k.slice(width..2 * width), k.slice(3 * width..4 * width));
            }
            // The copy holds positions 4..6 of the prompt: finishing the prompt through it
            // equals the uncached run.
            let outs = r
                .execute(
                    &ScheduledBatch { copies: vec![], seqs: vec![chunk(&p, 1, &[0, 3], 6, 8)] },
                    &mut pages,
                )
                .unwrap();
            assert_same(&outs[0], &run_uncached(r.thinker(), r.backend(), &p, r.capture(), false).unwrap());
        }
    }

    fn pages_equal(a: &CpuPages, b: &CpuPages) -> bool {
        a.k == b.k && a.v == b.v && a.hidden == b.hidden
    }

    #[test]
    fn invalid_batches_are_rejected_before_any_page_changes() {
        let cfg = Config::tiny_qwen3(32, 2, 4, 2, 64);
        let r = runner(cfg.clone(), 1);
        let p = prompt(&cfg, 10, 2, 4);
        let table = [0u32, 1, 2];
        let mut pages = r.alloc_pages(4, BS).unwrap();
        r.execute(&ScheduledBatch { copies: vec![], seqs: vec![chunk(&p, 1, &table, 0, 4)] }, &mut pages)
            .unwrap();
        let before = pages.clone();
        let good = chunk(&p, 1, &table, 4, 10);
        let mut bad_token = good.clone();
        bad_token.token_ids[2] = 64;
        // Slots come from the block table, so they cannot disagree with it; a
        // table of another block size than the pages' would misplace them.
        let mut bad_slot = good.clone();
        bad_slot.block_table = BlockTable::new(table.to_vec(), 2 * BS);
        let mut short_table = good.clone();
        short_table.block_table.truncate(2);
        let mut early_output = chunk(&p, 1, &table, 4, 8);
        early_output.emits_output = true;
        let mut bad_embed = good.clone();
        bad_embed.embeds = vec![EmbedRows {
            step_offset: 5,
            embeddings: Arc::new(Array2::zeros((3, 32))),
            rows: 0..2,
            deepstack: None,
        }];
        let mut bad_positions = good.clone();
        bad_positions.positions = Positions::linear(2);
        let deep = with_deepstack(p.clone(), 3, 1);
        let too_many_levels = chunk(&deep, 1, &table, 4, 10);
        let mut bad_level_shape = chunk(&with_deepstack(p.clone(), 2, 1), 1, &table, 4, 10);
        for e in &mut bad_level_shape.embeds {
            e.deepstack = Some(Arc::new(vec![Array2::zeros(e.embeddings.dim()), Array2::zeros((1, 32))]));
        }
        for (what, seq) in [
            ("token", bad_token),
            ("slot", bad_slot),
            ("table", short_table),
            ("early", early_output),
            ("embed", bad_embed),
            ("positions", bad_positions),
            ("deepstack levels", too_many_levels),
            ("deepstack shape", bad_level_shape),
        ] {
            // A valid copy goes first: it must not run either.
            let batch =
                ScheduledBatch { copies: vec![BlockCopy { src: 0, dst: 3 }], seqs: vec![good.clone(), seq] };
            let err = r.execute(&batch, &mut pages).unwrap_err();
            assert!(
                matches!(err, Error::Runner(RunnerError::InvalidBatch { request: 1, .. })),
                "{what}: {err}"
            );
            assert!(pages_equal(&pages, &before), "{what}: pages changed");
        }
        let bad_copy = ScheduledBatch { copies: vec![BlockCopy { src: 0, dst: 4 }], seqs: vec![] };
        assert!(matches!(
            r.execute(&bad_copy, &mut pages),
            Err(Error::Backend(BackendError::OpIndex { what: "copy block", index: 4, .. }))
        ));
        // An item store of another width or block size than the model's and the pages'.
        for (what, mut store) in [
            ("store width", ItemCapture::new(CaptureName::Hidden(1), 31, BS)),
            ("store block size", ItemCapture::new(CaptureName::Hidden(1), 32, 2 * BS)),
        ] {
            let batch =
                ScheduledBatch { copies: vec![BlockCopy { src: 0, dst: 3 }], seqs: vec![good.clone()] };
            let err = r.execute_with_items(&batch, &mut pages, Some(&mut store)).unwrap_err();
            assert!(
                matches!(err, Error::Backend(BackendError::OpShape { what: w, .. }) if w == what),
                "{err}"
            );
            assert!(pages_equal(&pages, &before) && store.is_empty(), "{what}: pages or store changed");
        }
        let mut wrong_pages =
            r.backend().alloc_pages(PagesSpec { captured: 1, ..r.pages_spec(4, BS) }).unwrap();
        let err =
            r.execute(&ScheduledBatch { copies: vec![], seqs: vec![good] }, &mut wrong_pages).unwrap_err();
        assert!(matches!(err, Error::Backend(BackendError::OpShape { what: "pages", .. })));
    }

    /// The CPU backend, except that `take_to_host` loses its last matrix: a
    /// backend that returns fewer results than it was asked for.
    struct ShortBackend(CpuBackend);

    impl Backend for ShortBackend {
        type Tensor = Array2<f32>;
        type Weight = <CpuBackend as Backend>::Weight;
        type Pages = CpuPages;
        fn name(&self) -> &'static str {
            "short"
        }
        fn upload(&self, host: ndarray::ArrayView2<'_, f32>) -> Result<Array2<f32>> {
            self.0.upload(host)
        }
        fn download(&self, t: &Array2<f32>) -> Result<Array2<f32>> {
            self.0.download(t)
        }
        fn take_to_host(&self, ts: Vec<Array2<f32>>) -> Result<Vec<Array2<f32>>> {
            let mut host = self.0.take_to_host(ts)?;
            host.pop();
            Ok(host)
        }
        fn shape(&self, t: &Array2<f32>) -> [usize; 2] {
            self.0.shape(t)
        }
        fn weight_dtypes(&self) -> &'static [Dtype] {
            self.0.weight_dtypes()
        }
        fn upload_weight(&self, host: crate::backend::HostWeight) -> Result<Self::Weight> {
            self.0.upload_weight(host)
        }
        fn alloc_pages(&self, spec: PagesSpec) -> Result<CpuPages> {
            self.0.alloc_pages(spec)
        }
        fn pages_spec(&self, pages: &CpuPages) -> PagesSpec {
            self.0.pages_spec(pages)
        }
        fn embedding(&self, table: &Self::Weight, ids: &[u32]) -> Result<Array2<f32>> {
            self.0.embedding(table, ids)
        }
        fn scatter_rows(&self, dst: &mut Array2<f32>, rows: &[u32], src: &Array2<f32>) -> Result<()> {
            self.0.scatter_rows(dst, rows, src)
        }
        fn gather_rows(&self, x: &Array2<f32>, rows: &[u32]) -> Result<Array2<f32>> {
            self.0.gather_rows(x, rows)
        }
        fn matmul_t(&self, x: &Array2<f32>, w: &Self::Weight) -> Result<Array2<f32>> {
            self.0.matmul_t(x, w)
        }
        fn add_bias(&self, x: &mut Array2<f32>, bias: &Array2<f32>) -> Result<()> {
            self.0.add_bias(x, bias)
        }
        fn add(&self, x: &mut Array2<f32>, y: &Array2<f32>) -> Result<()> {
            self.0.add(x, y)
        }
        fn rms_norm(&self, x: &Array2<f32>, w: &Array2<f32>, eps: f32) -> Result<Array2<f32>> {
            self.0.rms_norm(x, w, eps)
        }
        fn rms_norm_heads(
            &self, x: &mut Array2<f32>, w: &Array2<f32>, head_dim: usize, eps: f32,
        ) -> Result<()> {
            self.0.rms_norm_heads(x, w, head_dim, eps)
        }
        fn rope(
            &self, x: &mut Array2<f32>, spec: &crate::backend::RopeSpec, pos: RopePositions<'_>,
        ) -> Result<()> {
            self.0.rope(x, spec, pos)
        }
        fn swiglu(&self, gate_up: &Array2<f32>) -> Result<Array2<f32>> {
            self.0.swiglu(gate_up)
        }
        fn moe(&self, x: &Array2<f32>, w: &crate::backend::MoeWeights<Self::Weight>) -> Result<Array2<f32>> {
            self.0.moe(x, w)
        }
        fn write_kv(
            &self, pages: &mut CpuPages, layer: usize, k: &Array2<f32>, v: &Array2<f32>, slots: &[i64],
        ) -> Result<()> {
            self.0.write_kv(pages, layer, k, v, slots)
        }
        fn paged_attention(
            &self, q: &Array2<f32>, pages: &CpuPages, layer: usize, heads: crate::backend::AttnHeads,
            seqs: &[AttnSeq<'_>],
        ) -> Result<Array2<f32>> {
            self.0.paged_attention(q, pages, layer, heads, seqs)
        }
        fn write_hidden(
            &self, pages: &mut CpuPages, capture: usize, x: &Array2<f32>, slots: &[i64],
        ) -> Result<()> {
            self.0.write_hidden(pages, capture, x, slots)
        }
        fn gather_hidden(&self, pages: &CpuPages, capture: usize, slots: &[i64]) -> Result<Array2<f32>> {
            self.0.gather_hidden(pages, capture, slots)
        }
        fn copy_blocks(&self, pages: &mut CpuPages, copies: &[(BlockId, BlockId)]) -> Result<()> {
            self.0.copy_blocks(pages, copies)
        }
    }

    #[test]
    fn a_backend_that_returns_too_few_results_is_a_typed_error() {
        let cfg = Config::tiny_qwen3(32, 2, 4, 2, 64);
        let backend = Arc::new(ShortBackend(CpuBackend::new()));
        let thinker = Arc::new(Thinker::random(&*backend, cfg.clone(), 3).unwrap());
        let capture =
            CaptureSpec::new([CaptureName::Hidden(0), CaptureName::Final], cfg.num_hidden_layers).unwrap();
        let r = ModelRunner::new(backend, thinker, capture).unwrap();
        let p = prompt(&cfg, 10, 2, 4);
        let mut pages = r.alloc_pages(4, BS).unwrap();
        let batch = ScheduledBatch { copies: vec![], seqs: vec![chunk(&p, 1, &[0, 1, 2], 0, 10)] };
        let err = r.execute(&batch, &mut pages).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Backend(BackendError::OpCount { op: "take_to_host", expected: 3, found: 2, .. })
            ),
            "{err}"
        );
    }
}
