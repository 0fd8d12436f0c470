//! The storage shard as a deterministic state machine (no I/O, no clock, no threads).
//!
//! Inputs are messages, completed disk commands and clock ticks, each fed at the driver's clock
//! ([`ShardCore::handle`]); outputs ([`ShardCore::take_outputs`]) are messages to send and disk
//! commands to run. The tokio driver (`crate::driver::shard`) and the simulation tests run the same
//! core. What it implements (SpecREDS §4.2–4.3, §5):
//!
//! * primary-copy replication: the acting primary of a slot applies a write locally and on every
//!   live replica in parallel and acknowledges once all are durable; every operation on one slot
//!   is serialised by a slot lock, different slots proceed in parallel;
//! * collocated clones: a `super` child's object shares its parent's slot, so copy-on-write is a
//!   local copy on each replica, and a write covering the whole object skips the copy;
//! * the dirty / allow-write bits in a replicated tracking object per table, the tracking list on
//!   every data shard, permission requests, atomic `collapse`, and garbage collection;
//! * re-replication of a restarted or replaced shard, and repair of a replica whose copy differs
//!   from the primary's (object versions name contents; see [`Version`]);
//! * self-fencing on a liveness lease (issue 24 §3, `volume shard --store`): see [`Fence`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::hash::{BuildHasherDefault, DefaultHasher};

use serde::{Deserialize, Serialize};

use crate::types::*;

/// Who a message comes from or goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Peer {
    Shard(ShardId),
    /// A client connection, numbered by the driver.
    Client(u64),
    /// The metadata service.
    Meta,
}

/// One input of [`ShardCore::handle`]; the time comes with every input (its `now_us`).
#[derive(Debug)]
pub enum Input {
    Msg { from: Peer, msg: Msg },
    Disk { id: u64, result: Result<DiskOut, DiskErr> },
    /// The resend period's clock: requests unanswered for `resend_after_us` go again.
    Tick,
    /// The state of the shard's liveness lease in the control store (with
    /// [`ShardConfig::lease_required`]), reported by the driver whenever it changes.
    Lease(LeaseReport),
}

/// The shard's liveness lease in the control store, as its driver sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseReport {
    /// Lease `lease` of `ttl_us` is surely valid until `sure_until_us` (this core's clock): the
    /// send time of its last successful renewal plus its TTL (the store renewed it no earlier).
    Held { lease: i64, ttl_us: u64, sure_until_us: u64 },
    /// No lease: lost (not renewed in time, or the store said it expired), or not registered
    /// yet. Why, for the error clients get.
    Lost { why: String },
}

/// A shard fences itself this fraction of its lease's TTL before the lease may expire in the
/// store: with a renewal every third of the TTL, two renewals in a row must fail (or be slow)
/// before it fences.
pub const FENCE_MARGIN_TTL_DIVISOR: u64 = 3;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    Send { to: Peer, msg: Msg },
    Disk { id: u64, cmd: DiskCmd },
}

