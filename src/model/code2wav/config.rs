//! The `code2wav_config` object of a Qwen3-Omni `config.json`
//! (HF `Qwen3OmniMoeCode2WavConfig`), and the receptive-field arithmetic of the
//! convolutions it implies, which streaming needs.

use std::path::Path;

use serde::Deserialize;

use crate::Result;
use crate::backend::{Conv1dSpec, ConvTranspose1dSpec};
use crate::error::CheckpointError;
use crate::model::config::{parse_json, read_text};

/// Qwen3-Omni's code2wav output rate: HF writes its waveform at 24 kHz (the
/// config does not say it).
pub const SAMPLE_RATE: u32 = 24_000;

/// The code2wav sizes, named as HF names them.
#[derive(Debug, Clone, PartialEq)]
pub struct Code2WavConfig {
    /// Codes per quantizer (the embedding holds `codebook_size * num_quantizers` rows).
    pub codebook_size: usize,
    /// Residual quantizers per frame (rows of a codes matrix).
    pub num_quantizers: usize,
    /// Width of the transformer and the upsampling ConvNeXt blocks.
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// `head_dim`, else `hidden_size / num_attention_heads`.
    pub head_dim: usize,
    pub intermediate_size: usize,
    /// Keys a query sees, itself included (every layer is sliding-window).
    pub sliding_window: usize,
    pub attention_bias: bool,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// Transposed-conv factors of the ConvNeXt upsampling stage (`kernel == stride`).
    pub upsampling_ratios: Vec<usize>,
    /// Strides of the decoder blocks (`kernel == 2 * stride`).
    pub upsample_rates: Vec<usize>,
    /// Channels after the decoder's first conv; halved by each decoder block.
    pub decoder_dim: usize,
    /// Output samples per second ([`SAMPLE_RATE`]).
    pub sample_rate: u32,
}

/// The fields read from `code2wav_config`; unknown ones are ignored.
#[derive(Debug, Deserialize)]
struct Raw {
    codebook_size: usize,
    num_quantizers: usize,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: Option<usize>,
    intermediate_size: usize,
    sliding_window: usize,
    attention_bias: Option<bool>,
    hidden_act: Option<String>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_parameters: Option<RawRope>,
    upsampling_ratios: Vec<usize>,
    upsample_rates: Vec<usize>,
    decoder_dim: usize,
}

#[derive(Debug, Deserialize)]
struct RawRope {
    rope_type: Option<String>,
    rope_theta: Option<f64>,
}

fn unsupported(field: &'static str, value: impl std::fmt::Debug, reason: &'static str) -> crate::Error {
    CheckpointError::UnsupportedConfig { field, value: format!("{value:?}"), reason }.into()
}

/// One convolution of the conv stack (upsampling + decoder), in order: what the
/// receptive-field arithmetic needs of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConvStage {
    Causal(Conv1dSpec),
    Transposed(ConvTranspose1dSpec),
}

