//! Greedy generation equals Hugging Face transformers' `generate`.
//!
//! `fixtures/make_tiny_models.py` ran HF's greedy `generate` (12 tokens, no eos, eager
//! attention) on the tiny checkpoints and recorded the tokens and, for every position
//! that ran (the prompt, then each generated token but the last), every hidden state
//! (`fixtures/tiny/<model>/generate_reference.safetensors`, see `fixtures/tiny/README.md`).
//! For the Omni thinker the prompt `mm_prefix` holds an image, an audio and a video item
//! and HF's own `thinker.generate` placed the generated tokens (M-RoPE positions
//! `L + i + rope_delta` on every axis), so the decode positions after `get_rope_index`
//! are covered.
//!
//! Here each checkpoint goes through `Engine::from_dir_on` with every hidden state
//! captured and 4-token blocks, and `Engine::generate` must return HF's tokens exactly
//! and every hidden row within [`reference::TOLERANCE`] relative error. The same engine
//! then serves the prompt again (all but its last position cached: identical tokens,
//! hidden rows bit-identical on the CPU, within the tolerance on wgpu) and prompt + reply (every position the first run ran
//! cached, its partly filled last block included; the one token generated is HF's 12th).
//! On the CPU backend and on wgpu (see `shared_gpu`: skip loudly without an adapter,
//! fail under `OMNIPREFIX_REQUIRE_GPU=1`).
//!
//! Placeholder masking (issue 22): `fixtures/tiny/omni_thinker/suppress_reference.safetensors`
//! holds HF's greedy `generate` on a text prompt whose free reply holds a video pad
//! (`pads_allowed`), and the same with `suppress_tokens` = the image, video and audio pad ids
//! (`pads_suppressed`; facts in `suppress_reference.json`). The engine's default (masked)
//! generation must equal the second, with `allow_special_ids` the first.

#[cfg(feature = "wgpu")]
use crate::shared_gpu;
use support::reference;

use std::sync::Arc;

use ndarray::{Array2, ArrayD, IxDyn};
use omniprefix::backend::cpu::CpuBackend;
use omniprefix::backend::{Backend, Dtype};
use omniprefix::canon::{ItemContent, ItemLayout, ItemSpec, Modality, TensorView};
use omniprefix::engine::{Engine, EngineConfig, ItemInput, Output, PlaceholderForm, Request};
use omniprefix::model::CaptureName;
use omniprefix::sample::{FinishReason, SamplingParams, placeholder_ids};
use omniprefix::sched::SchedulerConfig;
use reference::{Reference, TestResult, model_dir, relative_error, relative_error_within};
#[cfg(feature = "wgpu")]
use shared_gpu::gpu;

const GEN_FILE: &str = "generate_reference.safetensors";
/// HF greedy `generate` with and without `suppress_tokens` = the placeholder ids (issue 22).
const SUPPRESS_FILE: &str = "suppress_reference.safetensors";
/// Tokens HF generated per prompt.
const GEN_TOKENS: usize = 12;
/// KV block size: every prompt and every reply ends inside a block.
const BLOCK_SIZE: usize = 4;

/// The checkpoints, their layer counts and generate prompts (`VERSIONS.json`, `generate`).
const MODELS: [(&str, usize, &[&str]); 3] = [
    ("qwen3_dense", 3, &["text_a", "text_b"]),
    ("omni_thinker", 3, &["mm_prefix", "text_c"]),
    ("qwen2_dense", 2, &["text_a", "text_b"]),
];

/// The layouts the fixture script gave HF's `get_rope_index` for the `mm` items
/// (`VERSIONS.json`, `omni_thinker.mm_layout`): item j's rows are `mm.item.<j>.embeds`
/// of `reference.safetensors`.
const MM_LAYOUTS: [(Modality, ItemLayout); 3] = [
    (Modality::Image, ItemLayout::Image { grid_thw: [1, 4, 6] }),
    (Modality::Audio, ItemLayout::Audio { mel_frames: 120 }),
    (Modality::Video, ItemLayout::Video { grid_thw: [2, 4, 4], seconds_per_grid: 1.0 }),
];

