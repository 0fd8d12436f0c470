//! Model check (stateright) of the REAL witness-KV core, `kv::witness::core::node::WitnessCore`,
//! against the `always` properties of spec `candstore.md` (d).
//!
//! The model's transitions call `WitnessCore::handle` and carry out its outputs; nothing of the
//! protocol is re-implemented here. What the harness abstracts:
//! - the network is a *set* of in-flight messages (any order; an identical re-send merges with
//!   the copy in flight); a bounded number may be lost; messages to a crashed node vanish;
//! - NVMM: each node's `PmemAppend`s queue as pending and become durable together by a
//!   `Persist` action, which reports `PmemPersisted` with the newest seq (the driver contract:
//!   persists are reported in order); a crash keeps the durable image, loses the pending ones;
//!   `PmemTruncate` / `PmemFree` apply to the image at once (`PmemFree` moves the entries to the
//!   "written back" set: the core frees only after the SSD write is durable);
//! - SSD writes, reads and frees complete at once (the backup's segments in a `MemSsd`);
//! - time is one global clock that moves only by a `Tick` action with a jump: small (a
//!   heartbeat period: heartbeats, retransmits, writeback linger), soft (past the soft timeout)
//!   or hard (past every election timeout and lease). A tick is offered only when it would
//!   do something (tried on a clone). Timers and `sent_us` are left out of the fingerprint, and
//!   a core is fingerprinted through its public accessors (role, term, commit and last index,
//!   key and value stamps, backup index, recovery) plus its durable NVMM and SSD state — an
//!   abstraction like HEAL's `model_fingerprint`: states differing only in hidden counters merge;
//! - one client, one operation outstanding at a time, sent to a head of its choice; an op whose
//!   node crashes is abandoned (indeterminate). Put values are unique.
//! - the first primary's election and its no-op commit are run by a fixed script before the
//!   check (the initial state is a serving P with an empty store): the check's depth goes to
//!   writes and failures, not to the boot.
//!
//! Checked, as `always` properties:
//! - election safety: ≤1 leader (provisional or full) per term, never a backup in any role
//!   but follower (from the cores' `Role` outputs, a ghost map kept across crashes);
//! - commit rule: every acknowledged Put (key, value) is durable at every voting backup
//!   (its NVMM image, or written back) — checked in every state, so a later truncation of a
//!   committed entry fails it too;
//! - read safety: every Get answer is the value of the newest acknowledged Put of its key or
//!   of a Put still indeterminate (a ghost history, as `model_check.rs` keeps);
//! - install monotone: no input lowers a head's key stamp or local value stamp (an old
//!   primary dropping its whole value table to serve as a witness, M24, excepted);
//! - lease safety: at no time do two live leaders both hold an unexpired lease;
//! - the core's own `check_invariants_deep` (a panic is recorded as a violation).
//! - the backup's writeback and GC rules: every key freed from a backup's NVMM has a version
//!   at least as new in its SSD segments (GC never drops the newest version); with GC running
//!   all the time in `model_check_witness_backup_gc_keeps_the_newest_version`.
//!
//! Bounds (CI default): P+B+W, 2 keys, 2 Puts, 2 Gets, 1 crash of P, 1 drop, 6 ticks; BFS to
//! `MODEL_DEPTH` (default 7: ~130k states in ~6 s debug; depth 9 is ~2.3M states, ~2 min),
//! then `MODEL_SIM_STATES` seeded random walks (default 100000; 4 Gets, 12 ticks) that go
//! through the crash, the witness's election, reconciliation and live recovery — a
//! `sometimes` property (a Get answered by the new primary) asserts that they do. The walks
//! favour delivery and persistence over new operations, ticks and faults (`Weighted`).
//! `MODEL_SEED`, `MODEL_CRASH_NODES=0,1,2`, `MODEL_PUTS`, `MODEL_GETS`, `MODEL_KEYS`,
//! `MODEL_DROPS`, `MODEL_CRASHES`, `MODEL_TICKS` change the bounds; `MODEL_VERBOSE=1` prints
//! counterexamples. Also checked by walks: a crash of any one node, and the N = 2 layout.
//!
//! Deliberately broken variants (`Params::fault`, test-only), each caught:
//! - `MajorityQuorum` (commit on a majority of voters): the commit rule fails by BFS within 8
//!   steps, for N = 1 and N = 2;
//! - `InstallWithoutStampCheck` (a pulled value taken as current): read safety fails — the
//!   new primary serves v1 after v2 was acknowledged — found by seeded walks (seed 2, ~17k
//!   states) and shown step by step by `model_check_witness_scripted_failover_read`;
//! - `NoLeaseWait` (votes granted within the lease): lease safety fails — the witness leads
//!   term 2 while the primary's lease from term 1 runs — found by seeded walks (seed 1).
//!
//! Membership changes (M22, `model_check_witness_substitution`): a `Reconfigure` action gives
//! the serving leader one change (the N = 2 layout: witness 3 substitutes for backup 2) at any
//! point, and a crash of backup 2 or of the primary; the commit rule then asks every backup
//! voting in every configuration a live node holds. BFS to `MODEL_RECONF_DEPTH` (default 5;
//! depth 6 is ~118k states, ~32 s debug), then seeded walks (default 30000 states), which
//! must acknowledge a Put under the substituted configuration.
//!
//! Not modelled (yet): restarts (`WitnessCore::restore`), the spec's PriorityPull-from-SSD-only
//! variant, partitions longer than one drop, SSD errors.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use kv::witness::core::config::{Change, Config};
use kv::witness::core::node::{
    Input, Output, Params, PmemRecord, RoleKind, WitnessCore, WitnessFault,
};
use kv::witness::core::ssd::MemSsd;
use kv::witness::proto::{ClientReply, ClientReq, Entry, NodeId, PeerBody, PeerMsg};
use stateright::{Checker, Model as SrModel, Property};

const KEYS: [&[u8]; 2] = [b"a", b"b"];
const MS: u64 = 1_000;

