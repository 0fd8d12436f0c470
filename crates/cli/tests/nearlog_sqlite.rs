//! SQLite (journal_mode=WAL, synchronous=FULL) under the nearlog LD_PRELOAD shim: killed with
//! SIGKILL mid-load, restarted against an empty local directory into which only the bulk file
//! (the database) is copied back from "storage"; every acknowledged row must be there.
//! Needs python3 (its sqlite3 module) and the `nearlog-preload` cdylib (built on demand).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod nearlog_common;
use nearlog_common::{shim_path, start_cluster, Kill};

const LOAD: &str = r#"
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("PRAGMA synchronous=FULL")
db.execute("PRAGMA wal_autocheckpoint=0")  # every row stays in the WAL: recovery must come from the peers
db.execute("CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, v TEXT)")
i = 0
while True:
    i += 1
    db.execute("INSERT INTO t (id, v) VALUES (?, ?)", (i, "x" * (i % 300)))
    print(i, flush=True)
"#;

const CHECK: &str = r#"
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
for (i,) in db.execute("SELECT id FROM t ORDER BY id"):
    print(i)
"#;

#[test]
fn sqlite_wal_survives_sigkill_and_an_empty_local_directory() {
    let so = shim_path();
    let tmp = tempfile::tempdir().unwrap();
    let (_cluster, cluster_file) = start_cluster(&tmp.path().join("cluster"));
    let app = tmp.path().join("app");
    std::fs::create_dir_all(&app).unwrap();
    let db = app.join("db.sqlite");
    let env = |c: &mut Command| {
        c.env("LD_PRELOAD", &so).env("UNDERSTUDY_NEARLOG_CLUSTER", &cluster_file).env("UNDERSTUDY_NEARLOG_PATTERNS", "*-wal").env("UNDERSTUDY_NEARLOG_DEADLINE_MS", "10000");
    };
    let mut cmd = Command::new("python3");
    cmd.arg("-c").arg(LOAD).arg(&db).stdout(Stdio::piped()).stderr(Stdio::inherit());
    env(&mut cmd);
    let mut child = Kill(cmd.spawn().unwrap());
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let mut acked = 0u64;
    let start = Instant::now();
    while acked < 300 && start.elapsed() < Duration::from_secs(60) {
        match lines.next() {
            Some(Ok(l)) => acked = l.trim().parse().unwrap(),
            _ => break,
        }
    }
    // SIGKILL mid-load.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGKILL) };
    drop(child);
    assert!(acked >= 300, "load acknowledged only {acked} rows");

    // The local directory is lost; the bulk file (the database) survives on storage.
    let old = tmp.path().join("old-app");
    std::fs::rename(&app, &old).unwrap();
    std::fs::create_dir_all(&app).unwrap();
    std::fs::copy(old.join("db.sqlite"), &db).unwrap();
    assert!(!app.join("db.sqlite-wal").exists());

    let mut cmd = Command::new("python3");
    cmd.arg("-c").arg(CHECK).arg(&db);
    env(&mut cmd);
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "check failed: {err}");
    assert!(err.contains("recovered"), "the WAL came back from the log peers: {err}");
    let ids: Vec<u64> = String::from_utf8_lossy(&out.stdout).lines().map(|l| l.trim().parse().unwrap()).collect();
    assert!(ids.len() as u64 >= acked, "{} rows recovered, {acked} acknowledged", ids.len());
    assert!(ids.iter().copied().eq(1..=ids.len() as u64), "rows 1..=n without gaps");
}
