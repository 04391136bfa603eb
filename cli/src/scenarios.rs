//! `fixtures/scenarios.json`, compiled in and parsed by one set of types for
//! every harness (the demo, `bench ttft`, the match workloads), so a malformed
//! fixture is one error ([`HarnessError::Fixture`]) wherever it is read.

use serde::Deserialize;

use crate::error::{HarnessError, Result};
use omniprefix::canon::Modality;

/// Where the scenarios come from (named in errors).
pub const SCENARIOS_FILE: &str = "fixtures/scenarios.json";
const SCENARIOS_JSON: &str = include_str!("../../fixtures/scenarios.json");

/// The chat scenarios the harnesses replay.
#[derive(Debug, Clone, Deserialize)]
pub struct Scenarios {
    pub rfc_text_pair: RfcTextPair,
    pub multi_round: MultiRound,
    pub prefix_repetition: PrefixRepetition,
}

/// The vllm-omni RFC's two text prompts.
#[derive(Debug, Clone, Deserialize)]
pub struct RfcTextPair {
    pub prompt1: Vec<u32>,
    pub prompt2: Vec<u32>,
}

/// A conversation whose every round re-sends the history and all earlier media.
#[derive(Debug, Clone, Deserialize)]
pub struct MultiRound {
    pub rounds: Vec<Round>,
}

/// One round: its unexpanded ids and the items its placeholders name, in order.
#[derive(Debug, Clone, Deserialize)]
pub struct Round {
    pub items_in_order: Vec<Modality>,
    pub token_ids_unexpanded: Vec<u32>,
}

/// vLLM's `prefix_repetition` dataset parameters.
#[derive(Debug, Clone, Deserialize)]
pub struct PrefixRepetition {
    pub prefix_len: usize,
    pub suffix_len: usize,
    pub num_prefixes: usize,
    /// Tokens generated per request.
    pub output_len: usize,
    pub num_prompts: usize,
}

impl Scenarios {
    /// Parses the embedded fixture.
    ///
    /// ```
    /// let s = omniprefix_cli::scenarios::Scenarios::load()?;
    /// assert_eq!(s.multi_round.rounds.len(), 4);
    /// # Ok::<(), omniprefix_cli::HarnessError>(())
    /// ```
    pub fn load() -> Result<Self> {
        parse(SCENARIOS_FILE, SCENARIOS_JSON)
    }
}

/// Parses an embedded fixture; a malformed one is an [`HarnessError::Fixture`] naming `file`.
pub(crate) fn parse<T: serde::de::DeserializeOwned>(file: &'static str, json: &str) -> Result<T> {
    serde_json::from_str(json).map_err(|e| HarnessError::Fixture { file, problem: e.to_string() })
}
