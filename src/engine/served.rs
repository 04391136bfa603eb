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
use std::sync::mpsc::{self, Sender, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;


use super::handle::RequestHandle;
use super::output::Event;
use super::prepare::{Prepared, Preparer};
use super::request::Request;
use super::{Engine, EngineConfig, EngineStats};
use crate::backend::Backend;
use crate::batch::RequestId;
use crate::error::{Error, InvariantViolation, Result, SchedError};
use crate::events::PublisherStats;
use crate::model::{CaptureSpec, Config};
use crate::prompt::OmniTokens;

/// How a served engine buffers events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServedOptions {
    /// Events a request's buffer holds before its stream stops generating
    /// (at least 1; default 256). It resumes once the reader drains half.
    pub buffer_events: usize,
}

impl Default for ServedOptions {
    fn default() -> Self {
        ServedOptions { buffer_events: 256 }
    }
}

/// What a handle yields: the request's next event, or the error that ended it.
pub type HandleEvent = Result<Event>;

/// What the loop needs of a core, whatever its backend.
pub(super) trait Core: Send {
    fn submit_prepared(&mut self, prepared: Prepared) -> Result<RequestId>;
    fn step(&mut self) -> Result<Vec<Event>>;
    fn abort(&mut self, id: RequestId) -> Result<()>;
    fn hold(&mut self, id: RequestId, held: bool) -> Result<()>;
    fn has_runnable(&self) -> bool;
    fn is_pending(&self, id: RequestId) -> bool;
    fn stats(&self) -> EngineStats;
    fn validate(&self) -> std::result::Result<(), InvariantViolation>;
    fn reset_cache(&mut self) -> Result<usize>;
    fn cached_block_hashes(&self) -> Vec<u64>;
    fn kv_events_stats(&self) -> Option<PublisherStats>;
    fn metrics(&self) -> Result<String>;
}

impl<B: Backend> Core for Engine<B>
where
    Engine<B>: Send,
{
    fn submit_prepared(&mut self, prepared: Prepared) -> Result<RequestId> {
        Engine::submit_prepared(self, prepared)
    }
    fn step(&mut self) -> Result<Vec<Event>> {
        Engine::step(self)
    }
    fn abort(&mut self, id: RequestId) -> Result<()> {
        Engine::abort(self, id)
    }
    fn hold(&mut self, id: RequestId, held: bool) -> Result<()> {
        Engine::hold(self, id, held)
    }
    fn has_runnable(&self) -> bool {
        Engine::has_runnable(self)
    }
    fn is_pending(&self, id: RequestId) -> bool {
        Engine::is_pending(self, id)
    }
    fn stats(&self) -> EngineStats {
        Engine::stats(self)
    }
    fn metrics(&self) -> Result<String> {
        Engine::metrics(self)
    }
    fn validate(&self) -> std::result::Result<(), InvariantViolation> {
        Engine::validate(self)
    }
    fn reset_cache(&mut self) -> Result<usize> {
        Engine::reset_cache(self)
    }
    fn cached_block_hashes(&self) -> Vec<u64> {
        Engine::cached_block_hashes(self)
    }
    fn kv_events_stats(&self) -> Option<PublisherStats> {
        Engine::kv_events_stats(self)
    }
}

/// A call run on the loop's thread between two steps.
pub(super) type Call = Box<dyn FnOnce(&mut dyn Core) + Send>;

pub(super) enum Command {
    Submit { prepared: Prepared, route: Route, reply: SyncSender<Result<RequestId>> },
    Abort(RequestId),
    Release(RequestId),
    Call(Call),
    /// Abort everything and end the loop.
    Shutdown,
}

/// Where a request's events go.
pub(super) struct Route {
    pub(super) events: async_channel::Sender<HandleEvent>,
    pub(super) flow: Arc<Flow>,
}

/// Backpressure state shared by the loop and a handle.
pub(super) struct Flow {
    /// Set by the loop when the buffer filled; cleared by the reader, which
    /// then asks the loop to release the request.
    pub(super) held: AtomicBool,
    pub(super) capacity: usize,
}

/// Facts about the model that never change, readable without the loop.
struct Facts {
    config: EngineConfig,
    model: Config,
    capture: CaptureSpec,
    tokens: OmniTokens,
}

/// An engine that steps on its own thread. Made by [`Engine::serve`].
///
/// ```
/// use omniprefix::engine::{Engine, EngineConfig, Event, Request, ServedOptions};
/// use omniprefix::model::Config;
/// use omniprefix::sample::SamplingParams;
///
/// let engine = Engine::random(Config::tiny_qwen3(32, 2, 4, 2, 600), 1, EngineConfig { block_size: 4, ..Default::default() })?;
/// let served = engine.serve(ServedOptions::default())?;
/// let prefill = served.submit(Request::text((0..10).collect()))?;
/// let mut stream = served.submit(Request::text((0..12).collect()).generate(SamplingParams::greedy(5)))?;
/// let mut tokens = Vec::new();
/// while let Some(event) = stream.recv() {
///     match event? {
///         Event::Token(t) => tokens.push(t.token),
///         Event::Finished(out) => assert_eq!(out.tokens, tokens),
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
}

impl ServedEngine {
    pub(super) fn start<B: Backend + 'static>(engine: Engine<B>, options: ServedOptions) -> Result<Self>
    where
        Engine<B>: Send,
    {
        if options.buffer_events == 0 {
            let found = "0".into();
            return Err(crate::error::ConfigError::Invalid { component: "served engine", field: "buffer_events", expected: "at least 1".into(), found }.into());
        }
        let facts = Facts {
            config: engine.config().clone(),
            model: engine.model_config().clone(),
            capture: engine.capture().clone(),
            tokens: engine.tokens().clone(),
        };
        let preparer = engine.preparer();
        let (commands, inbox) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("omniprefix-engine".into())
            .spawn(move || super::step_loop::run(Box::new(engine), inbox))
            .map_err(|e| SchedError::Stopped { reason: format!("cannot start the engine thread: {e}") })?;
        Ok(ServedEngine { preparer, commands, thread: Some(thread), options, facts })
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
        let (tx, rx) = async_channel::unbounded();
        let flow = Arc::new(Flow { held: AtomicBool::new(false), capacity: self.options.buffer_events });
        let (reply, answer) = mpsc::sync_channel(1);
        let route = Route { events: tx, flow: Arc::clone(&flow) };
        self.send(Command::Submit { prepared, route, reply })?;
        let id = answer.recv().map_err(|_| stopped())??;
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
        answer.recv().map_err(|_| stopped())
    }

    fn send(&self, command: Command) -> Result<()> {
        self.commands.send(command).map_err(|_| stopped())
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

pub(super) fn stopped() -> Error {
    SchedError::Stopped { reason: "the engine's loop has stopped".into() }.into()
}
