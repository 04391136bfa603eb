//! One workload made ready to measure: preprocessor, warm and empty radix
//! indexes, and a warm vLLM hash-chain index, each path as one method so the
//! CLI and criterion time exactly the same code.

use std::collections::BTreeMap;

use crate::error::Result;
use crate::workloads::{RequestPlan, Workload};
use omniprefix::canon::{FingerprintKey, Fingerprinter, ItemIdentity, Modality};
use omniprefix::index::hashchain::{HashChainIndex, hash_mm_item};
use omniprefix::index::radix::{RadixConfig, RadixIndex};
use omniprefix::index::{BlockId, PrefixIndex, PrefixMatch, ValidationPolicy};
use omniprefix::preprocess::Preprocessor;
use omniprefix::prompt::{CanonicalPrompt, OmniTokens};

/// The model id vLLM puts into every multimodal hash.
pub const MODEL_ID: &str = "Qwen/Qwen3-Omni-30B-A3B-Instruct";
/// KV block size of both indexes.
pub const BLOCK_SIZE: usize = 16;

/// A workload with its indexes warmed by the workload's warm-up requests.
#[derive(Debug)]
pub struct MatchFixture {
    pub workload: Workload,
    preprocessor: Preprocessor,
    /// Holds every warm-up request.
    warm_radix: RadixIndex,
    /// Holds nothing: the cold path.
    empty_radix: RadixIndex,
    /// vLLM's cache after the same warm-up requests, items keyed by their raw-media mm hash.
    warm_chain: HashChainIndex,
    /// The measured request, preprocessed once (for the match-only paths).
    prompt: CanonicalPrompt,
    /// vLLM mm hash of the measured request's items, in item order.
    mm_hashes: Vec<String>,
}

impl MatchFixture {
    /// Preprocesses and caches the warm-up requests (radix with `policy`,
    /// hash chain with vLLM's mm hashes); fingerprints use `threads` threads
    /// and a fresh random key, the default of a real index.
    pub fn new(workload: Workload, threads: usize, policy: ValidationPolicy) -> Result<Self> {
        let fingerprinter = Fingerprinter::new(FingerprintKey::random(), threads, policy)?;
        let preprocessor = Preprocessor::new(fingerprinter, OmniTokens::qwen3_omni());
        let config = RadixConfig { block_size: BLOCK_SIZE };
        let mut warm_radix = RadixIndex::new(config)?;
        let mut warm_chain = HashChainIndex::new(BLOCK_SIZE)?;
        let vllm_hashes = vllm_hashes(&workload)?;
        let mut next_block: BlockId = 0;
        for plan in &workload.warmup {
            let prompt = preprocessor.preprocess(&workload.raw(plan))?;
            let full = prompt.len() / BLOCK_SIZE;
            let blocks: Vec<BlockId> = (next_block..).take(full).collect();
            next_block += full as BlockId;
            warm_radix.insert(&prompt, &blocks)?;
            warm_chain.insert_with_mm_hashes(&prompt, &plan_hashes(plan, &vllm_hashes), &blocks)?;
        }
        let prompt = preprocessor.preprocess(&workload.raw(&workload.measured))?;
        let mm_hashes = plan_hashes(&workload.measured, &vllm_hashes);
        Ok(MatchFixture {
            preprocessor,
            warm_radix,
            empty_radix: RadixIndex::new(config)?,
            warm_chain,
            prompt,
            mm_hashes,
            workload,
        })
    }

    /// The measured request, preprocessed.
    pub fn prompt(&self) -> &CanonicalPrompt {
        &self.prompt
    }

    /// Threads the fingerprinter runs on.
    pub fn threads(&self) -> usize {
        self.preprocessor.fingerprinter().threads()
    }

    /// The validation policy of the radix path.
    pub fn policy(&self) -> ValidationPolicy {
        self.preprocessor.fingerprinter().policy()
    }

    /// Index-structure bytes per cached token of the warm radix index.
    pub fn radix_bytes_per_token(&self) -> f64 {
        let stats = self.warm_radix.stats();
        stats.index_bytes as f64 / (stats.cached_blocks as f64 * BLOCK_SIZE as f64).max(1.0)
    }

    /// The floor: one plain read of every byte the request carries.
    pub fn read_floor(&self) -> u64 {
        self.workload.read_floor()
    }

    /// Fingerprinting alone: every item of the measured request.
    pub fn fingerprint(&self) -> Result<Vec<ItemIdentity>> {
        let raw = self.workload.raw(&self.workload.measured);
        let fingerprinter = self.preprocessor.fingerprinter();
        Ok(raw
            .items
            .iter()
            .enumerate()
            .map(|(i, item)| fingerprinter.identify(i, item))
            .collect::<omniprefix::Result<_>>()?)
    }

    /// omniprefix, cold: preprocess + match on an index that holds nothing.
    pub fn omniprefix_cold(&mut self) -> Result<PrefixMatch> {
        let prompt = self.preprocessor.preprocess(&self.workload.raw(&self.workload.measured))?;
        Ok(self.empty_radix.match_prefix(&prompt))
    }

    /// omniprefix, warm: preprocess + validated match on the warm index.
    pub fn omniprefix_warm(&mut self) -> Result<PrefixMatch> {
        let prompt = self.preprocessor.preprocess(&self.workload.raw(&self.workload.measured))?;
        Ok(self.warm_radix.match_prefix(&prompt))
    }

    /// The radix match alone on the warm index (prompt already preprocessed).
    pub fn radix_match(&mut self) -> PrefixMatch {
        self.warm_radix.match_prefix(&self.prompt)
    }

    /// vLLM's path on one thread: BLAKE3 mm hash of each raw item, then the
    /// SHA-256/CBOR block chain and the lookup on the warm hash-chain index.
    pub fn hashchain(&mut self) -> Result<PrefixMatch> {
        let media = &self.workload.media;
        let hashes = self
            .workload
            .measured
            .items
            .iter()
            .map(|&m| hash_mm_item(MODEL_ID, m, media.vllm_media(m)))
            .collect::<omniprefix::Result<Vec<_>>>()?;
        Ok(self.warm_chain.match_with_mm_hashes(&self.prompt, &hashes)?)
    }

    /// The block chain + lookup alone (mm hashes already known).
    pub fn hashchain_chain(&mut self) -> Result<PrefixMatch> {
        Ok(self.warm_chain.match_with_mm_hashes(&self.prompt, &self.mm_hashes)?)
    }
}

/// vLLM's mm hash of each media item the workload uses.
fn vllm_hashes(workload: &Workload) -> Result<BTreeMap<Modality, String>> {
    let mut hashes = BTreeMap::new();
    for plan in workload.warmup.iter().chain([&workload.measured]) {
        for &m in &plan.items {
            if let std::collections::btree_map::Entry::Vacant(slot) = hashes.entry(m) {
                slot.insert(hash_mm_item(MODEL_ID, m, workload.media.vllm_media(m))?);
            }
        }
    }
    Ok(hashes)
}

fn plan_hashes(plan: &RequestPlan, hashes: &BTreeMap<Modality, String>) -> Vec<String> {
    plan.items.iter().filter_map(|m| hashes.get(m).cloned()).collect()
}
