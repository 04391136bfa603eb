//! [`Backend`] for wgpu: tensors stay on the device between ops; per-step metadata
//! (slots, positions, block tables) is uploaded by each op.

use std::sync::Arc;

use ndarray::{Array2, ArrayView2};

use crate::Result;
use crate::backend::weight::unsupported_dtype;
use crate::backend::wgpu::context::{GpuContext, GpuOptions};
use crate::backend::wgpu::ops::attention::KvPools;
use crate::backend::wgpu::ops::paging::SlotColumns;
use crate::backend::wgpu::pool::{ATTENTION_POOL_CHUNKS, PagedPool};
use crate::backend::wgpu::tensor::GpuTensor;
use crate::backend::{
    AttnHeads, AttnSeq, Backend, Dtype, FloatSlice, HostWeight, MoeWeights, PagesSpec, RopePositions,
    RopeSpec,
};
use crate::error::{BackendError, GpuError};
use crate::kv::BlockId;

/// Per-layer K and V pools and the hidden-state pool, on the device.
#[derive(Debug)]
pub struct WgpuPages {
    spec: PagesSpec,
    k: Vec<PagedPool>,
    v: Vec<PagedPool>,
    hidden: PagedPool,
}

impl WgpuPages {
    /// Layer `layer`'s K and V pools.
    pub fn layer(&self, op: &'static str, layer: usize) -> Result<KvPools<'_>> {
        match (self.k.get(layer), self.v.get(layer)) {
            (Some(k), Some(v)) => Ok(KvPools { k, v }),
            _ => Err(BackendError::OpIndex {
                op,
                what: "layer",
                index: layer as i64,
                bound: self.spec.num_layers,
            }
            .into()),
        }
    }

    /// The hidden-state pool `[num_blocks, block_size, captured, hidden]`.
    pub fn hidden(&self) -> &PagedPool {
        &self.hidden
    }

    /// Columns of capture `capture` inside a hidden slot.
    fn capture_columns(&self, op: &'static str, capture: usize) -> Result<SlotColumns> {
        if capture >= self.spec.captured {
            return Err(BackendError::OpIndex {
                op,
                what: "capture",
                index: capture as i64,
                bound: self.spec.captured,
            }
            .into());
        }
        Ok(SlotColumns { offset: capture * self.spec.hidden, width: self.spec.hidden })
    }
}

/// The wgpu backend. Cheap to clone (shares one device).
///
/// ```no_run
/// use ndarray::array;
/// use omniprefix::backend::Backend;
/// use omniprefix::backend::wgpu::WgpuBackend;
/// let gpu = WgpuBackend::new()?;
/// let x = gpu.upload(array![[1.0f32, 2.0], [3.0, 4.0]].view())?;
/// let y = gpu.matmul_t(&x, &x)?;
/// assert_eq!(gpu.download(&y)?, array![[5.0f32, 11.0], [11.0, 25.0]]);
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct WgpuBackend {
    ctx: Arc<GpuContext>,
}

impl WgpuBackend {
    /// Opens the default adapter (see [`GpuContext::new`]).
    pub fn new() -> Result<Self> {
        Ok(Self::from_context(Arc::new(GpuContext::new(&GpuOptions::default())?)))
    }

    /// A backend over an already opened device.
    pub fn from_context(ctx: Arc<GpuContext>) -> Self {
        Self { ctx }
    }

    /// The device context (kernel-level API).
    pub fn context(&self) -> &GpuContext {
        &self.ctx
    }
}

impl Backend for WgpuBackend {
    type Tensor = GpuTensor;
    type Weight = GpuTensor;
    type Pages = WgpuPages;

    fn name(&self) -> &'static str {
        "wgpu"
    }

    fn upload(&self, host: ArrayView2<'_, f32>) -> Result<GpuTensor> {
        let standard = host.as_standard_layout();
        let data = standard.as_slice().unwrap_or_default();
        self.ctx.upload(data, [host.nrows(), host.ncols()])
    }

