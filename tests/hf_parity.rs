//! Parity with Hugging Face transformers.
//!
//! `fixtures/make_tiny_models.py` built tiny checkpoints with the HF classes
//! (`Qwen3ForCausalLM`; the Qwen3-Omni MoE thinker with interleaved M-RoPE;
//! `Qwen2ForCausalLM`) and recorded, per prompt, every hidden state, the
//! final-norm output and the logits of every row (see `fixtures/tiny/README.md`).
//! Here each checkpoint goes through our loader and our thinker on the CPU
//! backend, and every recorded tensor must match within [`TOLERANCE`]
//! relative error: `max|ours - ref| / max(max|ref|, TINY)`.

use std::collections::BTreeMap;
use std::error::Error as StdError;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ndarray::{Array2, ArrayView2};
use omniprefix::backend::cpu::CpuBackend;
use omniprefix::batch::EmbedRows;
use omniprefix::model::{CaptureName, CaptureSpec, Thinker};
use omniprefix::prompt::Positions;
use omniprefix::runner::{PromptInputs, run_uncached};
use safetensors::{Dtype as StDtype, SafeTensors};

type TestResult<T = ()> = Result<T, Box<dyn StdError>>;

/// Largest accepted `max|ours - ref| / max(max|ref|, TINY)` per tensor.
const TOLERANCE: f32 = 1e-4;
/// Floor of the reference scale, so an all-zero reference does not divide by zero.
const TINY: f32 = 1e-6;

fn model_dir(model: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/tiny")
        .join(model)
}

// ------------------------------------------------------------------ reference file

/// The tensors of one `reference.safetensors`, decoded to host types.
struct Reference {
    f32s: BTreeMap<String, Array2<f32>>,
    i64s: BTreeMap<String, Vec<i64>>,
}

impl Reference {
    fn open(model: &str) -> TestResult<Self> {
        let path = model_dir(model).join("reference.safetensors");
        let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let st = SafeTensors::deserialize(&bytes)?;
        let (mut f32s, mut i64s) = (BTreeMap::new(), BTreeMap::new());
        for (name, view) in st.tensors() {
            match view.dtype() {
                StDtype::F32 => {
                    let data: Vec<f32> = view
                        .data()
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect();
                    // Matrices are stored 2-D; 1-D f32 tensors do not occur.
                    let &[rows, cols] = view.shape() else {
                        return Err(format!(
                            "{name}: f32 reference of shape {:?}, expected 2-D",
                            view.shape()
                        )
                        .into());
                    };
                    f32s.insert(name, Array2::from_shape_vec((rows, cols), data)?);
                }
                StDtype::I64 => {
                    let data = view
                        .data()
                        .chunks_exact(8)
                        .map(|b| {
                            i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
                        })
                        .collect();
                    i64s.insert(name, data);
                }
                other => return Err(format!("{name}: unexpected dtype {other:?}").into()),
            }
        }
        Ok(Self { f32s, i64s })
    }

    fn matrix(&self, name: &str) -> TestResult<&Array2<f32>> {
        self.f32s
            .get(name)
            .ok_or_else(|| format!("reference lacks `{name}`").into())
    }

    fn ints(&self, name: &str) -> TestResult<&[i64]> {
        self.i64s
            .get(name)
            .map(Vec::as_slice)
            .ok_or_else(|| format!("reference lacks `{name}`").into())
    }

    /// Token ids of prompt `p` as the model's `u32`.
    fn token_ids(&self, p: &str) -> TestResult<Vec<u32>> {
        self.ints(&format!("{p}.input_ids"))?
            .iter()
            .map(|&id| Ok(u32::try_from(id)?))
            .collect()
    }

    /// The prompts recorded (every prompt has `<p>.logits`), in name order.
    fn prompts(&self) -> Vec<&str> {
        self.f32s
            .keys()
            .filter_map(|k| k.strip_suffix(".logits"))
            .collect()
    }

    /// Capture names recorded for prompt `p` (`hidden.<k>`, `final`), plus `logits`.
    fn outputs_of<'a>(&'a self, p: &str) -> impl Iterator<Item = (&'a str, &'a Array2<f32>)> {
        let prefix = format!("{p}.");
        self.f32s.iter().filter_map(move |(k, v)| {
            let what = k.strip_prefix(&prefix)?;
            (what == "final" || what == "logits" || what.starts_with("hidden."))
                .then_some((what, v))
        })
    }
}

// ------------------------------------------------------------------ comparison

