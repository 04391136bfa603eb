//! The served engine: the core on its own thread, a handle per request.
//! Its outputs equal the core's; a stream nobody reads keeps generating up to
//! its buffer (256 events by default) and then holds; a dropped handle aborts; an encoder blocked on
//! one thread does not stop another thread's stream; bad encoder output
//! (non-finite rows) is a typed error that caches nothing.

use std::error::Error as StdError;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ndarray::Array2;
use omniprefix::Error;
use omniprefix::canon::ItemIdentity;
use omniprefix::engine::{
    EncoderOutput, Engine, EngineConfig, Event, Output, Request, ServedEngine, ServedOptions,
};
use omniprefix::error::{EmbeddingPart, RequestError};
use omniprefix::prompt::OmniTokens;
use omniprefix::sample::SamplingParams;

use support::images;

use images::{HIDDEN, image, model, pixels, rows, with_image};
use omniprefix::sched::SchedulerConfig;

type TestResult<T = ()> = Result<T, Box<dyn StdError>>;

fn config() -> EngineConfig {
    EngineConfig {
        scheduler: SchedulerConfig {
            block_size: 4,
            num_blocks: 64,
            max_tokens_per_step: 16,
            max_seqs_per_step: 4,
            ..Default::default()
        },
        tokens: Some(OmniTokens::tiny()),
        ..Default::default()
    }
}

fn core() -> TestResult<Engine> {
    Ok(Engine::random(model(), 3, config())?)
}

fn served(options: ServedOptions) -> TestResult<ServedEngine> {
    Ok(core()?.serve(options)?)
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams { ignore_eos: true, ..SamplingParams::greedy(n) }
}

fn same(got: &Output, want: &Output) -> TestResult {
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(got.hidden.len(), want.hidden.len());
    for ((name, g), (_, w)) in got.hidden.iter().zip(&want.hidden) {
        assert_eq!(g, w, "{name}: the CPU is bit-exact across caching and batching");
    }
    assert_eq!(got.last_logits, want.last_logits);
    Ok(())
}

/// Every event of `handle` in order, the output last.
fn read_all(handle: &mut omniprefix::engine::RequestHandle) -> TestResult<(Vec<u32>, Output)> {
    let mut tokens = Vec::new();
    while let Some(event) = handle.recv() {
        match event? {
            Event::Token(t) => tokens.push(t.token),
            Event::Finished(out) => return Ok((tokens, out)),
            Event::Audio(_) => return Err("no audio was asked".into()),
        }
    }
    Err("the stream ended without its output".into())
}

#[test]
fn served_outputs_equal_the_cores_and_streams_carry_every_token() -> TestResult {
    let prompt: Vec<u32> = (1..14).collect();
    let mut reference = core()?;
    let want_prefill = reference.run(Request::text(prompt.clone()))?;
    let want_generate = reference.run(Request::text(prompt.clone()).generate(greedy(9)))?;

    let served = served(ServedOptions::default())?;
    let got_prefill = served.submit(Request::text(prompt.clone()))?.wait()?;
    same(&got_prefill, &want_prefill)?;
    let mut stream = served.submit(Request::text(prompt).generate(greedy(9)))?;
    let (tokens, got) = read_all(&mut stream)?;
    assert_eq!(tokens, got.tokens);
    same(&got, &want_generate)?;
    assert!(stream.recv().is_none(), "nothing after the output");
    assert_eq!(
        (got.num_cached_tokens, want_generate.num_cached_tokens),
        (12, 12),
        "the same cache hit in both"
    );
    served.validate()?;
    Ok(())
}

#[test]
fn an_unread_stream_keeps_generating() -> TestResult {
    let served = served(ServedOptions::default())?;
    let handle = served.submit(Request::text((1..9).collect()).generate(greedy(40)))?;
    // Nobody reads: the loop still runs the request to its end (40 tokens + the output).
    let deadline = Instant::now() + Duration::from_secs(30);
    while handle.buffered() < 41 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(handle.buffered(), 41);
    assert_eq!(served.stats()?.finished, 1, "finished before anyone read it");
    Ok(())
}

