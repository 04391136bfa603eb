//! The validated radix prefix index over atoms.
//!
//! A radix tree per tenant (tenant salt → root; tenants never share nodes),
//! nodes in a slot arena (`arena`), edges as compressed atom runs (`edge`),
//! children in an `FxHashMap` keyed by the edge head (a text token, or an
//! item's fingerprint and row) and then *confirmed against the real content*.
//!
//! **Collisions.** A head key maps to a short list of candidate children, not
//! one: two items with colliding fingerprints (same key) but different content
//! coexist as siblings. Matching takes the candidate whose content validates
//! (with the [`Evidence`](crate::canon::Evidence) both identities carry, see
//! [`validate`](crate::index::validate)); if none does, matching stops there (a miss,
//! counted in `validation_failures`). Insert never merges into a candidate that
//! fails validation, it adds a sibling under the same key.
//!
//! **Blocks.** Block `i` covers positions `i*bs .. (i+1)*bs` and is stored on the
//! node whose edge holds its last position, so a node split keeps each id with
//! the side that holds that position. A leaf ends on a block boundary, or is a
//! *partial leaf*: a finished sequence's last, partly filled block
//! ([`insert_partial`](PrefixIndex::insert_partial)) is stored on the leaf its
//! valid positions end on, so a leaf holds `ceil(end/bs) - floor(start/bs)`
//! blocks and every position in the tree is covered by a cached block.
//! Interior nodes never hold a partial block (two blocks for one index on a
//! path): an insert that reaches the end of a partial leaf and goes on grows
//! the leaf in place and gives the partial block up
//! ([`InsertOutcome::released`]); one that diverges inside it splits it, and
//! the leaf keeps its partial block.
//!
//! **Locks.** A lock pins exactly the blocks its match reports: the node the
//! match ends in is split at the block boundary after its last block, so the
//! locked path ends there (or at the end of a partial leaf, when the partial
//! block is the last one), and the pin is recorded by that block (module `pin`).
//! A locked full leaf is never extended in place by an insert (a new child
//! takes the new blocks), so blocks beyond a pin stay unpinned and evictable.
//! A locked partial leaf cannot grow at all (its partial block would have to
//! go): such an insert is a [`CacheError::LockedPartialBlock`] that changes
//! nothing. The scheduler pins a partial block only as a copy-on-write source
//! until the batch holding the copy completes; an insert that meets such a pin
//! (another batch completed first) is deferred by the scheduler.
//!
//! **Eviction.** Unlocked leaves sit in an LRU set ordered by a logical clock
//! (touched on match and insert). Eviction trims (a partial leaf's partly
//! filled block first, back to its block boundary) or removes them; a parent that
//! becomes childless is trimmed back to its last block boundary and becomes a
//! leaf itself (or is removed if it holds no block).

mod arena;
mod check;
mod edge;
mod pin;

use std::collections::BTreeSet;

use fxhash::{FxHashMap, FxHashSet};

use crate::Result;
use crate::error::{CacheError, Component, ConfigError, InvariantViolation, RequestError};
use crate::index::{BlockId, IndexStats, InsertOutcome, PrefixIndex, PrefixMatch, check_partial_args};
use crate::prompt::{Atom, CanonicalPrompt, TenantSalt};

use arena::{Arena, NodeId};
use edge::{Cursor, Edge, Head, Validator};
use pin::Pin;

/// Settings of a [`RadixIndex`].
///
/// There is no validation policy here: hits are confirmed with the evidence
/// the items carry, which their fingerprinter's policy decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct RadixConfig {
    /// Tokens per KV block (default 16).
    pub block_size: usize,
}

impl Default for RadixConfig {
    fn default() -> Self {
        RadixConfig { block_size: crate::kv::DEFAULT_BLOCK_SIZE }
    }
}

/// One tree node: the edge from its parent and the blocks whose last position lies on it.
#[derive(Debug)]
struct Node {
    parent: Option<NodeId>,
    tenant: TenantSalt,
    /// Tokens before this edge (depth of the edge start).
    start: usize,
    edge: Edge,
    /// Candidate children per head key (several only under fingerprint collisions).
    children: FxHashMap<Head, Vec<NodeId>>,
    blocks: Vec<BlockId>,
    /// Live locks whose pinned path runs through this node: the pins ending
    /// here plus the locks of its children.
    lock: u32,
    last_access: u64,
}

