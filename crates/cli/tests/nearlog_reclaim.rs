//! Taking a log peer's memory back, and log files outgrowing a peer's region, with separate
//! `understudy nearlog controller` / `peer` processes and unmodified applications (python3's
//! sqlite3 and os.write) under the LD_PRELOAD shim.
//!
//! - `reclaiming_a_peer_mid_load_moves_its_files_and_loses_nothing`: `understudy nearlog
//!   reclaim` of one of the WAL's peers while SQLite keeps inserting; the command finishes, the
//!   peer says it returned its region, the placement no longer names it, and after a SIGKILL of
//!   the application and a restart on an empty directory every acknowledged row is there.
//! - `a_full_region_grows_onto_peers_with_room`: three peers with a small region hold the log;
//!   peers with room start later; writes beyond the small regions succeed (the file is
//!   relocated) and the content comes back whole.
//! - `a_full_region_everywhere_fails_the_write_with_enospc`: no peer has room: the write fails
//!   with ENOSPC (never a short write); `after_enospc_the_log_recovers_exactly_the_acknowledged_writes`:
//!   recovery then returns exactly what was acknowledged.

mod nearlog_common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use nearlog_common::{free_port, recover_through_shim, shim_path, Kill, SQLITE_LOAD};

struct Cluster {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    ctl_addr: String,
    ctl_dir: PathBuf,
    secret: PathBuf,
    cluster: PathBuf,
    _ctl: Kill,
    peers: Vec<(String, Kill, PathBuf)>,
}

