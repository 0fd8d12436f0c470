//! The failover monitor with a standby on a real 3-member etcd (issue 24, items 2 and 5): two
//! `failover run --store etcd://...` monitors of one application and a `failover endpoint`
//! process that follows the primary they publish, all real processes; the application is the
//! SQLite front on an ext4 volume, in its own network namespace, under the load generator
//! through the endpoint.
//!
//! * SIGKILL of the leading monitor: the standby leads within 2x the election TTL (the time is
//!   printed as `takeover_vs_lease_ttl.failover_monitor`), the endpoint keeps serving meanwhile,
//!   the new leader serves the next promotion (the primary SIGKILLed, the backup promoted on a
//!   super child), and every acknowledged commit is there.
//! * The leading monitor killed in the middle of a failover (the backup recovering): the new
//!   leader resumes it from the stored phase and it ends with exactly one of primary and backup
//!   (one promotion, one volume left), every acknowledged commit there.
//! * A leading monitor paused (SIGSTOP) past its lease, then resumed: the standby has taken
//!   over; the resumed one exits as deposed, and every key it could write still carries the new
//!   leader's fencing token.
//!
//! Needs root, /dev/fuse, losetup, mkfs.ext4, python3, iproute2 and etcd; set
//! UNDERSTUDY_SKIP_FUSE_TESTS=1 on a machine without them.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// The monitors' election lease (etcd's minimum with its default timings).
const ELECTION_TTL_MS: u64 = 2000;
/// How long anything may take at most on a loaded machine (attach, mkfs, a promotion).
const WAIT: Duration = Duration::from_secs(40);
/// Commits that show the load flows.
const FLOWING_COMMITS: usize = 20;

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
    wire::ports::free_loopback_port().unwrap()
}

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim().to_string()
}

/// The cluster, etcd, the volume and the spec of one test.
struct Bed {
    up: Up,
    etcd: testbed::etcd::EtcdCluster,
    dir: PathBuf,
    spec: PathBuf,
    vol: String,
}

impl Bed {
    fn new(vol: &str) -> Bed {
        Bed::with_backup_delay(vol, 0)
    }

    /// Every instance but the first sleeps `backup_delay_s` before it starts the application
    /// (a failover that lasts long enough to kill its monitor in the middle).
    fn with_backup_delay(vol: &str, backup_delay_s: u64) -> Bed {
        let etcd = testbed::etcd::EtcdCluster::start(3).expect("etcd starts");
        let up = Up::start(3);
        up.ok(&["volume", "create", vol, "--size", "128M"]);
        let dir = up.dir.path().join(format!("case-{vol}"));
        std::fs::create_dir_all(&dir).unwrap();
        let spec = serde_json::json!({
            "volume": vol,
            "state_dir": dir.join("failover"),
            "mkfs": true,
            "app": { "command": ["sh", "-c", format!("[ \"$UNDERSTUDY_INSTANCE\" = i1 ] || sleep {backup_delay_s}; exec \"$0\" failover sqlite-front --db \"$UNDERSTUDY_MOUNT/app.db\" --port \"$UNDERSTUDY_PORT\""), BIN], "stop_grace_ms": 5000 },
            "health": { "send": "PING", "expect": "PONG", "timeout_ms": 1000 },
            // Not bound on the store: the endpoint is `failover endpoint`.
            "endpoint": { "listen": format!("127.0.0.1:{}", free_port()) },
            "monitor": { "policy": "speculative", "ping_interval_ms": 250, "reds_timeout_ms": 30000, "healthy_timeout_ms": 60000, "max_backup_starts": 2 },
            "network": { "namespaces": "on" },
        });
        let path = dir.join("spec.json");
        std::fs::write(&path, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
        Bed { up, etcd, dir, spec: path, vol: vol.into() }
    }

    /// This test's volumes (the spec's and its children).
    fn volumes(&self) -> Vec<String> {
        let v: Value = serde_json::from_str(&self.up.ok(&["volume", "list", "--json"])).unwrap();
        let mine = |n: &&str| *n == self.vol || n.starts_with(&format!("{}.", self.vol));
        v.as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap()).filter(mine).map(str::to_string).collect()
    }

    fn secret(&self) -> Vec<u8> {
        testbed::cluster_file::read_secret(&self.up.secret_file()).unwrap()
    }

