//! Deterministic simulation of the witness KV (CANDStore): the real `WitnessCore`s over
//! `sim::Network` (loss, duplication, reordering, partitions), NVMM persists and SSD I/O as
//! delayed completions, closed-loop clients that follow `NotLeader` hints, and one fault per
//! run: the primary crashes for good (a witness must take over, reconcile and serve while it
//! pulls values) or is isolated for a while and then healed (its lease must keep it from
//! answering stale reads). Every history is checked for linearizability with `kv::checker`,
//! final reads of every key included (no acknowledged write lost).
//!
//! `SIM_SEEDS=N` sets the number of seeds per scenario; `SIM_SEED=S` runs one seed verbosely.
//!
//! Faults before the primary's: a witness crash, a backup cut off and back, a backup and a
//! witness restarted from their NVMM and SSD, the primary paused (as by SIGSTOP) again and again
//! for longer than the soft timeout and shorter than the hard one (false soft timeouts: the
//! proactive pull starts and aborts, nobody is elected); and a double failure (the successor
//! crashes).
//! Membership changes (M22–M24, the leader's automatic policy with `member_lost_us`): a backup
//! lost for good (a witness substitutes, a spare backup joins, catches up and is promoted, the
//! substitute steps back), a witness lost for good (a spare witness replaces it), each before
//! the primary's crash; the old primary restarting as a witness and taking over again.
//!
//! Not yet simulated: SSD read errors and slowness, torn NVMM records (power loss), crashes
//! in the middle of reconciliation on purpose.

use std::collections::{BTreeMap, HashMap};

use kv::checker::{self, Op, OpKind};
use kv::witness::core::config::{Config, Kind, Member};
use kv::witness::core::node::{Durable, Input, Output, Params, PmemRecord, WitnessCore};
use kv::witness::core::ssd::MemSsd;
use kv::witness::proto::{ClientReply, ClientReq, Entry, NodeId, PeerMsg};
use sim::{Delivery, EventQueue, NetConfig, Network, SimRng};

const TICK_US: u64 = 1_000;
const CLIENT_DELAY_US: u64 = 200;

#[derive(Clone, Debug)]
enum Msg {
    Peer(PeerMsg),
}

enum Ev {
    Deliver(Delivery<Msg>),
    /// Completions carry the node's incarnation: a restarted core never sees its
    /// predecessor's.
    Persisted {
        node: NodeId,
        inc: u64,
        seq: u64,
    },
    Io {
        node: NodeId,
        inc: u64,
        input: Input,
    },
    /// A crashed node restarts from its NVMM and SSD.
    Restart(NodeId),
    Tick(NodeId),
    /// A client's request reaches its node (clients talk over TCP: lossless, in order).
    Request {
        node: NodeId,
        client: usize,
        tag: u64,
        req: ClientReq,
    },
    Reply {
        client: usize,
        tag: u64,
        reply: ClientReply,
    },
    ClientWake(usize),
    Fault,
    /// A fault before the main one (see `Scenario::pre_fault`).
    PreFault,
    /// The second failure of a double failure: the leader that took over crashes too.
    Fault2,
    Heal,
    /// The serving leader stops processing anything (SIGSTOP) for a while (`Scenario::pauses`).
    Pause,
}

impl From<Delivery<Msg>> for Ev {
    fn from(d: Delivery<Msg>) -> Self {
        Ev::Deliver(d)
    }
}

/// A node's NVMM as the driver would replay it: the last Meta record, live entries by index.
type NvmmRegions = (Option<(u64, Option<NodeId>)>, BTreeMap<u64, Entry>);

#[derive(Clone, Copy, Debug)]
struct Scenario {
    backups: u32,
    witnesses: u32,
    keys: u32,
    clients: usize,
    run_us: u64,
    drop_p: f64,
    dup_p: f64,
    /// true: the primary crashes for good; false: it is isolated, then healed.
    crash: bool,
    client_timeout_us: u64,
    /// Client 0 reads only from node 0 (see `Client::pinned`).
    pinned_reader: bool,
    /// After the primary's crash, its successor crashes too once it serves.
    double_failure: bool,
    /// Soft timeouts and proactive BatchPull (M15) on.
    proactive: bool,
    pre_fault: PreFault,
    /// Pauses of the leader before the main fault, each longer than the soft timeout and
    /// shorter than the hard one.
    pauses: u32,
    /// How long before the main fault the pre-fault strikes.
    pre_fault_lead_us: u64,
    /// Added to the main fault's time (room for membership changes after a pre-fault).
    fault_delay_us: u64,
    /// Spare nodes named in the configuration, running idle until the leader adds them.
    spares: &'static [(NodeId, Kind)],
    /// The crashed primary restarts (from its NVMM) 250 ms later and rejoins as a witness.
    restart_primary: bool,
    /// `Params::log_keep_entries`: small makes heads truncate their logs (and restarted heads
    /// need snapshots) many times over a run.
    log_keep: usize,
    /// Backups get a tiny SSD (16 KiB segments, 64 KiB budget) and a short recent-index
    /// window, so GC (M9) runs many times during the run.
    small_ssd: bool,
}

