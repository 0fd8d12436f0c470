//! The failure monitor's decision logic as a deterministic state machine (sans-I/O).
//!
//! The core API every Understudy core has: [`Monitor::handle`] takes the time (`now_ms`, the
//! caller's clock: wall-clock ms in the runtime, virtual time in the simulation) and one
//! [`Input`] (a ping result, an instance event, the result of a volume operation, a timer tick);
//! [`Monitor::take_outputs`] hands over the [`Action`]s for the driver to carry out;
//! [`Monitor::check_invariants`] runs after every input. The messages and the persisted state
//! live in [`crate::proto`], which the drivers import too. The part of the state that must
//! survive a restart of the monitor is [`Durable`]; the driver persists it (see
//! [`crate::journal`]) **after every `handle` and before executing the actions it took**, so every irreversible step (super, collapse, re-pointing the endpoint,
//! killing an instance) is recorded as intended before it happens. After a restart,
//! [`Monitor::recover`] re-issues the actions of the recorded phase; every action is idempotent
//! in the drivers (a second `Collapse` of the same child reports the outcome already decided),
//! so a restart never promotes twice and never loses a decision.
//!
//! Safety rules the core keeps (the simulation checks them from outside, and
//! [`Monitor::check_invariants`] asserts them from inside: the actions of each input, and the
//! volume, which changes only at a promotion):
//! * the parent volume is only ever given up through a `Collapse` that answered `Promoted`;
//!   aborting drops the *child* (`DropChild`), never the parent;
//! * the endpoint is re-pointed to a backup only after its child was promoted (speculative) or
//!   after the old primary was fenced (REDS: killed, volume detached);
//! * one superposition at a time, and one failover at a time.

use std::collections::BTreeSet;

use crate::proto::*;

/// The monitor core: [`Durable`] plus what may be forgotten on a restart.
#[derive(Clone, Debug)]
pub struct Monitor {
    cfg: MonitorConfig,
    d: Durable,
    /// Pings sent and not yet answered.
    pings_in_flight: BTreeSet<InstanceId>,
    next_ping_ms: u64,
    /// When the starting instance is pinged next (every `backup_ping_interval_ms`).
    next_backup_ping_ms: u64,
    missed_pings: u32,
    /// When a failed action is to be re-issued.
    retry_at_ms: Option<u64>,
    oracle: Option<(Option<u64>, u64)>,
    /// When the failure was first noticed, for the `failover_ms` of events.
    detected_ms: Option<u64>,
    /// Actions issued and not yet taken by [`Monitor::take_outputs`], oldest first. At most
    /// a handful per input; the driver takes them after every input.
    out: Vec<Action>,
    /// The actions of the last input start here in `out` (what `check_invariants` checks).
    last_input_out: usize,
    /// `Durable::volume` before the last input: it may change only by a promotion.
    volume_before: String,
}

impl Monitor {
    /// A fresh monitor that starts the first primary on `volume` (its first actions are in
    /// [`Monitor::take_outputs`]).
    pub fn new(cfg: MonitorConfig, volume: String, now_ms: u64) -> Monitor {
        let first = InstanceId(1);
        let d = Durable {
            volume,
            primary: first,
            next_instance: 2,
            next_child: 1,
            phase: Phase::Booting { instance: first, since_ms: now_ms, healthy: false },
            aborts_ms: vec![],
            failovers: 0,
            silent_since_ms: None,
        };
        Monitor::recover(cfg, d, now_ms)
    }

    /// A monitor restarted from its persisted state: re-issues what the phase needs (in
    /// [`Monitor::take_outputs`]).
    pub fn recover(cfg: MonitorConfig, d: Durable, now_ms: u64) -> Monitor {
        let m = Monitor {
            cfg,
            volume_before: d.volume.clone(),
            d,
            pings_in_flight: BTreeSet::new(),
            next_ping_ms: now_ms,
            next_backup_ping_ms: now_ms,
            missed_pings: 0,
            retry_at_ms: None,
            oracle: None,
            detected_ms: None,
            out: vec![],
            last_input_out: 0,
        };
        let mut m = m;
        // A monitor that gave up stopped its instances (the old primary fenced first):
        // restarted, its cause fixed one hopes, it starts the application again on its volume
        // rather than sit without a primary — after killing the instance it started last, as
        // REDS does, should the crash have cut in before that kill.
        // A journal from before `last` was recorded names no instance to kill, so one may still
        // run: that monitor stays given up (two instances must never share the volume).
        if let Phase::Failed { last: Some(old), .. } = m.d.phase {
            m.d.phase = Phase::RedsFencing { old };
        }
        m.detected_ms = m.d.silent_since_ms;
        let mut acts = vec![];
        // The endpoint lives in the monitor's process: a restarted monitor points it again at
        // the primary that serves (phases that point it themselves, or fence, are left alone).
        let serving = match &m.d.phase {
            Phase::Normal | Phase::Supering { .. } | Phase::Recovering { .. } | Phase::Aborting { .. } => true,
            Phase::Promoting { pointed, .. } => *pointed,
            _ => false,
        };
        if serving {
            acts.push(Action::PointEndpoint(m.d.primary));
        }
        acts.extend(m.phase_actions());
        m.out = acts;
        m.check_invariants();
        m
    }

    /// [`Input::Shutdown`]: a primary that was serving is to be started again (on the same
    /// volume) by the next run, rather than taken for failed. Mid-failover phases stay as they
    /// are and resume.
    fn on_shutdown(&mut self, now_ms: u64) {
        if self.d.phase == Phase::Normal {
            self.boot_again(now_ms);
        }
    }

    /// A new primary instance is to boot on the volume (no instance runs).
    fn boot_again(&mut self, now_ms: u64) {
        let id = self.new_instance();
        self.d.primary = id;
        self.d.silent_since_ms = None;
        self.d.phase = Phase::Booting { instance: id, since_ms: now_ms, healthy: false };
    }

    pub fn durable(&self) -> &Durable {
        &self.d
    }

