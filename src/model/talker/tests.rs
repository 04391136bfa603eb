use std::sync::Arc;

use ndarray::{Array2, s};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::backend::cpu::CpuBackend;
use crate::error::{Error, RequestError, RunnerError};
use crate::kv::BlockTable;
use crate::sample::{FinishReason, TalkerSampling};

fn rows(seed: u64, n: usize, c: usize) -> Array2<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    Array2::from_shape_fn((n, c), |_| rng.random::<f32>() * 2.0 - 1.0)
}

fn setup() -> (Arc<CpuBackend>, Talker<CpuBackend>, TalkerInputs) {
    let backend = Arc::new(CpuBackend::new());
    let talker = Talker::random(&*backend, TalkerConfig::tiny(), 5).unwrap();
    let mut inputs = TalkerInputs::linear(rows(1, 9, 32), rows(2, 3, 32), rows(3, 1, 32));
    // M-RoPE positions with a jump (an item) and a negative delta, as an image prompt has.
    inputs.positions =
        (0..9i64).map(|p| if (2..6).contains(&p) { [2, 2 + p % 2, 2 + p / 4] } else { [p - 2; 3] }).collect();
    inputs.rope_delta = -2;
    (backend, talker, inputs)
}

fn sampling(max: usize) -> TalkerSampling {
    TalkerSampling { max_new_tokens: max, ..TalkerSampling::greedy() }
}

#[test]
fn frames_stream_as_they_complete_and_codes_stay_in_range() {
    let (backend, talker, inputs) = setup();
    let mut streamed: Vec<Vec<u32>> = Vec::new();
    let out = talker
        .generate(&backend, &inputs, &sampling(7), |f: &[u32]| {
            streamed.push(f.to_vec());
            Ok(())
        })
        .unwrap();
    let frames = out.codes.ncols();
    assert_eq!(out.sampled.len(), frames + 1, "the last sampled code gets no frame");
    assert_eq!(streamed.len(), frames);
    for (f, frame) in streamed.iter().enumerate() {
        assert_eq!(frame, &out.codes.column(f).to_vec());
        assert!(frame[0] < 1056 - 1024, "first codes are not special ids");
        assert!(frame[1..].iter().all(|&c| c < 32));
    }
    assert_eq!(out.finish == FinishReason::Stop, *out.sampled.last().unwrap() == 40);
    assert_eq!(out.past_hidden.dim(), (frames, 32));
    assert_eq!(out.step_embeds.dim(), (frames, 32));
    // Sampling repeats given its seed.
    let sampled = TalkerSampling { max_new_tokens: 6, seed: 9, ..TalkerSampling::default() };
    let a = talker.generate(&backend, &inputs, &sampled, |_: &[u32]| Ok(())).unwrap();
    let b = talker.generate(&backend, &inputs, &sampled, |_: &[u32]| Ok(())).unwrap();
    assert_eq!(a.codes, b.codes);
}

#[test]
fn a_reused_talker_prefix_gives_the_same_codes() {
    let (backend, talker, inputs) = setup();
    let want = talker.generate(&backend, &inputs, &sampling(6), |_: &[u32]| Ok(())).unwrap();
    let mut pages = talker.alloc_pages(&backend, 8, 4).unwrap();
    let table = BlockTable::new(vec![7, 2, 5, 0], 4);
    for cached in [0, 4, 9] {
        let kv = TalkerKv { pages: &mut pages, block_table: table.clone(), num_cached: cached };
        let got = talker.generate_in(&backend, kv, &inputs, &sampling(6), |_: &[u32]| Ok(())).unwrap();
        assert_eq!(got.codes, want.codes, "{cached} cached rows");
        assert_eq!(got.past_hidden, want.past_hidden);
        assert_eq!(got.step_embeds, want.step_embeds);
    }
}

