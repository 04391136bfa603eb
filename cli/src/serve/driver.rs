//! Drives one engine through one run. The engine steps on its own thread (a
//! [`ServedEngine`]); this thread submits nothing itself: for each request the
//! [`Dispatcher`] says is due it starts a caller thread, which prepares and
//! submits the request (fingerprints and encoder calls on that thread, outside
//! the loop), reads its stream, timestamps each token as it arrives, and hands
//! the finished reply back here to extend its conversation.
//!
//! Items go without embeddings: a stand-in encoder returns the media's rows,
//! after `--encoder-ms` of sleep, for each item that misses the engine's
//! encoder cache. The calls are counted.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use ndarray::Array2;

use omniprefix::backend::Backend;
use omniprefix::canon::{ItemIdentity, Modality};
use omniprefix::engine::{Engine, EngineConfig, Event, ItemInput, Request, ServedEngine, ServedOptions};
use omniprefix::error::Component;
use omniprefix::events::PublisherStats;
use omniprefix::model::Thinker;
use omniprefix::prompt::{OmniTokens, TenantSalt};
use omniprefix::sample::SamplingParams;

use super::{
    Arrival, Dispatcher, RequestSample, RunFacts, ServeOptions, ServeReport, ServeWorkload, itl_trace,
};
use crate::error::Result;
use crate::ttft::{Media, map_ids, text_id_limit};
use crate::workloads::{
    ChatTurn, client_turns, conversation_turns, prefix_repetition_prompts, reply_for_history,
};
use omniprefix::sched::{PrefillCap, SchedulerConfig};

/// Requests that run in order (a conversation's rounds), all of one tenant.
#[derive(Debug, Clone)]
pub(super) struct Stream {
    pub(super) tenant: TenantSalt,
    pub(super) turns: Vec<ChatTurn>,
}

/// A conversation's history so far: its ids (replies included) and its items.
pub(super) type History = (Vec<u32>, Vec<Modality>);

/// What one [`Serve::drive`] hands back: each finished request's round and
/// sample, the stand-in encoder's calls, and when the last token came.
pub(super) struct Driven {
    pub(super) samples: Vec<(usize, RequestSample)>,
    pub(super) encoder_calls: u64,
    pub(super) start: Instant,
    pub(super) end: Instant,
}

/// Runs every workload × arrival, caching on then off, on `thinker` (whose special ids are `tokens`).
pub fn run_serve<B: Backend + 'static>(
    backend: Arc<B>, thinker: Arc<Thinker<B>>, tokens: OmniTokens, options: &ServeOptions,
) -> Result<Vec<ServeReport>> {
    let media = Media::new(options.mm_scale, thinker.config().hidden_size, options.seed)?;
    let bench = Serve { backend, thinker, tokens, media, options };
    let mut reports = Vec::new();
    for &workload in &options.workloads {
        let streams = bench.streams(workload)?;
        if workload == ServeWorkload::ManyClients {
            reports.extend(bench.many_clients(&streams)?);
            continue;
        }
        for &arrival in &options.arrivals {
            for cache in [true, false] {
                reports.push(bench.run(workload, &streams, arrival, cache)?);
            }
        }
    }
    Ok(reports)
}

/// The model, media and options every run of one `bench serve` shares.
pub(super) struct Serve<'a, B: Backend> {
    pub(super) backend: Arc<B>,
    thinker: Arc<Thinker<B>>,
    tokens: OmniTokens,
    media: Media,
    pub(super) options: &'a ServeOptions,
}

impl<B: Backend + 'static> Serve<'_, B> {
    fn streams(&self, workload: ServeWorkload) -> Result<Vec<Stream>> {
        let o = self.options;
        let vocab = self.thinker.config().vocab_size;
        Ok(match workload {
            ServeWorkload::PrefixRepetition => {
                let limit = text_id_limit(&self.tokens, vocab);
                let prompts = o.num_prefixes * o.prompts_per_prefix;
                prefix_repetition_prompts(prompts, o.num_prefixes, o.prefix_len, o.suffix_len, limit, o.seed)
                    .into_iter()
                    .map(|token_ids| Stream {
                        tenant: 0,
                        turns: vec![ChatTurn { token_ids, new_items: Vec::new() }],
                    })
                    .collect()
            }
            ServeWorkload::MultiRound => self.conversations(conversation_turns()?, o.conversations),
            ServeWorkload::ManyClients => self.conversations(client_turns(o.client_rounds)?, o.clients),
        })
    }

