//! The bad-input catalogue (`docs/security.md`, "Bad inputs"): every class of malformed
//! checkpoint, config or request gets its own typed `Error` variant, and the
//! cache state of a warm scheduler (pool, radix index, request bookkeeping)
//! is exactly what it was before — `validate()` passes and every counter is
//! unchanged.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ndarray::{Array1, Array2, Array3, ArrayD, ArrayViewD, IxDyn, s};
use omniprefix::backend::cpu::CpuBackend;
use omniprefix::batch::{ModelShape, ScheduledBatch};
use omniprefix::canon::{
    FingerprintKey, Fingerprinter, ItemContent, ItemIdentity, ItemLayout, ItemSpec, Modality, TensorView,
};
use omniprefix::error::{CheckpointError, IoError, RequestError, RequestFileError, SchedError};
use omniprefix::index::radix::{RadixConfig, RadixIndex};
use omniprefix::index::{IndexStats, ValidationPolicy};
use omniprefix::model::{Config, Thinker};
use omniprefix::prompt::{
    Atom, CanonicalPrompt, OmniTokens, PlaceholderForm, PositionKind, PromptBuilder, positions_from_atoms,
};
use omniprefix::sched::{PrefillCap, Request, RequestChecks, Scheduler, SchedulerConfig, SchedulerStats};
use omniprefix::{Error, Result};
use serde_json::Value;

const BLOCK: usize = 4;
const NUM_BLOCKS: usize = 16;
const HIDDEN: usize = 8;
/// Text ids and an image placeholder in the tiny vocabulary of `OmniTokens::tiny`.
const IMAGE_PROMPT: [u32; 5] = [100, 503, 500, 504, 200];
const MAX_CONTEXT: usize = 40;
const TENANTS: [u64; 2] = [0, 7];
/// The model the warm scheduler admits for: ids below 600 (the tiny special ids
/// included), `HIDDEN`-wide rows, two decoder layers (at most two DeepStack levels).
const MODEL: ModelShape =
    ModelShape { vocab_size: 600, hidden_size: HIDDEN, num_layers: 2, deepstack_levels: None };
const FIXTURE: &str = "fixtures/tiny/qwen3_dense";

fn fingerprinter() -> Result<Fingerprinter> {
    Fingerprinter::new(FingerprintKey::fixed(6), 1, ValidationPolicy::SecondDigest)
}

fn image_spec(pixels: &Array3<u8>) -> ItemSpec<'_> {
    ItemSpec {
        modality: Modality::Image,
        layout: ItemLayout::Image { grid_thw: [1, 4, 6] },
        content: ItemContent::Tensor(TensorView::U8(pixels.view().into_dyn())),
        params: Default::default(),
    }
}

fn image(seed: u8) -> Result<Arc<ItemIdentity>> {
    let pixels = Array3::from_shape_fn((8, 12, 3), |(y, x, c)| seed.wrapping_add((y * 31 + x * 7 + c) as u8));
    Ok(Arc::new(fingerprinter()?.identify(0, &image_spec(&pixels))?))
}

fn text_prompt(tenant: u64, ids: &[u32]) -> Result<CanonicalPrompt> {
    let mut b = PromptBuilder::new(OmniTokens::tiny()).with_tenant(tenant);
    b.push_text(ids)?;
    b.build()
}

fn image_prompt(tenant: u64, seed: u8) -> Result<CanonicalPrompt> {
    let mut b = PromptBuilder::new(OmniTokens::tiny()).with_tenant(tenant);
    b.extend(&IMAGE_PROMPT, &[image(seed)?], PlaceholderForm::Unexpanded)?;
    b.build()
}

/// A request whose item embeddings fit its prompt.
fn request(id: u64, prompt: CanonicalPrompt) -> Request {
    let item_embeddings =
        prompt.items.iter().map(|i| Arc::new(Array2::from_elem((i.num_tokens, HIDDEN), 0.5f32))).collect();
    Request { item_embeddings, hidden_size: Some(HIDDEN), ..Request::new(id, prompt) }
}

/// Runs everything admitted to the end without a model, finishing each request.
fn drain(sched: &mut Scheduler) -> Result<()> {
    loop {
        let batch = sched.schedule()?;
        if batch.seqs.is_empty() {
            return Ok(());
        }
        for id in sched.complete(&batch)? {
            sched.finish(id)?;
        }
    }
}

/// A pool of `NUM_BLOCKS` blocks of `BLOCK` tokens, 8 tokens and 2 sequences a step,
/// under a radix index: the warm scheduler's and c12's.
fn scheduler() -> Result<Scheduler> {
    let config = SchedulerConfig {
        num_blocks: NUM_BLOCKS,
        block_size: BLOCK,
        max_tokens_per_step: 8,
        max_seqs_per_step: 2,
        prefill_cap: PrefillCap::Off,
        token_granular_reuse: true,
    };
    Scheduler::new(config, Box::new(RadixIndex::new(RadixConfig { block_size: BLOCK })?))
}

