//! Runs one workload's waves through preprocess → scheduler → runner, one way
//! (radix index, hash-chain baseline, or no cache), timing each request from
//! its submission to its full hidden states.

use std::sync::Arc;
use std::time::Instant;

use fxhash::FxHashMap;
use indicatif::ProgressBar;
use ndarray::Array2;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::workloads::{Wave, expanded_len, raw_request};
use crate::backend::Backend;
use crate::batch::RequestId;
use crate::bench::MODEL_ID;
use crate::canon::Modality;
use crate::error::{Error, Result};
use crate::index::hashchain::{HashChainIndex, hash_mm_item};
use crate::index::radix::{RadixConfig, RadixIndex};
use crate::index::{PrefixIndex, ValidationPolicy};
use crate::model::CaptureName;
use crate::preprocess::Preprocessor;
use crate::prompt::{Atom, CanonicalPrompt};
use crate::runner::ModelRunner;
use crate::sched::{Request, Scheduler, SchedulerConfig};
use crate::workloads::Media;

/// Tokens per KV block in every way.
pub const BLOCK_SIZE: usize = 16;
/// Sequences per scheduler step.
const MAX_SEQS_PER_STEP: usize = 16;

/// How a workload is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Way {
    /// omniprefix: keyed fingerprints in preprocessing, validated radix match, token-granular reuse.
    Radix,
    /// vLLM V1's path: BLAKE3 mm hashes of the raw media, SHA-256/CBOR block chain, whole blocks.
    HashChain,
    /// Nothing shared: every request its own tenant, same scheduler and chunking (the reference).
    NoCache,
}

impl Way {
    /// Run order: the reference first.
    pub const ALL: [Way; 3] = [Way::NoCache, Way::Radix, Way::HashChain];

    /// The name in tables and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Way::Radix => "radix",
            Way::HashChain => "hash_chain",
            Way::NoCache => "no_cache",
        }
    }
}

/// One random embedding sequence `[tokens, hidden]` per modality, standing in for
/// the encoders' output: every request that carries the item gets the same rows.
#[derive(Debug, Clone)]
pub struct ItemEmbeddings {
    by_modality: FxHashMap<Modality, Arc<Array2<f32>>>,
}

impl ItemEmbeddings {
    /// Seeded uniform values in [-1, 1), the scale of the random token embeddings.
    pub fn random(media: &Media, hidden: usize, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let by_modality = [Modality::Image, Modality::Audio, Modality::Video]
            .into_iter()
            .map(|m| {
                let rows = media.shapes.layout(m).num_tokens();
                let values = Array2::from_shape_simple_fn((rows, hidden), || rng.random::<f32>() * 2.0 - 1.0);
                (m, Arc::new(values))
            })
            .collect();
        ItemEmbeddings { by_modality }
    }

    fn for_prompt(&self, prompt: &CanonicalPrompt) -> Result<Vec<Arc<Array2<f32>>>> {
        prompt
            .items
            .iter()
            .map(|item| {
                self.by_modality
                    .get(&item.modality)
                    .cloned()
                    .ok_or_else(|| Error::InvalidRequest(format!("no embeddings for a {:?} item", item.modality)))
            })
            .collect()
    }
}

/// What one request of one way produced.
#[derive(Debug, Clone)]
pub struct RequestRun {
    pub prompt_tokens: usize,
    /// Tokens reused from the cache when the request started (not recomputed).
    pub cached_tokens: usize,
    /// Identifying + matching: fingerprinting (radix) or vLLM's mm hashes (hash chain),
    /// plus the scheduler steps that matched the request.
    pub match_ns: u64,
    /// From submission to the full hidden states.
    pub ttft_ns: u64,
    /// Each captured point's hidden states.
    pub hidden: Vec<(CaptureName, Array2<f32>)>,
    pub last_logits: Vec<f32>,
}

/// What [`run_way`] needs besides the waves.
pub struct WayInputs<'a, B: Backend> {
    pub runner: &'a ModelRunner<B>,
    pub preprocessor: &'a Preprocessor,
    pub media: &'a Media,
    pub embeddings: &'a ItemEmbeddings,
    pub progress: &'a ProgressBar,
}

/// Runs `waves` one way on fresh pages and a fresh scheduler; results in request order.
pub fn run_way<B: Backend>(
    inputs: &WayInputs<'_, B>,
    way: Way,
    waves: &[Wave],
    max_tokens_per_step: usize,
) -> Result<Vec<RequestRun>> {
    let total_tokens: usize = waves.iter().flatten().map(|p| expanded_len(p, inputs.media)).sum();
    // The worst case: every prompt's blocks held at once, plus a copy-on-write block each.
    let requests = waves.iter().map(Vec::len).sum::<usize>();
    let num_blocks = total_tokens.div_ceil(BLOCK_SIZE) * 2 + 2 * requests + waves.len();
    let index: Box<dyn PrefixIndex> = match way {
        Way::HashChain => Box::new(HashChainIndex::new(BLOCK_SIZE)?),
        Way::Radix | Way::NoCache => {
            Box::new(RadixIndex::new(RadixConfig { block_size: BLOCK_SIZE, validation: ValidationPolicy::SecondDigest })?)
        }
    };
    let config = SchedulerConfig {
        num_blocks,
        block_size: BLOCK_SIZE,
        max_tokens_per_step,
        max_seqs_per_step: MAX_SEQS_PER_STEP,
        token_granular_reuse: true,
    };
    let mut sched = Scheduler::new(config, index)?;
    let mut pages = inputs.runner.alloc_pages(num_blocks, BLOCK_SIZE)?;
    let mut runs = Vec::with_capacity(requests);
    let mut next_id: RequestId = 0;
    for wave in waves {
        let first = next_id;
        next_id += wave.len() as u64;
        runs.extend(run_wave(inputs, way, wave, first, &mut sched, &mut pages)?);
    }
    Ok(runs)
}

