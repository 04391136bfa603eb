//! Qwen3-Omni's code2wav (HF `Qwen3OmniMoeCode2Wav`): codec codes
//! `[num_quantizers, frames]` → a 24 kHz waveform, over any [`Backend`](crate::backend::Backend).
//!
//! The forward, as HF's: the mean over quantizers of the codes' embeddings
//! (quantizer `q`'s codes offset by `q * codebook_size` into one table), a
//! transformer of sliding-window causal layers (RMSNorm, RoPE, no qk-norm,
//! LayerScale on both residual branches, SwiGLU), then convolutions on a `[T, C]`
//! signal (time on rows): ConvNeXt upsampling blocks (transposed conv with
//! `kernel == stride`, depthwise causal conv, LayerNorm, GELU MLP, gamma), a
//! causal conv to `decoder_dim` channels, decoder blocks (SnakeBeta, transposed
//! conv `kernel = 2 * stride`, three dilated residual units), SnakeBeta, a causal
//! conv to one channel, and a clamp to `[-1, 1]`.
//!
//! [`Code2WavStream`] decodes frames as they arrive and emits exactly the samples
//! one pass over all of them gives; its module says how.

pub mod config;
mod stream;

use std::path::Path;

use ndarray::{Array2, ArrayView2};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub use config::{Code2WavConfig, SAMPLE_RATE};
pub use stream::Code2WavStream;

use crate::Result;
use crate::backend::cpu::conv::{
    conv_transpose1d_weight_from_hf, conv1d_weight_from_hf, dense_conv1d_weight_from_hf,
};
use crate::backend::{
    AttnHeads, Backend, Conv1dSpec, ConvTranspose1dSpec, HostWeight, RopeKind, RopePositions, RopeSpec,
};
use crate::error::{CheckpointError, RequestError};
use crate::model::weights::{HostTensor, MemorySource, SafetensorsSource, WeightSource, Weights};
use config::RESIDUAL_DILATIONS;

/// A causal conv's weight, bias `[1, cout]` and shape. A dense conv's weight `W`
/// is a backend weight `[kernel * cout, cin]` (one matrix product gives every
/// tap); a depthwise conv's is a tensor `[kernel, channels]`.
struct Conv<T, W = T> {
    w: W,
    b: T,
    spec: Conv1dSpec,
}

/// A causal transposed conv's weight `[kernel * cout, cin]`, bias and shape.
struct TransConv<T, W> {
    w: W,
    b: T,
    spec: ConvTranspose1dSpec,
}

/// SnakeBeta's log-scale `alpha`, `beta [1, C]`.
struct Snake<T> {
    alpha: T,
    beta: T,
}

struct ResidualUnit<T, W> {
    act1: Snake<T>,
    conv1: Conv<T, W>,
    act2: Snake<T>,
    conv2: Conv<T, W>,
}

struct DecoderBlock<T, W> {
    act: Snake<T>,
    up: TransConv<T, W>,
    units: Vec<ResidualUnit<T, W>>,
}

struct ConvNeXt<T, W> {
    dwconv: Conv<T>,
    norm_w: T,
    norm_b: T,
    pwconv1: W,
    pwconv1_b: T,
    pwconv2: W,
    pwconv2_b: T,
    gamma: T,
}

/// One upsampling stage: a transposed conv (`kernel == stride`), then a ConvNeXt block.
struct Upsample<T, W> {
    up: TransConv<T, W>,
    block: ConvNeXt<T, W>,
}

struct Layer<T, W> {
    input_norm: T,
    q: W,
    k: W,
    v: W,
    o: W,
    /// q, k, v, o biases (`attention_bias`).
    bias: Option<[T; 4]>,
    attn_scale: T,
    post_norm: T,
    /// gate and up stacked row-wise `[2I, H]`.
    gate_up: W,
    down: W,
    mlp_scale: T,
}

/// Per transformer layer, the post-RoPE K and V rows of the last
/// `sliding_window - 1` frames: all a new frame's query can see besides itself.
pub(crate) type KvWindow<T> = Vec<Option<(T, T)>>;

