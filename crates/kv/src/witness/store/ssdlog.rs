//! The backup's SSD logs (paper §3.2–§3.3, Fig 4; spec (c) "SSD tier" and the `ssdlog.rs` row):
//! the hot and cold sets of segment files, written in page-aligned batches and read with
//! `O_DIRECT`, in the one format of [`core::page`](crate::witness::core::page). The core decides
//! what goes where (segment, offset) and when a segment is freed; this module makes it durable
//! and honest on this machine.
//!
//! **Why O_DIRECT.** On this machine the page cache would hold a multi-GiB log in RAM and serve
//! every PriorityPull and the offline copy from memory, which would make both fiction. Every
//! segment is opened `O_DIRECT` (checked with `fcntl(F_GETFL)` after opening), every transfer is
//! whole 4 KiB pages through a 4 KiB-aligned buffer. A file system that refuses `O_DIRECT`
//! (or that is memory, tmpfs e.g. `/dev/shm`, which accepts `O_DIRECT` since Linux 6.6 but reads
//! from RAM) gets [`SsdError::NoDirectIo`], never a silent buffered fallback.
//!
//! **Files.** `hot-<id>.seg` and `cold-<id>.seg`, ids unique across both logs. A segment is
//! created by its first write ([`SsdLogs::write_at`], the core's `SsdWrite`), with the directory
//! synced so that the file outlives a crash, and deleted by [`SsdLogs::delete_segment`] (the
//! core's `SsdFree`, after GC).
//!
//! **Recovery.** [`SsdLogs::open`] scans every segment in id order and stops each at its first
//! torn or corrupt entry or empty page; it hands the segments' valid bytes to the core
//! ([`DurableSeg`]), which rebuilds its index from them with the same rule as live updates.
//!
//! [`SsdLogs::append`] (the store placing a batch itself, in the same format) is for tools,
//! tests and `bench kv ssd`, which have no core; a node never calls it.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use super::TierBytes;
pub use crate::witness::core::node::DurableSeg;
use crate::witness::core::page::{self, BatchBuilder, ENTRY_FIXED_BYTES};
pub use crate::witness::core::page::{decode_pages, round_up_page, Loc, FRAME_BYTES, PAGE_BYTES};
/// The two logs (the core's type).
pub use crate::witness::core::ssd::SsdLog as LogKind;
use crate::witness::proto::{Entry, Op};

/// Largest key (as everywhere in the KV).
pub const MAX_KEY_BYTES: usize = crate::pmlog::record::MAX_KEY_BYTES;
/// Largest value (as everywhere in the KV).
pub const MAX_VALUE_BYTES: usize = crate::pmlog::record::MAX_VALUE_BYTES;
/// Default size at which [`SsdLogs::append`] closes a segment and starts a new one.
pub const DEFAULT_SEGMENT_MAX_BYTES: u64 = 64 << 20;

/// The logical timestamp of a committed entry: (term, index) of the Raft variant (§3.1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LogTs {
    pub term: u64,
    pub index: u64,
}

/// A Put, owned: what tools and the benchmark append (a node writes the core's [`Entry`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SsdEntry {
    pub key: Vec<u8>,
    pub ts: LogTs,
    pub value: Vec<u8>,
}

impl SsdEntry {
    pub fn to_entry(&self) -> Entry {
        Entry {
            index: self.ts.index,
            term: self.ts.term,
            op: Op::Put {
                key: self.key.clone(),
                value: Some(serde_bytes::ByteBuf::from(self.value.clone())),
            },
        }
    }

    /// The Put in `e`, if it is one with its value.
    pub fn from_entry(e: &Entry) -> Option<SsdEntry> {
        Some(SsdEntry {
            key: e.key()?.to_vec(),
            ts: LogTs {
                term: e.term,
                index: e.index,
            },
            value: e.value()?.to_vec(),
        })
    }
}

/// The framed size of a Put of `key` and `value`.
pub fn framed_len(key: &[u8], value: &[u8]) -> usize {
    FRAME_BYTES + ENTRY_FIXED_BYTES + key.len() + value.len()
}

/// The bytes (whole pages) `entries` take as one batch.
pub fn packed_len(entries: &[SsdEntry]) -> usize {
    let es: Vec<Entry> = entries.iter().map(SsdEntry::to_entry).collect();
    page::packed_len(&es)
}

