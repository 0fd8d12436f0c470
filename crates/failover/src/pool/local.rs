//! The instance pool (§4.1): where application instances run.
//!
//! [`InstancePool`] is what the monitor's driver needs from any pool (local processes today;
//! containers or Kubernetes pods can implement it later). [`LocalPool`] runs each instance as its
//! own process group, like a small host: the `understudy volume attach --foreground` helper that
//! serves the instance's volume as ext4 at its own mount point, and the application itself. Each
//! instance is reached through its own network link, which a fault can cut: with network
//! namespaces ([`crate::netns`]) the application runs in its own namespace behind a veth pair
//! and a cut takes the link down (the volume, served from the host, stays attached); without,
//! the link is a [`Proxy`] the pool owns and a cut points it nowhere. The application runs as a
//! unit that dies whole ([`crate::pool::unit`]: its own cgroup, or its process tree without cgroup2),
//! since a process group is not one (PostgreSQL starts every backend in a session of its own).
//! An instance can be paused (its application's group frozen, the helper SIGSTOPped) or killed
//! (its disk fenced, every process of its application SIGKILLed, with no flush: dirty pages
//! never reach the volume).

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};
use tokio::sync::mpsc;

use crate::proto::{now_unix_ms, InstanceId, Input};
use crate::endpoint::Proxy;
use crate::netns::{self, NetnsLink};
use crate::pool::process::{self, pid_alive, start_time};
use crate::pool::teardown;
use crate::pool::unit::{self, Containment};
use crate::spec::{substitute, AppSpec};

#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("instance {0} was killed; ids are never reused")]
    Killed(InstanceId),
    #[error("no instance {0}")]
    Unknown(InstanceId),
    #[error("attaching volume {volume} for instance {id} failed: {msg}")]
    Attach { id: InstanceId, volume: String, msg: String },
    #[error("starting the application of instance {id} failed: {msg}")]
    App { id: InstanceId, msg: String },
    #[error("instance {id}: {msg}")]
    Io { id: InstanceId, msg: String },
}

/// What the monitor's driver needs from a pool. Every operation is idempotent.
pub trait InstancePool: Send + Sync + 'static {
    /// Starts instance `id` on `volume` (or reports the running one); returns its address.
    fn start(&self, id: InstanceId, volume: &str) -> impl std::future::Future<Output = Result<SocketAddr, PoolError>> + Send;
    /// Kills the whole instance at once and detaches its volume (fencing). Final for `id`.
    fn kill(&self, id: InstanceId) -> impl std::future::Future<Output = Result<(), PoolError>> + Send;
    /// Stops the application cleanly (SIGTERM, wait), then detaches the volume (unmount).
    fn stop(&self, id: InstanceId) -> impl std::future::Future<Output = Result<(), PoolError>> + Send;
    /// SIGSTOP / SIGCONT of the whole instance.
    fn pause(&self, id: InstanceId, paused: bool) -> Result<(), PoolError>;
    /// Cuts (or restores) the instance's network link: connections severed, new ones refused.
    fn cut(&self, id: InstanceId, cut: bool) -> Result<(), PoolError>;
    fn address(&self, id: InstanceId) -> Option<SocketAddr>;
}

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

/// Where an instance's start went (wall clock, ms since the Unix epoch): the bench breaks a
/// recovery down with it.
#[derive(serde::Serialize, serde::Deserialize, Clone, Debug, Default, PartialEq)]
pub struct StartTiming {
    /// `start` called (the attach helper is spawned right after).
    pub requested_unix_ms: u64,
    /// The helper reported the file system mounted.
    pub attached_unix_ms: u64,
    /// The application's process spawned.
    pub spawned_unix_ms: u64,
    /// The helper's own steps, in ms: volume open, FUSE mount, losetup, (mkfs,) mount.
    pub attach_steps_ms: Vec<(String, f64)>,
}

/// The `[open=1.2 fuse=0.4 … ms]` suffix of the attach helper's ready line.
fn parse_attach_steps(line: &str) -> Vec<(String, f64)> {
    let Some(inner) = line.trim_end().rsplit_once('[').and_then(|(_, r)| r.strip_suffix("ms]")) else { return vec![] };
    inner.split_whitespace().filter_map(|kv| kv.split_once('=')).filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?))).collect()
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

