//! The nearlog controller with a standby on a real 3-member etcd (issue 24, items 2-3): two
//! `understudy nearlog controller --store etcd://...` processes, 4 log peers and a python3
//! writer under the LD_PRELOAD shim, all given both controllers' addresses.
//!
//! `the_standby_controller_takes_over_and_nothing_acknowledged_is_lost`: the state is in etcd as
//! one key per peer and per file; SIGKILL of the leading controller while the writer writes (it
//! never waits for the controller: its file is open); the standby leads and serves within a
//! generous bound (the figure is printed: election TTL 2 s), from the state the leader kept (the
//! writer's file, its placement and epoch); it gives every peer a whole lease from its takeover
//! (no peer declared lost while all are alive); a new log file whose open the shim began while
//! no controller led is opened once the standby leads (the shim waits, bounded, on its list); the killed controller restarted stands by (does not listen); and both files recover
//! through the shim as exactly what was acknowledged.
//!
//! `a_stalled_leader_that_resumes_steps_down`: SIGSTOP of the leader past its lease; the standby
//! leads; SIGCONT: the old leader exits (code 3) without serving again; the peers follow the
//! new leader.

mod nearlog_common;

use std::io::{BufRead, BufReader, Lines, Write};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use nearlog::driver::control_store::{cluster_id_from_secret, CONTROLLER_ELECTION};
use nearlog::proto::{ControllerState, CtlReply, CtlRequest};
use nearlog_common::{daemon, free_port, recover_through_shim, shim_path, Kill};

/// The controllers' election lease.
const ELECTION_TTL_MS: u64 = 2000;
/// The peers' lease at the controller.
const PEER_LEASE_MS: u64 = 2000;
const CHUNK: usize = 16 << 10;
/// Bound of every wait (15 election leases: far beyond a takeover's ~1-2).
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

fn status(addr: &str, secret: &[u8]) -> Option<ControllerState> {
    // One address, one attempt: which controller answers is what is being tested.
    let mut s = nearlog::driver::blocking::connect(addr, secret, Duration::from_secs(2)).ok()?;
    match nearlog::driver::blocking::call::<_, CtlReply>(&mut s, &CtlRequest::Status, nearlog::proto::MAX_FRAME_BYTES).ok()? {
        CtlReply::Status(st) => Some(st),
        _ => None,
    }
}

