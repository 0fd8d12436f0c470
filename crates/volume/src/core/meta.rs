//! The metadata service's decisions as a deterministic state machine (no sockets, no clock, no
//! files): volume create / delete / resize / general clone, the orchestration of `super` and
//! `collapse` over the tracking shard (SpecREDS §4.3), and the garbage-collection hand-off after
//! collapse (§4.3, "Deallocation with garbage collection").
//!
//! Inputs are control requests, shard replies, "state saved" notices and clock ticks; outputs are
//! replies, messages to shards and state saves. [`crate::driver::meta`] drives it with real sockets and
//! a real file; the simulation test `sim_super_collapse` drives it over a lossy network, with
//! crashing shards and failing saves.
//!
//! Durability: every change of [`MetaState`] is made durable before anything that depends on it
//! leaves the core (a reply, the next request to a shard). The core emits [`MetaOutput::Save`]
//! and holds those outputs until the driver reports [`MetaInput::Saved`]; one save is in flight
//! at a time (changes made meanwhile go into the next one). If a save fails, the core goes back
//! to the last durable state and fails what depended on the lost changes with a clear error —
//! "bad input or a full disk loses nothing". Reads (`List`, `Info`, `GetMap`, `Jobs`) answer
//! from the durable state.
//!
//! Control operations that change volumes run one at a time, in arrival order; garbage
//! collection and delete jobs run beside them, one job at a time.
//!
//! Crashes: the service may stop at any step and restart from its saved state ([`MetaCore::new`]).
//! A `super` child is recorded *pending* before the tracking shard hears of it and made visible
//! only once the tracking shard confirmed it; a `collapse` is decided on the tracking shard
//! before it is recorded here. So a restart can find a pending child (the tracking shard may or
//! may not know it) or a child whose collapse the tracking shard decided. Before serving other
//! control requests, the restarted core *resumes* every super child: it asks the tracking shard
//! to register it again (idempotent), which answers "tracked" (the super is finished: the child
//! becomes visible), the collapse's outcome (the collapse is recorded and its garbage collection
//! starts), or a refusal (a pending child is undone). No orphan child survives a restart.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::proto::{CollapseRec, Job, Layout, MetaReq, MetaResp, MetaState, VolumeRec, MAX_COLLAPSE_RECORDS};
use crate::core::membership::{mark_all_down_after_restart, Membership, MembershipConfig};
use crate::types::*;

/// The metadata service's two cores as a start makes them, from its saved state (`None`: a new
/// service): what the driver must save before feeding them anything (`save`: the state with
/// every shard marked down, see [`mark_all_down_after_restart`], or a new service's first
/// state), the metadata core over it, and the membership core over its map. The tokio driver
/// and the simulation's restarts both start this way.
pub struct ServiceStart {
    pub save: Option<MetaState>,
    pub core: MetaCore,
    pub members: Membership,
}

/// See [`ServiceStart`]. `replicas`: a new service's replication factor; `now_us`: the driver's
/// clock; `req_base`: see [`MetaCore::new`].
pub fn start_service(loaded: Option<MetaState>, replicas: u32, cfg: MetaCoreConfig, member_cfg: MembershipConfig, now_us: u64, req_base: ReqId) -> ServiceStart {
    let (state, save) = match loaded {
        Some(mut s) => {
            // Nobody is known alive after a restart: every shard registers again.
            let changed = mark_all_down_after_restart(&mut s.map);
            let save = changed.then(|| s.clone());
            (s, save)
        }
        None => {
            let s = MetaState::new(replicas);
            (s.clone(), Some(s))
        }
    };
    let members = Membership::new(member_cfg, state.map.clone(), now_us);
    ServiceStart { save, core: MetaCore::new(cfg, state, req_base), members }
}

/// Who asked: the driver numbers its control requests and routes the reply back.
pub type CallId = u64;

/// Timing of the core's requests to shards, in µs of the driver's clock.
#[derive(Debug, Clone)]
pub struct MetaCoreConfig {
    /// A request to a shard that has had no reply for this long is sent again.
    pub resend_after_us: u64,
    /// After a retryable refusal (stale map, not primary, not ready), wait this long.
    pub retry_after_us: u64,
    /// `super` / `collapse` answer their caller after this long without the tracking shard's
    /// answer (an undecided collapse goes on in the background, see [`MetaCore`]).
    pub tracking_deadline_us: u64,
    /// The longest wait between two background attempts (resumed supers, undecided collapses);
    /// the wait doubles from `20 × retry_after_us` up to this.
    pub max_backoff_us: u64,
}

impl Default for MetaCoreConfig {
    fn default() -> Self {
        MetaCoreConfig { resend_after_us: 5_000_000, retry_after_us: 50_000, tracking_deadline_us: 30_000_000, max_backoff_us: 5_000_000 }
    }
}

#[derive(Debug, Clone)]
pub enum MetaInput {
    /// A control client's request.
    Request { call: CallId, req: MetaReq },
    /// A shard's reply to a request of the core.
    ShardReply { from: ShardId, req: ReqId, result: Result<ReplyBody, IoErr> },
    /// The save `seq` is durable (`Ok`) or failed.
    Saved { seq: u64, result: Result<(), String> },
    /// The resend and retry clock (the monotonic time comes with every input, as
    /// [`MetaCore::handle`]'s `now_us`); `unix_ms`: wall time, for creation stamps.
    Tick { unix_ms: u64 },
    /// The driver changed the cluster map (shard registration, liveness); it is saved like
    /// every change and becomes durable — and so visible in [`MetaCore::durable`] — after.
    SetMap(ClusterMap),
    /// The link to `shard` was (re)established: a request sent over the broken link may be
    /// lost, so what waits for a shard's answer is sent again now rather than at the next
    /// resend period (every request to a shard is idempotent).
    LinkUp { shard: ShardId },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetaOutput {
    Reply { call: CallId, resp: MetaResp },
    Send { to: ShardId, msg: Msg },
    /// Make `state` durable, then report [`MetaInput::Saved`] with `seq`.
    Save { seq: u64, state: Box<MetaState> },
}

/// A request to the tracking shard of a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TrackReq {
    Super { table: TableId, parent: VolId, child: VolId },
    /// Abort's first step: mark the superposition written, as the parent's first write would
    /// (without writing anything), so the collapse that follows must reject.
    Permission { table: TableId, parent: VolId },
    Collapse { table: TableId, child: VolId },
    EndSuper { table: TableId, child: VolId },
}

impl TrackReq {
    fn table(&self) -> TableId {
        match *self {
            TrackReq::Super { table, .. }
            | TrackReq::Permission { table, .. }
            | TrackReq::Collapse { table, .. }
            | TrackReq::EndSuper { table, .. } => table,
        }
    }

    fn msg(&self, req: ReqId, epoch: Epoch) -> Msg {
        match *self {
            TrackReq::Super { table, parent, child } => Msg::Super { req, epoch, table, parent, child },
            TrackReq::Permission { table, parent } => Msg::Permission { req, epoch, table, parent },
            TrackReq::Collapse { table, child } => Msg::Collapse { req, epoch, table, child },
            TrackReq::EndSuper { table, child } => Msg::EndSuper { req, epoch, table, child },
        }
    }
}

/// Why a tracking request ended without an answer: `refused` (the tracking shard said no, for
/// good) or not (no answer before the deadline: it may or may not have acted).
#[derive(Debug, Clone)]
struct TrackErr {
    refused: bool,
    msg: String,
}

/// One request to the tracking shard in flight: resent on silence, retried on retryable errors.
#[derive(Debug, Clone)]
struct TrackAsk {
    what: TrackReq,
    req: ReqId,
    /// When the current attempt was sent (or, while `waiting`, when to send the next).
    at_us: u64,
    waiting: bool,
    deadline_us: u64,
}

/// A request every shard not down must acknowledge at one epoch (GC, delete): a map change
/// starts a new round, so a shard down now learns the outcome from its peers when it
/// re-replicates.
#[derive(Debug, Clone)]
struct AllAsk {
    job: Job,
    epoch: Epoch,
    /// Shards still to acknowledge at `epoch`, with their current request id and send time.
    pending: BTreeMap<ShardId, (ReqId, u64)>,
    /// A shard refused: start a new round at `retry_at_us`.
    retry_at_us: Option<u64>,
}

#[derive(Debug)]
enum Control {
    /// Waiting for the save of the child's record, then asks the tracking shard.
    SuperRecording { call: CallId, rec: VolumeRec, parent: String, track: TrackReq },
    SuperAsking { call: CallId, rec: VolumeRec, parent: String, ask: TrackAsk },
    /// An abort marking the superposition written; then it collapses (`abort` set).
    AbortMarking { call: CallId, child: String, parent: String, collapse: TrackReq, ask: TrackAsk },
    /// `abort`: the request was an abort, which answers the parent's record (or an error if
    /// the collapse had already promoted the child).
    CollapseAsking { call: CallId, child: String, parent: String, ask: TrackAsk, abort: bool },
    /// A restart (or a failed save) left this super child unconfirmed, or its collapse is
    /// undecided: asks the tracking shard to register it again (and finishes or undoes what was
    /// half done), or to collapse it again. `attempt` counts the background attempts (backoff).
    Resuming { child: String, parent: String, ask: TrackAsk, attempt: u32 },
    /// Waiting for a save; the reply is released with it.
    Saving,
}

#[derive(Debug)]
enum JobRun {
    All(AllAsk),
    /// GC: every shard collected; the tracking shard forgets the super.
    EndSuper { job: Job, ask: TrackAsk },
    /// Waiting for the save that ends the job.
    Saving,
    /// Retry the job from its start at this time.
    Backoff(u64),
}

/// What runs once a save is durable, or instead of it if the save fails.
#[derive(Debug, Default)]
struct Batch {
    changed: bool,
    outputs: Vec<MetaOutput>,
    then: Vec<Then>,
}

#[derive(Debug)]
enum Then {
    /// Send the tracking request of a `SuperRecording` control.
    AskSuper,
    EndControl,
    EndJob,
}