/// A loaded code2wav: config plus device weights (all f32).
///
/// ```
/// use ndarray::Array2;
/// use omniprefix::backend::cpu::CpuBackend;
/// use omniprefix::model::code2wav::{Code2Wav, Code2WavConfig};
/// let cfg = Code2WavConfig::tiny();
/// let model = Code2Wav::random(&CpuBackend, cfg, 7)?;
/// let codes = Array2::from_shape_fn((4, 5), |(q, t)| ((q * 7 + t) % 64) as i64);
/// let wav = model.forward(&CpuBackend, codes.view())?;
/// assert_eq!(wav.len(), model.config().output_len(5));
/// # Ok::<(), omniprefix::Error>(())
/// ```
pub struct Code2Wav<B: Backend> {
    config: Code2WavConfig,
    rope: RopeSpec,
    embed: B::Weight,
    /// `1 / num_quantizers` in every column: the mean over quantizers.
    mean_scale: B::Tensor,
    layers: Vec<Layer<B::Tensor, B::Weight>>,
    norm: B::Tensor,
    upsample: Vec<Upsample<B::Tensor, B::Weight>>,
    pre_conv: Conv<B::Tensor, B::Weight>,
    blocks: Vec<DecoderBlock<B::Tensor, B::Weight>>,
    post_act: Snake<B::Tensor>,
    post_conv: Conv<B::Tensor, B::Weight>,
}

/// Uploads the weights under one prefix, shape-checked against the config.
struct Loader<'a, B: Backend> {
    backend: &'a B,
}

impl<B: Backend> Loader<'_, B> {
    fn vector(&self, at: &Weights<'_>, leaf: &str, n: usize) -> Result<B::Tensor> {
        self.backend.upload(at.vector(leaf, n)?.view())
    }

    fn linear(&self, at: &Weights<'_>, out: usize, inp: usize) -> Result<B::Weight> {
        self.backend.upload_weight(at.weight("weight", out, inp, crate::backend::Dtype::F32)?)
    }

    fn layout_error(at: &Weights<'_>) -> crate::Error {
        CheckpointError::WeightLayout { name: at.name("weight"), problem: "cannot reorder the kernel".into() }
            .into()
    }

    /// The `conv.weight` of shape `hf_shape` and `conv.bias` (`bias` wide) at `at`, the weight
    /// reordered by `reorder` (a dense or transposed conv's layout) and uploaded for matmuls.
    fn conv_weights(
        &self, at: &Weights<'_>, hf_shape: [usize; 3], bias: usize,
        reorder: impl FnOnce(&[f32]) -> Option<ndarray::Array2<f32>>,
    ) -> Result<(B::Weight, B::Tensor)> {
        let at = at.pp("conv");
        let t = at.get("weight", &hf_shape)?;
        let w = reorder(&t.data).ok_or_else(|| Self::layout_error(&at))?;
        Ok((self.backend.upload_weight(HostWeight::from_f32(w))?, self.vector(&at, "bias", bias)?))
    }

    /// A dense `Qwen3OmniMoeCausalConvNet` at `at` (its `conv.weight`, `conv.bias`).
    fn conv(
        &self, at: &Weights<'_>, cin: usize, cout: usize, spec: Conv1dSpec,
    ) -> Result<Conv<B::Tensor, B::Weight>> {
        let (w, b) = self.conv_weights(at, [cout, cin, spec.kernel], cout, |hf| {
            dense_conv1d_weight_from_hf(hf, cout, cin, spec.kernel)
        })?;
        Ok(Conv { w, b, spec })
    }

    /// A depthwise `Qwen3OmniMoeCausalConvNet` (`groups == channels`) at `at`.
    fn depthwise_conv(&self, at: &Weights<'_>, channels: usize, spec: Conv1dSpec) -> Result<Conv<B::Tensor>> {
        let at = at.pp("conv");
        let t = at.get("weight", &[channels, 1, spec.kernel])?;
        let w = conv1d_weight_from_hf(&t.data, channels, 1, spec.kernel)
            .ok_or_else(|| Self::layout_error(&at))?;
        Ok(Conv { w: self.backend.upload(w.view())?, b: self.vector(&at, "bias", channels)?, spec })
    }

    /// A `Qwen3OmniMoeCausalTransConvNet` at `at`.
    fn trans_conv(
        &self, at: &Weights<'_>, cin: usize, cout: usize, spec: ConvTranspose1dSpec,
    ) -> Result<TransConv<B::Tensor, B::Weight>> {
        let (w, b) = self.conv_weights(at, [cin, cout, spec.kernel], cout, |hf| {
            conv_transpose1d_weight_from_hf(hf, cin, cout, spec.kernel)
        })?;
        Ok(TransConv { w, b, spec })
    }

    fn snake(&self, at: &Weights<'_>, c: usize) -> Result<Snake<B::Tensor>> {
        Ok(Snake { alpha: self.vector(at, "alpha", c)?, beta: self.vector(at, "beta", c)? })
    }
}

