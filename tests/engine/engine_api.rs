//! The engine's contract beyond one prompt: batches of requests (varlen,
//! chunked steps) equal their uncached runs; bad requests are typed errors that
//! leave the engine unchanged; the encoder cache skips encoders for items seen.

use std::error::Error as StdError;
use std::sync::Arc;

use ndarray::{Array2, ArrayD};
use omniprefix::Error;
use omniprefix::canon::{ItemIdentity, Modality};
use omniprefix::engine::{EncoderOutput, Engine, EngineConfig, ItemInput, Output, Request};
use omniprefix::error::RequestError;
use omniprefix::model::Config;
use omniprefix::prompt::OmniTokens;

use support::images;

use images::{HIDDEN, image, model, pixels, rows, with_image};
use omniprefix::sched::SchedulerConfig;

type TestResult<T = ()> = Result<T, Box<dyn StdError>>;

fn config() -> EngineConfig {
    EngineConfig {
        scheduler: SchedulerConfig {
            block_size: 4,
            num_blocks: 32,
            max_tokens_per_step: 10,
            max_seqs_per_step: 3,
            ..Default::default()
        },
        tokens: Some(OmniTokens::tiny()),
        ..Default::default()
    }
}

fn assert_same(got: &Output, want: &Output) {
    assert_eq!(got.hidden.len(), want.hidden.len());
    for ((name, g), (_, w)) in got.hidden.iter().zip(&want.hidden) {
        assert_eq!(g.dim(), w.dim(), "{name}");
        let scale = w.iter().fold(1f32, |m, v| m.max(v.abs()));
        let worst = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-5 * scale, "{name}: max difference {worst}");
    }
    let scale = want.last_logits.iter().fold(1f32, |m, v| m.max(v.abs()));
    let worst =
        got.last_logits.iter().zip(&want.last_logits).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(worst <= 1e-5 * scale, "logits: max difference {worst}");
}

#[test]
fn batched_chunked_requests_equal_their_uncached_runs() -> TestResult {
    let content = pixels(1);
    let shared: Vec<u32> = (10..27).collect();
    let prompts = [
        with_image(&shared, &[40, 41, 42]),
        with_image(&shared, &[50, 51, 52, 53, 54, 55]),
        (100..123).collect::<Vec<u32>>(),
    ];
    let request = |ids: &Vec<u32>| Request {
        token_ids: ids.clone(),
        items: if ids.contains(&500) { vec![image(&content, Some(rows(4, HIDDEN, 0.5)))] } else { vec![] },
        ..Default::default()
    };
    let mut reference = Engine::random(
        model(),
        5,
        EngineConfig {
            scheduler: SchedulerConfig { max_tokens_per_step: 4096, ..config().scheduler },
            cache: false,
            ..config()
        },
    )?;
    let want: Vec<Output> = prompts.iter().map(|p| reference.run(request(p))).collect::<Result<_, _>>()?;

    let mut engine = Engine::random(model(), 5, config())?;
    // Warm the shared text prefix, then submit all three at once.
    engine.run(Request::text(shared.clone()))?;
    let ids: Vec<u64> = prompts.iter().map(|p| engine.submit(request(p))).collect::<Result<_, _>>()?;
    let outs = engine.run_all()?;
    assert_eq!(outs.len(), 3);
    for (id, want) in ids.iter().zip(&want) {
        let out = outs.iter().find(|o| o.request == *id).ok_or("missing output")?;
        assert_same(out, want);
        assert_eq!(out.prompt_len, want.prompt_len);
    }
    // The two image prompts share 16 warm tokens at least (four whole blocks).
    assert!(outs.iter().filter(|o| o.num_cached_tokens >= 16).count() >= 2);
    let stats = engine.stats();
    assert_eq!((stats.sched.queries, stats.finished), (4, 4));
    assert!(engine.stats().sched.running == 0 && engine.stats().sched.waiting == 0);
    engine.validate()?;
    Ok(())
}

