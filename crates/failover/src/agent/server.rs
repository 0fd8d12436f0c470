//! The failover agent of one host (`understudy failover agent`): runs a [`LocalPool`] per
//! application on its host for the monitor, which reaches it over TCP ([`serve`], protocol in
//! [`super::proto`]). It makes no decision: it carries out the monitor's start, kill, stop,
//! crash, pause, cut and address requests, each idempotent.
//!
//! State: `STATE_DIR/<app>/` is that application's pool directory (mount points, logs, the
//! instance table a restarted agent adopts from), `STATE_DIR/<app>/app.json` the application
//! spec the monitor sent with its first start (so a restarted agent can adopt before any
//! request).

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use super::proto::*;
use crate::pool::{InstancePool, LocalPool, LocalPoolConfig};
use crate::proto::Input;
use crate::spec::AppSpec;

/// Instance events (exits) each pool may queue before the agent's logger reads them.
pub const POOL_EVENT_QUEUE: usize = 256;

#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// The `understudy` executable (for `volume attach` / `volume detach`).
    pub exe: PathBuf,
    /// Arguments that find the volume cluster, e.g. `["--meta", "...", "--secret-file", "..."]`.
    pub conn_args: Vec<String>,
    pub state_dir: PathBuf,
    /// Where instances are reached: the host's address, so the monitor and the endpoints on
    /// other hosts can.
    pub link_ip: IpAddr,
    pub attach_timeout: Duration,
}

pub struct Agent {
    cfg: AgentConfig,
    pools: Mutex<HashMap<String, Arc<LocalPool>>>,
}

impl Agent {
    pub fn new(cfg: AgentConfig) -> std::io::Result<Agent> {
        std::fs::create_dir_all(&cfg.state_dir)?;
        Ok(Agent { cfg, pools: Mutex::default() })
    }

    /// Adopts the instances a previous run left running (every application with an `app.json`).
    pub async fn adopt_all(&self) -> Vec<(String, Vec<crate::proto::InstanceId>)> {
        let mut out = vec![];
        let Ok(dir) = std::fs::read_dir(&self.cfg.state_dir) else { return out };
        for e in dir.flatten() {
            let app = e.file_name().to_string_lossy().into_owned();
            if check_app_name(&app).is_err() {
                continue;
            }
            let Ok(bytes) = std::fs::read(e.path().join("app.json")) else { continue };
            let Ok((spec, mkfs_first)) = serde_json::from_slice::<(AppSpec, bool)>(&bytes) else {
                tracing::warn!("ignoring unreadable {}", e.path().join("app.json").display());
                continue;
            };
            match self.pool(&app, Some((&spec, mkfs_first))) {
                Ok(Some(p)) => out.push((app, p.adopt().await)),
                Ok(None) => {}
                Err(e) => tracing::warn!("cannot adopt application {app}: {e}"),
            }
        }
        out
    }

    /// The pool of `app`; made (its spec recorded first) when `spec` is given and there is none.
    fn pool(&self, app: &str, spec: Option<(&AppSpec, bool)>) -> Result<Option<Arc<LocalPool>>, String> {
        check_app_name(app)?;
        let mut pools = self.pools.lock().unwrap();
        if let Some(p) = pools.get(app) {
            return Ok(Some(p.clone()));
        }
        let Some((spec, mkfs_first)) = spec else { return Ok(None) };
        let dir = self.cfg.state_dir.join(app);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        std::fs::write(dir.join("app.json"), serde_json::to_vec(&(spec, mkfs_first)).expect("serialisable")).map_err(|e| format!("{}: {e}", dir.display()))?;
        let (tx, mut rx) = mpsc::channel::<Input>(POOL_EVENT_QUEUE);
        let tag = app.to_string();
        // The monitor learns of an instance's death from its pings (it cannot hear this
        // host's events once the host is gone, so it never relies on them): logged only.
        tokio::spawn(async move {
            while let Some(ev) = rx.recv().await {
                tracing::info!(app = %tag, ?ev, "instance event");
            }
        });
        let pool = LocalPool::new(
            LocalPoolConfig {
                exe: self.cfg.exe.clone(),
                conn_args: self.cfg.conn_args.clone(),
                state_dir: dir.clone(),
                app: spec.clone(),
                mkfs_first,
                attach_timeout: self.cfg.attach_timeout,
                // The instance is reached at the host's address through the pool's proxy: a
                // namespace's veth address is routed on this host only.
                netns: false,
            },
            tx,
        )
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .with_link_ip(self.cfg.link_ip);
        let pool = Arc::new(pool);
        pools.insert(app.to_string(), pool.clone());
        Ok(Some(pool))
    }

