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
use std::sync::Arc;

use crate::canon::{Fingerprint, ItemIdentity, ItemLayout, Modality};
use crate::error::{RequestError, Result};

use super::{Atom, OmniTokens};

/// Which rotary positions a prompt gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PositionKind {
    /// Plain `0..len` (text-only thinkers).
    Linear,
    /// Qwen3-Omni 3-D M-RoPE positions with their rope delta.
    #[default]
    Mrope,
}

/// Rotary position ids of consecutive prompt positions, stored by run.
///
/// A text run is two numbers (its length and first position), a vision item's
/// rows are its merged grid, so building, slicing and cloning cost per atom,
/// not per token. [`Positions::slice`] cuts the positions of one scheduler
/// chunk: the scheduler, the runner and the engine all take chunk positions
/// from it. Only the runner materialises values, for the chunk it runs
/// ([`Positions::extend_axes`]).
///
/// ```
/// use omniprefix::prompt::Positions;
/// let p = Positions::linear(10);
/// let chunk = p.slice(2..4)?;
/// assert_eq!(chunk.axes()[0], vec![2, 3]);
/// assert_eq!(chunk, Positions::linear(4).slice(2..4)?);
/// assert!(p.slice(8..11).is_err());
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Positions {
    kind: PositionKind,
    len: usize,
    /// One past the largest position of the whole prompt, minus its length
    /// (M-RoPE only; a slice keeps the whole prompt's).
    rope_delta: i64,
    runs: Vec<Run>,
}

/// Consecutive positions that follow one rule.
#[derive(Debug, Clone)]
enum Run {
    /// `len` positions at `base + i` on every axis: text, audio rows, 1-D positions.
    Diagonal { len: usize, base: i64 },
    /// Rows `first_row..first_row + len` of a vision item, at `base` plus
    /// their (time, row, column) in the merged grid.
    Grid { len: usize, base: i64, first_row: u32, grid: Grid },
    /// Positions given value by value (e.g. HF's `position_ids` in parity tests).
    Given { values: Arc<[[i64; 3]]>, first: usize, len: usize },
}

/// A vision item's merged grid and its temporal scale.
#[derive(Debug, Clone, Copy)]
struct Grid {
    rows: u32,
    cols: u32,
    /// Seconds per temporal grid step (1 for images).
    seconds: f32,
    /// Temporal positions per second (`position_id_per_seconds`).
    per_second: f32,
}

impl Grid {
    fn of(layout: &ItemLayout, tokens: &OmniTokens) -> Option<Grid> {
        let (grid_thw, seconds) = match layout {
            ItemLayout::Image { grid_thw } => (*grid_thw, 1.0),
            ItemLayout::Video { grid_thw, seconds_per_grid } => (*grid_thw, *seconds_per_grid),
            ItemLayout::Audio { .. } => return None,
        };
        let merge = tokens.spatial_merge_size.max(1);
        Some(Grid {
            rows: grid_thw[1] / merge,
            cols: grid_thw[2] / merge,
            seconds,
            per_second: tokens.position_id_per_seconds as f32,
        })
    }

    /// (t, h, w) offsets from the item's base of embedding row `row`; the
    /// temporal one truncated toward zero (see the module docs).
    fn offsets(&self, row: u32) -> [i64; 3] {
        let per_frame = (self.rows * self.cols).max(1);
        let (frame, cell) = (row / per_frame, row % per_frame);
        let cols = self.cols.max(1);
        [self.time(frame) as i64, i64::from(cell / cols), i64::from(cell % cols)]
    }

    /// Temporal offset of frame `frame`, in f32 as torch computes it
    /// (`arange(t) * seconds_per_grid * position_id_per_seconds`).
    fn time(&self, frame: u32) -> f32 {
        frame as f32 * self.seconds * self.per_second
    }
}