/// Local storage work for the driver. Every mutation is durable when it completes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiskCmd {
    /// Reads a range; bytes past the stored length read as zeroes.
    Read { key: ObjKey, offset: u32, len: u32 },
    /// Reads the whole stored object.
    ReadAll { key: ObjKey },
    /// Applies a mutation and records `version`. With `cow_from`, the object is first created as
    /// a local copy of that object (copy-on-write of a collocated clone).
    Apply { key: ObjKey, version: Version, op: RepOp, cow_from: Option<ObjKey> },
    Delete { key: ObjKey },
    /// Renames an object, keeping its version (garbage collection hands a parent object to the
    /// child).
    Rename { from: ObjKey, to: ObjKey },
    /// Replaces the shard's small state file; a higher `seq` always wins.
    SaveState { seq: u64, bytes: Vec<u8> },
    /// A hint, not a mutation, that nobody waits for: `parent` (of `table`) just got a `super`
    /// child, whose first write to each of the parent's objects here will need a fresh object.
    /// The store gets that many ready ahead of the child's writes (pre-stocking, SpecREDS §5:
    /// a COW write never waits for an allocation); `super` itself does not wait for it.
    Prestock { table: TableId, parent: VolId },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiskOut {
    Data(Vec<u8>),
    Done,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiskErr {
    NoSpace,
    Io(String),
}

/// How soon a request a peer answered "not ready" (it does not hold our map epoch yet) is sent
/// again, in µs: a map push reaches every shard within a few ms, and a write waits for it.
pub const RETRY_SOON_US: u64 = 20_000;

#[derive(Debug, Clone)]
pub struct ShardConfig {
    pub id: ShardId,
    /// Resend a request that has had no reply for this long.
    pub resend_after_us: u64,
    /// Objects per `ListObjects` reply page.
    pub list_page_objects: usize,
    /// Concurrent object pulls while re-replicating.
    pub max_pulls_in_flight: usize,
    /// First request id: differs between runs of a shard, so a reply to a request of an earlier
    /// run can never be taken for one of this run.
    pub id_base: u64,
    /// Slot tasks of garbage collection and volume deletion this shard runs at once as a
    /// primary (each holds its slot's lock and issues at most one disk command): background work
    /// gets this small budget, so its deletes and renames never queue ahead of client writes in
    /// the driver's disk queue, however many objects a collapse leaves to collect.
    pub max_background_tasks: usize,
    /// The shard keeps a liveness lease in the control store and fences itself while it is not
    /// sure of it (see [`Fence`]); it starts fenced, until its first lease is reported.
    pub lease_required: bool,
}

impl ShardConfig {
    pub fn new(id: ShardId) -> Self {
        ShardConfig { id, resend_after_us: 200_000, list_page_objects: 2048, max_pulls_in_flight: 16, id_base: 0, max_background_tasks: 4, lease_required: false }
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct CoreStats {
    pub epoch: Epoch,
    pub objects: u64,
    pub ops_in_flight: u64,
    pub locked_slots: u64,
    pub recovering: bool,
    pub retired_volumes: u64,
    /// Budgeted background tasks (GC) waiting for a turn, and running.
    pub background_waiting: u64,
    pub background_running: u64,
    /// Fenced: refusing client I/O because its lease is not sure (see [`Fence`]).
    pub fenced: bool,
}

/// Self-fencing, as Patroni demotes a primary that cannot reach its store.
///
/// A shard with a lease ([`ShardConfig::lease_required`]) fences itself once it is no longer
/// sure of its lease for the next `ttl / FENCE_MARGIN_TTL_DIVISOR` (or has none): it refuses
/// every client read and write and every tracking request ([`IoErr::Fenced`], which clients
/// retry after refreshing their map), while it goes on serving as a replica.
///
/// Why no two primaries of one slot accept writes: the metadata leader moves a slot away from
/// this shard (a new map epoch, with another primary) only after it read the shard's lease gone
/// from the store, or listed under another lease. The store expires a lease no earlier than
/// the TTL after it received the last renewal, which is after this shard *sent* it; the shard
/// fences at that send time plus `ttl - ttl / FENCE_MARGIN_TTL_DIVISOR` on its own monotonic
/// clock. So it refuses writes at least `ttl / FENCE_MARGIN_TTL_DIVISOR` (a second of a 3 s
/// TTL) before any other shard can be made primary in its place; that margin absorbs the core's
/// tick (20 ms), the drift between the two clocks, and the writes already in flight. And a write
/// that an old primary still sends after the new epoch exists is refused by every replica on
/// the new epoch ([`IoErr::StaleEpoch`]), so it is never acknowledged: the epoch check is the
/// backstop, the fence keeps a shard cut off from the store from taking writes alone.
///
/// The fence lifts when the shard is sure of a lease again and either it is the lease it held
/// when it fenced (renewed in time after all: the store never let it go, so the metadata
/// service cannot have moved its slots for it), or the metadata service has re-admitted it:
/// it saw a map marking it down since it fenced, and now one where it is not down (it lost its
/// lease, registered a new one, and recovers as a restarted shard does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    /// Why, for the error clients get.
    pub why: String,
    /// The lease held when the fence went up (None: none held).
    lease: Option<i64>,
    /// A map marking this shard down arrived since the fence went up.
    seen_down: bool,
}

/// What the driver found on disk at start.
#[derive(Debug, Default, Clone)]
pub struct Boot {
    pub objects: Vec<(ObjKey, Version)>,
    /// Contents of the tracking objects held here.
    pub track_objects: Vec<(ObjKey, Vec<u8>)>,
    /// The last saved state file.
    pub state: Option<Vec<u8>>,
}

/// The shard's small durable state: its tracking list.
#[derive(Serialize, Deserialize, Default, Debug, Clone)]
struct SavedState {
    entries: Vec<(VolId, TrackEntry)>,
    retired: Vec<VolId>,
}

type OpId = u64;
/// Hash maps with a fixed hasher: iteration order must not vary between runs, or a simulation
/// seed would not reproduce.
type HashMap<K, V> = std::collections::HashMap<K, V, BuildHasherDefault<DefaultHasher>>;
type HashSet<K> = std::collections::HashSet<K, BuildHasherDefault<DefaultHasher>>;

/// Whom an outstanding request is addressed to; resolved again on every resend.
#[derive(Debug, Clone, Copy)]
enum Target {
    Shard(ShardId),
    TrackingPrimary(TableId),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    Op(OpId),
    Permission(VolId),
    Recovery,
}

#[derive(Debug)]
struct Outstanding {
    target: Target,
    msg: Msg,
    sent_us: u64,
    owner: Owner,
}

#[derive(Debug)]
enum Queued {
    Msg(Peer, Msg),
    Task(OpId, Task),
}

/// Slot-locked work of a multi-object operation (GC, delete, recovery).
#[derive(Debug, Clone)]
enum Task {
    Delete(ObjKey),
    /// Garbage collection of one slot: `from`'s object is deleted if `to` is `None` or already
    /// has its own, else renamed to `to`'s (a promoted child takes the parent objects it did not
    /// copy). A primary replicates it to the slot's replicas, so every change to a slot's objects
    /// flows through its primary in order.
    Collect { slot: Slot, from: VolId, to: Option<VolId>, replicate: bool },
    /// Recovery: install a pulled object.
    Install { key: ObjKey, version: Version, data: Vec<u8> },
}

#[derive(Debug)]
enum Kind {
    /// Client write at the primary.
    Write {
        reply_to: (Peer, ReqId),
        vol: VolRef,
        objno: u64,
        op: IoOp,
        waiting_permission: bool,
        started: Option<(ObjKey, Version)>,
        need_full: Vec<ShardId>,
        reading_full: bool,
    },
    /// Client read at the primary, or a pull served to a recovering shard.
    Read { reply_to: (Peer, ReqId), pull_of: Option<(ObjKey, Version)>, body: Option<ReplyBody> },
    /// A replicated mutation at a replica.
    Replica { reply_to: (Peer, ReqId), key: ObjKey, version: Version, track: Option<TableTrack> },
    /// A change of a tracking object at its primary (super, collapse, permission, end).
    TrackUpdate {
        reply_to: (Peer, ReqId),
        key: ObjKey,
        version: Version,
        new: TableTrack,
        reply: ReplyBody,
        broadcast: Option<(VolId, TrackEntry)>,
    },
    /// A tracking-list change at a data shard, acknowledged once saved.
    SaveEntries { reply_to: Option<(Peer, ReqId)>, parent: Option<OpId> },
    /// A set of slot-locked tasks (GC, delete) replied to when all are done. `budgeted`: its
    /// tasks run within [`ShardConfig::max_background_tasks`].
    Tasks { reply_to: Option<(Peer, ReqId)>, remaining: usize, for_recovery: bool, budgeted: bool },
    /// One slot-locked task.
    Task { parent: OpId, task: Task },
    /// A new primary making its replicas' copies of a slot equal to its own.
    SlotSync { epoch: Epoch, reads: HashMap<u64, (ShardId, ObjKey, Version)> },
}

#[derive(Debug)]
struct Op {
    slot: Option<Slot>,
    disk: HashSet<u64>,
    waits: HashSet<ReqId>,
    err: Option<IoErr>,
    kind: Kind,
}

#[derive(Debug)]
struct PermissionState {
    table: TableId,
    waiters: Vec<OpId>,
}

#[derive(Debug, Default)]
struct Recovery {
    epoch: Epoch,
    /// Peers still listing, with their next cursor.
    listing: HashMap<ShardId, Option<ObjKey>>,
    /// Peers asked for their lists: only slots one of them leads are reconciled.
    peers: HashSet<ShardId>,
    listed: HashMap<ObjKey, (Version, ShardId)>,
    /// Objects a replicated write was applied to since recovery began: they are current.
    touched: HashSet<ObjKey>,
    /// Objects we told a primary we hold a different copy of: pulled before recovery may end.
    stale: HashSet<ObjKey>,
    pulls: VecDeque<(ObjKey, ShardId)>,
    pulls_in_flight: usize,
    tasks_in_flight: usize,
    reported: bool,
    reported_us: u64,
}

pub struct ShardCore {
    cfg: ShardConfig,
    now_us: u64,
    map: Option<ClusterMap>,
    objects: BTreeMap<ObjKey, Version>,
    tracks: HashMap<TableId, TableTrack>,
    entries: HashMap<VolId, TrackEntry>,
    /// Volumes deleted, collapsed away or replaced: late I/O for them is refused, so an in-flight
    /// write can never recreate an object garbage collection removed.
    retired: HashSet<VolId>,
    state_seq: u64,
    locks: HashMap<Slot, VecDeque<Queued>>,
    ops: HashMap<OpId, Op>,
    disk_owner: HashMap<u64, OpId>,
    outstanding: HashMap<ReqId, Outstanding>,
    permissions: HashMap<VolId, PermissionState>,
    recovery: Option<Recovery>,
    /// Slots whose replicas were made equal to ours since the last map change.
    synced: HashSet<Slot>,
    /// Budgeted background tasks waiting to start, and how many run.
    background: VecDeque<(OpId, Task)>,
    background_running: usize,
    next_id: u64,
    out: Vec<Output>,
    /// The driver's last report of the lease (None: none yet).
    lease: Option<LeaseReport>,
    /// Up while the shard refuses client I/O (see [`Fence`]).
    fence: Option<Fence>,
}

fn track_key(table: TableId) -> ObjKey {
    ObjKey { table, objno: TRACK_OBJNO, owner: 0 }
}

fn with_owner(key: ObjKey, owner: VolId) -> ObjKey {
    ObjKey { owner, ..key }
}

fn set_epoch(msg: &mut Msg, e: Epoch) {
    match msg {
        Msg::Rep { epoch, .. }
        | Msg::Permission { epoch, .. }
        | Msg::Track { epoch, .. }
        | Msg::ListObjects { epoch, .. }
        | Msg::SlotVersions { epoch, .. }
        | Msg::RepDelete { epoch, .. }
        | Msg::RepSync { epoch, .. }
        | Msg::RepCollect { epoch, .. }
        | Msg::Pull { epoch, .. } => *epoch = e,
        _ => {}
    }
}

impl ShardCore {
    pub fn new(cfg: ShardConfig, boot: Boot) -> Self {
        let cfg_id_base = cfg.id_base;
        let mut core = ShardCore {
            cfg,
            now_us: 0,
            map: None,
            objects: boot.objects.into_iter().collect(),
            tracks: HashMap::default(),
            entries: HashMap::default(),
            retired: HashSet::default(),
            state_seq: 0,
            locks: HashMap::default(),
            ops: HashMap::default(),
            disk_owner: HashMap::default(),
            outstanding: HashMap::default(),
            permissions: HashMap::default(),
            recovery: None,
            synced: HashSet::default(),
            background: VecDeque::new(),
            background_running: 0,
            next_id: 1 + cfg_id_base,
            out: Vec::new(),
            lease: None,
            fence: None,
        };
        if core.cfg.lease_required {
            // A new process: the metadata service treats it as restarted (recovering), so the
            // first map where it is not down is its re-admission.
            core.fence = Some(Fence { why: "no lease in the control store yet".into(), lease: None, seen_down: true });
        }
        for (key, bytes) in boot.track_objects {
            if let Ok(t) = postcard::from_bytes::<TableTrack>(&bytes) {
                core.tracks.insert(key.table, t);
            }
        }
        if let Some(bytes) = boot.state {
            if let Ok(s) = postcard::from_bytes::<SavedState>(&bytes) {
                core.entries = s.entries.into_iter().collect();
                core.retired = s.retired.into_iter().collect();
            }
        }
        core
    }

    pub fn id(&self) -> ShardId {
        self.cfg.id
    }

    pub fn map(&self) -> Option<&ClusterMap> {
        self.map.as_ref()
    }

    /// Objects stored here and their versions (for tests and metrics).
    pub fn objects(&self) -> &BTreeMap<ObjKey, Version> {
        &self.objects
    }

    pub fn tracking_entry(&self, vol: VolId) -> Option<TrackEntry> {
        self.entries.get(&vol).copied()
    }

    pub fn table_track(&self, table: TableId) -> Option<&TableTrack> {
        self.tracks.get(&table)
    }

    /// Operations in progress (for tests: zero when the shard is idle).
    pub fn ops_in_flight(&self) -> usize {
        self.ops.len()
    }

    /// A one-line description of the operations in progress, for test failures.
    pub fn debug_ops(&self) -> String {
        let ops: Vec<String> = self
            .ops
            .values()
            .map(|o| {
                let kind = match &o.kind {
                    Kind::Write { waiting_permission, started, need_full, .. } => {
                        format!("write perm:{waiting_permission} {started:?} need_full:{need_full:?}")
                    }
                    Kind::Read { .. } => "read".into(),
                    Kind::Replica { key, .. } => format!("replica {key:?}"),
                    Kind::TrackUpdate { key, .. } => format!("track-update {key:?}"),
                    Kind::SaveEntries { .. } => "save".into(),
                    Kind::Tasks { remaining, .. } => format!("tasks {remaining} (background: {} waiting, {} running)", self.background.len(), self.background_running),
                    Kind::Task { task, .. } => format!("task {task:?}").chars().take(80).collect(),
                    Kind::SlotSync { reads, .. } => format!("slot-sync reads:{}", reads.len()),
                };
                let waits: Vec<String> = o
                    .waits
                    .iter()
                    .map(|w| match self.outstanding.get(w) {
                        Some(x) => format!("{:?} {}", x.target, { let m = format!("{:?}", x.msg); let n = m.len(); m[n.saturating_sub(120)..].to_string() }),
                        None => "?".into(),
                    })
                    .collect();
                format!("[{kind} disk:{} waits:{waits:?} err:{:?}]", o.disk.len(), o.err)
            })
            .collect();
        format!("{} locks:{} recovery:{:?}", ops.join(" "), self.locks.len(), self.recovery.as_ref().map(|r| (r.listing.len(), r.pulls.len(), r.pulls_in_flight, r.tasks_in_flight, r.reported)))
    }

    /// Gauges for the metrics endpoint.
    pub fn stats(&self) -> CoreStats {
        CoreStats {
            epoch: self.epoch(),
            objects: self.objects.len() as u64,
            ops_in_flight: self.ops.len() as u64,
            locked_slots: self.locks.len() as u64,
            recovering: self.is_recovering(),
            retired_volumes: self.retired.len() as u64,
            background_waiting: self.background.len() as u64,
            background_running: self.background_running as u64,
            fenced: self.fence.is_some(),
        }
    }

    /// The fence, while it is up.
    pub fn fence(&self) -> Option<&Fence> {
        self.fence.as_ref()
    }

    /// The lease this shard is sure of for at least the fencing margin, or why not.
    fn sure_lease(&self) -> Result<i64, String> {
        match &self.lease {
            None => Err("no lease in the control store yet".into()),
            Some(LeaseReport::Lost { why }) => Err(why.clone()),
            Some(LeaseReport::Held { lease, ttl_us, sure_until_us }) => {
                let (lease, ttl_us, sure_until_us) = (*lease, *ttl_us, *sure_until_us);
                if self.now_us + ttl_us / FENCE_MARGIN_TTL_DIVISOR < sure_until_us {
                    Ok(lease)
                } else {
                    Err(format!(
                        "lease {lease:x} in the control store not renewed: it may expire in {} ms (TTL {} ms)",
                        sure_until_us.saturating_sub(self.now_us) / 1000,
                        ttl_us / 1000
                    ))
                }
            }
        }
    }

    /// Puts the fence up or takes it down (the rules of [`Fence`]); after every input.
    fn update_fence(&mut self) {
        if !self.cfg.lease_required {
            return;
        }
        let me_down = self.map.as_ref().is_none_or(|m| m.state(self.cfg.id) == ShardState::Down);
        let sure = self.sure_lease();
        let held = match &self.lease {
            Some(LeaseReport::Held { lease, .. }) => Some(*lease),
            _ => None,
        };
        match (sure, &mut self.fence) {
            (Err(why), None) => self.fence = Some(Fence { why, lease: held, seen_down: me_down }),
            (Err(why), Some(f)) => {
                f.seen_down |= me_down;
                f.why = why;
            }
            (Ok(lease), Some(f)) => {
                f.seen_down |= me_down;
                if f.lease == Some(lease) || (f.seen_down && !me_down) {
                    self.fence = None;
                }
            }
            (Ok(_), None) => {}
        }
    }

    fn fenced_err(&self) -> Option<IoErr> {
        self.fence.as_ref().map(|f| IoErr::Fenced(format!("shard {} fenced itself: {}", self.cfg.id, f.why)))
    }

    pub fn is_recovering(&self) -> bool {
        self.recovery.as_ref().is_some_and(|r| !r.reported)
    }

    /// Feeds one input at `now_us` (the driver's monotonic clock, µs; read at [`Input::Tick`]s,
    /// an earlier time than one seen before counts as that one); its outputs wait in
    /// [`Self::take_outputs`].
    pub fn handle(&mut self, now_us: u64, input: Input) {
        #[cfg(debug_assertions)]
        let epoch_before = self.epoch();
        if let Input::Tick = input {
            // The clock advances at ticks only: request and report times count from the last
            // tick, as they did before every input carried the time (a seeded simulation's
            // schedule stays the same).
            self.now_us = self.now_us.max(now_us);
        }
        match input {
            Input::Msg { from, msg } => self.on_msg(from, msg),
            Input::Disk { id, result } => self.on_disk(id, result),
            Input::Tick => self.on_tick(),
            Input::Lease(report) => self.lease = Some(report),
        }
        self.update_fence();
        #[cfg(debug_assertions)]
        {
            assert!(self.epoch() >= epoch_before, "shard {}: invariant `the map epoch never decreases` broken: {epoch_before} -> {}", self.cfg.id, self.epoch());
            self.check_invariants();
        }
    }

    /// The outputs of the inputs handled since the last call, in order.
    pub fn take_outputs(&mut self) -> Vec<Output> {
        std::mem::take(&mut self.out)
    }

    /// Panics, naming the invariant and the state, if the core's state breaks one of the rules
    /// the module doc states. Cheap: O(operations in flight + locked slots + tracking state),
    /// never O(objects stored). Run after every input in debug builds and after every step of
    /// the simulation.
    pub fn check_invariants(&self) {
        let me = self.cfg.id;
        let broken = |what: &str, state: String| -> ! { panic!("shard {me}: invariant `{what}` broken: {state}") };
        // A shard not sure of its lease for the fencing margin refuses client I/O.
        if self.cfg.lease_required && self.fence.is_none() {
            if let Err(why) = self.sure_lease() {
                broken("a shard unsure of its lease is fenced", why);
            }
        }
        // Every operation on one slot is serialised by the slot lock: an operation bound to a
        // slot holds its lock, and no two operations hold one slot.
        let mut holders: HashMap<Slot, OpId> = HashMap::default();
        for (id, op) in &self.ops {
            if let Some(slot) = op.slot {
                if !self.locks.contains_key(&slot) {
                    broken("an operation on a slot holds its lock", format!("op {id} on {slot:?} without the lock; {}", self.debug_ops()));
                }
                if let Some(other) = holders.insert(slot, *id) {
                    broken("one operation at a time per slot", format!("ops {other} and {id} both hold {slot:?}; {}", self.debug_ops()));
                }
            }
            // What an operation waits for is tracked: each disk command it waits for is owned by
            // it, each request it waits for is outstanding on its behalf.
            for d in &op.disk {
                if self.disk_owner.get(d) != Some(id) {
                    broken("an operation's disk commands are owned by it", format!("op {id} waits for disk {d}, owned by {:?}", self.disk_owner.get(d)));
                }
            }
            for r in &op.waits {
                if self.outstanding.get(r).map(|o| o.owner) != Some(Owner::Op(*id)) {
                    broken("an operation's requests are outstanding for it", format!("op {id} waits for {r:?}, outstanding for {:?}", self.outstanding.get(r).map(|o| o.owner)));
                }
            }
        }
        // A write waiting for permission is queued on exactly that parent's request.
        for (parent, p) in &self.permissions {
            for w in &p.waiters {
                match self.ops.get(w).map(|o| &o.kind) {
                    Some(Kind::Write { waiting_permission: true, .. }) => {}
                    other => broken("a permission waiter is a write waiting for permission", format!("parent {parent}: waiter {w} is {other:?}")),
                }
            }
        }
        // Named limits.
        if self.background_running > self.cfg.max_background_tasks.max(1) {
            broken("background tasks within max_background_tasks", format!("{} running, limit {}", self.background_running, self.cfg.max_background_tasks));
        }
        if let Some(r) = &self.recovery {
            if r.pulls_in_flight > self.cfg.max_pulls_in_flight {
                broken("recovery pulls within max_pulls_in_flight", format!("{} in flight, limit {}", r.pulls_in_flight, self.cfg.max_pulls_in_flight));
            }
            if r.epoch > self.epoch() {
                broken("recovery runs at an epoch we hold", format!("recovery at {}, map at {}", r.epoch, self.epoch()));
            }
        }
    }

    /// [`Self::check_invariants`] and those whose check walks every slot this shard synced:
    /// one placement computation per slot, thousands per input once a shard has synced its
    /// slots — after every input of a real shard that made a debug build's `mkfs` on a volume
    /// CPU-bound for minutes. The simulations and the model test call this one after every step.
    pub fn check_invariants_deep(&self) {
        self.check_invariants();
        // Slots synced since the last map change are slots we lead in this map.
        for slot in &self.synced {
            if !self.is_primary(*slot) {
                panic!(
                    "shard {}: invariant `synced slots are slots we lead` broken: {slot:?} synced, primary {:?}",
                    self.cfg.id,
                    self.map.as_ref().and_then(|m| m.primary(*slot))
                );
            }
        }
    }

    fn fresh_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        // Mix in the shard id so request ids of different shards never collide in logs.
        id << 8 | (self.cfg.id as u64 & 0xff)
    }

    fn epoch(&self) -> Epoch {
        self.map.as_ref().map_or(0, |m| m.epoch)
    }

    fn reply(&mut self, to: (Peer, ReqId), result: Result<ReplyBody, IoErr>) {
        self.out.push(Output::Send { to: to.0, msg: Msg::Reply { req: to.1, result } });
    }

    fn send_request(&mut self, target: Target, mut msg: Msg, owner: Owner) -> ReqId {
        let req = self.fresh_id();
        match &mut msg {
            Msg::Rep { req: r, .. }
            | Msg::Permission { req: r, .. }
            | Msg::Track { req: r, .. }
            | Msg::ListObjects { req: r, .. }
            | Msg::SlotVersions { req: r, .. }
            | Msg::RepDelete { req: r, .. }
            | Msg::RepSync { req: r, .. }
            | Msg::RepCollect { req: r, .. }
            | Msg::Pull { req: r, .. } => *r = req,
            _ => unreachable!("not a shard-to-shard request: {msg:?}"),
        }
        self.transmit(target, &msg);
        self.outstanding.insert(req, Outstanding { target, msg, sent_us: self.now_us, owner });
        req
    }

    fn resolve(&self, target: Target) -> Option<ShardId> {
        let map = self.map.as_ref()?;
        match target {
            Target::Shard(id) => (map.state(id) != ShardState::Down).then_some(id),
            Target::TrackingPrimary(table) => map.primary(track_key(table).slot()),
        }
    }

    fn transmit(&mut self, target: Target, msg: &Msg) {
        if let Some(to) = self.resolve(target) {
            if to == self.cfg.id {
                // Requests to ourselves (we are the tracking primary) loop through the inbox.
                let msg = msg.clone();
                self.on_msg(Peer::Shard(to), msg);
            } else {
                self.out.push(Output::Send { to: Peer::Shard(to), msg: msg.clone() });
            }
        }
    }

    fn check_epoch(&self, epoch: Epoch) -> Result<(), IoErr> {
        match &self.map {
            None => Err(IoErr::NotReady),
            Some(m) if epoch < m.epoch => Err(IoErr::StaleEpoch(m.epoch)),
            Some(m) if epoch > m.epoch => Err(IoErr::NotReady),
            Some(_) => Ok(()),
        }
    }

    fn check_primary(&self, slot: Slot) -> Result<(), IoErr> {
        if self.is_primary(slot) {
            Ok(())
        } else {
            Err(IoErr::NotPrimary)
        }
    }

    fn is_primary(&self, slot: Slot) -> bool {
        self.map.as_ref().and_then(|m| m.primary(slot)) == Some(self.cfg.id)
    }

    /// Replicas of a slot other than us that must receive its mutations.
    fn live_replicas(&self, slot: Slot) -> Vec<ShardId> {
        let Some(map) = &self.map else { return vec![] };
        map.placement(slot)
            .into_iter()
            .filter(|&id| id != self.cfg.id && map.state(id) != ShardState::Down)
            .collect()
    }

    // ---- slot locks ---------------------------------------------------------------------------

    /// Takes the slot lock, or queues the item to run when the lock is handed over.
    fn lock_or_queue(&mut self, slot: Slot, item: Queued) -> bool {
        match self.locks.get_mut(&slot) {
            Some(q) => {
                q.push_back(item);
                false
            }
            None => {
                self.locks.insert(slot, VecDeque::new());
                true
            }
        }
    }

    fn unlock(&mut self, slot: Slot) {
        let next = self.locks.get_mut(&slot).and_then(|q| q.pop_front());
        match next {
            Some(item) => self.run_locked(item),
            None => {
                self.locks.remove(&slot);
            }
        }
    }

    fn run_locked(&mut self, item: Queued) {
        match item {
            Queued::Msg(from, msg) => self.on_msg_locked(from, msg),
            Queued::Task(op, task) => self.run_task(op, task),
        }
    }

    fn new_op(&mut self, slot: Option<Slot>, kind: Kind) -> OpId {
        let id = self.fresh_id();
        self.ops.insert(id, Op { slot, disk: HashSet::default(), waits: HashSet::default(), err: None, kind });
        id
    }

    fn disk(&mut self, op: OpId, cmd: DiskCmd) {
        let id = self.fresh_id();
        self.disk_owner.insert(id, op);
        if let Some(o) = self.ops.get_mut(&op) {
            o.disk.insert(id);
        }
        self.out.push(Output::Disk { id, cmd });
    }

    fn wait_on(&mut self, op: OpId, target: Target, msg: Msg) {
        let req = self.send_request(target, msg, Owner::Op(op));
        if let Some(o) = self.ops.get_mut(&op) {
            o.waits.insert(req);
        }
    }

    // ---- messages -----------------------------------------------------------------------------

    fn on_msg(&mut self, from: Peer, msg: Msg) {
        if let Peer::Client(_) = from {
            // A client connection may only do I/O (and ping). Control and replication messages
            // come from the metadata service and from shards; a reply from a client could
            // otherwise pass for a replica's acknowledgement of the same request id.
            match &msg {
                Msg::Io { .. } | Msg::Ping { .. } => {}
                Msg::Reply { .. } | Msg::Map(_) | Msg::Recovered { .. } | Msg::Register { .. } => return,
                other => {
                    if let Some(req) = request_id(other) {
                        self.reply((from, req), Err(IoErr::BadRequest("clients may only send I/O".into())));
                    }
                    return;
                }
            }
        }
        if let Some(e) = self_child(&msg) {
            // Hostile (the metadata service never names a volume its own child): acting on it
            // would track, fence or collect a volume against itself.
            if let Some(req) = request_id(&msg) {
                self.reply((from, req), Err(IoErr::BadRequest(e)));
            }
            return;
        }
        match msg {
            Msg::Map(map) => self.on_map(map),
            Msg::Reply { req, result } => self.on_reply(req, result),
            Msg::Io { req, .. } if self.fence.is_some() => {
                let e = self.fenced_err().expect("fenced");
                self.reply((from, req), Err(e));
            }
            Msg::Permission { req, .. } | Msg::Super { req, .. } | Msg::Collapse { req, .. } | Msg::EndSuper { req, .. }
                if self.fence.is_some() =>
            {
                let e = self.fenced_err().expect("fenced");
                self.reply((from, req), Err(e));
            }
            Msg::Io { req, epoch, ref vol, objno, ref op } => {
                let slot = Slot { table: vol.table, objno };
                if let Err(e) = self.validate_io(epoch, vol, objno, op) {
                    return self.reply((from, req), Err(e));
                }
                if self.lock_or_queue(slot, Queued::Msg(from, msg.clone())) {
                    self.on_msg_locked(from, msg);
                }
            }
            Msg::Rep { req, epoch, key, .. } => {
                if let Err(e) = self.check_epoch(epoch).and_then(|_| self.check_sender_is_primary(from, key.slot())) {
                    return self.reply((from, req), Err(e));
                }
                if self.lock_or_queue(key.slot(), Queued::Msg(from, msg.clone())) {
                    self.on_msg_locked(from, msg);
                }
            }
            Msg::Permission { req, epoch, table, .. }
            | Msg::Super { req, epoch, table, .. }
            | Msg::Collapse { req, epoch, table, .. }
            | Msg::EndSuper { req, epoch, table, .. } => {
                let slot = track_key(table).slot();
                if let Err(e) = self.check_epoch(epoch) {
                    return self.reply((from, req), Err(e));
                }
                if !self.is_primary(slot) {
                    return self.reply((from, req), Err(IoErr::NotPrimary));
                }
                if self.lock_or_queue(slot, Queued::Msg(from, msg.clone())) {
                    self.on_msg_locked(from, msg);
                }
            }
            Msg::Pull { req, epoch, key } => {
                if let Err(e) = self.check_epoch(epoch) {
                    return self.reply((from, req), Err(e));
                }
                if !self.is_primary(key.slot()) {
                    return self.reply((from, req), Err(IoErr::NotPrimary));
                }
                if self.lock_or_queue(key.slot(), Queued::Msg(from, msg.clone())) {
                    self.on_msg_locked(from, msg);
                }
            }
            Msg::Track { req, epoch, parent, entry } => {
                if let Err(e) = self.check_epoch(epoch) {
                    return self.reply((from, req), Err(e));
                }
                self.set_entry(parent, entry);
                let op = self.new_op(None, Kind::SaveEntries { reply_to: Some((from, req)), parent: None });
                self.save_state(op);
            }
            Msg::Gc { req, epoch, .. } | Msg::DeleteVolume { req, epoch, .. } if self.check_epoch(epoch).is_err() => {
                let e = self.check_epoch(epoch).unwrap_err();
                self.reply((from, req), Err(e));
            }
            Msg::Gc { req, table, parent, child, promoted, .. } => self.on_gc(from, req, table, parent, child, promoted),
            Msg::DeleteVolume { req, table, owner, drop_table, .. } => {
                self.entries.remove(&owner);
                self.retired.insert(owner);
                let mut tasks: Vec<Task> =
                    self.led_slots(table).into_iter().map(|slot| Task::Collect { slot, from: owner, to: None, replicate: true }).collect();
                let track = track_key(table).slot();
                if drop_table && self.is_primary(track) {
                    tasks.push(Task::Collect { slot: track, from: 0, to: None, replicate: true });
                }
                self.start_tasks(Some((from, req)), tasks, true);
            }
            Msg::ListObjects { req, epoch, after } => self.on_list(from, req, epoch, after),
            Msg::SlotVersions { req, epoch, slot } => {
                if let Err(e) = self.check_epoch(epoch).and_then(|_| self.check_sender_is_primary(from, slot)) {
                    return self.reply((from, req), Err(e));
                }
                let lo = ObjKey { table: slot.table, objno: slot.objno, owner: 0 };
                let hi = ObjKey { table: slot.table, objno: slot.objno, owner: VolId::MAX };
                let objects = self.objects.range(lo..=hi).map(|(k, v)| (*k, *v)).collect();
                self.reply((from, req), Ok(ReplyBody::Objects { objects, tracks: vec![], retired: vec![], more: false }));
            }
            Msg::RepCollect { req, epoch, slot, from: gone, to } => {
                if let Err(e) = self.check_epoch(epoch).and_then(|_| self.check_sender_is_primary(from, slot)) {
                    return self.reply((from, req), Err(e));
                }
                // After the collect we hold no copy of `gone`, as the primary: a pull of it
                // answering later must not bring it back. Whether `to` is current here is known
                // only when the collect runs (`run_task`): it is if the collect moves our copy
                // of `gone` into it, not when we hold no copy to move (then the primary's `to`,
                // listed and pulled, must still be installed: sim seed 17).
                if let Some(r) = &mut self.recovery {
                    let key = ObjKey { table: slot.table, objno: slot.objno, owner: gone };
                    r.touched.insert(key);
                    r.stale.remove(&key);
                }
                self.start_tasks(Some((from, req)), vec![Task::Collect { slot, from: gone, to, replicate: false }], false);
            }
            Msg::RepSync { req, epoch, key, .. } => {
                if let Err(e) = self.check_epoch(epoch).and_then(|_| self.check_sender_is_primary(from, key.slot())) {
                    return self.reply((from, req), Err(e));
                }
                if self.lock_or_queue(key.slot(), Queued::Msg(from, msg.clone())) {
                    self.on_msg_locked(from, msg);
                }
            }
            Msg::RepDelete { req, epoch, key } => {
                if let Err(e) = self.check_epoch(epoch).and_then(|_| self.check_sender_is_primary(from, key.slot())) {
                    return self.reply((from, req), Err(e));
                }
                if let Some(r) = &mut self.recovery {
                    r.touched.insert(key);
                    r.stale.remove(&key);
                }
                self.start_tasks(Some((from, req)), vec![Task::Delete(key)], false);
            }
            Msg::Ping { req } => self.reply((from, req), Ok(ReplyBody::Done)),
            Msg::Recovered { .. } | Msg::Register { .. } => {}
        }
    }

    fn check_sender_is_primary(&self, from: Peer, slot: Slot) -> Result<(), IoErr> {
        match (from, self.map.as_ref().and_then(|m| m.primary(slot))) {
            (Peer::Shard(s), Some(p)) if s == p => Ok(()),
            _ => Err(IoErr::NotPrimary),
        }
    }

    fn validate_io(&self, epoch: Epoch, vol: &VolRef, objno: u64, op: &IoOp) -> Result<(), IoErr> {
        self.check_epoch(epoch)?;
        if !self.is_primary(Slot { table: vol.table, objno }) {
            return Err(IoErr::NotPrimary);
        }
        if vol.object_size_bytes == 0 || vol.object_size_bytes > MAX_OBJECT_SIZE_BYTES {
            return Err(IoErr::BadRequest(format!("object size {} out of range", vol.object_size_bytes)));
        }
        if objno == TRACK_OBJNO {
            return Err(IoErr::BadRequest("the tracking object is not addressable by clients".into()));
        }
        if self.retired.contains(&vol.id) {
            return Err(IoErr::WriteRefused(format!("volume {} was deleted or collapsed away", vol.id)));
        }
        let (offset, len) = match op {
            IoOp::Read { offset, len } | IoOp::Zero { offset, len } => (*offset, *len),
            IoOp::Write { offset, data } => (*offset, data.len() as u32),
        };
        if offset as u64 + len as u64 > vol.object_size_bytes as u64 {
            return Err(IoErr::BadRequest(format!(
                "range {offset}+{len} exceeds object size {}",
                vol.object_size_bytes
            )));
        }
        Ok(())
    }

    /// Runs a message that needs the slot lock, which the caller holds.
    fn on_msg_locked(&mut self, from: Peer, msg: Msg) {
        let primary_slot = match &msg {
            Msg::Io { vol, objno, .. } => Some(Slot { table: vol.table, objno: *objno }),
            Msg::Permission { table, .. } | Msg::Super { table, .. } | Msg::Collapse { table, .. } | Msg::EndSuper { table, .. } => {
                Some(track_key(*table).slot())
            }
            Msg::Pull { key, .. } => Some(key.slot()),
            _ => None,
        };
        if let Some(slot) = primary_slot {
            if self.is_primary(slot) && !self.synced.contains(&slot) {
                // First operation on this slot since the map changed: make the replicas' copies
                // equal to ours first, then run the operation (it waits at the head of the queue).
                self.locks.get_mut(&slot).expect("slot is locked").push_front(Queued::Msg(from, msg));
                return self.start_sync(slot);
            }
        }
        match msg {
            Msg::Io { req, epoch, vol, objno, op } => {
                let slot = Slot { table: vol.table, objno };
                // Re-check: the map may have changed while the message was queued.
                if let Err(e) = self.validate_io(epoch, &vol, objno, &op) {
                    self.reply((from, req), Err(e));
                    return self.unlock(slot);
                }
                match op {
                    IoOp::Read { offset, len } => self.start_read(from, req, &vol, objno, offset, len),
                    op => self.start_write(from, req, vol, objno, op),
                }
            }
            Msg::Rep { req, epoch, key, prev_version, version, op, cow_from } => {
                if let Err(e) = self.check_epoch(epoch).and_then(|_| self.check_sender_is_primary(from, key.slot())) {
                    self.reply((from, req), Err(e));
                    return self.unlock(key.slot());
                }
                if self.retired.contains(&key.owner) {
                    self.reply((from, req), Err(IoErr::WriteRefused(format!("volume {} was deleted or collapsed away", key.owner))));
                    return self.unlock(key.slot());
                }
                let local = self.objects.get(&key).copied().unwrap_or_default();
                if local == version {
                    self.reply((from, req), Ok(ReplyBody::Done));
                    return self.unlock(key.slot());
                }
                let whole = matches!(op, RepOp::Put { .. });
                let cow_ok = cow_from.is_none_or(|(p, v)| self.objects.get(&with_owner(key, p)) == Some(&v));
                if !whole && (local != prev_version || !cow_ok) {
                    if let Some(r) = &mut self.recovery {
                        r.touched.remove(&key);
                        r.stale.insert(key);
                    }
                    self.reply((from, req), Ok(ReplyBody::NeedFull));
                    return self.unlock(key.slot());
                }
                if let Some(r) = &mut self.recovery {
                    r.touched.insert(key);
                    r.stale.remove(&key);
                }
                let track = match (&op, key.objno) {
                    (RepOp::Put { data }, TRACK_OBJNO) => postcard::from_bytes(data).ok(),
                    _ => None,
                };
                let op_id = self.new_op(Some(key.slot()), Kind::Replica { reply_to: (from, req), key, version, track });
                let cow_from = if whole { None } else { cow_from.map(|(p, _)| with_owner(key, p)) };
                self.disk(op_id, DiskCmd::Apply { key, version, op, cow_from });
            }
            Msg::RepSync { req, epoch, key, version, data } => {
                if let Err(e) = self.check_epoch(epoch).and_then(|_| self.check_sender_is_primary(from, key.slot())) {
                    self.reply((from, req), Err(e));
                    return self.unlock(key.slot());
                }
                if let Some(r) = &mut self.recovery {
                    r.touched.insert(key);
                    r.stale.remove(&key);
                }
                let track = if key.objno == TRACK_OBJNO { postcard::from_bytes(&data).ok() } else { None };
                let op_id = self.new_op(Some(key.slot()), Kind::Replica { reply_to: (from, req), key, version, track });
                self.disk(op_id, DiskCmd::Apply { key, version, op: RepOp::Put { data }, cow_from: None });
            }
            Msg::Pull { req, key, epoch } => {
                let slot = key.slot();
                if let Err(e) = self.check_epoch(epoch).and_then(|_| self.check_primary(slot)) {
                    self.reply((from, req), Err(e));
                    return self.unlock(slot);
                }
                match self.objects.get(&key).copied() {
                    None => {
                        self.reply((from, req), Ok(ReplyBody::Object { version: Version::default(), data: vec![] }));
                        self.unlock(slot);
                    }
                    Some(version) => {
                        let op = self.new_op(Some(slot), Kind::Read { reply_to: (from, req), pull_of: Some((key, version)), body: None });
                        self.disk(op, DiskCmd::ReadAll { key });
                    }
                }
            }
            Msg::Permission { req, epoch, table, .. }
            | Msg::Super { req, epoch, table, .. }
            | Msg::Collapse { req, epoch, table, .. }
            | Msg::EndSuper { req, epoch, table, .. }
                if self.check_epoch(epoch).and_then(|_| self.check_primary(track_key(table).slot())).is_err() =>
            {
                // The map changed while this waited for the lock: the sender retries elsewhere.
                let e = self.check_epoch(epoch).and_then(|_| self.check_primary(track_key(table).slot())).unwrap_err();
                self.reply((from, req), Err(e));
                self.unlock(track_key(table).slot())
            }
            Msg::Permission { req, table, parent, .. } => self.on_permission(from, req, table, parent),
            Msg::Super { req, table, parent, child, .. } => self.on_super(from, req, table, parent, child),
            Msg::Collapse { req, table, child, .. } => self.on_collapse(from, req, table, child),
            Msg::EndSuper { req, table, child, .. } => self.on_end_super(from, req, table, child),
            other => unreachable!("not a slot-locked message: {other:?}"),
        }
    }

    // ---- slot synchronisation by a new primary -----------------------------------------------

    /// Asks every live replica for its versions of the slot's objects; differing copies are
    /// replaced by ours and extra ones deleted (they can only be unacknowledged writes: every
    /// acknowledged write is on every live replica, us included).
    fn start_sync(&mut self, slot: Slot) {
        let op = self.new_op(Some(slot), Kind::SlotSync { epoch: self.epoch(), reads: HashMap::default() });
        for r in self.live_replicas(slot) {
            self.wait_on(op, Target::Shard(r), Msg::SlotVersions { req: 0, epoch: self.epoch(), slot });
        }
        self.advance(op);
    }

    fn on_slot_versions(&mut self, op_id: OpId, replica: ShardId, theirs: Vec<(ObjKey, Version)>) {
        let Some(slot) = self.ops.get(&op_id).and_then(|o| o.slot) else { return };
        let lo = ObjKey { table: slot.table, objno: slot.objno, owner: 0 };
        let hi = ObjKey { table: slot.table, objno: slot.objno, owner: VolId::MAX };
        // Objects of retired volumes too: the replica must hold what we hold when our garbage
        // collection of the slot, which follows, replicates to it.
        let ours: BTreeMap<ObjKey, Version> = self.objects.range(lo..=hi).map(|(k, v)| (*k, *v)).collect();
        let theirs: BTreeMap<ObjKey, Version> = theirs.into_iter().filter(|(k, _)| k.slot() == slot).collect();
        for (k, v) in &ours {
            if theirs.get(k) != Some(v) {
                let id = self.fresh_id();
                self.disk_owner.insert(id, op_id);
                let op = self.ops.get_mut(&op_id).unwrap();
                op.disk.insert(id);
                if let Kind::SlotSync { reads, .. } = &mut op.kind {
                    reads.insert(id, (replica, *k, *v));
                }
                self.out.push(Output::Disk { id, cmd: DiskCmd::ReadAll { key: *k } });
            }
        }
        for k in theirs.keys().filter(|k| !ours.contains_key(k)) {
            self.wait_on(op_id, Target::Shard(replica), Msg::RepDelete { req: 0, epoch: self.epoch(), key: *k });
        }
    }

    // ---- client I/O at the primary ------------------------------------------------------------

    fn start_read(&mut self, from: Peer, req: ReqId, vol: &VolRef, objno: u64, offset: u32, len: u32) {
        let slot = Slot { table: vol.table, objno };
        let own = ObjKey { table: vol.table, objno, owner: vol.id };
        // A child reads its own copy, else falls through to the parent's (§4.2).
        let key = if self.objects.contains_key(&own) {
            Some(own)
        } else {
            vol.parent.map(|p| with_owner(own, p)).filter(|k| self.objects.contains_key(k))
        };
        match key {
            None => {
                self.reply((from, req), Ok(ReplyBody::Data(vec![0; len as usize])));
                self.unlock(slot);
            }
            Some(key) => {
                let op = self.new_op(Some(slot), Kind::Read { reply_to: (from, req), pull_of: None, body: None });
                self.disk(op, DiskCmd::Read { key, offset, len });
            }
        }
    }

    fn start_write(&mut self, from: Peer, req: ReqId, vol: VolRef, objno: u64, op: IoOp) {
        let slot = Slot { table: vol.table, objno };
        // Look the volume up whatever the client says of its parent: a client that opened a child
        // before it was promoted still names the old parent, and the promoted child may have a
        // super child of its own by now.
        let entry = self.entries.get(&vol.id).copied();
        let vol_id = vol.id;
        let op_id = self.new_op(
            Some(slot),
            Kind::Write {
                reply_to: (from, req),
                vol,
                objno,
                op,
                waiting_permission: false,
                started: None,
                need_full: vec![],
                reading_full: false,
            },
        );
        match entry {
            Some(TrackEntry::Fenced { .. }) => {
                self.fail(op_id, IoErr::WriteRefused("the volume's super child was promoted; this volume is fenced".into()));
            }
            Some(TrackEntry::Tracked { table, .. }) => {
                // First parent write on this shard since super: ask the tracking shard (§4.3).
                if let Some(Kind::Write { waiting_permission, .. }) = self.ops.get_mut(&op_id).map(|o| &mut o.kind) {
                    *waiting_permission = true;
                }
                match self.permissions.get_mut(&vol_id) {
                    Some(p) => p.waiters.push(op_id),
                    None => {
                        self.permissions.insert(vol_id, PermissionState { table, waiters: vec![op_id] });
                        let msg = Msg::Permission { req: 0, epoch: self.epoch(), table, parent: vol_id };
                        self.send_request(Target::TrackingPrimary(table), msg, Owner::Permission(vol_id));
                    }
                }
            }
            _ => self.issue_write(op_id),
        }
    }

    fn issue_write(&mut self, op_id: OpId) {
        let epoch = self.epoch();
        let Some(Op { kind: Kind::Write { vol, objno, op, started, .. }, .. }) = self.ops.get_mut(&op_id) else { return };
        let key = ObjKey { table: vol.table, objno: *objno, owner: vol.id };
        let object_size = vol.object_size_bytes;
        let rep_op = match std::mem::replace(op, IoOp::Zero { offset: 0, len: 0 }) {
            IoOp::Write { offset: 0, data } if data.len() as u32 == object_size => RepOp::Put { data },
            IoOp::Zero { offset: 0, len } if len == object_size => RepOp::Put { data: vec![] },
            IoOp::Write { offset, data } => RepOp::Write { offset, data },
            IoOp::Zero { offset, len } => RepOp::Zero { offset, len },
            IoOp::Read { .. } => unreachable!(),
        };
        let parent = vol.parent;
        let zeroing = matches!(&rep_op, RepOp::Zero { .. }) || matches!(&rep_op, RepOp::Put { data } if data.is_empty());
        let nothing_below = parent.is_none_or(|p| !self.objects.contains_key(&with_owner(key, p)));
        if zeroing && !self.objects.contains_key(&key) && nothing_below {
            // Zeroing an object that does not exist (trim of a fresh volume, mkfs discards):
            // it already reads as zeroes, so no object is created anywhere.
            return self.advance(op_id);
        }
        let prev = self.objects.get(&key).copied().unwrap_or_default();
        let version = Version { epoch, seq: prev.seq + 1 };
        *started = Some((key, version));
        // Copy-on-write only for a partial write of a child object not yet copied.
        let cow_from = match (parent, &rep_op) {
            (Some(p), RepOp::Write { .. } | RepOp::Zero { .. }) if !self.objects.contains_key(&key) => {
                self.objects.get(&with_owner(key, p)).map(|v| (p, *v))
            }
            _ => None,
        };
        for r in self.live_replicas(key.slot()) {
            let msg = Msg::Rep { req: 0, epoch, key, prev_version: prev, version, op: rep_op.clone(), cow_from };
            self.wait_on(op_id, Target::Shard(r), msg);
        }
        self.disk(op_id, DiskCmd::Apply { key, version, op: rep_op, cow_from: cow_from.map(|(p, _)| with_owner(key, p)) });
    }

    // ---- tracking shard -----------------------------------------------------------------------

    fn table_track_or_default(&self, table: TableId) -> TableTrack {
        self.tracks.get(&table).cloned().unwrap_or_default()
    }

    /// Persists and replicates a new tracking object, then replies (and broadcasts).
    fn update_track(
        &mut self,
        reply_to: (Peer, ReqId),
        table: TableId,
        new: TableTrack,
        reply: ReplyBody,
        broadcast: Option<(VolId, TrackEntry)>,
    ) {
        let key = track_key(table);
        let prev = self.objects.get(&key).copied().unwrap_or_default();
        let version = Version { epoch: self.epoch(), seq: prev.seq + 1 };
        let data = postcard::to_allocvec(&new).expect("tracking object encodes");
        let op_id = self.new_op(Some(key.slot()), Kind::TrackUpdate { reply_to, key, version, new, reply, broadcast });
        for r in self.live_replicas(key.slot()) {
            let msg = Msg::Rep {
                req: 0,
                epoch: self.epoch(),
                key,
                prev_version: prev,
                version,
                op: RepOp::Put { data: data.clone() },
                cow_from: None,
            };
            self.wait_on(op_id, Target::Shard(r), msg);
        }
        if let Some((parent, entry)) = broadcast {
            self.broadcast_track(op_id, parent, entry);
        }
        self.disk(op_id, DiskCmd::Apply { key, version, op: RepOp::Put { data }, cow_from: None });
    }

    /// Tells every shard not down (and ourselves) to track `parent`; `super` returns only when
    /// all of them, at one epoch, have saved it.
    fn broadcast_track(&mut self, op_id: OpId, parent: VolId, entry: TrackEntry) {
        self.set_entry(parent, entry);
        let save = self.new_op(None, Kind::SaveEntries { reply_to: None, parent: None });
        self.save_state(save);
        let others: Vec<ShardId> = self
            .map
            .as_ref()
            .map(|m| m.shards.iter().filter(|s| s.state != ShardState::Down && s.id != self.cfg.id).map(|s| s.id).collect())
            .unwrap_or_default();
        for s in others {
            let msg = Msg::Track { req: 0, epoch: self.epoch(), parent, entry };
            self.wait_on(op_id, Target::Shard(s), msg);
        }
    }

    fn on_permission(&mut self, from: Peer, req: ReqId, table: TableId, parent: VolId) {
        let mut t = self.table_track_or_default(table);
        let slot = track_key(table).slot();
        if t.fenced_parents.contains(&parent) {
            self.reply((from, req), Ok(ReplyBody::Granted(false)));
            return self.unlock(slot);
        }
        match &mut t.current {
            Some(cur) if cur.parent == parent && cur.phase == Phase::Superposed => {
                if !cur.allow_write {
                    self.reply((from, req), Ok(ReplyBody::Granted(false)));
                    self.unlock(slot)
                } else if cur.dirty {
                    self.reply((from, req), Ok(ReplyBody::Granted(true)));
                    self.unlock(slot)
                } else {
                    cur.dirty = true;
                    self.update_track((from, req), table, t, ReplyBody::Granted(true), None);
                }
            }
            Some(cur) if cur.parent == parent && cur.phase == Phase::Promoted => {
                self.reply((from, req), Ok(ReplyBody::Granted(false)));
                self.unlock(slot)
            }
            _ => {
                // Not (or no longer) tracked: an aborted super leaves the parent writable.
                self.reply((from, req), Ok(ReplyBody::Granted(true)));
                self.unlock(slot)
            }
        }
    }

    fn on_super(&mut self, from: Peer, req: ReqId, table: TableId, parent: VolId, child: VolId) {
        let mut t = self.table_track_or_default(table);
        let slot = track_key(table).slot();
        match &t.current {
            Some(cur) if cur.child == child && cur.parent == parent && cur.phase == Phase::Superposed => {
                // A retried super: broadcast again so every shard surely tracks the parent.
                let (p, e) = (parent, TrackEntry::Tracked { table, child });
                return self.update_track((from, req), table, t, ReplyBody::Done, Some((p, e)));
            }
            Some(cur) if cur.child == child && cur.parent == parent => {
                // Super again for a child whose collapse was decided: the metadata service lost
                // the answer (it restarted); tell it the outcome, changing nothing.
                let outcome = if cur.phase == Phase::Promoted { CollapseOutcome::Promoted } else { CollapseOutcome::Rejected };
                self.reply((from, req), Ok(ReplyBody::Collapse(outcome)));
                return self.unlock(slot);
            }
            Some(cur) => {
                let msg = format!("volume already has a super child {} (phase {:?}); collapse it first", cur.child, cur.phase);
                self.reply((from, req), Err(IoErr::BadRequest(msg)));
                return self.unlock(slot);
            }
            None if t.fenced_parents.contains(&parent) => {
                self.reply((from, req), Err(IoErr::BadRequest("volume was fenced by an earlier collapse".into())));
                return self.unlock(slot);
            }
            None => {}
        }
        t.current = Some(TrackState { parent, child, dirty: false, allow_write: true, phase: Phase::Superposed });
        self.update_track((from, req), table, t, ReplyBody::Done, Some((parent, TrackEntry::Tracked { table, child })));
    }

    fn on_collapse(&mut self, from: Peer, req: ReqId, table: TableId, child: VolId) {
        let mut t = self.table_track_or_default(table);
        let slot = track_key(table).slot();
        let Some(cur) = t.current.as_mut().filter(|c| c.child == child) else {
            self.reply((from, req), Err(IoErr::CollapseRefused(format!("volume {child} is not a super child"))));
            return self.unlock(slot);
        };
        let outcome = match cur.phase {
            Phase::Promoted => Some(CollapseOutcome::Promoted),
            Phase::Aborted => Some(CollapseOutcome::Rejected),
            Phase::Superposed => None,
        };
        if let Some(outcome) = outcome {
            self.reply((from, req), Ok(ReplyBody::Collapse(outcome)));
            return self.unlock(slot);
        }
        // The atomic step of collapse: one check-and-set on the tracking object (§4.3).
        let outcome = if cur.dirty {
            cur.phase = Phase::Aborted;
            CollapseOutcome::Rejected
        } else {
            cur.allow_write = false;
            cur.phase = Phase::Promoted;
            let parent = cur.parent;
            t.fenced_parents.push(parent);
            CollapseOutcome::Promoted
        };
        self.update_track((from, req), table, t, ReplyBody::Collapse(outcome), None);
    }

    fn on_end_super(&mut self, from: Peer, req: ReqId, table: TableId, child: VolId) {
        let mut t = self.table_track_or_default(table);
        let slot = track_key(table).slot();
        match &t.current {
            Some(cur) if cur.child == child && cur.phase != Phase::Superposed => {
                t.current = None;
                self.update_track((from, req), table, t, ReplyBody::Done, None);
            }
            Some(cur) if cur.child == child => {
                self.reply((from, req), Err(IoErr::BadRequest("super not collapsed yet".into())));
                self.unlock(slot)
            }
            _ => {
                self.reply((from, req), Ok(ReplyBody::Done));
                self.unlock(slot)
            }
        }
    }

    // ---- data shard tracking list -------------------------------------------------------------

    fn set_entry(&mut self, parent: VolId, entry: TrackEntry) {
        // Fenced is final: a late or repeated message never unfences a parent.
        let old = self.entries.get(&parent).copied();
        if !matches!(old, Some(TrackEntry::Fenced { .. })) {
            self.entries.insert(parent, entry);
            if let TrackEntry::Tracked { table, .. } = entry {
                if old != Some(entry) {
                    // A new super child: its copy-on-write burst is coming.
                    let id = self.fresh_id();
                    self.out.push(Output::Disk { id, cmd: DiskCmd::Prestock { table, parent } });
                }
            }
        }
    }

    fn save_state(&mut self, op: OpId) {
        self.state_seq += 1;
        let mut entries: Vec<(VolId, TrackEntry)> = self.entries.iter().map(|(k, v)| (*k, *v)).collect();
        entries.sort_by_key(|e| e.0);
        let mut retired: Vec<VolId> = self.retired.iter().copied().collect();
        retired.sort_unstable();
        let bytes = postcard::to_allocvec(&SavedState { entries, retired }).expect("state encodes");
        self.disk(op, DiskCmd::SaveState { seq: self.state_seq, bytes });
    }

    fn on_permission_reply(&mut self, parent: VolId, result: Result<ReplyBody, IoErr>) -> bool {
        let granted = match result {
            Ok(ReplyBody::Granted(g)) => g,
            _ => return false, // retried on the next tick
        };
        let Some(p) = self.permissions.remove(&parent) else { return true };
        let child = match self.entries.get(&parent) {
            Some(TrackEntry::Tracked { child, .. } | TrackEntry::Granted { child, .. } | TrackEntry::Fenced { child, .. }) => *child,
            None => 0,
        };
        if granted {
            self.set_entry(parent, TrackEntry::Granted { table: p.table, child });
            for w in p.waiters {
                self.resume_write(w);
            }
        } else {
            self.set_entry(parent, TrackEntry::Fenced { table: p.table, child });
            let op = self.new_op(None, Kind::SaveEntries { reply_to: None, parent: None });
            self.save_state(op);
            for w in p.waiters {
                self.fail(w, IoErr::WriteRefused("the volume's super child was promoted; this volume is fenced".into()));
            }
        }
        true
    }

    fn resume_write(&mut self, op_id: OpId) {
        if let Some(Op { kind: Kind::Write { waiting_permission, .. }, err, .. }) = self.ops.get_mut(&op_id) {
            *waiting_permission = false;
            if err.is_some() {
                return self.advance(op_id);
            }
            self.issue_write(op_id);
        }
    }

    // ---- GC, delete, tasks --------------------------------------------------------------------

    fn on_gc(&mut self, from: Peer, req: ReqId, table: TableId, parent: VolId, child: VolId, promoted: bool) {
        let (gone, heir) = if promoted {
            self.set_entry(parent, TrackEntry::Fenced { table, child });
            (parent, Some(child))
        } else {
            if matches!(self.entries.get(&parent), Some(TrackEntry::Tracked { child: c, .. } | TrackEntry::Granted { child: c, .. }) if *c == child)
            {
                self.entries.remove(&parent);
            }
            (child, None)
        };
        self.retired.insert(gone);
        // Only slots that may hold an object of the loser: one here, a write in progress (it
        // holds the lock), or replicas not made equal to ours since the map changed (a replica
        // may hold one we do not). A rejected child that wrote little costs little to collect.
        let tasks = self
            .led_slots(table)
            .into_iter()
            .filter(|s| {
                !self.synced.contains(s) || self.locks.contains_key(s) || self.objects.contains_key(&ObjKey { table: s.table, objno: s.objno, owner: gone })
            })
            .map(|slot| Task::Collect { slot, from: gone, to: heir, replicate: true })
            .collect();
        self.start_tasks(Some((from, req)), tasks, true);
    }

    /// Slots of `table` we lead that may hold objects: those with objects here, and those a
    /// write in progress (holding the slot's lock) may be filling. Tasks look again when they
    /// run, under the lock.
    fn led_slots(&self, table: TableId) -> BTreeSet<Slot> {
        let stored = self.objects.keys().filter(|k| k.table == table && k.objno != TRACK_OBJNO).map(|k| k.slot());
        let writing = self.locks.keys().filter(|s| s.table == table).copied();
        stored.chain(writing).filter(|s| self.is_primary(*s)).collect()
    }

    /// Starts `tasks`. With `save_entries` (garbage collection and volume deletion, which a
    /// primary starts for many slots at once) the tracking list is saved too, and the tasks run
    /// within the background budget; the rest (a replica's share of a primary's task, recovery,
    /// which has its own bound) start at once — a replica never waits for budget, or two
    /// primaries waiting on each other's replicas could deadlock.
    fn start_tasks(&mut self, reply_to: Option<(Peer, ReqId)>, tasks: Vec<Task>, save_entries: bool) -> OpId {
        let for_recovery = reply_to.is_none() && !save_entries;
        if for_recovery {
            if let Some(r) = &mut self.recovery {
                r.tasks_in_flight += 1;
            }
        }
        let budgeted = save_entries;
        let parent = self.new_op(None, Kind::Tasks { reply_to, remaining: tasks.len() + save_entries as usize, for_recovery, budgeted });
        if save_entries {
            let save = self.new_op(None, Kind::SaveEntries { reply_to: None, parent: Some(parent) });
            self.save_state(save);
        }
        for task in tasks {
            if budgeted {
                self.background.push_back((parent, task));
            } else {
                self.lock_and_run(parent, task);
            }
        }
        self.pump_background();
        self.advance(parent);
        parent
    }

    fn lock_and_run(&mut self, parent: OpId, task: Task) {
        let slot = match &task {
            Task::Delete(k) | Task::Install { key: k, .. } => k.slot(),
            Task::Collect { slot, .. } => *slot,
        };
        if self.lock_or_queue(slot, Queued::Task(parent, task.clone())) {
            self.run_task(parent, task);
        }
    }

    /// Starts waiting background tasks while the budget allows.
    fn pump_background(&mut self) {
        while self.background_running < self.cfg.max_background_tasks.max(1) {
            let Some((parent, task)) = self.background.pop_front() else { return };
            self.background_running += 1;
            self.lock_and_run(parent, task);
        }
    }

    /// A slot task of `parent` ended: frees its budget if it had one.
    fn task_finished(&mut self, parent: OpId) {
        if let Some(Op { kind: Kind::Tasks { budgeted: true, .. }, .. }) = self.ops.get(&parent) {
            self.background_running = self.background_running.saturating_sub(1);
        }
        self.child_task_finished(parent);
        self.pump_background();
    }

    /// Runs one task with its slot lock held.
    fn run_task(&mut self, parent: OpId, task: Task) {
        let (slot, cmd) = match &task {
            Task::Delete(k) => {
                if !self.objects.contains_key(k) {
                    return self.task_done(parent, k.slot());
                }
                (k.slot(), DiskCmd::Delete { key: *k })
            }
            Task::Collect { slot, from, to, replicate } => {
                let (slot, from, to, replicate) = (*slot, *from, *to, *replicate);
                if replicate && !self.is_primary(slot) {
                    // The slot's primary changed: the collection at the new epoch does it.
                    return self.task_done(parent, slot);
                }
                if replicate && !self.synced.contains(&slot) {
                    self.locks.get_mut(&slot).expect("slot is locked").push_front(Queued::Task(parent, task));
                    return self.start_sync(slot);
                }
                let key = ObjKey { table: slot.table, objno: slot.objno, owner: from };
                let cmd = match to.map(|t| with_owner(key, t)) {
                    _ if !self.objects.contains_key(&key) => None,
                    Some(heir) if !self.objects.contains_key(&heir) => Some(DiskCmd::Rename { from: key, to: heir }),
                    _ => Some(DiskCmd::Delete { key }),
                };
                if let (Some(DiskCmd::Rename { to: heir, .. }), Some(r)) = (&cmd, &mut self.recovery) {
                    // The primary's collect moves our copy into the heir, as it did its own:
                    // a replicated write to the heir, current as the copy moved was.
                    r.touched.insert(*heir);
                    r.stale.remove(heir);
                }
                // Nothing of `from` here, in a slot whose replicas were made equal to ours (the
                // check above): every change since flowed through us, so they hold none either.
                if cmd.is_none() {
                    return self.task_done(parent, slot);
                }
                let replicas = if replicate { self.live_replicas(slot) } else { vec![] };
                let op = self.new_op(Some(slot), Kind::Task { parent, task: task.clone() });
                for r in replicas {
                    self.wait_on(op, Target::Shard(r), Msg::RepCollect { req: 0, epoch: self.epoch(), slot, from, to });
                }
                if let Some(cmd) = cmd {
                    self.disk(op, cmd);
                }
                return self.advance(op);
            }
            Task::Install { key, version, data } => {
                if let Some(r) = self.recovery.as_mut().filter(|r| r.touched.contains(key)) {
                    r.stale.remove(key);
                    // A replicated write reached this slot after we listed it: it is current.
                    return self.task_done(parent, key.slot());
                }
                if let Some(r) = &mut self.recovery {
                    r.stale.remove(key);
                }
                // A volume retired while we pulled (collapsed away, deleted) is not reinstalled.
                let version = if self.retired.contains(&key.owner) { &Version::default() } else { version };
                let cmd = if *version == Version::default() {
                    if !self.objects.contains_key(key) {
                        return self.task_done(parent, key.slot());
                    }
                    DiskCmd::Delete { key: *key }
                } else {
                    DiskCmd::Apply { key: *key, version: *version, op: RepOp::Put { data: data.clone() }, cow_from: None }
                };
                (key.slot(), cmd)
            }
        };
        let op = self.new_op(Some(slot), Kind::Task { parent, task });
        self.disk(op, cmd);
    }

    fn task_done(&mut self, parent: OpId, slot: Slot) {
        self.unlock(slot);
        self.task_finished(parent);
    }

    fn child_task_finished(&mut self, parent: OpId) {
        if let Some(Op { kind: Kind::Tasks { remaining, .. }, .. }) = self.ops.get_mut(&parent) {
            *remaining -= 1;
        }
        self.advance(parent);
    }

    // ---- completions --------------------------------------------------------------------------

    fn on_disk(&mut self, id: u64, result: Result<DiskOut, DiskErr>) {
        let Some(op_id) = self.disk_owner.remove(&id) else { return };
        let Some(op) = self.ops.get_mut(&op_id) else { return };
        op.disk.remove(&id);
        let err = match &result {
            Ok(_) => None,
            Err(DiskErr::NoSpace) => Some(IoErr::NoSpace(self.cfg.id)),
            Err(DiskErr::Io(m)) => Some(IoErr::Io(format!("shard {}: {m}", self.cfg.id))),
        };
        if let Some(e) = err {
            op.err.get_or_insert(e);
        }
        let ok = result.is_ok();
        match &mut op.kind {
            Kind::Write { started: Some((key, version)), reading_full, .. } => {
                if *reading_full {
                    *reading_full = false;
                    if let Ok(DiskOut::Data(data)) = result {
                        let (key, version) = (*key, *version);
                        return self.send_full(op_id, key, version, data);
                    }
                } else if ok {
                    self.objects.insert(*key, *version);
                }
            }
            Kind::Replica { key, version, .. } | Kind::TrackUpdate { key, version, .. } if ok => {
                let (key, version) = (*key, *version);
                self.objects.insert(key, version);
                match &op.kind {
                    Kind::TrackUpdate { new, .. } | Kind::Replica { track: Some(new), .. } => {
                        self.tracks.insert(key.table, new.clone());
                    }
                    _ => {}
                }
            }
            Kind::Replica { .. } | Kind::TrackUpdate { .. } => {}
            Kind::Read { pull_of, body, .. } => {
                *body = match (result, *pull_of) {
                    (Ok(DiskOut::Data(data)), None) => Some(ReplyBody::Data(data)),
                    (Ok(DiskOut::Data(data)), Some((_, version))) => Some(ReplyBody::Object { version, data }),
                    _ => {
                        op.err.get_or_insert(IoErr::Io("disk returned no data".into()));
                        None
                    }
                };
            }
            Kind::SlotSync { reads, .. } => {
                if let (Some((replica, key, version)), Ok(DiskOut::Data(data))) = (reads.remove(&id), result) {
                    let msg = Msg::RepSync { req: 0, epoch: self.epoch(), key, version, data };
                    self.wait_on(op_id, Target::Shard(replica), msg);
                }
            }
            Kind::Task { task, .. } if ok => match task.clone() {
                Task::Delete(k) => {
                    self.objects.remove(&k);
                    if k.objno == TRACK_OBJNO {
                        self.tracks.remove(&k.table);
                    }
                }
                Task::Collect { slot, from, to, .. } => {
                    let key = ObjKey { table: slot.table, objno: slot.objno, owner: from };
                    if let Some(v) = self.objects.remove(&key) {
                        if let Some(heir) = to.map(|t| with_owner(key, t)) {
                            self.objects.entry(heir).or_insert(v);
                        }
                    }
                    if key.objno == TRACK_OBJNO {
                        self.tracks.remove(&key.table);
                    }
                }
                Task::Install { key, version, data } => {
                    if version == Version::default() || self.retired.contains(&key.owner) {
                        self.objects.remove(&key);
                    } else {
                        self.objects.insert(key, version);
                    }
                    if key.objno == TRACK_OBJNO {
                        match postcard::from_bytes::<TableTrack>(&data) {
                            Ok(t) if version != Version::default() => self.tracks.insert(key.table, t),
                            _ => self.tracks.remove(&key.table),
                        };
                    }
                }
            },
            _ => {}
        }
        self.advance(op_id);
    }

    fn on_reply(&mut self, req: ReqId, result: Result<ReplyBody, IoErr>) {
        let Some(o) = self.outstanding.get_mut(&req) else { return };
        if matches!(result, Err(IoErr::NotReady)) && matches!(o.owner, Owner::Op(_) | Owner::Recovery) {
            // The peer does not hold our map yet (a shard that just came back, or one the push
            // of a new map has not reached): it will within moments, so ask again after
            // RETRY_SOON_US rather than a whole resend period, which a write waits out.
            o.sent_us = self.now_us.saturating_sub(self.cfg.resend_after_us.saturating_sub(RETRY_SOON_US));
        }
        match o.owner {
            Owner::Permission(parent) => {
                if self.on_permission_reply(parent, result) {
                    self.outstanding.remove(&req);
                }
            }
            Owner::Recovery => {
                if result.as_ref().is_err_and(|e| e.is_retryable()) {
                    return; // resent on a later tick
                }
                let o = self.outstanding.remove(&req).unwrap();
                self.on_recovery_reply(o, result);
            }
            Owner::Op(op_id) => {
                if result.as_ref().is_err_and(|e| e.is_retryable()) {
                    return; // resent on a later tick
                }
                let o = self.outstanding.remove(&req).unwrap();
                let Some(op) = self.ops.get_mut(&op_id) else { return };
                op.waits.remove(&req);
                match result {
                    Ok(ReplyBody::NeedFull) => {
                        if let (Kind::Write { need_full, .. }, Target::Shard(s)) = (&mut op.kind, o.target) {
                            need_full.push(s);
                        }
                    }
                    Ok(ReplyBody::Objects { objects, .. }) => {
                        if let (Kind::SlotSync { .. }, Target::Shard(s)) = (&op.kind, o.target) {
                            self.on_slot_versions(op_id, s, objects);
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        op.err.get_or_insert(e);
                    }
                }
                self.advance(op_id);
            }
        }
    }

    /// Finishes an operation once nothing is pending.
    fn advance(&mut self, op_id: OpId) {
        let Some(op) = self.ops.get(&op_id) else { return };
        if !op.disk.is_empty() || !op.waits.is_empty() {
            return;
        }
        if let Kind::Write { waiting_permission: true, .. } = op.kind {
            return;
        }
        if let Kind::Write { need_full, started: Some((key, _)), .. } = &op.kind {
            if !need_full.is_empty() && op.err.is_none() {
                let key = *key;
                if let Some(Op { kind: Kind::Write { reading_full, .. }, .. }) = self.ops.get_mut(&op_id) {
                    *reading_full = true;
                }
                return self.disk(op_id, DiskCmd::ReadAll { key });
            }
        }
        if let Kind::Tasks { remaining, .. } = op.kind {
            if remaining > 0 {
                return;
            }
        }
        let op = self.ops.remove(&op_id).unwrap();
        let result = match op.err {
            Some(e) => Err(e),
            None => Ok(()),
        };
        match op.kind {
            Kind::Write { reply_to, .. } => self.reply(reply_to, result.map(|_| ReplyBody::Done)),
            Kind::Read { reply_to, body, .. } => self.reply(reply_to, result.map(|_| body.expect("read completed"))),
            Kind::SlotSync { epoch, .. } => {
                // On failure, or if the map changed meanwhile, the next operation syncs again.
                if let (Ok(()), Some(slot), true) = (&result, op.slot, epoch == self.epoch()) {
                    self.synced.insert(slot);
                }
            }
            Kind::Replica { reply_to, .. } => self.reply(reply_to, result.map(|_| ReplyBody::Done)),
            Kind::TrackUpdate { reply_to, reply, .. } => self.reply(reply_to, result.map(|_| reply)),
            Kind::SaveEntries { reply_to, parent } => {
                if let Some(r) = reply_to {
                    self.reply(r, result.map(|_| ReplyBody::Done));
                }
                if let Some(parent) = parent {
                    return self.child_task_finished(parent);
                }
            }
            Kind::Tasks { reply_to, for_recovery, .. } => {
                if let Some(r) = reply_to {
                    self.reply(r, result.map(|_| ReplyBody::Done));
                }
                if for_recovery {
                    if let Some(r) = &mut self.recovery {
                        r.tasks_in_flight = r.tasks_in_flight.saturating_sub(1);
                    }
                    self.recovery_step();
                }
            }
            Kind::Task { parent, .. } => {
                if let Some(slot) = op.slot {
                    self.unlock(slot);
                }
                return self.task_finished(parent);
            }
        }
        if let Some(slot) = op.slot {
            self.unlock(slot);
        }
    }

    fn fail(&mut self, op_id: OpId, e: IoErr) {
        if let Some(op) = self.ops.get_mut(&op_id) {
            op.err.get_or_insert(e);
            if let Kind::Write { waiting_permission, .. } = &mut op.kind {
                *waiting_permission = false;
            }
        }
        self.advance(op_id);
    }

    fn send_full(&mut self, op_id: OpId, key: ObjKey, version: Version, data: Vec<u8>) {
        let targets = match self.ops.get_mut(&op_id) {
            Some(Op { kind: Kind::Write { need_full, .. }, .. }) => std::mem::take(need_full),
            _ => return,
        };
        for s in targets {
            let msg = Msg::Rep {
                req: 0,
                epoch: self.epoch(),
                key,
                prev_version: Version::default(),
                version,
                op: RepOp::Put { data: data.clone() },
                cow_from: None,
            };
            self.wait_on(op_id, Target::Shard(s), msg);
        }
        self.advance(op_id);
    }

    // ---- map changes and ticks ----------------------------------------------------------------

    fn on_map(&mut self, map: ClusterMap) {
        if self.map.as_ref().is_some_and(|m| m.epoch >= map.epoch) {
            return;
        }
        let me = map.state(self.cfg.id);
        self.map = Some(map);
        self.synced.clear();
        // Stop waiting for shards now down; re-address everything else at the new epoch. The
        // operations that waited go on only after those whose slot we no longer lead are failed
        // (below): a write that waited only for replicas now down must not be acknowledged by
        // a shard that no longer leads its slot (the map of a restarted metadata service marks
        // every shard down; an acknowledgement then was lost when another in-sync replica led
        // the slot first — sim seed 22).
        let mut unblocked: Vec<OpId> = vec![];
        let reqs: Vec<ReqId> = self.outstanding.keys().copied().collect();
        for req in reqs {
            let epoch = self.epoch();
            let o = self.outstanding.get_mut(&req).unwrap();
            set_epoch(&mut o.msg, epoch);
            let (target, owner) = (o.target, o.owner);
            if self.resolve(target).is_none() {
                if let (Owner::Op(op), Target::Shard(_)) = (owner, target) {
                    self.outstanding.remove(&req);
                    if let Some(op) = self.ops.get_mut(&op) {
                        op.waits.remove(&req);
                    }
                    unblocked.push(op);
                }
                continue;
            }
            let msg = self.outstanding[&req].msg.clone();
            self.outstanding.get_mut(&req).unwrap().sent_us = self.now_us;
            self.transmit(target, &msg);
        }
        // A super in progress must be acknowledged by every live shard at one epoch: re-broadcast.
        let supers: Vec<(OpId, VolId, TrackEntry)> = self
            .ops
            .iter()
            .filter_map(|(id, o)| match &o.kind {
                Kind::TrackUpdate { broadcast: Some((p, e)), .. } => Some((*id, *p, *e)),
                _ => None,
            })
            .collect();
        for (op_id, parent, entry) in supers {
            let track_waits: Vec<ReqId> = self
                .outstanding
                .iter()
                .filter(|(_, o)| o.owner == Owner::Op(op_id) && matches!(o.msg, Msg::Track { .. }))
                .map(|(r, _)| *r)
                .collect();
            for r in track_waits {
                self.outstanding.remove(&r);
                if let Some(op) = self.ops.get_mut(&op_id) {
                    op.waits.remove(&r);
                }
            }
            self.broadcast_track(op_id, parent, entry);
        }
        // Writes whose slot we no longer lead fail; the client retries at the new primary.
        let lost: Vec<OpId> = self
            .ops
            .iter()
            .filter_map(|(id, o)| match (&o.kind, o.slot) {
                (
                    Kind::Write { .. }
                    | Kind::TrackUpdate { .. }
                    | Kind::SlotSync { .. }
                    | Kind::Task { task: Task::Collect { replicate: true, .. }, .. },
                    Some(slot),
                ) if !self.is_primary(slot) => Some(*id),
                _ => None,
            })
            .collect();
        for op_id in lost {
            let waits: Vec<ReqId> = self.ops[&op_id].waits.iter().copied().collect();
            for r in waits {
                self.outstanding.remove(&r);
            }
            let op = self.ops.get_mut(&op_id).unwrap();
            op.waits.clear();
            op.err.get_or_insert(IoErr::NotPrimary);
            if let Kind::Write { waiting_permission, need_full, .. } = &mut op.kind {
                *waiting_permission = false;
                need_full.clear();
            }
            // Copies a sync is reading for its replicas are not sent once read: the replicas
            // refuse a shard that no longer leads the slot (a retryable error, so the sync
            // waited for ever, holding the slot's lock: sim seed 373).
            if let Kind::SlotSync { reads, .. } = &mut op.kind {
                reads.clear();
            }
            for p in self.permissions.values_mut() {
                p.waiters.retain(|w| *w != op_id);
            }
            self.advance(op_id);
        }
        for op_id in unblocked {
            if self.ops.contains_key(&op_id) {
                self.advance(op_id);
            }
        }
        if me == ShardState::Recovering && self.recovery.as_ref().is_none_or(|r| r.epoch != self.epoch()) {
            self.start_recovery();
        }
        if me == ShardState::Up {
            self.recovery = None;
        }
    }

    fn on_tick(&mut self) {
        let due: Vec<ReqId> = self
            .outstanding
            .iter()
            .filter(|(_, o)| self.now_us.saturating_sub(o.sent_us) >= self.cfg.resend_after_us)
            .map(|(r, _)| *r)
            .collect();
        // Until the metadata service marks us up, repeat that recovery finished (it may be lost).
        if let (Some(r), Some(map)) = (&mut self.recovery, &self.map) {
            if r.reported && map.state(self.cfg.id) == ShardState::Recovering && map.epoch == r.epoch {
                if self.now_us.saturating_sub(r.reported_us) >= self.cfg.resend_after_us {
                    r.reported_us = self.now_us;
                    self.out.push(Output::Send { to: Peer::Meta, msg: Msg::Recovered { shard: self.cfg.id, epoch: r.epoch } });
                }
            }
        }
        for req in due {
            let o = self.outstanding.get_mut(&req).unwrap();
            o.sent_us = self.now_us;
            let (target, msg) = (o.target, o.msg.clone());
            self.transmit(target, &msg);
        }
    }

    // ---- recovery (re-replication) ------------------------------------------------------------

    fn start_recovery(&mut self) {
        let epoch = self.epoch();
        // Requests of an abandoned round: their replies must not count in the new one.
        self.outstanding.retain(|_, o| o.owner != Owner::Recovery);
        // Objects written here by their primary during the last round are current only if that
        // round ran at the epoch just before this one: with an epoch missed in between (say, we
        // were marked down, and missed writes, in a map we never saw) they may be stale, and
        // must be compared with the peers' lists like any other.
        let old_touched = self.recovery.take().filter(|r| r.epoch + 1 == epoch).map(|r| r.touched).unwrap_or_default();
        let peers: Vec<ShardId> = self
            .map
            .as_ref()
            .map(|m| m.shards.iter().filter(|s| s.state == ShardState::Up && s.id != self.cfg.id).map(|s| s.id).collect())
            .unwrap_or_default();
        // Our tracking list may be stale: rebuild it from the live shards' lists. With none up
        // (every shard was marked down: a restart of the metadata service, of the whole
        // cluster) ours may be the only copy, kept as objects are: clearing it unfenced
        // promoted parents and untracked superposed ones (sim seed 110).
        if !peers.is_empty() {
            self.entries.clear();
        }
        self.recovery = Some(Recovery {
            epoch,
            listing: peers.iter().map(|p| (*p, None)).collect(),
            peers: peers.iter().copied().collect(),
            touched: old_touched,
            ..Default::default()
        });
        for p in peers {
            self.send_request(Target::Shard(p), Msg::ListObjects { req: 0, epoch, after: None }, Owner::Recovery);
        }
        self.recovery_step();
    }

    fn on_list(&mut self, from: Peer, req: ReqId, epoch: Epoch, after: Option<ObjKey>) {
        if let Err(e) = self.check_epoch(epoch) {
            return self.reply((from, req), Err(e));
        }
        let Peer::Shard(asker) = from else {
            return self.reply((from, req), Err(IoErr::BadRequest("only shards list objects".into())));
        };
        let map = self.map.as_ref().unwrap();
        let mut objects = vec![];
        let mut more = false;
        let range = match after {
            Some(a) => self.objects.range((std::ops::Bound::Excluded(a), std::ops::Bound::Unbounded)),
            None => self.objects.range(..),
        };
        for (k, v) in range {
            if objects.len() >= self.cfg.list_page_objects {
                more = true;
                break;
            }
            let slot = k.slot();
            if map.primary(slot) == Some(self.cfg.id) && map.placement(slot).contains(&asker) {
                objects.push((*k, *v));
            }
        }
        let first = after.is_none();
        if first {
            // Mutations in flight may have started before the asker was a replica and so not
            // reach it: list them as changing, so it pulls them once they are done.
            let changing = Version { epoch: Epoch::MAX, seq: 0 };
            for o in self.ops.values() {
                let key = match &o.kind {
                    Kind::Write { started: Some((key, _)), .. } | Kind::TrackUpdate { key, .. } => *key,
                    _ => continue,
                };
                if map.placement(key.slot()).contains(&asker) {
                    objects.retain(|(k, _)| *k != key);
                    objects.push((key, changing));
                }
            }
        }
        let tracks = if first { self.entries.iter().map(|(k, v)| (*k, *v)).collect() } else { vec![] };
        let retired = if first { self.retired.iter().copied().collect() } else { vec![] };
        self.reply((from, req), Ok(ReplyBody::Objects { objects, tracks, retired, more }));
    }

    fn on_recovery_reply(&mut self, o: Outstanding, result: Result<ReplyBody, IoErr>) {
        let Some(r) = &mut self.recovery else { return };
        match (o.msg, result) {
            (Msg::ListObjects { epoch, .. }, Ok(ReplyBody::Objects { objects, tracks, retired, more })) if epoch == r.epoch => {
                let Target::Shard(peer) = o.target else { return };
                let last = objects.last().map(|(k, _)| *k);
                for (k, v) in objects {
                    r.listed.insert(k, (v, peer));
                }
                self.retired.extend(retired);
                for (parent, entry) in tracks {
                    let entry = match entry {
                        TrackEntry::Granted { table, child } => TrackEntry::Tracked { table, child },
                        e => e,
                    };
                    if !matches!(self.entries.get(&parent), Some(TrackEntry::Fenced { .. })) {
                        self.entries.insert(parent, entry);
                    }
                }
                let r = self.recovery.as_mut().unwrap();
                if more {
                    r.listing.insert(peer, last);
                    self.send_request(Target::Shard(peer), Msg::ListObjects { req: 0, epoch, after: last }, Owner::Recovery);
                } else {
                    r.listing.remove(&peer);
                    if r.listing.is_empty() {
                        self.plan_recovery();
                    }
                }
            }
            (Msg::Pull { key, epoch, .. }, Ok(ReplyBody::Object { version, data })) if epoch == r.epoch => {
                r.pulls_in_flight -= 1;
                self.start_tasks(None, vec![Task::Install { key, version, data }], false);
                self.recovery_step();
            }
            (Msg::Pull { epoch, .. }, _) if epoch == r.epoch => {
                // The object is unreadable at the primary; recovery restarts at the next map.
                r.pulls_in_flight -= 1;
                self.recovery_step();
            }
            _ => {}
        }
    }

    fn plan_recovery(&mut self) {
        let entries_op = self.new_op(None, Kind::SaveEntries { reply_to: None, parent: None });
        self.save_state(entries_op);
        let map = self.map.clone().unwrap();
        let r = self.recovery.as_mut().unwrap();
        for (k, (v, peer)) in &r.listed {
            if !r.touched.contains(k) && self.objects.get(k) != Some(v) {
                r.pulls.push_back((*k, *peer));
            }
        }
        // Objects here that their primary no longer has (deleted or collected while we were
        // away). Slots no listed peer leads are left alone: we may hold their only copy.
        let stale: Vec<ObjKey> = self
            .objects
            .keys()
            .filter(|k| {
                !r.listed.contains_key(k)
                    && !r.touched.contains(k)
                    && map.primary(k.slot()).is_some_and(|p| r.peers.contains(&p))
                    && map.placement(k.slot()).contains(&self.cfg.id)
            })
            .copied()
            .collect();
        if !stale.is_empty() {
            self.start_tasks(None, stale.into_iter().map(Task::Delete).collect(), false);
        }
        self.recovery_step();
    }

    fn recovery_step(&mut self) {
        let epoch = self.epoch();
        let Some(r) = &mut self.recovery else { return };
        if !r.listing.is_empty() || r.reported {
            return;
        }
        let mut to_send = vec![];
        while r.pulls_in_flight < self.cfg.max_pulls_in_flight {
            let Some((key, peer)) = r.pulls.pop_front() else { break };
            r.pulls_in_flight += 1;
            to_send.push((key, peer));
        }
        let idle = r.pulls.is_empty() && r.pulls_in_flight == 0 && r.tasks_in_flight == 0 && to_send.is_empty();
        if idle && !r.stale.is_empty() {
            // Copies a primary found different while we listed: fetch them whole.
            let map = self.map.as_ref().unwrap();
            for key in std::mem::take(&mut r.stale) {
                if let Some(p) = map.primary(key.slot()) {
                    r.pulls.push_back((key, p));
                }
            }
            return self.recovery_step();
        }
        let done = idle;
        if done {
            r.reported = true;
            r.reported_us = self.now_us;
            self.out.push(Output::Send { to: Peer::Meta, msg: Msg::Recovered { shard: self.cfg.id, epoch } });
        }
        for (key, peer) in to_send {
            self.send_request(Target::Shard(peer), Msg::Pull { req: 0, epoch, key }, Owner::Recovery);
        }
    }
}

/// Why `msg` is refused, if it names a volume as its own super child (`Track`, `Super`, `Gc`).
fn self_child(msg: &Msg) -> Option<String> {
    let (parent, child) = match *msg {
        Msg::Track { parent, entry: TrackEntry::Tracked { child, .. } | TrackEntry::Granted { child, .. } | TrackEntry::Fenced { child, .. }, .. } => (parent, child),
        Msg::Super { parent, child, .. } | Msg::Gc { parent, child, .. } => (parent, child),
        _ => return None,
    };
    (parent == child).then(|| format!("volume {parent} named as its own super child: a super child is a new volume"))
}

/// The request id of a request message (`None` for messages that are not requests).
pub fn request_id(m: &Msg) -> Option<ReqId> {
    Some(match m {
        Msg::Io { req, .. }
        | Msg::Rep { req, .. }
        | Msg::Permission { req, .. }
        | Msg::Super { req, .. }
        | Msg::Track { req, .. }
        | Msg::Collapse { req, .. }
        | Msg::EndSuper { req, .. }
        | Msg::Gc { req, .. }
        | Msg::DeleteVolume { req, .. }
        | Msg::ListObjects { req, .. }
        | Msg::SlotVersions { req, .. }
        | Msg::RepDelete { req, .. }
        | Msg::RepSync { req, .. }
        | Msg::RepCollect { req, .. }
        | Msg::Pull { req, .. }
        | Msg::Ping { req } => *req,
        Msg::Map(_) | Msg::Recovered { .. } | Msg::Register { .. } | Msg::Reply { .. } => return None,
    })
}


#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds one input (time does not matter here) and returns its outputs.
    fn run(core: &mut ShardCore, input: Input) -> Vec<Output> {
        core.handle(0, input);
        core.take_outputs()
    }

    fn prestocks(outs: &[Output]) -> Vec<DiskCmd> {
        outs.iter()
            .filter_map(|o| match o {
                Output::Disk { cmd: cmd @ DiskCmd::Prestock { .. }, .. } => Some(cmd.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_new_super_child_prestocks_slots_once_and_super_waits_only_for_the_tracking_list() {
        let mut core = ShardCore::new(ShardConfig::new(1), Boot::default());
        let map = ClusterMap {
            epoch: 1,
            replicas: 3,
            shards: (1..=4).map(|id| ShardInfo { id, addr: String::new(), state: ShardState::Up, in_sync: true }).collect(),
        };
        run(&mut core, Input::Msg { from: Peer::Meta, msg: Msg::Map(map) });
        let track = |req| Msg::Track { req, epoch: 1, parent: 3, entry: TrackEntry::Tracked { table: 5, child: 9 } };
        let outs = run(&mut core, Input::Msg { from: Peer::Shard(2), msg: track(7) });
        assert_eq!(prestocks(&outs), [DiskCmd::Prestock { table: 5, parent: 3 }]);
        // The reply waits for the saved tracking list only, never for the pre-stocking.
        let save = outs.iter().find_map(|o| match o {
            Output::Disk { id, cmd: DiskCmd::SaveState { .. } } => Some(*id),
            _ => None,
        });
        let hint = outs.iter().find_map(|o| match o {
            Output::Disk { id, cmd: DiskCmd::Prestock { .. } } => Some(*id),
            _ => None,
        });
        assert!(run(&mut core, Input::Disk { id: hint.unwrap(), result: Ok(DiskOut::Done) }).is_empty());
        let outs = run(&mut core, Input::Disk { id: save.unwrap(), result: Ok(DiskOut::Done) });
        assert!(outs.iter().any(|o| matches!(o, Output::Send { msg: Msg::Reply { req: 7, result: Ok(_) }, .. })), "{outs:?}");
        // A retried super (the same child) does not stock again.
        assert!(prestocks(&run(&mut core, Input::Msg { from: Peer::Shard(2), msg: track(8) })).is_empty());
    }

    /// A peer's `Track`, `Super` or `Gc` naming a volume as its own super child is hostile (the
    /// metadata service never makes one): refused with a clear error, and nothing is recorded.
    #[test]
    fn a_volume_named_as_its_own_super_child_is_refused() {
        let map = ClusterMap {
            epoch: 1,
            replicas: 3,
            shards: (1..=4).map(|id| ShardInfo { id, addr: String::new(), state: ShardState::Up, in_sync: true }).collect(),
        };
        // The tracking primary of table 5, so `Super` is handled here.
        let me = map.primary(track_key(5).slot()).unwrap();
        let mut core = ShardCore::new(ShardConfig::new(me), Boot::default());
        run(&mut core, Input::Msg { from: Peer::Meta, msg: Msg::Map(map) });
        let refused = |outs: &[Output], req: ReqId| {
            outs.iter().any(|o| matches!(o, Output::Send { msg: Msg::Reply { req: r, result: Err(IoErr::BadRequest(e)) }, .. } if *r == req && e.contains("its own super child")))
        };
        let peer = Peer::Shard(if me == 1 { 2 } else { 1 });
        for (req, entry) in [(7, TrackEntry::Tracked { table: 5, child: 3 }), (8, TrackEntry::Granted { table: 5, child: 3 }), (9, TrackEntry::Fenced { table: 5, child: 3 })] {
            let outs = run(&mut core, Input::Msg { from: peer, msg: Msg::Track { req, epoch: 1, parent: 3, entry } });
            assert!(refused(&outs, req), "Track {entry:?} of parent 3: {outs:?}");
            assert_eq!(core.tracking_entry(3), None, "a hostile Track was recorded");
        }
        let outs = run(&mut core, Input::Msg { from: Peer::Meta, msg: Msg::Super { req: 10, epoch: 1, table: 5, parent: 3, child: 3 } });
        assert!(refused(&outs, 10), "Super 3 -> 3: {outs:?}");
        assert!(core.table_track(5).and_then(|t| t.current.as_ref()).is_none(), "a hostile Super was recorded: {:?}", core.table_track(5));
        let outs = run(&mut core, Input::Msg { from: Peer::Meta, msg: Msg::Gc { req: 11, epoch: 1, table: 5, parent: 3, child: 3, promoted: true } });
        assert!(refused(&outs, 11), "Gc 3 -> 3: {outs:?}");
        assert_eq!(core.tracking_entry(3), None, "a hostile Gc fenced the volume");
    }

    /// A shard recovering while no other is up (a restarted metadata service marked every shard
    /// down) keeps its tracking list: it may be the only copy; clearing it unfenced promoted
    /// parents (sim seed 110).
    #[test]
    fn a_recovery_with_no_shard_up_keeps_the_tracking_list() {
        let fenced = TrackEntry::Fenced { table: 5, child: 9 };
        let state = postcard::to_allocvec(&SavedState { entries: vec![(3, fenced)], retired: vec![3] }).unwrap();
        let mut core = ShardCore::new(ShardConfig::new(1), Boot { state: Some(state), ..Boot::default() });
        let mut map = ClusterMap {
            epoch: 7,
            replicas: 3,
            shards: (1..=4).map(|id| ShardInfo { id, addr: String::new(), state: ShardState::Down, in_sync: true }).collect(),
        };
        map.shards[0].state = ShardState::Recovering;
        let outs = run(&mut core, Input::Msg { from: Peer::Meta, msg: Msg::Map(map) });
        // Nobody to list: it caught up at once.
        assert!(outs.iter().any(|o| matches!(o, Output::Send { msg: Msg::Recovered { epoch: 7, .. }, .. })), "{outs:?}");
        assert_eq!(core.tracking_entry(3), Some(fenced), "the tracking list was cleared with no peer to rebuild it from");
    }

    /// A write waiting only for replicas that a new map marks down is not acknowledged when the
    /// same map no longer lets this shard lead its slot (a restarted metadata service marks
    /// every shard down): the client retries at the slot's next primary. Acknowledged here, the
    /// write was lost when another in-sync replica led the slot first (sim seed 22).
    #[test]
    fn a_write_is_not_acknowledged_by_a_shard_the_new_map_does_not_let_lead() {
        let mut map = ClusterMap {
            epoch: 1,
            replicas: 3,
            shards: (1..=4).map(|id| ShardInfo { id, addr: String::new(), state: ShardState::Up, in_sync: true }).collect(),
        };
        let slot = Slot { table: 5, objno: 0 };
        let me = map.primary(slot).unwrap();
        let mut core = ShardCore::new(ShardConfig::new(me), Boot::default());
        run(&mut core, Input::Msg { from: Peer::Meta, msg: Msg::Map(map.clone()) });
        let vol = VolRef { id: 5, table: 5, object_size_bytes: 65536, parent: None };
        let write = Msg::Io { req: 77, epoch: 1, vol, objno: 0, op: IoOp::Write { offset: 0, data: vec![7; 65536] } };
        let mut pending = run(&mut core, Input::Msg { from: Peer::Client(1), msg: write });
        // Run its disk commands (and the slot sync's), never answering the replicas.
        let mut replies = vec![];
        for _ in 0..20 {
            let mut next = vec![];
            for o in pending {
                match o {
                    Output::Disk { id, cmd } => {
                        let result = match cmd {
                            DiskCmd::Read { len, .. } => Ok(DiskOut::Data(vec![0; len as usize])),
                            DiskCmd::ReadAll { .. } => Ok(DiskOut::Data(vec![])),
                            _ => Ok(DiskOut::Done),
                        };
                        next.extend(run(&mut core, Input::Disk { id, result }));
                    }
                    Output::Send { to: Peer::Shard(s), msg } if request_id(&msg).is_some() && matches!(msg, Msg::SlotVersions { .. }) => {
                        // The replicas hold nothing of the slot.
                        let req = request_id(&msg).unwrap();
                        let body = ReplyBody::Objects { objects: vec![], tracks: vec![], retired: vec![], more: false };
                        next.extend(run(&mut core, Input::Msg { from: Peer::Shard(s), msg: Msg::Reply { req, result: Ok(body) } }));
                    }
                    Output::Send { to: Peer::Client(_), msg: Msg::Reply { result, .. } } => replies.push(result),
                    Output::Send { .. } => {}
                }
            }
            pending = next;
        }
        assert!(replies.is_empty(), "answered before its replicas: {replies:?}");
        // Every shard down: this one no longer leads the slot.
        map.epoch = 2;
        for sh in &mut map.shards {
            sh.state = ShardState::Down;
        }
        let outs = run(&mut core, Input::Msg { from: Peer::Meta, msg: Msg::Map(map) });
        let replies: Vec<&Result<ReplyBody, IoErr>> = outs
            .iter()
            .filter_map(|o| match o {
                Output::Send { to: Peer::Client(1), msg: Msg::Reply { req: 77, result } } => Some(result),
                _ => None,
            })
            .collect();
        assert!(matches!(replies[..], [Err(IoErr::NotPrimary)]), "{replies:?}");
    }

    /// A recovering replica told to collect a slot (`RepCollect`, `from` into `to`) while it
    /// holds neither copy gains nothing from the collect: the primary's `to`, which the replica
    /// listed and pulls, is still installed when the pull answers. Counted as current because
    /// of the collect, the pull was dropped and the replica came up without the object; once it
    /// led the slot it deleted the other replicas' copies, losing acknowledged writes (sim
    /// seed 17).
    #[test]
    fn a_collect_that_moves_nothing_here_does_not_stop_a_recovery_pull() {
        let slot = Slot { table: 1, objno: 2 };
        let mut map = ClusterMap {
            epoch: 3,
            replicas: 3,
            shards: (1..=4).map(|id| ShardInfo { id, addr: String::new(), state: ShardState::Up, in_sync: true }).collect(),
        };
        let primary = map.primary(slot).unwrap();
        let me = map.placement(slot).into_iter().find(|s| *s != primary).unwrap();
        map.shards.iter_mut().find(|s| s.id == me).unwrap().state = ShardState::Recovering;
        let mut core = ShardCore::new(ShardConfig::new(me), Boot::default());
        let (gone, heir) = (1, 2);
        let to_key = ObjKey { table: slot.table, objno: slot.objno, owner: heir };
        let version = Version { epoch: 2, seq: 1 };
        let mut outs = run(&mut core, Input::Msg { from: Peer::Meta, msg: Msg::Map(map) });
        // Every peer lists; the primary lists the collected object (already renamed there).
        let mut pull = None;
        for _ in 0..5 {
            let mut next = vec![];
            for o in std::mem::take(&mut outs) {
                match o {
                    Output::Send { to: Peer::Shard(p), msg: Msg::ListObjects { req, .. } } => {
                        let objects = if p == primary { vec![(to_key, version)] } else { vec![] };
                        let body = ReplyBody::Objects { objects, tracks: vec![], retired: vec![], more: false };
                        next.extend(run(&mut core, Input::Msg { from: Peer::Shard(p), msg: Msg::Reply { req, result: Ok(body) } }));
                    }
                    Output::Send { to: Peer::Shard(p), msg: Msg::Pull { req, key, .. } } if key == to_key => pull = Some((p, req)),
                    Output::Disk { id, .. } => next.extend(run(&mut core, Input::Disk { id, result: Ok(DiskOut::Done) })),
                    _ => {}
                }
            }
            outs = next;
        }
        let (from, pull_req) = pull.expect("the listed object is pulled");
        assert_eq!(from, primary);
        // The primary's collect reaches us before the pull's answer: we hold no copy of `gone`.
        let collect = Msg::RepCollect { req: 90, epoch: 3, slot, from: gone, to: Some(heir) };
        let outs = run(&mut core, Input::Msg { from: Peer::Shard(primary), msg: collect });
        assert!(outs.iter().any(|o| matches!(o, Output::Send { msg: Msg::Reply { req: 90, result: Ok(_) }, .. })), "{outs:?}");
        let data = vec![7u8; 4096];
        let answer = Msg::Reply { req: pull_req, result: Ok(ReplyBody::Object { version, data: data.clone() }) };
        let outs = run(&mut core, Input::Msg { from: Peer::Shard(primary), msg: answer });
        let installs: Vec<&DiskCmd> = outs
            .iter()
            .filter_map(|o| match o {
                Output::Disk { cmd: cmd @ DiskCmd::Apply { key, .. }, .. } if *key == to_key => Some(cmd),
                _ => None,
            })
            .collect();
        assert!(
            matches!(installs[..], [DiskCmd::Apply { version: v, op: RepOp::Put { data: d }, .. }] if *v == version && *d == data),
            "the pulled object was not installed: {outs:?}"
        );
    }

    /// A new primary's slot sync that a new map ends (we no longer lead the slot) while it reads
    /// a copy to send a replica sends nothing when the read completes: it finishes, failed, and
    /// frees the slot. Sending it, the sync waited for ever on a replica that refuses a
    /// non-primary (a retryable error, resent every tick) and held the slot's lock, blocking a
    /// garbage collection there and so another shard's recovery pull (sim seed 373).
    #[test]
    fn a_slot_sync_ended_by_a_new_map_sends_nothing_once_its_read_completes() {
        let mut map = ClusterMap {
            epoch: 1,
            replicas: 3,
            shards: (1..=4).map(|id| ShardInfo { id, addr: String::new(), state: ShardState::Up, in_sync: true }).collect(),
        };
        let slot = Slot { table: 5, objno: 0 };
        let me = map.primary(slot).unwrap();
        let key = ObjKey { table: 5, objno: 0, owner: 5 };
        let boot = Boot { objects: vec![(key, Version { epoch: 1, seq: 1 })], ..Boot::default() };
        let mut core = ShardCore::new(ShardConfig::new(me), boot);
        run(&mut core, Input::Msg { from: Peer::Meta, msg: Msg::Map(map.clone()) });
        // A read at the new primary syncs the slot first.
        let vol = VolRef { id: 5, table: 5, object_size_bytes: 65536, parent: None };
        let read = Msg::Io { req: 77, epoch: 1, vol, objno: 0, op: IoOp::Read { offset: 0, len: 4096 } };
        let outs = run(&mut core, Input::Msg { from: Peer::Client(1), msg: read });
        // The replicas hold nothing of the slot: ours is read to be sent to them.
        let mut reads = vec![];
        for o in outs {
            if let Output::Send { to: Peer::Shard(s), msg: msg @ Msg::SlotVersions { .. } } = o {
                let req = request_id(&msg).unwrap();
                let body = ReplyBody::Objects { objects: vec![], tracks: vec![], retired: vec![], more: false };
                for o in run(&mut core, Input::Msg { from: Peer::Shard(s), msg: Msg::Reply { req, result: Ok(body) } }) {
                    if let Output::Disk { id, cmd: DiskCmd::ReadAll { .. } } = o {
                        reads.push(id);
                    }
                }
            }
        }
        assert!(!reads.is_empty(), "no copy read for the replicas");
        // A new map: another shard leads the slot.
        map.epoch = 2;
        map.shards.iter_mut().find(|s| s.id == me).unwrap().state = ShardState::Down;
        run(&mut core, Input::Msg { from: Peer::Meta, msg: Msg::Map(map) });
        let mut sent = vec![];
        for id in reads {
            sent.extend(run(&mut core, Input::Disk { id, result: Ok(DiskOut::Data(vec![1; 4096])) }));
        }
        let syncs = sent.iter().filter(|o| matches!(o, Output::Send { msg: Msg::RepSync { .. }, .. })).count();
        assert_eq!(syncs, 0, "a sync this shard no longer leads sent its copy to the replicas");
        assert_eq!(core.ops_in_flight(), 0, "the ended sync (or the read behind it) still holds the slot: {}", core.debug_ops());
    }

    /// The invariant checks can fail: a core whose state breaks one panics naming it.
    #[test]
    fn check_invariants_names_a_broken_invariant() {
        let mut core = ShardCore::new(ShardConfig::new(1), Boot::default());
        core.check_invariants();
        let slot = Slot { table: 5, objno: 0 };
        // An operation on a slot whose lock nobody holds.
        core.new_op(Some(slot), Kind::SaveEntries { reply_to: None, parent: None });
        let e = std::panic::catch_unwind(|| core.check_invariants()).unwrap_err();
        let msg = e.downcast_ref::<String>().unwrap();
        assert!(msg.contains("an operation on a slot holds its lock"), "{msg}");
    }

    /// A leased shard refuses client I/O until it holds a lease, fences itself a third of the
    /// TTL before its lease may expire, lifts the fence when the same lease is renewed, and
    /// after a lost lease only once the metadata service has marked it down and re-admitted it.
    #[test]
    fn a_leased_shard_fences_itself_before_its_lease_may_expire() {
        const TTL: u64 = 3_000_000;
        let map = |epoch, state| ClusterMap { epoch, replicas: 1, shards: vec![ShardInfo { id: 1, addr: String::new(), state, in_sync: true }] };
        let mut cfg = ShardConfig::new(1);
        cfg.lease_required = true;
        let mut core = ShardCore::new(cfg, Boot::default());
        let vol = VolRef { id: 5, table: 5, object_size_bytes: 65536, parent: None };
        let mut req = 100;
        // A client write now: refused as fenced, or started (a disk command for it).
        let mut write = |core: &mut ShardCore, now: u64| -> Result<(), String> {
            req += 1;
            core.handle(now, Input::Msg { from: Peer::Client(1), msg: Msg::Io { req, epoch: core.epoch(), vol: vol.clone(), objno: 0, op: IoOp::Write { offset: 0, data: vec![1; 512] } } });
            let outs = core.take_outputs();
            for o in &outs {
                if let Output::Send { msg: Msg::Reply { result: Err(IoErr::Fenced(why)), .. }, .. } = o {
                    return Err(why.clone());
                }
            }
            assert!(outs.iter().any(|o| matches!(o, Output::Disk { cmd: DiskCmd::Apply { .. }, .. })), "{outs:?}");
            Ok(())
        };
        let tick = |core: &mut ShardCore, now: u64| core.handle(now, Input::Tick);
        core.handle(0, Input::Msg { from: Peer::Meta, msg: Msg::Map(map(1, ShardState::Up)) });
        assert!(write(&mut core, 0).unwrap_err().contains("no lease"));
        core.handle(0, Input::Lease(LeaseReport::Held { lease: 7, ttl_us: TTL, sure_until_us: TTL }));
        assert!(core.fence().is_none(), "a new process with a lease and a map where it is up");
        write(&mut core, 0).unwrap();

        // No renewal: still serving until a third of the TTL before it may expire, fenced then.
        tick(&mut core, TTL - TTL / 3 - 20_000);
        assert!(core.fence().is_none());
        tick(&mut core, TTL - TTL / 3);
        let why = write(&mut core, TTL - TTL / 3).unwrap_err();
        assert!(why.contains("shard 1 fenced itself") && why.contains("not renewed"), "{why}");
        assert!(core.stats().fenced);
        // The same lease renewed after all: the store never let it go, the fence lifts.
        core.handle(TTL - 100_000, Input::Lease(LeaseReport::Held { lease: 7, ttl_us: TTL, sure_until_us: 2 * TTL - 200_000 }));
        assert!(core.fence().is_none());

        // Lost: fenced at once. A new lease alone does not lift it; the map marking it down and
        // then recovering does.
        core.handle(TTL, Input::Lease(LeaseReport::Lost { why: "lease 7 not renewed within its TTL".into() }));
        assert!(write(&mut core, TTL).unwrap_err().contains("within its TTL"));
        core.handle(TTL + 1, Input::Lease(LeaseReport::Held { lease: 8, ttl_us: TTL, sure_until_us: 2 * TTL }));
        assert!(core.fence().is_some(), "a new lease before the metadata service re-admitted it");
        core.handle(TTL + 2, Input::Msg { from: Peer::Meta, msg: Msg::Map(map(2, ShardState::Up)) });
        assert!(core.fence().is_some(), "a map that never marked it down is no re-admission");
        core.handle(TTL + 3, Input::Msg { from: Peer::Meta, msg: Msg::Map(map(3, ShardState::Down)) });
        assert!(core.fence().is_some());
        core.handle(TTL + 4, Input::Msg { from: Peer::Meta, msg: Msg::Map(map(4, ShardState::Recovering)) });
        assert!(core.fence().is_none(), "re-admitted under its new lease");
    }

    /// Without a lease the shard never fences (the embedded default).
    #[test]
    fn a_shard_without_a_lease_never_fences() {
        let mut core = ShardCore::new(ShardConfig::new(1), Boot::default());
        core.handle(u64::MAX / 2, Input::Tick);
        core.handle(u64::MAX / 2, Input::Lease(LeaseReport::Lost { why: "x".into() }));
        assert!(core.fence().is_none());
    }
}
