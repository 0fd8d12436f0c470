//! A shard's write-ahead journal: group commit for the slot store ([`crate::store`]).
//!
//! Without it every mutating command pays its own `fdatasync` of its own slot file, so 32 writes
//! in flight are 32 device flushes. With it a command appends one checksummed record holding the
//! bytes it is about to write (a physical redo record) to this journal, waits until a journal
//! `fdatasync` covers the record, and only then writes those bytes to its slot file (the page
//! cache) ([`Journal::commit_then`]). Whoever finds no sync running starts one for every record
//! appended so far; the rest wait for it (group commit), so one device flush acknowledges many
//! writes.
//!
//! Write-ahead, strictly: no slot byte is written before its record is durable, so after a
//! power loss every changed slot byte is either covered by a durable record (replay redoes the
//! whole command) or was never written (the object's old state, durable before, stands intact
//! and its block checksums still match). Written after the record, a command in flight could
//! leave some of its bytes in a slot with no record to redo them: the object failed its
//! checksums and came back suspect.
//!
//! # Layout
//!
//! A preallocated file (written with zeroes at creation, so appends change no file-system
//! metadata): a 4 KiB header page with two copies of the [`JHeader`] (sectors 0 and 1, the newer
//! valid one wins), then a ring of `capacity` bytes. Records are addressed by a log sequence
//! number (LSN: bytes since the journal was made; position = LSN mod capacity). A record is
//! 8-byte aligned: `magic u32, kind u32, boot u64, lsn u64, len u32, crc u32` then `len` payload
//! bytes; the CRC32C covers the first 28 header bytes and the payload. A record never straddles
//! the ring's end: a [`KIND_SKIP`] record (or, when fewer than a header's bytes are left,
//! nothing) sends the next one to the start of the next lap.
//!
//! # Replay
//!
//! From the header's `tail` LSN, records are read while each has the magic, this boot's number,
//! its own LSN and a matching CRC. The first that does not ends the log: a torn or partial last
//! record, an older lap's leftovers, or a record of an earlier boot that was never acknowledged
//! (every acknowledged record was synced after every record before it, so it is never behind an
//! invalid one). The caller applies the payloads in order, makes its files durable, and then
//! [`Journal::open`] moves `tail` to the end with a new boot number, so the next run's records
//! can never be confused with leftovers.
//!
//! # Checkpoint
//!
//! Journal space is reused only after a checkpoint: it takes the LSN `P` of the head and the set
//! of keys (slot files) records dirtied since the last checkpoint, waits until every record
//! below `P` has been applied to its files (a command between its durable record and its slot
//! writes is not in the page cache yet: moving the tail past it would forget an acknowledged
//! write), has the caller write back
//! each of those files — only those, never the whole file system, which the shards share — and
//! then writes `tail = P` into the header and syncs it (that `fdatasync`'s device flush also
//! makes the caller's written-back files durable, see `store`). Appenders that find the ring full wait
//! for it (bounded by the checkpoint's own progress).

use std::collections::{BTreeSet, HashSet};
use std::io;
use std::sync::{Condvar, Mutex};

/// The file operations the journal needs; [`std::fs::File`] and simulated files implement them.
pub trait JournalFile: Send + Sync {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()>;
    /// Makes every write before it durable (`fdatasync`).
    fn sync(&self) -> io::Result<()>;
}

impl JournalFile for std::fs::File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        std::os::unix::fs::FileExt::read_at(self, buf, offset)
    }
    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(self, data, offset)
    }
    fn sync(&self) -> io::Result<()> {
        self.sync_data()
    }
}

