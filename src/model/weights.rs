//! Where model weights come from: a pluggable source (mmapped safetensors, or an
//! in-memory map for tests) read through prefix paths, every tensor shape-checked.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use ndarray::Array2;
use safetensors::{Dtype as StDtype, SafeTensors};

use crate::backend::{Dtype, FloatVec, HostWeight};
use crate::error::{CheckpointError, IoError};
use crate::{Error, Result};

/// A host tensor of any rank, already converted to f32.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// A host tensor of any rank in the dtype it is stored in.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredTensor {
    pub shape: Vec<usize>,
    /// The elements, row-major.
    pub data: FloatVec,
}

impl From<HostTensor> for StoredTensor {
    fn from(t: HostTensor) -> Self {
        StoredTensor { shape: t.shape, data: FloatVec::F32(t.data) }
    }
}

/// A named store of tensors.
pub trait WeightSource {
    /// True when the source holds a tensor named `name`.
    fn contains(&self, name: &str) -> bool;
    /// The tensor `name` as f32; [`CheckpointError::MissingTensor`] when absent,
    /// [`CheckpointError::TensorDtype`] when stored in a type other than f32/f16/bf16.
    fn load(&self, name: &str) -> Result<HostTensor> {
        let t = self.load_stored(name)?;
        Ok(HostTensor { shape: t.shape, data: t.data.into_f32() })
    }
    /// The tensor `name` in the dtype it is stored in; errors as [`WeightSource::load`].
    fn load_stored(&self, name: &str) -> Result<StoredTensor>;
    /// The dtype `name` is stored in; `None` when absent or not a float type.
    fn stored_dtype(&self, name: &str) -> Option<Dtype>;
}

/// Tensors held in memory (tests, converted checkpoints).
#[derive(Debug, Clone, Default)]
pub struct MemorySource {
    tensors: HashMap<String, HostTensor>,
}

impl MemorySource {
    /// An empty source.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a tensor.
    pub fn insert(&mut self, name: impl Into<String>, tensor: HostTensor) {
        self.tensors.insert(name.into(), tensor);
    }

    /// Removes a tensor, returning it.
    pub fn remove(&mut self, name: &str) -> Option<HostTensor> {
        self.tensors.remove(name)
    }

    /// Names of all tensors held.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }
}

impl WeightSource for MemorySource {
    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn load_stored(&self, name: &str) -> Result<StoredTensor> {
        self.tensors
            .get(name)
            .cloned()
            .map(StoredTensor::from)
            .ok_or_else(|| CheckpointError::MissingTensor { name: name.into() }.into())
    }

    fn stored_dtype(&self, name: &str) -> Option<Dtype> {
        self.contains(name).then_some(Dtype::F32)
    }
}

/// Where one tensor lives inside the mmapped files.
#[derive(Debug, Clone)]
struct Entry {
    file: usize,
    dtype: StDtype,
    shape: Vec<usize>,
    /// Byte range within the file.
    start: usize,
    end: usize,
}

/// Memory-mapped safetensors files: one `model.safetensors`, or shards listed by
/// `model.safetensors.index.json`.
pub struct SafetensorsSource {
    maps: Vec<Mmap>,
    entries: HashMap<String, Entry>,
}

impl SafetensorsSource {
    /// Opens the checkpoint in `dir` (sharded if an index file is present).
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|source| IoError::read(&index, source))?;
            let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                CheckpointError::Safetensors { path: index.display().to_string(), message: e.to_string() }
            })?;
            let map = json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| {
                CheckpointError::Safetensors {
                    path: index.display().to_string(),
                    message: "no `weight_map` object".into(),
                }
            })?;
            let mut shards: Vec<PathBuf> =
                map.values().filter_map(|v| v.as_str()).map(|f| dir.join(f)).collect();
            shards.sort();
            shards.dedup();
            Self::open_files(&shards)
        } else {
            Self::open_files(&[dir.join("model.safetensors")])
        }
    }

    /// Opens and validates the given files; a name present in two files is an error.
    pub fn open_files(paths: &[PathBuf]) -> Result<Self> {
        let mut maps = Vec::with_capacity(paths.len());
        let mut entries = HashMap::new();
        for (file, path) in paths.iter().enumerate() {
            let shown = path.display().to_string();
            let handle = std::fs::File::open(path).map_err(|source| IoError::read(&shown, source))?;
            // SAFETY: the checkpoint is opened read-only; as with any mmap, a concurrent
            // writer truncating the file is outside what we guard against.
            let map = unsafe { Mmap::map(&handle) }.map_err(|source| IoError::read(&shown, source))?;
            let st_err = |e: safetensors::SafeTensorError| {
                Error::Checkpoint(CheckpointError::Safetensors {
                    path: shown.clone(),
                    message: e.to_string(),
                })
            };
            // `deserialize` checks the header against the file length (truncation).
            SafeTensors::deserialize(&map).map_err(st_err)?;
            let (header_len, meta) = SafeTensors::read_metadata(&map).map_err(st_err)?;
            for (name, info) in meta.tensors() {
                let base = 8 + header_len;
                let entry = Entry {
                    file,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: base + info.data_offsets.0,
                    end: base + info.data_offsets.1,
                };
                if entries.insert(name.clone(), entry).is_some() {
                    return Err(CheckpointError::Safetensors {
                        path: shown.clone(),
                        message: format!("tensor `{name}` in two files"),
                    }
                    .into());
                }
            }
            maps.push(map);
        }
        Ok(Self { maps, entries })
    }
}

