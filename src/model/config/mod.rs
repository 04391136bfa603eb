//! The thinker's text-model config: the [`Config`] type and its checks. It is read from a
//! Hugging Face `config.json` by [`hf`](crate::model::config::hf) (Qwen2, Qwen3, Qwen3-MoE, Qwen2.5-Omni and Qwen3-Omni
//! thinkers; the one reader of that file), or built in memory for a small random-weight model
//! from the presets in [`presets`](crate::model::config::presets) ([`TinyModel`](crate::model::TinyModel)).

/// HF `config.json` / `generation_config.json` → [`Config`], and a checkpoint's special ids.
pub mod hf;
/// [`TinyModel`]: small random-weight models sized by name.
pub mod presets;

use crate::backend::{RopeKind, RopeSpec};
use crate::error::CheckpointError;
use crate::{Error, Result};

pub use hf::{tokens_from_config_file, tokens_from_config_json};
pub use presets::{TinyFamily, TinyModel};

/// Mixture-of-Experts settings (Qwen3-MoE / Qwen3-Omni thinker).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer (1-based) is sparse...
    pub decoder_sparse_step: usize,
    /// ...unless listed here.
    pub mlp_only_layers: Vec<usize>,
    /// Intermediate size of the shared expert every sparse layer adds under a
    /// sigmoid gate (Qwen2-MoE, the Qwen3-Omni talker); 0 = no shared expert.
    pub shared_expert_intermediate_size: usize,
}

/// Everything the thinker's decoder needs to know about its shape.
///
/// Read it from a checkpoint's `config.json`, or size a small random-weight
/// model by name with [`TinyModel`]:
///
/// ```
/// let json = r#"{"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
///   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
///   "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 100,
///   "tie_word_embeddings": true}"#;
/// let cfg = omniprefix::model::Config::from_json_str(json)?;
/// assert!(cfg.qk_norm && !cfg.attention_bias);
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// HF `model_type` of the text model (decides qk-norm and default biases).
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v projections (Qwen2 family).
    pub attention_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3 family).
    pub qk_norm: bool,
    /// M-RoPE sections (temporal, height, width) in frequencies; `None` = 1-D RoPE.
    pub mrope_section: Option<[usize; 3]>,
    /// Qwen3-Omni interleaves the M-RoPE sections; Qwen2.5-Omni keeps them contiguous.
    pub mrope_interleaved: bool,
    pub moe: Option<MoeConfig>,
    /// Longest prompt the model was trained for (HF `max_position_embeddings`);
    /// the engine rejects longer requests. `None`: no limit known.
    pub max_position_embeddings: Option<usize>,
    /// DeepStack levels the checkpoint's vision encoder produces (the length of
    /// `vision_config.deepstack_visual_indexes`); `None` when the config names none.
    /// Level `i` is added after decoder layer `i`.
    pub deepstack_levels: Option<usize>,
    /// Token ids that end generation (HF `eos_token_id`, one id or a list), each
    /// below `vocab_size`; empty when the checkpoint names none (and for
    /// [`TinyModel`] configs). [`Config::from_dir`] prefers `generation_config.json`
    /// over `config.json`; see there.
    pub eos_token_ids: Vec<u32>,
}

/// Largest size of any one model dimension (hidden, heads, layers, experts...).
const MAX_DIM: usize = 1 << 20;
/// Largest vocabulary.
const MAX_VOCAB: usize = 1 << 24;

fn unsupported(field: &'static str, value: impl std::fmt::Debug, reason: &'static str) -> Error {
    CheckpointError::UnsupportedConfig { field, value: format!("{value:?}"), reason }.into()
}

/// The text of a checkpoint's file at `path`; an unreadable one is an
/// [`IoError`](crate::error::IoError) naming it. One rule for every config reader.
pub(crate) fn read_text(path: &std::path::Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| crate::error::IoError::read(path, source).into())
}

/// The root of a checkpoint's JSON text; text that is not JSON is
/// [`CheckpointError::ConfigParse`].
pub(crate) fn parse_json(text: &str) -> Result<serde_json::Value> {
    serde_json::from_str(text).map_err(|e| CheckpointError::ConfigParse(e.to_string()).into())
}

