//! Output through the engine: greedy and seeded output is the same with
//! caching on and off, across chunkings, batching and preemption (bit for bit
//! on the CPU backend); a follow-up round reuses the reply to the last
//! position that ran; streaming yields each token with its position's rows;
//! abort mid-decode leaves nothing behind; bad sampling settings are typed
//! errors that change nothing.

use std::error::Error as StdError;

use ndarray::{ArrayD, IxDyn};
use omniprefix::Error;
use omniprefix::engine::{Engine, EngineConfig, Event, ItemInput, Output, Request, TokenEvent};
use omniprefix::error::RequestError;
use omniprefix::model::{CaptureName, Config};
use omniprefix::prompt::OmniTokens;
use omniprefix::sample::{FinishReason, SamplingParams};
use omniprefix::sched::{PrefillCap, SchedulerConfig};

use support::images;

type TestResult<T = ()> = Result<T, Box<dyn StdError>>;

const HIDDEN: usize = 32;
const VOCAB: usize = 512;

fn models() -> Vec<Config> {
    vec![
        Config::tiny_qwen3(HIDDEN, 2, 4, 2, VOCAB),
        Config::tiny_qwen2_omni(HIDDEN, 2, 4, 1, VOCAB),
        Config::tiny_qwen3_omni_moe(HIDDEN, 2, 4, 2, VOCAB, 4, 2),
    ]
}

fn config(cache: bool) -> EngineConfig {
    EngineConfig {
        scheduler: SchedulerConfig {
            block_size: 4,
            num_blocks: 64,
            max_tokens_per_step: 64,
            max_seqs_per_step: 4,
            ..Default::default()
        },
        cache,
        capture: Some(vec![CaptureName::Hidden(0), CaptureName::Hidden(1), CaptureName::Final]),
        tokens: Some(OmniTokens::tiny()),
        ..Default::default()
    }
}

fn engine(model: &Config, config: EngineConfig) -> TestResult<Engine> {
    Ok(Engine::random(model.clone(), 7, config)?)
}

fn text(ids: &[u32]) -> Request<'static> {
    Request::text(ids.to_vec())
}

fn ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + seed * 11 + 5) % 480).collect()
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams { ignore_eos: true, ..SamplingParams::greedy(n) }
}

fn sampled(n: usize, seed: u64) -> SamplingParams {
    SamplingParams { temperature: 0.9, top_k: Some(40), top_p: Some(0.9), seed: Some(seed), ..greedy(n) }
}

/// Steps `e` until nothing is pending, checking its invariants after every
/// step; the finished generations in request order.
fn drain(e: &mut Engine) -> TestResult<Vec<Output>> {
    let mut got = Vec::new();
    while e.has_pending() {
        for event in e.step()? {
            if let Event::Finished(g) = event {
                got.push(g);
            }
        }
        e.validate()?;
    }
    got.sort_by_key(|g| g.request);
    Ok(got)
}

/// Equal tokens and bit-equal hidden rows.
fn assert_same(what: &str, got: &Output, want: &Output) {
    assert_eq!(got.tokens, want.tokens, "{what}: tokens");
    assert_eq!(got.finish_reason, want.finish_reason, "{what}: finish reason");
    assert_eq!(got.hidden.len(), want.hidden.len(), "{what}: captures");
    for ((name, g), (_, w)) in got.hidden.iter().zip(&want.hidden) {
        assert_eq!(g.dim(), w.dim(), "{what}: {name} shape");
        assert!(g == w, "{what}: {name} differs");
    }
}

