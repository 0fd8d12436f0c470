//! The runtime driver: runs the [`Monitor`] core against the real instance pool, the client
//! endpoint and the volume service, with wall-clock time.
//!
//! One loop owns the core. Inputs arrive on one bounded channel (ping results, instance exits,
//! results of operations, control requests, ticks). After every step the durable state is
//! written to the journal (when it changed) **before** the step's actions are handed out: pings
//! run as tasks; pool operations and endpoint changes run one at a time on the pool worker;
//! super / collapse / drop run one at a time on the volume worker.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use volume::driver::client::Cluster;
use volume::driver::meta::{MetaReq, MetaResp};

use crate::core::Monitor;
use crate::endpoint::Proxy;
use crate::journal::{FileJournal, Record};
use crate::pool::{InstancePool, LocalPool};
use crate::proto::*;
use crate::spec::{substitute, HealthSpec, Spec};

/// Inputs waiting for the monitor loop at most.
pub const INPUT_QUEUE: usize = 1024;
/// Operations waiting for a worker at most.
pub const WORK_QUEUE: usize = 256;
/// Longest control request line.
pub const MAX_CONTROL_LINE_BYTES: usize = 4096;

/// One health check of an instance at `addr` (its network link).
pub async fn health_check(h: &HealthSpec, addr: SocketAddr, instance: InstanceId) -> bool {
    let timeout = Duration::from_millis(h.timeout_ms);
    if let Some(cmd) = &h.command {
        let args: Vec<String> = cmd.iter().map(|a| substitute(a, Path::new(""), addr.ip(), addr.port(), &instance.to_string())).collect();
        let run = tokio::process::Command::new(&args[0])
            .args(&args[1..])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .status();
        return matches!(tokio::time::timeout(timeout, run).await, Ok(Ok(s)) if s.success());
    }
    if let Some(pg) = &h.postgres {
        let check = async {
            let mut c = crate::pg::PgConn::connect(addr, &pg.user, &pg.database, timeout).await.ok()?;
            let rows = c.query(h.send.as_deref().unwrap_or("SELECT 1")).await.ok()?;
            c.close().await;
            if let Some(e) = &h.expect {
                let first = rows.first().and_then(|r| r.first().cloned().flatten()).unwrap_or_default();
                if !first.starts_with(e.as_str()) {
                    return None;
                }
            }
            Some(())
        };
        return matches!(tokio::time::timeout(timeout, check).await, Ok(Some(())));
    }
    if let Some(my) = &h.mysql {
        let check = async {
            let mut c = crate::mysql::MyConn::connect(addr, &my.user, timeout).await.ok()?;
            let rows = c.query(h.send.as_deref().unwrap_or("SELECT 1")).await.ok()?;
            c.close().await;
            if let Some(e) = &h.expect {
                let first = rows.first().and_then(|r| r.first().cloned().flatten()).unwrap_or_default();
                if !first.starts_with(e.as_str()) {
                    return None;
                }
            }
            Some(())
        };
        return matches!(tokio::time::timeout(timeout, check).await, Ok(Some(())));
    }
    let check = async {
        let mut s = TcpStream::connect(addr).await.ok()?;
        if let Some(send) = &h.send {
            s.write_all(format!("{send}\n").as_bytes()).await.ok()?;
            let mut line = String::new();
            let mut r = BufReader::new(s);
            let n = r.read_line(&mut line).await.ok()?;
            if n == 0 {
                return None;
            }
            if let Some(e) = &h.expect {
                if !line.starts_with(e.as_str()) {
                    return None;
                }
            }
        }
        Some(())
    };
    matches!(tokio::time::timeout(timeout, check).await, Ok(Some(())))
}

/// Super, collapse and drop through the metadata service, each idempotent: a repeated request
/// (after a monitor restart) reports what was already done.
pub struct Volumes {
    pub cluster: Arc<Cluster>,
}

