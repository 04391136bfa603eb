//! Edge labels of the radix tree and how a query is compared against them.
//!
//! An edge is a compressed run of atoms: text token runs and item row spans.
//! Comparison works on whole spans, so a 7200-row item span costs one
//! fingerprint compare plus one (memoised) validation, not 7200 steps.

use std::ops::Range;
use std::sync::Arc;

use crate::canon::{Fingerprint, ItemIdentity};
use crate::index::validate::confirm;
use crate::prompt::Atom;

/// The key a child is found under: the first token of its edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Head {
    /// A text token id.
    Text(u32),
    /// An item row: the item's fingerprint and the row index within the item.
    Item(Fingerprint, u32),
}

/// One compressed piece of an edge label.
#[derive(Debug, Clone)]
enum Seg {
    Text(Vec<u32>),
    Item { id: Arc<ItemIdentity>, rows: Range<u32> },
}

impl Seg {
    fn len(&self) -> usize {
        match self {
            Seg::Text(t) => t.len(),
            Seg::Item { rows, .. } => rows.len(),
        }
    }

    fn head_at(&self, off: usize) -> Head {
        match self {
            Seg::Text(t) => Head::Text(t[off]),
            Seg::Item { id, rows } => Head::Item(id.fingerprint, row_at(rows, off)),
        }
    }
}

/// Row `off` of a span; spans are bounded by `u32` rows, so this cannot overflow
/// for offsets inside the span.
fn row_at(rows: &Range<u32>, off: usize) -> u32 {
    rows.start.saturating_add(u32::try_from(off).unwrap_or(u32::MAX))
}

/// A compressed edge label (never empty in a non-root node).
#[derive(Debug, Clone, Default)]
pub(super) struct Edge {
    segs: Vec<Seg>,
    len: usize,
}

impl Edge {
    /// Number of tokens (positions) the edge covers.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The key this edge's node is stored under in its parent.
    pub(super) fn head(&self) -> Option<Head> {
        self.segs.first().map(|s| s.head_at(0))
    }

    /// Appends a piece, merging with the last one when contiguous.
    fn push(&mut self, seg: Seg) {
        let n = seg.len();
        if n == 0 {
            return;
        }
        self.len += n;
        match (self.segs.last_mut(), seg) {
            (Some(Seg::Text(last)), Seg::Text(more)) => last.extend_from_slice(&more),
            (Some(Seg::Item { id, rows }), Seg::Item { id: nid, rows: nrows })
                if Arc::ptr_eq(id, &nid) && rows.end == nrows.start =>
            {
                rows.end = nrows.end;
            }
            (_, seg) => self.segs.push(seg),
        }
    }

    /// Appends all of `other` (used to extend a leaf in place).
    pub(super) fn append(&mut self, other: Edge) {
        for seg in other.segs {
            self.push(seg);
        }
    }

    /// Keeps the first `k` tokens and returns the rest.
    pub(super) fn split_off(&mut self, k: usize) -> Edge {
        debug_assert!(k <= self.len);
        let mut tail = Edge::default();
        let mut seen = 0;
        let mut keep = self.segs.len();
        for (i, seg) in self.segs.iter_mut().enumerate() {
            let n = seg.len();
            if seen + n > k {
                let at = k - seen;
                keep = if at == 0 { i } else { i + 1 };
                if at > 0 {
                    let rest = match seg {
                        Seg::Text(t) => Seg::Text(t.split_off(at)),
                        Seg::Item { id, rows } => {
                            let mid = row_at(rows, at);
                            let rest = Seg::Item { id: Arc::clone(id), rows: mid..rows.end };
                            rows.end = mid;
                            rest
                        }
                    };
                    tail.push(rest);
                }
                break;
            }
            seen += n;
        }
        for seg in self.segs.drain(keep..) {
            tail.push(seg);
        }
        self.len = k;
        self.segs.shrink_to_fit();
        if let Some(Seg::Text(t)) = self.segs.last_mut() {
            t.shrink_to_fit();
        }
        tail
    }

    /// Drops everything after the first `k` tokens.
    pub(super) fn truncate(&mut self, k: usize) {
        drop(self.split_off(k));
    }

