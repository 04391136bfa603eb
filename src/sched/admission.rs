//! Admission: every check a request must pass, in one place, before any
//! state changes.
//!
//! A request that passes can be cut into chunks without going out of range,
//! and every chunk is well-formed for the model: its token ids are in the
//! vocabulary, its item rows fit their embeddings, its embeddings and
//! DeepStack levels have the model's width and level count. So the runner
//! trusts the batches the scheduler builds (it only `debug_assert!`s them).
//!
//! The checks, in order: the tenant is known (when tenants are required);
//! positions, atoms and token ids cover the same positions; the token ids
//! (placeholders included) are in the vocabulary; the sequence fits the
//! context; the embeddings and DeepStack rows agree with their items and the
//! model; the index map's spans are ordered, disjoint and inside the prompt and
//! their items. Those read no scheduler state ([`RequestChecks`]); then the id
//! is free and the sequence fits the pool ([`PoolLimits`]).

use fxhash::FxHashSet;

use super::Request;
use crate::batch::{LevelMismatch, ModelShape, RequestId};
use crate::canon::Modality;
use crate::error::{Error, RequestError, Result, SchedError};
use crate::prompt::{CanonicalPrompt, TenantSalt, out_of_vocab};
use crate::sample::SamplingParams;

/// The checks a request must pass that read no scheduler state: what it is
/// checked against (nothing but self-consistency by default). A served engine
/// runs them while it prepares a request, on the caller's thread; a
/// [`Scheduler`](super::Scheduler) runs them in [`admit`](super::Scheduler::admit).
///
/// ```
/// use omniprefix::batch::ModelShape;
/// use omniprefix::model::Config;
/// use omniprefix::sched::RequestChecks;
///
/// let checks = RequestChecks::default()
///     .with_model(ModelShape::of(&Config::tiny_qwen3(32, 2, 4, 2, 50)))
///     .with_max_context(64)
///     .with_known_tenants([0, 7]);
/// assert!(checks.check_tenant(1, 7).is_ok());
/// assert!(checks.check_tenant(1, 8).is_err());
/// ```
#[derive(Debug, Clone, Default)]
pub struct RequestChecks {
    /// The model the batches run on: vocabulary, hidden width, DeepStack levels.
    model: Option<ModelShape>,
    /// Longest sequence the model can attend over (`max_position_embeddings`).
    max_context: Option<usize>,
    /// When set, only these tenants are admitted: a request carrying an
    /// unknown salt is rejected instead of silently getting a cache of its own.
    known_tenants: Option<FxHashSet<TenantSalt>>,
}

/// A request that passed every [`RequestChecks`] check; only
/// [`RequestChecks::check`] makes one, and
/// [`Scheduler::admit_checked`](super::Scheduler::admit_checked) takes it
/// without checking it again.
#[derive(Debug, Clone)]
pub struct Checked(pub(super) Request);

impl Checked {
    /// The request that passed.
    pub fn request(&self) -> &Request {
        &self.0
    }
}

/// The scheduler state admission reads (it changes none).
pub(super) struct PoolLimits {
    /// The id is held by an admitted request (or one aborted while in flight).
    pub(super) id_taken: bool,
    pub(super) num_blocks: usize,
    pub(super) block_size: usize,
}

impl PoolLimits {
    /// The id is free and, alone, the request can always get its blocks (see `Scheduler::start`).
    pub(super) fn check(&self, req: &Request) -> Result<()> {
        if self.id_taken {
            return Err(SchedError::DuplicateRequest { id: req.id }.into());
        }
        let needed = req.prompt.len().saturating_add(req.max_new_tokens).div_ceil(self.block_size);
        if needed > self.num_blocks {
            return Err(RequestError::RequestTooLarge {
                id: Some(req.id),
                needed,
                num_blocks: self.num_blocks,
            }
            .into());
        }
        Ok(())
    }
}

impl RequestChecks {
    /// Checks against `shape`: token ids (placeholders included) in its
    /// vocabulary, embeddings of its width, as many DeepStack levels as it takes.
    pub fn with_model(mut self, shape: ModelShape) -> Self {
        self.model = Some(shape);
        self
    }

    /// Rejects sequences (prompt + tokens it may generate) longer than
    /// `max_context` positions with [`RequestError::ContextTooLong`].
    pub fn with_max_context(mut self, max_context: usize) -> Self {
        self.max_context = Some(max_context);
        self
    }

    /// Admits only prompts salted with one of `tenants`; others get
    /// [`RequestError::UnknownTenant`].
    pub fn with_known_tenants(mut self, tenants: impl IntoIterator<Item = TenantSalt>) -> Self {
        self.known_tenants = Some(tenants.into_iter().collect());
        self
    }

