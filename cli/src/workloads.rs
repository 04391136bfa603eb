//! Seeded match workloads with the real Qwen3-Omni shapes.
//!
//! Shapes, layouts and prompts come from the embedded fixtures
//! (`fixtures/qwen3_omni.json`, `fixtures/scenarios.json`); media content is
//! seeded noise of exactly the RAW form vLLM hashes (f32 16 kHz waveform,
//! HWC u8 image, THWC u8 frames). [`MediaScale::Tiny`] keeps every layout and
//! token count but shrinks the tensors, for tests and smoke runs.

use std::fmt;
use std::sync::Arc;

use clap::ValueEnum;

use ndarray::{Array1, Array3, Array4};
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;

use crate::error::{HarnessError, Result};
use crate::scenarios::{SCENARIOS_FILE, Scenarios, parse};
use omniprefix::canon::{ItemContent, ItemLayout, ItemSpec, Modality, TensorView, read_floor};
use omniprefix::index::hashchain::MmMedia;
use omniprefix::preprocess::{PlaceholderForm, RawRequest};
use omniprefix::prompt::OmniTokens;

const OMNI_FILE: &str = "fixtures/qwen3_omni.json";
const OMNI_JSON: &str = include_str!("../../fixtures/qwen3_omni.json");

/// Seconds of video per temporal grid step of the video item.
pub const VIDEO_SECONDS_PER_GRID: f32 = 2.0;
/// Plain-text ids are drawn below this (Qwen's BPE ranks; specials start here).
pub const TEXT_VOCAB: u32 = 151_643;
/// Share of a text workload's measured request that its warm-up request also has.
pub const TEXT_SHARED_FRACTION: f64 = 0.9;

/// The workloads of `bench match`, named on the command line and in reports as
/// their `snake_case` names (`text1k`, `multi_round`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum WorkloadName {
    /// Audio + image + video + question (vllm-omni's mixed-modalities query, 8546 tokens).
    Mixed,
    /// The mixed prompt's framing with the image alone.
    Image,
    /// The mixed prompt's framing with the audio alone.
    Audio,
    /// The mixed prompt's framing with the video alone.
    Video,
    /// 1024 random text ids; the warm-up request shares the first 90 %.
    Text1k,
    /// 8192 random text ids; the warm-up request shares the first 90 %.
    Text8k,
    /// 32768 random text ids; the warm-up request shares the first 90 %.
    Text32k,
    /// Round 4 of the 4-round conversation, after rounds 1-3 warmed the index.
    MultiRound,
}

impl WorkloadName {
    fn text_len(self) -> Option<usize> {
        match self {
            WorkloadName::Text1k => Some(1 << 10),
            WorkloadName::Text8k => Some(8 << 10),
            WorkloadName::Text32k => Some(32 << 10),
            _ => None,
        }
    }
}

impl fmt::Display for WorkloadName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_name(self, f)
    }
}

/// The value of `T` called `name` on the command line; the error lists every
/// name (and `all`, which [`select`] takes).
pub fn by_name<T: ValueEnum>(name: &str) -> Result<T> {
    T::from_str(name, false).map_err(|_| HarnessError::UnknownWorkload {
        name: name.to_string(),
        known: T::value_variants()
            .iter()
            .filter_map(T::to_possible_value)
            .map(|v| v.get_name().to_string() + ", ")
            .collect::<String>()
            + "all",
    })
}

/// `all` (every value, in declaration order) or a comma-separated list of names.
///
/// ```
/// use omniprefix_cli::workloads::{WorkloadName, select};
/// assert_eq!(select::<WorkloadName>("text32k,mixed")?, vec![WorkloadName::Text32k, WorkloadName::Mixed]);
/// assert_eq!(select::<WorkloadName>("all")?.len(), 8);
/// assert!(select::<WorkloadName>("txt").is_err());
/// # Ok::<(), omniprefix_cli::HarnessError>(())
/// ```
pub fn select<T: ValueEnum>(names: &str) -> Result<Vec<T>> {
    if names == "all" {
        return Ok(T::value_variants().to_vec());
    }
    names.split(',').map(by_name).collect()
}

