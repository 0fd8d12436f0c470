//! The shard core and the metadata core under the deterministic simulator: parent writes racing
//! `super` and `collapse`, shards crashing (losing and tearing unsynced writes) and restarting,
//! each shard on the real object store ([`FileStore`]) over the simulator's disk — a crash cuts
//! the power in the middle of the disk commands in flight, so it exercises the store's own
//! crash-safety rules (torn headers, moves, frees, deferred copies) —
//! partitions, message loss, duplication and reordering, the tracking shard failing over, and
//! the metadata service's state saves failing (it then reverts and the client retries).
//!
//! The control plane is the real [`MetaCore`]: it creates the parent volume, orchestrates
//! `super` and `collapse` over the tracking shard and runs garbage collection. Shard membership
//! is the real [`Membership`] core: it pings the shards over the simulated network, marks one
//! down when its control link ends (a crash, a lost disk, a broken link) or when it goes silent
//! (a partition), recovering when it registers or answers again, and up once it reports that
//! it caught up. The test plays only their driver (the links, and the state file).
//!
//! Every seed checks the safety property of SpecREDS §4.4 — once a child is promoted, no parent
//! write issued after `super` returned was acknowledged, and the child's content is the parent's
//! at `super` plus the child's own writes — plus replica agreement, no lost acknowledged write,
//! and no leaked objects after garbage collection. About a third of the seeds send the metadata
//! service's abort request instead of collapsing: the child must be rejected, and the parent must
//! never have a write refused. About half the seeds crash the metadata service once, right after
//! one of its outputs (a message that may or may not leave, a state save that may or may not
//! reach the disk — it loses nothing it saved), at a step chosen by the seed: recording a super
//! child, telling the tracking shard, collapsing, aborting, each GC step. It restarts from its
//! saved state the way the real service does (`start_service`: every shard marked down, a new
//! membership core, each shard registering again; maps reach shards only once saved), must finish or undo the half-done step (no orphan child), and the test's client
//! retries its request as a real client whose connection broke would. A failing seed reproduces exactly:
//! `SIM_SEED=<n> cargo test -p volume --test sim_super_collapse -- --nocapture`.

use std::collections::{BTreeMap, BTreeSet};

use sim::{Delivery, EventQueue, NetConfig, Network, NodeId, SimRng, TimeUs};
use volume::core::membership::{LinkId, MemberInput, MemberOutput, Membership, MembershipConfig};
use volume::driver::meta::{MetaReq, MetaResp, MetaState};
use volume::core::meta::{start_service, MetaCore, MetaCoreConfig, MetaInput, MetaOutput};
use volume::core::shard::*;
use volume::store::{FileStore, SimFs};
use volume::types::*;

const META: NodeId = 99;
const CLIENT_BASE: NodeId = 100;
const SHARDS: u32 = 4;
/// Four 4 KiB sectors: a child's first block write makes a deferred (partial) copy.
const OBJECT_BYTES: u32 = 16384;
/// Half a 4 KiB sector: a block write to an uncopied child object copies only part of it.
const BLOCK_BYTES: u32 = 2048;
const OBJECTS: u64 = 6;
const BLOCKS: u64 = OBJECTS * (OBJECT_BYTES / BLOCK_BYTES) as u64;
const TABLE: TableId = 1;
const PARENT: VolId = 1;
const CHILD: VolId = 2;
const CLIENTS_PER_VOLUME: usize = 3;
const PARENT_NAME: &str = "parent";
const CHILD_NAME: &str = "child";
/// Longer than a few shard resend periods, as a real client's request timeout is.
const CLIENT_TIMEOUT_US: u64 = 200_000;
/// The membership core pings every shard at each tick of the simulation's clock (every 5 ms)
/// and marks a shard silent for 20 ms (listening time) down.
const MEMBERSHIP: MembershipConfig = MembershipConfig { ping_interval_us: 5_000, down_after_us: 20_000 };
/// Request ids of liveness pings: a range of their own, as in the real driver.
const PING_REQ_BASE: u64 = 1 << 62;

enum Ev {
    Deliver(Delivery<Msg>),
    DiskDone { shard: u32, gen: u64, id: u64 },
    Tick,
    ClientWake { client: usize, gen: u64 },
    Crash(u32),
    /// A crash that waited for a disk command (see `Shard::crash_waiting_until`) happens.
    CrashNow(u32),
    Restart(u32),
    /// The shard's disk is lost: a replacement with the same id and an empty disk comes up.
    Replace(u32),
    Isolate(u32),
    Heal(u32),
    Super,
    Collapse,
    /// A state save of the metadata service completes (or fails).
    MetaSaved { seq: u64, ok: bool, gen: u64 },
    /// The metadata service restarts from its saved state.
    MetaRestart,
    /// The shard connects again to the metadata service (which restarted).
    Reconnect(u32),
    /// The connection between the metadata service and a shard breaks (messages in flight on
    /// it are lost) and is made again later.
    MetaLinkDrop(u32),
    MetaLinkUp(u32),
    /// The test client's connection to the metadata service breaks while a control request is
    /// in flight: it reconnects and sends the request again.
    ClientDrop,
    StopFaults,
}

impl From<Delivery<Msg>> for Ev {
    fn from(d: Delivery<Msg>) -> Self {
        Ev::Deliver(d)
    }
}

struct Shard {
    core: Option<ShardCore>,
    /// Its disk, and the store on it while the shard runs.
    disk: SimFs,
    store: Option<FileStore<SimFs>>,
    /// Disk commands issued and not yet done, by id: each runs when it completes (the real
    /// driver runs them in parallel on blocking threads, so they complete in any order), or,
    /// when the shard crashes first, runs into the power cut.
    inflight: BTreeMap<u64, DiskCmd>,
    /// Deferred copies made and completed by the stores of earlier incarnations.
    deferred_made: u64,
    deferred_completed: u64,
    /// The store's crash handling: disk commands the power cut short, objects open found
    /// suspect (their bytes do not match their checksums), older claims and half-made slot
    /// files open cleaned up.
    recovery: StoreRecovery,
    /// A crash waits for the shard's next disk command (until this time at most), so that it
    /// lands inside one rather than between two.
    crash_waiting_until: Option<TimeUs>,
    gen: u64,
    isolated: bool,
    /// Its control link to the metadata service, while the membership core knows it.
    link: Option<LinkId>,
    /// Its disk was replaced by an empty one since it last registered.
    fresh: bool,
}

/// Whether a shard's crash waits for its next disk command (20 ms at most), so that the power
/// cut lands inside the store's sequence of writes and syncs rather than between commands
/// (on by default; `SIM_CRASH_IN_COMMANDS=0` turns it off, see the note at
/// `super_collapse_under_faults_many_seeds`).
fn crash_in_commands() -> bool {
    std::env::var("SIM_CRASH_IN_COMMANDS").map_or(true, |v| v != "0")
}

#[derive(Clone, Copy, Debug, Default)]
struct StoreRecovery {
    commands_cut: u64,
    suspect_objects: u64,
    older_claims_freed: u64,
    partial_slots_removed: u64,
}

impl StoreRecovery {
    fn plus(&self, o: &StoreRecovery) -> StoreRecovery {
        StoreRecovery {
            commands_cut: self.commands_cut + o.commands_cut,
            suspect_objects: self.suspect_objects + o.suspect_objects,
            older_claims_freed: self.older_claims_freed + o.older_claims_freed,
            partial_slots_removed: self.partial_slots_removed + o.partial_slots_removed,
        }
    }
}

impl Shard {
    /// Opens the store on the shard's disk (running open's recovery) and reads what the core
    /// boots from.
    fn open_store(&mut self) -> Boot {
        let store = FileStore::simulated(self.disk.clone()).unwrap_or_else(|e| panic!("the store does not open after a crash: {e}"));
        let boot = store.boot().unwrap_or_else(|e| panic!("the store does not boot after a crash: {e}"));
        let c = store.pool_stats().counters;
        self.recovery.suspect_objects += boot.objects.iter().filter(|(_, v)| *v == volume::store::objfmt::SUSPECT).count() as u64;
        self.recovery.older_claims_freed += c.open_older_claims_freed;
        self.recovery.partial_slots_removed += c.open_partial_slots_removed;
        self.store = Some(store);
        boot
    }

    /// The process stops: the disk commands in flight run until the power goes, after
    /// `cut_after` more disk operations (their results go nowhere), and the store is gone.
    fn lose_power(&mut self, cut_after: u64) {
        let inflight = std::mem::take(&mut self.inflight);
        let Some(store) = self.store.take() else { return };
        self.disk.cut_power_after(cut_after);
        for cmd in inflight.into_values() {
            if store.run(cmd).is_err() {
                self.recovery.commands_cut += 1;
            }
        }
        let c = store.pool_stats().counters;
        self.deferred_made += c.deferred_copies_made;
        self.deferred_completed += c.deferred_copies_completed;
    }

    /// Deferred copies made and completed so far, by every incarnation.
    fn deferred_copies(&self) -> (u64, u64) {
        let c = self.store.as_ref().map(|s| s.pool_stats().counters).unwrap_or_default();
        (self.deferred_made + c.deferred_copies_made, self.deferred_completed + c.deferred_copies_completed)
    }
}

#[derive(Clone, Debug)]
struct WriteRec {
    child: bool,
    block: u64,
    value: u64,
    issued_us: TimeUs,
    acked_us: Option<TimeUs>,
}

