use ndarray::{Array2, s};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::Error;
use crate::backend::cpu::CpuBackend;

fn random_codes(seed: u64, cfg: &Code2WavConfig, frames: usize) -> Array2<i64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    Array2::from_shape_fn((cfg.num_quantizers, frames), |_| rng.random_range(0..cfg.codebook_size as i64))
}

/// Pushes `codes` in pieces of `sizes` (cycled), then finishes.
fn streamed(
    model: &Code2Wav<CpuBackend>, codes: &Array2<i64>, first: usize, chunk: usize, sizes: &[usize],
) -> Vec<f32> {
    let mut stream = Code2WavStream::new(model, first, chunk).unwrap();
    let mut wav = Vec::new();
    let mut t = 0;
    for &n in sizes.iter().cycle() {
        if t >= codes.ncols() {
            break;
        }
        let end = (t + n).min(codes.ncols());
        let before = wav.len();
        wav.extend(stream.push(&CpuBackend, codes.slice(s![.., t..end])).unwrap());
        assert_eq!(wav.len(), stream.samples_emitted());
        assert!(wav.len() >= before);
        t = end;
    }
    assert_eq!(stream.frames_received(), codes.ncols());
    wav.extend(stream.finish(&CpuBackend).unwrap());
    wav
}

#[test]
fn streamed_audio_equals_one_pass() {
    let cfg = Code2WavConfig::tiny();
    // 2 layers with a 6-key window: the transformer reaches 10 frames back, the convs 13.
    assert_eq!((cfg.transformer_left_context(), cfg.conv_left_context()), (10, 13));
    let model = Code2Wav::random(&CpuBackend, cfg.clone(), 3).unwrap();
    for (seed, frames) in [(1, 1), (2, 5), (3, 37), (4, 90)] {
        let codes = random_codes(seed, &cfg, frames);
        let one = model.forward(&CpuBackend, codes.view()).unwrap();
        assert_eq!(one.len(), cfg.output_len(frames));
        let inside = one.iter().filter(|v| v.abs() < 0.99).count();
        assert!(inside * 2 > one.len(), "most samples inside the clamp: {inside} of {}", one.len());
        for (first, chunk, sizes) in
            [(4, 25, &[1usize][..]), (1, 1, &[1][..]), (4, 10, &[3, 7, 1][..]), (2, 5, &[frames][..])]
        {
            let wav = streamed(&model, &codes, first, chunk, sizes);
            assert_eq!(wav.len(), one.len(), "{frames} frames, chunks {first}/{chunk}, pushes {sizes:?}");
            let diff = wav.iter().zip(&one).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(diff <= 1e-5, "{frames} frames, chunks {first}/{chunk}: max diff {diff}");
            assert_eq!(wav, one, "bit for bit on the CPU");
        }
    }
}

#[test]
fn stream_emits_audio_as_soon_as_it_is_final() {
    let cfg = Code2WavConfig::tiny();
    let model = Code2Wav::random(&CpuBackend, cfg.clone(), 3).unwrap();
    let codes = random_codes(9, &cfg, 13);
    let mut stream = Code2WavStream::new(&model, 2, 5).unwrap();
    let mut push = |from: usize, to: usize| stream.push(&CpuBackend, codes.slice(s![.., from..to])).unwrap();
    assert!(push(0, 1).is_empty(), "1 < first chunk");
    assert_eq!(push(1, 2).len(), cfg.output_len(2), "all of 2 frames' samples are final");
    // Later chunks double (2 frames decoded: wait for 2 more, then 4), up to `chunk` (5).
    assert!(push(2, 3).is_empty(), "1 < 2 frames decoded");
    assert_eq!(push(3, 4).len(), cfg.output_len(4) - cfg.output_len(2));
    assert!(push(4, 7).is_empty(), "3 < 4 frames decoded");
    assert_eq!(push(7, 8).len(), cfg.output_len(8) - cfg.output_len(4));
    assert!(push(8, 12).is_empty(), "4 < chunk (5), not 8");
    assert_eq!(push(12, 13).len(), cfg.output_len(13) - cfg.output_len(8));
    assert!(matches!(
        Code2WavStream::new(&model, 0, 5),
        Err(Error::Config(crate::error::ConfigError::Invalid { field: "first_chunk", .. }))
    ));
}

