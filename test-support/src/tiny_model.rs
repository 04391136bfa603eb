//! A tiny random thinker on the CPU backend driven through the real
//! scheduler: requests over a tiny vocabulary with images (so prompts share
//! blocks), and the uncached reference every cached output must equal.
//! Shared by `proptests/sched_state_machine.rs` and `tests/engine/abort_safety.rs`.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Arc;

use ndarray::Array2;
use omniprefix::Result;
use omniprefix::backend::cpu::{CpuBackend, CpuPages};
use omniprefix::batch::{EmbedRows, RequestId, ScheduledBatch};
use omniprefix::canon::{Evidence, Fingerprint, ItemIdentity, ItemLayout, Modality};
use omniprefix::model::{CaptureName, CaptureSpec, Config, Thinker};
use omniprefix::prompt::{Atom, CanonicalPrompt, IndexMap, ItemSpan, Positions};
use omniprefix::runner::{ModelRunner, PromptInputs, SeqOutput, run_uncached};
use omniprefix::sched::Request;

/// Vocabulary of the tiny model; text ids come from `0..TEXT_IDS`.
pub const VOCAB: usize = 8;
pub const TEXT_IDS: u32 = 4;
/// Placeholder id of image rows.
pub const IMAGE_PAD: u32 = 7;
/// Units from this value up stand for image `unit - IMAGE_UNIT`.
pub const IMAGE_UNIT: u32 = 100;
/// Rows of every image.
pub const IMAGE_ROWS: usize = 3;
pub const HIDDEN: usize = 16;
const LAYERS: usize = 2;

/// Relative tolerance of cached vs uncached hidden states.
pub const TOLERANCE: f32 = 1e-5;

/// The model, its runner and the reference outputs of every request seen.
pub struct TinyModel {
    pub runner: ModelRunner<CpuBackend>,
    thinker: Arc<Thinker<CpuBackend>>,
    backend: Arc<CpuBackend>,
    capture: CaptureSpec,
}

impl TinyModel {
    pub fn new(seed: u64) -> Result<Self> {
        let backend = Arc::new(CpuBackend::new());
        let thinker =
            Arc::new(Thinker::random(&*backend, Config::tiny_qwen3(HIDDEN, LAYERS, 2, 1, VOCAB), seed)?);
        let capture =
            CaptureSpec::new([CaptureName::Hidden(0), CaptureName::Hidden(1), CaptureName::Final], LAYERS)?;
        let runner = ModelRunner::new(Arc::clone(&backend), Arc::clone(&thinker), capture.clone())?;
        Ok(Self { runner, thinker, backend, capture })
    }

    pub fn pages(&self, num_blocks: usize, block_size: usize) -> Result<CpuPages> {
        self.runner.alloc_pages(num_blocks, block_size)
    }

    /// The whole prompt in one step on fresh pages: what caching must not change.
    pub fn uncached(&self, inputs: &PromptInputs) -> Result<omniprefix::runner::Outputs> {
        run_uncached(&self.thinker, &*self.backend, inputs, &self.capture, false)
    }

    /// Runs a scheduled batch on `pages`.
    pub fn execute(&self, batch: &ScheduledBatch, pages: &mut CpuPages) -> Result<Vec<SeqOutput>> {
        self.runner.execute(batch, pages)
    }
}

/// Embedding rows of image `k`: distinct per image and per row.
fn image_embeddings(k: u32) -> Array2<f32> {
    Array2::from_shape_fn((IMAGE_ROWS, HIDDEN), |(r, c)| {
        ((k as usize * 7 + r * 3 + c) % 11) as f32 * 0.1 - 0.5
    })
}

fn image_identity(k: u32) -> Arc<ItemIdentity> {
    let fingerprint = Fingerprint(0x1000 + u128::from(k));
    Arc::new(ItemIdentity {
        fingerprint,
        evidence: Evidence::SecondDigest(Fingerprint(0x2000 + u128::from(k))),
        modality: Modality::Image,
        layout: ItemLayout::Image { grid_thw: [1, 2, 2 * IMAGE_ROWS as u32] },
        num_tokens: IMAGE_ROWS,
        content_bytes: 0,
    })
}

