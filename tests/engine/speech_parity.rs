//! The talker stage against transformers' own `generate(return_audio=True)` on the tiny
//! full Omni fixture (`fixtures/tiny/omni_audio`, made by `fixtures/make_omni_audio.py`):
//! cases `text` (system + user text), `image` (a user turn with an image) and `round2`
//! (the image round, its reply, and a second user turn).

use std::sync::Arc;

use ndarray::{ArrayD, IxDyn};
use omniprefix::backend::cpu::CpuBackend;
use omniprefix::canon::{ItemContent, ItemLayout, ItemSpec, Modality, TensorView};
use omniprefix::engine::{Engine, EngineConfig, Event, ItemInput, PlaceholderForm, Request};
use omniprefix::sample::{SamplingParams, TalkerSampling};
use omniprefix::speech::{ASSISTANT_ROWS, ChatIds, SpeechOptions, SpeechStage, TalkerLayout};
use support::reference::{Reference, TestResult, model_dir};

const MODEL: &str = "omni_audio";
const CASES: [&str; 3] = ["text", "image", "round2"];

fn reference() -> TestResult<Reference> {
    Reference::open_file(MODEL, "audio_reference.safetensors")
}

fn chat_ids() -> TestResult<ChatIds> {
    let text = std::fs::read_to_string(model_dir(MODEL).join("config.json"))?;
    Ok(ChatIds::from_config(&serde_json::from_str(&text)?)?)
}

/// An image's layout, its encoder rows and its DeepStack levels.
type ImageRows = (ItemLayout, Arc<ndarray::Array2<f32>>, Arc<Vec<ndarray::Array2<f32>>>);

/// Case `case`'s thinker prompt with its image (HF's encoder rows and DeepStack level given).
struct Case {
    ids: Vec<u32>,
    items: Vec<ImageRows>,
    content: ArrayD<u8>,
}

impl Case {
    fn open(hf: &Reference, case: &str) -> TestResult<Self> {
        let ids = hf
            .ints(&format!("{case}.input_ids"))?
            .iter()
            .map(|&t| u32::try_from(t))
            .collect::<Result<_, _>>()?;
        let mut items = Vec::new();
        if let Ok(grids) = hf.ints(&format!("{case}.image_grid_thw")) {
            for (j, grid) in grids.chunks(3).enumerate() {
                let grid_thw = [grid[0], grid[1], grid[2]].map(|g| g as u32);
                let embeds = hf.matrix(&format!("{case}.item.{j}.embeds"))?.clone();
                let deepstack = (0..)
                    .map_while(|k| hf.matrix(&format!("{case}.item.{j}.deepstack.{k}")).ok().cloned())
                    .collect();
                items.push((ItemLayout::Image { grid_thw }, Arc::new(embeds), Arc::new(deepstack)));
            }
        }
        Ok(Case { ids, items, content: ArrayD::from_elem(IxDyn(&[8, 8, 3]), 7u8) })
    }

    fn request(&self) -> Request<'_> {
        let items = self
            .items
            .iter()
            .map(|(layout, rows, deepstack)| ItemInput {
                spec: ItemSpec {
                    modality: Modality::Image,
                    layout: *layout,
                    content: ItemContent::Tensor(TensorView::U8(self.content.view())),
                    params: Default::default(),
                },
                embeddings: Some(Arc::clone(rows)),
                deepstack: Some(Arc::clone(deepstack)),
                routing_hash: None,
            })
            .collect();
        Request {
            token_ids: self.ids.clone(),
            placeholders: PlaceholderForm::Expanded,
            items,
            ..Default::default()
        }
    }
}

