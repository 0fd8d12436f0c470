//! Simulation of one log file replicated to 3 log peers over a lossy, duplicating, reordering
//! network, with peer crashes (memory lost) and restarts, at-rest corruption of a replica, and
//! client crashes followed by recovery under a new epoch.
//!
//! Beside the writer, *readers* (read-only opens verifying a local copy: a stale state of the
//! file, sometimes with a flipped byte) come and go; they read at the reader epoch while the
//! writer goes on.
//!
//! Checked after every recovery: the recovered content is exactly the content after some prefix
//! of the ops the application issued, and that prefix contains every acknowledged op (nothing
//! acknowledged lost, nothing invented). A reader's content is such a state too, holding every
//! op acknowledged before it started, and a reader never fences the writer (any failure of
//! the writer fails the run). `SIM_SEEDS=N` runs N seeds (default 60); `SIM_SEED=S` runs one.

mod common;

use common::{Ev, Msg};
use nearlog::core::file_client::{ClientConfig, Failure, FileClient, Input};
use nearlog::core::peer::PeerCore;
use nearlog::proto::{apply_op, Op};
use sim::{EventQueue, Network, NodeId, SimRng};

const CLIENT: NodeId = 0;
const READER: NodeId = 10;
const PEERS: [NodeId; 3] = [1, 2, 3];
const TICK_US: u64 = 50_000;
const FILE: u64 = 7;
const REGION_BYTES: u64 = 8 << 20;

enum Fault {
    CrashPeer(NodeId),
    RestartPeer(NodeId),
    CorruptPeer(NodeId),
    CrashClient,
    Read,
}

/// A read-only open in progress: ops of the writer's session `session` up to history index
/// `floor` were acknowledged when it started.
struct Reader {
    client: FileClient,
    floor: usize,
    session: u32,
}

fn cfg() -> ClientConfig {
    ClientConfig { max_buffered_bytes: 64 * 1024, retransmit_after_us: 100_000, retransmit_batch_records: 64, patch_min_bytes: 1024 }
}

struct Run {
    rng: SimRng,
    net_rng: SimRng,
    net: Network<Msg>,
    q: EventQueue<Ev<Fault>>,
    peers: Vec<Option<PeerCore>>,
    client: Option<FileClient>,
    epoch: u64,
    initialized: bool,
    /// History of the last session that became ready: images after 0..n of its ops.
    history: Vec<Vec<u8>>,
    /// Index in `history` up to which ops were acknowledged (at the last client crash).
    acked_floor: usize,
    /// The session being written: its base image and ops (becomes `history` once ready).
    session_base: Option<Vec<u8>>,
    session_images: Vec<Vec<u8>>,
    recoveries: u32,
    acked_ops: u64,
    reader: Option<Reader>,
    /// Reads that finished (checked), and that gave up because the file kept changing.
    reads: u32,
    reads_changing: u32,
    /// A writer that closed with every op acknowledged: its state and local copy, given to the
    /// next open as known (that open reads the copy only if a peer lacks the state).
    known: Option<(nearlog::proto::Holding, Vec<u8>)>,
    /// Opens that found the known state and took the local copy as the content.
    known_opens: u32,
    /// Sessions that patched a lagging peer (sent only the blocks it lacked).
    patching_sessions: u32,
    /// A clean close under way: no new ops; the close happens once every op is acknowledged.
    closing: bool,
    /// The close queued by `closing` is clean (its copy is current).
    clean: bool,
}

impl Run {
    fn send_out(&mut self, now: u64) {
        if let Some(c) = self.client.as_mut() {
            common::send_out(c, CLIENT, &mut self.net, &mut self.net_rng, &mut self.q, now);
        }
        if let Some(r) = self.reader.as_mut() {
            common::send_out(&mut r.client, READER, &mut self.net, &mut self.net_rng, &mut self.q, now);
        }
    }

