//! The project's YCSB workload driver.
//!
//! Not a paper section but the load every evaluation uses: HEAL §IX (YCSB with zipfian keys,
//! 80 % reads / 20 % writes, and TAOBench), CANDStore §6 (YCSB B and C, θ ∈ {0.9, 0.99, 1.1})
//! and SplitFT (YCSB A–F against Redis and RocksDB). It follows YCSB's `CoreWorkload` (B. F.
//! Cooper et al., "Benchmarking Cloud Serving Systems with YCSB", SoCC'10) and depends on no
//! other subsystem, so any store can be measured by implementing one trait.
//!
//! - [`choosers`]: key choosers — [`Zipfian`] (exact rejection-inversion sampling, any θ > 0,
//!   O(1) item-count changes), YCSB's [`ScrambledZipfian`], [`Uniform`], [`SkewedLatest`].
//! - [`WorkloadSpec`]: workloads A–F exactly as YCSB's `workloads/workload[a-f]` files define
//!   them, and a TAO-like social-graph mix; [`OpGenerator`] is the deterministic core that turns
//!   a seed into a stream of [`Op`]s (sans-I/O).
//! - [`KvTarget`]: the async interface a store implements (get, put, insert, optional scan,
//!   read-modify-write); [`MemTarget`] (a map behind a mutex, for tests) and
//!   [`redis::RedisTarget`] (a minimal RESP2 client) implement it.
//! - [`Runner`]: closed-loop clients as tokio tasks, a load and a run phase, bounded by
//!   operation count and/or duration; [`PhaseSummary`] holds per-operation HDR latency
//!   histograms ([`bench::LatencyRecorder`]), throughput per 100 ms window
//!   ([`bench::WindowedCounter`]) and the checks of every value read, and writes BENCH.md figures.
//! - Every value carries its key's fingerprint and a nonce ([`value`]), so each read is checked
//!   to return a value the driver wrote for that key.

pub mod choosers;
pub mod keys;
pub mod memory;
pub mod redis;
mod runner;
mod summary;
mod target;
pub mod value;
mod workload;

pub use choosers::{
    zeta, KeyChooser, RequestDistribution, ScrambledZipfian, SkewedLatest, Uniform, Zipfian,
};
pub use keys::{fnv_hash64, InsertOrder, KeyFormat};
pub use memory::MemTarget;
pub use runner::{RunConfig, RunError, Runner};
pub use summary::{OpStats, Phase, PhaseSummary};
pub use target::{KvTarget, Records, TargetError};
pub use workload::{
    InsertSequence, Mix, Op, OpGenerator, OpKind, Proportions, ScanLengthDistribution, TaoMix,
    WorkloadSpec,
};

/// A configuration that cannot work; the message says what to change.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl ConfigError {
    pub fn new(message: impl Into<String>) -> ConfigError {
        ConfigError(message.into())
    }
}