/// Writes `value`'s command-line name (what reports call it too).
pub fn write_name<T: ValueEnum>(value: &T, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    value.to_possible_value().map_or(Ok(()), |v| f.write_str(v.get_name()))
}

/// How large the generated media tensors are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MediaScale {
    /// The real raw shapes: 720x1280x3 image, 480000 samples, 20x720x1280x3 frames (60 MB).
    #[default]
    Full,
    /// Same layouts and token counts, tensors of a few hundred bytes.
    Tiny,
}

/// The shapes the workloads need from `fixtures/qwen3_omni.json`.
#[derive(Debug, Clone, Deserialize)]
struct OmniFixture {
    items: FixtureItems,
    mixed: FixtureMixed,
}

#[derive(Debug, Clone, Deserialize)]
struct FixtureItems {
    image: FixtureItem,
    audio: FixtureItem,
    video: FixtureItem,
}

#[derive(Debug, Clone, Deserialize)]
struct FixtureItem {
    raw_input_hashed_by_vllm: RawInput,
    processed: Processed,
    num_placeholder_tokens: usize,
}

#[derive(Debug, Clone, Deserialize)]
struct RawInput {
    shape: Vec<usize>,
}

#[derive(Debug, Clone, Deserialize)]
struct Processed {
    image_grid_thw: Option<[u32; 3]>,
    video_grid_thw: Option<[u32; 3]>,
    mel_frames: Option<u32>,
}

#[derive(Debug, Clone, Deserialize)]
struct FixtureMixed {
    token_ids_unexpanded: Vec<u32>,
    num_prompt_tokens_total: usize,
}

fn fixture_error(problem: impl Into<String>) -> HarnessError {
    HarnessError::Fixture { file: OMNI_FILE, problem: problem.into() }
}

/// Layouts of the three Qwen3-Omni items and the mixed prompt's size.
#[derive(Debug, Clone, PartialEq)]
pub struct OmniShapes {
    /// Image grid (1, 44, 80): 880 tokens.
    pub image: ItemLayout,
    /// 3000 mel frames: 390 tokens.
    pub audio: ItemLayout,
    /// Video grid (10, 40, 72) at [`VIDEO_SECONDS_PER_GRID`]: 7200 tokens.
    pub video: ItemLayout,
    /// Raw shapes vLLM hashes: HWC image, waveform samples, THWC frames.
    pub image_raw: [usize; 3],
    pub audio_raw: [usize; 1],
    pub video_raw: [usize; 4],
    /// Unexpanded ids of the mixed prompt (one pad per item).
    pub mixed_ids: Vec<u32>,
    /// Expanded length of the mixed prompt (8546).
    pub mixed_tokens: usize,
}

impl OmniShapes {
    /// Parses the embedded `fixtures/qwen3_omni.json` and checks that each
    /// layout's token count is the fixture's.
    pub fn load() -> Result<Self> {
        let f: OmniFixture = parse(OMNI_FILE, OMNI_JSON)?;
        let image = ItemLayout::Image {
            grid_thw: f
                .items
                .image
                .processed
                .image_grid_thw
                .ok_or_else(|| fixture_error("no image_grid_thw"))?,
        };
        let video = ItemLayout::Video {
            grid_thw: f
                .items
                .video
                .processed
                .video_grid_thw
                .ok_or_else(|| fixture_error("no video_grid_thw"))?,
            seconds_per_grid: VIDEO_SECONDS_PER_GRID,
        };
        let audio = ItemLayout::Audio {
            mel_frames: f.items.audio.processed.mel_frames.ok_or_else(|| fixture_error("no mel_frames"))?,
        };
        for (layout, item) in [(&image, &f.items.image), (&audio, &f.items.audio), (&video, &f.items.video)] {
            if layout.num_tokens() != item.num_placeholder_tokens {
                return Err(fixture_error(format!(
                    "{layout:?} gives {} tokens, the fixture says {}",
                    layout.num_tokens(),
                    item.num_placeholder_tokens
                )));
            }
        }
        let shape = |item: &FixtureItem| item.raw_input_hashed_by_vllm.shape.clone();
        Ok(OmniShapes {
            image,
            audio,
            video,
            image_raw: shape(&f.items.image)
                .try_into()
                .map_err(|s| fixture_error(format!("image shape {s:?}")))?,
            audio_raw: shape(&f.items.audio)
                .try_into()
                .map_err(|s| fixture_error(format!("audio shape {s:?}")))?,
            video_raw: shape(&f.items.video)
                .try_into()
                .map_err(|s| fixture_error(format!("video shape {s:?}")))?,
            mixed_ids: f.mixed.token_ids_unexpanded,
            mixed_tokens: f.mixed.num_prompt_tokens_total,
        })
    }

