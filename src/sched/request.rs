//! What a caller submits to the scheduler.

use std::sync::Arc;

use ndarray::Array2;

use crate::batch::{DeepStack, EmbedRows, RequestId};
use crate::events::RoutingHash;
use crate::prompt::CanonicalPrompt;

/// A preprocessed request with the embeddings of its multimodal items.
///
/// [`Scheduler::admit`](super::Scheduler::admit) checks every part of it
/// against the others and the model before anything changes.
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
    /// The frontend's routing hash per `prompt.items` entry (`None`: the item
    /// has none); empty when no item has one. Only KV events read it: the
    /// blocks this request publishes name its items' hashes as markers.
    pub item_routing: Vec<Option<RoutingHash>>,
    /// The embeddings' width, for a scheduler that was not given the model
    /// (its [`RequestChecks`](super::RequestChecks) name none, see
    /// [`Scheduler::with_checks`](super::Scheduler::with_checks)); the model's width wins.
    pub hidden_size: Option<usize>,
    /// Tokens the sequence may grow by ([`Scheduler::append`](super::Scheduler::append));
    /// 0 for a prefill. Admission checks prompt + this against the context and the pool.
    pub max_new_tokens: usize,
}

impl Request {
    /// A prefill of `prompt` with no item rows, no DeepStack levels and no
    /// routing hashes: what a text prompt needs; the rest is set field by field.
    ///
    /// ```
    /// use omniprefix::prompt::CanonicalPrompt;
    /// use omniprefix::sched::Request;
    ///
    /// let prompt = CanonicalPrompt::text(0, (0..8).collect());
    /// let generating = Request { max_new_tokens: 4, ..Request::new(1, prompt) };
    /// assert!(generating.item_embeddings.is_empty() && generating.hidden_size.is_none());
    /// ```
    pub fn new(id: RequestId, prompt: CanonicalPrompt) -> Self {
        Request {
            id,
            prompt,
            item_embeddings: Vec::new(),
            item_deepstack: Vec::new(),
            item_routing: Vec::new(),
            hidden_size: None,
            max_new_tokens: 0,
        }
    }

    /// The item rows at their prompt positions, one entry per index-map span:
    /// what each chunk's rows are clipped from (the request passed admission,
    /// so every span lies inside the prompt and its item).
    pub(super) fn placed_embeds(&self) -> Vec<EmbedRows> {
        let deepstack = |item: usize| self.item_deepstack.get(item).cloned().flatten();
        self.prompt
            .index_map
            .spans
            .iter()
            .filter_map(|span| {
                let item = span.item as usize;
                Some(EmbedRows {
                    step_offset: span.start as usize,
                    embeddings: Arc::clone(self.item_embeddings.get(item)?),
                    rows: span.rows.start as usize..span.rows.end as usize,
                    deepstack: deepstack(item),
                })
            })
            .collect()
    }
}
