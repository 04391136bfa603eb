//! The library face of a thinker stage: requests in, full hidden states out.
//!
//! [`Engine`] runs one pipeline per request, each stage once and in order:
//! **preprocess** (fingerprint items, build the canonical prompt, find the
//! items' embeddings) → **admit** (the scheduler's one admission check, against
//! this model) → **schedule** (match, allocate, cut chunks) → **run** (the runner
//! on a backend) → **complete** (commit full blocks) → **output**. It returns,
//! per request, the hidden states of every captured layer for **every**
//! position (cached rows included) and the last position's logits. Caching
//! changes timings and `num_cached_tokens`, never the outputs.

mod config;
mod request;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fxhash::{FxHashMap, FxHashSet};
use ndarray::Array2;

use crate::backend::Backend;
use crate::backend::cpu::CpuBackend;
use crate::batch::{DeepStack, ModelShape, RequestId, ScheduledBatch};
use crate::canon::{Fingerprinter, ItemIdentity};
use crate::error::{CheckpointError, Error, InvariantViolation, IoError, RequestError, Result, SchedError};
use crate::index::PrefixIndex;
use crate::index::hashchain::HashChainIndex;
use crate::index::radix::{RadixConfig, RadixIndex};
use crate::model::{CaptureName, CaptureSpec, Config, EncoderCache, Thinker};
use crate::preprocess::Preprocessor;
use crate::prompt::{CanonicalPrompt, OmniTokens, PositionKind, Positions, TenantSalt};
use crate::runner::{ModelRunner, SeqOutput};
use crate::sched::{Request, Scheduler, SchedulerConfig, SchedulerStats, check_tenant};

pub use config::{EngineConfig, EngineStats, IndexKind, Timings};
pub use request::{EncoderOutput, ItemInput, PlaceholderForm, PrefillRequest};

/// What a finished prefill returns.
#[derive(Debug, Clone)]
pub struct Output {
    pub request: RequestId,
    /// Each captured point's hidden states `[prompt_len, hidden]`, in capture order.
    pub hidden: Vec<(CaptureName, Array2<f32>)>,
    /// Logits `[vocab]` of the prompt's last position.
    pub last_logits: Vec<f32>,
    /// Leading positions whose KV came from the cache (not recomputed).
    pub num_cached_tokens: usize,
    /// Length of the expanded prompt.
    pub prompt_len: usize,
    /// Position ids of the positions that ran (`num_cached_tokens..prompt_len`):
    /// the prompt's positions cut by [`Positions::slice`], as every chunk's were.
    pub computed_positions: Positions,
    pub timings: Timings,
}

impl Output {
    /// The hidden states captured at `name`, if captured.
    pub fn hidden_at(&self, name: CaptureName) -> Option<&Array2<f32>> {
        self.hidden.iter().find(|(n, _)| *n == name).map(|(_, h)| h)
    }
}

/// An item's encoder output to cache once its request is admitted.
type FreshRows = (crate::canon::Fingerprint, Arc<Array2<f32>>, Option<DeepStack>);

/// A submitted request until its output is read.
struct Pending {
    timings: Timings,
    submitted: Instant,
    /// The prompt's positions (by run): the output's are cut from them.
    positions: Positions,
}

/// A thinker stage with prefix caching: submit requests, run them, read full hidden states.
///
/// ```
/// use omniprefix::engine::{Engine, EngineConfig, PrefillRequest};
/// use omniprefix::model::Config;
///
/// let model = Config::tiny_qwen3(32, 2, 4, 2, 600);
/// let mut engine = Engine::random(model, 1, EngineConfig { block_size: 4, ..Default::default() })?;
/// let first = engine.prefill(PrefillRequest::text((0..10).collect()))?;
/// let second = engine.prefill(PrefillRequest::text((0..14).collect()))?;
/// assert_eq!(first.num_cached_tokens, 0);
/// assert_eq!(second.num_cached_tokens, 8); // two full blocks of the first prompt
/// assert_eq!(second.hidden[0].1.dim(), (14, 32)); // every position, cached ones included
/// assert_eq!(engine.stats().hits, 1);
/// # Ok::<(), omniprefix::Error>(())
/// ```
pub struct Engine<B: Backend = CpuBackend> {
    config: EngineConfig,
    runner: ModelRunner<B>,
    pages: B::Pages,
    sched: Scheduler,
    /// Fingerprints items and lays prompts out for the engine's model.
    preprocessor: Preprocessor,
    encoder_cache: EncoderCache,
    encoder_cache_hits: u64,
    finished: u64,
    next_id: RequestId,
    pending: FxHashMap<RequestId, Pending>,
    /// Outputs of requests that finished while another was awaited by `prefill`.
    ready: Vec<Output>,
    /// `config.known_tenants` as a set.
    known_tenants: Option<FxHashSet<TenantSalt>>,
}

