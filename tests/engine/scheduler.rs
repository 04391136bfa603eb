//! Scheduler behaviour on the committed scenarios, against the reference index.

use std::sync::Arc;

use ndarray::Array2;
use omniprefix::batch::{BlockCopy, RequestId, ScheduledBatch};
use omniprefix::index::PrefixIndex;
use omniprefix::index::radix::{RadixConfig, RadixIndex};
use omniprefix::prompt::Positions;
use omniprefix::sched::{PrefillCap, Request, RequestChecks, Scheduler, SchedulerConfig};
use omniprefix::{Error, Result};
use support::sched::{IMAGE_MARKER, ReferenceIndex, ShadowPages, request};

/// A test that can also fail outside omniprefix (a fixture that does not parse, shadow pages that disagree).
type TestResult<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;
use omniprefix::error::{ConfigError, RequestError, SchedError};

/// Asserts that `err` (an `Option<Error>` or `Result`) matches `pattern`, printing it otherwise.
macro_rules! assert_err {
    ($err:expr, $pattern:pat) => {
        assert!(matches!($err, $pattern), "{:?}", $err)
    };
}

fn config(num_blocks: usize, budget: usize, token_granular_reuse: bool) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size: 16,
        max_tokens_per_step: budget,
        max_seqs_per_step: 4,
        prefill_cap: PrefillCap::Off,
        token_granular_reuse,
    }
}

fn scheduler(cfg: SchedulerConfig) -> Result<Scheduler> {
    Scheduler::new(cfg, Box::new(ReferenceIndex::new(cfg.block_size)))
}

/// Both indexes: the brute-force reference and the radix tree.
fn indexes(block_size: usize) -> Result<Vec<(&'static str, Box<dyn PrefixIndex>)>> {
    let radix = RadixIndex::new(RadixConfig { block_size })?;
    Ok(vec![("reference", Box::new(ReferenceIndex::new(block_size))), ("radix", Box::new(radix))])
}

fn rfc_pair() -> TestResult<(Vec<u32>, Vec<u32>)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/scenarios.json");
    let text = std::fs::read_to_string(path)?;
    let json: serde_json::Value = serde_json::from_str(&text)?;
    let ids = |key: &str| -> TestResult<Vec<u32>> {
        Ok(serde_json::from_value(json["rfc_text_pair"][key].clone())?)
    };
    Ok((ids("prompt1")?, ids("prompt2")?))
}

fn check(sched: &Scheduler) -> Result<()> {
    sched.validate().map_err(Error::from)
}

/// Schedules, runs (on the shadow pages) and completes until nothing is left,
/// finishing requests as they complete; returns every batch.
fn drive(sched: &mut Scheduler, pages: &mut ShadowPages) -> TestResult<Vec<ScheduledBatch>> {
    let mut batches = Vec::new();
    for _ in 0..1000 {
        let batch = sched.schedule()?;
        if batch.seqs.is_empty() {
            return Ok(batches);
        }
        pages.run(&batch)?;
        for id in sched.complete(&batch)? {
            sched.finish(id)?;
        }
        check(sched)?;
        batches.push(batch);
    }
    Err("scheduler did not drain in 1000 steps".into())
}

fn admit(sched: &mut Scheduler, pages: &mut ShadowPages, req: Request) -> Result<()> {
    pages.register(&req);
    sched.admit(req)
}

