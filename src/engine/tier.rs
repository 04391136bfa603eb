//! The engine's side of the disk tier: it opens the tier when the engine is
//! built, and moves bytes between the pages and the tier around each batch
//! (the scheduler decides which; the runner never sees the tier).

use std::sync::Arc;

use prometheus_client::metrics::histogram::Histogram;

use super::{Engine, EngineConfig};
use crate::Result;
use crate::backend::{Backend, PagesSpec, no_tier};
use crate::kv::ItemCapture;
use crate::model::CaptureSpec;
use crate::sched::TierWork;
use crate::tier::{BlockLayout, Identity, ModelId, TierStats, TierStore, TierWriter, key_fingerprint};

/// Blocks the writer may hold before it drops: a bounded queue, so a slow disk
/// costs tier hits, never a step's time or unbounded memory.
const WRITE_QUEUE_BLOCKS: usize = 256;

/// Load-latency buckets (seconds): one block's read and check, from a page-cache
/// hit (tens of µs) to a cold disk.
const LOAD_BUCKETS: [f64; 12] =
    [0.00001, 0.00003, 0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0];

/// Counters of an engine's tier: the store's (files) and the scheduler's (tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierEngineStats {
    /// Files: hits, misses, errors, writes, drops, evictions, bytes on disk.
    #[serde(flatten)]
    pub files: TierStats,
    /// Prompt tokens past the pool's match looked up in the tier.
    pub query_tokens: u64,
    /// Of those, tokens loaded from the tier.
    pub hit_tokens: u64,
}

/// An engine's tier: the writer (shared with the scheduler) and the load latencies.
#[derive(Debug)]
pub(super) struct EngineTier {
    pub(super) writer: Arc<TierWriter>,
    pub(super) load_seconds: Histogram,
}

/// Refuses what can be refused before anything loads: a tier on a backend that
/// cannot reach its pages, or a bound of 0 (the bound against one block is
/// checked when the layout is known, in [`open`]).
pub(super) fn precheck<B: Backend>(config: &EngineConfig, backend: &B) -> Result<()> {
    if config.tier_dir.is_none() {
        return Ok(());
    }
    if !backend.tier_capable() {
        return Err(no_tier(backend.name()));
    }
    if !config.cache {
        // With caching off every request is its own tenant: nothing written could be hit.
        return Err(crate::error::ConfigError::Invalid {
            component: "engine",
            field: "tier_dir",
            expected: "none with caching off".into(),
            found: "a tier".into(),
        }
        .into());
    }
    if config.tier_bytes == 0 {
        return Err(crate::error::ConfigError::Invalid {
            component: "engine",
            field: "tier_bytes",
            expected: "at least one block's file".into(),
            found: "0".into(),
        }
        .into());
    }
    Ok(())
}

/// The tier `config` asks for, over pages of `spec`, for blocks of `model`
/// captured at `capture` (and at item positions into `items`); `None` without a `tier_dir`.
pub(super) fn open<B: Backend>(
    config: &EngineConfig, backend: &B, model: ModelId, capture: &CaptureSpec, items: Option<&ItemCapture>,
    spec: &PagesSpec,
) -> Result<Option<EngineTier>> {
    precheck(config, backend)?;
    // Which points are captured is part of what a block's rows are.
    let points = format!("{:?} items {:?}", capture.points(), items.map(|i| i.point()));
    let model = ModelId::of([&model.0[..], points.as_bytes()]);
    let writer = start_writer(config, model, spec, items.map_or(0, |i| i.width()))?;
    Ok(writer.map(|writer| EngineTier { writer, load_seconds: Histogram::new(LOAD_BUCKETS) }))
}

/// The talker's tier in the same directory (`None` without a `tier_dir`): its
/// files carry the talker's identity with the `thinker`'s (whose embeddings
/// and accept rows are its input) and the talker pages' layout `spec`.
pub(super) fn open_talker(
    config: &EngineConfig, thinker: ModelId, talker: ModelId, spec: &PagesSpec,
) -> Result<Option<Arc<TierWriter>>> {
    start_writer(config, ModelId::of([&thinker.0[..], &talker.0[..], b"talker"]), spec, 0)
}