/// Bytes before the ring: two header copies, padded to a page.
pub const HEADER_PAGE_BYTES: u64 = 4096;
const HEADER_COPY_BYTES: u64 = 512;
const JHEADER_MAGIC: u32 = 0x554a_4831; // "UJH1"
const RECORD_MAGIC: u32 = 0x554a_5231; // "UJR1"
pub const RECORD_HEADER_BYTES: u64 = 32;
pub(crate) const KIND_DATA: u32 = 1;
const KIND_SKIP: u32 = 2;
/// The smallest ring the store makes: a record may take half of it (so a 4 MiB object and its
/// header fit).
pub const MIN_CAPACITY_BYTES: u64 = 16 << 20;
/// The smallest ring at all (tests use small rings to wrap often).
const MIN_RING_BYTES: u64 = 1024;
/// Journal syncs that may run at once. One at a time groups the most records per sync. A disk
/// that overlaps flushes idles between them (this machine's virtual disk does: with 32 writers,
/// 32 parallel `fdatasync`s of distinct slot files ran at ~5× the latency of one, not 32×);
/// allowing 4 was tried and measured no better in the store benchmark (fewer records per sync).
const MAX_SYNCS_RUNNING: usize = 1;
/// A checkpoint starts once this share of the ring (1/N) is in use, so appenders rarely wait.
const CHECKPOINT_AT_DIVISOR: u64 = 4;

fn align8(n: u64) -> u64 {
    n.div_ceil(8) * 8
}

/// The durable part of the journal's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct JHeader {
    seq: u64,
    capacity: u64,
    tail: u64,
    boot: u64,
}

