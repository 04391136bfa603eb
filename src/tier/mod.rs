//! The disk tier: a bounded, checked, shared on-disk store of the blocks the
//! prefix index evicts (KV pages and captured hidden rows), keyed by their
//! content block hash under the fleet key.
//!
//! Five parts, one job each:
//! * `file` — one block's file: header (model identity, fleet-key
//!   fingerprint, block hash, layout, format version) and checksummed payload;
//! * `store` — the directory: atomic writes, the bound with
//!   recency eviction, private modes, sharing between processes under `flock`;
//! * `writer` — the writer thread with its bounded, dropping
//!   queue, from which queued blocks are readable at once;
//! * `reader` — the reader thread: a starting request's blocks are read
//!   and checked while other requests' steps run;
//! * `key_file` — the fleet key kept in the directory for
//!   engines given none, so a restart finds its files.
//!
//! The scheduler is the tier's only user; the runner never sees it.

mod file;
mod key_file;
mod reader;
mod store;
mod writer;

#[cfg(test)]
pub(crate) mod scratch;

pub use file::{BlockLayout, FORMAT_VERSION, Identity, ModelId, Rejected, key_fingerprint};
pub use key_file::{KEY_FILE, tier_key};
pub use reader::{ReadDone, TierReader, read_run};
pub use store::{Put, TierBlock, TierStats, TierStore};
pub use writer::{Loaded, TierWriter};
