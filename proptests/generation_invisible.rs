//! Caching is invisible to generation. Random conversations (requests sharing
//! random prefixes, some re-sending an earlier reply), random block sizes,
//! token budgets and prefill caps beside decodes, batch widths and pool sizes small enough to force
//! preemption, greedy or seeded sampling: every request's tokens and every
//! hidden row equal those of the same request run alone with caching off, to
//! the last bit on this CPU backend; `validate()` holds after every step.
//!
//! About a quarter of the cases preempt (measured: 52 of 200). Cases default
//! to 32 (under a second); scale with `PROPTEST_CASES`.

use omniprefix::engine::{Engine, EngineConfig, Event, Output, Request};
use omniprefix::model::{CaptureName, Config};
use omniprefix::sample::SamplingParams;
use omniprefix::sched::{PrefillCap, SchedulerConfig};
use proptest::prelude::*;
use proptest::test_runner::Config as PtConfig;
use support::sampling::greedy_or_seeded;

const HIDDEN: usize = 32;
const VOCAB: usize = 256;

#[derive(Debug, Clone)]
struct Case {
    moe: bool,
    block_size: usize,
    budget: usize,
    /// Prefill tokens beside decodes (1 to the budget; `None`: the engine's default).
    prefill_cap: Option<usize>,
    seqs: usize,
    /// Blocks beyond what the largest request needs alone (small: preemption).
    spare_blocks: usize,
    base: Vec<u32>,
    /// Per request: leading ids of `base` it shares, its own tail, tokens to generate, seed (None: greedy).
    requests: Vec<(usize, Vec<u32>, usize, Option<u64>)>,
    /// Re-send the first request's prompt + reply as one more request.
    follow_up: bool,
}

fn case() -> impl Strategy<Value = Case> {
    let request =
        (0usize..24, prop::collection::vec(0u32..240, 1..10), 1usize..12, prop::option::of(0u64..1000));
    (
        any::<bool>(),
        prop_oneof![Just(1usize), Just(2), Just(4), Just(16)],
        (1usize..24, prop::option::of(1usize..24)),
        1usize..4,
        0usize..3,
        prop::collection::vec(0u32..240, 24),
        prop::collection::vec(request, 1..6),
        any::<bool>(),
    )
        .prop_map(|(moe, block_size, (budget, cap), seqs, spare_blocks, base, requests, follow_up)| {
            Case {
                moe,
                block_size,
                budget,
                prefill_cap: cap.map(|c| 1 + (c - 1) % budget),
                seqs,
                spare_blocks,
                base,
                requests,
                follow_up,
            }
        })
}

fn params(n: usize, seed: Option<u64>) -> SamplingParams {
    greedy_or_seeded(SamplingParams { ignore_eos: true, ..SamplingParams::greedy(n) }, seed)
}

fn engine(case: &Case, cache: bool, num_blocks: usize) -> Result<Engine, TestCaseError> {
    let model = if case.moe {
        Config::tiny_qwen3_omni_moe(HIDDEN, 2, 4, 2, VOCAB, 4, 2)
    } else {
        Config::tiny_qwen3(HIDDEN, 2, 4, 2, VOCAB)
    };
    let config = EngineConfig {
        scheduler: SchedulerConfig {
            block_size: case.block_size,
            num_blocks,
            max_tokens_per_step: case.budget,
            prefill_cap: case.prefill_cap.map_or(PrefillCap::Auto, PrefillCap::Tokens),
            max_seqs_per_step: case.seqs,
            ..Default::default()
        },
        cache,
        capture: Some(vec![CaptureName::Hidden(1), CaptureName::Final]),
        ..Default::default()
    };
    Engine::random(model, 3, config).map_err(|e| TestCaseError::fail(e.to_string()))
}

fn fail(e: omniprefix::Error) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// Runs `prompts` on `engine` all at once, stepping to the end; generations by request order.
fn run_all(
    engine: &mut Engine, prompts: &[(Vec<u32>, SamplingParams)],
) -> Result<Vec<Output>, TestCaseError> {
    for (p, s) in prompts {
        engine.submit(Request::text(p.clone()).generate(s.clone())).map_err(fail)?;
    }
    let mut got = Vec::new();
    while engine.has_pending() {
        for event in engine.step().map_err(fail)? {
            if let Event::Finished(g) = event {
                got.push(g);
            }
        }
        engine.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    got.sort_by_key(|g| g.request);
    Ok(got)
}

fn same(what: &str, got: &Output, want: &Output) -> Result<(), TestCaseError> {
    prop_assert_eq!(&got.tokens, &want.tokens, "{}: tokens", what);
    for ((name, g), (_, w)) in got.hidden.iter().zip(&want.hidden) {
        prop_assert_eq!(g.dim(), w.dim(), "{}: {} shape", what, name);
        prop_assert!(g == w, "{}: {} rows differ", what, name);
    }
    Ok(())
}

fn check(case: &Case) -> Result<(), TestCaseError> {
    let prompts: Vec<(Vec<u32>, SamplingParams)> = case
        .requests
        .iter()
        .map(|(shared, tail, n, seed)| ([&case.base[..*shared], &tail[..]].concat(), params(*n, *seed)))
        .collect();
    // Just enough for the largest request alone (and the follow-up), so
    // several at once run out of blocks and preempt.
    let follow_up = prompts[0].0.len() + prompts[0].1.max_tokens + 2 + 2;
    let longest = prompts.iter().map(|(p, s)| s.positions_needed(p.len())).max().unwrap_or(1).max(follow_up);
    let num_blocks = longest.div_ceil(case.block_size) + case.spare_blocks;
    // The reference: caching off, each request alone.
    let mut plain = engine(case, false, num_blocks)?;
    let mut want = Vec::new();
    for p in &prompts {
        want.extend(run_all(&mut plain, std::slice::from_ref(p))?);
    }
    let mut cached = engine(case, true, num_blocks)?;
    let got = run_all(&mut cached, &prompts)?;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        same(&format!("request {i}"), g, w)?;
    }
    if case.follow_up {
        let (first, s) = &prompts[0];
        let resent = [&first[..], &got[0].tokens[..], &[7, 8][..]].concat();
        let again = (resent, params(3, s.seed));
        let want_next = run_all(&mut plain, std::slice::from_ref(&again))?;
        let got_next = run_all(&mut cached, std::slice::from_ref(&again))?;
        same("follow-up", &got_next[0], &want_next[0])?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(PtConfig { cases: support::cases(32), ..PtConfig::default() })]

    #[test]
    fn generation_is_the_same_with_caching_on_and_off(case in case()) {
        check(&case)?;
    }
}
