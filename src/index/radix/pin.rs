//! Locks that pin exactly the blocks a match reports.
//!
//! A lock of a match with `k` blocks pins the path from the root down to the
//! boundary after block `k - 1`: if that boundary falls inside a node's edge,
//! the node is split there first, so the locked path ends exactly at it and
//! nothing beyond is pinned. The pin is recorded in a table keyed by the
//! match's last block (block ids are unique in the tree, and a pinned block
//! is never evicted, so the key stays valid while the pin lives). `lock`
//! finds the path from the match's blocks, its handle being only a hint (see
//! `locate`: the split keeps the handle with the lower part, which eviction
//! may take while the blocks the match reports stay cached). `unlock`
//! goes through that table, not through the match's handle, so it releases
//! exactly what `lock` pinned even after the handle's node was evicted or
//! split. A match whose last block is a partial leaf's partly filled one
//! pins that whole leaf (it ends before the block's boundary).

use crate::index::{BlockId, PrefixMatch};

use super::{NodeId, RadixIndex};

/// One pinned path: the node it ends in (whose last block is the table key)
/// and how many live locks share it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pin {
    pub(super) node: NodeId,
    pub(super) count: u32,
}

impl RadixIndex {
    /// The node holding the last of `blocks`, found on the path from `from`
    /// up, if every one of `blocks` sits at its block position on that path.
    /// `None` for an empty, stale or foreign block list.
    fn holder_of(&self, from: NodeId, blocks: &[BlockId]) -> Option<NodeId> {
        let bs = self.config.block_size;
        let last = blocks.len().checked_sub(1)?;
        let mut holder = None;
        let mut cur = from;
        loop {
            let n = self.node(cur);
            let Some(parent) = n.parent else { return holder };
            let first = n.start / bs;
            if first <= last {
                let end = first + n.blocks.len();
                if holder.is_none() {
                    if end <= last {
                        return None;
                    }
                    holder = Some(cur);
                }
                let upto = end.min(last + 1);
                if n.blocks.get(..upto - first)? != blocks.get(first..upto)? {
                    return None;
                }
            }
            cur = parent;
        }
    }

    /// The node holding the last block of `m`, if every block of `m` is
    /// still cached at its position. The match's handle is only a hint: it
    /// names the node the match ended in, and a lock splits that node and
    /// keeps the handle with the lower part, which eviction may then take
    /// while the upper part stays pinned. So a match whose handle went stale
    /// is found from a pin on one of its blocks (a shorter lock of a locked
    /// match, as the scheduler takes when it unpins a copy-on-write source)
    /// or, failing that, by the block id itself.
    fn locate(&self, m: &PrefixMatch) -> Option<NodeId> {
        let last = *m.blocks.last()?;
        // Cheapest first: a pin of the same last block, then the handle.
        let pinned = |b: &BlockId| self.pins.get(b).map(|pin| pin.node);
        let from_hints = pinned(&last)
            .into_iter()
            .chain(self.nodes.resolve(m.handle))
            .chain(m.blocks.iter().rev().skip(1).filter_map(pinned))
            .find_map(|id| self.holder_of(id, &m.blocks));
        from_hints.or_else(|| {
            if !self.owned.contains(&last) {
                return None;
            }
            let (id, _) = self.nodes.iter().find(|(_, n)| n.blocks.contains(&last))?;
            self.holder_of(id, &m.blocks)
        })
    }

    /// Pins the path ending right after the last block of `m` (see the module
    /// docs). A match some of whose blocks are no longer cached at their
    /// positions (evicted), a foreign or an empty one pins nothing.
    pub(super) fn pin(&mut self, m: &PrefixMatch) {
        let Some(&last) = m.blocks.last() else { return };
        let Some(holder) = self.locate(m) else { return };
        let boundary = m.blocks.len() * self.config.block_size;
        let n = self.node(holder);
        // A partial leaf ends before the boundary of its last block; a pin
        // of that block ends there, the whole leaf.
        let node = if boundary < n.end() {
            let k = boundary - n.start;
            self.split(holder, k)
        } else {
            holder
        };
        debug_assert!(
            self.node(node).end() == boundary
                || self.node(node).is_leaf() && self.node(node).end() > boundary - self.config.block_size,
            "a pinned path ends on its boundary or in its partial leaf"
        );
        self.lru_leave(node);
        self.add_lock(node, 1);
        self.pins.entry(last).or_insert(Pin { node, count: 0 }).count += 1;
    }

    /// Releases one pin of `m`; a match that holds no pin is ignored (lock
    /// counts never go negative).
    pub(super) fn unpin(&mut self, m: &PrefixMatch) {
        let Some(&last) = m.blocks.last() else { return };
        let Some(pin) = self.pins.get(&last).copied() else { return };
        if self.holder_of(pin.node, &m.blocks) != Some(pin.node) {
            return;
        }
        if pin.count > 1 {
            self.pins.insert(last, Pin { count: pin.count - 1, ..pin });
        } else {
            self.pins.remove(&last);
        }
        self.add_lock(pin.node, -1);
        self.lru_enter(pin.node);
    }

    /// Adds `delta` to the lock count of `node` and every non-root ancestor.
    fn add_lock(&mut self, node: NodeId, delta: i32) {
        let mut cur = Some(node);
        while let Some(c) = cur {
            let n = self.node_mut(c);
            if n.parent.is_none() {
                break;
            }
            debug_assert!(n.lock.checked_add_signed(delta).is_some(), "lock count of node {c} out of range");
            n.lock = n.lock.saturating_add_signed(delta);
            cur = n.parent;
        }
    }
}
