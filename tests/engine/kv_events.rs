//! KV events: the payload bytes vLLM 0.33's own classes write
//! (`fixtures/vllm_kv_events_vectors.json`), the ZMQ framing of the live stream
//! and of replay, typed errors for bad endpoints, and the hashes an engine
//! publishes against the ones a frontend computes for the same request.
//!
//! Sockets bind to loopback with port 0; every wait is bounded in time.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ndarray::{Array2, ArrayD, IxDyn};
use omniprefix::canon::{
    FingerprintKey, Fingerprinter, ItemContent, ItemLayout, ItemSpec, Modality, TensorView, ValidationPolicy,
};
use omniprefix::engine::{Engine, EngineConfig, ItemInput, Request, request_block_hashes};
use omniprefix::error::{Error, EventsError, RequestError, SchedError};
use omniprefix::events::{
    ItemRows, KvEvent, KvEventBatch, KvEventPublisher, KvEventsConfig, Medium, RoutingHash,
};
use omniprefix::model::Config;
use omniprefix::prompt::OmniTokens;
use omniprefix::sched::SchedulerConfig;
use serde_json::Value;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// The longest any single wait may take.
const WAIT: Duration = Duration::from_secs(10);

fn vectors() -> TestResult<Value> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/vllm_kv_events_vectors.json");
    Ok(serde_json::from_str(&std::fs::read_to_string(path)?)?)
}

fn u64s(v: &Value) -> TestResult<Vec<u64>> {
    v.as_array().ok_or("not an array")?.iter().map(|x| x.as_u64().ok_or_else(|| "not a u64".into())).collect()
}

fn medium(v: &Value) -> TestResult<Medium> {
    match v.as_str() {
        Some("CPU") => Ok(Medium::Cpu),
        Some("GPU") => Ok(Medium::Gpu),
        other => Err(format!("medium {other:?}").into()),
    }
}

/// One block's extra keys as the vectors spell them: `null` or `[mm_hash, row, ...]`.
fn item_rows(v: &Value) -> TestResult<Option<Vec<ItemRows>>> {
    let Some(flat) = v.as_array() else { return Ok(None) };
    let rows = flat
        .chunks(2)
        .map(|pair| -> TestResult<ItemRows> {
            let mm_hash = pair[0].as_str().ok_or("mm_hash")?.to_owned();
            let first_row = u32::try_from(pair[1].as_u64().ok_or("row")?)?;
            Ok(ItemRows { mm_hash, first_row, routing_hash: None })
        })
        .collect::<TestResult<Vec<_>>>()?;
    Ok(Some(rows))
}

/// A case's `decoded_as_python` as the library's batch.
fn batch_of(case: &Value) -> TestResult<KvEventBatch> {
    let decoded = &case["decoded_as_python"];
    let events = decoded[1]
        .as_array()
        .ok_or("events")?
        .iter()
        .map(|e| -> TestResult<KvEvent> {
            Ok(match e["type"].as_str() {
                Some("BlockStored") => KvEvent::BlockStored {
                    block_hashes: u64s(&e["block_hashes"])?,
                    parent_block_hash: e["parent_block_hash"].as_u64(),
                    token_ids: u64s(&e["token_ids"])?
                        .into_iter()
                        .map(u32::try_from)
                        .collect::<Result<_, _>>()?,
                    block_size: usize::try_from(e["block_size"].as_u64().ok_or("block_size")?)?,
                    medium: medium(&e["medium"])?,
                    extra_keys: match e.get("extra_keys").and_then(Value::as_array) {
                        Some(blocks) => Some(blocks.iter().map(item_rows).collect::<TestResult<_>>()?),
                        None => None,
                    },
                },
                Some("BlockRemoved") => KvEvent::BlockRemoved {
                    block_hashes: u64s(&e["block_hashes"])?,
                    medium: medium(&e["medium"])?,
                },
                Some("AllBlocksCleared") => KvEvent::AllBlocksCleared,
                other => return Err(format!("event type {other:?}").into()),
            })
        })
        .collect::<TestResult<Vec<_>>>()?;
    let rank = decoded[2].as_u64().map(u32::try_from).transpose()?;
    Ok(KvEventBatch { ts: decoded[0].as_f64().ok_or("ts")?, events, data_parallel_rank: rank })
}