    /// A read-only open beside the writer, with a stale local copy.
    fn start_reader(&mut self, now: u64) {
        let Some(c) = self.client.as_ref() else { return };
        if self.reader.is_some() || !c.is_ready() || !self.initialized {
            return;
        }
        let floor = c.acked_seq().saturating_sub(1) as usize;
        let mut local = self.history[self.rng.range_u64(0, self.history.len() as u64 - 1) as usize].clone();
        if !local.is_empty() && self.rng.chance(0.3) {
            let i = self.rng.range_u64(0, local.len() as u64 - 1) as usize;
            local[i] ^= 0x40;
        }
        let client = FileClient::reader(FILE, PEERS.to_vec(), Vec::new(), cfg(), now).with_local_copy(local);
        self.reader = Some(Reader { client, floor, session: self.recoveries });
        self.send_out(now);
    }

    /// The reader is done or failed: check what it read.
    fn reader_step(&mut self, seed: u64) {
        let Some(r) = self.reader.as_mut() else { return };
        if common::trace() {
            let d = format!("{:?}", r.client);
            eprintln!("reader: {}", &d[..d.len().min(400)]);
        }
        match r.client.failure() {
            Some(Failure::KeptChanging { .. }) => {
                self.reads_changing += 1;
                self.reader = None;
                return;
            }
            Some(f) => panic!("seed {seed}: a reader failed: {f}"),
            None => {}
        }
        if !r.client.is_ready() {
            return;
        }
        let got = r.client.take_recovered().expect("a ready reader has the image");
        assert_eq!(r.session, self.recoveries, "readers end with their writer's session");
        assert!(
            self.history[r.floor..].contains(&got),
            "seed {seed}: a reader read {} bytes: not a state with every op acknowledged before it started (floor {} of {})",
            got.len(),
            r.floor,
            self.history.len() - 1
        );
        self.reads += 1;
        self.reader = None;
    }

    fn open_client(&mut self, now: u64) {
        if self.client.as_ref().is_some_and(|c| c.image_bytes().patch > 0) {
            self.patching_sessions += 1;
        }
        self.epoch += 1;
        let mut c = FileClient::open(FILE, self.epoch, PEERS.to_vec(), self.initialized, Vec::new(), cfg(), now);
        if let Some((h, _)) = &self.known {
            c = c.with_known_state(*h);
        }
        self.client = Some(c);
        self.session_base = None;
        self.send_out(now);
    }

    /// The client became ready: check the recovered content and start a new session history.
    fn on_ready(&mut self, seed: u64) {
        let c = self.client.as_mut().unwrap();
        let recovered = match &self.known {
            Some((_, img)) if c.matched_known() => {
                // The bytes are there only if a peer lacked the state (then they are the copy).
                assert!(c.take_recovered().is_none_or(|r| r == *img), "a known open gives back its own copy or nothing");
                self.known_opens += 1;
                img.clone()
            }
            _ => c.take_recovered().expect("recovered image once ready"),
        };
        self.known = None;
        if common::trace() {
            let d = format!("{c:?}");
            let i = d.find("probes").unwrap_or(0);
            eprintln!("ready epoch {}: {}", self.epoch, &d[i..(i + 600).min(d.len())]);
        }
        if self.initialized {
            let ok = self.history[self.acked_floor..].contains(&recovered);
            if !ok {
                let any = self.history.iter().position(|img| *img == recovered);
                let h = &self.history[self.acked_floor];
                let diff = h.iter().zip(&recovered).position(|(a, b)| a != b);
                eprintln!("matches index {any:?}; first diff with floor state at {diff:?}");
            }
            assert!(
                ok,
                "seed {seed}: recovered {} bytes at epoch {} is not a state with every acknowledged op (floor {} of {}; sizes {:?})",
                recovered.len(),
                self.epoch,
                self.acked_floor,
                self.history.len() - 1,
                self.history.iter().map(|i| i.len()).collect::<Vec<_>>()
            );
        } else {
            assert!(recovered.is_empty(), "seed {seed}: an uninitialized file recovers empty");
        }
        self.initialized = true;
        self.recoveries += 1;
        self.history = vec![recovered.clone()];
        self.acked_floor = 0;
        self.session_base = Some(recovered);
        self.session_images = Vec::new();
    }

