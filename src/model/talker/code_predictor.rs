//! The code predictor: a small dense decoder (the thinker's [`Thinker`] layers under
//! `talker.code_predictor.model`) that turns the talker's hidden state and first
//! code of a frame into the frame's other `num_code_groups - 1` codes, one per step,
//! each group with its own embedding table and head.

use ndarray::{Array2, ArrayView2};

use crate::Result;
use crate::backend::{AttnSeq, Backend, Dtype, PagesSpec, RopePositions};
use crate::error::BackendError;
use crate::model::thinker::{StepMeta, Thinker, WeightNames};
use crate::model::{Config, WeightSource, Weights};
use crate::sample::{Sampler, SamplingParams};

/// Block size of the predictor's own pages: one frame's positions.
const BLOCK: usize = 16;

/// The loaded code predictor (HF `Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration`).
pub struct CodePredictor<B: Backend> {
    /// The decoder; its embedding and head are group 1's (`codec_embedding.0`, `lm_head.0`).
    decoder: Thinker<B>,
    /// Embedding tables of groups 2.. (`codec_embedding.1..`).
    embeds: Vec<B::Weight>,
    /// Heads of groups 2.. (`lm_head.1..`).
    heads: Vec<B::Weight>,
    /// Codes per frame, the talker's first one included.
    groups: usize,
}

/// One frame's residual codes and what they add to the talker's next input.
pub struct Prediction {
    /// Codes of groups `1..num_code_groups`.
    pub codes: Vec<u32>,
    /// `Σ_g codec_embedding[g-1](codes[g])` over those groups, `[1, hidden]`.
    pub embed_sum: Array2<f32>,
}

impl<B: Backend> CodePredictor<B> {
    /// Loads `talker.code_predictor.*` for `groups` codes per frame, matrices as `dtype`.
    pub(crate) fn load(
        backend: &B, config: Config, source: &dyn WeightSource, dtype: Option<Dtype>, groups: usize,
    ) -> Result<Self> {
        let names = WeightNames::new(
            "talker.code_predictor.model",
            "codec_embedding.0",
            "talker.code_predictor.lm_head.0",
        );
        let decoder = Thinker::load_named(backend, config, source, dtype, &names)?;
        let c = decoder.config();
        let (vocab, hidden, dtype) = (c.vocab_size, c.hidden_size, decoder.dtype());
        let model = Weights::root(source, "talker.code_predictor.model");
        let heads_root = Weights::root(source, "talker.code_predictor.lm_head");
        let mut embeds = Vec::new();
        let mut heads = Vec::new();
        for g in 1..groups.saturating_sub(1) {
            let table = model.pp("codec_embedding").pp(g).weight("weight", vocab, hidden, dtype)?;
            embeds.push(backend.upload_weight(table)?);
            heads.push(backend.upload_weight(heads_root.pp(g).weight("weight", vocab, hidden, dtype)?)?);
        }
        Ok(CodePredictor { decoder, embeds, heads, groups })
    }

    /// The decoder's config.
    pub fn config(&self) -> &Config {
        self.decoder.config()
    }

    /// Blocks one frame's positions (`num_code_groups`) take.
    fn blocks_per_frame(&self) -> usize {
        self.groups.div_ceil(BLOCK)
    }

    /// Pages for `frames` frames predicted at once, the predictor's own.
    pub fn alloc_pages(&self, backend: &B, frames: usize) -> Result<B::Pages> {
        let c = self.config();
        backend.alloc_pages(PagesSpec {
            num_layers: c.num_hidden_layers,
            num_blocks: frames.max(1) * self.blocks_per_frame(),
            block_size: BLOCK,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            captured: 0,
            hidden: c.hidden_size,
            kv_dtype: Dtype::F32,
        })
    }

    /// Whether `pages` hold `frames` frames (from [`alloc_pages`](Self::alloc_pages)).
    pub fn pages_hold(&self, backend: &B, pages: &B::Pages, frames: usize) -> bool {
        backend.pages_spec(pages).num_blocks >= frames * self.blocks_per_frame()
    }

    /// Embeddings of `codes` in group `group` (1-based: group 1 is `codec_embedding.0`).
    fn embed(&self, backend: &B, group: usize, codes: &[u32]) -> Result<B::Tensor> {
        match group {
            1 => self.decoder.embed(backend, codes),
            g => backend.embedding(self.table(&self.embeds, g, "embedding group")?, codes),
        }
    }

    /// Logits of group `group` (1-based) of a final-normed row.
    fn logits(&self, backend: &B, group: usize, normed: &B::Tensor) -> Result<B::Tensor> {
        match group {
            1 => self.decoder.logits(backend, normed),
            g => backend.matmul_t(normed, self.table(&self.heads, g, "head group")?),
        }
    }

    fn table<'a>(&self, tables: &'a [B::Weight], group: usize, what: &'static str) -> Result<&'a B::Weight> {
        tables.get(group.wrapping_sub(2)).ok_or_else(|| {
            BackendError::OpIndex { op: "code_predictor", what, index: group as i64, bound: self.groups }
                .into()
        })
    }

