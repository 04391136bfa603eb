//! The Qwen2/Qwen3-family decoder ("thinker" text model), generic over a [`Backend`](crate::backend::Backend):
//! RMSNorm, GQA attention over paged KV (optional qkv bias and qk-norm, RoPE or
//! M-RoPE), dense SwiGLU MLP or Qwen3-MoE block per layer.

use std::path::Path;

use ndarray::Array2;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::Result;
use crate::backend::weight::unsupported_dtype;
use crate::backend::{AttnHeads, AttnSeq, Backend, Dtype, HostWeight, MoeWeights, RopePositions, RopeSpec};
use crate::error::{BackendError, CheckpointError};
use crate::model::config::Config;
use crate::model::identity::Recording;
use crate::model::weights::{HostTensor, MemorySource, SafetensorsSource, WeightSource, Weights};
use crate::tier::ModelId;

/// Attention weights of one layer, on the device: matrices `W`, vectors `T`.
struct Attention<T, W> {
    q: W,
    k: W,
    v: W,
    o: W,
    /// q, k, v biases `[1, out]` (Qwen2 family).
    bias: Option<[T; 3]>,
    /// q and k per-head norm weights `[1, head_dim]` (Qwen3 family).
    qk_norm: Option<[T; 2]>,
}

/// The feed-forward block of one layer.
enum Mlp<W> {
    /// `down(silu(gate x) * up x)` with gate and up fused row-wise `[2I, H]`.
    Dense { gate_up: W, down: W },
    /// Routed experts, plus a gated shared expert where the config has one.
    Sparse { routed: MoeWeights<W>, shared: Option<SharedExpert<W>> },
}

/// The shared expert of a sparse layer: a SwiGLU MLP every row takes, scaled by
/// `sigmoid(x @ gate^T)` (HF `shared_expert` and `shared_expert_gate`).
struct SharedExpert<W> {
    /// gate and up fused row-wise `[2I, H]`.
    gate_up: W,
    down: W,
    /// `[1, H]`.
    gate: W,
}

struct Layer<T, W> {
    input_norm: T,
    attn: Attention<T, W>,
    post_norm: T,
    mlp: Mlp<W>,
}

/// Per-step inputs every layer shares: rotary positions, KV slots, sequences.
#[derive(Debug, Clone, Copy)]
pub struct StepMeta<'a> {
    pub positions: RopePositions<'a>,
    /// Slot of each new row (`-1` skips the KV write).
    pub slots: &'a [i64],
    pub seqs: &'a [AttnSeq<'a>],
}

/// A loaded thinker: config plus device weights.
///
/// ```
/// use omniprefix::backend::cpu::CpuBackend;
/// use omniprefix::model::{Config, Thinker};
/// let cfg = Config::tiny_qwen3(32, 2, 4, 2, 50);
/// let thinker = Thinker::random(&CpuBackend::new(), cfg, 7)?;
/// assert_eq!(thinker.config().num_hidden_layers, 2);
/// # Ok::<(), omniprefix::Error>(())
/// ```
pub struct Thinker<B: Backend> {
    config: Config,
    rope: RopeSpec,
    dtype: Dtype,
    weight_bytes: usize,
    /// A digest of the weights read (names, shapes, dtypes, each one's first bytes) and the config.
    identity: ModelId,
    embed: B::Weight,
    layers: Vec<Layer<B::Tensor, B::Weight>>,
    norm: B::Tensor,
    /// `None` when tied to the embeddings.
    lm_head: Option<B::Weight>,
}

/// Where one decoder's weights live in a checkpoint, so the same loader reads
/// the thinker (`thinker.model.embed_tokens`, `thinker.lm_head`), the talker
/// (`talker.model.codec_embedding`, `talker.codec_head`) and the code predictor.
///
/// ```
/// use omniprefix::model::thinker::WeightNames;
/// let talker = WeightNames::new("talker.model", "codec_embedding", "talker.codec_head");
/// assert_eq!(talker.embed, "codec_embedding");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightNames {
    /// Prefix of `layers.N.*` and `norm` (e.g. `model`, `talker.model`).
    pub model: String,
    /// The input embedding table, under `model` (e.g. `embed_tokens`).
    pub embed: String,
    /// Prefix of the output head's `weight` (e.g. `lm_head`); unused when tied.
    pub head: String,
}

