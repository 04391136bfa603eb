//! The disk tier is invisible. Random conversations over a pool too small to
//! hold them (so the index evicts into the tier and matches continue into it),
//! some of them submitted together (so a request reads its blocks from the
//! tier while others' steps run, and may be preempted while it waits),
//! interleaved with spills (every cached block down to the tier), restarts on
//! the same directory and key, and corrupted files (a flipped byte, a
//! truncation, an older format version, another block's file under the name):
//! every request's tokens and hidden rows equal the same request run alone with
//! caching off, `validate()` holds after every request, and the directory never
//! holds more than `tier_bytes` plus one block. Cases default to 12; scale with
//! `PROPTEST_CASES`.

use std::path::{Path, PathBuf};

use omniprefix::Dtype;
use omniprefix::backend::PagesSpec;
use omniprefix::canon::FingerprintKey;
use omniprefix::engine::{Engine, EngineConfig, Output, Request};
use omniprefix::model::Config;
use omniprefix::sample::SamplingParams;
use omniprefix::sched::SchedulerConfig;
use omniprefix::tier::BlockLayout;
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, FileFailurePersistence};

fn model() -> Config {
    Config::tiny_qwen3(32, 2, 4, 2, 256)
}

#[derive(Debug, Clone)]
enum Op {
    /// Run request `i` of the case.
    Run(usize),
    /// Submit these requests of the case together and run them all.
    RunTogether(Vec<usize>),
    /// Every cached block down to the tier.
    Spill,
    /// Drop the engine (it spills) and build another on the same directory.
    Restart,
    /// Spill, then damage one file (by `kind`, at the file picked by `at`).
    Corrupt { kind: u8, at: usize },
}

#[derive(Debug, Clone)]
struct Case {
    block_size: usize,
    /// Blocks in the pool beyond the largest request's.
    spare_blocks: usize,
    /// The tier's bound in blocks.
    tier_blocks: u64,
    base: Vec<u32>,
    /// Per request: leading ids of `base` it shares, its own tail, tokens to generate.
    requests: Vec<(usize, Vec<u32>, usize)>,
    ops: Vec<Op>,
}

fn case() -> impl Strategy<Value = Case> {
    let request = (0usize..24, prop::collection::vec(0u32..240, 1..8), 1usize..4);
    let op = prop_oneof![
        6 => (0usize..8).prop_map(Op::Run),
        3 => prop::collection::vec(0usize..8, 2..5).prop_map(Op::RunTogether),
        1 => Just(Op::Spill),
        1 => Just(Op::Restart),
        2 => (0u8..4, 0usize..64).prop_map(|(kind, at)| Op::Corrupt { kind, at }),
    ];
    (
        prop_oneof![Just(2usize), Just(4)],
        0usize..3,
        2u64..12,
        prop::collection::vec(0u32..240, 24),
        prop::collection::vec(request, 1..5),
        prop::collection::vec(op, 1..14),
    )
        .prop_map(|(block_size, spare_blocks, tier_blocks, base, requests, ops)| Case {
            block_size,
            spare_blocks,
            tier_blocks,
            base,
            requests,
            ops,
        })
}

fn prompt(case: &Case, i: usize) -> (Vec<u32>, usize) {
    let (shared, tail, new_tokens) = &case.requests[i % case.requests.len()];
    ([&case.base[..*shared], &tail[..]].concat(), *new_tokens)
}

fn request(ids: Vec<u32>, new_tokens: usize) -> Request<'static> {
    Request::text(ids).generate(SamplingParams::greedy(new_tokens))
}

/// One block's file, as the engine lays its pages out (the default capture: 3 points).
fn block_file_bytes(block_size: usize) -> u64 {
    let spec = PagesSpec {
        num_layers: 2,
        num_blocks: 1,
        block_size,
        kv_heads: 2,
        head_dim: 8,
        captured: 3,
        hidden: 32,
        kv_dtype: Dtype::F32,
    };
    BlockLayout::of(&spec, 0).file_bytes()
}

fn block_files(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut files: Vec<(PathBuf, u64)> = std::fs::read_dir(dir)
        .map(|d| d.flatten().collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".blk"))
        .map(|e| (e.path(), e.metadata().map(|m| m.len()).unwrap_or(0)))
        .collect();
    files.sort();
    files
}

