//! `understudy nearlog up` runs the controller and each log peer as its own process and
//! restarts one that exits (issue 24 item 4): a peer SIGKILLed under a running writer comes back
//! at its address under its old id (the controller lists the same 3 peers, not 4), the writer
//! goes on, and the peers hold every acknowledged byte; the controller SIGKILLed comes back on
//! its state file, with the same peers, and opens files again.

mod nearlog_common;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nearlog_common::{recover_through_shim, shim_path, Kill};
use testbed::proc::{alive, signal};

/// For each line `N` on stdin: appends N chunks of 1000 bytes (byte value = chunk index) with
/// os.write + fsync, then prints the file size.
const WRITER: &str = r#"
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
i = 0
for line in sys.stdin:
    for _ in range(int(line)):
        assert os.write(fd, bytes([i % 251]) * 1000) == 1000
        os.fsync(fd)
        i += 1
    print(os.fstat(fd).st_size, flush=True)
"#;

/// The shim's deadline here: far above a peer's restart, so a write waits for it rather than
/// failing.
const DEADLINE_MS: u64 = 30_000;

/// `nearlog up` on `dir`, its stderr in `dir.up.log`; returns once it printed `ready`.
fn start(dir: &Path) -> Kill {
    let mut child = Command::new(env!("CARGO_BIN_EXE_understudy"))
        .args(["nearlog", "up", "--dir"])
        .arg(dir)
        .args(["--region-bytes", "67108864"])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.with_extension("up.log")).unwrap())
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
    guard
}

/// `DIR/pids`: daemon name -> pid.
fn pids(dir: &Path) -> Vec<(String, u32)> {
    std::fs::read_to_string(dir.join("pids"))
        .unwrap()
        .lines()
        .map(|l| {
            let (n, p) = l.split_once(' ').unwrap();
            (n.to_string(), p.trim().parse().unwrap())
        })
        .collect()
}

fn pid_of(dir: &Path, name: &str) -> u32 {
    pids(dir).into_iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no {name} in {}/pids", dir.display())).1
}

/// Waits until `name`'s pid in `DIR/pids` is a live process other than `old`.
fn wait_restarted(dir: &Path, name: &str, old: u32) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let p = pid_of(dir, name);
        if p != old && alive(p) {
            return p;
        }
        assert!(Instant::now() < deadline, "{name} was not restarted within 30 s: {}", up_log(dir));
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn up_log(dir: &Path) -> String {
    std::fs::read_to_string(dir.with_extension("up.log")).unwrap_or_default()
}

/// (id, addr) of every peer in the controller's state file.
fn controller_peers(dir: &Path) -> Vec<(u64, String)> {
    let st: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("nearlog-controller.json")).unwrap()).unwrap();
    st["peers"].as_object().unwrap().iter().map(|(id, p)| (id.parse().unwrap(), p["addr"].as_str().unwrap().to_string())).collect()
}