const fn causal(kernel: usize, dilation: usize) -> Conv1dSpec {
    Conv1dSpec { kernel, dilation, groups: 1 }
}

impl<B: Backend> Code2Wav<B> {
    /// Loads `code2wav_config` of `dir/config.json` and the `code2wav.*` weights of
    /// the safetensors checkpoint in `dir`.
    pub fn from_dir(backend: &B, dir: &Path) -> Result<Self> {
        let config = Code2WavConfig::from_file(&dir.join("config.json"))?;
        Self::load(backend, config, &SafetensorsSource::open_dir(dir)?)
    }

    /// Loads every weight `config` implies from `source` under HF's names
    /// (`code2wav.pre_transformer.layers.3.self_attn.q_proj.weight`,
    /// `code2wav.upsample.0.0.conv.weight`, `code2wav.decoder.1.block.2.conv1.conv.weight`, …),
    /// shape-checked, as f32; conv kernels are reordered into the backend's layout.
    pub fn load(backend: &B, config: Code2WavConfig, source: &dyn WeightSource) -> Result<Self> {
        config.validate()?;
        let c = &config;
        let ld = Loader { backend };
        let root = Weights::root(source, "code2wav");
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (q_out, kv_out) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let embed = backend.upload_weight(HostWeight::from_f32(root.pp("code_embedding").matrix(
            "weight",
            c.codebook_size * c.num_quantizers,
            h,
        )?))?;
        let mean_scale = backend.upload(Array2::from_elem((1, h), 1.0 / c.num_quantizers as f32).view())?;

        let tr = root.pp("pre_transformer");
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let lw = tr.pp("layers").pp(i);
            let at = lw.pp("self_attn");
            let bias = if c.attention_bias {
                Some([
                    ld.vector(&at.pp("q_proj"), "bias", q_out)?,
                    ld.vector(&at.pp("k_proj"), "bias", kv_out)?,
                    ld.vector(&at.pp("v_proj"), "bias", kv_out)?,
                    ld.vector(&at.pp("o_proj"), "bias", h)?,
                ])
            } else {
                None
            };
            let mlp = lw.pp("mlp");
            let gate =
                mlp.pp("gate_proj").weight("weight", c.intermediate_size, h, crate::backend::Dtype::F32)?;
            let up =
                mlp.pp("up_proj").weight("weight", c.intermediate_size, h, crate::backend::Dtype::F32)?;
            let gate_up = HostWeight::stack(vec![gate, up]).ok_or_else(|| CheckpointError::WeightLayout {
                name: mlp.name("gate_proj+up_proj"),
                problem: "parts do not stack".into(),
            })?;
            layers.push(Layer {
                input_norm: ld.vector(&lw.pp("input_layernorm"), "weight", h)?,
                q: ld.linear(&at.pp("q_proj"), q_out, h)?,
                k: ld.linear(&at.pp("k_proj"), kv_out, h)?,
                v: ld.linear(&at.pp("v_proj"), kv_out, h)?,
                o: ld.linear(&at.pp("o_proj"), h, q_out)?,
                bias,
                attn_scale: ld.vector(&lw.pp("self_attn_layer_scale"), "scale", h)?,
                post_norm: ld.vector(&lw.pp("post_attention_layernorm"), "weight", h)?,
                gate_up: backend.upload_weight(gate_up)?,
                down: ld.linear(&mlp.pp("down_proj"), h, c.intermediate_size)?,
                mlp_scale: ld.vector(&lw.pp("mlp_layer_scale"), "scale", h)?,
            });
        }
        let norm = ld.vector(&tr.pp("norm"), "weight", h)?;

