//! Tokio drivers: the node server ([`run_node`]), the CM server ([`run_cm`]) and the async
//! client ([`KvClient`], [`KvCluster`]). They run the sans-I/O cores unchanged.
//!
//! Every TCP connection starts with `wire::auth` (mutual HMAC over the cluster secret), then a
//! [`NetMsg::Hello`] saying who connects; then frames of [`NetMsg`] (`wire` framing, size-limited).
//! Nodes dial each other (one outbound connection per peer, reconnecting); the CM dials every
//! node; clients dial any node and may keep many requests in flight on one connection.
//!
//! Persistence runs on a dedicated thread owning the [`FileLog`](crate::pmlog::FileLog)
//! ([`log_thread`]): appends are taken in order and batched (group commit), each batch one
//! `O_DSYNC` write, or, when it is large or a sync is in flight, written and synced by a second
//! thread while the next batch is written; each durable append is reported in order. A node
//! reports its recoveries as structured [`events`].

pub mod client;
pub mod cm;
pub mod events;
pub mod log_thread;
pub mod net;
pub mod node;

pub use client::*;
pub use cm::*;
pub use net::*;
pub use node::*;

use log_thread::*;
