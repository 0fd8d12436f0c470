//! The shard's local object store: objects live in pre-allocated slot files; every mutation is
//! durable when [`FileStore::run`] returns.
//!
//! # Why slot files
//!
//! A copy-on-write write to a collocated child (SpecREDS §4.2.1) must copy the parent object
//! locally; that is inherent and cheap (page cache). What made it cost twice a plain write was
//! the file system: one file per object meant a new file, a rename and a directory fsync for
//! every first write to a child object, and block allocation for every first write — each an
//! ext4 journal commit on the critical path. Here every object sits in a slot file that was
//! created, filled with zeroes, `fdatasync`ed and entered in a synced directory *ahead of need*
//! by a background refill. Writing an object, new or old, then changes no file-system metadata
//! (no size change, no allocation, no directory entry), and its one `fdatasync` only writes the
//! data pages and flushes the device.
//!
//! ("Slot" in this file means a slot file. It is not the placement slot, [`Slot`], of the core.)
//!
//! # Deferred copies
//!
//! Even a local copy writes 64 KiB where a plain overwrite writes 4 KiB, and on a virtual disk
//! a 64 KiB `fdatasync`ed write costs about twice a 4 KiB one (measured here with fio: ≈ 7,300
//! against ≈ 13,300 writes per second). So a child's first write to an object of the 64 KiB
//! class writes only the 4 KiB sectors it touches into the child's slot, and records in the
//! slot header which sectors are there and which parent slot holds the rest ([`Base`]). The
//! copy is completed (the missing sectors written, the base dropped) only when the parent's
//! bytes are about to change or go: a parent write (the child is then doomed anyway: the dirty
//! bit is set), garbage collection deleting or renaming the parent, or the child growing out of
//! the class. A rejected child is deleted without ever being copied.
//!
//! # Layout
//!
//! ```text
//! <root>/state                  the shard's tracking list (small, replaced atomically)
//! <root>/slots/<class>/<n>      slot file n of a size class: 4KiB, 64KiB, 1MiB, 4MiB
//! ```
//!
//! A slot file is a 4 KiB header page followed by the class's data bytes. The header page holds
//! two copies of the slot header, in sectors 0 and 1; the rest is unused so the object's bytes
//! start page aligned (a 4 KiB write dirties one data page, not two half pages). On ext4 the
//! 4 KiB page costs nothing over the 512-byte header of [`crate::store::objfmt`]: a file's size is
//! rounded up to whole 4 KiB blocks anyway. One header copy (512 bytes, one sector) is:
//!
//! * bytes `0..280`: the [`objfmt::Header`] of the object: its version and the CRC32C of every
//!   64 KiB block of its bytes (so [`objfmt::apply`], [`objfmt::verify`] and
//!   [`objfmt::read_body`] work on slots unchanged);
//! * bytes `384..508`: the slot trailer: magic, free or live, the generation, the object's key
//!   (table, objno, owner), its length in bytes and the slot's class;
//! * bytes `508..512`: CRC32C of bytes `0..508`.
//!
//! An object's length lives in the header, never in the file size: bytes past it are stale
//! leftovers of an earlier object and read as zeroes; growing an object first zeroes the gap.
//!
//! # Crash safety
//!
//! * **One durable step per command.** A write puts the data, then the new header, then makes
//!   them durable once: with the [`crate::store::journal`] on (off by default), by one record holding
//!   those bytes and a journal `fdatasync` shared with every command waiting (group commit),
//!   written *ahead*: the bytes reach the slot file only after the record is durable (the
//!   slot file itself is synced by a later checkpoint, and replayed from the record after a
//!   crash before it), so a power loss leaves each command either whole after replay or not
//!   begun; with it off, by the slot file's own `fdatasync`. Without the journal, after a power
//!   loss during a command that was never acknowledged, any mix of old and new bytes and header
//!   fails the block checksums, and [`FileStore::boot`] reports the object
//!   [`objfmt::SUSPECT`] so it is re-replicated — the property the one-file-per-object store
//!   had.
//! * **The key is never lost with a torn header.** Each header write goes to the copy that does
//!   *not* hold the current header, with a generation higher than any before it (one counter for
//!   the store, restored at open as the highest generation found plus one). At open the valid
//!   copy (its CRC matches) with the higher generation wins, so a torn header write falls back to
//!   the previous header: the object is still found under its key (and is suspect if its bytes
//!   changed), instead of vanishing — which for a `super` child would silently expose the
//!   parent's bytes.
//! * **Completing a deferred copy syncs its bytes before its header.** The copy holds
//!   acknowledged writes: a crash while it is completed leaves the old header (with its base)
//!   over bytes that read the same, or the whole copy — never a new header over torn bytes.
//! * **Free and rename are header writes.** Delete writes a free header; rename (garbage
//!   collection hands a parent object to its child) writes a header with the new owner.
//! * **Moves keep one copy.** An object that outgrows its class is built in memory, written to a
//!   slot of a bigger class and made durable *before* its old slot gets a free header. If a crash
//!   comes in between, two slots claim the key and open keeps the higher generation (the new
//!   one), freeing the other. The same rule covers a rename onto an existing key.
//! * **Slot creation** writes the whole file (a free header and zeroes), `fdatasync`s it and
//!   fsyncs the class directory before the slot is used. A file left short by a crash during
//!   creation, or with holes, holds no object and is deleted at open.
//!
//! # File systems
//!
//! The store runs on a real file system ([`files::RealFs`]: shards) or on the simulator's disk
//! ([`files::SimFs`]: the seeded simulation and the model tests, whose crashes cut the power
//! inside the store's commands and lose or tear what was not synced), through the small
//! [`files::StoreFs`] trait. What a simulated disk cannot model is listed there.
//!
//! # Pool
//!
//! A free list per class (an in-memory index maps keys to slots; [`FileStore::open`] rebuilds
//! both from the slot headers). A background thread keeps a target of free slots ready in every
//! class in use, never taking the file system's available space below
//! [`PoolOptions::reserve_bytes`], and deletes free slots beyond [`PoolOptions::free_slots_max`].
//! The target adapts to bursts: it starts at [`PoolOptions::free_slots_target`], doubles (up to
//! the maximum) whenever a write finds the class empty, and decays back after quiet seconds. A
//! `super` followed by a write-heavy recovery is such a burst: every first write to a child
//! object takes a slot.
//! `super` pre-stocks: every shard that learns of a new child (the tracking list entry) sends
//! the store a [`DiskCmd::Prestock`] hint, and the store reserves as many slots per class as the
//! parent has objects on this shard (at most [`PoolOptions::reserved_slots_max`]) in a free
//! list of their own that only the child's first writes take from, so each of them finds a
//! ready slot — no allocation on the COW path (SpecREDS §4.2.1, §5) — even while other volumes
//! (a general clone's copy-ups) allocate in bursts. The reservation is stocked at once from the
//! free slots the pool holds (moved in memory), then from slots freed later and by the refill.
//! The hint costs one pass over the in-memory index on a disk thread; `super` does not wait
//! for it.
//! A write that finds its class empty creates a slot itself (slow, correct); on a full disk it
//! takes a free slot of a bigger class, or fails with [`DiskErr::NoSpace`] having changed
//! nothing. Overwrites never need space: their blocks exist.