/// The talker's input ids and rotary positions (prefill rows and the decode delta) equal
/// HF's for every case: user turns only (the system turn and round 1's reply dropped), the
/// image's M-RoPE rows recomputed over the talker's own shorter sequence.
#[test]
fn the_talker_layout_equals_hf_ids_and_positions() -> TestResult {
    let hf = reference()?;
    let chat = chat_ids()?;
    let engine = Engine::from_dir(&model_dir(MODEL), EngineConfig::default())?;
    for case in CASES {
        let c = Case::open(&hf, case)?;
        let prepared = engine.prepare(c.request())?;
        let layout = TalkerLayout::of(prepared.prompt(), &chat, engine.tokens())?;
        let want_ids: Vec<u32> =
            hf.ints(&format!("{case}.talker_input_ids"))?.iter().map(|&t| t as u32).collect();
        assert_eq!(layout.ids, want_ids, "{case}: talker input ids");
        assert_eq!(layout.prefill_rows(), want_ids.len());
        assert_eq!(
            layout.is_item.iter().filter(|&&m| m).count(),
            c.items.iter().map(|i| i.1.nrows()).sum::<usize>()
        );
        let want_pos = hf.ints(&format!("{case}.talker_position_ids"))?;
        let axes = layout.positions.axes();
        let rows = layout.prefill_rows();
        for (a, axis) in axes.iter().enumerate() {
            assert_eq!(axis[..], want_pos[a * rows..(a + 1) * rows], "{case}: axis {a}");
        }
        let delta = hf.ints(&format!("{case}.talker_rope_delta"))?[0];
        assert_eq!(layout.positions.rope_delta().unwrap_or(0), delta, "{case}: rope delta");
        assert_eq!(layout.ids[rows - ASSISTANT_ROWS..], [chat.tts_pad_token_id; ASSISTANT_ROWS]);
    }
    Ok(())
}

/// HF's generate kwargs of the fixture (`audio_reference.json`): the thinker's reply
/// length and suppressed ids, the talker's length cap.
struct Recorded {
    thinker_max_new_tokens: usize,
    thinker_suppress: Vec<u32>,
    talker_max_new_tokens: usize,
}

impl Recorded {
    /// HF's thinker settings of the fixture: greedy, its reply length, its suppressed ids.
    fn thinker_params(&self) -> SamplingParams {
        SamplingParams {
            suppress_ids: self.thinker_suppress.clone(),
            ..SamplingParams::greedy(self.thinker_max_new_tokens)
        }
    }

    /// HF's talker settings of the fixture: greedy, its step cap.
    fn greedy_talker(&self) -> TalkerSampling {
        TalkerSampling { max_new_tokens: self.talker_max_new_tokens, ..TalkerSampling::greedy() }
    }
}

fn recorded() -> TestResult<Recorded> {
    let text = std::fs::read_to_string(model_dir(MODEL).join("audio_reference.json"))?;
    let json: serde_json::Value = serde_json::from_str(&text)?;
    let kwargs = &json["generate_kwargs"];
    let number = |v: &serde_json::Value| v.as_u64().map(|n| n as usize).ok_or("not a number");
    Ok(Recorded {
        thinker_max_new_tokens: number(&kwargs["thinker_max_new_tokens"])?,
        thinker_suppress: serde_json::from_value(kwargs["thinker_suppress_tokens"].clone())?,
        talker_max_new_tokens: number(&json["cases"]["text"]["talker_max_new_tokens"])?,
    })
}

