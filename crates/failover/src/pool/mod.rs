//! The instance pool (§4.1): where application instances run.
//!
//! [`InstancePool`] is what the monitor's driver needs from any pool (local processes today;
//! containers or Kubernetes pods can implement it later); [`LocalPool`] runs each instance as
//! local processes ([`local`]). Below it: [`unit`] (an application as a unit that dies whole),
//! [`teardown`] (an instance's volume stack taken down in the order that cannot wedge the
//! kernel) and [`process`] (pids: alive, start time, signals).

mod local;
pub mod process;
pub mod teardown;
pub mod unit;

use std::net::SocketAddr;

use crate::proto::InstanceId;

pub use local::{LocalPool, LocalPoolConfig};
pub use process::pid_alive;

// Serialisable: a failover agent returns its pool's errors to the monitor as they are.
#[derive(Debug, thiserror::Error, serde::Serialize, serde::Deserialize, Clone, PartialEq)]
pub enum PoolError {
    #[error("instance {0} was killed; ids are never reused")]
    Killed(InstanceId),
    #[error("no instance {0}")]
    Unknown(InstanceId),
    #[error("attaching volume {volume} for instance {id} failed: {msg}")]
    Attach { id: InstanceId, volume: String, msg: String },
    #[error("starting the application of instance {id} failed: {msg}")]
    App { id: InstanceId, msg: String },
    #[error("instance {id}: {msg}")]
    Io { id: InstanceId, msg: String },
    /// The failover agent of the instance's host did not carry the operation out (unreachable,
    /// timed out, refused the request): its outcome is unknown, so the caller repeats it.
    #[error("instance {id} on host {host}: {msg}")]
    Host { id: InstanceId, host: String, msg: String },
}

/// What the monitor's driver needs from a pool. Every operation is idempotent.
pub trait InstancePool: Send + Sync + 'static {
    /// Starts instance `id` on `volume` (or reports the running one); returns its address.
    fn start(&self, id: InstanceId, volume: &str) -> impl std::future::Future<Output = Result<SocketAddr, PoolError>> + Send;
    /// Kills the whole instance at once and detaches its volume (fencing). Final for `id`.
    fn kill(&self, id: InstanceId) -> impl std::future::Future<Output = Result<(), PoolError>> + Send;
    /// Stops the application cleanly (SIGTERM, wait), then detaches the volume (unmount).
    fn stop(&self, id: InstanceId) -> impl std::future::Future<Output = Result<(), PoolError>> + Send;
    /// SIGSTOP / SIGCONT of the whole instance.
    fn pause(&self, id: InstanceId, paused: bool) -> Result<(), PoolError>;
    /// Cuts (or restores) the instance's network link: connections severed, new ones refused.
    fn cut(&self, id: InstanceId, cut: bool) -> Result<(), PoolError>;
    fn address(&self, id: InstanceId) -> Option<SocketAddr>;
}

/// Where an instance's start went (wall clock, ms since the Unix epoch): the bench breaks a
/// recovery down with it.
#[derive(serde::Serialize, serde::Deserialize, Clone, Debug, Default, PartialEq)]
pub struct StartTiming {
    /// `start` called (the attach helper is spawned right after).
    pub requested_unix_ms: u64,
    /// The helper reported the file system mounted.
    pub attached_unix_ms: u64,
    /// The application's process spawned.
    pub spawned_unix_ms: u64,
    /// The helper's own steps, in ms: volume open, FUSE mount, losetup, (mkfs,) mount.
    pub attach_steps_ms: Vec<(String, f64)>,
}
