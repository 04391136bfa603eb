//! How long does matching an Omni-style prompt take on a warm radix index,
//! as a ratio against one plain read pass over the prompt's token ids?
//!
//! The prompt mixes 832 text tokens with two 7200-row item spans; the design
//! expects the walk to cost about as much as a short text
//! compare, independent of how many rows the item spans hold.

use support::index_oracle as common;

use std::hint::black_box;

use common::{ItemModel, Piece};
use criterion::{Criterion, Throughput, criterion_group};
use omniprefix::index::radix::{RadixConfig, RadixIndex};
use omniprefix::index::{PrefixIndex, ValidationPolicy};
use rand::{Rng, SeedableRng};

fn omni_prompt_match(c: &mut Criterion) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let mut text = |n: usize| Piece::Text((0..n).map(|_| rng.random_range(0..151_000)).collect());
    let pieces = [
        text(512),
        Piece::Item { content: 1, split: 0 },
        text(64),
        Piece::Item { content: 2, split: 0 },
        text(256),
    ];
    let video = ItemModel { rows: 7200, fp_bits: None, policy: ValidationPolicy::SecondDigest };
    let (cached, _) = video.build(0, &pieces);
    let (query, _) = video.build(0, &pieces);
    let mut index = RadixIndex::new(RadixConfig::default()).expect("default config is valid");
    let blocks: Vec<u32> = (0..(cached.len() / 16) as u32).collect();
    index.insert(&cached, &blocks).expect("a fresh index accepts the prompt");

    let mut group = c.benchmark_group("omni_prompt_match");
    group.throughput(Throughput::Elements(query.len() as u64));
    group.bench_function("read_token_ids_reference", |b| {
        b.iter(|| black_box(&query.token_ids).iter().fold(0u64, |acc, &t| acc.wrapping_add(u64::from(t))))
    });
    group.bench_function("radix_match_prefix", |b| {
        b.iter(|| black_box(index.match_prefix(black_box(&query))))
    });
    group.finish();
}

criterion_group!(benches, omni_prompt_match);
