use std::sync::Arc;

use ndarray::Array2;
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