/// A fault some 150 ms before the main one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PreFault {
    None,
    /// The highest-id witness crashes for good (M23: no configuration change needed).
    CrashWitness,
    /// Backup 1 is cut off for 100 ms, then healed: writes stall, then it catches up.
    IsolateBackup,
    /// Backup 1 and the highest-id witness crash and restart from NVMM + SSD 50 ms later.
    RestartBackupAndWitness,
    /// Backup 1 crashes for good (M22: a witness substitutes, a spare replaces it).
    LoseBackup,
    /// Backup 1 crashes and restarts from NVMM + SSD 400 ms later: long past
    /// `member_lost_us`, so a witness substitutes and the heads' logs are truncated past it;
    /// the leader must refill it with its values (`core/refill.rs`) before it votes again.
    BackupDownLong,
}

struct Client {
    target: NodeId,
    /// Reads only, always from node 0 (the first primary), ignoring hints: the client that
    /// would see a stale read if a deposed primary answered after its lease.
    pinned: bool,
    /// The op in flight: (tag, index in the history).
    inflight: Option<(u64, usize)>,
    sent_us: u64,
    n: u64,
    done_after_fault: u64,
}

struct World {
    sc: Scenario,
    rng: SimRng,
    net_rng: SimRng,
    net: Network<Msg>,
    q: EventQueue<Ev>,
    nodes: BTreeMap<NodeId, WitnessCore>,
    dead: Vec<NodeId>,
    heads: Vec<NodeId>,
    ssd: HashMap<NodeId, MemSsd>,
    pmem: HashMap<NodeId, NvmmRegions>,
    incs: HashMap<NodeId, u64>,
    /// Each node's bootstrap configuration (a spare's names itself, non-voting).
    boot: HashMap<NodeId, Config>,
    /// The primary the main fault struck.
    old_primary: Option<NodeId>,
    /// The most entry records any head's NVMM Log region held at once.
    max_head_log: usize,
    clients: Vec<Client>,
    hist: Vec<Op>,
    next_tag: u64,
    fault_at: u64,
    recovered: u64,
    verbose: bool,
    /// A paused node processes nothing before this time; its events wait.
    paused_until: HashMap<NodeId, u64>,
    /// Proactive pulls aborted over the run (all nodes, crashed ones included).
    proactive_aborted: u64,
    /// Keys from this number on are no longer written (only read): their newest versions
    /// then stay the ones written before (`PreFault::BackupDownLong`).
    frozen_keys_from: Option<u64>,
}

fn params(sc: &Scenario) -> Params {
    Params {
        soft_timeout_us: if sc.proactive { 30_000 } else { 0 },
        heartbeat_us: 5_000,
        election_timeout_us: 150_000,
        election_jitter_us: 20_000,
        lease_us: 100_000,
        clock_drift_us: 10_000,
        member_lost_us: 200_000,
        log_keep_entries: sc.log_keep,
        writeback_linger_us: 10_000,
        batch_pull_bytes: 8 << 10,
        pull_retry_us: 20_000,
        ..if sc.small_ssd {
            Params {
                ssd_segment_bytes: 16 << 10,
                ssd_capacity_bytes: 64 << 10,
                gc_free_min_bytes: 24 << 10,
                recent_index_window_entries: 32,
                ..Params::default()
            }
        } else {
            Params::default()
        }
    }
}

impl World {
    fn new(seed: u64, sc: Scenario, verbose: bool) -> World {
        let mut cfg = Config::standard(sc.backups, sc.witnesses);
        let mut rng = SimRng::new(seed);
        let net_rng = rng.fork();
        let mut q = EventQueue::new(1 << 20);
        let mut nodes = BTreeMap::new();
        let mut boot = HashMap::new();
        for &(id, kind) in sc.spares {
            cfg.spares.push(Member {
                id,
                kind,
                voting: false,
            });
        }
        for id in cfg.ids() {
            boot.insert(id, cfg.clone());
        }
        for &(id, kind) in sc.spares {
            let mut own = cfg.clone();
            own.epoch = 0;
            own.members.push(Member {
                id,
                kind,
                voting: false,
            });
            boot.insert(id, own);
        }
        let mut heads = Vec::new();
        for (&id, c) in &boot {
            nodes.insert(id, WitnessCore::new(id, c.clone(), params(&sc), 0).unwrap());
            if c.kind(id) == Some(Kind::Head) {
                heads.push(id);
            }
        }
        heads.sort_unstable();
        for &id in nodes.keys() {
            q.push_at(rng.range_u64(0, TICK_US), Ev::Tick(id)).unwrap();
        }
        let clients = (0..sc.clients)
            .map(|c| {
                q.push_at(300_000 + c as u64 * 100, Ev::ClientWake(c))
                    .unwrap();
                Client {
                    target: 0,
                    pinned: sc.pinned_reader && c == 0,
                    inflight: None,
                    sent_us: 0,
                    n: 0,
                    done_after_fault: 0,
                }
            })
            .collect();
        let mut fault_at = rng.range_u64(450_000, 800_000) + sc.fault_delay_us;
        for i in 0..u64::from(sc.pauses) {
            let at = 350_000 + i * 200_000 + rng.range_u64(0, 20_000);
            q.push_at(at, Ev::Pause).unwrap();
            fault_at = fault_at.max(at + 250_000);
        }
        q.push_at(fault_at, Ev::Fault).unwrap();
        if sc.pre_fault != PreFault::None {
            q.push_at(fault_at - sc.pre_fault_lead_us, Ev::PreFault)
                .unwrap();
        }
        World {
            sc,
            net_rng,
            net: Network::new(NetConfig {
                drop_probability: sc.drop_p,
                duplicate_probability: sc.dup_p,
                delay_us_min: 50,
                delay_us_max: 1_500,
            }),
            rng,
            q,
            nodes,
            dead: Vec::new(),
            heads,
            ssd: HashMap::new(),
            pmem: HashMap::new(),
            incs: HashMap::new(),
            boot,
            old_primary: None,
            max_head_log: 0,
            clients,
            hist: Vec::new(),
            next_tag: 1,
            fault_at,
            recovered: 0,
            verbose,
            paused_until: HashMap::new(),
            proactive_aborted: 0,
            frozen_keys_from: None,
        }
    }

