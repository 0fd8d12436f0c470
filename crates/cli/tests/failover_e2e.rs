//! Real failovers end to end: `understudy failover run` with the SQLite front (python3's sqlite3,
//! WAL, synchronous=FULL) on an ext4 volume attached through FUSE and a loop device, a load
//! generator that records every acknowledged commit through the endpoint, and injected faults.
//! After each run the table is read through the endpoint: every acknowledged commit is there and
//! nothing that was never attempted. Needs root, /dev/fuse, losetup, mkfs.ext4, python3; set
//! UNDERSTUDY_SKIP_FUSE_TESTS=1 on a machine without them.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use common::*;

fn skip() -> bool {
    if std::env::var_os("UNDERSTUDY_SKIP_FUSE_TESTS").is_some() {
        eprintln!("skipped: UNDERSTUDY_SKIP_FUSE_TESTS is set");
        return true;
    }
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "failover tests attach volumes: they need root (or UNDERSTUDY_SKIP_FUSE_TESTS=1)");
    false
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

struct Opts {
    policy: &'static str,
    housekeeping_ms: u64,
    reds_timeout_ms: u64,
    command: Option<Vec<String>>,
    healthy_timeout_ms: u64,
    /// PostgreSQL instead of the SQLite front.
    postgres: bool,
    /// MariaDB (RocksDB engine) instead of the SQLite front.
    mariadb: bool,
}

impl Default for Opts {
    fn default() -> Self {
        Opts { policy: "speculative", housekeeping_ms: 0, reds_timeout_ms: 30_000, command: None, healthy_timeout_ms: 60_000, postgres: false, mariadb: false }
    }
}

