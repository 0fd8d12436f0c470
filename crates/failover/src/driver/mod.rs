//! The runtime driver: runs the [`Monitor`] core against the real instance pool, the client
//! endpoint and the volume service, with wall-clock time.
//!
//! One loop owns the core. Inputs arrive on one bounded channel (ping results, instance exits,
//! results of operations, control requests, ticks). After every step the durable state is
//! written to the journal (when it changed) **before** the step's actions are handed out: pings
//! run as tasks; pool operations and endpoint changes run one at a time on the pool worker;
//! super / collapse / drop run one at a time on the volume worker.
//!
//! With the control store ([`Parts::store`], `failover run --store URL`) the journal is the
//! store's keys and the endpoint is not in this process: the monitor publishes where clients go
//! ([`crate::proto::PrimaryRecord`]) and the endpoints follow it ([`crate::endpoint::follow`]).
//! Every write is guarded by the election; a failed one, or a lost lease, ends the run with
//! [`DriverError::SteppedDown`], leaving the instances running for the next leader to adopt.
//!
//! [`control`]: the control port and fault injection; [`volumes`]: the volume operations;
//! [`store`]: the state on the control store.

mod control;
mod pools;
pub mod store;
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
use self::store::StoreJournal;
use crate::proto::*;
use crate::spec::{HealthSpec, Spec};

pub use control::{serve_control, Control, FaultKind, InstanceStatus, Status, MAX_CONTROL_LINE_BYTES};
pub use pools::AnyPool;
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
    /// No longer the leader (its lease lost, a guarded write refused, the store unreachable
    /// with a write's outcome unknown): the instances are left running for the next leader.
    #[error("stepping down: {0}")]
    SteppedDown(String),
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
    /// Local processes, or the failover agents of other hosts (`failover run --agents`).
    pub pool: AnyPool,
    /// Inputs from the pool (instance exits) and the workers; `inputs_tx` feeds it.
    pub inputs: mpsc::Receiver<Input>,
    pub inputs_tx: mpsc::Sender<Input>,
    /// The client endpoint in this process (None with the control store: the endpoints are
    /// processes of their own that follow the published primary).
    pub endpoint: Option<Arc<Proxy>>,
    pub control: mpsc::Receiver<Control>,
    /// Run as the leader on the control store (its state and the endpoint record as keys)
    /// rather than on the journal file.
    pub store: Option<StoreJournal>,
}

/// How long the monitor waits after publishing a frozen endpoint record before it goes on (to
/// the collapse or the fence): every endpoint looks at the record every
/// [`crate::endpoint::FOLLOW_INTERVAL`], so by then each has severed its connections to the old
/// primary. An endpoint that cannot reach the store for longer is not waited for (see
/// docs/failover.md: run endpoints next to the store's members).
pub const FREEZE_GRACE: Duration = Duration::from_millis(4 * crate::endpoint::FOLLOW_INTERVAL_MS);

/// Where the durable state goes.
enum Journal {
    File(FileJournal),
    Store(Box<StoreJournal>),
}

impl Journal {
    async fn save(&mut self, r: &Record) -> Result<(), DriverError> {
        match self {
            Journal::File(j) => Ok(j.save(r)?),
            Journal::Store(j) => j.save(r).await.map_err(|e| DriverError::SteppedDown(e.to_string())),
        }
    }
}

