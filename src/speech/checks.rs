//! What a request asking for audio is checked against before it is admitted:
//! the talker's speakers and the chat ids its prompt is cut by. Plain data, so
//! the engine's preparer (shared with caller threads) needs no model.

use std::collections::BTreeMap;

use crate::Result;
use crate::error::RequestError;
use crate::prompt::{CanonicalPrompt, OmniTokens};

use super::layout::TalkerLayout;
use super::stage::SpeechOptions;
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
}

impl SpeechChecks {
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
    /// talker's sampling is in range, and the prompt opens an assistant turn.
    /// The error names what is wrong ([`RequestError::UnknownSpeaker`],
    /// [`RequestError::InvalidSampling`], [`RequestError::NoAssistantTurn`]).
    pub fn check(
        &self, options: &SpeechOptions, prompt: &CanonicalPrompt, tokens: &OmniTokens,
    ) -> Result<CheckedSpeech> {
        let speaker_id = self.speaker_id(&options.speaker)?;
        options.check()?;
        let layout = TalkerLayout::of(prompt, &self.chat, tokens)?;
        Ok(CheckedSpeech { options: options.clone(), layout, speaker_id })
    }
}
