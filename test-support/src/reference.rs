//! The reference side of the parity tests (`tests/engine/hf_parity.rs`,
//! `tests/engine/wgpu_model_parity.rs`): the tiny HF checkpoints' recorded tensors
//! (`fixtures/tiny/<model>/reference.safetensors`, see `fixtures/tiny/README.md`)
//! and the relative error every parity check measures against them.

use std::collections::BTreeMap;
use std::error::Error as StdError;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ndarray::{Array2, ArrayView2, s};
use omniprefix::batch::EmbedRows;
use omniprefix::prompt::Positions;
use omniprefix::runner::PromptInputs;
use safetensors::{Dtype as StDtype, SafeTensors};

pub type TestResult<T = ()> = Result<T, Box<dyn StdError>>;

/// Largest accepted relative error `max|got - want| / max(max|want|, TINY)` per tensor (f32 on both sides).
pub const TOLERANCE: f32 = 1e-4;
/// Floor of the reference scale, so an all-zero reference does not divide by zero.
const TINY: f32 = 1e-6;

/// The committed checkpoint folder of `model` (`qwen3_dense`, `omni_thinker`, `qwen2_dense`).
pub fn model_dir(model: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny").join(model)
}

/// The f32 matrices and i64 vectors of one `reference.safetensors`, decoded to host types.
pub struct Reference {
    /// Every f32 tensor by name (what a test lists recorded prompts and outputs from).
    pub f32s: BTreeMap<String, Array2<f32>>,
    i64s: BTreeMap<String, Vec<i64>>,
}

impl Reference {
    /// Reads `model`'s reference file; f32 tensors must be 2-D (1-D ones become one row), i64 ones are flattened.
    pub fn open(model: &str) -> TestResult<Self> {
        Self::open_file(model, "reference.safetensors")
    }

    /// Reads `file` of `model`'s folder (e.g. `deepstack_reference.safetensors`), as [`Reference::open`].
    pub fn open_file(model: &str, file: &str) -> TestResult<Self> {
        let path = model_dir(model).join(file);
        let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let st = SafeTensors::deserialize(&bytes)?;
        let (mut f32s, mut i64s) = (BTreeMap::new(), BTreeMap::new());
        for (name, view) in st.tensors() {
            match (view.dtype(), view.shape()) {
                (StDtype::F32, &[rows, cols]) => {
                    let data = bytemuck::pod_collect_to_vec(view.data());
                    f32s.insert(name, Array2::from_shape_vec((rows, cols), data)?);
                }
                // A waveform: one row.
                (StDtype::F32, &[len]) => {
                    let data = bytemuck::pod_collect_to_vec(view.data());
                    f32s.insert(name, Array2::from_shape_vec((1, len), data)?);
                }
                (StDtype::I64, _) => {
                    i64s.insert(name, bytemuck::pod_collect_to_vec(view.data()));
                }
                (dtype, shape) => {
                    return Err(format!("{name}: unexpected {dtype:?} {shape:?}").into());
                }
            }
        }
        Ok(Self { f32s, i64s })
    }

    pub fn matrix(&self, name: &str) -> TestResult<&Array2<f32>> {
        self.f32s.get(name).ok_or_else(|| format!("reference lacks `{name}`").into())
    }

    pub fn ints(&self, name: &str) -> TestResult<&[i64]> {
        self.i64s.get(name).map(Vec::as_slice).ok_or_else(|| format!("reference lacks `{name}`").into())
    }

    fn first_int(&self, name: &str) -> TestResult<i64> {
        self.ints(name)?.first().copied().ok_or_else(|| format!("`{name}` is empty").into())
    }

    /// Prompt `p` as runner inputs: text with positions `0..L`, or — when the reference
    /// holds `<p>.position_ids` — HF's 3-D positions and the item rows at their starts
    /// (with their DeepStack levels `<p>.item.<j>.deepstack.<i>` where recorded).
    pub fn prompt(&self, p: &str) -> TestResult<PromptInputs> {
        let token_ids = self
            .ints(&format!("{p}.input_ids"))?
            .iter()
            .map(|&id| u32::try_from(id))
            .collect::<Result<Vec<_>, _>>()?;
        let len = token_ids.len();
        let Ok(pos) = self.ints(&format!("{p}.position_ids")) else {
            return Ok(PromptInputs { token_ids, embeds: vec![], positions: Positions::linear(len) });
        };
        let axis = |a: usize| {
            pos.get(a * len..(a + 1) * len).map(<[i64]>::to_vec).ok_or("position_ids is not [3, L]")
        };
        let rope_delta = self.first_int(&format!("{p}.rope_delta"))?;
        let (t, h, w) = (axis(0)?, axis(1)?, axis(2)?);
        let positions = Positions::given((0..len).map(|i| [t[i], h[i], w[i]]).collect(), rope_delta);
        let mut embeds = Vec::new();
        while let Ok(rows) = self.matrix(&format!("{p}.item.{}.embeds", embeds.len())) {
            let item = format!("{p}.item.{}", embeds.len());
            let start = self.first_int(&format!("{item}.start"))?;
            let levels: Vec<Array2<f32>> = (0..)
                .map_while(|level| self.matrix(&format!("{item}.deepstack.{level}")).ok().cloned())
                .collect();
            embeds.push(EmbedRows {
                step_offset: usize::try_from(start)?,
                rows: 0..rows.nrows(),
                embeddings: Arc::new(rows.clone()),
                deepstack: (!levels.is_empty()).then(|| Arc::new(levels)),
            });
        }
        Ok(PromptInputs { token_ids, embeds, positions })
    }

    /// HF's tensor for our output `what` of prompt `p` (`last_logits`: the last row of `logits`).
    pub fn expected(&self, p: &str, what: &str) -> TestResult<ArrayView2<'_, f32>> {
        if what == "last_logits" {
            let logits = self.matrix(&format!("{p}.logits"))?;
            let last = logits.nrows().checked_sub(1).ok_or("empty logits")?;
            return Ok(logits.slice(s![last.., ..]));
        }
        Ok(self.matrix(&format!("{p}.{what}"))?.view())
    }
}

/// Relative error of `got` against `want`, or a message naming the first element
/// whose error exceeds [`TOLERANCE`] (row-major order).
pub fn relative_error(
    what: &str, got: ArrayView2<'_, f32>, want: ArrayView2<'_, f32>,
) -> Result<f32, String> {
    relative_error_within(what, got, want, TOLERANCE)
}

/// [`relative_error`] with the accepted error `tolerance` instead of [`TOLERANCE`].
pub fn relative_error_within(
    what: &str, got: ArrayView2<'_, f32>, want: ArrayView2<'_, f32>, tolerance: f32,
) -> Result<f32, String> {
    if got.dim() != want.dim() {
        return Err(format!("{what}: shape {:?}, expected {:?}", got.dim(), want.dim()));
    }
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(TINY);
    let mut worst = 0f32;
    let mut first_bad = None;
    for ((idx, &g), &w) in got.indexed_iter().zip(want) {
        let err = (g - w).abs() / scale;
        // NaN compares false: count it as the worst possible error.
        let err = if err.is_nan() { f32::INFINITY } else { err };
        worst = worst.max(err);
        if err > tolerance && first_bad.is_none() {
            first_bad = Some((idx, g, w));
        }
    }
    match first_bad {
        None => Ok(worst),
        Some(((r, c), g, w)) => Err(format!(
            "{what}: relative error {worst:.3e} > {tolerance:e}; first at [{r}, {c}]: got {g}, want {w} (scale {scale})"
        )),
    }
}
