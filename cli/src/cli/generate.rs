//! `omniprefix generate`: run warm-up requests, then a request, generating
//! tokens for each with the same sampling settings; print the tokens, cache
//! reuse and timings, and optionally write the hidden states of every position
//! that ran (prompt + generated tokens but the last) under `hidden`'s names.
//!
//! The request is a request file of ids (`--request`) or text: `--prompt TEXT` (one user
//! message) or `--messages FILE.json` (an OpenAI-style list), which the checkpoint's chat
//! template and tokenizer turn into ids ([`crate::chat`]); then the reply is printed decoded too.
//!
//! `--audio-out` (or any talker flag) asks every request, warm-ups included, for a spoken reply
//! (the checkpoint's talker and code2wav): the request's waveform goes to a WAV file, its codec
//! codes and samples into the report and `--out`.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Args;
use serde::Serialize;
use serde_json::Value;

use omniprefix::backend::Backend;
use omniprefix::engine::{Engine, Output, Request, millis};
use omniprefix::request_file::RequestFile;
use omniprefix::sample::{FinishReason, SamplingParams, TalkerSampling, parse_id_ranges};
use omniprefix::speech::{Speech, SpeechOptions};

use omniprefix::error::IoError;
use omniprefix::events::PublisherStats;
use safetensors::Dtype;

use super::fleet;
use super::hidden::{
    EngineArgs, EngineJob, JobRun, Tensor, hidden_tensors, on_selected_backend, print_shapes,
    required_request, write_tensors,
};
use crate::chat::{Chat, Messages};
use crate::error::{HarnessError, Result, output};
use crate::ttft::median;

/// Arguments of `omniprefix generate`.
#[derive(Debug, Clone, Args)]
#[command(group(clap::ArgGroup::new("prompt_input").args(["request", "prompt", "messages"]).required(true)))]
pub struct GenerateArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// A user message as the prompt, through the checkpoint's chat template and tokenizer
    /// (`tokenizer.json`, `tokenizer_config.json`); the reply is printed as text too.
    #[arg(long)]
    pub prompt: Option<String>,
    /// A JSON file of OpenAI-style messages (`[{"role": "user", "content": "..."}]`) as the
    /// prompt, as `--prompt` does with one.
    #[arg(long)]
    pub messages: Option<PathBuf>,
    /// Tokens to generate at most (≥ 1).
    #[arg(long, visible_alias = "max-new-tokens")]
    pub max_tokens: usize,
    /// Softmax temperature; 0 = greedy (argmax).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Sample among the `K` likeliest tokens only.
    #[arg(long, allow_negative_numbers = true)]
    pub top_k: Option<usize>,
    /// Sample from the smallest set of tokens whose probability reaches `P` (0 < P ≤ 1).
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f32>,
    /// Seed of the sampler when `--temperature` is above 0 (default: a random seed, reported back).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Token ids that end generation (default: the checkpoint's eos ids).
    #[arg(long, value_delimiter = ',')]
    pub stop: Option<Vec<u32>>,
    /// Generate `--max-tokens` tokens whatever the stop ids.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Token ids never sampled (HF `suppress_tokens`): commas and inclusive ranges,
    /// e.g. `151643-151644,151646-152063`.
    #[arg(long, value_parser = IdList::parse, default_value = "")]
    pub suppress_ids: IdList,
    /// Also write the hidden states of every position that ran to this safetensors file.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print one JSON object instead of lines of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub speech: SpeechArgs,
}

/// `generate`'s audio flags: any of them asks every request (warm-ups included) for a spoken
/// reply from the checkpoint's talker; one without a talker is the library's
/// [`RequestError::NoTalker`](omniprefix::error::RequestError::NoTalker).
#[derive(Debug, Clone, Default, Args)]
pub struct SpeechArgs {
    /// Speak the reply and write the request's waveform to this WAV file (mono, 32-bit float,
    /// at the talker's sample rate).
    #[arg(long)]
    pub audio_out: Option<PathBuf>,
    /// The talker's voice, a speaker the checkpoint names (default: ethan, HF's).
    #[arg(long)]
    pub speaker: Option<String>,
    /// The talker's softmax temperature; 0 = greedy (default 0.9, HF's).
    #[arg(long, allow_negative_numbers = true)]
    pub talker_temperature: Option<f32>,
    /// Talker steps at most, as transformers' `talker_max_new_tokens` counts them: a reply cut
    /// there has one frame fewer (default 4096).
    #[arg(long, allow_negative_numbers = true)]
    pub talker_max_tokens: Option<usize>,
}

