//! RocksDB (Debian's librocksdb, through a small C program compiled here with `cc`) under the
//! nearlog LD_PRELOAD shim: synced puts (`WriteOptions.sync`), the WAL (`*.log` in a local WAL
//! directory) replicated to the log peers, the SST files and the MANIFEST in a "storage"
//! directory. Killed with SIGKILL mid-load, then restarted (1) against a stale local WAL
//! directory (a copy taken earlier in the load) and (2) against an empty one, each time after
//! `understudy nearlog restore` (RocksDB finds its WAL files by listing the directory), and (3)
//! against an empty one without restore (the shim recovers the files when RocksDB lists the
//! directory); every acknowledged put must be there with its value. Needs cc and librocksdb-dev.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod nearlog_common;
use nearlog_common::{shim_path, start_cluster, Kill};

const LOAD_C: &str = include_str!("../../testbed/src/nearlog_rocksdb.c");

fn build_load(dir: &Path) -> PathBuf {
    let src = dir.join("load.c");
    let bin = dir.join("load");
    std::fs::write(&src, LOAD_C).unwrap();
    let out = Command::new("cc").args(["-O1", "-o"]).arg(&bin).arg(&src).args(["-lrocksdb", "-lpthread"]).output().expect("cc");
    assert!(out.status.success(), "compiling against librocksdb failed: {}", String::from_utf8_lossy(&out.stderr));
    bin
}

struct Env {
    so: PathBuf,
    cluster_file: PathBuf,
    wal: PathBuf,
}

impl Env {
    fn apply(&self, c: &mut Command) {
        c.env("LD_PRELOAD", &self.so)
            .env("UNDERSTUDY_NEARLOG_CLUSTER", &self.cluster_file)
            .env("UNDERSTUDY_NEARLOG_PATTERNS", format!("{}/*.log", self.wal.display()))
            .env("UNDERSTUDY_NEARLOG_DEADLINE_MS", "10000");
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        // A WAL file may vanish between listing and copying (RocksDB deletes obsolete ones).
        let _ = std::fs::copy(e.path(), to.join(e.file_name()));
    }
}

/// Loads until at least `min_acked` puts are acknowledged (copying the WAL directory to
/// `stale` after `stale_at` of them), then SIGKILLs the load; returns the last acknowledged i.
fn load_and_kill(bin: &Path, db: &Path, env: &Env, min_acked: u64, stale: Option<(&Path, u64)>) -> u64 {
    let mut c = Command::new(bin);
    c.arg("load").arg(db).arg(&env.wal).arg("1").stdout(Stdio::piped()).stderr(Stdio::inherit());
    env.apply(&mut c);
    let mut child = Kill(c.spawn().unwrap());
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let mut acked = 0u64;
    let start = Instant::now();
    while acked < min_acked && start.elapsed() < Duration::from_secs(90) {
        match lines.next() {
            Some(Ok(l)) => acked = l.trim().parse().unwrap(),
            _ => break,
        }
        if let Some((dir, at)) = stale {
            if acked == at {
                copy_dir(&env.wal, dir);
            }
        }
    }
    // SIGKILL mid-load: the next put is in flight.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGKILL) };
    drop(child);
    // Acks printed before the kill landed also count.
    for l in lines.map_while(Result::ok) {
        acked = acked.max(l.trim().parse().unwrap_or(0));
    }
    assert!(acked >= min_acked, "the load acknowledged only {acked} puts");
    acked
}

fn restore_and_check(bin: &Path, db: &Path, env: &Env) -> (u64, String) {
    restore(env);
    check(bin, db, env)
}

fn restore(env: &Env) {
    let out = Command::new(env!("CARGO_BIN_EXE_understudy"))
        .args(["nearlog", "restore", "--cluster"])
        .arg(&env.cluster_file)
        .arg("--shim")
        .arg(&env.so)
        .arg(&env.wal)
        .output()
        .unwrap();
    let restore_err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "nearlog restore failed: {restore_err}");
    assert!(restore_err.contains("recovered"), "the WAL came back from the log peers: {restore_err}");
}

/// Opens the database under the shim; returns the puts found and the shim's lines.
fn check(bin: &Path, db: &Path, env: &Env) -> (u64, String) {
    let mut c = Command::new(bin);
    c.arg("check").arg(db).arg(&env.wal);
    env.apply(&mut c);
    let out = c.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "check failed: {err}");
    (String::from_utf8_lossy(&out.stdout).trim().parse().unwrap(), err.to_string())
}

#[test]
fn rocksdb_synced_wal_survives_sigkill_with_a_stale_or_empty_local_wal_directory() {
    let so = shim_path();
    let tmp = tempfile::tempdir().unwrap();
    let bin = build_load(tmp.path());
    let (_cluster, cluster_file) = start_cluster(&tmp.path().join("cluster"));
    let db = tmp.path().join("storage/db");
    std::fs::create_dir_all(tmp.path().join("storage")).unwrap();
    let wal = tmp.path().join("local/wal");
    std::fs::create_dir_all(&wal).unwrap();
    let env = Env { so, cluster_file, wal: wal.clone() };

    // (1) Stale local WAL directory: the copy taken after 500 of the acknowledged puts.
    let stale = tmp.path().join("stale-wal");
    let acked = load_and_kill(&bin, &db, &env, 3000, Some((&stale, 500)));
    std::fs::remove_dir_all(&wal).unwrap();
    std::fs::rename(&stale, &wal).unwrap();
    let (n, _) = restore_and_check(&bin, &db, &env);
    assert!(n >= acked, "stale local WAL: {n} puts recovered, {acked} acknowledged");

    // (2) Empty local WAL directory (a new machine), after a second load on the same storage.
    let acked = load_and_kill(&bin, &db, &env, 3000, None);
    std::fs::remove_dir_all(&wal).unwrap();
    std::fs::create_dir_all(&wal).unwrap();
    let (n, _) = restore_and_check(&bin, &db, &env);
    assert!(n >= acked, "empty local WAL: {n} puts recovered, {acked} acknowledged");

    // (3) Empty again, and no `nearlog restore`: RocksDB's own listing of the WAL directory
    // (opendir, intercepted by the shim) brings the replicated WAL files back first.
    let acked = load_and_kill(&bin, &db, &env, 3000, None);
    std::fs::remove_dir_all(&wal).unwrap();
    std::fs::create_dir_all(&wal).unwrap();
    let (n, shim_err) = check(&bin, &db, &env);
    assert!(n >= acked, "empty local WAL without restore: {n} puts recovered, {acked} acknowledged");
    assert!(shim_err.contains("recovered"), "the shim brought the WAL back when RocksDB listed it: {shim_err}");
}
