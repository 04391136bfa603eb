//! The ops a Qwen-family forward needs, behind one trait, so the thinker and the
//! runner run unchanged on the CPU reference and on the GPU.
//!
//! Design rules every implementation follows:
//! * A `Tensor` is a row-major 2-D f32 matrix `[rows, cols]` that lives on the
//!   device; only [`Backend::upload`] / [`Backend::download`] cross to the host,
//!   so a GPU backend keeps activations on the device between layers.
//! * Per-step metadata (positions, slot mappings, block tables, query offsets) is
//!   passed as host slices; a GPU backend uploads them itself.
//! * Vectors (biases, norm weights) are `[1, n]` tensors.
//! * The thinker composes these ops: e.g. logits of selected rows are
//!   `gather_rows` → `rms_norm` → `matmul_t(lm_head)`, so no op needs a host round trip.
//! * Ops validate operand shapes and indices and return [`BackendError::OpShape`](crate::error::BackendError::OpShape) /
//!   [`BackendError::OpIndex`](crate::error::BackendError::OpIndex); an op that fails leaves its operands unchanged.
//!
//! [`BackendError::OpShape`]: crate::error::BackendError::OpShape
//! [`BackendError::OpIndex`]: crate::error::BackendError::OpIndex

#[cfg(feature = "wgpu")]
pub mod auto;
pub mod cpu;
pub(crate) mod floats;
#[cfg(test)]
pub(crate) mod test_support;
pub(crate) mod weight;
#[cfg(feature = "wgpu")]
pub mod wgpu;

pub use floats::{FloatSlice, FloatVec};
pub use weight::{Dtype, HostWeight, UnknownDtype, WeightView};

use ndarray::{Array2, ArrayView2};

use crate::Result;
use crate::kv::BlockId;

/// Sizes of a set of pages: per layer K and V `[num_blocks, block_size, kv_heads, head_dim]`
/// and hidden-state pages `[num_blocks, block_size, captured, hidden]`, all addressed
/// by the same block ids.
///
/// A *slot* is `block * block_size + offset`; slot `s` of layer `l`'s K pages holds
/// `kv_heads * head_dim` floats at flat offset `s * kv_heads * head_dim`, and slot `s`
/// of capture `c` of the hidden pages holds `hidden` floats at flat offset
/// `(s * captured + c) * hidden`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagesSpec {
    pub num_layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Number of captured hidden states per position (may be 0).
    pub captured: usize,
    pub hidden: usize,
    /// The element type K and V pages are stored in (read back widened to f32;
    /// hidden pages are always f32). A backend refuses one it cannot store.
    pub kv_dtype: Dtype,
}

impl PagesSpec {
    /// Number of slots (`num_blocks * block_size`).
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// Floats of one K (or V) row: `kv_heads * head_dim`.
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Bytes the pages occupy (K + V of every layer and the hidden pages).
    pub fn bytes(&self) -> usize {
        let kv = 2 * self.num_layers * self.num_slots() * self.kv_width();
        let hidden = self.num_slots() * self.captured * self.hidden;
        kv * self.kv_dtype.size_bytes() + hidden * std::mem::size_of::<f32>()
    }
}

/// Which rotary frequencies follow which position axis.
///
/// Frequency `i` (of `head_dim / 2`) rotates by `pos[axis(i)] * theta^(-2i / head_dim)`,
/// where `pos` is the row's (temporal, height, width) position.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeKind {
    /// 1-D RoPE: every frequency follows the temporal (only) axis.
    Plain,
    /// Qwen2-VL / Qwen2.5-Omni M-RoPE: contiguous sections, frequencies
    /// `0..s0` temporal, `s0..s0+s1` height, the rest width.
    Sectioned([usize; 3]),
    /// Qwen3-VL / Qwen3-Omni M-RoPE (`apply_interleaved_mrope`): frequency `i` is
    /// height when `i % 3 == 1 && i < 3 * s1`, width when `i % 3 == 2 && i < 3 * s2`,
    /// temporal otherwise.
    Interleaved([usize; 3]),
}

/// Rotary embedding parameters (rotate-half convention over the whole head).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeSpec {
    pub theta: f32,
    pub head_dim: usize,
    pub kind: RopeKind,
}

