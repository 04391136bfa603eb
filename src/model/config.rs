//! The thinker's text-model config, read from a Hugging Face `config.json`
//! (Qwen2, Qwen3, Qwen3-MoE, Qwen2.5-Omni and Qwen3-Omni thinkers), or
//! built in memory for a small random-weight model with [`TinyModel`].

use std::path::Path;

use serde::Deserialize;

use crate::backend::{RopeKind, RopeSpec};
use crate::{Error, Result};
use crate::error::{CheckpointError, IoError};

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

/// The raw HF fields we read; unknown fields are ignored.
#[derive(Debug, Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    vocab_size: usize,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    hidden_act: Option<String>,
    use_sliding_window: Option<bool>,
    rope_scaling: Option<RawRope>,
    rope_parameters: Option<RawRope>,
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    shared_expert_intermediate_size: Option<usize>,
    max_position_embeddings: Option<usize>,
}

#[derive(Debug, Deserialize)]
struct RawRope {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    type_: Option<String>,
    rope_theta: Option<f64>,
    mrope_section: Option<Vec<usize>>,
    mrope_interleaved: Option<bool>,
    interleaved: Option<bool>,
}

/// Largest size of any one model dimension (hidden, heads, layers, experts...).
const MAX_DIM: usize = 1 << 20;
/// Largest vocabulary.
const MAX_VOCAB: usize = 1 << 24;

fn unsupported(field: &'static str, value: impl std::fmt::Debug, reason: &'static str) -> Error {
    CheckpointError::UnsupportedConfig { field, value: format!("{value:?}"), reason }.into()
}

/// Where an `eos_token_id` was read, for the error that names it.
#[derive(Clone, Copy)]
enum EosSource {
    Config,
    GenerationConfig,
}

/// A HF `eos_token_id`: `null` or absent → `None`; one id or a list of ids → the ids.
fn parse_eos(value: Option<&serde_json::Value>, source: EosSource) -> Result<Option<Vec<u32>>> {
    use serde_json::Value;
    let id = |v: &Value| v.as_u64().and_then(|id| u32::try_from(id).ok());
    let ids = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(items)) => items.iter().map(id).collect::<Option<Vec<u32>>>(),
        Some(one) => id(one).map(|id| vec![id]),
    };
    ids.map(Some).ok_or_else(|| {
        let found = value.unwrap_or(&Value::Null);
        let reason = match source {
            EosSource::Config => "config.json: expected a token id (0..2^32) or a list of token ids",
            EosSource::GenerationConfig => {
                "generation_config.json: expected a token id (0..2^32) or a list of token ids"
            }
        };
        unsupported("eos_token_id", found, reason)
    })
}

/// The eos ids of a `config.json`: the first `eos_token_id` that is set, at the
/// root, in `thinker_config`, in `thinker_config.text_config`, or in `text_config`.
fn eos_from_config(root: &serde_json::Value) -> Result<Vec<u32>> {
    for pointer in ["/eos_token_id", "/thinker_config/eos_token_id", "/thinker_config/text_config/eos_token_id", "/text_config/eos_token_id"] {
        if let Some(ids) = parse_eos(root.pointer(pointer), EosSource::Config)? {
            return Ok(ids);
        }
    }
    Ok(Vec::new())
}

