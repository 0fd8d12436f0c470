//! A log peer killed with SIGKILL mid-load and restarted empty: writes go on with the other two
//! (a minority dying never blocks), the restarted peer is re-based from the client's local copy,
//! and after the application is killed too and restarted on an empty directory, every
//! acknowledged row is recovered. Separate `understudy nearlog controller` / `peer` processes.

mod nearlog_common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use nearlog_common::{shim_path, Kill, Split, SQLITE_LOAD};

#[test]
fn a_peer_restart_mid_load_loses_nothing() {
    let so = shim_path();
    let mut split = Split::start("peer-restart-secret");
    let mut peers = std::mem::take(&mut split.peers);
    let (tmp, cluster, app) = (&split.tmp, &split.cluster, &split.app);
    let db = app.join("db.sqlite");
    let env = |c: &mut Command| {
        c.env("LD_PRELOAD", &so).env("UNDERSTUDY_NEARLOG_CLUSTER", &cluster).env("UNDERSTUDY_NEARLOG_PATTERNS", "*-wal");
    };
    let mut cmd = Command::new("python3");
    cmd.arg("-c").arg(SQLITE_LOAD).arg(&db).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
    env(&mut cmd);
    let mut child = Kill(cmd.spawn().unwrap());
    let mut stdin = child.0.stdin.take().unwrap();
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let mut step = |n: u32| -> u64 {
        writeln!(stdin, "{n}").unwrap();
        lines.next().expect("load died").unwrap().trim().parse().unwrap()
    };
    step(100);
    // Peer 0 dies (its memory with it): the other two keep acknowledging.
    drop(peers.remove(0));
    step(100);
    // It comes back empty and is re-based; then peer 1 dies: writes still need peer 0's copy.
    peers.insert(0, split.peer(0));
    std::thread::sleep(Duration::from_millis(1500));
    step(100);
    drop(peers.remove(1));
    let acked = step(100);
    unsafe { libc::kill(child.0.id() as i32, libc::SIGKILL) };
    drop(child);

    let old = tmp.path().join("old-app");
    std::fs::rename(&app, &old).unwrap();
    std::fs::create_dir_all(&app).unwrap();
    std::fs::copy(old.join("db.sqlite"), &db).unwrap();
    let mut cmd = Command::new("python3");
    cmd.arg("-c").arg("import sqlite3,sys; print(sqlite3.connect(sys.argv[1]).execute('select count(*), max(id) from t').fetchone())").arg(&db);
    env(&mut cmd);
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("recovered"), "the WAL came back from the log peers: {err}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), format!("({acked}, {acked})"), "{err}");
}
