//! The emulated persistent-memory log (§V-B): one append-only file of records, each
//! `len: u32 LE | crc32c: u32 LE | postcard(LogRecord)`. A `Put` is an update reaching its local
//! durability point; a `Mark` sets the entry's GDP flag (the update is known committed /
//! globally durable) — written lazily, since a lost flag only puts the entry on the
//! Partially_persisted list, where the Buddy resolves it. Reading stops at the first torn or
//! corrupt record: everything after it was never acknowledged as durable.
//!
//! [`PmLog`] is the storage interface; [`FileLog`] the runtime implementation (a file opened
//! with `O_DSYNC`, an optional extra latency per persist to model slower NVM). The simulation
//! tests implement it over `sim::SimDisk`.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::ops::ControlFlow;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub mod record;

use record::{Chunk, Ts};

/// Largest record accepted when reading a log back (a maximal key and value plus framing).
pub const MAX_RECORD_BYTES: usize = record::MAX_VALUE_BYTES + record::MAX_KEY_BYTES + 64;

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LogRecord {
    /// Written (and synced) once, when the node first joins its group: a log with `Boot` belongs
    /// to a node that was a member before and must recover before it serves again.
    Boot { node: u32 },
    Put {
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
        ts: Ts,
        #[serde(with = "serde_bytes")]
        value: Vec<u8>,
    },
    Mark {
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
        ts: Ts,
    },
    /// The node became an active, complete member of configuration `epoch` (`whole`: no node
    /// was absent). Everything it applies later follows this record: the "log id" the
    /// reactive-log baseline reads from (§II-C, ZooKeeper's zxid), and where compaction cuts.
    Epoch { epoch: u64, whole: bool },
}

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("log I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("log record encoding failed: {0}")]
    Encode(String),
}

/// Encodes one record with its header.
pub fn encode(rec: &LogRecord) -> Vec<u8> {
    let mut out = Vec::new();
    encode_into(rec, &mut out);
    out
}

/// Appends one encoded record (header included) to `out`, serializing in place: a batch of
/// records is one buffer with one copy of each value.
pub fn encode_into(rec: &LogRecord, out: &mut Vec<u8>) {
    encode_framed(rec, out)
}

fn encode_framed<T: Serialize>(rec: &T, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0u8; 8]);
    let taken = std::mem::take(out);
    *out = postcard::to_extend(rec, taken).expect("log records always encode");
    let payload_len = out.len() - start - 8;
    let crc = crc32c::crc32c(&out[start + 8..]);
    out[start..start + 4].copy_from_slice(&(payload_len as u32).to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// [`LogRecord`] borrowing its bytes: the same variants in the same order, so the same
/// encoding (checked by a test), written and read without owning a copy of the entry.
#[derive(Serialize, Deserialize)]
enum LogRecordRef<'a> {
    Boot {
        node: u32,
    },
    Put {
        #[serde(with = "serde_bytes", borrow)]
        key: &'a [u8],
        ts: Ts,
        #[serde(with = "serde_bytes", borrow)]
        value: &'a [u8],
    },
    Mark {
        #[serde(with = "serde_bytes", borrow)]
        key: &'a [u8],
        ts: Ts,
    },
    Epoch {
        epoch: u64,
        whole: bool,
    },
}

/// A catch-up chunk's durable records: for each entry the node logs (its byte offset in the
/// chunk: the applied ones, and under the baselines the stale ones too) a `Put`, and a `Mark`
/// (its GDP flag) if it is committed, encoded straight from the chunk. An older version logged
/// after a newer one is harmless: a rebuild orders a key's versions by timestamp.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ChunkPuts {
    pub chunk: std::sync::Arc<Chunk>,
    pub applied: Vec<u32>,
}

impl ChunkPuts {
    /// The records, owned (tests and the simulator's bookkeeping).
    pub fn records(&self) -> Vec<LogRecord> {
        let mut out = Vec::new();
        for &at in &self.applied {
            let (e, _) = self
                .chunk
                .entry_at(at as usize)
                .expect("applied offsets come from a validated chunk");
            out.push(LogRecord::Put {
                key: e.key.to_vec(),
                ts: e.ts,
                value: e.value.to_vec(),
            });
            if e.committed {
                out.push(LogRecord::Mark {
                    key: e.key.to_vec(),
                    ts: e.ts,
                });
            }
        }
        out
    }

    fn key_at(&self, at: u32) -> &[u8] {
        self.chunk
            .entry_at(at as usize)
            .map(|(e, _)| e.key)
            .expect("applied offsets come from a validated chunk")
    }

    /// The applied offsets in key order (a chunk of a log stream is in log order).
    pub fn key_index(&self) -> Vec<u32> {
        let mut index = self.applied.clone();
        index.sort_by(|a, b| self.key_at(*a).cmp(self.key_at(*b)));
        index
    }

    /// Whether `key` is among the applied entries, given their offsets in key order.
    pub fn index_contains(&self, index: &[u32], key: &[u8]) -> bool {
        index
            .binary_search_by(|&at| self.key_at(at).cmp(key))
            .is_ok()
    }

    pub fn size_hint(&self) -> usize {
        // Every applied entry's bytes are at most the chunk's.
        self.chunk.len_bytes() + self.applied.len() * 64
    }

    /// Appends the encoded records to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        for &at in &self.applied {
            let (e, _) = self
                .chunk
                .entry_at(at as usize)
                .expect("applied offsets come from a validated chunk");
            encode_framed(
                &LogRecordRef::Put {
                    key: e.key,
                    ts: e.ts,
                    value: e.value,
                },
                out,
            );
            if e.committed {
                encode_framed(
                    &LogRecordRef::Mark {
                        key: e.key,
                        ts: e.ts,
                    },
                    out,
                );
            }
        }
    }
}

/// One durable append: a record, or a catch-up chunk's records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Append {
    Rec(LogRecord),
    Chunk(ChunkPuts),
}

impl Append {
    pub fn size_hint(&self) -> usize {
        match self {
            Append::Rec(r) => record_size_hint(r),
            Append::Chunk(c) => c.size_hint(),
        }
    }
}

/// Decodes records from a whole log image, stopping at the first incomplete or corrupt one.
/// Returns the records and the byte length of the valid prefix.
pub fn decode_all(bytes: &[u8]) -> (Vec<LogRecord>, usize) {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos + 8 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
        let crc = u32::from_le_bytes(bytes[pos + 4..pos + 8].try_into().unwrap());
        if len > MAX_RECORD_BYTES || pos + 8 + len > bytes.len() {
            break;
        }
        let payload = &bytes[pos + 8..pos + 8 + len];
        if crc32c::crc32c(payload) != crc {
            break;
        }
        match postcard::from_bytes::<LogRecord>(payload) {
            Ok(r) => out.push(r),
            Err(_) => break,
        }
        pos += 8 + len;
    }
    (out, pos)
}

/// What a node finds in its log when it starts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogState {
    /// The node was a member before (see [`LogRecord::Boot`]).
    pub booted: bool,
    /// Per key, the newest entry with its GDP flag set: known committed.
    pub base: BTreeMap<Vec<u8>, (Ts, Vec<u8>)>,
    /// The Partially_persisted list: per key, the newest persisted entry newer than `base` whose
    /// flag is clear.
    pub partially: BTreeMap<Vec<u8>, (Ts, Vec<u8>)>,
    pub records: usize,
    /// The newest [`LogRecord::Epoch`]: the last configuration this node was complete in.
    pub last_epoch: u64,
    /// The node id of the first `Boot` record.
    pub boot_node: Option<u32>,
}

impl LogState {
    /// What a log holding only `Boot { node }` holds: a member with nothing stored (the
    /// full-copy baseline's returning node, see [`FileLog::reset_as_new_node`]).
    pub fn new_node(node: u32) -> Self {
        LogState {
            booted: true,
            boot_node: Some(node),
            records: 1,
            ..Default::default()
        }
    }
}

