//! The monitor core under the deterministic simulator: a model of the volume service (super,
//! dirty bit, collapse, fencing), an instance pool, an endpoint, clients that record every
//! acknowledged write, and faults — primaries that crash, come back, keep writing while
//! unreachable; backups that crash during recovery or never become healthy; and crashes of the
//! monitor itself at every step (between persisting a step and executing its actions, with only
//! a prefix of the actions carried out).
//!
//! Checked at every step: an acknowledged write is on the volume of whatever instance serves the
//! client next (no lost write, no second primary visible); the endpoint never points at an
//! instance on an uncollapsed child; a parent is destroyed only by a promoting collapse; two
//! live instances never have one volume attached; each child is promoted at most once.
//! Checked at the end: a primary that is gone for good is replaced (when a backup can become
//! healthy), and the monitor settles.
//!
//! `SIM_SEEDS=N` runs N seeds (default 300); `SIM_SEED=S` runs one seed with a trace.

use std::collections::{BTreeMap, BTreeSet};

use failover::core::Monitor;
use failover::proto::*;
use sim::{EventQueue, SimRng, TimeUs};

const MS: u64 = 1_000;

#[derive(Clone, Debug)]
struct Vol {
    writes: BTreeSet<u64>,
    parent: Option<String>,
    child: Option<String>,
    dirty: bool,
    fenced: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum IState {
    Recovering,
    Running,
    Dead,
}

#[derive(Clone, Debug)]
struct Inst {
    volume: String,
    state: IState,
    gen: u64,
}

#[derive(Clone, Debug)]
enum Ev {
    Deliver { inc: u64, input: Input },
    Tick { inc: u64 },
    Storage { inc: u64, action: Action },
    Pool { inc: u64, action: Action },
    Ready { id: InstanceId, gen: u64 },
    BackupCrash { id: InstanceId, gen: u64 },
    Client,
    Hint(Input),
    InternalWrite,
    Cut,
    Heal,
    KillPrimary,
    MonitorCrash,
    MonitorRestart,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// SIGKILL of the primary, for good.
    Crash,
    /// Unreachable for a while, then back (no writes meanwhile): a false positive.
    Transient,
    /// Unreachable but writing to its disk (log rotation, GC); may come back.
    WritingWhileCut,
    /// Unreachable for good, but alive and writing: only the REDS fallback ends it.
    FailSlow,
    /// A few short cuts that heal (a loaded machine's missed pings: false positives, aborted
    /// when the primary answers), then a crash for good, which speculation must still fail
    /// over at once (the false positives must not have switched it off).
    FlakyThenCrash,
}

struct World {
    rng: SimRng,
    q: EventQueue<Ev>,
    trace: bool,
    cfg: MonitorConfig,
    monitor: Option<Monitor>,
    persisted: Option<Durable>,
    inc: u64,
    vols: BTreeMap<String, Vol>,
    /// Collapses decided: child → outcome (the tracking shard remembers).
    decided: BTreeMap<String, CollapseOutcome>,
    promotions: BTreeMap<String, u32>,
    insts: BTreeMap<InstanceId, Inst>,
    endpoint: Option<InstanceId>,
    /// The primary's network: false while cut.
    cut: BTreeSet<InstanceId>,
    writing_while_cut: bool,
    next_write: u64,
    acked: BTreeSet<u64>,
    /// Highest count a client has read (monotonic reads).
    read_count: usize,
    last_served: Option<InstanceId>,
    killed: BTreeSet<InstanceId>,
    original: String,
    never_healthy: bool,
    backup_crash_p: f64,
    recovery_ms: (u64, u64),
    crash_p: f64,
    events: Vec<Event>,
    fault: Fault,
    faulted: Option<InstanceId>,
    /// A transient fault that heals the moment a collapse promotes the backup: the old primary
    /// is reachable again before the monitor has heard the outcome (the fencing window).
    heal_at_collapse: bool,
    /// `events.len()` at each SIGKILL of a primary.
    kills: Vec<usize>,
}

impl World {
    fn log(&self, s: impl FnOnce() -> String) {
        if self.trace {
            eprintln!("{:>9.3}s {}", self.q.now() as f64 / 1e6, s());
        }
    }

