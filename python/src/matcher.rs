//! The standalone matcher for a Python scheduler: `fingerprint`, `Prompt` and
//! `PrefixIndex` (the radix tree over canonical atoms, validating every hit),
//! with block ids that the caller's own KV pool owns.

use std::sync::{Mutex, OnceLock};

use omniprefix::canon::{FingerprintKey, Fingerprinter, ItemContent, ItemSpec};
use omniprefix::index::radix::{RadixConfig, RadixIndex};
use omniprefix::index::{InsertOutcome as Inserted, PrefixIndex, PrefixMatch, ValidationPolicy};
use omniprefix::preprocess::Preprocessor;
use omniprefix::prompt::{CanonicalPrompt, OmniTokens};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::arrays::Content;
use crate::errors::{guard, to_py};
use crate::item::{BorrowedItems, layout_from_dict, modality_name, params_from};
use crate::options::{fingerprint_key, validation, validation_name};

/// The key of prompts built without one: random, drawn once per process.
fn process_key() -> FingerprintKey {
    static KEY: OnceLock<FingerprintKey> = OnceLock::new();
    KEY.get_or_init(FingerprintKey::random).clone()
}

fn policy_of(value: Option<&Bound<'_, PyAny>>) -> PyResult<ValidationPolicy> {
    value.filter(|v| !v.is_none()).map_or(Ok(ValidationPolicy::SecondDigest), validation)
}

/// The 128-bit keyed fingerprint of one item's content and layout (the
/// modality is the layout's kind), with the GIL released while it reads.
#[pyfunction]
#[pyo3(signature = (content, layout, *, key, params=None))]
pub fn fingerprint(
    py: Python<'_>, content: &Bound<'_, PyAny>, layout: &Bound<'_, PyAny>, key: &Bound<'_, PyAny>,
    params: Option<&Bound<'_, PyAny>>,
) -> PyResult<u128> {
    let key = fingerprint_key(key, "key")?;
    let layout = layout_from_dict(layout)?;
    let params = params_from(params)?;
    let content = Content::borrow(content)?;
    let spec = ItemSpec {
        modality: layout.modality(),
        layout,
        content: ItemContent::Tensor(content.view()),
        params,
    };
    py.detach(|| {
        guard(|| {
            let fingerprinter = Fingerprinter::new(key, 1, ValidationPolicy::Unvalidated)?;
            Ok(fingerprinter.identify(0, &spec)?.fingerprint.0)
        })
    })
}

/// vLLM's `multi_modal_uuids` for `items`: per modality, in order, each
/// item's identity under `key` as 64 hex digits (`Fingerprint::mm_hash_hex`,
/// the string our KV events carry in `extra_keys`). Fingerprinting reads each
/// item's bytes once, with the GIL released.
#[pyfunction]
#[pyo3(signature = (items, *, key, threads=1))]
pub fn vllm_uuids<'py>(
    py: Python<'py>, items: &Bound<'py, PyAny>, key: &Bound<'py, PyAny>, threads: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let key = fingerprint_key(key, "key")?;
    let borrowed = BorrowedItems::from_py(Some(items))?;
    let specs = borrowed.specs();
    let hexes: Vec<String> = py.detach(|| {
        guard(|| {
            let fingerprinter = Fingerprinter::new(key, threads.max(1), ValidationPolicy::Unvalidated)?;
            specs
                .iter()
                .enumerate()
                .map(|(i, spec)| Ok(fingerprinter.identify(i, spec)?.fingerprint.mm_hash_hex()))
                .collect()
        })
    })?;
    let out = PyDict::new(py);
    for (item, hex) in borrowed.items().iter().zip(hexes) {
        let modality = modality_name(item.get().modality);
        match out.get_item(modality)? {
            Some(list) => list.cast::<PyList>()?.append(hex)?,
            None => out.set_item(modality, PyList::new(py, [hex])?)?,
        }
    }
    Ok(out)
}

/// A canonical prompt: atoms (text runs, fingerprinted item rows), the
/// index map and positions, made under one key and validation policy.
/// It keeps its own copy of whatever validation needs, never the caller's arrays.
#[pyclass(frozen, module = "omniprefix")]
pub struct Prompt {
    prompt: CanonicalPrompt,
    policy: ValidationPolicy,
}