impl Node {
    fn end(&self) -> usize {
        self.start + self.edge.len()
    }

    fn is_leaf(&self) -> bool {
        self.children.is_empty()
    }

    fn heap_bytes(&self) -> usize {
        let entry = std::mem::size_of::<(Head, Vec<NodeId>)>() + 1;
        let lists: usize = self.children.values().map(|v| v.capacity() * 4).sum();
        self.edge.heap_bytes()
            + self.blocks.capacity() * std::mem::size_of::<BlockId>()
            + self.children.capacity() * entry
            + lists
    }
}

/// Where a walk down the tree stopped.
#[derive(Debug)]
struct Walk {
    /// Root first; the last node is the deepest one entered (maybe partly).
    path: Vec<NodeId>,
    /// Tokens matched from the start of the prompt.
    matched: usize,
}

/// What [`RadixIndex::plan_insert`] found.
#[derive(Debug)]
struct Plan {
    /// The walk to the inserted length (down to the last block's holder
    /// when all of it is cached).
    walk: Walk,
    /// The index's ids of the blocks the insert finds cached.
    cached: Vec<BlockId>,
    /// The walk ends at the end of a partial leaf that the insert grows.
    extend: bool,
}

/// The validated radix prefix index.
///
/// ```
/// use omniprefix::index::radix::{RadixConfig, RadixIndex};
/// use omniprefix::index::PrefixIndex;
/// use omniprefix::prompt::CanonicalPrompt;
///
/// let prompt = |ids: Vec<u32>| CanonicalPrompt::text(0, ids);
/// let mut index = RadixIndex::new(RadixConfig { block_size: 4 })?;
/// index.insert(&prompt((0..8).collect()), &[10, 11])?;
/// let m = index.match_prefix(&prompt(vec![0, 1, 2, 3, 4, 5, 9, 9]));
/// assert_eq!((m.tokens, m.aligned_tokens, m.blocks), (6, 4, vec![10, 11]));
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Debug)]
pub struct RadixIndex {
    config: RadixConfig,
    nodes: Arena<Node>,
    roots: FxHashMap<TenantSalt, NodeId>,
    /// Unlocked non-root leaves by (last access, id): eviction order.
    lru: BTreeSet<(u64, NodeId)>,
    /// Every block id the tree holds.
    owned: FxHashSet<BlockId>,
    /// Live pins by the last block they pin.
    pins: FxHashMap<BlockId, Pin>,
    clock: u64,
    stats: IndexStats,
}

impl RadixIndex {
    /// An empty index; `block_size` must be at least 1.
    pub fn new(config: RadixConfig) -> Result<Self> {
        ConfigError::require_positive("radix index", "block_size", config.block_size)?;
        Ok(RadixIndex {
            config,
            nodes: Arena::default(),
            roots: FxHashMap::default(),
            lru: BTreeSet::new(),
            owned: FxHashSet::default(),
            pins: FxHashMap::default(),
            clock: 0,
            stats: IndexStats::default(),
        })
    }

    /// The settings this index runs with.
    pub fn config(&self) -> RadixConfig {
        self.config
    }

    fn node(&self, id: NodeId) -> &Node {
        self.nodes.get(id)
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes.get_mut(id)
    }

    /// The LRU key of `id` if it belongs in the LRU set (unlocked non-root leaf).
    fn lru_key(&self, id: NodeId) -> Option<(u64, NodeId)> {
        let n = self.node(id);
        (n.parent.is_some() && n.is_leaf() && n.lock == 0).then_some((n.last_access, id))
    }

    /// Takes `id` out of the LRU set before its state changes.
    fn lru_leave(&mut self, id: NodeId) {
        if let Some(key) = self.lru_key(id) {
            self.lru.remove(&key);
        }
    }

    /// Puts `id` back into the LRU set if it now qualifies.
    fn lru_enter(&mut self, id: NodeId) {
        if let Some(key) = self.lru_key(id) {
            self.lru.insert(key);
        }
    }

    /// Marks every node of `path` as used now.
    fn touch(&mut self, path: &[NodeId]) {
        self.clock += 1;
        for &id in path {
            self.lru_leave(id);
            self.node_mut(id).last_access = self.clock;
            self.lru_enter(id);
        }
    }

