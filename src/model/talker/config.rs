//! The `talker_config` object of a Qwen3-Omni `config.json` → [`TalkerConfig`]: the
//! talker decoder's and the code predictor's [`Config`](crate::model::Config)s, and the codec ids and
//! sizes the generation loop needs.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::error::CheckpointError;
use crate::model::Config;
use crate::model::config::{parse_json, read_text};
use crate::{Error, Result};

/// HF's `mrope_section` when the talker's `rope_parameters` names none
/// (`Qwen3OmniMoeThinkerTextRotaryEmbedding`).
const DEFAULT_MROPE_SECTION: [usize; 3] = [24, 20, 20];

/// How many ids at the top of the talker's vocabulary are special (HF `generate`
/// suppresses `vocab - 1024 .. vocab` except the codec EOS).
pub const SPECIAL_CODEC_IDS: usize = 1024;

/// The talker of a Qwen3-Omni checkpoint: what HF's `Qwen3OmniMoeTalkerConfig` holds.
#[derive(Debug, Clone, PartialEq)]
pub struct TalkerConfig {
    /// The talker decoder (`text_config`): Qwen3-MoE with a shared expert in every
    /// layer, interleaved M-RoPE, `codec_embedding` in and `codec_head` out.
    pub text: Config,
    /// The code predictor (`code_predictor_config`): a dense Qwen3 decoder with 1-D RoPE.
    pub code_predictor: Config,
    /// Codes per frame: the talker's first code plus `num_code_groups - 1` from the predictor.
    pub num_code_groups: usize,
    /// Width of the thinker rows the text and hidden projections take.
    pub thinker_hidden_size: usize,
    /// The thinker layer whose output feeds `hidden_projection` for multimodal rows.
    pub accept_hidden_layer: usize,
    /// The code that ends the talker's generation.
    pub codec_eos_token_id: u32,
    /// Codec ids of the assistant prompt (`nothink`, `think_bos`, `think_eos`, pad, bos).
    pub codec_nothink_id: u32,
    pub codec_think_bos_id: u32,
    pub codec_think_eos_id: u32,
    pub codec_pad_id: u32,
    pub codec_bos_id: u32,
    /// Speaker name (lower case) → codec id of the voice.
    pub speaker_id: BTreeMap<String, u32>,
    /// The vision merge size the talker's own 3-D positions use.
    pub spatial_merge_size: usize,
    /// Thinker ids the talker's 3-D positions look at.
    pub audio_token_id: u32,
    pub image_token_id: u32,
    pub video_token_id: u32,
    pub position_id_per_seconds: usize,
}

/// The raw HF fields; absent ones take HF's defaults.
#[derive(Debug, Deserialize)]
struct RawTalker {
    text_config: Option<serde_json::Value>,
    code_predictor_config: Option<serde_json::Value>,
    num_code_groups: Option<usize>,
    thinker_hidden_size: Option<usize>,
    accept_hidden_layer: Option<usize>,
    codec_eos_token_id: Option<u32>,
    codec_nothink_id: Option<u32>,
    codec_think_bos_id: Option<u32>,
    codec_think_eos_id: Option<u32>,
    codec_pad_id: Option<u32>,
    codec_bos_id: Option<u32>,
    speaker_id: Option<BTreeMap<String, u32>>,
    spatial_merge_size: Option<usize>,
    audio_token_id: Option<u32>,
    image_token_id: Option<u32>,
    video_token_id: Option<u32>,
    position_id_per_seconds: Option<usize>,
}

fn unsupported(field: &'static str, value: impl std::fmt::Debug, reason: &'static str) -> Error {
    CheckpointError::UnsupportedConfig { field, value: format!("{value:?}"), reason }.into()
}

fn missing(field: &str) -> Error {
    CheckpointError::ConfigParse(format!("talker_config: missing `{field}`")).into()
}