/// Replays records into a [`LogState`].
pub fn rebuild(records: &[LogRecord]) -> LogState {
    let mut b = Rebuilder::default();
    for r in records {
        b.push(r.clone());
    }
    b.finish()
}

/// Builds a [`LogState`] one record at a time (a log of any size streams through it). Per key
/// it keeps only the versions that can still matter: a `Mark` drops every older version.
/// Per key, the versions still relevant: (timestamp, value, GDP flag), oldest first. Most keys
/// have one, kept inline: a per-key allocation would be freed after the rebuild and leave a
/// store-sized heap of holes between the values that the node keeps.
enum Versions {
    One((Ts, Vec<u8>, bool)),
    Many(Vec<(Ts, Vec<u8>, bool)>),
}

impl Versions {
    fn many(&mut self) -> &mut Vec<(Ts, Vec<u8>, bool)> {
        if let Versions::One(x) = self {
            let x = std::mem::take(x);
            *self = Versions::Many(vec![x]);
        }
        match self {
            Versions::Many(v) => v,
            Versions::One(_) => unreachable!(),
        }
    }
}

#[derive(Default)]
pub struct Rebuilder {
    puts: BTreeMap<Vec<u8>, Versions>,
    boot_node: Option<u32>,
    last_epoch: u64,
    records: usize,
}

impl Rebuilder {
    pub fn push(&mut self, r: LogRecord) {
        self.records += 1;
        match r {
            LogRecord::Boot { node } => {
                self.boot_node.get_or_insert(node);
            }
            LogRecord::Epoch { epoch, .. } => self.last_epoch = self.last_epoch.max(epoch),
            LogRecord::Put { key, ts, value } => {
                // Most keys have one live version: no room for more until it is needed (a
                // default Vec would reserve four per key, a store-sized heap of holes later).
                let v = match self.puts.entry(key) {
                    std::collections::btree_map::Entry::Vacant(e) => {
                        e.insert(Versions::One((ts, value, false)));
                        return;
                    }
                    std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                };
                if let Versions::One(x) = v {
                    if x.0 == ts {
                        x.1 = value;
                        return;
                    }
                }
                let v = v.many();
                match v.binary_search_by_key(&ts, |e| e.0) {
                    Ok(i) => v[i].1 = value,
                    Err(i) => v.insert(i, (ts, value, false)),
                }
            }
            LogRecord::Mark { key, ts } => {
                // A mark may precede its put in the file only if the put was never made
                // durable; such a mark refers to nothing.
                if let Some(Versions::One(x)) = self.puts.get_mut(&key) {
                    if x.0 == ts {
                        x.2 = true;
                    }
                } else if let Some(Versions::Many(v)) = self.puts.get_mut(&key) {
                    if let Ok(i) = v.binary_search_by_key(&ts, |e| e.0) {
                        v[i].2 = true;
                        v.drain(..i);
                    }
                }
            }
        }
    }

    pub fn finish(self) -> LogState {
        let mut st = LogState {
            booted: self.boot_node.is_some(),
            boot_node: self.boot_node,
            records: self.records,
            last_epoch: self.last_epoch,
            ..Default::default()
        };
        for (key, versions) in self.puts {
            let mut versions = match versions {
                Versions::One((ts, v, marked)) => {
                    if marked {
                        st.base.insert(key, (ts, v));
                    } else if ts > Ts::default() {
                        st.partially.insert(key, (ts, v));
                    }
                    continue;
                }
                Versions::Many(v) => v,
            };
            let base_i = versions.iter().rposition(|e| e.2);
            let base_ts = base_i.map(|i| versions[i].0).unwrap_or_default();
            let newest_unmarked = versions.last().is_some_and(|e| !e.2 && e.0 > base_ts);
            if newest_unmarked {
                let (ts, v, _) = versions.pop().unwrap();
                st.partially.insert(key.clone(), (ts, v));
            }
            if let Some(i) = base_i {
                let (ts, v, _) = versions.swap_remove(i);
                st.base.insert(key, (ts, v));
            }
        }
        st
    }
}

/// Reads records from `r` until the end or the first torn or corrupt one, handing each to `f`.
/// Returns the byte length of the valid prefix.
pub fn stream_records(r: impl Read, mut f: impl FnMut(LogRecord, u64)) -> std::io::Result<u64> {
    stream_payloads(r, |payload, n| {
        match postcard::from_bytes::<LogRecord>(payload) {
            Ok(rec) => {
                f(rec, n);
                ControlFlow::Continue(())
            }
            Err(_) => ControlFlow::Break(false),
        }
    })
}

/// Whether the valid records of `r` include a `Boot` (the node was a member before), found
/// without decoding any other record.
pub fn holds_boot(r: impl Read) -> std::io::Result<bool> {
    let mut found = false;
    stream_payloads(r, |payload, _| {
        // A record's first byte is its variant (`Boot` is the first).
        if payload.first() != Some(&0) {
            return ControlFlow::Continue(());
        }
        match postcard::from_bytes::<LogRecord>(payload) {
            Ok(LogRecord::Boot { .. }) => {
                found = true;
                ControlFlow::Break(true)
            }
            Ok(_) => ControlFlow::Continue(()),
            Err(_) => ControlFlow::Break(false),
        }
    })?;
    Ok(found)
}

/// Reads framed payloads (length and checksum checked) from `r`, handing each with its framed
/// length to `f`, until the end, a torn or corrupt frame, or `f` breaks: `Break(true)` counts
/// the payload as valid, `Break(false)` ends the valid prefix before it. Returns the byte
/// length of the valid prefix read.
fn stream_payloads(
    r: impl Read,
    mut f: impl FnMut(&[u8], u64) -> ControlFlow<bool>,
) -> std::io::Result<u64> {
    let mut r = std::io::BufReader::with_capacity(1 << 20, r);
    let mut pos = 0u64;
    let mut payload = Vec::new();
    loop {
        let mut hdr = [0u8; 8];
        match read_full(&mut r, &mut hdr)? {
            8 => {}
            _ => return Ok(pos),
        }
        let len = u32::from_le_bytes(hdr[..4].try_into().unwrap()) as usize;
        let crc = u32::from_le_bytes(hdr[4..].try_into().unwrap());
        if len > MAX_RECORD_BYTES {
            return Ok(pos);
        }
        payload.resize(len, 0);
        if read_full(&mut r, &mut payload)? != len || crc32c::crc32c(&payload) != crc {
            return Ok(pos);
        }
        let n = 8 + len as u64;
        match f(&payload, n) {
            ControlFlow::Continue(()) => pos += n,
            ControlFlow::Break(valid) => return Ok(pos + if valid { n } else { 0 }),
        }
    }
}

fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// A request to read a node's log from a point (the reactive-log baseline, §II-C).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LogCursor {
    /// The recovering node's last epoch as a complete member (its newest `Epoch` record).
    pub since_epoch: u64,
    /// Log generation `pos` belongs to (compaction starts a new one).
    pub gen: u64,
    /// Byte offset to continue from; `None`: find the point for `since_epoch` first.
    pub pos: Option<u64>,
}

/// What a log read returns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogChunk {
    /// False: no `Epoch` record old enough is left (never written, or compacted away): the
    /// log cannot serve this node and recovery falls back to a full copy.
    pub found: bool,
    pub gen: u64,
    /// Every update in log order from the point, redundant ones included, packed as a
    /// catch-up chunk: committed where the log holds the version's `Mark` within this read.
    pub entries: Chunk,
    /// Byte offsets in `entries` of the updates whose `Mark` was not in the read (it may be
    /// later in the log, or lost): the reader judges them.
    pub unmarked: Vec<u32>,
    pub next_pos: u64,
    /// The read reached the end of the log.
    pub at_end: bool,
}