    /// Whether the monitor is at rest: the primary serves and answers (no failover, no
    /// suspicion) and no failed step waits for its retry. Tests wait for this before they
    /// look at what a failover left, instead of polling a monitor still finishing it.
    pub fn settled(&self) -> bool {
        self.d.phase == Phase::Normal && self.retry_at_ms.is_none() && self.d.silent_since_ms.is_none()
    }

    pub fn config(&self) -> &MonitorConfig {
        &self.cfg
    }

    fn new_instance(&mut self) -> InstanceId {
        let id = InstanceId(self.d.next_instance);
        self.d.next_instance += 1;
        id
    }

    /// The idempotent actions that move the current phase forward (re-issued after a restart
    /// or a failed attempt).
    fn phase_actions(&self) -> Vec<Action> {
        match &self.d.phase {
            Phase::Booting { instance, healthy: false, .. } => vec![Action::StartInstance { id: *instance, volume: self.d.volume.clone() }],
            Phase::Booting { instance, healthy: true, .. } => vec![Action::PointEndpoint(*instance)],
            Phase::Normal | Phase::Failed { .. } => vec![],
            Phase::Supering { child } => vec![Action::Super { parent: self.d.volume.clone(), child: child.clone() }],
            Phase::Recovering { child, backup, stopping, .. } => {
                if *stopping {
                    vec![Action::KillInstance(*backup)]
                } else {
                    vec![Action::StartInstance { id: *backup, volume: child.clone() }]
                }
            }
            Phase::Collapsing { child, .. } => {
                vec![Action::FreezeEndpoint, Action::Collapse { parent: self.d.volume.clone(), child: child.clone() }]
            }
            Phase::Promoting { backup, old, pointed, old_stopped } => {
                let mut a = vec![];
                if !pointed {
                    a.push(Action::PointEndpoint(*backup));
                }
                if !old_stopped {
                    a.push(Action::KillInstance(*old));
                }
                a
            }
            Phase::Aborting { child, backup, backup_stopped, child_dropped, .. } => {
                let mut a = vec![];
                if let (Some(b), false) = (backup, backup_stopped) {
                    a.push(Action::KillInstance(*b));
                }
                if !child_dropped {
                    a.push(Action::DropChild { parent: self.d.volume.clone(), child: child.clone() });
                }
                a
            }
            // Frozen before the fence and until the re-point: clients are held at the endpoint
            // (not sent to an address that is going away) and reach the restarted instance the
            // moment it is pointed at.
            Phase::RedsFencing { old } => vec![Action::FreezeEndpoint, Action::KillInstance(*old)],
            Phase::RedsStarting { backup, stopping, .. } => {
                if *stopping {
                    vec![Action::FreezeEndpoint, Action::KillInstance(*backup)]
                } else {
                    vec![Action::FreezeEndpoint, Action::StartInstance { id: *backup, volume: self.d.volume.clone() }]
                }
            }
            Phase::RedsPointing { backup } => vec![Action::PointEndpoint(*backup)],
        }
    }

    fn aborts_in_window(&self, now_ms: u64) -> usize {
        self.d.aborts_ms.iter().filter(|&&t| now_ms.saturating_sub(t) < self.cfg.abort_window_ms).count()
    }

    fn record_abort(&mut self, now_ms: u64) {
        self.d.aborts_ms.push(now_ms);
        let max = self.cfg.max_aborts.max(1) as usize;
        if self.d.aborts_ms.len() > max {
            let drop = self.d.aborts_ms.len() - max;
            self.d.aborts_ms.drain(..drop);
        }
    }

    /// The instance being recovered on, if any (pinged alongside the primary).
    fn backup(&self) -> Option<InstanceId> {
        match &self.d.phase {
            Phase::Booting { instance, healthy: false, .. } => Some(*instance),
            Phase::Recovering { backup, stopping: false, .. } => Some(*backup),
            Phase::RedsStarting { backup, stopping: false, .. } => Some(*backup),
            _ => None,
        }
    }

    /// Whether the primary is still the one to watch (not being replaced for good).
    fn primary_watched(&self) -> bool {
        matches!(self.d.phase, Phase::Normal | Phase::Supering { .. } | Phase::Recovering { .. } | Phase::Collapsing { .. } | Phase::Aborting { .. })
    }

    /// Takes one input at time `now_ms`; the actions it calls for are added to
    /// [`Monitor::take_outputs`]. Checks the invariants afterwards.
    pub fn handle(&mut self, now_ms: u64, input: Input) {
        let mut out = vec![];
        self.volume_before = self.d.volume.clone();
        match input {
            Input::Tick => self.on_tick(now_ms, &mut out),
            Input::Shutdown => self.on_shutdown(now_ms),
            Input::PingOk(id) => {
                self.pings_in_flight.remove(&id);
                self.on_ping_ok(now_ms, id, &mut out);
            }
            Input::PingFailed(id) => {
                self.pings_in_flight.remove(&id);
                self.on_ping_failed(now_ms, id, &mut out);
            }
            // Its processes run: ask at once whether it is up (a fast start is seen at once).
            Input::InstanceStarted(id) => {
                if Some(id) == self.backup() && self.pings_in_flight.insert(id) {
                    out.push(Action::Ping(id));
                }
            }
            Input::InstanceStartFailed { id, error } => self.on_instance_failed(now_ms, id, &error, &mut out),
            Input::InstanceExited(id) => self.on_instance_failed(now_ms, id, "exited", &mut out),
            Input::InstanceStopped(id) => self.on_stopped(now_ms, id, &mut out),
            Input::EndpointPointed(id) => self.on_pointed(now_ms, id, &mut out),
            Input::EndpointFailed { .. } | Input::CollapseFailed { .. } | Input::DropFailed { .. } | Input::KillFailed { .. } => {
                self.retry_at_ms = Some(now_ms + self.cfg.retry_backoff_ms);
            }
            Input::SuperDone { child } => self.on_super_done(now_ms, child, &mut out),
            Input::SuperFailed { child, error, existing_child } => self.on_super_failed(now_ms, child, error, existing_child, &mut out),
            Input::CollapseDone { child, outcome } => self.on_collapse(now_ms, child, outcome, &mut out),
            Input::ChildDropped { child } => {
                if let Phase::Aborting { child: c, child_dropped, .. } = &mut self.d.phase {
                    if *c == child {
                        *child_dropped = true;
                    }
                }
                self.maybe_finish_abort(now_ms, &mut out);
            }
            Input::OracleHint { primary_back_after_ms, recovery_ms } => {
                self.oracle = Some((primary_back_after_ms, recovery_ms));
                if self.cfg.policy == PolicyKind::Oracle && self.d.silent_since_ms.is_some() && self.d.phase == Phase::Normal {
                    self.oracle_decide(now_ms, &mut out);
                }
            }
        }
        self.last_input_out = self.out.len();
        self.out.extend(out);
        self.check_invariants();
    }

