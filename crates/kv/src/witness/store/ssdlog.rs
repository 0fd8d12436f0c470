//! The backup's SSD logs (paper §3.2–§3.3, Fig 4; spec (c) "SSD tier" and the `ssdlog.rs` row):
//! two sets of segment files, hot and cold, written in page-aligned batches and read with
//! `O_DIRECT`, plus the DRAM index key → (segment, offset, length, ts).
//!
//! **Why O_DIRECT.** On this machine the page cache would hold a multi-GiB log in RAM and serve
//! every PriorityPull and the offline copy from memory, which would make both fiction. Every
//! segment is opened `O_DIRECT` (checked with `fcntl(F_GETFL)` after opening), every transfer is
//! whole 4 KiB pages through a 4 KiB-aligned buffer. A file system that refuses `O_DIRECT`
//! (or that is memory, tmpfs e.g. `/dev/shm`, which accepts `O_DIRECT` since Linux 6.6 but reads
//! from RAM) gets [`SsdError::NoDirectIo`], never a silent buffered fallback.
//!
//! **Format.** A segment is a sequence of 4 KiB pages. Each entry is framed
//! `len: u32 LE | crc32c: u32 LE | payload` (the shape of `kv::pmlog`'s records), with payload
//! `key_len: u16 LE | key | term: u64 LE | index: u64 LE | value`. The checksum also covers the
//! segment id and the entry's offset, so a misdirected read fails it. An entry never straddles
//! a page unless it is larger than a page; such an entry starts on a page boundary. The rest of
//! a page after its last entry is zero (`len` 0 = "next page"). A batch always starts on a fresh
//! page: a durable page is never rewritten, so a crash during a batch cannot damage an earlier,
//! acknowledged one (the cost is the unused tail of a batch's last page, ≤ 4 KiB per batch).
//!
//! **Recovery.** [`SsdLogs::open`] scans every segment in id order and stops each at its first
//! torn or corrupt entry or empty page; every segment found is sealed (appends go to new
//! segments), so nothing is ever appended behind a torn tail. The index is rebuilt from the
//! scan with the same rule as live updates ([`Index::apply`]: the ts never decreases).
//!
//! **GC** ([`gc_segment`]) rewrites an entry iff the index points at exactly its location: the
//! index holds the newest version of every key, so the newest version is always rewritten (and
//! made durable) before its old segment is deleted.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use super::TierBytes;

/// The unit of every SSD transfer and of entry packing.
pub const PAGE_BYTES: usize = 4096;
/// Bytes of an entry's frame (len, crc32c).
pub const FRAME_BYTES: usize = 8;
/// Bytes of an entry's payload besides key and value: key length, term, index.
pub const ENTRY_FIXED_BYTES: usize = 2 + 8 + 8;
/// Largest key (as everywhere in the KV).
pub const MAX_KEY_BYTES: usize = crate::pmlog::record::MAX_KEY_BYTES;
/// Largest value (as everywhere in the KV).
pub const MAX_VALUE_BYTES: usize = crate::pmlog::record::MAX_VALUE_BYTES;
const MAX_PAYLOAD_BYTES: usize = ENTRY_FIXED_BYTES + MAX_KEY_BYTES + MAX_VALUE_BYTES;
/// Default size at which a segment is closed and a new one started.
pub const DEFAULT_SEGMENT_MAX_BYTES: u64 = 64 << 20;

/// The logical timestamp of a committed entry: (term, index) of the Raft variant (§3.1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LogTs {
    pub term: u64,
    pub index: u64,
}

/// Which of the two logs (§3.3: popular keys in the hot log, the rest in the cold one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LogKind {
    Hot,
    Cold,
}

impl LogKind {
    fn name(self) -> &'static str {
        match self {
            LogKind::Hot => "hot",
            LogKind::Cold => "cold",
        }
    }
    fn slot(self) -> usize {
        self as usize
    }
}

