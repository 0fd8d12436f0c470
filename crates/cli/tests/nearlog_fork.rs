//! Fork, vfork/posix_spawn, exec and signal handlers under the nearlog shim, and the lock-free
//! path of everything that is no log file (issue 22 §1).
//!
//! A C program under the shim runs threads that hammer its entry points (open, write, fsync,
//! close, rename, unlink on log and non-log paths) while the main thread forks 200 times; each
//! child calls into the shim (rename, open/write/close of a non-log file, close of an inherited
//! log fd, a write to one that must fail with EIO, sometimes a log file of its own) and
//! `_exit`s. A child that does not exit within 10 s (it takes milliseconds) is a deadlock on a
//! lock it inherited held (the parent's other threads are gone in the child); a child also
//! checks it holds none of the parent's peer connections. The same program also
//! `posix_spawn`s and `vfork`+`exec`s while the threads run, and the parent's log file is then
//! recovered on an empty directory: nothing a child did (close, dup2 over an inherited log fd)
//! made the parent's own writes go unreplicated.

mod nearlog_common;

use std::process::Command;

use nearlog_common::{recover_through_shim, Bed};

const PROG: &str = r#"
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;
static const char *dir;
static int ctl_port;
static volatile int stop;

static void path(char *out, const char *fmt, long a, long b) {
    char name[128];
    snprintf(name, sizeof name, fmt, a, b);
    snprintf(out, 512, "%s/%s", dir, name);
}

/* One hammering thread: a log file opened, written, fsynced, closed, renamed, unlinked; a
   non-log file likewise; over and over until `stop`. */
static void *hammer(void *arg) {
    long t = (long)arg;
    char buf[200], a[512], b[512];
    memset(buf, 'a' + t, sizeof buf);
    for (long i = 0; !stop; i++) {
        path(a, "t%ld-%ld.log", t, i % 4);
        path(b, "t%ld-%ld-renamed.log", t, i % 4);
        int fd = open(a, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd < 0) { fprintf(stderr, "thread %ld: open %s: %s\n", t, a, strerror(errno)); exit(20); }
        for (int k = 0; k < 3; k++)
            if (write(fd, buf, sizeof buf) != sizeof buf) { fprintf(stderr, "thread %ld: write: %s\n", t, strerror(errno)); exit(21); }
        if (fsync(fd) != 0) { fprintf(stderr, "thread %ld: fsync: %s\n", t, strerror(errno)); exit(22); }
        if (close(fd) != 0) { fprintf(stderr, "thread %ld: close: %s\n", t, strerror(errno)); exit(23); }
        if (rename(a, b) != 0) { fprintf(stderr, "thread %ld: rename: %s\n", t, strerror(errno)); exit(24); }
        if (unlink(b) != 0) { fprintf(stderr, "thread %ld: unlink: %s\n", t, strerror(errno)); exit(25); }
        path(a, "t%ld-%ld.tmp", t, i % 4);
        path(b, "t%ld-%ld.dat", t, i % 4);
        fd = open(a, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0 || write(fd, buf, sizeof buf) != sizeof buf || fsync(fd) != 0 || close(fd) != 0 || rename(a, b) != 0) {
            fprintf(stderr, "thread %ld: non-log file: %s\n", t, strerror(errno)); exit(26);
        }
    }
    return NULL;
}

/* What a forked child does (Redis's rewrite child: writes a temp file and renames it). Exit
   codes name what went wrong. */
