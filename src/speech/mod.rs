//! The talker stage's view of a thinker conversation: which thinker rows feed
//! the talker, and the chat ids that frame them. The talker model and code2wav
//! live in [`crate::model`]; this module joins them to the thinker's output.

mod checks;
mod layout;
mod options;
mod stage;
mod turns;

pub use checks::{CheckedSpeech, SpeechChecks};
pub use layout::{ASSISTANT_ROWS, TalkerLayout};
pub use options::SpeechOptions;
pub use stage::{Speech, SpeechStage};
pub use turns::{ChatIds, Turns, turns};
