//! [`LocalPool`]: the instance pool of local processes. Each instance runs as its own process
//! group, like a small host: the `understudy volume attach --foreground` helper that serves the
//! instance's volume as ext4 at its own mount point, and the application itself. Each instance
//! is reached through its own network link, which a fault can cut: with network namespaces
//! ([`crate::netns`]) the application runs in its own namespace behind a veth pair and a cut
//! takes the link down (the volume, served from the host, stays attached); without, the link is
//! a [`Proxy`] the pool owns and a cut points it nowhere. The application runs as a unit that
//! dies whole ([`crate::pool::unit`]: its own cgroup, or its process tree without cgroup2),
//! since a process group is not one (PostgreSQL starts every backend in a session of its own).
//! An instance can be paused (its application's group frozen, the helper SIGSTOPped) or killed
//! (its disk fenced, every process of its application SIGKILLed, with no flush: dirty pages
//! never reach the volume).
//!
//! Starting an instance is in [`start`]; adopting or reaping what a previous run of the monitor
//! left, in [`adopt`]; stopping, killing and the instance table, here.

mod adopt;
mod start;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::process::{ChildStdout, Command};
use tokio::sync::mpsc;

use crate::proto::{now_unix_ms, InstanceId, Input};
use crate::endpoint::Proxy;
use crate::netns::{self, NetnsLink};
use crate::pool::process::{self, pid_alive, start_time};
use crate::pool::teardown;
use crate::pool::unit::{self, Containment};
use crate::spec::AppSpec;

use super::{InstancePool, PoolError, StartTiming};

#[derive(Clone, Debug)]
pub struct LocalPoolConfig {
    /// The `understudy` executable (for `volume attach` / `volume detach`).
    pub exe: PathBuf,
    /// Arguments that find the cluster, e.g. `["--cluster", "/data/cluster.json"]`.
    pub conn_args: Vec<String>,
    /// Mount points (`mnt/iN`) and logs (`logs/iN.log`, `logs/iN.attach.log`) live here.
    pub state_dir: PathBuf,
    pub app: AppSpec,
    /// `--mkfs` for the first instance's attach.
    pub mkfs_first: bool,
    /// How long attaching may take.
    pub attach_timeout: Duration,
    /// Each application in its own network namespace (resolved: see [`netns::resolve`]).
    pub netns: bool,
}

/// What `instances.json` keeps of an instance, so a restarted monitor adopts the instances its
/// previous run left running (a monitor crash is not an instance crash).
#[derive(serde::Serialize, serde::Deserialize, Clone, Debug)]
struct SavedInst {
    id: InstanceId,
    pgid: i32,
    app_pid: u32,
    app_start: u64,
    attach_pid: u32,
    attach_start: u64,
    app_port: u16,
    mount: PathBuf,
    /// The application's own process group (0 in records of runs that kept the application
    /// in the helper's group).
    #[serde(default)]
    app_pgid: i32,
    /// Its network namespace, when it has one.
    #[serde(default)]
    netns: Option<NetnsLink>,
}

#[derive(serde::Serialize, serde::Deserialize, Default, Debug)]
struct SavedPool {
    instances: Vec<SavedInst>,
    killed: Vec<InstanceId>,
    /// Starts under way: the attach helper runs (its pid and process group are known) but the
    /// instance is not serving yet. A monitor that crashed here leaves a helper nobody adopts;
    /// the next run reaps it (group SIGKILL, then umount / `losetup -d` / FUSE unmount).
    #[serde(default)]
    starting: Vec<SavedInst>,
}

/// How an instance is reached, and cut off.
enum Link {
    /// Host network: a proxy the pool owns in front of the application's port.
    Proxy { proxy: Proxy, app_addr: SocketAddr },
    /// Own namespace: the application at its namespace address, behind a veth pair.
    Netns { link: NetnsLink, addr: SocketAddr },
}

impl Link {
    fn address(&self) -> SocketAddr {
        match self {
            Link::Proxy { proxy, .. } => proxy.local_addr(),
            Link::Netns { addr, .. } => *addr,
        }
    }

    fn cut(&self, cut: bool) -> Result<(), String> {
        match self {
            Link::Proxy { proxy, app_addr } => {
                proxy.point(if cut { None } else { Some(*app_addr) });
                Ok(())
            }
            Link::Netns { link, .. } => netns::set_link(link, !cut).map_err(|e| e.to_string()),
        }
    }