    fn app_step(&mut self, now: u64) {
        let Some(c) = self.client.as_mut() else { return };
        if !c.is_ready() || c.failure().is_some() || self.closing {
            return;
        }
        // Up to 4 ops outstanding (as a multi-threaded application might have).
        let outstanding = c.last_seq() - c.acked_seq();
        if outstanding >= 4 || self.history.len() > 400 {
            return;
        }
        let cur = self.history.last().unwrap().clone();
        let size = cur.len() as u64;
        let op = match self.rng.range_u64(0, 19) {
            0 => Op::Truncate { size: self.rng.range_u64(0, size) },
            _ if size > 300_000 => Op::Truncate { size: self.rng.range_u64(0, size / 2) },
            1 => Op::Truncate { size: size + self.rng.range_u64(1, 5000) }, // trailing zeros
            2 | 3 if size > 0 => {
                let off = self.rng.range_u64(0, size - 1);
                Op::write(off, vec![self.rng.range_u64(1, 255) as u8; self.rng.range_u64(1, 300) as usize])
            }
            4 => Op::write(size + self.rng.range_u64(1, 9000), vec![0xee; 10]), // a hole
            _ => {
                let len = self.rng.range_u64(1, 2000) as usize;
                let mut data = vec![0u8; len];
                for b in data.iter_mut() {
                    *b = self.rng.range_u64(0, 255) as u8;
                }
                Op::write(size, data)
            }
        };
        let mut next = cur;
        apply_op(&mut next, &op);
        c.submit(op).unwrap();
        assert_eq!(c.size(), next.len() as u64);
        self.history.push(next);
        self.send_out(now);
    }
}