impl Run {
    fn len(&self) -> usize {
        match self {
            Run::Diagonal { len, .. } | Run::Grid { len, .. } | Run::Given { len, .. } => *len,
        }
    }

    /// Positions `range` of this run (relative to its start).
    fn sub(&self, range: Range<usize>) -> Run {
        let len = range.len();
        match self {
            Run::Diagonal { base, .. } => Run::Diagonal { len, base: base + range.start as i64 },
            Run::Grid { base, first_row, grid, .. } => {
                Run::Grid { len, base: *base, first_row: first_row + range.start as u32, grid: *grid }
            }
            Run::Given { values, first, .. } => {
                Run::Given { values: Arc::clone(values), first: first + range.start, len }
            }
        }
    }

    /// Position `i` of the run.
    fn at(&self, i: usize) -> [i64; 3] {
        match self {
            Run::Diagonal { base, .. } => [base + i as i64; 3],
            Run::Grid { base, first_row, grid, .. } => grid.offsets(first_row + i as u32).map(|o| base + o),
            Run::Given { values, first, .. } => values[first + i],
        }
    }

    /// The largest value on any axis (`None` for an empty run): arithmetic for
    /// a diagonal run, a walk over the rows of an item otherwise.
    fn max(&self) -> Option<i64> {
        match self {
            Run::Diagonal { len, base } => (*len > 0).then(|| base + *len as i64 - 1),
            _ => (0..self.len()).flat_map(|i| self.at(i)).max(),
        }
    }
}

impl Positions {
    /// Plain 1-D positions `0..len`.
    pub fn linear(len: usize) -> Self {
        Positions {
            kind: PositionKind::Linear,
            len,
            rope_delta: 0,
            runs: vec![Run::Diagonal { len, base: 0 }],
        }
    }

    /// M-RoPE positions given one `[t, h, w]` per position, with the prompt's
    /// rope delta: for positions computed elsewhere (HF's `position_ids`, test
    /// layouts). Prompts built from atoms never need it.
    pub fn given(values: Vec<[i64; 3]>, rope_delta: i64) -> Self {
        let len = values.len();
        let values: Arc<[[i64; 3]]> = values.into();
        Positions {
            kind: PositionKind::Mrope,
            len,
            rope_delta,
            runs: vec![Run::Given { values, first: 0, len }],
        }
    }

    /// Number of positions.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when there are no positions.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// 1-D or M-RoPE.
    pub fn kind(&self) -> PositionKind {
        self.kind
    }

    /// M-RoPE's rope delta of the whole prompt (decoding after it starts at
    /// `len + rope_delta`); `None` for 1-D positions.
    pub fn rope_delta(&self) -> Option<i64> {
        (self.kind == PositionKind::Mrope).then_some(self.rope_delta)
    }

    /// The positions of prompt positions `range` (a scheduler chunk), keeping
    /// the rope delta of the whole prompt: the one place chunk positions are cut.
    /// Costs one step per run, never per token.
    pub fn slice(&self, range: Range<usize>) -> Result<Positions> {
        if range.start > range.end || range.end > self.len {
            return Err(RequestError::PositionRangeOutOfBounds {
                start: range.start,
                end: range.end,
                len: self.len,
            }
            .into());
        }
        let mut runs = Vec::new();
        let mut at = 0;
        for run in &self.runs {
            let (lo, hi) = (at, at + run.len());
            at = hi;
            if hi <= range.start || lo == hi {
                continue;
            }
            if lo >= range.end {
                break;
            }
            runs.push(run.sub(range.start.max(lo) - lo..range.end.min(hi) - lo));
        }
        Ok(Positions { kind: self.kind, len: range.len(), rope_delta: self.rope_delta, runs })
    }