impl Config {
    /// Reads a checkpoint directory's `config.json`, and the eos ids of its
    /// `generation_config.json` when that file exists.
    ///
    /// [`eos_token_ids`](Config::eos_token_ids) come from the first
    /// `eos_token_id` that is set (not absent, not `null`) in
    /// `generation_config.json`, then `config.json` at its root, in
    /// `thinker_config`, in `thinker_config.text_config` (Qwen3-Omni) or in
    /// `text_config`. Set nowhere: empty. A value that is neither an id nor a list
    /// of ids is [`CheckpointError::UnsupportedConfig`] with field `eos_token_id`;
    /// a `generation_config.json` that is not JSON is [`CheckpointError::ConfigParse`].
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let mut cfg = Self::from_file(&dir.join("config.json"))?;
        let path = dir.join("generation_config.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(cfg),
            Err(source) => return Err(IoError::read(&path, source).into()),
        };
        let generation: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| CheckpointError::ConfigParse(format!("generation_config.json: {e}")))?;
        if let Some(ids) = parse_eos(generation.get("eos_token_id"), EosSource::GenerationConfig)? {
            cfg.eos_token_ids = ids;
            cfg.validate()?;
        }
        Ok(cfg)
    }

    /// Reads `config.json` from a file (eos ids from it alone; [`Config::from_dir`]
    /// also reads `generation_config.json`).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| IoError::read(path, source))?;
        Self::from_json_str(&text)
    }

    /// Parses a HF config; for Omni checkpoints the text config is found under
    /// `thinker_config.text_config` or `text_config`.
    pub fn from_json_str(json: &str) -> Result<Self> {
        let root: serde_json::Value =
            serde_json::from_str(json).map_err(|e| CheckpointError::ConfigParse(e.to_string()))?;
        let text = root
            .pointer("/thinker_config/text_config")
            .or_else(|| root.get("text_config"))
            .unwrap_or(&root);
        let raw = RawConfig::deserialize(text).map_err(|e| CheckpointError::ConfigParse(e.to_string()))?;
        let deepstack = root
            .pointer("/thinker_config/vision_config/deepstack_visual_indexes")
            .or_else(|| root.pointer("/vision_config/deepstack_visual_indexes"));
        let deepstack_levels = match deepstack {
            None => None,
            Some(serde_json::Value::Array(indexes)) => Some(indexes.len()),
            Some(other) => return Err(unsupported("deepstack_visual_indexes", other, "expected a list of layer indexes")),
        };
        let eos_token_ids = eos_from_config(&root)?;
        let cfg = Config { deepstack_levels, eos_token_ids, ..Self::from_raw(raw)? };
        cfg.validate()?;
        Ok(cfg)
    }

    fn from_raw(raw: RawConfig) -> Result<Self> {
        let model_type = raw.model_type.unwrap_or_default();
        let (qk_norm, default_bias) = if model_type.starts_with("qwen3") {
            (true, false)
        } else if model_type.starts_with("qwen2") {
            (false, true)
        } else {
            return Err(unsupported("model_type", &model_type, "expected a qwen2* or qwen3* text model"));
        };
        if let Some(act) = raw.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(unsupported("hidden_act", act, "only silu (SwiGLU) is implemented"));
        }
        if raw.use_sliding_window == Some(true) {
            return Err(unsupported("use_sliding_window", true, "sliding-window attention is not implemented"));
        }
        if raw.shared_expert_intermediate_size.is_some_and(|s| s > 0) {
            return Err(unsupported(
                "shared_expert_intermediate_size",
                raw.shared_expert_intermediate_size,
                "shared experts are not implemented",
            ));
        }
        let rope = raw.rope_parameters.as_ref().or(raw.rope_scaling.as_ref());
        if let Some(kind) = rope.and_then(|r| r.rope_type.as_deref().or(r.type_.as_deref()))
            && !matches!(kind, "default" | "mrope") {
                return Err(unsupported("rope_type", kind, "only default RoPE / M-RoPE is implemented"));
            }
        let mrope_section = match rope.and_then(|r| r.mrope_section.as_deref()) {
            None => None,
            Some(&[t, h, w]) => Some([t, h, w]),
            Some(other) => return Err(unsupported("mrope_section", other, "expected three sections")),
        };
        let mrope_interleaved =
            rope.is_some_and(|r| r.mrope_interleaved.or(r.interleaved).unwrap_or(false));
        let rope_theta = rope.and_then(|r| r.rope_theta).or(raw.rope_theta).unwrap_or(10_000.0);
        let moe = match raw.num_experts.filter(|&n| n > 0) {
            None => None,
            Some(num_experts) => Some(MoeConfig {
                num_experts,
                num_experts_per_tok: raw
                    .num_experts_per_tok
                    .ok_or_else(|| CheckpointError::ConfigParse("missing field `num_experts_per_tok`".into()))?,
                moe_intermediate_size: raw
                    .moe_intermediate_size
                    .ok_or_else(|| CheckpointError::ConfigParse("missing field `moe_intermediate_size`".into()))?,
                norm_topk_prob: raw.norm_topk_prob.unwrap_or(true),
                decoder_sparse_step: raw.decoder_sparse_step.unwrap_or(1),
                mlp_only_layers: raw.mlp_only_layers.unwrap_or_default(),
            }),
        };
        // Without an explicit head_dim the heads split the hidden size evenly.
        if raw.head_dim.is_none()
            && raw.num_attention_heads > 0
            && !raw.hidden_size.is_multiple_of(raw.num_attention_heads)
        {
            return Err(unsupported(
                "hidden_size",
                raw.hidden_size,
                "must be a multiple of num_attention_heads when head_dim is absent",
            ));
        }
        let cfg = Config {
            head_dim: raw.head_dim.unwrap_or(raw.hidden_size / raw.num_attention_heads.max(1)),
            num_key_value_heads: raw.num_key_value_heads.unwrap_or(raw.num_attention_heads),
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            attention_bias: raw.attention_bias.unwrap_or(default_bias),
            model_type,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            rope_theta,
            vocab_size: raw.vocab_size,
            qk_norm,
            mrope_section,
            mrope_interleaved,
            moe,
            max_position_embeddings: raw.max_position_embeddings,
            deepstack_levels: None,
            eos_token_ids: Vec::new(),
        };
        cfg.validate()?;
        Ok(cfg)
    }

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
        ];
        if let Some((field, value)) = dims.into_iter().find(|&(_, v)| v > MAX_DIM) {
            return Err(unsupported(field, value, "larger than any supported model (limit 2^20)"));
        }
        if self.vocab_size > MAX_VOCAB {
            return Err(unsupported("vocab_size", self.vocab_size, "larger than any supported model (limit 2^24)"));
        }
        if let Some(levels) = self.deepstack_levels.filter(|&l| l > self.num_hidden_layers) {
            return Err(unsupported("deepstack_visual_indexes", levels, "more DeepStack levels than decoder layers"));
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
            return Err(unsupported("num_attention_heads", self.num_attention_heads, "heads must be positive"));
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
            && sec.iter().fold(0usize, |a, &b| a.saturating_add(b)) != self.head_dim / 2 {
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

    /// Positional shorthand for [`TinyModel`] with [`TinyFamily::Qwen3`].
    pub fn tiny_qwen3(hidden: usize, layers: usize, heads: usize, kv_heads: usize, vocab: usize) -> Self {
        TinyModel { family: TinyFamily::Qwen3, hidden, layers, heads, kv_heads, vocab }.config()
    }

    /// Positional shorthand for [`TinyModel`] with [`TinyFamily::Qwen2Omni`].
    pub fn tiny_qwen2_omni(hidden: usize, layers: usize, heads: usize, kv_heads: usize, vocab: usize) -> Self {
        TinyModel { family: TinyFamily::Qwen2Omni, hidden, layers, heads, kv_heads, vocab }.config()
    }

    /// Positional shorthand for [`TinyModel`] with [`TinyFamily::Qwen3OmniMoe`].
    pub fn tiny_qwen3_omni_moe(
        hidden: usize,
        layers: usize,
        heads: usize,
        kv_heads: usize,
        vocab: usize,
        num_experts: usize,
        top_k: usize,
    ) -> Self {
        let family = TinyFamily::Qwen3OmniMoe { experts: num_experts, top_k };
        TinyModel { family, hidden, layers, heads, kv_heads, vocab }.config()
    }
}

/// The architecture of a [`TinyModel`]: which Qwen thinker it imitates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TinyFamily {
    /// Dense Qwen3: qk-norm, no bias, 1-D RoPE, tied embeddings.
    Qwen3,
    /// Qwen2.5-Omni-style thinker: qkv bias, no qk-norm, contiguous (sectioned)
    /// M-RoPE, untied embeddings.
    Qwen2Omni,
    /// Qwen3-Omni-style MoE thinker: qk-norm, interleaved M-RoPE, untied
    /// embeddings; every layer but layer 0 is sparse, with `experts` experts of
    /// which `top_k` run per token (intermediate size `hidden / 2` each).
    Qwen3OmniMoe { experts: usize, top_k: usize },
}

