//! Preparation: everything a request needs before the step loop sees it,
//! run on the caller's thread and outside the loop's lock. It fingerprints
//! the items, builds the canonical prompt, runs every admission check that
//! reads no scheduler state, and calls the encoder for items that miss the
//! encoder cache. So a big item or a slow encoder delays only its own request.
//!
//! The encoder cache is shared with the loop and locked only to look up or
//! insert whole entries. Two callers that prepare the same item at once may
//! both call the encoder; whichever output is inserted last stays, and a
//! request only ever reads one output whole, so rows are never mixed. Fresh
//! outputs enter the cache when the request is admitted, never before.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use ndarray::Array2;

use super::request::{Encoder, Request, Task};
use crate::batch::{DeepStack, RequestId};
use crate::canon::{Fingerprint, ItemIdentity};
use crate::error::{EmbeddingPart, Error, RequestError, Result};
use crate::events::RoutingHash;
use crate::model::EncoderCache;
use crate::preprocess::Preprocessor;
use crate::prompt::{CanonicalPrompt, OmniTokens, TenantSalt};
use crate::sample::{SamplingParams, random_seed};
use crate::sched::{Checked, RequestChecks};
use crate::speech::{CheckedSpeech, SpeechChecks};

/// An engine-wide encoder: called from whichever thread prepares a request.
pub type SharedEncoder = Arc<dyn Encoder + Send + Sync>;

/// An item's encoder output to cache once its request is admitted.
type FreshRows = (Fingerprint, Arc<Array2<f32>>, Option<DeepStack>);

/// A request ready for the step loop: checked, with every item's rows. Made
/// by [`Engine::prepare`](super::Engine::prepare) (or a served engine's
/// `submit`), taken by [`Engine::submit_prepared`](super::Engine::submit_prepared).
#[derive(Debug)]
pub struct Prepared {
    pub(super) checked: Checked,
    /// Encoder outputs to cache once admitted.
    pub(super) fresh: Vec<FreshRows>,
    /// Items whose rows came from the encoder cache.
    pub(super) cache_hits: u64,
    /// Items the encoder ran for.
    pub(super) encoded: u64,
    /// The sampling settings and the seed in force, for a generation.
    pub(super) generate: Option<(SamplingParams, u64)>,
    /// The reply's speech, checked, when the request asked for audio.
    pub(super) speech: Option<CheckedSpeech>,
    pub(super) started: Instant,
    pub(super) preprocess: Duration,
}

impl Prepared {
    /// The id the request will run under.
    pub fn id(&self) -> RequestId {
        self.checked.request().id
    }

    /// The canonical prompt.
    pub fn prompt(&self) -> &CanonicalPrompt {
        &self.checked.request().prompt
    }
}

/// What preparation needs, shared by the engine and every thread that submits to it.
pub(super) struct Preparer {
    preprocessor: Preprocessor,
    /// The engine's checks, which its scheduler reads too.
    checks: Arc<RequestChecks>,
    /// Off: every request gets a private tenant, so nothing is shared.
    cache: bool,
    encoder_cache: Mutex<EncoderCache>,
    encoder: RwLock<Option<SharedEncoder>>,
    /// The talker's checks; `None` when the engine speaks no audio.
    speech: Option<SpeechChecks>,
    /// Items the encoder ran for (each an encoder-cache miss), counted when
    /// their request is admitted: a rejected request changes no counter.
    encoder_calls: AtomicU64,
    next_id: AtomicU64,
}

impl Preparer {
    pub(super) fn new(
        preprocessor: Preprocessor, checks: Arc<RequestChecks>, cache: bool, encoder_cache: EncoderCache,
        speech: Option<SpeechChecks>,
    ) -> Self {
        Preparer {
            preprocessor,
            checks,
            cache,
            encoder_cache: Mutex::new(encoder_cache),
            encoder: RwLock::new(None),
            speech,
            encoder_calls: AtomicU64::new(0),
            next_id: AtomicU64::new(0),
        }
    }

    /// Items the encoder ran for, of admitted requests.
    pub(super) fn encoder_calls(&self) -> u64 {
        self.encoder_calls.load(Ordering::Relaxed)
    }

    pub(super) fn tokens(&self) -> &OmniTokens {
        self.preprocessor.tokens()
    }

    pub(super) fn encoder_cache(&self) -> MutexGuard<'_, EncoderCache> {
        self.encoder_cache.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(super) fn set_encoder(&self, encoder: Option<SharedEncoder>) {
        *self.encoder.write().unwrap_or_else(|poisoned| poisoned.into_inner()) = encoder;
    }