fn corrupt(path: &Path, kind: u8, other: Option<&Path>) {
    let Ok(mut bytes) = std::fs::read(path) else { return };
    if bytes.len() < 12 {
        // Already damaged past its header by an earlier op: nothing more to break.
        return;
    }
    match kind {
        0 => {
            let at = bytes.len() / 2;
            bytes[at] ^= 0x40;
        }
        1 => bytes.truncate(bytes.len() * 2 / 3),
        2 => bytes[8..12].copy_from_slice(&0u32.to_le_bytes()),
        _ => match other.and_then(|o| std::fs::read(o).ok()) {
            // Another block's (or model's) file under this name: a wrong header.
            Some(o) => bytes = o,
            None => bytes.clear(),
        },
    }
    std::fs::write(path, bytes).expect("rewrite a tier file");
}

fn same(got: &Output, want: &Output) -> Result<(), TestCaseError> {
    prop_assert_eq!(&got.tokens, &want.tokens);
    for ((name, a), (_, b)) in got.hidden.iter().zip(&want.hidden) {
        prop_assert_eq!(a.dim(), b.dim());
        let diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        prop_assert!(diff < 1e-4, "{}: rows differ by {}", name, diff);
    }
    Ok(())
}

fn run_case(case: &Case, dir: &Path) -> Result<(), TestCaseError> {
    let longest =
        (0..case.requests.len()).map(|i| prompt(case, i)).map(|(p, g)| p.len() + g).max().unwrap_or(1);
    let tier_bytes = case.tier_blocks * block_file_bytes(case.block_size);
    let config = |cache: bool, tier: bool| EngineConfig {
        scheduler: SchedulerConfig {
            block_size: case.block_size,
            num_blocks: longest.div_ceil(case.block_size) + case.spare_blocks,
            ..Default::default()
        },
        cache,
        fingerprint_key: FingerprintKey::fixed(9),
        tier_dir: tier.then(|| dir.to_path_buf()),
        tier_bytes,
        ..Default::default()
    };
    let mut engine = Engine::random(model(), 3, config(true, true)).expect("an engine with a tier");
    let mut max_file = 0;
    for op in &case.ops {
        match *op {
            Op::Run(i) => {
                let (ids, new_tokens) = prompt(case, i);
                let got = engine.run(request(ids.clone(), new_tokens)).expect("a run with a tier");
                let mut alone = Engine::random(model(), 3, config(false, false)).expect("a cache-off engine");
                same(&got, &alone.run(request(ids, new_tokens)).expect("a cache-off run"))?;
                engine.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::RunTogether(ref picks) => {
                let prompts: Vec<(Vec<u32>, usize)> = picks.iter().map(|&i| prompt(case, i)).collect();
                let ids: Vec<_> = prompts
                    .iter()
                    .map(|(p, g)| engine.submit(request(p.clone(), *g)).expect("a submitted request"))
                    .collect();
                let outputs = engine.run_all().expect("requests run together with a tier");
                prop_assert_eq!(outputs.len(), ids.len());
                for (id, (p, g)) in ids.iter().zip(prompts) {
                    let got = outputs.iter().find(|o| o.request == *id).expect("every request finishes");
                    let mut alone =
                        Engine::random(model(), 3, config(false, false)).expect("a cache-off engine");
                    same(got, &alone.run(request(p, g)).expect("a cache-off run"))?;
                }
                engine.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::Spill => {
                engine.flush_tier().expect("a spill");
            }
            Op::Restart => {
                drop(engine);
                engine = Engine::random(model(), 3, config(true, true)).expect("a restarted engine");
            }
            Op::Corrupt { kind, at } => {
                engine.flush_tier().expect("a spill");
                let files = block_files(dir);
                if !files.is_empty() {
                    let target = &files[at % files.len()].0;
                    let other = files.iter().map(|f| f.0.as_path()).find(|p| p != target);
                    corrupt(target, kind, other);
                }
            }
        }
        let files = block_files(dir);
        max_file = files.iter().map(|f| f.1).chain([max_file]).max().unwrap_or(0);
        let total: u64 = files.iter().map(|f| f.1).sum();
        prop_assert!(total <= tier_bytes + max_file, "{} bytes in the tier, bound {}", total, tier_bytes);
    }
    Ok(())
}

proptest! {
    // Failures persist beside this file, as the other suites' do.
    #![proptest_config(PtConfig {
        cases: support::cases(12),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..PtConfig::default()
    })]

    #[test]
    fn the_tier_is_invisible_through_evictions_restarts_and_corruption(case in case()) {
        let dir = std::env::temp_dir().join(format!("omniprefix-prop-tier-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let result = run_case(&case, &dir);
        let _ = std::fs::remove_dir_all(&dir);
        result?;
    }
}