/// A writer over `config`'s tier directory for blocks of `model` laid out as
/// `spec`, with item rows of `item_width` floats after the pages (0 for none).
fn start_writer(
    config: &EngineConfig, model: ModelId, spec: &PagesSpec, item_width: usize,
) -> Result<Option<Arc<TierWriter>>> {
    let Some(dir) = &config.tier_dir else { return Ok(None) };
    let layout = BlockLayout::of(spec, item_width);
    let identity = Identity { model, key: key_fingerprint(&config.fingerprint_key), layout };
    let store = TierStore::open(dir, config.tier_bytes, identity)?;
    Ok(Some(Arc::new(TierWriter::start(store, WRITE_QUEUE_BLOCKS)?)))
}

/// Copies `saves` out of `pages` (and `items`) to `writer` (waiting for room
/// in its queue when `spill`, else dropping when it is full), then `loads`
/// into them, each load's read time into `load_seconds`: one home for the
/// thinker's pages and the talker's.
pub(super) fn move_blocks<B: Backend>(
    backend: &B, pages: &mut B::Pages, mut items: Option<&mut ItemCapture>, writer: &TierWriter,
    work: TierWork, spill: bool, load_seconds: Option<&Histogram>,
) -> Result<()> {
    let TierWork { saves, loads, load_times } = work;
    let page_bytes = writer.store().identity().layout.payload_bytes();
    for (block, hash) in saves {
        let mut bytes = Vec::with_capacity(page_bytes);
        backend.export_block(pages, block, &mut bytes)?;
        if let Some(items) = items.as_deref() {
            items.export_block(block, &mut bytes);
        }
        if spill {
            writer.submit_waiting(hash, bytes.into());
        } else {
            // A full queue drops the block (counted): recomputed if asked for again.
            writer.submit(hash, bytes.into());
        }
    }
    for (block, loaded) in loads {
        let (page, tail) = loaded.payload().split_at_checked(page_bytes).unwrap_or((loaded.payload(), &[]));
        if let Some(items) = items.as_deref_mut() {
            items.import_block(block, tail)?;
        }
        backend.import_block(pages, block, page)?;
    }
    if let Some(h) = load_seconds {
        load_times.iter().for_each(|t| h.observe(t.as_secs_f64()));
    }
    Ok(())
}

impl<B: Backend> Engine<B> {
    /// Runs the scheduler's tier work on the pages: evicted blocks out to the
    /// writer first (their pages may be what a load or this batch writes next),
    /// then loads in. Called after each `schedule`, before the batch runs; a
    /// full write queue drops a block rather than delay the step.
    pub(super) fn run_tier_work(&mut self) -> Result<()> {
        self.move_tier_blocks(false)
    }

    /// [`run_tier_work`](Self::run_tier_work), waiting for room in the write
    /// queue instead of dropping when `spill` (no step waits then).
    fn move_tier_blocks(&mut self, spill: bool) -> Result<()> {
        let Some(tier) = &self.tier else { return Ok(()) };
        let work = self.sched.take_tier_work();
        move_blocks(
            self.runner.backend(),
            &mut self.pages,
            self.item_capture.as_mut(),
            &tier.writer,
            work,
            spill,
            Some(&tier.load_seconds),
        )
    }

    /// Writes every cached block no request reads to the tier and waits until
    /// the writer is done: what a drop does, so the next engine on this
    /// `tier_dir` (a restart) finds the whole cache. The blocks leave the pool.
    /// Returns how many were spilled (0 without a tier).
    pub fn flush_tier(&mut self) -> Result<usize> {
        if self.tier.is_none() {
            return Ok(0);
        }
        let spilled = self.sched.evict(usize::MAX)?;
        // Every block reaches the tier: a spill has no step to keep on time.
        self.move_tier_blocks(true)?;
        self.publish_kv_events();
        if let Some(tier) = &self.tier {
            tier.writer.flush();
        }
        // The talker's cache too, into its own files.
        if let Some(talkers) = self.talkers.as_mut() {
            talkers.spill_to_tier()?;
        }
        Ok(spilled)
    }

    /// Bytes of one block's file in the tier (`None` without a tier): what a
    /// restored block reads.
    pub fn tier_block_file_bytes(&self) -> Option<u64> {
        Some(self.tier.as_ref()?.writer.store().identity().layout.file_bytes())
    }

