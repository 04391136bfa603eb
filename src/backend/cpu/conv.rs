//! The host kernels of the audio decoder (Qwen3-Omni code2wav): causal and
//! transposed 1-D convolutions over time, SnakeBeta, LayerNorm, exact GELU, a
//! per-channel scale and a clamp.
//!
//! A signal is a `[T, C]` matrix: time on rows, channels on columns, and the
//! time axis is the one rayon splits.
//!
//! * A **dense** convolution (every conv of code2wav but ConvNeXt's depthwise
//!   one) is one matrix product and a sum: `z = x @ w^T`, every tap's products of
//!   every input row at once (`w [kernel * cout, cin]`, packed once at load like
//!   any weight: [`dense_conv1d_weight_from_hf`]), then each output row adds its
//!   taps' rows of `z` to the bias in ascending tap order (`sum_causal_taps`,
//!   `sum_transposed_taps`). The backend's matrix product computes each element
//!   as one chain over the input channels, whatever the number of rows.
//! * A **grouped** (depthwise) convolution (`causal_conv1d`) sums its few
//!   products per output element in f64, a row at a time (an `axpy` over
//!   contiguous output channels).
//!
//! Either way a row's value depends only on the input rows it reads, never on
//! the length of the signal or on which rows share a task: decoding a window of
//! a stream gives, bit for bit, the samples one pass over the whole stream gives
//! (see `model::code2wav`'s streaming). The product form is what makes a stream's
//! small chunks cheap: summing products in f64 one weight row at a time (this
//! module's first form of the dense convs) re-read every weight per output row.
//!
//! These are the CPU backend's ops and the host fallbacks every other backend's
//! default [`Backend`](crate::backend::Backend) methods call.

use ndarray::{Array2, ArrayView2, Axis, CowArray, Ix2, parallel::prelude::*};

use super::fast_sin::{SIN_SQUARED_LIMIT, sin_squared};
use crate::backend::{Conv1dSpec, ConvTranspose1dSpec};
use crate::error::BackendError;
use crate::{Error, Result};

/// A shape error for operand `what` of `op`.
fn shape_err(op: &'static str, what: &'static str, expected: String, found: &[usize]) -> Error {
    BackendError::OpShape { op, what, expected, found: found.to_vec() }.into()
}

/// `v` must be a `[1, n]` vector.
fn expect_vector(op: &'static str, what: &'static str, v: ArrayView2<'_, f32>, n: usize) -> Result<()> {
    if v.dim() == (1, n) { Ok(()) } else { Err(shape_err(op, what, format!("[1, {n}]"), v.shape())) }
}

/// The elements of a `[1, n]` vector, in column order.
fn values(v: ArrayView2<'_, f32>) -> Vec<f32> {
    v.iter().copied().collect()
}

/// `out += a * w`, element by element, in f64 (the inner loop of both convolutions).
#[inline]
fn axpy(out: &mut [f64], a: f32, w: &[f32]) {
    let a = f64::from(a);
    for (o, &w) in out.iter_mut().zip(w) {
        *o += a * f64::from(w);
    }
}

