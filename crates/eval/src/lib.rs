//! The paper experiments, one module per experiment, behind `understudy bench …`: each starts
//! its throw-away clusters and outside systems through `testbed`, runs its workload and fills a
//! [`bench::Report`] (figures, ratios, plots, CSV samples), printed as the last line of stdout.
//!
//! * [`volume::cow`]: `bench volume cow`, SpecREDS §6.2 Figure 4a/4b (write latency of plain,
//!   `super` and general-clone volumes by size and depth) and the dirty-bit overhead.
//! * [`volume::recovery_trace`]: `bench volume recovery-trace`, SpecREDS §6.2 "Performance on real
//!   recovery workloads" (Figure 4c reads, 4d writes): SQLite's crash recovery recorded on a
//!   volume and replayed on plain, `super` and general-clone volumes.
//! * [`failover::recovery`], [`failover::scenarios`]: `bench failover recovery|scenarios`, SpecREDS
//!   §6.3 (application recovery on plain, super and general clone) and §6.4-6.5 (Figure 6).
//! * [`kv::recovery`], [`kv::ycsb`], [`kv::zookeeper`]: `bench kv recovery|ycsb|zookeeper`, HEAL §IX
//!   (recovery latency and lost work against the baselines, Figs. 7-9).
//! * [`nearlog`]: `bench nearlog apps|ycsb|recovery`, SplitFT (Redis, SQLite and RocksDB with
//!   strong, weak and near-compute logs; log recovery from the peers).
//! * [`volume::ceph`]: `bench volume ceph`, Understudy beside a real single-node Ceph (rbd, rbd
//!   clone) measured with fio.
//! * [`control`]: `bench control failover`, issue 24: the control plane on etcd losing a leader's
//!   host (takeover against the lease TTL), beside the embedded backend's restart.
//! * [`ycsb`]: `bench ycsb redis`, YCSB workloads through the project's own driver against a
//!   real redis-server.
//!
//! The experiments' options are clap definitions beside them (`understudy bench …` flattens
//! them), so a flag and what it changes live in one file.

pub mod control;
pub mod failover;
pub mod fio;
pub mod kv;
pub mod nearlog;
pub mod volume;
pub mod ycsb;

/// The tokio runtime an experiment drives its clients on (as the CLI's client commands).
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}