impl Code2WavConfig {
    /// Reads `code2wav_config` of a full Qwen3-Omni `config.json` file.
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_json_str(&read_text(path)?)
    }

    /// Reads `code2wav_config` of a full Qwen3-Omni `config.json` (or the object
    /// itself, when the root has `codebook_size`). A missing object or field, or a
    /// field of the wrong type, is [`CheckpointError::ConfigParse`]; a value this
    /// crate does not implement (an activation other than silu, a RoPE other than
    /// the default, sizes that do not fit together) is
    /// [`CheckpointError::UnsupportedConfig`].
    pub fn from_json_str(json: &str) -> Result<Self> {
        let root = parse_json(json)?;
        let node = match root.get("code2wav_config") {
            Some(node) => node,
            None if root.get("codebook_size").is_some() => &root,
            None => return Err(CheckpointError::ConfigParse("no `code2wav_config` object".into()).into()),
        };
        let raw = Raw::deserialize(node)
            .map_err(|e| CheckpointError::ConfigParse(format!("code2wav_config: {e}")))?;
        if let Some(act) = raw.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(unsupported("code2wav_config.hidden_act", act, "only silu (SwiGLU) is implemented"));
        }
        if let Some(kind) = raw.rope_parameters.as_ref().and_then(|r| r.rope_type.as_deref())
            && kind != "default"
        {
            return Err(unsupported("code2wav_config.rope_type", kind, "only default RoPE is implemented"));
        }
        let heads = raw.num_attention_heads.max(1);
        let cfg = Code2WavConfig {
            codebook_size: raw.codebook_size,
            num_quantizers: raw.num_quantizers,
            hidden_size: raw.hidden_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads: raw.num_key_value_heads,
            head_dim: raw.head_dim.unwrap_or(raw.hidden_size / heads),
            intermediate_size: raw.intermediate_size,
            sliding_window: raw.sliding_window,
            attention_bias: raw.attention_bias.unwrap_or(false),
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-5),
            rope_theta: raw.rope_parameters.and_then(|r| r.rope_theta).or(raw.rope_theta).unwrap_or(10_000.0),
            upsampling_ratios: raw.upsampling_ratios,
            upsample_rates: raw.upsample_rates,
            decoder_dim: raw.decoder_dim,
            sample_rate: SAMPLE_RATE,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Qwen3-Omni-30B-A3B's code2wav (HF's defaults): 16 quantizers of 2048 codes,
    /// an 8-layer transformer of width 1024, 1920 samples a frame at 24 kHz.
    pub fn qwen3_omni() -> Self {
        Code2WavConfig {
            codebook_size: 2048,
            num_quantizers: 16,
            hidden_size: 1024,
            num_hidden_layers: 8,
            num_attention_heads: 16,
            num_key_value_heads: 16,
            head_dim: 64,
            intermediate_size: 3072,
            sliding_window: 72,
            attention_bias: false,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            upsampling_ratios: vec![2, 2],
            upsample_rates: vec![8, 5, 4, 3],
            decoder_dim: 1536,
            sample_rate: SAMPLE_RATE,
        }
    }

    /// A small config for tests: 4 quantizers of 64 codes, 2 layers of width 32
    /// with a 6-key window, 48 samples a frame.
    pub fn tiny() -> Self {
        Code2WavConfig {
            codebook_size: 64,
            num_quantizers: 4,
            hidden_size: 32,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 8,
            intermediate_size: 48,
            sliding_window: 6,
            attention_bias: false,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            upsampling_ratios: vec![2, 2],
            upsample_rates: vec![4, 3],
            decoder_dim: 24,
            sample_rate: SAMPLE_RATE,
        }
    }

    /// Checks the sizes fit together; [`CheckpointError::UnsupportedConfig`] names the first that does not.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("codebook_size", self.codebook_size),
            ("num_quantizers", self.num_quantizers),
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("intermediate_size", self.intermediate_size),
            ("sliding_window", self.sliding_window),
            ("decoder_dim", self.decoder_dim),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(unsupported(field, value, "must be positive"));
            }
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(unsupported("head_dim", self.head_dim, "must be positive and even (RoPE halves)"));
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(unsupported(
                "num_key_value_heads",
                self.num_key_value_heads,
                "must divide num_attention_heads",
            ));
        }
        if self.codebook_size.checked_mul(self.num_quantizers).is_none_or(|n| n > u32::MAX as usize) {
            return Err(unsupported(
                "codebook_size",
                self.codebook_size,
                "codebook_size * num_quantizers > u32",
            ));
        }
        if self.upsampling_ratios.iter().chain(&self.upsample_rates).any(|&r| r == 0) {
            return Err(unsupported("upsample_rates", &self.upsample_rates, "every factor must be positive"));
        }
        let halvings = u32::try_from(self.upsample_rates.len()).unwrap_or(u32::MAX);
        if 2usize
            .checked_pow(halvings)
            .is_none_or(|d| !self.decoder_dim.is_multiple_of(d) || self.decoder_dim < d)
        {
            return Err(unsupported(
                "decoder_dim",
                self.decoder_dim,
                "must be a positive multiple of 2^len(upsample_rates) (each decoder block halves it)",
            ));
        }
        Ok(())
    }

    /// Output samples per frame: the product of every upsampling factor (1920 for Qwen3-Omni).
    pub fn total_upsample(&self) -> usize {
        self.upsampling_ratios.iter().chain(&self.upsample_rates).product()
    }

    /// Channels of decoder block `i`'s input (`decoder_dim / 2^i`).
    pub(crate) fn decoder_channels(&self, i: usize) -> usize {
        self.decoder_dim >> i
    }

    /// The convolutions from the transformer's output to the waveform, in order.
    pub(crate) fn conv_stages(&self) -> Vec<ConvStage> {
        let causal = |kernel, dilation| ConvStage::Causal(Conv1dSpec { kernel, dilation, groups: 1 });
        let mut stages = Vec::new();
        for &f in &self.upsampling_ratios {
            stages.push(ConvStage::Transposed(ConvTranspose1dSpec { kernel: f, stride: f }));
            stages.push(ConvStage::Causal(Conv1dSpec { kernel: 7, dilation: 1, groups: self.hidden_size }));
        }
        stages.push(causal(7, 1));
        for &r in &self.upsample_rates {
            stages.push(ConvStage::Transposed(ConvTranspose1dSpec { kernel: 2 * r, stride: r }));
            for d in RESIDUAL_DILATIONS {
                stages.push(causal(7, d));
                stages.push(causal(1, 1));
            }
        }
        stages.push(causal(7, 1));
        stages
    }

    /// Samples one pass over `frames` frames gives: each decoder block's transposed
    /// conv (`kernel = 2 * stride`) gives `(n - 1) * stride` rows for `n`, so the
    /// waveform is `frames * total_upsample()` less a constant (555 samples for
    /// Qwen3-Omni), the samples that would need the frame after the last.
    pub fn output_len(&self, frames: usize) -> usize {
        self.conv_stages().iter().fold(frames, |n, s| match s {
            ConvStage::Causal(_) => n,
            ConvStage::Transposed(t) => crate::backend::cpu::conv::conv_transpose1d_len(n, *t),
        })
    }

    /// The first transformer-output frame waveform sample `n` depends on through the
    /// convolutions (negative: it reaches into the zero padding before frame 0).
    /// Backwards through the stages: a causal conv reads `(kernel-1)·dilation` rows
    /// back, a transposed conv's row `m` reads input rows from `⌊m / stride⌋`.
    pub fn first_frame_of_sample(&self, n: usize) -> i64 {
        self.conv_stages().iter().rev().fold(n as i64, |m, s| match s {
            ConvStage::Causal(c) => m - ((c.kernel - 1) * c.dilation) as i64,
            ConvStage::Transposed(t) => m.div_euclid(t.stride as i64),
        })
    }

    /// Frames of left context the convolutions need before a sample's own frame,
    /// at most (over the sample's offset in its frame): 10 for Qwen3-Omni.
    pub fn conv_left_context(&self) -> usize {
        let u = self.total_upsample();
        // Far from the start, the context depends only on the offset within a frame.
        let base = 64 * u;
        (base..base + u).map(|n| (n / u) as i64 - self.first_frame_of_sample(n)).max().unwrap_or(0).max(0)
            as usize
    }

    /// Frames back the transformer's output at a frame depends on:
    /// `num_hidden_layers * (sliding_window - 1)` (568 for Qwen3-Omni).
    pub fn transformer_left_context(&self) -> usize {
        self.num_hidden_layers * (self.sliding_window - 1)
    }
}

