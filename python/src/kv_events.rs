//! The frontend side of KV events: `block_hashes`, the hashes an engine under
//! a fleet key publishes for a request, computed without any model.

use omniprefix::engine::{Request, request_block_hashes, tokens_from_config_json};
use omniprefix::prompt::OmniTokens;
use pyo3::prelude::*;

use crate::engine::{config_json, placeholder_form};
use crate::errors::guard;
use crate::item::BorrowedItems;
use crate::options::fingerprint_key as parse_key;

/// The hashes of a request's full blocks as an engine under `fingerprint_key`
/// publishes them in `BlockStored` events (items need no embeddings here).
#[pyfunction]
#[pyo3(signature = (token_ids, items=None, *, fingerprint_key, block_size=omniprefix::kv::DEFAULT_BLOCK_SIZE, tenant=0, placeholders="unexpanded", tokens=None))]
#[allow(clippy::too_many_arguments)]
pub fn block_hashes(
    py: Python<'_>, token_ids: &Bound<'_, PyAny>, items: Option<&Bound<'_, PyAny>>,
    fingerprint_key: &Bound<'_, PyAny>, block_size: usize, tenant: u64, placeholders: &str,
    tokens: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<u64>> {
    let ids = crate::arrays::token_ids(token_ids)?;
    let key = parse_key(fingerprint_key, "fingerprint_key")?;
    let tokens = special_tokens(py, tokens)?;
    let form = placeholder_form(placeholders)?;
    let borrowed = BorrowedItems::from_py(items)?;
    let request = Request {
        tenant,
        token_ids: ids,
        placeholders: form,
        items: borrowed.inputs(),
        ..Default::default()
    };
    py.detach(|| guard(|| request_block_hashes(&request, &key, block_size, &tokens)))
}

/// The special ids of `tokens`: `None` is Qwen3-Omni's; a `config.json` dict
/// gives the ones an engine over that config uses (Qwen3-Omni's when it names none).
fn special_tokens(py: Python<'_>, tokens: Option<&Bound<'_, PyAny>>) -> PyResult<OmniTokens> {
    let Some(config) = tokens.filter(|t| !t.is_none()) else { return Ok(OmniTokens::qwen3_omni()) };
    let json = config_json(py, config, "tokens")?;
    Ok(guard(|| tokens_from_config_json(&json))?.unwrap_or_else(OmniTokens::qwen3_omni))
}