    fn inc(&self, id: NodeId) -> u64 {
        self.incs.get(&id).copied().unwrap_or(0)
    }

    fn crash(&mut self, id: NodeId) {
        if let Some(n) = self.nodes.get(&id) {
            self.proactive_aborted += n.counters.proactive_aborted;
        }
        self.dead.push(id);
        self.net.set_down(id, true);
        *self.incs.entry(id).or_default() += 1;
    }

    fn restart(&mut self, now: u64, id: NodeId) {
        let (meta, log) = self.pmem.get(&id).cloned().unwrap_or_default();
        let durable = Durable {
            meta,
            entries: log.into_values().collect(),
            ssd: self.ssd.get(&id).map(MemSsd::durable).unwrap_or_default(),
        };
        let core = WitnessCore::restore(id, self.boot[&id].clone(), params(&self.sc), now, durable)
            .expect("restore");
        self.nodes.insert(id, core);
        if id == 1 && self.sc.pre_fault == PreFault::BackupDownLong {
            // The upper half of the keys keeps the versions written while backup 1 was
            // down: only a refill can bring them to it.
            self.frozen_keys_from = Some(self.sc.keys as u64 / 2);
        }
        self.dead.retain(|&d| d != id);
        self.net.set_down(id, false);
        if self.verbose {
            eprintln!("{now} node {id} restarted");
        }
        self.q.push_at(now + 1, Ev::Tick(id)).unwrap();
    }

    fn feed(&mut self, now: u64, id: NodeId, input: Input) {
        if self.dead.contains(&id) {
            return;
        }
        let core = self.nodes.get_mut(&id).unwrap();
        core.handle(now, input);
        core.check_invariants_deep();
        for o in core.take_outputs() {
            match o {
                Output::Send { to, msg } => {
                    self.net
                        .send(&mut self.net_rng, &mut self.q, now, id, to, Msg::Peer(msg))
                        .unwrap();
                }
                Output::PmemAppend { seq, rec, .. } => {
                    // SIGKILL model (shm NVMM): a record is kept once appended.
                    let (meta, log) = self.pmem.entry(id).or_default();
                    match postcard::from_bytes::<PmemRecord>(&rec).unwrap() {
                        PmemRecord::Meta { term, voted_for } => *meta = Some((term, voted_for)),
                        PmemRecord::Entry(e) => {
                            log.insert(e.index, e);
                        }
                    }
                    if self.boot[&id].kind(id) == Some(Kind::Head) {
                        self.max_head_log = self.max_head_log.max(log.len());
                    }
                    let d = self.rng.range_u64(1, 30);
                    let inc = self.inc(id);
                    self.q
                        .push_at(now + d, Ev::Persisted { node: id, inc, seq })
                        .unwrap();
                }
                Output::PmemTruncate { from_index, .. } => {
                    let (_, log) = self.pmem.entry(id).or_default();
                    log.split_off(&from_index);
                }
                Output::PmemFree { through_index, .. } => {
                    let (_, log) = self.pmem.entry(id).or_default();
                    *log = log.split_off(&(through_index + 1));
                }
                Output::SsdWrite {
                    id: io,
                    seg,
                    log,
                    off,
                    bytes,
                    ..
                } => {
                    self.ssd.entry(id).or_default().write(seg, log, off, &bytes);
                    let d = self.rng.range_u64(20, 200);
                    let input = Input::SsdWritten {
                        id: io,
                        result: Ok(()),
                    };
                    self.q
                        .push_at(
                            now + d,
                            Ev::Io {
                                node: id,
                                inc: self.inc(id),
                                input,
                            },
                        )
                        .unwrap();
                }
                Output::SsdRead {
                    id: io,
                    seg,
                    off,
                    len,
                    ..
                } => {
                    let result = self.ssd.entry(id).or_default().read(seg, off, len);
                    let d = self.rng.range_u64(10, 150);
                    let input = Input::SsdRead { id: io, result };
                    self.q
                        .push_at(
                            now + d,
                            Ev::Io {
                                node: id,
                                inc: self.inc(id),
                                input,
                            },
                        )
                        .unwrap();
                }
                Output::SsdFree { seg } => self.ssd.entry(id).or_default().free(seg),
                Output::Reply { tag, reply } => {
                    if let Some(c) = self
                        .clients
                        .iter()
                        .position(|c| c.inflight.is_some_and(|f| f.0 == tag))
                    {
                        self.q
                            .push_at(
                                now + CLIENT_DELAY_US,
                                Ev::Reply {
                                    client: c,
                                    tag,
                                    reply,
                                },
                            )
                            .unwrap();
                    }
                }
                Output::Role { term, role, .. } => {
                    if self.verbose {
                        eprintln!("{now} node {id} term {term} {role:?}");
                    }
                }
                Output::Recovered(s) => {
                    if now > self.fault_at {
                        self.recovered += 1;
                    }
                    if self.verbose {
                        eprintln!("{now} node {id} recovered {s:?}");
                    }
                }
            }
        }
    }

