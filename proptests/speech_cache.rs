//! Invariant 7 through the whole engine: speech is invisible to caching. Two random voice
//! chats (2 or 3 rounds each; a round re-sends the previous prompt, its reply, `<|im_end|>`
//! and a new user turn of random text with an image given as embeddings sometimes; the
//! second chat's first user turn is the first's, image and all, now and then, under
//! another system turn) run on a random tiny Omni thinker with a random tiny talker and
//! code2wav beside it, their rounds alone or both chats' at once (staggered by random step
//! counts, and a round sent twice sometimes, so two talkers miss on one prompt), with random thinker
//! chunking (block size, step budget, prefill cap, batch width), random talker block
//! sizes, small thinker and/or talker pools (so blocks of one, the other or both get
//! evicted), random `first_chunk`/`chunk`, greedy and seeded thinker and talker sampling.
//! Every request's reply, codes and audio equal a cache-off engine's (each request alone,
//! default chunking, big pools) bit for bit; the streamed `Event::Audio` chunks come at
//! their offsets and concatenate to `Output::speech.audio` (in both engines); the
//! talker's cached rows are whole blocks of the user rows (none with caching off), and a
//! round reuses every full block of its chat's previous round's user rows when no talker
//! block was evicted since.
//!
//! Over a run, some round must reuse talker rows (or the test is vacuous); two fixed
//! cases pin the asymmetric evictions: the talker's blocks evicted while the thinker's
//! stay, and the thinker's evicted while the talker's stay (and still reused).
//!
//! Cases default to 32 (about a second on 2 cores; 600 take ~35 s); scale with
//! `PROPTEST_CASES`. A planted `TalkerCache::begin` that reports one cached row too many
//! fails all three tests at once.

use std::collections::BTreeMap;
use std::sync::Arc;

use ndarray::{Array2, ArrayD, IxDyn};
use omniprefix::backend::cpu::CpuBackend;
use omniprefix::canon::{ItemContent, ItemLayout, ItemSpec, Modality, TensorView};
use omniprefix::engine::{Engine, EngineConfig, EngineStats, Event, ItemInput, Output, Request};
use omniprefix::model::code2wav::{Code2Wav, Code2WavConfig};
use omniprefix::model::talker::{Talker, TalkerConfig};
use omniprefix::model::{Config, Thinker};
use omniprefix::prompt::OmniTokens;
use omniprefix::sample::{SamplingParams, TalkerSampling};
use omniprefix::sched::{PrefillCap, SchedulerConfig, TalkerCacheConfig};
use omniprefix::speech::{ASSISTANT_ROWS, ChatIds, SpeechOptions, SpeechStage};
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, FileFailurePersistence, TestRunner};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use support::images::image_markers;
use support::sampling::greedy_or_seeded;

const HIDDEN: usize = 32;
const VOCAB: u32 = 512;
/// Text ids (prompt and reply) stay in here: below are the chat markers, above the tiny
/// vocabulary's special ids (500..507).
const TEXT: std::ops::Range<u32> = 10..480;
/// The stage's chat ids, which the prompts below are written with: `<|im_start|>` 1,
/// `user` 2, `assistant` 3 (then `system` 4, `\n` 5, `<|im_end|>` 6 below).
const CHAT: ChatIds = ChatIds::tiny();
const SYSTEM: u32 = 4;
const NEWLINE: u32 = 5;
const IM_END: u32 = 6;
/// Steps one wave may take before the test calls it a hang.
const MAX_STEPS: usize = 20_000;

/// One round of a chat: the user turn (text, an optional image of `h * w` rows, text),
/// how the thinker replies and how the reply is spoken.
#[derive(Debug, Clone)]
struct Turn {
    a: Vec<u32>,
    image: Option<(u32, u32)>,
    b: Vec<u32>,
    /// Reply tokens (exact: EOS is suppressed and ignored).
    reply: usize,
    /// `None`: greedy.
    thinker_seed: Option<u64>,
    /// `None`: greedy.
    talker_seed: Option<u64>,
    talker_tokens: usize,
    first_chunk: usize,
    chunk: usize,
}

