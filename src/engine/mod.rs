//! The library face of a thinker stage: requests in, full hidden states and
//! generated tokens out.
//!
//! Two layers over one core:
//! - [`Engine`], the core, is synchronous and deterministic: it
//!   [`prepare`](Engine::prepare)s a [`Request`] (fingerprint items, build the
//!   canonical prompt, run every check that reads no scheduler state, call the
//!   encoder on an encoder-cache miss), [`submit_prepared`](Engine::submit_prepared)s
//!   it (admission against the pool), and each [`step`](Engine::step) schedules
//!   (match, allocate, cut chunks), runs the batch on a backend, commits full
//!   blocks and samples, returning [`Event`]s. Tests, benches and proptests drive it.
//! - [`ServedEngine`] owns a core on its own thread and steps while anything is
//!   pending; callers prepare requests on their own threads and read each
//!   request's events from a [`RequestHandle`] (blocking or async; abort on drop).
//!
//! Every request returns one [`Output`]: the hidden states of every captured
//! layer for **every** position (cached rows included), the last logits, and
//! for a generation its tokens. Caching changes timings and
//! `num_cached_tokens`, never the outputs. A generation's reply enters the
//! cache like its prompt, so the next round hits.

mod channel;
mod config;
mod generation;
mod handle;
mod kv_events;
mod lifecycle;
mod metrics;
mod output;
mod prepare;
mod request;
mod served;
mod step_loop;
mod talk;
mod tier;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use fxhash::FxHashMap;

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, Dtype};
use crate::batch::{ModelShape, RequestId};
use crate::canon::Fingerprinter;
use crate::error::{ConfigError, InvariantViolation, Result};
use crate::events::Medium;
use crate::index::PrefixIndex;
use crate::index::block_hash::FleetHasher;
use crate::index::hashchain::HashChainIndex;
use crate::index::radix::{RadixConfig, RadixIndex};
use crate::kv::ItemCapture;
use crate::model::{CaptureSpec, Config, EncoderCache, Thinker};
use crate::preprocess::Preprocessor;
use crate::prompt::{OmniTokens, PositionKind};
use crate::runner::ModelRunner;
use crate::sched::{RequestChecks, Scheduler};
use crate::speech::SpeechStage;
use lifecycle::Pending;
use prepare::Preparer;

pub use channel::{HandleEvent, ReadySender};
pub use config::{DEFAULT_AUDIO_YIELD, EngineConfig, EngineStats, IndexKind, ItemCaptureStats};
pub use handle::{Aborter, RequestHandle};
pub use kv_events::request_block_hashes;
pub use output::{AudioEvent, Event, Output, Timings, TokenEvent};
pub use prepare::{Prepared, SharedEncoder};
pub use request::{Encoder, EncoderOutput, ItemInput, PlaceholderForm, Request, Task};
pub use served::{ServedEngine, ServedOptions};
pub use step_loop::FAULT_STEP_PANIC_ENV;
pub use tier::TierEngineStats;