    /// The layout of the item of `modality`.
    pub fn layout(&self, modality: Modality) -> ItemLayout {
        match modality {
            Modality::Image => self.image,
            Modality::Audio => self.audio,
            Modality::Video => self.video,
        }
    }
}

/// One raw item per modality, seeded noise in the raw form vLLM hashes.
#[derive(Debug, Clone)]
pub struct Media {
    pub shapes: OmniShapes,
    /// HWC u8 pixels.
    pub image: Array3<u8>,
    /// f32 16 kHz samples in [-1, 1).
    pub audio: Array1<f32>,
    /// THWC u8 frames.
    pub video: Array4<u8>,
}

impl Media {
    /// Generates the three items at `scale` from `seed`.
    pub fn generate(scale: MediaScale, seed: u64) -> Result<Self> {
        let shapes = OmniShapes::load()?;
        let (image, audio, video) = match scale {
            MediaScale::Full => (shapes.image_raw, shapes.audio_raw, shapes.video_raw),
            MediaScale::Tiny => ([8, 8, 3], [160], [2, 8, 8, 3]),
        };
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut noise = |len: usize| {
            let mut bytes = vec![0u8; len];
            rng.fill_bytes(&mut bytes);
            bytes
        };
        let image = Array3::from_shape_vec(image, noise(image.iter().product())).map_err(shape_error)?;
        let video = Array4::from_shape_vec(video, noise(video.iter().product())).map_err(shape_error)?;
        let audio = Array1::from_iter((0..audio[0]).map(|_| f32::from(rng.random::<i16>()) / 32768.0));
        Ok(Media { shapes, image, audio, video })
    }

    /// The item of `modality` as the preprocessor takes it.
    pub fn spec(&self, modality: Modality) -> ItemSpec<'_> {
        let view = match modality {
            Modality::Image => TensorView::U8(self.image.view().into_dyn()),
            Modality::Audio => TensorView::F32(self.audio.view().into_dyn()),
            Modality::Video => TensorView::U8(self.video.view().into_dyn()),
        };
        ItemSpec {
            modality,
            layout: self.shapes.layout(modality),
            content: ItemContent::Tensor(view),
            params: Default::default(),
        }
    }

    /// The item of `modality` as vLLM's multimodal hasher receives it
    /// (a PIL RGB image, numpy waveform and frames).
    pub fn vllm_media(&self, modality: Modality) -> MmMedia<'_> {
        match modality {
            Modality::Image => MmMedia::PilRgb(self.image.view()),
            Modality::Audio => MmMedia::Array(TensorView::F32(self.audio.view().into_dyn())),
            Modality::Video => MmMedia::Array(TensorView::U8(self.video.view().into_dyn())),
        }
    }

    /// The raw bytes of the item of `modality` (all arrays are standard layout).
    pub fn bytes(&self, modality: Modality) -> &[u8] {
        let bytes = match modality {
            Modality::Image => self.image.as_slice().map(bytemuck::cast_slice),
            Modality::Audio => self.audio.as_slice().map(bytemuck::cast_slice),
            Modality::Video => self.video.as_slice().map(bytemuck::cast_slice),
        };
        debug_assert!(bytes.is_some(), "generated arrays are contiguous");
        bytes.unwrap_or_default()
    }
}

