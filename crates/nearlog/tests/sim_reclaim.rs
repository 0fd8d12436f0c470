//! Simulation of reclaiming log peers' memory while an application writes: one log file on 3 of
//! 5 log peers, the controller core (in-memory store) answering requests directly, a lossy,
//! duplicating, reordering network between the clients and the peers.
//!
//! Injected: reclaims of a peer of the file (the controller re-places the file; a *mover*
//! client opens it at a new epoch over the new set, which fences the writer; the writer resumes
//! at a newer epoch and resubmits what was not acknowledged), mover crashes, peer crashes (memory
//! lost; at most one down, and only while every other replica holds the newest epoch's copy),
//! writer crashes followed by a fresh open. Peers heartbeat the controller and free the files
//! it no longer places on them.
//!
//! Checked: every recovery (writer open, writer resume, mover) yields a state that contains
//! every acknowledged op; a resumed writer's recovered state plus its unacknowledged ops is its
//! own view; at the end every reclaimed peer holds nothing, no peer holds the file unless the
//! placement names it, and the final recovery has every acknowledged op.
//! `SIM_SEEDS=N` runs N seeds (default 16); `SIM_SEED=S` runs one.

mod common;

use common::{Ev, Msg};
use nearlog::core::file_client::{ClientConfig, Failure, FileClient, Input};
use nearlog::core::controller::ControllerCore;
use nearlog::store::MemStore;
use nearlog::core::peer::{PeerCore, PeerInput};
use nearlog::proto::{apply_op, CtlReply, CtlRequest, FileGrant, Op, PeerId};
use sim::{EventQueue, Network, NodeId, SimRng};

const WRITER: NodeId = 0;
const MOVER: NodeId = 100;
const NPEERS: u32 = 5;
const TICK_US: u64 = 50_000;
const HEARTBEAT_US: u64 = 300_000;
const REGION_BYTES: u64 = 8 << 20;
const KEY: &str = "/app/db-wal";

enum Fault {
    Heartbeat,
    Reclaim,
    CrashPeer,
    RestartPeer(PeerId),
    CrashWriter,
    CrashMover,
}

fn cfg() -> ClientConfig {
    ClientConfig { max_buffered_bytes: 64 * 1024, retransmit_after_us: 100_000, retransmit_batch_records: 64, patch_min_bytes: 1024 }
}

fn ids(v: &[nearlog::proto::PeerAddr]) -> Vec<PeerId> {
    v.iter().map(|p| p.id).collect()
}

fn client_for(g: &FileGrant, now: u64) -> FileClient {
    FileClient::open_moving(g.file, g.epoch, ids(&g.peers), ids(&g.recover_from), g.initialized, Vec::new(), cfg(), now)
}

struct Writer {
    client: FileClient,
    owner_epoch: u64,
    /// Resuming: the ops not acknowledged when fenced.
    resume: Option<Vec<Op>>,
    /// Whether this client came from a fresh open (vs a resume).
    fresh: bool,
    /// The current client became ready (its recovered state was checked).
    ready_seen: bool,
}

struct Mover {
    client: FileClient,
    /// The writer's session and acked floor when the mover opened (for the check).
    session: u64,
    floor: usize,
    reported: bool,
}

struct Run {
    seed: u64,
    rng: SimRng,
    net_rng: SimRng,
    net: Network<Msg>,
    q: EventQueue<Ev<Fault>>,
    ctl: ControllerCore<MemStore>,
    peers: Vec<Option<PeerCore>>,
    writer: Option<Writer>,
    mover: Option<Mover>,
    /// Images after 0..n ops of the writer's current session (index 0: its recovered base).
    history: Vec<Vec<u8>>,
    /// Index in `history` below which nothing may be lost (acknowledged).
    floor: usize,
    session: u64,
    down: Option<PeerId>,
    reclaimed: Vec<PeerId>,
    recoveries: u32,
    resumes: u32,
    /// Bytes resumed writers took from their local copy instead of fetching (and fetched).
    reused_bytes: u64,
    fetched_bytes: u64,
    moves: u32,
    acked_ops: u64,
    ending: bool,
}

impl Run {
    fn peer(&mut self, p: PeerId) -> Option<&mut PeerCore> {
        self.peers[(p - 1) as usize].as_mut()
    }

    fn file(&self) -> u64 {
        self.ctl.state().files.get(KEY).map(|m| m.file).unwrap_or(0)
    }