#[test]
fn a_full_buffer_holds_the_stream_until_it_is_read() -> TestResult {
    let want = core()?.run(Request::text((1..9).collect()).generate(greedy(30)))?;
    let served = served(ServedOptions { buffer_events: 4, ..ServedOptions::default() })?;
    let mut handle = served.submit(Request::text((1..9).collect()).generate(greedy(30)))?;
    // Held after at most one more token than the buffer holds.
    std::thread::sleep(Duration::from_millis(300));
    let buffered = handle.buffered();
    assert!((4..=5).contains(&buffered), "{buffered} events buffered, over the limit of 4");
    assert_eq!(served.stats()?.finished, 0);
    // Reading releases it; the output is the one an unheld run gives.
    let (tokens, got) = read_all(&mut handle)?;
    assert_eq!(tokens.len(), 30);
    same(&got, &want)?;
    served.validate()?;
    Ok(())
}

/// The documented default (`ServedOptions::default()`, 256 events a request):
/// an unread stream of a default served engine is held after 256 events (at
/// most one more arrives), long before its 400-token reply ends.
#[test]
fn the_default_buffer_holds_a_stream_at_256_events() -> TestResult {
    assert_eq!(ServedOptions::default().buffer_events, 256);
    // Room for the whole reply: 8 + 400 positions in 4-token blocks.
    let roomy =
        EngineConfig { scheduler: SchedulerConfig { num_blocks: 128, ..config().scheduler }, ..config() };
    let served = Engine::random(model(), 3, roomy)?.serve(ServedOptions::default())?;
    let handle = served.submit(Request::text((1..9).collect()).generate(greedy(400)))?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while handle.buffered() < 256 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    // Held now: give an unheld stream time to run on.
    std::thread::sleep(Duration::from_millis(300));
    let buffered = handle.buffered();
    assert!((256..=257).contains(&buffered), "{buffered} events buffered by default, not 256");
    assert_eq!(served.stats()?.finished, 0, "the unread stream ran to its end");
    Ok(())
}

/// A held stream gives its blocks up when another request needs them: on a
/// pool that holds only one of the two requests, the stream nobody reads is
/// parked (its blocks taken back), the other runs to its end, and the parked
/// one, once read, recomputes and returns what it returns alone.
#[test]
fn a_held_stream_gives_its_blocks_to_a_request_that_needs_them() -> TestResult {
    let tight =
        EngineConfig { scheduler: SchedulerConfig { num_blocks: 5, ..config().scheduler }, ..config() };
    let held_request = || Request::text((1..9).collect()).generate(greedy(8));
    let other_request = || Request::text((20..32).collect()).generate(greedy(4));
    let mut reference = Engine::random(model(), 3, tight.clone())?;
    let (want_held, want_other) = (reference.run(held_request())?, reference.run(other_request())?);

    let served = Engine::random(model(), 3, tight)?
        .serve(ServedOptions { buffer_events: 1, ..ServedOptions::default() })?;
    let mut held = served.submit(held_request())?;
    // Unread: held after its first token, its prompt's blocks locked.
    let deadline = Instant::now() + Duration::from_secs(30);
    while held.buffered() < 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    let mut other = served.submit(other_request())?;
    let (_, got_other) = read_all(&mut other)?;
    same(&got_other, &want_other)?;
    let (_, got_held) = read_all(&mut held)?;
    same(&got_held, &want_held)?;
    served.validate()?;
    assert!(served.stats()?.sched.preemptions >= 1, "the held request was parked");
    Ok(())
}

#[test]
fn dropping_a_handle_aborts_its_request() -> TestResult {
    let served = served(ServedOptions { buffer_events: 2, ..ServedOptions::default() })?;
    let handle = served.submit(Request::text((1..9).collect()).generate(greedy(200)))?;
    std::thread::sleep(Duration::from_millis(50));
    drop(handle);
    // The abort reaches the loop before this call, which runs after it.
    served.validate()?;
    // A reset is refused while anything is pending: it passes, so the request is gone.
    served.reset_cache()?;
    assert_eq!(served.stats()?.finished, 0);
    Ok(())
}

