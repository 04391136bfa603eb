//! The talker stage after a thinker reply: the talker's prompt built from the
//! thinker's rows (HF `Qwen3OmniMoeForConditionalGeneration.generate`), the
//! talker's frames, and code2wav streaming them to audio as they come.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ndarray::{Array2, ArrayView2, Axis, concatenate, s};

use crate::Result;
use crate::backend::Backend;
use crate::error::{BackendError, RequestError};
use crate::model::code2wav::Code2Wav;
use crate::model::config::{parse_json, read_text};
use crate::model::talker::{Talker, TalkerInputs};
use crate::model::{CaptureName, Thinker};
use crate::sample::FinishReason;

use super::checks::SpeechChecks;
use super::layout::TalkerLayout;
use super::turns::ChatIds;

/// A spoken reply.
#[derive(Debug, Clone)]
pub struct Speech {
    /// Codec codes `[num_code_groups, frames]`.
    pub codes: Array2<u32>,
    /// Mono audio at [`sample_rate`](Self::sample_rate).
    pub audio: Vec<f32>,
    pub sample_rate: u32,
    /// Rows of the talker's prefill (the user rows and the assistant rows).
    pub talker_prompt_rows: usize,
    /// Prefill rows whose talker KV was reused.
    pub talker_cached_rows: usize,
    /// `Stop` at the codec EOS, `Length` at the talker's `max_new_tokens`.
    pub finish: FinishReason,
    /// From the request's start to its first audio chunk (its time to first audio); `None`
    /// when the reply made no audio.
    pub first_audio: Option<Duration>,
}

/// The talker and code2wav of a full Omni checkpoint, with the thinker whose
/// embeddings frame the talker's prompt.
pub struct SpeechStage<B: Backend> {
    backend: Arc<B>,
    thinker: Arc<Thinker<B>>,
    talker: Talker<B>,
    code2wav: Arc<Code2Wav<B>>,
    chat: ChatIds,
}

impl<B: Backend> SpeechStage<B> {
    /// Loads the talker and code2wav of the checkpoint in `dir`, beside its
    /// loaded `thinker`. A checkpoint without them (no `talker_config`, or
    /// `enable_audio_output: false`) is [`RequestError::NoTalker`].
    pub fn from_dir(backend: Arc<B>, thinker: Arc<Thinker<B>>, dir: &Path) -> Result<Self> {
        let root = read_config(dir)?;
        if !has_talker(&root) {
            return Err(RequestError::NoTalker { model: dir.display().to_string() }.into());
        }
        let chat = ChatIds::from_config(&root)?;
        let talker = Talker::from_dir(&*backend, dir)?;
        let code2wav = Code2Wav::from_dir(&*backend, dir)?;
        Ok(SpeechStage::new(backend, thinker, talker, code2wav, chat))
    }

    /// A stage over loaded parts (e.g. seeded random ones, for benches): `chat`
    /// are the thinker's ids that frame the talker's prompt.
    pub fn new(
        backend: Arc<B>, thinker: Arc<Thinker<B>>, talker: Talker<B>, code2wav: Code2Wav<B>, chat: ChatIds,
    ) -> Self {
        SpeechStage { backend, thinker, talker, code2wav: Arc::new(code2wav), chat }
    }

    /// Whether the checkpoint in `dir` has a talker (and code2wav) switched on.
    pub fn in_checkpoint(dir: &Path) -> Result<bool> {
        Ok(has_talker(&read_config(dir)?))
    }

    /// The chat ids the talker's prompt is cut by.
    pub fn chat_ids(&self) -> &ChatIds {
        &self.chat
    }

    /// The thinker capture the talker reads at item rows (HF `accept_hidden_layer`).
    pub fn accept_capture(&self) -> CaptureName {
        CaptureName::Hidden(self.talker.config().accept_hidden_layer)
    }

    /// The talker.
    pub fn talker(&self) -> &Talker<B> {
        &self.talker
    }