    fn now_ms(&self) -> u64 {
        self.q.now() / MS
    }

    fn push(&mut self, delay_us: TimeUs, ev: Ev) {
        let now = self.q.now();
        self.q.push_after(now, delay_us, ev).expect("queue bounded");
    }

    fn deliver(&mut self, inc: u64, delay_us: u64, input: Input) {
        self.push(delay_us, Ev::Deliver { inc, input });
    }

    fn reachable(&self, id: InstanceId) -> bool {
        self.insts.get(&id).is_some_and(|i| i.state == IState::Running) && !self.cut.contains(&id)
    }

    /// Runs the monitor's step: persist, then execute the actions (a crash may cut in between).
    fn step(&mut self, input: Option<Input>) {
        let Some(m) = self.monitor.as_mut() else { return };
        let now = self.q.now() / MS;
        m.handle(now, input.unwrap_or(Input::Tick));
        // (`handle` checked the invariants already; a simulation step checks them, whatever
        // a build's `handle` does.)
        m.check_invariants();
        let actions = m.take_outputs();
        self.persisted = Some(m.durable().clone());
        self.run_actions(actions);
    }

    fn run_actions(&mut self, actions: Vec<Action>) {
        let mut n = actions.len();
        if !actions.is_empty() && self.rng.chance(self.crash_p) {
            n = self.rng.range_u64(0, actions.len() as u64 - 1) as usize;
            self.log(|| format!("monitor crashes after {n} of {} actions", actions.len()));
            self.push(0, Ev::MonitorCrash);
        }
        for a in actions.into_iter().take(n) {
            self.execute(a);
        }
    }

    fn execute(&mut self, a: Action) {
        let inc = self.inc;
        self.log(|| format!("action {a:?}"));
        let d = self.rng.range_u64(1, 30) * MS;
        match a {
            Action::Notify(e) => self.events.push(e),
            Action::FreezeEndpoint => {
                self.endpoint = None;
                self.log(|| "endpoint frozen".into());
            }
            Action::Ping(id) => {
                let input = if self.reachable(id) { Input::PingOk(id) } else { Input::PingFailed(id) };
                // An unanswered ping fails after its timeout.
                let delay = if matches!(input, Input::PingOk(_)) { d } else { 300 * MS };
                self.deliver(inc, delay, input);
            }
            Action::Super { .. } | Action::Collapse { .. } | Action::DropChild { .. } => self.push(d, Ev::Storage { inc, action: a }),
            Action::StartInstance { .. } | Action::KillInstance(_) => self.push(d, Ev::Pool { inc, action: a }),
            // Endpoint changes happen at once, in the order issued (as in the driver): a
            // re-point queued behind a slow start must not undo a later freeze.
            Action::PointEndpoint(id) => {
                let i = self.insts.get(&id).expect("endpoint pointed at an unknown instance");
                let v = self.vols.get(&i.volume).expect("endpoint pointed at an instance whose volume is gone");
                assert!(v.parent.is_none(), "endpoint pointed at {id} on uncollapsed child {}", i.volume);
                assert!(!v.fenced, "endpoint pointed at {id} on fenced volume {}", i.volume);
                self.endpoint = Some(id);
                self.log(|| format!("endpoint → {id}"));
                self.deliver(inc, d, Input::EndpointPointed(id));
            }
        }
    }