/// A scheduler with cached text and image prefixes for two tenants, a
/// context limit, mandatory tenant salts and a model to admit for, plus one
/// request still waiting.
fn warm() -> Result<Scheduler> {
    let checks =
        RequestChecks::default().with_max_context(MAX_CONTEXT).with_known_tenants(TENANTS).with_model(MODEL);
    let mut sched = scheduler()?.with_checks(Arc::new(checks));
    sched.admit(request(1, text_prompt(0, &(0..13).collect::<Vec<_>>())?))?;
    sched.admit(request(2, image_prompt(0, 1)?))?;
    sched.admit(request(3, image_prompt(7, 2)?))?;
    drain(&mut sched)?;
    sched.admit(request(4, text_prompt(7, &[1, 2, 3])?))?;
    Ok(sched)
}

/// Everything observable about the cache state.
#[derive(Debug, PartialEq)]
struct Snapshot {
    sched: SchedulerStats,
    index: IndexStats,
    waiting_table: Option<Vec<u32>>,
}

fn snapshot(sched: &Scheduler) -> Result<Snapshot> {
    sched.validate().map_err(Error::from)?;
    Ok(Snapshot {
        sched: sched.stats(),
        index: sched.index_stats(),
        waiting_table: sched.block_table(4).map(<[u32]>::to_vec),
    })
}

/// Asserts the scheduler validates and nothing changed since `before`.
fn assert_unchanged(sched: &Scheduler, before: &Snapshot) -> Result<()> {
    let after = snapshot(sched)?;
    assert_eq!(&after, before, "a rejected input changed the cache state");
    assert!(before.sched.blocks_cached > 0, "the warm scheduler caches something");
    Ok(())
}

/// Runs a bad input against a warm scheduler and returns its error.
fn rejected(bad: impl FnOnce(&mut Scheduler) -> Result<()>) -> Result<Error> {
    let mut sched = warm()?;
    let before = snapshot(&sched)?;
    let err = match bad(&mut sched) {
        Err(e) => e,
        Ok(()) => panic!("bad input was accepted"),
    };
    assert_unchanged(&sched, &before)?;
    Ok(err)
}

// ---- checkpoints: a scratch copy of the tiny fixture, mutated ----

/// A fresh scratch directory holding the fixture's config.json and model.safetensors.
fn scratch(name: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("omniprefix-bad-inputs-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| IoError::write(&dir, e))?;
    for file in ["config.json", "model.safetensors"] {
        let from = Path::new(FIXTURE).join(file);
        std::fs::copy(&from, dir.join(file)).map_err(|e| IoError::read(&from, e))?;
    }
    Ok(dir)
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_default()
}

fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|source| Error::Io(IoError::write(path, source)))
}

/// Rewrites the bytes of the checkpoint's model.safetensors in `dir` through `edit`.
fn edit_safetensors(dir: &Path, edit: impl FnOnce(&mut Vec<u8>)) -> Result<()> {
    let path = dir.join("model.safetensors");
    let mut bytes = read(&path);
    edit(&mut bytes);
    write(&path, &bytes)
}

/// Rewrites the safetensors header of the checkpoint in `dir` through `edit`.
fn edit_header(dir: &Path, edit: impl FnOnce(&mut Value)) -> Result<()> {
    let path = dir.join("model.safetensors");
    let bytes = read(&path);
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap_or_default()) as usize;
    let mut header: Value =
        serde_json::from_slice(&bytes[8..8 + n]).map_err(|e| CheckpointError::ConfigParse(e.to_string()))?;
    edit(&mut header);
    let text = header.to_string();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    write(&path, &out)
}

/// Rewrites config.json in `dir` through `edit`.
fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> Result<()> {
    let path = dir.join("config.json");
    let mut cfg: Value =
        serde_json::from_slice(&read(&path)).map_err(|e| CheckpointError::ConfigParse(e.to_string()))?;
    if let Some(map) = cfg.as_object_mut() {
        edit(map);
    }
    write(&path, cfg.to_string().as_bytes())
}

/// What [`rejected`] says of a scratch copy of the fixture that `edit` changed: the loader's
/// error (the scheduler beside it unchanged).
fn rejected_checkpoint(case: &str, edit: impl FnOnce(&Path) -> Result<()>) -> Result<Error> {
    rejected(|_| {
        let dir = scratch(case)?;
        edit(&dir)?;
        load(&dir)
    })
}

fn load(dir: &Path) -> Result<()> {
    let result = Thinker::from_dir(&CpuBackend::new(), dir).map(|_| ());
    let _ = std::fs::remove_dir_all(dir);
    result
}

#[test]
fn the_unmodified_fixture_loads() -> Result<()> {
    load(&scratch("pristine")?)
}

#[test]
fn c01_truncated_safetensors() -> Result<()> {
    let err = rejected_checkpoint("truncated", |dir| edit_safetensors(dir, |b| b.truncate(b.len() - 100)))?;
    assert!(
        matches!(err, Error::Checkpoint(CheckpointError::Safetensors { ref message, .. }) if !message.is_empty()),
        "{err}"
    );
    Ok(())
}