static void child(int n, int logfd) {
    char a[512], b[512];
    /* The parent's connections to its log peers are not the child's: closed at the fork. (A
       controller connection another thread had open at that moment may be copied: not
       counted.) */
    for (int fd = 0; fd < 1024; fd++) {
        struct sockaddr_in sa;
        socklen_t len = sizeof sa;
        if (getpeername(fd, (struct sockaddr *)&sa, &len) == 0 && sa.sin_family == AF_INET && ntohs(sa.sin_port) != ctl_port) _exit(11);
    }
    path(a, "child-%ld.tmp", n, 0);
    path(b, "child-%ld.rdb", n, 0);
    int fd = open(a, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || write(fd, "child", 5) != 5 || fsync(fd) != 0 || close(fd) != 0) _exit(2);
    if (rename(a, b) != 0 || unlink(b) != 0) _exit(3);
    /* A log fd inherited from the parent is not the child's to replicate: EIO, clearly. */
    errno = 0;
    if (write(logfd, "x", 1) != -1 || errno != EIO) _exit(4);
    if (fsync(logfd) != -1 || errno != EIO) _exit(5);
    if (close(logfd) != 0) _exit(6);
    /* Its fd number, reused for a plain file, is a plain fd again. */
    fd = open(a, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || write(fd, "again", 5) != 5 || close(fd) != 0 || unlink(a) != 0) _exit(7);
    if (n % 20 == 0) {
        /* A log file of the child's own replicates through the child's own connections. */
        path(a, "child-%ld.log", n, 0);
        fd = open(a, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0) _exit(8);
        if (write(fd, "mine", 4) != 4 || fsync(fd) != 0 || close(fd) != 0) _exit(9);
        if (unlink(a) != 0) _exit(10);
    }
    _exit(0);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Waits for `pid` up to `secs`; a child still running then is reported and killed. */
static int reap(pid_t pid, double secs, const char *what, int n) {
    double until = now() + secs;
    int st;
    for (;;) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) break;
        if (r < 0) { perror("waitpid"); return 1; }
        if (now() > until) {
            printf("HUNG %s %d: pid %d did not exit within %.0f s\n", what, n, pid, secs);
            fflush(stdout);
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return 1;
        }
        usleep(200);
    }
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        printf("FAILED %s %d: status %d (exit %d)\n", what, n, st, WIFEXITED(st) ? WEXITSTATUS(st) : -1);
        return 1;
    }
    return 0;
}

static int records;

/* The parent's own log record number `records`, through `fd` (the log fd or a copy). */
static void record(int fd) {
    char line[64];
    int len = snprintf(line, sizeof line, "record %06d\n", records++);
    if (write(fd, line, len) != len) { perror("write main.log"); exit(31); }
}

