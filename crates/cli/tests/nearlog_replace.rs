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

mod nearlog_common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nearlog_common::{daemon, free_port, recover_through_shim, shim_path, Kill};

/// The lease the test's controller runs with.
const LEASE_MS: u64 = 2000;
const CHUNK: usize = 16 << 10;

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

fn status(ctl: &str, secret: &[u8]) -> nearlog::proto::ControllerState {
    match nearlog::driver::mover::ctl_call(ctl, secret, &nearlog::proto::CtlRequest::Status) {
        Ok(nearlog::proto::CtlReply::Status(s)) => s,
        other => panic!("controller status: {other:?}"),
    }
}

#[test]
fn a_lost_peer_is_replaced_without_an_operator_and_a_second_loss_loses_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    let ctl_dir = root.join("ctl");
    std::fs::create_dir_all(&ctl_dir).unwrap();
    let secret_file = ctl_dir.join("secret");
    let secret = b"replace-test-secret".to_vec();
    std::fs::write(&secret_file, &secret).unwrap();
    let ctl_addr = format!("127.0.0.1:{}", free_port());
    let ctl_out = root.join("controller.out");
    let _ctl = Kill(
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
    let said = || std::fs::read_to_string(&ctl_out).unwrap_or_default();
    let peer_addrs: Vec<String> = (0..4).map(|_| format!("127.0.0.1:{}", free_port())).collect();
    let mut peers: Vec<Option<Kill>> = peer_addrs
        .iter()
        .map(|a| Some(daemon(&["nearlog", "peer", "--listen", a, "--controller", &ctl_addr, "--region-bytes", "67108864", "--secret-file"], &[&secret_file])))
        .collect();
    let t = Instant::now();
    // The controller may not listen yet: errors count as "not yet".
    let live = || match nearlog::driver::mover::ctl_call(&ctl_addr, &secret, &nearlog::proto::CtlRequest::Status) {
        Ok(nearlog::proto::CtlReply::Status(s)) => s.peers.values().filter(|p| p.live).count(),
        _ => 0,
    };
    while live() < 4 {
        assert!(t.elapsed() < Duration::from_secs(30), "4 peers did not register within 30 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    let cluster = root.join("cluster.json");
    std::fs::write(&cluster, format!(r#"{{"controller":"{ctl_addr}","secret_file":"{}","peers":[]}}"#, secret_file.display())).unwrap();
    let env = |c: &mut Command| {
        c.env("LD_PRELOAD", shim_path())
            .env("UNDERSTUDY_NEARLOG_CLUSTER", &cluster)
            .env("UNDERSTUDY_NEARLOG_PATTERNS", "*.log")
            .env("UNDERSTUDY_NEARLOG_DEADLINE_MS", "20000");
    };
    let app = root.join("app");
    std::fs::create_dir_all(&app).unwrap();
    let log = app.join("w.log");
    let key = log.display().to_string();
    let mut cmd = Command::new("python3");
    cmd.arg("-c").arg(WRITER).arg(&log).arg(CHUNK.to_string()).stdin(Stdio::piped()).stdout(Stdio::piped());
    // A file, not a pipe: the shim's notes must never block the writer.
    let writer_err = root.join("writer.err");
    cmd.stderr(std::fs::File::create(&writer_err).unwrap());
    env(&mut cmd);
    let mut writer = Kill(cmd.spawn().unwrap());
    let mut stdin = writer.0.stdin.take().unwrap();
    let mut lines = BufReader::new(writer.0.stdout.take().unwrap()).lines();
    let mut step = |n: u32| -> usize {
        // Paced: the file stays far below the peers' regions however long a phase lasts.
        std::thread::sleep(Duration::from_millis(20));
        writeln!(stdin, "{n}").unwrap();
        match lines.next() {
            Some(Ok(l)) => l.trim().parse().unwrap(),
            _ => panic!("the writer died: {}\ncontroller said: {}", std::fs::read_to_string(&writer_err).unwrap_or_default(), std::fs::read_to_string(&ctl_out).unwrap_or_default()),
        }
    };
    // 4 MiB before the loss: what the new peer must be brought up to.
    let mut acked = step(256);
    let addr_of = |st: &nearlog::proto::ControllerState, id: nearlog::proto::PeerId| peer_addrs.iter().position(|a| st.peers[&id].addr == *a).unwrap();
    let st = status(&ctl_addr, &secret);
    let placed = st.files[&key].peers.clone();
    assert_eq!(placed.len(), 3);
    let spare = *st.peers.keys().find(|id| !placed.contains(id)).unwrap();
    let victim = placed[0];

    // First loss: no operator; the controller moves the file to the spare.
    let at_kill = acked as u64;
    drop(peers[addr_of(&st, victim)].take()); // SIGKILL
    let killed = Instant::now();
    let mut moved_after = None;
    let replicated_after = loop {
        acked = step(1);
        let st = status(&ctl_addr, &secret);
        let m = &st.files[&key];
        if moved_after.is_none() && !m.peers.contains(&victim) && m.prev_peers.is_empty() {
            moved_after = Some(killed.elapsed());
        }
        // The new peer holds at least the file as it was at the kill (heartbeats report
        // used bytes every second).
        if moved_after.is_some() && st.peers[&spare].used_bytes >= at_kill {
            break killed.elapsed();
        }
        assert!(killed.elapsed() < Duration::from_secs(30), "the lost peer was not replaced within 30 s: {m:?}; controller said: {}", said());
    };
    let moved_after = moved_after.unwrap();
    let out = said();
    assert!(out.contains(&format!("peer {victim} lost")), "{out}");
    assert!(out.contains(&format!("replacing lost peer {victim} by peer {spare}")), "{out}");
    eprintln!("lost peer replaced: placement moved {} ms after the kill, new peer holding {at_kill} bytes {} ms after it (lease {LEASE_MS} ms)", moved_after.as_millis(), replicated_after.as_millis());
    let st = status(&ctl_addr, &secret);
    assert!(st.files[&key].peers.contains(&spare));
    assert!(!st.peers[&victim].live);
    acked = step(32);

    // Second loss: one of the file's original peers. No spare is left: the controller says
    // so; the writer goes on with the remaining majority (the new peer and one original).
    let second = *st.files[&key].peers.iter().find(|&&p| p != spare).unwrap();
    drop(peers[addr_of(&st, second)].take());
    let killed = Instant::now();
    while !said().contains(&format!("stays on lost peer {second}")) {
        acked = step(1);
        assert!(killed.elapsed() < Duration::from_secs(30), "the controller did not report the second loss: {}", said());
    }
    assert!(said().contains("no live log peer outside its set has room"), "{}", said());
    acked = step(32);
    drop(stdin);
    let _ = writer.0.wait();
    drop(writer);
    let err = std::fs::read_to_string(&writer_err).unwrap_or_default();

    // Nothing acknowledged is lost: the file recovered from the two live peers.
    let got = recover_through_shim(&log, env);
    assert_eq!(got.len(), acked, "recovered length; writer said: {err}");
    assert!(got == expected(acked), "recovered content differs from the acknowledged writes");
    drop(peers);
}