    fn storage(&mut self, inc: u64, a: Action) {
        let d = self.rng.range_u64(1, 20) * MS;
        // Storage sometimes fails transiently (and the request is not applied).
        if self.rng.chance(0.05) {
            let input = match a {
                Action::Super { child, .. } => Input::SuperFailed { child, error: "unavailable".into(), existing_child: None },
                Action::Collapse { child, .. } => Input::CollapseFailed { child, error: "unavailable".into() },
                Action::DropChild { child, .. } => Input::DropFailed { child, error: "unavailable".into() },
                _ => unreachable!(),
            };
            self.deliver(inc, d, input);
            return;
        }
        match a {
            Action::Super { parent, child } => {
                let p = self.vols.get(&parent).cloned();
                let input = match p {
                    None => Input::SuperFailed { child, error: format!("no volume {parent}"), existing_child: None },
                    Some(p) if p.child.as_deref() == Some(&child) => Input::SuperDone { child },
                    Some(p) if p.child.is_some() => {
                        Input::SuperFailed { child, error: "already has a super child".into(), existing_child: p.child.clone() }
                    }
                    Some(p) if self.vols.contains_key(&child) || self.decided.contains_key(&child) => {
                        let _ = p;
                        Input::SuperFailed { child, error: "name taken".into(), existing_child: None }
                    }
                    Some(p) => {
                        assert!(p.parent.is_none(), "super of an uncollapsed child");
                        self.vols.insert(
                            child.clone(),
                            Vol { writes: p.writes.clone(), parent: Some(parent.clone()), child: None, dirty: false, fenced: false },
                        );
                        let pv = self.vols.get_mut(&parent).unwrap();
                        pv.child = Some(child.clone());
                        pv.dirty = false;
                        Input::SuperDone { child }
                    }
                };
                self.deliver(inc, d, input);
            }
            Action::Collapse { child, .. } => {
                let outcome = self.collapse(&child, false);
                if self.heal_at_collapse && outcome == CollapseOutcome::Promoted {
                    if let Some(id) = self.faulted {
                        self.log(|| format!("{id} heals as the collapse promotes"));
                        self.cut.remove(&id);
                    }
                }
                // Sometimes the answer is slow to come back: the decision is made, the monitor
                // does not know it yet (the window fencing must cover).
                let d = if self.rng.chance(0.2) { self.rng.range_u64(200, 2_000) * MS } else { d };
                self.deliver(inc, d, Input::CollapseDone { child, outcome });
            }
            Action::DropChild { parent, child } => {
                if self.vols.get(&child).is_some_and(|c| c.parent.is_some()) {
                    // Mark the parent observed, then collapse: always rejects.
                    let outcome = self.collapse(&child, true);
                    assert_eq!(outcome, CollapseOutcome::Rejected, "dropping {child} promoted it");
                }
                let _ = parent;
                self.deliver(inc, d, Input::ChildDropped { child });
            }
            _ => unreachable!(),
        }
    }

    fn collapse(&mut self, child: &str, mark_parent: bool) -> CollapseOutcome {
        if let Some(o) = self.decided.get(child) {
            return *o;
        }
        let Some(c) = self.vols.get(child).cloned() else {
            // Never created (super failed or still to come): nothing to promote.
            return CollapseOutcome::Rejected;
        };
        let Some(parent) = c.parent.clone() else {
            panic!("collapse of {child}, which is not a super child and has no recorded outcome")
        };
        if mark_parent {
            let p = self.vols.get_mut(&parent).unwrap();
            assert!(!p.fenced);
            p.dirty = true;
        }
        let p = self.vols.get(&parent).unwrap().clone();
        let outcome = if p.dirty { CollapseOutcome::Rejected } else { CollapseOutcome::Promoted };
        self.decided.insert(child.to_string(), outcome);
        match outcome {
            CollapseOutcome::Promoted => {
                *self.promotions.entry(child.to_string()).or_default() += 1;
                assert_eq!(self.promotions[child], 1, "{child} promoted twice");
                // The parent is fenced and (after GC) destroyed; keep a fenced husk for the
                // instance that may still have it attached.
                let pv = self.vols.get_mut(&parent).unwrap();
                pv.fenced = true;
                pv.child = None;
                self.vols.get_mut(child).unwrap().parent = None;
                self.log(|| format!("collapse {child}: promoted, {parent} fenced"));
            }
            CollapseOutcome::Rejected => {
                self.vols.remove(child);
                self.vols.get_mut(&parent).unwrap().child = None;
                self.log(|| format!("collapse {child}: rejected, {parent} goes on"));
            }
        }
        outcome
    }

    /// A write by an instance to its volume; false if fenced (EPERM) or gone.
    fn write(&mut self, vol: &str, id: u64) -> bool {
        let Some(v) = self.vols.get_mut(vol) else { return false };
        if v.fenced {
            return false;
        }
        if v.child.is_some() {
            v.dirty = true;
        }
        v.writes.insert(id);
        true
    }

