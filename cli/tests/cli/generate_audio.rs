//! `omniprefix generate --audio-out` on the tiny full Omni checkpoint (`fixtures/tiny/omni_audio`)
//! against transformers' own `generate(return_audio=True)` (`audio_reference.safetensors`, case
//! `text`): the WAV file's samples, the `--out` codes, the JSON figures, the talker's length cap,
//! and audio asked of a checkpoint without a talker as the library's typed error.

use std::path::{Path, PathBuf};

use clap::Parser;
use safetensors::SafeTensors;
use serde_json::Value;

use super::common::{self, TestResult, fixture, p};
use omniprefix::Error;
use omniprefix::error::RequestError;
use omniprefix_cli::HarnessError;
use omniprefix_cli::cli::{Cli, run};

fn scratch(test: &str) -> TestResult<PathBuf> {
    common::scratch("generate-audio", test)
}

/// HF's recording of case `text`: the thinker prompt, its codes `[16, frames]` and waveform.
struct Reference {
    input_ids: Vec<i64>,
    codes: Vec<i64>,
    code_shape: Vec<usize>,
    waveform: Vec<f32>,
    /// HF's `thinker_suppress_tokens` as `--suppress-ids` ranges (`242,246-255,...`).
    suppress: String,
}

fn reference() -> TestResult<Reference> {
    let bytes = std::fs::read(fixture("omni_audio").join("audio_reference.safetensors"))?;
    let st = SafeTensors::deserialize(&bytes)?;
    let ints = |name: &str| -> TestResult<(Vec<i64>, Vec<usize>)> {
        let t = st.tensor(name)?;
        let values = t.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
        Ok((values.collect(), t.shape().to_vec()))
    };
    let (input_ids, _) = ints("text.input_ids")?;
    let (codes, code_shape) = ints("text.codes")?;
    let waveform = st.tensor("text.waveform")?.data().chunks_exact(4);
    let waveform = waveform.map(|b| f32::from_le_bytes(b.try_into().unwrap_or([0; 4]))).collect();
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("omni_audio").join("audio_reference.json"))?)?;
    let ids: Vec<u32> = serde_json::from_value(json["generate_kwargs"]["thinker_suppress_tokens"].clone())?;
    Ok(Reference { input_ids, codes, code_shape, waveform, suppress: ranges(&ids) })
}

/// Sorted ids as comma-separated inclusive ranges: `[1, 2, 3, 7]` is `1-3,7`.
fn ranges(ids: &[u32]) -> String {
    let mut parts: Vec<(u32, u32)> = Vec::new();
    for &id in ids {
        match parts.last_mut() {
            Some((_, hi)) if *hi + 1 == id => *hi = id,
            _ => parts.push((id, id)),
        }
    }
    let part = |&(lo, hi): &(u32, u32)| if lo == hi { lo.to_string() } else { format!("{lo}-{hi}") };
    parts.iter().map(part).collect::<Vec<_>>().join(",")
}