fn shape_error(source: ndarray::ShapeError) -> HarnessError {
    HarnessError::GeneratedMedia { what: "workload media", source }
}

/// One request of a workload: unexpanded ids and the modality of each item, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestPlan {
    pub token_ids: Vec<u32>,
    /// Each entry is the one [`Media`] item of that modality.
    pub items: Vec<Modality>,
}

impl RequestPlan {
    /// Bytes the request carries: its items' raw bytes in `media` and its token ids.
    pub fn input_bytes(&self, media: &Media) -> usize {
        let items: usize = self.items.iter().map(|&m| media.bytes(m).len()).sum();
        items + std::mem::size_of_val(self.token_ids.as_slice())
    }

    /// The read floor: one plain single-threaded pass over exactly the bytes of
    /// [`RequestPlan::input_bytes`] (what any matcher must at least read).
    pub fn read_floor(&self, media: &Media) -> u64 {
        let ids = read_floor(bytemuck::cast_slice(&self.token_ids));
        self.items.iter().fold(ids, |acc, &m| acc.wrapping_add(read_floor(media.bytes(m))))
    }
}

/// A workload: requests that warm the index, then the measured request.
#[derive(Debug, Clone)]
pub struct Workload {
    pub name: WorkloadName,
    /// Sent (and cached) before the measured request, in order.
    pub warmup: Vec<RequestPlan>,
    pub measured: RequestPlan,
    pub media: Arc<Media>,
}

impl Workload {
    /// Builds workload `name` over `media`; text ids are drawn from `seed`.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use omniprefix_cli::workloads::{Media, MediaScale, Workload, WorkloadName};
    /// let media = Arc::new(Media::generate(MediaScale::Tiny, 7)?);
    /// let text = Workload::new(WorkloadName::Text1k, media, 7)?;
    /// assert_eq!(text.measured.token_ids.len(), 1024);
    /// assert_eq!(text.warmup[0].token_ids[..921], text.measured.token_ids[..921]);
    /// # Ok::<(), omniprefix_cli::HarnessError>(())
    /// ```
    pub fn new(name: WorkloadName, media: Arc<Media>, seed: u64) -> Result<Self> {
        let tokens = OmniTokens::qwen3_omni();
        let mixed = RequestPlan {
            token_ids: media.shapes.mixed_ids.clone(),
            items: vec![Modality::Audio, Modality::Image, Modality::Video],
        };
        let alone = |modality| -> Result<(Vec<RequestPlan>, RequestPlan)> {
            let plan = RequestPlan {
                token_ids: keep_only(&mixed.token_ids, modality, &tokens)?,
                items: vec![modality],
            };
            Ok((vec![plan.clone()], plan))
        };
        let (warmup, measured) = match name {
            WorkloadName::Mixed => (vec![mixed.clone()], mixed),
            WorkloadName::Image => alone(Modality::Image)?,
            WorkloadName::Audio => alone(Modality::Audio)?,
            WorkloadName::Video => alone(Modality::Video)?,
            WorkloadName::Text1k | WorkloadName::Text8k | WorkloadName::Text32k => {
                text_pair(name.text_len().unwrap_or_default(), seed)
            }
            WorkloadName::MultiRound => multi_round()?,
        };
        Ok(Workload { name, warmup, measured, media })
    }

    /// `plan` as the preprocessor takes it.
    pub fn raw<'a>(&'a self, plan: &'a RequestPlan) -> RawRequest<'a> {
        RawRequest {
            token_ids: &plan.token_ids,
            items: plan.items.iter().map(|&m| self.media.spec(m)).collect(),
            placeholders: PlaceholderForm::Unexpanded,
        }
    }

    /// Bytes the measured request carries: its items' raw bytes and its token ids.
    pub fn input_bytes(&self) -> usize {
        self.measured.input_bytes(&self.media)
    }