#[derive(Debug, Clone)]
struct Chat {
    system: Vec<u32>,
    turns: Vec<Turn>,
}

/// One wave of requests in flight together.
#[derive(Debug, Clone, Copy)]
struct Wave {
    /// 0 and 1: that chat's next round alone; 2: both chats'.
    chats: u8,
    /// The wave's first request goes twice, right after itself (an identical prompt in
    /// flight: both talkers miss, and the second to commit gets the index's copies of its
    /// blocks, its own going back to the pool while it still decodes).
    twin: bool,
    /// Engine steps between the first submission and the second, and the second and the third.
    delay: [usize; 2],
}

/// Pool sizes: a pool of `Some(spare)` holds the largest request's blocks and `spare` more
/// (small: evictions), `None` one big enough to keep everything.
#[derive(Debug, Clone)]
struct Case {
    chats: [Chat; 2],
    /// Chat 1's first user turn is chat 0's (text and image).
    share_first: bool,
    /// Which chats send their next round together; the rounds left after these go both at once.
    waves: Vec<Wave>,
    block_size: usize,
    budget: usize,
    prefill_cap: Option<usize>,
    seqs: usize,
    thinker_spare: Option<usize>,
    talker_block_size: usize,
    talker_spare: Option<usize>,
    /// The caching engine has a disk tier under both pools (evicted blocks come back from it).
    tier: bool,
    /// With a tier: after this wave the caching engine is dropped (spilling both caches) and
    /// rebuilt on the same directory and key, so later rounds read from the tier into fresh pages.
    restart_after: Option<usize>,
    /// DeepStack levels of the images (0..=2).
    deepstack: usize,
    seed: u64,
}

fn text(len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(TEXT, len)
}

fn turn() -> impl Strategy<Value = Turn> {
    (
        (text(0..5), prop::option::weighted(0.4, (1..3u32, 1..3u32)), text(1..5)),
        prop_oneof![1 => Just(1usize), 6 => 2..6usize],
        prop::option::of(any::<u64>()),
        prop::option::of(any::<u64>()),
        2..6usize,
        1..4usize,
        1..4usize,
    )
        .prop_map(
            |((a, image, b), reply, thinker_seed, talker_seed, talker_tokens, first_chunk, chunk)| Turn {
                a,
                image,
                b,
                reply,
                thinker_seed,
                talker_seed,
                talker_tokens,
                first_chunk,
                chunk,
            },
        )
}

fn chat() -> impl Strategy<Value = Chat> {
    (text(1..4), prop::collection::vec(turn(), 2..4)).prop_map(|(system, turns)| Chat { system, turns })
}

fn spare() -> impl Strategy<Value = Option<usize>> {
    prop_oneof![2 => (0..3usize).prop_map(Some), 1 => Just(None)]
}

fn case() -> impl Strategy<Value = Case> {
    (
        [chat(), chat()],
        prop::bool::weighted(0.3),
        prop::collection::vec(
            (0..3u8, prop::bool::weighted(0.4), (prop_oneof![Just(0usize), 0..12usize], 0..12usize))
                .prop_map(|(chats, twin, (d0, d1))| Wave { chats, twin, delay: [d0, d1] }),
            0..6,
        ),
        (
            prop::sample::select(vec![1usize, 2, 4, 8, 16]),
            1..32usize,
            prop::option::of(1..32usize),
            1..4usize,
        ),
        (spare(), 1..9usize, spare(), prop::bool::weighted(0.4), prop::option::weighted(0.5, 0..4usize)),
        0..3usize,
        any::<u64>(),
    )
        .prop_map(
            |(chats, share_first, waves, (block_size, budget, cap, seqs), pools, deepstack, seed)| {
                let (thinker_spare, talker_block_size, talker_spare, tier, restart_after) = pools;
                Case {
                    chats,
                    share_first,
                    waves,
                    block_size,
                    budget,
                    prefill_cap: cap.map(|c| 1 + (c - 1) % budget),
                    seqs,
                    thinker_spare,
                    talker_block_size,
                    talker_spare,
                    tier,
                    restart_after: restart_after.filter(|_| tier),
                    deepstack,
                    seed,
                }
            },
        )
}

