//! What a caller hands the engine: token ids, items with their content (for
//! the fingerprint) and their encoder outputs (for the model).

use std::sync::Arc;

use ndarray::Array2;

use crate::batch::DeepStack;
use crate::canon::ItemSpec;
pub use crate::preprocess::PlaceholderForm;
use crate::prompt::TenantSalt;

/// One multimodal item of a request.
#[derive(Debug, Clone)]
pub struct ItemInput<'a> {
    /// Modality, layout and content: what the fingerprint is computed over.
    pub spec: ItemSpec<'a>,
    /// The encoder's output `[num_tokens, hidden]`; `None` takes it from the
    /// engine's encoder cache (or the encoder given to
    /// [`Engine::submit_with_encoder`](super::Engine::submit_with_encoder)).
    pub embeddings: Option<Arc<Array2<f32>>>,
    /// DeepStack levels of a vision item (Qwen3-Omni): one `[num_tokens, hidden]`
    /// array per level, level `i` added at the item's positions after decoder
    /// layer `i`; at most one level per layer, the same count on every item of
    /// a request, none on audio. `None` takes the levels cached with the
    /// embeddings, or those the encoder returns (if any).
    pub deepstack: Option<DeepStack>,
}

/// What an encoder hands the engine for one item: its embeddings and, from a
/// DeepStack vision encoder, one more `[num_tokens, hidden]` per level. An
/// encoder closure may also return a bare `Array2<f32>` (no levels).
#[derive(Debug, Clone)]
pub struct EncoderOutput {
    /// `[num_tokens, hidden]`, scattered at the item's placeholders.
    pub embeddings: Array2<f32>,
    /// DeepStack levels (empty: none).
    pub deepstack: Vec<Array2<f32>>,
}

impl From<Array2<f32>> for EncoderOutput {
    fn from(embeddings: Array2<f32>) -> Self {
        EncoderOutput { embeddings, deepstack: Vec::new() }
    }
}

/// A prefill request.
#[derive(Debug, Clone, Default)]
pub struct PrefillRequest<'a> {
    /// Requests of different tenants never share cache entries.
    pub tenant: TenantSalt,
    /// Text ids with the items' placeholder ids in `placeholders` form.
    pub token_ids: Vec<u32>,
    pub placeholders: PlaceholderForm,
    /// Items in the order their placeholders appear (per modality).
    pub items: Vec<ItemInput<'a>>,
}

impl PrefillRequest<'_> {
    /// A text-only request of tenant 0.
    pub fn text(token_ids: Vec<u32>) -> Self {
        PrefillRequest { token_ids, ..Default::default() }
    }
}
