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
//! driver uses `store::pmem` for NVMM and carries the core's SSD writes, reads and frees (one
//! page format, `core::page`; segments the core picks, `core::ssd`) out on `store::ssdlog`
//! through the priority pool `store::io`.
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
//! - done too: M9 (GC of the least-live segment; references counted per segment), M10 (the
//!   primary samples and ships popular keys; a backup places writebacks hot or cold by its
//!   popularity LRU, GC moves keys between the logs, BatchPull answers popular keys first;
//!   `Params::ssd_logs` = `Single` for the single-log ablation), M20 (one BatchPull in flight,
//!   paced by the core's AIMD token bucket), M22 (a lost backup substituted by a witness, spares
//!   added, non-voting members promoted once caught up, all as configuration entries in the
//!   log: `core/reconfig.rs`), M24 (an old primary follows as a witness without values; heads
//!   truncate their log once every member holds it durably, a head behind gets a key-table
//!   snapshot: `core/snapshot.rs`). Recovery schemes (`Params::recovery`, `--recovery`):
//!   `core/node/recovery.rs`.
//! - S: M1/M7 (one backup worker), M2 (any N; N = 1, 2 tested), M21 (PriorityPulls spread
//!   round-robin), restart (`restore`).
//! - left: a backup behind a truncated log is never refilled (it needs a value snapshot onto
//!   its SSD); the driver and `kv up` start no spares and expose no reconfiguration command.

pub mod core;
pub mod driver;
pub mod fuzzing;
pub mod proto;
pub mod store;