fn write_spec(dir: &Path, o: &Opts) -> (PathBuf, u16) {
    let port = free_port();
    let pg = || -> Vec<String> {
        ["failover", "postgres", "--data", "{mount}/pgdata", "--port", "{port}"].iter().map(|s| s.to_string()).collect()
    };
    let command = o.command.clone().unwrap_or_else(|| {
        if o.postgres {
            return std::iter::once(BIN.to_string()).chain(pg()).collect();
        }
        if o.mariadb {
            return [BIN, "failover", "mariadb", "--data", "{mount}/mysql", "--port", "{port}"].iter().map(|s| s.to_string()).collect();
        }
        vec![
            BIN.to_string(),
            "failover".into(),
            "sqlite-front".into(),
            "--db".into(),
            "{mount}/app.db".into(),
            "--port".into(),
            "{port}".into(),
            "--housekeeping-ms".into(),
            o.housekeeping_ms.to_string(),
        ]
    });
    let spec = serde_json::json!({
        "volume": "db",
        "state_dir": dir.join("failover"),
        "mkfs": true,
        "app": { "command": command, "stop_grace_ms": 5000 },
        "health": if o.postgres {
            serde_json::json!({ "postgres": {}, "send": "SELECT 1", "expect": "1", "timeout_ms": 1000 })
        } else if o.mariadb {
            serde_json::json!({ "mysql": {}, "send": "SELECT 1", "expect": "1", "timeout_ms": 1000 })
        } else {
            serde_json::json!({ "send": "PING", "expect": "PONG", "timeout_ms": 1000 })
        },
        "endpoint": { "listen": format!("127.0.0.1:{port}") },
        "monitor": {
            "policy": o.policy,
            "ping_interval_ms": 300,
            "reds_timeout_ms": o.reds_timeout_ms,
            "healthy_timeout_ms": o.healthy_timeout_ms,
            "max_backup_starts": 2,
            "max_aborts": 2,
            "abort_window_ms": 300000,
        },
    });
    let path = dir.join("spec.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
    (path, port)
}

/// A running `understudy failover run`; stopped (instances cleanly stopped, volumes detached)
/// when dropped, also when the test fails.
struct Monitor {
    child: Option<Child>,
    events: Receiver<serde_json::Value>,
    seen: Vec<serde_json::Value>,
    control: String,
    state_dir: PathBuf,
    cluster: PathBuf,
    stderr: PathBuf,
    /// Detach what is left on drop (not after a simulated crash: the next run adopts it).
    cleanup: bool,
}

impl Monitor {
    fn start(up: &Up, spec: &Path) -> Monitor {
        let control = format!("127.0.0.1:{}", free_port());
        let stderr = spec.with_file_name("monitor.err");
        let mut child = Command::new(BIN)
            .args(["failover", "run"])
            .arg(spec)
            .args(["--control", &control, "--cluster"])
            .arg(up.cluster_file())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(std::fs::File::create(&stderr).unwrap()))
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                eprintln!("monitor: {line}");
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                    if tx.send(v).is_err() {
                        return;
                    }
                }
            }
        });
        Monitor {
            child: Some(child),
            events: rx,
            seen: vec![],
            control,
            state_dir: spec.parent().unwrap().join("failover"),
            cluster: up.cluster_file(),
            stderr,
            cleanup: true,
        }
    }

    /// Waits for an event of this name; returns it.
    fn wait(&mut self, name: &str, timeout: Duration) -> serde_json::Value {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(v) => {
                    self.seen.push(v.clone());
                    if v["event"] == name {
                        return v;
                    }
                    if v["event"] == "gave_up" {
                        panic!("the monitor gave up waiting for {name}: {v}");
                    }
                }
                Err(_) => panic!(
                    "no {name} event within {timeout:?}; events: {:?}\nmonitor stderr:\n{}",
                    self.seen,
                    std::fs::read_to_string(&self.stderr).unwrap_or_default()
                ),
            }
        }
    }

    fn inject(&self, fault: &str, ms: u64) {
        let o = Command::new(BIN).args(["failover", "inject", "--control", &self.control, fault, &ms.to_string()]).output().unwrap();
        assert!(o.status.success(), "inject {fault}: {}", String::from_utf8_lossy(&o.stderr));
    }

    /// SIGKILL of the monitor itself; its instances keep running.
    fn crash(mut self) {
        let mut c = self.child.take().unwrap();
        let _ = c.kill();
        let _ = c.wait();
        self.cleanup = false;
    }

    fn exit_status(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        let c = self.child.as_mut()?;
        loop {
            if let Ok(Some(s)) = c.try_wait() {
                return Some(s);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            stop_child(&mut c, Duration::from_secs(60));
        }
        if !self.cleanup {
            return;
        }
        // Anything left mounted (the monitor was killed): detach by mount point.
        if let Ok(dirs) = std::fs::read_dir(self.state_dir.join("mnt")) {
            for d in dirs.flatten() {
                let _ = Command::new(BIN)
                    .args(["volume", "detach"])
                    .arg(d.path())
                    .arg("--cluster")
                    .arg(&self.cluster)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
        }
        if std::thread::panicking() {
            eprintln!("--- monitor stderr:\n{}", std::fs::read_to_string(&self.stderr).unwrap_or_default());
            if let Ok(logs) = std::fs::read_dir(self.state_dir.join("logs")) {
                for l in logs.flatten() {
                    eprintln!("--- {}:\n{}", l.path().display(), std::fs::read_to_string(l.path()).unwrap_or_default());
                }
            }
        }
    }
}

/// The load generator as a child process; returns its JSON verdict when done.
struct Load(Option<Child>);

impl Load {
    fn start(port: u16, duration_ms: u64) -> Load {
        Self::start_with(port, duration_ms, &[])
    }

    fn start_with(port: u16, duration_ms: u64, extra: &[&str]) -> Load {
        let c = Command::new(BIN)
            .args(["failover", "load", "--endpoint", &format!("127.0.0.1:{port}"), "--duration-ms", &duration_ms.to_string()])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        Load(Some(c))
    }

    fn finish(mut self) -> serde_json::Value {
        let o = self.0.take().unwrap().wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&o.stdout);
        let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap_or("null"))
            .unwrap_or_else(|_| panic!("load printed no JSON: {stdout} {}", String::from_utf8_lossy(&o.stderr)));
        assert!(o.status.success(), "the load check failed: {v}");
        v
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn check_load(v: &serde_json::Value) {
    assert_eq!(v["ok"], true, "{v}");
    assert!(v["verdict"]["missing"].as_array().unwrap().is_empty(), "acknowledged commits lost: {v}");
    assert!(v["verdict"]["unexpected"].as_array().unwrap().is_empty(), "rows never attempted: {v}");
    assert!(v["acked"].as_u64().unwrap() > 0, "no commit acknowledged at all: {v}");
}

fn volumes(up: &Up) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(&up.ok(&["volume", "list", "--json"])).unwrap();
    v.as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap().to_string()).collect()
}