    fn client_issue(&mut self, now: u64, c: usize) {
        let k = self.rng.range_u64(0, self.sc.keys as u64 - 1);
        let key = format!("k{k}").into_bytes();
        let frozen = self.frozen_keys_from.is_some_and(|f| k >= f);
        let cl = &mut self.clients[c];
        let (req, kind) = if !cl.pinned && self.rng.chance(0.5) && !frozen {
            cl.n += 1;
            let v = format!("c{c}-{}", cl.n).into_bytes();
            (
                ClientReq::Put {
                    key: key.clone(),
                    value: v.clone(),
                },
                OpKind::Put(v),
            )
        } else {
            (ClientReq::Get { key: key.clone() }, OpKind::Get(None))
        };
        let tag = self.next_tag;
        self.next_tag += 1;
        self.hist.push(Op {
            client: c as u64,
            key,
            call_us: now,
            ret_us: None,
            kind,
        });
        let cl = &mut self.clients[c];
        cl.inflight = Some((tag, self.hist.len() - 1));
        cl.sent_us = now;
        let node = cl.target;
        self.q
            .push_at(
                now + CLIENT_DELAY_US,
                Ev::Request {
                    node,
                    client: c,
                    tag,
                    req,
                },
            )
            .unwrap();
        self.q
            .push_at(now + self.sc.client_timeout_us, Ev::ClientWake(c))
            .unwrap();
    }

    fn on_reply(&mut self, now: u64, c: usize, tag: u64, reply: ClientReply) {
        let Some((t, h)) = self.clients[c].inflight else {
            return;
        };
        if t != tag {
            return;
        }
        self.clients[c].inflight = None;
        let mut retry_elsewhere = None;
        match reply {
            ClientReply::PutOk => {
                assert!(matches!(self.hist[h].kind, OpKind::Put(_)));
                self.hist[h].ret_us = Some(now);
            }
            ClientReply::Value(v) => {
                self.hist[h].kind = OpKind::Get(v.map(|b| b.into_vec()));
                self.hist[h].ret_us = Some(now);
            }
            ClientReply::Indeterminate => {} // stays pending
            ClientReply::NotLeader { hint } => retry_elsewhere = Some(hint),
            ClientReply::Unavailable => retry_elsewhere = Some(Some(self.clients[c].target)),
            ClientReply::Invalid(e) => panic!("invalid request: {e}"),
            r @ (ClientReply::Reconfigured(_) | ClientReply::Membership { .. }) => {
                panic!("a membership reply to a get or put: {r:?}")
            }
            ClientReply::Status(_) => panic!("a status reply to a get or put"),
        }
        if let Some(hint) = retry_elsewhere {
            // Definitely not executed: the op never happened.
            self.hist[h].ret_us = Some(u64::MAX);
            let hint = if self.clients[c].pinned {
                Some(0)
            } else {
                hint
            };
            self.clients[c].target = match hint {
                Some(n) => n,
                None => {
                    let i = self
                        .heads
                        .iter()
                        .position(|&x| x == self.clients[c].target)
                        .unwrap_or(0);
                    self.heads[(i + 1) % self.heads.len()]
                }
            };
        }
        if self.hist[h].ret_us.is_some()
            && self.hist[h].ret_us != Some(u64::MAX)
            && now > self.fault_at
        {
            self.clients[c].done_after_fault += 1;
        }
        let backoff = if retry_elsewhere.is_some() && !self.clients[c].pinned {
            2_000
        } else {
            100
        };
        self.q.push_at(now + backoff, Ev::ClientWake(c)).unwrap();
    }

