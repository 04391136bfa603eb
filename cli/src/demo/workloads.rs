//! The demo's three workloads, as waves of raw requests over shared media.
//!
//! A wave is submitted at once and runs to completion before the next one
//! starts: the RFC pair and the conversation send one request per wave (each
//! sees what the previous ones cached), the `prefix_repetition` batch is one
//! wave of many requests that share prefixes (later requests hit blocks that
//! earlier steps of the same batch committed).

use std::fmt;

use clap::ValueEnum;

use ndarray::s;

use crate::error::Result;
use crate::scenarios::Scenarios;
use crate::workloads::{
    Media, MediaScale, RequestPlan, TEXT_VOCAB, conversation_rounds, prefix_repetition_prompts, write_name,
};
use omniprefix::canon::ItemLayout;

/// The workloads `omniprefix demo` runs (`--workload`, see [`crate::workloads::select`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum DemoWorkload {
    /// The vllm-omni RFC's two text prompts (67 and 57 tokens, 46 shared).
    RfcTextPair,
    /// A 4-round conversation re-sending its history and all earlier media.
    MultiRound,
    /// vLLM's `prefix_repetition` dataset: random prompts over a few shared prefixes, as one batch.
    PrefixRepetition,
}

impl fmt::Display for DemoWorkload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_name(self, f)
    }
}

/// How big the demo's inputs are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct DemoScale {
    /// Real Qwen3-Omni raw media and item layouts (`false`: tiny tensors and layouts, for CI).
    pub full_media: bool,
    /// Temporal grid steps of the video item (the real clip has 10: 20 frames, 7200 tokens).
    pub video_grid_t: u32,
    /// Prompts in the `prefix_repetition` batch.
    pub prefix_prompts: usize,
    /// Shared prefixes among them.
    pub num_prefixes: usize,
    /// Tokens of each shared prefix and of each random suffix.
    pub prefix_len: usize,
    pub suffix_len: usize,
    /// Tokens of each `multi_round` reply the engine generates (greedy, eos ignored)
    /// before the next round re-sends it.
    pub reply_tokens: usize,
    /// Chunked-prefill budget (new tokens per scheduler step): small enough that a
    /// batch spans several steps, so later prompts find what earlier steps cached.
    pub max_tokens_per_step: usize,
}

impl DemoScale {
    /// The default demo: real image and audio, the video cut to `video_grid_t`
    /// grid steps, and the fixture's prefix/suffix lengths and prefix count
    /// with two prompts per prefix.
    pub fn full(video_grid_t: u32) -> Result<Self> {
        let p = Scenarios::load()?.prefix_repetition;
        Ok(DemoScale {
            full_media: true,
            video_grid_t,
            prefix_prompts: (2 * p.num_prefixes).min(p.num_prompts),
            num_prefixes: p.num_prefixes,
            prefix_len: p.prefix_len,
            suffix_len: p.suffix_len,
            reply_tokens: 32,
            max_tokens_per_step: 2048,
        })
    }

    /// A CI-sized demo: items of a few tokens, a batch of four short prompts.
    pub fn quick() -> Self {
        DemoScale {
            full_media: false,
            video_grid_t: 2,
            prefix_prompts: 4,
            num_prefixes: 2,
            prefix_len: 32,
            suffix_len: 16,
            reply_tokens: 8,
            max_tokens_per_step: 64,
        }
    }
}

/// The media every workload draws its items from (one item per modality).
pub fn demo_media(scale: &DemoScale, seed: u64) -> Result<Media> {
    if !scale.full_media {
        let mut media = Media::generate(MediaScale::Tiny, seed)?;
        media.shapes.image = ItemLayout::Image { grid_thw: [1, 4, 8] };
        media.shapes.audio = ItemLayout::Audio { mel_frames: 100 };
        media.shapes.video =
            ItemLayout::Video { grid_thw: [scale.video_grid_t, 4, 8], seconds_per_grid: 2.0 };
        return Ok(media);
    }
    let mut media = Media::generate(MediaScale::Full, seed)?;
    if let ItemLayout::Video { grid_thw: [t, h, w], seconds_per_grid } = media.shapes.video {
        let keep_t = scale.video_grid_t.clamp(1, t);
        // Two frames per temporal grid step (temporal patch size 2).
        let frames = 2 * keep_t as usize;
        media.video = media.video.slice(s![..frames, .., .., ..]).to_owned();
        media.shapes.video = ItemLayout::Video { grid_thw: [keep_t, h, w], seconds_per_grid };
    }
    Ok(media)
}

