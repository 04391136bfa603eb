//! The JSON request-file format of `omniprefix hidden` (documented in `docs/request-format.md`).
//!
//! ```json
//! {
//!   "tenant": 0,
//!   "expanded": false,
//!   "audio_in_video": false,
//!   "segments": [
//!     {"text": [151644, 872, 198, 151652]},
//!     {"item": {"modality": "image",
//!               "layout": {"kind": "image", "grid_thw": [1, 4, 6]},
//!               "content": {"file": "img.safetensors", "tensor": "pixels"},
//!               "embeddings": {"file": "img.safetensors", "tensor": "emb"},
//!               "deepstack": {"file": "img.safetensors", "tensor": "deepstack"}}},
//!     {"text": [151653, 151645]}
//!   ]
//! }
//! ```
//!
//! Text segments are concatenated in order. With `"expanded": false` (the
//! default) an item segment stands for its placeholder: the engine expands it
//! to the item's token count. With `"expanded": true` the text already holds
//! every placeholder id and item segments only declare the items, in order.
//! `deepstack` (optional) names an item's DeepStack levels `[levels, rows, hidden]`.
//! Files are relative to the request file's folder.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ndarray::{Array2, ArrayD, IxDyn};
use safetensors::{Dtype as StDtype, SafeTensors};
use serde::Deserialize;

use crate::batch::DeepStack;
use crate::canon::{ItemContent, ItemLayout, ItemSpec, Modality, TensorView};
use crate::engine::{ItemInput, PlaceholderForm, Request};
use crate::error::{Error, IoError, RequestFileError, Result};
use crate::prompt::{OmniTokens, TenantSalt};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    tenant: TenantSalt,
    #[serde(default)]
    expanded: bool,
    #[serde(default)]
    audio_in_video: bool,
    segments: Vec<RawSegment>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
enum RawSegment {
    Text(Vec<u32>),
    Item(RawItem),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawItem {
    modality: Modality,
    layout: ItemLayout,
    content: TensorRef,
    embeddings: TensorRef,
    /// DeepStack levels `[levels, rows, hidden]` of a vision item (Qwen3-Omni).
    #[serde(default)]
    deepstack: Option<TensorRef>,
    #[serde(default)]
    params: BTreeMap<String, String>,
}

/// A tensor inside a safetensors file, relative to the request file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct TensorRef {
    file: PathBuf,
    tensor: String,
}

/// An item's content tensor, owned, in its stored dtype.
#[derive(Debug, Clone)]
enum OwnedTensor {
    U8(ArrayD<u8>),
    I32(ArrayD<i32>),
    I64(ArrayD<i64>),
    F16(ArrayD<half::f16>),
    BF16(ArrayD<half::bf16>),
    F32(ArrayD<f32>),
}

impl OwnedTensor {
    fn view(&self) -> TensorView<'_> {
        match self {
            OwnedTensor::U8(a) => TensorView::U8(a.view()),
            OwnedTensor::I32(a) => TensorView::I32(a.view()),
            OwnedTensor::I64(a) => TensorView::I64(a.view()),
            OwnedTensor::F16(a) => TensorView::F16(a.view()),
            OwnedTensor::BF16(a) => TensorView::BF16(a.view()),
            OwnedTensor::F32(a) => TensorView::F32(a.view()),
        }
    }
}

#[derive(Debug, Clone)]
struct LoadedItem {
    modality: Modality,
    layout: ItemLayout,
    params: BTreeMap<String, String>,
    content: OwnedTensor,
    embeddings: Arc<Array2<f32>>,
    deepstack: Option<DeepStack>,
}