    /// Carries out one request.
    pub async fn handle(&self, req: AgentRequest) -> AgentReply {
        let (app, id) = (req.app().to_string(), req.id());
        let spec = match &req {
            AgentRequest::Start { spec, mkfs_first, .. } => Some((spec, *mkfs_first)),
            _ => None,
        };
        let pool = match self.pool(&app, spec) {
            Ok(p) => p,
            Err(why) => return AgentReply::Refused { why },
        };
        let done = |r: Result<(), crate::pool::PoolError>| match r {
            Ok(()) => AgentReply::Done,
            Err(error) => AgentReply::Failed { error },
        };
        let Some(pool) = pool else {
            // Nothing of `app` ever ran here: a kill or stop has nothing to do (idempotent).
            return match req {
                AgentRequest::Kill { .. } | AgentRequest::Stop { .. } | AgentRequest::Crash { .. } => AgentReply::Done,
                AgentRequest::Address { .. } => AgentReply::Address { addr: None },
                _ => AgentReply::Failed { error: crate::pool::PoolError::Unknown(id) },
            };
        };
        match req {
            AgentRequest::Start { volume, .. } => match pool.start(id, &volume).await {
                Ok(addr) => AgentReply::Started { addr },
                Err(error) => AgentReply::Failed { error },
            },
            AgentRequest::Kill { .. } => done(pool.kill(id).await),
            AgentRequest::Stop { .. } => done(pool.stop(id).await),
            AgentRequest::Crash { .. } => done(pool.crash(id).await),
            AgentRequest::Pause { paused, .. } => done(pool.pause(id, paused)),
            AgentRequest::Cut { cut, .. } => done(pool.cut(id, cut)),
            AgentRequest::Address { .. } => AgentReply::Address { addr: pool.address(id) },
        }
    }

    /// Kills every instance of every application here: the agent's lease is lost, so the
    /// monitor may already count this host's instances as gone and start others (see
    /// [`super::remote`]); they must not go on serving.
    pub async fn fence_all(&self) {
        let pools: Vec<Arc<LocalPool>> = self.pools.lock().unwrap().values().cloned().collect();
        for p in pools {
            for id in p.instances() {
                if let Err(e) = p.kill(id).await {
                    tracing::error!("fencing {id}: {e}");
                }
            }
        }
    }

    /// Stops every instance cleanly (the agent is told to stop).
    pub async fn stop_all(&self) {
        let pools: Vec<Arc<LocalPool>> = self.pools.lock().unwrap().values().cloned().collect();
        for p in pools {
            p.stop_all().await;
        }
    }
}

/// Serves the monitor's requests on `listener`: each connection after the cluster's
/// challenge-response handshake, then frames of one request and one reply. A connection that
/// fails the handshake, announces a frame over [`MAX_AGENT_FRAME_BYTES`], or sends nothing for
/// the authentication deadline between requests is closed; an unreadable request is answered
/// [`AgentReply::Refused`] and the connection closed. Requests run as tasks of their own, so a
/// client that goes away mid-start does not abandon the start half-way.
pub async fn serve(listener: TcpListener, secret: Vec<u8>, agent: Arc<Agent>) {
    let secret: Arc<[u8]> = secret.into();
    wire::listen::serve(listener, "failover agent", move |mut s, peer| {
        let (secret, agent) = (secret.clone(), agent.clone());
        async move {
            if let Err(e) = wire::auth::accept(&mut s, &secret).await {
                tracing::warn!("failover agent: refused {peer}: {e}");
                return;
            }
            loop {
                let mut header = [0u8; FRAME_HEADER_BYTES];
                match tokio::time::timeout(wire::listen::AUTH_DEADLINE, s.read_exact(&mut header)).await {
                    Ok(Ok(_)) => {}
                    _ => return,
                }
                let n = match body_len(header) {
                    Ok(n) => n,
                    Err(e) => {
                        tracing::warn!("failover agent: {peer}: {e}; closing");
                        let _ = write(&mut s, &AgentReply::Refused { why: e.to_string() }).await;
                        return;
                    }
                };
                let mut body = vec![0u8; n];
                match tokio::time::timeout(wire::listen::AUTH_DEADLINE, s.read_exact(&mut body)).await {
                    Ok(Ok(_)) => {}
                    _ => return,
                }
                let req: AgentRequest = match decode(&body) {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!("failover agent: {peer}: {e}; closing");
                        let _ = write(&mut s, &AgentReply::Refused { why: e.to_string() }).await;
                        return;
                    }
                };
                tracing::info!(%peer, ?req, "request");
                let agent = agent.clone();
                let reply = match tokio::spawn(async move { agent.handle(req).await }).await {
                    Ok(r) => r,
                    Err(e) => AgentReply::Refused { why: format!("the request failed: {e}") },
                };
                if write(&mut s, &reply).await.is_err() {
                    return;
                }
            }
        }
    })
    .await
}