#[test]
fn bad_requests_are_typed_errors_and_change_nothing() -> TestResult {
    let content = pixels(2);
    let mut engine = Engine::random(model(), 6, config())?;
    engine.run(Request::text((0..9).collect()))?;
    let before = engine.stats();
    let cases: Vec<(&str, Request<'_>)> = vec![
        ("too large", Request::text(vec![1; 32 * 4 + 1])),
        ("out of vocab", Request::text(vec![1, 2, 512])),
        (
            "rows",
            Request {
                token_ids: with_image(&[1], &[2]),
                items: vec![image(&content, Some(rows(3, HIDDEN, 0.0)))],
                ..Default::default()
            },
        ),
        (
            "hidden",
            Request {
                token_ids: with_image(&[1], &[2]),
                items: vec![image(&content, Some(rows(4, HIDDEN + 1, 0.0)))],
                ..Default::default()
            },
        ),
        (
            "no embeddings",
            Request {
                token_ids: with_image(&[1], &[2]),
                items: vec![image(&content, None)],
                ..Default::default()
            },
        ),
        ("no item", Request { token_ids: with_image(&[1], &[2]), ..Default::default() }),
        ("empty", Request::text(vec![])),
    ];
    for (what, request) in cases {
        let err = engine.run(request).expect_err(what);
        let expected = match what {
            "too large" => matches!(
                err,
                Error::Request(RequestError::RequestTooLarge { id: None, needed: 33, num_blocks: 32, .. })
            ),
            "out of vocab" => matches!(
                err,
                Error::Request(RequestError::TokenOutOfVocab { position: 2, token: 512, vocab_size: 512 })
            ),
            "rows" => matches!(
                err,
                Error::Request(RequestError::EmbeddingMismatch {
                    id: None,
                    what: "embedding rows",
                    expected: 4,
                    found: 3,
                    ..
                })
            ),
            "hidden" => matches!(
                err,
                Error::Request(RequestError::EmbeddingMismatch {
                    id: None,
                    what: "embedding columns",
                    expected: 32,
                    found: 33,
                    ..
                })
            ),
            "no embeddings" => matches!(err, Error::Request(RequestError::MissingEmbeddings { item: 0 })),
            "no item" => matches!(
                err,
                Error::Request(RequestError::MissingItem { position: 2, modality: Modality::Image, .. })
            ),
            _ => matches!(err, Error::Request(RequestError::EmptyPrompt)),
        };
        assert!(expected, "{what}: {err}");
        assert_eq!(engine.stats(), before, "{what}: state changed");
        engine.validate()?;
    }
    assert!(engine.encoder_cache().is_empty(), "rejected items are not cached");
    // Still serves, and the earlier prompt is still cached.
    let out = engine.run(Request::text((0..12).collect()))?;
    // All 9 positions of the earlier prompt, its partly filled third block included.
    assert_eq!(out.num_cached_tokens, 9);
    Ok(())
}

/// An encoder may return DeepStack levels with the embeddings: the run equals one
/// where the caller passed both, and the levels are cached with the embeddings.
#[test]
fn an_encoder_can_hand_over_deepstack_levels() -> TestResult {
    let content = pixels(9);
    let ids = with_image(&[4, 5], &[6]);
    let (emb, levels) = (rows(4, HIDDEN, 0.25), vec![rows(4, HIDDEN, 1.5), rows(4, HIDDEN, 2.5)]);
    let no_cache = EngineConfig { cache: false, ..config() };
    let request = |item| Request { token_ids: ids.clone(), items: vec![item], ..Default::default() };
    let mut given = Engine::random(model(), 12, no_cache.clone())?;
    let want = given.run(request(deep_image(&content, Some(emb.clone()), levels.clone())))?;
    let mut encoded = Engine::random(model(), 12, no_cache)?;
    let calls = std::sync::atomic::AtomicUsize::new(0);
    let encoder = |_item: usize, _id: &_| -> omniprefix::Result<EncoderOutput> {
        calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(EncoderOutput { embeddings: emb.clone(), deepstack: levels.clone() })
    };
    let got = encoded.run(request(image(&content, None)).with_encoder(encoder))?;
    assert_same(&got, &want);
    let again = encoded.run(request(image(&content, None)).with_encoder(encoder))?;
    assert_same(&again, &want);
    let stats = encoded.stats();
    assert_eq!(
        (calls.into_inner(), stats.encoder_cache_hits, stats.encoder_calls),
        (1, 1, 1),
        "levels come from the cache the second time"
    );
    Ok(())
}