pub mod files;
pub mod journal;
pub mod objfmt;

mod cow;
mod header;
mod index;
mod objects;
mod pool;
mod recovery;
mod wal;
mod write;

use std::collections::{HashMap, VecDeque};
use std::io::{self, ErrorKind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

pub use files::{RealFs, SimFs, SlotFile, StoreFs};
use journal::{Journal, JournalFile, JournalStats};
use objfmt::{ObjFile, CRC_BLOCK_BYTES, HEADER_BYTES, MAX_CRC_BLOCKS};
use crate::core::shard::{Boot, DiskCmd, DiskErr, DiskOut};
use crate::types::*;
use header::*;
use index::*;
use objects::*;
use wal::*;

/// Number of slot size classes.
pub const CLASSES: usize = 4;
/// Object bytes a slot of each class holds, smallest first. The largest is the largest object.
pub const CLASS_DATA_BYTES: [u64; CLASSES] = [4 << 10, 64 << 10, 1 << 20, 4 << 20];
const CLASS_DIR_NAMES: [&str; CLASSES] = ["4KiB", "64KiB", "1MiB", "4MiB"];
/// Bytes before a slot's data: the two header copies, padded to a page.
pub const SLOT_HEADER_PAGE_BYTES: u64 = 4096;
const HEADER_COPY_BYTES: usize = HEADER_BYTES as usize;
/// Where the slot trailer starts in a header copy (the objfmt header ends at byte 280).
const TRAILER_AT: usize = 384;
const HEADER_CRC_AT: usize = HEADER_COPY_BYTES - 4;
const SLOT_MAGIC: u32 = 0x5553_4c31; // "USL1"
const STATE_FREE: u32 = 1;
const STATE_LIVE: u32 = 2;
/// Bytes of slots the refill creates between two checks of the disk space and of shutdown (at
/// least one slot). The files of a batch share one journal commit.
const REFILL_BATCH_BYTES: u64 = 4 << 20;
/// And at most this many slots: a batch keeps its files open until they are synced.
const REFILL_BATCH_MAX_SLOTS: usize = 64;
/// The refill looks at the pool at least this often, even when nobody woke it; a class whose
/// writes all found a free slot for this long has its target lowered by a quarter.
const REFILL_PERIOD_MS: u64 = 1000;
/// While the shard is serving writes, the refill holds back (so its batches of zeroes and their
/// fdatasyncs do not queue in front of the writes' own) as long as a class keeps at least this
/// share of its target ready: one slot in `REFILL_FLOOR_DIVISOR` of the target, at least one.
const REFILL_FLOOR_DIVISOR: usize = 4;
/// A write this recent counts as the shard serving writes; a held-back refill looks again after
/// this long.
const REFILL_YIELD_MS: u64 = 50;
/// A reservation of pre-stocked slots ([`Index::reserved`]) that no child first write used
/// for this long is dropped (the child was rejected, or promoted and collected).
const RESERVE_IDLE_MS: u64 = 60_000;
/// Zeroes are written in pieces of at most this many bytes when a slot is created.
const ZERO_CHUNK_BYTES: usize = 1 << 20;

const _: () = assert!(CLASS_DATA_BYTES[CLASSES - 1] == MAX_CRC_BLOCKS as u64 * CRC_BLOCK_BYTES);
const _: () = assert!(CLASS_DATA_BYTES[CLASSES - 1] == MAX_OBJECT_SIZE_BYTES as u64);
const _: () = assert!(2 * HEADER_COPY_BYTES as u64 <= SLOT_HEADER_PAGE_BYTES);
const _: () = assert!(24 + 4 * MAX_CRC_BLOCKS <= TRAILER_AT);
const _: () = assert!(TRAILER_AT + BASE_AT + 52 <= HEADER_CRC_AT);

/// A child's first write copies only the 4 KiB sectors it touches (see [`Base`]).
pub(crate) const LAZY_SECTOR_BYTES: u64 = 4096;
/// Copies are deferred for objects of the 64 KiB class (the default object size: 16 sectors);
/// bigger objects are copied whole on the first write, as before.
pub(crate) const LAZY_CLASS: usize = 1;
const _: () = assert!(CLASS_DATA_BYTES[LAZY_CLASS] / LAZY_SECTOR_BYTES <= 32);
/// Where the deferred-copy fields start in the slot trailer, and their magic.
const BASE_AT: usize = 56;
const BASE_MAGIC: u32 = 0x4c41_5a31; // "LAZ1"

fn slot_file_bytes(class: usize) -> u64 {
    SLOT_HEADER_PAGE_BYTES + CLASS_DATA_BYTES[class]
}

/// The smallest class that holds `len_bytes`.
fn class_for(len_bytes: u64) -> Option<usize> {
    CLASS_DATA_BYTES.iter().position(|&c| c >= len_bytes)
}

/// How the pool of free slots is kept.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    /// Free slots the background refill keeps ready in every class in use, at least (the
    /// target grows under bursts, see the module documentation).
    pub free_slots_target: [usize; CLASSES],
    /// Free slots of a class beyond this are deleted (their space goes back to the file system);
    /// also the most the target grows to.
    pub free_slots_max: [usize; CLASSES],
    /// The refill never takes the file system's available space below this. (A write that needs
    /// a slot still creates one while there is any space.)
    pub reserve_bytes: u64,
    /// The most slots of each class kept set aside for `super` children's first writes (see
    /// [`Index::reserved_free`]): a child's reservation is as many slots as its parent has
    /// objects of the class on this shard, at most this.
    pub reserved_slots_max: [usize; CLASSES],
    /// Run the background refill thread (tests turn it off to count slots exactly).
    pub background_refill: bool,
    /// Ring bytes of the write-ahead journal ([`crate::store::journal`]): a mutating command's record
    /// is made durable by a shared `fdatasync` of the journal (group commit), then its bytes go
    /// to the slot file (page cache) and it is acknowledged; a background checkpoint syncs the
    /// slot files they dirtied.
    /// `None`: every command `fdatasync`s its own slot file. A journal left by an earlier run is
    /// replayed at open either way.
    pub journal_capacity_bytes: Option<u64>,
}

