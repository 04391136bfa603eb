//! Placeholder token counts (Qwen3-Omni rules) and the shape checks that tie a
//! tensor to its layout.
//!
//! The token count fixes how many placeholder positions an item occupies, so an
//! item whose layout and tensor disagree must be rejected before it is hashed.

use super::{ItemLayout, Modality, TensorView};
use crate::error::{Error, RequestError, Result};

/// Spatial merge of the vision encoder: 2x2 patches become one token.
pub const SPATIAL_MERGE: u32 = 2;

/// Mel frames per audio-encoder window (`n_window` 50, doubled by the conv stride).
const AUDIO_WINDOW_FRAMES: i64 = 100;
/// Tokens one full window of `AUDIO_WINDOW_FRAMES` frames produces.
const AUDIO_TOKENS_PER_WINDOW: i64 = 13;

/// Python floor division for a positive divisor (`a // b`).
fn floor_div(a: i64, b: i64) -> i64 {
    debug_assert!(b > 0);
    a.div_euclid(b)
}

/// Audio tokens for `mel_frames` frames: a port of HF Qwen3-Omni
/// `_get_feat_extract_output_lengths` with Python floor-division semantics,
/// so a remainder of zero frames contributes nothing.
///
/// ```
/// use omniprefix::canon::audio_tokens;
/// assert_eq!(audio_tokens(250), 33);
/// assert_eq!(audio_tokens(100), 13);
/// ```
pub fn audio_tokens(mel_frames: u32) -> usize {
    let frames = i64::from(mel_frames);
    let leave = frames % AUDIO_WINDOW_FRAMES;
    let feat = floor_div(leave - 1, 2) + 1;
    let tail = floor_div(floor_div(feat - 1, 2) + 1 - 1, 2) + 1;
    let out = tail + (frames / AUDIO_WINDOW_FRAMES) * AUDIO_TOKENS_PER_WINDOW;
    // `out` >= 0 for every u32 input: the tail term is >= 0 (tested at leave = 0).
    usize::try_from(out).unwrap_or(0)
}

impl ItemLayout {
    /// Number of placeholder tokens (= embedding rows) the item occupies.
    ///
    /// Image/video: t·h·w / merge² (merge 2); audio: [`audio_tokens`]. For a
    /// grid that [`ItemLayout::try_num_tokens`] would reject, the patch count
    /// is floor-divided; call the fallible form on anything a user supplied.
    ///
    /// ```
    /// use omniprefix::canon::ItemLayout;
    /// assert_eq!(ItemLayout::Image { grid_thw: [1, 4, 6] }.num_tokens(), 6);
    /// assert_eq!(ItemLayout::Audio { mel_frames: 3000 }.num_tokens(), 390);
    /// ```
    pub fn num_tokens(&self) -> usize {
        self.merged_tokens(SPATIAL_MERGE).unwrap_or(usize::MAX)
    }