    fn run(&mut self) -> Result<(), String> {
        let end = self.sc.run_us;
        while let Some((now, ev)) = self.q.pop() {
            if now > end {
                break;
            }
            let target = match &ev {
                Ev::Deliver(d) => Some(d.to),
                Ev::Persisted { node, .. } | Ev::Io { node, .. } | Ev::Request { node, .. } => {
                    Some(*node)
                }
                Ev::Tick(id) => Some(*id),
                _ => None,
            };
            if let Some(until) = target.and_then(|t| self.paused_until.get(&t).copied()) {
                if now < until {
                    // Stopped: nothing runs, messages wait in its socket buffers.
                    self.q.push_at(until, ev).unwrap();
                    continue;
                }
            }
            match ev {
                Ev::Deliver(d) => {
                    let Some(d) = self.net.receive(d) else {
                        continue;
                    };
                    let Msg::Peer(msg) = d.msg;
                    self.feed(now, d.to, Input::Peer { from: d.from, msg });
                }
                Ev::Persisted { node, inc, seq } => {
                    if inc == self.inc(node) {
                        self.feed(now, node, Input::PmemPersisted { seq })
                    }
                }
                Ev::Io { node, inc, input } => {
                    if inc == self.inc(node) {
                        self.feed(now, node, input)
                    }
                }
                Ev::Restart(id) => self.restart(now, id),
                Ev::Tick(id) => {
                    if !self.dead.contains(&id) {
                        self.feed(now, id, Input::Tick);
                        self.q.push_at(now + TICK_US, Ev::Tick(id)).unwrap();
                    }
                }
                Ev::Request {
                    node,
                    client,
                    tag,
                    req,
                } => {
                    if self.dead.contains(&node) {
                        continue; // lost with the node: the client times out
                    }
                    let _ = client;
                    self.feed(now, node, Input::Client { tag, req });
                }
                Ev::Reply { client, tag, reply } => self.on_reply(now, client, tag, reply),
                Ev::ClientWake(c) => {
                    let cl = &self.clients[c];
                    match cl.inflight {
                        None => self.client_issue(now, c),
                        Some(_) if now >= cl.sent_us + self.sc.client_timeout_us => {
                            // Timed out: the op stays pending; try another head.
                            let cl = &mut self.clients[c];
                            cl.inflight = None;
                            let i = self.heads.iter().position(|&x| x == cl.target).unwrap_or(0);
                            if !cl.pinned {
                                cl.target = self.heads[(i + 1) % self.heads.len()];
                            }
                            self.client_issue(now, c);
                        }
                        Some(_) => {}
                    }
                }
                Ev::Fault => {
                    if self.sc.pauses > 0 {
                        if let Some((i, n)) = self.nodes.iter().find(|(_, n)| n.term() > 1) {
                            return Err(format!(
                                "node {i} reached term {} during the pauses: a false hard timeout",
                                n.term()
                            ));
                        }
                    }
                    let leader = self
                        .nodes
                        .iter()
                        .find(|(_, n)| n.is_serving())
                        .map(|(i, _)| *i);
                    let Some(l) = leader else {
                        return Err("no serving leader at the fault".into());
                    };
                    if self.verbose {
                        eprintln!("{now} fault on leader {l}: crash={}", self.sc.crash);
                    }
                    self.old_primary = Some(l);
                    if self.sc.crash {
                        self.crash(l);
                        if self.sc.restart_primary {
                            self.q.push_at(now + 250_000, Ev::Restart(l)).unwrap();
                        }
                        if self.sc.double_failure {
                            let d = if self.sc.restart_primary {
                                self.rng.range_u64(500_000, 700_000)
                            } else {
                                self.rng.range_u64(200_000, 400_000)
                            };
                            self.q.push_at(now + d, Ev::Fault2).unwrap();
                        }
                    } else {
                        self.net.isolate(l);
                        let d = self.rng.range_u64(150_000, 400_000);
                        self.q.push_at(now + d, Ev::Heal).unwrap();
                    }
                }
                Ev::PreFault => match self.sc.pre_fault {
                    PreFault::None => {}
                    PreFault::CrashWitness => {
                        let w = self.sc.backups + self.sc.witnesses; // not a spare
                        if self.verbose {
                            eprintln!("{now} witness {w} crashes");
                        }
                        self.crash(w);
                    }
                    PreFault::RestartBackupAndWitness => {
                        let w = self.sc.backups + self.sc.witnesses;
                        if self.verbose {
                            eprintln!("{now} backup 1 and witness {w} crash");
                        }
                        self.crash(1);
                        self.crash(w);
                        self.q.push_at(now + 50_000, Ev::Restart(1)).unwrap();
                        self.q.push_at(now + 60_000, Ev::Restart(w)).unwrap();
                    }
                    PreFault::BackupDownLong => {
                        if self.verbose {
                            eprintln!("{now} backup 1 crashes, back in 400 ms");
                        }
                        self.crash(1);
                        self.q.push_at(now + 400_000, Ev::Restart(1)).unwrap();
                    }
                    PreFault::LoseBackup => {
                        if self.verbose {
                            eprintln!("{now} backup 1 crashes for good");
                        }
                        self.crash(1);
                    }
                    PreFault::IsolateBackup => {
                        if self.verbose {
                            eprintln!("{now} backup 1 isolated for 100 ms");
                        }
                        self.net.isolate(1);
                        self.q.push_at(now + 100_000, Ev::Heal).unwrap();
                    }
                },
                Ev::Fault2 => {
                    let leader = self
                        .nodes
                        .iter()
                        .filter(|(i, _)| !self.dead.contains(i))
                        .find(|(_, n)| n.is_serving())
                        .map(|(i, _)| *i);
                    let Some(l) = leader else {
                        // Not elected yet: strike once it serves.
                        self.q.push_at(now + 20_000, Ev::Fault2).unwrap();
                        continue;
                    };
                    if self.verbose {
                        eprintln!("{now} second crash: leader {l}");
                    }
                    self.crash(l);
                }
                Ev::Heal => self.net.heal_all(),
                Ev::Pause => {
                    let leader = self
                        .nodes
                        .iter()
                        .filter(|(i, _)| !self.dead.contains(i))
                        .find(|(_, n)| n.is_serving())
                        .map(|(i, _)| *i);
                    if let Some(l) = leader {
                        // Past the soft timeout (30 ms), short of the hard one (150 ms) with
                        // the last heartbeat's age and network delay added.
                        let d = self.rng.range_u64(45_000, 110_000);
                        if self.verbose {
                            eprintln!("{now} leader {l} paused for {} ms", d / 1000);
                        }
                        self.paused_until.insert(l, now + d);
                    }
                }
            }
        }
        // Liveness: clients completed ops after the fault.
        let after: u64 = self.clients.iter().map(|c| c.done_after_fault).sum();
        if after == 0 {
            return Err("no op completed after the fault".into());
        }
        if self.verbose {
            for (id, n) in &self.nodes {
                if self.dead.contains(id) {
                    continue;
                }
                let ks: Vec<String> = (0..self.sc.keys)
                    .map(|k| {
                        let key = format!("k{k}").into_bytes();
                        format!(
                            "k{k}: key {:?} local {:?} index {:?}",
                            n.key_stamp(&key),
                            n.local_value(&key).map(|x| x.0),
                            n.backup_index_stamp(&key)
                        )
                    })
                    .collect();
                eprintln!(
                    "node {id} {:?} term {} commit {} last {} missing {} | {}",
                    n.role(),
                    n.term(),
                    n.commit_index(),
                    n.last_index(),
                    n.missing_keys(),
                    ks.join("; ")
                );
            }
        }
        if self.sc.crash && self.recovered == 0 {
            return Err("the new primary never finished live recovery".into());
        }
        self.check_membership()
    }

