//! Drives one engine through one run: submit what the [`Dispatcher`] says is
//! due, `step`, timestamp the tokens each step returns, feed finished replies
//! back into their conversation, until every stream is done.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fxhash::FxHashMap;

use omniprefix::backend::Backend;
use omniprefix::batch::RequestId;
use omniprefix::canon::Modality;
use omniprefix::engine::{Engine, EngineConfig, Event, Request};
use omniprefix::error::Component;
use omniprefix::model::Thinker;
use omniprefix::prompt::{OmniTokens, TenantSalt};
use omniprefix::sample::SamplingParams;

use super::{Arrival, Dispatcher, RequestSample, RunFacts, ServeOptions, ServeReport, ServeWorkload};
use crate::error::Result;
use crate::ttft::{Media, map_ids, text_id_limit};
use crate::workloads::{ChatTurn, conversation_turns, prefix_repetition_prompts, reply_for_history};

/// Requests that run in order (a conversation's rounds), all of one tenant.
#[derive(Debug, Clone)]
struct Stream {
    tenant: TenantSalt,
    turns: Vec<ChatTurn>,
}

/// Runs every workload × arrival, caching on then off, on `thinker` (whose special ids are `tokens`).
pub fn run_serve<B: Backend>(
    backend: Arc<B>,
    thinker: Arc<Thinker<B>>,
    tokens: OmniTokens,
    options: &ServeOptions,
) -> Result<Vec<ServeReport>> {
    let media = Media::new(options.mm_scale, thinker.config().hidden_size, options.seed)?;
    let bench = Serve { backend, thinker, tokens, media, options };
    let mut reports = Vec::new();
    for &workload in &options.workloads {
        let streams = bench.streams(workload)?;
        for &arrival in &options.arrivals {
            for cache in [true, false] {
                reports.push(bench.run(workload, &streams, arrival, cache)?);
            }
        }
    }
    Ok(reports)
}

struct Serve<'a, B: Backend> {
    backend: Arc<B>,
    thinker: Arc<Thinker<B>>,
    tokens: OmniTokens,
    media: Media,
    options: &'a ServeOptions,
}

/// A request in flight.
struct Live {
    stream: usize,
    arrived: Instant,
    last_token: Option<Instant>,
    sample: RequestSample,
}

