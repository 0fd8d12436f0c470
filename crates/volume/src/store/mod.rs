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

/// One slot file and which of its two header copies holds its current header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SlotRef {
    class: usize,
    no: u64,
    /// 0 or 1; the next header write goes to the other copy.
    current_copy: u8,
}

impl SlotRef {
    fn next_copy(&self) -> u8 {
        self.current_copy ^ 1
    }
}

/// Where an object lives.
#[derive(Debug, Clone, Copy)]
struct Entry {
    slot: SlotRef,
    len_bytes: u64,
    /// Set while the object is a deferred copy of its parent.
    base: Option<Base>,
}

/// A `super` child's object whose copy of the parent is deferred: only the sectors in `present`
/// are in the child's slot; the others read from the parent's slot, which is collocated on this
/// shard. This takes the copy off the write path: the first child write to an object writes the
/// 4 KiB it changes (plus its header), not 64 KiB, so it costs about what a plain overwrite
/// costs.
///
/// Invariant: the parent's bytes never change while a child depends on them. Every mutation,
/// rename or delete of an object first completes its dependents (copies the missing sectors and
/// drops `base`, durably), so a crash at any point leaves either a deferred copy whose parent
/// is intact or a complete copy. The block checksums in the child's header cover the merged
/// bytes, so [`FileStore::boot`] checks a deferred copy like any other object. Parent and child
/// share a placement slot, so the core never runs two commands on them at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Base {
    /// The parent object and its slot file.
    key: ObjKey,
    class: usize,
    no: u64,
    /// The parent's length when the copy was made: child bytes past it that are not present
    /// are zeroes.
    len_bytes: u64,
    /// Bit i: sector i of the child is in the child's slot.
    present: u32,
}

/// The object part of a live slot header.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LiveObject {
    key: ObjKey,
    len_bytes: u64,
    /// The object's header as [`objfmt`] encodes it (version, block checksums).
    objfmt_header: [u8; HEADER_COPY_BYTES],
    base: Option<Base>,
}

/// One copy of a slot header.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SlotHeader {
    generation: u64,
    /// `None`: the slot is free.
    object: Option<LiveObject>,
}

impl SlotHeader {
    fn encode(&self, class: usize) -> [u8; HEADER_COPY_BYTES] {
        let mut h = [0u8; HEADER_COPY_BYTES];
        let t = TRAILER_AT;
        if let Some(o) = &self.object {
            h[..t].copy_from_slice(&o.objfmt_header[..t]);
            h[t + 16..t + 24].copy_from_slice(&o.key.table.to_le_bytes());
            h[t + 24..t + 32].copy_from_slice(&o.key.objno.to_le_bytes());
            h[t + 32..t + 40].copy_from_slice(&o.key.owner.to_le_bytes());
            h[t + 40..t + 48].copy_from_slice(&o.len_bytes.to_le_bytes());
            if let Some(b) = &o.base {
                let a = t + BASE_AT;
                h[a..a + 4].copy_from_slice(&BASE_MAGIC.to_le_bytes());
                h[a + 4..a + 8].copy_from_slice(&b.present.to_le_bytes());
                h[a + 8..a + 12].copy_from_slice(&(b.class as u32).to_le_bytes());
                h[a + 12..a + 20].copy_from_slice(&b.no.to_le_bytes());
                h[a + 20..a + 28].copy_from_slice(&b.key.table.to_le_bytes());
                h[a + 28..a + 36].copy_from_slice(&b.key.objno.to_le_bytes());
                h[a + 36..a + 44].copy_from_slice(&b.key.owner.to_le_bytes());
                h[a + 44..a + 52].copy_from_slice(&b.len_bytes.to_le_bytes());
            }
        }
        h[t..t + 4].copy_from_slice(&SLOT_MAGIC.to_le_bytes());
        let state = if self.object.is_some() { STATE_LIVE } else { STATE_FREE };
        h[t + 4..t + 8].copy_from_slice(&state.to_le_bytes());
        h[t + 8..t + 16].copy_from_slice(&self.generation.to_le_bytes());
        h[t + 48..t + 56].copy_from_slice(&CLASS_DATA_BYTES[class].to_le_bytes());
        let crc = crc32c::crc32c(&h[..HEADER_CRC_AT]);
        h[HEADER_CRC_AT..].copy_from_slice(&crc.to_le_bytes());
        h
    }

    /// A header copy, if it is whole (its CRC matches) and belongs to a slot of `class`.
    fn decode(h: &[u8], class: usize) -> Option<SlotHeader> {
        let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().unwrap());
        let t = TRAILER_AT;
        if h.len() < HEADER_COPY_BYTES
            || u32_at(t) != SLOT_MAGIC
            || u32_at(HEADER_CRC_AT) != crc32c::crc32c(&h[..HEADER_CRC_AT])
            || u64_at(t + 48) != CLASS_DATA_BYTES[class]
        {
            return None;
        }
        let generation = u64_at(t + 8);
        let object = match u32_at(t + 4) {
            STATE_FREE => None,
            STATE_LIVE => {
                let len_bytes = u64_at(t + 40);
                if len_bytes > CLASS_DATA_BYTES[class] {
                    return None;
                }
                let mut objfmt_header = [0u8; HEADER_COPY_BYTES];
                objfmt_header[..t].copy_from_slice(&h[..t]);
                let a = t + BASE_AT;
                let base = match u32_at(a) {
                    BASE_MAGIC => {
                        let class = u32_at(a + 8) as usize;
                        if class >= CLASSES || len_bytes > CLASS_DATA_BYTES[LAZY_CLASS] {
                            return None;
                        }
                        Some(Base {
                            present: u32_at(a + 4),
                            class,
                            no: u64_at(a + 12),
                            key: ObjKey { table: u64_at(a + 20), objno: u64_at(a + 28), owner: u64_at(a + 36) },
                            len_bytes: u64_at(a + 44),
                        })
                    }
                    _ => None,
                };
                Some(LiveObject {
                    key: ObjKey { table: u64_at(t + 16), objno: u64_at(t + 24), owner: u64_at(t + 32) },
                    len_bytes,
                    objfmt_header,
                    base,
                })
            }
            _ => return None,
        };
        Some(SlotHeader { generation, object })
    }
}

/// The current header of a slot from its header page: the whole copy with the higher
/// generation, and which copy that is.
fn current_header(page: &[u8], class: usize) -> Option<(u8, SlotHeader)> {
    let a = SlotHeader::decode(&page[..HEADER_COPY_BYTES], class);
    let b = SlotHeader::decode(&page[HEADER_COPY_BYTES..2 * HEADER_COPY_BYTES], class);
    match (a, b) {
        (Some(a), Some(b)) if b.generation > a.generation => Some((1, b)),
        (Some(a), _) => Some((0, a)),
        (None, Some(b)) => Some((1, b)),
        (None, None) => None,
    }
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

/// An object in its slot as [`objfmt`] sees an object file: the objfmt header at offset 0, the
/// object's bytes from [`HEADER_BYTES`]. The length comes from the slot header, not the file
/// size; growing the object zeroes the stale bytes it takes in; shrinking it (`Put`) only lowers
/// the length — nothing is truncated or deallocated, so no metadata changes. The new objfmt
/// header is kept here; the store writes it into the slot header.
struct SlotObject<'a, F: SlotFile> {
    file: &'a SlotWriter<F>,
    objfmt_header: [u8; HEADER_COPY_BYTES],
    len_bytes: u64,
    capacity_bytes: u64,
}

impl<F: SlotFile> SlotObject<'_, F> {
    fn grow_to(&mut self, len_bytes: u64) -> io::Result<()> {
        if len_bytes > self.capacity_bytes {
            return Err(invalid(format!("object of {len_bytes} bytes does not fit its {} byte slot", self.capacity_bytes)));
        }
        if len_bytes > self.len_bytes {
            self.file.write_zeroes_at(SLOT_HEADER_PAGE_BYTES + self.len_bytes, len_bytes - self.len_bytes)?;
            self.len_bytes = len_bytes;
        }
        Ok(())
    }
}

impl<F: SlotFile> ObjFile for SlotObject<'_, F> {
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        if offset < HEADER_BYTES {
            // objfmt reads its header whole, at offset 0.
            let n = buf.len().min(HEADER_COPY_BYTES - offset as usize);
            buf[..n].copy_from_slice(&self.objfmt_header[offset as usize..offset as usize + n]);
            return Ok(n);
        }
        let at = offset - HEADER_BYTES;
        let n = (buf.len() as u64).min(self.len_bytes.saturating_sub(at)) as usize;
        let got = self.file.read_at(&mut buf[..n], SLOT_HEADER_PAGE_BYTES + at)?;
        // A slot file is never short; if one were, its missing bytes read as zeroes (and fail
        // the checksums).
        buf[got..n].fill(0);
        Ok(n)
    }

    fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()> {
        let Some(at) = body_write_offset(&mut self.objfmt_header, data, offset)? else { return Ok(()) };
        if at > self.len_bytes {
            self.grow_to(at)?;
        }
        if at + data.len() as u64 > self.capacity_bytes {
            return Err(invalid("write past the end of the slot".into()));
        }
        self.file.write_all_at(data, SLOT_HEADER_PAGE_BYTES + at)?;
        self.len_bytes = self.len_bytes.max(at + data.len() as u64);
        Ok(())
    }

    fn len(&mut self) -> io::Result<u64> {
        Ok(HEADER_BYTES + self.len_bytes)
    }

    fn set_len(&mut self, len: u64) -> io::Result<()> {
        let len_bytes = len.saturating_sub(HEADER_BYTES);
        if len_bytes <= self.len_bytes {
            self.len_bytes = len_bytes;
            Ok(())
        } else {
            self.grow_to(len_bytes)
        }
    }

    fn zero_range(&mut self, offset: u64, len: u64) -> io::Result<()> {
        // Zeroes are written, not punched: a hole would have to be reallocated (metadata) by the
        // next write.
        let at = offset.saturating_sub(HEADER_BYTES);
        let end = (at + len).min(self.len_bytes);
        if end > at {
            self.file.write_zeroes_at(SLOT_HEADER_PAGE_BYTES + at, end - at)?;
        }
        Ok(())
    }

    fn crc_range(&mut self, offset: u64, len: u64) -> io::Result<u32> {
        // Every write checksums a whole 64 KiB block: read it into uninitialised capacity
        // rather than a zeroed buffer (one pass over the block fewer).
        let at = offset.saturating_sub(HEADER_BYTES).min(self.len_bytes);
        let n = len.min(self.len_bytes - at);
        let mut buf = self.file.f.read_vec(SLOT_HEADER_PAGE_BYTES + at, n)?;
        buf.resize(n as usize, 0);
        self.file.overlay_pending(&mut buf, SLOT_HEADER_PAGE_BYTES + at)?;
        Ok(crc32c::crc32c(&buf))
    }
}

/// What both object adapters do first in `write_at`: objfmt writes its header whole at offset 0,
/// into the slot header's copy; a partial header write is refused; an empty write does nothing
/// (as on a file, it does not extend it). Returns the body offset of anything else.
fn body_write_offset(header: &mut [u8; HEADER_COPY_BYTES], data: &[u8], offset: u64) -> io::Result<Option<u64>> {
    if offset == 0 && data.len() == HEADER_COPY_BYTES {
        header.copy_from_slice(data);
        return Ok(None);
    }
    if offset < HEADER_BYTES {
        return Err(invalid("partial object header write".into()));
    }
    Ok((!data.is_empty()).then_some(offset - HEADER_BYTES))
}

/// An object built in memory before it goes into a fresh slot in one write: a new object, a
/// copy-on-write copy of its parent, or an object moving to a bigger class.
pub(crate) struct MemObject {
    pub(crate) objfmt_header: [u8; HEADER_COPY_BYTES],
    pub(crate) body: Vec<u8>,
}

impl ObjFile for MemObject {
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let (src, at): (&[u8], u64) =
            if offset < HEADER_BYTES { (&self.objfmt_header, offset) } else { (&self.body, offset - HEADER_BYTES) };
        let at = (at as usize).min(src.len());
        let n = buf.len().min(src.len() - at);
        buf[..n].copy_from_slice(&src[at..at + n]);
        Ok(n)
    }

    fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()> {
        let Some(at) = body_write_offset(&mut self.objfmt_header, data, offset)? else { return Ok(()) };
        let at = at as usize;
        if at + data.len() > MAX_OBJECT_SIZE_BYTES as usize {
            return Err(invalid("object larger than 4 MiB".into()));
        }
        if self.body.len() < at + data.len() {
            self.body.resize(at + data.len(), 0);
        }
        self.body[at..at + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn len(&mut self) -> io::Result<u64> {
        Ok(HEADER_BYTES + self.body.len() as u64)
    }

    fn set_len(&mut self, len: u64) -> io::Result<()> {
        self.body.resize(len.saturating_sub(HEADER_BYTES) as usize, 0);
        Ok(())
    }

    fn zero_range(&mut self, offset: u64, len: u64) -> io::Result<()> {
        let at = (offset.saturating_sub(HEADER_BYTES) as usize).min(self.body.len());
        let end = (at + len as usize).min(self.body.len());
        self.body[at..end].fill(0);
        Ok(())
    }

    fn crc_range(&mut self, offset: u64, len: u64) -> io::Result<u32> {
        // Checksummed where it lies: no copy (a copy-on-write checksums a block per write).
        let at = (offset.saturating_sub(HEADER_BYTES) as usize).min(self.body.len());
        let end = (at + len as usize).min(self.body.len());
        Ok(crc32c::crc32c(&self.body[at..end]))
    }
}

/// What [`Inner::apply_lazy`] applies a write to: the whole object in memory, or only the
/// sectors a small write touches.
enum LazySource {
    Whole(MemObject),
    Window(Window),
}

/// Some whole sectors of an object, `start` bytes into it, and its header: enough for
/// [`objfmt::apply`] of a write inside them ([`objfmt::small_write_fits`]), which reads and
/// writes only the written range and the header. Anything else is refused with an error.
struct Window {
    objfmt_header: [u8; HEADER_COPY_BYTES],
    len_bytes: u64,
    start: u64,
    bytes: Vec<u8>,
}

impl Window {
    fn range(&self, at: u64, len: usize) -> io::Result<std::ops::Range<usize>> {
        match at.checked_sub(self.start) {
            Some(x) if x as usize + len <= self.bytes.len() => Ok(x as usize..x as usize + len),
            _ => Err(io::Error::other("deferred copy: access outside the sectors read")),
        }
    }
}

impl ObjFile for Window {
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        if offset < HEADER_BYTES {
            let n = buf.len().min(HEADER_COPY_BYTES - offset as usize);
            buf[..n].copy_from_slice(&self.objfmt_header[offset as usize..offset as usize + n]);
            return Ok(n);
        }
        let r = self.range(offset - HEADER_BYTES, buf.len())?;
        buf.copy_from_slice(&self.bytes[r]);
        Ok(buf.len())
    }

    fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()> {
        let Some(at) = body_write_offset(&mut self.objfmt_header, data, offset)? else { return Ok(()) };
        let r = self.range(at, data.len())?;
        self.bytes[r].copy_from_slice(data);
        Ok(())
    }

    fn len(&mut self) -> io::Result<u64> {
        Ok(HEADER_BYTES + self.len_bytes)
    }

    fn set_len(&mut self, _len: u64) -> io::Result<()> {
        Err(io::Error::other("deferred copy: a window cannot change length"))
    }

    fn zero_range(&mut self, _offset: u64, _len: u64) -> io::Result<()> {
        Err(io::Error::other("deferred copy: a window takes writes only"))
    }

    fn crc_range(&mut self, _offset: u64, _len: u64) -> io::Result<u32> {
        Err(io::Error::other("deferred copy: a window has not every byte of a block"))
    }
}

