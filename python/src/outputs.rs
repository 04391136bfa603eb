//! `Output` (a prefill) and `Generation`: the engine's one result type as the
//! two Python objects it always was,
//! hidden states moved into numpy arrays without a copy; `AudioChunk`: one
//! `Event::Audio` of a stream that asked for audio.

use numpy::{PyArray1, PyArray2, PyUntypedArrayMethods};
use omniprefix::engine::{AudioEvent, Output, millis};
use omniprefix::speech::Speech;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::hidden_dict;

/// A prefill's result: every prompt position's hidden state, cached or not.
#[pyclass(frozen, name = "Output", module = "omniprefix")]
pub struct PyOutput {
    /// `{"hidden.<L>" | "hidden.final": float32 [prompt_len, hidden]}`.
    #[pyo3(get)]
    hidden: Py<PyDict>,
    /// float32 `[vocab]`: the logits of the last position.
    #[pyo3(get)]
    last_logits: Py<PyArray1<f32>>,
    /// Leading positions whose KV came from the cache.
    #[pyo3(get)]
    num_cached_tokens: usize,
    #[pyo3(get)]
    prompt_len: usize,
    /// Milliseconds: preprocess, schedule, forward, total.
    #[pyo3(get)]
    timings: Py<PyDict>,
}

impl PyOutput {
    pub fn new(py: Python<'_>, output: Output) -> PyResult<Self> {
        let timings = PyDict::new(py);
        timings.set_item("preprocess", millis(output.timings.preprocess))?;
        timings.set_item("schedule", millis(output.timings.schedule))?;
        timings.set_item("forward", millis(output.timings.forward))?;
        timings.set_item("total", millis(output.timings.total))?;
        Ok(PyOutput {
            hidden: hidden_dict(py, output.hidden)?.unbind(),
            last_logits: PyArray1::from_vec(py, output.last_logits).unbind(),
            num_cached_tokens: output.num_cached_tokens,
            prompt_len: output.prompt_len,
            timings: timings.unbind(),
        })
    }
}

#[pymethods]
impl PyOutput {
    fn __repr__(&self) -> String {
        format!("Output(prompt_len={}, num_cached_tokens={})", self.prompt_len, self.num_cached_tokens)
    }
}

/// A finished generation: its tokens and the hidden rows of every position that ran.
#[pyclass(frozen, name = "Generation", module = "omniprefix")]
pub struct PyGeneration {
    /// The generated ids (a stop id, when one ended it, is the last).
    #[pyo3(get)]
    tokens: Vec<u32>,
    /// `{name: float32 [prompt_len + len(tokens) - 1, hidden]}`: the prompt, then each generated token but the last.
    #[pyo3(get)]
    hidden: Py<PyDict>,
    #[pyo3(get)]
    num_cached_tokens: usize,
    #[pyo3(get)]
    prompt_len: usize,
    /// `"stop"` or `"length"`.
    #[pyo3(get)]
    finish_reason: String,
    /// The sampler's seed (the one given, or the one drawn).
    #[pyo3(get)]
    seed: u64,
    /// Milliseconds: preprocess, ttft, total, and itl (the gaps between tokens).
    #[pyo3(get)]
    timings: Py<PyDict>,
    /// Tokens per second after the first.
    #[pyo3(get)]
    decode_tokens_per_s: f64,
    /// The spoken reply (a request with `audio=True`), else None.
    speech: Option<PySpeech>,
}

/// The spoken reply of a generation, as numpy arrays.
struct PySpeech {
    /// int64 `[code groups, frames]`: the talker's codec codes.
    codes: Py<PyArray2<i64>>,
    /// float32 `[samples]`: mono audio at `sample_rate`.
    audio: Py<PyArray1<f32>>,
    sample_rate: u32,
    talker_prompt_rows: usize,
    talker_cached_rows: usize,
    /// `"stop"` (the codec's EOS) or `"length"` (the talker's `max_tokens`).
    finish_reason: String,
    /// Seconds from submission to the first audio; None when the reply made no audio.
    ttfa_s: Option<f64>,
}

impl PySpeech {
    fn new(py: Python<'_>, speech: Speech, ttfa_s: Option<f64>) -> Self {
        PySpeech {
            codes: PyArray2::from_owned_array(py, speech.codes.mapv(i64::from)).unbind(),
            audio: PyArray1::from_vec(py, speech.audio).unbind(),
            sample_rate: speech.sample_rate,
            talker_prompt_rows: speech.talker_prompt_rows,
            talker_cached_rows: speech.talker_cached_rows,
            finish_reason: speech.finish.to_string(),
            ttfa_s,
        }
    }
}