/// Relative error of `ours` against `reference`, or a message naming the first
/// element whose error exceeds the tolerance (row-major order).
fn compare(
    what: &str,
    ours: ArrayView2<'_, f32>,
    reference: ArrayView2<'_, f32>,
) -> Result<f32, String> {
    if ours.dim() != reference.dim() {
        return Err(format!(
            "{what}: shape {:?}, reference {:?}",
            ours.dim(),
            reference.dim()
        ));
    }
    let scale = reference.iter().fold(0f32, |m, x| m.max(x.abs())).max(TINY);
    let mut worst = 0f32;
    let mut first_bad = None;
    for ((idx, &a), &b) in ours.indexed_iter().zip(reference.iter()) {
        let err = (a - b).abs() / scale;
        // NaN compares false: count it as the worst possible error.
        let err = if err.is_nan() { f32::INFINITY } else { err };
        worst = worst.max(err);
        if err > TOLERANCE && first_bad.is_none() {
            first_bad = Some((idx, a, b));
        }
    }
    match first_bad {
        None => Ok(worst),
        Some(((r, c), a, b)) => Err(format!(
            "{what}: relative error {worst:.3e} > {TOLERANCE:e}; first at [{r}, {c}]: ours {a}, reference {b} (scale {scale})"
        )),
    }
}

/// Checks every recorded output of prompt `p` against `ours` (capture name → matrix).
/// Returns the worst relative error, or every failure message.
fn check_prompt(
    model: &str,
    p: &str,
    reference: &Reference,
    ours: &BTreeMap<String, Array2<f32>>,
) -> Result<f32, Vec<String>> {
    let mut worst = 0f32;
    let mut failures = Vec::new();
    for (what, expected) in reference.outputs_of(p) {
        let label = format!("{model}/{p}.{what}");
        match ours.get(what) {
            None => failures.push(format!("{label}: not produced by our run")),
            Some(got) => match compare(&label, got.view(), expected.view()) {
                Ok(err) => worst = worst.max(err),
                Err(msg) => failures.push(msg),
            },
        }
    }
    if failures.is_empty() {
        Ok(worst)
    } else {
        Err(failures)
    }
}

// ------------------------------------------------------------------ our side

/// Every capture point the fixtures hold: `hidden.0..=num_layers` and `final`.
fn all_captures(num_layers: usize) -> TestResult<CaptureSpec> {
    let points = (0..=num_layers)
        .map(CaptureName::Hidden)
        .chain([CaptureName::Final]);
    Ok(CaptureSpec::new(points, num_layers)?)
}

/// Prompt `p` as our runner's inputs: plain text with positions `0..L`, or —
/// when the reference holds `<p>.position_ids` — HF's 3-D positions and the item
/// embeddings at their recorded starts.
fn prompt_inputs(reference: &Reference, p: &str) -> TestResult<PromptInputs> {
    let token_ids = reference.token_ids(p)?;
    let len = token_ids.len();
    let Ok(pos) = reference.ints(&format!("{p}.position_ids")) else {
        let positions = Positions::Linear((0..len as i64).collect());
        return Ok(PromptInputs {
            token_ids,
            embeds: vec![],
            positions,
        });
    };
    let axis = |a: usize| {
        pos.get(a * len..(a + 1) * len)
            .map(<[i64]>::to_vec)
            .ok_or("position_ids is not [3, L]")
    };
    let rope_delta = *reference
        .ints(&format!("{p}.rope_delta"))?
        .first()
        .ok_or("empty rope_delta")?;
    let positions = Positions::Mrope {
        t: axis(0)?,
        h: axis(1)?,
        w: axis(2)?,
        rope_delta,
    };
    let mut embeds = Vec::new();
    for j in 0.. {
        let Ok(rows) = reference.matrix(&format!("{p}.item.{j}.embeds")) else {
            break;
        };
        let start = *reference
            .ints(&format!("{p}.item.{j}.start"))?
            .first()
            .ok_or("empty item start")?;
        embeds.push(EmbedRows {
            step_offset: usize::try_from(start)?,
            rows: 0..rows.nrows(),
            embeddings: Arc::new(rows.clone()),
        });
    }
    Ok(PromptInputs {
        token_ids,
        embeds,
        positions,
    })
}

