//! A log peer that falls behind is patched, not sent the whole file: while peer 3 is stopped
//! (SIGSTOP) the writer goes on past its retransmit buffer and drops it; once it runs again it
//! holds an older copy, and the writer sends only the blocks it lacks (its block checksums
//! first). Then peer 1 dies and the file, recovered from peers 2 and 3 into an empty
//! directory, holds every byte. Separate `understudy nearlog controller` / `peer` processes.

mod nearlog_common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nearlog_common::{recover_through_shim, shim_path, Kill, Split};

/// For each line `N` on stdin: appends N KiB in 64 KiB writes (the i-th write's bytes are
/// `i % 251`) and prints the size; `c`: closes the file and exits.
const WRITER: &str = r#"
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
size = 0
for line in sys.stdin:
    line = line.strip()
    if line == "c":
        os.close(fd)
        break
    for _ in range(int(line) // 64):
        os.write(fd, bytes([(size // 65536) % 251]) * 65536)
        size += 65536
    print(size, flush=True)
"#;

fn expected(size: usize) -> Vec<u8> {
    (0..size / 65536).flat_map(|i| std::iter::repeat_n((i % 251) as u8, 65536)).collect()
}

#[test]
fn a_peer_that_falls_behind_is_patched_with_what_it_lacks() {
    let so = shim_path();
    let mut split = Split::start("patch-secret");
    let mut peers = std::mem::take(&mut split.peers);
    let (tmp, cluster, app) = (&split.tmp, &split.cluster, &split.app);
    let log = app.join("x.log");
    let stderr_path = tmp.path().join("writer.err");
    let env = |c: &mut Command| {
        c.env("LD_PRELOAD", &so).env("UNDERSTUDY_NEARLOG_CLUSTER", &cluster).env("UNDERSTUDY_NEARLOG_PATTERNS", "*.log").env("UNDERSTUDY_NEARLOG_DEADLINE_MS", "20000");
    };
    let mut cmd = Command::new("python3");
    cmd.arg("-c").arg(WRITER).arg(&log).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(std::fs::File::create(&stderr_path).unwrap());
    env(&mut cmd);
    let mut child = Kill(cmd.spawn().unwrap());
    let mut stdin = child.0.stdin.take().unwrap();
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let mut step = |cmd: &str| -> usize {
        writeln!(stdin, "{cmd}").unwrap();
        lines.next().expect("writer died").unwrap().trim().parse().unwrap()
    };
    step("4096");
    // Peer 3 stops; the writer goes on past its 16 MiB retransmit buffer and drops it.
    let stopped = peers[2].0.id() as i32;
    assert!(testbed::proc::pause(stopped as u32, Duration::from_secs(10)), "log peer 3 did not stop within 10 s");
    step("20480");
    // SAFETY: signalling our own child (the guard's SIGKILL also ends a stopped process).
    unsafe { libc::kill(stopped, libc::SIGCONT) };
    // It runs again behind: the writer's next writes find it and resync it.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut size = 0;
    while !std::fs::read_to_string(&stderr_path).unwrap().contains("resyncing it from the local copy") {
        assert!(Instant::now() < deadline, "peer 3 was never resynced: {}", std::fs::read_to_string(&stderr_path).unwrap());
        size = step("64");
        std::thread::sleep(Duration::from_millis(50));
    }
    for _ in 0..10 {
        size = step("64");
        std::thread::sleep(Duration::from_millis(50));
    }
    writeln!(stdin, "c").unwrap();
    drop(stdin);
    let status = child.0.wait().unwrap();
    assert!(status.success());
    let err = std::fs::read_to_string(&stderr_path).unwrap();
    let line = err.lines().find(|l| l.contains("images sent to lagging log peers")).unwrap_or_else(|| panic!("no image line: {err}"));
    let n: Vec<u64> = line.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    eprintln!("{line}");
    let [whole, patch, patched] = n[n.len() - 3..] else { panic!("{line}") };
    assert_eq!(whole, 0, "patched, not sent whole: {line}");
    assert!(patched as usize >= 24 << 20 && patch > 0 && patch < patched / 2, "only what it lacked: {line}");

    // Peer 1 dies: peers 2 and 3 (patched) recover the file into an empty directory.
    drop(peers.remove(0));
    let recovered = recover_through_shim(&log, env);
    assert!(recovered == expected(size), "recovered {} bytes, not the {size} written (or different bytes)", recovered.len());
}