impl Cluster {
    fn new() -> Cluster {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_path_buf();
        let ctl_dir = root.join("ctl");
        std::fs::create_dir_all(&ctl_dir).unwrap();
        let secret = ctl_dir.join("secret");
        std::fs::write(&secret, "reclaim-test-secret").unwrap();
        let ctl_addr = format!("127.0.0.1:{}", free_port());
        let ctl = Kill(
            Command::new(env!("CARGO_BIN_EXE_understudy"))
                .args(["nearlog", "controller", "--listen", &ctl_addr, "--dir"])
                .arg(&ctl_dir)
                .arg("--secret-file")
                .arg(&secret)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let cluster = root.join("cluster.json");
        std::fs::write(&cluster, format!(r#"{{"controller":"{ctl_addr}","secret_file":"{}","peers":[]}}"#, secret.display())).unwrap();
        Cluster { _tmp: tmp, root, ctl_addr, ctl_dir, secret, cluster, _ctl: ctl, peers: Vec::new() }
    }

    /// Starts a peer lending `region_bytes`; its stdout goes to a file (read by `peer_said`).
    fn add_peer(&mut self, region_bytes: u64) -> String {
        let addr = format!("127.0.0.1:{}", free_port());
        let log = self.root.join(format!("peer-{}.out", self.peers.len()));
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_understudy"))
            .args(["nearlog", "peer", "--listen", &addr, "--controller", &self.ctl_addr, "--region-bytes", &region_bytes.to_string(), "--secret-file"])
            .arg(&self.secret)
            .stdout(out)
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.peers.push((addr.clone(), Kill(child), log));
        addr
    }

    /// Waits until every started peer registered.
    fn wait_registered(&self) {
        for _ in 0..300 {
            let st = self.state();
            if self.peers.iter().all(|(a, _, _)| st["peers"].as_object().is_some_and(|m| m.values().any(|p| p["addr"] == a.as_str()))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("peers did not register within 30 s");
    }

    /// The controller's persisted state.
    fn state(&self) -> serde_json::Value {
        let p = self.ctl_dir.join("nearlog-controller.json");
        std::fs::read(&p).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or(serde_json::Value::Null)
    }

    fn peer_said(&self, addr: &str) -> String {
        let (_, _, log) = self.peers.iter().find(|(a, _, _)| a == addr).unwrap();
        std::fs::read_to_string(log).unwrap_or_default()
    }

    fn env(&self, c: &mut Command, patterns: &str) {
        c.env("LD_PRELOAD", shim_path())
            .env("UNDERSTUDY_NEARLOG_CLUSTER", &self.cluster)
            .env("UNDERSTUDY_NEARLOG_PATTERNS", patterns)
            .env("UNDERSTUDY_NEARLOG_DEADLINE_MS", "20000");
    }
}


#[test]
fn reclaiming_a_peer_mid_load_moves_its_files_and_loses_nothing() {
    let mut c = Cluster::new();
    let addrs: Vec<String> = (0..4).map(|_| c.add_peer(64 << 20)).collect();
    c.wait_registered();
    let app = c.root.join("app");
    std::fs::create_dir_all(&app).unwrap();
    let db = app.join("db.sqlite");
    let mut cmd = Command::new("python3");
    cmd.arg("-c").arg(SQLITE_LOAD).arg(&db).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
    c.env(&mut cmd, "*-wal");
    let mut child = Kill(cmd.spawn().unwrap());
    let mut stdin = child.0.stdin.take().unwrap();
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let mut step = |n: u32| -> u64 {
        writeln!(stdin, "{n}").unwrap();
        lines.next().expect("load died").unwrap().trim().parse().unwrap()
    };
    step(200);
    let wal = format!("{}-wal", db.display());
    let st = c.state();
    let placed: Vec<u64> = st["files"][&wal]["peers"].as_array().expect("the WAL is placed").iter().map(|v| v.as_u64().unwrap()).collect();
    let victim = placed[0];
    let victim_addr = st["peers"][victim.to_string()]["addr"].as_str().unwrap().to_string();
    assert!(addrs.contains(&victim_addr));

    let mut reclaim = Command::new(env!("CARGO_BIN_EXE_understudy"));
    reclaim.args(["nearlog", "reclaim", "--controller", &c.ctl_addr, "--peer", &victim.to_string(), "--timeout-secs", "60", "--secret-file"]).arg(&c.secret);
    let mut reclaim = Kill(reclaim.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap());
    // The application keeps inserting while its WAL moves.
    let mut acked;
    let status = loop {
        acked = step(20);
        if let Some(s) = reclaim.0.try_wait().unwrap() {
            break s;
        }
        assert!(acked < 200 + 20 * 3000, "reclaim did not finish");
    };
    let mut out = String::new();
    std::io::Read::read_to_string(reclaim.0.stdout.as_mut().unwrap(), &mut out).unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(reclaim.0.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(status.success(), "reclaim failed: {out} {err}");
    assert!(out.contains("reclaimed"), "{out}");
    for _ in 0..3 {
        acked = step(50);
    }
    let st = c.state();
    let now: Vec<u64> = st["files"][&wal]["peers"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert!(!now.contains(&victim), "the WAL still lives on the reclaimed peer: {now:?}");
    assert_eq!(st["files"][&wal]["prev_peers"].as_array().map(|a| a.len()).unwrap_or(0), 0, "move complete");
    assert!(st["peers"][victim.to_string()]["draining"].as_bool().unwrap());
    // The peer returned its memory (it says so once its heartbeat finds nothing placed on it).
    let mut said = String::new();
    for _ in 0..50 {
        said = c.peer_said(&victim_addr);
        if said.contains("lent region returned") {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(said.contains("lent region returned"), "peer output: {said}");

    unsafe { libc::kill(child.0.id() as i32, libc::SIGKILL) };
    drop(child);
    let old = c.root.join("old-app");
    std::fs::rename(&app, &old).unwrap();
    std::fs::create_dir_all(&app).unwrap();
    std::fs::copy(old.join("db.sqlite"), &db).unwrap();
    let mut cmd = Command::new("python3");
    cmd.arg("-c").arg("import sqlite3,sys; print(sqlite3.connect(sys.argv[1]).execute('select count(*), max(id) from t').fetchone())").arg(&db);
    c.env(&mut cmd, "*-wal");
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("recovered"), "the WAL came back from the log peers: {err}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), format!("({acked}, {acked})"), "{err}");
}

/// Appends `count` chunks of `chunk` bytes (byte value = chunk index) with os.write + fsync,
/// printing the file size after each acknowledged write or `ERR errno` and stopping.
const APPEND: &str = r#"
import os, sys
path, chunk, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
for i in range(count):
    try:
        n = os.write(fd, bytes([i % 251]) * chunk)
        assert n == chunk, "short write %d" % n
        os.fsync(fd)
    except OSError as e:
        print("ERR", e.errno, flush=True)
        sys.exit(0)
    print(os.fstat(fd).st_size, flush=True)
"#;

fn append(c: &Cluster, path: &Path, chunk: usize, count: usize) -> (Vec<String>, String) {
    let mut cmd = Command::new("python3");
    cmd.arg("-c").arg(APPEND).arg(path).arg(chunk.to_string()).arg(count.to_string());
    c.env(&mut cmd, "*.log");
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{err}");
    (String::from_utf8_lossy(&out.stdout).lines().map(String::from).collect(), err)
}

/// Reads the log on an empty directory (recovered from the peers) and checks its content.
fn recovered_content(c: &Cluster, path: &Path) -> Vec<u8> {
    recover_through_shim(path, |cmd| c.env(cmd, "*.log"))
}

fn expected(chunk: usize, count: usize) -> Vec<u8> {
    (0..count).flat_map(|i| std::iter::repeat_n((i % 251) as u8, chunk)).collect()
}

#[test]
fn a_full_region_grows_onto_peers_with_room() {
    let mut c = Cluster::new();
    for _ in 0..3 {
        c.add_peer(256 << 10);
    }
    c.wait_registered();
    let dir = c.root.join("app");
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("grow.log");
    // Placed on the three small peers.
    let (out, err) = append(&c, &log, 16 << 10, 4);
    assert_eq!(out.last().map(String::as_str), Some("65536"), "{out:?} {err}");
    for _ in 0..3 {
        c.add_peer(64 << 20);
    }
    c.wait_registered();
    std::thread::sleep(Duration::from_millis(1500)); // heartbeats: the new peers' free space
    // 64 KiB more per write, well beyond 256 KiB: relocations, no error, no short write.
    let (out, err) = append(&c, &log, 64 << 10, 10);
    assert!(!out.iter().any(|l| l.starts_with("ERR")), "{out:?} {err}");
    assert_eq!(out.last().map(String::as_str), Some("720896"), "{out:?} {err}");
    assert!(err.contains("continuing at epoch"), "the file was relocated: {err}");
    // The relocated writer recovered from the new set with its local copy at hand.
    assert!(err.contains("verified from the local copy"), "the resume reports what it fetched: {err}");
    let st = c.state();
    let key = log.display().to_string();
    assert_eq!(st["files"][&key]["prev_peers"].as_array().map(|a| a.len()).unwrap_or(0), 0, "moves complete: {}", st["files"][&key]);
    let got = recovered_content(&c, &log);
    let mut want = expected(16 << 10, 4);
    want.extend(expected(64 << 10, 10));
    assert_eq!(got.len(), want.len());
    assert!(got == want, "recovered content differs");
}

/// Three 30 KiB writes fill 100 KiB regions on every peer; the fourth has nowhere to go.
fn fill_every_region(c: &mut Cluster) -> (PathBuf, usize) {
    for _ in 0..3 {
        c.add_peer(100 << 10);
    }
    c.wait_registered();
    let dir = c.root.join("app");
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("full.log");
    let (out, err) = append(c, &log, 30 << 10, 10);
    assert_eq!(out.last().map(String::as_str), Some(&*format!("ERR {}", libc::ENOSPC)), "{out:?} {err}");
    assert!(err.contains("no log peer has room"), "{err}");
    let acked: usize = out[out.len() - 2].parse().unwrap();
    assert_eq!(acked, 3 * (30 << 10), "three 30 KiB writes fit in 100 KiB");
    (log, acked)
}

#[test]
fn a_full_region_everywhere_fails_the_write_with_enospc() {
    let mut c = Cluster::new();
    fill_every_region(&mut c);
}

/// Recovery after ENOSPC: every region is full, so a peer whose copy is not exactly the
/// source's state cannot stage the image beside it; it releases its old copy once a majority
/// holds every acknowledged op without it, or waits like a dead peer while a majority re-bases.
#[test]
fn after_enospc_the_log_recovers_exactly_the_acknowledged_writes() {
    let mut c = Cluster::new();
    let (log, acked) = fill_every_region(&mut c);
    let got = recovered_content(&c, &log);
    assert_eq!(got.len(), acked, "exactly the acknowledged writes, nothing short or partial");
    assert!(got == expected(30 << 10, 3));
}
