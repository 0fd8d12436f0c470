//! `understudy up` supervises its daemons (issue 24 item 4): the metadata service killed with
//! SIGKILL while a client writes through NBD is restarted on its state file, the writer never
//! sees an error and every acknowledged block reads back; while the metadata service does not
//! answer at all, I/O on an open volume goes on (the client and the shards need it only for
//! opens and decisions); a daemon that keeps failing is given up on, reported, and only then
//! does `up` exit non-zero.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{qemu_ok, require_qemu, QemuSession, Up, BIN};
use testbed::proc::{alive, pause, signal};

/// Block size of the verifying writer.
const BLOCK: u64 = 64 * 1024;

/// Pattern byte of block `i` (never 0: a block never written reads as zeros).
fn pattern(i: u64) -> u64 {
    i % 250 + 1
}

/// Writes block `i` with its pattern through the open session; panics on a failed write.
fn write_block(s: &mut QemuSession, i: u64) {
    let (ok, text) = s.cmd(&format!("write -P {} {} {BLOCK}", pattern(i), i * BLOCK));
    assert!(ok, "write of block {i} failed: {text}");
}

/// Every block of `0..n` reads back with its pattern, through a new NBD connection (a new open,
/// through the metadata service).
fn verify_blocks(up: &Up, volume: &str, n: u64) {
    let cmds: Vec<String> = (0..n).map(|i| format!("read -P {} {} {BLOCK}", pattern(i), i * BLOCK)).collect();
    let refs: Vec<&str> = cmds.iter().map(String::as_str).collect();
    qemu_ok(&up.uri(volume), &refs);
}

