//! Soak test: many requests with Zipf-distributed prefix reuse (text and
//! multimodal) through the real scheduler and radix index, with a pool far
//! smaller than the working set and no model compute (each scheduled batch is
//! completed as if a runner had executed it). It watches for leaked blocks,
//! unbounded index growth and memory growth under sustained eviction.
//!
//! ```
//! use omniprefix_cli::soak::{SoakOptions, run_soak};
//! let report = run_soak(&SoakOptions { requests: 200, pool_blocks: 64, ..SoakOptions::default() })?;
//! assert_eq!(report.leaked_blocks, 0);
//! assert!(report.evicted_blocks > 0, "the pool is smaller than the working set");
//! # Ok::<(), omniprefix_cli::HarnessError>(())
//! ```

use std::sync::Arc;

use ndarray::{Array1, Array2, Array3};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{HarnessError, Result};
use omniprefix::batch::RequestId;
use omniprefix::canon::{
    FingerprintKey, Fingerprinter, ItemContent, ItemIdentity, ItemLayout, ItemSpec, Modality, TensorView,
};
use omniprefix::error::{ConfigError, Error};
use omniprefix::events::{KvEventBatch, KvEventPublisher, KvEventsConfig, Medium, PublisherStats};
use omniprefix::index::ValidationPolicy;
use omniprefix::index::block_hash::FleetHasher;
use omniprefix::index::radix::{RadixConfig, RadixIndex};
use omniprefix::prompt::{CanonicalPrompt, OmniTokens, PromptBuilder};
use omniprefix::sched::{PrefillCap, Request, Scheduler, SchedulerConfig};

/// What a soak run drives.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SoakOptions {
    /// Requests to run (default 100 000).
    pub requests: usize,
    /// KV blocks in the pool (default 1024): far fewer than the working set.
    pub pool_blocks: usize,
    /// Tokens per block (default 16).
    pub block_size: usize,
    /// Distinct shared prefixes ("documents") the Zipf law draws from (default 4096).
    pub prefixes: usize,
    /// Zipf exponent of prefix popularity (default 1.0).
    pub zipf_exponent: f64,
    /// Requests admitted at once (default 8).
    pub concurrency: usize,
    /// Seed of every random choice.
    pub seed: u64,
    /// Index samples taken over the run (default 20).
    pub samples: usize,
    /// Publish the scheduler's KV events here (one batch per step); `None` = none.
    #[serde(skip)]
    pub kv_events: Option<KvEventsConfig>,
    /// The fleet key the published block hashes are keyed by.
    #[serde(skip)]
    pub fingerprint_key: FingerprintKey,
}

impl Default for SoakOptions {
    fn default() -> Self {
        Self {
            requests: 100_000,
            pool_blocks: SchedulerConfig::default().num_blocks,
            block_size: omniprefix::kv::DEFAULT_BLOCK_SIZE,
            prefixes: 4096,
            zipf_exponent: 1.0,
            concurrency: 8,
            seed: 0,
            samples: 20,
            kv_events: None,
            fingerprint_key: FingerprintKey::random(),
        }
    }
}

/// One look at the cache state during the run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SoakSample {
    /// Requests finished so far.
    pub requests: usize,
    pub index_nodes: u64,
    pub cached_blocks: u64,
    pub index_bytes: u64,
    /// Resident memory now (`VmRSS`), KiB; 0 where `/proc` is unavailable.
    pub rss_kib: u64,
}