pub struct MetaCore {
    cfg: MetaCoreConfig,
    now_us: u64,
    unix_ms: u64,
    state: MetaState,
    durable: MetaState,
    save_seq: u64,
    /// The save in flight and what waits for it.
    saving: Option<(u64, MetaState, Batch)>,
    /// Changes and outputs made since: the next save.
    next: Batch,
    control: Option<Control>,
    queue: VecDeque<(CallId, MetaReq)>,
    /// Super children to resume before other control requests, each not before its time, with
    /// the number of attempts made so far.
    resume: VecDeque<(String, u64, u32)>,
    job: Option<JobRun>,
    next_req: ReqId,
    out: Vec<MetaOutput>,
    /// The durable map's epoch as of the last invariant check (it never goes back).
    checked_epoch: Epoch,
}

impl MetaCore {
    /// A core over `state`, which must be durable (loaded or just saved). `req_base`: the first
    /// request id, different for every run so a late reply to an earlier run is never taken for
    /// one of this run.
    pub fn new(cfg: MetaCoreConfig, state: MetaState, req_base: ReqId) -> Self {
        // Every super child of the saved state: its super may be half done (pending) or its
        // collapse decided on the tracking shard but not recorded here.
        let resume = state.volumes.values().filter(|v| v.super_parent.is_some()).map(|v| (v.name.clone(), 0, 0)).collect();
        let mut core = MetaCore {
            cfg,
            now_us: 0,
            unix_ms: 0,
            durable: state.clone(),
            state,
            save_seq: 0,
            saving: None,
            next: Batch::default(),
            control: None,
            queue: VecDeque::new(),
            resume: VecDeque::new(),
            job: None,
            next_req: req_base,
            out: vec![],
            checked_epoch: 0,
        };
        core.resume = resume;
        core.checked_epoch = core.durable.map.epoch;
        #[cfg(debug_assertions)]
        core.check_invariants();
        core
    }

    /// The durable state: what replies and the cluster map as pushed to shards rest on.
    pub fn durable(&self) -> &MetaState {
        &self.durable
    }

    /// Whether nothing is in progress (no control operation, job, save or queued request).
    pub fn is_idle(&self) -> bool {
        self.control.is_none()
            && self.job.is_none()
            && self.saving.is_none()
            && !self.next.changed
            && self.queue.is_empty()
            && self.resume.is_empty()
            && self.state.jobs.is_empty()
    }

    /// The outputs of the inputs handled since the last call, in order.
    pub fn take_outputs(&mut self) -> Vec<MetaOutput> {
        std::mem::take(&mut self.out)
    }

    /// Feeds one input at `now_us` (the driver's monotonic clock, µs; read at
    /// [`MetaInput::Tick`]s, an earlier time than one seen before counts as that one); its
    /// outputs wait in [`Self::take_outputs`].
    pub fn handle(&mut self, now_us: u64, input: MetaInput) {
        if let MetaInput::Tick { .. } = input {
            // The clock advances at ticks only (deadlines and resends count from the last
            // tick), as before every input carried the time.
            self.now_us = self.now_us.max(now_us);
        }
        match input {
            MetaInput::Request { call, req } => self.on_request(call, req),
            MetaInput::ShardReply { from, req, result } => self.on_reply(from, req, result),
            MetaInput::Saved { seq, result } => self.on_saved(seq, result),
            MetaInput::Tick { unix_ms } => {
                self.unix_ms = unix_ms;
                self.on_tick();
            }
            MetaInput::SetMap(map) => {
                if map != self.state.map {
                    self.state.map = map;
                    self.next.changed = true;
                    if let Some(JobRun::All(a)) = &mut self.job {
                        // A new epoch: the round restarts at it.
                        a.pending.clear();
                        a.retry_at_us = Some(self.now_us);
                    }
                }
            }
            MetaInput::LinkUp { shard } => {
                tracing::debug!(shard, "shard link up: resending what waits for an answer");
                self.resend_now();
                self.on_tick();
            }
        }
        if self.control.is_none() {
            self.end_control();
        }
        self.maybe_start_job();
        self.flush();
        #[cfg(debug_assertions)]
        self.check_invariants();
        self.checked_epoch = self.durable.map.epoch;
    }

    /// Panics, naming the invariant and the state, if the core breaks a rule of the module doc:
    /// in the current and in the durable state, one superposition per volume (a parent and its
    /// one super child name each other, in one table), the tracking/GC hand-off (a collapse's
    /// loser is gone from the records while its GC job is listed, a promoted child reads
    /// through its parent only until that job ends, no super child in a table being collected);
    /// one map per epoch (the durable epoch never goes back, the current map is the durable one
    /// or newer); durability (a change waits only for the save in flight, a super child is
    /// answered only once confirmed); requests queue only behind a running control operation.
    /// O(volumes + jobs): run after every input in debug builds and every simulation step.
    pub fn check_invariants(&self) {
        let broken = |what: &str, state: String| -> ! { panic!("metadata core: invariant `{what}` broken: {state}") };
        for (which, st) in [("state", &self.state), ("durable", &self.durable)] {
            if let Err((what, detail)) = check_state(st) {
                broken(what, format!("{which}: {detail}; {st:?}"));
            }
        }
        // One map per epoch.
        let (cur, dur) = (&self.state.map, &self.durable.map);
        if dur.epoch < self.checked_epoch {
            broken("the durable map's epoch never goes back", format!("{} -> {}", self.checked_epoch, dur.epoch));
        }
        if cur.epoch < dur.epoch || (cur.epoch == dur.epoch && cur != dur) {
            broken("one map per epoch", format!("current {cur:?}, durable {dur:?}"));
        }
        // Durability: changes are held for one save at a time; outputs of an unchanged batch
        // leave at once.
        if self.next.changed && self.saving.is_none() {
            broken("a change waits only for the save in flight", "changes pending, no save in flight".into());
        }
        if !self.next.changed && (!self.next.outputs.is_empty() || !self.next.then.is_empty()) {
            broken("outputs are held only for a save", format!("{:?} held with nothing to save", self.next.outputs));
        }
        if let Some((seq, _, _)) = &self.saving {
            if *seq != self.save_seq {
                broken("the save in flight is the latest", format!("saving {seq}, last issued {}", self.save_seq));
            }
        }
        for o in &self.out {
            if let MetaOutput::Reply { resp: MetaResp::Volume(v), .. } = o {
                if v.super_pending {
                    broken("a super child is answered only once the tracking shard confirmed it", format!("{v:?}"));
                }
            }
        }
        if !self.queue.is_empty() && self.control.is_none() {
            broken("requests queue only behind a running control operation", format!("{} queued", self.queue.len()));
        }
        if let Some(JobRun::All(AllAsk { job, .. }) | JobRun::EndSuper { job, .. }) = &self.job {
            if !self.state.jobs.contains(job) {
                broken("a running job is listed", format!("{job:?} runs, listed: {:?}", self.state.jobs));
            }
        }
    }

    /// [`Self::check_invariants`] and the check that every change of the state is saved: with
    /// no save in flight and none pending, the state is the durable one. O(state) (a compare of
    /// the whole state): the simulation and the unit tests call it after every input.
    pub fn check_invariants_deep(&self) {
        self.check_invariants();
        if self.saving.is_none() && !self.next.changed && self.state != self.durable {
            panic!("metadata core: invariant `every change of the state is saved` broken: state {:?}, durable {:?}", self.state, self.durable);
        }
    }

    // ---- saving -------------------------------------------------------------------------------

    fn fresh_req(&mut self) -> ReqId {
        self.next_req += 1;
        self.next_req
    }

    /// Emits what is ready: outputs of an unchanged batch at once, a changed batch as a save
    /// (when none is in flight).
    fn flush(&mut self) {
        if !self.next.changed {
            let b = std::mem::take(&mut self.next);
            self.release(b);
            return;
        }
        if self.saving.is_some() {
            return;
        }
        let b = std::mem::take(&mut self.next);
        self.save_seq += 1;
        let seq = self.save_seq;
        self.out.push(MetaOutput::Save { seq, state: Box::new(self.state.clone()) });
        self.saving = Some((seq, self.state.clone(), b));
    }

    fn release(&mut self, b: Batch) {
        self.out.extend(b.outputs);
        for t in b.then {
            self.then(t);
        }
    }

    fn on_saved(&mut self, seq: u64, result: Result<(), String>) {
        let Some((s, _, _)) = &self.saving else { return };
        if *s != seq {
            return;
        }
        let (_, snapshot, batch) = self.saving.take().unwrap();
        match result {
            Ok(()) => {
                self.durable = snapshot;
                self.release(batch);
            }
            Err(e) => {
                tracing::error!("cannot save the metadata: {e}");
                // Back to the durable state: every change since is lost, and whatever depended
                // on one fails (replies say why; jobs start again from the durable list).
                let later = std::mem::take(&mut self.next);
                self.state = self.durable.clone();
                for b in [batch, later] {
                    self.fail(b, &e);
                }
            }
        }
    }

    fn fail(&mut self, b: Batch, e: &str) {
        for o in b.outputs {
            if let MetaOutput::Reply { call, .. } = o {
                self.out.push(MetaOutput::Reply { call, resp: MetaResp::Err(format!("cannot save the metadata: {e}")) });
            }
        }
        for t in b.then {
            match t {
                Then::AskSuper => {
                    if let Some(Control::SuperRecording { call, .. }) = self.control.take() {
                        self.out.push(MetaOutput::Reply { call, resp: MetaResp::Err(format!("super failed: cannot save the metadata: {e}")) });
                    }
                    self.end_control()
                }
                Then::EndControl => self.end_control(),
                Then::EndJob => self.job = Some(JobRun::Backoff(self.now_us + self.cfg.retry_after_us * 10)),
            }
        }
    }

    fn then(&mut self, t: Then) {
        match t {
            Then::EndControl => self.end_control(),
            Then::EndJob => self.job = None,
            Then::AskSuper => {
                if let Some(Control::SuperRecording { call, rec, parent, track }) = self.control.take() {
                    let ask = self.track_ask(track);
                    self.control = Some(Control::SuperAsking { call, rec, parent, ask });
                }
            }
        }
    }