    /// Follows `atoms` down from `root` as far as cached, validated content agrees.
    fn walk(&self, root: NodeId, atoms: &[Atom], limit: usize, v: &mut Validator) -> Walk {
        let mut path = vec![root];
        let mut matched = 0;
        let mut q = Cursor::new(atoms);
        let mut cur = root;
        while matched < limit {
            let Some(head) = q.head() else { break };
            let Some(candidates) = self.node(cur).children.get(&head) else { break };
            let entered = candidates.iter().find_map(|&c| {
                let mut probe = q.clone();
                let n = self.node(c).edge.common_prefix(&mut probe, limit - matched, v);
                (n > 0).then_some((c, n, probe))
            });
            let Some((child, n, probe)) = entered else { break };
            q = probe;
            matched += n;
            path.push(child);
            if n < self.node(child).edge.len() {
                break;
            }
            cur = child;
        }
        Walk { path, matched }
    }

    /// Whether `id` holds block `idx` (its blocks are the consecutive ids
    /// from the block of its start on).
    fn holds(&self, id: NodeId, idx: usize) -> bool {
        let n = self.node(id);
        let first = n.start / self.config.block_size;
        (first..first + n.blocks.len()).contains(&idx)
    }

    /// Extends `path` from `deepest` (the node the `tokens`-th position lies
    /// on) down to the node holding the last block a match of `tokens`
    /// needs, when that block's last position lies below `deepest`. Any
    /// child will do, they all agree on the matched part of the block; the
    /// one holding `prefer` is taken if there is one (an insert re-offering
    /// an id it got from a match).
    fn block_holder(&self, deepest: NodeId, tokens: usize, path: &mut Vec<NodeId>, prefer: Option<BlockId>) {
        let last = tokens.div_ceil(self.config.block_size) - 1;
        if let Some(below) = prefer.and_then(|b| self.path_to_block(deepest, last, b)) {
            path.extend(below);
            return;
        }
        let mut cur = deepest;
        while !self.holds(cur, last) {
            let next = self.node(cur).children.values().flatten().copied().min();
            let Some(next) = next else {
                debug_assert!(false, "leaf {cur} does not hold block {last}");
                return;
            };
            path.push(next);
            cur = next;
        }
    }

    /// The nodes below `from` down to the one holding `block` as block `idx`,
    /// if that is how the subtree holds it (searches only nodes that hold no
    /// block `idx`, i.e. that end before it).
    fn path_to_block(&self, from: NodeId, idx: usize, block: BlockId) -> Option<Vec<NodeId>> {
        if self.holds(from, idx) {
            let n = self.node(from);
            return (n.blocks[idx - n.start / self.config.block_size] == block).then(Vec::new);
        }
        self.node(from).children.values().flatten().find_map(|&c| {
            let mut below = self.path_to_block(c, idx, block)?;
            below.insert(0, c);
            Some(below)
        })
    }

    /// The first `want` block ids along `path`.
    fn blocks_on(&self, path: &[NodeId], want: usize) -> Vec<BlockId> {
        // Slice copies per node: a flat_map + take over 2k ids costs microseconds.
        let mut blocks: Vec<BlockId> = Vec::with_capacity(want);
        for &id in path {
            let held = &self.node(id).blocks;
            blocks.extend_from_slice(&held[..held.len().min(want - blocks.len())]);
        }
        blocks
    }

    /// Splits `id` so that its first `k` edge tokens move to a new parent,
    /// which is returned. `id` keeps its slot (and so its handles) and the
    /// blocks whose last position is on its remaining edge.
    fn split(&mut self, id: NodeId, k: usize) -> NodeId {
        let bs = self.config.block_size;
        let n = self.node_mut(id);
        debug_assert!(0 < k && k < n.edge.len());
        let tail = n.edge.split_off(k);
        let head_edge = std::mem::replace(&mut n.edge, tail);
        let split_at = n.start + k;
        let upper_blocks: Vec<BlockId> = n.blocks.drain(..split_at / bs - n.start / bs).collect();
        let tail_head = n.edge.head().expect("split leaves a non-empty tail");
        let upper = Node {
            parent: n.parent,
            tenant: n.tenant,
            start: n.start,
            edge: head_edge,
            children: std::iter::once((tail_head, vec![id])).collect(),
            blocks: upper_blocks,
            lock: n.lock,
            last_access: n.last_access,
        };
        n.start = split_at;
        let parent = n.parent.expect("the root is never split");
        let key = upper.edge.head().expect("split leaves a non-empty head");
        let upper_id = self.nodes.alloc(upper);
        self.node_mut(id).parent = Some(upper_id);
        if let Some(list) = self.node_mut(parent).children.get_mut(&key) {
            for c in list.iter_mut().filter(|c| **c == id) {
                *c = upper_id;
            }
        }
        upper_id
    }

