//! The RFC case through the whole engine: after `rfc_text_pair`'s prompt 1,
//! prompt 2 returns `[57, H]` for every captured layer — 32 tokens cached at
//! block size 16 (46 with token-granular reuse) — equal to the uncached run.
//! And the tiny Qwen3-Omni thinker checkpoint through `Engine::from_dir`, with
//! images, audio and video, against transformers' own activations.

use std::collections::BTreeMap;
use std::error::Error as StdError;
use std::path::Path;
use std::sync::Arc;

use ndarray::{Array2, ArrayD, IxDyn};
use omniprefix::canon::{ItemContent, ItemLayout, ItemSpec, Modality, TensorView};
use omniprefix::engine::{Engine, EngineConfig, IndexKind, ItemInput, Output, PlaceholderForm, Request};
use omniprefix::model::{CaptureName, Config};
use omniprefix::prompt::{PositionKind, Positions};
use omniprefix::sched::SchedulerConfig;
use safetensors::{Dtype as StDtype, SafeTensors};

type TestResult<T = ()> = Result<T, Box<dyn StdError>>;

fn fixture(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(path)
}

fn rfc_prompts() -> TestResult<(Vec<u32>, Vec<u32>)> {
    let text = std::fs::read_to_string(fixture("scenarios.json"))?;
    let json: serde_json::Value = serde_json::from_str(&text)?;
    let ids =
        |p: &str| -> TestResult<Vec<u32>> { Ok(serde_json::from_value(json["rfc_text_pair"][p].clone())?) };
    Ok((ids("prompt1")?, ids("prompt2")?))
}

/// `max|got - want| <= tol * max(1, max|want|)`, naming the first element over.
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    if let Some(i) = got.iter().zip(want).position(|(g, w)| (g - w).abs() > tol * scale) {
        panic!("{what}: first mismatch at flat index {i}: {} vs {}", got[i], want[i]);
    }
}

fn assert_same_output(got: &Output, want: &Output) {
    assert_eq!(got.hidden.len(), want.hidden.len());
    for ((name, g), (wname, w)) in got.hidden.iter().zip(&want.hidden) {
        assert_eq!(name, wname);
        assert_eq!(g.dim(), w.dim(), "{name}: shape");
        assert_close(&name.to_string(), g.as_slice().unwrap(), w.as_slice().unwrap(), 1e-5);
    }
    assert_close("last_logits", &got.last_logits, &want.last_logits, 1e-5);
}

/// Every capture point of a model with `layers` layers.
fn all_points(layers: usize) -> Vec<CaptureName> {
    (0..=layers).map(CaptureName::Hidden).chain([CaptureName::Final]).collect()
}

#[test]
fn rfc_text_pair_returns_full_hidden_states_with_32_or_46_cached_tokens() -> TestResult {
    let (p1, p2) = rfc_prompts()?;
    assert_eq!((p1.len(), p2.len()), (67, 57));
    // Hidden 16 keeps the 151936-row Qwen embedding small.
    let model = Config::tiny_qwen3(16, 2, 2, 1, 151_936);
    let config = |cache, token_granular_reuse, index| EngineConfig {
        scheduler: SchedulerConfig { token_granular_reuse, ..Default::default() },
        capture: Some(all_points(2)),
        cache,
        index,
        ..Default::default()
    };
    let mut uncached = Engine::random(model.clone(), 3, config(false, true, IndexKind::Radix))?;
    uncached.run(Request::text(p1.clone()))?;
    let want = uncached.run(Request::text(p2.clone()))?;
    assert_eq!(want.num_cached_tokens, 0);
    assert_eq!(uncached.stats().sched.hits, 0);
    for (granular, index, cached) in
        [(false, IndexKind::Radix, 32), (true, IndexKind::Radix, 46), (false, IndexKind::HashChain, 32)]
    {
        let mut engine = Engine::random(model.clone(), 3, config(true, granular, index))?;
        let first = engine.run(Request::text(p1.clone()))?;
        assert_eq!(first.num_cached_tokens, 0);
        let out = engine.run(Request::text(p2.clone()))?;
        assert_eq!(out.num_cached_tokens, cached, "token-granular {granular}, {index:?}");
        assert_eq!(out.prompt_len, 57);
        for (name, h) in &out.hidden {
            assert_eq!(h.dim(), (57, 16), "{name}");
        }
        assert_same_output(&out, &want);
        // Only the suffix ran, at the suffix's positions.
        assert_eq!(out.computed_positions, Positions::linear(57).slice(cached..57)?);
        assert_eq!(out.computed_positions.axes()[0], (cached as i64..57).collect::<Vec<_>>());
        let stats = engine.stats();
        assert_eq!((stats.sched.queries, stats.sched.hits, stats.sched.hit_tokens), (2, 1, cached as u64));
        engine.validate()?;
    }
    Ok(())
}

