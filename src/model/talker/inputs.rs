//! What a talker run takes (the prompt rows, their positions, the rows its decode
//! steps add) and what it produces (the codec codes and the rows beside them): the
//! types [`step`](crate::model::talker::step) and [`generate`](crate::model::talker::generate) share.

use ndarray::Array2;

use crate::batch::RequestId;
use crate::error::RunnerError;
use crate::sample::FinishReason;
use crate::{Error, Result};

/// The talker prompt and what its decode steps add (HF `talker.generate`'s
/// `inputs_embeds`, 3-D positions, `trailing_text_hidden`, `tts_pad_embed`).
#[derive(Debug, Clone)]
pub struct TalkerInputs {
    /// Prefill rows `[rows, hidden]`.
    pub embeds: Array2<f32>,
    /// The (temporal, height, width) rotary position of each prefill row.
    pub positions: Vec<[i64; 3]>,
    /// Decode row at sequence index `p` has position `p + rope_delta` on every axis.
    pub rope_delta: i64,
    /// `[n, hidden]`: decode step `s` adds row `s` while `s < n`...
    pub trailing_text_hidden: Array2<f32>,
    /// ...and this `[1, hidden]` row after that.
    pub tts_pad_embed: Array2<f32>,
}

impl TalkerInputs {
    /// Inputs with 1-D positions `0..rows` (a prompt without multimodal items).
    pub fn linear(
        embeds: Array2<f32>, trailing_text_hidden: Array2<f32>, tts_pad_embed: Array2<f32>,
    ) -> Self {
        let positions = (0..embeds.nrows() as i64).map(|p| [p; 3]).collect();
        TalkerInputs { embeds, positions, rope_delta: 0, trailing_text_hidden, tts_pad_embed }
    }

    /// Widths and lengths against a talker `hidden` wide; errors name `request`.
    pub(super) fn check(&self, request: RequestId, hidden: usize) -> Result<()> {
        let bad = |what: String| Err(Error::Runner(RunnerError::InvalidBatch { request, what }));
        let rows = self.embeds.nrows();
        if rows == 0 {
            return bad("the talker prompt has no rows".into());
        }
        if self.positions.len() != rows {
            return bad(format!("{} positions for {rows} talker prompt rows", self.positions.len()));
        }
        for (what, m, n) in [
            ("talker prompt", &self.embeds, None),
            ("trailing_text_hidden", &self.trailing_text_hidden, None),
            ("tts_pad_embed", &self.tts_pad_embed, Some(1)),
        ] {
            if m.ncols() != hidden || n.is_some_and(|n| m.nrows() != n) {
                return bad(format!("{what} is {:?}, the talker is {hidden} wide", m.shape()));
            }
        }
        Ok(())
    }
}

/// What a talker run produced.
#[derive(Debug, Clone)]
pub struct TalkerOutput {
    /// Codec codes `[num_code_groups, frames]`: column `f` is frame `f`, row 0 the
    /// talker's code, rows `1..` the code predictor's (what code2wav takes).
    pub codes: Array2<u32>,
    /// The talker's final-normed hidden row each frame's code predictor started from, `[frames, hidden]`.
    pub past_hidden: Array2<f32>,
    /// The decode row fed back after each frame, `[frames, hidden]`.
    pub step_embeds: Array2<f32>,
    /// Every first code the talker sampled, the last one (EOS or the one at the
    /// length limit, which gets no frame) included.
    pub sampled: Vec<u32>,
    /// `Stop` when the talker sampled the codec EOS, `Length` at `max_new_tokens`.
    pub finish: FinishReason,
}