    /// Runs `frames` frames' rows `x` (`rows` each, frame after frame) at positions
    /// `start..start + rows`, frame `i` in blocks `i·blocks_per_frame..`, over
    /// `pages`; returns each frame's final-normed last row `[frames, hidden]`.
    fn forward(
        &self, backend: &B, mut x: B::Tensor, frames: usize, start: usize, pages: &mut B::Pages,
    ) -> Result<B::Tensor> {
        let rows = backend.shape(&x)[0] / frames.max(1);
        let per = self.blocks_per_frame();
        let positions: Vec<i64> = (0..frames).flat_map(|_| (start..start + rows).map(|p| p as i64)).collect();
        let slots: Vec<i64> = (0..frames)
            .flat_map(|f| (start..start + rows).map(move |p| (f * per * BLOCK + p) as i64))
            .collect();
        let blocks: Vec<Vec<u32>> =
            (0..frames).map(|f| ((f * per) as u32..((f + 1) * per) as u32).collect()).collect();
        let seqs: Vec<AttnSeq<'_>> = blocks
            .iter()
            .enumerate()
            .map(|(f, table)| AttnSeq {
                query_start: f * rows,
                num_new: rows,
                num_computed: start,
                block_table: table,
            })
            .collect();
        let meta = StepMeta {
            positions: RopePositions { t: &positions, h: &positions, w: &positions },
            slots: &slots,
            seqs: &seqs,
        };
        for layer in 0..self.decoder.num_layers() {
            self.decoder.forward_layer(backend, layer, &mut x, &meta, pages)?;
        }
        let last: Vec<u32> = (1..=frames).map(|f| (f * rows).saturating_sub(1) as u32).collect();
        let last = backend.gather_rows(&x, &last)?;
        self.decoder.final_norm(backend, &last)
    }

    /// One frame of each of several talkers, every step one forward over all of
    /// them (HF: per talker, `code_predictor.generate` of `[past_hidden,
    /// embed(code0)]`, `num_code_groups - 1` new tokens): a prefill of each talker's
    /// final-normed hidden row `past[i]` and its first code's embedding
    /// `code0_embed[i]`, then one step per further group, frame `i` sampling with
    /// `params[i]` and `samplers[i]` from its group's head. A row's result does not
    /// depend on its batch, so each frame is what predicting it alone gives.
    ///
    /// Each `embed_sum` starts at the frame's `code0_embed` and adds every predicted
    /// code's embedding in group order, as HF sums the frame's codec embeddings.
    /// `pages` must hold the frames ([`pages_hold`](Self::pages_hold)).
    pub fn predict(
        &self, backend: &B, past: ArrayView2<'_, f32>, code0_embed: ArrayView2<'_, f32>,
        pages: &mut B::Pages, params: &[&SamplingParams], samplers: &mut [Sampler],
    ) -> Result<Vec<Prediction>> {
        let (frames, hidden) = (past.nrows(), self.config().hidden_size);
        if code0_embed.dim() != (frames, hidden)
            || past.ncols() != hidden
            || params.len() != frames
            || samplers.len() != frames
        {
            return Err(BackendError::OpShape {
                op: "code_predictor",
                what: "frames",
                expected: format!(
                    "[{frames}, {hidden}] rows, code0 embeddings, params and samplers for each"
                ),
                found: vec![code0_embed.nrows(), code0_embed.ncols(), params.len(), samplers.len()],
            }
            .into());
        }
        if frames == 0 {
            return Ok(Vec::new());
        }
        let x = Array2::from_shape_fn((2 * frames, hidden), |(r, c)| {
            if r % 2 == 0 { past[[r / 2, c]] } else { code0_embed[[r / 2, c]] }
        });
        let mut embed_sum = backend.upload(code0_embed)?;
        let mut codes = vec![Vec::with_capacity(self.groups - 1); frames];
        let mut normed = self.forward(backend, backend.upload(x.view())?, frames, 0, pages)?;
        for group in 1..self.groups {
            let logits = backend.download(&self.logits(backend, group, &normed)?)?;
            let mut step = Vec::with_capacity(frames);
            for (f, sampler) in samplers.iter_mut().enumerate() {
                let row = logits.row(f);
                let code = sampler.sample(row.as_slice().unwrap_or(&[]), params[f], &[]);
                codes[f].push(code);
                step.push(code);
            }
            let e = self.embed(backend, group, &step)?;
            backend.add(&mut embed_sum, &e)?;
            if group + 1 < self.groups {
                normed = self.forward(backend, e, frames, group + 1, pages)?;
            }
        }
        let sums = backend.download(&embed_sum)?;
        Ok(codes
            .into_iter()
            .zip(sums.outer_iter())
            .map(|(codes, sum)| Prediction { codes, embed_sum: sum.to_owned().insert_axis(ndarray::Axis(0)) })
            .collect())
    }
}
