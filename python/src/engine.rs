//! `omniprefix.Engine`: a served engine (the core steps on its own thread)
//! behind Python calls that release the GIL while they wait.
//!
//! A call prepares its request on the calling thread with the GIL released
//! (fingerprints, prompt, checks); an encoder callable re-attaches the GIL
//! only while it runs. Nothing here holds a lock across the engine's steps, so
//! a slow encoder on one thread never stalls another thread's stream, and a
//! stream that nobody reads keeps generating (up to its buffer, 256 events).

use std::mem::ManuallyDrop;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use omniprefix::backend::Backend;
use omniprefix::backend::auto::{SelectedBackend, select};
use omniprefix::canon::ItemIdentity;
use omniprefix::engine::{
    Encoder, EncoderOutput, Engine, EngineConfig, Output, PlaceholderForm, Request, RequestHandle,
    ServedEngine, ServedOptions, Task, tokens_from_config_json,
};
use omniprefix::error::RequestError;
use omniprefix::model::{Config, Thinker};
use omniprefix::sample::{SamplingParams, TalkerSampling};
use omniprefix::speech::SpeechOptions;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::arrays::{float_levels, float_matrix};
use crate::errors::{InternalError, guard, to_py};
use crate::item::{BorrowedItems, Item};
use crate::options::EngineOptions;
use crate::outputs::{PyGeneration, PyOutput};
use crate::pump::EventPump;
use crate::stream::Stream;

/// A thinker engine: prefix-cached prefill and generation over one checkpoint.
///
/// The model's facts (widths, special ids, sizes) are the served engine's, read
/// without its loop; only the backend's name is the extension's own.
#[pyclass(frozen, name = "Engine", module = "omniprefix")]
pub struct PyEngine {
    /// Dropped by hand, with the GIL released (see the `Drop` impl).
    served: ManuallyDrop<ServedEngine>,
    /// The backend opened, and why (`"cpu (asked for cpu)"`, `"wgpu on <adapter> (...)"`).
    #[pyo3(get)]
    backend: String,
    /// The KV events PUB and replay endpoints as bound, when events are published.
    kv_endpoints: Option<(String, Option<String>)>,
}

impl Drop for PyEngine {
    /// Dropping an engine stops its loop (pending streams end with an error)
    /// and closes its KV events publisher, which first keeps its sockets open
    /// for `kv_linger_s`: other Python threads run meanwhile.
    fn drop(&mut self) {
        // SAFETY: `served` is taken once, here, and `self` is not used after.
        let served = unsafe { ManuallyDrop::take(&mut self.served) };
        Python::attach(|py| py.detach(move || drop(served)));
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
/// exception is kept and re-raised as is once preparation returns.
struct PyEncoder<'a> {
    callable: Py<PyAny>,
    items: &'a [Py<Item>],
    raised: &'a Mutex<Option<PyErr>>,
}

impl Encoder for PyEncoder<'_> {
    fn encode(&self, index: usize, _identity: &ItemIdentity) -> omniprefix::Result<EncoderOutput> {
        let missing = || RequestError::MissingEmbeddings { item: index }.into();
        let Some(item) = self.items.get(index) else { return Err(missing()) };
        Python::attach(|py| {
            let result = self
                .callable
                .call1(py, (item.clone_ref(py),))
                .and_then(|out| encoder_output(out.bind(py), index));
            result.map_err(|e| {
                *self.raised.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                missing()
            })
        })
    }
}

/// `embeddings` or `(embeddings, deepstack)` as an encoder returned them. NaN
/// or Inf is left to the engine, whose typed error names the item, part and element.
fn encoder_output(out: &Bound<'_, PyAny>, index: usize) -> PyResult<EncoderOutput> {
    let what = format!("the encoder's output for item {index}");
    if let Ok(pair) = out.cast::<PyTuple>() {
        if pair.len() != 2 {
            return Err(PyTypeError::new_err(format!(
                "{what}: expected embeddings or (embeddings, deepstack)"
            )));
        }
        let embeddings = float_matrix(&pair.get_item(0)?, &what, false)?;
        let deepstack = float_levels(&pair.get_item(1)?, &format!("{what}, deepstack"), false)?;
        return Ok(EncoderOutput { embeddings, deepstack });
    }
    Ok(float_matrix(out, &what, false)?.into())
}

