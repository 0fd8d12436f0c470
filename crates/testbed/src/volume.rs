//! A local volume cluster on loopback, as child processes of this one (what `understudy up` runs).
//!
//! [`LocalCluster`] is the machinery (used by `up`, `demo`, the benchmarks): it lays out the directory, makes the
//! secret, checks the ports, starts the metadata service, the shards and the NBD server (this
//! same executable, re-executed), waits until every shard is up, restarts one that exits
//! ([`LocalCluster::supervise`]), and stops them all (SIGTERM,
//! then SIGKILL after a grace period) when stopped or dropped.
//!
//! Layout of DIR: `secret`, `cluster.json`, `up.pid`, `meta/`, `shard-N/`, `nbd.sock`,
//! `logs/{meta,shard-N,nbd}.log`.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use volume::driver::client::Cluster;
use volume::types::ShardState;

use crate::cluster_file::{self, ClusterInfo, NbdProc, ProcInfo, ShardProc, SECRET_FILE};
use crate::proc;
use crate::supervise::{Daemon, Event, RestartPolicy, Supervisor};

pub const DEFAULT_SHARDS: u32 = 4;
pub const DEFAULT_REPLICAS: u32 = 3;
pub const DEFAULT_PORT_BASE: u16 = 7700;
/// How long `up` waits for every shard to be up.
pub const READY_TIMEOUT: Duration = Duration::from_secs(90);
const MAX_SHARDS: u32 = 64;

/// A feature switch on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

impl OnOff {
    pub fn as_arg(self) -> &'static str {
        match self {
            OnOff::On => "on",
            OnOff::Off => "off",
        }
    }
}

/// What to start.
#[derive(Clone, Debug)]
pub struct UpConfig {
    pub dir: PathBuf,
    pub shards: u32,
    pub replicas: u32,
    /// 0: free ports picked at start.
    pub port_base: u16,
    /// -v count passed on to the children.
    pub verbose: u8,
}

/// A running local cluster; stops its processes when dropped.
pub struct LocalCluster {
    pub info: ClusterInfo,
    /// The daemons, in start order: meta, shards, nbd; restarted when they exit (see
    /// [`LocalCluster::supervise`]).
    sup: Supervisor,
    lock_file: PathBuf,
    stopped: bool,
}

fn port_in_use_error(port: u16, what: &str, e: std::io::Error) -> anyhow::Error {
    if e.kind() == std::io::ErrorKind::AddrInUse {
        anyhow::anyhow!(
            "port {port} ({what}) on 127.0.0.1 is already in use: is another `understudy up` running? \
             Stop it, or choose other ports with --port-base (0 picks free ones)"
        )
    } else {
        anyhow::anyhow!("cannot use port {port} ({what}) on 127.0.0.1: {e}")
    }
}

/// Picks `n` distinct free loopback ports (below the ephemeral range: see `wire::ports`).
fn free_ports(n: usize) -> anyhow::Result<Vec<u16>> {
    wire::ports::free_loopback_ports(n).context("cannot find free ports")
}

impl LocalCluster {
    /// Lays out `cfg.dir` and starts every process (without waiting for them).
    pub fn start(cfg: &UpConfig) -> anyhow::Result<LocalCluster> {
        Self::start_with(cfg, &[])
    }

    /// As [`LocalCluster::start`], with extra arguments for every shard (e.g.
    /// `--inject-write-latency-us 500` in benchmarks).
    pub fn start_with(cfg: &UpConfig, extra_shard_args: &[String]) -> anyhow::Result<LocalCluster> {
        Self::start_full(cfg, extra_shard_args, false)
    }

