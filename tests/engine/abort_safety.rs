//! Abort safety: a request aborted mid-prefill (between chunks, or while a
//! chunk is out on the runner) leaves only the blocks it completed in the
//! index — never a partially written one — and no lock behind. A later
//! identical request reuses exactly those blocks and its outputs equal the
//! uncached run.
//!
//! Lock safety: evicting everything while a request runs never takes the
//! prefix it locked, and its outputs still equal the uncached run.

use support::tiny_model;

use omniprefix::backend::cpu::CpuPages;
use omniprefix::batch::ScheduledBatch;
use omniprefix::error::SchedError;
use omniprefix::index::radix::{RadixConfig, RadixIndex};
use omniprefix::runner::{PromptInputs, SeqOutput};
use omniprefix::sched::{PrefillCap, Scheduler, SchedulerConfig};
use omniprefix::{Error, Result};
use tiny_model::{IMAGE_UNIT, TinyModel, equal_outputs, request};

/// A test that can also fail outside omniprefix (outputs that differ from the uncached run).
type TestResult<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

const BLOCK: usize = 4;
const NUM_BLOCKS: usize = 12;
/// 5 text tokens, image 0 (3 rows), 6 text tokens, image 1, 7 text: 24 positions.
const UNITS: [u32; 20] = [0, 1, 2, 3, 0, IMAGE_UNIT, 1, 2, 3, 0, 1, 2, IMAGE_UNIT + 1, 3, 2, 1, 0, 1, 2, 3];
const PROMPT_LEN: usize = 24;

fn scheduler(max_tokens_per_step: usize) -> Result<Scheduler> {
    let config = SchedulerConfig {
        num_blocks: NUM_BLOCKS,
        block_size: BLOCK,
        max_tokens_per_step,
        max_seqs_per_step: 2,
        prefill_cap: PrefillCap::Off,
        token_granular_reuse: true,
    };
    let index = RadixIndex::new(RadixConfig { block_size: BLOCK })?;
    Scheduler::new(config, Box::new(index))
}

fn check(sched: &Scheduler) -> Result<()> {
    sched.validate().map_err(Error::from)
}

/// Schedules one step and runs it on the model.
fn step(
    sched: &mut Scheduler, model: &TinyModel, pages: &mut CpuPages,
) -> Result<(ScheduledBatch, Vec<SeqOutput>)> {
    let batch = sched.schedule()?;
    let outs = model.execute(&batch, pages)?;
    check(sched)?;
    Ok((batch, outs))
}

/// Runs request `id` (already admitted) to the end and returns its outputs
/// and the number of tokens it reused.
fn run_to_end(
    sched: &mut Scheduler, model: &TinyModel, pages: &mut CpuPages, id: u64,
) -> TestResult<(SeqOutput, usize)> {
    let mut reused = None;
    loop {
        let (batch, outs) = step(sched, model, pages)?;
        let seq = batch.seqs.iter().find(|s| s.request == id).ok_or_else(|| format!("{id} not scheduled"))?;
        reused.get_or_insert(seq.num_computed_tokens);
        let done = sched.complete(&batch)?;
        check(sched)?;
        if done.contains(&id) {
            let out = outs.into_iter().find(|o| o.request == id).ok_or("no output")?;
            sched.finish(id)?;
            check(sched)?;
            return Ok((out, reused.unwrap_or(0)));
        }
    }
}

/// A fresh tenant's prompt as long as the whole pool can only run if every
/// cached block can be evicted: no lock outlived the aborted request.
fn assert_no_lock_left(sched: &mut Scheduler, model: &TinyModel, pages: &mut CpuPages) -> TestResult {
    let units: Vec<u32> = (0..(NUM_BLOCKS * BLOCK) as u32).map(|i| i % 4).collect();
    let (req, _) = request(500, 42, &units);
    sched.admit(req)?;
    run_to_end(sched, model, pages, 500)?;
    let stats = sched.stats();
    assert_eq!((stats.blocks_in_use, stats.blocks_cached), (0, NUM_BLOCKS), "{stats:?}");
    Ok(())
}