fn cases() -> TestResult<Vec<(String, KvEventBatch, Vec<u8>)>> {
    vectors()?["cases"]
        .as_array()
        .ok_or("cases")?
        .iter()
        .map(|c| {
            Ok((
                c["name"].as_str().ok_or("name")?.to_string(),
                batch_of(c)?,
                hex::decode(c["payload_hex"].as_str().ok_or("hex")?)?,
            ))
        })
        .collect()
}

#[test]
fn payloads_are_the_bytes_vllm_writes() -> TestResult {
    let cases = cases()?;
    assert_eq!(cases.len(), 5);
    for (name, batch, want) in cases {
        assert_eq!(hex::encode(batch.encode()), hex::encode(want), "{name}");
    }
    Ok(())
}

/// Runs `f` on a fresh single-threaded tokio runtime (the sockets' tasks need one).
fn block_on<T>(f: impl Future<Output = TestResult<T>>) -> TestResult<T> {
    tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(f)
}

async fn recv(socket: &mut impl SocketRecv) -> TestResult<Vec<Bytes>> {
    Ok(tokio::time::timeout(WAIT, socket.recv()).await??.into_vec())
}

fn message(frames: Vec<Bytes>) -> TestResult<ZmqMessage> {
    ZmqMessage::try_from(frames).map_err(|_| "an empty message".into())
}

fn loopback(topic: &str) -> KvEventsConfig {
    KvEventsConfig {
        endpoint: "tcp://127.0.0.1:0".into(),
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        topic: topic.into(),
        ..Default::default()
    }
}

/// Subscribes to `publisher`, publishing sentinel batches until one arrives
/// (a PUB socket drops what it sends before the subscription reaches it);
/// returns the socket and the seq of the last sentinel seen.
async fn subscribe(publisher: &KvEventPublisher, topic: &str) -> TestResult<(SubSocket, u64)> {
    let mut sub = SubSocket::new();
    sub.connect(publisher.endpoint()).await?;
    sub.subscribe(topic).await?;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        publisher.publish(KvEventBatch::now(vec![KvEvent::AllBlocksCleared], None));
        if let Ok(Ok(message)) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
            let frames = message.into_vec();
            // Drain the sentinels still in flight, so the next message is the caller's.
            let mut seq = u64::from_be_bytes(frames[1].as_ref().try_into()?);
            while let Ok(Ok(more)) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
                seq = u64::from_be_bytes(more.into_vec()[1].as_ref().try_into()?);
            }
            return Ok((sub, seq));
        }
        if tokio::time::Instant::now() > deadline {
            return Err("no subscription within the wait".into());
        }
    }
}

#[test]
fn live_stream_and_replay_have_vllms_framing() -> TestResult {
    let publisher = KvEventPublisher::bind(&loopback("kv@a"))?;
    let replay_at = publisher.replay_endpoint().ok_or("no replay endpoint")?.to_string();
    let cases = cases()?;
    let stats = block_on(async {
        let (mut sub, last_sentinel) = subscribe(&publisher, "kv@a").await?;
        for (_, batch, _) in &cases {
            assert!(publisher.publish(batch.clone()));
        }
        // Live: (topic, seq as u64 big-endian, payload), seq counting on.
        for (i, (name, _, payload)) in cases.iter().enumerate() {
            let frames = recv(&mut sub).await?;
            let seq = last_sentinel + 1 + i as u64;
            assert_eq!(
                frames,
                vec![
                    Bytes::from("kv@a"),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    Bytes::from(payload.clone())
                ],
                "{name}"
            );
        }
        // A late subscriber replays from the first vector batch on.
        let first = last_sentinel + 1;
        let mut dealer = DealerSocket::new();
        dealer.connect(&replay_at).await?;
        // A malformed request (a 3-byte seq) is ignored and counted; the next one is answered.
        dealer.send(message(vec![Bytes::new(), Bytes::from_static(b"abc")])?).await?;
        dealer.send(message(vec![Bytes::new(), Bytes::copy_from_slice(&first.to_be_bytes())])?).await?;
        for (i, (name, _, payload)) in cases.iter().enumerate() {
            let frames = recv(&mut dealer).await?;
            let seq = first + i as u64;
            let want = vec![
                Bytes::new(),
                Bytes::from("kv@a"),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                Bytes::from(payload.clone()),
            ];
            assert_eq!(frames, want, "replay of {name}");
        }
        let end = recv(&mut dealer).await?;
        assert_eq!(
            end,
            vec![Bytes::new(), Bytes::new(), Bytes::copy_from_slice(&(-1i64).to_be_bytes()), Bytes::new()]
        );
        Ok(publisher.stats())
    })?;
    assert_eq!((stats.replays, stats.malformed_replays, stats.dropped), (1, 1, 0));
    assert_eq!(stats.published, stats.batches);
    Ok(())
}