#[test]
fn c02_malformed_safetensors_header() -> Result<()> {
    for (case, mutate) in [
        ("garbage", (|b: &mut Vec<u8>| b[8..40].fill(b'#')) as fn(&mut Vec<u8>)),
        ("huge-length", |b: &mut Vec<u8>| b[..8].copy_from_slice(&u64::MAX.to_le_bytes())),
        ("empty", |b: &mut Vec<u8>| b.clear()),
    ] {
        let err = rejected_checkpoint(case, |dir| edit_safetensors(dir, mutate))?;
        assert!(matches!(err, Error::Checkpoint(CheckpointError::Safetensors { .. })), "{case}: {err}");
    }
    Ok(())
}

#[test]
fn c03_mislabeled_safetensors_dtype() -> Result<()> {
    // Same byte size, a dtype the loader does not convert.
    let err = rejected_checkpoint("mislabeled-i32", |dir| {
        edit_header(dir, |h| h["model.norm.weight"]["dtype"] = "I32".into())
    })?;
    assert!(
        matches!(err, Error::Checkpoint(CheckpointError::TensorDtype { ref name, ref found }) if name == "model.norm.weight" && found == "I32"),
        "{err}"
    );
    // A label whose element size disagrees with the stored bytes.
    let err = rejected_checkpoint("mislabeled-f64", |dir| {
        edit_header(dir, |h| h["model.norm.weight"]["dtype"] = "F64".into())
    })?;
    assert!(matches!(err, Error::Checkpoint(CheckpointError::Safetensors { .. })), "{err}");
    Ok(())
}

#[test]
fn c04_config_not_json_or_missing_fields() -> Result<()> {
    let err = rejected_checkpoint("config-missing", |dir| {
        edit_config(dir, |c| {
            c.remove("num_hidden_layers");
        })
    })?;
    assert!(
        matches!(err, Error::Checkpoint(CheckpointError::ConfigParse(ref m)) if m.contains("num_hidden_layers")),
        "{err}"
    );
    let err = rejected(|_| Config::from_json_str("{\"model_type\": \"qwen3\", ").map(|_| ()))?;
    assert!(matches!(err, Error::Checkpoint(CheckpointError::ConfigParse(_))), "{err}");
    Ok(())
}

#[test]
fn c05_config_absurd_fields() -> Result<()> {
    type Edit = fn(&mut serde_json::Map<String, Value>);
    let cases: [(&str, Edit, &str); 4] = [
        (
            "zero-layers",
            |c| {
                c.insert("num_hidden_layers".into(), 0.into());
            },
            "num_hidden_layers",
        ),
        (
            "heads-not-dividing-hidden",
            |c| {
                c.remove("head_dim");
                c.insert("num_attention_heads".into(), 6.into());
            },
            "hidden_size",
        ),
        (
            "kv-heads-not-dividing-heads",
            |c| {
                c.insert("num_key_value_heads".into(), 3.into());
            },
            "num_key_value_heads",
        ),
        (
            "unknown-rope-type",
            |c| {
                c.insert("rope_parameters".into(), serde_json::json!({"rope_type": "yarn", "factor": 4.0}));
            },
            "rope_type",
        ),
    ];
    for (case, edit, field) in cases {
        let err = rejected_checkpoint(case, |dir| edit_config(dir, edit))?;
        assert!(
            matches!(err, Error::Checkpoint(CheckpointError::UnsupportedConfig { field: f, .. }) if f == field),
            "{case}: {err}"
        );
    }
    let err = rejected_checkpoint("negative", |dir| {
        edit_config(dir, |c| {
            c.insert("hidden_size".into(), (-64).into());
        })
    })?;
    assert!(
        matches!(err, Error::Checkpoint(CheckpointError::ConfigParse(ref m)) if m.contains("-64")),
        "{err}"
    );
    Ok(())
}

#[test]
fn c06_weights_of_the_wrong_shape_or_missing() -> Result<()> {
    let name = "model.layers.1.mlp.down_proj.weight";
    let err = rejected_checkpoint("wrong-shape", |dir| {
        edit_header(dir, |h| h[name]["shape"] = serde_json::json!([128, 64]))
    })?;
    assert!(
        matches!(err, Error::Checkpoint(CheckpointError::TensorShape { name: ref n, ref expected, ref found }) if n == name && expected == &[64, 128] && found == &[128, 64]),
        "{err}"
    );
    let err = rejected_checkpoint("missing", |dir| {
        edit_header(dir, |h| {
            if let Some(map) = h.as_object_mut()
                && let Some(v) = map.remove(name)
            {
                map.insert("renamed.weight".into(), v);
            }
        })
    })?;
    assert!(
        matches!(err, Error::Checkpoint(CheckpointError::MissingTensor { name: ref n }) if n == name),
        "{err}"
    );
    Ok(())
}

// ---- requests ----

#[test]
fn c07_placeholder_count_disagrees_with_grid() -> Result<()> {
    let img = image(3)?; // grid 1x4x6 -> 6 tokens
    let mut builder = PromptBuilder::new(OmniTokens::tiny());
    builder.push_text(&[100])?;
    let err = rejected(|_| {
        builder.extend(&[503, 500, 500, 500, 500, 504], &[img], PlaceholderForm::Expanded).map(|_| ())
    })?;
    assert!(
        matches!(
            err,
            Error::Request(RequestError::PlaceholderCountMismatch {
                item: 0,
                position: 2,
                expected: 6,
                found: 4
            })
        ),
        "{err}"
    );
    assert_eq!(builder.len(), 1, "the builder is unchanged");
    Ok(())
}