#[test]
fn bad_inputs_sampling_and_callbacks_are_errors() {
    let (backend, talker, inputs) = setup();
    let narrow = TalkerInputs { tts_pad_embed: rows(4, 1, 31), ..inputs.clone() };
    let err = talker.generate(&backend, &narrow, &sampling(3), |_: &[u32]| Ok(())).unwrap_err();
    assert!(matches!(err, Error::Runner(RunnerError::InvalidBatch { .. })), "{err}");
    let short = TalkerInputs { positions: inputs.positions[..8].to_vec(), ..inputs.clone() };
    assert!(talker.generate(&backend, &short, &sampling(3), |_: &[u32]| Ok(())).is_err());
    let bad = TalkerSampling { top_p: 2.0, ..sampling(3) };
    assert!(matches!(
        talker.generate(&backend, &inputs, &bad, |_: &[u32]| Ok(())),
        Err(Error::Request(RequestError::InvalidSampling { param: "top_p", .. }))
    ));
    let mut pages = talker.alloc_pages(&backend, 2, 4).unwrap();
    let kv = TalkerKv { pages: &mut pages, block_table: BlockTable::new(vec![0, 1], 4), num_cached: 0 };
    assert!(matches!(
        talker.generate_in(&backend, kv, &inputs, &sampling(3), |_: &[u32]| Ok(())),
        Err(Error::Runner(RunnerError::InvalidBatch { .. }))
    ));
    let stop = talker.generate(&backend, &inputs, &sampling(5), |_: &[u32]| {
        Err(RequestError::InvalidSampling { param: "stop", expected: "", found: String::new() }.into())
    });
    assert!(matches!(stop, Err(Error::Request(RequestError::InvalidSampling { param: "stop", .. }))));
}

#[test]
fn projections_match_a_host_oracle() {
    let (backend, talker, _) = setup();
    let cfg = talker.config().clone();
    let src = random_source(&cfg, 5).unwrap();
    let x = rows(8, 3, 24);
    let got = talker.project_text(&*backend, &x).unwrap();
    let w = |n: &str| {
        let t = src.load(n).unwrap();
        let cols = t.shape.get(1).copied().unwrap_or(t.shape[0]);
        Array2::from_shape_vec((t.data.len() / cols, cols), t.data).unwrap()
    };
    let h = x.dot(&w("talker.text_projection.linear_fc1.weight").t())
        + &w("talker.text_projection.linear_fc1.bias");
    let h = h.mapv(|v| v / (1.0 + (-v).exp()));
    let want = h.dot(&w("talker.text_projection.linear_fc2.weight").t())
        + &w("talker.text_projection.linear_fc2.bias");
    assert!(got.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-5), "{got} vs {want}");
    assert_ne!(talker.project_hidden(&*backend, &x).unwrap(), got);
    assert_eq!(talker.codec_embed(&*backend, &[3, 40]).unwrap().dim(), (2, 32));
}

/// A seq of `inputs` whose trailing rows come later, on blocks `first..first + n` of 4 positions.
fn seq_of(
    talker: &Talker<CpuBackend>, request: u64, inputs: &TalkerInputs, sampling: &TalkerSampling,
    blocks: std::ops::Range<u32>,
) -> TalkerSeq {
    let late = TalkerInputs { trailing_text_hidden: Array2::zeros((0, 32)), ..inputs.clone() };
    let blocks = TalkerBlocks { block_table: BlockTable::new(blocks.collect(), 4), num_cached: 0 };
    TalkerSeq::new(talker.config(), request, late, sampling, blocks).unwrap()
}

fn assert_same(got: &TalkerOutput, want: &TalkerOutput, what: &str) {
    assert_eq!(got.sampled, want.sampled, "{what}: sampled");
    assert_eq!(got.codes, want.codes, "{what}: codes");
    assert_eq!(got.finish, want.finish, "{what}: finish");
    // Bit for bit: the same f32s, not merely close ones.
    let bits = |m: &Array2<f32>| m.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got.past_hidden), bits(&want.past_hidden), "{what}: past_hidden");
    assert_eq!(bits(&got.step_embeds), bits(&want.step_embeds), "{what}: step_embeds");
}

/// Three replies: different prompts, trailing rows and sampling (greedy, seeded, seeded).
fn three() -> Vec<(TalkerInputs, TalkerSampling)> {
    let (_, _, base) = setup();
    let seeded = |seed, max| TalkerSampling { max_new_tokens: max, seed, ..TalkerSampling::default() };
    vec![
        (base.clone(), sampling(9)),
        (TalkerInputs::linear(rows(11, 6, 32), rows(12, 2, 32), rows(13, 1, 32)), seeded(4, 10)),
        (TalkerInputs { trailing_text_hidden: rows(14, 5, 32), ..base }, seeded(77, 8)),
    ]
}

