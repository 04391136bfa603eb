//! A served request's handle: its events in order, read blocking or async,
//! with the reader's side of backpressure; dropping it aborts the request.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;

use super::channel::{Command, Flow, HandleEvent};
use super::output::{Event, Output};
use crate::batch::RequestId;
use crate::error::{Result, SchedError};

/// A request's events, in order: its tokens (with their hidden rows), then
/// [`Event::Finished`]; or the error that ended it. Dropping the handle before
/// the end aborts the request.
pub struct RequestHandle {
    id: RequestId,
    events: async_channel::Receiver<HandleEvent>,
    flow: Arc<Flow>,
    commands: Sender<Command>,
    done: bool,
}

impl RequestHandle {
    pub(super) fn new(
        id: RequestId, events: async_channel::Receiver<HandleEvent>, flow: Arc<Flow>,
        commands: Sender<Command>,
    ) -> Self {
        RequestHandle { id, events, flow, commands, done: false }
    }

    /// The id the request runs under.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The next event, waiting for it; `None` after the last one.
    pub fn recv(&mut self) -> Option<HandleEvent> {
        if self.done {
            return None;
        }
        let event = self.events.recv_blocking().ok();
        self.took(event)
    }

    /// The next event if one is buffered, without waiting; `None` when none is
    /// (then [`is_done`](Self::is_done) tells whether the stream ended).
    pub fn try_recv(&mut self) -> Option<HandleEvent> {
        if self.done {
            return None;
        }
        match self.events.try_recv() {
            Ok(event) => self.took(Some(event)),
            Err(async_channel::TryRecvError::Empty) => None,
            Err(async_channel::TryRecvError::Closed) => self.took(None),
        }
    }

    /// The next event, awaited; `None` after the last one. Works on any async runtime.
    pub async fn next(&mut self) -> Option<HandleEvent> {
        if self.done {
            return None;
        }
        let event = self.events.recv().await.ok();
        self.took(event)
    }

    /// Reads to the end and returns the request's output (its tokens were in it).
    pub fn wait(mut self) -> Result<Output> {
        while let Some(event) = self.recv() {
            if let Event::Finished(output) = event? {
                return Ok(output);
            }
        }
        Err(SchedError::UnknownRequest { id: self.id }.into())
    }

    /// Aborts the request now (dropping the handle does the same).
    pub fn abort(mut self) {
        self.abort_now();
    }

    /// Something that aborts this request from anywhere, e.g. while another
    /// thread waits in [`recv`](Self::recv) (which then returns `None`).
    pub fn aborter(&self) -> Aborter {
        Aborter { id: self.id, commands: self.commands.clone() }
    }

    /// True once the last event was read (or the request was aborted).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Events buffered and not read yet.
    pub fn buffered(&self) -> usize {
        self.events.len()
    }

    fn abort_now(&mut self) {
        if !self.done {
            self.done = true;
            let _ = self.commands.send(Command::Abort(self.id));
        }
    }

    /// Bookkeeping after a read: the end, and backpressure release.
    fn took(&mut self, event: Option<HandleEvent>) -> Option<HandleEvent> {
        match &event {
            None | Some(Err(_)) | Some(Ok(Event::Finished(_))) => self.done = true,
            Some(Ok(Event::Token(_) | Event::Audio(_))) => {
                if self.events.len() <= self.flow.capacity / 2 && self.flow.held.swap(false, Ordering::AcqRel)
                {
                    let _ = self.commands.send(Command::Release(self.id));
                }
            }
        }
        event
    }
}

/// Aborts one request of a served engine; cloneable, usable from any thread.
#[derive(Clone)]
pub struct Aborter {
    id: RequestId,
    commands: Sender<Command>,
}

impl Aborter {
    /// Aborts the request if it is still pending; its handle's stream ends.
    pub fn abort(&self) {
        let _ = self.commands.send(Command::Abort(self.id));
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        self.abort_now();
    }
}