#[test]
fn rfc_pair_reuses_32_tokens_aligned_and_46_token_granular() -> TestResult {
    let (p1, p2) = rfc_pair()?;
    assert_eq!((p1.len(), p2.len()), (67, 57));
    for (switch, cached) in [(false, 32), (true, 46)] {
        for (name, index) in indexes(16)? {
            let mut sched = Scheduler::new(config(32, 256, switch), index)?;
            let mut pages = ShadowPages::new(32, 16);
            admit(&mut sched, &mut pages, request(1, 0, &p1))?;
            let first = sched.schedule()?;
            let p1_table = first.seqs[0].block_table.clone();
            pages.run(&first)?;
            assert_eq!(sched.complete(&first)?, vec![1]);
            sched.finish(1)?;
            // The radix index also keeps the partly filled fifth block (vLLM's
            // hash chain, which the reference index follows, does not).
            let cached_blocks = if name == "radix" { 5 } else { 4 };
            assert_eq!(sched.stats().blocks_cached, cached_blocks, "{name}: 67 tokens, 4 full blocks");

            admit(&mut sched, &mut pages, request(2, 0, &p2))?;
            let batch = sched.schedule()?;
            let seq = &batch.seqs[0];
            assert_eq!(seq.num_computed_tokens, cached, "{name} index, token_granular_reuse = {switch}");
            assert_eq!(seq.token_ids, p2[cached..]);
            assert_eq!(seq.block_table[..2], p1_table[..2], "whole cached blocks are shared");
            let want_copies =
                if switch { vec![BlockCopy { src: p1_table[2], dst: seq.block_table[2] }] } else { vec![] };
            assert_eq!(batch.copies, want_copies);
            assert_eq!(seq.positions.axes()[0], (cached as i64..57).collect::<Vec<_>>());
            assert!(seq.emits_output);
            pages.run(&batch)?;
            sched.complete(&batch)?;
            sched.finish(2)?;
            let stats = sched.stats();
            assert_eq!((stats.queries, stats.hits, stats.hit_tokens), (2, 1, cached as u64));
            assert_eq!(stats.blocks_in_use, 0);
            assert_eq!(stats.blocks_free + stats.blocks_cached, 32);
            check(&sched)?;
        }
    }
    Ok(())
}

#[test]
fn chunked_prefill_covers_each_prompt_exactly_once_within_budget() -> TestResult {
    let (p1, p2) = rfc_pair()?;
    let budget = 10;
    let mut sched = scheduler(config(16, budget, true))?;
    let mut pages = ShadowPages::new(16, 16);
    admit(&mut sched, &mut pages, request(1, 0, &p1))?;
    admit(&mut sched, &mut pages, request(2, 7, &p2))?;
    let batches = drive(&mut sched, &mut pages)?;
    for (id, prompt) in [(1, &p1), (2, &p2)] {
        let seqs: Vec<_> = batches.iter().flat_map(|b| &b.seqs).filter(|s| s.request == id).collect();
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.token_ids.iter().copied()).collect();
        assert_eq!(&tokens, prompt, "request {id}: chunks cover the prompt once, in order");
        let mut next = 0;
        for s in &seqs {
            assert_eq!(s.num_computed_tokens, next);
            let positions: Vec<i64> = (next as i64..(next + s.token_ids.len()) as i64).collect();
            assert_eq!(s.positions.axes()[0], positions);
            next += s.token_ids.len();
        }
        assert_eq!(seqs.iter().filter(|s| s.emits_output).count(), 1);
    }
    assert!(batches.iter().all(|b| b.num_new_tokens() <= budget));
    assert!(batches.iter().any(|b| b.seqs.len() == 2), "two requests share a step");
    assert_eq!(sched.stats().blocks_in_use, 0);
    Ok(())
}

#[test]
fn fully_cached_prompt_still_computes_its_last_token() -> TestResult {
    let (p1, _) = rfc_pair()?;
    let aligned: Vec<u32> = p1[..64].to_vec();
    for (switch, want) in [(false, 48), (true, 63)] {
        let mut sched = scheduler(config(16, 256, switch))?;
        let mut pages = ShadowPages::new(16, 16);
        admit(&mut sched, &mut pages, request(1, 0, &aligned))?;
        drive(&mut sched, &mut pages)?;
        admit(&mut sched, &mut pages, request(2, 0, &aligned))?;
        let batches = drive(&mut sched, &mut pages)?;
        let seq = &batches[0].seqs[0];
        assert_eq!(seq.num_computed_tokens, want, "token_granular_reuse = {switch}");
        assert!(seq.emits_output);
        assert_eq!(batches[0].copies.len(), usize::from(switch));
    }
    Ok(())
}

#[test]
fn identical_prompts_in_one_step_end_up_sharing_the_index_copy() -> TestResult {
    let (p1, _) = rfc_pair()?;
    let mut sched = scheduler(config(16, 256, false))?;
    let mut pages = ShadowPages::new(16, 16);
    admit(&mut sched, &mut pages, request(1, 0, &p1))?;
    admit(&mut sched, &mut pages, request(2, 0, &p1))?;
    let batch = sched.schedule()?;
    assert_eq!(batch.seqs.len(), 2);
    pages.run(&batch)?;
    assert_eq!(sched.complete(&batch)?, vec![1, 2]);
    check(&sched)?;
    let (t1, t2) = (sched.block_table(1).unwrap_or_default(), sched.block_table(2).unwrap_or_default());
    assert_eq!(t1[..4], t2[..4], "request 2's duplicate full blocks were swapped for the index's");
    assert_ne!(t1[4], t2[4], "partial last blocks stay private");
    let stats = sched.stats();
    assert_eq!((stats.blocks_cached, stats.blocks_in_use, stats.blocks_free), (4, 2, 10));
    sched.finish(1)?;
    sched.finish(2)?;
    Ok(check(&sched)?)
}

