//! Streaming code2wav: frames in as the talker makes them, audio out as soon as
//! it is final, the concatenation equal to one [`Code2Wav::forward`] over all frames.
//!
//! # What a sample depends on
//!
//! * **The transformer** is causal with a sliding window of `w` keys per layer, so
//!   its output at frame `f` reaches back `num_hidden_layers * (w - 1)` frames (568
//!   for Qwen3-Omni: 8 layers × 71). Re-running it over a window of frames would
//!   need that much context; instead each layer keeps the post-RoPE K/V rows of its
//!   last `w - 1` frames, and a chunk's frames run through it once, at their own
//!   positions, attending to those rows: the rows one pass gives.
//! * **The convolutions** (upsampling, decoder) keep, each, the last input rows
//!   their next output rows read (a causal conv's `(kernel-1)·dilation`, a
//!   transposed conv's one row ahead; [`Code2WavConfig::conv_left_context`] frames
//!   in all, 10 for Qwen3-Omni): a chunk's rows run through every conv once, after
//!   those rows, and earlier frames are never decoded again. Each row is computed
//!   from the rows one pass gives it, in one fixed order, so the samples are the
//!   one-pass ones bit for bit on the CPU.
//! * **To the right**, HF trims `stride` rows from each end of a decoder block's
//!   transposed conv, so one pass over `F` frames gives
//!   [`Code2WavConfig::output_len`]`(F)` samples (`1920·F − 555` for Qwen3-Omni):
//!   the 555 missing ones would read frame `F`. Every sample one pass over `F` frames
//!   gives is therefore final, and a chunk's decode makes exactly the samples its
//!   frames make final: `output_len(F) - output_len(F_before)`.
//!
//! The first form of this stream re-decoded the convolutions over a window reaching
//! back to the first frame any unsent sample reads: with doubling chunks that was
//! most of code2wav's work (a one-frame chunk re-read ten frames of context).
//!
//! HF's `chunked_decode(chunk_size=300, left_context_size=25)` is not this: 25
//! frames of left context cover the convolutions but not the transformer's 568,
//! and each chunk's last 555 samples are dropped, not held back, so for inputs
//! longer than one chunk its output differs from (and is shorter than) one pass.

use std::ops::Deref;

use ndarray::{Array2, ArrayView2};

use super::{Code2Wav, ConvHistory, KvWindow};
use crate::Result;
use crate::backend::Backend;
use crate::error::{BackendError, ConfigError};

/// An incremental decode of one utterance's codec frames.
///
/// Frames wait until `first_chunk` of them are pending (the first decode: a short
/// wait for the first audio), then each later decode waits for as many frames as
/// were decoded before it, at most `chunk`: chunks double (1, 1, 2, 4, … from a
/// first chunk of 1), so the audio a listener holds grows with what was said, and
/// the context each decode re-reads is paid ever more rarely. vllm-omni's code2wav
/// streams a small first chunk, then fixed ones. [`Code2WavStream::finish`]
/// decodes whatever is left.
///
/// ```
/// use ndarray::{Array2, s};
/// use omniprefix::backend::cpu::CpuBackend;
/// use omniprefix::model::code2wav::{Code2Wav, Code2WavConfig, Code2WavStream};
/// let model = Code2Wav::random(&CpuBackend, Code2WavConfig::tiny(), 7)?;
/// let codes = Array2::from_shape_fn((4, 30), |(q, t)| ((q * 7 + t * 3) % 64) as i64);
/// let mut stream = Code2WavStream::new(&model, 4, 10)?;
/// let mut wav = Vec::new();
/// for t in 0..30 {
///     wav.extend(stream.push(&CpuBackend, codes.slice(s![.., t..t + 1]))?);
/// }
/// wav.extend(stream.finish(&CpuBackend)?);
/// assert_eq!(wav, model.forward(&CpuBackend, codes.view())?);
/// # Ok::<(), omniprefix::Error>(())
/// ```
///
/// The stream holds its model by any pointer to it (`&Code2Wav`, `Arc<Code2Wav>`):
/// an engine keeps one stream per speaking request beside the shared model.
pub struct Code2WavStream<M: Deref<Target = Code2Wav<B>>, B: Backend> {
    model: M,
    first_chunk: usize,
    chunk: usize,
    /// Codes of frames not yet decoded, per quantizer.
    pending: Vec<Vec<i64>>,
    /// Frames through the transformer.
    frames: usize,
    /// Per layer, the K/V rows of the last `sliding_window - 1` frames.
    window: KvWindow<B::Tensor>,
    /// Per convolution, the input rows its next outputs read.
    history: ConvHistory<B::Tensor>,
    /// Samples emitted so far.
    emitted: usize,
}