    /// The actions issued since the last call, oldest first: the driver carries them out in
    /// this order (after persisting [`Monitor::durable`]).
    pub fn take_outputs(&mut self) -> Vec<Action> {
        self.last_input_out = 0;
        std::mem::take(&mut self.out)
    }

    /// Panics if the monitor's state, or the actions of its last input, break one of its
    /// invariants (the safety rules of the module doc among them); `handle` runs it after every
    /// input, in all builds (the state is a few fields, the actions a handful).
    pub fn check_invariants(&self) {
        let d = &self.d;
        assert!(d.primary.0 < d.next_instance, "primary id was allocated");
        assert!(d.aborts_ms.len() <= self.cfg.max_aborts.max(1) as usize, "abort history is bounded");
        // The volume changes hands only through a collapse that answered `Promoted`: the input
        // that changed it left the monitor promoting the child that is now the volume.
        assert!(
            d.volume == self.volume_before || matches!(d.phase, Phase::Promoting { .. }),
            "volume changed from {} to {} outside a promotion (phase {:?})",
            self.volume_before,
            d.volume,
            d.phase
        );
        let allocated = |id: &InstanceId| id.0 < d.next_instance;
        // One superposition at a time: the phase names at most one child, of this volume.
        let own_child = |c: &str| c.strip_prefix(&d.volume).and_then(|r| r.strip_prefix(".fo-")).and_then(|n| n.parse::<u64>().ok()).is_some_and(|n| n < d.next_child);
        match &d.phase {
            Phase::Booting { instance, .. } => assert_eq!(*instance, d.primary, "the booting instance is the primary"),
            Phase::Normal | Phase::Failed { .. } => {}
            Phase::Supering { child } => assert!(own_child(child), "super child {child} of {}", d.volume),
            Phase::Recovering { child, backup, attempt, .. } => {
                assert!(own_child(child), "recovering on {child}, not a child of {}", d.volume);
                assert!(allocated(backup) && *backup != d.primary, "backup {backup} (primary {})", d.primary);
                assert!(*attempt >= 1, "attempt {attempt}");
            }
            Phase::Collapsing { child, backup } => {
                assert!(own_child(child), "collapsing {child}, not a child of {}", d.volume);
                assert!(allocated(backup) && *backup != d.primary, "backup {backup} (primary {})", d.primary);
            }
            Phase::Promoting { backup, old, .. } => {
                assert_ne!(backup, old);
                assert_eq!(*backup, d.primary, "the promoted backup is the primary");
            }
            Phase::Aborting { backup, .. } => {
                if let Some(b) = backup {
                    assert!(allocated(b) && *b != d.primary, "aborted backup {b} (primary {})", d.primary);
                }
            }
            Phase::RedsFencing { old } => assert!(allocated(old)),
            Phase::RedsStarting { old, backup, attempt, .. } => {
                assert!(allocated(backup) && backup != old, "REDS backup {backup} of {old}");
                assert!(*attempt >= 1, "attempt {attempt}");
            }
            Phase::RedsPointing { backup } => assert!(allocated(backup) && *backup != d.primary, "REDS backup {backup}"),
        }
        for a in &self.out[self.last_input_out..] {
            match a {
                // Clients reach a new instance only once it may serve: it is the primary (a
                // promotion made it so, or it boots), or REDS restarted it after the fence.
                Action::PointEndpoint(id) => assert!(
                    *id == d.primary || matches!(d.phase, Phase::RedsPointing { backup } if backup == *id),
                    "endpoint pointed at {id}, neither the primary {} nor a fenced REDS restart ({:?})",
                    d.primary,
                    d.phase
                ),
                // The parent is never dropped nor collapsed away: only a child is.
                Action::DropChild { parent, child } | Action::Collapse { parent, child } | Action::Super { parent, child } => {
                    assert!(*parent == self.volume_before && *child != *parent, "{a:?} on volume {}", self.volume_before)
                }
                Action::StartInstance { id, .. } | Action::KillInstance(id) | Action::Ping(id) => assert!(allocated(id), "{a:?}"),
                Action::FreezeEndpoint | Action::Notify(_) => {}
            }
        }
    }

    fn on_tick(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        if let Some(t) = self.retry_at_ms {
            if now_ms >= t {
                self.retry_at_ms = None;
                out.extend(self.phase_actions());
            }
        }
        let mut targets = vec![];
        if now_ms >= self.next_ping_ms {
            self.next_ping_ms = now_ms + self.cfg.ping_interval_ms;
            if self.primary_watched() {
                targets.push(self.d.primary);
            }
        }
        if now_ms >= self.next_backup_ping_ms {
            self.next_backup_ping_ms = now_ms + self.cfg.backup_ping_interval_ms.min(self.cfg.ping_interval_ms).max(1);
            if let Some(b) = self.backup() {
                targets.push(b);
            }
        }
        for t in targets {
            if self.pings_in_flight.insert(t) {
                out.push(Action::Ping(t));
            }
        }
        // Time-outs of the current phase.
        let healthy_timeout = self.cfg.healthy_timeout_ms;
        match self.d.phase.clone() {
            Phase::Booting { instance, since_ms, healthy: false } if now_ms.saturating_sub(since_ms) > healthy_timeout => {
                let reason = format!("instance {instance} did not become healthy within {healthy_timeout} ms");
                self.fail(reason, instance, out);
            }
            Phase::Recovering { backup, since_ms, stopping: false, .. } if now_ms.saturating_sub(since_ms) > healthy_timeout => {
                self.on_instance_failed(now_ms, backup, &format!("not healthy within {healthy_timeout} ms"), out);
            }
            Phase::RedsStarting { backup, since_ms, stopping: false, .. } if now_ms.saturating_sub(since_ms) > healthy_timeout => {
                self.on_instance_failed(now_ms, backup, &format!("not healthy within {healthy_timeout} ms"), out);
            }
            Phase::Normal | Phase::Supering { .. } | Phase::Recovering { .. } | Phase::Collapsing { .. } | Phase::Aborting { .. } => {
                self.check_reds_timeout(now_ms, out);
            }
            _ => {}
        }
    }