#[derive(Clone, Debug)]
struct ReadRec {
    child: bool,
    block: u64,
    invoked_us: TimeUs,
    /// Completion time and the value read.
    done: Option<(TimeUs, u64)>,
}

struct Client {
    child: bool,
    blocks: Vec<u64>,
    /// The read in flight (index into `World::reads`), when `current` is a read.
    reading: Option<usize>,
    active: bool,
    /// (request id, history indices of the write in flight, the message, sent at)
    current: Option<(ReqId, Vec<usize>, Msg, TimeUs)>,
    gen: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ControlKind {
    Super,
    /// The metadata service's abort request (mark written, then collapse: always rejected).
    Abort,
    Collapse,
}

struct World {
    rng: SimRng,
    /// Whether a crash waits for the shard's next disk command (see `crash_in_commands`).
    crash_in_commands: bool,
    q: EventQueue<Ev>,
    net: Network<Msg>,
    shards: Vec<Shard>,
    /// The cluster map the membership core decided (pushed to the shards as it changes).
    map: ClusterMap,
    members: Membership,
    next_link: LinkId,
    next_ping: u64,
    clients: Vec<Client>,
    history: Vec<WriteRec>,
    reads: Vec<ReadRec>,
    next_req: u64,
    next_value: u64,
    /// The metadata service's core, and the control request of the test's client in flight.
    meta: MetaCore,
    control: Option<(ControlKind, u64)>,
    next_call: u64,
    /// Probability that a state save of the metadata service fails.
    meta_save_failure: f64,
    super_start_us: Option<TimeUs>,
    super_end_us: Option<TimeUs>,
    collapse_outcome: Option<CollapseOutcome>,
    gc_done: bool,
    faults: bool,
    parent_keeps_writing: bool,
    /// This seed aborts the superposition instead of collapsing it.
    abort: bool,
    /// Parent writes refused (by a fence): never, unless the child was promoted.
    parent_refused: Vec<TimeUs>,
    log: Vec<String>,
    dumped: TimeUs,
    /// The metadata service's state file: the last save that reached the disk.
    meta_disk: MetaState,
    /// The save in flight (one at a time), which reaches the disk when it completes.
    meta_saving: Option<(u64, MetaState)>,
    /// Incarnation of the metadata service; its outputs counted, and after which one it crashes.
    meta_gen: u64,
    meta_down: bool,
    /// Outputs counted towards the crash (of the kind it waits for), and the crash: after the
    /// n-th output of a kind (`None`: of any kind).
    meta_outputs: u64,
    meta_crash_after: Option<(Option<&'static str>, u64)>,
    /// The output the crash came with (e.g. `Send Super`, `Save`), for the coverage count.
    meta_crash_step: Option<String>,
    /// The control request in flight when the service crashed: retried after the restart.
    control_lost: Option<ControlKind>,
    /// The restart found a super child recorded but not confirmed (the orphan case).
    restarted_with_pending: bool,
    /// The child's id, from the answer to super (a super undone at a restart and retried makes
    /// a child with a new id).
    child_id: VolId,
    /// This seed's metadata core timing (some seeds have a tracking deadline shorter than the
    /// faults, so collapses end their calls undecided and finish in the background).
    meta_cfg: MetaCoreConfig,
    /// The durable map's epoch last pushed to the shards.
    pushed_epoch: Epoch,
    /// Shards whose link to the metadata service is broken now.
    meta_link_down: BTreeSet<u32>,
    client_drops: u64,
    link_drops: u64,
    /// Draws whether the client's connection breaks during a control request (its own
    /// generator, so the rest of the seed's run is drawn as before).
    drop_rng: SimRng,
    /// A collapse call ended "not decided yet"; the client looks again later, without pushing.
    undecided_waiting: bool,
    undecided_replies: u64,
    /// Collapses the service decided on its own after the call ended undecided.
    decided_in_background: u64,
}

/// The metadata core's timing on the simulator's faster clock.
fn sim_meta_config(seed: u64) -> MetaCoreConfig {
    let short = SimRng::new(seed ^ 0x5d_ead1).chance(0.3);
    MetaCoreConfig { resend_after_us: 30_000, retry_after_us: 5_000, tracking_deadline_us: if short { 40_000 } else { 10_000_000 }, max_backoff_us: 100_000 }
}

fn sim_config(id: ShardId, boot: u64) -> ShardConfig {
    let mut c = ShardConfig::new(id);
    c.resend_after_us = 20_000;
    c.id_base = boot << 40;
    c
}

fn value_bytes(v: u64, len: usize) -> Vec<u8> {
    v.to_le_bytes().iter().cycle().take(len).copied().collect()
}

fn block_value(bytes: &[u8]) -> u64 {
    u64::from_le_bytes(bytes[..8].try_into().unwrap())
}

impl World {
    fn new(seed: u64) -> World {
        let mut rng = SimRng::new(seed);
        let drop_probability = [0.0, 0.01, 0.05][rng.range_u64(0, 2) as usize];
        let net = Network::new(NetConfig {
            drop_probability,
            duplicate_probability: 0.01,
            delay_us_min: 50,
            delay_us_max: 1_500,
        });
        let shards = (0..SHARDS)
            .map(|id| {
                let disk = SimFs::new();
                Shard {
                    core: Some(ShardCore::new(sim_config(id, 0), Boot::default())),
                    store: Some(FileStore::simulated(disk.clone()).expect("a store on an empty simulated disk opens")),
                    disk,
                    inflight: BTreeMap::new(),
                    deferred_made: 0,
                    deferred_completed: 0,
                    recovery: StoreRecovery::default(),
                    crash_waiting_until: None,
                    gen: 0,
                    isolated: false,
                    link: Some(id as LinkId),
                    fresh: false,
                }
            })
            .collect();
        let map = ClusterMap {
            epoch: 1,
            replicas: 3,
            shards: (0..SHARDS).map(|id| ShardInfo { id, addr: format!("sim:{id}"), state: ShardState::Up, in_sync: true }).collect(),
        };
        let mut clients = vec![];
        for child in [false, true] {
            for c in 0..CLIENTS_PER_VOLUME {
                // Each client owns whole objects, so every block has a single writer per volume.
                let per_object = (OBJECT_BYTES / BLOCK_BYTES) as u64;
                let blocks = (0..BLOCKS).filter(|b| ((b / per_object) as usize) % CLIENTS_PER_VOLUME == c).collect();
                clients.push(Client { child, blocks, reading: None, active: !child, current: None, gen: 0 });
            }
        }
        let meta_map = map.clone();
        let parent_keeps_writing = rng.chance(0.5);
        let meta_save_failure = [0.0, 0.0, 0.2][rng.range_u64(0, 2) as usize];
        let meta_crash_after = meta_crash_after(seed);
        let mut w = World {
            crash_in_commands: crash_in_commands(),
            rng,
            q: EventQueue::new(1_000_000),
            net,
            shards,
            members: Membership::linked(MEMBERSHIP, map.clone(), 0, &(0..SHARDS).map(|id| (id, id as LinkId, 0)).collect::<Vec<_>>()),
            next_link: SHARDS as LinkId,
            next_ping: PING_REQ_BASE,
            map,
            clients,
            history: vec![],
            reads: vec![],
            next_req: 1 << 48,
            next_value: 1,
            meta: MetaCore::new(sim_meta_config(seed), MetaState::with_map(meta_map.clone()), 1 << 56),
            control: None,
            next_call: 1,
            meta_save_failure,
            super_start_us: None,
            super_end_us: None,
            collapse_outcome: None,
            gc_done: false,
            faults: true,
            parent_keeps_writing,
            abort: aborts(seed),
            parent_refused: vec![],
            log: vec![],
            dumped: 0,
            meta_disk: MetaState::with_map(meta_map),
            meta_saving: None,
            meta_gen: 0,
            meta_down: false,
            meta_outputs: 0,
            meta_crash_after,
            meta_crash_step: None,
            control_lost: None,
            restarted_with_pending: false,
            child_id: CHILD,
            meta_cfg: sim_meta_config(seed),
            meta_link_down: BTreeSet::new(),
            pushed_epoch: 0,
            client_drops: 0,
            link_drops: 0,
            drop_rng: SimRng::new(seed ^ 0xc11e_47d0),
            undecided_waiting: false,
            undecided_replies: 0,
            decided_in_background: 0,
        };
        // The parent volume, created through the metadata core (saves succeed here): it gets
        // the ids the clients use.
        w.meta.handle(0, MetaInput::Request {
            call: 0,
            req: MetaReq::Create { name: PARENT_NAME.into(), size_bytes: OBJECTS * OBJECT_BYTES as u64, object_size_bytes: OBJECT_BYTES },
        });
        let outs = w.meta.take_outputs();
        let MetaOutput::Save { seq, state } = &outs[0] else { panic!("create did not save: {outs:?}") };
        w.meta_disk = (**state).clone();
        w.meta.handle(0, MetaInput::Saved { seq: *seq, result: Ok(()) });
        let outs = w.meta.take_outputs();
        match &outs[..] {
            [MetaOutput::Reply { resp: MetaResp::Volume(v), .. }] => assert_eq!((v.vol.id, v.vol.table), (PARENT, TABLE)),
            other => panic!("create answered {other:?}"),
        }
        w.pushed_epoch = w.map.epoch;
        w.push_map();
        w.q.push_at(0, Ev::Tick).unwrap();
        for c in 0..w.clients.len() {
            w.q.push_at(100, Ev::ClientWake { client: c, gen: 0 }).unwrap();
        }
        let super_at = w.rng.range_u64(80_000, 150_000);
        w.q.push_at(super_at, Ev::Super).unwrap();
        w.q.push_at(900_000, Ev::StopFaults).unwrap();
        // Faults: a few crashes and partitions, at most one shard out at a time.
        let mut t = 20_000;
        while t < 800_000 {
            t += w.rng.range_u64(40_000, 200_000);
            let s = w.rng.range_u64(0, SHARDS as u64 - 1) as u32;
            let ev = match w.rng.range_u64(0, 9) {
                0..=4 => Ev::Crash(s),
                5..=7 => Ev::Isolate(s),
                _ => Ev::Replace(s),
            };
            w.q.push_at(t, ev).unwrap();
        }
        // Broken connections, from a generator of their own: the metadata service's links to
        // shards, and the test client's link to the service.
        let mut plan = SimRng::new(seed ^ 0xd7_0b5e);
        let link_drops = plan.chance(0.5);
        if link_drops && std::env::var("SIM_NO_LINK_DROPS").is_err() {
            for _ in 0..plan.range_u64(1, 3) {
                let s = plan.range_u64(0, SHARDS as u64 - 1) as u32;
                w.q.push_at(plan.range_u64(50_000, 900_000), Ev::MetaLinkDrop(s)).unwrap();
            }
        }
        if plan.chance(0.5) {
            for _ in 0..plan.range_u64(1, 3) {
                w.q.push_at(plan.range_u64(50_000, 1_200_000), Ev::ClientDrop).unwrap();
            }
        }
        w
    }