#[test]
fn encoder_runs_once_per_item_content() -> TestResult {
    let (a, b) = (pixels(3), pixels(4));
    let mut engine = Engine::random(model(), 7, config())?;
    let calls = std::sync::Mutex::new(Vec::new());
    let encode = |content: &ArrayD<u8>, engine: &mut Engine| -> TestResult<Output> {
        let request = Request {
            token_ids: with_image(&[7, 8], &[9]),
            items: vec![image(content, None)],
            ..Default::default()
        };
        Ok(engine.run(request.with_encoder(|item, identity: &ItemIdentity| {
            calls.lock().expect("no panic holds the lock").push(item);
            Ok(rows(identity.num_tokens, HIDDEN, identity.fingerprint.0 as f32))
        }))?)
    };
    let first = encode(&a, &mut engine)?;
    let again = encode(&a, &mut engine)?;
    assert_eq!(
        calls.lock().map_err(|_| "poisoned")?.len(),
        1,
        "second request of the same image skips the encoder"
    );
    assert_eq!(engine.stats().encoder_cache_hits, 1);
    assert_same(&again, &first);
    encode(&b, &mut engine)?;
    assert_eq!(calls.lock().map_err(|_| "poisoned")?.len(), 2, "different content runs the encoder");
    // Embeddings may now be omitted for a cached item.
    let plain =
        Request { token_ids: with_image(&[7, 8], &[9]), items: vec![image(&a, None)], ..Default::default() };
    assert_same(&engine.run(plain)?, &first);
    Ok(())
}

#[test]
fn an_image_sent_twice_in_one_request_is_encoded_once() -> TestResult {
    let (a, b) = (pixels(5), pixels(6));
    let mut engine = Engine::random(model(), 7, config())?;
    let calls = std::sync::Mutex::new(Vec::new());
    // a, b, a: the third item reuses the first one's rows.
    let token_ids = [with_image(&[7], &[8]), with_image(&[], &[9]), with_image(&[], &[10])].concat();
    let items = vec![image(&a, None), image(&b, None), image(&a, None)];
    let request =
        Request { token_ids, items, ..Default::default() }.with_encoder(|item, identity: &ItemIdentity| {
            calls.lock().expect("no panic holds the lock").push(item);
            Ok(rows(identity.num_tokens, HIDDEN, identity.fingerprint.0 as f32))
        });
    let out = engine.run(request)?;
    assert_eq!(calls.into_inner().map_err(|_| "poisoned")?, vec![0, 1], "item 2 has item 0's content");
    // hidden.0 is the input embeddings: item 0's rows at positions 2..6, item 2's at 16..20.
    let layer0 = out.hidden_at(omniprefix::model::CaptureName::Hidden(0)).ok_or("hidden.0 captured")?;
    for r in 0..4 {
        assert_eq!(layer0.row(2 + r), layer0.row(16 + r), "row {r} of the repeated image");
    }
    Ok(())
}

#[test]
fn prompts_longer_than_the_model_context_are_rejected_and_change_nothing() -> TestResult {
    let model = Config { max_position_embeddings: Some(12), ..model() };
    let mut engine = Engine::random(model, 8, config())?;
    engine.run(Request::text((0..9).collect()))?;
    let before = engine.stats();
    let err = engine.run(Request::text((0..13).collect())).expect_err("13 tokens > context 12");
    assert!(
        matches!(err, Error::Request(RequestError::ContextTooLong { id: None, len: 13, max: 12, .. })),
        "{err}"
    );
    // The caller never saw the number the engine gave this request: the message names none.
    let message = "a prompt of 13 positions + 0 generated positions = 13, over the model context of 12";
    assert_eq!(err.to_string(), message);
    assert_eq!(engine.stats(), before, "state changed");
    engine.validate()?;
    let out = engine.run(Request::text((0..12).collect()))?;
    assert_eq!(
        (out.prompt_len, out.num_cached_tokens),
        (12, 9),
        "a prompt of exactly the context still runs"
    );
    Ok(())
}

