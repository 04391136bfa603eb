//! Test support shared by `tests/engine/scheduler.rs` and `proptests/pool_invariants.rs`:
//! a reference index, hand-built prompts, and a shadow runner that tracks what
//! every KV slot holds so a wrong reuse shows up as a wrong read.

pub mod reference_index;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use ndarray::Array2;
use omniprefix::canon::{Evidence, Fingerprint, ItemIdentity, ItemLayout, Modality};

use omniprefix::batch::{RequestId, ScheduledBatch, ScheduledSeq};
use omniprefix::prompt::{
    Atom, CanonicalPrompt, IndexMap, ItemSpan, OmniTokens, PositionKind, Positions, positions_from_atoms,
};
use omniprefix::sched::Request;

pub use reference_index::{Key, ReferenceIndex, keys_of};

/// A text-only prompt with 1-D positions (what the prompt builder makes for plain text).
pub fn text_prompt(tenant: u64, ids: &[u32]) -> CanonicalPrompt {
    CanonicalPrompt {
        tenant,
        atoms: vec![Atom::Text(ids.to_vec())],
        token_ids: ids.to_vec(),
        items: Vec::new(),
        index_map: IndexMap::default(),
        positions: Positions::linear(ids.len()),
    }
}

/// Ids from this value up in [`request`] input stand for images 0 and 1.
pub const IMAGE_MARKER: u32 = u32::MAX - 1;
/// Placeholder token id of image rows.
const IMAGE_PAD: u32 = 9;
/// Rows (placeholder tokens) of every test image.
const IMAGE_ROWS: u32 = 3;

/// The embedding value a test image puts at `(row, 0)`: the shadow runner
/// checks it to catch rows placed at the wrong position.
fn embedding_value(fingerprint: u128, row: usize) -> f32 {
    (fingerprint * 10) as f32 + row as f32
}

/// A request whose `marked` ids below [`IMAGE_MARKER`] are text tokens and
/// whose ids `IMAGE_MARKER + k` are image `k` (3 rows, fingerprint `100 + k`),
/// with M-RoPE positions (an image's rows on its 1x3 grid), so a chunk given
/// the wrong positions shows in every axis.
pub fn request(id: RequestId, tenant: u64, marked: &[u32]) -> Request {
    let mut prompt = text_prompt(tenant, &[]);
    let mut embeddings = Vec::new();
    for &m in marked {
        if m < IMAGE_MARKER {
            match prompt.atoms.last_mut() {
                Some(Atom::Text(ids)) => ids.push(m),
                _ => prompt.atoms.push(Atom::Text(vec![m])),
            }
            prompt.token_ids.push(m);
            continue;
        }
        let fingerprint = 100 + u128::from(m - IMAGE_MARKER);
        let item = match prompt.items.iter().position(|i| i.fingerprint.0 == fingerprint) {
            Some(item) => item,
            None => {
                prompt.items.push(Arc::new(ItemIdentity {
                    fingerprint: Fingerprint(fingerprint),
                    evidence: Evidence::SecondDigest(Fingerprint(fingerprint + 100)),
                    modality: Modality::Image,
                    layout: ItemLayout::Image { grid_thw: [1, 2, 6] },
                    num_tokens: IMAGE_ROWS as usize,
                    content_bytes: 0,
                }));
                let rows =
                    Array2::from_shape_fn((IMAGE_ROWS as usize, 2), |(r, _)| embedding_value(fingerprint, r));
                embeddings.push(Arc::new(rows));
                prompt.items.len() - 1
            }
        };
        let start = prompt.token_ids.len() as u32;
        let identity = Arc::clone(&prompt.items[item]);
        prompt.atoms.push(Atom::Item { id: identity, rows: 0..IMAGE_ROWS });
        prompt.index_map.spans.push(ItemSpan { item: item as u32, rows: 0..IMAGE_ROWS, start });
        prompt.index_map.placeholders.insert_range(start..start + IMAGE_ROWS);
        prompt.token_ids.extend([IMAGE_PAD; IMAGE_ROWS as usize]);
    }
    prompt.positions = positions_from_atoms(&prompt.atoms, &OmniTokens::tiny(), PositionKind::Mrope)
        .expect("test images are 1x3 grids under the tiny merge size");
    Request { item_embeddings: embeddings, hidden_size: Some(2), ..Request::new(id, prompt) }
}

/// What each pool slot holds, written the way a runner would write KV.
pub struct ShadowPages {
    block_size: usize,
    slots: Vec<Option<(u64, Key)>>,
    /// Tenant and keys of every request seen, by id.
    prompts: HashMap<RequestId, (u64, Vec<Key>)>,
    /// Every request's whole-prompt positions, materialised, by id.
    positions: HashMap<RequestId, Vec<[i64; 3]>>,
}

