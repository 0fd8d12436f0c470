//! The backup's storage tiers (paper §3.2, Fig 4; spec (c) "Honest tier emulation"), as plain
//! libraries the witness driver calls. No protocol decision is made here: what to append,
//! when to free, what to read and at which priority is the core's; these modules only make it
//! durable, fast and honest on this machine.
//!
//! - [`pmem`]: the NVMM buffer, a bounded ring of crc-framed records in a `/dev/shm` mapping
//!   (survives SIGKILL, **not** power loss) or an `O_DSYNC` file (power-safe, ~100 µs/persist).
//! - [`ssdlog`]: the hot and cold SSD logs, `O_DIRECT` segments of 4 KiB pages, the DRAM
//!   [`ssdlog::Index`] rebuilt by scanning, and [`ssdlog::gc_segment`].
//! - [`io`]: the SSD I/O pool, priority classes PriorityPull > Writeback > BatchPull > Gc with
//!   per-class in-flight limits and a BatchPull token bucket.
//! - [`TierBytes`]: what each structure holds per tier, for the cost model.
//!
//! # Driving it from the core's outputs
//!
//! The driver owns one [`pmem::PmemRegion`] per NVMM buffer (e.g. `hot` and `cold` per worker),
//! one `Arc<`[`ssdlog::SsdLogs`]`>` (both logs) with the [`ssdlog::Index`] that
//! [`ssdlog::SsdLogs::open`] rebuilt (handed to the core at start), and one [`io::IoPool`] over
//! the logs. The core's outputs map as follows:
//!
//! | core output | call | completion fed back |
//! |---|---|---|
//! | `PmemAppend{seq, bytes}` | `region.append(seq, &bytes)` (durable on return; `seq` strictly increasing per region) | `on_pmem_persisted(seq)` at once; [`pmem::PmemError::Full`] means writeback is behind: the core must not ack |
//! | `PmemTruncate{upto}` | `region.truncate_through(upto)` (frees the prefix of records with seq ≤ `upto`) | none |
//! | `SsdWrite{id, kind, entries}` | `submit(IoRequest{id, class: Writeback (or Gc for GC rewrites), op: IoOp::Append{kind, entries}})` | `on_ssd_written(id, locs)`: the batch is `fdatasync`ed; the core applies each `(key, ts, kind, loc)` to its index ([`ssdlog::Index::apply`]) and only then truncates pmem |
//! | `SsdRead{id, class, loc}` (a PriorityPull miss) | `op: IoOp::ReadPage{loc}` | `on_ssd_read(id, entries)`: every entry of the page(s) |
//! | `SsdRead{id, class, seg, off, len}` (BatchPull stream, GC) | `op: IoOp::Read{seg, off, len}` | raw pages; [`ssdlog::decode_pages`]`(seg, off, &bytes)` gives the entries with their locations |
//! | `SsdDelete{seg}` (after GC) | `op: IoOp::Delete{seg}` | — |
//! | pause GC during proactive/live recovery (§5.1, §5.3) | `submitter.pause(IoClass::Gc)` / `resume` | — |
//!
//! Entries carry a [`ssdlog::LogTs`] `(term, index)`; the core's own timestamp type converts to
//! it. After a restart the driver reopens the regions (each recovers its whole records) and the
//! logs (sealed; the index rebuilt), and replays the pmem records to the core, whose index rule
//! (ts never decreases) makes a replay of an entry already written back harmless.
//! For a synchronous GC outside the pool (tests, tools), [`ssdlog::gc_segment`] does the whole
//! pass: rewrite the indexed versions durably, then delete.

pub mod io;
pub mod pmem;
pub mod ssdlog;

/// Bytes a structure holds, by tier, for the cost model (DRAM $35.16, NVMM $4.51, SSD $0.32
/// per GB, paper Fig 1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierBytes {
    /// Emulated NVMM (shm or dsync files), as provisioned.
    pub nvmm: u64,
    /// SSD log segments: their durable pages.
    pub ssd: u64,
    /// DRAM spent on indexes over the other tiers (estimated from entry counts and sizes).
    pub dram_index: u64,
}

impl std::ops::Add for TierBytes {
    type Output = TierBytes;
    fn add(self, o: TierBytes) -> TierBytes {
        TierBytes {
            nvmm: self.nvmm + o.nvmm,
            ssd: self.ssd + o.ssd,
            dram_index: self.dram_index + o.dram_index,
        }
    }
}

impl std::iter::Sum for TierBytes {
    fn sum<I: Iterator<Item = TierBytes>>(it: I) -> TierBytes {
        it.fold(TierBytes::default(), |a, b| a + b)
    }
}
