//! Parity with Hugging Face transformers.
//!
//! `fixtures/make_tiny_models.py` built tiny checkpoints with the HF classes
//! (`Qwen3ForCausalLM`; the Qwen3-Omni MoE thinker with interleaved M-RoPE;
//! `Qwen2ForCausalLM`) and recorded, per prompt, every hidden state, the
//! final-norm output and the logits of every row (see `fixtures/tiny/README.md`).
//! Here each checkpoint goes through our loader and our thinker on the CPU
//! backend, and every recorded tensor must match within [`reference::TOLERANCE`]
//! relative error: `max|ours - ref| / max(max|ref|, TINY)`.
//!
//! Two ways to run a prompt: `run_uncached` (one step), and `ModelRunner::execute`
//! in small chunks over a scattered block table, where every step reads the
//! earlier ones' K/V from pages and the full hidden states come back from the
//! hidden pages — so "caching is invisible" is checked against HF itself.
//!
//! `omni_thinker/deepstack_reference.safetensors` adds Qwen3-Omni DeepStack: the
//! `mm` prompt with per-level rows on its image and video items, which HF adds
//! after the first decoder layers.

use support::reference;

use std::collections::BTreeMap;
use std::sync::Arc;

use ndarray::Array2;
use omniprefix::backend::Dtype;
use omniprefix::backend::cpu::CpuBackend;
use omniprefix::batch::ScheduledBatch;
use omniprefix::kv::BlockTable;
use omniprefix::model::{CaptureName, CaptureSpec, Thinker};
use omniprefix::runner::{ModelRunner, PromptInputs, run_uncached};
use reference::{Reference, TOLERANCE, TestResult, model_dir, relative_error, relative_error_within};

/// Reference-only views of the recorded tensors (a trait: `Reference` is the support crate's type).
trait RecordedOutputs {
    fn prompts(&self) -> Vec<&str>;
    fn outputs_of<'a>(&'a self, p: &str) -> impl Iterator<Item = &'a str>;
}

impl RecordedOutputs for Reference {
    /// The prompts recorded (every prompt has `<p>.logits`), in name order.
    fn prompts(&self) -> Vec<&str> {
        self.f32s.keys().filter_map(|k| k.strip_suffix(".logits")).collect()
    }

    /// Names of the outputs recorded for prompt `p`: `hidden.<k>`, `final`, `logits`.
    fn outputs_of<'a>(&'a self, p: &str) -> impl Iterator<Item = &'a str> {
        let prefix = format!("{p}.");
        self.f32s.keys().filter_map(move |k| {
            let what = k.strip_prefix(&prefix)?;
            (what == "final" || what == "logits" || what.starts_with("hidden.")).then_some(what)
        })
    }
}

// ------------------------------------------------------------------ comparison

/// Checks each of our outputs of prompt `p` (output name → matrix) against the reference.
/// Returns the worst relative error, or every failure message.
fn check_prompt(
    model: &str, p: &str, reference: &Reference, ours: &BTreeMap<String, Array2<f32>>, tolerance: f32,
) -> Result<f32, Vec<String>> {
    let mut worst = 0f32;
    let mut failures = Vec::new();
    for (what, got) in ours {
        let label = format!("{model}/{p}.{what}");
        let checked = reference
            .expected(p, what)
            .map_err(|e| format!("{label}: {e}"))
            .and_then(|expected| relative_error_within(&label, got.view(), expected, tolerance));
        match checked {
            Ok(err) => worst = worst.max(err),
            Err(msg) => failures.push(msg),
        }
    }
    if failures.is_empty() { Ok(worst) } else { Err(failures) }
}

// ------------------------------------------------------------------ our side

/// Every capture point the fixtures hold: `hidden.0..=num_layers` and `final`.
fn all_captures(num_layers: usize) -> TestResult<CaptureSpec> {
    let points = (0..=num_layers).map(CaptureName::Hidden).chain([CaptureName::Final]);
    Ok(CaptureSpec::new(points, num_layers)?)
}

/// How our side runs a prompt.
#[derive(Debug, Clone, Copy)]
enum Mode {
    /// `run_uncached`: one step; every row's logits.
    Uncached,
    /// `ModelRunner::execute` in steps of `chunk` tokens over `block_size`-token
    /// blocks laid out in a reversed, non-contiguous block table; the last step
    /// returns the full hidden states and the last row's logits.
    Chunked { chunk: usize, block_size: usize },
}

/// Output name → matrix, as `check_prompt` takes it.
fn named(hidden: Vec<(CaptureName, Array2<f32>)>) -> BTreeMap<String, Array2<f32>> {
    hidden.into_iter().map(|(name, m)| (name.to_string(), m)).collect()
}

