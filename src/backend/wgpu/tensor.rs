//! Device buffers: f32 (or f16 weight) tensors with a shape, index buffers,
//! uniforms, and the dispatch helper every kernel wrapper uses.

use half::f16;
use wgpu::util::DeviceExt;

use crate::backend::Dtype;
use crate::backend::weight::unsupported_dtype;
use crate::backend::wgpu::context::GpuContext;
use crate::error::{BackendError, GpuError};
use crate::{Error, Result};

/// A row-major matrix `[rows, cols]` on the device, stored as f32, or as f16 for a
/// weight ([`GpuContext::upload_f16`]: two halves per 32-bit word, element `i` in
/// the low half of word `i / 2` when `i` is even; a block of odd length ends with a
/// zero half). Only matmul weights and embedding tables may be f16; every other
/// operand must be f32 (`GpuContext::whole` says so with a typed error).
///
/// Normally one storage buffer. An uploaded tensor larger than one storage
/// binding (a 151936-row vocabulary matrix on an adapter with 128 MiB bindings)
/// is split into blocks of whole rows, one buffer each; matmul weights, stacked MoE
/// experts and embedding tables may be split, every other operand must be whole
/// (`GpuContext::whole` says so with a typed error).
///
/// Not `Clone`: a clone would share the buffer, and in-place ops on one would
/// silently change the other.
#[derive(Debug)]
pub struct GpuTensor {
    /// Rows `0..part_rows` (all of them unless the tensor is split).
    first: wgpu::Buffer,
    /// The row blocks after the first, `part_rows` rows each (the last may be shorter).
    rest: Vec<wgpu::Buffer>,
    part_rows: usize,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// [`Dtype::F32`] or [`Dtype::F16`].
    dtype: Dtype,
}

impl GpuTensor {
    /// An f32 tensor in one buffer.
    fn whole_buffer(buffer: wgpu::Buffer, rows: usize, cols: usize) -> Self {
        GpuTensor { first: buffer, rest: Vec::new(), part_rows: rows, rows, cols, dtype: Dtype::F32 }
    }

    /// How the elements are stored: [`Dtype::F32`], or [`Dtype::F16`] for a weight.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Whether the elements are f16 (the kernels' `*_F16` override constants).
    pub(crate) fn is_f16(&self) -> bool {
        self.dtype == Dtype::F16
    }

    /// Whether the tensor spans several buffers.
    pub fn is_split(&self) -> bool {
        !self.rest.is_empty()
    }

    /// `(first row, rows, buffer)` of each row block, in order (one for a whole tensor).
    pub(crate) fn row_blocks(&self) -> impl Iterator<Item = (usize, usize, &wgpu::Buffer)> {
        std::iter::once(&self.first).chain(&self.rest).enumerate().map(|(i, buffer)| {
            let row0 = i * self.part_rows;
            (row0, self.part_rows.min(self.rows - row0), buffer)
        })
    }

    /// The buffer of a tensor created whole (`zeros`, pool chunks); never a split upload.
    pub(crate) fn into_buffer(self) -> wgpu::Buffer {
        debug_assert!(self.rest.is_empty(), "only uploads are split");
        self.first
    }

    /// `[rows, cols]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.rows, self.cols]
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// True when the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// An [`BackendError::OpShape`] for this tensor as operand `what` of `op`.
    pub(crate) fn shape_error(&self, op: &'static str, what: &'static str, expected: String) -> Error {
        BackendError::OpShape { op, what, expected, found: self.shape().to_vec() }.into()
    }

    /// Checks the tensor has `rows` rows.
    pub(crate) fn expect_rows(&self, op: &'static str, what: &'static str, rows: usize) -> Result<()> {
        if self.rows == rows { Ok(()) } else { Err(self.shape_error(op, what, format!("[{rows}, _]"))) }
    }