impl Case {
    /// Round `round` of chat `chat`, with chat 0's first turn in chat 1 when shared.
    fn turn(&self, chat: usize, round: usize) -> (&Turn, ImageKey) {
        match (chat, round) {
            (1, 0) if self.share_first => (&self.chats[0].turns[0], (0, 0)),
            _ => (&self.chats[chat].turns[round], (chat, round)),
        }
    }

    /// How each round is sampled and spoken (chat 1's own, even over a shared turn).
    fn own(&self, chat: usize, round: usize) -> &Turn {
        &self.chats[chat].turns[round]
    }

    fn rounds(&self, chat: usize) -> usize {
        self.chats[chat].turns.len()
    }

    /// Thinker positions of a user turn, the image expanded.
    fn user_rows(&self, chat: usize, round: usize) -> usize {
        let (t, _) = self.turn(chat, round);
        3 + t.a.len() + t.b.len() + 2 + t.image.map_or(0, |(h, w)| 2 + (h * w) as usize)
    }

    /// The talker's user rows of round `round`: every user turn so far.
    fn talker_user_rows(&self, chat: usize, round: usize) -> usize {
        (0..=round).map(|j| self.user_rows(chat, j)).sum()
    }

    /// The expanded thinker prompt length of round `round` (replies are exact).
    fn prompt_len(&self, chat: usize, round: usize) -> usize {
        // Each earlier round: its assistant opening, reply, `<|im_end|>` and newline.
        let earlier: usize = (0..round).map(|j| 3 + self.own(chat, j).reply + 2).sum();
        5 + self.chats[chat].system.len() + self.talker_user_rows(chat, round) + earlier + 3
    }

    fn thinker_params(&self, chat: usize, round: usize) -> SamplingParams {
        let t = self.own(chat, round);
        let suppress_ids = (0..TEXT.start).chain(TEXT.end..VOCAB).collect();
        let greedy = SamplingParams { ignore_eos: true, suppress_ids, ..SamplingParams::greedy(t.reply) };
        greedy_or_seeded(greedy, t.thinker_seed)
    }

    fn speech(&self, chat: usize, round: usize) -> SpeechOptions {
        let t = self.own(chat, round);
        let talker = match t.talker_seed {
            Some(seed) => {
                TalkerSampling { max_new_tokens: t.talker_tokens, seed, ..TalkerSampling::default() }
            }
            None => TalkerSampling { max_new_tokens: t.talker_tokens, ..TalkerSampling::greedy() },
        };
        SpeechOptions { speaker: "ethan".into(), talker, first_chunk: t.first_chunk, chunk: t.chunk }
    }

    /// Blocks of the largest request: thinker and talker.
    fn largest(&self) -> (usize, usize) {
        let mut thinker = 0;
        let mut talker = 0;
        for chat in 0..2 {
            for round in 0..self.rounds(chat) {
                let need = self.thinker_params(chat, round).positions_needed(self.prompt_len(chat, round));
                thinker = thinker.max(need.div_ceil(self.block_size));
                let rows =
                    self.talker_user_rows(chat, round) + ASSISTANT_ROWS + self.own(chat, round).talker_tokens
                        - 1;
                talker = talker.max(rows.div_ceil(self.talker_block_size));
            }
        }
        (thinker, talker)
    }