/// Runs a prompt as [`Mode::Chunked`] says; returns the captures and `last_logits`.
fn run_chunked(
    runner: &ModelRunner<CpuBackend>, inputs: &PromptInputs, chunk: usize, block_size: usize,
) -> TestResult<BTreeMap<String, Array2<f32>>> {
    let len = inputs.token_ids.len();
    let needed = len.div_ceil(block_size);
    let num_blocks = 2 * needed;
    let blocks: Vec<u32> = (0..needed).map(|i| (num_blocks - 1 - 2 * i) as u32).collect();
    let block_table = BlockTable::new(blocks, block_size);
    let mut pages = runner.alloc_pages(num_blocks, block_size)?;
    let mut last = None;
    for start in (0..len).step_by(chunk) {
        let step = start..(start + chunk).min(len);
        // The runner's own chunk cut (what the scheduler uses too).
        let seq = inputs.step(1, block_table.clone(), step.clone())?;
        let mut outputs = runner.execute(&ScheduledBatch { copies: vec![], seqs: vec![seq] }, &mut pages)?;
        assert_eq!(outputs.len(), usize::from(step.end == len), "outputs only on the last step");
        last = outputs.pop();
    }
    let out = last.ok_or("empty prompt")?;
    let vocab = out.last_logits.len();
    let mut ours = named(out.hidden);
    ours.insert("last_logits".into(), Array2::from_shape_vec((1, vocab), out.last_logits)?);
    Ok(ours)
}

/// Loads `fixtures/tiny/<model>` with our loader, runs every recorded prompt on
/// the CPU backend as `mode` says and compares all outputs. Returns the worst
/// relative error over everything compared.
fn check_model(model: &str, expected_prompts: &[&str], mode: Mode) -> TestResult<f32> {
    check_model_file(model, "reference.safetensors", expected_prompts, mode)
}

/// [`check_model`] against the recorded prompts of `file` in the model's folder.
fn check_model_file(model: &str, file: &str, expected_prompts: &[&str], mode: Mode) -> TestResult<f32> {
    check_model_as(model, file, expected_prompts, mode, Dtype::F32, TOLERANCE)
}

/// [`check_model_file`] with the weight matrices stored as `dtype`, every output
/// within `tolerance`.
fn check_model_as(
    model: &str, file: &str, expected_prompts: &[&str], mode: Mode, dtype: Dtype, tolerance: f32,
) -> TestResult<f32> {
    let backend = Arc::new(CpuBackend::new());
    let thinker = Arc::new(Thinker::from_dir_as(&*backend, &model_dir(model), Some(dtype))?);
    assert_eq!(thinker.dtype(), dtype);
    let num_layers = thinker.config().num_hidden_layers;
    let capture = all_captures(num_layers)?;
    let runner = ModelRunner::new(Arc::clone(&backend), Arc::clone(&thinker), capture.clone())?;
    let reference = Reference::open_file(model, file)?;
    assert_eq!(reference.prompts(), expected_prompts, "{model}: prompts in reference.safetensors");

    let mut worst = 0f32;
    let mut failures = Vec::new();
    for p in reference.prompts() {
        let inputs = reference.prompt(p)?;
        let ours = match mode {
            Mode::Uncached => {
                let out = run_uncached(&thinker, &*backend, &inputs, &capture, true)?;
                let mut ours = named(out.hidden);
                ours.insert("logits".into(), out.logits.ok_or("run_uncached returned no per-row logits")?);
                ours
            }
            Mode::Chunked { chunk, block_size } => run_chunked(&runner, &inputs, chunk, block_size)?,
        };
        // Every recorded hidden state is checked, or parity would be claimed for fewer.
        let recorded: Vec<&str> = reference.outputs_of(p).collect();
        assert_eq!(recorded.len(), num_layers + 3, "{model}/{p}: hidden.0..={num_layers}, final, logits");
        for what in recorded.iter().filter(|w| **w != "logits") {
            assert!(ours.contains_key(*what), "{model}/{p}: our run lacks {what}");
        }
        match check_prompt(model, p, &reference, &ours, tolerance) {
            Ok(err) => worst = worst.max(err),
            Err(mut msgs) => failures.append(&mut msgs),
        }
    }
    eprintln!(
        "{model} ({mode:?}, {dtype} weights, {file}): worst relative error {worst:.3e} over {} prompts",
        expected_prompts.len()
    );
    if failures.is_empty() { Ok(worst) } else { Err(failures.join("\n").into()) }
}

// ------------------------------------------------------------------ tests

const TEXT_PROMPTS: &[&str] = &["text_a", "text_b", "text_c"];
const OMNI_PROMPTS: &[&str] = &["mm", "text_a", "text_b", "text_c"];

