//! What a KV-event publisher is configured by and what it counts: plain types,
//! built with or without the `kv-events` feature (which brings the ZMQ
//! publisher itself), so an engine config can name them either way.

use std::time::Duration;

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