impl RopeSpec {
    /// Which position axis (0 temporal, 1 height, 2 width) frequency `i` follows.
    pub fn axis(&self, i: usize) -> usize {
        match self.kind {
            RopeKind::Plain => 0,
            RopeKind::Sectioned([s0, s1, _]) => {
                if i < s0 {
                    0
                } else if i < s0 + s1 {
                    1
                } else {
                    2
                }
            }
            RopeKind::Interleaved([_, s1, s2]) => match i % 3 {
                1 if i < 3 * s1 => 1,
                2 if i < 3 * s2 => 2,
                _ => 0,
            },
        }
    }

    /// Inverse frequency of frequency `i`, computed in f32 as HF does:
    /// `1 / theta^((2i) / head_dim)`.
    pub fn inv_freq(&self, i: usize) -> f32 {
        1.0 / self.theta.powf((2 * i) as f32 / self.head_dim as f32)
    }
}

/// Per-row rotary positions of a step (temporal, height, width), each of length
/// `rows`. 1-D positions pass the same slice three times.
#[derive(Debug, Clone, Copy)]
pub struct RopePositions<'a> {
    pub t: &'a [i64],
    pub h: &'a [i64],
    pub w: &'a [i64],
}

impl<'a> RopePositions<'a> {
    /// Positions of axis `a` (0 temporal, 1 height, 2 width).
    pub fn axis(&self, a: usize) -> &'a [i64] {
        match a {
            1 => self.h,
            2 => self.w,
            _ => self.t,
        }
    }
}

/// One sequence's share of a varlen attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnSeq<'a> {
    /// First row of this sequence's queries in the step's `q` tensor.
    pub query_start: usize,
    /// Number of new tokens (query rows) of this sequence.
    pub num_new: usize,
    /// Positions already in pages before this step; the new tokens are positions
    /// `num_computed..num_computed + num_new` and their K/V must already be written.
    pub num_computed: usize,
    /// The blocks holding positions `0..num_computed + num_new` in order.
    pub block_table: &'a [BlockId],
}

/// Head layout of an attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnHeads {
    pub num_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Weights of one Mixture-of-Experts block, already on the device.
///
/// Expert `e`'s gate rows are `gate_up[e*2I .. e*2I+I]`, its up rows
/// `gate_up[e*2I+I .. (e+1)*2I]` (HF Linear layout `[out, in]`), its down rows
/// `down[e*H .. (e+1)*H]`.
#[derive(Debug)]
pub struct MoeWeights<T> {
    /// Router `[num_experts, hidden]`.
    pub router: T,
    /// `[num_experts * 2 * moe_intermediate, hidden]`.
    pub gate_up: T,
    /// `[num_experts * hidden, moe_intermediate]`.
    pub down: T,
    pub num_experts: usize,
    pub top_k: usize,
    /// Divide the top-k routing weights by their sum.
    pub norm_topk_prob: bool,
}

impl<T> MoeWeights<T> {
    /// The same block with every matrix passed through `f` (an upload, a dtype change).
    pub fn try_map<U, E>(
        &self, mut f: impl FnMut(&T) -> std::result::Result<U, E>,
    ) -> std::result::Result<MoeWeights<U>, E> {
        Ok(MoeWeights {
            router: f(&self.router)?,
            gate_up: f(&self.gate_up)?,
            down: f(&self.down)?,
            num_experts: self.num_experts,
            top_k: self.top_k,
            norm_topk_prob: self.norm_topk_prob,
        })
    }

    /// `top_k` picks 1 to `num_experts` experts: every backend's MoE op checks
    /// it first (a shape error naming `top_k`, never a panic in a kernel).
    pub(crate) fn check_top_k(&self, op: &'static str) -> Result<()> {
        if self.top_k == 0 || self.top_k > self.num_experts {
            return Err(crate::error::BackendError::OpShape {
                op,
                what: "top_k",
                expected: format!("1..={}", self.num_experts),
                found: vec![self.top_k],
            }
            .into());
        }
        Ok(())
    }
}

