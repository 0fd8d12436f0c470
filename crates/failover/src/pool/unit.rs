//! An instance's application as a unit that dies whole.
//!
//! A process group is not one: PostgreSQL's postmaster starts each child (every backend, the
//! checkpointer, the WAL writer) in a session of its own, and any daemon may `setsid` or double
//! fork, so a SIGKILL of the application's group leaves those running, reparented to init,
//! still holding files on the instance's volume (and so its loop device). A backend notices its
//! postmaster's death only where it waits; one in a long query runs on.
//!
//! So each application runs in its own cgroup v2 group (`<cgroup2 mount>/understudy/<name>`),
//! which it enters before it runs a single instruction of its own (the spawned child writes `0`
//! to the group's `cgroup.procs` between fork and exec), so nothing escapes by forking, double
//! forking or `setsid`. A kill writes `1` to `cgroup.kill` (the kernel SIGKILLs every process in
//! the group, also those forking at that moment), waits until `cgroup.events` says
//! `populated 0`, and removes the group. A pause writes `cgroup.freeze`. Only the core files
//! (`cgroup.procs`, `cgroup.kill`, `cgroup.freeze`, `cgroup.events`) are used, so no controller
//! has to be enabled: it works on the cgroup2 hierarchy of a hybrid machine
//! (`/sys/fs/cgroup/unified`) as on a pure-v2 one (`/sys/fs/cgroup`). `cgroup.kill` needs
//! Linux 5.14.
//!
//! Without a usable cgroup2 hierarchy the pool falls back to the application's process tree:
//! every descendant (by parent pid, walked from /proc again and again) is SIGSTOPped until the
//! set stops growing — stopped processes cannot fork — and then all are SIGKILLed. A process
//! that left the tree before the kill (its parent exited and it was reparented to init) is not
//! found that way: the fallback is weaker, and the pool says which one it uses.

use std::collections::BTreeSet;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::process::pid_alive;

/// The directory under the cgroup2 mount that holds the instances' groups.
const BASE: &str = "understudy";

/// How the pool contains its instances' applications.
#[derive(Clone, Debug, PartialEq)]
pub enum Containment {
    /// One cgroup v2 group per application, under this directory.
    Cgroup(PathBuf),
    /// No usable cgroup2 (the reason): the process tree is frozen and killed.
    Tree(String),
}

/// The cgroup2 mount point, from `/proc/self/mountinfo` (fields: id parent major:minor root
/// mount-point options ... - fstype source super-options).
pub fn cgroup2_mount() -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    text.lines()
        .find(|l| l.split(" - ").nth(1).and_then(|r| r.split(' ').next()) == Some("cgroup2"))
        .and_then(|l| l.split(' ').nth(4))
        .map(PathBuf::from)
}

impl Containment {
    /// Finds the cgroup2 hierarchy and proves it usable: the base directory is made (or found)
    /// and a probe group made in it has `cgroup.kill` and is removed again.
    pub fn detect() -> Containment {
        let Some(mount) = cgroup2_mount() else {
            return Containment::Tree("no cgroup2 file system is mounted".into());
        };
        let base = mount.join(BASE);
        // Unique in the machine (pid) and in this process (two pools may probe at once).
        static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let probe = base.join(format!("probe-{}-{n}", std::process::id()));
        let r = (|| -> Result<(), String> {
            match std::fs::create_dir(&base) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(format!("cannot create {}: {e}", base.display())),
            }
            let _ = std::fs::remove_dir(&probe);
            std::fs::create_dir(&probe)
                .map_err(|e| format!("cannot create {}: {e}", probe.display()))?;
            let has_kill = probe.join("cgroup.kill").exists();
            // A process must be able to move itself in (permissions, a delegated hierarchy):
            // a short-lived one tries, as an application will at its spawn.
            let moved = if has_kill {
                probe_entry(&probe)
            } else {
                Ok(())
            };
            // Its process has exited (waited for): the group is empty, and goes.
            let _ = kill_group(&probe, Duration::from_secs(5));
            if !has_kill {
                return Err(format!(
                    "{} has no cgroup.kill (Linux older than 5.14)",
                    mount.display()
                ));
            }
            moved
        })();
        match r {
            Ok(()) => Containment::Cgroup(base),
            Err(why) => Containment::Tree(why),
        }
    }

    /// One line saying which mechanism kills instances (logged when the pool starts).
    pub fn describe(&self) -> String {
        match self {
            Containment::Cgroup(base) => format!("each instance's application runs in its own cgroup under {} and is killed whole with cgroup.kill", base.display()),
            Containment::Tree(why) => format!("{why}: an instance's application is killed by freezing and killing its process tree (a process that left the tree escapes)"),
        }
    }

    /// Makes the group `name` (a left-over one of the same name, from a run that crashed, is
    /// killed and removed first). `None` without cgroups.
    pub fn create(&self, name: &str) -> Result<Option<Group>, String> {
        let Containment::Cgroup(base) = self else {
            return Ok(None);
        };
        let dir = base.join(name);
        if dir.exists() {
            tracing::warn!(group = %dir.display(), "a group of this name is left from an earlier run: killing what is in it");
            kill_group(&dir, KILL_TIMEOUT)?;
        }
        std::fs::create_dir(&dir)
            .map_err(|e| format!("cannot create cgroup {}: {e}", dir.display()))?;
        let procs = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("cgroup.procs"))
            .map_err(|e| format!("cannot open {}/cgroup.procs: {e}", dir.display()))?;
        Ok(Some(Group {
            dir,
            procs: procs.into(),
        }))
    }
}