/// A request file of case `text`'s ids in `dir`.
fn request_file(dir: &Path, hf: &Reference) -> TestResult<PathBuf> {
    let path = dir.join("text.json");
    let ids = serde_json::to_string(&hf.input_ids)?;
    std::fs::write(&path, format!(r#"{{"expanded": true, "segments": [{{"text": {ids}}}]}}"#))?;
    Ok(path)
}

/// `generate --model <model> <args>` in process; stdout on success.
fn generate(model: &str, args: &[&str]) -> Result<String, HarnessError> {
    let model = fixture(model);
    let base = ["omniprefix", "generate", "--model", p(&model)];
    let mut out = Vec::new();
    run(Cli::try_parse_from(base.iter().chain(args))?, &mut out)?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn json(stdout: &str) -> TestResult<Value> {
    Ok(serde_json::from_str(stdout.trim())?)
}

fn number(report: &Value, key: &str) -> TestResult<u64> {
    Ok(report[key].as_u64().ok_or_else(|| format!("{key} in {report}"))?)
}

#[test]
fn audio_out_equals_hf_waveform_and_codes() -> TestResult {
    let hf = reference()?;
    let dir = scratch("hf")?;
    let req = request_file(&dir, &hf)?;
    let (wav, out) = (dir.join("x.wav"), dir.join("y.safetensors"));
    let args = [
        "--request",
        p(&req),
        "--suppress-ids",
        &hf.suppress,
        "--max-tokens",
        "8",
        "--talker-temperature",
        "0",
        "--talker-max-tokens",
        "64",
        "--audio-out",
        p(&wav),
        "--json",
        "--out",
        p(&out),
    ];
    let report = json(&generate("omni_audio", &args)?)?;

    // The WAV file: mono IEEE float at the talker's rate, HF's waveform within 1e-4.
    let mut reader = hound::WavReader::open(&wav)?;
    let spec = reader.spec();
    assert_eq!(
        (spec.channels, spec.sample_rate, spec.bits_per_sample, spec.sample_format),
        (1, 24_000, 32, hound::SampleFormat::Float)
    );
    let samples = reader.samples::<f32>().collect::<Result<Vec<_>, _>>()?;
    assert_eq!(samples.len(), hf.waveform.len());
    let worst = samples.iter().zip(&hf.waveform).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(worst <= 1e-4, "the waveform differs from HF's by {worst}");

    // `--out`: HF's codes, the waveform as written, next to the hidden states.
    let bytes = std::fs::read(&out)?;
    let st = SafeTensors::deserialize(&bytes)?;
    let codes = st.tensor("codes")?;
    assert_eq!((codes.dtype(), codes.shape()), (safetensors::Dtype::I64, &hf.code_shape[..]));
    let got: Vec<i64> =
        codes.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8]))).collect();
    assert_eq!(got, hf.codes, "codes [16, frames]");
    let audio = st.tensor("audio")?;
    assert_eq!((audio.dtype(), audio.shape()), (safetensors::Dtype::F32, &[samples.len()][..]));
    let audio: Vec<f32> =
        audio.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap_or([0; 4]))).collect();
    assert_eq!(audio, samples, "--out's audio is the WAV's");
    assert!(st.names().iter().any(|n| n.starts_with("hidden.")), "{:?}", st.names());

    // The JSON figures agree with the files.
    let frames = hf.code_shape[1] as u64;
    assert_eq!(number(&report, "codec_frames")?, frames, "{report}");
    assert_eq!(number(&report, "audio_samples")?, samples.len() as u64, "{report}");
    assert_eq!(number(&report, "sample_rate")?, 24_000);
    assert_eq!(number(&report, "talker_prompt_rows")?, 22, "HF's talker prefill rows: {report}");
    assert_eq!(number(&report, "talker_cached_rows")?, 0, "nothing ran before: {report}");
    assert_eq!(report["talker_finish_reason"].as_str(), Some("stop"), "{report}");
    let (ttfa, total) = (report["ttfa_ms"].as_f64(), report["total_ms"].as_f64());
    assert!(ttfa.zip(total).is_some_and(|(a, t)| a > 0.0 && a <= t), "{report}");
    assert_eq!(report["tokens"].as_array().map(Vec::len), Some(8), "{report}");
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn talker_flags_cap_the_reply_and_warm_ups_speak_too() -> TestResult {
    let hf = reference()?;
    let dir = scratch("cap")?;
    let req = request_file(&dir, &hf)?;
    let base = ["--request", p(&req), "--suppress-ids", &hf.suppress, "--max-tokens", "8", "--json"];
    let greedy = ["--talker-temperature", "0"];

    // Without an audio flag: no audio figures.
    let plain = json(&generate("omni_audio", &base)?)?;
    for key in ["codec_frames", "audio_samples", "sample_rate", "ttfa_ms", "talker_prompt_rows"] {
        assert!(plain.get(key).is_none(), "{key}: {plain}");
    }

    // `--talker-max-tokens 3` counts talker steps as transformers does: 2 frames.
    let capped =
        json(&generate("omni_audio", &[&base[..], &greedy, &["--talker-max-tokens", "3"]].concat())?)?;
    assert_eq!(number(&capped, "codec_frames")?, 2, "{capped}");
    assert_eq!(capped["talker_finish_reason"].as_str(), Some("length"), "{capped}");
    assert!(number(&capped, "audio_samples")? > 0, "{capped}");

    // A warm-up of the same request asks for audio too; the thinker's prompt is then cached
    // (the talker's rows as the engine reuses them). `--no-cache` reuses nothing.
    let talker = [&base[..], &greedy, &["--talker-max-tokens", "4", "--warm", p(&req)]].concat();
    let warmed = json(&generate("omni_audio", &talker)?)?;
    assert!(number(&warmed, "num_cached_tokens")? > 0, "{warmed}");
    assert!(number(&warmed, "talker_cached_rows")? <= number(&warmed, "talker_prompt_rows")?, "{warmed}");
    let uncached = json(&generate("omni_audio", &[&talker[..], &["--no-cache"]].concat())?)?;
    assert_eq!(number(&uncached, "num_cached_tokens")?, 0, "{uncached}");
    assert_eq!(number(&uncached, "talker_cached_rows")?, 0, "{uncached}");
    assert_eq!(uncached["tokens"], warmed["tokens"], "greedy: caching changes nothing generated");
    assert_eq!(uncached["codec_frames"], warmed["codec_frames"]);

    // The text report names the audio too.
    let wav = dir.join("cap.wav");
    let text = generate("omni_audio", &[&base[..base.len() - 1], &["--audio-out", p(&wav)]].concat())?;
    assert!(text.lines().any(|l| l.starts_with("audio: ") && l.contains(" Hz")), "{text}");
    assert!(text.lines().any(|l| l.starts_with("ttfa: ")), "{text}");
    assert!(wav.exists());

    // The talker's own checks are the library's typed errors.
    let err = generate("omni_audio", &[&base[..], &["--speaker", "nobody"]].concat());
    assert!(
        matches!(&err, Err(HarnessError::Engine(Error::Request(RequestError::UnknownSpeaker { .. })))),
        "{err:?}"
    );
    let err = generate("omni_audio", &[&base[..], &["--talker-max-tokens", "0"]].concat());
    assert!(
        matches!(
            &err,
            Err(HarnessError::Engine(Error::Request(RequestError::InvalidSampling {
                param: "max_new_tokens",
                ..
            })))
        ),
        "{err:?}"
    );
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn audio_of_a_checkpoint_without_a_talker_is_an_error_not_a_panic() -> TestResult {
    let dir = scratch("no-talker")?;
    let req = dir.join("req.json");
    std::fs::write(&req, r#"{"segments": [{"text": [10, 11, 12, 13]}]}"#)?;
    let wav = dir.join("x.wav");
    let err = generate("omni_thinker", &["--request", p(&req), "--max-tokens", "2", "--audio-out", p(&wav)]);
    assert!(
        matches!(&err, Err(HarnessError::Engine(Error::Request(RequestError::NoTalker { .. })))),
        "{err:?}"
    );
    assert!(!wav.exists(), "no file for a request that failed");

    let model = fixture("omni_thinker");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_omniprefix"))
        .args(["generate", "--model", p(&model), "--request", p(&req), "--max-tokens", "2"])
        .args(["--audio-out", p(&wav)])
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.starts_with("error: ") && stderr.contains("talker"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn a_backwards_suppress_range_fails_with_a_message() -> TestResult {
    let req = fixture("omni_audio").join("unused.json");
    let err = generate("omni_audio", &["--request", p(&req), "--max-tokens", "2", "--suppress-ids", "9-7"]);
    match err {
        Err(HarnessError::Args(e)) => {
            let message = e.to_string();
            assert!(message.contains("9-7") && message.contains("suppress"), "{message}");
        }
        other => return Err(format!("a parse error naming 9-7: {other:?}").into()),
    }
    let model = fixture("omni_audio");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_omniprefix"))
        .args(["generate", "--model", p(&model), "--request", p(&req), "--max-tokens", "2"])
        .args(["--suppress-ids", "9-7"])
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("9-7"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    Ok(())
}