impl WeightSource for SafetensorsSource {
    fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    fn load_stored(&self, name: &str) -> Result<StoredTensor> {
        let entry =
            self.entries.get(name).ok_or_else(|| CheckpointError::MissingTensor { name: name.into() })?;
        let map = self.maps.get(entry.file);
        let bytes = map.and_then(|m| m.get(entry.start..entry.end)).ok_or_else(|| {
            CheckpointError::Safetensors { path: name.into(), message: "data range outside the file".into() }
        })?;
        let data = match entry.dtype {
            StDtype::F32 => FloatVec::F32(
                bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            ),
            StDtype::F16 => {
                FloatVec::F16(bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])).collect())
            }
            StDtype::BF16 => {
                FloatVec::Bf16(bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]])).collect())
            }
            other => {
                return Err(
                    CheckpointError::TensorDtype { name: name.into(), found: format!("{other:?}") }.into()
                );
            }
        };
        if let Some(map) = map {
            // The bytes are copied: drop their pages from this process's resident set,
            // so a checkpoint's file pages and its loaded weights are not counted twice
            // (the pages stay in the page cache; a later read faults them back in).
            #[cfg(unix)]
            // SAFETY: the map is read-only and private, and no reference into the range
            // outlives this call, so discarding its pages only forces a re-read from the file.
            let _ = unsafe {
                map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    entry.start,
                    entry.end - entry.start,
                )
            };
        }
        Ok(StoredTensor { shape: entry.shape.clone(), data })
    }

    fn stored_dtype(&self, name: &str) -> Option<Dtype> {
        match self.entries.get(name)?.dtype {
            StDtype::F32 => Some(Dtype::F32),
            StDtype::BF16 => Some(Dtype::Bf16),
            StDtype::F16 => Some(Dtype::F16),
            _ => None,
        }
    }
}

/// A prefix path into a source (`vb.pp("model.layers").pp(3)` in candle's terms).
#[derive(Clone)]
pub struct Weights<'a> {
    source: &'a dyn WeightSource,
    prefix: String,
}

impl<'a> Weights<'a> {
    /// The root of `source` under `prefix` (may be empty).
    pub fn root(source: &'a dyn WeightSource, prefix: &str) -> Self {
        Weights { source, prefix: prefix.trim_end_matches('.').to_string() }
    }

    /// The path one level down.
    pub fn pp(&self, part: impl std::fmt::Display) -> Weights<'a> {
        let prefix =
            if self.prefix.is_empty() { part.to_string() } else { format!("{}.{part}", self.prefix) };
        Weights { source: self.source, prefix }
    }

    /// The full name of `leaf` under this path.
    pub fn name(&self, leaf: &str) -> String {
        if self.prefix.is_empty() { leaf.to_string() } else { format!("{}.{leaf}", self.prefix) }
    }

    /// True when `leaf` exists under this path.
    pub fn contains(&self, leaf: &str) -> bool {
        self.source.contains(&self.name(leaf))
    }

    /// Loads `leaf` and checks its shape equals `shape`.
    pub fn get(&self, leaf: &str, shape: &[usize]) -> Result<HostTensor> {
        let name = self.name(leaf);
        let t = self.source.load(&name)?;
        if t.shape != shape {
            return Err(
                CheckpointError::TensorShape { name, expected: shape.to_vec(), found: t.shape }.into()
            );
        }
        debug_assert_eq!(t.data.len(), shape.iter().product::<usize>());
        Ok(t)
    }

    /// A 2-D weight `[rows, cols]` (HF Linear: `[out, in]`).
    pub fn matrix(&self, leaf: &str, rows: usize, cols: usize) -> Result<Array2<f32>> {
        let t = self.get(leaf, &[rows, cols])?;
        Array2::from_shape_vec((rows, cols), t.data).map_err(|e| {
            CheckpointError::WeightLayout { name: self.name(leaf), problem: e.to_string() }.into()
        })
    }

    /// A 2-D weight `[rows, cols]` stored as `dtype` (converted from the checkpoint's own).
    pub fn weight(&self, leaf: &str, rows: usize, cols: usize, dtype: Dtype) -> Result<HostWeight> {
        self.weight_reshaped(leaf, &[rows, cols], rows, cols, dtype)
    }

    /// `leaf` (of any rank) as a `[rows, cols]` weight stored as `dtype`: stacked
    /// expert tensors `[E, r, c]` become `[E * r, c]`.
    pub fn weight_reshaped(
        &self, leaf: &str, shape: &[usize], rows: usize, cols: usize, dtype: Dtype,
    ) -> Result<HostWeight> {
        let name = self.name(leaf);
        let t = self.source.load_stored(&name)?;
        if t.shape != shape {
            return Err(
                CheckpointError::TensorShape { name, expected: shape.to_vec(), found: t.shape }.into()
            );
        }
        let w = HostWeight::new([rows, cols], t.data)
            .map_err(|e| CheckpointError::WeightLayout { name, problem: e.to_string() })?;
        w.to_dtype(dtype)
    }

    /// The dtype `leaf` is stored in.
    pub fn stored_dtype(&self, leaf: &str) -> Option<Dtype> {
        self.source.stored_dtype(&self.name(leaf))
    }

    /// A 1-D weight `[n]` as a `[1, n]` matrix.
    pub fn vector(&self, leaf: &str, n: usize) -> Result<Array2<f32>> {
        let t = self.get(leaf, &[n])?;
        Array2::from_shape_vec((1, n), t.data).map_err(|e| {
            CheckpointError::WeightLayout { name: self.name(leaf), problem: e.to_string() }.into()
        })
    }
}