/// Where an entry is: its segment, the byte offset of its frame, the frame's length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Loc {
    pub seg: u64,
    pub off: u64,
    pub len: u32,
}

impl Loc {
    /// The page-aligned byte range holding the entry: (offset, length).
    pub fn page_span(&self) -> (u64, usize) {
        let start = self.off / PAGE_BYTES as u64 * PAGE_BYTES as u64;
        let end = (self.off + self.len as u64).div_ceil(PAGE_BYTES as u64) * PAGE_BYTES as u64;
        (start, (end - start) as usize)
    }
}

/// An entry, owned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SsdEntry {
    pub key: Vec<u8>,
    pub ts: LogTs,
    pub value: Vec<u8>,
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
    #[error("entry with a {key} B key and a {value} B value exceeds the limits ({MAX_KEY_BYTES} B key, {MAX_VALUE_BYTES} B value, non-empty key)")]
    EntryTooLarge { key: usize, value: usize },
    #[error("no segment {0}")]
    UnknownSegment(u64),
    #[error("segment {0} is the active segment of its log (seal it first)")]
    ActiveSegment(u64),
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

fn entry_crc(seg: u64, off: u64, payload: &[u8]) -> u32 {
    let c = crc32c::crc32c(&seg.to_le_bytes());
    let c = crc32c::crc32c_append(c, &off.to_le_bytes());
    crc32c::crc32c_append(c, payload)
}

fn round_up_page(n: usize) -> usize {
    n.div_ceil(PAGE_BYTES) * PAGE_BYTES
}

/// The framed size of an entry.
pub fn framed_len(key: &[u8], value: &[u8]) -> usize {
    FRAME_BYTES + ENTRY_FIXED_BYTES + key.len() + value.len()
}

/// Where an entry of `framed` bytes goes when the batch holds `pos` bytes: here, or on the
/// next page if it would straddle one (or is larger than a page).
fn place_at(pos: usize, framed: usize) -> usize {
    let in_page = pos % PAGE_BYTES;
    if in_page != 0 && (framed > PAGE_BYTES || PAGE_BYTES - in_page < framed) {
        round_up_page(pos)
    } else {
        pos
    }
}

/// The bytes (whole pages) `entries` take as one batch.
pub fn packed_len(entries: &[SsdEntry]) -> usize {
    let mut pos = 0;
    for e in entries {
        let framed = framed_len(&e.key, &e.value);
        pos = place_at(pos, framed) + framed;
        if framed > PAGE_BYTES {
            pos = round_up_page(pos);
        }
    }
    round_up_page(pos)
}

/// Packs entries into pages for one batch that will be written at byte `base` of segment
/// `seg` (both known before packing, because the checksum covers them). Sans-I/O.
pub struct BatchBuilder {
    seg: u64,
    base: u64,
    buf: Vec<u8>,
    locs: Vec<Loc>,
}

impl BatchBuilder {
    pub fn new(seg: u64, base: u64) -> Self {
        assert_eq!(base % PAGE_BYTES as u64, 0, "batches start on a page");
        BatchBuilder {
            seg,
            base,
            buf: Vec::new(),
            locs: Vec::new(),
        }
    }

    /// Where an entry of `framed` bytes would start if pushed now (relative to the batch).
    fn place(&self, framed: usize) -> usize {
        place_at(self.buf.len(), framed)
    }

    /// Bytes the batch would take (whole pages) with one more entry of `framed` bytes.
    pub fn len_with(&self, framed: usize) -> usize {
        round_up_page(self.place(framed) + framed)
    }

    /// Bytes the batch takes now (whole pages).
    pub fn len_bytes(&self) -> usize {
        round_up_page(self.buf.len())
    }

    pub fn is_empty(&self) -> bool {
        self.locs.is_empty()
    }

