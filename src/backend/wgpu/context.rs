//! Device setup: one adapter, one device with the adapter's own limits, and a
//! pipeline cache. Everything that can fail here returns a typed [`Error`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::backend::Dtype;
use crate::backend::weight::unsupported_dtype;
use crate::backend::wgpu::pipelines::{PipelineCache, Shader, lock};
use crate::error::GpuError;
use crate::{Error, Result};

/// How to open the device.
#[derive(Debug, Clone, Default)]
pub struct GpuOptions {
    /// Cap on the bytes of one storage binding, below the adapter's own limit.
    /// Pools larger than this are split into chunks; tests use it to exercise the split.
    pub max_binding_bytes: Option<u64>,
    /// Treat the adapter as lacking the f16 conversions
    /// (`DownlevelFlags::SHADER_F16_IN_F32`): f32 storage only, as on such an adapter.
    /// Tests use it to exercise the fallback.
    pub without_f16: bool,
    /// Treat the adapter as lacking subgroup operations (`Features::SUBGROUP`): decode
    /// attention then takes the portable kernel, as on such an adapter. Tests use it to
    /// exercise the fallback.
    pub without_subgroups: bool,
}

/// Reads one limit of an adapter.
type LimitOf = fn(&wgpu::Limits) -> u64;

/// What the kernels need from an adapter (name, getter, minimum), checked before a
/// device is requested.
const REQUIRED_LIMITS: &[(&str, LimitOf, u64)] = &[
    // paged attention binds q, row info, two K chunks, two V chunks and an output
    ("max_storage_buffers_per_shader_stage", |l| l.max_storage_buffers_per_shader_stage.into(), 7),
    // prefill attention keeps a query tile (1024 f32), a K/V tile (2048) and scores (1024)
    ("max_compute_workgroup_storage_size", |l| l.max_compute_workgroup_storage_size.into(), 16 * 1024),
    ("max_compute_invocations_per_workgroup", |l| l.max_compute_invocations_per_workgroup.into(), 256),
    ("max_compute_workgroup_size_x", |l| l.max_compute_workgroup_size_x.into(), 256),
    ("max_compute_workgroup_size_y", |l| l.max_compute_workgroup_size_y.into(), 16),
    ("max_uniform_buffer_binding_size", |l| l.max_uniform_buffer_binding_size, 64),
];

/// Checks that `limits` cover what the kernels need; names the first limit that does not.
pub fn check_limits(adapter: &str, limits: &wgpu::Limits) -> Result<()> {
    for &(limit, get, required) in REQUIRED_LIMITS {
        let available = get(limits);
        if available < required {
            return Err(GpuError::Limit { adapter: adapter.to_string(), limit, required, available }.into());
        }
    }
    Ok(())
}

/// An open GPU device with the kernels' pipeline cache.
///
/// ```no_run
/// use omniprefix::backend::wgpu::{GpuContext, GpuOptions};
/// let ctx = GpuContext::new(&GpuOptions::default())?;
/// let x = ctx.upload(&[1.0, 2.0, 3.0, 4.0], [2, 2])?;
/// let y = ctx.matmul_xwt(&x, &x)?; // x @ x^T
/// assert_eq!(ctx.download(&y)?, vec![5.0, 11.0, 11.0, 25.0]);
/// # Ok::<(), omniprefix::Error>(())
/// ```
pub struct GpuContext {
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    pub(crate) adapter_name: String,
    adapter_info: wgpu::AdapterInfo,
    pub(crate) limits: wgpu::Limits,
    /// Bytes one storage binding may span (adapter limit, possibly capped by options).
    pub(crate) max_binding_bytes: u64,
    pub(crate) pipelines: PipelineCache,
    /// Whether the kernels may pack and unpack f16 pairs (f16 weights and K/V pages).
    pub(crate) f16_pairs: bool,
    /// Whether the device was opened with `Features::SUBGROUP` (decode attention's
    /// subgroup kernel).
    pub(crate) subgroups: bool,
    /// Recorded ops not yet submitted (see [`GpuContext::submit`]).
    pending: Mutex<Vec<wgpu::CommandBuffer>>,
    /// Times the host has waited for the device ([`GpuContext::host_waits`]).
    host_waits: AtomicU64,
}

/// Ops recorded per queue submission: one submit per op costs more than the op on
/// small shapes, while a long queue delays the device's start.
const OPS_PER_SUBMIT: usize = 16;

