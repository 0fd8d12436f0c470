//! Child processes and signals, the one process helper of the workspace: starting the same
//! binary as a daemon with its output in a log file, whether a process is alive, its resident
//! memory (now and peak), stopping processes by pid (SIGTERM, wait, SIGKILL) or by process group,
//! and waiting for Ctrl-C / SIGTERM.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

/// How long a stopped child gets between SIGTERM and SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(10);

/// Starts `understudy ARGS...` (this very executable) with stdout and stderr appended to `log`,
/// in its own process group (so a terminal's Ctrl-C reaches only the supervisor, which stops
/// the children in order), and with SIGTERM as its parent-death signal (so the children do not
/// outlive a supervisor that was killed).
pub fn spawn_self(args: &[String], log: &Path, env: &[(&str, String)]) -> anyhow::Result<Child> {
    let exe = std::env::current_exe().context("cannot find the understudy executable")?;
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("cannot open log file {}", log.display()))?;
    let err = out.try_clone()?;
    let mut cmd = Command::new(exe);
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::from(out)).stderr(Stdio::from(err));
    for (k, v) in env {
        cmd.env(k, v);
    }
    own_group_dying_with_parent(&mut cmd, libc::SIGTERM);
    cmd.spawn().with_context(|| format!("cannot start `understudy {}`", args.join(" ")))
}

/// Makes `cmd`'s process lead a process group of its own, with `sig` as its parent-death signal.
pub fn own_group_dying_with_parent(cmd: &mut Command, sig: libc::c_int) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: only async-signal-safe calls (setpgid, prctl, getppid, kill) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::setpgid(0, 0);
            libc::prctl(libc::PR_SET_PDEATHSIG, sig as libc::c_ulong, 0, 0, 0);
            // The parent may have died before prctl: then nobody would stop us.
            if libc::getppid() != parent {
                libc::kill(libc::getpid(), sig);
            }
            Ok(())
        });
    }
}

pub fn signal(pid: u32, sig: libc::c_int) -> bool {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(pid as libc::pid_t, sig) == 0 }
}

/// SIGKILLs every process of process group `pgid` and waits, at most `timeout`, until none is
/// left alive (zombies hold no mount: their cwd and files are released at exit). Returns whether
/// the group is gone.
pub fn kill_group(pgid: u32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        // SAFETY: kill(2) has no memory-safety preconditions; a negative pid names a group.
        unsafe { libc::kill(-(pgid as libc::pid_t), libc::SIGKILL) };
        if !group_alive(pgid) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether any live (non-zombie) process is in process group `pgid`.
fn group_alive(pgid: u32) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else { return false };
    dir.filter_map(Result::ok).filter(|e| e.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit())).any(|e| {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { return false };
        // After the parenthesised command name: state, ppid, pgrp.
        let mut f = stat.rsplit_once(')').map(|(_, r)| r.split_whitespace()).into_iter().flatten();
        let state = f.next();
        state != Some("Z") && f.nth(1).and_then(|g| g.parse::<u32>().ok()) == Some(pgid)
    })
}

/// SIGSTOPs `pid` and waits, at most `timeout`, until every one of its threads is stopped.
/// kill(2) only queues the signal: each thread stops when it next runs, which on a loaded
/// machine can be milliseconds later, and until then it still answers requests (a test that
/// stopped two of three log peers and wrote at once saw its write acknowledged by a peer that
/// had not stopped yet). Returns whether all threads stopped in time.
pub fn pause(pid: u32, timeout: Duration) -> bool {
    if !signal(pid, libc::SIGSTOP) {
        return false;
    }
    let deadline = Instant::now() + timeout;
    while !all_threads_stopped(pid) {
        if Instant::now() >= deadline || !alive(pid) {
            return false;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    true
}

/// Whether every thread of `pid` is in the stopped state (`T`; `t` is a tracing stop).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    let mut any = false;
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else { continue };
        // The state follows the parenthesised command name.
        let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next());
        if !matches!(state, Some('T' | 't')) {
            return false;
        }
        any = true;
    }
    any
}

/// Whether a process with this pid exists (and is not a zombie).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat.rsplit_once(')').map(|(_, rest)| !rest.trim_start().starts_with('Z')).unwrap_or(true),
        Err(_) => false,
    }
}