impl Volumes {
    async fn info(&self, name: &str) -> anyhow::Result<Option<volume::driver::meta::VolumeRec>> {
        match self.cluster.meta(MetaReq::Info { name: name.to_string() }).await {
            Ok(MetaResp::Volume(v)) => Ok(Some(v)),
            Ok(other) => anyhow::bail!("unexpected answer {other:?}"),
            Err(e) if e.to_string().contains("no volume") => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub async fn super_(&self, parent: &str, child: &str) -> Input {
        let r: anyhow::Result<Input> = async {
            let Some(p) = self.info(parent).await? else { anyhow::bail!("volume {parent:?} does not exist") };
            match &p.super_child {
                Some(c) if c == child => return Ok(Input::SuperDone { child: child.into() }),
                Some(c) => {
                    return Ok(Input::SuperFailed {
                        child: child.into(),
                        error: format!("{parent} already has super child {c}"),
                        existing_child: Some(c.clone()),
                    })
                }
                None => {}
            }
            self.cluster.meta(MetaReq::Super { parent: parent.into(), child: child.into() }).await?;
            Ok(Input::SuperDone { child: child.into() })
        }
        .await;
        r.unwrap_or_else(|e| Input::SuperFailed { child: child.into(), error: format!("{e:#}"), existing_child: None })
    }

    async fn decided(&self, parent: &str, child: &str) -> anyhow::Result<Option<CollapseOutcome>> {
        let c = self.info(child).await?;
        let p = self.info(parent).await?;
        Ok(match (c, p) {
            (Some(c), _) if c.super_parent.as_deref() == Some(parent) => None,
            (Some(_), None) => Some(CollapseOutcome::Promoted),
            (None, Some(_)) => Some(CollapseOutcome::Rejected),
            (c, p) => anyhow::bail!("cannot tell the state of {child} (exists: {}) and {parent} (exists: {})", c.is_some(), p.is_some()),
        })
    }

    pub async fn collapse(&self, parent: &str, child: &str) -> Input {
        let r: anyhow::Result<CollapseOutcome> = async {
            // Straight to the collapse (it is on the failover's critical path); only when it
            // fails is the outcome looked up: a repeated request (after a restart of the
            // monitor, or a lost answer) finds the child promoted or gone.
            match self.cluster.meta(MetaReq::Collapse { child: child.into() }).await {
                Ok(MetaResp::Collapsed { outcome, .. }) => Ok(match outcome {
                    volume::types::CollapseOutcome::Promoted => CollapseOutcome::Promoted,
                    volume::types::CollapseOutcome::Rejected => CollapseOutcome::Rejected,
                }),
                Ok(other) => anyhow::bail!("unexpected answer {other:?}"),
                Err(e) => match self.decided(parent, child).await? {
                    Some(o) => Ok(o),
                    None => Err(e),
                },
            }
        }
        .await;
        match r {
            Ok(outcome) => Input::CollapseDone { child: child.into(), outcome },
            Err(e) => Input::CollapseFailed { child: child.into(), error: format!("{e:#}") },
        }
    }

    /// Discards a super child and keeps the parent: the metadata service's abort request (the
    /// child is rejected and garbage-collected; the parent keeps permission to write).
    pub async fn drop_child(&self, parent: &str, child: &str) -> Input {
        let r: anyhow::Result<()> = async {
            match self.decided(parent, child).await? {
                Some(CollapseOutcome::Rejected) => return Ok(()),
                Some(CollapseOutcome::Promoted) => anyhow::bail!("{child} was promoted already; it cannot be dropped"),
                None => {}
            }
            match self.cluster.meta(MetaReq::Abort { child: child.into() }).await? {
                MetaResp::Volume(_) => Ok(()),
                other => anyhow::bail!("aborting {child}: unexpected answer {other:?}"),
            }
        }
        .await;
        match r {
            Ok(()) => Input::ChildDropped { child: child.into() },
            Err(e) => Input::DropFailed { child: child.into(), error: format!("{e:#}") },
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGKILL of the whole instance (no flush).
    Kill,
    /// Clean stop: SIGTERM, wait, unmount.
    Stop,
    /// SIGSTOP for the duration (0: until resumed by hand... here: for good).
    Pause,
    /// Network link cut for the duration (0: for good).
    Cut,
}

impl std::str::FromStr for FaultKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "kill" => FaultKind::Kill,
            "stop" => FaultKind::Stop,
            "pause" => FaultKind::Pause,
            "cut" => FaultKind::Cut,
            _ => return Err(format!("unknown fault {s:?} (kill, stop, pause, cut)")),
        })
    }
}