    /// Sampling parameters ([`SamplingParams::check`]), stop ids against the
    /// model's vocabulary when one is checked against.
    pub fn check_sampling(&self, params: &SamplingParams) -> Result<()> {
        params.check(self.model.as_ref().map_or(usize::MAX, |m| m.vocab_size))
    }

    /// The model checked against, if any.
    pub fn model(&self) -> Option<&ModelShape> {
        self.model.as_ref()
    }

    /// Every check, in order: the tenant, the prompt, then the rows; on error
    /// nothing changed.
    pub fn check(&self, req: Request) -> Result<Checked> {
        self.check_tenant(req.id, req.prompt.tenant)?;
        self.check_prompt(req.id, &req.prompt, req.max_new_tokens)?;
        self.checked_rows(req)
    }

    /// The last part of [`check`](Self::check), for a caller that ran
    /// [`check_tenant`](Self::check_tenant) and [`check_prompt`](Self::check_prompt)
    /// on this request's prompt before it computed the rows.
    pub(crate) fn checked_rows(&self, req: Request) -> Result<Checked> {
        self.check_rows(&req)?;
        Ok(Checked(req))
    }

    /// The tenant rule: the one cheap check that runs before anything is fingerprinted.
    pub fn check_tenant(&self, id: RequestId, tenant: TenantSalt) -> Result<()> {
        if self.known_tenants.as_ref().is_some_and(|known| !known.contains(&tenant)) {
            return Err(RequestError::UnknownTenant { id: Some(id), tenant }.into());
        }
        Ok(())
    }

    /// What needs no embeddings: the prompt's parts cover the same positions,
    /// its ids are in the vocabulary, and it fits the context after growing by
    /// `max_new_tokens`. An engine runs this before any encoder.
    pub fn check_prompt(&self, id: RequestId, prompt: &CanonicalPrompt, max_new_tokens: usize) -> Result<()> {
        check_lengths(Some(id), prompt)?;
        if let Some(model) = &self.model
            && let Some((position, token)) = out_of_vocab(&prompt.token_ids, model.vocab_size)
        {
            let vocab_size = u32::try_from(model.vocab_size).unwrap_or(u32::MAX);
            return Err(RequestError::TokenOutOfVocab { position, token, vocab_size }.into());
        }
        let len = prompt.len().saturating_add(max_new_tokens);
        if let Some(max) = self.max_context.filter(|&max| len > max) {
            return Err(RequestError::ContextTooLong {
                id: Some(id),
                prompt_len: prompt.len(),
                max_new_tokens,
                len,
                max,
            }
            .into());
        }
        Ok(())
    }

    /// The embeddings and DeepStack rows against their items, the index map and the model.
    pub fn check_rows(&self, req: &Request) -> Result<()> {
        self.check_items(req)?;
        check_spans(req)
    }

    /// Embeddings and DeepStack levels against their items and the model.
    fn check_items(&self, req: &Request) -> Result<()> {
        let id = Some(req.id);
        let items = &req.prompt.items;
        if req.item_embeddings.len() != items.len() {
            return Err(count_mismatch(
                id,
                "number of item embeddings",
                items.len(),
                req.item_embeddings.len(),
            ));
        }
        let hidden = self
            .model
            .map(|m| m.hidden_size)
            .or(req.hidden_size)
            .or_else(|| req.item_embeddings.first().map(|e| e.ncols()));
        for (item, (identity, emb)) in items.iter().zip(&req.item_embeddings).enumerate() {
            if emb.nrows() != identity.num_tokens {
                let found = emb.nrows();
                return Err(RequestError::EmbeddingMismatch {
                    id,
                    item,
                    what: "embedding rows",
                    expected: identity.num_tokens,
                    found,
                }
                .into());
            }
            if let Some(hidden) = hidden.filter(|&h| h != emb.ncols()) {
                let found = emb.ncols();
                return Err(RequestError::EmbeddingMismatch {
                    id,
                    item,
                    what: "embedding columns",
                    expected: hidden,
                    found,
                }
                .into());
            }
        }
        self.check_deepstack(req, hidden)
    }

