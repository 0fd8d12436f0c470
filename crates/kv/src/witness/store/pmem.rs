//! NVMM emulation for the backup's buffers (paper §3.2: "the backup persists it to a small NVMM
//! buffer, then responds"; spec (c) "Honest tier emulation").
//!
//! A [`PmemRegion`] is a bounded ring of records in one file: a 4 KiB header page, then
//! `capacity_bytes` of ring. Each record is framed like `kv::pmlog`'s records,
//! `len: u32 LE | crc32c: u32 LE | seq: u64 LE | payload`, but the checksum also covers the
//! record's *logical offset* (an ever-growing position in the ring): a record left over from an
//! earlier lap of the ring sits at the wrong logical offset, fails its checksum and ends the
//! scan. (`pmlog`'s codec frames postcard `LogRecord`s in an append-only file and has no notion
//! of laps, so it is not reused as is; the framing shape is the same.)
//!
//! Two modes:
//! - [`PmemMode::Shm`] (default): the file lives in `/dev/shm` and is mapped with `memmap2`;
//!   persist = copy into the mapping + a fence, plus an optional busy-wait `persist_ns` to model
//!   the device's latency. The mapping is `MAP_SHARED` on tmpfs, so every store is in the page
//!   cache the moment it is made: it **survives SIGKILL and a restart of the process, but not a
//!   power loss or a host reboot** (tmpfs is RAM). That is the honest limit of this emulation.
//! - [`PmemMode::Dsync`]: the same layout in a file on disk opened `O_DSYNC`; each persist is a
//!   `pwrite` that returns once the bytes are on stable storage (power-safe, ~100 µs per persist
//!   on this machine's disk, which hides the paper's point that NVMM replication is faster than
//!   SSD). Reads go through a shared mapping of the same file (the page cache is coherent with
//!   `pwrite` on Linux).
//!
//! Recovery ([`PmemRegion::open`]) scans from the persisted head and stops at the first torn,
//! corrupt or out-of-order record: everything after it was never acknowledged as persisted.
//! [`PmemRegion::truncate_through`] frees the prefix that writeback has made durable on SSD.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use super::TierBytes;

/// Bytes of the header page in front of the ring.
pub const HEADER_BYTES: usize = 4096;
/// Bytes of a record's frame: len, crc32c, seq.
pub const FRAME_BYTES: usize = 4 + 4 + 8;
/// Largest payload of one record (a maximal key and value plus the caller's framing).
pub const MAX_RECORD_PAYLOAD_BYTES: usize = 2 * 1024 * 1024;
/// A region's ring may not be smaller than this (a record must always fit after a wrap).
pub const MIN_CAPACITY_BYTES: u64 = 64 * 1024;
const MAGIC: &[u8; 8] = b"USPMEM01";
/// `len` of the marker that says "the rest of this lap is unused, continue at the next lap".
const WRAP_LEN: u32 = u32::MAX;
// Header fields (offsets in the header page).
const H_MAGIC: usize = 0;
const H_CAPACITY: usize = 8;
const H_HEAD: usize = 16;

/// Where the region lives and how a persist is made durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PmemMode {
    /// `/dev/shm` + mmap: survives SIGKILL, not power loss.
    #[default]
    Shm,
    /// `O_DSYNC` file on disk: power-safe, slow.
    Dsync,
}

impl std::str::FromStr for PmemMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "shm" => Ok(PmemMode::Shm),
            "dsync" => Ok(PmemMode::Dsync),
            _ => Err(format!("unknown pmem mode {s:?} (expected shm or dsync)")),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PmemError {
    #[error("pmem I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "pmem region full: a record of {need_bytes} bytes does not fit in the {free_bytes} free \
         bytes of {capacity_bytes} (writeback must free a prefix first)"
    )]
    Full {
        need_bytes: u64,
        free_bytes: u64,
        capacity_bytes: u64,
    },
    #[error("pmem record payload of {len} bytes exceeds the limit of {MAX_RECORD_PAYLOAD_BYTES}")]
    TooLarge { len: usize },
    #[error("pmem seq {seq} is not above the last appended seq {last}")]
    SeqOrder { seq: u64, last: u64 },
    #[error("{path} is not a pmem region of {expected} bytes: {why}")]
    BadHeader {
        path: PathBuf,
        expected: u64,
        why: String,
    },
    #[error("pmem capacity {0} bytes is below the minimum of {MIN_CAPACITY_BYTES}")]
    TooSmall(u64),
}