fn params(fault: WitnessFault) -> Params {
    Params {
        heartbeat_us: 5 * MS,
        election_timeout_us: 150 * MS,
        election_jitter_us: 20 * MS,
        lease_us: 100 * MS,
        clock_drift_us: 10 * MS,
        // Longer than a soft jump: a proactive pull right after a commit finds the newest
        // version still in the backup's NVMM buffer, not yet in the SSD log it reads.
        writeback_linger_us: 40 * MS,
        pull_retry_us: 5 * MS,
        soft_timeout_us: 30 * MS,
        fault,
        ..Params::default()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Jump {
    Small,
    Soft,
    Hard,
}

impl Jump {
    fn us(self) -> u64 {
        match self {
            Jump::Small => 5 * MS,
            Jump::Soft => 31 * MS,
            // Past the lowest-ranked head's election deadline (150 + 2·20 + 10 ms) and any lease.
            Jump::Hard => 260 * MS,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Bounds {
    /// Keys the client uses (1: every Put overwrites the same key).
    keys: usize,
    puts: u8,
    gets: u8,
    crashes: u8,
    drops: u8,
    ticks: u8,
}

#[derive(Clone)]
struct Check {
    cfg: Config,
    p: Params,
    bounds: Bounds,
    crash_nodes: Vec<NodeId>,
    /// Membership changes a `Reconfigure` action may ask of the serving leader (once a run).
    changes: Vec<Change>,
}

#[derive(Clone, Default)]
struct NodeSt {
    /// None: crashed.
    core: Option<WitnessCore>,
    meta: Option<(u64, Option<NodeId>)>,
    /// Durable NVMM entry records by index.
    nvmm: BTreeMap<u64, Entry>,
    /// Appended, not yet durable: (seq, record).
    pending: Vec<(u64, PmemRecord)>,
    /// (key, value) of entries freed from NVMM after their SSD write.
    written_back: BTreeSet<(Vec<u8>, Vec<u8>)>,
    /// Ghost: the newest stamp (term, index) of each key freed from NVMM after its SSD write.
    wb_newest: BTreeMap<Vec<u8>, (u64, u64)>,
    ssd: MemSsd,
}

impl NodeSt {
    fn holds(&self, key: &[u8], value: &[u8]) -> bool {
        self.written_back.contains(&(key.to_vec(), value.to_vec()))
            || self
                .nvmm
                .values()
                .any(|e| e.key() == Some(key) && e.value() == Some(value))
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum ClientOp {
    Put(usize, Vec<u8>),
    Get(usize),
}

#[derive(Clone)]
struct St {
    nodes: Vec<NodeSt>,
    net: BTreeSet<(NodeId, NodeId, Vec<u8>)>,
    /// Not fingerprinted (see the module docs).
    now: u64,
    next_tag: u64,
    client: Option<(u64, NodeId, ClientOp)>,
    puts: u8,
    gets: u8,
    crashes: u8,
    drops: u8,
    ticks: u8,
    reconfigs: u8,
    /// Ghost: per key, the values a Get may return now.
    cands: [BTreeSet<Option<Vec<u8>>>; 2],
    /// Ghost: per key, Put values neither acknowledged nor known failed (may land any time).
    indet: [BTreeSet<Vec<u8>>; 2],
    /// Ghost: acknowledged Puts.
    acked: BTreeSet<(Vec<u8>, Vec<u8>)>,
    /// Ghost: the leader of each term (from `Role` outputs).
    leaders: BTreeMap<u64, NodeId>,
    /// A Get was answered with a value by a node elected after a crash.
    served_after_failover: bool,
    /// A Put was acknowledged by a leader with a substitute in force (M22).
    acked_substituted: bool,
    /// The first violation seen while carrying out an input: (property, why).
    violation: Option<(&'static str, String)>,
}

fn role_code(r: RoleKind) -> u8 {
    match r {
        RoleKind::Follower => 0,
        RoleKind::Candidate => 1,
        RoleKind::Provisional => 2,
        RoleKind::Leader => 3,
    }
}

/// A message's bytes with its timestamps zeroed (fingerprint only).
fn timeless(b: &[u8]) -> Vec<u8> {
    let mut m: PeerMsg = postcard::from_bytes(b).unwrap();
    match &mut m.body {
        PeerBody::AppendEntries { sent_us, .. } | PeerBody::AppendAck { sent_us, .. } => {
            *sent_us = 0
        }
        _ => {}
    }
    postcard::to_allocvec(&m).unwrap()
}

fn hash_core<H: Hasher>(c: &WitnessCore, h: &mut H) {
    (
        role_code(c.role()),
        c.term(),
        c.commit_index(),
        c.last_index(),
        c.leader_hint(),
        c.in_recovery(),
        c.missing_keys(),
        c.written_back_through(),
        c.config().epoch,
    )
        .hash(h);
    for k in KEYS {
        (c.key_stamp(k), c.local_value(k), c.backup_index_stamp(k)).hash(h);
    }
}

impl Hash for St {
    fn hash<H: Hasher>(&self, h: &mut H) {
        for n in &self.nodes {
            match &n.core {
                None => 0u8.hash(h),
                Some(c) => {
                    1u8.hash(h);
                    hash_core(c, h);
                }
            }
            let pend: Vec<_> = n.pending.iter().map(|(_, r)| format!("{r:?}")).collect();
            let nv: Vec<_> = n.nvmm.values().map(|e| format!("{e:?}")).collect();
            (&n.meta, nv, pend, &n.written_back, &n.wb_newest, &n.ssd).hash(h);
        }
        for (f, t, b) in &self.net {
            (f, t, timeless(b)).hash(h);
        }
        (
            &self.client,
            self.puts,
            self.gets,
            self.crashes,
            self.drops,
            self.ticks,
            self.reconfigs,
        )
            .hash(h);
        (
            &self.cands,
            &self.indet,
            &self.acked,
            &self.leaders,
            &self.violation,
        )
            .hash(h);
        (self.served_after_failover, self.acked_substituted).hash(h);
    }
}

impl PartialEq for St {
    fn eq(&self, o: &Self) -> bool {
        let fp = |s: &St| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            s.hash(&mut h);
            h.finish()
        };
        fp(self) == fp(o)
    }
}
impl Eq for St {}

impl fmt::Debug for St {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "now {} ms, leaders {:?}", self.now / MS, self.leaders)?;
        for (i, n) in self.nodes.iter().enumerate() {
            match &n.core {
                None => writeln!(f, "  node {i}: CRASHED")?,
                Some(c) => {
                    let ks: Vec<String> = KEYS
                        .iter()
                        .map(|k| {
                            format!(
                                "{}: key {:?} value {:?}",
                                k[0] as char,
                                c.key_stamp(k),
                                c.local_value(k)
                                    .map(|(s, v)| (s, String::from_utf8_lossy(v)))
                            )
                        })
                        .collect();
                    writeln!(
                        f,
                        "  node {i}: {:?} term {} commit {} last {} {}",
                        c.role(),
                        c.term(),
                        c.commit_index(),
                        c.last_index(),
                        ks.join("; ")
                    )?
                }
            }
            writeln!(
                f,
                "    nvmm {:?} pending {} written back {:?}",
                n.nvmm
                    .values()
                    .map(|e| (
                        e.index,
                        e.key().map(|k| k[0] as char),
                        e.value().map(String::from_utf8_lossy)
                    ))
                    .collect::<Vec<_>>(),
                n.pending.len(),
                n.written_back.len()
            )?;
        }
        writeln!(
            f,
            "  net {} msgs, client {:?}, acked {:?}",
            self.net.len(),
            self.client,
            self.acked
        )?;
        if let Some(v) = &self.violation {
            writeln!(f, "  VIOLATION ({}): {}", v.0, v.1)?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    Put(NodeId, usize),
    Get(NodeId, usize),
    Deliver(NodeId, NodeId, Vec<u8>),
    Drop(NodeId, NodeId, Vec<u8>),
    Persist(NodeId),
    Tick(NodeId, Jump),
    Crash(NodeId),
    /// The serving leader `.0` is asked for `changes[.1]`.
    Reconfigure(NodeId, usize),
}

const P_ELECTION: &str = "election safety: <=1 leader per term, never a backup";
const P_COMMIT: &str = "commit rule: an acked Put is durable at every voting backup";
const P_READ: &str = "read safety: a Get returns the newest acked or an indeterminate Put";
const P_MONO: &str = "install monotone: no key or value stamp goes down";
const P_LEASE: &str = "lease safety: no two live leaders with unexpired leases";
const P_CORE: &str = "the core's own invariants";
const P_GC: &str =
    "backup SSD: the newest written-back version of every key is on SSD (GC never drops it)";
/// Reached by the random walks (asserted): the crash, a new leader, and a Get answered by it.
const S_FAILOVER: &str = "a Get is answered by a witness elected after the primary's crash";
/// Reached by the substitution walks (asserted): writes go on under the changed quorum.
const S_SUBSTITUTED: &str =
    "a Put is acknowledged by a leader whose configuration has a substitute";

fn set_violation(s: &mut St, prop: &'static str, why: String) {
    if s.violation.is_none() {
        s.violation = Some((prop, why));
    }
}

impl Check {
    fn heads(&self) -> Vec<NodeId> {
        self.cfg
            .members
            .iter()
            .filter(|m| self.cfg.may_stand(m.id))
            .map(|m| m.id)
            .collect()
    }

    fn is_backup(&self, id: NodeId) -> bool {
        !self.cfg.may_stand(id)
    }

    fn init(&self) -> St {
        // The boot below assumes node 0 is the first primary.
        assert!(self.cfg.may_stand(0));
        let n = self.cfg.members.len();
        let mut s = St {
            nodes: (0..n)
                .map(|i| NodeSt {
                    core: Some(
                        WitnessCore::new(i as NodeId, self.cfg.clone(), self.p.clone(), 0).unwrap(),
                    ),
                    ..NodeSt::default()
                })
                .collect(),
            net: BTreeSet::new(),
            now: 0,
            next_tag: 1,
            client: None,
            puts: 0,
            gets: 0,
            crashes: 0,
            drops: 0,
            ticks: 0,
            reconfigs: 0,
            cands: [BTreeSet::from([None]), BTreeSet::from([None])],
            indet: [BTreeSet::new(), BTreeSet::new()],
            acked: BTreeSet::new(),
            leaders: BTreeMap::new(),
            served_after_failover: false,
            acked_substituted: false,
            violation: None,
        };
        // The boot script: 1 ms steps, everything delivered and persisted, until node 0 serves.
        for _ in 0..2_000 {
            loop {
                let mut busy = false;
                for id in 0..n as NodeId {
                    if !s.nodes[id as usize].pending.is_empty() {
                        self.persist(&mut s, id);
                        busy = true;
                    }
                }
                if let Some((f, t, b)) = s.net.pop_first() {
                    self.feed(
                        &mut s,
                        t,
                        Input::Peer {
                            from: f,
                            msg: postcard::from_bytes(&b).unwrap(),
                        },
                    );
                    busy = true;
                }
                if !busy {
                    break;
                }
            }
            let c0 = s.nodes[0].core.as_ref().unwrap();
            if c0.role() == RoleKind::Leader
                && c0.is_serving()
                && !c0.in_recovery()
                && c0.commit_index() >= 1
            {
                break;
            }
            s.now += MS;
            for id in 0..n as NodeId {
                self.feed(&mut s, id, Input::Tick);
            }
        }
        let c0 = s.nodes[0].core.as_ref().unwrap();
        assert!(
            c0.is_serving(),
            "boot: node 0 did not become a serving primary"
        );
        assert!(s.violation.is_none(), "boot: {:?}", s.violation);
        s
    }

    /// Gives `input` to node `id` (if alive) and carries out its outputs, checking the
    /// harness-side properties as it goes.
    fn feed(&self, s: &mut St, id: NodeId, input: Input) {
        let mut queue = vec![input];
        while let Some(input) = queue.pop() {
            let now = s.now;
            let Some(core) = s.nodes[id as usize].core.as_mut() else {
                return;
            };
            let before: Vec<_> = KEYS
                .iter()
                .map(|k| (core.key_stamp(k), core.local_value(k).map(|x| x.0)))
                .collect();
            let dropped_before = core.counters.values_dropped_as_witness;
            let r = catch_unwind(AssertUnwindSafe(|| {
                core.handle(now, input);
                core.check_invariants_deep();
            }));
            if let Err(e) = r {
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|x| x.to_string()))
                    .unwrap_or_default();
                set_violation(s, P_CORE, format!("node {id} panicked: {msg}"));
                // Keep the state well-formed: the node is treated as crashed.
                s.nodes[id as usize].core = None;
                return;
            }
            let core = s.nodes[id as usize].core.as_mut().unwrap();
            let mut bad = None;
            // An old primary following a newer leader drops its whole value table on purpose
            // (M24): values vanish, they never go back to an older version.
            let dropped = core.counters.values_dropped_as_witness > dropped_before;
            for (k, (ks, vs)) in KEYS.iter().zip(&before) {
                let (ks2, vs2) = (core.key_stamp(k), core.local_value(k).map(|x| x.0));
                if ks2 < *ks || (vs2 < *vs && !(dropped && vs2.is_none())) {
                    let why = format!(
                        "node {id} key {}: key stamp {ks:?} -> {ks2:?}, value stamp {vs:?} -> {vs2:?}",
                        k[0] as char
                    );
                    bad.get_or_insert(why);
                }
            }
            let outs = core.take_outputs();
            if let Some(why) = bad {
                set_violation(s, P_MONO, why);
            }
            for o in outs {
                self.output(s, id, o, &mut queue);
            }
        }
    }

    fn output(&self, s: &mut St, id: NodeId, o: Output, queue: &mut Vec<Input>) {
        let n = &mut s.nodes[id as usize];
        match o {
            Output::Send { to, msg } => {
                if s.nodes[to as usize].core.is_some() {
                    s.net.insert((id, to, postcard::to_allocvec(&msg).unwrap()));
                }
            }
            Output::PmemAppend { seq, rec, .. } => {
                n.pending.push((seq, postcard::from_bytes(&rec).unwrap()));
            }
            Output::PmemTruncate { from_index, .. } => {
                n.nvmm.split_off(&from_index);
                n.pending
                    .retain(|(_, r)| !matches!(r, PmemRecord::Entry(e) if e.index >= from_index));
            }
            Output::PmemFree { through_index, .. } => {
                let keep = n.nvmm.split_off(&(through_index + 1));
                for e in std::mem::replace(&mut n.nvmm, keep).into_values() {
                    if let (Some(k), Some(v)) = (e.key(), e.value()) {
                        let st = n.wb_newest.entry(k.to_vec()).or_default();
                        *st = (*st).max((e.term, e.index));
                        n.written_back.insert((k.to_vec(), v.to_vec()));
                    }
                }
            }
            Output::SsdWrite {
                id: io,
                seg,
                log,
                off,
                bytes,
                ..
            } => {
                n.ssd.write(seg, log, off, &bytes);
                queue.push(Input::SsdWritten {
                    id: io,
                    result: Ok(()),
                });
            }
            Output::SsdRead {
                id: io,
                seg,
                off,
                len,
                ..
            } => {
                let result = n.ssd.read(seg, off, len);
                queue.push(Input::SsdRead { id: io, result });
            }
            Output::SsdFree { seg } => n.ssd.free(seg),
            Output::Reply { tag, reply } => self.reply(s, id, tag, reply),
            Output::Role { term, role, .. } => {
                if role != RoleKind::Follower && self.is_backup(id) {
                    set_violation(
                        s,
                        P_ELECTION,
                        format!("backup {id} became {role:?} in term {term}"),
                    );
                }
                if matches!(role, RoleKind::Provisional | RoleKind::Leader) {
                    let l = *s.leaders.entry(term).or_insert(id);
                    if l != id {
                        set_violation(s, P_ELECTION, format!("term {term}: leaders {l} and {id}"));
                    }
                }
            }
            Output::Recovered(_) => {}
        }
    }

    fn reply(&self, s: &mut St, id: NodeId, tag: u64, reply: ClientReply) {
        let Some((t, node, op)) = s.client.clone() else {
            return;
        };
        if t != tag || node != id {
            return;
        }
        s.client = None;
        match (op, reply) {
            (ClientOp::Put(k, v), ClientReply::PutOk) => {
                let sub = s.nodes[id as usize]
                    .core
                    .as_ref()
                    .is_some_and(|c| c.config().substitute.is_some());
                s.acked_substituted |= sub;
                s.indet[k].remove(&v);
                s.cands[k] = s.indet[k].iter().cloned().map(Some).collect();
                s.cands[k].insert(Some(v.clone()));
                s.acked.insert((KEYS[k].to_vec(), v));
            }
            (ClientOp::Get(k), ClientReply::Value(x)) => {
                if s.crashes > 0 && id != 0 {
                    s.served_after_failover = true;
                }
                let x = x.map(|b| b.into_vec());
                if !s.cands[k].contains(&x) {
                    let why = format!(
                        "node {id}: Get {} = {:?}, allowed {:?}",
                        KEYS[k][0] as char,
                        x.as_ref().map(|v| String::from_utf8_lossy(v).to_string()),
                        s.cands[k]
                    );
                    set_violation(s, P_READ, why);
                }
                s.cands[k] = s.indet[k].iter().cloned().map(Some).collect();
                s.cands[k].insert(x);
            }
            // Any other answer to a Put leaves it indeterminate; to a Get, says nothing.
            _ => {}
        }
    }

    fn persist(&self, s: &mut St, id: NodeId) {
        let n = &mut s.nodes[id as usize];
        let pend = std::mem::take(&mut n.pending);
        let Some(seq) = pend.last().map(|x| x.0) else {
            return;
        };
        for (_, r) in pend {
            match r {
                PmemRecord::Meta { term, voted_for } => n.meta = Some((term, voted_for)),
                PmemRecord::Entry(e) => {
                    n.nvmm.insert(e.index, e);
                }
            }
        }
        self.feed(s, id, Input::PmemPersisted { seq });
    }

    /// Whether a tick after `jump` would change anything at `id` (tried on a clone).
    fn tick_matters(&self, s: &St, id: NodeId, jump: Jump) -> bool {
        let Some(c) = s.nodes[id as usize].core.as_ref() else {
            return false;
        };
        let mut c2 = c.clone();
        c2.handle(s.now + jump.us(), Input::Tick);
        if !c2.take_outputs().is_empty() {
            return true;
        }
        let fp = |c: &WitnessCore| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            hash_core(c, &mut h);
            h.finish()
        };
        fp(c) != fp(&c2)
    }

    fn commit_rule(&self, s: &St) -> Result<(), String> {
        // Backups voting in the initial configuration and in every one a live node holds
        // (a substituted-out backup stops counting once the change is in force anywhere).
        let mut backups: BTreeSet<NodeId> = self.cfg.voting_backups().collect();
        for c in s.nodes.iter().filter_map(|n| n.core.as_ref()) {
            let v: BTreeSet<NodeId> = c.config().voting_backups().collect();
            backups = backups.intersection(&v).copied().collect();
        }
        for (k, v) in &s.acked {
            for &b in &backups {
                if !s.nodes[b as usize].holds(k, v) {
                    return Err(format!(
                        "acked Put {}={} not durable at voting backup {b}",
                        k[0] as char,
                        String::from_utf8_lossy(v)
                    ));
                }
            }
        }
        Ok(())
    }

    /// The backup's writeback and GC rules (spec (d)): the NVMM copy is freed only after the
    /// SSD write is durable, and GC never drops the newest version: every key freed from a
    /// backup's NVMM has a version at least as new in its SSD segments (crashed or not: SSD
    /// survives).
    fn gc_rule(&self, s: &St) -> Result<(), String> {
        for b in (0..s.nodes.len() as NodeId).filter(|&i| self.is_backup(i)) {
            let n = &s.nodes[b as usize];
            let mut on_ssd: BTreeMap<Vec<u8>, (u64, u64)> = BTreeMap::new();
            for (seg, (_, bytes)) in &n.ssd.segs {
                for (_, e) in kv::witness::core::page::decode_pages(*seg, 0, bytes).0 {
                    if let Some(k) = e.key() {
                        let st = on_ssd.entry(k.to_vec()).or_default();
                        *st = (*st).max((e.term, e.index));
                    }
                }
            }
            for (k, st) in &n.wb_newest {
                if on_ssd.get(k).is_none_or(|have| have < st) {
                    return Err(format!("backup {b}: key {k:?} at {st:?} is not on SSD"));
                }
            }
        }
        Ok(())
    }

    fn lease_ok(&self, s: &St) -> bool {
        s.nodes
            .iter()
            .filter_map(|n| n.core.as_ref())
            .filter(|c| c.role() == RoleKind::Leader && c.lease_until_us() > s.now)
            .count()
            <= 1
    }
}

impl SrModel for Check {
    type State = St;
    type Action = Action;

    fn init_states(&self) -> Vec<St> {
        vec![self.init()]
    }

    fn actions(&self, s: &St, out: &mut Vec<Action>) {
        if s.violation.is_some() {
            return;
        }
        for (f, t, b) in &s.net {
            out.push(Action::Deliver(*f, *t, b.clone()));
            if s.drops < self.bounds.drops {
                out.push(Action::Drop(*f, *t, b.clone()));
            }
        }
        for (i, n) in s.nodes.iter().enumerate() {
            if n.core.is_some() && !n.pending.is_empty() {
                out.push(Action::Persist(i as NodeId));
            }
        }
        if s.client.is_none() {
            for h in self.heads() {
                if s.nodes[h as usize].core.is_none() {
                    continue;
                }
                for k in 0..self.bounds.keys {
                    if s.puts < self.bounds.puts {
                        out.push(Action::Put(h, k));
                    }
                    if s.gets < self.bounds.gets {
                        out.push(Action::Get(h, k));
                    }
                }
            }
        }
        if s.ticks < self.bounds.ticks {
            for i in 0..s.nodes.len() as NodeId {
                for j in [Jump::Small, Jump::Soft, Jump::Hard] {
                    if self.tick_matters(s, i, j) {
                        out.push(Action::Tick(i, j));
                    }
                }
            }
        }
        if s.reconfigs == 0 {
            for (i, n) in s.nodes.iter().enumerate() {
                if n.core.as_ref().is_some_and(|c| c.is_serving()) {
                    for c in 0..self.changes.len() {
                        out.push(Action::Reconfigure(i as NodeId, c));
                    }
                }
            }
        }
        if s.crashes < self.bounds.crashes {
            for &i in &self.crash_nodes {
                if s.nodes[i as usize].core.is_some() {
                    out.push(Action::Crash(i));
                }
            }
        }
    }

    fn next_state(&self, s0: &St, action: Action) -> Option<St> {
        let mut s = s0.clone();
        match action {
            Action::Put(h, k) => {
                let tag = s.next_tag;
                s.next_tag += 1;
                s.puts += 1;
                let v = format!("v{}", s.puts).into_bytes();
                s.indet[k].insert(v.clone());
                s.cands[k].insert(Some(v.clone()));
                s.client = Some((tag, h, ClientOp::Put(k, v.clone())));
                let req = ClientReq::Put {
                    key: KEYS[k].to_vec(),
                    value: v,
                };
                self.feed(&mut s, h, Input::Client { tag, req });
            }
            Action::Get(h, k) => {
                let tag = s.next_tag;
                s.next_tag += 1;
                s.gets += 1;
                s.client = Some((tag, h, ClientOp::Get(k)));
                let req = ClientReq::Get {
                    key: KEYS[k].to_vec(),
                };
                self.feed(&mut s, h, Input::Client { tag, req });
            }
            Action::Deliver(f, t, b) => {
                s.net.remove(&(f, t, b.clone()));
                let msg = postcard::from_bytes(&b).unwrap();
                self.feed(&mut s, t, Input::Peer { from: f, msg });
            }
            Action::Drop(f, t, b) => {
                s.net.remove(&(f, t, b));
                s.drops += 1;
            }
            Action::Persist(i) => self.persist(&mut s, i),
            Action::Reconfigure(i, c) => {
                s.reconfigs += 1;
                self.feed(&mut s, i, Input::Reconfigure(self.changes[c].clone()));
            }
            Action::Tick(i, j) => {
                s.ticks += 1;
                s.now += j.us();
                self.feed(&mut s, i, Input::Tick);
            }
            Action::Crash(i) => {
                s.crashes += 1;
                let n = &mut s.nodes[i as usize];
                n.core = None;
                n.pending.clear();
                s.net.retain(|(_, t, _)| *t != i);
                if s.client.as_ref().is_some_and(|c| c.1 == i) {
                    s.client = None; // abandoned: a Put stays indeterminate
                }
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        fn viol(s: &St, p: &str) -> bool {
            s.violation.as_ref().is_some_and(|v| v.0 == p)
        }
        vec![
            Property::always(P_ELECTION, |_, s: &St| !viol(s, P_ELECTION)),
            Property::always(P_COMMIT, |m: &Check, s: &St| m.commit_rule(s).is_ok()),
            Property::always(P_READ, |_, s: &St| !viol(s, P_READ)),
            Property::always(P_MONO, |_, s: &St| !viol(s, P_MONO)),
            Property::always(P_LEASE, |m: &Check, s: &St| m.lease_ok(s)),
            Property::always(P_GC, |m: &Check, s: &St| m.gc_rule(s).is_ok()),
            Property::always(P_CORE, |_, s: &St| !viol(s, P_CORE)),
            Property::sometimes(S_FAILOVER, |_, s: &St| s.served_after_failover),
            Property::sometimes(S_SUBSTITUTED, |_, s: &St| s.acked_substituted),
        ]
    }
}

fn env_u(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn default_bounds() -> Bounds {
    Bounds {
        keys: env_u("MODEL_KEYS", 2),
        puts: env_u("MODEL_PUTS", 2) as u8,
        gets: env_u("MODEL_GETS", 2) as u8,
        crashes: env_u("MODEL_CRASHES", 1) as u8,
        drops: env_u("MODEL_DROPS", 1) as u8,
        ticks: env_u("MODEL_TICKS", 6) as u8,
    }
}

/// Walks go deeper than the BFS: more Gets (some after the failover) and more ticks.
fn walk_bounds() -> Bounds {
    Bounds {
        gets: env_u("MODEL_GETS", 4) as u8,
        ticks: env_u("MODEL_TICKS", 12) as u8,
        ..default_bounds()
    }
}

fn crash_nodes() -> Vec<NodeId> {
    match std::env::var("MODEL_CRASH_NODES") {
        Ok(v) => v.split(',').filter_map(|x| x.trim().parse().ok()).collect(),
        Err(_) => vec![0],
    }
}

/// Random walks that favour progress (delivery, persistence) over new client operations,
/// ticks and faults, so a walk usually lets one step finish before the next fault: uniform
/// choice spends the tick and crash budgets before anything is committed. Seeded: a failure
/// reproduces with its `MODEL_SEED`.
#[derive(Clone)]
struct Weighted;

impl stateright::Chooser<Check> for Weighted {
    type State = u64;
    fn new_state(&self, seed: u64) -> u64 {
        seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
    }
    fn choose_initial_state(&self, _: &mut u64, _: &[St]) -> usize {
        0
    }
    fn choose_action(&self, rng: &mut u64, _: &St, actions: &[Action]) -> usize {
        let w = |a: &Action| -> u64 {
            match a {
                Action::Deliver(..) | Action::Persist(_) => 12,
                Action::Tick(_, Jump::Small) => 3,
                Action::Get(..) => 2,
                _ => 1,
            }
        };
        let total: u64 = actions.iter().map(w).sum();
        // xorshift64
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        let mut x = *rng % total;
        for (i, a) in actions.iter().enumerate() {
            if x < w(a) {
                return i;
            }
            x -= w(a);
        }
        actions.len() - 1
    }
}

type Found = BTreeMap<&'static str, String>;

enum Search {
    Bfs(usize),
    Walks(usize, u64),
}

fn run(name: &str, m: Check, search: Search) -> Found {
    let t0 = Instant::now();
    let b = m.clone().checker().threads(env_u("MODEL_THREADS", 1));
    let b = b.finish_when(stateright::HasDiscoveries::AnyFailures);
    let (what, c): (String, Box<dyn Checker<Check>>) = match search {
        Search::Bfs(depth) => (
            format!("BFS depth {depth}"),
            Box::new(b.target_max_depth(depth).spawn_bfs().join()),
        ),
        Search::Walks(n, seed) => (
            format!("random walks seed {seed}"),
            Box::new(
                b.target_state_count(n)
                    .spawn_simulation(seed, Weighted)
                    .join(),
            ),
        ),
    };
    let found: Found = c
        .discoveries()
        .into_iter()
        .map(|(name, path)| {
            let last = path.last_state().clone();
            let steps: Vec<String> = path
                .into_actions()
                .iter()
                .map(|a| match a {
                    Action::Deliver(f, t, b) => format!(
                        "Deliver {f}->{t} {:?}",
                        postcard::from_bytes::<PeerMsg>(b).unwrap()
                    ),
                    Action::Drop(f, t, b) => format!(
                        "Drop {f}->{t} {:?}",
                        postcard::from_bytes::<PeerMsg>(b).unwrap()
                    ),
                    o => format!("{o:?}"),
                })
                .collect();
            let why = m.commit_rule(&last).err().unwrap_or_default()
                + &m.gc_rule(&last).err().unwrap_or_default();
            (
                name,
                format!(
                    "last state:\n{last:?}{why}\nsteps:\n  {}",
                    steps.join("\n  ")
                ),
            )
        })
        .collect();
    eprintln!(
        "{name} ({:?}, {what}): {} states ({} unique), max depth {}, {:.1?}, found {:?}",
        m.bounds,
        c.state_count(),
        c.unique_state_count(),
        c.max_depth(),
        t0.elapsed(),
        found.keys().collect::<Vec<_>>()
    );
    found
}

fn check(cfg: Config, fault: WitnessFault, bounds: Bounds) -> Check {
    Check {
        cfg,
        p: params(fault),
        bounds,
        crash_nodes: crash_nodes(),
        changes: Vec::new(),
    }
}

fn assert_clean(found: &Found, what: &str) {
    let reached = [S_FAILOVER, S_SUBSTITUTED];
    if let Some((name, why)) = found.iter().find(|(n, _)| !reached.contains(*n)) {
        panic!("{what}: property {name:?} violated: {why}");
    }
}

/// P+B+W (N = 1) with the correct core: BFS to a bounded depth, then seeded random walks
/// through the crash of P, the witness's election, reconciliation and live recovery.
#[test]
fn model_check_witness_pbw() {
    let m = check(Config::standard(1, 1), WitnessFault::None, default_bounds());
    let found = run("P+B+W", m.clone(), Search::Bfs(env_u("MODEL_DEPTH", 7)));
    assert_clean(&found, "P+B+W BFS");
    let seed = env_u("MODEL_SEED", 1) as u64;
    let m = check(Config::standard(1, 1), WitnessFault::None, walk_bounds());
    let found = run(
        "P+B+W",
        m,
        Search::Walks(env_u("MODEL_SIM_STATES", 100_000), seed),
    );
    assert_clean(&found, "P+B+W random walks");
    assert!(
        found.contains_key(S_FAILOVER),
        "no walk reached a Get served by the new primary after the crash"
    );
}

/// The backup's GC rule with GC running all the time: one key overwritten, 8 KiB segments in
/// a 12 KiB budget and a one-entry recent-index window, so nearly every writeback makes GC
/// collect a segment; BFS, then walks through the crash of P and the failover (live recovery
/// reads the backup's SSD while GC moves it).
#[test]
fn model_check_witness_backup_gc_keeps_the_newest_version() {
    let p = Params {
        ssd_segment_bytes: 8 << 10,
        ssd_capacity_bytes: 12 << 10,
        gc_free_min_bytes: 4 << 10,
        recent_index_window_entries: 1,
        ..params(WitnessFault::None)
    };
    let b = Bounds {
        keys: 1,
        puts: 3,
        ..default_bounds()
    };
    let m = Check {
        p: p.clone(),
        ..check(Config::standard(1, 1), WitnessFault::None, b)
    };
    let found = run("GC P+B+W", m, Search::Bfs(env_u("MODEL_DEPTH", 7)));
    assert_clean(&found, "GC P+B+W BFS");
    let m = Check {
        p,
        ..check(
            Config::standard(1, 1),
            WitnessFault::None,
            Bounds {
                keys: 1,
                puts: 3,
                ..walk_bounds()
            },
        )
    };
    let seed = env_u("MODEL_SEED", 1) as u64;
    let found = run(
        "GC P+B+W",
        m,
        Search::Walks(env_u("MODEL_SIM_STATES", 100_000) / 2, seed),
    );
    assert_clean(&found, "GC P+B+W random walks");
}

/// A majority commit quorum (leader + the witness) acknowledges a Put the backup never holds.
#[test]
fn model_check_witness_finds_majority_quorum() {
    let b = Bounds {
        keys: 2,
        puts: 1,
        gets: 0,
        crashes: 0,
        drops: 0,
        ticks: 0,
    };
    let m = check(Config::standard(1, 1), WitnessFault::MajorityQuorum, b);
    let found = run("majority quorum", m, Search::Bfs(10));
    let why = found
        .get(P_COMMIT)
        .unwrap_or_else(|| panic!("a majority commit quorum went unnoticed: {found:?}"));
    assert!(why.contains("not durable at voting backup 1"), "{why}");
    if std::env::var("MODEL_VERBOSE").is_ok() {
        eprintln!("{why}");
    }
    // N = 2: a majority of 5 voters is P and both witnesses, neither backup.
    let m = check(Config::standard(2, 2), WitnessFault::MajorityQuorum, b);
    let found = run("majority quorum, N = 2", m, Search::Bfs(10));
    let why = found
        .get(P_COMMIT)
        .unwrap_or_else(|| panic!("N = 2: a majority commit quorum went unnoticed: {found:?}"));
    assert!(why.contains("not durable at voting backup"), "{why}");
    // The same bounds with the correct core: nothing.
    let m = check(Config::standard(1, 1), WitnessFault::None, b);
    assert_clean(
        &run("majority quorum, correct core", m, Search::Bfs(10)),
        "correct core",
    );
}

/// A pulled value installed without its stamp check (taken as the key's current value): the
/// new primary serves a version older than an acknowledged Put. Seeded random walks.
#[test]
fn model_check_witness_finds_install_without_stamp_check() {
    // One key: the second Put overwrites the first, whose older version the backup's SSD log
    // still holds after writeback (the stale value a BatchPull brings).
    let b = Bounds {
        keys: 1,
        ..walk_bounds()
    };
    let m = check(
        Config::standard(1, 1),
        WitnessFault::InstallWithoutStampCheck,
        b,
    );
    // The stale read needs a long path (write back v1, commit v2, crash, soft timeout, pull,
    // election, install, Get): seeded walks, seed after seed, within a fixed budget.
    let per_seed = env_u("MODEL_SIM_STATES", 30_000);
    let seeds = env_u("MODEL_SEEDS", 16) as u64;
    let mut found = Found::new();
    for seed in 1..=seeds {
        found = run(
            "install without stamp check",
            m.clone(),
            Search::Walks(per_seed, seed),
        );
        if found.contains_key(P_READ) {
            break;
        }
    }
    let why = found.get(P_READ).unwrap_or_else(|| {
        panic!("an unchecked install went unnoticed in {seeds} seeds × {per_seed} states")
    });
    assert!(why.contains("Get a = Some(\"v1\")"), "{why}");
    if std::env::var("MODEL_VERBOSE").is_ok() {
        eprintln!("{why}");
    }
}

impl Check {
    /// Delivers every message and completes every persist until nothing is left (in a fixed
    /// order): a script's "let the group settle".
    fn settle(&self, s: &mut St) {
        for _ in 0..10_000 {
            let mut a = Vec::new();
            for (i, n) in s.nodes.iter().enumerate() {
                if n.core.is_some() && !n.pending.is_empty() {
                    a.push(Action::Persist(i as NodeId));
                }
            }
            if let Some((f, t, b)) = s.net.first().cloned() {
                a.push(Action::Deliver(f, t, b));
            }
            let Some(a) = a.into_iter().next() else {
                return;
            };
            *s = self.next_state(s, a).unwrap();
        }
        panic!("no settling");
    }

    fn script(&self, s: &mut St, steps: &[Action]) {
        for a in steps {
            *s = self.next_state(s, a.clone()).unwrap();
            self.settle(s);
            if std::env::var("MODEL_VERBOSE").is_ok() {
                eprintln!("after {a:?}:\n{s:?}");
            }
        }
    }
}

/// The stale-read path the walks find, as a fixed script through the same model: v1 written
/// back to the backup's SSD log, v2 committed in its NVMM buffer, P crashes, the witness's
/// soft timeout pulls the SSD log (v1 only), then it is elected and installs what it pulled.
/// The correct core keeps `a` missing and serves v2 after a pull; the broken one serves v1.
#[test]
fn model_check_witness_scripted_failover_read() {
    use Action::*;
    let steps = [
        Put(0, 0),
        Tick(0, Jump::Small), // the heartbeat tells the backup v1 is committed
        Tick(1, Jump::Hard),  // past the writeback linger: v1 goes to the SSD log
        Tick(0, Jump::Small),
        Put(0, 0),
        Tick(0, Jump::Small),
        Crash(0),
        Tick(2, Jump::Soft), // proactive BatchPull: the SSD log holds v1 only
        Tick(2, Jump::Hard), // election, reconciliation, install
        Get(2, 0),
    ];
    let b = Bounds {
        keys: 1,
        ..walk_bounds()
    };
    for (fault, want) in [
        (WitnessFault::None, None),
        (WitnessFault::InstallWithoutStampCheck, Some(P_READ)),
    ] {
        let m = check(Config::standard(1, 1), fault, b);
        let mut s = m.init();
        m.script(&mut s, &steps);
        assert_eq!(s.violation.as_ref().map(|v| v.0), want, "{fault:?}: {s:?}");
        assert!(m.commit_rule(&s).is_ok(), "{fault:?}: {s:?}");
        assert!(
            s.served_after_failover,
            "{fault:?}: the Get was not answered: {s:?}"
        );
    }
}

/// Walks through a crash of any one node (P, B or W: with N = 1 a backup crash stalls writes,
/// safety must hold), and the N = 2 layout (P, B1, B2, W1, W2) with a crash of P.
#[test]
fn model_check_witness_any_crash_and_n2() {
    let seed = env_u("MODEL_SEED", 1) as u64;
    let n = env_u("MODEL_SIM_STATES", 40_000);
    let mut m = check(Config::standard(1, 1), WitnessFault::None, walk_bounds());
    m.crash_nodes = vec![0, 1, 2];
    assert_clean(
        &run("P+B+W, any crash", m, Search::Walks(n, seed)),
        "any crash",
    );
    let m = check(Config::standard(2, 2), WitnessFault::None, walk_bounds());
    let found = run("P+2B+2W", m, Search::Walks(n, seed));
    assert_clean(&found, "P+2B+2W");
    assert!(
        found.contains_key(S_FAILOVER),
        "N = 2: no walk reached a Get served by the new primary after the crash"
    );
}

/// Votes granted within the leader lease: the witness is elected while the primary still holds
/// an unexpired lease (two leaders could both serve reads). No client operations are needed.
#[test]
fn model_check_witness_finds_no_lease_wait() {
    let b = Bounds {
        keys: 1,
        puts: 0,
        gets: 0,
        crashes: 0,
        drops: 0,
        ticks: 6,
    };
    let m = check(Config::standard(1, 1), WitnessFault::NoLeaseWait, b);
    let per_seed = env_u("MODEL_SIM_STATES", 30_000);
    let seeds = env_u("MODEL_SEEDS", 16) as u64;
    let mut found = Found::new();
    for seed in 1..=seeds {
        found = run("no lease wait", m.clone(), Search::Walks(per_seed, seed));
        if found.contains_key(P_LEASE) {
            break;
        }
    }
    let why = found.get(P_LEASE).unwrap_or_else(|| {
        panic!("votes within the lease went unnoticed in {seeds} seeds × {per_seed} states")
    });
    if std::env::var("MODEL_VERBOSE").is_ok() {
        eprintln!("{why}");
    }
    // The correct core under the same bounds and seeds: no violation.
    let m = check(Config::standard(1, 1), WitnessFault::None, b);
    for seed in 1..=4 {
        assert_clean(
            &run(
                "no lease wait, correct core",
                m.clone(),
                Search::Walks(per_seed, seed),
            ),
            "correct core",
        );
    }
}

/// M22 in the N = 2 layout (P0, B1, B2, W3, W4): the serving leader may at any point be asked
/// to let witness 3 substitute for backup 2, and backup 2 or the primary may crash. Safety
/// must hold through the change: the commit rule (every acknowledged Put on backup 1, the
/// backup voting throughout), reads, election and lease safety, the core's invariants.
#[test]
fn model_check_witness_substitution() {
    let change = Change::Substitute {
        backup: 2,
        witness: 3,
    };
    let b = Bounds {
        keys: 1,
        puts: 2,
        gets: 2,
        crashes: 1,
        drops: 1,
        ticks: 4,
    };
    let mut m = check(Config::standard(2, 2), WitnessFault::None, b);
    m.changes = vec![change.clone()];
    m.crash_nodes = vec![0, 2];
    let found = run(
        "substitution BFS",
        m.clone(),
        Search::Bfs(env_u("MODEL_RECONF_DEPTH", 5)),
    );
    assert_clean(&found, "substitution BFS");
    let mut m = check(Config::standard(2, 2), WitnessFault::None, walk_bounds());
    m.changes = vec![change];
    m.crash_nodes = vec![0, 2];
    let seed = env_u("MODEL_SEED", 1) as u64;
    let found = run(
        "substitution walks",
        m,
        Search::Walks(env_u("MODEL_SIM_STATES", 30_000), seed),
    );
    assert_clean(&found, "substitution walks");
    assert!(
        found.contains_key(S_SUBSTITUTED),
        "no walk acknowledged a Put under the substituted configuration"
    );
}