#[test]
fn a_full_queue_drops_and_counts_without_blocking() -> TestResult {
    // A queue of one batch, filled faster than the thread drains it.
    let config = KvEventsConfig { max_queue_size: 1, ..loopback("") };
    let publisher = KvEventPublisher::bind(&config)?;
    let big = KvEventBatch::now(
        vec![KvEvent::BlockRemoved { block_hashes: (0..20_000).collect(), medium: Medium::Cpu }],
        None,
    );
    let accepted = (0..200).filter(|_| publisher.publish(big.clone())).count() as u64;
    let stats = publisher.close();
    assert_eq!(stats.batches, 200);
    assert!(stats.dropped > 0, "nothing dropped: {stats:?}");
    assert_eq!(stats.dropped + accepted, 200);
    assert_eq!(stats.published, accepted);
    Ok(())
}

#[test]
fn bad_endpoints_are_typed_errors_at_startup() -> TestResult {
    for endpoint in ["garbage", "udp://127.0.0.1:5", "tcp://127.0.0.1:notaport"] {
        let config = KvEventsConfig { endpoint: endpoint.into(), ..Default::default() };
        match KvEventPublisher::bind(&config) {
            Err(Error::Events(EventsError::BadEndpoint { socket: "PUB", .. })) => {}
            other => panic!("{endpoint}: {other:?}"),
        }
    }
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = taken.local_addr()?.port();
    let config = KvEventsConfig { replay_endpoint: Some(format!("tcp://127.0.0.1:{port}")), ..loopback("") };
    match KvEventPublisher::bind(&config) {
        Err(Error::Events(EventsError::Bind { socket: "replay", .. })) => {}
        other => panic!("port in use: {other:?}"),
    }
    // The engine refuses to start on one too, before anything runs.
    let config = EngineConfig {
        kv_events: Some(KvEventsConfig { endpoint: format!("tcp://127.0.0.1:{port}"), ..Default::default() }),
        ..tiny_config(1, 12)
    };
    assert!(matches!(
        Engine::random(model(), 1, config),
        Err(Error::Events(EventsError::Bind { socket: "PUB", .. }))
    ));
    Ok(())
}

const HIDDEN: usize = 32;

fn model() -> Config {
    Config::tiny_qwen3_omni_moe(HIDDEN, 2, 4, 2, 512, 4, 2)
}

fn tiny_config(key: u64, num_blocks: usize) -> EngineConfig {
    EngineConfig {
        scheduler: SchedulerConfig { block_size: 4, num_blocks, ..Default::default() },
        tokens: Some(OmniTokens::tiny()),
        fingerprint_key: FingerprintKey::fixed(key),
        kv_events: Some(loopback("")),
        ..Default::default()
    }
}

fn pixels(seed: u8) -> ArrayD<u8> {
    ArrayD::from_shape_fn(IxDyn(&[4, 4, 3]), |d| seed.wrapping_add(d[0] as u8 * 7 + d[1] as u8))
}

