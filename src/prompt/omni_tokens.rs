//! Special token ids and placement constants of a Qwen3-Omni-style thinker,
//! and the number of placeholder tokens each item layout occupies.

use crate::canon::{ItemIdentity, ItemLayout, LayoutRules, Modality};
use crate::error::{RequestError, Result};

/// The ids and constants the prompt builder needs to lay out items.
///
/// Field names are the Hugging Face thinker config's keys, so the config's
/// JSON (or the `special_ids` object of `fixtures/mrope_position_vectors.json`)
/// deserialises directly. They follow one pattern, `<token>_token_id`:
///
/// | token | field | [`qwen3_omni`](Self::qwen3_omni) | [`tiny`](Self::tiny) |
/// |---|---|---:|---:|
/// | `<\|image_pad\|>` | `image_token_id` | 151655 | 500 |
/// | `<\|video_pad\|>` | `video_token_id` | 151656 | 501 |
/// | `<\|audio_pad\|>` | `audio_token_id` | 151675 | 502 |
/// | `<\|vision_start\|>` | `vision_start_token_id` | 151652 | 503 |
/// | `<\|vision_end\|>` | `vision_end_token_id` | 151653 | 504 |
/// | `<\|audio_start\|>` | `audio_start_token_id` | 151669 | 505 |
/// | `<\|audio_end\|>` | `audio_end_token_id` | 151670 | 506 |
///
/// Rather than naming fields, a prompt usually asks by modality:
/// [`pad_id`](Self::pad_id) for the placeholder, and
/// [`unexpanded_item`](Self::unexpanded_item) for the start, pad and end ids
/// of one item in the unexpanded form (the engine expands the pad to the
/// item's token count). Other ids: struct-update syntax on a preset.
///
/// ```
/// use omniprefix::canon::Modality;
/// use omniprefix::prompt::OmniTokens;
///
/// let tokens = OmniTokens::tiny();
/// assert_eq!(tokens.pad_id(Modality::Image), tokens.image_token_id);
/// assert_eq!(tokens.unexpanded_item(Modality::Image), [503, 500, 504]);
/// assert_eq!(tokens.unexpanded_item(Modality::Audio), [505, 502, 506]);
///
/// let mine = OmniTokens { image_token_id: 7, ..OmniTokens::tiny() };
/// assert_eq!(mine.unexpanded_item(Modality::Image), [503, 7, 504]);
///
/// let from_json: OmniTokens = serde_json::from_str(
///     r#"{"image_token_id": 500, "video_token_id": 501, "audio_token_id": 502,
///         "vision_start_token_id": 503, "vision_end_token_id": 504,
///         "audio_start_token_id": 505, "audio_end_token_id": 506}"#,
/// ).unwrap();
/// assert_eq!(from_json, OmniTokens::tiny());
/// ```
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OmniTokens {
    /// `<|image_pad|>`: one per image token.
    pub image_token_id: u32,
    /// `<|video_pad|>`: one per video token.
    pub video_token_id: u32,
    /// `<|audio_pad|>`: one per audio token.
    pub audio_token_id: u32,
    /// `<|vision_start|>`: opens an image or video (and an audio-in-video).
    pub vision_start_token_id: u32,
    /// `<|vision_end|>`: closes an image or video.
    pub vision_end_token_id: u32,
    /// `<|audio_start|>`: opens an audio.
    pub audio_start_token_id: u32,
    /// `<|audio_end|>`: closes an audio.
    pub audio_end_token_id: u32,
    /// Side of the square of vision patches merged into one LLM token.
    #[serde(default = "default_merge_size")]
    pub spatial_merge_size: u32,
    /// Temporal M-RoPE positions per second of video.
    #[serde(default = "default_position_id_per_seconds")]
    pub position_id_per_seconds: u32,
}

fn default_merge_size() -> u32 {
    LayoutRules::QWEN3_OMNI.merge
}

fn default_position_id_per_seconds() -> u32 {
    LayoutRules::QWEN3_OMNI.positions_per_second
}

impl OmniTokens {
    /// Qwen3-Omni (30B-A3B) thinker: the ids of its tokenizer and config
    /// (`fixtures/qwen3_omni.json`). The vocab size is left unknown: set it from
    /// the checkpoint's config to have out-of-vocab ids rejected.
    pub fn qwen3_omni() -> Self {
        Self {
            image_token_id: 151_655,
            video_token_id: 151_656,
            audio_token_id: 151_675,
            vision_start_token_id: 151_652,
            vision_end_token_id: 151_653,
            audio_start_token_id: 151_669,
            audio_end_token_id: 151_670,
            spatial_merge_size: default_merge_size(),
            position_id_per_seconds: default_position_id_per_seconds(),
        }
    }

    /// The tiny vocabulary of `fixtures/mrope_position_vectors.json`, for tests and examples.
    pub fn tiny() -> Self {
        Self {
            image_token_id: 500,
            video_token_id: 501,
            audio_token_id: 502,
            vision_start_token_id: 503,
            vision_end_token_id: 504,
            audio_start_token_id: 505,
            audio_end_token_id: 506,
            spatial_merge_size: default_merge_size(),
            position_id_per_seconds: default_position_id_per_seconds(),
        }
    }

