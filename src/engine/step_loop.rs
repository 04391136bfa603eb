//! The served engine's loop: commands between steps, steps while anything
//! can run, each step's events handed to their handles (holding a request
//! whose buffer filled), failures handed to the requests they dropped.

use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, OnceLock};

use fxhash::FxHashMap;

use super::channel::{Command, Core, Route, dead};
use super::output::Event;
use crate::batch::RequestId;
use crate::error::{Error, SchedError};

/// The environment variable the default [`ServedOptions`](super::ServedOptions) reads its test-only
/// step fault from (debug builds; see [`ServedOptions::fault_step_panic`](super::ServedOptions::fault_step_panic)).
pub const FAULT_STEP_PANIC_ENV: &str = "OMNIPREFIX_FAULT_STEP_PANIC";

/// What the loop shares with its [`ServedEngine`](super::ServedEngine), and its test fault.
pub(super) struct LoopState {
    /// Set with the panic's message when a step panicked, before the loop ends.
    pub(super) dead: Arc<OnceLock<String>>,
    /// Debug builds: this step (1-based) panics ([`ServedOptions::fault_step_panic`](super::ServedOptions)).
    pub(super) fault_step_panic: Option<u64>,
}

/// The loop: commands between steps; steps while anything can run; waits for
/// a command otherwise. Ends when every sender is gone (the engine and all
/// handles dropped) or the core panicked (the engine is then dead).
pub(super) fn run(mut core: Box<dyn Core>, inbox: Receiver<Command>, state: LoopState) {
    let mut routes: FxHashMap<RequestId, Route> = FxHashMap::default();
    let fault = state.fault_step_panic.filter(|_| cfg!(debug_assertions));
    let mut steps = 0u64;
    loop {
        // Wait only when nothing can run; otherwise take what is queued.
        let first = if core.has_runnable() {
            inbox.try_recv().ok()
        } else {
            match inbox.recv() {
                Ok(command) => Some(command),
                Err(_) => break,
            }
        };
        for command in first.into_iter().chain(std::iter::from_fn(|| inbox.try_recv().ok())) {
            if let Command::Shutdown = command {
                for (id, route) in routes.drain() {
                    let _ = core.abort(id);
                    let _ = route
                        .send(Err(SchedError::Stopped { reason: "the engine was dropped".into() }.into()));
                }
                return;
            }
            handle_command(&mut *core, &mut routes, command);
        }
        if !core.has_runnable() {
            continue;
        }
        steps += 1;
        let stepped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if fault == Some(steps) {
                panic!("test fault: step {steps} panics ({FAULT_STEP_PANIC_ENV})");
            }
            core.step()
        }));
        match stepped {
            Ok(Ok(events)) => dispatch(&mut *core, &mut routes, events),
            Ok(Err(error)) => fail_lost(&mut *core, &mut routes, error),
            Err(panic) => return die(&mut *core, routes, &state.dead, crate::error::panic_message(&*panic)),
        }
    }
}

/// A step panicked: the core's state can no longer be trusted. Marks the
/// engine dead (every later call fails), fails every pending request with
/// [`SchedError::EngineDead`], and withdraws the published blocks from
/// routers (`AllBlocksCleared`), so none is routed here for a cache it lost.
fn die(
    core: &mut dyn Core, routes: FxHashMap<RequestId, Route>, dead_state: &OnceLock<String>, message: String,
) {
    let _ = dead_state.set(message.clone());
    for (_, route) in routes {
        let _ = route.send(Err(dead(&message)));
    }
    // The publisher is apart from the state that panicked; if it panics too, nothing more is lost.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| core.withdraw_kv_events()));
}

fn handle_command(core: &mut dyn Core, routes: &mut FxHashMap<RequestId, Route>, command: Command) {
    match command {
        Command::Submit { prepared, mut route, ready, reply } => {
            let admitted = core.submit_prepared(*prepared);
            if let Ok(id) = admitted {
                route.ready = ready.map(|ready| (id, ready));
                routes.insert(id, route);
            }
            if let Err(lost) = reply.send(admitted)
                && let Ok(id) = lost.0
            {
                // The submitter is gone: nobody will read this request.
                routes.remove(&id);
                let _ = core.abort(id);
            }
        }
        Command::Abort(id) => {
            if routes.remove(&id).is_some() {
                let _ = core.abort(id);
            }
        }
        Command::Release(id) => {
            if routes.contains_key(&id) {
                let _ = core.hold(id, false);
            }
        }
        Command::Call(f) => f(core),
        Command::Shutdown => {}
    }
}

/// Hands a step's events to their handles; holds a request whose buffer
/// filled, aborts one whose handle is gone.
fn dispatch(core: &mut dyn Core, routes: &mut FxHashMap<RequestId, Route>, events: Vec<Event>) {
    for event in events {
        let id = event.request();
        let finished = matches!(event, Event::Finished(_));
        let Some(route) = routes.get(&id) else { continue };
        if route.send(Ok(event)).is_err() {
            routes.remove(&id);
            if !finished {
                let _ = core.abort(id);
            }
            continue;
        }
        if finished {
            routes.remove(&id);
        } else if route.events.len() >= route.flow.capacity && !route.flow.held.swap(true, Ordering::AcqRel) {
            let _ = core.hold(id, true);
        }
    }
}

/// A failed step: the requests it dropped get the error (the first one the
/// error itself, the others its message); when it dropped none, every pending
/// request is aborted and told, so a broken step cannot repeat forever.
fn fail_lost(core: &mut dyn Core, routes: &mut FxHashMap<RequestId, Route>, error: Error) {
    let mut lost: Vec<RequestId> = routes.keys().copied().filter(|&id| !core.is_pending(id)).collect();
    if lost.is_empty() {
        lost = routes.keys().copied().collect();
        for &id in &lost {
            let _ = core.abort(id);
        }
    }
    lost.sort_unstable();
    let reason = error.to_string();
    let mut error = Some(error);
    for id in lost {
        if let Some(route) = routes.remove(&id) {
            let e =
                error.take().unwrap_or_else(|| SchedError::StepFailed { id, reason: reason.clone() }.into());
            let _ = route.send(Err(e));
        }
    }
}