    /// Closes the way in at once (the instance is being killed or stopped).
    fn sever(&self) {
        if let Link::Proxy { proxy, .. } = self {
            proxy.point(None);
        }
    }

    fn netns(&self) -> Option<&NetnsLink> {
        match self {
            Link::Netns { link, .. } => Some(link),
            Link::Proxy { .. } => None,
        }
    }
}

struct Inst {
    /// The application's cgroup (see [`crate::pool::unit`]); `None` without cgroup2.
    cgroup: Option<PathBuf>,
    timing: StartTiming,
    saved: SavedInst,
    pgid: i32,
    app_pid: u32,
    /// The application's own process group.
    app_pgid: i32,
    attach_pid: u32,
    link: Link,
    mount: PathBuf,
    /// Set before we kill or stop it, so the exit is not reported as a failure.
    expected_exit: Arc<AtomicBool>,
    _attach_stdout: Option<ChildStdout>,
}

/// The namespace made ahead for the instance that would start next (being made: `None`).
type Spare = Option<(InstanceId, Option<NetnsLink>)>;

pub struct LocalPool {
    cfg: LocalPoolConfig,
    /// Names this pool's namespaces (`usfo-TAG-iN`), from its state directory.
    tag: String,
    insts: Mutex<HashMap<InstanceId, Inst>>,
    /// Starts under way (see [`SavedPool::starting`]).
    starting: Mutex<HashMap<InstanceId, SavedInst>>,
    killed: Mutex<HashSet<InstanceId>>,
    events: mpsc::Sender<Input>,
    /// A namespace made ahead for the instance to be started next (see [`LocalPool::prewarm`]).
    /// `None` in the link: being made.
    spare: Arc<Mutex<Spare>>,
    /// One lock per instance: its start, kill, stop and crash never overlap (a fault injected
    /// while the monitor fences the same instance, say).
    ops: Mutex<HashMap<InstanceId, Arc<tokio::sync::Mutex<()>>>>,
    /// How applications are contained and killed whole (a cgroup each, or their process tree).
    containment: Containment,
    /// Where an instance's proxy link listens without namespaces: loopback for a monitor that
    /// runs its instances itself; the host's address under a failover agent, whose instances
    /// the monitor and the endpoints reach from other hosts.
    link_ip: std::net::IpAddr,
}

/// Signals process group `pgid`.
fn signal_group(pgid: i32, sig: libc::c_int) {
    process::signal(-pgid, sig)
}

fn signal_pid(pid: u32, sig: libc::c_int) {
    process::signal(pid as libc::pid_t, sig)
}

/// Deadline of `understudy volume detach` (the helper's own detach waits up to 120 s).
const DETACH_TIMEOUT: Duration = Duration::from_secs(150);

impl LocalPool {
    pub fn new(cfg: LocalPoolConfig, events: mpsc::Sender<Input>) -> std::io::Result<LocalPool> {
        Self::with_containment(cfg, events, Containment::detect())
    }

    /// [`LocalPool::new`] with the given way of killing applications whole (tests use the
    /// fallback on a machine that has cgroup2).
    pub fn with_containment(cfg: LocalPoolConfig, events: mpsc::Sender<Input>, containment: Containment) -> std::io::Result<LocalPool> {
        std::fs::create_dir_all(cfg.state_dir.join("mnt"))?;
        std::fs::create_dir_all(cfg.state_dir.join("logs"))?;
        let tag = netns::tag_for(&cfg.state_dir);
        if cfg.netns {
            // Namespaces crashed runs left behind (nothing lives in them any more). Those of
            // instances a previous run of this monitor left running hold processes: kept.
            match netns::sweep_stale(None) {
                Ok(gone) if !gone.is_empty() => tracing::info!(?gone, "removed stale network namespaces"),
                Ok(_) => {}
                Err(e) => tracing::warn!("sweeping stale network namespaces: {e}"),
            }
            // Tests and tools find this pool's namespaces by this tag.
            std::fs::write(cfg.state_dir.join("netns.tag"), &tag)?;
        }
        match &containment {
            Containment::Cgroup(_) => tracing::info!("{}", containment.describe()),
            Containment::Tree(_) => tracing::warn!("{}", containment.describe()),
        }
        Ok(LocalPool {
            cfg,
            tag,
            insts: Mutex::new(HashMap::new()),
            starting: Mutex::new(HashMap::new()),
            killed: Mutex::new(HashSet::new()),
            events,
            spare: Arc::default(),
            ops: Mutex::default(),
            containment,
            link_ip: std::net::Ipv4Addr::LOCALHOST.into(),
        })
    }

