//! The engine's side of KV events: start the publisher with the scheduler's
//! event log, publish each step's events as one batch, and the block hashes a
//! frontend computes for a request.

use crate::Result;
use crate::backend::Backend;
use crate::canon::{FingerprintKey, Fingerprinter, ValidationPolicy};
use crate::error::ConfigError;
#[cfg(feature = "kv-events")]
pub(super) use crate::events::KvEventPublisher as Publisher;
use crate::events::{KvEventBatch, Medium, PublisherStats};
use crate::index::block_hash::FleetHasher;
use crate::preprocess::Preprocessor;
use crate::prompt::OmniTokens;
use crate::sched::Scheduler;

use super::{Engine, EngineConfig, Request};

/// Binds the publisher `config.kv_events` asks for and makes `sched` record
/// the events, hashed under the engine's fingerprint key.
pub(super) fn start(
    sched: Scheduler, config: &EngineConfig, backend: &str,
) -> Result<(Scheduler, Option<Publisher>)> {
    let Some(events) = &config.kv_events else { return Ok((sched, None)) };
    let publisher = Publisher::bind(events)?;
    let sched = sched.with_kv_events(FleetHasher::new(&config.fingerprint_key), Medium::of_backend(backend));
    Ok((sched, Some(publisher)))
}

/// The hashes an engine under fleet key `key` publishes for `request`'s full
/// blocks of `block_size` tokens, computed without any model: the frontend
/// side of a cache-aware router. `tokens` are the model's special ids (what
/// placeholders expand with). A `block_size` of 0 is a [`ConfigError`].
///
/// ```
/// use omniprefix::canon::FingerprintKey;
/// use omniprefix::engine::{Engine, EngineConfig, Request, request_block_hashes};
/// use omniprefix::events::KvEventsConfig;
/// use omniprefix::model::Config;
/// use omniprefix::sched::SchedulerConfig;
///
/// let key = FingerprintKey::fixed(5);
/// let events = KvEventsConfig { endpoint: "tcp://127.0.0.1:0".into(), ..Default::default() };
/// let config = EngineConfig { scheduler: SchedulerConfig { block_size: 4, ..Default::default() }, fingerprint_key: key.clone(), kv_events: Some(events), ..Default::default() };
/// let mut engine = Engine::random(Config::tiny_qwen3(32, 2, 4, 2, 600), 1, config)?;
/// engine.run(Request::text((0..10).collect()))?;
/// let frontend = request_block_hashes(&Request::text((0..10).collect()), &key, 4, engine.tokens())?;
/// assert_eq!(frontend.len(), 2); // the full blocks
/// let mut published = frontend.clone();
/// published.sort();
/// assert_eq!(engine.cached_block_hashes(), published);
/// # Ok::<(), omniprefix::Error>(())
/// ```
pub fn request_block_hashes(
    request: &Request<'_>, key: &FingerprintKey, block_size: usize, tokens: &OmniTokens,
) -> Result<Vec<u64>> {
    ConfigError::require_positive("block hashes", "block_size", block_size)?;
    // The policy decides the validation evidence only, never the fingerprint.
    let fingerprinter = Fingerprinter::new(key.clone(), 1, ValidationPolicy::Unvalidated)?;
    let prompt = Preprocessor::new(fingerprinter, tokens.clone()).canonicalise(
        request.tenant,
        &request.token_ids,
        request.placeholders,
        request.items.iter().map(|item| &item.spec),
    )?;
    Ok(FleetHasher::new(key).block_hashes(&prompt, block_size))
}

impl<B: Backend> Engine<B> {
    /// Hands the events the scheduler recorded since the last step to the
    /// publisher as one batch (never waits; a full queue drops and counts it).
    pub(super) fn publish_kv_events(&mut self) {
        // Taken even when nothing publishes them any more (after `close_kv_events`),
        // so they never pile up.
        let events = self.sched.take_kv_events();
        let Some(publisher) = &self.publisher else { return };
        if !events.is_empty() {
            let rank = self.config.kv_events.as_ref().and_then(|c| c.data_parallel_rank);
            publisher.publish(KvEventBatch::now(events, rank));
        }
    }

    /// Drops every cached block and publishes `AllBlocksCleared`; refused with
    /// `SchedError::CacheInUse`, nothing changed, while requests are pending.
    /// Returns the number of blocks freed (partly filled ones included, which
    /// are never published: a router hashes full blocks only).
    pub fn reset_cache(&mut self) -> Result<usize> {
        let freed = self.sched.reset_cache()?;
        self.publish_kv_events();
        Ok(freed)
    }

    /// The hashes of the published blocks the index holds, ascending (empty
    /// without `kv_events`): what a router following the events knows.
    pub fn cached_block_hashes(&self) -> Vec<u64> {
        self.sched.cached_block_hashes()
    }

    /// The publisher's counters, if events are published.
    pub fn kv_events_stats(&self) -> Option<PublisherStats> {
        self.publisher.as_ref().map(Publisher::stats)
    }

    /// Stops publishing: sends what is queued, keeps the sockets open for the
    /// configured linger (blocking this thread), closes them and returns the
    /// final counters (`None` without `kv_events`). Later events are dropped;
    /// [`cached_block_hashes`](Self::cached_block_hashes) still follows the index.
    pub fn close_kv_events(&mut self) -> Option<PublisherStats> {
        self.publisher.take().map(Publisher::close)
    }

    /// Tells routers that every block this engine published is gone
    /// (`AllBlocksCleared`), then stops publishing (see
    /// [`close_kv_events`](Self::close_kv_events)): what a served engine does
    /// when it dies, so no request is routed to it for a cache it lost. The
    /// scheduler is not consulted: after a panic its state is not trusted.
    pub fn withdraw_kv_events(&mut self) {
        if let Some(publisher) = self.publisher.take() {
            let rank = self.config.kv_events.as_ref().and_then(|c| c.data_parallel_rank);
            publisher.publish(KvEventBatch::now(vec![crate::events::KvEvent::AllBlocksCleared], rank));
            publisher.close();
        }
    }

    /// The PUB and replay endpoints as bound (ports resolved), if events are published.
    pub fn kv_events_endpoints(&self) -> Option<(&str, Option<&str>)> {
        self.publisher.as_ref().map(|p| (p.endpoint(), p.replay_endpoint()))
    }
}

/// Without the `kv-events` feature there is no publisher: a config that asks
/// for one is refused, so this type has no values.
#[cfg(not(feature = "kv-events"))]
#[derive(Debug)]
pub(super) enum Publisher {}

#[cfg(not(feature = "kv-events"))]
impl Publisher {
    fn bind(_: &crate::events::KvEventsConfig) -> Result<Self> {
        Err(crate::error::ConfigError::Invalid {
            component: "engine",
            field: "kv_events",
            expected: "none (omniprefix was built without the kv-events feature)".into(),
            found: "an endpoint".into(),
        }
        .into())
    }
    fn publish(&self, _: KvEventBatch) -> bool {
        match *self {}
    }
    fn stats(&self) -> PublisherStats {
        match *self {}
    }
    fn close(self) -> PublisherStats {
        match self {}
    }
    fn endpoint(&self) -> &str {
        match *self {}
    }
    fn replay_endpoint(&self) -> Option<&str> {
        match *self {}
    }
}