/// A small model for seeded random weights (tests, examples, the demo), sized by name.
///
/// Start from a family preset and override what you need with struct-update
/// syntax; [`TinyModel::config`] (or `Config::from`) gives the full [`Config`]:
///
/// ```
/// use omniprefix::model::{Config, TinyFamily, TinyModel};
///
/// // A Qwen3-Omni-style MoE thinker with M-RoPE: hidden 64, 2 layers, 4 query / 2 KV heads.
/// let model: Config = TinyModel { hidden: 64, vocab: 600, ..TinyModel::qwen3_omni_moe() }.config();
/// assert_eq!((model.hidden_size, model.num_hidden_layers, model.head_dim), (64, 2, 16));
/// assert!(model.mrope_section.is_some() && model.moe.is_some());
///
/// // Other expert counts go in the family; other sizes in the named fields.
/// let wide = TinyModel {
///     family: TinyFamily::Qwen3OmniMoe { experts: 8, top_k: 2 },
///     layers: 4,
///     ..TinyModel::qwen3_omni_moe()
/// };
/// assert_eq!(Config::from(wide).moe.map(|m| m.num_experts), Some(8));
///
/// // Anything else: edit the returned config, whose fields are public.
/// let tied = Config { tie_word_embeddings: true, ..TinyModel::qwen2_omni().config() };
/// assert!(tied.attention_bias && tied.tie_word_embeddings);
/// ```
///
/// Derived sizes: `head_dim = hidden / heads`, dense `intermediate_size = 2 * hidden`,
/// RMSNorm eps 1e-6, RoPE theta 10 000, no context limit, no DeepStack levels, no eos ids.
/// The presets are hidden 32, 2 layers, 4 query / 2 KV heads and a 512-id
/// vocabulary, which holds [`OmniTokens::tiny`](crate::prompt::OmniTokens::tiny)'s
/// special ids (500-506).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TinyModel {
    pub family: TinyFamily,
    /// Hidden size of the residual stream.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads; must divide `hidden`.
    pub heads: usize,
    /// Key/value heads (GQA); must divide `heads`.
    pub kv_heads: usize,
    /// Vocabulary size.
    pub vocab: usize,
}