/// How weights and K/V pages are stored, the hidden rows' accepted error against HF
/// (f32), and how close a cached run's rows must be to the first run's.
struct Precision {
    dtype: Option<Dtype>,
    kv_dtype: Dtype,
    tolerance: f32,
    /// `None`: the same bits (the CPU backend: a row never depends on its batch);
    /// `Some(t)`: within `t` relative (wgpu: a row re-run alone takes the decode kernel,
    /// which sums in another order than the prefill kernel that ran it first).
    cached: Option<f32>,
}

/// The checkpoints' own f32 weights and pages on the CPU.
const F32: Precision =
    Precision { dtype: None, kv_dtype: Dtype::F32, tolerance: reference::TOLERANCE, cached: None };

/// Greedy, exactly `n` tokens.
fn greedy(n: usize) -> SamplingParams {
    SamplingParams { ignore_eos: true, ..SamplingParams::greedy(n) }
}

/// Every capture point the fixtures hold: `hidden.0..=num_layers` and `final`.
fn all_points(num_layers: usize) -> Vec<CaptureName> {
    (0..=num_layers).map(CaptureName::Hidden).chain([CaptureName::Final]).collect()
}

fn to_u32(ids: &[i64]) -> TestResult<Vec<u32>> {
    Ok(ids.iter().map(|&t| u32::try_from(t)).collect::<Result<_, _>>()?)
}

/// One recorded generation: the prompt, HF's tokens, and the item rows of a multimodal prompt.
struct Case {
    model: &'static str,
    prompt: &'static str,
    num_layers: usize,
    ids: Vec<u32>,
    hf_tokens: Vec<u32>,
    hf: Reference,
    /// `mm.item.<j>.embeds` for `mm_prefix` (from `reference.safetensors`), else empty.
    items: Vec<Arc<Array2<f32>>>,
    /// Stand-in item bytes (only fingerprinted: the embeddings are given).
    contents: Vec<ArrayD<u8>>,
}

impl Case {
    fn open(model: &'static str, num_layers: usize, prompt: &'static str) -> TestResult<Self> {
        Self::open_in(GEN_FILE, model, num_layers, prompt)
    }

    /// `prompt` of `file` (named as in [`GEN_FILE`]) of `model`'s folder.
    fn open_in(file: &str, model: &'static str, num_layers: usize, prompt: &'static str) -> TestResult<Self> {
        let hf = Reference::open_file(model, file)?;
        let ids = to_u32(hf.ints(&format!("{prompt}.input_ids"))?)?;
        let hf_tokens = to_u32(hf.ints(&format!("{prompt}.gen.tokens"))?)?;
        assert_eq!(hf_tokens.len(), GEN_TOKENS, "{model}/{prompt}: tokens recorded");
        let (mut items, mut contents) = (Vec::new(), Vec::new());
        if prompt.starts_with("mm") {
            let base = Reference::open(model)?;
            // `mm_prefix` is the start of `mm`, items included.
            let mm = to_u32(base.ints("mm.input_ids")?)?;
            assert_eq!(ids[..], mm[..ids.len()], "{prompt} is a prefix of mm");
            for j in 0..MM_LAYOUTS.len() {
                let rows = base.matrix(&format!("mm.item.{j}.embeds"))?;
                let start = usize::try_from(base.ints(&format!("mm.item.{j}.start"))?[0])?;
                assert!(start + rows.nrows() < ids.len(), "item {j} lies inside {prompt}");
                items.push(Arc::new(rows.clone()));
                contents.push(ArrayD::from_elem(IxDyn(&[8, 8, 3]), j as u8));
            }
        }
        Ok(Case { model, prompt, num_layers, ids, hf_tokens, hf, items, contents })
    }

    fn label(&self) -> String {
        format!("{}/{}", self.model, self.prompt)
    }