int main(int argc, char **argv) {
    dir = argv[1];
    int forks = atoi(argv[2]), spawns = atoi(argv[3]);
    ctl_port = atoi(argv[4]);
    char logp[512];
    path(logp, "main.log", 0, 0);
    /* No O_CLOEXEC asked, and a dup2 copy (which POSIX makes inheritable): what does an exec'd
       program get? */
    int logfd = open(logp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (logfd < 0) { perror("open main.log"); return 30; }
    int copy = dup2(logfd, 40);
    if (copy != 40) { perror("dup2 of the log fd"); return 36; }
    pthread_t th[4];
    for (long t = 0; t < 4; t++) pthread_create(&th[t], NULL, hammer, (void *)t);
    int bad = 0;
    char fds[2][16];
    snprintf(fds[0], sizeof fds[0], "%d", logfd);
    snprintf(fds[1], sizeof fds[1], "%d", copy);
    for (int n = 0; n < spawns; n++) {
        record(n % 2 ? copy : logfd);
        /* posix_spawn from this threaded program (glibc: clone(CLONE_VM|CLONE_VFORK), no fork
           handlers, no interposed calls in the child) of a shell that reports which of the
           log fds it inherited across the exec. */
        char *sargv[] = {"sh", "-c", "for f in \"$@\"; do if [ -e /proc/self/fd/$f ]; then echo EXEC-SEES-FD-$f; else echo EXEC-LACKS-FD-$f; fi; done", "sh", fds[0], fds[1], NULL};
        pid_t sp;
        fflush(stdout);
        if (posix_spawnp(&sp, "sh", NULL, NULL, sargv, environ) != 0) { perror("posix_spawn"); return 33; }
        bad += reap(sp, 5.0, "posix_spawn child", n);
        /* vfork (shared memory, its own fd table) + dup2 over the log fd + close + exec: the
           child's fd table changes, the parent's log fds must go on replicating. */
        int devnull = open("/dev/null", O_WRONLY);
        pid_t vp = vfork();
        if (vp == 0) {
            dup2(devnull, logfd);
            close(copy);
            close(devnull);
            execlp("true", "true", (char *)NULL);
            _exit(127);
        }
        close(devnull);
        bad += reap(vp, 5.0, "vfork child", n);
    }
    for (int n = 0; n < forks; n++) {
        record(logfd);
        pid_t pid = fork();
        if (pid < 0) { perror("fork"); return 32; }
        if (pid == 0) child(n, logfd);
        bad += reap(pid, 10.0, "fork child", n);
        if (bad >= 3) break; /* a deadlock is plain by now: fail fast */
    }
    stop = 1;
    for (int t = 0; t < 4; t++) pthread_join(th[t], NULL);
    record(copy);
    const char *end = "end\n";
    if (write(logfd, end, 4) != 4 || fsync(logfd) != 0) { perror("write main.log after the forks"); return 34; }
    if (close(copy) != 0 || close(logfd) != 0) { perror("close main.log"); return 35; }
    printf("DONE forks=%d spawns=%d bad=%d records=%d\n", forks, spawns, bad, records);
    return bad ? 1 : 0;
}
"#;

/// Compiles PROG into `dir` (cc is part of the Rust toolchain's prerequisites).
fn compile(dir: &std::path::Path) -> std::path::PathBuf {
    let src = dir.join("forker.c");
    let bin = dir.join("forker");
    std::fs::write(&src, PROG).unwrap();
    let out = Command::new("cc").args(["-O1", "-pthread", "-o"]).arg(&bin).arg(&src).output().expect("cc");
    assert!(out.status.success(), "cc: {}", String::from_utf8_lossy(&out.stderr));
    bin
}

/// Runs the program under the shim with `forks` forks and `spawns` rounds of posix_spawn and
/// vfork+exec; checks it ended well and that every record it wrote is on the log peers.
/// Returns its stdout.
fn run(forks: usize, spawns: usize) -> String {
    let bed = Bed::new();
    let bin = compile(bed.tmp.path());
    let mut cmd = Command::new(&bin);
    let cluster: serde_json::Value = serde_json::from_slice(&std::fs::read(&bed.cluster_file).unwrap()).unwrap();
    let ctl_port = cluster["controller"].as_str().unwrap().rsplit_once(':').unwrap().1.to_string();
    cmd.arg(&bed.app).arg(forks.to_string()).arg(spawns.to_string()).arg(ctl_port);
    let env = |c: &mut Command| {
        c.env("LD_PRELOAD", &bed.so).env("UNDERSTUDY_NEARLOG_CLUSTER", &bed.cluster_file).env("UNDERSTUDY_NEARLOG_PATTERNS", "*.log");
    };
    env(&mut cmd);
    // Its own process group: a hung child is killed with it whatever happens to this test.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let child = cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    struct Group(i32);
    impl Drop for Group {
        fn drop(&mut self) {
            // SAFETY: signals our own process group (the program and whatever it left).
            unsafe { libc::kill(-self.0, libc::SIGKILL) };
        }
    }
    let _group = Group(child.id() as i32);
    let start = std::time::Instant::now();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail: String = stderr.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
    assert!(out.status.success(), "program failed ({:?}) after {:?}:\n{stdout}\nstderr (last lines):\n{tail}", out.status, start.elapsed());
    let done = stdout.lines().find(|l| l.starts_with("DONE ")).unwrap_or_else(|| panic!("{stdout}\n{tail}"));
    assert!(done.contains(&format!("forks={forks} spawns={spawns} bad=0 ")), "{stdout}\n{tail}");
    let records: usize = done.rsplit_once("records=").unwrap().1.parse().unwrap();
    eprintln!("{forks} forks, {spawns} spawns under the shim: {:?}", start.elapsed());

    // Every record the parent wrote (while its children closed or replaced their copies of its
    // log fds) reached the log peers.
    let recovered = recover_through_shim(&bed.app.join("main.log"), env);
    let mut want = String::new();
    for n in 0..records {
        want += &format!("record {n:06}\n");
    }
    want += "end\n";
    assert_eq!(String::from_utf8_lossy(&recovered), want);
    stdout
}

#[test]
fn forks_while_threads_are_inside_the_shim_never_hang_a_child() {
    run(200, 1);
}

/// A log fd does not cross exec (it is close-on-exec, also a dup2 copy the application made
/// inheritable): an exec'd program has no shim state for it, and what it wrote there would be
/// in no peer's copy. A vfork child's dup2 over the log fd and close of its copy before exec
/// leave the parent's log fds replicating.
#[test]
fn vfork_posix_spawn_and_exec_leave_the_parents_log_fds_alone() {
    let stdout = run(0, 5);
    assert!(!stdout.contains("EXEC-SEES"), "an exec'd program inherited a log fd:\n{stdout}");
    assert_eq!(stdout.matches("EXEC-LACKS-FD").count(), 10, "{stdout}");
}

/// A program whose SIGALRM handler (every 300 µs) writes a record to the same log file its main
/// thread writes to, and a byte to a pipe. The handler often interrupts the main thread inside
/// the shim, which holds the state's lock: the handler's write must neither wait for it (a
/// deadlock with itself) nor pass through unreplicated; it fails with EIO, clearly. A write to
/// a non-log fd from the handler takes no lock and succeeds.
const SIG_PROG: &str = r#"
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>

static int logfd, pipefd[2];
static volatile sig_atomic_t sig_ok, sig_eio, sig_other, pipe_bad;

/* "sig NNNNNN\n" without stdio (async-signal-safe). */
static int fmt(char *out, const char *tag, int n) {
    int len = 0;
    for (const char *t = tag; *t; t++) out[len++] = *t;
    out[len++] = ' ';
    for (int d = 100000; d; d /= 10) out[len++] = '0' + (n / d) % 10;
    out[len++] = '\n';
    return len;
}

static void on_alarm(int sig) {
    (void)sig;
    int saved = errno;
    char line[32];
    int len = fmt(line, "sig", sig_ok);
    ssize_t r = write(logfd, line, len);
    if (r == len) sig_ok++;
    else if (r < 0 && errno == EIO) sig_eio++;
    else sig_other++;
    if (write(pipefd[1], "x", 1) != 1) pipe_bad++;
    errno = saved;
}

int main(int argc, char **argv) {
    int n = atoi(argv[2]);
    logfd = open(argv[1], O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644);
    if (logfd < 0 || pipe(pipefd) != 0) { perror("open"); return 2; }
    fcntl(pipefd[1], F_SETFL, O_NONBLOCK);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGALRM, &sa, NULL);
    struct itimerval it = {{0, 300}, {0, 300}};
    setitimer(ITIMER_REAL, &it, NULL);
    char line[32];
    for (int i = 0; i < n; i++) {
        /* Drain the pipe now and then (the handler's bytes) without blocking. */
        if (i % 256 == 0) { char b[4096]; fcntl(pipefd[0], F_SETFL, O_NONBLOCK); while (read(pipefd[0], b, sizeof b) > 0) {} }
        int len = fmt(line, "main", i);
        if (write(logfd, line, len) != len) { perror("main write"); return 3; }
    }
    struct itimerval off = {{0, 0}, {0, 0}};
    setitimer(ITIMER_REAL, &off, NULL);
    if (fsync(logfd) != 0 || close(logfd) != 0) { perror("fsync/close"); return 4; }
    printf("DONE main=%d sig_ok=%d sig_eio=%d sig_other=%d pipe_bad=%d\n", n, (int)sig_ok, (int)sig_eio, (int)sig_other, (int)pipe_bad);
    return 0;
}
"#;