#[test]
fn c08_overlapping_or_out_of_order_items() -> Result<()> {
    // Rows of an item out of order in the atoms.
    let img = image(4)?;
    let atoms = vec![
        Atom::Text(vec![503]),
        Atom::Item { id: Arc::clone(&img), rows: 3..6 },
        Atom::Item { id: Arc::clone(&img), rows: 0..3 },
    ];
    let err =
        rejected(|_| positions_from_atoms(&atoms, &OmniTokens::tiny(), PositionKind::Mrope).map(|_| ()))?;
    assert!(matches!(err, Error::Request(RequestError::MalformedAtoms { atom: 1, .. })), "{err}");
    // Two items whose index-map spans overlap.
    let mut two = PromptBuilder::new(OmniTokens::tiny());
    two.extend(&[503, 500, 504, 503, 500, 504], &[image(4)?, image(5)?], PlaceholderForm::Unexpanded)?;
    let mut prompt = two.build()?;
    prompt.index_map.spans[1].start = prompt.index_map.spans[0].start + 2;
    let err = rejected(|s| s.admit(request(10, prompt)))?;
    assert!(
        matches!(err, Error::Request(RequestError::PromptMismatch { id: Some(10), what, expected: 7, found: 3 }) if what.contains("span start")),
        "{err}"
    );
    // Spans listed out of position order.
    let mut prompt = two.build()?;
    prompt.index_map.spans.swap(0, 1);
    let err = rejected(|s| s.admit(request(11, prompt)))?;
    assert!(
        matches!(err, Error::Request(RequestError::PromptMismatch { id: Some(11), what, .. }) if what.contains("span start")),
        "{err}"
    );
    Ok(())
}

#[test]
fn c09_nan_and_inf_tensors() -> Result<()> {
    let fp = fingerprinter()?;
    for (bad, at) in [(f32::NAN, 17), (f32::INFINITY, 0), (f32::NEG_INFINITY, 159)] {
        let mut wave = Array1::from_iter((0..160).map(|i| (i as f32 * 0.1).sin()));
        wave[at] = bad;
        let spec = ItemSpec {
            modality: Modality::Audio,
            layout: ItemLayout::Audio { mel_frames: 100 },
            content: ItemContent::Tensor(TensorView::F32(wave.view().into_dyn())),
            params: Default::default(),
        };
        let err = rejected(|_| fp.identify(2, &spec).map(|_| ()))?;
        assert!(
            matches!(err, Error::Request(RequestError::NonFinite { item: 2, index }) if index == at),
            "{bad}: {err}"
        );
    }
    Ok(())
}

/// The flat row-major index of the first non-finite element of `view`, in
/// logical order (the oracle for strided views).
fn first_non_finite<T: Copy>(view: &ArrayViewD<'_, T>, finite: impl Fn(T) -> bool) -> Option<usize> {
    view.iter().position(|&x| !finite(x))
}