    /// The prompt followed by `tail` (generated ids), with the items at their placeholders.
    fn request(&self, tail: &[u32]) -> Request<'_> {
        let items = MM_LAYOUTS
            .iter()
            .zip(&self.items)
            .zip(&self.contents)
            .map(|(((modality, layout), rows), content)| ItemInput {
                spec: ItemSpec {
                    modality: *modality,
                    layout: *layout,
                    content: ItemContent::Tensor(TensorView::U8(content.view())),
                    params: Default::default(),
                },
                embeddings: Some(Arc::clone(rows)),
                deepstack: None,
                routing_hash: None,
            })
            .collect();
        Request {
            tenant: 0,
            token_ids: [&self.ids[..], tail].concat(),
            placeholders: PlaceholderForm::Expanded,
            items,
            ..Default::default()
        }
    }

    /// Every capture of `got` (all `L + 11` rows) against HF's `<p>.gen.<capture>`;
    /// the worst relative error, or every failure with its first bad position.
    fn check_hidden(&self, what: &str, got: &Output, tolerance: f32) -> TestResult<f32> {
        let label = format!("{} {what}", self.label());
        let names: Vec<CaptureName> = got.hidden.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, all_points(self.num_layers), "{label}: captures");
        let mut worst = 0f32;
        let mut failures = Vec::new();
        for (name, h) in &got.hidden {
            let want = self.hf.matrix(&format!("{}.gen.{name}", self.prompt))?;
            match relative_error_within(&format!("{label} {name}"), h.view(), want.view(), tolerance) {
                Ok(err) => worst = worst.max(err),
                Err(msg) => failures.push(format!("{msg}{}", first_bad_row(h, want, tolerance))),
            }
        }
        if failures.is_empty() { Ok(worst) } else { Err(failures.join("\n").into()) }
    }
}

/// Where a mismatch starts, in words: the first row (= position that ran) whose
/// error exceeds the tolerance, and whether it is a prompt or a decode row.
fn first_bad_row(got: &Array2<f32>, want: &Array2<f32>, tolerance: f32) -> String {
    if got.dim() != want.dim() {
        return String::new();
    }
    let scale = want.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
    let bad = got.rows().into_iter().zip(want.rows()).position(|(g, w)| {
        g.iter().zip(w).any(|(a, b)| (a - b).is_nan() || (a - b).abs() / scale > tolerance)
    });
    bad.map_or_else(String::new, |r| format!(" (first bad row: position {r} of {})", got.nrows()))
}

/// The rows of `a` are those of `b`: the same bits, or within `within` relative.
fn assert_hidden_same(label: &str, a: &Output, b: &Output, within: Option<f32>) -> TestResult {
    assert_eq!(a.hidden.len(), b.hidden.len(), "{label}: captures");
    for ((na, ha), (nb, hb)) in a.hidden.iter().zip(&b.hidden) {
        assert_eq!(na, nb, "{label}: capture order");
        assert_eq!(ha.dim(), hb.dim(), "{label} {na}: shape");
        match within {
            None => {
                let same = ha.iter().zip(hb).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{label} {na}: cached run differs from the first run");
            }
            Some(t) => {
                relative_error_within(
                    &format!("{label} {na}: cached vs first run"),
                    ha.view(),
                    hb.view(),
                    t,
                )?;
            }
        }
    }
    Ok(())
}