impl MoeWeights<Array2<f32>> {
    /// Host weights uniform in [-1, 1) for `num_experts` experts over `hidden`
    /// channels with `inter` intermediate channels each, drawn router, gate_up,
    /// down in that order: the input of the MoE kernel tests (the CPU one against
    /// its naive oracle, the GPU one against the CPU backend), kept in one place
    /// so both draw the same shapes the same way.
    #[doc(hidden)]
    pub fn random(
        rng: &mut impl rand::Rng, num_experts: usize, hidden: usize, inter: usize, top_k: usize,
        norm_topk_prob: bool,
    ) -> Self {
        let mut matrix = |rows: usize, cols: usize| {
            Array2::from_shape_fn((rows, cols), |_| rng.random::<f32>() * 2.0 - 1.0)
        };
        MoeWeights {
            router: matrix(num_experts, hidden),
            gate_up: matrix(num_experts * 2 * inter, hidden),
            down: matrix(num_experts * hidden, inter),
            num_experts,
            top_k,
            norm_topk_prob,
        }
    }
}

/// A causal 1-D convolution over time (stride 1), HF `Qwen3OmniMoeCausalConvNet`:
/// see [`Backend::causal_conv1d`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv1dSpec {
    /// Taps.
    pub kernel: usize,
    /// Rows between taps; the input is left-padded with `(kernel - 1) * dilation` zeros.
    pub dilation: usize,
    /// Channel groups (`groups == channels` is depthwise); both channel counts divide by it.
    pub groups: usize,
}

/// A causal transposed 1-D convolution, HF `Qwen3OmniMoeCausalTransConvNet`:
/// see [`Backend::causal_conv_transpose1d`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvTranspose1dSpec {
    /// Taps, `stride..=2 * stride`.
    pub kernel: usize,
    /// Output rows per input row.
    pub stride: usize,
}

/// The ops of a Qwen-family decoder forward over paged KV.
///
/// Every op's contract is stated in terms of `[rows, cols]` row-major f32 matrices.
pub trait Backend: Send + Sync {
    /// A device-resident row-major f32 matrix `[rows, cols]`.
    type Tensor: Send + Sync;
    /// A weight matrix `[rows, cols]` in one of [`Backend::weight_dtypes`]: the
    /// right operand of [`Backend::matmul_t`], an embedding table, MoE experts.
    type Weight: Send + Sync;
    /// Per-layer K/V pages and hidden-state pages (see [`PagesSpec`]), zero-filled.
    type Pages: Send;

    /// Short name for logs and bench labels.
    fn name(&self) -> &'static str;

