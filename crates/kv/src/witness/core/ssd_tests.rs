//! Unit tests of a backup's SSD decisions (M8–M10) on one `WitnessCore` driven by hand: GC
//! under a small SSD budget, restarts from the segments, hot/cold placement.

use std::collections::BTreeMap;

use super::config::Config;
use super::node::{Durable, Input, Output, Params, PmemRecord, SsdLog, SsdLogs, WitnessCore};
use super::ssd::MemSsd;
use crate::witness::proto::{Entry, NodeId, Op, PeerBody, PeerMsg};

const SEGMENT_BYTES: u64 = 8 << 10;
const CAPACITY_BYTES: u64 = 96 << 10;
const GC_FREE_MIN_BYTES: u64 = 32 << 10;

fn params(logs: SsdLogs) -> Params {
    Params {
        // Every committed entry is written back at once: one page per Put, so the small SSD
        // fills fast and GC runs many times.
        writeback_linger_us: 0,
        ssd_logs: logs,
        ssd_segment_bytes: SEGMENT_BYTES,
        ssd_capacity_bytes: CAPACITY_BYTES,
        gc_free_min_bytes: GC_FREE_MIN_BYTES,
        recent_index_window_entries: 4,
        ..Params::default()
    }
}

/// Backup 1 of a primary (0) + backup + witness group, its NVMM and SSD in memory, every
/// output carried out at once.
struct Bk {
    core: WitnessCore,
    p: Params,
    ssd: MemSsd,
    meta: Option<(u64, Option<NodeId>)>,
    nvmm: BTreeMap<u64, Entry>,
    last: u64,
    now: u64,
    gc_freed: u64,
}

impl Bk {
    fn new(p: Params) -> Bk {
        Bk {
            core: WitnessCore::new(1, Config::standard(1, 1), p.clone(), 0).unwrap(),
            p,
            ssd: MemSsd::default(),
            meta: None,
            nvmm: BTreeMap::new(),
            last: 0,
            now: 0,
            gc_freed: 0,
        }
    }

    fn feed(&mut self, input: Input) -> Vec<PeerBody> {
        let mut inputs = vec![input];
        let mut sent = Vec::new();
        while let Some(i) = inputs.pop() {
            self.core.handle(self.now, i);
            for o in self.core.take_outputs() {
                match o {
                    Output::PmemAppend { seq, rec, .. } => {
                        match postcard::from_bytes::<PmemRecord>(&rec).unwrap() {
                            PmemRecord::Meta { term, voted_for } => {
                                self.meta = Some((term, voted_for))
                            }
                            PmemRecord::Entry(e) => {
                                self.nvmm.insert(e.index, e);
                            }
                        }
                        inputs.push(Input::PmemPersisted { seq });
                    }
                    Output::PmemTruncate { from_index, .. } => {
                        self.nvmm.split_off(&from_index);
                    }
                    Output::PmemFree { through_index, .. } => {
                        self.nvmm = self.nvmm.split_off(&(through_index + 1));
                    }
                    Output::SsdWrite {
                        id,
                        seg,
                        log,
                        off,
                        bytes,
                        ..
                    } => {
                        self.ssd.write(seg, log, off, &bytes);
                        inputs.push(Input::SsdWritten { id, result: Ok(()) });
                    }
                    Output::SsdRead {
                        id, seg, off, len, ..
                    } => {
                        let result = self.ssd.read(seg, off, len);
                        inputs.push(Input::SsdRead { id, result });
                    }
                    Output::SsdFree { seg } => self.ssd.free(seg),
                    Output::Send { msg, .. } => sent.push(msg.body),
                    _ => {}
                }
            }
            self.core.check_invariants_deep();
        }
        sent
    }

    fn peer(&mut self, body: PeerBody) -> Vec<PeerBody> {
        self.feed(Input::Peer {
            from: 0,
            msg: PeerMsg {
                term: 1,
                epoch: 1,
                body,
            },
        })
    }

    /// The primary appends and commits one Put.
    fn put(&mut self, key: &[u8], value: Vec<u8>) {
        let prev = self.last;
        self.last += 1;
        self.now += 1_000;
        let e = Entry {
            index: self.last,
            term: 1,
            op: Op::Put {
                key: key.to_vec(),
                value: Some(serde_bytes::ByteBuf::from(value)),
            },
        };
        self.peer(PeerBody::AppendEntries {
            leader: 0,
            prev_index: prev,
            prev_term: if prev == 0 { 0 } else { 1 },
            entries: vec![e],
            commit: self.last,
            sent_us: 0,
        });
        self.feed(Input::Tick);
    }

    /// What a PriorityPull of `key` answers: the newest version's value.
    fn pull(&mut self, key: &[u8]) -> Option<Vec<u8>> {
        let sent = self.peer(PeerBody::PriorityPull {
            id: 7,
            key: serde_bytes::ByteBuf::from(key.to_vec()),
        });
        let entries = sent.into_iter().find_map(|m| match m {
            PeerBody::PriorityPullReply { id: 7, entries } => Some(entries),
            _ => None,
        })?;
        entries
            .into_iter()
            .filter(|e| e.key() == Some(key))
            .max_by_key(|e| e.stamp())
            .and_then(|e| e.value().map(<[u8]>::to_vec))
    }