/// Runs the monitor until `shutdown` resolves (then stops every instance cleanly) or it gives up.
/// `on_event` sees every [`Event`] (the CLI prints them).
pub async fn run(
    spec: &Spec,
    parts: Parts,
    mut on_event: impl FnMut(&Event),
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<Durable, DriverError> {
    let Parts { cluster, pool, mut inputs, inputs_tx, endpoint, mut control, store } = parts;
    let (mut journal, mut m) = match store {
        None => {
            let j = FileJournal::new(&spec.state_dir.join("monitor.json"));
            let rec = j.load()?;
            (Journal::File(j), start_monitor(spec, rec, &spec.state_dir.join("monitor.json").display().to_string()))
        }
        Some(j) => {
            // Read by `failover run` right after winning the election (the old leader can no
            // longer write): the state it left.
            let rec = store_record(&j);
            (Journal::Store(Box::new(j)), start_monitor(spec, rec, "the control store"))
        }
    };
    let mut saved = m.durable().clone();
    journal.save(&Record { config: spec.monitor.clone(), state: saved.clone() }).await?;
    let workers = Workers::spawn(pool.clone(), Volumes { cluster }, inputs_tx.clone());
    let actions = Actions { pool: pool.clone(), endpoint: endpoint.clone(), inputs_tx, health: Arc::new(spec.health.clone()) };
    let mut gave_up: Option<String> = None;
    let first = actions.carry_out(m.take_outputs(), &mut gave_up, &mut on_event);
    publish(&mut journal, &actions, first.publish).await?;
    for w in first.work {
        workers.send(w).await;
    }
    let mut tick = tokio::time::interval(Duration::from_millis(spec.monitor.tick_interval_ms()));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    // A leader on the store: its lease, and how long its loop may not run before it confirms
    // its leadership in the store before acting again (it may have been paused past its lease
    // before the renewal thread could say so).
    let leader = match &journal {
        Journal::Store(j) => Some((j.daemon().leadership().clone(), j.daemon().leadership_ttl() / 4)),
        Journal::File(_) => None,
    };
    let mut last_turn = std::time::Instant::now();
    loop {
        let input = tokio::select! {
            _ = &mut shutdown => break,
            why = async { leader.as_ref().unwrap().0.lost().await }, if leader.is_some() => {
                return Err(DriverError::SteppedDown(format!("leadership lost: {why}")));
            }
            _ = tick.tick() => Input::Tick,
            Some(i) = inputs.recv() => i,
            Some(c) = control.recv() => {
                match c {
                    Control::Status(reply) => {
                        let _ = reply.send(control::status(&m, &pool, endpoint.as_deref(), workers.busy()));
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
        if let (Some((lead, confirm_after)), Journal::Store(j)) = (&leader, &journal) {
            let gap = last_turn.elapsed();
            if !lead.is_leader() {
                return Err(DriverError::SteppedDown("election lease lost".into()));
            }
            if gap > *confirm_after {
                tracing::warn!("the monitor loop did not run for {} ms: confirming its leadership first", gap.as_millis());
                j.confirm().await.map_err(|e| DriverError::SteppedDown(e.to_string()))?;
            }
        }
        m.handle(now_unix_ms(), input);
        let out = m.take_outputs();
        if *m.durable() != saved {
            saved = m.durable().clone();
            journal.save(&Record { config: spec.monitor.clone(), state: saved.clone() }).await?;
        }
        for a in &out {
            if !matches!(a, Action::Ping(_) | Action::Notify(_)) {
                tracing::info!(?a, "action");
            }
        }
        let todo = actions.carry_out(out, &mut gave_up, &mut on_event);
        publish(&mut journal, &actions, todo.publish).await?;
        for w in todo.work {
            workers.send(w).await;
        }
        last_turn = std::time::Instant::now();
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
    journal.save(&Record { config: spec.monitor.clone(), state: m.durable().clone() }).await?;
    Ok(m.durable().clone())
}

/// What the store journal read when it was opened.
fn store_record(j: &StoreJournal) -> Option<Record> {
    j.loaded().cloned()
}

/// The monitor as the journal left it (resumed mid-failover if it was), or a fresh one that
/// boots the spec's volume.
fn start_monitor(spec: &Spec, rec: Option<Record>, from: &str) -> Monitor {
    let now = now_unix_ms();
    match rec {
        Some(rec) => {
            if rec.config != spec.monitor {
                tracing::warn!("the spec's monitor settings differ from the journal's; using the spec's");
            }
            tracing::info!(phase = ?rec.state.phase, "resuming from {from}");
            Monitor::recover(spec.monitor.clone(), rec.state, now)
        }
        None => Monitor::new(spec.monitor.clone(), spec.volume.clone(), now),
    }
}

/// Endpoint changes for the endpoints that follow the store, in the order issued; each
/// answered as the local endpoint's are. A frozen record is waited on for [`FREEZE_GRACE`]
/// before anything after it (a collapse, a fence) is queued.
async fn publish(journal: &mut Journal, actions: &Actions, changes: Vec<Publish>) -> Result<(), DriverError> {
    let Journal::Store(j) = journal else {
        assert!(changes.is_empty(), "endpoint records are published only on the control store");
        return Ok(());
    };
    for c in changes {
        let writer = j.daemon().fencing_token();
        let (rec, answer) = match c {
            Publish::Point(id) => match actions.pool.address(id) {
                Some(addr) => (PrimaryRecord { instance: Some(id), addr: Some(addr), frozen: false, writer }, Some(Input::EndpointPointed(id))),
                None => {
                    let _ = actions.inputs_tx.send(Input::EndpointFailed { id, error: format!("instance {id} has no address") }).await;
                    continue;
                }
            },
            Publish::Freeze => (PrimaryRecord { instance: None, addr: None, frozen: true, writer }, None),
        };
        j.publish(&rec).await.map_err(|e| DriverError::SteppedDown(e.to_string()))?;
        tracing::info!(?rec, "endpoint record published");
        match answer {
            Some(input) => {
                let tx = actions.inputs_tx.clone();
                tokio::spawn(async move {
                    let _ = tx.send(input).await;
                });
            }
            None => tokio::time::sleep(FREEZE_GRACE).await,
        }
    }
    Ok(())
}

/// An endpoint change to publish on the control store.
enum Publish {
    Point(InstanceId),
    Freeze,
}

/// What [`Actions::carry_out`] leaves to the loop: endpoint records to publish (first, in
/// order), then work for the workers.
struct Todo {
    publish: Vec<Publish>,
    work: Vec<Work>,
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
    fn spawn(pool: AnyPool, volumes: Volumes, inputs: mpsc::Sender<Input>) -> Workers {
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
    pool: AnyPool,
    /// None: the endpoints follow the control store (the changes are published).
    endpoint: Option<Arc<Proxy>>,
    inputs_tx: mpsc::Sender<Input>,
    health: Arc<HealthSpec>,
}

impl Actions {
    /// Returns the work for the workers, in the order issued; a `GaveUp` event sets `gave_up`.
    fn carry_out(&self, actions: Vec<Action>, gave_up: &mut Option<String>, on_event: &mut dyn FnMut(&Event)) -> Todo {
        let (pool, inputs_tx, health) = (&self.pool, &self.inputs_tx, &self.health);
        let mut work = vec![];
        let mut publish = vec![];
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
                Action::PointEndpoint(id) if self.endpoint.is_none() => publish.push(Publish::Point(id)),
                Action::FreezeEndpoint if self.endpoint.is_none() => publish.push(Publish::Freeze),
                Action::PointEndpoint(id) => {
                    let endpoint = self.endpoint.as_ref().expect("matched above");
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
                    self.endpoint.as_ref().expect("matched above").freeze();
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
        Todo { publish, work }
    }
}
