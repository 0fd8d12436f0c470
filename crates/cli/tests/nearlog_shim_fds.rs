//! The shim and file-descriptor copies: an unmodified Python program writes a log file through
//! `os.dup` (fcntl F_DUPFD_CLOEXEC), `os.dup2` (dup2), `os.dup2(inheritable=False)` (dup3) and
//! `fcntl(F_DUPFD)` copies, closes the original, replaces one copy with a non-log fd via dup2,
//! and tries a writable shared mmap of the log (refused with ENODEV, loudly) and a read-only
//! one (allowed). Recovered on an empty directory, the log holds every byte written through
//! every copy, and nothing written after a copy stopped being a log fd.

mod nearlog_common;

use std::process::Command;

use nearlog_common::{recover_through_shim, shim_path, start_cluster};

const PROG: &str = r#"
import os, sys, mmap, fcntl
path = sys.argv[1]
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
os.write(fd, b"A" * 100)
d1 = os.dup(fd)
os.write(d1, b"B" * 100)
d2 = os.dup2(fd, 50)
os.write(d2, b"C" * 100)
d3 = os.dup2(fd, 51, inheritable=False)
os.write(d3, b"D" * 100)
d4 = fcntl.fcntl(fd, fcntl.F_DUPFD, 60)
os.write(d4, b"E" * 100)
os.close(fd)
os.write(d1, b"F" * 100)
os.fsync(d1)
other = os.open(path + ".other", os.O_WRONLY | os.O_CREAT, 0o644)
os.dup2(other, d2)
os.write(d2, b"not-a-log")
try:
    mmap.mmap(d3, 600, mmap.MAP_SHARED, mmap.PROT_WRITE | mmap.PROT_READ)
    print("MMAP-OK")
except OSError as e:
    print("MMAP-ERR", e.errno)
m = mmap.mmap(d3, 600, mmap.MAP_PRIVATE, mmap.PROT_READ)
print("READMAP", m[:1].decode())
print("SIZE", os.fstat(d1).st_size)
"#;

#[test]
fn writes_through_fd_copies_replicate_and_shared_mmap_is_refused() {
    let so = shim_path();
    let tmp = tempfile::tempdir().unwrap();
    let (_cluster, cluster_file) = start_cluster(&tmp.path().join("cluster"));
    let app = tmp.path().join("app");
    std::fs::create_dir_all(&app).unwrap();
    let log = app.join("fds.log");
    let env = |c: &mut Command| {
        c.env("LD_PRELOAD", &so).env("UNDERSTUDY_NEARLOG_CLUSTER", &cluster_file).env("UNDERSTUDY_NEARLOG_PATTERNS", "*.log");
    };
    let mut cmd = Command::new("python3");
    cmd.arg("-c").arg(PROG).arg(&log);
    env(&mut cmd);
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout} {stderr}");
    assert!(stdout.contains(&format!("MMAP-ERR {}", libc::ENODEV)), "{stdout} {stderr}");
    assert!(stderr.contains("ENODEV"), "the refusal is logged: {stderr}");
    assert!(stdout.contains("READMAP A"), "{stdout}");
    assert!(stdout.contains("SIZE 600"), "{stdout}");
    assert_eq!(std::fs::read(app.join("fds.log.other")).unwrap(), b"not-a-log");

    let recovered = recover_through_shim(&log, env);
    let want: Vec<u8> = b"ABCDEF".iter().flat_map(|&c| std::iter::repeat_n(c, 100)).collect();
    assert_eq!(String::from_utf8_lossy(&recovered), String::from_utf8_lossy(&want));
}

/// A log file the application never closes (Redis keeps its AOF open until it exits) is
/// remembered as a known copy at exit, with the state of its last write: the next run's writer
/// open does not read it again.
#[test]
fn a_log_left_open_is_remembered_at_exit() {
    let bed = nearlog_common::Bed::new();
    let log = bed.app.join("open-at-exit.log");
    let prog = "import os, sys\nfd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)\nos.write(fd, b'x' * 1234)\nos.fsync(fd)\n";
    let mut cmd = Command::new("python3");
    cmd.arg("-c").arg(prog).arg(&log);
    cmd.env("LD_PRELOAD", &bed.so).env("UNDERSTUDY_NEARLOG_CLUSTER", &bed.cluster_file).env("UNDERSTUDY_NEARLOG_PATTERNS", "*.log");
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // SAFETY: no arguments.
    let dir = format!("/dev/shm/understudy-nearlog-{}", unsafe { libc::geteuid() });
    let key = log.to_str().unwrap();
    let record = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .filter_map(|e| std::fs::read_to_string(e.unwrap().path()).ok())
        .find(|t| t.lines().next() == Some(key))
        .unwrap_or_else(|| panic!("no record of {key} in {dir}"));
    let size: u64 = record.lines().nth(1).unwrap().split_whitespace().nth(3).unwrap().parse().unwrap();
    assert_eq!(size, 1234, "the record is the state after the last write: {record}");
}
