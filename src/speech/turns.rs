//! Which thinker positions the talker reads, as transformers'
//! `Qwen3OmniMoeForConditionalGeneration.generate` picks them: every position of
//! every **user** turn (the system turn and earlier assistant turns are dropped),
//! then the last assistant turn, whose first three rows (`<|im_start|>assistant\n`)
//! and first reply token open the talker's prompt.
//!
//! A position belongs to the turn of the last `<|im_start|>` at or before it; the
//! turn's role is the id right after that `<|im_start|>` (HF reads it with a
//! cumulative max, and a position before any `<|im_start|>` takes position 0's
//! turn: the same rule here).

use serde::Deserialize;

use crate::Result;
use crate::error::{CheckpointError, RequestError};

/// The chat-template ids a full Omni config names at its root (HF
/// `Qwen3OmniMoeConfig`): the turn markers the talker's prompt is cut by and
/// the three text ids whose projections frame the spoken reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct ChatIds {
    /// `<|im_start|>`: opens every turn.
    pub im_start_token_id: u32,
    /// The role word of a user turn (`user`).
    pub user_token_id: u32,
    /// The role word of an assistant turn (`assistant`).
    pub assistant_token_id: u32,
    /// The text row of an assistant position with nothing to say yet.
    pub tts_pad_token_id: u32,
    /// The text row that opens speech.
    pub tts_bos_token_id: u32,
    /// The text row after the reply's last token.
    pub tts_eos_token_id: u32,
}

impl ChatIds {
    /// Small ids for tests over tiny vocabularies: `<|im_start|>` 1, `user` 2,
    /// `assistant` 3, `tts_pad` 7, `tts_bos` 8, `tts_eos` 9.
    #[doc(hidden)]
    pub const fn tiny() -> Self {
        ChatIds {
            im_start_token_id: 1,
            user_token_id: 2,
            assistant_token_id: 3,
            tts_pad_token_id: 7,
            tts_bos_token_id: 8,
            tts_eos_token_id: 9,
        }
    }

    /// The ids at the root of a full Omni `config.json`; a missing one is a
    /// [`CheckpointError::ConfigParse`] naming it.
    pub fn from_config(root: &serde_json::Value) -> Result<Self> {
        ChatIds::deserialize(root).map_err(|e| CheckpointError::ConfigParse(format!("chat ids: {e}")).into())
    }
}

/// The thinker positions behind a talker prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turns {
    /// Every user-turn position of the prompt, ascending.
    pub user: Vec<usize>,
    /// The position of the last `<|im_start|>` followed by `assistant` in the prompt.
    pub assistant_start: usize,
}

/// The turns of a thinker prompt `ids` (the prompt only, no reply).
///
/// A prompt with no `<|im_start|>assistant` opening, or whose last one is not
/// followed by a third token (the newline; the talker's prompt takes those three
/// rows, then the first reply token) is [`RequestError::NoAssistantTurn`]:
/// there is nothing to speak.
///
/// ```
/// use omniprefix::speech::{ChatIds, turns};
///
/// let ids = ChatIds { im_start_token_id: 1, user_token_id: 2, assistant_token_id: 3,
///                     tts_pad_token_id: 7, tts_bos_token_id: 8, tts_eos_token_id: 9 };
/// //              system turn   user turn      assistant opening
/// let prompt = [1, 4, 5, 6,     1, 2, 5, 6,    1, 3, 5];
/// let t = turns(&prompt, &ids)?;
/// assert_eq!(t.user, [4, 5, 6, 7]);
/// assert_eq!(t.assistant_start, 8);
/// # Ok::<(), omniprefix::Error>(())
/// ```
pub fn turns(ids: &[u32], chat: &ChatIds) -> Result<Turns> {
    let assistant_start = ids
        .windows(2)
        .rposition(|w| w[0] == chat.im_start_token_id && w[1] == chat.assistant_token_id)
        .filter(|&start| start + 3 <= ids.len())
        .ok_or(RequestError::NoAssistantTurn { prompt_len: ids.len() })?;
    let mut turn_start = 0;
    let mut user = Vec::new();
    for (pos, &id) in ids.iter().enumerate() {
        if id == chat.im_start_token_id {
            turn_start = pos;
        }
        let role = ids[(turn_start + 1).min(ids.len() - 1)];
        if role == chat.user_token_id {
            user.push(pos);
        }
    }
    Ok(Turns { user, assistant_start })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    const CHAT: ChatIds = ChatIds::tiny();

    /// HF's rule written as HF writes it: cumulative max of `<|im_start|>` positions
    /// (−1 elsewhere) clamped to 0, the role read one past it (clamped to the end).
    fn hf_user_mask(ids: &[u32]) -> Vec<usize> {
        let mut running = -1i64;
        let mut user = Vec::new();
        for (p, &id) in ids.iter().enumerate() {
            if id == CHAT.im_start_token_id {
                running = running.max(p as i64);
            }
            let prev = running.max(0) as usize;
            if ids[(prev + 1).min(ids.len() - 1)] == CHAT.user_token_id {
                user.push(p);
            }
        }
        user
    }

    #[test]
    fn user_positions_follow_hf_over_multi_round_chats() {
        let round1 = [1, 4, 5, 0, 1, 2, 6, 6, 0, 1, 3, 5, 6, 0];
        let round2 = [&round1[..], &[1, 2, 5, 5, 0, 1, 3, 5]].concat();
        let t = turns(&round2, &CHAT).unwrap();
        assert_eq!(t.user, hf_user_mask(&round2));
        assert_eq!(t.user, [4, 5, 6, 7, 8, 14, 15, 16, 17, 18]);
        assert_eq!(t.assistant_start, 19, "the last opening, not round 1's");
        // Text before any <|im_start|> takes position 0's turn, as in HF.
        let headless = [2, 5, 1, 2, 6, 1, 3, 5];
        assert_eq!(turns(&headless, &CHAT).unwrap().user, hf_user_mask(&headless));
    }

    #[test]
    fn a_prompt_without_an_assistant_opening_has_nothing_to_speak() {
        for prompt in [&[1, 2, 5, 6][..], &[1, 2, 5, 1, 3][..], &[][..]] {
            let err = turns(prompt, &CHAT).unwrap_err();
            assert!(
                matches!(err, Error::Request(RequestError::NoAssistantTurn { prompt_len }) if prompt_len == prompt.len()),
                "{prompt:?}: {err}"
            );
        }
    }

    #[test]
    fn chat_ids_come_from_the_config_root() {
        let root = serde_json::json!({"im_start_token_id": 1, "user_token_id": 2, "assistant_token_id": 3,
            "tts_pad_token_id": 7, "tts_bos_token_id": 8, "tts_eos_token_id": 9, "other": 0});
        assert_eq!(ChatIds::from_config(&root).unwrap(), CHAT);
        let missing = serde_json::json!({"im_start_token_id": 1});
        assert!(matches!(
            ChatIds::from_config(&missing),
            Err(Error::Checkpoint(CheckpointError::ConfigParse(_)))
        ));
    }
}
