//! The Qwen3-Omni talker: the thinker's decoder layers under `talker.model` (a
//! Qwen3-MoE with shared experts over `codec_embedding`, `codec_head` on top), the
//! text and hidden projections that turn thinker rows into talker rows, and the
//! code predictor that completes each frame. [`Talker::generate`] produces the
//! codec codes `[num_code_groups, frames]` code2wav turns into audio, frame by frame;
//! [`Talker::step`] advances many [`TalkerSeq`](crate::model::talker::TalkerSeq)s one frame each in one batched
//! forward, for an engine interleaving the talker with the thinker.

/// The code predictor (residual codes of a frame).
pub mod code_predictor;
/// The talker's config from an Omni `config.json`.
pub mod config;
/// The frame loop: prefill, sample, predict, feed back.
pub mod generate;
/// What a talker run takes and produces.
pub mod inputs;
/// The talker a step at a time, batched, trailing text arriving as the thinker makes it.
pub mod step;
#[cfg(test)]
mod tests;

use std::path::Path;
use std::sync::{Arc, Mutex};

use ndarray::Array2;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::Result;
use crate::backend::{Backend, Dtype};
use crate::model::identity::Recording;
use crate::model::thinker::{Thinker, WeightNames, random_source as decoder_source};
use crate::model::{HostTensor, MemorySource, SafetensorsSource, WeightSource, Weights};
use crate::tier::ModelId;

pub use code_predictor::{CodePredictor, Prediction};
pub use config::TalkerConfig;
pub use generate::TalkerKv;
pub use inputs::{TalkerInputs, TalkerOutput};
pub use step::{TalkerBlocks, TalkerSeq};

/// HF `Qwen3OmniMoeTalkerResizeMLP`: `fc2(silu(fc1 x + b1)) + b2`, thinker width → talker width.
struct ResizeMlp<T, W> {
    fc1: W,
    b1: T,
    fc2: W,
    b2: T,
}

/// A loaded talker: config, decoder, projections and code predictor on one backend.
///
/// ```
/// use std::sync::Arc;
/// use ndarray::Array2;
/// use omniprefix::backend::cpu::CpuBackend;
/// use omniprefix::model::talker::{Talker, TalkerConfig, TalkerInputs};
/// use omniprefix::sample::TalkerSampling;
///
/// let backend = Arc::new(CpuBackend::new());
/// let talker = Talker::random(&*backend, TalkerConfig::tiny(), 3)?;
/// // Thinker rows [n, thinker_hidden] → talker rows [n, hidden].
/// let rows = talker.project_text(&*backend, &Array2::from_elem((5, 24), 0.1))?;
/// let inputs = TalkerInputs::linear(rows, Array2::zeros((2, 32)), Array2::zeros((1, 32)));
/// let sampling = TalkerSampling { max_new_tokens: 4, ..TalkerSampling::greedy() };
/// let mut streamed = 0;
/// let out = talker.generate(&backend, &inputs, &sampling, |frame: &[u32]| {
///     assert_eq!(frame.len(), 16);
///     streamed += 1;
///     Ok(())
/// })?;
/// assert_eq!(out.codes.nrows(), 16);
/// assert_eq!(out.codes.ncols(), streamed);
/// # Ok::<(), omniprefix::Error>(())
/// ```
pub struct Talker<B: Backend> {
    config: TalkerConfig,
    text_projection: ResizeMlp<B::Tensor, B::Weight>,
    hidden_projection: ResizeMlp<B::Tensor, B::Weight>,
    model: Arc<Thinker<B>>,
    code_predictor: CodePredictor<B>,
    /// The code predictor's pages between steps: a frame's KV is scratch (each
    /// frame rewrites positions `0..num_code_groups` before reading them), so one
    /// set serves every seq, allocated once rather than per step.
    predictor_pages: Mutex<Option<B::Pages>>,
    identity: ModelId,
}

