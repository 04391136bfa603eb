//! The talker stage inside the engine's step loop: after each thinker step,
//! every speaking request whose talker can move takes one talker step, all of
//! them in one batched forward, and each frame goes through code2wav as it is
//! made. A talker starts once its reply's first token is sampled and is not the
//! reply's last (its prompt's last row), and decode step `s` waits for the reply's
//! token `s + 1` likewise (its trailing text row). HF's rows are the thinker's
//! input embeddings of every token that ran, i.e. all but the last sampled one;
//! a token's row is its embedding, so it is final as soon as the sampler says the
//! reply goes on, a thinker step before the token runs. The codes are HF's
//! whatever the interleaving. Talker KV lives in the talker's own pool, whose prefix
//! index ([`TalkerCache`]) lets a later round reuse every earlier user turn.
//!
//! First audio goes first: while a speaking request awaits its first audio and the
//! step had other work, a stream that already plays holds its due code2wav decodes
//! until its listener's audio runs out plus [`EngineConfig::audio_yield`](super::EngineConfig::audio_yield),
//! then decodes all it holds at once. The samples are the same whatever the chunks.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ndarray::Array2;
use prometheus_client::metrics::histogram::Histogram;

use super::output::{AudioEvent, Event, Output};
use crate::Result;
use crate::backend::{Backend, PagesSpec};
use crate::batch::RequestId;
use crate::canon::Fingerprinter;
use crate::index::PrefixIndex;
use crate::index::block_hash::FleetHasher;
use crate::index::radix::{RadixConfig, RadixIndex};
use crate::model::code2wav::{Code2Wav, Code2WavStream};
use crate::model::talker::{TalkerBlocks, TalkerSeq};
use crate::prompt::{CanonicalPrompt, OmniTokens};
use crate::runner::ModelRunner;
use crate::sample::FinishReason;
use crate::sched::{TalkerCache, TalkerCacheConfig, TalkerCacheStats, TalkerSlot, talker_key};
use crate::speech::{CheckedSpeech, Speech, SpeechStage};
use crate::tier::{TierStats, TierWriter};

/// The talker stage of an engine: the stage's models, the talker's pages and
/// prefix cache, and every speaking request's state.
pub(super) struct Talkers<B: Backend> {
    stage: Arc<SpeechStage<B>>,
    code2wav: Arc<Code2Wav<B>>,
    runner: ModelRunner<B>,
    pages: B::Pages,
    cache: TalkerCache,
    fingerprinter: Fingerprinter,
    tokens: OmniTokens,
    /// Ordered by id, so a step's batch is the same whatever the insertion order.
    talks: BTreeMap<RequestId, Talk<B>>,
    /// How long past its listener's audio a playing stream's decode may wait
    /// while another request awaits its first audio (`None`: never).
    audio_yield: Option<Duration>,
    /// The engine's tier load histogram, with a tier.
    tier_load_seconds: Option<Histogram>,
}

/// One speaking request.
struct Talk<B: Backend> {
    checked: CheckedSpeech,
    prompt: CanonicalPrompt,
    started: Instant,
    /// The assistant turn so far: the prompt's ids from its last assistant
    /// opening, then every reply token sampled.
    assistant: Vec<u32>,
    /// Leading ids of `assistant` that are talker rows: all but the reply's last
    /// token (which HF's thinker never runs), once it is known to be the last.
    settled: usize,
    /// The thinker's accept-layer rows of the prompt, once the prompt ran.
    accept: Option<Array2<f32>>,
    /// The thinker's output, held until the speech ends.
    output: Option<Output>,
    audio: Vec<f32>,
    first_audio: Option<Duration>,
    /// The reply's code2wav stream, from the talker's start until its last samples are out.
    stream: Option<Code2WavStream<Arc<Code2Wav<B>>, B>>,
    state: State,
}

impl<B: Backend> Talk<B> {
    /// The talker made its last frame (or had nothing to say).
    fn talker_done(&self) -> bool {
        matches!(self.state, State::Done { .. })
    }

    /// A decode is due: enough frames are pending for the next chunk, or the
    /// talker is done and whatever is pending is the rest of the audio.
    fn decode_is_due(&self) -> bool {
        self.stream.as_ref().is_some_and(|s| self.talker_done() || s.is_due())
    }