#[test]
fn seqs_stepped_together_give_what_they_give_alone() {
    let (backend, talker, _) = setup();
    let runner = talker.runner(&backend).unwrap();
    let cases = three();
    let alone: Vec<TalkerOutput> =
        cases.iter().map(|(i, s)| talker.generate(&backend, i, s, |_: &[u32]| Ok(())).unwrap()).collect();
    for (k, out) in alone.iter().enumerate() {
        // The replies must reach past their trailing rows (tts_pad) to test anything.
        assert!(out.codes.ncols() > cases[k].0.trailing_text_hidden.nrows(), "case {k}: {out:?}");
    }
    let mut pages = talker.alloc_pages(&backend, 16, 4).unwrap();
    let mut seqs: Vec<TalkerSeq> = cases
        .iter()
        .enumerate()
        .map(|(k, (inputs, s))| {
            let mut seq = seq_of(&talker, k as u64, inputs, s, 5 * k as u32..5 * k as u32 + 5);
            seq.push_trailing(inputs.trailing_text_hidden.view()).unwrap();
            seq.finish_trailing();
            seq
        })
        .collect();
    // The third reply's prompt runs in chunks of 4 beside the others' decode rows.
    seqs[2] = seqs[2].clone().with_prefill_chunk(std::num::NonZeroUsize::new(4).unwrap());
    let mut streamed: Vec<Vec<Vec<u32>>> = vec![vec![]; 3];
    let mut steps = 0;
    while seqs.iter().any(|s| !s.is_finished()) {
        // The first reply joins late, so prompts and decode rows share batches.
        let join = if steps < 2 { 1 } else { 0 };
        let mut batch: Vec<&mut TalkerSeq> = seqs.iter_mut().skip(join).collect();
        let frames = talker.step(&backend, &runner, &mut pages, &mut batch).unwrap();
        for (k, frame) in frames.into_iter().enumerate() {
            streamed[k + join].extend(frame);
        }
        steps += 1;
        assert!(steps < 40);
    }
    for (k, seq) in seqs.into_iter().enumerate() {
        let got = seq.into_output().unwrap();
        assert_same(&got, &alone[k], &format!("case {k}"));
        let cols: Vec<Vec<u32>> = (0..got.codes.ncols()).map(|f| got.codes.column(f).to_vec()).collect();
        assert_eq!(streamed[k], cols, "case {k}: streamed frames");
    }
}

#[test]
fn trailing_rows_arriving_late_and_in_pieces_give_generates_codes() {
    let (backend, talker, _) = setup();
    let runner = talker.runner(&backend).unwrap();
    for (k, (inputs, s)) in three().into_iter().enumerate() {
        let want = talker.generate(&backend, &inputs, &s, |_: &[u32]| Ok(())).unwrap();
        let n = inputs.trailing_text_hidden.nrows();
        for schedule in 0..6u64 {
            let mut rng = ChaCha8Rng::seed_from_u64(schedule * 10 + k as u64);
            let mut seq = seq_of(&talker, 0, &inputs, &s, 0..5);
            let mut pages = talker.alloc_pages(&backend, 5, 4).unwrap();
            let mut pushed = 0;
            let mut steps = 0;
            while !seq.is_finished() {
                // A thinker step: maybe some rows (schedule 0 pushes all of them only when the talker is stuck).
                let piece = match schedule {
                    0 if seq.is_ready() => 0,
                    0 => n - pushed,
                    _ => rng.random_range(0..3usize).min(n - pushed),
                };
                if piece > 0 {
                    seq.push_trailing(inputs.trailing_text_hidden.slice(s![pushed..pushed + piece, ..]))
                        .unwrap();
                    pushed += piece;
                }
                if pushed == n && !seq.trailing_finished() && (schedule == 0 || rng.random_bool(0.5)) {
                    seq.finish_trailing();
                }
                let (ready, before) = (seq.is_ready(), seq.sampled().len());
                let frames = talker.step(&backend, &runner, &mut pages, &mut [&mut seq]).unwrap();
                if !ready {
                    // A seq waiting for its trailing row is left out and left as it was.
                    assert!(frames[0].is_none() && seq.sampled().len() == before, "schedule {schedule}");
                }
                steps += 1;
                assert!(steps < 100, "case {k} schedule {schedule} never finished");
            }
            assert_same(&seq.into_output().unwrap(), &want, &format!("case {k} schedule {schedule}"));
        }
    }
}