    pub fn push(&mut self, key: &[u8], ts: LogTs, value: &[u8]) -> Result<Loc, SsdError> {
        if key.is_empty() || key.len() > MAX_KEY_BYTES || value.len() > MAX_VALUE_BYTES {
            return Err(SsdError::EntryTooLarge {
                key: key.len(),
                value: value.len(),
            });
        }
        let framed = framed_len(key, value);
        let at = self.place(framed);
        self.buf.resize(at, 0);
        let off = self.base + at as u64;
        let mut payload = Vec::with_capacity(framed - FRAME_BYTES);
        payload.extend_from_slice(&(key.len() as u16).to_le_bytes());
        payload.extend_from_slice(key);
        payload.extend_from_slice(&ts.term.to_le_bytes());
        payload.extend_from_slice(&ts.index.to_le_bytes());
        payload.extend_from_slice(value);
        self.buf
            .extend_from_slice(&(payload.len() as u32).to_le_bytes());
        self.buf
            .extend_from_slice(&entry_crc(self.seg, off, &payload).to_le_bytes());
        self.buf.extend_from_slice(&payload);
        if framed > PAGE_BYTES {
            // A large entry owns its last page too: the next entry starts on a fresh page.
            let end = round_up_page(self.buf.len());
            self.buf.resize(end, 0);
        }
        let loc = Loc {
            seg: self.seg,
            off,
            len: framed as u32,
        };
        self.locs.push(loc);
        Ok(loc)
    }

    /// The batch's pages and each pushed entry's location, in push order.
    pub fn finish(self) -> (AlignedBuf, Vec<Loc>) {
        let mut out = AlignedBuf::zeroed(self.buf.len());
        out[..self.buf.len()].copy_from_slice(&self.buf);
        (out, self.locs)
    }
}

/// Decodes the entries of `bytes`, which start at page-aligned byte `base` of segment `seg`.
/// Stops at the first torn or corrupt entry or at a page that starts empty. Returns the entries
/// with their locations and the byte (relative to `base`, a page multiple) where valid data ends.
/// A large entry cut off by the end of `bytes` also ends the scan (read more to get it).
pub fn decode_pages(seg: u64, base: u64, bytes: &[u8]) -> (Vec<(Loc, SsdEntry)>, usize) {
    let mut out = Vec::new();
    let mut pos = 0usize;
    loop {
        let in_page = pos % PAGE_BYTES;
        if in_page != 0 && PAGE_BYTES - in_page < FRAME_BYTES {
            pos = round_up_page(pos);
        }
        if pos + FRAME_BYTES > bytes.len() {
            break;
        }
        let len = u32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
        if len == 0 {
            if pos.is_multiple_of(PAGE_BYTES) {
                break;
            }
            pos = round_up_page(pos);
            continue;
        }
        let framed = FRAME_BYTES + len;
        if !(ENTRY_FIXED_BYTES + 1..=MAX_PAYLOAD_BYTES).contains(&len) || pos + framed > bytes.len()
        {
            break;
        }
        if framed <= PAGE_BYTES && pos % PAGE_BYTES + framed > PAGE_BYTES {
            break;
        }
        let crc = u32::from_le_bytes(bytes[pos + 4..pos + 8].try_into().unwrap());
        let payload = &bytes[pos + FRAME_BYTES..pos + framed];
        let off = base + pos as u64;
        if entry_crc(seg, off, payload) != crc {
            break;
        }
        let klen = u16::from_le_bytes(payload[0..2].try_into().unwrap()) as usize;
        if klen == 0 || klen > MAX_KEY_BYTES || ENTRY_FIXED_BYTES + klen > payload.len() {
            break;
        }
        let key = payload[2..2 + klen].to_vec();
        let f = &payload[2 + klen..];
        let ts = LogTs {
            term: u64::from_le_bytes(f[0..8].try_into().unwrap()),
            index: u64::from_le_bytes(f[8..16].try_into().unwrap()),
        };
        let value = f[16..].to_vec();
        out.push((
            Loc {
                seg,
                off,
                len: framed as u32,
            },
            SsdEntry { key, ts, value },
        ));
        pos += framed;
        if framed > PAGE_BYTES {
            pos = round_up_page(pos);
        }
    }
    (out, round_up_page(pos).min(round_up_page(bytes.len())))
}