#[test]
fn an_encoder_blocked_on_one_thread_does_not_stall_another_stream() -> TestResult {
    let served = Arc::new(served(ServedOptions::default())?);
    let (release, blocked) = mpsc::channel::<()>();
    let (entered, encoder_running) = mpsc::channel::<()>();
    let submitter = {
        let served = Arc::clone(&served);
        std::thread::spawn(move || -> Result<Output, Error> {
            let content = pixels(9);
            let blocked = std::sync::Mutex::new(blocked);
            let encoder = move |_item: usize, identity: &ItemIdentity| -> omniprefix::Result<Array2<f32>> {
                let _ = entered.send(());
                // Waits for the test (at most 30 s, so a regression fails instead of hanging).
                if let Ok(blocked) = blocked.lock() {
                    let _ = blocked.recv_timeout(Duration::from_secs(30));
                }
                Ok(rows(identity.num_tokens, HIDDEN, 1.0))
            };
            let request = Request {
                token_ids: with_image(&[7], &[8]),
                items: vec![image(&content, None)],
                ..Default::default()
            };
            served.submit(request.with_encoder(encoder))?.wait()
        })
    };
    encoder_running.recv_timeout(Duration::from_secs(30))?;
    // The encoder is inside its call now; a whole generation runs meanwhile.
    let started = Instant::now();
    let mut stream = served.submit(Request::text((20..30).collect()).generate(greedy(24)))?;
    let (tokens, _) = read_all(&mut stream)?;
    assert_eq!(tokens.len(), 24);
    assert!(started.elapsed() < Duration::from_secs(25), "the stream waited for the encoder");
    release.send(())?;
    let out = submitter.join().map_err(|_| "submitter panicked")??;
    assert_eq!(out.prompt_len, 2 + 2 + 4);
    Ok(())
}

#[test]
fn handles_are_read_async() -> TestResult {
    let want = core()?.run(Request::text((1..9).collect()).generate(greedy(6)))?;
    let served = served(ServedOptions::default())?;
    let mut handle = served.submit(Request::text((1..9).collect()).generate(greedy(6)))?;
    let got = pollster::block_on(async {
        let mut tokens = Vec::new();
        while let Some(event) = handle.next().await {
            match event? {
                Event::Token(t) => tokens.push(t.token),
                Event::Finished(out) => return Ok::<_, Error>((tokens, out)),
                Event::Audio(_) => {}
            }
        }
        Err(omniprefix::error::SchedError::UnknownRequest { id: handle.id() }.into())
    })?;
    assert_eq!(got.0, want.tokens);
    same(&got.1, &want)?;
    Ok(())
}