    /// `failover run SPEC --store etcd://...` as `name`, events from its stdout.
    fn monitor(&self, name: &str) -> Monitor {
        let control = format!("127.0.0.1:{}", free_port());
        let stderr = self.dir.join(format!("monitor-{name}.err"));
        let mut child = Command::new(BIN)
            .args(["failover", "run"])
            .arg(&self.spec)
            .args(["--control", &control, "--store", &self.etcd.url(), "--election-ttl-ms", &ELECTION_TTL_MS.to_string(), "--advertise", name, "--cluster"])
            .arg(self.up.cluster_file())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(std::fs::File::create(&stderr).unwrap()))
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, rx) = channel();
        let tag = name.to_string();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                eprintln!("monitor {tag}: {line}");
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    if tx.send(v).is_err() {
                        return;
                    }
                }
            }
        });
        let pid = child.id();
        let guard = testbed::failover::MonitorGuard::new(child, &self.dir.join("failover"), &self.up.cluster_file());
        Monitor { guard: Some(guard), pid, events: rx, control: control.parse().unwrap(), stderr, name: name.into() }
    }

    /// `failover endpoint` for this application on a free port.
    fn endpoint(&self) -> (Killed, u16) {
        let port = free_port();
        let log = std::fs::File::create(self.dir.join("endpoint.log")).unwrap();
        let child = Command::new(BIN)
            .args(["failover", "endpoint", "--store", &self.etcd.url(), "--name", &self.vol, "--listen", &format!("127.0.0.1:{port}"), "--cluster"])
            .arg(self.up.cluster_file())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        (Killed(child), port)
    }

    /// The application's key of `kind` on the store (its JSON).
    fn key(&self, kind: &str) -> Value {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let id = control::daemon::cluster_id_from_secret("failover", &self.secret());
            let s = control::Store::open(&self.etcd.url(), "failover", &id).await.unwrap();
            let kv = s.get(&s.key("failover", kind, &self.vol)).await.unwrap().unwrap_or_else(|| panic!("no {kind} key"));
            serde_json::from_slice(&kv.value).unwrap()
        })
    }
}

/// A child killed (SIGKILL) and reaped when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Monitor {
    /// Stops it (SIGTERM: it stops its instances if it leads), then removes what is left.
    guard: Option<testbed::failover::MonitorGuard>,
    pid: u32,
    events: Receiver<Value>,
    control: std::net::SocketAddr,
    stderr: PathBuf,
    name: String,
}

impl Drop for Monitor {
    fn drop(&mut self) {
        // A test that failed with this monitor paused: it must run to obey the guard's SIGTERM.
        testbed::proc::signal(self.pid, libc::SIGCONT);
    }
}

