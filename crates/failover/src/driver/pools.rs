//! The pool the driver runs on: the monitor's own processes ([`LocalPool`]) or the failover
//! agents of other hosts ([`RemotePool`]). One enum rather than a generic driver: the driver
//! also needs what only each kind has (status details, the fault injections, a prewarm).

use std::net::SocketAddr;
use std::sync::Arc;

use crate::agent::RemotePool;
use crate::pool::{InstancePool, LocalPool, PoolError};
use crate::proto::InstanceId;

use super::control::InstanceStatus;

#[derive(Clone)]
pub enum AnyPool {
    Local(Arc<LocalPool>),
    Remote(Arc<RemotePool>),
}

impl AnyPool {
    pub async fn start(&self, id: InstanceId, volume: &str) -> Result<SocketAddr, PoolError> {
        match self {
            AnyPool::Local(p) => p.start(id, volume).await,
            AnyPool::Remote(p) => p.start(id, volume).await,
        }
    }

    pub async fn kill(&self, id: InstanceId) -> Result<(), PoolError> {
        match self {
            AnyPool::Local(p) => p.kill(id).await,
            AnyPool::Remote(p) => p.kill(id).await,
        }
    }

    pub async fn stop(&self, id: InstanceId) -> Result<(), PoolError> {
        match self {
            AnyPool::Local(p) => p.stop(id).await,
            AnyPool::Remote(p) => p.stop(id).await,
        }
    }

    /// The fault injection's crash (not the monitor's fence).
    pub async fn crash(&self, id: InstanceId) -> Result<(), PoolError> {
        match self {
            AnyPool::Local(p) => p.crash(id).await,
            AnyPool::Remote(p) => p.crash(id).await,
        }
    }

    pub async fn pause(&self, id: InstanceId, paused: bool) -> Result<(), PoolError> {
        match self {
            AnyPool::Local(p) => p.pause(id, paused),
            AnyPool::Remote(p) => p.pause_remote(id, paused).await,
        }
    }

    pub async fn cut(&self, id: InstanceId, cut: bool) -> Result<(), PoolError> {
        match self {
            AnyPool::Local(p) => p.cut(id, cut),
            AnyPool::Remote(p) => p.cut_remote(id, cut).await,
        }
    }

    pub fn address(&self, id: InstanceId) -> Option<SocketAddr> {
        match self {
            AnyPool::Local(p) => p.address(id),
            AnyPool::Remote(p) => p.address(id),
        }
    }

    /// Makes the next instance's network namespace ahead (local instances only: an agent
    /// runs its instances without one).
    pub fn prewarm(&self, id: InstanceId) {
        if let AnyPool::Local(p) = self {
            p.prewarm(id);
        }
    }

    pub async fn stop_all(&self) {
        match self {
            AnyPool::Local(p) => p.stop_all().await,
            AnyPool::Remote(p) => p.stop_all().await,
        }
    }

    pub fn status(&self) -> Vec<InstanceStatus> {
        match self {
            AnyPool::Local(pool) => pool
                .instances()
                .into_iter()
                .map(|id| InstanceStatus { id, addr: pool.address(id), pids: pool.pids(id), netns: pool.netns(id), start: pool.start_timing(id), host: None })
                .collect(),
            AnyPool::Remote(pool) => pool
                .placement()
                .into_iter()
                .map(|(id, host)| InstanceStatus { id, addr: pool.address(id), pids: None, netns: None, start: None, host: Some(host) })
                .collect(),
        }
    }
}