#[test]
fn pool_pressure_evicts_unlocked_cache_lru_first() -> TestResult {
    let a: Vec<u32> = (0..64).collect();
    let b: Vec<u32> = (100..164).collect();
    let c: Vec<u32> = (200..280).collect();
    let mut sched = scheduler(config(10, 256, false))?;
    let mut pages = ShadowPages::new(10, 16);
    admit(&mut sched, &mut pages, request(1, 0, &a))?;
    drive(&mut sched, &mut pages)?;
    admit(&mut sched, &mut pages, request(2, 0, &b))?;
    drive(&mut sched, &mut pages)?;
    assert_eq!(sched.stats().blocks_cached, 8);
    // c needs 5 blocks, 2 are free: the 3 oldest leaves go, all from a.
    admit(&mut sched, &mut pages, request(3, 0, &c))?;
    drive(&mut sched, &mut pages)?;
    assert_eq!(sched.stats().evicted_blocks, 3);
    // b's blocks survived: reused up to len - 1 (48 of 64, block aligned); its
    // one new block takes a's last cached block, the least recently used.
    admit(&mut sched, &mut pages, request(4, 0, &b))?;
    let batches = drive(&mut sched, &mut pages)?;
    assert_eq!(batches[0].seqs[0].num_computed_tokens, 48);
    assert_eq!(sched.stats().evicted_blocks, 4);
    admit(&mut sched, &mut pages, request(5, 0, &a))?;
    let batches = drive(&mut sched, &mut pages)?;
    assert_eq!(batches[0].seqs[0].num_computed_tokens, 0, "a was evicted entirely");
    Ok(())
}

#[test]
fn short_pool_preempts_the_newest_so_the_oldest_progresses() -> TestResult {
    let a: Vec<u32> = (0..80).collect();
    let b: Vec<u32> = (100..180).collect();
    let mut sched = scheduler(config(6, 32, false))?;
    let mut pages = ShadowPages::new(6, 16);
    admit(&mut sched, &mut pages, request(1, 0, &a))?;
    admit(&mut sched, &mut pages, request(2, 0, &b))?;
    // Two steps in flight at once: b starts while a's first chunk is out.
    let first = sched.schedule()?;
    let second = sched.schedule()?;
    let ids = |batch: &ScheduledBatch| batch.seqs.iter().map(|s| s.request).collect::<Vec<RequestId>>();
    assert_eq!((ids(&first), ids(&second)), (vec![1], vec![2]));
    for batch in [&first, &second] {
        pages.run(batch)?;
        sched.complete(batch)?;
    }
    // a needs 3 more blocks, 2 are free and b pins the rest: b is sent back.
    let batches = drive(&mut sched, &mut pages)?;
    let finished: Vec<RequestId> =
        batches.iter().flat_map(|b| &b.seqs).filter(|s| s.emits_output).map(|s| s.request).collect();
    assert_eq!(finished, vec![1, 2]);
    assert_eq!(sched.stats().preemptions, 1);
    let restart =
        batches.iter().flat_map(|b| &b.seqs).find(|s| s.request == 2).map(|s| s.num_computed_tokens);
    assert_eq!(restart, Some(16), "b rematches what survived of its committed blocks");
    Ok(())
}