/// Configuration of one region.
#[derive(Clone, Debug)]
pub struct PmemConfig {
    pub mode: PmemMode,
    /// Bytes of the ring (the file is this plus [`HEADER_BYTES`]).
    pub capacity_bytes: u64,
    /// Extra busy-wait per persist, modelling the device's write latency (0 = none).
    pub persist_ns: u64,
}

/// One live record: where it is and its seq.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Live {
    seq: u64,
    /// Logical offset of the frame.
    at: u64,
    len: u32,
}

/// A bounded ring of persisted records (see the module doc).
pub struct PmemRegion {
    path: PathBuf,
    mode: PmemMode,
    map: MmapMut,
    /// The `O_DSYNC` handle in [`PmemMode::Dsync`]; `None` in shm mode.
    dsync: Option<File>,
    capacity: u64,
    persist_ns: u64,
    /// Logical offset of the first live byte (persisted in the header).
    head: u64,
    /// Logical offset where the next record goes.
    tail: u64,
    live: VecDeque<Live>,
    last_seq: Option<u64>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> PmemError + '_ {
    move |source| PmemError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn record_crc(at: u64, seq: u64, payload: &[u8]) -> u32 {
    let c = crc32c::crc32c(&at.to_le_bytes());
    let c = crc32c::crc32c_append(c, &seq.to_le_bytes());
    crc32c::crc32c_append(c, payload)
}

fn wrap_crc(at: u64) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(b"wrap"), &at.to_le_bytes())
}

impl PmemRegion {
    /// The default directory of [`PmemMode::Shm`] regions.
    pub fn shm_dir() -> PathBuf {
        PathBuf::from("/dev/shm")
    }

