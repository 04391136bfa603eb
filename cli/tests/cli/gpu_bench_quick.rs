//! `scripts/gpu_bench.sh --quick` end to end on whatever adapter wgpu opens (lavapipe
//! in CI): every step runs and writes the JSON lines it promises, and the parity
//! lines are within the f32 / f16 tolerances of `docs/backends.md`.
//!
//! Without an adapter this prints a loud skip message and passes, unless
//! `OMNIPREFIX_REQUIRE_GPU=1` (CI) makes it fail, like the library's GPU tests.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use super::common::TestResult;
use serde_json::Value;

/// The JSON objects of `dir/file`, one a line.
fn lines(dir: &Path, file: &str) -> TestResult<Vec<Value>> {
    let text = std::fs::read_to_string(dir.join(file))?;
    Ok(text.lines().map(serde_json::from_str).collect::<Result<_, _>>()?)
}

#[test]
fn gpu_bench_quick_writes_every_json_line() -> TestResult {
    let bin = env!("CARGO_BIN_EXE_omniprefix");
    if !Command::new(bin).arg("gpu-info").output()?.status.success() {
        assert_ne!(
            std::env::var("OMNIPREFIX_REQUIRE_GPU").as_deref(),
            Ok("1"),
            "OMNIPREFIX_REQUIRE_GPU=1 but no GPU adapter"
        );
        eprintln!("\n!!!!!!!! SKIPPING gpu_bench.sh --quick: no GPU adapter !!!!!!!!\n");
        return Ok(());
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = std::env::temp_dir().join(format!("omniprefix-gpu-bench-{}", std::process::id()));
    let start = Instant::now();
    let run = Command::new("bash")
        .arg(root.join("scripts/gpu_bench.sh"))
        .args(["--quick".as_ref(), out.as_os_str()])
        .env("OMNIPREFIX_BIN", bin)
        .output()?;
    let seconds = start.elapsed().as_secs_f64();
    assert!(run.status.success(), "gpu_bench.sh --quick failed: {}", String::from_utf8_lossy(&run.stderr));
    eprintln!("gpu_bench.sh --quick took {seconds:.1} s");

    let [adapter] = &lines(&out, "adapter.jsonl")?[..] else { return Err("one adapter line".into()) };
    for key in ["adapter", "driver", "driver_info", "limits", "stored_dtypes", "subgroups"] {
        assert!(adapter.get(key).is_some(), "adapter line lacks {key}: {adapter}");
    }
    let parity = lines(&out, "parity.jsonl")?;
    assert_eq!(parity.len(), 6, "3 fixtures x f32, f16");
    for line in &parity {
        let tolerance = if line["dtype"] == "f16" { 1e-3 } else { 1e-4 };
        let err = line["worst_rel_vs_cpu"].as_f64().ok_or("worst_rel_vs_cpu")?;
        assert!(err <= tolerance, "{line}");
    }
    for (file, key) in [("ttft.jsonl", "ttft_cached_ms"), ("decode.jsonl", "decode_tokens_per_s")] {
        let found = lines(&out, file)?;
        let steps: Vec<&str> = found.iter().filter_map(|l| l["step"].as_str()).collect();
        assert_eq!(steps.len(), 2, "{file}: f32 and f16: {steps:?}");
        assert!(found.iter().all(|l| l[key].as_f64().is_some_and(|v| v > 0.0)), "{file}: {found:?}");
    }
    assert_eq!(lines(&out, "timing.jsonl")?.len(), 1 + 6 + 4, "a timing per step");
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// Writes criterion's two files for one benchmark: its median (ns) and declared bytes.
fn fake_criterion_bench(dir: &Path, median_ns: f64, bytes: u64) -> TestResult {
    std::fs::create_dir_all(dir.join("new"))?;
    std::fs::write(
        dir.join("new/estimates.json"),
        format!(r#"{{"median": {{"point_estimate": {median_ns}}}}}"#),
    )?;
    std::fs::write(dir.join("new/benchmark.json"), format!(r#"{{"throughput": {{"Bytes": {bytes}}}}}"#))?;
    Ok(())
}

/// The full run's attention step (no GPU needed): `scripts/attention_fraction.py` reads
/// criterion's medians of wgpu `decode` and `copy_kv` per shape, ignores the CPU's, and
/// fails naming the group when a case is missing.
#[test]
fn attention_fraction_reads_criterion_medians() -> TestResult {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = std::env::temp_dir().join(format!("omniprefix-criterion-{}", std::process::id()));
    let group = dir.join("attention_128+16");
    // decode: 1 MB in 1 ms = 1e9 B/s; copy: 4 MB in 1 ms = 4e9 B/s.
    fake_criterion_bench(&group.join("wgpu_decode_128+16"), 1e6, 1_000_000)?;
    fake_criterion_bench(&group.join("wgpu_copy_kv_128+16"), 1e6, 4_000_000)?;
    fake_criterion_bench(&group.join("cpu_decode_128+16"), 1.0, 1_000_000)?;
    let run = |dir: &Path| {
        Command::new("python3").arg(root.join("scripts/attention_fraction.py")).arg(dir).output()
    };
    let out = run(&dir)?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(line["shape"], "128+16");
    assert_eq!(line["decode_bytes_per_s"].as_f64(), Some(1e9));
    assert_eq!(line["decode_bandwidth_fraction"].as_f64(), Some(0.25));

    std::fs::remove_dir_all(group.join("wgpu_copy_kv_128+16"))?;
    let out = run(&dir)?;
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("expected one wgpu copy_kv benchmark"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
