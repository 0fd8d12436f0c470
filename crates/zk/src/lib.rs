//! A small ZooKeeper client and a real local ZooKeeper ensemble, for comparing HEAL's recovery
//! with ZooKeeper's (HEAL paper §II-C, §IX-D).
//!
//! ZooKeeper recovers a returning follower reactively: the follower reports its last zxid, the
//! leader answers from its log (DIFF, or a snapshot, redundant updates included) and the
//! follower serves again once synchronised. To measure that on the real thing, this crate:
//!
//! - [`jute`]: the client wire protocol (length-framed jute records), sans-I/O — encode
//!   `ConnectRequest` / create / setData / getData / ping, decode replies, split frames with a
//!   size limit;
//! - [`ZkClient`]: a tokio client with many requests in flight on one session, pings, and the
//!   zxid of every reply;
//! - [`fourlw`]: four-letter-word probes (`srvr`: mode and last applied zxid of a server);
//! - [`Ensemble`]: starts N `QuorumPeerMain` JVMs from Debian's `zookeeper` package on loopback
//!   ports with generated `zoo.cfg` files in a private directory, and kills, stops, continues
//!   and restarts single servers; every JVM is killed when the [`Ensemble`] is dropped.

pub mod client;
pub mod ensemble;
pub mod fourlw;
pub mod jute;

pub use client::ZkClient;
pub use ensemble::{Ensemble, EnsembleOptions};
pub use fourlw::{srvr, ServerState};

use std::net::SocketAddr;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ZkError {
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The server sent something this client cannot decode; the connection is closed.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The request would be refused (bad path, data too large); nothing was sent.
    #[error("bad argument: {0}")]
    BadArgument(String),
    /// The server answered with an error code.
    #[error("{op} {path}: {name} (code {code})")]
    Server {
        op: &'static str,
        path: String,
        code: i32,
        name: &'static str,
    },
    #[error("{0} refused the session (expired, or not serving)")]
    SessionRefused(SocketAddr),
    /// The connection closed with the request in flight: it may or may not have been applied.
    #[error("connection to {0} lost")]
    ConnectionLost(SocketAddr),
    #[error("no answer within {0:?} (the request may or may not have been applied)")]
    Timeout(Duration),
    /// ZooKeeper or Java is missing, or the ensemble did not start.
    #[error("{0}")]
    Setup(String),
}