/// Making (or taking the spare) namespace of a start, beside its attach.
type NsTask = tokio::task::JoinHandle<Result<(netns::Lock, NetnsLink, std::os::fd::OwnedFd), netns::NetnsError>>;

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
}

/// Signals process group `pgid`.
fn signal_group(pgid: i32, sig: libc::c_int) {
    process::signal(-pgid, sig)
}

fn signal_pid(pid: u32, sig: libc::c_int) {
    process::signal(pid as libc::pid_t, sig)
}

/// The source (device) of the file system mounted at `dir`, if `dir` is a mount point.
fn mount_source(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    // Canonical like the kernel's (the parent only: a dead FUSE mount must not be stat'ed).
    let dir = match (dir.parent().and_then(|p| p.canonicalize().ok()), dir.file_name()) {
        (Some(p), Some(n)) => p.join(n),
        _ => dir.to_path_buf(),
    };
    let d = dir.to_string_lossy();
    // Fields: id parent major:minor root mount-point options ... - fstype source super-options.
    text.lines().rev().find(|l| l.split(' ').nth(4) == Some(d.as_ref())).and_then(|l| l.split(" - ").nth(1)?.split(' ').nth(1).map(str::to_string))
}

/// Live `volume attach` helpers whose `--mount` is `mount`.
fn helpers_of(mount: &Path) -> Vec<u32> {
    let want = mount.as_os_str().as_encoded_bytes();
    let mut v = vec![];
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        let is_helper = args.contains(&&b"attach"[..]) && args.windows(2).any(|w| w[0] == b"--mount" && w[1] == want);
        if is_helper && pid_alive(pid) {
            v.push(pid);
        }
    }
    v
}

/// Runs a clean-up command with a deadline ([`teardown::run_bounded`]); a failure (a wedged
/// `losetup` or `umount` included) is logged and the caller goes on with the next step.
async fn run_logged(prog: &str, args: &[&std::ffi::OsStr]) {
    let (prog, args): (String, Vec<String>) = (prog.to_string(), args.iter().map(|a| a.to_string_lossy().into_owned()).collect());
    let r = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        teardown::run_bounded(&prog, &args, teardown::COMMAND_TIMEOUT)
    })
    .await;
    match r {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::warn!("{e}"),
        Err(e) => tracing::warn!("clean-up command panicked: {e}"),
    }
}