    /// Instances' proxy links listen on `ip` (see [`LocalPool::link_ip`]) rather than loopback.
    pub fn with_link_ip(mut self, ip: std::net::IpAddr) -> LocalPool {
        self.link_ip = ip;
        self
    }

    /// Where instances' proxy links listen (when they run without namespaces).
    pub fn link_ip(&self) -> std::net::IpAddr {
        self.link_ip
    }

    /// How this pool kills an instance's application whole.
    pub fn containment(&self) -> &Containment {
        &self.containment
    }

    /// The name of instance `id`'s cgroup: fixed, so a run finds what a crashed one left.
    fn group_name(&self, id: InstanceId) -> String {
        format!("{}-{id}", self.tag)
    }

    /// Instance `id`'s cgroup, if this pool uses cgroups.
    pub fn group_dir(&self, id: InstanceId) -> Option<PathBuf> {
        match &self.containment {
            Containment::Cgroup(base) => Some(base.join(self.group_name(id))),
            Containment::Tree(_) => None,
        }
    }

    /// Makes the network namespace of instance `id` (the next one the monitor will start) ahead
    /// of time, in the background, so a failover does not wait for the `ip` commands that set
    /// one up. Any other spare is deleted. Without namespaces, or when `id` already runs or has
    /// its spare, nothing happens. Every decision about a spare is taken under the namespace
    /// lock ([`netns::lock`]), so a start and a pre-make of the same instance never race; a
    /// spare that a concurrent sweep removed is simply made again when the instance starts.
    pub fn prewarm(&self, id: InstanceId) {
        if !self.cfg.netns || self.insts.lock().unwrap().contains_key(&id) || self.killed.lock().unwrap().contains(&id) {
            return;
        }
        let old = {
            let mut g = self.spare.lock().unwrap();
            if g.as_ref().is_some_and(|(s, _)| *s == id) {
                return;
            }
            g.replace((id, None))
        };
        let name = netns::name_for(&self.tag, &id.to_string());
        let spare = self.spare.clone();
        tokio::task::spawn_blocking(move || {
            let Ok(l) = netns::lock() else { return };
            if let Some((_, Some(link))) = old {
                let _ = netns::delete(&link.name);
            }
            // Still wanted? (A start of `id` may have taken over, or another id been asked for.)
            if *spare.lock().unwrap() != Some((id, None)) {
                return;
            }
            match netns::create(&name, &l) {
                Ok(link) => *spare.lock().unwrap() = Some((id, Some(link))),
                Err(e) => {
                    tracing::debug!("pre-making {name}: {e}");
                    let mut g = spare.lock().unwrap();
                    if *g == Some((id, None)) {
                        *g = None;
                    }
                }
            }
        });
    }

    /// Deletes the spare namespace, if any (the pool is shutting down).
    fn drop_spare(&self) {
        let _l = netns::lock();
        if let Some((_, Some(l))) = self.spare.lock().unwrap().take() {
            let _ = netns::delete(&l.name);
        }
    }

    /// The tag in this pool's namespace names (`usfo-TAG-iN`).
    pub fn netns_tag(&self) -> &str {
        &self.tag
    }

    /// The network namespace of an instance, if it runs in one.
    pub fn netns(&self, id: InstanceId) -> Option<NetnsLink> {
        self.insts.lock().unwrap().get(&id).and_then(|i| i.link.netns().cloned())
    }

    fn saved_path(&self) -> PathBuf {
        self.cfg.state_dir.join("instances.json")
    }

    /// Writes `instances.json` (atomically) after every change.
    fn save(&self) {
        let saved = SavedPool {
            instances: self.insts.lock().unwrap().values().map(|i| i.saved.clone()).collect(),
            killed: self.killed.lock().unwrap().iter().copied().collect(),
            starting: self.starting.lock().unwrap().values().cloned().collect(),
        };
        let path = self.saved_path();
        let tmp = path.with_extension("tmp");
        let r = std::fs::write(&tmp, serde_json::to_vec_pretty(&saved).expect("serialisable")).and_then(|_| std::fs::rename(&tmp, &path));
        if let Err(e) = r {
            tracing::error!("cannot write {}: {e}", path.display());
        }
    }