    /// Checks the tensor has `cols` columns.
    pub(crate) fn expect_cols(&self, op: &'static str, what: &'static str, cols: usize) -> Result<()> {
        if self.cols == cols { Ok(()) } else { Err(self.shape_error(op, what, format!("[_, {cols}]"))) }
    }
}

/// The first `len` elements of `bytes` stored as `dtype`, as f32.
/// Device storage is only ever allocated in a float type, so an integer
/// `dtype` is an [`InvariantViolation`](crate::error::InvariantViolation).
pub(crate) fn widen(bytes: &[u8], dtype: Dtype, len: usize) -> Result<Vec<f32>> {
    Ok(match dtype {
        Dtype::F32 => bytemuck::pod_collect_to_vec::<u8, f32>(bytes).into_iter().take(len).collect(),
        Dtype::F16 => {
            bytemuck::pod_collect_to_vec::<u8, f16>(bytes).iter().take(len).map(|h| h.to_f32()).collect()
        }
        Dtype::Bf16 => bytemuck::pod_collect_to_vec::<u8, half::bf16>(bytes)
            .iter()
            .take(len)
            .map(|h| h.to_f32())
            .collect(),
        Dtype::U8 | Dtype::I32 | Dtype::I64 => {
            return Err(crate::error::Component::Storage
                .violation(format!("device storage in {dtype}: not a float type"))
                .into());
        }
    })
}

/// Buffer usages of every storage buffer: bound to kernels and copied both ways.
const STORAGE_USAGE: wgpu::BufferUsages =
    wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_SRC).union(wgpu::BufferUsages::COPY_DST);

/// Workgroups per dispatch dimension guaranteed by WebGPU (and requested from the adapter).
const MIN_GROUPS_PER_DIM: u32 = 65_535;

impl GpuContext {
    /// Bytes of a storage buffer of `len` f32/u32 elements, checked against the binding limit.
    pub(crate) fn storage_bytes(&self, what: &str, len: usize) -> Result<u64> {
        // Zero-sized bindings are invalid: keep one element of room.
        let bytes = (len.max(1) as u64).saturating_mul(4);
        self.check_binding(what, bytes)?;
        Ok(bytes)
    }

    /// Checks that one binding may span `bytes`.
    fn check_binding(&self, what: &str, bytes: u64) -> Result<()> {
        if bytes > self.max_binding_bytes {
            return Err(GpuError::TooLarge {
                adapter: self.adapter_name.clone(),
                what: what.to_string(),
                requested: bytes,
                limit: "max_storage_buffer_binding_size",
                max: self.max_binding_bytes,
            }
            .into());
        }
        Ok(())
    }

    /// Uploads row-major `data` as a `[rows, cols]` tensor.
    pub fn upload(&self, data: &[f32], shape: [usize; 2]) -> Result<GpuTensor> {
        self.upload_elems(bytemuck::cast_slice(data), Dtype::F32, data.len(), shape)
    }

    /// Uploads row-major `data` as a `[rows, cols]` f16 weight (see [`GpuTensor`]):
    /// the right operand of [`GpuContext::matmul_xwt`], an embedding table, MoE experts.
    /// A [`ConfigError::Invalid`](crate::error::ConfigError::Invalid) on an adapter without f16
    /// pairs ([`GpuContext::stored_dtypes`]).
    pub fn upload_f16(&self, data: &[f16], shape: [usize; 2]) -> Result<GpuTensor> {
        self.check_stored("weight dtype", Dtype::F16)?;
        self.upload_elems(bytemuck::cast_slice(data), Dtype::F16, data.len(), shape)
    }