/// The journal's size when it is on: a checkpoint starts once a quarter of it is in use, and the
/// file is written with zeroes at creation.
///
/// The journal is off by default (`understudy shard --journal on` turns it on). On this
/// project's machines (2 cores, one virtual disk) it did not pay: the disk overlaps parallel
/// `fdatasync`s of distinct files well (32 writers: ~5× one sync's latency, not 32×), so
/// serialising them into one journal sync grouped only ~3 records per sync at depth 32, while
/// every byte is written twice (journal, then slot). Store benchmark, same process, ABBA
/// batches, load ≈ 6–11: 4 KiB overwrite depth 1 ≈ equal (119 vs 140 µs p50), depth 32 mean
/// 1125 vs 862 µs, 64 KiB put depth 32 3036 vs 1225 µs (journal vs none). `bench volume cow
/// --quick` ABBA rounds (on, off, off, on; load 5–24) put plain depth-1 latency at 1072 / 1628
/// µs with it and 737 / 1121 µs without, depth-32 at 9709 / 7079 against 6363 / 7198 µs. A
/// cluster write's time there goes mostly to CPU scheduling (2 cores for 4 shards, client and
/// NBD server), not to device flushes. A second ABBA round after disk commands went straight
/// to blocking threads (load 4–23) came out the other way: plain depth-1 718 / 982 µs with the
/// journal against 1248 / 2223 without, depth-32 7031 / 8235 against 9161 / 11498, fio depth-32
/// 3738 / 3267 against 3359 / 2985 IOPS. Mixed results on a loaded machine: the default stays
/// off until an idle-machine ABBA decides. With the journal write-ahead and (off) a shared
/// device flush since reverted, ABAB at load 25–30 (2026-11-26 19:26–19:30): the journal won fio depth-32
/// IOPS over NBD (1932 / 3168 against 1122 / 2118) and parent IOPS (2760 against 1500) but its
/// depth-32 COW latency means were 78 / 131 ms against 8.5 / 14 ms (stalls): still off.
pub const DEFAULT_JOURNAL_BYTES: u64 = 32 << 20;
/// The journal's file, in the shard's data directory.
const JOURNAL_FILE: &str = "journal";

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            // ≈ 0.5 MiB, 4.3 MiB, 16 MiB and 16 MiB of ready slots per class in use.
            free_slots_target: [64, 64, 16, 4],
            free_slots_max: [1024, 1024, 64, 16],
            reserve_bytes: 64 << 20,
            // ≈ 128 MiB, 272 MiB, 256 MiB and 256 MiB of slots at most set aside for children.
            reserved_slots_max: [16384, 4096, 256, 64],
            background_refill: true,
            // Off by default: see `DEFAULT_JOURNAL_BYTES`'s note on the measurements.
            journal_capacity_bytes: None,
        }
    }
}