    /// Copies a host matrix to the device.
    fn upload(&self, host: ArrayView2<'_, f32>) -> Result<Self::Tensor>;
    /// Copies a device matrix to the host (a GPU backend waits for pending work).
    fn download(&self, t: &Self::Tensor) -> Result<Array2<f32>>;
    /// Copies several device matrices to the host, in order. A GPU backend waits once
    /// for all of them.
    fn download_all(&self, ts: &[&Self::Tensor]) -> Result<Vec<Array2<f32>>> {
        ts.iter().map(|t| self.download(t)).collect()
    }
    /// [`Backend::download_all`] of tensors the caller is done with (the runner reads a
    /// step's logits and hidden rows with one call). A backend whose tensors already are
    /// host matrices hands them over instead of copying them (a prefill's captured hidden
    /// states are megabytes).
    fn take_to_host(&self, ts: Vec<Self::Tensor>) -> Result<Vec<Array2<f32>>> {
        self.download_all(&ts.iter().collect::<Vec<_>>())
    }
    /// `[rows, cols]` of a tensor.
    fn shape(&self, t: &Self::Tensor) -> [usize; 2];

    /// The dtypes weights may be stored in; always includes [`Dtype::F32`].
    fn weight_dtypes(&self) -> &'static [Dtype];
    /// Copies a host weight to the device in its own dtype; a dtype outside
    /// [`Backend::weight_dtypes`] is a [`ConfigError::Invalid`](crate::error::ConfigError::Invalid).
    fn upload_weight(&self, host: HostWeight) -> Result<Self::Weight>;

    /// Allocates zero-filled pages; `block_size` must be positive.
    fn alloc_pages(&self, spec: PagesSpec) -> Result<Self::Pages>;
    /// The sizes the pages were allocated with.
    fn pages_spec(&self, pages: &Self::Pages) -> PagesSpec;

    /// `out[i] = table[ids[i]]`: `table [vocab, hidden]` → `[ids.len(), hidden]`.
    fn embedding(&self, table: &Self::Weight, ids: &[u32]) -> Result<Self::Tensor>;
    /// `dst[rows[i]] = src[i]` for every `i`: `src [rows.len(), cols]`, `dst [n, cols]`.
    fn scatter_rows(&self, dst: &mut Self::Tensor, rows: &[u32], src: &Self::Tensor) -> Result<()>;
    /// `out[i] = x[rows[i]]`: `[rows.len(), cols]`.
    fn gather_rows(&self, x: &Self::Tensor, rows: &[u32]) -> Result<Self::Tensor>;

    /// `x @ w^T` with `w` in HF Linear layout: `x [n, in]`, `w [out, in]` → `[n, out]`,
    /// accumulated in f32 whatever the weight's dtype.
    fn matmul_t(&self, x: &Self::Tensor, w: &Self::Weight) -> Result<Self::Tensor>;
    /// `x[i, j] += bias[0, j]`: `bias [1, cols]`.
    fn add_bias(&self, x: &mut Self::Tensor, bias: &Self::Tensor) -> Result<()>;
    /// `x += y`, same shapes (the residual add).
    fn add(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;

    /// RMSNorm of whole rows: `out[i, j] = x[i, j] / sqrt(mean_j(x[i]^2) + eps) * w[0, j]`,
    /// `w [1, cols]`.
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Tensor, eps: f32) -> Result<Self::Tensor>;
    /// RMSNorm in place of each head: columns `h*head_dim..(h+1)*head_dim` of each row are
    /// normalised on their own and scaled by `w [1, head_dim]` (Qwen3 qk-norm).
    fn rms_norm_heads(&self, x: &mut Self::Tensor, w: &Self::Tensor, head_dim: usize, eps: f32)
    -> Result<()>;

    /// Rotary embedding in place, rotate-half convention, on every head of `x [n, heads*head_dim]`.
    /// For row `r`, frequency `i < head_dim/2`: `angle = pos[spec.axis(i)][r] as f32 *
    /// spec.inv_freq(i)`; `(a, b) = (x[i], x[i + head_dim/2])` of the head becomes
    /// `(a cos − b sin, b cos + a sin)`.
    fn rope(&self, x: &mut Self::Tensor, spec: &RopeSpec, pos: RopePositions<'_>) -> Result<()>;

    /// SwiGLU on a fused gate/up product: `gate_up [n, 2I]` (gate columns first) →
    /// `silu(gate) * up`, `[n, I]`.
    fn swiglu(&self, gate_up: &Self::Tensor) -> Result<Self::Tensor>;

    // ---- code2wav (audio decoder) ops: time on rows, channels on columns ----
    // Each has a default that downloads its operands, runs the CPU kernel
    // (`cpu::conv`, `cpu::dense_attention`) and uploads the result, so every backend
    // runs the audio decoder; a backend overrides the ones it has kernels for.

    /// Grouped causal 1-D convolution (stride 1) of `x [T, cin]` → `[T, cout]`, for
    /// the depthwise convs (a dense one is [`Backend::dense_causal_conv1d`]):
    /// `out[t, o] = bias[0, o] + Σ_j Σ_c x[t - (k-1-j)·dilation, g·cin_g + c] · w[j·cin_g + c, o]`
    /// over taps whose source row is `>= 0` (HF's left padding), `g = o / (cout / groups)`,
    /// `cin_g = cin / groups`. `w [kernel * cin_g, cout]` holds HF's
    /// `weight[o, c, j]` at row `j·cin_g + c` ([`cpu::conv::conv1d_weight_from_hf`]);
    /// `bias [1, cout]`. A row reads only rows at or before it.
    fn causal_conv1d(
        &self, x: &Self::Tensor, w: &Self::Tensor, bias: Option<&Self::Tensor>, spec: Conv1dSpec,
    ) -> Result<Self::Tensor> {
        let bias = bias.map(|b| self.download(b)).transpose()?;
        let (x, w) = (self.download(x)?, self.download(w)?);
        let out = cpu::conv::causal_conv1d(x.view(), w.view(), bias.as_ref().map(|b| b.view()), spec)?;
        self.upload(out.view())
    }

    /// Dense causal 1-D convolution (stride 1, `groups == 1`) of `x [T, cin]` →
    /// `[T, cout]`: `out[t, o] = bias[0, o] + Σ_j Σ_c x[t - (k-1-j)·dilation, c] · weight[o, c, j]`
    /// over taps whose source row is `>= 0`. `w` is a weight `[kernel * cout, cin]`
    /// holding HF's `weight[o, :, j]` at row `j·cout + o`
    /// ([`cpu::conv::dense_conv1d_weight_from_hf`]), so the default is one
    /// [`Backend::matmul_t`] (every tap's products) and the taps' sum on the host.
    fn dense_causal_conv1d(
        &self, x: &Self::Tensor, w: &Self::Weight, bias: Option<&Self::Tensor>, spec: Conv1dSpec,
    ) -> Result<Self::Tensor> {
        let z = self.download(&self.matmul_t(x, w)?)?;
        let bias = bias.map(|b| self.download(b)).transpose()?;
        self.upload(cpu::conv::sum_causal_taps(z.view(), bias.as_ref().map(|b| b.view()), spec)?.view())
    }

    /// Causal transposed 1-D convolution of `x [T, cin]`: `ConvTranspose1d(kernel,
    /// stride)` with `kernel - stride` rows trimmed from both ends →
    /// `[(T + 1)·stride - kernel, cout]` ([`cpu::conv::conv_transpose1d_len`]);
    /// output row `m` is `bias + Σ x[i, c] · weight[c, o, j]` over `i·stride + j = m + kernel - stride`.
    /// `w` is a weight `[kernel * cout, cin]` holding HF's `weight[:, o, j]` at row
    /// `j·cout + o` ([`cpu::conv::conv_transpose1d_weight_from_hf`]); `stride <= kernel
    /// <= 2·stride`. The default is one [`Backend::matmul_t`] and the taps' sum on the host.
    fn causal_conv_transpose1d(
        &self, x: &Self::Tensor, w: &Self::Weight, bias: Option<&Self::Tensor>, spec: ConvTranspose1dSpec,
    ) -> Result<Self::Tensor> {
        let z = self.download(&self.matmul_t(x, w)?)?;
        let bias = bias.map(|b| self.download(b)).transpose()?;
        self.upload(cpu::conv::sum_transposed_taps(z.view(), bias.as_ref().map(|b| b.view()), spec)?.view())
    }

    /// SnakeBeta per channel: `x + 1 / (exp(beta[0, c]) + 1e-9) · sin(x · exp(alpha[0, c]))²`;
    /// `alpha`, `beta [1, C]` are the checkpoint's log-scale parameters.
    fn snake_beta(
        &self, x: &Self::Tensor, alpha: &Self::Tensor, beta: &Self::Tensor,
    ) -> Result<Self::Tensor> {
        let (x, a, b) = (self.download(x)?, self.download(alpha)?, self.download(beta)?);
        self.upload(cpu::conv::snake_beta(x.view(), a.view(), b.view())?.view())
    }

    /// LayerNorm of whole rows: `(x - mean) / sqrt(var + eps) · w[0, j] + b[0, j]`
    /// (biased variance, as `torch.nn.LayerNorm`); `w`, `b [1, cols]`.
    fn layer_norm(
        &self, x: &Self::Tensor, w: &Self::Tensor, b: &Self::Tensor, eps: f32,
    ) -> Result<Self::Tensor> {
        let (x, w, b) = (self.download(x)?, self.download(w)?, self.download(b)?);
        self.upload(cpu::conv::layer_norm(x.view(), w.view(), b.view(), eps)?.view())
    }

    /// Exact GELU element-wise: `0.5 · x · (1 + erf(x / √2))` (`torch.nn.GELU()`).
    fn gelu(&self, x: &Self::Tensor) -> Result<Self::Tensor> {
        let x = self.download(x)?;
        self.upload(cpu::conv::gelu(x.view()).view())
    }

    /// `x[i, j] *= scale[0, j]` in place (LayerScale, ConvNeXt's gamma): `scale [1, cols]`.
    fn scale_cols(&self, x: &mut Self::Tensor, scale: &Self::Tensor) -> Result<()> {
        let (mut host, scale) = (self.download(x)?, self.download(scale)?);
        cpu::conv::scale_cols(&mut host, scale.view())?;
        *x = self.upload(host.view())?;
        Ok(())
    }

    /// `x = min(max(x, min), max)` in place, NaN kept (`torch.clamp`); `min <= max`,
    /// else a shape error on `bounds`.
    fn clamp(&self, x: &mut Self::Tensor, min: f32, max: f32) -> Result<()> {
        let mut host = self.download(x)?;
        cpu::conv::clamp(&mut host, min, max)?;
        *x = self.upload(host.view())?;
        Ok(())
    }

    /// Dense causal attention of one sequence, optionally windowed: `q [Tq,
    /// num_heads*head_dim]`, `k`, `v [Tk, kv_heads*head_dim]`, `Tq <= Tk`. Query row `r`
    /// is position `p = Tk - Tq + r` (a chunk's queries against cached keys + its own)
    /// and sees key `j` iff `j <= p` and, with `window = Some(w)`, `j > p - w` (HF's
    /// sliding-window causal mask: `w` keys, itself included). GQA, scale and softmax
    /// as [`Backend::paged_attention`]. A row's result depends only on its q row and
    /// the K/V rows it sees. Output `[Tq, num_heads*head_dim]`.
    fn causal_attention(
        &self, q: &Self::Tensor, k: &Self::Tensor, v: &Self::Tensor, heads: AttnHeads, window: Option<usize>,
    ) -> Result<Self::Tensor> {
        let (q, k, v) = (self.download(q)?, self.download(k)?, self.download(v)?);
        self.upload(
            cpu::dense_attention::causal_attention(q.view(), k.view(), v.view(), heads, window)?.view(),
        )
    }

    /// The Qwen MoE block on `x [n, hidden]` → `[n, hidden]`: per row, router logits
    /// `x @ router^T`, softmax over experts, the `top_k` largest probabilities (ties to
    /// the lower expert id), divided by their sum if `norm_topk_prob`, and the
    /// weighted sum of those experts' SwiGLU MLPs `down_e(silu(gate_e x) * up_e x)`.
    fn moe(&self, x: &Self::Tensor, w: &MoeWeights<Self::Weight>) -> Result<Self::Tensor>;

    /// `x * sigmoid(x)` of every element: `[n, c]` → `[n, c]` (the activation of the
    /// talker's text and hidden projections, which are not gated).
    ///
    /// The default goes through the host (download, map, upload), so a backend
    /// without a kernel of its own still runs the talker.
    fn silu(&self, x: &Self::Tensor) -> Result<Self::Tensor> {
        let mut host = self.download(x)?;
        host.mapv_inplace(|v| v / (1.0 + (-v).exp()));
        self.upload(host.view())
    }

    /// `x[i, j] += sigmoid(gate[i, 0]) * y[i, j]`: `x`, `y [n, c]`, `gate [n, 1]` —
    /// a shared expert's output `y` added under its per-row gate (Qwen2-MoE and
    /// the Qwen3-Omni talker: `moe(x) + sigmoid(x @ g^T) * shared(x)`).
    ///
    /// Shapes are checked before anything changes; the default goes through the host.
    fn add_sigmoid_gated(&self, x: &mut Self::Tensor, y: &Self::Tensor, gate: &Self::Tensor) -> Result<()> {
        let [rows, cols] = self.shape(x);
        check_shape("add_sigmoid_gated", "y", [rows, cols], self.shape(y))?;
        check_shape("add_sigmoid_gated", "gate", [rows, 1], self.shape(gate))?;
        let mut host = self.download(x)?;
        let y = self.download(y)?;
        let gate = self.download(gate)?;
        add_sigmoid_gated_host(&mut host, &y, &gate);
        *x = self.upload(host.view())?;
        Ok(())
    }

    /// Writes rows of `k`, `v [n, kv_heads*head_dim]` into layer `layer`'s pages at
    /// `slots[i]`; a negative slot skips its row.
    fn write_kv(
        &self, pages: &mut Self::Pages, layer: usize, k: &Self::Tensor, v: &Self::Tensor, slots: &[i64],
    ) -> Result<()>;

    /// Varlen causal attention over paged K/V of layer `layer`.
    ///
    /// `q [total_new, num_heads*head_dim]` holds each sequence's new tokens at rows
    /// `query_start..query_start+num_new`. For new row `i` of a sequence, key/value
    /// position `j` is visible iff `j <= num_computed + i`; position `j` lives in slot
    /// `block_table[j / block_size] * block_size + j % block_size`. Query head `h`
    /// reads KV head `h / (num_heads / kv_heads)` (GQA). Scores are scaled by
    /// `1/sqrt(head_dim)` and softmaxed in f32. Output `[total_new, num_heads*head_dim]`;
    /// rows no sequence covers are zero.
    fn paged_attention(
        &self, q: &Self::Tensor, pages: &Self::Pages, layer: usize, heads: AttnHeads, seqs: &[AttnSeq<'_>],
    ) -> Result<Self::Tensor>;

    /// Writes rows of `x [n, hidden]` as capture `capture` of the hidden pages at
    /// `slots[i]`; a negative slot skips its row.
    fn write_hidden(
        &self, pages: &mut Self::Pages, capture: usize, x: &Self::Tensor, slots: &[i64],
    ) -> Result<()>;
    /// Reads capture `capture` at `slots[i]` into row `i` of `[slots.len(), hidden]`;
    /// a negative slot gives a zero row.
    fn gather_hidden(&self, pages: &Self::Pages, capture: usize, slots: &[i64]) -> Result<Self::Tensor>;

    /// Copies whole blocks `src → dst` (every layer's K and V and all hidden pages), in
    /// order; used for copy-on-write before a step runs.
    fn copy_blocks(&self, pages: &mut Self::Pages, copies: &[(BlockId, BlockId)]) -> Result<()>;

    /// Whether the disk tier can read and write this backend's pages
    /// ([`Backend::export_block`], [`Backend::import_block`]). An engine given a
    /// `tier_dir` on a backend without them is refused when it is built.
    fn tier_capable(&self) -> bool {
        false
    }

    /// Appends block `block`'s K and V of every layer (layer by layer, K then V),
    /// then its hidden rows, to `out` as stored bytes: the disk tier's payload.
    /// A backend that is not [`tier_capable`](Backend::tier_capable) refuses.
    fn export_block(&self, pages: &Self::Pages, block: BlockId, out: &mut Vec<u8>) -> Result<()> {
        let _ = (pages, block, out);
        Err(no_tier(self.name()))
    }

    /// Writes `bytes`, as [`Backend::export_block`] made them, into block `block`.
    fn import_block(&self, pages: &mut Self::Pages, block: BlockId, bytes: &[u8]) -> Result<()> {
        let _ = (pages, block, bytes);
        Err(no_tier(self.name()))
    }
}

/// A disk tier asked of a backend whose pages it cannot reach.
pub(crate) fn no_tier(backend: &str) -> crate::Error {
    crate::error::ConfigError::Invalid {
        component: "engine",
        field: "tier_dir",
        expected: "none on this backend (the disk tier reads and writes the cpu backend's pages)".into(),
        found: format!("a tier on the {backend} backend"),
    }
    .into()
}

/// A [`BackendError::OpShape`](crate::error::BackendError::OpShape) unless `found == expected`.
pub(crate) fn check_shape(
    op: &'static str, what: &'static str, expected: [usize; 2], found: [usize; 2],
) -> Result<()> {
    if found == expected {
        return Ok(());
    }
    Err(crate::error::BackendError::OpShape {
        op,
        what,
        expected: format!("[{}, {}]", expected[0], expected[1]),
        found: found.to_vec(),
    }
    .into())
}

/// [`Backend::add_sigmoid_gated`] on host matrices whose shapes were checked;
/// the sigmoid in f32 as torch computes it.
pub(crate) fn add_sigmoid_gated_host(x: &mut Array2<f32>, y: &Array2<f32>, gate: &Array2<f32>) {
    for ((mut row, y), g) in x.rows_mut().into_iter().zip(y.rows()).zip(gate.column(0)) {
        let s = 1.0 / (1.0 + (-g).exp());
        row.zip_mut_with(&y, |a, &b| *a += s * b);
    }
}
