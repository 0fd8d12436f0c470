//! Unit tests of `WitnessCore`: several cores driven by hand through a tiny in-test router
//! (messages delivered in order, NVMM persists and SSD I/O completed at once unless a test
//! holds them back, time advanced 1 ms at a time with a Tick to every live node).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use super::config::Config;
use super::node::{Input, Output, Params, RoleKind, WitnessCore};
use super::ssd::MemSsd;
use crate::witness::proto::{ClientReply, ClientReq, NodeId, PeerMsg};

const MS: u64 = 1_000;

/// A node's NVMM as its driver would replay it: the last Meta record, live entries by index.
type NvmmRegions = (
    Option<(u64, Option<NodeId>)>,
    BTreeMap<u64, crate::witness::proto::Entry>,
);

fn params() -> Params {
    Params {
        heartbeat_us: 5 * MS,
        election_timeout_us: 150 * MS,
        election_jitter_us: 20 * MS,
        lease_us: 100 * MS,
        clock_drift_us: 10 * MS,
        writeback_batch_bytes: 32 << 10,
        writeback_linger_us: 20 * MS,
        batch_pull_bytes: 16 << 10,
        pull_retry_us: 30 * MS,
        ..Params::default()
    }
}

struct Router {
    now: u64,
    nodes: BTreeMap<NodeId, WitnessCore>,
    alive: BTreeSet<NodeId>,
    /// Inputs due now (NVMM persists, SSD writes: immediate).
    queue: VecDeque<(NodeId, Input)>,
    /// Inputs due at the next millisecond (messages and SSD reads: 1 ms latency).
    later: VecDeque<(NodeId, Input)>,
    /// Directed links that drop everything.
    cut: BTreeSet<(NodeId, NodeId)>,
    /// Nodes whose NVMM persists are held back (they never ack).
    hold_persist: BTreeSet<NodeId>,
    held: Vec<(NodeId, u64)>,
    ssd: HashMap<NodeId, MemSsd>,
    replies: HashMap<u64, ClientReply>,
    next_tag: u64,
    /// (time, node, role) of every role change.
    roles: Vec<(u64, NodeId, RoleKind)>,
    recovered: Vec<NodeId>,
    stats: Vec<(NodeId, super::node::RecoveryStats)>,
    /// What each node's NVMM regions hold (the router applies truncations and frees).
    pmem: HashMap<NodeId, NvmmRegions>,
    cfg: Config,
    p: Params,
}

impl Router {
    fn new(cfg: Config) -> Router {
        Router::with_params(cfg, params())
    }

    fn with_params(cfg: Config, p: Params) -> Router {
        let mut nodes = BTreeMap::new();
        for id in cfg.ids() {
            nodes.insert(id, WitnessCore::new(id, cfg.clone(), p.clone(), 0).unwrap());
        }
        let (cfg, p) = (cfg.clone(), p.clone());
        Router {
            now: 0,
            alive: nodes.keys().copied().collect(),
            nodes,
            queue: VecDeque::new(),
            later: VecDeque::new(),
            cut: BTreeSet::new(),
            hold_persist: BTreeSet::new(),
            held: Vec::new(),
            ssd: HashMap::new(),
            replies: HashMap::new(),
            next_tag: 1,
            roles: Vec::new(),
            recovered: Vec::new(),
            stats: Vec::new(),
            pmem: HashMap::new(),
            cfg,
            p,
        }
    }

    fn node(&self, id: NodeId) -> &WitnessCore {
        &self.nodes[&id]
    }

    fn crash(&mut self, id: NodeId) {
        self.alive.remove(&id);
        self.queue.retain(|(to, _)| *to != id);
        self.later.retain(|(to, _)| *to != id);
    }