    /// The tier's counters (`None` without a tier): files of the thinker's and
    /// the talker's blocks, tokens of the thinker's (the talker's rows are in
    /// its cache's stats, `tier_hit_rows`).
    pub fn tier_stats(&self) -> Option<TierEngineStats> {
        let tier = self.tier.as_ref()?;
        let tokens = self.sched.tier_tokens().unwrap_or_default();
        let mut files = tier.writer.stats();
        if let Some(talker) = self.talkers.as_ref().and_then(|t| t.tier_stats()) {
            files = files.merged(talker);
        }
        Some(TierEngineStats { files, query_tokens: tokens.query_tokens, hit_tokens: tokens.hit_tokens })
    }
}

impl<B: Backend> Drop for Engine<B> {
    /// Spills the cache to the tier and flushes it (nothing to do without one).
    fn drop(&mut self) {
        let _ = self.flush_tier();
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::canon::FingerprintKey;
    use crate::engine::{Output, Request};
    use crate::error::ConfigError;
    use crate::model::Config;
    use crate::sample::SamplingParams;
    use crate::sched::SchedulerConfig;
    use crate::tier::scratch::Scratch;

    fn model() -> Config {
        Config::tiny_qwen3(32, 2, 4, 2, 600)
    }

    /// A pool of 10 blocks of 4: two 20-token prompts do not both stay cached.
    fn config(tier_dir: Option<PathBuf>) -> EngineConfig {
        EngineConfig {
            scheduler: SchedulerConfig { block_size: 4, num_blocks: 10, ..Default::default() },
            fingerprint_key: FingerprintKey::fixed(3),
            tier_dir,
            tier_bytes: 1 << 20,
            ..Default::default()
        }
    }

    fn request(first: u32) -> Request<'static> {
        prompt(first, 20)
    }

