//! Replicated block volumes with `super` and `collapse` (SpecREDS §4–5).
//!
//! * [`types`]: ids, the cluster map and placement (rendezvous hashing), the wire messages.
//! * [`shard_core`]: the storage shard as a deterministic state machine: primary-copy
//!   replication, collocated-clone copy-on-write, the dirty / allow-write tracking protocol,
//!   garbage collection and re-replication.
//! * [`store`]: the shard's object store in pre-allocated slot files, with deferred
//!   (sector-wise) copy-on-write, and its write-ahead [`journal`] (group commit); [`sim_store`]: the same semantics on the simulator's disk.
//! * [`proto`]: the metadata service's state and control messages (core and driver import it).
//! * [`meta_core`]: the metadata service's decisions as a deterministic state machine: volume
//!   create / delete / resize, `super` and `collapse` over the tracking shard, the GC hand-off.
//! * [`membership`]: shard membership as a deterministic state machine: the failure detector,
//!   down / recovering / up, and when a returning shard may lead again.
//! * [`shard_server`], [`meta`], [`client`]: the tokio drivers (shard, metadata service, volume
//!   client); [`testkit`] runs them in one process.
//! * [`fuzzing`]: hostile protocol input for the cargo-fuzz targets (`crates/volume/fuzz`) and
//!   the property tests.

pub mod shard_core;
pub mod types;
pub mod shard_server;
pub mod store;
pub mod journal;
pub mod proto;
pub mod meta;
pub mod meta_core;
pub mod membership;
pub mod client;
pub mod sim_store;
pub mod objfmt;
pub mod testkit;
pub mod fuzzing;
