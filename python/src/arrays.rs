//! numpy in and out: token ids, item content views (no copy), float matrices
//! (copied, since the engine keeps them) and hidden states (moved, no copy).

use half::{bf16, f16};
use ndarray::{Array2, ArrayViewD};
use numpy::{
    PyArray1, PyArray2, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArray, PyUntypedArrayMethods,
};
use omniprefix::canon::TensorView;
use omniprefix::model::CaptureName;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyFloat, PyString};

/// The dtypes item content may have, as numpy names them.
const CONTENT_DTYPES: &str = "uint8, int32, int64, float16, bfloat16 or float32";

/// `numpy.asarray(obj)`: a numpy array over any buffer-protocol object, without a copy.
fn as_ndarray<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyUntypedArray>> {
    if let Ok(array) = obj.cast::<PyUntypedArray>() {
        return Ok(array.clone());
    }
    let numpy = obj.py().import("numpy")?;
    let array = numpy.call_method1("asarray", (obj,))?;
    Ok(array.cast_into::<PyUntypedArray>()?)
}

/// The dtype's `kind` character (`'u'`, `'i'`, `'f'`, `'b'`, ...) and name.
fn dtype_kind_name(array: &Bound<'_, PyUntypedArray>) -> PyResult<(String, String)> {
    let dtype = array.getattr("dtype")?;
    Ok((dtype.getattr("kind")?.extract()?, dtype.getattr("name")?.extract()?))
}

/// `array` in native byte order (a copy only when it is byte-swapped).
fn native_order<'py>(array: Bound<'py, PyUntypedArray>) -> PyResult<Bound<'py, PyUntypedArray>> {
    let dtype = array.getattr("dtype")?;
    let swapped = !dtype.getattr("isnative")?.extract::<bool>()?;
    if !swapped {
        return Ok(array);
    }
    let native = dtype.call_method1("newbyteorder", ("=",))?;
    Ok(array.call_method1("astype", (native,))?.cast_into::<PyUntypedArray>()?)
}

/// Token ids from a list of ints or a numpy integer array.
///
/// Floats are a `TypeError`; ids below 0 or above `u32::MAX` a `ValueError`
/// naming the position. Ids at or past the vocabulary are the engine's
/// `RequestError`. A numpy array is read in place (any integer dtype and
/// strides) and a list of ints in one extraction; only a failing list is
/// walked again, to name the element.
pub fn token_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(
            "token_ids must be a sequence of ints or a numpy integer array, not a string",
        ));
    }
    if let Ok(array) = obj.cast::<PyUntypedArray>() {
        return array_ids(array);
    }
    match obj.extract::<Vec<i64>>() {
        Ok(ids) => {
            ids.into_iter().enumerate().map(|(position, id)| id_at(position, i128::from(id))).collect()
        }
        Err(_) => list_ids(obj),
    }
}

/// An id checked into `u32`.
fn id_at(position: usize, id: i128) -> PyResult<u32> {
    u32::try_from(id)
        .map_err(|_| PyValueError::new_err(format!("token_ids[{position}] = {id} is outside 0..=4294967295")))
}

/// Ids of a 1-D numpy integer array, widened to 64 bits (no copy when already 64-bit).
fn array_ids(array: &Bound<'_, PyUntypedArray>) -> PyResult<Vec<u32>> {
    let (kind, name) = dtype_kind_name(array)?;
    if array.ndim() != 1 {
        return Err(PyValueError::new_err(format!("token_ids must be 1-D, found shape {:?}", array.shape())));
    }
    let widened = |dtype: &str| array.call_method1("astype", (dtype, "K", "same_kind", true, false));
    match kind.as_str() {
        "i" => {
            let ids = widened("int64")?.cast_into::<PyArray1<i64>>()?.readonly();
            ids.as_array().iter().enumerate().map(|(p, &id)| id_at(p, i128::from(id))).collect()
        }
        "u" => {
            let ids = widened("uint64")?.cast_into::<PyArray1<u64>>()?.readonly();
            ids.as_array().iter().enumerate().map(|(p, &id)| id_at(p, i128::from(id))).collect()
        }
        _ => Err(PyTypeError::new_err(format!("token_ids must have an integer dtype, found {name}"))),
    }
}

/// The slow path of a sequence that did not extract as ints: names the first bad element.
fn list_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let items = obj
        .try_iter()
        .map_err(|_| PyTypeError::new_err("token_ids must be a sequence of ints or a numpy integer array"))?;
    let mut ids = Vec::new();
    for (position, item) in items.enumerate() {
        let item = item?;
        // Ints and int-likes (numpy integer scalars) have `__index__`; floats do not.
        if item.is_instance_of::<PyFloat>() || !item.hasattr("__index__")? {
            let kind = item.get_type().name()?;
            return Err(PyTypeError::new_err(format!("token_ids[{position}] is a {kind}, not an int")));
        }
        let index = item.call_method0("__index__")?;
        let id = index.extract::<i128>().map_err(|_| {
            PyValueError::new_err(format!("token_ids[{position}] = {index} is outside 0..=4294967295"))
        })?;
        ids.push(id_at(position, id)?);
    }
    Ok(ids)
}