/// The sampling keywords of `generate` / `stream`, passed to the library's
/// `SamplingParams` as they are (unknown names are errors, missing ones take
/// its defaults); `max_tokens` is required, as it always was here.
fn sampling_params(sampling: Option<&Bound<'_, PyDict>>) -> PyResult<SamplingParams> {
    let missing = || PyTypeError::new_err("missing required keyword argument: 'max_tokens'");
    let sampling = sampling.ok_or_else(missing)?;
    if !sampling.contains("max_tokens")? {
        return Err(missing());
    }
    pythonize::depythonize::<SamplingParams>(sampling.as_any())
        .map_err(|e| crate::errors::RequestError::new_err(format!("sampling options: {e}")))
}

/// The talker's option names as Python spells them: `TalkerSampling`'s fields
/// (read from the library, so none is missed), `max_new_tokens` as `max_tokens`
/// like the thinker's.
fn talker_option_names() -> Vec<String> {
    let defaults = serde_json::to_value(TalkerSampling::default()).unwrap_or_default();
    let fields: Vec<String> = defaults.as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default();
    fields.into_iter().map(|k| if k == "max_new_tokens" { "max_tokens".into() } else { k }).collect()
}

/// The `talker` dict of a request: the library's `TalkerSampling`, keys as
/// [`talker_option_names`] spells them, missing ones taking its defaults (HF's).
/// Unknown keys are a `RequestError` naming them; ranges are the engine's check.
fn talker_sampling(talker: Option<&Bound<'_, PyDict>>) -> PyResult<TalkerSampling> {
    let Some(talker) = talker else { return Ok(TalkerSampling::default()) };
    let known = talker_option_names();
    let renamed = PyDict::new(talker.py());
    let mut unknown = Vec::new();
    for (key, value) in talker.iter() {
        let name: String =
            key.extract().map_err(|_| PyTypeError::new_err("talker option names must be str"))?;
        if !known.contains(&name) {
            unknown.push(format!("{name:?}"));
            continue;
        }
        let field = if name == "max_tokens" { "max_new_tokens" } else { name.as_str() };
        renamed.set_item(field, value)?;
    }
    if !unknown.is_empty() {
        return Err(crate::errors::RequestError::new_err(format!(
            "unknown talker option {}: the talker options are {}",
            unknown.join(", "),
            known.join(", ")
        )));
    }
    pythonize::depythonize::<TalkerSampling>(renamed.as_any())
        .map_err(|e| crate::errors::RequestError::new_err(format!("talker options: {e}")))
}

/// The speech keywords of `generate` / `stream`: `SpeechOptions` when `audio`,
/// else None (and then none of the others may be given).
fn speech_options(
    audio: bool, speaker: Option<String>, talker: Option<&Bound<'_, PyDict>>, first_chunk: Option<usize>,
    chunk: Option<usize>,
) -> PyResult<Option<SpeechOptions>> {
    if !audio {
        if speaker.is_some() || talker.is_some() || first_chunk.is_some() || chunk.is_some() {
            return Err(PyTypeError::new_err(
                "speaker, talker, audio_first_chunk and audio_chunk need audio=True",
            ));
        }
        return Ok(None);
    }
    let defaults = SpeechOptions::default();
    Ok(Some(SpeechOptions {
        speaker: speaker.unwrap_or(defaults.speaker),
        talker: talker_sampling(talker)?,
        first_chunk: first_chunk.unwrap_or(defaults.first_chunk),
        chunk: chunk.unwrap_or(defaults.chunk),
    }))
}

/// `max_position_embeddings` of the checkpoint in `model_dir`, read by the engine's
/// own config parser (what `Engine.context_len` says once it is loaded); None when
/// the checkpoint names none. For a process that runs no engine (the fleet's edge).
#[pyfunction]
pub fn checkpoint_context_len(model_dir: std::path::PathBuf) -> PyResult<Option<usize>> {
    Ok(Config::from_dir(&model_dir).map_err(to_py)?.max_position_embeddings)
}