    /// Still before its first audio, with audio to come.
    fn awaits_first_audio(&self) -> bool {
        self.first_audio.is_none() && (self.stream.is_some() || !self.talker_done())
    }

    /// Its listener already hears it, and the audio out so far plays on until
    /// at least `allowance` before `now`: a decode for it may wait.
    fn may_yield(&self, now: Instant, allowance: Duration, sample_rate: u32) -> bool {
        self.first_audio.is_some_and(|first| {
            let heard = Duration::from_secs_f64(self.audio.len() as f64 / f64::from(sample_rate.max(1)));
            now < self.started + first + heard + allowance
        })
    }
}

enum State {
    /// Until the reply's first token settled (or the talker pool has room).
    Waiting,
    Running(Box<Running>),
    /// The talker finished (or there was nothing to say).
    Done {
        codes: Array2<u32>,
        finish: FinishReason,
        prompt_rows: usize,
        cached_rows: usize,
    },
}

struct Running {
    seq: TalkerSeq,
    slot: TalkerSlot,
    /// The prompt's full blocks went to the talker's index.
    committed: bool,
    /// Assistant ids `4..pushed` are trailing rows of the seq already.
    pushed: usize,
}

/// What one talker step did for one request.
struct Stepped {
    id: RequestId,
    frame: Option<Vec<u32>>,
}

impl<B: Backend> Talkers<B> {
    pub(super) fn new(
        stage: SpeechStage<B>, cache: TalkerCacheConfig, fingerprinter: Fingerprinter, tokens: OmniTokens,
        audio_yield: Option<Duration>,
    ) -> Result<Self> {
        // The cache first: it refuses a pool of 0 blocks or rows as a `ConfigError`,
        // before the pages are asked for them.
        let index: Box<dyn PrefixIndex> =
            Box::new(RadixIndex::new(RadixConfig { block_size: cache.block_size })?);
        let talker_cache = TalkerCache::new(cache, index)?;
        let backend = stage.backend();
        let runner = stage.talker().runner(&backend)?;
        let pages = runner.alloc_pages(cache.num_blocks, cache.block_size)?;
        let code2wav = stage.code2wav_shared();
        Ok(Talkers {
            stage: Arc::new(stage),
            code2wav,
            runner,
            pages,
            cache: talker_cache,
            fingerprinter,
            tokens,
            talks: BTreeMap::new(),
            audio_yield,
            tier_load_seconds: None,
        })
    }

    pub(super) fn stage(&self) -> &SpeechStage<B> {
        &self.stage
    }

    pub(super) fn cache_stats(&self) -> TalkerCacheStats {
        self.cache.stats()
    }

    /// The counters of the talker's tier files (`None` without a tier).
    pub(super) fn tier_stats(&self) -> Option<TierStats> {
        self.cache.tier().map(|w| w.stats())
    }

    /// The layout of the talker's pages (what its tier files hold).
    pub(super) fn pages_spec(&self) -> PagesSpec {
        self.runner.backend().pages_spec(&self.pages)
    }

    /// Puts the disk tier's talker store (`writer`) under the talker's pool;
    /// its block reads are timed into `load_seconds` (the engine's tier histogram).
    pub(super) fn attach_tier(
        &mut self, writer: Arc<TierWriter>, hasher: FleetHasher, load_seconds: Histogram,
    ) {
        self.cache.attach_tier(writer, hasher);
        self.tier_load_seconds = Some(load_seconds);
    }

    /// Writes every cached talker block no slot reads to the tier and waits
    /// for the writes (an engine's drop, a restart); nothing without a tier.
    pub(super) fn spill_to_tier(&mut self) -> Result<()> {
        if self.cache.tier().is_none() {
            return Ok(());
        }
        self.cache.evict(usize::MAX)?;
        move_tier_blocks(&mut self.cache, &self.runner, &mut self.pages, true, None)?;
        if let Some(writer) = self.cache.tier() {
            writer.flush();
        }
        Ok(())
    }