impl PyGeneration {
    pub fn new(py: Python<'_>, generation: Output) -> PyResult<Self> {
        let t = &generation.timings;
        let timings = PyDict::new(py);
        timings.set_item("preprocess", millis(t.preprocess))?;
        timings.set_item("ttft", millis(t.ttft))?;
        timings.set_item("total", millis(t.total))?;
        timings.set_item("itl", t.itl().into_iter().map(millis).collect::<Vec<_>>())?;
        let decode_tokens_per_s = t.decode_tokens_per_s();
        let ttfa_s = t.ttfa.map(|d| d.as_secs_f64());
        let speech = generation.speech.map(|s| PySpeech::new(py, s, ttfa_s));
        Ok(PyGeneration {
            tokens: generation.tokens,
            hidden: hidden_dict(py, generation.hidden)?.unbind(),
            num_cached_tokens: generation.num_cached_tokens,
            prompt_len: generation.prompt_len,
            finish_reason: generation.finish_reason.map(|r| r.to_string()).unwrap_or_default(),
            seed: generation.seed.unwrap_or_default(),
            timings: timings.unbind(),
            decode_tokens_per_s,
            speech,
        })
    }
}

#[pymethods]
impl PyGeneration {
    /// int64 `[code groups, frames]`: the talker's codec codes; None without audio.
    #[getter]
    fn codes(&self, py: Python<'_>) -> Option<Py<PyArray2<i64>>> {
        self.speech.as_ref().map(|s| s.codes.clone_ref(py))
    }

    /// float32 `[samples]`: the spoken reply, mono at `sample_rate`; None without audio.
    #[getter]
    fn audio(&self, py: Python<'_>) -> Option<Py<PyArray1<f32>>> {
        self.speech.as_ref().map(|s| s.audio.clone_ref(py))
    }

    /// Samples per second of `audio`; None without audio.
    #[getter]
    fn sample_rate(&self) -> Option<u32> {
        self.speech.as_ref().map(|s| s.sample_rate)
    }

    /// Seconds from submission to the first audio sample; None without audio (or no audio made).
    #[getter]
    fn ttfa_s(&self) -> Option<f64> {
        self.speech.as_ref().and_then(|s| s.ttfa_s)
    }

    /// Rows of the talker's prefill; None without audio.
    #[getter]
    fn talker_prompt_rows(&self) -> Option<usize> {
        self.speech.as_ref().map(|s| s.talker_prompt_rows)
    }

    /// Rows of the talker's prefill whose KV was reused; None without audio.
    #[getter]
    fn talker_cached_rows(&self) -> Option<usize> {
        self.speech.as_ref().map(|s| s.talker_cached_rows)
    }

    /// Why the talker stopped: `"stop"` (the codec's end) or `"length"` (its `max_tokens`); None without audio.
    #[getter]
    fn audio_finish_reason(&self) -> Option<String> {
        self.speech.as_ref().map(|s| s.finish_reason.clone())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let audio = match &self.speech {
            Some(s) => format!(", audio_frames={}", s.codes.bind(py).shape()[1]),
            None => String::new(),
        };
        format!(
            "Generation(tokens={}, prompt_len={}, num_cached_tokens={}, finish_reason={:?}{audio})",
            self.tokens.len(),
            self.prompt_len,
            self.num_cached_tokens,
            self.finish_reason
        )
    }
}

/// A chunk of a spoken reply as a stream reads it (`Event::Audio`): final as
/// soon as it is made; a request's chunks, in order, are its `Generation.audio`.
#[pyclass(frozen, name = "AudioChunk", module = "omniprefix")]
pub struct PyAudioChunk {
    /// Index of the chunk's first sample in the reply's audio.
    #[pyo3(get)]
    offset: usize,
    /// float32 `[samples]`, mono at `sample_rate`.
    #[pyo3(get)]
    samples: Py<PyArray1<f32>>,
    /// Samples a second (the generation's `sample_rate`).
    #[pyo3(get)]
    sample_rate: u32,
}

impl PyAudioChunk {
    pub fn new(py: Python<'_>, event: AudioEvent) -> Self {
        PyAudioChunk {
            offset: event.offset,
            samples: PyArray1::from_vec(py, event.samples).unbind(),
            sample_rate: event.sample_rate,
        }
    }
}

#[pymethods]
impl PyAudioChunk {
    fn __len__(&self, py: Python<'_>) -> usize {
        self.samples.bind(py).len()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!("AudioChunk(offset={}, samples={})", self.offset, self.samples.bind(py).len())
    }
}
