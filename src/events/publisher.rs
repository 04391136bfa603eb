//! The ZMQ transport of KV events, as vLLM's `ZmqEventPublisher`.
//!
//! * PUB socket: each batch goes out as the frames `(topic, seq as u64
//!   big-endian, payload)`; `seq` counts batches from 0.
//! * ROUTER replay socket: a DEALER sends `(b"", start seq as u64 big-endian)`
//!   and gets `(b"", topic, seq, payload)` for every buffered batch from that
//!   seq on, then the end marker `(b"", b"", -1 as i64 big-endian, b"")`. A
//!   request of any other shape is ignored and counted.
//!
//! The scheduler's side never blocks: batches go through a bounded queue to the
//! publisher's own thread (a single-threaded tokio runtime, which the pure-Rust
//! `zeromq` crate needs); when the queue is full the batch is dropped and
//! counted. A subscriber that falls behind loses batches inside the PUB socket
//! (as with libzmq's high-water mark) and catches up through replay.

use std::collections::VecDeque;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use zeromq::{Endpoint, PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::{KvEventBatch, KvEventsConfig, PublisherStats};
use crate::error::{EventsError, Result};

/// The shortest linger: time for the PUB writer to flush what was queued.
const FLUSH: Duration = Duration::from_millis(50);

/// The end marker's seq: -1 as a big-endian i64.
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

#[derive(Debug, Default)]
struct Counters {
    batches: AtomicU64,
    published: AtomicU64,
    dropped: AtomicU64,
    replays: AtomicU64,
    malformed_replays: AtomicU64,
}

/// Publishes KV event batches on ZMQ (PUB + ROUTER replay) from its own thread.
///
/// ```
/// use omniprefix::events::{KvEvent, KvEventBatch, KvEventPublisher, KvEventsConfig};
/// let config = KvEventsConfig { endpoint: "tcp://127.0.0.1:0".into(), ..Default::default() };
/// let publisher = KvEventPublisher::bind(&config)?;
/// assert!(publisher.endpoint().starts_with("tcp://127.0.0.1:"));
/// publisher.publish(KvEventBatch::now(vec![KvEvent::AllBlocksCleared], None));
/// let stats = publisher.close();
/// assert_eq!((stats.batches, stats.dropped), (1, 0));
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Debug)]
pub struct KvEventPublisher {
    queue: Option<mpsc::Sender<KvEventBatch>>,
    counters: Arc<Counters>,
    thread: Option<JoinHandle<()>>,
    endpoint: String,
    replay_endpoint: Option<String>,
}