    /// A request that asked for audio was admitted.
    pub(super) fn add(
        &mut self, id: RequestId, checked: CheckedSpeech, prompt: CanonicalPrompt, started: Instant,
    ) {
        let start = checked.layout.assistant_start.min(prompt.token_ids.len());
        let assistant = prompt.token_ids[start..].to_vec();
        let talk = Talk {
            checked,
            prompt,
            started,
            settled: assistant.len(),
            assistant,
            accept: None,
            output: None,
            audio: Vec::new(),
            first_audio: None,
            stream: None,
            state: State::Waiting,
        };
        self.talks.insert(id, talk);
    }

    pub(super) fn contains(&self, id: RequestId) -> bool {
        self.talks.contains_key(&id)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.talks.is_empty()
    }

    /// True while `id` speaks and its prompt's accept rows have not arrived.
    pub(super) fn wants_prompt_rows(&self, id: RequestId) -> bool {
        self.talks.get(&id).is_some_and(|t| t.accept.is_none())
    }

    /// The thinker's rows of the prompt arrived: `rows` holds the accept layer's
    /// rows by position, at least at the prompt's item positions (the prompt's first output).
    pub(super) fn on_prompt_rows(&mut self, id: RequestId, mut rows: Array2<f32>) {
        if let Some(talk) = self.talks.get_mut(&id).filter(|t| t.accept.is_none()) {
            let n = talk.prompt.len().min(rows.nrows());
            rows.slice_collapse(ndarray::s![..n, ..]);
            talk.accept = Some(rows);
        }
    }

    /// The thinker sampled `token` for `id`; `last`: the reply ends with it.
    pub(super) fn on_token(&mut self, id: RequestId, token: u32, last: bool) {
        if let Some(talk) = self.talks.get_mut(&id) {
            talk.assistant.push(token);
            if !last {
                talk.settled = talk.assistant.len();
            }
        }
    }

    /// The thinker finished `id`: its output waits for the speech. `None` when
    /// `id` does not speak (the caller emits the output itself).
    pub(super) fn on_thinker_done(&mut self, output: Output) -> Option<Output> {
        match self.talks.get_mut(&output.request) {
            Some(talk) => {
                talk.output = Some(output);
                None
            }
            None => Some(output),
        }
    }

    /// Whether a talker step would make progress: some talk can start or step,
    /// has a decode due, or waits only for its finished thinker's output to go out.
    pub(super) fn has_work(&self) -> bool {
        self.talks.values().any(|t| {
            t.decode_is_due()
                || match &t.state {
                    State::Waiting => t.accept.is_some() && (t.settled >= 4 || t.output.is_some()),
                    State::Running(r) => r.seq.is_ready() || t.output.is_some(),
                    State::Done { .. } => t.output.is_some(),
                }
        })
    }

    /// Drops `id`'s talk (an abort): its talker blocks go back, none indexed
    /// unless its prompt had run.
    pub(super) fn abort(&mut self, id: RequestId) -> Result<()> {
        if let Some(talk) = self.talks.remove(&id)
            && let State::Running(run) = talk.state
        {
            self.cache.release(run.slot)?;
        }
        Ok(())
    }

    /// One talker step: starts the talks that can, hands each running one the
    /// reply rows that settled since, steps every ready one in one batch, hands
    /// their frames to code2wav, decodes the chunks due (first audio first), and
    /// finishes the talks that ended. `thinker_ran`: the step's thinker part ran.
    /// `first_audio` is told each request's time to first audio.
    pub(super) fn step(
        &mut self, events: &mut Vec<Event>, thinker_ran: bool, mut first_audio: impl FnMut(Duration),
    ) -> Result<()> {
        let ids: Vec<RequestId> = self.talks.keys().copied().collect();
        for &id in &ids {
            self.start_or_feed(id)?;
        }
        let talker_ran = self.step_ready()?;
        self.decode_due(events, thinker_ran || talker_ran, &mut first_audio)?;
        for id in ids {
            self.finish_if_done(id, events)?;
        }
        Ok(())
    }