/// The same references through the paged runner: 7-token steps over 8-token blocks
/// (steps never block aligned; in `mm` the image, audio and video items each straddle
/// a step boundary), blocks reversed and non-contiguous.
#[test]
fn chunked_prefill_reading_the_prefix_from_pages_matches_transformers() -> TestResult {
    let mode = Mode::Chunked { chunk: 7, block_size: 8 };
    check_model("qwen3_dense", TEXT_PROMPTS, mode)?;
    check_model("omni_thinker", OMNI_PROMPTS, mode)?;
    check_model("qwen2_dense", TEXT_PROMPTS, mode)?;
    Ok(())
}

/// Qwen3 dense: qk-norm, GQA 4/2, 1-D RoPE, untied lm_head.
#[test]
fn qwen3_dense_matches_transformers() -> TestResult {
    check_model("qwen3_dense", TEXT_PROMPTS, Mode::Uncached)?;
    Ok(())
}

/// Qwen3-Omni MoE thinker from a checkpoint with the real `thinker.` names and
/// per-expert weights: text prompts, and a text/image/audio/video prompt with item
/// embeddings scattered at the placeholders and HF's interleaved M-RoPE positions.
#[test]
fn omni_thinker_matches_transformers_on_text_and_multimodal_prompts() -> TestResult {
    check_model("omni_thinker", OMNI_PROMPTS, Mode::Uncached)?;
    Ok(())
}

/// The `mm` prompt with DeepStack rows on the image and video items (2 levels),
/// recorded through HF's `Qwen3OmniMoeThinkerTextModel` with `visual_pos_masks` +
/// `deepstack_visual_embeds`.
const DEEPSTACK_FILE: &str = "deepstack_reference.safetensors";

/// Qwen3-Omni DeepStack: level `i` of the image and video rows is added after
/// decoder layer `i`, and `hidden.<i + 1>` is the layer's output before the add,
/// as HF records it. Checked in one step and through paged prefill in chunks that
/// cut both items (7-token steps over 8-token blocks, and 5-token steps over
/// 4-token blocks), where every chunk adds only its own slice of the rows.
#[test]
fn omni_thinker_with_deepstack_matches_transformers_uncached_and_chunked() -> TestResult {
    let reference = Reference::open_file("omni_thinker", DEEPSTACK_FILE)?;
    let inputs = reference.prompt("mm")?;
    let levels: Vec<usize> =
        inputs.embeds.iter().map(|e| e.deepstack.as_ref().map_or(0, |d| d.len())).collect();
    assert_eq!(levels, [2, 0, 2], "image and video carry 2 levels, audio none");
    // Not vacuous: DeepStack changes what HF records after layer 1 (hidden.1 is
    // layer 0's output before the first add, so it equals the plain run's).
    let plain = Reference::open("omni_thinker")?;
    assert_eq!(reference.matrix("mm.hidden.1")?, plain.matrix("mm.hidden.1")?);
    let moved = relative_error(
        "hidden.2",
        reference.matrix("mm.hidden.2")?.view(),
        plain.matrix("mm.hidden.2")?.view(),
    );
    assert!(moved.is_err(), "DeepStack did not change hidden.2");
    for mode in
        [Mode::Uncached, Mode::Chunked { chunk: 7, block_size: 8 }, Mode::Chunked { chunk: 5, block_size: 4 }]
    {
        check_model_file("omni_thinker", DEEPSTACK_FILE, &["mm"], mode)?;
    }
    Ok(())
}

/// How far ours may lie from transformers over the same bf16 weights with every product's
/// input rounded to bf16 too. Not [`TOLERANCE`]: rounding each input to bf16 turns the
/// ~1e-7 by which two f32 sums of different order differ into a whole bf16 step (2^-8 of
/// the value) wherever a value lies that close to a rounding tie. Over the tiny models'
/// prompts that moved the worst output by 2.9e-4 (omni_thinker text_b's logits; qwen2 5.4e-5,
/// qwen3 6.1e-7), against the ≥ 1e-2 that bf16 rounding itself moves them (asserted below).
const BF16_PRODUCTS_TOLERANCE: f32 = 1e-3;

