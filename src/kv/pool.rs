//! The KV block pool: which block ids are free, cached by the index, or in use.
//!
//! Page storage lives in the backend; the pool only hands out ids. A block is
//! in exactly one of three states:
//!
//! * **free** — on the free list; its content is stale but kept until reuse,
//! * **indexed** — owned by the prefix index, which pins it with its own locks
//!   while requests read it and gives it back through `evict`,
//! * **in use** — private to running requests, with one reference per user.
//!
//! The free list is a FIFO linked through the block array itself (O(1) pop and
//! push, no allocation): the block freed longest ago is reused first.

use super::BlockId;
use crate::error::{CacheError, Component, ConfigError, Error, InvariantViolation, Result};

/// Marks the end of the free list.
const NIL: BlockId = BlockId::MAX;

/// Who holds a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    /// On the free list.
    Free,
    /// Owned by the prefix index (pinned by the index's locks, not by pool refs).
    Indexed,
    /// Private to running requests; `refs` is the number of users (never 0).
    InUse { refs: u32 },
}

#[derive(Debug, Clone)]
struct Block {
    state: BlockState,
    /// Next block on the free list (only meaningful while `Free`).
    next: BlockId,
}

/// A fixed pool of KV block ids with reference counts and a free list.
///
/// ```
/// use omniprefix::kv::{BlockPool, BlockState};
/// let mut pool = BlockPool::new(4)?;
/// let ids = pool.allocate(3).expect("4 blocks are free");
/// assert_eq!(pool.num_free(), 1);
/// pool.adopt_by_index(ids[0])?; // the prefix index now owns it
/// assert_eq!(pool.state(ids[0])?, BlockState::Indexed);
/// pool.release(ids[1])?;
/// assert_eq!(pool.num_free(), 2);
/// pool.validate().map_err(omniprefix::Error::from)?;
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct BlockPool {
    blocks: Vec<Block>,
    head: BlockId,
    tail: BlockId,
    num_free: usize,
    num_indexed: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks (at least one, fewer than `u32::MAX`).
    pub fn new(num_blocks: usize) -> Result<Self> {
        if num_blocks == 0 || num_blocks >= NIL as usize {
            return Err(ConfigError::Invalid {
                component: "block pool",
                field: "num_blocks",
                expected: format!("in 1..{NIL}"),
                found: num_blocks.to_string(),
            }
            .into());
        }
        let blocks = (0..num_blocks as BlockId)
            .map(|id| Block {
                state: BlockState::Free,
                next: if id + 1 == num_blocks as BlockId { NIL } else { id + 1 },
            })
            .collect();
        Ok(Self { blocks, head: 0, tail: num_blocks as BlockId - 1, num_free: num_blocks, num_indexed: 0 })
    }

    /// Total number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks on the free list.
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Blocks owned by the prefix index.
    pub fn num_indexed(&self) -> usize {
        self.num_indexed
    }

    /// Blocks private to requests.
    pub fn num_in_use(&self) -> usize {
        self.blocks.len() - self.num_free - self.num_indexed
    }

    /// The state of `block`.
    pub fn state(&self, block: BlockId) -> Result<BlockState> {
        self.block(block).map(|b| b.state)
    }

    /// Takes `n` blocks off the free list, each with one reference; all or
    /// nothing, so a short pool leaks no partial allocation.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.head;
            let block = &mut self.blocks[id as usize];
            debug_assert_eq!(block.state, BlockState::Free, "free list holds a non-free block");
            self.head = block.next;
            block.next = NIL;
            block.state = BlockState::InUse { refs: 1 };
            ids.push(id);
        }
        if self.head == NIL {
            self.tail = NIL;
        }
        self.num_free -= n;
        Some(ids)
    }

    /// Adds a user to an in-use block.
    pub fn retain(&mut self, block: BlockId) -> Result<()> {
        let b = self.block_mut(block)?;
        match b.state {
            BlockState::InUse { refs } => {
                b.state = BlockState::InUse { refs: refs + 1 };
                Ok(())
            }
            state => Err(misuse("retain", block, state)),
        }
    }

    /// Drops a user of an in-use block; the last one puts it on the free list.
    pub fn release(&mut self, block: BlockId) -> Result<()> {
        let b = self.block_mut(block)?;
        match b.state {
            BlockState::InUse { refs } if refs > 1 => {
                b.state = BlockState::InUse { refs: refs - 1 };
                Ok(())
            }
            BlockState::InUse { .. } => {
                b.state = BlockState::Free;
                self.push_free(block);
                Ok(())
            }
            state => Err(misuse("release", block, state)),
        }
    }

    /// Hands a block with exactly one user to the prefix index, which adopted it.
    pub fn adopt_by_index(&mut self, block: BlockId) -> Result<()> {
        let b = self.block_mut(block)?;
        match b.state {
            BlockState::InUse { refs: 1 } => {
                b.state = BlockState::Indexed;
                self.num_indexed += 1;
                Ok(())
            }
            state => Err(misuse("adopt", block, state)),
        }
    }

    /// Puts a block the index evicted back on the free list (content kept until reuse).
    pub fn reclaim_evicted(&mut self, block: BlockId) -> Result<()> {
        let b = self.block_mut(block)?;
        match b.state {
            BlockState::Indexed => {
                b.state = BlockState::Free;
                self.num_indexed -= 1;
                self.push_free(block);
                Ok(())
            }
            state => Err(misuse("reclaim", block, state)),
        }
    }

    /// Checks that every block is in one state, the free list is a consistent
    /// chain over exactly the free blocks, and the counters add up.
    pub fn validate(&self) -> std::result::Result<(), InvariantViolation> {
        self.broken_invariant().map_err(|what| Component::BlockPool.violation(what))
    }

    /// The first broken invariant of [`BlockPool::validate`], in words.
    fn broken_invariant(&self) -> std::result::Result<(), String> {
        let mut on_list = vec![false; self.blocks.len()];
        let mut cursor = self.head;
        let mut last = NIL;
        let mut walked = 0usize;
        while cursor != NIL {
            let block = self
                .blocks
                .get(cursor as usize)
                .ok_or_else(|| format!("free list points at block {cursor} outside the pool"))?;
            if block.state != BlockState::Free {
                return Err(format!("block {cursor} is on the free list but {:?}", block.state));
            }
            if std::mem::replace(&mut on_list[cursor as usize], true) {
                return Err(format!("free list revisits block {cursor} (cycle)"));
            }
            walked += 1;
            last = cursor;
            cursor = block.next;
        }
        if last != self.tail {
            return Err(format!("free list ends at {last} but tail is {}", self.tail));
        }
        let (mut free, mut indexed) = (0usize, 0usize);
        for (id, block) in self.blocks.iter().enumerate() {
            match block.state {
                BlockState::Free if !on_list[id] => {
                    return Err(format!("free block {id} is not on the free list"));
                }
                BlockState::Free => free += 1,
                BlockState::Indexed => indexed += 1,
                BlockState::InUse { refs: 0 } => {
                    return Err(format!("in-use block {id} has no references"));
                }
                BlockState::InUse { .. } => {}
            }
        }
        if walked != self.num_free || free != self.num_free {
            return Err(format!(
                "free count {} but {walked} blocks on the list and {free} in state free",
                self.num_free
            ));
        }
        if indexed != self.num_indexed {
            return Err(format!("indexed count {} but {indexed} blocks indexed", self.num_indexed));
        }
        Ok(())
    }

    fn push_free(&mut self, block: BlockId) {
        self.blocks[block as usize].next = NIL;
        match self.tail {
            NIL => self.head = block,
            tail => self.blocks[tail as usize].next = block,
        }
        self.tail = block;
        self.num_free += 1;
    }

    fn block(&self, block: BlockId) -> Result<&Block> {
        self.blocks
            .get(block as usize)
            .ok_or(CacheError::BlockOutOfRange { block, num_blocks: self.blocks.len() }.into())
    }

    fn block_mut(&mut self, block: BlockId) -> Result<&mut Block> {
        let num_blocks = self.blocks.len();
        self.blocks.get_mut(block as usize).ok_or(CacheError::BlockOutOfRange { block, num_blocks }.into())
    }
}