        let mut upsample = Vec::new();
        for (i, &f) in c.upsampling_ratios.iter().enumerate() {
            let at = root.pp("upsample").pp(i);
            let up = ld.trans_conv(&at.pp(0), h, h, ConvTranspose1dSpec { kernel: f, stride: f })?;
            let nx = at.pp(1);
            let block = ConvNeXt {
                dwconv: ld.depthwise_conv(
                    &nx.pp("dwconv"),
                    h,
                    Conv1dSpec { kernel: 7, dilation: 1, groups: h },
                )?,
                norm_w: ld.vector(&nx.pp("norm"), "weight", h)?,
                norm_b: ld.vector(&nx.pp("norm"), "bias", h)?,
                pwconv1: ld.linear(&nx.pp("pwconv1"), 4 * h, h)?,
                pwconv1_b: ld.vector(&nx.pp("pwconv1"), "bias", 4 * h)?,
                pwconv2: ld.linear(&nx.pp("pwconv2"), h, 4 * h)?,
                pwconv2_b: ld.vector(&nx.pp("pwconv2"), "bias", h)?,
                gamma: ld.vector(&nx, "gamma", h)?,
            };
            upsample.push(Upsample { up, block });
        }

        let dec = root.pp("decoder");
        let pre_conv = ld.conv(&dec.pp(0), h, c.decoder_dim, causal(7, 1))?;
        let mut blocks = Vec::new();
        for (i, &r) in c.upsample_rates.iter().enumerate() {
            let (cin, cout) = (c.decoder_channels(i), c.decoder_channels(i + 1));
            let at = dec.pp(i + 1).pp("block");
            let mut units = Vec::new();
            for (u, d) in RESIDUAL_DILATIONS.into_iter().enumerate() {
                let ut = at.pp(u + 2);
                units.push(ResidualUnit {
                    act1: ld.snake(&ut.pp("act1"), cout)?,
                    conv1: ld.conv(&ut.pp("conv1"), cout, cout, causal(7, d))?,
                    act2: ld.snake(&ut.pp("act2"), cout)?,
                    conv2: ld.conv(&ut.pp("conv2"), cout, cout, causal(1, 1))?,
                });
            }
            blocks.push(DecoderBlock {
                act: ld.snake(&at.pp(0), cin)?,
                up: ld.trans_conv(&at.pp(1), cin, cout, ConvTranspose1dSpec { kernel: 2 * r, stride: r })?,
                units,
            });
        }
        let n = c.upsample_rates.len();
        let out_dim = c.decoder_channels(n);
        let post_act = ld.snake(&dec.pp(n + 1), out_dim)?;
        let post_conv = ld.conv(&dec.pp(n + 2), out_dim, 1, causal(7, 1))?;
        Ok(Self {
            rope: RopeSpec { theta: c.rope_theta as f32, head_dim: hd, kind: RopeKind::Plain },
            config,
            embed,
            mean_scale,
            layers,
            norm,
            upsample,
            pre_conv,
            blocks,
            post_act,
            post_conv,
        })
    }

    /// A model with seeded random weights ([`random_source`], loaded through [`Code2Wav::load`]).
    pub fn random(backend: &B, config: Code2WavConfig, seed: u64) -> Result<Self> {
        let source = random_source(&config, seed)?;
        Self::load(backend, config, &source)
    }

    /// The model's config.
    pub fn config(&self) -> &Code2WavConfig {
        &self.config
    }

    /// Output samples per frame (1920 for Qwen3-Omni: 12.5 frames a second at 24 kHz).
    pub fn total_upsample(&self) -> usize {
        self.config.total_upsample()
    }

    /// Output samples per second.
    pub fn sample_rate(&self) -> u32 {
        self.config.sample_rate
    }

    /// HF `Code2Wav.forward` on `codes [num_quantizers, frames]`: the waveform,
    /// [`Code2WavConfig::output_len`] samples in `[-1, 1]`. A codes matrix with
    /// another number of rows is [`RequestError::MediaShape`]; a code outside
    /// `0..codebook_size` is [`RequestError::CodecCodeOutOfRange`].
    pub fn forward(&self, backend: &B, codes: ArrayView2<'_, i64>) -> Result<Vec<f32>> {
        self.check_codes(codes, 0)?;
        if codes.ncols() == 0 {
            return Ok(Vec::new());
        }
        let x = self.embed_codes(backend, codes)?;
        let hidden = self.transformer(backend, x, 0, &mut self.empty_window())?;
        self.decode_hidden(backend, &hidden, &mut ConvHistory::default())
    }

    /// Checks a codes matrix; its column `t` is frame `first_frame + t` (for errors).
    pub(crate) fn check_codes(&self, codes: ArrayView2<'_, i64>, first_frame: usize) -> Result<()> {
        let (nq, cb) = (self.config.num_quantizers, self.config.codebook_size);
        if codes.nrows() != nq {
            return Err(RequestError::MediaShape {
                what: "codec codes",
                expected: format!("[{nq}, frames]"),
                found: codes.shape().to_vec(),
            }
            .into());
        }
        for ((quantizer, t), &code) in codes.indexed_iter() {
            if usize::try_from(code).map_or(true, |c| c >= cb) {
                return Err(RequestError::CodecCodeOutOfRange {
                    quantizer,
                    frame: first_frame + t,
                    code,
                    codebook_size: cb,
                }
                .into());
            }
        }
        Ok(())
    }

    /// The mean over quantizers of checked codes' embeddings: `[frames, hidden]`.
    pub(crate) fn embed_codes(&self, backend: &B, codes: ArrayView2<'_, i64>) -> Result<B::Tensor> {
        let cb = self.config.codebook_size;
        let mut acc: Option<B::Tensor> = None;
        for (q, row) in codes.rows().into_iter().enumerate() {
            // check_codes bounded every code by codebook_size, and the table by u32.
            let ids: Vec<u32> = row.iter().map(|&c| (q * cb) as u32 + c as u32).collect();
            let e = backend.embedding(&self.embed, &ids)?;
            match acc.as_mut() {
                None => acc = Some(e),
                Some(a) => backend.add(a, &e)?,
            }
        }
        let mut acc = acc.ok_or_else(|| CheckpointError::UnsupportedConfig {
            field: "num_quantizers",
            value: "0".into(),
            reason: "must be positive",
        })?;
        backend.scale_cols(&mut acc, &self.mean_scale)?;
        Ok(acc)
    }

    /// An empty K/V window per layer.
    pub(crate) fn empty_window(&self) -> KvWindow<B::Tensor> {
        (0..self.layers.len()).map(|_| None).collect()
    }

    /// The transformer (and its final norm) on frames `start..start + n` (`x [n,
    /// hidden]`), attending to the keys `window` holds from earlier frames and leaving
    /// it holding the last `sliding_window - 1` frames' keys. Every op here computes a
    /// row from its own row (and attention from the keys it sees), so frames fed in
    /// chunks get the rows one pass gives.
    pub(crate) fn transformer(
        &self, backend: &B, mut x: B::Tensor, start: usize, window: &mut KvWindow<B::Tensor>,
    ) -> Result<B::Tensor> {
        let c = &self.config;
        let eps = c.rms_norm_eps as f32;
        let [n, _] = backend.shape(&x);
        let pos: Vec<i64> = (start..start + n).map(|p| p as i64).collect();
        let positions = RopePositions { t: &pos, h: &pos, w: &pos };
        let heads = AttnHeads {
            num_heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
        };
        let keep = c.sliding_window - 1;
        for (lw, cached) in self.layers.iter().zip(window.iter_mut()) {
            let h = backend.rms_norm(&x, &lw.input_norm, eps)?;
            let mut q = backend.matmul_t(&h, &lw.q)?;
            let mut k = backend.matmul_t(&h, &lw.k)?;
            let mut v = backend.matmul_t(&h, &lw.v)?;
            if let Some([bq, bk, bv, _]) = &lw.bias {
                backend.add_bias(&mut q, bq)?;
                backend.add_bias(&mut k, bk)?;
                backend.add_bias(&mut v, bv)?;
            }
            backend.rope(&mut q, &self.rope, positions)?;
            backend.rope(&mut k, &self.rope, positions)?;
            let (k, v) = match cached.take() {
                Some((ck, cv)) => (concat_rows(backend, &ck, &k)?, concat_rows(backend, &cv, &v)?),
                None => (k, v),
            };
            let attn = backend.causal_attention(&q, &k, &v, heads, Some(c.sliding_window))?;
            let mut o = backend.matmul_t(&attn, &lw.o)?;
            if let Some([_, _, _, bo]) = &lw.bias {
                backend.add_bias(&mut o, bo)?;
            }
            backend.scale_cols(&mut o, &lw.attn_scale)?;
            backend.add(&mut x, &o)?;
            *cached = Some((last_rows(backend, &k, keep)?, last_rows(backend, &v, keep)?));
            let h = backend.rms_norm(&x, &lw.post_norm, eps)?;
            let mut m = backend.matmul_t(&backend.swiglu(&backend.matmul_t(&h, &lw.gate_up)?)?, &lw.down)?;
            backend.scale_cols(&mut m, &lw.mlp_scale)?;
            backend.add(&mut x, &m)?;
        }
        backend.rms_norm(&x, &self.norm, eps)
    }

    /// The convolutions and the clamp on the transformer output of the next frames,
    /// `hidden [frames, hidden]`, after the frames `history` saw (none for one
    /// pass): the samples those frames make final, on the host. Over all chunks
    /// they are [`Code2WavConfig::output_len`]`(frames)` samples, the one pass's.
    pub(crate) fn decode_hidden(
        &self, backend: &B, hidden: &B::Tensor, history: &mut ConvHistory<B::Tensor>,
    ) -> Result<Vec<f32>> {
        history.next = 0;
        let mut x: Option<B::Tensor> = None;
        for Upsample { up, block: nx } in &self.upsample {
            let input = x.as_ref().unwrap_or(hidden);
            let mut y = self.transposed(backend, history, input, up)?;
            let dw = &nx.dwconv;
            let h = history
                .causal(backend, &y, dw.spec, |w| backend.causal_conv1d(w, &dw.w, Some(&dw.b), dw.spec))?;
            let h = backend.layer_norm(&h, &nx.norm_w, &nx.norm_b, 1e-6)?;
            let mut h = backend.matmul_t(&h, &nx.pwconv1)?;
            backend.add_bias(&mut h, &nx.pwconv1_b)?;
            let mut h = backend.matmul_t(&backend.gelu(&h)?, &nx.pwconv2)?;
            backend.add_bias(&mut h, &nx.pwconv2_b)?;
            backend.scale_cols(&mut h, &nx.gamma)?;
            backend.add(&mut y, &h)?;
            x = Some(y);
        }
        let mut x = self.causal(backend, history, x.as_ref().unwrap_or(hidden), &self.pre_conv)?;
        for block in &self.blocks {
            let y = backend.snake_beta(&x, &block.act.alpha, &block.act.beta)?;
            x = self.transposed(backend, history, &y, &block.up)?;
            for u in &block.units {
                let h = self.causal(
                    backend,
                    history,
                    &backend.snake_beta(&x, &u.act1.alpha, &u.act1.beta)?,
                    &u.conv1,
                )?;
                let h = self.causal(
                    backend,
                    history,
                    &backend.snake_beta(&h, &u.act2.alpha, &u.act2.beta)?,
                    &u.conv2,
                )?;
                backend.add(&mut x, &h)?;
            }
        }
        let y = backend.snake_beta(&x, &self.post_act.alpha, &self.post_act.beta)?;
        let mut wav = self.causal(backend, history, &y, &self.post_conv)?;
        backend.clamp(&mut wav, -1.0, 1.0)?;
        Ok(backend.download(&wav)?.into_iter().collect())
    }

    /// A dense causal conv of the new rows `x`: over the conv's history and `x`,
    /// the rows of `x` kept.
    fn causal(
        &self, backend: &B, history: &mut ConvHistory<B::Tensor>, x: &B::Tensor,
        c: &Conv<B::Tensor, B::Weight>,
    ) -> Result<B::Tensor> {
        history.causal(backend, x, c.spec, |w| backend.dense_causal_conv1d(w, &c.w, Some(&c.b), c.spec))
    }

    /// A causal transposed conv of the new rows `x`: every output row it makes is
    /// new and final. Output row `m` reads input rows `m / stride` and, when
    /// `kernel > stride`, the row after it, so the last input row seen leads the
    /// next window, whose output is `(rows - 1) * stride` rows: those of `x`.
    fn transposed(
        &self, backend: &B, history: &mut ConvHistory<B::Tensor>, x: &B::Tensor,
        c: &TransConv<B::Tensor, B::Weight>,
    ) -> Result<B::Tensor> {
        let keep = usize::from(c.spec.kernel > c.spec.stride);
        history.window(backend, x, keep, |w| backend.causal_conv_transpose1d(w, &c.w, Some(&c.b), c.spec))
    }
}

