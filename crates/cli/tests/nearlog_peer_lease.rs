//! Log peers keep a liveness lease in a real 3-member etcd (`nearlog peer --store`, issue 24
//! §3): the controller (on the same etcd, its heartbeat lease set to a minute so that only the
//! store can tell) takes a SIGKILLed peer for lost once its lease expires in etcd, and moves the
//! file to the spare peer by itself while a python3 writer under the LD_PRELOAD shim keeps
//! writing; the file recovered through the shim is exactly the acknowledged writes.

mod nearlog_common;

use std::io::{BufRead, BufReader, Lines, Write};
use std::path::PathBuf;
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use nearlog::driver::control_store::{cluster_id_from_secret, CONTROLLER_ELECTION};
use nearlog::proto::{ControllerState, CtlReply, CtlRequest, PeerId};
use nearlog_common::{daemon, free_port, recover_through_shim, shim_path, Kill};

/// The peers' lease TTL in etcd.
const LEASE_TTL_MS: u64 = 2000;
/// The controller's heartbeat lease: far beyond the test, so a lost peer is found by its store
/// lease alone.
const HEARTBEAT_LEASE_MS: u64 = 60_000;
const CHUNK: usize = 16 << 10;
/// Bound of every wait for the controller (15 leases).
const WAIT: Duration = Duration::from_secs(30);

/// For each line `N` on stdin: appends N chunks of CHUNK bytes (byte = chunk index mod 251),
/// each with os.write + fsync, then prints the file size (every byte of it acknowledged).
const WRITER: &str = r#"
import os, sys
path, chunk = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
i = 0
for line in sys.stdin:
    for _ in range(int(line)):
        n = os.write(fd, bytes([i % 251]) * chunk)
        assert n == chunk, "short write %d" % n
        os.fsync(fd)
        i += 1
    print(os.fstat(fd).st_size, flush=True)
"#;

fn expected(bytes: usize) -> Vec<u8> {
    (0..bytes / CHUNK).flat_map(|i| std::iter::repeat_n((i % 251) as u8, CHUNK)).collect()
}

/// etcd, a controller on it, 4 leased peers of 64 MiB, in a temp dir.
struct Bed {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    ctl_addr: String,
    ctl_out: PathBuf,
    secret: Vec<u8>,
    cluster: PathBuf,
    peer_addrs: Vec<String>,
    peers: Vec<Option<Kill>>,
    _ctl: Kill,
    store: control::Store,
    rt: tokio::runtime::Runtime,
    // Last: dropped after the processes that use it.
    _etcd: testbed::etcd::EtcdCluster,
}

