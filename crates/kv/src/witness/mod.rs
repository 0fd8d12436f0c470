//! The witness KV (CANDStore, SoCC'20): a primary in NVMM, cheap backups (NVMM buffer + hot/cold SSD logs) and key/timestamp-only witnesses; [`store`] holds the backup's storage tiers.

pub mod store;
