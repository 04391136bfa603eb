//! Runs one workload through an [`Engine`] one way (radix index, hash-chain
//! baseline, or no cache) — waves of prefills, or a conversation whose replies
//! the engine generates — and keeps, per request, what the report needs.

use std::sync::Arc;
use std::time::Instant;

use fxhash::FxHashMap;
use indicatif::ProgressBar;
use ndarray::Array2;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::workloads::{Wave, expanded_len};
use crate::bench::MODEL_ID;
use crate::error::{HarnessError, Result};
use crate::workloads::{ChatTurn, Media, RequestPlan, reply_for_history};
use omniprefix::backend::Backend;
use omniprefix::canon::{FingerprintKey, Modality};
use omniprefix::engine::{Engine, EngineConfig, IndexKind, ItemInput, Request};
use omniprefix::index::hashchain::hash_mm_item;
use omniprefix::model::{CaptureName, Thinker};
use omniprefix::prompt::OmniTokens;
use omniprefix::sample::SamplingParams;
use omniprefix::sched::SchedulerConfig;

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
    /// vLLM V1's block hash chain (SHA-256/CBOR, whole blocks); its match cost counts
    /// vLLM's BLAKE3 mm hashes of the raw media.
    HashChain,
    /// Caching off: every request its own tenant, same engine otherwise (the reference).
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

    fn get(&self, modality: Modality) -> Result<Arc<Array2<f32>>> {
        self.by_modality
            .get(&modality)
            .cloned()
            .ok_or_else(|| HarnessError::NoEmbeddings { item: format!("a {modality:?} item") })
    }
}

/// What one request of one way produced.
#[derive(Debug, Clone)]
pub struct RequestRun {
    pub prompt_tokens: usize,
    /// Tokens reused from the cache when the request started (not recomputed).
    pub cached_tokens: usize,
    /// Identifying + matching: preprocessing (fingerprints, prompt layout) or, for the
    /// hash chain, vLLM's mm hashes; plus the scheduler calls of the request's steps.
    pub match_ns: u64,
    /// From submission to the full hidden states.
    pub ttft_ns: u64,
    /// Each captured point's hidden states.
    pub hidden: Vec<(CaptureName, Array2<f32>)>,
    /// The last prompt position's logits (empty for a generated round, which returns tokens instead).
    pub last_logits: Vec<f32>,
    /// Tokens generated (the conversation's replies; empty for a prefill).
    pub generated: Vec<u32>,
    /// The previous round's reply as re-sent in this prompt, and how many of
    /// those tokens were found in the cache (0 and 0 outside a conversation).
    pub reply_tokens: usize,
    pub reply_cached: usize,
}

/// What [`run_way`] needs besides the waves.
pub struct WayInputs<'a, B: Backend> {
    pub backend: &'a Arc<B>,
    pub thinker: &'a Arc<Thinker<B>>,
    pub media: &'a Media,
    pub embeddings: &'a ItemEmbeddings,
    /// Chunked-prefill budget (new tokens per step).
    pub max_tokens_per_step: usize,
    /// Key of the item fingerprints.
    pub fingerprint_key: FingerprintKey,
    pub fingerprint_threads: usize,
}

/// The engine of one way: room for `tokens` prompt tokens of `requests` requests in `waves` waves.
fn way_engine<B: Backend>(
    inputs: &WayInputs<'_, B>, way: Way, tokens: usize, requests: usize, waves: usize,
) -> Result<Engine<B>> {
    // Room for every prompt's blocks at once, plus a copy-on-write block each.
    let num_blocks = tokens.div_ceil(BLOCK_SIZE) * 2 + 2 * requests + waves;
    let config = EngineConfig {
        scheduler: SchedulerConfig {
            block_size: BLOCK_SIZE,
            num_blocks,
            max_tokens_per_step: inputs.max_tokens_per_step,
            max_seqs_per_step: MAX_SEQS_PER_STEP,
            ..EngineConfig::default().scheduler
        },
        cache: way != Way::NoCache,
        index: if way == Way::HashChain { IndexKind::HashChain } else { IndexKind::Radix },
        fingerprint_key: inputs.fingerprint_key.clone(),
        fingerprint_threads: inputs.fingerprint_threads,
        tokens: Some(OmniTokens::qwen3_omni()),
        ..EngineConfig::default()
    };
    Ok(Engine::new(Arc::clone(inputs.backend), Arc::clone(inputs.thinker), config)?)
}

