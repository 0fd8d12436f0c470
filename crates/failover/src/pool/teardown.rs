//! Taking an instance's volume stack down without ever hanging.
//!
//! An instance's volume is a stack the kernel holds together: ext4 mount → loop device → the
//! FUSE file served by the instance's attach helper. Killing that helper while a loop device
//! still reads its file is how a machine gets a process stuck in D state for good (loop I/O
//! waiting on a server that is gone, and every later `losetup` behind the loop mutex). So the
//! order here is always: fence the FUSE connection (fusectl `abort`: from then on every request
//! fails at once, nothing more reaches the volume — a crash's lost page cache — and nothing can
//! wait on the server), kill the application, `umount -l` the file system, `losetup -d` its
//! loop device and wait until the kernel let go of the FUSE file, and only then SIGKILL the
//! helper. Every external command runs with a deadline ([`run_bounded`]); a step that does not
//! finish is reported, not waited on.
//!
//! Plain functions (std threads, no runtime): the pool calls them through `spawn_blocking`,
//! tests from their clean-up guards.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::process::{pid_alive, signal, wait_gone};

/// Deadline of each clean-up command (`umount`, `losetup`, `mount`).
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(20);
/// How long the kernel gets to release a loop device after `losetup -d`.
pub const LOOP_RELEASE_TIMEOUT: Duration = Duration::from_secs(15);
/// How long killed processes get to be gone.
pub const EXIT_TIMEOUT: Duration = Duration::from_secs(15);
const FUSECTL: &str = "/sys/fs/fuse/connections";

/// Runs `prog args` with a deadline; returns its stdout, or why it failed. A command still
/// running at the deadline is SIGKILLed and reported; it is not waited for beyond a short grace
/// (one stuck in the kernel would never be reaped), so the caller never hangs.
pub fn run_bounded(prog: &str, args: &[&str], timeout: Duration) -> Result<String, String> {
    let what = format!("`{prog} {}`", args.join(" "));
    let mut child = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {prog}: {e}"))?;
    // Read both pipes while it runs: output larger than a pipe's buffer would otherwise stall
    // the command until its deadline.
    let drain = |p: Option<Box<dyn std::io::Read + Send>>| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut v = vec![];
            if let Some(mut p) = p {
                let _ = p.read_to_end(&mut v);
            }
            let _ = tx.send(String::from_utf8_lossy(&v).into_owned());
        });
        rx
    };
    let out = drain(child.stdout.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>));
    let err = drain(child.stderr.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>));
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                // The command has exited, so its pipes end — unless it left a child holding
                // them: then what was read so far is not waited for beyond a second.
                let grace = Duration::from_secs(1);
                let (out, err) = (out.recv_timeout(grace).unwrap_or_default(), err.recv_timeout(grace).unwrap_or_default());
                return if status.success() { Ok(out) } else { Err(format!("{what}: {status}: {}", err.trim())) };
            }
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let grace = Instant::now() + Duration::from_secs(1);
                while matches!(child.try_wait(), Ok(None)) && Instant::now() < grace {
                    std::thread::sleep(Duration::from_millis(10));
                }
                return Err(format!("{what} did not finish within {timeout:?} (killed; it may be stuck in the kernel)"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => return Err(format!("{what}: wait failed: {e}")),
        }
    }
}

fn mountinfo() -> String {
    std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default()
}

/// The private FUSE directory prefix of attach helper `pid` (fusefile's `understudy-fusefile-PID-N`).
pub fn fuse_prefix(pid: u32) -> String {
    std::env::temp_dir()
        .join(format!("understudy-fusefile-{pid}-"))
        .to_string_lossy()
        .into_owned()
}

/// FUSE mounts of helper `pid`: (mount point, fusectl connection number).
pub fn fuse_mounts(pid: u32) -> Vec<(String, String)> {
    let prefix = fuse_prefix(pid);
    mountinfo()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let (dev, mp) = (f.get(2)?, f.get(4)?);
            // A FUSE connection is numbered by the minor of its device (`0:NN`).
            mp.starts_with(&prefix).then(|| {
                (
                    mp.to_string(),
                    dev.rsplit(':').next().unwrap_or_default().to_string(),
                )
            })
        })
        .collect()
}

/// Loop devices reading a FUSE file of helper `pid`.
pub fn loops(pid: u32) -> Vec<PathBuf> {
    let prefix = fuse_prefix(pid);
    let mut v = vec![];
    for e in std::fs::read_dir("/sys/block")
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file")) {
            if b.trim().starts_with(&prefix) {
                v.push(Path::new("/dev").join(e.file_name()));
            }
        }
    }
    v
}

/// Mounts fusectl where it belongs if nothing is there yet (systemd does it on most machines).
fn ensure_fusectl() -> Result<(), String> {
    if mountinfo()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(FUSECTL))
    {
        return Ok(());
    }
    run_bounded(
        "mount",
        &["-t", "fusectl", "fusectl", FUSECTL],
        COMMAND_TIMEOUT,
    )
    .map(|_| ())
}