/// The last token event says why the request stops (and only the last does), the
/// same reason as the output's, with and without `run_last_token` (whose output
/// comes a step after that token), for a length stop and for a stop id.
#[test]
fn the_last_token_event_carries_the_finish_reason() -> TestResult {
    let model = &models()[0];
    let free = engine(model, config(true))?.run(text(&ids(9, 3)).generate(greedy(6)))?;
    let stop = free.tokens[2];
    let stopping = SamplingParams { stop: Some(vec![stop]), ignore_eos: false, ..greedy(6) };
    for run_last_token in [false, true] {
        for (params, want) in [(greedy(6), FinishReason::Length), (stopping.clone(), FinishReason::Stop)] {
            let mut e = engine(model, config(true))?;
            e.submit(text(&ids(9, 3)).generate(SamplingParams { run_last_token, ..params }))?;
            let (mut reasons, mut output) = (Vec::new(), None);
            while e.has_pending() {
                for event in e.step()? {
                    match event {
                        Event::Token(t) => reasons.push(t.finish_reason),
                        Event::Finished(o) => output = Some(o),
                        Event::Audio(_) => return Err("no audio was asked".into()),
                    }
                }
            }
            let output = output.ok_or("no output")?;
            assert_eq!(output.finish_reason, Some(want));
            let mut expected = vec![None; output.tokens.len() - 1];
            expected.push(Some(want));
            assert_eq!(reasons, expected, "run_last_token {run_last_token}, {want:?}");
        }
    }
    Ok(())
}

#[test]
fn generated_hidden_rows_cover_every_position_that_ran() -> TestResult {
    for model in models() {
        let mut e = engine(&model, config(true))?;
        let g = e.run(text(&ids(9, 1)).generate(greedy(5)))?;
        assert_eq!((g.tokens.len(), g.prompt_len, g.finish_reason), (5, 9, Some(FinishReason::Length)));
        for (_, h) in &g.hidden {
            assert_eq!(h.dim(), (9 + 5 - 1, HIDDEN));
        }
        assert_eq!(g.timings.token_times.len(), 5);
        assert_eq!(g.timings.ttft, g.timings.token_times[0]);
        assert_eq!(g.timings.itl().len(), 4);
        let last = e.run(text(&ids(9, 2)).generate(SamplingParams { run_last_token: true, ..greedy(5) }))?;
        assert_eq!(last.hidden[0].1.nrows(), 9 + 5, "run_last_token runs the last token too");
        e.validate()?;
        assert_eq!(e.stats().sched.blocks_in_use, 0);
    }
    Ok(())
}

#[test]
fn caching_chunking_and_batching_leave_greedy_and_seeded_output_bit_equal() -> TestResult {
    for model in models() {
        let prompts = [ids(13, 1), ids(22, 2), [ids(13, 1), ids(6, 3)].concat()];
        let params = [greedy(7), sampled(9, 5), sampled(6, 11)];
        // The reference: caching off, one request at a time, whole prompts per step.
        let mut plain = engine(&model, config(false))?;
        let want: Vec<Output> = prompts
            .iter()
            .zip(&params)
            .map(|(p, s)| plain.run(text(p).generate(s.clone())))
            .collect::<Result<_, _>>()?;
        for (budget, seqs) in [(5, 2), (3, 3), (64, 4)] {
            let mut e = engine(
                &model,
                EngineConfig {
                    scheduler: SchedulerConfig {
                        max_tokens_per_step: budget,
                        max_seqs_per_step: seqs,
                        ..config(true).scheduler
                    },
                    ..config(true)
                },
            )?;
            // Warm the cache with the first prompt, then all three at once.
            e.run(text(&prompts[0]).generate(greedy(3)))?;
            let submitted: Vec<u64> = prompts
                .iter()
                .zip(&params)
                .map(|(p, s)| e.submit(text(p).generate(s.clone())))
                .collect::<Result<_, _>>()?;
            let got = drain(&mut e)?;
            assert_eq!(got.iter().map(|g| g.request).collect::<Vec<_>>(), submitted);
            assert!(got[0].num_cached_tokens > 0, "the warmed prompt hits");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_same(&format!("{} budget {budget} prompt {i}", model.model_type), g, w);
            }
        }
    }
    Ok(())
}