    /// `count` conversations of `turns` (ids mapped to the model's vocabulary),
    /// one tenant each: each reuses only its own history.
    fn conversations(&self, turns: Vec<ChatTurn>, count: usize) -> Vec<Stream> {
        let vocab = self.thinker.config().vocab_size;
        let turns: Vec<ChatTurn> = turns
            .into_iter()
            .map(|t| ChatTurn { token_ids: map_ids(&t.token_ids, &self.tokens, vocab), ..t })
            .collect();
        (0..count).map(|c| Stream { tenant: c as TenantSalt + 1, turns: turns.clone() }).collect()
    }

    /// Tokens of `stream`'s last round: every turn, its items' rows and every reply.
    pub(super) fn longest(&self, stream: &Stream) -> Result<usize> {
        let mut len = stream.turns.len() * self.options.output_len;
        for turn in &stream.turns {
            len += turn.token_ids.len();
            for &m in &turn.new_items {
                len += self.media.get(m)?.tokens.saturating_sub(1);
            }
        }
        Ok(len)
    }

    /// Blocks for a caching on/off run: every sequence in flight twice over
    /// (copy-on-write, reply blocks) plus the shared prefixes, so nothing is evicted early.
    fn serve_blocks(&self, streams: &[Stream], arrival: Arrival) -> Result<usize> {
        let o = self.options;
        let longest = streams.iter().map(|s| self.longest(s)).try_fold(0, |m, l| l.map(|l| m.max(l)))?;
        let in_flight = match arrival {
            Arrival::Concurrency(c) => c.min(streams.len()),
            Arrival::Poisson { .. } => streams.len(),
        };
        Ok((2 * in_flight + o.num_prefixes) * longest.div_ceil(o.block_size) + 64)
    }

    /// The engine settings every run shares, with a pool of `num_blocks` and caching `cache`.
    pub(super) fn config(&self, num_blocks: usize, cache: bool) -> EngineConfig {
        let o = self.options;
        EngineConfig {
            scheduler: SchedulerConfig {
                block_size: o.block_size,
                num_blocks,
                max_seqs_per_step: o.max_seqs,
                max_tokens_per_step: o.max_tokens_per_step,
                prefill_cap: o.prefill_cap.map_or(PrefillCap::Auto, PrefillCap::Tokens),
                ..Default::default()
            },
            capture: Some(Vec::new()),
            cache,
            tokens: Some(self.tokens.clone()),
            kv_dtype: o.kv_dtype,
            fingerprint_key: o.fingerprint_key.clone(),
            kv_events: o.kv_events.clone(),
            ..Default::default()
        }
    }

    /// An engine of `config`, serving, after an untimed warm-up request.
    pub(super) fn serve(&self, config: EngineConfig) -> Result<ServedEngine> {
        let mut engine = Engine::new(Arc::clone(&self.backend), Arc::clone(&self.thinker), config)?;
        if let Some((endpoint, replay)) = engine.kv_events_endpoints() {
            crate::cli::fleet::announce(endpoint, replay);
        }
        // Untimed: thread pools and allocator warm up before the clock runs.
        let warm = Request { tenant: TenantSalt::MAX / 2, ..Request::text(vec![1; 32]) };
        engine.run(warm.generate(SamplingParams { ignore_eos: true, ..SamplingParams::greedy(2) }))?;
        Ok(engine.serve(ServedOptions::default())?)
    }

    fn run(
        &self, workload: ServeWorkload, streams: &[Stream], arrival: Arrival, cache: bool,
    ) -> Result<ServeReport> {
        let served = self.serve(self.config(self.serve_blocks(streams, arrival)?, cache))?;
        let mut history = vec![History::default(); streams.len()];
        let driven = self.drive(&served, streams, arrival, 0..usize::MAX, &mut history)?;
        let samples: Vec<RequestSample> = driven.samples.iter().map(|(_, s)| s.clone()).collect();
        let name = workload.to_string();
        let duration = driven.end.saturating_duration_since(driven.start);
        let facts = self.facts(&name, &served, cache, arrival, duration, driven.encoder_calls);
        let kv_events = drained_kv_events(&served)?;
        let trace = self.options.trace.then(|| itl_trace(&samples));
        Ok(ServeReport { kv_events, itl_trace: trace, ..ServeReport::new(facts, &samples) })
    }