/// Where a read for `since_epoch` starts: the newest `Epoch` record of an *earlier*
/// configuration (one configuration of slack: a write in flight while the recovering node
/// adopted its last configuration was applied here before this node's record of it), or the
/// genesis one. `markers` are (epoch, offset) in log order.
pub fn start_offset(markers: &[(u64, u64)], since_epoch: u64) -> Option<u64> {
    if since_epoch == 0 {
        return None;
    }
    markers
        .iter()
        .rev()
        .find(|(e, _)| *e < since_epoch || *e == 1)
        .filter(|(e, _)| *e <= since_epoch)
        .map(|(_, o)| *o)
}

/// Reads up to about `max_bytes` of updates at `cursor` from a log of `len` bytes whose
/// `Epoch` records are `markers`; `read_at(offset, len)` reads the file.
pub fn read_chunk(
    markers: &[(u64, u64)],
    gen: u64,
    len: u64,
    cursor: &LogCursor,
    max_bytes: usize,
    mut read_at: impl FnMut(u64, usize) -> std::io::Result<Vec<u8>>,
) -> std::io::Result<LogChunk> {
    let start = match cursor.pos {
        Some(p) if cursor.gen == gen && p <= len => Some(p),
        _ => start_offset(markers, cursor.since_epoch),
    };
    let Some(mut pos) = start else {
        return Ok(LogChunk {
            found: false,
            gen,
            ..Default::default()
        });
    };
    let mut out = LogChunk {
        found: true,
        gen,
        ..Default::default()
    };
    // Where each (key, version) read so far and not yet flagged sits in `out.entries`: a
    // `Mark` after its `Put` (written lazily, usually a few records later) flags it committed
    // without the reader asking its store, as ZooKeeper's leader knows a transaction committed
    // from its log. Keyed by a hash of the pair, checked against the entry (no allocation per
    // record); an entry displaced by another of the same hash (a collision, or the same
    // version logged twice) goes to `displaced`, for the reader to judge.
    let mut unmarked: HashMap<u64, u32> = HashMap::new();
    let mut displaced = Vec::new();
    let version_hash = |key: &[u8], ts: Ts| {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        key.hash(&mut h);
        ts.hash(&mut h);
        h.finish()
    };
    let mut torn = false;
    'read: while pos < len && out.entries.len_bytes() < max_bytes {
        let want = ((len - pos) as usize).min(max_bytes.max(MAX_RECORD_BYTES + 8));
        let buf = read_at(pos, want)?;
        let mut at = 0usize;
        while at + 8 <= buf.len() && out.entries.len_bytes() < max_bytes {
            let n = u32::from_le_bytes(buf[at..at + 4].try_into().unwrap()) as usize;
            if at + 8 + n > buf.len() {
                break;
            }
            let Some(rec) = decode_one_ref(&buf[at..at + 8 + n]) else {
                // A corrupt record inside the valid length cannot be: stop as at a torn tail.
                pos += at as u64;
                torn = true;
                break 'read;
            };
            at += 8 + n;
            match rec {
                LogRecordRef::Put { key, ts, value } => {
                    let offset = out.entries.len_bytes() as u32;
                    displaced.extend(unmarked.insert(version_hash(key, ts), offset));
                    out.entries.push(key, ts, value, false);
                }
                LogRecordRef::Mark { key, ts } => {
                    let h = version_hash(key, ts);
                    let Some(&offset) = unmarked.get(&h) else {
                        continue;
                    };
                    let (e, _) = out
                        .entries
                        .entry_at(offset as usize)
                        .expect("offsets of entries pushed here");
                    if e.key == key && e.ts == ts {
                        unmarked.remove(&h);
                        out.entries.set_committed(offset as usize);
                    }
                }
                LogRecordRef::Boot { .. } | LogRecordRef::Epoch { .. } => {}
            }
        }
        if at == 0 {
            break; // a record larger than the read (cannot happen below MAX_RECORD_BYTES)
        }
        pos += at as u64;
    }
    out.unmarked = unmarked.into_values().chain(displaced).collect();
    out.unmarked.sort_unstable();
    out.next_pos = pos;
    out.at_end = torn || pos >= len;
    Ok(out)
}

/// One framed record (header included), checked and decoded with its bytes borrowed.
fn decode_one_ref(b: &[u8]) -> Option<LogRecordRef<'_>> {
    let len = u32::from_le_bytes(b.get(..4)?.try_into().unwrap()) as usize;
    let crc = u32::from_le_bytes(b.get(4..8)?.try_into().unwrap());
    let payload = b.get(8..)?;
    if len > MAX_RECORD_BYTES || payload.len() != len || crc32c::crc32c(payload) != crc {
        return None;
    }
    postcard::from_bytes(payload).ok()
}

/// Offsets of the `Epoch` records in a log image, and the byte length of its valid prefix.
pub fn scan_markers(bytes: &[u8]) -> (Vec<(u64, u64)>, usize) {
    let mut markers = Vec::new();
    let mut pos = 0;
    while pos + 8 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
        if len > MAX_RECORD_BYTES || pos + 8 + len > bytes.len() {
            break;
        }
        let Some(rec) = decode_one_ref(&bytes[pos..pos + 8 + len]) else {
            break;
        };
        if let LogRecordRef::Epoch { epoch, .. } = rec {
            markers.push((epoch, pos as u64));
        }
        pos += 8 + len;
    }
    (markers, pos)
}

/// The records that stand for `records` once compacted: the Boot record, then per key its
/// committed base (Put + Mark) and its Partially_persisted entry. Intermediate versions, old
/// `Epoch` records and flags of superseded versions go.
pub fn snapshot_records(records: &[LogRecord]) -> Vec<LogRecord> {
    snapshot_of(rebuild(records))
}

fn snapshot_of(st: LogState) -> Vec<LogRecord> {
    let mut out = Vec::new();
    if let Some(node) = st.boot_node {
        out.push(LogRecord::Boot { node });
    }
    for (key, (ts, value)) in st.base {
        out.push(LogRecord::Put {
            key: key.clone(),
            ts,
            value,
        });
        out.push(LogRecord::Mark { key, ts });
    }
    for (key, (ts, value)) in st.partially {
        out.push(LogRecord::Put { key, ts, value });
    }
    out
}

/// Where compaction may cut a log: before the second-newest `Epoch` record of a whole group
/// (a node that left after it can still be served by the reactive baseline), unless the tail
/// from there is over `max_tail_bytes` (then everything is compacted, and such a node gets a
/// full copy, as ZooKeeper sends a snapshot to a learner too far behind).
pub fn compaction_cut(whole_markers: &[u64], len: u64, max_tail_bytes: u64) -> u64 {
    let cut = match whole_markers {
        [.., a, _] => *a,
        [a] => *a,
        [] => len,
    };
    if len - cut > max_tail_bytes {
        len
    } else {
        cut
    }
}

/// About the encoded size of a record (for sizing buffers and batches).
pub fn record_size_hint(r: &LogRecord) -> usize {
    match r {
        LogRecord::Put { key, value, .. } => key.len() + value.len() + 32,
        LogRecord::Mark { key, .. } => key.len() + 32,
        LogRecord::Boot { .. } | LogRecord::Epoch { .. } => 32,
    }
}

/// Durable storage of a node's log.
pub trait PmLog {
    /// Appends records and makes them durable before returning.
    fn append_durable(&mut self, recs: &[LogRecord]) -> Result<(), LogError>;
    /// Appends records without waiting for durability (GDP flags).
    fn append_lazy(&mut self, recs: &[LogRecord]) -> Result<(), LogError>;
    /// Every record that survived.
    fn read_all(&mut self) -> Result<Vec<LogRecord>, LogError>;
}