    /// The one definition of the token count, for a vision encoder merging
    /// `merge`x`merge` patches: `t·h·w / merge²` (floor) for image/video,
    /// [`audio_tokens`] for audio. `None` when `t·h·w` overflows `usize` or
    /// `merge` is 0. [`checked_tokens`](Self::checked_tokens) calls this after
    /// its checks on the grid.
    ///
    /// ```
    /// use omniprefix::canon::ItemLayout;
    /// let video = ItemLayout::Video { grid_thw: [10, 40, 72], seconds_per_grid: 2.0 };
    /// assert_eq!(video.merged_tokens(2), Some(7200));
    /// assert_eq!(video.merged_tokens(0), None);
    /// ```
    pub fn merged_tokens(&self, merge: u32) -> Option<usize> {
        match *self {
            ItemLayout::Image { grid_thw } | ItemLayout::Video { grid_thw, .. } => {
                let area = (merge as usize).checked_mul(merge as usize).filter(|&a| a > 0)?;
                let patches = grid_thw.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d as usize))?;
                Some(patches / area)
            }
            ItemLayout::Audio { mel_frames } => Some(audio_tokens(mel_frames)),
        }
    }

    /// Token count after checking the layout itself under Qwen3-Omni's
    /// [`LayoutRules`] ([`checked_tokens`](Self::checked_tokens) for its own modality).
    pub fn try_num_tokens(&self, item: usize) -> Result<usize> {
        self.checked_tokens(item, self.modality(), LayoutRules::QWEN3_OMNI)
    }

    /// The one check of an item's layout, for canon and the prompt alike;
    /// errors name `item`. Returns the item's token count after checking:
    ///
    /// | rule | error |
    /// |---|---|
    /// | the layout kind is `modality`'s | [`InvalidLayout`](RequestError::InvalidLayout) `kind` |
    /// | a video's `seconds_per_grid` is finite, > 0, and its last frame's temporal position offset fits M-RoPE (2^31) | `InvalidLayout` `seconds_per_grid` |
    /// | the grid's h and w divide by the merge size | [`GridNotMergeable`](RequestError::GridNotMergeable) |
    /// | t·h·w fits `usize` | `InvalidLayout` `grid_thw` |
    /// | at least one token (no zero side, no zero mel frames) | [`EmptyItem`](RequestError::EmptyItem) |
    pub fn checked_tokens(&self, item: usize, modality: Modality, rules: LayoutRules) -> Result<usize> {
        let invalid = |field, expected: String, found: String| {
            Error::from(RequestError::InvalidLayout { item, field, expected, found })
        };
        if self.modality() != modality {
            let found = format!("{self:?} for a {modality:?} item");
            return Err(invalid("kind", format!("a {modality:?} layout"), found));
        }
        if let ItemLayout::Video { grid_thw, seconds_per_grid } = *self {
            let last_offset =
                grid_thw[0].saturating_sub(1) as f32 * seconds_per_grid * rules.positions_per_second as f32;
            if !(seconds_per_grid.is_finite() && seconds_per_grid > 0.0 && last_offset <= MAX_TEMPORAL_OFFSET)
            {
                let expected = format!(
                    "a finite number > 0 placing frames at temporal offsets up to {MAX_TEMPORAL_OFFSET}"
                );
                return Err(invalid(
                    "seconds_per_grid",
                    expected,
                    format!("{seconds_per_grid} (last offset {last_offset})"),
                ));
            }
        }
        if let ItemLayout::Image { grid_thw } | ItemLayout::Video { grid_thw, .. } = *self {
            let merge = rules.merge;
            if grid_thw.contains(&0) {
                return Err(RequestError::EmptyItem { item, what: "grid_thw with a zero side" }.into());
            }
            if merge == 0 || grid_thw[1] % merge != 0 || grid_thw[2] % merge != 0 {
                return Err(RequestError::GridNotMergeable { item, grid_thw, merge }.into());
            }
        }
        let count = self.merged_tokens(rules.merge).ok_or_else(|| {
            invalid("grid_thw", "a token count that fits in usize".into(), format!("{self:?}"))
        })?;
        if count == 0 {
            return Err(
                RequestError::EmptyItem { item, what: "a layout of zero tokens (no mel frames)" }.into()
            );
        }
        Ok(count)
    }

    /// The modality this layout kind describes.
    pub fn modality(&self) -> Modality {
        match self {
            ItemLayout::Image { .. } => Modality::Image,
            ItemLayout::Video { .. } => Modality::Video,
            ItemLayout::Audio { .. } => Modality::Audio,
        }
    }
}

/// What a model's placement needs of a layout: the vision merge size and the
/// temporal M-RoPE positions per second of video.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutRules {
    /// Side of the square of vision patches merged into one token.
    pub merge: u32,
    /// Temporal M-RoPE positions per second of video.
    pub positions_per_second: u32,
}

impl LayoutRules {
    /// Qwen3-Omni's: 2x2 merge, 13 positions per second; what canon checks
    /// items against before any model is known.
    pub const QWEN3_OMNI: LayoutRules = LayoutRules { merge: SPATIAL_MERGE, positions_per_second: 13 };
}

/// Largest temporal M-RoPE offset accepted inside one video (2^31): keeps
/// positions far from `i64` overflow whatever `seconds_per_grid` says.
const MAX_TEMPORAL_OFFSET: f32 = 2_147_483_648.0;

/// t·h·w in usize; saturates instead of wrapping on absurd grids.
fn grid_patches(grid_thw: [u32; 3]) -> usize {
    grid_thw.iter().fold(1usize, |acc, &d| acc.saturating_mul(d as usize))
}

