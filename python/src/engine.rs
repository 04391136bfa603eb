//! `omniprefix.Engine`: the engine behind a mutex, run with the GIL released.
//!
//! Lock order: the engine's mutex is only ever taken with the GIL released
//! (inside `Python::detach`), and an encoder callable re-attaches the GIL while
//! the mutex is held. A thread that waits for the mutex therefore never holds
//! the GIL, so two threads cannot deadlock on the pair.

use std::collections::{HashMap, VecDeque};
use std::mem::ManuallyDrop;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use omniprefix::backend::auto::{SelectedBackend, select};
use omniprefix::backend::{Backend, cpu::CpuBackend, wgpu::WgpuBackend};
use omniprefix::batch::RequestId;
use omniprefix::canon::ItemIdentity;
use omniprefix::engine::{Engine, EngineConfig, EncoderOutput, Event, PlaceholderForm, PrefillRequest, tokens_from_config_json};
use omniprefix::error::{RequestError, SchedError};
use omniprefix::model::{Config, Thinker};
use omniprefix::sample::SamplingParams;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::arrays::{capture_key, float_levels, float_matrix, row_dict};
use crate::errors::{InternalError, guard, to_py};
use crate::item::{BorrowedItems, Item};
use crate::options::EngineOptions;
use crate::outputs::{PyGeneration, PyOutput};

/// An engine on whichever backend was opened.
pub enum AnyEngine {
    Cpu(Engine<CpuBackend>),
    Wgpu(Engine<WgpuBackend>),
}

/// Runs `$body` with `$e` bound to the concrete engine.
macro_rules! on_engine {
    ($any:expr, $e:ident => $body:expr) => {
        match $any {
            AnyEngine::Cpu($e) => $body,
            AnyEngine::Wgpu($e) => $body,
        }
    };
}

/// What the mutex guards: the engine and the events of requests whose
/// Python caller has not taken them yet.
struct State {
    engine: AnyEngine,
    queues: HashMap<RequestId, VecDeque<Event>>,
    /// Set when a panic left the engine in an unknown state.
    broken: Option<String>,
}

/// Facts about the engine that never change, readable without the lock.
struct Info {
    capture: Vec<String>,
    eos_token_ids: Vec<u32>,
    hidden_size: usize,
    num_layers: usize,
    vocab_size: usize,
    block_size: usize,
    backend: String,
    dtype: &'static str,
    /// The KV events PUB and replay endpoints as bound, when events are published.
    kv_endpoints: Option<(String, Option<String>)>,
}

/// A thinker engine: prefix-cached prefill and generation over one checkpoint.
#[pyclass(frozen, name = "Engine", module = "omniprefix")]
pub struct PyEngine {
    /// Dropped by hand, with the GIL released (see the `Drop` impl).
    state: ManuallyDrop<Mutex<State>>,
    /// Requests whose stream was dropped unfinished; aborted at the next call.
    orphans: Mutex<Vec<RequestId>>,
    info: Info,
}

impl Drop for PyEngine {
    /// Dropping an engine closes its KV events publisher, which first keeps its
    /// sockets open for `kv_linger_s` (late subscribers replay then): other
    /// Python threads run meanwhile, as during any engine call.
    fn drop(&mut self) {
        // SAFETY: `state` is taken once, here, and `self` is not used after.
        let state = unsafe { ManuallyDrop::take(&mut self.state) };
        Python::attach(|py| py.detach(move || drop(state)));
    }
}

/// Sampling settings of `generate` / `stream`, as Python passed them.
struct Sampling {
    max_tokens: usize,
    temperature: f32,
    top_k: Option<usize>,
    top_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<Vec<u32>>,
    ignore_eos: bool,
}

impl Sampling {
    fn params(self) -> SamplingParams {
        SamplingParams {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
            stop: self.stop,
            ignore_eos: self.ignore_eos,
            ..SamplingParams::greedy(self.max_tokens)
        }
    }
}