impl std::fmt::Debug for GpuContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuContext")
            .field("adapter", &self.adapter_name)
            .field("max_binding_bytes", &self.max_binding_bytes)
            .finish_non_exhaustive()
    }
}

impl GpuContext {
    /// Opens the first adapter of the backends named by `WGPU_BACKEND` (all by default),
    /// requesting the adapter's own limits (WebGPU defaults are lower than real GPUs).
    pub fn new(options: &GpuOptions) -> Result<Self> {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let backends = format!("{:?}", wgpu::Backends::from_env().unwrap_or(wgpu::Backends::all()));
        let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            ..Default::default()
        }))
        .map_err(|e| GpuError::Unavailable { backends, reason: e.to_string() })?;
        let info = adapter.get_info();
        let adapter_name = format!("{} ({:?})", info.name, info.backend);
        let limits = adapter.limits();
        check_limits(&adapter_name, &limits)?;
        let f16_pairs = !options.without_f16
            && adapter.get_downlevel_capabilities().flags.contains(wgpu::DownlevelFlags::SHADER_F16_IN_F32);
        // Requested only where the adapter has it: asking for a missing feature fails.
        let subgroups = !options.without_subgroups && adapter.features().contains(wgpu::Features::SUBGROUP);
        let required_features = if subgroups { wgpu::Features::SUBGROUP } else { wgpu::Features::empty() };
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("omniprefix"),
            required_features,
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| GpuError::Op {
            adapter: adapter_name.clone(),
            op: "request_device",
            message: e.to_string(),
        })?;
        // Every op runs inside error scopes; anything that still escapes is reported, not a panic.
        device.on_uncaptured_error(Arc::new(|e: wgpu::Error| {
            eprintln!("omniprefix: uncaptured wgpu error: {e}")
        }));
        let adapter_binding = limits.max_storage_buffer_binding_size.min(limits.max_buffer_size);
        let max_binding_bytes =
            options.max_binding_bytes.map_or(adapter_binding, |cap| cap.min(adapter_binding));
        Ok(Self {
            device,
            queue,
            adapter_name,
            adapter_info: info,
            limits,
            max_binding_bytes,
            pipelines: PipelineCache::default(),
            f16_pairs,
            subgroups,
            pending: Mutex::default(),
            host_waits: AtomicU64::new(0),
        })
    }

    /// The adapter's name and API, as errors report it.
    pub fn adapter_name(&self) -> &str {
        &self.adapter_name
    }

    /// What the adapter says of itself: name, vendor, device type, driver.
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.adapter_info
    }

    /// The limits the device was opened with (the adapter's own).
    pub fn limits(&self) -> &wgpu::Limits {
        &self.limits
    }

    /// Bytes one storage binding may span.
    pub fn max_binding_bytes(&self) -> u64 {
        self.max_binding_bytes
    }

    /// What weights and K/V pages may be stored as: f32, and f16 where the adapter has
    /// the f16 pair conversions (`DownlevelFlags::SHADER_F16_IN_F32`: every WebGPU
    /// adapter; Mesa lavapipe only with `Features::SHADER_F16`).
    pub fn stored_dtypes(&self) -> &'static [Dtype] {
        if self.f16_pairs { &[Dtype::F32, Dtype::F16] } else { &[Dtype::F32] }
    }

    /// Whether the kernels may use subgroup operations: the adapter has
    /// `Features::SUBGROUP` (Vulkan, Metal, DX12 on most GPUs; lavapipe too) and the device
    /// was not opened [`without_subgroups`](GpuOptions::without_subgroups). Decode attention
    /// then scores keys with `wgsl/paged_decode_subgroup.wgsl`; otherwise with the portable
    /// kernel. The adapter's subgroup sizes are in [`GpuContext::adapter_info`]
    /// (`subgroup_min_size` / `subgroup_max_size`); the kernel works with any of them.
    pub fn has_subgroups(&self) -> bool {
        self.subgroups
    }

    /// A [`ConfigError::Invalid`](crate::error::ConfigError::Invalid) unless `dtype` is one of
    /// [`GpuContext::stored_dtypes`]; `field` names what would be stored (`"weight dtype"`, `"kv dtype"`).
    pub(crate) fn check_stored(&self, field: &'static str, dtype: Dtype) -> Result<()> {
        if self.stored_dtypes().contains(&dtype) {
            Ok(())
        } else {
            Err(unsupported_dtype("wgpu backend", field, self.stored_dtypes(), dtype))
        }
    }

    /// Queues a recorded op; every [`OPS_PER_SUBMIT`] ops go to the device in one
    /// submission. Ops keep their order: everything that submits goes through here,
    /// and whatever reads results back calls [`GpuContext::flush`] first.
    pub(crate) fn submit(&self, commands: wgpu::CommandBuffer) {
        let mut pending = self.pending.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        pending.push(commands);
        if pending.len() >= OPS_PER_SUBMIT {
            self.queue.submit(pending.drain(..));
        }
    }

    /// How many times the host has waited for the device (downloads, synchronize):
    /// a decode step should cost one, however many layers the model has.
    pub fn host_waits(&self) -> u64 {
        self.host_waits.load(Ordering::Relaxed)
    }

    /// Counts one host wait.
    pub(crate) fn count_host_wait(&self) {
        self.host_waits.fetch_add(1, Ordering::Relaxed);
    }

    /// Submits every queued op.
    pub(crate) fn flush(&self) {
        let mut pending = self.pending.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !pending.is_empty() {
            self.queue.submit(pending.drain(..));
        }
    }

    /// Runs `record` inside validation and out-of-memory error scopes and maps what
    /// they catch to [`GpuError::Op`] naming `op`.
    pub(crate) fn scoped<T>(&self, op: &'static str, record: impl FnOnce() -> T) -> Result<T> {
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let value = record();
        let validation_error = pollster::block_on(validation.pop());
        let oom_error = pollster::block_on(oom.pop());
        match validation_error.or(oom_error) {
            None => Ok(value),
            Some(e) => {
                Err(GpuError::Op { adapter: self.adapter_name.clone(), op, message: e.to_string() }.into())
            }
        }
    }
}

