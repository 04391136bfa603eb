//! The served engine under several threads: random requests (shared prefixes,
//! prefills and greedy or seeded generations) submitted from up to three
//! threads, some read to the end, some aborted after a few events, some whose
//! handle is dropped at once; a pool small enough to evict and preempt. After
//! every thread joined, `validate()` holds, nothing is pending, and every
//! request read to its end returned exactly what the same request returns run
//! alone on an engine with caching off (tokens, every hidden row and the
//! logits, to the last bit on this CPU backend).
//!
//! Cases default to 96 (about 1.5 s; a held stream whose blocks another request needs shows within 100); scale with `PROPTEST_CASES`.

use std::sync::Arc;

use omniprefix::engine::{Engine, EngineConfig, Event, Output, Request, ServedEngine, ServedOptions};
use omniprefix::model::{CaptureName, Config};
use omniprefix::sample::SamplingParams;
use proptest::prelude::*;
use proptest::test_runner::Config as PtConfig;

const HIDDEN: usize = 32;
const VOCAB: usize = 256;
const BLOCK: usize = 4;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(96)
}

/// What a thread does with a request's handle.
#[derive(Debug, Clone, Copy)]
enum Reading {
    /// Read every event; the output is checked.
    ToTheEnd,
    /// Read this many events, then abort.
    AbortAfter(usize),
    /// Drop the handle at once (an abort).
    Drop,
}

#[derive(Debug, Clone)]
struct Job {
    /// Leading ids of the case's base it shares, then its own tail.
    shared: usize,
    tail: Vec<u32>,
    /// Tokens to generate (0: a prefill) and the seed (None: greedy).
    generate: usize,
    seed: Option<u64>,
    reading: Reading,
}

#[derive(Debug, Clone)]
struct Case {
    base: Vec<u32>,
    /// Jobs per thread, each thread submitting its own in order.
    threads: Vec<Vec<Job>>,
    /// Blocks beyond what the largest request needs alone (few: eviction and preemption).
    spare_blocks: usize,
    buffer_events: usize,
}

fn job() -> impl Strategy<Value = Job> {
    let reading = prop_oneof![6 => Just(Reading::ToTheEnd), 2 => (0usize..4).prop_map(Reading::AbortAfter), 1 => Just(Reading::Drop)];
    (0usize..16, prop::collection::vec(0u32..240, 1..8), prop_oneof![Just(0usize), 1usize..10], prop::option::of(0u64..100), reading)
        .prop_map(|(shared, tail, generate, seed, reading)| Job { shared, tail, generate, seed, reading })
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(0u32..240, 16),
        prop::collection::vec(prop::collection::vec(job(), 1..4), 1..4),
        0usize..6,
        prop_oneof![Just(1usize), Just(4), Just(256)],
    )
        .prop_map(|(base, threads, spare_blocks, buffer_events)| Case { base, threads, spare_blocks, buffer_events })
}

fn model() -> Config {
    Config::tiny_qwen3(HIDDEN, 2, 4, 2, VOCAB)
}

fn config(cache: bool, num_blocks: usize) -> EngineConfig {
    EngineConfig {
        block_size: BLOCK,
        num_blocks,
        max_tokens_per_step: 8,
        // Prompts beside decodes go 3 tokens a step: chunked across steps.
        prefill_cap: Some(3),
        max_seqs_per_step: 3,
        cache,
        capture: Some(vec![CaptureName::Hidden(0), CaptureName::Final]),
        ..Default::default()
    }
}

fn request(base: &[u32], job: &Job) -> Request<'static> {
    let prompt = [&base[..job.shared], &job.tail[..]].concat();
    let request = Request::text(prompt);
    if job.generate == 0 {
        return request;
    }
    let params = match job.seed {
        Some(seed) => SamplingParams { temperature: 1.5, seed: Some(seed), ..SamplingParams::greedy(job.generate) },
        None => SamplingParams::greedy(job.generate),
    };
    request.generate(SamplingParams { ignore_eos: true, ..params })
}

/// Runs one thread's jobs; the outputs of the jobs read to their end.
fn run_thread(served: &ServedEngine, base: &[u32], jobs: &[Job]) -> Result<Vec<(Job, Output)>, String> {
    let mut outputs = Vec::new();
    for job in jobs {
        let mut handle = served.submit(request(base, job)).map_err(|e| e.to_string())?;
        match job.reading {
            Reading::Drop => drop(handle),
            Reading::AbortAfter(n) => {
                for _ in 0..n {
                    if handle.recv().is_none() {
                        break;
                    }
                }
                handle.abort();
            }
            Reading::ToTheEnd => {
                let mut tokens = Vec::new();
                let mut finished = None;
                while let Some(event) = handle.recv() {
                    match event.map_err(|e| e.to_string())? {
                        Event::Token(t) => tokens.push(t.token),
                        Event::Finished(out) => finished = Some(out),
                    }
                }
                let out = finished.ok_or("a stream ended without its output")?;
                if tokens != out.tokens {
                    return Err(format!("streamed {tokens:?}, output {:?}", out.tokens));
                }
                outputs.push((job.clone(), out));
            }
        }
    }
    Ok(outputs)
}

fn check(case: &Case) -> Result<(), TestCaseError> {
    let fail = |e: String| TestCaseError::fail(e);
    // The largest request alone: its prompt and the positions its tokens take.
    let largest = case.threads.iter().flatten().map(|j| j.shared + j.tail.len() + j.generate).max().unwrap_or(1);
    let num_blocks = largest.div_ceil(BLOCK) + case.spare_blocks;
    let engine = Engine::random(model(), 3, config(true, num_blocks)).map_err(|e| fail(e.to_string()))?;
    let served = Arc::new(engine.serve(ServedOptions { buffer_events: case.buffer_events, ..ServedOptions::default() }).map_err(|e| fail(e.to_string()))?);
    let threads: Vec<_> = case
        .threads
        .iter()
        .map(|jobs| {
            let (served, base, jobs) = (Arc::clone(&served), case.base.clone(), jobs.clone());
            std::thread::spawn(move || run_thread(&served, &base, &jobs))
        })
        .collect();
    let mut finished = Vec::new();
    for thread in threads {
        finished.extend(thread.join().map_err(|_| fail("a submitting thread panicked".into()))?.map_err(fail)?);
    }
    served.validate().map_err(|e| fail(e.to_string()))?;
    // Nothing pending: a reset is allowed only then.
    served.reset_cache().map_err(|e| fail(format!("after every thread joined: {e}")))?;

    let mut reference = Engine::random(model(), 3, config(false, 64)).map_err(|e| fail(e.to_string()))?;
    for (job, got) in finished {
        let want = reference.run(request(&case.base, &job)).map_err(|e| fail(e.to_string()))?;
        prop_assert_eq!(&got.tokens, &want.tokens, "{:?}", job);
        prop_assert_eq!(got.hidden.len(), want.hidden.len());
        for ((name, g), (_, w)) in got.hidden.iter().zip(&want.hidden) {
            prop_assert!(g == w, "{:?}: {} differs from the uncached run", job, name);
        }
        prop_assert!(got.last_logits == want.last_logits, "{:?}: logits", job);
    }
    Ok(())
}

proptest! {
    #![proptest_config(PtConfig { cases: cases(), ..PtConfig::default() })]

    #[test]
    fn served_requests_from_threads_equal_their_uncached_runs(case in case()) {
        check(&case)?;
    }
}
