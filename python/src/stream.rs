//! `Stream`: one request's events as Python reads them, blocking (`next()`) or
//! through an [`EventPump`](crate::pump::EventPump), with its result kept at the end.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use omniprefix::engine::{Aborter, AudioEvent, Event, Output, RequestHandle};
use omniprefix::sample::FinishReason;
use pyo3::prelude::*;
use pyo3::sync::MutexExt;

use crate::arrays::row_dict;
use crate::errors::to_py;
use crate::outputs::{PyAudioChunk, PyGeneration, PyOutput};

/// The events of one request as they come: iterate for `(token, {capture: row})`
/// and, for a request that asked for audio, `AudioChunk`s in the order they
/// were made; `.generation` (a generation) or `.output` (a prefill) holds the
/// result once it ends. Closing (or dropping) it early aborts the request.
#[pyclass(module = "omniprefix")]
pub struct Stream {
    pub(crate) state: Arc<StreamState>,
    /// Keeps the engine (and its loop) alive while the stream is.
    _engine: Py<PyAny>,
}

/// What a stream shares with the [`EventPump`](crate::pump::EventPump) that may read it.
///
/// No lock here is ever held while the GIL is being waited for: each is taken
/// with `lock_py_attached` (which lets go of the GIL while it waits), so a
/// reader blocked in `next()` (GIL released, handle locked) and a thread
/// polling `done` or calling `close()` can never wait on each other.
pub(crate) struct StreamState {
    handle: Mutex<Option<RequestHandle>>,
    /// Aborts without the handle's lock, which a waiting reader holds.
    aborter: Aborter,
    /// The request's id (what an event pump names it by).
    pub(crate) id: u64,
    result: Mutex<Option<Output>>,
    /// Why the request stops, set when its last token is read.
    finish_reason: Mutex<Option<FinishReason>>,
    /// Set once the stream ended: read without any lock.
    done: AtomicBool,
}

impl Stream {
    /// `engine`: the Python engine the request runs on, kept alive by the stream.
    pub(crate) fn new(handle: RequestHandle, engine: &Bound<'_, PyAny>) -> Self {
        let state = StreamState {
            aborter: handle.aborter(),
            id: handle.id(),
            handle: Mutex::new(Some(handle)),
            result: Mutex::new(None),
            finish_reason: Mutex::new(None),
            done: AtomicBool::new(false),
        };
        Stream { state: Arc::new(state), _engine: engine.clone().unbind() }
    }
}

/// What one read of a stream found.
pub(crate) enum Read {
    /// A token, its rows, and why the request stops when it is the last.
    Token(u32, Vec<(omniprefix::model::CaptureName, Vec<f32>)>, Option<FinishReason>),
    /// A chunk of the spoken reply (a request that asked for audio).
    Audio(AudioEvent),
    /// Nothing buffered (a read that does not wait).
    Empty,
    /// The stream ended (its result kept) or was closed.
    End,
}

impl StreamState {
    /// The next token, or the end (the result kept); waits, with the GIL
    /// released, only when `wait`.
    pub(crate) fn read(&self, py: Python<'_>, wait: bool) -> PyResult<Read> {
        let mut guard = self.handle.lock_py_attached(py).unwrap_or_else(|p| p.into_inner());
        let Some(handle) = guard.as_mut() else { return Ok(Read::End) };
        let event = if wait {
            py.detach(|| handle.recv())
        } else {
            match handle.try_recv() {
                Some(event) => Some(event),
                None if handle.is_done() => None,
                None => return Ok(Read::Empty),
            }
        };
        let ended = |guard: &mut Option<RequestHandle>| {
            *guard = None;
            self.done.store(true, Ordering::Release);
        };
        match event {
            Some(Ok(Event::Token(token))) => {
                if token.finish_reason.is_some() {
                    *self.finish_reason.lock_py_attached(py).unwrap_or_else(|p| p.into_inner()) =
                        token.finish_reason;
                }
                Ok(Read::Token(token.token, token.hidden, token.finish_reason))
            }
            Some(Ok(Event::Audio(audio))) => Ok(Read::Audio(audio)),
            Some(Ok(Event::Finished(output))) => {
                *self.result.lock_py_attached(py).unwrap_or_else(|p| p.into_inner()) = Some(output);
                ended(&mut guard);
                Ok(Read::End)
            }
            Some(Err(error)) => {
                ended(&mut guard);
                Err(to_py(error))
            }
            None => {
                ended(&mut guard);
                Ok(Read::End)
            }
        }
    }

