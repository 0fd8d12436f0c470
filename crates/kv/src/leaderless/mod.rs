//! HEAL: the leaderless replicated KV (Hermes-style writes, five persistency models, online
//! incremental recovery). [`proto`] holds the messages; [`core`] the sans-I/O state machines
//! (the replica [`core::node::NodeCore`] and the configuration manager [`core::cm::CmCore`]);
//! [`driver`] the tokio drivers that run them over real sockets, files and clocks. Cores and
//! drivers both import `proto`, never each other's internals the other way round.

pub mod core;
pub mod driver;
pub mod proto;
