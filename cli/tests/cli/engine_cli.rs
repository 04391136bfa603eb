//! `omniprefix hidden` and `omniprefix bench ttft` end to end, through the binary:
//! output tensors' names, shapes and values (cached = uncached), and bad input
//! as one `error:` line with a non-zero exit.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use super::common::{self, TestResult, fixture, hidden_args, p};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

/// A fresh scratch folder per test.
fn scratch(test: &str) -> TestResult<PathBuf> {
    common::scratch("engine-cli", test)
}

/// A scratch dir holding `req.json`, a request of the text tokens 1, 2, 3.
fn text_request(test: &str) -> TestResult<(PathBuf, PathBuf)> {
    let dir = scratch(test)?;
    let req = dir.join("req.json");
    std::fs::write(&req, r#"{"segments": [{"text": [1, 2, 3]}]}"#)?;
    Ok((dir, req))
}

fn omniprefix(args: &[&str]) -> TestResult<Output> {
    Ok(Command::new(env!("CARGO_BIN_EXE_omniprefix")).args(args).output()?)
}

fn ok_stdout(out: &Output) -> TestResult<String> {
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!("exit {:?}: {stderr}", out.status.code()).into());
    }
    Ok(String::from_utf8(out.stdout.clone())?)
}

/// The one-line error of a failed run.
fn error_line(out: &Output) -> TestResult<String> {
    assert!(!out.status.success(), "expected failure, got {}", String::from_utf8_lossy(&out.stdout));
    let stderr = String::from_utf8(out.stderr.clone())?;
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    Ok(stderr)
}

/// One tensor of an output file: name, shape, values.
type Named = (String, Vec<usize>, Vec<f32>);

/// The tensors of an output file, by name.
fn read_tensors(path: &Path) -> TestResult<Vec<Named>> {
    let bytes = std::fs::read(path)?;
    let st = SafeTensors::deserialize(&bytes)?;
    let mut out: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| (name, v.shape().to_vec(), bytemuck::pod_collect_to_vec::<u8, f32>(v.data())))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Each tensor's name and shape, in the file's (sorted) order.
fn names_and_shapes(tensors: &[Named]) -> Vec<(&str, &[usize])> {
    tensors.iter().map(|(n, s, _)| (n.as_str(), s.as_slice())).collect()
}

/// What capturing `hidden.0`, `middle` and `final` writes for 11 positions of a 64-wide
/// tiny checkpoint with a 256-id vocabulary: the three layers and the last position's logits.
fn captured_11(middle: &'static str) -> Vec<(&'static str, &'static [usize])> {
    vec![("hidden.0", &[11, 64][..]), (middle, &[11, 64]), ("hidden.final", &[11, 64]), ("logits", &[1, 256])]
}