    /// The finished request's output, if it finished.
    fn result(&self, py: Python<'_>) -> Option<Output> {
        self.result.lock_py_attached(py).unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }
}

/// A token as a stream yields it: `(token, {capture: row})`.
fn token_item(
    py: Python<'_>, token: u32, rows: Vec<(omniprefix::model::CaptureName, Vec<f32>)>,
) -> PyResult<Py<PyAny>> {
    Ok((token, row_dict(py, rows)?).into_pyobject(py)?.into_any().unbind())
}

/// An audio chunk as a stream yields it: an `AudioChunk`.
pub(crate) fn audio_item(py: Python<'_>, audio: AudioEvent) -> PyResult<Py<PyAny>> {
    Ok(Py::new(py, PyAudioChunk::new(py, audio))?.into_any())
}

#[pymethods]
impl Stream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        loop {
            match self.state.read(py, true)? {
                Read::Token(token, rows, _) => return Ok(Some(token_item(py, token, rows)?)),
                Read::Audio(audio) => return Ok(Some(audio_item(py, audio)?)),
                // A blocking read is never empty; read on if it were.
                Read::Empty => continue,
                Read::End => return Ok(None),
            }
        }
    }

    /// Waits (GIL released) for the next event and returns every buffered
    /// item as `[(token, {capture: row}) | AudioChunk, ...]`; `[]` once the stream ended.
    fn next_batch(&self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        let mut batch = Vec::new();
        loop {
            match self.state.read(py, batch.is_empty())? {
                Read::Token(token, rows, _) => batch.push(token_item(py, token, rows)?),
                Read::Audio(audio) => batch.push(audio_item(py, audio)?),
                Read::Empty | Read::End => return Ok(batch),
            }
        }
    }

    /// Why the generation stops (`"stop"` or `"length"`), set as soon as its
    /// last token has been read, before the stream's end; None until then.
    #[getter]
    fn finish_reason(&self, py: Python<'_>) -> Option<String> {
        self.state
            .finish_reason
            .lock_py_attached(py)
            .unwrap_or_else(|p| p.into_inner())
            .map(|r| r.to_string())
    }

    /// The finished generation (None until the stream is exhausted).
    #[getter]
    fn generation(&self, py: Python<'_>) -> PyResult<Option<PyGeneration>> {
        let output = self.state.result(py);
        output.filter(|o| o.finish_reason.is_some()).map(|o| PyGeneration::new(py, o)).transpose()
    }

    /// The finished prefill of `Engine.submit_prefill` (None until it ended).
    #[getter]
    fn output(&self, py: Python<'_>) -> PyResult<Option<PyOutput>> {
        let output = self.state.result(py);
        output.filter(|o| o.finish_reason.is_none()).map(|o| PyOutput::new(py, o)).transpose()
    }

    /// True once the request ended (finished, failed or closed); never waits.
    #[getter]
    fn done(&self) -> bool {
        self.state.is_done()
    }

    /// The engine's id of the request (what `EventPump.wait` names it by).
    #[getter]
    fn request_id(&self) -> u64 {
        self.state.id
    }

    /// Aborts the request if it has not finished; its blocks go back, nothing of it is cached.
    fn close(&self) {
        // A reader waiting in another thread holds the handle: abort through
        // the loop, which ends that reader's wait.
        self.state.aborter.abort();
        if let Ok(mut handle) = self.state.handle.try_lock()
            && handle.take().is_some()
        {
            self.state.done.store(true, Ordering::Release);
        }
    }
}