    /// Appends `n` text positions after the last: generated tokens. They count
    /// on from the sequence index plus the rope delta, as Hugging Face decodes
    /// Qwen-Omni (`cache_position + rope_deltas`), so text after the last item
    /// continues from its largest position + 1; 1-D positions simply continue.
    pub fn append_text(&mut self, n: usize) {
        let base = self.len as i64 + if self.kind == PositionKind::Mrope { self.rope_delta } else { 0 };
        self.len += n;
        if let Some(Run::Diagonal { len, base: last }) = self.runs.last_mut()
            && *last + *len as i64 == base
        {
            *len += n;
            return;
        }
        self.runs.push(Run::Diagonal { len: n, base });
    }

    /// Every position as `[t, h, w]` (1-D positions repeat one value), in order.
    pub fn iter(&self) -> impl Iterator<Item = [i64; 3]> + '_ {
        self.runs.iter().flat_map(|run| (0..run.len()).map(move |i| run.at(i)))
    }

    /// Appends the values to per-axis vectors (temporal, height, width): the
    /// dense `[3, n]` form a step's rotary embedding reads.
    pub fn extend_axes(&self, axes: &mut [Vec<i64>; 3]) {
        for axis in axes.iter_mut() {
            axis.reserve(self.len);
        }
        for run in &self.runs {
            match run {
                Run::Diagonal { len, base } => {
                    for axis in axes.iter_mut() {
                        axis.extend(*base..base + *len as i64);
                    }
                }
                _ => {
                    for i in 0..run.len() {
                        for (axis, v) in axes.iter_mut().zip(run.at(i)) {
                            axis.push(v);
                        }
                    }
                }
            }
        }
    }

    /// The values per axis (temporal, height, width), materialised.
    pub fn axes(&self) -> [Vec<i64>; 3] {
        let mut axes: [Vec<i64>; 3] = Default::default();
        self.extend_axes(&mut axes);
        axes
    }
}

