//! `tier_restore`: what restoring a prefix from the disk tier costs against
//! recomputing it, per token, on the benchmark's model (issue 39's target:
//! restore ≤ 0.1 × recompute).
//!
//! Per run, on one engine with a tier in a private temp directory:
//! 1. **computed**: a new prefix + suffix, nothing of it cached;
//! 2. the engine spills its whole cache to the tier and waits for the writes
//!    ([`Engine::flush_tier`]), so the pool holds nothing;
//! 3. **restored**: the same prefix + a new suffix; the prefix's blocks come
//!    back from the tier (read, checked, copied into fresh pages);
//! 4. **pooled**: the same prefix + another suffix; the prefix is in the pool.
//!
//! Pooled is the baseline both others pay on top: recomputing costs
//! `computed − pooled` (TTFT), restoring what the restored run's scheduling
//! took over the pooled run's (the tier's lookups, reads, checks and page
//! copies all happen there; the forward passes of the two are the same work),
//! each over the tokens the tier gave back. The TTFT difference of the two is
//! reported too: it says the same, under the machine's noise. The tier's files were just written, so they are read
//! from the page cache (what the next request after an eviction sees), not
//! from a cold disk.

use omniprefix::backend::Backend;
use omniprefix::engine::{Output, Request, millis};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::{Bench, median};
use crate::error::Result;
use crate::scratch::private_temp_dir;

/// One JSON line of `bench ttft`: the tier's restore against recomputing.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TierRestoreReport {
    pub workload: String,
    pub backend: &'static str,
    /// Tokens of the prefix (the tier restores its full blocks).
    pub prefix: usize,
    pub suffix: usize,
    pub runs: usize,
    /// Median tokens the restored run took from the tier.
    pub restored_tokens: usize,
    /// Median TTFTs of the three prompts.
    pub ttft_computed_ms: f64,
    pub ttft_restored_ms: f64,
    pub ttft_pooled_ms: f64,
    /// Median of `(computed − pooled) / restored_tokens`: one token's prefill.
    pub recompute_ms_per_token: f64,
    /// Median of the restored run's scheduling time over the pooled run's, per
    /// restored token: one token's lookup, read, check and copy.
    pub restore_ms_per_token: f64,
    /// Median of `(restored − pooled) / restored_tokens` in TTFT: the same cost
    /// end to end, within the run-to-run noise of two prefills.
    pub restore_ttft_ms_per_token: f64,
    /// `restore_ms_per_token / recompute_ms_per_token` (target ≤ 0.1).
    pub restore_over_recompute: f64,
    /// Bytes of one block's file (KV of every layer and the captured rows).
    pub block_file_bytes: u64,
}

impl<B: Backend> Bench<B> {
    /// The three prompts of every run (see the module doc), `prefix + suffix` long.
    pub(super) fn tier_restore(&self, prefix: usize, suffix: usize) -> Result<TierRestoreReport> {
        let dir = private_temp_dir("omniprefix-bench-tier-")?;
        let mut engine = self.engine_on(true, self.options.capture(), prefix + suffix, Some(dir.path()))?;
        let mut rng = ChaCha8Rng::seed_from_u64(self.options.seed ^ 0x7137);
        let mut runs = Vec::new();
        for run in 0..self.options.warmup + self.options.runs.max(1) {
            let shared = self.text(&engine, &mut rng, prefix);
            let prompt = |rng: &mut ChaCha8Rng| {
                let mut ids = shared.clone();
                ids.extend(self.text(&engine, rng, suffix));
                Request::text(ids)
            };
            let (first, second, third) = (prompt(&mut rng), prompt(&mut rng), prompt(&mut rng));
            let computed = engine.run(first)?;
            engine.flush_tier()?;
            let hits_before = engine.tier_stats().map_or(0, |s| s.hit_tokens);
            let restored = engine.run(second)?;
            let hit = engine.tier_stats().map_or(0, |s| s.hit_tokens) - hits_before;
            let pooled = engine.run(third)?;
            if run >= self.options.warmup {
                runs.push(Run::of(&computed, &restored, &pooled, hit as usize));
            }
        }
        let block_file_bytes = engine.tier_block_file_bytes().unwrap_or(0);
        drop(engine); // spills into `dir` before it is removed
        Ok(report(self.backend.name(), prefix, suffix, runs, block_file_bytes))
    }
}

/// One run's three TTFTs, two scheduling times and the tokens restored.
struct Run {
    computed_ms: f64,
    restored_ms: f64,
    pooled_ms: f64,
    restored_schedule_ms: f64,
    pooled_schedule_ms: f64,
    restored_tokens: usize,
}

impl Run {
    fn of(computed: &Output, restored: &Output, pooled: &Output, restored_tokens: usize) -> Self {
        Run {
            computed_ms: millis(computed.timings.total),
            restored_ms: millis(restored.timings.total),
            pooled_ms: millis(pooled.timings.total),
            restored_schedule_ms: millis(restored.timings.schedule),
            pooled_schedule_ms: millis(pooled.timings.schedule),
            restored_tokens,
        }
    }

    /// Per restored token over the pooled run: (recompute, restore, restore in TTFT) ms.
    fn per_token(&self) -> (f64, f64, f64) {
        let n = self.restored_tokens.max(1) as f64;
        (
            (self.computed_ms - self.pooled_ms) / n,
            (self.restored_schedule_ms - self.pooled_schedule_ms) / n,
            (self.restored_ms - self.pooled_ms) / n,
        )
    }
}

fn report(
    backend: &'static str, prefix: usize, suffix: usize, runs: Vec<Run>, block_file_bytes: u64,
) -> TierRestoreReport {
    let med = |f: &dyn Fn(&Run) -> f64| median(runs.iter().map(f).collect());
    let recompute = med(&|r| r.per_token().0);
    let restore = med(&|r| r.per_token().1);
    TierRestoreReport {
        workload: "tier_restore".into(),
        backend,
        prefix,
        suffix,
        runs: runs.len(),
        restored_tokens: med(&|r| r.restored_tokens as f64).round() as usize,
        ttft_computed_ms: med(&|r| r.computed_ms),
        ttft_restored_ms: med(&|r| r.restored_ms),
        ttft_pooled_ms: med(&|r| r.pooled_ms),
        recompute_ms_per_token: recompute,
        restore_ms_per_token: restore,
        restore_ttft_ms_per_token: med(&|r| r.per_token().2),
        restore_over_recompute: restore / recompute,
        block_file_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run of 100 restored tokens over a pooled run of 10 ms (1 ms scheduling).
    fn run(computed_ms: f64, restored_ms: f64, restored_schedule_ms: f64) -> Run {
        Run {
            computed_ms,
            restored_ms,
            pooled_ms: 10.0,
            restored_schedule_ms,
            pooled_schedule_ms: 1.0,
            restored_tokens: 100,
        }
    }

    #[test]
    fn costs_are_per_restored_token_over_the_pooled_run() {
        let runs = vec![run(110.0, 12.0, 4.0), run(210.0, 14.0, 2.0), run(160.0, 13.0, 3.0)];
        let r = report("cpu", 100, 8, runs, 4096);
        assert_eq!((r.recompute_ms_per_token, r.restore_ms_per_token), (1.5, 0.02));
        assert_eq!(r.restore_ttft_ms_per_token, 0.03);
        assert!((r.restore_over_recompute - 0.02 / 1.5).abs() < 1e-12);
        assert_eq!((r.restored_tokens, r.ttft_pooled_ms, r.runs), (100, 10.0, 3));
    }
}
