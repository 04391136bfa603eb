//! Builder tests: the workload scenarios expand to their documented token
//! counts, and every class of bad input returns its own error variant with
//! the builder left unchanged.

use std::sync::Arc;

use serde_json::Value;

use super::*;
use crate::canon::{Evidence, Fingerprint, ItemIdentity, ItemLayout, Modality};
use crate::error::{Error, RequestError, Result};

fn item(n: u128, layout: ItemLayout) -> Arc<ItemIdentity> {
    let modality = layout.modality();
    let num_tokens = OmniTokens::tiny().placeholder_count(&layout).unwrap_or(0);
    Arc::new(ItemIdentity {
        fingerprint: Fingerprint(n),
        evidence: Evidence::Unvalidated,
        modality,
        layout,
        num_tokens,
        content_bytes: 0,
    })
}

fn image(n: u128) -> Arc<ItemIdentity> {
    item(n, ItemLayout::Image { grid_thw: [1, 4, 6] })
}

fn video(n: u128) -> Arc<ItemIdentity> {
    item(n, ItemLayout::Video { grid_thw: [3, 4, 4], seconds_per_grid: 1.0 })
}

fn audio(n: u128) -> Arc<ItemIdentity> {
    item(n, ItemLayout::Audio { mel_frames: 300 })
}

/// The Qwen3-Omni workload items of `fixtures/qwen3_omni.json`, by name.
fn workload_item(name: &str) -> Arc<ItemIdentity> {
    match name {
        "image" => item(1, ItemLayout::Image { grid_thw: [1, 44, 80] }),
        "audio" => item(2, ItemLayout::Audio { mel_frames: 3000 }),
        // 10 s at 2 fps, temporal patch 2: one grid step per second.
        _ => item(3, ItemLayout::Video { grid_thw: [10, 40, 72], seconds_per_grid: 1.0 }),
    }
}

fn fixture(path: &str) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    serde_json::from_str(&text).unwrap_or_default()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().into_iter().flatten().filter_map(Value::as_u64).map(|x| x as u32).collect()
}

fn unexpanded(ids: &[u32], items: &[Arc<ItemIdentity>]) -> Result<CanonicalPrompt> {
    let mut builder = PromptBuilder::new(OmniTokens::qwen3_omni());
    builder.extend(ids, items, PlaceholderForm::Unexpanded)?;
    builder.build()
}

#[test]
fn workload_item_counts_match_the_fixture() {
    let data = fixture("fixtures/qwen3_omni.json");
    for name in ["image", "audio", "video"] {
        let expected = data["items"][name]["num_placeholder_tokens"].as_u64();
        assert_eq!(Some(workload_item(name).num_tokens as u64), expected, "{name}");
    }
}

#[test]
fn mixed_prompt_expands_to_8546_tokens_at_the_documented_offsets() -> Result<()> {
    let mixed = fixture("fixtures/qwen3_omni.json")["mixed"].clone();
    let items: Vec<_> = ["audio", "image", "video"].into_iter().map(workload_item).collect();
    let prompt = unexpanded(&ids(&mixed["token_ids_unexpanded"]), &items)?;
    assert_eq!(prompt.len(), 8546);
    assert_eq!(prompt.index_map.placeholders.len(), 8470);
    let spans: Vec<(u32, usize)> = prompt.index_map.spans.iter().map(|s| (s.start, s.rows.len())).collect();
    assert_eq!(spans, vec![(44, 390), (436, 880), (1318, 7200)]);
    for range in mixed["placeholder_ranges"].as_array().into_iter().flatten() {
        let (offset, length) = (range["offset"].as_u64().unwrap_or(0), range["length"].as_u64().unwrap_or(0));
        let pad = prompt.token_ids[offset as usize];
        assert!(prompt.token_ids[offset as usize..(offset + length) as usize].iter().all(|&t| t == pad));
        assert_ne!(prompt.token_ids[offset as usize - 1], pad);
    }
    assert_eq!(prompt.positions.kind(), PositionKind::Mrope);
    assert_eq!(prompt.positions.axes()[0].len(), 8546);
    Ok(())
}

#[test]
fn multi_round_rounds_expand_and_each_extends_the_last() -> Result<()> {
    let rounds = fixture("fixtures/scenarios.json")["multi_round"]["rounds"].clone();
    let mut previous: Option<CanonicalPrompt> = None;
    let mut lengths = Vec::new();
    for round in rounds.as_array().into_iter().flatten() {
        let items: Vec<_> = round["items_in_order"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|n| workload_item(n.as_str().unwrap_or("")))
            .collect();
        let prompt = unexpanded(&ids(&round["token_ids_unexpanded"]), &items)?;
        if let Some(prev) = &previous {
            let n = prev.len();
            assert_eq!(prompt.token_ids[..n], prev.token_ids[..], "history is re-sent verbatim");
            let prefix = prompt.positions.slice(0..n)?;
            assert_eq!(prev.positions.axes(), prefix.axes(), "a prefix keeps its positions");
        }
        lengths.push(prompt.len());
        previous = Some(prompt);
    }
    // unexpanded length - pads + item tokens (image 880, audio 390, video 7200)
    assert_eq!(lengths, vec![57 - 1 + 880, 95 - 2 + 1270, 137 - 3 + 8470, 172 - 3 + 8470]);
    Ok(())
}