impl WeightNames {
    /// Names from their three parts.
    pub fn new(model: &str, embed: &str, head: &str) -> Self {
        WeightNames { model: model.into(), embed: embed.into(), head: head.into() }
    }
}

/// The weight names of a thinker checkpoint (plain HF or Omni `thinker.`).
fn prefixes(source: &dyn WeightSource) -> Result<WeightNames> {
    if source.contains("thinker.model.embed_tokens.weight") {
        Ok(WeightNames::new("thinker.model", "embed_tokens", "thinker.lm_head"))
    } else if source.contains("model.embed_tokens.weight") {
        Ok(WeightNames::new("model", "embed_tokens", "lm_head"))
    } else {
        Err(CheckpointError::MissingTensor { name: "model.embed_tokens.weight".into() }.into())
    }
}

/// Stacks matrices row-wise (fusing gate/up, or experts) into the weight `name`.
fn stack(parts: Vec<HostWeight>, name: String) -> Result<HostWeight> {
    HostWeight::stack(parts)
        .ok_or_else(|| CheckpointError::WeightLayout { name, problem: "parts do not stack".into() }.into())
}

/// Host weights of one MoE block in the fused layout of [`MoeWeights`], stored as `dtype`.
fn load_experts(
    mlp: &Weights<'_>, cfg: &Config, num_experts: usize, inter: usize, dtype: Dtype,
) -> Result<[HostWeight; 2]> {
    let hidden = cfg.hidden_size;
    let experts = mlp.pp("experts");
    if experts.contains("gate_up_proj") {
        // transformers v5 fused layout: gate_up [E, 2I, H], down [E, H, I].
        let gate_up = experts.weight_reshaped(
            "gate_up_proj",
            &[num_experts, 2 * inter, hidden],
            num_experts * 2 * inter,
            hidden,
            dtype,
        )?;
        let down = experts.weight_reshaped(
            "down_proj",
            &[num_experts, hidden, inter],
            num_experts * hidden,
            inter,
            dtype,
        )?;
        return Ok([gate_up, down]);
    }
    let (mut gate_up, mut down) = (Vec::new(), Vec::new());
    for e in 0..num_experts {
        let ex = experts.pp(e);
        gate_up.push(ex.pp("gate_proj").weight("weight", inter, hidden, dtype)?);
        gate_up.push(ex.pp("up_proj").weight("weight", inter, hidden, dtype)?);
        down.push(ex.pp("down_proj").weight("weight", hidden, inter, dtype)?);
    }
    Ok([stack(gate_up, experts.name("*.gate_proj+up_proj"))?, stack(down, experts.name("*.down_proj"))?])
}

/// The dtype weights load as: `requested`, else the checkpoint's own (its
/// embedding table's), widened to f32 on a backend that cannot store that.
fn resolve_dtype<B: Backend>(backend: &B, embed: &Weights<'_>, requested: Option<Dtype>) -> Result<Dtype> {
    let supported = backend.weight_dtypes();
    match requested {
        Some(d) if supported.contains(&d) => Ok(d),
        Some(d) => Err(unsupported_dtype(backend.name(), "weight dtype", supported, d)),
        None => Ok(embed.stored_dtype("weight").filter(|d| supported.contains(d)).unwrap_or(Dtype::F32)),
    }
}

impl<B: Backend> Thinker<B> {
    /// Loads `config.json` (eos ids from `generation_config.json` when present,
    /// see [`Config::from_dir`]) and the safetensors checkpoint in `dir`.
    pub fn from_dir(backend: &B, dir: &Path) -> Result<Self> {
        Self::from_dir_as(backend, dir, None)
    }