/// Runs `true` entering the group at `dir` at its spawn, as [`Group::enter_at_spawn`] does.
fn probe_entry(dir: &Path) -> Result<(), String> {
    use std::os::unix::process::CommandExt;
    let procs = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("cgroup.procs"))
        .map_err(|e| format!("cannot open {}/cgroup.procs: {e}", dir.display()))?;
    let fd = procs.as_raw_fd();
    let mut cmd = std::process::Command::new("true");
    cmd.stdin(std::process::Stdio::null());
    // SAFETY: as in `enter_at_spawn`: one write(2) on a descriptor the parent keeps open.
    unsafe {
        cmd.pre_exec(move || enter_own_group(fd));
    }
    let status = cmd
        .status()
        .map_err(|e| format!("a process cannot enter a group in {}: {e}", dir.display()))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("probing {}: `true` exited {status}", dir.display()))
    }
}

/// In a forked child before exec: moves the calling process into the group whose
/// `cgroup.procs` is open on `procs_fd` (writing `0` means "myself"). One write(2): safe to call
/// between fork and exec, where the child must not allocate or take locks.
fn enter_own_group(procs_fd: std::os::fd::RawFd) -> std::io::Result<()> {
    // SAFETY: writes one byte from a static buffer to a descriptor the caller keeps open.
    if unsafe { libc::write(procs_fd, b"0".as_ptr().cast(), 1) } == 1 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A freshly made group, ready to take the application at its spawn.
pub struct Group {
    pub dir: PathBuf,
    /// Its `cgroup.procs`, opened by the parent (the child must not allocate or open files).
    procs: OwnedFd,
}

impl Group {
    /// Makes `cmd`'s child enter this group before it execs: it writes `0` (itself) to the
    /// group's `cgroup.procs`, a descriptor the parent keeps open. A failure fails the spawn.
    pub fn enter_at_spawn(&self, cmd: &mut tokio::process::Command) {
        let fd = self.procs.as_raw_fd();
        // SAFETY: the closure runs in the forked child before exec and makes one
        // async-signal-safe system call (write) on a descriptor the parent keeps open until the
        // spawn returns (the group outlives the call).
        unsafe {
            cmd.pre_exec(move || enter_own_group(fd));
        }
    }
}

/// How long the processes of a killed group get to be gone.
pub const KILL_TIMEOUT: Duration = Duration::from_secs(15);

/// Whether the group at `dir` still holds a live process (`cgroup.events`: `populated 1`).
pub fn populated(dir: &Path) -> std::io::Result<bool> {
    let events = std::fs::read_to_string(dir.join("cgroup.events"))?;
    Ok(events.lines().any(|l| l == "populated 1"))
}

/// Live processes in the group at `dir` (empty when it is gone).
pub fn members(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Kills every process in the group at `dir` (`cgroup.kill`), waits up to `timeout` until it is
/// empty (`populated 0`), then removes it. A group that does not exist is already dead.
pub fn kill_group(dir: &Path, timeout: Duration) -> Result<(), String> {
    if !dir.exists() {
        return Ok(());
    }
    // A frozen group is killed too (SIGKILL wakes frozen tasks); thaw it anyway, so a kill
    // that fails to empty it does not leave it frozen.
    let _ = std::fs::write(dir.join("cgroup.freeze"), "0");
    match std::fs::write(dir.join("cgroup.kill"), "1") {
        Ok(()) => {}
        Err(_) if !dir.exists() => return Ok(()),
        Err(e) => {
            return Err(format!(
                "cannot kill cgroup {}: writing cgroup.kill: {e}",
                dir.display()
            ))
        }
    }
    let deadline = Instant::now() + timeout;
    loop {
        match populated(dir) {
            Ok(false) => break,
            Err(_) if !dir.exists() => return Ok(()),
            Err(e) => return Err(format!("cannot read {}/cgroup.events: {e}", dir.display())),
            Ok(true) if Instant::now() >= deadline => {
                return Err(format!(
                    "cgroup {} still holds processes {:?} {timeout:?} after cgroup.kill (stuck in the kernel?)",
                    dir.display(),
                    members(dir)
                ))
            }
            Ok(true) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    // Empty now; a removal can still meet a task the kernel has not quite let go of: retried.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                return Err(format!(
                    "cannot remove the emptied cgroup {}: {e}",
                    dir.display()
                ))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Freezes (or thaws) the group at `dir`.
pub fn freeze_group(dir: &Path, frozen: bool) -> Result<(), String> {
    std::fs::write(dir.join("cgroup.freeze"), if frozen { "1" } else { "0" }).map_err(|e| {
        format!(
            "cannot {} cgroup {}: {e}",
            if frozen { "freeze" } else { "thaw" },
            dir.display()
        )
    })
}

/// (pid, parent pid) of every live (not zombie) process.
fn process_table() -> Vec<(u32, u32)> {
    let mut v = vec![];
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut f = rest.split_whitespace();
        let (state, ppid) = (f.next(), f.next().and_then(|p| p.parse().ok()));
        if let (Some(s), Some(ppid)) = (state, ppid) {
            if s != "Z" && s != "X" {
                v.push((pid, ppid));
            }
        }
    }
    v
}

/// `root` (if alive) and its live descendants now, by parent pid.
pub fn tree(root: u32) -> BTreeSet<u32> {
    descendants(&process_table(), [root].into())
}

/// Those of `roots` alive in `table`, and their descendants in it.
fn descendants(table: &[(u32, u32)], roots: BTreeSet<u32>) -> BTreeSet<u32> {
    let mut found: BTreeSet<u32> = table
        .iter()
        .filter(|(p, _)| roots.contains(p))
        .map(|(p, _)| *p)
        .collect();
    loop {
        let n = found.len();
        found.extend(
            table
                .iter()
                .filter(|(p, pp)| found.contains(pp) && !found.contains(p))
                .map(|(p, _)| *p)
                .collect::<Vec<_>>(),
        );
        if found.len() == n {
            return found;
        }
    }
}

/// [`super::process::signal`] of one process.
fn signal(pid: u32, sig: libc::c_int) {
    super::process::signal(pid as libc::pid_t, sig)
}

/// The fallback kill: the tree of `root` SIGSTOPped until no new process appears in it (a
/// stopped process cannot fork; every pid once seen is kept, so one reparented meanwhile is not
/// lost), then every process seen SIGKILLed; repeated until none is left or `timeout` passes.
pub fn kill_tree(root: u32, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    let mut seen: BTreeSet<u32> = BTreeSet::new();
    loop {
        // Freeze: walk from the root and from every process seen so far.
        loop {
            let mut roots = seen.clone();
            roots.insert(root);
            let now = descendants(&process_table(), roots);
            let new: Vec<u32> = now.difference(&seen).copied().collect();
            for p in &new {
                signal(*p, libc::SIGSTOP);
            }
            seen.extend(new.iter().copied());
            if new.is_empty() {
                break;
            }
        }
        for p in &seen {
            signal(*p, libc::SIGKILL);
        }
        let left: Vec<u32> = seen
            .iter()
            .copied()
            .filter(|p| pid_alive(*p))
            .collect();
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "processes {left:?} of the tree of {root} still alive {timeout:?} after SIGKILL"
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
        seen.retain(|p| pid_alive(*p));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// A child that daemonizes (setsid, double fork) within its group: the group's kill
    /// reaches the grandchild, which the process group's SIGKILL would not.
    fn daemonizing() -> Command {
        let mut c = Command::new("sh");
        c.args([
            "-c",
            "setsid sh -c 'sleep 300 & sleep 300' & exec sleep 300",
        ]);
        c
    }

    #[test]
    fn a_group_is_killed_whole_however_its_processes_daemonize() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: making cgroups needs root");
            return;
        }
        let c = Containment::detect();
        eprintln!("{}", c.describe());
        let Containment::Cgroup(_) = &c else {
            eprintln!("skipped: no usable cgroup2 here");
            return;
        };
        let g = c
            .create(&format!("unit-test-{}", std::process::id()))
            .unwrap()
            .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let std_cmd = daemonizing();
            let mut cmd = tokio::process::Command::from(std_cmd);
            g.enter_at_spawn(&mut cmd);
            let mut child = cmd.spawn().unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            while members(&g.dir).len() < 3 {
                assert!(Instant::now() < deadline, "members: {:?}", members(&g.dir));
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let pids = members(&g.dir);
            kill_group(&g.dir, KILL_TIMEOUT).unwrap();
            assert!(!g.dir.exists());
            let _ = child.wait().await;
            let left: Vec<u32> = pids
                .into_iter()
                .filter(|p| pid_alive(*p))
                .collect();
            assert!(left.is_empty(), "alive after the group's kill: {left:?}");
        });
        // Killing a group that is gone is a no-op.
        kill_group(&g.dir, KILL_TIMEOUT).unwrap();
    }

    #[test]
    fn the_fallback_kills_the_whole_tree() {
        let mut child = Command::new("sh")
            .args([
                "-c",
                "sh -c 'sleep 300 & sleep 300' & sleep 300 & exec sleep 300",
            ])
            .spawn()
            .unwrap();
        let root = child.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        while tree(root).len() < 4 {
            assert!(Instant::now() < deadline, "tree: {:?}", tree(root));
            std::thread::sleep(Duration::from_millis(10));
        }
        let pids = tree(root);
        kill_tree(root, KILL_TIMEOUT).unwrap();
        let _ = child.wait();
        let left: Vec<u32> = pids
            .into_iter()
            .filter(|p| pid_alive(*p))
            .collect();
        assert!(left.is_empty(), "alive after the tree's kill: {left:?}");
    }
}