/// What a stream keeps between decodes: per convolution, in the order
/// [`Code2Wav::decode_hidden`] runs them, the last input rows its next output
/// rows read (a causal conv's `(kernel - 1) * dilation`, a transposed conv's one
/// when `kernel > stride`). A chunk's convolutions then run over those rows and
/// the chunk's own, never over earlier frames again, and every row is computed
/// from the rows one pass would read: the samples are one pass's, bit for bit.
pub(crate) struct ConvHistory<T> {
    rows: Vec<Option<T>>,
    /// The next convolution's slot in `rows` during a decode.
    next: usize,
}

impl<T> Default for ConvHistory<T> {
    fn default() -> Self {
        ConvHistory { rows: Vec::new(), next: 0 }
    }
}

impl<T> ConvHistory<T> {
    /// Runs `op` on the next conv's window (its history, then `x`) and keeps the
    /// window's last `keep` rows as its history.
    fn window<B: Backend<Tensor = T>, R>(
        &mut self, backend: &B, x: &T, keep: usize, op: impl FnOnce(&T) -> Result<R>,
    ) -> Result<R> {
        let slot = self.next;
        self.next += 1;
        if self.rows.len() <= slot {
            self.rows.resize_with(slot + 1, || None);
        }
        let window = match self.rows[slot].take() {
            Some(h) => Some(concat_rows(backend, &h, x)?),
            None => None,
        };
        let w = window.as_ref().unwrap_or(x);
        let out = op(w)?;
        self.rows[slot] = if keep == 0 { None } else { Some(last_rows(backend, w, keep)?) };
        Ok(out)
    }

