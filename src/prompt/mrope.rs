//! Position ids as a pure function of a prompt's atoms and item layouts.
//!
//! M-RoPE positions follow transformers' Qwen3-Omni thinker `get_rope_index`:
//! text advances one position per token on all three axes; a vision item's rows
//! sit at `base + (t_offset, row, col)` of its merged grid, with `t_offset =
//! frame · seconds_per_grid · position_id_per_seconds` (images: `frame · 13`);
//! an audio item's rows at `base + row` on all axes; after an item, the next
//! position is one past the largest value of its last chunk. A video directly
//! followed (no text between) by an audio item is audio-in-video: both items
//! share one base and their rows interleave by time, video first on ties.
//!
//! HF keeps positions as floats; here they are `i64`, so a temporal offset that
//! is not an integer (seconds_per_grid · 13 fractional) is truncated toward
//! zero, as Qwen2.5-VL's `get_rope_index` does. All integral cases are exact.

use std::ops::Range;

use crate::canon::{Fingerprint, ItemIdentity, ItemLayout, Modality};
use crate::error::{RequestError, Result};

use super::{Atom, OmniTokens, Positions};

/// Which rotary positions a prompt gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PositionKind {
    /// Plain `0..len` (text-only thinkers).
    Linear,
    /// Qwen3-Omni 3-D M-RoPE positions with their rope delta.
    #[default]
    Mrope,
}

impl Positions {
    /// Number of positions.
    pub fn len(&self) -> usize {
        match self {
            Positions::Linear(p) => p.len(),
            Positions::Mrope { t, .. } => t.len(),
        }
    }

    /// True when there are no positions.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The positions of prompt positions `range` (a scheduler chunk), keeping
    /// the rope delta of the whole prompt.
    ///
    /// ```
    /// use omniprefix::prompt::Positions;
    /// let p = Positions::Linear((0..10).collect());
    /// assert_eq!(p.slice(2..4).unwrap(), Positions::Linear(vec![2, 3]));
    /// assert!(p.slice(8..11).is_err());
    /// ```
    pub fn slice(&self, range: Range<usize>) -> Result<Positions> {
        let len = self.len();
        if range.start > range.end || range.end > len {
            return Err(RequestError::PositionRangeOutOfBounds { start: range.start, end: range.end, len }.into());
        }
        Ok(match self {
            Positions::Linear(p) => Positions::Linear(p[range].to_vec()),
            Positions::Mrope { t, h, w, rope_delta } => Positions::Mrope {
                t: t[range.clone()].to_vec(),
                h: h[range.clone()].to_vec(),
                w: w[range].to_vec(),
                rope_delta: *rope_delta,
            },
        })
    }
}

/// Positions of a prompt made of `atoms` (see the module docs for the rules).
pub fn positions_from_atoms(atoms: &[Atom], tokens: &OmniTokens, kind: PositionKind) -> Result<Positions> {
    let mut walk = MropeWalk::default();
    for (index, atom) in atoms.iter().enumerate() {
        match atom {
            Atom::Text(ids) => walk.text(index, ids.len())?,
            Atom::Item { id, rows } => walk.item(index, id, rows.clone(), tokens)?,
        }
    }
    walk.finish(atoms.len())?;
    let len = walk.t.len();
    Ok(match kind {
        PositionKind::Linear => Positions::Linear((0..len as i64).collect()),
        PositionKind::Mrope => {
            let max = walk.t.iter().chain(&walk.h).chain(&walk.w).copied().max().unwrap_or(-1);
            Positions::Mrope { rope_delta: max + 1 - len as i64, t: walk.t, h: walk.h, w: walk.w }
        }
    })
}

/// An item occurrence whose rows are being placed.
struct OpenItem {
    fingerprint: Fingerprint,
    modality: Modality,
    base: i64,
    next_row: u32,
    num_tokens: u32,
}