impl JHeader {
    fn encode(&self) -> [u8; HEADER_COPY_BYTES as usize] {
        let mut b = [0u8; HEADER_COPY_BYTES as usize];
        b[0..4].copy_from_slice(&JHEADER_MAGIC.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.capacity.to_le_bytes());
        b[24..32].copy_from_slice(&self.tail.to_le_bytes());
        b[32..40].copy_from_slice(&self.boot.to_le_bytes());
        let crc = crc32c::crc32c(&b[..40]);
        b[40..44].copy_from_slice(&crc.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<JHeader> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        if u32::from_le_bytes(b[0..4].try_into().unwrap()) != JHEADER_MAGIC
            || u32::from_le_bytes(b[40..44].try_into().unwrap()) != crc32c::crc32c(&b[..40])
        {
            return None;
        }
        Some(JHeader { seq: u64_at(8), capacity: u64_at(16), tail: u64_at(24), boot: u64_at(32) })
    }
}

/// Where a record of `len` payload bytes goes if appended at `head`: the LSN it starts at
/// (after a jump to the next lap if it does not fit before the ring's end) and whether a skip
/// record must mark the jump.
fn place(head: u64, len: u64, capacity: u64) -> (u64, bool) {
    let left = capacity - head % capacity;
    if RECORD_HEADER_BYTES + align8(len) <= left {
        (head, false)
    } else {
        (head + left, left >= RECORD_HEADER_BYTES)
    }
}

pub(crate) fn record_header(kind: u32, boot: u64, lsn: u64, payload: &[u8]) -> [u8; RECORD_HEADER_BYTES as usize] {
    let mut h = [0u8; RECORD_HEADER_BYTES as usize];
    h[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
    h[4..8].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&boot.to_le_bytes());
    h[16..24].copy_from_slice(&lsn.to_le_bytes());
    h[24..28].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    let mut crc = crc32c::crc32c(&h[..28]);
    crc = crc32c::crc32c_append(crc, payload);
    h[28..32].copy_from_slice(&crc.to_le_bytes());
    h
}

struct State {
    header: JHeader,
    /// LSN the next record goes at.
    head: u64,
    /// Every record below this LSN is durable.
    synced: u64,
    /// Syncs running, and the highest LSN one of them covers.
    syncs_running: usize,
    sync_target: u64,
    checkpointing: bool,
    /// Keys (files) records dirtied since the last checkpoint began.
    dirty: HashSet<u64>,
    /// Start LSNs of records appended by [`Journal::commit_then`] whose bytes are not in the
    /// caller's files yet (at most one per command in flight).
    unapplied: BTreeSet<u64>,
    /// A failed sync: the journal is unusable until the shard restarts (what made it to disk is
    /// unknown, so nothing more may be acknowledged).
    failed: Option<String>,
}

/// Counters, for the shard's metrics.
#[derive(Clone, Copy, Debug, Default)]
pub struct JournalStats {
    pub records: u64,
    pub record_bytes: u64,
    pub syncs: u64,
    pub checkpoints: u64,
    pub checkpoint_files_synced: u64,
    pub checkpoint_us: u64,
    pub full_waits: u64,
}

pub struct Journal<F: JournalFile> {
    file: F,
    st: Mutex<State>,
    /// Wakes waiters for a sync, for space, and a checkpointer.
    cv: Condvar,
    stats: Mutex<JournalStats>,
}

/// A replayed record's payload.
pub type Payload = Vec<u8>;

impl<F: JournalFile> Journal<F> {
    /// Writes a new, empty journal of `capacity` ring bytes to `file` (zeroes, then the header,
    /// synced).
    pub fn format(file: &F, capacity: u64) -> io::Result<()> {
        if capacity < MIN_RING_BYTES || !capacity.is_multiple_of(8) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("journal capacity {capacity} bytes: at least {MIN_RING_BYTES} and a multiple of 8")));
        }
        let zeroes = vec![0u8; 1 << 20];
        let mut at = 0;
        while at < HEADER_PAGE_BYTES + capacity {
            let n = (HEADER_PAGE_BYTES + capacity - at).min(zeroes.len() as u64);
            file.write_all_at(&zeroes[..n as usize], at)?;
            at += n;
        }
        let h = JHeader { seq: 1, capacity, tail: 0, boot: 1 };
        file.write_all_at(&h.encode(), (h.seq % 2) * HEADER_COPY_BYTES)?;
        file.sync()
    }

    /// Reads the journal in `file` and returns the payloads of its valid records, in order,
    /// with `finish`: the caller applies them, makes them durable in its own files, then calls
    /// [`Replay::finish`] to get a journal ready for appends.
    pub fn open(file: F) -> io::Result<Replay<F>> {
        let mut page = vec![0u8; 2 * HEADER_COPY_BYTES as usize];
        read_full(&file, &mut page, 0)?;
        let header = [JHeader::decode(&page[..512]), JHeader::decode(&page[512..])]
            .into_iter()
            .flatten()
            .max_by_key(|h| h.seq)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "the journal has no valid header"))?;
        if header.capacity < MIN_RING_BYTES || !header.capacity.is_multiple_of(8) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("the journal's header names a bad capacity ({})", header.capacity)));
        }
        let mut payloads = vec![];
        let mut lsn = header.tail;
        let mut hdr = [0u8; RECORD_HEADER_BYTES as usize];
        // At most one lap: a valid chain never holds more than the ring.
        while lsn - header.tail < header.capacity {
            let left = header.capacity - lsn % header.capacity;
            if left < RECORD_HEADER_BYTES {
                lsn += left;
                continue;
            }
            let pos = HEADER_PAGE_BYTES + lsn % header.capacity;
            if read_full(&file, &mut hdr, pos)? < hdr.len() {
                break;
            }
            let u32_at = |i: usize| u32::from_le_bytes(hdr[i..i + 4].try_into().unwrap());
            let u64_at = |i: usize| u64::from_le_bytes(hdr[i..i + 8].try_into().unwrap());
            let (kind, len) = (u32_at(4), u32_at(24) as u64);
            if u32_at(0) != RECORD_MAGIC || u64_at(8) != header.boot || u64_at(16) != lsn || RECORD_HEADER_BYTES + align8(len) > left {
                break;
            }
            let mut payload = vec![0u8; len as usize];
            if read_full(&file, &mut payload, pos + RECORD_HEADER_BYTES)? < payload.len() {
                break;
            }
            let crc = crc32c::crc32c_append(crc32c::crc32c(&hdr[..28]), &payload);
            if crc != u32_at(28) {
                break;
            }
            match kind {
                KIND_DATA => {
                    payloads.push(payload);
                    lsn += RECORD_HEADER_BYTES + align8(len);
                }
                KIND_SKIP => lsn += left,
                _ => break,
            }
        }
        Ok(Replay { file, header, end: lsn, payloads })
    }

    /// Appends a record and returns once it is durable. `keys` are the files the record's
    /// bytes go to: the next checkpoint syncs them.
    #[cfg(test)]
    pub fn commit(&self, payload: &[u8], keys: &[u64]) -> io::Result<()> {
        self.commit_then(payload, keys, || Ok(()))
    }

    /// Write-ahead: appends a record, waits until it is durable, and only then runs `apply`,
    /// which writes the record's bytes to the caller's files (`keys`; the next checkpoint syncs
    /// them). A checkpoint never frees the record before `apply` returned. If `apply` fails the
    /// journal stops accepting records (the durable record would be redone at the next open,
    /// but this run's files miss its bytes).
    pub fn commit_then(&self, payload: &[u8], keys: &[u64], apply: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        let (start, end) = self.append_record(payload, keys, true)?;
        let result = self.wait_durable(end).and_then(|()| apply().inspect_err(|e| self.fail(format!("a slot write after its journal record failed: {e}"))));
        self.st.lock().unwrap().unapplied.remove(&start);
        self.cv.notify_all();
        result
    }

    fn fail(&self, why: String) {
        let mut st = self.st.lock().unwrap();
        st.failed.get_or_insert(why);
        drop(st);
        self.cv.notify_all();
    }

    /// Appends a record (to the page cache); returns the LSN its durability waits for.
    #[cfg(test)]
    pub fn append(&self, payload: &[u8], keys: &[u64]) -> io::Result<u64> {
        self.append_record(payload, keys, false).map(|(_, end)| end)
    }

    /// Appends a record; returns its start and end LSNs. `pin`: it counts as unapplied (no
    /// checkpoint moves past it) until [`Journal::commit_then`] removes it.
    fn append_record(&self, payload: &[u8], keys: &[u64], pin: bool) -> io::Result<(u64, u64)> {
        let len = payload.len() as u64;
        let mut st = self.st.lock().unwrap();
        let capacity = st.header.capacity;
        // At most half: after a checkpoint it then always fits, a jump to the next lap included.
        if RECORD_HEADER_BYTES + align8(len) > capacity / 2 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("a journal record of {len} bytes is too big for a {capacity} byte journal")));
        }
        let mut waited = false;
        let (at, skip) = loop {
            if let Some(e) = &st.failed {
                return Err(io::Error::other(e.clone()));
            }
            let (at, skip) = place(st.head, len, capacity);
            let end = at + RECORD_HEADER_BYTES + align8(len);
            if end - st.header.tail <= capacity {
                break (at, skip);
            }
            // Full: a checkpoint frees the space (the checkpointer is woken below and by us).
            if !waited {
                self.stats.lock().unwrap().full_waits += 1;
                waited = true;
            }
            self.cv.notify_all();
            st = self.cv.wait(st).unwrap();
        };
        let boot = st.header.boot;
        if skip {
            let h = record_header(KIND_SKIP, boot, st.head, &[]);
            self.file.write_all_at(&h, HEADER_PAGE_BYTES + st.head % capacity)?;
        }
        let pos = HEADER_PAGE_BYTES + at % capacity;
        let mut buf = Vec::with_capacity((RECORD_HEADER_BYTES + align8(len)) as usize);
        buf.extend_from_slice(&record_header(KIND_DATA, boot, at, payload));
        buf.extend_from_slice(payload);
        buf.resize((RECORD_HEADER_BYTES + align8(len)) as usize, 0);
        // Written under the lock: a sync that starts after we release it covers these bytes.
        if let Err(e) = self.file.write_all_at(&buf, pos) {
            st.failed = Some(format!("journal write failed: {e}"));
            return Err(e);
        }
        st.head = at + buf.len() as u64;
        st.dirty.extend(keys.iter().copied());
        if pin {
            st.unapplied.insert(at);
        }
        let end = st.head;
        let wake_checkpointer = end - st.header.tail > capacity / CHECKPOINT_AT_DIVISOR && !st.checkpointing;
        drop(st);
        {
            let mut s = self.stats.lock().unwrap();
            s.records += 1;
            s.record_bytes += len;
        }
        if wake_checkpointer {
            self.cv.notify_all();
        }
        Ok((at, end))
    }

    /// Waits until every record below `end` is durable (group commit): a record a running sync
    /// covers waits for it; otherwise the waiter syncs for every record appended so far, if
    /// fewer than `MAX_SYNCS_RUNNING` syncs run, else waits for one to end.
    pub fn wait_durable(&self, end: u64) -> io::Result<()> {
        let mut st = self.st.lock().unwrap();
        loop {
            if st.synced >= end {
                return Ok(());
            }
            if let Some(e) = &st.failed {
                return Err(io::Error::other(e.clone()));
            }
            if st.sync_target >= end || st.syncs_running >= MAX_SYNCS_RUNNING {
                st = self.cv.wait(st).unwrap();
                continue;
            }
            st.syncs_running += 1;
            let target = st.head;
            st.sync_target = target;
            drop(st);
            // Everything below `target` was written before this call: it covers those records
            // whatever the syncs started before it do.
            let r = self.file.sync();
            self.stats.lock().unwrap().syncs += 1;
            st = self.st.lock().unwrap();
            st.syncs_running -= 1;
            match r {
                Ok(()) => st.synced = st.synced.max(target),
                Err(e) => st.failed = Some(format!("journal fdatasync failed: {e}")),
            }
            self.cv.notify_all();
        }
    }

    /// Whether a checkpoint is due (the ring is a quarter full or more).
    pub fn checkpoint_due(&self) -> bool {
        let st = self.st.lock().unwrap();
        st.head - st.header.tail > st.header.capacity / CHECKPOINT_AT_DIVISOR
    }

    /// Waits up to `timeout` for a checkpoint to become due (or for anything else to change);
    /// returns whether one is due.
    pub fn wait_checkpoint_due(&self, timeout: std::time::Duration) -> bool {
        let st = self.st.lock().unwrap();
        let due = |s: &State| s.head - s.header.tail > s.header.capacity / CHECKPOINT_AT_DIVISOR;
        if due(&st) {
            return true;
        }
        let (st, _) = self.cv.wait_timeout(st, timeout).unwrap();
        due(&st)
    }

    /// Makes every record so far redundant: `sync_keys` writes back every key (file) dirtied
    /// since the last checkpoint (made durable by this journal's `fdatasync` that follows), then the header's tail moves to the head of now. One checkpoint
    /// at a time (others return at once).
    pub fn checkpoint(&self, sync_keys: impl FnOnce(&HashSet<u64>) -> io::Result<()>) -> io::Result<()> {
        let started = std::time::Instant::now();
        let (p, dirty, mut header) = {
            let mut st = self.st.lock().unwrap();
            if st.checkpointing || st.head == st.header.tail {
                return Ok(());
            }
            st.checkpointing = true;
            (st.head, std::mem::take(&mut st.dirty), st.header)
        };
        let n = dirty.len() as u64;
        let result = (|| {
            self.wait_applied_below(p)?;
            sync_keys(&dirty)?;
            header.seq += 1;
            header.tail = p;
            self.file.write_all_at(&header.encode(), (header.seq % 2) * HEADER_COPY_BYTES)?;
            self.file.sync()
        })();
        let mut st = self.st.lock().unwrap();
        st.checkpointing = false;
        match &result {
            Ok(()) => {
                st.header = header;
                // The records below `p` are durable too (the header's sync covered them).
                st.synced = st.synced.max(p);
            }
            Err(_) => {
                // Those files must still be synced by the next checkpoint.
                st.dirty.extend(dirty);
            }
        }
        drop(st);
        self.cv.notify_all();
        let mut s = self.stats.lock().unwrap();
        if result.is_ok() {
            s.checkpoints += 1;
            s.checkpoint_files_synced += n;
            s.checkpoint_us += started.elapsed().as_micros() as u64;
        }
        result
    }

    /// Waits until every record starting below `p` has been applied to its files (each is a
    /// command between its durable record and its page-cache writes: a short wait, bounded by
    /// the sync it waits for; a failed journal ends it).
    fn wait_applied_below(&self, p: u64) -> io::Result<()> {
        let mut st = self.st.lock().unwrap();
        while st.unapplied.first().is_some_and(|&lsn| lsn < p) {
            if let Some(e) = &st.failed {
                return Err(io::Error::other(e.clone()));
            }
            st = self.cv.wait(st).unwrap();
        }
        match &st.failed {
            Some(e) => Err(io::Error::other(e.clone())),
            None => Ok(()),
        }
    }

    pub fn stats(&self) -> JournalStats {
        *self.stats.lock().unwrap()
    }

    /// Bytes of the ring in use (records not yet checkpointed).
    pub fn used_bytes(&self) -> u64 {
        let st = self.st.lock().unwrap();
        st.head - st.header.tail
    }

    /// Wakes anyone waiting in [`Journal::wait_checkpoint_due`] (at shutdown).
    pub fn wake(&self) {
        self.cv.notify_all();
    }
}