/// Strided views take the staging path, not the contiguous scan: transposed
/// (mel features, f16 patch rows), stepped (a waveform with every other
/// sample, where non-finite values in the skipped samples are not part of the
/// item), and a permuted bf16 video above the tree threshold. Each error names
/// the flat index in logical order, and nothing changes.
#[test]
fn c09_nan_and_inf_in_strided_views() -> Result<()> {
    let fp = fingerprinter()?;
    let check = |spec: &ItemSpec<'_>, expected: usize| -> Result<()> {
        let err = rejected(|_| fp.identify(3, spec).map(|_| ()))?;
        assert!(
            matches!(err, Error::Request(RequestError::NonFinite { item: 3, index }) if index == expected),
            "{:?}: {err}",
            spec.layout
        );
        Ok(())
    };
    fn audio(content: TensorView<'_>, mel_frames: u32) -> ItemSpec<'_> {
        ItemSpec {
            modality: Modality::Audio,
            layout: ItemLayout::Audio { mel_frames },
            content: ItemContent::Tensor(content),
            params: Default::default(),
        }
    }

    // Mel features [8, 3000] stored frame-major and viewed transposed. The NaN
    // at logical [6, 2345] lies past the first staging buffer (16384 floats);
    // an Inf at logical [0, 2999] comes before it in logical order, after it in memory.
    let mut frames = Array2::from_shape_fn((3000, 8), |(f, m)| (f * 8 + m) as f32 * 1e-3);
    frames[[2345, 6]] = f32::NAN;
    let late = 6 * 3000 + 2345;
    assert!(late > omniprefix::canon::STAGING_BYTES / 4);
    assert_eq!(first_non_finite(&frames.t().into_dyn(), f32::is_finite), Some(late));
    check(&audio(TensorView::F32(frames.t().into_dyn()), 3000), late)?;
    frames[[2999, 0]] = f32::INFINITY;
    let mel = frames.t().into_dyn();
    assert!(!mel.is_standard_layout());
    assert_eq!(first_non_finite(&mel, f32::is_finite), Some(2999));
    check(&audio(TensorView::F32(mel), 3000), 2999)?;

    // f16 patch rows [24, 12] (grid 1x4x6) viewed transposed from [12, 24].
    let mut patches = ArrayD::from_elem(IxDyn(&[12, 24]), half::f16::ONE);
    patches[[5, 17]] = half::f16::NEG_INFINITY; // logical [17, 5] = 17 * 12 + 5
    patches[[11, 20]] = half::f16::NAN; // logical [20, 11]: after it
    let rows = patches.t();
    let image = ItemSpec {
        modality: Modality::Image,
        layout: ItemLayout::Image { grid_thw: [1, 4, 6] },
        content: ItemContent::Tensor(TensorView::F16(rows.clone())),
        params: Default::default(),
    };
    assert_eq!(first_non_finite(&rows, half::f16::is_finite), Some(17 * 12 + 5));
    check(&image, 17 * 12 + 5)?;

    // A stepped waveform: samples 0, 2, 4, ... of 320. Non-finite odd samples
    // are outside the item; sample 114 is its element 57.
    let mut wave = Array1::from_iter((0..320).map(|i| (i as f32 * 0.1).sin()));
    wave[1] = f32::NAN;
    wave[201] = f32::INFINITY;
    let clean = wave.clone();
    let stepped = clean.slice(s![..;2]).into_dyn();
    assert_eq!(stepped.len(), 160);
    assert!(
        fp.identify(3, &audio(TensorView::F32(stepped), 100)).is_ok(),
        "skipped samples are not the item's"
    );
    wave[114] = f32::NEG_INFINITY;
    check(&audio(TensorView::F32(wave.slice(s![..;2]).into_dyn()), 100), 57)?;
    // Reversed and stepped: element k is sample 319 - 2k (the odd ones), so
    // the first non-finite one in logical order is sample 201, element 59.
    let reversed = wave.slice(s![..;-2]).into_dyn();
    assert_eq!(first_non_finite(&reversed, f32::is_finite), Some(59));
    check(&audio(TensorView::F32(reversed), 100), 59)?;

    // bf16 video frames [4, 600, 1000] viewed as [1000, 4, 600]: 4.8 MB, so
    // the tree path hashes it leaf by leaf; the NaN is in a late leaf.
    let mut video = ArrayD::from_elem(IxDyn(&[4, 600, 1000]), half::bf16::ONE);
    video[[1, 2, 900]] = half::bf16::NAN;
    let permuted = video.view().permuted_axes(IxDyn(&[2, 0, 1]));
    assert!(permuted.len() * 2 > omniprefix::canon::TREE_THRESHOLD);
    let at = 900 * 4 * 600 + 600 + 2;
    assert_eq!(first_non_finite(&permuted, half::bf16::is_finite), Some(at));
    let clip = ItemSpec {
        modality: Modality::Video,
        layout: ItemLayout::Video { grid_thw: [2, 4, 4], seconds_per_grid: 2.0 },
        content: ItemContent::Tensor(TensorView::BF16(permuted)),
        params: Default::default(),
    };
    check(&clip, at)
}

#[test]
fn c10_zero_length_items() -> Result<()> {
    let fp = fingerprinter()?;
    let empty = Array3::<u8>::zeros((0, 12, 3));
    let err = rejected(|_| fp.identify(1, &image_spec(&empty)).map(|_| ()))?;
    assert!(matches!(err, Error::Request(RequestError::EmptyItem { item: 1, .. })), "{err}");
    let pixels = Array3::<u8>::zeros((8, 12, 3));
    let spec = ItemSpec { layout: ItemLayout::Image { grid_thw: [1, 0, 6] }, ..image_spec(&pixels) };
    let err = rejected(|_| fp.identify(0, &spec).map(|_| ()))?;
    assert!(matches!(err, Error::Request(RequestError::EmptyItem { item: 0, .. })), "{err}");
    let err = rejected(|_| PromptBuilder::new(OmniTokens::tiny()).build().map(|_| ()))?;
    assert!(matches!(err, Error::Request(RequestError::EmptyPrompt)), "{err}");
    Ok(())
}