#[test]
fn step_errors_are_typed_and_leave_the_seq_as_it_was() {
    let (backend, talker, inputs) = setup();
    let runner = talker.runner(&backend).unwrap();
    let want = talker.generate(&backend, &inputs, &sampling(6), |_: &[u32]| Ok(())).unwrap();
    let invalid = |e: Error, request| matches!(e, Error::Runner(RunnerError::InvalidBatch { request: r, .. }) if r == request);

    // Construction: sampling and widths.
    let blocks = TalkerBlocks { block_table: BlockTable::new(vec![0, 1], 4), num_cached: 0 };
    let bad = TalkerSampling { temperature: -1.0, ..sampling(6) };
    assert!(matches!(
        TalkerSeq::new(talker.config(), 3, inputs.clone(), &bad, blocks.clone()),
        Err(Error::Request(RequestError::InvalidSampling { param: "temperature", .. }))
    ));
    let narrow = TalkerInputs { embeds: rows(1, 9, 31), ..inputs.clone() };
    assert!(invalid(TalkerSeq::new(talker.config(), 3, narrow, &sampling(6), blocks).unwrap_err(), 3));

    // Trailing rows: width, and none after finish_trailing.
    let mut seq = seq_of(&talker, 3, &inputs, &sampling(6), 0..2);
    assert!(invalid(seq.push_trailing(rows(1, 2, 31).view()).unwrap_err(), 3));
    assert_eq!(seq.trailing_rows(), 0);

    // A block table too small for the step: an error naming the request, nothing
    // changed; after the caller adds blocks the same seq goes on to generate's codes.
    let mut pages = talker.alloc_pages(&backend, 4, 4).unwrap();
    assert_eq!(seq.next_positions(), 9);
    assert_eq!(seq.positions_needed(), 9 + 6 - 1);
    assert!(invalid(talker.step(&backend, &runner, &mut pages, &mut [&mut seq]).unwrap_err(), 3));
    assert!(seq.sampled().is_empty() && seq.is_ready() && seq.finish().is_none());
    seq.extend_blocks([2]);
    seq.push_trailing(inputs.trailing_text_hidden.view()).unwrap();
    seq.finish_trailing();
    assert!(invalid(seq.push_trailing(inputs.trailing_text_hidden.view()).unwrap_err(), 3));
    // Blocks outside the pages: the runner's check, the request named.
    let mut outside = seq.clone();
    outside.extend_blocks([9, 9]);
    let mut small = talker.alloc_pages(&backend, 3, 4).unwrap();
    assert!(invalid(talker.step(&backend, &runner, &mut small, &mut [&mut outside]).unwrap_err(), 3));
    while !seq.is_finished() {
        let needed = seq.next_positions();
        if !seq.block_table().covers(needed) {
            seq.extend_blocks([3]);
        }
        talker.step(&backend, &runner, &mut pages, &mut [&mut seq]).unwrap();
    }
    assert_same(&seq.into_output().unwrap(), &want, "grown block table");

    // A seq of another talker, or another talker's runner.
    let mut cfg = TalkerConfig::tiny();
    cfg.num_code_groups = 8;
    let mut other = seq_of(&talker, 5, &inputs, &sampling(6), 0..4);
    other.push_trailing(inputs.trailing_text_hidden.view()).unwrap();
    let twin = Talker::random(&*backend, TalkerConfig::tiny(), 5).unwrap();
    let twin_runner = twin.runner(&backend).unwrap();
    assert!(invalid(talker.step(&backend, &twin_runner, &mut pages, &mut [&mut other]).unwrap_err(), 5));
    let blocks = TalkerBlocks { block_table: BlockTable::new(vec![0, 1, 2, 3], 4), num_cached: 0 };
    let mut eight = TalkerSeq::new(&cfg, 6, inputs.clone(), &sampling(6), blocks).unwrap();
    assert!(invalid(talker.step(&backend, &runner, &mut pages, &mut [&mut eight]).unwrap_err(), 6));
    // Nothing ready: nothing runs.
    let mut done = seq_of(&talker, 7, &inputs, &sampling(1), 0..4);
    while !done.is_finished() {
        talker.step(&backend, &runner, &mut pages, &mut [&mut done]).unwrap();
    }
    assert_eq!(done.sampled().len(), 1, "max_new_tokens 1: one code, no frame");
    assert_eq!(talker.step(&backend, &runner, &mut pages, &mut [&mut done]).unwrap(), vec![None]);
}