/// A thinker stage with prefix caching: the synchronous core. Prepare and
/// submit requests, step, read events; or [`run`](Engine::run) one request to
/// its end.
///
/// ```
/// use omniprefix::engine::{Engine, EngineConfig, Request};
/// use omniprefix::model::Config;
/// use omniprefix::sample::SamplingParams;
/// use omniprefix::sched::SchedulerConfig;
///
/// let model = Config::tiny_qwen3(32, 2, 4, 2, 600);
/// let mut engine = Engine::random(model, 1, EngineConfig { scheduler: SchedulerConfig { block_size: 4, ..Default::default() }, ..Default::default() })?;
/// let first = engine.run(Request::text((0..10).collect()))?;
/// let second = engine.run(Request::text((0..14).collect()))?;
/// assert_eq!(first.num_cached_tokens, 0);
/// assert_eq!(second.num_cached_tokens, 10); // every position of the first prompt
/// assert_eq!(second.hidden[0].1.dim(), (14, 32)); // every position, cached ones included
///
/// // A generation; the next round re-sends prompt + reply and hits all but its last token.
/// let prompt: Vec<u32> = (0..10).collect();
/// let reply = engine.run(Request::text(prompt.clone()).generate(SamplingParams::greedy(6)))?;
/// assert_eq!(reply.tokens.len(), 6);
/// assert_eq!(reply.hidden[0].1.nrows(), 10 + 6 - 1); // every position that ran
/// let next = [prompt, reply.tokens.clone(), vec![7, 8]].concat();
/// let round2 = engine.run(Request::text(next).generate(SamplingParams::greedy(2)))?;
/// assert_eq!(round2.num_cached_tokens, 10 + 6 - 1);
/// # Ok::<(), omniprefix::Error>(())
/// ```
pub struct Engine<B: Backend = CpuBackend> {
    config: EngineConfig,
    runner: ModelRunner<B>,
    pages: B::Pages,
    /// The talker's accept layer at item positions, beside the pages, unless
    /// the capture pages it at every position anyway.
    item_capture: Option<ItemCapture>,
    sched: Scheduler,
    /// What callers prepare requests with (shared with a served engine's callers).
    preparer: Arc<Preparer>,
    finished: u64,
    pending: FxHashMap<RequestId, Pending>,
    /// Publishes the scheduler's KV events once per step (`config.kv_events`).
    publisher: Option<kv_events::Publisher>,
    /// TTFT and inter-token latency histograms ([`metrics`](Self::metrics)).
    latencies: metrics::Latencies,
    /// The talker stage, when the checkpoint has a talker and speech is on.
    talkers: Option<talk::Talkers<B>>,
    /// The disk tier under the pool (`config.tier_dir`).
    tier: Option<tier::EngineTier>,
}

/// What `config` asks that can be refused before any weight loads: its dtypes,
/// and a tier `backend` cannot use.
fn check_before_load<B: Backend>(config: &EngineConfig, backend: &B) -> Result<()> {
    config.check_dtypes()?;
    tier::precheck(config, backend)
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
        check_before_load(&config, &*backend)?;
        let thinker = Arc::new(Thinker::random_as(&*backend, model, seed, config.dtype)?);
        Self::new(backend, thinker, config)
    }
}

impl<B: Backend> Engine<B> {
    /// An engine on `backend` over the checkpoint in `dir`.
    pub fn from_dir_on(backend: Arc<B>, dir: &Path, mut config: EngineConfig) -> Result<Self> {
        check_before_load(&config, &*backend)?;
        if config.tokens.is_none() {
            config.tokens = tokens_from_config_file(&dir.join("config.json"))?;
        }
        let thinker = Arc::new(Thinker::from_dir_as(&*backend, dir, config.dtype)?);
        let speech = match config.speech && SpeechStage::<B>::in_checkpoint(dir)? {
            true => Some(SpeechStage::from_dir(Arc::clone(&backend), Arc::clone(&thinker), dir)?),
            false => None,
        };
        Self::with_speech(backend, thinker, config, speech)
    }

    /// An engine over a loaded thinker (several engines may share one).
    pub fn new(backend: Arc<B>, thinker: Arc<Thinker<B>>, config: EngineConfig) -> Result<Self> {
        Self::with_speech(backend, thinker, config, None)
    }

