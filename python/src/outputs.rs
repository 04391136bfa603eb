//! `Output` (a prefill) and `Generation`: the engine's one result type as the
//! two Python objects it always was,
//! hidden states moved into numpy arrays without a copy.

use numpy::PyArray1;
use omniprefix::engine::{Output, millis};
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
        Ok(PyGeneration {
            tokens: generation.tokens,
            hidden: hidden_dict(py, generation.hidden)?.unbind(),
            num_cached_tokens: generation.num_cached_tokens,
            prompt_len: generation.prompt_len,
            finish_reason: generation.finish_reason.map(|r| r.to_string()).unwrap_or_default(),
            seed: generation.seed.unwrap_or_default(),
            timings: timings.unbind(),
            decode_tokens_per_s,
        })
    }
}

#[pymethods]
impl PyGeneration {
    fn __repr__(&self) -> String {
        format!(
            "Generation(tokens={}, prompt_len={}, num_cached_tokens={}, finish_reason={:?})",
            self.tokens.len(),
            self.prompt_len,
            self.num_cached_tokens,
            self.finish_reason
        )
    }
}