/// What the engine used to check itself is admission's now: every id the model
/// embeds (placeholder ids too) in its vocabulary, rows of its width whatever the
/// request claims, at most one DeepStack level per decoder layer.
#[test]
fn c11_requests_the_model_cannot_run_are_refused_at_admission() -> Result<()> {
    let err = rejected(|s| s.admit(request(30, text_prompt(0, &[1, 2, 600])?)))?;
    assert!(
        matches!(
            err,
            Error::Request(RequestError::TokenOutOfVocab { position: 2, token: 600, vocab_size: 600 })
        ),
        "{err}"
    );
    // A model whose image pad is past the vocabulary: the placeholder ids are embedded too.
    let tokens = OmniTokens { image_token_id: 650, ..OmniTokens::tiny() };
    let mut b = PromptBuilder::new(tokens);
    b.extend(&[100, 503, 650, 504, 200], &[image(3)?], PlaceholderForm::Unexpanded)?;
    let err = rejected(|s| s.admit(request(31, b.build()?)))?;
    assert!(
        matches!(
            err,
            Error::Request(RequestError::TokenOutOfVocab { position: 2, token: 650, vocab_size: 600 })
        ),
        "{err}"
    );
    let mut narrow = request(32, image_prompt(0, 1)?);
    narrow.item_embeddings = vec![Arc::new(Array2::zeros((6, HIDDEN / 2)))];
    narrow.hidden_size = Some(HIDDEN / 2);
    let err = rejected(|s| s.admit(narrow))?;
    assert!(
        matches!(
            err,
            Error::Request(RequestError::EmbeddingMismatch {
                id: Some(32),
                what: "embedding columns",
                expected: HIDDEN,
                found: 4,
                ..
            })
        ),
        "{err}"
    );
    let mut deep = request(33, image_prompt(0, 1)?);
    deep.item_deepstack = vec![Some(Arc::new(vec![Array2::zeros((6, HIDDEN)); 3]))];
    let err = rejected(|s| s.admit(deep))?;
    assert!(
        matches!(err, Error::Request(RequestError::DeepStackMismatch { id: Some(33), item: 0, level: 2, what, expected: 2, found: 3 }) if what.contains("decoder layer")),
        "{err}"
    );
    Ok(())
}

#[test]
fn c12_requests_larger_than_the_pool() -> Result<()> {
    let ids: Vec<u32> = (0..(NUM_BLOCKS * BLOCK + 1) as u32).map(|i| i % 400).collect();
    let mut sched = scheduler()?;
    sched.admit(request(1, text_prompt(0, &ids[..20])?))?;
    drain(&mut sched)?;
    let before = snapshot(&sched)?;
    let err = sched.admit(request(20, text_prompt(0, &ids)?)).err();
    assert!(
        matches!(
            err,
            Some(Error::Request(RequestError::RequestTooLarge { id: Some(20), needed: 17, num_blocks: 16 }))
        ),
        "{err:?}"
    );
    assert_unchanged(&sched, &before)
}

#[test]
fn c13_requests_longer_than_the_model_context() -> Result<()> {
    let ids: Vec<u32> = (0..MAX_CONTEXT as u32 + 1).collect();
    let err = rejected(|s| s.admit(request(21, text_prompt(0, &ids)?)))?;
    assert!(
        matches!(err, Error::Request(RequestError::ContextTooLong { id: Some(21), len: 41, max: 40, .. })),
        "{err}"
    );
    Ok(())
}

#[test]
fn c14_unknown_tenant_when_salts_are_required() -> Result<()> {
    let err = rejected(|s| s.admit(request(22, text_prompt(3, &[0, 1, 2, 3, 4])?)))?;
    assert!(matches!(err, Error::Request(RequestError::UnknownTenant { id: Some(22), tenant: 3 })), "{err}");
    Ok(())
}

#[test]
fn c15_atoms_that_disagree_with_the_token_ids() -> Result<()> {
    let mut prompt = text_prompt(0, &[0, 1, 2, 3, 4, 5])?;
    prompt.atoms = vec![Atom::Text(vec![0, 1, 2, 3])];
    let err = rejected(|s| s.admit(request(23, prompt)))?;
    assert!(
        matches!(err, Error::Request(RequestError::AtomsLengthMismatch { atoms: 4, tokens: 6 })),
        "{err}"
    );
    Ok(())
}

#[test]
fn c16_embeddings_that_disagree_with_their_items() -> Result<()> {
    let mut req = request(24, image_prompt(0, 1)?);
    req.item_embeddings[0] = Arc::new(Array2::zeros((5, HIDDEN)));
    let err = rejected(|s| s.admit(req))?;
    assert!(
        matches!(
            err,
            Error::Request(RequestError::EmbeddingMismatch {
                id: Some(24),
                item: 0,
                expected: 6,
                found: 5,
                ..
            })
        ),
        "{err}"
    );
    let mut req = request(25, image_prompt(0, 1)?);
    req.item_embeddings.clear();
    let err = rejected(|s| s.admit(req))?;
    assert!(
        matches!(
            err,
            Error::Request(RequestError::EmbeddingMismatch { id: Some(25), expected: 1, found: 0, .. })
        ),
        "{err}"
    );
    Ok(())
}