/// A row-major copy whose rows are contiguous slices (no copy when already so).
fn standard(x: ArrayView2<'_, f32>) -> CowArray<'_, f32, Ix2> {
    if x.is_standard_layout() { x.into() } else { x.as_standard_layout().into_owned().into() }
}

/// Rows `0..rows` of `[rows, cols]`, each accumulated by `f(row, acc)` in f64 from
/// `init` (a conv sums thousands of products a sample; f64 keeps that sum from
/// drifting from torch's blocked one) and rounded once, on rayon.
fn rows_par_f64(rows: usize, init: &[f32], f: impl Fn(usize, &mut [f64]) + Sync) -> Array2<f32> {
    rows_par(rows, init.len(), |t, out| {
        let mut acc: Vec<f64> = init.iter().map(|&b| f64::from(b)).collect();
        f(t, &mut acc);
        for (o, a) in out.iter_mut().zip(acc) {
            *o = a as f32;
        }
    })
}

/// Rows `0..rows` of `[rows, cols]`, each filled by `f(row, out)` on rayon.
fn rows_par(rows: usize, cols: usize, f: impl Fn(usize, &mut [f32]) + Sync) -> Array2<f32> {
    let mut out = Array2::zeros((rows, cols));
    out.axis_iter_mut(Axis(0)).into_par_iter().enumerate().for_each(|(t, mut row)| {
        if let Some(row) = row.as_slice_mut() {
            f(t, row);
        }
    });
    out
}

/// HF `Conv1d.weight [cout, cin/groups, kernel]` (flat, row-major) in the layout
/// [`Backend::causal_conv1d`](crate::backend::Backend::causal_conv1d) reads: `[kernel * cin/groups, cout]`, row `j * cin_g + c`,
/// column `o` holding `weight[o, c, j]` (each tap's weights for one input channel
/// are a contiguous row over the output channels).
pub fn conv1d_weight_from_hf(
    weight: &[f32], cout: usize, cin_g: usize, kernel: usize,
) -> Option<Array2<f32>> {
    (weight.len() == cout * cin_g * kernel).then(|| {
        Array2::from_shape_fn((kernel * cin_g, cout), |(r, o)| {
            weight[(o * cin_g + r % cin_g) * kernel + r / cin_g]
        })
    })
}

/// HF `Conv1d.weight [cout, cin, kernel]` (flat, row-major, `groups == 1`) as the
/// weight of [`Backend::dense_causal_conv1d`](crate::backend::Backend::dense_causal_conv1d):
/// a Linear's `[kernel * cout, cin]`, row `j * cout + o` holding `weight[o, :, j]`, so
/// `x @ w^T` gives every tap's products at once.
pub fn dense_conv1d_weight_from_hf(
    weight: &[f32], cout: usize, cin: usize, kernel: usize,
) -> Option<Array2<f32>> {
    (weight.len() == cout * cin * kernel).then(|| {
        Array2::from_shape_fn((kernel * cout, cin), |(r, c)| weight[(r % cout * cin + c) * kernel + r / cout])
    })
}

/// HF `ConvTranspose1d.weight [cin, cout, kernel]` (flat, row-major) as the weight of
/// [`Backend::causal_conv_transpose1d`](crate::backend::Backend::causal_conv_transpose1d):
/// a Linear's `[kernel * cout, cin]`, row `j * cout + o` holding `weight[:, o, j]`.
pub fn conv_transpose1d_weight_from_hf(
    weight: &[f32], cin: usize, cout: usize, kernel: usize,
) -> Option<Array2<f32>> {
    (weight.len() == cin * cout * kernel).then(|| {
        Array2::from_shape_fn((kernel * cout, cin), |(r, c)| {
            weight[(c * cout + r % cout) * kernel + r / cout]
        })
    })
}

/// `z [T, kernel * cout]`'s output channels per tap, checked against `bias [1, cout]`.
fn tap_width(
    op: &'static str, z: ArrayView2<'_, f32>, kernel: usize, bias: Option<ArrayView2<'_, f32>>,
) -> Result<usize> {
    if kernel == 0 || !z.ncols().is_multiple_of(kernel) {
        return Err(shape_err(op, "products", format!("[T, {kernel} * cout]"), z.shape()));
    }
    let cout = z.ncols() / kernel;
    if let Some(b) = bias {
        expect_vector(op, "bias", b, cout)?;
    }
    Ok(cout)
}

/// `a += b`, element by element (a tap's products into an output row).
#[inline]
fn add_row(out: &mut [f32], b: &[f32]) {
    for (o, &v) in out.iter_mut().zip(b) {
        *o += v;
    }
}

/// The second half of a dense causal convolution: from every tap's products
/// `z [T, kernel * cout]` (`z[t, j·cout + o] = Σ_c x[t, c] · weight[o, c, j]`),
/// `out[t, o] = bias[o] + Σ_j z[t - (kernel-1-j)·dilation, j·cout + o]` over taps
/// whose source row is `>= 0` (HF's left padding), added in ascending `j` → `[T, cout]`.
pub(crate) fn sum_causal_taps(
    z: ArrayView2<'_, f32>, bias: Option<ArrayView2<'_, f32>>, spec: Conv1dSpec,
) -> Result<Array2<f32>> {
    const OP: &str = "dense_causal_conv1d";
    let Conv1dSpec { kernel, dilation, groups } = spec;
    if dilation == 0 || groups != 1 {
        return Err(shape_err(OP, "spec", "dilation > 0, groups == 1".into(), &[kernel, dilation, groups]));
    }
    let cout = tap_width(OP, z, kernel, bias)?;
    let bias = bias.map(values).unwrap_or_else(|| vec![0.0; cout]);
    let (rows, z) = (z.nrows(), standard(z));
    let Some(z) = z.as_slice() else {
        return Err(shape_err(OP, "products", "contiguous rows".into(), &[rows, kernel * cout]));
    };
    let tap = |row: usize, j: usize| z.get((row * kernel + j) * cout..(row * kernel + j + 1) * cout);
    Ok(rows_par(rows, cout, |t, out| {
        out.copy_from_slice(&bias);
        for j in 0..kernel {
            if let Some(src) = t.checked_sub((kernel - 1 - j) * dilation).and_then(|r| tap(r, j)) {
                add_row(out, src);
            }
        }
    }))
}

/// The second half of a causal transposed convolution: from every tap's products
/// `z [T, kernel * cout]` (`z[i, j·cout + o] = Σ_c x[i, c] · weight[c, o, j]`),
/// `out[m, o] = bias[o] + Σ z[i, j·cout + o]` over `i·stride + j = m + kernel - stride`,
/// added in ascending `j` → [`conv_transpose1d_len`]`(T)` rows.
pub(crate) fn sum_transposed_taps(
    z: ArrayView2<'_, f32>, bias: Option<ArrayView2<'_, f32>>, spec: ConvTranspose1dSpec,
) -> Result<Array2<f32>> {
    const OP: &str = "causal_conv_transpose1d";
    let ConvTranspose1dSpec { kernel, stride } = spec;
    if stride == 0 || kernel < stride || kernel > 2 * stride {
        let expected = "stride > 0, stride <= kernel <= 2 * stride".into();
        return Err(shape_err(OP, "spec", expected, &[kernel, stride]));
    }
    let cout = tap_width(OP, z, kernel, bias)?;
    let bias = bias.map(values).unwrap_or_else(|| vec![0.0; cout]);
    let trim = kernel - stride;
    let (rows, z) = (z.nrows(), standard(z));
    let Some(z) = z.as_slice() else {
        return Err(shape_err(OP, "products", "contiguous rows".into(), &[rows, kernel * cout]));
    };
    let tap = |row: usize, j: usize| z.get((row * kernel + j) * cout..(row * kernel + j + 1) * cout);
    Ok(rows_par(conv_transpose1d_len(rows, spec), cout, |m, out| {
        out.copy_from_slice(&bias);
        for j in 0..kernel {
            let Some(n) = (m + trim).checked_sub(j).filter(|n| n.is_multiple_of(stride)) else { continue };
            if let Some(src) = tap(n / stride, j) {
                add_row(out, src);
            }
        }
    }))
}

/// Causal 1-D convolution, stride 1, HF `Qwen3OmniMoeCausalConvNet`: the input is
/// left-padded with `(kernel - 1) * dilation` zeros, so
/// `out[t, o] = bias[o] + Σ_j Σ_c x[t - (kernel-1-j)·dilation, g·cin_g + c] · w[j·cin_g + c, o]`
/// over taps `j` whose source row is `>= 0`, where `g = o / (cout / groups)`.
///
/// `x [T, cin]`, `w [kernel * cin/groups, cout]` (see [`conv1d_weight_from_hf`]),
/// `bias [1, cout]` → `[T, cout]`.
pub(crate) fn causal_conv1d(
    x: ArrayView2<'_, f32>, w: ArrayView2<'_, f32>, bias: Option<ArrayView2<'_, f32>>, spec: Conv1dSpec,
) -> Result<Array2<f32>> {
    const OP: &str = "causal_conv1d";
    let Conv1dSpec { kernel, dilation, groups } = spec;
    let spec_shape = [kernel, dilation, groups];
    if kernel == 0 || dilation == 0 || groups == 0 {
        return Err(shape_err(OP, "spec", "kernel, dilation, groups all > 0".into(), &spec_shape));
    }
    let (cin, cout) = (x.ncols(), w.ncols());
    if !cin.is_multiple_of(groups) {
        return Err(shape_err(OP, "x", format!("[T, k * {groups}] (groups)"), x.shape()));
    }
    let cin_g = cin / groups;
    if w.nrows() != kernel * cin_g || !cout.is_multiple_of(groups) {
        let expected = format!("[{kernel} * {cin_g}, k * {groups}]");
        return Err(shape_err(OP, "weight", expected, w.shape()));
    }
    if let Some(b) = bias {
        expect_vector(OP, "bias", b, cout)?;
    }
    let cout_g = cout / groups;
    let (x, w) = (standard(x), standard(w));
    let bias = bias.map(values).unwrap_or_else(|| vec![0.0; cout]);
    Ok(rows_par_f64(x.nrows(), &bias, |t, out| {
        for j in 0..kernel {
            let shift = (kernel - 1 - j) * dilation;
            let Some(src) = t.checked_sub(shift) else { continue };
            let (Some(xr), Some(wj)) = (x.row(src).to_slice(), w.as_slice()) else { continue };
            let wj = &wj[j * cin_g * cout..(j + 1) * cin_g * cout];
            if cin_g == 1 && cout_g == 1 {
                // Depthwise: channel o reads input channel o.
                for ((o, &xv), &wv) in out.iter_mut().zip(xr).zip(wj) {
                    *o += f64::from(xv) * f64::from(wv);
                }
                continue;
            }
            for g in 0..groups {
                let outs = g * cout_g..(g + 1) * cout_g;
                for c in 0..cin_g {
                    let row = &wj[c * cout..(c + 1) * cout];
                    axpy(&mut out[outs.clone()], xr[g * cin_g + c], &row[outs.clone()]);
                }
            }
        }
    }))
}

/// Rows of a causal transposed convolution's output for `rows` input rows:
/// `ConvTranspose1d`'s `(rows - 1) * stride + kernel`, less `kernel - stride` at
/// each end (HF `Qwen3OmniMoeCausalTransConvNet`), i.e. `(rows + 1) * stride - kernel`
/// (`rows * stride` when `kernel == stride`, `(rows - 1) * stride` when `kernel == 2 * stride`).
pub fn conv_transpose1d_len(rows: usize, spec: ConvTranspose1dSpec) -> usize {
    if rows == 0 { 0 } else { ((rows + 1) * spec.stride).saturating_sub(spec.kernel) }
}

/// SnakeBeta, HF `Qwen3OmniMoeSnakeBeta`, per channel `c`:
/// `x + 1 / (exp(beta[c]) + 1e-9) · sin(x · exp(alpha[c]))²`. `alpha` and `beta`
/// are the checkpoint's log-scale parameters `[1, C]`.
pub(crate) fn snake_beta(
    x: ArrayView2<'_, f32>, alpha: ArrayView2<'_, f32>, beta: ArrayView2<'_, f32>,
) -> Result<Array2<f32>> {
    expect_vector("snake_beta", "alpha", alpha, x.ncols())?;
    expect_vector("snake_beta", "beta", beta, x.ncols())?;
    let a: Vec<f32> = alpha.iter().map(|v| v.exp()).collect();
    let inv_b: Vec<f32> = beta.iter().map(|v| 1.0 / (v.exp() + 1e-9)).collect();
    let x = standard(x);
    Ok(rows_par(x.nrows(), x.ncols(), |t, out| {
        if let Some(xr) = x.row(t).to_slice() {
            // One SIMD pass; the rare row with an argument beyond the fast sine's range again with libm.
            let mut beyond = false;
            for (((o, &v), &a), &inv_b) in out.iter_mut().zip(xr).zip(&a).zip(&inv_b) {
                let y = v * a;
                beyond |= y.abs() > SIN_SQUARED_LIMIT;
                *o = v + inv_b * sin_squared(y);
            }
            if beyond {
                for (((o, &v), &a), &inv_b) in out.iter_mut().zip(xr).zip(&a).zip(&inv_b) {
                    let y = v * a;
                    if y.abs() > SIN_SQUARED_LIMIT {
                        let s = y.sin();
                        *o = v + inv_b * (s * s);
                    }
                }
            }
        }
    }))
}

/// LayerNorm of whole rows, `torch.nn.LayerNorm`: `(x - mean) / sqrt(var + eps) · w + b`
/// with the biased variance; `w`, `b [1, C]`.
pub(crate) fn layer_norm(
    x: ArrayView2<'_, f32>, w: ArrayView2<'_, f32>, b: ArrayView2<'_, f32>, eps: f32,
) -> Result<Array2<f32>> {
    expect_vector("layer_norm", "weight", w, x.ncols())?;
    expect_vector("layer_norm", "bias", b, x.ncols())?;
    let (w, b) = (values(w), values(b));
    let x = standard(x);
    let n = x.ncols().max(1) as f32;
    Ok(rows_par(x.nrows(), x.ncols(), |t, out| {
        if let Some(xr) = x.row(t).to_slice() {
            let mean = xr.iter().sum::<f32>() / n;
            let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
            let inv = 1.0 / (var + eps).sqrt();
            for (c, (o, &v)) in out.iter_mut().zip(xr).enumerate() {
                *o = (v - mean) * inv * w[c] + b[c];
            }
        }
    }))
}

/// Exact GELU, `torch.nn.GELU()`: `0.5 · x · (1 + erf(x / √2))` (libm's `erff`;
/// std's `erf` is not stable Rust).
pub(crate) fn gelu(x: ArrayView2<'_, f32>) -> Array2<f32> {
    let x = standard(x);
    rows_par(x.nrows(), x.ncols(), |t, out| {
        if let Some(xr) = x.row(t).to_slice() {
            for (o, &v) in out.iter_mut().zip(xr) {
                *o = 0.5 * v * (1.0 + libm::erff(v * std::f32::consts::FRAC_1_SQRT_2));
            }
        }
    })
}

/// `x[t, c] *= scale[0, c]` (HF LayerScale, ConvNeXt's gamma, a mean's `1/n`).
pub(crate) fn scale_cols(x: &mut Array2<f32>, scale: ArrayView2<'_, f32>) -> Result<()> {
    expect_vector("scale_cols", "scale", scale, x.ncols())?;
    *x *= &scale;
    Ok(())
}

/// `x = min(max(x, min), max)` element-wise, NaN kept (as `torch.clamp`); `min <= max`.
pub(crate) fn clamp(x: &mut Array2<f32>, min: f32, max: f32) -> Result<()> {
    // A NaN bound compares as `None`: refused too.
    if !matches!(min.partial_cmp(&max), Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)) {
        return Err(shape_err("clamp", "bounds", format!("min {min} <= max {max}"), x.shape()));
    }
    x.mapv_inplace(|v| {
        if v < min {
            min
        } else if v > max {
            max
        } else {
            v
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::test_support::rand_rows;
    use ndarray::array;

    fn close(got: &Array2<f32>, want: &Array2<f32>, tol: f32, what: &str) {
        assert_eq!(got.dim(), want.dim(), "{what}: shape");
        for ((idx, g), w) in got.indexed_iter().zip(want.iter()) {
            assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what} at {idx:?}: {g} vs {w}");
        }
    }

    /// HF-layout weights `[cout, cin_g, k]` as a flat vector.
    fn hf_weight(seed: u64, a: usize, b: usize, k: usize) -> Vec<f32> {
        rand_rows(seed, a * b, k).iter().copied().collect()
    }

    /// `torch.nn.functional.conv1d` on the left-padded input, written plainly.
    fn naive_conv(x: &Array2<f32>, w: &[f32], bias: &[f32], cout: usize, spec: Conv1dSpec) -> Array2<f32> {
        let Conv1dSpec { kernel, dilation, groups } = spec;
        let (t_len, cin) = x.dim();
        let (cin_g, cout_g) = (cin / groups, cout / groups);
        let pad = (kernel - 1) * dilation;
        Array2::from_shape_fn((t_len, cout), |(t, o)| {
            let g = o / cout_g;
            let mut acc = bias[o];
            for c in 0..cin_g {
                for j in 0..kernel {
                    let p = t + j * dilation;
                    if p >= pad {
                        acc += w[(o * cin_g + c) * kernel + j] * x[[p - pad, g * cin_g + c]];
                    }
                }
            }
            acc
        })
    }

    #[test]
    fn causal_conv_matches_a_padded_convolution() {
        for (cin, cout, spec) in [
            (5, 7, Conv1dSpec { kernel: 7, dilation: 1, groups: 1 }),
            (6, 4, Conv1dSpec { kernel: 7, dilation: 3, groups: 2 }),
            (8, 8, Conv1dSpec { kernel: 7, dilation: 1, groups: 8 }),
            (6, 3, Conv1dSpec { kernel: 1, dilation: 1, groups: 1 }),
            (4, 4, Conv1dSpec { kernel: 3, dilation: 9, groups: 1 }),
        ] {
            let x = rand_rows(1, 40, cin);
            let w_hf = hf_weight(2, cout, cin / spec.groups, spec.kernel);
            let bias: Vec<f32> = rand_rows(3, 1, cout).iter().copied().collect();
            let w = conv1d_weight_from_hf(&w_hf, cout, cin / spec.groups, spec.kernel).unwrap();
            let b = Array2::from_shape_vec((1, cout), bias.clone()).unwrap();
            let got = causal_conv1d(x.view(), w.view(), Some(b.view()), spec).unwrap();
            close(&got, &naive_conv(&x, &w_hf, &bias, cout, spec), 1e-5, &format!("{spec:?}"));
            // A window's rows are the whole signal's rows, bit for bit, once its left context is in.
            let ctx = (spec.kernel - 1) * spec.dilation;
            let part = causal_conv1d(x.slice(ndarray::s![10.., ..]), w.view(), Some(b.view()), spec).unwrap();
            assert_eq!(part.slice(ndarray::s![ctx.., ..]), got.slice(ndarray::s![10 + ctx.., ..]));
        }
    }

    #[test]
    fn causal_conv_rejects_bad_shapes() {
        let x = rand_rows(1, 4, 6);
        let spec = Conv1dSpec { kernel: 3, dilation: 1, groups: 1 };
        let w = rand_rows(2, 18, 5);
        let err = |r: Result<Array2<f32>>| match r {
            Err(Error::Backend(BackendError::OpShape { op: "causal_conv1d", what, .. })) => what,
            other => panic!("expected a shape error, got {other:?}"),
        };
        assert_eq!(err(causal_conv1d(x.view(), rand_rows(2, 17, 5).view(), None, spec)), "weight");
        assert_eq!(err(causal_conv1d(x.view(), w.view(), Some(rand_rows(3, 1, 4).view()), spec)), "bias");
        assert_eq!(err(causal_conv1d(x.view(), w.view(), None, Conv1dSpec { groups: 4, ..spec })), "x");
        assert_eq!(err(causal_conv1d(x.view(), w.view(), None, Conv1dSpec { dilation: 0, ..spec })), "spec");
        assert_eq!(causal_conv1d(x.view(), w.view(), None, spec).unwrap().dim(), (4, 5));
    }

    /// `ConvTranspose1d` written plainly, then the causal trim.
    fn naive_trans(x: &Array2<f32>, w: &[f32], bias: &[f32], cout: usize, k: usize, s: usize) -> Array2<f32> {
        let (t_len, cin) = x.dim();
        let full_len = (t_len - 1) * s + k;
        let mut full = Array2::from_shape_fn((full_len, cout), |(_, o)| bias[o]);
        for i in 0..t_len {
            for c in 0..cin {
                for o in 0..cout {
                    for j in 0..k {
                        full[[i * s + j, o]] += x[[i, c]] * w[(c * cout + o) * k + j];
                    }
                }
            }
        }
        let trim = k - s;
        full.slice(ndarray::s![trim..full_len - trim, ..]).to_owned()
    }

    /// The CPU backend's op on a packed weight (the matrix product, then the taps' sum).
    fn backend_weight(w: Array2<f32>) -> crate::backend::cpu::PackedWeight {
        use crate::backend::Backend;
        crate::backend::cpu::CpuBackend.upload_weight(crate::backend::HostWeight::from_f32(w)).unwrap()
    }

    #[test]
    fn dense_conv_is_the_padded_convolution_and_a_window_is_the_whole_bit_for_bit() {
        use crate::backend::Backend;
        let cpu = crate::backend::cpu::CpuBackend;
        for (cin, cout, kernel, dilation) in [(5, 7, 7, 1), (6, 3, 1, 1), (4, 4, 3, 9), (40, 33, 7, 3)] {
            let spec = Conv1dSpec { kernel, dilation, groups: 1 };
            let x = rand_rows(1, 40, cin);
            let w_hf = hf_weight(2, cout, cin, kernel);
            let bias: Vec<f32> = rand_rows(3, 1, cout).iter().copied().collect();
            let w = backend_weight(dense_conv1d_weight_from_hf(&w_hf, cout, cin, kernel).unwrap());
            let b = Array2::from_shape_vec((1, cout), bias.clone()).unwrap();
            let got = cpu.dense_causal_conv1d(&x, &w, Some(&b), spec).unwrap();
            close(&got, &naive_conv(&x, &w_hf, &bias, cout, spec), 1e-5, &format!("{spec:?}"));
            let ctx = (kernel - 1) * dilation;
            let part = cpu
                .dense_causal_conv1d(&x.slice(ndarray::s![10.., ..]).to_owned(), &w, Some(&b), spec)
                .unwrap();
            assert_eq!(part.slice(ndarray::s![ctx.., ..]), got.slice(ndarray::s![10 + ctx.., ..]));
        }
        let spec = Conv1dSpec { kernel: 3, dilation: 1, groups: 1 };
        let w = backend_weight(rand_rows(2, 3 * 5, 6));
        let shape_what = |r: Result<Array2<f32>>| match r {
            Err(Error::Backend(BackendError::OpShape { what, .. })) => what,
            other => panic!("expected a shape error, got {other:?}"),
        };
        let x = rand_rows(1, 4, 6);
        assert_eq!(shape_what(cpu.dense_causal_conv1d(&x, &w, Some(&rand_rows(3, 1, 4)), spec)), "bias");
        assert_eq!(
            shape_what(cpu.dense_causal_conv1d(&x, &w, None, Conv1dSpec { groups: 2, ..spec })),
            "spec"
        );
        assert_eq!(
            shape_what(cpu.dense_causal_conv1d(&x, &w, None, Conv1dSpec { kernel: 4, ..spec })),
            "products"
        );
        assert_eq!(cpu.dense_causal_conv1d(&x, &w, None, spec).unwrap().dim(), (4, 5));
    }

    #[test]
    fn transposed_conv_matches_conv_transpose_then_trim() {
        use crate::backend::Backend;
        let cpu = crate::backend::cpu::CpuBackend;
        for (cin, cout, k, s) in [(4, 3, 8, 4), (3, 5, 2, 2), (6, 2, 6, 3), (2, 2, 5, 3), (3, 3, 1, 1)] {
            for t_len in [1, 2, 9] {
                let x = rand_rows(4, t_len, cin);
                let w_hf = hf_weight(5, cin, cout, k);
                let bias: Vec<f32> = rand_rows(6, 1, cout).iter().copied().collect();
                let w = backend_weight(conv_transpose1d_weight_from_hf(&w_hf, cin, cout, k).unwrap());
                let b = Array2::from_shape_vec((1, cout), bias.clone()).unwrap();
                let spec = ConvTranspose1dSpec { kernel: k, stride: s };
                let got = cpu.causal_conv_transpose1d(&x, &w, Some(&b), spec).unwrap();
                assert_eq!(got.nrows(), conv_transpose1d_len(t_len, spec));
                close(
                    &got,
                    &naive_trans(&x, &w_hf, &bias, cout, k, s),
                    1e-5,
                    &format!("k {k} s {s} T {t_len}"),
                );
            }
        }
        let x = rand_rows(1, 3, 2);
        let spec = ConvTranspose1dSpec { kernel: 5, stride: 2 };
        let err = cpu.causal_conv_transpose1d(&x, &backend_weight(rand_rows(2, 10, 2)), None, spec);
        assert!(matches!(err, Err(Error::Backend(BackendError::OpShape { what: "spec", .. }))));
        let spec = ConvTranspose1dSpec { kernel: 4, stride: 2 };
        let err = cpu.causal_conv_transpose1d(&x, &backend_weight(rand_rows(2, 9, 2)), None, spec);
        assert!(matches!(err, Err(Error::Backend(BackendError::OpShape { what: "products", .. }))));
    }

    #[test]
    fn activations_and_norms_match_their_formulas() {
        let x = rand_rows(7, 6, 5).mapv(|v| v * 3.0);
        let alpha = rand_rows(8, 1, 5);
        let beta = rand_rows(9, 1, 5);
        let got = snake_beta(x.view(), alpha.view(), beta.view()).unwrap();
        let want = Array2::from_shape_fn((6, 5), |(t, c)| {
            let v = x[[t, c]] as f64;
            let a = (alpha[[0, c]] as f64).exp();
            let b = (beta[[0, c]] as f64).exp();
            (v + 1.0 / (b + 1e-9) * (v * a).sin().powi(2)) as f32
        });
        close(&got, &want, 1e-5, "snake_beta");
        // Arguments far beyond the fast sine's range (channel 1's scale is about 1e6) take libm's.
        let mut wide = alpha.clone();
        wide[[0, 1]] = 13.8;
        let got = snake_beta(x.view(), wide.view(), beta.view()).unwrap();
        let want = Array2::from_shape_fn((6, 5), |(t, c)| {
            let y = x[[t, c]] * wide[[0, c]].exp();
            let s = y.sin() as f64;
            (x[[t, c]] as f64 + 1.0 / ((beta[[0, c]] as f64).exp() + 1e-9) * s * s) as f32
        });
        close(&got, &want, 1e-5, "snake_beta beyond the fast sine");
        assert!(matches!(
            snake_beta(x.view(), alpha.view(), rand_rows(1, 1, 4).view()),
            Err(Error::Backend(BackendError::OpShape { op: "snake_beta", what: "beta", .. }))
        ));

        let (w, b) = (rand_rows(10, 1, 5), rand_rows(11, 1, 5));
        let got = layer_norm(x.view(), w.view(), b.view(), 1e-6).unwrap();
        let want = Array2::from_shape_fn((6, 5), |(t, c)| {
            let row: Vec<f64> = x.row(t).iter().map(|&v| v as f64).collect();
            let mean = row.iter().sum::<f64>() / 5.0;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 5.0;
            ((row[c] - mean) / (var + 1e-6).sqrt() * w[[0, c]] as f64 + b[[0, c]] as f64) as f32
        });
        close(&got, &want, 1e-5, "layer_norm");
        assert!(matches!(
            layer_norm(x.view(), rand_rows(1, 1, 6).view(), b.view(), 1e-6),
            Err(Error::Backend(BackendError::OpShape { op: "layer_norm", what: "weight", .. }))
        ));

        // erf(1/√2) = 0.682689492..., erf(2/√2) = 0.954499736...
        let got = gelu(array![[1.0f32, -2.0, 0.0]].view());
        let want = array![[0.5 * 1.682_689_5, -0.5 * 2.0 * (1.0 - 0.954_499_7), 0.0]];
        close(&got, &want, 1e-6, "gelu");

        let mut s = x.clone();
        scale_cols(&mut s, w.view()).unwrap();
        close(&s, &Array2::from_shape_fn((6, 5), |(t, c)| x[[t, c]] * w[[0, c]]), 0.0, "scale_cols");
        assert!(matches!(
            scale_cols(&mut s, rand_rows(1, 2, 5).view()),
            Err(Error::Backend(BackendError::OpShape { op: "scale_cols", what: "scale", .. }))
        ));

        let mut c = array![[-3.0f32, -0.5, 0.25, 2.0, f32::NAN]];
        clamp(&mut c, -1.0, 1.0).unwrap();
        assert_eq!(c.slice(ndarray::s![.., ..4]), array![[-1.0f32, -0.5, 0.25, 1.0]]);
        assert!(c[[0, 4]].is_nan(), "NaN stays NaN, as torch.clamp");
        assert!(matches!(
            clamp(&mut c, 1.0, -1.0),
            Err(Error::Backend(BackendError::OpShape { op: "clamp", what: "bounds", .. }))
        ));
    }
}