fn run(seed: u64) -> (u32, u64, u32, u32, u32, u32) {
    let mut rng = SimRng::new(seed);
    let net_rng = rng.fork();
    let net: Network<Msg> = common::network(&mut rng, 0.7, 0.05, 3_000);
    let mut r = Run {
        rng,
        net_rng,
        net,
        q: EventQueue::new(200_000),
        peers: PEERS.iter().map(|_| Some(PeerCore::new(REGION_BYTES))).collect(),
        client: None,
        epoch: 0,
        initialized: false,
        history: vec![Vec::new()],
        acked_floor: 0,
        session_base: None,
        session_images: Vec::new(),
        recoveries: 0,
        acked_ops: 0,
        reader: None,
        reads: 0,
        reads_changing: 0,
        known: None,
        known_opens: 0,
        patching_sessions: 0,
        closing: false,
        clean: false,
    };
    let end_us = 20_000_000;
    // Faults: at most one peer down at a time, so a majority stays reachable.
    let mut t = 0;
    while t < end_us {
        t += r.rng.range_u64(300_000, 2_000_000);
        if t >= end_us {
            break;
        }
        let ev = match r.rng.range_u64(0, 9) {
            0..=3 => Fault::CrashPeer(PEERS[r.rng.range_u64(0, 2) as usize]),
            4 => Fault::CorruptPeer(PEERS[r.rng.range_u64(0, 2) as usize]),
            _ => Fault::CrashClient,
        };
        r.q.push_at(t, Ev::Fault(ev)).unwrap();
    }
    // Read-only opens now and then.
    let mut t = 0;
    while t < end_us {
        t += r.rng.range_u64(200_000, 1_000_000);
        r.q.push_at(t, Ev::Fault(Fault::Read)).unwrap();
    }
    r.q.push_at(0, Ev::Tick).unwrap();
    r.open_client(0);
    let mut down: Option<NodeId> = None;
    let mut corrupted = false;
    let mut ending = false;
    let mut final_opened = false;
    while let Some((now, ev)) = r.q.pop() {
        // Every core checks its invariants after every step, in all builds.
        for p in r.peers.iter().flatten() {
            p.check_invariants();
        }
        if let Some(c) = &r.client {
            c.check_invariants_deep();
        }
        if let Some(rd) = &r.reader {
            rd.client.check_invariants_deep();
        }
        if now > end_us + 60_000_000 {
            break; // liveness: the final recovery had a virtual minute; reported below
        }
        if now > end_us && !ending {
            // Final round: everyone up, the client crashes once more and must recover.
            ending = true;
            if let Some(p) = down.take() {
                r.q.push_at(now, Ev::Fault(Fault::RestartPeer(p))).unwrap();
            }
            r.q.push_at(now + 1, Ev::Fault(Fault::CrashClient)).unwrap();
        }
        match ev {
            Ev::Deliver(d) => {
                let Some(d) = r.net.receive(d) else { continue };
                match d.msg {
                    Msg::Req(req) => {
                        let Some(p) = r.peers[(d.to - 1) as usize].as_mut() else { continue };
                        let rep = p.reply_to(req);
                        r.net.send(&mut r.net_rng, &mut r.q, now, d.to, d.from, Msg::Rep(rep)).unwrap();
                    }
                    Msg::Rep(rep) if d.to == READER => {
                        if let Some(rd) = r.reader.as_mut() {
                            rd.client.handle(Input::Reply { peer: d.from, reply: rep });
                            r.reader_step(seed);
                            r.send_out(now);
                        }
                    }
                    Msg::Rep(rep) => {
                        let Some(c) = r.client.as_mut() else { continue };
                        let was_ready = c.is_ready();
                        c.handle(Input::Reply { peer: d.from, reply: rep });
                        if !was_ready && c.is_ready() {
                            r.on_ready(seed);
                        }
                        let c = r.client.as_mut().unwrap();
                        if let Some(f) = c.failure() {
                            panic!("seed {seed}: client failed: {f}");
                        }
                        if c.wants_image() {
                            let img = r.known.as_ref().expect("only a known open asks for its image").1.clone();
                            c.handle(Input::Image(img));
                        }
                        if c.wants_local_copy() {
                            // The known copy is not current: recovery compares it, fetching the rest.
                            let img = r.known.as_ref().expect("only a known open asks for its copy").1.clone();
                            c.handle(Input::LocalCopy(img));
                        }
                        if let Some(p) = c.wants_resync() {
                            let img = r.history.last().unwrap().clone();
                            c.handle(Input::Resync { peer: p, image: img });
                        }
                        if r.closing && !r.clean && c.committed_state().is_some() {
                            r.clean = true; // still closing: no new op before the close
                            r.q.push_at(now, Ev::Fault(Fault::CrashClient)).unwrap();
                        }
                        r.send_out(now);
                        r.app_step(now);
                    }
                }
            }
            Ev::Tick => {
                if let Some(c) = r.client.as_mut() {
                    c.handle(Input::Tick { now_us: now });
                }
                if let Some(rd) = r.reader.as_mut() {
                    rd.client.handle(Input::Tick { now_us: now });
                }
                r.send_out(now);
                r.app_step(now);
                if !(final_opened && r.client.as_ref().is_some_and(|c| c.is_ready())) {
                    r.q.push_after(now, TICK_US, Ev::Tick).unwrap();
                }
            }
            // Fault budget f = 1 of 3: a peer loses its memory only while the two others
            // hold the current epoch's copy, and never after a corruption (a second fault).
            Ev::Fault(Fault::CrashPeer(p))
                if down.is_none()
                    && !ending
                    && !corrupted
                    && PEERS.iter().filter(|&&q| q != p).all(|&q| {
                        r.peers[(q - 1) as usize].as_ref().and_then(|c| c.holding(FILE)).is_some_and(|h| h.epoch == r.epoch)
                    }) =>
            {
                if common::trace() {
                    eprintln!("{now}: crash peer {p}");
                }
                r.net.set_down(p, true);
                r.peers[(p - 1) as usize] = None;
                down = Some(p);
                let back = r.rng.range_u64(100_000, 1_500_000);
                r.q.push_after(now, back, Ev::Fault(Fault::RestartPeer(p))).unwrap();
            }
            Ev::Fault(Fault::CrashPeer(_)) => {}
            Ev::Fault(Fault::RestartPeer(p)) => {
                if down == Some(p) {
                    down = None;
                }
                if r.peers[(p - 1) as usize].is_none() {
                    r.peers[(p - 1) as usize] = Some(PeerCore::new(REGION_BYTES));
                    r.net.set_down(p, false);
                }
            }
            Ev::Fault(Fault::CorruptPeer(p))
                if !corrupted
                    && down.is_none()
                    && !ending
                    && PEERS.iter().all(|&q| r.peers[(q - 1) as usize].as_ref().and_then(|c| c.holding(FILE)).is_some_and(|h| h.epoch == r.epoch)) =>
            {
                // One corruption per run, and only while no peer is down: a corrupt replica plus
                // a lost one would be two faults out of three.
                if let Some(core) = r.peers[(p - 1) as usize].as_mut() {
                    let at = r.rng.range_u64(0, 1 << 20);
                    corrupted = core.corrupt(FILE, at);
                    if common::trace() {
                        eprintln!("{now}: corrupt peer {p} at {at} -> {corrupted} holding {:?}", core.holding(FILE));
                    }
                }
            }
            Ev::Fault(Fault::CorruptPeer(_)) => {}
            Ev::Fault(Fault::Read) => {
                if !ending {
                    r.start_reader(now);
                }
            }
            Ev::Fault(Fault::CrashClient) => {
                if !ending && !r.closing && !r.clean && r.client.as_ref().is_some_and(|c| c.is_ready()) && r.rng.chance(0.5) {
                    // A clean close instead: the application stops writing and closes once every
                    // op is acknowledged (its local copy is then the majority's state).
                    r.closing = true;
                    continue;
                }
                r.closing = false;
                // A reader goes with its writer's session (the check needs that session's states).
                r.reader = None;
                let Some(c) = r.client.take() else { continue };
                if c.is_ready() {
                    // The acked floor: ops 1..=acked_seq-1 of this session (seq 1 is the Base).
                    let acked_ops = c.acked_seq().saturating_sub(1) as usize;
                    r.acked_ops += acked_ops as u64;
                    r.acked_floor = acked_ops;
                    r.history.truncate(c.last_seq() as usize); // base + submitted ops
                }
                if common::trace() {
                    eprintln!("{now}: client crash clean={} state {:?}", r.clean, c.committed_state());
                }
                r.known = match c.committed_state() {
                    Some(h) if std::mem::take(&mut r.clean) => Some((h, r.history.last().unwrap().clone())),
                    _ => None,
                };
                r.clean = false;
                final_opened = ending;
                r.open_client(now + 1);
            }
        }
        // A peer restarted with amnesia after a corruption could leave one good copy: the
        // harness injects at most one memory fault per client session plus one crash at a time.
        let _ = &r.session_images;
    }
    let c = r.client.as_ref().expect("client");
    if !c.is_ready() {
        let holdings: Vec<_> = r.peers.iter().map(|p| p.as_ref().map(|p| p.holding(FILE))).collect();
        let dbg = format!("{c:?}");
        panic!("seed {seed}: final recovery did not finish (epoch {}); peers {holdings:?}; client {}", r.epoch, &dbg[..dbg.len().min(1500)]);
    }
    let patching = r.patching_sessions + u32::from(c.image_bytes().patch > 0);
    (r.recoveries, r.acked_ops, r.reads, r.reads_changing, r.known_opens, patching)
}

#[test]
fn acknowledged_writes_survive_faults_over_many_seeds() {
    let (seeds, one) = common::seeds(60);
    let (mut recoveries, mut acked, mut reads, mut changing, mut known, mut patching) = (0, 0, 0, 0, 0, 0);
    for &seed in &seeds {
        let (r, a, rd, ch, k, p) = run(seed);
        if one {
            println!("seed {seed}: {r} recoveries ({k} from a known local copy), {a} acknowledged ops, {rd} reads ({ch} gave up: the file kept changing)");
        }
        recoveries += r;
        acked += a;
        reads += rd;
        changing += ch;
        known += k;
        patching += p;
    }
    println!("{} seeds: {recoveries} recoveries ({known} from a known local copy), {acked} acknowledged ops checked, {reads} reads checked ({changing} gave up), {patching} sessions patched a lagging peer", seeds.len());
    if !one {
        assert!(recoveries as usize > seeds.len(), "every run recovers more than once");
        assert!(reads as usize > seeds.len(), "readers finished");
        assert!(known > 0, "some opens used a known local copy");
        assert!(patching > 0, "some lagging peers were patched");
    }
}

#[test]
fn same_seed_same_outcome() {
    assert_eq!(run(11), run(11));
}