    /// The read floor: one plain single-threaded pass over exactly the bytes of
    /// [`Workload::input_bytes`].
    pub fn read_floor(&self) -> u64 {
        self.measured.read_floor(&self.media)
    }
}

/// The mixed prompt's ids with the wrapped placeholders of every modality but
/// `keep` removed (`start pad end` triples).
fn keep_only(ids: &[u32], keep: Modality, tokens: &OmniTokens) -> Result<Vec<u32>> {
    let mut out = Vec::with_capacity(ids.len());
    let mut iter = ids.iter().copied();
    while let Some(id) = iter.next() {
        match tokens.placeholder_modality(id) {
            Some(m) if m != keep => {
                let start = if m == Modality::Audio {
                    tokens.audio_start_token_id
                } else {
                    tokens.vision_start_token_id
                };
                let end =
                    if m == Modality::Audio { tokens.audio_end_token_id } else { tokens.vision_end_token_id };
                if out.pop() != Some(start) || iter.next() != Some(end) {
                    return Err(fixture_error(format!("{m:?} pad not wrapped in {start} .. {end}")));
                }
            }
            _ => out.push(id),
        }
    }
    Ok(out)
}

/// `len` random text ids, and a warm-up request sharing the first 90 % of them
/// followed by different random ids.
fn text_pair(len: usize, seed: u64) -> (Vec<RequestPlan>, RequestPlan) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ len as u64);
    let measured: Vec<u32> = (0..len).map(|_| rng.random_range(0..TEXT_VOCAB)).collect();
    let shared = (len as f64 * TEXT_SHARED_FRACTION) as usize;
    let mut warm = measured[..shared].to_vec();
    warm.extend((shared..len).map(|_| rng.random_range(0..TEXT_VOCAB)));
    let plan = |token_ids| RequestPlan { token_ids, items: Vec::new() };
    (vec![plan(warm)], plan(measured))
}

/// The rounds of the 4-round conversation in `fixtures/scenarios.json`, each
/// re-sending the history and all earlier media.
pub(crate) fn conversation_rounds() -> Result<Vec<RequestPlan>> {
    Ok(Scenarios::load()?
        .multi_round
        .rounds
        .into_iter()
        .map(|r| RequestPlan { token_ids: r.token_ids_unexpanded, items: r.items_in_order })
        .collect())
}

/// Qwen's `<|im_end|>`: closes every chat turn (a reply is followed by it).
pub const IM_END: u32 = 151_645;

/// What a conversation round adds to the history it re-sends: round 1's whole
/// prompt, then per later round the text after the previous reply (`<|im_end|>`
/// onwards, ending in `<|im_start|>assistant\n`) and the items it adds.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatTurn {
    pub token_ids: Vec<u32>,
    pub new_items: Vec<Modality>,
}

/// The 4-round conversation as turns, so a driver can put the engine's own
/// reply between them: round `k+1` = round `k` + reply `k` + turn `k+1`.
/// The fixture's replies (its text up to the next `<|im_end|>`) are dropped.
pub fn conversation_turns() -> Result<Vec<ChatTurn>> {
    let rounds = conversation_rounds()?;
    let mut turns = Vec::with_capacity(rounds.len());
    let mut previous: Option<&RequestPlan> = None;
    for round in &rounds {
        let (ids, items) = (&round.token_ids, &round.items);
        let (start, old_items) = match previous {
            None => (0, 0),
            Some(prev) => {
                let extends = ids.starts_with(&prev.token_ids) && items.starts_with(&prev.items);
                let reply_end = ids[prev.token_ids.len().min(ids.len())..].iter().position(|&t| t == IM_END);
                match reply_end {
                    Some(reply) if extends => (prev.token_ids.len() + reply, prev.items.len()),
                    _ => {
                        return Err(HarnessError::Fixture {
                            file: SCENARIOS_FILE,
                            problem:
                                "a round does not re-send the previous round and a reply ending in <|im_end|>"
                                    .into(),
                        });
                    }
                }
            }
        };
        turns.push(ChatTurn { token_ids: ids[start..].to_vec(), new_items: items[old_items..].to_vec() });
        previous = Some(round);
    }
    Ok(turns)
}

