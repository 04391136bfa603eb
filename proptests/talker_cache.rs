//! Invariant 7 for the talker's own prefix cache ([`TalkerCache`]): a random tiny
//! talker speaks random rounds of random conversations (two system turns over the same
//! user turns, images sometimes, a reply per round), visited in a random order, with
//! random evictions of the talker's blocks (all of them sometimes), a slot held across
//! a visit now and then (pool pressure, refusals), and accept-layer rows flipped by one
//! bit sometimes. Every visit's codes and final-normed rows with the cache (`generate_in`
//! over the slot's block table from its cached rows) equal a cache-off run bit for bit;
//! the cached rows never pass the longest common prefix of talker input rows (and
//! positions) with a committed visit (no wrong hit); without evictions a visit reuses
//! every full block of an earlier visit's user rows it starts with; a refused `begin`
//! changes nothing.
//!
//! The accept-layer rows stand in for the thinker's: row `p` is a hash of the whole
//! thinker prefix up to `p` (item rows also of the item), so an item's rows depend on
//! the system turn, as they do in the model, while text rows depend on their id alone.
//!
//! Cases default to 12 (a few seconds on 2 cores); scale with `PROPTEST_CASES`.

use std::sync::Arc;

use ndarray::{Array2, ArrayD, Axis, IxDyn, concatenate, s};
use omniprefix::backend::cpu::CpuBackend;
use omniprefix::canon::{
    FingerprintKey, Fingerprinter, ItemContent, ItemLayout, ItemSpec, Modality, TensorView, ValidationPolicy,
};
use omniprefix::index::PrefixIndex;
use omniprefix::index::hashchain::HashChainIndex;
use omniprefix::index::radix::{RadixConfig, RadixIndex};
use omniprefix::model::talker::{Talker, TalkerConfig, TalkerInputs, TalkerKv};
use omniprefix::prompt::{CanonicalPrompt, OmniTokens, PromptBuilder};
use omniprefix::sample::TalkerSampling;
use omniprefix::sched::{TalkerCache, TalkerCacheConfig, talker_key};
use omniprefix::speech::{ASSISTANT_ROWS, ChatIds, TalkerLayout};
use proptest::prelude::*;
use proptest::test_runner::Config as PtConfig;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const CHAT: ChatIds = ChatIds::tiny();
/// The tiny talker's `thinker_hidden_size`.
const THINKER: usize = 24;
const TALKER: usize = 32;
const NEW_TOKENS: usize = 3;

/// One user turn: text, an optional image (grid halves h, w), more text; then the reply.
#[derive(Debug, Clone)]
struct Turn {
    a: Vec<u32>,
    image: Option<(u32, u32)>,
    b: Vec<u32>,
    reply: Vec<u32>,
}

/// One visit: speak round `round` of conversation `system`.
#[derive(Debug, Clone)]
struct Visit {
    system: usize,
    round: usize,
    /// Blocks to evict from the talker cache first (`usize::MAX`: all).
    evict: Option<usize>,
    /// Flip one bit of the accept row at this index of the item rows (when it has any).
    flip: Option<usize>,
    /// Keep a second slot on this prompt live until the next visit ends.
    hold: bool,
}

#[derive(Debug, Clone)]
struct Case {
    systems: [Vec<u32>; 2],
    turns: Vec<Turn>,
    visits: Vec<Visit>,
    block_size: usize,
    /// Blocks beyond the largest visit's.
    spare: usize,
    hashchain: bool,
    seed: u64,
}

fn ids(len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(10..480u32, len)
}