/// Checks a tensor against its layout where the relation is known.
///
/// | modality    | tensor                       | rule                          |
/// |-------------|------------------------------|-------------------------------|
/// | image/video | float, 2-D (processed patches) | rows == t·h·w               |
/// | audio       | float, 2-D (mel features `[n_mels, frames]`) | columns == mel_frames |
/// | any         | anything else (raw HWC u8 image, f32 waveform, THWC u8 frames, ids) | any non-empty shape |
///
/// Raw media are accepted with any shape because their relation to the grid
/// depends on the processor's resize, which the processor params record.
pub fn check_shape(
    item: usize, modality: Modality, layout: &ItemLayout, view: &TensorView<'_>,
) -> Result<()> {
    let shape = view.shape();
    if view.is_empty() {
        return Err(RequestError::EmptyItem { item, what: "tensor with a zero dimension" }.into());
    }
    if !view.dtype().is_float() || shape.len() != 2 {
        return Ok(());
    }
    let mismatch = |expected: String| {
        Error::Request(RequestError::ShapeMismatch { item, modality, expected, found: shape.to_vec() })
    };
    match *layout {
        ItemLayout::Image { grid_thw } | ItemLayout::Video { grid_thw, .. } => {
            let patches = grid_patches(grid_thw);
            if shape[0] != patches {
                return Err(mismatch(format!("{patches} patch rows (grid t·h·w {grid_thw:?})")));
            }
        }
        ItemLayout::Audio { mel_frames } => {
            if shape[1] != mel_frames as usize {
                return Err(mismatch(format!("[n_mels, {mel_frames}] mel features")));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{ArrayD, IxDyn};

    #[test]
    fn audio_tokens_match_hf_reference_points() {
        assert_eq!(audio_tokens(250), 33);
        assert_eq!(audio_tokens(3000), 390);
        assert_eq!(audio_tokens(300), 39);
        assert_eq!(audio_tokens(100), 13);
        assert_eq!(audio_tokens(1), 1);
        assert_eq!(audio_tokens(u32::MAX), audio_tokens(u32::MAX)); // no overflow panic
    }

    #[test]
    fn audio_tokens_follow_python_formula_everywhere() {
        // Independent re-derivation of the HF expression, step by step as Python evaluates it.
        let py = |l: i64| {
            let leave = l % 100;
            let feat = (leave - 1).div_euclid(2) + 1;
            ((feat - 1).div_euclid(2) + 1 - 1).div_euclid(2) + 1 + (l / 100) * 13
        };
        for l in 1..2000u32 {
            assert_eq!(audio_tokens(l) as i64, py(i64::from(l)), "mel_frames {l}");
        }
    }

    #[test]
    fn grid_tokens_divide_by_merge_area() {
        assert_eq!(ItemLayout::Image { grid_thw: [1, 4, 6] }.try_num_tokens(0).ok(), Some(6));
        let video = ItemLayout::Video { grid_thw: [2, 4, 4], seconds_per_grid: 2.0 };
        assert_eq!(video.try_num_tokens(0).ok(), Some(8));
        assert_eq!(video.num_tokens(), 8);
    }

    #[test]
    fn bad_layouts_are_typed_errors() {
        let odd = ItemLayout::Image { grid_thw: [1, 3, 5] };
        assert!(matches!(
            odd.try_num_tokens(4),
            Err(Error::Request(RequestError::GridNotMergeable { item: 4, merge: 2, .. }))
        ));
        let zero = ItemLayout::Image { grid_thw: [1, 0, 4] };
        assert!(matches!(
            zero.try_num_tokens(1),
            Err(Error::Request(RequestError::EmptyItem { item: 1, .. }))
        ));
        let nan = ItemLayout::Video { grid_thw: [2, 2, 2], seconds_per_grid: f32::NAN };
        assert!(matches!(
            nan.try_num_tokens(2),
            Err(Error::Request(RequestError::InvalidLayout { field: "seconds_per_grid", .. }))
        ));
        let silent = ItemLayout::Audio { mel_frames: 0 };
        assert!(matches!(
            silent.try_num_tokens(3),
            Err(Error::Request(RequestError::EmptyItem { item: 3, .. }))
        ));
        // t·h·w = 12 divides by 4, but w = 3 cannot lie on an h/2 x w/2 grid.
        let narrow = ItemLayout::Video { grid_thw: [2, 2, 3], seconds_per_grid: 1.0 };
        let err = narrow.try_num_tokens(5);
        assert!(
            matches!(
                err,
                Err(Error::Request(RequestError::GridNotMergeable {
                    item: 5,
                    grid_thw: [2, 2, 3],
                    merge: 2
                }))
            ),
            "{err:?}"
        );
        let far = ItemLayout::Video { grid_thw: [2, 2, 2], seconds_per_grid: 1e30 };
        let err = far.try_num_tokens(6);
        assert!(
            matches!(
                err,
                Err(Error::Request(RequestError::InvalidLayout { item: 6, field: "seconds_per_grid", .. }))
            ),
            "{err:?}"
        );
        let still = ItemLayout::Video { grid_thw: [2, 2, 2], seconds_per_grid: 0.0 };
        let err = still.try_num_tokens(7);
        assert!(
            matches!(
                err,
                Err(Error::Request(RequestError::InvalidLayout { item: 7, field: "seconds_per_grid", .. }))
            ),
            "{err:?}"
        );
    }

    #[test]
    fn a_layout_of_another_modality_is_invalid() {
        let image = ItemLayout::Image { grid_thw: [1, 4, 4] };
        assert_eq!(image.checked_tokens(0, Modality::Image, LayoutRules::QWEN3_OMNI).ok(), Some(4));
        let err = image.checked_tokens(2, Modality::Video, LayoutRules::QWEN3_OMNI);
        assert!(
            matches!(err, Err(Error::Request(RequestError::InvalidLayout { item: 2, field: "kind", .. }))),
            "{err:?}"
        );
        // A merge of 4 needs h and w divisible by 4.
        let rules = LayoutRules { merge: 4, ..LayoutRules::QWEN3_OMNI };
        let err = ItemLayout::Image { grid_thw: [1, 4, 6] }.checked_tokens(1, Modality::Image, rules);
        assert!(
            matches!(err, Err(Error::Request(RequestError::GridNotMergeable { item: 1, merge: 4, .. }))),
            "{err:?}"
        );
        let zero = LayoutRules { merge: 0, ..LayoutRules::QWEN3_OMNI };
        assert!(matches!(
            image.checked_tokens(0, Modality::Image, zero),
            Err(Error::Request(RequestError::GridNotMergeable { merge: 0, .. }))
        ));
    }

    #[test]
    fn processed_tensors_must_fit_their_layout() {
        let patches = ArrayD::<f32>::zeros(IxDyn(&[16, 8]));
        let grid = ItemLayout::Image { grid_thw: [1, 4, 4] };
        assert!(check_shape(0, Modality::Image, &grid, &TensorView::F32(patches.view())).is_ok());
        let wrong = ItemLayout::Image { grid_thw: [1, 4, 2] };
        assert!(matches!(
            check_shape(5, Modality::Image, &wrong, &TensorView::F32(patches.view())),
            Err(Error::Request(RequestError::ShapeMismatch { item: 5, modality: Modality::Image, .. }))
        ));
        let mel = ArrayD::<f32>::zeros(IxDyn(&[128, 250]));
        let ok = ItemLayout::Audio { mel_frames: 250 };
        assert!(check_shape(0, Modality::Audio, &ok, &TensorView::F32(mel.view())).is_ok());
        let short = ItemLayout::Audio { mel_frames: 200 };
        assert!(matches!(
            check_shape(1, Modality::Audio, &short, &TensorView::F32(mel.view())),
            Err(Error::Request(RequestError::ShapeMismatch { item: 1, .. }))
        ));
    }

    #[test]
    fn raw_media_accept_any_non_empty_shape() {
        let hwc = ArrayD::<u8>::zeros(IxDyn(&[37, 53, 3]));
        let grid = ItemLayout::Image { grid_thw: [1, 4, 4] };
        assert!(check_shape(0, Modality::Image, &grid, &TensorView::U8(hwc.view())).is_ok());
        let wave = ArrayD::<f32>::zeros(IxDyn(&[16000]));
        let audio = ItemLayout::Audio { mel_frames: 100 };
        assert!(check_shape(0, Modality::Audio, &audio, &TensorView::F32(wave.view())).is_ok());
        let empty = ArrayD::<u8>::zeros(IxDyn(&[0, 4, 3]));
        assert!(matches!(
            check_shape(2, Modality::Image, &grid, &TensorView::U8(empty.view())),
            Err(Error::Request(RequestError::EmptyItem { item: 2, .. }))
        ));
    }
}