    /// Fingerprint → prompt → checks → encoder, in that order, so a request
    /// that a cheap check rejects costs no encoder call; on error nothing
    /// changed. Errors name no request id: the caller has not seen it.
    pub(super) fn prepare(&self, request: Request<'_>) -> Result<Prepared> {
        self.prepare_numbered(request).map_err(Error::unnamed)
    }

    fn prepare_numbered(&self, request: Request<'_>) -> Result<Prepared> {
        let started = Instant::now();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        // The cheap rule first: a forged salt costs no fingerprinting (checked with caching off too).
        self.checks.check_tenant(id, request.tenant)?;
        let tenant = if self.cache { request.tenant } else { private_tenant(id) };
        // Also before fingerprinting: a malformed routing hash costs nothing.
        let routing = routing_hashes(&request)?;
        let specs = request.items.iter().map(|item| &item.spec);
        let prompt =
            self.preprocessor.canonicalise(tenant, &request.token_ids, request.placeholders, specs)?;
        let generate = match &request.task {
            Task::Prefill => None,
            Task::Generate(params) => {
                self.checks.check_sampling(params)?;
                Some((params.clone(), params.seed.unwrap_or_else(random_seed)))
            }
        };
        let speech = match (&request.audio, &self.speech) {
            (None, _) => None,
            (Some(_), None) => {
                return Err(RequestError::NoTalker { model: "this engine's checkpoint".into() }.into());
            }
            (Some(_), Some(_)) if generate.is_none() => return Err(RequestError::AudioNeedsGeneration.into()),
            (Some(options), Some(checks)) => Some(checks.check(options, &prompt, self.tokens())?),
        };
        // Positions the sequence may grow by: every sampled token but the last runs.
        let max_new_tokens =
            generate.as_ref().map_or(0, |(p, _)| p.positions_needed(prompt.len()) - prompt.len());
        self.checks.check_prompt(id, &prompt, max_new_tokens)?;
        let engine_encoder = self.encoder.read().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
        let encoder: Option<&dyn Encoder> = match &request.encoder {
            Some(e) => Some(&**e),
            None => engine_encoder.as_deref().map(|e| e as &dyn Encoder),
        };
        let rows = self.item_rows(&prompt, &request, encoder)?;
        let item_routing = routing.map(|r| in_prompt_order(&prompt.items, &request, &r)).unwrap_or_default();
        let req = crate::sched::Request {
            id,
            prompt,
            item_embeddings: rows.embeddings,
            item_deepstack: rows.deepstack,
            item_routing,
            hidden_size: None,
            max_new_tokens,
        };
        let checked = self.checks.checked_rows(req)?;
        Ok(Prepared {
            checked,
            fresh: rows.fresh,
            cache_hits: rows.cache_hits,
            encoded: rows.encoded,
            generate,
            speech,
            started,
            preprocess: started.elapsed(),
        })
    }

    /// Caches a newly admitted request's encoder outputs.
    pub(super) fn admitted(&self, fresh: Vec<FreshRows>, cache_hits: u64, encoded: u64) {
        self.encoder_calls.fetch_add(encoded, Ordering::Relaxed);
        let mut cache = self.encoder_cache();
        for (fp, embeddings, levels) in fresh {
            cache.insert_with_deepstack(fp, embeddings, levels);
        }
        cache.record_hits(cache_hits);
    }

