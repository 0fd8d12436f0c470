//! The sans-I/O parts of the witness KV (CANDStore): deterministic state machines with no
//! socket, clock, file or thread; time and randomness are inputs. [`node::WitnessCore`] is one
//! node of any kind; [`config`] the group's membership and quorums; [`page`] the backup's one SSD
//! format (what the core writes and the store scans); [`ssd`] the backup's segments, their live
//! bytes and the GC victim rule; [`detector`] the Φ-accrual failure detector with soft and hard
//! thresholds; [`popularity`] the primary's sampler and the backups' popularity LRU (both driven
//! by `WitnessCore`'s recovery policy, `node/recovery.rs`); [`tiers`] the bytes each tier holds,
//! counted as the tables change (`kv status`, the cost per GB).

pub mod config;
pub mod detector;
pub mod node;
pub mod page;
pub mod popularity;
pub mod ssd;
pub mod tiers;

#[cfg(test)]
mod ssd_tests;
#[cfg(test)]
mod tests;
