//! Tier accounting (issue 25 item 10, spec (e)): the bytes a node holds in each tier, counted
//! where its tables change so a status request costs O(1), never a walk of millions of keys.
//!
//! What is counted, by tier (the spec's "honest tier emulation"):
//! - **NVMM tables**: a head's key table (key → stamp, the oracle) and value table. They are
//!   DRAM hash tables on this machine but stand for the paper's NVMM hash tables, so their
//!   bytes are charged at the NVMM price.
//! - **NVMM buffer**: the log/buffer ring in `/dev/shm`; the driver owns it and adds its bytes
//!   (`nvmm_buffer_used_bytes`, `nvmm_buffer_mapped_bytes`, see `proto::TierReport`).
//! - **DRAM**: a backup's index (key → stamp, SSD location), the popularity list, the slots of
//!   the in-memory Raft log.
//! - **SSD**: a backup's segments: live bytes (the entries its index points at: the newest
//!   version of every key, counted by the index itself) and allocated bytes (what the files
//!   take, stale versions and page padding included: `ssd::Space`).
//!
//! A table's bytes are its heap allocations as glibc's malloc hands them out
//! ([`alloc_bytes`]: a key of 24 B takes a 32 B chunk, a 1 KiB value a 1040 B one) plus the
//! hash table's slot array at its current capacity (one `(key, value)` slot and one control
//! byte per bucket). Capacity is read at report time (O(1)); the heap bytes are a counter kept
//! by [`CountedMap`], whose only mutators keep it exact, and `check_invariants_deep` recounts.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};

use crate::witness::proto::{Stamp, TierReport};

use super::page::Loc;

/// Bytes glibc's malloc takes for an allocation of `cap` bytes: 8 B of chunk header, 16 B
/// alignment, 32 B minimum (x86-64). Counting requested bytes instead would hide ~25% on
/// 24 B keys, and RSS would then look unexplained.
pub fn alloc_bytes(cap: usize) -> u64 {
    if cap == 0 {
        return 0;
    }
    (((cap + 8 + 15) / 16) * 16).max(32) as u64
}

/// Bytes a table value owns beyond its slot: on the heap, and on SSD (the entry a backup's
/// index entry points at).
pub trait HeapBytes {
    fn heap_bytes(&self) -> u64;
    fn ssd_bytes(&self) -> u64 {
        0
    }
}

impl HeapBytes for Stamp {
    fn heap_bytes(&self) -> u64 {
        0
    }
}

impl HeapBytes for (Stamp, Loc) {
    fn heap_bytes(&self) -> u64 {
        0
    }
    fn ssd_bytes(&self) -> u64 {
        self.1.len as u64
    }
}

impl HeapBytes for (Stamp, Vec<u8>) {
    fn heap_bytes(&self) -> u64 {
        alloc_bytes(self.1.capacity())
    }
}

/// A key-addressed table that knows its bytes. Reads go through `Deref` to the `HashMap`;
/// every mutation goes through the methods here (`get_mut` hands out a [`CountedMut`]), so the
/// counters cannot drift: a new mutation site that bypasses them does not compile.
#[derive(Clone, Debug)]
pub struct CountedMap<V> {
    map: HashMap<Vec<u8>, V>,
    /// Heap bytes of the keys and values held ([`alloc_bytes`] of each allocation).
    heap_bytes: u64,
    /// SSD bytes the values point at (a backup's index: the newest version of every key).
    ssd_bytes: u64,
}

impl<V> Default for CountedMap<V> {
    fn default() -> Self {
        CountedMap {
            map: HashMap::new(),
            heap_bytes: 0,
            ssd_bytes: 0,
        }
    }
}

/// A value borrowed for change: its bytes are taken before and counted again when the borrow
/// ends, so an in-place change (a new location, a longer value) keeps the counters exact.
pub struct CountedMut<'a, V: HeapBytes> {
    v: &'a mut V,
    heap_bytes: &'a mut u64,
    ssd_bytes: &'a mut u64,
}

impl<'a, V: HeapBytes> CountedMut<'a, V> {
    fn new(v: &'a mut V, heap_bytes: &'a mut u64, ssd_bytes: &'a mut u64) -> Self {
        *heap_bytes -= v.heap_bytes();
        *ssd_bytes -= v.ssd_bytes();
        CountedMut {
            v,
            heap_bytes,
            ssd_bytes,
        }
    }
}

impl<V: HeapBytes> Deref for CountedMut<'_, V> {
    type Target = V;
    fn deref(&self) -> &V {
        self.v
    }
}

impl<V: HeapBytes> DerefMut for CountedMut<'_, V> {
    fn deref_mut(&mut self) -> &mut V {
        self.v
    }
}

impl<V: HeapBytes> Drop for CountedMut<'_, V> {
    fn drop(&mut self) {
        *self.heap_bytes += self.v.heap_bytes();
        *self.ssd_bytes += self.v.ssd_bytes();
    }
}