    /// Opens (creating if absent) the region at `path` and recovers its live records.
    /// An existing file must have been created with the same capacity.
    pub fn open(path: &Path, cfg: &PmemConfig) -> Result<Self, PmemError> {
        if cfg.capacity_bytes < MIN_CAPACITY_BYTES {
            return Err(PmemError::TooSmall(cfg.capacity_bytes));
        }
        let file_len = HEADER_BYTES as u64 + cfg.capacity_bytes;
        let mut oo = OpenOptions::new();
        oo.read(true).write(true).create(true);
        let file = oo.open(path).map_err(io_err(path))?;
        let existing = file.metadata().map_err(io_err(path))?.len();
        let fresh = existing == 0;
        if fresh {
            file.set_len(file_len).map_err(io_err(path))?;
        } else if existing != file_len {
            return Err(PmemError::BadHeader {
                path: path.into(),
                expected: file_len,
                why: format!("the file has {existing} bytes"),
            });
        }
        // SAFETY: the file is ours (a per-node path); no other process resizes it while it is
        // mapped, which is the condition under which a shared mapping stays valid.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(io_err(path))?;
        let dsync = match cfg.mode {
            PmemMode::Shm => None,
            PmemMode::Dsync => Some(
                OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_DSYNC)
                    .open(path)
                    .map_err(io_err(path))?,
            ),
        };
        let mut me = PmemRegion {
            path: path.into(),
            mode: cfg.mode,
            map,
            dsync,
            capacity: cfg.capacity_bytes,
            persist_ns: cfg.persist_ns,
            head: 0,
            tail: 0,
            live: VecDeque::new(),
            last_seq: None,
        };
        if fresh {
            let mut h = [0u8; 24];
            h[H_MAGIC..H_MAGIC + 8].copy_from_slice(MAGIC);
            h[H_CAPACITY..H_CAPACITY + 8].copy_from_slice(&cfg.capacity_bytes.to_le_bytes());
            h[H_HEAD..H_HEAD + 8].copy_from_slice(&0u64.to_le_bytes());
            me.persist_at(0, &h)?;
            if cfg.mode == PmemMode::Dsync {
                // The new file's size and header must survive a power loss too.
                file.sync_all().map_err(io_err(path))?;
            }
        } else {
            let h = &me.map[..24];
            let why = if &h[H_MAGIC..H_MAGIC + 8] != MAGIC {
                Some("bad magic".to_string())
            } else {
                let cap = u64::from_le_bytes(h[H_CAPACITY..H_CAPACITY + 8].try_into().unwrap());
                (cap != cfg.capacity_bytes).then(|| format!("its ring holds {cap} bytes"))
            };
            if let Some(why) = why {
                return Err(PmemError::BadHeader {
                    path: path.into(),
                    expected: file_len,
                    why,
                });
            }
            me.head = u64::from_le_bytes(me.map[H_HEAD..H_HEAD + 8].try_into().unwrap());
            me.recover();
        }
        Ok(me)
    }

    fn phys(&self, at: u64) -> usize {
        HEADER_BYTES + (at % self.capacity) as usize
    }

    /// Bytes from logical offset `at` to the physical end of the ring.
    fn to_lap_end(&self, at: u64) -> u64 {
        self.capacity - at % self.capacity
    }

    fn next_lap(&self, at: u64) -> u64 {
        at + self.to_lap_end(at)
    }

    /// Scans from `head` and keeps every whole record in order; stops at the first torn,
    /// corrupt or out-of-order one.
    fn recover(&mut self) {
        let mut at = self.head;
        let end = self.head + self.capacity;
        loop {
            if self.to_lap_end(at) < FRAME_BYTES as u64 {
                at = self.next_lap(at);
            }
            if at + FRAME_BYTES as u64 > end {
                break;
            }
            let p = self.phys(at);
            let len = u32::from_le_bytes(self.map[p..p + 4].try_into().unwrap());
            let crc = u32::from_le_bytes(self.map[p + 4..p + 8].try_into().unwrap());
            if len == WRAP_LEN {
                if crc != wrap_crc(at) {
                    break;
                }
                at = self.next_lap(at);
                continue;
            }
            let framed = FRAME_BYTES as u64 + len as u64;
            if len as usize > MAX_RECORD_PAYLOAD_BYTES
                || framed > self.to_lap_end(at)
                || at + framed > end
            {
                break;
            }
            let seq = u64::from_le_bytes(self.map[p + 8..p + 16].try_into().unwrap());
            let payload = &self.map[p + FRAME_BYTES..p + framed as usize];
            if record_crc(at, seq, payload) != crc || self.last_seq.is_some_and(|l| seq <= l) {
                break;
            }
            self.live.push_back(Live { seq, at, len });
            self.last_seq = Some(seq);
            at += framed;
        }
        self.tail = if self.live.is_empty() { self.head } else { at };
    }

    /// Writes `bytes` at physical offset `p` durably (per the mode).
    fn persist_at(&mut self, p: usize, bytes: &[u8]) -> Result<(), PmemError> {
        match &self.dsync {
            None => {
                self.map[p..p + bytes.len()].copy_from_slice(bytes);
                // The emulated clwb + sfence: later stores are not reordered before these.
                fence(Ordering::SeqCst);
            }
            Some(f) => f
                .write_all_at(bytes, p as u64)
                .map_err(io_err(&self.path))?,
        }
        Ok(())
    }

    fn persist_delay(&self) {
        if self.persist_ns > 0 {
            let until = Instant::now() + Duration::from_nanos(self.persist_ns);
            while Instant::now() < until {
                std::hint::spin_loop();
            }
        }
    }

    /// Appends one record and persists it before returning. `seq` must be above every earlier
    /// seq of this region (the caller's own numbering; gaps are fine).
    pub fn append(&mut self, seq: u64, payload: &[u8]) -> Result<(), PmemError> {
        if payload.len() > MAX_RECORD_PAYLOAD_BYTES {
            return Err(PmemError::TooLarge { len: payload.len() });
        }
        if let Some(last) = self.last_seq {
            if seq <= last {
                return Err(PmemError::SeqOrder { seq, last });
            }
        }
        let framed = (FRAME_BYTES + payload.len()) as u64;
        let mut at = self.tail;
        let skip = if self.to_lap_end(at) < framed {
            self.to_lap_end(at)
        } else {
            0
        };
        let used = self.tail - self.head;
        if used + skip + framed > self.capacity {
            return Err(PmemError::Full {
                need_bytes: framed + skip,
                free_bytes: self.capacity - used,
                capacity_bytes: self.capacity,
            });
        }
        if skip > 0 {
            if skip >= FRAME_BYTES as u64 {
                let mut w = [0u8; 8];
                w[..4].copy_from_slice(&WRAP_LEN.to_le_bytes());
                w[4..].copy_from_slice(&wrap_crc(at).to_le_bytes());
                let p = self.phys(at);
                self.persist_at(p, &w)?;
            }
            at += skip;
        }
        let mut rec = Vec::with_capacity(framed as usize);
        rec.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        rec.extend_from_slice(&record_crc(at, seq, payload).to_le_bytes());
        rec.extend_from_slice(&seq.to_le_bytes());
        rec.extend_from_slice(payload);
        let p = self.phys(at);
        self.persist_at(p, &rec)?;
        self.persist_delay();
        self.live.push_back(Live {
            seq,
            at,
            len: payload.len() as u32,
        });
        self.last_seq = Some(seq);
        self.tail = at + framed;
        Ok(())
    }

    /// Frees every record with seq ≤ `seq` that is at the front (a prefix: records are freed in
    /// append order). Returns how many were freed. The new head is persisted, so a restart does
    /// not bring them back.
    pub fn truncate_through(&mut self, seq: u64) -> Result<usize, PmemError> {
        let mut n = 0;
        while self.live.front().is_some_and(|r| r.seq <= seq) {
            self.live.pop_front();
            n += 1;
        }
        if n == 0 {
            return Ok(0);
        }
        let new_head = self.live.front().map(|r| r.at).unwrap_or(self.tail);
        self.head = new_head;
        self.persist_at(H_HEAD, &new_head.to_le_bytes())?;
        Ok(n)
    }

    /// The live records in append order, as (seq, payload).
    pub fn iter(&self) -> impl Iterator<Item = (u64, &[u8])> + '_ {
        self.live.iter().map(|r| {
            let p = self.phys(r.at) + FRAME_BYTES;
            (r.seq, &self.map[p..p + r.len as usize])
        })
    }

    /// The payload of the live record `seq`, if any.
    pub fn get(&self, seq: u64) -> Option<&[u8]> {
        let i = self.live.binary_search_by_key(&seq, |r| r.seq).ok()?;
        let r = self.live[i];
        let p = self.phys(r.at) + FRAME_BYTES;
        Some(&self.map[p..p + r.len as usize])
    }

    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    pub fn last_seq(&self) -> Option<u64> {
        self.last_seq
    }

    /// Bytes of the ring in use (live records plus any wrap gap between them).
    pub fn used_bytes(&self) -> u64 {
        self.tail - self.head
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.capacity
    }

    pub fn mode(&self) -> PmemMode {
        self.mode
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// NVMM: the whole mapped file (it is provisioned, used or not); DRAM index: the live list.
    pub fn tier_bytes(&self) -> TierBytes {
        TierBytes {
            nvmm: HEADER_BYTES as u64 + self.capacity,
            ssd: 0,
            dram_index: (self.live.capacity() * std::mem::size_of::<Live>()) as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(mode: PmemMode, cap: u64) -> PmemConfig {
        PmemConfig {
            mode,
            capacity_bytes: cap,
            persist_ns: 0,
        }
    }

    fn payload(i: u64, n: usize) -> Vec<u8> {
        (0..n).map(|j| (i as usize * 31 + j) as u8).collect()
    }

    fn records(r: &PmemRegion) -> Vec<(u64, Vec<u8>)> {
        r.iter().map(|(s, p)| (s, p.to_vec())).collect()
    }

    /// A temp dir in /dev/shm for shm mode, on the real disk for dsync.
    fn dir_for(mode: PmemMode) -> tempfile::TempDir {
        match mode {
            PmemMode::Shm => tempfile::tempdir_in(PmemRegion::shm_dir()).unwrap(),
            PmemMode::Dsync => tempfile::tempdir_in("/var/tmp").unwrap(),
        }
    }

    #[test]
    fn pmem_append_reopen_truncate_both_modes() {
        for mode in [PmemMode::Shm, PmemMode::Dsync] {
            let d = dir_for(mode);
            let p = d.path().join("buf");
            let c = cfg(mode, MIN_CAPACITY_BYTES);
            let mut r = PmemRegion::open(&p, &c).unwrap();
            for s in 1..=10u64 {
                r.append(s * 2, &payload(s, 100 + s as usize)).unwrap();
            }
            let before = records(&r);
            assert!(matches!(
                r.append(3, b"x"),
                Err(PmemError::SeqOrder { seq: 3, last: 20 })
            ));
            drop(r);
            let mut r = PmemRegion::open(&p, &c).unwrap();
            assert_eq!(records(&r), before, "{mode:?}");
            assert_eq!(r.get(8), Some(&payload(4, 104)[..]));
            assert_eq!(r.truncate_through(9).unwrap(), 4);
            drop(r);
            let r = PmemRegion::open(&p, &c).unwrap();
            assert_eq!(records(&r), before[4..].to_vec(), "{mode:?}");
            assert_eq!(r.last_seq(), Some(20));
            // A region of another size is refused, not reinterpreted.
            assert!(matches!(
                PmemRegion::open(&p, &cfg(mode, 2 * MIN_CAPACITY_BYTES)),
                Err(PmemError::BadHeader { .. })
            ));
        }
    }

    #[test]
    fn pmem_full_region_is_a_clear_error_and_wraps_after_truncate() {
        let d = dir_for(PmemMode::Shm);
        let p = d.path().join("buf");
        let c = cfg(PmemMode::Shm, MIN_CAPACITY_BYTES);
        let mut r = PmemRegion::open(&p, &c).unwrap();
        let rec = payload(0, 1000);
        let mut seq = 0;
        let err = loop {
            seq += 1;
            match r.append(seq, &rec) {
                Ok(()) => {}
                Err(e) => break e,
            }
        };
        assert!(matches!(err, PmemError::Full { .. }), "{err}");
        assert!(err.to_string().contains("full"));
        let n = r.len();
        assert_eq!(n as u64, MIN_CAPACITY_BYTES / (FRAME_BYTES as u64 + 1000));
        // Nothing was lost by the refused append; free half and lap the ring several times.
        let mut first = 1;
        for _ in 0..5 * n {
            if r.append(seq, &payload(seq, 1000)).is_err() {
                r.truncate_through(first + n as u64 / 2).unwrap();
                first += n as u64 / 2 + 1;
                r.append(seq, &payload(seq, 1000)).unwrap();
            }
            seq += 1;
        }
        let before = records(&r);
        assert!(before.iter().all(|(s, p)| *p == payload(*s, 1000)));
        drop(r);
        let r = PmemRegion::open(&p, &c).unwrap();
        assert_eq!(records(&r), before);
        assert!(matches!(
            PmemRegion::open(&d.path().join("small"), &cfg(PmemMode::Shm, 4096)),
            Err(PmemError::TooSmall(4096))
        ));
        assert!(matches!(
            r.tier_bytes(),
            TierBytes { nvmm, ssd: 0, .. } if nvmm == MIN_CAPACITY_BYTES + HEADER_BYTES as u64
        ));
    }

    #[test]
    fn pmem_recovery_stops_at_torn_or_corrupt_tail() {
        for mode in [PmemMode::Shm, PmemMode::Dsync] {
            let d = dir_for(mode);
            let p = d.path().join("buf");
            let c = cfg(mode, MIN_CAPACITY_BYTES);
            let mut r = PmemRegion::open(&p, &c).unwrap();
            for s in 1..=6u64 {
                r.append(s, &payload(s, 200)).unwrap();
            }
            let all = records(&r);
            let at5 = HEADER_BYTES as u64 + 4 * (FRAME_BYTES as u64 + 200);
            drop(r);
            // A torn record: record 5's payload half written (the rest zero), 6 never written.
            let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
            f.write_all_at(&[0u8; 300], at5 + FRAME_BYTES as u64 + 100)
                .unwrap();
            let mut r = PmemRegion::open(&p, &c).unwrap();
            assert_eq!(records(&r), all[..4].to_vec(), "{mode:?}");
            // Appends continue after the last whole record, and survive a reopen.
            r.append(7, b"seven").unwrap();
            drop(r);
            let r = PmemRegion::open(&p, &c).unwrap();
            assert_eq!(r.len(), 5);
            assert_eq!(r.get(7), Some(&b"seven"[..]));
            drop(r);
            // One flipped byte in record 3's payload: recovery keeps 1 and 2.
            let at3 = HEADER_BYTES as u64 + 2 * (FRAME_BYTES as u64 + 200);
            let mut b = [0u8; 1];
            f.read_exact_at(&mut b, at3 + 50).unwrap();
            f.write_all_at(&[b[0] ^ 0x40], at3 + 50).unwrap();
            let r = PmemRegion::open(&p, &c).unwrap();
            assert_eq!(records(&r), all[..2].to_vec(), "{mode:?}");
            // A garbage length: no panic, same prefix.
            f.write_all_at(&[0xff, 0xff, 0xff, 0x7f], at3).unwrap();
            let r = PmemRegion::open(&p, &c).unwrap();
            assert_eq!(r.len(), 2);
        }
    }

    /// Random appends of random sizes (lapping the ring many times), prefix frees, refused
    /// appends of a full ring, torn appends (garbage where the next record goes) and reopens,
    /// checked after every step against a model of the live records.
    #[test]
    fn pmem_random_appends_frees_torn_tails_and_reopens_match_a_model() {
        for seed in 1..=4u64 {
            let mut rng = seed.wrapping_mul(0x2545_f491_4f6c_dd1d);
            let mut next = move |n: u64| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng % n
            };
            let d = dir_for(PmemMode::Shm);
            let p = d.path().join("buf");
            let c = cfg(PmemMode::Shm, MIN_CAPACITY_BYTES);
            let mut r = PmemRegion::open(&p, &c).unwrap();
            let mut model: VecDeque<(u64, Vec<u8>)> = VecDeque::new();
            let (mut seq, mut fulls, mut laps) = (0u64, 0, 0);
            for step in 0..600 {
                match next(12) {
                    0..=6 => {
                        seq += 1 + next(3);
                        let rec = payload(seq, 1 + next(6000) as usize);
                        match r.append(seq, &rec) {
                            Ok(()) => model.push_back((seq, rec)),
                            Err(PmemError::Full {
                                need_bytes,
                                free_bytes,
                                ..
                            }) => {
                                assert!(need_bytes > free_bytes, "seed {seed} step {step}");
                                fulls += 1;
                            }
                            Err(e) => panic!("seed {seed} step {step}: {e}"),
                        }
                    }
                    7 | 8 => {
                        if !model.is_empty() {
                            let upto = model[next(model.len() as u64) as usize].0;
                            r.truncate_through(upto).unwrap();
                            model.retain(|(s, _)| *s > upto);
                        }
                    }
                    9 => {
                        // A torn append: part of a frame and payload where the next record goes.
                        let room = r.to_lap_end(r.tail).min(r.capacity - r.used_bytes());
                        let n = room.min(1 + next(300)) as usize;
                        let at = r.phys(r.tail);
                        for (i, b) in r.map[at..at + n].iter_mut().enumerate() {
                            *b = (seed as usize + i * 7) as u8;
                        }
                        drop(r);
                        r = PmemRegion::open(&p, &c).unwrap();
                    }
                    _ => {
                        drop(r);
                        r = PmemRegion::open(&p, &c).unwrap();
                    }
                }
                let got: Vec<(u64, Vec<u8>)> = r.iter().map(|(s, p)| (s, p.to_vec())).collect();
                assert_eq!(got, Vec::from(model.clone()), "seed {seed} step {step}");
                laps = laps.max(r.tail / r.capacity);
            }
            assert!(
                fulls > 0 && laps >= 5,
                "seed {seed}: {fulls} full, {laps} laps"
            );
        }
    }

    /// With every record freed, the bytes at the head are an earlier lap's records (equal sizes
    /// put its boundaries exactly there); a reopen must not bring them back. The record's
    /// logical offset in its checksum is what tells them apart.
    #[test]
    fn pmem_fully_freed_ring_does_not_resurrect_an_earlier_lap() {
        for mode in [PmemMode::Shm, PmemMode::Dsync] {
            let d = dir_for(mode);
            let p = d.path().join("buf");
            let c = cfg(mode, MIN_CAPACITY_BYTES);
            let mut r = PmemRegion::open(&p, &c).unwrap();
            for s in 1..=100u64 {
                if s == 61 {
                    r.truncate_through(60).unwrap();
                }
                r.append(s, &payload(s, 1000)).unwrap();
            }
            assert!(r.tail > r.capacity, "the ring lapped");
            assert_eq!(r.truncate_through(100).unwrap(), 40);
            drop(r);
            let mut r = PmemRegion::open(&p, &c).unwrap();
            assert!(r.is_empty(), "{mode:?}: {} records came back", r.len());
            r.append(101, b"next").unwrap();
            drop(r);
            let r = PmemRegion::open(&p, &c).unwrap();
            assert_eq!(records(&r), vec![(101, b"next".to_vec())]);
        }
    }
}
