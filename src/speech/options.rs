//! How a request asks for its reply to be spoken, and what makes those options
//! valid on their own (what needs the checkpoint is [`SpeechChecks`](crate::speech::SpeechChecks)).

use crate::Result;
use crate::error::RequestError;
use crate::sample::TalkerSampling;

/// How one reply is spoken.
#[derive(Debug, Clone, PartialEq)]
pub struct SpeechOptions {
    /// A speaker the checkpoint names (case-insensitive, as HF looks it up).
    pub speaker: String,
    /// The talker's sampling; the default is the checkpoint's (HF's).
    pub talker: TalkerSampling,
    /// Frames code2wav waits for before its first decode: a small first chunk
    /// is a short wait for the first audio.
    pub first_chunk: usize,
    /// Most frames a later decode waits for (chunks double up to it: see
    /// [`Code2WavStream`](crate::model::code2wav::Code2WavStream)).
    pub chunk: usize,
}

impl SpeechOptions {
    /// The talker's sampling in range and both chunk sizes positive; the error
    /// is [`RequestError::InvalidSampling`] naming the field.
    pub fn check(&self) -> Result<()> {
        self.talker.check()?;
        for (param, n) in [("first_chunk", self.first_chunk), ("chunk", self.chunk)] {
            if n == 0 {
                return Err(RequestError::InvalidSampling {
                    param,
                    expected: "at least 1 frame",
                    found: "0".into(),
                }
                .into());
            }
        }
        Ok(())
    }
}

impl Default for SpeechOptions {
    /// Speaker `ethan` (HF's default), HF's talker sampling, a first chunk of 1
    /// frame (the first audio needs the reply's first token only), then doubling
    /// chunks up to 25 frames.
    fn default() -> Self {
        SpeechOptions {
            speaker: "ethan".into(),
            talker: TalkerSampling::default(),
            first_chunk: 1,
            chunk: 25,
        }
    }
}