    /// As [`LocalCluster::start_with`]; with `shard_metrics`, every shard also serves Prometheus
    /// metrics on a free loopback port (`ShardProc::metrics`), for benchmarks that read its
    /// counters.
    pub fn start_full(cfg: &UpConfig, extra_shard_args: &[String], shard_metrics: bool) -> anyhow::Result<LocalCluster> {
        anyhow::ensure!((1..=MAX_SHARDS).contains(&cfg.shards), "--shards must be between 1 and {MAX_SHARDS}");
        anyhow::ensure!((1..=cfg.shards).contains(&cfg.replicas), "--replicas must be between 1 and the number of shards ({})", cfg.shards);
        std::fs::create_dir_all(&cfg.dir).with_context(|| format!("cannot create {}", cfg.dir.display()))?;
        let dir = cfg.dir.canonicalize()?;
        let logs = dir.join("logs");
        std::fs::create_dir_all(&logs)?;

        // One supervisor per directory.
        let lock_file = dir.join("up.pid");
        if let Ok(text) = std::fs::read_to_string(&lock_file) {
            if let Ok(pid) = text.trim().parse::<u32>() {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                if pid != std::process::id() && proc::alive(pid) && String::from_utf8_lossy(&cmdline).contains("understudy") {
                    anyhow::bail!("another `understudy up` (pid {pid}) is already running on {}", dir.display());
                }
            }
        }
        std::fs::write(&lock_file, format!("{}\n", std::process::id()))?;

        let secret_file = dir.join(SECRET_FILE);
        cluster_file::ensure_secret(&secret_file)?;

        let n = cfg.shards as usize;
        let ports: Vec<u16> = if cfg.port_base == 0 {
            free_ports(n + 2)?
        } else {
            let last = cfg.port_base as u32 + 1 + n as u32;
            anyhow::ensure!(last <= u16::MAX as u32, "--port-base {} leaves no room for {n} shards", cfg.port_base);
            (0..n as u16 + 2).map(|i| cfg.port_base + i).collect()
        };
        let names: Vec<String> =
            ["metadata service".to_string(), "NBD server".to_string()].into_iter().chain((1..=n).map(|i| format!("shard {i}"))).collect();
        for (port, what) in ports.iter().zip(&names) {
            TcpListener::bind(("127.0.0.1", *port)).map_err(|e| port_in_use_error(*port, what, e))?;
        }
        let addr = |p: u16| format!("127.0.0.1:{p}");
        let meta_addr = addr(ports[0]);
        let nbd_addr = addr(ports[1]);
        let secret_arg = secret_file.to_string_lossy().into_owned();
        let mut verbose_args: Vec<String> = vec![];
        if cfg.verbose >= 2 {
            verbose_args.push(format!("-{}", "v".repeat(cfg.verbose as usize)));
        }

        let mut lc = LocalCluster {
            info: ClusterInfo {
                dir: dir.clone(),
                secret_file: secret_file.clone(),
                replicas: cfg.replicas,
                port_base: cfg.port_base,
                up_pid: std::process::id(),
                meta: ProcInfo { addr: meta_addr.clone(), pid: 0, log: logs.join("meta.log") },
                nbd: NbdProc {
                    addr: nbd_addr.clone(),
                    uri: format!("nbd://{nbd_addr}/<volume>"),
                    unix_socket: dir.join("nbd.sock"),
                    pid: 0,
                    log: logs.join("nbd.log"),
                },
                shards: vec![],
            },
            sup: Supervisor::new(None, vec![]),
            lock_file,
            stopped: false,
        };

        let mut args = vec![
            "meta".to_string(),
            "--dir".into(),
            dir.join("meta").to_string_lossy().into_owned(),
            "--listen".into(),
            meta_addr.clone(),
            "--replicas".into(),
            cfg.replicas.to_string(),
            "--secret-file".into(),
            secret_arg.clone(),
        ];
        args.extend(verbose_args.iter().cloned());
        let log = lc.info.meta.log.clone();
        lc.info.meta.pid = lc.spawn("metadata service", args, log)?;

        let metrics_ports = if shard_metrics { free_ports(cfg.shards as usize)? } else { vec![] };
        for i in 1..=cfg.shards {
            let metrics = metrics_ports.get(i as usize - 1).map(|&p| addr(p));
            let shard_dir = dir.join(format!("shard-{i}"));
            let log = logs.join(format!("shard-{i}.log"));
            let shard_addr = addr(ports[1 + i as usize]);
            let mut args = vec![
                "shard".to_string(),
                "--id".into(),
                i.to_string(),
                "--dir".into(),
                shard_dir.to_string_lossy().into_owned(),
                "--listen".into(),
                shard_addr.clone(),
                "--meta".into(),
                meta_addr.clone(),
                "--secret-file".into(),
                secret_arg.clone(),
                // `up` owns DIR: a missing shard directory is a new (or replacement) shard.
                "--create".into(),
            ];
            args.extend(extra_shard_args.iter().cloned());
            if let Some(m) = &metrics {
                args.extend(["--metrics".to_string(), m.clone()]);
            }
            args.extend(verbose_args.iter().cloned());
            let pid = lc.spawn(&format!("shard {i}"), args, log.clone())?;
            lc.info.shards.push(ShardProc { id: i, addr: shard_addr, dir: shard_dir, pid, log, metrics });
        }

        let mut args = vec![
            "nbd".to_string(),
            "--meta".into(),
            meta_addr,
            "--secret-file".into(),
            secret_arg,
            "--listen".into(),
            nbd_addr,
            "--unix".into(),
            lc.info.nbd.unix_socket.to_string_lossy().into_owned(),
        ];
        args.extend(verbose_args.iter().cloned());
        let log = lc.info.nbd.log.clone();
        lc.info.nbd.pid = lc.spawn("NBD server", args, log)?;
        lc.set_restart(Some(RestartPolicy::default()));
        Ok(lc)
    }

