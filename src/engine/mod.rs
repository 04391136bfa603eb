//! The library face of a thinker stage: requests in, full hidden states and
//! generated tokens out.
//!
//! [`Engine`] runs one pipeline per request, each stage once and in order:
//! **preprocess** (fingerprint items, build the canonical prompt, find the
//! items' embeddings) → **admit** (the scheduler's one admission check, against
//! this model) → **schedule** (match, allocate, cut chunks) → **run** (the runner
//! on a backend) → **complete** (commit full blocks) → **output**. It returns,
//! per request, the hidden states of every captured layer for **every**
//! position (cached rows included) and the last position's logits. Caching
//! changes timings and `num_cached_tokens`, never the outputs.
//!
//! A generating request ([`Engine::generate`]) goes on after its prompt: each
//! step samples a token from the last position's logits with the request's
//! seeded sampler, streams it with that position's hidden rows
//! ([`TokenEvent`]), and appends it to the sequence, which decodes in
//! continuous batches with other requests until a stop id or `max_tokens`.
//! Its reply enters the cache like its prompt, so the next round hits.

mod config;
mod generation;
mod kv_events;
mod request;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fxhash::{FxHashMap, FxHashSet};
use ndarray::Array2;

use crate::backend::{Backend, Dtype};
use crate::backend::cpu::CpuBackend;
use crate::batch::{DeepStack, ModelShape, RequestId, ScheduledBatch};
use crate::canon::{Fingerprinter, ItemIdentity};
use crate::error::{CheckpointError, ConfigError, Error, InvariantViolation, IoError, RequestError, Result, SchedError};
use crate::index::PrefixIndex;
use crate::index::hashchain::HashChainIndex;
use crate::index::radix::{RadixConfig, RadixIndex};
use crate::model::{CaptureName, CaptureSpec, Config, EncoderCache, Thinker};
use crate::preprocess::Preprocessor;
use crate::prompt::{CanonicalPrompt, OmniTokens, PositionKind, Positions, TenantSalt};
use crate::prompt::out_of_vocab;
use crate::runner::{ModelRunner, SeqOutput};
use crate::sample::{FinishReason, SamplingParams};
use crate::sched::{Request, Scheduler, SchedulerConfig, SchedulerStats, check_tenant};
use generation::{Decoding, Next, last_rows};

pub use config::{EngineConfig, EngineStats, IndexKind, Timings};
pub use generation::{Event, Generation, GenerationTimings, TokenEvent};
pub use kv_events::request_block_hashes;
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
    /// `None` for a prefill.
    decoding: Option<Decoding>,
    /// Cached prompt tokens of the run that completed the prompt.
    num_cached: Option<usize>,
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
/// assert_eq!(second.num_cached_tokens, 10); // every position of the first prompt
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
    /// Events of other requests produced while one was awaited; `step` and
    /// `run_until_done` hand them out first.
    backlog: Vec<Event>,
    /// `config.known_tenants` as a set.
    known_tenants: Option<FxHashSet<TenantSalt>>,
    /// Publishes the scheduler's KV events once per step (`config.kv_events`).
    publisher: Option<crate::events::KvEventPublisher>,
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
        let thinker = Arc::new(Thinker::random_as(&*backend, model, seed, config.dtype)?);
        Self::new(backend, thinker, config)
    }
}

impl<B: Backend> Engine<B> {
    /// An engine on `backend` over the checkpoint in `dir`.
    pub fn from_dir_on(backend: Arc<B>, dir: &Path, mut config: EngineConfig) -> Result<Self> {
        if config.tokens.is_none() {
            config.tokens = tokens_from_config_file(&dir.join("config.json"))?;
        }
        let thinker = Arc::new(Thinker::from_dir_as(&*backend, dir, config.dtype)?);
        Self::new(backend, thinker, config)
    }