/// The whole chain against HF's `generate(return_audio=True)`, greedy, through the engine:
/// our thinker's reply, then the talker's prompt from its rows (accept-layer rows at the
/// image, projected embeddings elsewhere), the talker's codes (equal, code for code) and
/// code2wav's waveform (within 1e-4), streamed as `Event::Audio` chunks whose concatenation
/// is the output's waveform.
#[test]
fn thinker_talker_and_code2wav_equal_hf_audio() -> TestResult {
    let hf = reference()?;
    let rec = recorded()?;
    let mut engine = Engine::from_dir(&model_dir(MODEL), EngineConfig::default())?;
    let options = SpeechOptions { talker: rec.greedy_talker(), ..SpeechOptions::default() };
    for case in CASES {
        let c = Case::open(&hf, case)?;
        let params = rec.thinker_params();
        let id = engine.submit(c.request().generate(params).speak(options.clone()))?;
        let mut chunks = Vec::new();
        let mut output = None;
        while engine.has_pending() {
            for event in engine.step()? {
                match event {
                    Event::Audio(a) if a.request == id => {
                        assert_eq!(a.offset, chunks.iter().map(Vec::len).sum::<usize>(), "{case}: offsets");
                        assert_eq!(a.sample_rate, 24_000, "{case}: the chunk says its rate");
                        chunks.push(a.samples);
                    }
                    Event::Finished(out) => output = Some(out),
                    _ => {}
                }
            }
        }
        let out = output.ok_or("no output")?;
        let want_seq: Vec<u32> =
            hf.ints(&format!("{case}.thinker_sequences"))?.iter().map(|&t| t as u32).collect();
        assert_eq!(out.tokens[..], want_seq[c.ids.len()..], "{case}: thinker reply");
        let speech = out.speech.as_ref().ok_or("no speech")?;
        let want_codes = hf.ints(&format!("{case}.codes"))?;
        let frames = speech.codes.ncols();
        let got_codes: Vec<i64> = speech.codes.iter().map(|&c| i64::from(c)).collect();
        assert_eq!(got_codes, want_codes, "{case}: codes [16, {frames}]");
        let want_wav = hf.matrix(&format!("{case}.waveform"))?;
        assert_eq!(speech.audio.len(), want_wav.ncols(), "{case}: samples");
        let worst = speech.audio.iter().zip(want_wav.iter()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!(
            "{case}: {frames} frames, {} samples, max |ours - HF| = {worst:.2e}, {} chunks, ttfa {:?}",
            speech.audio.len(),
            chunks.len(),
            out.timings.ttfa
        );
        assert!(worst <= 1e-4, "{case}: waveform differs by {worst}");
        assert_eq!(chunks.concat(), speech.audio, "{case}: the streamed chunks are the waveform");
        assert!(chunks.len() > 1, "{case}: audio came in chunks");
        assert!(out.timings.ttfa.is_some_and(|t| t <= out.timings.total));
    }
    Ok(())
}

/// Each bad speech request is a typed error naming the problem, with nothing cached: audio
/// of a checkpoint without a talker, an unknown speaker, talker options out of range, audio
/// on a prefill, a prompt with no assistant turn, and (for the thinker) a `suppress_ids`
/// that bans every id.
#[test]
fn bad_speech_requests_are_typed_errors_that_change_nothing() -> TestResult {
    use omniprefix::Error;
    use omniprefix::error::RequestError;
    let hf = reference()?;
    let c = Case::open(&hf, "text")?;
    let mut engine = Engine::from_dir(&model_dir(MODEL), EngineConfig::default())?;
    let greedy = || c.request().generate(SamplingParams::greedy(4));
    let before = engine.stats();
    let speaker = SpeechOptions { speaker: "nobody".into(), ..SpeechOptions::default() };
    match engine.submit(greedy().speak(speaker)) {
        Err(Error::Request(RequestError::UnknownSpeaker { speaker, known })) => {
            assert_eq!(speaker, "nobody");
            assert!(known.contains(&"ethan".to_string()), "{known:?}");
        }
        other => return Err(format!("unknown speaker: {other:?}").into()),
    }
    for (field, talker) in [
        ("temperature", TalkerSampling { temperature: -1.0, ..TalkerSampling::default() }),
        ("top_p", TalkerSampling { top_p: 0.0, ..TalkerSampling::default() }),
        ("repetition_penalty", TalkerSampling { repetition_penalty: f32::NAN, ..TalkerSampling::default() }),
        ("max_new_tokens", TalkerSampling { max_new_tokens: 0, ..TalkerSampling::default() }),
    ] {
        let options = SpeechOptions { talker, ..SpeechOptions::default() };
        match engine.submit(greedy().speak(options)) {
            Err(Error::Request(RequestError::InvalidSampling { param, .. })) if param == field => {}
            other => return Err(format!("talker {field}: {other:?}").into()),
        }
    }
    let chunk = SpeechOptions { first_chunk: 0, ..SpeechOptions::default() };
    assert!(matches!(
        engine.submit(greedy().speak(chunk)),
        Err(Error::Request(RequestError::InvalidSampling { param: "first_chunk", .. }))
    ));
    assert!(matches!(
        engine.submit(c.request().speak(SpeechOptions::default())),
        Err(Error::Request(RequestError::AudioNeedsGeneration))
    ));
    let no_turn = Request { token_ids: c.ids[..c.ids.len() - 3].to_vec(), ..c.request() };
    assert!(matches!(
        engine.submit(no_turn.generate(SamplingParams::greedy(4)).speak(SpeechOptions::default())),
        Err(Error::Request(RequestError::NoAssistantTurn { .. }))
    ));
    let vocab = engine.model_config().vocab_size as u32;
    let ban_all = SamplingParams { suppress_ids: (0..vocab).collect(), ..SamplingParams::greedy(4) };
    assert!(matches!(
        engine.submit(c.request().generate(ban_all).speak(SpeechOptions::default())),
        Err(Error::Request(RequestError::InvalidSampling { param: "suppress_ids", .. }))
    ));
    assert_eq!(engine.stats(), before, "a rejected request changes no cache state");
    assert!(!engine.has_pending());

    // A checkpoint without a talker.
    let mut plain = Engine::from_dir(&model_dir("omni_thinker"), EngineConfig::default())?;
    let text = Request::text(vec![1, 2, 3]).generate(SamplingParams::greedy(2));
    assert!(matches!(
        plain.submit(text.speak(SpeechOptions::default())),
        Err(Error::Request(RequestError::NoTalker { .. }))
    ));
    Ok(())
}

/// The talker's prefix cache on the fixture: round 2 (`round2`: the image round, its reply
/// and a second user turn) reuses round 1's (`image`) talker KV for every full block of
/// round 1's user rows (the image's rows keyed by their accept-layer rows, which the
/// thinker's cache hands back bit for bit), and its codes equal both a cache-off run and
/// HF's; with the talker's blocks evicted (the thinker's cache untouched: it still reuses
/// round 1) round 2 recomputes its user rows and its codes are unchanged.
#[test]
fn round2_reuses_round1_talker_kv_and_its_codes_stay() -> TestResult {
    use omniprefix::canon::{FingerprintKey, Fingerprinter, ValidationPolicy};
    use omniprefix::index::radix::{RadixConfig, RadixIndex};
    use omniprefix::model::talker::TalkerKv;
    use omniprefix::sched::{TalkerCache, TalkerCacheConfig, talker_key};

    let hf = reference()?;
    let rec = recorded()?;
    let dir = model_dir(MODEL);
    let probe = Engine::from_dir(&dir, EngineConfig::default())?;
    let (backend, thinker) = probe.runner().shared();
    let stage = SpeechStage::from_dir(backend.clone(), thinker, &dir)?;
    let config = EngineConfig { capture: Some(vec![stage.accept_capture()]), ..EngineConfig::default() };
    let mut engine = Engine::from_dir(&dir, config)?;
    let fingerprinter = Fingerprinter::new(FingerprintKey::fixed(0), 1, ValidationPolicy::SecondDigest)?;
    let sampling = rec.greedy_talker();
    let speaker = stage.checks().speaker_id("ethan")?;
    let talker = stage.talker();
    let (block_size, num_blocks) = (4, 256);
    let index = RadixIndex::new(RadixConfig { block_size })?;
    let mut cache = TalkerCache::new(TalkerCacheConfig { num_blocks, block_size }, Box::new(index))?;
    let mut pages = talker.alloc_pages(&backend, num_blocks, block_size)?;
    let mut round1_rows = 0;
    for (visit, case) in ["image", "round2", "round2"].into_iter().enumerate() {
        if visit == 2 {
            assert!(cache.evict(usize::MAX)? > 0, "round 2's talker blocks were cached");
        }
        let c = Case::open(&hf, case)?;
        let params = rec.thinker_params();
        let prepared = engine.prepare(c.request().generate(params))?;
        let prompt = prepared.prompt().clone();
        let layout = TalkerLayout::of(&prompt, stage.chat_ids(), engine.tokens())?;
        let id = engine.submit_prepared(prepared)?;
        let out = engine.run_all()?.into_iter().find(|o| o.request == id).ok_or("no output")?;
        if visit > 0 {
            assert!(out.num_cached_tokens > 0, "{case}: the thinker's cache reused round 1");
        }
        let accept = out.hidden_at(stage.accept_capture()).ok_or("no accept-layer capture")?;
        let inputs = stage.inputs(&layout, &c.ids, &out.tokens, accept.view(), speaker)?;
        let want = talker.generate(&backend, &inputs, &sampling, |_: &[u32]| Ok(()))?;
        let key = talker_key(&layout, &prompt, accept.view(), &fingerprinter, engine.tokens())?;
        assert_eq!(key.len(), layout.user.len());
        let total = layout.prefill_rows() + sampling.max_new_tokens - 1;
        let mut slot = cache.begin(key, total)?.ok_or("the talker pool is short")?;
        let expected = match visit {
            1 => round1_rows / block_size * block_size,
            _ => 0,
        };
        eprintln!(
            "{case} (visit {visit}): {} talker user rows, {} cached (expected {expected}); thinker cached {}",
            layout.user.len(),
            slot.num_cached(),
            out.num_cached_tokens
        );
        assert_eq!(slot.num_cached(), expected, "{case} (visit {visit}): cached talker rows");
        let kv = TalkerKv {
            pages: &mut pages,
            block_table: slot.block_table().clone(),
            num_cached: slot.num_cached(),
        };
        let got = talker.generate_in(&backend, kv, &inputs, &sampling, |_: &[u32]| Ok(()))?;
        assert_eq!(got.codes, want.codes, "{case} (visit {visit}): codes with the talker cache");
        let hf_codes = hf.ints(&format!("{case}.codes"))?;
        assert_eq!(
            got.codes.iter().map(|&c| i64::from(c)).collect::<Vec<_>>(),
            hf_codes,
            "{case}: HF's codes"
        );
        cache.commit(&mut slot)?;
        cache.release(slot)?;
        cache.validate()?;
        if visit == 0 {
            round1_rows = layout.user.len();
        }
    }
    let stats = cache.stats();
    assert_eq!((stats.queries, stats.hits, stats.live_slots), (3, 1, 0));
    Ok(())
}

/// Runs `case` through `engine` asking for audio; every event in order and the output.
fn speak_case<B: omniprefix::backend::Backend>(
    engine: &mut Engine<B>, hf: &Reference, rec: &Recorded, case: &str, options: &SpeechOptions,
) -> TestResult<(Vec<Event>, omniprefix::engine::Output)> {
    let c = Case::open(hf, case)?;
    let params = rec.thinker_params();
    let id = engine.submit(c.request().generate(params).speak(options.clone()))?;
    let mut events = Vec::new();
    while engine.has_pending() {
        events.extend(engine.step()?.into_iter().filter(|e| e.request() == id));
    }
    let out = match events.pop() {
        Some(Event::Finished(out)) => out,
        other => return Err(format!("{case}: the last event is {other:?}").into()),
    };
    Ok((events, out))
}

/// The talker starts while the thinker still generates (the first audio comes in the step
/// that sampled the reply's first token), with one-frame code2wav chunks; the talker's prefix cache hands
/// round 2 every full block of round 1's user rows, and with caching off nothing; codes and
/// audio are the same in all three runs and equal HF's.
#[test]
fn the_talker_streams_beside_the_thinker_and_its_cache_is_invisible() -> TestResult {
    let hf = reference()?;
    let rec = recorded()?;
    let options =
        SpeechOptions { talker: rec.greedy_talker(), first_chunk: 1, chunk: 2, ..SpeechOptions::default() };
    let mut runs = Vec::new();
    for cache in [true, false] {
        let mut engine =
            Engine::from_dir(&model_dir(MODEL), EngineConfig { cache, ..EngineConfig::default() })?;
        let (events, _) = speak_case(&mut engine, &hf, &rec, "image", &options)?;
        // The first frame needs only the reply's first token, as soon as the sampler says
        // the reply goes on: the talker starts in the step that sampled it, and one frame is
        // a chunk, so the first audio comes before the reply's second token.
        let first_audio = events.iter().position(|e| matches!(e, Event::Audio(_))).ok_or("no audio")?;
        let tokens: Vec<usize> =
            events.iter().enumerate().filter(|(_, e)| matches!(e, Event::Token(_))).map(|(i, _)| i).collect();
        assert!(tokens.len() > 2, "the reply is long enough to tell");
        assert!(
            tokens[0] < first_audio && first_audio < tokens[1],
            "audio at event {first_audio}, the reply's tokens at {tokens:?}"
        );
        // The talker's accept layer is kept at the image's positions only: not paged
        // (the capture is the default one), one row per item position, none for text.
        let image = Case::open(&hf, "image")?;
        let item_positions =
            image.ids.iter().filter(|&&t| engine.tokens().placeholder_modality(t).is_some()).count();
        let hidden = engine.model_config().hidden_size;
        let layers = engine.model_config().num_hidden_layers;
        assert_eq!(engine.capture(), &omniprefix::model::CaptureSpec::default_for(layers));
        let held = engine.stats().item_capture.ok_or("no item capture")?;
        assert_eq!((held.rows, held.bytes), (item_positions, item_positions * hidden * 4), "cache {cache}");
        assert!(
            0 < item_positions && item_positions < image.ids.len(),
            "{item_positions} of {}",
            image.ids.len()
        );
        let (_, out) = speak_case(&mut engine, &hf, &rec, "round2", &options)?;
        let speech = out.speech.ok_or("no speech")?;
        let block = EngineConfig::default().talker_cache.block_size;
        let want_cached = if cache { 57 / block * block } else { 0 };
        assert_eq!(speech.talker_cached_rows, want_cached, "cache {cache}: talker rows reused");
        let stats = engine.stats().talker.ok_or("no talker stats")?;
        assert_eq!(stats.hit_rows as usize, want_cached);
        assert!(engine.metrics()?.contains("omniprefix_talker_prefix_cache_hits_total"));
        assert!(engine.metrics()?.contains("omniprefix_time_to_first_audio_seconds_count 2"));
        let hf_codes = hf.ints("round2.codes")?;
        assert_eq!(speech.codes.iter().map(|&c| i64::from(c)).collect::<Vec<_>>(), hf_codes, "cache {cache}");
        runs.push(speech.audio);
    }
    assert_eq!(runs[0], runs[1], "the talker's cache changes no sample");
    Ok(())
}

/// First audio first: while `image` awaits its first audio, `text`, already heard, holds
/// its due code2wav decodes (an allowance of an hour holds them until `image` is heard),
/// then sends them in one chunk; with `audio_yield: None` it sends them as they come due,
/// which is what makes this test able to fail. Either way each reply's codes are HF's, its
/// audio is one code2wav pass over them, sample for sample, and its chunks concatenate to it.
#[test]
fn a_heard_reply_holds_its_decodes_while_another_awaits_first_audio() -> TestResult {
    let hf = reference()?;
    let rec = recorded()?;
    // One-frame chunks: without the yield, every frame of `text` is a decode.
    let options =
        SpeechOptions { talker: rec.greedy_talker(), first_chunk: 1, chunk: 1, ..SpeechOptions::default() };
    let code2wav = omniprefix::model::code2wav::Code2Wav::from_dir(&CpuBackend, &model_dir(MODEL))?;
    let (text, image) = (Case::open(&hf, "text")?, Case::open(&hf, "image")?);
    for audio_yield in [Some(std::time::Duration::from_secs(3600)), None] {
        let config = EngineConfig { audio_yield, ..EngineConfig::default() };
        let mut engine = Engine::from_dir(&model_dir(MODEL), config)?;
        let a = engine.submit(text.request().generate(rec.thinker_params()).speak(options.clone()))?;
        let heard = |events: &[Event], id| {
            events.iter().position(|e| matches!(e, Event::Audio(x) if x.request == id))
        };
        let mut events = Vec::new();
        while heard(&events, a).is_none() {
            events.extend(engine.step()?);
        }
        let b = engine.submit(image.request().generate(rec.thinker_params()).speak(options.clone()))?;
        let submitted = events.len();
        while engine.has_pending() {
            events.extend(engine.step()?);
        }
        let b_heard = submitted + heard(&events[submitted..], b).ok_or("no audio for image")?;
        let a_chunks_meanwhile = events[submitted..b_heard]
            .iter()
            .filter(|e| matches!(e, Event::Audio(x) if x.request == a))
            .count();
        let a_chunk = |e: &Event| match e {
            Event::Audio(x) if x.request == a => Some(x.samples.len()),
            _ => None,
        };
        let largest_before = events[..submitted].iter().filter_map(a_chunk).max().unwrap_or(0);
        let first_after = events[b_heard..].iter().find_map(a_chunk).ok_or("text had nothing left to say")?;
        match audio_yield {
            Some(_) => {
                assert_eq!(a_chunks_meanwhile, 0, "text decoded while image awaited its first audio");
                assert!(first_after > largest_before, "the held frames come out in one chunk");
            }
            None => assert!(
                a_chunks_meanwhile > 0,
                "text had no chunk due while image awaited: the test cannot tell"
            ),
        }
        for (id, case) in [(a, "text"), (b, "image")] {
            let streamed: Vec<f32> = events
                .iter()
                .filter_map(|e| match e {
                    Event::Audio(x) if x.request == id => Some(x.samples.iter().copied()),
                    _ => None,
                })
                .flatten()
                .collect();
            let out = events
                .iter()
                .find_map(|e| match e {
                    Event::Finished(o) if o.request == id => Some(o),
                    _ => None,
                })
                .ok_or("no output")?;
            let speech = out.speech.as_ref().ok_or("no speech")?;
            let codes = speech.codes.mapv(i64::from);
            assert_eq!(
                codes.iter().copied().collect::<Vec<_>>(),
                hf.ints(&format!("{case}.codes"))?,
                "{case}"
            );
            let one_pass = code2wav.forward(&CpuBackend, codes.view())?;
            assert_eq!(speech.audio, one_pass, "{case}, yield {audio_yield:?}: one pass over its codes");
            assert_eq!(streamed, one_pass, "{case}: its chunks concatenate to its audio");
        }
    }
    Ok(())
}

/// A talker pool of no blocks or no rows a block is refused when the engine is
/// built, as a `ConfigError` naming the field (it reached the backend's page
/// allocation before, as an internal error).
#[test]
fn a_talker_pool_of_zero_blocks_or_rows_is_a_config_error() -> TestResult {
    use omniprefix::error::ConfigError;
    use omniprefix::sched::TalkerCacheConfig;
    for (num_blocks, block_size, want) in [(0, 16, "num_blocks"), (16, 0, "block_size")] {
        let config = EngineConfig {
            talker_cache: TalkerCacheConfig { num_blocks, block_size },
            ..EngineConfig::default()
        };
        match Engine::from_dir(&model_dir(MODEL), config) {
            Err(omniprefix::Error::Config(ConfigError::Invalid { field, .. })) => assert_eq!(field, want),
            Err(e) => return Err(format!("{want}: expected a config error, got {e}").into()),
            Ok(_) => return Err(format!("{want}: an engine over an empty talker pool").into()),
        }
    }
    Ok(())
}

/// The talker's cache outlives its engine through the disk tier: round 1 on one
/// engine, which spills both stages' caches to the tier when dropped; round 2 on
/// another engine on the same directory and key reads every full block of round
/// 1's talker user rows from the tier, and its codes equal HF's and its audio the
/// same reply's without caching.
#[test]
fn the_talker_cache_outlives_its_engine_through_the_disk_tier() -> TestResult {
    let hf = reference()?;
    let rec = recorded()?;
    let options = SpeechOptions { talker: rec.greedy_talker(), ..SpeechOptions::default() };
    let dir = tempfile::tempdir()?;
    let config = || EngineConfig {
        tier_dir: Some(dir.path().join("tier")),
        fingerprint_key: omniprefix::canon::FingerprintKey::fixed(5),
        ..EngineConfig::default()
    };
    let mut first = Engine::from_dir(&model_dir(MODEL), config())?;
    speak_case(&mut first, &hf, &rec, "image", &options)?;
    drop(first);
    let mut second = Engine::from_dir(&model_dir(MODEL), config())?;
    let (_, out) = speak_case(&mut second, &hf, &rec, "round2", &options)?;
    let speech = out.speech.ok_or("no speech")?;
    let block = EngineConfig::default().talker_cache.block_size;
    assert_eq!(speech.talker_cached_rows, 57 / block * block, "round 1's full talker blocks, from the tier");
    let talker = second.stats().talker.ok_or("no talker stats")?;
    assert_eq!(talker.tier_hit_rows as usize, 57 / block * block);
    let metrics = second.metrics()?;
    assert!(
        metrics.contains(&format!("omniprefix_talker_tier_hits_total {}\n", 57 / block * block)),
        "{metrics}"
    );
    assert!(out.num_cached_tokens > 0, "the thinker's blocks came back too");
    assert_eq!(second.tier_stats().ok_or("no tier")?.files.errors, 0);
    assert_eq!(speech.codes.iter().map(|&c| i64::from(c)).collect::<Vec<_>>(), hf.ints("round2.codes")?);
    let mut uncached =
        Engine::from_dir(&model_dir(MODEL), EngineConfig { cache: false, ..EngineConfig::default() })?;
    let (_, want) = speak_case(&mut uncached, &hf, &rec, "round2", &options)?;
    assert_eq!(speech.audio, want.speech.ok_or("no speech")?.audio, "the tier changes no sample");
    Ok(())
}

/// The whole chain on the wgpu backend: the thinker and the talker's decoders on its
/// kernels, the talker's projections, code predictor glue and code2wav's convolutions
/// through the trait's host fallbacks; codes equal HF's, audio within 1e-4.
#[cfg(feature = "wgpu")]
#[test]
fn the_speech_chain_runs_on_wgpu() -> TestResult {
    let Some(gpu) = crate::shared_gpu::gpu() else { return Ok(()) };
    let hf = reference()?;
    let rec = recorded()?;
    let mut engine = Engine::from_dir_on(Arc::new(gpu), &model_dir(MODEL), EngineConfig::default())?;
    let options = SpeechOptions { talker: rec.greedy_talker(), ..SpeechOptions::default() };
    for case in CASES {
        let (_, out) = speak_case(&mut engine, &hf, &rec, case, &options)?;
        let speech = out.speech.ok_or("no speech")?;
        let codes: Vec<i64> = speech.codes.iter().map(|&c| i64::from(c)).collect();
        assert_eq!(codes, hf.ints(&format!("{case}.codes"))?, "wgpu {case}: codes");
        let want = hf.matrix(&format!("{case}.waveform"))?;
        assert_eq!(speech.audio.len(), want.ncols());
        let worst = speech.audio.iter().zip(want.iter()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("wgpu {case}: max |ours - HF| = {worst:.2e}");
        assert!(worst <= 1e-4, "wgpu {case}: waveform differs by {worst}");
    }
    Ok(())
}
