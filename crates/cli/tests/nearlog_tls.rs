//! SQLite (WAL, synchronous=FULL) under the nearlog LD_PRELOAD shim with every nearlog link
//! over mutual TLS (`UNDERSTUDY_LINK_TLS=always`, a certificate from the test's CA in every
//! process: the peers, the controller, and the shim inside the application): killed with
//! SIGKILL mid-load, its WAL comes back from the peers into an empty local directory. Every
//! daemon refuses plain links (`always`, loopback included; the refusal itself is checked in
//! the nearlog crate's `link_tls` test), so the shim's links really are TLS. Not run here: a
//! shim without the setting (each of its calls waits out the daemons' 5 s handshake deadline
//! before failing: minutes for one sqlite3 open). One test in this file: it sets the
//! environment its processes inherit. Needs python3 (its sqlite3 module) and the
//! `nearlog-preload` cdylib.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use wire::link::{LINK_TLS_CA_ENV, LINK_TLS_CERT_ENV, LINK_TLS_ENV, LINK_TLS_KEY_ENV};

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
fn sqlite_under_the_shim_with_nearlog_links_over_tls() {
    let so = shim_path();
    let tmp = tempfile::tempdir().unwrap();
    let pki = wire::tls::TestPki::write(&tmp.path().join("pki"));
    std::env::set_var(LINK_TLS_ENV, "always");
    std::env::set_var(LINK_TLS_CERT_ENV, pki.path("server-cert.pem"));
    std::env::set_var(LINK_TLS_KEY_ENV, pki.path("server-key.pem"));
    std::env::set_var(LINK_TLS_CA_ENV, pki.path("ca-cert.pem"));
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
    assert!(acked >= 300, "load acknowledged only {acked} rows over TLS");

    // The local directory is lost; the bulk file (the database) survives on storage.
    let old = tmp.path().join("old-app");
    std::fs::rename(&app, &old).unwrap();
    std::fs::create_dir_all(&app).unwrap();
    std::fs::copy(old.join("db.sqlite"), &db).unwrap();
    let mut cmd = Command::new("python3");
    cmd.arg("-c").arg(CHECK).arg(&db);
    env(&mut cmd);
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "check failed: {err}");
    assert!(err.contains("recovered"), "the WAL came back from the log peers: {err}");
    let ids: Vec<u64> = String::from_utf8_lossy(&out.stdout).lines().map(|l| l.trim().parse().unwrap()).collect();
    assert!(ids.len() as u64 >= acked, "{} rows recovered, {acked} acknowledged", ids.len());
}
