//! The invariant checker behind [`PrefixIndex::validate`](crate::index::PrefixIndex::validate).

use fxhash::{FxHashMap, FxHashSet};

use super::{BlockId, NodeId, RadixIndex};

/// Walks every tenant tree and cross-checks the side tables; the error names
/// the first broken invariant and the node it was found at.
pub(super) fn check(index: &RadixIndex) -> Result<(), String> {
    let bs = index.config.block_size;
    let mut seen_blocks: FxHashSet<u32> = FxHashSet::default();
    let mut visited = 0usize;
    let mut unlocked_leaves = 0usize;
    // Pins by the node they end in: (key block, count).
    let mut pinned_at: FxHashMap<NodeId, (BlockId, u32)> = FxHashMap::default();
    for (&block, pin) in &index.pins {
        if pin.count == 0 {
            return Err(format!("pin of block {block} has no lock"));
        }
        if pinned_at.insert(pin.node, (block, pin.count)).is_some() {
            return Err(format!("node {}: two pins end in it", pin.node));
        }
    }
    for (&tenant, &root) in &index.roots {
        let r = index.node(root);
        if r.parent.is_some() || r.edge.len() != 0 || r.start != 0 || r.tenant != tenant {
            return Err(format!("root {root} of tenant {tenant} is not a bare root"));
        }
        if !r.blocks.is_empty() || r.lock != 0 {
            return Err(format!("root {root} holds blocks or locks"));
        }
        let mut stack: Vec<NodeId> = vec![root];
        while let Some(id) = stack.pop() {
            visited += 1;
            let n = index.node(id);
            let is_root = n.parent.is_none();
            let mut child_locks = 0u64;
            for (key, list) in &n.children {
                if list.is_empty() {
                    return Err(format!("node {id}: empty candidate list"));
                }
                for &c in list {
                    let cn = index.node(c);
                    if cn.parent != Some(id) {
                        return Err(format!("node {c}: parent link is not {id}"));
                    }
                    if cn.edge.len() == 0 {
                        return Err(format!("node {c}: empty edge"));
                    }
                    if cn.edge.head() != Some(*key) {
                        return Err(format!("node {c}: stored under a key that is not its edge head"));
                    }
                    if cn.start != n.end() {
                        return Err(format!(
                            "node {c}: starts at {} but parent ends at {}",
                            cn.start,
                            n.end()
                        ));
                    }
                    if cn.tenant != tenant {
                        return Err(format!("node {c}: tenant {} under tenant {tenant}", cn.tenant));
                    }
                    child_locks += u64::from(cn.lock);
                    stack.push(c);
                }
            }
            let own_pins = match pinned_at.remove(&id) {
                Some((block, count)) => {
                    let partial_leaf = n.is_leaf() && !n.end().is_multiple_of(bs);
                    if is_root
                        || !(n.end().is_multiple_of(bs) || partial_leaf)
                        || n.blocks.last() != Some(&block)
                    {
                        return Err(format!("node {id}: pin of block {block} does not end at its boundary"));
                    }
                    u64::from(count)
                }
                None => 0,
            };
            if !is_root && u64::from(n.lock) != child_locks + own_pins {
                return Err(format!(
                    "node {id}: lock {} is not its {own_pins} pins plus its children's {child_locks}",
                    n.lock
                ));
            }
            // Blocks whose last position is on the edge, plus a leaf's partly filled last block.
            let expected_blocks =
                if n.is_leaf() { n.end().div_ceil(bs) } else { n.end() / bs } - n.start / bs;
            if n.blocks.len() != expected_blocks {
                return Err(format!(
                    "node {id}: {} blocks for positions {}..{} (expected {expected_blocks})",
                    n.blocks.len(),
                    n.start,
                    n.end()
                ));
            }
            for &b in &n.blocks {
                if !seen_blocks.insert(b) {
                    return Err(format!("block {b} appears twice in the tree"));
                }
            }
            if !is_root && n.is_leaf() && n.blocks.is_empty() {
                return Err(format!("leaf {id}: holds no block"));
            }
            let should_be_in_lru = !is_root && n.is_leaf() && n.lock == 0;
            if should_be_in_lru {
                unlocked_leaves += 1;
            }
            if should_be_in_lru != index.lru.contains(&(n.last_access, id)) {
                return Err(format!("node {id}: LRU membership is wrong"));
            }
        }
    }
    if let Some((node, (block, _))) = pinned_at.into_iter().next() {
        return Err(format!("pin of block {block} names node {node}, which is not in the tree"));
    }
    if visited != index.nodes.len() {
        return Err(format!("{} live nodes but {visited} reachable", index.nodes.len()));
    }
    if unlocked_leaves != index.lru.len() {
        return Err(format!("LRU holds {} entries for {unlocked_leaves} unlocked leaves", index.lru.len()));
    }
    if seen_blocks != index.owned {
        return Err("owned-block set differs from the blocks in the tree".into());
    }
    if index.stats.cached_blocks != seen_blocks.len() as u64 {
        return Err(format!(
            "stats.cached_blocks = {} but the tree holds {}",
            index.stats.cached_blocks,
            seen_blocks.len()
        ));
    }
    Ok(())
}