impl<B: Backend> Talker<B> {
    /// Loads the `talker_config` of `dir/config.json` and the `talker.*` weights of its
    /// safetensors checkpoint, matrices in the checkpoint's own dtype where the backend stores it.
    pub fn from_dir(backend: &B, dir: &Path) -> Result<Self> {
        let config = TalkerConfig::from_dir(dir)?;
        let source = SafetensorsSource::open_dir(dir)?;
        Self::load(backend, config, &source, None)
    }

    /// Loads every `talker.*` weight `config` implies from `source`, shape-checked
    /// (names as HF's: `talker.model.layers.N...`, `talker.codec_head`,
    /// `talker.text_projection.linear_fc1`, `talker.code_predictor.lm_head.N`).
    pub fn load(
        backend: &B, config: TalkerConfig, source: &dyn WeightSource, dtype: Option<Dtype>,
    ) -> Result<Self> {
        config.validate()?;
        // Every talker weight read goes into the identity its tier files carry.
        let recording = Recording::new(source);
        let source: &dyn WeightSource = &recording;
        let names = WeightNames::new("talker.model", "codec_embedding", "talker.codec_head");
        let model = Thinker::load_named(backend, config.text.clone(), source, dtype, &names)?;
        let dtype = Some(model.dtype());
        let code_predictor = CodePredictor::load(
            backend,
            config.code_predictor.clone(),
            source,
            dtype,
            config.num_code_groups,
        )?;
        let resize = |name: &str| -> Result<ResizeMlp<B::Tensor, B::Weight>> {
            let w = Weights::root(source, "talker").pp(name);
            let (inner, outer, hidden) =
                (config.text.intermediate_size, config.thinker_hidden_size, config.text.hidden_size);
            let d = model.dtype();
            Ok(ResizeMlp {
                fc1: backend.upload_weight(w.pp("linear_fc1").weight("weight", inner, outer, d)?)?,
                b1: backend.upload(w.pp("linear_fc1").vector("bias", inner)?.view())?,
                fc2: backend.upload_weight(w.pp("linear_fc2").weight("weight", hidden, inner, d)?)?,
                b2: backend.upload(w.pp("linear_fc2").vector("bias", hidden)?.view())?,
            })
        };
        let (text_projection, hidden_projection) = (resize("text_projection")?, resize("hidden_projection")?);
        let identity =
            recording.identity(&[format!("{config:?}").as_bytes(), model.dtype().name().as_bytes()]);
        Ok(Talker {
            text_projection,
            hidden_projection,
            model: Arc::new(model),
            code_predictor,
            predictor_pages: Mutex::new(None),
            identity,
            config,
        })
    }

    /// A digest of the config and every talker weight read (see
    /// [`Thinker::identity`]): what the disk tier's talker files carry.
    pub fn identity(&self) -> ModelId {
        self.identity
    }

    /// A talker with seeded random weights (see [`random_source`]).
    pub fn random(backend: &B, config: TalkerConfig, seed: u64) -> Result<Self> {
        let source = random_source(&config, seed)?;
        Self::load(backend, config, &source, None)
    }

    /// The config.
    pub fn config(&self) -> &TalkerConfig {
        &self.config
    }

    /// The talker decoder (its layers, `codec_embedding` as the embedding, `codec_head` as the head).
    pub fn model(&self) -> &Arc<Thinker<B>> {
        &self.model
    }

    /// The code predictor.
    pub fn code_predictor(&self) -> &CodePredictor<B> {
        &self.code_predictor
    }

    /// HF `talker.text_projection` of thinker *embeddings* `[n, thinker_hidden]` →
    /// `[n, hidden]`: text rows of the talker prompt, `trailing_text_hidden` and the
    /// `tts_*` embeds.
    pub fn project_text(&self, backend: &B, thinker_embeds: &Array2<f32>) -> Result<Array2<f32>> {
        self.project(backend, &self.text_projection, thinker_embeds)
    }

    /// HF `talker.hidden_projection` of thinker hidden rows (layer
    /// `accept_hidden_layer`) `[n, thinker_hidden]` → `[n, hidden]`: the multimodal
    /// rows of the talker prompt.
    pub fn project_hidden(&self, backend: &B, thinker_rows: &Array2<f32>) -> Result<Array2<f32>> {
        self.project(backend, &self.hidden_projection, thinker_rows)
    }