    /// The chats of each wave (a chat's next round each), in order, until every round ran.
    fn schedule(&self) -> Vec<(Vec<usize>, Wave)> {
        let mut next = [0usize; 2];
        let mut waves = Vec::new();
        let both = Wave { chats: 2, twin: false, delay: [0, 0] };
        for wave in self.waves.iter().copied().chain(std::iter::repeat(both)) {
            if (0..2).all(|c| next[c] == self.rounds(c)) {
                break;
            }
            let chats: Vec<usize> = match wave.chats {
                2 => vec![0, 1],
                c => vec![usize::from(c)],
            };
            let chats: Vec<usize> = chats.into_iter().filter(|&c| next[c] < self.rounds(c)).collect();
            for &c in &chats {
                next[c] += 1;
            }
            if !chats.is_empty() {
                waves.push((chats, wave));
            }
        }
        waves
    }
}

/// An image by the (chat, round) whose turn first showed it.
type ImageKey = (usize, usize);

/// Every image's pixels, encoder rows and DeepStack rows (a shared turn's image is one).
struct Images {
    pixels: BTreeMap<ImageKey, ArrayD<u8>>,
    rows: BTreeMap<ImageKey, ImageRows>,
}

/// An image's encoder rows and DeepStack levels.
type ImageRows = (Arc<Array2<f32>>, Option<Arc<Vec<Array2<f32>>>>);

impl Images {
    fn of(case: &Case) -> Self {
        let mut pixels = BTreeMap::new();
        let mut rows = BTreeMap::new();
        for chat in 0..2 {
            for round in 0..case.rounds(chat) {
                let (turn, key) = case.turn(chat, round);
                let Some((h, w)) = turn.image else { continue };
                let tag = (key.0 * 8 + key.1) as u8;
                pixels
                    .insert(key, ArrayD::from_shape_fn(IxDyn(&[6, 6, 3]), |d| tag ^ (d[0] * 7 + d[1]) as u8));
                let mut rng = ChaCha8Rng::seed_from_u64(case.seed ^ (u64::from(tag) << 40));
                let mut random = || {
                    Array2::from_shape_simple_fn(((h * w) as usize, HIDDEN), || {
                        rng.random::<f32>() * 2.0 - 1.0
                    })
                };
                let embeds = Arc::new(random());
                let deepstack =
                    (case.deepstack > 0).then(|| Arc::new((0..case.deepstack).map(|_| random()).collect()));
                rows.insert(key, (embeds, deepstack));
            }
        }
        Images { pixels, rows }
    }
}

/// Round `round` of chat `chat` as a speaking request, over the earlier rounds' `replies`.
fn request<'a>(
    case: &Case, images: &'a Images, chat: usize, round: usize, replies: &[Vec<u32>],
) -> Request<'a> {
    let mut ids = vec![CHAT.im_start_token_id, SYSTEM, NEWLINE];
    ids.extend(&case.chats[chat].system);
    ids.extend([IM_END, NEWLINE]);
    let mut items = Vec::new();
    for j in 0..=round {
        let (turn, key) = case.turn(chat, j);
        ids.extend([CHAT.im_start_token_id, CHAT.user_token_id, NEWLINE]);
        ids.extend(&turn.a);
        if let Some((h, w)) = turn.image {
            ids.extend(image_markers());
            let (embeds, deepstack) = &images.rows[&key];
            items.push(ItemInput {
                spec: ItemSpec {
                    modality: Modality::Image,
                    layout: ItemLayout::Image { grid_thw: [1, 2 * h, 2 * w] },
                    content: ItemContent::Tensor(TensorView::U8(images.pixels[&key].view())),
                    params: Default::default(),
                },
                embeddings: Some(Arc::clone(embeds)),
                deepstack: deepstack.clone(),
                routing_hash: None,
            });
        }
        ids.extend(&turn.b);
        ids.extend([IM_END, NEWLINE]);
        if let Some(reply) = replies.get(j).filter(|_| j < round) {
            ids.extend([CHAT.im_start_token_id, CHAT.assistant_token_id, NEWLINE]);
            ids.extend(reply);
            ids.extend([IM_END, NEWLINE]);
        }
    }
    ids.extend([CHAT.im_start_token_id, CHAT.assistant_token_id, NEWLINE]);
    let request = Request { token_ids: ids, items, ..Default::default() };
    request.generate(case.thinker_params(chat, round)).speak(case.speech(chat, round))
}