#[test]
fn unknown_tenants_are_rejected_and_change_nothing() -> TestResult {
    for cache in [true, false] {
        let config = EngineConfig { known_tenants: Some(vec![1, 2]), cache, ..config() };
        let mut engine = Engine::random(model(), 8, config)?;
        let request = |tenant| Request { tenant, ..Request::text((0..9).collect()) };
        engine.run(request(1))?;
        let before = engine.stats();
        let err = engine.run(request(3)).expect_err("tenant 3 is not known");
        assert!(
            matches!(err, Error::Request(RequestError::UnknownTenant { id: None, tenant: 3, .. })),
            "{err}"
        );
        assert_eq!(err.to_string(), "tenant 3 is not one of the known tenants");
        assert!(
            matches!(
                engine.run(request(0)),
                Err(Error::Request(RequestError::UnknownTenant { id: None, tenant: 0, .. }))
            ),
            "0 is not implied"
        );
        assert_eq!(engine.stats(), before, "state changed (cache {cache})");
        engine.validate()?;
        let out = engine.run(request(2))?;
        assert_eq!(out.num_cached_tokens, 0, "tenant 2 never shares tenant 1's cache");
        let again = engine.run(request(1))?;
        assert_eq!(again.num_cached_tokens, if cache { 8 } else { 0 });
    }
    Ok(())
}

/// `image` with DeepStack `levels` (each `[rows, cols]`).
fn deep_image<'a>(
    content: &'a ArrayD<u8>, embeddings: Option<Array2<f32>>, levels: Vec<Array2<f32>>,
) -> ItemInput<'a> {
    ItemInput { deepstack: Some(Arc::new(levels)), ..image(content, embeddings) }
}

#[test]
fn deepstack_mismatches_are_typed_errors_and_change_nothing() -> TestResult {
    let (a, b) = (pixels(5), pixels(6));
    let mut engine = Engine::random(model(), 9, config())?;
    engine.run(Request::text((0..9).collect()))?;
    let before = engine.stats();
    let two_images = [with_image(&[1], &[2]), with_image(&[], &[3])].concat();
    let level = |n: usize, cols: usize, seed: f32| rows(n, cols, seed);
    let emb = || Some(rows(4, HIDDEN, 0.0));
    let cases: Vec<(&str, Request<'_>)> = vec![
        (
            "levels > layers",
            Request {
                token_ids: with_image(&[1], &[2]),
                items: vec![deep_image(&a, emb(), (0..3).map(|i| level(4, HIDDEN, i as f32)).collect())],
                ..Default::default()
            },
        ),
        (
            "rows",
            Request {
                token_ids: with_image(&[1], &[2]),
                items: vec![deep_image(&a, emb(), vec![level(4, HIDDEN, 0.0), level(3, HIDDEN, 1.0)])],
                ..Default::default()
            },
        ),
        (
            "columns",
            Request {
                token_ids: with_image(&[1], &[2]),
                items: vec![deep_image(&a, emb(), vec![level(4, HIDDEN + 1, 0.0)])],
                ..Default::default()
            },
        ),
        (
            "levels differ",
            Request {
                token_ids: two_images,
                items: vec![
                    deep_image(&a, emb(), vec![level(4, HIDDEN, 0.0), level(4, HIDDEN, 1.0)]),
                    deep_image(&b, emb(), vec![level(4, HIDDEN, 2.0)]),
                ],
                ..Default::default()
            },
        ),
    ];
    for (what, request) in cases {
        let err = engine.run(request).expect_err(what);
        let expected = match what {
            "levels > layers" => matches!(
                err,
                Error::Request(RequestError::DeepStackMismatch {
                    id: None,
                    item: 0,
                    level: 2,
                    expected: 2,
                    found: 3,
                    ..
                })
            ),
            "rows" => matches!(
                err,
                Error::Request(RequestError::DeepStackMismatch {
                    id: None,
                    item: 0,
                    level: 1,
                    what: "rows",
                    expected: 4,
                    found: 3,
                    ..
                })
            ),
            "columns" => matches!(
                err,
                Error::Request(RequestError::DeepStackMismatch {
                    id: None,
                    item: 0,
                    level: 0,
                    what: "columns",
                    expected: 32,
                    found: 33,
                    ..
                })
            ),
            _ => matches!(
                err,
                Error::Request(RequestError::DeepStackMismatch {
                    id: None,
                    item: 1,
                    what: "number of levels",
                    expected: 2,
                    found: 1,
                    ..
                })
            ),
        };
        assert!(expected, "{what}: {err}");
        assert_eq!(engine.stats(), before, "{what}: state changed");
        engine.validate()?;
    }
    assert!(engine.encoder_cache().is_empty(), "rejected items are not cached");
    Ok(())
}