pub(crate) fn placeholder_form(name: &str) -> PyResult<PlaceholderForm> {
    match name {
        "unexpanded" => Ok(PlaceholderForm::Unexpanded),
        "expanded" => Ok(PlaceholderForm::Expanded),
        "audio_in_video" => Ok(PlaceholderForm::UnexpandedAudioInVideo),
        other => Err(PyValueError::new_err(format!(
            "placeholders {other:?}: expected \"unexpanded\", \"expanded\" or \"audio_in_video\""
        ))),
    }
}

/// Calls a Python encoder for an item that missed the encoder cache. Its
/// exception is kept and re-raised as is once the engine call returns.
struct PyEncoder<'a> {
    callable: Option<Py<PyAny>>,
    items: Vec<Py<Item>>,
    raised: &'a mut Option<PyErr>,
}

impl PyEncoder<'_> {
    fn encode(&mut self, index: usize, _identity: &ItemIdentity) -> omniprefix::Result<EncoderOutput> {
        let missing = || RequestError::MissingEmbeddings { item: index }.into();
        let (Some(callable), Some(item)) = (&self.callable, self.items.get(index)) else { return Err(missing()) };
        Python::attach(|py| {
            let result = callable.call1(py, (item.clone_ref(py),)).and_then(|out| encoder_output(out.bind(py), index));
            result.map_err(|e| {
                *self.raised = Some(e);
                missing()
            })
        })
    }
}

/// `embeddings` or `(embeddings, deepstack)` as an encoder returned them.
fn encoder_output(out: &Bound<'_, PyAny>, index: usize) -> PyResult<EncoderOutput> {
    let what = format!("the encoder's output for item {index}");
    if let Ok(pair) = out.cast::<PyTuple>() {
        if pair.len() != 2 {
            return Err(PyTypeError::new_err(format!("{what}: expected embeddings or (embeddings, deepstack)")));
        }
        let embeddings = float_matrix(&pair.get_item(0)?, &what)?;
        let deepstack = float_levels(&pair.get_item(1)?, &format!("{what}, deepstack"))?;
        return Ok(EncoderOutput { embeddings, deepstack });
    }
    Ok(float_matrix(out, &what)?.into())
}

impl PyEngine {
    fn open(options: EngineOptions, build: impl FnOnce(SelectedBackend, EngineConfig) -> omniprefix::Result<AnyEngine>) -> PyResult<Self> {
        let selection = guard(|| select(options.backend))?;
        let reason = selection.reason.clone();
        let engine = guard(|| build(selection.backend, options.config))?;
        let info = on_engine!(&engine, e => {
            let model = e.model_config();
            Info {
                capture: e.capture().points().iter().map(|p| capture_key(*p)).collect(),
                eos_token_ids: e.eos_token_ids().to_vec(),
                hidden_size: model.hidden_size,
                num_layers: model.num_hidden_layers,
                vocab_size: model.vocab_size,
                block_size: e.config().block_size,
                backend: reason,
                dtype: e.weight_dtype().name(),
                kv_endpoints: e.kv_events_endpoints().map(|(pub_at, replay_at)| (pub_at.to_string(), replay_at.map(str::to_string))),
            }
        });
        Ok(PyEngine {
            state: ManuallyDrop::new(Mutex::new(State { engine, queues: HashMap::new(), broken: None })),
            orphans: Mutex::new(Vec::new()),
            info,
        })
    }