    fn req(&mut self) -> ReqId {
        self.next_req += 1;
        self.next_req
    }

    fn now(&self) -> TimeUs {
        self.q.now()
    }

    fn send(&mut self, from: NodeId, to: NodeId, msg: Msg) {
        let now = self.now();
        self.net.send(&mut self.rng, &mut self.q, now, from, to, msg).unwrap();
    }

    fn push_map(&mut self) {
        for s in 0..SHARDS {
            let m = Msg::Map(self.map.clone());
            self.send(META, s, m);
        }
    }

    /// As the real driver does after each input of the metadata core: the durable map, once
    /// its epoch moved, becomes the one shards and clients get. A map is pushed only once it
    /// is saved, so a restarted service (which marks every shard down at the next epoch of its
    /// saved map) never makes a second map with an epoch a shard already holds.
    fn push_durable_map(&mut self) {
        let map = &self.meta.durable().map;
        if map.epoch != self.pushed_epoch {
            self.pushed_epoch = map.epoch;
            self.map = map.clone();
            self.push_map();
        }
    }

    /// Feeds the membership core (the metadata service's, so nothing while that is down) and
    /// carries out its outputs: a new map is pushed to the shards and saved through the
    /// metadata core; pings go out.
    fn member(&mut self, input: MemberInput) {
        if self.meta_down {
            return;
        }
        let now = self.now();
        self.members.handle(now, input);
        self.members.check_invariants_deep();
        for out in self.members.take_outputs() {
            match out {
                MemberOutput::SetMap { map, why } => {
                    self.log.push(format!("{now} epoch {}: {why}", map.epoch));
                    self.run_meta(MetaInput::SetMap(map));
                }
                MemberOutput::Ping { shard } => {
                    let req = self.next_ping;
                    self.next_ping += 1;
                    self.send(META, shard, Msg::Ping { req });
                }
            }
        }
    }

    /// The shard (alive) registers over a new control link.
    fn register(&mut self, s: u32) {
        let link = self.next_link;
        self.next_link += 1;
        let sh = &mut self.shards[s as usize];
        sh.link = Some(link);
        let (boot_id, fresh) = (sh.gen, std::mem::take(&mut sh.fresh));
        self.member(MemberInput::LinkOpened { shard: s, link, addr: format!("sim:{s}"), boot_id, fresh, leased: false });
        // As the real driver does on a registration: the durable map to the shard, and what
        // waits for a shard's answer is resent.
        let map = self.meta.durable().map.clone();
        self.send(META, s, Msg::Map(map));
        self.run_meta(MetaInput::LinkUp { shard: s });
    }

    /// The shard's control link ends (its process died, or the connection broke).
    fn link_closed(&mut self, s: u32, why: &str) {
        if let Some(link) = self.shards[s as usize].link.take() {
            self.member(MemberInput::LinkClosed { shard: s, link, why: why.into() });
        }
    }

    fn out_of_service(&self) -> bool {
        self.shards.iter().any(|s| s.core.is_none() || s.isolated)
            || self.map.shards.iter().any(|i| i.state != ShardState::Up)
    }

    fn node_to_peer(n: NodeId) -> Peer {
        match n {
            META => Peer::Meta,
            n if n >= CLIENT_BASE => Peer::Client((n - CLIENT_BASE) as u64),
            n => Peer::Shard(n),
        }
    }

    fn run_core(&mut self, s: u32, input: Input) {
        let Some(core) = self.shards[s as usize].core.as_mut() else { return };
        core.handle(self.q.now(), input);
        let outputs = core.take_outputs();
        // In all builds (the core checks itself after every input in debug builds only).
        core.check_invariants_deep();
        // Kept here, not in the core: the core takes a tracking object from its primary as
        // given, so only an honest cluster keeps this.
        if let Some(TrackState { phase: Phase::Promoted, allow_write: true, .. }) = core.table_track(TABLE).and_then(|t| t.current.as_ref()) {
            panic!("shard {s}: a promoted child's parent still allows writes: {:?}", core.table_track(TABLE));
        }
        for out in outputs {
            match out {
                Output::Send { to, msg } => {
                    let to = match to {
                        Peer::Shard(t) => t,
                        Peer::Client(c) => CLIENT_BASE + c as NodeId,
                        Peer::Meta => META,
                    };
                    self.send(s, to, msg);
                }
                Output::Disk { id, cmd } => {
                    if std::env::var("SIM_TRACE").is_ok() {
                        eprintln!("{} shard {s} disk issue {id} {:?}", self.now(), format!("{cmd:?}").chars().take(if std::env::var("SIM_TRACE_FULL").is_ok() { usize::MAX } else { 100 }).collect::<String>());
                    }
                    let now = self.now();
                    let shard = &mut self.shards[s as usize];
                    shard.inflight.insert(id, cmd);
                    let gen = shard.gen;
                    let crash_waiting = shard.crash_waiting_until.is_some();
                    let delay = self.rng.range_u64(30, 800);
                    if crash_waiting {
                        let at = self.rng.range_u64(0, delay - 1);
                        self.q.push_after(now, at, Ev::CrashNow(s)).unwrap();
                    }
                    self.q.push_after(now, delay, Ev::DiskDone { shard: s, gen, id }).unwrap();
                }
            }
        }
    }

