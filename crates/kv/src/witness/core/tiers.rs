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
//! - **SSD**: a backup's segments: live bytes (referenced entries) and allocated bytes (what
//!   the files take, GC slack included), both kept by `ssd::Space`.
//!
//! A table's bytes are its heap allocations as glibc's malloc hands them out
//! ([`alloc_bytes`]: a key of 24 B takes a 32 B chunk, a 1 KiB value a 1040 B one) plus the
//! hash table's slot array at its current capacity (one `(key, value)` slot and one control
//! byte per bucket). Capacity is read at report time (O(1)); the heap bytes are a counter kept
//! by [`CountedMap`], whose only mutators keep it exact, and `check_invariants_deep` recounts.

use std::collections::HashMap;
use std::ops::Deref;

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

/// Heap bytes a table value owns beyond its slot.
pub trait HeapBytes {
    fn heap_bytes(&self) -> u64;
}

/// A value whose heap bytes cannot change in place, so `get_mut` may hand it out.
pub trait FixedHeap: HeapBytes {}

impl HeapBytes for Stamp {
    fn heap_bytes(&self) -> u64 {
        0
    }
}
impl FixedHeap for Stamp {}

impl HeapBytes for (Stamp, Loc) {
    fn heap_bytes(&self) -> u64 {
        0
    }
}
impl FixedHeap for (Stamp, Loc) {}

impl HeapBytes for (Stamp, Vec<u8>) {
    fn heap_bytes(&self) -> u64 {
        alloc_bytes(self.1.capacity())
    }
}

/// A key-addressed table that knows its heap bytes. Reads go through `Deref` to the
/// `HashMap`; every mutation goes through the methods here, so the counter cannot drift (a new
/// mutation site that bypasses it does not compile).
#[derive(Clone, Debug)]
pub struct CountedMap<V> {
    map: HashMap<Vec<u8>, V>,
    /// Heap bytes of the keys and values held ([`alloc_bytes`] of each allocation).
    heap_bytes: u64,
}

impl<V> Default for CountedMap<V> {
    fn default() -> Self {
        CountedMap {
            map: HashMap::new(),
            heap_bytes: 0,
        }
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
        let old = self.map.insert(k, v);
        match &old {
            Some(o) => self.heap_bytes -= o.heap_bytes(),
            None => self.heap_bytes += add_key,
        }
        old
    }

    pub fn remove(&mut self, k: &[u8]) -> Option<V> {
        let (key, v) = self.map.remove_entry(k)?;
        self.heap_bytes -= alloc_bytes(key.capacity()) + v.heap_bytes();
        Some(v)
    }

    /// Drops everything and the table's memory with it (an old primary's value table, M24).
    pub fn clear_and_free(&mut self) {
        *self = CountedMap::default();
    }

    /// Gives back slot capacity the table no longer needs (after a bulk load or a drop).
    pub fn shrink_to_fit(&mut self) {
        self.map.shrink_to_fit();
    }

    /// Heap bytes as counted.
    pub fn heap_bytes(&self) -> u64 {
        self.heap_bytes
    }

    /// Heap bytes recounted by a walk (`check_invariants_deep` only).
    pub fn recount_heap_bytes(&self) -> u64 {
        self.map
            .iter()
            .map(|(k, v)| alloc_bytes(k.capacity()) + v.heap_bytes())
            .sum()
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

impl<V: FixedHeap> CountedMap<V> {
    pub fn get_mut(&mut self, k: &[u8]) -> Option<&mut V> {
        self.map.get_mut(k)
    }

    /// The value at `k`, inserting `default` first if absent.
    pub fn get_or_insert(&mut self, k: Vec<u8>, default: V) -> &mut V {
        if !self.map.contains_key(&k) {
            self.heap_bytes += alloc_bytes(k.capacity()) + default.heap_bytes();
        }
        self.map.entry(k).or_insert(default)
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
    ssd_live_bytes: u64,
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
        ssd_live_bytes,
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
        assert_eq!(m.heap_bytes(), m.recount_heap_bytes());
        assert!(m.remove(b"nope").is_none());
        m.remove(b"k1").unwrap();
        assert_eq!(m.heap_bytes(), 32 + 1040);
        assert_eq!(m.heap_bytes(), m.recount_heap_bytes());
        assert!(m.table_bytes() > 0 && m.bytes() > m.heap_bytes());
        m.clear_and_free();
        assert_eq!((m.bytes(), m.len()), (0, 0));
    }

    #[test]
    fn fixed_values_may_change_in_place() {
        let mut m: CountedMap<Stamp> = CountedMap::default();
        *m.get_or_insert(b"a".to_vec(), Stamp::ZERO) = ST;
        *m.get_or_insert(b"a".to_vec(), Stamp::ZERO) = ST;
        assert_eq!(m.len(), 1);
        assert_eq!(m.heap_bytes(), 32);
        *m.get_mut(b"a").unwrap() = Stamp { term: 2, index: 5 };
        assert_eq!(m.heap_bytes(), m.recount_heap_bytes());
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