    /// Gives up: `last` (the instance started last) is being killed.
    fn fail(&mut self, reason: String, last: InstanceId, out: &mut Vec<Action>) {
        tracing::error!("{reason}");
        out.push(Action::KillInstance(last));
        self.d.phase = Phase::Failed { reason: reason.clone(), last: Some(last) };
        out.push(Action::Notify(Event::GaveUp { reason }));
    }

    /// REDS (or speculative's fallback): the primary silent for the whole timeout.
    fn check_reds_timeout(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        let Some(since) = self.d.silent_since_ms else { return };
        if now_ms.saturating_sub(since) < self.cfg.reds_timeout_ms || self.d.phase != Phase::Normal {
            return;
        }
        let use_reds = match self.cfg.policy {
            PolicyKind::Reds => true,
            PolicyKind::Speculative => self.aborts_in_window(now_ms) >= self.cfg.max_aborts as usize,
            // Only reached when the hint said "comes back" and it did not: stop waiting.
            PolicyKind::Oracle => true,
        };
        if use_reds {
            self.start_reds(out);
        }
    }

    fn start_reds(&mut self, out: &mut Vec<Action>) {
        self.oracle = None;
        let old = self.d.primary;
        self.d.phase = Phase::RedsFencing { old };
        out.push(Action::Notify(Event::RedsTimeout { instance: old }));
        out.extend(self.phase_actions());
    }

    fn oracle_decide(&mut self, _now_ms: u64, out: &mut Vec<Action>) {
        match self.oracle {
            Some((Some(back_ms), recovery_ms)) if back_ms <= recovery_ms => {} // waiting is shorter
            _ => self.start_reds(out),
        }
    }

    fn on_ping_ok(&mut self, now_ms: u64, id: InstanceId, out: &mut Vec<Action>) {
        if id == self.d.primary && self.primary_watched() {
            if let Some(since) = self.d.silent_since_ms.take() {
                // A failure that healed: the oracle's hint was about it.
                self.oracle = None;
                out.push(Action::Notify(Event::PrimaryAnswered { instance: id, silent_ms: now_ms.saturating_sub(since) }));
            }
            self.missed_pings = 0;
            self.detected_ms = None;
            match self.d.phase.clone() {
                // The primary answers again: it wins. Stop the speculation.
                Phase::Supering { child } => {
                    self.d.phase = Phase::Aborting {
                        child,
                        backup: None,
                        backup_stopped: true,
                        child_dropped: false,
                        reason: "the primary answered again".into(),
                        counts: false,
                    };
                    out.extend(self.phase_actions());
                }
                Phase::Recovering { child, backup, .. } => {
                    self.d.phase = Phase::Aborting {
                        child,
                        backup: Some(backup),
                        backup_stopped: false,
                        child_dropped: false,
                        reason: "the primary answered again".into(),
                        counts: false,
                    };
                    out.extend(self.phase_actions());
                }
                // Collapsing: the decision is the tracking shard's now.
                _ => {}
            }
            return;
        }
        if Some(id) == self.backup() {
            match self.d.phase.clone() {
                Phase::Booting { instance, since_ms, healthy: false } => {
                    self.d.phase = Phase::Booting { instance, since_ms, healthy: true };
                    out.extend(self.phase_actions());
                }
                Phase::Recovering { child, backup, .. } => {
                    self.d.phase = Phase::Collapsing { child: child.clone(), backup };
                    out.push(Action::Notify(Event::BackupHealthy { instance: backup }));
                    out.extend(self.phase_actions());
                }
                Phase::RedsStarting { backup, .. } => {
                    self.d.phase = Phase::RedsPointing { backup };
                    out.push(Action::Notify(Event::BackupHealthy { instance: backup }));
                    out.extend(self.phase_actions());
                }
                _ => {}
            }
        }
    }

    fn on_ping_failed(&mut self, now_ms: u64, id: InstanceId, out: &mut Vec<Action>) {
        if id != self.d.primary || !self.primary_watched() {
            return; // a backup that is not up yet: its health timeout decides
        }
        self.missed_pings += 1;
        if self.d.silent_since_ms.is_none() {
            self.d.silent_since_ms = Some(now_ms);
            self.detected_ms = Some(now_ms);
            out.push(Action::Notify(Event::Suspected { instance: id }));
        }
        if self.d.phase != Phase::Normal {
            return;
        }
        match self.cfg.policy {
            PolicyKind::Speculative => {
                let fallen_back = self.aborts_in_window(now_ms) >= self.cfg.max_aborts as usize;
                if !fallen_back && self.missed_pings >= self.cfg.speculate_after_missed_pings.max(1) {
                    let child = format!("{}.fo-{}", self.d.volume, self.d.next_child);
                    self.d.next_child += 1;
                    self.d.phase = Phase::Supering { child };
                    out.extend(self.phase_actions());
                }
            }
            PolicyKind::Oracle => self.oracle_decide(now_ms, out),
            PolicyKind::Reds => {}
        }
        self.check_reds_timeout(now_ms, out);
    }

