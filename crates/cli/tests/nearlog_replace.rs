//! The nearlog controller replaces a lost log peer by itself (peer leases), with separate
//! `understudy nearlog controller` / `peer` processes and a python3 writer under the
//! LD_PRELOAD shim.
//!
//! - `a_lost_peer_is_replaced_without_an_operator_and_a_second_loss_loses_nothing`: 4 peers, a
//!   file on 3 of them; SIGKILL of one of its peers: the controller (lease 2 s) declares it lost
//!   and moves the file to the spare peer while the writer keeps writing; the new peer ends up
//!   holding the file. Then SIGKILL of one of the file's other original peers: no spare is left
//!   (the controller says so), the writer still writes on the remaining majority, and the file
//!   recovered through the shim is exactly the acknowledged writes.
//! - `a_stopped_peer_is_replaced_and_when_it_resumes_it_releases_its_old_copy`: SIGSTOP of a
//!   peer (alive, silent: a partition) gets it replaced; after SIGCONT it is an ordinary live
//!   peer again (not draining) that frees its stale copy, and the file recovers whole.

mod nearlog_common;

use std::io::{BufRead, BufReader, Lines, Write};
use std::path::PathBuf;
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use nearlog::proto::{ControllerState, CtlReply, CtlRequest, PeerId};
use nearlog_common::{daemon, free_port, recover_through_shim, shim_path, Kill};

/// The lease the test's controller runs with.
const LEASE_MS: u64 = 2000;
const CHUNK: usize = 16 << 10;
/// Bound of every wait for the controller (15 leases: far beyond a replacement's ~2 leases).
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

/// A controller (lease [`LEASE_MS`], stdout kept) and 4 peers of 64 MiB, in a temp dir.
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
}

impl Bed {
    fn start() -> Bed {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_path_buf();
        let ctl_dir = root.join("ctl");
        std::fs::create_dir_all(&ctl_dir).unwrap();
        let secret_file = ctl_dir.join("secret");
        let secret = b"replace-test-secret".to_vec();
        std::fs::write(&secret_file, &secret).unwrap();
        let ctl_addr = format!("127.0.0.1:{}", free_port());
        let ctl_out = root.join("controller.out");
        let ctl = Kill(
            Command::new(env!("CARGO_BIN_EXE_understudy"))
                .args(["nearlog", "controller", "--listen", &ctl_addr, "--peer-lease-ms", &LEASE_MS.to_string(), "--dir"])
                .arg(&ctl_dir)
                .arg("--secret-file")
                .arg(&secret_file)
                .stdout(std::fs::File::create(&ctl_out).unwrap())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let peer_addrs: Vec<String> = (0..4).map(|_| format!("127.0.0.1:{}", free_port())).collect();
        let peers = peer_addrs
            .iter()
            .map(|a| Some(daemon(&["nearlog", "peer", "--listen", a, "--controller", &ctl_addr, "--region-bytes", "67108864", "--secret-file"], &[&secret_file])))
            .collect();
        let cluster = root.join("cluster.json");
        std::fs::write(&cluster, format!(r#"{{"controller":"{ctl_addr}","secret_file":"{}","peers":[]}}"#, secret_file.display())).unwrap();
        let bed = Bed { _tmp: tmp, root, ctl_addr, ctl_out, secret, cluster, peer_addrs, peers, _ctl: ctl };
        let t = Instant::now();
        // The controller may not listen yet: errors count as "not yet".
        while bed.try_status().is_none_or(|s| s.peers.values().filter(|p| p.live).count() < 4) {
            assert!(t.elapsed() < WAIT, "4 peers did not register within {WAIT:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
        bed
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

    /// What the controller printed.
    fn said(&self) -> String {
        std::fs::read_to_string(&self.ctl_out).unwrap_or_default()
    }

    /// The index into `peers` of controller peer `id`.
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
        // A file, not a pipe: the shim's notes must never block the writer.
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
fn a_lost_peer_is_replaced_without_an_operator_and_a_second_loss_loses_nothing() {
    let mut bed = Bed::start();
    let mut w = bed.writer();
    // 4 MiB before the loss: what the new peer must be brought up to.
    let at_kill = w.step(256);
    let st = bed.status();
    let placed = st.files[&w.key].peers.clone();
    assert_eq!(placed.len(), 3);
    let spare = *st.peers.keys().find(|id| !placed.contains(id)).unwrap();
    let victim = placed[0];

    // First loss: no operator; the controller moves the file to the spare.
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
        // The new peer holds at least the file as it was at the kill (heartbeats report used
        // bytes every second).
        moved_after.is_some() && st.peers[&spare].used_bytes >= at_kill as u64
    });
    let replicated_after = killed.elapsed();
    let out = bed.said();
    assert!(out.contains(&format!("peer {victim} lost")), "{out}");
    assert!(out.contains(&format!("replacing lost peer {victim} by peer {spare}")), "{out}");
    eprintln!(
        "lost peer replaced: placement moved {} ms after the kill, new peer holding {at_kill} bytes {} ms after it (lease {LEASE_MS} ms)",
        moved_after.unwrap().as_millis(),
        replicated_after.as_millis()
    );
    let st = bed.status();
    assert!(st.files[&w.key].peers.contains(&spare));
    assert!(!st.peers[&victim].live);
    w.step(32);

    // Second loss: one of the file's original peers. No spare is left: the controller says
    // so; the writer goes on with the remaining majority (the new peer and one original).
    let second = *st.files[&w.key].peers.iter().find(|&&p| p != spare).unwrap();
    let i = bed.index(second);
    drop(bed.peers[i].take());
    let said = format!("stays on lost peer {second}");
    step_until(&bed, &mut w, "the second loss reported", |_| bed.said().contains(&said));
    assert!(bed.said().contains("no live log peer outside its set has room"), "{}", bed.said());
    let acked = w.step(32);
    // Nothing acknowledged is lost: the file recovered from the two live peers.
    w.check_recovers(&bed, acked);
}

#[test]
fn a_stopped_peer_is_replaced_and_when_it_resumes_it_releases_its_old_copy() {
    let bed = Bed::start();
    let mut w = bed.writer();
    w.step(64);
    let st = bed.status();
    let file = st.files[&w.key].file;
    let victim = st.files[&w.key].peers[0];
    let pid = bed.peers[bed.index(victim)].as_ref().unwrap().0.id() as i32;
    // SAFETY: a signal to our own child, which is still ours (not reaped).
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let key = w.key.clone();
    step_until(&bed, &mut w, "the stopped peer replaced", |st| !st.files[&key].peers.contains(&victim) && st.files[&key].prev_peers.is_empty());
    assert!(bed.said().contains(&format!("peer {victim} lost")), "{}", bed.said());
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    // Back: live, not draining, its stale copy freed (no placement names it).
    step_until(&bed, &mut w, "the resumed peer back and empty", |st| {
        let p = &st.peers[&victim];
        p.live && !p.draining && p.used_bytes == 0
    });
    assert!(bed.said().contains(&format!("peer {victim} is back")), "{}", bed.said());
    assert!(!bed.status().files.values().any(|m| m.file == file && (m.peers.contains(&victim) || m.prev_peers.contains(&victim))));
    let acked = w.step(16);
    w.check_recovers(&bed, acked);
}