/// The object's length after `op`, as [`objfmt::apply`] makes it.
/// What a child's write to a deferred copy makes its own: the written range, plus the zeroes
/// between the old end and the write when it grows the object. Marks those sectors present in
/// `present` and returns the byte range of whole sectors to write (clipped to the new length)
/// and whether the copy is now complete (every sector of the object present).
pub(crate) fn claim_sectors(present: &mut u32, old_len: u64, new_len: u64, op: &RepOp) -> (u64, u64, bool) {
    let (mut start, mut end) = match op {
        RepOp::Write { offset, data } => (*offset as u64, *offset as u64 + data.len() as u64),
        RepOp::Zero { offset, len } => (*offset as u64, (*offset as u64 + *len as u64).min(old_len)),
        RepOp::Put { .. } => unreachable!("a Put is never a deferred copy"),
    };
    if new_len > old_len {
        (start, end) = (start.min(old_len), end.max(new_len));
    }
    let (s0, s1) = (start / LAZY_SECTOR_BYTES, end.div_ceil(LAZY_SECTOR_BYTES));
    for s in s0..s1 {
        *present |= 1 << s;
    }
    let all = (1u64 << new_len.div_ceil(LAZY_SECTOR_BYTES)) - 1;
    (s0 * LAZY_SECTOR_BYTES, (s1 * LAZY_SECTOR_BYTES).min(new_len), u64::from(*present) & all == all)
}

pub(crate) fn len_after(len_bytes: u64, op: &RepOp) -> u64 {
    match op {
        RepOp::Put { data } => data.len() as u64,
        RepOp::Write { data, .. } if data.is_empty() => len_bytes,
        RepOp::Write { offset, data } => len_bytes.max(*offset as u64 + data.len() as u64),
        RepOp::Zero { .. } => len_bytes,
    }
}

#[derive(Default)]
struct Index {
    objects: HashMap<ObjKey, Entry>,
    /// Free slots per class: the most recently freed is taken first (its pages are likely still
    /// cached); the refill adds at the front and the trim removes from the front.
    free: [VecDeque<SlotRef>; CLASSES],
    next_slot_no: [u64; CLASSES],
    /// Classes the refill keeps stocked: those with any slot file, or asked for since open.
    in_use: [bool; CLASSES],
    /// Free slots the refill keeps ready now, per class.
    target: [usize; CLASSES],
    /// A write of the class found no free slot since the refill last lowered the target.
    ran_dry: [bool; CLASSES],
    /// Slots owed to `super` children: one per first write they may still make (per class, the
    /// largest reservation asked for, at most [`PoolOptions::reserved_slots_max`]). Only a
    /// child's first write counts one off. The child's burst may start seconds after `super`,
    /// or the refill may need more than a decay period to make them on a busy disk, so the
    /// reservation lasts until [`RESERVE_IDLE_MS`] pass without a child taking one.
    reserved: [usize; CLASSES],
    /// The ready slots of the reservation: a free list of their own, which only a child's first
    /// write takes from (every other allocation — a general clone's copy-ups, a fill, a move —
    /// takes from `free`). With one shared list, other bursts drained the child's stock, and at
    /// depth 32 the child's writes met a dry pool: slots made inline (a directory fsync) and the
    /// refill writing batches of zeroes under them. Kept at most `reserved` long; stocked first
    /// from free slots (moved in memory: `super` pre-stocks at once whatever the pool holds),
    /// then from freed slots and the refill.
    reserved_free: [VecDeque<SlotRef>; CLASSES],
    /// When a reservation was last made or used, in µs since open.
    reserved_touched_us: [u64; CLASSES],
    /// Parent → its children that are deferred copies of it (see [`Base`]).
    lazy_children: HashMap<ObjKey, Vec<ObjKey>>,
}

impl Index {
    /// Free slots (of `free`) the refill keeps ready in a class: the adaptive target, at most
    /// the class maximum.
    fn goal(&self, class: usize, max: &[usize; CLASSES]) -> usize {
        self.target[class].min(max[class])
    }

    /// Ready slots the reservation of a class still lacks.
    fn reserve_deficit(&self, class: usize) -> usize {
        self.reserved[class].saturating_sub(self.reserved_free[class].len())
    }

    /// Moves free slots into the reservation while it lacks any (the most recently freed
    /// first), and gives back to `free` any ready slots beyond what is still owed.
    fn rebalance_reserve(&mut self, class: usize) {
        while self.reserve_deficit(class) > 0 {
            let Some(slot) = self.free[class].pop_back() else { break };
            self.reserved_free[class].push_back(slot);
        }
        while self.reserved_free[class].len() > self.reserved[class] {
            let slot = self.reserved_free[class].pop_front().expect("longer than zero");
            self.free[class].push_front(slot);
        }
    }

    /// Puts a slot that holds nothing back: into the reservation if it lacks slots, else into
    /// the free list.
    fn put_free(&mut self, slot: SlotRef) {
        if self.reserve_deficit(slot.class) > 0 {
            self.reserved_free[slot.class].push_back(slot);
        } else {
            self.free[slot.class].push_back(slot);
        }
    }

    /// Enters (or replaces) an object, keeping `lazy_children` in step.
    fn insert(&mut self, key: ObjKey, e: Entry) -> Option<Entry> {
        let old = self.objects.insert(key, e);
        if let Some(b) = old.and_then(|o| o.base) {
            self.forget_child(b.key, key);
        }
        if let Some(b) = e.base {
            self.lazy_children.entry(b.key).or_default().push(key);
        }
        old
    }

    fn remove(&mut self, key: &ObjKey) -> Option<Entry> {
        let old = self.objects.remove(key);
        if let Some(b) = old.and_then(|o| o.base) {
            self.forget_child(b.key, *key);
        }
        old
    }

    fn forget_child(&mut self, parent: ObjKey, child: ObjKey) {
        if let Some(v) = self.lazy_children.get_mut(&parent) {
            v.retain(|c| *c != child);
            if v.is_empty() {
                self.lazy_children.remove(&parent);
            }
        }
    }
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

/// A slot file opened for a mutating command. With the journal on, the command's writes are
/// held back as its journal record's payload and reach the file only once that record is
/// durable ([`Inner::make_durable`]: write-ahead); reads through it see them meanwhile.
struct SlotWriter<F> {
    f: F,
    slot: SlotRef,
    /// The writes held back so far ([`encode_write`] entries), if journaling.
    pending: Option<std::cell::RefCell<Vec<u8>>>,
}

impl<F: SlotFile> SlotWriter<F> {
    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        match &self.pending {
            Some(p) => encode_write(&mut p.borrow_mut(), self.slot.class, self.slot.no, offset, data.len() as u64, Some(data)),
            None => self.f.write_all_at(data, offset)?,
        }
        Ok(())
    }

    fn write_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
        match &self.pending {
            Some(p) => encode_write(&mut p.borrow_mut(), self.slot.class, self.slot.no, offset, len, None),
            None => write_zeroes_at(&self.f, offset, len)?,
        }
        Ok(())
    }

    /// Reads the file from `offset` as this command's writes so far left it.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let got = read_full_at(&self.f, buf, offset)?;
        self.overlay_pending(buf, offset)?;
        Ok(got)
    }

    /// Copies the held-back writes that overlap `buf` (read from `offset`) into it, in order.
    fn overlay_pending(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let Some(p) = &self.pending else { return Ok(()) };
        let p = p.borrow();
        let end = offset + buf.len() as u64;
        for (_, at, len, data) in decode_writes(&p)? {
            let (from, to) = (at.max(offset), (at + len).min(end));
            if from >= to {
                continue;
            }
            let dst = &mut buf[(from - offset) as usize..(to - offset) as usize];
            match data {
                Some(d) => dst.copy_from_slice(&d[(from - at) as usize..(to - at) as usize]),
                None => dst.fill(0),
            }
        }
        Ok(())
    }
}

/// Writes a journal record's writes (all to `f`, the slot file of their key) to the file.
fn write_record<F: JournalFile>(f: &F, payload: &[u8]) -> io::Result<()> {
    for (_, offset, len, data) in decode_writes(payload)? {
        match data {
            Some(d) => f.write_all_at(d, offset)?,
            None => write_zeroes_at(f, offset, len)?,
        }
    }
    Ok(())
}

/// The journal's key for a slot file.
fn slot_key(class: usize, no: u64) -> u64 {
    ((class as u64) << 56) | no
}

fn slot_of_key(key: u64) -> (usize, u64) {
    ((key >> 56) as usize, key & ((1 << 56) - 1))
}

/// One write of a journal record's payload: `key u64, offset u64, len u64, zeroes u8`, then the
/// bytes unless it writes zeroes.
fn encode_write(out: &mut Vec<u8>, class: usize, no: u64, offset: u64, len: u64, data: Option<&[u8]>) {
    out.extend_from_slice(&slot_key(class, no).to_le_bytes());
    out.extend_from_slice(&offset.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
    out.push(data.is_none() as u8);
    if let Some(d) = data {
        out.extend_from_slice(d);
    }
}

/// The writes of a journal record's payload: (key, offset, bytes or `None` for `len` zeroes).
type RecordWrite<'a> = (u64, u64, u64, Option<&'a [u8]>);

fn decode_writes(mut p: &[u8]) -> io::Result<Vec<RecordWrite<'_>>> {
    let bad = || io::Error::new(ErrorKind::InvalidData, "a journal record's payload is malformed");
    let mut out = vec![];
    while !p.is_empty() {
        if p.len() < 25 {
            return Err(bad());
        }
        let u = |i: usize| u64::from_le_bytes(p[i..i + 8].try_into().unwrap());
        let (key, offset, len, zeroes) = (u(0), u(8), u(16), p[24] != 0);
        p = &p[25..];
        if slot_of_key(key).0 >= CLASSES || offset.checked_add(len).is_none_or(|end| end > slot_file_bytes(slot_of_key(key).0)) {
            return Err(bad());
        }
        if zeroes {
            out.push((key, offset, len, None));
        } else {
            if (p.len() as u64) < len {
                return Err(bad());
            }
            out.push((key, offset, len, Some(&p[..len as usize])));
            p = &p[len as usize..];
        }
    }
    Ok(out)
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

