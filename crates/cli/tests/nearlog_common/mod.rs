//! Shared by the nearlog integration tests: the shim, a local nearlog cluster, process guards.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// Kills (SIGKILL) and reaps a child on drop, also on panic.
pub struct Kill(pub Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Builds the LD_PRELOAD shim (a cdylib is not built as a dependency) and returns its path.
pub fn shim_path() -> PathBuf {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_understudy"));
    let dir = bin.parent().unwrap().to_path_buf();
    let so = dir.join("libnearlog_preload.so");
    let profile = if dir.ends_with("release") { vec!["--release"] } else { vec![] };
    let status = Command::new(env!("CARGO")).args(["build", "-q", "-p", "nearlog-preload"]).args(profile).status().expect("cargo");
    assert!(status.success(), "building the shim failed");
    assert!(so.exists(), "no shim at {}", so.display());
    so
}

/// `understudy nearlog up` in DIR; returns the guard and the cluster file once ready.
pub fn start_cluster(dir: &Path) -> (Kill, PathBuf) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_understudy"))
        .args(["nearlog", "up", "--dir"])
        .arg(dir)
        .args(["--region-bytes", "67108864"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let guard = Kill(child);
    let mut lines = BufReader::new(out).lines();
    loop {
        let l = lines.next().expect("nearlog up exited").unwrap();
        if l == "ready" {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    (guard, dir.join("nearlog-cluster.json"))
}

/// What every shim test starts from: the shim, a temp dir with a running cluster, and an empty
/// application directory `app` in it.
pub struct Bed {
    pub so: PathBuf,
    pub tmp: tempfile::TempDir,
    pub cluster_file: PathBuf,
    pub app: PathBuf,
    _cluster: Kill,
}

impl Bed {
    pub fn new() -> Bed {
        let so = shim_path();
        let tmp = tempfile::tempdir().unwrap();
        let (cluster, cluster_file) = start_cluster(&tmp.path().join("cluster"));
        let app = tmp.path().join("app");
        std::fs::create_dir_all(&app).unwrap();
        Bed { so, tmp, cluster_file, app, _cluster: cluster }
    }
}

/// `understudy ARGS EXTRA...` in the background, its output dropped; killed on drop.
pub fn daemon(args: &[&str], extra: &[&Path]) -> Kill {
    let mut c = Command::new(env!("CARGO_BIN_EXE_understudy"));
    c.args(args);
    for p in extra {
        c.arg(p);
    }
    Kill(c.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap())
}

/// A nearlog cluster of separate processes, so a test can stop or kill one peer: an
/// `understudy nearlog controller` and three `understudy nearlog peer`s sharing a secret, in a
/// temp dir that also holds `cluster.json` (what the shim reads) and an empty `app` directory.
pub struct Split {
    pub tmp: tempfile::TempDir,
    pub secret: PathBuf,
    pub ctl_addr: String,
    pub cluster: PathBuf,
    pub app: PathBuf,
    pub peer_addrs: Vec<String>,
    pub peers: Vec<Kill>,
    _ctl: Kill,
}

impl Split {
    pub fn start(secret_text: &str) -> Split {
        let tmp = tempfile::tempdir().unwrap();
        let ctl_dir = tmp.path().join("ctl");
        std::fs::create_dir_all(&ctl_dir).unwrap();
        let secret = ctl_dir.join("secret");
        std::fs::write(&secret, secret_text).unwrap();
        let ctl_addr = format!("127.0.0.1:{}", free_port());
        let ctl = daemon(&["nearlog", "controller", "--listen", &ctl_addr, "--secret-file"], &[&secret, Path::new("--dir"), &ctl_dir]);
        let peer_addrs: Vec<String> = (0..3).map(|_| format!("127.0.0.1:{}", free_port())).collect();
        let cluster = tmp.path().join("cluster.json");
        std::fs::write(&cluster, format!(r#"{{"controller":"{ctl_addr}","secret_file":"{}","peers":[]}}"#, secret.display())).unwrap();
        let app = tmp.path().join("app");
        std::fs::create_dir_all(&app).unwrap();
        let mut split = Split { tmp, secret, ctl_addr, cluster, app, peer_addrs, peers: Vec::new(), _ctl: ctl };
        split.peers = (0..3).map(|i| split.peer(i)).collect();
        // Registration: until the controller's state lists every peer (a fixed sleep was too
        // short on a loaded machine).
        let t = std::time::Instant::now();
        while split.controller_state()["peers"].as_object().map_or(0, |p| p.len()) < 3 {
            assert!(t.elapsed() < std::time::Duration::from_secs(30), "3 log peers did not register within 30 s: {}", split.controller_state());
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        split
    }

    /// The controller's persisted state (peers and file placements), `null` before its first
    /// write.
    pub fn controller_state(&self) -> serde_json::Value {
        std::fs::read(self.tmp.path().join("ctl").join("nearlog-controller.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or(serde_json::Value::Null)
    }

    /// Indices (into `peers`) of the peers the controller placed the file `key` on.
    pub fn peers_of(&self, key: &str) -> Vec<usize> {
        let st = self.controller_state();
        let ids = st["files"][key]["peers"].as_array().cloned().unwrap_or_default();
        ids.iter()
            .filter_map(|id| st["peers"][id.to_string()]["addr"].as_str().map(str::to_string))
            .filter_map(|addr| self.peer_addrs.iter().position(|a| *a == addr))
            .collect()
    }

    /// Starts (or restarts, empty) peer `i` on its address.
    pub fn peer(&self, i: usize) -> Kill {
        daemon(&["nearlog", "peer", "--listen", &self.peer_addrs[i], "--controller", &self.ctl_addr, "--secret-file"], &[&self.secret])
    }
}

/// Removes the local copy of `log`, then reads it back through the shim (python3 under `env`,
/// which sets LD_PRELOAD and the cluster): the bytes the log peers recovered.
pub fn recover_through_shim(log: &Path, env: impl Fn(&mut Command)) -> Vec<u8> {
    std::fs::remove_file(log).unwrap();
    let mut cmd = Command::new("python3");
    cmd.arg("-c").arg("import sys; sys.stdout.buffer.write(open(sys.argv[1], 'rb').read())").arg(log);
    env(&mut cmd);
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "reading {} back through the shim: {}", log.display(), String::from_utf8_lossy(&out.stderr));
    out.stdout
}

pub fn free_port() -> u16 {
    wire::ports::free_loopback_port().unwrap()
}

/// A SQLite writer (WAL, synchronous=FULL, no automatic checkpoints): for each line `N` on
/// stdin it inserts N rows and prints the last acknowledged row id.
pub const SQLITE_LOAD: &str = r#"
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("PRAGMA synchronous=FULL")
db.execute("PRAGMA wal_autocheckpoint=0")
db.execute("CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, v TEXT)")
i = 0
for line in sys.stdin:
    for _ in range(int(line)):
        i += 1
        db.execute("INSERT INTO t (id, v) VALUES (?, ?)", (i, "y" * (i % 200)))
    print(i, flush=True)
"#;
