//! The backup's SSD space as the core sees it (paper §3.2–§3.3; spec M7–M10): which segments
//! exist, in which log (hot or cold), how far each is written and durable, and how many bytes
//! of each the DRAM index and the recent-log window still reference. Sans-I/O.
//!
//! The core decides *what* is written and *where* (segment, offset), because it owns the index
//! that must name every location (a PriorityPull reads exactly the page the index names) and
//! because GC must know which bytes are still referenced to free a segment safely. The driver
//! only carries out `SsdWrite`/`SsdRead`/`SsdFree` on `O_DIRECT` segment files.
//!
//! GC (M9) works on this accounting: every location the index or a recent-log slot holds is a
//! *reference* of its segment; a segment's live bytes are the framed bytes of its referenced
//! entries. The victim is the sealed segment with the fewest live bytes (the paper's "collect
//! only mostly-invalid batches"); its live entries are rewritten, the references move, and only
//! a segment with no reference left (and no read in flight) is ever freed.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::page::{round_up_page, Loc};

/// The backup's two SSD logs (§3.3: popular keys in the hot log, the rest in the cold one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum SsdLog {
    Hot,
    Cold,
}

impl SsdLog {
    /// The segment file name prefix.
    pub fn name(self) -> &'static str {
        match self {
            SsdLog::Hot => "hot",
            SsdLog::Cold => "cold",
        }
    }
    fn slot(self) -> usize {
        self as usize
    }
}

/// How a backup places entries on SSD (`Params::ssd_logs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SsdLogs {
    /// Popular keys (the backup's popularity LRU, M10) in the hot log, the rest in the cold one;
    /// GC moves entries between them as popularity changes.
    #[default]
    HotCold,
    /// Everything in one log (the spec's `single-log` ablation).
    Single,
}

/// The SSD I/O priority classes, highest first (§5.3, §7.7): a PriorityPull (a client Get is
/// waiting) overtakes writeback (the NVMM buffer fills if it starves), which overtakes the bulk
/// BatchPull, which overtakes GC. One enum for the core's outputs and the driver's I/O pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum IoClass {
    PriorityPull = 0,
    Writeback = 1,
    BatchPull = 2,
    Gc = 3,
}

/// One segment's accounting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seg {
    pub log: SsdLog,
    /// Bytes allocated (writes in flight included), a page multiple.
    pub end: u64,
    /// Framed bytes of the entries something references, once per reference (the index and a
    /// recent-index window slot may both reference one entry): a GC victim weight, not a size.
    pub live_bytes: u64,
    /// Locations in this segment the index or the recent-log window holds.
    pub refs: u64,
    /// Writes in flight: write id → offset.
    pending: BTreeMap<u64, u64>,
    /// Reads in flight (a segment is freed only with none: a read never meets a freed file).
    pub reads: u32,
    /// A GC pass rewrote what it could decode and references were left (a corrupt page): never
    /// picked again, never freed.
    pub gc_stuck: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Space {
    segs: BTreeMap<u64, Seg>,
    active: [Option<u64>; 2],
    next_seg: u64,
    refs_total: u64,
}

impl Default for Space {
    fn default() -> Self {
        Space {
            segs: BTreeMap::new(),
            active: [None, None],
            next_seg: 1,
            refs_total: 0,
        }
    }
}

impl Space {
    /// Reserves `bytes` (a page multiple) at the end of `log`'s active segment, or of a new one
    /// when the batch would take the active one past `segment_bytes` (a batch larger than a
    /// segment gets a segment of its own). The write `id` is pending until [`Space::written`].
    pub fn alloc(&mut self, log: SsdLog, bytes: u64, segment_bytes: u64, id: u64) -> (u64, u64) {
        let fits = self.active[log.slot()]
            .and_then(|s| self.segs.get(&s).map(|g| (s, g.end)))
            .filter(|&(_, end)| end == 0 || end + bytes <= segment_bytes);
        let seg = match fits {
            Some((s, _)) => s,
            None => {
                let s = self.next_seg;
                self.next_seg += 1;
                self.segs.insert(
                    s,
                    Seg {
                        log,
                        end: 0,
                        live_bytes: 0,
                        refs: 0,
                        pending: BTreeMap::new(),
                        reads: 0,
                        gc_stuck: false,
                    },
                );
                self.active[log.slot()] = Some(s);
                s
            }
        };
        let g = self.segs.get_mut(&seg).expect("allocated segment exists");
        let off = g.end;
        g.end += bytes;
        g.pending.insert(id, off);
        (seg, off)
    }

    /// A write is durable (or is being retried under `new_id`).
    pub fn written(&mut self, seg: u64, id: u64, new_id: Option<u64>) {
        if let Some(g) = self.segs.get_mut(&seg) {
            if let Some(off) = g.pending.remove(&id) {
                if let Some(n) = new_id {
                    g.pending.insert(n, off);
                }
            }
        }
    }

    /// Bytes of `seg` that are durable and contiguous from 0 (what a BatchPull may read).
    pub fn durable_end(&self, seg: u64) -> u64 {
        self.segs
            .get(&seg)
            .map_or(0, |g| g.pending.values().copied().min().unwrap_or(g.end))
    }

