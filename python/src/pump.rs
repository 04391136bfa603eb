//! `omniprefix.EventPump`: one reader for many streams, so that N concurrent
//! asyncio streams cost one thread, not N (vLLM's `AsyncLLM` has one output
//! task feeding per-request queues for the same reason).
//!
//! A stream submitted with `pump=` makes the engine's loop send its request id
//! to the pump after each of its events and when it ends
//! ([`ServedEngine::submit_prepared_notify`](omniprefix::engine::ServedEngine::submit_prepared_notify)).
//! [`EventPump::wait`] blocks, with the GIL released, until some watched
//! stream has something, then reads every watched stream that was named
//! without waiting and hands back what each had.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use omniprefix::engine::ReadySender;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::PyBool;

use crate::arrays::row_dict;
use crate::stream::{Read, Stream, StreamState, audio_item};

/// A stream's items as the pump hands them on: `[(token, {capture: row}, finish_reason) | AudioChunk, ...]`,
/// `finish_reason` (`"stop"`, `"length"`) on the request's last token, else None; an
/// `AudioChunk` for each chunk of a request that asked for audio.
type Tokens = Vec<Py<PyAny>>;

/// What [`EventPump::wait`] found for one stream: its request id, the tokens
/// read, and `None` (still running), `True` (ended; its result is on the
/// stream) or the exception that ended it.
type Found = (u64, Tokens, Option<Py<PyAny>>);

/// Reads many streams from one thread: `pump.watch(stream)` for each stream
/// submitted with `pump=pump`, then `pump.wait(timeout_s)` in a loop.
#[pyclass(frozen, module = "omniprefix")]
pub struct EventPump {
    ready: Sender<u64>,
    /// Ids told by the engine; only `wait` reads them.
    told: Mutex<Receiver<u64>>,
    watched: Mutex<HashMap<u64, Arc<StreamState>>>,
}

impl EventPump {
    /// Where the engine tells this pump which requests have events.
    pub(crate) fn ready_sender(&self) -> ReadySender {
        self.ready.clone()
    }
}

#[pymethods]
impl EventPump {
    #[new]
    fn new() -> Self {
        let (ready, told) = std::sync::mpsc::channel();
        EventPump { ready, told: Mutex::new(told), watched: Mutex::new(HashMap::new()) }
    }

    /// Starts reading `stream` (submitted with `pump=` this pump). Its events
    /// that came before are read at the next `wait`.
    fn watch(&self, py: Python<'_>, stream: PyRef<'_, Stream>) {
        let state = Arc::clone(&stream.state);
        let id = state.id;
        self.watched.lock_py_attached(py).unwrap_or_else(|p| p.into_inner()).insert(id, state);
        // The engine may have told the id before it was watched: look once more.
        let _ = self.ready.send(id);
    }

    /// Streams watched and not ended.
    fn __len__(&self, py: Python<'_>) -> usize {
        self.watched.lock_py_attached(py).unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Waits up to `timeout_s` (GIL released) until a watched stream has
    /// events, then returns `[(request_id, [(token, {capture: row}, finish_reason) | AudioChunk, ...], end)]`
    /// for each that had any: `end` is None while it runs, True once it ended
    /// (its `.generation` / `.output` is set), or the exception that ended it.
    /// `[]` when the time ran out.
    fn wait(&self, py: Python<'_>, timeout_s: f64) -> PyResult<Vec<Found>> {
        if !(timeout_s.is_finite() && timeout_s >= 0.0) {
            return Err(PyValueError::new_err(format!(
                "timeout_s must be a finite number >= 0, not {timeout_s}"
            )));
        }
        let timeout = Duration::from_secs_f64(timeout_s);
        let ids: HashSet<u64> = py.detach(|| {
            let told = self.told.lock().unwrap_or_else(|p| p.into_inner());
            let first = match told.recv_timeout(timeout) {
                Ok(id) => id,
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => return HashSet::new(),
            };
            std::iter::once(first).chain(told.try_iter()).collect()
        });
        let mut found = Vec::new();
        for id in ids {
            let state =
                self.watched.lock_py_attached(py).unwrap_or_else(|p| p.into_inner()).get(&id).cloned();
            let Some(state) = state else { continue };
            let (tokens, end) = drain(py, &state)?;
            if end.is_some() {
                self.watched.lock_py_attached(py).unwrap_or_else(|p| p.into_inner()).remove(&id);
            }
            if !tokens.is_empty() || end.is_some() {
                found.push((id, tokens, end));
            }
        }
        Ok(found)
    }
}

/// Every event `state` has buffered, without waiting: its tokens, and how it ended if it did.
fn drain(py: Python<'_>, state: &StreamState) -> PyResult<(Tokens, Option<Py<PyAny>>)> {
    let mut tokens = Vec::new();
    loop {
        match state.read(py, false) {
            Ok(Read::Token(token, rows, finish)) => {
                let item = (token, row_dict(py, rows)?, finish.map(|r| r.to_string()));
                tokens.push(item.into_pyobject(py)?.into_any().unbind())
            }
            Ok(Read::Audio(audio)) => tokens.push(audio_item(py, audio)?),
            Ok(Read::Empty) => return Ok((tokens, None)),
            Ok(Read::End) => return Ok((tokens, Some(PyBool::new(py, true).to_owned().into_any().unbind()))),
            Err(error) => return Ok((tokens, Some(error.into_value(py).into_any()))),
        }
    }
}