impl TinyModel {
    /// The preset sizes with a given family.
    pub const fn preset(family: TinyFamily) -> Self {
        TinyModel { family, hidden: 32, layers: 2, heads: 4, kv_heads: 2, vocab: 512 }
    }

    /// A dense Qwen3 ([`TinyFamily::Qwen3`]) of the preset sizes.
    pub const fn qwen3() -> Self {
        Self::preset(TinyFamily::Qwen3)
    }

    /// A Qwen2.5-Omni-style thinker ([`TinyFamily::Qwen2Omni`]) of the preset sizes.
    pub const fn qwen2_omni() -> Self {
        Self::preset(TinyFamily::Qwen2Omni)
    }

    /// A Qwen3-Omni-style MoE thinker ([`TinyFamily::Qwen3OmniMoe`]) of the
    /// preset sizes, 4 experts, top-2.
    pub const fn qwen3_omni_moe() -> Self {
        Self::preset(TinyFamily::Qwen3OmniMoe { experts: 4, top_k: 2 })
    }

    /// The full model config.
    pub fn config(&self) -> Config {
        let TinyModel { family, hidden, layers, heads, kv_heads, vocab } = *self;
        let head_dim = hidden / heads.max(1);
        let qwen3 = Config {
            model_type: "qwen3".into(),
            hidden_size: hidden,
            intermediate_size: 2 * hidden,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            vocab_size: vocab,
            tie_word_embeddings: true,
            attention_bias: false,
            qk_norm: true,
            mrope_section: None,
            mrope_interleaved: false,
            moe: None,
            max_position_embeddings: None,
            deepstack_levels: None,
            eos_token_ids: Vec::new(),
        };
        match family {
            TinyFamily::Qwen3 => qwen3,
            TinyFamily::Qwen2Omni => Config {
                model_type: "qwen2_5_omni_text".into(),
                attention_bias: true,
                qk_norm: false,
                tie_word_embeddings: false,
                mrope_section: Some(three_sections(head_dim / 2)),
                ..qwen3
            },
            TinyFamily::Qwen3OmniMoe { experts, top_k } => Config {
                model_type: "qwen3_omni_moe_text".into(),
                tie_word_embeddings: false,
                mrope_section: Some(three_sections(head_dim / 2)),
                mrope_interleaved: true,
                moe: Some(MoeConfig {
                    num_experts: experts,
                    num_experts_per_tok: top_k,
                    moe_intermediate_size: hidden / 2,
                    norm_topk_prob: true,
                    decoder_sparse_step: 1,
                    mlp_only_layers: vec![0],
                }),
                ..qwen3
            },
        }
    }
}