/// A count of the pool, for benchmarks and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Free slots any write may take.
    pub free_slots: [usize; CLASSES],
    /// The refill's current targets for those.
    pub free_slots_target: [usize; CLASSES],
    /// Free slots set aside for `super` children's first writes, and how many the children are
    /// still owed (the refill makes the difference).
    pub reserved_free_slots: [usize; CLASSES],
    pub reserved_slots: [usize; CLASSES],
    pub live_objects: usize,
    /// Writes that found their class empty and created a slot on the critical path.
    pub slow_allocations: u64,
    /// `super` pre-stocking hints handled.
    pub prestocks: u64,
    /// What the store did since open (monotonic counters).
    pub counters: StoreCounters,
}

/// Counters of the store's work since open, so a benchmark can see where a write's time goes
/// (every field monotonic; `_us` fields are summed microseconds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreCounters {
    /// `Apply` commands run.
    pub applies: u64,
    /// First writes of a `super` child to an object (a copy-on-write from its parent).
    pub cow_first_writes: u64,
    /// Slots writes took from the free pool (fast) — `PoolStats::slow_allocations` counts those
    /// created on the write path.
    pub slots_from_pool: u64,
    /// Of those, slots a child's first write took from the slots set aside for it.
    pub slots_from_reserve: u64,
    /// `fdatasync`s of mutating commands (a write, delete, rename, free; not the refill's).
    pub write_fdatasyncs: u64,
    /// Directory fsyncs on a command's path (slot files created inline).
    pub write_dir_fsyncs: u64,
    /// First child writes: time reading the parent object, and time writing the child's
    /// sectors and header and syncing them.
    pub cow_load_us: u64,
    pub cow_commit_us: u64,
    /// In-place overwrites: how many, and their time applying and syncing.
    pub in_place_writes: u64,
    pub in_place_us: u64,
    /// Slots the background refill created, in how many batches, how many of those batches
    /// started while the shard was serving writes, and the refill's time creating them.
    pub refill_slots: u64,
    pub refill_batches: u64,
    pub refill_batches_while_serving: u64,
    pub refill_us: u64,
    /// First child writes that made a deferred copy, and deferred copies completed (so a test
    /// can see the partial-copy paths ran).
    pub deferred_copies_made: u64,
    pub deferred_copies_completed: u64,
    /// Open's crash recovery: slots that held an older claim of a key another slot claims too
    /// (a crash during a move or a rename onto an existing key), freed; slot files a crash
    /// left half made, removed.
    pub open_older_claims_freed: u64,
    pub open_partial_slots_removed: u64,
}