#[test]
fn a_signal_handler_writing_a_log_fd_during_a_log_write_fails_clearly_and_loses_nothing() {
    let bed = Bed::new();
    let src = bed.tmp.path().join("sig.c");
    let bin = bed.tmp.path().join("sig");
    std::fs::write(&src, SIG_PROG).unwrap();
    let out = Command::new("cc").args(["-O1", "-o"]).arg(&bin).arg(&src).output().expect("cc");
    assert!(out.status.success(), "cc: {}", String::from_utf8_lossy(&out.stderr));
    let log = bed.app.join("sig.log");
    let env = |c: &mut Command| {
        c.env("LD_PRELOAD", &bed.so).env("UNDERSTUDY_NEARLOG_CLUSTER", &bed.cluster_file).env("UNDERSTUDY_NEARLOG_PATTERNS", "*.log");
    };
    let main_records = 3000;
    let mut cmd = Command::new(&bin);
    cmd.arg(&log).arg(main_records.to_string());
    env(&mut cmd);
    let child = cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    // A deadlock (the handler waiting for the lock its own thread holds) never ends: bounded.
    let out = match rx.recv_timeout(std::time::Duration::from_secs(60)) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            // SAFETY: signals the program this test started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the program did not finish within 60 s (a signal handler deadlocked in the shim?)");
        }
    };
    let (stdout, stderr, status) = (String::from_utf8_lossy(&out.stdout).to_string(), String::from_utf8_lossy(&out.stderr).to_string(), out.status);
    let tail: String = stderr.lines().rev().take(10).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
    assert!(status.success(), "{status:?}\n{stdout}\n{tail}");
    let done = stdout.lines().find(|l| l.starts_with("DONE ")).unwrap_or_else(|| panic!("{stdout}\n{tail}"));
    let field = |k: &str| -> usize { done.split_whitespace().find_map(|f| f.strip_prefix(&format!("{k}="))).unwrap().parse().unwrap() };
    eprintln!("{done}");
    assert_eq!(field("sig_other"), 0, "a handler's log write failed otherwise than EIO: {done}\n{tail}");
    assert_eq!(field("pipe_bad"), 0, "a handler's write to a pipe failed: {done}");
    assert!(field("sig_ok") + field("sig_eio") > 0, "no signal arrived during the run: {done}");

    // Every write that returned success, from the main loop or the handler, is on the peers,
    // and nothing else is.
    let recovered = String::from_utf8_lossy(&recover_through_shim(&log, env)).to_string();
    let mut got: Vec<&str> = recovered.lines().collect();
    got.sort();
    let mut want: Vec<String> = (0..main_records).map(|i| format!("main {i:06}")).chain((0..field("sig_ok")).map(|i| format!("sig {i:06}"))).collect();
    want.sort();
    assert_eq!(got.len(), want.len(), "{done}: recovered {} lines, {} acknowledged", got.len(), want.len());
    assert!(got.iter().zip(&want).all(|(g, w)| g == w), "{done}: the recovered log differs from what was acknowledged");
}