/// Runs every prompt of `model` on `backend` (fresh engine per prompt, caching on):
/// HF's tokens and hidden rows; the same prompt again with every prompt position but
/// the last cached; prompt + the first 11 generated tokens with every position the
/// first run ran cached, which then generates HF's 12th token. Returns the worst
/// relative error against HF.
fn check_model<B: Backend>(backend: &Arc<B>, model: &'static str, precision: &Precision) -> TestResult<f32> {
    let (_, num_layers, prompts) = MODELS.iter().find(|m| m.0 == model).ok_or("unknown model")?;
    let mut worst = 0f32;
    for prompt in *prompts {
        let case = Case::open(model, *num_layers, prompt)?;
        let label = case.label();
        let len = case.ids.len();
        let config = EngineConfig {
            scheduler: SchedulerConfig { block_size: BLOCK_SIZE, ..Default::default() },
            capture: Some(all_points(*num_layers)),
            dtype: precision.dtype,
            kv_dtype: precision.kv_dtype,
            ..Default::default()
        };
        let mut engine = Engine::from_dir_on(Arc::clone(backend), &model_dir(model), config)?;

        let first = engine.run(case.request(&[]).generate(greedy(GEN_TOKENS)))?;
        assert_eq!((first.prompt_len, first.num_cached_tokens), (len, 0), "{label}: first run");
        assert_eq!(first.finish_reason, Some(FinishReason::Length), "{label}");
        assert_eq!(first.tokens, case.hf_tokens, "{label}: tokens differ from transformers' generate");
        let err = case.check_hidden("generate", &first, precision.tolerance)?;
        worst = worst.max(err);

        // The same prompt again: its last position must run, everything before it is cached.
        let again = engine.run(case.request(&[]).generate(greedy(GEN_TOKENS)))?;
        assert_eq!(again.num_cached_tokens, len - 1, "{label}: second run reuses the prompt");
        assert_eq!(again.tokens, first.tokens, "{label}: cached run's tokens");
        assert_hidden_same(&format!("{label} again"), &again, &first, precision.cached)?;

        // Prompt + reply as the next round: all L + 11 positions that ran are cached
        // (the partly filled last block of the first run included) but the last, which
        // runs again and must choose HF's 12th token.
        let reply = &first.tokens[..GEN_TOKENS - 1];
        let next = engine.run(case.request(reply).generate(greedy(1)))?;
        assert_eq!(next.prompt_len, len + GEN_TOKENS - 1, "{label}: follow-up prompt");
        assert_eq!(
            next.num_cached_tokens,
            len + GEN_TOKENS - 2,
            "{label}: follow-up reuses every position that ran"
        );
        assert_eq!(next.tokens, case.hf_tokens[GEN_TOKENS - 1..], "{label}: follow-up token");
        assert_hidden_same(&format!("{label} follow-up"), &next, &first, precision.cached)?;

        engine.validate()?;
        eprintln!("{label} on {}: tokens equal, worst relative error {err:.3e}", std::any::type_name::<B>());
    }
    Ok(worst)
}

/// Issue 22 on `backend`: the Omni thinker's masked greedy reply (the default) is HF's with
/// `suppress_tokens` = the placeholder ids, tokens exactly and hidden rows within the
/// tolerance; with `allow_special_ids` it is HF's free reply, which holds a pad. The masked
/// reply re-sends as the next round's prompt, the free one is rejected. Returns the worst
/// relative error and how many of the 12 tokens the two replies differ at.
fn check_suppressed<B: Backend>(backend: &Arc<B>, precision: &Precision) -> TestResult<(f32, usize)> {
    let allowed = Case::open_in(SUPPRESS_FILE, "omni_thinker", 3, "pads_allowed")?;
    let suppressed = Case::open_in(SUPPRESS_FILE, "omni_thinker", 3, "pads_suppressed")?;
    assert_eq!(allowed.ids, suppressed.ids, "one prompt, two runs");
    let config = EngineConfig {
        scheduler: SchedulerConfig { block_size: BLOCK_SIZE, ..Default::default() },
        capture: Some(all_points(3)),
        dtype: precision.dtype,
        kv_dtype: precision.kv_dtype,
        ..Default::default()
    };
    let mut engine = Engine::from_dir_on(Arc::clone(backend), &model_dir("omni_thinker"), config)?;
    // The checkpoint's own ids (config.json), as the fixture script suppressed them.
    let pads = placeholder_ids(engine.tokens());
    assert_eq!(pads, [254, 255, 249], "image, video, audio pads of the tiny Omni config");
    let first =
        allowed.hf_tokens.iter().position(|t| pads.contains(t)).ok_or("HF's free reply holds no pad")?;
    assert!(suppressed.hf_tokens.iter().all(|t| !pads.contains(t)));

    let masked = engine.run(suppressed.request(&[]).generate(greedy(GEN_TOKENS)))?;
    assert_eq!(
        masked.tokens, suppressed.hf_tokens,
        "masked reply differs from transformers' suppress_tokens"
    );
    let mut worst = suppressed.check_hidden("masked", &masked, precision.tolerance)?;
    let raw = engine.run(
        allowed.request(&[]).generate(SamplingParams { allow_special_ids: true, ..greedy(GEN_TOKENS) }),
    )?;
    assert_eq!(raw.tokens, allowed.hf_tokens, "unmasked reply differs from transformers' free generate");
    worst = worst.max(allowed.check_hidden("unmasked", &raw, precision.tolerance)?);
    assert_eq!(masked.tokens[..first], raw.tokens[..first]);
    let differing = masked.tokens.iter().zip(&raw.tokens).filter(|(a, b)| a != b).count();

    let next = engine.run(suppressed.request(&masked.tokens))?;
    assert_eq!(
        next.num_cached_tokens,
        suppressed.ids.len() + GEN_TOKENS - 1,
        "the masked reply re-sends, cached"
    );
    assert!(engine.run(allowed.request(&raw.tokens)).is_err(), "a re-sent reply holding a pad is rejected");
    engine.validate()?;
    Ok((worst, differing))
}

