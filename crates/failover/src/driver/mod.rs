//! The runtime driver: runs the [`Monitor`] core against the real instance pool, the client
//! endpoint and the volume service, with wall-clock time.
//!
//! One loop owns the core. Inputs arrive on one bounded channel (ping results, instance exits,
//! results of operations, control requests, ticks). After every step the durable state is
//! written to the journal (when it changed) **before** the step's actions are handed out: pings
//! run as tasks; pool operations and endpoint changes run one at a time on the pool worker;
//! super / collapse / drop run one at a time on the volume worker.
//!
//! [`control`]: the control port and fault injection; [`volumes`]: the volume operations.

mod control;
mod volumes;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use volume::driver::client::Cluster;

use crate::core::Monitor;
use crate::endpoint::Proxy;
use crate::health::health_check;
use crate::journal::{FileJournal, Record};
use crate::pool::{InstancePool, LocalPool};
use crate::proto::*;
use crate::spec::{HealthSpec, Spec};

pub use control::{serve_control, Control, FaultKind, InstanceStatus, Status, MAX_CONTROL_LINE_BYTES};
pub use volumes::Volumes;

/// Inputs waiting for the monitor loop at most.
pub const INPUT_QUEUE: usize = 1024;
/// Operations waiting for a worker at most.
pub const WORK_QUEUE: usize = 256;

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
    let mut m = start_monitor(spec, &journal)?;
    let mut saved = m.durable().clone();
    journal.save(&Record { config: spec.monitor.clone(), state: saved.clone() })?;
    let workers = Workers::spawn(pool.clone(), Volumes { cluster }, inputs_tx.clone());
    let actions = Actions { pool: pool.clone(), endpoint: endpoint.clone(), inputs_tx, health: Arc::new(spec.health.clone()) };
    let mut gave_up: Option<String> = None;
    for w in actions.carry_out(m.take_outputs(), &mut gave_up, &mut on_event) {
        workers.send(w).await;
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
                        let _ = reply.send(control::status(&m, &pool, &endpoint, workers.busy()));
                        continue;
                    }
                    Control::Fault { kind, duration_ms, reply } => {
                        // Off the loop: a crash waits for the instance's other operations.
                        let (pool, primary) = (pool.clone(), m.durable().primary);
                        tokio::spawn(async move {
                            let _ = reply.send(control::inject(&pool, primary, kind, duration_ms).await);
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
        let out = m.take_outputs();
        if *m.durable() != saved {
            saved = m.durable().clone();
            journal.save(&Record { config: spec.monitor.clone(), state: saved.clone() })?;
        }
        for a in &out {
            if !matches!(a, Action::Ping(_) | Action::Notify(_)) {
                tracing::info!(?a, "action");
            }
        }
        for w in actions.carry_out(out, &mut gave_up, &mut on_event) {
            workers.send(w).await;
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

/// The monitor as the journal left it (resumed mid-failover if it was), or a fresh one that
/// boots the spec's volume.
fn start_monitor(spec: &Spec, journal: &FileJournal) -> Result<Monitor, DriverError> {
    let now = now_unix_ms();
    Ok(match journal.load()? {
        Some(rec) => {
            if rec.config != spec.monitor {
                tracing::warn!("the spec's monitor settings differ from the journal's; using the spec's");
            }
            tracing::info!(phase = ?rec.state.phase, "resuming from {}", journal.path().display());
            Monitor::recover(spec.monitor.clone(), rec.state, now)
        }
        None => Monitor::new(spec.monitor.clone(), spec.volume.clone(), now),
    })
}

/// The two workers that carry out the slow actions, one at a time each, and report their
/// result as an input: the pool worker (start, kill) and the volume worker (super, collapse,
/// drop). Each takes at most [`WORK_QUEUE`] waiting operations.
struct Workers {
    pool_tx: mpsc::Sender<Work>,
    volume_tx: mpsc::Sender<Work>,
    /// Operations queued or running on the workers (for `Status::settled`).
    busy: Arc<AtomicUsize>,
}

impl Workers {
    fn spawn(pool: Arc<LocalPool>, volumes: Volumes, inputs: mpsc::Sender<Input>) -> Workers {
        let (pool_tx, mut pool_rx) = mpsc::channel::<Work>(WORK_QUEUE);
        let (volume_tx, mut volume_rx) = mpsc::channel::<Work>(WORK_QUEUE);
        let busy = Arc::new(AtomicUsize::new(0));
        // Pool worker: instances, one operation at a time.
        {
            let busy = busy.clone();
            let tx = inputs.clone();
            tokio::spawn(async move {
                while let Some(w) = pool_rx.recv().await {
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
                    busy.fetch_sub(1, Ordering::SeqCst);
                    if tx.send(input).await.is_err() {
                        return;
                    }
                }
            });
        }
        // Volume worker.
        {
            let busy = busy.clone();
            let tx = inputs;
            tokio::spawn(async move {
                while let Some(w) = volume_rx.recv().await {
                    let input = match w {
                        Work::Super(p, c) => volumes.super_(&p, &c).await,
                        Work::Collapse(p, c) => volumes.collapse(&p, &c).await,
                        Work::Drop(p, c) => volumes.drop_child(&p, &c).await,
                        _ => unreachable!(),
                    };
                    busy.fetch_sub(1, Ordering::SeqCst);
                    if tx.send(input).await.is_err() {
                        return;
                    }
                }
            });
        }
        Workers { pool_tx, volume_tx, busy }
    }

    /// Queues `w` on its worker (waits while that queue is full).
    async fn send(&self, w: Work) {
        self.busy.fetch_add(1, Ordering::SeqCst);
        let ch = match w {
            Work::Super(..) | Work::Collapse(..) | Work::Drop(..) => &self.volume_tx,
            _ => &self.pool_tx,
        };
        let _ = ch.send(w).await;
    }

    fn busy(&self) -> usize {
        self.busy.load(Ordering::SeqCst)
    }
}

/// Carries out the monitor's actions: pings as tasks, endpoint changes at once, events to the
/// caller; the rest becomes [`Work`] for the workers.
struct Actions {
    pool: Arc<LocalPool>,
    endpoint: Arc<Proxy>,
    inputs_tx: mpsc::Sender<Input>,
    health: Arc<HealthSpec>,
}

impl Actions {
    /// Returns the work for the workers, in the order issued; a `GaveUp` event sets `gave_up`.
    fn carry_out(&self, actions: Vec<Action>, gave_up: &mut Option<String>, on_event: &mut dyn FnMut(&Event)) -> Vec<Work> {
        let (pool, endpoint, inputs_tx, health) = (&self.pool, &self.endpoint, &self.inputs_tx, &self.health);
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
    }
}