    fn prompt(first: u32, len: u32) -> Request<'static> {
        Request::text((first..first + len).collect()).generate(SamplingParams::greedy(3))
    }

    /// Tokens equal, every hidden row within float tolerance (chunkings differ).
    fn assert_same(got: &Output, want: &Output) {
        assert_eq!(got.tokens, want.tokens);
        assert_eq!(got.hidden.len(), want.hidden.len());
        for ((name, a), (_, b)) in got.hidden.iter().zip(&want.hidden) {
            assert_eq!(a.dim(), b.dim(), "{name}");
            let diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            assert!(diff < 1e-4, "{name}: rows differ by {diff}");
        }
    }

    fn cache_off(first: u32) -> Output {
        let mut engine = Engine::random(model(), 5, EngineConfig { cache: false, ..config(None) }).unwrap();
        engine.run(request(first)).unwrap()
    }

    #[test]
    fn an_evicted_prefix_comes_back_from_the_tier_as_a_cache_off_run() {
        let dir = Scratch::new("evicted");
        let mut engine = Engine::random(model(), 5, config(Some(dir.0.clone()))).unwrap();
        let first = engine.run(request(0)).unwrap();
        // Another conversation takes the whole pool: the first one's blocks are evicted to the tier.
        engine.run(prompt(100, 37)).unwrap();
        assert!(engine.stats().sched.evicted_blocks > 0);
        engine.tier.as_ref().unwrap().writer.flush();
        let again = engine.run(request(0)).unwrap();
        let stats = engine.tier_stats().unwrap();
        assert_eq!(stats.hit_tokens, 20, "{stats:?}");
        assert_eq!(again.num_cached_tokens, 19, "every full block, the last token recomputed");
        assert_eq!(stats.files.errors, 0);
        let want = cache_off(0);
        assert_same(&first, &want);
        assert_same(&again, &want);
        engine.validate().unwrap();
        let metrics = engine.metrics().unwrap();
        assert!(metrics.contains(&format!("omniprefix_tier_hits_total {}\n", stats.hit_tokens)), "{metrics}");
        assert!(metrics.contains("omniprefix_tier_load_seconds_count"));
        assert!(metrics.contains("omniprefix_tier_write_drops_total 0\n"));
    }

    #[test]
    fn files_that_fail_their_check_after_the_lookup_are_computed_instead() {
        let dir = Scratch::new("late-corrupt");
        let mut engine = Engine::random(model(), 5, config(Some(dir.0.clone()))).unwrap();
        engine.run(request(0)).unwrap();
        engine.flush_tier().unwrap();
        // Every file is found by name (the lookup), then fails its checksum (the read).
        let files: Vec<PathBuf> = std::fs::read_dir(&dir.0)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "blk"))
            .collect();
        assert!(files.len() >= 5);
        for path in &files {
            let mut bytes = std::fs::read(path).unwrap();
            let last = bytes.len() - 1;
            bytes[last] ^= 1;
            std::fs::write(path, bytes).unwrap();
        }
        let out = engine.run(request(0)).unwrap();
        assert_eq!(out.num_cached_tokens, 0);
        assert_same(&out, &cache_off(0));
        let stats = engine.tier_stats().unwrap();
        assert_eq!((stats.hit_tokens, stats.files.errors), (0, 1), "the first bad file ends the run");
        engine.validate().unwrap();
    }

    /// A spill holds more blocks than the write queue: it waits for room, so
    /// the next engine on the directory finds every block.
    #[test]
    fn a_spill_larger_than_the_write_queue_drops_nothing() {
        let dir = Scratch::new("spill-all");
        let mut config = config(Some(dir.0.clone()));
        config.scheduler.num_blocks = 300;
        config.tier_bytes = 1 << 30;
        let mut engine = Engine::random(model(), 5, config).unwrap();
        let ids: Vec<u32> = (0..1101).map(|i| i % 500).collect();
        engine.run(Request::text(ids)).unwrap();
        // Another holder of the directory's lock stalls the writer while the spill fills its queue.
        let other = std::fs::File::options().read(true).write(true).open(dir.0.join(".lock")).unwrap();
        other.lock().unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            other.unlock().unwrap();
        });
        let spilled = engine.flush_tier().unwrap();
        release.join().unwrap();
        assert!(spilled > WRITE_QUEUE_BLOCKS, "{spilled} blocks spilled");
        let stats = engine.tier_stats().unwrap().files;
        // Every full block (the last, partial one is not published).
        assert_eq!((stats.write_drops, stats.written), (0, 1101 / 4));
    }

    #[test]
    fn a_restart_on_the_same_directory_and_key_hits_the_tier() {
        let dir = Scratch::new("restart");
        let mut engine = Engine::random(model(), 5, config(Some(dir.0.clone()))).unwrap();
        engine.run(request(0)).unwrap();
        drop(engine); // spills the cache and flushes
        let mut restarted = Engine::random(model(), 5, config(Some(dir.0.clone()))).unwrap();
        let out = restarted.run(request(0)).unwrap();
        assert_eq!(out.num_cached_tokens, 19, "every full block but the last token's");
        assert_same(&out, &cache_off(0));
        // Another key (or model) finds nothing there.
        let other_key =
            EngineConfig { fingerprint_key: FingerprintKey::fixed(4), ..config(Some(dir.0.clone())) };
        let mut stranger = Engine::random(model(), 5, other_key).unwrap();
        assert_eq!(stranger.run(request(0)).unwrap().num_cached_tokens, 0);
        let mut other_model = Engine::random(model(), 6, config(Some(dir.0.clone()))).unwrap();
        assert_eq!(other_model.run(request(0)).unwrap().num_cached_tokens, 0);
    }

    #[test]
    fn a_served_engine_spills_to_the_tier_when_it_stops() {
        let dir = Scratch::new("served");
        let engine = Engine::random(model(), 5, config(Some(dir.0.clone()))).unwrap();
        let served = engine.serve(crate::engine::ServedOptions::default()).unwrap();
        served.submit(request(0)).unwrap().wait().unwrap();
        drop(served); // the serving thread drops the engine: spill and flush
        let mut restarted = Engine::random(model(), 5, config(Some(dir.0.clone()))).unwrap();
        let out = restarted.run(request(0)).unwrap();
        assert_eq!(out.num_cached_tokens, 19);
        assert_same(&out, &cache_off(0));
    }

    #[test]
    fn bad_tier_settings_are_config_errors_naming_the_field() {
        let dir = Scratch::new("bad");
        let field = |config: EngineConfig| match Engine::random(model(), 5, config) {
            Err(crate::Error::Config(ConfigError::Invalid { field, .. })) => field,
            Err(e) => panic!("expected a config error, got {e}"),
            Ok(_) => panic!("expected a config error, got an engine"),
        };
        assert_eq!(field(EngineConfig { tier_bytes: 0, ..config(Some(dir.0.clone())) }), "tier_bytes");
        assert_eq!(field(EngineConfig { tier_bytes: 100, ..config(Some(dir.0.clone())) }), "tier_bytes");
        std::fs::create_dir_all(&dir.0).unwrap();
        let file = dir.0.join("file");
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(field(config(Some(file))), "tier_dir");
        assert_eq!(field(EngineConfig { cache: false, ..config(Some(dir.0.join("t"))) }), "tier_dir");
    }
}