/// Running state of the position walk over atoms.
#[derive(Default)]
struct MropeWalk {
    t: Vec<i64>,
    h: Vec<i64>,
    w: Vec<i64>,
    /// The next text position.
    next: i64,
    /// Occurrences in the current run of item atoms (no text between them).
    open: Vec<OpenItem>,
}

impl MropeWalk {
    fn text(&mut self, atom: usize, len: usize) -> Result<()> {
        self.close_group(atom)?;
        for p in self.next..self.next + len as i64 {
            self.push(p, p, p);
        }
        self.next += len as i64;
        Ok(())
    }

    fn item(&mut self, atom: usize, id: &ItemIdentity, rows: Range<u32>, tokens: &OmniTokens) -> Result<()> {
        let num_tokens = u32::try_from(id.num_tokens)
            .map_err(|_| RequestError::MalformedAtoms { atom, problem: "item has more than u32::MAX rows" })?;
        if rows.is_empty() || rows.end > num_tokens {
            return Err(RequestError::MalformedAtoms { atom, problem: "item rows empty or past the item's token count" }.into());
        }
        let base = if rows.start == 0 {
            tokens.checked_token_count(id, atom)?;
            self.open_occurrence(atom, id, num_tokens, rows.end)?
        } else {
            let open = self
                .open
                .iter_mut()
                .find(|o| o.fingerprint == id.fingerprint && o.next_row == rows.start)
                .ok_or(RequestError::MalformedAtoms { atom, problem: "rows continue no item open right before them" })?;
            open.next_row = rows.end;
            open.base
        };
        let mut max = i64::MIN;
        for row in rows {
            let (t, h, w) = row_offsets(&id.layout, row, tokens);
            let (t, h, w) = (base + t, base + h, base + w);
            max = max.max(t).max(h).max(w);
            self.push(t, h, w);
        }
        self.next = max + 1;
        Ok(())
    }

    /// Starts a new item occurrence and returns its base position. An audio
    /// right after a lone video in the same run shares the video's base.
    fn open_occurrence(&mut self, atom: usize, id: &ItemIdentity, num_tokens: u32, next_row: u32) -> Result<i64> {
        let base = match self.open.as_slice() {
            [video] if video.modality == Modality::Video && id.modality == Modality::Audio => video.base,
            _ => {
                if self.open.iter().any(|o| o.next_row != o.num_tokens) {
                    return Err(RequestError::MalformedAtoms { atom, problem: "new item starts inside an unfinished item" }.into());
                }
                self.next
            }
        };
        self.open.push(OpenItem { fingerprint: id.fingerprint, modality: id.modality, base, next_row, num_tokens });
        Ok(base)
    }

    fn close_group(&mut self, atom: usize) -> Result<()> {
        if self.open.iter().any(|o| o.next_row != o.num_tokens) {
            return Err(RequestError::MalformedAtoms { atom, problem: "an item's rows end before its token count" }.into());
        }
        self.open.clear();
        Ok(())
    }

    fn finish(&mut self, atoms: usize) -> Result<()> {
        self.close_group(atoms)
    }

    fn push(&mut self, t: i64, h: i64, w: i64) {
        self.t.push(t);
        self.h.push(h);
        self.w.push(w);
    }
}

/// Temporal offset of vision frame `frame`, in f32 as torch computes it
/// (`arange(t) * seconds_per_grid * position_id_per_seconds`).
fn frame_time(layout: &ItemLayout, frame: u32, tokens: &OmniTokens) -> f32 {
    let seconds = match layout {
        ItemLayout::Video { seconds_per_grid, .. } => *seconds_per_grid,
        _ => 1.0,
    };
    frame as f32 * seconds * tokens.position_id_per_seconds as f32
}

/// Merged-grid (frame, row, col) of vision row `row`; `(frames, rows, cols)` dims.
fn vision_cell(grid_thw: [u32; 3], merge: u32, row: u32) -> (u32, u32, u32) {
    let (gh, gw) = (grid_thw[1] / merge.max(1), grid_thw[2] / merge.max(1));
    let per_frame = (gh * gw).max(1);
    let cell = row % per_frame;
    (row / per_frame, cell / gw.max(1), cell % gw.max(1))
}

