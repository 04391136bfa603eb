//! Qwen3-Omni code2wav against transformers, and streaming against one pass.
//!
//! `fixtures/make_omni_audio.py` recorded, with HF's `Qwen3OmniMoeCode2Wav` of the tiny
//! `omni_audio` checkpoint (192 samples a frame, 2 sliding-window layers of 8 keys), the
//! waveform of `code2wav_long.codes [16, 320]` (one forward) and of each chat case's talker
//! codes (`text`, `image`, `round2`; `chunked_decode` of fewer than 300 frames, i.e. one
//! forward). Our [`Code2Wav::forward`] on the CPU backend must match each within
//! [`TOLERANCE`] (max abs, samples in `[-1, 1]`), and [`Code2WavStream`] must give one pass's
//! samples whatever the chunking.

use ndarray::{Array2, s};
use omniprefix::backend::cpu::CpuBackend;
use omniprefix::model::code2wav::{Code2Wav, Code2WavStream};
use safetensors::{Dtype, SafeTensors};
use support::reference::{TestResult, model_dir};

/// Largest accepted `max |ours - HF|` over a waveform.
const TOLERANCE: f32 = 1e-4;
/// Largest accepted `max |streamed - one pass|` (the CPU kernels give 0).
const STREAM_TOLERANCE: f32 = 1e-5;

/// A case's codes `[16, frames]` and HF's waveform.
struct Case {
    codes: Array2<i64>,
    waveform: Vec<f32>,
}

fn tensor<T: bytemuck::Pod>(
    st: &SafeTensors<'_>, name: &str, dtype: Dtype,
) -> TestResult<(Vec<usize>, Vec<T>)> {
    let view = st.tensor(name)?;
    if view.dtype() != dtype {
        return Err(format!("{name}: {:?}, expected {dtype:?}", view.dtype()).into());
    }
    Ok((view.shape().to_vec(), bytemuck::pod_collect_to_vec(view.data())))
}

