//! Invariant 2, fuzzed: caching is invisible. For random prompts (text and item
//! rows, 1-D or M-RoPE positions), random block sizes, random block tables and
//! random chunkings of the prefill, every captured hidden state `[len, hidden]`
//! and the last logits equal the uncached run within 1e-5 relative.
//!
//! Cases default to 12; scale with `PROPTEST_CASES`.

use std::sync::Arc;

use ndarray::Array2;
use omniprefix::backend::cpu::CpuBackend;
use omniprefix::batch::{EmbedRows, ScheduledBatch};
use omniprefix::kv::BlockTable;
use omniprefix::model::{CaptureName, CaptureSpec, Config, Thinker};
use omniprefix::prompt::Positions;
use omniprefix::runner::{ModelRunner, PromptInputs, run_uncached};
use proptest::prelude::*;
use proptest::test_runner::Config as PtConfig;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn model(kind: usize) -> Config {
    match kind {
        0 => Config::tiny_qwen3(32, 2, 4, 2, 64),
        1 => Config::tiny_qwen2_omni(32, 2, 4, 1, 64),
        _ => Config::tiny_qwen3_omni_moe(32, 2, 4, 2, 64, 4, 2),
    }
}

/// A prompt of `len` positions with one item of `rows` rows at `start`.
fn prompt(cfg: &Config, len: usize, start: usize, rows: usize, rng: &mut ChaCha8Rng) -> PromptInputs {
    let token_ids = (0..len).map(|_| rng.random_range(0..cfg.vocab_size as u32)).collect();
    let item = Array2::from_shape_fn((rows, cfg.hidden_size), |_| rng.random::<f32>() * 2.0 - 1.0);
    let embeds =
        vec![EmbedRows { step_offset: start, embeddings: Arc::new(item), rows: 0..rows, deepstack: None }];
    let positions = match cfg.mrope_section {
        None => Positions::linear(len),
        Some(_) => {
            let grid = |p: usize, f: fn(usize) -> usize| -> i64 {
                if (start..start + rows).contains(&p) { (start + f(p - start)) as i64 } else { p as i64 }
            };
            Positions::given(
                (0..len).map(|p| [grid(p, |_| 0), grid(p, |r| r / 3), grid(p, |r| r % 3)]).collect(),
                0,
            )
        }
    };
    PromptInputs { token_ids, embeds, positions }
}

fn close(got: &[f32], want: &[f32]) -> Result<(), String> {
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    match got.iter().zip(want).position(|(g, w)| (g - w).abs() > 1e-5 * scale) {
        None if got.len() == want.len() => Ok(()),
        None => Err(format!("lengths {} vs {}", got.len(), want.len())),
        Some(i) => Err(format!("first mismatch at flat index {i}: {} vs {}", got[i], want[i])),
    }
}

proptest! {
    #![proptest_config(PtConfig { cases: support::cases(12), ..PtConfig::default() })]

    #[test]
    fn chunked_cached_prefill_equals_uncached(
        kind in 0usize..3,
        len in 2usize..40,
        block_size in 1usize..9,
        item in (0usize..30, 1usize..8),
        cuts in proptest::collection::vec(1usize..40, 0..4),
        seed in any::<u64>(),
    ) {
        let cfg = model(kind);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (start, rows) = (item.0 % len, item.1.min(len - item.0 % len));
        let p = prompt(&cfg, len, start, rows, &mut rng);
        let backend = Arc::new(CpuBackend::new());
        let thinker = Arc::new(Thinker::random(&*backend, cfg, seed).unwrap());
        let capture = CaptureSpec::new([CaptureName::Hidden(0), CaptureName::Hidden(1), CaptureName::Final], 2).unwrap();
        let want = run_uncached(&thinker, &*backend, &p, &capture, false).unwrap();
        let runner = ModelRunner::new(backend, thinker, capture).unwrap();

        let num_blocks = len.div_ceil(block_size) + 3;
        let mut blocks: Vec<u32> = (0..num_blocks as u32).collect();
        blocks.shuffle(&mut rng);
        let table = &blocks[..len.div_ceil(block_size)];
        let mut ends: Vec<usize> = cuts.into_iter().filter(|&c| c < len).collect();
        ends.push(len);
        ends.sort_unstable();
        ends.dedup();
        let mut pages = runner.alloc_pages(num_blocks, block_size).unwrap();
        let mut a = 0;
        let mut outs = Vec::new();
        for &b in &ends {
            let seq = p.step(9, BlockTable::new(table.to_vec(), block_size), a..b).unwrap();
            outs = runner.execute(&ScheduledBatch { copies: vec![], seqs: vec![seq] }, &mut pages).unwrap();
            prop_assert_eq!(outs.len(), usize::from(b == len));
            a = b;
        }
        for ((name, got), (_, w)) in outs[0].hidden.iter().zip(&want.hidden) {
            prop_assert_eq!(got.dim(), (len, 32));
            close(got.as_slice().unwrap(), w.as_slice().unwrap()).map_err(|m| TestCaseError::fail(format!("{name}: {m}")))?;
        }
        close(&outs[0].last_logits, &want.last_logits).map_err(|m| TestCaseError::fail(format!("logits: {m}")))?;
    }
}
