//! Reproduces every case of `fixtures/mrope_position_vectors.json` (computed by
//! transformers' Qwen3-Omni thinker `get_rope_index`) exactly, from expanded ids.

use std::sync::Arc;

use omniprefix::Result;
use omniprefix::canon::{ItemIdentity, ItemLayout};
use omniprefix::prompt::{OmniTokens, PlaceholderForm, Positions, PromptBuilder, positions_from_atoms};
use serde_json::Value;

use support::items::placeholder_item;

/// A test that can also fail outside omniprefix (a fixture that does not parse).
type TestResult<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

fn fixture() -> TestResult<Value> {
    let text = std::fs::read_to_string("fixtures/mrope_position_vectors.json")?;
    Ok(serde_json::from_str(&text)?)
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().into_iter().flatten().filter_map(|x| x.as_u64()).map(|x| x as u32).collect()
}

fn grids(v: &Value) -> Vec<[u32; 3]> {
    v.as_array()
        .into_iter()
        .flatten()
        .map(|g| {
            let g = u32s(g);
            [g[0], g[1], g[2]]
        })
        .collect()
}

/// The case's items: images, videos (with seconds per grid), audios.
fn case_items(tokens: &OmniTokens, case: &Value) -> Result<Vec<Arc<ItemIdentity>>> {
    let mut items = Vec::new();
    for grid_thw in grids(&case["image_grid_thw"]) {
        items.push(placeholder_item(tokens, items.len() as u128, ItemLayout::Image { grid_thw })?);
    }
    let seconds: Vec<f64> =
        case["second_per_grid"].as_array().into_iter().flatten().filter_map(Value::as_f64).collect();
    for (grid_thw, spg) in grids(&case["video_grid_thw"]).into_iter().zip(seconds) {
        let layout = ItemLayout::Video { grid_thw, seconds_per_grid: spg as f32 };
        items.push(placeholder_item(tokens, items.len() as u128, layout)?);
    }
    for mel_frames in u32s(&case["audio_mel_frames"]) {
        items.push(placeholder_item(tokens, items.len() as u128, ItemLayout::Audio { mel_frames })?);
    }
    Ok(items)
}

#[test]
fn every_fixture_case_matches_hf_get_rope_index() -> TestResult {
    let data = fixture()?;
    let tokens: OmniTokens = serde_json::from_value(data["special_ids"].clone())?;
    assert_eq!(tokens, OmniTokens::tiny());
    let cases = data["cases"].as_array().cloned().unwrap_or_default();
    assert_eq!(cases.len(), 8);
    for case in &cases {
        let name = case["name"].as_str().unwrap_or("?");
        let ids = u32s(&case["input_ids"]);
        let items = case_items(&tokens, case)?;
        let mut builder = PromptBuilder::new(tokens.clone());
        builder.extend(&ids, &items, PlaceholderForm::Expanded)?;
        let prompt = builder.build()?;
        assert_eq!(prompt.token_ids, ids, "{name}: token ids");
        let rows: Vec<Vec<i64>> = case["position_ids"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| r.as_array().into_iter().flatten().filter_map(Value::as_i64).collect())
            .collect();
        let rope_delta = case["rope_delta"].as_i64().unwrap_or(i64::MIN);
        assert_eq!(prompt.positions.axes().to_vec(), rows, "{name}: positions");
        assert_eq!(prompt.positions.rope_delta(), Some(rope_delta), "{name}: rope delta");
        let expected = Positions::given(
            (0..rows[0].len()).map(|i| [rows[0][i], rows[1][i], rows[2][i]]).collect(),
            rope_delta,
        );
        assert_eq!(prompt.positions, expected, "{name}: positions");
        // Positions are a pure function of the atoms and item layouts.
        assert_eq!(
            positions_from_atoms(&prompt.atoms, &tokens, Default::default())?,
            expected,
            "{name}: from atoms"
        );
        // Every placeholder position is in the index map and nothing else is.
        let pads: Vec<u32> = ids
            .iter()
            .enumerate()
            .filter(|(_, t)| tokens.placeholder_modality(**t).is_some())
            .map(|(p, _)| p as u32)
            .collect();
        assert_eq!(prompt.index_map.placeholders.iter().collect::<Vec<_>>(), pads, "{name}: index map");
    }
    Ok(())
}

#[test]
fn audio_in_video_from_unexpanded_ids_equals_the_expanded_case() -> TestResult {
    let data = fixture()?;
    let tokens = OmniTokens::tiny();
    let cases = data["cases"].as_array().cloned().unwrap_or_default();
    let case = cases.iter().find(|c| c["name"] == "audio_in_video").cloned().unwrap_or_default();
    let items = case_items(&tokens, &case)?;
    let mut expanded = PromptBuilder::new(tokens.clone());
    expanded.extend(&u32s(&case["input_ids"]), &items, PlaceholderForm::Expanded)?;
    let mut unexpanded = PromptBuilder::new(tokens.clone());
    unexpanded.extend(
        &[100, 101, 102, 503, 501, 504, 200, 201, 202],
        &items,
        PlaceholderForm::UnexpandedAudioInVideo,
    )?;
    let (a, b) = (expanded.build()?, unexpanded.build()?);
    assert_eq!(a.token_ids, b.token_ids);
    assert_eq!(a.positions, b.positions);
    assert_eq!(a.index_map.spans, b.index_map.spans);
    assert_eq!(b.index_map.spans.len(), 6, "video and audio interleave in 6 runs");
    Ok(())
}