impl KvEventPublisher {
    /// Binds the sockets and starts the publisher thread. An endpoint that does
    /// not parse or cannot be bound (a port in use) is an [`EventsError`] here,
    /// before anything is published.
    pub fn bind(config: &KvEventsConfig) -> Result<Self> {
        let endpoint = parse_endpoint("PUB", &config.endpoint)?;
        let replay = config.replay_endpoint.as_deref().map(|e| parse_endpoint("replay", e)).transpose()?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| EventsError::Start { reason: e.to_string() })?;
        let (tx, rx) = mpsc::channel(config.max_queue_size.max(1));
        let counters = Arc::new(Counters::default());
        let (bound_tx, bound_rx) = std::sync::mpsc::channel();
        let worker = Worker {
            topic: Bytes::from(config.topic.clone().into_bytes()),
            buffer: VecDeque::new(),
            buffer_steps: config.buffer_steps,
            next_seq: 0,
            counters: Arc::clone(&counters),
            linger: config.linger,
        };
        let thread = std::thread::Builder::new()
            .name("omniprefix-kv-events".into())
            .spawn(move || runtime.block_on(worker.run(endpoint, replay, rx, bound_tx)))
            .map_err(|e| EventsError::Start { reason: e.to_string() })?;
        match bound_rx.recv() {
            Ok(Ok((endpoint, replay_endpoint))) => Ok(KvEventPublisher {
                queue: Some(tx),
                counters,
                thread: Some(thread),
                endpoint,
                replay_endpoint,
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e.into())
            }
            Err(_) => {
                let _ = thread.join();
                Err(EventsError::Start { reason: "the publisher thread ended before binding".into() }.into())
            }
        }
    }

    /// Queues `batch` for publishing; never blocks. `false` when it was
    /// dropped (the queue is full or the publisher stopped), which is counted.
    pub fn publish(&self, batch: KvEventBatch) -> bool {
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        let sent = self.queue.as_ref().is_some_and(|q| q.try_send(batch).is_ok());
        if !sent {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
        }
        sent
    }

    /// The PUB endpoint as bound (the port resolved when 0 was asked for).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The replay endpoint as bound, if any.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The counters so far.
    pub fn stats(&self) -> PublisherStats {
        let c = &self.counters;
        PublisherStats {
            batches: c.batches.load(Ordering::Relaxed),
            published: c.published.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            replays: c.replays.load(Ordering::Relaxed),
            malformed_replays: c.malformed_replays.load(Ordering::Relaxed),
        }
    }

    /// Publishes what is queued, keeps the sockets open for the linger, closes
    /// them and returns the final counters (dropping the publisher does the same).
    pub fn close(mut self) -> PublisherStats {
        self.shut_down();
        self.stats()
    }

    fn shut_down(&mut self) {
        self.queue = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for KvEventPublisher {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// Parses a `tcp://host:port` endpoint (`*` = every interface, as libzmq reads it).
fn parse_endpoint(socket: &'static str, endpoint: &str) -> std::result::Result<Endpoint, EventsError> {
    let bad = |reason: String| EventsError::BadEndpoint { socket, endpoint: endpoint.into(), reason };
    let normalised = endpoint.replacen("tcp://*:", "tcp://0.0.0.0:", 1);
    let parsed = Endpoint::from_str(&normalised).map_err(|e| bad(e.to_string()))?;
    match parsed {
        Endpoint::Tcp(..) => Ok(parsed),
        other => Err(bad(format!("transport {} is not tcp", other.transport()))),
    }
}

/// What the publisher thread owns.
struct Worker {
    topic: Bytes,
    /// `(seq, payload)` of the last `buffer_steps` batches.
    buffer: VecDeque<(u64, Bytes)>,
    buffer_steps: usize,
    next_seq: u64,
    counters: Arc<Counters>,
    linger: Duration,
}

type Bound = std::result::Result<(String, Option<String>), EventsError>;

impl Worker {
    async fn run(
        mut self, endpoint: Endpoint, replay: Option<Endpoint>, mut batches: mpsc::Receiver<KvEventBatch>,
        bound: std::sync::mpsc::Sender<Bound>,
    ) {
        let sockets = bind_sockets(endpoint, replay).await;
        let (mut publisher, replay) = match sockets {
            Ok((publisher, publisher_at, replay, replay_at)) => {
                let _ = bound.send(Ok((publisher_at, replay_at)));
                (publisher, replay)
            }
            Err(e) => {
                let _ = bound.send(Err(e));
                return;
            }
        };
        // The ROUTER's receiving half feeds a channel, so waiting on it next
        // to the batch queue loses nothing when the other side wins.
        let (requests_tx, mut requests) = mpsc::channel::<ZmqMessage>(64);
        let mut replier = replay.map(|socket| {
            let (send, mut recv) = socket.split();
            tokio::spawn(async move {
                while let Ok(message) = recv.recv().await {
                    if requests_tx.send(message).await.is_err() {
                        break;
                    }
                }
            });
            send
        });
        loop {
            tokio::select! {
                batch = batches.recv() => match batch {
                    Some(batch) => self.publish(&mut publisher, &batch).await,
                    None => break,
                },
                Some(request) = requests.recv() => {
                    if let Some(replier) = replier.as_mut() {
                        self.replay(replier, request).await;
                    }
                }
            }
        }
        // At least a moment, so the PUB socket's writer task flushes the last batches.
        let linger = tokio::time::sleep(self.linger.max(FLUSH));
        tokio::pin!(linger);
        loop {
            tokio::select! {
                () = &mut linger => break,
                Some(request) = requests.recv() => {
                    if let Some(replier) = replier.as_mut() {
                        self.replay(replier, request).await;
                    }
                }
            }
        }
        let _ = publisher.close().await;
    }

    async fn publish(&mut self, socket: &mut PubSocket, batch: &KvEventBatch) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let payload = Bytes::from(batch.encode());
        let frames = vec![self.topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
        let sent = match ZmqMessage::try_from(frames) {
            Ok(message) => socket.send(message).await.is_ok(),
            Err(_) => false,
        };
        let counter = if sent { &self.counters.published } else { &self.counters.dropped };
        counter.fetch_add(1, Ordering::Relaxed);
        if self.buffer_steps > 0 {
            if self.buffer.len() == self.buffer_steps {
                self.buffer.pop_front();
            }
            self.buffer.push_back((seq, payload));
        }
    }

    /// Answers one replay request `(identity, b"", start seq)`.
    async fn replay(&mut self, socket: &mut zeromq::RouterSendHalf, request: ZmqMessage) {
        let frames = request.into_vec();
        let start = match frames.as_slice() {
            [_, empty, seq] if empty.is_empty() => {
                <[u8; 8]>::try_from(seq.as_ref()).ok().map(u64::from_be_bytes)
            }
            _ => None,
        };
        let Some(start) = start else {
            self.counters.malformed_replays.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let identity = frames[0].clone();
        let empty = Bytes::new();
        for (seq, payload) in self.buffer.iter().filter(|(seq, _)| *seq >= start) {
            let frames = vec![
                identity.clone(),
                empty.clone(),
                self.topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ];
            if let Ok(message) = ZmqMessage::try_from(frames) {
                let _ = socket.send(message).await;
            }
        }
        let end = vec![identity, empty.clone(), empty.clone(), Bytes::from_static(&END_SEQ), empty];
        if let Ok(message) = ZmqMessage::try_from(end) {
            let _ = socket.send(message).await;
        }
        self.counters.replays.fetch_add(1, Ordering::Relaxed);
    }
}

/// Binds the PUB socket and the optional ROUTER, with the endpoints as bound.
async fn bind_sockets(
    endpoint: Endpoint, replay: Option<Endpoint>,
) -> std::result::Result<(PubSocket, String, Option<RouterSocket>, Option<String>), EventsError> {
    let bind_error = |socket, endpoint: &Endpoint, e: zeromq::ZmqError| EventsError::Bind {
        socket,
        endpoint: endpoint.to_string(),
        reason: e.to_string(),
    };
    let mut publisher = PubSocket::new();
    let publisher_at =
        publisher.bind(&endpoint.to_string()).await.map_err(|e| bind_error("PUB", &endpoint, e))?;
    let (router, router_at) = match replay {
        Some(replay) => {
            let mut router = RouterSocket::new();
            let at = router.bind(&replay.to_string()).await.map_err(|e| bind_error("replay", &replay, e))?;
            (Some(router), Some(at.to_string()))
        }
        None => (None, None),
    };
    Ok((publisher, publisher_at.to_string(), router, router_at))
}