    /// Locks the engine (call with the GIL released), aborting orphaned streams first.
    fn lock(&self) -> PyResult<MutexGuard<'_, State>> {
        let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(why) = &state.broken {
            return Err(InternalError::new_err(format!("the engine is unusable after an internal panic: {why}")));
        }
        let orphans = std::mem::take(&mut *self.orphans.lock().unwrap_or_else(|p| p.into_inner()));
        for id in orphans {
            state.queues.remove(&id);
            // Already finished requests are unknown to the engine: nothing to abort.
            let _ = on_engine!(&mut state.engine, e => e.abort(id));
        }
        Ok(state)
    }

    /// Runs `f` on the locked engine with the GIL released; a panic marks it broken.
    fn with_state<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut State) -> PyResult<T> + Send) -> PyResult<T> {
        py.detach(|| {
            let mut state = self.lock()?;
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut state))) {
                Ok(result) => result,
                Err(panic) => {
                    let message = crate::errors::panic_message(&*panic);
                    state.broken = Some(message.clone());
                    Err(InternalError::new_err(format!("internal panic: {message}")))
                }
            }
        })
    }

    /// Submits one request (with the GIL released) and registers its event queue.
    fn submit(
        &self,
        py: Python<'_>,
        request: PrefillRequest<'_>,
        params: Option<SamplingParams>,
        encoder: Option<Py<PyAny>>,
        items: &BorrowedItems<'_>,
    ) -> PyResult<RequestId> {
        let items: Vec<Py<Item>> = items.items().iter().map(|i| i.clone().unbind()).collect();
        let mut raised = None;
        let submitted = self.with_state(py, |state| {
            let mut encoder = PyEncoder { callable: encoder, items, raised: &mut raised };
            let encode = |index: usize, identity: &ItemIdentity| encoder.encode(index, identity);
            let id = on_engine!(&mut state.engine, e => match params {
                Some(params) => e.submit_generate_with_encoder(request, params, encode),
                None => e.submit_with_encoder(request, encode),
            });
            let id = id.map_err(to_py)?;
            state.queues.insert(id, VecDeque::new());
            Ok(id)
        });
        match raised {
            Some(error) => Err(error),
            None => submitted,
        }
    }

    /// The next event of request `id`, stepping the engine as needed (GIL released).
    fn next_event(&self, py: Python<'_>, id: RequestId) -> PyResult<Event> {
        self.with_state(py, |state| loop {
            let Some(queue) = state.queues.get_mut(&id) else {
                return Err(to_py(SchedError::UnknownRequest { id }.into()));
            };
            if let Some(event) = queue.pop_front() {
                if matches!(event, Event::Prefilled(_) | Event::Generated(_)) {
                    state.queues.remove(&id);
                }
                return Ok(event);
            }
            let pending = on_engine!(&state.engine, e => e.has_pending());
            if !pending {
                state.queues.remove(&id);
                return Err(InternalError::new_err(format!(
                    "request {id} is no longer pending (an earlier engine failure aborted it)"
                )));
            }
            let events = on_engine!(&mut state.engine, e => guard(|| e.step()))?;
            for event in events {
                if let Some(queue) = state.queues.get_mut(&event.request()) {
                    queue.push_back(event);
                }
            }
        })
    }

    /// Aborts request `id` now (GIL released); unknown ids are ignored.
    fn abort(&self, py: Python<'_>, id: RequestId) -> PyResult<()> {
        self.with_state(py, |state| {
            if state.queues.remove(&id).is_some() {
                let _ = on_engine!(&mut state.engine, e => e.abort(id));
            }
            Ok(())
        })
    }

    /// Defers an abort to the next call (for a stream dropped with the GIL held).
    fn abort_later(&self, id: RequestId) {
        self.orphans.lock().unwrap_or_else(|p| p.into_inner()).push(id);
    }

    #[allow(clippy::too_many_arguments)]
    fn submit_generation(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        items: Option<&Bound<'_, PyAny>>,
        sampling: Sampling,
        tenant: u64,
        encoder: Option<Py<PyAny>>,
        placeholders: &str,
    ) -> PyResult<RequestId> {
        let ids = crate::arrays::token_ids(token_ids)?;
        let borrowed = BorrowedItems::from_py(items)?;
        let request = PrefillRequest { tenant, token_ids: ids, placeholders: placeholder_form(placeholders)?, items: borrowed.inputs() };
        self.submit(py, request, Some(sampling.params()), encoder, &borrowed)
    }
}