    /// The placeholder (pad) id of a modality.
    pub fn pad_id(&self, modality: Modality) -> u32 {
        match modality {
            Modality::Image => self.image_token_id,
            Modality::Video => self.video_token_id,
            Modality::Audio => self.audio_token_id,
        }
    }

    /// The ids of one item in the unexpanded prompt form: `[start, pad, end]`
    /// (`vision_start`/`vision_end` around an image or video pad,
    /// `audio_start`/`audio_end` around an audio pad).
    pub fn unexpanded_item(&self, modality: Modality) -> [u32; 3] {
        let (start, end) = match modality {
            Modality::Image | Modality::Video => (self.vision_start_token_id, self.vision_end_token_id),
            Modality::Audio => (self.audio_start_token_id, self.audio_end_token_id),
        };
        [start, self.pad_id(modality), end]
    }

    /// The modality whose placeholder `token` is, if it is one.
    pub fn placeholder_modality(&self, token: u32) -> Option<Modality> {
        [Modality::Image, Modality::Video, Modality::Audio].into_iter().find(|&m| self.pad_id(m) == token)
    }

    /// Placeholder tokens an item with `layout` occupies under this model's
    /// merge size, after [`ItemLayout::checked_tokens`] (errors name item 0).
    pub fn placeholder_count(&self, layout: &ItemLayout) -> Result<usize> {
        layout.checked_tokens(0, layout.modality(), self.layout_rules())
    }

    /// The merge size and temporal rate an item's layout is checked against.
    pub fn layout_rules(&self) -> LayoutRules {
        LayoutRules { merge: self.spatial_merge_size, positions_per_second: self.position_id_per_seconds }
    }

    /// Number of placeholder tokens of `item` (index `index` in the caller's
    /// list), after checking its layout against its modality and this model
    /// and that its declared count is the layout's.
    pub(crate) fn checked_token_count(&self, item: &ItemIdentity, index: usize) -> Result<usize> {
        let count = item.layout.checked_tokens(index, item.modality, self.layout_rules())?;
        if count != item.num_tokens {
            return Err(RequestError::InvalidLayout {
                item: index,
                field: "num_tokens",
                expected: format!("{count}, the count of its layout"),
                found: item.num_tokens.to_string(),
            }
            .into());
        }
        Ok(count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{Error, TestResult};

    #[test]
    fn audio_lengths_match_hf_reference_values() -> Result<()> {
        let tokens = OmniTokens::tiny();
        let count = |mel_frames| tokens.placeholder_count(&ItemLayout::Audio { mel_frames });
        assert_eq!(count(250)?, 33);
        assert_eq!(count(3000)?, 390);
        assert_eq!(count(300)?, 39);
        assert_eq!(count(100)?, 13);
        assert_eq!(count(1)?, 1);
        assert!(matches!(count(0), Err(Error::Request(RequestError::EmptyItem { .. }))));
        Ok(())
    }

    #[test]
    fn vision_counts_divide_by_merge_squared() -> Result<()> {
        let tokens = OmniTokens::tiny();
        assert_eq!(tokens.placeholder_count(&ItemLayout::Image { grid_thw: [1, 44, 80] })?, 880);
        let video = ItemLayout::Video { grid_thw: [10, 40, 72], seconds_per_grid: 1.0 };
        assert_eq!(tokens.placeholder_count(&video)?, 7200);
        let odd = tokens.placeholder_count(&ItemLayout::Image { grid_thw: [1, 3, 4] });
        assert!(matches!(
            odd,
            Err(Error::Request(RequestError::GridNotMergeable { item: 0, grid_thw: [1, 3, 4], merge: 2 }))
        ));
        let empty = tokens.placeholder_count(&ItemLayout::Image { grid_thw: [0, 4, 4] });
        assert!(matches!(empty, Err(Error::Request(RequestError::EmptyItem { .. }))));
        Ok(())
    }

    #[test]
    fn constructors_match_fixture_ids() -> TestResult {
        let fixture = |path: &str| -> serde_json::Value {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            serde_json::from_str(&text).unwrap_or_default()
        };
        let tiny: OmniTokens =
            serde_json::from_value(fixture("fixtures/mrope_position_vectors.json")["special_ids"].clone())?;
        assert_eq!(tiny, OmniTokens::tiny());
        let special = &fixture("fixtures/qwen3_omni.json")["special_tokens"];
        let q = OmniTokens::qwen3_omni();
        for (name, id) in [
            ("<|image_pad|>", q.image_token_id),
            ("<|video_pad|>", q.video_token_id),
            ("<|audio_pad|>", q.audio_token_id),
            ("<|vision_start|>", q.vision_start_token_id),
            ("<|vision_end|>", q.vision_end_token_id),
            ("<|audio_start|>", q.audio_start_token_id),
            ("<|audio_end|>", q.audio_end_token_id),
        ] {
            assert_eq!(special[name].as_u64(), Some(u64::from(id)), "{name}");
        }
        Ok(())
    }
}
