//! The preprocessing stage: a raw request (unexpanded text ids + items) in,
//! a self-contained [`CanonicalPrompt`] out.
//!
//! It runs before and off the scheduling path, on any thread: fingerprinting
//! reads every item byte (on the fingerprinter's threads), so the scheduler
//! only ever sees canonical requests and its own work stays microseconds.

use std::sync::Arc;

use crate::canon::{Fingerprinter, ItemSpec};
use crate::error::Result;
pub use crate::prompt::PlaceholderForm;
use crate::prompt::{CanonicalPrompt, OmniTokens, PositionKind, PromptBuilder, TenantSalt};

/// A request as a client sends it, after tokenisation and media decoding.
#[derive(Debug, Clone)]
pub struct RawRequest<'a> {
    /// Text token ids with each placeholder id once per item (unexpanded).
    pub token_ids: &'a [u32],
    /// The items, in the order their placeholders appear per modality.
    pub items: Vec<ItemSpec<'a>>,
    /// How the placeholders appear in `token_ids` (unexpanded, with or without
    /// audio-in-video, or expanded).
    pub placeholders: PlaceholderForm,
}

/// Turns [`RawRequest`]s into [`CanonicalPrompt`]s for one tenant.
///
/// The fingerprinter's [`ValidationPolicy`](crate::index::ValidationPolicy)
/// decides which validation [`Evidence`](crate::canon::Evidence) (second
/// digest, retained bytes) each item identity carries; the index confirms
/// hits with that evidence and has no policy of its own.
///
/// ```
/// use ndarray::Array3;
/// use omniprefix::canon::{FingerprintKey, Fingerprinter, ItemContent, ItemLayout, ItemSpec, Modality, TensorView};
/// use omniprefix::index::ValidationPolicy;
/// use omniprefix::preprocess::{PlaceholderForm, Preprocessor, RawRequest};
/// use omniprefix::prompt::OmniTokens;
///
/// let fingerprinter = Fingerprinter::new(FingerprintKey::random(), 1, ValidationPolicy::SecondDigest)?;
/// let preprocessor = Preprocessor::new(fingerprinter, OmniTokens::tiny());
/// let pixels = Array3::<u8>::zeros((64, 96, 3));
/// let image = ItemSpec {
///     modality: Modality::Image,
///     layout: ItemLayout::Image { grid_thw: [1, 4, 6] },
///     content: ItemContent::Tensor(TensorView::U8(pixels.view().into_dyn())),
///     params: Default::default(),
/// };
/// // text, vision_start, one image pad, vision_end, text
/// let ids = [100, 503, 500, 504, 200];
/// let prompt = preprocessor.preprocess(&RawRequest { token_ids: &ids, items: vec![image], placeholders: PlaceholderForm::Unexpanded })?;
/// assert_eq!(prompt.len(), 4 + 6); // the pad expands to 1·4·6 / 2² tokens
/// assert_eq!(prompt.items.len(), 1);
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Debug)]
pub struct Preprocessor {
    fingerprinter: Fingerprinter,
    /// The empty prompt every request starts from: the model's special ids, the
    /// tenant and the position layout live there, once.
    empty: PromptBuilder,
}

impl Preprocessor {
    /// A preprocessor for tenant 0 of the model whose special ids are `tokens`.
    pub fn new(fingerprinter: Fingerprinter, tokens: OmniTokens) -> Self {
        Preprocessor { fingerprinter, empty: PromptBuilder::new(tokens) }
    }

    /// Lays positions out as `kind` (1-D for plain RoPE models, 3-D M-RoPE for Omni ones).
    pub fn with_positions(self, kind: PositionKind) -> Self {
        Preprocessor { empty: self.empty.with_positions(kind), ..self }
    }

    /// Salts every prompt with `tenant`: prompts of different tenants never share cache.
    pub fn with_tenant(self, tenant: TenantSalt) -> Self {
        Preprocessor { empty: self.empty.with_tenant(tenant), ..self }
    }

    /// The fingerprinter (its key, policy and threads).
    pub fn fingerprinter(&self) -> &Fingerprinter {
        &self.fingerprinter
    }