#[test]
fn preempted_sequences_resume_to_the_same_output() -> TestResult {
    let model = Config::tiny_qwen3(HIDDEN, 2, 4, 2, VOCAB);
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| ids(14 + i, 20 + i as u32)).collect();
    // Settings under which every draw matters: `sampled`'s (temperature 0.9, top-k 40,
    // top-p 0.9) give the greedy tokens on this model (so do 1.5 and most seeds), and a
    // sampler that restarted from its seed on preemption would still pass.
    let params = |seed| SamplingParams { temperature: 3.0, top_k: None, top_p: None, ..sampled(10, seed) };
    let mut plain = engine(&model, config(false))?;
    let want: Vec<Output> =
        prompts.iter().map(|p| plain.run(text(p).generate(params(3)))).collect::<Result<_, _>>()?;
    for (i, (p, w)) in prompts.iter().zip(&want).enumerate() {
        let other = plain.run(text(p).generate(params(4)))?;
        let differing = other.tokens.iter().zip(&w.tokens).filter(|(a, b)| a != b).count();
        assert!(differing >= 5, "prompt {i}: seeds 3 and 4 differ at {differing} of 10 tokens");
        assert_ne!(
            plain.run(text(p).generate(greedy(10)))?.tokens,
            w.tokens,
            "prompt {i}: not the greedy tokens"
        );
    }
    // 16 blocks of 4 cannot hold four sequences of 14-17 + 9 positions at once. Uncapped,
    // so all four start in one step (a cap starts one long prompt a step, staggering them).
    let base = config(true);
    let mut e = engine(
        &model,
        EngineConfig {
            scheduler: SchedulerConfig { num_blocks: 16, prefill_cap: PrefillCap::Off, ..base.scheduler },
            ..base
        },
    )?;
    for p in &prompts {
        e.submit(text(p).generate(params(3)))?;
    }
    let got = drain(&mut e)?;
    assert!(e.stats().sched.preemptions > 0, "the pool was too small for all four");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_same(&format!("prompt {i}"), g, w);
    }
    Ok(())
}

#[test]
fn a_follow_up_round_reuses_the_reply_to_the_last_position_that_ran() -> TestResult {
    for model in models() {
        let mut e = engine(&model, config(true))?;
        let mut history = ids(11, 4);
        for round in 0..3 {
            let g = e.run(text(&history).generate(greedy(6)))?;
            let ran = g.prompt_len + g.tokens.len() - 1;
            history.extend(&g.tokens);
            history.extend(ids(3 + round, 9 + round as u32));
            let next = e.run(text(&history))?;
            assert_eq!(
                next.num_cached_tokens, ran,
                "{} round {round}: every position that ran is reused",
                model.model_type
            );
            // The prefill itself ran the whole history; drop it from the next round's count.
            history.push(7);
        }
        e.validate()?;
    }
    Ok(())
}

#[test]
fn streaming_yields_each_token_with_the_rows_of_the_position_that_chose_it() -> TestResult {
    let model = Config::tiny_qwen3_omni_moe(HIDDEN, 2, 4, 2, VOCAB, 4, 2);
    let mut e = engine(&model, config(true))?;
    let mut events: Vec<TokenEvent> = Vec::new();
    e.submit(text(&ids(10, 8)).generate(sampled(6, 2)))?;
    let mut finished = None;
    while e.has_pending() {
        for event in e.step()? {
            match event {
                Event::Token(t) => events.push(t),
                Event::Finished(out) => finished = Some(out),
                Event::Audio(_) => return Err("no audio was asked".into()),
            }
        }
    }
    let g = finished.ok_or("the generation finished")?;
    assert_eq!(events.iter().map(|t| t.token).collect::<Vec<_>>(), g.tokens);
    for (k, t) in events.iter().enumerate() {
        assert_eq!((t.index, t.position, t.request), (k, 10 + k - 1, g.request));
        for ((name, row), (_, h)) in t.hidden.iter().zip(&g.hidden) {
            assert_eq!(row.as_slice(), h.row(t.position).as_slice().unwrap_or_default(), "{name} row {k}");
        }
    }
    Ok(())
}

