//! Shared helpers of the witness-KV CLI tests: a group started with `understudy kv up
//! --protocol witness` on free ports, stopped (SIGTERM, then SIGKILL) when its guard drops,
//! even on failure; waiting for it to serve; the pids it records; the CLI run against it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use testbed::kv_witness::WitnessClusterFile;

pub struct Up {
    child: Child,
}

impl Drop for Up {
    fn drop(&mut self) {
        // `kv up` stops its nodes and removes their /dev/shm regions on SIGTERM.
        // SAFETY: kill(2) has no memory-safety preconditions.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `kv up --protocol witness` in `dir` with `extra` arguments; its output beside `dir`.
pub fn start(dir: &Path, extra: &[&str]) -> Up {
    std::fs::create_dir_all(dir).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_understudy"))
        .args(["kv", "up", "--protocol", "witness", "--dir", dir.to_str().unwrap(), "--port-base", "0"])
        .args(extra)
        .stdout(std::fs::File::create(dir.with_extension("up.out")).unwrap())
        .stderr(std::fs::File::create(dir.with_extension("up.log")).unwrap())
        .spawn()
        .unwrap();
    Up { child }
}

/// Waits for `kv up` to report the group serving (it runs a put and a get first).
pub fn wait_ready(dir: &Path) -> (WitnessClusterFile, Vec<u8>) {
    let out = dir.with_extension("up.out");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        if text.contains("serving after") {
            break;
        }
        let log = std::fs::read_to_string(dir.with_extension("up.log")).unwrap_or_default();
        assert!(Instant::now() < deadline, "the witness group did not start serving:\n{text}\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    }
    WitnessClusterFile::load(&dir.join("kv-cluster.json")).unwrap().expect("a witness cluster file")
}

/// The pid `kv up` recorded for `name` (`node-0`, ...).
pub fn pid_of(dir: &Path, name: &str) -> u32 {
    let text = std::fs::read_to_string(dir.join("pids")).unwrap();
    text.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).unwrap().trim().parse().unwrap()
}

pub fn cli(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_understudy")).args(args).stdin(Stdio::null()).output().unwrap()
}

/// A data directory on the disk (the SSD tier refuses tmpfs), made, and removed with the test.
pub fn disk_dir() -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir_in("/var/tmp").unwrap();
    let dir = t.path().join("group");
    std::fs::create_dir_all(&dir).unwrap();
    (t, dir)
}
