//! The uniform parameters of each kernel (`p` in its WGSL), declared once with
//! [`wgsl_params!`]. They live here, below both the ops that fill them and the
//! [`Shader`](super::Shader) table that writes their WGSL declarations, so neither
//! imports the other.

use crate::backend::wgpu::params::wgsl_params;

wgsl_params! {
    /// `p` of the attention kernels.
    pub(crate) struct AttnParams {
        /// Rows (decode) or query tiles (prefill).
        pub(crate) n_rows: u32,
        /// Whole blocks per pool chunk.
        pub(crate) blocks_per_chunk: u32,
        /// 1 / sqrt(head_dim).
        pub(crate) scale: f32,
        /// Decode: splits per (row, head), and keys per split.
        pub(crate) n_splits: u32,
        pub(crate) split_len: u32,
        /// Decode: where the (max, sum) pairs start in the partials, after the V sums.
        pub(crate) part_ml_offset: u32,
        pub(crate) _pad: [u32; 2],
    }
}

wgsl_params! {
    /// `p` of `matmul.wgsl`.
    pub(crate) struct MatmulParams {
        pub(crate) m: u32,
        pub(crate) n: u32,
        pub(crate) k: u32,
        /// Rows `w_lo..w_hi` of the (stacked) weight are in the bound buffer, `w_lo` first.
        pub(crate) w_lo: u32,
        pub(crate) w_hi: u32,
        /// `matmul_routed` only: the first expert of the dispatch.
        pub(crate) e0: u32,
        /// `matmul_routed` only: slot `s` reads x row `s / in_div`.
        pub(crate) in_div: u32,
        /// Elements between rows of `y` (its column count).
        pub(crate) y_stride: u32,
        /// First column of `y` written (a split weight's block writes its own columns).
        pub(crate) y_col0: u32,
        pub(crate) _pad: [u32; 3],
    }
}

wgsl_params! {
    /// `p` of `rmsnorm.wgsl`.
    pub(crate) struct NormParams {
        pub(crate) rows: u32,
        pub(crate) dim: u32,
        pub(crate) eps: f32,
        pub(crate) _pad: u32,
    }
}

wgsl_params! {
    /// `p` of `elementwise.wgsl`.
    pub(crate) struct EwParams {
        pub(crate) len: u32,
        pub(crate) width: u32,
        pub(crate) _pad: [u32; 2],
    }
}

wgsl_params! {
    /// `p` of `moe.wgsl`.
    pub(crate) struct MoeParams {
        pub(crate) tokens: u32,
        pub(crate) experts: u32,
        pub(crate) top_k: u32,
        /// `router_topk`: 1 to divide the chosen probabilities by their sum.
        pub(crate) renormalize: u32,
        /// `expert_combine`: columns of a row.
        pub(crate) width: u32,
        pub(crate) _pad: [u32; 3],
    }
}

wgsl_params! {
    /// `p` of `paged_rows.wgsl`: row `r`, column `c` is pool element
    /// `(slot - slot_base) * slot_stride + slot_offset + c` of the bound chunk, which holds
    /// slots `slot_base .. slot_base + slot_count`.
    pub(crate) struct RowParams {
        pub(crate) n_rows: u32,
        pub(crate) width: u32,
        pub(crate) slot_stride: u32,
        pub(crate) slot_offset: u32,
        pub(crate) slot_base: u32,
        pub(crate) slot_count: u32,
        pub(crate) _pad: [u32; 2],
    }
}

wgsl_params! {
    /// `p` of `copy_blocks.wgsl`.
    pub(crate) struct CopyParams {
        pub(crate) n_pairs: u32,
        pub(crate) block_words: u32,
        pub(crate) _pad: [u32; 2],
    }
}

wgsl_params! {
    /// `p` of `rope.wgsl`.
    pub(crate) struct RopeParams {
        pub(crate) n: u32,
        pub(crate) heads: u32,
        pub(crate) head_dim: u32,
        /// 0 plain, 1 interleaved, 2 sectioned (see [`mode`]).
        pub(crate) mode: u32,
        /// The M-RoPE sections, `sec0 .. sec2` in WGSL.
        pub(crate) sec: [u32; 3],
        pub(crate) _pad: u32,
    }
}

wgsl_params! {
    /// `p` of `rows.wgsl`: indices at or past `src_rows` (gather) or `dst_rows` (scatter) are skipped.
    pub(crate) struct DenseRowParams {
        pub(crate) n_rows: u32,
        pub(crate) width: u32,
        pub(crate) src_rows: u32,
        pub(crate) dst_rows: u32,
    }
}