/// The runtime log: an `O_DSYNC` file, so each append returns once it is on stable storage.
/// `extra_persist_latency` is added to every durable append to model NVM slower than the disk
/// cache (zero by default).
///
/// Bounded: once the file has grown past `compact_min_bytes` and twice its size after the last
/// compaction, it is rewritten as a snapshot of what precedes the cut of [`compaction_cut`]
/// followed by the tail after it, verbatim (written to a temporary file, synced, renamed).
pub struct FileLog {
    path: std::path::PathBuf,
    file: File,
    dsync: File,
    extra_persist_latency: Duration,
    len: u64,
    gen: u64,
    /// (epoch, offset, whole) of every `Epoch` record.
    markers: Vec<(u64, u64, bool)>,
    pub compact_min_bytes: u64,
    pub max_tail_bytes: u64,
    compacted_len: u64,
    pub compactions: u64,
    /// Time spent encoding durable appends, in microseconds (statistics).
    pub encode_us: u64,
    /// The encode buffer, kept between appends up to [`ENCODE_BUFFER_KEEP_BYTES`]: a fresh
    /// buffer of a catch-up's many MiB costs a page fault per 4 KiB on first touch.
    enc: Vec<u8>,
}

/// Capacity of the log's encode buffer kept between appends (a larger one is freed after use).
pub const ENCODE_BUFFER_KEEP_BYTES: usize = 8 << 20;

/// Free heap memory glibc keeps at the top of each arena instead of returning it (see
/// [`keep_transient_buffers`]): a catch-up's window of chunks, with room to spare.
pub const MALLOC_KEEP_FREE_BYTES: usize = 32 << 20;

/// Keeps the memory of freed megabyte-sized buffers (catch-up chunks, decoded frames) in the
/// process for the next ones. By default glibc serves them with fresh `mmap`s or trims its heap
/// down after each is freed, so every chunk of a catch-up touched fresh pages: a page fault per
/// 4 KiB, about half a millisecond per MiB on this kind of VM, several times the copy itself.
/// What it keeps: at most [`MALLOC_KEEP_FREE_BYTES`] free at the top of each arena (free
/// blocks between live ones are glibc's business as before); the node's memory figure in
/// `bench kv recovery` stayed at 1.30x stored + cap (peak 1.44) with it.
pub fn keep_transient_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; it takes no pointers.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MALLOC_KEEP_FREE_BYTES as i32);
        libc::mallopt(libc::M_TRIM_THRESHOLD, MALLOC_KEEP_FREE_BYTES as i32);
    }
}