#[derive(Debug, thiserror::Error)]
pub enum SsdError {
    #[error("ssd log I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path}: no direct I/O here ({source}); the SSD tier must be on a real disk that \
         accepts O_DIRECT (not tmpfs such as /dev/shm) so that no read is served from memory"
    )]
    NoDirectIo {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Entry(#[from] page::PageError),
    #[error("no segment {0}")]
    UnknownSegment(u64),
    #[error("segment {0} is the active segment of its log (seal it first)")]
    ActiveSegment(u64),
    #[error("segment {0} exists in the other log")]
    WrongLog(u64),
    #[error("unaligned SSD write of {len} bytes at {off} (whole {PAGE_BYTES}-byte pages only)")]
    Unaligned { off: u64, len: usize },
    #[error("segment {seg} offset {off}: {why}")]
    Corrupt {
        seg: u64,
        off: u64,
        why: &'static str,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> SsdError + '_ {
    move |source| SsdError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A zeroed heap buffer aligned to [`PAGE_BYTES`], whose length is a multiple of it: what
/// `O_DIRECT` transfers need.
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively (like a Box<[u8]>).
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes rounded up to whole pages (at least one).
    pub fn zeroed(len: usize) -> Self {
        let len = len.max(1).div_ceil(PAGE_BYTES) * PAGE_BYTES;
        let layout = std::alloc::Layout::from_size_align(len, PAGE_BYTES).expect("valid layout");
        // SAFETY: layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            std::ptr::NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout =
            std::alloc::Layout::from_size_align(self.len, PAGE_BYTES).expect("valid layout");
        // SAFETY: allocated in `zeroed` with this very layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialized (zeroed) bytes for the buffer's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} B)", self.len)
    }
}

/// One segment file.
struct Segment {
    kind: LogKind,
    path: PathBuf,
    file: File,
    /// Bytes of durable pages (a page multiple); appends go here.
    end: AtomicU64,
}

/// The active segment of one log.
#[derive(Default)]
struct Writer {
    active: Option<u64>,
}

/// Configuration of the logs.
#[derive(Clone, Debug)]
pub struct SsdConfig {
    /// A segment is closed once a batch would take it past this.
    pub segment_max_bytes: u64,
}

impl Default for SsdConfig {
    fn default() -> Self {
        SsdConfig {
            segment_max_bytes: DEFAULT_SEGMENT_MAX_BYTES,
        }
    }
}

/// The hot and cold segment sets in one directory (files `hot-<id>.seg`, `cold-<id>.seg`; ids
/// are unique across both). All methods take `&self`: reads run in parallel with an append
/// (the I/O pool shares one `Arc<SsdLogs>`); appends to one log are serialized.
pub struct SsdLogs {
    dir: PathBuf,
    cfg: SsdConfig,
    segs: RwLock<BTreeMap<u64, Arc<Segment>>>,
    writers: [Mutex<Writer>; 2],
    next_seg: AtomicU64,
}

/// Opens `path` with `O_DIRECT` and checks that the flag stuck.
fn open_direct(path: &Path, create: bool) -> Result<File, SsdError> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|source| {
            if source.raw_os_error() == Some(libc::EINVAL) {
                SsdError::NoDirectIo {
                    path: path.into(),
                    source,
                }
            } else {
                SsdError::Io {
                    path: path.into(),
                    source,
                }
            }
        })?;
    if !is_direct(&f) {
        return Err(SsdError::NoDirectIo {
            path: path.into(),
            source: std::io::Error::other("O_DIRECT was dropped by the file system"),
        });
    }
    Ok(f)
}

/// Whether `f` was opened with `O_DIRECT`.
pub fn is_direct(f: &File) -> bool {
    // SAFETY: F_GETFL on a valid, owned descriptor has no side effects.
    let fl = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) };
    fl >= 0 && fl & libc::O_DIRECT != 0
}

/// The name of the memory file system `dir` is on, if it is one (tmpfs, ramfs).
pub fn memory_fs(dir: &Path) -> Option<&'static str> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statfs writes only into the zeroed struct we own; c is a valid C string.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    match st.f_type as i64 {
        TMPFS_MAGIC => Some("tmpfs"),
        RAMFS_MAGIC => Some("ramfs"),
        _ => None,
    }
}

fn sync_dir(dir: &Path) -> Result<(), SsdError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))
}