/// Loads `fixtures/tiny/<model>` with our loader, runs every recorded prompt
/// uncached on the CPU backend and compares all outputs. Returns the worst
/// relative error over everything compared.
fn check_model(model: &str, expected_prompts: &[&str]) -> TestResult<f32> {
    let backend = CpuBackend::new();
    let thinker = Thinker::from_dir(&backend, &model_dir(model))?;
    let num_layers = thinker.config().num_hidden_layers;
    let capture = all_captures(num_layers)?;
    let reference = Reference::open(model)?;
    assert_eq!(
        reference.prompts(),
        expected_prompts,
        "{model}: prompts in reference.safetensors"
    );

    let mut worst = 0f32;
    let mut failures = Vec::new();
    for p in reference.prompts() {
        let out = run_uncached(
            &thinker,
            &backend,
            &prompt_inputs(&reference, p)?,
            &capture,
            true,
        )?;
        let mut ours: BTreeMap<String, Array2<f32>> = out
            .hidden
            .into_iter()
            .map(|(name, m)| (name.to_string(), m))
            .collect();
        ours.insert(
            "logits".into(),
            out.logits
                .ok_or("run_uncached returned no per-row logits")?,
        );
        // The fixture must cover every capture point, or parity would be claimed for fewer.
        let recorded = reference.outputs_of(p).count();
        assert_eq!(
            recorded,
            num_layers + 3,
            "{model}/{p}: hidden.0..={num_layers}, final and logits recorded"
        );
        match check_prompt(model, p, &reference, &ours) {
            Ok(err) => worst = worst.max(err),
            Err(mut msgs) => failures.append(&mut msgs),
        }
    }
    eprintln!(
        "{model}: worst relative error {worst:.3e} over {} prompts",
        expected_prompts.len()
    );
    if failures.is_empty() {
        Ok(worst)
    } else {
        Err(failures.join("\n").into())
    }
}

// ------------------------------------------------------------------ tests

/// Qwen3 dense: qk-norm, GQA 4/2, 1-D RoPE, untied lm_head.
#[test]
fn qwen3_dense_matches_transformers() -> TestResult {
    check_model("qwen3_dense", &["text_a", "text_b", "text_c"])?;
    Ok(())
}

/// Qwen3-Omni MoE thinker from a checkpoint with the real `thinker.` names and
/// per-expert weights: text prompts, and a text/image/audio/video prompt with item
/// embeddings scattered at the placeholders and HF's interleaved M-RoPE positions.
#[test]
fn omni_thinker_matches_transformers_on_text_and_multimodal_prompts() -> TestResult {
    check_model("omni_thinker", &["mm", "text_a", "text_b", "text_c"])?;
    Ok(())
}

/// Qwen2 dense: q/k/v bias, no qk-norm, tied embeddings (no `lm_head.weight`).
#[test]
fn qwen2_dense_matches_transformers() -> TestResult {
    check_model("qwen2_dense", &["text_a", "text_b", "text_c"])?;
    Ok(())
}

/// The M-RoPE positions really are 3-D (not `0..L` on every axis), so the
/// multimodal parity above exercises the interleaved rotary path.
#[test]
fn omni_multimodal_prompt_uses_non_linear_positions() -> TestResult {
    let reference = Reference::open("omni_thinker")?;
    let inputs = prompt_inputs(&reference, "mm")?;
    let Positions::Mrope {
        t,
        h,
        w,
        rope_delta,
    } = &inputs.positions
    else {
        return Err("mm prompt has no 3-D positions".into());
    };
    let linear: Vec<i64> = (0..t.len() as i64).collect();
    assert!(
        t != &linear && h != t && w != h,
        "positions degenerate to 1-D"
    );
    // HF's definition: the next decode position minus the prompt length.
    let max_pos = t
        .iter()
        .chain(h)
        .chain(w)
        .copied()
        .max()
        .ok_or("empty positions")?;
    assert_eq!(*rope_delta, max_pos + 1 - t.len() as i64);
    assert_eq!(inputs.embeds.len(), 3, "image, audio and video items");
    Ok(())
}

/// The comparison is not vacuous: a perturbation just above the tolerance at one
/// element fails and names that element.
#[test]
fn comparison_reports_first_element_over_tolerance() -> TestResult {
    let reference = Reference::open("qwen3_dense")?;
    let expected = reference.matrix("text_a.final")?;
    assert_eq!(compare("same", expected.view(), expected.view()), Ok(0.0));
    let scale = expected.iter().fold(0f32, |m, x| m.max(x.abs()));
    let mut ours = expected.clone();
    ours[[3, 5]] += 2.0 * TOLERANCE * scale;
    let msg = compare("perturbed", ours.view(), expected.view())
        .expect_err("a 2x-tolerance error must fail");
    assert!(msg.contains("first at [3, 5]"), "{msg}");
    ours[[3, 5]] = expected[[3, 5]] + 0.5 * TOLERANCE * scale;
    assert!(compare("within", ours.view(), expected.view()).is_ok());
    Ok(())
}