    fn pool(&mut self, inc: u64, a: Action) {
        let d = self.rng.range_u64(1, 20) * MS;
        match a {
            Action::StartInstance { id, volume } => {
                // Killing is final for an id (a late start from a crashed monitor must not
                // bring a fenced instance back); the monitor never reuses ids.
                if self.killed.contains(&id) {
                    self.deliver(inc, d, Input::InstanceStartFailed { id, error: "instance was killed".into() });
                    return;
                }
                if self.insts.get(&id).is_some_and(|i| i.state != IState::Dead) {
                    self.deliver(inc, d, Input::InstanceStarted(id));
                    return;
                }
                let Some(v) = self.vols.get(&volume) else {
                    self.deliver(inc, d, Input::InstanceStartFailed { id, error: format!("no volume {volume}") });
                    return;
                };
                assert!(!v.fenced, "instance {id} started on fenced volume {volume}");
                for (other, i) in &self.insts {
                    assert!(
                        !(i.state != IState::Dead && i.volume == volume),
                        "instance {id} attaches {volume}, still attached to live instance {other}"
                    );
                }
                let gen = self.insts.get(&id).map(|i| i.gen + 1).unwrap_or(0);
                self.insts.insert(id, Inst { volume: volume.clone(), state: IState::Recovering, gen });
                self.deliver(inc, d, Input::InstanceStarted(id));
                let rec = self.rng.range_u64(self.recovery_ms.0, self.recovery_ms.1) * MS;
                if self.rng.chance(self.backup_crash_p) && id.0 > 1 {
                    let at = self.rng.range_u64(0, rec);
                    self.push(at, Ev::BackupCrash { id, gen });
                } else if !self.never_healthy || id.0 == 1 {
                    self.push(rec, Ev::Ready { id, gen });
                }
            }
            Action::KillInstance(id) => {
                self.killed.insert(id);
                if let Some(i) = self.insts.get_mut(&id) {
                    i.state = IState::Dead;
                }
                self.deliver(inc, d, Input::InstanceStopped(id));
            }
            _ => unreachable!(),
        }
    }

    /// One client operation through the endpoint: a write, then a read of the count.
    fn client(&mut self) {
        let Some(id) = self.endpoint else { return };
        if !self.reachable(id) {
            return;
        }
        let vol = self.insts[&id].volume.clone();
        // Fencing (§4.3): once a collapse promoted a child, the old primary must not answer a
        // client any more, not even a read from its caches.
        assert!(
            self.vols.get(&vol).is_some_and(|v| !v.fenced),
            "a client was answered by {id}, whose volume {vol} was fenced by a promotion (a second primary)"
        );
        let w = self.next_write;
        self.next_write += 1;
        if self.write(&vol, w) {
            // Acknowledged: crash consistency means it is on the disk.
            let v = &self.vols[&vol];
            // Volumes only grow, so a full check is needed only when the server changes.
            if self.last_served != Some(id) {
                let missing: Vec<_> = self.acked.difference(&v.writes).take(5).collect();
                assert!(missing.is_empty(), "acknowledged writes {missing:?} missing from {vol}, served by {id}");
                self.last_served = Some(id);
            }
            self.acked.insert(w);
            let count = v.writes.len();
            assert!(count >= self.read_count, "a client read went back in time on {vol} ({count} < {})", self.read_count);
            self.read_count = count;
        }
    }

