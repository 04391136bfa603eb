//! Canonical prompts: the self-contained result of preprocessing.
//!
//! A prompt is a sequence of atoms (runs of text token ids, and row spans of
//! fingerprinted items), plus the token ids the model sees, the index map of
//! which positions hold which item rows, and the position ids. Positions are a
//! pure function of the atoms: equal atoms give equal positions and so equal KV.

use std::ops::Range;
use std::sync::Arc;

use crate::canon::ItemIdentity;

/// `PromptBuilder`: text, items and whole id sequences into a `CanonicalPrompt`.
mod builder;
/// Position ids (1-D and Qwen3-Omni M-RoPE) computed from atoms, stored by run.
mod mrope;
/// Special token ids and placeholder counts of Qwen3-Omni-style models.
mod omni_tokens;
#[cfg(test)]
mod tests;

pub use builder::{PlaceholderForm, PromptBuilder};
pub use mrope::{PositionKind, Positions, positions_from_atoms};
pub use omni_tokens::OmniTokens;

/// Run-length key unit of a prompt.
#[derive(Debug, Clone)]
pub enum Atom {
    /// A run of plain text token ids.
    Text(Vec<u32>),
    /// Rows `rows` of one item's embedding sequence, at consecutive positions.
    Item { id: Arc<ItemIdentity>, rows: Range<u32> },
}

impl Atom {
    /// Number of prompt positions the atom covers: what the index keys on and
    /// the scheduler checks against the token ids.
    pub fn len(&self) -> usize {
        match self {
            Atom::Text(ids) => ids.len(),
            Atom::Item { rows, .. } => rows.len(),
        }
    }

    /// True for an atom that covers no position.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where an item's rows sit in the prompt (audio-in-video gives several spans per item).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemSpan {
    /// Index into `CanonicalPrompt::items`.
    pub item: u32,
    /// Rows of that item's embedding sequence.
    pub rows: Range<u32>,
    /// Prompt position of the first row.
    pub start: u32,
}

/// Which prompt positions hold which item rows.
#[derive(Debug, Clone, Default)]
pub struct IndexMap {
    /// All placeholder positions.
    pub placeholders: roaring::RoaringBitmap,
    /// The spans in position order.
    pub spans: Vec<ItemSpan>,
}

/// The first id of `ids` not below `vocab_size`, with its index: the one
/// vocabulary rule (the prompt builder, admission and the runner's check of
/// hand-built batches apply it). A max over the ids runs first because it
/// vectorises; the position is searched only when some id is out.
pub(crate) fn out_of_vocab(ids: &[u32], vocab_size: usize) -> Option<(usize, u32)> {
    let vocab = u32::try_from(vocab_size).ok()?;
    if ids.iter().fold(0, |m, &t| m.max(t)) < vocab {
        return None;
    }
    ids.iter().position(|&t| t >= vocab).map(|i| (i, ids[i]))
}

/// Tenant salt: prompts with different salts never share cache entries.
pub type TenantSalt = u64;

/// A request after preprocessing; all the scheduler ever sees.
#[derive(Debug, Clone)]
pub struct CanonicalPrompt {
    pub tenant: TenantSalt,
    pub atoms: Vec<Atom>,
    /// One id per position; placeholder positions hold their modality's pad id.
    pub token_ids: Vec<u32>,
    /// The items in order of first appearance.
    pub items: Vec<Arc<ItemIdentity>>,
    pub index_map: IndexMap,
    /// Rotary positions, a function of the atoms (stored by run, see [`Positions`]).
    pub positions: Positions,
}

impl CanonicalPrompt {
    /// A prompt of plain text `ids` under `tenant`, at linear positions: what
    /// a scheduler or index is driven with where no items are involved.
    ///
    /// ```
    /// use omniprefix::prompt::CanonicalPrompt;
    /// let p = CanonicalPrompt::text(0, vec![5, 6, 7]);
    /// assert_eq!((p.len(), p.items.len()), (3, 0));
    /// ```
    pub fn text(tenant: TenantSalt, ids: Vec<u32>) -> Self {
        CanonicalPrompt {
            tenant,
            atoms: vec![Atom::Text(ids.clone())],
            positions: Positions::linear(ids.len()),
            token_ids: ids,
            items: vec![],
            index_map: IndexMap::default(),
        }
    }

    /// Number of positions (tokens) in the prompt.
    pub fn len(&self) -> usize {
        self.token_ids.len()
    }

    /// Appends a generated token: a text atom of the sequence (merged into a
    /// trailing text run) at the next decode position, so the index keys the
    /// reply like any text and a follow-up that re-sends it matches.
    pub fn push_text(&mut self, token: u32) {
        self.token_ids.push(token);
        match self.atoms.last_mut() {
            Some(Atom::Text(ids)) => ids.push(token),
            _ => self.atoms.push(Atom::Text(vec![token])),
        }
        self.positions.append_text(1);
    }

    /// True for a prompt with no tokens.
    pub fn is_empty(&self) -> bool {
        self.token_ids.is_empty()
    }
}