    /// Runs a causal conv `op` of shape `spec` (dense or depthwise) over the next
    /// conv's window, keeping the `(kernel - 1) * dilation` rows its next outputs
    /// read, and returns the rows of `x` (the window's leading history rows dropped).
    fn causal<B: Backend<Tensor = T>>(
        &mut self, backend: &B, x: &T, spec: Conv1dSpec, op: impl FnOnce(&T) -> Result<T>,
    ) -> Result<T> {
        let rows = backend.shape(x)[0];
        let out = self.window(backend, x, (spec.kernel - 1) * spec.dilation, op)?;
        if backend.shape(&out)[0] == rows { Ok(out) } else { last_rows(backend, &out, rows) }
    }
}

/// `a` over `b`: `[ra + rb, cols]`.
fn concat_rows<B: Backend>(backend: &B, a: &B::Tensor, b: &B::Tensor) -> Result<B::Tensor> {
    let ([ra, cols], [rb, _]) = (backend.shape(a), backend.shape(b));
    let mut out = backend.upload(Array2::zeros((ra + rb, cols)).view())?;
    let rows = |range: std::ops::Range<usize>| range.map(|r| r as u32).collect::<Vec<u32>>();
    backend.scatter_rows(&mut out, &rows(0..ra), a)?;
    backend.scatter_rows(&mut out, &rows(ra..ra + rb), b)?;
    Ok(out)
}