#[derive(Serialize, Debug, Clone)]
pub struct Status {
    /// At rest: the primary serves, nothing suspected, no operation queued or running, no
    /// retry pending ([`Monitor::settled`]). What tests wait for before looking around.
    pub settled: bool,
    pub state: Durable,
    pub endpoint: SocketAddr,
    pub endpoint_target: Option<SocketAddr>,
    pub instances: Vec<InstanceStatus>,
}

#[derive(Serialize, Debug, Clone)]
pub struct InstanceStatus {
    pub id: InstanceId,
    pub addr: Option<SocketAddr>,
    /// (application, attach helper)
    pub pids: Option<(u32, u32)>,
    /// Its network namespace, when it runs in one.
    pub netns: Option<crate::netns::NetnsLink>,
    /// Where its start went (attach steps, application spawned).
    pub start: Option<crate::pool::StartTiming>,
}

pub enum Control {
    Fault { kind: FaultKind, duration_ms: u64, reply: oneshot::Sender<Result<String, String>> },
    Status(oneshot::Sender<Status>),
    Hint { primary_back_after_ms: Option<u64>, recovery_ms: u64 },
}

#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error(transparent)]
    Journal(#[from] crate::journal::JournalError),
    #[error("the monitor gave up: {0}")]
    GaveUp(String),
    #[error("{0}")]
    Other(String),
}

enum Work {
    Start(InstanceId, String),
    Kill(InstanceId),
    Super(String, String),
    Collapse(String, String),
    Drop(String, String),
}

/// Serves control requests (one line each) on `listener`: `status`, `kill`, `stop`,
/// `pause MS`, `cut MS`, `hint BACK_MS|never RECOVERY_MS`.
pub async fn serve_control(listener: TcpListener, tx: mpsc::Sender<Control>) {
    // Accept errors are waited out with backoff (retrying at once spins a core).
    wire::listen::serve(listener, "failover control port", move |s, _| {
        let tx = tx.clone();
        async move {
            let (r, mut w) = s.into_split();
            let mut lines = BufReader::new(r.take(MAX_CONTROL_LINE_BYTES as u64 * 16)).lines();
            // The port has no secret; the tools send their line at once: a connection that
            // sends no request within the authentication deadline of the other ports is closed.
            while let Ok(Ok(Some(line))) = tokio::time::timeout(wire::listen::AUTH_DEADLINE, lines.next_line()).await {
                let reply = control_request(&tx, line.trim()).await;
                let text = match reply {
                    Ok(t) => format!("ok {t}\n"),
                    Err(e) => format!("error {e}\n"),
                };
                if w.write_all(text.as_bytes()).await.is_err() {
                    return;
                }
            }
        }
    })
    .await
}

use tokio::io::AsyncReadExt;

async fn control_request(tx: &mpsc::Sender<Control>, line: &str) -> Result<String, String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let ms = |i: usize| -> Result<u64, String> {
        words.get(i).map(|w| w.parse::<u64>().map_err(|_| format!("{w:?} is not a number of milliseconds"))).unwrap_or(Ok(0))
    };
    match words.first().copied() {
        Some("status") => {
            let (otx, orx) = oneshot::channel();
            tx.send(Control::Status(otx)).await.map_err(|_| "monitor stopped".to_string())?;
            let s = orx.await.map_err(|_| "monitor stopped".to_string())?;
            Ok(serde_json::to_string(&s).unwrap())
        }
        Some("hint") => {
            let back = match words.get(1) {
                Some(&"never") => None,
                _ => Some(ms(1)?),
            };
            tx.send(Control::Hint { primary_back_after_ms: back, recovery_ms: ms(2)? }).await.map_err(|_| "monitor stopped".to_string())?;
            Ok("hint taken".into())
        }
        Some(f) => {
            let kind: FaultKind = f.parse()?;
            let (otx, orx) = oneshot::channel();
            tx.send(Control::Fault { kind, duration_ms: ms(1)?, reply: otx }).await.map_err(|_| "monitor stopped".to_string())?;
            orx.await.map_err(|_| "monitor stopped".to_string())?
        }
        None => Err("empty request".into()),
    }
}