/// A journal read at open, before its records are applied.
pub struct Replay<F: JournalFile> {
    file: F,
    header: JHeader,
    end: u64,
    /// The valid records' payloads, oldest first.
    pub payloads: Vec<Payload>,
}

impl<F: JournalFile> Replay<F> {
    /// The caller has made every payload durable in its own files: the records are no longer
    /// needed. Starts a new boot (records of this one are never taken for the last one's).
    pub fn finish(self) -> io::Result<Journal<F>> {
        let header = JHeader { seq: self.header.seq + 1, capacity: self.header.capacity, tail: self.end, boot: self.header.boot + 1 };
        self.file.write_all_at(&header.encode(), (header.seq % 2) * HEADER_COPY_BYTES)?;
        self.file.sync()?;
        Ok(Journal {
            file: self.file,
            st: Mutex::new(State {
                header,
                head: self.end,
                synced: self.end,
                syncs_running: 0,
                sync_target: self.end,
                checkpointing: false,
                dirty: HashSet::new(),
                unapplied: BTreeSet::new(),
                failed: None,
            }),
            cv: Condvar::new(),
            stats: Mutex::new(JournalStats::default()),
        })
    }

    pub fn capacity(&self) -> u64 {
        self.header.capacity
    }

    /// Where the valid records end: the LSN, and the boot number they carry.
    #[cfg(test)]
    pub(crate) fn end(&self) -> (u64, u64) {
        (self.end, self.header.boot)
    }
}