/// The atomic form of [`StoreCounters`].
#[derive(Default)]
struct Counters {
    applies: AtomicU64,
    cow_first_writes: AtomicU64,
    slots_from_pool: AtomicU64,
    slots_from_reserve: AtomicU64,
    write_fdatasyncs: AtomicU64,
    write_dir_fsyncs: AtomicU64,
    cow_load_us: AtomicU64,
    cow_commit_us: AtomicU64,
    in_place_writes: AtomicU64,
    in_place_us: AtomicU64,
    refill_slots: AtomicU64,
    refill_batches: AtomicU64,
    refill_batches_while_serving: AtomicU64,
    refill_us: AtomicU64,
    deferred_copies_made: AtomicU64,
    deferred_copies_completed: AtomicU64,
    open_older_claims_freed: AtomicU64,
    open_partial_slots_removed: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> StoreCounters {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StoreCounters {
            applies: g(&self.applies),
            cow_first_writes: g(&self.cow_first_writes),
            slots_from_pool: g(&self.slots_from_pool),
            slots_from_reserve: g(&self.slots_from_reserve),
            write_fdatasyncs: g(&self.write_fdatasyncs),
            write_dir_fsyncs: g(&self.write_dir_fsyncs),
            cow_load_us: g(&self.cow_load_us),
            cow_commit_us: g(&self.cow_commit_us),
            in_place_writes: g(&self.in_place_writes),
            in_place_us: g(&self.in_place_us),
            refill_slots: g(&self.refill_slots),
            refill_batches: g(&self.refill_batches),
            refill_batches_while_serving: g(&self.refill_batches_while_serving),
            refill_us: g(&self.refill_us),
            deferred_copies_made: g(&self.deferred_copies_made),
            deferred_copies_completed: g(&self.deferred_copies_completed),
            open_older_claims_freed: g(&self.open_older_claims_freed),
            open_partial_slots_removed: g(&self.open_partial_slots_removed),
        }
    }
}

fn add_us(a: &AtomicU64, since: std::time::Instant) {
    a.fetch_add(since.elapsed().as_micros() as u64, Ordering::Relaxed);
}