    /// The model's special token ids.
    pub fn tokens(&self) -> &OmniTokens {
        self.empty.tokens()
    }

    /// Fingerprints every item, then expands the placeholders and computes
    /// positions. Any bad item or id is a typed error naming it.
    pub fn preprocess(&self, request: &RawRequest<'_>) -> Result<CanonicalPrompt> {
        self.fill(self.empty.clone(), request.token_ids, request.placeholders, &request.items)
    }

    /// [`Preprocessor::preprocess`] for callers that keep items in a request type
    /// of their own (the engine's items also carry embeddings), with the tenant
    /// and the placeholder form given per call.
    pub fn canonicalise<'i, 'a: 'i>(
        &self, tenant: TenantSalt, token_ids: &[u32], form: PlaceholderForm,
        items: impl IntoIterator<Item = &'i ItemSpec<'a>>,
    ) -> Result<CanonicalPrompt> {
        self.fill(self.empty.clone().with_tenant(tenant), token_ids, form, items)
    }

    /// Fingerprints `items` and lays them out with `token_ids` in `builder`.
    fn fill<'i, 'a: 'i>(
        &self, mut builder: PromptBuilder, token_ids: &[u32], form: PlaceholderForm,
        items: impl IntoIterator<Item = &'i ItemSpec<'a>>,
    ) -> Result<CanonicalPrompt> {
        let items = items
            .into_iter()
            .enumerate()
            .map(|(index, item)| self.fingerprinter.identify(index, item).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        builder.extend(token_ids, &items, form)?;
        builder.into_prompt()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canon::{FingerprintKey, ItemContent, ItemLayout, Modality, TensorView};
    use crate::error::{Error, RequestError};
    use crate::index::ValidationPolicy;
    use ndarray::Array1;

    fn preprocessor(tenant: TenantSalt) -> Result<Preprocessor> {
        let fingerprinter = Fingerprinter::new(FingerprintKey::fixed(1), 1, ValidationPolicy::SecondDigest)?;
        Ok(Preprocessor::new(fingerprinter, OmniTokens::tiny()).with_tenant(tenant))
    }

    fn audio(wave: &Array1<f32>, mel_frames: u32) -> ItemSpec<'_> {
        ItemSpec {
            modality: Modality::Audio,
            layout: ItemLayout::Audio { mel_frames },
            content: ItemContent::Tensor(TensorView::F32(wave.view().into_dyn())),
            params: Default::default(),
        }
    }

    #[test]
    fn items_are_fingerprinted_and_expanded_for_the_tenant() -> Result<()> {
        let wave = Array1::from_iter((0..1600).map(|i| (i as f32 * 0.01).sin()));
        let ids = [7, 505, 502, 506, 8];
        let request = RawRequest {
            token_ids: &ids,
            items: vec![audio(&wave, 100)],
            placeholders: PlaceholderForm::Unexpanded,
        };
        let prompt = preprocessor(9)?.preprocess(&request)?;
        assert_eq!(prompt.tenant, 9);
        assert_eq!(prompt.len(), 4 + 13);
        assert_eq!(prompt.items[0].num_tokens, 13);
        assert!(prompt.items[0].evidence.check().is_some(), "SecondDigest material is computed");
        Ok(())
    }

    #[test]
    fn bad_items_and_ids_are_typed_errors() -> Result<()> {
        let wave = Array1::from_elem(160, f32::NAN);
        let ids = [7, 505, 502, 506];
        let nan = RawRequest {
            token_ids: &ids,
            items: vec![audio(&wave, 100)],
            placeholders: PlaceholderForm::Unexpanded,
        };
        assert!(matches!(
            preprocessor(0)?.preprocess(&nan),
            Err(Error::Request(RequestError::NonFinite { item: 0, .. }))
        ));
        let missing =
            RawRequest { token_ids: &ids, items: vec![], placeholders: PlaceholderForm::Unexpanded };
        assert!(matches!(
            preprocessor(0)?.preprocess(&missing),
            Err(Error::Request(RequestError::MissingItem { position: 2, modality: Modality::Audio, .. }))
        ));
        Ok(())
    }
}