fn misuse(op: &'static str, block: BlockId, state: BlockState) -> Error {
    CacheError::BlockStateMisuse { op, block, state: format!("{state:?}") }.into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::TestResult;

    #[test]
    fn allocate_is_all_or_nothing_and_fifo() -> TestResult {
        let mut pool = BlockPool::new(3)?;
        assert_eq!(pool.allocate(4), None);
        assert_eq!(pool.num_free(), 3);
        let a = pool.allocate(2).ok_or("pool short")?;
        assert_eq!(a, vec![0, 1]);
        pool.release(1)?;
        pool.release(0)?;
        // Block 2 was freed longest ago (never used), then 1, then 0.
        assert_eq!(pool.allocate(3), Some(vec![2, 1, 0]));
        assert_eq!(pool.num_free(), 0);
        assert_eq!(pool.allocate(1), None);
        Ok(pool.validate()?)
    }

    #[test]
    fn refcounts_count_users_and_never_go_negative() -> TestResult {
        let mut pool = BlockPool::new(2)?;
        let id = pool.allocate(1).ok_or("pool short")?[0];
        pool.retain(id)?;
        assert_eq!(pool.state(id)?, BlockState::InUse { refs: 2 });
        pool.release(id)?;
        assert_eq!(pool.state(id)?, BlockState::InUse { refs: 1 });
        pool.release(id)?;
        assert_eq!(pool.state(id)?, BlockState::Free);
        let err = pool.release(id).err();
        assert!(
            matches!(err, Some(Error::Cache(CacheError::BlockStateMisuse { op: "release", block: 0, .. }))),
            "{err:?}"
        );
        assert!(matches!(
            pool.retain(id),
            Err(Error::Cache(CacheError::BlockStateMisuse { op: "retain", .. }))
        ));
        assert!(matches!(
            pool.release(9),
            Err(Error::Cache(CacheError::BlockOutOfRange { block: 9, num_blocks: 2 }))
        ));
        assert_eq!(pool.num_free(), 2);
        Ok(pool.validate()?)
    }

    #[test]
    fn indexed_blocks_leave_the_free_list_until_evicted() -> TestResult {
        let mut pool = BlockPool::new(2)?;
        let ids = pool.allocate(2).ok_or("pool short")?;
        pool.retain(ids[1])?;
        // Only a block with a single user can be handed over.
        assert!(matches!(
            pool.adopt_by_index(ids[1]),
            Err(Error::Cache(CacheError::BlockStateMisuse { op: "adopt", .. }))
        ));
        pool.adopt_by_index(ids[0])?;
        assert_eq!((pool.num_free(), pool.num_indexed(), pool.num_in_use()), (0, 1, 1));
        assert!(matches!(pool.release(ids[0]), Err(Error::Cache(CacheError::BlockStateMisuse { .. }))));
        assert!(matches!(
            pool.reclaim_evicted(ids[1]),
            Err(Error::Cache(CacheError::BlockStateMisuse { op: "reclaim", .. }))
        ));
        pool.reclaim_evicted(ids[0])?;
        assert_eq!(pool.state(ids[0])?, BlockState::Free);
        assert_eq!((pool.num_free(), pool.num_indexed(), pool.num_in_use()), (1, 0, 1));
        Ok(pool.validate()?)
    }

    #[test]
    fn rejects_empty_pool() {
        assert!(matches!(
            BlockPool::new(0),
            Err(Error::Config(ConfigError::Invalid { field: "num_blocks", .. }))
        ));
    }

    #[test]
    fn validate_catches_broken_free_list() -> Result<()> {
        let mut pool = BlockPool::new(3)?;
        pool.blocks[1].next = 0; // cycle 0 -> 1 -> 0
        assert!(
            pool.validate().is_err_and(|e| e.component == Component::BlockPool && e.what.contains("cycle"))
        );
        let mut pool = BlockPool::new(3)?;
        pool.num_free = 2;
        assert!(pool.validate().is_err());
        Ok(())
    }
}
