//! The tokio driver of the witness KV (spec (c) "Runtime, CLI and metrics"): [`run_node`] runs
//! one [`WitnessCore`](crate::witness::core::node::WitnessCore) as a server process, and
//! [`WitnessClient`] finds the serving leader by following `NotLeader{hint}`. The driver makes no
//! protocol decision: it carries the core's outputs out in order and feeds back completions.
//!
//! Every TCP connection starts with `wire::auth` (mutual HMAC over the cluster secret), then a
//! [`Hello`] saying who connects, then `wire` frames of [`NetMsg`] (size-limited, checksummed).
//! Each node dials every peer once (one outbound connection per peer, reconnecting) and reads
//! the peers' outbound connections on its listener; clients dial any node.
//!
//! Tiers, as this version carries them out (see [`node`] for why):
//! - NVMM: two [`PmemRegion`](crate::witness::store::pmem::PmemRegion)s per node (`meta` for
//!   term/vote, `log` for the head's log or the backup's buffer), in `/dev/shm` by default.
//!   An append is durable on return (shm: a store + fence), so `PmemPersisted` follows at once.
//! - SSD: the core's one page format ([`core::page`](crate::witness::core::page)) written at the
//!   segments and offsets the core names, into `O_DIRECT` segment files
//!   ([`store::ssdlog`](crate::witness::store::ssdlog)), through the priority pool
//!   ([`store::io`](crate::witness::store::io)) in the core's class: PriorityPull > writeback >
//!   BatchPull > GC.

pub mod client;
pub mod node;

pub use client::*;
pub use node::*;

use serde::{Deserialize, Serialize};

use crate::witness::proto::{ClientReply, ClientReq, NodeId, PeerMsg};

/// Largest frame a node or client accepts: a peer message at its bound, plus room.
pub const MAX_FRAME_BYTES: usize = crate::witness::proto::MAX_PEER_MSG_BYTES + 64 * 1024;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Hello {
    Peer(NodeId),
    Client,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum NetMsg {
    Hello(Hello),
    Peer(PeerMsg),
    Req { id: u64, req: ClientReq },
    Resp { id: u64, reply: ClientReply },
}

#[derive(Debug, thiserror::Error)]
pub enum WitnessError {
    #[error(transparent)]
    Wire(#[from] wire::WireError),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("pmem: {0}")]
    Pmem(#[from] crate::witness::store::pmem::PmemError),
    #[error("bad configuration: {0}")]
    Config(String),
    #[error("restoring the node from its tiers: {0}")]
    Restore(String),
    #[error("no node answered: {0}")]
    Unavailable(String),
    #[error("request refused: {0}")]
    Refused(String),
    #[error("the put may or may not have taken effect: {0}")]
    Indeterminate(String),
}