    fn send_out(&mut self, now: u64) {
        if let Some(w) = self.writer.as_mut() {
            common::send_out(&mut w.client, WRITER, &mut self.net, &mut self.net_rng, &mut self.q, now);
        }
        if let Some(m) = self.mover.as_mut() {
            common::send_out(&mut m.client, MOVER, &mut self.net, &mut self.net_rng, &mut self.q, now);
        }
    }

    fn open_writer(&mut self, now: u64) {
        let CtlReply::Granted(g) = self.ctl.reply_to(CtlRequest::Open { key: KEY.into(), replicas: 3 }) else { panic!("seed {}: open refused", self.seed) };
        self.writer = Some(Writer { client: client_for(&g, now), owner_epoch: g.epoch, resume: None, fresh: true, ready_seen: false });
        self.send_out(now);
    }

    fn check_recovered(&self, what: &str, recovered: &[u8], floor: usize) {
        assert!(
            self.history[floor..].iter().any(|h| h == recovered),
            "seed {}: {what} recovered {} bytes: not a state holding every acknowledged op (floor {floor} of {}; sizes {:?})",
            self.seed,
            recovered.len(),
            self.history.len() - 1,
            self.history.iter().map(|i| i.len()).collect::<Vec<_>>()
        );
    }

    /// Writer-side reactions after any input: readiness, resume, failures, app writes.
    fn writer_step(&mut self, now: u64) {
        let Some(w) = self.writer.as_mut() else { return };
        if let Some(f) = w.client.failure().cloned() {
            if common::trace() {
                eprintln!("{now}: writer failure {f} (ready {}, resume {})", w.client.is_ready(), w.resume.is_some());
            }
            match f {
                Failure::Fenced { .. } => {
                    // Fenced by the mover: resume at a newer epoch.
                    if w.resume.is_none() {
                        if !w.ready_seen {
                            // Fenced during its own open's recovery: open again (as the shim does).
                            self.writer = None;
                            self.open_writer(now);
                            return;
                        }
                        self.floor = self.floor.max(w.client.acked_seq().saturating_sub(1) as usize);
                        w.resume = Some(w.client.unacked_ops());
                    }
                    let w = self.writer.as_mut().unwrap();
                    let CtlReply::Granted(g) = self.ctl.reply_to(CtlRequest::Resume { key: KEY.into(), epoch: w.owner_epoch }) else {
                        panic!("seed {}: resume refused", self.seed)
                    };
                    w.owner_epoch = g.epoch;
                    // The writer's local copy holds every op it submitted; sometimes it is
                    // damaged (a flipped byte): recovery must take only verified chunks from it.
                    let mut local = self.history.last().unwrap().clone();
                    if !local.is_empty() && self.rng.range_u64(0, 3) == 0 {
                        let i = self.rng.range_u64(0, local.len() as u64 - 1) as usize;
                        local[i] ^= 0x20;
                    }
                    let w = self.writer.as_mut().unwrap();
                    w.client = client_for(&g, now).with_local_copy(local);
                    w.fresh = false;
                    w.ready_seen = false;
                    self.resumes += 1;
                    self.send_out(now);
                }
                f => panic!("seed {}: writer failed: {f}", self.seed),
            }
            return;
        }
        if w.client.is_ready() {
            if let Some(rec) = w.client.take_recovered() {
                let ops = w.resume.take();
                let epoch = w.client.epoch();
                if ops.is_some() {
                    let (fetched, reused) = w.client.recovery_bytes();
                    self.fetched_bytes += fetched;
                    self.reused_bytes += reused;
                }
                self.check_recovered(if ops.is_some() { "resumed writer" } else { "opened writer" }, &rec, self.floor);
                // The Base is on a majority of the grant's set: report it (ends a pending move).
                let _ = self.ctl.reply_to(CtlRequest::Initialized { key: KEY.into(), epoch });
                self.recoveries += 1;
                self.session += 1;
                let mut hist = vec![rec.clone()];
                let w = self.writer.as_mut().unwrap();
                w.ready_seen = true;
                if let Some(ops) = ops {
                    let mut img = rec;
                    for op in ops {
                        apply_op(&mut img, &op);
                        hist.push(img.clone());
                        w.client.submit(op).unwrap();
                    }
                    assert_eq!(Some(&img), self.history.last(), "seed {}: resumed state plus unacked ops is the writer's view", self.seed);
                }
                self.history = hist;
                self.floor = 0;
                self.send_out(now);
            }
        }
        if let Some(w) = self.writer.as_mut() {
            if let Some(p) = w.client.wants_resync() {
                let img = self.history.last().unwrap().clone();
                w.client.handle(Input::Resync { peer: p, image: img });
                self.send_out(now);
            }
        }
    }

