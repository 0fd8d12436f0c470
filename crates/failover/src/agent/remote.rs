//! [`RemotePool`]: the monitor's instance pool when instances run on other hosts, each started
//! by the failover agent of its host ([`super::server`]).
//!
//! **Placement.** A new instance goes to a live host (an agent whose lease in the control
//! store is renewed) other than the hosts of the instances still running ([`super::placement`]):
//! the backup never shares the primary's machine. Which host holds which instance is written to
//! the control store (`failover/placement/<name>`, guarded by the monitor's election) **before**
//! the agent is asked to start it, so a standby monitor that takes over knows where every
//! instance may run ([`RemotePool::adopt`]) and can kill it there.
//!
//! **A dead host.** Every remote call is bounded (a timeout, and the agent's lease watched
//! while it waits): a host that dies mid-call fails the call within about the lease TTL, and the
//! monitor's core repeats it. A kill or stop of an instance whose host's agent lease has expired
//! succeeds without reaching it — see [`RemotePool::kill`] for why that fence is safe.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::placement::place;
use super::proto::*;
use crate::pool::{InstancePool, PoolError};
use crate::proto::InstanceId;
use crate::spec::AppSpec;

/// Bound of a quick request (address, pause, cut, crash): connect, handshake, answer.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound of a kill or stop: the agent tears the instance's volume stack down (its own
/// commands have deadlines); past this the core retries the fence.
pub const FENCE_TIMEOUT: Duration = Duration::from_secs(60);
/// How often a waiting call looks whether the agent's lease still stands.
pub const LIVENESS_POLL: Duration = Duration::from_millis(500);
/// How long a start waits for a live agent to place the instance on (the store may be
/// electing a leader after losing a member) before it fails.
pub const PLACEMENT_WAIT: Duration = Duration::from_secs(10);

/// The system segment of the placement key (the monitor's keys are under it too).
const SYSTEM: &str = "failover";

/// The key where the monitor of application `name` records which host holds each instance.
pub fn placement_key(store: &control::Store, name: &str) -> String {
    store.key(SYSTEM, "placement", name)
}

/// Why a remote call did not get its answer.
#[derive(Debug, thiserror::Error)]
enum CallError {
    /// The agent's lease disappeared while the call waited: its host is dead, or its agent
    /// fenced every instance there.
    #[error("{0}")]
    Gone(String),
    /// Unreachable, timed out, or an unreadable answer: the outcome is unknown.
    #[error("{0}")]
    Failed(String),
}

pub struct RemotePoolConfig {
    pub store: control::Store,
    /// The monitor's leadership: placement writes are guarded by it (a deposed monitor cannot
    /// move instances).
    pub leadership: Arc<control::Leadership>,
    /// The application's name (its keys, and its directory on each agent).
    pub name: String,
    pub app: AppSpec,
    pub mkfs_first: bool,
    pub secret: Vec<u8>,
    /// Bound of a start: the agent's attach timeout and the application's start.
    pub start_timeout: Duration,
}

/// Where an instance runs; as recorded in the store (`placement/<name>`: id → this).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Placed {
    host: String,
    /// Where it is reached, once its start answered.
    addr: Option<SocketAddr>,
}

pub struct RemotePool {
    cfg: RemotePoolConfig,
    /// Instances started (or being started) and not yet killed or stopped, by id.
    placed: Mutex<BTreeMap<InstanceId, Placed>>,
}

impl RemotePool {
    pub fn new(cfg: RemotePoolConfig) -> RemotePool {
        RemotePool { cfg, placed: Mutex::default() }
    }

    /// Live agents: (host, address).
    pub async fn live_agents(&self) -> Result<Vec<(String, SocketAddr)>, String> {
        let live = self.cfg.store.live(AGENT_KIND).await.map_err(|e| format!("control store: {e}"))?;
        Ok(live.into_iter().filter_map(|(h, a)| a.parse().ok().map(|a| (h, a))).collect())
    }