impl PyEngine {
    fn open(
        options: EngineOptions, build: impl FnOnce(SelectedBackend, EngineConfig) -> omniprefix::Result<Self>,
    ) -> PyResult<Self> {
        let selection = guard(|| select(options.backend))?;
        let reason = selection.reason.clone();
        let mut engine = guard(|| build(selection.backend, options.config))?;
        engine.backend = reason;
        Ok(engine)
    }

    /// Prepares and submits one request with the GIL released (the encoder,
    /// if called, takes it back while it runs); returns its handle.
    fn submit(
        &self, py: Python<'_>, prompt: Prompt<'_>, task: Task, audio: Option<SpeechOptions>,
        encoder: Option<Py<PyAny>>, pump: Option<&EventPump>,
    ) -> PyResult<RequestHandle> {
        let ready = pump.map(EventPump::ready_sender);
        let Prompt { ids, borrowed, tenant, placeholders } = prompt;
        let items: Vec<Py<Item>> = borrowed.items().iter().map(|i| i.clone().unbind()).collect();
        let inputs = borrowed.inputs();
        let raised = Mutex::new(None);
        let served = &*self.served;
        let submitted = py.detach(|| {
            let mut request =
                Request { tenant, token_ids: ids, placeholders, items: inputs, task, encoder: None, audio };
            if let Some(callable) = encoder {
                request = request.with_encoder(PyEncoder { callable, items: &items, raised: &raised });
            }
            guard(|| {
                let prepared = served.prepare(request)?;
                match ready {
                    Some(ready) => served.submit_prepared_notify(prepared, ready),
                    None => served.submit_prepared(prepared),
                }
            })
        });
        match raised.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(error) => Err(error),
            None => submitted,
        }
    }
}

/// A request's prompt as Python passed it.
struct Prompt<'a> {
    ids: Vec<u32>,
    borrowed: BorrowedItems<'a>,
    tenant: u64,
    placeholders: PlaceholderForm,
}

impl<'a> Prompt<'a> {
    fn parse(
        token_ids: &Bound<'_, PyAny>, items: Option<&'a Bound<'a, PyAny>>, tenant: u64, placeholders: &str,
    ) -> PyResult<Self> {
        Ok(Prompt {
            ids: crate::arrays::token_ids(token_ids)?,
            borrowed: BorrowedItems::from_py(items)?,
            tenant,
            placeholders: placeholder_form(placeholders)?,
        })
    }
}