impl Engine<CpuBackend> {
    /// An engine on the CPU backend over the HF checkpoint in `dir`
    /// (`config.json` + safetensors; special ids from its `thinker_config`).
    pub fn from_dir(dir: &Path, config: EngineConfig) -> Result<Self> {
        Self::from_dir_on(Arc::new(CpuBackend::new()), dir, config)
    }

    /// An engine on the CPU backend over a model with seeded random weights.
    pub fn random(model: Config, seed: u64, config: EngineConfig) -> Result<Self> {
        let backend = Arc::new(CpuBackend::new());
        let thinker = Arc::new(Thinker::random(&*backend, model, seed)?);
        Self::new(backend, thinker, config)
    }
}

impl<B: Backend> Engine<B> {
    /// An engine on `backend` over the checkpoint in `dir`.
    pub fn from_dir_on(backend: Arc<B>, dir: &Path, mut config: EngineConfig) -> Result<Self> {
        if config.tokens.is_none() {
            config.tokens = tokens_from_config_file(&dir.join("config.json"))?;
        }
        let thinker = Arc::new(Thinker::from_dir(&*backend, dir)?);
        Self::new(backend, thinker, config)
    }

    /// An engine over a loaded thinker (several engines may share one).
    pub fn new(backend: Arc<B>, thinker: Arc<Thinker<B>>, config: EngineConfig) -> Result<Self> {
        let model = thinker.config().clone();
        let capture = match &config.capture {
            Some(points) => CaptureSpec::new(points.iter().copied(), model.num_hidden_layers)?,
            None => CaptureSpec::default_for(model.num_hidden_layers),
        };
        let index: Box<dyn PrefixIndex> = match config.index {
            IndexKind::Radix => Box::new(RadixIndex::new(RadixConfig { block_size: config.block_size })?),
            IndexKind::HashChain => Box::new(HashChainIndex::new(config.block_size)?),
        };
        let sched = Scheduler::new(
            SchedulerConfig {
                num_blocks: config.num_blocks,
                block_size: config.block_size,
                max_tokens_per_step: config.max_tokens_per_step,
                max_seqs_per_step: config.max_seqs_per_step,
                token_granular_reuse: config.token_granular_reuse,
            },
            index,
        )?;
        // Admission checks every request against this model (vocabulary,
        // widths, DeepStack levels, context), so the runner trusts the batches.
        let sched = sched.with_model(ModelShape::of(&model));
        let sched = match model.max_position_embeddings {
            Some(max) => sched.with_max_context(max),
            None => sched,
        };
        let runner = ModelRunner::new(backend, thinker, capture)?;
        let pages = runner.alloc_pages(config.num_blocks, config.block_size)?;
        let tokens = config.tokens.clone().unwrap_or_else(OmniTokens::qwen3_omni);
        let fingerprinter = Fingerprinter::new(config.fingerprint_key.clone(), config.fingerprint_threads, config.validation)?;
        let position_kind = if model.mrope_section.is_some() { PositionKind::Mrope } else { PositionKind::Linear };
        let preprocessor = Preprocessor::new(fingerprinter, tokens).with_positions(position_kind);
        Ok(Engine {
            known_tenants: config.known_tenants.as_ref().map(|t| t.iter().copied().collect()),
            encoder_cache: EncoderCache::new(config.encoder_cache_bytes),
            config,
            runner,
            pages,
            sched,
            preprocessor,
            encoder_cache_hits: 0,
            finished: 0,
            next_id: 0,
            pending: FxHashMap::default(),
            ready: Vec::new(),
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The model's config.
    pub fn model_config(&self) -> &Config {
        self.runner.thinker().config()
    }

    /// The captured points, in the order of [`Output::hidden`].
    pub fn capture(&self) -> &CaptureSpec {
        self.runner.capture()
    }

    /// The special ids requests are laid out with (admission checks ids against the model's vocabulary).
    pub fn tokens(&self) -> &OmniTokens {
        self.preprocessor.tokens()
    }

    /// The runner (its thinker and backend), e.g. for an uncached reference run.
    pub fn runner(&self) -> &ModelRunner<B> {
        &self.runner
    }

    /// Encoder outputs by item fingerprint: items found here need no embeddings.
    pub fn encoder_cache(&mut self) -> &mut EncoderCache {
        &mut self.encoder_cache
    }

    /// Submits, runs everything pending and returns this request's output
    /// (other requests' outputs wait for [`Engine::run_until_done`]).
    pub fn prefill(&mut self, request: PrefillRequest<'_>) -> Result<Output> {
        let id = self.submit(request)?;
        self.await_output(id)
    }

    /// [`Engine::prefill`] with `encoder` called for items that bring no
    /// embeddings and miss the encoder cache (its outputs, DeepStack levels
    /// included, are cached). The encoder returns an [`EncoderOutput`] or a bare
    /// `Array2<f32>` of embeddings.
    pub fn prefill_with_encoder<E: Into<EncoderOutput>>(
        &mut self,
        request: PrefillRequest<'_>,
        encoder: impl FnMut(usize, &ItemIdentity) -> Result<E>,
    ) -> Result<Output> {
        let id = self.submit_with_encoder(request, encoder)?;
        self.await_output(id)
    }

    /// Checks and queues a request; on error nothing changes.
    pub fn submit(&mut self, request: PrefillRequest<'_>) -> Result<RequestId> {
        self.submit_with_encoder(request, |item, _| -> Result<Array2<f32>> { Err(Error::Request(RequestError::MissingEmbeddings { item })) })
    }

    /// [`Engine::submit`] with an encoder for items without embeddings.
    pub fn submit_with_encoder<E: Into<EncoderOutput>>(
        &mut self,
        request: PrefillRequest<'_>,
        encoder: impl FnMut(usize, &ItemIdentity) -> Result<E>,
    ) -> Result<RequestId> {
        let started = Instant::now();
        let id = self.next_id;
        // The cheap rule first: a forged salt costs no fingerprinting (checked with caching off too).
        check_tenant(self.known_tenants.as_ref(), id, request.tenant)?;
        let prompt = self.preprocess(&request)?;
        let positions = prompt.positions.clone();
        let (embeddings, deepstack, fresh, cache_hits) = self.item_rows(&prompt, &request, encoder)?;
        let preprocess = started.elapsed();
        let req = Request { id, prompt, item_embeddings: embeddings, item_deepstack: deepstack, hidden_size: None, max_new_tokens: 0 };
        self.sched.admit(req)?;
        // Admitted: only now does anything change.
        for (fp, e, levels) in fresh {
            self.encoder_cache.insert_with_deepstack(fp, e, levels);
        }
        self.encoder_cache_hits += cache_hits;
        self.next_id += 1;
        let timings = Timings { preprocess, ..Default::default() };
        self.pending.insert(id, Pending { timings, submitted: started, positions });
        Ok(id)
    }

    /// Runs steps (several requests per step, chunked by the token budget)
    /// until every submitted request has finished; returns their outputs in
    /// the order they finished.
    pub fn run_until_done(&mut self) -> Result<Vec<Output>> {
        while !self.pending.is_empty() {
            self.step()?;
        }
        Ok(std::mem::take(&mut self.ready))
    }

    /// Counters of the scheduler, index and encoder cache.
    pub fn stats(&self) -> EngineStats {
        let s = self.sched.stats();
        EngineStats {
            queries: s.queries,
            hits: s.hits,
            hit_tokens: s.hit_tokens,
            evicted_blocks: s.evicted_blocks,
            preemptions: s.preemptions,
            encoder_cache_hits: self.encoder_cache_hits,
            finished: self.finished,
        }
    }

    /// The scheduler's counters and pool occupancy.
    pub fn scheduler_stats(&self) -> SchedulerStats {
        self.sched.stats()
    }

    /// Checks the scheduler's pool, index and request bookkeeping; `Err` names
    /// the first broken invariant.
    pub fn validate(&self) -> std::result::Result<(), InvariantViolation> {
        self.sched.validate()
    }

    /// Fingerprints the items and lays the prompt out (positions included).
    fn preprocess(&self, request: &PrefillRequest<'_>) -> Result<CanonicalPrompt> {
        let tenant = if self.config.cache { request.tenant } else { private_tenant(self.next_id) };
        let specs = request.items.iter().map(|item| &item.spec);
        self.preprocessor.canonicalise(tenant, &request.token_ids, request.placeholders, specs)
    }

    /// Each item's embeddings and DeepStack levels: given with the request, from
    /// the encoder cache, or from `encoder`. Returns them with the outputs to
    /// cache once the request is admitted, and the number of cache hits.
    #[allow(clippy::type_complexity)] // the four results of one pass over the items
    fn item_rows<E: Into<EncoderOutput>>(
        &mut self,
        prompt: &CanonicalPrompt,
        request: &PrefillRequest<'_>,
        mut encoder: impl FnMut(usize, &ItemIdentity) -> Result<E>,
    ) -> Result<(Vec<Arc<Array2<f32>>>, Vec<Option<DeepStack>>, Vec<FreshRows>, u64)> {
        let mut embeddings = Vec::with_capacity(prompt.items.len());
        let mut deepstack = Vec::with_capacity(prompt.items.len());
        let mut fresh = Vec::new();
        let mut cache_hits = 0;
        for (index, (identity, input)) in prompt.items.iter().zip(&request.items).enumerate() {
            let fp = identity.fingerprint;
            let (emb, levels) = match &input.embeddings {
                Some(e) => {
                    fresh.push((fp, Arc::clone(e), input.deepstack.clone()));
                    (Arc::clone(e), input.deepstack.clone())
                }
                None => match self.encoder_cache.get_with_deepstack(fp) {
                    Some((e, cached)) => {
                        cache_hits += 1;
                        (e, input.deepstack.clone().or(cached))
                    }
                    None => {
                        let out: EncoderOutput = encoder(index, identity)?.into();
                        let e = Arc::new(out.embeddings);
                        let encoded = (!out.deepstack.is_empty()).then(|| Arc::new(out.deepstack));
                        let levels = input.deepstack.clone().or(encoded);
                        fresh.push((fp, Arc::clone(&e), levels.clone()));
                        (e, levels)
                    }
                },
            };
            embeddings.push(emb);
            deepstack.push(levels);
        }
        Ok((embeddings, deepstack, fresh, cache_hits))
    }

    /// Steps until `id` has finished; keeps other finished outputs for `run_until_done`.
    fn await_output(&mut self, id: RequestId) -> Result<Output> {
        loop {
            if let Some(i) = self.ready.iter().position(|o| o.request == id) {
                return Ok(self.ready.swap_remove(i));
            }
            if !self.pending.contains_key(&id) {
                return Err(SchedError::UnknownRequest { id }.into());
            }
            self.step()?;
        }
    }

    /// One step of the pipeline after admission: schedule → run → complete →
    /// output. A runner failure aborts the batch's requests (their blocks go
    /// back to the pool) and is returned.
    fn step(&mut self) -> Result<()> {
        let t0 = Instant::now();
        let batch = self.sched.schedule()?;
        let schedule = t0.elapsed();
        if batch.seqs.is_empty() {
            return Err(SchedError::Stalled { pending: self.pending.len() }.into());
        }
        let t1 = Instant::now();
        let outputs = match self.runner.execute_scheduled(&batch, &mut self.pages) {
            Ok(outputs) => outputs,
            Err(e) => {
                self.abort_batch(&batch);
                return Err(e);
            }
        };
        let forward = t1.elapsed();
        let t2 = Instant::now();
        let done = self.sched.complete(&batch)?;
        let schedule = schedule + t2.elapsed();
        for seq in &batch.seqs {
            if let Some(p) = self.pending.get_mut(&seq.request) {
                p.timings.schedule += schedule;
                p.timings.forward += forward;
            }
        }
        for out in outputs {
            if !done.contains(&out.request) {
                return Err(SchedError::OutputsBeforeFinish { id: out.request }.into());
            }
            let num_cached = self.sched.num_cached_tokens(out.request).unwrap_or(0);
            self.sched.finish(out.request)?;
            self.output(out, num_cached)?;
        }
        Ok(())
    }

    /// The last stage: the runner's outputs with what ran (positions from the
    /// prompt's, cut like every chunk's) and where the time went.
    fn output(&mut self, out: SeqOutput, num_cached: usize) -> Result<()> {
        let Some(p) = self.pending.remove(&out.request) else { return Ok(()) };
        let prompt_len = p.positions.len();
        let computed_positions = p.positions.slice(num_cached..prompt_len)?;
        let timings = Timings { total: p.submitted.elapsed(), ..p.timings };
        self.finished += 1;
        self.ready.push(Output {
            request: out.request,
            hidden: out.hidden,
            last_logits: out.last_logits,
            num_cached_tokens: num_cached,
            prompt_len,
            computed_positions,
            timings,
        });
        Ok(())
    }

    fn abort_batch(&mut self, batch: &ScheduledBatch) {
        for seq in &batch.seqs {
            // The request is known to the scheduler (it was just scheduled).
            let _ = self.sched.abort(seq.request);
            self.pending.remove(&seq.request);
        }
    }
}

/// The tenant of request `id` when caching is off: one per request, from the
/// top of the salt space, so no two requests ever share an entry.
fn private_tenant(id: RequestId) -> TenantSalt {
    TenantSalt::MAX - id
}

/// Special ids from a checkpoint's `config.json` (`thinker_config` of Omni
/// checkpoints, or the root); `None` when it names none (a text-only model).
pub fn tokens_from_config_file(path: &Path) -> Result<Option<OmniTokens>> {
    let text = std::fs::read_to_string(path).map_err(|source| IoError::read(&path, source))?;
    let root: serde_json::Value = serde_json::from_str(&text).map_err(|e| CheckpointError::ConfigParse(e.to_string()))?;
    let node = root.get("thinker_config").unwrap_or(&root);
    if node.get("image_token_id").is_none() {
        return Ok(None);
    }
    serde_json::from_value(node.clone()).map(Some).map_err(|e| CheckpointError::ConfigParse(format!("special token ids: {e}")).into())
}

/// Time as fractional milliseconds (for reports).
pub fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