#[test]
fn hidden_writes_full_hidden_states_equal_to_the_uncached_run() -> TestResult {
    let dir = scratch("text")?;
    let (warm, req) = (dir.join("warm.json"), dir.join("req.json"));
    std::fs::write(&warm, r#"{"segments": [{"text": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]}]}"#)?;
    std::fs::write(&req, r#"{"segments": [{"text": [5, 6, 7, 8, 9, 10]}, {"text": [11, 12, 13, 99, 98]}]}"#)?;
    let (cached, uncached) = (dir.join("cached.safetensors"), dir.join("uncached.safetensors"));
    let m = fixture("qwen3_dense");
    let common = hidden_args(&m, &req, &["--warm", p(&warm), "--block-size", "4", "--capture", "0,2,final"]);
    let stdout = ok_stdout(&omniprefix(&[&common[..], &["--out", p(&cached)]].concat())?)?;
    // The warm request cached all its 10 positions; the request shares 9 of them.
    assert!(stdout.contains("num_cached_tokens: 9"), "{stdout}");
    assert!(stdout.contains("hidden.2: [11, 64]") && stdout.contains("logits: [1, 256]"), "{stdout}");
    let stdout = ok_stdout(&omniprefix(&[&common[..], &["--out", p(&uncached), "--no-cache"]].concat())?)?;
    assert!(stdout.contains("num_cached_tokens: 0"), "{stdout}");
    let (a, b) = (read_tensors(&cached)?, read_tensors(&uncached)?);
    assert_eq!(names_and_shapes(&a), captured_11("hidden.2"));
    for ((name, _, x), (_, _, y)) in a.iter().zip(&b) {
        let scale = y.iter().fold(1f32, |m, v| m.max(v.abs()));
        assert!(x.iter().zip(y).all(|(u, v)| (u - v).abs() <= 1e-5 * scale), "{name} differs");
    }
    let all = dir.join("all.safetensors");
    ok_stdout(&omniprefix(&hidden_args(&m, &req, &["--out", p(&all), "--capture", "all"]))?)?;
    assert_eq!(read_tensors(&all)?.len(), 3 + 1 + 1 + 1, "hidden.0..=3, hidden.final, logits");
    Ok(())
}

/// Writes one safetensors file of `(name, dtype, shape, bytes)`.
fn write_st(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> TestResult {
    let views = tensors
        .iter()
        .map(|(n, d, s, b)| Ok((n.to_string(), TensorView::new(*d, s.clone(), b)?)))
        .collect::<TestResult<Vec<_>>>()?;
    safetensors::tensor::serialize_to_file(views, &None, path)?;
    Ok(())
}

/// The tiny Omni checkpoint's test image in `dir/img.safetensors`: 8x8x3 `pixels`, and
/// its 6 rows of 64-wide embeddings as `emb` and flattened as `flat` (a shape a request refuses).
fn write_image(dir: &Path) -> TestResult {
    let emb: Vec<u8> = (0..6 * 64).flat_map(|i| ((i as f32) * 0.01).sin().to_le_bytes()).collect();
    write_st(
        &dir.join("img.safetensors"),
        &[
            ("pixels", Dtype::U8, vec![8, 8, 3], (0..192).map(|i| i as u8).collect()),
            ("emb", Dtype::F32, vec![6, 64], emb.clone()),
            ("flat", Dtype::F32, vec![6 * 64], emb),
        ],
    )
}

/// A request file's JSON: ids `1 2 <vision_start>`, [`write_image`]'s image (its 1x4x6
/// grid, 6 rows) with embeddings tensor `emb`, then `<vision_end>` and `tail` (the tiny
/// Omni checkpoint's special ids: vision_start 250, vision_end 251).
fn image_request(emb: &str, tail: &[u32]) -> String {
    let tail: Vec<String> = std::iter::once(251).chain(tail.iter().copied()).map(|t| t.to_string()).collect();
    format!(
        r#"{{"segments": [{{"text": [1, 2, 250]}},
            {{"item": {{"modality": "image", "layout": {{"kind": "image", "grid_thw": [1, 4, 6]}},
                       "content": {{"file": "img.safetensors", "tensor": "pixels"}},
                       "embeddings": {{"file": "img.safetensors", "tensor": "{emb}"}}}}}},
            {{"text": [{}]}}]}}"#,
        tail.join(", ")
    )
}