impl<M: Deref<Target = Code2Wav<B>>, B: Backend> Code2WavStream<M, B> {
    /// A stream that decodes once `first_chunk` frames are pending, then in
    /// doubling chunks of at most `chunk` frames (see the type's doc); both must
    /// be positive ([`ConfigError::Invalid`]).
    pub fn new(model: M, first_chunk: usize, chunk: usize) -> Result<Self> {
        ConfigError::require_positive("code2wav stream", "first_chunk", first_chunk)?;
        ConfigError::require_positive("code2wav stream", "chunk", chunk)?;
        Ok(Self {
            first_chunk,
            chunk,
            pending: vec![Vec::new(); model.config().num_quantizers],
            frames: 0,
            window: model.empty_window(),
            model,
            history: ConvHistory::default(),
            emitted: 0,
        })
    }

    /// Frames pushed so far (decoded or pending).
    pub fn frames_received(&self) -> usize {
        self.frames + self.pending_frames()
    }

    /// Samples emitted so far.
    pub fn samples_emitted(&self) -> usize {
        self.emitted
    }

    /// Appends `codes [num_quantizers, n]` (the next `n` frames) and, once enough
    /// frames are pending, decodes them: the new final samples (often none). Codes
    /// are checked as [`Code2Wav::forward`] checks them (frames numbered from the
    /// stream's start); a rejected push leaves the stream as it was.
    pub fn push(&mut self, backend: &B, codes: ArrayView2<'_, i64>) -> Result<Vec<f32>> {
        self.append(codes)?;
        self.decode_if_due(backend)
    }

    /// Appends `codes [num_quantizers, n]` without decoding: a caller that
    /// schedules decodes itself (an engine serving first audio first) calls
    /// [`decode_if_due`](Self::decode_if_due) when it chooses. Checked as
    /// [`push`](Self::push) checks; a rejected append leaves the stream as it was.
    pub fn append(&mut self, codes: ArrayView2<'_, i64>) -> Result<()> {
        self.model.check_codes(codes, self.frames_received())?;
        for (p, row) in self.pending.iter_mut().zip(codes.rows()) {
            p.extend(row.iter().copied());
        }
        Ok(())
    }

    /// Frames appended and not yet decoded.
    pub fn pending_frames(&self) -> usize {
        self.pending.first().map_or(0, Vec::len)
    }

    /// Whether enough frames are pending for the next chunk (see the type's doc).
    pub fn is_due(&self) -> bool {
        let due = if self.frames == 0 { self.first_chunk } else { self.frames.clamp(1, self.chunk) };
        self.pending_frames() >= due
    }

    /// Decodes every pending frame when [`is_due`](Self::is_due): the new final
    /// samples (none otherwise). A decode that waited carries all that is
    /// pending, more than `chunk` frames if need be, and the samples are the
    /// same whatever the chunks.
    pub fn decode_if_due(&mut self, backend: &B) -> Result<Vec<f32>> {
        if self.is_due() { self.decode(backend) } else { Ok(Vec::new()) }
    }

    /// Decodes the frames still pending: the rest of the waveform.
    pub fn finish(mut self, backend: &B) -> Result<Vec<f32>> {
        self.decode(backend)
    }

    /// Runs the pending frames through the transformer, then the convolutions
    /// after their history; returns the samples they make final.
    fn decode(&mut self, backend: &B) -> Result<Vec<f32>> {
        let n = self.pending_frames();
        if n == 0 {
            return Ok(Vec::new());
        }
        let nq = self.pending.len();
        let flat: Vec<i64> = self.pending.iter().flatten().copied().collect();
        let codes = Array2::from_shape_vec((nq, n), flat).map_err(|_| BackendError::OpShape {
            op: "code2wav stream",
            what: "pending codes",
            expected: format!("[{nq}, {n}]"),
            found: vec![nq, n],
        })?;
        let x = self.model.embed_codes(backend, codes.view())?;
        let h = self.model.transformer(backend, x, self.frames, &mut self.window)?;
        self.pending.iter_mut().for_each(Vec::clear);
        self.frames += n;
        let wav = self.model.decode_hidden(backend, &h, &mut self.history)?;
        let want = self.model.config().output_len(self.frames) - self.emitted;
        if wav.len() != want {
            return Err(BackendError::OpCount {
                op: "code2wav stream",
                what: "samples",
                expected: want,
                found: wav.len(),
            }
            .into());
        }
        self.emitted += wav.len();
        Ok(wav)
    }
}