/// `head`, an image (4 placeholder rows, with embeddings), `tail`, for `tenant`.
fn image_request<'a>(content: &'a ArrayD<u8>, head: &[u32], tail: &[u32], tenant: u64) -> Request<'a> {
    let mut ids = head.to_vec();
    ids.extend([503, 500, 504]);
    ids.extend_from_slice(tail);
    let item = ItemInput {
        spec: ItemSpec {
            modality: Modality::Image,
            layout: ItemLayout::Image { grid_thw: [1, 4, 4] },
            content: ItemContent::Tensor(TensorView::U8(content.view())),
            params: Default::default(),
        },
        embeddings: Some(Arc::new(Array2::from_shape_fn((4, HIDDEN), |(r, c)| {
            ((r * HIDDEN + c) as f32 * 0.37).sin()
        }))),
        deepstack: None,
        routing_hash: None,
    };
    Request { tenant, token_ids: ids, items: vec![item], ..Default::default() }
}

fn sorted(mut v: Vec<u64>) -> Vec<u64> {
    v.sort_unstable();
    v
}

#[test]
fn frontend_hashes_equal_the_published_ones_for_text_and_images() -> TestResult {
    let key = FingerprintKey::fixed(3);
    let tokens = OmniTokens::tiny();
    let (a, b) = (pixels(1), pixels(2));
    let requests = [
        Request::text((0..13).collect()),
        image_request(&a, &[1, 2, 3], &[7, 8, 9, 10, 11], 0),
        // The same placeholders, another image: other hashes from the image's block on.
        image_request(&b, &[1, 2, 3], &[7, 8, 9, 10, 11], 0),
        // The same image for another tenant: every hash differs.
        image_request(&a, &[1, 2, 3], &[7, 8, 9, 10, 11], 5),
    ];
    let hashes: Vec<Vec<u64>> =
        requests.iter().map(|r| request_block_hashes(r, &key, 4, &tokens)).collect::<Result<_, _>>()?;
    assert_eq!(hashes.iter().map(Vec::len).collect::<Vec<_>>(), vec![3, 3, 3, 3]);
    // Image rows start at position 4 (after 3 ids and vision_start): block 0 is shared, block 1 holds the image.
    assert_eq!(hashes[1][0], hashes[2][0]);
    assert!(hashes[1][1..].iter().zip(&hashes[2][1..]).all(|(x, y)| x != y));
    assert!(hashes[1].iter().zip(&hashes[3]).all(|(x, y)| x != y));
    // Another fleet key: other hashes for the same request.
    let other_key = request_block_hashes(&requests[1], &FingerprintKey::fixed(4), 4, &tokens)?;
    assert!(hashes[1].iter().zip(&other_key).all(|(x, y)| x != y));

    let mut engine = Engine::random(model(), 1, tiny_config(3, 64))?;
    let mut published = Vec::new();
    for (request, want) in requests.into_iter().zip(&hashes) {
        engine.run(request)?;
        published.extend(want.iter().copied());
        published.sort_unstable();
        published.dedup();
        assert_eq!(engine.cached_block_hashes(), published);
    }
    engine.validate()?;
    Ok(())
}

#[test]
fn evictions_and_resets_are_published_and_reset_waits_for_idle() -> TestResult {
    let mut engine = Engine::random(model(), 1, tiny_config(3, 12))?;
    // 12 blocks of 4: four 16-token prompts cannot all stay cached.
    for start in [0u32, 100, 300, 200] {
        engine.run(Request::text((start..start + 16).collect()))?;
    }
    let last = sorted(request_block_hashes(
        &Request::text((200..216).collect()),
        &FingerprintKey::fixed(3),
        4,
        engine.tokens(),
    )?);
    let cached = engine.cached_block_hashes();
    assert!(engine.stats().sched.evicted_blocks > 0);
    assert!(last.iter().all(|h| cached.binary_search(h).is_ok()));
    assert!(cached.len() <= 12 && cached.len() >= 4);
    // Reset refuses while a request is pending, and changes nothing.
    let id = engine.submit(Request::text(vec![1, 2, 3, 4, 5]))?;
    assert!(matches!(engine.reset_cache(), Err(Error::Sched(SchedError::CacheInUse { requests: 1 }))));
    assert_eq!(engine.cached_block_hashes(), cached);
    engine.abort(id)?;
    assert!(engine.reset_cache()? >= cached.len());
    assert!(engine.cached_block_hashes().is_empty());
    let stats = engine.kv_events_stats().ok_or("no publisher")?;
    assert_eq!(stats.dropped, 0);
    assert!(stats.batches >= 4, "{stats:?}");
    Ok(())
}