/// A read-only view of an item's content array, borrowed for one call.
pub enum Content<'py> {
    U8(PyReadonlyArrayDyn<'py, u8>),
    I32(PyReadonlyArrayDyn<'py, i32>),
    I64(PyReadonlyArrayDyn<'py, i64>),
    F16(PyReadonlyArrayDyn<'py, f16>),
    /// bfloat16 (ml_dtypes) read through a `uint16` view of the same memory.
    BF16(PyReadonlyArrayDyn<'py, u16>),
    F32(PyReadonlyArrayDyn<'py, f32>),
}

impl<'py> Content<'py> {
    /// Borrows `obj` (any buffer-protocol object; any strides) without copying
    /// it, unless it is byte-swapped: then a native-order copy is read.
    pub fn borrow(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        let array = as_ndarray(obj)?;
        if let Some(content) = Self::typed(&array) {
            return Ok(content);
        }
        // Not a native array of a numpy dtype we read: byte-swapped, bfloat16 or unsupported.
        let array = native_order(array)?;
        if let Some(content) = Self::typed(&array) {
            return Ok(content);
        }
        let (_, name) = dtype_kind_name(&array)?;
        if name == "bfloat16" {
            let bits = array.call_method1("view", ("uint16",))?;
            return Ok(Content::BF16(bits.cast_into::<PyArrayDyn<u16>>()?.readonly()));
        }
        Err(PyTypeError::new_err(format!(
            "item content has dtype {name}; supported: {CONTENT_DTYPES} (convert it first, \
             knowing that the fingerprint is over the values as given)"
        )))
    }

    /// The array as one of the native dtypes (a numpy type check, no Python call).
    fn typed(array: &Bound<'py, PyUntypedArray>) -> Option<Self> {
        fn read<'py, T: numpy::Element>(
            array: &Bound<'py, PyUntypedArray>,
        ) -> Option<PyReadonlyArrayDyn<'py, T>> {
            array.cast::<PyArrayDyn<T>>().ok()?.try_readonly().ok()
        }
        read::<u8>(array)
            .map(Content::U8)
            .or_else(|| read::<f32>(array).map(Content::F32))
            .or_else(|| read::<i64>(array).map(Content::I64))
            .or_else(|| read::<i32>(array).map(Content::I32))
            .or_else(|| read::<f16>(array).map(Content::F16))
    }

    /// The engine's view of the same memory.
    pub fn view(&self) -> TensorView<'_> {
        match self {
            Content::U8(a) => TensorView::U8(a.as_array()),
            Content::I32(a) => TensorView::I32(a.as_array()),
            Content::I64(a) => TensorView::I64(a.as_array()),
            Content::F16(a) => TensorView::F16(a.as_array()),
            Content::BF16(a) => TensorView::BF16(bf16_view(a.as_array())),
            Content::F32(a) => TensorView::F32(a.as_array()),
        }
    }
}

/// The `u16` bit patterns of a bfloat16 array as `bf16`, same memory and strides.
fn bf16_view(bits: ArrayViewD<'_, u16>) -> ArrayViewD<'_, bf16> {
    // SAFETY: `bf16` is `repr(transparent)` over `u16`, so the cast keeps every
    // element's size, alignment and validity; the view keeps the borrow's lifetime.
    unsafe { bits.raw_view().cast::<bf16>().deref_into_view() }
}

/// A float array as an owned `f32` matrix `[rows, cols]` (converted from
/// float16/float64 and copied: the engine keeps it). With `reject_non_finite`,
/// non-finite values are a `ValueError` naming `what` and the element; without,
/// they are left to the engine, whose check names the item
/// (`RequestError::NonFiniteEmbeddings`): what an encoder's output gets.
pub fn float_matrix(obj: &Bound<'_, PyAny>, what: &str, reject_non_finite: bool) -> PyResult<Array2<f32>> {
    let array = as_ndarray(obj)?;
    let (kind, name) = dtype_kind_name(&array)?;
    if kind != "f" {
        return Err(PyTypeError::new_err(format!("{what} must be a float array, found dtype {name}")));
    }
    if array.ndim() != 2 {
        return Err(PyValueError::new_err(format!(
            "{what} must be 2-D [rows, hidden], found shape {:?}",
            array.shape()
        )));
    }
    let f32s = array.call_method1("astype", ("float32",))?;
    let matrix = f32s.cast_into::<PyArray2<f32>>()?.readonly().as_array().to_owned();
    if let Some((at, value)) = matrix.indexed_iter().find(|(_, v)| reject_non_finite && !v.is_finite()) {
        return Err(PyValueError::new_err(format!(
            "{what}: non-finite value {value} at [{}, {}]",
            at.0, at.1
        )));
    }
    Ok(matrix)
}

/// DeepStack levels: a `[levels, rows, hidden]` array or a sequence of `[rows, hidden]` ones
/// (`reject_non_finite` as [`float_matrix`]).
pub fn float_levels(
    obj: &Bound<'_, PyAny>, what: &str, reject_non_finite: bool,
) -> PyResult<Vec<Array2<f32>>> {
    let levels: Vec<Bound<'_, PyAny>> = match obj.cast::<PyUntypedArray>() {
        Ok(array) if array.ndim() == 3 => array.try_iter()?.collect::<PyResult<_>>()?,
        Ok(array) => {
            return Err(PyValueError::new_err(format!(
                "{what} must be 3-D [levels, rows, hidden], found shape {:?}",
                array.shape()
            )));
        }
        Err(_) => obj.try_iter()?.collect::<PyResult<_>>()?,
    };
    levels
        .iter()
        .enumerate()
        .map(|(i, level)| float_matrix(level, &format!("{what}[{i}]"), reject_non_finite))
        .collect()
}

/// `{name: array}`, each array moved into numpy without a copy.
pub fn hidden_dict<'py>(
    py: Python<'py>, hidden: Vec<(CaptureName, Array2<f32>)>,
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for (name, rows) in hidden {
        dict.set_item(name.key(), PyArray2::from_owned_array(py, rows))?;
    }
    Ok(dict)
}

/// `{name: row}` for one position.
pub fn row_dict<'py>(py: Python<'py>, hidden: Vec<(CaptureName, Vec<f32>)>) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for (name, row) in hidden {
        dict.set_item(name.key(), PyArray1::from_vec(py, row))?;
    }
    Ok(dict)
}