    /// A restart from what the NVMM and the SSD hold.
    fn restart(&mut self) {
        self.gc_freed += self.core.counters.gc_segments_freed;
        let durable = Durable {
            meta: self.meta,
            entries: self.nvmm.values().cloned().collect(),
            ssd: self.ssd.durable(),
        };
        self.core =
            WitnessCore::restore(1, Config::standard(1, 1), self.p.clone(), self.now, durable)
                .unwrap();
        self.core.check_invariants_deep();
    }
}

fn value(i: u64) -> Vec<u8> {
    vec![i as u8; 300 + (i as usize * 37) % 900]
}

/// M9: with a 96 KiB SSD and one 4 KiB page per Put, 300 Puts (1.2 MiB of pages) fit only if
/// GC frees segments again and again. The invariants run after every input (the reference
/// counts recounted from the index and the window each time); the newest version of every key
/// stays readable by PriorityPull, and so it does after restarts from the segments.
#[test]
fn backup_gc_keeps_every_newest_version_within_its_ssd_budget_across_restarts() {
    let mut b = Bk::new(params(SsdLogs::HotCold));
    let mut model: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    let mut peak = 0;
    for i in 1..=300u64 {
        let key = format!("k{}", i % 5).into_bytes();
        b.put(&key, value(i));
        model.insert(key, value(i));
        assert_eq!(b.core.written_back_through(), i, "written back at once");
        assert_eq!(
            b.ssd.bytes(),
            b.core.ssd_used_bytes(),
            "core and disk agree"
        );
        peak = peak.max(b.ssd.bytes());
        assert!(
            b.ssd.bytes() <= CAPACITY_BYTES,
            "put {i}: {} B on SSD",
            b.ssd.bytes()
        );
        if i % 60 == 0 {
            b.restart();
        }
    }
    b.gc_freed += b.core.counters.gc_segments_freed;
    assert!(b.gc_freed >= 100, "{} segments freed", b.gc_freed);
    for (k, v) in &model {
        assert_eq!(b.pull(k).as_ref(), Some(v), "{k:?}");
    }
    b.restart();
    for (k, v) in &model {
        assert_eq!(b.pull(k).as_ref(), Some(v), "{k:?} after a restart");
    }
    // GC keeps the SSD near its threshold: it collects under pressure, not eagerly.
    assert!(
        peak >= CAPACITY_BYTES - GC_FREE_MIN_BYTES - 2 * SEGMENT_BYTES,
        "peak {peak} B"
    );
}

/// M10: a key the primary reports popular moves to the hot log by GC alone (no client write),
/// and its next write goes there directly; other keys stay cold. `Single` puts everything in
/// one log whatever is popular.
#[test]
fn backup_places_popular_keys_hot_and_gc_moves_a_key_that_became_hot() {
    let mut b = Bk::new(params(SsdLogs::HotCold));
    b.put(b"a", value(1));
    assert_eq!(b.core.backup_index_log(b"a"), Some(SsdLog::Cold));
    b.peer(PeerBody::Popularity {
        keys: vec![(serde_bytes::ByteBuf::from(b"a".to_vec()), 1)],
    });
    // 14 other live keys, one page each, near the GC threshold (16 pages): segments with no
    // dead page are few, so GC must also compact partly live ones, a's among them.
    for i in 2..=200u64 {
        b.put(format!("x{}", i % 14).as_bytes(), value(i));
    }
    assert_eq!(
        b.core.backup_index_log(b"a"),
        Some(SsdLog::Hot),
        "{:?}",
        b.core.counters
    );
    assert!(b.core.counters.gc_moved_to_hot >= 1);
    assert_eq!(b.pull(b"a"), Some(value(1)));
    assert_eq!(b.core.backup_index_log(b"x1"), Some(SsdLog::Cold));
    b.put(b"a", value(99));
    assert_eq!(b.core.backup_index_log(b"a"), Some(SsdLog::Hot));
    let logs: Vec<SsdLog> = b.ssd.segs.values().map(|s| s.0).collect();
    assert!(logs.contains(&SsdLog::Hot) && logs.contains(&SsdLog::Cold));

    let mut s = Bk::new(params(SsdLogs::Single));
    s.peer(PeerBody::Popularity {
        keys: vec![(serde_bytes::ByteBuf::from(b"a".to_vec()), 1)],
    });
    for i in 1..=40u64 {
        s.put(if i % 3 == 0 { b"a" } else { b"b" }, value(i));
    }
    assert!(s.ssd.segs.values().all(|seg| seg.0 == SsdLog::Hot));
    assert!(s.core.counters.gc_segments_freed > 0);
    assert_eq!(s.pull(b"b"), Some(value(40)));
}
