//! What a caller hands the engine: one [`Request`] (prompt, tenant and task),
//! items with their content (for the fingerprint) and optional encoder outputs
//! (for the model), and the [`Encoder`] hook that computes missing outputs.

use std::fmt;
use std::sync::Arc;

use ndarray::Array2;

use crate::batch::DeepStack;
use crate::canon::{ItemIdentity, ItemSpec};
use crate::error::Result;
pub use crate::preprocess::PlaceholderForm;
use crate::prompt::TenantSalt;
use crate::sample::SamplingParams;
use crate::speech::SpeechOptions;

/// One multimodal item of a request.
#[derive(Debug, Clone)]
pub struct ItemInput<'a> {
    /// Modality, layout and content: what the fingerprint is computed over.
    pub spec: ItemSpec<'a>,
    /// The encoder's output `[num_tokens, hidden]`; `None` takes it from the
    /// engine's encoder cache, or from the request's (else the engine's) [`Encoder`].
    pub embeddings: Option<Arc<Array2<f32>>>,
    /// DeepStack levels of a vision item (Qwen3-Omni): one `[num_tokens, hidden]`
    /// array per level, level `i` added at the item's positions after decoder
    /// layer `i`; at most one level per layer, the same count on every item of
    /// a request, none on audio. `None` takes the levels cached with the
    /// embeddings, or those the encoder returns (if any).
    pub deepstack: Option<DeepStack>,
    /// The frontend's name of the item for KV-aware routing, 16 hex digits
    /// (Dynamo's frontend: `xxh3_64` of the image URL, one per image of
    /// `extra_args["mm_hashes"]`). The blocks holding the item's rows are then
    /// published with [`RoutingHash::marker`](crate::events::RoutingHash::marker)
    /// first in their `extra_keys`, the form Dynamo 1.6.1 routes images on.
    /// Never part of the fingerprint: the cache keys on content alone. Anything
    /// but 16 hex digits is [`RequestError::InvalidRoutingHash`](crate::error::RequestError::InvalidRoutingHash)
    /// naming the item, before anything is fingerprinted or cached.
    pub routing_hash: Option<String>,
}

impl<'a> ItemInput<'a> {
    /// An item of `spec` with no embeddings, DeepStack levels or routing hash.
    pub fn new(spec: ItemSpec<'a>) -> Self {
        ItemInput { spec, embeddings: None, deepstack: None, routing_hash: None }
    }
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

/// Computes an item's [`EncoderOutput`] when the request brings none and the
/// encoder cache misses. Requests hold theirs as `Send + Sync` (a request may
/// be built on one thread and submitted from another), so a counting encoder
/// counts with an atomic or a mutex. It runs while the request is prepared, on the caller's
/// thread and outside the engine's step loop, so a slow encoder delays only its
/// own request. Any `Fn(usize, &ItemIdentity) -> Result<E>` with
/// `E: Into<EncoderOutput>` is one; `item` indexes the request's items.
///
/// What it returns is checked like embeddings given with a request (shape,
/// width, finite values) before anything is cached.
pub trait Encoder {
    /// The output for item `item` of the request being prepared.
    fn encode(&self, item: usize, identity: &ItemIdentity) -> Result<EncoderOutput>;
}

impl<F, E> Encoder for F
where
    F: Fn(usize, &ItemIdentity) -> Result<E>,
    E: Into<EncoderOutput>,
{
    fn encode(&self, item: usize, identity: &ItemIdentity) -> Result<EncoderOutput> {
        self(item, identity).map(Into::into)
    }
}

/// What the engine does with a request's prompt.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Task {
    /// Run the prompt: full hidden states and the last position's logits.
    #[default]
    Prefill,
    /// Run the prompt, then sample tokens until a stop id or `max_tokens`.
    Generate(SamplingParams),
}

/// One request: the prompt (token ids and items), its tenant, its task and,
/// optionally, an encoder for its items.
///
/// ```
/// use omniprefix::engine::{Request, Task};
/// use omniprefix::sample::SamplingParams;
///
/// let prefill = Request::text(vec![1, 2, 3]);
/// assert_eq!(prefill.task, Task::Prefill);
/// let generate = Request::text(vec![1, 2, 3]).generate(SamplingParams::greedy(8));
/// assert!(matches!(generate.task, Task::Generate(ref p) if p.max_tokens == 8));
/// ```
#[derive(Clone, Default)]
pub struct Request<'a> {
    /// Requests of different tenants never share cache entries.
    pub tenant: TenantSalt,
    /// Text ids with the items' placeholder ids in `placeholders` form.
    pub token_ids: Vec<u32>,
    pub placeholders: PlaceholderForm,
    /// Items in the order their placeholders appear (per modality).
    pub items: Vec<ItemInput<'a>>,
    pub task: Task,
    /// This request's encoder; `None` falls back to the engine's
    /// ([`Engine::set_encoder`](super::Engine::set_encoder)), if any.
    pub encoder: Option<Arc<dyn Encoder + Send + Sync + 'a>>,
    /// Speak the reply (a generation on an engine whose checkpoint has a
    /// talker): audio chunks come as [`Event::Audio`](super::Event::Audio) and the
    /// whole in [`Output::speech`](super::Output::speech).
    pub audio: Option<SpeechOptions>,
}

impl<'a> Request<'a> {
    /// A text-only prefill of tenant 0.
    pub fn text(token_ids: Vec<u32>) -> Self {
        Request { token_ids, ..Default::default() }
    }

    /// The same prompt, generating with `params`.
    pub fn generate(self, params: SamplingParams) -> Self {
        Request { task: Task::Generate(params), ..self }
    }

    /// The same request, its reply spoken with `options` (see [`Request::audio`]).
    pub fn speak(self, options: SpeechOptions) -> Self {
        Request { audio: Some(options), ..self }
    }

    /// The same request, with `encoder` for its items that need one.
    pub fn with_encoder(self, encoder: impl Encoder + Send + Sync + 'a) -> Self {
        Request { encoder: Some(Arc::new(encoder)), ..self }
    }
}

impl fmt::Debug for Request<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Request")
            .field("tenant", &self.tenant)
            .field("token_ids", &self.token_ids)
            .field("placeholders", &self.placeholders)
            .field("items", &self.items)
            .field("task", &self.task)
            .field("encoder", &self.encoder.as_ref().map(|_| "<encoder>"))
            .field("audio", &self.audio)
            .finish()
    }
}