impl ShadowPages {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            block_size,
            slots: vec![None; num_blocks * block_size],
            prompts: HashMap::new(),
            positions: HashMap::new(),
        }
    }

    /// Remembers a request's keys so its batches can be checked.
    pub fn register(&mut self, req: &Request) {
        self.update(req.id, &req.prompt);
    }

    /// Request `id`'s sequence is `prompt` now (it grew by generated tokens).
    pub fn update(&mut self, id: RequestId, prompt: &CanonicalPrompt) {
        self.prompts.insert(id, (prompt.tenant, keys_of(prompt)));
        self.positions.insert(id, prompt.positions.iter().collect());
    }

    /// Executes `batch`: block copies, then for each sequence checks that its
    /// block table serves the right KV for every computed position, then
    /// writes its new positions into the slots the table maps them to.
    pub fn run(&mut self, batch: &ScheduledBatch) -> Result<(), String> {
        let bs = self.block_size;
        for c in &batch.copies {
            let (src, dst) = (c.src as usize * bs, c.dst as usize * bs);
            let block = self.slots[src..src + bs].to_vec();
            self.slots[dst..dst + bs].clone_from_slice(&block);
        }
        for seq in &batch.seqs {
            let (tenant, keys) =
                self.prompts.get(&seq.request).ok_or(format!("unknown request {}", seq.request))?;
            let slot = |p: usize| seq.block_table[p / bs] as usize * bs + p % bs;
            if seq.block_table.block_size() != bs {
                return Err(format!(
                    "request {}: a table of {}-token blocks",
                    seq.request,
                    seq.block_table.block_size()
                ));
            }
            let end = seq.num_computed_tokens + seq.token_ids.len();
            if seq.block_table.len() * bs < end || end > keys.len() || seq.seq_len != keys.len() {
                return Err(format!(
                    "request {}: table of {} blocks for tokens ..{end}",
                    seq.request,
                    seq.block_table.len()
                ));
            }
            for (p, &key) in keys.iter().enumerate().take(seq.num_computed_tokens) {
                let found = self.slots[slot(p)];
                if found != Some((*tenant, key)) {
                    return Err(format!(
                        "request {}: position {p} reads {found:?}, wants {key:?}",
                        seq.request
                    ));
                }
            }
            // The slots the runner writes come from the table (`ScheduledSeq::slots`).
            for (p, s) in seq.new_positions().zip(seq.slots()) {
                if s != slot(p) as i64 {
                    return Err(format!("request {}: slot of position {p} is {s}", seq.request));
                }
                self.slots[s as usize] = Some((*tenant, keys[p]));
            }
            check_inputs(seq, &keys[seq.num_computed_tokens..end])?;
            let whole = self.positions.get(&seq.request).map_or(&[][..], Vec::as_slice);
            check_positions(seq, whole)?;
            if seq.emits_output != (end == keys.len()) {
                return Err(format!(
                    "request {}: emits_output {} at token {end}",
                    seq.request, seq.emits_output
                ));
            }
        }
        Ok(())
    }
}

/// Checks that a sequence's positions are the whole prompt's positions over
/// `num_computed_tokens..num_computed_tokens + len`, value by value (so a chunk
/// cut from the wrong place, e.g. positions restarting at 0, is caught without
/// trusting the slicing code it tests).
fn check_positions(seq: &ScheduledSeq, whole: &[[i64; 3]]) -> Result<(), String> {
    let range = seq.new_positions();
    let want = whole
        .get(range.clone())
        .ok_or(format!("request {}: positions {range:?} past the prompt", seq.request))?;
    let got: Vec<[i64; 3]> = seq.positions.iter().collect();
    if got != want {
        let first = got.iter().zip(want).position(|(g, w)| g != w).unwrap_or(got.len().min(want.len()));
        return Err(format!(
            "request {}: positions of {range:?} differ from the prompt's at offset {first}: {:?} vs {:?}",
            seq.request,
            got.get(first),
            want.get(first)
        ));
    }
    Ok(())
}

/// Checks that a sequence's new positions get the right inputs: each text
/// token its id, each image row exactly one embedding row with the right value.
fn check_inputs(seq: &ScheduledSeq, keys: &[Key]) -> Result<(), String> {
    let id = seq.request;
    let mut placed = HashSet::new();
    for e in &seq.embeds {
        for (j, row) in e.rows.clone().enumerate() {
            let offset = e.step_offset + j;
            let value = e.embeddings.get((row, 0)).copied();
            match keys.get(offset) {
                Some(&Key::Row(fp, r)) if r as usize == row && value == Some(embedding_value(fp, row)) => {}
                other => {
                    return Err(format!(
                        "request {id}: embedding row {row} at offset {offset} over {other:?}"
                    ));
                }
            }
            if !placed.insert(offset) {
                return Err(format!("request {id}: two embedding rows at offset {offset}"));
            }
        }
    }
    for (offset, key) in keys.iter().enumerate() {
        match *key {
            Key::Text(t) if seq.token_ids.get(offset) != Some(&t) => {
                return Err(format!("request {id}: token at offset {offset} is not {t}"));
            }
            Key::Row(..) if !placed.contains(&offset) => {
                return Err(format!("request {id}: image row at offset {offset} has no embedding"));
            }
            _ => {}
        }
    }
    Ok(())
}