    fn app_write(&mut self, now: u64) {
        let Some(w) = self.writer.as_mut() else { return };
        if !w.client.is_ready() || w.resume.is_some() || w.client.failure().is_some() || self.ending {
            return;
        }
        if w.client.last_seq() - w.client.acked_seq() >= 4 || self.history.len() > 300 {
            return;
        }
        let cur = self.history.last().unwrap().clone();
        let size = cur.len() as u64;
        let op = match self.rng.range_u64(0, 19) {
            0 => Op::Truncate { size: self.rng.range_u64(0, size) },
            _ if size > 200_000 => Op::Truncate { size: self.rng.range_u64(0, size / 2) },
            1 => Op::Truncate { size: size + self.rng.range_u64(1, 3000) },
            2 | 3 if size > 0 => Op::write(self.rng.range_u64(0, size - 1), vec![self.rng.range_u64(1, 255) as u8; self.rng.range_u64(1, 300) as usize]),
            _ => {
                let len = self.rng.range_u64(1, 2000) as usize;
                Op::write(size, (0..len).map(|_| self.rng.range_u64(0, 255) as u8).collect())
            }
        };
        let mut next = cur;
        apply_op(&mut next, &op);
        w.client.submit(op).unwrap();
        self.history.push(next);
        self.send_out(now);
    }

    fn mover_step(&mut self, now: u64) {
        let pending = self.ctl.state().files.get(KEY).is_some_and(|m| !m.prev_peers.is_empty());
        if self.mover.is_none() {
            if pending && !self.ending {
                let CtlReply::Granted(g) = self.ctl.reply_to(CtlRequest::Move { key: KEY.into() }) else { panic!("seed {}: move refused", self.seed) };
                self.mover = Some(Mover { client: client_for(&g, now), session: self.session, floor: self.writer_floor(), reported: false });
                self.send_out(now);
            }
            return;
        }
        let m = self.mover.as_mut().unwrap();
        if m.client.failure().is_some() {
            // Fenced by the writer's resume (or an open): the writer completes the move.
            self.mover = None;
            return;
        }
        if let Some(rec) = m.client.take_recovered() {
            if m.session == self.session {
                let floor = m.floor;
                self.check_recovered("mover", &rec, floor);
            }
            let m = self.mover.as_mut().unwrap();
            let epoch = m.client.epoch();
            m.reported = true;
            if self.ctl.reply_to(CtlRequest::Initialized { key: KEY.into(), epoch }) == CtlReply::Ok {
                self.moves += 1;
            }
        }
        let m = self.mover.as_mut().unwrap();
        if m.reported && m.client.fully_replicated() {
            self.mover = None;
        }
    }

    /// Ops of the writer's current session acknowledged so far (index into `history`).
    fn writer_floor(&self) -> usize {
        match &self.writer {
            Some(w) if w.client.is_ready() && w.resume.is_none() => self.floor.max(w.client.acked_seq().saturating_sub(1) as usize),
            _ => self.floor,
        }
    }

    fn heartbeats(&mut self) {
        for p in 1..=NPEERS {
            let Some(core) = self.peers[(p - 1) as usize].as_ref() else { continue };
            let req = CtlRequest::PeerHeartbeat { peer: p, used_bytes: core.used_bytes(), files: core.files() };
            if let CtlReply::Heartbeat { release, .. } = self.ctl.reply_to(req) {
                for f in release {
                    self.peer(p).unwrap().handle(PeerInput::Release(f));
                }
            }
        }
    }

    /// Fault budget f = 1: crash a peer only while every other replica (current set and
    /// pending-move set) holds a copy of the newest epoch any peer holds.
    fn may_crash(&self, p: PeerId) -> bool {
        let Some(m) = self.ctl.state().files.get(KEY) else { return false };
        let file = m.file;
        let newest = (1..=NPEERS).filter_map(|q| self.peers[(q - 1) as usize].as_ref().and_then(|c| c.holding(file))).map(|h| h.epoch).max();
        let Some(newest) = newest else { return false };
        self.down.is_none()
            && m.peers.iter().chain(&m.prev_peers).filter(|&&q| q != p).all(|&q| self.peers[(q - 1) as usize].as_ref().and_then(|c| c.holding(file)).is_some_and(|h| h.epoch == newest))
    }
}