    fn project(
        &self, backend: &B, mlp: &ResizeMlp<B::Tensor, B::Weight>, x: &Array2<f32>,
    ) -> Result<Array2<f32>> {
        let x = backend.upload(x.view())?;
        let mut h = backend.matmul_t(&x, &mlp.fc1)?;
        backend.add_bias(&mut h, &mlp.b1)?;
        let mut out = backend.matmul_t(&backend.silu(&h)?, &mlp.fc2)?;
        backend.add_bias(&mut out, &mlp.b2)?;
        backend.download(&out)
    }

    /// The code predictor's scratch pages: the kept ones, or new ones when another
    /// step holds them.
    fn take_predictor_pages(&self, backend: &B, frames: usize) -> Result<B::Pages> {
        let kept = self.predictor_pages.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        match kept {
            Some(pages) if self.code_predictor.pages_hold(backend, &pages, frames) => Ok(pages),
            _ => self.code_predictor.alloc_pages(backend, frames),
        }
    }

    /// Keeps the code predictor's scratch pages for the next step.
    fn put_predictor_pages(&self, pages: B::Pages) {
        *self.predictor_pages.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(pages);
    }

    /// The talker's codec embeddings of `ids` `[ids.len(), hidden]` (HF
    /// `talker.get_input_embeddings()`): the codec half of the assistant prompt.
    pub fn codec_embed(&self, backend: &B, ids: &[u32]) -> Result<Array2<f32>> {
        backend.download(&self.model.embed(backend, ids)?)
    }
}

/// Seeded random `talker.*` weights for `config` under HF names: the decoders'
/// from [`crate::model::random_source`], renamed, plus the predictor's further
/// groups and the two projections.
pub fn random_source(config: &TalkerConfig, seed: u64) -> Result<MemorySource> {
    let mut out = MemorySource::new();
    let mut rename = |src: MemorySource, model: &str, embed: &str, head: &str| -> Result<()> {
        for name in src.names() {
            let tensor = src.load(name)?;
            let renamed = match name {
                "model.embed_tokens.weight" => format!("{model}.{embed}.weight"),
                "lm_head.weight" => format!("{head}.weight"),
                other => format!("{model}.{}", other.trim_start_matches("model.")),
            };
            out.insert(renamed, tensor);
        }
        Ok(())
    };
    rename(decoder_source(&config.text, seed)?, "talker.model", "codec_embedding", "talker.codec_head")?;
    let cp = &config.code_predictor;
    rename(
        decoder_source(cp, seed.wrapping_add(1))?,
        "talker.code_predictor.model",
        "codec_embedding.0",
        "talker.code_predictor.lm_head.0",
    )?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_add(2));
    let mut put = |name: String, shape: Vec<usize>, scale: f32| {
        let n = shape.iter().product();
        let data = (0..n).map(|_| scale * (rng.random::<f32>() * 2.0 - 1.0)).collect();
        out.insert(name, HostTensor { shape, data });
    };
    let (vocab, h) = (cp.vocab_size, cp.hidden_size);
    for g in 1..config.num_code_groups.saturating_sub(1) {
        put(format!("talker.code_predictor.model.codec_embedding.{g}.weight"), vec![vocab, h], 1.0);
        put(format!("talker.code_predictor.lm_head.{g}.weight"), vec![vocab, h], 1.0 / (h as f32).sqrt());
    }
    let (inner, outer, hidden) =
        (config.text.intermediate_size, config.thinker_hidden_size, config.text.hidden_size);
    for p in ["text_projection", "hidden_projection"] {
        put(format!("talker.{p}.linear_fc1.weight"), vec![inner, outer], 1.0 / (outer as f32).sqrt());
        put(format!("talker.{p}.linear_fc1.bias"), vec![inner], 0.1);
        put(format!("talker.{p}.linear_fc2.weight"), vec![hidden, inner], 1.0 / (inner as f32).sqrt());
        put(format!("talker.{p}.linear_fc2.bias"), vec![hidden], 0.1);
    }
    Ok(out)
}