    pub fn seg(&self, seg: u64) -> Option<&Seg> {
        self.segs.get(&seg)
    }

    pub fn segs(&self) -> impl Iterator<Item = (u64, &Seg)> {
        self.segs.iter().map(|(s, g)| (*s, g))
    }

    /// The first segment with id ≥ `seg`.
    pub fn first_from(&self, seg: u64) -> Option<u64> {
        self.segs.range(seg..).next().map(|(s, _)| *s)
    }

    pub fn add_ref(&mut self, loc: Loc) {
        let g = self
            .segs
            .get_mut(&loc.seg)
            .unwrap_or_else(|| panic!("a reference into freed segment {}", loc.seg));
        g.refs += 1;
        g.live_bytes += loc.len as u64;
        self.refs_total += 1;
    }

    pub fn drop_ref(&mut self, loc: Loc) {
        let g = self
            .segs
            .get_mut(&loc.seg)
            .unwrap_or_else(|| panic!("a reference into freed segment {}", loc.seg));
        g.refs -= 1;
        g.live_bytes -= loc.len as u64;
        self.refs_total -= 1;
    }

    pub fn refs_total(&self) -> u64 {
        self.refs_total
    }

    pub fn read_started(&mut self, seg: u64) {
        if let Some(g) = self.segs.get_mut(&seg) {
            g.reads += 1;
        }
    }

    pub fn read_done(&mut self, seg: u64) {
        if let Some(g) = self.segs.get_mut(&seg) {
            g.reads = g.reads.saturating_sub(1);
        }
    }

    /// Bytes the segments take on SSD.
    pub fn used_bytes(&self) -> u64 {
        self.segs.values().map(|g| g.end).sum()
    }

    /// Whether `seg` is a log's active (append) segment.
    pub fn is_active(&self, seg: u64) -> bool {
        self.active.contains(&Some(seg))
    }

    /// The GC victim: the sealed, fully durable segment with the fewest live bytes, among those
    /// whose live entries could take at least a page less than the segment (collecting one
    /// whose live data fills its pages would rewrite as much as it frees, forever), or that
    /// nothing references (an empty file left by a crash included).
    pub fn victim(&self) -> Option<u64> {
        self.segs
            .iter()
            .filter(|(s, g)| {
                !self.is_active(**s)
                    && g.pending.is_empty()
                    && !g.gc_stuck
                    && (g.refs == 0 || round_up_page(g.live_bytes as usize) < g.end as usize)
            })
            .min_by_key(|(s, g)| (g.live_bytes, **s))
            .map(|(s, _)| *s)
    }

    pub fn mark_gc_stuck(&mut self, seg: u64) {
        if let Some(g) = self.segs.get_mut(&seg) {
            g.gc_stuck = true;
        }
    }

    /// Whether `seg` can be freed now: nothing references it, nothing reads or writes it.
    pub fn freeable(&self, seg: u64) -> bool {
        self.segs.get(&seg).is_some_and(|g| {
            g.refs == 0 && g.reads == 0 && g.pending.is_empty() && !self.is_active(seg)
        })
    }

    /// Forgets a segment (the core then tells the driver to free it).
    pub fn free(&mut self, seg: u64) {
        assert!(
            self.freeable(seg),
            "freeing segment {seg} that is still referenced or busy"
        );
        self.segs.remove(&seg);
    }

    /// A segment found at a restart: sealed, `end` bytes of whole entries.
    pub fn restore_seg(&mut self, seg: u64, log: SsdLog, end: u64) {
        self.segs.insert(
            seg,
            Seg {
                log,
                end,
                live_bytes: 0,
                refs: 0,
                pending: BTreeMap::new(),
                reads: 0,
                gc_stuck: false,
            },
        );
        self.next_seg = self.next_seg.max(seg + 1);
    }

    pub fn check_invariants(&self) {
        let mut refs = 0;
        for (s, g) in &self.segs {
            assert!(*s < self.next_seg, "segment id {s} not below the next id");
            // An entry counts once per reference, and at most two reference it (the DRAM index
            // and one recent-index window slot), while distinct entries fit in `end`.
            assert!(
                g.live_bytes <= 2 * g.end,
                "segment {s}: live {} > twice its end {}",
                g.live_bytes,
                g.end
            );
            assert!(
                g.refs > 0 || g.live_bytes == 0,
                "segment {s}: live bytes without refs"
            );
            assert!(
                g.pending.values().all(|o| *o < g.end),
                "segment {s}: write past end"
            );
            refs += g.refs;
        }
        assert_eq!(refs, self.refs_total, "reference count drift");
        for (i, a) in self.active.iter().enumerate() {
            if let Some(a) = a {
                let g = self.segs.get(a).expect("an active segment exists");
                assert_eq!(g.log.slot(), i, "active segment {a} in the wrong log");
            }
        }
    }
}