    /// DeepStack rows: one entry per item (or none at all), none on audio
    /// items, as many levels as the model takes and the same number on every
    /// item that has them (HF takes one list of levels), every level shaped
    /// like the item's embeddings.
    fn check_deepstack(&self, req: &Request, hidden: Option<usize>) -> Result<()> {
        let id = Some(req.id);
        let items = &req.prompt.items;
        if !req.item_deepstack.is_empty() && req.item_deepstack.len() != items.len() {
            let found = req.item_deepstack.len();
            return Err(count_mismatch(id, "number of item DeepStack entries", items.len(), found));
        }
        let mut levels_seen = None;
        for (item, (identity, levels)) in items.iter().zip(&req.item_deepstack).enumerate() {
            let Some(levels) = levels else { continue };
            let found = levels.len();
            if identity.modality == Modality::Audio {
                return Err(RequestError::DeepStackMismatch {
                    id,
                    item,
                    level: 0,
                    what: "levels of an audio item",
                    expected: 0,
                    found,
                }
                .into());
            }
            if let Some((what, expected)) = self.model.and_then(|m| m.deepstack_count_violation(found)) {
                return Err(RequestError::DeepStackMismatch {
                    id,
                    item,
                    level: found.min(expected),
                    what,
                    expected,
                    found,
                }
                .into());
            }
            let expected = *levels_seen.get_or_insert(found);
            if found != expected {
                return Err(RequestError::DeepStackMismatch {
                    id,
                    item,
                    level: 0,
                    what: "number of levels",
                    expected,
                    found,
                }
                .into());
            }
            if let Some(LevelMismatch { level, what, expected, found }) =
                LevelMismatch::first(levels, identity.num_tokens, hidden)
            {
                return Err(RequestError::DeepStackMismatch { id, item, level, what, expected, found }.into());
            }
        }
        Ok(())
    }
}

/// Positions, atoms and token ids cover the same positions.
fn check_lengths(id: Option<RequestId>, prompt: &CanonicalPrompt) -> Result<()> {
    let len = prompt.len();
    if len == 0 {
        return Err(RequestError::PromptMismatch { id, what: "prompt length", expected: 1, found: 0 }.into());
    }
    if prompt.positions.len() != len {
        return Err(RequestError::PromptMismatch {
            id,
            what: "positions length",
            expected: len,
            found: prompt.positions.len(),
        }
        .into());
    }
    // The index keys on the atoms while the runner computes from the ids:
    // atoms that cover other tokens would file KV under the wrong key.
    let atoms: usize = prompt.atoms.iter().map(|a| a.len()).sum();
    if atoms != len {
        return Err(RequestError::AtomsLengthMismatch { atoms, tokens: len }.into());
    }
    Ok(())
}

/// The index map's spans are ordered, disjoint, inside the prompt and inside
/// their items' embeddings, and cover exactly the placeholders, so slicing
/// item rows per chunk cannot go out of range.
fn check_spans(req: &Request) -> Result<()> {
    let id = Some(req.id);
    let prompt = &req.prompt;
    let len = prompt.len();
    let items = prompt.items.len();
    let mut placeholder_rows = 0u64;
    let mut next_free = 0usize;
    for span in &prompt.index_map.spans {
        // Spans in position order and disjoint: an item row is placed once.
        let start = span.start as usize;
        if start < next_free {
            let what = "index map span start (spans must be ordered and disjoint)";
            return Err(RequestError::PromptMismatch { id, what, expected: next_free, found: start }.into());
        }
        next_free = start + span.rows.len();
        let item = span.item as usize;
        let rows = req.item_embeddings.get(item).map(|e| e.nrows());
        let rows = rows.ok_or(RequestError::PromptMismatch {
            id,
            what: "index map item index",
            expected: items,
            found: item,
        })?;
        if span.rows.start > span.rows.end || span.rows.end as usize > rows {
            let found = span.rows.end as usize;
            return Err(RequestError::EmbeddingMismatch {
                id,
                item,
                what: "index map row end",
                expected: rows,
                found,
            }
            .into());
        }
        if next_free > len {
            return Err(RequestError::PromptMismatch {
                id,
                what: "index map span end",
                expected: len,
                found: next_free,
            }
            .into());
        }
        placeholder_rows += span.rows.len() as u64;
    }
    let placeholders = prompt.index_map.placeholders.len();
    if placeholder_rows != placeholders {
        let (expected, found) = (placeholders as usize, placeholder_rows as usize);
        return Err(RequestError::PromptMismatch {
            id,
            what: "rows covered by index map spans",
            expected,
            found,
        }
        .into());
    }
    Ok(())
}

/// A per-item list of `found` entries for `expected` items; `item` is the first
/// index that one of them lacks.
fn count_mismatch(id: Option<RequestId>, what: &'static str, expected: usize, found: usize) -> Error {
    RequestError::EmbeddingMismatch { id, item: found.min(expected), what, expected, found }.into()
}