fn case() -> impl Strategy<Value = Case> {
    let turn = (ids(0..5), prop::option::of((1..3u32, 1..3u32)), ids(1..5), ids(1..4))
        .prop_map(|(a, image, b, reply)| Turn { a, image, b, reply });
    (
        prop::collection::vec(turn, 1..4),
        [ids(1..4), ids(1..4)],
        1..7usize,
        0..24usize,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_flat_map(|(turns, systems, block_size, spare, hashchain, seed)| {
            let rounds = turns.len();
            let visit = (
                0..2usize,
                0..rounds,
                prop::option::weighted(
                    0.25,
                    prop::option::of(0..4usize).prop_map(|n| n.unwrap_or(usize::MAX)),
                ),
                prop::option::weighted(0.2, 0..16usize),
                prop::bool::weighted(0.2),
            )
                .prop_map(|(system, round, evict, flip, hold)| Visit {
                    system,
                    round,
                    evict,
                    flip,
                    hold,
                });
            let visits = prop::collection::vec(visit, 2..8);
            (Just((turns, systems, block_size, spare, hashchain, seed)), visits)
        })
        .prop_map(|((turns, systems, block_size, spare, hashchain, seed), visits)| Case {
            systems,
            turns,
            visits,
            block_size,
            spare,
            hashchain,
            seed,
        })
}

fn fingerprinter() -> Fingerprinter {
    Fingerprinter::new(FingerprintKey::fixed(7), 1, ValidationPolicy::SecondDigest).expect("a fingerprinter")
}

/// The thinker prompt of round `round` of conversation `system`: the system turn, the
/// earlier rounds with their replies, this round's user turn, the assistant opening.
fn thinker_prompt(case: &Case, system: usize, round: usize) -> CanonicalPrompt {
    let fp = fingerprinter();
    let mut b = PromptBuilder::new(OmniTokens::tiny());
    let text = |b: &mut PromptBuilder, ids: &[u32]| {
        b.push_text(ids).expect("text ids");
    };
    text(&mut b, &[1, 4, 5]);
    text(&mut b, &case.systems[system]);
    text(&mut b, &[6, 5]);
    for (j, turn) in case.turns[..=round].iter().enumerate() {
        text(&mut b, &[1, 2, 5]);
        text(&mut b, &turn.a);
        if let Some((h, w)) = turn.image {
            let pixels = ArrayD::<u8>::from_elem(IxDyn(&[8, 8, 3]), j as u8);
            let spec = ItemSpec {
                modality: Modality::Image,
                layout: ItemLayout::Image { grid_thw: [1, 2 * h, 2 * w] },
                content: ItemContent::Tensor(TensorView::U8(pixels.view())),
                params: Default::default(),
            };
            text(&mut b, &[503]);
            b.push_item(Arc::new(fp.identify(j, &spec).expect("an identity"))).expect("an image");
            text(&mut b, &[504]);
        }
        text(&mut b, &turn.b);
        text(&mut b, &[6, 5, 1, 3, 5]);
        if j < round {
            text(&mut b, &turn.reply);
            text(&mut b, &[6, 5]);
        }
    }
    b.build().expect("a prompt")
}

/// Stand-in accept-layer rows: row `p` hashes the whole prefix up to `p`.
fn accept_rows(prompt: &CanonicalPrompt) -> Array2<f32> {
    let mut out = Array2::zeros((prompt.len(), THINKER));
    let mut item_at = vec![None; prompt.len()];
    for span in &prompt.index_map.spans {
        let fp = prompt.items[span.item as usize].fingerprint.0 as u64;
        for (k, row) in span.rows.clone().enumerate() {
            item_at[span.start as usize + k] = Some(fp ^ u64::from(row));
        }
    }
    let mut h = 0x9e37_79b9_7f4a_7c15u64;
    for (p, &id) in prompt.token_ids.iter().enumerate() {
        h = (h ^ u64::from(id)).wrapping_mul(0x1000_0000_01b3).rotate_left(17);
        let mut row_seed = h;
        if let Some(item) = item_at[p] {
            h = (h ^ item).wrapping_mul(0x1000_0000_01b3).rotate_left(29);
            row_seed = h;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(row_seed);
        for c in 0..THINKER {
            out[[p, c]] = rng.random::<f32>() * 2.0 - 1.0;
        }
    }
    out
}

fn random_rows(seed: u64, n: usize, c: usize) -> Array2<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    Array2::from_shape_fn((n, c), |_| rng.random::<f32>() * 2.0 - 1.0)
}

/// The talker's inputs as the speech stage builds them: text rows projected from a
/// fixed embedding table, item rows from the accept rows, then assistant rows (fresh
/// random rows each visit: they are never cached).
fn talker_inputs(
    talker: &Talker<CpuBackend>, backend: &CpuBackend, layout: &TalkerLayout, prompt: &CanonicalPrompt,
    accept: &Array2<f32>, table: &Array2<f32>, visit_seed: u64,
) -> Result<TalkerInputs, TestCaseError> {
    let mut user = Array2::zeros((layout.user.len(), TALKER));
    type Rows = Vec<(usize, usize)>;
    let (items, texts): (Rows, Rows) =
        layout.user.iter().copied().enumerate().partition(|&(row, _)| layout.is_item[row]);
    let fail = |e: omniprefix::Error| TestCaseError::fail(e.to_string());
    for (part, project_item) in [(&texts, false), (&items, true)] {
        if part.is_empty() {
            continue;
        }
        let rows = if project_item {
            let x = Array2::from_shape_fn((part.len(), THINKER), |(i, c)| accept[[part[i].1, c]]);
            talker.project_hidden(backend, &x).map_err(fail)?
        } else {
            let x = Array2::from_shape_fn((part.len(), THINKER), |(i, c)| {
                table[[prompt.token_ids[part[i].1] as usize, c]]
            });
            talker.project_text(backend, &x).map_err(fail)?
        };
        for (&(row, _), r) in part.iter().zip(rows.rows()) {
            user.row_mut(row).assign(&r);
        }
    }
    let assistant = random_rows(visit_seed, ASSISTANT_ROWS, TALKER);
    let embeds = concatenate(Axis(0), &[user.view(), assistant.view()]).expect("one width");
    Ok(TalkerInputs {
        embeds,
        positions: layout.positions.iter().collect(),
        rope_delta: layout.positions.rope_delta().unwrap_or(0),
        trailing_text_hidden: random_rows(visit_seed ^ 1, 2, TALKER),
        tts_pad_embed: random_rows(3, 1, TALKER),
    })
}

/// A visit's talker input rows of its user rows, and their positions.
type UserRows = (Array2<f32>, Vec<[i64; 3]>);

/// Leading user rows two visits share, input rows and positions bit for bit.
fn common_rows(a: &UserRows, b: &UserRows) -> usize {
    let n = a.0.nrows().min(b.0.nrows());
    (0..n)
        .position(|r| {
            a.1[r] != b.1[r] || a.0.row(r).iter().zip(b.0.row(r)).any(|(x, y)| x.to_bits() != y.to_bits())
        })
        .unwrap_or(n)
}

fn check(case: &Case) -> Result<(), TestCaseError> {
    let backend = Arc::new(CpuBackend::new());
    let talker = Talker::random(&*backend, TalkerConfig::tiny(), case.seed)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let table = random_rows(case.seed ^ 0x5eed, 512, THINKER);
    let tokens = OmniTokens::tiny();
    let fp = fingerprinter();
    let bs = case.block_size;
    let sampling = TalkerSampling { max_new_tokens: NEW_TOKENS, ..TalkerSampling::greedy() };
    // Every visit's thinker prompt first, to size the pool.
    let prompts: Vec<Vec<CanonicalPrompt>> =
        (0..2).map(|s| (0..case.turns.len()).map(|r| thinker_prompt(case, s, r)).collect()).collect();
    let mut largest = 0;
    for p in prompts.iter().flatten() {
        let layout = TalkerLayout::of(p, &CHAT, &tokens).map_err(|e| TestCaseError::fail(e.to_string()))?;
        largest = largest.max((layout.prefill_rows() + NEW_TOKENS - 1).div_ceil(bs));
    }
    let num_blocks = largest + case.spare;
    let index: Box<dyn PrefixIndex> = if case.hashchain {
        Box::new(HashChainIndex::new(bs).map_err(|e| TestCaseError::fail(e.to_string()))?)
    } else {
        Box::new(
            RadixIndex::new(RadixConfig { block_size: bs })
                .map_err(|e| TestCaseError::fail(e.to_string()))?,
        )
    };
    let mut cache = TalkerCache::new(TalkerCacheConfig { num_blocks, block_size: bs }, index)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut pages =
        talker.alloc_pages(&backend, num_blocks, bs).map_err(|e| TestCaseError::fail(e.to_string()))?;
    // User rows of every committed visit, and whether it was an unflipped (system, round).
    let mut committed: Vec<(UserRows, Option<(usize, usize)>)> = Vec::new();
    let mut held = None;
    for (v, visit) in case.visits.iter().enumerate() {
        let prompt = &prompts[visit.system][visit.round];
        let layout =
            TalkerLayout::of(prompt, &CHAT, &tokens).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut accept = accept_rows(prompt);
        let item_rows: Vec<usize> =
            (0..layout.user.len()).filter(|&r| layout.is_item[r]).map(|r| layout.user[r]).collect();
        let flipped = match visit.flip {
            Some(k) if !item_rows.is_empty() => {
                let pos = item_rows[k % item_rows.len()];
                accept[[pos, k % THINKER]] = f32::from_bits(accept[[pos, k % THINKER]].to_bits() ^ 1);
                true
            }
            _ => false,
        };
        if let Some(n) = visit.evict {
            cache.evict(n).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        let inputs =
            talker_inputs(&talker, &backend, &layout, prompt, &accept, &table, case.seed ^ (v as u64) << 8)?;
        let want = talker
            .generate(&backend, &inputs, &sampling, |_: &[u32]| Ok(()))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let key = talker_key(&layout, prompt, accept.view(), &fp, &tokens)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(key.len(), layout.user.len());
        let total = layout.prefill_rows() + NEW_TOKENS - 1;
        let before = cache.stats();
        let Some(mut slot) =
            cache.begin(key.clone(), total).map_err(|e| TestCaseError::fail(e.to_string()))?
        else {
            // Refused: nothing changed but the refusal count.
            let after = cache.stats();
            prop_assert!(held.is_some(), "refused with no other slot live");
            prop_assert_eq!(after.refusals, before.refusals + 1);
            prop_assert_eq!(
                (after.blocks_free, after.blocks_in_use, after.blocks_cached, after.queries),
                (before.blocks_free, before.blocks_in_use, before.blocks_cached, before.queries)
            );
            if let Some(h) = held.take() {
                cache.release(h).map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            continue;
        };
        let cached = slot.num_cached();
        let user = layout.user.len();
        let rows = (inputs.embeds.slice(s![..user, ..]).to_owned(), inputs.positions[..user].to_vec());
        prop_assert!(cached % bs == 0 && cached <= user, "{} cached of {} user rows", cached, user);
        let bound = committed.iter().map(|(c, _)| common_rows(c, &rows)).max().unwrap_or(0);
        prop_assert!(cached <= bound, "visit {}: {} cached rows past the common prefix {}", v, cached, bound);
        if cache.stats().evicted_blocks == 0 && !flipped {
            // An earlier unflipped round of the same conversation: the shorter one's user
            // rows start the longer one's, and all of its full blocks are still cached.
            let floor = committed
                .iter()
                .filter(|(_, same)| same.is_some_and(|(s, _)| s == visit.system))
                .map(|(c, _)| c.0.nrows().min(user))
                .max()
                .unwrap_or(0);
            prop_assert!(
                cached >= floor / bs * bs,
                "visit {}: {} cached rows, an earlier visit left {}",
                v,
                cached,
                floor
            );
        }
        let kv = TalkerKv { pages: &mut pages, block_table: slot.block_table().clone(), num_cached: cached };
        let got = talker
            .generate_in(&backend, kv, &inputs, &sampling, |_: &[u32]| Ok(()))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&got.codes, &want.codes, "visit {}: codes with {} cached rows", v, cached);
        prop_assert_eq!(&got.sampled, &want.sampled);
        prop_assert!(
            got.past_hidden.iter().zip(want.past_hidden.iter()).all(|(a, b)| a.to_bits() == b.to_bits()),
            "visit {}: final-normed rows differ with {} cached rows",
            v,
            cached
        );
        cache.commit(&mut slot).map_err(|e| TestCaseError::fail(e.to_string()))?;
        cache.release(slot).map_err(|e| TestCaseError::fail(e.to_string()))?;
        committed.push((rows, (!flipped).then_some((visit.system, visit.round))));
        if let Some(h) = held.take() {
            cache.release(h).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        if visit.hold {
            held = cache.begin(key, total).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        cache.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    if let Some(h) = held.take() {
        cache.release(h).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    let stats = cache.stats();
    prop_assert_eq!((stats.blocks_in_use, stats.live_slots), (0, 0));
    cache.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
    Ok(())
}

proptest! {
    #![proptest_config(PtConfig { cases: support::cases(12), ..PtConfig::default() })]

    #[test]
    fn talker_codes_with_the_talker_cache_equal_a_cache_off_run(case in case()) {
        check(&case)?;
    }
}