/// An SSD in memory for simulations and tests (the drivers use `store::ssdlog`): carries out
/// `SsdWrite`/`SsdRead`/`SsdFree` the way the files do and hands the segments back for a
/// restart.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct MemSsd {
    pub segs: BTreeMap<u64, (SsdLog, Vec<u8>)>,
}

impl MemSsd {
    pub fn write(&mut self, seg: u64, log: SsdLog, off: u64, bytes: &[u8]) {
        let f = &mut self.segs.entry(seg).or_insert((log, Vec::new())).1;
        let end = off as usize + bytes.len();
        if f.len() < end {
            f.resize(end, 0);
        }
        f[off as usize..end].copy_from_slice(bytes);
    }

    /// `len` bytes at `off`, zero past the end; a missing segment is an error (as a deleted
    /// file is).
    pub fn read(&self, seg: u64, off: u64, len: u32) -> Result<Vec<u8>, String> {
        let f = &self.segs.get(&seg).ok_or(format!("no segment {seg}"))?.1;
        let mut buf = vec![0u8; len as usize];
        let s = (off as usize).min(f.len());
        let e = (off as usize + len as usize).min(f.len());
        buf[..e - s].copy_from_slice(&f[s..e]);
        Ok(buf)
    }

    pub fn free(&mut self, seg: u64) {
        self.segs.remove(&seg);
    }

    pub fn bytes(&self) -> u64 {
        self.segs.values().map(|(_, b)| b.len() as u64).sum()
    }

    pub fn durable(&self) -> Vec<super::node::DurableSeg> {
        self.segs
            .iter()
            .map(|(s, (log, b))| super::node::DurableSeg {
                seg: *s,
                log: *log,
                bytes: b.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(seg: u64, off: u64, len: u32) -> Loc {
        Loc { seg, off, len }
    }

    #[test]
    fn space_rolls_segments_and_tracks_durable_prefix() {
        let mut sp = Space::default();
        let (s1, o1) = sp.alloc(SsdLog::Hot, 8192, 16384, 1);
        let (s2, o2) = sp.alloc(SsdLog::Hot, 8192, 16384, 2);
        assert_eq!((s1, o1, s2, o2), (1, 0, 1, 8192));
        // The third batch does not fit: a new segment; the cold log has its own.
        let (s3, _) = sp.alloc(SsdLog::Hot, 4096, 16384, 3);
        let (s4, _) = sp.alloc(SsdLog::Cold, 4096, 16384, 4);
        assert_eq!((s3, s4), (2, 3));
        // Write 2 done before write 1: the durable prefix waits for 1.
        sp.written(1, 2, None);
        assert_eq!(sp.durable_end(1), 0);
        sp.written(1, 1, Some(9));
        assert_eq!(sp.durable_end(1), 0, "a retried write is still pending");
        sp.written(1, 9, None);
        assert_eq!(sp.durable_end(1), 16384);
        // A batch larger than a segment gets one of its own.
        let (s5, o5) = sp.alloc(SsdLog::Cold, 65536, 16384, 5);
        assert_eq!((s5, o5), (4, 0));
        sp.check_invariants();
    }

    #[test]
    fn space_victim_is_least_live_and_freeing_needs_no_refs_or_reads() {
        let mut sp = Space::default();
        for id in 1..=3 {
            sp.alloc(SsdLog::Cold, 16384, 16384, id);
            sp.written(id, id, None);
        }
        // Segment 3 is active; 1 has 2 live entries, 2 has one.
        sp.add_ref(loc(1, 0, 100));
        sp.add_ref(loc(1, 4096, 100));
        sp.add_ref(loc(2, 0, 100));
        assert_eq!(sp.victim(), Some(2));
        assert!(!sp.freeable(2));
        sp.drop_ref(loc(2, 0, 100));
        sp.read_started(2);
        assert!(!sp.freeable(2), "a read in flight holds the segment");
        sp.read_done(2);
        assert!(sp.freeable(2));
        sp.free(2);
        assert!(!sp.freeable(3), "the active segment is never freed");
        assert_eq!(sp.victim(), Some(1));
        sp.mark_gc_stuck(1);
        assert_eq!(sp.victim(), None);
        // Live data in every page of a sealed segment: rewriting it would free nothing.
        sp.alloc(SsdLog::Hot, 8192, 8192, 10);
        sp.written(4, 10, None);
        sp.alloc(SsdLog::Hot, 4096, 8192, 11);
        sp.add_ref(loc(4, 0, 4000));
        sp.add_ref(loc(4, 4096, 4000));
        assert_eq!(sp.victim(), None);
        // An empty segment (a crash right after creating it) is collected.
        sp.restore_seg(9, SsdLog::Cold, 0);
        assert_eq!(sp.victim(), Some(9));
        sp.check_invariants();
    }

    #[test]
    #[should_panic(expected = "still referenced")]
    fn space_refuses_to_free_a_referenced_segment() {
        let mut sp = Space::default();
        sp.alloc(SsdLog::Hot, 4096, 4096, 1);
        sp.written(1, 1, None);
        sp.alloc(SsdLog::Hot, 4096, 4096, 2);
        sp.add_ref(loc(1, 0, 10));
        sp.free(1);
    }
}
