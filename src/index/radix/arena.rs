//! Slot arena of tree nodes: a `Vec` of slots plus a free list, with a
//! generation per slot so a stale [`MatchHandle`] never names a reused slot.

use crate::index::MatchHandle;

/// Index of a node slot.
pub(super) type NodeId = u32;

#[derive(Debug)]
struct Slot<T> {
    generation: u32,
    value: Option<T>,
}

/// Nodes by id; freed ids are reused.
#[derive(Debug)]
pub(super) struct Arena<T> {
    slots: Vec<Slot<T>>,
    free: Vec<NodeId>,
    live: usize,
}

impl<T> Default for Arena<T> {
    fn default() -> Self {
        Arena { slots: Vec::new(), free: Vec::new(), live: 0 }
    }
}

impl<T> Arena<T> {
    /// Stores `value` in a free slot (or a new one).
    pub(super) fn alloc(&mut self, value: T) -> NodeId {
        self.live += 1;
        if let Some(id) = self.free.pop() {
            self.slots[id as usize].value = Some(value);
            return id;
        }
        self.slots.push(Slot { generation: 0, value: Some(value) });
        NodeId::try_from(self.slots.len() - 1).expect("fewer than 2^32 nodes")
    }

    /// Frees slot `id` and returns its value; the slot's generation moves on.
    pub(super) fn free(&mut self, id: NodeId) -> T {
        let slot = &mut self.slots[id as usize];
        let value = slot.value.take().expect("freeing a live node");
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push(id);
        self.live -= 1;
        value
    }

    pub(super) fn get(&self, id: NodeId) -> &T {
        self.slots[id as usize].value.as_ref().expect("live node")
    }

    pub(super) fn get_mut(&mut self, id: NodeId) -> &mut T {
        self.slots[id as usize].value.as_mut().expect("live node")
    }

    /// Number of live values.
    pub(super) fn len(&self) -> usize {
        self.live
    }

    /// Live ids and values.
    pub(super) fn iter(&self) -> impl Iterator<Item = (NodeId, &T)> {
        self.slots.iter().enumerate().filter_map(|(i, s)| s.value.as_ref().map(|v| (i as NodeId, v)))
    }

    /// A handle naming `id` in its current generation (never 0).
    pub(super) fn handle(&self, id: NodeId) -> MatchHandle {
        let generation = self.slots[id as usize].generation;
        MatchHandle((u64::from(generation) << 32) | (u64::from(id) + 1))
    }

    /// The live node a handle names, or `None` for the empty or a stale handle.
    pub(super) fn resolve(&self, handle: MatchHandle) -> Option<NodeId> {
        let low = handle.0 & u64::from(u32::MAX);
        let id = NodeId::try_from(low.checked_sub(1)?).ok()?;
        let slot = self.slots.get(id as usize)?;
        (slot.value.is_some() && u64::from(slot.generation) == handle.0 >> 32).then_some(id)
    }

    /// Bytes of the slot vector and free list (not what the values own on the heap).
    pub(super) fn table_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot<T>>()
            + self.free.capacity() * std::mem::size_of::<NodeId>()
    }
}