/// A ready sequence nobody appends to (a served stream nobody reads) holds
/// blocks another request needs: the scheduler parks it (caching what ran,
/// releasing its blocks) instead of emitting an empty step; appended later,
/// it recomputes from what is still cached and decodes on.
#[test]
fn a_ready_sequence_left_waiting_is_parked_for_a_request_that_needs_its_blocks() -> TestResult {
    for token_granular in [false, true] {
        let mut sched = scheduler(config(4, 64, token_granular))?;
        sched.admit(generating(1, &(0..40).collect::<Vec<_>>(), 8))?;
        assert_eq!(step(&mut sched)?, vec![1]);
        // 3 of 4 blocks held by ready request 1; request 2 needs 3.
        sched.admit(request(2, 0, &(100..140).collect::<Vec<_>>()))?;
        let batch = sched.schedule()?;
        let shape: Vec<(RequestId, usize)> =
            batch.seqs.iter().map(|s| (s.request, s.token_ids.len())).collect();
        assert_eq!(shape, vec![(2, 40)], "token-granular: {token_granular}");
        assert_eq!(sched.stats().preemptions, 1);
        assert_eq!(sched.num_computed_tokens(1), Some(0), "parked: it holds nothing");
        check(&sched)?;
        // Its next token arrives while request 2 runs: it waits, then recomputes.
        sched.append(1, 7)?;
        assert_eq!(complete(&mut sched, &batch)?, vec![2]);
        sched.finish(2)?;
        let batch = sched.schedule()?;
        let resumed = batch.seqs.iter().find(|s| s.request == 1).ok_or("request 1 resumes")?;
        // What survived of its cached blocks is reused; only its new token is handed out.
        assert_eq!((resumed.seq_len, resumed.output_from), (41, 40));
        assert!(resumed.num_computed_tokens > 0, "its committed blocks are rematched");
        assert_eq!(complete(&mut sched, &batch)?, vec![1]);
        sched.finish(1)?;
        check(&sched)?;
    }
    Ok(())
}

#[test]
fn abort_mid_prefill_leaves_no_partial_block_and_no_lock() -> TestResult {
    let (p1, _) = rfc_pair()?;
    let mut sched = scheduler(config(5, 20, false))?;
    let mut pages = ShadowPages::new(5, 16);
    admit(&mut sched, &mut pages, request(1, 0, &p1))?;
    let batch = sched.schedule()?;
    pages.run(&batch)?;
    sched.complete(&batch)?;
    // 20 tokens computed: one full block committed, one partial block private.
    assert_eq!(sched.index_stats().cached_blocks, 1);
    let batch = sched.schedule()?;
    pages.run(&batch)?;
    sched.abort(1)?;
    let err = sched.admit(request(1, 0, &p1)).err();
    assert!(
        matches!(err, Some(Error::Sched(SchedError::DuplicateRequest { id: 1 }))),
        "id reused before its batch completed: {err:?}"
    );
    assert!(sched.complete(&batch)?.is_empty(), "an aborted request's share is ignored");
    check(&sched)?;
    let stats = sched.stats();
    assert_eq!((stats.blocks_cached, stats.blocks_in_use, stats.blocks_free), (1, 0, 4));
    // No lock is left: a request needing the whole pool can evict that block.
    let other: Vec<u32> = (1000..1080).collect();
    admit(&mut sched, &mut pages, request(2, 0, &other))?;
    drive(&mut sched, &mut pages)?;
    assert_eq!(sched.stats().evicted_blocks, 1);
    Ok(())
}

#[test]
fn item_rows_are_placed_in_the_chunk_that_holds_them() -> TestResult {
    let cfg = SchedulerConfig {
        num_blocks: 8,
        block_size: 4,
        max_tokens_per_step: 5,
        max_seqs_per_step: 1,
        prefill_cap: PrefillCap::Off,
        token_granular_reuse: false,
    };
    let mut sched = Scheduler::new(cfg, Box::new(ReferenceIndex::new(4)))?;
    let mut pages = ShadowPages::new(8, 4);
    // Image 0 (3 rows) at positions 3..6 of 8.
    let image = request(1, 0, &[1, 2, 3, IMAGE_MARKER, 4, 5]);
    let emb = image.item_embeddings[0].clone();
    admit(&mut sched, &mut pages, image)?;
    let batches = drive(&mut sched, &mut pages)?;
    let placed: Vec<Vec<(usize, std::ops::Range<usize>)>> = batches
        .iter()
        .map(|b| b.seqs[0].embeds.iter().map(|e| (e.step_offset, e.rows.clone())).collect())
        .collect();
    // Chunks 0..5 and 5..8.
    assert_eq!(placed, vec![vec![(3, 0..2)], vec![(0, 2..3)]]);
    assert!(batches.iter().flat_map(|b| &b.seqs[0].embeds).all(|e| Arc::ptr_eq(&e.embeddings, &emb)));
    Ok(())
}

