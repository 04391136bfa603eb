//! The modalities an item can have: a leaf type, so that [`crate::error`]
//! can name one without importing the layers above it. Re-exported as
//! [`crate::canon::Modality`].

/// Which encoder an item feeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Modality {
    Image,
    Audio,
    Video,
}