    /// Each item's embeddings and DeepStack levels: given with the request,
    /// from the encoder cache, or from `encoder`. Fresh rows (given or encoded)
    /// must be finite: cached, a NaN would poison every later hit.
    fn item_rows(
        &self, prompt: &CanonicalPrompt, request: &Request<'_>, encoder: Option<&dyn Encoder>,
    ) -> Result<ItemRows> {
        let mut rows = ItemRows::default();
        for (index, (identity, input)) in prompt.items.iter().zip(&request.items).enumerate() {
            let fp = identity.fingerprint;
            let (emb, levels) = match &input.embeddings {
                Some(e) => {
                    check_finite(index, e, levels_of(&input.deepstack))?;
                    rows.fresh.push((fp, Arc::clone(e), input.deepstack.clone()));
                    (Arc::clone(e), input.deepstack.clone())
                }
                None => {
                    let cached = self.encoder_cache().get_with_deepstack(fp);
                    match cached {
                        Some((e, cached)) => {
                            rows.cache_hits += 1;
                            let levels = input.deepstack.clone().or(cached);
                            if let Some(given) = &input.deepstack {
                                check_finite(index, &e, Some(given.as_slice()))?;
                            }
                            (e, levels)
                        }
                        // The same content earlier in this request: encoded once.
                        None if let Some((_, e, levels)) = rows.fresh.iter().find(|(f, _, _)| *f == fp) => {
                            (Arc::clone(e), input.deepstack.clone().or_else(|| levels.clone()))
                        }
                        None => {
                            let encoder = encoder
                                .ok_or(Error::Request(RequestError::MissingEmbeddings { item: index }))?;
                            let out = encoder.encode(index, identity)?;
                            rows.encoded += 1;
                            let e = Arc::new(out.embeddings);
                            let encoded = (!out.deepstack.is_empty()).then(|| Arc::new(out.deepstack));
                            let levels = input.deepstack.clone().or(encoded);
                            check_finite(index, &e, levels_of(&levels))?;
                            rows.fresh.push((fp, Arc::clone(&e), levels.clone()));
                            (e, levels)
                        }
                    }
                }
            };
            rows.embeddings.push(emb);
            rows.deepstack.push(levels);
        }
        Ok(rows)
    }
}

/// The request's routing hashes, one per item in request order (`None`: the
/// request has none at all); the first malformed one is an error naming its item.
fn routing_hashes(request: &Request<'_>) -> Result<Option<Vec<Option<RoutingHash>>>> {
    if request.items.iter().all(|item| item.routing_hash.is_none()) {
        return Ok(None);
    }
    let parse = |(item, input): (usize, &super::ItemInput<'_>)| match &input.routing_hash {
        None => Ok(None),
        Some(text) => RoutingHash::parse(text).map(Some).ok_or_else(|| {
            Error::Request(RequestError::InvalidRoutingHash { item, found: text.chars().take(40).collect() })
        }),
    };
    request.items.iter().enumerate().map(parse).collect::<Result<Vec<_>>>().map(Some)
}

/// `routing` (request order) per `prompt.items` entry. The prompt lists items
/// in order of appearance, the request per modality in placeholder order; so
/// the k-th item of a modality in one is the k-th of that modality in the other.
fn in_prompt_order(
    prompt_items: &[Arc<ItemIdentity>], request: &Request<'_>, routing: &[Option<RoutingHash>],
) -> Vec<Option<RoutingHash>> {
    let mut taken = [0usize; 3];
    prompt_items
        .iter()
        .map(|identity| {
            let slot = &mut taken[identity.modality as usize];
            let k = *slot;
            *slot += 1;
            request
                .items
                .iter()
                .zip(routing)
                .filter(|(input, _)| input.spec.modality == identity.modality)
                .nth(k)
                .and_then(|(_, h)| *h)
        })
        .collect()
}

/// One pass over a request's items.
#[derive(Default)]
struct ItemRows {
    embeddings: Vec<Arc<Array2<f32>>>,
    deepstack: Vec<Option<DeepStack>>,
    fresh: Vec<FreshRows>,
    cache_hits: u64,
    /// Items the encoder ran for.
    encoded: u64,
}

/// Rejects NaN or ±Inf in an item's embeddings or DeepStack levels, naming the first.
fn check_finite(item: usize, embeddings: &Array2<f32>, deepstack: Option<&[Array2<f32>]>) -> Result<()> {
    let parts = std::iter::once((EmbeddingPart::Embeddings, embeddings)).chain(
        deepstack
            .into_iter()
            .flatten()
            .enumerate()
            .map(|(level, rows)| (EmbeddingPart::DeepStack { level }, rows)),
    );
    for (what, rows) in parts {
        if let Some(flat) = rows.iter().position(|v| !v.is_finite()) {
            let columns = rows.ncols().max(1);
            return Err(RequestError::NonFiniteEmbeddings {
                item,
                what,
                row: flat / columns,
                column: flat % columns,
            }
            .into());
        }
    }
    Ok(())
}

fn levels_of(levels: &Option<DeepStack>) -> Option<&[Array2<f32>]> {
    levels.as_ref().map(|d| d.as_slice())
}

/// The tenant of request `id` when caching is off: one per request, from the
/// top of the salt space, so no two requests ever share an entry.
fn private_tenant(id: RequestId) -> TenantSalt {
    TenantSalt::MAX - id
}
