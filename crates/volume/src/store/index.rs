//! The in-memory index: objects to slots, the free lists per class, the reservations for `super`
//! children, and the deferred copies of each parent.

use super::*;

#[derive(Default)]
pub(super) struct Index {
    pub(super) objects: HashMap<ObjKey, Entry>,
    /// Free slots per class: the most recently freed is taken first (its pages are likely still
    /// cached); the refill adds at the front and the trim removes from the front.
    pub(super) free: [VecDeque<SlotRef>; CLASSES],
    pub(super) next_slot_no: [u64; CLASSES],
    /// Classes the refill keeps stocked: those with any slot file, or asked for since open.
    pub(super) in_use: [bool; CLASSES],
    /// Free slots the refill keeps ready now, per class.
    pub(super) target: [usize; CLASSES],
    /// A write of the class found no free slot since the refill last lowered the target.
    pub(super) ran_dry: [bool; CLASSES],
    /// Slots owed to `super` children: one per first write they may still make (per class, the
    /// largest reservation asked for, at most [`PoolOptions::reserved_slots_max`]). Only a
    /// child's first write counts one off. The child's burst may start seconds after `super`,
    /// or the refill may need more than a decay period to make them on a busy disk, so the
    /// reservation lasts until [`RESERVE_IDLE_MS`] pass without a child taking one.
    pub(super) reserved: [usize; CLASSES],
    /// The ready slots of the reservation: a free list of their own, which only a child's first
    /// write takes from (every other allocation — a general clone's copy-ups, a fill, a move —
    /// takes from `free`). With one shared list, other bursts drained the child's stock, and at
    /// depth 32 the child's writes met a dry pool: slots made inline (a directory fsync) and the
    /// refill writing batches of zeroes under them. Kept at most `reserved` long; stocked first
    /// from free slots (moved in memory: `super` pre-stocks at once whatever the pool holds),
    /// then from freed slots and the refill.
    pub(super) reserved_free: [VecDeque<SlotRef>; CLASSES],
    /// When a reservation was last made or used, in µs since open.
    pub(super) reserved_touched_us: [u64; CLASSES],
    /// Parent → its children that are deferred copies of it (see [`Base`]).
    pub(super) lazy_children: HashMap<ObjKey, Vec<ObjKey>>,
}

impl Index {
    /// Free slots (of `free`) the refill keeps ready in a class: the adaptive target, at most
    /// the class maximum.
    pub(super) fn goal(&self, class: usize, max: &[usize; CLASSES]) -> usize {
        self.target[class].min(max[class])
    }

    /// Ready slots the reservation of a class still lacks.
    pub(super) fn reserve_deficit(&self, class: usize) -> usize {
        self.reserved[class].saturating_sub(self.reserved_free[class].len())
    }

    /// Moves free slots into the reservation while it lacks any (the most recently freed
    /// first), and gives back to `free` any ready slots beyond what is still owed.
    pub(super) fn rebalance_reserve(&mut self, class: usize) {
        while self.reserve_deficit(class) > 0 {
            let Some(slot) = self.free[class].pop_back() else { break };
            self.reserved_free[class].push_back(slot);
        }
        while self.reserved_free[class].len() > self.reserved[class] {
            let slot = self.reserved_free[class].pop_front().expect("longer than zero");
            self.free[class].push_front(slot);
        }
    }

    /// Puts a slot that holds nothing back: into the reservation if it lacks slots, else into
    /// the free list.
    pub(super) fn put_free(&mut self, slot: SlotRef) {
        if self.reserve_deficit(slot.class) > 0 {
            self.reserved_free[slot.class].push_back(slot);
        } else {
            self.free[slot.class].push_back(slot);
        }
    }

    /// Enters (or replaces) an object, keeping `lazy_children` in step.
    pub(super) fn insert(&mut self, key: ObjKey, e: Entry) -> Option<Entry> {
        let old = self.objects.insert(key, e);
        if let Some(b) = old.and_then(|o| o.base) {
            self.forget_child(b.key, key);
        }
        if let Some(b) = e.base {
            self.lazy_children.entry(b.key).or_default().push(key);
        }
        old
    }

    pub(super) fn remove(&mut self, key: &ObjKey) -> Option<Entry> {
        let old = self.objects.remove(key);
        if let Some(b) = old.and_then(|o| o.base) {
            self.forget_child(b.key, *key);
        }
        old
    }

    pub(super) fn forget_child(&mut self, parent: ObjKey, child: ObjKey) {
        if let Some(v) = self.lazy_children.get_mut(&parent) {
            v.retain(|c| *c != child);
            if v.is_empty() {
                self.lazy_children.remove(&parent);
            }
        }
    }
}