/// A request for `units` (text ids below [`IMAGE_UNIT`], images from it up),
/// and the same prompt as whole-prompt inputs for the uncached reference.
pub fn request(id: RequestId, tenant: u64, units: &[u32]) -> (Request, PromptInputs) {
    let mut prompt = CanonicalPrompt {
        tenant,
        atoms: Vec::new(),
        token_ids: Vec::new(),
        items: Vec::new(),
        index_map: IndexMap::default(),
        positions: Positions::linear(0),
    };
    let mut embeddings: Vec<Arc<Array2<f32>>> = Vec::new();
    let mut embeds = Vec::new();
    let mut item_of: HashMap<u32, usize> = HashMap::new();
    for &u in units {
        if u < IMAGE_UNIT {
            let t = u % TEXT_IDS;
            match prompt.atoms.last_mut() {
                Some(Atom::Text(ids)) => ids.push(t),
                _ => prompt.atoms.push(Atom::Text(vec![t])),
            }
            prompt.token_ids.push(t);
            continue;
        }
        let k = u - IMAGE_UNIT;
        let item = *item_of.entry(k).or_insert_with(|| {
            prompt.items.push(image_identity(k));
            embeddings.push(Arc::new(image_embeddings(k)));
            prompt.items.len() - 1
        });
        let start = prompt.token_ids.len() as u32;
        prompt.atoms.push(Atom::Item { id: Arc::clone(&prompt.items[item]), rows: 0..IMAGE_ROWS as u32 });
        prompt.index_map.spans.push(ItemSpan { item: item as u32, rows: 0..IMAGE_ROWS as u32, start });
        prompt.index_map.placeholders.insert_range(start..start + IMAGE_ROWS as u32);
        prompt.token_ids.extend([IMAGE_PAD; IMAGE_ROWS]);
        embeds.push(EmbedRows {
            step_offset: start as usize,
            embeddings: Arc::clone(&embeddings[item]),
            rows: 0..IMAGE_ROWS,
            deepstack: None,
        });
    }
    let positions = Positions::linear(prompt.token_ids.len());
    prompt.positions = positions.clone();
    let inputs = PromptInputs { token_ids: prompt.token_ids.clone(), embeds, positions };
    (Request { item_embeddings: embeddings, hidden_size: Some(HIDDEN), ..Request::new(id, prompt) }, inputs)
}

/// `Ok` when every captured hidden state and the last logits of `got` equal
/// `want` within [`TOLERANCE`] relative; otherwise the first mismatch.
pub fn equal_outputs(got: &SeqOutput, want: &omniprefix::runner::Outputs) -> std::result::Result<(), String> {
    for ((name, g), (_, w)) in got.hidden.iter().zip(&want.hidden) {
        if g.dim() != w.dim() {
            return Err(format!("{name}: shape {:?} vs uncached {:?}", g.dim(), w.dim()));
        }
        close(g.iter().copied(), w.iter().copied()).map_err(|m| format!("{name}: {m}"))?;
    }
    close(got.last_logits.iter().copied(), want.last_logits.iter().copied())
        .map_err(|m| format!("logits: {m}"))
}

fn close(
    got: impl Iterator<Item = f32>, want: impl Iterator<Item = f32> + Clone,
) -> std::result::Result<(), String> {
    let scale = want.clone().fold(1f32, |m, v| m.max(v.abs()));
    match got.zip(want).enumerate().find(|(_, (g, w))| (g - w).abs() > TOLERANCE * scale || g.is_nan()) {
        None => Ok(()),
        Some((i, (g, w))) => Err(format!("first mismatch at flat index {i}: {g} vs uncached {w}")),
    }
}