    /// After the run: every spare was added and votes, no lost backup or witness is still a
    /// voter, and an old primary that follows keeps no values (M22–M24).
    fn check_membership(&self) -> Result<(), String> {
        let Some((&l, leader)) = self
            .nodes
            .iter()
            .filter(|(i, _)| !self.dead.contains(i))
            .find(|(_, n)| n.is_serving())
        else {
            return Ok(()); // final_reads reports it
        };
        let c = leader.config();
        for &(id, _) in self.sc.spares {
            if !c.is_voter(id) {
                return Err(format!("spare {id} not a voter at the end: {c:?}"));
            }
        }
        if !self.sc.spares.is_empty() {
            // Lost before the main fault (the crashed primary has no spare to replace it).
            for &d in self.dead.iter().filter(|&&d| Some(d) != self.old_primary) {
                if c.is_voter(d) {
                    return Err(format!("lost node {d} still votes: {c:?}"));
                }
            }
            if c.substitute.is_some() {
                return Err(format!("the substitute never stepped back: {c:?}"));
            }
        }
        if let Some(o) = self
            .old_primary
            .filter(|&o| o != l && !self.dead.contains(&o))
        {
            let n = &self.nodes[&o];
            if !c.gets_values(o) {
                for k in 0..self.sc.keys {
                    let key = format!("k{k}").into_bytes();
                    if n.local_value(&key).is_some() {
                        return Err(format!("old primary {o} still holds a value of k{k}"));
                    }
                }
            }
        }
        if self.verbose {
            eprintln!("final configuration at leader {l}: {c:?}");
        }
        // Heads hold at most 2 × keep applied entries plus what is not applied yet (bounded
        // by the clients in flight and a stalled commit's retries: far below 400 here).
        let bound = 2 * self.sc.log_keep + 400;
        if self.max_head_log > bound {
            return Err(format!(
                "a head's NVMM log held {} entries (bound {bound})",
                self.max_head_log
            ));
        }
        let top = self
            .nodes
            .values()
            .map(|n| n.last_index())
            .max()
            .unwrap_or(0);
        if self.sc.log_keep < 1000 && top < 10 * self.sc.log_keep as u64 {
            return Err(format!("a long run wrote only {top} entries"));
        }
        let installed: u64 = self
            .nodes
            .values()
            .map(|n| n.counters.snapshots_installed)
            .sum();
        if self.verbose {
            eprintln!(
                "last index {top}, snapshots installed {installed}, max head log {}",
                self.max_head_log
            );
        }
        if self.sc.pre_fault == PreFault::BackupDownLong {
            // Backup 1 was refilled after its restart (its counters start there), and the
            // substitution it caused ended.
            let b = &self.nodes[&1];
            if b.counters.refills_installed == 0 {
                return Err("backup 1 came back behind the truncated log but was never refilled".into());
            }
            if !c.is_voter(1) || c.substitute.is_some() {
                return Err(format!("backup 1 does not vote again: {c:?}"));
            }
            // Every replica agrees: backup 1 indexes the newest version of each frozen key.
            for k in self.frozen_keys_from.unwrap_or(0)..self.sc.keys as u64 {
                let key = format!("k{k}").into_bytes();
                let (want, got) = (leader.key_stamp(&key), b.backup_index_stamp(&key));
                if want.is_some() && got != want {
                    return Err(format!("backup 1 holds k{k} at {got:?}, the leader at {want:?}"));
                }
            }
        }
        if self.sc.log_keep < 1000
            && self.sc.pre_fault == PreFault::RestartBackupAndWitness
            && installed == 0
        {
            return Err("the witness restarted from a truncated log without a snapshot".into());
        }
        Ok(())
    }

    /// Final reads of every key through the serving leader, appended to the history.
    fn final_reads(&mut self) -> Result<(), String> {
        let Some(l) = self
            .nodes
            .iter()
            .filter(|(i, _)| !self.dead.contains(i))
            .find(|(_, n)| n.is_serving())
            .map(|(i, _)| *i)
        else {
            return Err("no serving leader at the end".into());
        };
        let mut now = self.q.now().max(self.sc.run_us + 1);
        for k in 0..self.sc.keys {
            let key = format!("k{k}").into_bytes();
            let tag = 1 << 40 | k as u64;
            let call_us = now;
            // Drive the leader alone until it answers (pulls need the backups: keep them fed).
            self.clients.push(Client {
                target: l,
                pinned: false,
                inflight: Some((tag, 0)),
                sent_us: now,
                n: 0,
                done_after_fault: 0,
            });
            let c = self.clients.len() - 1;
            self.feed(
                now,
                l,
                Input::Client {
                    tag,
                    req: ClientReq::Get { key: key.clone() },
                },
            );
            let mut answer = None;
            while let Some((t, ev)) = self.q.pop() {
                now = t;
                match ev {
                    Ev::Reply {
                        client,
                        tag: rt,
                        reply,
                    } if client == c && rt == tag => {
                        answer = Some(reply);
                        break;
                    }
                    Ev::Deliver(d) => {
                        if let Some(d) = self.net.receive(d) {
                            let Msg::Peer(msg) = d.msg;
                            self.feed(now, d.to, Input::Peer { from: d.from, msg });
                        }
                    }
                    Ev::Persisted { node, inc, seq } if inc == self.inc(node) => {
                        self.feed(now, node, Input::PmemPersisted { seq })
                    }
                    Ev::Io { node, inc, input } if inc == self.inc(node) => {
                        self.feed(now, node, input)
                    }
                    Ev::Tick(id) if !self.dead.contains(&id) => {
                        self.feed(now, id, Input::Tick);
                        self.q.push_at(now + TICK_US, Ev::Tick(id)).unwrap();
                    }
                    _ => {}
                }
                if now > self.sc.run_us + 2_000_000 {
                    break;
                }
            }
            match answer {
                Some(ClientReply::Value(v)) => self.hist.push(Op {
                    client: 10_000 + k as u64,
                    key,
                    call_us,
                    ret_us: Some(now),
                    kind: OpKind::Get(v.map(|b| b.into_vec())),
                }),
                other => return Err(format!("final read of k{k}: {other:?}")),
            }
        }
        Ok(())
    }
}