/// Opens the journal at `root` (replaying whatever an earlier run left in it onto the slot
/// files, made durable before the journal forgets it), or creates one of `capacity` bytes; with
/// `capacity` `None`, a journal left behind is replayed and removed.
fn open_journal<D: StoreFs>(fs: &D, root: &Path, capacity: Option<u64>) -> io::Result<Option<Journal<D::File>>> {
    let path = root.join(JOURNAL_FILE);
    let mut journal = None;
    match fs.open(&path) {
        Ok(f) => {
            let replay = Journal::open(f)?;
            if !replay.payloads.is_empty() {
                tracing::info!(records = replay.payloads.len(), "replaying the journal");
            }
            apply_records(fs, root, &replay.payloads)?;
            let cap = replay.capacity();
            let j = replay.finish()?;
            if capacity == Some(cap) {
                journal = Some(j);
            } else {
                drop(j);
                fs.remove_file(&path)?;
                fs.sync_dir(root)?;
            }
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    if let (None, Some(cap)) = (&journal, capacity) {
        // Made whole under another name first: a crash mid-way leaves no journal half made.
        let tmp = root.join("journal.tmp");
        let f = fs.create_truncate(&tmp)?;
        Journal::format(&f, cap)?;
        fs.rename(&tmp, &path)?;
        fs.sync_dir(root)?;
        journal = Some(Journal::open(f)?.finish()?);
    }
    Ok(journal)
}

/// Redoes journal records' writes on the slot files, in order, and syncs the files. A file
/// that is gone was a free slot the trim removed (after syncing it): nothing to restore.
fn apply_records<D: StoreFs>(fs: &D, root: &Path, payloads: &[Vec<u8>]) -> io::Result<()> {
    let mut files: HashMap<u64, Option<D::File>> = HashMap::new();
    for p in payloads {
        for (key, offset, len, data) in decode_writes(p)? {
            let f = match files.entry(key) {
                std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    let (class, no) = slot_of_key(key);
                    v.insert(match fs.open(&slot_path_in(root, class, no)) {
                        Ok(f) => Some(f),
                        Err(e) if e.kind() == ErrorKind::NotFound => None,
                        Err(e) => return Err(e),
                    })
                }
            };
            let Some(f) = f else { continue };
            match data {
                Some(d) => f.write_all_at(d, offset)?,
                None => write_zeroes_at(f, offset, len)?,
            }
        }
    }
    for f in files.values().flatten() {
        f.start_writeback();
    }
    files.values().flatten().try_for_each(|f| f.sync())
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

    /// Makes the slot files the journal's records dirtied since the last checkpoint durable —
    /// only those — then frees the journal space.
    ///
    /// One device flush for all of them, not one `fdatasync` each: the writeback of every file
    /// is started, then waited for (`sync_file_range`), and the journal header's `fdatasync`
    /// that follows ([`Journal::checkpoint`]) flushes the device's write cache, completed slot
    /// writes included. That is enough because writing a slot file never changes metadata:
    /// every block of it was written (allocated) when it was made, and its size never changes.
    /// With one `fdatasync` per file, a checkpoint after a burst of writes to distinct objects
    /// cost as many flushes as the writes had saved (the store benchmark's depth-32 p99 was
    /// four times worse with the journal than without).
    fn checkpoint(&self) -> io::Result<()> {
        let Some(j) = &self.journal else { return Ok(()) };
        j.checkpoint(|keys| {
            let mut files = Vec::with_capacity(keys.len());
            for &k in keys {
                let (class, no) = slot_of_key(k);
                match self.fs.open_read(&self.slot_path(class, no)) {
                    Ok(f) => {
                        f.start_writeback();
                        files.push(f);
                    }
                    // Removed by the trim, which synced it first.
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
            files.iter().try_for_each(|f| f.wait_writeback())
        })
    }

    fn checkpoint_loop(&self) {
        let Some(j) = &self.journal else { return };
        let mut failing_logged = false;
        while !self.shutdown.load(Ordering::SeqCst) {
            if j.wait_checkpoint_due(Duration::from_millis(REFILL_PERIOD_MS)) && !self.shutdown.load(Ordering::SeqCst) {
                match self.checkpoint() {
                    Ok(()) => failing_logged = false,
                    Err(e) => {
                        if !failing_logged {
                            tracing::warn!("journal checkpoint failed (retrying): {e}");
                            failing_logged = true;
                        }
                        std::thread::sleep(Duration::from_millis(REFILL_YIELD_MS));
                    }
                }
            }
        }
    }

    fn open_slot(&self, slot: &SlotRef) -> io::Result<D::File> {
        self.fs.open(&self.slot_path(slot.class, slot.no))
    }

    fn make_dirs(&self) -> io::Result<()> {
        let fresh = !self.fs.is_dir(&self.slots_dir());
        for class in 0..CLASSES {
            self.fs.create_dir_all(&self.class_dir(class))?;
        }
        if fresh {
            self.fs.sync_dir(&self.slots_dir())?;
            self.fs.sync_dir(&self.root)?;
        }
        Ok(())
    }

    fn generation(&self) -> u64 {
        self.next_generation.fetch_add(1, Ordering::Relaxed)
    }

    fn entry(&self, key: &ObjKey) -> Option<Entry> {
        self.index.lock().unwrap().objects.get(key).copied()
    }

    /// Reads a slot's header page and returns its current header.
    fn read_header(&self, f: &D::File, class: usize) -> io::Result<Option<(u8, SlotHeader)>> {
        let mut page = [0u8; 2 * HEADER_COPY_BYTES];
        read_full_at(f, &mut page, 0)?;
        Ok(current_header(&page, class))
    }

    /// The live header of an object's slot (the index said it is there).
    fn read_live(&self, f: &D::File, key: &ObjKey, e: &Entry) -> io::Result<LiveObject> {
        let mut sector = [0u8; HEADER_COPY_BYTES];
        read_full_at(f, &mut sector, e.slot.current_copy as u64 * HEADER_COPY_BYTES as u64)?;
        match SlotHeader::decode(&sector, e.slot.class) {
            Some(SlotHeader { object: Some(o), .. }) if o.key == *key => Ok(o),
            _ => Err(io::Error::other(format!(
                "slot {} of class {} no longer holds the header of {key:?}",
                e.slot.no, CLASS_DIR_NAMES[e.slot.class]
            ))),
        }
    }

    /// Writes a new header into the slot's other copy and makes the slot durable (its data
    /// written before, and the header, in one `fdatasync`). Returns the slot with the copy now
    /// current.
    fn commit_header(&self, w: &SlotWriter<D::File>, slot: SlotRef, object: Option<LiveObject>) -> io::Result<SlotRef> {
        let header = SlotHeader { generation: self.generation(), object };
        let copy = slot.next_copy();
        w.write_all_at(&header.encode(slot.class), copy as u64 * HEADER_COPY_BYTES as u64)?;
        self.make_durable(w)?;
        Ok(SlotRef { current_copy: copy, ..slot })
    }

    /// Makes what `w` wrote durable: one journal record (group commit) and then the writes
    /// themselves (write-ahead), or the slot file's own `fdatasync`.
    fn make_durable(&self, w: &SlotWriter<D::File>) -> io::Result<()> {
        match (&self.journal, &w.pending) {
            (Some(j), Some(pending)) => {
                let payload = std::mem::take(&mut *pending.borrow_mut());
                j.commit_then(&payload, &[slot_key(w.slot.class, w.slot.no)], || write_record(&w.f, &payload))
            }
            _ => {
                w.f.sync()?;
                inc(&self.counters.write_fdatasyncs);
                Ok(())
            }
        }
    }

    /// Opens a slot file for a mutating command (see [`SlotWriter`]).
    fn writer(&self, slot: &SlotRef) -> io::Result<SlotWriter<D::File>> {
        let pending = self.journal.as_ref().map(|_| std::cell::RefCell::new(Vec::new()));
        Ok(SlotWriter { f: self.open_slot(slot)?, slot: *slot, pending })
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

    fn apply(&self, key: ObjKey, version: Version, op: RepOp, cow_from: Option<ObjKey>) -> io::Result<()> {
        let existing = self.entry(&key);
        // A new child starts as a copy of its parent: its length after `op` counts from the parent's.
        let start_len = match (existing, cow_from) {
            (Some(e), _) => e.len_bytes,
            (None, Some(src)) => self.entry(&src).map_or(0, |p| p.len_bytes),
            (None, None) => 0,
        };
        let len_bytes = len_after(start_len, &op);
        if len_bytes > MAX_OBJECT_SIZE_BYTES as u64 {
            return Err(invalid(format!("object {key:?} would be {len_bytes} bytes, larger than 4 MiB")));
        }
        if existing.is_some() {
            // Children still reading this object's bytes get their own copy first.
            self.complete_children_of(&key)?;
        }
        let lazy_fits = len_bytes <= CLASS_DATA_BYTES[LAZY_CLASS] && !matches!(op, RepOp::Put { .. });
        match existing {
            Some(e) if e.base.is_some() && lazy_fits && e.slot.class == LAZY_CLASS => {
                let obj = self.lazy_source(&key, &e, &op)?;
                self.apply_lazy(key, e.slot, e.base.unwrap(), obj, version, &op, false)
            }
            Some(e) if e.base.is_some() && !matches!(op, RepOp::Put { .. }) => {
                // Grows past the deferred-copy class: complete the copy, then as any object.
                self.complete(key)?;
                self.apply(key, version, op, None)
            }
            // A Put replaces every byte: the deferred copy simply ends (apply_in_place writes a
            // header without a base).
            Some(e) if len_bytes <= CLASS_DATA_BYTES[e.slot.class] => self.apply_in_place(key, e, version, &op),
            Some(e) => {
                // Outgrows its class: build it in memory, make it durable in a bigger slot, and
                // only then free the old slot (a crash in between leaves two claims; open keeps
                // the newer).
                let mut obj = self.load(&key, &e)?;
                objfmt::apply(&mut obj, version, &op)?;
                self.write_fresh(key, obj)?;
                // If freeing fails the write is durable but reported failed (the client
                // retries; the replay is an overwrite). The old slot is then out of use until
                // the next open, whose duplicate rule frees it: it must not be reused before,
                // or a later delete of the key could let its stale claim come back.
                self.free_slot(e.slot)
            }
            None if cow_from.is_some() && lazy_fits => {
                inc(&self.counters.cow_first_writes);
                let src = cow_from.unwrap();
                let pe = self.entry(&src).ok_or_else(|| not_found(&src))?;
                let t = std::time::Instant::now();
                if pe.base.is_some() {
                    // The parent is itself a deferred copy (a child promoted moments ago, not yet
                    // garbage collected): copy it whole rather than chain deferred copies.
                    let mut obj = self.load(&src, &pe)?;
                    add_us(&self.counters.cow_load_us, t);
                    objfmt::apply(&mut obj, version, &op)?;
                    return self.write_fresh_as(key, obj, true);
                }
                let obj = self.lazy_source(&src, &pe, &op)?;
                add_us(&self.counters.cow_load_us, t);
                let slot = self.take_slot(LAZY_CLASS, true)?;
                let base = Base { key: src, class: pe.slot.class, no: pe.slot.no, len_bytes: pe.len_bytes, present: 0 };
                self.apply_lazy(key, slot, base, obj, version, &op, true)
            }
            None => {
                let mut obj = match cow_from {
                    // Collocated copy-on-write: a local copy, no network transfer (§4.2.1).
                    Some(src) => {
                        inc(&self.counters.cow_first_writes);
                        let pe = self.entry(&src).ok_or_else(|| not_found(&src))?;
                        self.load(&src, &pe)?
                    }
                    None => MemObject { objfmt_header: [0; HEADER_COPY_BYTES], body: vec![] },
                };
                objfmt::apply(&mut obj, version, &op)?;
                self.write_fresh_as(key, obj, cow_from.is_some())
            }
        }
    }

    /// Applies a write or zeroing to a deferred copy (`obj` holds its merged bytes; `slot` is the
    /// child's own slot, fresh or its current one): writes only the sectors the operation
    /// touches, then the header with the sectors now present, one fdatasync. Once every sector
    /// is present the copy is complete and the header drops the base.
    #[allow(clippy::too_many_arguments)]
    fn apply_lazy(&self, key: ObjKey, slot: SlotRef, mut base: Base, obj: LazySource, version: Version, op: &RepOp, fresh: bool) -> io::Result<()> {
        // The bytes the sectors to write start from, from `from` bytes into the object.
        let (old_len, new_len, objfmt_header, from, bytes) = match obj {
            LazySource::Whole(mut obj) => {
                let old_len = obj.body.len() as u64;
                objfmt::apply(&mut obj, version, op)?;
                (old_len, obj.body.len() as u64, obj.objfmt_header, 0, obj.body)
            }
            LazySource::Window(mut w) => {
                objfmt::apply(&mut w, version, op)?;
                (w.len_bytes, w.len_bytes, w.objfmt_header, w.start, w.bytes)
            }
        };
        let (a, b, complete) = claim_sectors(&mut base.present, old_len, new_len, op);
        let base = (!complete).then_some(base);
        let t = std::time::Instant::now();
        let written = (|| {
            let w = self.writer(&slot)?;
            if b > a {
                let range = a.checked_sub(from).zip(b.checked_sub(from)).filter(|(_, e)| *e as usize <= bytes.len());
                let Some((x, y)) = range else { return Err(io::Error::other("deferred copy: sectors outside the bytes read")) };
                w.write_all_at(&bytes[x as usize..y as usize], SLOT_HEADER_PAGE_BYTES + a)?;
            }
            let object = LiveObject { key, len_bytes: new_len, objfmt_header, base };
            self.commit_header(&w, slot, Some(object))
        })();
        if fresh {
            add_us(&self.counters.cow_commit_us, t);
        }
        match written {
            Ok(slot) => {
                if fresh {
                    inc(&self.counters.deferred_copies_made);
                }
                self.index.lock().unwrap().insert(key, Entry { slot, len_bytes: new_len, base });
                Ok(())
            }
            Err(e) => {
                if fresh {
                    self.give_back(slot);
                }
                Err(e)
            }
        }
    }

    /// What a write to a deferred copy (new or not) starts from. A write inside the object's
    /// bytes and one checksum block ([`objfmt::small_write_fits`]) needs only the whole sectors
    /// it touches and the header: the checksum is updated from the bytes it replaces. Before,
    /// every child first write read and checksummed the whole 64 KiB parent object. Any other
    /// write gets the whole object.
    fn lazy_source(&self, key: &ObjKey, e: &Entry, op: &RepOp) -> io::Result<LazySource> {
        if let RepOp::Write { offset, data } = op {
            let f = self.open_slot(&e.slot)?;
            let live = self.read_live(&f, key, e)?;
            let (offset, len) = (*offset as u64, data.len() as u64);
            if objfmt::Header::decode(&live.objfmt_header).is_some_and(|h| objfmt::small_write_fits(&h, e.len_bytes, offset, len)) {
                let start = offset / LAZY_SECTOR_BYTES * LAZY_SECTOR_BYTES;
                let stop = ((offset + len).div_ceil(LAZY_SECTOR_BYTES) * LAZY_SECTOR_BYTES).min(e.len_bytes);
                let mut bytes = vec![0u8; (stop - start) as usize];
                self.read_body_at(&f, e, &mut bytes, start)?;
                return Ok(LazySource::Window(Window { objfmt_header: live.objfmt_header, len_bytes: e.len_bytes, start, bytes }));
            }
        }
        Ok(LazySource::Whole(self.load(key, e)?))
    }

    /// Makes a deferred copy whole: writes its merged bytes into its slot and a header without
    /// a base, durably. Nothing to do for any other object.
    ///
    /// The bytes are made durable before the header (two `fdatasync`s, or two journal records):
    /// the copy holds acknowledged writes, so a crash in between must leave it readable — the
    /// old header (with the base) over bytes that read the same either way. With one sync for
    /// both, a crash could keep the new header over torn bytes, and the child's acknowledged
    /// writes would be suspect (found by the power-cut test of every command on the simulated
    /// disk).
    fn complete(&self, key: ObjKey) -> io::Result<()> {
        let Some(e) = self.entry(&key) else { return Ok(()) };
        if e.base.is_none() {
            return Ok(());
        }
        let obj = self.load(&key, &e)?;
        let w = self.writer(&e.slot)?;
        w.write_all_at(&obj.body, SLOT_HEADER_PAGE_BYTES)?;
        self.make_durable(&w)?;
        let object = LiveObject { key, len_bytes: e.len_bytes, objfmt_header: obj.objfmt_header, base: None };
        let slot = self.commit_header(&w, e.slot, Some(object))?;
        self.index.lock().unwrap().insert(key, Entry { slot, len_bytes: e.len_bytes, base: None });
        inc(&self.counters.deferred_copies_completed);
        Ok(())
    }

    /// Completes every deferred copy of `parent`, before its bytes change or go.
    fn complete_children_of(&self, parent: &ObjKey) -> io::Result<()> {
        let children = self.index.lock().unwrap().lazy_children.get(parent).cloned().unwrap_or_default();
        for child in children {
            self.complete(child)?;
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes of an object's body from `offset` (inside its length). A deferred
    /// copy takes the sectors it does not hold from its parent's slot — or zeroes, should that
    /// slot no longer hold the parent (which the invariant of [`Base`] rules out; the block
    /// checksums would then mark the object suspect at boot).
    fn read_body_at(&self, f: &D::File, e: &Entry, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let Some(base) = e.base else {
            let got = read_full_at(f, buf, SLOT_HEADER_PAGE_BYTES + offset)?;
            buf[got..].fill(0);
            return Ok(());
        };
        let parent = {
            let idx = self.index.lock().unwrap();
            idx.objects.get(&base.key).is_some_and(|p| p.slot.class == base.class && p.slot.no == base.no)
        };
        let parent = if parent { Some(self.open_slot(&SlotRef { class: base.class, no: base.no, current_copy: 0 })?) } else { None };
        let end = offset + buf.len() as u64;
        let mut at = offset;
        while at < end {
            // A run of sectors from one source.
            let sector = at / LAZY_SECTOR_BYTES;
            let here = base.present & (1 << sector) != 0;
            let mut run_end = ((sector + 1) * LAZY_SECTOR_BYTES).min(end);
            while run_end < end && (base.present & (1 << (run_end / LAZY_SECTOR_BYTES)) != 0) == here {
                run_end = ((run_end / LAZY_SECTOR_BYTES + 1) * LAZY_SECTOR_BYTES).min(end);
            }
            let out = &mut buf[(at - offset) as usize..(run_end - offset) as usize];
            let (src, valid) = if here { (Some(f), out.len()) } else { (parent.as_ref(), base.len_bytes.saturating_sub(at).min(out.len() as u64) as usize) };
            let got = match src {
                Some(src) => read_full_at(src, &mut out[..valid], SLOT_HEADER_PAGE_BYTES + at)?,
                None => 0,
            };
            out[got..].fill(0);
            at = run_end;
        }
        Ok(())
    }

    /// Gives a fresh slot that got no object back to the pool, with a free header over whatever
    /// got written. If even that fails, the slot stays out of use until the next open sorts it
    /// out.
    fn give_back(&self, slot: SlotRef) {
        if let Ok(w) = self.writer(&slot) {
            if let Ok(slot) = self.commit_header(&w, slot, None) {
                self.index.lock().unwrap().put_free(slot);
            }
        }
    }

    /// An overwrite: the data goes where it is, the header to the other copy, one fdatasync.
    fn apply_in_place(&self, key: ObjKey, e: Entry, version: Version, op: &RepOp) -> io::Result<()> {
        let t = std::time::Instant::now();
        inc(&self.counters.in_place_writes);
        let w = self.writer(&e.slot)?;
        let live = self.read_live(&w.f, &key, &e)?;
        let mut obj = SlotObject {
            file: &w,
            objfmt_header: live.objfmt_header,
            len_bytes: e.len_bytes,
            capacity_bytes: CLASS_DATA_BYTES[e.slot.class],
        };
        objfmt::apply(&mut obj, version, op)?;
        let len_bytes = obj.len_bytes;
        let object = LiveObject { key, len_bytes, objfmt_header: obj.objfmt_header, base: None };
        let slot = self.commit_header(&w, e.slot, Some(object))?;
        self.index.lock().unwrap().insert(key, Entry { slot, len_bytes, base: None });
        add_us(&self.counters.in_place_us, t);
        Ok(())
    }

    /// An object's header and bytes, in memory.
    fn load(&self, key: &ObjKey, e: &Entry) -> io::Result<MemObject> {
        let f = self.open_slot(&e.slot)?;
        let live = self.read_live(&f, key, e)?;
        let body = if e.base.is_some() {
            let mut body = vec![0u8; e.len_bytes as usize];
            self.read_body_at(&f, e, &mut body, 0)?;
            body
        } else {
            // Read into uninitialised capacity ([`SlotFile::read_vec`]).
            let mut body = f.read_vec(SLOT_HEADER_PAGE_BYTES, e.len_bytes)?;
            body.resize(e.len_bytes as usize, 0); // a short slot file: missing bytes read as zeroes
            body
        };
        Ok(MemObject { objfmt_header: live.objfmt_header, body })
    }

    /// Writes an object built in memory into a free slot (the smallest class it fits) and enters
    /// it in the index, replacing any entry of its key (whose slot the caller then frees).
    fn write_fresh(&self, key: ObjKey, obj: MemObject) -> io::Result<()> {
        self.write_fresh_as(key, obj, false)
    }

    /// [`Inner::write_fresh`]; `child_first_write` as for [`Inner::take_slot`].
    fn write_fresh_as(&self, key: ObjKey, obj: MemObject, child_first_write: bool) -> io::Result<()> {
        let len_bytes = obj.body.len() as u64;
        let class = class_for(len_bytes).ok_or_else(|| invalid(format!("object {key:?} larger than 4 MiB")))?;
        let slot = self.take_slot(class, child_first_write)?;
        let written = (|| {
            let w = self.writer(&slot)?;
            w.write_all_at(&obj.body, SLOT_HEADER_PAGE_BYTES)?;
            let object = LiveObject { key, len_bytes, objfmt_header: obj.objfmt_header, base: None };
            self.commit_header(&w, slot, Some(object))
        })();
        match written {
            Ok(slot) => {
                self.index.lock().unwrap().insert(key, Entry { slot, len_bytes, base: None });
                Ok(())
            }
            Err(e) => {
                self.give_back(slot);
                Err(e)
            }
        }
    }

    /// Writes a free header into a slot (durably) and puts it on its free list.
    fn free_slot(&self, slot: SlotRef) -> io::Result<()> {
        let w = self.writer(&slot)?;
        let slot = self.commit_header(&w, slot, None)?;
        let mut idx = self.index.lock().unwrap();
        idx.put_free(slot);
        let over = idx.free[slot.class].len() > self.pool.free_slots_max[slot.class];
        drop(idx);
        if over {
            self.wake_refill();
        }
        Ok(())
    }

    fn delete(&self, key: ObjKey) -> io::Result<()> {
        self.complete_children_of(&key)?;
        let Some(e) = self.index.lock().unwrap().remove(&key) else { return Ok(()) };
        self.free_slot(e.slot).inspect_err(|_| {
            // Not durably freed: as far as anyone knows the object is still there.
            self.index.lock().unwrap().insert(key, e);
        })
    }

    fn rename(&self, from: ObjKey, to: ObjKey) -> io::Result<()> {
        // Both objects' dependents keep their bytes, and the renamed object is whole.
        self.complete_children_of(&from)?;
        self.complete_children_of(&to)?;
        self.complete(from)?;
        let e = self.entry(&from).ok_or_else(|| not_found(&from))?;
        let w = self.writer(&e.slot)?;
        let mut live = self.read_live(&w.f, &from, &e)?;
        live.key = to;
        let slot = self.commit_header(&w, e.slot, Some(live))?;
        let replaced = {
            let mut idx = self.index.lock().unwrap();
            idx.remove(&from);
            idx.insert(to, Entry { slot, len_bytes: e.len_bytes, base: None })
        };
        // An object already named `to` is replaced (as a file rename would). Its slot is freed
        // after the rename is durable; a crash in between leaves two claims, and open keeps the
        // newer, renamed one.
        match replaced {
            Some(old) => self.free_slot(old.slot),
            None => Ok(()),
        }
    }

    /// Pre-stocking for a new `super` child of `parent`: the child's first write to each of
    /// the parent's objects here takes a free slot of the class the parent object sits in (a
    /// deferred copy of a 64 KiB-class object, a whole copy of a bigger one), so each class
    /// reserves as many slots as there are such parent objects (at most
    /// [`PoolOptions::reserved_slots_max`]). Free slots the pool holds move into the reservation
    /// at once (in memory); the refill is woken to make the rest, and to restock the free list.
    /// Costs one pass over the index, off the write path.
    fn prestock(&self, table: TableId, parent: VolId) {
        let mut want = [0usize; CLASSES];
        {
            let mut idx = self.index.lock().unwrap();
            for (k, e) in &idx.objects {
                if k.table == table && k.owner == parent && k.objno != TRACK_OBJNO {
                    want[e.slot.class] += 1;
                }
            }
            for (class, &n) in want.iter().enumerate() {
                if n == 0 {
                    continue;
                }
                let t = n.min(self.pool.reserved_slots_max[class]);
                idx.in_use[class] = true;
                idx.reserved[class] = idx.reserved[class].max(t);
                idx.reserved_touched_us[class] = self.now_us();
                idx.rebalance_reserve(class);
            }
        }
        self.prestocks.fetch_add(1, Ordering::Relaxed);
        self.wake_refill();
    }

    fn now_us(&self) -> u64 {
        (self.opened.elapsed().as_micros() as u64).max(1)
    }

    /// A free slot of `class`: from the pool, else created now (the slow path), else — on a
    /// full disk — a free slot of a bigger class, or one set aside for children.
    /// `child_first_write`: for a `super` child's first write to an object, which takes a slot
    /// of the reservation ([`Index::reserved_free`]) if there is one ready, and counts one off
    /// the slots owed. Every other allocation leaves the reservation alone.
    fn take_slot(&self, class: usize, child_first_write: bool) -> io::Result<SlotRef> {
        {
            let mut idx = self.index.lock().unwrap();
            idx.in_use[class] = true;
            if child_first_write && idx.reserved[class] > 0 {
                idx.reserved[class] -= 1;
                idx.reserved_touched_us[class] = self.now_us();
                if let Some(slot) = idx.reserved_free[class].pop_back() {
                    inc(&self.counters.slots_from_pool);
                    inc(&self.counters.slots_from_reserve);
                    return Ok(slot);
                }
            }
            if let Some(slot) = idx.free[class].pop_back() {
                inc(&self.counters.slots_from_pool);
                let low = idx.free[class].len() < idx.goal(class, &self.pool.free_slots_max);
                drop(idx);
                if low {
                    self.wake_refill();
                }
                return Ok(slot);
            }
        }
        {
            // The pool was too small for this burst: keep twice as many ready.
            let mut idx = self.index.lock().unwrap();
            idx.target[class] = (idx.target[class] * 2).max(1).min(self.pool.free_slots_max[class]);
            idx.ran_dry[class] = true;
        }
        self.wake_refill();
        let slow = self.slow_allocations.fetch_add(1, Ordering::Relaxed) + 1;
        // At most one line a second: a fill of a new volume runs the pool dry on every write.
        let now_us = (self.opened.elapsed().as_micros() as u64).max(1);
        let logged = self.dry_logged_us.load(Ordering::Relaxed);
        if (logged == 0 || now_us.saturating_sub(logged) >= 1_000_000)
            && self.dry_logged_us.compare_exchange(logged, now_us, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            tracing::info!(class = CLASS_DIR_NAMES[class], slow_allocations = slow, "slot pool ran dry: a write creates its slot itself");
        }
        match self.create_slots(class, 1) {
            Ok(mut made) => {
                inc(&self.counters.write_dir_fsyncs);
                Ok(made.pop().expect("one slot made"))
            }
            Err(e) if is_no_space(&e) => {
                // A write that can still land beats a slot kept for a child that may never
                // write (the refill makes it again once there is space).
                let mut idx = self.index.lock().unwrap();
                (class..CLASSES).find_map(|c| idx.free[c].pop_back().or_else(|| idx.reserved_free[c].pop_back())).ok_or(e)
            }
            Err(e) => Err(e),
        }
    }

    /// Creates `count` slot files of `class`: each written whole (a free header, then zeroes)
    /// and synced, then the directory synced. On any error every file of the batch is removed.
    fn create_slots(&self, class: usize, count: usize) -> io::Result<Vec<SlotRef>> {
        let first_no = {
            let mut idx = self.index.lock().unwrap();
            let no = idx.next_slot_no[class];
            idx.next_slot_no[class] += count as u64;
            no
        };
        let mut page = vec![0u8; SLOT_HEADER_PAGE_BYTES as usize];
        page[..HEADER_COPY_BYTES].copy_from_slice(&SlotHeader { generation: 0, object: None }.encode(class));
        let mut made: Vec<(PathBuf, D::File)> = Vec::with_capacity(count);
        let result = (|| {
            for no in first_no..first_no + count as u64 {
                let path = self.slot_path(class, no);
                let f = self.fs.create_new(&path)?;
                made.push((path, f));
                let f = &made.last().unwrap().1;
                f.write_all_at(&page, 0)?;
                write_zeroes_at(f, SLOT_HEADER_PAGE_BYTES, CLASS_DATA_BYTES[class])?;
            }
            for (_, f) in &made {
                f.start_writeback();
            }
            for (_, f) in &made {
                f.sync()?;
            }
            self.fs.sync_dir(&self.class_dir(class))
        })();
        match result {
            Ok(()) => Ok((first_no..first_no + count as u64).map(|no| SlotRef { class, no, current_copy: 0 }).collect()),
            Err(e) => {
                for (path, _) in &made {
                    let _ = self.fs.remove_file(path);
                }
                Err(e)
            }
        }
    }

    fn wake_refill(&self) {
        if self.pool.background_refill {
            *self.refill_wanted.lock().unwrap() = true;
            self.refill_cv.notify_one();
        }
    }

    fn refill_loop(&self) {
        let mut last_decay = std::time::Instant::now();
        let mut held_back = false;
        loop {
            {
                let wanted = self.refill_wanted.lock().unwrap();
                let period = if held_back { REFILL_YIELD_MS } else { REFILL_PERIOD_MS };
                let (mut wanted, _) = self
                    .refill_cv
                    .wait_timeout_while(wanted, Duration::from_millis(period), |w| {
                        !*w && !self.shutdown.load(Ordering::SeqCst)
                    })
                    .unwrap();
                *wanted = false;
            }
            if self.shutdown.load(Ordering::SeqCst) {
                return;
            }
            if last_decay.elapsed() >= Duration::from_millis(REFILL_PERIOD_MS) {
                last_decay = std::time::Instant::now();
                let mut idx = self.index.lock().unwrap();
                let now_us = self.now_us();
                for class in 0..CLASSES {
                    if !std::mem::take(&mut idx.ran_dry[class]) {
                        let base = self.pool.free_slots_target[class];
                        let t = idx.target[class];
                        idx.target[class] = base.max(t - (t / 4).max(1).min(t));
                    }
                    if idx.reserved[class] > 0 && now_us.saturating_sub(idx.reserved_touched_us[class]) >= RESERVE_IDLE_MS * 1000 {
                        // The ready slots go back to the free list (trimmed to its maximum).
                        idx.reserved[class] = 0;
                        idx.rebalance_reserve(class);
                    }
                }
            }
            held_back = false;
            for class in 0..CLASSES {
                held_back |= self.refill(class);
                self.trim(class);
            }
        }
    }

    /// Whether a write started in the last [`REFILL_YIELD_MS`].
    fn serving_writes(&self) -> bool {
        let last = self.last_write_us.load(Ordering::Relaxed);
        last != 0 && (self.opened.elapsed().as_micros() as u64).saturating_sub(last) < REFILL_YIELD_MS * 1000
    }

    /// Tops up the free slots of a class in use, in batches, while the disk has room to spare.
    /// Returns true if it held back for the shard's writes (see [`REFILL_FLOOR_DIVISOR`]): the
    /// loop then looks again soon.
    fn refill(&self, class: usize) -> bool {
        loop {
            if self.shutdown.load(Ordering::SeqCst) {
                return false;
            }
            // The free list and the reservation (slots set aside for `super` children).
            let (free, target, reserved_free, owed, in_use) = {
                let idx = self.index.lock().unwrap();
                let c = class;
                (idx.free[c].len(), idx.goal(c, &self.pool.free_slots_max), idx.reserved_free[c].len(), idx.reserved[c], idx.in_use[c])
            };
            let need = target.saturating_sub(free) + owed.saturating_sub(reserved_free);
            if !in_use || need == 0 {
                return false;
            }
            let above_floor = |have: usize, goal: usize| have >= goal || have >= (goal / REFILL_FLOOR_DIVISOR).max(1);
            if above_floor(free, target) && above_floor(reserved_free, owed) && self.serving_writes() {
                return true;
            }
            let batch_slots = ((REFILL_BATCH_BYTES / slot_file_bytes(class)).max(1) as usize).min(REFILL_BATCH_MAX_SLOTS);
            let count = need.min(batch_slots);
            let need_bytes = count as u64 * slot_file_bytes(class);
            match self.fs.available_bytes(&self.root) {
                Ok(avail) if avail >= self.pool.reserve_bytes + need_bytes => {}
                Ok(_) => return false, // the disk is nearly full: leave its space to writes
                Err(e) => {
                    tracing::warn!("slot refill cannot check free space: {e}");
                    return false;
                }
            }
            inc(&self.counters.refill_batches);
            if self.serving_writes() {
                inc(&self.counters.refill_batches_while_serving);
            }
            let t = std::time::Instant::now();
            let created = self.create_slots(class, count);
            add_us(&self.counters.refill_us, t);
            match created {
                Ok(made) => {
                    self.counters.refill_slots.fetch_add(made.len() as u64, Ordering::Relaxed);
                    let mut idx = self.index.lock().unwrap();
                    for slot in made {
                        if idx.reserve_deficit(class) > 0 {
                            idx.reserved_free[class].push_front(slot);
                        } else {
                            idx.free[class].push_front(slot);
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!("slot refill of class {} failed: {e}", CLASS_DIR_NAMES[class]);
                    return false;
                }
            }
        }
    }

    /// Deletes free slots beyond the class's maximum. The unlinks need no directory fsync: a
    /// slot whose deletion a crash undoes is just a free slot again.
    fn trim(&self, class: usize) {
        let extra: Vec<SlotRef> = {
            let mut idx = self.index.lock().unwrap();
            let over = idx.free[class].len().saturating_sub(self.pool.free_slots_max[class]);
            idx.free[class].drain(..over).collect()
        };
        for slot in extra {
            if self.journal.is_some() {
                // Its free header may so far be durable only in the journal: were the removal
                // lost in a crash, the file would come back with whatever it held before.
                if let Err(e) = self.fs.open_read(&self.slot_path(slot.class, slot.no)).and_then(|f| f.sync()) {
                    tracing::warn!("cannot sync free slot {} before deleting it: {e}", self.slot_path(slot.class, slot.no).display());
                    self.index.lock().unwrap().free[class].push_front(slot);
                    continue;
                }
            }
            if let Err(e) = self.fs.remove_file(&self.slot_path(slot.class, slot.no)) {
                tracing::warn!("cannot delete free slot {}: {e}", self.slot_path(slot.class, slot.no).display());
            }
        }
    }

    /// Rebuilds the index and free lists from the slot headers.
    fn scan(&self) -> io::Result<()> {
        let mut idx = Index { target: self.pool.free_slots_target, ..Index::default() };
        let mut max_generation = 0;
        // Key → (generation, entry) of the slot that claims it; losers are freed below.
        let mut claims: HashMap<ObjKey, (u64, Entry)> = HashMap::new();
        let mut losers = vec![];
        for class in 0..CLASSES {
            let mut free = vec![];
            for (file_name, path) in self.fs.read_dir(&self.class_dir(class))? {
                let Ok(no) = file_name.parse::<u64>() else {
                    tracing::warn!("ignoring {} (not a slot file)", path.display());
                    continue;
                };
                idx.next_slot_no[class] = idx.next_slot_no[class].max(no + 1);
                idx.in_use[class] = true;
                let f = self.fs.open(&path)?;
                let file_bytes = f.len()?;
                let current = self.read_header(&f, class)?;
                let slot = SlotRef { class, no, current_copy: current.as_ref().map_or(1, |(c, _)| *c) };
                match current {
                    Some((_, SlotHeader { generation, object: Some(o) })) => {
                        max_generation = max_generation.max(generation);
                        if file_bytes < slot_file_bytes(class) {
                            // Never written so; keep the object (its checksums will judge it).
                            tracing::warn!("slot {} is short; extending it", path.display());
                            // With zeroes written, not a hole: every block of a slot file stays
                            // allocated, so writing it never changes metadata (the checkpoint
                            // relies on that).
                            write_zeroes_at(&f, file_bytes, slot_file_bytes(class) - file_bytes)?;
                            f.sync()?;
                        }
                        // Two slots claim one key after a crash in the middle of a move or of a
                        // rename onto an existing key: the higher generation is the newer.
                        let entry = Entry { slot, len_bytes: o.len_bytes, base: o.base };
                        match claims.insert(o.key, (generation, entry)) {
                            Some((g, other)) if g > generation => {
                                claims.insert(o.key, (g, other));
                                losers.push(slot);
                            }
                            Some((_, other)) => losers.push(other.slot),
                            None => {}
                        }
                    }
                    header => {
                        if file_bytes != slot_file_bytes(class) || f.has_hole(file_bytes) {
                            // A creation a crash interrupted: it never held an object.
                            self.fs.remove_file(&path)?;
                            inc(&self.counters.open_partial_slots_removed);
                            continue;
                        }
                        if let Some((_, h)) = header {
                            max_generation = max_generation.max(h.generation);
                        }
                        free.push(slot);
                    }
                }
            }
            free.sort_by_key(|s| std::cmp::Reverse(s.no));
            idx.free[class] = free.into();
        }
        // In key order, so the index (its lists of deferred children) does not depend on the
        // hash map's order: a simulation seed replays the same store operations.
        let mut claims: Vec<(ObjKey, Entry)> = claims.into_iter().map(|(k, (_, e))| (k, e)).collect();
        claims.sort_by_key(|(k, _)| *k);
        for (k, e) in claims {
            idx.insert(k, e);
        }
        self.next_generation.store(max_generation + 1, Ordering::Relaxed);
        *self.index.lock().unwrap() = idx;
        for slot in losers {
            tracing::warn!("slot {} of class {} held an older copy of a moved or renamed object: freeing it", slot.no, CLASS_DIR_NAMES[slot.class]);
            self.free_slot(slot)?;
            inc(&self.counters.open_older_claims_freed);
        }
        Ok(())
    }

    /// Moves objects of the one-file-per-object layout (`objects/<table>/<objno>.<owner>`, an
    /// objfmt file each) into slots, byte for byte with their headers, so a damaged one stays
    /// suspect. Each file is removed once its slot is durable; a crash in between imports it
    /// again and open's duplicate rule keeps the newer slot.
    fn import_one_file_per_object_layout(&self) -> io::Result<()> {
        let old = self.root.join("objects");
        if !self.fs.is_dir(&old) {
            return Ok(());
        }
        for (table_name, table_path) in self.fs.read_dir(&old)? {
            let Ok(table) = u64::from_str_radix(&table_name, 16) else { continue };
            for (name, path) in self.fs.read_dir(&table_path)? {
                let key = name.split_once('.').and_then(|(objno, owner)| {
                    Some(ObjKey {
                        table,
                        objno: u64::from_str_radix(objno, 16).ok()?,
                        owner: u64::from_str_radix(owner, 16).ok()?,
                    })
                });
                if let Some(key) = key {
                    let f = self.fs.open_read(&path)?;
                    let body_bytes = f.len()?.saturating_sub(HEADER_BYTES);
                    if body_bytes > MAX_OBJECT_SIZE_BYTES as u64 {
                        tracing::warn!("{} is larger than any object: left in place", path.display());
                        continue;
                    }
                    let mut objfmt_header = [0u8; HEADER_COPY_BYTES];
                    read_full_at(&f, &mut objfmt_header, 0)?;
                    if objfmt::Header::decode(&objfmt_header).is_none() {
                        // A torn header: the object is kept, as suspect.
                        objfmt_header = objfmt::Header { version: objfmt::SUSPECT, crcs: vec![] }.encode();
                    }
                    let mut body = vec![0u8; body_bytes as usize];
                    read_full_at(&f, &mut body, HEADER_BYTES)?;
                    self.write_fresh(key, MemObject { objfmt_header, body })?;
                }
                // Objects imported, and leftover temporaries of an interrupted copy.
                self.fs.remove_file(&path)?;
            }
            self.fs.remove_dir(&table_path)?;
        }
        self.fs.remove_dir(&old)?;
        self.fs.sync_dir(&self.root)
    }

    fn boot(&self) -> io::Result<Boot> {
        let mut boot = Boot::default();
        let mut entries: Vec<(ObjKey, Entry)> =
            self.index.lock().unwrap().objects.iter().map(|(k, e)| (*k, *e)).collect();
        entries.sort_by_key(|(k, _)| *k);
        for (key, e) in entries {
            let version = if e.base.is_some() {
                // A deferred copy: its checksums cover the bytes merged with the parent's.
                objfmt::verify(&mut self.load(&key, &e)?)?
            } else {
                // Read only: no journal record.
                let w = SlotWriter { f: self.open_slot(&e.slot)?, slot: e.slot, pending: None };
                let live = self.read_live(&w.f, &key, &e)?;
                objfmt::verify(&mut SlotObject {
                    file: &w,
                    objfmt_header: live.objfmt_header,
                    len_bytes: e.len_bytes,
                    capacity_bytes: CLASS_DATA_BYTES[e.slot.class],
                })?
            };
            if version == objfmt::SUSPECT {
                tracing::warn!("object {key:?} does not match its checksums (interrupted write): it will be re-replicated");
            }
            boot.objects.push((key, version));
            if key.objno == TRACK_OBJNO && version != objfmt::SUSPECT {
                boot.track_objects.push((key, self.load(&key, &e)?.body));
            }
        }
        match self.fs.read(&self.root.join("state")) {
            Ok(b) => boot.state = Some(b),
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        Ok(boot)
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
mod tests {
    use super::*;
    use std::fs::{self, File, OpenOptions};
    use std::io::Write;
    use std::time::Instant;

    fn key(objno: u64, owner: u64) -> ObjKey {
        ObjKey { table: 7, objno, owner }
    }

    fn v(seq: u64) -> Version {
        Version { epoch: 1, seq }
    }

    /// No background refill: slot counts are exact.
    fn quiet() -> PoolOptions {
        PoolOptions { background_refill: false, journal_capacity_bytes: Some(crate::store::journal::MIN_CAPACITY_BYTES), ..PoolOptions::default() }
    }

    fn no_journal() -> PoolOptions {
        PoolOptions { journal_capacity_bytes: None, ..quiet() }
    }

    fn write(s: &FileStore, k: ObjKey, seq: u64, offset: u32, data: Vec<u8>) {
        s.run(DiskCmd::Apply { key: k, version: v(seq), op: RepOp::Write { offset, data }, cow_from: None }).unwrap();
    }

    fn read(s: &FileStore, k: ObjKey, offset: u32, len: u32) -> Vec<u8> {
        let DiskOut::Data(d) = s.run(DiskCmd::Read { key: k, offset, len }).unwrap() else { panic!() };
        d
    }

    fn read_all(s: &FileStore, k: ObjKey) -> Vec<u8> {
        let DiskOut::Data(d) = s.run(DiskCmd::ReadAll { key: k }).unwrap() else { panic!() };
        d
    }

    fn reopen_boot(dir: &Path) -> Boot {
        FileStore::open_with(dir, false, quiet()).unwrap().boot().unwrap()
    }

    /// The object a crash-test writer ([`journal_crash_writer`]) leaves after `seq` writes.
    fn crash_model(objno: u64, seq: u64) -> Vec<u8> {
        let mut obj = vec![objno as u8; 65536];
        for s in 2..=seq {
            let at = (s as usize * 4096) % 65536;
            obj[at..at + 4096].fill((objno * 7 + s) as u8);
        }
        obj
    }

    const CRASH_DIR_ENV: &str = "UNDERSTUDY_JOURNAL_CRASH_DIR";
    const CRASH_WRITERS: u64 = 6;
    const CRASH_OBJECTS_PER_WRITER: u64 = 24;

    /// Run as a child process by [`a_shard_store_killed_mid_burst_keeps_every_acknowledged_write`]
    /// (does nothing otherwise): writers append to objects of their own, one write in flight
    /// each, printing every acknowledged write, until the parent SIGKILLs the process.
    #[test]
    fn journal_crash_writer() {
        let Ok(dir) = std::env::var(CRASH_DIR_ENV) else { return };
        let s = Arc::new(FileStore::open_with(Path::new(&dir), true, quiet()).unwrap());
        let out = Arc::new(Mutex::new(std::io::stdout()));
        let threads: Vec<_> = (0..CRASH_WRITERS)
            .map(|t| {
                let (s, out) = (s.clone(), out.clone());
                std::thread::spawn(move || {
                    for seq in 1u64.. {
                        for i in 0..CRASH_OBJECTS_PER_WRITER {
                            let objno = t * CRASH_OBJECTS_PER_WRITER + i;
                            let op = if seq == 1 {
                                RepOp::Put { data: crash_model(objno, 1) }
                            } else {
                                let at = (seq as usize * 4096) % 65536;
                                RepOp::Write { offset: at as u32, data: vec![(objno * 7 + seq) as u8; 4096] }
                            };
                            s.run(DiskCmd::Apply { key: key(objno, 1), version: v(seq), op, cow_from: None }).unwrap();
                            let mut o = out.lock().unwrap();
                            writeln!(o, "acked {objno} {seq}").unwrap();
                            o.flush().unwrap();
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }

    /// A real process writing through the journal is SIGKILLed mid-burst. To stand for a power
    /// loss (which SIGKILL is not: the page cache survives), every slot byte the journal's
    /// records still cover is then overwritten with garbage — as if those writes never reached
    /// the slot files — and a torn record is put at the journal's end. Reopened, the store must
    /// hold every acknowledged write (and at most the one unacknowledged write per object that
    /// was in flight), with no object suspect, and keep working. It failed about one run in six
    /// while the journal was write-behind (a write in flight at the kill had bytes in its slot
    /// and no record to redo them).
    #[test]
    fn a_shard_store_killed_mid_burst_keeps_every_acknowledged_write() {
        let dir = tempdir();
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "store::tests::journal_crash_writer", "--nocapture", "--test-threads=1"])
            .env(CRASH_DIR_ENV, &dir)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let count = Arc::new(AtomicU64::new(0));
        let counted = count.clone();
        let reader = std::thread::spawn(move || {
            let mut acked: HashMap<u64, u64> = HashMap::new();
            let mut lines = 0;
            for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
                let Ok(line) = line else { break };
                let mut w = line.split_whitespace();
                if w.next() == Some("acked") {
                    let objno: u64 = w.next().unwrap().parse().unwrap();
                    let seq: u64 = w.next().unwrap().parse().unwrap();
                    acked.insert(objno, seq);
                    lines += 1;
                    counted.store(lines, Ordering::Relaxed);
                }
            }
            (acked, lines)
        });
        // Kill once enough writes went through for the journal to have been checkpointed (the
        // first writes alone, whole objects, fill more than a quarter of it).
        let deadline = Instant::now() + Duration::from_secs(20);
        let journal = dir.join(JOURNAL_FILE);
        while count.load(Ordering::Relaxed) < 1500 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            if let Ok(Some(status)) = child.try_wait() {
                panic!("the writer exited early: {status}");
            }
        }
        child.kill().unwrap();
        child.wait().unwrap();
        let (acked, lines) = reader.join().unwrap();
        assert!(lines > 200, "only {lines} writes were acknowledged before the kill");

        // The power loss: what the journal covers never reached the slot files.
        let f = OpenOptions::new().read(true).write(true).open(&journal).unwrap();
        let replay = crate::store::journal::Journal::open(f).unwrap();
        assert!(!replay.payloads.is_empty(), "the journal held no records at the kill");
        for p in &replay.payloads {
            for (key, offset, len, _) in decode_writes(p).unwrap() {
                let (class, no) = slot_of_key(key);
                if let Ok(f) = OpenOptions::new().write(true).open(slot_path_in(&dir, class, no)) {
                    f.write_all_at(&vec![0xa5; len as usize], offset).unwrap();
                }
            }
        }
        // A torn last record: a whole header, half its payload.
        let ((end, boot), cap) = (replay.end(), replay.capacity());
        let payload = vec![0x5a; 4096];
        let mut torn = crate::store::journal::record_header(crate::store::journal::KIND_DATA, boot, end, &payload).to_vec();
        torn.extend_from_slice(&payload[..2048]);
        let jf = OpenOptions::new().write(true).open(&journal).unwrap();
        if cap - end % cap >= torn.len() as u64 {
            jf.write_all_at(&torn, crate::store::journal::HEADER_PAGE_BYTES + end % cap).unwrap();
        }
        drop((replay, jf));

        let s = FileStore::open_with(&dir, false, quiet()).unwrap();
        let boot = s.boot().unwrap();
        let versions: HashMap<ObjKey, Version> = boot.objects.iter().copied().collect();
        for (&objno, &seq) in &acked {
            let got = versions.get(&key(objno, 1)).copied().unwrap_or_else(|| panic!("object {objno} is gone"));
            assert!(got == v(seq) || got == v(seq + 1), "object {objno}: acknowledged seq {seq}, found {got:?}");
            assert_eq!(read_all(&s, key(objno, 1)), crash_model(objno, got.seq), "object {objno} at seq {}", got.seq);
        }
        // The store goes on: a write after the replay survives another reopen.
        write(&s, key(0, 1), 1_000_000, 0, vec![9; 4096]);
        drop(s);
        let s = FileStore::open_with(&dir, false, quiet()).unwrap();
        assert_eq!(read(&s, key(0, 1), 0, 4096), vec![9; 4096]);
        drop(s);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// The store's crash rules on the simulator's disk, at every point of a command: the power
    /// is cut after each possible number of the command's disk operations, the disk crashes
    /// (losing or tearing what was not synced, several ways each), and the store reopens. An
    /// object a command did not touch is intact; the one it touched is old, new or suspect
    /// (never gone with a torn header); a move keeps one copy; a delete or rename leaves the
    /// old state or the new; a deferred copy's bytes survive every change to its parent.
    #[test]
    fn a_power_cut_anywhere_in_a_command_keeps_the_stores_crash_rules() {
        let (p, c, q, small) = (key(1, 1), key(1, 2), key(1, 3), key(2, 1));
        let p0: Vec<u8> = (0..16384u32).map(|i| (i % 251) as u8).collect();
        let patch = |base: &[u8], at: usize, data: &[u8]| {
            let mut b = base.to_vec();
            b.resize(b.len().max(at + data.len()), 0);
            b[at..at + data.len()].copy_from_slice(data);
            b
        };
        let wr = |k: ObjKey, seq: u64, offset: u32, data: Vec<u8>, cow_from: Option<ObjKey>| DiskCmd::Apply {
            key: k,
            version: v(seq),
            op: RepOp::Write { offset, data },
            cow_from,
        };
        let c1 = patch(&p0, 0, &[0xcc; 2048]);
        // (name, acknowledged setup, the command cut short, the check after the crash)
        type Check = Box<dyn Fn(&HashMap<ObjKey, (Version, Vec<u8>)>) -> Result<(), String>>;
        let intact = |k: ObjKey, ver: Version, bytes: Vec<u8>| {
            move |objs: &HashMap<ObjKey, (Version, Vec<u8>)>| match objs.get(&k) {
                Some((v, b)) if *v == ver && *b == bytes => Ok(()),
                other => Err(format!("{k:?} should be intact at {ver:?}, is {:?}", other.map(|(v, b)| (v, b.len())))),
            }
        };
        let old_new_or_suspect = |k: ObjKey, old: Option<(Version, Vec<u8>)>, new: (Version, Vec<u8>)| {
            move |objs: &HashMap<ObjKey, (Version, Vec<u8>)>| match (objs.get(&k), &old) {
                (Some((v, _)), _) if *v == objfmt::SUSPECT => Ok(()),
                (Some(x), _) if *x == new => Ok(()),
                (Some(x), Some(o)) if x == o => Ok(()),
                (None, None) => Ok(()),
                (x, _) => Err(format!("{k:?} is neither old, new nor suspect: {:?}", x.map(|(v, b)| (v, b.len())))),
            }
        };
        let scenarios: Vec<(&str, Vec<DiskCmd>, DiskCmd, Vec<Check>)> = vec![
            (
                "overwrite in place",
                vec![wr(p, 1, 0, p0.clone(), None)],
                wr(p, 2, 4096, vec![0xbb; 4096], None),
                vec![Box::new(old_new_or_suspect(p, Some((v(1), p0.clone())), (v(2), patch(&p0, 4096, &[0xbb; 4096]))))],
            ),
            (
                "move to a bigger class",
                vec![wr(small, 1, 0, vec![5; 2048], None), wr(p, 1, 0, p0.clone(), None)],
                wr(small, 2, 8192, vec![6; 4096], None),
                vec![
                    Box::new(old_new_or_suspect(small, Some((v(1), vec![5; 2048])), (v(2), patch(&[5; 2048], 8192, &[6; 4096])))),
                    Box::new(intact(p, v(1), p0.clone())),
                ],
            ),
            (
                "delete",
                vec![wr(p, 1, 0, p0.clone(), None), wr(small, 1, 0, vec![5; 2048], None)],
                DiskCmd::Delete { key: p },
                vec![
                    Box::new({
                        let p0 = p0.clone();
                        move |o: &HashMap<ObjKey, (Version, Vec<u8>)>| match o.get(&p) {
                            None => Ok(()),
                            Some(_) => intact(p, v(1), p0.clone())(o),
                        }
                    }),
                    Box::new(intact(small, v(1), vec![5; 2048])),
                ],
            ),
            (
                "rename",
                vec![wr(p, 1, 0, p0.clone(), None)],
                DiskCmd::Rename { from: p, to: q },
                vec![Box::new({
                    let p0 = p0.clone();
                    move |o: &HashMap<ObjKey, (Version, Vec<u8>)>| match (o.contains_key(&p), o.contains_key(&q)) {
                        (true, false) => intact(p, v(1), p0.clone())(o),
                        (false, true) => intact(q, v(1), p0.clone())(o),
                        both => Err(format!("rename left (from, to) = {both:?}")),
                    }
                })],
            ),
            (
                "a child's first write (a deferred copy)",
                vec![wr(p, 1, 0, p0.clone(), None)],
                wr(c, 2, 0, vec![0xcc; 2048], Some(p)),
                vec![Box::new(intact(p, v(1), p0.clone())), Box::new(old_new_or_suspect(c, None, (v(2), c1.clone())))],
            ),
            (
                "a parent write completes its deferred child first",
                vec![wr(p, 1, 0, p0.clone(), None), wr(c, 2, 0, vec![0xcc; 2048], Some(p))],
                wr(p, 3, 8192, vec![0xdd; 4096], None),
                vec![
                    Box::new(intact(c, v(2), c1.clone())),
                    Box::new(old_new_or_suspect(p, Some((v(1), p0.clone())), (v(3), patch(&p0, 8192, &[0xdd; 4096])))),
                ],
            ),
            (
                "a parent delete completes its deferred child first",
                vec![wr(p, 1, 0, p0.clone(), None), wr(c, 2, 0, vec![0xcc; 2048], Some(p))],
                DiskCmd::Delete { key: p },
                vec![Box::new(intact(c, v(2), c1.clone()))],
            ),
        ];
        let mut crashes = 0;
        for (name, setup, cmd, checks) in &scenarios {
            for cut_after in 0.. {
                let mut cut = false;
                for seed in 0..4 {
                    let fs = SimFs::new();
                    let store = FileStore::simulated(fs.clone()).unwrap();
                    for s in setup {
                        store.run(s.clone()).unwrap();
                    }
                    fs.cut_power_after(cut_after);
                    let _ = store.run(cmd.clone());
                    cut = fs.power_is_cut();
                    drop(store);
                    fs.crash(&mut sim::SimRng::new(seed));
                    crashes += 1;
                    let store = FileStore::simulated(fs.clone()).unwrap_or_else(|e| panic!("{name}, cut after {cut_after}: open: {e}"));
                    let boot = store.boot().unwrap_or_else(|e| panic!("{name}, cut after {cut_after}: boot: {e}"));
                    let objs: HashMap<ObjKey, (Version, Vec<u8>)> = boot
                        .objects
                        .iter()
                        .map(|(k, ver)| {
                            let DiskOut::Data(b) = store.run(DiskCmd::ReadAll { key: *k }).unwrap() else { panic!() };
                            (*k, (*ver, b))
                        })
                        .collect();
                    for check in checks {
                        check(&objs).unwrap_or_else(|e| panic!("{name}, power cut after {cut_after} operations, crash seed {seed}: {e}"));
                    }
                    // The store goes on working after its recovery.
                    store.run(wr(key(9, 9), 1, 0, vec![1; 100], None)).unwrap_or_else(|e| panic!("{name}: a write after recovery: {e:?}"));
                }
                if !cut {
                    break; // the command ran whole: every point of it was cut
                }
            }
        }
        assert!(crashes > 100, "only {crashes} crashes");
    }

    #[test]
    fn write_read_cow_rename_delete_and_boot() {
        let dir = tempdir();
        let s = FileStore::open(&dir, true).unwrap();
        let v1 = Version { epoch: 1, seq: 1 };
        s.run(DiskCmd::Apply { key: key(0, 1), version: v1, op: RepOp::Write { offset: 10, data: vec![5; 4] }, cow_from: None }).unwrap();
        let DiskOut::Data(d) = s.run(DiskCmd::Read { key: key(0, 1), offset: 8, len: 8 }).unwrap() else { panic!() };
        assert_eq!(d, vec![0, 0, 5, 5, 5, 5, 0, 0]);
        // Copy-on-write into the child, then write: the parent is untouched.
        let v2 = Version { epoch: 1, seq: 1 };
        s.run(DiskCmd::Apply { key: key(0, 2), version: v2, op: RepOp::Write { offset: 11, data: vec![9] }, cow_from: Some(key(0, 1)) }).unwrap();
        let DiskOut::Data(c) = s.run(DiskCmd::ReadAll { key: key(0, 2) }).unwrap() else { panic!() };
        assert_eq!(&c[10..14], &[5, 9, 5, 5]);
        let DiskOut::Data(p) = s.run(DiskCmd::ReadAll { key: key(0, 1) }).unwrap() else { panic!() };
        assert_eq!(&p[10..14], &[5, 5, 5, 5]);
        s.run(DiskCmd::Apply { key: key(0, 2), version: Version { epoch: 1, seq: 2 }, op: RepOp::Zero { offset: 10, len: 2 }, cow_from: None }).unwrap();
        let DiskOut::Data(c) = s.run(DiskCmd::Read { key: key(0, 2), offset: 10, len: 4 }).unwrap() else { panic!() };
        assert_eq!(c, vec![0, 0, 5, 5]);
        s.run(DiskCmd::Delete { key: key(0, 1) }).unwrap();
        s.run(DiskCmd::Rename { from: key(0, 2), to: key(0, 3) }).unwrap();
        s.run(DiskCmd::SaveState { seq: 2, bytes: vec![1, 2] }).unwrap();
        s.run(DiskCmd::SaveState { seq: 1, bytes: vec![9] }).unwrap();
        drop(s);
        let boot = FileStore::open(&dir, false).unwrap().boot().unwrap();
        assert_eq!(boot.objects, vec![(key(0, 3), Version { epoch: 1, seq: 2 })]);
        assert_eq!(boot.state, Some(vec![1, 2]));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_directory_is_a_clear_error() {
        let err = FileStore::open(Path::new("/nonexistent/understudy-shard"), false).err().unwrap();
        assert!(err.contains("does not exist"), "{err}");
    }

    #[test]
    fn boot_after_reopen_finds_every_object_with_its_version() {
        let dir = tempdir();
        let s = FileStore::open_with(&dir, true, quiet()).unwrap();
        let mut want = vec![];
        // Objects of every class, some rewritten, some deleted, a Put, a tracking object.
        for i in 0..20u64 {
            let len = [100usize, 5000, 70_000, 2_000_000][i as usize % 4];
            write(&s, key(i, 1), 10 + i, 0, vec![i as u8 + 1; len]);
            if i % 3 == 0 {
                write(&s, key(i, 1), 100 + i, 7, vec![0xee; 10]);
            }
            if i % 5 == 4 {
                s.run(DiskCmd::Delete { key: key(i, 1) }).unwrap();
                continue;
            }
            want.push((key(i, 1), v(if i % 3 == 0 { 100 + i } else { 10 + i })));
        }
        let track = ObjKey { table: 7, objno: TRACK_OBJNO, owner: 0 };
        s.run(DiskCmd::Apply { key: track, version: v(5), op: RepOp::Put { data: vec![1, 2, 3] }, cow_from: None }).unwrap();
        want.push((track, v(5)));
        want.sort();
        drop(s);
        let boot = reopen_boot(&dir);
        assert_eq!(boot.objects, want);
        assert_eq!(boot.track_objects, vec![(track, vec![1, 2, 3])]);
        // And the contents survived.
        let s = FileStore::open_with(&dir, false, quiet()).unwrap();
        assert_eq!(read(&s, key(1, 1), 0, 8), vec![2; 8]);
        assert_eq!(read(&s, key(3, 1), 5, 4), vec![4, 4, 0xee, 0xee]);
        assert_eq!(read_all(&s, key(2, 1)).len(), 70_000);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn cow_into_a_fresh_slot_leaves_the_parent_untouched() {
        let dir = tempdir();
        let s = FileStore::open_with(&dir, true, quiet()).unwrap();
        let parent: Vec<u8> = (0..65536u32).map(|i| (i % 253) as u8).collect();
        s.run(DiskCmd::Apply { key: key(3, 1), version: v(1), op: RepOp::Put { data: parent.clone() }, cow_from: None }).unwrap();
        let (pclass, ppath) = s.slot_of(&key(3, 1)).unwrap();
        let parent_file = fs::read(&ppath).unwrap();
        s.run(DiskCmd::Apply { key: key(3, 2), version: v(2), op: RepOp::Write { offset: 4096, data: vec![0xab; 4096] }, cow_from: Some(key(3, 1)) }).unwrap();
        let (cclass, cpath) = s.slot_of(&key(3, 2)).unwrap();
        assert_ne!(cpath, ppath);
        assert_eq!(cclass, pclass);
        assert_eq!(fs::read(&ppath).unwrap(), parent_file, "the parent's slot file changed");
        let mut want = parent.clone();
        want[4096..8192].fill(0xab);
        assert_eq!(read_all(&s, key(3, 2)), want);
        assert_eq!(read_all(&s, key(3, 1)), parent);
        // A later parent write does not show in the child.
        write(&s, key(3, 1), 3, 0, vec![1; 10]);
        assert_eq!(read(&s, key(3, 2), 0, 2), parent[..2].to_vec());
        // A COW from a parent shorter than the write extends the copy.
        write(&s, key(4, 1), 1, 0, vec![7; 10]);
        s.run(DiskCmd::Apply { key: key(4, 2), version: v(2), op: RepOp::Write { offset: 100_000, data: vec![8; 10] }, cow_from: Some(key(4, 1)) }).unwrap();
        let c = read_all(&s, key(4, 2));
        assert_eq!((c.len(), &c[..10], c[50_000], &c[100_000..]), (100_010, &[7u8; 10][..], 0, &[8u8; 10][..]));
        // A COW from a missing parent is an error and creates nothing.
        assert!(s.run(DiskCmd::Apply { key: key(5, 2), version: v(2), op: RepOp::Write { offset: 0, data: vec![1] }, cow_from: Some(key(5, 1)) }).is_err());
        assert!(s.slot_of(&key(5, 2)).is_none());
        drop(s);
        let boot = reopen_boot(&dir);
        assert_eq!(boot.objects, vec![(key(3, 1), v(3)), (key(3, 2), v(2)), (key(4, 1), v(1)), (key(4, 2), v(2))]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn objects_grow_across_classes_and_free_their_old_slots() {
        let dir = tempdir();
        let s = FileStore::open_with(&dir, true, quiet()).unwrap();
        write(&s, key(1, 1), 1, 0, vec![1; 100]);
        assert_eq!(s.slot_of(&key(1, 1)).unwrap().0, 0);
        // Stale bytes of an earlier object in the reused slot must not show through a gap.
        write(&s, key(2, 1), 1, 0, vec![0xff; 4096]);
        s.run(DiskCmd::Delete { key: key(2, 1) }).unwrap();
        write(&s, key(2, 1), 2, 0, vec![2; 10]);
        write(&s, key(2, 1), 3, 20, vec![3; 10]);
        assert_eq!(read(&s, key(2, 1), 0, 40), [vec![2; 10], vec![0; 10], vec![3; 10], vec![0; 10]].concat());
        // 4 KiB → 1 MiB → 4 MiB.
        write(&s, key(1, 1), 2, 200_000, vec![2; 10]);
        assert_eq!(s.slot_of(&key(1, 1)).unwrap().0, 2);
        write(&s, key(1, 1), 3, 4 * 1024 * 1024 - 10, vec![3; 10]);
        assert_eq!(s.slot_of(&key(1, 1)).unwrap().0, 3);
        let body = read_all(&s, key(1, 1));
        assert_eq!(body.len(), 4 << 20);
        assert_eq!((&body[..100], body[100], &body[200_000..200_010], &body[(4 << 20) - 10..]), (&[1u8; 100][..], 0, &[2u8; 10][..], &[3u8; 10][..]));
        // A whole-object Put into a small object moves it in one step; a shorter Put does not
        // move it back, and bytes past the new length read as zeroes.
        s.run(DiskCmd::Apply { key: key(2, 1), version: v(4), op: RepOp::Put { data: vec![9; 65536] }, cow_from: None }).unwrap();
        assert_eq!(s.slot_of(&key(2, 1)).unwrap().0, 1);
        s.run(DiskCmd::Apply { key: key(2, 1), version: v(5), op: RepOp::Put { data: vec![6; 5] }, cow_from: None }).unwrap();
        assert_eq!(s.slot_of(&key(2, 1)).unwrap().0, 1);
        assert_eq!(read(&s, key(2, 1), 0, 8), vec![6, 6, 6, 6, 6, 0, 0, 0]);
        assert_eq!(read_all(&s, key(2, 1)), vec![6; 5]);
        // Too big for any slot: refused, nothing changed.
        assert!(s.run(DiskCmd::Apply { key: key(2, 1), version: v(6), op: RepOp::Write { offset: 4 << 20, data: vec![1] }, cow_from: None }).is_err());
        // The slots left behind are free: 4 KiB (key 1, then key 2's), 1 MiB.
        let st = s.pool_stats();
        assert_eq!((st.free_slots, st.live_objects), ([2, 0, 1, 0], 2));
        assert_eq!(s.slot_files(), 5);
        drop(s);
        assert_eq!(reopen_boot(&dir).objects, vec![(key(1, 1), v(3)), (key(2, 1), v(5))]);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Without the journal, each write's own fdatasync is all there is: slot bytes or headers lost
    /// or torn in a crash show as suspect objects. With it, the same damage is repaired from the
    /// journal's records at open (every one of those writes was acknowledged).
    #[test]
    fn torn_writes_are_suspect_after_boot_without_a_journal_and_repaired_with_one() {
        for journal in [false, true] {
            torn_writes(journal);
        }
    }

    fn torn_writes(journal: bool) {
        let dir = tempdir();
        let s = FileStore::open_with(&dir, true, if journal { quiet() } else { no_journal() }).unwrap();
        for i in 0..5 {
            s.run(DiskCmd::Apply { key: key(i, 1), version: v(1), op: RepOp::Put { data: vec![i as u8; 65536] }, cow_from: None }).unwrap();
        }
        let path = |k| s.slot_of(&key(k, 1)).unwrap().1;
        let before: Vec<Vec<u8>> = (0..5).map(|i| fs::read(path(i)).unwrap()).collect();
        for i in 0..5 {
            write(&s, key(i, 1), 2, 8192, vec![0x55; 4096]);
        }
        let page = SLOT_HEADER_PAGE_BYTES as usize;
        let patch = |k: u64, at: usize, bytes: &[u8]| {
            let f = OpenOptions::new().write(true).open(path(k)).unwrap();
            f.write_all_at(bytes, at as u64).unwrap();
        };
        // 0: a data byte flipped (lost or torn data under a kept header).
        patch(0, page + 9000, &[0x54]);
        // 1: the old header page restored (the new header lost, the new data kept).
        patch(1, 0, &before[1][..page]);
        // 2: the old data restored (the new data lost, the new header kept).
        patch(2, page + 8192, &before[2][page + 8192..page + 12288]);
        // 3: the newest header copy torn: the older copy still names the object, whose bytes
        //    no longer match it.
        let f = File::open(path(3)).unwrap();
        let (copy, _) = s.inner.read_header(&f, 1).unwrap().unwrap();
        patch(3, copy as usize * HEADER_COPY_BYTES + 100, &[0xde, 0xad]);
        // 4: untouched.
        drop(s);
        let boot = FileStore::open_with(&dir, false, if journal { quiet() } else { no_journal() }).unwrap().boot().unwrap();
        let s = if journal { v(2) } else { objfmt::SUSPECT };
        assert_eq!(boot.objects, vec![(key(0, 1), s), (key(1, 1), s), (key(2, 1), s), (key(3, 1), s), (key(4, 1), v(2))], "journal: {journal}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_crash_between_a_move_and_freeing_the_old_slot_keeps_the_newer_copy() {
        let dir = tempdir();
        let s = FileStore::open_with(&dir, true, quiet()).unwrap();
        write(&s, key(2, 1), 1, 0, vec![3; 10]);
        write(&s, key(2, 2), 1, 0, vec![4; 10]);
        write(&s, key(1, 1), 1, 0, vec![1; 100]);
        let (_, small) = s.slot_of(&key(1, 1)).unwrap();
        let small_before = fs::read(&small).unwrap();
        write(&s, key(1, 1), 2, 10_000, vec![2; 100]);
        // The old slot's free header never reached the disk. (Nothing writes after this, so
        // the freed slot is not taken again.)
        fs::write(&small, &small_before).unwrap();
        // Likewise a rename onto an existing key whose old slot was not freed.
        let (_, heir) = s.slot_of(&key(2, 2)).unwrap();
        let heir_before = fs::read(&heir).unwrap();
        s.run(DiskCmd::Rename { from: key(2, 1), to: key(2, 2) }).unwrap();
        fs::write(&heir, &heir_before).unwrap();
        drop(s);
        let s = FileStore::open_with(&dir, false, quiet()).unwrap();
        assert_eq!(s.boot().unwrap().objects, vec![(key(1, 1), v(2)), (key(2, 2), v(1))]);
        assert_eq!(read(&s, key(1, 1), 99, 2), vec![1, 0]);
        assert_eq!(read_all(&s, key(2, 2)), vec![3; 10]);
        assert_eq!(s.pool_stats().free_slots, [2, 0, 0, 0]);
        // The losers were freed durably.
        drop(s);
        assert_eq!(FileStore::open_with(&dir, false, quiet()).unwrap().pool_stats().free_slots, [2, 0, 0, 0]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn free_slots_are_reused() {
        let dir = tempdir();
        let s = FileStore::open_with(&dir, true, quiet()).unwrap();
        write(&s, key(1, 1), 1, 0, vec![1; 60_000]);
        let (_, first) = s.slot_of(&key(1, 1)).unwrap();
        s.run(DiskCmd::Delete { key: key(1, 1) }).unwrap();
        assert_eq!(read(&s, key(1, 1), 0, 4), vec![0; 4]);
        assert!(s.run(DiskCmd::ReadAll { key: key(1, 1) }).is_err());
        s.run(DiskCmd::Delete { key: key(1, 1) }).unwrap(); // deleting nothing is fine
        write(&s, key(9, 3), 2, 0, vec![2; 1000]); // 4 KiB class: a new slot
        write(&s, key(9, 4), 2, 0, vec![2; 50_000]);
        assert_eq!(s.slot_of(&key(9, 4)).unwrap().1, first, "the freed 64 KiB slot was not reused");
        assert_eq!(read(&s, key(9, 4), 49_998, 4), vec![2, 2, 0, 0], "stale bytes past the length");
        assert_eq!(s.slot_files(), 2);
        assert_eq!(s.pool_stats().slow_allocations, 2);
        drop(s);
        assert_eq!(reopen_boot(&dir).objects, vec![(key(9, 3), v(2)), (key(9, 4), v(2))]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn eight_threads_write_different_keys() {
        let dir = tempdir();
        let s = FileStore::open(&dir, true).unwrap();
        let parent: Vec<u8> = (0..65536u32).map(|i| (i / 256) as u8).collect();
        for t in 0..8u64 {
            s.run(DiskCmd::Apply { key: key(t, 1), version: v(1), op: RepOp::Put { data: parent.clone() }, cow_from: None }).unwrap();
        }
        std::thread::scope(|sc| {
            for t in 0..8u64 {
                let s = &s;
                sc.spawn(move || {
                    for i in 0..40u64 {
                        // Thread t owns objects ≡ t (mod 8): plain writes, COWs, Puts, deletes.
                        let objno = t + 8 * (i % 5);
                        let data = vec![(t * 40 + i) as u8; 4096];
                        let cow = (objno == t && i >= 5).then_some(key(t, 1));
                        let k = if cow.is_some() { key(objno, 2 + i) } else { key(objno, 1) };
                        s.run(DiskCmd::Apply { key: k, version: v(10 + i), op: RepOp::Write { offset: 4096 * (i % 16) as u32, data }, cow_from: cow }).unwrap();
                        if i % 7 == 6 {
                            s.run(DiskCmd::Delete { key: k }).unwrap();
                        }
                    }
                });
            }
        });
        let stats = s.pool_stats();
        let mut want = vec![];
        for t in 0..8u64 {
            for i in 0..40u64 {
                let objno = t + 8 * (i % 5);
                let cow = objno == t && i >= 5;
                let k = if cow { key(objno, 2 + i) } else { key(objno, 1) };
                let got = read(&s, k, 4096 * (i % 16) as u32, 4096);
                if i % 7 == 6 {
                    continue;
                }
                if cow {
                    assert_eq!(got, vec![(t * 40 + i) as u8; 4096], "COW child {k:?}");
                    want.push((k, v(10 + i)));
                }
            }
            for r in 0..5u64 {
                let last = (0..40u64).filter(|i| i % 5 == r && !(r == 0 && *i >= 5)).max().unwrap();
                let k = key(t + 8 * r, 1);
                if last % 7 != 6 {
                    want.push((k, v(10 + last)));
                }
            }
        }
        want.sort();
        drop(s);
        assert_eq!(reopen_boot(&dir).objects, want);
        assert!(stats.live_objects == want.len(), "{stats:?}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_refill_keeps_free_slots_ready_grows_under_bursts_and_trims_extras() {
        let dir = tempdir();
        let mut pool = PoolOptions::default();
        pool.free_slots_target = [3, 5, 0, 0];
        pool.free_slots_max = [3, 8, 0, 0];
        let s = FileStore::open_with(&dir, true, pool).unwrap();
        let wait_until = |what: &str, done: &dyn Fn(&PoolStats) -> bool| {
            let start = Instant::now();
            while !done(&s.pool_stats()) {
                assert!(start.elapsed() < Duration::from_secs(30), "{what}: {:?}", s.pool_stats());
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        // The first 64 KiB object finds the class empty: a slow allocation, and the target
        // doubles (capped at the maximum).
        write(&s, key(1, 1), 1, 0, vec![1; 10_000]);
        let st = s.pool_stats();
        assert_eq!((st.slow_allocations, st.free_slots_target), (1, [3, 8, 0, 0]));
        wait_until("the refill stocks the class in use", &|st| st.free_slots[1] >= 5);
        assert_eq!(s.pool_stats().free_slots[0], 0, "a class never used got slots");
        wait_until("the target decays to its base", &|st| st.free_slots_target[1] == 5);
        // A burst, then its objects deleted: the free slots beyond the maximum go.
        for i in 2..14 {
            write(&s, key(i, 1), 1, 0, vec![1; 10_000]);
        }
        for i in 2..14 {
            s.run(DiskCmd::Delete { key: key(i, 1) }).unwrap();
        }
        wait_until("trimmed to the maximum", &|st| st.free_slots[1] == 8 && s.slot_files() == 9);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn super_prestocks_a_slot_for_every_parent_object_so_child_writes_allocate_nothing() {
        let dir = tempdir();
        let mut pool = PoolOptions::default();
        pool.free_slots_target = [0, 1, 0, 0];
        pool.free_slots_max = [0, 64, 64, 0];
        let s = FileStore::open_with(&dir, true, pool).unwrap();
        // The parent (owner 1): twelve 64 KiB-class objects and two 1 MiB-class ones; another
        // volume of the table (owner 5) must not count.
        for i in 0..12 {
            write(&s, key(i, 1), 1, 0, vec![1; 65536]);
        }
        for i in 12..14 {
            write(&s, key(i, 1), 1, 0, vec![1; 100_000]);
        }
        write(&s, key(20, 5), 1, 0, vec![5; 4096]);
        let wait_until = |what: &str, done: &dyn Fn(&PoolStats) -> bool| {
            let start = Instant::now();
            while !done(&s.pool_stats()) {
                assert!(start.elapsed() < Duration::from_secs(30), "{what}: {:?}", s.pool_stats());
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        s.run(DiskCmd::Prestock { table: 7, parent: 1 }).unwrap();
        let st = s.pool_stats();
        assert!(st.prestocks == 1 && st.reserved_slots[1] == 12 && st.reserved_slots[2] == 2, "{st:?}");
        wait_until("the refill makes the pre-stocked slots", &|st| st.reserved_free_slots[1] == 12 && st.reserved_free_slots[2] == 2);
        // Quiet seconds (the child has not started writing) keep the reservation.
        std::thread::sleep(Duration::from_millis(2500));
        let st = s.pool_stats();
        assert!(st.reserved_slots[1] == 12 && st.reserved_free_slots[1] == 12, "{st:?}");
        // The child's first writes (deferred copies, and a whole copy of a bigger object) all
        // take ready slots: no allocation on their path.
        let slow = s.pool_stats().slow_allocations;
        for i in 0..14 {
            s.run(DiskCmd::Apply { key: key(i, 2), version: v(1), op: RepOp::Write { offset: 0, data: vec![2; 4096] }, cow_from: Some(key(i, 1)) })
                .unwrap();
            assert_eq!(read(&s, key(i, 2), 0, 8192)[4090..4100], [2, 2, 2, 2, 2, 2, 1, 1, 1, 1]);
        }
        let st = s.pool_stats();
        assert_eq!(st.slow_allocations, slow, "{st:?}");
        assert_eq!(st.counters.slots_from_reserve, 14, "{st:?}");
        assert_eq!(st.reserved_slots, [0; CLASSES], "{st:?}");
        drop(s); // stops the refill thread
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn only_a_childs_first_writes_take_its_reserved_slots() {
        let dir = tempdir();
        let pool = PoolOptions { free_slots_target: [0, 4, 0, 0], free_slots_max: [0, 64, 0, 0], ..quiet() };
        let s = FileStore::open_with(&dir, true, pool).unwrap();
        // The parent (owner 1): ten objects of the 64 KiB class.
        for i in 0..10 {
            write(&s, key(i, 1), 1, 0, vec![1; 10_000]);
        }
        // Six free slots in the pool (a burst's objects deleted).
        for i in 0..6 {
            write(&s, key(i, 8), 1, 0, vec![1; 10_000]);
        }
        for i in 0..6 {
            s.run(DiskCmd::Delete { key: key(i, 8) }).unwrap();
        }
        assert_eq!(s.pool_stats().free_slots[1], 6);
        // super: ten slots owed to the child; the six free ones move into its reservation at
        // once (no refill runs in this test).
        s.run(DiskCmd::Prestock { table: 7, parent: 1 }).unwrap();
        let st = s.pool_stats();
        assert_eq!((st.reserved_slots[1], st.reserved_free_slots[1], st.free_slots[1]), (10, 6, 0), "{st:?}");
        // Another volume's burst of new objects (a general clone's copy-ups) does not touch
        // them: each of its writes makes its slot itself.
        let slow = st.slow_allocations;
        for i in 0..3 {
            write(&s, key(i, 9), 1, 0, vec![1; 10_000]);
        }
        let st = s.pool_stats();
        assert_eq!((st.slow_allocations - slow, st.reserved_free_slots[1], st.reserved_slots[1]), (3, 6, 10), "{st:?}");
        // A slot freed while the reservation lacks slots goes to the reservation.
        s.run(DiskCmd::Delete { key: key(0, 9) }).unwrap();
        let st = s.pool_stats();
        assert_eq!((st.reserved_free_slots[1], st.free_slots[1]), (7, 0), "{st:?}");
        // The child's first writes take reserved slots and count them off, one each.
        let slow = st.slow_allocations;
        for i in 0..3 {
            s.run(DiskCmd::Apply { key: key(i, 2), version: v(1), op: RepOp::Write { offset: 0, data: vec![2; 4096] }, cow_from: Some(key(i, 1)) })
                .unwrap();
        }
        let st = s.pool_stats();
        assert_eq!((st.reserved_slots[1], st.reserved_free_slots[1]), (7, 4), "{st:?}");
        assert_eq!((st.counters.slots_from_reserve, st.slow_allocations), (3, slow), "{st:?}");
        // Overwrites of the child's objects take no slot at all.
        s.run(DiskCmd::Apply { key: key(0, 2), version: v(2), op: RepOp::Write { offset: 0, data: vec![3; 4096] }, cow_from: None }).unwrap();
        assert_eq!(s.pool_stats().reserved_slots[1], 7);
        // A second, smaller reservation does not add to the first.
        s.run(DiskCmd::Prestock { table: 7, parent: 9 }).unwrap();
        assert_eq!(s.pool_stats().reserved_slots[1], 7);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_refill_stocks_the_reservation_and_the_free_list_apart() {
        let dir = tempdir();
        let pool = PoolOptions { free_slots_target: [0, 3, 0, 0], free_slots_max: [0, 8, 0, 0], reserved_slots_max: [0, 5, 0, 0], ..quiet() };
        let s = FileStore::open_with(&dir, true, pool).unwrap();
        for i in 0..9 {
            write(&s, key(i, 1), 1, 0, vec![1; 10_000]);
        }
        s.inner.index.lock().unwrap().target[1] = 3;
        // Nine parent objects, but at most five slots reserved.
        s.run(DiskCmd::Prestock { table: 7, parent: 1 }).unwrap();
        assert_eq!(s.pool_stats().reserved_slots[1], 5);
        assert!(!s.inner.refill(1));
        let st = s.pool_stats();
        assert_eq!((st.reserved_free_slots[1], st.free_slots[1]), (5, 3), "{st:?}");
        // Other writes drain the free list only.
        for i in 0..3 {
            write(&s, key(i, 9), 1, 0, vec![1; 10_000]);
        }
        let st = s.pool_stats();
        assert_eq!((st.reserved_free_slots[1], st.free_slots[1]), (5, 0), "{st:?}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_refill_holds_back_while_writes_are_served_but_never_below_its_floor() {
        let dir = tempdir();
        let pool = PoolOptions { free_slots_target: [0, 8, 0, 0], free_slots_max: [0, 8, 0, 0], ..quiet() };
        let s = FileStore::open_with(&dir, true, pool).unwrap();
        let free = |s: &FileStore| s.pool_stats().free_slots[1];
        // One 64 KiB object: the class is in use (and that write counts as serving writes).
        write(&s, key(1, 1), 1, 0, vec![1; 10_000]);
        assert_eq!(free(&s), 0);
        // Below the floor (8 / 4 = 2 slots): the refill tops up whatever the shard is doing.
        // (The write just made counts as recent however long its fdatasync took on a loaded
        // machine.)
        s.inner.last_write_us.store((s.inner.opened.elapsed().as_micros() as u64).max(1), Ordering::Relaxed);
        assert!(s.inner.serving_writes());
        assert!(!s.inner.refill(1));
        assert_eq!(free(&s), 8);
        // Above the floor while writes are served: it holds back and says so.
        for i in 0..5 {
            s.inner.take_slot(1, false).unwrap();
            assert_eq!(free(&s), 7 - i);
        }
        s.inner.last_write_us.store((s.inner.opened.elapsed().as_micros() as u64).max(1), Ordering::Relaxed);
        assert!(s.inner.refill(1));
        assert_eq!(free(&s), 3);
        // Once the writes are older than the yield window, it tops up.
        std::thread::sleep(Duration::from_millis(REFILL_YIELD_MS + 10));
        assert!(!s.inner.serving_writes());
        assert!(!s.inner.refill(1));
        assert_eq!(free(&s), 8);
        drop(s);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn slot_files_whose_creation_was_interrupted_are_removed_at_open() {
        let dir = tempdir();
        let s = FileStore::open_with(&dir, true, quiet()).unwrap();
        write(&s, key(1, 1), 1, 0, vec![1; 10_000]);
        let class_dir = s.inner.class_dir(1);
        drop(s);
        // Short; full size but never written (holes); not a slot file at all.
        fs::write(class_dir.join("5"), [0u8; 100]).unwrap();
        File::create(class_dir.join("6")).unwrap().set_len(slot_file_bytes(1)).unwrap();
        fs::write(class_dir.join("notes.txt"), b"hello").unwrap();
        let s = FileStore::open_with(&dir, false, quiet()).unwrap();
        assert!(!class_dir.join("5").exists() && !class_dir.join("6").exists());
        assert!(class_dir.join("notes.txt").exists());
        assert_eq!(s.pool_stats().free_slots, [0; CLASSES]);
        assert_eq!(s.boot().unwrap().objects, vec![(key(1, 1), v(1))]);
        // New slots do not reuse the numbers seen.
        write(&s, key(2, 1), 1, 0, vec![1; 10_000]);
        assert_eq!(s.slot_of(&key(2, 1)).unwrap().1, class_dir.join("7"));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn objects_of_the_one_file_per_object_layout_are_imported() {
        let dir = tempdir();
        let table_dir = dir.join("objects").join(format!("{:016x}", 7));
        fs::create_dir_all(&table_dir).unwrap();
        let mut good = objfmt::Header { version: v(4), crcs: vec![crc32c::crc32c(&[5; 10])] }.encode().to_vec();
        good.extend([5; 10]);
        fs::write(table_dir.join(format!("{:016x}.{:016x}", 1, 1)), &good).unwrap();
        let mut torn = good.clone();
        torn[HEADER_BYTES as usize] = 6;
        fs::write(table_dir.join(format!("{:016x}.{:016x}", 2, 1)), &torn).unwrap();
        fs::write(table_dir.join(format!("{:016x}.{:016x}.cow", 3, 1)), &good).unwrap();
        let s = FileStore::open_with(&dir, false, quiet()).unwrap();
        assert_eq!(s.boot().unwrap().objects, vec![(key(1, 1), v(4)), (key(2, 1), objfmt::SUSPECT)]);
        assert_eq!(read_all(&s, key(1, 1)), vec![5; 10]);
        assert!(!dir.join("objects").exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A 2 MiB tmpfs fills up: writes that need a new slot fail with NoSpace and change nothing;
    /// overwrites still work (their blocks exist); a freed slot is used again.
    #[test]
    fn a_full_disk_gives_no_space_and_changes_nothing() {
        let dir = tempdir();
        let mnt = dir.join("tiny");
        fs::create_dir_all(&mnt).unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=2m", "tmpfs"])
            .arg(&mnt)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !mounted {
            eprintln!("SKIPPED a_full_disk_gives_no_space_and_changes_nothing: cannot mount a tmpfs at {} (needs root)", mnt.display());
            fs::remove_dir_all(&dir).unwrap();
            return;
        }
        let result = std::panic::catch_unwind(|| {
            let root = mnt.join("shard");
            // The default pool: its refill must stay out of a disk this small (reserve). No
            // journal: it alone would take more than the disk.
            let s = FileStore::open_with(&root, true, PoolOptions { journal_capacity_bytes: None, ..PoolOptions::default() }).unwrap();
            let mut stored = vec![];
            let full = loop {
                let k = key(stored.len() as u64, 1);
                assert!(stored.len() < 64, "a 2 MiB disk took 64 objects of 64 KiB");
                match s.run(DiskCmd::Apply { key: k, version: v(1), op: RepOp::Put { data: vec![1; 65536] }, cow_from: None }) {
                    Ok(_) => stored.push(k),
                    Err(DiskErr::NoSpace) => break k,
                    Err(e) => panic!("{e:?}"),
                }
            };
            assert!(stored.len() >= 10, "only {} objects fit", stored.len());
            assert!(s.run(DiskCmd::ReadAll { key: full }).is_err());
            let child = key(0, 2);
            assert_eq!(
                s.run(DiskCmd::Apply { key: child, version: v(2), op: RepOp::Write { offset: 0, data: vec![2; 4096] }, cow_from: Some(key(0, 1)) }),
                Err(DiskErr::NoSpace)
            );
            assert_eq!(read(&s, child, 0, 4), vec![0; 4]);
            // Overwrites need no space.
            for k in &stored {
                write(&s, *k, 2, 4096, vec![3; 4096]);
            }
            // Room again after a delete: the freed slot is taken.
            s.run(DiskCmd::Delete { key: stored[0] }).unwrap();
            s.run(DiskCmd::Apply { key: full, version: v(3), op: RepOp::Put { data: vec![4; 65536] }, cow_from: None }).unwrap();
            let files = s.slot_files();
            drop(s);
            let boot = FileStore::open_with(&root, false, no_journal()).unwrap().boot().unwrap();
            let mut want: Vec<_> = stored[1..].iter().map(|k| (*k, v(2))).collect();
            want.push((full, v(3)));
            want.sort();
            assert_eq!(boot.objects, want);
            // No half-created slot files were left behind.
            assert_eq!(files, stored.len());
        });
        let _ = std::process::Command::new("umount").arg(&mnt).status();
        fs::remove_dir_all(&dir).unwrap();
        if let Err(e) = result {
            std::panic::resume_unwind(e);
        }
    }

    fn tempdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("understudy-store-{}-{}", std::process::id(), rand::random::<u32>()));
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_first_child_write_copies_only_the_sectors_it_touches() {
        let dir = tempdir();
        let s = FileStore::open_with(&dir, true, quiet()).unwrap();
        let parent: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8 + 1).collect();
        s.run(DiskCmd::Apply { key: key(1, 1), version: v(1), op: RepOp::Put { data: parent.clone() }, cow_from: None }).unwrap();
        // 100 bytes across the boundary of sectors 2 and 3.
        s.run(DiskCmd::Apply { key: key(1, 2), version: v(2), op: RepOp::Write { offset: 3 * 4096 - 50, data: vec![0; 100] }, cow_from: Some(key(1, 1)) }).unwrap();
        let mut want = parent.clone();
        want[3 * 4096 - 50..3 * 4096 + 50].fill(0);
        assert_eq!(read_all(&s, key(1, 2)), want);
        assert_eq!(read(&s, key(1, 2), 3 * 4096 - 52, 4), vec![want[3 * 4096 - 52], want[3 * 4096 - 51], 0, 0]);
        // The child's slot holds sectors 2 and 3 only (a fresh slot is zeroes elsewhere).
        let (_, cpath) = s.slot_of(&key(1, 2)).unwrap();
        let page = SLOT_HEADER_PAGE_BYTES as usize;
        let file = fs::read(&cpath).unwrap();
        assert_eq!(&file[page + 2 * 4096..page + 4 * 4096], &want[2 * 4096..4 * 4096]);
        assert!(file[page..page + 2 * 4096].iter().all(|&b| b == 0), "sectors 0-1 were copied");
        assert!(file[page + 4 * 4096..].iter().all(|&b| b == 0), "sectors 4-15 were copied");
        // It survives a reopen as a deferred copy with valid checksums.
        drop(s);
        assert_eq!(reopen_boot(&dir).objects, vec![(key(1, 1), v(1)), (key(1, 2), v(2))]);
        let s = FileStore::open_with(&dir, false, quiet()).unwrap();
        assert_eq!(read_all(&s, key(1, 2)), want);
        // A parent write completes the child first: the child keeps the parent's old bytes.
        write(&s, key(1, 1), 3, 0, vec![0xee; 65536]);
        assert!(s.inner.entry(&key(1, 2)).unwrap().base.is_none());
        assert_eq!(read_all(&s, key(1, 2)), want);
        assert_eq!(fs::read(&cpath).unwrap()[page..page + 65536], want[..]);
        drop(s);
        assert_eq!(reopen_boot(&dir).objects, vec![(key(1, 1), v(3)), (key(1, 2), v(2))]);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Random writes, zeroes, Puts, copy-on-write children, deletes, renames and reopens against
    /// an in-memory model: deferred copies must read, survive and end exactly like whole copies.
    #[test]
    fn deferred_copies_match_a_model_through_every_operation() {
        let dir = tempdir();
        let mut s = FileStore::open_with(&dir, true, quiet()).unwrap();
        let mut model: HashMap<ObjKey, (Version, Vec<u8>)> = HashMap::new();
        let mut rng: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let mut seq = 0;
        let mut deferred_steps = 0;
        for step in 0..1500 {
            seq += 1;
            let objno = next(4);
            let (parent, child) = (key(objno, 1), key(objno, 2 + next(2)));
            let k = if next(3) == 0 { parent } else { child };
            match next(10) {
                0..=5 => {
                    let len = [1u64, 100, 4096, 5000, 20_000][next(5) as usize];
                    let beyond = if next(8) == 0 { 10_000 } else { 0 };
                    let offset = next(65536 - len + 1 + beyond) as u32;
                    let data: Vec<u8> = (0..len).map(|_| next(255) as u8 + 1).collect();
                    let cow = (!model.contains_key(&k) && k != parent && model.contains_key(&parent)).then_some(parent);
                    s.run(DiskCmd::Apply { key: k, version: v(seq), op: RepOp::Write { offset, data: data.clone() }, cow_from: cow }).unwrap();
                    let mut body = cow.map_or(vec![], |p| model[&p].1.clone());
                    if let Some((_, b)) = model.get(&k) {
                        body = b.clone();
                    }
                    let end = offset as usize + data.len();
                    if body.len() < end {
                        body.resize(end, 0);
                    }
                    body[offset as usize..end].copy_from_slice(&data);
                    model.insert(k, (v(seq), body));
                }
                6 if model.contains_key(&k) => {
                    let (offset, len) = (next(65536) as u32, next(20_000) as u32);
                    s.run(DiskCmd::Apply { key: k, version: v(seq), op: RepOp::Zero { offset, len }, cow_from: None }).unwrap();
                    let m = model.get_mut(&k).unwrap();
                    let end = (offset as usize + len as usize).min(m.1.len());
                    if end > offset as usize {
                        m.1[offset as usize..end].fill(0);
                    }
                    m.0 = v(seq);
                }
                7 => {
                    let data = vec![next(255) as u8; [10usize, 65536, 100_000][next(3) as usize]];
                    s.run(DiskCmd::Apply { key: k, version: v(seq), op: RepOp::Put { data: data.clone() }, cow_from: None }).unwrap();
                    model.insert(k, (v(seq), data));
                }
                8 => {
                    s.run(DiskCmd::Delete { key: k }).unwrap();
                    model.remove(&k);
                }
                9 if model.contains_key(&child) => {
                    // Garbage collection hands objects over by renaming them.
                    let to = key(objno, if child.owner == 2 { 3 } else { 2 });
                    s.run(DiskCmd::Rename { from: child, to }).unwrap();
                    let m = model.remove(&child).unwrap();
                    model.insert(to, m);
                }
                _ => {}
            }
            if step % 100 == 99 {
                drop(s);
                let mut want: Vec<(ObjKey, Version)> = model.iter().map(|(k, (v, _))| (*k, *v)).collect();
                want.sort();
                assert_eq!(reopen_boot(&dir).objects, want, "step {step}");
                s = FileStore::open_with(&dir, false, quiet()).unwrap();
            }
            for (k, (_, body)) in &model {
                assert_eq!(&read_all(&s, *k), body, "step {step} {k:?}");
                deferred_steps += s.inner.entry(k).unwrap().base.is_some() as usize;
            }
        }
        assert!(deferred_steps > 500, "the run hardly exercised deferred copies ({deferred_steps})");
        drop(s);
        fs::remove_dir_all(&dir).unwrap();
    }
}