#[test]
fn rfc_text_pair_has_67_and_57_tokens_with_linear_mrope() -> Result<()> {
    let pair = fixture("fixtures/scenarios.json")["rfc_text_pair"].clone();
    for (key, len) in [("prompt1", 67), ("prompt2", 57)] {
        let prompt = unexpanded(&ids(&pair[key]), &[])?;
        assert_eq!(prompt.len(), len);
        assert_eq!(prompt.atoms.len(), 1, "one merged text run");
        let linear: Vec<i64> = (0..len as i64).collect();
        assert_eq!(prompt.positions.axes(), [linear.clone(), linear.clone(), linear]);
        assert_eq!(prompt.positions.rope_delta(), Some(0));
    }
    Ok(())
}

#[test]
fn pushes_merge_text_and_record_spans() -> Result<()> {
    let mut builder =
        PromptBuilder::new(OmniTokens::tiny()).with_tenant(9).with_positions(PositionKind::Linear);
    builder.push_text(&[1, 2])?.push_text(&[3])?.push_item(image(1))?.push_text(&[4])?;
    let prompt = builder.build()?;
    assert_eq!(prompt.tenant, 9);
    assert_eq!(prompt.token_ids, vec![1, 2, 3, 500, 500, 500, 500, 500, 500, 4]);
    assert!(matches!(&prompt.atoms[0], Atom::Text(run) if run == &vec![1, 2, 3]));
    assert!(matches!(&prompt.atoms[1], Atom::Item { rows, .. } if *rows == (0..6)));
    assert_eq!(prompt.index_map.spans, vec![ItemSpan { item: 0, rows: 0..6, start: 3 }]);
    assert_eq!(prompt.positions, Positions::linear(10));
    Ok(())
}

#[test]
fn same_item_twice_gets_two_occurrences_and_distinct_positions() -> Result<()> {
    let mut builder = PromptBuilder::new(OmniTokens::tiny());
    let img = image(1);
    builder.push_item(Arc::clone(&img))?.push_item(img)?;
    let prompt = builder.build()?;
    let [t, h, w] = prompt.positions.axes();
    let rope_delta = prompt.positions.rope_delta().expect("mrope");
    // second image starts one past the first one's largest position (w = 2)
    assert_eq!(t, vec![0, 0, 0, 0, 0, 0, 3, 3, 3, 3, 3, 3]);
    assert_eq!(h, vec![0, 0, 0, 1, 1, 1, 3, 3, 3, 4, 4, 4]);
    assert_eq!(w, vec![0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]);
    assert_eq!(rope_delta, 6 - 12);
    assert_eq!(prompt.items.len(), 2);
    Ok(())
}

#[test]
fn placeholder_run_shorter_than_its_item_is_rejected() {
    let mut builder = PromptBuilder::new(OmniTokens::tiny());
    let err = builder.extend(&[1, 503, 500, 500, 504], &[image(1)], PlaceholderForm::Expanded).err();
    assert!(matches!(
        err,
        Some(Error::Request(RequestError::PlaceholderCountMismatch {
            item: 0,
            position: 2,
            expected: 6,
            found: 2
        }))
    ));
    assert!(builder.is_empty(), "rejected request leaves the builder unchanged");
}

#[test]
fn more_placeholders_than_items_is_rejected() {
    let mut builder = PromptBuilder::new(OmniTokens::tiny());
    builder.push_text(&[7]).ok();
    let err = builder.extend(&[500, 1, 500], &[image(1)], PlaceholderForm::Unexpanded).err();
    assert!(matches!(
        err,
        Some(Error::Request(RequestError::MissingItem {
            position: 8,
            modality: Modality::Image,
            available: 1
        }))
    ));
    assert_eq!(builder.len(), 1, "rejected request leaves the builder unchanged");
}

#[test]
fn fewer_placeholders_than_items_is_rejected() {
    let mut builder = PromptBuilder::new(OmniTokens::tiny());
    let err = builder.extend(&[500, 1], &[image(1), audio(2), image(3)], PlaceholderForm::Unexpanded).err();
    assert!(matches!(
        err,
        Some(Error::Request(RequestError::UnusedItems { first: 2, modality: Modality::Image, count: 1 }))
    ));
}