fn read_full<F: JournalFile>(f: &F, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match f.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    //! Replay against a simulated disk: writes since the last sync may each be lost, kept, or
    //! torn at any byte of their 512-byte sector when the machine crashes.
    use super::*;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};
    use std::collections::BTreeMap;

    const SECTOR: usize = 512;

    /// A file on a disk that loses or tears unsynced sectors in a crash.
    #[derive(Default)]
    struct CrashFile {
        inner: Mutex<CrashInner>,
    }

    #[derive(Default, Clone)]
    struct CrashInner {
        durable: Vec<u8>,
        /// Sectors written since the last sync: their current bytes.
        pending: BTreeMap<usize, Vec<u8>>,
    }

    impl CrashInner {
        fn sector(&self, i: usize) -> Vec<u8> {
            self.pending.get(&i).cloned().unwrap_or_else(|| {
                let mut v = vec![0u8; SECTOR];
                let start = (i * SECTOR).min(self.durable.len());
                let end = ((i + 1) * SECTOR).min(self.durable.len());
                v[..end - start].copy_from_slice(&self.durable[start..end]);
                v
            })
        }
    }

    impl JournalFile for CrashFile {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
            let f = self.inner.lock().unwrap();
            for (i, b) in buf.iter_mut().enumerate() {
                let at = offset as usize + i;
                *b = f.sector(at / SECTOR)[at % SECTOR];
            }
            Ok(buf.len())
        }
        fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
            let mut f = self.inner.lock().unwrap();
            let mut at = offset as usize;
            for chunk in data.chunks(SECTOR) {
                let mut done = 0;
                while done < chunk.len() {
                    let (sec, within) = (at / SECTOR, at % SECTOR);
                    let n = (SECTOR - within).min(chunk.len() - done);
                    let mut s = f.sector(sec);
                    s[within..within + n].copy_from_slice(&chunk[done..done + n]);
                    f.pending.insert(sec, s);
                    at += n;
                    done += n;
                }
            }
            Ok(())
        }
        fn sync(&self) -> io::Result<()> {
            let mut f = self.inner.lock().unwrap();
            let pending = std::mem::take(&mut f.pending);
            for (sec, bytes) in pending {
                let end = (sec + 1) * SECTOR;
                if f.durable.len() < end {
                    f.durable.resize(end, 0);
                }
                f.durable[sec * SECTOR..end].copy_from_slice(&bytes);
            }
            Ok(())
        }
    }

    impl CrashFile {
        /// The file as the disk holds it after a crash: each unsynced sector lost, written, or
        /// torn (a prefix of it written).
        fn crash(&self, rng: &mut impl Rng) -> CrashFile {
            let f = self.inner.lock().unwrap().clone();
            let mut durable = f.durable.clone();
            for (sec, bytes) in &f.pending {
                let end = (sec + 1) * SECTOR;
                if durable.len() < end {
                    durable.resize(end, 0);
                }
                let keep = match rng.gen_range(0..3) {
                    0 => 0,
                    1 => SECTOR,
                    _ => rng.gen_range(1..SECTOR),
                };
                durable[sec * SECTOR..sec * SECTOR + keep].copy_from_slice(&bytes[..keep]);
            }
            CrashFile { inner: Mutex::new(CrashInner { durable, pending: BTreeMap::new() }) }
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Append(usize),
        Sync,
        Checkpoint,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![4 => (0usize..3000).prop_map(Op::Append), 2 => Just(Op::Sync), 1 => Just(Op::Checkpoint)]
    }

    fn payload(n: usize, len: usize) -> Vec<u8> {
        (0..len).map(|i| (n * 31 + i * 7) as u8).collect()
    }

    const RING: u64 = 16 << 10;

    /// Runs `ops` on a journal, crashes, and checks the replay: it returns, in order, the records
    /// appended since the last checkpoint — every acknowledged one, and then perhaps some that
    /// were appended but never synced (whole and intact, or not at all: a torn tail ends it).
    fn cycle(file: CrashFile, ops: &[Op], first: bool, rng: &mut impl Rng) -> Result<CrashFile, TestCaseError> {
        if first {
            Journal::format(&file, RING).unwrap();
        }
        let replay = Journal::open(file).unwrap();
        let j = replay.finish().unwrap();
        let mut since_checkpoint: Vec<Vec<u8>> = vec![];
        let mut acked = 0;
        for (n, op) in ops.iter().enumerate() {
            match op {
                Op::Append(len) => {
                    // The test runs single-threaded: free space by a checkpoint rather than wait.
                    if j.used_bytes() + 2 * (RECORD_HEADER_BYTES + align8(*len as u64)) + 64 > RING {
                        j.checkpoint(|_| Ok(())).unwrap();
                        since_checkpoint.clear();
                        acked = 0;
                    }
                    let p = payload(n, *len);
                    j.append(&p, &[n as u64]).unwrap();
                    since_checkpoint.push(p);
                }
                Op::Sync => {
                    let head = j.st.lock().unwrap().head;
                    j.wait_durable(head).unwrap();
                    acked = since_checkpoint.len();
                }
                Op::Checkpoint => {
                    j.checkpoint(|_| Ok(())).unwrap();
                    since_checkpoint.clear();
                    acked = 0;
                }
            }
        }
        let crashed = j.file.crash(rng);
        let replay = Journal::open(crashed).unwrap();
        let got = &replay.payloads;
        prop_assert!(got.len() >= acked, "{} records replayed, {} acknowledged", got.len(), acked);
        prop_assert!(got.len() <= since_checkpoint.len(), "{} replayed, only {} appended", got.len(), since_checkpoint.len());
        prop_assert!(got[..] == since_checkpoint[..got.len()], "replayed records differ from those appended");
        Ok(replay.file)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

        /// Two crash cycles: the second run's replay never takes the first run's unacknowledged
        /// leftovers for its own records.
        #[test]
        fn replay_returns_every_acknowledged_record_and_ignores_a_torn_tail(
            a in proptest::collection::vec(op(), 0..60),
            b in proptest::collection::vec(op(), 0..60),
            seed in any::<u64>(),
        ) {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let f = cycle(CrashFile::default(), &a, true, &mut rng)?;
            cycle(f, &b, false, &mut rng)?;
        }
    }

    #[test]
    fn group_commit_shares_syncs_between_threads() {
        let file = CrashFile::default();
        Journal::format(&file, 1 << 20).unwrap();
        let j = std::sync::Arc::new(Journal::open(file).unwrap().finish().unwrap());
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let j = j.clone();
                std::thread::spawn(move || {
                    for i in 0..50 {
                        j.commit(&payload(t * 100 + i, 100), &[t as u64]).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let s = j.stats();
        assert_eq!(s.records, 400);
        assert!(s.syncs <= 400, "{} syncs for 400 records", s.syncs);
        // Every record is durable and replays, in an order each thread's own records keep.
        let crashed = j.file.crash(&mut rand::rngs::StdRng::seed_from_u64(1));
        assert_eq!(Journal::open(crashed).unwrap().payloads.len(), 400);
    }

    /// A record of an earlier run, intact on disk behind a torn one, is never replayed as this
    /// run's, even when this run's records end exactly where it starts.
    #[test]
    fn an_earlier_runs_leftover_record_is_not_replayed() {
        let file = CrashFile::default();
        Journal::format(&file, RING).unwrap();
        let j = Journal::open(file).unwrap().finish().unwrap();
        let start = j.st.lock().unwrap().head;
        for n in 0..3 {
            j.commit(&payload(n, 1000), &[]).unwrap();
        }
        // The second record's header torn (as if never synced, the third written by chance).
        let b_at = HEADER_PAGE_BYTES + (start + RECORD_HEADER_BYTES + 1000) % RING;
        j.file.write_all_at(&[0xff; 8], b_at).unwrap();
        j.file.sync().unwrap();
        let replay = Journal::open(j.file).unwrap();
        assert_eq!(replay.payloads, vec![payload(0, 1000)]);
        let j = replay.finish().unwrap();
        // This run's record is as long as the torn one: the leftover third sits right behind it.
        j.commit(&payload(7, 1000), &[]).unwrap();
        let replay = Journal::open(j.file).unwrap();
        assert_eq!(replay.payloads, vec![payload(7, 1000)]);
    }

    /// A checkpoint never frees a durable record whose bytes are not in the caller's files yet
    /// (the tail moving past it would forget an acknowledged write at a power loss).
    #[test]
    fn a_checkpoint_waits_until_a_durable_record_is_applied() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::{mpsc, Arc};
        let file = CrashFile::default();
        Journal::format(&file, RING).unwrap();
        let j = Arc::new(Journal::open(file).unwrap().finish().unwrap());
        let applied = Arc::new(AtomicBool::new(false));
        let (applying_tx, applying_rx) = mpsc::channel();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let writer = {
            let (j, applied) = (j.clone(), applied.clone());
            std::thread::spawn(move || {
                j.commit_then(&payload(1, 100), &[1], || {
                    applying_tx.send(()).unwrap();
                    go_rx.recv().unwrap();
                    applied.store(true, Ordering::SeqCst);
                    Ok(())
                })
            })
        };
        applying_rx.recv().unwrap();
        let checkpointer = {
            let (j, applied) = (j.clone(), applied.clone());
            std::thread::spawn(move || {
                j.checkpoint(|keys| {
                    assert!(applied.load(Ordering::SeqCst), "the checkpoint synced the files before the record's bytes were in them");
                    assert!(keys.contains(&1));
                    Ok(())
                })
            })
        };
        // Give the checkpoint time to (wrongly) go ahead before the bytes are applied.
        std::thread::sleep(std::time::Duration::from_millis(100));
        go_tx.send(()).unwrap();
        writer.join().unwrap().unwrap();
        checkpointer.join().unwrap().unwrap();
        assert_eq!(j.used_bytes(), 0);
    }

    #[test]
    fn a_journal_without_a_valid_header_is_a_clear_error() {
        let file = CrashFile::default();
        file.write_all_at(&[0u8; 8192], 0).unwrap();
        let err = Journal::open(file).err().expect("refused");
        assert!(err.to_string().contains("no valid header"), "{err}");
    }
}