impl Monitor {
    fn wait(&self, event: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(v) if v["event"] == event => return v,
                Ok(v) => assert_ne!(v["event"], "gave_up", "monitor {} gave up: {v}", self.name),
                Err(e) => panic!("monitor {}: no {event} within {timeout:?} ({e}); stderr:\n{}", self.name, std::fs::read_to_string(&self.stderr).unwrap_or_default()),
            }
        }
    }

    fn request(&self, secret: &[u8], line: &str) -> String {
        testbed::failover::control_request(self.control, secret, line).unwrap_or_else(|e| panic!("monitor {} {line}: {e}", self.name))
    }

    fn wait_settled(&self, secret: &[u8]) -> Value {
        let deadline = Instant::now() + WAIT;
        loop {
            let s: Value = serde_json::from_str(&self.request(secret, "status")).unwrap();
            if s["settled"] == true {
                return s;
            }
            assert!(Instant::now() < deadline, "monitor {} did not settle within {WAIT:?}: {s}", self.name);
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The load generator through the endpoint, its acknowledged commits counted as it goes.
struct Load {
    child: Option<Child>,
    acked: Arc<Mutex<usize>>,
}

impl Load {
    fn start(port: u16) -> Load {
        let mut c = Command::new(BIN)
            .args(["failover", "load", "--endpoint", &format!("127.0.0.1:{port}"), "--duration-ms", "600000", "--progress-ms", "50"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let acked = Arc::new(Mutex::new(0));
        let (err, a) = (c.stderr.take().unwrap(), acked.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                match serde_json::from_str::<Value>(&line) {
                    Ok(v) if v["acked"].is_u64() => *a.lock().unwrap() = v["acked"].as_u64().unwrap() as usize,
                    _ => eprintln!("load: {line}"),
                }
            }
        });
        Load { child: Some(c), acked }
    }

    fn acked(&self) -> usize {
        *self.acked.lock().unwrap()
    }

    fn wait_acked(&self, n: usize, what: &str) {
        let deadline = Instant::now() + WAIT;
        while self.acked() < n {
            assert!(Instant::now() < deadline, "{what}: {} of {n} commits acknowledged within {WAIT:?}", self.acked());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the load (SIGTERM); it checks the table through the endpoint; returns its verdict.
    fn finish(mut self) -> Value {
        let mut c = self.child.take().unwrap();
        testbed::proc::signal(c.id(), libc::SIGTERM);
        let mut out = c.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        });
        let deadline = Instant::now() + WAIT;
        let status = loop {
            if let Some(s) = c.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                panic!("the load did not finish its check within {WAIT:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let stdout = reader.join().unwrap();
        let v: Value = serde_json::from_str(stdout.lines().last().unwrap_or("null")).unwrap_or_else(|_| panic!("load printed no JSON: {stdout}"));
        assert!(status.success(), "the load check failed: {v}");
        assert_eq!(v["ok"], true, "{v}");
        assert!(v["verdict"]["missing"].as_array().unwrap().is_empty(), "acknowledged commits lost: {v}");
        assert!(v["verdict"]["unexpected"].as_array().unwrap().is_empty(), "rows never attempted: {v}");
        v
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// SIGKILL of the leading monitor under load: the standby leads within 2x the TTL, the
/// endpoint serves throughout, the next promotion is served by the new leader, no acknowledged
/// commit is lost.
#[test]
fn sigkill_of_the_leading_monitor_the_standby_takes_over_and_serves_the_next_promotion() {
    if skip() {
        return;
    }
    let bed = Bed::new("sbkill");
    let secret = bed.secret();
    let (_endpoint, port) = bed.endpoint();
    // Declared first, dropped last: the leader (b in the end) stops the instances first.
    let mut a = bed.monitor("a");
    a.wait("leading", WAIT);
    a.wait("primary_up", WAIT);
    let b = bed.monitor("b");
    b.wait("standing", WAIT);
    let load = Load::start(port);
    load.wait_acked(FLOWING_COMMITS, "before the monitor's death");

    let acked_at_kill = load.acked();
    let killed_at = now_unix_ms();
    testbed::proc::signal(a.pid, libc::SIGKILL);
    let lead = b.wait("leading", WAIT);
    let takeover_ms = lead["unix_ms"].as_u64().unwrap().saturating_sub(killed_at);
    let acked_at_takeover = load.acked();
    b.wait("ready", WAIT);
    eprintln!(
        "{}",
        serde_json::json!({
            "figure": "takeover_vs_lease_ttl.failover_monitor",
            "takeover_ms": takeover_ms, "ttl_ms": ELECTION_TTL_MS,
            "ratio": takeover_ms as f64 / ELECTION_TTL_MS as f64, "loadavg": loadavg(),
        })
    );
    assert!(takeover_ms <= 2 * ELECTION_TTL_MS, "the standby took {takeover_ms} ms to lead, over 2x the TTL of {ELECTION_TTL_MS} ms");
    assert!(
        acked_at_takeover >= acked_at_kill + FLOWING_COMMITS,
        "the endpoint did not keep serving while no monitor led: {acked_at_kill} commits at the kill, {acked_at_takeover} at the takeover"
    );
    // The new leader resumed the primary, without a failover.
    let s = b.wait_settled(&secret);
    assert_eq!(s["state"]["primary"], 1, "{s}");
    assert_eq!(s["state"]["failovers"], 0, "{s}");

    // The next failure is the new leader's: a promotion on a super child.
    load.wait_acked(load.acked() + FLOWING_COMMITS, "before the primary's death");
    b.request(&secret, "kill 0");
    let promoted = b.wait("promoted", WAIT);
    assert_eq!(promoted["volume"], format!("{}.fo-1", bed.vol), "{promoted}");
    load.wait_acked(load.acked() + FLOWING_COMMITS, "after the promotion");
    let primary = bed.key("primary");
    assert_eq!(primary["instance"], promoted["instance"], "the endpoint record names the promoted backup: {primary}");
    assert_eq!(primary["writer"], lead["fencing_token"], "written by the new leader: {primary}");
    load.finish();
    b.wait_settled(&secret);
    drop(b);
    drop(a.guard.take());
}

/// The leader killed while the backup recovers on the super child: the standby resumes the
/// failover from the stored phase; it ends with one promotion and one volume, nothing lost.
#[test]
fn the_leader_killed_mid_failover_the_standby_ends_it_with_one_primary() {
    if skip() {
        return;
    }
    let bed = Bed::with_backup_delay("sbmid", 3);
    let secret = bed.secret();
    let (_endpoint, port) = bed.endpoint();
    let mut a = bed.monitor("a");
    a.wait("leading", WAIT);
    a.wait("primary_up", WAIT);
    let b = bed.monitor("b");
    b.wait("standing", WAIT);
    let load = Load::start(port);
    load.wait_acked(FLOWING_COMMITS, "before the primary's death");
    a.request(&secret, "kill 0");
    a.wait("backup_started", WAIT);
    testbed::proc::signal(a.pid, libc::SIGKILL);
    let lead = b.wait("leading", WAIT);
    assert!(lead["phase"].as_str().unwrap_or_default().starts_with("Recovering"), "the standby found the failover in flight: {lead}");
    let promoted = b.wait("promoted", WAIT);
    let child = format!("{}.fo-1", bed.vol);
    assert_eq!(promoted["volume"], child, "{promoted}");
    load.wait_acked(load.acked() + FLOWING_COMMITS, "after the resumed failover");
    load.finish();
    let s = b.wait_settled(&secret);
    assert_eq!(s["state"]["failovers"], 1, "one promotion: {s}");
    assert_eq!(s["state"]["primary"], promoted["instance"], "{s}");
    assert_eq!(bed.volumes(), vec![child], "exactly one of primary and backup is left");
    assert_eq!(bed.key("primary")["instance"], promoted["instance"]);
    drop(b);
    drop(a.guard.take());
}

/// A leading monitor paused past its lease and resumed cannot write: the standby has taken
/// over, the resumed one exits as deposed, and the state and endpoint records carry the new
/// leader's token.
#[test]
fn a_paused_leader_that_resumes_cannot_write_and_steps_down() {
    if skip() {
        return;
    }
    let bed = Bed::new("sbpause");
    let secret = bed.secret();
    let (_endpoint, port) = bed.endpoint();
    let mut a = bed.monitor("a");
    let a_lead = a.wait("leading", WAIT);
    a.wait("primary_up", WAIT);
    let b = bed.monitor("b");
    b.wait("standing", WAIT);
    let load = Load::start(port);
    load.wait_acked(FLOWING_COMMITS, "before the pause");

    assert!(testbed::proc::pause(a.pid, Duration::from_secs(10)), "monitor a did not stop");
    let b_lead = b.wait("leading", WAIT);
    b.wait("ready", WAIT);
    assert!(b_lead["fencing_token"].as_i64() > a_lead["fencing_token"].as_i64(), "{a_lead} {b_lead}");
    b.wait_settled(&secret);
    let before = (bed.key("state"), bed.key("primary"));
    assert_eq!(before.0["writer"], b_lead["fencing_token"], "{}", before.0);
    testbed::proc::signal(a.pid, libc::SIGCONT);

    // Resumed, a finds it was deposed and exits (status 3) leaving the instances to b.
    let deadline = Instant::now() + WAIT;
    while testbed::proc::alive(a.pid) {
        assert!(Instant::now() < deadline, "the resumed monitor did not step down within {WAIT:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let err = std::fs::read_to_string(&a.stderr).unwrap();
    assert!(err.contains("no longer the leader"), "monitor a's stderr:\n{err}");
    let after = (bed.key("state"), bed.key("primary"));
    assert_eq!(after.0["writer"], b_lead["fencing_token"], "{}", after.0);
    assert_eq!(after.1["writer"], b_lead["fencing_token"], "{}", after.1);
    // b still leads and serves: commits flow, the primary unchanged.
    load.wait_acked(load.acked() + FLOWING_COMMITS, "after the resumed monitor stepped down");
    let s = b.wait_settled(&secret);
    assert_eq!(s["state"]["primary"], 1, "{s}");
    load.finish();
    drop(b);
    drop(a.guard.take());
}