impl<V> Deref for CountedMap<V> {
    type Target = HashMap<Vec<u8>, V>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl<'a, V> IntoIterator for &'a CountedMap<V> {
    type Item = (&'a Vec<u8>, &'a V);
    type IntoIter = std::collections::hash_map::Iter<'a, Vec<u8>, V>;
    fn into_iter(self) -> Self::IntoIter {
        self.map.iter()
    }
}

impl<V: HeapBytes> CountedMap<V> {
    /// As `HashMap::insert`: on a replace the map keeps its own key and drops `k`.
    pub fn insert(&mut self, k: Vec<u8>, v: V) -> Option<V> {
        let add_key = alloc_bytes(k.capacity());
        self.heap_bytes += v.heap_bytes();
        self.ssd_bytes += v.ssd_bytes();
        let old = self.map.insert(k, v);
        match &old {
            Some(o) => {
                self.heap_bytes -= o.heap_bytes();
                self.ssd_bytes -= o.ssd_bytes();
            }
            None => self.heap_bytes += add_key,
        }
        old
    }

    pub fn remove(&mut self, k: &[u8]) -> Option<V> {
        let (key, v) = self.map.remove_entry(k)?;
        self.heap_bytes -= alloc_bytes(key.capacity()) + v.heap_bytes();
        self.ssd_bytes -= v.ssd_bytes();
        Some(v)
    }

    pub fn get_mut(&mut self, k: &[u8]) -> Option<CountedMut<'_, V>> {
        let v = self.map.get_mut(k)?;
        Some(CountedMut::new(
            v,
            &mut self.heap_bytes,
            &mut self.ssd_bytes,
        ))
    }

    /// The value at `k`, inserting `default` first if absent.
    pub fn get_or_insert(&mut self, k: Vec<u8>, default: V) -> CountedMut<'_, V> {
        if !self.map.contains_key(&k) {
            self.heap_bytes += alloc_bytes(k.capacity()) + default.heap_bytes();
            self.ssd_bytes += default.ssd_bytes();
        }
        let v = self.map.entry(k).or_insert(default);
        CountedMut::new(v, &mut self.heap_bytes, &mut self.ssd_bytes)
    }

    /// Drops everything and the table's memory with it (an old primary's value table, M24).
    pub fn clear_and_free(&mut self) {
        *self = CountedMap::default();
    }

    /// Room for `additional` more keys without a resize (slot bytes are counted from the
    /// capacity at report time).
    pub fn reserve(&mut self, additional: usize) {
        self.map.reserve(additional);
    }

    /// Gives back slot capacity the table no longer needs (after a bulk load or a drop).
    pub fn shrink_to_fit(&mut self) {
        self.map.shrink_to_fit();
    }

    /// Heap bytes as counted.
    pub fn heap_bytes(&self) -> u64 {
        self.heap_bytes
    }

    /// SSD bytes the values point at, as counted.
    pub fn ssd_bytes(&self) -> u64 {
        self.ssd_bytes
    }

    /// (heap, SSD) bytes recounted by a walk (`check_invariants_deep` only).
    pub fn recount(&self) -> (u64, u64) {
        self.map.iter().fold((0, 0), |(h, s), (k, v)| {
            (
                h + alloc_bytes(k.capacity()) + v.heap_bytes(),
                s + v.ssd_bytes(),
            )
        })
    }

    /// The slot array at its capacity: one `(key, value)` slot and one control byte per bucket
    /// (hashbrown; buckets are a power of two above capacity ÷ 7/8), plus the allocation.
    pub fn table_bytes(&self) -> u64 {
        let cap = self.map.capacity();
        if cap == 0 {
            return 0;
        }
        let buckets = if cap < 8 {
            (cap + 1).next_power_of_two()
        } else {
            (cap * 8 / 7).next_power_of_two()
        };
        let slot = std::mem::size_of::<(Vec<u8>, V)>() + 1;
        alloc_bytes(buckets * slot + 16)
    }

    /// Everything this table holds in memory.
    pub fn bytes(&self) -> u64 {
        self.heap_bytes + self.table_bytes()
    }
}

/// Per-entry DRAM of the popularity list (`popularity::PopularityLru`): two B-tree entries
/// (key → count and recency, recency → key), node overhead included (~1.5× the payload at
/// B-tree fill), and two key allocations. The list is bounded (`popular_keys_max`), so an
/// estimate from its length and the node's mean key size is enough, and costs no hook in the
/// generic list.
pub fn popularity_bytes(entries: usize, mean_key_alloc_bytes: u64) -> u64 {
    let payload = 2 * std::mem::size_of::<Vec<u8>>() + 3 * 8;
    entries as u64 * (payload as u64 * 3 / 2 + 2 * mean_key_alloc_bytes)
}