fn run(seed: u64) -> (u32, u32, u32, u64, u64, u64) {
    let mut rng = SimRng::new(seed);
    let net_rng = rng.fork();
    let net: Network<Msg> = common::network(&mut rng, 0.7, 0.05, 3_000);
    let mut ctl = ControllerCore::open(MemStore::default()).unwrap();
    for i in 1..=NPEERS {
        assert_eq!(ctl.reply_to(CtlRequest::RegisterPeer { addr: format!("p{i}"), region_bytes: REGION_BYTES, known_as: None }), CtlReply::Registered { peer: i });
    }
    let mut r = Run {
        seed,
        rng,
        net_rng,
        net,
        q: EventQueue::new(200_000),
        ctl,
        peers: (0..NPEERS).map(|_| Some(PeerCore::new(REGION_BYTES))).collect(),
        writer: None,
        mover: None,
        history: vec![Vec::new()],
        floor: 0,
        session: 0,
        down: None,
        reclaimed: Vec::new(),
        recoveries: 0,
        resumes: 0,
        reused_bytes: 0,
        fetched_bytes: 0,
        moves: 0,
        acked_ops: 0,
        ending: false,
    };
    let end_us = 20_000_000;
    let mut t = 0;
    while t < end_us {
        t += r.rng.range_u64(300_000, 1_500_000);
        if t >= end_us {
            break;
        }
        let ev = match r.rng.range_u64(0, 9) {
            0..=2 => Fault::Reclaim,
            3..=4 => Fault::CrashPeer,
            5 => Fault::CrashMover,
            _ => Fault::CrashWriter,
        };
        r.q.push_at(t, Ev::Fault(ev)).unwrap();
    }
    r.q.push_at(0, Ev::Tick).unwrap();
    r.q.push_at(0, Ev::Fault(Fault::Heartbeat)).unwrap();
    r.open_writer(0);
    let mut final_opened = false;
    while let Some((now, ev)) = r.q.pop() {
        // Every core checks its invariants after every step, in all builds.
        r.ctl.check_invariants();
        for p in r.peers.iter().flatten() {
            p.check_invariants();
        }
        if let Some(w) = &r.writer {
            w.client.check_invariants_deep();
        }
        if let Some(m) = &r.mover {
            m.client.check_invariants_deep();
        }
        if now > end_us + 60_000_000 {
            break;
        }
        if now > end_us && !r.ending {
            // Final round: every peer up, the writer crashes and must recover everything.
            r.ending = true;
            if let Some(p) = r.down.take() {
                r.q.push_at(now, Ev::Fault(Fault::RestartPeer(p))).unwrap();
            }
            r.q.push_at(now + 1, Ev::Fault(Fault::CrashWriter)).unwrap();
        }
        match ev {
            Ev::Deliver(d) => {
                let Some(d) = r.net.receive(d) else { continue };
                match d.msg {
                    Msg::Req(req) => {
                        let Some(p) = r.peer(d.to as PeerId) else { continue };
                        let rep = p.reply_to(req);
                        r.net.send(&mut r.net_rng, &mut r.q, now, d.to, d.from, Msg::Rep(rep)).unwrap();
                    }
                    Msg::Rep(rep) if d.to == WRITER => {
                        if let Some(w) = r.writer.as_mut() {
                            w.client.handle(Input::Reply { peer: d.from as PeerId, reply: rep });
                            r.send_out(now);
                            r.writer_step(now);
                        }
                    }
                    Msg::Rep(rep) => {
                        if let Some(m) = r.mover.as_mut() {
                            m.client.handle(Input::Reply { peer: d.from as PeerId, reply: rep });
                            r.send_out(now);
                            r.mover_step(now);
                        }
                    }
                }
            }
            Ev::Tick => {
                if let Some(w) = r.writer.as_mut() {
                    w.client.handle(Input::Tick { now_us: now });
                }
                if let Some(m) = r.mover.as_mut() {
                    m.client.handle(Input::Tick { now_us: now });
                }
                r.send_out(now);
                r.writer_step(now);
                // The application writes at most one op per tick: it stays active all run
                // long, so moves fence it mid-load.
                r.app_write(now);
                r.mover_step(now);
                let done = final_opened && r.writer.as_ref().is_some_and(|w| w.client.is_ready() && w.resume.is_none()) && r.mover.is_none();
                if !done {
                    r.q.push_after(now, TICK_US, Ev::Tick).unwrap();
                }
            }
            Ev::Fault(Fault::Heartbeat) => {
                r.heartbeats();
                if !(final_opened && r.q.len() <= 2) {
                    r.q.push_after(now, HEARTBEAT_US, Ev::Fault(Fault::Heartbeat)).unwrap();
                }
            }
            Ev::Fault(Fault::Reclaim) if common::trace() && {
                eprintln!("{now}: reclaim event; meta {:?}", r.ctl.state().files.get(KEY));
                false
            } => {}
            Ev::Fault(Fault::Reclaim) => {
                // Reclaim one of the file's current peers (5 peers, 3 replicas: at most 2).
                let Some(m) = r.ctl.state().files.get(KEY).cloned() else { continue };
                if r.reclaimed.len() >= 2 || !m.prev_peers.is_empty() {
                    continue;
                }
                let p = m.peers[r.rng.range_u64(0, m.peers.len() as u64 - 1) as usize];
                match r.ctl.reply_to(CtlRequest::Reclaim { peer: p }) {
                    CtlReply::Reclaiming { .. } => r.reclaimed.push(p),
                    other => panic!("seed {seed}: reclaim of {p} refused: {other:?}"),
                }
                r.mover_step(now);
            }
            Ev::Fault(Fault::CrashPeer) => {
                let Some(m) = r.ctl.state().files.get(KEY).cloned() else { continue };
                let p = m.peers[r.rng.range_u64(0, m.peers.len() as u64 - 1) as usize];
                if r.ending || !r.may_crash(p) {
                    continue;
                }
                r.net.set_down(p as NodeId, true);
                r.peers[(p - 1) as usize] = None;
                r.down = Some(p);
                let back = r.rng.range_u64(100_000, 1_500_000);
                r.q.push_after(now, back, Ev::Fault(Fault::RestartPeer(p))).unwrap();
            }
            Ev::Fault(Fault::RestartPeer(p)) => {
                if r.down == Some(p) {
                    r.down = None;
                }
                if r.peers[(p - 1) as usize].is_none() {
                    r.peers[(p - 1) as usize] = Some(PeerCore::new(REGION_BYTES));
                    r.net.set_down(p as NodeId, false);
                    let _ = r.ctl.reply_to(CtlRequest::RegisterPeer { addr: format!("p{p}"), region_bytes: REGION_BYTES, known_as: None });
                }
            }
            Ev::Fault(Fault::CrashMover) => {
                r.mover = None;
            }
            Ev::Fault(Fault::CrashWriter) => {
                let Some(w) = r.writer.take() else { continue };
                if w.client.is_ready() && w.resume.is_none() {
                    let acked_ops = w.client.acked_seq().saturating_sub(1) as usize;
                    r.acked_ops += acked_ops as u64;
                    r.floor = r.floor.max(acked_ops);
                    r.history.truncate(w.client.last_seq() as usize);
                }
                final_opened = r.ending;
                r.open_writer(now + 1);
            }
        }
    }
    let w = r.writer.as_ref().expect("writer");
    assert!(w.client.is_ready() && w.resume.is_none(), "seed {seed}: the final recovery did not finish");
    // A few more heartbeats: peers free what is no longer placed on them.
    r.heartbeats();
    r.heartbeats();
    let m = r.ctl.state().files[KEY].clone();
    assert!(m.prev_peers.is_empty(), "seed {seed}: a move is still pending at the end: {m:?}");
    let file = m.file;
    for p in 1..=NPEERS {
        let Some(core) = r.peers[(p - 1) as usize].as_ref() else { continue };
        if !m.peers.contains(&p) {
            assert_eq!(core.used_bytes(), 0, "seed {seed}: peer {p} (not placed) still holds {} bytes", core.used_bytes());
            assert!(core.holding(file).is_none(), "seed {seed}: peer {p} still holds the file");
        }
    }
    for p in &r.reclaimed {
        assert!(!m.peers.contains(p), "seed {seed}: reclaimed peer {p} still placed");
        assert!(r.ctl.files_on(*p).is_empty());
    }
    let _ = r.file();
    (r.recoveries, r.resumes, r.moves, r.acked_ops, r.reused_bytes, r.fetched_bytes)
}

#[test]
fn reclaiming_peers_while_writing_loses_nothing_over_many_seeds() {
    let (seeds, one) = common::seeds(16);
    let (mut rec, mut res, mut moves, mut acked, mut reused, mut fetched) = (0, 0, 0, 0, 0, 0);
    for &seed in &seeds {
        let (a, b, c, d, e, f) = run(seed);
        rec += a;
        res += b;
        moves += c;
        acked += d;
        reused += e;
        fetched += f;
    }
    println!("{} seeds: {rec} recoveries, {res} writer resumes ({reused} bytes taken from the local copy, {fetched} fetched), {moves} moves completed by a mover, {acked} acknowledged ops checked", seeds.len());
    if !one {
        assert!(res > 0, "some writer was fenced by a move and resumed");
        assert!(reused > 0, "some resumed writer took verified chunks from its local copy");
    }
}

#[test]
fn same_seed_same_outcome() {
    assert_eq!(run(5), run(5));
}