fn inc(a: &AtomicU64) {
    a.fetch_add(1, Ordering::Relaxed);
}

/// Reads into `buf` from `offset`; returns how many bytes the file has there.
fn read_full_at<F: JournalFile>(f: &F, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

fn write_zeroes_at<F: JournalFile>(f: &F, mut offset: u64, mut len: u64) -> io::Result<()> {
    let zeroes = vec![0u8; (len as usize).min(ZERO_CHUNK_BYTES)];
    while len > 0 {
        let n = len.min(zeroes.len() as u64);
        f.write_all_at(&zeroes[..n as usize], offset)?;
        offset += n;
        len -= n;
    }
    Ok(())
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(ErrorKind::InvalidInput, msg)
}

struct Inner<D: StoreFs> {
    /// The file system the store's files are on.
    fs: D,
    root: PathBuf,
    pool: PoolOptions,
    index: Mutex<Index>,
    /// The next header generation (store wide).
    next_generation: AtomicU64,
    /// Highest state sequence written, so an older snapshot never replaces a newer one.
    state_seq: Mutex<u64>,
    slow_allocations: AtomicU64,
    /// When a dry pool was last logged, in µs since `opened` (0: never).
    dry_logged_us: AtomicU64,
    /// `Prestock` hints handled.
    prestocks: AtomicU64,
    counters: Counters,
    refill_wanted: Mutex<bool>,
    refill_cv: Condvar,
    shutdown: AtomicBool,
    /// When the last mutating command started, in µs since `opened` (0: none yet).
    last_write_us: AtomicU64,
    opened: std::time::Instant,
    /// The write-ahead journal, if on.
    journal: Option<Journal<D::File>>,
}

/// The store, on the real file system unless a test gives it another ([`StoreFs`]).
pub struct FileStore<D: StoreFs = RealFs> {
    inner: Arc<Inner<D>>,
    refill_thread: Option<JoinHandle<()>>,
    checkpoint_thread: Option<JoinHandle<()>>,
}

fn disk_err(e: io::Error) -> DiskErr {
    if is_no_space(&e) {
        DiskErr::NoSpace
    } else {
        DiskErr::Io(e.to_string())
    }
}

fn is_no_space(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::ENOSPC) || e.kind() == ErrorKind::StorageFull
}

fn not_found(key: &ObjKey) -> io::Error {
    io::Error::new(ErrorKind::NotFound, format!("object {key:?} not found"))
}

fn slot_path_in(root: &Path, class: usize, no: u64) -> PathBuf {
    root.join("slots").join(CLASS_DIR_NAMES[class]).join(no.to_string())
}

impl FileStore<RealFs> {
    /// Opens (creating if asked) a shard data directory, with the default pool.
    pub fn open(root: &Path, create: bool) -> Result<Self, String> {
        Self::open_with(root, create, PoolOptions::default())
    }

    /// Opens a shard data directory: reads every slot header to rebuild the index and free
    /// lists (checksums of the objects' bytes are checked by [`FileStore::boot`]), imports
    /// objects of the older one-file-per-object layout, and starts the refill.
    pub fn open_with(root: &Path, create: bool, pool: PoolOptions) -> Result<Self, String> {
        Self::open_on(RealFs, root, create, pool)
    }
}

impl FileStore<SimFs> {
    /// The store on the simulator's disk, as the simulations and model tests run it: at
    /// `shard/` on `fs` (created if new), without the background refill thread (a write that
    /// finds its class empty makes its slot itself) and without the journal (as shards run by
    /// default). A simulation is one thread whose clock is simulated: a thread of the store's
    /// own, paced by the wall clock, would make a seed's run depend on timing.
    pub fn simulated(fs: SimFs) -> Result<Self, String> {
        let pool = PoolOptions { background_refill: false, journal_capacity_bytes: None, ..PoolOptions::default() };
        Self::open_on(fs, Path::new("shard"), true, pool)
    }

    /// The disk under the store (clones share it).
    pub fn fs(&self) -> &SimFs {
        &self.inner.fs
    }
}