/// The parent pid of `pid`.
fn ppid(pid: u32) -> u32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    stat.rsplit_once(')').unwrap().1.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn nearlog_up_restarts_a_killed_peer_under_its_id_and_a_killed_controller_on_its_state() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cluster");
    let app = tmp.path().join("app");
    std::fs::create_dir_all(&app).unwrap();
    let up = start(&dir);
    let cluster = dir.join("nearlog-cluster.json");
    let env = |c: &mut Command| {
        c.env("LD_PRELOAD", shim_path())
            .env("UNDERSTUDY_NEARLOG_CLUSTER", &cluster)
            .env("UNDERSTUDY_NEARLOG_PATTERNS", "*.log")
            .env("UNDERSTUDY_NEARLOG_DEADLINE_MS", DEADLINE_MS.to_string());
    };

    // Four daemons, each its own process, children of `nearlog up`.
    let before_pids = pids(&dir);
    let names: Vec<&str> = before_pids.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["controller", "peer-0", "peer-1", "peer-2"]);
    for (n, p) in &before_pids {
        assert!(alive(*p) && *p != up.0.id() && ppid(*p) == up.0.id(), "{n} (pid {p}) is not a process of its own under nearlog up");
    }
    let peers_before = controller_peers(&dir);
    assert_eq!(peers_before.len(), 3, "{peers_before:?}");

    let log = app.join("w.log");
    let mut w = Command::new("python3");
    w.arg("-c").arg(WRITER).arg(&log).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
    env(&mut w);
    let mut child = Kill(w.spawn().unwrap());
    let mut stdin = child.0.stdin.take().unwrap();
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let mut step = |n: u32| -> u64 {
        writeln!(stdin, "{n}").unwrap();
        lines.next().expect("the writer died").unwrap().trim().parse().unwrap()
    };
    assert_eq!(step(20), 20_000);

    // A peer killed: restarted at its address under its id; the writer goes on.
    let peer = pid_of(&dir, "peer-1");
    assert!(signal(peer, libc::SIGKILL));
    let new_peer = wait_restarted(&dir, "peer-1", peer);
    assert_eq!(step(20), 40_000);
    assert_eq!(controller_peers(&dir), peers_before, "the restarted peer registered under its old id, at its address");

    // The controller killed: restarted on its state file; the same peers, and opens work.
    let ctl = pid_of(&dir, "controller");
    assert!(signal(ctl, libc::SIGKILL));
    let new_ctl = wait_restarted(&dir, "controller", ctl);
    assert_eq!(step(20), 60_000);
    drop(child);
    let mut w2 = Command::new("python3");
    w2.arg("-c").arg("import os, sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o644); os.write(fd, b'x' * 100); os.fsync(fd)").arg(app.join("new.log"));
    env(&mut w2);
    let out = w2.output().unwrap();
    assert!(out.status.success(), "a new log file after the controller's restart: {}", String::from_utf8_lossy(&out.stderr));
    let peers_after = controller_peers(&dir);
    assert_eq!(peers_after, peers_before, "the controller lists the same 3 peers after both restarts");

    let want: Vec<u8> = (0..60u8).flat_map(|i| vec![i; 1000]).collect();
    let got = recover_through_shim(&log, env);
    assert!(got == want, "the peers hold {} bytes, not the 60000 acknowledged", got.len());
    let said = up_log(&dir);
    for s in ["peer 1 exited", &format!("peer 1 restarted (pid {new_peer})"), "controller exited", &format!("controller restarted (pid {new_ctl})")] {
        assert!(said.contains(s), "nearlog up reports `{s}`:\n{said}");
    }
    drop(up);
    // Its children go with it (parent-death signal).
    let all: Vec<u32> = pids(&dir).into_iter().map(|(_, p)| p).collect();
    assert!(testbed::proc::wait_gone(&all, Duration::from_secs(20)), "daemons outlived nearlog up");
}

/// A controller that cannot start again (its state file is garbage) is restarted with a
/// growing backoff, then given up on: `nearlog up` names it and the cause, stops the peers and
/// exits non-zero.
#[test]
fn a_controller_that_keeps_failing_is_reported_and_nearlog_up_exits_non_zero() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cluster");
    let mut up = start(&dir);
    let peers: Vec<u32> = pids(&dir).into_iter().filter(|(n, _)| n.starts_with("peer-")).map(|(_, p)| p).collect();
    std::fs::write(dir.join("nearlog-controller.json"), b"not json").unwrap();
    assert!(signal(pid_of(&dir, "controller"), libc::SIGKILL));
    // 250 ms + 0.5 + 1 + 2 + 4 s of backoff and six failed starts.
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = up.0.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "nearlog up still runs 60 s after its controller began failing:\n{}", up_log(&dir));
        std::thread::sleep(Duration::from_millis(100));
    };
    let said = up_log(&dir);
    assert!(!status.success(), "nearlog up exited successfully:\n{said}");
    assert!(said.contains("controller keeps failing (6 exits within 60 s)") && said.contains("nearlog-controller.json"), "{said}");
    assert!(testbed::proc::wait_gone(&peers, Duration::from_secs(30)), "peers still run after nearlog up gave up");
}