/// A request of a wave while it runs.
struct Pending {
    prompt_tokens: usize,
    cached_tokens: Option<usize>,
    match_ns: u64,
    done: Option<RequestRun>,
}

fn run_wave<B: Backend>(
    inputs: &WayInputs<'_, B>,
    way: Way,
    wave: &Wave,
    first_id: RequestId,
    sched: &mut Scheduler,
    pages: &mut B::Pages,
) -> Result<Vec<RequestRun>> {
    let config = inputs.runner.thinker().config();
    let (vocab, hidden) = (config.vocab_size, config.hidden_size);
    // The baseline and the reference do not fingerprint: their prompts are built before the clock starts.
    let prebuilt: Vec<Option<CanonicalPrompt>> = wave
        .iter()
        .map(|plan| match way {
            Way::Radix => Ok(None),
            Way::HashChain | Way::NoCache => inputs.preprocessor.preprocess(&raw_request(plan, inputs.media)).map(Some),
        })
        .collect::<Result<_>>()?;
    let start = Instant::now();
    let mut pending: FxHashMap<RequestId, Pending> = FxHashMap::default();
    for ((plan, prebuilt), id) in wave.iter().zip(prebuilt).zip(first_id..) {
        let t = Instant::now();
        let mut prompt = match prebuilt {
            Some(prompt) => prompt,
            None => inputs.preprocessor.preprocess(&raw_request(plan, inputs.media))?,
        };
        match way {
            Way::HashChain => {
                for &m in &plan.items {
                    std::hint::black_box(hash_mm_item(MODEL_ID, m, inputs.media.vllm_media(m))?);
                }
            }
            // Tenant 0 is the shared one; every reference request gets its own.
            Way::NoCache => prompt.tenant = id + 1,
            Way::Radix => {}
        }
        let match_ns = elapsed_ns(t);
        fold_into_vocab(&mut prompt, vocab);
        let item_embeddings = inputs.embeddings.for_prompt(&prompt)?;
        let prompt_tokens = prompt.len();
        sched.admit(Request { id, prompt, item_embeddings, hidden_size: Some(hidden) })?;
        pending.insert(id, Pending { prompt_tokens, cached_tokens: None, match_ns, done: None });
    }
    while pending.values().any(|p| p.done.is_none()) {
        let t = Instant::now();
        let batch = sched.schedule()?;
        let schedule_ns = elapsed_ns(t);
        if batch.seqs.is_empty() {
            return Err(Error::InvalidRequest(format!(
                "{}: the scheduler cannot make progress with {} blocks",
                way.as_str(),
                sched.config().num_blocks
            )));
        }
        for seq in &batch.seqs {
            if let Some(p) = pending.get_mut(&seq.request).filter(|p| p.cached_tokens.is_none()) {
                p.cached_tokens = Some(seq.num_computed_tokens);
                p.match_ns += schedule_ns;
                inputs.progress.inc(seq.num_computed_tokens as u64);
            }
        }
        let outputs = inputs.runner.execute(&batch, pages)?;
        inputs.progress.inc(batch.num_new_tokens() as u64);
        for id in sched.complete(&batch)? {
            sched.finish(id)?;
        }
        for out in outputs {
            let p = pending.get_mut(&out.request).ok_or(Error::UnknownRequest { id: out.request })?;
            p.done = Some(RequestRun {
                prompt_tokens: p.prompt_tokens,
                cached_tokens: p.cached_tokens.unwrap_or(0),
                match_ns: p.match_ns,
                ttft_ns: elapsed_ns(start),
                hidden: out.hidden,
                last_logits: out.last_logits,
            });
        }
    }
    (first_id..first_id + wave.len() as u64)
        .map(|id| pending.remove(&id).and_then(|p| p.done).ok_or(Error::UnknownRequest { id }))
        .collect()
}

/// Folds token ids at or past `vocab` into it (`id mod vocab`), in the ids and the
/// text atoms alike, so a small test checkpoint can run prompts written with
/// Qwen3-Omni ids. Equal prompts stay equal, so caching is unaffected.
fn fold_into_vocab(prompt: &mut CanonicalPrompt, vocab: usize) {
    let Ok(vocab) = u32::try_from(vocab) else { return };
    if vocab == 0 || prompt.token_ids.iter().all(|&t| t < vocab) {
        return;
    }
    prompt.token_ids.iter_mut().for_each(|t| *t %= vocab);
    for atom in &mut prompt.atoms {
        if let Atom::Text(ids) = atom {
            ids.iter_mut().for_each(|t| *t %= vocab);
        }
    }
}

fn elapsed_ns(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
}