    /// [`Engine::new`] with a talker stage that speaks the replies of requests
    /// asking for audio; the thinker then also keeps the layer the talker
    /// reads (HF `accept_hidden_layer`) at item positions, the only rows of it
    /// the talker reads ([`ItemCapture`]; text rows come from the ids). Outputs
    /// hold it only where `config.capture` names it.
    pub fn with_speech(
        backend: Arc<B>, thinker: Arc<Thinker<B>>, config: EngineConfig, speech: Option<SpeechStage<B>>,
    ) -> Result<Self> {
        config.check_dtypes()?;
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
        let item_capture = speech
            .as_ref()
            .map(|stage| stage.accept_capture())
            .filter(|&accept| capture.index_of(accept).is_none())
            .map(|accept| ItemCapture::new(accept, model.hidden_size, config.scheduler.block_size));
        let index: Box<dyn PrefixIndex> = match config.index {
            IndexKind::Radix => {
                Box::new(RadixIndex::new(RadixConfig { block_size: config.scheduler.block_size })?)
            }
            IndexKind::HashChain => Box::new(HashChainIndex::new(config.scheduler.block_size)?),
        };
        // Every request is checked against this model (vocabulary, widths, DeepStack
        // levels, context, tenant), so the runner trusts the batches: by preparation,
        // and by the scheduler for what it appends, both reading this one set.
        let mut checks = RequestChecks::default().with_model(ModelShape::of(&model));
        if let Some(max) = model.max_position_embeddings {
            checks = checks.with_max_context(max);
        }
        if let Some(tenants) = &config.known_tenants {
            checks = checks.with_known_tenants(tenants.iter().copied());
        }
        let checks = Arc::new(checks);
        let sched = Scheduler::new(config.scheduler, index)?.with_checks(Arc::clone(&checks));
        let runner = ModelRunner::new(backend, thinker, capture)?.with_kv_dtype(config.kv_dtype);
        let pages = runner.alloc_pages(config.scheduler.num_blocks, config.scheduler.block_size)?;
        let spec = runner.backend().pages_spec(&pages);
        let tier = tier::open(
            &config,
            runner.backend(),
            runner.thinker().identity(),
            runner.capture(),
            item_capture.as_ref(),
            &spec,
        )?;
        let sched = match &tier {
            Some(t) => sched.with_tier(
                Arc::clone(&t.writer),
                FleetHasher::new(&config.fingerprint_key),
                Medium::of_backend(runner.backend().name()),
            )?,
            None => sched,
        };
        // Last, so a failure above does not wait out a publisher's linger.
        let (sched, publisher) = kv_events::start(sched, &config, runner.backend().name())?;
        let tokens = config.tokens.clone().unwrap_or_else(OmniTokens::qwen3_omni);
        let fingerprinter = Fingerprinter::new(
            config.fingerprint_key.clone(),
            config.fingerprint_threads,
            config.validation,
        )?;
        let position_kind =
            if model.mrope_section.is_some() { PositionKind::Mrope } else { PositionKind::Linear };
        let preprocessor = Preprocessor::new(fingerprinter, tokens).with_positions(position_kind);
        let encoder_cache = EncoderCache::new(config.encoder_cache_bytes);
        let speech_checks = speech
            .as_ref()
            .map(|s| s.checks().with_pool(config.talker_cache.block_size, config.talker_cache.num_blocks));
        let talkers = match speech {
            Some(stage) => {
                let fingerprinter = Fingerprinter::new(config.fingerprint_key.clone(), 1, config.validation)?;
                let tokens = preprocessor.tokens().clone();
                let mut talkers = talk::Talkers::new(
                    stage,
                    config.talker_cache,
                    fingerprinter,
                    tokens,
                    config.audio_yield,
                )?;
                let (thinker, talker) = (runner.thinker().identity(), talkers.stage().talker().identity());
                let writer = tier::open_talker(&config, thinker, talker, &talkers.pages_spec())?;
                if let (Some(writer), Some(t)) = (writer, &tier) {
                    talkers.attach_tier(
                        writer,
                        FleetHasher::new(&config.fingerprint_key),
                        t.load_seconds.clone(),
                    );
                }
                Some(talkers)
            }
            None => None,
        };
        let preparer = Preparer::new(preprocessor, checks, config.cache, encoder_cache, speech_checks);
        Ok(Engine {
            config,
            runner,
            pages,
            item_capture,
            sched,
            preparer: Arc::new(preparer),
            finished: 0,
            pending: FxHashMap::default(),
            publisher,
            latencies: metrics::Latencies::default(),
            talkers,
            tier,
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
        self.preparer.tokens()
    }

    /// The runner (its thinker and backend), e.g. for an uncached reference run.
    pub fn runner(&self) -> &ModelRunner<B> {
        &self.runner
    }

    /// Encoder outputs by item fingerprint: items found here need no embeddings.
    /// Locked only briefly by preparation; do not hold it across engine calls.
    pub fn encoder_cache(&self) -> std::sync::MutexGuard<'_, EncoderCache> {
        self.preparer.encoder_cache()
    }

    /// The encoder for items that bring no embeddings, miss the encoder cache
    /// and whose request names no encoder of its own; `None` removes it.
    pub fn set_encoder(&mut self, encoder: Option<SharedEncoder>) {
        self.preparer.set_encoder(encoder);
    }

    /// The checkpoint's eos ids: a generation's stop ids unless it names its own.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.model_config().eos_token_ids
    }