/// Aborts request 1 after `completed_chunks` completed chunks of 5 tokens,
/// with one more chunk out on the runner when `in_flight`, and checks what
/// stays cached, what a rerun reuses and its outputs.
fn abort_mid_prefill(completed_chunks: usize, in_flight: bool) -> TestResult {
    let model = TinyModel::new(11)?;
    let mut pages = model.pages(NUM_BLOCKS, BLOCK)?;
    let mut sched = scheduler(5)?;
    let (req, inputs) = request(1, 0, &UNITS);
    assert_eq!(req.prompt.len(), PROMPT_LEN);
    sched.admit(req)?;
    for _ in 0..completed_chunks {
        let (batch, _) = step(&mut sched, &model, &mut pages)?;
        assert!(sched.complete(&batch)?.is_empty(), "the prompt is not done yet");
        check(&sched)?;
    }
    let computed = completed_chunks * 5;
    let outstanding = if in_flight { Some(step(&mut sched, &model, &mut pages)?.0) } else { None };
    sched.abort(1)?;
    check(&sched)?;
    if let Some(batch) = outstanding {
        // The runner wrote a chunk the scheduler never committed; completing it now changes nothing.
        assert!(sched.complete(&batch)?.is_empty());
        check(&sched)?;
    }
    let stats = sched.stats();
    let committed = computed / BLOCK;
    assert_eq!(stats.blocks_cached, committed, "only completed full blocks are cached: {stats:?}");
    assert_eq!((stats.blocks_in_use, stats.running, stats.waiting), (0, 0, 0), "{stats:?}");
    assert_eq!(sched.index_stats().cached_blocks as usize, committed);

    // The same prompt again: it reuses the committed blocks and nothing more.
    let (again, _) = request(2, 0, &UNITS);
    sched.admit(again)?;
    let (out, reused) = run_to_end(&mut sched, &model, &mut pages, 2)?;
    assert!(reused <= committed * BLOCK, "reused {reused} tokens but only {committed} blocks were committed");
    assert_eq!(reused, committed * BLOCK, "the committed blocks are reused");
    let want = model.uncached(&inputs)?;
    equal_outputs(&out, &want)?;
    assert_no_lock_left(&mut sched, &model, &mut pages)
}

#[test]
fn abort_between_chunks_keeps_only_completed_blocks() -> TestResult {
    for chunks in 0..4 {
        abort_mid_prefill(chunks, false)?;
    }
    Ok(())
}

#[test]
fn abort_with_a_chunk_on_the_runner_commits_nothing_of_it() -> TestResult {
    for chunks in 0..4 {
        abort_mid_prefill(chunks, true)?;
    }
    Ok(())
}

/// A model (weights from `seed`), its pages, and a scheduler with chunks of
/// `max_tokens_per_step` that has run `UNITS` as request 1 to the end, so
/// all its full blocks are cached; with the inputs of `UNITS`.
fn warmed(
    seed: u64, max_tokens_per_step: usize,
) -> TestResult<(TinyModel, CpuPages, Scheduler, PromptInputs)> {
    let model = TinyModel::new(seed)?;
    let mut pages = model.pages(NUM_BLOCKS, BLOCK)?;
    let mut sched = scheduler(max_tokens_per_step)?;
    let (first, inputs) = request(1, 0, &UNITS);
    sched.admit(first)?;
    run_to_end(&mut sched, &model, &mut pages, 1)?;
    assert_eq!(sched.stats().blocks_cached, PROMPT_LEN / BLOCK);
    Ok((model, pages, sched, inputs))
}