    /// The number of positions `prompt`'s atoms cover, which must be its length.
    fn atoms_len(prompt: &CanonicalPrompt) -> Result<usize> {
        let atoms: usize = prompt.atoms.iter().map(Atom::len).sum();
        if atoms != prompt.len() {
            return Err(RequestError::AtomsLengthMismatch { atoms, tokens: prompt.len() }.into());
        }
        Ok(atoms)
    }

    /// Checks an insert of `total` positions held by `blocks` without
    /// changing anything: how far it is cached, the index's ids for the
    /// blocks it already covers, and whether a partial leaf must grow.
    fn plan_insert(&self, prompt: &CanonicalPrompt, blocks: &[BlockId], total: usize) -> Result<Plan> {
        let bs = self.config.block_size;
        let mut given: FxHashSet<BlockId> = FxHashSet::default();
        if let Some(&block) = blocks.iter().find(|&&b| !given.insert(b)) {
            return Err(CacheError::BlockAlreadyCached { block }.into());
        }
        let mut walk = match self.roots.get(&prompt.tenant) {
            Some(&root) => {
                let mut v = Validator::default();
                self.walk(root, &prompt.atoms, total, &mut v)
            }
            None => Walk { path: Vec::new(), matched: 0 },
        };
        let m = walk.matched;
        let mut extend = false;
        let cached = if m == total && total > 0 {
            // All of it is cached: blocks as a match of `total` reports them.
            let deepest = *walk.path.last().expect("walk path starts at the root");
            self.block_holder(deepest, total, &mut walk.path, blocks.last().copied());
            self.blocks_on(&walk.path, blocks.len())
        } else {
            // Blocks wholly inside the matched part; the one `m` falls in is new.
            if let Some(&last) = walk.path.last() {
                let n = self.node(last);
                if n.parent.is_some() && n.is_leaf() && m == n.end() && !m.is_multiple_of(bs) {
                    let block = *n.blocks.last().expect("a partial leaf holds its partial block");
                    if n.lock > 0 {
                        return Err(CacheError::LockedPartialBlock { block, end: m }.into());
                    }
                    extend = true;
                }
            }
            self.blocks_on(&walk.path, m / bs)
        };
        for (position, &block) in blocks.iter().enumerate() {
            if self.owned.contains(&block) && cached.get(position) != Some(&block) {
                return Err(CacheError::BlockAlreadyCached { block }.into());
            }
        }
        Ok(Plan { walk, cached, extend })
    }