    /// Replies once the changes made so far are durable.
    fn reply_after_save(&mut self, call: CallId, resp: MetaResp) {
        self.next.outputs.push(MetaOutput::Reply { call, resp });
    }

    fn reply_now(&mut self, call: CallId, resp: MetaResp) {
        self.out.push(MetaOutput::Reply { call, resp });
    }

    /// Ends the control operation and starts the next: a super child to resume (when due),
    /// else the next queued request.
    fn end_control(&mut self) {
        self.control = None;
        // No control runs now, so no super is in flight: a pending child left by a failed save
        // is resumed like one found at a restart.
        let pending: Vec<String> = self.state.volumes.values().filter(|v| v.super_pending).map(|v| v.name.clone()).collect();
        for name in pending {
            if !self.resume.iter().any(|(n, _, _)| *n == name) {
                self.resume.push_back((name, self.now_us + self.cfg.retry_after_us, 0));
            }
        }
        while self.control.is_none() {
            if let Some(i) = self.resume.iter().position(|(_, at, _)| *at <= self.now_us) {
                let (child, _, attempt) = self.resume.remove(i).unwrap();
                self.start_resume(child, attempt);
                continue;
            }
            let Some((call, req)) = self.queue.pop_front() else { break };
            self.start_control(call, req);
        }
    }

    /// Asks the tracking shard to register `child` again (see the module documentation), or,
    /// if its collapse is undecided, to collapse it (again: idempotent).
    fn start_resume(&mut self, child: String, attempt: u32) {
        let Some(c) = self.state.volumes.get(&child).cloned() else { return };
        let (Some(parent), Some(parent_id)) = (c.super_parent.clone(), c.vol.parent) else { return };
        tracing::info!(child, pending = c.super_pending, collapsing = c.collapsing, attempt, "resuming a super child");
        let track = if c.collapsing {
            TrackReq::Collapse { table: c.vol.table, child: c.vol.id }
        } else {
            TrackReq::Super { table: c.vol.table, parent: parent_id, child: c.vol.id }
        };
        let ask = self.track_ask(track);
        self.control = Some(Control::Resuming { child, parent, ask, attempt });
    }

    /// The wait before background attempt `attempt` (0 = the first retry).
    fn backoff_us(&self, attempt: u32) -> u64 {
        (self.cfg.retry_after_us * 20).saturating_mul(1 << attempt.min(20)).min(self.cfg.max_backoff_us)
    }

    /// Makes every request that waits for a shard's answer due now (see [`MetaInput::LinkUp`]).
    fn resend_now(&mut self) {
        let now = self.now_us;
        let due = |a: &mut TrackAsk| {
            a.waiting = true;
            a.at_us = now;
        };
        if let Some(ask) = self.control_ask() {
            due(ask);
        }
        match &mut self.job {
            Some(JobRun::EndSuper { ask, .. }) => due(ask),
            Some(JobRun::All(a)) if !a.pending.is_empty() => a.retry_at_us = Some(now),
            _ => {}
        }
    }

    // ---- requests -----------------------------------------------------------------------------

    fn on_request(&mut self, call: CallId, req: MetaReq) {
        let d = &self.durable;
        match req {
            MetaReq::GetMap => self.reply_now(call, MetaResp::Map(d.map.clone())),
            MetaReq::List => self.reply_now(call, MetaResp::Volumes(d.volumes.values().cloned().collect())),
            MetaReq::Info { name } => {
                let r = match d.volumes.get(&name) {
                    Some(v) if v.super_pending => MetaResp::Err(super_pending(&name)),
                    Some(v) => MetaResp::Volume(v.clone()),
                    None => MetaResp::Err(no_volume(&name)),
                };
                self.reply_now(call, r)
            }
            MetaReq::Jobs => self.reply_now(call, MetaResp::Jobs(d.jobs.clone())),
            req => {
                if self.control.is_some() {
                    self.queue.push_back((call, req));
                } else {
                    self.start_control(call, req);
                }
            }
        }
    }

    fn start_control(&mut self, call: CallId, req: MetaReq) {
        match self.decide(req) {
            Ok(Step::Reply(resp)) => {
                self.control = Some(Control::Saving);
                self.next.changed = true;
                self.reply_after_save(call, resp);
                self.next.then.push(Then::EndControl);
            }
            Ok(Step::Super { rec, parent, track }) => {
                self.control = Some(Control::SuperRecording { call, rec, parent, track });
                self.next.changed = true;
                self.next.then.push(Then::AskSuper);
            }
            Ok(Step::SuperAgain { rec, parent, track }) => {
                let ask = self.track_ask(track);
                self.control = Some(Control::SuperAsking { call, rec, parent, ask });
            }
            Ok(Step::Collapse { child, parent, track }) => {
                let ask = self.track_ask(track);
                self.control = Some(Control::CollapseAsking { call, child, parent, ask, abort: false });
            }
            Ok(Step::Abort { child, parent, mark, collapse }) => {
                let ask = self.track_ask(mark);
                self.control = Some(Control::AbortMarking { call, child, parent, collapse, ask });
            }
            Err(e) => self.reply_now(call, MetaResp::Err(e)),
        }
    }

    /// Validates a control request against the current state and makes its first change.
    fn decide(&mut self, req: MetaReq) -> Result<Step, String> {
        let s = &mut self.state;
        let now_ms = self.unix_ms;
        match req {
            MetaReq::Create { name, size_bytes, object_size_bytes } => {
                validate_name(&name)?;
                ensure(
                    object_size_bytes.is_power_of_two() && (4096..=MAX_OBJECT_SIZE_BYTES).contains(&object_size_bytes),
                    format!("object size must be a power of two between 4 KiB and 4 MiB, not {object_size_bytes}"),
                )?;
                ensure(size_bytes > 0 && size_bytes % 512 == 0, "size must be a positive multiple of 512 bytes".into())?;
                ensure(!s.volumes.contains_key(&name), format!("a volume named {name:?} already exists"))?;
                let id = s.next_id;
                s.next_id += 1;
                let rec = VolumeRec::new(name.clone(), VolRef { id, table: id, object_size_bytes, parent: None }, size_bytes, Layout::Plain, now_ms);
                s.volumes.insert(name, rec.clone());
                Ok(Step::Reply(MetaResp::Volume(rec)))
            }
            MetaReq::Resize { name, size_bytes } => {
                ensure(size_bytes > 0 && size_bytes % 512 == 0, "size must be a positive multiple of 512 bytes".into())?;
                let rec = s.volumes.get_mut(&name).ok_or_else(|| format!("no volume named {name:?}"))?;
                ensure(size_bytes >= rec.size_bytes, "shrinking a volume is not supported (it would discard data)".into())?;
                rec.size_bytes = size_bytes;
                Ok(Step::Reply(MetaResp::Volume(rec.clone())))
            }
            MetaReq::Delete { name } => {
                let rec = s.volumes.get(&name).cloned().ok_or_else(|| no_volume(&name))?;
                ensure(rec.super_child.is_none(), format!("volume {name:?} has a super child; collapse it first"))?;
                ensure(rec.super_parent.is_none(), format!("volume {name:?} is a super child; collapse it instead"))?;
                ensure(
                    !s.volumes.values().any(|v| matches!(&v.layout, Layout::GeneralClone { parent } if parent.id == rec.vol.id)),
                    format!("volume {name:?} has general clones; delete them first"),
                )?;
                ensure(rec.vol.parent.is_none(), format!("volume {name:?} is still being garbage-collected; retry shortly"))?;
                s.volumes.remove(&name);
                let shares_table = s.volumes.values().any(|v| v.vol.table == rec.vol.table);
                s.jobs.push(Job::Delete { table: rec.vol.table, owner: rec.vol.id, drop_table: !shares_table });
                Ok(Step::Reply(MetaResp::Done))
            }
            MetaReq::Super { parent, child } => {
                validate_name(&child)?;
                let p = s.volumes.get(&parent).cloned().ok_or_else(|| no_volume(&parent))?;
                if let Some(c) = s.volumes.get(&child).filter(|c| c.super_parent.as_ref() == Some(&parent)) {
                    // A retried super (its reply was lost, or the service restarted): ask the
                    // tracking shard again, which is idempotent, and answer the same child.
                    let track = TrackReq::Super { table: c.vol.table, parent: p.vol.id, child: c.vol.id };
                    return Ok(Step::SuperAgain { rec: c.clone(), parent, track });
                }
                ensure(!s.volumes.contains_key(&child), format!("a volume named {child:?} already exists"))?;
                ensure(p.super_child.is_none(), format!("volume {parent:?} already has a super child; collapse it first"))?;
                ensure(p.super_parent.is_none(), format!("volume {parent:?} is itself a super child; collapse it first"))?;
                ensure(p.vol.parent.is_none(), format!("volume {parent:?} is still being garbage-collected; retry shortly"))?;
                // The tracking shard refuses a new super until the last one's garbage collection
                // ended it: refuse here, without recording and undoing a child.
                ensure(
                    !s.jobs.iter().any(|j| matches!(j, Job::Gc { table, .. } if *table == p.vol.table)),
                    format!("the last super child of {parent:?} is still being garbage-collected; retry shortly"),
                )?;
                ensure(p.layout == Layout::Plain, "super needs a plain volume".into())?;
                // A promoting collapse retires the parent and hands its objects to the child,
                // which would leave a general clone reading through to a retired volume.
                ensure(
                    !s.volumes.values().any(|v| matches!(&v.layout, Layout::GeneralClone { parent: gp } if gp.id == p.vol.id)),
                    format!("volume {parent:?} has general clones, which a promoting collapse would break; delete them first"),
                )?;
                // Record the child first, pending: if we crash before the tracking shard knows
                // it, the restarted core finishes or undoes the super (see `start_resume`).
                let child_id = s.next_id;
                s.next_id += 1;
                let vol = VolRef { id: child_id, table: p.vol.table, object_size_bytes: p.vol.object_size_bytes, parent: Some(p.vol.id) };
                let mut rec = VolumeRec::new(child.clone(), vol, p.size_bytes, Layout::Plain, now_ms);
                rec.super_parent = Some(parent.clone());
                rec.super_pending = true;
                s.volumes.insert(child.clone(), rec.clone());
                s.volumes.get_mut(&parent).expect("checked above").super_child = Some(child);
                let track = TrackReq::Super { table: p.vol.table, parent: p.vol.id, child: child_id };
                Ok(Step::Super { rec, parent, track })
            }
            MetaReq::Collapse { child } => {
                if let Some(resp) = decided_collapse(s, &child) {
                    // Asked again (the caller lost its connection, or its call ended before the
                    // tracking shard answered): the decided outcome.
                    return Ok(Step::Reply(resp));
                }
                let c = s.volumes.get(&child).cloned().ok_or_else(|| no_volume(&child))?;
                let Some(parent) = c.super_parent.clone() else {
                    return Err(format!("volume {child:?} is not a super child: nothing to collapse"));
                };
                ensure(!c.super_pending, super_pending(&child))?;
                ensure(c.vol.parent.is_some(), format!("super child {child:?} names no parent volume"))?;
                let track = TrackReq::Collapse { table: c.vol.table, child: c.vol.id };
                Ok(Step::Collapse { child, parent, track })
            }
            MetaReq::Abort { child } => {
                if let Some(MetaResp::Collapsed { outcome: CollapseOutcome::Rejected, .. }) = decided_collapse(s, &child) {
                    return Err(format!("no volume named {child:?}: an earlier collapse or abort rejected it"));
                }
                let c = s.volumes.get(&child).cloned().ok_or_else(|| no_volume(&child))?;
                let Some(parent) = c.super_parent.clone() else {
                    // A promoted child lives on in its parent's table (a created volume has its own).
                    if c.vol.parent.is_some() || c.vol.table != c.vol.id {
                        return Err(format!("volume {child:?} was promoted by a collapse; a promoted child cannot be aborted"));
                    }
                    return Err(format!("volume {child:?} is not a super child: nothing to abort"));
                };
                ensure(!c.super_pending, super_pending(&child))?;
                let parent_id = c.vol.parent.ok_or_else(|| format!("super child {child:?} names no parent volume"))?;
                let mark = TrackReq::Permission { table: c.vol.table, parent: parent_id };
                let collapse = TrackReq::Collapse { table: c.vol.table, child: c.vol.id };
                Ok(Step::Abort { child, parent, mark, collapse })
            }
            MetaReq::CloneGeneral { parent, child } => {
                validate_name(&child)?;
                let p = s.volumes.get(&parent).cloned().ok_or_else(|| no_volume(&parent))?;
                ensure(!s.volumes.contains_key(&child), format!("a volume named {child:?} already exists"))?;
                ensure(p.layout == Layout::Plain && p.vol.parent.is_none(), "general clones need a plain parent".into())?;
                ensure(p.super_child.is_none(), format!("volume {parent:?} has a super child; collapse it first"))?;
                let id = s.next_id;
                s.next_id += 1;
                let vol = VolRef { id, table: id, object_size_bytes: p.vol.object_size_bytes, parent: None };
                let rec = VolumeRec::new(child.clone(), vol, p.size_bytes, Layout::GeneralClone { parent: p.vol.clone() }, now_ms);
                s.volumes.insert(child, rec.clone());
                Ok(Step::Reply(MetaResp::Volume(rec)))
            }
            MetaReq::GetMap | MetaReq::List | MetaReq::Info { .. } | MetaReq::Jobs => unreachable!("reads are answered at once"),
        }
    }

