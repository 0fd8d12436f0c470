//! Redis (appendonly yes, appendfsync always) under the nearlog LD_PRELOAD shim: loaded with
//! SETs through the project's blocking RESP client, killed with SIGKILL mid-load, restarted against an empty
//! local directory into which only the bulk files (manifest, base RDB) are copied back from
//! "storage"; every acknowledged SET must be there. And Redis's own forks under the shim
//! (BGREWRITEAOF, BGSAVE) while clients write: every one completes, and afterwards every
//! acknowledged SET survives a restart. Needs redis-server.

mod nearlog_common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nearlog_common::{free_port, shim_path, start_cluster, Kill};
use ycsb::redis::{BlockingClient, Reply};

/// Redis's replies as the text this test compares, over the project's one blocking RESP client
/// (`ycsb::redis::BlockingClient`).
struct Resp(BlockingClient);

impl Resp {
    fn connect(port: u16) -> Resp {
        Resp(BlockingClient::connect(("127.0.0.1", port), Duration::from_secs(30)).unwrap_or_else(|e| panic!("redis not reachable: {e}")))
    }
    fn send(&mut self, args: &[&str]) {
        let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        self.0.send(&args).unwrap();
    }
    /// A bulk-string reply (None: nil).
    fn bulk(&mut self) -> Option<String> {
        match self.0.reply().unwrap() {
            Reply::Bulk(b) => b.map(|v| String::from_utf8(v).unwrap()),
            other => panic!("not a bulk string: {other:?}"),
        }
    }
    fn mget(&mut self, keys: &[String]) -> Vec<Option<String>> {
        let args: Vec<&str> = std::iter::once("MGET").chain(keys.iter().map(|k| k.as_str())).collect();
        self.send(&args);
        match self.0.reply().unwrap() {
            Reply::Array(Some(items)) => items
                .into_iter()
                .map(|i| match i {
                    Reply::Bulk(b) => b.map(|v| String::from_utf8(v).unwrap()),
                    other => panic!("not a bulk string: {other:?}"),
                })
                .collect(),
            other => panic!("not an array: {other:?}"),
        }
    }
    /// A reply as redis-cli's raw text: `+OK`, `-ERR …`, `:1`, a bulk string's value, `(nil)`.
    fn cmd(&mut self, args: &[&str]) -> String {
        self.send(args);
        match self.0.reply().unwrap() {
            Reply::Simple(s) => format!("+{s}"),
            Reply::Error(e) => format!("-{e}"),
            Reply::Integer(i) => format!(":{i}"),
            Reply::Bulk(Some(v)) => String::from_utf8_lossy(&v).into_owned(),
            Reply::Bulk(None) => "(nil)".into(),
            other => format!("{other:?}"),
        }
    }
}

fn redis(dir: &Path, port: u16, so: &Path, cluster: &Path) -> Kill {
    let mut c = Command::new("redis-server");
    c.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--dir"])
        .arg(dir)
        .args(["--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no", "--logfile", ""])
        .env("LD_PRELOAD", so)
        .env("UNDERSTUDY_NEARLOG_CLUSTER", cluster)
        .env("UNDERSTUDY_NEARLOG_PATTERNS", "*.incr.aof")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    Kill(c.spawn().unwrap())
}