#[test]
fn seeded_sampling_repeats_and_different_seeds_differ() -> TestResult {
    let model = Config::tiny_qwen3(HIDDEN, 2, 4, 2, VOCAB);
    let mut e = engine(&model, config(true))?;
    let p = ids(12, 6);
    let a = e.run(text(&p).generate(SamplingParams { temperature: 1.5, ..sampled(24, 1) }))?;
    let b = e.run(text(&p).generate(SamplingParams { temperature: 1.5, ..sampled(24, 1) }))?;
    let c = e.run(text(&p).generate(SamplingParams { temperature: 1.5, ..sampled(24, 2) }))?;
    assert!(b.num_cached_tokens > 0);
    assert_same("same seed, cached", &b, &a);
    assert_ne!(a.tokens, c.tokens, "another seed draws other tokens");
    assert_eq!((a.seed, c.seed), (Some(1), Some(2)));
    Ok(())
}

#[test]
fn stop_ids_end_a_generation_unless_ignored() -> TestResult {
    let model = Config::tiny_qwen3(HIDDEN, 2, 4, 2, VOCAB);
    let mut e = engine(&model, config(true))?;
    let p = ids(9, 3);
    let free = e.run(text(&p).generate(greedy(8)))?;
    let stop = free.tokens[3];
    let first = free.tokens.iter().position(|&t| t == stop).unwrap_or(3);
    let stopped =
        e.run(text(&p).generate(SamplingParams { stop: Some(vec![stop]), ignore_eos: false, ..greedy(8) }))?;
    assert_eq!(stopped.tokens, free.tokens[..=first]);
    assert_eq!(stopped.finish_reason, Some(FinishReason::Stop));
    let ignored =
        e.run(text(&p).generate(SamplingParams { stop: Some(vec![stop]), ignore_eos: true, ..greedy(8) }))?;
    assert_eq!((ignored.tokens.len(), ignored.finish_reason), (8, Some(FinishReason::Length)));
    Ok(())
}

#[test]
fn abort_mid_decode_leaves_no_block_or_lock_behind() -> TestResult {
    let model = Config::tiny_qwen3(HIDDEN, 2, 4, 2, VOCAB);
    let mut e = engine(&model, config(true))?;
    let a = e.submit(text(&ids(10, 1)).generate(greedy(20)))?;
    let b = e.submit(text(&ids(10, 2)).generate(greedy(4)))?;
    let mut tokens_of_a = 0;
    while tokens_of_a < 5 {
        tokens_of_a += e.step()?.iter().filter(|ev| matches!(ev, Event::Token(t) if t.request == a)).count();
    }
    e.abort(a)?;
    e.validate()?;
    let mut rest = Vec::new();
    while e.has_pending() {
        rest.extend(e.step()?);
    }
    assert!(rest.iter().all(|ev| ev.request() == b), "no event of the aborted request follows");
    assert!(matches!(e.abort(a), Err(Error::Sched(_))), "aborted twice");
    let stats = e.stats().sched;
    assert_eq!((stats.blocks_in_use, stats.running, stats.waiting), (0, 0, 0));
    // Everything left is cached and evictable: no lock pins it.
    e.validate()?;
    Ok(())
}