    // ---- the tracking shard -------------------------------------------------------------------

    fn track_ask(&mut self, what: TrackReq) -> TrackAsk {
        let mut ask = TrackAsk { what, req: 0, at_us: self.now_us, waiting: false, deadline_us: self.now_us + self.cfg.tracking_deadline_us };
        self.send_track(&mut ask);
        ask
    }

    /// Sends (again) to the table's tracking primary, under a new request id; with no primary
    /// up, waits a retry period.
    fn send_track(&mut self, ask: &mut TrackAsk) {
        ask.req = self.fresh_req();
        ask.at_us = self.now_us;
        let map = &self.durable.map;
        match map.primary(Slot { table: ask.what.table(), objno: TRACK_OBJNO }) {
            Some(p) => {
                ask.waiting = false;
                let msg = ask.what.msg(ask.req, map.epoch);
                self.out.push(MetaOutput::Send { to: p, msg });
            }
            None => ask.waiting = true,
        }
    }

    /// What to do with a reply (or silence) of the tracking shard: `Some(result)` ends the ask.
    fn track_result(&mut self, ask: &mut TrackAsk, result: Result<ReplyBody, IoErr>) -> Option<Result<ReplyBody, TrackErr>> {
        match result {
            Ok(body) => Some(Ok(body)),
            Err(e) if e.is_retryable() && self.now_us < ask.deadline_us => {
                ask.waiting = true;
                ask.at_us = self.now_us + self.cfg.retry_after_us;
                ask.req = 0;
                None
            }
            Err(e) => Some(Err(TrackErr { refused: !e.is_retryable(), msg: format!("tracking shard: {e}") })),
        }
    }

    fn on_track_done(&mut self, result: Result<ReplyBody, TrackErr>) {
        match self.control.take() {
            Some(Control::SuperAsking { call, rec, parent, .. }) => {
                let resp = match self.settle_super(&rec.name, &parent, result) {
                    Ok(rec) => MetaResp::Volume(rec),
                    Err(e) => MetaResp::Err(e),
                };
                self.control = Some(Control::Saving);
                self.reply_after_save(call, resp);
                self.next.then.push(Then::EndControl);
            }
            Some(Control::Resuming { child, parent, ask, attempt }) => {
                if let Err(TrackErr { refused: false, msg }) = &result {
                    // The tracking shard cannot be reached yet: try again later, backing off
                    // (other control requests run meanwhile; the child stays pending,
                    // superposed or collapsing).
                    tracing::warn!(child, attempt, "cannot resume the super child yet: {msg}");
                    let at = self.now_us + self.backoff_us(attempt);
                    self.resume.push_back((child, at, attempt + 1));
                    return self.end_control();
                }
                if let TrackReq::Collapse { table, child: child_id } = ask.what {
                    match result {
                        Ok(ReplyBody::Collapse(outcome)) => {
                            tracing::info!(child, ?outcome, "undecided collapse decided");
                            self.record_collapse(&child, &parent, table, child_id, outcome);
                        }
                        other => {
                            // The tracking shard will never collapse it: stop asking (a caller
                            // may collapse it again and gets the answer).
                            tracing::warn!(child, "collapse in the background refused: {other:?}");
                            if let Some(rec) = self.state.volumes.get_mut(&child) {
                                rec.collapsing = false;
                            }
                            self.next.changed = true;
                        }
                    }
                } else if let Err(e) = self.settle_super(&child, &parent, result) {
                    tracing::info!(child, "resumed super child: {e}");
                }
                self.control = Some(Control::Saving);
                self.next.then.push(Then::EndControl);
            }
            Some(Control::AbortMarking { call, child, parent, collapse, .. }) => match result {
                Ok(ReplyBody::Granted(_)) => {
                    let ask = self.track_ask(collapse);
                    self.control = Some(Control::CollapseAsking { call, child, parent, ask, abort: true });
                }
                other => self.control_failed(call, other),
            },
            Some(Control::CollapseAsking { call, child, parent, ask, abort, .. }) => match result {
                Ok(ReplyBody::Collapse(outcome)) => {
                    let TrackReq::Collapse { table, child: child_id } = ask.what else { unreachable!() };
                    let (volume, parent_rec) = self.record_collapse(&child, &parent, table, child_id, outcome);
                    let promoted = outcome == CollapseOutcome::Promoted;
                    let resp = match (abort, parent_rec) {
                        (false, _) => MetaResp::Collapsed { outcome, volume },
                        (true, Some(p)) => MetaResp::Volume(p),
                        // An earlier collapse promoted the child (this service crashed before
                        // recording it): the record is completed, and the abort says so.
                        (true, None) if promoted => MetaResp::Err(format!(
                            "volume {child:?} was promoted by an earlier collapse; a promoted child cannot be aborted"
                        )),
                        (true, None) => MetaResp::Err(format!("the parent {parent:?} of {child:?} is gone")),
                    };
                    self.control = Some(Control::Saving);
                    self.reply_after_save(call, resp);
                    self.next.then.push(Then::EndControl);
                }
                Err(TrackErr { refused: false, msg }) => {
                    // No answer in time: the tracking shard may or may not have decided. The
                    // service owns the decision from here: it keeps asking in the background
                    // (durably, so also after a restart) and records the outcome, which a repeated
                    // `collapse` returns.
                    tracing::warn!(child, "collapse not decided yet ({msg}); asking again in the background");
                    if let Some(rec) = self.state.volumes.get_mut(&child) {
                        rec.collapsing = true;
                    }
                    self.next.changed = true;
                    let at = self.now_us + self.backoff_us(0);
                    self.resume.retain(|(n, _, _)| *n != child);
                    self.resume.push_back((child.clone(), at, 1));
                    let e = format!(
                        "collapse of {child:?} is not decided yet ({msg}); the metadata service keeps asking the tracking shard — retry the collapse to learn the outcome"
                    );
                    self.control = Some(Control::Saving);
                    self.reply_after_save(call, MetaResp::Err(e));
                    self.next.then.push(Then::EndControl);
                }
                other => self.control_failed(call, other),
            },
            other => self.control = other,
        }
    }