/// What the driver runs with.
pub struct Parts {
    pub cluster: Arc<Cluster>,
    pub pool: Arc<LocalPool>,
    /// Inputs from the pool (instance exits) and the workers; `inputs_tx` feeds it.
    pub inputs: mpsc::Receiver<Input>,
    pub inputs_tx: mpsc::Sender<Input>,
    pub endpoint: Arc<Proxy>,
    pub control: mpsc::Receiver<Control>,
}

/// Runs the monitor until `shutdown` resolves (then stops every instance cleanly) or it gives up.
/// `on_event` sees every [`Event`] (the CLI prints them).
pub async fn run(
    spec: &Spec,
    parts: Parts,
    mut on_event: impl FnMut(&Event),
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<Durable, DriverError> {
    let Parts { cluster, pool, mut inputs, inputs_tx, endpoint, mut control } = parts;
    let journal = FileJournal::new(&spec.state_dir.join("monitor.json"));
    let now = now_unix_ms();
    let mut m = match journal.load()? {
        Some(rec) => {
            if rec.config != spec.monitor {
                tracing::warn!("the spec's monitor settings differ from the journal's; using the spec's");
            }
            tracing::info!(phase = ?rec.state.phase, "resuming from {}", journal.path().display());
            Monitor::recover(spec.monitor.clone(), rec.state, now)
        }
        None => Monitor::new(spec.monitor.clone(), spec.volume.clone(), now),
    };
    let first = m.take_outputs();
    let mut saved = m.durable().clone();
    journal.save(&Record { config: spec.monitor.clone(), state: saved.clone() })?;

    let (work_tx, mut work_rx) = mpsc::channel::<Work>(WORK_QUEUE);
    let (vol_tx, mut vol_rx) = mpsc::channel::<Work>(WORK_QUEUE);
    // Operations queued or running on the workers (for `Status::settled`).
    let busy = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // Pool worker: instances and the endpoint, one operation at a time.
    {
        let busy = busy.clone();
        let pool = pool.clone();
        let tx = inputs_tx.clone();
        tokio::spawn(async move {
            while let Some(w) = work_rx.recv().await {
                let input = match w {
                    Work::Start(id, vol) => match pool.start(id, &vol).await {
                        Ok(_) => Input::InstanceStarted(id),
                        Err(e) => Input::InstanceStartFailed { id, error: e.to_string() },
                    },
                    Work::Kill(id) => match pool.kill(id).await {
                        Ok(()) => Input::InstanceStopped(id),
                        Err(e) => {
                            tracing::error!("kill {id}: {e}");
                            // The core retries it: a fence must not be skipped.
                            Input::KillFailed { id, error: e.to_string() }
                        }
                    },
                    _ => unreachable!(),
                };
                busy.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                if tx.send(input).await.is_err() {
                    return;
                }
            }
        });
    }
    // Volume worker.
    {
        let busy = busy.clone();
        let volumes = Volumes { cluster };
        let tx = inputs_tx.clone();
        tokio::spawn(async move {
            while let Some(w) = vol_rx.recv().await {
                let input = match w {
                    Work::Super(p, c) => volumes.super_(&p, &c).await,
                    Work::Collapse(p, c) => volumes.collapse(&p, &c).await,
                    Work::Drop(p, c) => volumes.drop_child(&p, &c).await,
                    _ => unreachable!(),
                };
                busy.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                if tx.send(input).await.is_err() {
                    return;
                }
            }
        });
    }

    let health = Arc::new(spec.health.clone());
    let mut gave_up: Option<String> = None;
    let dispatch = |actions: Vec<Action>, gave_up: &mut Option<String>, on_event: &mut dyn FnMut(&Event)| -> Vec<Work> {
        let mut work = vec![];
        for a in actions {
            match a {
                Action::Ping(id) => {
                    let tx = inputs_tx.clone();
                    let addr = pool.address(id);
                    let h = health.clone();
                    tokio::spawn(async move {
                        let ok = match addr {
                            Some(a) => health_check(&h, a, id).await,
                            None => false,
                        };
                        let _ = tx.send(if ok { Input::PingOk(id) } else { Input::PingFailed(id) }).await;
                    });
                }
                Action::StartInstance { id, volume } => work.push(Work::Start(id, volume)),
                Action::KillInstance(id) => work.push(Work::Kill(id)),
                // Endpoint changes at once, in the order issued: a re-point queued behind a slow
                // start must never undo a later freeze.
                Action::PointEndpoint(id) => {
                    let input = match pool.address(id) {
                        Some(addr) => {
                            endpoint.point(Some(addr));
                            tracing::info!(%id, %addr, "endpoint re-pointed");
                            Input::EndpointPointed(id)
                        }
                        None => Input::EndpointFailed { id, error: format!("instance {id} has no address") },
                    };
                    let tx = inputs_tx.clone();
                    tokio::spawn(async move {
                        let _ = tx.send(input).await;
                    });
                }
                // At once, before the collapse that follows it is even queued.
                Action::FreezeEndpoint => {
                    endpoint.freeze();
                    tracing::info!("endpoint frozen before collapse");
                }
                Action::Super { parent, child } => work.push(Work::Super(parent, child)),
                Action::Collapse { parent, child } => work.push(Work::Collapse(parent, child)),
                Action::DropChild { parent, child } => work.push(Work::Drop(parent, child)),
                Action::Notify(e) => {
                    if let Event::GaveUp { reason } = &e {
                        *gave_up = Some(reason.clone());
                    }
                    on_event(&e);
                }
            }
        }
        work
    };
    let first_work = dispatch(first, &mut gave_up, &mut on_event);
    for w in first_work {
        busy.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        send_work(&work_tx, &vol_tx, w).await;
    }
    let mut tick = tokio::time::interval(Duration::from_millis(spec.monitor.tick_interval_ms()));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        let input = tokio::select! {
            _ = &mut shutdown => break,
            _ = tick.tick() => Input::Tick,
            Some(i) = inputs.recv() => i,
            Some(c) = control.recv() => {
                match c {
                    Control::Status(reply) => {
                        let mut instances = vec![];
                        for id in pool.instances() {
                            instances.push(InstanceStatus { id, addr: pool.address(id), pids: pool.pids(id), netns: pool.netns(id), start: pool.start_timing(id) });
                        }
                        let _ = reply.send(Status {
                            settled: m.settled() && busy.load(std::sync::atomic::Ordering::SeqCst) == 0,
                            state: m.durable().clone(),
                            endpoint: endpoint.local_addr(),
                            endpoint_target: endpoint.target(),
                            instances,
                        });
                        continue;
                    }
                    Control::Fault { kind, duration_ms, reply } => {
                        // Off the loop: a crash waits for the instance's other operations.
                        let (pool, primary) = (pool.clone(), m.durable().primary);
                        tokio::spawn(async move {
                            let _ = reply.send(inject(&pool, primary, kind, duration_ms).await);
                        });
                        continue;
                    }
                    Control::Hint { primary_back_after_ms, recovery_ms } => Input::OracleHint { primary_back_after_ms, recovery_ms },
                }
            }
        };
        if !matches!(input, Input::Tick) {
            tracing::debug!(?input, "input");
        }
        m.handle(now_unix_ms(), input);
        let actions = m.take_outputs();
        if *m.durable() != saved {
            saved = m.durable().clone();
            journal.save(&Record { config: spec.monitor.clone(), state: saved.clone() })?;
        }
        for a in &actions {
            if !matches!(a, Action::Ping(_) | Action::Notify(_)) {
                tracing::info!(?a, "action");
            }
        }
        let work = dispatch(actions, &mut gave_up, &mut on_event);
        for w in work {
            busy.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            send_work(&work_tx, &vol_tx, w).await;
        }
        // While all is well, the next instance's network namespace is made ahead (whichever
        // policy: a backup, a REDS restart or the oracle's all start as that instance).
        if m.durable().phase == Phase::Normal {
            pool.prewarm(InstanceId(m.durable().next_instance));
        }
        if let Some(r) = gave_up.take() {
            pool.stop_all().await;
            return Err(DriverError::GaveUp(r));
        }
    }
    pool.stop_all().await;
    // (Shutting down issues no action: the instances are stopped already.)
    m.handle(now_unix_ms(), Input::Shutdown);
    journal.save(&Record { config: spec.monitor.clone(), state: m.durable().clone() })?;
    Ok(m.durable().clone())
}