/// NaN in given embeddings, in an encoder's embeddings, or in an encoder's
/// DeepStack rows: a typed error naming the item, part, row and column; nothing
/// is cached, so the same image with good rows afterwards runs as on a fresh engine.
#[test]
fn non_finite_item_rows_are_rejected_before_anything_is_cached() -> TestResult {
    let content = pixels(4);
    let ids = with_image(&[7, 8], &[9, 10, 11]);
    let request = |embeddings| Request {
        token_ids: ids.clone(),
        items: vec![image(&content, embeddings)],
        ..Default::default()
    };
    let mut bad = rows(4, HIDDEN, 0.5);
    bad[[2, 5]] = f32::NAN;
    let mut engine = core()?;
    let before = engine.stats();

    let given = engine.run(request(Some(bad.clone()))).err().ok_or("NaN embeddings accepted")?;
    assert!(
        matches!(
            given,
            Error::Request(RequestError::NonFiniteEmbeddings {
                item: 0,
                what: EmbeddingPart::Embeddings,
                row: 2,
                column: 5
            })
        ),
        "{given}"
    );
    let encoded = engine
        .run(request(None).with_encoder(|_, _: &ItemIdentity| Ok::<_, Error>(bad.clone())))
        .err()
        .ok_or("accepted")?;
    assert!(
        matches!(encoded, Error::Request(RequestError::NonFiniteEmbeddings { row: 2, column: 5, .. })),
        "{encoded}"
    );
    let mut level = rows(4, HIDDEN, 0.9);
    level[[0, 1]] = f32::INFINITY;
    let levels = move |_: usize, _: &ItemIdentity| {
        Ok::<_, Error>(EncoderOutput {
            embeddings: rows(4, HIDDEN, 0.5),
            deepstack: vec![rows(4, HIDDEN, 0.1), level.clone()],
        })
    };
    let deep = engine.run(request(None).with_encoder(levels)).err().ok_or("accepted")?;
    assert!(
        matches!(
            deep,
            Error::Request(RequestError::NonFiniteEmbeddings {
                what: EmbeddingPart::DeepStack { level: 1 },
                row: 0,
                column: 1,
                ..
            })
        ),
        "{deep}"
    );
    assert_eq!(engine.stats(), before, "nothing changed");
    assert!(engine.encoder_cache().is_empty(), "no rows cached");

    // A NaN must not poison the cache: good rows now give what a fresh engine gives.
    let good = engine.run(request(Some(rows(4, HIDDEN, 0.5))).generate(greedy(6)))?;
    let fresh = core()?.run(request(Some(rows(4, HIDDEN, 0.5))).generate(greedy(6)))?;
    same(&good, &fresh)?;
    Ok(())
}

/// A request the served engine refuses, in preparation or at admission, gets
/// an error that names no request id: the caller would only have learnt the
/// engine's number for it from a handle.
#[test]
fn refused_requests_are_not_named_by_the_engines_number() -> TestResult {
    let served = served(ServedOptions::default())?;
    for _ in 0..3 {
        served.submit(Request::text((1..9).collect()))?.wait()?;
    }
    let content = pixels(4);
    let short_rows = Request {
        token_ids: with_image(&[7], &[8]),
        items: vec![image(&content, Some(rows(3, HIDDEN, 0.5)))],
        ..Default::default()
    };
    let err = served.submit(short_rows).err().ok_or("3 rows for a 4-token image accepted")?;
    assert!(
        matches!(
            err,
            Error::Request(RequestError::EmbeddingMismatch { id: None, item: 0, expected: 4, found: 3, .. })
        ),
        "{err}"
    );
    assert_eq!(err.to_string(), "item 0: embedding rows is 3, expected 4");
    // 64 blocks of 4: 257 positions need 65.
    let err =
        served.submit(Request::text(vec![1; 257])).err().ok_or("a request larger than the pool accepted")?;
    assert!(
        matches!(err, Error::Request(RequestError::RequestTooLarge { id: None, needed: 65, num_blocks: 64 })),
        "{err}"
    );
    assert_eq!(err.to_string(), "the sequence needs 65 blocks but the pool holds 64");
    Ok(())
}

#[test]
fn two_threads_preparing_the_same_item_get_whole_rows() -> TestResult {
    let served = Arc::new(served(ServedOptions::default())?);
    let want = core()?.run(Request {
        token_ids: with_image(&[7], &[8, 9]),
        items: vec![image(&pixels(3), Some(rows(4, HIDDEN, 2.0)))],
        ..Default::default()
    })?;
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let served = Arc::clone(&served);
            std::thread::spawn(move || -> Result<Output, Error> {
                let content = pixels(3);
                let encoder = |_: usize, identity: &ItemIdentity| -> omniprefix::Result<Array2<f32>> {
                    std::thread::sleep(Duration::from_millis(20));
                    Ok(rows(identity.num_tokens, HIDDEN, 2.0))
                };
                let request = Request {
                    token_ids: with_image(&[7], &[8, 9]),
                    items: vec![image(&content, None)],
                    ..Default::default()
                };
                served.submit(request.with_encoder(encoder))?.wait()
            })
        })
        .collect();
    for thread in threads {
        let got = thread.join().map_err(|_| "a submitter panicked")??;
        same(&got, &want)?;
    }
    served.validate()?;
    Ok(())
}

