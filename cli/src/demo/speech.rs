//! The demo's spoken chat: a multi-round conversation on a full Omni checkpoint (thinker,
//! talker and code2wav) where every round re-sends the whole conversation, the engine's own
//! earlier replies included, and asks for the reply as audio; the same rounds run on a second
//! engine with caching off, so time to first audio (TTFA) is compared within one run.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;
use serde_json::{Value, json};

use crate::chat::{Chat, Messages};
use crate::error::{HarnessError, Result};
use omniprefix::backend::Backend;
use omniprefix::engine::{Engine, EngineConfig, Output, Request, millis};
use omniprefix::error::{CheckpointError, IoError};
use omniprefix::sample::{SamplingParams, TalkerSampling};
use omniprefix::speech::SpeechOptions;

/// The user turns of the spoken chat, one per round. The tiny checkpoint's random talker often
/// ends a reply at once (codec EOS first); on it these turns make audio in every round.
pub const SPOKEN_TURNS: [&str; 3] = ["Say hello to me.", "Can you repeat that?", "What is the weather like?"];

/// The repository's tiny full Omni checkpoint, the spoken chat's model when no other is given.
pub fn default_speech_model() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny/omni_audio");
    dir.join("config.json").is_file().then_some(dir)
}

/// Whether the checkpoint in `dir` has a talker (`talker_config`, audio output not turned off).
pub fn has_talker(dir: &Path) -> Result<bool> {
    let root = read_root_config(dir)?;
    Ok(root.get("talker_config").is_some_and(|t| !t.is_null())
        && root.get("enable_audio_output").and_then(Value::as_bool) != Some(false))
}

/// How big the spoken chat is.
#[derive(Debug, Clone, PartialEq)]
pub struct SpokenChatOptions {
    /// The full Omni checkpoint.
    pub model: PathBuf,
    /// Rounds (at most [`SPOKEN_TURNS`]' length).
    pub rounds: usize,
    /// Tokens of each (greedy) reply: the thinker's special ids are suppressed and the
    /// reply runs to this length, so its decoded text re-sends as the same kind of ids.
    pub reply_tokens: usize,
    /// Talker steps per reply at most (greedy talker).
    pub talker_max_tokens: usize,
}

impl SpokenChatOptions {
    /// Three rounds of 8-token replies, each spoken in at most 32 talker steps.
    pub fn new(model: PathBuf) -> Self {
        SpokenChatOptions { model, rounds: SPOKEN_TURNS.len(), reply_tokens: 8, talker_max_tokens: 32 }
    }
}

/// One round of the spoken chat, cached and uncached.
#[derive(Debug, Clone, Serialize)]
pub struct SpokenRound {
    pub round: usize,
    pub prompt_tokens: usize,
    /// Thinker prompt tokens reused (caching on).
    pub cached_tokens: usize,
    pub talker_prompt_rows: usize,
    /// Talker prefill rows reused (caching on).
    pub talker_cached_rows: usize,
    pub codec_frames: usize,
    pub audio_samples: usize,
    /// Submission to the first audio sample, caching on and off.
    pub ttfa_ms: f64,
    pub ttfa_ms_uncached: f64,
    /// `ttfa_ms / ttfa_ms_uncached`.
    pub ttfa_ratio: f64,
    /// The uncached run spoke the same codes (greedy: caching changes nothing).
    pub same_audio_as_uncached: bool,
}

/// The spoken chat's report.
#[derive(Debug, Clone, Serialize)]
pub struct SpokenChatReport {
    /// The checkpoint directory.
    pub model: String,
    pub sample_rate: u32,
    pub rounds: Vec<SpokenRound>,
    /// The last round's TTFA, cached over uncached.
    pub last_round_ttfa_ratio: f64,
    /// Every round spoke the same codes cached and uncached.
    pub same_audio: bool,
}