#[test]
fn hidden_runs_multimodal_requests_and_reports_bad_input_in_one_line() -> TestResult {
    let dir = scratch("mm")?;
    write_image(&dir)?;
    let request = |emb: &str| image_request(emb, &[3]);
    let req = dir.join("req.json");
    std::fs::write(&req, request("emb"))?;
    let (m, out) = (fixture("omni_thinker"), dir.join("out.safetensors"));
    let run = |req: &Path| {
        omniprefix(&hidden_args(&m, req, &["--out", p(&out), "--warm", p(req), "--block-size", "4"]))
    };
    let stdout = ok_stdout(&run(&req)?)?;
    // The warm run of the same 11 positions cached them all; the last one always runs.
    assert!(stdout.contains("num_cached_tokens: 10"), "{stdout}");
    let tensors = read_tensors(&out)?;
    // Default capture of a 3-layer model: hidden.0, hidden.1 (the middle), final.
    assert_eq!(names_and_shapes(&tensors), captured_11("hidden.1"));
    // hidden.0 rows 3..9 are the item's embeddings.
    let first_row: Vec<f32> = (0..64).map(|i| ((i as f32) * 0.01).sin()).collect();
    assert_eq!(&tensors[0].2[3 * 64..4 * 64], first_row.as_slice());

    let bad = |name: &str, text: String| -> TestResult<String> {
        let path = dir.join(name);
        std::fs::write(&path, text)?;
        error_line(&run(&path)?)
    };
    assert!(bad("nonjson.json", "{segments".into())?.contains("request file"));
    assert!(bad("unknown.json", r#"{"segments": [{"txt": [1]}]}"#.into())?.contains("request file"));
    assert!(bad("missing_tensor.json", request("nope"))?.contains("no tensor `nope`"));
    assert!(bad("flat.json", request("flat"))?.contains("embeddings of shape [rows, hidden]"));
    assert!(
        bad("missing_file.json", request("emb").replace("img.safetensors", "gone.safetensors"))?
            .contains("gone.safetensors")
    );
    assert!(bad("vocab.json", r#"{"segments": [{"text": [1, 256]}]}"#.into())?.contains("vocab"));
    let missing =
        error_line(&omniprefix(&["hidden", "--model", p(&dir), "--request", p(&req), "--out", p(&out)])?)?;
    assert!(missing.contains("config.json"), "{missing}");
    Ok(())
}

/// The `--json` lines of `omniprefix bench ttft --model <model> <flags>`, where `flags` is
/// written as on a command line.
fn bench_ttft_json(model: &Path, flags: &str) -> TestResult<Vec<serde_json::Value>> {
    let args: Vec<&str> = ["bench", "ttft", "--model", p(model)]
        .into_iter()
        .chain(flags.split_whitespace())
        .chain(["--json"])
        .collect();
    let stdout = ok_stdout(&omniprefix(&args)?)?;
    Ok(stdout.lines().map(serde_json::from_str).collect::<Result<_, _>>()?)
}

/// `bench ttft --json` lines of a small run on the tiny Omni thinker.
fn bench_ttft_lines(backend: &str) -> TestResult<Vec<serde_json::Value>> {
    let flags = "--prefix 16 --suffix 8 --long-prefix 32 --runs 1 --mm-scale 8 --block-size 4 --threads 1";
    bench_ttft_json(&fixture("omni_thinker"), &format!("{flags} --backend {backend}"))
}

#[test]
fn bench_ttft_runs_on_wgpu_with_the_cpu_run_s_cache_hits() -> TestResult {
    let (cpu, gpu) = (bench_ttft_lines("cpu")?, bench_ttft_lines("wgpu")?);
    // The disk tier needs pages on the host: wgpu skips `tier_restore`, the CPU's last line.
    assert_eq!(cpu.len(), gpu.len() + 1);
    assert_eq!(cpu.last().and_then(|l| l["workload"].as_str()), Some("tier_restore"));
    for (c, g) in cpu.iter().zip(&gpu) {
        assert_eq!((c["backend"].as_str(), g["backend"].as_str()), (Some("cpu"), Some("wgpu")));
        assert_eq!(
            (&c["workload"], &c["cached_tokens"], &c["captured"]),
            (&g["workload"], &g["cached_tokens"], &g["captured"])
        );
    }
    Ok(())
}

#[test]
fn bench_ttft_prints_one_json_line_per_workload() -> TestResult {
    let lines = bench_ttft_lines("cpu")?;
    let names: Vec<&str> = lines.iter().filter_map(|l| l["workload"].as_str()).collect();
    assert_eq!(
        names,
        [
            "prefix_repetition",
            "prefix_repetition_long",
            "multi_round.round1",
            "multi_round.round2",
            "multi_round.round3",
            "multi_round.round4",
            "capture_overhead",
            "tier_restore"
        ]
    );
    assert_eq!((lines[0]["prefix"].as_u64(), lines[0]["suffix"].as_u64()), (Some(16), Some(8)));
    assert_eq!(lines[0]["cached_tokens"].as_u64(), Some(16));
    assert_eq!(lines[1]["cached_tokens"].as_u64(), Some(32));
    assert!((lines[1]["ideal_ratio"].as_f64().unwrap_or_default() - 8.0 / 40.0).abs() < 1e-12);
    assert_eq!(lines[2]["cached_tokens"].as_u64(), Some(0), "round 1 has no history");
    assert!(lines[5]["cached_tokens"].as_u64().unwrap_or_default() > 0, "round 4 reuses the history");
    for line in &lines[..6] {
        assert!(line["ttft_cached_ms"].as_f64().is_some_and(|v| v > 0.0) && line["ratio"].as_f64().is_some());
    }
    assert_eq!(lines[6]["captured"].as_u64(), Some(3));
    // The long prefix's 8 full blocks of 4 come back from the tier, and cost something to read.
    assert_eq!(lines[7]["restored_tokens"].as_u64(), Some(32));
    assert!(lines[7]["restore_ms_per_token"].as_f64().is_some_and(|v| v > 0.0), "{}", lines[7]);
    Ok(())
}

/// `bench ttft --model` on a plain Qwen3 checkpoint (`Qwen3ForCausalLM`, whose
/// 256-id vocabulary has no Omni special ids): the selected text workloads only,
/// warmed up, without captures; the cached prefill beats the uncached one.
#[test]
fn bench_ttft_loads_a_qwen3_checkpoint_and_runs_the_selected_workloads() -> TestResult {
    let flags = "--workloads prefix_repetition,prefix_repetition_long --prefix 32 --suffix 16 \
                 --long-prefix 512 --runs 3 --warmup 1 --no-capture --threads 1";
    let lines = bench_ttft_json(&fixture("qwen3_dense"), flags)?;
    let names: Vec<&str> = lines.iter().filter_map(|l| l["workload"].as_str()).collect();
    assert_eq!(names, ["prefix_repetition", "prefix_repetition_long"], "{lines:?}");
    for (line, prefix) in lines.iter().zip([32, 512]) {
        assert_eq!((line["backend"].as_str(), line["runs"].as_u64()), (Some("cpu"), Some(3)), "{line}");
        assert_eq!((line["prefix"].as_u64(), line["suffix"].as_u64()), (Some(prefix), Some(16)), "{line}");
        assert_eq!(line["cached_tokens"].as_u64(), Some(prefix), "{line}");
        for key in [
            "ttft_uncached_ms",
            "ttft_cached_ms",
            "ideal_ratio",
            "ratio",
            "ratio_over_ideal",
            "flop_ratio",
            "cached_schedule_ms",
            "cached_preprocess_ms",
        ] {
            assert!(line[key].as_f64().is_some_and(f64::is_finite), "{key}: {line}");
        }
    }
    let long = &lines[1];
    let (uncached, cached) = (
        long["ttft_uncached_ms"].as_f64().unwrap_or_default(),
        long["ttft_cached_ms"].as_f64().unwrap_or_default(),
    );
    assert!(0.0 < cached && cached < uncached, "16 new tokens over a cached 512 vs 528 uncached: {long}");
    Ok(())
}

/// `--dtype`: `auto` keeps the f32 checkpoint's f32, `bf16` halves the matrices' bytes and
/// says so in the report, and an unknown name is an argument error naming the choices;
/// `--kv-dtype f16` runs the same workload over half-precision pages.
#[test]
fn bench_ttft_dtype_stores_the_weights_as_asked() -> TestResult {
    let m = fixture("qwen3_dense");
    let report = |flag: &str, dtype: &str| -> TestResult<serde_json::Value> {
        let args = [
            "bench",
            "ttft",
            "--model",
            p(&m),
            "--workloads",
            "prefix_repetition",
            "--prefix",
            "16",
            "--suffix",
            "8",
            "--runs",
            "1",
            "--no-capture",
            "--threads",
            "1",
            flag,
            dtype,
            "--json",
        ];
        let stdout = ok_stdout(&omniprefix(&args)?)?;
        Ok(serde_json::from_str(stdout.lines().next().ok_or("no report")?)?)
    };
    let (auto, bf16) = (report("--dtype", "auto")?, report("--dtype", "bf16")?);
    // f16 K/V pages: the same workload runs and still hits the cache.
    let kv = report("--kv-dtype", "f16")?;
    assert_eq!(kv["cached_tokens"].as_u64(), Some(16), "{kv}");
    assert_eq!((auto["dtype"].as_str(), bf16["dtype"].as_str()), (Some("f32"), Some("bf16")));
    let mib = |r: &serde_json::Value| r["weight_mib"].as_f64().unwrap_or_default();
    assert!(
        mib(&bf16) > 0.0 && mib(&bf16) < 0.6 * mib(&auto),
        "bf16 {} MiB vs f32 {} MiB",
        mib(&bf16),
        mib(&auto)
    );
    let out = omniprefix(&["bench", "ttft", "--dtype", "fp8"])?;
    let err = String::from_utf8(out.stderr)?;
    assert!(
        !out.status.success()
            && err.contains("'fp8' for '--dtype")
            && err.contains("expected auto, f32, bf16 or f16"),
        "{err}"
    );
    Ok(())
}

#[test]
fn hidden_on_wgpu_equals_the_cpu_backend_and_says_which_backend_ran() -> TestResult {
    let dir = scratch("backend")?;
    let (warm, req) = (dir.join("warm.json"), dir.join("req.json"));
    std::fs::write(&warm, r#"{"segments": [{"text": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]}]}"#)?;
    std::fs::write(&req, r#"{"segments": [{"text": [5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 42]}]}"#)?;
    let m = fixture("qwen3_dense");
    let run = |backend: &str, out: &Path| -> TestResult<Output> {
        let rest = ["--warm", p(&warm), "--block-size", "4", "--backend", backend, "--out", p(out)];
        omniprefix(&hidden_args(&m, &req, &rest))
    };
    let (on_cpu, on_gpu) = (dir.join("cpu.safetensors"), dir.join("gpu.safetensors"));
    let stdout = ok_stdout(&run("cpu", &on_cpu)?)?;
    assert!(stdout.contains("backend: cpu") && stdout.contains("num_cached_tokens: 8"), "{stdout}");
    let gpu = run("wgpu", &on_gpu)?;
    if !gpu.status.success() && std::env::var("OMNIPREFIX_REQUIRE_GPU").as_deref() != Ok("1") {
        eprintln!("SKIP hidden --backend wgpu: no adapter ({})", String::from_utf8_lossy(&gpu.stderr).trim());
        return Ok(());
    }
    let stdout = ok_stdout(&gpu)?;
    assert!(stdout.contains("backend: wgpu on") && stdout.contains("num_cached_tokens: 8"), "{stdout}");
    for ((name, shape, x), (_, want_shape, y)) in read_tensors(&on_gpu)?.iter().zip(&read_tensors(&on_cpu)?) {
        assert_eq!(shape, want_shape, "{name}");
        let scale = y.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        let worst = x.iter().zip(y).map(|(u, v)| (u - v).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-4 * scale, "{name}: wgpu differs from cpu by {worst} (scale {scale})");
    }
    let bad = omniprefix(&hidden_args(&m, &req, &["--out", p(&on_cpu), "--backend", "metal"]))?;
    assert!(!bad.status.success(), "an unknown backend must fail");
    Ok(())
}

/// The block hashes of every `BlockStored` in a replayed vLLM payload.
fn stored_hashes(payload: &[u8]) -> TestResult<Vec<u64>> {
    let batch = rmpv::decode::read_value(&mut &payload[..])?;
    let events = batch[1].as_array().ok_or("events")?;
    let mut hashes = Vec::new();
    for event in events {
        let map = event.as_map().ok_or("an event is a map")?;
        let field = |name: &str| map.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v);
        if field("type").and_then(|t| t.as_str()) == Some("BlockStored") {
            let list = field("block_hashes").and_then(|v| v.as_array()).ok_or("block_hashes")?;
            hashes.extend(list.iter().filter_map(rmpv::Value::as_u64));
        }
    }
    Ok(hashes)
}

/// Every hash stored in the batches the ROUTER at `replay` buffered (empty
/// while it is not up); one replay from seq 0, bounded in time.
async fn replayed_hashes(replay: &str) -> TestResult<Vec<u64>> {
    use zeromq::{Socket, SocketRecv, SocketSend};
    let mut dealer = zeromq::DealerSocket::new();
    let wait = std::time::Duration::from_millis(500);
    if tokio::time::timeout(wait, dealer.connect(replay)).await.is_err() {
        return Ok(vec![]);
    }
    let request = zeromq::ZmqMessage::try_from(vec![
        bytes::Bytes::new(),
        bytes::Bytes::copy_from_slice(&0u64.to_be_bytes()),
    ])
    .map_err(|_| "empty message")?;
    dealer.send(request).await?;
    let mut hashes = Vec::new();
    loop {
        let Ok(Ok(message)) = tokio::time::timeout(wait, dealer.recv()).await else { return Ok(hashes) };
        let frames = message.into_vec();
        if frames.len() != 4 || frames[2].as_ref() == (-1i64).to_be_bytes() {
            return Ok(hashes);
        }
        hashes.extend(stored_hashes(&frames[3])?);
    }
}

/// The endpoints of the `kv events: publishing on PUB[, replay on REPLAY]` line,
/// each checked to name the port it bound (never the 0 that asked for a free one).
fn bound_endpoints(line: &str) -> TestResult<(String, Option<String>)> {
    let rest = line
        .trim_end()
        .strip_prefix("kv events: publishing on ")
        .ok_or_else(|| format!("not the bound line: {line:?}"))?;
    let (publisher, replay) = match rest.split_once(", replay on ") {
        Some((p, r)) => (p.to_string(), Some(r.to_string())),
        None => (rest.to_string(), None),
    };
    for endpoint in std::iter::once(&publisher).chain(&replay) {
        let port: u16 = endpoint.strip_prefix("tcp://127.0.0.1:").ok_or("a loopback endpoint")?.parse()?;
        assert_ne!(port, 0, "{line}");
    }
    Ok((publisher, replay))
}

#[test]
fn block_hashes_equal_what_hidden_publishes_for_a_multimodal_request() -> TestResult {
    let dir = scratch("kv_events")?;
    write_image(&dir)?;
    // 3 ids, 6 image rows, 4 ids: 13 positions, 3 full blocks of 4.
    let req = dir.join("req.json");
    std::fs::write(&req, image_request("emb", &[3, 4, 5]))?;
    let m = fixture("omni_thinker");
    let config = m.join("config.json");
    let key = "0f".repeat(32);
    let hashes = |key: &str| -> TestResult<Vec<u64>> {
        let out = ok_stdout(&omniprefix(&[
            "block-hashes",
            "--request",
            p(&req),
            "--fingerprint-key",
            key,
            "--block-size",
            "4",
            "--config",
            p(&config),
            "--json",
        ])?)?;
        let json: serde_json::Value = serde_json::from_str(&out)?;
        Ok(json["block_hashes"]
            .as_array()
            .ok_or("block_hashes")?
            .iter()
            .filter_map(serde_json::Value::as_u64)
            .collect())
    };
    let mut want = hashes(&key)?;
    assert_eq!(want.len(), 3);
    assert!(
        hashes(&"1e".repeat(32))?.iter().zip(&want).all(|(a, b)| a != b),
        "another fleet key, other hashes"
    );

    // `hidden` publishes them on free ports (port 0), which it names on stderr
    // before it runs; the replay endpoint stays up for the linger.
    let mut child = Command::new(env!("CARGO_BIN_EXE_omniprefix"))
        .args(hidden_args(&m, &req, &["--out", p(&dir.join("out.safetensors")), "--block-size", "4"]))
        .args([
            "--fingerprint-key",
            &key,
            "--kv-events",
            "tcp://127.0.0.1:0",
            "--kv-replay",
            "tcp://127.0.0.1:0",
            "--linger-s",
            "4",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let mut stderr = std::io::BufReader::new(child.stderr.take().ok_or("stderr")?);
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stderr, &mut line)?;
    let (publisher, replay) = bound_endpoints(&line)?;
    let replay = replay.ok_or("a replay endpoint")?;
    assert_ne!(publisher, replay);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(4);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let mut published = Vec::new();
    while std::time::Instant::now() < deadline && published.len() < want.len() {
        published = runtime.block_on(replayed_hashes(&replay))?;
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let out = child.wait_with_output()?;
    let stdout = String::from_utf8(out.stdout)?;
    assert!(out.status.success(), "{stdout}");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest)?;
    assert_eq!(rest, "", "one line on stderr, the bound endpoints");
    assert!(stdout.contains(" batches published, 0 dropped"), "{stdout}");
    published.sort_unstable();
    want.sort_unstable();
    assert_eq!(published, want);
    Ok(())
}

#[test]
fn warm_says_it_repeats() -> TestResult {
    let help = ok_stdout(&omniprefix(&["hidden", "--help"])?)?;
    let warm = help.lines().map(str::trim).find(|l| l.starts_with("--warm ")).ok_or("a --warm line")?;
    let (flag, text) = warm.split_once("  ").ok_or(warm)?;
    assert_eq!(
        (flag, text.trim()),
        (
            "--warm <WARM>",
            "A warm-up request file, run before the request; repeat the flag for several (`--warm a.json --warm b.json` runs them in that order)"
        ),
        "{help}"
    );
    Ok(())
}

/// The calm forms of the `backend:` line `--backend auto` prints.
fn calm_auto_line(line: &str) -> bool {
    line == "backend: cpu (auto: no GPU adapter found)"
        || (line.starts_with("backend: cpu (auto: the adapter found, ")
            && line.ends_with(", renders in software, slower than the CPU backend)"))
        || (line.starts_with("backend: wgpu on ")
            && line.ends_with(" (auto: a hardware adapter is available)"))
        || line.starts_with("backend: cpu (auto: the GPU adapter cannot run the kernels: ")
}

#[test]
fn backend_auto_without_xdg_runtime_dir_prints_one_calm_line_and_nothing_on_stderr() -> TestResult {
    let (dir, req) = text_request("auto_quiet")?;
    let m = fixture("qwen3_dense");
    let child = Command::new(env!("CARGO_BIN_EXE_omniprefix"))
        .args(hidden_args(&m, &req, &["--out", p(&dir.join("o.safetensors")), "--backend", "auto"]))
        .env_remove("XDG_RUNTIME_DIR")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let pid = child.id();
    let out = child.wait_with_output()?;
    assert_eq!(
        String::from_utf8(out.stderr)?,
        "",
        "libwayland's XDG_RUNTIME_DIR complaint, or anything else"
    );
    let stdout = String::from_utf8(out.stdout)?;
    let first = stdout.lines().next().unwrap_or_default();
    assert!(out.status.success() && calm_auto_line(first), "{stdout}");
    let stand_in = std::env::temp_dir().join(format!("omniprefix-runtime-{pid}"));
    assert!(!stand_in.exists(), "the stand-in runtime dir is removed at exit: {stand_in:?}");
    Ok(())
}

#[test]
fn bad_kv_event_flags_are_one_line_errors() -> TestResult {
    let (dir, req) = text_request("kv_bad")?;
    let m = fixture("qwen3_dense");
    let hidden = |extra: &[&str]| {
        omniprefix(&[&["hidden", "--model", p(&m), "--request", p(&req), "--out", p(&dir.join("o.safetensors"))][..], extra].concat())
    };
    let line = error_line(&hidden(&["--kv-events", "udp://nowhere"])?)?;
    assert!(line.contains("udp://nowhere") && line.contains("tcp://host:port"), "{line}");
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let endpoint = format!("tcp://127.0.0.1:{}", taken.local_addr()?.port());
    let line = error_line(&hidden(&["--kv-events", &endpoint])?)?;
    assert!(line.contains("cannot bind"), "{line}");
    let line = error_line(&hidden(&["--fingerprint-key", "abc"])?)?;
    assert!(line.contains("64 hex digits"), "{line}");
    let line = error_line(&hidden(&["--kv-events", "tcp://127.0.0.1:0", "--linger-s=-1"])?)?;
    assert!(line.contains("linger") && line.contains("seconds >= 0") && line.contains("-1"), "{line}");
    let line = error_line(&omniprefix(&[
        "block-hashes",
        "--request",
        p(&req),
        "--fingerprint-key",
        &"00".repeat(32),
        "--block-size",
        "0",
    ])?)?;
    assert!(line.contains("--block-size 0"), "{line}");
    Ok(())
}
