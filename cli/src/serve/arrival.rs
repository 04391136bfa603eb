//! When `bench serve` submits each request: a seeded Poisson process (open
//! loop, `--rate`) or a fixed number in flight (closed loop, `--concurrency`),
//! over streams of requests that must run in order (a conversation's rounds).
//!
//! Pure bookkeeping against a clock the caller passes in, so the driver checks
//! it between engine steps and tests check it without an engine.

use std::fmt;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrival {
    /// A stream's first request arrives by a seeded Poisson process at `rate`
    /// requests per second; nothing bounds how many are in flight.
    Poisson { rate: f64 },
    /// At most this many requests in flight; the next starts when one finishes.
    Concurrency(usize),
}

impl fmt::Display for Arrival {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Arrival::Poisson { rate } => write!(f, "rate {rate}/s"),
            Arrival::Concurrency(c) => write!(f, "concurrency {c}"),
        }
    }
}

/// Offsets from the start of `n` Poisson arrivals at `rate` per second:
/// exponential gaps drawn from `seed` (the first arrival is at 0, as in `vllm bench serve`).
pub fn poisson_offsets(n: usize, rate: f64, seed: u64) -> Vec<Duration> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut t = 0.0f64;
    (0..n)
        .map(|i| {
            if i > 0 {
                // 1 - u lies in (0, 1]: its log is finite.
                t += -(1.0 - rng.random::<f64>()).ln() / rate;
            }
            Duration::from_secs_f64(t)
        })
        .collect()
}

/// One request to submit now: `stream`'s round `round`, counted as arrived at `arrived`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Due {
    /// Index of the stream (a prompt, or a conversation).
    pub stream: usize,
    /// Index of the request within its stream (a conversation's round).
    pub round: usize,
    /// Since the start: the Poisson arrival of a stream's first request (so time
    /// spent waiting for the next step counts in its TTFT), else the clock when it became due.
    pub arrived: Duration,
}

#[derive(Debug, Clone)]
struct StreamState {
    /// When its first request arrives.
    offset: Duration,
    rounds: usize,
    next_round: usize,
    in_flight: bool,
}

/// Which requests to submit, given the clock and what has finished.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    arrival: Arrival,
    streams: Vec<StreamState>,
    in_flight: usize,
}

impl Dispatcher {
    /// Streams of `rounds[i]` requests each, arriving by `arrival` (Poisson offsets drawn from `seed`).
    ///
    /// ```
    /// use std::time::Duration;
    /// use omniprefix_cli::serve::{Arrival, Dispatcher};
    /// let mut d = Dispatcher::new(Arrival::Concurrency(2), &[2, 1, 1], 0);
    /// let now = Duration::ZERO;
    /// let first: Vec<_> = d.due(now).iter().map(|r| (r.stream, r.round)).collect();
    /// assert_eq!(first, [(0, 0), (1, 0)]);
    /// d.finished(0); // stream 0's round 1 comes before stream 2
    /// assert_eq!(d.due(now).iter().map(|r| (r.stream, r.round)).collect::<Vec<_>>(), [(0, 1)]);
    /// ```
    pub fn new(arrival: Arrival, rounds: &[usize], seed: u64) -> Self {
        let offsets = match arrival {
            Arrival::Poisson { rate } => poisson_offsets(rounds.len(), rate, seed),
            Arrival::Concurrency(_) => vec![Duration::ZERO; rounds.len()],
        };
        let streams = rounds
            .iter()
            .zip(offsets)
            .map(|(&rounds, offset)| StreamState { offset, rounds, next_round: 0, in_flight: false })
            .collect();
        Dispatcher { arrival, streams, in_flight: 0 }
    }

    /// The requests to submit at `now` (since the start), in stream order; each is marked in flight.
    pub fn due(&mut self, now: Duration) -> Vec<Due> {
        let cap = match self.arrival {
            Arrival::Concurrency(c) => c.max(1),
            Arrival::Poisson { .. } => usize::MAX,
        };
        let mut due = Vec::new();
        for (stream, s) in self.streams.iter_mut().enumerate() {
            if self.in_flight >= cap {
                break;
            }
            if s.in_flight || s.next_round >= s.rounds || s.offset > now {
                continue;
            }
            // Only a Poisson stream's first request has an arrival of its own; the rest arrive
            // when they become due (a closed-loop slot frees, or the previous round finished).
            let open_loop_first = s.next_round == 0 && matches!(self.arrival, Arrival::Poisson { .. });
            let arrived = if open_loop_first { s.offset } else { now };
            due.push(Due { stream, round: s.next_round, arrived });
            s.in_flight = true;
            s.next_round += 1;
            self.in_flight += 1;
        }
        due
    }

    /// `stream`'s request in flight finished; its next round (if any) is due at once.
    pub fn finished(&mut self, stream: usize) {
        if let Some(s) = self.streams.get_mut(stream).filter(|s| s.in_flight) {
            s.in_flight = false;
            self.in_flight -= 1;
        }
    }

    /// The earliest future arrival of a stream that has not started (what to sleep until when idle).
    pub fn next_arrival(&self) -> Option<Duration> {
        self.streams.iter().filter(|s| s.next_round == 0 && !s.in_flight).map(|s| s.offset).min()
    }

    /// Every request of every stream submitted and finished.
    pub fn done(&self) -> bool {
        self.in_flight == 0 && self.streams.iter().all(|s| s.next_round >= s.rounds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_gaps_are_seeded_with_the_asked_mean() {
        let a = poisson_offsets(4000, 20.0, 7);
        assert_eq!(a, poisson_offsets(4000, 20.0, 7));
        assert_ne!(a, poisson_offsets(4000, 20.0, 8));
        assert_eq!(a[0], Duration::ZERO);
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
        let mean_gap = a[3999].as_secs_f64() / 3999.0;
        assert!((mean_gap - 0.05).abs() < 0.005, "{mean_gap}");
    }

    #[test]
    fn open_loop_submits_on_the_clock_and_rounds_follow_their_predecessor() {
        let mut d = Dispatcher::new(Arrival::Poisson { rate: 10.0 }, &[2, 1, 1], 3);
        let offsets = poisson_offsets(3, 10.0, 3);
        assert_eq!(d.due(Duration::ZERO), [Due { stream: 0, round: 0, arrived: Duration::ZERO }]);
        assert_eq!(d.next_arrival(), Some(offsets[1]));
        // Stream 0's round 1 waits for round 0, whatever the clock says.
        let late = offsets[2] + Duration::from_secs(1);
        let due: Vec<_> = d.due(late).iter().map(|r| (r.stream, r.arrived)).collect();
        assert_eq!(due, [(1, offsets[1]), (2, offsets[2])]);
        d.finished(0);
        assert_eq!(d.due(late), [Due { stream: 0, round: 1, arrived: late }]);
        assert!(!d.done());
        (0..3).for_each(|s| d.finished(s));
        assert!(d.done() && d.due(late).is_empty() && d.next_arrival().is_none());
    }

    #[test]
    fn closed_loop_keeps_at_most_c_in_flight() {
        let mut d = Dispatcher::new(Arrival::Concurrency(4), &[1; 10], 0);
        assert_eq!(d.due(Duration::ZERO).len(), 4);
        assert!(d.due(Duration::ZERO).is_empty());
        d.finished(1);
        d.finished(1); // finishing twice frees one slot, not two
        // A closed-loop request arrives when its slot frees, not at the start.
        let later = Duration::from_secs(3);
        assert_eq!(d.due(later), [Due { stream: 4, round: 0, arrived: later }]);
    }
}