    /// Heap bytes held by the label.
    pub(super) fn heap_bytes(&self) -> usize {
        let own = self.segs.capacity() * std::mem::size_of::<Seg>();
        let text: usize = self
            .segs
            .iter()
            .map(|s| match s {
                Seg::Text(t) => t.capacity() * std::mem::size_of::<u32>(),
                Seg::Item { .. } => 0,
            })
            .sum();
        own + text
    }

    /// Length of the common prefix of this edge and the query at `q` (at most
    /// `max` tokens); advances `q` past it. Item spans match only when the
    /// fingerprint and row agree and `v` confirms the identity.
    pub(super) fn common_prefix(&self, q: &mut Cursor<'_>, max: usize, v: &mut Validator) -> usize {
        let mut matched = 0;
        for seg in &self.segs {
            let mut off = 0;
            while off < seg.len() && matched < max {
                let Some((atom, qo)) = q.current() else { return matched };
                let room = max - matched;
                let n = match (seg, atom) {
                    (Seg::Text(e), Atom::Text(t)) => {
                        let (a, b) = (&e[off..], &t[qo..]);
                        let lim = a.len().min(b.len()).min(room);
                        common_len(&a[..lim], &b[..lim])
                    }
                    (Seg::Item { id, rows }, Atom::Item { id: qid, rows: qrows }) => {
                        let same_row = row_at(rows, off) == row_at(qrows, qo);
                        if same_row && id.fingerprint == qid.fingerprint && v.confirm(id, qid) {
                            (seg.len() - off).min(qrows.len() - qo).min(room)
                        } else {
                            0
                        }
                    }
                    _ => 0,
                };
                if n == 0 {
                    return matched;
                }
                matched += n;
                off += n;
                q.advance(n);
            }
            if matched == max {
                break;
            }
        }
        matched
    }
}

/// Length of the common prefix of two token runs. Whole chunks compare as
/// slices (vectorised memcmp), first 1024 tokens at a time, then 64 inside
/// the first unequal chunk, then one by one: a 30k-token text edge compares
/// in a few microseconds instead of one token per cycle.
fn common_len(a: &[u32], b: &[u32]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut done = 0;
    for chunk in [1024, 64, 1] {
        let equal = a[done..].chunks(chunk).zip(b[done..].chunks(chunk)).take_while(|(x, y)| x == y).count();
        done = (done + equal * chunk).min(n);
    }
    done
}

/// A position inside a prompt's atoms.
#[derive(Debug, Clone)]
pub(super) struct Cursor<'a> {
    atoms: &'a [Atom],
    idx: usize,
    off: usize,
}

impl<'a> Cursor<'a> {
    pub(super) fn new(atoms: &'a [Atom]) -> Self {
        Cursor { atoms, idx: 0, off: 0 }
    }

    /// The atom under the cursor and the offset inside it, skipping empty atoms.
    fn current(&mut self) -> Option<(&'a Atom, usize)> {
        while let Some(atom) = self.atoms.get(self.idx) {
            if self.off < atom.len() {
                return Some((atom, self.off));
            }
            self.idx += 1;
            self.off = 0;
        }
        None
    }

    /// The head key of the next token, if any.
    pub(super) fn head(&mut self) -> Option<Head> {
        let (atom, off) = self.current()?;
        Some(match atom {
            Atom::Text(t) => Head::Text(t[off]),
            Atom::Item { id, rows } => Head::Item(id.fingerprint, row_at(rows, off)),
        })
    }

    /// Moves `n` tokens forward (stops at the end).
    pub(super) fn advance(&mut self, mut n: usize) {
        while n > 0 {
            let Some((atom, off)) = self.current() else { return };
            let step = (atom.len() - off).min(n);
            self.off += step;
            n -= step;
        }
    }

    /// The next `n` tokens as an edge label; advances past them.
    pub(super) fn take_edge(&mut self, mut n: usize) -> Edge {
        let mut edge = Edge::default();
        while n > 0 {
            let Some((atom, off)) = self.current() else { break };
            let step = (atom.len() - off).min(n);
            edge.push(match atom {
                Atom::Text(t) => Seg::Text(t[off..off + step].to_vec()),
                Atom::Item { id, rows } => {
                    Seg::Item { id: Arc::clone(id), rows: row_at(rows, off)..row_at(rows, off + step) }
                }
            });
            self.off += step;
            n -= step;
        }
        if let Some(Seg::Text(t)) = edge.segs.last_mut() {
            t.shrink_to_fit();
        }
        edge
    }
}