    /// Uploads `len` elements of `dtype` (their little-endian `bytes`) as a `[rows, cols]` tensor.
    fn upload_elems(
        &self, bytes: &[u8], dtype: Dtype, len: usize, [rows, cols]: [usize; 2],
    ) -> Result<GpuTensor> {
        let expected = rows.checked_mul(cols);
        if expected != Some(len) {
            return Err(BackendError::OpShape {
                op: "upload",
                what: "data",
                expected: format!("{rows} x {cols} elements"),
                found: vec![len],
            }
            .into());
        }
        let elem = dtype.size_bytes();
        let row_bytes = (cols as u64).saturating_mul(elem as u64);
        if (bytes.len() as u64) <= self.max_binding_bytes || row_bytes == 0 {
            let buffer = self.storage_from_bytes("tensor", bytes)?;
            return Ok(GpuTensor { first: buffer, rest: Vec::new(), part_rows: rows, rows, cols, dtype });
        }
        // Too large for one binding: blocks of as many whole rows as one binding holds.
        let part_rows = usize::try_from(self.max_binding_bytes / row_bytes).unwrap_or(usize::MAX);
        if part_rows == 0 {
            return Err(GpuError::TooLarge {
                adapter: self.adapter_name.clone(),
                what: format!("one row of a [{rows}, {cols}] tensor"),
                requested: row_bytes,
                limit: "max_storage_buffer_binding_size",
                max: self.max_binding_bytes,
            }
            .into());
        }
        let mut blocks = bytes
            .chunks(part_rows * cols * elem)
            .map(|block| self.storage_from_bytes("tensor row block", block))
            .collect::<Result<Vec<_>>>()?
            .into_iter();
        let first = blocks.next().ok_or_else(|| GpuError::Op {
            adapter: self.adapter_name.clone(),
            op: "upload",
            message: "a split tensor has no row block".into(),
        })?;
        Ok(GpuTensor { first, rest: blocks.collect(), part_rows, rows, cols, dtype })
    }

    /// The one buffer of an f32 `tensor`: [`GpuError::TooLarge`] when it is split (`op`
    /// cannot take a tensor larger than one storage binding), a
    /// [`ConfigError::Invalid`](crate::error::ConfigError::Invalid) when it is f16
    /// (only weights may be, and `op` does not take one).
    pub(crate) fn whole<'t>(&self, tensor: &'t GpuTensor, op: &'static str) -> Result<&'t wgpu::Buffer> {
        if tensor.dtype != Dtype::F32 {
            return Err(unsupported_dtype("wgpu backend", "operand dtype", &[Dtype::F32], tensor.dtype));
        }
        if tensor.is_split() {
            return Err(GpuError::TooLarge {
                adapter: self.adapter_name.clone(),
                what: format!("{op} operand [{}, {}] (only matmul weights, MoE experts and embedding tables may span several bindings)", tensor.rows, tensor.cols),
                requested: (tensor.len() as u64).saturating_mul(tensor.dtype.size_bytes() as u64),
                limit: "max_storage_buffer_binding_size",
                max: self.max_binding_bytes,
            }.into());
        }
        Ok(&tensor.first)
    }