#[test]
fn speculative_unclean_crash_promotes_the_backup() {
    if skip() {
        return;
    }
    let up = Up::start(4);
    up.ok(&["volume", "create", "db", "--size", "128M"]);
    let (spec, port) = write_spec(up.dir.path(), &Opts::default());
    let mut m = Monitor::start(&up, &spec);
    m.wait("primary_up", Duration::from_secs(120));
    let load = Load::start(port, 14_000);
    std::thread::sleep(Duration::from_secs(3));
    m.inject("kill", 0);
    let p = m.wait("promoted", Duration::from_secs(120));
    assert_eq!(p["volume"], "db.fo-1");
    let v = load.finish();
    check_load(&v);
    // The client saw one outage, which ended.
    assert!(v["gap_end_ms"].as_u64().unwrap() < v["duration_ms"].as_u64().unwrap(), "throughput never resumed: {v}");
    // The parent is gone (promoted child in its place).
    let vols = volumes(&up);
    assert!(vols.contains(&"db.fo-1".to_string()) && !vols.contains(&"db".to_string()), "{vols:?}");
}

#[test]
fn primary_writing_while_cut_off_rejects_collapse_then_reds_fallback() {
    if skip() {
        return;
    }
    let up = Up::start(4);
    up.ok(&["volume", "create", "db", "--size", "128M"]);
    // The front writes on its own every 100 ms (log rotation, GC), reachable or not.
    let opts = Opts { housekeeping_ms: 100, reds_timeout_ms: 15_000, ..Opts::default() };
    let (spec, port) = write_spec(up.dir.path(), &opts);
    let mut m = Monitor::start(&up, &spec);
    m.wait("primary_up", Duration::from_secs(120));
    let load = Load::start(port, 30_000);
    std::thread::sleep(Duration::from_secs(2));
    m.inject("cut", 0);
    // Every speculative attempt is rejected: the primary keeps writing its volume.
    for _ in 0..2 {
        let a = m.wait("aborted", Duration::from_secs(120));
        assert!(a["reason"].as_str().unwrap().contains("collapse rejected"), "{a}");
        let vols = volumes(&up);
        assert!(vols.contains(&"db".to_string()), "the parent must survive a rejected collapse: {vols:?}");
    }
    // After max_aborts, REDS: the timeout, fence (kill) the primary, restart on the parent.
    let r = m.wait("reds_restarted", Duration::from_secs(120));
    assert_eq!(r["volume"], "db");
    assert!(m.seen.iter().all(|e| e["event"] != "promoted"), "{:?}", m.seen);
    check_load(&load.finish());
    assert_eq!(volumes(&up), vec!["db".to_string()]);
}

