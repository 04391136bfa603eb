//! `omniprefix.Item`: one multimodal item, and its conversion to the engine's
//! borrowed [`ItemSpec`] for the length of one call.

use std::collections::BTreeMap;
use std::sync::Arc;

use ndarray::Array2;
use numpy::PyArray2;
use omniprefix::batch::DeepStack;
use omniprefix::canon::{ItemContent, ItemLayout, ItemSpec, Modality};
use omniprefix::engine::ItemInput;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::arrays::{Content, float_levels, float_matrix};
use crate::errors::to_py;

/// A multimodal item: what the fingerprint reads (modality, layout, content,
/// processor params) and, optionally, its encoder outputs.
///
/// The content array is referenced, not copied, and read at each call; the
/// embeddings and DeepStack levels are copied here (as float32), because the
/// engine's encoder cache keeps them.
#[pyclass(frozen, module = "omniprefix")]
pub struct Item {
    pub modality: Modality,
    pub layout: ItemLayout,
    layout_dict: Py<PyAny>,
    pub content: Py<PyAny>,
    pub embeddings: Option<Arc<Array2<f32>>>,
    pub deepstack: Option<DeepStack>,
    pub params: BTreeMap<String, String>,
}

/// A value of a serde type (`"image"`, a layout dict) from its Python form.
pub fn from_py<T: serde::de::DeserializeOwned>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<T> {
    pythonize::depythonize(obj).map_err(|e| {
        PyValueError::new_err(format!(
            "{what} {}: {e}",
            obj.repr().map_or_else(|_| "?".into(), |r| r.to_string())
        ))
    })
}

/// An item layout from its request-file dict (`{"kind": "image", "grid_thw": [1, 4, 6]}`).
pub fn layout_from_dict(layout: &Bound<'_, PyAny>) -> PyResult<ItemLayout> {
    if !layout.is_instance_of::<PyDict>() {
        return Err(PyTypeError::new_err(
            "layout must be a dict such as {\"kind\": \"image\", \"grid_thw\": [1, 4, 6]}",
        ));
    }
    from_py(layout, "layout")
}

/// Processor params: a `dict[str, str]`.
pub fn params_from(params: Option<&Bound<'_, PyAny>>) -> PyResult<BTreeMap<String, String>> {
    match params {
        None => Ok(BTreeMap::new()),
        Some(p) if p.is_none() => Ok(BTreeMap::new()),
        Some(p) => p.extract().map_err(|_| PyTypeError::new_err("params must be a dict of str to str")),
    }
}

#[pymethods]
impl Item {
    #[new]
    #[pyo3(signature = (modality, content, layout, embeddings=None, deepstack=None, params=None))]
    fn new(
        modality: &Bound<'_, PyAny>, content: &Bound<'_, PyAny>, layout: &Bound<'_, PyAny>,
        embeddings: Option<&Bound<'_, PyAny>>, deepstack: Option<&Bound<'_, PyAny>>,
        params: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let modality: Modality = from_py(modality, "modality (image, audio or video)")?;
        let parsed = layout_from_dict(layout)?;
        // Borrowing once checks the dtype now rather than at the first call.
        Content::borrow(content)?;
        let embeddings =
            embeddings.filter(|e| !e.is_none()).map(|e| float_matrix(e, "embeddings", true)).transpose()?;
        let deepstack =
            deepstack.filter(|d| !d.is_none()).map(|d| float_levels(d, "deepstack", true)).transpose()?;
        Ok(Item {
            modality,
            layout: parsed,
            layout_dict: layout.clone().unbind(),
            content: content.clone().unbind(),
            embeddings: embeddings.map(Arc::new),
            deepstack: deepstack.map(Arc::new),
            params: params_from(params)?,
        })
    }

    /// `"image"`, `"audio"` or `"video"`.
    #[getter]
    fn modality(&self) -> &'static str {
        modality_name(self.modality)
    }

    /// The layout dict as given.
    #[getter]
    fn layout(&self, py: Python<'_>) -> Py<PyAny> {
        self.layout_dict.clone_ref(py)
    }

    /// The content array as given (not a copy).
    #[getter]
    fn content(&self, py: Python<'_>) -> Py<PyAny> {
        self.content.clone_ref(py)
    }

    /// The embeddings `[num_tokens, hidden]` as float32 (a copy of the engine's), or None.
    #[getter]
    fn embeddings<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyArray2<f32>>> {
        self.embeddings.as_ref().map(|e| PyArray2::from_array(py, e))
    }

    /// DeepStack levels as a list of float32 arrays, or None.
    #[getter]
    fn deepstack<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        self.deepstack
            .as_ref()
            .map(|levels| PyList::new(py, levels.iter().map(|l| PyArray2::from_array(py, l))))
            .transpose()
    }

    /// Placeholder tokens (= embedding rows) the layout implies.
    #[getter]
    fn num_tokens(&self) -> PyResult<usize> {
        self.layout.try_num_tokens(0).map_err(to_py)
    }

    fn __repr__(&self) -> String {
        format!(
            "Item({}, {:?}, embeddings={})",
            modality_name(self.modality),
            self.layout,
            self.embeddings.is_some()
        )
    }
}

/// The Python name of a modality.
pub fn modality_name(m: Modality) -> &'static str {
    match m {
        Modality::Image => "image",
        Modality::Audio => "audio",
        Modality::Video => "video",
    }
}

/// The items of one call, their content borrowed until the call returns.
pub struct BorrowedItems<'py> {
    items: Vec<Bound<'py, Item>>,
    contents: Vec<Content<'py>>,
}

impl<'py> BorrowedItems<'py> {
    /// `None` or a sequence of `Item`s.
    pub fn from_py(items: Option<&Bound<'py, PyAny>>) -> PyResult<Self> {
        let mut out = BorrowedItems { items: Vec::new(), contents: Vec::new() };
        let Some(items) = items.filter(|i| !i.is_none()) else { return Ok(out) };
        for (i, item) in items
            .try_iter()
            .map_err(|_| PyTypeError::new_err("items must be a sequence of omniprefix.Item"))?
            .enumerate()
        {
            let item = item?
                .cast_into::<Item>()
                .map_err(|_| PyTypeError::new_err(format!("items[{i}] is not an omniprefix.Item")))?;
            out.contents.push(Content::borrow(item.get().content.bind(items.py()))?);
            out.items.push(item);
        }
        Ok(out)
    }

    /// The Python items, in order (what an encoder callable is handed).
    pub fn items(&self) -> &[Bound<'py, Item>] {
        &self.items
    }

    /// The engine's specs over the borrowed content.
    pub fn specs(&self) -> Vec<ItemSpec<'_>> {
        self.items
            .iter()
            .zip(&self.contents)
            .map(|(item, content)| {
                let item = item.get();
                ItemSpec {
                    modality: item.modality,
                    layout: item.layout,
                    content: ItemContent::Tensor(content.view()),
                    params: item.params.clone(),
                }
            })
            .collect()
    }

    /// Engine inputs: the specs with the embeddings and levels each item brought.
    pub fn inputs(&self) -> Vec<ItemInput<'_>> {
        self.specs()
            .into_iter()
            .zip(&self.items)
            .map(|(spec, item)| ItemInput {
                spec,
                embeddings: item.get().embeddings.clone(),
                deepstack: item.get().deepstack.clone(),
            })
            .collect()
    }
}