/// Runs the spoken chat on `backend`: per round, the uncached engine then the cached one, on
/// the same prompt ids (those of the cached conversation).
pub fn run_spoken_chat<B: Backend>(backend: Arc<B>, options: &SpokenChatOptions) -> Result<SpokenChatReport> {
    let dir = &options.model;
    let chat = Chat::from_dir(dir)?;
    let engine =
        |cache| Engine::from_dir_on(Arc::clone(&backend), dir, EngineConfig { cache, ..Default::default() });
    let (mut cached, mut uncached) = (engine(true)?, engine(false)?);
    let params = SamplingParams {
        ignore_eos: true,
        suppress_ids: special_ids(dir, cached.model_config().vocab_size)?,
        ..SamplingParams::greedy(options.reply_tokens)
    };
    let speech = SpeechOptions {
        talker: TalkerSampling { max_new_tokens: options.talker_max_tokens, ..TalkerSampling::greedy() },
        ..SpeechOptions::default()
    };
    let speak = |engine: &mut Engine<B>, ids: &[u32]| -> Result<Output> {
        Ok(engine.run(Request::text(ids.to_vec()).generate(params.clone()).speak(speech.clone()))?)
    };
    let mut messages = vec![json!({"role": "system", "content": "You are a helpful assistant."})];
    // One untimed round on a throwaway engine first, so neither way pays the first run's page faults.
    messages.push(json!({"role": "user", "content": SPOKEN_TURNS[0]}));
    speak(&mut engine(false)?, &chat.prompt_ids(&to_messages(&messages)?)?)?;
    messages.pop();

    let (mut rounds, mut sample_rate) = (Vec::new(), 0);
    for (round, turn) in SPOKEN_TURNS.iter().take(options.rounds.max(1)).enumerate() {
        messages.push(json!({"role": "user", "content": turn}));
        let ids = chat.prompt_ids(&to_messages(&messages)?)?;
        let reference = speak(&mut uncached, &ids)?;
        let out = speak(&mut cached, &ids)?;
        let (Some(spoken), Some(reference_speech)) = (&out.speech, &reference.speech) else {
            return Err(HarnessError::NoOutput { what: "the talker" });
        };
        sample_rate = spoken.sample_rate;
        let ttfa = |o: &Output| o.timings.ttfa.map_or(f64::NAN, millis);
        let (ttfa_ms, ttfa_ms_uncached) = (ttfa(&out), ttfa(&reference));
        rounds.push(SpokenRound {
            round,
            prompt_tokens: out.prompt_len,
            cached_tokens: out.num_cached_tokens,
            talker_prompt_rows: spoken.talker_prompt_rows,
            talker_cached_rows: spoken.talker_cached_rows,
            codec_frames: spoken.codes.ncols(),
            audio_samples: spoken.audio.len(),
            ttfa_ms,
            ttfa_ms_uncached,
            ttfa_ratio: ttfa_ms / ttfa_ms_uncached,
            same_audio_as_uncached: spoken.codes == reference_speech.codes && out.tokens == reference.tokens,
        });
        messages.push(json!({"role": "assistant", "content": chat.decode(&out.tokens, true)?}));
    }
    Ok(SpokenChatReport {
        model: dir.display().to_string(),
        sample_rate,
        last_round_ttfa_ratio: rounds.last().map_or(f64::NAN, |r| r.ttfa_ratio),
        same_audio: rounds.iter().all(|r| r.same_audio_as_uncached),
        rounds,
    })
}

/// Prints the spoken chat's table and its summary line.
pub fn print_spoken_chat(report: &SpokenChatReport, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    writeln!(out, "\n== spoken_chat == ({}, {} Hz)", report.model, report.sample_rate)?;
    writeln!(
        out,
        "{:>5} {:>6} {:>6} {:>7} {:>7} {:>6} {:>7} {:>9} {:>9} {:>7} {:>5}",
        "round",
        "prompt",
        "cached",
        "talker",
        "t_cache",
        "frames",
        "samples",
        "ttfa_ms",
        "ttfa_nc",
        "ttfa/nc",
        "same"
    )?;
    for r in &report.rounds {
        writeln!(
            out,
            "{:>5} {:>6} {:>6} {:>7} {:>7} {:>6} {:>7} {:>9.2} {:>9.2} {:>7.3} {:>5}",
            r.round,
            r.prompt_tokens,
            r.cached_tokens,
            r.talker_prompt_rows,
            r.talker_cached_rows,
            r.codec_frames,
            r.audio_samples,
            r.ttfa_ms,
            r.ttfa_ms_uncached,
            r.ttfa_ratio,
            if r.same_audio_as_uncached { "yes" } else { "NO" }
        )?;
    }
    Ok(())
}

/// The one summary line of the spoken chat.
pub fn spoken_summary_line(report: &SpokenChatReport) -> String {
    let last = report.rounds.last();
    format!(
        "TTFA, last spoken_chat round: {:.2} ms cached vs {:.2} ms uncached, {:.3}x uncached; audio {} uncached",
        last.map_or(f64::NAN, |r| r.ttfa_ms),
        last.map_or(f64::NAN, |r| r.ttfa_ms_uncached),
        report.last_round_ttfa_ratio,
        if report.same_audio { "identical to" } else { "DIFFERS from" }
    )
}

fn to_messages(messages: &[Value]) -> Result<Messages> {
    Ok(Messages::parse(&Value::from(messages.to_vec()).to_string(), "the spoken chat")?)
}

fn read_root_config(dir: &Path) -> Result<Value> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| IoError::read(&path, source))?;
    serde_json::from_str(&text)
        .map_err(|e| CheckpointError::ConfigParse(format!("{}: {e}", path.display())).into())
}

/// The chat's special ids below `vocab`: every `*_token_id` at the root of `config.json` and in
/// its `thinker_config` (turn markers, item placeholders, the talker's text rows): what HF's
/// reference suppresses in a spoken reply (`thinker_suppress_tokens`), and the end of turn too.
fn special_ids(dir: &Path, vocab: usize) -> Result<Vec<u32>> {
    let root = read_root_config(dir)?;
    let mut ids: Vec<u32> = [Some(&root), root.get("thinker_config")]
        .into_iter()
        .flatten()
        .filter_map(Value::as_object)
        .flat_map(|o| o.iter())
        .filter(|(k, _)| k.ends_with("_token_id"))
        .filter_map(|(_, v)| v.as_u64().and_then(|id| u32::try_from(id).ok()))
        .filter(|&id| (id as usize) < vocab)
        .collect();
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}