/// A `config.json` given as a dict (argument `what`), as JSON text.
pub(crate) fn config_json(py: Python<'_>, config: &Bound<'_, PyAny>, what: &str) -> PyResult<String> {
    if !config.is_instance_of::<PyDict>() {
        return Err(PyTypeError::new_err(format!("{what} must be a dict (a config.json)")));
    }
    py.import("json")?.call_method1("dumps", (config,))?.extract()
}

/// A checkpoint folder as given (str or os.PathLike).
fn checkpoint_dir(path: &Bound<'_, PyAny>) -> PyResult<PathBuf> {
    path.extract::<PathBuf>().map_err(|_| PyTypeError::new_err("path must be a str or os.PathLike"))
}

#[pymethods]
impl PyEngine {
    /// An engine over the Hugging Face checkpoint in `path` (`config.json` + safetensors).
    #[staticmethod]
    #[pyo3(signature = (path, **options))]
    fn from_dir(py: Python<'_>, path: &Bound<'_, PyAny>, options: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let dir = checkpoint_dir(path)?;
        let mut options = EngineOptions::parse(options)?;
        let model = guard(|| Config::from_dir(&dir))?;
        options.config.capture = options.capture.resolve(model.num_hidden_layers);
        py.detach(|| {
            Self::open(options, |backend, config| {
                Ok(match backend {
                    SelectedBackend::Cpu(cpu) => AnyEngine::Cpu(Engine::from_dir_on(Arc::new(cpu), &dir, config)?),
                    SelectedBackend::Wgpu(gpu) => AnyEngine::Wgpu(Engine::from_dir_on(Arc::new(gpu), &dir, config)?),
                })
            })
        })
    }

    /// An engine over a model with seeded random weights; `config` is a `config.json` dict.
    #[staticmethod]
    #[pyo3(signature = (config, seed, **options))]
    fn random(py: Python<'_>, config: &Bound<'_, PyAny>, seed: u64, options: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let json = config_json(py, config, "config")?;
        let mut options = EngineOptions::parse(options)?;
        let model = guard(|| Config::from_json_str(&json))?;
        options.config.capture = options.capture.resolve(model.num_hidden_layers);
        // Special ids from the dict, as `from_dir` reads them from its config.json.
        options.config.tokens = guard(|| tokens_from_config_json(&json))?;
        py.detach(|| {
            Self::open(options, |backend, config| {
                fn random_on<B: Backend>(backend: B, model: Config, seed: u64, config: EngineConfig) -> omniprefix::Result<Engine<B>> {
                    let backend = Arc::new(backend);
                    let thinker = Arc::new(Thinker::random(&*backend, model, seed)?);
                    Engine::new(backend, thinker, config)
                }
                Ok(match backend {
                    SelectedBackend::Cpu(cpu) => AnyEngine::Cpu(random_on(cpu, model, seed, config)?),
                    SelectedBackend::Wgpu(gpu) => AnyEngine::Wgpu(random_on(gpu, model, seed, config)?),
                })
            })
        })
    }

    /// Full hidden states of a prompt (cached rows included) and its last logits.
    #[pyo3(signature = (token_ids, items=None, *, tenant=0, encoder=None, placeholders="unexpanded"))]
    fn prefill(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        items: Option<&Bound<'_, PyAny>>,
        tenant: u64,
        encoder: Option<Py<PyAny>>,
        placeholders: &str,
    ) -> PyResult<PyOutput> {
        let ids = crate::arrays::token_ids(token_ids)?;
        let borrowed = BorrowedItems::from_py(items)?;
        let request = PrefillRequest { tenant, token_ids: ids, placeholders: placeholder_form(placeholders)?, items: borrowed.inputs() };
        let id = self.submit(py, request, None, encoder, &borrowed)?;
        match self.next_event(py, id)? {
            Event::Prefilled(output) => PyOutput::new(py, output),
            _ => Err(InternalError::new_err(format!("request {id}: a prefill produced generation events"))),
        }
    }