    /// An engine over a loaded thinker (several engines may share one).
    pub fn new(backend: Arc<B>, thinker: Arc<Thinker<B>>, config: EngineConfig) -> Result<Self> {
        if let Some(dtype) = config.dtype.filter(|&d| d != thinker.dtype()) {
            return Err(ConfigError::Invalid {
                component: "engine",
                field: "dtype",
                expected: format!("the loaded thinker's {}", thinker.dtype()),
                found: dtype.to_string(),
            }
            .into());
        }
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
        let runner = ModelRunner::new(backend, thinker, capture)?.with_kv_dtype(config.kv_dtype);
        let pages = runner.alloc_pages(config.num_blocks, config.block_size)?;
        // Last, so a failure above does not wait out a publisher's linger.
        let (sched, publisher) = kv_events::start(sched, &config, runner.backend().name())?;
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
            backlog: Vec::new(),
            publisher,
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

    /// The dtype the model's weight matrices are stored in (`auto` resolved).
    pub fn weight_dtype(&self) -> Dtype {
        self.runner.thinker().dtype()
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
        self.await_prefill(id)
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
        self.await_prefill(id)
    }

    /// Submits a generating request, runs everything pending and returns its
    /// generation (other requests' events wait for [`Engine::step`]).
    ///
    /// ```
    /// use omniprefix::engine::{Engine, EngineConfig, PrefillRequest};
    /// use omniprefix::model::Config;
    /// use omniprefix::sample::SamplingParams;
    ///
    /// let model = Config::tiny_qwen3(32, 2, 4, 2, 600);
    /// let mut engine = Engine::random(model, 1, EngineConfig { block_size: 4, ..Default::default() })?;
    /// let prompt: Vec<u32> = (0..10).collect();
    /// let first = engine.generate(PrefillRequest::text(prompt.clone()), SamplingParams::greedy(6))?;
    /// assert_eq!(first.tokens.len(), 6);
    /// assert_eq!(first.hidden[0].1.nrows(), 10 + 6 - 1); // every position that ran
    /// // The next round re-sends prompt + reply: all of it but the last token is cached.
    /// let next = [prompt, first.tokens.clone(), vec![7, 8]].concat();
    /// let second = engine.generate(PrefillRequest::text(next), SamplingParams::greedy(2))?;
    /// assert_eq!(second.num_cached_tokens, 10 + 6 - 1);
    /// # Ok::<(), omniprefix::Error>(())
    /// ```
    pub fn generate(&mut self, request: PrefillRequest<'_>, params: SamplingParams) -> Result<Generation> {
        self.generate_streaming(request, params, |_| {})
    }

    /// [`Engine::generate`], calling `on_token` with each token as it is
    /// sampled and the hidden rows of the position that produced it: what a
    /// talker consumes, token by token.
    pub fn generate_streaming(
        &mut self,
        request: PrefillRequest<'_>,
        params: SamplingParams,
        on_token: impl FnMut(&TokenEvent),
    ) -> Result<Generation> {
        let id = self.submit_generate(request, params)?;
        match self.await_finish(id, on_token)? {
            Event::Generated(g) => Ok(g),
            other => Err(SchedError::OutputsBeforeFinish { id: other.request() }.into()),
        }
    }

    /// Checks and queues a generating request; on error nothing changes.
    /// Its tokens and its end come from [`Engine::step`].
    pub fn submit_generate(&mut self, request: PrefillRequest<'_>, params: SamplingParams) -> Result<RequestId> {
        self.submit_generate_with_encoder(request, params, no_encoder)
    }

    /// [`Engine::submit_generate`] with an encoder for items without embeddings.
    pub fn submit_generate_with_encoder<E: Into<EncoderOutput>>(
        &mut self,
        request: PrefillRequest<'_>,
        params: SamplingParams,
        encoder: impl FnMut(usize, &ItemIdentity) -> Result<E>,
    ) -> Result<RequestId> {
        self.submit_inner(request, Some(params), encoder)
    }

    /// Drops a submitted request at any point (waiting, prefilling or
    /// decoding): its blocks and locks go back, its partly written blocks
    /// never enter the index, and no event of it follows.
    pub fn abort(&mut self, id: RequestId) -> Result<()> {
        if self.pending.remove(&id).is_none() {
            return Err(SchedError::UnknownRequest { id }.into());
        }
        self.backlog.retain(|e| e.request() != id);
        self.sched.abort(id)
    }

    /// True while some submitted request has not finished.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The checkpoint's eos ids: a generation's stop ids unless it names its own.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.model_config().eos_token_ids
    }

    /// Checks and queues a request; on error nothing changes.
    pub fn submit(&mut self, request: PrefillRequest<'_>) -> Result<RequestId> {
        self.submit_with_encoder(request, no_encoder)
    }

    /// [`Engine::submit`] with an encoder for items without embeddings.
    pub fn submit_with_encoder<E: Into<EncoderOutput>>(
        &mut self,
        request: PrefillRequest<'_>,
        encoder: impl FnMut(usize, &ItemIdentity) -> Result<E>,
    ) -> Result<RequestId> {
        self.submit_inner(request, None, encoder)
    }