impl Config {
    /// Checks the sizes fit together (heads divide, sections cover the head).
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("vocab_size", self.vocab_size),
        ];
        if let Some((field, value)) = sizes.into_iter().find(|&(_, v)| v == 0) {
            return Err(unsupported(field, value, "must be positive"));
        }
        // Bounds far above any real model keep every product the loader forms
        // (e.g. experts x 2 x intermediate x hidden) from overflowing.
        let moe = self.moe.as_ref();
        let dims = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("num_experts", moe.map_or(0, |m| m.num_experts)),
            ("moe_intermediate_size", moe.map_or(0, |m| m.moe_intermediate_size)),
            ("shared_expert_intermediate_size", moe.map_or(0, |m| m.shared_expert_intermediate_size)),
        ];
        if let Some((field, value)) = dims.into_iter().find(|&(_, v)| v > MAX_DIM) {
            return Err(unsupported(field, value, "larger than any supported model (limit 2^20)"));
        }
        if self.vocab_size > MAX_VOCAB {
            return Err(unsupported(
                "vocab_size",
                self.vocab_size,
                "larger than any supported model (limit 2^24)",
            ));
        }
        if let Some(levels) = self.deepstack_levels.filter(|&l| l > self.num_hidden_layers) {
            return Err(unsupported(
                "deepstack_visual_indexes",
                levels,
                "more DeepStack levels than decoder layers",
            ));
        }
        if let Some(&id) = self.eos_token_ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(unsupported("eos_token_id", id, "must be below vocab_size"));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(unsupported("rope_theta", self.rope_theta, "must be finite and positive"));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Err(unsupported("rms_norm_eps", self.rms_norm_eps, "must be finite and non-negative"));
        }
        if self.num_attention_heads == 0 || self.num_key_value_heads == 0 {
            return Err(unsupported(
                "num_attention_heads",
                self.num_attention_heads,
                "heads must be positive",
            ));
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(unsupported(
                "num_key_value_heads",
                self.num_key_value_heads,
                "must divide num_attention_heads",
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(unsupported("head_dim", self.head_dim, "must be even and positive"));
        }
        if let Some(sec) = self.mrope_section
            && sec.iter().fold(0usize, |a, &b| a.saturating_add(b)) != self.head_dim / 2
        {
            return Err(unsupported("mrope_section", sec, "sections must sum to head_dim / 2"));
        }
        if let Some(moe) = &self.moe {
            if moe.num_experts_per_tok == 0 || moe.num_experts_per_tok > moe.num_experts {
                return Err(unsupported(
                    "num_experts_per_tok",
                    moe.num_experts_per_tok,
                    "must be in 1..=num_experts",
                ));
            }
            if moe.decoder_sparse_step == 0 {
                return Err(unsupported("decoder_sparse_step", 0, "must be positive"));
            }
        }
        Ok(())
    }

    /// True when layer `layer` uses the MoE block rather than the dense MLP
    /// (HF: not in `mlp_only_layers` and `(layer + 1) % decoder_sparse_step == 0`).
    pub fn is_sparse_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| {
            !m.mlp_only_layers.contains(&layer) && (layer + 1).is_multiple_of(m.decoder_sparse_step)
        })
    }

    /// The rotary embedding this config implies.
    pub fn rope_spec(&self) -> RopeSpec {
        let kind = match self.mrope_section {
            None => RopeKind::Plain,
            Some(s) if self.mrope_interleaved => RopeKind::Interleaved(s),
            Some(s) => RopeKind::Sectioned(s),
        };
        RopeSpec { theta: self.rope_theta as f32, head_dim: self.head_dim, kind }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_values_name_their_field() {
        let cases = [
            (r#", "hidden_act": "gelu""#, "hidden_act"),
            (r#", "use_sliding_window": true"#, "use_sliding_window"),
        ];
        for (extra, field) in cases {
            // Later duplicate keys win in serde_json objects.
            let err = Config::from_json_str(&hf::tests::omni_text(extra)).unwrap_err();
            assert!(
                matches!(err, Error::Checkpoint(CheckpointError::UnsupportedConfig { field: f, .. }) if f == field),
                "{err}"
            );
        }
        let yarn = hf::tests::omni_text("").replace(r#""rope_type": "default""#, r#""rope_type": "yarn""#);
        assert!(matches!(
            Config::from_json_str(&yarn),
            Err(Error::Checkpoint(CheckpointError::UnsupportedConfig { field: "rope_type", .. }))
        ));
        let bad_sections = hf::tests::omni_text("").replace("[24, 20, 20]", "[24, 20, 21]");
        assert!(matches!(
            Config::from_json_str(&bad_sections),
            Err(Error::Checkpoint(CheckpointError::UnsupportedConfig { field: "mrope_section", .. }))
        ));
        let llama = r#"{"model_type": "llama", "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 4}"#;
        assert!(matches!(
            Config::from_json_str(llama),
            Err(Error::Checkpoint(CheckpointError::UnsupportedConfig { field: "model_type", .. }))
        ));
        assert!(matches!(
            Config::from_json_str("{}"),
            Err(Error::Checkpoint(CheckpointError::ConfigParse(_)))
        ));
        let mut gqa = TinyModel { layers: 1, kv_heads: 3, vocab: 10, ..TinyModel::qwen3() }.config();
        gqa.head_dim = 8;
        assert!(matches!(
            gqa.validate(),
            Err(Error::Checkpoint(CheckpointError::UnsupportedConfig { field: "num_key_value_heads", .. }))
        ));
    }
}