    /// The settings and totals a report of a run on `served` names: it took
    /// `duration` (first arrival to last token) and called the encoder `encoder_calls` times.
    pub(super) fn facts<'w>(
        &self, workload: &'w str, served: &ServedEngine, cache: bool, arrival: Arrival, duration: Duration,
        encoder_calls: u64,
    ) -> RunFacts<'w> {
        let sched = served.config().scheduler;
        RunFacts {
            workload,
            backend: self.backend.name(),
            cache,
            arrival,
            max_tokens_per_step: sched.max_tokens_per_step,
            prefill_cap: sched.prefill_cap_tokens().unwrap_or(sched.max_tokens_per_step),
            long_prefills_per_step: sched.long_prefills_per_step(),
            duration: duration.max(Duration::from_nanos(1)),
            encoder_ms: self.options.encoder_ms,
            encoder_calls,
        }
    }

    /// Sends the turns of `rounds` (indices, clipped to each stream's) of every
    /// stream to `served` as `arrival` says, each round after its stream's
    /// previous one, extending `history` with each turn and reply; returns when
    /// all finished. One call runs a whole caching on/off run, or one round of
    /// `many_clients` (so its rounds, and a restart between two, have clear edges).
    pub(super) fn drive(
        &self, served: &ServedEngine, streams: &[Stream], arrival: Arrival, rounds: Range<usize>,
        history: &mut [History],
    ) -> Result<Driven> {
        let o = self.options;
        let counts: Vec<usize> =
            streams.iter().map(|s| s.turns.len().min(rounds.end).saturating_sub(rounds.start)).collect();
        let mut dispatcher = Dispatcher::new(arrival, &counts, o.seed);
        let caller = Caller {
            served,
            media: &self.media,
            output_len: o.output_len,
            encoder_delay: Duration::from_millis(o.encoder_ms),
            encoder_calls: AtomicU64::new(0),
        };
        let (finished, done) = mpsc::channel::<Result<Done>>();
        let mut samples = Vec::new();
        let start = Instant::now();
        let mut end = start;
        std::thread::scope(|scope| -> Result<()> {
            let mut in_flight = 0usize;
            loop {
                for due in dispatcher.due(start.elapsed()) {
                    let stream = &streams[due.stream];
                    let round = rounds.start + due.round;
                    let (ids, items) = &mut history[due.stream];
                    ids.extend(&stream.turns[round].token_ids);
                    items.extend(&stream.turns[round].new_items);
                    let job = Job {
                        stream: due.stream,
                        round,
                        tenant: stream.tenant,
                        token_ids: ids.clone(),
                        items: items.clone(),
                        arrived: start + due.arrived,
                        run_start: start,
                    };
                    let (caller, finished) = (&caller, finished.clone());
                    // One caller thread per request in flight: it prepares the request
                    // (fingerprints, encoder calls) and reads its stream, as a client would.
                    // A send fails only when the run already ended on an error.
                    scope.spawn(move || {
                        let _ = finished.send(caller.request(job));
                    });
                    in_flight += 1;
                }
                if dispatcher.done() {
                    return Ok(());
                }
                // Sleep until a request finishes or, if sooner, the next Poisson arrival.
                let now = Instant::now();
                let next = dispatcher
                    .next_arrival()
                    .map(|t| (start + t).saturating_duration_since(now))
                    .filter(|w| !w.is_zero());
                let message = match next {
                    Some(wait) => match done.recv_timeout(wait) {
                        Ok(message) => message,
                        Err(_) => continue,
                    },
                    None if in_flight == 0 => {
                        let what =
                            "bench serve: nothing in flight and no arrival to come, yet requests remain";
                        return Err(Component::Scheduler.violation(what).into());
                    }
                    None => done.recv().map_err(|_| {
                        Component::Scheduler.violation("bench serve: a caller thread vanished")
                    })?,
                };
                let d = message?;
                in_flight -= 1;
                history[d.stream].0.extend(reply_for_history(&d.reply, &self.tokens));
                dispatcher.finished(d.stream);
                samples.push((d.round, d.sample));
                end = end.max(d.at);
            }
        })?;
        Ok(Driven { samples, encoder_calls: caller.encoder_calls.load(Ordering::Relaxed), start, end })
    }
}