/// bf16 and f16 weight matrices (f32 norms and accumulation; bf16 products read their
/// input rounded to bf16) against transformers in f32 over the same checkpoint with its
/// matrices rounded to that dtype and, for bf16, each `linear`'s input rounded to bf16
/// (`fixtures/make_half_references.py`): the same arithmetic, up to the order of the sums.
#[test]
fn half_precision_weights_match_transformers_over_the_same_rounded_weights() -> TestResult {
    for (dtype, file, tolerance) in [
        (Dtype::Bf16, "bf16_weights_reference.safetensors", BF16_PRODUCTS_TOLERANCE),
        (Dtype::F16, "f16_weights_reference.safetensors", TOLERANCE),
    ] {
        for model in ["qwen3_dense", "qwen2_dense", "omni_thinker"] {
            check_model_as(model, file, TEXT_PROMPTS, Mode::Uncached, dtype, tolerance)?;
        }
        check_model_as(
            "qwen3_dense",
            file,
            TEXT_PROMPTS,
            Mode::Chunked { chunk: 7, block_size: 8 },
            dtype,
            tolerance,
        )?;
    }
    // Not vacuous: bf16 rounding moves the outputs far past the tolerance.
    let f32_ref = Reference::open("qwen3_dense")?;
    let bf16_ref = Reference::open_file("qwen3_dense", "bf16_weights_reference.safetensors")?;
    let moved = relative_error_within(
        "logits",
        bf16_ref.matrix("text_a.logits")?.view(),
        f32_ref.matrix("text_a.logits")?.view(),
        10.0 * BF16_PRODUCTS_TOLERANCE,
    );
    assert!(moved.is_err(), "bf16 rounding moved the logits less than 1e-2");
    Ok(())
}

/// bf16 weights against transformers run in bf16 (weights and activations). The
/// tolerance is derived, not tuned: `fixtures/tiny/half_references.json` records how
/// far transformers' bf16 run lies from its run over the same bf16 weights with f32
/// arithmetic between bf16 products (`bf16_native_vs_bf16_weights_max_rel`: 3.1e-2 for
/// qwen3_dense, 9.8e-3 for qwen2_dense); ours lies within [`BF16_PRODUCTS_TOLERANCE`] of
/// the latter (test above), so it must lie within their sum of the former.
#[test]
fn bf16_weights_are_within_transformers_own_bf16_error_of_transformers_in_bf16() -> TestResult {
    let facts: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model_dir("half_references.json"))?)?;
    for model in ["qwen3_dense", "qwen2_dense"] {
        let own = facts["models"][model]["bf16_native_vs_bf16_weights_max_rel"]
            .as_f64()
            .ok_or("no recorded bf16 error")? as f32;
        assert!(
            own > BF16_PRODUCTS_TOLERANCE,
            "{model}: transformers' bf16 error {own} should exceed the bf16 products' tolerance"
        );
        let bound = own + BF16_PRODUCTS_TOLERANCE;
        let worst = check_model_as(
            model,
            "bf16_native_reference.safetensors",
            TEXT_PROMPTS,
            Mode::Uncached,
            Dtype::Bf16,
            bound,
        )?;
        eprintln!("{model}: ours (bf16 weights) vs transformers bf16: {worst:.3e}, bound {bound:.3e}");
    }
    Ok(())
}

/// Qwen2 dense: q/k/v bias, no qk-norm, tied embeddings (no `lm_head.weight`).
#[test]
fn qwen2_dense_matches_transformers() -> TestResult {
    check_model("qwen2_dense", TEXT_PROMPTS, Mode::Uncached)?;
    Ok(())
}

/// The M-RoPE positions really are 3-D (not `0..L` on every axis), so the
/// multimodal parity above exercises the interleaved rotary path.
#[test]
fn omni_multimodal_prompt_uses_non_linear_positions() -> TestResult {
    let reference = Reference::open("omni_thinker")?;
    let inputs = reference.prompt("mm")?;
    let Some(rope_delta) = inputs.positions.rope_delta() else {
        return Err("mm prompt has no 3-D positions".into());
    };
    let [t, h, w] = &inputs.positions.axes();
    let linear: Vec<i64> = (0..t.len() as i64).collect();
    assert!(t != &linear && h != t && w != h, "positions degenerate to 1-D");
    // HF's definition: the next decode position minus the prompt length.
    let max_pos = t.iter().chain(h).chain(w).copied().max().ok_or("empty positions")?;
    assert_eq!(rope_delta, max_pos + 1 - t.len() as i64);
    assert_eq!(inputs.embeds.len(), 3, "image, audio and video items");
    Ok(())
}

/// The comparison is not vacuous: a perturbation just above the tolerance at one
/// element fails and names that element.
#[test]
fn comparison_reports_first_element_over_tolerance() -> TestResult {
    let reference = Reference::open("qwen3_dense")?;
    let expected = reference.matrix("text_a.final")?;
    assert_eq!(relative_error("same", expected.view(), expected.view()), Ok(0.0));
    let scale = expected.iter().fold(0f32, |m, x| m.max(x.abs()));
    let mut ours = expected.clone();
    ours[[3, 5]] += 2.0 * TOLERANCE * scale;
    let msg = relative_error("perturbed", ours.view(), expected.view())
        .expect_err("a 2x-tolerance error must fail");
    assert!(msg.contains("first at [3, 5]"), "{msg}");
    ours[[3, 5]] = expected[[3, 5]] + 0.5 * TOLERANCE * scale;
    assert!(relative_error("within", ours.view(), expected.view()).is_ok());
    Ok(())
}