/// One index slot: the newest known version of a key and where it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexEntry {
    pub ts: LogTs,
    pub kind: LogKind,
    pub loc: Loc,
}

/// The backup's DRAM index (§3.1: "updating its DRAM index to reflect the location and
/// timestamp of the latest update of the key"). Sans-I/O.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Index {
    map: HashMap<Vec<u8>, IndexEntry>,
    key_bytes: u64,
}

/// Estimated DRAM per index slot besides the key bytes: the entry, the Vec header, the hash
/// table's control byte and load-factor slack.
const INDEX_SLOT_OVERHEAD_BYTES: u64 =
    (std::mem::size_of::<IndexEntry>() + std::mem::size_of::<Vec<u8>>()) as u64 * 8 / 7 + 1;

impl Index {
    /// Points `key` at `loc` iff `ts` ≥ the indexed ts (§3.2: "only updated if the entry has an
    /// equal or greater logical timestamp"; equal = the same version moved by GC). Returns
    /// whether it did.
    pub fn apply(&mut self, key: &[u8], ts: LogTs, kind: LogKind, loc: Loc) -> bool {
        let e = IndexEntry { ts, kind, loc };
        match self.map.get_mut(key) {
            Some(cur) if cur.ts > ts => false,
            Some(cur) => {
                *cur = e;
                true
            }
            None => {
                self.key_bytes += key.len() as u64;
                self.map.insert(key.to_vec(), e);
                true
            }
        }
    }

    pub fn get(&self, key: &[u8]) -> Option<&IndexEntry> {
        self.map.get(key)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&Vec<u8>, &IndexEntry)> {
        self.map.iter()
    }

    /// Whether the entry at `loc` is the indexed (newest) version of `key`.
    pub fn is_live(&self, key: &[u8], loc: Loc) -> bool {
        self.map.get(key).is_some_and(|e| e.loc == loc)
    }