/// A Python program: a log write that cannot reach a majority (the test stopped two of the three
/// peers) holds the shim's state for up to the deadline on one thread, while the main thread
/// creates, writes, renames and unlinks files that are no log files, timing each round.
const STALL_PROG: &str = r#"
import os, sys, threading, time
d = sys.argv[1]
fd = os.open(d + "/stall.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
os.write(fd, b"before\n")
print("OPENED", flush=True)
sys.stdin.readline()
result = []
def stalled():
    t = time.monotonic()
    try:
        os.write(fd, b"stalled\n")
        result.append("ok")
    except OSError as e:
        result.append("errno %d" % e.errno)
    result.append("%.0f" % ((time.monotonic() - t) * 1000))
w = threading.Thread(target=stalled)
w.start()
time.sleep(0.5)
worst = 0.0
for i in range(50):
    t = time.monotonic()
    a, b = "%s/plain-%d.tmp" % (d, i), "%s/plain-%d.dat" % (d, i)
    f = os.open(a, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(f, b"x" * 100)
    os.close(f)
    os.rename(a, b)
    os.unlink(b)
    worst = max(worst, time.monotonic() - t)
busy = w.is_alive()
w.join()
print("WORST_MS %.0f WRITER_BUSY_MEANWHILE %s WRITER %s" % (worst * 1000, busy, " ".join(result)), flush=True)
"#;

/// Calls on paths and fds that are no log files take no shim lock: a log write stalled for want
/// of a majority (holding the replication state up to its deadline) does not hold up a rename or
/// unlink of a plain file on another thread.
#[test]
fn plain_files_do_not_wait_behind_a_stalled_log_write() {
    use std::io::{BufRead, BufReader, Write};
    let split = nearlog_common::Split::start("stall-secret");
    let so = nearlog_common::shim_path();
    let deadline_ms = 5000;
    let mut child = nearlog_common::Kill(
        Command::new("python3")
            .arg("-c")
            .arg(STALL_PROG)
            .arg(&split.app)
            .env("LD_PRELOAD", &so)
            .env("UNDERSTUDY_NEARLOG_CLUSTER", &split.cluster)
            .env("UNDERSTUDY_NEARLOG_PATTERNS", "*.log")
            .env("UNDERSTUDY_NEARLOG_DEADLINE_MS", deadline_ms.to_string())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "OPENED");
    // Two of the file's three peers stopped: no write can reach a majority until its deadline.
    let key = split.app.join("stall.log").canonicalize().unwrap().to_string_lossy().into_owned();
    let holders = split.peers_of(&key);
    assert_eq!(holders.len(), 3, "the log file is placed on the cluster's 3 peers: {}", split.controller_state());
    let stopped: Vec<i32> = holders[..2].iter().map(|&i| split.peers[i].0.id() as i32).collect();
    struct Cont(Vec<i32>);
    impl Drop for Cont {
        fn drop(&mut self) {
            for &p in &self.0 {
                // SAFETY: resumes a peer this test stopped.
                unsafe { libc::kill(p, libc::SIGCONT) };
            }
        }
    }
    let _cont = Cont(stopped.clone());
    for &p in &stopped {
        // Stopped for certain before the write: a peer still running answers it.
        assert!(testbed::proc::pause(p as u32, std::time::Duration::from_secs(10)), "log peer {p} did not stop within 10 s");
    }
    child.0.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let line = lines.next().expect("the program ended early").unwrap();
    eprintln!("{line}");
    let worst: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    // Far below the stalled write's deadline (what a plain rename waited before), generous for a
    // loaded machine (a round is well under 10 ms).
    assert!(worst < 1000, "a plain file's open/write/rename/unlink round took {worst} ms behind a log write stalled for {deadline_ms} ms: {line}");
    assert!(
        line.contains("WRITER_BUSY_MEANWHILE True"),
        "the log write was not stalled while the plain files were handled: {line}; stopped peers {holders:?} (pids {:?}) of the controller's state {}",
        _cont.0,
        split.controller_state()
    );
    assert!(line.contains(&format!("WRITER errno {}", libc::EIO)), "the stalled log write ends with EIO at its deadline: {line}");
}