    async fn agent_of(&self, host: &str) -> Result<Option<SocketAddr>, String> {
        Ok(self.live_agents().await?.into_iter().find(|(h, _)| h == host).map(|(_, a)| a))
    }

    /// Where each instance runs (id, host), for status.
    pub fn placement(&self) -> Vec<(InstanceId, String)> {
        self.placed.lock().unwrap().iter().map(|(id, p)| (*id, p.host.clone())).collect()
    }

    /// Reads the placement the previous leader recorded (a monitor that takes over): which
    /// host holds each instance and where it is reached. No agent is asked: one on a dead host
    /// would hold the takeover up, and the monitor's pings tell whether the instance serves.
    /// Returns the instances with an address.
    pub async fn adopt(&self) -> Result<Vec<InstanceId>, String> {
        let k = placement_key(&self.cfg.store, &self.cfg.name);
        let Some(kv) = self.cfg.store.get(&k).await.map_err(|e| format!("control store: {e}"))? else { return Ok(vec![]) };
        let map: BTreeMap<u64, Placed> = serde_json::from_slice(&kv.value).map_err(|e| format!("placement key {k} is corrupt: {e}"))?;
        let running = map.iter().filter(|(_, p)| p.addr.is_some()).map(|(id, _)| InstanceId(*id)).collect();
        // Kept even without an address: a later kill must still reach its host.
        *self.placed.lock().unwrap() = map.into_iter().map(|(id, p)| (InstanceId(id), p)).collect();
        Ok(running)
    }

    /// Records the placement (every instance not yet killed) in the store, guarded by the
    /// election.
    async fn record(&self) -> Result<(), String> {
        let map: BTreeMap<u64, Placed> = self.placed.lock().unwrap().iter().map(|(id, p)| (id.0, p.clone())).collect();
        let k = placement_key(&self.cfg.store, &self.cfg.name);
        self.cfg.leadership.put(&k, serde_json::to_vec(&map).expect("serialisable")).await.map_err(|e| format!("recording the placement: {e}"))?;
        Ok(())
    }

    /// One request to the agent of `host` at `agent`, bounded by `timeout` and by the agent's
    /// lease: the call fails as soon as the host's registration is gone.
    async fn call(&self, host: &str, agent: SocketAddr, req: &AgentRequest, timeout: Duration) -> Result<AgentReply, CallError> {
        let exchange = async {
            let r: Result<AgentReply, String> = async {
                let mut s = tokio::net::TcpStream::connect(agent).await.map_err(|e| format!("cannot reach the agent at {agent}: {e}"))?;
                let _ = s.set_nodelay(true);
                wire::auth::connect(&mut s, &self.cfg.secret).await.map_err(|e| format!("agent {agent}: {e}"))?;
                s.write_all(&encode(req).map_err(|e| e.to_string())?).await.map_err(|e| format!("agent {agent}: {e}"))?;
                let mut header = [0u8; FRAME_HEADER_BYTES];
                s.read_exact(&mut header).await.map_err(|e| format!("agent {agent} closed: {e}"))?;
                let mut body = vec![0u8; body_len(header).map_err(|e| e.to_string())?];
                s.read_exact(&mut body).await.map_err(|e| format!("agent {agent} closed: {e}"))?;
                decode::<AgentReply>(&body).map_err(|e| e.to_string())
            }
            .await;
            r.map_err(CallError::Failed)
        };
        let gone = async {
            loop {
                tokio::time::sleep(LIVENESS_POLL).await;
                // (A store that cannot answer says nothing about the host: keep waiting.)
                if let Ok(live) = self.live_agents().await {
                    if !live.iter().any(|(h, a)| h == host && *a == agent) {
                        return CallError::Gone(format!("the agent of host {host} lost its lease"));
                    }
                }
            }
        };
        tokio::select! {
            r = tokio::time::timeout(timeout, exchange) => r.unwrap_or_else(|_| Err(CallError::Failed(format!("agent {agent} did not answer within {} ms", timeout.as_millis())))),
            why = gone => Err(why),
        }
    }