#[pymethods]
impl Prompt {
    #[new]
    #[pyo3(signature = (token_ids, items=None, *, key=None, tenant=0, validation=None, placeholders="unexpanded", special_tokens=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>, token_ids: &Bound<'_, PyAny>, items: Option<&Bound<'_, PyAny>>,
        key: Option<&Bound<'_, PyAny>>, tenant: u64, validation: Option<&Bound<'_, PyAny>>,
        placeholders: &str, special_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let ids = crate::arrays::token_ids(token_ids)?;
        let key =
            key.filter(|k| !k.is_none()).map_or_else(|| Ok(process_key()), |k| fingerprint_key(k, "key"))?;
        let policy = policy_of(validation)?;
        let tokens = special_tokens_of(special_tokens)?;
        let form = crate::engine::placeholder_form(placeholders)?;
        let borrowed = BorrowedItems::from_py(items)?;
        let specs = borrowed.specs();
        let prompt = py.detach(|| {
            guard(|| {
                let preprocessor = Preprocessor::new(Fingerprinter::new(key, 1, policy)?, tokens);
                preprocessor.canonicalise(tenant, &ids, form, &specs)
            })
        })?;
        Ok(Prompt { prompt, policy })
    }

    fn __len__(&self) -> usize {
        self.prompt.len()
    }

    /// One id per position, placeholders expanded.
    #[getter]
    fn token_ids(&self) -> Vec<u32> {
        self.prompt.token_ids.clone()
    }

    /// The items' fingerprints, in order.
    #[getter]
    fn fingerprints(&self) -> Vec<u128> {
        self.prompt.items.iter().map(|i| i.fingerprint.0).collect()
    }

    #[getter]
    fn tenant(&self) -> u64 {
        self.prompt.tenant
    }

    #[getter]
    fn validation(&self) -> &'static str {
        validation_name(self.policy)
    }

    fn __repr__(&self) -> String {
        format!(
            "Prompt(len={}, items={}, tenant={})",
            self.prompt.len(),
            self.prompt.items.len(),
            self.prompt.tenant
        )
    }
}

/// Special ids: `None` (Qwen3-Omni's) or a dict of `OmniTokens` fields
/// (`image_token_id`, `video_token_id`, `audio_token_id`, `vision_start_token_id`, ...).
fn special_tokens_of(value: Option<&Bound<'_, PyAny>>) -> PyResult<OmniTokens> {
    let Some(value) = value.filter(|v| !v.is_none()) else { return Ok(OmniTokens::qwen3_omni()) };
    if !value.is_instance_of::<PyDict>() {
        return Err(PyTypeError::new_err("special_tokens must be a dict of token-id fields"));
    }
    crate::item::from_py(value, "special_tokens")
}

/// A cached prefix as the index reported it: lock it while its blocks are read.
#[pyclass(frozen, name = "Match", module = "omniprefix")]
pub struct PyMatch {
    inner: PrefixMatch,
}

#[pymethods]
impl PyMatch {
    /// Leading positions whose KV is cached (may end inside a block).
    #[getter]
    fn tokens(&self) -> usize {
        self.inner.tokens
    }

    /// `tokens` rounded down to whole blocks.
    #[getter]
    fn aligned_tokens(&self) -> usize {
        self.inner.aligned_tokens
    }

    /// `ceil(tokens / block_size)` block ids; the last may be partly valid.
    #[getter]
    fn blocks(&self) -> Vec<u32> {
        self.inner.blocks.clone()
    }

    fn __repr__(&self) -> String {
        format!("Match(tokens={}, blocks={:?})", self.inner.tokens, self.inner.blocks)
    }
}

/// What an insert did with the blocks it was given.
#[pyclass(frozen, module = "omniprefix")]
pub struct InsertOutcome {
    /// Blocks the index now owns.
    #[pyo3(get)]
    adopted: Vec<u32>,
    /// Blocks not taken because equal content was cached: still the caller's.
    #[pyo3(get)]
    duplicates: Vec<u32>,
    /// Superseded partial blocks the index gave back to the caller.
    #[pyo3(get)]
    released: Vec<u32>,
    /// The inserted prefix as cached now (ready to lock).
    #[pyo3(get)]
    cached: Py<PyMatch>,
}