    /// Preprocess → check → encode → admit, for prefills (`params: None`) and
    /// generations alike; on error nothing changes.
    fn submit_inner<E: Into<EncoderOutput>>(
        &mut self,
        request: PrefillRequest<'_>,
        params: Option<SamplingParams>,
        encoder: impl FnMut(usize, &ItemIdentity) -> Result<E>,
    ) -> Result<RequestId> {
        let started = Instant::now();
        let id = self.next_id;
        // The cheap rule first: a forged salt costs no fingerprinting (checked with caching off too).
        check_tenant(self.known_tenants.as_ref(), id, request.tenant)?;
        let prompt = self.preprocess(&request)?;
        let model = self.model_config();
        // Before any encoder runs: ids and sampling settings the model cannot take.
        if let Some((position, token)) = out_of_vocab(&prompt.token_ids, model.vocab_size) {
            let vocab_size = u32::try_from(model.vocab_size).unwrap_or(u32::MAX);
            return Err(RequestError::TokenOutOfVocab { position, token, vocab_size }.into());
        }
        if let Some(params) = &params {
            params.check(model.vocab_size, prompt.len(), model.max_position_embeddings)?;
        }
        // Positions the sequence may grow by: every sampled token but the last runs.
        let max_new_tokens = params.as_ref().map_or(0, |p| p.positions_needed(prompt.len()) - prompt.len());
        let positions = prompt.positions.clone();
        let (embeddings, deepstack, fresh, cache_hits) = self.item_rows(&prompt, &request, encoder)?;
        let preprocess = started.elapsed();
        let req = Request { id, prompt, item_embeddings: embeddings, item_deepstack: deepstack, hidden_size: None, max_new_tokens };
        self.sched.admit(req)?;
        // Admitted: only now does anything change.
        for (fp, e, levels) in fresh {
            self.encoder_cache.insert_with_deepstack(fp, e, levels);
        }
        self.encoder_cache_hits += cache_hits;
        self.next_id += 1;
        let timings = Timings { preprocess, ..Default::default() };
        let decoding = params.map(|p| {
            let seed = p.seed.unwrap_or_else(crate::sample::random_seed);
            Decoding::new(p, seed, &self.runner.thinker().config().eos_token_ids, &crate::sample::placeholder_ids(self.tokens()))
        });
        self.pending.insert(id, Pending { timings, submitted: started, positions, decoding, num_cached: None });
        Ok(id)
    }

    /// Runs steps (several requests per step, chunked by the token budget)
    /// until every submitted request has finished; returns their outputs in
    /// the order they finished.
    /// Events of generating requests are kept for [`Engine::step`].
    pub fn run_until_done(&mut self) -> Result<Vec<Output>> {
        let mut outputs = Vec::new();
        let mut keep = Vec::new();
        loop {
            for event in self.step()? {
                match event {
                    Event::Prefilled(out) => outputs.push(out),
                    other => keep.push(other),
                }
            }
            if self.pending.is_empty() {
                break;
            }
        }
        self.backlog = keep;
        Ok(outputs)
    }

