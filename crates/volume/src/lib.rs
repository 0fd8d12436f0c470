//! Replicated block volumes with `super` and `collapse` (SpecREDS §4–5).
//!
//! * [`types`]: ids, the cluster map and placement (rendezvous hashing), the wire messages.
//! * [`shard_core`]: the storage shard as a deterministic state machine: primary-copy
//!   replication, collocated-clone copy-on-write, the dirty / allow-write tracking protocol,
//!   garbage collection and re-replication.

pub mod shard_core;
pub mod types;
pub mod shard_server;
pub mod store;
pub mod meta;
pub mod client;
pub mod sim_store;
pub mod bench_cow;
pub mod bench_trace;
pub mod objfmt;
pub mod testkit;
pub mod fuzzing;