/// Hands memory freed by a large transient structure (a log rebuild or compaction) back to the
/// OS: glibc keeps it in its heap otherwise, and a node's resident memory would stay at its
/// peak rather than at what it stores.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the kernel; it takes no pointers and
    // is thread-safe (glibc locks each arena).
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Reads `n` bytes at `off` into a new buffer without zeroing it first (a reactive-log read is
/// a MiB at a time, and zeroing it was a few percent of the reading thread's time).
fn read_exact_at_uninit(file: &File, off: u64, n: usize) -> std::io::Result<Vec<u8>> {
    use std::os::fd::AsRawFd;
    let mut buf: Vec<u8> = Vec::with_capacity(n);
    while buf.len() < n {
        let done = buf.len();
        // SAFETY: pread writes at most `n - done` bytes into the spare capacity starting at
        // `done` (allocated above), and only the bytes it reports written are counted in.
        let got = unsafe {
            libc::pread(
                file.as_raw_fd(),
                buf.as_mut_ptr().add(done).cast(),
                n - done,
                (off + done as u64) as libc::off_t,
            )
        };
        match got {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            g if g < 0 => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
            // SAFETY: the first `done + g` bytes are now initialized (see above).
            g => unsafe { buf.set_len(done + g as usize) },
        }
    }
    Ok(buf)
}

/// Largest durable append written as one `O_DSYNC` write (see `FileLog::write_durable`).
pub const DSYNC_WRITE_MAX_BYTES: usize = 256 << 10;
/// Pieces of a larger durable append, each with its write-back started as it is written.
pub const WRITEBACK_PIECE_BYTES: usize = 1 << 20;

/// Default for [`FileLog::compact_min_bytes`].
pub const COMPACT_MIN_BYTES: u64 = 64 << 20;
/// Default for [`FileLog::max_tail_bytes`].
pub const MAX_TAIL_BYTES: u64 = 256 << 20;

impl FileLog {
    pub fn open(path: &Path, extra_persist_latency: Duration) -> Result<Self, LogError> {
        Ok(Self::open_and_rebuild(path, extra_persist_latency)?.0)
    }

    /// Opens the log and rebuilds what it holds in one streaming pass (no copy of the file in
    /// memory: a store of any size starts within the memory of its state).
    pub fn open_and_rebuild(
        path: &Path,
        extra_persist_latency: Duration,
    ) -> Result<(Self, LogState), LogError> {
        let mut me = Self::open_unread(path, extra_persist_latency)?;
        let st = me.load_state()?;
        me.compacted_len = me.len;
        Ok((me, st))
    }

    /// Opens the log at `path` for a node that returns as a new one, replacing it as
    /// [`Self::reset_as_new_node`] does, without rebuilding the state it drops (the whole
    /// store: seconds of parsing and a second copy of the store in memory at the restart).
    pub fn open_as_new_node(
        path: &Path,
        extra_persist_latency: Duration,
        node: u32,
    ) -> Result<(Self, LogState), LogError> {
        let mut me = Self::open_unread(path, extra_persist_latency)?;
        // Only the compaction threshold uses the old length (see `reset_as_new_node`).
        me.len = me.file.metadata()?.len();
        let st = me.reset_as_new_node(node)?;
        Ok((me, st))
    }

    /// Whether the log at `path` says its node was a member before (holds a `Boot` record),
    /// read without rebuilding anything; false if there is no log.
    pub fn was_booted(path: &Path) -> Result<bool, LogError> {
        let file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e.into()),
        };
        Ok(holds_boot(&file)?)
    }

    /// The log at `path`, opened, its contents not read yet.
    fn open_unread(path: &Path, extra_persist_latency: Duration) -> Result<Self, LogError> {
        let (file, dsync) = Self::open_files(path)?;
        Ok(FileLog {
            path: path.to_path_buf(),
            file,
            dsync,
            extra_persist_latency,
            len: 0,
            gen: 0,
            markers: Vec::new(),
            compact_min_bytes: COMPACT_MIN_BYTES,
            max_tail_bytes: MAX_TAIL_BYTES,
            compacted_len: 0,
            compactions: 0,
            encode_us: 0,
            enc: Vec::new(),
        })
    }

    /// Streams the file: indexes markers, cuts a torn tail, rebuilds the state.
    fn load_state(&mut self) -> Result<LogState, LogError> {
        let mut b = Rebuilder::default();
        let valid = self.index_markers(|r| b.push(r))?;
        self.drop_cached_pages();
        let total = self.file.metadata()?.len();
        if valid < total {
            self.file.set_len(valid)?;
            self.file.sync_data()?;
        }
        self.len = valid;
        Ok(b.finish())
    }

    /// Like [`Self::load_state`] for the markers and length only (after a compaction: the state
    /// is in the node already, and rebuilding it would hold a second copy of the store).
    fn load_markers(&mut self) -> Result<(), LogError> {
        self.len = self.index_markers(|_| {})?;
        release_free_memory();
        Ok(())
    }

    /// Reads the file from its start, indexing its epoch markers and handing every valid record
    /// to `each`; returns the length of the valid prefix.
    fn index_markers(&mut self, mut each: impl FnMut(LogRecord)) -> Result<u64, LogError> {
        use std::io::Seek;
        self.file.seek(std::io::SeekFrom::Start(0))?;
        let mut markers = Vec::new();
        let mut pos = 0u64;
        let valid = stream_records(&self.file, |r, n| {
            if let LogRecord::Epoch { epoch, whole } = &r {
                markers.push((*epoch, pos, *whole));
            }
            pos += n;
            each(r);
        })?;
        self.markers = markers;
        Ok(valid)
    }

    /// Asks the kernel to drop the file's cached pages once a rebuild has read it whole: the
    /// node now holds the state in memory (a reactive-log catch-up it serves reads what it
    /// appends later, still cached), while a store-sized log kept in the page cache crowds the
    /// memory every node's appends need (with several nodes on one machine, a catch-up's log
    /// writes then wait on page reclaim). Dirty pages are not dropped (their write-back is only
    /// started). Not after a compaction, whose new file holds the tail a reactive read needs.
    fn drop_cached_pages(&self) {
        use std::os::fd::AsRawFd;
        // SAFETY: posix_fadvise takes the fd (owned by `self.file`, open) and a byte range (0, 0:
        // the whole file); it is advice and changes no data.
        unsafe {
            libc::posix_fadvise(self.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
    }

    fn open_files(path: &Path) -> Result<(File, File), LogError> {
        let file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)?;
        let dsync = OpenOptions::new()
            .append(true)
            .custom_flags(libc::O_DSYNC)
            .open(path)?;
        Ok((file, dsync))
    }

    /// Encodes `recs` into the reused buffer (taken: hand it back with [`Self::keep_buffer`]).
    fn encode_batch(&mut self, recs: &[LogRecord]) -> Vec<u8> {
        let mut buf = std::mem::take(&mut self.enc);
        buf.clear();
        buf.reserve(recs.iter().map(record_size_hint).sum());
        for r in recs {
            if let LogRecord::Epoch { epoch, whole } = r {
                self.markers
                    .push((*epoch, self.len + buf.len() as u64, *whole));
            }
            encode_into(r, &mut buf);
        }
        self.len += buf.len() as u64;
        buf
    }

    /// Encodes records and catch-up chunks into the reused buffer (see [`Self::encode_batch`]).
    fn encode_items(&mut self, items: &[Append]) -> Vec<u8> {
        let mut buf = std::mem::take(&mut self.enc);
        buf.clear();
        buf.reserve(items.iter().map(Append::size_hint).sum());
        for it in items {
            match it {
                Append::Rec(r) => {
                    if let LogRecord::Epoch { epoch, whole } = r {
                        self.markers
                            .push((*epoch, self.len + buf.len() as u64, *whole));
                    }
                    encode_into(r, &mut buf);
                }
                Append::Chunk(c) => c.encode_into(&mut buf),
            }
        }
        self.len += buf.len() as u64;
        buf
    }

    /// Appends records and catch-up chunks and makes them durable (as
    /// [`PmLog::append_durable`]).
    pub fn append_items_durable(&mut self, items: &[Append]) -> Result<(), LogError> {
        self.persist_encoded(|log| log.encode_items(items))
    }

    /// Encodes (timed into `encode_us`), writes durably, keeps the buffer for the next batch,
    /// then adds the configured extra persist latency.
    fn persist_encoded(
        &mut self,
        encode: impl FnOnce(&mut Self) -> Vec<u8>,
    ) -> Result<(), LogError> {
        let t = std::time::Instant::now();
        let buf = encode(self);
        self.encode_us += t.elapsed().as_micros() as u64;
        let r = self.write_durable(&buf);
        self.keep_buffer(buf);
        r?;
        if !self.extra_persist_latency.is_zero() {
            std::thread::sleep(self.extra_persist_latency);
        }
        Ok(())
    }

    /// Appends records and catch-up chunks to the file without waiting for durability: their
    /// write-back is started, and they are durable after a later `sync_data` on a handle of
    /// [`Self::sync_handle`] (which covers every byte written before it). Lets a caller write
    /// the next appends while an earlier sync is in flight (a pipelined group commit).
    pub fn append_items_written(&mut self, items: &[Append]) -> Result<(), LogError> {
        let t = std::time::Instant::now();
        let buf = self.encode_items(items);
        self.encode_us += t.elapsed().as_micros() as u64;
        let r = self.write_started(&buf);
        self.keep_buffer(buf);
        Ok(r?)
    }

    /// A handle of the log file for syncing appends made by [`Self::append_items_written`]
    /// (a new one after each compaction, which replaces the file).
    pub fn sync_handle(&self) -> Result<File, LogError> {
        Ok(self.file.try_clone()?)
    }

    /// The extra latency added to every durable append (see the type's docs).
    pub fn extra_persist_latency(&self) -> Duration {
        self.extra_persist_latency
    }

    /// Whether [`Self::maybe_compact`] would compact now.
    pub fn wants_compaction(&self) -> bool {
        self.len >= self.compact_min_bytes && self.len >= 2 * self.compacted_len
    }

    /// Appends without waiting for durability (as [`PmLog::append_lazy`]).
    pub fn append_items_lazy(&mut self, items: &[Append]) -> Result<(), LogError> {
        let buf = self.encode_items(items);
        let r = self.file.write_all(&buf);
        self.keep_buffer(buf);
        Ok(r?)
    }

    fn keep_buffer(&mut self, buf: Vec<u8>) {
        if buf.capacity() <= ENCODE_BUFFER_KEEP_BYTES {
            self.enc = buf;
        }
    }

    /// Appends `buf` (already counted in `self.len`) and makes it durable. Up to
    /// [`DSYNC_WRITE_MAX_BYTES`] it is one `O_DSYNC` write; a larger one goes through the page
    /// cache in pieces whose write-back is started as each is written, then one `fdatasync`:
    /// an `O_DSYNC` write reaches the device about one request at a time, this way many are in
    /// flight (on this project's virtio disks, about 3x the bandwidth for a catch-up's batch).
    fn write_durable(&mut self, buf: &[u8]) -> Result<(), LogError> {
        if buf.len() <= DSYNC_WRITE_MAX_BYTES {
            self.dsync.write_all(buf)?;
            return Ok(());
        }
        self.write_started(buf)?;
        self.file.sync_data()?;
        Ok(())
    }

    /// Appends `buf` (already counted in `self.len`) through the page cache, starting the
    /// write-back of each piece as it is written (not waiting for it).
    fn write_started(&mut self, buf: &[u8]) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let mut off = self.len - buf.len() as u64;
        for piece in buf.chunks(WRITEBACK_PIECE_BYTES) {
            self.file.write_all(piece)?;
            // SAFETY: sync_file_range only takes the fd (owned by `self.file`, open) and a byte
            // range; SYNC_FILE_RANGE_WRITE starts write-back without waiting for it. It is a
            // hint: durability comes from the fdatasync below, so its result is not needed.
            #[cfg(target_os = "linux")]
            unsafe {
                libc::sync_file_range(
                    self.file.as_raw_fd(),
                    off as i64,
                    piece.len() as i64,
                    libc::SYNC_FILE_RANGE_WRITE,
                );
            }
            off += piece.len() as u64;
        }
        Ok(())
    }

    /// Rebuilds the state from the file (a node reloading after it was removed).
    pub fn rebuild_state(&mut self) -> Result<LogState, LogError> {
        self.load_state()
    }

    /// Bytes in the log file.
    pub fn len_bytes(&self) -> u64 {
        self.len
    }

    /// Reads about `max_bytes` of updates at `cursor` (see [`read_chunk`]).
    pub fn read_chunk(&self, cursor: &LogCursor, max_bytes: usize) -> Result<LogChunk, LogError> {
        let markers: Vec<(u64, u64)> = self.markers.iter().map(|(e, o, _)| (*e, *o)).collect();
        Ok(read_chunk(
            &markers,
            self.gen,
            self.len,
            cursor,
            max_bytes,
            |off, n| read_exact_at_uninit(&self.file, off, n),
        )?)
    }

    /// Compacts the log if it has grown enough (see the type's docs). Returns whether it did.
    pub fn maybe_compact(&mut self) -> Result<bool, LogError> {
        if !self.wants_compaction() {
            return Ok(false);
        }
        self.compact()?;
        Ok(true)
    }

    /// Rewrites the log now, streaming: the head before the cut through a [`Rebuilder`] into
    /// its snapshot, the tail copied verbatim.
    pub fn compact(&mut self) -> Result<(), LogError> {
        use std::io::{Seek, SeekFrom};
        let whole: Vec<u64> = self.markers.iter().filter(|m| m.2).map(|m| m.1).collect();
        let cut = compaction_cut(&whole, self.len, self.max_tail_bytes);
        self.file.seek(SeekFrom::Start(0))?;
        let mut b = Rebuilder::default();
        stream_records((&self.file).take(cut), |r, _| b.push(r))?;
        let tmp = self.path.with_extension("compact");
        {
            let mut f = std::io::BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
            for r in snapshot_of(b.finish()) {
                f.write_all(&encode(&r))?;
            }
            self.file.seek(SeekFrom::Start(cut))?;
            std::io::copy(&mut (&self.file).take(self.len - cut), &mut f)?;
            let f = f.into_inner().map_err(|e| e.into_error())?;
            f.sync_all()?;
        }
        self.install(&tmp)?;
        self.compacted_len = self.len;
        self.compactions += 1;
        Ok(())
    }

    /// Puts the synced file `tmp` in the log's place (renamed, the directory synced: a crash
    /// leaves the old log or the new one) and reopens it as a new generation.
    fn install(&mut self, tmp: &Path) -> Result<(), LogError> {
        std::fs::rename(tmp, &self.path)?;
        if let Some(dir) = self.path.parent() {
            File::open(dir)?.sync_all()?;
        }
        let (file, dsync) = Self::open_files(&self.path)?;
        self.file = file;
        self.dsync = dsync;
        self.load_markers()?;
        self.gen += 1;
        Ok(())
    }

    /// Replaces the log with one holding only `Boot { node }` (written to a temporary file,
    /// synced, renamed: a crash leaves the old log or the new one) and returns the state that
    /// log holds. The full-copy baseline's returning node starts this way: the state of the
    /// art replaces a failed node with a new one that receives the whole store (HEAL §III, §IX;
    /// Hermes). The whole store then arrives as one record per key, a snapshot already, so
    /// compaction waits until the log is twice the size it was.
    pub fn reset_as_new_node(&mut self, node: u32) -> Result<LogState, LogError> {
        let old_len = self.len;
        let tmp = self.path.with_extension("new");
        {
            let mut f = File::create(&tmp)?;
            f.write_all(&encode(&LogRecord::Boot { node }))?;
            f.sync_all()?;
        }
        self.install(&tmp)?;
        self.compacted_len = old_len.max(self.len);
        Ok(LogState::new_node(node))
    }
}

