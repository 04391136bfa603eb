//! The served engine under several threads: random requests (shared prefixes,
//! prefills and greedy or seeded generations) submitted from up to three
//! threads, some read to the end, some aborted after a few events, some whose
//! handle is dropped at once; a pool small enough to evict and preempt. After
//! every thread joined, `validate()` holds, nothing is pending, and every
//! request read to its end returned exactly what the same request returns run
//! alone on an engine with caching off (tokens, every hidden row and the
//! logits, to the last bit on this CPU backend).
//!
//! A quarter of the cases (and some jobs of the others) hold a stream on
//! purpose: its thread reads it only after its later jobs, so once its buffer
//! fills it is held, and in those cases the next job cannot fit beside it (a
//! pool sized for the larger request alone): the scheduler must park the held
//! stream to run it, and the case checks that it preempted. Without them the
//! random cases reached a held stream whose blocks another request needs too
//! rarely: a stream that was never parked passed 400 cases.
//!
//! Cases default to 96 (under a second); scale with `PROPTEST_CASES`.

use std::sync::Arc;

use omniprefix::engine::{
    Engine, EngineConfig, Event, Output, Request, RequestHandle, ServedEngine, ServedOptions,
};
use omniprefix::model::{CaptureName, Config};
use omniprefix::sample::SamplingParams;
use omniprefix::sched::{PrefillCap, SchedulerConfig};
use proptest::prelude::*;
use proptest::test_runner::Config as PtConfig;

const HIDDEN: usize = 32;
const VOCAB: usize = 256;
const BLOCK: usize = 4;

/// What a thread does with a request's handle.
#[derive(Debug, Clone, Copy)]
enum Reading {
    /// Read every event; the output is checked.
    ToTheEnd,
    /// Read this many events, then abort.
    AbortAfter(usize),
    /// Drop the handle at once (an abort).
    Drop,
    /// Keep the handle unread until the thread's later jobs are done, then
    /// read it to the end (checked): held once its buffer fills.
    Later,
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
    /// A held stream and a request that cannot fit beside it: parking is the only way on.
    must_park: bool,
}

fn job() -> impl Strategy<Value = Job> {
    let reading = prop_oneof![
        6 => Just(Reading::ToTheEnd),
        2 => (0usize..4).prop_map(Reading::AbortAfter),
        1 => Just(Reading::Drop),
        1 => Just(Reading::Later),
    ];
    (
        0usize..16,
        prop::collection::vec(0u32..240, 1..8),
        prop_oneof![Just(0usize), 1usize..10],
        prop::option::of(0u64..100),
        reading,
    )
        .prop_map(|(shared, tail, generate, seed, reading)| Job {
            shared,
            tail,
            generate,
            seed,
            reading,
        })
}

fn random_case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(0u32..240, 16),
        prop::collection::vec(prop::collection::vec(job(), 1..4), 1..4),
        0usize..6,
        prop_oneof![Just(1usize), Just(4), Just(256)],
    )
        .prop_map(|(base, threads, spare_blocks, buffer_events)| Case {
            base,
            threads,
            spare_blocks,
            buffer_events,
            must_park: false,
        })
}

/// One thread: a stream `held` read only after `next`, which cannot fit beside
/// it. `held`: a 5..10-token prompt of its own (first id 240 or over, which no
/// other prompt uses: nothing shared), two tokens more than its buffer, at most 16
/// positions; `next`: the whole base and a tail, then 4..10 tokens, at least
/// 21 positions, so the pool is sized for it alone (no spare block) and its
/// blocks and the held prompt's (two or more) exceed the pool. `next` cannot
/// run to its end before `held` is held (it decodes 4 steps or more, `held`
/// is older and prefills first), and `held` is never read until `next` ends.
fn held_case() -> impl Strategy<Value = Case> {
    // A held stream gets at most one more token: two more than its buffer and it is held unfinished.
    let buffered = prop_oneof![(Just(1usize), 3usize..8), (Just(4usize), 6usize..8)];
    (
        prop::collection::vec(0u32..240, 16),
        (240u32..256, prop::collection::vec(0u32..240, 4..9), buffered, prop::option::of(0u64..100)),
        (prop::collection::vec(0u32..240, 1..8), 4usize..10, prop::option::of(0u64..100)),
    )
        .prop_map(
            |(base, (first, rest, (buffer_events, generate), seed), (tail, next_generate, next_seed))| {
                let held = Job {
                    shared: 0,
                    tail: [vec![first], rest].concat(),
                    generate,
                    seed,
                    reading: Reading::Later,
                };
                let next = Job {
                    shared: 16,
                    tail,
                    generate: next_generate,
                    seed: next_seed,
                    reading: Reading::ToTheEnd,
                };
                Case {
                    base,
                    threads: vec![vec![held, next]],
                    spare_blocks: 0,
                    buffer_events,
                    must_park: true,
                }
            },
        )
}