fn cpu() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::new())
}

// ------------------------------------------------------------------ CPU

/// Qwen3 dense: qk-norm, GQA, 1-D RoPE.
#[test]
fn qwen3_dense_generates_what_transformers_generates() -> TestResult {
    let worst = check_model(&cpu(), "qwen3_dense", &F32)?;
    eprintln!("qwen3_dense (cpu): worst relative error {worst:.3e}");
    Ok(())
}

/// Qwen2 dense: q/k/v bias, tied embeddings.
#[test]
fn qwen2_dense_generates_what_transformers_generates() -> TestResult {
    let worst = check_model(&cpu(), "qwen2_dense", &F32)?;
    eprintln!("qwen2_dense (cpu): worst relative error {worst:.3e}");
    Ok(())
}

/// The Omni MoE thinker: a text prompt, and image + audio + video items, after
/// which HF decodes at `L + i + rope_delta` on all three M-RoPE axes.
#[test]
fn omni_thinker_generates_what_transformers_generates_after_multimodal_items() -> TestResult {
    let worst = check_model(&cpu(), "omni_thinker", &F32)?;
    eprintln!("omni_thinker (cpu): worst relative error {worst:.3e}");
    Ok(())
}

/// Placeholder masking equals transformers' `suppress_tokens` (issue 22).
#[test]
fn omni_thinker_masks_placeholders_as_transformers_suppress_tokens_does() -> TestResult {
    let (worst, differing) = check_suppressed(&cpu(), &F32)?;
    eprintln!(
        "omni_thinker suppress (cpu): {differing} of {GEN_TOKENS} tokens differ from the free reply, worst relative error {worst:.3e}"
    );
    Ok(())
}

/// The decode positions HF used (`<p>.gen.position_ids`, recorded as they entered the
/// text model) are ours: the prompt's from our prompt builder, then text counting on
/// from the largest position + 1 (`Positions::append_text`, what the engine decodes
/// at), and a re-sent prompt + reply gets the same positions from the prompt builder.
/// Not vacuous: `mm_prefix`'s rope delta is not 0.
#[test]
fn omni_decode_positions_are_transformers_cache_position_plus_rope_deltas() -> TestResult {
    for prompt in ["mm_prefix", "text_c"] {
        let case = Case::open("omni_thinker", 3, prompt)?;
        let hf = case.hf.ints(&format!("{prompt}.gen.position_ids"))?;
        let delta = case.hf.ints(&format!("{prompt}.gen.rope_delta"))?[0];
        assert_eq!(delta != 0, prompt == "mm_prefix", "{prompt}: rope delta {delta}");
        let rows = case.ids.len() + GEN_TOKENS - 1;
        assert_eq!(hf.len(), 3 * rows, "{prompt}: [3, L + 11]");
        let config = EngineConfig {
            scheduler: SchedulerConfig { block_size: BLOCK_SIZE, ..Default::default() },
            cache: false,
            ..Default::default()
        };
        let mut engine = Engine::from_dir(&model_dir("omni_thinker"), config)?;

        let mut positions = engine.run(case.request(&[]))?.computed_positions;
        assert_eq!(positions.rope_delta(), Some(delta), "{prompt}: our rope delta");
        positions.append_text(GEN_TOKENS - 1);
        assert_eq!(positions.axes().concat(), hf, "{prompt}: prompt then decode positions");

        let resent = engine.run(case.request(&case.hf_tokens[..GEN_TOKENS - 1]))?.computed_positions;
        assert_eq!(resent.axes().concat(), hf, "{prompt}: prompt + reply as a new prompt");
    }
    Ok(())
}