    /// One event of the world (about 115 lines on purpose: one match over every kind of
    /// event, the world's state machine, reads best whole).
    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Deliver { inc, input } => {
                if inc == self.inc && self.monitor.is_some() {
                    self.log(|| format!("input {input:?}"));
                    self.step(Some(input));
                }
            }
            Ev::Tick { inc } => {
                if inc == self.inc && self.monitor.is_some() {
                    self.step(None);
                    let t = self.cfg.tick_interval_ms() * MS;
                    self.push(t, Ev::Tick { inc });
                }
            }
            Ev::Storage { inc, action } => self.storage(inc, action),
            Ev::Pool { inc, action } => self.pool(inc, action),
            Ev::Ready { id, gen } => {
                if let Some(i) = self.insts.get_mut(&id) {
                    if i.gen == gen && i.state == IState::Recovering {
                        // Recovery writes to its own volume (WAL replay) — never observed.
                        let vol = i.volume.clone();
                        i.state = IState::Running;
                        let w = self.next_write;
                        self.next_write += 1;
                        self.write(&vol, w);
                    }
                }
            }
            Ev::BackupCrash { id, gen } => {
                if let Some(i) = self.insts.get_mut(&id) {
                    if i.gen == gen && i.state != IState::Dead {
                        i.state = IState::Dead;
                        let inc = self.inc;
                        self.deliver(inc, 5 * MS, Input::InstanceExited(id));
                    }
                }
            }
            Ev::Client => {
                self.client();
                let d = self.rng.range_u64(20, 200) * MS;
                self.push(d, Ev::Client);
            }
            Ev::InternalWrite => {
                if self.writing_while_cut {
                    if let Some(id) = self.faulted {
                        if self.insts.get(&id).is_some_and(|i| i.state == IState::Running) {
                            let vol = self.insts[&id].volume.clone();
                            let w = self.next_write;
                            self.next_write += 1;
                            self.write(&vol, w);
                        }
                    }
                    let d = self.rng.range_u64(100, 2_000) * MS;
                    self.push(d, Ev::InternalWrite);
                }
            }
            Ev::Hint(input) => {
                // The evaluator tells whichever monitor runs now.
                if self.monitor.is_some() {
                    self.step(Some(input));
                }
            }
            Ev::Cut | Ev::KillPrimary if self.endpoint.is_none() => self.push(1_000 * MS, ev),
            Ev::Cut => {
                if let Some(id) = self.endpoint {
                    self.log(|| format!("fault {:?} on {id}", self.fault));
                    self.faulted = Some(id);
                    self.cut.insert(id);
                    if matches!(self.fault, Fault::WritingWhileCut | Fault::FailSlow) {
                        self.writing_while_cut = true;
                        let d = self.rng.range_u64(0, 500) * MS;
                        self.push(d, Ev::InternalWrite);
                    }
                }
            }
            Ev::Heal => {
                if let Some(id) = self.faulted {
                    self.log(|| format!("{id} heals"));
                    self.cut.remove(&id);
                    self.writing_while_cut = false;
                }
            }
            Ev::KillPrimary => {
                if let Some(id) = self.endpoint {
                    self.log(|| format!("SIGKILL {id}"));
                    self.kills.push(self.events.len());
                    self.faulted = Some(id);
                    if let Some(i) = self.insts.get_mut(&id) {
                        i.state = IState::Dead;
                    }
                }
            }
            Ev::MonitorCrash => {
                if self.monitor.take().is_some() {
                    self.log(|| "monitor crashed".into());
                    // The endpoint is the monitor's own proxy: it goes down with it.
                    self.endpoint = None;
                    self.inc += 1;
                    let d = self.rng.range_u64(10, 3_000) * MS;
                    self.push(d, Ev::MonitorRestart);
                }
            }
            Ev::MonitorRestart => {
                let d = self.persisted.clone().expect("persisted before any action");
                self.log(|| format!("monitor restarts in {:?}", d.phase));
                let mut m = Monitor::recover(self.cfg.clone(), d, self.now_ms());
                let acts = m.take_outputs();
                self.monitor = Some(m);
                let inc = self.inc;
                self.push(0, Ev::Tick { inc });
                self.run_actions(acts);
            }
        }
    }
}

struct Outcome {
    rejected: usize,
    aborted: usize,
    monitor_restarts: u64,
    phase: Phase,
    failovers: u64,
    fault: Fault,
    policy: PolicyKind,
}

