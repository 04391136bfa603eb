//! The tiny Omni model and image items of the engine tests (`tests/engine/engine_api.rs`,
//! `tests/engine/served.rs`): a 4x4x3 picture whose 1x4x4 patch grid merges into 4
//! tokens, its stand-in embeddings, and prompts around its unexpanded
//! placeholder (the tiny ids of `OmniTokens::tiny()`).

use std::sync::Arc;

use ndarray::{Array2, ArrayD, IxDyn};
use omniprefix::canon::{ItemContent, ItemLayout, ItemSpec, Modality, TensorView};
use omniprefix::engine::ItemInput;
use omniprefix::model::Config;
use omniprefix::prompt::OmniTokens;

/// The model's width (and every embedding's).
pub const HIDDEN: usize = 32;

/// A random tiny Qwen3-Omni MoE thinker: 2 layers, 4 heads (2 KV), vocab 512, 4 experts (2 active).
pub fn model() -> Config {
    Config::tiny_qwen3_omni_moe(HIDDEN, 2, 4, 2, 512, 4, 2)
}

/// The pixels of image `seed`.
pub fn pixels(seed: u8) -> ArrayD<u8> {
    ArrayD::from_shape_fn(IxDyn(&[4, 4, 3]), |d| seed.wrapping_add(d[0] as u8 * 7 + d[1] as u8))
}

/// An image item with a 2x2-token grid (4 placeholders) and its content.
pub fn image<'a>(content: &'a ArrayD<u8>, embeddings: Option<Array2<f32>>) -> ItemInput<'a> {
    ItemInput {
        spec: ItemSpec {
            modality: Modality::Image,
            layout: ItemLayout::Image { grid_thw: [1, 4, 4] },
            content: ItemContent::Tensor(TensorView::U8(content.view())),
            params: Default::default(),
        },
        embeddings: embeddings.map(Arc::new),
        deepstack: None,
        routing_hash: None,
    }
}

/// Deterministic `[n, cols]` rows seeded by `seed`.
pub fn rows(n: usize, cols: usize, seed: f32) -> Array2<f32> {
    Array2::from_shape_fn((n, cols), |(r, c)| ((r * cols + c) as f32 * 0.37 + seed).sin())
}

/// An unexpanded image in the tiny vocabulary (`OmniTokens::tiny()`, 500..507):
/// `vision_start image_pad vision_end`.
pub fn image_markers() -> [u32; 3] {
    OmniTokens::tiny().unexpanded_item(Modality::Image)
}

/// Text, an unexpanded image ([`image_markers`]), text.
pub fn with_image(head: &[u32], tail: &[u32]) -> Vec<u32> {
    [head, &image_markers()[..], tail].concat()
}