/// Runs one seed: the number of ops checked and of proactive pulls aborted.
fn run_one(seed: u64, sc: Scenario, verbose: bool) -> Result<(usize, u64), String> {
    let mut w = World::new(seed, sc, verbose);
    w.run()?;
    let aborted = w.proactive_aborted
        + w.nodes
            .iter()
            .filter(|(i, _)| !w.dead.contains(i))
            .map(|(_, n)| n.counters.proactive_aborted)
            .sum::<u64>();
    if sc.small_ssd {
        // GC really ran (on the backups alive at the end; a restart resets the counters).
        let freed: u64 = w.nodes.values().map(|n| n.counters.gc_segments_freed).sum();
        if freed < 5 {
            return Err(format!("only {freed} SSD segments freed by GC"));
        }
        for (id, s) in &w.ssd {
            if s.bytes() > 64 << 10 {
                return Err(format!("node {id} holds {} B of SSD", s.bytes()));
            }
        }
    }
    w.net.heal_all();
    w.final_reads()?;
    let hist: Vec<Op> = w
        .hist
        .into_iter()
        .filter(|o| o.ret_us != Some(u64::MAX))
        .collect();
    checker::check(&hist).map_err(|v| v.to_string())?;
    Ok((hist.len(), aborted))
}

fn seeds(default: u64) -> Vec<u64> {
    if let Ok(s) = std::env::var("SIM_SEED") {
        return vec![s.parse().expect("SIM_SEED is a number")];
    }
    let n = std::env::var("SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    (0..n).collect()
}

fn run_many(name: &str, sc: Scenario, default_seeds: u64) {
    let verbose = std::env::var("SIM_SEED").is_ok();
    let mut ops = 0;
    let mut aborted = 0;
    let seeds = seeds(default_seeds);
    for &seed in &seeds {
        match run_one(seed, sc, verbose) {
            Ok((n, a)) => {
                ops += n;
                aborted += a;
            }
            Err(e) => panic!(
                "{name}: seed {seed} failed: {e}\nreproduce: SIM_SEED={seed} cargo test -p kv --test sim_witness {name} -- --nocapture"
            ),
        }
    }
    eprintln!(
        "{name}: {} seeds, {ops} ops checked, {aborted} proactive pulls aborted",
        seeds.len()
    );
    if sc.pauses > 0 {
        assert!(aborted > 0, "{name}: no pause made a false soft timeout");
    }
}

fn scenario(backups: u32, witnesses: u32, crash: bool) -> Scenario {
    Scenario {
        backups,
        witnesses,
        keys: 4,
        clients: 4,
        run_us: 1_500_000,
        drop_p: 0.02,
        dup_p: 0.02,
        crash,
        client_timeout_us: 60_000,
        pinned_reader: !crash,
        double_failure: false,
        proactive: true,
        pre_fault: PreFault::None,
        pauses: 0,
        pre_fault_lead_us: 150_000,
        fault_delay_us: 0,
        spares: &[],
        restart_primary: false,
        log_keep: 4096,
        small_ssd: false,
    }
}

#[test]
fn primary_crash_witness_takes_over() {
    run_many("primary_crash_witness_takes_over", scenario(1, 1, true), 10);
}

#[test]
fn primary_crash_two_backups_two_witnesses() {
    // Without proactive pulls: the new primary recovers by live recovery alone.
    let sc = Scenario {
        proactive: false,
        ..scenario(2, 2, true)
    };
    run_many("primary_crash_two_backups_two_witnesses", sc, 8);
}

#[test]
fn double_failure_primary_then_successor() {
    let sc = Scenario {
        double_failure: true,
        run_us: 2_000_000,
        ..scenario(2, 2, true)
    };
    run_many("double_failure_primary_then_successor", sc, 6);
}

#[test]
fn primary_crash_over_very_lossy_links() {
    let sc = Scenario {
        drop_p: 0.10,
        dup_p: 0.05,
        ..scenario(1, 1, true)
    };
    run_many("primary_crash_over_very_lossy_links", sc, 6);
}

#[test]
fn witness_crash_then_primary_crash() {
    let sc = Scenario {
        pre_fault: PreFault::CrashWitness,
        ..scenario(2, 2, true)
    };
    run_many("witness_crash_then_primary_crash", sc, 6);
}

#[test]
fn backup_cut_off_and_back_then_primary_crash() {
    let sc = Scenario {
        pre_fault: PreFault::IsolateBackup,
        ..scenario(1, 1, true)
    };
    run_many("backup_cut_off_and_back_then_primary_crash", sc, 8);
}

#[test]
fn backup_and_witness_restart_then_primary_crash() {
    let sc = Scenario {
        pre_fault: PreFault::RestartBackupAndWitness,
        ..scenario(1, 1, true)
    };
    run_many("backup_and_witness_restart_then_primary_crash", sc, 6);
}

/// M9 under faults: every backup's SSD is tiny, so GC collects segments throughout the run,
/// while a backup restarts from its segments and the primary crashes; BatchPull and
/// PriorityPull read segments GC is moving. Histories stay linearizable, nothing acked is lost.
#[test]
fn backup_gc_on_a_small_ssd_through_restart_and_primary_crash() {
    let sc = Scenario {
        small_ssd: true,
        pre_fault: PreFault::RestartBackupAndWitness,
        ..scenario(2, 1, true)
    };
    run_many(
        "backup_gc_on_a_small_ssd_through_restart_and_primary_crash",
        sc,
        6,
    );
}

#[test]
fn primary_isolated_then_healed() {
    run_many("primary_isolated_then_healed", scenario(1, 1, false), 10);
}

#[test]
fn leader_paused_repeatedly_false_soft_timeouts_then_crash() {
    // Four pauses between the soft and hard timeouts: each starts a proactive pull that the
    // leader's next heartbeat aborts; nobody is elected until the real crash.
    let sc = Scenario {
        pauses: 4,
        run_us: 2_200_000,
        ..scenario(1, 1, true)
    };
    run_many(
        "leader_paused_repeatedly_false_soft_timeouts_then_crash",
        sc,
        6,
    );
}

#[test]
fn backup_lost_for_good_substitute_then_replacement_promoted() {
    // P0 B1 W2 + spare backup 3: backup 1 dies; witness 2 substitutes, backup 3 joins, catches
    // up, is promoted and witness 2 steps back; then the primary crashes and witness 2 must
    // recover every value from backup 3 alone.
    let sc = Scenario {
        pre_fault: PreFault::LoseBackup,
        pre_fault_lead_us: 700_000,
        fault_delay_us: 700_000,
        run_us: 2_500_000,
        spares: &[(3, Kind::Backup)],
        ..scenario(1, 1, true)
    };
    run_many(
        "backup_lost_for_good_substitute_then_replacement_promoted",
        sc,
        6,
    );
}

#[test]
fn backup_lost_for_good_two_backups_two_witnesses() {
    let sc = Scenario {
        pre_fault: PreFault::LoseBackup,
        pre_fault_lead_us: 700_000,
        fault_delay_us: 700_000,
        run_us: 2_500_000,
        spares: &[(5, Kind::Backup)],
        ..scenario(2, 2, true)
    };
    run_many("backup_lost_for_good_two_backups_two_witnesses", sc, 4);
}

#[test]
fn witness_lost_for_good_replaced_then_primary_crash() {
    // P0 B1 W2 + spare witness 3: witness 2 dies; 3 replaces it and must take over when the
    // primary crashes (without it, P0's crash would leave no head to elect).
    let sc = Scenario {
        pre_fault: PreFault::CrashWitness,
        pre_fault_lead_us: 700_000,
        fault_delay_us: 700_000,
        run_us: 2_500_000,
        spares: &[(3, Kind::Head)],
        ..scenario(1, 1, true)
    };
    run_many("witness_lost_for_good_replaced_then_primary_crash", sc, 6);
}

#[test]
fn old_primary_rejoins_as_witness_and_takes_over_again() {
    // The primary crashes, restarts as a witness (no values), and when its successor crashes
    // too it is elected again and recovers from the backup.
    let sc = Scenario {
        restart_primary: true,
        double_failure: true,
        run_us: 2_500_000,
        ..scenario(1, 1, true)
    };
    run_many("old_primary_rejoins_as_witness_and_takes_over_again", sc, 6);
}

#[test]
fn long_run_past_the_log_ring_with_restarts() {
    // Heads keep 32..64 applied entries: over thousands of entries every head truncates its
    // log many times; the backup and a witness restart mid-run (the witness from a truncated
    // log: it must get a snapshot before it may stand), then the primary crashes.
    let sc = Scenario {
        pre_fault: PreFault::RestartBackupAndWitness,
        log_keep: 32,
        run_us: 2_500_000,
        fault_delay_us: 600_000,
        ..scenario(2, 2, true)
    };
    run_many("long_run_past_the_log_ring_with_restarts", sc, 6);
}

#[test]
fn backup_down_past_the_truncated_log_is_refilled_then_primary_crash() {
    // P0 B1 W2: backup 1 is down for 400 ms; witness 2 substitutes and the heads drop their
    // logs past it (keep 32). Back, it gets the leader's values, votes again and witness 2
    // steps back; half the keys are no longer written, so their newest versions reach
    // backup 1 only by the refill (checked at the end); then the primary crashes.
    let sc = Scenario {
        pre_fault: PreFault::BackupDownLong,
        pre_fault_lead_us: 1_100_000,
        fault_delay_us: 1_100_000,
        log_keep: 32,
        run_us: 2_800_000,
        ..scenario(1, 1, true)
    };
    run_many(
        "backup_down_past_the_truncated_log_is_refilled_then_primary_crash",
        sc,
        4,
    );
}