    /// How daemons that exit are restarted from now on (None: reported and left down).
    pub fn set_restart(&mut self, policy: Option<RestartPolicy>) {
        let daemons = std::mem::take(&mut self.sup.daemons);
        self.sup = Supervisor::new(policy, daemons);
    }

    /// Starts a daemon (not yet watched: `start_full` hands them all to the supervisor).
    fn spawn(&mut self, what: &str, args: Vec<String>, log: PathBuf) -> anyhow::Result<u32> {
        let child = proc::spawn_self(&args, &log, &[])?;
        let pid = child.id();
        self.sup.daemons.push(Daemon { what: what.to_string(), args, log, child: Some(child) });
        Ok(pid)
    }

    /// Children that exited since the last call (not restarted: for start-up, where an exit
    /// is a failure to report at once): (description, status, log file).
    pub fn newly_exited(&mut self) -> Vec<(String, String, PathBuf)> {
        let mut out = vec![];
        for d in &mut self.sup.daemons {
            let Some(c) = &mut d.child else { continue };
            if let Ok(Some(status)) = c.try_wait() {
                d.child = None;
                out.push((d.what.clone(), proc::describe_status(status), d.log.clone()));
            }
        }
        out
    }

    /// Restarts the daemons that exited, each on its own data and address, after a backoff,
    /// and gives up on one that keeps failing ([`crate::supervise`]). Each restart updates
    /// the pids in [`LocalCluster::info`] (the caller saves it). Once ready, the cluster is
    /// watched through this alone: an exit is a gap in one daemon, not the end of the cluster.
    pub fn supervise(&mut self) -> Vec<Event> {
        let events = self.sup.poll();
        for e in &events {
            if let Event::Restarted { .. } = e {
                let n = self.sup.daemons.len();
                let pid = |i: usize| self.sup.pid(i).unwrap_or(0);
                self.info.meta.pid = pid(0);
                self.info.nbd.pid = pid(n - 1);
                for (k, s) in self.info.shards.iter_mut().enumerate() {
                    s.pid = self.sup.pid(k + 1).unwrap_or(0);
                }
            }
        }
        events
    }

    /// Whether a daemon kept failing and was given up on.
    pub fn gave_up(&self) -> bool {
        self.sup.gave_up()
    }