async fn send_work(pool: &mpsc::Sender<Work>, vols: &mpsc::Sender<Work>, w: Work) {
    let ch = match w {
        Work::Super(..) | Work::Collapse(..) | Work::Drop(..) => vols,
        _ => pool,
    };
    let _ = ch.send(w).await;
}

/// Injects a fault into the current primary (tests, benchmarks, the demo).
async fn inject(pool: &Arc<LocalPool>, primary: InstanceId, kind: FaultKind, duration_ms: u64) -> Result<String, String> {
    if pool.address(primary).is_none() {
        return Err(format!("primary {primary} is not running"));
    }
    match kind {
        FaultKind::Kill => {
            // Not the pool's kill: detaching is the monitor's job (its fence). A crash is the
            // disk cut off (the helper's FUSE connection aborted: nothing more reaches the
            // volume) and the application SIGKILLed.
            pool.crash(primary).await.map_err(|e| e.to_string())?;
        }
        FaultKind::Stop => {
            let pool = pool.clone();
            tokio::spawn(async move {
                if let Err(e) = pool.stop(primary).await {
                    tracing::warn!("clean stop of {primary}: {e}");
                }
            });
        }
        FaultKind::Pause | FaultKind::Cut => {
            let set = |on: bool| match kind {
                FaultKind::Pause => pool.pause(primary, on),
                _ => pool.cut(primary, on),
            };
            set(true).map_err(|e| e.to_string())?;
            if duration_ms > 0 {
                let pool = pool.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(duration_ms)).await;
                    let r = match kind {
                        FaultKind::Pause => pool.pause(primary, false),
                        _ => pool.cut(primary, false),
                    };
                    if let Err(e) = r {
                        tracing::info!("healing {primary}: {e}");
                    }
                });
            }
        }
    }
    Ok(format!("{kind:?} injected into primary {primary}"))
}