#[test]
fn bad_sampling_settings_are_typed_errors_that_change_nothing() -> TestResult {
    let model = Config { max_position_embeddings: Some(40), ..Config::tiny_qwen3(HIDDEN, 2, 4, 2, VOCAB) };
    let mut e = engine(&model, config(true))?;
    let p = ids(12, 1);
    let cases: Vec<(&str, SamplingParams)> = vec![
        ("max_tokens", SamplingParams { max_tokens: 0, ..greedy(1) }),
        ("context", greedy(30)),
        ("temperature", SamplingParams { temperature: -0.5, ..greedy(4) }),
        ("top_p", SamplingParams { top_p: Some(0.0), ..greedy(4) }),
        ("top_p", SamplingParams { top_p: Some(1.5), ..greedy(4) }),
        ("top_k", SamplingParams { top_k: Some(0), ..greedy(4) }),
        ("stop", SamplingParams { stop: Some(vec![VOCAB as u32]), ..greedy(4) }),
    ];
    let before = e.stats();
    for (what, params) in cases {
        let err = e.run(text(&p).generate(params)).err().ok_or(format!("{what}: accepted"))?;
        let Error::Request(r) = &err else { return Err(format!("{what}: {err}").into()) };
        let ok = match what {
            "max_tokens" | "temperature" | "top_p" | "top_k" => {
                matches!(r, RequestError::InvalidSampling { param, .. } if *param == what)
            }
            "context" => {
                matches!(r, RequestError::ContextTooLong { id: None, prompt_len: 12, max_new_tokens: 29, .. })
            }
            _ => matches!(r, RequestError::StopIdOutOfVocab { .. }),
        };
        assert!(ok, "{what}: {err}");
        assert_eq!(e.stats(), before, "{what}: state changed");
        assert!(!e.has_pending());
    }
    e.validate()?;
    Ok(())
}

/// An image item with a 2x2-token grid (4 placeholders) and its embeddings.
fn image(content: &ArrayD<u8>, seed: f32) -> ItemInput<'_> {
    images::image(content, Some(images::rows(4, HIDDEN, seed)))
}

#[test]
fn an_mm_prompt_decodes_after_its_item_and_the_reply_is_reused() -> TestResult {
    let model = Config::tiny_qwen3_omni_moe(HIDDEN, 2, 4, 2, VOCAB, 4, 2);
    let content = ArrayD::from_shape_fn(IxDyn(&[4, 4, 3]), |d| (d[0] * 7 + d[1] * 3 + d[2]) as u8);
    let tokens = OmniTokens::tiny();
    let mut head = ids(5, 2);
    head.extend([tokens.vision_start_token_id, tokens.image_token_id, tokens.vision_end_token_id]);
    let request = |extra: &[u32]| Request {
        token_ids: [&head[..], extra].concat(),
        items: vec![image(&content, 0.5)],
        ..Default::default()
    };
    let mut plain = engine(&model, config(false))?;
    let want = plain.run(request(&[3, 4]).generate(sampled(8, 4)))?;
    let mut e = engine(&model, config(true))?;
    let got = e.run(request(&[3, 4]).generate(sampled(8, 4)))?;
    assert_same("mm", &got, &want);
    let again = e.run(request(&[3, 4]).generate(sampled(8, 4)))?;
    assert_same("mm cached", &again, &want);
    let follow = e.run(request(&[&[3, 4][..], &got.tokens, &[9]].concat()))?;
    assert_eq!(follow.num_cached_tokens, got.prompt_len + got.tokens.len() - 1);
    Ok(())
}

/// `suppress_ids` (HF `suppress_tokens`) bans ids from the reply: banning the greedy reply's
/// first token changes that token and nothing before it, and the banned ids never appear;
/// a ban of every id or of an id past the vocab is an `InvalidSampling` error naming
/// `suppress_ids`, with nothing cached.
#[test]
fn suppress_ids_ban_tokens_and_a_ban_of_everything_is_rejected() -> TestResult {
    let model = Config::tiny_qwen3_omni_moe(HIDDEN, 2, 4, 2, VOCAB, 4, 2);
    let prompt = ids(9, 1);
    let mut e = engine(&model, config(true))?;
    let free = e.run(text(&prompt).generate(greedy(6)))?;
    let banned = vec![free.tokens[0], free.tokens[1]];
    let params = SamplingParams { suppress_ids: banned.clone(), ignore_eos: true, ..greedy(6) };
    let got = e.run(text(&prompt).generate(params))?;
    assert_ne!(got.tokens[0], free.tokens[0]);
    assert!(got.tokens.iter().all(|t| !banned.contains(t)), "{:?} holds one of {banned:?}", got.tokens);

    let before = e.stats();
    for bad in [(0..VOCAB as u32).collect::<Vec<u32>>(), vec![VOCAB as u32]] {
        let params = SamplingParams { suppress_ids: bad, ..greedy(6) };
        match e.run(text(&ids(7, 3)).generate(params)) {
            Err(omniprefix::Error::Request(RequestError::InvalidSampling {
                param: "suppress_ids", ..
            })) => {}
            other => return Err(format!("expected InvalidSampling(suppress_ids), got {other:?}").into()),
        }
    }
    assert_eq!(e.stats(), before, "a rejected request changes no cache state");
    Ok(())
}