/// A request file read into memory: ids, items' content and embeddings.
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("omniprefix-doc-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// let path = dir.join("req.json");
/// std::fs::write(&path, r#"{"segments": [{"text": [1, 2, 3]}, {"text": [4]}]}"#).unwrap();
/// let file = omniprefix::request_file::RequestFile::load(&path)?;
/// let tokens = omniprefix::prompt::OmniTokens::qwen3_omni();
/// assert_eq!(file.request(&tokens).token_ids, vec![1, 2, 3, 4]);
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct RequestFile {
    tenant: TenantSalt,
    expanded: bool,
    audio_in_video: bool,
    segments: Vec<Segment>,
    items: Vec<LoadedItem>,
}

#[derive(Debug, Clone)]
enum Segment {
    Text(Vec<u32>),
    /// Index into `items`.
    Item(usize),
}

impl RequestFile {
    /// Reads and checks a request file and every tensor it names.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| IoError::read(path, source))?;
        Self::parse(&text, path)
    }

    /// Parses request JSON whose tensor files are relative to `path`'s folder.
    pub fn parse(json: &str, path: &Path) -> Result<Self> {
        let raw: RawFile = serde_json::from_str(json).map_err(|e| RequestFileError::Format {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        let mut files = TensorFiles::default();
        let mut segments = Vec::with_capacity(raw.segments.len());
        let mut items = Vec::new();
        for segment in raw.segments {
            match segment {
                RawSegment::Text(ids) => segments.push(Segment::Text(ids)),
                RawSegment::Item(item) => {
                    let content = files.content(base, &item.content)?;
                    let embeddings = Arc::new(files.embeddings(base, &item.embeddings)?);
                    let deepstack = match &item.deepstack {
                        Some(r) => Some(Arc::new(files.deepstack(base, r, embeddings.dim())?)),
                        None => None,
                    };
                    segments.push(Segment::Item(items.len()));
                    items.push(LoadedItem {
                        modality: item.modality,
                        layout: item.layout,
                        params: item.params,
                        content,
                        embeddings,
                        deepstack,
                    });
                }
            }
        }
        Ok(RequestFile {
            tenant: raw.tenant,
            expanded: raw.expanded,
            audio_in_video: raw.audio_in_video,
            segments,
            items,
        })
    }

    /// The engine request, borrowing the loaded tensors; unexpanded item
    /// segments become one pad id of `tokens`.
    pub fn request(&self, tokens: &OmniTokens) -> Request<'_> {
        let mut token_ids = Vec::new();
        for segment in &self.segments {
            match segment {
                Segment::Text(ids) => token_ids.extend_from_slice(ids),
                Segment::Item(i) if !self.expanded => {
                    if let Some(item) = self.items.get(*i) {
                        token_ids.push(tokens.pad_id(item.modality));
                    }
                }
                Segment::Item(_) => {}
            }
        }
        let placeholders = match (self.expanded, self.audio_in_video) {
            (true, _) => PlaceholderForm::Expanded,
            (false, false) => PlaceholderForm::Unexpanded,
            (false, true) => PlaceholderForm::UnexpandedAudioInVideo,
        };
        let items = self
            .items
            .iter()
            .map(|item| ItemInput {
                spec: ItemSpec {
                    modality: item.modality,
                    layout: item.layout,
                    content: ItemContent::Tensor(item.content.view()),
                    params: item.params.clone(),
                },
                embeddings: Some(Arc::clone(&item.embeddings)),
                deepstack: item.deepstack.clone(),
            })
            .collect();
        Request { tenant: self.tenant, token_ids, placeholders, items, ..Default::default() }
    }
}

/// Safetensors files read once per request file.
#[derive(Default)]
struct TensorFiles {
    bytes: BTreeMap<PathBuf, Vec<u8>>,
}

impl TensorFiles {
    /// The raw bytes, dtype and shape of `r`.
    fn tensor(&mut self, base: &Path, r: &TensorRef) -> Result<(StDtype, Vec<usize>, Vec<u8>)> {
        let path = base.join(&r.file);
        if !self.bytes.contains_key(&path) {
            let data = std::fs::read(&path).map_err(|source| IoError::read(&path, source))?;
            self.bytes.insert(path.clone(), data);
        }
        let data = self.bytes.get(&path).map(Vec::as_slice).unwrap_or_default();
        let st = SafeTensors::deserialize(data).map_err(|e| RequestFileError::Safetensors {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let view = st.tensor(&r.tensor).map_err(|_| RequestFileError::TensorNotInFile {
            path: path.display().to_string(),
            tensor: r.tensor.clone(),
        })?;
        Ok((view.dtype(), view.shape().to_vec(), view.data().to_vec()))
    }

    fn content(&mut self, base: &Path, r: &TensorRef) -> Result<OwnedTensor> {
        let (dtype, shape, data) = self.tensor(base, r)?;
        let shaped = |e: ndarray::ShapeError| self::shape_error(base, r, e);
        Ok(match dtype {
            StDtype::U8 => OwnedTensor::U8(ArrayD::from_shape_vec(IxDyn(&shape), data).map_err(shaped)?),
            StDtype::I32 => OwnedTensor::I32(
                ArrayD::from_shape_vec(IxDyn(&shape), bytemuck::pod_collect_to_vec(&data)).map_err(shaped)?,
            ),
            StDtype::I64 => OwnedTensor::I64(
                ArrayD::from_shape_vec(IxDyn(&shape), bytemuck::pod_collect_to_vec(&data)).map_err(shaped)?,
            ),
            StDtype::F16 => OwnedTensor::F16(
                ArrayD::from_shape_vec(IxDyn(&shape), bytemuck::pod_collect_to_vec(&data)).map_err(shaped)?,
            ),
            StDtype::BF16 => OwnedTensor::BF16(
                ArrayD::from_shape_vec(IxDyn(&shape), bytemuck::pod_collect_to_vec(&data)).map_err(shaped)?,
            ),
            StDtype::F32 => OwnedTensor::F32(
                ArrayD::from_shape_vec(IxDyn(&shape), bytemuck::pod_collect_to_vec(&data)).map_err(shaped)?,
            ),
            other => {
                return Err(request_tensor(
                    base,
                    r,
                    "dtype u8, i32, i64, f16, bf16 or f32".into(),
                    format!("{other:?}"),
                ));
            }
        })
    }

    /// A float tensor as f32 values (f16 / bf16 widened) with its shape.
    fn floats(&mut self, base: &Path, r: &TensorRef, what: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let (dtype, shape, data) = self.tensor(base, r)?;
        let values: Vec<f32> = match dtype {
            StDtype::F32 => bytemuck::pod_collect_to_vec(&data),
            StDtype::F16 => {
                bytemuck::pod_collect_to_vec::<u8, half::f16>(&data).into_iter().map(f32::from).collect()
            }
            StDtype::BF16 => {
                bytemuck::pod_collect_to_vec::<u8, half::bf16>(&data).into_iter().map(f32::from).collect()
            }
            other => {
                return Err(request_tensor(
                    base,
                    r,
                    format!("{what} in f32, f16 or bf16"),
                    format!("dtype {other:?}"),
                ));
            }
        };
        Ok((shape, values))
    }

    /// Embeddings `[rows, hidden]` as f32 (f16 / bf16 widened).
    fn embeddings(&mut self, base: &Path, r: &TensorRef) -> Result<Array2<f32>> {
        let (shape, values) = self.floats(base, r, "embeddings")?;
        let &[rows, cols] = shape.as_slice() else {
            return Err(request_tensor(
                base,
                r,
                "embeddings of shape [rows, hidden]".into(),
                format!("shape {shape:?}"),
            ));
        };
        Array2::from_shape_vec((rows, cols), values).map_err(|e| shape_error(base, r, e))
    }

    /// DeepStack levels `[levels, rows, hidden]` (at least one level) of an item whose
    /// embeddings are `[rows, hidden]`, split into one matrix per level.
    fn deepstack(
        &mut self, base: &Path, r: &TensorRef, (rows, cols): (usize, usize),
    ) -> Result<Vec<Array2<f32>>> {
        let (shape, values) = self.floats(base, r, "DeepStack levels")?;
        let levels = match shape.as_slice() {
            &[levels, level_rows, level_cols] if levels > 0 && level_rows == rows && level_cols == cols => {
                levels
            }
            _ => {
                let expected = format!(
                    "DeepStack of shape [levels >= 1, {rows}, {cols}] (the embeddings' rows and hidden)"
                );
                return Err(request_tensor(base, r, expected, format!("shape {shape:?}")));
            }
        };
        let per_level = rows * cols;
        (0..levels)
            .map(|l| {
                let level = values.get(l * per_level..(l + 1) * per_level).unwrap_or_default().to_vec();
                Array2::from_shape_vec((rows, cols), level).map_err(|e| shape_error(base, r, e))
            })
            .collect()
    }
}

fn request_tensor(base: &Path, r: &TensorRef, expected: String, found: String) -> Error {
    RequestFileError::Tensor {
        path: base.join(&r.file).display().to_string(),
        tensor: r.tensor.clone(),
        expected,
        found,
    }
    .into()
}

fn shape_error(base: &Path, r: &TensorRef, e: ndarray::ShapeError) -> Error {
    request_tensor(base, r, "data that fills its shape".into(), e.to_string())
}