    /// Restarts a crashed node from what its NVMM and SSD hold.
    fn restart(&mut self, id: NodeId) {
        let (meta, log) = self.pmem.get(&id).cloned().unwrap_or_default();
        let durable = super::node::Durable {
            meta,
            entries: log.into_values().collect(),
            ssd: self.ssd.get(&id).map(MemSsd::durable).unwrap_or_default(),
        };
        let core =
            WitnessCore::restore(id, self.cfg.clone(), self.p.clone(), self.now, durable).unwrap();
        self.nodes.insert(id, core);
        self.alive.insert(id);
    }

    fn isolate(&mut self, id: NodeId) {
        for &o in self.nodes.keys() {
            if o != id {
                self.cut.insert((id, o));
                self.cut.insert((o, id));
            }
        }
    }

    fn feed(&mut self, id: NodeId, input: Input) {
        if !self.alive.contains(&id) {
            return;
        }
        let now = self.now;
        let core = self.nodes.get_mut(&id).unwrap();
        core.handle(now, input);
        core.check_invariants_deep();
        let outs = core.take_outputs();
        for o in outs {
            match o {
                Output::Send { to, msg } => {
                    if !self.cut.contains(&(id, to)) && self.alive.contains(&to) {
                        self.later.push_back((to, Input::Peer { from: id, msg }));
                    }
                }
                Output::PmemAppend { seq, rec, .. } => {
                    let (meta, log) = self.pmem.entry(id).or_default();
                    match postcard::from_bytes::<super::node::PmemRecord>(&rec).unwrap() {
                        super::node::PmemRecord::Meta { term, voted_for } => {
                            *meta = Some((term, voted_for))
                        }
                        super::node::PmemRecord::Entry(e) => {
                            log.insert(e.index, e);
                        }
                    }
                    if self.hold_persist.contains(&id) {
                        self.held.push((id, seq));
                    } else {
                        self.queue.push_back((id, Input::PmemPersisted { seq }));
                    }
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
                    self.queue.push_back((
                        id,
                        Input::SsdWritten {
                            id: io,
                            result: Ok(()),
                        },
                    ));
                }
                Output::SsdRead {
                    id: io,
                    seg,
                    off,
                    len,
                    ..
                } => {
                    let result = self.ssd.entry(id).or_default().read(seg, off, len);
                    self.later
                        .push_back((id, Input::SsdRead { id: io, result }));
                }
                Output::SsdFree { seg } => self.ssd.entry(id).or_default().free(seg),
                Output::Reply { tag, reply } => {
                    assert!(
                        self.replies.insert(tag, reply).is_none(),
                        "two replies to {tag}"
                    );
                }
                Output::Role { role, .. } => self.roles.push((self.now, id, role)),
                Output::Recovered(st) => {
                    self.recovered.push(id);
                    self.stats.push((id, st));
                }
            }
        }
    }

    /// Delivers everything queued (bounded), then advances 1 ms and ticks every live node.
    fn step(&mut self) {
        let mut budget = 100_000;
        while let Some((to, input)) = self.queue.pop_front() {
            self.feed(to, input);
            budget -= 1;
            assert!(budget > 0, "message storm");
        }
        self.now += MS;
        self.queue = std::mem::take(&mut self.later);
        let ids: Vec<NodeId> = self.alive.iter().copied().collect();
        for id in ids {
            self.feed(id, Input::Tick);
        }
    }

    fn run_until(&mut self, max_ms: u64, mut pred: impl FnMut(&Router) -> bool) -> bool {
        for _ in 0..max_ms {
            if pred(self) {
                return true;
            }
            self.step();
        }
        pred(self)
    }

    fn run_for(&mut self, ms: u64) {
        for _ in 0..ms {
            self.step();
        }
    }

    fn serving(&self) -> Option<NodeId> {
        self.alive
            .iter()
            .copied()
            .find(|&id| self.nodes[&id].is_serving())
    }

    fn wait_serving(&mut self) -> NodeId {
        assert!(
            self.run_until(3_000, |r| r.serving().is_some()),
            "no leader"
        );
        self.serving().unwrap()
    }

