//! CANDStore: the witness KV (paper `004_220b2d339f7c21ee`, §3–§7; spec `specs/candstore.md`).
//! One primary holds every value, cheap backups keep NVMM buffers in front of SSD logs, and
//! witnesses keep keys and timestamps only; after the primary fails a witness takes over and
//! serves at once, pulling popular data ahead and missing data on demand.

pub mod core;