    /// [`Thinker::from_dir`] with the matrices stored as `dtype` (`None`: the checkpoint's own).
    pub fn from_dir_as(backend: &B, dir: &Path, dtype: Option<Dtype>) -> Result<Self> {
        let config = Config::from_dir(dir)?;
        let source = SafetensorsSource::open_dir(dir)?;
        Self::load_as(backend, config, &source, dtype)
    }

    /// Loads every weight `config` implies from `source`, shape-checked, and uploads it,
    /// matrices in the checkpoint's own dtype where the backend stores it (see [`Thinker::load_as`]).
    pub fn load(backend: &B, config: Config, source: &dyn WeightSource) -> Result<Self> {
        Self::load_as(backend, config, source, None)
    }

    /// Loads every weight `config` implies from `source`, shape-checked, and uploads it.
    /// Names follow HF (`model.layers.3.self_attn.q_proj.weight`), under `thinker.`
    /// for Omni checkpoints.
    ///
    /// Matrices (projections, embeddings, experts) are stored as `dtype`; `None`
    /// takes the embedding table's stored dtype, or f32 where the backend cannot
    /// store that. An explicit dtype the backend cannot store is a
    /// [`ConfigError::Invalid`](crate::error::ConfigError::Invalid). Norm weights
    /// and biases stay f32; every product accumulates in f32.
    ///
    /// ```
    /// use omniprefix::backend::{cpu::CpuBackend, Dtype};
    /// use omniprefix::model::{Config, Thinker, random_source};
    /// let cfg = Config::tiny_qwen3(32, 2, 4, 2, 50);
    /// let source = random_source(&cfg, 7)?;
    /// let thinker = Thinker::load_as(&CpuBackend::new(), cfg, &source, Some(Dtype::Bf16))?;
    /// assert_eq!(thinker.dtype(), Dtype::Bf16);
    /// # Ok::<(), omniprefix::Error>(())
    /// ```
    pub fn load_as(
        backend: &B, config: Config, source: &dyn WeightSource, dtype: Option<Dtype>,
    ) -> Result<Self> {
        let names = prefixes(source)?;
        Self::load_named(backend, config, source, dtype, &names)
    }

    /// [`Thinker::load_as`] of a decoder stored under `names` (the talker's, the
    /// code predictor's): the same layers, norms and experts, another prefix.
    pub fn load_named(
        backend: &B, config: Config, source: &dyn WeightSource, dtype: Option<Dtype>, names: &WeightNames,
    ) -> Result<Self> {
        // Each packed matrix is made beside its host copy: let those copies' pages go (crate::alloc).
        crate::alloc::while_loading(|| Self::load_packed(backend, config, source, dtype, names))
    }