    fn submit(&mut self, node: NodeId, req: ClientReq) -> u64 {
        let tag = self.next_tag;
        self.next_tag += 1;
        self.feed(node, Input::Client { tag, req });
        tag
    }

    fn call(&mut self, node: NodeId, req: ClientReq, max_ms: u64) -> Option<ClientReply> {
        let tag = self.submit(node, req);
        self.run_until(max_ms, |r| r.replies.contains_key(&tag));
        self.replies.remove(&tag)
    }

    fn put(&mut self, node: NodeId, k: &str, v: &str) -> Option<ClientReply> {
        let req = ClientReq::Put {
            key: k.as_bytes().to_vec(),
            value: v.as_bytes().to_vec(),
        };
        self.call(node, req, 500)
    }

    fn get(&mut self, node: NodeId, k: &str) -> Option<ClientReply> {
        let req = ClientReq::Get {
            key: k.as_bytes().to_vec(),
        };
        self.call(node, req, 2_000)
    }
}

fn val(v: &str) -> Option<ClientReply> {
    Some(ClientReply::Value(Some(serde_bytes::ByteBuf::from(
        v.as_bytes().to_vec(),
    ))))
}

/// Never did a backup (nodes listed) take any role but follower.
fn assert_backups_never_ran(r: &Router, backups: &[NodeId]) {
    for (t, id, role) in &r.roles {
        assert!(
            !backups.contains(id) || *role == RoleKind::Follower,
            "backup {id} became {role:?} at {t}"
        );
    }
}

#[test]
fn normal_put_get_and_writeback() {
    let mut r = Router::new(Config::standard(1, 1)); // P=0, B=1, W=2
    let p = r.wait_serving();
    assert_eq!(p, 0, "the primary's slot has the shortest timeout");
    assert_eq!(r.put(p, "a", "1"), Some(ClientReply::PutOk));
    assert_eq!(r.put(p, "a", "2"), Some(ClientReply::PutOk));
    assert_eq!(r.put(p, "b", "x"), Some(ClientReply::PutOk));
    assert_eq!(r.get(p, "a"), val("2"));
    assert_eq!(r.get(p, "b"), val("x"));
    assert_eq!(r.get(p, "nope"), Some(ClientReply::Value(None)));
    // Others redirect to the leader.
    assert_eq!(
        r.get(2, "a"),
        Some(ClientReply::NotLeader { hint: Some(0) })
    );
    assert_eq!(
        r.get(1, "a"),
        Some(ClientReply::NotLeader { hint: Some(0) })
    );
    // The witness learns keys and stamps (no values); the backup writes back after commit.
    r.run_for(60);
    let st = r.node(0).key_stamp(b"a").unwrap();
    assert_eq!(r.node(2).key_stamp(b"a"), Some(st));
    assert!(
        r.node(2).local_value(b"a").is_none(),
        "a witness holds no values"
    );
    assert_eq!(r.node(1).backup_index_stamp(b"a"), Some(st));
    assert!(r.node(1).written_back_through() >= st.index);
    // Oversized input is refused clearly.
    let big = ClientReq::Put {
        key: vec![1; 5000],
        value: vec![],
    };
    assert!(matches!(r.call(p, big, 10), Some(ClientReply::Invalid(_))));
    assert_backups_never_ran(&r, &[1]);
}