    /// The vocoder.
    pub fn code2wav(&self) -> &Code2Wav<B> {
        &self.code2wav
    }

    /// The vocoder, shared (a stream per speaking request holds it).
    pub fn code2wav_shared(&self) -> Arc<Code2Wav<B>> {
        Arc::clone(&self.code2wav)
    }

    /// The backend the stage runs on.
    pub fn backend(&self) -> Arc<B> {
        Arc::clone(&self.backend)
    }

    /// What a request asking for audio is checked against.
    pub fn checks(&self) -> SpeechChecks {
        let speakers = self.talker.config().speaker_id.iter().map(|(k, v)| (k.to_lowercase(), *v)).collect();
        SpeechChecks { chat: self.chat, speakers, pool: None }
    }

    /// The talker's projection of thinker text ids (HF `text_projection` of the
    /// thinker's embeddings): user text rows, the assistant opening and the
    /// `trailing_text_hidden` rows a reply's tokens become.
    pub fn text_rows(&self, ids: &[u32]) -> Result<Array2<f32>> {
        let b = &*self.backend;
        let embeds = b.download(&self.thinker.embed(b, ids)?)?;
        self.talker.project_text(b, &embeds)
    }

    /// The `tts_eos` row that follows a reply's last trailing row.
    pub fn tts_eos_row(&self) -> Result<Array2<f32>> {
        self.text_rows(&[self.chat.tts_eos_token_id])
    }

    /// The assistant turn as HF slices it: the thinker ids from the last
    /// `<|im_start|>assistant` of the prompt on, then the reply. Its first 4 ids
    /// open the talker's prompt; ids `4..` that ran become trailing rows.
    pub fn assistant_ids(layout: &TalkerLayout, prompt_ids: &[u32], reply: &[u32]) -> Vec<u32> {
        prompt_ids[layout.assistant_start.min(prompt_ids.len())..].iter().chain(reply).copied().collect()
    }

    /// The talker's prompt (HF `_get_talker_user_parts` and
    /// `_get_talker_assistant_parts`), with no trailing rows yet: `prompt_ids`
    /// the thinker prompt laid out as `layout`, `assistant` its
    /// [`assistant_ids`](Self::assistant_ids) (at least 4), `accept_rows` the
    /// thinker's [`accept_capture`](Self::accept_capture) rows of at least the
    /// prompt's positions. The assistant turn's later ids become trailing rows
    /// ([`text_rows`](Self::text_rows)) as they run.
    pub fn prompt_inputs(
        &self, layout: &TalkerLayout, prompt_ids: &[u32], assistant: &[u32],
        accept_rows: ArrayView2<'_, f32>, speaker_id: u32,
    ) -> Result<TalkerInputs> {
        let cfg = self.talker.config();
        let b = &*self.backend;
        if accept_rows.nrows() < prompt_ids.len() {
            let what =
                format!("{} accept-layer rows for a prompt of {}", accept_rows.nrows(), prompt_ids.len());
            return Err(crate::error::RunnerError::InvalidBatch { request: 0, what }.into());
        }
        // `<|im_start|>`, `assistant`, the newline, then the first reply token.
        let Some(opening) = assistant.get(..4) else {
            return Err(RequestError::ReplyTooShort { rows: assistant.len() }.into());
        };

        // User rows: text from its embedding, items from the accept layer.
        let hidden = cfg.text.hidden_size;
        let mut user = Array2::zeros((layout.user.len(), hidden));
        // (talker row, thinker position) of the item rows and of the text rows.
        let rows_where = |item: bool| -> Vec<(usize, usize)> {
            layout.user.iter().copied().enumerate().filter(|&(row, _)| layout.is_item[row] == item).collect()
        };
        let (items, texts) = (rows_where(true), rows_where(false));
        if !texts.is_empty() {
            let ids: Vec<u32> = texts.iter().map(|&(_, p)| prompt_ids[p]).collect();
            for (&(row, _), projected) in texts.iter().zip(self.text_rows(&ids)?.rows()) {
                user.row_mut(row).assign(&projected);
            }
        }
        if !items.is_empty() {
            let rows = Array2::from_shape_fn((items.len(), accept_rows.ncols()), |(i, c)| {
                accept_rows[[items[i].1, c]]
            });
            for (&(row, _), projected) in items.iter().zip(self.talker.project_hidden(b, &rows)?.rows()) {
                user.row_mut(row).assign(&projected);
            }
        }

        let tts = self.text_rows(&[self.chat.tts_bos_token_id, self.chat.tts_pad_token_id])?;
        let (tts_bos, tts_pad) = (tts.slice(s![0..1, ..]), tts.slice(s![1..2, ..]));
        let opening = self.text_rows(opening)?;
        let pads = stack_rows(&[tts_pad; 4])?;
        let assistant_text =
            stack_rows(&[opening.slice(s![0..3, ..]), pads.view(), tts_bos, opening.slice(s![3..4, ..])])?;
        let codec = self.talker.codec_embed(
            b,
            &[
                cfg.codec_nothink_id,
                cfg.codec_think_bos_id,
                cfg.codec_think_eos_id,
                speaker_id,
                cfg.codec_pad_id,
                cfg.codec_bos_id,
            ],
        )?;
        let mut assistant_rows = assistant_text;
        assistant_rows.slice_mut(s![3.., ..]).zip_mut_with(&codec, |a, c| *a += c);
        Ok(TalkerInputs {
            embeds: stack_rows(&[user.view(), assistant_rows.view()])?,
            positions: layout.positions.iter().collect(),
            rope_delta: layout.positions.rope_delta().unwrap_or(0),
            trailing_text_hidden: Array2::zeros((0, hidden)),
            tts_pad_embed: tts_pad.to_owned(),
        })
    }

