//! The talker's prompt laid out over a thinker prompt: which thinker row each
//! talker row comes from, which of them are item rows, and the talker's own
//! rotary positions (M-RoPE over the user turns alone, as HF's talker computes
//! them from its input ids).

use crate::Result;
use crate::prompt::{Atom, CanonicalPrompt, OmniTokens, Positions, positions_from_atoms};

use super::turns::{ChatIds, turns};

/// Rows of the talker's prompt after the user rows: `<|im_start|>assistant\n`,
/// four `tts_pad`, `tts_bos`, the first reply token (HF
/// `_get_talker_assistant_parts`), 3 + 4 + 1 + 1.
pub const ASSISTANT_ROWS: usize = 9;

/// The talker prompt of one thinker prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct TalkerLayout {
    /// Thinker positions of the talker's user rows, ascending.
    pub user: Vec<usize>,
    /// Per user row: an item (placeholder) row, projected from the thinker's
    /// accept-layer hidden state, or a text row, projected from its embedding.
    pub is_item: Vec<bool>,
    /// The thinker position of the last `<|im_start|>assistant`.
    pub assistant_start: usize,
    /// The talker's input ids: the user rows' thinker ids, then
    /// [`ASSISTANT_ROWS`] `tts_pad` ids (what HF computes its positions from).
    pub ids: Vec<u32>,
    /// Rotary positions of the prefill ([`TalkerLayout::prefill_rows`] rows);
    /// decode row `k` (0-based, after the prefill) sits at
    /// `prefill_rows + k + rope_delta` on every axis.
    pub positions: Positions,
}

impl TalkerLayout {
    /// Rows of the talker's prefill: the user rows and the assistant rows.
    pub fn prefill_rows(&self) -> usize {
        self.user.len() + ASSISTANT_ROWS
    }

    /// The layout of `prompt` (the thinker's prompt, without its reply).
    ///
    /// Errors: [`RequestError::NoAssistantTurn`](crate::error::RequestError::NoAssistantTurn)
    /// when the prompt opens no assistant turn.
    pub fn of(prompt: &CanonicalPrompt, chat: &ChatIds, tokens: &OmniTokens) -> Result<Self> {
        let t = turns(&prompt.token_ids, chat)?;
        let mut user_atoms = Vec::new();
        let mut is_item = Vec::with_capacity(t.user.len());
        let mut next = t.user.iter().copied().peekable();
        let mut start = 0;
        for atom in &prompt.atoms {
            let end = start + atom.len();
            match atom {
                Atom::Text(ids) => {
                    let mut kept = Vec::new();
                    while let Some(pos) = next.next_if(|&p| p < end) {
                        kept.push(ids[pos - start]);
                    }
                    is_item.extend(std::iter::repeat_n(false, kept.len()));
                    if !kept.is_empty() {
                        user_atoms.push(Atom::Text(kept));
                    }
                }
                Atom::Item { .. } => {
                    // An item never spans a turn marker: all its rows are user rows or none are.
                    let mut n = 0;
                    while next.next_if(|&p| p < end).is_some() {
                        n += 1;
                    }
                    if n > 0 {
                        is_item.extend(std::iter::repeat_n(true, n));
                        user_atoms.push(atom.clone());
                    }
                }
            }
            start = end;
        }
        user_atoms.push(Atom::Text(vec![chat.tts_pad_token_id; ASSISTANT_ROWS]));
        let positions = positions_from_atoms(&user_atoms, tokens, prompt.positions.kind())?;
        let ids = t
            .user
            .iter()
            .map(|&p| prompt.token_ids[p])
            .chain([chat.tts_pad_token_id; ASSISTANT_ROWS])
            .collect();
        Ok(TalkerLayout { user: t.user, is_item, assistant_start: t.assistant_start, ids, positions })
    }
}
