//! `understudy nearlog up` stopped and started again on the same directory (issue 22 §4).
//!
//! The peers come back with the ids they had (no dead duplicates in the controller) but with
//! empty memory: an application reopening a log file written before gets a quick, clear error
//! that names the cause (the peers lost the file) and the way out (`nearlog reseed`), not EIO
//! after the shim's deadline. `understudy nearlog reseed` takes the local copy as the truth and
//! writes it to a majority of peers at a new epoch; afterwards the file recovers from the peers
//! (local copy removed first) with exactly the acknowledged bytes.

mod nearlog_common;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nearlog_common::{recover_through_shim, shim_path, start_cluster, Kill};

/// Appends `count` chunks of 1000 bytes (byte value = chunk index) with os.write + fsync.
const WRITE: &str = r#"
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
for i in range(int(sys.argv[2])):
    assert os.write(fd, bytes([i % 251]) * 1000) == 1000
    os.fsync(fd)
os.close(fd)
"#;

/// For each line `N` on stdin: appends N chunks as [`WRITE`] does, then prints the file size.
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

/// The shim's deadline in this test: the failure mode (waiting for a majority that cannot
/// come) takes this long; the clear error must come well before it.
const DEADLINE_MS: u64 = 20_000;

fn controller_peers(dir: &Path) -> Vec<(u64, String)> {
    let st: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("nearlog-controller.json")).unwrap()).unwrap();
    st["peers"].as_object().unwrap().iter().map(|(id, p)| (id.parse().unwrap(), p["addr"].as_str().unwrap().to_string())).collect()
}

/// Stops `nearlog up` as an operator does (Ctrl-C), SIGKILL if it does not exit in 10 s.
fn stop(mut up: Kill) {
    unsafe { libc::kill(up.0.id() as i32, libc::SIGINT) };
    let t = Instant::now();
    while up.0.try_wait().unwrap().is_none() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(up);
}

/// A `nearlog up` cluster in a fresh directory and an application directory holding `log_name`.
struct Setup {
    _tmp: tempfile::TempDir,
    dir: std::path::PathBuf,
    log: std::path::PathBuf,
    up: Kill,
    cluster: std::path::PathBuf,
}

fn setup(log_name: &str) -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cluster");
    let app = tmp.path().join("app");
    std::fs::create_dir_all(&app).unwrap();
    let (up, cluster) = start_cluster(&dir);
    Setup { log: app.join(log_name), dir, up, cluster, _tmp: tmp }
}

/// Runs `c` under the shim, its log files the `*.log` ones, with the test's deadline.
fn under_shim(c: &mut Command, cluster: &Path) {
    c.env("LD_PRELOAD", shim_path())
        .env("UNDERSTUDY_NEARLOG_CLUSTER", cluster)
        .env("UNDERSTUDY_NEARLOG_PATTERNS", "*.log")
        .env("UNDERSTUDY_NEARLOG_DEADLINE_MS", DEADLINE_MS.to_string());
}

#[test]
fn restarting_nearlog_up_keeps_peer_ids_and_a_lost_file_is_reseeded_from_its_local_copy() {
    let Setup { _tmp, dir, log, up, cluster } = setup("x.log");
    let env = |c: &mut Command| under_shim(c, &cluster);
    let mut w = Command::new("python3");
    w.arg("-c").arg(WRITE).arg(&log).arg("50");
    env(&mut w);
    let out = w.output().unwrap();
    assert!(out.status.success(), "writing through the shim: {}", String::from_utf8_lossy(&out.stderr));
    let acked = std::fs::read(&log).unwrap();
    assert_eq!(acked.len(), 50_000);
    let before = controller_peers(&dir);
    assert_eq!(before.len(), 3, "{before:?}");

    stop(up);
    let (_up, cluster2) = start_cluster(&dir);
    assert_eq!(cluster2, cluster);

    // Reopen the existing log file for writing, as the application does after the restart.
    let mut r = Command::new("python3");
    r.arg("-c").arg("import os, sys; os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)").arg(&log);
    env(&mut r);
    let t = Instant::now();
    let out = r.output().unwrap();
    let took = t.elapsed();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    eprintln!("reopen after the restart: {:?} after {took:?}: {err}", out.status);

    let after = controller_peers(&dir);
    let ids = |v: &[(u64, String)]| v.iter().map(|(id, _)| *id).collect::<Vec<_>>();
    assert_eq!(
        ids(&after),
        ids(&before),
        "the controller lists exactly the 3 peers of `nearlog up`, with their ids (before: {before:?}, after: {after:?}); \
         the reopen took {took:?}: {err}"
    );
    let cf: serde_json::Value = serde_json::from_slice(&std::fs::read(&cluster).unwrap()).unwrap();
    for (_, addr) in &after {
        assert!(cf["peers"].as_array().unwrap().iter().any(|p| p == addr.as_str()), "{addr} is not a running peer: {cf}");
    }

    assert!(!out.status.success(), "the reopen succeeded although no peer holds the file: {err}");
    assert!(took < Duration::from_millis(DEADLINE_MS / 2), "the reopen failed only after {took:?}, not at once: {err}");
    assert!(err.contains("lost") && err.contains("nearlog reseed"), "the error names the cause and the way out: {err}");
    assert_eq!(std::fs::read(&log).unwrap(), acked, "a failed open leaves the local copy alone");

    // The operator accepts the local copy.
    let out = Command::new(env!("CARGO_BIN_EXE_understudy")).args(["nearlog", "reseed", "--cluster"]).arg(&cluster).arg(&log).output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "reseed failed: {said}");
    assert!(said.contains("re-seeded"), "{said}");

    // The peers hold it again: with the local copy gone, the file comes back from them whole.
    let got = recover_through_shim(&log, env);
    assert_eq!(got.len(), acked.len());
    assert!(got == acked, "recovered bytes differ from the acknowledged ones");

    // A second reseed of a file the peers hold is refused (it would override the peers).
    let out = Command::new(env!("CARGO_BIN_EXE_understudy")).args(["nearlog", "reseed", "--cluster"]).arg(&cluster).arg(&log).output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "reseed of a file the peers hold must be refused: {said}");
    assert!(said.contains("--force"), "{said}");
}

/// An application that keeps its log file open across a restart of `nearlog up` goes on
/// writing: the cluster comes back at the same addresses with the same peer ids, the writer
/// re-bases the emptied peers from its local copy (it holds every op it submitted), and the
/// peers then hold every acknowledged byte.
#[test]
fn a_writer_running_across_a_restart_of_nearlog_up_keeps_writing() {
    let Setup { _tmp, dir, log, up, cluster } = setup("w.log");
    let env = |c: &mut Command| under_shim(c, &cluster);
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
    let before = std::fs::read_to_string(&cluster).unwrap();
    stop(up);
    let (_up, _) = start_cluster(&dir);
    let after = std::fs::read_to_string(&cluster).unwrap();
    assert_eq!(after, before, "the controller and the peers are back at their addresses");
    assert_eq!(controller_peers(&dir).len(), 3);
    let t = Instant::now();
    assert_eq!(step(20), 40_000);
    assert!(t.elapsed() < Duration::from_millis(DEADLINE_MS / 2), "writes resumed only after {:?}", t.elapsed());
    drop(child);
    let want: Vec<u8> = (0..40u8).flat_map(|i| vec![i; 1000]).collect();
    let got = recover_through_shim(&log, env);
    assert!(got == want, "the peers hold {} bytes, not the 40000 acknowledged", got.len());
}
