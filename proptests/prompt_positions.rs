//! Properties of prompt positions over random Qwen3-Omni prompts: chunk slices
//! concatenate back to the whole, positions are a pure function of the atoms,
//! and the built token ids parse back to the same prompt.
//!
//! Case count: `PROPTEST_CASES` (default 32).

use omniprefix::Result;
use omniprefix::canon::ItemLayout;
use omniprefix::prompt::{
    CanonicalPrompt, OmniTokens, PlaceholderForm, PositionKind, Positions, PromptBuilder,
    positions_from_atoms,
};
use proptest::prelude::*;

use support::items::placeholder_item;

/// One step of a random prompt.
#[derive(Debug, Clone)]
enum Step {
    Text(Vec<u32>),
    Image([u32; 3]),
    Video([u32; 3], f32),
    Audio(u32),
    AudioInVideo([u32; 3], f32, u32),
}

fn grid(max_t: u32) -> impl Strategy<Value = [u32; 3]> {
    (1..=max_t, 1..=3u32, 1..=3u32).prop_map(|(t, h, w)| [t, 2 * h, 2 * w])
}

fn seconds() -> impl Strategy<Value = f32> {
    prop_oneof![Just(0.5f32), Just(1.0), Just(2.0)]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        prop::collection::vec(0..400u32, 1..6).prop_map(Step::Text),
        grid(2).prop_map(Step::Image),
        (grid(3), seconds()).prop_map(|(g, s)| Step::Video(g, s)),
        (1..350u32).prop_map(Step::Audio),
        (grid(4), seconds(), 1..350u32).prop_map(|(g, s, a)| Step::AudioInVideo(g, s, a)),
    ]
}

/// Builds the prompt; a text token separates items so each step stands alone.
fn build(steps: &[Step], kind: PositionKind) -> Result<CanonicalPrompt> {
    let tokens = OmniTokens::tiny();
    let mut b = PromptBuilder::new(tokens.clone()).with_positions(kind);
    for (n, s) in steps.iter().enumerate() {
        if !matches!(s, Step::Text(_)) {
            b.push_text(&[1])?;
        }
        match s {
            Step::Text(ids) => b.push_text(ids)?,
            Step::Image(g) => {
                b.push_item(placeholder_item(&tokens, n as u128, ItemLayout::Image { grid_thw: *g })?)?
            }
            Step::Video(g, s) => {
                let layout = ItemLayout::Video { grid_thw: *g, seconds_per_grid: *s };
                b.push_item(placeholder_item(&tokens, n as u128, layout)?)?
            }
            Step::Audio(mel) => {
                b.push_item(placeholder_item(&tokens, n as u128, ItemLayout::Audio { mel_frames: *mel })?)?
            }
            Step::AudioInVideo(g, s, mel) => {
                let video = placeholder_item(
                    &tokens,
                    n as u128,
                    ItemLayout::Video { grid_thw: *g, seconds_per_grid: *s },
                )?;
                let audio =
                    placeholder_item(&tokens, (n + 1000) as u128, ItemLayout::Audio { mel_frames: *mel })?;
                b.push_audio_in_video(video, audio)?
            }
        };
    }
    b.build()
}

/// The parts' values one after the other, as one M-RoPE prompt's positions.
fn concat(parts: Vec<Positions>, rope_delta: i64) -> Positions {
    Positions::given(parts.iter().flat_map(Positions::iter).collect(), rope_delta)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(support::cases(32)))]

    #[test]
    fn slices_concatenate_to_the_whole(steps in prop::collection::vec(step(), 1..8), cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6)) {
        let prompt = build(&steps, PositionKind::Mrope).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let len = prompt.len();
        let mut bounds: Vec<usize> = cuts.iter().map(|i| i.index(len + 1)).collect();
        bounds.extend([0, len]);
        bounds.sort_unstable();
        let parts = bounds
            .windows(2)
            .map(|w| prompt.positions.slice(w[0]..w[1]))
            .collect::<Result<Vec<_>>>()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let Some(rope_delta) = prompt.positions.rope_delta() else {
            return Err(TestCaseError::fail("mrope expected"));
        };
        prop_assert!(parts.iter().all(|p| p.rope_delta() == Some(rope_delta)), "slices keep the rope delta");
        prop_assert_eq!(concat(parts, rope_delta), prompt.positions.clone());
        prop_assert!(prompt.positions.slice(0..len + 1).is_err());
    }

    #[test]
    fn positions_are_a_function_of_atoms_and_ids_parse_back(steps in prop::collection::vec(step(), 1..8)) {
        let prompt = build(&steps, PositionKind::Mrope).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let tokens = OmniTokens::tiny();
        let again = positions_from_atoms(&prompt.atoms, &tokens, PositionKind::Mrope)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&again, &prompt.positions);
        let mut parsed = PromptBuilder::new(tokens);
        parsed.extend(&prompt.token_ids, &prompt.items, PlaceholderForm::Expanded).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let parsed = parsed.build().map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&parsed.token_ids, &prompt.token_ids);
        prop_assert_eq!(&parsed.index_map.spans, &prompt.index_map.spans);
        prop_assert_eq!(&parsed.positions, &prompt.positions);
        let linear = build(&steps, PositionKind::Linear).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(linear.positions, Positions::linear(prompt.len()));
    }
}