/// (t, h, w) offsets from the item's base of embedding row `row`.
fn row_offsets(layout: &ItemLayout, row: u32, tokens: &OmniTokens) -> (i64, i64, i64) {
    match layout {
        ItemLayout::Image { grid_thw } | ItemLayout::Video { grid_thw, .. } => {
            let (frame, r, c) = vision_cell(*grid_thw, tokens.spatial_merge_size, row);
            (frame_time(layout, frame, tokens) as i64, i64::from(r), i64::from(c))
        }
        ItemLayout::Audio { .. } => (i64::from(row), i64::from(row), i64::from(row)),
    }
}

/// The row runs of a video and its audio in the order the HF Qwen3-Omni
/// processor emits them: by time, a video frame before an audio token whose
/// index is not below the frame's temporal offset.
pub(crate) fn audio_in_video_runs(
    video: &ItemLayout,
    video_tokens: u32,
    audio_tokens: u32,
    tokens: &OmniTokens,
) -> Vec<(Modality, Range<u32>)> {
    let mut runs: Vec<(Modality, Range<u32>)> = Vec::new();
    let mut emit = |modality: Modality, rows: Range<u32>| {
        if rows.is_empty() {
            return;
        }
        match runs.last_mut() {
            Some((m, last)) if *m == modality && last.end == rows.start => last.end = rows.end,
            _ => runs.push((modality, rows)),
        }
    };
    let grid_thw = match video {
        ItemLayout::Video { grid_thw, .. } | ItemLayout::Image { grid_thw } => *grid_thw,
        ItemLayout::Audio { .. } => [0, 0, 0],
    };
    let per_frame = video_tokens.checked_div(grid_thw[0]).unwrap_or(0);
    let mut audio = 0;
    for frame in 0..grid_thw[0] {
        let time = frame_time(video, frame, tokens);
        let start = audio;
        while audio < audio_tokens && (audio as f32) < time {
            audio += 1;
        }
        emit(Modality::Audio, start..audio);
        emit(Modality::Video, frame * per_frame..(frame + 1) * per_frame);
    }
    emit(Modality::Audio, audio..audio_tokens);
    runs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    #[test]
    fn interleave_puts_video_first_on_ties() {
        let video = ItemLayout::Video { grid_thw: [3, 4, 4], seconds_per_grid: 1.0 };
        let runs = audio_in_video_runs(&video, 12, 39, &OmniTokens::tiny());
        let expected = vec![
            (Modality::Video, 0..4),
            (Modality::Audio, 0..13),
            (Modality::Video, 4..8),
            (Modality::Audio, 13..26),
            (Modality::Video, 8..12),
            (Modality::Audio, 26..39),
        ];
        assert_eq!(runs, expected);
    }

    #[test]
    fn interleave_with_short_audio_leaves_video_tail() {
        let video = ItemLayout::Video { grid_thw: [3, 2, 2], seconds_per_grid: 1.0 };
        let runs = audio_in_video_runs(&video, 3, 5, &OmniTokens::tiny());
        assert_eq!(runs, vec![(Modality::Video, 0..1), (Modality::Audio, 0..5), (Modality::Video, 1..3)]);
    }

    #[test]
    fn slice_rejects_out_of_range() {
        let p = Positions::Mrope { t: vec![0, 1], h: vec![0, 1], w: vec![0, 1], rope_delta: 0 };
        assert!(matches!(p.slice(1..3), Err(Error::Request(RequestError::PositionRangeOutOfBounds { start: 1, end: 3, len: 2 }))));
        assert_eq!(p.slice(1..2).ok(), Some(Positions::Mrope { t: vec![1], h: vec![1], w: vec![1], rope_delta: 0 }));
    }
}
