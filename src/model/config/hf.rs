//! Reads a Hugging Face checkpoint's `config.json` (and `generation_config.json`) into a
//! [`Config`](crate::model::Config), and its special token ids into [`OmniTokens`](crate::prompt::OmniTokens): the one reader of those files.

use std::path::Path;

use serde::Deserialize;

use super::{Config, MoeConfig, parse_json, read_text, unsupported};
use crate::Result;
use crate::error::{CheckpointError, IoError};
use crate::prompt::OmniTokens;

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
    /// What transformers writes for `num_experts` when it saves some configs (an attribute alias).
    num_local_experts: Option<usize>,
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
    for pointer in [
        "/eos_token_id",
        "/thinker_config/eos_token_id",
        "/thinker_config/text_config/eos_token_id",
        "/text_config/eos_token_id",
    ] {
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
        Self::from_json_str(&read_text(path)?)
    }

    /// Parses a HF config; for Omni checkpoints the text config is found under
    /// `thinker_config.text_config` or `text_config`.
    pub fn from_json_str(json: &str) -> Result<Self> {
        let root = parse_json(json)?;
        let text =
            root.pointer("/thinker_config/text_config").or_else(|| root.get("text_config")).unwrap_or(&root);
        let raw = RawConfig::deserialize(text).map_err(|e| CheckpointError::ConfigParse(e.to_string()))?;
        let deepstack = root
            .pointer("/thinker_config/vision_config/deepstack_visual_indexes")
            .or_else(|| root.pointer("/vision_config/deepstack_visual_indexes"));
        let deepstack_levels = match deepstack {
            None => None,
            Some(serde_json::Value::Array(indexes)) => Some(indexes.len()),
            Some(other) => {
                return Err(unsupported(
                    "deepstack_visual_indexes",
                    other,
                    "expected a list of layer indexes",
                ));
            }
        };
        let eos_token_ids = eos_from_config(&root)?;
        let cfg = Config { deepstack_levels, eos_token_ids, ..Self::from_raw(raw)? };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses one decoder's text-config object as it stands (no search for
    /// `thinker_config`, no eos ids): the talker's `text_config` and
    /// `code_predictor_config` are decoders of their own inside an Omni `config.json`.
    pub fn from_text_value(text: &serde_json::Value) -> Result<Self> {
        let raw = RawConfig::deserialize(text).map_err(|e| CheckpointError::ConfigParse(e.to_string()))?;
        let cfg = Self::from_raw(raw)?;
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
            return Err(unsupported(
                "use_sliding_window",
                true,
                "sliding-window attention is not implemented",
            ));
        }
        let rope = raw.rope_parameters.as_ref().or(raw.rope_scaling.as_ref());
        if let Some(kind) = rope.and_then(|r| r.rope_type.as_deref().or(r.type_.as_deref()))
            && !matches!(kind, "default" | "mrope")
        {
            return Err(unsupported("rope_type", kind, "only default RoPE / M-RoPE is implemented"));
        }
        let mrope_section = match rope.and_then(|r| r.mrope_section.as_deref()) {
            None => None,
            Some(&[t, h, w]) => Some([t, h, w]),
            Some(other) => return Err(unsupported("mrope_section", other, "expected three sections")),
        };
        let mrope_interleaved = rope.is_some_and(|r| r.mrope_interleaved.or(r.interleaved).unwrap_or(false));
        let rope_theta = rope.and_then(|r| r.rope_theta).or(raw.rope_theta).unwrap_or(10_000.0);
        let moe = match raw.num_experts.or(raw.num_local_experts).filter(|&n| n > 0) {
            None => None,
            Some(num_experts) => Some(MoeConfig {
                num_experts,
                num_experts_per_tok: raw.num_experts_per_tok.ok_or_else(|| {
                    CheckpointError::ConfigParse("missing field `num_experts_per_tok`".into())
                })?,
                moe_intermediate_size: raw.moe_intermediate_size.ok_or_else(|| {
                    CheckpointError::ConfigParse("missing field `moe_intermediate_size`".into())
                })?,
                norm_topk_prob: raw.norm_topk_prob.unwrap_or(true),
                decoder_sparse_step: raw.decoder_sparse_step.unwrap_or(1),
                mlp_only_layers: raw.mlp_only_layers.unwrap_or_default(),
                shared_expert_intermediate_size: raw.shared_expert_intermediate_size.unwrap_or(0),
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
}

/// Special ids from a checkpoint's `config.json` (`thinker_config` of Omni
/// checkpoints, or the root); `None` when it names none (a text-only model).
pub fn tokens_from_config_file(path: &Path) -> Result<Option<OmniTokens>> {
    tokens_from_config_json(&read_text(path)?)
}

/// [`tokens_from_config_file`] over the text of a `config.json`.
pub fn tokens_from_config_json(text: &str) -> Result<Option<OmniTokens>> {
    let root = parse_json(text)?;
    let node = root.get("thinker_config").unwrap_or(&root);
    if node.get("image_token_id").is_none() {
        return Ok(None);
    }
    serde_json::from_value(node.clone())
        .map(Some)
        .map_err(|e| CheckpointError::ConfigParse(format!("special token ids: {e}")).into())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::Error;
    use crate::backend::RopeKind;
    use crate::model::TinyModel;

    pub(in crate::model::config) fn omni_text(extra: &str) -> String {
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
            let vision =
                format!(r#""vision_config": {{"deepstack_visual_indexes": {indexes}}}, "text_config""#);
            Config::from_json_str(&text.replacen(r#""text_config""#, &vision, 1))
        };
        assert_eq!(Config::from_json_str(&omni_text("")).unwrap().deepstack_levels, None);
        assert_eq!(with_vision("[8, 16, 24]").unwrap().deepstack_levels, Some(3));
        assert!(matches!(
            with_vision("7"),
            Err(Error::Checkpoint(CheckpointError::UnsupportedConfig {
                field: "deepstack_visual_indexes",
                ..
            }))
        ));
        let too_many = format!("[{}]", (0..49).map(|i| i.to_string()).collect::<Vec<_>>().join(", "));
        assert!(matches!(
            with_vision(&too_many),
            Err(Error::Checkpoint(CheckpointError::UnsupportedConfig {
                field: "deepstack_visual_indexes",
                ..
            }))
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
        let json = omni_text("").replace(
            r#""decoder_sparse_step": 1, "mlp_only_layers": []"#,
            r#""decoder_sparse_step": 2, "mlp_only_layers": [3]"#,
        );
        let cfg = Config::from_json_str(&json).unwrap();
        let sparse: Vec<usize> = (0..6).filter(|&l| cfg.is_sparse_layer(l)).collect();
        assert_eq!(sparse, vec![1, 5]);
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
        let thinker = omni_text("").replacen(
            r#""thinker_config": {"#,
            r#""thinker_config": {"eos_token_id": [151643, 151645], "#,
            1,
        );
        assert_eq!(eos_of("thinker", &thinker, None).unwrap(), vec![151643, 151645]);
        // The root before thinker_config before its text_config.
        let all = omni_text(r#", "eos_token_id": 3"#).replacen(
            r#""thinker_config": {"#,
            r#""eos_token_id": 1, "thinker_config": {"eos_token_id": 2, "#,
            1,
        );
        assert_eq!(eos_of("root", &all, None).unwrap(), vec![1]);
        let nested = omni_text(r#", "eos_token_id": 3"#).replacen(
            r#""thinker_config": {"#,
            r#""eos_token_id": null, "thinker_config": {"eos_token_id": 2, "#,
            1,
        );
        assert_eq!(eos_of("nested", &nested, None).unwrap(), vec![2]);
    }

    #[test]
    fn malformed_eos_ids_are_checkpoint_errors() {
        let is_eos_error = |r: Result<Vec<u32>>| {
            matches!(
                r,
                Err(Error::Checkpoint(CheckpointError::UnsupportedConfig { field: "eos_token_id", .. }))
            )
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
}