    pub fn mount_dir(&self, id: InstanceId) -> PathBuf {
        self.cfg.state_dir.join("mnt").join(id.to_string())
    }

    pub fn log_file(&self, id: InstanceId) -> PathBuf {
        self.cfg.state_dir.join("logs").join(format!("{id}.log"))
    }

    /// Where the start of a running instance went (default for an adopted one).
    pub fn start_timing(&self, id: InstanceId) -> Option<StartTiming> {
        self.insts.lock().unwrap().get(&id).map(|i| i.timing.clone())
    }

    /// Process ids of an instance: (application, attach helper).
    pub fn pids(&self, id: InstanceId) -> Option<(u32, u32)> {
        self.insts.lock().unwrap().get(&id).map(|i| (i.app_pid, i.attach_pid))
    }

    pub fn instances(&self) -> Vec<InstanceId> {
        let mut v: Vec<_> = self.insts.lock().unwrap().keys().copied().collect();
        v.sort();
        v
    }

    async fn detach(&self, mount: &Path) -> Result<(), String> {
        let run = Command::new(&self.cfg.exe)
            .arg("volume")
            .args(&self.cfg.conn_args)
            .arg("detach")
            .arg(mount)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(DETACH_TIMEOUT, run)
            .await
            .map_err(|_| format!("`volume detach {}` did not finish within {DETACH_TIMEOUT:?}", mount.display()))?
            .map_err(|e| format!("cannot run {}: {e}", self.cfg.exe.display()))?;
        let err = String::from_utf8_lossy(&out.stderr);
        if out.status.success() || err.contains("nothing is attached") {
            Ok(())
        } else {
            Err(err.trim().to_string())
        }
    }