#[test]
fn commit_needs_every_voting_backup() {
    // P=0, B=1,2, W=3,4: a majority (P, B1, W3, W4) acks, but B2 does not persist.
    let mut r = Router::new(Config::standard(2, 2));
    let p = r.wait_serving();
    assert_eq!(r.put(p, "k", "old"), Some(ClientReply::PutOk));
    r.hold_persist.insert(2);
    let tag = r.submit(
        p,
        ClientReq::Put {
            key: b"k".to_vec(),
            value: b"new".to_vec(),
        },
    );
    r.run_for(300);
    assert!(
        !r.replies.contains_key(&tag),
        "acknowledged without backup 2: {:?}",
        r.replies.get(&tag)
    );
    // Not committed, so not visible.
    assert_eq!(r.get(p, "k"), val("old"));
    // Backup 2 persists: the Put commits.
    r.hold_persist.remove(&2);
    for (id, seq) in std::mem::take(&mut r.held) {
        r.queue.push_back((id, Input::PmemPersisted { seq }));
    }
    assert!(r.run_until(200, |r| r.replies.contains_key(&tag)));
    assert_eq!(r.replies.remove(&tag), Some(ClientReply::PutOk));
    assert_eq!(r.get(p, "k"), val("new"));
}

#[test]
fn witness_takes_over_and_serves_pulled_values_never_stale() {
    // No proactive pull: everything the new primary serves comes by live recovery.
    let p = Params {
        soft_timeout_us: 0,
        ..params()
    };
    let mut r = Router::with_params(Config::standard(1, 1), p); // P=0, B=1, W=2
    let p = r.wait_serving();
    let mut model: BTreeMap<String, String> = BTreeMap::new();
    for i in 0..40 {
        let (k, v) = (format!("k{:02}", i % 25), format!("v{i}"));
        assert_eq!(r.put(p, &k, &v), Some(ClientReply::PutOk));
        model.insert(k, v);
    }
    r.run_for(50); // most entries written back to the SSD log
                   // Newer versions of some written-back keys, still only in the backup's NVMM buffer.
    for i in 0..3 {
        let (k, v) = (format!("k{:02}", i), format!("late{i}"));
        assert_eq!(r.put(p, &k, &v), Some(ClientReply::PutOk));
        model.insert(k, v);
    }
    r.crash(p);
    let w = r.wait_serving();
    assert_eq!(w, 2, "the witness is elected, never the backup");
    assert_backups_never_ran(&r, &[1]);
    assert!(r.node(w).in_recovery());
    assert!(r.node(w).missing_keys() > 0);
    // Every Get during recovery answers the newest committed value (or nothing yet).
    for (k, v) in model.clone() {
        assert_eq!(r.get(w, &k), val(&v), "key {k}");
    }
    assert_eq!(r.get(w, "never"), Some(ClientReply::Value(None)));
    // A Put during recovery to a key not yet pulled wins over the pulled value.
    assert_eq!(r.put(w, "k24", "fresh"), Some(ClientReply::PutOk));
    model.insert("k24".into(), "fresh".into());
    assert!(r.run_until(2_000, |r| r.recovered.contains(&2)));
    assert_eq!(r.node(w).missing_keys(), 0);
    for (k, v) in &model {
        assert_eq!(r.get(w, k), val(v), "key {k} after recovery");
        assert_eq!(r.node(w).local_value(k.as_bytes()).unwrap().1, v.as_bytes());
    }
}

#[test]
fn deposed_primary_refuses_reads_after_its_lease() {
    let mut r = Router::new(Config::standard(1, 1));
    let p = r.wait_serving();
    assert_eq!(r.put(p, "k", "v1"), Some(ClientReply::PutOk));
    r.isolate(p);
    let cut_at = r.now;
    // After the lease (plus drift) the old primary answers no read, even before it notices.
    r.run_for(100);
    let lease_end = r.node(p).lease_until_us();
    assert!(lease_end <= cut_at + 100 * MS);
    assert_eq!(r.get(p, "k"), Some(ClientReply::NotLeader { hint: None }));
    // The witness is elected only after the old lease ran out, then takes writes.
    assert!(r.run_until(3_000, |r| r.node(2).is_serving()));
    let w = 2;
    let elected = r
        .roles
        .iter()
        .find(|(_, id, role)| *id == 2 && *role == RoleKind::Leader)
        .unwrap()
        .0;
    assert!(
        elected >= lease_end,
        "new leader at {elected} before the old lease end {lease_end}"
    );
    assert_eq!(r.put(w, "k", "v2"), Some(ClientReply::PutOk));
    assert_eq!(r.get(w, "k"), val("v2"));
    assert!(matches!(r.get(p, "k"), Some(ClientReply::NotLeader { .. })));
    // Healed, the old primary follows and redirects.
    r.cut.clear();
    r.run_for(50);
    assert_eq!(r.node(p).role(), RoleKind::Follower);
    assert_eq!(
        r.get(p, "k"),
        Some(ClientReply::NotLeader { hint: Some(2) })
    );
}