    /// Generates up to `max_tokens` tokens; returns tokens and the hidden rows of every position that ran.
    #[pyo3(signature = (token_ids, items=None, *, max_tokens, temperature=0.0, top_k=None, top_p=None, seed=None,
                        stop=None, ignore_eos=false, tenant=0, encoder=None, placeholders="unexpanded"))]
    #[allow(clippy::too_many_arguments)]
    fn generate(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        items: Option<&Bound<'_, PyAny>>,
        max_tokens: usize,
        temperature: f32,
        top_k: Option<usize>,
        top_p: Option<f32>,
        seed: Option<u64>,
        stop: Option<Vec<u32>>,
        ignore_eos: bool,
        tenant: u64,
        encoder: Option<Py<PyAny>>,
        placeholders: &str,
    ) -> PyResult<PyGeneration> {
        let sampling = Sampling { max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos };
        let id = self.submit_generation(py, token_ids, items, sampling, tenant, encoder, placeholders)?;
        loop {
            match self.next_event(py, id)? {
                Event::Generated(generation) => return PyGeneration::new(py, generation),
                Event::Token(_) => {}
                Event::Prefilled(_) => return Err(InternalError::new_err(format!("request {id}: a generation ended as a prefill"))),
            }
        }
    }

    /// `generate`, yielding `(token, {capture: row})` as each token is sampled.
    #[pyo3(signature = (token_ids, items=None, *, max_tokens, temperature=0.0, top_k=None, top_p=None, seed=None,
                        stop=None, ignore_eos=false, tenant=0, encoder=None, placeholders="unexpanded"))]
    #[allow(clippy::too_many_arguments)]
    fn stream(
        slf: &Bound<'_, Self>,
        token_ids: &Bound<'_, PyAny>,
        items: Option<&Bound<'_, PyAny>>,
        max_tokens: usize,
        temperature: f32,
        top_k: Option<usize>,
        top_p: Option<f32>,
        seed: Option<u64>,
        stop: Option<Vec<u32>>,
        ignore_eos: bool,
        tenant: u64,
        encoder: Option<Py<PyAny>>,
        placeholders: &str,
    ) -> PyResult<Stream> {
        let sampling = Sampling { max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos };
        let id = slf.get().submit_generation(slf.py(), token_ids, items, sampling, tenant, encoder, placeholders)?;
        Ok(Stream { engine: slf.clone().unbind(), id, generation: None, done: false })
    }

    /// Counters: queries, hits, hit_tokens, evicted_blocks, preemptions, encoder_cache_hits, finished.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.with_state(py, |state| Ok(on_engine!(&state.engine, e => e.stats())))?;
        let dict = PyDict::new(py);
        dict.set_item("queries", stats.queries)?;
        dict.set_item("hits", stats.hits)?;
        dict.set_item("hit_tokens", stats.hit_tokens)?;
        dict.set_item("evicted_blocks", stats.evicted_blocks)?;
        dict.set_item("preemptions", stats.preemptions)?;
        dict.set_item("encoder_cache_hits", stats.encoder_cache_hits)?;
        dict.set_item("finished", stats.finished)?;
        Ok(dict)
    }

    /// Checks the scheduler's pool, index and bookkeeping; raises `InternalError` naming a broken invariant.
    fn validate(&self, py: Python<'_>) -> PyResult<()> {
        self.with_state(py, |state| on_engine!(&state.engine, e => e.validate()).map_err(|v| to_py(v.into())))
    }

    /// Drops every cached block and publishes `AllBlocksCleared`; the number of blocks freed.
    /// Refused (`CacheError`, nothing changed) while requests are pending.
    fn reset_cache(&self, py: Python<'_>) -> PyResult<usize> {
        self.with_state(py, |state| on_engine!(&mut state.engine, e => e.reset_cache()).map_err(to_py))
    }

    /// The hashes of the published full blocks the index holds, ascending (empty without `kv_events`).
    fn cached_block_hashes(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        self.with_state(py, |state| Ok(on_engine!(&state.engine, e => e.cached_block_hashes())))
    }

    /// The publisher's counters (batches, published, dropped, replays, malformed_replays), or None.
    fn kv_events_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let stats = self.with_state(py, |state| Ok(on_engine!(&state.engine, e => e.kv_events_stats())))?;
        stats.map(|s| pythonize::pythonize(py, &s).map_err(|e| InternalError::new_err(e.to_string()))).transpose()
    }

    /// The KV events PUB endpoint as bound (port 0 resolved), or None.
    #[getter]
    fn kv_events_endpoint(&self) -> Option<String> {
        self.info.kv_endpoints.as_ref().map(|(pub_at, _)| pub_at.clone())
    }

    /// The KV events replay (ROUTER) endpoint as bound, or None.
    #[getter]
    fn kv_replay_endpoint(&self) -> Option<String> {
        self.info.kv_endpoints.as_ref().and_then(|(_, replay_at)| replay_at.clone())
    }

    /// Captured points, in page order (`hidden.<L>`, `hidden.final`).
    #[getter]
    fn capture(&self) -> Vec<String> {
        self.info.capture.clone()
    }

    /// The checkpoint's eos ids (default stop ids of a generation).
    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.info.eos_token_ids.clone()
    }

    #[getter]
    fn hidden_size(&self) -> usize {
        self.info.hidden_size
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.info.num_layers
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.info.vocab_size
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.info.block_size
    }

    /// The dtype the weight matrices are stored in (`"auto"` resolved).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.info.dtype
    }

    /// The backend opened, and why (`"cpu (asked for cpu)"`, `"wgpu on <adapter> (...)"`).
    #[getter]
    fn backend(&self) -> String {
        self.info.backend.clone()
    }

    fn __repr__(&self) -> String {
        format!(
            "Engine(layers={}, hidden={}, vocab={}, block_size={}, backend={:?})",
            self.info.num_layers, self.info.hidden_size, self.info.vocab_size, self.info.block_size, self.info.backend
        )
    }
}