impl From<TinyModel> for Config {
    fn from(model: TinyModel) -> Self {
        model.config()
    }
}

/// Splits `half` frequencies into (t, h, w) sections, temporal taking the remainder.
fn three_sections(half: usize) -> [usize; 3] {
    let hw = half * 5 / 16;
    [half - 2 * hw, hw, hw]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn omni_text(extra: &str) -> String {
        format!(
            r#"{{"architectures": ["Qwen3OmniMoeForConditionalGeneration"], "thinker_config": {{"text_config": {{
              "model_type": "qwen3_omni_moe_text", "hidden_size": 2048, "intermediate_size": 768,
              "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
              "rms_norm_eps": 1e-6, "vocab_size": 152064, "hidden_act": "silu",
              "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
              "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "rope_scaling": {{"mrope_section": [24, 20, 20], "interleaved": true, "mrope_interleaved": true, "rope_type": "default"}},
              "rope_theta": 1000000.0 {extra} }}}}}}"#
        )
    }

    #[test]
    fn deepstack_levels_come_from_the_vision_config() {
        let with_vision = |indexes: &str| {
            let text = omni_text("");
            let vision = format!(r#""vision_config": {{"deepstack_visual_indexes": {indexes}}}, "text_config""#);
            Config::from_json_str(&text.replacen(r#""text_config""#, &vision, 1))
        };
        assert_eq!(Config::from_json_str(&omni_text("")).unwrap().deepstack_levels, None);
        assert_eq!(with_vision("[8, 16, 24]").unwrap().deepstack_levels, Some(3));
        assert!(matches!(
            with_vision("7"),
            Err(Error::Checkpoint(CheckpointError::UnsupportedConfig { field: "deepstack_visual_indexes", .. }))
        ));
        let too_many = format!("[{}]", (0..49).map(|i| i.to_string()).collect::<Vec<_>>().join(", "));
        assert!(matches!(
            with_vision(&too_many),
            Err(Error::Checkpoint(CheckpointError::UnsupportedConfig { field: "deepstack_visual_indexes", .. }))
        ));
    }

    #[test]
    fn reads_the_nested_qwen3_omni_thinker_text_config() {
        let cfg = Config::from_json_str(&omni_text("")).unwrap();
        assert!(cfg.qk_norm && !cfg.attention_bias && !cfg.tie_word_embeddings);
        assert_eq!(cfg.rope_spec().kind, RopeKind::Interleaved([24, 20, 20]));
        assert_eq!(cfg.rope_theta, 1e6);
        let moe = cfg.moe.as_ref().unwrap();
        assert_eq!((moe.num_experts, moe.num_experts_per_tok), (128, 8));
        assert!(cfg.is_sparse_layer(0) && cfg.is_sparse_layer(47));
    }

    #[test]
    fn reads_qwen2_5_omni_style_text_config_with_rope_parameters() {
        let json = r#"{"text_config": {"model_type": "qwen2_5_omni_text", "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 300,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "mrope_section": [2, 3, 3]}}}"#;
        let cfg = Config::from_json_str(json).unwrap();
        assert!(cfg.attention_bias && !cfg.qk_norm);
        assert_eq!((cfg.head_dim, cfg.num_key_value_heads, cfg.rope_theta), (16, 4, 500.0));
        assert_eq!(cfg.rope_spec().kind, RopeKind::Sectioned([2, 3, 3]));
        assert!(cfg.moe.is_none() && !cfg.is_sparse_layer(1));
    }

    #[test]
    fn sparse_layers_follow_step_and_mlp_only_layers() {
        let json = omni_text("").replace(r#""decoder_sparse_step": 1, "mlp_only_layers": []"#, r#""decoder_sparse_step": 2, "mlp_only_layers": [3]"#);
        let cfg = Config::from_json_str(&json).unwrap();
        let sparse: Vec<usize> = (0..6).filter(|&l| cfg.is_sparse_layer(l)).collect();
        assert_eq!(sparse, vec![1, 5]);
    }

    #[test]
    fn unsupported_values_name_their_field() {
        let cases = [
            (r#", "hidden_act": "gelu""#, "hidden_act"),
            (r#", "use_sliding_window": true"#, "use_sliding_window"),
        ];
        for (extra, field) in cases {
            // Later duplicate keys win in serde_json objects.
            let err = Config::from_json_str(&omni_text(extra)).unwrap_err();
            assert!(matches!(err, Error::Checkpoint(CheckpointError::UnsupportedConfig { field: f, .. }) if f == field), "{err}");
        }
        let yarn = omni_text("").replace(r#""rope_type": "default""#, r#""rope_type": "yarn""#);
        assert!(matches!(Config::from_json_str(&yarn), Err(Error::Checkpoint(CheckpointError::UnsupportedConfig { field: "rope_type", .. }))));
        let bad_sections = omni_text("").replace("[24, 20, 20]", "[24, 20, 21]");
        assert!(matches!(Config::from_json_str(&bad_sections), Err(Error::Checkpoint(CheckpointError::UnsupportedConfig { field: "mrope_section", .. }))));
        let llama = r#"{"model_type": "llama", "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 4}"#;
        assert!(matches!(Config::from_json_str(llama), Err(Error::Checkpoint(CheckpointError::UnsupportedConfig { field: "model_type", .. }))));
        assert!(matches!(Config::from_json_str("{}"), Err(Error::Checkpoint(CheckpointError::ConfigParse(_)))));
        let mut gqa = TinyModel { layers: 1, kv_heads: 3, vocab: 10, ..TinyModel::qwen3() }.config();
        gqa.head_dim = 8;
        assert!(matches!(gqa.validate(), Err(Error::Checkpoint(CheckpointError::UnsupportedConfig { field: "num_key_value_heads", .. }))));
    }

    #[test]
    fn tiny_models_derive_their_sizes_by_family() {
        let dense = TinyModel::qwen3().config();
        assert_eq!(dense.model_type, "qwen3");
        assert_eq!((dense.hidden_size, dense.intermediate_size, dense.num_hidden_layers), (32, 64, 2));
        assert_eq!((dense.num_attention_heads, dense.num_key_value_heads, dense.head_dim), (4, 2, 8));
        assert_eq!(dense.vocab_size, 512);
        assert!(dense.qk_norm && !dense.attention_bias && dense.tie_word_embeddings);
        assert_eq!(dense.rope_spec().kind, RopeKind::Plain);
        assert!(dense.moe.is_none() && dense.validate().is_ok());

        let qwen2 = TinyModel { hidden: 64, ..TinyModel::qwen2_omni() }.config();
        assert_eq!(qwen2.model_type, "qwen2_5_omni_text");
        assert!(qwen2.attention_bias && !qwen2.qk_norm && !qwen2.tie_word_embeddings);
        assert_eq!(qwen2.rope_spec().kind, RopeKind::Sectioned([4, 2, 2]));
        assert!(qwen2.validate().is_ok());

        let family = TinyFamily::Qwen3OmniMoe { experts: 8, top_k: 2 };
        let moe = Config::from(TinyModel { family, hidden: 256, layers: 4, ..TinyModel::qwen3_omni_moe() });
        assert_eq!(moe.model_type, "qwen3_omni_moe_text");
        assert_eq!(moe.rope_spec().kind, RopeKind::Interleaved([12, 10, 10]));
        let experts = moe.moe.as_ref().unwrap();
        assert_eq!((experts.num_experts, experts.num_experts_per_tok, experts.moe_intermediate_size), (8, 2, 128));
        assert!(!moe.is_sparse_layer(0) && moe.is_sparse_layer(1) && moe.is_sparse_layer(3));
        assert!(moe.validate().is_ok());
    }

    /// A fresh directory holding `config.json` and, when given, `generation_config.json`.
    fn checkpoint_dir(name: &str, config: &str, generation: Option<&str>) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("omniprefix-eos-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), config).unwrap();
        if let Some(generation) = generation {
            std::fs::write(dir.join("generation_config.json"), generation).unwrap();
        }
        dir
    }

    /// A dense Qwen3 `config.json` with `extra` fields at its root.
    fn dense(extra: &str) -> String {
        format!(
            r#"{{"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100 {extra}}}"#
        )
    }

    fn eos_of(name: &str, config: &str, generation: Option<&str>) -> Result<Vec<u32>> {
        let dir = checkpoint_dir(name, config, generation);
        let cfg = Config::from_dir(&dir);
        std::fs::remove_dir_all(&dir).ok();
        cfg.map(|c| c.eos_token_ids)
    }

    #[test]
    fn eos_ids_come_from_generation_config_then_config() {
        assert_eq!(eos_of("none", &dense(""), None).unwrap(), Vec::<u32>::new());
        assert_eq!(eos_of("null", &dense(r#", "eos_token_id": null"#), None).unwrap(), Vec::<u32>::new());
        assert_eq!(eos_of("int", &dense(r#", "eos_token_id": 7"#), None).unwrap(), vec![7]);
        assert_eq!(eos_of("list", &dense(r#", "eos_token_id": [9, 7]"#), None).unwrap(), vec![9, 7]);
        assert_eq!(eos_of("empty-list", &dense(r#", "eos_token_id": []"#), None).unwrap(), Vec::<u32>::new());
        // generation_config.json wins over config.json...
        let gen_list = r#"{"bos_token_id": 1, "eos_token_id": [3, 4], "do_sample": true}"#;
        assert_eq!(eos_of("gen", &dense(r#", "eos_token_id": 7"#), Some(gen_list)).unwrap(), vec![3, 4]);
        assert_eq!(eos_of("gen-int", &dense(""), Some(r#"{"eos_token_id": 5}"#)).unwrap(), vec![5]);
        // ...unless it does not set one.
        let gen_null = r#"{"eos_token_id": null, "temperature": 0.7}"#;
        assert_eq!(eos_of("gen-null", &dense(r#", "eos_token_id": 7"#), Some(gen_null)).unwrap(), vec![7]);
        assert_eq!(eos_of("gen-none", &dense(r#", "eos_token_id": 7"#), Some("{}")).unwrap(), vec![7]);
        // Config::from_file and from_json_str read config.json's alone.
        assert_eq!(Config::from_json_str(&dense(r#", "eos_token_id": [2]"#)).unwrap().eos_token_ids, vec![2]);
        assert!(TinyModel::qwen3().config().eos_token_ids.is_empty());
    }

    #[test]
    fn eos_ids_are_found_in_the_omni_nesting() {
        let text = omni_text(r#", "vocab_size": 152064, "eos_token_id": 151645"#);
        assert_eq!(eos_of("text-config", &text, None).unwrap(), vec![151645]);
        let thinker = omni_text("").replacen(r#""thinker_config": {"#, r#""thinker_config": {"eos_token_id": [151643, 151645], "#, 1);
        assert_eq!(eos_of("thinker", &thinker, None).unwrap(), vec![151643, 151645]);
        // The root before thinker_config before its text_config.
        let all = omni_text(r#", "eos_token_id": 3"#)
            .replacen(r#""thinker_config": {"#, r#""eos_token_id": 1, "thinker_config": {"eos_token_id": 2, "#, 1);
        assert_eq!(eos_of("root", &all, None).unwrap(), vec![1]);
        let nested = omni_text(r#", "eos_token_id": 3"#)
            .replacen(r#""thinker_config": {"#, r#""eos_token_id": null, "thinker_config": {"eos_token_id": 2, "#, 1);
        assert_eq!(eos_of("nested", &nested, None).unwrap(), vec![2]);
    }

    #[test]
    fn malformed_eos_ids_are_checkpoint_errors() {
        let is_eos_error = |r: Result<Vec<u32>>| {
            matches!(r, Err(Error::Checkpoint(CheckpointError::UnsupportedConfig { field: "eos_token_id", .. })))
        };
        for bad in [r#""2""#, "-1", "1.5", "4294967296", r#"[1, "x"]"#, r#"{"id": 1}"#, "true"] {
            let cfg = dense(&format!(r#", "eos_token_id": {bad}"#));
            assert!(is_eos_error(eos_of("bad", &cfg, None)), "config.json eos {bad}");
            let generation = format!(r#"{{"eos_token_id": {bad}}}"#);
            let err = eos_of("bad-gen", &dense(""), Some(&generation));
            assert!(is_eos_error(err), "generation_config.json eos {bad}");
        }
        let err = eos_of("gen-reason", &dense(""), Some(r#"{"eos_token_id": "x"}"#)).unwrap_err();
        assert!(err.to_string().contains("generation_config.json"), "{err}");
        // Ids the model cannot produce.
        assert!(is_eos_error(eos_of("vocab", &dense(r#", "eos_token_id": [5, 100]"#), None)));
        assert!(is_eos_error(eos_of("vocab-gen", &dense(""), Some(r#"{"eos_token_id": 100}"#))));
        assert!(matches!(
            eos_of("gen-json", &dense(""), Some("{not json")),
            Err(Error::Checkpoint(CheckpointError::ConfigParse(m))) if m.starts_with("generation_config.json")
        ));
    }

    #[test]
    fn tiny_fixtures_carry_no_eos_ids() {
        // fixtures/make_tiny_models.py drops generation_config.json and the configs say `null`.
        for model in ["qwen3_dense", "qwen2_dense", "omni_thinker"] {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny").join(model);
            assert_eq!(Config::from_dir(&dir).unwrap().eos_token_ids, Vec::<u32>::new(), "{model}");
        }
    }

    #[test]
    fn positional_constructors_are_the_named_presets() {
        assert_eq!(Config::tiny_qwen3(32, 2, 4, 2, 512), TinyModel::qwen3().config());
        assert_eq!(Config::tiny_qwen2_omni(32, 2, 4, 2, 512), TinyModel::qwen2_omni().config());
        assert_eq!(Config::tiny_qwen3_omni_moe(32, 2, 4, 2, 512, 4, 2), TinyModel::qwen3_omni_moe().config());
        let moe = Config::tiny_qwen3_omni_moe(16, 1, 2, 1, 40, 3, 1);
        let named = TinyModel {
            family: TinyFamily::Qwen3OmniMoe { experts: 3, top_k: 1 },
            hidden: 16,
            layers: 1,
            heads: 2,
            kv_heads: 1,
            vocab: 40,
        };
        assert_eq!(moe, named.config());
    }
}