    fn load_packed(
        backend: &B, config: Config, source: &dyn WeightSource, dtype: Option<Dtype>, names: &WeightNames,
    ) -> Result<Self> {
        config.validate()?;
        let recording = Recording::new(source);
        let source: &dyn WeightSource = &recording;
        let root = Weights::root(source, &names.model);
        let dtype = resolve_dtype(backend, &root.pp(&names.embed), dtype)?;
        let c = &config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (q_out, kv_out) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let weight_bytes = std::cell::Cell::new(0usize);
        let up = |a: Array2<f32>| {
            weight_bytes.set(weight_bytes.get() + a.len() * 4);
            backend.upload(a.view())
        };
        let upw = |w: HostWeight| {
            weight_bytes.set(weight_bytes.get() + w.bytes());
            backend.upload_weight(w)
        };
        let matrix =
            |at: &Weights<'_>, rows: usize, cols: usize| at.weight("weight", rows, cols, dtype).and_then(upw);

        let embed = matrix(&root.pp(&names.embed), c.vocab_size, h)?;
        let mut layers = Vec::new();
        for i in 0..c.num_hidden_layers {
            let lw = root.pp("layers").pp(i);
            let at = lw.pp("self_attn");
            let bias = if c.attention_bias {
                Some([
                    up(at.pp("q_proj").vector("bias", q_out)?)?,
                    up(at.pp("k_proj").vector("bias", kv_out)?)?,
                    up(at.pp("v_proj").vector("bias", kv_out)?)?,
                ])
            } else {
                None
            };
            let qk_norm = if c.qk_norm {
                Some([up(at.pp("q_norm").vector("weight", hd)?)?, up(at.pp("k_norm").vector("weight", hd)?)?])
            } else {
                None
            };
            let attn = Attention {
                q: matrix(&at.pp("q_proj"), q_out, h)?,
                k: matrix(&at.pp("k_proj"), kv_out, h)?,
                v: matrix(&at.pp("v_proj"), kv_out, h)?,
                o: matrix(&at.pp("o_proj"), h, q_out)?,
                bias,
                qk_norm,
            };
            let mw = lw.pp("mlp");
            let mlp = match c.moe.as_ref().filter(|_| c.is_sparse_layer(i)) {
                Some(m) => {
                    let [gate_up, down] =
                        load_experts(&mw, c, m.num_experts, m.moe_intermediate_size, dtype)?;
                    let routed = MoeWeights {
                        router: matrix(&mw.pp("gate"), m.num_experts, h)?,
                        gate_up: upw(gate_up)?,
                        down: upw(down)?,
                        num_experts: m.num_experts,
                        top_k: m.num_experts_per_tok,
                        norm_topk_prob: m.norm_topk_prob,
                    };
                    let shared = match m.shared_expert_intermediate_size {
                        0 => None,
                        inter => {
                            let sw = mw.pp("shared_expert");
                            let gate = sw.pp("gate_proj").weight("weight", inter, h, dtype)?;
                            let upm = sw.pp("up_proj").weight("weight", inter, h, dtype)?;
                            Some(SharedExpert {
                                gate_up: upw(stack(vec![gate, upm], sw.name("gate_proj+up_proj"))?)?,
                                down: matrix(&sw.pp("down_proj"), h, inter)?,
                                gate: matrix(&mw.pp("shared_expert_gate"), 1, h)?,
                            })
                        }
                    };
                    Mlp::Sparse { routed, shared }
                }
                None => {
                    let gate = mw.pp("gate_proj").weight("weight", c.intermediate_size, h, dtype)?;
                    let upm = mw.pp("up_proj").weight("weight", c.intermediate_size, h, dtype)?;
                    Mlp::Dense {
                        gate_up: upw(stack(vec![gate, upm], mw.name("gate_proj+up_proj"))?)?,
                        down: matrix(&mw.pp("down_proj"), h, c.intermediate_size)?,
                    }
                }
            };
            layers.push(Layer {
                input_norm: up(lw.pp("input_layernorm").vector("weight", h)?)?,
                attn,
                post_norm: up(lw.pp("post_attention_layernorm").vector("weight", h)?)?,
                mlp,
            });
        }
        let norm = up(root.pp("norm").vector("weight", h)?)?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(matrix(&Weights::root(source, &names.head), c.vocab_size, h)?)
        };
        let identity = recording.identity(&[format!("{config:?}").as_bytes(), dtype.name().as_bytes()]);
        Ok(Self {
            rope: config.rope_spec(),
            config,
            dtype,
            weight_bytes: weight_bytes.get(),
            identity,
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    /// A model with seeded random weights (HF names in memory, loaded through [`Thinker::load`]).
    pub fn random(backend: &B, config: Config, seed: u64) -> Result<Self> {
        Self::random_as(backend, config, seed, None)
    }

    /// [`Thinker::random`] with the matrices rounded to `dtype` (`None`: f32).
    pub fn random_as(backend: &B, config: Config, seed: u64, dtype: Option<Dtype>) -> Result<Self> {
        let source = random_source(&config, seed)?;
        Self::load_as(backend, config, &source, dtype)
    }

    /// The model's config.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The dtype the matrices are stored in.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// What this model is, as the disk tier checks it: a digest of its config and of
    /// every weight it read (name, shape, stored dtype and first bytes).
    pub fn identity(&self) -> ModelId {
        self.identity
    }

    /// Bytes of all weights as stored (matrices in [`Thinker::dtype`], vectors in f32).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// The rotary embedding the layers apply.
    pub fn rope(&self) -> &RopeSpec {
        &self.rope
    }

    /// Token embeddings `[ids.len(), hidden]`; ids must be `< vocab_size`.
    pub fn embed(&self, backend: &B, ids: &[u32]) -> Result<B::Tensor> {
        backend.embedding(&self.embed, ids)
    }

    /// Runs decoder layer `layer` on `x [n, hidden]` in place, writing its K/V at `step.slots`.
    pub fn forward_layer(
        &self, backend: &B, layer: usize, x: &mut B::Tensor, step: &StepMeta<'_>, pages: &mut B::Pages,
    ) -> Result<()> {
        let lw = self.layers.get(layer).ok_or(BackendError::OpIndex {
            op: "forward_layer",
            what: "layer",
            index: layer as i64,
            bound: self.layers.len(),
        })?;
        let eps = self.config.rms_norm_eps as f32;
        let a = &lw.attn;
        let h = backend.rms_norm(x, &lw.input_norm, eps)?;
        let mut q = backend.matmul_t(&h, &a.q)?;
        let mut k = backend.matmul_t(&h, &a.k)?;
        let mut v = backend.matmul_t(&h, &a.v)?;
        if let Some([bq, bk, bv]) = &a.bias {
            backend.add_bias(&mut q, bq)?;
            backend.add_bias(&mut k, bk)?;
            backend.add_bias(&mut v, bv)?;
        }
        if let Some([nq, nk]) = &a.qk_norm {
            backend.rms_norm_heads(&mut q, nq, self.config.head_dim, eps)?;
            backend.rms_norm_heads(&mut k, nk, self.config.head_dim, eps)?;
        }
        backend.rope(&mut q, &self.rope, step.positions)?;
        backend.rope(&mut k, &self.rope, step.positions)?;
        backend.write_kv(pages, layer, &k, &v, step.slots)?;
        let heads = AttnHeads {
            num_heads: self.config.num_attention_heads,
            kv_heads: self.config.num_key_value_heads,
            head_dim: self.config.head_dim,
        };
        let attn = backend.paged_attention(&q, pages, layer, heads, step.seqs)?;
        backend.add(x, &backend.matmul_t(&attn, &a.o)?)?;
        let h = backend.rms_norm(x, &lw.post_norm, eps)?;
        let mlp_out = match &lw.mlp {
            Mlp::Dense { gate_up, down } => {
                backend.matmul_t(&backend.swiglu(&backend.matmul_t(&h, gate_up)?)?, down)?
            }
            Mlp::Sparse { routed, shared } => {
                let mut out = backend.moe(&h, routed)?;
                if let Some(s) = shared {
                    let y =
                        backend.matmul_t(&backend.swiglu(&backend.matmul_t(&h, &s.gate_up)?)?, &s.down)?;
                    backend.add_sigmoid_gated(&mut out, &y, &backend.matmul_t(&h, &s.gate)?)?;
                }
                out
            }
        };
        backend.add(x, &mlp_out)
    }

    /// The final RMSNorm of `x [n, hidden]`.
    pub fn final_norm(&self, backend: &B, x: &B::Tensor) -> Result<B::Tensor> {
        backend.rms_norm(x, &self.norm, self.config.rms_norm_eps as f32)
    }

    /// The number of decoder layers (what [`Thinker::forward_layer`] accepts).
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Logits `[n, vocab]` of final-normed rows.
    pub fn logits(&self, backend: &B, normed: &B::Tensor) -> Result<B::Tensor> {
        backend.matmul_t(normed, self.lm_head.as_ref().unwrap_or(&self.embed))
    }
}

/// Seeded random weights under HF names (`model.` prefix), scaled so activations
/// stay O(1) through many layers.
pub fn random_source(config: &Config, seed: u64) -> Result<MemorySource> {
    config.validate()?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut src = MemorySource::new();
    let c = config;
    let (h, hd) = (c.hidden_size, c.head_dim);
    let (q_out, kv_out) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let mut put = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
        let n = shape.iter().product();
        let data = (0..n).map(|_| offset + scale * (rng.random::<f32>() * 2.0 - 1.0)).collect();
        src.insert(name, HostTensor { shape, data });
    };
    let lin = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    put("model.embed_tokens.weight".into(), vec![c.vocab_size, h], 1.0, 0.0);
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        put(format!("{p}.input_layernorm.weight"), vec![h], 0.2, 1.0);
        put(format!("{p}.post_attention_layernorm.weight"), vec![h], 0.2, 1.0);
        for (name, out) in [("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)] {
            put(format!("{p}.self_attn.{name}.weight"), vec![out, h], lin(h), 0.0);
            if c.attention_bias {
                put(format!("{p}.self_attn.{name}.bias"), vec![out], 0.1, 0.0);
            }
        }
        put(format!("{p}.self_attn.o_proj.weight"), vec![h, q_out], lin(q_out), 0.0);
        if c.qk_norm {
            put(format!("{p}.self_attn.q_norm.weight"), vec![hd], 0.2, 1.0);
            put(format!("{p}.self_attn.k_norm.weight"), vec![hd], 0.2, 1.0);
        }
        match c.moe.as_ref().filter(|_| c.is_sparse_layer(i)) {
            Some(m) => {
                let inter = m.moe_intermediate_size;
                put(format!("{p}.mlp.gate.weight"), vec![m.num_experts, h], 1.0, 0.0);
                for e in 0..m.num_experts {
                    put(format!("{p}.mlp.experts.{e}.gate_proj.weight"), vec![inter, h], lin(h), 0.0);
                    put(format!("{p}.mlp.experts.{e}.up_proj.weight"), vec![inter, h], lin(h), 0.0);
                    put(format!("{p}.mlp.experts.{e}.down_proj.weight"), vec![h, inter], lin(inter), 0.0);
                }
                let shared = m.shared_expert_intermediate_size;
                if shared > 0 {
                    put(format!("{p}.mlp.shared_expert.gate_proj.weight"), vec![shared, h], lin(h), 0.0);
                    put(format!("{p}.mlp.shared_expert.up_proj.weight"), vec![shared, h], lin(h), 0.0);
                    put(format!("{p}.mlp.shared_expert.down_proj.weight"), vec![h, shared], lin(shared), 0.0);
                    put(format!("{p}.mlp.shared_expert_gate.weight"), vec![1, h], lin(h), 0.0);
                }
            }
            None => {
                let inter = c.intermediate_size;
                put(format!("{p}.mlp.gate_proj.weight"), vec![inter, h], lin(h), 0.0);
                put(format!("{p}.mlp.up_proj.weight"), vec![inter, h], lin(h), 0.0);
                put(format!("{p}.mlp.down_proj.weight"), vec![h, inter], lin(inter), 0.0);
            }
        }
    }
    put("model.norm.weight".into(), vec![h], 0.2, 1.0);
    if !c.tie_word_embeddings {
        put("lm_head.weight".into(), vec![c.vocab_size, h], lin(h), 0.0);
    }
    Ok(src)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use safetensors::tensor::TensorView as StView;

    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::error::{Error, IoError};
    use crate::model::CaptureSpec;
    use crate::prompt::Positions;
    use crate::runner::{PromptInputs, run_uncached};

    fn tiny() -> Config {
        Config::tiny_qwen3_omni_moe(32, 2, 4, 2, 40, 4, 2)
    }

    fn logits_of(thinker: &Thinker<CpuBackend>) -> Vec<f32> {
        let inputs =
            PromptInputs { token_ids: vec![1, 5, 9, 2, 7], embeds: vec![], positions: Positions::linear(5) };
        let out = run_uncached(thinker, &CpuBackend, &inputs, &CaptureSpec::default_for(2), false).unwrap();
        out.last_logits
    }

    fn scratch_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("omniprefix-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Writes `src` as safetensors in bf16 under `prefix`, split over `shards` files.
    fn write_checkpoint(dir: &Path, src: &MemorySource, prefix: &str, shards: usize) {
        let mut names: Vec<&str> = src.names().collect();
        names.sort();
        let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = names
            .iter()
            .map(|n| {
                let t = src.load(n).unwrap();
                let bytes = t.data.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
                (format!("{prefix}{n}"), t.shape, bytes)
            })
            .collect();
        let mut weight_map = serde_json::Map::new();
        let per = encoded.len().div_ceil(shards);
        for (i, chunk) in encoded.chunks(per).enumerate() {
            let file = format!("model-{i:05}.safetensors");
            let views = chunk.iter().map(|(n, shape, bytes)| {
                weight_map.insert(n.clone(), file.clone().into());
                (n.clone(), StView::new(safetensors::Dtype::BF16, shape.clone(), bytes).unwrap())
            });
            let views: Vec<_> = views.collect();
            safetensors::serialize_to_file(views, &None, &dir.join(&file)).unwrap();
        }
        let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }

    #[test]
    fn missing_and_misshapen_weights_are_named() {
        let mut src = random_source(&tiny(), 3).unwrap();
        let name = "model.layers.1.self_attn.k_proj.weight";
        let k = src.remove(name).unwrap();
        let err = Thinker::load(&CpuBackend, tiny(), &src).err().unwrap();
        assert!(
            matches!(&err, Error::Checkpoint(CheckpointError::MissingTensor { name: n }) if n == name),
            "{err}"
        );
        src.insert(name, HostTensor { shape: vec![16, 31], data: k.data[..16 * 31].to_vec() });
        let err = Thinker::load(&CpuBackend, tiny(), &src).err().unwrap();
        assert!(
            matches!(&err, Error::Checkpoint(CheckpointError::TensorShape { name: n, expected, found }) if n == name && expected == &[16, 32] && found == &[16, 31]),
            "{err}"
        );
        let err = Thinker::load(&CpuBackend, tiny(), &MemorySource::new()).err().unwrap();
        assert!(matches!(err, Error::Checkpoint(CheckpointError::MissingTensor { .. })));
    }

    #[test]
    fn sharded_bf16_omni_checkpoint_loads_like_the_rounded_weights() {
        let cfg = tiny();
        let src = random_source(&cfg, 9).unwrap();
        let dir = scratch_dir("sharded");
        write_checkpoint(&dir, &src, "thinker.", 3);
        std::fs::write(dir.join("config.json"), r#"{"thinker_config": {"text_config": {"model_type": "qwen3_omni_moe_text",
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 40,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": true,
            "decoder_sparse_step": 1, "mlp_only_layers": [0],
            "rope_scaling": {"mrope_section": [2, 1, 1], "interleaved": true}}}}"#).unwrap();
        // `auto` keeps the checkpoint's bf16; f32 on request widens it.
        let loaded = Thinker::from_dir(&CpuBackend, &dir).unwrap();
        assert_eq!((loaded.config(), loaded.dtype()), (&cfg, Dtype::Bf16));
        let widened = Thinker::from_dir_as(&CpuBackend, &dir, Some(Dtype::F32)).unwrap();
        assert_eq!(widened.dtype(), Dtype::F32);
        assert!(widened.weight_bytes() > loaded.weight_bytes() * 3 / 2, "bf16 matrices take half the bytes");
        let mut rounded = MemorySource::new();
        for n in src.names() {
            let t = src.load(n).unwrap();
            let data = t.data.iter().map(|v| half::bf16::from_f32(*v).to_f32()).collect();
            rounded.insert(n, HostTensor { shape: t.shape, data });
        }
        // The same values through the same kernels: bit-equal in each dtype.
        let reference = Thinker::load_as(&CpuBackend, cfg.clone(), &rounded, Some(Dtype::Bf16)).unwrap();
        assert_eq!(logits_of(&loaded), logits_of(&reference));
        assert_eq!(logits_of(&widened), logits_of(&Thinker::load(&CpuBackend, cfg, &rounded).unwrap()));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_shared_expert_adds_under_its_gate_and_a_zero_one_adds_nothing() {
        let mut cfg = tiny();
        if let Some(m) = cfg.moe.as_mut() {
            m.shared_expert_intermediate_size = 8;
        }
        let src = random_source(&cfg, 6).unwrap();
        let shared = Thinker::load(&CpuBackend, cfg.clone(), &src).unwrap();
        let mut plain_src = src.clone();
        let mut zeroed = src.clone();
        for leaf in [
            "shared_expert.gate_proj.weight",
            "shared_expert.up_proj.weight",
            "shared_expert.down_proj.weight",
            "shared_expert_gate.weight",
        ] {
            let name = format!("model.layers.1.mlp.{leaf}");
            let t = plain_src.remove(&name).unwrap();
            if leaf.starts_with("shared_expert.down") {
                zeroed.insert(name, HostTensor { data: vec![0.0; t.data.len()], shape: t.shape });
            }
        }
        let mut plain_cfg = cfg.clone();
        if let Some(m) = plain_cfg.moe.as_mut() {
            m.shared_expert_intermediate_size = 0;
        }
        let plain = Thinker::load(&CpuBackend, plain_cfg, &plain_src).unwrap();
        let zero = Thinker::load(&CpuBackend, cfg, &zeroed).unwrap();
        assert_eq!(logits_of(&zero), logits_of(&plain));
        assert_ne!(logits_of(&shared), logits_of(&plain));
    }

    #[test]
    fn fused_v5_expert_layout_equals_per_expert_layout() {
        let cfg = tiny();
        let src = random_source(&cfg, 4).unwrap();
        let mut fused = src.clone();
        let (e, h, inter) = (4, 32, 16);
        let mut gate_up = Vec::new();
        let mut down = Vec::new();
        for x in 0..e {
            for part in ["gate_proj", "up_proj"] {
                gate_up.extend(
                    fused.remove(&format!("model.layers.1.mlp.experts.{x}.{part}.weight")).unwrap().data,
                );
            }
            down.extend(
                fused.remove(&format!("model.layers.1.mlp.experts.{x}.down_proj.weight")).unwrap().data,
            );
        }
        fused.insert(
            "model.layers.1.mlp.experts.gate_up_proj",
            HostTensor { shape: vec![e, 2 * inter, h], data: gate_up },
        );
        fused.insert(
            "model.layers.1.mlp.experts.down_proj",
            HostTensor { shape: vec![e, h, inter], data: down },
        );
        let a = Thinker::load(&CpuBackend, cfg.clone(), &src).unwrap();
        let b = Thinker::load(&CpuBackend, cfg, &fused).unwrap();
        assert_eq!(logits_of(&a), logits_of(&b));
    }

    #[test]
    fn safetensors_f16_converts_and_bad_files_are_typed_errors() {
        let dir = scratch_dir("bad");
        let ints: Vec<u8> = [1i32, 2, 3, 4].iter().flat_map(|v| v.to_le_bytes()).collect();
        let halves: Vec<u8> =
            [0.5f32, -2.0].iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect();
        let views = [
            ("model.norm.weight", StView::new(safetensors::Dtype::I32, vec![4], &ints).unwrap()),
            ("model.half", StView::new(safetensors::Dtype::F16, vec![2, 1], &halves).unwrap()),
        ];
        let path = dir.join("model.safetensors");
        safetensors::serialize_to_file(views, &None, &path).unwrap();
        let src = SafetensorsSource::open_dir(&dir).unwrap();
        assert!(
            matches!(src.load("model.norm.weight"), Err(Error::Checkpoint(CheckpointError::TensorDtype { found, .. })) if found == "I32")
        );
        assert_eq!(src.load("model.half").unwrap(), HostTensor { shape: vec![2, 1], data: vec![0.5, -2.0] });
        assert!(
            matches!(src.load("model.nope"), Err(Error::Checkpoint(CheckpointError::MissingTensor { name })) if name == "model.nope")
        );
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        assert!(matches!(
            SafetensorsSource::open_dir(&dir),
            Err(Error::Checkpoint(CheckpointError::Safetensors { .. }))
        ));
        let empty = scratch_dir("empty");
        assert!(matches!(SafetensorsSource::open_dir(&empty), Err(Error::Io(IoError { .. }))));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::remove_dir_all(&empty).ok();
    }
}
