//! The talker stage against transformers' own `generate(return_audio=True)` on the tiny
//! full Omni fixture (`fixtures/tiny/omni_audio`, made by `fixtures/make_omni_audio.py`):
//! cases `text` (system + user text), `image` (a user turn with an image) and `round2`
//! (the image round, its reply, and a second user turn).

use std::sync::Arc;

use ndarray::{ArrayD, IxDyn};
use omniprefix::canon::{ItemContent, ItemLayout, ItemSpec, Modality, TensorView};
use omniprefix::engine::{Engine, EngineConfig, ItemInput, PlaceholderForm, Request};
use omniprefix::speech::{ASSISTANT_ROWS, ChatIds, TalkerLayout};
use support::reference::{Reference, TestResult, model_dir};

const MODEL: &str = "omni_audio";
const CASES: [&str; 3] = ["text", "image", "round2"];

fn reference() -> TestResult<Reference> {
    Reference::open_file(MODEL, "audio_reference.safetensors")
}

fn chat_ids() -> TestResult<ChatIds> {
    let text = std::fs::read_to_string(model_dir(MODEL).join("config.json"))?;
    Ok(ChatIds::from_config(&serde_json::from_str(&text)?)?)
}

/// An image's layout, its encoder rows and its DeepStack levels.
type ImageRows = (ItemLayout, Arc<ndarray::Array2<f32>>, Arc<Vec<ndarray::Array2<f32>>>);

/// Case `case`'s thinker prompt with its image (HF's encoder rows and DeepStack level given).
struct Case {
    ids: Vec<u32>,
    items: Vec<ImageRows>,
    content: ArrayD<u8>,
}

impl Case {
    fn open(hf: &Reference, case: &str) -> TestResult<Self> {
        let ids = hf
            .ints(&format!("{case}.input_ids"))?
            .iter()
            .map(|&t| u32::try_from(t))
            .collect::<Result<_, _>>()?;
        let mut items = Vec::new();
        if let Ok(grids) = hf.ints(&format!("{case}.image_grid_thw")) {
            for (j, grid) in grids.chunks(3).enumerate() {
                let grid_thw = [grid[0], grid[1], grid[2]].map(|g| g as u32);
                let embeds = hf.matrix(&format!("{case}.item.{j}.embeds"))?.clone();
                let deepstack = (0..)
                    .map_while(|k| hf.matrix(&format!("{case}.item.{j}.deepstack.{k}")).ok().cloned())
                    .collect();
                items.push((ItemLayout::Image { grid_thw }, Arc::new(embeds), Arc::new(deepstack)));
            }
        }
        Ok(Case { ids, items, content: ArrayD::from_elem(IxDyn(&[8, 8, 3]), 7u8) })
    }

    fn request(&self) -> Request<'_> {
        let items = self
            .items
            .iter()
            .map(|(layout, rows, deepstack)| ItemInput {
                spec: ItemSpec {
                    modality: Modality::Image,
                    layout: *layout,
                    content: ItemContent::Tensor(TensorView::U8(self.content.view())),
                    params: Default::default(),
                },
                embeddings: Some(Arc::clone(rows)),
                deepstack: Some(Arc::clone(deepstack)),
                routing_hash: None,
            })
            .collect();
        Request {
            token_ids: self.ids.clone(),
            placeholders: PlaceholderForm::Expanded,
            items,
            ..Default::default()
        }
    }
}

/// The talker's input ids and rotary positions (prefill rows and the decode delta) equal
/// HF's for every case: user turns only (the system turn and round 1's reply dropped), the
/// image's M-RoPE rows recomputed over the talker's own shorter sequence.
#[test]
fn the_talker_layout_equals_hf_ids_and_positions() -> TestResult {
    let hf = reference()?;
    let chat = chat_ids()?;
    let engine = Engine::from_dir(&model_dir(MODEL), EngineConfig::default())?;
    for case in CASES {
        let c = Case::open(&hf, case)?;
        let prepared = engine.prepare(c.request())?;
        let layout = TalkerLayout::of(prepared.prompt(), &chat, engine.tokens())?;
        let want_ids: Vec<u32> =
            hf.ints(&format!("{case}.talker_input_ids"))?.iter().map(|&t| t as u32).collect();
        assert_eq!(layout.ids, want_ids, "{case}: talker input ids");
        assert_eq!(layout.prefill_rows(), want_ids.len());
        assert_eq!(
            layout.is_item.iter().filter(|&&m| m).count(),
            c.items.iter().map(|i| i.1.nrows()).sum::<usize>()
        );
        let want_pos = hf.ints(&format!("{case}.talker_position_ids"))?;
        let axes = layout.positions.axes();
        let rows = layout.prefill_rows();
        for (a, axis) in axes.iter().enumerate() {
            assert_eq!(axis[..], want_pos[a * rows..(a + 1) * rows], "{case}: axis {a}");
        }
        let delta = hf.ints(&format!("{case}.talker_rope_delta"))?[0];
        assert_eq!(layout.positions.rope_delta().unwrap_or(0), delta, "{case}: rope delta");
        assert_eq!(layout.ids[rows - ASSISTANT_ROWS..], [chat.tts_pad_token_id; ASSISTANT_ROWS]);
    }
    Ok(())
}