/// One seeded run: a world and its faults drawn from `seed`, run to the end, checked.
fn run(seed: u64, trace: bool) -> Outcome {
    let mut rng = SimRng::new(seed);
    let mut w = new_world(seed, trace, &mut rng);
    schedule_faults(&mut w, &mut rng);
    // As drawn: the end of the run turns the monitor's crashes off.
    let crash_p = w.crash_p;
    run_to_the_end(&mut w);
    check_the_end(&w, seed, crash_p)
}

/// The world of a run, its monitor booting: the policy, the fault and the timings drawn.
fn new_world(seed: u64, trace: bool, rng: &mut SimRng) -> World {
    let policy = *rng.pick(&[PolicyKind::Speculative, PolicyKind::Speculative, PolicyKind::Reds, PolicyKind::Oracle]).unwrap();
    let fault = *rng.pick(&[Fault::Crash, Fault::Transient, Fault::WritingWhileCut, Fault::FailSlow, Fault::FlakyThenCrash]).unwrap();
    let cfg = MonitorConfig {
        policy,
        ping_interval_ms: 500,
        backup_ping_interval_ms: *rng.pick(&[100, 250]).unwrap(),
        reds_timeout_ms: *rng.pick(&[5_000, 20_000]).unwrap(),
        speculate_after_missed_pings: 1,
        healthy_timeout_ms: 30_000,
        max_backup_starts: 3,
        max_aborts: 3,
        abort_window_ms: 300_000,
        retry_backoff_ms: 200,
    };
    let never_healthy = rng.chance(0.1);
    let backup_crash_p = *rng.pick(&[0.0, 0.0, 0.3, 0.7]).unwrap();
    let crash_p = *rng.pick(&[0.0, 0.02, 0.1]).unwrap();
    let recovery_ms = *rng.pick(&[(300, 2_000), (2_000, 15_000)]).unwrap();
    let q = EventQueue::new(100_000);
    let mut w = World {
        rng: rng.fork(),
        q,
        trace,
        cfg: cfg.clone(),
        monitor: None,
        persisted: None,
        inc: 0,
        vols: BTreeMap::new(),
        decided: BTreeMap::new(),
        promotions: BTreeMap::new(),
        insts: BTreeMap::new(),
        endpoint: None,
        cut: BTreeSet::new(),
        writing_while_cut: false,
        next_write: 1,
        acked: BTreeSet::new(),
        read_count: 0,
        last_served: None,
        killed: BTreeSet::new(),
        original: "db".into(),
        never_healthy,
        backup_crash_p,
        recovery_ms,
        crash_p,
        events: vec![],
        fault,
        faulted: None,
        heal_at_collapse: false,
        kills: vec![],
    };
    w.log(|| format!("seed {seed}: {policy:?} {fault:?} never_healthy={never_healthy} backup_crash_p={backup_crash_p} crash_p={crash_p} recovery_ms={recovery_ms:?} timeout={}", cfg.reds_timeout_ms));
    w.vols.insert("db".into(), Vol { writes: BTreeSet::new(), parent: None, child: None, dirty: false, fenced: false });
    let mut m = Monitor::new(cfg.clone(), "db".into(), 0);
    let acts = m.take_outputs();
    w.persisted = Some(m.durable().clone());
    w.monitor = Some(m);
    w.run_actions(acts);
    w.push(0, Ev::Tick { inc: 0 });
    w.push(100 * MS, Ev::Client);
    w
}