    fn on_instance_failed(&mut self, now_ms: u64, id: InstanceId, why: &str, out: &mut Vec<Action>) {
        match self.d.phase.clone() {
            Phase::Booting { instance, healthy: false, .. } if instance == id => {
                self.fail(format!("the first instance failed to start: {why}"), instance, out);
            }
            Phase::Recovering { child, backup, attempt, since_ms, stopping: false } if backup == id => {
                if attempt >= self.cfg.max_backup_starts {
                    self.d.phase = Phase::Aborting {
                        child,
                        backup: Some(backup),
                        backup_stopped: false,
                        child_dropped: false,
                        reason: format!("backup {backup} failed {attempt} times (last: {why})"),
                        counts: true,
                    };
                } else {
                    self.d.phase = Phase::Recovering { child, backup, attempt, since_ms, stopping: true };
                }
                out.extend(self.phase_actions());
            }
            Phase::RedsStarting { old, backup, attempt, since_ms, stopping: false } if backup == id => {
                if attempt >= self.cfg.max_backup_starts {
                    self.fail(format!("REDS restart failed {attempt} times (last: {why}); volume {} is intact", self.d.volume), backup, out);
                } else {
                    self.d.phase = Phase::RedsStarting { old, backup, attempt, since_ms, stopping: true };
                    out.extend(self.phase_actions());
                }
            }
            // The primary exited on its own: a ping will notice; nothing more to know here.
            _ => {
                let _ = now_ms;
            }
        }
    }

    fn on_stopped(&mut self, now_ms: u64, id: InstanceId, out: &mut Vec<Action>) {
        match self.d.phase.clone() {
            Phase::Recovering { child, backup, attempt, stopping: true, .. } if backup == id => {
                let next = self.new_instance();
                self.d.phase = Phase::Recovering { child: child.clone(), backup: next, attempt: attempt + 1, since_ms: now_ms, stopping: false };
                out.push(Action::StartInstance { id: next, volume: child.clone() });
                out.push(Action::Notify(Event::BackupStarted { instance: next, volume: child }));
            }
            Phase::Promoting { backup, old, pointed, old_stopped: false } if old == id => {
                self.d.phase = Phase::Promoting { backup, old, pointed, old_stopped: true };
                self.maybe_finish_promotion(now_ms, out);
            }
            Phase::Aborting { child, backup: Some(b), backup_stopped: false, child_dropped, reason, counts } if b == id => {
                self.d.phase = Phase::Aborting { child, backup: Some(b), backup_stopped: true, child_dropped, reason, counts };
                self.maybe_finish_abort(now_ms, out);
            }
            Phase::RedsFencing { old } if old == id => {
                let backup = self.new_instance();
                self.d.phase = Phase::RedsStarting { old, backup, attempt: 1, since_ms: now_ms, stopping: false };
                out.extend(self.phase_actions());
                out.push(Action::Notify(Event::BackupStarted { instance: backup, volume: self.d.volume.clone() }));
            }
            Phase::RedsStarting { old, backup, attempt, stopping: true, .. } if backup == id => {
                let next = self.new_instance();
                self.d.phase = Phase::RedsStarting { old, backup: next, attempt: attempt + 1, since_ms: now_ms, stopping: false };
                out.extend(self.phase_actions());
            }
            _ => {}
        }
    }

    fn on_pointed(&mut self, now_ms: u64, id: InstanceId, out: &mut Vec<Action>) {
        match self.d.phase.clone() {
            Phase::Promoting { backup, old, pointed: false, old_stopped } if backup == id => {
                self.d.phase = Phase::Promoting { backup, old, pointed: true, old_stopped };
                self.maybe_finish_promotion(now_ms, out);
            }
            Phase::Booting { instance, healthy: true, .. } if instance == id => {
                self.d.phase = Phase::Normal;
                self.reset_silence();
                out.push(Action::Notify(Event::PrimaryUp { instance, volume: self.d.volume.clone() }));
            }
            Phase::RedsPointing { backup } if backup == id => {
                self.d.primary = backup;
                let failover_ms = self.complete_failover(now_ms);
                out.push(Action::Notify(Event::RedsRestarted { instance: backup, volume: self.d.volume.clone(), failover_ms }));
            }
            _ => {}
        }
    }

    fn reset_silence(&mut self) {
        self.d.silent_since_ms = None;
        self.missed_pings = 0;
        self.pings_in_flight.clear();
    }

    fn on_super_done(&mut self, now_ms: u64, child: String, out: &mut Vec<Action>) {
        if let Phase::Supering { child: c } = &self.d.phase {
            if *c == child {
                let backup = self.new_instance();
                self.d.phase = Phase::Recovering { child: child.clone(), backup, attempt: 1, since_ms: now_ms, stopping: false };
                out.push(Action::Notify(Event::Superposed { parent: self.d.volume.clone(), child: child.clone() }));
                out.push(Action::StartInstance { id: backup, volume: child.clone() });
                out.push(Action::Notify(Event::BackupStarted { instance: backup, volume: child }));
            }
        }
    }

    fn on_super_failed(&mut self, now_ms: u64, child: String, error: String, existing_child: Option<String>, out: &mut Vec<Action>) {
        if let Phase::Supering { child: c } = &self.d.phase {
            if *c == child {
                match existing_child {
                    // A superposition left by an earlier attempt: drop it first.
                    Some(stale) if stale != child => {
                        self.d.phase = Phase::Aborting {
                            child: stale,
                            backup: None,
                            backup_stopped: true,
                            child_dropped: false,
                            reason: format!("stale super child found: {error}"),
                            counts: false,
                        };
                        out.extend(self.phase_actions());
                    }
                    _ => {
                        // Storage unavailable for now: a new attempt on the next silence.
                        self.d.phase = Phase::Normal;
                        self.retry_at_ms = Some(now_ms + self.cfg.retry_backoff_ms);
                        out.push(Action::Notify(Event::Aborted { child, reason: format!("super failed: {error}") }));
                    }
                }
            }
        }
    }

    fn on_collapse(&mut self, now_ms: u64, child: String, outcome: CollapseOutcome, out: &mut Vec<Action>) {
        let Phase::Collapsing { child: c, backup } = self.d.phase.clone() else { return };
        if c != child {
            return;
        }
        match outcome {
            CollapseOutcome::Promoted => {
                // Irreversible: the parent is fenced; the child is the volume from now on.
                let old = self.d.primary;
                self.d.volume = child;
                self.d.primary = backup;
                self.d.phase = Phase::Promoting { backup, old, pointed: false, old_stopped: false };
                out.extend(self.phase_actions());
            }
            CollapseOutcome::Rejected => {
                // The parent was written: the primary lives (thaw the endpoint: it serves on).
                // The child is already discarded.
                out.push(Action::PointEndpoint(self.d.primary));
                self.d.phase = Phase::Aborting {
                    child,
                    backup: Some(backup),
                    backup_stopped: false,
                    child_dropped: true,
                    reason: "collapse rejected: the primary wrote to its volume".into(),
                    counts: true,
                };
                out.extend(self.phase_actions());
            }
        }
        let _ = now_ms;
    }