    /// The talker's inputs for a whole thinker reply: [`prompt_inputs`](Self::prompt_inputs)
    /// and every trailing row, the reply's tokens that ran (all but its first and
    /// last), then `tts_eos`. A reply of fewer than 2 tokens is
    /// [`RequestError::ReplyTooShort`]: its first token never ran.
    pub fn inputs(
        &self, layout: &TalkerLayout, prompt_ids: &[u32], reply: &[u32], accept_rows: ArrayView2<'_, f32>,
        speaker_id: u32,
    ) -> Result<TalkerInputs> {
        let assistant = Self::assistant_ids(layout, prompt_ids, reply);
        // The last reply token never ran.
        let ran = assistant.len().saturating_sub(1);
        if ran < 4 {
            return Err(RequestError::ReplyTooShort { rows: ran }.into());
        }
        let mut inputs = self.prompt_inputs(layout, prompt_ids, &assistant, accept_rows, speaker_id)?;
        let eos = self.tts_eos_row()?;
        inputs.trailing_text_hidden = match ran > 4 {
            true => stack_rows(&[self.text_rows(&assistant[4..ran])?.view(), eos.view()])?,
            false => eos,
        };
        Ok(inputs)
    }
}

/// Rows of `parts` one after another; every part is the talker's width, so a
/// mismatch is an internal shape error, never a panic.
fn stack_rows(parts: &[ArrayView2<'_, f32>]) -> Result<Array2<f32>> {
    concatenate(Axis(0), parts).map_err(|_| {
        BackendError::OpShape {
            op: "talker prompt",
            what: "rows",
            expected: "one width".into(),
            found: parts.iter().map(|p| p.ncols()).collect(),
        }
        .into()
    })
}

/// The checkpoint's `config.json`.
fn read_config(dir: &Path) -> Result<serde_json::Value> {
    parse_json(&read_text(&dir.join("config.json"))?)
}

/// Whether a full Omni config carries a talker that is switched on.
fn has_talker(root: &serde_json::Value) -> bool {
    root.get("talker_config").is_some_and(|t| !t.is_null())
        && root.get("code2wav_config").is_some_and(|c| !c.is_null())
        && root.get("enable_audio_output").and_then(serde_json::Value::as_bool) != Some(false)
}
