//! The code predictor: a small dense decoder (the thinker's [`Thinker`] layers under
//! `talker.code_predictor.model`) that turns the talker's hidden state and first
//! code of a frame into the frame's other `num_code_groups - 1` codes, one per step,
//! each group with its own embedding table and head.

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
pub struct Prediction<T> {
    /// Codes of groups `1..num_code_groups`.
    pub codes: Vec<u32>,
    /// `Σ_g codec_embedding[g-1](codes[g])` over those groups, `[1, hidden]`.
    pub embed_sum: T,
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

    /// Pages for one frame's positions (`num_code_groups`), the predictor's own.
    pub fn alloc_pages(&self, backend: &B) -> Result<B::Pages> {
        let c = self.config();
        backend.alloc_pages(PagesSpec {
            num_layers: c.num_hidden_layers,
            num_blocks: self.groups.div_ceil(BLOCK),
            block_size: BLOCK,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            captured: 0,
            hidden: c.hidden_size,
            kv_dtype: Dtype::F32,
        })
    }

    /// Embedding of `code` in group `group` (1-based: group 1 is `codec_embedding.0`).
    fn embed(&self, backend: &B, group: usize, code: u32) -> Result<B::Tensor> {
        match group {
            1 => self.decoder.embed(backend, &[code]),
            g => backend.embedding(self.table(&self.embeds, g, "embedding group")?, &[code]),
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

    /// Runs rows `x` at positions `start..start + rows` over `pages` and returns the
    /// final-normed last row.
    fn forward(
        &self, backend: &B, mut x: B::Tensor, start: usize, pages: &mut B::Pages,
    ) -> Result<B::Tensor> {
        let rows = backend.shape(&x)[0];
        let positions: Vec<i64> = (start..start + rows).map(|p| p as i64).collect();
        let blocks: Vec<u32> = (0..self.groups.div_ceil(BLOCK) as u32).collect();
        let seqs = [AttnSeq { query_start: 0, num_new: rows, num_computed: start, block_table: &blocks }];
        let meta = StepMeta {
            positions: RopePositions { t: &positions, h: &positions, w: &positions },
            slots: &positions,
            seqs: &seqs,
        };
        for layer in 0..self.decoder.num_layers() {
            self.decoder.forward_layer(backend, layer, &mut x, &meta, pages)?;
        }
        let last = backend.gather_rows(&x, &[rows.saturating_sub(1) as u32])?;
        self.decoder.final_norm(backend, &last)
    }

    /// One frame (HF: `code_predictor.generate` of `[past_hidden, embed(code0)]`,
    /// `num_code_groups - 1` new tokens): a prefill of the talker's final-normed
    /// hidden row and its first code's embedding `code0_embed` (both `[1, hidden]`),
    /// then one step per further group, each sampling with `params` from its group's head.
    ///
    /// `embed_sum` starts at `code0_embed` and adds every predicted code's embedding in
    /// group order, as HF sums the frame's codec embeddings.
    pub fn predict(
        &self, backend: &B, past_hidden: &B::Tensor, code0_embed: &B::Tensor, pages: &mut B::Pages,
        params: &SamplingParams, sampler: &mut Sampler,
    ) -> Result<Prediction<B::Tensor>> {
        let hidden = self.config().hidden_size;
        let mut x = backend.upload(ndarray::Array2::zeros((2, hidden)).view())?;
        backend.scatter_rows(&mut x, &[0], past_hidden)?;
        backend.scatter_rows(&mut x, &[1], code0_embed)?;
        let mut embed_sum = backend.upload(backend.download(code0_embed)?.view())?;
        let mut codes = Vec::with_capacity(self.groups - 1);
        let mut normed = self.forward(backend, x, 0, pages)?;
        for group in 1..self.groups {
            let logits = backend.download(&self.logits(backend, group, &normed)?)?;
            let code = sampler.sample(logits.as_slice().unwrap_or(&[]), params, &[]);
            codes.push(code);
            let e = self.embed(backend, group, code)?;
            backend.add(&mut embed_sum, &e)?;
            if group + 1 < self.groups {
                normed = self.forward(backend, e, group + 1, pages)?;
            }
        }
        Ok(Prediction { codes, embed_sum })
    }
}