impl GpuContext {
    /// The pipeline of `entry` in `shader` with override `constants`, built on first use.
    pub(crate) fn pipeline(
        &self, shader: Shader, entry: &'static str, constants: &[(&'static str, u32)],
    ) -> Result<Arc<wgpu::ComputePipeline>> {
        let key = (shader, entry, constants.to_vec());
        if let Some(found) = lock(&self.pipelines.pipelines).get(&key) {
            return Ok(found.clone());
        }
        if shader.needs_subgroups() && !self.subgroups {
            return Err(Error::Gpu(GpuError::ShaderCompile {
                adapter: self.adapter_name.clone(),
                shader: shader.name().to_string(),
                entry: entry.to_string(),
                message: "needs subgroups (Features::SUBGROUP), which this device was opened without".into(),
            }));
        }
        let module = {
            let mut modules = lock(&self.pipelines.modules);
            match modules.get(&shader) {
                Some(module) => module.clone(),
                None => {
                    let module = self.compile_module(shader.name(), &shader.source(self.f16_pairs))?;
                    modules.insert(shader, module.clone());
                    module
                }
            }
        };
        let pipeline = Arc::new(self.build_pipeline(shader.name(), &module, entry, constants)?);
        lock(&self.pipelines.pipelines).insert(key, pipeline.clone());
        Ok(pipeline)
    }

    /// Compiles WGSL `source`; a rejected shader is [`GpuError::ShaderCompile`], not a panic.
    pub fn compile_module(&self, name: &str, source: &str) -> Result<wgpu::ShaderModule> {
        self.scoped("create_shader_module", || {
            self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(name),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            })
        })
        .map_err(|e| self.shader_error(name, "(module)", e))
    }

    /// Builds a compute pipeline with an automatic layout; failures are [`GpuError::ShaderCompile`].
    pub fn build_pipeline(
        &self, name: &str, module: &wgpu::ShaderModule, entry: &str, constants: &[(&str, u32)],
    ) -> Result<wgpu::ComputePipeline> {
        let constants: Vec<(&str, f64)> = constants.iter().map(|&(k, v)| (k, f64::from(v))).collect();
        self.scoped("create_compute_pipeline", || {
            self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: None,
                module,
                entry_point: Some(entry),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants: &constants,
                    zero_initialize_workgroup_memory: false,
                },
                cache: None,
            })
        })
        .map_err(|e| self.shader_error(name, entry, e))
    }

    fn shader_error(&self, shader: &str, entry: &str, e: Error) -> Error {
        let message = match e {
            Error::Gpu(GpuError::Op { message, .. }) => message,
            other => other.to_string(),
        };
        Error::Gpu(GpuError::ShaderCompile {
            adapter: self.adapter_name.clone(),
            shader: shader.to_string(),
            entry: entry.to_string(),
            message,
        })
    }
}