#[test]
fn reds_after_clean_stop_and_speculative_after_pause() {
    if skip() {
        return;
    }
    let up = Up::start(4);
    up.ok(&["volume", "create", "db", "--size", "128M"]);
    let (spec, port) = write_spec(up.dir.path(), &Opts { policy: "reds", reds_timeout_ms: 3_000, ..Opts::default() });
    {
        let mut m = Monitor::start(&up, &spec);
        m.wait("primary_up", Duration::from_secs(120));
        let load = Load::start(port, 12_000);
        std::thread::sleep(Duration::from_secs(2));
        m.inject("stop", 0);
        let r = m.wait("reds_restarted", Duration::from_secs(120));
        assert_eq!(r["volume"], "db");
        check_load(&load.finish());
    }
    // The same application, monitor restarted with the speculative policy: it boots the primary
    // again on the volume; a pause then either heals first (aborted) or loses to the backup
    // (promoted): both keep every acknowledged commit.
    let spec_text = std::fs::read_to_string(&spec).unwrap().replace("\"reds\"", "\"speculative\"").replace("\"mkfs\": true", "\"mkfs\": false");
    std::fs::write(&spec, spec_text).unwrap();
    let mut m = Monitor::start(&up, &spec);
    m.wait("primary_up", Duration::from_secs(120));
    let load = Load::start(port, 12_000);
    std::thread::sleep(Duration::from_secs(2));
    m.inject("pause", 1_500);
    let deadline = Instant::now() + Duration::from_secs(120);
    let outcome = loop {
        let e = m.events.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("no outcome of the pause");
        m.seen.push(e.clone());
        if e["event"] == "aborted" || e["event"] == "promoted" || e["event"] == "primary_answered" {
            break e;
        }
    };
    eprintln!("pause outcome: {outcome}");
    check_load(&load.finish());
}

#[test]
fn bad_specs_and_never_healthy_apps_get_clear_errors() {
    if skip() {
        return;
    }
    let up = Up::start(4);
    // The volume does not exist.
    let (spec, _) = write_spec(up.dir.path(), &Opts::default());
    let o = Command::new(BIN).args(["failover", "run"]).arg(&spec).arg("--cluster").arg(up.cluster_file()).output().unwrap();
    let err = expect_one_line_error(&o, "failover run on a missing volume");
    assert!(err.contains("volume \"db\"") && err.contains("create it first"), "{err}");
    // A command that does not exist.
    let bad = Opts { command: Some(vec!["/nonexistent/app".into()]), ..Opts::default() };
    let (spec, _) = write_spec(up.dir.path(), &bad);
    let o = Command::new(BIN).args(["failover", "run"]).arg(&spec).arg("--cluster").arg(up.cluster_file()).output().unwrap();
    let err = expect_one_line_error(&o, "failover run with a bad command");
    assert!(err.contains("not found"), "{err}");
    // An application that never becomes healthy: bounded wait, a clear error, volume intact.
    up.ok(&["volume", "create", "db", "--size", "128M"]);
    let never = Opts { command: Some(vec!["sleep".into(), "600".into()]), healthy_timeout_ms: 3_000, ..Opts::default() };
    let (spec, _) = write_spec(up.dir.path(), &never);
    let mut m = Monitor::start(&up, &spec);
    let g = loop {
        let e = m.events.recv_timeout(Duration::from_secs(120)).expect("no gave_up event");
        if e["event"] == "gave_up" {
            break e;
        }
    };
    assert!(g["reason"].as_str().unwrap().contains("did not become healthy"), "{g}");
    let status = m.exit_status(Duration::from_secs(60)).expect("the monitor did not exit after giving up");
    assert!(!status.success());
    assert_eq!(volumes(&up), vec!["db".to_string()]);
}