    fn download(&self, t: &GpuTensor) -> Result<Array2<f32>> {
        Ok(self.download_all(&[t])?.pop().unwrap_or_default())
    }

    /// One copy pass and one wait for all of `ts`.
    fn download_all(&self, ts: &[&GpuTensor]) -> Result<Vec<Array2<f32>>> {
        let data = self.ctx.download_all(ts)?;
        ts.iter()
            .zip(data)
            .map(|(t, data)| {
                Array2::from_shape_vec((t.rows, t.cols), data).map_err(|e| {
                    GpuError::Op {
                        adapter: self.ctx.adapter_name().to_string(),
                        op: "download",
                        message: e.to_string(),
                    }
                    .into()
                })
            })
            .collect()
    }

    fn shape(&self, t: &GpuTensor) -> [usize; 2] {
        t.shape()
    }

    /// f32, and f16 where the adapter has the f16 pair conversions
    /// ([`GpuContext::stored_dtypes`]); bf16 checkpoints widen to f32 under `auto`.
    fn weight_dtypes(&self) -> &'static [Dtype] {
        self.ctx.stored_dtypes()
    }

    fn upload_weight(&self, host: HostWeight) -> Result<GpuTensor> {
        match host.view().elements() {
            FloatSlice::F32(e) => self.ctx.upload(e, host.shape()),
            FloatSlice::F16(e) => self.ctx.upload_f16(e, host.shape()),
            FloatSlice::Bf16(_) => {
                Err(unsupported_dtype("wgpu backend", "weight dtype", self.weight_dtypes(), Dtype::Bf16))
            }
        }
    }

    /// K/V pages in one of [`GpuContext::stored_dtypes`] (f16 needs an even
    /// `kv_heads * head_dim`); hidden pages stay f32.
    fn alloc_pages(&self, spec: PagesSpec) -> Result<WgpuPages> {
        self.ctx.check_stored("kv dtype", spec.kv_dtype)?;
        let mut k = Vec::with_capacity(spec.num_layers);
        let mut v = Vec::with_capacity(spec.num_layers);
        let kv_shape = (spec.num_blocks, spec.block_size, spec.kv_width());
        for _ in 0..spec.num_layers {
            for pools in [&mut k, &mut v] {
                let what = "KV pages of one layer";
                pools.push(self.ctx.alloc_pool(
                    what,
                    kv_shape,
                    spec.kv_dtype,
                    Some(ATTENTION_POOL_CHUNKS),
                )?);
            }
        }
        let hidden_shape = (spec.num_blocks, spec.block_size, spec.captured * spec.hidden);
        let hidden = self.ctx.alloc_pool("hidden pages", hidden_shape, Dtype::F32, None)?;
        Ok(WgpuPages { spec, k, v, hidden })
    }

    fn pages_spec(&self, pages: &WgpuPages) -> PagesSpec {
        pages.spec
    }

    fn embedding(&self, table: &GpuTensor, ids: &[u32]) -> Result<GpuTensor> {
        self.ctx.embedding(table, ids)
    }

    fn scatter_rows(&self, dst: &mut GpuTensor, rows: &[u32], src: &GpuTensor) -> Result<()> {
        self.ctx.scatter_rows(dst, rows, src)
    }

    fn gather_rows(&self, x: &GpuTensor, rows: &[u32]) -> Result<GpuTensor> {
        self.ctx.gather_rows(x, rows)
    }

    fn matmul_t(&self, x: &GpuTensor, w: &GpuTensor) -> Result<GpuTensor> {
        self.ctx.matmul_xwt(x, w)
    }

    fn add_bias(&self, x: &mut GpuTensor, bias: &GpuTensor) -> Result<()> {
        self.ctx.add_bias(x, bias)
    }

    fn add(&self, x: &mut GpuTensor, y: &GpuTensor) -> Result<()> {
        self.ctx.add_assign(x, y)
    }

    fn rms_norm(&self, x: &GpuTensor, w: &GpuTensor, eps: f32) -> Result<GpuTensor> {
        self.ctx.rms_norm(x, w, eps)
    }

    fn rms_norm_heads(&self, x: &mut GpuTensor, w: &GpuTensor, head_dim: usize, eps: f32) -> Result<()> {
        *x = self.ctx.rms_norm_heads(x, w, head_dim, eps)?;
        Ok(())
    }

    fn rope(&self, x: &mut GpuTensor, spec: &RopeSpec, pos: RopePositions<'_>) -> Result<()> {
        self.ctx.rope(x, spec, pos)
    }

    fn swiglu(&self, gate_up: &GpuTensor) -> Result<GpuTensor> {
        self.ctx.swiglu(gate_up)
    }

    fn moe(&self, x: &GpuTensor, w: &MoeWeights<GpuTensor>) -> Result<GpuTensor> {
        self.ctx.moe(x, w)
    }

    fn write_kv(
        &self, pages: &mut WgpuPages, layer: usize, k: &GpuTensor, v: &GpuTensor, slots: &[i64],
    ) -> Result<()> {
        const OP: &str = "write_kv";
        let pools = pages.layer(OP, layer)?;
        let cols = SlotColumns { offset: 0, width: pages.spec.kv_width() };
        // Check both operands before writing either, so a rejected call changes nothing.
        for (what, t) in [("k", k), ("v", v)] {
            t.expect_rows(OP, what, slots.len())?;
            t.expect_cols(OP, what, cols.width)?;
        }
        self.ctx.scatter_to_pool(OP, pools.k, k, slots, cols)?;
        self.ctx.scatter_to_pool(OP, pools.v, v, slots, cols)
    }

    fn paged_attention(
        &self, q: &GpuTensor, pages: &WgpuPages, layer: usize, heads: AttnHeads, seqs: &[AttnSeq<'_>],
    ) -> Result<GpuTensor> {
        if heads.kv_heads != pages.spec.kv_heads || heads.head_dim != pages.spec.head_dim {
            return Err(BackendError::OpShape {
                op: "paged_attention",
                what: "heads (num_heads, kv_heads, head_dim)",
                expected: format!("kv_heads {}, head_dim {}", pages.spec.kv_heads, pages.spec.head_dim),
                found: vec![heads.num_heads, heads.kv_heads, heads.head_dim],
            }
            .into());
        }
        self.ctx.paged_attention(q, pages.layer("paged_attention", layer)?, heads, seqs)
    }

    fn write_hidden(
        &self, pages: &mut WgpuPages, capture: usize, x: &GpuTensor, slots: &[i64],
    ) -> Result<()> {
        let cols = pages.capture_columns("write_hidden", capture)?;
        self.ctx.scatter_to_pool("write_hidden", &pages.hidden, x, slots, cols)
    }

    fn gather_hidden(&self, pages: &WgpuPages, capture: usize, slots: &[i64]) -> Result<GpuTensor> {
        let cols = pages.capture_columns("gather_hidden", capture)?;
        self.ctx.gather_from_pool("gather_hidden", &pages.hidden, slots, cols)
    }

    fn copy_blocks(&self, pages: &mut WgpuPages, copies: &[(BlockId, BlockId)]) -> Result<()> {
        for &(src, dst) in copies {
            for b in [src, dst] {
                if b as usize >= pages.spec.num_blocks {
                    return Err(BackendError::OpIndex {
                        op: "copy_blocks",
                        what: "block",
                        index: b.into(),
                        bound: pages.spec.num_blocks,
                    }
                    .into());
                }
            }
        }
        for pool in pages.k.iter().chain(&pages.v).chain([&pages.hidden]) {
            self.ctx.copy_pool_blocks(pool, copies)?;
        }
        Ok(())
    }
}