fn fail(what: &str) -> impl Fn(omniprefix::Error) -> TestCaseError + '_ {
    move |e| TestCaseError::fail(format!("{what}: {e}"))
}

/// The engine of a case: caching on with the case's chunking and pools, or the
/// reference (caching off, default chunking, big pools).
fn engine(
    case: &Case, backend: &Arc<CpuBackend>, thinker: &Arc<Thinker<CpuBackend>>, cache: bool,
    tier_dir: Option<&std::path::Path>,
) -> Result<Engine, TestCaseError> {
    let mut talker_cfg = TalkerConfig::tiny();
    talker_cfg.thinker_hidden_size = HIDDEN;
    let talker =
        Talker::random(&**backend, talker_cfg.clone(), case.seed ^ 0x7a1c).map_err(fail("talker"))?;
    // The tiny vocoder decodes the tiny talker's 16 code groups.
    let code2wav_cfg =
        Code2WavConfig { num_quantizers: talker_cfg.num_code_groups, ..Code2WavConfig::tiny() };
    let code2wav =
        Code2Wav::random(&**backend, code2wav_cfg, case.seed ^ 0xc0de).map_err(fail("code2wav"))?;
    let stage = SpeechStage::new(Arc::clone(backend), Arc::clone(thinker), talker, code2wav, CHAT);
    let (thinker_blocks, talker_blocks) = case.largest();
    let big = |n: usize| 8 * n + 64;
    let config = match cache {
        true => EngineConfig {
            scheduler: SchedulerConfig {
                block_size: case.block_size,
                num_blocks: case.thinker_spare.map_or(big(thinker_blocks), |s| thinker_blocks + s),
                max_tokens_per_step: case.budget,
                prefill_cap: case.prefill_cap.map_or(PrefillCap::Auto, PrefillCap::Tokens),
                max_seqs_per_step: case.seqs,
                ..Default::default()
            },
            talker_cache: TalkerCacheConfig {
                num_blocks: case.talker_spare.map_or(big(talker_blocks), |s| talker_blocks + s),
                block_size: case.talker_block_size,
            },
            tier_dir: tier_dir.filter(|_| case.tier).map(|d| d.join("tier")),
            // The same key after a restart, so the tier's blocks are found again.
            fingerprint_key: omniprefix::canon::FingerprintKey::fixed(case.seed),
            ..EngineConfig::default()
        },
        false => EngineConfig {
            scheduler: SchedulerConfig { num_blocks: 512, ..Default::default() },
            talker_cache: TalkerCacheConfig { num_blocks: 256, block_size: 16 },
            cache: false,
            ..EngineConfig::default()
        },
    };
    let config = EngineConfig { tokens: Some(OmniTokens::tiny()), ..config };
    Engine::with_speech(Arc::clone(backend), Arc::clone(thinker), config, Some(stage)).map_err(fail("engine"))
}