    /// Caches the first `total` positions of `prompt` held by `blocks`
    /// (`ceil(total / bs)` of them, arguments already checked).
    fn insert_upto(
        &mut self, prompt: &CanonicalPrompt, blocks: &[BlockId], total: usize,
    ) -> Result<InsertOutcome> {
        let Plan { walk, mut cached, extend } = self.plan_insert(prompt, blocks, total)?;
        let mut outcome = InsertOutcome::default();
        if blocks.is_empty() {
            return Ok(outcome);
        }
        let bs = self.config.block_size;
        let m = walk.matched;
        let first_new = if m == total { blocks.len() } else { m / bs };
        outcome.duplicates =
            blocks[..first_new].iter().zip(&cached).filter(|(b, c)| b != c).map(|(b, _)| *b).collect();
        let root = self.root_for(prompt.tenant);
        let mut path = walk.path;
        if path.is_empty() {
            path.push(root);
        }
        // All of it was cached: the plan extended the path to the block holder.
        let mut holder = *path.last().expect("path starts at the root");
        if m < total {
            let last = *path.last().expect("path starts at the root");
            let attach = if m < self.node(last).end() {
                let upper = self.split(last, m - self.node(last).start);
                *path.last_mut().expect("path starts at the root") = upper;
                upper
            } else {
                last
            };
            let mut q = Cursor::new(&prompt.atoms);
            q.advance(m);
            let edge = q.take_edge(total - m);
            let new_blocks = blocks[first_new..].to_vec();
            self.lru_leave(attach);
            let a = self.node(attach);
            if a.parent.is_some() && a.is_leaf() && a.lock == 0 {
                // Extends the leaf in place; a partial last block gives way to
                // the new block over the same positions.
                let a = self.node_mut(attach);
                if extend {
                    outcome.released.extend(a.blocks.pop());
                }
                a.edge.append(edge);
                a.blocks.extend_from_slice(&new_blocks);
                holder = attach;
            } else {
                debug_assert!(!extend, "the plan refuses to grow a locked partial leaf");
                let key = edge.head().expect("a non-empty new edge");
                let tenant = prompt.tenant;
                let child = self.nodes.alloc(Node {
                    parent: Some(attach),
                    tenant,
                    start: m,
                    edge,
                    children: FxHashMap::default(),
                    blocks: new_blocks.clone(),
                    lock: 0,
                    last_access: self.clock,
                });
                self.node_mut(attach).children.entry(key).or_default().push(child);
                self.lru_enter(child);
                path.push(child);
                holder = child;
            }
            self.lru_enter(attach);
            for b in &outcome.released {
                self.owned.remove(b);
            }
            self.owned.extend(new_blocks.iter().copied());
            self.stats.cached_blocks += new_blocks.len() as u64;
            self.stats.cached_blocks -= outcome.released.len() as u64;
            cached.extend_from_slice(&new_blocks);
            outcome.adopted = new_blocks;
        }
        self.touch(&path);
        debug_assert_eq!(cached.len(), blocks.len());
        debug_assert!(
            cached.last().is_some_and(|b| self.node(holder).blocks.contains(b)),
            "the holder holds the last block"
        );
        outcome.cached = PrefixMatch {
            tokens: total,
            aligned_tokens: total / bs * bs,
            blocks: cached,
            handle: self.nodes.handle(holder),
        };
        Ok(outcome)
    }

    fn root_for(&mut self, tenant: TenantSalt) -> NodeId {
        if let Some(&root) = self.roots.get(&tenant) {
            return root;
        }
        let root = self.nodes.alloc(Node {
            parent: None,
            tenant,
            start: 0,
            edge: Edge::default(),
            children: FxHashMap::default(),
            blocks: Vec::new(),
            lock: 0,
            last_access: self.clock,
        });
        self.roots.insert(tenant, root);
        root
    }

    /// Removes leaf `id` and returns its blocks; a parent left childless is
    /// trimmed to its last block boundary, or removed too if it holds no block.
    fn remove_leaf(&mut self, mut id: NodeId) -> Vec<BlockId> {
        let bs = self.config.block_size;
        let mut freed = Vec::new();
        loop {
            self.lru_leave(id);
            let node = self.nodes.free(id);
            freed.extend(node.blocks);
            let Some(parent) = node.parent else {
                self.roots.remove(&node.tenant);
                return freed;
            };
            let key = node.edge.head().expect("non-root edges are non-empty");
            let p = self.node_mut(parent);
            if let Some(list) = p.children.get_mut(&key) {
                list.retain(|&c| c != id);
                if list.is_empty() {
                    p.children.remove(&key);
                }
            }
            if !p.is_leaf() {
                return freed;
            }
            p.children.shrink_to_fit();
            if p.parent.is_some() {
                let aligned = p.end() / bs * bs;
                if aligned > p.start {
                    let keep = aligned - p.start;
                    p.edge.truncate(keep);
                    self.lru_enter(parent);
                    return freed;
                }
                debug_assert!(p.blocks.is_empty() && p.lock == 0);
            }
            id = parent;
        }
    }
}

impl PrefixIndex for RadixIndex {
    fn block_size(&self) -> usize {
        self.config.block_size
    }

    fn match_prefix(&mut self, prompt: &CanonicalPrompt) -> PrefixMatch {
        self.stats.queries += 1;
        self.stats.query_tokens += prompt.len() as u64;
        let Some(&root) = self.roots.get(&prompt.tenant) else { return PrefixMatch::default() };
        let limit = prompt.atoms.iter().map(Atom::len).sum();
        let mut v = Validator::default();
        let Walk { mut path, matched } = self.walk(root, &prompt.atoms, limit, &mut v);
        self.stats.validation_failures += v.failures;
        if matched == 0 {
            return PrefixMatch::default();
        }
        let bs = self.config.block_size;
        let deepest = *path.last().expect("walk path starts at the root");
        self.block_holder(deepest, matched, &mut path, None);
        let holder = *path.last().expect("walk path starts at the root");
        let blocks = self.blocks_on(&path, matched.div_ceil(bs));
        self.touch(&path);
        self.stats.hits += 1;
        self.stats.hit_tokens += matched as u64;
        PrefixMatch {
            tokens: matched,
            aligned_tokens: matched / bs * bs,
            blocks,
            handle: self.nodes.handle(holder),
        }
    }

