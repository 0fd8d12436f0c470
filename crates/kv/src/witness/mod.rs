//! The witness KV: CANDStore ("High availability in cheap distributed key value storage",
//! SoCC'20, §3–§6; spec `shared/specs/candstore.md`). One full copy of the data (the primary),
//! cheap backups (a small NVMM buffer in front of SSD logs) and witnesses (keys and timestamps
//! only). Replication is a Raft variant whose commit quorum is the leader plus every voting
//! backup and whose candidates are heads only; after the primary fails a witness is elected,
//! reconciles its log with the backups, and serves at once, pulling values on demand and in
//! the background while checking each against its key table.
//!
//! [`proto`] holds the messages (cores and drivers import it, never each other); [`core`] the
//! sans-I/O state machines; [`store`] the backup's storage tiers (NVMM emulation in `/dev/shm`
//! or an O_DSYNC file, O_DIRECT SSD logs, the prioritised I/O pool); [`driver`] the tokio node
//! server and the leader-following client (`understudy kv node|up --protocol witness`). The
//! driver uses `store::pmem` for NVMM, but writes the SSD log in the core's own page format
//! (`core::page`) on one FIFO `O_DIRECT` thread: `store::ssdlog`/`store::io` (segments,
//! their own entry framing, priority classes) are not driven yet (see `driver`).
//!
//! Status of the spec's mechanisms in [`core::node::WitnessCore`] (S = simplified, see the
//! `SIMPLIFIED` notes in the code):
//! - done: M3 (leader lease; voters refuse votes within it), M4 (commit = leader + all voting
//!   backups), M5, M6 (persist in NVMM, then ack), M8 (writeback only of committed entries, index
//!   update only if newer, NVMM copy freed after the SSD write), M11, M12, M13 (adoption only from
//!   a voting backup's log refusal), M14 (all voting backups asked; the longest agreed prefix
//!   kept), M15 (designated successor, abort on a live leader, stamp-checked install, popular
//!   keys first), M16 (Φ-accrual soft/hard timeouts, the fixed values as floors, 3× as
//!   ceilings), M17, M18
//!   (buffer first, then index page; install iff local < stamp ≤ key table; answer iff equal;
//!   one pull per key, bounded), M19, M23 (a witness loss needs no change), NotLeader{hint}.
//! - S: M1/M7 (one backup worker, one SSD log, no hot/cold), M2 (any N; N = 1, 2 tested), M10
//!   (sampling and the backups' popular list order BatchPull; no placement yet), M20 (one
//!   BatchPull in flight, paced by the core's AIMD token bucket), M21 (PriorityPulls spread
//!   round-robin), restart (M24 partly: `restore`). Recovery schemes (`Params::recovery`,
//!   `--recovery`): `core/node/recovery.rs`.
//! - left: M9 (GC), M22 (substitution, non-voting
//!   promotion at run time: `Config` supports both, nothing changes it), M24 (joint consensus,
//!   old primary re-added as a witness, snapshots/catch-up of new nodes, log truncation).

pub mod core;
pub mod driver;
pub mod fuzzing;
pub mod proto;
pub mod store;
