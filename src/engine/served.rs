//! A served engine: the core on its own thread, stepping while anything is
//! pending, with a handle per request.
//!
//! Callers prepare requests on their own threads ([`ServedEngine::submit`]):
//! fingerprints, the canonical prompt, the stateless checks and the encoder
//! run there, outside the loop, so a slow encoder on one thread never stalls
//! another request's stream. Only the prepared request crosses to the loop,
//! which admits it between two steps and answers at once.
//!
//! Each request's events go to its [`RequestHandle`], read blocking
//! ([`RequestHandle::recv`]) or async ([`RequestHandle::next`]). A stream that
//! nobody reads keeps generating until its buffer holds
//! [`ServedOptions::buffer_events`] events (256 by default); then it is held —
//! it keeps its blocks but samples no further token — until the reader has
//! drained half of it (backpressure, not loss: no event is ever dropped).
//! Dropping a handle before its request finished aborts the request.

use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

use super::channel::{Command, Core, Flow, ReadySender, Route, dead, stopped};
use super::handle::RequestHandle;
use super::prepare::{Prepared, Preparer};
use super::request::Request;
use super::step_loop::FAULT_STEP_PANIC_ENV;
use super::{Engine, EngineConfig, EngineStats};
use crate::backend::{Backend, Dtype};
use crate::error::{Error, Result, SchedError};
use crate::events::PublisherStats;
use crate::model::{CaptureSpec, Config};
use crate::prompt::OmniTokens;

/// How a served engine buffers events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServedOptions {
    /// Events a request's buffer holds before its stream stops generating
    /// (at least 1; default 256). It resumes once the reader drains half.
    pub buffer_events: usize,
    /// A test-only fault: the loop's step number `n` (1-based) panics, so tests
    /// can kill an engine on purpose. Honoured in debug builds only; a release
    /// build ignores it. The default reads `OMNIPREFIX_FAULT_STEP_PANIC`.
    #[doc(hidden)]
    pub fault_step_panic: Option<u64>,
}

impl Default for ServedOptions {
    fn default() -> Self {
        let fault_step_panic = if cfg!(debug_assertions) {
            std::env::var(FAULT_STEP_PANIC_ENV).ok().and_then(|v| v.trim().parse().ok())
        } else {
            None
        };
        ServedOptions { buffer_events: 256, fault_step_panic }
    }
}

/// Facts about the model that never change, readable without the loop.
struct Facts {
    config: EngineConfig,
    model: Config,
    weight_dtype: Dtype,
    capture: CaptureSpec,
    tokens: OmniTokens,
}

/// An engine that steps on its own thread. Made by [`Engine::serve`].
///
/// ```
/// use omniprefix::engine::{Engine, EngineConfig, Event, Request, ServedOptions};
/// use omniprefix::model::Config;
/// use omniprefix::sample::SamplingParams;
/// use omniprefix::sched::SchedulerConfig;
///
/// let engine = Engine::random(Config::tiny_qwen3(32, 2, 4, 2, 600), 1, EngineConfig { scheduler: SchedulerConfig { block_size: 4, ..Default::default() }, ..Default::default() })?;
/// let served = engine.serve(ServedOptions::default())?;
/// let prefill = served.submit(Request::text((0..10).collect()))?;
/// let mut stream = served.submit(Request::text((0..12).collect()).generate(SamplingParams::greedy(5)))?;
/// let mut tokens = Vec::new();
/// while let Some(event) = stream.recv() {
///     match event? {
///         Event::Token(t) => tokens.push(t.token),
///         Event::Finished(out) => assert_eq!(out.tokens, tokens),
///         Event::Audio(_) => unreachable!("no audio was asked"),
///     }
/// }
/// assert_eq!(tokens.len(), 5);
/// assert_eq!(prefill.wait()?.prompt_len, 10);
/// # Ok::<(), omniprefix::Error>(())
/// ```
pub struct ServedEngine {
    preparer: Arc<Preparer>,
    commands: Sender<Command>,
    thread: Option<JoinHandle<()>>,
    options: ServedOptions,
    facts: Facts,
    /// Set, with the panic's message, before the loop ends after a step panicked.
    dead: Arc<OnceLock<String>>,
}

impl ServedEngine {
    pub(super) fn start<B: Backend + 'static>(engine: Engine<B>, options: ServedOptions) -> Result<Self>
    where
        Engine<B>: Send,
    {
        if options.buffer_events == 0 {
            let found = "0".into();
            return Err(crate::error::ConfigError::Invalid {
                component: "served engine",
                field: "buffer_events",
                expected: "at least 1".into(),
                found,
            }
            .into());
        }
        let facts = Facts {
            config: engine.config().clone(),
            model: engine.model_config().clone(),
            weight_dtype: engine.weight_dtype(),
            capture: engine.capture().clone(),
            tokens: engine.tokens().clone(),
        };
        let preparer = engine.preparer();
        let (commands, inbox) = mpsc::channel();
        let dead = Arc::new(OnceLock::new());
        let loop_state = super::step_loop::LoopState {
            dead: Arc::clone(&dead),
            fault_step_panic: options.fault_step_panic,
        };
        let thread = std::thread::Builder::new()
            .name("omniprefix-engine".into())
            .spawn(move || super::step_loop::run(Box::new(engine), inbox, loop_state))
            .map_err(|e| SchedError::Stopped { reason: format!("cannot start the engine thread: {e}") })?;
        Ok(ServedEngine { preparer, commands, thread: Some(thread), options, facts, dead })
    }