// ------------------------------------------------------------------ routing hashes (Dynamo's image keys)

/// Dynamo's frontend hashes of two image URLs (`extra_args["mm_hashes"]` entries).
const ROUTE_A: &str = "00112233445566ff";
const ROUTE_B: &str = "8899AABBCCDDEEFF";

/// `request`'s first item with routing hash `hash`.
fn routed<'a>(mut request: Request<'a>, hash: &str) -> Request<'a> {
    request.items[0].routing_hash = Some(hash.to_string());
    request
}

/// The item's 64-hex identity under fleet key `key` (what its extra keys name it by).
fn identity(request: &Request<'_>, key: u64) -> TestResult<String> {
    let fingerprinter = Fingerprinter::new(FingerprintKey::fixed(key), 1, ValidationPolicy::Unvalidated)?;
    Ok(fingerprinter.identify(0, &request.items[0].spec)?.fingerprint.mm_hash_hex())
}

/// Every payload `engine` published so far, by replay from seq 0 (once the
/// publisher's thread sent all it was handed).
fn published_payloads<B: omniprefix::backend::Backend>(engine: &Engine<B>) -> TestResult<Vec<Bytes>> {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let stats = engine.kv_events_stats().ok_or("no publisher")?;
        if stats.published + stats.dropped == stats.batches {
            break;
        }
        if std::time::Instant::now() > deadline {
            return Err(format!("the publisher did not drain: {stats:?}").into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let (_, replay) = engine.kv_events_endpoints().ok_or("no publisher")?;
    let replay = replay.ok_or("no replay endpoint")?.to_string();
    block_on(async move {
        let mut dealer = DealerSocket::new();
        dealer.connect(&replay).await?;
        dealer.send(message(vec![Bytes::new(), Bytes::copy_from_slice(&0u64.to_be_bytes())])?).await?;
        let mut payloads = Vec::new();
        loop {
            let frames = recv(&mut dealer).await?;
            if frames[2].as_ref() == (-1i64).to_be_bytes() {
                return Ok(payloads);
            }
            payloads.push(frames[3].clone());
        }
    })
}

/// A str of 32 to 255 bytes as msgpack writes it (str8).
fn str8(s: &str) -> Vec<u8> {
    let mut out = vec![0xd9, u8::try_from(s.len()).unwrap_or(0)];
    out.extend_from_slice(s.as_bytes());
    out
}

/// Whether `needle` occurs in `hay`.
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn a_routing_hash_is_written_first_in_dynamos_marker_form_then_our_identity() -> TestResult {
    let pixels = pixels(1);
    // 3 ids, vision_start, 4 image rows, vision_end, 5 ids: blocks [1 2 3 vs] [image x4] [ve 7 8 9].
    let request = routed(image_request(&pixels, &[1, 2, 3], &[7, 8, 9, 10, 11], 0), ROUTE_B);
    let ours = identity(&request, 3)?;
    assert_eq!(ours.len(), 64);
    let mut engine = Engine::random(model(), 1, tiny_config(3, 64))?;
    engine.run(request)?;
    let payloads = published_payloads(&engine)?;
    let stored: Vec<&Bytes> = payloads.iter().filter(|p| contains(p, b"BlockStored")).collect();
    assert_eq!(stored.len(), 1, "one BlockStored for the prompt's 3 full blocks");
    // Dynamo 1.6.1's marker: the frontend's 16 hex digits, lowercase, then 48 "0".
    let marker = format!("8899aabbccddeeff{}", "0".repeat(48));
    assert_eq!(RoutingHash::parse(ROUTE_B).map(RoutingHash::marker), Some(marker.clone()));
    // extra_keys, byte for byte: [nil, [marker, identity, 0], nil].
    let mut want = b"\xaaextra_keys\x93\xc0\x93".to_vec();
    want.extend(str8(&marker));
    want.extend(str8(&ours));
    want.extend(b"\x00\xc0");
    assert!(
        contains(stored[0], &want),
        "extra_keys are not [nil, [marker, identity, 0], nil]: {}",
        hex::encode(stored[0].as_ref())
    );
    // The same request without a routing hash: our identity alone, as before.
    let mut plain = Engine::random(model(), 1, tiny_config(3, 64))?;
    plain.run(image_request(&pixels, &[1, 2, 3], &[7, 8, 9, 10, 11], 0))?;
    let payloads = published_payloads(&plain)?;
    let mut want = b"\xaaextra_keys\x93\xc0\x92".to_vec();
    want.extend(str8(&ours));
    want.extend(b"\x00\xc0");
    assert!(payloads.iter().any(|p| contains(p, &want)));
    assert!(!payloads.iter().any(|p| contains(p, marker.as_bytes())));
    // The routing hash names blocks, not content: both engines cache the same hashes.
    assert_eq!(engine.cached_block_hashes(), plain.cached_block_hashes());
    Ok(())
}

#[test]
fn the_same_image_under_another_routing_hash_hits_the_cache_and_keeps_the_first_marker() -> TestResult {
    let pixels = pixels(4);
    let mut engine = Engine::random(model(), 1, tiny_config(3, 64))?;
    engine.run(routed(image_request(&pixels, &[1, 2, 3], &[7, 8, 9, 10, 11], 0), ROUTE_A))?;
    let cached = engine.cached_block_hashes();
    // The same content sent again (another URL, so another frontend hash): a cache hit on
    // every full block, and no block published again under the second marker.
    let again = engine.run(routed(image_request(&pixels, &[1, 2, 3], &[7, 8, 9, 10, 11], 0), ROUTE_B))?;
    assert!(again.num_cached_tokens >= 12, "{} cached tokens", again.num_cached_tokens);
    assert_eq!(engine.cached_block_hashes(), cached);
    let payloads = published_payloads(&engine)?;
    let marker_a = RoutingHash::parse(ROUTE_A).ok_or("A")?.marker();
    let marker_b = RoutingHash::parse(ROUTE_B).ok_or("B")?.marker();
    assert_eq!(payloads.iter().filter(|p| contains(p, marker_a.as_bytes())).count(), 1);
    assert!(!payloads.iter().any(|p| contains(p, marker_b.as_bytes())));
    Ok(())
}

#[test]
fn a_malformed_routing_hash_is_a_typed_error_naming_the_item_and_changes_nothing() -> TestResult {
    let (a, b) = (pixels(1), pixels(2));
    let mut engine = Engine::random(model(), 1, tiny_config(3, 64))?;
    engine.run(routed(image_request(&a, &[1, 2, 3], &[7, 8, 9, 10, 11], 0), ROUTE_A))?;
    let (cached, stats) = (engine.cached_block_hashes(), engine.stats());
    let batches = engine.kv_events_stats().ok_or("no publisher")?.batches;
    let long = "0".repeat(100);
    for bad in ["00112233445566f", "00112233445566fff", "00112233445566fg", "+0112233445566ff", "", &long] {
        // The bad hash on the request's second item: the error names item 1.
        let mut request = image_request(&b, &[1, 2, 3], &[7, 8, 9, 10, 11], 0);
        let mut second = request.items[0].clone();
        second.routing_hash = Some(bad.to_string());
        request.items[0].routing_hash = Some(ROUTE_A.into());
        request.items.push(second);
        request.token_ids.extend([503, 500, 504]);
        match engine.run(request) {
            Err(Error::Request(RequestError::InvalidRoutingHash { item: 1, found })) => {
                assert_eq!(found, bad.chars().take(40).collect::<String>());
            }
            other => panic!("{bad:?}: {other:?}"),
        }
        assert_eq!(engine.cached_block_hashes(), cached, "{bad:?}");
        assert_eq!(engine.stats(), stats, "{bad:?}");
        assert_eq!(engine.kv_events_stats().ok_or("no publisher")?.batches, batches, "{bad:?}");
    }
    // The engine still serves, and the same request with good hashes is cached.
    let mut request = image_request(&b, &[1, 2, 3], &[7, 8, 9, 10, 11], 0);
    request.items[0].routing_hash = Some(ROUTE_B.into());
    engine.run(request)?;
    assert!(engine.cached_block_hashes().len() > cached.len());
    engine.validate()?;
    Ok(())
}