/// One wave of requests: submitted together, run to completion.
pub type Wave = Vec<RequestPlan>;

/// The waves of `workload` at `scale`; text ids drawn from `seed`.
pub fn waves(workload: DemoWorkload, scale: &DemoScale, seed: u64) -> Result<Vec<Wave>> {
    let s = Scenarios::load()?;
    let text = |ids: Vec<u32>| RequestPlan { token_ids: ids, items: Vec::new() };
    Ok(match workload {
        DemoWorkload::RfcTextPair => {
            vec![vec![text(s.rfc_text_pair.prompt1)], vec![text(s.rfc_text_pair.prompt2)]]
        }
        DemoWorkload::MultiRound => conversation_rounds()?.into_iter().map(|plan| vec![plan]).collect(),
        DemoWorkload::PrefixRepetition => vec![prefix_repetition(scale, seed)],
    })
}

/// `prefix_prompts` prompts over `num_prefixes` shared prefixes (vLLM's dataset: random ids, prefixes shared evenly).
fn prefix_repetition(scale: &DemoScale, seed: u64) -> Wave {
    prefix_repetition_prompts(
        scale.prefix_prompts,
        scale.num_prefixes,
        scale.prefix_len,
        scale.suffix_len,
        TEXT_VOCAB,
        seed,
    )
    .into_iter()
    .map(|token_ids| RequestPlan { token_ids, items: Vec::new() })
    .collect()
}

/// Prompt tokens of `plan` once each item's one placeholder is expanded to its rows.
pub fn expanded_len(plan: &RequestPlan, media: &Media) -> usize {
    plan.items.iter().map(|&m| media.shapes.layout(m).num_tokens().saturating_sub(1)).sum::<usize>()
        + plan.token_ids.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc_pair_shares_46_tokens() -> Result<()> {
        let w = waves(DemoWorkload::RfcTextPair, &DemoScale::quick(), 0)?;
        let (a, b) = (&w[0][0].token_ids, &w[1][0].token_ids);
        assert_eq!((a.len(), b.len()), (67, 57));
        assert_eq!(a.iter().zip(b).take_while(|(x, y)| x == y).count(), 46);
        Ok(())
    }

    #[test]
    fn prefix_repetition_shares_prefixes_round_robin() -> Result<()> {
        let scale = DemoScale::full(1)?;
        assert_eq!((scale.prefix_prompts, scale.num_prefixes, scale.prefix_len), (20, 10, 256));
        let wave = &waves(DemoWorkload::PrefixRepetition, &scale, 3)?[0];
        assert_eq!(wave.len(), 20);
        assert!(wave.iter().all(|p| p.token_ids.len() == 512));
        assert_eq!(wave[0].token_ids[..256], wave[10].token_ids[..256]);
        assert_ne!(wave[0].token_ids[..256], wave[1].token_ids[..256]);
        assert_ne!(wave[0].token_ids[256..], wave[10].token_ids[256..]);
        Ok(())
    }

    #[test]
    fn scaled_video_keeps_two_frames_per_grid_step() -> Result<()> {
        let media = demo_media(&DemoScale::quick(), 1)?;
        assert_eq!(media.shapes.video.num_tokens(), 2 * 4 * 8 / 4);
        let err = crate::workloads::by_name::<DemoWorkload>("rfc");
        assert!(matches!(err, Err(crate::HarnessError::UnknownWorkload { name, .. }) if name == "rfc"));
        Ok(())
    }
}