/// The metadata service's pid in cluster.json, once it differs from `old` (up rewrites the
/// file when it restarts a daemon).
fn wait_new_meta_pid(up: &Up, old: u32, timeout: Duration) -> u32 {
    let deadline = Instant::now() + timeout;
    loop {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(up.cluster_file()).unwrap()).unwrap();
        let pid = v["meta"]["pid"].as_u64().unwrap() as u32;
        if pid != old && alive(pid) {
            return pid;
        }
        assert!(Instant::now() < deadline, "the metadata service was not restarted within {timeout:?}:\n{}", up.up_output());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until the metadata service answers `status`.
fn wait_meta_answers(up: &Up, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while !up.cli(&["status"]).status.success() {
        assert!(Instant::now() < deadline, "the metadata service does not answer within {timeout:?}:\n{}", up.up_output());
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn meta_killed_under_up_is_restarted_while_a_writer_keeps_writing() {
    require_qemu();
    let up = Up::start(3);
    up.ok(&["volume", "create", "vol", "--size", "64M"]);
    let mut s = QemuSession::open(&up.uri("vol"));
    for i in 0..10 {
        write_block(&mut s, i);
    }
    let meta = up.info["meta"]["pid"].as_u64().unwrap() as u32;
    assert!(signal(meta, libc::SIGKILL));
    // The writer goes on through the kill and the restart: no write fails.
    for i in 10..60 {
        write_block(&mut s, i);
    }
    let new_meta = wait_new_meta_pid(&up, meta, Duration::from_secs(30));
    wait_meta_answers(&up, Duration::from_secs(30));
    for i in 60..80 {
        write_block(&mut s, i);
    }
    drop(s);
    let out = up.up_output();
    assert!(out.contains("metadata service exited") && out.contains(&format!("restarted (pid {new_meta})")), "up reports the exit and the restart:\n{out}");
    // The restarted service recovered its state file: the volume is there, and decisions work.
    assert!(up.ok(&["volume", "list"]).lines().any(|l| l.starts_with("vol ")), "the volume survived the restart");
    verify_blocks(&up, "vol", 80);
    up.ok(&["volume", "create", "vol2", "--size", "16M"]);
    let child = up.ok(&["volume", "super", "vol"]).trim().to_string();
    assert_eq!(up.ok(&["volume", "collapse", &child]).trim(), "promoted");
    // Promoted: the child is the volume now, with every block.
    verify_blocks(&up, &child, 80);
}

/// The metadata service stopped (SIGSTOP: alive, so not restarted, but answering nothing) for
/// several seconds: an open volume's reads and writes go on without it.
#[test]
fn io_on_an_open_volume_goes_on_while_meta_does_not_answer() {
    require_qemu();
    let up = Up::start(3);
    up.ok(&["volume", "create", "vol", "--size", "64M"]);
    let mut s = QemuSession::open(&up.uri("vol"));
    for i in 0..5 {
        write_block(&mut s, i);
    }
    let meta = up.info["meta"]["pid"].as_u64().unwrap() as u32;
    assert!(pause(meta, Duration::from_secs(10)), "cannot stop the metadata service");
    // A guard: the service resumes after OUTAGE_MAX even if the I/O below hangs, so a failure
    // is an assertion, not a hung test.
    const OUTAGE_MAX: Duration = Duration::from_secs(40);
    let resume = std::thread::spawn(move || {
        std::thread::sleep(OUTAGE_MAX);
        signal(meta, libc::SIGCONT);
    });
    let t = Instant::now();
    // At least 5 s without the service, writing and reading all along.
    let mut i = 5;
    while t.elapsed() < Duration::from_secs(5) || i < 40 {
        write_block(&mut s, i);
        let (ok, text) = s.cmd(&format!("read -P {} {} {BLOCK}", pattern(i - 3), (i - 3) * BLOCK));
        assert!(ok, "read of block {} failed: {text}", i - 3);
        i += 1;
    }
    let outage = t.elapsed();
    let status = up.cli(&["status"]);
    signal(meta, libc::SIGCONT);
    assert!(outage < OUTAGE_MAX, "the I/O went on only after the metadata service resumed ({outage:?})");
    assert!(!status.status.success(), "the metadata service answered while stopped: the test did not test an outage");
    eprintln!("{i} blocks written in {outage:?} with the metadata service stopped");
    wait_meta_answers(&up, Duration::from_secs(30));
    drop(s);
    verify_blocks(&up, "vol", i);
    let child = up.ok(&["volume", "super", "vol"]).trim().to_string();
    assert_eq!(up.ok(&["volume", "collapse", &child]).trim(), "promoted");
    verify_blocks(&up, &child, i);
    drop(resume);
}

/// A metadata service that cannot start again (its state file is garbage) is restarted with a
/// growing backoff, then given up on: `up` says which daemon, how often it failed and why, stops
/// the cluster and exits non-zero.
#[test]
fn a_daemon_that_keeps_failing_is_reported_and_up_exits_non_zero() {
    let dir = tempfile::Builder::new().prefix("understudy-test-").tempdir().unwrap();
    let out = std::fs::File::create(dir.path().join("up.out")).unwrap();
    let mut child = Command::new(BIN)
        .args(["up", "--dir"])
        .arg(dir.path())
        .args(["--port-base", "0", "--shards", "1", "--replicas", "1"])
        .stdin(Stdio::null())
        .stdout(Stdio::from(out.try_clone().unwrap()))
        .stderr(Stdio::from(out))
        .spawn()
        .unwrap();
    let guard = scopeguard(child.id());
    let cluster = dir.path().join("cluster.json");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !cluster.exists() {
        assert!(child.try_wait().unwrap().is_none(), "up exited: {}", std::fs::read_to_string(dir.path().join("up.out")).unwrap());
        assert!(Instant::now() < deadline, "up did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    let info: serde_json::Value = serde_json::from_slice(&std::fs::read(&cluster).unwrap()).unwrap();
    std::fs::write(dir.path().join("meta/meta.json"), b"not json").unwrap();
    assert!(signal(info["meta"]["pid"].as_u64().unwrap() as u32, libc::SIGKILL));
    // 250 ms + 0.5 + 1 + 2 + 4 s of backoff and six failed starts.
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "up still runs 60 s after its metadata service began failing");
        std::thread::sleep(Duration::from_millis(100));
    };
    let said = std::fs::read_to_string(dir.path().join("up.out")).unwrap();
    assert!(!status.success(), "up exited successfully: {said}");
    assert!(said.contains("metadata service keeps failing") && said.contains("6 exits within 60 s"), "{said}");
    assert!(said.contains("meta.json"), "the report names the cause from the daemon's log: {said}");
    for s in info["shards"].as_array().unwrap().iter().chain([&info["nbd"]]) {
        let pid = s["pid"].as_u64().unwrap() as u32;
        assert!(testbed::proc::wait_gone(&[pid], Duration::from_secs(30)), "{s} still runs after up gave up");
    }
    drop(guard);
}

/// Kills `understudy up` (and so, by their parent-death signal, its children) if the test fails
/// before it exits.
fn scopeguard(pid: u32) -> impl Drop {
    struct G(u32);
    impl Drop for G {
        fn drop(&mut self) {
            if alive(self.0) {
                signal(self.0, libc::SIGTERM);
                testbed::proc::wait_gone(&[self.0], Duration::from_secs(20));
                signal(self.0, libc::SIGKILL);
            }
        }
    }
    G(pid)
}

/// A shard SIGKILLed under a writer is started again by `up` on its data directory within
/// moments (before or after the metadata service marks it down), comes back up, and every
/// acknowledged block reads back, also with the other replicas of its slots gone.
#[test]
fn a_killed_shard_is_restarted_by_up_and_comes_back_up() {
    require_qemu();
    let up = Up::start(3);
    up.ok(&["volume", "create", "vol", "--size", "64M"]);
    let mut s = QemuSession::open(&up.uri("vol"));
    for i in 0..10 {
        write_block(&mut s, i);
    }
    let victim = up.shard_pid(2);
    assert!(signal(victim, libc::SIGKILL));
    for i in 10..40 {
        write_block(&mut s, i);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let new_pid = loop {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(up.cluster_file()).unwrap()).unwrap();
        let pid = v["shards"].as_array().unwrap().iter().find(|s| s["id"] == 2).unwrap()["pid"].as_u64().unwrap() as u32;
        if pid != victim && alive(pid) {
            break pid;
        }
        assert!(Instant::now() < deadline, "shard 2 was not restarted:\n{}", up.up_output());
        std::thread::sleep(Duration::from_millis(50));
    };
    up.wait_shard(2, "Up", Duration::from_secs(60));
    for i in 40..50 {
        write_block(&mut s, i);
    }
    drop(s);
    assert!(up.up_output().contains(&format!("shard 2 restarted (pid {new_pid})")), "{}", up.up_output());
    // 3 shards, 3 replicas: shard 2 holds every slot. With the other two stopped (SIGSTOP: `up`
    // does not restart a live process) and marked down, every block is read from shard 2 alone,
    // so it caught up on what it missed while dead.
    for id in [1, 3] {
        assert!(pause(up.shard_pid(id), Duration::from_secs(10)));
    }
    let resume = || {
        for id in [1, 3] {
            signal(up.shard_pid(id), libc::SIGCONT);
        }
    };
    for id in [1, 3] {
        up.wait_shard(id, "Down", Duration::from_secs(60));
    }
    let cmds: Vec<String> = (0..50).map(|i| format!("read -P {} {} {BLOCK}", pattern(i), i * BLOCK)).collect();
    let refs: Vec<&str> = cmds.iter().map(String::as_str).collect();
    let (ok, text) = common::qemu_io(&up.uri("vol"), &refs);
    resume();
    assert!(ok, "reading every block from the restarted shard alone:\n{text}");
}

/// The NBD server SIGKILLed: `up` starts it again at its TCP address and its Unix socket (the
/// dead one's socket file does not stand in the way), and both serve the volume with what was
/// written before.
#[test]
fn a_killed_nbd_server_is_restarted_on_its_address_and_socket() {
    require_qemu();
    let up = Up::start(3);
    up.ok(&["volume", "create", "vol", "--size", "16M"]);
    qemu_ok(&up.uri("vol"), &["write -P 0x42 0 256k"]);
    let old = up.info["nbd"]["pid"].as_u64().unwrap() as u32;
    assert!(signal(old, libc::SIGKILL));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(up.cluster_file()).unwrap()).unwrap();
        let pid = v["nbd"]["pid"].as_u64().unwrap() as u32;
        if pid != old && alive(pid) {
            break;
        }
        assert!(Instant::now() < deadline, "the NBD server was not restarted:\n{}", up.up_output());
        std::thread::sleep(Duration::from_millis(50));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !common::qemu_io(&up.uri("vol"), &["read -P 0x42 0 256k"]).0 {
        assert!(Instant::now() < deadline, "the restarted NBD server does not serve over TCP:\n{}", up.up_output());
        std::thread::sleep(Duration::from_millis(100));
    }
    let sock = up.info["nbd"]["unix_socket"].as_str().unwrap();
    qemu_ok(&format!("nbd+unix:///vol?socket={sock}"), &["read -P 0x42 0 256k", "write -P 0x43 256k 64k", "read -P 0x43 256k 64k"]);
}