/// A checkpoint that names its DeepStack levels (`deepstack_visual_indexes`) takes
/// exactly that many per item: fewer or more is a typed error before anything runs.
#[test]
fn deepstack_level_count_follows_the_checkpoint() -> TestResult {
    let a = pixels(7);
    let model = Config { deepstack_levels: Some(1), ..model() };
    let mut engine = Engine::random(model, 9, config())?;
    let request = |levels: usize| Request {
        token_ids: with_image(&[1], &[2]),
        items: vec![deep_image(
            &a,
            Some(rows(4, HIDDEN, 0.0)),
            (0..levels).map(|i| rows(4, HIDDEN, i as f32)).collect(),
        )],
        ..Default::default()
    };
    for levels in [2, 0] {
        let err = engine.run(request(levels)).expect_err("the checkpoint names 1 level");
        assert!(
            matches!(&err, Error::Request(RequestError::DeepStackMismatch { id: None, item: 0, expected: 1, found, what, .. })
                if *found == levels && what.contains("deepstack_visual_indexes")),
            "{levels} levels: {err}"
        );
    }
    assert_eq!(engine.stats().sched.queries, 0, "nothing ran");
    assert_eq!(engine.run(request(1))?.prompt_len, 2 + 4 + 2);
    Ok(())
}

/// DeepStack rows change the outputs, and the encoder cache keeps them with the
/// embeddings: a later request naming the item without either gets both.
#[test]
fn deepstack_rows_are_cached_with_the_embeddings() -> TestResult {
    let content = pixels(7);
    let ids = with_image(&[4, 5, 6], &[7, 8]);
    let levels = vec![rows(4, HIDDEN, 3.0), rows(4, HIDDEN, 4.0)];
    let no_cache = EngineConfig { cache: false, ..config() };
    let mut engine = Engine::random(model(), 10, no_cache.clone())?;
    let request = |item| Request { token_ids: ids.clone(), items: vec![item], ..Default::default() };
    let with = engine.run(request(deep_image(&content, Some(rows(4, HIDDEN, 0.5)), levels)))?;
    let from_cache = engine.run(request(image(&content, None)))?;
    assert_eq!(engine.stats().encoder_cache_hits, 1);
    assert_same(&from_cache, &with);
    let mut plain_engine = Engine::random(model(), 10, no_cache)?;
    let plain = plain_engine.run(request(image(&content, Some(rows(4, HIDDEN, 0.5)))))?;
    let last = |o: &Output| o.hidden.last().map(|(_, h)| h.row(5).to_vec()).unwrap_or_default();
    assert_ne!(last(&with), last(&plain), "DeepStack changed nothing");
    assert_eq!(with.hidden[0].1, plain.hidden[0].1, "hidden.0 is before any DeepStack add");
    Ok(())
}

/// `EngineConfig::dtype` stores the matrices as asked (`Engine::random` rounds its f32
/// weights), the default is the checkpoint's own, and a config naming another dtype
/// than the thinker it is given is a typed error.
#[test]
fn engine_dtype_is_the_one_asked_for_and_a_mismatch_is_a_config_error() -> Result<(), Box<dyn StdError>> {
    use omniprefix::backend::Dtype;
    use omniprefix::backend::cpu::CpuBackend;
    use omniprefix::error::ConfigError;
    use omniprefix::model::Thinker;
    let cfg = Config::tiny_qwen3(32, 2, 4, 2, 50);
    let half =
        Engine::random(cfg.clone(), 3, EngineConfig { dtype: Some(Dtype::Bf16), ..Default::default() })?;
    assert_eq!(half.weight_dtype(), Dtype::Bf16);
    assert_eq!(Engine::random(cfg.clone(), 3, EngineConfig::default())?.weight_dtype(), Dtype::F32);
    let backend = Arc::new(CpuBackend::new());
    let thinker = Arc::new(Thinker::random(&*backend, cfg, 3)?);
    let err = Engine::new(backend, thinker, EngineConfig { dtype: Some(Dtype::F16), ..Default::default() })
        .err()
        .ok_or("mismatch accepted")?;
    assert!(
        matches!(&err, Error::Config(ConfigError::Invalid { component: "engine", field: "dtype", found, .. }) if found == "f16"),
        "{err}"
    );
    Ok(())
}