    /// A fence or stop (`req`) of instance `id`: done when its host's agent says so, or when
    /// that agent's lease is gone.
    async fn fence(&self, id: InstanceId, req: AgentRequest) -> Result<(), PoolError> {
        let Some(host) = self.placed.lock().unwrap().get(&id).map(|p| p.host.clone()) else {
            // Never placed by this monitor or its predecessors (they record before starting).
            return Ok(());
        };
        let err = |msg: String| PoolError::Host { id, host: host.clone(), msg };
        let agent = self.agent_of(&host).await.map_err(err)?;
        let r = match agent {
            // The host is gone (or its agent, which fenced its instances when it lost its
            // lease): nothing of the instance can still write where it matters. See `kill`.
            None => {
                tracing::warn!(%id, host, "the instance's host has no live agent: counted as fenced");
                Ok(())
            }
            Some(agent) => match self.call(&host, agent, &req, FENCE_TIMEOUT).await {
                Ok(AgentReply::Done) => Ok(()),
                Ok(AgentReply::Failed { error }) => Err(error),
                Ok(other) => Err(err(format!("unexpected answer {other:?}"))),
                // Lost its lease while we waited: as above.
                Err(CallError::Gone(why)) => {
                    tracing::warn!(%id, host, "{why} during the fence: counted as fenced");
                    Ok(())
                }
                Err(CallError::Failed(why)) => Err(err(why)),
            },
        };
        if r.is_ok() {
            self.placed.lock().unwrap().remove(&id);
            if let Err(e) = self.record().await {
                // The instance is gone all the same; a stale entry only costs a successor a
                // repeated (idempotent) kill.
                tracing::warn!(%id, "{e}");
            }
        }
        r
    }

    /// Crash of instance `id` (fault injection: the disk cut off, the application SIGKILLed).
    pub async fn crash(&self, id: InstanceId) -> Result<(), PoolError> {
        self.simple(id, AgentRequest::Crash { app: self.cfg.name.clone(), id }).await
    }

    pub async fn pause_remote(&self, id: InstanceId, paused: bool) -> Result<(), PoolError> {
        self.simple(id, AgentRequest::Pause { app: self.cfg.name.clone(), id, paused }).await
    }

    pub async fn cut_remote(&self, id: InstanceId, cut: bool) -> Result<(), PoolError> {
        self.simple(id, AgentRequest::Cut { app: self.cfg.name.clone(), id, cut }).await
    }

    async fn simple(&self, id: InstanceId, req: AgentRequest) -> Result<(), PoolError> {
        let host = self.placed.lock().unwrap().get(&id).map(|p| p.host.clone()).ok_or(PoolError::Unknown(id))?;
        let err = |msg: String| PoolError::Host { id, host: host.clone(), msg };
        let agent = self.agent_of(&host).await.map_err(err)?.ok_or_else(|| err("no live agent".into()))?;
        match self.call(&host, agent, &req, CALL_TIMEOUT).await.map_err(|e| err(e.to_string()))? {
            AgentReply::Done => Ok(()),
            AgentReply::Failed { error } => Err(error),
            other => Err(err(format!("unexpected answer {other:?}"))),
        }
    }

    /// Stops every instance cleanly (the monitor is told to stop).
    pub async fn stop_all(&self) {
        let ids: Vec<InstanceId> = self.placed.lock().unwrap().keys().copied().collect();
        for id in ids {
            if let Err(e) = self.stop(id).await {
                tracing::warn!("stopping {id}: {e}");
            }
        }
    }

    /// Blocks on `f` from a synchronous trait method (the multi-threaded runtime's worker gives
    /// its other tasks away meanwhile).
    fn block<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))
    }
}

