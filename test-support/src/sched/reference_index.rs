//! A brute-force prefix index: correct by construction, slow on purpose.
//!
//! Every cached block is stored with the full per-position key sequence of the
//! prompt up to its end (tenant included), so a match is a plain comparison of
//! key sequences — no hashing, no tree. It is the oracle the scheduler's tests
//! run against while the radix index is written in parallel.

use omniprefix::Result;
use omniprefix::error::{CacheError, Component, InvariantViolation};
use omniprefix::index::{BlockId, IndexStats, InsertOutcome, MatchHandle, PrefixIndex, PrefixMatch};
use omniprefix::prompt::{Atom, CanonicalPrompt};

/// What determines a position's KV: its text token, or (item fingerprint, row).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Key {
    Text(u32),
    Row(u128, u32),
}

/// The per-position keys of a prompt, from its atoms.
pub fn keys_of(prompt: &CanonicalPrompt) -> Vec<Key> {
    let mut keys = Vec::with_capacity(prompt.len());
    for atom in &prompt.atoms {
        match atom {
            Atom::Text(ids) => keys.extend(ids.iter().map(|&t| Key::Text(t))),
            Atom::Item { id, rows } => keys.extend(rows.clone().map(|r| Key::Row(id.fingerprint.0, r))),
        }
    }
    keys
}

#[derive(Debug)]
struct Entry {
    tenant: u64,
    /// Keys of every position up to the end of this block.
    keys: Vec<Key>,
    block: BlockId,
    locks: u32,
    last_used: u64,
}

/// The oracle index.
#[derive(Debug)]
pub struct ReferenceIndex {
    block_size: usize,
    entries: Vec<Entry>,
    clock: u64,
    stats: IndexStats,
}

impl ReferenceIndex {
    pub fn new(block_size: usize) -> Self {
        Self { block_size, entries: Vec::new(), clock: 0, stats: IndexStats::default() }
    }

    fn find(&self, tenant: u64, keys: &[Key]) -> Option<usize> {
        self.entries.iter().position(|e| e.tenant == tenant && e.keys == keys)
    }

    fn has_child(&self, e: &Entry) -> bool {
        self.entries.iter().any(|c| {
            c.tenant == e.tenant
                && c.keys.len() == e.keys.len() + self.block_size
                && c.keys.starts_with(&e.keys)
        })
    }

    fn entry_of_block(&mut self, block: BlockId) -> &mut Entry {
        self.entries.iter_mut().find(|e| e.block == block).expect("locked block is cached")
    }
}

impl PrefixIndex for ReferenceIndex {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn match_prefix(&mut self, prompt: &CanonicalPrompt) -> PrefixMatch {
        let bs = self.block_size;
        let keys = keys_of(prompt);
        self.clock += 1;
        let mut used = Vec::new();
        let mut aligned = 0;
        while aligned + bs <= keys.len() {
            match self.find(prompt.tenant, &keys[..aligned + bs]) {
                Some(i) => {
                    used.push(i);
                    aligned += bs;
                }
                None => break,
            }
        }
        // A child block sharing some leading keys of the next block: a match inside it.
        let rest = &keys[aligned..keys.len().min(aligned + bs)];
        let partial = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| {
                e.tenant == prompt.tenant
                    && e.keys.len() == aligned + bs
                    && e.keys[..aligned] == keys[..aligned]
            })
            .map(|(i, e)| (e.keys[aligned..].iter().zip(rest).take_while(|(a, b)| a == b).count(), i))
            .max()
            .filter(|&(lcp, _)| lcp > 0);
        let mut tokens = aligned;
        if let Some((lcp, i)) = partial {
            used.push(i);
            tokens += lcp;
        }
        for &i in &used {
            self.entries[i].last_used = self.clock;
        }
        self.stats.queries += 1;
        self.stats.query_tokens += keys.len() as u64;
        if tokens > 0 {
            self.stats.hits += 1;
            self.stats.hit_tokens += tokens as u64;
        }
        PrefixMatch {
            tokens,
            aligned_tokens: aligned,
            blocks: used.iter().map(|&i| self.entries[i].block).collect(),
            handle: MatchHandle(self.clock),
        }
    }

    fn insert(&mut self, prompt: &CanonicalPrompt, blocks: &[BlockId]) -> Result<InsertOutcome> {
        let bs = self.block_size;
        let keys = keys_of(prompt);
        if blocks.len() * bs > keys.len() {
            return Err(CacheError::BlocksExceedPrompt {
                blocks: blocks.len(),
                full_blocks: keys.len() / bs,
            }
            .into());
        }
        self.clock += 1;
        let mut outcome = InsertOutcome::default();
        let mut cached = Vec::with_capacity(blocks.len());
        for (k, &block) in blocks.iter().enumerate() {
            let prefix = &keys[..(k + 1) * bs];
            match self.find(prompt.tenant, prefix) {
                Some(i) => {
                    self.entries[i].last_used = self.clock;
                    cached.push(self.entries[i].block);
                    if self.entries[i].block != block {
                        outcome.duplicates.push(block);
                    }
                }
                None => {
                    self.entries.push(Entry {
                        tenant: prompt.tenant,
                        keys: prefix.to_vec(),
                        block,
                        locks: 0,
                        last_used: self.clock,
                    });
                    outcome.adopted.push(block);
                    cached.push(block);
                }
            }
        }
        if !cached.is_empty() {
            let tokens = cached.len() * bs;
            outcome.cached = PrefixMatch {
                tokens,
                aligned_tokens: tokens,
                blocks: cached,
                handle: MatchHandle(self.clock),
            };
        }
        Ok(outcome)
    }

    fn lock(&mut self, m: &PrefixMatch) {
        for &b in &m.blocks {
            self.entry_of_block(b).locks += 1;
        }
    }

    fn unlock(&mut self, m: &PrefixMatch) {
        for &b in &m.blocks {
            let e = self.entry_of_block(b);
            e.locks = e.locks.checked_sub(1).expect("unlock without lock");
        }
    }

    fn evict(&mut self, max_blocks: usize) -> Vec<BlockId> {
        let mut out = Vec::new();
        while out.len() < max_blocks {
            let victim = (0..self.entries.len())
                .filter(|&i| self.entries[i].locks == 0 && !self.has_child(&self.entries[i]))
                .min_by_key(|&i| self.entries[i].last_used);
            let Some(i) = victim else { break };
            out.push(self.entries.swap_remove(i).block);
        }
        self.stats.evicted_blocks += out.len() as u64;
        out
    }

    fn stats(&self) -> IndexStats {
        IndexStats {
            cached_blocks: self.entries.len() as u64,
            nodes: self.entries.len() as u64,
            ..self.stats.clone()
        }
    }

    fn validate(&self) -> std::result::Result<(), InvariantViolation> {
        self.broken_invariant().map_err(|what| Component::OtherIndex("reference").violation(what))
    }
}

impl ReferenceIndex {
    /// The first broken invariant of [`PrefixIndex::validate`], in words.
    fn broken_invariant(&self) -> std::result::Result<(), String> {
        for e in &self.entries {
            if e.keys.is_empty() || e.keys.len() % self.block_size != 0 {
                return Err(format!("block {} covers {} keys", e.block, e.keys.len()));
            }
            let parent = &e.keys[..e.keys.len() - self.block_size];
            if !parent.is_empty() && self.find(e.tenant, parent).is_none() {
                return Err(format!("block {} has no parent", e.block));
            }
            if self.entries.iter().filter(|o| o.block == e.block).count() != 1 {
                return Err(format!("block {} cached twice", e.block));
            }
        }
        Ok(())
    }
}