    fn step(&mut self) -> bool {
        let Some((now, ev)) = self.q.pop() else { return false };
        if let Some(at) = std::env::var("SIM_DUMP_AT").ok().and_then(|s| s.parse::<u64>().ok()) {
            if self.dumped < at && now >= at {
                self.dumped = now;
                eprintln!("DUMP {now}: {}", self.why_busy());
            }
        }
        if self.meta_down && matches!(ev, Ev::Restart(_) | Ev::Heal(_) | Ev::MetaLinkUp(_) | Ev::Reconnect(_)) {
            // Shard registration is the metadata service's: it waits for it.
            self.q.push_after(now, 5_000, ev).unwrap();
            return true;
        }
        match ev {
            Ev::Deliver(d) => {
                let link = |a: NodeId, b: NodeId| if a == META { Some(b) } else if b == META { Some(a) } else { None };
                if link(d.from, d.to).is_some_and(|s| self.meta_link_down.contains(&s)) {
                    return true; // lost with the broken connection
                }
                let Some(d) = self.net.receive(d) else { return true };
                if std::env::var("SIM_TRACE_MSG").is_ok() {
                    let m = format!("{:?}", d.msg);
                    eprintln!("{now} msg {} -> {}: {}", d.from, d.to, &m[..m.len().min(if std::env::var("SIM_TRACE_FULL").is_ok() { usize::MAX } else { 160 })]);
                }
                match d.to {
                    META => self.meta_receive(d.from, d.msg),
                    n if n >= CLIENT_BASE => self.client_receive((n - CLIENT_BASE) as usize, d.msg),
                    s => self.run_core(s, Input::Msg { from: Self::node_to_peer(d.from), msg: d.msg }),
                }
            }
            Ev::DiskDone { shard, gen, id } => {
                let sh = &mut self.shards[shard as usize];
                if std::env::var("SIM_TRACE").is_ok() {
                    eprintln!("{now} shard {shard} disk done {id} gen {gen} current {}", sh.gen);
                }
                if sh.gen == gen && sh.core.is_some() {
                    let cmd = sh.inflight.remove(&id).expect("a disk command in flight");
                    let result = sh.store.as_ref().expect("a running shard has its store").run(cmd);
                    if std::env::var("SIM_TRACE").is_ok() {
                        eprintln!("{now} shard {shard} disk result {id}: {:?}", format!("{result:?}").chars().take(if std::env::var("SIM_TRACE_FULL").is_ok() { usize::MAX } else { 100 }).collect::<String>());
                    }
                    self.run_core(shard, Input::Disk { id, result });
                }
            }
            Ev::Tick => {
                for s in 0..SHARDS {
                    self.run_core(s, Input::Tick);
                }
                // The drivers' clocks; and a map whose save failed is offered again (as the
                // real driver does at each round of its failure detector).
                self.run_meta(MetaInput::Tick { unix_ms: 0 });
                self.member(MemberInput::Tick);
                let map = self.members.map().clone();
                self.run_meta(MetaInput::SetMap(map));
                if now % 50_000 < 5_000 && !self.meta_down {
                    self.push_map(); // the metadata service re-sends the map with its pings
                }
                if self.q.len() > 1 || !self.quiet() {
                    self.q.push_after(now, 5_000, Ev::Tick).unwrap();
                }
            }
            Ev::ClientWake { client, gen } => {
                if self.clients[client].gen == gen {
                    self.client_wake(client);
                }
            }
            Ev::Crash(s) | Ev::CrashNow(s) => {
                let waiting = self.shards[s as usize].crash_waiting_until.take();
                match ev {
                    Ev::CrashNow(_) if waiting.is_none() => return true, // it happened already
                    Ev::Crash(_) if self.shards[s as usize].inflight.is_empty() && self.crash_in_commands => {
                        // Wait for its next disk command, 20 ms at most.
                        self.shards[s as usize].crash_waiting_until = Some(now + 20_000);
                        self.q.push_after(now, 20_000, Ev::CrashNow(s)).unwrap();
                        return true;
                    }
                    _ => {}
                }
                if self.faults && !self.out_of_service() {
                    self.log.push(format!("{now} crash shard {s}"));
                    let sh = &mut self.shards[s as usize];
                    sh.core = None;
                    sh.gen += 1;
                    // The power goes somewhere inside the commands in flight: a few more of
                    // their disk operations happen, then none; the crash then loses or tears
                    // whatever of them was not synced.
                    let cut_after = self.rng.range_u64(0, 30);
                    sh.lose_power(cut_after);
                    sh.disk.crash(&mut self.rng);
                    self.net.set_down(s, true);
                    // Its kernel closes its control link.
                    self.link_closed(s, "the shard crashed");
                    let back = self.rng.range_u64(60_000, 250_000);
                    self.q.push_after(now, back, Ev::Restart(s)).unwrap();
                }
            }
            Ev::Replace(s) => {
                if self.faults && !self.out_of_service() {
                    self.log.push(format!("{now} shard {s} loses its disk"));
                    let sh = &mut self.shards[s as usize];
                    sh.core = None;
                    sh.gen += 1;
                    sh.lose_power(0);
                    sh.disk = SimFs::new();
                    sh.fresh = true;
                    self.net.set_down(s, true);
                    self.link_closed(s, "the shard lost its disk");
                    let back = self.rng.range_u64(40_000, 150_000);
                    self.q.push_after(now, back, Ev::Restart(s)).unwrap();
                }
            }
            Ev::Restart(s) => {
                let sh = &mut self.shards[s as usize];
                let boot = sh.open_store();
                sh.core = Some(ShardCore::new(sim_config(s, sh.gen + 1), boot));
                sh.gen += 1;
                self.net.set_down(s, false);
                self.log.push(format!("{now} restart shard {s}"));
                // A link of the dead process the metadata service did not see end (it was down
                // then) ends now; the restarted shard registers.
                self.link_closed(s, "replaced by the restarted shard's");
                self.register(s);
            }
            Ev::Isolate(s) => {
                if self.faults && !self.out_of_service() {
                    self.log.push(format!("{now} isolate shard {s}"));
                    self.shards[s as usize].isolated = true;
                    // Its links stay open but carry nothing: the membership core marks it down
                    // once it is silent for `down_after`.
                    self.net.isolate(s);
                    let back = self.rng.range_u64(30_000, 150_000);
                    self.q.push_after(now, back, Ev::Heal(s)).unwrap();
                }
            }
            Ev::Heal(s) => {
                self.log.push(format!("{now} heal shard {s}"));
                self.shards[s as usize].isolated = false;
                self.net.heal_all();
                // It answers pings again (and so recovers); one that has no link (the metadata
                // service restarted meanwhile) registers again.
                if self.shards[s as usize].core.is_some() && self.shards[s as usize].link.is_none() && !self.meta_link_down.contains(&s) {
                    self.register(s);
                }
            }
            Ev::Super => {
                if !self.parent_keeps_writing {
                    for c in self.clients.iter_mut().filter(|c| !c.child) {
                        c.active = false;
                    }
                    if self.clients.iter().any(|c| !c.child && c.current.is_some()) {
                        // Wait until the parent is truly silent.
                        self.q.push_after(now, 2_000, Ev::Super).unwrap();
                        return true;
                    }
                }
                // A retried super keeps the first attempt's start: the child may date from it.
                self.super_start_us.get_or_insert(now);
                self.log.push(format!("{now} super"));
                self.start_control(ControlKind::Super);
            }
            Ev::MetaLinkDrop(s) => {
                // A broken link marks its shard down (as in the real service), so a link breaks
                // only while every shard is up: at most one shard out at a time, as for the
                // other faults.
                if self.faults && !self.out_of_service() && self.meta_link_down.insert(s) {
                    self.link_drops += 1;
                    self.log.push(format!("{now} link metadata service - shard {s} breaks"));
                    self.link_closed(s, "the connection broke");
                    let back = self.rng.range_u64(10_000, 200_000);
                    self.q.push_after(now, back, Ev::MetaLinkUp(s)).unwrap();
                }
            }
            Ev::MetaLinkUp(s) => {
                self.meta_link_down.remove(&s);
                self.log.push(format!("{now} link metadata service - shard {s} is back"));
                if self.shards[s as usize].core.is_some() && self.shards[s as usize].link.is_none() && !self.shards[s as usize].isolated {
                    self.register(s);
                }
                self.run_meta(MetaInput::LinkUp { shard: s });
            }
            Ev::ClientDrop => {
                if let Some((kind, _)) = self.control.filter(|_| !self.meta_down) {
                    // The reply to the lost call is never read; the request goes again.
                    self.control = None;
                    self.client_drops += 1;
                    self.log.push(format!("{now} the client's connection breaks during {kind:?}; it reconnects"));
                    let ev = if kind == ControlKind::Super { Ev::Super } else { Ev::Collapse };
                    self.q.push_after(now, self.rng.range_u64(1_000, 30_000), ev).unwrap();
                }
            }
            Ev::Collapse if std::mem::take(&mut self.undecided_waiting) && self.collapse_decided() => {
                // Nobody asked since the call ended undecided: the service decided on its own.
                self.decided_in_background += 1;
                self.log.push(format!("{now} the undecided collapse was decided in the background; asking for the outcome"));
                self.q.push_after(now, 0, Ev::Collapse).unwrap();
            }
            Ev::Collapse if self.abort => {
                self.log.push(format!("{now} abort"));
                self.start_control(ControlKind::Abort);
            }
            Ev::Collapse => {
                self.log.push(format!("{now} collapse"));
                self.start_control(ControlKind::Collapse);
            }
            Ev::MetaSaved { seq, ok, gen } => {
                if gen != self.meta_gen {
                    return true; // a save of the crashed incarnation: settled at the crash
                }
                let result = if ok { Ok(()) } else { Err("injected: no space left on the metadata disk".to_string()) };
                if !ok {
                    self.log.push(format!("{now} metadata save {seq} fails"));
                }
                if let Some((s, state)) = self.meta_saving.take() {
                    if s == seq && ok {
                        self.meta_disk = state;
                    }
                }
                self.run_meta(MetaInput::Saved { seq, result });
            }
            Ev::MetaRestart => {
                self.meta_gen += 1;
                self.meta_down = false;
                let pending = self.meta_disk.volumes.values().filter(|v| v.super_pending).count();
                let children = self.meta_disk.volumes.values().filter(|v| v.super_parent.is_some()).count();
                self.log.push(format!("{now} metadata service restarts ({children} super children saved, {pending} pending)"));
                self.restarted_with_pending |= pending > 0;
                let base = (1 << 56) + (self.meta_gen << 44);
                // The real service's start (`start_service`, as the driver's): from the saved
                // state, every shard marked down (saved before anything else), a new membership
                // core that knows no link. Every shard's link ended with the old process: each
                // live one registers again once it reconnects. (Until issue 23 the membership
                // core and the map went on across the restart; modelling the real start made
                // seeds fail on three protocol bugs, fixed in the cores: a recovery with no
                // shard up cleared the tracking list, a GC round ended with slots nobody led,
                // and a write was acknowledged by a shard the new map no longer let lead.)
                let start = start_service(Some(self.meta_disk.clone()), 3, self.meta_cfg.clone(), MEMBERSHIP, now, base);
                if let Some(saved) = start.save {
                    self.meta_disk = saved;
                }
                self.meta = start.core;
                self.members = start.members;
                self.log.push(format!("{now} epoch {}: every shard down until it registers again", self.meta.durable().map.epoch));
                for s in 0..SHARDS {
                    self.shards[s as usize].link = None;
                    let back = self.rng.range_u64(1_000, 20_000);
                    self.q.push_after(now, back, Ev::Reconnect(s)).unwrap();
                }
                self.run_meta(MetaInput::Tick { unix_ms: 0 });
                if let Some(kind) = self.control_lost.take() {
                    // The client's connection broke: it sends its request again.
                    let ev = if kind == ControlKind::Super { Ev::Super } else { Ev::Collapse };
                    self.q.push_after(now, self.rng.range_u64(1_000, 30_000), ev).unwrap();
                }
            }
            Ev::Reconnect(s) => {
                // A shard whose link to the restarted service ended connects again (a crashed
                // or isolated one does when it is back; one whose link is broken, when it heals).
                let sh = &self.shards[s as usize];
                if sh.core.is_some() && sh.link.is_none() && !sh.isolated && !self.meta_link_down.contains(&s) {
                    self.register(s);
                }
            }
            Ev::StopFaults => self.faults = false,
        }
        true
    }

