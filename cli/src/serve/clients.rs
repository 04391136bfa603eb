//! `many_clients`: C conversations × R rounds, each its own tenant, run round
//! by round (every conversation's round r, closed loop, before any round r+1),
//! so all C are alive while the pool holds about a tenth of what they re-send.
//! The same requests run on four engines: the small pool alone, the same pool
//! over a disk tier in a fresh directory, a pool that holds everything (the
//! ceiling), and pool + tier dropped and rebuilt halfway on the same directory
//! and key (a restart). Each reports every round's hit rate and TTFT p50.

use std::path::Path;
use std::time::Duration;

use omniprefix::backend::Backend;
use omniprefix::engine::{EngineConfig, ServedEngine};
use omniprefix::model::Config;

use super::driver::{History, Serve, Stream};
use super::{Arrival, ClientsEngine, ClientsReport, RequestSample, RoundReport, ServeReport, ServeWorkload};
use crate::error::Result;
use crate::scratch::private_temp_dir;

/// The random model of a full `many_clients` run (hidden 256, 4 layers of 4
/// heads over 2 KV heads, 1024 ids; `bench ttft`'s M-RoPE, its head_dim being
/// the same): four engines × 64 conversations × 6 rounds run in minutes on two
/// cores, and a block still costs far more to recompute than to read back.
pub fn clients_model() -> Config {
    let bench = crate::ttft::bench_model();
    Config {
        intermediate_size: 768,
        mrope_section: bench.mrope_section,
        mrope_interleaved: bench.mrope_interleaved,
        ..Config::tiny_qwen3(256, 4, 4, 2, 1024)
    }
}

/// The pool sizes of a `many_clients` run, in blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pools {
    /// Every conversation's last round together.
    working_set: usize,
    /// `pool_share` of the working set, but never less than the requests in flight need.
    small: usize,
    /// The working set and the requests in flight: nothing is ever evicted.
    unbounded: usize,
}

impl Pools {
    /// Sizes for conversations whose last rounds take `blocks` each, with
    /// `in_flight` requests at once, the small pool holding `share` of the total.
    fn new(blocks: &[usize], in_flight: usize, share: f64) -> Self {
        let working_set: usize = blocks.iter().sum();
        let longest = blocks.iter().copied().max().unwrap_or(0);
        // Each request in flight holds its whole prompt and reply (one more block
        // for a partial last one), plus a margin for the untimed warm-up.
        let floor = in_flight * (longest + 2) + 16;
        let small = ((working_set as f64 * share).ceil() as usize).max(floor);
        Pools { working_set, small, unbounded: working_set + floor }
    }
}

impl<B: Backend + 'static> Serve<'_, B> {
    /// Runs `streams` (the conversations) on the four engines, one report each.
    pub(super) fn many_clients(&self, streams: &[Stream]) -> Result<Vec<ServeReport>> {
        let o = self.options;
        let blocks = streams
            .iter()
            .map(|s| self.longest(s).map(|l| l.div_ceil(o.block_size)))
            .collect::<Result<Vec<_>>>()?;
        let pools = Pools::new(&blocks, o.client_concurrency.min(streams.len()), o.pool_share);
        ClientsEngine::ALL.iter().map(|&engine| self.clients_run(engine, streams, pools)).collect()
    }

    /// The engine settings of `engine`: its pool, and a tier in `dir` for the tier runs.
    fn clients_config(&self, engine: ClientsEngine, pools: Pools, dir: Option<&Path>) -> EngineConfig {
        let blocks = if engine == ClientsEngine::Unbounded { pools.unbounded } else { pools.small };
        EngineConfig { tier_dir: dir.map(Path::to_path_buf), ..self.config(blocks, true) }
    }

    /// Every round of `streams` on `engine`, each round's figures, and the run's totals.
    fn clients_run(&self, engine: ClientsEngine, streams: &[Stream], pools: Pools) -> Result<ServeReport> {
        let o = self.options;
        let arrival = Arrival::Concurrency(o.client_concurrency.max(1));
        let tiered = matches!(engine, ClientsEngine::PoolTier | ClientsEngine::Restart);
        let dir = match tiered {
            true => Some(private_temp_dir(&format!("omniprefix-many-clients-{}-", engine.name()))?),
            false => None,
        };
        let config = self.clients_config(engine, pools, dir.as_ref().map(tempfile::TempDir::path));
        let rounds = streams.iter().map(|s| s.turns.len()).max().unwrap_or(0);
        let restart_round = (engine == ClientsEngine::Restart).then_some(rounds / 2);
        let mut served = self.serve(config.clone())?;
        let mut history = vec![History::default(); streams.len()];
        let mut samples: Vec<RequestSample> = Vec::new();
        let mut reports = Vec::with_capacity(rounds);
        let (mut first, mut last, mut encoder_calls) = (None, None, 0);
        for round in 0..rounds {
            if restart_round == Some(round) {
                // Dropping the served engine spills its pool to the tier and waits for the writes.
                drop(served);
                served = self.serve(config.clone())?;
            }
            let before = tier_hit_tokens(&served)?;
            let driven = self.drive(&served, streams, arrival, round..round + 1, &mut history)?;
            let round_samples: Vec<RequestSample> = driven.samples.into_iter().map(|(_, s)| s).collect();
            let tier_hits = tier_hit_tokens(&served)?.saturating_sub(before);
            reports.push(RoundReport::new(round + 1, &round_samples, tier_hits));
            samples.extend(round_samples);
            first = first.or(Some(driven.start));
            last = Some(driven.end);
            encoder_calls += driven.encoder_calls;
        }
        let tier = served.stats()?.tier;
        let name = ServeWorkload::ManyClients.to_string();
        let duration = match (first, last) {
            (Some(first), Some(last)) => last.saturating_duration_since(first),
            _ => Duration::ZERO,
        };
        let facts = self.facts(&name, &served, true, arrival, duration, encoder_calls);
        let many_clients = ClientsReport {
            engine,
            conversations: streams.len(),
            concurrency: o.client_concurrency.max(1),
            pool_blocks: served.config().scheduler.num_blocks,
            working_set_blocks: pools.working_set,
            restart_round: restart_round.map(|r| r + 1),
            tier,
            rounds: reports,
        };
        Ok(ServeReport { many_clients: Some(many_clients), ..ServeReport::new(facts, &samples) })
    }
}

/// Prompt tokens `served` has loaded from its tier so far (0 without one).
fn tier_hit_tokens(served: &ServedEngine) -> Result<u64> {
    Ok(served.stats()?.tier.map_or(0, |t| t.hit_tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_small_pool_is_a_share_of_the_working_set_but_fits_the_requests_in_flight() {
        let p = Pools::new(&[100; 64], 4, 0.1);
        assert_eq!((p.working_set, p.small, p.unbounded), (6400, 640, 6400 + 424));
        // Few conversations: the requests in flight need more than the share.
        let p = Pools::new(&[10; 8], 2, 0.1);
        assert_eq!((p.small, p.unbounded), (40, 80 + 40));
    }
}