#[test]
fn monitor_killed_mid_failover_resumes_and_promotes_once() {
    if skip() {
        return;
    }
    let up = Up::start(4);
    up.ok(&["volume", "create", "db", "--size", "128M"]);
    let (spec, port) = write_spec(up.dir.path(), &Opts::default());
    let mut m = Monitor::start(&up, &spec);
    m.wait("primary_up", Duration::from_secs(120));
    let load = Load::start(port, 25_000);
    std::thread::sleep(Duration::from_secs(2));
    m.inject("kill", 0);
    m.wait("backup_started", Duration::from_secs(60));
    // The monitor dies in the middle of the failover (its journal says: recovering on db.fo-1).
    m.crash();
    let mut m = Monitor::start(&up, &spec);
    let p = m.wait("promoted", Duration::from_secs(120));
    assert_eq!(p["volume"], "db.fo-1", "{p}");
    check_load(&load.finish());
    assert_eq!(volumes(&up), vec!["db.fo-1".to_string()]);
    assert_eq!(m.seen.iter().filter(|e| e["event"] == "promoted").count(), 1);
}

/// PostgreSQL (Debian's, unmodified) under load, SIGKILL of the whole primary mid-load, a
/// speculative failover onto the super child: every acknowledged commit is present after the
/// promotion and no row that was never attempted appears.
#[test]
fn postgres_unclean_crash_speculative_failover_keeps_every_commit() {
    if skip() {
        return;
    }
    if std::path::Path::new("/usr/lib/postgresql").read_dir().map_or(true, |mut d| d.next().is_none()) {
        panic!("PostgreSQL is not installed (scripts/install-deps installs postgresql)");
    }
    let up = Up::start(4);
    // postgres runs unprivileged: it must be able to reach its data directory on the mount.
    std::fs::set_permissions(up.dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    up.ok(&["volume", "create", "db", "--size", "256M"]);
    let (spec, port) = write_spec(up.dir.path(), &Opts { postgres: true, ..Opts::default() });
    let mut m = Monitor::start(&up, &spec);
    m.wait("primary_up", Duration::from_secs(180));
    let load = Load::start_with(port, 20_000, &["--postgres"]);
    std::thread::sleep(Duration::from_secs(4));
    m.inject("kill", 0);
    let p = m.wait("promoted", Duration::from_secs(120));
    assert_eq!(p["volume"], "db.fo-1");
    let v = load.finish();
    check_load(&v);
    assert!(v["gap_end_ms"].as_u64().unwrap() < v["duration_ms"].as_u64().unwrap(), "throughput never resumed: {v}");
    // Commits were acknowledged after the promotion too (the backup took writes).
    let after = v["verdict"]["acked"].as_u64().unwrap();
    assert!(after > 0, "{v}");
    assert_eq!(volumes(&up), vec!["db.fo-1".to_string()]);
}

/// MariaDB with the RocksDB engine (Debian's mariadb-server and mariadb-plugin-rocksdb,
/// unmodified): SIGKILL of the whole primary mid-load, speculative failover, every acknowledged
/// commit present and nothing never attempted.
#[test]
fn mariadb_rocksdb_unclean_crash_speculative_failover_keeps_every_commit() {
    if skip() {
        return;
    }
    assert!(std::path::Path::new("/usr/sbin/mariadbd").exists(), "MariaDB is not installed (scripts/install-deps installs mariadb-server)");
    let up = Up::start(4);
    std::fs::set_permissions(up.dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    up.ok(&["volume", "create", "db", "--size", "512M"]);
    let (spec, port) = write_spec(up.dir.path(), &Opts { mariadb: true, ..Opts::default() });
    let mut m = Monitor::start(&up, &spec);
    m.wait("primary_up", Duration::from_secs(240));
    let load = Load::start_with(port, 20_000, &["--mysql"]);
    std::thread::sleep(Duration::from_secs(4));
    m.inject("kill", 0);
    let p = m.wait("promoted", Duration::from_secs(180));
    assert_eq!(p["volume"], "db.fo-1");
    let v = load.finish();
    check_load(&v);
    assert!(v["gap_end_ms"].as_u64().unwrap() < v["duration_ms"].as_u64().unwrap(), "throughput never resumed: {v}");
    assert_eq!(volumes(&up), vec!["db.fo-1".to_string()]);
}