#[test]
fn c16_deepstack_rows_that_disagree_with_their_items() -> Result<()> {
    let level = |rows: usize| Array2::from_elem((rows, HIDDEN), 0.25f32);
    let mut req = request(27, image_prompt(0, 1)?);
    req.item_deepstack = vec![Some(Arc::new(vec![level(6)])), None];
    let err = rejected(|s| s.admit(req))?;
    assert!(
        matches!(
            err,
            Error::Request(RequestError::EmbeddingMismatch {
                id: Some(27),
                what: "number of item DeepStack entries",
                expected: 1,
                found: 2,
                ..
            })
        ),
        "{err}"
    );
    let mut req = request(28, image_prompt(0, 1)?);
    req.item_deepstack = vec![Some(Arc::new(vec![level(6), level(5)]))];
    let err = rejected(|s| s.admit(req))?;
    assert!(
        matches!(
            err,
            Error::Request(RequestError::DeepStackMismatch {
                id: Some(28),
                item: 0,
                level: 1,
                what: "rows",
                expected: 6,
                found: 5
            })
        ),
        "{err}"
    );
    // Audio items (Qwen3-Omni's audio tower) have no DeepStack levels.
    let mut req = request(29, image_prompt(0, 1)?);
    let mut audio = (*req.prompt.items[0]).clone();
    audio.modality = Modality::Audio;
    req.prompt.items[0] = Arc::new(audio);
    req.item_deepstack = vec![Some(Arc::new(vec![level(6)]))];
    let err = rejected(|s| s.admit(req))?;
    assert!(
        matches!(
            err,
            Error::Request(RequestError::DeepStackMismatch {
                id: Some(29),
                item: 0,
                what: "levels of an audio item",
                found: 1,
                ..
            })
        ),
        "{err}"
    );
    Ok(())
}

#[test]
fn c17_positions_that_do_not_cover_the_prompt() -> Result<()> {
    let mut prompt = text_prompt(0, &[0, 1, 2, 3, 4, 5])?;
    prompt.positions = omniprefix::prompt::Positions::linear(3);
    let err = rejected(|s| s.admit(request(26, prompt)))?;
    assert!(
        matches!(
            err,
            Error::Request(RequestError::PromptMismatch { id: Some(26), expected: 6, found: 3, .. })
        ),
        "{err}"
    );
    Ok(())
}

#[test]
fn c18_duplicate_request_ids() -> Result<()> {
    let err = rejected(|s| s.admit(request(4, text_prompt(0, &[9, 9])?)))?;
    assert!(matches!(err, Error::Sched(SchedError::DuplicateRequest { id: 4 })), "{err}");
    Ok(())
}

#[test]
fn c19_completing_a_batch_that_was_not_handed_out() -> Result<()> {
    let err = rejected(|s| {
        let seq = omniprefix::runner::PromptInputs {
            token_ids: vec![1, 2, 3],
            embeds: vec![],
            positions: omniprefix::prompt::Positions::linear(3),
        }
        .step(4, omniprefix::kv::BlockTable::new(vec![0], BLOCK), 0..3)?;
        s.complete(&ScheduledBatch { copies: vec![], seqs: vec![seq] }).map(|_| ())
    })?;
    assert!(
        matches!(
            err,
            Error::Sched(SchedError::BatchMismatch { id: 4, what: "new tokens", expected: 0, found: 3 })
        ),
        "{err}"
    );
    let err = rejected(|s| s.finish(4))?;
    assert!(
        matches!(err, Error::Sched(SchedError::RequestNotFinished { id: 4, computed: 0, len: 3 })),
        "{err}"
    );
    let err = rejected(|s| s.abort(99))?;
    assert!(matches!(err, Error::Sched(SchedError::UnknownRequest { id: 99 })), "{err}");
    Ok(())
}

#[test]
fn c20_layouts_that_cannot_describe_their_item() -> Result<()> {
    let fp = fingerprinter()?;
    let pixels = Array3::<u8>::zeros((8, 12, 3));
    let odd = ItemSpec { layout: ItemLayout::Image { grid_thw: [1, 3, 5] }, ..image_spec(&pixels) };
    let err = rejected(|_| fp.identify(0, &odd).map(|_| ()))?;
    assert!(
        matches!(
            err,
            Error::Request(RequestError::GridNotMergeable { item: 0, grid_thw: [1, 3, 5], merge: 2 })
        ),
        "{err}"
    );
    let audio_layout = ItemSpec { layout: ItemLayout::Audio { mel_frames: 100 }, ..image_spec(&pixels) };
    let err = rejected(|_| fp.identify(0, &audio_layout).map(|_| ()))?;
    assert!(
        matches!(err, Error::Request(RequestError::InvalidLayout { item: 0, field: "kind", .. })),
        "{err}"
    );
    let patches = Array2::<f32>::zeros((20, 4));
    let processed = ItemSpec {
        content: ItemContent::Tensor(TensorView::F32(patches.view().into_dyn())),
        ..image_spec(&pixels)
    };
    let err = rejected(|_| fp.identify(3, &processed).map(|_| ()))?;
    assert!(
        matches!(err, Error::Request(RequestError::ShapeMismatch { item: 3, modality: Modality::Image, .. })),
        "{err}"
    );
    Ok(())
}

// ---- request files ----