#[test]
fn wrong_modality_for_audio_in_video_is_rejected() {
    let mut builder = PromptBuilder::new(OmniTokens::tiny());
    let err = builder.push_audio_in_video(image(1), audio(2)).err();
    assert!(matches!(
        err,
        Some(Error::Request(RequestError::ItemModalityMismatch {
            item: 0,
            expected: Modality::Video,
            found: Modality::Image
        }))
    ));
}

#[test]
fn placeholder_id_in_text_is_rejected() {
    let mut builder = PromptBuilder::new(OmniTokens::tiny());
    let err = builder.push_text(&[1, 2, 502]).err();
    assert!(matches!(err, Some(Error::Request(RequestError::StrayPlaceholder { position: 2, token: 502 }))));
    assert!(builder.is_empty());
}

#[test]
fn empty_prompt_is_rejected() {
    let builder = PromptBuilder::new(OmniTokens::tiny());
    assert!(matches!(builder.build(), Err(Error::Request(RequestError::EmptyPrompt))));
}

#[test]
fn item_with_zero_tokens_is_rejected() {
    let mut builder = PromptBuilder::new(OmniTokens::tiny());
    let err = builder.push_item(item(1, ItemLayout::Audio { mel_frames: 0 })).err();
    assert!(matches!(err, Some(Error::Request(RequestError::EmptyItem { item: 0, .. }))));
}

#[test]
fn layouts_that_disagree_are_rejected() {
    let mut builder = PromptBuilder::new(OmniTokens::tiny());
    let mut wrong_count = (*image(1)).clone();
    wrong_count.num_tokens = 5;
    let err = builder.push_item(Arc::new(wrong_count)).err();
    assert!(
        matches!(err, Some(Error::Request(RequestError::InvalidLayout { item: 0, field: "num_tokens", .. }))),
        "{err:?}"
    );
    let odd_grid = item(2, ItemLayout::Image { grid_thw: [1, 3, 4] });
    let err = builder.push_item(odd_grid).err();
    assert!(
        matches!(
            err,
            Some(Error::Request(RequestError::GridNotMergeable { item: 0, grid_thw: [1, 3, 4], merge: 2 }))
        ),
        "{err:?}"
    );
    let mut mislabeled = (*image(3)).clone();
    mislabeled.modality = Modality::Audio;
    let err = builder.push_item(Arc::new(mislabeled)).err();
    assert!(
        matches!(err, Some(Error::Request(RequestError::InvalidLayout { item: 0, field: "kind", .. }))),
        "{err:?}"
    );
    let nan = item(4, ItemLayout::Video { grid_thw: [1, 2, 2], seconds_per_grid: f32::NAN });
    let err = builder.push_item(nan).err();
    assert!(
        matches!(
            err,
            Some(Error::Request(RequestError::InvalidLayout { item: 0, field: "seconds_per_grid", .. }))
        ),
        "{err:?}"
    );
    let far = item(5, ItemLayout::Video { grid_thw: [2, 2, 2], seconds_per_grid: 1e30 });
    let err = builder.push_item(far).err();
    assert!(
        matches!(
            err,
            Some(Error::Request(RequestError::InvalidLayout { item: 0, field: "seconds_per_grid", .. }))
        ),
        "{err:?}"
    );
    let mut too_big = (*image(6)).clone();
    too_big.layout = ItemLayout::Image { grid_thw: [1 << 16, 1 << 10, 1 << 10] };
    too_big.num_tokens = 1 << 34;
    let err = builder.push_item(Arc::new(too_big)).err();
    assert!(
        matches!(err, Some(Error::Request(RequestError::PromptTooLong { .. }))),
        "prompt past u32 positions: {err:?}"
    );
    assert!(builder.is_empty());
}

#[test]
fn malformed_audio_in_video_is_rejected() {
    let tokens = OmniTokens::tiny();
    // expanded: all video then all audio is not the time-interleaved order
    let mut expanded = vec![503, 505];
    expanded.extend([501; 12]);
    expanded.extend([502; 39]);
    expanded.extend([506, 504]);
    let mut builder = PromptBuilder::new(tokens.clone());
    let err = builder.extend(&expanded, &[video(1), audio(2)], PlaceholderForm::Expanded).err();
    assert!(matches!(
        err,
        Some(Error::Request(RequestError::MalformedAudioInVideo { item: 0, position: 6, .. }))
    ));
    // unexpanded: the video pad must sit between vision_start and vision_end
    let err =
        builder.extend(&[1, 501, 504], &[video(1), audio(2)], PlaceholderForm::UnexpandedAudioInVideo).err();
    assert!(matches!(
        err,
        Some(Error::Request(RequestError::MalformedAudioInVideo { item: 0, position: 1, .. }))
    ));
    // an audio pushed right after a video would be read as audio-in-video
    builder.push_item(video(1)).ok();
    let err = builder.push_item(audio(2)).err();
    assert!(matches!(
        err,
        Some(Error::Request(RequestError::MalformedAudioInVideo { item: 1, position: 12, .. }))
    ));
    // a video asking for its audio when none is left
    let mut builder = PromptBuilder::new(tokens);
    let err = builder.extend(&[503, 501, 504], &[video(1)], PlaceholderForm::UnexpandedAudioInVideo).err();
    assert!(matches!(err, Some(Error::Request(RequestError::MissingItem { modality: Modality::Audio, .. }))));
}