/// The tokens of one generation as they are sampled: iterate for
/// `(token, {capture: row})`; `.generation` holds the result once it ends.
/// Closing (or dropping) it early aborts the request.
#[pyclass(module = "omniprefix")]
pub struct Stream {
    engine: Py<PyEngine>,
    id: RequestId,
    generation: Option<Py<PyGeneration>>,
    done: bool,
}

#[pymethods]
impl Stream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<(u32, Py<PyDict>)>> {
        if self.done {
            return Ok(None);
        }
        let engine = self.engine.get();
        let event = engine.next_event(py, self.id);
        let event = event.inspect_err(|_| self.done = true)?;
        match event {
            Event::Token(token) => Ok(Some((token.token, row_dict(py, token.hidden)?.unbind()))),
            Event::Generated(generation) => {
                self.done = true;
                self.generation = Some(Py::new(py, PyGeneration::new(py, generation)?)?);
                Ok(None)
            }
            Event::Prefilled(_) => {
                self.done = true;
                Err(InternalError::new_err(format!("request {}: a generation ended as a prefill", self.id)))
            }
        }
    }

    /// The finished generation (None until the stream is exhausted).
    #[getter]
    fn generation(&self, py: Python<'_>) -> Option<Py<PyGeneration>> {
        self.generation.as_ref().map(|g| g.clone_ref(py))
    }

    /// Aborts the generation if it has not finished; its blocks go back, nothing of it is cached.
    fn close(&mut self, py: Python<'_>) -> PyResult<()> {
        if !self.done {
            self.done = true;
            self.engine.get().abort(py, self.id)?;
        }
        Ok(())
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if !self.done {
            self.engine.get().abort_later(self.id);
        }
    }
}