    /// Applies the tracking shard's answer to a registration (first, retried or resumed) of the
    /// super child `child` of `parent`: "tracked" confirms it (it stops being pending and is
    /// answered); a collapse's outcome means the collapse was decided but never recorded here
    /// (it is recorded now and its GC starts); a definite refusal undoes a pending child (nothing
    /// tracks it) and leaves a confirmed one as it is; no answer leaves it pending, to be resumed.
    /// Marks the state changed: the caller saves before anything depends on it.
    fn settle_super(&mut self, child: &str, parent: &str, result: Result<ReplyBody, TrackErr>) -> Result<VolumeRec, String> {
        self.next.changed = true;
        let Some(c) = self.state.volumes.get(child).cloned() else { return Err(no_volume(child)) };
        match result {
            Ok(ReplyBody::Collapse(outcome)) => {
                self.record_collapse(child, parent, c.vol.table, c.vol.id, outcome);
                Err(format!("{child:?} was already collapsed ({outcome:?}) by an earlier request"))
            }
            Ok(_) => {
                let rec = self.state.volumes.get_mut(child).expect("looked up above");
                rec.super_pending = false;
                Ok(rec.clone())
            }
            Err(TrackErr { refused: true, msg }) if c.super_pending => {
                self.state.volumes.remove(child);
                if let Some(p) = self.state.volumes.get_mut(parent) {
                    p.super_child = None;
                }
                Err(format!("super failed: {msg}"))
            }
            Err(TrackErr { refused: true, msg }) => Err(format!("super of {child:?} was confirmed earlier; now: {msg}")),
            Err(TrackErr { refused: false, msg }) => Err(format!(
                "super did not complete ({msg}); {child:?} stays pending until the tracking shard answers (retry the super, or wait)"
            )),
        }
    }

    /// Records a collapse the tracking shard decided: the loser's records go, the GC job is
    /// listed. Returns the promoted child's record, or the kept parent's.
    fn record_collapse(&mut self, child: &str, parent: &str, table: TableId, child_id: VolId, outcome: CollapseOutcome) -> (Option<VolumeRec>, Option<VolumeRec>) {
        let promoted = outcome == CollapseOutcome::Promoted;
        let s = &mut self.state;
        let Some(parent_id) = s.volumes.get(child).and_then(|c| c.vol.parent) else { return (None, None) };
        s.jobs.push(Job::Gc { table, parent: parent_id, child: child_id, promoted, child_name: Some(child.to_string()) });
        s.collapsed.retain(|r| r.child != child);
        s.collapsed.push(CollapseRec { child: child.to_string(), child_id, outcome });
        let excess = s.collapsed.len().saturating_sub(MAX_COLLAPSE_RECORDS);
        s.collapsed.drain(..excess);
        self.next.changed = true;
        if promoted {
            // The parent is gone for good; the child is the volume now.
            s.volumes.remove(parent);
            let volume = s.volumes.get_mut(child).map(|rec| {
                rec.super_parent = None;
                rec.super_pending = false;
                rec.collapsing = false;
                rec.clone()
            });
            (volume, None)
        } else {
            s.volumes.remove(child);
            let parent_rec = s.volumes.get_mut(parent).map(|p| {
                p.super_child = None;
                p.clone()
            });
            (None, parent_rec)
        }
    }

    /// Ends a control operation whose tracking request failed or got an unexpected answer.
    fn control_failed(&mut self, call: CallId, result: Result<ReplyBody, TrackErr>) {
        let e = match result {
            Ok(body) => format!("tracking shard answered {body:?}"),
            Err(TrackErr { refused: false, msg }) => format!("{msg}: no answer from the tracking shard in time; retry"),
            Err(e) => e.msg,
        };
        self.reply_now(call, MetaResp::Err(e));
        self.end_control();
    }

    // ---- jobs ---------------------------------------------------------------------------------

    fn maybe_start_job(&mut self) {
        match &self.job {
            None => {}
            Some(JobRun::Backoff(at)) if *at <= self.now_us => self.job = None,
            Some(_) => return,
        }
        if self.job.is_some() {
            return;
        }
        let Some(job) = self.durable.jobs.first().cloned() else { return };
        // Only a job that is still listed in the current state (a failed save may have
        // dropped it, a finished one is gone).
        if !self.state.jobs.contains(&job) {
            return;
        }
        let mut a = AllAsk { job, epoch: 0, pending: BTreeMap::new(), retry_at_us: None };
        self.all_round(&mut a);
        self.job = Some(JobRun::All(a));
    }

    fn all_msg(job: &Job, req: ReqId, epoch: Epoch) -> Msg {
        match *job {
            Job::Gc { table, parent, child, promoted, .. } => Msg::Gc { req, epoch, table, parent, child, promoted },
            Job::Delete { table, owner, drop_table } => Msg::DeleteVolume { req, epoch, table, owner, drop_table },
        }
    }

    /// Starts a round at the durable map's epoch: every shard not down is asked.
    fn all_round(&mut self, a: &mut AllAsk) {
        a.epoch = self.durable.map.epoch;
        a.retry_at_us = None;
        a.pending.clear();
        let live: Vec<ShardId> = self.durable.map.shards.iter().filter(|s| s.state != ShardState::Down).map(|s| s.id).collect();
        for s in live {
            let req = self.fresh_req();
            a.pending.insert(s, (req, self.now_us));
            self.out.push(MetaOutput::Send { to: s, msg: Self::all_msg(&a.job, req, a.epoch) });
        }
    }

    fn on_all_reply(&mut self, from: ShardId, req: ReqId, result: Result<ReplyBody, IoErr>) {
        let Some(JobRun::All(a)) = &mut self.job else { return };
        if a.pending.get(&from).map(|p| p.0) != Some(req) {
            return;
        }
        match result {
            Ok(_) => {
                a.pending.remove(&from);
            }
            Err(e) => {
                tracing::debug!("shard {from}: {e}");
                a.pending.clear();
                a.retry_at_us = Some(self.now_us + self.cfg.retry_after_us * 2);
                return;
            }
        }
        if a.pending.is_empty() && a.retry_at_us.is_none() {
            if a.epoch != self.durable.map.epoch {
                let mut a = match self.job.take() {
                    Some(JobRun::All(a)) => a,
                    _ => unreachable!(),
                };
                self.all_round(&mut a);
                self.job = Some(JobRun::All(a));
                return;
            }
            if !every_slot_has_a_primary(&self.durable.map) {
                // Only the primaries (up shards) collect, each its slots on its replicas; a
                // slot with no up shard is collected by nobody, and its shards recover from
                // peers that kept its objects too. So a round counts only at an epoch where
                // every slot has a primary; until then it is asked again. (After a restart of
                // the service every shard is down, then recovering: a round with the first one
                // alone ended GC with nothing collected — sim seeds 163, 176, 251.)
                a.retry_at_us = Some(self.now_us + self.cfg.retry_after_us * 2);
                return;
            }
            let Some(JobRun::All(a)) = self.job.take() else { unreachable!() };
            match a.job {
                Job::Gc { table, child, .. } => {
                    let ask = self.track_ask(TrackReq::EndSuper { table, child });
                    self.job = Some(JobRun::EndSuper { job: a.job, ask });
                }
                Job::Delete { .. } => self.finish_job(&a.job),
            }
        }
    }

    fn finish_job(&mut self, job: &Job) {
        if let Job::Gc { child, child_name: Some(name), .. } = job {
            // The child holds every object now: it no longer copies on write.
            if let Some(rec) = self.state.volumes.get_mut(name) {
                if rec.vol.id == *child {
                    rec.vol.parent = None;
                }
            }
        }
        self.state.jobs.retain(|j| j != job);
        self.job = Some(JobRun::Saving);
        self.next.changed = true;
        self.next.then.push(Then::EndJob);
    }

    // ---- replies and time ---------------------------------------------------------------------

    /// The control operation's request to the tracking shard, if one is in flight.
    fn control_ask(&mut self) -> Option<&mut TrackAsk> {
        match &mut self.control {
            Some(Control::SuperAsking { ask, .. } | Control::AbortMarking { ask, .. } | Control::CollapseAsking { ask, .. } | Control::Resuming { ask, .. }) => Some(ask),
            _ => None,
        }
    }

    fn on_reply(&mut self, from: ShardId, req: ReqId, result: Result<ReplyBody, IoErr>) {
        if req == 0 {
            return;
        }
        // The control operation's tracking request?
        let ask = self.control_ask().filter(|a| a.req == req).cloned();
        if let Some(mut ask) = ask {
            let done = self.track_result(&mut ask, result);
            match done {
                Some(r) => self.on_track_done(r),
                None => {
                    if let Some(a) = self.control_ask() {
                        *a = ask;
                    }
                }
            }
            return;
        }
        // The job's?
        if let Some(JobRun::EndSuper { ask, .. }) = &self.job {
            if ask.req == req {
                let Some(JobRun::EndSuper { job, mut ask }) = self.job.take() else { unreachable!() };
                match self.track_result(&mut ask, result) {
                    None => self.job = Some(JobRun::EndSuper { job, ask }),
                    Some(Ok(_)) => self.finish_job(&job),
                    Some(Err(e)) => {
                        tracing::warn!("job {job:?}: {}; retrying", e.msg);
                        self.job = Some(JobRun::Backoff(self.now_us + self.cfg.retry_after_us * 10));
                    }
                }
                return;
            }
        }
        self.on_all_reply(from, req, result);
    }

    fn on_tick(&mut self) {
        let now = self.now_us;
        let resend = self.cfg.resend_after_us;
        let due = |a: &TrackAsk| if a.waiting { now >= a.at_us } else { now >= a.at_us + resend };
        // The control's tracking request: resend on silence, retry after a refusal, give up at
        // the deadline.
        let ask = self.control_ask().filter(|a| due(a)).cloned();
        if let Some(mut ask) = ask {
            if now >= ask.deadline_us {
                self.on_track_done(Err(TrackErr { refused: false, msg: "tracking shard: no answer before the deadline".into() }));
            } else {
                self.send_track(&mut ask);
                if let Some(a) = self.control_ask() {
                    *a = ask;
                }
            }
        }
        match self.job.take() {
            Some(JobRun::EndSuper { job, mut ask }) => {
                if due(&ask) {
                    if now >= ask.deadline_us {
                        self.job = Some(JobRun::Backoff(now + self.cfg.retry_after_us * 10));
                        return;
                    }
                    self.send_track(&mut ask);
                }
                self.job = Some(JobRun::EndSuper { job, ask });
            }
            Some(JobRun::All(mut a)) => {
                let stale = a.pending.values().any(|(_, sent)| now >= sent + resend);
                if a.retry_at_us.is_some_and(|t| now >= t) || stale || (a.epoch != self.durable.map.epoch && a.retry_at_us.is_none()) {
                    self.all_round(&mut a);
                }
                self.job = Some(JobRun::All(a));
            }
            other => self.job = other,
        }
    }
}

