//! `omniprefix bench serve`: `vllm bench serve` on the engine's own generation
//! API. Requests arrive by a seeded Poisson process or a fixed concurrency;
//! the engine steps on its own thread ([`omniprefix::engine::ServedEngine`])
//! and each request is submitted and read by a caller thread of its own, whose
//! items go through a stand-in encoder that sleeps `--encoder-ms` per
//! encoder-cache miss. Each run reports TTFT and ITL percentiles, output
//! tokens/s, the cache hit rate and the encoder calls, with caching on and off
//! on the same model, seed and requests.
//!
//! Workloads: vLLM's `prefix_repetition` dataset and the 4-round multimodal
//! conversation of `fixtures/scenarios.json`, whose every round re-sends the
//! earlier prompts and the engine's own earlier replies (so a conversation's
//! rounds run in order; several conversations run at once). And `many_clients`
//! (named only, not in `all`): many conversations over a pool a tenth of their
//! size, on the pool alone, over a disk tier, unbounded, and across a restart
//! (see `clients.rs`).

mod arrival;
mod clients;
mod driver;
mod stats;

use std::fmt;

use clap::ValueEnum;

pub use arrival::{Arrival, Dispatcher, Due, poisson_offsets};
pub use clients::clients_model;
pub use driver::run_serve;
pub use stats::{
    ClientsEngine, ClientsReport, RequestSample, RoundReport, RunFacts, ServeReport, itl_trace, percentile,
};

use omniprefix::backend::Dtype;
use omniprefix::canon::FingerprintKey;
use omniprefix::events::KvEventsConfig;

use crate::error::Result;
use crate::scenarios::Scenarios;
use crate::workloads::write_name;

/// The workloads of `bench serve` (`--workload`, see [`crate::workloads::select`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum ServeWorkload {
    /// Random prompts over a few shared random prefixes (vLLM's `prefix_repetition`).
    PrefixRepetition,
    /// 4-round image/audio/video conversations re-sending their history and replies.
    MultiRound,
    /// Many conversations × rounds over a pool a tenth of their size: pool alone,
    /// pool + disk tier, unbounded pool, and pool + tier across a restart.
    ManyClients,
}

impl ServeWorkload {
    /// What `--workload all` runs: the workloads that compare caching on and
    /// off. `many_clients` runs four engines of its own and only when named.
    pub const ALL: [ServeWorkload; 2] = [ServeWorkload::PrefixRepetition, ServeWorkload::MultiRound];
}

impl fmt::Display for ServeWorkload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_name(self, f)
    }
}

/// The sizes of a `bench serve` run.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeOptions {
    pub workloads: Vec<ServeWorkload>,
    /// Every arrival setting is run with caching on and off.
    pub arrivals: Vec<Arrival>,
    /// `prefix_repetition`: tokens of each shared prefix and of each random suffix.
    pub prefix_len: usize,
    pub suffix_len: usize,
    pub num_prefixes: usize,
    /// `prefix_repetition`: prompts per prefix (vLLM's `num_prompts / num_prefixes`).
    pub prompts_per_prefix: usize,
    /// Tokens generated per request (`ignore_eos`: exactly this many).
    pub output_len: usize,
    /// `multi_round`: conversations (each its own tenant, 4 rounds).
    pub conversations: usize,
    /// `multi_round`, `many_clients`: divides the image/video grid sides (audio by the square); 1 = real token counts.
    pub mm_scale: u32,
    /// `many_clients`: conversations (each its own tenant), and rounds of each.
    pub clients: usize,
    pub client_rounds: usize,
    /// `many_clients`: requests in flight within a round (closed loop).
    pub client_concurrency: usize,
    /// `many_clients`: the share of the working set the small pool holds.
    pub pool_share: f64,
    pub block_size: usize,
    /// Sequences per scheduler step (bounds the decode batch).
    pub max_seqs: usize,
    /// New tokens per scheduler step (the chunked-prefill budget).
    pub max_tokens_per_step: usize,
    /// Prefill tokens a step beside decodes may add; `None`: the engine's default.
    pub prefill_cap: Option<usize>,
    /// The element type of the K/V pages.
    pub kv_dtype: Dtype,
    /// Seed of the prompts, media, arrivals and sampling.
    pub seed: u64,
    /// The fleet key of fingerprints and published block hashes.
    pub fingerprint_key: FingerprintKey,
    /// Publish each engine's KV events here (engines run one after another).
    pub kv_events: Option<KvEventsConfig>,
    /// What the stand-in encoder sleeps per item it encodes (an encoder-cache
    /// miss), on the submitting thread; 0 = it returns the rows at once.
    pub encoder_ms: u64,
    /// Report every inter-token gap with its time (`itl_trace`).
    pub trace: bool,
}

impl ServeOptions {
    /// The `vllm bench serve` sizes: `prefix_repetition` 10 prefixes of 256 +
    /// 256-token suffixes, 128 output tokens (fixtures/scenarios.json), 2 prompts
    /// per prefix; 4 conversations; concurrency 1 and 8.
    pub fn full() -> Result<Self> {
        let p = Scenarios::load()?.prefix_repetition;
        Ok(ServeOptions {
            workloads: ServeWorkload::ALL.to_vec(),
            arrivals: vec![Arrival::Concurrency(1), Arrival::Concurrency(8)],
            prefix_len: p.prefix_len,
            suffix_len: p.suffix_len,
            num_prefixes: p.num_prefixes,
            prompts_per_prefix: 2,
            output_len: p.output_len,
            conversations: 4,
            mm_scale: 4,
            clients: 64,
            client_rounds: 6,
            client_concurrency: 4,
            pool_share: 0.1,
            block_size: omniprefix::kv::DEFAULT_BLOCK_SIZE,
            max_seqs: 16,
            max_tokens_per_step: 2048,
            prefill_cap: None,
            kv_dtype: Dtype::F32,
            seed: 0,
            fingerprint_key: FingerprintKey::random(),
            kv_events: None,
            encoder_ms: 0,
            trace: false,
        })
    }

    /// The sizes of a `many_clients` run alone: [`full`](Self::full) (64
    /// conversations × 6 rounds) with 16-token replies, so four engines × 384
    /// requests run in minutes; or [`quick`](Self::quick) (8 × 4).
    pub fn many_clients(quick: bool) -> Result<Self> {
        let base = if quick { Self::quick()? } else { Self::full()? };
        let output_len = if quick { base.output_len } else { 16 };
        Ok(ServeOptions { workloads: vec![ServeWorkload::ManyClients], output_len, ..base })
    }

    /// A CI-sized run: short prompts and replies, few requests (enough that some
    /// arrive after their prefix was cached at concurrency 4), concurrency 1 and 4;
    /// the engine's settings as in [`full`](Self::full).
    pub fn quick() -> Result<Self> {
        Ok(ServeOptions {
            arrivals: vec![Arrival::Concurrency(1), Arrival::Concurrency(4)],
            prefix_len: 32,
            suffix_len: 16,
            num_prefixes: 2,
            prompts_per_prefix: 3,
            output_len: 8,
            conversations: 2,
            mm_scale: 8,
            clients: 8,
            client_rounds: 4,
            client_concurrency: 2,
            ..Self::full()?
        })
    }
}