/// Submits `requests` one after another, `delay[k]` steps after the one before (sooner
/// when nothing else is pending), and steps to the end: each one's output and the concatenation of its streamed
/// audio (each chunk checked to come at its offset).
fn run_wave(
    engine: &mut Engine, requests: Vec<Request<'_>>, delay: [usize; 2],
) -> Result<Vec<(Output, Vec<f32>)>, TestCaseError> {
    let mut queue = requests.into_iter();
    let mut ids = Vec::new();
    let mut streamed: BTreeMap<_, Vec<f32>> = BTreeMap::new();
    let mut outputs = BTreeMap::new();
    let mut steps = 0;
    let mut since = 0;
    loop {
        let wait = ids.len().checked_sub(1).map_or(0, |k| delay[k.min(1)]);
        if (since >= wait || !engine.has_pending())
            && let Some(r) = queue.next()
        {
            let id = engine.submit(r).map_err(fail("submit"))?;
            ids.push(id);
            streamed.insert(id, Vec::new());
            since = 0;
            continue;
        }
        if !engine.has_pending() {
            break;
        }
        steps += 1;
        since += 1;
        prop_assert!(steps <= MAX_STEPS, "no end after {} steps", MAX_STEPS);
        for event in engine.step().map_err(fail("step"))? {
            match event {
                Event::Audio(a) => {
                    let audio = streamed
                        .get_mut(&a.request)
                        .ok_or_else(|| TestCaseError::fail("audio of an unknown request"))?;
                    prop_assert_eq!(a.offset, audio.len(), "request {}: chunk offsets", a.request);
                    prop_assert!(!outputs.contains_key(&a.request), "audio after the output");
                    audio.extend(a.samples);
                }
                Event::Finished(out) => {
                    prop_assert!(outputs.insert(out.request, out).is_none(), "finished twice");
                }
                _ => {}
            }
        }
        engine.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    ids.iter()
        .map(|id| {
            let out = outputs.remove(id).ok_or_else(|| TestCaseError::fail("no output"))?;
            let audio = streamed.remove(id).unwrap_or_default();
            let speech = out.speech.as_ref().ok_or_else(|| TestCaseError::fail("no speech"))?;
            prop_assert!(bits(&audio) == bits(&speech.audio), "request {}: streamed chunks != the audio", id);
            Ok((out, audio))
        })
        .collect()
}

fn speech(out: &Output) -> Result<&omniprefix::speech::Speech, TestCaseError> {
    out.speech.as_ref().ok_or_else(|| TestCaseError::fail(format!("request {}: no speech", out.request)))
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// What a run saw, across cases.
#[derive(Debug, Default)]
struct Tally {
    cases: usize,
    rounds: usize,
    /// Rounds that reused talker rows.
    talker_hits: usize,
    talker_hit_rows: usize,
    /// Cases whose talker evicted blocks while the thinker evicted none, and the reverse.
    talker_only_evicted: usize,
    thinker_only_evicted: usize,
    both_evicted: usize,
    /// Waves with several requests in flight, and those with a twin.
    concurrent_waves: usize,
    twins: usize,
    preemptions: u64,
    /// Rows and tokens the tier gave back (cases with a tier).
    talker_tier_hit_rows: usize,
    thinker_tier_hit_tokens: usize,
    restarts: usize,
}

fn check(case: &Case, tally: &mut Tally) -> Result<(), TestCaseError> {
    let backend = Arc::new(CpuBackend::new());
    let model = Config::tiny_qwen3_omni_moe(HIDDEN, 2, 4, 2, VOCAB as usize, 4, 2);
    let thinker = Arc::new(Thinker::random_as(&*backend, model, case.seed, None).map_err(fail("thinker"))?);
    let images = Images::of(case);
    let dir = tempfile::tempdir().map_err(|e| TestCaseError::fail(format!("a temp dir: {e}")))?;
    let mut cached = engine(case, &backend, &thinker, true, Some(dir.path()))?;
    let mut plain = engine(case, &backend, &thinker, false, None)?;
    let tbs = case.talker_block_size;
    let mut replies: [Vec<Vec<u32>>; 2] = [Vec::new(), Vec::new()];
    // Per chat: its last round's talker user rows (when the talker ran) and the talker's
    // evicted-block count before the wave it ran in.
    let mut last: [Option<(usize, u64)>; 2] = [None, None];
    let mut rounds = 0;
    for (w, (chats, wave)) in case.schedule().into_iter().enumerate() {
        let evicted_before = talker_stats(&cached.stats())?.evicted_blocks;
        let mut rounds_now: Vec<(usize, usize, bool)> =
            chats.iter().map(|&c| (c, replies[c].len(), false)).collect();
        if wave.twin {
            rounds_now.insert(1, (rounds_now[0].0, rounds_now[0].1, true));
        }
        let requests =
            rounds_now.iter().map(|&(c, r, _)| request(case, &images, c, r, &replies[c])).collect();
        let got = run_wave(&mut cached, requests, wave.delay)?;
        let evicted_after = talker_stats(&cached.stats())?.evicted_blocks;
        tally.concurrent_waves += usize::from(rounds_now.len() > 1);
        tally.twins += usize::from(wave.twin);
        for (&(c, r, twin), (g, g_audio)) in rounds_now.iter().zip(&got) {
            let what = format!("chat {c} round {r}{}", if twin { " (twin)" } else { "" });
            let want = run_wave(&mut plain, vec![request(case, &images, c, r, &replies[c])], [0, 0])?;
            let (w, _) = &want[0];
            prop_assert_eq!(&g.tokens, &w.tokens, "{}: the thinker's reply", what);
            let (gs, ws) = (speech(g)?, speech(w)?);
            prop_assert_eq!(
                &gs.codes,
                &ws.codes,
                "{}: codes ({} talker rows cached)",
                what,
                gs.talker_cached_rows
            );
            prop_assert!(
                bits(g_audio) == bits(&ws.audio),
                "{}: audio differs ({} talker rows cached)",
                what,
                gs.talker_cached_rows
            );
            prop_assert_eq!(gs.finish, ws.finish, "{}: finish", what);
            prop_assert_eq!(gs.talker_prompt_rows, ws.talker_prompt_rows, "{}: talker prompt rows", what);
            prop_assert_eq!(ws.talker_cached_rows, 0, "{}: cached talker rows with caching off", what);
            let user = case.talker_user_rows(c, r);
            let spoke = gs.talker_prompt_rows > 0;
            if spoke {
                prop_assert_eq!(gs.talker_prompt_rows, user + ASSISTANT_ROWS, "{}: talker prompt rows", what);
            }
            let hit = gs.talker_cached_rows;
            prop_assert!(hit % tbs == 0 && hit <= user, "{}: {} cached of {} user rows", what, hit, user);
            if let Some((prev_user, _)) = last[c].filter(|&(_, e)| !twin && spoke && e == evicted_after) {
                // This round spoke, the previous one did too, and no talker block was evicted
                // since the previous round's wave began.
                let floor = prev_user / tbs * tbs;
                prop_assert!(
                    hit >= floor,
                    "{}: {} talker rows cached, the previous round left {} (blocks of {})",
                    what,
                    hit,
                    prev_user,
                    tbs
                );
            }
            tally.talker_hits += usize::from(hit > 0);
            tally.talker_hit_rows += hit;
            if !twin {
                last[c] = spoke.then_some((user, evicted_before));
                replies[c].push(g.tokens.clone());
                rounds += 1;
            }
        }
        if case.restart_after == Some(w) {
            tally_tier(&cached.stats(), tally)?;
            drop(cached); // spills both stages' caches to the tier and waits for the writes
            cached = engine(case, &backend, &thinker, true, Some(dir.path()))?;
            // The new engine's counters start at 0: no floor from before the restart.
            last = [None, None];
            tally.restarts += 1;
        }
    }
    prop_assert_eq!(rounds, case.rounds(0) + case.rounds(1));
    let stats = cached.stats();
    let talker = talker_stats(&stats)?;
    prop_assert_eq!((talker.blocks_in_use, talker.live_slots), (0, 0), "talker blocks left in use");
    let (talker_evicted, thinker_evicted) = (talker.evicted_blocks > 0, stats.sched.evicted_blocks > 0);
    tally.cases += 1;
    tally.rounds += rounds;
    tally.talker_only_evicted += usize::from(talker_evicted && !thinker_evicted);
    tally.thinker_only_evicted += usize::from(thinker_evicted && !talker_evicted);
    tally.both_evicted += usize::from(thinker_evicted && talker_evicted);
    tally.preemptions += stats.sched.preemptions;
    tally_tier(&stats, tally)
}

/// Adds what `stats`' engine read from its tier to the tally.
fn tally_tier(stats: &EngineStats, tally: &mut Tally) -> Result<(), TestCaseError> {
    tally.talker_tier_hit_rows += talker_stats(stats)?.tier_hit_rows as usize;
    tally.thinker_tier_hit_tokens += stats.tier.map_or(0, |t| t.hit_tokens as usize);
    Ok(())
}

fn talker_stats(stats: &EngineStats) -> Result<omniprefix::sched::TalkerCacheStats, TestCaseError> {
    stats.talker.clone().ok_or_else(|| TestCaseError::fail("no talker stats"))
}

#[test]
fn speech_is_the_same_with_caching_on_and_off() {
    let cases = support::cases(32);
    // Failures persist beside this file, as the `proptest!` suites' do.
    let persistence = FileFailurePersistence::WithSource("proptest-regressions");
    let mut runner = TestRunner::new(PtConfig {
        cases,
        source_file: Some(file!()),
        failure_persistence: Some(Box::new(persistence)),
        ..PtConfig::default()
    });
    let tally = std::cell::RefCell::new(Tally::default());
    let started = std::time::Instant::now();
    let result = runner.run(&case(), |case| check(&case, &mut tally.borrow_mut()));
    if let Err(e) = result {
        panic!("{e}");
    }
    let tally = tally.into_inner();
    eprintln!("speech_cache: {tally:?} in {:.1?}", started.elapsed());
    if cases >= 4 {
        assert!(tally.talker_hits > 0, "no round reused talker rows: the test is vacuous ({tally:?})");
    }
}

/// A fixed case: three rounds per chat, alternating, an image in round 1 of each.
fn fixed(thinker_spare: Option<usize>, talker_spare: Option<usize>) -> Case {
    let turn = |a: Vec<u32>, image, b: Vec<u32>, seeded: bool| Turn {
        a,
        image,
        b,
        reply: 4,
        thinker_seed: seeded.then_some(11),
        talker_seed: seeded.then_some(12),
        talker_tokens: 4,
        first_chunk: 1,
        chunk: 2,
    };
    let chat = |base: u32, seeded| Chat {
        system: vec![base, base + 1],
        turns: vec![
            turn(vec![base + 2, base + 3, base + 4], None, vec![base + 5, base + 6], seeded),
            turn(vec![base + 7], Some((2, 2)), vec![base + 8, base + 9, base + 10], seeded),
            turn(vec![base + 11, base + 12], None, vec![base + 13], seeded),
        ],
    };
    Case {
        chats: [chat(100, false), chat(200, true)],
        share_first: false,
        waves: [0, 1, 0, 1, 0, 1].map(|chats| Wave { chats, twin: false, delay: [0, 0] }).to_vec(),
        block_size: 4,
        budget: 7,
        prefill_cap: Some(5),
        seqs: 2,
        thinker_spare,
        talker_block_size: 3,
        talker_spare,
        tier: false,
        restart_after: None,
        deepstack: 1,
        seed: 42,
    }
}

/// A small talker pool beside a big thinker pool: the talker's blocks are evicted, the
/// thinker's all stay (each round reuses its whole previous prompt), speech unchanged.
#[test]
fn talker_blocks_evicted_while_the_thinkers_stay() {
    let mut tally = Tally::default();
    let case = fixed(None, Some(0));
    if let Err(e) = check(&case, &mut tally) {
        panic!("{e}");
    }
    assert_eq!((tally.talker_only_evicted, tally.both_evicted), (1, 0), "{tally:?}");
}

/// A small thinker pool beside a big talker pool: the thinker's blocks are evicted (and
/// recomputed, so the accept-layer rows the talker keys its items by are recomputed too),
/// the talker's all stay and later rounds still reuse them, speech unchanged.
#[test]
fn thinker_blocks_evicted_while_the_talkers_stay() {
    let mut tally = Tally::default();
    let case = fixed(Some(0), None);
    if let Err(e) = check(&case, &mut tally) {
        panic!("{e}");
    }
    assert_eq!((tally.thinker_only_evicted, tally.both_evicted), (1, 0), "{tally:?}");
    assert!(tally.talker_hits >= 4, "rounds 2 and 3 of both chats reuse talker rows: {tally:?}");
}