enum Step {
    Reply(MetaResp),
    Super { rec: VolumeRec, parent: String, track: TrackReq },
    /// A super retried for a child already recorded: ask the tracking shard again.
    SuperAgain { rec: VolumeRec, parent: String, track: TrackReq },
    Collapse { child: String, parent: String, track: TrackReq },
    /// Mark the superposition written (`mark`), then collapse (`collapse`), which must reject.
    Abort { child: String, parent: String, mark: TrackReq, collapse: TrackReq },
}

fn ensure(ok: bool, msg: String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(msg)
    }
}

/// The answer to a repeated `collapse` of `child`, if its collapse was decided (and `child`
/// is still the volume it promoted, or gone after a rejection).
/// Whether every slot's placement holds an up shard (its primary): no shard is recovering, and
/// fewer are down than a placement holds shards (`replicas` distinct ones, or all if fewer).
fn every_slot_has_a_primary(map: &ClusterMap) -> bool {
    let down = map.shards.iter().filter(|s| s.state == ShardState::Down).count();
    let per_placement = (map.replicas as usize).min(map.shards.len());
    !map.shards.iter().any(|s| s.state == ShardState::Recovering) && down < per_placement
}

/// The rules one [`MetaState`] keeps (see [`MetaCore::check_invariants`]): `Err((rule, detail))`.
fn check_state(s: &MetaState) -> Result<(), (&'static str, String)> {
    let mut ids = BTreeSet::new();
    for (name, v) in &s.volumes {
        if *name != v.name {
            return Err(("a volume is listed under its name", format!("{name:?} lists {:?}", v.name)));
        }
        if !ids.insert(v.vol.id) || v.vol.id >= s.next_id {
            return Err(("volume ids are unique and issued", format!("{name:?} has id {} (next {})", v.vol.id, s.next_id)));
        }
        if let Some(c) = &v.super_child {
            // One superposition per volume: its child names it back, in its table.
            let ok = c != name
                && v.super_parent.is_none()
                && s.volumes.get(c).is_some_and(|cr| cr.super_parent.as_ref() == Some(name) && cr.vol.parent == Some(v.vol.id) && cr.vol.table == v.vol.table);
            if !ok {
                return Err(("a super parent and its one child name each other", format!("{name:?} -> {c:?}: {:?}", s.volumes.get(c))));
            }
        }
        if let Some(p) = &v.super_parent {
            if s.volumes.get(p).and_then(|pr| pr.super_child.as_ref()) != Some(name) {
                return Err(("a super child's parent names it as its child", format!("{name:?} -> {p:?}: {:?}", s.volumes.get(p))));
            }
            if s.jobs.iter().any(|j| matches!(j, Job::Gc { table, .. } if *table == v.vol.table)) {
                return Err(("no super child in a table being garbage-collected", format!("{name:?} in table {}: {:?}", v.vol.table, s.jobs)));
            }
        } else if v.super_pending || v.collapsing {
            return Err(("only a super child is pending or collapsing", format!("{name:?}: {v:?}")));
        } else if let Some(pid) = v.vol.parent {
            // A promoted child reads through its parent's objects until its GC moved them.
            let collected = s.jobs.iter().any(|j| matches!(j, Job::Gc { parent, child, promoted: true, .. } if *parent == pid && *child == v.vol.id));
            if !collected {
                return Err(("a promoted child reads through its parent only while its GC job is listed", format!("{name:?}: {v:?}; jobs {:?}", s.jobs)));
            }
        }
        if v.super_pending && v.collapsing {
            return Err(("a pending super child is not collapsing", format!("{name:?}")));
        }
    }
    let mut gc_tables = BTreeSet::new();
    for j in &s.jobs {
        if let Job::Gc { table, parent, child, promoted, .. } = *j {
            // The collapse's loser is gone from the records; one GC per table at a time (a new
            // super waits for the last one's).
            let loser = if promoted { parent } else { child };
            if parent == child || !gc_tables.insert(table) || ids.contains(&loser) {
                return Err(("a GC job's loser is gone from the records, one GC per table", format!("{j:?}; jobs {:?}", s.jobs)));
            }
        }
    }
    if s.collapsed.len() > MAX_COLLAPSE_RECORDS {
        return Err(("at most MAX_COLLAPSE_RECORDS decided collapses", format!("{}", s.collapsed.len())));
    }
    Ok(())
}

fn decided_collapse(s: &MetaState, child: &str) -> Option<MetaResp> {
    let r = s.collapsed.iter().rev().find(|r| r.child == child)?;
    let now = s.volumes.get(child);
    match r.outcome {
        CollapseOutcome::Promoted => {
            let v = now.filter(|v| v.vol.id == r.child_id && v.super_parent.is_none())?;
            Some(MetaResp::Collapsed { outcome: r.outcome, volume: Some(v.clone()) })
        }
        CollapseOutcome::Rejected => now.is_none().then_some(MetaResp::Collapsed { outcome: r.outcome, volume: None }),
    }
}

fn super_pending(name: &str) -> String {
    format!("the super that makes {name:?} has not completed yet; retry shortly")
}

fn no_volume(name: &str) -> String {
    format!("no volume named {name:?} (see `understudy volume list`)")
}

pub fn validate_name(name: &str) -> Result<(), String> {
    ensure(
        !name.is_empty() && name.len() <= 128 && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)),
        format!("volume names are 1 to 128 characters of letters, digits, '-', '_' and '.', not {name:?}"),
    )
}