/// The test fault of a debug build, on the engine's `step`-th step.
fn dying_at(step: u64) -> TestResult<ServedEngine> {
    served(ServedOptions { fault_step_panic: Some(step), ..ServedOptions::default() })
}

fn is_dead<T>(result: Result<T, Error>) -> bool {
    matches!(result, Err(Error::Sched(omniprefix::error::SchedError::EngineDead { .. })))
}

#[test]
fn a_step_that_panics_kills_the_engine_for_every_pending_and_later_call() -> TestResult {
    if !cfg!(debug_assertions) {
        eprintln!(
            "not run: a_step_that_panics_kills_the_engine (the step fault is compiled out of release builds)"
        );
        return Ok(());
    }
    let served = dying_at(3)?;
    let a = served.submit(Request::text((0..10).collect()).generate(greedy(20)))?;
    // On a loaded machine step 3 can panic before `b` is submitted: then the submission itself
    // is refused as dead, which is the "later call" half of this test.
    let b = served.submit(Request::text((40..52).collect()).generate(greedy(20)));
    let last = |mut h: omniprefix::engine::RequestHandle| {
        let mut end = None;
        while let Some(event) = h.recv() {
            if let Err(e) = event {
                end = Some(e);
            }
        }
        end
    };
    for handle in [Ok(a), b] {
        let end = match handle {
            Ok(handle) => last(handle),
            Err(refused) => Some(refused),
        };
        assert!(
            matches!(end, Some(Error::Sched(omniprefix::error::SchedError::EngineDead { .. }))),
            "{end:?}"
        );
    }
    assert!(served.is_dead());
    assert!(served.death().is_some_and(|m| m.contains("step 3")), "{:?}", served.death());
    assert!(is_dead(served.stats()));
    assert!(is_dead(served.metrics()));
    assert!(is_dead(served.submit(Request::text((0..10).collect()))));
    Ok(())
}

#[test]
fn an_engine_that_never_panicked_is_not_dead() -> TestResult {
    let served = served(ServedOptions::default())?;
    served.submit(Request::text((0..10).collect()).generate(greedy(4)))?.wait()?;
    assert!(!served.is_dead() && served.death().is_none());
    Ok(())
}

#[test]
fn one_reader_follows_many_handles_through_their_ready_ids() -> TestResult {
    let served = served(ServedOptions::default())?;
    let (ready, ids) = mpsc::channel();
    let mut handles = std::collections::HashMap::new();
    let mut want = std::collections::HashMap::new();
    for k in 0..6u32 {
        let prompt: Vec<u32> = (k * 7..k * 7 + 9).collect();
        let prepared = served.prepare(Request::text(prompt.clone()).generate(greedy(5)))?;
        let handle = served.submit_prepared_notify(prepared, ready.clone())?;
        want.insert(handle.id(), core()?.run(Request::text(prompt).generate(greedy(5)))?.tokens);
        handles.insert(handle.id(), (handle, Vec::new()));
    }
    // Only try_recv, woken by the ids: a lost wake-up would hang here, so bound it.
    let deadline = Instant::now() + Duration::from_secs(60);
    // A watcher looks at each new handle once before it waits.
    let mut woken: Vec<u64> = handles.keys().copied().collect();
    while !handles.is_empty() {
        for id in woken.drain(..) {
            let Some((handle, tokens)) = handles.get_mut(&id) else { continue };
            while let Some(event) = handle.try_recv() {
                if let Event::Token(t) = event? {
                    tokens.push(t.token);
                }
            }
            if handle.is_done() {
                let (_, tokens) = handles.remove(&id).unwrap();
                assert_eq!(Some(&tokens), want.get(&id), "request {id}");
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        woken.push(ids.recv_timeout(left).map_err(|_| "no ready id within 60 s: a lost wake-up")?);
    }
    Ok(())
}