    /// Prepares `request` on this thread (fingerprints, prompt, checks, encoder
    /// calls: none of it holds up the loop), then hands it to the loop, which
    /// admits it between two steps. Its events arrive at the returned handle.
    /// On error nothing changed.
    pub fn submit(&self, request: Request<'_>) -> Result<RequestHandle> {
        let prepared = self.preparer.prepare(request)?;
        self.submit_prepared(prepared)
    }

    /// [`submit`](Self::submit) for a request prepared by [`prepare`](Self::prepare).
    pub fn submit_prepared(&self, prepared: Prepared) -> Result<RequestHandle> {
        self.submit_routed(prepared, None)
    }

    /// [`submit_prepared`](Self::submit_prepared), and the loop sends the
    /// request's id to `ready` after each of its events and when its stream
    /// ends: one reader thread can watch many handles (an asyncio event pump).
    /// The id is sent only once the handle exists on the loop's side, so a
    /// watcher should look at a new handle once before waiting on `ready`.
    pub fn submit_prepared_notify(&self, prepared: Prepared, ready: ReadySender) -> Result<RequestHandle> {
        self.submit_routed(prepared, Some(ready))
    }

    fn submit_routed(&self, prepared: Prepared, ready: Option<ReadySender>) -> Result<RequestHandle> {
        let (tx, rx) = async_channel::unbounded();
        let flow = Arc::new(Flow { held: AtomicBool::new(false), capacity: self.options.buffer_events });
        let (reply, answer) = mpsc::sync_channel(1);
        let route = Route { events: tx, flow: Arc::clone(&flow), ready: None };
        self.send(Command::Submit { prepared: Box::new(prepared), route, ready, reply })?;
        let id = answer.recv().map_err(|_| self.stopped())??;
        Ok(RequestHandle::new(id, rx, flow, self.commands.clone()))
    }

    /// Prepares `request` on this thread without submitting it.
    pub fn prepare(&self, request: Request<'_>) -> Result<Prepared> {
        self.preparer.prepare(request)
    }

    /// Counters of the scheduler, index and encoder cache.
    pub fn stats(&self) -> Result<EngineStats> {
        self.call(|core| core.stats())
    }

    /// The engine's metrics in Prometheus text format (see [`Engine::metrics`]).
    pub fn metrics(&self) -> Result<String> {
        self.call(|core| core.metrics())?
    }

    /// Checks the scheduler's pool, index and bookkeeping.
    pub fn validate(&self) -> Result<()> {
        self.call(|core| core.validate())?.map_err(Error::from)
    }

    /// Drops every cached block; refused while requests are pending (see [`Engine::reset_cache`]).
    pub fn reset_cache(&self) -> Result<usize> {
        self.call(|core| core.reset_cache())?
    }

    /// The hashes of the published blocks the index holds (see [`Engine::cached_block_hashes`]).
    pub fn cached_block_hashes(&self) -> Result<Vec<u64>> {
        self.call(|core| core.cached_block_hashes())
    }

    /// The KV-event publisher's counters, if events are published.
    pub fn kv_events_stats(&self) -> Result<Option<PublisherStats>> {
        self.call(|core| core.kv_events_stats())
    }

    /// The configuration in force.
    pub fn config(&self) -> &EngineConfig {
        &self.facts.config
    }

    /// The model's config.
    pub fn model_config(&self) -> &Config {
        &self.facts.model
    }

    /// The dtype the model's weight matrices are stored in (`auto` resolved).
    pub fn weight_dtype(&self) -> Dtype {
        self.facts.weight_dtype
    }

    /// The captured points, in the order of [`Output::hidden`](super::Output::hidden).
    pub fn capture(&self) -> &CaptureSpec {
        &self.facts.capture
    }

    /// The model's special ids.
    pub fn tokens(&self) -> &OmniTokens {
        &self.facts.tokens
    }

    /// Runs `f` on the loop's thread between two steps and returns its result.
    fn call<T: Send + 'static>(&self, f: impl FnOnce(&mut dyn Core) -> T + Send + 'static) -> Result<T> {
        let (reply, answer) = mpsc::sync_channel(1);
        self.send(Command::Call(Box::new(move |core| {
            let _ = reply.send(f(core));
        })))?;
        answer.recv().map_err(|_| self.stopped())
    }

    fn send(&self, command: Command) -> Result<()> {
        self.commands.send(command).map_err(|_| self.stopped())
    }

    /// True once a step panicked: every pending and later call fails with
    /// [`SchedError::EngineDead`]. A server should withdraw this engine.
    pub fn is_dead(&self) -> bool {
        self.dead.get().is_some()
    }

    /// What killed the engine (the panic's message), if it is dead.
    pub fn death(&self) -> Option<&str> {
        self.dead.get().map(String::as_str)
    }

    /// The error of a call the loop can no longer answer: the engine died, or it stopped.
    fn stopped(&self) -> Error {
        match self.dead.get() {
            Some(reason) => dead(reason),
            None => stopped(),
        }
    }
}

impl Drop for ServedEngine {
    /// Stops the loop once every command sent before has run: requests still
    /// pending are aborted and their handles get [`SchedError::Stopped`]. Then
    /// waits for the thread, which drops the core (a KV-event publisher
    /// lingers as configured).
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