#[test]
fn aborting_a_reader_of_shared_blocks_leaves_them_cached_and_unlocked() -> TestResult {
    let (model, mut pages, mut sched, inputs) = warmed(12, 8)?;
    let cached = sched.stats().blocks_cached;
    // A second reader pins the cached prefix, runs one chunk, then aborts.
    let (reader, _) = request(2, 0, &UNITS);
    sched.admit(reader)?;
    let (batch, _) = step(&mut sched, &model, &mut pages)?;
    assert_eq!(
        batch.seqs[0].num_computed_tokens,
        PROMPT_LEN - 1,
        "the whole prefix but the last token is reused"
    );
    sched.abort(2)?;
    check(&sched)?;
    assert!(sched.complete(&batch)?.is_empty());
    assert!(matches!(sched.finish(2), Err(Error::Sched(SchedError::UnknownRequest { id: 2 }))));
    assert_eq!(sched.stats().blocks_cached, cached);
    let (third, _) = request(3, 0, &UNITS);
    sched.admit(third)?;
    let (out, _) = run_to_end(&mut sched, &model, &mut pages, 3)?;
    equal_outputs(&out, &model.uncached(&inputs)?)?;
    assert_no_lock_left(&mut sched, &model, &mut pages)
}

/// 14 tokens of `UNITS` (text, image 0, text), then a text tail of its own: 24 positions.
const DIVERGING: [u32; 22] = [0, 1, 2, 3, 0, IMAGE_UNIT, 1, 2, 3, 0, 1, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3];

/// Evicts everything the index may give up and checks what stays cached.
fn evict_all(sched: &mut Scheduler, expect_freed: usize, expect_cached: usize) -> Result<()> {
    assert_eq!(sched.evict(usize::MAX)?, expect_freed, "only unlocked blocks are evicted");
    check(sched)?;
    let stats = sched.stats();
    assert_eq!(
        (stats.blocks_cached, sched.index_stats().cached_blocks as usize),
        (expect_cached, expect_cached),
        "the locked prefix stays indexed: {stats:?}"
    );
    Ok(())
}

/// A lock that pinned nothing would let `evict(usize::MAX)` take a running
/// request's prefix: the index would forget it, and its next chunks would be
/// written over the freed blocks. Evicts everything while the reader's first
/// chunk is out on the runner (its lock still ends inside a block it copies
/// from) and again between chunks (after commit re-locked it), then checks
/// its outputs and that a third request reuses the whole prompt.
#[test]
fn evicting_everything_while_a_request_runs_keeps_its_locked_prefix() -> TestResult {
    let (model, mut pages, mut sched, _) = warmed(13, 5)?;
    let (reader, inputs) = request(2, 0, &DIVERGING);
    assert_eq!(reader.prompt.len(), PROMPT_LEN);
    sched.admit(reader)?;
    let batch = sched.schedule()?;
    assert_eq!(batch.seqs[0].num_computed_tokens, 14, "text, image 0 and text are reused");
    assert_eq!(batch.copies.len(), 1, "block 3 is partly reused: copied before it is written");
    // Locked: blocks 0..=3 (3 as the copy source). Blocks 4 and 5 are not.
    evict_all(&mut sched, 2, 4)?;
    let outs = model.execute(&batch, &mut pages)?;
    assert!(outs.iter().all(|o| o.request != 2), "not done after one chunk");
    assert!(sched.complete(&batch)?.is_empty());
    check(&sched)?;
    // Commit re-locked blocks 0..=2 plus its own block 3: the first request's block 3 goes.
    evict_all(&mut sched, 1, 4)?;

    let (out, _) = run_to_end(&mut sched, &model, &mut pages, 2)?;
    equal_outputs(&out, &model.uncached(&inputs)?)?;
    let (third, _) = request(3, 0, &DIVERGING);
    sched.admit(third)?;
    let (out, reused) = run_to_end(&mut sched, &model, &mut pages, 3)?;
    assert_eq!(reused, PROMPT_LEN - 1, "the reader's whole prompt stayed cached");
    equal_outputs(&out, &model.uncached(&inputs)?)?;
    assert_no_lock_left(&mut sched, &model, &mut pages)
}