/// Redis in its own process group, killed whole (with any child it forked) on drop: a rewrite
/// child hung in the shim must not outlive the test.
struct Group(std::process::Child);
impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: signals the process group this test made for redis.
        unsafe { libc::kill(-(self.0.id() as i32), libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

fn redis_group(dir: &Path, port: u16, so: &Path, cluster: &Path) -> Group {
    let mut c = Command::new("redis-server");
    c.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--dir"])
        .arg(dir)
        // hz 50: a finished child is reaped within 20 ms (serverCron), not 100.
        .args(["--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no", "--logfile", "", "--hz", "50"])
        .env("LD_PRELOAD", so)
        .env("UNDERSTUDY_NEARLOG_CLUSTER", cluster)
        .env("UNDERSTUDY_NEARLOG_PATTERNS", "*.incr.aof")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    std::os::unix::process::CommandExt::process_group(&mut c, 0);
    Group(c.spawn().unwrap())
}

/// INFO persistence as field -> value.
fn persistence(c: &mut Resp) -> std::collections::HashMap<String, String> {
    c.send(&["INFO", "persistence"]);
    let text = c.bulk().unwrap();
    text.lines().filter_map(|l| l.split_once(':')).map(|(k, v)| (k.to_string(), v.trim().to_string())).collect()
}

/// Longest one BGREWRITEAOF or BGSAVE of this small data set may take under the shim on a
/// loaded 2-core machine (each takes well under a second; the deadlock was forever).
const BACKGROUND_OP_BOUND: Duration = Duration::from_secs(20);

/// Starts `cmd` (BGREWRITEAOF or BGSAVE) and waits until Redis has reaped its child: the
/// `count` field has reached `want`, nothing is in progress, and the last status is ok.
fn background_op(c: &mut Resp, cmd: &str, count: &str, in_progress: &str, status: &str, want: u64) {
    let rep = c.cmd(&[cmd]);
    assert!(rep.starts_with('+'), "{cmd} #{want}: {rep}");
    let start = Instant::now();
    loop {
        let p = persistence(c);
        let done = p[count].parse::<u64>().unwrap() >= want && p[in_progress] == "0";
        if done {
            assert_eq!(p[status], "ok", "{cmd} #{want} failed: {p:?}");
            return;
        }
        assert!(start.elapsed() < BACKGROUND_OP_BOUND, "{cmd} #{want} did not finish within {BACKGROUND_OP_BOUND:?} (its child hangs?): {p:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn redis_bgrewriteaof_and_bgsave_under_load_complete_and_lose_nothing() {
    let so = shim_path();
    let tmp = tempfile::tempdir().unwrap();
    let (_cluster, cluster_file) = start_cluster(&tmp.path().join("cluster"));
    let app = tmp.path().join("app");
    std::fs::create_dir_all(&app).unwrap();
    let port = free_port();
    let server = redis_group(&app, port, &so, &cluster_file);
    let mut admin = Resp::connect(port);
    // Four writers, each on its own connection, each counting its acknowledged SETs.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut c = Resp::connect(port);
                let mut acked = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let i = acked + 1;
                    let rep = c.cmd(&["SET", &format!("w{w}:{i}"), &format!("v{i}-{}", "x".repeat((i % 50) as usize))]);
                    assert_eq!(rep, "+OK", "writer {w}: SET {i}");
                    acked = i;
                }
                acked
            })
        })
        .collect();
    let start = Instant::now();
    for k in 1..=20 {
        background_op(&mut admin, "BGREWRITEAOF", "aof_rewrites", "aof_rewrite_in_progress", "aof_last_bgrewrite_status", k);
        background_op(&mut admin, "BGSAVE", "rdb_saves", "rdb_bgsave_in_progress", "rdb_last_bgsave_status", k);
    }
    let took = start.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let acked: Vec<u64> = writers.into_iter().map(|h| h.join().unwrap()).collect();
    eprintln!("20 BGREWRITEAOF + 20 BGSAVE under the shim in {took:?}; SETs acknowledged meanwhile: {acked:?}");
    assert!(acked.iter().all(|&n| n > 0), "every writer made progress: {acked:?}");

    // Whatever the rewrites left (manifest, base, the current incr file) holds every
    // acknowledged SET: Redis killed and restarted on the same directory.
    drop(admin);
    drop(server);
    let _server = redis_group(&app, port, &so, &cluster_file);
    let mut c = Resp::connect(port);
    let start = Instant::now();
    while c.cmd(&["PING"]).starts_with("-LOADING") && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
    }
    for (w, &n) in acked.iter().enumerate() {
        let keys: Vec<String> = (1..=n).map(|i| format!("w{w}:{i}")).collect();
        for (batch_no, batch) in keys.chunks(500).enumerate() {
            for (j, v) in c.mget(batch).into_iter().enumerate() {
                let i = (batch_no * 500 + j + 1) as u64;
                assert_eq!(v, Some(format!("v{i}-{}", "x".repeat((i % 50) as usize))), "acknowledged SET w{w}:{i} lost ({n} acknowledged)");
            }
        }
    }
}

fn copy_bulk(from: &Path, to: &Path) {
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().to_string();
        let target = to.join(&name);
        if e.file_type().unwrap().is_dir() {
            std::fs::create_dir_all(&target).unwrap();
            copy_bulk(&e.path(), &target);
        } else if !name.ends_with(".incr.aof") {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}

#[test]
fn redis_aof_always_survives_sigkill_and_an_empty_local_directory() {
    let so = shim_path();
    let tmp = tempfile::tempdir().unwrap();
    let (_cluster, cluster_file) = start_cluster(&tmp.path().join("cluster"));
    let app = tmp.path().join("app");
    std::fs::create_dir_all(&app).unwrap();
    let port = free_port();
    let mut server = redis(&app, port, &so, &cluster_file);
    let mut c = Resp::connect(port);
    let mut acked = 0u64;
    let start = Instant::now();
    while acked < 2000 && start.elapsed() < Duration::from_secs(60) {
        let i = acked + 1;
        if c.cmd(&["SET", &format!("k{i}"), &format!("v{i}")]) != "+OK" {
            break;
        }
        acked = i;
    }
    // SIGKILL mid-load: one more SET in flight.
    c.send(&["SET", "lastx", "1"]);
    unsafe { libc::kill(server.0.id() as i32, libc::SIGKILL) };
    let _ = server.0.wait();
    drop(server);
    assert!(acked >= 2000, "only {acked} SETs acknowledged");

    let old = tmp.path().join("old-app");
    std::fs::rename(&app, &old).unwrap();
    std::fs::create_dir_all(&app).unwrap();
    copy_bulk(&old, &app);

    let _server = redis(&app, port, &so, &cluster_file);
    let mut c = Resp::connect(port);
    let start = Instant::now();
    while c.cmd(&["PING"]).starts_with("-LOADING") && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
    }
    for i in 1..=acked {
        assert_eq!(c.cmd(&["GET", &format!("k{i}")]), format!("v{i}"), "acknowledged SET k{i} lost ({acked} acknowledged)");
    }
}