    /// Starts `id`'s talker once its prompt's last row (the reply's first
    /// token) settled, or feeds a running one its new trailing rows.
    fn start_or_feed(&mut self, id: RequestId) -> Result<()> {
        let Some(talk) = self.talks.get_mut(&id) else { return Ok(()) };
        let thinker_done = talk.output.is_some();
        let settled = talk.settled;
        match &mut talk.state {
            State::Waiting => {
                let Some(accept) = &talk.accept else { return Ok(()) };
                if settled < 4 {
                    if thinker_done {
                        // The reply ended with its first token: nothing to say.
                        let groups = self.stage.talker().config().num_code_groups;
                        talk.state = State::Done {
                            codes: Array2::zeros((groups, 0)),
                            finish: FinishReason::Stop,
                            prompt_rows: 0,
                            cached_rows: 0,
                        };
                    }
                    return Ok(());
                }
                let c = &talk.checked;
                let inputs = self.stage.prompt_inputs(
                    &c.layout,
                    &talk.prompt.token_ids,
                    &talk.assistant,
                    accept.view(),
                    c.speaker_id,
                )?;
                let key =
                    talker_key(&c.layout, &talk.prompt, accept.view(), &self.fingerprinter, &self.tokens)?;
                let total = inputs.embeds.nrows() + c.options.talker.max_new_tokens - 1;
                let Some(slot) = self.cache.begin(key, total)? else { return Ok(()) };
                // Blocks the match evicted go out, blocks it read from the tier come in,
                // before the talker writes or reads any of them.
                let loads = self.tier_load_seconds.as_ref();
                if let Err(e) = move_tier_blocks(&mut self.cache, &self.runner, &mut self.pages, false, loads)
                {
                    self.cache.release(slot)?;
                    return Err(e);
                }
                let blocks =
                    TalkerBlocks { block_table: slot.block_table().clone(), num_cached: slot.num_cached() };
                let config = self.stage.talker().config();
                let seq = match TalkerSeq::new(config, id, inputs, &c.options.talker, blocks) {
                    Ok(seq) => seq,
                    Err(e) => {
                        self.cache.release(slot)?;
                        return Err(e);
                    }
                };
                let stream = match Code2WavStream::new(
                    Arc::clone(&self.code2wav),
                    c.options.first_chunk,
                    c.options.chunk,
                ) {
                    Ok(stream) => stream,
                    Err(e) => {
                        self.cache.release(slot)?;
                        return Err(e);
                    }
                };
                talk.stream = Some(stream);
                talk.state = State::Running(Box::new(Running { seq, slot, committed: false, pushed: 4 }));
                // The rows that already settled become trailing rows right away.
                self.start_or_feed(id)
            }
            State::Running(run) => {
                if settled > run.pushed {
                    let rows = self.stage.text_rows(&talk.assistant[run.pushed..settled])?;
                    run.seq.push_trailing(rows.view())?;
                    run.pushed = settled;
                }
                if thinker_done && !run.seq.trailing_finished() {
                    run.seq.push_trailing(self.stage.tts_eos_row()?.view())?;
                    run.seq.finish_trailing();
                }
                Ok(())
            }
            State::Done { .. } => Ok(()),
        }
    }

    /// One batched talker forward over every ready seq; each frame goes to its
    /// request's code2wav stream. Whether a forward ran.
    fn step_ready(&mut self) -> Result<bool> {
        let backend = self.stage.backend();
        let mut ready: Vec<(RequestId, &mut TalkerSeq)> = self
            .talks
            .iter_mut()
            .filter_map(|(&id, t)| match &mut t.state {
                State::Running(run) if run.seq.is_ready() => Some((id, &mut run.seq)),
                _ => None,
            })
            .collect();
        if ready.is_empty() {
            return Ok(false);
        }
        let ids: Vec<RequestId> = ready.iter().map(|(id, _)| *id).collect();
        let mut seqs: Vec<&mut TalkerSeq> = ready.iter_mut().map(|(_, seq)| &mut **seq).collect();
        let frames = self.stage.talker().step(&backend, &self.runner, &mut self.pages, &mut seqs)?;
        let stepped: Vec<Stepped> =
            ids.into_iter().zip(frames).map(|(id, frame)| Stepped { id, frame }).collect();
        for Stepped { id, frame } in stepped {
            let Some(talk) = self.talks.get_mut(&id) else { continue };
            let State::Running(run) = &mut talk.state else { continue };
            if !run.committed && run.seq.prompt_done() {
                // Index the prompt's full blocks; the index may hand back its own copy of one.
                self.cache.commit(&mut run.slot)?;
                run.seq.set_block_table(run.slot.block_table().clone());
                run.committed = true;
            }
            let stream = talk.stream.as_mut().ok_or_else(|| {
                crate::error::Component::Engine
                    .violation(format!("request {id}: a running talker has no stream"))
            })?;
            if let Some(codes) = frame {
                let column = Array2::from_shape_fn((codes.len(), 1), |(q, _)| i64::from(codes[q]));
                stream.append(column.view())?;
            }
            if run.seq.is_finished() {
                // Done from here on: whatever the stream holds is due.
                let State::Running(run) = std::mem::replace(&mut talk.state, State::Waiting) else {
                    continue;
                };
                let Running { seq, slot, .. } = *run;
                let (prompt_rows, cached_rows) = (seq.prompt_rows(), slot.num_cached());
                self.cache.release(slot)?;
                let out = seq.into_output().ok_or_else(|| {
                    crate::error::Component::Engine
                        .violation(format!("request {id}: a finished talker has no output"))
                })?;
                talk.state = State::Done { codes: out.codes, finish: out.finish, prompt_rows, cached_rows };
            }
        }
        Ok(true)
    }