    /// Blocks whose content is already cached come back in `duplicates`,
    /// except an id equal to the one cached at that position (the caller got
    /// it from a match; the index keeps owning it, it is in neither list).
    /// `cached` names the node holding the last block, as a match would.
    fn insert(&mut self, prompt: &CanonicalPrompt, blocks: &[BlockId]) -> Result<InsertOutcome> {
        let bs = self.config.block_size;
        let atoms = Self::atoms_len(prompt)?;
        if blocks.len() > atoms / bs {
            return Err(
                CacheError::BlocksExceedPrompt { blocks: blocks.len(), full_blocks: atoms / bs }.into()
            );
        }
        self.insert_upto(prompt, blocks, blocks.len() * bs)
    }

    /// The partial block becomes the last block of a partial leaf (see the
    /// module docs). Errors with [`CacheError::LockedPartialBlock`] when it
    /// would have to grow a partial leaf a lock pins.
    fn insert_partial(
        &mut self, prompt: &CanonicalPrompt, blocks: &[BlockId], tokens: usize,
    ) -> Result<InsertOutcome> {
        let atoms = Self::atoms_len(prompt)?;
        check_partial_args(self.config.block_size, atoms, blocks.len(), tokens)?;
        self.insert_upto(prompt, blocks, tokens)
    }

    /// Pins exactly `m.blocks` (see module `pin`), found by their ids: a
    /// match whose handle went stale (its node was split and the part the
    /// handle names evicted) is still pinned while all its blocks are cached.
    /// A stale match (one of its blocks was evicted), a foreign one (it names
    /// blocks not on one path) or the empty match locks nothing.
    fn lock(&mut self, m: &PrefixMatch) {
        self.pin(m);
    }

    /// Releases what one `lock(m)` pinned, even if the tree changed since.
    /// Unlocking a match that holds no lock is ignored (lock counts never go
    /// negative).
    fn unlock(&mut self, m: &PrefixMatch) {
        self.unpin(m);
    }

    fn evict(&mut self, max_blocks: usize) -> Vec<BlockId> {
        let bs = self.config.block_size;
        let mut freed = Vec::new();
        while freed.len() < max_blocks {
            let Some(&(_, id)) = self.lru.first() else { break };
            let need = max_blocks - freed.len();
            let have = self.node(id).blocks.len();
            if have > need {
                // Back to a block boundary: a partial last block goes first.
                let n = self.node_mut(id);
                let end = (n.end().div_ceil(bs) - need) * bs;
                n.edge.truncate(end - n.start);
                freed.extend(n.blocks.drain(have - need..));
            } else {
                freed.extend(self.remove_leaf(id));
            }
        }
        for b in &freed {
            self.owned.remove(b);
        }
        self.stats.cached_blocks -= freed.len() as u64;
        self.stats.evicted_blocks += freed.len() as u64;
        freed
    }

    /// `nodes` counts tenant roots too; `index_bytes` is computed on call
    /// from the live structure (node table, edges, child maps, block lists,
    /// LRU set, owned-block set and pin table).
    fn stats(&self) -> IndexStats {
        let nodes: usize = self.nodes.iter().map(|(_, n)| n.heap_bytes()).sum();
        let lru = self.lru.len() * (std::mem::size_of::<(u64, NodeId)>() + 8);
        let owned = self.owned.capacity() * (std::mem::size_of::<BlockId>() + 1);
        let roots = self.roots.capacity() * (std::mem::size_of::<(TenantSalt, NodeId)>() + 1);
        let pins = self.pins.capacity() * (std::mem::size_of::<(BlockId, Pin)>() + 1);
        IndexStats {
            nodes: self.nodes.len() as u64,
            index_bytes: (self.nodes.table_bytes() + nodes + lru + owned + roots + pins) as u64,
            ..self.stats.clone()
        }
    }

    fn validate(&self) -> std::result::Result<(), InvariantViolation> {
        check::check(self).map_err(|what| Component::RadixIndex.violation(what))
    }
}
