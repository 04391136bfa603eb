//! What the served engine's three parts share: the commands its callers send
//! the loop, the route a request's events take back to its handle, and the
//! core the loop steps. It sits below `served.rs`, `handle.rs` and
//! `step_loop.rs`, so none of them imports another for these.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{Sender, SyncSender};

use super::output::Event;
use super::prepare::Prepared;
use super::{Engine, EngineStats};
use crate::backend::Backend;
use crate::batch::RequestId;
use crate::error::{Error, InvariantViolation, Result, SchedError};
use crate::events::PublisherStats;

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
    /// After a panic: tells routers every published block is gone, and stops publishing.
    fn withdraw_kv_events(&mut self);
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
    fn withdraw_kv_events(&mut self) {
        Engine::withdraw_kv_events(self)
    }
}

/// A call run on the loop's thread between two steps.
pub(super) type Call = Box<dyn FnOnce(&mut dyn Core) + Send>;

pub(super) enum Command {
    /// `ready`: where the route tells the request's id (set once it has one).
    /// The prepared request is boxed: it is large, and every other command is small.
    Submit {
        prepared: Box<Prepared>,
        route: Route,
        ready: Option<ReadySender>,
        reply: SyncSender<Result<RequestId>>,
    },
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
    /// Told the request's id after each event and when the route closes.
    pub(super) ready: Option<(RequestId, ReadySender)>,
}

impl Route {
    /// Hands `event` to the handle (an error once the handle is gone) and tells
    /// the reader watching it, if any.
    pub(super) fn send(&self, event: HandleEvent) -> std::result::Result<(), ()> {
        let sent = self.events.try_send(event).map_err(|_| ());
        self.notify();
        sent
    }

    fn notify(&self) {
        if let Some((id, ready)) = &self.ready {
            let _ = ready.send(*id);
        }
    }
}

impl Drop for Route {
    /// A closed route ends its handle's stream: its watcher must look once more.
    fn drop(&mut self) {
        self.events.close();
        self.notify();
    }
}

/// Where a served engine tells one reader which of its requests have events to
/// read (see [`ServedEngine::submit_prepared_notify`](super::ServedEngine::submit_prepared_notify)): one thread can then
/// serve any number of handles, reading each with [`RequestHandle::try_recv`](super::RequestHandle::try_recv).
/// An id may be told more than once, and after its stream ended.
pub type ReadySender = Sender<RequestId>;

/// Backpressure state shared by the loop and a handle.
pub(super) struct Flow {
    /// Set by the loop when the buffer filled; cleared by the reader, which
    /// then asks the loop to release the request.
    pub(super) held: AtomicBool,
    pub(super) capacity: usize,
}

pub(super) fn stopped() -> Error {
    SchedError::Stopped { reason: "the engine's loop has stopped".into() }.into()
}

/// The error every call of a dead engine gets.
pub(super) fn dead(reason: &str) -> Error {
    SchedError::EngineDead { reason: format!("a step panicked: {reason}") }.into()
}