/// Runs the conversation `turns` one way on a fresh engine, each round
/// re-sending the history, the engine's own (greedy, `reply_len`-token) reply
/// to the previous round and the new turn. Returns the runs and the prompts sent.
pub fn run_conversation<B: Backend>(
    inputs: &WayInputs<'_, B>, way: Way, turns: &[ChatTurn], reply_len: usize, progress: &ProgressBar,
) -> Result<(Vec<RequestRun>, Vec<RequestPlan>)> {
    let tokens = OmniTokens::qwen3_omni();
    let mut plan = RequestPlan { token_ids: Vec::new(), items: Vec::new() };
    let longest = turns.iter().map(|t| t.token_ids.len() + reply_len).sum::<usize>()
        + turns
            .iter()
            .flat_map(|t| &t.new_items)
            .map(|&m| inputs.media.shapes.layout(m).num_tokens())
            .sum::<usize>();
    let mut engine = way_engine(inputs, way, longest * turns.len(), turns.len(), turns.len())?;
    let (mut runs, mut plans) = (Vec::with_capacity(turns.len()), Vec::with_capacity(turns.len()));
    // Where the previous prompt ended and how many reply tokens follow it.
    let (mut previous_len, mut reply_tokens) = (0, 0);
    for turn in turns {
        plan.token_ids.extend(&turn.token_ids);
        plan.items.extend(&turn.new_items);
        let hash_ns = if way == Way::HashChain { vllm_mm_hash_ns(&plan, inputs.media)? } else { 0 };
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(reply_len) };
        let g = engine.run((prefill_request(&plan, inputs)?).generate(params))?;
        progress.inc(g.prompt_len as u64);
        let identify_ns = if way == Way::HashChain { hash_ns } else { nanos(g.timings.preprocess) };
        runs.push(RequestRun {
            prompt_tokens: g.prompt_len,
            cached_tokens: g.num_cached_tokens,
            match_ns: identify_ns,
            ttft_ns: nanos(g.timings.ttft),
            hidden: g.hidden,
            last_logits: Vec::new(),
            reply_tokens,
            reply_cached: g.num_cached_tokens.saturating_sub(previous_len).min(reply_tokens),
            generated: g.tokens.clone(),
        });
        plans.push(plan.clone());
        let reply = reply_for_history(&g.tokens, &tokens);
        previous_len = g.prompt_len;
        reply_tokens = reply.len();
        plan.token_ids.extend(reply);
    }
    Ok((runs, plans))
}

/// Runs `waves` one way on a fresh engine; results in request order. Each wave is
/// submitted at once and run to completion before the next; `progress` counts
/// the prompt tokens of finished requests.
pub fn run_way<B: Backend>(
    inputs: &WayInputs<'_, B>, way: Way, waves: &[Wave], progress: &ProgressBar,
) -> Result<Vec<RequestRun>> {
    let total_tokens: usize = waves.iter().flatten().map(|p| expanded_len(p, inputs.media)).sum();
    let requests = waves.iter().map(Vec::len).sum::<usize>();
    let mut engine = way_engine(inputs, way, total_tokens, requests, waves.len())?;
    let mut runs = Vec::with_capacity(requests);
    for wave in waves {
        let mut vllm_hash_ns = FxHashMap::default();
        for plan in wave {
            let hash_ns = if way == Way::HashChain { vllm_mm_hash_ns(plan, inputs.media)? } else { 0 };
            let id = engine.submit(prefill_request(plan, inputs)?)?;
            vllm_hash_ns.insert(id, hash_ns);
        }
        let mut outputs = engine.run_all()?;
        outputs.sort_by_key(|o| o.request);
        for out in outputs {
            progress.inc(out.prompt_len as u64);
            // The baseline identifies items by vLLM's mm hashes, not by our fingerprints.
            let identify_ns = match vllm_hash_ns.get(&out.request) {
                Some(&ns) if way == Way::HashChain => ns,
                _ => nanos(out.timings.preprocess),
            };
            runs.push(RequestRun {
                prompt_tokens: out.prompt_len,
                cached_tokens: out.num_cached_tokens,
                match_ns: identify_ns + nanos(out.timings.schedule),
                ttft_ns: nanos(out.timings.total),
                hidden: out.hidden,
                last_logits: out.last_logits,
                generated: Vec::new(),
                reply_tokens: 0,
                reply_cached: 0,
            });
        }
    }
    Ok(runs)
}

fn prefill_request<'a, B: Backend>(plan: &'a RequestPlan, inputs: &WayInputs<'a, B>) -> Result<Request<'a>> {
    let items = plan
        .items
        .iter()
        .map(|&m| {
            Ok(ItemInput {
                spec: inputs.media.spec(m),
                embeddings: Some(inputs.embeddings.get(m)?),
                deepstack: None,
            })
        })
        .collect::<Result<_>>()?;
    Ok(Request { token_ids: plan.token_ids.clone(), items, ..Request::default() })
}

/// vLLM's identification of `plan`'s items: the BLAKE3 mm hash of each raw item.
fn vllm_mm_hash_ns(plan: &RequestPlan, media: &Media) -> Result<u64> {
    let t = Instant::now();
    for &m in &plan.items {
        std::hint::black_box(hash_mm_item(MODEL_ID, m, media.vllm_media(m))?);
    }
    Ok(nanos(t.elapsed()))
}

fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