    async fn wait_gone(pids: &[u32], timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while pids.iter().any(|p| pid_alive(*p)) {
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    /// Clean stop of every instance (the monitor shutting down).
    pub async fn stop_all(&self) {
        self.drop_spare();
        for id in self.instances() {
            if let Err(e) = self.stop(id).await {
                tracing::warn!("stopping {id}: {e}");
            }
        }
    }
}

impl InstancePool for LocalPool {
    async fn start(&self, id: InstanceId, volume: &str) -> Result<SocketAddr, PoolError> {
        let lock = self.op_lock(id);
        let _g = lock.lock().await;
        if self.killed.lock().unwrap().contains(&id) {
            return Err(PoolError::Killed(id));
        }
        let existing = self.insts.lock().unwrap().get(&id).map(|i| (i.link.address(), i.app_pid));
        if let Some((addr, pid)) = existing {
            if pid_alive(pid) {
                return Ok(addr);
            }
            // It died: clean up, then start it again (a restart of the same instance).
            self.kill_inner(id).await?;
        }
        self.start_inner(id, volume).await
    }

    async fn kill(&self, id: InstanceId) -> Result<(), PoolError> {
        let lock = self.op_lock(id);
        let _g = lock.lock().await;
        self.killed.lock().unwrap().insert(id);
        self.save();
        let r = self.kill_inner(id).await;
        self.save();
        r
    }

    async fn stop(&self, id: InstanceId) -> Result<(), PoolError> {
        let lock = self.op_lock(id);
        let _g = lock.lock().await;
        let Some((pgid, app_pgid, app_pid, app_start, attach_pid, mount, flag, cgroup)) = self.teardown_handles(id)
        else {
            return Ok(());
        };
        flag.store(true, Ordering::SeqCst);
        if let Some(d) = &cgroup {
            let _ = unit::freeze_group(d, false);
        }
        signal_group(pgid, libc::SIGCONT);
        signal_group(app_pgid, libc::SIGCONT);
        signal_pid(app_pid, libc::SIGTERM);
        Self::wait_gone(&[app_pid], Duration::from_millis(self.cfg.app.stop_grace_ms)).await;
        // Whatever is left of the application (all of it after the grace, or a process it
        // left behind) dies now: nothing may hold the file system the helper unmounts.
        let killed = kill_app(cgroup, app_pgid, app_pid, app_start).await;
        // The helper unmounts (a clean unmount: everything flushed) and exits.
        let mut r = killed.and(self.detach(&mount).await);
        if !Self::wait_gone(&[attach_pid], teardown::EXIT_TIMEOUT).await {
            // It did not: take the stack down from here, the helper last.
            let t = take_down(attach_pid, true, &mount).await;
            r = r.and(t);
        }
        if let Some(i) = self.insts.lock().unwrap().remove(&id) {
            i.link.sever();
            Self::drop_netns(&i.link);
        }
        self.save();
        r.map_err(|msg| PoolError::Io { id, msg: format!("detach after clean stop: {msg}") })
    }

    fn pause(&self, id: InstanceId, paused: bool) -> Result<(), PoolError> {
        let g = self.insts.lock().unwrap();
        let i = g.get(&id).ok_or(PoolError::Unknown(id))?;
        // The whole host: the application (every process of it: its group frozen) and the
        // server of its disk.
        let sig = if paused { libc::SIGSTOP } else { libc::SIGCONT };
        match &i.cgroup {
            Some(d) => unit::freeze_group(d, paused).map_err(|msg| PoolError::Io { id, msg })?,
            // Without one, its process tree (while the application is the recorded process).
            None if start_time(i.app_pid) == Some(i.saved.app_start) => unit::tree(i.app_pid).into_iter().for_each(|p| signal_pid(p, sig)),
            None => {}
        }
        signal_group(i.app_pgid, sig);
        signal_group(i.pgid, sig);
        Ok(())
    }

    fn cut(&self, id: InstanceId, cut: bool) -> Result<(), PoolError> {
        let g = self.insts.lock().unwrap();
        let i = g.get(&id).ok_or(PoolError::Unknown(id))?;
        i.link.cut(cut).map_err(|msg| PoolError::Io { id, msg })
    }

    fn address(&self, id: InstanceId) -> Option<SocketAddr> {
        self.insts.lock().unwrap().get(&id).map(|i| i.link.address())
    }
}

impl LocalPool {
    /// Deletes an instance's namespace once its processes are gone (its veth goes with it).
    fn drop_netns(link: &Link) {
        if let Some(l) = link.netns() {
            if let Err(e) = netns::delete(&l.name) {
                tracing::warn!("deleting {}: {e}", l.name);
            }
        }
    }

    /// Fences and kills an instance as a crash would, then detaches its volume: its FUSE
    /// connection aborted first (nothing it leaves in the page cache reaches the volume), the
    /// application's group SIGKILLed, the stack taken down with the helper last
    /// ([`teardown::take_down_helper`]). An error (a loop device that does not let go) leaves
    /// the instance recorded: the core retries the kill.
    async fn kill_inner(&self, id: InstanceId) -> Result<(), PoolError> {
        let Some((pgid, app_pgid, app_pid, app_start, attach_pid, mount, flag, cgroup)) = self.teardown_handles(id)
        else {
            // Unknown (never started here, or already gone): make sure nothing is mounted.
            let mount = self.mount_dir(id);
            if mount.exists() {
                self.detach(&mount).await.map_err(|msg| PoolError::Io { id, msg })?;
            }
            return Ok(());
        };
        flag.store(true, Ordering::SeqCst);
        if let Some(i) = self.insts.lock().unwrap().get(&id) {
            i.link.sever();
        }
        // A paused helper must run again to let its stack go.
        signal_group(pgid, libc::SIGCONT);
        self.fence_and_kill_app(id, attach_pid, cgroup, app_pgid, app_pid, app_start).await?;
        take_down(attach_pid, true, &mount).await.map_err(|msg| PoolError::Io { id, msg: format!("taking the volume down after the kill: {msg}") })?;
        // Its state file: the helper is gone, so `detach` only removes what is left of it.
        if let Err(e) = self.detach(&mount).await {
            tracing::warn!(%id, "detach after kill: {e}");
        }
        if let Some(i) = self.insts.lock().unwrap().remove(&id) {
            Self::drop_netns(&i.link);
        }
        tracing::info!(%id, "instance killed and its volume detached");
        Ok(())
    }

    /// The crash itself: the helper's FUSE connection aborted (the instance's disk is gone:
    /// nothing more reaches the volume), then every process of the application SIGKILLed
    /// ([`kill_app`]), waited for until none is left.
    async fn fence_and_kill_app(&self, id: InstanceId, attach_pid: u32, cgroup: Option<PathBuf>, app_pgid: i32, app_pid: u32, app_start: u64) -> Result<(), PoolError> {
        match tokio::task::spawn_blocking(move || teardown::abort_fuse(attach_pid)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(%id, "fencing the volume: {e}; killing without the fence"),
            Err(e) => tracing::warn!(%id, "fencing the volume: {e}"),
        }
        kill_app(cgroup, app_pgid, app_pid, app_start).await.map_err(|msg| PoolError::Io { id, msg })?;
        if !Self::wait_gone(&[app_pid], teardown::EXIT_TIMEOUT).await {
            return Err(PoolError::Io { id, msg: format!("application (pid {app_pid}) still alive {:?} after SIGKILL", teardown::EXIT_TIMEOUT) });
        }
        Ok(())
    }

    /// Fault injection: the instance crashes as a host would (its disk fenced, its application
    /// SIGKILLed, no flush). The helper stays, fenced, until the monitor kills the instance.
    pub async fn crash(&self, id: InstanceId) -> Result<(), PoolError> {
        let lock = self.op_lock(id);
        let _g = lock.lock().await;
        let (pgid, app_pgid, app_pid, app_start, attach_pid, cgroup) = self
            .insts
            .lock()
            .unwrap()
            .get(&id)
            .map(|i| (i.pgid, i.app_pgid, i.app_pid, i.saved.app_start, i.attach_pid, i.cgroup.clone()))
            .ok_or(PoolError::Unknown(id))?;
        signal_group(pgid, libc::SIGCONT);
        self.fence_and_kill_app(id, attach_pid, cgroup, app_pgid, app_pid, app_start).await
    }

    /// The lock that serialises operations (start, kill, stop, crash) on one instance.
    /// What a stop or a kill of instance `id` needs, copied out of the table (whose lock is not
    /// held across their awaits): process group, the application's group, pid and start time,
    /// the attach helper's pid, the mount, the expected-exit flag and the cgroup.
    #[allow(clippy::type_complexity)]
    fn teardown_handles(&self, id: InstanceId) -> Option<(i32, i32, u32, u64, u32, PathBuf, Arc<AtomicBool>, Option<PathBuf>)> {
        self.insts
            .lock()
            .unwrap()
            .get(&id)
            .map(|i| (i.pgid, i.app_pgid, i.app_pid, i.saved.app_start, i.attach_pid, i.mount.clone(), i.expected_exit.clone(), i.cgroup.clone()))
    }

    fn op_lock(&self, id: InstanceId) -> Arc<tokio::sync::Mutex<()>> {
        self.ops.lock().unwrap().entry(id).or_default().clone()
    }
}

/// Kills every process of an application, off the runtime: its cgroup (`cgroup.kill`, waited
/// until empty, removed), which holds the application and all it started. Without one, its
/// process group (what the tree walk may miss: a member reparented to init) and its process
/// tree, frozen and killed.
/// `app_start`: the application's start time ([`start_time`]); without a cgroup nothing is
/// signalled unless `app_pid` is still that process (once reaped, its pid and group id may be
/// another process's).
async fn kill_app(cgroup: Option<PathBuf>, app_pgid: i32, app_pid: u32, app_start: u64) -> Result<(), String> {
    tokio::task::spawn_blocking(move || match &cgroup {
        Some(d) => unit::kill_group(d, unit::KILL_TIMEOUT),
        None if app_pid != 0 && pid_alive(app_pid) && start_time(app_pid) == Some(app_start) => {
            if app_pgid > 0 {
                signal_group(app_pgid, libc::SIGSTOP);
            }
            let r = unit::kill_tree(app_pid, unit::KILL_TIMEOUT);
            if app_pgid > 0 {
                signal_group(app_pgid, libc::SIGKILL);
            }
            r
        }
        None => Ok(()),
    })
    .await
    .map_err(|e| format!("killing the application panicked: {e}"))?
}

/// [`teardown::take_down_helper`] off the runtime. `ours`: the pid is still the helper
/// recorded (else it is neither fenced nor signalled).
async fn take_down(helper: u32, ours: bool, mount: &Path) -> Result<(), String> {
    let mount = mount.to_path_buf();
    tokio::task::spawn_blocking(move || {
        if ours {
            teardown::take_down_helper(helper, Some(&mount))
        } else {
            teardown::take_down_dead_helper(helper, Some(&mount))
        }
    })
    .await
    .map_err(|e| format!("take-down panicked: {e}"))?
}