/// The run's fault (and the oracle's hint about it), a second failure in some runs, and
/// crashes of the monitor when the run has them.
fn schedule_faults(w: &mut World, rng: &mut SimRng) {
    let (fault, policy, recovery_ms, crash_p) = (w.fault, w.cfg.policy, w.recovery_ms, w.crash_p);
    let fault_at = rng.range_u64(5_000, 10_000) * MS;
    let heal_after = rng.range_u64(1_000, 40_000) * MS;
    match fault {
        Fault::Crash => w.push(fault_at, Ev::KillPrimary),
        Fault::Transient => {
            w.push(fault_at, Ev::Cut);
            w.push(fault_at + heal_after, Ev::Heal);
            w.heal_at_collapse = rng.chance(0.5);
        }
        Fault::WritingWhileCut => {
            w.push(fault_at, Ev::Cut);
            if rng.chance(0.5) {
                w.push(fault_at + heal_after, Ev::Heal);
            }
        }
        Fault::FailSlow => w.push(fault_at, Ev::Cut),
        Fault::FlakyThenCrash => {
            let mut at = fault_at;
            for _ in 0..rng.range_u64(3, 5) {
                w.push(at, Ev::Cut);
                w.push(at + rng.range_u64(400, 1_500) * MS, Ev::Heal);
                at += rng.range_u64(recovery_ms.1 + 3_000, recovery_ms.1 + 10_000) * MS;
            }
            w.push(at, Ev::KillPrimary);
        }
    }
    if policy == PolicyKind::Oracle {
        // The evaluator knows the future: tell the oracle before the failure.
        let back = match fault {
            Fault::Crash | Fault::FailSlow => None,
            Fault::Transient => Some(heal_after / MS),
            Fault::WritingWhileCut => None,
            // (Told about the crash; the short cuts before it are waited out.)
            Fault::FlakyThenCrash => None,
        };
        w.push(fault_at - MS, Ev::Hint(Input::OracleHint { primary_back_after_ms: back, recovery_ms: recovery_ms.1 }));
    }
    // A second failure, of whichever instance serves then, in some runs.
    if rng.chance(0.3) {
        w.push(fault_at + 100_000 * MS, Ev::KillPrimary);
    }
    // Monitor crashes at random times too (besides those between a step and its actions).
    if crash_p > 0.0 {
        for _ in 0..3 {
            let at = rng.range_u64(1_000, 200_000) * MS;
            w.push(at, Ev::MonitorCrash);
        }
    }
}

/// Runs the events for 400 s of virtual time; then, with monitor crashes off, restarts a
/// crashed monitor and gives it 200 s more to settle.
fn run_to_the_end(w: &mut World) {
    let end = 400_000 * MS;
    while let Some(t) = w.q.peek_time() {
        if t > end {
            break;
        }
        let (_, ev) = w.q.pop().unwrap();
        if w.crash_p == 0.0 && matches!(ev, Ev::MonitorCrash) {
            continue;
        }
        w.handle(ev);
        // The original volume is gone only if a child of it was promoted.
        if !w.vols.contains_key(&w.original) {
            panic!("the original volume vanished");
        }
    }
    // Restart a crashed monitor so that it can settle.
    w.crash_p = 0.0;
    if w.monitor.is_none() {
        w.handle(Ev::MonitorRestart);
        let until = w.q.now() + 200_000 * MS;
        while let Some(t) = w.q.peek_time() {
            if t > until {
                break;
            }
            let (_, ev) = w.q.pop().unwrap();
            if !matches!(ev, Ev::MonitorCrash) {
                w.handle(ev);
            }
        }
    }
}

