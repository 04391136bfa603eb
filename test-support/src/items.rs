//! Hand-made item identities for prompt tests (`tests/engine/mrope_vectors.rs`,
//! `proptests/prompt_positions.rs`): only the layout and token count matter to
//! positions, so the content fields stay empty.

use std::sync::Arc;

use omniprefix::Result;
use omniprefix::canon::{Evidence, Fingerprint, ItemIdentity, ItemLayout};
use omniprefix::prompt::OmniTokens;

/// Item `fingerprint` laid out as `layout` (of the layout's modality), with the
/// placeholder count `tokens` gives that layout (so the builder accepts it).
pub fn placeholder_item(
    tokens: &OmniTokens, fingerprint: u128, layout: ItemLayout,
) -> Result<Arc<ItemIdentity>> {
    Ok(Arc::new(ItemIdentity {
        fingerprint: Fingerprint(fingerprint),
        evidence: Evidence::Unvalidated,
        modality: layout.modality(),
        layout,
        num_tokens: tokens.placeholder_count(&layout)?,
        content_bytes: 0,
    }))
}