    // ---- clients ------------------------------------------------------------------------------

    fn vol(&self, child: bool) -> VolRef {
        if child {
            VolRef { id: self.child_id, table: TABLE, object_size_bytes: OBJECT_BYTES, parent: (!self.gc_done).then_some(PARENT) }
        } else {
            VolRef { id: PARENT, table: TABLE, object_size_bytes: OBJECT_BYTES, parent: None }
        }
    }

    fn client_wake(&mut self, c: usize) {
        let now = self.now();
        if let Some((_, idx, msg, sent)) = self.clients[c].current.clone() {
            if now.saturating_sub(sent) >= CLIENT_TIMEOUT_US {
                // Timed out: resend the same write under a new request id.
                let req = self.req();
                let mut msg = msg;
                if let Msg::Io { req: r, epoch, .. } = &mut msg {
                    *r = req;
                    *epoch = self.map.epoch;
                }
                self.clients[c].current = Some((req, idx, msg.clone(), now));
                self.send_io(c, msg);
            }
            self.schedule_client(c, CLIENT_TIMEOUT_US);
            return;
        }
        if !self.clients[c].active {
            return;
        }
        let child = self.clients[c].child;
        let blocks = self.clients[c].blocks.clone();
        let per_object = (OBJECT_BYTES / BLOCK_BYTES) as u64;
        if self.rng.chance(0.3) {
            // Read a block another client writes: histories are checked for linearizability.
            let others: Vec<u64> = (0..BLOCKS).filter(|b| !blocks.contains(b)).collect();
            let b = *self.rng.pick(&others).unwrap();
            self.reads.push(ReadRec { child, block: b, invoked_us: now, done: None });
            self.clients[c].reading = Some(self.reads.len() - 1);
            let offset = ((b % per_object) * BLOCK_BYTES as u64) as u32;
            let req = self.req();
            let msg = Msg::Io { req, epoch: self.map.epoch, vol: self.vol(child), objno: b / per_object, op: IoOp::Read { offset, len: BLOCK_BYTES } };
            self.clients[c].current = Some((req, vec![], msg.clone(), now));
            self.send_io(c, msg);
            self.schedule_client(c, CLIENT_TIMEOUT_US);
            return;
        }
        let value = self.next_value;
        self.next_value += 1;
        let b = *self.rng.pick(&blocks).unwrap();
        let objno = b / per_object;
        let (op, written, stored) = if self.rng.chance(0.1) {
            // A write covering the whole object: no copy-on-write needed.
            let data = value_bytes(value, OBJECT_BYTES as usize);
            (IoOp::Write { offset: 0, data }, (objno * per_object..(objno + 1) * per_object).collect::<Vec<_>>(), value)
        } else if self.rng.chance(0.05) {
            let offset = ((b % per_object) * BLOCK_BYTES as u64) as u32;
            (IoOp::Zero { offset, len: BLOCK_BYTES }, vec![b], 0)
        } else {
            let offset = ((b % per_object) * BLOCK_BYTES as u64) as u32;
            (IoOp::Write { offset, data: value_bytes(value, BLOCK_BYTES as usize) }, vec![b], value)
        };
        let idx: Vec<usize> = written
            .iter()
            .map(|&block| {
                self.history.push(WriteRec { child, block, value: stored, issued_us: now, acked_us: None });
                self.history.len() - 1
            })
            .collect();
        let req = self.req();
        let msg = Msg::Io { req, epoch: self.map.epoch, vol: self.vol(child), objno, op };
        self.clients[c].current = Some((req, idx, msg.clone(), now));
        self.send_io(c, msg);
        self.schedule_client(c, CLIENT_TIMEOUT_US);
    }

    fn send_io(&mut self, c: usize, msg: Msg) {
        let Msg::Io { vol, objno, .. } = &msg else { unreachable!() };
        let slot = Slot { table: vol.table, objno: *objno };
        // Clients learn the map from the metadata service: here, the current one.
        if let Some(p) = self.map.primary(slot) {
            self.send(CLIENT_BASE + c as NodeId, p, msg);
        }
    }

    fn schedule_client(&mut self, c: usize, delay: u64) {
        self.clients[c].gen += 1;
        let gen = self.clients[c].gen;
        let now = self.now();
        self.q.push_after(now, delay, Ev::ClientWake { client: c, gen }).unwrap();
    }

    fn client_receive(&mut self, c: usize, msg: Msg) {
        let Msg::Reply { req, result } = msg else { return };
        let Some((cur, idx, m, _)) = self.clients[c].current.clone() else { return };
        if cur != req {
            return;
        }
        let now = self.now();
        match result {
            Ok(ReplyBody::Data(d)) => {
                let r = self.clients[c].reading.take().expect("data answers a read");
                let v = block_value(&d);
                assert_eq!(d, value_bytes(v, BLOCK_BYTES as usize), "a read returned a torn block: {:?}", &self.reads[r]);
                self.reads[r].done = Some((now, v));
            }
            Ok(_) => {
                for i in idx {
                    self.history[i].acked_us = Some(now);
                }
            }
            Err(e) if e.is_retryable() => {
                // Retry soon at the (possibly new) primary.
                let req = self.req();
                let mut m = m;
                if let Msg::Io { req: r, epoch, .. } = &mut m {
                    *r = req;
                    *epoch = self.map.epoch;
                }
                self.clients[c].current = Some((req, idx, m.clone(), now));
                self.send_io(c, m);
                return;
            }
            Err(IoErr::WriteRefused(_)) => {
                if !self.clients[c].child && self.clients[c].reading.is_none() {
                    self.parent_refused.push(now);
                }
                // A refused write stays unacknowledged in the history: an earlier attempt of it
                // may have landed, so the checks treat it like any unacknowledged write.
                self.clients[c].reading = None;
            }
            Err(e) => panic!("client {c}: unexpected error {e:?}"),
        }
        self.clients[c].current = None;
        let pause = self.rng.range_u64(0, 3_000);
        self.schedule_client(c, pause);
    }

    // ---- the metadata service: its core, driven here --------------------------------------------

    fn run_meta(&mut self, input: MetaInput) {
        if self.meta_down {
            return; // lost: the service is not running
        }
        self.meta.handle(self.q.now(), input);
        // In all builds (the core checks itself after every input in debug builds only).
        self.meta.check_invariants_deep();
        let outputs = self.meta.take_outputs();
        for out in outputs {
            if let Some((kind, n)) = self.meta_crash_after {
                if kind.is_none_or(|k| output_step(&out) == k) {
                    self.meta_outputs += 1;
                    if self.meta_outputs == n {
                        self.meta_crash_after = None;
                        return self.crash_meta(out);
                    }
                }
            }
            match out {
                MetaOutput::Send { to, msg } => self.send(META, to, msg),
                MetaOutput::Save { seq, state } => {
                    // The state file: a save takes a while, and may fail.
                    self.meta_saving = Some((seq, *state));
                    let ok = !self.rng.chance(self.meta_save_failure);
                    let delay = self.rng.range_u64(100, 2_000);
                    let now = self.now();
                    let gen = self.meta_gen;
                    self.q.push_after(now, delay, Ev::MetaSaved { seq, ok, gen }).unwrap();
                }
                MetaOutput::Reply { call, resp } => self.meta_reply(call, resp),
            }
        }
        self.push_durable_map();
        // Garbage collection ran to its end once the core has no job left after a collapse.
        if self.collapse_outcome.is_some() && !self.gc_done && self.meta.is_idle() {
            let now = self.now();
            self.gc_done = true;
            self.log.push(format!("{now} gc done"));
            for c in self.clients.iter_mut() {
                c.active = false;
            }
        }
    }

    /// The metadata service crashes as `out` leaves it: a message is sent or not, a save (this
    /// one or the one in flight) reaches the disk or not; every later output is lost.
    fn crash_meta(&mut self, out: MetaOutput) {
        let now = self.now();
        let lands = self.rng.chance(0.5);
        let step = output_step(&out).to_string();
        self.log.push(format!("{now} metadata service crashes at its output {} ({step}, lands: {lands})", self.meta_outputs));
        self.meta_crash_step = Some(step);
        match out {
            MetaOutput::Send { to, msg } if lands => self.send(META, to, msg),
            MetaOutput::Save { state, .. } if lands => self.meta_disk = *state,
            _ => {
                if let Some((_, state)) = self.meta_saving.take().filter(|_| lands) {
                    self.meta_disk = state;
                }
            }
        }
        self.meta_saving = None;
        self.meta_down = true;
        self.control_lost = self.control.take().map(|(kind, _)| kind);
        let back = self.rng.range_u64(5_000, 60_000);
        self.q.push_after(now, back, Ev::MetaRestart).unwrap();
    }

