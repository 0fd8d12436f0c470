//! Processes by pid: alive or not, which one (its start time survives pid reuse), signalled
//! with kill(2). The leaf the local pool, the unit kill and the teardown share (none of them
//! imports another for these).

use std::time::{Duration, Instant};

/// Whether `pid` names a live process (a zombie counts as gone).
pub fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat.rsplit_once(')').map(|(_, rest)| !rest.trim_start().starts_with('Z')).unwrap_or(true),
        Err(_) => false,
    }
}

/// Start time of a process (clock ticks since boot, /proc/PID/stat field 22): with the pid, it
/// names one process even after pid reuse.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    // Fields after the command: state is field 3, so starttime (22) is index 19 here.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Sends `sig` to `pid`; a negative `pid` is a process group.
pub fn signal(pid: i32, sig: libc::c_int) {
    // SAFETY: kill(2) has no memory-safety preconditions (negative pid: a process group).
    unsafe {
        libc::kill(pid, sig);
    }
}

/// Waits until none of `pids` is alive; false at the deadline.
pub fn wait_gone(pids: &[u32], timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while pids.iter().any(|p| pid_alive(*p)) {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}