    pub fn tier_bytes(&self) -> TierBytes {
        TierBytes {
            dram_index: self.key_bytes + self.map.capacity() as u64 * INDEX_SLOT_OVERHEAD_BYTES,
            ..Default::default()
        }
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
    /// Opens (creating) the logs in `dir`, scans every segment and rebuilds the index. Every
    /// existing segment is sealed. Fails with [`SsdError::NoDirectIo`] on tmpfs.
    pub fn open(dir: &Path, cfg: SsdConfig) -> Result<(SsdLogs, Index), SsdError> {
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
        let mut index = Index::default();
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
            let (entries, valid) = decode_pages(id, 0, &bytes);
            for (loc, e) in entries {
                index.apply(&e.key, e.ts, kind, loc);
            }
            me.segs.read().unwrap()[&id]
                .end
                .store(valid as u64, Ordering::Release);
        }
        Ok((me, index))
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
    pub fn read_entry(&self, loc: Loc) -> Result<SsdEntry, SsdError> {
        let (start, n) = loc.page_span();
        let bytes = self.read_raw(loc.seg, start, n)?;
        let at = (loc.off - start) as usize;
        let (mut es, _) = decode_pages(loc.seg, loc.off, &bytes[at..at + loc.len as usize]);
        match es.pop() {
            Some((l, e)) if l == loc => Ok(e),
            _ => Err(SsdError::Corrupt {
                seg: loc.seg,
                off: loc.off,
                why: "no valid entry at this location",
            }),
        }
    }

    /// Every entry in the page(s) holding `loc` (PriorityPull returns "the whole 4 KB page",
    /// §5.3, so neighbours come free).
    pub fn read_page_entries(&self, loc: Loc) -> Result<Vec<(Loc, SsdEntry)>, SsdError> {
        let (start, n) = loc.page_span();
        let bytes = self.read_raw(loc.seg, start, n)?;
        Ok(decode_pages(loc.seg, start, &bytes).0)
    }

    /// Appends `entries` as one batch to `kind`'s active segment (a new one if there is none or
    /// the batch would take it past the size limit), then `fdatasync`s. Returns each entry's
    /// location, in order. On return the batch is durable.
    pub fn append(&self, kind: LogKind, entries: &[SsdEntry]) -> Result<Vec<Loc>, SsdError> {
        let mut w = self.writers[kind.slot()].lock().unwrap();
        let bytes = packed_len(entries);
        let seg = match w.active.map(|id| self.seg(id)).transpose()? {
            Some(s)
                if s.end.load(Ordering::Acquire) == 0
                    || s.end.load(Ordering::Acquire) + bytes as u64
                        <= self.cfg.segment_max_bytes =>
            {
                (w.active.unwrap(), s)
            }
            _ => {
                let id = self.next_seg.fetch_add(1, Ordering::AcqRel);
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
                self.segs.write().unwrap().insert(id, s.clone());
                w.active = Some(id);
                (id, s)
            }
        };
        let (id, s) = seg;
        let base = s.end.load(Ordering::Acquire);
        let mut b = BatchBuilder::new(id, base);
        for e in entries {
            b.push(&e.key, e.ts, &e.value)?;
        }
        let (buf, locs) = b.finish();
        s.file.write_all_at(&buf, base).map_err(io_err(&s.path))?;
        s.file.sync_data().map_err(io_err(&s.path))?;
        s.end.store(base + buf.len() as u64, Ordering::Release);
        Ok(locs)
    }

    /// Closes `kind`'s active segment: the next append starts a new one (so GC may take it).
    pub fn seal(&self, kind: LogKind) {
        self.writers[kind.slot()].lock().unwrap().active = None;
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

    /// Deletes a sealed segment (after GC made its live entries durable elsewhere).
    pub fn delete_segment(&self, id: u64) -> Result<(), SsdError> {
        let s = self.seg(id)?;
        if self.writers[s.kind.slot()].lock().unwrap().active == Some(id) {
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

/// What one GC pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GcStats {
    pub entries: usize,
    pub live: usize,
    pub bytes_freed: u64,
    pub bytes_rewritten: u64,
}

/// Largest batch GC writes at once.
pub const GC_BATCH_MAX_BYTES: usize = 256 * 1024;

/// Collects sealed segment `seg`: re-appends its live entries (those the index points at) to
/// the log `place` chooses for each key, updates the index, then deletes the segment. The
/// newest version of a key is always the indexed one, so it is never dropped; the rewrite is
/// durable before the delete, so a crash in between leaves two copies of the same version
/// (harmless: equal ts) and never none.
pub fn gc_segment(
    logs: &SsdLogs,
    index: &mut Index,
    seg: u64,
    place: impl Fn(&[u8]) -> LogKind,
) -> Result<GcStats, SsdError> {
    let s = logs.seg(seg)?;
    if logs.writers[s.kind.slot()].lock().unwrap().active == Some(seg) {
        return Err(SsdError::ActiveSegment(seg));
    }
    let end = s.end.load(Ordering::Acquire);
    let bytes = logs.read_raw(seg, 0, end as usize)?;
    let (entries, _) = decode_pages(seg, 0, &bytes);
    let mut st = GcStats {
        entries: entries.len(),
        bytes_freed: end,
        ..Default::default()
    };
    let mut pending: [Vec<SsdEntry>; 2] = Default::default();
    let flush = |kind: LogKind, batch: &mut Vec<SsdEntry>, index: &mut Index| {
        if batch.is_empty() {
            return Ok::<_, SsdError>(());
        }
        let locs = logs.append(kind, batch)?;
        for (e, loc) in batch.drain(..).zip(locs) {
            index.apply(&e.key, e.ts, kind, loc);
        }
        Ok(())
    };
    for (loc, e) in entries {
        if !index.is_live(&e.key, loc) {
            continue;
        }
        st.live += 1;
        st.bytes_rewritten += loc.len as u64;
        let kind = place(&e.key);
        let batch = &mut pending[kind.slot()];
        batch.push(e);
        if packed_len(batch) >= GC_BATCH_MAX_BYTES {
            flush(kind, batch, index)?;
        }
    }
    for kind in [LogKind::Hot, LogKind::Cold] {
        flush(kind, &mut pending[kind.slot()], index)?;
    }
    logs.delete_segment(seg)?;
    Ok(st)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A temp dir on the real disk (O_DIRECT needs one; /tmp may be tmpfs elsewhere).
    pub(crate) fn disk_dir() -> tempfile::TempDir {
        tempfile::tempdir_in("/var/tmp").unwrap()
    }

    fn ent(k: &str, term: u64, index: u64, vlen: usize) -> SsdEntry {
        SsdEntry {
            key: k.as_bytes().to_vec(),
            ts: LogTs { term, index },
            value: (0..vlen).map(|i| (i as u64 + index) as u8).collect(),
        }
    }

    #[test]
    fn ssdlog_packing_never_straddles_a_page_unless_larger() {
        let mut b = BatchBuilder::new(7, 8192);
        let mut locs = Vec::new();
        let mut es = Vec::new();
        for (i, vlen) in [1000, 1000, 1000, 1000, 5000, 10, 3000, 3000]
            .iter()
            .enumerate()
        {
            let e = ent(&format!("k{i}"), 1, i as u64, *vlen);
            locs.push(b.push(&e.key, e.ts, &e.value).unwrap());
            es.push(e);
        }
        for l in &locs {
            let first = l.off / PAGE_BYTES as u64;
            let last = (l.off + l.len as u64 - 1) / PAGE_BYTES as u64;
            if l.len as usize <= PAGE_BYTES {
                assert_eq!(first, last, "{l:?}");
            } else {
                assert_eq!(l.off % PAGE_BYTES as u64, 0, "{l:?}");
            }
        }
        // The fourth 1000 B value does not fit in page 0 with the first three.
        assert_eq!(locs[3].off, 8192 + 4096);
        let (buf, got) = b.finish();
        assert_eq!(got, locs);
        assert_eq!(buf.len() % PAGE_BYTES, 0);
        let (dec, valid) = decode_pages(7, 8192, &buf);
        assert_eq!(valid, buf.len());
        assert_eq!(dec.iter().map(|d| d.0).collect::<Vec<_>>(), locs);
        assert_eq!(dec.into_iter().map(|d| d.1).collect::<Vec<_>>(), es);
        // The checksum binds an entry to its place: the same bytes elsewhere do not decode.
        assert!(decode_pages(8, 8192, &buf).0.is_empty());
        assert!(matches!(
            BatchBuilder::new(1, 0).push(b"", LogTs::default(), b"v"),
            Err(SsdError::EntryTooLarge { .. })
        ));
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
        assert_eq!(logs.read_entry(idx_loc).unwrap().key, b"a");
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
        let (logs, mut idx) = SsdLogs::open(d.path(), cfg.clone()).unwrap();
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
                    assert!(idx.apply(&e.key, e.ts, kind, l));
                    newest.insert(String::from_utf8(e.key.clone()).unwrap(), e.clone());
                }
            }
        }
        assert!(logs.segments(LogKind::Hot).len() > 2, "rolls segments");
        for (k, e) in &newest {
            let ie = idx.get(k.as_bytes()).unwrap();
            assert_eq!(&logs.read_entry(ie.loc).unwrap(), e);
        }
        let tb = logs.tier_bytes().ssd;
        drop(logs);
        let (logs, rebuilt) = SsdLogs::open(d.path(), cfg).unwrap();
        assert_eq!(rebuilt, idx);
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
        let (_, idx) = SsdLogs::open(d.path(), SsdConfig::default()).unwrap();
        assert_eq!(idx.len(), 22, "4 batches of 6, the last two entries lost");
        assert!(idx.get(b"k3-3").is_some() && idx.get(b"k3-4").is_none());
        // Corrupt: one flipped byte inside the value of batch 1's third entry.
        let victim = all[1].1[2];
        let mut byte = [0u8; 1];
        f.read_exact_at(&mut byte, victim.off + 40).unwrap();
        f.write_all_at(&[byte[0] ^ 1], victim.off + 40).unwrap();
        let (logs, idx) = SsdLogs::open(d.path(), SsdConfig::default()).unwrap();
        assert_eq!(idx.len(), 8, "batch 0 and the first two of batch 1");
        assert!(matches!(
            logs.read_entry(victim),
            Err(SsdError::Corrupt { .. })
        ));
        // A garbage length in the first page: nothing recovered, nothing panics.
        f.write_all_at(&[0xff, 0xff, 0xff, 0xff], 0).unwrap();
        let (_, idx) = SsdLogs::open(d.path(), SsdConfig::default()).unwrap();
        assert!(idx.is_empty());
    }

    #[test]
    fn ssdlog_gc_keeps_the_newest_version_and_moves_keys_between_logs() {
        let d = disk_dir();
        let (logs, mut idx) = SsdLogs::open(d.path(), SsdConfig::default()).unwrap();
        let put = |idx: &mut Index, kind, es: Vec<SsdEntry>| {
            let locs = logs.append(kind, &es).unwrap();
            for (e, l) in es.iter().zip(locs) {
                idx.apply(&e.key, e.ts, kind, l);
            }
        };
        // Segment 1 (cold): a1, b1, c1. Then newer a in the hot log; an *older* version of c
        // arriving late (its index ts must not go back).
        put(
            &mut idx,
            LogKind::Cold,
            vec![ent("a", 1, 1, 50), ent("b", 1, 2, 50), ent("c", 1, 5, 50)],
        );
        logs.seal(LogKind::Cold);
        put(&mut idx, LogKind::Hot, vec![ent("a", 1, 3, 60)]);
        put(&mut idx, LogKind::Cold, vec![ent("c", 1, 4, 70)]);
        assert_eq!(idx.get(b"c").unwrap().ts.index, 5);
        let seg1 = logs.segments(LogKind::Cold)[0].0;
        assert!(matches!(
            gc_segment(&logs, &mut idx, logs.segments(LogKind::Cold)[1].0, |_| {
                LogKind::Cold
            }),
            Err(SsdError::ActiveSegment(_))
        ));
        // b becomes hot by GC alone.
        let st = gc_segment(&logs, &mut idx, seg1, |k| {
            if k == b"b" {
                LogKind::Hot
            } else {
                LogKind::Cold
            }
        })
        .unwrap();
        assert_eq!((st.entries, st.live), (3, 2));
        assert!(logs.seg(seg1).is_err());
        let check = |logs: &SsdLogs, idx: &Index| {
            for (k, want, kind) in [
                ("a", 3, LogKind::Hot),
                ("b", 2, LogKind::Hot),
                ("c", 5, LogKind::Cold),
            ] {
                let ie = idx.get(k.as_bytes()).unwrap();
                assert_eq!((ie.ts.index, ie.kind), (want, kind), "{k}");
                let e = logs.read_entry(ie.loc).unwrap();
                assert_eq!(e, ent(k, 1, want, e.value.len()));
            }
        };
        check(&logs, &idx);
        drop(logs);
        let (logs, rebuilt) = SsdLogs::open(d.path(), SsdConfig::default()).unwrap();
        assert_eq!(rebuilt.len(), 3);
        check(&logs, &rebuilt);
        let tb = logs.tier_bytes() + rebuilt.tier_bytes();
        assert!(
            tb.ssd >= 3 * PAGE_BYTES as u64 && tb.dram_index > 0 && tb.nvmm == 0,
            "{tb:?}"
        );
    }

    /// Random appends (some carrying versions older than the indexed one, as a late writeback
    /// or a GC rewrite racing a newer write would), seals, GC passes with random placement and
    /// restarts, checked after every step against a model of each key's newest version: the
    /// index holds exactly it, and it reads back whole from the disk.
    #[test]
    fn ssdlog_random_appends_gc_and_restarts_keep_every_newest_version() {
        for seed in 1..=4u64 {
            let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let mut next = move |n: u64| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng % n
            };
            let d = disk_dir();
            let cfg = SsdConfig {
                segment_max_bytes: 48 * 1024,
            };
            let (mut logs, mut idx) = SsdLogs::open(d.path(), cfg.clone()).unwrap();
            let mut model: HashMap<Vec<u8>, SsdEntry> = HashMap::new();
            let mut clock = 0u64;
            let (mut gcs, mut restarts) = (0, 0);
            for step in 0..120 {
                match next(10) {
                    0..=5 => {
                        let kind = if next(2) == 0 {
                            LogKind::Hot
                        } else {
                            LogKind::Cold
                        };
                        let batch: Vec<SsdEntry> = (0..1 + next(6))
                            .map(|_| {
                                clock += 1;
                                // One in five is an old version arriving late. A version is a
                                // function of (key, ts), as in the store: equal ts, equal entry.
                                let index = if next(5) == 0 { clock / 2 } else { clock };
                                ent(
                                    &format!("k{}", next(12)),
                                    1,
                                    index,
                                    (index as usize * 37) % 2500,
                                )
                            })
                            .collect();
                        let locs = logs.append(kind, &batch).unwrap();
                        for (e, l) in batch.into_iter().zip(locs) {
                            idx.apply(&e.key, e.ts, kind, l);
                            let m = model.entry(e.key.clone()).or_insert(e.clone());
                            if e.ts >= m.ts {
                                *m = e;
                            }
                        }
                    }
                    6 => logs.seal(if next(2) == 0 {
                        LogKind::Hot
                    } else {
                        LogKind::Cold
                    }),
                    7 | 8 => {
                        let kind = if next(2) == 0 {
                            LogKind::Hot
                        } else {
                            LogKind::Cold
                        };
                        let segs = logs.segments(kind);
                        if segs.len() > 1 {
                            // Never the newest (it may be active): any older one is sealed.
                            let (seg, _) = segs[next(segs.len() as u64 - 1) as usize];
                            let flip = next(2) == 0;
                            gc_segment(&logs, &mut idx, seg, |k| {
                                if (k.len() % 2 == 0) ^ flip {
                                    LogKind::Hot
                                } else {
                                    LogKind::Cold
                                }
                            })
                            .unwrap();
                            gcs += 1;
                        }
                    }
                    _ => {
                        drop(logs);
                        let (l, rebuilt) = SsdLogs::open(d.path(), cfg.clone()).unwrap();
                        assert_eq!(rebuilt.len(), idx.len(), "seed {seed} step {step}");
                        logs = l;
                        idx = rebuilt;
                        restarts += 1;
                    }
                }
                assert_eq!(idx.len(), model.len(), "seed {seed} step {step}");
                for (k, want) in &model {
                    let ie = idx.get(k).unwrap();
                    assert_eq!(ie.ts, want.ts, "seed {seed} step {step}");
                    assert_eq!(
                        &logs.read_entry(ie.loc).unwrap(),
                        want,
                        "seed {seed} step {step}"
                    );
                }
            }
            assert!(
                gcs >= 5 && restarts >= 3,
                "seed {seed}: {gcs} GC passes, {restarts} restarts"
            );
        }
    }
}