/// The end-of-run checks: nothing fenced without a promotion; serving (or given up, where the
/// run allows it); a crash after false positives failed over by a promotion.
fn check_the_end(w: &World, seed: u64, crash_p: f64) -> Outcome {
    let (fault, policy, never_healthy, backup_crash_p) = (w.fault, w.cfg.policy, w.never_healthy, w.backup_crash_p);
    let trace = w.trace;
    let m = w.monitor.as_ref().unwrap();
    let d = m.durable().clone();
    // A fenced volume only ever comes from a promotion.
    for (name, v) in &w.vols {
        if v.fenced {
            assert!(w.decided.values().any(|o| *o == CollapseOutcome::Promoted), "{name} fenced without a promotion");
        }
    }
    // Settled and serving, unless nothing can become healthy.
    let serving = w.endpoint.is_some_and(|id| w.reachable(id)) && d.phase == Phase::Normal;
    let primary_gone_for_good = matches!(fault, Fault::Crash | Fault::FailSlow | Fault::FlakyThenCrash);
    if !never_healthy && backup_crash_p < 0.5 && primary_gone_for_good {
        // A backup eventually comes up (at most a few crashes in a row are likely).
        let ok = serving || matches!(d.phase, Phase::Failed { .. });
        assert!(ok, "seed {seed}: not serving at the end: phase {:?}, endpoint {:?}", d.phase, w.endpoint);
    }
    if matches!(fault, Fault::Transient) && !never_healthy {
        assert!(serving || matches!(d.phase, Phase::Failed { .. }), "seed {seed}: transient fault left it not serving: {:?}", d.phase);
    }
    if never_healthy {
        // No backup ever served: the original volume survives and nothing was promoted.
        assert!(w.promotions.is_empty(), "seed {seed}: promoted a never-healthy backup");
        if fault == Fault::Crash && policy != PolicyKind::Speculative {
            assert!(matches!(d.phase, Phase::Failed { .. }), "seed {seed}: REDS with a never-healthy app must give up, got {:?}", d.phase);
        }
    }
    if fault == Fault::FailSlow && policy == PolicyKind::Speculative && !never_healthy && backup_crash_p < 0.5 {
        // The writing primary defeats every collapse: the REDS fallback must end it.
        assert!(serving || matches!(d.phase, Phase::Failed { .. }), "seed {seed}: fail-slow primary never replaced: {:?}", d.phase);
    }
    if fault == Fault::FlakyThenCrash && policy == PolicyKind::Speculative && !never_healthy && backup_crash_p == 0.0 {
        // False positives before the crash must not have switched speculation off: the crash
        // is failed over by a promotion, never by waiting out the REDS timeout.
        let after = &w.events[*w.kills.first().expect("the primary was killed")..];
        assert!(
            !after.iter().any(|e| matches!(e, Event::RedsTimeout { .. } | Event::RedsRestarted { .. })),
            "seed {seed}: fell back to REDS after false positives: {after:?}"
        );
        // (A monitor that crashes between a step and its notice loses the notice, not the step.)
        if crash_p == 0.0 {
            assert!(after.iter().any(|e| matches!(e, Event::Promoted { .. })), "seed {seed}: the crash was not failed over: {after:?}");
        }
    }
    if trace {
        for e in &w.events {
            eprintln!("event {}", serde_json::to_string(e).unwrap());
        }
    }
    Outcome {
        rejected: w.decided.values().filter(|o| **o == CollapseOutcome::Rejected).count(),
        aborted: w.events.iter().filter(|e| matches!(e, Event::Aborted { .. })).count(),
        monitor_restarts: w.inc,
        phase: d.phase,
        failovers: d.failovers,
        fault,
        policy,
    }
}

#[test]
fn many_seeds() {
    if let Ok(s) = std::env::var("SIM_SEED") {
        run(s.parse().expect("SIM_SEED is a number"), true);
        return;
    }
    let n: u64 = std::env::var("SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(300);
    let mut failovers = BTreeMap::new();
    let (mut rejected, mut aborted, mut restarts) = (0, 0, 0);
    for seed in 0..n {
        let r = std::panic::catch_unwind(|| run(seed, false));
        match r {
            Ok(o) => {
                *failovers.entry((format!("{:?}", o.policy), format!("{:?}", o.fault), o.failovers > 0)).or_insert(0u32) += 1;
                rejected += o.rejected;
                aborted += o.aborted;
                restarts += o.monitor_restarts;
                let _ = o.phase;
            }
            Err(_) => panic!("seed {seed} failed; rerun with SIM_SEED={seed} for a trace"),
        }
    }
    eprintln!("{n} seeds: {failovers:?}; {rejected} rejected collapses, {aborted} aborted attempts, {restarts} monitor restarts");
    // The runs cover promotions and aborts of every policy.
    assert!(failovers.keys().any(|(p, _, f)| p == "Speculative" && *f));
    assert!(failovers.keys().any(|(p, _, f)| p == "Reds" && *f));
    assert!(failovers.keys().any(|(p, _, f)| p == "Oracle" && *f));
    if n >= 100 {
        assert!(rejected > 0 && aborted > 0 && restarts > 0, "the seeds must cover rejections, aborts and monitor restarts");
    }
}

#[test]
fn same_seed_same_outcome() {
    for seed in [3, 17, 99] {
        let a = run(seed, false);
        let b = run(seed, false);
        assert_eq!(a.phase, b.phase);
        assert_eq!(a.failovers, b.failovers);
    }
}