fn case() -> impl Strategy<Value = Case> {
    prop_oneof![3 => random_case(), 1 => held_case()]
}

fn model() -> Config {
    Config::tiny_qwen3(HIDDEN, 2, 4, 2, VOCAB)
}

fn config(cache: bool, num_blocks: usize) -> EngineConfig {
    EngineConfig {
        scheduler: SchedulerConfig {
            block_size: BLOCK,
            num_blocks,
            max_tokens_per_step: 8,
            max_seqs_per_step: 3,
            // Prompts beside decodes go 3 tokens a step: chunked across steps.
            prefill_cap: PrefillCap::Tokens(3),
            ..Default::default()
        },
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
        Some(seed) => {
            SamplingParams { temperature: 1.5, seed: Some(seed), ..SamplingParams::greedy(job.generate) }
        }
        None => SamplingParams::greedy(job.generate),
    };
    request.generate(SamplingParams { ignore_eos: true, ..params })
}

/// Runs one thread's jobs; the outputs of the jobs read to their end.
fn run_thread(served: &ServedEngine, base: &[u32], jobs: &[Job]) -> Result<Vec<(Job, Output)>, String> {
    let mut outputs = Vec::new();
    let mut later = Vec::new();
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
            Reading::ToTheEnd => outputs.push((job.clone(), read_to_the_end(&mut handle)?)),
            Reading::Later => later.push((job.clone(), handle)),
        }
    }
    for (job, mut handle) in later {
        let out = read_to_the_end(&mut handle)
            .map_err(|e| format!("{job:?}, read after the thread's other jobs: {e}"))?;
        outputs.push((job, out));
    }
    Ok(outputs)
}

/// Every event of `handle`: the output, checked against the tokens streamed.
fn read_to_the_end(handle: &mut RequestHandle) -> Result<Output, String> {
    let mut tokens = Vec::new();
    let mut finished = None;
    while let Some(event) = handle.recv() {
        match event.map_err(|e| e.to_string())? {
            Event::Token(t) => tokens.push(t.token),
            Event::Finished(out) => finished = Some(out),
            Event::Audio(_) => return Err("no audio was asked".into()),
        }
    }
    let out = finished.ok_or("a stream ended without its output")?;
    if tokens != out.tokens {
        return Err(format!("streamed {tokens:?}, output {:?}", out.tokens));
    }
    Ok(out)
}

fn check(case: &Case) -> Result<(), TestCaseError> {
    let fail = |e: String| TestCaseError::fail(e);
    // The largest request alone: its prompt and the positions its tokens take.
    let largest =
        case.threads.iter().flatten().map(|j| j.shared + j.tail.len() + j.generate).max().unwrap_or(1);
    let num_blocks = largest.div_ceil(BLOCK) + case.spare_blocks;
    let engine = Engine::random(model(), 3, config(true, num_blocks)).map_err(|e| fail(e.to_string()))?;
    let served = Arc::new(
        engine
            .serve(ServedOptions { buffer_events: case.buffer_events, ..ServedOptions::default() })
            .map_err(|e| fail(e.to_string()))?,
    );
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
        finished
            .extend(thread.join().map_err(|_| fail("a submitting thread panicked".into()))?.map_err(fail)?);
    }
    served.validate().map_err(|e| fail(e.to_string()))?;
    if case.must_park {
        let preemptions = served.stats().map_err(|e| fail(e.to_string()))?.sched.preemptions;
        prop_assert!(
            preemptions > 0,
            "a request that cannot fit beside a held stream ran, yet nothing was parked or preempted"
        );
    }
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
    #![proptest_config(PtConfig { cases: support::cases(96), ..PtConfig::default() })]

    #[test]
    fn served_requests_from_threads_equal_their_uncached_runs(case in case()) {
        check(&case)?;
    }
}
