//! What a KV-event publisher is configured by and what it counts: plain types,
//! built with or without the `kv-events` feature (which brings the ZMQ
//! publisher itself), so an engine config can name them either way.

use std::time::Duration;

use crate::error::ConfigError;

/// Where and how KV events are published (vLLM's `KVEventsConfig`).
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventsConfig {
    /// The PUB endpoint, e.g. `tcp://127.0.0.1:5557` (`*` binds every interface;
    /// port 0 picks a free one, see `KvEventPublisher::endpoint`).
    pub endpoint: String,
    /// The ROUTER replay endpoint; `None` = no replay.
    pub replay_endpoint: Option<String>,
    /// The first frame of every published message (default empty).
    pub topic: String,
    /// Batches kept for replay (default 10 000, vLLM's `buffer_steps`).
    pub buffer_steps: usize,
    /// Batches waiting for the publisher thread before new ones are dropped (default 100 000).
    pub max_queue_size: usize,
    /// The `data_parallel_rank` of every batch (default none).
    pub data_parallel_rank: Option<u32>,
    /// How long the sockets stay open after the publisher closes, for late
    /// subscribers and replay (default 0; at least 50 ms are always given to
    /// flush the last batches). Closing (or dropping the engine) waits it out.
    pub linger: Duration,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            endpoint: "tcp://127.0.0.1:5557".into(),
            replay_endpoint: None,
            topic: String::new(),
            buffer_steps: 10_000,
            max_queue_size: 100_000,
            data_parallel_rank: None,
            linger: Duration::ZERO,
        }
    }
}

/// A publisher's settings as an edge takes them (the CLI's `--kv-events`,
/// `--kv-replay`, `--linger-s`; Python's `kv_events`, `kv_replay`, `kv_topic`,
/// `kv_buffer_steps`, `kv_linger_s`), each `None` where not given: the one place
/// that decides what they mean together.
///
/// ```
/// use omniprefix::events::KvEventsOptions;
///
/// let none = KvEventsOptions::default().config()?;
/// assert!(none.is_none());
/// let options = KvEventsOptions { endpoint: Some("tcp://127.0.0.1:0".into()), linger_s: Some(1.5), ..Default::default() };
/// let config = options.config()?.expect("an endpoint was given");
/// assert_eq!((config.linger.as_millis(), config.buffer_steps), (1500, 10_000));
/// let replay_alone = KvEventsOptions { replay_endpoint: Some("tcp://127.0.0.1:0".into()), ..Default::default() };
/// assert!(replay_alone.config().is_err());
/// # Ok::<(), omniprefix::error::ConfigError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KvEventsOptions {
    /// [`KvEventsConfig::endpoint`]; without it there is no publisher.
    pub endpoint: Option<String>,
    pub replay_endpoint: Option<String>,
    pub topic: Option<String>,
    pub buffer_steps: Option<usize>,
    /// [`KvEventsConfig::linger`] in seconds, as given.
    pub linger_s: Option<f64>,
}

impl KvEventsOptions {
    /// The publisher's config, the defaults where not given (`None` without an
    /// endpoint). A setting given without an endpoint, or a linger that is not a
    /// finite number of seconds >= 0, is a [`ConfigError::Invalid`] naming the
    /// [`KvEventsConfig`] field.
    pub fn config(self) -> Result<Option<KvEventsConfig>, ConfigError> {
        let invalid = |field, expected: &str, found: String| ConfigError::Invalid {
            component: "kv events",
            field,
            expected: expected.into(),
            found,
        };
        let Some(endpoint) = self.endpoint else {
            let given = [
                ("replay_endpoint", self.replay_endpoint.is_some()),
                ("topic", self.topic.is_some()),
                ("buffer_steps", self.buffer_steps.is_some()),
                ("linger", self.linger_s.is_some()),
            ];
            return match given.into_iter().find(|(_, set)| *set) {
                Some((field, _)) => {
                    Err(invalid(field, "given with the PUB endpoint", "no PUB endpoint".into()))
                }
                None => Ok(None),
            };
        };
        let defaults = KvEventsConfig::default();
        let linger = match self.linger_s {
            Some(s) => Duration::try_from_secs_f64(s)
                .map_err(|_| invalid("linger", "a finite number of seconds >= 0", s.to_string()))?,
            None => defaults.linger,
        };
        Ok(Some(KvEventsConfig {
            endpoint,
            replay_endpoint: self.replay_endpoint,
            topic: self.topic.unwrap_or(defaults.topic),
            buffer_steps: self.buffer_steps.unwrap_or(defaults.buffer_steps),
            linger,
            ..defaults
        }))
    }
}

/// Counters of a publisher.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PublisherStats {
    /// Batches handed to the publisher.
    pub batches: u64,
    /// Of those, batches sent on the PUB socket.
    pub published: u64,
    /// Batches dropped: the queue was full (the scheduler never waits) or the
    /// PUB socket refused them. `batches = published + dropped` once closed.
    pub dropped: u64,
    /// Replay requests answered.
    pub replays: u64,
    /// Replay requests ignored because they were malformed.
    pub malformed_replays: u64,
}
