//! Preprocess end to end on the mixed workload (real layouts, tiny tensors):
//! token count, a warm radix match of every cacheable token, agreement with
//! the vLLM hash chain, and a changed item that stops the match at its start.

use std::sync::Arc;

use omniprefix::Error;
use omniprefix::canon::{FingerprintKey, Fingerprinter, Modality};
use omniprefix::error::RequestError;
use omniprefix::index::hashchain::{HashChainIndex, hash_mm_item};
use omniprefix::index::radix::{RadixConfig, RadixIndex};
use omniprefix::index::{BlockId, PrefixIndex, ValidationPolicy};
use omniprefix::preprocess::Preprocessor;
use omniprefix::prompt::OmniTokens;
use omniprefix_cli::Result;
use omniprefix_cli::bench::{BLOCK_SIZE, MODEL_ID};
use omniprefix_cli::workloads::{Media, MediaScale, Workload, WorkloadName};

fn preprocessor(policy: ValidationPolicy) -> Result<Preprocessor> {
    Ok(Preprocessor::new(Fingerprinter::new(FingerprintKey::fixed(11), 2, policy)?, OmniTokens::qwen3_omni()))
}

fn mixed() -> Result<Workload> {
    Workload::new(WorkloadName::Mixed, Arc::new(Media::generate(MediaScale::Tiny, 1)?), 1)
}

#[test]
fn mixed_request_expands_to_8546_tokens_and_matches_warm() -> Result<()> {
    let workload = mixed()?;
    // The policy is given to the fingerprinter only; the index takes none.
    for policy in
        [ValidationPolicy::SecondDigest, ValidationPolicy::ExactBytes, ValidationPolicy::Unvalidated]
    {
        let pre = preprocessor(policy)?;
        let first = pre.preprocess(&workload.raw(&workload.measured))?;
        assert_eq!(first.len(), 8546);
        let spans: Vec<(u32, u32)> =
            first.index_map.spans.iter().map(|s| (s.start, s.rows.end - s.rows.start)).collect();
        assert_eq!(spans, vec![(44, 390), (436, 880), (1318, 7200)]);
        assert_eq!(first.index_map.placeholders.len(), 8470);

        let mut index = RadixIndex::new(RadixConfig { block_size: BLOCK_SIZE })?;
        let blocks: Vec<BlockId> = (0..(first.len() / BLOCK_SIZE) as BlockId).collect();
        index.insert(&first, &blocks)?;
        // A second, independent preprocess of the same request: fresh identities.
        let again = pre.preprocess(&workload.raw(&workload.measured))?;
        let m = index.match_prefix(&again);
        // Every token that a full block holds: 8546 = 534 * 16 + 2.
        assert_eq!((m.tokens, m.aligned_tokens), (8544, 8544));
        assert_eq!(m.blocks, blocks);
        assert_eq!(index.stats().validation_failures, 0);
        assert!(again.items.iter().all(|item| item.evidence.policy() == policy));
    }
    Ok(())
}

/// Identities made by fingerprinters of different policies never confirm
/// each other: the request misses at the item (counted), it never hits wrongly.
#[test]
fn items_of_another_policy_miss_at_the_item() -> Result<()> {
    let workload = mixed()?;
    let raw = workload.raw(&workload.measured);
    let cached = preprocessor(ValidationPolicy::SecondDigest)?.preprocess(&raw)?;
    let mut index = RadixIndex::new(RadixConfig { block_size: BLOCK_SIZE })?;
    index.insert(&cached, &(0..(cached.len() / BLOCK_SIZE) as BlockId).collect::<Vec<_>>())?;
    for policy in [ValidationPolicy::ExactBytes, ValidationPolicy::Unvalidated] {
        let query = preprocessor(policy)?.preprocess(&raw)?;
        assert_eq!(query.items[0].fingerprint, cached.items[0].fingerprint, "same key, same fingerprint");
        assert_eq!(index.match_prefix(&query).tokens, 44, "{policy:?}: stops where the first item starts");
    }
    assert_eq!(index.stats().validation_failures, 2);
    Ok(())
}

#[test]
fn hash_chain_agrees_on_the_warm_mixed_request() -> Result<()> {
    let workload = mixed()?;
    let prompt =
        preprocessor(ValidationPolicy::SecondDigest)?.preprocess(&workload.raw(&workload.measured))?;
    let hashes = workload
        .measured
        .items
        .iter()
        .map(|&m| hash_mm_item(MODEL_ID, m, workload.media.vllm_media(m)))
        .collect::<omniprefix::Result<Vec<_>>>()?;
    let mut chain = HashChainIndex::new(BLOCK_SIZE)?;
    let blocks: Vec<BlockId> = (0..(prompt.len() / BLOCK_SIZE) as BlockId).collect();
    chain.insert_with_mm_hashes(&prompt, &hashes, &blocks)?;
    assert_eq!(chain.match_with_mm_hashes(&prompt, &hashes)?.tokens, 8544);
    Ok(())
}

#[test]
fn a_changed_video_stops_the_match_where_the_video_starts() -> Result<()> {
    let workload = mixed()?;
    let pre = preprocessor(ValidationPolicy::SecondDigest)?;
    let cached = pre.preprocess(&workload.raw(&workload.measured))?;
    let mut index = RadixIndex::new(RadixConfig { block_size: BLOCK_SIZE })?;
    let blocks: Vec<BlockId> = (0..(cached.len() / BLOCK_SIZE) as BlockId).collect();
    index.insert(&cached, &blocks)?;

    let mut media = (*workload.media).clone();
    media.video[[1, 2, 3, 0]] ^= 1;
    let changed = Workload::new(WorkloadName::Mixed, Arc::new(media), 1)?;
    let m = index.match_prefix(&pre.preprocess(&changed.raw(&changed.measured))?);
    assert_eq!((m.tokens, m.aligned_tokens), (1318, 1312));
    Ok(())
}

#[test]
fn bad_media_is_a_typed_error_naming_the_item() -> Result<()> {
    let workload = mixed()?;
    let mut media = (*workload.media).clone();
    media.audio[5] = f32::INFINITY;
    let broken = Workload::new(WorkloadName::Mixed, Arc::new(media), 1)?;
    let err = preprocessor(ValidationPolicy::SecondDigest)?.preprocess(&broken.raw(&broken.measured));
    // Items are numbered in request order: audio is item 0 of the mixed request.
    assert_eq!(broken.measured.items[0], Modality::Audio);
    assert!(matches!(err, Err(Error::Request(RequestError::NonFinite { item: 0, index: 5 }))), "{err:?}");
    Ok(())
}
