//! What the scheduler records for KV events: a `BlockStored` when full blocks
//! enter the index, a `BlockRemoved` when they leave, `AllBlocksCleared` on a
//! reset. Only full blocks are published (a router hashes full blocks only);
//! a finished sequence's partly filled last block stays private to the engine.

use fxhash::{FxHashMap, FxHashSet};

use crate::canon::Fingerprint;
use crate::events::{ItemRows, KvEvent, Medium, RoutingHash};
use crate::index::block_hash::{FleetHasher, item_runs};
use crate::kv::BlockId;
use crate::prompt::CanonicalPrompt;

/// The routing hash of the first of `prompt`'s items with content `fingerprint`
/// that has one (`routing` runs parallel to `prompt.items`).
fn routing_hash(
    prompt: &CanonicalPrompt, routing: &[Option<RoutingHash>], fingerprint: Fingerprint,
) -> Option<RoutingHash> {
    prompt.items.iter().zip(routing).find_map(|(id, h)| h.filter(|_| id.fingerprint == fingerprint))
}

/// The events of the steps since the last [`take`](EventLog::take), and the
/// hash of every published block the index still holds.
#[derive(Debug)]
pub(super) struct EventLog {
    hasher: FleetHasher,
    medium: Medium,
    pending: Vec<KvEvent>,
    /// Published (full, index-owned) blocks: their hashes, and under a tier
    /// ([`keep_for_disk`](Self::keep_for_disk)) what their `BlockStored` said,
    /// to say it again for the disk tier.
    published: FxHashMap<BlockId, Published>,
    keeps_stored: bool,
    /// Hashes published as on the disk tier ([`Medium::Disk`]) and not since removed.
    on_disk: FxHashSet<u64>,
}

/// A published block: its hash, and what its `BlockStored` said when kept.
#[derive(Debug, Clone)]
struct Published {
    hash: u64,
    stored: Option<StoredBlock>,
}

/// One block's part of a `BlockStored`.
#[derive(Debug, Clone)]
struct StoredBlock {
    parent: Option<u64>,
    token_ids: Vec<u32>,
    extra: Option<Vec<ItemRows>>,
}

impl EventLog {
    pub(super) fn new(hasher: FleetHasher, medium: Medium) -> Self {
        EventLog {
            hasher,
            medium,
            pending: Vec::new(),
            published: FxHashMap::default(),
            keeps_stored: false,
            on_disk: FxHashSet::default(),
        }
    }

    /// Keeps each published block's tokens, parent and extra keys from now on, so
    /// a block that goes down to the disk tier can be published there
    /// ([`removed`](Self::removed)); without a tier nothing is kept.
    pub(super) fn keep_for_disk(&mut self) {
        self.keeps_stored = true;
    }

    /// Whether [`keep_for_disk`](Self::keep_for_disk) was asked.
    #[cfg(test)]
    pub(super) fn keeps_for_disk(&self) -> bool {
        self.keeps_stored
    }

    /// Records that the index adopted the full blocks `blocks` (`(position, id)`,
    /// positions ascending) of `prompt`; `chain` caches the prompt's hashes;
    /// `routing` holds the frontend's hash per `prompt.items` entry (or is empty).
    ///
    /// A block is published once, by the request whose prompt first put it in
    /// the index, so its markers are that request's routing hashes. A later
    /// request with the same content under another routing hash (the same
    /// image at another URL, say) hits those blocks in the engine's cache (the
    /// engine keys on content, never on the routing hash) and publishes only
    /// blocks it adds: the router keeps the first hash for the shared ones. We
    /// keep it so: re-publishing a cached block under a second marker would
    /// make one block two entries of the router's index for one KV copy. Within
    /// one prompt, identical content under several hashes takes the first
    /// item's (prompt order) for every run of it.
    pub(super) fn stored(
        &mut self, prompt: &CanonicalPrompt, routing: &[Option<RoutingHash>], block_size: usize,
        chain: &mut Vec<u64>, blocks: &[(usize, BlockId)],
    ) {
        let Some(&(last, _)) = blocks.last() else { return };
        self.hasher.extend(prompt, block_size, last + 1, chain);
        // One event per run of consecutive positions, as vLLM stores a sequence's new blocks.
        let mut start = 0;
        while start < blocks.len() {
            let mut end = start + 1;
            while end < blocks.len() && blocks[end].0 == blocks[end - 1].0 + 1 {
                end += 1;
            }
            let run = &blocks[start..end];
            let (first, _) = run[0];
            let positions = first * block_size..(first + run.len()) * block_size;
            let extra: Vec<Option<Vec<ItemRows>>> = run
                .iter()
                .map(|&(i, _)| {
                    let rows: Vec<ItemRows> = item_runs(prompt, i * block_size..(i + 1) * block_size)
                        .into_iter()
                        .map(|(fingerprint, first_row)| ItemRows {
                            mm_hash: fingerprint.mm_hash_hex(),
                            first_row,
                            routing_hash: routing_hash(prompt, routing, fingerprint),
                        })
                        .collect();
                    (!rows.is_empty()).then_some(rows)
                })
                .collect();
            for (&(i, id), extra) in run.iter().zip(&extra) {
                let stored = self.keeps_stored.then(|| StoredBlock {
                    parent: i.checked_sub(1).map(|p| chain[p]),
                    token_ids: prompt.token_ids[i * block_size..(i + 1) * block_size].to_vec(),
                    extra: extra.clone(),
                });
                self.published.insert(id, Published { hash: chain[i], stored });
            }
            self.pending.push(KvEvent::BlockStored {
                block_hashes: run.iter().map(|&(i, _)| chain[i]).collect(),
                parent_block_hash: first.checked_sub(1).map(|p| chain[p]),
                token_ids: prompt.token_ids[positions].to_vec(),
                block_size,
                medium: self.medium,
                extra_keys: extra.iter().any(Option::is_some).then_some(extra),
            });
            start = end;
        }
    }