#[test]
fn lagging_witness_adopts_backup_index_and_reconciles() {
    let mut r = Router::new(Config::standard(1, 1));
    let p = r.wait_serving();
    assert_eq!(r.put(p, "a", "0"), Some(ClientReply::PutOk));
    r.run_for(20);
    // The witness hears nothing more from the primary; Puts commit on P + B alone.
    r.cut.insert((p, 2));
    for i in 0..10 {
        assert_eq!(
            r.put(p, &format!("k{i}"), &format!("v{i}")),
            Some(ClientReply::PutOk)
        );
    }
    r.run_for(40);
    r.crash(p);
    let w = r.wait_serving();
    assert_eq!(w, 2);
    assert!(
        r.node(w).counters.adoptions >= 1,
        "the witness adopted the backup's index"
    );
    for i in 0..10 {
        assert_eq!(r.get(w, &format!("k{i}")), val(&format!("v{i}")));
    }
    assert_eq!(r.get(w, "a"), val("0"));
}

#[test]
fn entries_no_backup_holds_are_dropped_by_reconciliation() {
    let mut r = Router::new(Config::standard(1, 1));
    let p = r.wait_serving();
    assert_eq!(r.put(p, "k", "committed"), Some(ClientReply::PutOk));
    r.run_for(20);
    // The backup hears nothing more: these Puts reach the witness but never commit.
    r.cut.insert((p, 1));
    let t1 = r.submit(
        p,
        ClientReq::Put {
            key: b"k".to_vec(),
            value: b"lost".to_vec(),
        },
    );
    let t2 = r.submit(
        p,
        ClientReq::Put {
            key: b"z".to_vec(),
            value: b"lost".to_vec(),
        },
    );
    r.run_for(30);
    assert!(!r.replies.contains_key(&t1) && !r.replies.contains_key(&t2));
    assert!(r.node(2).last_index() > r.node(2).commit_index());
    r.crash(p);
    let w = r.wait_serving();
    assert_eq!(w, 2);
    assert!(r.node(w).counters.reconciled_dropped >= 1);
    assert_eq!(r.get(w, "k"), val("committed"));
    assert_eq!(r.get(w, "z"), Some(ClientReply::Value(None)));
}

#[test]
fn one_head_only_layout_rejects_a_backup_candidate_message() {
    // A RequestVote claiming to come from a backup is refused (backups never run).
    let mut r = Router::new(Config::standard(1, 1));
    r.wait_serving();
    r.run_for(200);
    let term = r.node(2).term();
    let msg = PeerMsg {
        term: term + 5,
        epoch: 1,
        body: crate::witness::proto::PeerBody::RequestVote {
            candidate: 1,
            last_index: 1000,
            last_term: 1000,
        },
    };
    r.feed(2, Input::Peer { from: 1, msg });
    assert_eq!(r.node(2).term(), term, "a backup's candidacy moves no term");
}

