//! The witness KV: CANDStore ("High availability in cheap distributed key value storage",
//! SoCC'20, §3–§6; spec `shared/specs/candstore.md`). One full copy of the data (the primary),
//! cheap backups (a small NVMM buffer in front of SSD logs) and witnesses (keys and timestamps
//! only). Replication is a Raft variant whose commit quorum is the leader plus every voting
//! backup and whose candidates are heads only; after the primary fails a witness is elected,
//! reconciles its log with the backups, and serves at once, pulling values on demand and in
//! the background while checking each against its key table.
//!
//! [`proto`] holds the messages (cores and drivers import it, never each other); [`core`] the
//! sans-I/O state machines.

pub mod core;
pub mod proto;