/// `reference.safetensors` of a tiny checkpoint, f32 matrices and i64 vectors.
struct Reference {
    f32s: BTreeMap<String, Array2<f32>>,
    i64s: BTreeMap<String, Vec<i64>>,
}

impl Reference {
    fn open(dir: &Path) -> TestResult<Self> {
        let bytes = std::fs::read(dir.join("reference.safetensors"))?;
        let st = SafeTensors::deserialize(&bytes)?;
        let (mut f32s, mut i64s) = (BTreeMap::new(), BTreeMap::new());
        for (name, view) in st.tensors() {
            match (view.dtype(), view.shape()) {
                (StDtype::F32, &[rows, cols]) => {
                    let data = bytemuck::pod_collect_to_vec::<u8, f32>(view.data());
                    f32s.insert(name, Array2::from_shape_vec((rows, cols), data)?);
                }
                (StDtype::I64, _) => {
                    i64s.insert(name, bytemuck::pod_collect_to_vec::<u8, i64>(view.data()));
                }
                other => return Err(format!("{name}: unexpected {other:?}").into()),
            }
        }
        Ok(Reference { f32s, i64s })
    }

    fn matrix(&self, name: &str) -> TestResult<&Array2<f32>> {
        Ok(self.f32s.get(name).ok_or(format!("no {name}"))?)
    }

    fn ints(&self, name: &str) -> TestResult<&[i64]> {
        Ok(self.i64s.get(name).ok_or(format!("no {name}"))?)
    }
}

#[test]
fn omni_checkpoint_through_the_engine_matches_transformers_cached_or_not() -> TestResult {
    let dir = fixture("tiny/omni_thinker");
    let reference = Reference::open(&dir)?;
    let ids: Vec<u32> =
        reference.ints("mm.input_ids")?.iter().map(|&t| u32::try_from(t)).collect::<Result<_, _>>()?;
    // The layouts the fixture script gave HF's get_rope_index (fixtures/tiny/README.md).
    let layouts = [
        (Modality::Image, ItemLayout::Image { grid_thw: [1, 4, 6] }),
        (Modality::Audio, ItemLayout::Audio { mel_frames: 120 }),
        (Modality::Video, ItemLayout::Video { grid_thw: [2, 4, 4], seconds_per_grid: 1.0 }),
    ];
    let contents: Vec<ArrayD<u8>> = (0..3u8).map(|j| ArrayD::from_elem(IxDyn(&[8, 8, 3]), j)).collect();
    let request = || -> TestResult<Request<'_>> {
        let items = layouts
            .iter()
            .zip(&contents)
            .enumerate()
            .map(|(j, ((modality, layout), content))| {
                Ok(ItemInput {
                    spec: ItemSpec {
                        modality: *modality,
                        layout: *layout,
                        content: ItemContent::Tensor(TensorView::U8(content.view())),
                        params: Default::default(),
                    },
                    embeddings: Some(Arc::new(reference.matrix(&format!("mm.item.{j}.embeds"))?.clone())),
                    deepstack: None,
                    routing_hash: None,
                })
            })
            .collect::<TestResult<Vec<_>>>()?;
        Ok(Request {
            tenant: 0,
            token_ids: ids.clone(),
            placeholders: PlaceholderForm::Expanded,
            items,
            ..Default::default()
        })
    };
    let config = EngineConfig {
        scheduler: SchedulerConfig { block_size: 4, max_tokens_per_step: 7, ..Default::default() },
        capture: Some(all_points(3)),
        ..Default::default()
    };
    let mut engine = Engine::from_dir(&dir, config)?;
    let first = engine.run(request()?)?;
    // Positions from our prompt builder equal HF's get_rope_index.
    let len = ids.len();
    let hf = reference.ints("mm.position_ids")?;
    assert_eq!(first.computed_positions.kind(), PositionKind::Mrope);
    assert_eq!(first.computed_positions.axes().concat(), hf);
    let second = engine.run(request()?)?;
    assert_eq!(first.num_cached_tokens, 0);
    // Every position of the first run was cached (its partly filled last block
    // too); the last position always runs.
    assert_eq!(second.num_cached_tokens, len - 1);
    for out in [&first, &second] {
        for (name, got) in &out.hidden {
            let key = match name {
                CaptureName::Hidden(l) => format!("mm.hidden.{l}"),
                CaptureName::Final => "mm.final".into(),
            };
            let want = reference.matrix(&key)?;
            assert_eq!(got.dim(), want.dim(), "{key}");
            assert_close(&key, got.as_slice().unwrap(), want.as_slice().unwrap(), 1e-4);
        }
        let logits = reference.matrix("mm.logits")?;
        assert_close("last logits", &out.last_logits, logits.row(len - 1).as_slice().unwrap(), 1e-4);
    }
    engine.validate()?;
    Ok(())
}