#[test]
fn rejected_requests_and_batches_change_nothing() -> TestResult {
    let (p1, _) = rfc_pair()?;
    let mut sched = scheduler(config(5, 16, false))?;
    let mut pages = ShadowPages::new(5, 16);
    admit(&mut sched, &mut pages, request(1, 0, &p1))?;
    let batch = sched.schedule()?;
    let before = sched.stats();
    let table = sched.block_table(1).map(<[u32]>::to_vec);

    let err = sched.admit(request(1, 0, &p1)).err();
    assert!(matches!(err, Some(Error::Sched(SchedError::DuplicateRequest { id: 1 }))), "{err:?}");
    let long: Vec<u32> = (0..81).collect();
    let err = sched.admit(request(2, 0, &long)).err();
    assert_err!(
        err,
        Some(Error::Request(RequestError::RequestTooLarge { id: Some(2), needed: 6, num_blocks: 5 }))
    );
    let err = sched.admit(request(3, 0, &[])).err();
    assert_err!(
        err,
        Some(Error::Request(RequestError::PromptMismatch { id: Some(3), what: "prompt length", .. }))
    );
    let mut bad_positions = request(4, 0, &[1, 2, 3]);
    bad_positions.prompt.positions = Positions::linear(2);
    let err = sched.admit(bad_positions).err();
    assert_err!(
        err,
        Some(Error::Request(RequestError::PromptMismatch {
            what: "positions length",
            expected: 3,
            found: 2,
            ..
        }))
    );

    let image = request(5, 0, &[1, 2, 3, IMAGE_MARKER, 4, 5]);
    let (prompt, emb) = (image.prompt, image.item_embeddings[0].clone());
    let missing = Request::new(5, prompt.clone());
    let err = sched.admit(missing).err();
    assert_err!(
        err,
        Some(Error::Request(RequestError::EmbeddingMismatch {
            what: "number of item embeddings",
            expected: 1,
            found: 0,
            ..
        }))
    );
    let short = Arc::new(Array2::<f32>::zeros((2, 2)));
    let err = sched.admit(Request { item_embeddings: vec![short], ..Request::new(6, prompt.clone()) }).err();
    assert_err!(
        err,
        Some(Error::Request(RequestError::EmbeddingMismatch {
            what: "embedding rows",
            expected: 3,
            found: 2,
            ..
        }))
    );
    let err = sched
        .admit(Request {
            item_embeddings: vec![emb.clone()],
            hidden_size: Some(16),
            ..Request::new(7, prompt.clone())
        })
        .err();
    assert_err!(
        err,
        Some(Error::Request(RequestError::EmbeddingMismatch {
            what: "embedding columns",
            expected: 16,
            found: 2,
            ..
        }))
    );
    let mut out_of_range = prompt;
    out_of_range.index_map.spans[0].start = 6;
    let err = sched.admit(Request { item_embeddings: vec![emb], ..Request::new(8, out_of_range) }).err();
    assert_err!(
        err,
        Some(Error::Request(RequestError::PromptMismatch {
            what: "index map span end",
            expected: 8,
            found: 9,
            ..
        }))
    );

    let mut forged = batch.clone();
    forged.seqs[0].token_ids.pop();
    let err = sched.complete(&forged).err();
    assert_err!(
        err,
        Some(Error::Sched(SchedError::BatchMismatch { id: 1, what: "new tokens", expected: 16, found: 15 }))
    );
    let err = sched.finish(1).err();
    assert_err!(err, Some(Error::Sched(SchedError::RequestNotFinished { id: 1, computed: 0, len: 67 })));
    assert!(matches!(sched.abort(42), Err(Error::Sched(SchedError::UnknownRequest { id: 42 }))));

    assert_eq!(sched.stats(), before);
    assert_eq!(sched.block_table(1).map(<[u32]>::to_vec), table);
    check(&sched)?;
    pages.run(&batch)?;
    sched.complete(&batch)?;
    let err = sched.complete(&batch).err();
    assert!(
        matches!(err, Some(Error::Sched(SchedError::BatchMismatch { what: "new tokens", expected: 0, .. }))),
        "completing twice: {err:?}"
    );
    Ok(check(&sched)?)
}