impl PmLog for FileLog {
    fn append_durable(&mut self, recs: &[LogRecord]) -> Result<(), LogError> {
        self.persist_encoded(|log| log.encode_batch(recs))
    }

    fn append_lazy(&mut self, recs: &[LogRecord]) -> Result<(), LogError> {
        let buf = self.encode_batch(recs);
        let r = self.file.write_all(&buf);
        self.keep_buffer(buf);
        Ok(r?)
    }

    fn read_all(&mut self) -> Result<Vec<LogRecord>, LogError> {
        use std::io::Seek;
        self.file.seek(std::io::SeekFrom::Start(0))?;
        let mut bytes = Vec::new();
        self.file.read_to_end(&mut bytes)?;
        Ok(decode_all(&bytes).0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(v: u64, n: u32) -> Ts {
        Ts {
            version: v,
            node: n,
        }
    }

    #[test]
    fn rebuild_takes_marked_base_and_partially() {
        let k = b"k".to_vec();
        let recs = vec![
            LogRecord::Boot { node: 0 },
            LogRecord::Put {
                key: k.clone(),
                ts: ts(1, 0),
                value: b"a".to_vec(),
            },
            LogRecord::Mark {
                key: k.clone(),
                ts: ts(1, 0),
            },
            LogRecord::Put {
                key: k.clone(),
                ts: ts(2, 1),
                value: b"b".to_vec(),
            },
        ];
        let st = rebuild(&recs);
        assert!(st.booted);
        assert_eq!(st.base[&k], (ts(1, 0), b"a".to_vec()));
        assert_eq!(st.partially[&k], (ts(2, 1), b"b".to_vec()));
    }

    /// A chunk's records, encoded from its borrowed bytes, are byte for byte the owned
    /// records' encoding (and decode back to them): the log cannot tell the two paths apart.
    #[test]
    fn chunk_records_encode_as_owned_records() {
        let mut c = Chunk::default();
        c.push(b"a", ts(3, 1), &[1; 300], true);
        c.push(b"bb", ts(4, 2), b"", false);
        c.push(&[b'k'; 24], ts(u64::MAX, u32::MAX), &[9; 5], true);
        let offs: Vec<u32> = c.iter().map(|r| r.unwrap().0 as u32).collect();
        // The second entry was stale: not applied, not logged.
        let cp = ChunkPuts {
            chunk: std::sync::Arc::new(c),
            applied: vec![offs[0], offs[2]],
        };
        let mut got = Vec::new();
        cp.encode_into(&mut got);
        let want: Vec<u8> = cp.records().iter().flat_map(encode).collect();
        assert_eq!(got, want);
        let (recs, valid) = decode_all(&got);
        assert_eq!(valid, got.len());
        assert_eq!(recs, cp.records());
        assert_eq!(recs.len(), 4, "a Put and a Mark per committed entry");
        assert!(cp.size_hint() >= got.len());
    }

    /// The borrowed decoder (a reactive-log read) reads every variant as the owned one, and
    /// refuses a record whose checksum or length is off.
    #[test]
    fn borrowed_decoder_reads_the_owned_records() {
        let recs = [
            LogRecord::Boot { node: 7 },
            put("key", 9, 2, "value"),
            mark("key", 9, 2),
            LogRecord::Epoch {
                epoch: 4,
                whole: false,
            },
        ];
        for r in &recs {
            let b = encode(r);
            let owned = match decode_one_ref(&b).expect("decodes") {
                LogRecordRef::Boot { node } => LogRecord::Boot { node },
                LogRecordRef::Put { key, ts, value } => LogRecord::Put {
                    key: key.to_vec(),
                    ts,
                    value: value.to_vec(),
                },
                LogRecordRef::Mark { key, ts } => LogRecord::Mark {
                    key: key.to_vec(),
                    ts,
                },
                LogRecordRef::Epoch { epoch, whole } => LogRecord::Epoch { epoch, whole },
            };
            assert_eq!(&owned, r);
            let mut bad = b.clone();
            *bad.last_mut().unwrap() ^= 1;
            assert!(decode_one_ref(&bad).is_none(), "checksum");
            assert!(decode_one_ref(&b[..b.len() - 1]).is_none(), "length");
        }
    }

    #[test]
    fn decode_stops_at_torn_tail() {
        let mut bytes = encode(&LogRecord::Boot { node: 3 });
        let second = encode(&LogRecord::Mark {
            key: b"x".to_vec(),
            ts: ts(1, 1),
        });
        bytes.extend_from_slice(&second[..second.len() - 1]);
        let (recs, valid) = decode_all(&bytes);
        assert_eq!(recs.len(), 1);
        assert_eq!(valid, encode(&LogRecord::Boot { node: 3 }).len());
    }

    #[test]
    fn file_log_round_trip_and_torn_tail_cut() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("log");
        {
            let mut l = FileLog::open(&p, Duration::ZERO).unwrap();
            l.append_durable(&[LogRecord::Boot { node: 1 }]).unwrap();
            l.append_lazy(&[LogRecord::Mark {
                key: b"a".to_vec(),
                ts: ts(1, 1),
            }])
            .unwrap();
        }
        std::fs::OpenOptions::new()
            .append(true)
            .open(&p)
            .unwrap()
            .write_all(&[9, 9, 9])
            .unwrap();
        let mut l = FileLog::open(&p, Duration::ZERO).unwrap();
        assert_eq!(l.read_all().unwrap().len(), 2);
        l.append_durable(&[LogRecord::Boot { node: 1 }]).unwrap();
        assert_eq!(l.read_all().unwrap().len(), 3);
    }

    /// The full-copy baseline's new node: the old records are gone (reopened too), the log
    /// holds its Boot record, appends follow it, and compaction waits for twice the old size.
    #[test]
    fn reset_as_new_node_keeps_only_boot() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("log");
        let put = |v: u64| LogRecord::Put {
            key: b"a".to_vec(),
            ts: ts(v, 1),
            value: vec![7; 100],
        };
        let mut l = FileLog::open(&p, Duration::ZERO).unwrap();
        l.append_durable(&[LogRecord::Boot { node: 2 }, put(1)])
            .unwrap();
        let old_len = l.len_bytes();
        let st = l.reset_as_new_node(2).unwrap();
        assert_eq!(st, LogState::new_node(2));
        assert_eq!(
            rebuild(&l.read_all().unwrap()),
            st,
            "what the new log holds"
        );
        assert_eq!(l.read_all().unwrap(), vec![LogRecord::Boot { node: 2 }]);
        l.compact_min_bytes = 0;
        assert!(
            !l.wants_compaction(),
            "a new node's log is not compacted at once"
        );
        l.append_durable(&[put(2)]).unwrap();
        drop(l);
        let (l, st) = FileLog::open_and_rebuild(&p, Duration::ZERO).unwrap();
        assert!(st.booted);
        assert_eq!(st.partially[&b"a".to_vec()].0, ts(2, 1));
        assert!(l.len_bytes() < old_len + 200);
        assert!(!p.with_extension("new").exists());
    }