/// The tiny Omni model's greedy reply to `ids(9, 1)` holds a video pad (found by a search
/// over `ids(n, seed)`); the next round re-sends prompt + reply as text, where a pad outside
/// an item span is a request error. Masked by default: the reply avoids the pads and re-sends;
/// `allow_special_ids` shows the raw choice, which the next round rejects.
#[test]
fn a_reply_holds_no_placeholder_id_so_the_next_round_can_resend_it() -> TestResult {
    let model = Config::tiny_qwen3_omni_moe(HIDDEN, 2, 4, 2, VOCAB, 4, 2);
    let tokens = OmniTokens::tiny();
    let pads = omniprefix::sample::placeholder_ids(&tokens);
    assert_eq!(pads, [tokens.image_token_id, tokens.video_token_id, tokens.audio_token_id]);
    let prompt = ids(9, 1);
    let mut e = engine(&model, config(true))?;

    let raw = e.run(text(&prompt).generate(SamplingParams { allow_special_ids: true, ..greedy(12) }))?;
    let first =
        raw.tokens.iter().position(|t| pads.contains(t)).ok_or("the unmasked reply holds no placeholder")?;
    assert_eq!((first, raw.tokens[first]), (3, tokens.video_token_id), "raw reply {:?}", raw.tokens);

    let masked = e.run(text(&prompt).generate(greedy(12)))?;
    assert!(masked.tokens.iter().all(|t| !pads.contains(t)), "masked reply {:?}", masked.tokens);
    assert_eq!(masked.tokens[..first], raw.tokens[..first], "the mask changes nothing before the first pad");
    assert_ne!(masked.tokens[first], raw.tokens[first]);
    let differing = masked.tokens.iter().zip(&raw.tokens).filter(|(a, b)| a != b).count();
    eprintln!("masked {:?}\nraw    {:?}\n{differing} of 12 tokens differ", masked.tokens, raw.tokens);
    // The same greedy rows up to the first pad's position: the mask touches sampling only.
    let rows = prompt.len() + first;
    for ((name, m), (_, r)) in masked.hidden.iter().zip(&raw.hidden) {
        assert!(m.slice(ndarray::s![..rows, ..]) == r.slice(ndarray::s![..rows, ..]), "{name}");
    }

    // The next round: prompt + masked reply re-sends (every position that ran is cached) ...
    let next = e.run(text(&[&prompt[..], &masked.tokens].concat()))?;
    assert_eq!(next.num_cached_tokens, prompt.len() + masked.tokens.len() - 1);
    // ... and prompt + raw reply is rejected: the pad takes an item the request does not have.
    let before = e.stats();
    let err = e
        .run(text(&[&prompt[..], &raw.tokens].concat()))
        .err()
        .ok_or("a reply holding a pad was accepted")?;
    assert!(
        matches!(err, Error::Request(RequestError::MissingItem { position, .. }) if position == prompt.len() + first),
        "{err}"
    );
    assert_eq!(e.stats(), before);
    // Sampled replies are masked as well.
    for seed in 0..8 {
        let g = e.run(text(&prompt).generate(SamplingParams { temperature: 2.0, ..sampled(24, seed) }))?;
        assert!(g.tokens.iter().all(|t| !pads.contains(t)), "seed {seed}: {:?}", g.tokens);
    }
    e.validate()?;
    Ok(())
}