/// A field of `/proc/PID/status` given in KiB (`VmRSS:`, `VmHWM:`), in bytes; None if the process
/// or the field is not there.
fn status_kib_field_bytes(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// Resident set size of a process now (VmRSS), in bytes; None if it is gone.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    status_kib_field_bytes(pid, "VmRSS:")
}

/// Peak resident set size of a process (VmHWM), in bytes; None if it is gone.
pub fn peak_rss_bytes(pid: u32) -> Option<u64> {
    status_kib_field_bytes(pid, "VmHWM:")
}

/// Waits until none of `pids` is alive; false at the deadline.
pub fn wait_gone(pids: &[u32], timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while pids.iter().any(|p| alive(*p)) {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

/// Stops children: SIGTERM to all, wait up to `grace`, SIGKILL the rest, reap all.
/// Returns each child's description and exit status text.
pub fn stop_children(children: &mut [(String, Child)], grace: Duration) -> Vec<(String, String)> {
    for (_, c) in children.iter_mut() {
        if let Ok(None) = c.try_wait() {
            signal(c.id(), libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + grace;
    let mut out = vec![];
    for (name, c) in children.iter_mut() {
        let status = loop {
            match c.try_wait() {
                Ok(Some(s)) => break describe_status(s),
                Ok(None) if Instant::now() >= deadline => {
                    let _ = c.kill();
                    break c.wait().map(|s| format!("{} after SIGKILL", describe_status(s))).unwrap_or_else(|e| e.to_string());
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => break e.to_string(),
            }
        };
        out.push((name.clone(), status));
    }
    out
}

pub fn describe_status(s: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => s.to_string(),
    }
}

/// The last `lines` lines of a (log) file, for error messages.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The reason a daemon gave for exiting: its last `error: ...` line (or panic message), else its
/// last log line.
pub fn last_error(log: &Path) -> String {
    let text = tail(log, 200);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    for (i, l) in lines.iter().enumerate().rev() {
        if let Some(e) = l.strip_prefix("error: ") {
            return e.to_string();
        }
        if l.contains("panicked at") {
            // The panic message is on the next line.
            return format!("{} {}", l.trim(), lines.get(i + 1).copied().unwrap_or("").trim());
        }
    }
    lines.last().map(|l| l.to_string()).unwrap_or_else(|| "no output".to_string())
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM; returns the signal's name.
pub async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("installing a SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing a SIGINT handler");
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

/// How long killing an application's process group may take before [`KillOnDrop`] warns.
pub const GROUP_KILL_TIMEOUT: Duration = Duration::from_secs(10);

/// A child process killed (SIGKILL) and reaped on drop; an application started by
/// [`app_command`] leads its own process group, and the whole group is killed (bounded wait), so
/// what it forked (Redis's `redis-aof-rewrite`, whose cwd is on the volume) does not keep the
/// volume's mount and loop device busy after the bench.
pub struct KillOnDrop(pub Child);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let pid = self.0.id();
        // SAFETY: getpgid(2) has no memory-safety preconditions; the child is not reaped yet.
        if unsafe { libc::getpgid(pid as libc::pid_t) } == pid as libc::pid_t && !kill_group(pid, GROUP_KILL_TIMEOUT) {
            eprintln!("warning: process group {pid} still has live processes {} s after SIGKILL", GROUP_KILL_TIMEOUT.as_secs());
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A command for an application (Redis, SQLite's python, the RocksDB and write+fsync programs):
/// in its own process group (killed as a whole by [`KillOnDrop`]), with SIGKILL as its
/// parent-death signal (a terminal's Ctrl-C no longer reaches it through the bench's group).
pub fn app_command(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = Command::new(program);
    own_group_dying_with_parent(&mut c, libc::SIGKILL);
    c
}

/// Runs an [`app_command`] to completion with its output captured, killing its process group
/// if it takes longer than `timeout`.
pub fn output_bounded(c: &mut Command, timeout: Duration) -> anyhow::Result<std::process::Output> {
    use std::io::Read;
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = KillOnDrop(c.spawn()?);
    let read_all = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut b = vec![];
            let _ = r.read_to_end(&mut b);
            b
        })
    };
    let out = read_all(Box::new(child.0.stdout.take().unwrap()));
    let err = read_all(Box::new(child.0.stderr.take().unwrap()));
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(st) = child.0.try_wait()? {
            break st;
        }
        anyhow::ensure!(Instant::now() < deadline, "{:?} still running after {} s: killed", c.get_program(), timeout.as_secs());
        std::thread::sleep(Duration::from_millis(5));
    };
    drop(child); // its group: anything it left behind
    Ok(std::process::Output { status, stdout: out.join().unwrap_or_default(), stderr: err.join().unwrap_or_default() })
}

/// Spawns this executable with `args`, stdout piped, and waits for a stdout line starting with
/// `ready_prefix`; returns the child and that line. Later output is drained.
pub fn spawn_self_until(args: &[&str], extra: &[&Path], ready_prefix: &str, timeout: Duration) -> anyhow::Result<(KillOnDrop, String)> {
    let mut c = Command::new(std::env::current_exe()?);
    c.args(args).args(extra).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = KillOnDrop(c.spawn().with_context(|| format!("cannot start `understudy {}`", args.join(" ")))?);
    let stdout = child.0.stdout.take().unwrap();
    let stderr = child.0.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let prefix = ready_prefix.to_string();
    std::thread::spawn(move || {
        let mut sent = false;
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            if !sent && l.starts_with(&prefix) {
                let _ = tx.send(l);
                sent = true;
            }
        }
    });
    let err_tail = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    {
        let err_tail = err_tail.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut t = err_tail.lock().unwrap();
                t.push(l);
                if t.len() > 20 {
                    t.remove(0);
                }
            }
        });
    }
    match rx.recv_timeout(timeout) {
        Ok(line) => Ok((child, line)),
        Err(_) => {
            let tail = err_tail.lock().unwrap().join("\n");
            anyhow::bail!("`understudy {}` did not become ready: {tail}", args.join(" "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The helper reads this very process: alive, a resident set above zero and a peak at least
    /// as large; a reaped child is neither alive nor measured.
    #[test]
    fn alive_and_rss_of_real_processes() {
        let me = std::process::id();
        assert!(alive(me));
        let rss = rss_bytes(me).expect("own VmRSS");
        let peak = peak_rss_bytes(me).expect("own VmHWM");
        assert!(rss > 0 && peak >= rss, "rss {rss} peak {peak}");
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        assert!(alive(pid));
        assert!(signal(pid, libc::SIGKILL));
        child.wait().unwrap();
        assert!(wait_gone(&[pid], Duration::from_secs(5)));
        assert!(!alive(pid) && rss_bytes(pid).is_none() && peak_rss_bytes(pid).is_none());
    }

    /// What an application forked (as Redis forks its AOF rewrite) dies with it.
    #[test]
    fn an_applications_children_die_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("child.pid");
        let mut c = app_command("sh");
        c.arg("-c").arg(format!("sleep 600 & echo $! > {}; wait", pidfile.display()));
        let app = KillOnDrop(c.spawn().unwrap());
        let deadline = Instant::now() + Duration::from_secs(10);
        let child = loop {
            if let Some(p) = std::fs::read_to_string(&pidfile).ok().and_then(|s| s.trim().parse::<u32>().ok()) {
                break p;
            }
            assert!(Instant::now() < deadline, "the shell did not start its child");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(alive(child));
        drop(app);
        assert!(!alive(child), "the application's child {child} outlived it");
    }

    /// A paused multi-threaded process (the test binary's own child: python with two threads)
    /// has every thread stopped when `pause` returns; a process that is gone is no pause.
    #[test]
    fn pause_returns_once_every_thread_stopped() {
        let mut c = Command::new("python3");
        c.arg("-c").arg("import threading, time\nthreading.Thread(target=lambda: time.sleep(60), daemon=True).start()\nprint('up', flush=True)\ntime.sleep(60)");
        let mut child = KillOnDrop(c.stdout(Stdio::piped()).spawn().unwrap());
        let mut line = String::new();
        BufReader::new(child.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let pid = child.0.id();
        assert!(!all_threads_stopped(pid));
        assert!(pause(pid, Duration::from_secs(10)));
        assert!(all_threads_stopped(pid));
        assert_eq!(std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().count(), 2, "python runs two threads");
        assert!(signal(pid, libc::SIGCONT));
        let deadline = Instant::now() + Duration::from_secs(10);
        while all_threads_stopped(pid) {
            assert!(Instant::now() < deadline, "SIGCONT did not resume it");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(signal(pid, libc::SIGKILL));
        child.0.wait().unwrap();
        assert!(!pause(pid, Duration::from_millis(100)), "a reaped process cannot be paused");
    }
}