/// A caller that holds decodes (an engine serving first audio first) appends frames
/// past a due chunk; the late decode carries all of them, and the audio is one pass's.
#[test]
fn a_held_decode_carries_every_pending_frame() {
    let cfg = Code2WavConfig::tiny();
    let model = Code2Wav::random(&CpuBackend, cfg.clone(), 3).unwrap();
    let codes = random_codes(5, &cfg, 21);
    let mut stream = Code2WavStream::new(&model, 1, 2).unwrap();
    let mut wav = stream.push(&CpuBackend, codes.slice(s![.., 0..1])).unwrap();
    assert_eq!(wav.len(), cfg.output_len(1));
    for t in 1..9 {
        stream.append(codes.slice(s![.., t..t + 1])).unwrap();
        assert!(stream.is_due(), "a chunk of 1 (then 2) frames is due from frame 2 on");
    }
    assert_eq!(stream.pending_frames(), 8, "appends decode nothing");
    let held = stream.decode_if_due(&CpuBackend).unwrap();
    assert_eq!(held.len(), cfg.output_len(9) - cfg.output_len(1), "8 frames in one chunk, more than `chunk`");
    assert_eq!(stream.pending_frames(), 0);
    assert!(!stream.is_due() && stream.decode_if_due(&CpuBackend).unwrap().is_empty());
    wav.extend(held);
    for t in 9..21 {
        wav.extend(stream.push(&CpuBackend, codes.slice(s![.., t..t + 1])).unwrap());
    }
    wav.extend(stream.finish(&CpuBackend).unwrap());
    assert_eq!(wav, model.forward(&CpuBackend, codes.view()).unwrap(), "bit for bit on the CPU");
}

#[test]
fn bad_codes_are_request_errors_naming_quantizer_and_frame() {
    let cfg = Code2WavConfig::tiny();
    let model = Code2Wav::random(&CpuBackend, cfg.clone(), 3).unwrap();
    let mut codes = random_codes(5, &cfg, 6);
    codes[[2, 4]] = 64;
    assert!(matches!(
        model.forward(&CpuBackend, codes.view()),
        Err(Error::Request(RequestError::CodecCodeOutOfRange {
            quantizer: 2,
            frame: 4,
            code: 64,
            codebook_size: 64
        }))
    ));
    codes[[2, 4]] = 0;
    codes[[1, 5]] = -1;
    let mut stream = Code2WavStream::new(&model, 4, 4).unwrap();
    stream.push(&CpuBackend, codes.slice(s![.., 0..3])).unwrap();
    assert!(matches!(
        stream.push(&CpuBackend, codes.slice(s![.., 3..6])),
        Err(Error::Request(RequestError::CodecCodeOutOfRange { quantizer: 1, frame: 5, code: -1, .. }))
    ));
    assert_eq!(stream.frames_received(), 3, "a rejected push adds nothing");
    assert!(matches!(
        model.forward(&CpuBackend, codes.slice(s![..3, ..])),
        Err(Error::Request(RequestError::MediaShape { what: "codec codes", .. }))
    ));
    assert!(model.forward(&CpuBackend, codes.slice(s![.., ..0])).unwrap().is_empty());
}

#[test]
fn missing_or_misshapen_weights_are_checkpoint_errors() {
    let cfg = Code2WavConfig::tiny();
    let mut src = random_source(&cfg, 1).unwrap();
    src.remove("code2wav.decoder.2.block.3.conv1.conv.weight");
    assert!(matches!(
        Code2Wav::load(&CpuBackend, cfg.clone(), &src),
        Err(Error::Checkpoint(CheckpointError::MissingTensor { name })) if name == "code2wav.decoder.2.block.3.conv1.conv.weight"
    ));
    let mut src = random_source(&cfg, 1).unwrap();
    src.insert(
        "code2wav.upsample.1.1.dwconv.conv.weight",
        HostTensor { shape: vec![32, 1, 5], data: vec![0.0; 160] },
    );
    assert!(matches!(
        Code2Wav::load(&CpuBackend, cfg, &src),
        Err(Error::Checkpoint(CheckpointError::TensorShape { .. }))
    ));
}