/// The last `n` rows of `t` (all of them when it has fewer).
pub(crate) fn last_rows<B: Backend>(backend: &B, t: &B::Tensor, n: usize) -> Result<B::Tensor> {
    let [rows, _] = backend.shape(t);
    let from = rows.saturating_sub(n);
    backend.gather_rows(t, &(from..rows).map(|r| r as u32).collect::<Vec<u32>>())
}

/// Uniform in ±√(3 / fan_in): unit variance out for unit variance in.
fn uniform_scale(fan_in: usize) -> f32 {
    (3.0 / fan_in as f32).sqrt()
}

/// Seeded random weights under HF's `code2wav.*` names, scaled so activations stay
/// O(1) and the waveform mostly inside the clamp (a test model for streaming, load
/// paths and the backends).
pub fn random_source(config: &Code2WavConfig, seed: u64) -> Result<MemorySource> {
    config.validate()?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut src = MemorySource::new();
    let c = config;
    let mut put = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
        let n = shape.iter().product();
        let data = (0..n).map(|_| offset + scale * (rng.random::<f32>() * 2.0 - 1.0)).collect();
        src.insert(format!("code2wav.{name}"), HostTensor { shape, data });
    };
    let fan = uniform_scale;
    // A conv at `at` (`conv.weight` of `shape`, `conv.bias [cout]`); a larger `fan_in`
    // than the kernel's damps it (the residual units, the last conv).
    fn conv(
        put: &mut impl FnMut(String, Vec<usize>, f32, f32), at: String, shape: [usize; 3], fan_in: usize,
        cout: usize,
    ) {
        put(format!("{at}.conv.weight"), shape.to_vec(), uniform_scale(fan_in), 0.0);
        put(format!("{at}.conv.bias"), vec![cout], 0.1, 0.0);
    }
    let (h, hd) = (c.hidden_size, c.head_dim);
    let (q_out, kv_out, inter) =
        (c.num_attention_heads * hd, c.num_key_value_heads * hd, c.intermediate_size);
    put("code_embedding.weight".into(), vec![c.codebook_size * c.num_quantizers, h], 1.0, 0.0);
    for i in 0..c.num_hidden_layers {
        let p = format!("pre_transformer.layers.{i}");
        for (name, out, inp) in
            [("q_proj", q_out, h), ("k_proj", kv_out, h), ("v_proj", kv_out, h), ("o_proj", h, q_out)]
        {
            put(format!("{p}.self_attn.{name}.weight"), vec![out, inp], fan(inp), 0.0);
            if c.attention_bias {
                put(format!("{p}.self_attn.{name}.bias"), vec![out], 0.1, 0.0);
            }
        }
        put(format!("{p}.mlp.gate_proj.weight"), vec![inter, h], fan(h), 0.0);
        put(format!("{p}.mlp.up_proj.weight"), vec![inter, h], fan(h), 0.0);
        put(format!("{p}.mlp.down_proj.weight"), vec![h, inter], fan(inter), 0.0);
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            put(format!("{p}.{norm}.weight"), vec![h], 0.2, 1.0);
        }
        for scale in ["self_attn_layer_scale", "mlp_layer_scale"] {
            put(format!("{p}.{scale}.scale"), vec![h], 0.2, 0.5);
        }
    }
    put("pre_transformer.norm.weight".into(), vec![h], 0.2, 1.0);
    for (i, &f) in c.upsampling_ratios.iter().enumerate() {
        conv(&mut put, format!("upsample.{i}.0"), [h, h, f], h, h);
        let nx = format!("upsample.{i}.1");
        conv(&mut put, format!("{nx}.dwconv"), [h, 1, 7], 7, h);
        put(format!("{nx}.norm.weight"), vec![h], 0.2, 1.0);
        put(format!("{nx}.norm.bias"), vec![h], 0.1, 0.0);
        put(format!("{nx}.pwconv1.weight"), vec![4 * h, h], fan(h), 0.0);
        put(format!("{nx}.pwconv1.bias"), vec![4 * h], 0.1, 0.0);
        put(format!("{nx}.pwconv2.weight"), vec![h, 4 * h], fan(4 * h), 0.0);
        put(format!("{nx}.pwconv2.bias"), vec![h], 0.1, 0.0);
        put(format!("{nx}.gamma"), vec![h], 0.2, 0.5);
    }
    conv(&mut put, "decoder.0".into(), [c.decoder_dim, h, 7], 7 * h, c.decoder_dim);
    for (i, &r) in c.upsample_rates.iter().enumerate() {
        let (cin, cout) = (c.decoder_channels(i), c.decoder_channels(i + 1));
        let b = format!("decoder.{}.block", i + 1);
        put(format!("{b}.0.alpha"), vec![cin], 0.3, 0.0);
        put(format!("{b}.0.beta"), vec![cin], 0.3, 0.0);
        conv(&mut put, format!("{b}.1"), [cin, cout, 2 * r], 2 * cin, cout);
        for u in 2..5 {
            for act in ["act1", "act2"] {
                put(format!("{b}.{u}.{act}.alpha"), vec![cout], 0.3, 0.0);
                put(format!("{b}.{u}.{act}.beta"), vec![cout], 0.3, 0.0);
            }
            conv(&mut put, format!("{b}.{u}.conv1"), [cout, cout, 7], 14 * cout, cout);
            conv(&mut put, format!("{b}.{u}.conv2"), [cout, cout, 1], 4 * cout, cout);
        }
    }
    let n = c.upsample_rates.len();
    let out_dim = c.decoder_channels(n);
    put(format!("decoder.{}.alpha", n + 1), vec![out_dim], 0.3, 0.0);
    put(format!("decoder.{}.beta", n + 1), vec![out_dim], 0.3, 0.0);
    conv(&mut put, format!("decoder.{}", n + 2), [1, out_dim, 7], 400 * out_dim, 1);
    Ok(src)
}

#[cfg(test)]
mod tests;