    /// Counters of the scheduler, index and encoder cache.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            sched: self.sched.stats(),
            encoder_cache_hits: self.preparer.encoder_cache().hits(),
            encoder_calls: self.preparer.encoder_calls(),
            finished: self.finished,
            talker: self.talkers.as_ref().map(talk::Talkers::cache_stats),
            tier: self.tier_stats(),
            item_capture: self
                .item_capture
                .as_ref()
                .map(|items| ItemCaptureStats { rows: items.len(), bytes: items.bytes() }),
        }
    }

    /// The engine's metrics in Prometheus text format: prefix-cache queries
    /// and hits in prompt tokens, preemptions, dropped KV events, running and
    /// waiting requests, KV-cache usage, TTFT and inter-token latency
    /// histograms (names and meanings follow vLLM's, prefixed `omniprefix_`).
    ///
    /// ```
    /// use omniprefix::engine::{Engine, EngineConfig, Request};
    /// use omniprefix::model::Config;
    /// use omniprefix::sched::SchedulerConfig;
    ///
    /// let mut engine = Engine::random(Config::tiny_qwen3(32, 2, 4, 2, 600), 1, EngineConfig { scheduler: SchedulerConfig { block_size: 4, ..Default::default() }, ..Default::default() })?;
    /// engine.run(Request::text((0..10).collect()))?;
    /// engine.run(Request::text((0..14).collect()))?;
    /// let text = engine.metrics()?;
    /// assert!(text.contains("omniprefix_prefix_cache_queries_total 24\n"));
    /// assert!(text.contains("omniprefix_prefix_cache_hits_total 10\n"));
    /// assert!(text.contains("omniprefix_time_to_first_token_seconds_count 2\n"));
    /// # Ok::<(), omniprefix::Error>(())
    /// ```
    pub fn metrics(&self) -> Result<String> {
        let stats = self.stats();
        let kv_events_dropped = self.kv_events_stats().map(|s| s.dropped);
        let reading = metrics::Reading {
            stats: &stats,
            num_blocks: self.config.scheduler.num_blocks,
            kv_events_dropped,
            tier_load_seconds: self.tier.as_ref().map(|t| &t.load_seconds),
        };
        metrics::render(&self.latencies, reading)
    }

    /// Checks the scheduler's pool, index and request bookkeeping; `Err` names
    /// the first broken invariant.
    pub fn validate(&self) -> std::result::Result<(), InvariantViolation> {
        self.sched.validate()
    }

    /// Moves the engine onto its own thread, which steps while anything is pending.
    pub fn serve(self, options: ServedOptions) -> Result<ServedEngine>
    where
        B: 'static,
    {
        ServedEngine::start(self, options)
    }
}

/// A checkpoint's special ids: read, with the rest of `config.json`, by [`crate::model::config::hf`].
pub use crate::model::config::{tokens_from_config_file, tokens_from_config_json};

/// Time as fractional milliseconds (for reports).
pub fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
