//! The talker against transformers: given HF's recorded talker inputs (prompt rows,
//! 3-D positions and rope delta, `trailing_text_hidden`, `tts_pad_embed`) of each
//! case of `fixtures/tiny/omni_audio/audio_reference.safetensors`, our greedy run
//! (HF `talker_do_sample=False`, repetition penalty 1.05, special ids but EOS
//! suppressed) yields the same codec codes `[16, frames]` exactly, and the code
//! predictor's `past_hidden` rows and the fed-back decode rows within [`TOLERANCE`].

use std::sync::Arc;

use ndarray::Array2;
use omniprefix::backend::cpu::CpuBackend;
use omniprefix::model::talker::{Talker, TalkerInputs};
use omniprefix::sample::{FinishReason, TalkerSampling};
use support::reference::{self, Reference, TestResult};

const MODEL: &str = "omni_audio";
const CASES: [&str; 3] = ["text", "image", "round2"];

/// HF's talker inputs of `case`.
fn inputs(r: &Reference, case: &str) -> TestResult<TalkerInputs> {
    let embeds = r.matrix(&format!("{case}.talker_inputs_embeds"))?.clone();
    let pos = r.ints(&format!("{case}.talker_position_ids"))?;
    let rows = embeds.nrows();
    if pos.len() != 3 * rows {
        return Err(format!("{case}: {} positions for {rows} rows", pos.len()).into());
    }
    let positions = (0..rows).map(|i| [pos[i], pos[rows + i], pos[2 * rows + i]]).collect();
    let rope_delta = *r.ints(&format!("{case}.talker_rope_delta"))?.first().ok_or("empty rope delta")?;
    Ok(TalkerInputs {
        embeds,
        positions,
        rope_delta,
        trailing_text_hidden: r.matrix(&format!("{case}.trailing_text_hidden"))?.clone(),
        tts_pad_embed: r.matrix(&format!("{case}.tts_pad_embed"))?.clone(),
    })
}

#[test]
fn greedy_codes_equal_transformers_for_every_case() -> TestResult {
    let backend = Arc::new(CpuBackend::new());
    let talker = Talker::from_dir(&*backend, &reference::model_dir(MODEL))?;
    let r = Reference::open_file(MODEL, "audio_reference.safetensors")?;
    let sampling = TalkerSampling { max_new_tokens: 64, ..TalkerSampling::greedy() };
    for case in CASES {
        let mut streamed = 0;
        let out = talker.generate(&backend, &inputs(&r, case)?, &sampling, |_: &[u32]| {
            streamed += 1;
            Ok(())
        })?;
        let want = r.ints(&format!("{case}.codes"))?;
        let frames = want.len() / 16;
        let want = Array2::from_shape_vec((16, frames), want.iter().map(|&c| c as u32).collect())?;
        assert_eq!(out.codes, want, "{case}: codes");
        assert_eq!(
            (out.finish, streamed),
            (FinishReason::Stop, frames),
            "{case}: HF stopped at the codec EOS"
        );
        let hidden = r.expected(case, "talker_step_hidden")?;
        let embeds = r.expected(case, "talker_step_embeds")?;
        let e1 =
            reference::relative_error(&format!("{case}.talker_step_hidden"), out.past_hidden.view(), hidden)?;
        let e2 =
            reference::relative_error(&format!("{case}.talker_step_embeds"), out.step_embeds.view(), embeds)?;
        println!("{case}: {frames} frames equal; past_hidden rel err {e1:.2e}, step embeds {e2:.2e}");
    }
    Ok(())
}
