//! The tier's reader thread: a request's blocks are read and checked while
//! other requests' steps run, so a request waiting on the disk does not hold
//! the step.
//!
//! The scheduler hands it a run of block hashes with a ticket
//! ([`TierReader::submit`]) and collects the finished runs between steps
//! ([`TierReader::try_done`]), or waits for one when nothing else can run
//! ([`TierReader::wait_done`]). A run stops at its first block that is gone
//! or fails its check, as a synchronous read would.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::writer::{Loaded, TierWriter};
use crate::Result;

/// A finished read: the blocks of a submitted run up to its first miss.
#[derive(Debug)]
pub struct ReadDone {
    /// The ticket the run was submitted with.
    pub ticket: u64,
    /// The blocks read and checked, in order.
    pub blocks: Vec<Loaded>,
    /// How long each block's read and check took.
    pub times: Vec<Duration>,
}

/// The blocks of `hashes` (in order) that `writer` gives back, up to the first
/// it lacks, with each one's read time.
pub fn read_run(writer: &TierWriter, hashes: &[u64]) -> (Vec<Loaded>, Vec<Duration>) {
    let (mut blocks, mut times) = (Vec::new(), Vec::new());
    for &hash in hashes {
        let t0 = Instant::now();
        let Some(block) = writer.get(hash) else { break };
        times.push(t0.elapsed());
        blocks.push(block);
    }
    (blocks, times)
}

/// A reader thread over a [`TierWriter`] (which serves queued blocks too).
#[derive(Debug)]
pub struct TierReader {
    /// `None` once dropping.
    jobs: Option<Sender<(u64, Vec<u64>)>>,
    done: Receiver<ReadDone>,
    /// Runs submitted and not yet collected.
    outstanding: usize,
    thread: Option<JoinHandle<()>>,
}

impl TierReader {
    /// Starts the thread reading from `writer`.
    pub fn start(writer: Arc<TierWriter>) -> Result<Self> {
        let (jobs, inbox) = channel::<(u64, Vec<u64>)>();
        let (outbox, done) = channel();
        let thread = std::thread::Builder::new()
            .name("omniprefix-tier-reader".into())
            .spawn({
                let writer = Arc::clone(&writer);
                move || {
                    for (ticket, hashes) in inbox {
                        let (blocks, times) = read_run(&writer, &hashes);
                        if outbox.send(ReadDone { ticket, blocks, times }).is_err() {
                            return;
                        }
                    }
                }
            })
            .map_err(|e| crate::error::IoError::read(writer.store().dir(), e))?;
        Ok(TierReader { jobs: Some(jobs), done, outstanding: 0, thread: Some(thread) })
    }

    /// Reads the blocks of `hashes` in the background; collected under `ticket`.
    pub fn submit(&mut self, ticket: u64, hashes: Vec<u64>) {
        // The thread only ends with the reader (or a panic, which `wait_done` reports as done).
        if let Some(jobs) = &self.jobs
            && jobs.send((ticket, hashes)).is_ok()
        {
            self.outstanding += 1;
        }
    }

    /// Runs submitted and not yet collected.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// A finished run, if one is ready now.
    pub fn try_done(&mut self) -> Option<ReadDone> {
        match self.done.try_recv() {
            Ok(done) => {
                self.outstanding -= 1;
                Some(done)
            }
            Err(TryRecvError::Empty | TryRecvError::Disconnected) => None,
        }
    }

    /// The next finished run, waiting for it; `None` when none is outstanding
    /// (or the thread is gone).
    pub fn wait_done(&mut self) -> Option<ReadDone> {
        if self.outstanding == 0 {
            return None;
        }
        let done = self.done.recv().ok();
        // A thread gone (it panicked) leaves nothing to wait for.
        self.outstanding = if done.is_some() { self.outstanding - 1 } else { 0 };
        done
    }
}

impl Drop for TierReader {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::scratch::{Scratch, payload_held, writer_holding};

    #[test]
    fn runs_come_back_under_their_tickets_and_stop_at_the_first_miss() {
        let dir = Scratch::new("reader");
        let mut reader = TierReader::start(writer_holding(&dir, &[1, 2, 4])).unwrap();
        assert!(reader.wait_done().is_none(), "nothing submitted");
        reader.submit(10, vec![1, 2, 3, 4]);
        reader.submit(11, vec![4]);
        assert_eq!(reader.outstanding(), 2);
        let first = reader.wait_done().unwrap();
        assert_eq!((first.ticket, first.blocks.len(), first.times.len()), (10, 2, 2));
        assert_eq!(first.blocks[1].payload(), &payload_held(2)[..]);
        let second = reader.wait_done().unwrap();
        assert_eq!((second.ticket, second.blocks[0].payload()), (11, &payload_held(4)[..]));
        assert_eq!(reader.outstanding(), 0);
        assert!(reader.try_done().is_none());
    }
}
