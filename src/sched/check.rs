//! The scheduler's invariant checker: pool, index and request bookkeeping agree.

use fxhash::FxHashMap;

use super::{Phase, Scheduler};
use crate::error::{Component, InvariantViolation};
use crate::kv::BlockId;
use crate::kv::BlockState;

impl Scheduler {
    /// Checks pool, index and request bookkeeping against each other; `Err`
    /// names the first broken invariant and the component it belongs to.
    pub fn validate(&self) -> std::result::Result<(), InvariantViolation> {
        self.pool.validate()?;
        self.index.validate()?;
        self.broken_bookkeeping().map_err(|what| Component::Scheduler.violation(what))
    }

    /// The first request or block whose bookkeeping disagrees, in words.
    fn broken_bookkeeping(&self) -> std::result::Result<(), String> {
        let mut users: FxHashMap<BlockId, u32> = FxHashMap::default();
        let mut tenant_of: FxHashMap<BlockId, u64> = FxHashMap::default();
        for (&id, t) in &self.requests {
            let listed = (self.waiting.contains(&id), self.running.contains(&id));
            let expected = match t.phase {
                Phase::Waiting => (true, false),
                Phase::Running => (false, true),
                Phase::Ready | Phase::Parked => (false, false),
            };
            if listed != expected {
                return Err(format!(
                    "request {id} is {:?} but listed (waiting, running) = {listed:?}",
                    t.phase
                ));
            }
            if matches!(t.phase, Phase::Waiting | Phase::Parked)
                && (!t.block_table.is_empty()
                    || t.lock.is_some()
                    || t.num_computed > 0
                    || t.in_flight.is_some())
            {
                return Err(format!(
                    "{:?} request {id} holds blocks, a lock, computed tokens or a batch",
                    t.phase
                ));
            }
            if t.phase == Phase::Ready && (t.num_computed != t.req.prompt.len() || t.in_flight.is_some()) {
                return Err(format!(
                    "ready request {id} has {} of {} tokens computed (in flight: {:?})",
                    t.num_computed,
                    t.req.prompt.len(),
                    t.in_flight
                ));
            }
            if t.delivered > t.req.prompt.len() {
                return Err(format!(
                    "request {id} handed out {} rows of {} positions",
                    t.delivered,
                    t.req.prompt.len()
                ));
            }
            let covered = t.num_computed + t.in_flight.unwrap_or(0);
            if t.phase != Phase::Waiting && t.block_table.len() < covered.div_ceil(self.config.block_size) {
                return Err(format!(
                    "request {id}: {} blocks cannot hold {covered} tokens",
                    t.block_table.len()
                ));
            }
            if t.num_shared > t.block_table.len() || (t.num_shared > 0 && t.lock.is_none()) {
                return Err(format!("request {id}: {} shared blocks without a covering lock", t.num_shared));
            }
            for (i, &b) in t.block_table.iter().enumerate() {
                if i < t.num_shared {
                    if self.pool.state(b).map_err(|e| e.to_string())? != BlockState::Indexed {
                        return Err(format!("request {id}: shared block {b} is not owned by the index"));
                    }
                } else {
                    *users.entry(b).or_default() += 1;
                }
                let tenant = t.req.prompt.tenant;
                if *tenant_of.entry(b).or_insert(tenant) != tenant {
                    return Err(format!("block {b} is shared across tenants (request {id})"));
                }
            }
        }
        for b in 0..self.pool.num_blocks() as BlockId {
            let users = users.get(&b).copied().unwrap_or(0);
            match self.pool.state(b).map_err(|e| e.to_string())? {
                BlockState::InUse { refs } if refs != users => {
                    return Err(format!("block {b} has {refs} refs but {users} request users"));
                }
                BlockState::Free | BlockState::Indexed if users > 0 => {
                    return Err(format!(
                        "block {b} is free or index-owned but privately used by {users} requests"
                    ));
                }
                _ => {}
            }
        }
        let cached = self.index.stats().cached_blocks;
        if cached != self.pool.num_indexed() as u64 {
            return Err(format!(
                "index caches {cached} blocks but the pool has {} index-owned",
                self.pool.num_indexed()
            ));
        }
        // A block published as stored and not yet as removed is still the index's.
        for (b, hash) in self.events.iter().flat_map(|e| e.published()) {
            if self.pool.state(b).map_err(|e| e.to_string())? != BlockState::Indexed {
                return Err(format!(
                    "block {b} (hash {hash:#x}) is published as cached but is not index-owned"
                ));
            }
        }
        Ok(())
    }
}
