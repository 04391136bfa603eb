//! Test support shared by `tests/scheduler.rs` and `proptests/pool_invariants.rs`:
//! a reference index, hand-built prompts, and a shadow runner that tracks what
//! every KV slot holds so a wrong reuse shows up as a wrong read.

pub mod reference_index;

use std::collections::HashMap;

use omniprefix::batch::{RequestId, ScheduledBatch};
use omniprefix::prompt::{Atom, CanonicalPrompt, IndexMap, Positions};
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
        positions: Positions::Linear((0..ids.len() as i64).collect()),
    }
}

/// A request without multimodal items.
pub fn text_request(id: RequestId, tenant: u64, ids: &[u32]) -> Request {
    Request {
        id,
        prompt: text_prompt(tenant, ids),
        item_embeddings: Vec::new(),
        hidden_size: None,
    }
}

/// What each pool slot holds, written the way a runner would write KV.
pub struct ShadowPages {
    block_size: usize,
    slots: Vec<Option<(u64, Key)>>,
    /// Tenant and keys of every request seen, by id.
    prompts: HashMap<RequestId, (u64, Vec<Key>)>,
}

impl ShadowPages {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            block_size,
            slots: vec![None; num_blocks * block_size],
            prompts: HashMap::new(),
        }
    }

    /// Remembers a request's keys so its batches can be checked.
    pub fn register(&mut self, req: &Request) {
        self.prompts
            .insert(req.id, (req.prompt.tenant, keys_of(&req.prompt)));
    }

    /// Executes `batch`: block copies, then for each sequence checks that its
    /// block table serves the right KV for every computed position and that
    /// its slots follow the table, then writes its new positions.
    pub fn run(&mut self, batch: &ScheduledBatch) -> Result<(), String> {
        let bs = self.block_size;
        for c in &batch.copies {
            let (src, dst) = (c.src as usize * bs, c.dst as usize * bs);
            let block = self.slots[src..src + bs].to_vec();
            self.slots[dst..dst + bs].clone_from_slice(&block);
        }
        for seq in &batch.seqs {
            let (tenant, keys) = self
                .prompts
                .get(&seq.request)
                .ok_or(format!("unknown request {}", seq.request))?;
            let slot = |p: usize| seq.block_table[p / bs] as usize * bs + p % bs;
            let end = seq.num_computed_tokens + seq.token_ids.len();
            if seq.block_table.len() * bs < end || end > keys.len() || seq.prompt_len != keys.len()
            {
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
            for (i, p) in (seq.num_computed_tokens..end).enumerate() {
                if seq.slot_mapping[i] != slot(p) as i64 {
                    return Err(format!(
                        "request {}: slot of position {p} is {}",
                        seq.request, seq.slot_mapping[i]
                    ));
                }
                let s = slot(p);
                self.slots[s] = Some((*tenant, keys[p]));
            }
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