    /// Back to `Normal` after a failover (REDS or promotion): counted, the replaced primary's
    /// abort history dropped. Returns the failover's latency from detection, in ms.
    fn complete_failover(&mut self, now_ms: u64) -> u64 {
        self.d.phase = Phase::Normal;
        self.d.failovers += 1;
        self.d.aborts_ms.clear();
        self.reset_silence();
        self.detected_ms.take().map(|t| now_ms.saturating_sub(t)).unwrap_or(0)
    }

    fn maybe_finish_promotion(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        if let Phase::Promoting { backup, pointed: true, old_stopped: true, .. } = self.d.phase {
            let failover_ms = self.complete_failover(now_ms);
            out.push(Action::Notify(Event::Promoted { instance: backup, volume: self.d.volume.clone(), failover_ms }));
        }
    }

    fn maybe_finish_abort(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        if let Phase::Aborting { child, backup, backup_stopped, child_dropped: true, reason, counts } = self.d.phase.clone() {
            if backup.is_none() || backup_stopped {
                self.d.phase = Phase::Normal;
                if counts {
                    self.record_abort(now_ms);
                }
                out.push(Action::Notify(Event::Aborted { child, reason }));
                // Still silent? The next missed ping starts a new attempt (or the REDS timeout).
                self.missed_pings = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One input, and the actions it called for.
    fn step(m: &mut Monitor, now_ms: u64, input: Input) -> Vec<Action> {
        m.handle(now_ms, input);
        m.take_outputs()
    }

    /// A fresh monitor and its first actions.
    fn start(cfg: MonitorConfig, volume: String, now_ms: u64) -> (Monitor, Vec<Action>) {
        let mut m = Monitor::new(cfg, volume, now_ms);
        let a = m.take_outputs();
        (m, a)
    }

    /// A monitor restarted from `d`, and the actions it re-issues.
    fn restart(cfg: MonitorConfig, d: Durable, now_ms: u64) -> (Monitor, Vec<Action>) {
        let mut m = Monitor::recover(cfg, d, now_ms);
        let a = m.take_outputs();
        (m, a)
    }

    fn boot(m: &mut Monitor, now: u64) {
        let a = step(m, now, Input::PingOk(InstanceId(1)));
        assert_eq!(a, vec![Action::PointEndpoint(InstanceId(1))]);
        step(m, now, Input::EndpointPointed(InstanceId(1)));
        assert_eq!(m.durable().phase, Phase::Normal);
    }

    /// Each invariant `check_invariants` states fails on a state (or an action) that breaks it,
    /// and names what broke.
    #[test]
    fn check_invariants_names_a_broken_invariant() {
        let (mut m, _) = start(MonitorConfig::default(), "db".into(), 0);
        boot(&mut m, 0);
        step(&mut m, 1_000, Input::PingFailed(InstanceId(1)));
        step(&mut m, 1_010, Input::SuperDone { child: "db.fo-1".into() });
        m.check_invariants();
        let broken = |what: &str, f: &dyn Fn(&mut Monitor)| {
            let mut b = m.clone();
            f(&mut b);
            let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| b.check_invariants())).expect_err(what);
            let msg = e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
            assert!(msg.contains(what), "{what:?} not in {msg:?}");
        };
        broken("outside a promotion", &|b| b.d.volume = "db.fo-1".into());
        broken("not a child of db", &|b| {
            if let Phase::Recovering { child, .. } = &mut b.d.phase {
                *child = "other.fo-1".into();
            }
        });
        broken("backup i1", &|b| {
            if let Phase::Recovering { backup, .. } = &mut b.d.phase {
                *backup = InstanceId(1);
            }
        });
        broken("endpoint pointed at i2", &|b| b.out.push(Action::PointEndpoint(InstanceId(2))));
        broken("on volume db", &|b| b.out.push(Action::DropChild { parent: "db".into(), child: "db".into() }));
        broken("on volume db", &|b| b.out.push(Action::Collapse { parent: "db.fo-1".into(), child: "db.fo-2".into() }));
        broken("StartInstance", &|b| b.out.push(Action::StartInstance { id: InstanceId(9), volume: "db".into() }));
        broken("the promoted backup is the primary", &|b| {
            b.d.phase = Phase::Promoting { backup: InstanceId(2), old: InstanceId(1), pointed: false, old_stopped: false }
        });
    }

    #[test]
    fn a_monitor_restarted_after_giving_up_boots_on_its_volume_again() {
        let cfg = MonitorConfig { healthy_timeout_ms: 1_000, ..MonitorConfig::default() };
        let (mut m, _) = start(cfg.clone(), "db".into(), 0);
        let a = step(&mut m, 2_000, Input::Tick);
        assert!(a.iter().any(|a| matches!(a, Action::Notify(Event::GaveUp { .. }))), "{a:?}");
        assert!(a.contains(&Action::KillInstance(InstanceId(1))), "{a:?}");
        // Restarted: the instance it gave up on is killed again (that kill may never have
        // run), and only once it is stopped is one started on the volume.
        let (mut m, a) = restart(cfg.clone(), m.durable().clone(), 3_000);
        assert_eq!(a, vec![Action::FreezeEndpoint, Action::KillInstance(InstanceId(1))]);
        let a = step(&mut m, 3_100, Input::InstanceStopped(InstanceId(1)));
        assert!(a.contains(&Action::StartInstance { id: InstanceId(2), volume: "db".into() }), "{a:?}");
        // A journal from before `last` was recorded: the instance it gave up on is unknown and
        // may still run, so nothing is started.
        let mut d = m.durable().clone();
        d.phase = serde_json::from_str(r#"{"Failed":{"reason":"old"}}"#).unwrap();
        let (m, a) = restart(cfg, d, 4_000);
        assert!(!a.iter().any(|a| matches!(a, Action::StartInstance { .. })), "{a:?}");
        assert!(matches!(m.durable().phase, Phase::Failed { last: None, .. }), "{:?}", m.durable().phase);
    }

    #[test]
    fn restart_mid_failover_keeps_the_detection_time_and_promotes_once() {
        let (mut m, _) = start(MonitorConfig::default(), "db".into(), 0);
        boot(&mut m, 100);
        let a = step(&mut m, 1_000, Input::PingFailed(InstanceId(1)));
        assert!(a.contains(&Action::Super { parent: "db".into(), child: "db.fo-1".into() }), "{a:?}");
        step(&mut m, 1_010, Input::SuperDone { child: "db.fo-1".into() });
        // Crash: recover from the durable state only.
        let d = m.durable().clone();
        assert_eq!(d.silent_since_ms, Some(1_000));
        let (mut m, a) = restart(MonitorConfig::default(), d, 2_000);
        // The endpoint (lost with the monitor) points at the primary again while it may serve.
        assert_eq!(a, vec![Action::PointEndpoint(InstanceId(1)), Action::StartInstance { id: InstanceId(2), volume: "db.fo-1".into() }]);
        step(&mut m, 2_100, Input::PingFailed(InstanceId(1)));
        let a = step(&mut m, 3_000, Input::PingOk(InstanceId(2)));
        assert!(a.contains(&Action::Collapse { parent: "db".into(), child: "db.fo-1".into() }), "{a:?}");
        // Crash again before the answer: the collapse is asked again (idempotent in drivers).
        let (mut m, a) = restart(MonitorConfig::default(), m.durable().clone(), 3_100);
        // Frozen first: no client reaches the old primary between the collapse and the re-point.
        assert_eq!(a, vec![Action::FreezeEndpoint, Action::Collapse { parent: "db".into(), child: "db.fo-1".into() }]);
        let a = step(&mut m, 3_200, Input::CollapseDone { child: "db.fo-1".into(), outcome: CollapseOutcome::Promoted });
        assert_eq!(a, vec![Action::PointEndpoint(InstanceId(2)), Action::KillInstance(InstanceId(1))]);
        // A late duplicate answer changes nothing.
        assert!(step(&mut m, 3_250, Input::CollapseDone { child: "db.fo-1".into(), outcome: CollapseOutcome::Promoted }).is_empty());
        step(&mut m, 3_300, Input::EndpointPointed(InstanceId(2)));
        let a = step(&mut m, 3_400, Input::InstanceStopped(InstanceId(1)));
        assert_eq!(
            a,
            vec![Action::Notify(Event::Promoted { instance: InstanceId(2), volume: "db.fo-1".into(), failover_ms: 2_400 })]
        );
        assert_eq!(m.durable().volume, "db.fo-1");
        assert_eq!(m.durable().failovers, 1);
    }

    /// A healthy primary that misses a ping now and then (a loaded machine) and answers again
    /// before any backup is up: each suspicion is a speculation aborted because the primary
    /// answered. Those must not switch speculation off: when this primary then really crashes,
    /// the next missed ping supers at once. (They used to count towards `max_aborts`: three of
    /// them within `abort_window_ms` fell back to REDS, and a crash then waited out the REDS
    /// timeout — or, with the bench's 600 s one, until the oldest abort left the window: the
    /// 289 s outage of Figure 6's scenario II in a loaded full run.)
    #[test]
    fn primaries_that_answered_again_do_not_switch_speculation_off() {
        let cfg = MonitorConfig { max_aborts: 3, reds_timeout_ms: 600_000, abort_window_ms: 600_000, ..MonitorConfig::default() };
        let (mut m, _) = start(cfg, "db".into(), 0);
        boot(&mut m, 0);
        let mut t = 1_000;
        for n in 1..=5u64 {
            let child = format!("db.fo-{n}");
            let backup = InstanceId(n + 1);
            let a = step(&mut m, t, Input::PingFailed(InstanceId(1)));
            assert!(a.contains(&Action::Super { parent: "db".into(), child: child.clone() }), "suspicion {n}: {a:?}");
            step(&mut m, t + 10, Input::SuperDone { child: child.clone() });
            // The primary answers again while the backup recovers: abort.
            let a = step(&mut m, t + 500, Input::PingOk(InstanceId(1)));
            assert!(a.contains(&Action::KillInstance(backup)), "{a:?}");
            step(&mut m, t + 510, Input::InstanceStopped(backup));
            let a = step(&mut m, t + 520, Input::ChildDropped { child: child.clone() });
            assert!(matches!(&a[..], [Action::Notify(Event::Aborted { .. })]), "{a:?}");
            t += 10_000;
        }
        assert!(m.durable().aborts_ms.is_empty(), "{:?}", m.durable().aborts_ms);
        // Now it crashes: speculation, at the first missed ping.
        let a = step(&mut m, t, Input::PingFailed(InstanceId(1)));
        assert!(a.contains(&Action::Super { parent: "db".into(), child: "db.fo-6".into() }), "{a:?}");
    }

    /// Aborts that do count (rejected collapses) are the replaced primary's history: after a
    /// failover the new primary speculates again from a clean slate.
    #[test]
    fn a_failover_clears_the_abort_history() {
        let cfg = MonitorConfig { max_aborts: 2, reds_timeout_ms: 5_000, ..MonitorConfig::default() };
        let (mut m, _) = start(cfg, "db".into(), 0);
        boot(&mut m, 0);
        let child = "db.fo-1".to_string();
        step(&mut m, 1_000, Input::PingFailed(InstanceId(1)));
        step(&mut m, 1_010, Input::SuperDone { child: child.clone() });
        step(&mut m, 1_020, Input::PingOk(InstanceId(2)));
        step(&mut m, 1_030, Input::CollapseDone { child: child.clone(), outcome: CollapseOutcome::Rejected });
        step(&mut m, 1_040, Input::InstanceStopped(InstanceId(2)));
        assert_eq!(m.durable().aborts_ms.len(), 1);
        // The primary answers, then a REDS-style failover happens another way: here a second
        // speculation that promotes.
        step(&mut m, 2_000, Input::PingOk(InstanceId(1)));
        step(&mut m, 3_000, Input::PingFailed(InstanceId(1)));
        step(&mut m, 3_010, Input::SuperDone { child: "db.fo-2".into() });
        step(&mut m, 3_020, Input::PingOk(InstanceId(3)));
        step(&mut m, 3_030, Input::CollapseDone { child: "db.fo-2".into(), outcome: CollapseOutcome::Promoted });
        step(&mut m, 3_040, Input::EndpointPointed(InstanceId(3)));
        let a = step(&mut m, 3_050, Input::InstanceStopped(InstanceId(1)));
        assert!(matches!(&a[..], [Action::Notify(Event::Promoted { .. })]), "{a:?}");
        assert!(m.durable().aborts_ms.is_empty());
    }

    /// REDS freezes the endpoint before fencing, and keeps it frozen while the new instance
    /// starts: clients wait at the endpoint (rather than being sent to an address that is
    /// gone) and reach the restarted instance as soon as it is pointed at.
    #[test]
    fn reds_freezes_the_endpoint_from_the_fence_to_the_re_point() {
        let cfg = MonitorConfig { policy: PolicyKind::Reds, reds_timeout_ms: 1_000, ..MonitorConfig::default() };
        let (mut m, _) = start(cfg, "db".into(), 0);
        boot(&mut m, 0);
        step(&mut m, 1_000, Input::PingFailed(InstanceId(1)));
        let a = step(&mut m, 2_100, Input::Tick);
        let freeze = a.iter().position(|x| *x == Action::FreezeEndpoint).expect("frozen");
        let kill = a.iter().position(|x| *x == Action::KillInstance(InstanceId(1))).expect("fenced");
        assert!(freeze < kill, "{a:?}");
        let a = step(&mut m, 2_200, Input::InstanceStopped(InstanceId(1)));
        assert!(a.contains(&Action::StartInstance { id: InstanceId(2), volume: "db".into() }), "{a:?}");
        assert!(!a.iter().any(|x| matches!(x, Action::PointEndpoint(_))), "{a:?}");
        let a = step(&mut m, 3_000, Input::PingOk(InstanceId(2)));
        assert!(a.contains(&Action::PointEndpoint(InstanceId(2))), "{a:?}");
    }

    /// A kill that fails (a process that would not die, a volume that would not detach) is
    /// not taken as done: the promotion waits, and the kill is issued again after the backoff
    /// until it succeeds.
    #[test]
    fn a_failed_kill_is_retried_and_the_promotion_waits_for_it() {
        let cfg = MonitorConfig { retry_backoff_ms: 500, ..MonitorConfig::default() };
        let (mut m, _) = start(cfg, "db".into(), 0);
        boot(&mut m, 0);
        assert!(m.settled());
        step(&mut m, 1_000, Input::PingFailed(InstanceId(1)));
        assert!(!m.settled());
        step(&mut m, 1_010, Input::SuperDone { child: "db.fo-1".into() });
        step(&mut m, 1_020, Input::PingOk(InstanceId(2)));
        let a = step(&mut m, 1_030, Input::CollapseDone { child: "db.fo-1".into(), outcome: CollapseOutcome::Promoted });
        assert!(a.contains(&Action::KillInstance(InstanceId(1))), "{a:?}");
        step(&mut m, 1_040, Input::EndpointPointed(InstanceId(2)));
        let a = step(&mut m, 1_050, Input::KillFailed { id: InstanceId(1), error: "still alive".into() });
        assert!(a.is_empty(), "{a:?}");
        assert!(!m.settled(), "a fence still to do");
        // Not before the backoff.
        let a = step(&mut m, 1_300, Input::Tick);
        assert!(!a.contains(&Action::KillInstance(InstanceId(1))), "{a:?}");
        let a = step(&mut m, 1_600, Input::Tick);
        assert!(a.contains(&Action::KillInstance(InstanceId(1))), "{a:?}");
        assert!(!matches!(m.durable().phase, Phase::Normal));
        let a = step(&mut m, 1_700, Input::InstanceStopped(InstanceId(1)));
        assert!(matches!(&a[..], [Action::Notify(Event::Promoted { .. })]), "{a:?}");
        assert!(m.settled());
    }

    #[test]
    fn rejected_collapse_keeps_the_parent_and_falls_back_to_reds() {
        let cfg = MonitorConfig { max_aborts: 2, reds_timeout_ms: 10_000, ..MonitorConfig::default() };
        let (mut m, _) = start(cfg, "db".into(), 0);
        boot(&mut m, 0);
        let mut t = 1_000;
        for n in 1..=2u64 {
            let child = format!("db.fo-{n}");
            let backup = InstanceId(n + 1);
            let a = step(&mut m, t, Input::PingFailed(InstanceId(1)));
            assert!(a.contains(&Action::Super { parent: "db".into(), child: child.clone() }), "{a:?}");
            step(&mut m, t + 10, Input::SuperDone { child: child.clone() });
            step(&mut m, t + 20, Input::PingOk(backup));
            let a = step(&mut m, t + 30, Input::CollapseDone { child: child.clone(), outcome: CollapseOutcome::Rejected });
            // The endpoint thaws back to the primary; the rejected child is gone already: no drop.
            assert_eq!(a, vec![Action::PointEndpoint(InstanceId(1)), Action::KillInstance(backup)]);
            let a = step(&mut m, t + 40, Input::InstanceStopped(backup));
            assert!(matches!(&a[..], [Action::Notify(Event::Aborted { .. })]), "{a:?}");
            assert_eq!(m.durable().volume, "db");
            t += 1_000;
        }
        // Two aborts: no more speculation; the REDS timeout (from the first silence) decides.
        let a = step(&mut m, t, Input::PingFailed(InstanceId(1)));
        assert!(!a.iter().any(|a| matches!(a, Action::Super { .. })), "{a:?}");
        let a = step(&mut m, 11_000, Input::Tick);
        assert!(a.contains(&Action::KillInstance(InstanceId(1))), "{a:?}");
        let a = step(&mut m, 11_100, Input::InstanceStopped(InstanceId(1)));
        assert!(a.contains(&Action::StartInstance { id: InstanceId(4), volume: "db".into() }), "{a:?}");
    }
}