#[test]
fn voter_in_lease_refuses_a_vote_without_moving_its_term() {
    let mut r = Router::new(Config::standard(1, 1));
    let p = r.wait_serving();
    assert_eq!(r.put(p, "k", "v"), Some(ClientReply::PutOk));
    r.run_for(10);
    for voter in [1, 2] {
        let term = r.node(voter).term();
        let msg = PeerMsg {
            term: term + 1,
            epoch: 1,
            body: crate::witness::proto::PeerBody::RequestVote {
                candidate: if voter == 1 { 2 } else { 0 },
                last_index: 1000,
                last_term: term + 1,
            },
        };
        let from = if voter == 1 { 2 } else { 0 };
        r.later.clear();
        r.feed(voter, Input::Peer { from, msg });
        assert_eq!(r.node(voter).term(), term, "in lease: term unchanged");
        let vote = r.later.iter().find_map(|(to, i)| match i {
            Input::Peer { msg, .. } if *to == from => Some(msg.body.clone()),
            _ => None,
        });
        assert!(
            matches!(
                vote,
                Some(crate::witness::proto::PeerBody::Vote {
                    granted: false,
                    in_lease: true,
                    ..
                })
            ),
            "{vote:?}"
        );
    }
}

#[test]
fn soft_timeout_pulls_ahead_aborts_on_a_live_leader_and_feeds_recovery() {
    let mut r = Router::new(Config::standard(1, 1)); // P=0, B=1, W=2
    let p = r.wait_serving();
    for i in 0..30 {
        assert_eq!(
            r.put(p, &format!("k{i}"), &format!("v{i}")),
            Some(ClientReply::PutOk)
        );
    }
    r.run_for(50); // written back: a BatchPull has something to stream
                   // A slow primary (silent longer than the soft timeout, shorter than the hard one).
    r.isolate(p);
    r.run_for(60);
    assert_eq!(
        r.node(2).counters.proactive_started,
        1,
        "the witness pulls ahead"
    );
    r.cut.clear();
    r.run_for(20);
    assert_eq!(
        r.node(2).counters.proactive_aborted,
        1,
        "a live leader aborts the pull"
    );
    assert!(r.node(p).is_serving());
    // Now the primary really fails: the pull restarts and the new primary starts warm.
    r.crash(p);
    assert!(r.run_until(3_000, |r| r.recovered.contains(&2)));
    let (_, st) = r.stats.iter().find(|(id, _)| *id == 2).unwrap().clone();
    assert!(st.proactive_installed > 0, "{st:?}");
    assert_eq!(r.node(2).counters.proactive_started, 2);
    for i in 0..30 {
        assert_eq!(r.get(2, &format!("k{i}")), val(&format!("v{i}")));
    }
}