/// Weights and K/V pages are stored in a float type: an integer `dtype` or
/// `kv_dtype` is refused by name before anything loads, by every constructor.
#[test]
fn integer_engine_dtypes_are_config_errors() -> Result<(), Box<dyn StdError>> {
    use omniprefix::Dtype;
    use omniprefix::backend::cpu::CpuBackend;
    use omniprefix::error::ConfigError;
    use omniprefix::model::Thinker;
    let cfg = Config::tiny_qwen3(32, 2, 4, 2, 50);
    let backend = Arc::new(CpuBackend::new());
    let thinker = Arc::new(Thinker::random(&*backend, cfg.clone(), 3)?);
    for (field, config) in [
        ("dtype", EngineConfig { dtype: Some(Dtype::U8), ..Default::default() }),
        ("kv_dtype", EngineConfig { kv_dtype: Dtype::I32, ..Default::default() }),
        ("kv_dtype", EngineConfig { dtype: Some(Dtype::F32), kv_dtype: Dtype::I64, ..Default::default() }),
    ] {
        let want = |err: &Error| matches!(err, Error::Config(ConfigError::Invalid { component: "engine", field: f, .. }) if *f == field);
        let err =
            Engine::random(cfg.clone(), 3, config.clone()).err().ok_or("random: integer dtype accepted")?;
        assert!(want(&err), "random, {field}: {err}");
        let err = Engine::new(Arc::clone(&backend), Arc::clone(&thinker), config.clone())
            .err()
            .ok_or("new: integer dtype accepted")?;
        assert!(want(&err), "new, {field}: {err}");
    }
    // The thinker itself refuses a dtype its backend does not store.
    let err = Thinker::random_as(&*backend, cfg, 3, Some(Dtype::I32))
        .err()
        .ok_or("thinker: integer dtype accepted")?;
    assert!(
        matches!(&err, Error::Config(ConfigError::Invalid { field: "weight dtype", found, .. }) if found == "i32"),
        "{err}"
    );
    Ok(())
}

/// `EngineConfig::kv_dtype`: f16 and bf16 K/V pages give hidden states close to the
/// f32 pages' (their rounding, nothing more), and caching stays invisible to the last bit.
#[test]
fn half_precision_kv_pages_are_close_to_f32_and_cached_equals_uncached() -> Result<(), Box<dyn StdError>> {
    use omniprefix::backend::Dtype;
    let cfg = Config::tiny_qwen3(64, 2, 4, 2, 300);
    let ids: Vec<u32> = (0..90).map(|i| (i * 37 % 280) as u32).collect();
    let run = |kv_dtype: Dtype, cache: bool| -> Result<Vec<Output>, Box<dyn StdError>> {
        let mut engine = Engine::random(
            cfg.clone(),
            5,
            EngineConfig {
                scheduler: SchedulerConfig { block_size: 8, ..Default::default() },
                kv_dtype,
                cache,
                ..Default::default()
            },
        )?;
        let warm = engine.run(Request::text(ids[..50].to_vec()))?;
        let main = engine.run(Request::text(ids.clone()))?;
        Ok(vec![warm, main])
    };
    let reference = run(Dtype::F32, false)?.pop().ok_or("no output")?;
    for kv_dtype in [Dtype::F16, Dtype::Bf16] {
        let cached = run(kv_dtype, true)?.pop().ok_or("no output")?;
        let uncached = run(kv_dtype, false)?.pop().ok_or("no output")?;
        assert!(
            cached.num_cached_tokens >= 48,
            "{kv_dtype}: the warm prompt's blocks are reused: {}",
            cached.num_cached_tokens
        );
        assert_eq!(uncached.num_cached_tokens, 0);
        let tolerance = if kv_dtype == Dtype::F16 { 5e-3 } else { 3e-2 };
        for ((name, c), ((_, u), (_, r))) in
            cached.hidden.iter().zip(uncached.hidden.iter().zip(&reference.hidden))
        {
            assert!(
                c.iter().zip(u.iter()).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{kv_dtype} {name}: cached differs from uncached"
            );
            let scale = r.iter().fold(0f32, |m, x| m.max(x.abs()));
            let err = u.iter().zip(r.iter()).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
            assert!(err < tolerance, "{kv_dtype} {name}: {err} from the f32 pages");
            if name.to_string() == "final" {
                assert!(err > 0.0, "{kv_dtype}: rounding K/V changed nothing (pages not narrowed?)");
            }
        }
    }
    Ok(())
}