#[cfg(test)]
mod control_port_tests {
    use super::*;
    use std::time::Instant;
    use tokio::io::AsyncBufReadExt;

    /// A flood of idle connections neither stops the control port nor stays open past the
    /// deadline; a real request is answered afterwards.
    #[tokio::test]
    async fn control_port_survives_a_flood_and_closes_idle_connections() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, mut rx) = mpsc::channel::<Control>(64);
        tokio::spawn(serve_control(l, tx));
        tokio::spawn(async move { while rx.recv().await.is_some() {} });
        let mut flood = Vec::new();
        for _ in 0..300 {
            flood.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        drop(flood);
        let s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (r, mut w) = s.into_split();
        w.write_all(b"hint 10 20\n").await.unwrap();
        let mut line = String::new();
        tokio::time::timeout(std::time::Duration::from_secs(10), BufReader::new(r).read_line(&mut line)).await.unwrap().unwrap();
        assert_eq!(line.trim(), "ok hint taken");

        let t0 = Instant::now();
        let mut idle = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut b = [0u8; 1];
        let n = tokio::time::timeout(wire::listen::AUTH_DEADLINE * 3, idle.read(&mut b)).await;
        assert!(matches!(n, Ok(Ok(0)) | Ok(Err(_))), "an idle control connection stayed open for {:?}", t0.elapsed());
    }
}