impl<D: StoreFs> FileStore<D> {
    /// [`FileStore::open_with`] on the file system `fs` (the simulation's disk in tests).
    pub fn open_on(fs: D, root: &Path, create: bool, pool: PoolOptions) -> Result<Self, String> {
        if !fs.exists(root) {
            if !create {
                return Err(format!(
                    "data directory {} does not exist (pass --create to make a new shard)",
                    root.display()
                ));
            }
            fs.create_dir_all(root).map_err(|e| format!("cannot create {}: {e}", root.display()))?;
        }
        let mut inner = Inner {
            fs,
            root: root.to_path_buf(),
            pool,
            index: Mutex::new(Index::default()),
            next_generation: AtomicU64::new(1),
            state_seq: Mutex::new(0),
            slow_allocations: AtomicU64::new(0),
            dry_logged_us: AtomicU64::new(0),
            prestocks: AtomicU64::new(0),
            counters: Counters::default(),
            refill_wanted: Mutex::new(false),
            refill_cv: Condvar::new(),
            shutdown: AtomicBool::new(false),
            last_write_us: AtomicU64::new(0),
            opened: std::time::Instant::now(),
            journal: None,
        };
        inner.make_dirs().map_err(|e| format!("{} is not a usable shard data directory: {e}", root.display()))?;
        // Before the slot headers are read: the journal's records bring the slots up to date.
        inner.journal = open_journal(&inner.fs, root, inner.pool.journal_capacity_bytes)
            .map_err(|e| format!("cannot open the journal of {}: {e}", root.display()))?;
        inner.scan().map_err(|e| format!("cannot read the slots of {}: {e}", root.display()))?;
        inner
            .import_one_file_per_object_layout()
            .map_err(|e| format!("cannot import the old objects of {}: {e}", root.display()))?;
        let inner = Arc::new(inner);
        let refill_thread = if inner.pool.background_refill {
            let i = inner.clone();
            let t = std::thread::Builder::new()
                .name("store-refill".into())
                .spawn(move || i.refill_loop())
                .map_err(|e| format!("cannot start the slot refill thread: {e}"))?;
            Some(t)
        } else {
            None
        };
        let checkpoint_thread = if inner.journal.is_some() {
            let i = inner.clone();
            let t = std::thread::Builder::new()
                .name("store-checkpoint".into())
                .spawn(move || i.checkpoint_loop())
                .map_err(|e| format!("cannot start the journal checkpoint thread: {e}"))?;
            Some(t)
        } else {
            None
        };
        Ok(FileStore { inner, refill_thread, checkpoint_thread })
    }

    /// The journal's counters, if it is on.
    pub fn has_journal(&self) -> bool {
        self.inner.journal.is_some()
    }

    pub fn journal_stats(&self) -> Option<JournalStats> {
        self.inner.journal.as_ref().map(|j| j.stats())
    }

    /// Makes every slot the journal's records dirtied durable and empties the journal (as the
    /// background checkpoint does once a quarter of it is used). Nothing to do without one.
    pub fn checkpoint(&self) -> io::Result<()> {
        self.inner.checkpoint()
    }

    /// Every object with its version (checked against its checksums: [`objfmt::SUSPECT`] if
    /// they do not match), the tracking objects' contents, the state.
    pub fn boot(&self) -> io::Result<Boot> {
        self.inner.boot()
    }

    /// Runs one disk command (blocking).
    pub fn run(&self, cmd: DiskCmd) -> Result<DiskOut, DiskErr> {
        self.inner.run(cmd)
    }

    pub fn pool_stats(&self) -> PoolStats {
        let idx = self.inner.index.lock().unwrap();
        PoolStats {
            free_slots: std::array::from_fn(|c| idx.free[c].len()),
            free_slots_target: std::array::from_fn(|c| idx.goal(c, &self.inner.pool.free_slots_max)),
            reserved_free_slots: std::array::from_fn(|c| idx.reserved_free[c].len()),
            reserved_slots: idx.reserved,
            live_objects: idx.objects.len(),
            slow_allocations: self.inner.slow_allocations.load(Ordering::Relaxed),
            prestocks: self.inner.prestocks.load(Ordering::Relaxed),
            counters: self.inner.counters.snapshot(),
        }
    }
}