    fn start_control(&mut self, kind: ControlKind) {
        if self.meta_down {
            // The service is down: the client connects once it is back.
            self.control_lost = Some(kind);
            return;
        }
        let call = self.next_call;
        self.next_call += 1;
        self.control = Some((kind, call));
        if self.faults && self.drop_rng.chance(0.2) {
            // The connection breaks while this request is in flight (or just after its reply).
            let after = self.drop_rng.range_u64(0, 3_000);
            let now = self.now();
            self.q.push_after(now, after, Ev::ClientDrop).unwrap();
        }
        let req = match kind {
            ControlKind::Super => MetaReq::Super { parent: PARENT_NAME.into(), child: CHILD_NAME.into() },
            ControlKind::Collapse => MetaReq::Collapse { child: CHILD_NAME.into() },
            ControlKind::Abort => MetaReq::Abort { child: CHILD_NAME.into() },
        };
        self.run_meta(MetaInput::Request { call, req });
    }

    fn meta_reply(&mut self, call: u64, resp: MetaResp) {
        let now = self.now();
        let Some((kind, c)) = self.control else { return };
        if c != call {
            return;
        }
        self.control = None;
        match (kind, resp) {
            (ControlKind::Collapse | ControlKind::Abort, MetaResp::Err(e)) if e.contains("not decided yet") => {
                // The service keeps at it: look again later, without pushing.
                self.log.push(format!("{now} {kind:?}: {e}"));
                self.undecided_replies += 1;
                self.undecided_waiting = true;
                let later = self.rng.range_u64(200_000, 400_000);
                self.q.push_after(now, later, Ev::Collapse).unwrap();
            }
            (_, MetaResp::Err(e)) if e.contains("cannot save the metadata") || e.contains("retry") => {
                // The service lost the change and said so: the client tries again.
                self.log.push(format!("{now} {kind:?} failed ({e}); retrying"));
                let ev = if kind == ControlKind::Super { Ev::Super } else { Ev::Collapse };
                self.q.push_after(now, 10_000, ev).unwrap();
            }
            (ControlKind::Super, MetaResp::Volume(v)) => {
                assert_eq!(v.vol.parent, Some(PARENT), "super made {v:?}");
                // That it is not pending (confirmed by the tracking shard) the metadata core
                // checks itself (`check_invariants`, run after every step).
                assert!(v.vol.id == CHILD || self.meta_crash_step.is_some() || self.client_drops > 0, "super made {v:?}");
                self.child_id = v.vol.id;
                self.super_end_us = Some(now);
                self.log.push(format!("{now} super returned"));
                for c in self.clients.iter_mut().filter(|c| c.child) {
                    c.active = true;
                }
                for c in 0..self.clients.len() {
                    if self.clients[c].child {
                        self.schedule_client(c, 100);
                    }
                }
                let at = self.rng.range_u64(100_000, 400_000);
                self.q.push_after(now, at, Ev::Collapse).unwrap();
            }
            (ControlKind::Collapse | ControlKind::Abort, MetaResp::Err(e))
                if (self.meta_crash_step.is_some() || self.client_drops > 0 || self.undecided_replies > 0) && ["not a super child", "no volume named", "was promoted"].iter().any(|m| e.contains(m)) =>
            {
                // A collapse or abort retried after the metadata service crashed, the client's
                // connection broke or the call ended undecided: the first attempt took effect (the restarted service recorded it). The client looks the
                // outcome up, as an operator would with `volume list`.
                let promoted = self.meta.durable().volumes.get(CHILD_NAME).is_some_and(|c| c.super_parent.is_none());
                let o = if promoted { CollapseOutcome::Promoted } else { CollapseOutcome::Rejected };
                self.log.push(format!("{now} {kind:?} retried: {e}; the volumes say {o:?}"));
                self.collapse_outcome = Some(o);
                for c in self.clients.iter_mut() {
                    if c.child != promoted {
                        c.active = false;
                    }
                }
            }
            (ControlKind::Abort, MetaResp::Volume(v)) => {
                assert_eq!((v.vol.id, v.super_child.as_deref()), (PARENT, None), "abort answered {v:?}");
                self.log.push(format!("{now} abort -> parent kept"));
                self.collapse_outcome = Some(CollapseOutcome::Rejected);
                for c in self.clients.iter_mut().filter(|c| c.child) {
                    c.active = false;
                }
            }
            (ControlKind::Collapse, MetaResp::Collapsed { outcome: o, volume }) => {
                self.log.push(format!("{now} collapse -> {o:?}"));
                let promoted = o == CollapseOutcome::Promoted;
                assert_eq!(volume.is_some(), promoted, "collapse {o:?} answered volume {volume:?}");
                self.collapse_outcome = Some(o);
                // The loser's clients stop; the survivor keeps going a while.
                for c in self.clients.iter_mut() {
                    if c.child != promoted {
                        c.active = false;
                    }
                }
            }
            (kind, resp) => {
                let tk = ObjKey { table: TABLE, objno: TRACK_OBJNO, owner: 0 };
                let states: Vec<String> = self
                    .shards
                    .iter()
                    .map(|s| match &s.core {
                        Some(c) => format!("{:?} {:?}", c.objects().get(&tk), c.table_track(TABLE)),
                        None => "down".into(),
                    })
                    .collect();
                panic!("{kind:?} answered {resp:?}\n{states:#?}\nplacement {:?}\n{}", self.map.placement(tk.slot()), self.log.join("\n"))
            }
        }
    }

    /// Whether the durable state shows the collapse decided (the child gone or promoted).
    fn collapse_decided(&self) -> bool {
        self.meta.durable().volumes.get(CHILD_NAME).is_none_or(|c| c.super_parent.is_none())
    }

    fn meta_receive(&mut self, from: NodeId, msg: Msg) {
        if self.meta_down {
            return;
        }
        match msg {
            Msg::Recovered { shard, epoch } => self.member(MemberInput::Recovered { shard, epoch }),
            Msg::Reply { req, result } => {
                self.member(MemberInput::Heard { shard: from });
                if req < PING_REQ_BASE {
                    self.run_meta(MetaInput::ShardReply { from, req, result });
                }
            }
            _ => {}
        }
    }

    fn why_busy(&self) -> String {
        let clients: Vec<String> = self.clients.iter().map(|c| format!("active {} current {:?}", c.active, c.current.as_ref().map(|x| &x.2))).collect();
        let shards: Vec<String> = self
            .shards
            .iter()
            .map(|s| match &s.core {
                Some(c) => format!("ops {} recovering {} {}", c.ops_in_flight(), c.is_recovering(), c.debug_ops()),
                None => "down".into(),
            })
            .collect();
        format!(
            "control {:?} meta idle {} jobs {:?} waiting for {:?} clients {clients:#?} shards {shards:#?} map {:?}",
            self.control,
            self.meta.is_idle(),
            self.meta.durable().jobs,
            volume::core::meta::pending_shards(&self.meta),
            self.map
        )
    }