impl SpeechArgs {
    /// Whether any flag asks for audio.
    pub fn wanted(&self) -> bool {
        self.audio_out.is_some()
            || self.speaker.is_some()
            || self.talker_temperature.is_some()
            || self.talker_max_tokens.is_some()
    }

    /// The speech options of every request, or `None` when no flag asks for audio; the talker's
    /// seed is `seed` (the thinker's `--seed`) when given. The engine checks the values.
    pub fn options(&self, seed: Option<u64>) -> Option<SpeechOptions> {
        if !self.wanted() {
            return None;
        }
        let SpeechOptions { speaker, talker, first_chunk, chunk } = SpeechOptions::default();
        let talker = TalkerSampling {
            temperature: self.talker_temperature.unwrap_or(talker.temperature),
            max_new_tokens: self.talker_max_tokens.unwrap_or(talker.max_new_tokens),
            seed: seed.unwrap_or(talker.seed),
            ..talker
        };
        Some(SpeechOptions { speaker: self.speaker.clone().unwrap_or(speaker), talker, first_chunk, chunk })
    }
}

/// A `--suppress-ids` value: the library's [`parse_id_ranges`] of one argument.
#[derive(Debug, Clone, Default)]
pub struct IdList(pub Vec<u32>);

impl IdList {
    fn parse(spec: &str) -> std::result::Result<Self, String> {
        parse_id_ranges(spec).map(IdList).map_err(|e| e.to_string())
    }
}

impl GenerateArgs {
    /// The sampling settings of every request (warm-ups included); the engine checks them.
    pub fn sampling(&self) -> SamplingParams {
        SamplingParams {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
            stop: self.stop.clone(),
            ignore_eos: self.ignore_eos,
            run_last_token: false,
            allow_special_ids: false,
            suppress_ids: self.suppress_ids.0.clone(),
        }
    }

    /// The chat of `--prompt` or `--messages`; `None` when the prompt is a request file.
    pub fn messages(&self) -> Result<Option<Messages>> {
        match (&self.prompt, &self.messages) {
            (Some(text), _) => Ok(Some(Messages::user(text))),
            (None, Some(path)) => Ok(Some(Messages::load(path)?)),
            (None, None) => Ok(None),
        }
    }
}

/// What `generate --json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct GenerateReport {
    /// The prompt's ids, when it was text (`--prompt`, `--messages`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_ids: Option<Vec<u32>>,
    pub tokens: Vec<u32>,
    /// The reply decoded without special tokens, when the prompt was text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    pub prompt_len: usize,
    pub num_cached_tokens: usize,
    pub finish_reason: FinishReason,
    /// The sampler's seed (the one drawn when `--seed` was not given); left
    /// out of greedy runs, which draw nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Submission to the first token.
    pub ttft_ms: f64,
    /// Median gap between consecutive tokens (`null` with one token).
    pub itl_ms_median: Option<f64>,
    /// Tokens after the first over the time from the first to the last (`null` with one token).
    pub decode_tokens_per_s: Option<f64>,
    pub total_ms: f64,
    /// The KV-event publisher's counters, with `--kv-events`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<PublisherStats>,
    /// The spoken reply's figures, when audio was asked for.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub audio: Option<AudioReport>,
}

/// What `generate --json` adds for a spoken reply.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AudioReport {
    /// Codec frames (the codes' columns).
    pub codec_frames: usize,
    /// Waveform samples (mono).
    pub audio_samples: usize,
    pub sample_rate: u32,
    /// Submission to the first audio sample (`null` when the reply made no audio).
    pub ttfa_ms: Option<f64>,
    /// Rows of the talker's prefill.
    pub talker_prompt_rows: usize,
    /// Prefill rows whose talker KV came from the cache.
    pub talker_cached_rows: usize,
    /// `stop` at the codec's end, `length` at `--talker-max-tokens`.
    pub talker_finish_reason: FinishReason,
}

