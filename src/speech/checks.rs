//! What a request asking for audio is checked against before it is admitted:
//! the talker's speakers and the chat ids its prompt is cut by. Plain data, so
//! the engine's preparer (shared with caller threads) needs no model.

use std::collections::BTreeMap;

use crate::Result;
use crate::error::RequestError;
use crate::prompt::{CanonicalPrompt, OmniTokens};

use super::layout::TalkerLayout;
use super::options::SpeechOptions;
use super::turns::ChatIds;

/// A request's speech, checked: its options, the talker prompt's layout over
/// its thinker prompt, and the speaker's codec id.
#[derive(Debug, Clone)]
pub struct CheckedSpeech {
    pub options: SpeechOptions,
    pub layout: TalkerLayout,
    pub speaker_id: u32,
}

/// The checks of a checkpoint with a talker.
#[derive(Debug, Clone)]
pub struct SpeechChecks {
    pub(super) chat: ChatIds,
    /// Speaker names (lower case) → codec ids.
    pub(super) speakers: BTreeMap<String, u32>,
    /// The talker pool's block size and blocks, when requests must fit it.
    pub(super) pool: Option<(usize, usize)>,
}

impl SpeechChecks {
    /// The same checks, with requests held to a talker pool of `num_blocks`
    /// blocks of `block_size` rows.
    pub fn with_pool(self, block_size: usize, num_blocks: usize) -> Self {
        SpeechChecks { pool: Some((block_size, num_blocks)), ..self }
    }

    /// The codec id of `speaker` (case-insensitive, as HF looks it up); an
    /// unknown one is [`RequestError::UnknownSpeaker`] listing the known ones.
    pub fn speaker_id(&self, speaker: &str) -> Result<u32> {
        self.speakers.get(&speaker.to_lowercase()).copied().ok_or_else(|| {
            RequestError::UnknownSpeaker {
                speaker: speaker.to_string(),
                known: self.speakers.keys().cloned().collect(),
            }
            .into()
        })
    }

    /// Checks `options` for `prompt` (a generation's): the speaker is known, the
    /// talker's sampling is in range, the prompt opens an assistant turn, and
    /// the talker's prompt and reply fit its pool. The error names what is
    /// wrong ([`RequestError::UnknownSpeaker`], [`RequestError::InvalidSampling`],
    /// [`RequestError::NoAssistantTurn`], [`RequestError::RequestTooLarge`]).
    pub fn check(
        &self, options: &SpeechOptions, prompt: &CanonicalPrompt, tokens: &OmniTokens,
    ) -> Result<CheckedSpeech> {
        let speaker_id = self.speaker_id(&options.speaker)?;
        options.check()?;
        let layout = TalkerLayout::of(prompt, &self.chat, tokens)?;
        if let Some((block_size, num_blocks)) = self.pool {
            let rows = layout.prefill_rows() + options.talker.max_new_tokens - 1;
            let needed = rows.div_ceil(block_size.max(1));
            if needed > num_blocks {
                return Err(RequestError::RequestTooLarge { id: None, needed, num_blocks }.into());
            }
        }
        Ok(CheckedSpeech { options: options.clone(), layout, speaker_id })
    }
}