/// Equal when they have the same kind, length, rope delta and values,
/// however the values are stored.
impl PartialEq for Positions {
    fn eq(&self, other: &Self) -> bool {
        self.kind == other.kind
            && self.len == other.len
            && self.rope_delta() == other.rope_delta()
            && self.iter().eq(other.iter())
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
    let len = walk.len;
    Ok(match kind {
        PositionKind::Linear => Positions::linear(len),
        PositionKind::Mrope => {
            let rope_delta = walk.max.unwrap_or(-1) + 1 - len as i64;
            Positions { kind, len, rope_delta, runs: walk.runs }
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
    runs: Vec<Run>,
    len: usize,
    /// The largest value so far on any axis.
    max: Option<i64>,
    /// The next text position.
    next: i64,
    /// Occurrences in the current run of item atoms (no text between them).
    open: Vec<OpenItem>,
}

impl MropeWalk {
    fn text(&mut self, atom: usize, len: usize) -> Result<()> {
        self.close_group(atom)?;
        self.push(Run::Diagonal { len, base: self.next });
        self.next += len as i64;
        Ok(())
    }

    fn item(&mut self, atom: usize, id: &ItemIdentity, rows: Range<u32>, tokens: &OmniTokens) -> Result<()> {
        let num_tokens = u32::try_from(id.num_tokens).map_err(|_| RequestError::MalformedAtoms {
            atom,
            problem: "item has more than u32::MAX rows",
        })?;
        if rows.is_empty() || rows.end > num_tokens {
            return Err(RequestError::MalformedAtoms {
                atom,
                problem: "item rows empty or past the item's token count",
            }
            .into());
        }
        let base = if rows.start == 0 {
            tokens.checked_token_count(id, atom)?;
            self.open_occurrence(atom, id, num_tokens, rows.end)?
        } else {
            let open = self
                .open
                .iter_mut()
                .find(|o| o.fingerprint == id.fingerprint && o.next_row == rows.start)
                .ok_or(RequestError::MalformedAtoms {
                    atom,
                    problem: "rows continue no item open right before them",
                })?;
            open.next_row = rows.end;
            open.base
        };
        let len = rows.len();
        let run = match Grid::of(&id.layout, tokens) {
            Some(grid) => Run::Grid { len, base, first_row: rows.start, grid },
            // Audio rows sit at `base + row` on every axis.
            None => Run::Diagonal { len, base: base + i64::from(rows.start) },
        };
        // After an item, text continues one past the largest value of its last chunk.
        self.next = run.max().map_or(self.next, |m| m + 1);
        self.push(run);
        Ok(())
    }

    /// Starts a new item occurrence and returns its base position. An audio
    /// right after a lone video in the same run shares the video's base.
    fn open_occurrence(
        &mut self, atom: usize, id: &ItemIdentity, num_tokens: u32, next_row: u32,
    ) -> Result<i64> {
        let base = match self.open.as_slice() {
            [video] if video.modality == Modality::Video && id.modality == Modality::Audio => video.base,
            _ => {
                if self.open.iter().any(|o| o.next_row != o.num_tokens) {
                    return Err(RequestError::MalformedAtoms {
                        atom,
                        problem: "new item starts inside an unfinished item",
                    }
                    .into());
                }
                self.next
            }
        };
        self.open.push(OpenItem {
            fingerprint: id.fingerprint,
            modality: id.modality,
            base,
            next_row,
            num_tokens,
        });
        Ok(base)
    }

    fn close_group(&mut self, atom: usize) -> Result<()> {
        if self.open.iter().any(|o| o.next_row != o.num_tokens) {
            return Err(RequestError::MalformedAtoms {
                atom,
                problem: "an item's rows end before its token count",
            }
            .into());
        }
        self.open.clear();
        Ok(())
    }

    fn finish(&mut self, atoms: usize) -> Result<()> {
        self.close_group(atoms)
    }

    fn push(&mut self, run: Run) {
        if let Some(m) = run.max() {
            self.max = Some(self.max.map_or(m, |old| old.max(m)));
        }
        self.len += run.len();
        self.runs.push(run);
    }
}

/// The row runs of a video and its audio in the order the HF Qwen3-Omni
/// processor emits them: by time, a video frame before an audio token whose
/// index is not below the frame's temporal offset.
pub(crate) fn audio_in_video_runs(
    video: &ItemLayout, video_tokens: u32, audio_tokens: u32, tokens: &OmniTokens,
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
    let (frames, grid) = match (video, Grid::of(video, tokens)) {
        (ItemLayout::Video { grid_thw, .. } | ItemLayout::Image { grid_thw }, Some(grid)) => {
            (grid_thw[0], grid)
        }
        _ => {
            return vec![(Modality::Audio, 0..audio_tokens)]
                .into_iter()
                .filter(|(_, r)| !r.is_empty())
                .collect();
        }
    };
    let per_frame = video_tokens.checked_div(frames).unwrap_or(0);
    let mut audio = 0;
    for frame in 0..frames {
        let time = grid.time(frame);
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
        let p = Positions::given(vec![[0, 0, 0], [1, 1, 1]], 0);
        assert!(matches!(
            p.slice(1..3),
            Err(Error::Request(RequestError::PositionRangeOutOfBounds { start: 1, end: 3, len: 2 }))
        ));
        assert_eq!(p.slice(1..2).ok(), Some(Positions::given(vec![[1, 1, 1]], 0)));
    }

    #[test]
    fn slices_cost_per_run_and_keep_the_delta() {
        let p = Positions::given(vec![[0, 0, 0], [1, 1, 2], [2, 1, 2]], -3);
        assert_eq!(p.slice(1..3).unwrap(), Positions::given(vec![[1, 1, 2], [2, 1, 2]], -3));
        // Text runs stay two numbers whatever their length.
        let long = Positions::linear(1 << 20).slice(1000..(1 << 19)).unwrap();
        assert_eq!(long.runs.len(), 1);
        assert_eq!(long.iter().next(), Some([1000; 3]));
        assert_eq!(long.rope_delta(), None);
    }
}