impl SsdLogs {
    /// Opens (creating) the logs in `dir` and scans every segment: returns the logs and each
    /// segment's whole valid bytes (what the core's restore rebuilds its index from). Every
    /// existing segment is sealed. Fails with [`SsdError::NoDirectIo`] on tmpfs.
    pub fn open(dir: &Path, cfg: SsdConfig) -> Result<(SsdLogs, Vec<DurableSeg>), SsdError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        // Linux ≥ 6.6 accepts O_DIRECT on tmpfs, but there every read is a memory copy: the
        // tier would be RAM posing as SSD. Refuse memory file systems by their magic.
        if let Some(fs) = memory_fs(dir) {
            return Err(SsdError::NoDirectIo {
                path: dir.into(),
                source: std::io::Error::other(format!("{fs} keeps its files in RAM")),
            });
        }
        // Probe O_DIRECT first, so an unsuitable directory fails before anything else.
        let probe = dir.join(".direct-probe");
        let r = open_direct(&probe, true);
        let _ = std::fs::remove_file(&probe);
        r?;
        let mut found = Vec::new();
        for e in std::fs::read_dir(dir).map_err(io_err(dir))? {
            let e = e.map_err(io_err(dir))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(stem) = name.strip_suffix(".seg") else {
                continue;
            };
            let (kind, id) = match stem.split_once('-') {
                Some(("hot", id)) => (LogKind::Hot, id),
                Some(("cold", id)) => (LogKind::Cold, id),
                _ => continue,
            };
            let Ok(id) = id.parse::<u64>() else { continue };
            found.push((id, kind, e.path()));
        }
        found.sort();
        let me = SsdLogs {
            dir: dir.into(),
            cfg,
            segs: RwLock::new(BTreeMap::new()),
            writers: Default::default(),
            next_seg: AtomicU64::new(found.last().map_or(1, |f| f.0 + 1)),
        };
        let mut durable = Vec::new();
        for (id, kind, path) in found {
            let file = open_direct(&path, false)?;
            let len = file.metadata().map_err(io_err(&path))?.len();
            let seg = Arc::new(Segment {
                kind,
                path,
                file,
                end: AtomicU64::new(len / PAGE_BYTES as u64 * PAGE_BYTES as u64),
            });
            me.segs.write().unwrap().insert(id, seg);
            let bytes = me.read_raw(id, 0, len as usize)?;
            let (_, valid) = decode_pages(id, 0, &bytes);
            me.segs.read().unwrap()[&id]
                .end
                .store(valid as u64, Ordering::Release);
            durable.push(DurableSeg {
                seg: id,
                log: kind,
                bytes: bytes[..valid].to_vec(),
            });
        }
        Ok((me, durable))
    }

    fn seg(&self, id: u64) -> Result<Arc<Segment>, SsdError> {
        self.segs
            .read()
            .unwrap()
            .get(&id)
            .cloned()
            .ok_or(SsdError::UnknownSegment(id))
    }

    /// Reads whole pages `[off, off + len)` (rounded out to pages) of segment `seg` with
    /// `O_DIRECT`. Bytes beyond the file's end read as zero.
    pub fn read_raw(&self, seg: u64, off: u64, len: usize) -> Result<AlignedBuf, SsdError> {
        let s = self.seg(seg)?;
        let start = off / PAGE_BYTES as u64 * PAGE_BYTES as u64;
        let n = round_up_page((off - start) as usize + len);
        let mut buf = AlignedBuf::zeroed(n);
        let mut done = 0;
        while done < n {
            let r = s
                .file
                .read_at(&mut buf[done..], start + done as u64)
                .map_err(io_err(&s.path))?;
            if r == 0 {
                break;
            }
            done += r;
        }
        Ok(buf)
    }

    /// Reads the entry at `loc` (the pages holding it).
    pub fn read_entry(&self, loc: Loc) -> Result<Entry, SsdError> {
        let (start, n) = loc.page_span();
        let bytes = self.read_raw(loc.seg, start, n)?;
        page::entry_at(loc, &bytes).ok_or(SsdError::Corrupt {
            seg: loc.seg,
            off: loc.off,
            why: "no valid entry at this location",
        })
    }

    /// Writes `bytes` (whole pages, page aligned) at `off` of segment `seg` of log `kind`,
    /// creating the segment file if it is new, then `fdatasync`s: durable on return.
    pub fn write_at(
        &self,
        seg: u64,
        kind: LogKind,
        off: u64,
        bytes: &[u8],
    ) -> Result<(), SsdError> {
        if !off.is_multiple_of(PAGE_BYTES as u64) || !bytes.len().is_multiple_of(PAGE_BYTES) {
            return Err(SsdError::Unaligned {
                off,
                len: bytes.len(),
            });
        }
        let s = match self.seg(seg) {
            Ok(s) => s,
            Err(_) => self.create(seg, kind)?,
        };
        if s.kind != kind {
            return Err(SsdError::WrongLog(seg));
        }
        let mut buf = AlignedBuf::zeroed(bytes.len());
        buf[..bytes.len()].copy_from_slice(bytes);
        s.file
            .write_all_at(&buf[..bytes.len()], off)
            .map_err(io_err(&s.path))?;
        s.file.sync_data().map_err(io_err(&s.path))?;
        s.end.fetch_max(off + bytes.len() as u64, Ordering::AcqRel);
        Ok(())
    }

    /// Creates segment `id` (or returns it if a concurrent write just did).
    fn create(&self, id: u64, kind: LogKind) -> Result<Arc<Segment>, SsdError> {
        let mut segs = self.segs.write().unwrap();
        if let Some(s) = segs.get(&id) {
            return Ok(s.clone());
        }
        let path = self.dir.join(format!("{}-{id:016}.seg", kind.name()));
        let file = open_direct(&path, true)?;
        // The new file's directory entry must be durable before data in it is relied on.
        sync_dir(&self.dir)?;
        let s = Arc::new(Segment {
            kind,
            path,
            file,
            end: AtomicU64::new(0),
        });
        segs.insert(id, s.clone());
        self.next_seg.fetch_max(id + 1, Ordering::AcqRel);
        Ok(s)
    }

    /// Appends `entries` as one batch to `kind`'s active segment (a new one if there is none or
    /// the batch would take it past the size limit), then `fdatasync`s. Returns each entry's
    /// location, in order. On return the batch is durable. For tools and benchmarks: a node's
    /// core places its batches itself ([`SsdLogs::write_at`]).
    pub fn append(&self, kind: LogKind, entries: &[SsdEntry]) -> Result<Vec<Loc>, SsdError> {
        let mut w = self.writers[kind as usize].lock().unwrap();
        let bytes = packed_len(entries);
        let active = w
            .active
            .map(|id| self.seg(id).map(|s| (id, s)))
            .transpose()?;
        let (id, s) = match active {
            Some((id, s))
                if s.end.load(Ordering::Acquire) == 0
                    || s.end.load(Ordering::Acquire) + bytes as u64
                        <= self.cfg.segment_max_bytes =>
            {
                (id, s)
            }
            _ => {
                let id = self.next_seg.fetch_add(1, Ordering::AcqRel);
                let s = self.create(id, kind)?;
                w.active = Some(id);
                (id, s)
            }
        };
        let base = s.end.load(Ordering::Acquire);
        let mut b = BatchBuilder::new(id, base);
        let mut locs = Vec::with_capacity(entries.len());
        for e in entries {
            if e.key.is_empty() {
                return Err(page::PageError::EntryTooLarge {
                    key: 0,
                    value: e.value.len(),
                }
                .into());
            }
            locs.push(b.push(&e.to_entry())?);
        }
        let (buf, _) = b.finish();
        self.write_at(id, kind, base, &buf)?;
        Ok(locs)
    }

    /// Closes `kind`'s active [`SsdLogs::append`] segment: the next append starts a new one.
    pub fn seal(&self, kind: LogKind) {
        self.writers[kind as usize].lock().unwrap().active = None;
    }

    /// The segments of `kind` as (id, durable bytes), oldest first.
    pub fn segments(&self, kind: LogKind) -> Vec<(u64, u64)> {
        self.segs
            .read()
            .unwrap()
            .iter()
            .filter(|(_, s)| s.kind == kind)
            .map(|(id, s)| (*id, s.end.load(Ordering::Acquire)))
            .collect()
    }

    /// The log a segment belongs to.
    pub fn kind_of(&self, seg: u64) -> Result<LogKind, SsdError> {
        Ok(self.seg(seg)?.kind)
    }

    /// Deletes a segment (the core frees one only when nothing references or reads it).
    pub fn delete_segment(&self, id: u64) -> Result<(), SsdError> {
        let s = self.seg(id)?;
        if self.writers[s.kind as usize].lock().unwrap().active == Some(id) {
            return Err(SsdError::ActiveSegment(id));
        }
        self.segs.write().unwrap().remove(&id);
        std::fs::remove_file(&s.path).map_err(io_err(&s.path))?;
        sync_dir(&self.dir)
    }

    /// Whether every segment file is open with `O_DIRECT` (for tests and `kv status`).
    pub fn all_direct(&self) -> bool {
        self.segs
            .read()
            .unwrap()
            .values()
            .all(|s| is_direct(&s.file))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// SSD: the durable bytes of every segment.
    pub fn tier_bytes(&self) -> TierBytes {
        TierBytes {
            ssd: self
                .segs
                .read()
                .unwrap()
                .values()
                .map(|s| s.end.load(Ordering::Acquire))
                .sum(),
            ..Default::default()
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A temp dir on the real disk (O_DIRECT needs one; /tmp may be tmpfs elsewhere).
    pub(crate) fn disk_dir() -> tempfile::TempDir {
        tempfile::tempdir_in("/var/tmp").unwrap()
    }

    /// Newest version of every key in the scanned segments, with its location (the rule the
    /// core's restore applies).
    pub(crate) fn newest_of(segs: &[DurableSeg]) -> HashMap<Vec<u8>, (LogTs, Loc)> {
        let mut m: HashMap<Vec<u8>, (LogTs, Loc)> = HashMap::new();
        for d in segs {
            for (loc, e) in decode_pages(d.seg, 0, &d.bytes).0 {
                let Some(se) = SsdEntry::from_entry(&e) else {
                    continue;
                };
                let cur = m.entry(se.key).or_insert((se.ts, loc));
                if cur.0 <= se.ts {
                    *cur = (se.ts, loc);
                }
            }
        }
        m
    }

    fn ent(k: &str, term: u64, index: u64, vlen: usize) -> SsdEntry {
        SsdEntry {
            key: k.as_bytes().to_vec(),
            ts: LogTs { term, index },
            value: (0..vlen).map(|i| (i as u64 + index) as u8).collect(),
        }
    }

    #[test]
    fn ssdlog_refuses_tmpfs_and_opens_segments_with_o_direct() {
        let shm = tempfile::tempdir_in("/dev/shm").unwrap();
        let e = SsdLogs::open(shm.path(), SsdConfig::default())
            .err()
            .unwrap();
        assert!(matches!(e, SsdError::NoDirectIo { .. }), "{e}");
        assert!(e.to_string().contains("O_DIRECT"));
        let d = disk_dir();
        let (logs, _) = SsdLogs::open(d.path(), SsdConfig::default()).unwrap();
        logs.append(LogKind::Hot, &[ent("a", 1, 1, 10)]).unwrap();
        logs.append(LogKind::Cold, &[ent("b", 1, 2, 10)]).unwrap();
        assert!(logs.all_direct());
        assert_eq!(logs.segments(LogKind::Hot).len(), 1);
        // And the flag is what the kernel reports for the descriptor, not just what we asked.
        let s = logs.seg(logs.segments(LogKind::Hot)[0].0).unwrap();
        // SAFETY: F_GETFL on a live descriptor.
        let fl = unsafe { libc::fcntl(s.file.as_raw_fd(), libc::F_GETFL) };
        assert_ne!(fl & libc::O_DIRECT, 0);
        let plain = File::open(&s.path).unwrap();
        assert!(!is_direct(&plain));
        // The page cache holds none of the segment after direct writes and reads; a buffered
        // read of the same file fills it (so this check can see the difference).
        let (seg, _) = logs.segments(LogKind::Hot)[0];
        let idx_loc = Loc {
            seg,
            off: 0,
            len: framed_len(b"a", &[0; 10]) as u32,
        };
        assert_eq!(logs.read_entry(idx_loc).unwrap().key(), Some(&b"a"[..]));
        assert_eq!(cached_pages(&plain), 0);
        std::io::Read::read_to_end(&mut &plain, &mut Vec::new()).unwrap();
        assert!(cached_pages(&plain) > 0);
    }

    /// Pages of `f` in the page cache (mincore over a mapping, which faults nothing in).
    fn cached_pages(f: &File) -> usize {
        // SAFETY: a read-only mapping of a file nobody truncates during the test.
        let m = unsafe { memmap2::Mmap::map(f) }.unwrap();
        let mut v = vec![0u8; m.len().div_ceil(PAGE_BYTES)];
        // SAFETY: the mapping is live and page-aligned; v has one byte per page.
        let r = unsafe { libc::mincore(m.as_ptr() as *mut _, m.len(), v.as_mut_ptr()) };
        assert_eq!(r, 0);
        v.iter().filter(|b| **b & 1 == 1).count()
    }

    #[test]
    fn ssdlog_index_rebuild_equals_index_before_restart() {
        let d = disk_dir();
        let cfg = SsdConfig {
            segment_max_bytes: 64 * 1024,
        };
        let (logs, _) = SsdLogs::open(d.path(), cfg.clone()).unwrap();
        let mut idx: HashMap<Vec<u8>, (LogTs, Loc)> = HashMap::new();
        let mut newest: HashMap<String, SsdEntry> = HashMap::new();
        let mut index = 0;
        for round in 0..30u64 {
            for kind in [LogKind::Hot, LogKind::Cold] {
                let batch: Vec<SsdEntry> = (0..8)
                    .map(|i| {
                        index += 1;
                        let k = format!("key{}", (round * 7 + i * 3) % 40);
                        ent(
                            &k,
                            1 + round / 10,
                            index,
                            100 + (index as usize * 37) % 3000,
                        )
                    })
                    .collect();
                let locs = logs.append(kind, &batch).unwrap();
                for (e, l) in batch.iter().zip(locs) {
                    idx.insert(e.key.clone(), (e.ts, l));
                    newest.insert(String::from_utf8(e.key.clone()).unwrap(), e.clone());
                }
            }
        }
        assert!(logs.segments(LogKind::Hot).len() > 2, "rolls segments");
        for (k, e) in &newest {
            let ie = idx.get(k.as_bytes()).unwrap();
            assert_eq!(logs.read_entry(ie.1).unwrap(), e.to_entry());
        }
        let tb = logs.tier_bytes().ssd;
        drop(logs);
        let (logs, rebuilt) = SsdLogs::open(d.path(), cfg).unwrap();
        assert_eq!(newest_of(&rebuilt), idx);
        assert_eq!(logs.tier_bytes().ssd, tb);
        // Reopened segments are sealed: a new append starts a new segment.
        let before = logs.segments(LogKind::Hot).len();
        logs.append(LogKind::Hot, &[ent("x", 9, 9999, 5)]).unwrap();
        assert_eq!(logs.segments(LogKind::Hot).len(), before + 1);
    }

    #[test]
    fn ssdlog_recovery_stops_at_torn_or_corrupt_entry() {
        let d = disk_dir();
        let (logs, _) = SsdLogs::open(d.path(), SsdConfig::default()).unwrap();
        let mut all = Vec::new();
        for b in 0..4u64 {
            let batch: Vec<SsdEntry> = (0..6)
                .map(|i| ent(&format!("k{b}-{i}"), 1, b * 10 + i, 900))
                .collect();
            all.push((batch.clone(), logs.append(LogKind::Cold, &batch).unwrap()));
        }
        let (seg, end) = logs.segments(LogKind::Cold)[0];
        let path = logs.seg(seg).unwrap().path.clone();
        drop(logs);
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        // Torn: the last batch's second page never reached the disk; the file ends mid-batch.
        let last = &all[3].1;
        let cut = last[4].off / PAGE_BYTES as u64 * PAGE_BYTES as u64;
        assert!(cut < end);
        f.set_len(cut + 100).unwrap();
        let (_, segs) = SsdLogs::open(d.path(), SsdConfig::default()).unwrap();
        let idx = newest_of(&segs);
        assert_eq!(idx.len(), 22, "4 batches of 6, the last two entries lost");
        assert!(idx.get(&b"k3-3"[..]).is_some() && idx.get(&b"k3-4"[..]).is_none());
        // Corrupt: one flipped byte inside the value of batch 1's third entry.
        let victim = all[1].1[2];
        let mut byte = [0u8; 1];
        f.read_exact_at(&mut byte, victim.off + 40).unwrap();
        f.write_all_at(&[byte[0] ^ 1], victim.off + 40).unwrap();
        let (logs, segs) = SsdLogs::open(d.path(), SsdConfig::default()).unwrap();
        let idx = newest_of(&segs);
        assert_eq!(idx.len(), 8, "batch 0 and the first two of batch 1");
        assert!(matches!(
            logs.read_entry(victim),
            Err(SsdError::Corrupt { .. })
        ));
        // A garbage length in the first page: nothing recovered, nothing panics.
        f.write_all_at(&[0xff, 0xff, 0xff, 0xff], 0).unwrap();
        let (_, segs) = SsdLogs::open(d.path(), SsdConfig::default()).unwrap();
        assert!(newest_of(&segs).is_empty());
    }
}