#[test]
fn backup_answers_a_priority_pull_from_its_nvmm_buffer_first() {
    // One backup core driven by hand: v1 of "k" is written back to SSD, v2 is committed but
    // still in the NVMM buffer. A PriorityPull must return v2 (the index alone names v1).
    use crate::witness::proto::{Entry, Op, PeerBody};
    let cfg = Config::standard(1, 1);
    let mut b = WitnessCore::new(1, cfg, params(), 0).unwrap();
    let put = |i: u64, v: &str| Entry {
        index: i,
        term: 1,
        op: Op::Put {
            key: b"k".to_vec(),
            value: Some(serde_bytes::ByteBuf::from(v.as_bytes().to_vec())),
        },
    };
    let append = |entries: Vec<Entry>, prev: u64, commit: u64| Input::Peer {
        from: 0,
        msg: PeerMsg {
            term: 1,
            epoch: 1,
            body: PeerBody::AppendEntries {
                leader: 0,
                prev_index: prev,
                prev_term: if prev == 0 { 0 } else { 1 },
                entries,
                commit,
                sent_us: 0,
            },
        },
    };
    let mut ssd = MemSsd::default();
    let mut now = 0;
    let pump = |b: &mut WitnessCore, now: u64, input: Input, ssd: &mut MemSsd| {
        let mut inputs = vec![input];
        let mut sent = Vec::new();
        while let Some(i) = inputs.pop() {
            b.handle(now, i);
            for o in b.take_outputs() {
                match o {
                    Output::PmemAppend { seq, .. } => inputs.push(Input::PmemPersisted { seq }),
                    Output::SsdWrite {
                        id,
                        seg,
                        log,
                        off,
                        bytes,
                        ..
                    } => {
                        ssd.write(seg, log, off, &bytes);
                        inputs.push(Input::SsdWritten { id, result: Ok(()) });
                    }
                    Output::SsdRead {
                        id, seg, off, len, ..
                    } => {
                        let result = ssd.read(seg, off, len);
                        inputs.push(Input::SsdRead { id, result });
                    }
                    Output::Send { msg, .. } => sent.push(msg.body),
                    _ => {}
                }
            }
        }
        sent
    };
    pump(&mut b, now, append(vec![put(1, "v1")], 0, 1), &mut ssd);
    now += 50 * MS; // past the writeback linger
    pump(&mut b, now, Input::Tick, &mut ssd);
    assert_eq!(b.written_back_through(), 1);
    pump(&mut b, now, append(vec![put(2, "v2")], 1, 2), &mut ssd);
    assert_eq!(b.written_back_through(), 1, "v2 not yet written back");
    assert_eq!(b.backup_index_stamp(b"k").unwrap().index, 1);
    let pull = Input::Peer {
        from: 0,
        msg: PeerMsg {
            term: 1,
            epoch: 1,
            body: PeerBody::PriorityPull {
                id: 9,
                key: serde_bytes::ByteBuf::from(b"k".to_vec()),
            },
        },
    };
    let sent = pump(&mut b, now, pull, &mut ssd);
    let entries = sent
        .into_iter()
        .find_map(|m| match m {
            PeerBody::PriorityPullReply { id: 9, entries } => Some(entries),
            _ => None,
        })
        .expect("a PriorityPull reply");
    let newest = entries.iter().max_by_key(|e| e.stamp()).unwrap();
    assert_eq!(newest.value(), Some(&b"v2"[..]));
    assert!(
        entries.iter().any(|e| e.value() == Some(&b"v1"[..])),
        "the SSD page too"
    );
}

#[test]
fn restarted_backup_rebuilds_its_index_and_serves_the_next_primary() {
    let p = Params {
        soft_timeout_us: 0,
        ..params()
    };
    let mut r = Router::with_params(Config::standard(1, 1), p); // P=0, B=1, W=2
    let p = r.wait_serving();
    let mut model = BTreeMap::new();
    for i in 0..30 {
        let (k, v) = (format!("k{:02}", i % 12), format!("v{i}"));
        assert_eq!(r.put(p, &k, &v), Some(ClientReply::PutOk));
        model.insert(k, v);
    }
    r.run_for(50); // written back
    for i in 0..3 {
        let (k, v) = (format!("k{:02}", i), format!("buffered{i}"));
        assert_eq!(r.put(p, &k, &v), Some(ClientReply::PutOk));
        model.insert(k, v);
    }
    let before = r.node(1).backup_index_stamp(b"k05");
    assert!(before.is_some());
    r.crash(1);
    r.restart(1);
    assert_eq!(
        r.node(1).backup_index_stamp(b"k05"),
        before,
        "index rebuilt from the SSD log"
    );
    // Writes commit again once the restarted backup follows.
    assert_eq!(r.put(p, "k11", "after-restart"), Some(ClientReply::PutOk));
    model.insert("k11".into(), "after-restart".into());
    // A restarted witness follows too.
    r.crash(2);
    r.restart(2);
    r.run_for(30);
    assert_eq!(r.node(2).key_stamp(b"k11"), r.node(p).key_stamp(b"k11"));
    r.crash(p);
    let w = r.wait_serving();
    assert_eq!(w, 2);
    for (k, v) in &model {
        assert_eq!(r.get(w, k), val(v), "key {k}");
    }
}

/// The recovery policy and schemes (`node/recovery.rs`), on this module's router.
mod recovery;
mod tiers;
#[path = "reconfig_tests.rs"]
mod reconfig_tests;
#[path = "refill_tests.rs"]
mod refill_tests;
