//! stdio writes to log files: a small C program appends numbered lines to a log file through a
//! `FILE` stream (`fopen(.., "a")`, or `fdopen` of a log fd), `fflush`es and
//! `fsync(fileno(f))`s each, and prints the line's number once both returned. It is SIGKILLed
//! mid-load, the local file is deleted (a new machine), and reading the file under the shim
//! recovers it from the log peers: every acknowledged line is there, in order, nothing else
//! but whole later lines. Without the shim's stream support (glibc writes streams with its
//! internal `write`, which LD_PRELOAD never sees) the recovered file would be empty. Needs cc.

mod nearlog_common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nearlog_common::{shim_path, start_cluster, Kill};

const PROG: &str = r#"
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
int main(int argc, char **argv) {
    FILE *f;
    if (strcmp(argv[2], "fdopen") == 0) {
        int fd = open(argv[1], O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd < 0) { perror("open"); return 1; }
        f = fdopen(fd, "a");
    } else {
        f = fopen(argv[1], "a");
    }
    if (!f) { perror("fopen"); return 1; }
    for (int i = 0;; i++) {
        fprintf(f, "line %d %s\n", i, i % 3 ? "x" : "a longer line of text");
        if (fflush(f) != 0) { perror("fflush"); return 1; }
        if (fsync(fileno(f)) != 0) { perror("fsync"); return 1; }
        printf("%d\n", i);
        fflush(stdout);
    }
}
"#;

fn run(so: &Path, cluster_file: &Path, bin: &Path, log: &Path, how: &str) {
    let env = |c: &mut Command| {
        c.env("LD_PRELOAD", so).env("UNDERSTUDY_NEARLOG_CLUSTER", cluster_file).env("UNDERSTUDY_NEARLOG_PATTERNS", "*.log");
    };
    let mut c = Command::new(bin);
    c.arg(log).arg(how).stdout(Stdio::piped()).stderr(Stdio::inherit());
    env(&mut c);
    let mut child = Kill(c.spawn().unwrap());
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let mut acked: i64 = -1;
    let start = Instant::now();
    while acked < 500 && start.elapsed() < Duration::from_secs(60) {
        match lines.next() {
            Some(Ok(l)) => acked = l.trim().parse().unwrap(),
            _ => break,
        }
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGKILL) };
    drop(child);
    for l in lines.map_while(Result::ok) {
        acked = acked.max(l.trim().parse().unwrap_or(-1));
    }
    assert!(acked >= 500, "{how}: the program acknowledged only {acked} lines");
    std::fs::remove_file(log).unwrap();
    // A reader under the shim recovers the missing file from the peers.
    let mut r = Command::new("python3");
    r.arg("-c").arg("import sys; sys.stdout.write(open(sys.argv[1]).read())").arg(log);
    env(&mut r);
    let out = r.output().unwrap();
    assert!(out.status.success(), "{how}: reading the log failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let got: Vec<&str> = text.lines().collect();
    assert!(got.len() as i64 > acked, "{how}: {} lines recovered, {} acknowledged", got.len(), acked + 1);
    for (i, l) in got.iter().enumerate() {
        assert_eq!(*l, format!("line {i} {}", if i % 3 != 0 { "x" } else { "a longer line of text" }), "{how}: line {i}");
    }
    assert!(text.ends_with('\n'), "{how}: only whole lines are written");
}

#[test]
fn stdio_stream_writes_to_a_log_file_are_replicated() {
    let so = shim_path();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("stdio.c");
    let bin = tmp.path().join("stdio");
    std::fs::write(&src, PROG).unwrap();
    let out = Command::new("cc").args(["-O1", "-o"]).arg(&bin).arg(&src).output().expect("cc");
    assert!(out.status.success(), "cc: {}", String::from_utf8_lossy(&out.stderr));
    let (_cluster, cluster_file) = start_cluster(&tmp.path().join("cluster"));
    let app = tmp.path().join("app");
    std::fs::create_dir_all(&app).unwrap();
    run(&so, &cluster_file, &bin, &app.join("fopen.log"), "fopen");
    run(&so, &cluster_file, &bin, &app.join("fdopen.log"), "fdopen");
}