    fn quiet(&self) -> bool {
        self.gc_done
            && !self.faults
            && !self.meta_down
            && self.clients.iter().all(|c| c.current.is_none() && !c.active)
            && !self.out_of_service()
            && self.control.is_none()
            && self.meta.is_idle()
            && self.shards.iter().all(|s| s.core.as_ref().is_some_and(|c| c.ops_in_flight() == 0 && !c.is_recovering()))
    }
}

/// Values a block may hold given a single writer's history: the last acknowledged write, or any
/// write issued after it (unacknowledged, failed or refused: a refused retry may follow an
/// earlier attempt that landed, so it may or may not be there).
fn allowed(writes: &[&WriteRec], initial: &BTreeSet<u64>) -> BTreeSet<u64> {
    let last_acked = writes.iter().rposition(|w| w.acked_us.is_some());
    let mut out = match last_acked {
        Some(i) => BTreeSet::from([writes[i].value]),
        None => initial.clone(),
    };
    let from = last_acked.map_or(0, |i| i + 1);
    out.extend(writes[from..].iter().map(|w| w.value));
    out
}

/// Position of a value in a single-writer register's history: 0 for the initial value, i + 1 for
/// the i-th write. A zero may be the initial value or a zeroing write.
fn positions(v: u64, writes: &[&WriteRec], initial: &BTreeSet<u64>) -> Vec<usize> {
    let mut p: Vec<usize> = writes.iter().enumerate().filter(|(_, w)| w.value == v).map(|(i, _)| i + 1).collect();
    if initial.contains(&v) {
        p.push(0);
    }
    p
}

/// Atomic-register check for one read: the value was written (or initial), not before the last
/// write acknowledged before the read began, not issued after the read ended, and not older than
/// what an earlier, non-overlapping read returned.
fn check_read(r: &ReadRec, writes: &[&WriteRec], initial: &BTreeSet<u64>, earlier: &[&ReadRec]) -> Result<(), String> {
    let (done_us, v) = r.done.unwrap();
    let floor = writes.iter().rposition(|w| w.acked_us.is_some_and(|a| a < r.invoked_us)).map_or(0, |i| i + 1);
    let floor = earlier
        .iter()
        .filter_map(|o| o.done.map(|(_, ov)| positions(ov, writes, initial).into_iter().min().unwrap_or(0)))
        .fold(floor, usize::max);
    let ok = positions(v, writes, initial).into_iter().any(|p| p >= floor && (p == 0 || writes[p - 1].issued_us <= done_us));
    if ok {
        Ok(())
    } else {
        Err(format!("read {r:?} returned {v}, not linearizable: writes {writes:?}, initial {initial:?}, floor {floor}"))
    }
}

/// What one seed exercised.
#[derive(Default)]
struct Exercised {
    deferred_made: u64,
    deferred_completed: u64,
    store_recovery: StoreRecovery,
    /// Metadata saves that failed, and control requests retried after one.
    meta_save_failures: u64,
    control_retries: u64,
    /// The output the metadata service crashed with, if it crashed.
    meta_crash_step: Option<String>,
    restarted_with_pending: bool,
    /// Broken connections (client - metadata service, metadata service - shard), collapse
    /// calls that ended undecided, and collapses decided in the background after one.
    client_drops: u64,
    link_drops: u64,
    undecided_replies: u64,
    decided_in_background: u64,
}

/// About a third of the seeds abort instead of collapsing (from their own generator, so the
/// other seeds' runs are unchanged).
fn aborts(seed: u64) -> bool {
    SimRng::new(seed ^ 0xab0b_7ab0).chance(0.3)
}

/// Runs one seed and checks it.
fn run_seed(seed: u64) -> Exercised {
    run_seed_with(seed, crash_in_commands())
}

/// Runs one seed, its crashes waiting for a disk command or not, and checks it.
fn run_seed_with(seed: u64, crash_in_commands: bool) -> Exercised {
    eprintln!("seed {seed}");
    let mut w = World::new(seed);
    w.crash_in_commands = crash_in_commands;
    let mut steps = 0u64;
    while w.step() {
        steps += 1;
        if w.quiet() && w.now() > 1_000_000 {
            break;
        }
        assert!(w.now() < 20_000_000, "seed {seed}: no quiescence after 20 s virtual: {}\n{}", w.why_busy(), w.log.join("\n"));
        assert!(steps < 20_000_000, "seed {seed}: too many steps");
    }
    let ctx = || format!("seed {seed} (parent keeps writing: {}, abort: {})\n{}", w.parent_keeps_writing, w.abort, w.log.join("\n"));
    assert!(w.quiet(), "seed {seed}: event queue ran dry before quiescence\n{}", ctx());
    let outcome = w.collapse_outcome.unwrap_or_else(|| panic!("no collapse outcome\n{}", ctx()));
    let (super_start, super_end) = (w.super_start_us.unwrap(), w.super_end_us.unwrap());
    let promoted = outcome == CollapseOutcome::Promoted;

    // Safety (§4.4): a promoted child means no parent write issued after super returned was
    // acknowledged.
    if promoted {
        for h in w.history.iter().filter(|h| !h.child) {
            assert!(
                !(h.issued_us > super_end && h.acked_us.is_some()),
                "promoted, yet parent write {h:?} issued after super returned was acknowledged\n{}",
                ctx()
            );
        }
    }
    if w.abort {
        assert!(!promoted, "aborted, yet the child was promoted\n{}", ctx());
    } else if !w.parent_keeps_writing {
        assert!(promoted, "the parent stayed silent, yet collapse rejected the child\n{}", ctx());
    }
    if !promoted {
        // The parent keeps permission to write through a rejection or an abort.
        assert!(w.parent_refused.is_empty(), "not promoted, yet parent writes were refused at {:?}\n{}", w.parent_refused, ctx());
    }

    // Replicas agree, and nothing of the loser is left.
    let survivor = if promoted { w.child_id } else { PARENT };
    let mut contents: BTreeMap<ObjKey, Vec<u8>> = BTreeMap::new();
    for s in 0..SHARDS {
        let sh = &mut w.shards[s as usize];
        let keys: Vec<ObjKey> = sh.core.as_ref().unwrap().objects().keys().copied().collect();
        for k in keys {
            // Nothing of the loser, nor of a child undone at a restart.
            if k.owner != survivor && k.objno != TRACK_OBJNO {
                let held: Vec<String> = (0..SHARDS)
                    .map(|t| {
                        let keys: Vec<&ObjKey> = w.shards[t as usize].core.as_ref().unwrap().objects().keys().filter(|x| x.slot() == k.slot()).collect();
                        format!("shard {t}: {keys:?}")
                    })
                    .collect();
                panic!("shard {s} still holds {k:?} of the collapsed-away volume; placement {:?}; {held:#?}\n{}", w.map.placement(k.slot()), ctx());
            }
            assert!(w.map.placement(k.slot()).contains(&s), "shard {s} holds {k:?} outside its placement");
            let mut bytes = match sh.store.as_ref().expect("a running shard has its store").run(DiskCmd::ReadAll { key: k }) {
                Ok(DiskOut::Data(bytes)) => bytes,
                other => panic!("shard {s} cannot read {k:?} it holds: {other:?}\n{}", ctx()),
            };
            if k.objno != TRACK_OBJNO {
                while bytes.last() == Some(&0) {
                    bytes.pop();
                }
            }
            if let Some(prev) = contents.get(&k) {
                if prev != &bytes {
                    let summary = |b: &Vec<u8>| b.chunks(BLOCK_BYTES as usize).map(|c| c[..8.min(c.len())].to_vec()).map(|c| c.first().copied().unwrap_or(0)).collect::<Vec<u8>>();
                    let versions: Vec<String> = (0..SHARDS)
                        .map(|t| format!("shard {t}: {:?}", w.shards[t as usize].core.as_ref().unwrap().objects().get(&k)))
                        .collect();
                    panic!("replicas of {k:?} differ (shard {s}): {:?} vs {:?}; {versions:?}\n{}", summary(prev), summary(&bytes), ctx());
                }
            }
            contents.insert(k, bytes);
        }
        for (slot, placement) in (0..OBJECTS).map(|o| (Slot { table: TABLE, objno: o }, w.map.placement(Slot { table: TABLE, objno: o }))) {
            let key = ObjKey { table: slot.table, objno: slot.objno, owner: survivor };
            let here = w.shards[s as usize].core.as_ref().unwrap().objects().contains_key(&key);
            if placement.contains(&s) {
                let anywhere = (0..SHARDS).any(|t| w.shards[t as usize].core.as_ref().unwrap().objects().contains_key(&key));
                assert_eq!(here, anywhere, "shard {s} is missing {key:?}\n{}", ctx());
            }
        }
    }

    // Content: every block holds what the history allows.
    for b in 0..BLOCKS {
        let objno = b / (OBJECT_BYTES / BLOCK_BYTES) as u64;
        let key = ObjKey { table: TABLE, objno, owner: survivor };
        let bytes = contents.get(&key).cloned().unwrap_or_default();
        let off = ((b % (OBJECT_BYTES / BLOCK_BYTES) as u64) * BLOCK_BYTES as u64) as usize;
        let mut blk = vec![0u8; BLOCK_BYTES as usize];
        let avail = bytes.len().saturating_sub(off).min(BLOCK_BYTES as usize);
        if avail > 0 {
            blk[..avail].copy_from_slice(&bytes[off..off + avail]);
        }
        let got = block_value(&blk);
        assert_eq!(blk, value_bytes(got, BLOCK_BYTES as usize), "block {b} is torn: {blk:?}\n{}", ctx());
        let parent_writes: Vec<&WriteRec> = w.history.iter().filter(|h| !h.child && h.block == b).collect();
        let child_writes: Vec<&WriteRec> = w.history.iter().filter(|h| h.child && h.block == b).collect();
        let expect = if promoted {
            // The parent at super: the last write acknowledged before super began, or any write
            // in flight across super.
            let before: Vec<&WriteRec> = parent_writes.iter().copied().filter(|h| h.acked_us.is_some_and(|a| a < super_start)).collect();
            let mut at_super = before.last().map_or(BTreeSet::from([0]), |h| BTreeSet::from([h.value]));
            at_super.extend(
                parent_writes
                    .iter()
                    .filter(|h| h.issued_us <= super_end && h.acked_us.is_none_or(|a| a >= super_start))
                    .map(|h| h.value),
            );
            if child_writes.is_empty() { at_super } else { allowed(&child_writes, &at_super) }
        } else {
            allowed(&parent_writes, &BTreeSet::from([0]))
        };
        if !expect.contains(&got) {
            let hist: Vec<String> = w.history.iter().filter(|h| h.block == b).map(|h| format!("{h:?}")).collect();
            let versions: Vec<String> = (0..SHARDS)
                .map(|t| format!("shard {t}: {:?}", w.shards[t as usize].core.as_ref().unwrap().objects().get(&key)))
                .collect();
            panic!("block {b}: holds {got}, allowed {expect:?}\n{}\n{versions:?}\n{}", hist.join("\n"), ctx());
        }
    }

    // Every completed read is linearizable: each block is a single-writer register per volume.
    for r in w.reads.iter().filter(|r| r.done.is_some()) {
        if r.child && !promoted {
            continue; // a rejected child may see parent writes (§4.2.1); it is discarded anyway
        }
        let writes: Vec<&WriteRec> = w.history.iter().filter(|h| h.child == r.child && h.block == r.block).collect();
        let initial: BTreeSet<u64> = if r.child {
            let pw: Vec<&WriteRec> = w.history.iter().filter(|h| !h.child && h.block == r.block).collect();
            let before: Vec<&&WriteRec> = pw.iter().filter(|h| h.acked_us.is_some_and(|a| a < super_start)).collect();
            let mut s = before.last().map_or(BTreeSet::from([0]), |h| BTreeSet::from([h.value]));
            s.extend(pw.iter().filter(|h| h.issued_us <= super_end && h.acked_us.is_none_or(|a| a >= super_start)).map(|h| h.value));
            s
        } else {
            BTreeSet::from([0])
        };
        let earlier: Vec<&ReadRec> = w
            .reads
            .iter()
            .filter(|o| o.child == r.child && o.block == r.block && o.done.is_some_and(|(t, _)| t < r.invoked_us))
            .collect();
        check_read(r, &writes, &initial, &earlier).unwrap_or_else(|e| panic!("{e}\n{}", ctx()));
    }

    // The tracking object was reset, and a promoted parent is fenced everywhere.
    for s in 0..SHARDS {
        let core = w.shards[s as usize].core.as_ref().unwrap();
        if let Some(t) = core.table_track(TABLE) {
            assert!(t.current.is_none(), "shard {s}: tracking object not reset: {t:?}");
        }
        if promoted {
            assert!(
                matches!(core.tracking_entry(PARENT), Some(TrackEntry::Fenced { .. })),
                "shard {s}: promoted parent not fenced: {:?}\n{}",
                core.tracking_entry(PARENT),
                ctx()
            );
        }
    }
    // The metadata service ends consistent with the outcome, its jobs done.
    let state = w.meta.durable();
    assert!(state.jobs.is_empty(), "jobs left: {:?}\n{}", state.jobs, ctx());
    assert!(state.volumes.values().all(|v| !v.super_pending && v.super_parent.is_none()), "a super child is left: {:?}\n{}", state.volumes, ctx());
    assert_eq!(&w.meta_disk, state, "the state file differs from the durable state\n{}", ctx());
    let names: Vec<&String> = state.volumes.keys().collect();
    if promoted {
        assert_eq!(names, [CHILD_NAME], "{}", ctx());
        let c = &state.volumes[CHILD_NAME];
        assert!(c.vol.parent.is_none() && c.super_parent.is_none(), "promoted child still has a parent: {c:?}");
    } else {
        assert_eq!(names, [PARENT_NAME], "{}", ctx());
        assert!(state.volumes[PARENT_NAME].super_child.is_none());
    }
    Exercised {
        deferred_made: w.shards.iter().map(|s| s.deferred_copies().0).sum(),
        deferred_completed: w.shards.iter().map(|s| s.deferred_copies().1).sum(),
        store_recovery: w.shards.iter().fold(StoreRecovery::default(), |a, s| a.plus(&s.recovery)),
        meta_save_failures: w.log.iter().filter(|l| l.contains("metadata save")).count() as u64,
        control_retries: w.log.iter().filter(|l| l.contains("retrying")).count() as u64,
        meta_crash_step: w.meta_crash_step.clone(),
        restarted_with_pending: w.restarted_with_pending,
        client_drops: w.client_drops,
        link_drops: w.link_drops,
        undecided_replies: w.undecided_replies,
        decided_in_background: w.decided_in_background,
    }
}

/// Kinds of the metadata service's outputs a crash may come with: each step of super (record,
/// tell the tracking shard, confirm), collapse, abort (mark written, then collapse) and GC (every
/// shard, then end the super), and the reply.
const META_STEPS: [&str; 8] = ["save", "send Super", "send Collapse", "send Permission", "send Gc", "send EndSuper", "send other", "reply"];

fn output_step(out: &MetaOutput) -> &'static str {
    match out {
        MetaOutput::Save { .. } => "save",
        MetaOutput::Reply { .. } => "reply",
        MetaOutput::Send { msg, .. } => match msg {
            Msg::Super { .. } => "send Super",
            Msg::Collapse { .. } => "send Collapse",
            Msg::Permission { .. } => "send Permission",
            Msg::Gc { .. } => "send Gc",
            Msg::EndSuper { .. } => "send EndSuper",
            _ => "send other",
        },
    }
}

/// About half the seeds crash the metadata service once: after the n-th output of a kind (or of
/// any kind), drawn from the seed's own generator, so the other seeds' runs are unchanged.
/// (A kind the seed never emits, e.g. an abort's mark in a collapsing seed, means no crash.)
fn meta_crash_after(seed: u64) -> Option<(Option<&'static str>, u64)> {
    let mut rng = SimRng::new(seed ^ 0x3e7a_c4a5);
    if !rng.chance(0.5) {
        return None;
    }
    if rng.chance(0.25) {
        return Some((None, rng.range_u64(1, 40)));
    }
    let kind = META_STEPS[rng.range_u64(0, META_STEPS.len() as u64 - 1) as usize];
    Some((Some(kind), rng.range_u64(1, 3)))
}

/// The seeds that found two shard-core bugs once the real store met the real metadata-service
/// restart, run as they were found (crashes at once, not waiting for a disk command): seed 17
/// lost an acknowledged write (a recovering replica dropped a pulled object after a collect
/// that moved nothing there: "block 22: holds 0, allowed {2}"), seed 373 never became quiet
/// (a slot sync a new map ended kept its slot locked: "no quiescence after 20 s virtual").
/// Their mechanisms have unit tests in `core::shard`.
#[test]
fn seeds_17_and_373_with_crashes_at_once() {
    for seed in [17, 373] {
        run_seed_with(seed, false);
    }
}

/// Every shard crash waits for the shard's next disk command (20 ms at most), so the power cut
/// lands inside the store's commands (102 commands cut, 8 objects left suspect over the 400
/// default seeds). Crashing at once instead (`SIM_CRASH_IN_COMMANDS=0`) lands inside one only
/// when a command happens to be in flight: 62 cut and 3 suspect objects over 1000 seeds, none
/// in the first 400 once the real metadata-service restart shifted the seeds' runs, so the
/// check below that a cut left a suspect object failed. It was off by default for a shard-core
/// bug it found at seed 42 (after an abort, the tracking primary crashes during garbage
/// collection while a replicated child write it refused is still on one replica; the new
/// primary takes the slot as in sync and never collects that copy: "shard 0 still holds
/// ObjKey { table: 1, objno: 0, owner: 2 } of the collapsed-away volume"); on the merged tree
/// no seed of 1000 finds it. The store's own crash rules are checked at every point of every
/// kind of command by `store::tests::a_power_cut_anywhere_in_a_command_keeps_the_stores_crash_rules`.
#[test]
fn super_collapse_under_faults_many_seeds() {
    if let Ok(seed) = std::env::var("SIM_SEED") {
        run_seed(seed.parse().expect("SIM_SEED is a number"));
        return;
    }
    let seeds: u64 = std::env::var("SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(400);
    if std::env::var("SIM_KEEP_GOING").is_ok() {
        // For investigation: every seed runs, and the failing ones are listed at the end.
        std::panic::set_hook(Box::new(|_| {}));
        let failed: Vec<u64> = (0..seeds).filter(|&seed| std::panic::catch_unwind(|| run_seed(seed)).is_err()).collect();
        let _ = std::panic::take_hook();
        panic!("{} of {seeds} seeds passed; failed: {failed:?}", seeds - failed.len() as u64);
    }
    let mut total = Exercised::default();
    let mut crash_steps: BTreeMap<String, u64> = BTreeMap::new();
    let mut pending_restarts = 0;
    for seed in 0..seeds {
        let e = run_seed(seed);
        if let Some(step) = &e.meta_crash_step {
            *crash_steps.entry(step.clone()).or_default() += 1;
        }
        pending_restarts += e.restarted_with_pending as u64;
        total.deferred_made += e.deferred_made;
        total.deferred_completed += e.deferred_completed;
        total.store_recovery = total.store_recovery.plus(&e.store_recovery);
        total.meta_save_failures += e.meta_save_failures;
        total.control_retries += e.control_retries;
        total.client_drops += e.client_drops;
        total.link_drops += e.link_drops;
        total.undecided_replies += e.undecided_replies;
        total.decided_in_background += e.decided_in_background;
    }
    eprintln!(
        "broken connections: {} client, {} metadata service - shard; collapse calls ended undecided: {}, then decided in the background: {}",
        total.client_drops, total.link_drops, total.undecided_replies, total.decided_in_background
    );
    if seeds >= 200 {
        assert!(total.client_drops > 0 && total.link_drops > 0, "no connection broke");
        assert!(total.decided_in_background > 0, "no undecided collapse was finished by the service on its own");
    }
    let (made, completed) = (total.deferred_made, total.deferred_completed);
    // The store deferred copies: the partial-copy paths ran.
    let aborted = (0..seeds).filter(|s| aborts(*s)).count();
    eprintln!("deferred copies: {made} made, {completed} completed over {seeds} seeds ({aborted} aborted)");
    assert!(seeds < 20 || aborted > 0, "no seed aborted");
    eprintln!("metadata saves failed: {}, control requests retried: {}", total.meta_save_failures, total.control_retries);
    assert!(seeds < 20 || (made > 0 && completed > 0), "no deferred copy was made ({made}) or completed ({completed})");
    // Crashes land inside the real store's commands, and its recovery at open ran.
    let r = total.store_recovery;
    eprintln!("store crash recovery: {r:?}");
    assert!(seeds < 200 || (r.commands_cut > 0 && r.suspect_objects > 0), "no crash cut a store command short and left a suspect object: {r:?}");
    assert!(seeds < 20 || (total.meta_save_failures > 0 && total.control_retries > 0), "the metadata core's failure paths never ran");
    // The metadata service crashed at every kind of step of super, collapse, abort and GC.
    eprintln!("metadata service crashes, by the output they came with: {crash_steps:?}; restarts with a pending super child: {pending_restarts}");
    assert!(seeds < 200 || pending_restarts > 0, "no restart found a super child recorded but not confirmed");
    if seeds >= 200 {
        for step in META_STEPS.iter().filter(|s| **s != "send other") {
            assert!(crash_steps.contains_key(*step), "no seed crashed the metadata service at {step:?}: {crash_steps:?}");
        }
    }
}