    /// Records that `blocks` left the index (those that were published), and
    /// that those of them in `to_disk` went down to the disk tier: their removal
    /// from the pool's medium first, then a `BlockStored` on [`Medium::Disk`]
    /// (so a router that reads no medium still ends holding the block, which
    /// the tier can give back).
    pub(super) fn removed(&mut self, blocks: &[BlockId], to_disk: &[BlockId]) {
        let mut hashes = Vec::new();
        let mut down = Vec::new();
        for b in blocks {
            let Some(Published { hash, stored }) = self.published.remove(b) else { continue };
            hashes.push(hash);
            if let Some(stored) = stored.filter(|_| to_disk.contains(b)) {
                down.push((hash, stored));
            }
        }
        if !hashes.is_empty() {
            self.pending.push(KvEvent::BlockRemoved { block_hashes: hashes, medium: self.medium });
        }
        for (hash, stored) in down {
            if self.on_disk.insert(hash) {
                self.pending.push(KvEvent::BlockStored {
                    block_hashes: vec![hash],
                    parent_block_hash: stored.parent,
                    block_size: stored.token_ids.len(),
                    token_ids: stored.token_ids,
                    medium: Medium::Disk,
                    extra_keys: stored.extra.map(|rows| vec![Some(rows)]),
                });
            }
        }
    }

    /// Records that the disk tier no longer holds `hashes` (those published on it).
    pub(super) fn left_disk(&mut self, hashes: &[u64]) {
        let gone: Vec<u64> = hashes.iter().copied().filter(|h| self.on_disk.remove(h)).collect();
        if !gone.is_empty() {
            self.pending.push(KvEvent::BlockRemoved { block_hashes: gone, medium: Medium::Disk });
        }
    }

    /// Records that the whole cache was dropped.
    pub(super) fn cleared(&mut self) {
        self.published.clear();
        self.on_disk.clear();
        self.pending.push(KvEvent::AllBlocksCleared);
    }

    /// The hasher of the fleet key the blocks are published under.
    pub(super) fn hasher(&self) -> &FleetHasher {
        &self.hasher
    }

    /// The events recorded since the last call.
    pub(super) fn take(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.pending)
    }

    /// The published blocks the index holds, with their hashes.
    pub(super) fn published(&self) -> impl Iterator<Item = (BlockId, u64)> + '_ {
        self.published.iter().map(|(&b, p)| (b, p.hash))
    }

    /// The hash block `b` was published under, if it is published.
    pub(super) fn hash_of(&self, b: BlockId) -> Option<u64> {
        self.published.get(&b).map(|p| p.hash)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canon::FingerprintKey;

    fn text(ids: Vec<u32>) -> CanonicalPrompt {
        CanonicalPrompt::text(0, ids)
    }

    #[test]
    fn blocks_spilled_to_the_tier_are_published_on_disk_after_their_removal() {
        let mut log = EventLog::new(FleetHasher::new(&FingerprintKey::fixed(1)), Medium::Cpu);
        log.keep_for_disk();
        let prompt = text((10..22).collect());
        let mut chain = Vec::new();
        log.stored(&prompt, &[], 4, &mut chain, &[(0, 7), (1, 8), (2, 9)]);
        let [KvEvent::BlockStored { block_hashes, .. }] = &log.take()[..] else { panic!("one stored run") };
        assert_eq!(block_hashes, &chain[..3]);
        // Blocks 8 and 9 leave the pool; only 9 went down to the tier.
        log.removed(&[8, 9], &[9]);
        let events = log.take();
        assert_eq!(
            events,
            [
                KvEvent::BlockRemoved { block_hashes: vec![chain[1], chain[2]], medium: Medium::Cpu },
                KvEvent::BlockStored {
                    block_hashes: vec![chain[2]],
                    parent_block_hash: Some(chain[1]),
                    token_ids: vec![18, 19, 20, 21],
                    block_size: 4,
                    medium: Medium::Disk,
                    extra_keys: None,
                },
            ]
        );
        // The tier lets 9 go (and one it never published): only 9's removal is said, once.
        log.left_disk(&[chain[2], 12345]);
        log.left_disk(&[chain[2]]);
        assert_eq!(
            log.take(),
            [KvEvent::BlockRemoved { block_hashes: vec![chain[2]], medium: Medium::Disk }]
        );
        assert_eq!(log.published().map(|(b, _)| b).collect::<Vec<_>>(), [7]);
    }
}
