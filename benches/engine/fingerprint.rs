//! What does identifying an item cost against one plain read of its bytes?
//!
//! Two seeded workloads: a 60 MB raw u8 video (zero-copy path) and a 4 MB f32
//! mel-feature tensor (fold + finite check through the staging buffer). For
//! each: the read floor (sum of u64 words), fingerprint only, fingerprint +
//! same-pass check digest, and an exact compare (memcmp of two equal
//! buffers), single-threaded and with `Throughput::Bytes` of the item; plus
//! fingerprint + check on 2 threads (the 60 MB item takes the leaf tree).
//!
//! `cargo bench --bench engine -- _MB/` measures the release profile. To reuse
//! the dev dependency builds instead, turn off the debug assertions and
//! overflow checks that slow xxh3 ~2.5x in dev:
//!
//! ```text
//! cargo bench --profile dev --bench engine \
//!   --config profile.dev.package.xxhash-rust.debug-assertions=false \
//!   --config profile.dev.package.xxhash-rust.overflow-checks=false \
//!   --config profile.dev.package.omniprefix.opt-level=3 \
//!   --config profile.dev.package.omniprefix.debug-assertions=false \
//!   --config profile.dev.package.omniprefix.overflow-checks=false \
//!   -- _MB/ --warm-up-time 1 --measurement-time 3
//! ```

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use ndarray::{ArrayD, IxDyn};
use omniprefix::canon::{
    FingerprintKey, Fingerprinter, ItemContent, ItemLayout, ItemSpec, Modality, TensorView, read_floor,
};
use omniprefix::index::ValidationPolicy;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn video_u8() -> ArrayD<u8> {
    let mut rng = ChaCha8Rng::seed_from_u64(60);
    let mut frames = ArrayD::<u8>::zeros(IxDyn(&[20, 1000, 1000, 3]));
    frames.iter_mut().for_each(|x| *x = rng.random());
    frames
}

fn mel_f32() -> ArrayD<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let mut mel = ArrayD::<f32>::zeros(IxDyn(&[128, 7813]));
    mel.iter_mut().for_each(|x| *x = rng.random_range(-1.0f32..1.0));
    mel
}

fn bench_item(c: &mut Criterion, name: &str, item: &ItemSpec<'_>, bytes: &[u8]) {
    let fingerprint = Fingerprinter::new(FingerprintKey::fixed(1), 1, ValidationPolicy::Unvalidated);
    let with_check = Fingerprinter::new(FingerprintKey::fixed(1), 1, ValidationPolicy::SecondDigest);
    let two_threads = Fingerprinter::new(FingerprintKey::fixed(1), 2, ValidationPolicy::SecondDigest);
    let (Ok(fingerprint), Ok(with_check), Ok(two_threads)) = (fingerprint, with_check, two_threads) else {
        eprintln!("cannot build fingerprinters");
        return;
    };
    let copy = bytes.to_vec();
    let mut group = c.benchmark_group(name);
    group.throughput(Throughput::Bytes(bytes.len() as u64));
    group.sample_size(10);
    group.bench_function(BenchmarkId::new("read_floor", bytes.len()), |b| {
        b.iter(|| read_floor(black_box(bytes)))
    });
    group.bench_function(BenchmarkId::new("fingerprint", bytes.len()), |b| {
        b.iter(|| fingerprint.identify(0, black_box(item)).map(|id| id.fingerprint))
    });
    group.bench_function(BenchmarkId::new("fingerprint+check", bytes.len()), |b| {
        b.iter(|| with_check.identify(0, black_box(item)).map(|id| (id.fingerprint, id.evidence.check())))
    });
    // Items above the tree threshold split into 1 MiB leaves across threads.
    group.bench_function(BenchmarkId::new("fingerprint+check/2threads", bytes.len()), |b| {
        b.iter(|| two_threads.identify(0, black_box(item)).map(|id| (id.fingerprint, id.evidence.check())))
    });
    group.bench_function(BenchmarkId::new("exact_compare", bytes.len()), |b| {
        b.iter(|| black_box(bytes) == black_box(&copy[..]))
    });
    group.finish();
}

fn fingerprint(c: &mut Criterion) {
    let video = video_u8();
    let video_item = ItemSpec {
        modality: Modality::Video,
        layout: ItemLayout::Video { grid_thw: [10, 72, 72], seconds_per_grid: 2.0 },
        content: ItemContent::Tensor(TensorView::U8(video.view())),
        params: Default::default(),
    };
    bench_item(c, "u8_video_60MB", &video_item, video.as_slice().unwrap_or_default());

    let mel = mel_f32();
    let mel_item = ItemSpec {
        modality: Modality::Audio,
        layout: ItemLayout::Audio { mel_frames: 7813 },
        content: ItemContent::Tensor(TensorView::F32(mel.view())),
        params: Default::default(),
    };
    let mel_bytes: &[u8] = mel.as_slice().map(bytemuck::cast_slice).unwrap_or_default();
    bench_item(c, "f32_mel_4MB", &mel_item, mel_bytes);
}

criterion_group!(benches, fingerprint);