/// Reads a handle to its end with the GIL released.
fn wait(py: Python<'_>, handle: RequestHandle) -> PyResult<Output> {
    py.detach(|| handle.wait()).map_err(to_py)
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
    ///
    /// Options (keywords): block_size, num_blocks, capture, cache, backend, dtype,
    /// kv_dtype, fingerprint_key, validation, tenants, max_tokens_per_step,
    /// max_seqs_per_step, prefill_cap, fingerprint_threads, encoder_cache_bytes, kv_events,
    /// kv_replay, kv_topic, kv_buffer_steps, kv_linger_s (see docs/python.md).
    #[staticmethod]
    #[pyo3(signature = (path, **options))]
    fn from_dir(
        py: Python<'_>, path: &Bound<'_, PyAny>, options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let dir = checkpoint_dir(path)?;
        let mut options = EngineOptions::parse(options)?;
        let model = guard(|| Config::from_dir(&dir))?;
        options.config.capture = options.capture.resolve(model.num_hidden_layers);
        py.detach(|| {
            Self::open(options, |backend, config| match backend {
                SelectedBackend::Cpu(cpu) => served(Engine::from_dir_on(Arc::new(cpu), &dir, config)?),
                SelectedBackend::Wgpu(gpu) => served(Engine::from_dir_on(Arc::new(gpu), &dir, config)?),
            })
        })
    }

    /// An engine over a model with seeded random weights; `config` is a
    /// `config.json` dict. Takes the options of `from_dir`.
    #[staticmethod]
    #[pyo3(signature = (config, seed, **options))]
    fn random(
        py: Python<'_>, config: &Bound<'_, PyAny>, seed: u64, options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let json = config_json(py, config, "config")?;
        let mut options = EngineOptions::parse(options)?;
        let model = guard(|| Config::from_json_str(&json))?;
        options.config.capture = options.capture.resolve(model.num_hidden_layers);
        // Special ids from the dict, as `from_dir` reads them from its config.json.
        options.config.tokens = guard(|| tokens_from_config_json(&json))?;
        py.detach(|| {
            Self::open(options, |backend, config| {
                fn random_on<B: Backend + 'static>(
                    backend: B, model: Config, seed: u64, config: EngineConfig,
                ) -> omniprefix::Result<PyEngine>
                where
                    Engine<B>: Send,
                {
                    let backend = Arc::new(backend);
                    let thinker = Arc::new(Thinker::random(&*backend, model, seed)?);
                    served(Engine::new(backend, thinker, config)?)
                }
                match backend {
                    SelectedBackend::Cpu(cpu) => random_on(cpu, model, seed, config),
                    SelectedBackend::Wgpu(gpu) => random_on(gpu, model, seed, config),
                }
            })
        })
    }

    /// Full hidden states of a prompt (cached rows included) and its last logits.
    /// `encoder(item) -> embeddings | (embeddings, deepstack)` runs for items
    /// that bring no embeddings and miss the encoder cache.
    #[pyo3(signature = (token_ids, items=None, *, tenant=0, encoder=None, placeholders="unexpanded"))]
    fn prefill(
        &self, py: Python<'_>, token_ids: &Bound<'_, PyAny>, items: Option<&Bound<'_, PyAny>>, tenant: u64,
        encoder: Option<Py<PyAny>>, placeholders: &str,
    ) -> PyResult<PyOutput> {
        let prompt = Prompt::parse(token_ids, items, tenant, placeholders)?;
        let handle = self.submit(py, prompt, Task::Prefill, None, encoder, None)?;
        PyOutput::new(py, wait(py, handle)?)
    }

    /// Generates tokens; returns them with the hidden rows of every position
    /// that ran. Sampling keywords go to `SamplingParams` as they are:
    /// max_tokens (required), temperature (0: greedy), top_k, top_p, seed,
    /// stop, ignore_eos, run_last_token. `audio=True` speaks the reply (a
    /// checkpoint with a talker): `speaker`, `talker` (a dict of `TalkerSampling`),
    /// `audio_first_chunk` and `audio_chunk` (frames per code2wav decode).
    #[pyo3(signature = (token_ids, items=None, *, tenant=0, encoder=None, placeholders="unexpanded", audio=false, speaker=None, talker=None, audio_first_chunk=None, audio_chunk=None, **sampling))]
    #[allow(clippy::too_many_arguments, reason = "Python's keyword arguments, one parameter each")]
    fn generate(
        &self, py: Python<'_>, token_ids: &Bound<'_, PyAny>, items: Option<&Bound<'_, PyAny>>, tenant: u64,
        encoder: Option<Py<PyAny>>, placeholders: &str, audio: bool, speaker: Option<String>,
        talker: Option<&Bound<'_, PyDict>>, audio_first_chunk: Option<usize>, audio_chunk: Option<usize>,
        sampling: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyGeneration> {
        let prompt = Prompt::parse(token_ids, items, tenant, placeholders)?;
        let task = Task::Generate(sampling_params(sampling)?);
        let speech = speech_options(audio, speaker, talker, audio_first_chunk, audio_chunk)?;
        let handle = self.submit(py, prompt, task, speech, encoder, None)?;
        PyGeneration::new(py, wait(py, handle)?)
    }

    /// `generate`, yielding `(token, {capture: row})` as each token is sampled
    /// and, with `audio=True`, an `AudioChunk` as each chunk of audio is made.
    /// The engine keeps generating while nobody reads (up to 256 buffered
    /// events); closing or dropping the stream aborts the request. With
    /// `pump`, that `EventPump` is told whenever the stream has events (read
    /// them with `pump.watch(stream)` and `pump.wait()`).
    #[pyo3(signature = (token_ids, items=None, *, tenant=0, encoder=None, placeholders="unexpanded", pump=None, audio=false, speaker=None, talker=None, audio_first_chunk=None, audio_chunk=None, **sampling))]
    #[allow(clippy::too_many_arguments, reason = "Python's keyword arguments, one parameter each")]
    fn stream(
        slf: &Bound<'_, Self>, token_ids: &Bound<'_, PyAny>, items: Option<&Bound<'_, PyAny>>, tenant: u64,
        encoder: Option<Py<PyAny>>, placeholders: &str, pump: Option<PyRef<'_, EventPump>>, audio: bool,
        speaker: Option<String>, talker: Option<&Bound<'_, PyDict>>, audio_first_chunk: Option<usize>,
        audio_chunk: Option<usize>, sampling: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Stream> {
        let prompt = Prompt::parse(token_ids, items, tenant, placeholders)?;
        let task = Task::Generate(sampling_params(sampling)?);
        let speech = speech_options(audio, speaker, talker, audio_first_chunk, audio_chunk)?;
        let handle = slf.get().submit(slf.py(), prompt, task, speech, encoder, pump.as_deref())?;
        Ok(Stream::new(handle, slf.as_any()))
    }

    /// Submits a prefill and returns its stream (it yields no tokens; its
    /// `.output` holds the result once exhausted): for callers that wait
    /// elsewhere (`pump`: as in `stream`).
    #[pyo3(signature = (token_ids, items=None, *, tenant=0, encoder=None, placeholders="unexpanded", pump=None))]
    #[allow(clippy::too_many_arguments, reason = "Python's keyword arguments, one parameter each")]
    fn submit_prefill(
        slf: &Bound<'_, Self>, token_ids: &Bound<'_, PyAny>, items: Option<&Bound<'_, PyAny>>, tenant: u64,
        encoder: Option<Py<PyAny>>, placeholders: &str, pump: Option<PyRef<'_, EventPump>>,
    ) -> PyResult<Stream> {
        let prompt = Prompt::parse(token_ids, items, tenant, placeholders)?;
        let handle = slf.get().submit(slf.py(), prompt, Task::Prefill, None, encoder, pump.as_deref())?;
        Ok(Stream::new(handle, slf.as_any()))
    }

    /// True once a step panicked: every pending and later call raises
    /// `EngineDeadError`. A server should withdraw this engine and exit.
    #[getter]
    fn is_dead(&self) -> bool {
        self.served.is_dead()
    }

    /// Every counter of `EngineStats`, one key per field (the scheduler's flattened in): queries,
    /// query_tokens, hits, hit_tokens, evicted_blocks, preemptions, block_copies, blocks_free,
    /// blocks_in_use, blocks_cached, waiting, running, encoder_cache_hits, encoder_calls, finished.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let stats = py.detach(|| self.served.stats()).map_err(to_py)?;
        pythonize::pythonize(py, &stats).map_err(|e| InternalError::new_err(e.to_string()))
    }

    /// Checks the scheduler's pool, index and bookkeeping; raises `InternalError` naming a broken invariant.
    fn validate(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.served.validate()).map_err(to_py)
    }

    /// Drops every cached block and publishes `AllBlocksCleared`; the number of blocks freed.
    /// Refused (`CacheError`, nothing changed) while requests are pending.
    fn reset_cache(&self, py: Python<'_>) -> PyResult<usize> {
        py.detach(|| self.served.reset_cache()).map_err(to_py)
    }

    /// The engine's metrics in Prometheus text format (`Engine::metrics`).
    fn metrics(&self, py: Python<'_>) -> PyResult<String> {
        py.detach(|| self.served.metrics()).map_err(to_py)
    }

    /// The hashes of the published full blocks the index holds, ascending (empty without `kv_events`).
    fn cached_block_hashes(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        py.detach(|| self.served.cached_block_hashes()).map_err(to_py)
    }

    /// The publisher's counters (batches, published, dropped, replays, malformed_replays), or None.
    fn kv_events_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let stats = py.detach(|| self.served.kv_events_stats()).map_err(to_py)?;
        stats
            .map(|s| pythonize::pythonize(py, &s).map_err(|e| InternalError::new_err(e.to_string())))
            .transpose()
    }

    /// The KV events PUB endpoint as bound (port 0 resolved), or None.
    #[getter]
    fn kv_events_endpoint(&self) -> Option<String> {
        self.kv_endpoints.as_ref().map(|(pub_at, _)| pub_at.clone())
    }

    /// The KV events replay (ROUTER) endpoint as bound, or None.
    #[getter]
    fn kv_replay_endpoint(&self) -> Option<String> {
        self.kv_endpoints.as_ref().and_then(|(_, replay_at)| replay_at.clone())
    }

    /// Captured points, in page order (`hidden.<L>`, `hidden.final`).
    #[getter]
    fn capture(&self) -> Vec<String> {
        self.served.capture().points().iter().map(|p| p.key()).collect()
    }

    /// The checkpoint's eos ids (default stop ids of a generation).
    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.served.model_config().eos_token_ids.clone()
    }

    #[getter]
    fn hidden_size(&self) -> usize {
        self.served.model_config().hidden_size
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.served.model_config().num_hidden_layers
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.served.model_config().vocab_size
    }

    /// Longest sequence (prompt + reply) the model attends over
    /// (`max_position_embeddings`; None when the checkpoint names none).
    #[getter]
    fn context_len(&self) -> Option<usize> {
        self.served.model_config().max_position_embeddings
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.served.config().scheduler.block_size
    }

    /// Blocks in the KV pool (what a router is told the engine holds).
    #[getter]
    fn num_blocks(&self) -> usize {
        self.served.config().scheduler.num_blocks
    }

    /// The dtype the weight matrices are stored in (`"auto"` resolved).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.served.weight_dtype().name()
    }

    /// `<|image_pad|>`: the placeholder id of an image (one per unexpanded image).
    #[getter]
    fn image_token_id(&self) -> u32 {
        self.served.tokens().image_token_id
    }

    /// `<|video_pad|>`: the placeholder id of a video.
    #[getter]
    fn video_token_id(&self) -> u32 {
        self.served.tokens().video_token_id
    }

    /// `<|audio_pad|>`: the placeholder id of an audio.
    #[getter]
    fn audio_token_id(&self) -> u32 {
        self.served.tokens().audio_token_id
    }

    /// `<|vision_start|>`: opens an image or a video.
    #[getter]
    fn vision_start_token_id(&self) -> u32 {
        self.served.tokens().vision_start_token_id
    }

    /// `<|vision_end|>`: closes an image or a video.
    #[getter]
    fn vision_end_token_id(&self) -> u32 {
        self.served.tokens().vision_end_token_id
    }

    /// `<|audio_start|>`: opens an audio.
    #[getter]
    fn audio_start_token_id(&self) -> u32 {
        self.served.tokens().audio_start_token_id
    }

    /// `<|audio_end|>`: closes an audio.
    #[getter]
    fn audio_end_token_id(&self) -> u32 {
        self.served.tokens().audio_end_token_id
    }

    fn __repr__(&self) -> String {
        format!(
            "Engine(layers={}, hidden={}, vocab={}, block_size={}, backend={:?})",
            self.num_layers(),
            self.hidden_size(),
            self.vocab_size(),
            self.block_size(),
            self.backend
        )
    }
}

/// A core engine moved onto its own thread, with the facts Python reads
/// (`backend` is left empty for `PyEngine::open` to fill in).
fn served<B: Backend + 'static>(engine: Engine<B>) -> omniprefix::Result<PyEngine>
where
    Engine<B>: Send,
{
    Ok(PyEngine {
        backend: String::new(),
        kv_endpoints: engine
            .kv_events_endpoints()
            .map(|(pub_at, replay_at)| (pub_at.to_string(), replay_at.map(str::to_string))),
        served: ManuallyDrop::new(engine.serve(ServedOptions::default())?),
    })
}