    /// Runs one step of the pipeline after admission (schedule → run →
    /// complete → sample → output) and returns what it produced: sampled
    /// tokens and finished requests, after any events kept from earlier calls.
    /// Empty when nothing is pending. A runner failure aborts the batch's
    /// requests (their blocks go back to the pool) and is returned.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let mut events = std::mem::take(&mut self.backlog);
        if !self.pending.is_empty() {
            self.step_into(&mut events)?;
        }
        Ok(events)
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
                    // The same content earlier in this request: encoded once.
                    None if let Some((_, e, levels)) = fresh.iter().find(|(f, _, _)| *f == fp) => {
                        (Arc::clone(e), input.deepstack.clone().or_else(|| levels.clone()))
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

    /// [`Engine::await_finish`] for a prefill.
    fn await_prefill(&mut self, id: RequestId) -> Result<Output> {
        match self.await_finish(id, |_| {})? {
            Event::Prefilled(out) => Ok(out),
            other => Err(SchedError::OutputsBeforeFinish { id: other.request() }.into()),
        }
    }

    /// Steps until `id` has finished and returns its last event, passing its
    /// tokens to `on_token`; other requests' events are kept for `step`.
    fn await_finish(&mut self, id: RequestId, mut on_token: impl FnMut(&TokenEvent)) -> Result<Event> {
        let mut kept = Vec::new();
        let mut events = std::mem::take(&mut self.backlog);
        let result = loop {
            let mut finished = None;
            for event in events.drain(..) {
                match event {
                    Event::Token(t) if t.request == id => on_token(&t),
                    Event::Prefilled(_) | Event::Generated(_) if event.request() == id => finished = Some(event),
                    other => kept.push(other),
                }
            }
            if let Some(event) = finished {
                break Ok(event);
            }
            if !self.pending.contains_key(&id) {
                break Err(SchedError::UnknownRequest { id }.into());
            }
            if let Err(e) = self.step_into(&mut events) {
                break Err(e);
            }
        };
        kept.append(&mut self.backlog);
        self.backlog = kept;
        result
    }

    /// One step of the pipeline after admission, its events appended to `events`.
    fn step_into(&mut self, events: &mut Vec<Event>) -> Result<()> {
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
        let ready = self.sched.complete(&batch)?;
        let schedule = schedule + t2.elapsed();
        for seq in &batch.seqs {
            if let Some(p) = self.pending.get_mut(&seq.request) {
                p.timings.schedule += schedule;
                p.timings.forward += forward;
            }
        }
        for out in outputs {
            if !ready.contains(&out.request) {
                return Err(SchedError::OutputsBeforeFinish { id: out.request }.into());
            }
            self.on_ready(out, events)?;
        }
        self.publish_kv_events();
        Ok(())
    }

    /// A sequence whose known tokens all ran: a prefill ends; a generation
    /// samples its next token and decodes on, or ends.
    fn on_ready(&mut self, out: SeqOutput, events: &mut Vec<Event>) -> Result<()> {
        let id = out.request;
        let Some(p) = self.pending.get_mut(&id) else { return Ok(()) };
        let num_cached = *p.num_cached.get_or_insert_with(|| self.sched.num_cached_tokens(id).unwrap_or(0));
        let elapsed = p.submitted.elapsed();
        let Some(d) = p.decoding.as_mut() else {
            self.sched.finish(id)?;
            return self.output(out, num_cached, events);
        };
        d.add_rows(&out.hidden);
        let next = match d.stopping {
            // Its last token just ran (`run_last_token`).
            Some(reason) => Next::Finish(reason),
            None => {
                let next = d.sample(&out.last_logits, elapsed);
                let index = d.tokens.len() - 1;
                let position = p.positions.len() + index - 1;
                let token = d.tokens[index];
                events.push(Event::Token(TokenEvent { request: id, token, index, position, hidden: last_rows(&out.hidden) }));
                next
            }
        };
        match next {
            Next::Continue(token) | Next::RunLast(token) => self.sched.append(id, token),
            Next::Finish(reason) => {
                self.sched.finish(id)?;
                self.generation(id, num_cached, reason, events)
            }
        }
    }

    /// The last stage: the runner's outputs with what ran (positions from the
    /// prompt's, cut like every chunk's) and where the time went.
    fn output(&mut self, out: SeqOutput, num_cached: usize, events: &mut Vec<Event>) -> Result<()> {
        let Some(p) = self.pending.remove(&out.request) else { return Ok(()) };
        let prompt_len = p.positions.len();
        let computed_positions = p.positions.slice(num_cached..prompt_len)?;
        let timings = Timings { total: p.submitted.elapsed(), ..p.timings };
        self.finished += 1;
        events.push(Event::Prefilled(Output {
            request: out.request,
            hidden: out.hidden,
            last_logits: out.last_logits,
            num_cached_tokens: num_cached,
            prompt_len,
            computed_positions,
            timings,
        }));
        Ok(())
    }

    /// A generation's end: its tokens and the rows of every position that ran.
    fn generation(&mut self, id: RequestId, num_cached: usize, finish_reason: FinishReason, events: &mut Vec<Event>) -> Result<()> {
        let Some(mut p) = self.pending.remove(&id) else { return Ok(()) };
        let Some(mut d) = p.decoding.take() else { return Ok(()) };
        let names = self.runner.capture().points().to_vec();
        let hidden = d.take_hidden(&names, self.model_config().hidden_size)?;
        let timings = GenerationTimings {
            preprocess: p.timings.preprocess,
            ttft: d.token_times.first().copied().unwrap_or_default(),
            token_times: std::mem::take(&mut d.token_times),
            total: p.submitted.elapsed(),
        };
        self.finished += 1;
        events.push(Event::Generated(Generation {
            request: id,
            tokens: std::mem::take(&mut d.tokens),
            hidden,
            num_cached_tokens: num_cached,
            prompt_len: p.positions.len(),
            finish_reason,
            seed: d.seed,
            timings,
        }));
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

/// The encoder of requests submitted without one: every item must bring its
/// embeddings or hit the encoder cache.
fn no_encoder(item: usize, _: &ItemIdentity) -> Result<Array2<f32>> {
    Err(Error::Request(RequestError::MissingEmbeddings { item }))
}

/// The tenant of request `id` when caching is off: one per request, from the
/// top of the salt space, so no two requests ever share an entry.
fn private_tenant(id: RequestId) -> TenantSalt {
    TenantSalt::MAX - id
}

/// Special ids from a checkpoint's `config.json` (`thinker_config` of Omni
/// checkpoints, or the root); `None` when it names none (a text-only model).
pub fn tokens_from_config_file(path: &Path) -> Result<Option<OmniTokens>> {
    let text = std::fs::read_to_string(path).map_err(|source| IoError::read(path, source))?;
    tokens_from_config_json(&text)
}

/// [`tokens_from_config_file`] over the text of a `config.json`.
pub fn tokens_from_config_json(text: &str) -> Result<Option<OmniTokens>> {
    let root: serde_json::Value = serde_json::from_str(text).map_err(|e| CheckpointError::ConfigParse(e.to_string()))?;
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