fn load_cases(names: &[&str]) -> TestResult<Vec<Case>> {
    let bytes = std::fs::read(model_dir("omni_audio").join("audio_reference.safetensors"))?;
    let st = SafeTensors::deserialize(&bytes)?;
    names
        .iter()
        .map(|c| {
            let (shape, codes) = tensor::<i64>(&st, &format!("{c}.codes"), Dtype::I64)?;
            let &[rows, cols] = shape.as_slice() else { return Err(format!("{c}.codes: {shape:?}").into()) };
            let (_, waveform) = tensor::<f32>(&st, &format!("{c}.waveform"), Dtype::F32)?;
            Ok(Case { codes: Array2::from_shape_vec((rows, cols), codes)?, waveform })
        })
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn model() -> TestResult<Code2Wav<CpuBackend>> {
    Ok(Code2Wav::from_dir(&CpuBackend, &model_dir("omni_audio"))?)
}

#[test]
fn one_pass_matches_transformers() -> TestResult {
    let model = model()?;
    assert_eq!((model.total_upsample(), model.sample_rate()), (192, 24_000));
    let names = ["code2wav_long", "text", "image", "round2"];
    for (name, case) in names.iter().zip(load_cases(&names)?) {
        let ours = model.forward(&CpuBackend, case.codes.view())?;
        assert_eq!(ours.len(), case.waveform.len(), "{name}: samples");
        assert_eq!(ours.len(), model.config().output_len(case.codes.ncols()), "{name}");
        let diff = max_diff(&ours, &case.waveform);
        eprintln!("code2wav {name}: {} frames, max |ours - HF| = {diff:e}", case.codes.ncols());
        assert!(diff <= TOLERANCE, "{name}: max |ours - HF| = {diff}");
    }
    Ok(())
}

#[test]
fn streamed_audio_equals_one_pass_and_hf() -> TestResult {
    let model = model()?;
    let [long] = <[Case; 1]>::try_from(load_cases(&["code2wav_long"])?).map_err(|_| "one case")?;
    let one = model.forward(&CpuBackend, long.codes.view())?;
    // (first chunk, later chunks, frames a push): vllm-omni's 4 / 25 frame by frame, odd pushes.
    for (first, chunk, push) in [(4, 25, 1), (4, 25, 7), (1, 1, 1), (10, 60, 33), (300, 300, 320)] {
        let mut stream = Code2WavStream::new(&model, first, chunk)?;
        let mut wav = Vec::new();
        for t in (0..long.codes.ncols()).step_by(push) {
            let end = (t + push).min(long.codes.ncols());
            wav.extend(stream.push(&CpuBackend, long.codes.slice(s![.., t..end]))?);
        }
        wav.extend(stream.finish(&CpuBackend)?);
        assert_eq!(wav.len(), one.len(), "chunks {first}/{chunk}, pushes of {push}");
        let diff = max_diff(&wav, &one);
        let hf = max_diff(&wav, &long.waveform);
        eprintln!("code2wav stream {first}/{chunk} (pushes of {push}): vs one pass {diff:e}, vs HF {hf:e}");
        assert!(diff <= STREAM_TOLERANCE, "chunks {first}/{chunk}: max |streamed - one pass| = {diff}");
        assert!(hf <= TOLERANCE, "chunks {first}/{chunk}: max |streamed - HF| = {hf}");
    }
    Ok(())
}

/// HF's `chunked_decode(300, 25)` is not one pass: each decode drops its last 66 samples
/// (here; 555 in the release) instead of holding them back, and 25 frames of left context
/// do not cover the transformer's. Its first chunk is one pass's first samples.
#[test]
fn hf_chunked_decode_drops_samples_one_pass_keeps() -> TestResult {
    let model = model()?;
    let bytes = std::fs::read(model_dir("omni_audio").join("audio_reference.safetensors"))?;
    let st = SafeTensors::deserialize(&bytes)?;
    let (_, chunked) = tensor::<f32>(&st, "code2wav_long.waveform_chunked", Dtype::F32)?;
    let lost = 300 * 192 - model.config().output_len(300);
    assert_eq!(lost, 66);
    assert_eq!(chunked.len() + lost, model.config().output_len(320));
    let [long] = <[Case; 1]>::try_from(load_cases(&["code2wav_long"])?).map_err(|_| "one case")?;
    let one = model.forward(&CpuBackend, long.codes.view())?;
    let first = model.config().output_len(300);
    assert!(max_diff(&one[..first], &chunked[..first]) <= TOLERANCE);
    Ok(())
}

/// The wgpu backend runs code2wav through the trait's host-fallback ops (convolutions,
/// SnakeBeta, LayerNorm, GELU, scale, clamp, windowed attention) and its own kernels
/// (embedding, products, RMSNorm, RoPE, SwiGLU): the same waveform as HF, and streamed
/// as one pass.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_backend_matches_transformers() -> TestResult {
    let Some(gpu) = crate::shared_gpu::gpu() else { return Ok(()) };
    let model = Code2Wav::from_dir(&gpu, &model_dir("omni_audio"))?;
    let names = ["text", "round2"];
    for (name, case) in names.iter().zip(load_cases(&names)?) {
        let ours = model.forward(&gpu, case.codes.view())?;
        let diff = max_diff(&ours, &case.waveform);
        assert!(diff <= TOLERANCE, "wgpu {name}: max |ours - HF| = {diff}");
        let mut stream = Code2WavStream::new(&model, 4, 5)?;
        let mut wav = Vec::new();
        for t in 0..case.codes.ncols() {
            wav.extend(stream.push(&gpu, case.codes.slice(s![.., t..t + 1]))?);
        }
        wav.extend(stream.finish(&gpu)?);
        let streamed = max_diff(&wav, &ours);
        eprintln!("wgpu code2wav {name}: max |ours - HF| = {diff:e}, streamed vs one pass {streamed:e}");
        assert_eq!(wav.len(), ours.len());
        assert!(streamed <= STREAM_TOLERANCE, "wgpu {name}: max |streamed - one pass| = {streamed}");
    }
    Ok(())
}