/// `rounds` turns of one `many_clients` conversation: the 4-round
/// conversation's turns (an image in the first, then audio, video, text), then
/// its last, text-only turn again for each further round, so a conversation
/// grows by a question and a reply per round without re-sending an item twice.
pub fn client_turns(rounds: usize) -> Result<Vec<ChatTurn>> {
    let mut turns = conversation_turns()?;
    let last = turns
        .last()
        .cloned()
        .ok_or(HarnessError::Fixture { file: SCENARIOS_FILE, problem: "no rounds".into() })?;
    turns.resize(rounds, last);
    Ok(turns)
}

/// A generated reply as a chat client re-sends it: without the multimodal
/// special ids (placeholders, vision/audio start and end), which detokenizing
/// with `skip_special_tokens` drops and which would otherwise ask for items.
pub fn reply_for_history(reply: &[u32], tokens: &OmniTokens) -> Vec<u32> {
    let wrappers = [
        tokens.vision_start_token_id,
        tokens.vision_end_token_id,
        tokens.audio_start_token_id,
        tokens.audio_end_token_id,
    ];
    reply
        .iter()
        .copied()
        .filter(|&t| tokens.placeholder_modality(t).is_none() && !wrappers.contains(&t))
        .collect()
}

/// vLLM's `prefix_repetition` prompts: prompt `i` = shared prefix
/// `i mod num_prefixes` + its own random suffix, ids drawn below `id_limit` from `seed`.
pub fn prefix_repetition_prompts(
    prompts: usize, num_prefixes: usize, prefix_len: usize, suffix_len: usize, id_limit: u32, seed: u64,
) -> Vec<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut random_ids =
        |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..id_limit.max(1))).collect() };
    let prefixes: Vec<Vec<u32>> = (0..num_prefixes.max(1)).map(|_| random_ids(prefix_len)).collect();
    (0..prompts)
        .map(|i| {
            let mut ids = prefixes[i % prefixes.len()].clone();
            ids.extend(random_ids(suffix_len));
            ids
        })
        .collect()
}

