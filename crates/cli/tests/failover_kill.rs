//! The pool's kill of an instance (a dead host) leaves nothing of it alive: PostgreSQL under
//! load, started as a failover instance through the pool (attach helper + application), is
//! killed; every process the instance had — the backends too, which PostgreSQL puts each in a
//! session of its own, out of the instance's process group — is gone within a short bound, and
//! the volume's loop device is detached. Needs root, /dev/fuse, losetup, mkfs.ext4 and
//! PostgreSQL; set UNDERSTUDY_SKIP_FUSE_TESTS=1 on a machine without them.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use failover::pool::{InstancePool, LocalPool, LocalPoolConfig};
use failover::pool::unit::Containment;
use failover::InstanceId;

fn skip() -> bool {
    if std::env::var_os("UNDERSTUDY_SKIP_FUSE_TESTS").is_some() {
        eprintln!("skipped: UNDERSTUDY_SKIP_FUSE_TESTS is set");
        return true;
    }
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "failover tests attach volumes: they need root (or UNDERSTUDY_SKIP_FUSE_TESTS=1)"
    );
    false
}

/// How long anything may take at most on a loaded machine (attach, mkfs, initdb, a kill).
const WAIT: Duration = Duration::from_secs(120);
/// How soon after the pool's kill returns no process of the instance may remain. A SIGKILLed
/// process is gone in milliseconds; the bug left backends alive for good.
const GONE_WITHIN: Duration = Duration::from_secs(2);

/// (pid, parent pid, command line) of every process.
fn process_table() -> Vec<(u32, u32, String)> {
    let mut v = vec![];
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let Some(ppid) = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().nth(1)?.parse().ok())
        else {
            continue;
        };
        let cmd =
            String::from_utf8_lossy(&std::fs::read(e.path().join("cmdline")).unwrap_or_default())
                .replace('\0', " ");
        v.push((pid, ppid, cmd.trim().to_string()));
    }
    v
}

/// CPU time process `pid` has used (utime + stime, clock ticks: /proc/PID/stat fields 14-15).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let f: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, r)| r)
        .split_whitespace()
        .collect();
    // After the command: state is field 3, so utime (14) and stime (15) are 11 and 12 here.
    f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

/// After a pause, how long the test lets it take hold; then how long it watches that nothing
/// runs, and how much CPU a process may still use meanwhile (clock ticks, usually 10 ms each:
/// a process finishing the I/O it was blocked in before it freezes). The busy backend alone
/// uses tens of ticks in PAUSE_WATCH when it runs, even on a loaded machine.
const PAUSE_SETTLE: Duration = Duration::from_millis(300);
const PAUSE_WATCH: Duration = Duration::from_millis(1000);
const PAUSED_TICKS: u64 = 2;

/// `root` and all its descendants now (by parent pid, as /proc shows them): pid → command line.
fn tree(root: u32) -> BTreeMap<u32, String> {
    let table = process_table();
    let mut found: BTreeMap<u32, String> = BTreeMap::new();
    if let Some((_, _, c)) = table.iter().find(|(p, _, _)| *p == root) {
        found.insert(root, c.clone());
    }
    loop {
        let before = found.len();
        for (p, pp, c) in &table {
            if found.contains_key(pp) && !found.contains_key(p) {
                found.insert(*p, c.clone());
            }
        }
        if found.len() == before {
            return found;
        }
    }
}

/// Loop devices whose backing file is a FUSE file of attach helper `pid`.
fn loops_of(pid: u32) -> Vec<String> {
    failover::pool::teardown::loops(pid)
        .iter()
        .map(|p| p.display().to_string())
        .collect()
}

/// Whatever the test left (it failed half-way): the instance's cgroup killed and removed,
/// every process it saw SIGKILLed by pid, then the helper's stack taken down in the order that
/// cannot wedge the kernel.
struct Guard {
    pids: Vec<u32>,
    helper: u32,
    mount: PathBuf,
    group: Option<PathBuf>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(g) = &self.group {
            if let Err(e) = failover::pool::unit::kill_group(g, failover::pool::unit::KILL_TIMEOUT) {
                eprintln!("clean-up: {e}");
            }
        }
        for p in &self.pids {
            if *p != self.helper && failover::pool::pid_alive(*p) {
                failover::pool::process::signal(*p as i32, libc::SIGKILL);
            }
        }
        failover::pool::process::wait_gone(
            &self
                .pids
                .iter()
                .copied()
                .filter(|p| *p != self.helper)
                .collect::<Vec<_>>(),
            Duration::from_secs(10),
        );
        if self.helper != 0 {
            let r = if failover::pool::pid_alive(self.helper) {
                failover::pool::teardown::take_down_helper(self.helper, Some(&self.mount))
            } else {
                failover::pool::teardown::take_down_dead_helper(self.helper, Some(&self.mount))
            };
            if let Err(e) = r {
                eprintln!("clean-up of helper {}: {e}", self.helper);
            }
        }
    }
}