/// Encoder call `k`'s output for the 4-row test image: embeddings and two
/// DeepStack levels, all seeded by `k`, so the rows of two calls differ.
fn call_output(k: usize) -> EncoderOutput {
    let k = k as f32;
    EncoderOutput {
        embeddings: rows(4, HIDDEN, k),
        deepstack: vec![rows(4, HIDDEN, 10.0 + k), rows(4, HIDDEN, 20.0 + k)],
    }
}

/// Two requests for one image, both prepared before either is admitted, both
/// miss the encoder cache and run the encoder. The cache then holds one call's
/// output whole (the last admitted one's: its embeddings with its own DeepStack
/// levels), never one call's embeddings with the other's levels, and a later
/// request served from it runs as one given that call's rows.
#[test]
fn two_misses_of_one_image_cache_one_encoder_output_whole() -> TestResult {
    let content = pixels(11);
    let ids = with_image(&[4, 5], &[6]);
    // Prefix caching off: the two calls' rows have one fingerprint, so a prompt
    // cache would serve the later request whichever KV was committed first.
    let no_cache = EngineConfig { cache: false, ..config() };
    let mut engine = Engine::random(model(), 13, no_cache.clone())?;
    let calls = std::sync::atomic::AtomicUsize::new(0);
    let encoder = |_item: usize, _id: &ItemIdentity| -> omniprefix::Result<EncoderOutput> {
        Ok(call_output(calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed)))
    };
    let request = |item| Request { token_ids: ids.clone(), items: vec![item], ..Default::default() };
    let first = engine.prepare(request(image(&content, None)).with_encoder(encoder))?;
    let second = engine.prepare(request(image(&content, None)).with_encoder(encoder))?;
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::Relaxed),
        2,
        "both prepared before either was admitted: both missed"
    );
    let fp = first.prompt().items[0].fingerprint;
    engine.submit_prepared(first)?;
    assert_eq!(
        engine.encoder_cache().get(fp).as_deref(),
        Some(&call_output(0).embeddings),
        "the first admission cached call 0"
    );
    engine.submit_prepared(second)?;
    let (emb, levels) = engine.encoder_cache().get_with_deepstack(fp).ok_or("the image is cached")?;
    let want = call_output(1);
    assert_eq!(*emb, want.embeddings, "the last admission's embeddings stay");
    assert_eq!(
        levels.as_deref(),
        Some(&want.deepstack),
        "DeepStack levels of another call than the embeddings"
    );
    engine.run_all()?;
    let got = engine.run(request(image(&content, None)))?;
    assert_eq!(engine.stats().encoder_cache_hits, 1);
    let mut given = Engine::random(model(), 13, no_cache)?;
    let reference = given.run(request(deep_image(&content, Some(want.embeddings), want.deepstack)))?;
    assert_same(&got, &reference);
    Ok(())
}