/// Fences helper `pid`'s FUSE connections: every pending and later request fails at once, so
/// nothing more reaches the volume (as in a crash, dirty pages are lost) and nothing can wait
/// on the server. Returns how many were aborted.
pub fn abort_fuse(pid: u32) -> Result<usize, String> {
    let conns = fuse_mounts(pid);
    if conns.is_empty() {
        return Ok(0);
    }
    ensure_fusectl()?;
    for (mp, conn) in &conns {
        let abort = format!("{FUSECTL}/{conn}/abort");
        std::fs::write(&abort, "1")
            .map_err(|e| format!("cannot abort the FUSE connection of {mp} ({abort}): {e}"))?;
        tracing::debug!(mp, conn, "FUSE connection aborted");
    }
    Ok(conns.len())
}

pub fn is_mountpoint(dir: &Path) -> bool {
    let d = dir.to_string_lossy();
    mountinfo()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(d.as_ref()))
}

/// Takes down what attach helper `helper` serves, as a crash: its FUSE connection aborted, the
/// file system at `mount` (if any) lazily unmounted, its loop devices detached and released,
/// then the helper's process group SIGKILLed and its FUSE directories unmounted. The
/// application must be dead already (its writes would only fail now). When a loop device does
/// not let go in time, the helper is left alive (killing it then is what wedges machines) and
/// the error says so: call again later.
pub fn take_down_helper(helper: u32, mount: Option<&Path>) -> Result<(), String> {
    take_down(helper, mount, true)
}

/// What a dead helper left (its pid may name another process by now: it is neither fenced
/// nor signalled): the file system at `mount`, loop devices and FUSE mounts named after it.
pub fn take_down_dead_helper(helper: u32, mount: Option<&Path>) -> Result<(), String> {
    take_down(helper, mount, false)
}

fn take_down(helper: u32, mount: Option<&Path>, ours: bool) -> Result<(), String> {
    let alive = |p| ours && pid_alive(p);
    let mut problems = vec![];
    if alive(helper) {
        // Go on without the fence if it fails: the unmount then flushes, which is slower
        // but never hangs.
        if let Err(e) = abort_fuse(helper) {
            problems.push(e);
        }
    }
    if let Some(m) = mount.filter(|m| is_mountpoint(m)) {
        if let Err(e) = run_bounded("umount", &["-l", &m.to_string_lossy()], COMMAND_TIMEOUT) {
            problems.push(e);
        }
    }
    for dev in loops(helper) {
        if let Err(e) = run_bounded("losetup", &["-d", &dev.to_string_lossy()], COMMAND_TIMEOUT) {
            problems.push(e);
        }
    }
    let deadline = Instant::now() + LOOP_RELEASE_TIMEOUT;
    while !loops(helper).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let held = loops(helper);
    if !held.is_empty() {
        problems.push(format!("loop devices {held:?} still read helper {helper}'s FUSE file after {LOOP_RELEASE_TIMEOUT:?}; the helper is left running"));
        return Err(problems.join("; "));
    }
    if alive(helper) {
        signal(-(helper as i32), libc::SIGKILL);
        signal(helper as i32, libc::SIGKILL);
        if !wait_gone(&[helper], EXIT_TIMEOUT) {
            problems.push(format!(
                "attach helper {helper} still alive {EXIT_TIMEOUT:?} after SIGKILL"
            ));
        }
    }
    for (mp, _) in fuse_mounts(helper) {
        if let Err(e) = run_bounded("umount", &["-l", &mp], COMMAND_TIMEOUT) {
            problems.push(e);
        }
        let _ = std::fs::remove_dir(&mp);
    }
    if problems.is_empty() {
        Ok(())
    } else {
        // Steps after a failed fence still ran; only a stuck loop device leaves things up.
        tracing::warn!(
            helper,
            "taking the volume stack down: {}",
            problems.join("; ")
        );
        if alive(helper) {
            Err(problems.join("; "))
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_bounded_and_report_why() {
        assert_eq!(run_bounded("sh", &["-c", "echo hi"], Duration::from_secs(10)).unwrap(), "hi\n");
        let e = run_bounded("sh", &["-c", "echo nope >&2; exit 3"], Duration::from_secs(10)).unwrap_err();
        assert!(e.contains("nope") && e.contains('3'), "{e}");
        assert!(run_bounded("/nonexistent/cmd", &[], Duration::from_secs(1)).unwrap_err().contains("cannot run"));
        // More output than a pipe holds does not stall the command.
        let big = run_bounded("sh", &["-c", "head -c 1000000 /dev/zero | tr '\\0' x"], Duration::from_secs(20)).unwrap();
        assert_eq!(big.len(), 1_000_000);
        // A command that does not finish is killed and reported at its deadline.
        let t = Instant::now();
        let e = run_bounded("sleep", &["30"], Duration::from_millis(200)).unwrap_err();
        assert!(e.contains("did not finish"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }

    /// Nothing to take down for a helper that never mounted anything: no error, no signal.
    #[test]
    fn a_helper_with_nothing_mounted_is_a_no_op() {
        // A pid that no process has (pid_max is at most 2^22).
        let pid = (1 << 22) + 7;
        assert!(fuse_mounts(pid).is_empty() && loops(pid).is_empty());
        take_down_dead_helper(pid, None).unwrap();
        assert_eq!(abort_fuse(pid).unwrap(), 0);
    }
}