    #[test]
    fn a_returning_node_is_found_booted_and_reset_without_a_rebuild() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("log");
        assert!(!FileLog::was_booted(&p).unwrap(), "no log: never a member");
        let puts: Vec<LogRecord> = (0..50u64)
            .map(|i| LogRecord::Put {
                key: i.to_be_bytes().to_vec(),
                ts: ts(1, 0),
                value: vec![i as u8; 300],
            })
            .collect();
        // A preloaded store: records but no `Boot`.
        let mut l = FileLog::open(&p, Duration::ZERO).unwrap();
        l.append_durable(&puts).unwrap();
        drop(l);
        assert!(!FileLog::was_booted(&p).unwrap());
        // A `Boot` cut by a crash (its last byte lost) is not in the valid prefix: not booted,
        // as the rebuild sees it.
        let boot = encode(&LogRecord::Boot { node: 3 });
        let len = std::fs::metadata(&p).unwrap().len();
        let mut f = OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(&boot[..boot.len() - 1]).unwrap();
        drop(f);
        assert!(!FileLog::was_booted(&p).unwrap());
        assert!(
            !FileLog::open_and_rebuild(&p, Duration::ZERO)
                .unwrap()
                .1
                .booted
        );
        assert_eq!(
            std::fs::metadata(&p).unwrap().len(),
            len,
            "the torn tail is cut"
        );
        // Whole, after the store: booted, and the returning node starts as a new one.
        let mut l = FileLog::open(&p, Duration::ZERO).unwrap();
        l.append_durable(&[LogRecord::Boot { node: 3 }, puts[0].clone()])
            .unwrap();
        drop(l);
        assert!(FileLog::was_booted(&p).unwrap());
        let (mut l, st) = FileLog::open_as_new_node(&p, Duration::ZERO, 3).unwrap();
        assert_eq!(st, LogState::new_node(3));
        assert_eq!(l.read_all().unwrap(), vec![LogRecord::Boot { node: 3 }]);
        drop(l);
        let (_, again) = FileLog::open_and_rebuild(&p, Duration::ZERO).unwrap();
        assert_eq!(again, st, "what the new log rebuilds to");
    }

    #[test]
    fn written_appends_follow_in_order_and_survive_a_sync_on_the_handle() {
        // The pipelined path: large and small appends written without a sync, interleaved with
        // an `O_DSYNC` one, then one sync on a handle taken after them; reopened, every record
        // is there in order (a large append is written in write-back pieces).
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("log");
        let value = "v".repeat(1000);
        let mut want: Vec<LogRecord> = (0..1500)
            .flat_map(|i| {
                [
                    put(&format!("k{i}"), 1, 1, &value),
                    mark(&format!("k{i}"), 1, 1),
                ]
            })
            .collect();
        want.push(put("b", 2, 1, "small"));
        want.push(LogRecord::Boot { node: 1 });
        let n = want.len();
        {
            let mut l = FileLog::open(&p, Duration::ZERO).unwrap();
            let items = |r: &[LogRecord]| r.iter().cloned().map(Append::Rec).collect::<Vec<_>>();
            l.append_items_written(&items(&want[..n - 2])).unwrap();
            l.append_items_durable(&items(&want[n - 2..n - 1])).unwrap();
            l.append_items_written(&items(&want[n - 1..])).unwrap();
            l.sync_handle().unwrap().sync_data().unwrap();
            assert_eq!(l.len_bytes(), std::fs::metadata(&p).unwrap().len());
        }
        let got = FileLog::open(&p, Duration::ZERO)
            .unwrap()
            .read_all()
            .unwrap();
        assert_eq!(got.len(), n);
        assert!(
            got == want,
            "the records read back differ from those appended"
        );
    }

    fn put(k: &str, v: u64, n: u32, val: &str) -> LogRecord {
        LogRecord::Put {
            key: k.as_bytes().to_vec(),
            ts: ts(v, n),
            value: val.as_bytes().to_vec(),
        }
    }
    fn mark(k: &str, v: u64, n: u32) -> LogRecord {
        LogRecord::Mark {
            key: k.as_bytes().to_vec(),
            ts: ts(v, n),
        }
    }

    #[test]
    fn streaming_rebuild_equals_rebuild_and_keeps_the_valid_prefix() {
        let recs = vec![
            LogRecord::Boot { node: 2 },
            put("a", 1, 0, "a1"),
            mark("a", 1, 0),
            LogRecord::Epoch {
                epoch: 3,
                whole: true,
            },
            put("a", 2, 1, "a2"),
            put("b", 1, 1, "b1"),
            mark("b", 1, 1),
            put("a", 3, 0, "a3"),
            mark("a", 3, 0),
            put("c", 1, 0, "c1"),
        ];
        let mut bytes: Vec<u8> = recs.iter().flat_map(encode).collect();
        bytes.extend_from_slice(&[1, 2, 3]); // torn tail
        let mut b = Rebuilder::default();
        let valid = stream_records(&bytes[..], |r, _| b.push(r)).unwrap();
        assert_eq!(valid as usize, bytes.len() - 3);
        let st = b.finish();
        assert_eq!(st, rebuild(&recs));
        assert_eq!(st.base[&b"a".to_vec()].0, ts(3, 0));
        assert_eq!(st.partially[&b"c".to_vec()].0, ts(1, 0));
        assert_eq!((st.last_epoch, st.boot_node), (3, Some(2)));
    }

    /// Reads about `max` bytes of updates at `cursor` from the log image `bytes`.
    fn read_image(bytes: &[u8], cursor: &LogCursor, max: usize) -> LogChunk {
        let (markers, valid) = scan_markers(bytes);
        read_chunk(&markers, 0, valid as u64, cursor, max, |o, n| {
            Ok(bytes[o as usize..(o as usize + n).min(bytes.len())].to_vec())
        })
        .unwrap()
    }

    /// A log read's updates: (key, version, flagged committed).
    fn read_puts(c: &LogChunk) -> Vec<(Vec<u8>, u64, bool)> {
        c.entries
            .iter()
            .map(|e| {
                let (_, e) = e.unwrap();
                (e.key.to_vec(), e.ts.version, e.committed)
            })
            .collect()
    }

    #[test]
    fn read_chunk_flags_the_puts_the_log_marks() {
        let recs = [
            LogRecord::Epoch {
                epoch: 1,
                whole: true,
            },
            put("a", 1, 0, "a1"),
            put("b", 1, 0, "b1"),
            mark("a", 1, 0),
            put("a", 2, 0, "a2"),
            mark("b", 2, 0), // another version's flag marks nothing here
            put("c", 1, 0, "c1"),
            mark("c", 1, 0),
        ];
        let bytes: Vec<u8> = recs.iter().flat_map(encode).collect();
        let from_start = LogCursor {
            since_epoch: 1,
            gen: 0,
            pos: None,
        };
        let read = |max: usize| read_image(&bytes, &from_start, max);
        let all = read(1 << 20);
        assert_eq!(
            read_puts(&all),
            vec![
                (b"a".to_vec(), 1, true),
                (b"b".to_vec(), 1, false),
                (b"a".to_vec(), 2, false),
                (b"c".to_vec(), 1, true),
            ]
        );
        // A read that ends before a Put's flag leaves it unmarked (its reader asks the store).
        let first = read(1);
        assert_eq!(read_puts(&first), vec![(b"a".to_vec(), 1, false)]);
        // The unflagged entries are listed for the reader, by offset.
        let offsets: Vec<u32> = all.entries.iter().map(|e| e.unwrap().0 as u32).collect();
        assert_eq!(all.unmarked, vec![offsets[1], offsets[2]]);
        assert_eq!(first.unmarked, vec![0]);

        // The same version logged twice: its flag marks one copy, the other is listed.
        let recs = [
            LogRecord::Epoch {
                epoch: 1,
                whole: true,
            },
            put("a", 1, 0, "a1"),
            put("a", 1, 0, "a1"),
            mark("a", 1, 0),
        ];
        let bytes: Vec<u8> = recs.iter().flat_map(encode).collect();
        let c = read_image(&bytes, &from_start, 1 << 20);
        let offsets: Vec<u32> = c.entries.iter().map(|e| e.unwrap().0 as u32).collect();
        let flags: Vec<bool> = read_puts(&c).iter().map(|p| p.2).collect();
        assert_eq!(flags, vec![false, true]);
        assert_eq!(c.unmarked, vec![offsets[0]]);
    }

    #[test]
    fn read_chunk_starts_one_configuration_back_and_pages() {
        let recs = [
            LogRecord::Epoch {
                epoch: 1,
                whole: true,
            },
            put("a", 1, 0, "x"),
            LogRecord::Epoch {
                epoch: 4,
                whole: true,
            },
            put("b", 1, 0, "y"),
            LogRecord::Epoch {
                epoch: 5,
                whole: false,
            },
            put("a", 2, 0, "z"),
            put("a", 3, 0, "w"),
        ];
        let bytes: Vec<u8> = recs.iter().flat_map(encode).collect();
        let (markers, valid) = scan_markers(&bytes);
        assert_eq!(valid, bytes.len());
        assert_eq!(markers.len(), 3);
        let read = |c: &LogCursor, max: usize| read_image(&bytes, c, max);
        // Last complete in epoch 5: read from the record of epoch 4 (one back), redundant
        // updates of "a" included.
        let c = LogCursor {
            since_epoch: 5,
            gen: 0,
            pos: None,
        };
        let all = read(&c, 1 << 20);
        assert!(all.found && all.at_end);
        let keys: Vec<_> = read_puts(&all).into_iter().map(|p| (p.0, p.1)).collect();
        assert_eq!(
            keys,
            vec![(b"b".to_vec(), 1), (b"a".to_vec(), 2), (b"a".to_vec(), 3)]
        );
        // Paging: one small update per read, continuing at next_pos.
        let mut c = c;
        let mut got = Vec::new();
        loop {
            let ch = read(&c, 1);
            got.extend(read_puts(&ch).into_iter().map(|p| p.1));
            if ch.at_end {
                break;
            }
            c.pos = Some(ch.next_pos);
        }
        assert_eq!(got, vec![1, 2, 3]);
        // Genesis: epoch 1 reads from its own record; an unknown old epoch is not found.
        assert_eq!(
            read(
                &LogCursor {
                    since_epoch: 1,
                    gen: 0,
                    pos: None
                },
                1 << 20
            )
            .entries
            .validate(),
            Ok(4)
        );
        let m2: Vec<(u64, u64)> = markers[1..].to_vec();
        let r = read_chunk(
            &m2,
            0,
            valid as u64,
            &LogCursor {
                since_epoch: 4,
                gen: 0,
                pos: None,
            },
            1 << 20,
            |_, _| unreachable!(),
        )
        .unwrap();
        assert!(!r.found);
    }

    #[test]
    fn compaction_keeps_state_and_the_tail_from_the_second_newest_whole_epoch() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("log");
        let mut l = FileLog::open(&p, Duration::ZERO).unwrap();
        l.append_durable(&[
            LogRecord::Boot { node: 4 },
            LogRecord::Epoch {
                epoch: 1,
                whole: true,
            },
        ])
        .unwrap();
        for v in 1..=50u64 {
            l.append_durable(&[put("k", v, 0, &"v".repeat(100)), mark("k", v, 0)])
                .unwrap();
        }
        l.append_durable(&[
            LogRecord::Epoch {
                epoch: 2,
                whole: true,
            },
            put("j", 1, 1, "j1"),
            mark("j", 1, 1),
        ])
        .unwrap();
        l.append_durable(&[
            LogRecord::Epoch {
                epoch: 3,
                whole: true,
            },
            put("k", 51, 1, "last"),
        ])
        .unwrap();
        let before = rebuild(&l.read_all().unwrap());
        let len_before = l.len_bytes();
        l.compact().unwrap();
        assert!(
            l.len_bytes() < len_before / 4,
            "{} vs {len_before}",
            l.len_bytes()
        );
        let recs = l.read_all().unwrap();
        let after = rebuild(&recs);
        assert_eq!(after.base, before.base);
        assert_eq!(after.partially, before.partially);
        assert_eq!(after.boot_node, Some(4));
        // The reactive baseline can still serve a node last complete in epoch 3 (reads from
        // epoch 2's record); epoch 1's record is gone.
        let c = l
            .read_chunk(
                &LogCursor {
                    since_epoch: 3,
                    gen: 1,
                    pos: None,
                },
                1 << 20,
            )
            .unwrap();
        assert!(c.found);
        assert_eq!(c.entries.validate(), Ok(2));
        assert!(
            !l.read_chunk(
                &LogCursor {
                    since_epoch: 2,
                    gen: 1,
                    pos: None
                },
                1 << 20
            )
            .unwrap()
            .found
        );
        // Appends continue after compaction, and a reopen sees the same.
        l.append_durable(&[put("z", 1, 0, "z")]).unwrap();
        let (_, st) = FileLog::open_and_rebuild(&p, Duration::ZERO).unwrap();
        assert_eq!(st.partially[&b"z".to_vec()].0, ts(1, 0));
        assert_eq!(st.base[&b"j".to_vec()].0, ts(1, 1));
    }
}