/// Dilations of the three residual units of a decoder block.
pub(crate) const RESIDUAL_DILATIONS: [usize; 3] = [1, 3, 9];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    #[test]
    fn reads_hf_code2wav_config_and_its_receptive_field() {
        let json = r#"{"model_type": "qwen3_omni_moe", "code2wav_config": {"codebook_size": 2048,
            "hidden_size": 1024, "max_position_embeddings": 8000,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "num_attention_heads": 16,
            "num_key_value_heads": 16, "attention_bias": false, "sliding_window": 72, "intermediate_size": 3072,
            "hidden_act": "silu", "layer_scale_initial_scale": 0.01, "rms_norm_eps": 1e-05,
            "num_hidden_layers": 8, "num_quantizers": 16, "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2], "decoder_dim": 1536}}"#;
        let cfg = Code2WavConfig::from_json_str(json).unwrap();
        assert_eq!(cfg, Code2WavConfig::qwen3_omni());
        assert_eq!(cfg.total_upsample(), 1920);
        assert_eq!(cfg.output_len(10), 10 * 1920 - 555);
        assert_eq!(cfg.output_len(1), 1365);
        assert_eq!(cfg.conv_left_context(), 10);
        assert_eq!(cfg.transformer_left_context(), 568);
        assert_eq!(Code2WavConfig::tiny().output_len(7), 321, "what HF gives the tiny config");

        let err =
            Code2WavConfig::from_json_str(&json.replace(r#""decoder_dim": 1536"#, r#""decoder_dim": 20"#));
        assert!(matches!(
            err,
            Err(Error::Checkpoint(CheckpointError::UnsupportedConfig { field: "decoder_dim", .. }))
        ));
        let err = Code2WavConfig::from_json_str(&json.replace(r#""sliding_window": 72, "#, ""));
        assert!(
            matches!(&err, Err(Error::Checkpoint(CheckpointError::ConfigParse(m))) if m.contains("sliding_window"))
        );
        let err = Code2WavConfig::from_json_str(&json.replace(r#""silu""#, r#""gelu""#));
        assert!(matches!(err, Err(Error::Checkpoint(CheckpointError::UnsupportedConfig { .. }))));
        let err = Code2WavConfig::from_json_str(r#"{"thinker_config": {}}"#);
        assert!(matches!(err, Err(Error::Checkpoint(CheckpointError::ConfigParse(_)))));
        let err = Code2WavConfig::from_json_str(
            &json.replace(r#""num_key_value_heads": 16"#, r#""num_key_value_heads": 3"#),
        );
        assert!(matches!(
            err,
            Err(Error::Checkpoint(CheckpointError::UnsupportedConfig { field: "num_key_value_heads", .. }))
        ));
    }
}