/// A scratch folder with `media.safetensors` holding `pixels` (u8 [8, 12, 3])
/// and `emb` (f32 [6, 4]) and a request file written from `json`.
fn request_file(name: &str, json: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("omniprefix-bad-requests-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|source| IoError::write(&dir, source))?;
    let pixels = vec![7u8; 8 * 12 * 3];
    let emb: Vec<u8> = [0.25f32; 24].iter().flat_map(|x| x.to_le_bytes()).collect();
    // DeepStack levels [2, 6, 4] holding 0, 1, 2, ...; and one with a row too few per level.
    let ds: Vec<u8> = (0..48).flat_map(|x| (x as f32).to_le_bytes()).collect();
    let views = [
        ("pixels", safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![8, 12, 3], &pixels)),
        ("emb", safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![6, 4], &emb)),
        ("ds", safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 6, 4], &ds)),
        ("ds_rows", safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 5, 4], &ds[..160])),
    ];
    let views = views
        .into_iter()
        .map(|(n, v)| v.map(|v| (n, v)))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| RequestFileError::Safetensors { path: "media".into(), message: e.to_string() })?;
    let bytes = safetensors::serialize(views, &None)
        .map_err(|e| RequestFileError::Safetensors { path: "media".into(), message: e.to_string() })?;
    write(&dir.join("media.safetensors"), &bytes)?;
    let path = dir.join("request.json");
    write(&path, json.as_bytes())?;
    Ok(path)
}

fn item_json(content: &str, embeddings: &str) -> String {
    format!(
        r#"{{"segments": [{{"text": [1, 503]}}, {{"item": {{"modality": "image",
            "layout": {{"kind": "image", "grid_thw": [1, 4, 6]}},
            "content": {{"file": "media.safetensors", "tensor": "{content}"}},
            "embeddings": {{"file": "{embeddings}", "tensor": "emb"}}}}}}, {{"text": [504]}}]}}"#
    )
}

#[test]
fn c21_request_file_deepstack_levels_load_and_a_bad_shape_is_named() -> Result<()> {
    use omniprefix::request_file::RequestFile;
    let with = |tensor: &str| {
        let ds = format!(
            r#""tensor": "emb"}}, "deepstack": {{"file": "media.safetensors", "tensor": "{tensor}"}}"#
        );
        item_json("pixels", "media.safetensors").replace(r#""tensor": "emb"}"#, &ds)
    };
    let path = request_file("deepstack", &with("ds"))?;
    let file = RequestFile::load(&path);
    let _ = path.parent().map(std::fs::remove_dir_all);
    let file = file?;
    let request = file.request(&OmniTokens::tiny());
    let levels =
        request.items.first().and_then(|i| i.deepstack.clone()).expect("the item carries DeepStack levels");
    assert_eq!(levels.len(), 2);
    assert_eq!(levels[1].dim(), (6, 4));
    assert_eq!((levels[0][[0, 1]], levels[1][[0, 0]], levels[1][[5, 3]]), (1.0, 24.0, 47.0));
    let err = rejected(|_| {
        let path = request_file("deepstack-rows", &with("ds_rows"))?;
        let result = RequestFile::load(&path).map(|_| ());
        let _ = path.parent().map(std::fs::remove_dir_all);
        result
    })?;
    assert!(
        matches!(err, Error::RequestFile(RequestFileError::Tensor { ref tensor, ref expected, ref found, .. })
            if tensor == "ds_rows" && expected.contains("[levels >= 1, 6, 4]") && found == "shape [2, 5, 4]"),
        "{err}"
    );
    Ok(())
}

#[test]
fn c21_request_files_that_are_not_json_or_name_missing_tensors() -> Result<()> {
    use omniprefix::request_file::RequestFile;
    let load = |name: &str, json: &str| -> Result<()> {
        let path = request_file(name, json)?;
        let result = RequestFile::load(&path).map(|_| ());
        let _ = path.parent().map(std::fs::remove_dir_all);
        result
    };
    // The well-formed file loads.
    load("good", &item_json("pixels", "media.safetensors"))?;
    let err = rejected(|_| load("not-json", "{\"segments\": [{\"text\": [1, 2"))?;
    assert!(matches!(err, Error::RequestFile(RequestFileError::Format { .. })), "{err}");
    let err = rejected(|_| load("unknown-field", r#"{"segments": [], "tenantt": 3}"#))?;
    assert!(
        matches!(err, Error::RequestFile(RequestFileError::Format { ref message, .. }) if message.contains("tenantt")),
        "{err}"
    );
    let err = rejected(|_| load("negative-id", r#"{"segments": [{"text": [1, -2]}]}"#))?;
    assert!(matches!(err, Error::RequestFile(RequestFileError::Format { .. })), "{err}");
    let err = rejected(|_| load("missing-tensor", &item_json("pixelz", "media.safetensors")))?;
    assert!(
        matches!(err, Error::RequestFile(RequestFileError::TensorNotInFile { ref tensor, .. }) if tensor == "pixelz"),
        "{err}"
    );
    let err = rejected(|_| load("missing-file", &item_json("pixels", "nowhere.safetensors")))?;
    assert!(
        matches!(err, Error::Io(IoError { ref path, .. }) if path.ends_with("nowhere.safetensors")),
        "{err}"
    );
    // Embeddings named where a [rows, hidden] tensor is needed, but of rank 3.
    let json =
        item_json("pixels", "media.safetensors").replace(r#""tensor": "emb""#, r#""tensor": "pixels""#);
    let err = rejected(|_| load("embeddings-rank", &json))?;
    assert!(
        matches!(err, Error::RequestFile(RequestFileError::Tensor { ref tensor, .. }) if tensor == "pixels"),
        "{err}"
    );
    Ok(())
}