impl InstancePool for RemotePool {
    async fn start(&self, id: InstanceId, volume: &str) -> Result<SocketAddr, PoolError> {
        // The agents' keys can be briefly unreadable (the store electing a leader after losing
        // a member, often with the very host that failed): waited for, bounded, rather than
        // failing the start at once.
        let deadline = tokio::time::Instant::now() + PLACEMENT_WAIT;
        let (live, host, fresh) = loop {
            let live = self.live_agents().await;
            let choice = live.as_ref().ok().and_then(|live| {
                let placed = self.placed.lock().unwrap();
                match placed.get(&id) {
                    // A repeated start goes where the first one went.
                    Some(p) => Some((p.host.clone(), false)),
                    None => {
                        let hosts: Vec<String> = live.iter().map(|(h, _)| h.clone()).collect();
                        let occupied: Vec<String> = placed.values().map(|p| p.host.clone()).collect();
                        place(&hosts, &occupied).map(|h| (h, true))
                    }
                }
            });
            match (live, choice) {
                (Ok(live), Some((host, fresh))) => break (live, host, fresh),
                (live, _) if tokio::time::Instant::now() >= deadline => {
                    let msg = match live {
                        Err(e) => e,
                        Ok(_) => "no live failover agent".to_string(),
                    };
                    return Err(PoolError::Host { id, host: "?".into(), msg });
                }
                _ => tokio::time::sleep(LIVENESS_POLL).await,
            }
        };
        let err = |msg: String| PoolError::Host { id, host: host.clone(), msg };
        if fresh {
            self.placed.lock().unwrap().insert(id, Placed { host: host.clone(), addr: None });
            // Recorded before the start: whoever leads next can find (and fence) it.
            if let Err(e) = self.record().await {
                self.placed.lock().unwrap().remove(&id);
                return Err(err(e));
            }
            tracing::info!(%id, host, "instance placed");
        }
        let agent = live.iter().find(|(h, _)| *h == host).map(|(_, a)| *a).ok_or_else(|| err("its host has no live agent".into()))?;
        let req = AgentRequest::Start { app: self.cfg.name.clone(), id, volume: volume.to_string(), spec: self.cfg.app.clone(), mkfs_first: self.cfg.mkfs_first };
        match self.call(&host, agent, &req, self.cfg.start_timeout).await.map_err(|e| err(e.to_string()))? {
            AgentReply::Started { addr } => {
                let changed = match self.placed.lock().unwrap().get_mut(&id) {
                    Some(p) => p.addr.replace(addr) != Some(addr),
                    None => false,
                };
                if changed {
                    // So that the next leader reaches it without asking its agent.
                    if let Err(e) = self.record().await {
                        tracing::warn!(%id, "{e}");
                    }
                }
                Ok(addr)
            }
            AgentReply::Failed { error } => Err(error),
            other => Err(err(format!("unexpected answer {other:?}"))),
        }
    }

    /// Kills instance `id` on its host. When the host's agent has no lease any more, the kill
    /// succeeds without reaching it, so a dead machine cannot hold a failover up forever. That
    /// is safe because of two things. The agent fences itself: one that cannot renew its lease
    /// kills every instance on its host, starting at the lease's deadline by its own clock (no
    /// later than the store expires it), and a dead host runs nothing. And the
    /// volume layer decides what the old primary could still write: a speculative failover
    /// promotes the backup by collapsing the primary's volume into the backup's child at the
    /// tracking shard, after which the parent's writes are refused (SpecREDS §4.4) — exactly one
    /// of primary and backup is ever seen, whatever a partitioned instance still attempts.
    async fn kill(&self, id: InstanceId) -> Result<(), PoolError> {
        self.fence(id, AgentRequest::Kill { app: self.cfg.name.clone(), id }).await
    }

    async fn stop(&self, id: InstanceId) -> Result<(), PoolError> {
        self.fence(id, AgentRequest::Stop { app: self.cfg.name.clone(), id }).await
    }

    fn pause(&self, id: InstanceId, paused: bool) -> Result<(), PoolError> {
        Self::block(self.pause_remote(id, paused))
    }

    fn cut(&self, id: InstanceId, cut: bool) -> Result<(), PoolError> {
        Self::block(self.cut_remote(id, cut))
    }