#[test]
fn config_must_agree_with_the_index() {
    let err = Scheduler::new(config(8, 16, false), Box::new(ReferenceIndex::new(32))).err();
    assert_err!(err, Some(Error::Config(ConfigError::Invalid { field: "block_size", .. })));
    let err = scheduler(config(8, 0, false)).err();
    assert_err!(err, Some(Error::Config(ConfigError::Invalid { field: "max_tokens_per_step", .. })));
}

#[test]
fn a_prefill_cap_of_zero_or_above_the_budget_is_a_config_error() {
    for (cap, expected) in [(0, "positive"), (17, "at most max_tokens_per_step (16)")] {
        let err =
            scheduler(SchedulerConfig { prefill_cap: PrefillCap::Tokens(cap), ..config(8, 16, false) }).err();
        assert!(
            matches!(&err, Some(Error::Config(ConfigError::Invalid { field: "prefill_cap", expected: e, .. })) if e == expected),
            "{err:?}"
        );
    }
    assert!(
        scheduler(SchedulerConfig { prefill_cap: PrefillCap::Tokens(16), ..config(8, 16, false) }).is_ok()
    );
}

/// Each sequence of a batch as (request, tokens it runs this step).
fn shape(batch: &ScheduledBatch) -> Vec<(RequestId, usize)> {
    batch.seqs.iter().map(|s| (s.request, s.token_ids.len())).collect()
}

/// With a cap, a step that carries decodes adds at most `prefill_cap` prefill
/// tokens: a long prompt is chunked across steps (and still progresses every
/// step) instead of stalling the decode; without decodes it takes the budget.
#[test]
fn a_prefill_cap_chunks_prompts_beside_decodes_and_keeps_them_moving() -> TestResult {
    let mut sched = scheduler(SchedulerConfig { prefill_cap: PrefillCap::Tokens(3), ..config(32, 8, true) })?;
    // Alone, a prompt takes the whole budget.
    sched.admit(generating(1, &(0..5).collect::<Vec<_>>(), 8))?;
    let batch = sched.schedule()?;
    assert_eq!(shape(&batch), vec![(1, 5)]);
    complete(&mut sched, &batch)?;
    sched.append(1, 42)?;
    // Beside request 1's decode, request 2's 10 tokens go 3 a step.
    sched.admit(request(2, 0, &(100..110).collect::<Vec<_>>()))?;
    for (step, chunk) in [3, 3, 3, 1].into_iter().enumerate() {
        let batch = sched.schedule()?;
        assert_eq!(shape(&batch), vec![(1, 1), (2, chunk)], "step {step}");
        let ready = complete(&mut sched, &batch)?;
        sched.append(1, 43 + step as u32)?;
        if ready.contains(&2) {
            sched.finish(2)?;
        }
    }
    assert_eq!(sched.num_computed_tokens(2), None, "request 2 finished in 4 steps");
    Ok(())
}

/// With a cap, a step prefills at most one long prompt (more than `prefill_cap`
/// tokens left), even with budget to spare and no decode: prompts that arrive
/// together start one after another. Short prompts still pack into one step.
#[test]
fn a_prefill_cap_starts_one_long_prompt_per_step_and_packs_short_ones() -> TestResult {
    let mut sched =
        scheduler(SchedulerConfig { prefill_cap: PrefillCap::Tokens(3), ..config(32, 16, true) })?;
    sched.admit(generating(1, &(0..5).collect::<Vec<_>>(), 8))?;
    sched.admit(generating(2, &(100..105).collect::<Vec<_>>(), 8))?;
    let batch = sched.schedule()?;
    assert_eq!(
        shape(&batch),
        vec![(1, 5)],
        "the second long prompt waits though 11 tokens of budget are left"
    );
    assert_eq!(complete(&mut sched, &batch)?, vec![1]);
    sched.append(1, 42)?;
    let batch = sched.schedule()?;
    assert_eq!(
        shape(&batch),
        vec![(1, 1), (2, 3)],
        "next step: the decode, then the cap's chunk of the next prompt"
    );
    assert_eq!(complete(&mut sched, &batch)?, vec![1]);
    sched.finish(1)?;
    // No decode now: short prompts (at most the cap) all start in one step beside the long one's last chunk.
    for id in 3..6 {
        sched.admit(request(id, 0, &[id as u32 * 100, id as u32 * 100 + 1]))?;
    }
    let batch = sched.schedule()?;
    assert_eq!(shape(&batch), vec![(2, 2), (3, 2), (4, 2), (5, 2)]);
    Ok(())
}