impl Bed {
    fn start() -> Bed {
        let etcd = testbed::etcd::EtcdCluster::start(3).expect("etcd starts");
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_path_buf();
        let ctl_dir = root.join("ctl");
        std::fs::create_dir_all(&ctl_dir).unwrap();
        let secret_file = root.join("secret");
        let secret = format!("peer-lease-{}-{:?}", std::process::id(), std::time::SystemTime::now()).into_bytes();
        std::fs::write(&secret_file, &secret).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let store = rt.block_on(control::Store::open(&etcd.url(), "nearlog", &cluster_id_from_secret(&secret))).unwrap();
        let ctl_addr = format!("127.0.0.1:{}", free_port());
        let ctl_out = root.join("controller.out");
        let ctl = Kill(
            Command::new(env!("CARGO_BIN_EXE_understudy"))
                .args(["nearlog", "controller", "--listen", &ctl_addr, "--store", &etcd.url(), "--election-ttl-ms", "2000"])
                .args(["--peer-lease-ms", &HEARTBEAT_LEASE_MS.to_string(), "--dir"])
                .arg(&ctl_dir)
                .arg("--secret-file")
                .arg(&secret_file)
                .stdout(std::fs::File::create(&ctl_out).unwrap())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let peer_addrs: Vec<String> = (0..4).map(|_| format!("127.0.0.1:{}", free_port())).collect();
        let url = etcd.url();
        let ttl = LEASE_TTL_MS.to_string();
        let peers = peer_addrs
            .iter()
            .map(|a| {
                let args = ["nearlog", "peer", "--listen", a, "--controller", &ctl_addr, "--region-bytes", "67108864", "--store", &url, "--lease-ttl-ms", &ttl, "--secret-file"];
                Some(daemon(&args, &[&secret_file]))
            })
            .collect();
        let cluster = root.join("cluster.json");
        std::fs::write(&cluster, format!(r#"{{"controller":"{ctl_addr}","secret_file":"{}","peers":[]}}"#, secret_file.display())).unwrap();
        let bed = Bed { _tmp: tmp, root, ctl_addr, ctl_out, secret, cluster, peer_addrs, peers, _ctl: ctl, store, rt, _etcd: etcd };
        let t = Instant::now();
        while bed.rt.block_on(bed.store.observe(CONTROLLER_ELECTION)).ok().flatten().is_none() {
            assert!(t.elapsed() < WAIT, "no controller led within {WAIT:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
        // Every peer registered with the controller and keeps its lease in etcd.
        while bed.try_status().is_none_or(|s| s.peers.values().filter(|p| p.live).count() < 4) || bed.live().len() < 4 {
            assert!(t.elapsed() < WAIT, "4 peers did not register within {WAIT:?}: live in etcd {:?}; controller said: {}", bed.live(), bed.said());
            std::thread::sleep(Duration::from_millis(100));
        }
        bed
    }

    /// The peers etcd lists as live.
    fn live(&self) -> Vec<(String, String)> {
        self.rt.block_on(self.store.live("peer")).unwrap_or_default()
    }

    fn try_status(&self) -> Option<ControllerState> {
        match nearlog::driver::mover::ctl_call(&self.ctl_addr, &self.secret, &CtlRequest::Status) {
            Ok(CtlReply::Status(s)) => Some(s),
            _ => None,
        }
    }

    fn status(&self) -> ControllerState {
        self.try_status().expect("controller status")
    }

    fn said(&self) -> String {
        std::fs::read_to_string(&self.ctl_out).unwrap_or_default()
    }

    fn index(&self, id: PeerId) -> usize {
        let st = self.status();
        self.peer_addrs.iter().position(|a| st.peers[&id].addr == *a).unwrap()
    }

    fn env(&self, c: &mut Command) {
        c.env("LD_PRELOAD", shim_path())
            .env("UNDERSTUDY_NEARLOG_CLUSTER", &self.cluster)
            .env("UNDERSTUDY_NEARLOG_PATTERNS", "*.log")
            .env("UNDERSTUDY_NEARLOG_DEADLINE_MS", "20000");
    }

    fn writer(&self) -> Writer {
        let app = self.root.join("app");
        std::fs::create_dir_all(&app).unwrap();
        let log = app.join("w.log");
        let mut cmd = Command::new("python3");
        cmd.arg("-c").arg(WRITER).arg(&log).arg(CHUNK.to_string()).stdin(Stdio::piped()).stdout(Stdio::piped());
        let err = self.root.join("writer.err");
        cmd.stderr(std::fs::File::create(&err).unwrap());
        self.env(&mut cmd);
        let mut child = Kill(cmd.spawn().unwrap());
        let stdin = child.0.stdin.take().unwrap();
        let lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
        Writer { key: log.display().to_string(), log, err, ctl_out: self.ctl_out.clone(), stdin: Some(stdin), lines, child }
    }
}

struct Writer {
    log: PathBuf,
    key: String,
    err: PathBuf,
    ctl_out: PathBuf,
    stdin: Option<ChildStdin>,
    lines: Lines<BufReader<ChildStdout>>,
    child: Kill,
}

impl Writer {
    /// Appends `n` chunks; returns the acknowledged size.
    fn step(&mut self, n: u32) -> usize {
        // Paced: the file stays far below the peers' regions however long a phase lasts.
        std::thread::sleep(Duration::from_millis(20));
        writeln!(self.stdin.as_mut().unwrap(), "{n}").unwrap();
        match self.lines.next() {
            Some(Ok(l)) => l.trim().parse().unwrap(),
            _ => panic!("the writer died: {}\ncontroller said: {}", std::fs::read_to_string(&self.err).unwrap_or_default(), std::fs::read_to_string(&self.ctl_out).unwrap_or_default()),
        }
    }

    /// Ends the writer (after its last acknowledged step) and recovers the file from the
    /// peers through the shim: it must be exactly the `acked` bytes written.
    fn check_recovers(mut self, bed: &Bed, acked: usize) {
        drop(self.stdin.take());
        let _ = self.child.0.wait();
        let err = std::fs::read_to_string(&self.err).unwrap_or_default();
        let got = recover_through_shim(&self.log, |c| bed.env(c));
        assert_eq!(got.len(), acked, "recovered length; writer said: {err}");
        assert!(got == expected(acked), "recovered content differs from the acknowledged writes");
    }
}

/// Steps the writer until `done(status)`; panics after [`WAIT`].
fn step_until(bed: &Bed, w: &mut Writer, what: &str, mut done: impl FnMut(&ControllerState) -> bool) -> usize {
    let t = Instant::now();
    loop {
        let acked = w.step(1);
        if done(&bed.status()) {
            return acked;
        }
        assert!(t.elapsed() < WAIT, "{what}: not within {WAIT:?}; file {:?}; controller said: {}", bed.status().files.get(&w.key), bed.said());
    }
}

#[test]
fn a_killed_peer_is_replaced_once_its_store_lease_expires_and_nothing_acknowledged_is_lost() {
    let mut bed = Bed::start();
    let mut w = bed.writer();
    let at_kill = w.step(256);
    let st = bed.status();
    let placed = st.files[&w.key].peers.clone();
    assert_eq!(placed.len(), 3);
    let spare = *st.peers.keys().find(|id| !placed.contains(id)).unwrap();
    let victim = placed[0];
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let i = bed.index(victim);
    drop(bed.peers[i].take()); // SIGKILL
    let killed = Instant::now();
    let mut moved_after = None;
    let key = w.key.clone();
    step_until(&bed, &mut w, "the lost peer replaced", |st| {
        let m = &st.files[&key];
        if moved_after.is_none() && !m.peers.contains(&victim) && m.prev_peers.is_empty() {
            moved_after = Some(killed.elapsed());
        }
        moved_after.is_some() && st.peers[&spare].used_bytes >= at_kill as u64
    });
    let replicated_after = killed.elapsed();
    let out = bed.said();
    assert!(out.contains(&format!("peer {victim} lost")), "{out}");
    assert!(out.contains(&format!("replacing lost peer {victim} by peer {spare}")), "{out}");
    assert!(!bed.live().iter().any(|(id, _)| *id == victim.to_string()), "its lease is gone from etcd: {:?}", bed.live());
    let moved = moved_after.unwrap();
    eprintln!(
        "peer lease: placement moved {} ms after the SIGKILL, new peer holding {at_kill} bytes {} ms after it (store lease TTL {LEASE_TTL_MS} ms, heartbeat lease {HEARTBEAT_LEASE_MS} ms); load {}",
        moved.as_millis(),
        replicated_after.as_millis(),
        load.trim()
    );
    // Found by the store lease, not by heartbeats (a minute).
    assert!(moved < Duration::from_millis(HEARTBEAT_LEASE_MS / 2), "moved {moved:?} after the kill");
    let acked = w.step(32);
    w.check_recovers(&bed, acked);
}