/// Encoder outputs of a request that admission rejects (rows of the wrong
/// shape) are never cached: a later request for the same image runs its own
/// encoder and succeeds, instead of hitting the rejected rows.
#[test]
fn a_rejected_requests_encoder_output_is_not_cached() -> TestResult {
    let content = pixels(12);
    let ids = with_image(&[4, 5], &[6]);
    let mut engine = Engine::random(model(), 14, config())?;
    engine.run(Request::text((0..9).collect()))?;
    let request =
        || Request { token_ids: ids.clone(), items: vec![image(&content, None)], ..Default::default() };
    let good = call_output(3);
    let bad = [
        ("embedding rows", EncoderOutput { embeddings: rows(3, HIDDEN, 1.0), ..good.clone() }),
        ("embedding columns", EncoderOutput { embeddings: rows(4, HIDDEN + 1, 1.0), ..good.clone() }),
        (
            "level rows",
            EncoderOutput { deepstack: vec![rows(4, HIDDEN, 1.0), rows(3, HIDDEN, 2.0)], ..good.clone() },
        ),
        ("level columns", EncoderOutput { deepstack: vec![rows(4, HIDDEN - 1, 1.0)], ..good.clone() }),
    ];
    for (what, out) in bad {
        let before = engine.stats();
        let encoder =
            move |_item: usize, _id: &ItemIdentity| -> omniprefix::Result<EncoderOutput> { Ok(out.clone()) };
        let err = engine.run(request().with_encoder(encoder)).expect_err(what);
        assert!(
            matches!(
                err,
                Error::Request(
                    RequestError::EmbeddingMismatch { id: None, .. }
                        | RequestError::DeepStackMismatch { id: None, item: 0, .. }
                )
            ),
            "{what}: {err}"
        );
        assert!(
            engine.encoder_cache().is_empty(),
            "{what}: the rejected request's encoder output was cached"
        );
        assert_eq!(engine.stats(), before, "{what}: state changed");
        engine.validate()?;
    }
    let calls = std::sync::atomic::AtomicUsize::new(0);
    let encoder = |_item: usize, _id: &ItemIdentity| -> omniprefix::Result<EncoderOutput> {
        calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(good.clone())
    };
    let got = engine.run(request().with_encoder(encoder))?;
    assert_eq!(
        calls.into_inner(),
        1,
        "the good request ran its encoder: nothing of the rejected ones was cached"
    );
    assert_eq!((engine.stats().encoder_calls, engine.stats().encoder_cache_hits), (1, 0));
    let mut given = Engine::random(model(), 14, EngineConfig { cache: false, ..config() })?;
    let reference = given.run(Request {
        token_ids: ids.clone(),
        items: vec![deep_image(&content, Some(good.embeddings), good.deepstack)],
        ..Default::default()
    })?;
    assert_same(&got, &reference);
    Ok(())
}

/// DeepStack levels given with a request whose embeddings come from the
/// encoder cache are checked for NaN and ±Inf like any given rows: a typed
/// error naming the level and the value's place, nothing changed.
#[test]
fn non_finite_deepstack_levels_given_on_an_encoder_cache_hit_are_rejected() -> TestResult {
    use omniprefix::error::EmbeddingPart;
    let content = pixels(13);
    let ids = with_image(&[4, 5], &[6]);
    let mut engine = Engine::random(model(), 15, config())?;
    let request = |item| Request { token_ids: ids.clone(), items: vec![item], ..Default::default() };
    let cached = engine.run(request(image(&content, Some(rows(4, HIDDEN, 0.5)))))?;
    let before = engine.stats();
    for value in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut level = rows(4, HIDDEN, 2.0);
        level[[2, 5]] = value;
        let err = engine
            .run(request(deep_image(&content, None, vec![rows(4, HIDDEN, 1.0), level])))
            .expect_err("a non-finite level");
        assert!(
            matches!(
                err,
                Error::Request(RequestError::NonFiniteEmbeddings {
                    item: 0,
                    what: EmbeddingPart::DeepStack { level: 1 },
                    row: 2,
                    column: 5
                })
            ),
            "{value}: {err}"
        );
        assert_eq!(engine.stats(), before, "{value}: state changed");
        engine.validate()?;
    }
    let (_, levels) = engine
        .encoder_cache()
        .get_with_deepstack(cached_fingerprint(&engine, &content)?)
        .ok_or("still cached")?;
    assert!(levels.is_none(), "the cached entry took no levels");
    assert_same(&engine.run(request(image(&content, None)))?, &cached);
    Ok(())
}

/// The fingerprint the engine gives the test image.
fn cached_fingerprint(engine: &Engine, content: &ArrayD<u8>) -> TestResult<omniprefix::canon::Fingerprint> {
    let prepared = engine.prepare(Request {
        token_ids: with_image(&[1], &[2]),
        items: vec![image(content, Some(rows(4, HIDDEN, 0.0)))],
        ..Default::default()
    })?;
    Ok(prepared.prompt().items[0].fingerprint)
}