/// Prefill-only requests are never long: a burst of them packs into one step
/// (they share its fixed costs and do not decode in lockstep afterwards).
#[test]
fn prefill_only_prompts_pack_under_a_prefill_cap() -> TestResult {
    let mut sched =
        scheduler(SchedulerConfig { prefill_cap: PrefillCap::Tokens(3), ..config(32, 16, true) })?;
    sched.admit(request(1, 0, &(0..5).collect::<Vec<_>>()))?;
    sched.admit(request(2, 0, &(100..105).collect::<Vec<_>>()))?;
    sched.admit(generating(3, &(200..205).collect::<Vec<_>>(), 4))?;
    sched.admit(generating(4, &(300..305).collect::<Vec<_>>(), 4))?;
    let batch = sched.schedule()?;
    assert_eq!(
        shape(&batch),
        vec![(1, 5), (2, 5), (3, 5)],
        "both prefill-only prompts and one generating one; 4 waits with budget left"
    );
    Ok(())
}

/// Completes `batch` without running it (the scheduler does not read pages) and
/// returns the ready requests.
fn complete(sched: &mut Scheduler, batch: &ScheduledBatch) -> TestResult<Vec<RequestId>> {
    let ready = sched.complete(batch)?;
    check(sched)?;
    Ok(ready)
}

/// Schedules one step and completes it unrun.
fn step(sched: &mut Scheduler) -> TestResult<Vec<RequestId>> {
    let batch = sched.schedule()?;
    complete(sched, &batch)
}

fn generating(id: RequestId, ids: &[u32], max_new_tokens: usize) -> Request {
    Request { max_new_tokens, ..request(id, 0, ids) }
}

#[test]
fn decode_tokens_go_first_then_prefill_chunks_within_one_budget() -> TestResult {
    let mut sched = scheduler(config(32, 8, true))?;
    sched.admit(generating(1, &(0..5).collect::<Vec<_>>(), 4))?;
    let batch = sched.schedule()?;
    assert_eq!(complete(&mut sched, &batch)?, vec![1]);
    sched.append(1, 42)?;
    // A long prompt arrives; request 1 decodes one token per step ahead of its chunks.
    sched.admit(request(2, 0, &(100..130).collect::<Vec<_>>()))?;
    for step in 0..3 {
        let batch = sched.schedule()?;
        let shape: Vec<(RequestId, usize)> =
            batch.seqs.iter().map(|s| (s.request, s.token_ids.len())).collect();
        assert_eq!(shape, vec![(1, 1), (2, 7)], "step {step}");
        let decode = &batch.seqs[0];
        assert_eq!(
            (decode.num_computed_tokens, decode.seq_len, decode.output_from),
            (5 + step, 6 + step, 5 + step)
        );
        assert!(decode.emits_output && !batch.seqs[1].emits_output);
        assert_eq!(complete(&mut sched, &batch)?, vec![1]);
        sched.append(1, 43 + step as u32)?;
    }
    assert_eq!(sched.num_computed_tokens(1), Some(8));
    Ok(())
}

#[test]
fn append_and_finish_check_the_sequence_and_change_nothing_on_error() -> TestResult {
    let radix = RadixIndex::new(RadixConfig { block_size: 16 })?;
    let checks = RequestChecks::default().with_model(omniprefix::batch::ModelShape {
        vocab_size: 200,
        hidden_size: 2,
        num_layers: 2,
        deepstack_levels: None,
    });
    let mut sched = Scheduler::new(config(32, 64, true), Box::new(radix))?.with_checks(Arc::new(checks));
    sched.admit(generating(1, &[1, 2, 3], 2))?;
    assert_err!(
        sched.append(1, 5),
        Err(Error::Sched(SchedError::RequestNotFinished { id: 1, computed: 0, len: 3 }))
    );
    let batch = sched.schedule()?;
    assert_err!(sched.finish(1), Err(Error::Sched(SchedError::RequestNotFinished { id: 1, .. })));
    complete(&mut sched, &batch)?;
    assert_err!(
        sched.append(1, 200),
        Err(Error::Request(RequestError::TokenOutOfVocab { position: 3, token: 200, .. }))
    );
    assert_err!(sched.append(9, 5), Err(Error::Sched(SchedError::UnknownRequest { id: 9 })));
    sched.append(1, 5)?;
    step(&mut sched)?;
    sched.append(1, 6)?;
    step(&mut sched)?;
    // Two new tokens is all it may grow by.
    assert_err!(
        sched.append(1, 7),
        Err(Error::Request(RequestError::GenerationLimit { id: 1, max_new_tokens: 2 }))
    );
    assert_eq!(sched.num_computed_tokens(1), Some(5));
    check(&sched)?;
    sched.finish(1)?;
    check(&sched)?;
    // prompt + reply are cached to the last position.
    sched.admit(request(2, 0, &[1, 2, 3, 5, 6, 9]))?;
    let batch = sched.schedule()?;
    assert_eq!(batch.seqs[0].num_computed_tokens, 5);
    Ok(())
}