impl TalkerConfig {
    /// Reads the `talker_config` of the `config.json` in `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        Self::from_json_str(&read_text(&dir.join("config.json"))?)
    }

    /// Parses a full Omni `config.json` (its `talker_config`), or a bare talker config.
    ///
    /// Errors: not JSON or a field of the wrong type → [`CheckpointError::ConfigParse`];
    /// sizes that do not fit together → [`CheckpointError::UnsupportedConfig`] naming the field.
    pub fn from_json_str(json: &str) -> Result<Self> {
        let root = parse_json(json)?;
        let talker = root.get("talker_config").unwrap_or(&root);
        let raw = RawTalker::deserialize(talker)
            .map_err(|e| CheckpointError::ConfigParse(format!("talker_config: {e}")))?;
        Self::from_raw(raw)
    }

    fn from_raw(raw: RawTalker) -> Result<Self> {
        let mut text =
            Config::from_text_value(raw.text_config.as_ref().ok_or_else(|| missing("text_config"))?)?;
        // HF builds every talker layer as the sparse block, whatever `mlp_only_layers` says.
        let Some(moe) = text.moe.as_mut() else {
            return Err(unsupported("num_experts", 0, "the talker's layers are all Mixture-of-Experts"));
        };
        moe.decoder_sparse_step = 1;
        moe.mlp_only_layers.clear();
        // The talker's rotary embedding is the thinker's: interleaved M-RoPE.
        text.mrope_section = Some(text.mrope_section.unwrap_or(DEFAULT_MROPE_SECTION));
        text.mrope_interleaved = true;
        text.validate()?;
        let mut code_predictor = Config::from_text_value(
            raw.code_predictor_config.as_ref().ok_or_else(|| missing("code_predictor_config"))?,
        )?;
        // The code predictor is a dense decoder with 1-D RoPE whatever else its config says.
        code_predictor.moe = None;
        code_predictor.mrope_section = None;
        code_predictor.validate()?;
        let cfg = TalkerConfig {
            text,
            code_predictor,
            num_code_groups: raw.num_code_groups.unwrap_or(32),
            thinker_hidden_size: raw.thinker_hidden_size.unwrap_or(2048),
            accept_hidden_layer: raw.accept_hidden_layer.unwrap_or(18),
            codec_eos_token_id: raw.codec_eos_token_id.unwrap_or(4198),
            codec_nothink_id: raw.codec_nothink_id.unwrap_or(4203),
            codec_think_bos_id: raw.codec_think_bos_id.unwrap_or(4204),
            codec_think_eos_id: raw.codec_think_eos_id.unwrap_or(4205),
            codec_pad_id: raw.codec_pad_id.unwrap_or(4196),
            codec_bos_id: raw.codec_bos_id.unwrap_or(4197),
            speaker_id: raw.speaker_id.unwrap_or_default(),
            spatial_merge_size: raw.spatial_merge_size.unwrap_or(2),
            audio_token_id: raw.audio_token_id.unwrap_or(151_646),
            image_token_id: raw.image_token_id.unwrap_or(151_655),
            video_token_id: raw.video_token_id.unwrap_or(151_656),
            position_id_per_seconds: raw.position_id_per_seconds.unwrap_or(25),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the parts fit together: the predictor works in the talker's width, every
    /// codec id is in the talker's vocabulary, a frame has at least two codes.
    pub fn validate(&self) -> Result<()> {
        self.text.validate()?;
        self.code_predictor.validate()?;
        if self.num_code_groups < 2 || self.num_code_groups > 1024 {
            return Err(unsupported("num_code_groups", self.num_code_groups, "must be in 2..=1024"));
        }
        if self.code_predictor.hidden_size != self.text.hidden_size {
            return Err(unsupported(
                "code_predictor_config.hidden_size",
                self.code_predictor.hidden_size,
                "must equal the talker's hidden_size (the predictor reads the talker's hidden state)",
            ));
        }
        for (field, size) in [
            ("thinker_hidden_size", self.thinker_hidden_size),
            ("spatial_merge_size", self.spatial_merge_size),
        ] {
            if size == 0 || size > 1 << 20 {
                return Err(unsupported(field, size, "must be in 1..=2^20"));
            }
        }
        let vocab = self.text.vocab_size;
        let ids = [
            ("codec_eos_token_id", self.codec_eos_token_id),
            ("codec_nothink_id", self.codec_nothink_id),
            ("codec_think_bos_id", self.codec_think_bos_id),
            ("codec_think_eos_id", self.codec_think_eos_id),
            ("codec_pad_id", self.codec_pad_id),
            ("codec_bos_id", self.codec_bos_id),
        ];
        let speakers = self.speaker_id.values().map(|&id| ("speaker_id", id));
        if let Some((field, id)) = ids.into_iter().chain(speakers).find(|&(_, id)| id as usize >= vocab) {
            return Err(unsupported(field, id, "must be below the talker's vocab_size"));
        }
        Ok(())
    }

    /// The ids HF's `generate` never lets the talker draw: the top
    /// [`SPECIAL_CODEC_IDS`] of its vocabulary except the codec EOS.
    pub fn suppressed_codes(&self) -> impl Iterator<Item = u32> + '_ {
        let vocab = self.text.vocab_size as u32;
        (vocab.saturating_sub(SPECIAL_CODEC_IDS as u32)..vocab).filter(|&id| id != self.codec_eos_token_id)
    }

    /// A talker of a few hundred kilobytes (hidden 32, two layers each, 16 code
    /// groups, 32 codes per group) for examples and tests.
    #[doc(hidden)]
    pub fn tiny() -> Self {
        // The literal parses and validates: a test holds it to that.
        Self::from_json_str(TINY).unwrap_or_else(|e| unreachable!("the tiny talker config is valid: {e}"))
    }
}

