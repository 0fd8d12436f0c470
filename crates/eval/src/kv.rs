//! The HEAL experiments (HEAL §IX): recovery after a node failure against the full-copy and
//! reactive-log baselines, YCSB workloads through the project's driver, and a real ZooKeeper
//! ensemble beside a HEAL group. Each runs on a [`testbed::kv::LocalKv`].

pub mod cost;
pub mod recovery;
pub mod ssd;
pub mod ttr;
pub mod ycsb;
pub mod zookeeper;

use std::path::Path;

pub use testbed::kv::events_path;

/// A recovery as its node reported it (the `recovered` event of `kv node --events`).
#[derive(Clone, Debug)]
pub(crate) struct Recovered {
    pub total_us: u64,
    pub ended_unix_us: u64,
    pub stats: ::kv::leaderless::core::node::RecoveryStats,
    /// The node's log bytes made durable since its process started.
    pub log_durable_bytes: u64,
}

/// The last recovery in the events file `path` after byte `from`, if one was reported.
pub(crate) fn last_recovery(path: &Path, from: u64) -> anyhow::Result<Option<Recovered>> {
    use ::kv::leaderless::driver::events::{read_events, Event};
    Ok(read_events(path, from)?.into_iter().rev().find_map(|l| match l.event {
        Event::Recovered { total_us, ended_unix_us, stats, since_start, .. } => {
            Some(Recovered { total_us, ended_unix_us, stats, log_durable_bytes: since_start.log_durable_bytes })
        }
    }))
}