#[test]
fn a_sequence_whose_blocks_fill_while_decoding_commits_them_at_once() -> TestResult {
    let radix = RadixIndex::new(RadixConfig { block_size: 4 })?;
    let mut sched =
        Scheduler::new(SchedulerConfig { block_size: 4, ..config(32, 64, true) }, Box::new(radix))?;
    sched.admit(generating(1, &[1, 2, 3], 8))?;
    step(&mut sched)?;
    for t in 10..16 {
        sched.append(1, t)?;
        step(&mut sched)?;
        // Blocks whose KV is written are cached while the sequence still runs.
        let full = sched.num_computed_tokens(1).unwrap_or(0) / 4;
        assert_eq!(sched.index_stats().cached_blocks, full as u64, "after token {t}");
    }
    sched.abort(1)?;
    check(&sched)?;
    // Abort leaves the full blocks cached and unpinned, and never the partial one.
    assert_eq!(sched.stats().blocks_in_use, 0);
    assert_eq!(sched.index_stats().cached_blocks, 2);
    assert_eq!(sched.evict(8)?, 2);
    Ok(())
}

/// Issue 22, two batches out: request 2's batch copies the cached partial
/// block `[7]`, pinned until that batch completes. Request 1's earlier batch
/// completes first and its full block `[7, 1, 2, 3]` would grow that pinned
/// leaf: the commit waits (request 1 keeps the block) instead of failing, and
/// lands at request 1's next completion, once the pin is gone.
#[test]
fn a_commit_that_meets_a_pinned_copy_source_waits_for_the_next_completion() -> TestResult {
    let radix = RadixIndex::new(RadixConfig { block_size: 4 })?;
    let cfg = SchedulerConfig { block_size: 4, max_seqs_per_step: 1, ..config(16, 64, true) };
    let mut sched = Scheduler::new(cfg, Box::new(radix))?;
    sched.admit(request(0, 0, &[7]))?;
    assert_eq!(step(&mut sched)?, vec![0]);
    sched.finish(0)?;
    sched.admit(generating(1, &[7, 1, 2, 3, 4, 5], 1))?;
    sched.admit(request(2, 0, &[7, 8]))?;
    let a = sched.schedule()?;
    let b = sched.schedule()?;
    assert_eq!((a.seqs[0].request, a.copies.len()), (1, 1));
    assert_eq!((b.seqs[0].request, b.copies.len()), (2, 1), "request 2 copies [7] too, pinning it");
    assert_eq!(complete(&mut sched, &a)?, vec![1]);
    assert_eq!(sched.index_stats().cached_blocks, 1, "only [7]: request 1's block waits");
    assert_eq!(complete(&mut sched, &b)?, vec![2]);
    sched.finish(2)?;
    sched.append(1, 9)?;
    assert_eq!(step(&mut sched)?, vec![1]);
    let own = sched.block_table(1).map(|t| t[0]);
    sched.finish(1)?;
    check(&sched)?;
    // Request 2's tail [7, 8] (it replaced the partial [7]), request 1's
    // [7, 1, 2, 3] and its tail [4, 5, 9].
    assert_eq!(sched.index_stats().cached_blocks, 3);
    sched.admit(request(3, 0, &[7, 1, 2, 3, 4, 5, 9, 0]))?;
    let batch = sched.schedule()?;
    assert_eq!(batch.seqs[0].num_computed_tokens, 7);
    assert_eq!(batch.seqs[0].block_table.blocks().first().copied(), own);
    Ok(())
}