/// What a soak run measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SoakReport {
    pub options: SoakOptions,
    pub requests: usize,
    /// Requests that reused at least one cached token.
    pub hits: u64,
    /// `hits / requests`.
    pub hit_rate: f64,
    pub hit_tokens: u64,
    pub prompt_tokens: u64,
    /// `hit_tokens / prompt_tokens`.
    pub token_hit_rate: f64,
    pub evicted_blocks: u64,
    pub preemptions: u64,
    /// Full blocks of the distinct shared prefixes drawn: what caching them all would take.
    pub working_set_blocks: usize,
    /// Peak resident memory of the process (`VmHWM`), KiB; 0 without `/proc`.
    pub peak_rss_kib: u64,
    pub samples: Vec<SoakSample>,
    /// Blocks neither free nor owned by the index after every request finished (must be 0).
    pub leaked_blocks: usize,
    /// Blocks the index holds at the end (full and partly filled ones).
    pub index_blocks: usize,
    /// Of those, the full blocks published as stored and not removed: what a
    /// router following the KV events holds (0 without `kv_events`).
    pub published_blocks: usize,
    /// The wrapping sum of those blocks' hashes: a consumer of the events that summed its
    /// own set the same way holds the same blocks (with near certainty).
    pub published_hash_sum: u64,
    /// The KV-event publisher's final counters, with `kv_events`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<PublisherStats>,
    pub seconds: f64,
}

impl SoakReport {
    /// `Err` when the run leaked blocks.
    pub fn check(&self) -> Result<()> {
        if self.leaked_blocks > 0 {
            return Err(HarnessError::BlocksLeaked {
                leaked: self.leaked_blocks,
                num_blocks: self.options.pool_blocks,
            });
        }
        Ok(())
    }
}

/// Zipf sampling over `0..n` by inverse CDF.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, exponent: f64) -> Self {
        let mut total = 0.0;
        let cdf = (1..=n)
            .map(|k| {
                total += (k as f64).powf(-exponent);
                total
            })
            .collect();
        Self { cdf }
    }

    fn sample(&self, rng: &mut impl Rng) -> usize {
        let total = self.cdf.last().copied().unwrap_or(0.0);
        let u = rng.random::<f64>() * total;
        self.cdf.partition_point(|&c| c <= u).min(self.cdf.len().saturating_sub(1))
    }
}

const IMAGE_CONTENTS: usize = 16;
const AUDIO_CONTENTS: usize = 8;
const SYSTEM_PROMPTS: usize = 4;

/// Shared parts requests are made of: system prompts, item identities from
/// a small set of seeded contents, and each prefix's text.
struct Catalogue {
    tokens: OmniTokens,
    systems: Vec<Vec<u32>>,
    images: Vec<Arc<ItemIdentity>>,
    audios: Vec<Arc<ItemIdentity>>,
    /// One `[rows, 1]` embedding per item length (the scheduler only checks shapes).
    embeddings: std::collections::HashMap<usize, Arc<Array2<f32>>>,
}

fn text(rng: &mut ChaCha8Rng, len: usize) -> Vec<u32> {
    // Below every Qwen3-Omni special and placeholder id.
    (0..len).map(|_| rng.random_range(0..150_000)).collect()
}