async fn write(s: &mut tokio::net::TcpStream, reply: &AgentReply) -> std::io::Result<()> {
    let f = encode(reply).map_err(std::io::Error::other)?;
    s.write_all(&f).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::InstanceId;

    const SECRET: &[u8] = b"agent-test-secret";

    async fn agent() -> (std::net::SocketAddr, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let agent = Arc::new(
            Agent::new(AgentConfig {
                exe: "/bin/false".into(),
                conn_args: vec![],
                state_dir: dir.path().join("agent"),
                link_ip: std::net::Ipv4Addr::LOCALHOST.into(),
                attach_timeout: Duration::from_secs(1),
            })
            .unwrap(),
        );
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(serve(l, SECRET.to_vec(), agent));
        (addr, dir)
    }

    /// Sends `bytes` after the handshake (with `secret`); the reply frame, None when closed
    /// without one.
    async fn exchange(addr: std::net::SocketAddr, secret: Option<&[u8]>, bytes: &[u8]) -> Option<AgentReply> {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        if let Some(secret) = secret {
            wire::auth::connect(&mut s, secret).await.ok()?;
        }
        s.write_all(bytes).await.ok()?;
        let read = async {
            let mut header = [0u8; FRAME_HEADER_BYTES];
            s.read_exact(&mut header).await.ok()?;
            let mut body = vec![0u8; body_len(header).ok()?];
            s.read_exact(&mut body).await.ok()?;
            decode::<AgentReply>(&body).ok()
        };
        tokio::time::timeout(wire::listen::AUTH_DEADLINE * 3, read).await.ok().flatten()
    }

    fn frame(body: &[u8]) -> Vec<u8> {
        let mut f = (body.len() as u32).to_be_bytes().to_vec();
        f.extend_from_slice(body);
        f
    }

    /// Without the secret nothing is obeyed; an oversized frame, an unreadable request and an
    /// unsafe application name are refused (the agent goes on serving); a kill or stop of an
    /// instance that never ran here is done, repeatedly (idempotent).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_agent_refuses_bad_requests_obeys_only_the_secret_and_serves_on() {
        let (addr, dir) = agent().await;
        let kill = encode(&AgentRequest::Kill { app: "db".into(), id: InstanceId(1) }).unwrap();
        assert_eq!(exchange(addr, None, &kill).await, None, "a client without the handshake got an answer");
        assert_eq!(exchange(addr, Some(b"wrong"), &kill).await, None, "a client with a wrong secret got an answer");

        let huge = ((MAX_AGENT_FRAME_BYTES + 1) as u32).to_be_bytes();
        assert!(matches!(exchange(addr, Some(SECRET), &huge).await, Some(AgentReply::Refused { .. })));
        assert!(matches!(exchange(addr, Some(SECRET), &frame(b"{not json")).await, Some(AgentReply::Refused { .. })));
        assert!(matches!(exchange(addr, Some(SECRET), &frame(br#"{"op":"format","app":"db","id":1}"#)).await, Some(AgentReply::Refused { .. })));
        let escape = encode(&AgentRequest::Kill { app: "../../etc".into(), id: InstanceId(1) }).unwrap();
        assert!(matches!(exchange(addr, Some(SECRET), &escape).await, Some(AgentReply::Refused { .. })));
        assert!(!dir.path().join("etc").exists());

        for _ in 0..2 {
            assert_eq!(exchange(addr, Some(SECRET), &kill).await, Some(AgentReply::Done));
            let stop = encode(&AgentRequest::Stop { app: "db".into(), id: InstanceId(1) }).unwrap();
            assert_eq!(exchange(addr, Some(SECRET), &stop).await, Some(AgentReply::Done));
        }
        let address = encode(&AgentRequest::Address { app: "db".into(), id: InstanceId(1) }).unwrap();
        assert_eq!(exchange(addr, Some(SECRET), &address).await, Some(AgentReply::Address { addr: None }));
        let pause = encode(&AgentRequest::Pause { app: "db".into(), id: InstanceId(1), paused: true }).unwrap();
        assert_eq!(exchange(addr, Some(SECRET), &pause).await, Some(AgentReply::Failed { error: crate::pool::PoolError::Unknown(InstanceId(1)) }));
    }
}
