//! Small random-weight models sized by name ([`TinyModel`]), for tests, examples and the demo.

use super::{Config, MoeConfig};

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
                    shared_expert_intermediate_size: 0,
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

impl Config {
    /// Positional shorthand for [`TinyModel`] with [`TinyFamily::Qwen3`].
    pub fn tiny_qwen3(hidden: usize, layers: usize, heads: usize, kv_heads: usize, vocab: usize) -> Self {
        TinyModel { family: TinyFamily::Qwen3, hidden, layers, heads, kv_heads, vocab }.config()
    }

    /// Positional shorthand for [`TinyModel`] with [`TinyFamily::Qwen2Omni`].
    pub fn tiny_qwen2_omni(
        hidden: usize, layers: usize, heads: usize, kv_heads: usize, vocab: usize,
    ) -> Self {
        TinyModel { family: TinyFamily::Qwen2Omni, hidden, layers, heads, kv_heads, vocab }.config()
    }

    /// Positional shorthand for [`TinyModel`] with [`TinyFamily::Qwen3OmniMoe`].
    pub fn tiny_qwen3_omni_moe(
        hidden: usize, layers: usize, heads: usize, kv_heads: usize, vocab: usize, num_experts: usize,
        top_k: usize,
    ) -> Self {
        let family = TinyFamily::Qwen3OmniMoe { experts: num_experts, top_k };
        TinyModel { family, hidden, layers, heads, kv_heads, vocab }.config()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::RopeKind;

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
        assert_eq!(
            (experts.num_experts, experts.num_experts_per_tok, experts.moe_intermediate_size),
            (8, 2, 128)
        );
        assert!(!moe.is_sparse_layer(0) && moe.is_sparse_layer(1) && moe.is_sparse_layer(3));
        assert!(moe.validate().is_ok());
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