impl Catalogue {
    /// Items fingerprinted under the fleet `key` (what the published block hashes are keyed by).
    fn new(seed: u64, key: &FingerprintKey) -> Result<Self> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x50a6);
        let fingerprinter = Fingerprinter::new(key.clone(), 1, ValidationPolicy::SecondDigest)?;
        let identify = |index: usize, spec: &ItemSpec<'_>| fingerprinter.identify(index, spec).map(Arc::new);
        let images = (0..IMAGE_CONTENTS)
            .map(|i| {
                let pixels = Array3::from_shape_fn((16, 32, 3), |_| rng.random::<u8>());
                identify(
                    i,
                    &ItemSpec {
                        modality: Modality::Image,
                        layout: ItemLayout::Image { grid_thw: [1, 4, 8] },
                        content: ItemContent::Tensor(TensorView::U8(pixels.view().into_dyn())),
                        params: Default::default(),
                    },
                )
            })
            .collect::<omniprefix::Result<Vec<_>>>()?;
        let audios = (0..AUDIO_CONTENTS)
            .map(|i| {
                let wave = Array1::from_shape_fn(1600, |_| rng.random::<f32>() - 0.5);
                identify(
                    i,
                    &ItemSpec {
                        modality: Modality::Audio,
                        layout: ItemLayout::Audio { mel_frames: 100 },
                        content: ItemContent::Tensor(TensorView::F32(wave.view().into_dyn())),
                        params: Default::default(),
                    },
                )
            })
            .collect::<omniprefix::Result<Vec<_>>>()?;
        let embeddings = images
            .iter()
            .chain(&audios)
            .map(|i| (i.num_tokens, Arc::new(Array2::zeros((i.num_tokens, 1)))))
            .collect();
        let systems = (0..SYSTEM_PROMPTS).map(|_| text(&mut rng, 48)).collect();
        Ok(Self { tokens: OmniTokens::qwen3_omni(), systems, images, audios, embeddings })
    }

    /// Prefix `k`: a system prompt, the document's text and, for two thirds
    /// of the documents, an image or an audio clip from the shared contents.
    fn push_prefix(&self, b: &mut PromptBuilder, k: usize, seed: u64) -> Result<()> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        b.push_text(&self.systems[k % SYSTEM_PROMPTS])?;
        let t = &self.tokens;
        match k % 3 {
            0 => {
                b.push_text(&[t.vision_start_token_id])?;
                b.push_item(Arc::clone(&self.images[k / 3 % IMAGE_CONTENTS]))?;
                b.push_text(&[t.vision_end_token_id])?;
            }
            1 => {
                b.push_text(&[t.audio_start_token_id])?;
                b.push_item(Arc::clone(&self.audios[k / 3 % AUDIO_CONTENTS]))?;
                b.push_text(&[t.audio_end_token_id])?;
            }
            _ => {}
        }
        let len = rng.random_range(32..160);
        b.push_text(&text(&mut rng, len))?;
        Ok(())
    }

    /// A request of prefix `k` plus a random suffix, and the prefix's length.
    fn request(&self, id: RequestId, k: usize, seed: u64, rng: &mut ChaCha8Rng) -> Result<(Request, usize)> {
        let mut b = PromptBuilder::new(self.tokens.clone());
        self.push_prefix(&mut b, k, seed)?;
        let prefix_len = b.len();
        let suffix = rng.random_range(4..48);
        b.push_text(&text(rng, suffix))?;
        let prompt: CanonicalPrompt = b.build()?;
        let item_embeddings = prompt
            .items
            .iter()
            .map(|i| {
                self.embeddings.get(&i.num_tokens).cloned().ok_or_else(|| HarnessError::NoEmbeddings {
                    item: format!("an item of {} tokens", i.num_tokens),
                })
            })
            .collect::<Result<_>>()?;
        Ok((Request { item_embeddings, ..Request::new(id, prompt) }, prefix_len))
    }
}

