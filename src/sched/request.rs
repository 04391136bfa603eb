//! What a caller submits, and the checks that make it safe to schedule.

use std::sync::Arc;

use ndarray::Array2;

use crate::batch::{DeepStack, RequestId};
use crate::canon::Modality;
use crate::error::{Error, RequestError, Result};
use crate::prompt::{Atom, CanonicalPrompt, Positions};

/// A preprocessed request with the embeddings of its multimodal items.
#[derive(Debug, Clone)]
pub struct Request {
    /// Caller-chosen id, unique among admitted requests.
    pub id: RequestId,
    pub prompt: CanonicalPrompt,
    /// One `[num_tokens, hidden]` array per `prompt.items` entry, in the same order.
    pub item_embeddings: Vec<Arc<Array2<f32>>>,
    /// DeepStack levels per `prompt.items` entry (`None`: the item has none);
    /// empty when no item has any.
    pub item_deepstack: Vec<Option<DeepStack>>,
    /// The model's hidden size, when known: every embedding must have that many columns.
    pub hidden_size: Option<usize>,
}

impl Request {
    /// Checks that the prompt's parts agree with each other and with the embeddings,
    /// so that slicing them per chunk cannot go out of range.
    pub(crate) fn validate(&self) -> Result<()> {
        let id = self.id;
        let len = self.prompt.len();
        if len == 0 {
            return Err(RequestError::PromptMismatch {
                id,
                what: "prompt length",
                expected: 1,
                found: 0,
            }.into());
        }
        let positions_len = match &self.prompt.positions {
            Positions::Linear(p) => p.len(),
            Positions::Mrope { t, h, w, .. } => {
                if t.len() != h.len() || t.len() != w.len() {
                    return Err(RequestError::PromptMismatch {
                        id,
                        what: "M-RoPE h/w row length",
                        expected: t.len(),
                        found: if h.len() != t.len() { h.len() } else { w.len() },
                    }.into());
                }
                t.len()
            }
        };
        if positions_len != len {
            return Err(RequestError::PromptMismatch {
                id,
                what: "positions length",
                expected: len,
                found: positions_len,
            }.into());
        }
        // The index keys on the atoms while the runner computes from the ids:
        // atoms that cover other tokens would file KV under the wrong key.
        let atoms: usize = self.prompt.atoms.iter().map(atom_len).sum();
        if atoms != len {
            return Err(RequestError::AtomsLengthMismatch { atoms, tokens: len }.into());
        }
        let items = &self.prompt.items;
        if self.item_embeddings.len() != items.len() {
            return Err(count_mismatch(id, "number of item embeddings", items.len(), self.item_embeddings.len()));
        }
        let hidden = self
            .hidden_size
            .or_else(|| self.item_embeddings.first().map(|e| e.ncols()));
        for (item, (identity, emb)) in items.iter().zip(&self.item_embeddings).enumerate() {
            if emb.nrows() != identity.num_tokens {
                return Err(RequestError::EmbeddingMismatch {
                    id,
                    item,
                    what: "embedding rows",
                    expected: identity.num_tokens,
                    found: emb.nrows(),
                }.into());
            }
            if let Some(hidden) = hidden.filter(|&h| h != emb.ncols()) {
                return Err(RequestError::EmbeddingMismatch {
                    id,
                    item,
                    what: "embedding columns",
                    expected: hidden,
                    found: emb.ncols(),
                }.into());
            }
        }
        self.validate_deepstack(hidden)?;
        let mut placeholder_rows = 0u64;
        let mut next_free = 0usize;
        for span in &self.prompt.index_map.spans {
            // Spans in position order and disjoint: an item row is placed once.
            if (span.start as usize) < next_free {
                return Err(RequestError::PromptMismatch {
                    id,
                    what: "index map span start (spans must be ordered and disjoint)",
                    expected: next_free,
                    found: span.start as usize,
                }.into());
            }
            next_free = span.start as usize + span.rows.len();
            let item = span.item as usize;
            let rows =
                self.item_embeddings
                    .get(item)
                    .map(|e| e.nrows())
                    .ok_or(RequestError::PromptMismatch {
                        id,
                        what: "index map item index",
                        expected: items.len(),
                        found: item,
                    })?;
            if span.rows.start > span.rows.end || span.rows.end as usize > rows {
                return Err(RequestError::EmbeddingMismatch {
                    id,
                    item,
                    what: "index map row end",
                    expected: rows,
                    found: span.rows.end as usize,
                }.into());
            }
            let end = span.start as usize + span.rows.len();
            if end > len {
                return Err(RequestError::PromptMismatch {
                    id,
                    what: "index map span end",
                    expected: len,
                    found: end,
                }.into());
            }
            placeholder_rows += span.rows.len() as u64;
        }
        let placeholders = self.prompt.index_map.placeholders.len();
        if placeholder_rows != placeholders {
            return Err(RequestError::PromptMismatch {
                id,
                what: "rows covered by index map spans",
                expected: placeholders as usize,
                found: placeholder_rows as usize,
            }.into());
        }
        Ok(())
    }

    /// Checks the DeepStack rows: one entry per item (or none at all), none on
    /// audio items, every level shaped like the item's embeddings, and the same
    /// number of levels on every item that has them (HF takes one list of levels).
    fn validate_deepstack(&self, hidden: Option<usize>) -> Result<()> {
        let id = self.id;
        let items = &self.prompt.items;
        if !self.item_deepstack.is_empty() && self.item_deepstack.len() != items.len() {
            return Err(count_mismatch(id, "number of item DeepStack entries", items.len(), self.item_deepstack.len()));
        }
        let mut levels_seen = None;
        for (item, (identity, levels)) in items.iter().zip(&self.item_deepstack).enumerate() {
            let Some(levels) = levels else { continue };
            if identity.modality == Modality::Audio {
                return Err(RequestError::DeepStackMismatch { id, item, level: 0, what: "levels of an audio item", expected: 0, found: levels.len() }.into());
            }
            let expected = *levels_seen.get_or_insert(levels.len());
            if levels.len() != expected {
                return Err(RequestError::DeepStackMismatch { id, item, level: 0, what: "number of levels", expected, found: levels.len() }.into());
            }
            for (level, rows) in levels.iter().enumerate() {
                if rows.nrows() != identity.num_tokens {
                    return Err(RequestError::DeepStackMismatch { id, item, level, what: "rows", expected: identity.num_tokens, found: rows.nrows() }.into());
                }
                if let Some(hidden) = hidden.filter(|&h| h != rows.ncols()) {
                    return Err(RequestError::DeepStackMismatch { id, item, level, what: "columns", expected: hidden, found: rows.ncols() }.into());
                }
            }
        }
        Ok(())
    }
}

/// A per-item list of `found` entries for `expected` items; `item` is the first
/// index that one of them lacks.
fn count_mismatch(id: RequestId, what: &'static str, expected: usize, found: usize) -> Error {
    RequestError::EmbeddingMismatch { id, item: found.min(expected), what, expected, found }.into()
}

/// Tokens an atom covers.
fn atom_len(atom: &Atom) -> usize {
    match atom {
        Atom::Text(ids) => ids.len(),
        Atom::Item { rows, .. } => rows.len(),
    }
}