    fn address(&self, id: InstanceId) -> Option<SocketAddr> {
        self.placed.lock().unwrap().get(&id).and_then(|p| p.addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    const SECRET: &[u8] = b"remote-pool-test-secret";

    fn app() -> AppSpec {
        AppSpec { command: vec!["true".into()], env: Default::default(), stop_grace_ms: 100 }
    }

    async fn leader(dir: &std::path::Path, me: &str) -> control::Daemon {
        control::Daemon::lead(
            control::DaemonConfig {
                store_url: dir.to_str().unwrap().to_string(),
                cluster: "t".into(),
                cluster_id: control::daemon::cluster_id_from_secret("failover", SECRET),
                election: "failover-db".into(),
                election_ttl: Duration::from_secs(2),
                advertise: me.into(),
            },
            |_| {},
        )
        .await
        .unwrap()
    }

    fn pool(d: &control::Daemon) -> RemotePool {
        RemotePool::new(RemotePoolConfig {
            store: d.store().clone(),
            leadership: d.leadership().clone(),
            name: "db".into(),
            app: app(),
            mkfs_first: false,
            secret: SECRET.to_vec(),
            start_timeout: Duration::from_secs(300),
        })
    }

    /// A start sent to a host whose agent never answers (a machine dying mid-call) fails once
    /// its lease is gone — long before the start's own timeout — and the instance is recorded
    /// on that host before the start was sent, so a monitor that takes over finds it. A kill of
    /// it there is then done without reaching the host (it is dead and its agent's lease gone),
    /// rather than holding the failover up.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dead_host_fails_a_start_within_its_lease_and_its_instances_count_as_fenced() {
        let dir = tempfile::tempdir().unwrap();
        let d = leader(dir.path(), "m1").await;
        // An "agent" that accepts connections and never says a word.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let silent_addr = silent.local_addr().unwrap();
        let held = Arc::new(Mutex::new(vec![]));
        let h = held.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = silent.accept().await {
                h.lock().unwrap().push(s);
            }
        });
        let reg = d.store().register(AGENT_KIND, "h0", &silent_addr.to_string(), Duration::from_secs(1)).await.unwrap();
        let p = pool(&d);
        assert_eq!(p.live_agents().await.unwrap(), vec![("h0".to_string(), silent_addr)]);

        let t0 = Instant::now();
        let dies = async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            reg.stop_renewing();
        };
        let (r, ()) = tokio::join!(tokio::time::timeout(Duration::from_secs(30), p.start(InstanceId(1), "db")), dies);
        let took = t0.elapsed();
        let e = r.expect("a start on a dead host was still waiting after 30 s").unwrap_err();
        assert!(e.to_string().contains("lost its lease"), "{e}");
        assert!(took < Duration::from_secs(30), "the start waited {took:?} on a dead host");
        assert_eq!(p.placement(), vec![(InstanceId(1), "h0".to_string())]);
        assert_eq!(p.address(InstanceId(1)), None);

        // A second monitor (same store, as the next leader would read it) finds the placement.
        let next = pool(&d);
        assert_eq!(next.adopt().await.unwrap(), vec![], "i1 never answered its start: no address");
        assert_eq!(next.placement(), vec![(InstanceId(1), "h0".to_string())]);
        // The host is gone: its instance's fence is done without it, and forgotten.
        tokio::time::timeout(Duration::from_secs(10), next.kill(InstanceId(1))).await.expect("a kill on a dead host hung").unwrap();
        assert!(next.placement().is_empty());
        let k = placement_key(d.store(), "db");
        let stored: BTreeMap<u64, Placed> = serde_json::from_slice(&d.store().get(&k).await.unwrap().unwrap().value).unwrap();
        assert!(stored.is_empty(), "{stored:?}");
        // With no live agent, a start has nowhere to go: it fails once it waited its bound.
        let t0 = Instant::now();
        let e = next.start(InstanceId(2), "db").await.unwrap_err();
        assert!(e.to_string().contains("no live failover agent"), "{e}");
        assert!(t0.elapsed() >= PLACEMENT_WAIT, "the start gave up before waiting for an agent");
    }
}