/// Deadline of `understudy volume detach` (the helper's own detach waits up to 120 s).
const DETACH_TIMEOUT: Duration = Duration::from_secs(150);

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join(" | ")
}

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
        })
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

    /// Adopts the instances a previous run of the monitor left running (same processes, same
    /// start times); returns their ids. Call once, before the monitor starts.
    pub async fn adopt(&self) -> Vec<InstanceId> {
        let Ok(bytes) = std::fs::read(self.saved_path()) else { return vec![] };
        let Ok(saved) = serde_json::from_slice::<SavedPool>(&bytes) else {
            tracing::warn!("ignoring unreadable {}", self.saved_path().display());
            return vec![];
        };
        self.killed.lock().unwrap().extend(saved.killed.iter().copied());
        for s in &saved.starting {
            tracing::info!(id = %s.id, attach_pid = s.attach_pid, "reaping a start the previous run left half-way");
            self.reap(s).await;
        }
        let mut adopted = vec![];
        for s in saved.instances {
            let alive = start_time(s.app_pid) == Some(s.app_start) && start_time(s.attach_pid) == Some(s.attach_start);
            if !alive {
                // One may be gone and the other not (an app that crashed beside a live helper
                // holding the mount): nothing of it may stay.
                tracing::info!(id = %s.id, "instance of the previous run is gone; reaping what is left of it");
                self.reap(&s).await;
                continue;
            }
            let link = match &s.netns {
                Some(l) => Link::Netns { link: l.clone(), addr: (l.ns_addr, s.app_port).into() },
                None => {
                    let app_addr: SocketAddr = ([127, 0, 0, 1], s.app_port).into();
                    let Ok(proxy) = Proxy::bind("127.0.0.1:0".parse().unwrap(), Some(app_addr)).await else { continue };
                    Link::Proxy { proxy, app_addr }
                }
            };
            let expected_exit = Arc::new(AtomicBool::new(false));
            // Not our children any more: watch them by pid.
            let (events, flag, id, pids) = (self.events.clone(), expected_exit.clone(), s.id, [s.app_pid, s.attach_pid]);
            tokio::spawn(async move {
                while pids.iter().all(|p| pid_alive(*p)) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                if !flag.load(Ordering::SeqCst) {
                    let _ = events.send(Input::InstanceExited(id)).await;
                }
            });
            tracing::info!(id = %s.id, addr = %link.address(), "adopted a running instance");
            adopted.push(s.id);
            self.insts.lock().unwrap().insert(
                s.id,
                Inst {
                    cgroup: self.group_dir(s.id).filter(|d| d.exists()),
                    timing: StartTiming::default(),
                    pgid: s.pgid,
                    app_pid: s.app_pid,
                    app_pgid: if s.app_pgid != 0 { s.app_pgid } else { s.pgid },
                    attach_pid: s.attach_pid,
                    link,
                    mount: s.mount.clone(),
                    expected_exit,
                    _attach_stdout: None,
                    saved: s,
                },
            );
        }
        // A helper this run has no record of (the previous one crashed between spawning it
        // and recording it): found by its `--mount` argument, reaped like the others.
        let ours: HashSet<PathBuf> = self.insts.lock().unwrap().values().map(|i| i.mount.clone()).collect();
        for d in std::fs::read_dir(self.cfg.state_dir.join("mnt")).into_iter().flatten().flatten() {
            let mount = d.path();
            if ours.contains(&mount) {
                continue;
            }
            for pid in helpers_of(&mount) {
                tracing::info!(mount = %mount.display(), pid, "reaping an attach helper the previous run left unrecorded");
                // Its application (found by the mount it runs in) first, then the stack.
                for app in procs_in(&mount) {
                    signal_pid(app, libc::SIGKILL);
                }
                if let Err(e) = take_down(pid, true, &mount).await {
                    tracing::error!(pid, "reaping an unrecorded attach helper: {e}");
                }
            }
            self.unmount_all(&mount).await;
        }
        self.save();
        adopted
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

    async fn start_inner(&self, id: InstanceId, volume: &str) -> Result<SocketAddr, PoolError> {
        let requested_unix_ms = now_unix_ms();
        let mount = self.mount_dir(id);
        std::fs::create_dir_all(&mount).map_err(|e| PoolError::Io { id, msg: format!("cannot create {}: {e}", mount.display()) })?;
        let attach_log = self.cfg.state_dir.join("logs").join(format!("{id}.attach.log"));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&attach_log)
            .map_err(|e| PoolError::Io { id, msg: e.to_string() })?;
        let inst = id.to_string();
        // The namespace is made (or the spare taken) while the volume attaches, not after.
        // Its lock is held from then until the application is in it, so a concurrent sweep
        // never takes it for stale.
        let ns_task = self.cfg.netns.then(|| {
            let spare = self.spare.clone();
            let name = netns::name_for(&self.tag, &inst);
            tokio::task::spawn_blocking(move || -> Result<(netns::Lock, NetnsLink, std::os::fd::OwnedFd), netns::NetnsError> {
                let l = netns::lock()?;
                let taken = {
                    let mut g = spare.lock().unwrap();
                    match g.take() {
                        Some((s, link)) if s == id => link, // a spare still being made is cancelled
                        other => {
                            *g = other;
                            None
                        }
                    }
                };
                let link = match taken {
                    Some(link) if Path::new("/run/netns").join(&link.name).exists() => link,
                    _ => netns::create(&name, &l)?,
                };
                match netns::open(&link.name) {
                    Ok(fd) => Ok((l, link, fd)),
                    Err(e) => {
                        let _ = netns::delete(&link.name);
                        Err(e)
                    }
                }
            })
        });
        let mut cmd = Command::new(&self.cfg.exe);
        cmd.arg("volume").args(&self.cfg.conn_args).args(["attach", volume, "--mount"]).arg(&mount).arg("--foreground");
        if self.cfg.mkfs_first && id == InstanceId(1) {
            cmd.arg("--mkfs");
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::from(log)).process_group(0).kill_on_drop(false);
        let attach: Child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                if let Some(t) = ns_task {
                    if let Ok(Ok((_l, link, _fd))) = t.await {
                        let _ = netns::delete(&link.name);
                    }
                }
                return Err(PoolError::Attach { id, volume: volume.into(), msg: format!("cannot run {}: {e}", self.cfg.exe.display()) });
            }
        };
        let attach_pid = attach.id().unwrap_or(0);
        let pgid = attach_pid as i32;
        // Durable before we wait for it: a crash of this monitor from here on leaves a record
        // the next run reaps (see `adopt`).
        self.starting.lock().unwrap().insert(
            id,
            SavedInst {
                id,
                pgid,
                app_pid: 0,
                app_start: 0,
                attach_pid,
                attach_start: start_time(attach_pid).unwrap_or(0),
                app_port: 0,
                mount: mount.clone(),
                app_pgid: 0,
                netns: None,
            },
        );
        self.save();
        let r = self.start_attached(id, volume, attach, mount, pgid, attach_log, ns_task, requested_unix_ms).await;
        self.starting.lock().unwrap().remove(&id);
        self.save();
        r
    }

    /// The rest of a start once the attach helper runs: wait for its mount, then the
    /// application. Every error path takes down what was made.
    #[allow(clippy::too_many_arguments)]
    async fn start_attached(
        &self,
        id: InstanceId,
        volume: &str,
        mut attach: Child,
        mount: PathBuf,
        pgid: i32,
        attach_log: PathBuf,
        ns_task: Option<NsTask>,
        requested_unix_ms: u64,
    ) -> Result<SocketAddr, PoolError> {
        let attach_pid = pgid as u32;
        let inst = id.to_string();
        let mut stdout = BufReader::new(attach.stdout.take().expect("piped"));
        let mut line = String::new();
        let ready = tokio::time::timeout(self.cfg.attach_timeout, stdout.read_line(&mut line)).await;
        if !matches!(ready, Ok(Ok(n)) if n > 0 && line.starts_with("attached")) {
            if let Some(t) = ns_task {
                if let Ok(Ok((_l, link, _fd))) = t.await {
                    let _ = netns::delete(&link.name);
                }
            }
            self.abandon(pgid, &mut attach, &mount).await;
            let why = match ready {
                Err(_) => format!("not attached within {:?}", self.cfg.attach_timeout),
                _ => tail(&attach_log, 3),
            };
            return Err(PoolError::Attach { id, volume: volume.into(), msg: why });
        }
        let attached_unix_ms = now_unix_ms();
        let attach_steps_ms = parse_attach_steps(&line);
        // The application, in the same process group (and its own network namespace).
        let port = free_port().map_err(|e| PoolError::Io { id, msg: e.to_string() })?;
        let (ns_lock, ns) = match ns_task {
            Some(t) => match t.await.map_err(|e| netns::NetnsError(format!("making the namespace: {e}"))).and_then(|r| r) {
                Ok((l, link, fd)) => (Some(l), Some((link, fd))),
                Err(e) => {
                    self.abandon(pgid, &mut attach, &mount).await;
                    return Err(PoolError::Io { id, msg: e.to_string() });
                }
            },
            None => (None, None),
        };
        let host: IpAddr = ns.as_ref().map_or(Ipv4Addr::LOCALHOST, |(l, _)| l.ns_addr).into();
        let args: Vec<String> = self.cfg.app.command.iter().map(|a| substitute(a, &mount, host, port, &inst)).collect();
        let app_log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_file(id))
            .map_err(|e| PoolError::Io { id, msg: e.to_string() })?;
        let app_err = app_log.try_clone().map_err(|e| PoolError::Io { id, msg: e.to_string() })?;
        let mut app = Command::new(&args[0]);
        app.args(&args[1..])
            .current_dir(&mount)
            .env("UNDERSTUDY_MOUNT", &mount)
            .env("UNDERSTUDY_PORT", port.to_string())
            .env("UNDERSTUDY_HOST", host.to_string())
            .env("UNDERSTUDY_INSTANCE", &inst)
            .stdin(Stdio::null())
            .stdout(Stdio::from(app_log))
            .stderr(Stdio::from(app_err))
            // Its own process group: the application can be killed as a whole without the
            // helper, which must outlive the loop device that reads its FUSE file.
            .process_group(0)
            .kill_on_drop(false);
        for (k, v) in &self.cfg.app.env {
            app.env(k, substitute(v, &mount, host, port, &inst));
        }
        if let Some((_, fd)) = &ns {
            let fd = fd.as_raw_fd();
            // SAFETY: the closure runs in the forked child before exec and makes one
            // async-signal-safe system call (setns) on a descriptor the parent keeps open.
            unsafe {
                app.pre_exec(move || netns::enter(fd));
            }
        }
        // Its own cgroup, entered before exec: every process it ever starts is in it, however
        // it daemonizes, and the kill reaches them all.
        let group = match self.containment.create(&self.group_name(id)) {
            Ok(g) => g,
            Err(msg) => {
                drop(ns_lock);
                if let Some((l, _)) = &ns {
                    let _ = netns::delete(&l.name);
                }
                self.abandon(pgid, &mut attach, &mount).await;
                return Err(PoolError::App { id, msg });
            }
        };
        if let Some(g) = &group {
            g.enter_at_spawn(&mut app);
        }
        let spawned = app.spawn();
        drop(ns_lock);
        let cgroup = group.map(|g| g.dir);
        let mut app_child = match spawned {
            Ok(c) => c,
            Err(e) => {
                if let Some(d) = &cgroup {
                    let _ = unit::kill_group(d, unit::KILL_TIMEOUT);
                }
                if let Some((l, _)) = &ns {
                    let _ = netns::delete(&l.name);
                }
                self.abandon(pgid, &mut attach, &mount).await;
                return Err(PoolError::App { id, msg: format!("cannot run {:?}: {e}", args[0]) });
            }
        };
        let app_pid = app_child.id().unwrap_or(0);
        let timing = StartTiming { requested_unix_ms, attached_unix_ms, spawned_unix_ms: now_unix_ms(), attach_steps_ms };
        let link = match ns {
            Some((link, _fd)) => Link::Netns { addr: (link.ns_addr, port).into(), link },
            None => {
                let app_addr: SocketAddr = ([127, 0, 0, 1], port).into();
                let proxy = match Proxy::bind("127.0.0.1:0".parse().unwrap(), Some(app_addr)).await {
                    Ok(p) => p,
                    Err(e) => {
                        if let Err(e) = kill_app(cgroup.clone(), app_pid as i32, app_pid, start_time(app_pid).unwrap_or(0)).await {
                            tracing::error!(%id, "{e}");
                        }
                        let _ = tokio::time::timeout(teardown::EXIT_TIMEOUT, app_child.wait()).await;
                        self.abandon(pgid, &mut attach, &mount).await;
                        return Err(PoolError::Io { id, msg: format!("cannot open the instance's link: {e}") });
                    }
                };
                Link::Proxy { proxy, app_addr }
            }
        };
        let addr = link.address();
        let expected_exit = Arc::new(AtomicBool::new(false));
        // Report an exit we did not cause (a crash of the app or of the attach helper).
        let events = self.events.clone();
        let flag = expected_exit.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = app_child.wait() => {}
                _ = attach.wait() => {}
            }
            if !flag.load(Ordering::SeqCst) {
                let _ = events.send(Input::InstanceExited(id)).await;
            }
            // Reap whichever is left once it is killed.
            let _ = app_child.wait().await;
            let _ = attach.wait().await;
        });
        tracing::info!(%id, volume, %addr, app_pid, attach_pid, "instance started");
        let app_pgid = app_pid as i32;
        let saved = SavedInst {
            id,
            pgid,
            app_pgid,
            app_pid,
            app_start: start_time(app_pid).unwrap_or(0),
            attach_pid,
            attach_start: start_time(attach_pid).unwrap_or(0),
            app_port: port,
            mount: mount.clone(),
            netns: link.netns().cloned(),
        };
        self.insts.lock().unwrap().insert(
            id,
            Inst { cgroup, timing, saved, pgid, app_pid, app_pgid, attach_pid, link, mount, expected_exit, _attach_stdout: Some(stdout.into_inner()) },
        );
        self.save();
        Ok(addr)
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
    /// Undoes a start that failed once the attach helper ran (attached or not): the volume
    /// stack taken down in the order that cannot hang ([`teardown::take_down_helper`]).
    async fn abandon(&self, pgid: i32, attach: &mut Child, mount: &Path) {
        match take_down(pgid as u32, true, mount).await {
            Ok(()) => {
                let _ = tokio::time::timeout(teardown::EXIT_TIMEOUT, attach.wait()).await;
            }
            Err(e) => tracing::error!(helper = pgid, "abandoning a failed start: {e}"),
        }
        self.unmount_all(mount).await;
    }

    /// Takes down what a previous run of the monitor left of an instance it no longer
    /// serves: its application (SIGKILL, only if still the process that was recorded: pids
    /// are reused), then its volume stack, the helper last ([`teardown::take_down_helper`]).
    async fn reap(&self, s: &SavedInst) {
        // Its cgroup holds every process of its application, whatever its pids are now.
        if let Some(d) = self.group_dir(s.id) {
            let r = tokio::task::spawn_blocking(move || unit::kill_group(&d, unit::KILL_TIMEOUT)).await;
            if let Ok(Err(e)) = r {
                tracing::warn!(id = %s.id, "{e}");
            }
        }
        if s.app_pid != 0 && start_time(s.app_pid) == Some(s.app_start) {
            if s.app_pgid != 0 {
                signal_group(s.app_pgid, libc::SIGKILL);
            }
            signal_pid(s.app_pid, libc::SIGKILL);
            if !Self::wait_gone(&[s.app_pid], teardown::EXIT_TIMEOUT).await {
                tracing::warn!(id = %s.id, "application of the previous run still alive after SIGKILL");
            }
        }
        let ours = s.attach_pid != 0 && start_time(s.attach_pid) == Some(s.attach_start);
        if s.attach_pid != 0 {
            if let Err(e) = take_down(s.attach_pid, ours, &s.mount).await {
                tracing::error!(id = %s.id, "reaping the previous run's instance: {e}");
            }
        }
        self.unmount_all(&s.mount).await;
        if let Some(l) = &s.netns {
            let _ = netns::delete(&l.name);
        }
    }

    /// `volume detach` of an instance's mount point, and when that leaves something (a helper
    /// killed before it wrote its state file: no record of the stack), the stack found from
    /// the kernel: ext4 mount → its loop device → the FUSE file behind it → the FUSE mount.
    async fn unmount_all(&self, mount: &Path) {
        let _ = self.detach(mount).await;
        let Some(dev) = mount_source(mount) else { return };
        let backing = dev
            .strip_prefix("/dev/")
            .and_then(|name| std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")).ok())
            .map(|b| PathBuf::from(b.trim()));
        tracing::info!(mount = %mount.display(), %dev, "unmounting what a dead attach helper left");
        run_logged("umount", &["-l".as_ref(), mount.as_os_str()]).await;
        if let Some(b) = backing {
            run_logged("losetup", &["-d".as_ref(), dev.as_ref()]).await;
            if let Some(fuse_dir) = b.parent().filter(|d| mount_source(d).is_some()) {
                run_logged("umount", &["-l".as_ref(), fuse_dir.as_os_str()]).await;
                let _ = std::fs::remove_dir(fuse_dir);
            }
        }
    }

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

/// Processes whose working directory is `mount` (an instance's application and its children).
fn procs_in(mount: &Path) -> Vec<u32> {
    let mut v = vec![];
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        if std::fs::read_link(e.path().join("cwd")).is_ok_and(|c| c == mount) {
            v.push(pid);
        }
    }
    v

}
