//! What does matching a whole Omni request cost, against one plain read of
//! its bytes and against vLLM's hash-chain path? One group per workload
//! (`omniprefix bench match` reports the same paths as medians):
//!
//! * `read_floor`: one single-threaded read of every byte the request carries;
//! * `fingerprint`: fingerprinting its items (1 thread, `SecondDigest` material);
//! * `radix_match_warm`: the radix match alone on a warm index;
//! * `omniprefix_cold` / `omniprefix_warm`: preprocess + match, empty / warm index;
//! * `hashchain`: vLLM's BLAKE3 mm hashes + SHA-256 block chain + lookup.
//!
//! Throughput is the request's input bytes. Media are seeded noise of the real
//! Qwen3-Omni raw shapes (60 MB for `mixed`). Run with
//! `cargo bench --bench match` (a few minutes; add a workload name to filter).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use clap::ValueEnum;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use omniprefix::index::ValidationPolicy;
use omniprefix_cli::bench::MatchFixture;
use omniprefix_cli::workloads::{Media, MediaScale, Workload, WorkloadName};

fn match_paths(c: &mut Criterion) {
    let media = Arc::new(Media::generate(MediaScale::Full, 0x5eed).expect("embedded fixtures parse"));
    for &name in WorkloadName::value_variants() {
        let workload = Workload::new(name, Arc::clone(&media), 0x5eed).expect("workload builds");
        let mut f =
            MatchFixture::new(workload, 1, ValidationPolicy::SecondDigest).expect("warm-up requests insert");
        let mut group = c.benchmark_group(format!("match/{name}"));
        group.throughput(Throughput::Bytes(f.workload.input_bytes() as u64));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        group.bench_function("read_floor", |b| b.iter(|| black_box(f.read_floor())));
        group.bench_function("fingerprint", |b| b.iter(|| black_box(f.fingerprint())));
        group.bench_function("radix_match_warm", |b| b.iter(|| black_box(f.radix_match())));
        group.bench_function("omniprefix_cold", |b| b.iter(|| black_box(f.omniprefix_cold())));
        group.bench_function("omniprefix_warm", |b| b.iter(|| black_box(f.omniprefix_warm())));
        group.bench_function("hashchain", |b| b.iter(|| black_box(f.hashchain())));
        group.finish();
    }
}

criterion_group!(benches, match_paths);
criterion_main!(benches);