impl<B: Backend> Serve<'_, B> {
    fn streams(&self, workload: ServeWorkload) -> Result<Vec<Stream>> {
        let o = self.options;
        let vocab = self.thinker.config().vocab_size;
        Ok(match workload {
            ServeWorkload::PrefixRepetition => {
                let limit = text_id_limit(&self.tokens, vocab);
                let prompts = o.num_prefixes * o.prompts_per_prefix;
                prefix_repetition_prompts(prompts, o.num_prefixes, o.prefix_len, o.suffix_len, limit, o.seed)
                    .into_iter()
                    .map(|token_ids| Stream { tenant: 0, turns: vec![ChatTurn { token_ids, new_items: Vec::new() }] })
                    .collect()
            }
            ServeWorkload::MultiRound => {
                let turns: Vec<ChatTurn> = conversation_turns()?
                    .into_iter()
                    .map(|t| ChatTurn { token_ids: map_ids(&t.token_ids, &self.tokens, vocab), ..t })
                    .collect();
                // One tenant per conversation: each reuses only its own history.
                (0..o.conversations).map(|c| Stream { tenant: c as TenantSalt + 1, turns: turns.clone() }).collect()
            }
        })
    }

    /// Tokens of `stream`'s last round: every turn, its items' rows and every reply.
    fn longest(&self, stream: &Stream) -> Result<usize> {
        let mut len = stream.turns.len() * self.options.output_len;
        for turn in &stream.turns {
            len += turn.token_ids.len();
            for &m in &turn.new_items {
                len += self.media.get(m)?.tokens.saturating_sub(1);
            }
        }
        Ok(len)
    }

    fn engine(&self, streams: &[Stream], arrival: Arrival, cache: bool) -> Result<Engine<B>> {
        let o = self.options;
        let longest = streams.iter().map(|s| self.longest(s)).try_fold(0, |m, l| l.map(|l| m.max(l)))?;
        let in_flight = match arrival {
            Arrival::Concurrency(c) => c.min(streams.len()),
            Arrival::Poisson { .. } => streams.len(),
        };
        // Every sequence in flight twice over (copy-on-write, reply blocks) plus the shared prefixes.
        let num_blocks = (2 * in_flight + o.num_prefixes) * longest.div_ceil(o.block_size) + 64;
        let config = EngineConfig {
            block_size: o.block_size,
            num_blocks,
            capture: Some(Vec::new()),
            cache,
            max_seqs_per_step: o.max_seqs,
            tokens: Some(self.tokens.clone()),
            kv_dtype: o.kv_dtype,
            fingerprint_key: o.fingerprint_key.clone(),
            kv_events: o.kv_events.clone(),
            ..Default::default()
        };
        let mut engine = Engine::new(Arc::clone(&self.backend), Arc::clone(&self.thinker), config)?;
        // Untimed: thread pools and allocator warm up before the clock runs.
        let warm = Request { tenant: TenantSalt::MAX / 2, ..Request::text(vec![1; 32]) };
        engine.run(warm.generate(SamplingParams { ignore_eos: true, ..SamplingParams::greedy(2) }))?;
        Ok(engine)
    }

    fn run(&self, workload: ServeWorkload, streams: &[Stream], arrival: Arrival, cache: bool) -> Result<ServeReport> {
        let o = self.options;
        let mut engine = self.engine(streams, arrival, cache)?;
        let rounds: Vec<usize> = streams.iter().map(|s| s.turns.len()).collect();
        let mut dispatcher = Dispatcher::new(arrival, &rounds, o.seed);
        let mut history: Vec<(Vec<u32>, Vec<Modality>)> = vec![Default::default(); streams.len()];
        let mut live: FxHashMap<RequestId, Live> = FxHashMap::default();
        let mut samples = Vec::new();
        let start = Instant::now();
        let mut end = start;
        loop {
            for due in dispatcher.due(start.elapsed()) {
                let (stream, turn) = (&streams[due.stream], &streams[due.stream].turns[due.round]);
                let (ids, items) = &mut history[due.stream];
                ids.extend(&turn.token_ids);
                items.extend(&turn.new_items);
                let items = items.iter().map(|&m| Ok(self.media.get(m)?.input())).collect::<Result<_>>()?;
                let request = Request { tenant: stream.tenant, token_ids: ids.clone(), items, ..Default::default() };
                // vllm bench serve's default: fixed output lengths.
                let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(o.output_len) };
                let id = engine.submit(request.generate(params))?;
                let sample = RequestSample::default();
                live.insert(id, Live { stream: due.stream, arrived: start + due.arrived, last_token: None, sample });
            }
            if !engine.has_pending() {
                if dispatcher.done() {
                    break;
                }
                let Some(next) = dispatcher.next_arrival() else {
                    let what = format!("bench serve: {} requests in flight, none pending in the engine", live.len());
                    return Err(Component::Scheduler.violation(what).into());
                };
                std::thread::sleep((start + next).saturating_duration_since(Instant::now()));
                continue;
            }
            let events = engine.step()?;
            let now = Instant::now();
            for event in events {
                match event {
                    Event::Token(token) => {
                        if let Some(l) = live.get_mut(&token.request) {
                            match l.last_token {
                                None => l.sample.ttft = now.saturating_duration_since(l.arrived),
                                Some(last) => l.sample.itl.push(now - last),
                            }
                            l.last_token = Some(now);
                        }
                    }
                    Event::Finished(g) => {
                        if let Some(mut l) = live.remove(&g.request) {
                            l.sample.prompt_tokens = g.prompt_len;
                            l.sample.cached_tokens = g.num_cached_tokens;
                            l.sample.output_tokens = g.tokens.len();
                            history[l.stream].0.extend(reply_for_history(&g.tokens, &self.tokens));
                            dispatcher.finished(l.stream);
                            samples.push(l.sample);
                            end = now;
                        }
                    }
                }
            }
        }
        let facts = RunFacts {
            workload: workload.as_str(),
            backend: self.backend.name(),
            cache,
            arrival,
            duration: end.saturating_duration_since(start).max(Duration::from_nanos(1)),
        };
        let kv_events = engine.close_kv_events();
        Ok(ServeReport { kv_events, ..ServeReport::new(facts, &samples) })
    }
}