    /// A zero-filled `[rows, cols]` tensor.
    pub fn zeros(&self, [rows, cols]: [usize; 2]) -> Result<GpuTensor> {
        let len = rows.saturating_mul(cols);
        let size = self.storage_bytes("tensor", len)?;
        let buffer = self.scoped("create_buffer", || {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("tensor"),
                size,
                usage: STORAGE_USAGE,
                mapped_at_creation: false,
            })
        })?;
        Ok(GpuTensor::whole_buffer(buffer, rows, cols))
    }

    /// Reads a tensor back to the host (waits for all queued work); f16 widened to f32.
    pub fn download(&self, tensor: &GpuTensor) -> Result<Vec<f32>> {
        Ok(self.download_all(&[tensor])?.pop().unwrap_or_default())
    }

    /// Reads several tensors back with one copy pass and one wait; f16 widened to f32.
    pub fn download_all(&self, tensors: &[&GpuTensor]) -> Result<Vec<Vec<f32>>> {
        let blocks: Vec<(&wgpu::Buffer, u64)> = tensors
            .iter()
            .flat_map(|t| {
                t.row_blocks().map(|(_, rows, buffer)| {
                    (buffer, (rows * t.cols * t.dtype.size_bytes()).next_multiple_of(4) as u64)
                })
            })
            .collect();
        let mut bytes = self.read_buffers(&blocks)?.into_iter();
        let widened = tensors.iter().map(|t| {
            let mut data = Vec::with_capacity(t.len());
            for (_, rows, _) in t.row_blocks() {
                data.extend(widen(&bytes.next().unwrap_or_default(), t.dtype, rows * t.cols)?);
            }
            Ok(data)
        });
        widened.collect()
    }

    /// A storage buffer holding 4-byte elements (f32, u32, i32) from the host.
    pub(crate) fn storage_from<T: bytemuck::Pod>(&self, what: &str, data: &[T]) -> Result<wgpu::Buffer> {
        self.storage_from_bytes(what, bytemuck::cast_slice(data))
    }

    /// A storage buffer holding `bytes`, zero-padded to whole 4-byte words (at least one).
    fn storage_from_bytes(&self, what: &str, bytes: &[u8]) -> Result<wgpu::Buffer> {
        let padded_len = bytes.len().next_multiple_of(4).max(4);
        self.check_binding(what, padded_len as u64)?;
        let padded;
        let contents = if bytes.len() == padded_len {
            bytes
        } else {
            padded = [bytes, &[0u8; 4][..padded_len - bytes.len()]].concat();
            &padded[..]
        };
        self.scoped("create_buffer", || {
            self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(what),
                contents,
                usage: STORAGE_USAGE,
            })
        })
    }

    /// A uniform buffer holding one parameter struct.
    pub(crate) fn uniform<T: bytemuck::Pod>(&self, params: &T) -> wgpu::Buffer {
        self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("params"),
            contents: bytemuck::bytes_of(params),
            usage: wgpu::BufferUsages::UNIFORM,
        })
    }

    /// Copies the first `size` bytes of `buffer` to the host.
    pub(crate) fn read_buffer(&self, buffer: &wgpu::Buffer, size: u64) -> Result<Vec<u8>> {
        Ok(self.read_buffers(&[(buffer, size)])?.pop().unwrap_or_default())
    }

    /// Copies the first `size` bytes (a multiple of 4) of each buffer to the host through
    /// one staging buffer: one submission, one map, one wait for all of them.
    pub(crate) fn read_buffers(&self, reads: &[(&wgpu::Buffer, u64)]) -> Result<Vec<Vec<u8>>> {
        let total: u64 = reads.iter().map(|&(_, size)| size).sum();
        if total == 0 {
            return Ok(vec![Vec::new(); reads.len()]);
        }
        let staging = self.scoped("download", || {
            let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("staging"),
                size: total,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let mut encoder = self.device.create_command_encoder(&Default::default());
            let mut offset = 0;
            for &(buffer, size) in reads.iter().filter(|&&(_, size)| size > 0) {
                encoder.copy_buffer_to_buffer(buffer, 0, &staging, offset, size);
                offset += size;
            }
            (staging, encoder.finish())
        })?;
        let (staging, copy) = staging;
        self.submit(copy);
        self.flush();
        let (sender, receiver) = std::sync::mpsc::channel();
        staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            // The receiver lives until after the poll below; a send error cannot happen.
            let _ = sender.send(r);
        });
        let gpu_error = |message: String| {
            Error::Gpu(GpuError::Op { adapter: self.adapter_name.clone(), op: "download", message })
        };
        self.wait("download")?;
        receiver.recv().map_err(|e| gpu_error(e.to_string()))?.map_err(|e| gpu_error(e.to_string()))?;
        let mapped = staging.slice(..).get_mapped_range().map_err(|e| gpu_error(e.to_string()))?;
        let mut offset = 0;
        let data = reads
            .iter()
            .map(|&(_, size)| {
                let range = offset as usize..(offset + size) as usize;
                offset += size;
                mapped[range].to_vec()
            })
            .collect();
        drop(mapped);
        staging.unmap();
        Ok(data)
    }

    /// Blocks until all submitted work has finished (benches stop their clocks after this).
    pub fn synchronize(&self) -> Result<()> {
        self.wait("synchronize")
    }

    fn wait(&self, op: &'static str) -> Result<()> {
        self.flush();
        self.count_host_wait();
        match self.device.poll(wgpu::PollType::wait_indefinitely()) {
            Ok(_) => Ok(()),
            Err(e) => {
                Err(GpuError::Op { adapter: self.adapter_name.clone(), op, message: e.to_string() }.into())
            }
        }
    }

    /// Copies `src` into `dst` (same shape) with one buffer-to-buffer copy: the
    /// device's copy bandwidth, the yardstick of the attention bench.
    pub fn copy_tensor(&self, src: &GpuTensor, dst: &GpuTensor) -> Result<()> {
        if src.shape() != dst.shape() {
            return Err(dst.shape_error("copy_tensor", "dst", format!("{:?}", src.shape())));
        }
        if src.is_empty() {
            return Ok(());
        }
        let (src_buffer, dst_buffer) = (self.whole(src, "copy_tensor")?, self.whole(dst, "copy_tensor")?);
        self.scoped("copy_tensor", || {
            let mut encoder = self.device.create_command_encoder(&Default::default());
            encoder.copy_buffer_to_buffer(src_buffer, 0, dst_buffer, 0, (src.len() * 4) as u64);
            encoder.finish()
        })
        .map(|commands| self.submit(commands))
    }

    /// Encodes one dispatch of `groups` workgroups (laid out in x, then y, as the shaders
    /// expect: `flat = wid.x + wid.y * nwg.x`) and queues it ([`GpuContext::submit`]).
    pub(crate) fn dispatch(
        &self, op: &'static str, pipeline: &wgpu::ComputePipeline, bindings: &[(u32, &wgpu::Buffer)],
        groups: u64,
    ) -> Result<()> {
        if groups == 0 {
            return Ok(());
        }
        let per_dim = u64::from(self.limits.max_compute_workgroups_per_dimension.min(MIN_GROUPS_PER_DIM));
        let x = groups.min(per_dim);
        let y = groups.div_ceil(x);
        if y > per_dim {
            return Err(GpuError::TooLarge {
                adapter: self.adapter_name.clone(),
                what: format!("{op} dispatch of {groups} workgroups"),
                requested: groups,
                limit: "max_compute_workgroups_per_dimension^2",
                max: per_dim * per_dim,
            }
            .into());
        }
        self.dispatch_xy(op, pipeline, bindings, (x as u32, y as u32))
    }

    /// Encodes one dispatch with an explicit 2-D workgroup grid and queues it.
    pub(crate) fn dispatch_xy(
        &self, op: &'static str, pipeline: &wgpu::ComputePipeline, bindings: &[(u32, &wgpu::Buffer)],
        (x, y): (u32, u32),
    ) -> Result<()> {
        self.scoped(op, || {
            let entries: Vec<wgpu::BindGroupEntry<'_>> = bindings
                .iter()
                .map(|&(binding, buffer)| wgpu::BindGroupEntry {
                    binding,
                    resource: buffer.as_entire_binding(),
                })
                .collect();
            let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(op),
                layout: &pipeline.get_bind_group_layout(0),
                entries: &entries,
            });
            let mut encoder =
                self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(op) });
            {
                let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some(op),
                    timestamp_writes: None,
                });
                pass.set_pipeline(pipeline);
                pass.set_bind_group(0, &bind_group, &[]);
                pass.dispatch_workgroups(x, y, 1);
            }
            encoder.finish()
        })
        .map(|commands| self.submit(commands))
    }
}
