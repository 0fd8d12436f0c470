//! Replicated block volumes with `super` and `collapse` (SpecREDS §4–5).
//!
//! The crate has the shape every system crate has: messages in [`proto`] (and [`types`]),
//! deterministic state machines in [`core`], tokio drivers in [`driver`], and the shard's
//! [`store`]. Cores and drivers both import the messages, never each other's modules for them.
//!
//! * [`types`]: ids, the cluster map and placement (rendezvous hashing), the wire messages.
//! * [`proto`]: the metadata service's state and control messages.
//! * [`core::shard`]: the storage shard as a deterministic state machine: primary-copy
//!   replication, collocated-clone copy-on-write, the dirty / allow-write tracking protocol,
//!   garbage collection and re-replication.
//! * [`core::meta`]: the metadata service's decisions as a deterministic state machine: volume
//!   create / delete / resize, `super` and `collapse` over the tracking shard, the GC hand-off.
//! * [`core::membership`]: shard membership as a deterministic state machine: the failure
//!   detector, down / recovering / up, and when a returning shard may lead again.
//! * [`store`]: the shard's object store in pre-allocated slot files, with deferred
//!   (sector-wise) copy-on-write, its on-disk format ([`store::objfmt`]) and its write-ahead
//!   [`store::journal`] (group commit), on a real file system or the simulator's disk
//!   ([`store::files`]: the simulations run the real store).
//! * [`driver::shard`], [`driver::meta`], [`driver::client`]: the tokio drivers (shard,
//!   metadata service, volume client); [`testkit`] runs them in one process.
//! * [`fuzzing`]: hostile protocol input for the cargo-fuzz targets (`crates/volume/fuzz`) and
//!   the property tests.

pub mod types;
pub mod proto;
pub mod core;
pub mod driver;
pub mod store;
pub mod testkit;
pub mod fuzzing;