impl<D: StoreFs> Drop for FileStore<D> {
    fn drop(&mut self) {
        self.inner.shutdown.store(true, Ordering::SeqCst);
        self.inner.wake_refill();
        if let Some(t) = self.refill_thread.take() {
            let _ = t.join();
        }
        if let Some(j) = &self.inner.journal {
            j.wake();
        }
        if let Some(t) = self.checkpoint_thread.take() {
            let _ = t.join();
        }
    }
}

impl<D: StoreFs> Inner<D> {
    fn slots_dir(&self) -> PathBuf {
        self.root.join("slots")
    }

    fn class_dir(&self, class: usize) -> PathBuf {
        self.slots_dir().join(CLASS_DIR_NAMES[class])
    }

    fn slot_path(&self, class: usize, no: u64) -> PathBuf {
        slot_path_in(&self.root, class, no)
    }

    fn open_slot(&self, slot: &SlotRef) -> io::Result<D::File> {
        self.fs.open(&self.slot_path(slot.class, slot.no))
    }

    fn entry(&self, key: &ObjKey) -> Option<Entry> {
        self.index.lock().unwrap().objects.get(key).copied()
    }

    fn run(&self, cmd: DiskCmd) -> Result<DiskOut, DiskErr> {
        if matches!(cmd, DiskCmd::Apply { .. } | DiskCmd::Delete { .. } | DiskCmd::Rename { .. }) {
            self.last_write_us.store((self.opened.elapsed().as_micros() as u64).max(1), Ordering::Relaxed);
        }
        match cmd {
            DiskCmd::Read { key, offset, len } => {
                let mut buf = vec![0u8; len as usize];
                if let Some(e) = self.entry(&key) {
                    // Bytes past the object's length read as zeroes.
                    let n = (len as u64).min(e.len_bytes.saturating_sub(offset as u64)) as usize;
                    let f = self.open_slot(&e.slot).map_err(disk_err)?;
                    self.read_body_at(&f, &e, &mut buf[..n], offset as u64).map_err(disk_err)?;
                }
                Ok(DiskOut::Data(buf))
            }
            DiskCmd::ReadAll { key } => {
                let e = self.entry(&key).ok_or_else(|| disk_err(not_found(&key)))?;
                let f = self.open_slot(&e.slot).map_err(disk_err)?;
                let mut buf = vec![0u8; e.len_bytes as usize];
                self.read_body_at(&f, &e, &mut buf, 0).map_err(disk_err)?;
                Ok(DiskOut::Data(buf))
            }
            DiskCmd::Apply { key, version, op, cow_from } => {
                inc(&self.counters.applies);
                self.apply(key, version, op, cow_from).map_err(disk_err)?;
                Ok(DiskOut::Done)
            }
            DiskCmd::Delete { key } => {
                self.delete(key).map_err(disk_err)?;
                Ok(DiskOut::Done)
            }
            DiskCmd::Rename { from, to } => {
                self.rename(from, to).map_err(disk_err)?;
                Ok(DiskOut::Done)
            }
            DiskCmd::Prestock { table, parent } => {
                self.prestock(table, parent);
                Ok(DiskOut::Done)
            }
            DiskCmd::SaveState { seq, bytes } => {
                let mut last = self.state_seq.lock().unwrap();
                if seq > *last {
                    let tmp = self.root.join("state.tmp");
                    let f = self.fs.create_truncate(&tmp).map_err(disk_err)?;
                    f.write_all_at(&bytes, 0).map_err(disk_err)?;
                    f.sync().map_err(disk_err)?;
                    self.fs.rename(&tmp, &self.root.join("state")).map_err(disk_err)?;
                    self.fs.sync_dir(&self.root).map_err(disk_err)?;
                    *last = seq;
                }
                Ok(DiskOut::Done)
            }
        }
    }
}

#[cfg(test)]
impl FileStore<RealFs> {
    /// The class and file of the slot holding `key`.
    fn slot_of(&self, key: &ObjKey) -> Option<(usize, PathBuf)> {
        let e = self.inner.entry(key)?;
        Some((e.slot.class, self.inner.slot_path(e.slot.class, e.slot.no)))
    }

    fn slot_files(&self) -> usize {
        (0..CLASSES).map(|c| std::fs::read_dir(self.inner.class_dir(c)).unwrap().count()).sum()
    }
}

#[cfg(test)]
mod tests;