#[test]
fn malformed_atoms_are_rejected_by_the_position_function() {
    let img = image(1);
    let atoms = vec![Atom::Item { id: Arc::clone(&img), rows: 0..3 }, Atom::Text(vec![1])];
    let err = positions_from_atoms(&atoms, &OmniTokens::tiny(), PositionKind::Mrope).err();
    assert!(matches!(err, Some(Error::Request(RequestError::MalformedAtoms { atom: 1, .. }))));
    let atoms = vec![Atom::Item { id: img, rows: 3..6 }];
    let err = positions_from_atoms(&atoms, &OmniTokens::tiny(), PositionKind::Mrope).err();
    assert!(matches!(err, Some(Error::Request(RequestError::MalformedAtoms { atom: 0, .. }))));
}

#[test]
fn placeholders_are_found_in_and_between_scan_groups() -> Result<()> {
    // The scan compares 32 ids at a time: a pad at each edge of a group and in the tail.
    for at in [0, 31, 32, 63, 64, 70] {
        let mut ids: Vec<u32> = (0..71).map(|i| i % 400).collect();
        ids[at] = 500;
        let mut builder = PromptBuilder::new(OmniTokens::tiny());
        let err = builder.push_text(&ids).err();
        assert!(
            matches!(err, Some(Error::Request(RequestError::StrayPlaceholder { position, token: 500 })) if position == at),
            "pad at {at}"
        );
        builder.extend(&ids, &[image(1)], PlaceholderForm::Unexpanded)?;
        assert_eq!(builder.build()?.index_map.spans[0].start as usize, at, "pad at {at}");
    }
    Ok(())
}

#[test]
fn a_rejected_extend_leaves_a_non_empty_builder_as_it_was() -> Result<()> {
    let mut builder = PromptBuilder::new(OmniTokens::tiny());
    builder.push_text(&[1, 2])?.push_item(image(1))?.push_text(&[3])?;
    let before = builder.build()?;
    // Text that grows the last run, an image, more text, then a second image pad with no item.
    let ids: Vec<u32> = (10..50).chain([503, 500, 504]).chain(60..100).chain([500]).collect();
    let err = builder.extend(&ids, &[image(2)], PlaceholderForm::Unexpanded).err();
    assert!(
        matches!(err, Some(Error::Request(RequestError::MissingItem { modality: Modality::Image, .. }))),
        "{err:?}"
    );
    let after = builder.build()?;
    assert_eq!(after.token_ids, before.token_ids);
    assert_eq!(after.atoms.len(), before.atoms.len());
    assert!(matches!(after.atoms.last(), Some(Atom::Text(run)) if run == &vec![3]));
    assert_eq!(after.items.len(), before.items.len());
    assert_eq!(after.index_map.spans, before.index_map.spans);
    assert_eq!(after.index_map.placeholders, before.index_map.placeholders);
    assert_eq!(after.positions, before.positions);
    Ok(())
}

#[test]
fn generated_tokens_continue_where_the_prompt_built_from_atoms_would() -> Result<()> {
    // A prompt ending in an image, then "generated" text pushed one token at a
    // time, must get exactly the positions the builder gives the same text.
    let tokens = OmniTokens::qwen3_omni();
    let items = [image(7)];
    let head = [1, 2, tokens.vision_start_token_id, tokens.image_token_id, tokens.vision_end_token_id];
    let mut sequence = unexpanded(&head, &items)?;
    let reply = [11, 12, 13];
    for t in reply {
        sequence.push_text(t);
    }
    let whole = unexpanded(&[&head[..], &reply[..]].concat(), &items)?;
    assert_eq!(sequence.positions, whole.positions);
    assert_eq!(sequence.token_ids, whole.token_ids);
    let atoms: usize = sequence.atoms.iter().map(Atom::len).sum();
    assert_eq!(atoms, sequence.len());
    assert!(
        matches!(sequence.atoms.last(), Some(Atom::Text(ids)) if ids == &[tokens.vision_end_token_id, 11, 12, 13][..])
    );
    // 1-D positions continue too.
    let mut linear = Positions::linear(5);
    linear.append_text(2);
    assert_eq!(linear, Positions::linear(7));
    Ok(())
}
