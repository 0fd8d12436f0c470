//! CANDStore, the witness KV (CANDStore §3–§7; spec `specs/candstore.md`). One primary holds
//! every value, cheap backups keep NVMM buffers in front of hot and cold SSD logs, and witnesses
//! keep keys and timestamps only; after the primary fails a witness takes over and serves at
//! once, pulling popular data ahead and missing data on demand.
//!
//! - [`core`]: sans-I/O parts (the failure detector, popularity sampling and LRU).
//! - [`store`]: the backup's storage tiers (NVMM emulation, O_DIRECT SSD logs, the I/O pool).

pub mod core;
pub mod store;