    /// Decodes every stream's due chunk, first audio first: while another
    /// request awaits its first audio and the step had other work (`busy`), a
    /// stream its listener still hears (past [`Talk::may_yield`]'s allowance)
    /// waits. Without other work, waiting would only idle the engine.
    fn decode_due(
        &mut self, events: &mut Vec<Event>, busy: bool, first_audio: &mut impl FnMut(Duration),
    ) -> Result<()> {
        let backend = self.stage.backend();
        let rate = self.code2wav.sample_rate();
        let now = Instant::now();
        let allowance =
            self.audio_yield.filter(|_| busy && self.talks.values().any(Talk::awaits_first_audio));
        for (&id, talk) in &mut self.talks {
            if !talk.decode_is_due() || allowance.is_some_and(|a| talk.may_yield(now, a, rate)) {
                continue;
            }
            let chunk = if talk.talker_done() {
                // The last decode: the stream goes with it.
                talk.stream.take().map(|s| s.finish(&*backend)).transpose()?.unwrap_or_default()
            } else {
                talk.stream.as_mut().map(|s| s.decode_if_due(&*backend)).transpose()?.unwrap_or_default()
            };
            if chunk.is_empty() {
                continue;
            }
            if talk.first_audio.is_none() {
                let ttfa = talk.started.elapsed();
                talk.first_audio = Some(ttfa);
                first_audio(ttfa);
            }
            events.push(Event::Audio(AudioEvent {
                request: id,
                offset: talk.audio.len(),
                samples: chunk.clone(),
                sample_rate: rate,
            }));
            talk.audio.extend(chunk);
        }
        Ok(())
    }

    /// Emits `id`'s output, its speech attached, once both stages are done.
    fn finish_if_done(&mut self, id: RequestId, events: &mut Vec<Event>) -> Result<()> {
        let done =
            self.talks.get(&id).is_some_and(|t| t.output.is_some() && t.stream.is_none() && t.talker_done());
        if !done {
            return Ok(());
        }
        let Some(talk) = self.talks.remove(&id) else { return Ok(()) };
        let (State::Done { codes, finish, prompt_rows, cached_rows }, Some(mut output)) =
            (talk.state, talk.output)
        else {
            return Ok(());
        };
        output.timings.ttfa = talk.first_audio;
        output.timings.total = talk.started.elapsed();
        output.speech = Some(Speech {
            codes,
            audio: talk.audio,
            sample_rate: self.code2wav.sample_rate(),
            talker_prompt_rows: prompt_rows,
            talker_cached_rows: cached_rows,
            finish,
            first_audio: talk.first_audio,
        });
        events.push(Event::Finished(output));
        Ok(())
    }
}

/// The talker cache's tier work on the talker's pages: evicted blocks out,
/// then blocks read from the tier in (see [`super::tier::move_blocks`]), each
/// read's time into `load_seconds`.
fn move_tier_blocks<B: Backend>(
    cache: &mut TalkerCache, runner: &ModelRunner<B>, pages: &mut B::Pages, spill: bool,
    load_seconds: Option<&Histogram>,
) -> Result<()> {
    let Some(writer) = cache.tier().cloned() else { return Ok(()) };
    let work = cache.take_tier_work();
    super::tier::move_blocks(runner.backend(), pages, None, &writer, work, spill, load_seconds)
}