    /// Waits until the metadata service answers, every shard is registered and up, and the NBD
    /// server accepts connections. Fails at once if a process exits, with the end of its log.
    pub async fn wait_ready(&mut self, timeout: Duration, progress: bool) -> anyhow::Result<Arc<Cluster>> {
        let deadline = Instant::now() + timeout;
        let secret = cluster_file::read_secret(&self.info.secret_file)?;
        let mut cluster: Option<Arc<Cluster>> = None;
        let mut last_up = usize::MAX;
        let want = self.info.shards.len();
        loop {
            if let Some((what, status, log)) = self.newly_exited().into_iter().next() {
                anyhow::bail!("{what} exited during start-up ({status}): {} (log: {})", proc::last_error(&log), log.display());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the cluster was not ready within {timeout:?} (up shards: {}/{want}); see the logs in {}",
                if last_up == usize::MAX { 0 } else { last_up },
                self.info.dir.join("logs").display()
            );
            if cluster.is_none() {
                match Cluster::connect(&self.info.meta.addr, &secret).await {
                    Ok(c) => cluster = Some(c),
                    Err(e) => tracing::debug!("metadata service not ready: {e:#}"),
                }
            }
            if let Some(c) = &cluster {
                if c.refresh_map(c.map().epoch).await.is_ok() {
                    let map = c.map();
                    let up = self.info.shards.iter().filter(|s| map.state(s.id) == ShardState::Up).count();
                    if up != last_up && progress {
                        eprintln!("understudy up: {up}/{want} shards up");
                    }
                    last_up = up;
                    if up == want && std::net::TcpStream::connect(&self.info.nbd.addr).is_ok() {
                        return Ok(c.clone());
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops every process (SIGTERM, then SIGKILL after [`proc::STOP_GRACE`]); returns each
    /// one's exit status text.
    pub fn stop(&mut self) -> Vec<(String, String)> {
        if self.stopped {
            return vec![];
        }
        self.stopped = true;
        // The metadata service first (it was started first): a shard that stopped before it
        // would be marked down and out of sync the moment its link closed, and the next start
        // could no longer tell a shard that was stale from the ones that were in sync.
        let n = self.sup.daemons.len();
        let first = n.min(1);
        let mut out = proc::stop_children(&mut self.sup.take_children(0..first), proc::STOP_GRACE);
        out.extend(proc::stop_children(&mut self.sup.take_children(first..n), proc::STOP_GRACE));
        let _ = std::fs::remove_file(&self.lock_file);
        let _ = std::fs::remove_file(&self.info.nbd.unix_socket);
        out
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A local cluster (4 shards, 3 replicas) with one volume attached as ext4 by a foreground
/// `understudy volume attach` (FUSE, loop device, mkfs.ext4); dropped, it detaches (SIGTERM to
/// the attach) and stops the cluster.
pub struct AttachedVolume {
    attach: Option<crate::proc::KillOnDrop>,
    pub mount: PathBuf,
    cluster: Option<LocalCluster>,
}

impl Drop for AttachedVolume {
    fn drop(&mut self) {
        let t0 = Instant::now();
        if let Some(mut c) = self.attach.take() {
            // SIGTERM: the foreground attach unmounts, releases the loop device and FUSE
            // (SIGKILL, by the guard, only if it is stuck).
            proc::signal(c.0.id(), libc::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(120);
            while matches!(c.0.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let detached = t0.elapsed().as_secs_f64();
        if let Some(mut lc) = self.cluster.take() {
            lc.stop();
        }
        eprintln!("volume detached in {detached:.1} s, cluster stopped in {:.1} s", t0.elapsed().as_secs_f64() - detached);
        let _ = &self.mount;
    }
}

/// Starts an [`AttachedVolume`] of `size` (as `volume create --size`) under `dir`, every shard
/// started with `extra_shard_args`, mounted at `dir/mnt`.
pub fn start_attached(rt: &tokio::runtime::Runtime, dir: &Path, extra_shard_args: &[String], size: &str) -> anyhow::Result<AttachedVolume> {
    let cfg = UpConfig { dir: dir.join("cluster"), shards: 4, replicas: 3, port_base: 0, verbose: 0 };
    let mut lc = LocalCluster::start_with(&cfg, extra_shard_args)?;
    rt.block_on(lc.wait_ready(READY_TIMEOUT, false))?;
    let cluster_file = lc.info.dir.join(crate::cluster_file::CLUSTER_FILE);
    lc.info.save(&cluster_file)?;
    let out = Command::new(std::env::current_exe()?)
        .arg("volume")
        .arg("--cluster")
        .arg(&cluster_file)
        .args(["create", "bulk", "--size", size])
        .output()?;
    anyhow::ensure!(out.status.success(), "volume create: {}", String::from_utf8_lossy(&out.stderr));
    let mount = dir.join("mnt");
    std::fs::create_dir_all(&mount)?;
    let mut bed = AttachedVolume { attach: None, mount: mount.clone(), cluster: Some(lc) };
    let (child, line) = crate::proc::spawn_self_until(
        &["volume", "--cluster", &cluster_file.to_string_lossy(), "attach", "bulk", "--mount", &mount.to_string_lossy(), "--mkfs", "--foreground"],
        &[],
        "attached ",
        Duration::from_secs(300),
    )?;
    eprintln!("{line}");
    bed.attach = Some(child);
    Ok(bed)
}