/// A `/proc/self/status` field in KiB (0 where unavailable).
fn proc_status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Runs the soak and reports; leaks are reported, not raised (see [`SoakReport::check`]).
pub fn run_soak(options: &SoakOptions) -> Result<SoakReport> {
    if options.requests == 0 || options.prefixes == 0 || options.concurrency == 0 {
        return Err(ConfigError::Invalid {
            component: "soak",
            field: "soak requests / prefixes / concurrency",
            expected: "positive".into(),
            found: format!("{} / {} / {}", options.requests, options.prefixes, options.concurrency),
        }
        .into());
    }
    let started = std::time::Instant::now();
    let catalogue = Catalogue::new(options.seed, &options.fingerprint_key)?;
    let bs = options.block_size;
    let config = SchedulerConfig {
        num_blocks: options.pool_blocks,
        block_size: bs,
        max_tokens_per_step: 8192,
        max_seqs_per_step: options.concurrency,
        prefill_cap: PrefillCap::Off,
        token_granular_reuse: true,
    };
    let index = RadixIndex::new(RadixConfig { block_size: bs })?;
    let mut sched = Scheduler::new(config, Box::new(index))?;
    let publisher = options.kv_events.as_ref().map(KvEventPublisher::bind).transpose()?;
    if let Some(p) = &publisher {
        crate::cli::fleet::announce(p.endpoint(), p.replay_endpoint());
        sched = sched.with_kv_events(FleetHasher::new(&options.fingerprint_key), Medium::Cpu);
    }
    let zipf = Zipf::new(options.prefixes, options.zipf_exponent);
    let mut rng = ChaCha8Rng::seed_from_u64(options.seed);
    let sample_every = options.requests.div_ceil(options.samples.max(1));
    let (mut admitted, mut finished, mut live, mut prompt_tokens) = (0usize, 0usize, 0usize, 0u64);
    let mut samples = Vec::new();
    let mut seen = vec![false; options.prefixes];
    let mut working_set_blocks = 0;
    while finished < options.requests {
        while live < options.concurrency && admitted < options.requests {
            let k = zipf.sample(&mut rng);
            let (req, prefix_len) = catalogue.request(admitted as RequestId, k, options.seed, &mut rng)?;
            prompt_tokens += req.prompt.len() as u64;
            if !std::mem::replace(&mut seen[k], true) {
                working_set_blocks += prefix_len / bs;
            }
            sched.admit(req)?;
            admitted += 1;
            live += 1;
        }
        let batch = sched.schedule()?;
        if batch.seqs.is_empty() {
            return Err(omniprefix::sched::stalled(live).into());
        }
        for id in sched.complete(&batch)? {
            sched.finish(id)?;
            live -= 1;
            finished += 1;
            if finished % sample_every == 0 || finished == options.requests {
                sched.validate().map_err(Error::from)?;
                let s = sched.index_stats();
                samples.push(SoakSample {
                    requests: finished,
                    index_nodes: s.nodes,
                    cached_blocks: s.cached_blocks,
                    index_bytes: s.index_bytes,
                    rss_kib: proc_status_kib("VmRSS:"),
                });
            }
        }
        if let Some(publisher) = &publisher {
            let events = sched.take_kv_events();
            if !events.is_empty() {
                publisher.publish(KvEventBatch::now(events, None));
            }
        }
    }
    sched.validate().map_err(Error::from)?;
    let stats = sched.stats();
    let leaked_blocks = options.pool_blocks - stats.blocks_free - stats.blocks_cached;
    let published = sched.cached_block_hashes();
    let requests = options.requests;
    Ok(SoakReport {
        options: options.clone(),
        requests,
        hits: stats.hits,
        hit_rate: stats.hits as f64 / requests as f64,
        hit_tokens: stats.hit_tokens,
        prompt_tokens,
        token_hit_rate: stats.hit_tokens as f64 / prompt_tokens.max(1) as f64,
        evicted_blocks: stats.evicted_blocks,
        preemptions: stats.preemptions,
        working_set_blocks,
        peak_rss_kib: proc_status_kib("VmHWM:"),
        samples,
        leaked_blocks,
        index_blocks: stats.blocks_cached,
        published_blocks: published.len(),
        published_hash_sum: published.iter().fold(0u64, |a, &h| a.wrapping_add(h)),
        kv_events: publisher.map(KvEventPublisher::close),
        seconds: started.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_prefers_low_ranks_and_stays_in_range() {
        let zipf = Zipf::new(100, 1.0);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let draws: Vec<usize> = (0..10_000).map(|_| zipf.sample(&mut rng)).collect();
        assert!(draws.iter().all(|&d| d < 100));
        let first = draws.iter().filter(|&&d| d == 0).count();
        let tenth = draws.iter().filter(|&&d| d == 9).count();
        // P(0) / P(9) = 10 under s = 1; allow sampling noise.
        assert!(first > 6 * tenth && first < 14 * tenth, "rank 0: {first}, rank 9: {tenth}");
    }

    #[test]
    fn zero_requests_are_a_config_error() {
        let err = run_soak(&SoakOptions { requests: 0, ..SoakOptions::default() }).err();
        assert!(
            matches!(err, Some(HarnessError::Engine(Error::Config(ConfigError::Invalid { .. })))),
            "{err:?}"
        );
    }
}