/// Confirms item hits with the evidence they carry, remembering the last
/// confirmed pair (an item split into many spans is validated once) and
/// counting failures.
#[derive(Debug, Default)]
pub(super) struct Validator {
    last_ok: Option<(*const ItemIdentity, *const ItemIdentity)>,
    /// Fingerprint hits that failed validation.
    pub(super) failures: u64,
}

impl Validator {
    fn confirm(&mut self, cached: &Arc<ItemIdentity>, query: &Arc<ItemIdentity>) -> bool {
        let pair = (Arc::as_ptr(cached), Arc::as_ptr(query));
        if self.last_ok == Some(pair) {
            return true;
        }
        if confirm(cached, query).is_ok() {
            self.last_ok = Some(pair);
            true
        } else {
            self.failures += 1;
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canon::{Evidence, ItemLayout, Modality};

    fn item(fp: u128, check: u128) -> Arc<ItemIdentity> {
        Arc::new(ItemIdentity {
            fingerprint: Fingerprint(fp),
            evidence: Evidence::SecondDigest(Fingerprint(check)),
            modality: Modality::Video,
            layout: ItemLayout::Video { grid_thw: [2, 4, 4], seconds_per_grid: 2.0 },
            num_tokens: 8,
            content_bytes: 0,
        })
    }

    fn label(atoms: &[Atom]) -> Edge {
        let total = atoms.iter().map(Atom::len).sum();
        Cursor::new(atoms).take_edge(total)
    }

    #[test]
    fn common_len_finds_the_first_difference_in_any_chunk() {
        let a: Vec<u32> = (0..3000).collect();
        for at in [0, 1, 63, 64, 65, 127, 128, 1023, 1024, 1100, 2047, 2999] {
            let mut b = a.clone();
            b[at] += 1;
            assert_eq!(common_len(&a, &b), at, "difference at {at}");
        }
        assert_eq!(common_len(&a, &a), 3000);
        assert_eq!(common_len(&a[..70], &a), 70);
        assert_eq!(common_len(&a, &a[..1130]), 1130);
        assert_eq!(common_len(&[], &a), 0);
    }

    #[test]
    fn contiguous_atoms_merge_and_split_restores_them() {
        let v = item(1, 1);
        let atoms = [
            Atom::Text(vec![1, 2]),
            Atom::Text(vec![3]),
            Atom::Item { id: Arc::clone(&v), rows: 0..3 },
            Atom::Item { id: Arc::clone(&v), rows: 3..8 },
        ];
        let mut edge = label(&atoms);
        assert_eq!((edge.len(), edge.segs.len()), (11, 2), "runs merge into one text and one item piece");
        let tail = edge.split_off(5);
        assert_eq!((edge.len(), tail.len()), (5, 6));
        assert_eq!(tail.head(), Some(Head::Item(Fingerprint(1), 2)));
        edge.append(tail);
        assert_eq!((edge.len(), edge.segs.len()), (11, 2), "re-joined pieces merge again");
        edge.truncate(2);
        assert_eq!((edge.len(), edge.head()), (2, Some(Head::Text(1))));
    }

    #[test]
    fn item_spans_compare_whole_and_a_collision_is_a_counted_miss() {
        let cached = label(&[Atom::Text(vec![9]), Atom::Item { id: item(5, 50), rows: 0..8 }]);
        let same = item(5, 50);
        let split = [
            Atom::Text(vec![9]),
            Atom::Item { id: Arc::clone(&same), rows: 0..4 },
            Atom::Item { id: Arc::clone(&same), rows: 4..8 },
        ];
        let mut v = Validator::default();
        assert_eq!(cached.common_prefix(&mut Cursor::new(&split), usize::MAX, &mut v), 9);
        assert_eq!(v.failures, 0);
        let colliding = [Atom::Text(vec![9]), Atom::Item { id: item(5, 51), rows: 0..8 }];
        assert_eq!(cached.common_prefix(&mut Cursor::new(&colliding), usize::MAX, &mut v), 1);
        assert_eq!(v.failures, 1);
        let shifted = [Atom::Text(vec![9]), Atom::Item { id: same, rows: 1..8 }];
        assert_eq!(cached.common_prefix(&mut Cursor::new(&shifted), usize::MAX, &mut v), 1);
        assert_eq!(cached.common_prefix(&mut Cursor::new(&split), 6, &mut v), 6, "stops at the limit");
    }
}