/// Rounds 1-3 warm up; round 4 is measured.
fn multi_round() -> Result<(Vec<RequestPlan>, RequestPlan)> {
    let mut rounds = conversation_rounds()?;
    let measured =
        rounds.pop().ok_or(HarnessError::Fixture { file: SCENARIOS_FILE, problem: "no rounds".into() })?;
    Ok((rounds, measured))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Result<Arc<Media>> {
        Ok(Arc::new(Media::generate(MediaScale::Tiny, 3)?))
    }

    #[test]
    fn shapes_are_the_real_qwen3_omni_ones() -> Result<()> {
        let s = OmniShapes::load()?;
        let counts = [s.image, s.video, s.audio].map(|l| l.num_tokens());
        assert_eq!(counts, [880, 7200, 390]);
        assert_eq!((s.image_raw, s.audio_raw, s.video_raw), ([720, 1280, 3], [480_000], [20, 720, 1280, 3]));
        assert_eq!(s.mixed_tokens, 8546);
        Ok(())
    }

    #[test]
    fn single_modality_workloads_keep_the_framing_of_mixed() -> Result<()> {
        let media = tiny()?;
        let mixed = Workload::new(WorkloadName::Mixed, media.clone(), 0)?;
        let image = Workload::new(WorkloadName::Image, media, 0)?;
        assert_eq!(image.measured.items, vec![Modality::Image]);
        assert_eq!(image.measured.token_ids.len(), mixed.measured.token_ids.len() - 6);
        let tokens = OmniTokens::qwen3_omni();
        let pads: Vec<_> =
            image.measured.token_ids.iter().filter_map(|&t| tokens.placeholder_modality(t)).collect();
        assert_eq!(pads, vec![Modality::Image]);
        Ok(())
    }

    #[test]
    fn text_workloads_share_ninety_percent() -> Result<()> {
        let w = Workload::new(WorkloadName::Text8k, tiny()?, 5)?;
        let (warm, measured) = (&w.warmup[0].token_ids, &w.measured.token_ids);
        let common = warm.iter().zip(measured).take_while(|(a, b)| a == b).count();
        assert!((7372..7380).contains(&common), "{common}");
        assert!(measured.iter().all(|&t| t < TEXT_VOCAB));
        assert_eq!(w.input_bytes(), 8192 * 4);
        Ok(())
    }

    #[test]
    fn multi_round_measures_round_four() -> Result<()> {
        let w = Workload::new(WorkloadName::MultiRound, tiny()?, 0)?;
        assert_eq!(w.warmup.len(), 3);
        assert_eq!(w.measured.token_ids.len(), 172);
        assert_eq!(w.measured.items, vec![Modality::Image, Modality::Audio, Modality::Video]);
        Ok(())
    }

    #[test]
    fn turns_rebuild_the_rounds_with_the_fixture_replies_between_them() -> Result<()> {
        let (rounds, turns) = (conversation_rounds()?, conversation_turns()?);
        assert_eq!(turns.len(), 4);
        assert_eq!(turns[0].token_ids, rounds[0].token_ids);
        let mut history = turns[0].token_ids.clone();
        for k in 1..4 {
            assert_eq!(turns[k].token_ids[0], IM_END);
            let reply =
                &rounds[k].token_ids[history.len()..rounds[k].token_ids.len() - turns[k].token_ids.len()];
            assert!(!reply.is_empty() && !reply.contains(&IM_END));
            history.extend(reply);
            history.extend(&turns[k].token_ids);
            assert_eq!(history, rounds[k].token_ids);
            assert_eq!([&rounds[k - 1].items[..], &turns[k].new_items].concat(), rounds[k].items);
        }
        let tokens = OmniTokens::qwen3_omni();
        assert_eq!(
            reply_for_history(&[7, tokens.image_token_id, 8, tokens.audio_end_token_id], &tokens),
            [7, 8]
        );
        Ok(())
    }

    #[test]
    fn client_turns_repeat_the_text_turn_past_round_four() -> Result<()> {
        let (turns, six) = (conversation_turns()?, client_turns(6)?);
        assert_eq!(six[..4], turns[..]);
        assert!(six[4..].iter().all(|t| *t == turns[3] && t.new_items.is_empty()));
        assert_eq!(client_turns(2)?, turns[..2]);
        Ok(())
    }

    #[test]
    fn unknown_workload_names_the_known_ones() {
        let err = by_name::<WorkloadName>("text64k");
        let known = "mixed, image, audio, video, text1k, text8k, text32k, multi_round, all";
        assert!(
            matches!(&err, Err(HarnessError::UnknownWorkload { name, known: k }) if name == "text64k" && k == known),
            "{err:?}"
        );
    }

    #[test]
    fn workloads_keep_their_report_names() {
        let names: Vec<String> = WorkloadName::value_variants().iter().map(ToString::to_string).collect();
        assert_eq!(names, ["mixed", "image", "audio", "video", "text1k", "text8k", "text32k", "multi_round"]);
        let serve: Vec<String> =
            crate::serve::ServeWorkload::value_variants().iter().map(ToString::to_string).collect();
        assert_eq!(serve, ["prefix_repetition", "multi_round", "many_clients"]);
        let demo: Vec<String> =
            crate::demo::DemoWorkload::value_variants().iter().map(ToString::to_string).collect();
        assert_eq!(demo, ["rfc_text_pair", "multi_round", "prefix_repetition"]);
        for (i, name) in demo.iter().enumerate() {
            let json = serde_json::to_value(crate::demo::DemoWorkload::value_variants()[i]).unwrap();
            assert_eq!(json.as_str(), Some(name.as_str()), "the JSON report's name is the command line's");
        }
    }
}