fn controller(name: &str, addr: &str, store: &str, root: &Path) -> Kill {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let out = std::fs::File::create(root.join(format!("{name}.out"))).unwrap();
    Kill(
        Command::new(env!("CARGO_BIN_EXE_understudy"))
            .args(["nearlog", "controller", "--listen", addr, "--store", store, "--election-ttl-ms", &ELECTION_TTL_MS.to_string()])
            .args(["--peer-lease-ms", &PEER_LEASE_MS.to_string(), "--dir"])
            .arg(&dir)
            .arg("--secret-file")
            .arg(root.join("secret"))
            .stdout(out)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

struct Writer {
    log: PathBuf,
    err: PathBuf,
    stdin: Option<ChildStdin>,
    lines: Lines<BufReader<ChildStdout>>,
    child: Kill,
}

impl Writer {
    fn start(log: &Path, root: &Path, env: &dyn Fn(&mut Command)) -> Writer {
        let mut cmd = Command::new("python3");
        cmd.arg("-c").arg(WRITER).arg(log).arg(CHUNK.to_string()).stdin(Stdio::piped()).stdout(Stdio::piped());
        let err = root.join(format!("{}.err", log.file_name().unwrap().to_string_lossy()));
        cmd.stderr(std::fs::File::create(&err).unwrap());
        env(&mut cmd);
        let mut child = Kill(cmd.spawn().unwrap());
        let stdin = child.0.stdin.take().unwrap();
        let lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
        Writer { log: log.to_path_buf(), err, stdin: Some(stdin), lines, child }
    }

    /// Appends `n` chunks; returns the acknowledged size.
    fn step(&mut self, n: u32) -> usize {
        std::thread::sleep(Duration::from_millis(20));
        writeln!(self.stdin.as_mut().unwrap(), "{n}").unwrap();
        match self.lines.next() {
            Some(Ok(l)) => l.trim().parse().unwrap(),
            _ => panic!("the writer of {} died: {}", self.log.display(), std::fs::read_to_string(&self.err).unwrap_or_default()),
        }
    }

    /// Ends the writer and recovers its file through the shim: exactly the `acked` bytes.
    fn check_recovers(mut self, env: &dyn Fn(&mut Command), acked: usize) {
        drop(self.stdin.take());
        let _ = self.child.0.wait();
        let err = std::fs::read_to_string(&self.err).unwrap_or_default();
        let got = recover_through_shim(&self.log, env);
        assert_eq!(got.len(), acked, "recovered length of {}; writer said: {err}", self.log.display());
        assert!(got == expected(acked), "recovered content of {} differs from the acknowledged writes", self.log.display());
    }
}

#[test]
fn the_standby_controller_takes_over_and_nothing_acknowledged_is_lost() {
    // Started on this thread: the members die with it (their parent-death signal).
    let etcd = testbed::etcd::EtcdCluster::start(3).expect("etcd starts");
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    let secret = format!("nl-standby-{}-{:?}", std::process::id(), std::time::SystemTime::now()).into_bytes();
    std::fs::write(root.join("secret"), &secret).unwrap();
    let (a, b) = (format!("127.0.0.1:{}", free_port()), format!("127.0.0.1:{}", free_port()));
    let both = format!("{a},{b}");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = rt.block_on(control::Store::open(&etcd.url(), "nearlog", &cluster_id_from_secret(&secret))).unwrap();
    let leader = || rt.block_on(store.observe(CONTROLLER_ELECTION)).ok().flatten();

    let mut ctl_a = Some(controller("ctl-a", &a, &etcd.url(), &root));
    let t = Instant::now();
    while status(&a, &secret).is_none() {
        assert!(t.elapsed() < WAIT, "ctl-a never served: {}", std::fs::read_to_string(root.join("ctl-a.out")).unwrap_or_default());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(leader().as_deref(), Some(a.as_str()));
    let _ctl_b = controller("ctl-b", &b, &etcd.url(), &root);
    let sf = root.join("secret");
    let _peers: Vec<Kill> = (0..4)
        .map(|_| {
            let p = format!("127.0.0.1:{}", free_port());
            daemon(&["nearlog", "peer", "--listen", &p, "--controller", &both, "--region-bytes", "67108864", "--secret-file"], &[&sf])
        })
        .collect();
    let cluster = root.join("cluster.json");
    std::fs::write(&cluster, format!(r#"{{"controller":"{both}","secret_file":"{}","peers":[]}}"#, sf.display())).unwrap();
    let t = Instant::now();
    while status(&a, &secret).is_none_or(|s| s.peers.values().filter(|p| p.live).count() < 4) {
        assert!(t.elapsed() < WAIT, "4 peers did not register within {WAIT:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The standby does not serve while ctl-a leads.
    assert!(status(&b, &secret).is_none(), "the standby answered while ctl-a leads");

    let app = root.join("app");
    std::fs::create_dir_all(&app).unwrap();
    let shim = shim_path();
    let env = |c: &mut Command| {
        c.env("LD_PRELOAD", &shim)
            .env("UNDERSTUDY_NEARLOG_CLUSTER", &cluster)
            .env("UNDERSTUDY_NEARLOG_PATTERNS", "*.log")
            .env("UNDERSTUDY_NEARLOG_DEADLINE_MS", "20000");
    };
    let mut w = Writer::start(&app.join("w.log"), &root, &env);
    w.step(64);
    let before = status(&a, &secret).unwrap();
    let key = w.log.display().to_string();
    let meta = before.files[&key].clone();
    // The state is in etcd, one key per peer and per file.
    let peer_keys = rt.block_on(store.list(&store.prefix("nearlog", "peer"))).unwrap();
    let file_keys = rt.block_on(store.list(&store.prefix("nearlog", "file"))).unwrap();
    assert_eq!(peer_keys.len(), 4, "one key per peer");
    assert_eq!(file_keys.len(), 1, "one key per file");

    // SIGKILL of the leader while the writer writes.
    drop(ctl_a.take());
    let killed = Instant::now();
    // A new log file opened while no controller leads: the shim's open waits (bounded) for
    // the standby instead of failing.
    let mut w2 = Writer::start(&app.join("new.log"), &root, &env);
    let mut steps_during = 0;
    let takeover = loop {
        w.step(1);
        steps_during += 1;
        if let Some(st) = status(&b, &secret) {
            break (killed.elapsed(), st);
        }
        assert!(killed.elapsed() < WAIT, "ctl-b did not take over within {WAIT:?}: {}", std::fs::read_to_string(root.join("ctl-b.out")).unwrap_or_default());
    };
    let (took, st) = takeover;
    eprintln!(
        "nearlog controller takeover: ctl-b served {} ms after SIGKILL of ctl-a (election TTL {ELECTION_TTL_MS} ms, ratio {:.2}); writer acknowledged {steps_during} fsyncs meanwhile",
        took.as_millis(),
        took.as_millis() as f64 / ELECTION_TTL_MS as f64
    );
    assert_eq!(leader().as_deref(), Some(b.as_str()));
    // The new leader serves what the old one kept: the file, its placement, its epoch (no
    // epoch handed out twice).
    let m = &st.files[&key];
    assert_eq!((m.file, &m.peers), (meta.file, &meta.peers));
    assert!(m.epoch >= meta.epoch);
    assert_eq!(st.peers.len(), 4);

    // A whole lease for every peer from the takeover: none is declared lost while all live.
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(2 * PEER_LEASE_MS) {
        w.step(1);
    }
    let said = std::fs::read_to_string(root.join("ctl-b.out")).unwrap_or_default();
    assert!(!said.contains(" lost:"), "the new leader declared a live peer lost: {said}");
    let st = status(&b, &secret).unwrap();
    assert_eq!(st.peers.values().filter(|p| p.live).count(), 4, "every peer reports to the new leader");

    // The file opened during the takeover.
    let acked2 = w2.step(16);
    assert!(status(&b, &secret).unwrap().files.contains_key(&w2.log.display().to_string()));

    // The old leader, restarted, stands by: it does not listen.
    let _ctl_a2 = controller("ctl-a2", &a, &etcd.url(), &root);
    std::thread::sleep(Duration::from_millis(1000));
    assert!(status(&a, &secret).is_none(), "a restarted controller served while ctl-b leads");
    assert_eq!(leader().as_deref(), Some(b.as_str()));

    let acked = w.step(16);
    w.check_recovers(&env, acked);
    w2.check_recovers(&env, acked2);
}

/// A leader that stalls (SIGSTOP: a partition or a long pause) past its election lease is
/// replaced; when it resumes it finds its lease lost and exits (code 3) without serving again,
/// while the new leader keeps the cluster (its peers report to it).
#[test]
fn a_stalled_leader_that_resumes_steps_down() {
    let etcd = testbed::etcd::EtcdCluster::start(3).expect("etcd starts");
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    let secret = format!("nl-stall-{}-{:?}", std::process::id(), std::time::SystemTime::now()).into_bytes();
    std::fs::write(root.join("secret"), &secret).unwrap();
    let (a, b) = (format!("127.0.0.1:{}", free_port()), format!("127.0.0.1:{}", free_port()));
    let both = format!("{a},{b}");
    let mut ctl_a = controller("ctl-a", &a, &etcd.url(), &root);
    let t = Instant::now();
    while status(&a, &secret).is_none() {
        assert!(t.elapsed() < WAIT, "ctl-a never served: {}", std::fs::read_to_string(root.join("ctl-a.out")).unwrap_or_default());
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ctl_b = controller("ctl-b", &b, &etcd.url(), &root);
    let sf = root.join("secret");
    let _peers: Vec<Kill> = (0..3)
        .map(|_| {
            let p = format!("127.0.0.1:{}", free_port());
            daemon(&["nearlog", "peer", "--listen", &p, "--controller", &both, "--region-bytes", "16777216", "--secret-file"], &[&sf])
        })
        .collect();
    while status(&a, &secret).is_none_or(|s| s.peers.values().filter(|p| p.live).count() < 3) {
        assert!(t.elapsed() < WAIT, "3 peers did not register within {WAIT:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let pid = ctl_a.0.id() as i32;
    // SAFETY: signals to our own child, not yet reaped.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let stopped = Instant::now();
    while status(&b, &secret).is_none() {
        assert!(stopped.elapsed() < WAIT, "ctl-b did not take over from a stalled leader within {WAIT:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    let resumed = Instant::now();
    let code = loop {
        if let Some(st) = ctl_a.0.try_wait().unwrap() {
            break st.code();
        }
        assert!(resumed.elapsed() < WAIT, "the resumed old leader did not step down: {}", std::fs::read_to_string(root.join("ctl-a.out")).unwrap_or_default());
        std::thread::sleep(Duration::from_millis(20));
    };
    let said = std::fs::read_to_string(root.join("ctl-a.out")).unwrap_or_default();
    assert_eq!(code, Some(3), "{said}");
    assert!(said.contains("leadership lost"), "{said}");
    assert!(status(&a, &secret).is_none(), "the old leader's address still answers");
    let t = Instant::now();
    while status(&b, &secret).is_none_or(|s| s.peers.values().filter(|p| p.live).count() < 3) {
        assert!(t.elapsed() < WAIT, "the peers did not report to the new leader within {WAIT:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}