/// Shards a job still waits for (for diagnostics).
pub fn pending_shards(core: &MetaCore) -> BTreeSet<ShardId> {
    match &core.job {
        Some(JobRun::All(a)) => a.pending.keys().copied().collect(),
        _ => BTreeSet::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map() -> ClusterMap {
        ClusterMap {
            epoch: 3,
            replicas: 3,
            shards: (1..=4).map(|id| ShardInfo { id, addr: format!("s{id}"), state: ShardState::Up, in_sync: true }).collect(),
        }
    }

    fn core() -> MetaCore {
        MetaCore::new(MetaCoreConfig::default(), MetaState::with_map(map()), 100)
    }

    /// Feeds `input` at the core's current time; answers every save with `save_ok`; returns
    /// the other outputs.
    fn run(c: &mut MetaCore, input: MetaInput, save_ok: bool) -> Vec<MetaOutput> {
        let now = c.now_us;
        run_at(c, now, input, save_ok)
    }

    /// [`run`] at `now_us`.
    fn run_at(c: &mut MetaCore, now_us: u64, input: MetaInput, save_ok: bool) -> Vec<MetaOutput> {
        let mut inputs = VecDeque::from([input]);
        let mut outs = vec![];
        while let Some(i) = inputs.pop_front() {
            c.handle(now_us, i);
            c.check_invariants_deep();
            for o in c.take_outputs() {
                match o {
                    MetaOutput::Save { seq, .. } => {
                        inputs.push_back(MetaInput::Saved { seq, result: if save_ok { Ok(()) } else { Err("disk full".into()) } })
                    }
                    o => outs.push(o),
                }
            }
        }
        outs
    }

    fn req(c: &mut MetaCore, call: CallId, r: MetaReq, save_ok: bool) -> Vec<MetaOutput> {
        run(c, MetaInput::Request { call, req: r }, save_ok)
    }

    fn create(name: &str) -> MetaReq {
        MetaReq::Create { name: name.into(), size_bytes: 1 << 20, object_size_bytes: 65536 }
    }

    fn reply_of(outs: &[MetaOutput], call: CallId) -> MetaResp {
        outs.iter()
            .find_map(|o| match o {
                MetaOutput::Reply { call: c, resp } if *c == call => Some(resp.clone()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no reply to {call} in {outs:?}"))
    }

    fn sent(outs: &[MetaOutput]) -> Vec<(ShardId, Msg)> {
        outs.iter()
            .filter_map(|o| match o {
                MetaOutput::Send { to, msg } => Some((*to, msg.clone())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn bad_requests_get_clear_errors_and_change_nothing() {
        let mut c = core();
        assert!(matches!(reply_of(&req(&mut c, 1, create("v"), true), 1), MetaResp::Volume(_)));
        let before = c.durable().clone();
        for (call, r, want) in [
            (2, create("v"), "already exists"),
            (3, create("bad name"), "volume names"),
            (4, MetaReq::Create { name: "w".into(), size_bytes: 1000, object_size_bytes: 65536 }, "multiple of 512"),
            (5, MetaReq::Create { name: "w".into(), size_bytes: 4096, object_size_bytes: 3000 }, "power of two"),
            (6, MetaReq::Collapse { child: "v".into() }, "not a super child"),
            (7, MetaReq::Collapse { child: "nope".into() }, "no volume named"),
            (8, MetaReq::Resize { name: "v".into(), size_bytes: 512 }, "shrinking"),
            (9, MetaReq::Super { parent: "nope".into(), child: "c".into() }, "no volume named"),
            (10, MetaReq::Abort { child: "v".into() }, "not a super child: nothing to abort"),
            (11, MetaReq::Abort { child: "nope".into() }, "no volume named"),
        ] {
            let outs = req(&mut c, call, r, true);
            match reply_of(&outs, call) {
                MetaResp::Err(e) => assert!(e.contains(want), "{e} should say {want}"),
                other => panic!("{other:?}"),
            }
            assert!(sent(&outs).is_empty());
        }
        assert_eq!(c.durable(), &before);
        assert!(c.is_idle());
    }

    #[test]
    fn a_failed_save_reverts_and_answers_with_an_error() {
        let mut c = core();
        let outs = req(&mut c, 1, create("v"), false);
        match reply_of(&outs, 1) {
            MetaResp::Err(e) => assert!(e.contains("cannot save the metadata: disk full"), "{e}"),
            other => panic!("{other:?}"),
        }
        assert!(c.durable().volumes.is_empty());
        // Nothing was lost: the same request succeeds once the disk takes it, with the same id.
        match reply_of(&req(&mut c, 2, create("v"), true), 2) {
            MetaResp::Volume(v) => assert_eq!(v.vol.id, 1),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn super_records_then_asks_the_tracking_shard_and_undoes_on_refusal() {
        let mut c = core();
        req(&mut c, 1, create("p"), true);
        let outs = req(&mut c, 2, MetaReq::Super { parent: "p".into(), child: "c".into() }, true);
        // The child is durable before the tracking shard hears of it; no reply yet.
        assert!(c.durable().volumes.contains_key("c"));
        let s = sent(&outs);
        let [(to, Msg::Super { req: r, epoch: 3, table: 1, parent: 1, child: 2 })] = s[..] else { panic!("{s:?}") };
        assert_eq!(Some(to), map().primary(Slot { table: 1, objno: TRACK_OBJNO }));
        // A second control request waits its turn.
        assert!(req(&mut c, 3, MetaReq::Delete { name: "p".into() }, true).is_empty());
        // A stale map: retried after the retry period under a new request id.
        assert!(run(&mut c, MetaInput::ShardReply { from: to, req: r, result: Err(IoErr::StaleEpoch(4)) }, true).is_empty());
        let outs = run_at(&mut c, 60_000, MetaInput::Tick { unix_ms: 0 }, true);
        let s = sent(&outs);
        let [(_, Msg::Super { req: r2, .. })] = s[..] else { panic!("{s:?}") };
        assert_ne!(r2, r);
        // A late reply to the first attempt is ignored; a refusal of the second undoes super.
        assert!(run(&mut c, MetaInput::ShardReply { from: to, req: r, result: Ok(ReplyBody::Done) }, true).is_empty());
        let outs = run(&mut c, MetaInput::ShardReply { from: to, req: r2, result: Err(IoErr::BadRequest("fenced".into())) }, true);
        match reply_of(&outs, 2) {
            MetaResp::Err(e) => assert!(e.contains("super failed") && e.contains("fenced"), "{e}"),
            other => panic!("{other:?}"),
        }
        assert!(!c.durable().volumes.contains_key("c"));
        // Then the queued delete ran: accepted, as p had no super child any more.
        assert_eq!(reply_of(&outs, 3), MetaResp::Done);
        assert!(c.durable().volumes.is_empty());
        assert_eq!(c.durable().jobs, vec![Job::Delete { table: 1, owner: 1, drop_table: true }]);
    }

    #[test]
    fn collapse_promotes_then_gc_runs_on_every_live_shard_at_one_epoch_and_ends_the_super() {
        let mut c = core();
        req(&mut c, 1, create("p"), true);
        let outs = req(&mut c, 2, MetaReq::Super { parent: "p".into(), child: "c".into() }, true);
        let s = sent(&outs);
        let [(t, Msg::Super { req: r, .. })] = s[..] else { panic!("{s:?}") };
        let outs = run(&mut c, MetaInput::ShardReply { from: t, req: r, result: Ok(ReplyBody::Done) }, true);
        assert!(matches!(reply_of(&outs, 2), MetaResp::Volume(v) if v.vol.parent == Some(1)));
        let outs = req(&mut c, 3, MetaReq::Collapse { child: "c".into() }, true);
        let s = sent(&outs);
        let [(t, Msg::Collapse { req: r, child: 2, .. })] = s[..] else { panic!("{s:?}") };
        let outs = run(&mut c, MetaInput::ShardReply { from: t, req: r, result: Ok(ReplyBody::Collapse(CollapseOutcome::Promoted)) }, true);
        match reply_of(&outs, 3) {
            MetaResp::Collapsed { outcome: CollapseOutcome::Promoted, volume: Some(v) } => assert_eq!(v.name, "c"),
            other => panic!("{other:?}"),
        }
        assert_eq!(c.durable().volumes.keys().collect::<Vec<_>>(), ["c"]);
        // The GC job went out to every shard with the collapse's durable record.
        let gcs: Vec<(ShardId, ReqId)> = sent(&outs)
            .into_iter()
            .filter_map(|(to, m)| match m {
                Msg::Gc { req, epoch: 3, parent: 1, child: 2, promoted: true, .. } => Some((to, req)),
                _ => None,
            })
            .collect();
        assert_eq!(gcs.iter().map(|g| g.0).collect::<Vec<_>>(), [1, 2, 3, 4]);
        // Shard 4 goes down meanwhile: a new round at the new epoch, without it.
        for &(to, req) in &gcs[..2] {
            run(&mut c, MetaInput::ShardReply { from: to, req, result: Ok(ReplyBody::Done) }, true);
        }
        let mut m = map();
        m.epoch = 4;
        m.shards[3].state = ShardState::Down;
        run(&mut c, MetaInput::SetMap(m), true);
        let outs = run_at(&mut c, 1_000, MetaInput::Tick { unix_ms: 0 }, true);
        let round: Vec<(ShardId, ReqId)> = sent(&outs)
            .into_iter()
            .filter_map(|(to, m)| match m {
                Msg::Gc { req, epoch: 4, .. } => Some((to, req)),
                _ => None,
            })
            .collect();
        assert_eq!(round.iter().map(|g| g.0).collect::<Vec<_>>(), [1, 2, 3]);
        let mut end = vec![];
        for (to, req) in round {
            end.extend(sent(&run(&mut c, MetaInput::ShardReply { from: to, req, result: Ok(ReplyBody::Done) }, true)));
        }
        let [(t, Msg::EndSuper { req: r, child: 2, .. })] = end[..] else { panic!("{end:?}") };
        run(&mut c, MetaInput::ShardReply { from: t, req: r, result: Ok(ReplyBody::Done) }, true);
        assert!(c.durable().jobs.is_empty());
        assert_eq!(c.durable().volumes["c"].vol.parent, None, "the child no longer copies on write");
        assert!(c.is_idle());
    }

    /// After a restart every shard is down, then recovering one by one: a GC round answered by
    /// the first shard back (which leads no slot) must not end the job, or nobody collects.
    #[test]
    fn a_gc_round_counts_only_when_every_slot_has_an_up_primary() {
        let mut c = core();
        req(&mut c, 1, create("p"), true);
        let outs = req(&mut c, 2, MetaReq::Super { parent: "p".into(), child: "c".into() }, true);
        let [(t, Msg::Super { req: r, .. })] = sent(&outs)[..] else { panic!("{outs:?}") };
        run(&mut c, MetaInput::ShardReply { from: t, req: r, result: Ok(ReplyBody::Done) }, true);
        let outs = req(&mut c, 3, MetaReq::Collapse { child: "c".into() }, true);
        let [(t, Msg::Collapse { req: r, .. })] = sent(&outs)[..] else { panic!("{outs:?}") };
        run(&mut c, MetaInput::ShardReply { from: t, req: r, result: Ok(ReplyBody::Collapse(CollapseOutcome::Promoted)) }, true);
        // The service restarts (the GC job is saved): every shard down, then shard 1 is back.
        let member_cfg = MembershipConfig { ping_interval_us: 5_000, down_after_us: 20_000 };
        let start = start_service(Some(c.durable().clone()), 3, MetaCoreConfig::default(), member_cfg, 0, 1_000);
        let mut c = start.core;
        let mut m = c.durable().map.clone();
        assert!(m.shards.iter().all(|s| s.state == ShardState::Down), "{m:?}");
        m.epoch += 1;
        m.shards[0].state = ShardState::Recovering;
        run(&mut c, MetaInput::SetMap(m.clone()), true);
        let mut now = 1_000;
        let mut answered = 0;
        for _ in 0..20 {
            now += 1_000_000;
            let outs = run_at(&mut c, now, MetaInput::Tick { unix_ms: 0 }, true);
            for (to, msg) in sent(&outs) {
                assert!(!matches!(msg, Msg::EndSuper { .. }), "GC ended with only shard 1 back");
                if let Msg::Gc { req, .. } = msg {
                    answered += 1;
                    let outs = run(&mut c, MetaInput::ShardReply { from: to, req, result: Ok(ReplyBody::Done) }, true);
                    assert!(!sent(&outs).iter().any(|(_, m)| matches!(m, Msg::EndSuper { .. })), "GC ended with only shard 1 back: {outs:?}");
                }
            }
        }
        assert!(answered > 0, "no GC round ran");
        // Every shard back up: the next round ends the job.
        m.epoch += 1;
        for sh in &mut m.shards {
            sh.state = ShardState::Up;
        }
        run(&mut c, MetaInput::SetMap(m), true);
        let outs = run_at(&mut c, now + 1_000_000, MetaInput::Tick { unix_ms: 0 }, true);
        let mut end = vec![];
        for (to, msg) in sent(&outs) {
            if let Msg::Gc { req, .. } = msg {
                end.extend(sent(&run(&mut c, MetaInput::ShardReply { from: to, req, result: Ok(ReplyBody::Done) }, true)));
            }
        }
        assert!(matches!(end[..], [(_, Msg::EndSuper { .. })]), "no GC round once every shard was up, then the end of the super: {end:?}, round {:?}", sent(&outs));
    }

    /// Registers `c` as a super child of `p` and returns the durable state as a crash after the
    /// child's record was saved would leave it (the tracking shard not told yet).
    fn crashed_after_recording_super() -> MetaState {
        let mut c = core();
        req(&mut c, 1, create("p"), true);
        let outs = req(&mut c, 2, MetaReq::Super { parent: "p".into(), child: "c".into() }, true);
        assert!(matches!(sent(&outs)[..], [(_, Msg::Super { .. })]));
        let d = c.durable().clone();
        assert!(d.volumes["c"].super_pending, "the child is recorded pending");
        d
    }

    fn restart(state: MetaState) -> (MetaCore, Vec<MetaOutput>) {
        let mut c = MetaCore::new(MetaCoreConfig::default(), state, 1_000);
        let outs = run_at(&mut c, 1, MetaInput::Tick { unix_ms: 0 }, true);
        (c, outs)
    }

    #[test]
    fn a_pending_child_is_invisible_and_a_restart_finishes_its_super() {
        let state = crashed_after_recording_super();
        let (mut c, outs) = restart(state);
        // Info refuses the pending child; a collapse of it waits behind the resume.
        let info = req(&mut c, 5, MetaReq::Info { name: "c".into() }, true);
        assert!(matches!(reply_of(&info, 5), MetaResp::Err(e) if e.contains("has not completed yet")));
        let s = sent(&outs);
        let [(t, Msg::Super { req: r, parent: 1, child: 2, .. })] = s[..] else { panic!("{s:?}") };
        assert!(req(&mut c, 6, MetaReq::Collapse { child: "c".into() }, true).is_empty());
        // The tracking shard registers it (or had): the super is finished.
        let outs = run(&mut c, MetaInput::ShardReply { from: t, req: r, result: Ok(ReplyBody::Done) }, true);
        assert!(!c.durable().volumes["c"].super_pending);
        // Then the queued collapse runs against a real super child.
        let s = sent(&outs);
        assert!(matches!(s[..], [(_, Msg::Collapse { child: 2, .. })]), "{s:?}");
        // A retried super answers the same child.
        let mut c2 = MetaCore::new(MetaCoreConfig::default(), c.durable().clone(), 2_000);
        let outs = req(&mut c2, 7, MetaReq::Super { parent: "p".into(), child: "c".into() }, true);
        let s = sent(&outs);
        let [(t, Msg::Super { req: r, .. }), ..] = s[..] else { panic!("{s:?}") };
        let outs = run(&mut c2, MetaInput::ShardReply { from: t, req: r, result: Ok(ReplyBody::Done) }, true);
        let s = sent(&outs);
        if let [(t, Msg::Super { req: r, .. })] = s[..] {
            run(&mut c2, MetaInput::ShardReply { from: t, req: r, result: Ok(ReplyBody::Done) }, true);
        }
        assert!(c2.is_idle());
    }

    #[test]
    fn a_restart_undoes_a_pending_child_the_tracking_shard_refuses() {
        let (mut c, outs) = restart(crashed_after_recording_super());
        let s = sent(&outs);
        let [(t, Msg::Super { req: r, .. })] = s[..] else { panic!("{s:?}") };
        run(&mut c, MetaInput::ShardReply { from: t, req: r, result: Err(IoErr::BadRequest("fenced".into())) }, true);
        let d = c.durable();
        assert!(!d.volumes.contains_key("c") && d.volumes["p"].super_child.is_none(), "{d:?}");
        assert!(c.is_idle());
        // The parent can have a new child.
        let outs = req(&mut c, 3, MetaReq::Super { parent: "p".into(), child: "c".into() }, true);
        assert!(matches!(sent(&outs)[..], [(_, Msg::Super { .. })]));
    }

    #[test]
    fn a_restart_records_a_collapse_the_tracking_shard_decided_and_retries_get_its_answer() {
        let mut c = core();
        req(&mut c, 1, create("p"), true);
        let outs = req(&mut c, 2, MetaReq::Super { parent: "p".into(), child: "c".into() }, true);
        let s = sent(&outs);
        let [(t, Msg::Super { req: r, .. })] = s[..] else { panic!("{s:?}") };
        run(&mut c, MetaInput::ShardReply { from: t, req: r, result: Ok(ReplyBody::Done) }, true);
        let outs = req(&mut c, 3, MetaReq::Collapse { child: "c".into() }, true);
        assert!(matches!(sent(&outs)[..], [(_, Msg::Collapse { .. })]));
        // Crash: the tracking shard promoted the child, this service never heard.
        let (mut c, outs) = restart(c.durable().clone());
        let s = sent(&outs);
        let [(t, Msg::Super { req: r, .. })] = s[..] else { panic!("{s:?}") };
        let outs = run(&mut c, MetaInput::ShardReply { from: t, req: r, result: Ok(ReplyBody::Collapse(CollapseOutcome::Promoted)) }, true);
        assert_eq!(c.durable().volumes.keys().collect::<Vec<_>>(), ["c"]);
        assert!(c.durable().volumes["c"].super_parent.is_none());
        assert!(sent(&outs).iter().any(|(_, m)| matches!(m, Msg::Gc { promoted: true, .. })), "GC starts");
        // The client's retried collapse learns the outcome; an abort says it was promoted.
        assert!(matches!(reply_of(&req(&mut c, 4, MetaReq::Collapse { child: "c".into() }, true), 4), MetaResp::Collapsed { outcome: CollapseOutcome::Promoted, .. }));
        assert!(matches!(reply_of(&req(&mut c, 5, MetaReq::Abort { child: "c".into() }, true), 5), MetaResp::Err(e) if e.contains("promoted")));
    }

    /// A super child `c` of `p`, confirmed; returns the core and the collapse request sent.
    fn superposed() -> MetaCore {
        let mut c = core();
        req(&mut c, 1, create("p"), true);
        let s = sent(&req(&mut c, 2, MetaReq::Super { parent: "p".into(), child: "c".into() }, true));
        let [(t, Msg::Super { req: r, .. })] = s[..] else { panic!("{s:?}") };
        run(&mut c, MetaInput::ShardReply { from: t, req: r, result: Ok(ReplyBody::Done) }, true);
        c
    }

    fn collapses(outs: &[MetaOutput]) -> Vec<(ShardId, ReqId)> {
        sent(outs)
            .into_iter()
            .filter_map(|(to, m)| match m {
                Msg::Collapse { req, child: 2, .. } => Some((to, req)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn an_unanswered_collapse_goes_on_in_the_background_and_a_repeated_collapse_learns_its_outcome() {
        let mut c = superposed();
        let first = collapses(&req(&mut c, 3, MetaReq::Collapse { child: "c".into() }, true));
        assert_eq!(first.len(), 1);
        // A link that comes back up gets the request again at once, not a resend period later.
        let again = collapses(&run(&mut c, MetaInput::LinkUp { shard: first[0].0 }, true));
        assert_eq!(again.len(), 1);
        assert_ne!(again[0].1, first[0].1);
        // The tracking shard stays silent past the deadline: the caller hears "not decided yet",
        // and the undecided collapse is recorded durably.
        let deadline = MetaCoreConfig::default().tracking_deadline_us;
        let outs = run_at(&mut c, deadline + 1, MetaInput::Tick { unix_ms: 0 }, true);
        assert!(matches!(reply_of(&outs, 3), MetaResp::Err(e) if e.contains("not decided yet")));
        assert!(c.durable().volumes["c"].collapsing);
        assert!(!c.is_idle());
        // A restart at this point asks the tracking shard to collapse (not to register) it.
        let (_, outs) = restart(c.durable().clone());
        assert_eq!(collapses(&outs).len(), 1, "{outs:?}");
        // Without a caller, the service asks again with growing waits.
        let mut asks = vec![];
        let mut now = deadline + 1;
        while asks.len() < 3 {
            now += 100_000;
            let outs = run_at(&mut c, now, MetaInput::Tick { unix_ms: 0 }, true);
            asks.extend(collapses(&outs).into_iter().map(|a| (now, a)));
            assert!(now < deadline * 4, "no background attempts: {asks:?}");
        }
        // Other control requests are served between the attempts.
        let (t, r) = asks.last().unwrap().1;
        let outs = run(&mut c, MetaInput::ShardReply { from: t, req: r, result: Ok(ReplyBody::Collapse(CollapseOutcome::Promoted)) }, true);
        assert!(sent(&outs).iter().any(|(_, m)| matches!(m, Msg::Gc { promoted: true, .. })), "GC starts");
        let d = c.durable();
        assert_eq!(d.volumes.keys().collect::<Vec<_>>(), ["c"]);
        assert!(!d.volumes["c"].collapsing && d.volumes["c"].super_parent.is_none());
        // The caller asks again and learns the outcome.
        match reply_of(&req(&mut c, 4, MetaReq::Collapse { child: "c".into() }, true), 4) {
            MetaResp::Collapsed { outcome: CollapseOutcome::Promoted, volume: Some(v) } => assert_eq!(v.name, "c"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_collapse_asked_twice_answers_both_callers_with_the_one_outcome() {
        let mut c = superposed();
        let first = collapses(&req(&mut c, 3, MetaReq::Collapse { child: "c".into() }, true));
        // The caller's connection broke; it asks again while the first is in flight.
        assert!(req(&mut c, 4, MetaReq::Collapse { child: "c".into() }, true).is_empty());
        let (t, r) = first[0];
        let outs = run(&mut c, MetaInput::ShardReply { from: t, req: r, result: Ok(ReplyBody::Collapse(CollapseOutcome::Rejected)) }, true);
        for call in [3, 4] {
            assert!(matches!(reply_of(&outs, call), MetaResp::Collapsed { outcome: CollapseOutcome::Rejected, volume: None }), "{outs:?}");
        }
        assert_eq!(c.durable().volumes.keys().collect::<Vec<_>>(), ["p"]);
        // A volume that never was a super child still gets the clear error.
        assert!(matches!(reply_of(&req(&mut c, 5, MetaReq::Collapse { child: "p".into() }, true), 5), MetaResp::Err(e) if e.contains("not a super child")));
    }

    /// The invariant checks can fail: a core whose state breaks one panics naming it.
    #[test]
    fn check_invariants_names_a_broken_invariant() {
        let broken = |c: MetaCore| {
            let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.check_invariants_deep())).expect_err("the broken state passed");
            e.downcast_ref::<String>().cloned().unwrap()
        };
        let mut c = core();
        req(&mut c, 1, create("p"), true);
        c.check_invariants_deep();
        // A volume whose super child does not exist (two superpositions would look alike).
        let mut c1 = core();
        req(&mut c1, 1, create("p"), true);
        c1.state.volumes.get_mut("p").unwrap().super_child = Some("ghost".into());
        c1.durable = c1.state.clone();
        let msg = broken(c1);
        assert!(msg.contains("a super parent and its one child name each other"), "{msg}");
        // Two maps with one epoch.
        let mut c2 = core();
        c2.state.map.shards[0].state = ShardState::Down;
        let msg = broken(c2);
        assert!(msg.contains("one map per epoch"), "{msg}");
        // A change nobody saves.
        let mut c3 = core();
        c3.state.next_id += 1;
        let msg = broken(c3);
        assert!(msg.contains("every change of the state is saved"), "{msg}");
    }
}