async fn pg(addr: std::net::SocketAddr) -> failover::pg::PgConn {
    failover::pg::PgConn::connect(addr, "postgres", "postgres", Duration::from_secs(10))
        .await
        .expect("connect to postgres")
}

/// Waits until postgres at `addr` answers a query.
async fn wait_ready(addr: std::net::SocketAddr, log: &Path) {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Ok(mut c) =
            failover::pg::PgConn::connect(addr, "postgres", "postgres", Duration::from_secs(2))
                .await
        {
            if c.query("SELECT 1").await.is_ok() {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "postgres not ready within {WAIT:?}: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts instance `id` of `pool` on `volume` (PostgreSQL), loads it, kills it through the
/// pool and checks that no process it had is left and that its loop device is detached.
async fn kill_under_load(pool: &LocalPool, id: InstanceId, volume: &str, guard: &mut Guard) {
    eprintln!("{id}: {}", pool.containment().describe());
    let t = Instant::now();
    let addr = tokio::time::timeout(WAIT, pool.start(id, volume))
        .await
        .expect("start within WAIT")
        .expect("start");
    let (app_pid, helper) = pool.pids(id).unwrap();
    guard.helper = helper;
    wait_ready(addr, &pool.log_file(id)).await;
    eprintln!("{id} up in {:?}", t.elapsed());

    // Load: a table, writers committing in a busy loop, one writer inside a long open
    // transaction, one backend sleeping in a long query, one busy in another.
    let mut c = pg(addr).await;
    c.query("CREATE TABLE IF NOT EXISTS t (id bigserial PRIMARY KEY, v text)")
        .await
        .unwrap();
    let commits = Arc::new(AtomicU64::new(0));
    let mut tasks = vec![];
    for w in 0..4 {
        let commits = commits.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = pg(addr).await;
            while c
                .query(&format!("INSERT INTO t (v) VALUES ('writer {w}')"))
                .await
                .is_ok()
            {
                commits.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    tasks.push(tokio::spawn(async move {
        let mut c = pg(addr).await;
        let _ = c.query("BEGIN").await;
        let _ = c
            .query("INSERT INTO t (v) SELECT 'bulk' FROM generate_series(1, 1000)")
            .await;
        let _ = c.query("SELECT pg_sleep(60)").await;
    }));
    tasks.push(tokio::spawn(async move {
        let mut c = pg(addr).await;
        let _ = c.query("SELECT pg_sleep(60)").await;
    }));
    // A long query that never looks whether its postmaster lives (a backend notices the
    // postmaster's death only where it waits: a busy loop runs on with ppid 1).
    tasks.push(tokio::spawn(async move {
        let mut c = pg(addr).await;
        let _ = c.query("DO $$ DECLARE i bigint := 0; BEGIN WHILE i < 100000000000 LOOP i := i + 1; END LOOP; END $$").await;
    }));
    let deadline = Instant::now() + WAIT;
    while commits.load(Ordering::Relaxed) < 50 {
        assert!(
            Instant::now() < deadline,
            "the load did not commit 50 rows within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Every process of the instance now: the application's tree, backends included.
    let before = tree(app_pid);
    guard.pids = before.keys().copied().collect();
    let backends = before
        .values()
        .filter(|c| c.contains("postgres: postgres postgres"))
        .count();
    eprintln!(
        "{id}: processes before the kill ({} commits): {before:#?}",
        commits.load(Ordering::Relaxed)
    );
    assert!(
        backends >= 7,
        "expected 7 client backends under load, saw {backends}: {before:#?}"
    );
    // With a cgroup, every one of them is in the instance's group.
    if let Some(g) = pool.group_dir(id) {
        let members = failover::pool::unit::members(&g);
        let outside: Vec<&u32> = before.keys().filter(|p| !members.contains(p)).collect();
        assert!(
            outside.is_empty(),
            "{id}: processes outside {}: {outside:?}",
            g.display()
        );
    }
    let devices = loops_of(helper);
    assert!(
        !devices.is_empty(),
        "the volume is attached through a loop device"
    );

    // Paused first (a host that stopped answering): no process of it runs — the busy backend
    // included — while it is paused (one blocked in I/O stays blocked: its disk's server is
    // stopped too). Then killed so, paused.
    pool.pause(id, true).unwrap();
    tokio::time::sleep(PAUSE_SETTLE).await;
    let cpu_before: Vec<(u32, u64)> = before.keys().map(|p| (*p, cpu_ticks(*p))).collect();
    tokio::time::sleep(PAUSE_WATCH).await;
    let ran: Vec<(u32, u64, &String)> = cpu_before
        .iter()
        .map(|(p, t)| (*p, cpu_ticks(*p).saturating_sub(*t), &before[p]))
        .filter(|(_, d, _)| *d > PAUSED_TICKS)
        .collect();
    assert!(
        ran.is_empty(),
        "{id}: processes ran while the instance was paused (pid, clock ticks in {PAUSE_WATCH:?}, command): {ran:#?}"
    );

    let t = Instant::now();
    let killed = tokio::time::timeout(WAIT, pool.kill(id))
        .await
        .expect("kill within WAIT");
    eprintln!("{id}: pool kill took {:?}: {killed:?}", t.elapsed());
    let t = Instant::now();
    let mut left: Vec<(u32, String)>;
    loop {
        left = before
            .iter()
            .filter(|(p, _)| failover::pool::pid_alive(**p))
            .map(|(p, c)| (*p, c.clone()))
            .collect();
        if left.is_empty() || t.elapsed() > GONE_WITHIN {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        left.is_empty(),
        "{} processes of the killed instance still alive {GONE_WITHIN:?} after the kill returned: {left:#?}",
        left.len()
    );
    killed.expect("the pool's kill succeeds");
    assert!(
        !failover::pool::pid_alive(helper),
        "the attach helper is gone after the kill"
    );
    // By device, not by backing file: its path changes once the FUSE mount behind it goes.
    let attached: Vec<&String> = devices
        .iter()
        .filter(|d| {
            Path::new(&format!(
                "/sys/block/{}/loop/backing_file",
                d.trim_start_matches("/dev/")
            ))
            .exists()
        })
        .collect();
    assert!(
        attached.is_empty(),
        "loop devices still attached after the kill: {attached:?}"
    );
    assert!(
        !failover::pool::teardown::is_mountpoint(&guard.mount),
        "{} still mounted after the kill",
        guard.mount.display()
    );
    if let Containment::Cgroup(base) = pool.containment() {
        let groups: Vec<String> = std::fs::read_dir(base)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(pool.netns_tag()))
            .collect();
        assert!(groups.is_empty(), "cgroups left after the kill: {groups:?}");
    }
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
    }
    guard.pids.clear();
}

/// PostgreSQL under load killed through the pool: first with the containment this machine
/// offers (a cgroup each where cgroup2 is usable), then, on the same volume, with the fallback
/// (the process tree frozen and killed).
#[test]
fn killing_a_postgres_instance_under_load_leaves_no_process_and_detaches_its_loop() {
    if skip() {
        return;
    }
    let up = Up::start(3);
    // PostgreSQL runs unprivileged: it must reach its data on the mount under this directory.
    std::fs::set_permissions(
        up.dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    up.ok(&["volume", "create", "pgkill", "--size", "256M"]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let tree_fallback = Containment::Tree("the test asks for the fallback".into());
    for (id, containment) in [
        (InstanceId(1), Containment::detect()),
        (InstanceId(2), tree_fallback),
    ] {
        let state = tempfile::Builder::new()
            .prefix("failover-kill-")
            .tempdir_in(up.dir.path())
            .unwrap();
        let state_dir = state.path().canonicalize().unwrap();
        let cfg = LocalPoolConfig {
            exe: BIN.into(),
            conn_args: vec![
                "--cluster".into(),
                up.cluster_file().to_string_lossy().into_owned(),
            ],
            state_dir: state_dir.clone(),
            app: failover::spec::AppSpec {
                command: [
                    BIN,
                    "failover",
                    "postgres",
                    "--data",
                    "{mount}/pgdata",
                    "--port",
                    "{port}",
                ]
                .iter()
                .map(|s| s.to_string())
                .collect(),
                env: Default::default(),
                stop_grace_ms: 5000,
            },
            // The first instance makes the file system; the second finds PostgreSQL's data.
            mkfs_first: true,
            attach_timeout: WAIT,
            netns: false,
        };
        let (tx, _rx) = tokio::sync::mpsc::channel(64);
        let mut guard = Guard {
            pids: vec![],
            helper: 0,
            mount: state_dir.join("mnt").join(id.to_string()),
            group: None,
        };
        rt.block_on(async {
            let pool = LocalPool::with_containment(cfg, tx, containment).unwrap();
            guard.group = pool.group_dir(id);
            kill_under_load(&pool, id, "pgkill", &mut guard).await;
        });
    }
}

/// `volume detach` after its helper died (killed with its disk fenced, as the pool kills an
/// instance) while a process still holds the file system: `losetup -d` of a held loop device
/// only marks it for autoclear and succeeds, so detach must wait until the device is released,
/// or fail saying why and leave what a second detach needs — not report "detached" with the
/// device still attached.
#[test]
fn detach_after_a_dead_helper_succeeds_only_once_the_loop_device_is_released() {
    if skip() {
        return;
    }
    let up = Up::start(3);
    up.ok(&["volume", "create", "held", "--size", "64M"]);
    let mnt = up.dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mnt = mnt.canonicalize().unwrap();
    let m = mnt.to_string_lossy().into_owned();
    let out = up.ok(&["volume", "attach", "held", "--mount", &m, "--mkfs"]);
    assert!(out.starts_with("attached held"), "{out}");
    let helper = process_table()
        .into_iter()
        .find(|(_, _, c)| c.contains(" attach ") && c.contains(&format!("--mount {m}")))
        .map(|(p, _, _)| p)
        .expect("the attach helper runs");
    // A process working in the file system holds it (and so the loop device) after any unmount.
    let mut holder = std::process::Command::new("sleep")
        .arg("300")
        .current_dir(&mnt)
        .spawn()
        .unwrap();
    let mut guard = Guard {
        pids: vec![holder.id()],
        helper,
        mount: mnt.clone(),
        group: None,
    };
    let dev = loops_of(helper);
    assert_eq!(dev.len(), 1, "one loop device: {dev:?}");
    let sys = format!("/sys/block/{}/loop", dev[0].trim_start_matches("/dev/"));
    // Attached while sysfs shows its backing file (whose path changes once the FUSE mount
    // behind it is unmounted, so it is not matched by name).
    let attached = || {
        std::fs::read_to_string(format!("{sys}/backing_file"))
            .ok()
            .map(|b| format!("{} -> {}", dev[0], b.trim()))
    };
    // The helper dies as the pool's kill leaves it: its FUSE connection aborted first.
    failover::pool::teardown::abort_fuse(helper).unwrap();
    failover::pool::process::signal(helper as i32, libc::SIGKILL);
    assert!(failover::pool::process::wait_gone(
        &[helper],
        Duration::from_secs(10)
    ));

    let detach = || {
        let mut c = std::process::Command::new(BIN);
        c.args(["volume", "--cluster"])
            .arg(up.cluster_file())
            .args(["detach", &m])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        c.spawn().unwrap()
    };
    let finish = |c: std::process::Child| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(c.wait_with_output().unwrap()));
        rx.recv_timeout(WAIT).expect("detach finishes within WAIT")
    };

    // While the holder holds the device, detach cannot succeed: it says why and keeps what
    // it needs to finish later.
    let t = Instant::now();
    let out = finish(detach());
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let left = attached();
    eprintln!(
        "detach while held: {} after {:?}: {}; loop device then: {left:?}",
        out.status,
        t.elapsed(),
        err.trim()
    );
    assert!(
        !out.status.success(),
        "`volume detach` exited {} while {left:?} stays attached (held by pid {})",
        out.status,
        holder.id()
    );
    assert!(
        left.is_some() && err.contains("still attached") && err.contains("run detach again"),
        "{err}"
    );

    // Run again, it waits; the holder lets go meanwhile (HELD, after detach started): it
    // succeeds once the device is released, and not before.
    const HELD: Duration = Duration::from_secs(2);
    let mut again = detach();
    let t = Instant::now();
    while t.elapsed() < HELD {
        if let Some(st) = again.try_wait().unwrap() {
            let left = attached();
            assert!(
                !st.success() || left.is_none(),
                "`volume detach` exited {st} while {left:?} stays attached"
            );
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = holder.kill();
    let _ = holder.wait();
    let out = finish(again);
    let left = attached();
    assert!(
        out.status.success(),
        "detach failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        left.is_none(),
        "`volume detach` succeeded with {left:?} still attached"
    );
    assert!(
        !failover::pool::teardown::is_mountpoint(&mnt),
        "{m} still mounted"
    );
    let err = up.fails(&["volume", "detach", &m]);
    assert!(err.contains("nothing is attached"), "{err}");
    guard.pids.clear();
}