/// What the core knows of its tiers (the driver adds the NVMM buffer and the process RSS).
pub(super) fn core_report(
    keys: &CountedMap<Stamp>,
    values: &CountedMap<(Stamp, Vec<u8>)>,
    index: &CountedMap<(Stamp, Loc)>,
    popular_entries: usize,
    log_slot_bytes: u64,
    ssd_allocated_bytes: u64,
) -> TierReport {
    let key_count = (keys.len() + index.len()) as u64;
    let mean_key = if key_count == 0 {
        0
    } else {
        // Key heap only: stamps and locations own no heap.
        (keys.heap_bytes() + index.heap_bytes()) / key_count
    };
    TierReport {
        nvmm_key_table_bytes: keys.bytes(),
        nvmm_value_table_bytes: values.bytes(),
        nvmm_buffer_used_bytes: 0,
        nvmm_buffer_mapped_bytes: 0,
        dram_index_bytes: index.bytes(),
        dram_popularity_bytes: popularity_bytes(popular_entries, mean_key),
        dram_log_bytes: log_slot_bytes,
        ssd_live_bytes: index.ssd_bytes(),
        ssd_allocated_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ST: Stamp = Stamp { term: 1, index: 1 };

    #[test]
    fn malloc_chunks_round_as_glibc_does() {
        assert_eq!(alloc_bytes(0), 0);
        assert_eq!(alloc_bytes(1), 32);
        assert_eq!(alloc_bytes(24), 32);
        assert_eq!(alloc_bytes(25), 48);
        assert_eq!(alloc_bytes(1024), 1040);
    }

    /// The counter follows inserts, replaces (the map keeps its first key), removes and a
    /// clear, and always equals the recount.
    #[test]
    fn counted_map_tracks_every_mutation() {
        let mut m: CountedMap<(Stamp, Vec<u8>)> = CountedMap::default();
        assert_eq!(m.bytes(), 0);
        m.insert(b"k1".to_vec(), (ST, vec![0; 1024]));
        assert_eq!(m.heap_bytes(), 32 + 1040);
        // A replace with a smaller value: the key is not counted twice.
        let old = m.insert(b"k1".to_vec(), (ST, vec![0; 100]));
        assert_eq!(old.map(|o| o.1.len()), Some(1024));
        assert_eq!(m.heap_bytes(), 32 + alloc_bytes(100));
        m.insert(b"k2".to_vec(), (ST, vec![0; 1024]));
        assert_eq!((m.heap_bytes(), m.ssd_bytes()), m.recount());
        assert!(m.remove(b"nope").is_none());
        m.remove(b"k1").unwrap();
        assert_eq!(m.heap_bytes(), 32 + 1040);
        assert_eq!((m.heap_bytes(), m.ssd_bytes()), m.recount());
        assert!(m.table_bytes() > 0 && m.bytes() > m.heap_bytes());
        m.clear_and_free();
        assert_eq!((m.bytes(), m.len()), (0, 0));
    }

    /// A change through `get_mut` or `get_or_insert` is counted when the borrow ends.
    #[test]
    fn in_place_changes_are_recounted() {
        let mut m: CountedMap<Stamp> = CountedMap::default();
        *m.get_or_insert(b"a".to_vec(), Stamp::ZERO) = ST;
        *m.get_or_insert(b"a".to_vec(), Stamp::ZERO) = ST;
        assert_eq!(m.len(), 1);
        assert_eq!(m.heap_bytes(), 32);
        *m.get_mut(b"a").unwrap() = Stamp { term: 2, index: 5 };
        assert_eq!((m.heap_bytes(), m.ssd_bytes()), m.recount());

        let loc = |len| Loc {
            seg: 1,
            off: 0,
            len,
        };
        let mut idx: CountedMap<(Stamp, Loc)> = CountedMap::default();
        idx.insert(b"k".to_vec(), (ST, loc(1000)));
        idx.insert(b"j".to_vec(), (ST, loc(50)));
        assert_eq!(idx.ssd_bytes(), 1050);
        // A newer version at a new place (a writeback), then a GC move.
        *idx.get_mut(b"k").unwrap() = (Stamp { term: 1, index: 9 }, loc(20));
        idx.get_mut(b"j").unwrap().1 = loc(60);
        assert_eq!(idx.ssd_bytes(), 80);
        assert_eq!((idx.heap_bytes(), idx.ssd_bytes()), idx.recount());
        idx.remove(b"k");
        assert_eq!(idx.ssd_bytes(), 60);

        let mut vals: CountedMap<(Stamp, Vec<u8>)> = CountedMap::default();
        vals.insert(b"k".to_vec(), (ST, vec![1; 10]));
        vals.get_mut(b"k").unwrap().1 = vec![2; 2000];
        assert_eq!(vals.heap_bytes(), 32 + alloc_bytes(2000));
        assert_eq!((vals.heap_bytes(), vals.ssd_bytes()), vals.recount());
    }

    /// The slot array is charged at capacity: 100k keys → 128k buckets of (Vec, Stamp) + 1.
    #[test]
    fn table_bytes_follow_hashbrown_buckets() {
        let mut m: CountedMap<Stamp> = CountedMap::default();
        for i in 0..100_000u32 {
            m.insert(i.to_le_bytes().to_vec(), ST);
        }
        let slot = std::mem::size_of::<(Vec<u8>, Stamp)>() as u64 + 1;
        let buckets = m.table_bytes() / slot;
        assert!(buckets >= 114_286 && buckets <= 131_073, "{buckets}");
        assert_eq!(m.heap_bytes(), 100_000 * 32);
    }
}
