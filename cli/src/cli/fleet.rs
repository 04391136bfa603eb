//! `--fingerprint-key`, `--kv-events`, `--kv-replay` and `--linger-s`: what
//! `hidden`, `generate`, `bench soak` and `bench serve` share to join a fleet
//! behind a cache-aware router.

use clap::Args;

use omniprefix::canon::FingerprintKey;
use omniprefix::engine::EngineConfig;
use omniprefix::events::{KvEventsConfig, KvEventsOptions, PublisherStats};

use crate::error::Result;

/// The fleet key and the KV-event endpoints.
#[derive(Debug, Clone, Default, Args)]
pub struct FleetArgs {
    /// The fleet key: 64 hex digits that every replica and frontend shares. Item
    /// fingerprints and block hashes are keyed by it. Default: a random key per run.
    #[arg(long, value_name = "HEX")]
    pub fingerprint_key: Option<String>,
    /// Publish KV events (vLLM's msgpack `KVEventBatch`) on this ZMQ PUB
    /// endpoint, e.g. `tcp://127.0.0.1:5557` (`*` for every interface).
    #[arg(long, value_name = "ENDPOINT")]
    pub kv_events: Option<String>,
    /// Answer replay requests (vLLM's protocol) on this ZMQ ROUTER endpoint.
    #[arg(long, value_name = "ENDPOINT", requires = "kv_events")]
    pub kv_replay: Option<String>,
    /// Seconds the event sockets stay open after the work ends, for late subscribers.
    #[arg(long, value_name = "S", default_value_t = 0.0, requires = "kv_events")]
    pub linger_s: f64,
}

impl FleetArgs {
    /// The fleet key given, or a fresh random one.
    pub fn key(&self) -> Result<FingerprintKey> {
        match &self.fingerprint_key {
            Some(hex) => Ok(FingerprintKey::from_hex(hex)?),
            None => Ok(FingerprintKey::random()),
        }
    }

    /// The publisher's settings, if `--kv-events` was given.
    pub fn kv_events(&self) -> Result<Option<KvEventsConfig>> {
        let options = KvEventsOptions {
            endpoint: self.kv_events.clone(),
            replay_endpoint: self.kv_replay.clone(),
            // `--linger-s` has a default, so it counts as given only beside `--kv-events`.
            linger_s: self.kv_events.as_ref().map(|_| self.linger_s),
            ..Default::default()
        };
        Ok(options.config()?)
    }

    /// Sets the engine's fleet key and KV events from these arguments.
    pub fn apply(&self, config: &mut EngineConfig) -> Result<()> {
        config.fingerprint_key = self.key()?;
        config.kv_events = self.kv_events()?;
        Ok(())
    }
}

/// The line that says where the KV-event sockets listen, ports resolved (so
/// `tcp://127.0.0.1:0` picks a free one): `kv events: publishing on ENDPOINT`,
/// then `, replay on ENDPOINT` with a replay socket.
///
/// ```
/// use omniprefix_cli::cli::fleet::bound_line;
/// assert_eq!(bound_line("tcp://127.0.0.1:5557", None), "kv events: publishing on tcp://127.0.0.1:5557");
/// assert_eq!(bound_line("tcp://127.0.0.1:5557", Some("tcp://127.0.0.1:5558")),
///            "kv events: publishing on tcp://127.0.0.1:5557, replay on tcp://127.0.0.1:5558");
/// ```
pub fn bound_line(endpoint: &str, replay: Option<&str>) -> String {
    let replay = replay.map(|r| format!(", replay on {r}")).unwrap_or_default();
    format!("kv events: publishing on {endpoint}{replay}")
}

/// Prints [`bound_line`] on stderr as soon as the sockets are bound, before
/// any work, so a subscriber started beside the run can read it and connect
/// (stdout keeps the command's report alone, JSON included).
pub fn announce(endpoint: &str, replay: Option<&str>) {
    eprintln!("{}", bound_line(endpoint, replay));
}

/// One line on what the publisher did: batches, drops, replays.
pub fn summary(stats: &PublisherStats) -> String {
    format!(
        "kv events: {} batches published, {} dropped, {} replays ({} malformed)",
        stats.published, stats.dropped, stats.replays, stats.malformed_replays
    )
}