/// The tiny talker's `talker_config` (see [`TalkerConfig::tiny`]).
const TINY: &str = r#"{"talker_config": {
  "text_config": {"model_type": "qwen3_omni_moe_talker_text", "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "vocab_size": 1056, "rms_norm_eps": 1e-6, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "norm_topk_prob": false,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2], "interleaved": true}},
  "code_predictor_config": {"model_type": "qwen3_omni_moe_talker_code_predictor", "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "vocab_size": 32, "num_code_groups": 16, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
  "num_code_groups": 16, "thinker_hidden_size": 24, "accept_hidden_layer": 1, "codec_eos_token_id": 40,
  "codec_nothink_id": 41, "codec_think_bos_id": 42, "codec_think_eos_id": 43, "codec_pad_id": 44,
  "codec_bos_id": 45, "speaker_id": {"ethan": 46}, "spatial_merge_size": 2}}"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_config_parses_with_hf_semantics() {
        let cfg = TalkerConfig::tiny();
        let moe = cfg.text.moe.as_ref().unwrap();
        assert_eq!((moe.shared_expert_intermediate_size, moe.norm_topk_prob), (24, false));
        assert!((0..2).all(|l| cfg.text.is_sparse_layer(l)));
        assert!(cfg.text.mrope_interleaved && cfg.text.mrope_section == Some([1, 1, 2]));
        assert!(cfg.code_predictor.moe.is_none() && cfg.code_predictor.mrope_section.is_none());
        assert_eq!(cfg.speaker_id["ethan"], 46);
        let suppressed: Vec<u32> = cfg.suppressed_codes().collect();
        assert_eq!(suppressed.len(), 1023);
        assert_eq!((suppressed[0], *suppressed.last().unwrap()), (32, 1055));
        assert!(!suppressed.contains(&40) && !suppressed.contains(&31));
    }

    #[test]
    fn bad_fields_are_named() {
        let tiny = TINY.to_string();
        let cases = [
            (tiny.replace(r#""num_code_groups": 16, "thinker"#, r#""num_code_groups": 1, "thinker"#), "num_code_groups"),
            (tiny.replace(r#""codec_eos_token_id": 40"#, r#""codec_eos_token_id": 4000"#), "codec_eos_token_id"),
            (tiny.replace(r#""ethan": 46"#, r#""ethan": 2000"#), "speaker_id"),
            (tiny.replace(r#""intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "vocab_size": 32"#, r#""intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "vocab_size": 32, "hidden_size": 16"#), "code_predictor_config.hidden_size"),
            (tiny.replace(r#""num_experts": 4,"#, r#""num_experts": 0,"#), "num_experts"),
        ];
        for (json, field) in cases {
            let err = TalkerConfig::from_json_str(&json).unwrap_err();
            assert!(
                matches!(&err, Error::Checkpoint(CheckpointError::UnsupportedConfig { field: f, .. }) if *f == field),
                "{field}: {err}"
            );
        }
        assert!(matches!(
            TalkerConfig::from_json_str(r#"{"talker_config": {"num_code_groups": 16}}"#),
            Err(Error::Checkpoint(CheckpointError::ConfigParse(_)))
        ));
        assert!(matches!(
            TalkerConfig::from_json_str(r#"{"talker_config": {"num_code_groups": "x"}}"#),
            Err(Error::Checkpoint(CheckpointError::ConfigParse(_)))
        ));
    }
}