impl AudioReport {
    /// The figures of `speech`, whose request's first audio came `ttfa` after submission.
    pub fn of(speech: &Speech, ttfa: Option<std::time::Duration>) -> Self {
        AudioReport {
            codec_frames: speech.codes.ncols(),
            audio_samples: speech.audio.len(),
            sample_rate: speech.sample_rate,
            ttfa_ms: ttfa.map(millis),
            talker_prompt_rows: speech.talker_prompt_rows,
            talker_cached_rows: speech.talker_cached_rows,
            talker_finish_reason: speech.finish,
        }
    }
}

impl GenerateReport {
    /// The figures of one generation sampled with `params`.
    pub fn of(g: &Output, params: &SamplingParams) -> Self {
        let itl: Vec<f64> = g.timings.itl().into_iter().map(millis).collect();
        let decoded = !itl.is_empty();
        GenerateReport {
            prompt_ids: None,
            tokens: g.tokens.clone(),
            text: None,
            prompt_len: g.prompt_len,
            num_cached_tokens: g.num_cached_tokens,
            finish_reason: g.finish_reason.unwrap_or(FinishReason::Length),
            seed: g.seed.filter(|_| params.temperature != 0.0),
            ttft_ms: millis(g.timings.ttft),
            itl_ms_median: decoded.then(|| median(itl)),
            decode_tokens_per_s: decoded.then(|| g.timings.decode_tokens_per_s()),
            total_ms: millis(g.timings.total),
            kv_events: None,
            audio: g.speech.as_ref().map(|s| AudioReport::of(s, g.timings.ttfa)),
        }
    }
}

/// Runs the command: the report to `out`, the hidden states to `--out`.
pub fn run(args: &GenerateArgs, out: &mut dyn Write) -> Result<()> {
    // Text becomes ids before the engine starts, so a bad tokenizer or template fails fast.
    let chat = match args.messages()? {
        Some(messages) => {
            let chat = Chat::from_dir(&args.engine.model)?;
            let ids = chat.prompt_ids(&messages)?;
            Some((chat, ids))
        }
        None => None,
    };
    let prompt = match &chat {
        Some((_, ids)) => Prompt::Ids(ids.clone()),
        None => Prompt::File(required_request(&args.engine)?.to_path_buf()),
    };
    let speech = args.speech.options(args.seed);
    let job = Generate { params: args.sampling(), speech: speech.clone(), prompt };
    let JobRun { reason, output: generation, kv_events } =
        on_selected_backend("generate", &args.engine, job)?;
    let spoken = match (&speech, &generation.speech) {
        (None, _) => None,
        (Some(_), Some(spoken)) => Some(spoken),
        (Some(_), None) => return Err(HarnessError::NoOutput { what: "the talker" }),
    };
    if let (Some(path), Some(spoken)) = (&args.speech.audio_out, spoken) {
        write_wav(path, spoken)?;
    }
    if let Some(path) = &args.out {
        let mut tensors = hidden_tensors(&generation.hidden);
        if let Some(spoken) = spoken {
            tensors.extend(speech_tensors(spoken));
        }
        write_tensors(tensors, path)?;
    }
    let mut report = GenerateReport { kv_events, ..GenerateReport::of(&generation, &args.sampling()) };
    if let Some((chat, ids)) = chat {
        report.text = Some(chat.decode(&report.tokens, true)?);
        report.prompt_ids = Some(ids);
    }
    if args.json {
        let json = serde_json::to_string(&report)
            .map_err(|source| HarnessError::Report { what: "the generate report".into(), source })?;
        return writeln!(out, "{json}").map_err(output);
    }
    writeln!(out, "backend: {reason}").map_err(output)?;
    if let Some(stats) = &report.kv_events {
        writeln!(out, "{}", fleet::summary(stats)).map_err(output)?;
    }
    writeln!(out, "prompt_len: {}", report.prompt_len).map_err(output)?;
    if let Some(ids) = &report.prompt_ids {
        writeln!(out, "prompt_ids: {ids:?}").map_err(output)?;
    }
    writeln!(out, "tokens: {:?}", report.tokens).map_err(output)?;
    if let Some(text) = &report.text {
        // JSON-quoted: one line, whatever newlines or control characters the reply holds.
        writeln!(out, "text: {}", Value::from(text.as_str())).map_err(output)?;
    }
    match report.seed {
        Some(seed) => writeln!(out, "finish_reason: {} (seed {seed})", report.finish_reason),
        None => writeln!(out, "finish_reason: {}", report.finish_reason),
    }
    .map_err(output)?;
    let itl = report.itl_ms_median.map_or("-".into(), |v| format!("{v:.2} ms"));
    let rate = report.decode_tokens_per_s.map_or("-".into(), |v| format!("{v:.1} tokens/s"));
    writeln!(out, "ttft: {:.2} ms, itl median: {itl}, decode: {rate}", report.ttft_ms).map_err(output)?;
    if let Some(audio) = &report.audio {
        let ttfa = audio.ttfa_ms.map_or("-".into(), |v| format!("{v:.2} ms"));
        let wav = args.speech.audio_out.as_ref().map_or(String::new(), |p| format!(" -> {}", p.display()));
        writeln!(
            out,
            "audio: {} frames, {} samples at {} Hz ({}){wav}",
            audio.codec_frames, audio.audio_samples, audio.sample_rate, audio.talker_finish_reason
        )
        .map_err(output)?;
        writeln!(
            out,
            "ttfa: {ttfa}, talker prompt rows: {}, cached: {}",
            audio.talker_prompt_rows, audio.talker_cached_rows
        )
        .map_err(output)?;
    }
    if args.out.is_some() {
        print_shapes(out, report.num_cached_tokens, &generation.hidden)
    } else {
        writeln!(out, "num_cached_tokens: {}", report.num_cached_tokens).map_err(output)
    }
}

