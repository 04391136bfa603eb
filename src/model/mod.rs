//! The thinker: config, weights, the Qwen-family decoder and the encoder-output cache.

/// Which hidden states a forward keeps per position.
pub mod capture;
/// Qwen3-Omni's code2wav: codec codes → 24 kHz waveform, one pass or streamed.
pub mod code2wav;
/// HF `config.json` → [`Config`]; [`TinyModel`] for small random-weight models.
pub mod config;
/// Encoder outputs cached by item fingerprint.
pub mod encoder_cache;
/// The digest of a loaded model that the disk tier's files carry.
mod identity;
/// The Qwen3-Omni talker: codec codes from the thinker's rows.
pub mod talker;
/// The decoder layers over a [`crate::backend::Backend`].
pub mod thinker;
/// Weight sources (mmapped safetensors, in-memory) and prefix paths.
pub mod weights;

pub use capture::{CaptureName, CaptureSpec};
pub use code2wav::{Code2Wav, Code2WavConfig, Code2WavStream};
pub use config::{Config, MoeConfig, TinyFamily, TinyModel};
pub use encoder_cache::EncoderCache;
pub use talker::{Talker, TalkerConfig};
pub use thinker::{StepMeta, Thinker, WeightNames, random_source};
pub use weights::{HostTensor, MemorySource, SafetensorsSource, WeightSource, Weights};