/// The comparison is not vacuous: HF's decode rows differ from the prompt step's last
/// row and from each other, and a perturbation of one decode row above the tolerance
/// is named with its position.
#[test]
fn generate_reference_rows_are_distinct_and_checked_per_row() -> TestResult {
    let case = Case::open("qwen3_dense", 3, "text_a")?;
    let want = case.hf.matrix("text_a.gen.final")?;
    let len = case.ids.len();
    assert_eq!(want.nrows(), len + GEN_TOKENS - 1);
    for r in len..want.nrows() {
        assert_ne!(want.row(r), want.row(r - 1), "decode row {r} repeats the row before");
    }
    let mut got = want.clone();
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    got[[len + 3, 7]] += 2.0 * reference::TOLERANCE * scale;
    assert!(relative_error("perturbed", got.view(), want.view()).is_err());
    assert_eq!(
        first_bad_row(&got, want, reference::TOLERANCE),
        format!(" (first bad row: position {} of {})", len + 3, want.nrows())
    );
    Ok(())
}

// ------------------------------------------------------------------ wgpu

/// All three checkpoints on the wgpu backend: HF's tokens, hidden rows within
/// [`reference::TOLERANCE`], and the cached rounds within it of the first run.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_generates_what_transformers_generates() -> TestResult {
    let Some(gpu) = gpu() else { return Ok(()) };
    let gpu = Arc::new(gpu);
    for (model, _, _) in MODELS {
        let f32 = Precision { cached: Some(reference::TOLERANCE), ..F32 };
        let worst = check_model(&gpu, model, &f32)?;
        eprintln!("{model} (wgpu): worst relative error {worst:.3e}");
    }
    Ok(())
}

/// Placeholder masking on wgpu: transformers' `suppress_tokens` tokens, rows within the tolerance.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_masks_placeholders_as_transformers_suppress_tokens_does() -> TestResult {
    let Some(gpu) = gpu() else { return Ok(()) };
    let (worst, differing) = check_suppressed(&Arc::new(gpu), &F32)?;
    eprintln!(
        "omni_thinker suppress (wgpu): {differing} of {GEN_TOKENS} tokens differ, worst relative error {worst:.3e}"
    );
    Ok(())
}

/// f16 weights and f16 K/V pages on wgpu: HF's greedy tokens (HF ran in f32 over the
/// original weights), every hidden row within the issue-13 bound of 5e-3, and the
/// cached rounds within 1e-3 of the first.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_f16_generates_what_transformers_generates() -> TestResult {
    let Some(gpu) = gpu() else { return Ok(()) };
    let gpu = Arc::new(gpu);
    let f16 =
        Precision { dtype: Some(Dtype::F16), kv_dtype: Dtype::F16, tolerance: 5e-3, cached: Some(1e-3) };
    for (model, _, _) in MODELS {
        let worst = check_model(&gpu, model, &f16)?;
        eprintln!("{model} (wgpu f16): worst relative error {worst:.3e}");
    }
    Ok(())
}

/// Decode on wgpu waits for the device once per step (the step's logits and hidden
/// rows in one download), not once per layer or per capture: 12 tokens of the
/// Omni thinker with every hidden state captured cost 12 waits. Its own device, so
/// the other tests' downloads do not count.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_generation_waits_for_the_device_once_per_step() -> TestResult {
    use omniprefix::backend::wgpu::{GpuContext, GpuOptions, WgpuBackend};
    if gpu().is_none() {
        return Ok(());
    }
    let gpu = Arc::new(WgpuBackend::from_context(Arc::new(GpuContext::new(&GpuOptions::default())?)));
    let case = Case::open("omni_thinker", 3, "mm_prefix")?;
    let config = EngineConfig {
        scheduler: SchedulerConfig { block_size: BLOCK_SIZE, ..Default::default() },
        capture: Some(all_points(3)),
        ..Default::default()
    };
    let mut engine = Engine::from_dir_on(Arc::clone(&gpu), &model_dir("omni_thinker"), config)?;
    let before = gpu.context().host_waits();
    let generation = engine.run(case.request(&[]).generate(greedy(GEN_TOKENS)))?;
    assert_eq!(generation.tokens, case.hf_tokens);
    assert_eq!(gpu.context().host_waits() - before, GEN_TOKENS as u64, "host waits for {GEN_TOKENS} steps");
    Ok(())
}