/// What `generate` runs after the warm-ups.
enum Prompt {
    /// A request file (`--request`).
    File(PathBuf),
    /// Ids of a text prompt.
    Ids(Vec<u32>),
}

/// `generate`'s job: each warm-up request, then the request, generated (and spoken, with
/// `speech`) with the same settings.
struct Generate {
    params: SamplingParams,
    speech: Option<SpeechOptions>,
    prompt: Prompt,
}

/// `request` generating with `params`, spoken with `speech` when given.
fn with_task<'a>(
    request: Request<'a>, params: &SamplingParams, speech: &Option<SpeechOptions>,
) -> Request<'a> {
    let request = request.generate(params.clone());
    match speech {
        Some(options) => request.speak(options.clone()),
        None => request,
    }
}

/// Writes `speech`'s waveform to `path`: a mono WAV of IEEE-float 32-bit samples at its rate.
pub fn write_wav(path: &Path, speech: &Speech) -> Result<()> {
    let io = |e: hound::Error| match e {
        hound::Error::IoError(source) => IoError::write(path, source),
        other => IoError::write(path, std::io::Error::other(other)),
    };
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: speech.sample_rate,
        bits_per_sample: 32,
        sample_format: hound::SampleFormat::Float,
    };
    let mut wav = hound::WavWriter::create(path, spec).map_err(io)?;
    for &sample in &speech.audio {
        wav.write_sample(sample).map_err(io)?;
    }
    Ok(wav.finalize().map_err(io)?)
}

/// `codes` (i64 `[groups, frames]`) and `audio` (f32 `[samples]`) of a spoken reply.
fn speech_tensors(speech: &Speech) -> [Tensor; 2] {
    let codes: Vec<u8> = speech.codes.iter().flat_map(|&c| i64::from(c).to_le_bytes()).collect();
    let audio: Vec<u8> = speech.audio.iter().flat_map(|v| v.to_le_bytes()).collect();
    [
        Tensor {
            name: "codes".into(),
            dtype: Dtype::I64,
            shape: speech.codes.shape().to_vec(),
            bytes: codes,
        },
        Tensor { name: "audio".into(), dtype: Dtype::F32, shape: vec![speech.audio.len()], bytes: audio },
    ]
}

impl EngineJob for Generate {
    type Output = Output;

    fn run<B: Backend>(self, engine: &mut Engine<B>, args: &EngineArgs) -> Result<Output> {
        for warm in &args.warm {
            generate_file(engine, warm, &self.params, &self.speech)?;
        }
        match self.prompt {
            Prompt::File(path) => generate_file(engine, &path, &self.params, &self.speech),
            Prompt::Ids(ids) => Ok(engine.run(with_task(Request::text(ids), &self.params, &self.speech))?),
        }
    }
}

fn generate_file<B: Backend>(
    engine: &mut Engine<B>, path: &Path, params: &SamplingParams, speech: &Option<SpeechOptions>,
) -> Result<Output> {
    let file = RequestFile::load(path)?;
    Ok(engine.run(with_task(file.request(engine.tokens()), params, speech))?)
}