impl InsertOutcome {
    fn new(py: Python<'_>, outcome: Inserted) -> PyResult<Self> {
        Ok(InsertOutcome {
            adopted: outcome.adopted,
            duplicates: outcome.duplicates,
            released: outcome.released,
            cached: Py::new(py, PyMatch { inner: outcome.cached })?,
        })
    }
}

/// The radix prefix index over canonical prompts, for a scheduler that owns
/// its KV blocks: `match`, `insert`, `lock` / `unlock`, `evict`. Every call
/// runs under [`guard`], so a panic in the tree is an `InternalError`.
#[pyclass(frozen, name = "PrefixIndex", module = "omniprefix")]
pub struct PyPrefixIndex {
    index: Mutex<RadixIndex>,
    policy: ValidationPolicy,
}

impl PyPrefixIndex {
    fn locked(&self) -> std::sync::MutexGuard<'_, RadixIndex> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Refuses a prompt whose items carry another policy's evidence: it could never hit.
    fn check(&self, prompt: &Prompt) -> PyResult<()> {
        if prompt.policy != self.policy {
            return Err(PyValueError::new_err(format!(
                "prompt made under validation {:?}, index validates with {:?}",
                validation_name(prompt.policy),
                validation_name(self.policy)
            )));
        }
        Ok(())
    }
}

#[pymethods]
impl PyPrefixIndex {
    #[new]
    #[pyo3(signature = (block_size=omniprefix::kv::DEFAULT_BLOCK_SIZE, validation=None))]
    fn new(block_size: usize, validation: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let index = RadixIndex::new(RadixConfig { block_size }).map_err(to_py)?;
        Ok(PyPrefixIndex { index: Mutex::new(index), policy: policy_of(validation)? })
    }

    /// The longest cached, validated prefix of `prompt`.
    #[pyo3(name = "match")]
    fn match_prefix(&self, prompt: &Prompt) -> PyResult<PyMatch> {
        self.check(prompt)?;
        Ok(PyMatch { inner: guard(|| Ok(self.locked().match_prefix(&prompt.prompt)))? })
    }

    /// Caches the first `len(blocks)` full blocks of `prompt` (their KV written).
    fn insert(&self, py: Python<'_>, prompt: &Prompt, blocks: Vec<u32>) -> PyResult<InsertOutcome> {
        self.check(prompt)?;
        let outcome = guard(|| self.locked().insert(&prompt.prompt, &blocks))?;
        InsertOutcome::new(py, outcome)
    }

    /// Caches the first `tokens` positions held by `blocks` (the last block may be partly filled).
    fn insert_partial(
        &self, py: Python<'_>, prompt: &Prompt, blocks: Vec<u32>, tokens: usize,
    ) -> PyResult<InsertOutcome> {
        self.check(prompt)?;
        let outcome = guard(|| self.locked().insert_partial(&prompt.prompt, &blocks, tokens))?;
        InsertOutcome::new(py, outcome)
    }

    /// Pins a match's blocks against eviction (reference counted).
    fn lock(&self, m: &PyMatch) -> PyResult<()> {
        guard(|| {
            self.locked().lock(&m.inner);
            Ok(())
        })
    }

    /// Releases one `lock` of the match.
    fn unlock(&self, m: &PyMatch) -> PyResult<()> {
        guard(|| {
            self.locked().unlock(&m.inner);
            Ok(())
        })
    }

    /// Gives back up to `n` blocks of unlocked least-recently-used entries.
    fn evict(&self, n: usize) -> PyResult<Vec<u32>> {
        guard(|| Ok(self.locked().evict(n)))
    }

    /// Counters: queries, hits, hit_tokens, query_tokens, validation_failures,
    /// evicted_blocks, cached_blocks, nodes, index_bytes.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let stats = self.locked().stats();
        let json = serde_json::to_string(&stats).map_err(|e| PyValueError::new_err(e.to_string()))?;
        py.import("json")?.call_method1("loads", (json,))
    }

    /// Checks every invariant of the tree; raises `InternalError` naming a broken one.
    fn validate(&self) -> PyResult<()> {
        self.locked().validate().map_err(|v| to_py(v.into()))
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.locked().block_size()
    }

    #[getter]
    fn validation(&self) -> &'static str {
        validation_name(self.policy)
    }
}