/// The publisher's counters once it sent (or dropped) every batch handed to
/// it: `published + dropped = batches`, as `Engine::close_kv_events` reports.
/// The loop publishes once per step, so after the last step only the queue drains.
fn drained_kv_events(served: &ServedEngine) -> Result<Option<PublisherStats>> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stats = served.kv_events_stats()?;
        match &stats {
            Some(s) if s.published + s.dropped < s.batches && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1));
            }
            _ => return Ok(stats),
        }
    }
}

/// One request for a caller thread: `stream`'s next round, its whole history.
struct Job {
    stream: usize,
    /// Which turn of the stream it sends (its history up to that turn).
    round: usize,
    tenant: TenantSalt,
    token_ids: Vec<u32>,
    items: Vec<Modality>,
    arrived: Instant,
    /// When the run started (token times in the trace count from here).
    run_start: Instant,
}

/// What a caller thread hands back when its request finished.
struct Done {
    stream: usize,
    round: usize,
    reply: Vec<u32>,
    sample: RequestSample,
    /// When the last event arrived.
    at: Instant,
}

/// What every caller thread shares: the served engine, the media and the stand-in encoder's settings.
struct Caller<'a> {
    served: &'a ServedEngine,
    media: &'a Media,
    output_len: usize,
    /// The stand-in encoder's cost per item it encodes (an encoder-cache miss).
    encoder_delay: Duration,
    encoder_calls: AtomicU64,
}

impl Caller<'_> {
    /// Submits `job` on this thread (preparation, encoder calls included, runs
    /// here, outside the engine's loop), then times its tokens as they arrive.
    fn request(&self, job: Job) -> Result<Done> {
        let media = job.items.iter().map(|&m| self.media.get(m)).collect::<Result<Vec<_>>>()?;
        // Items come without embeddings: an encoder-cache miss calls the stand-in encoder.
        let items = media.iter().map(|m| ItemInput { embeddings: None, ..m.input() }).collect();
        let rows: Vec<Arc<Array2<f32>>> = media.iter().map(|m| m.embeddings()).collect();
        let encoder = move |item: usize, _: &ItemIdentity| -> omniprefix::error::Result<Array2<f32>> {
            self.encoder_calls.fetch_add(1, Ordering::Relaxed);
            if !self.encoder_delay.is_zero() {
                std::thread::sleep(self.encoder_delay);
            }
            Ok(rows[item].as_ref().clone())
        };
        // vllm bench serve's default: fixed output lengths.
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(self.output_len) };
        let request = Request { tenant: job.tenant, token_ids: job.token_ids, items, ..Default::default() };
        let mut handle = self.served.submit(request.generate(params).with_encoder(encoder))?;
        let mut sample = RequestSample::default();
        let mut last_token: Option<Instant> = None;
        while let Some(event) = handle.recv() {
            let now = Instant::now();
            match event? {
                Event::Token(_) => {
                    match last_token {
                        None => sample.ttft = now.saturating_duration_since(job.arrived),
                        Some(last) => {
                            sample.itl.push(now - last);
                            sample.itl_at.push(now.saturating_duration_since(job.run_start));
                        }
                    }
                    last_token = Some(now);
                }
                // This driver asks for no audio.
                Event::Audio(_) => {}
                Event::Finished(out) => {
                    sample.prompt_tokens = out.prompt_len;
                    sample.cached_tokens = out.num_cached_tokens;
                    sample.output_tokens = out.tokens.len();
                    return Ok(Done {
                        stream: job.stream,
                        round: job.round,
                        reply: out.tokens,
                        sample,
                        at: now,
                    });
                }
            }
        }
        let what = format!("bench serve: request {} ended without finishing", handle.id());
        Err(Component::Engine.violation(what).into())
    }
}
