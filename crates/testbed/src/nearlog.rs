//! A local near-compute log cluster (SplitFT): a controller and 3 log peers as child processes,
//! supervised, what `understudy nearlog up` runs, and the cluster file the LD_PRELOAD shim reads.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use std::time::{Duration, Instant};

use anyhow::Context;

use crate::proc::{self, spawn_self_until, KillOnDrop};
use crate::supervise::{Daemon, Event, RestartPolicy, Supervisor};

/// The cluster file the shim reads (`UNDERSTUDY_NEARLOG_CLUSTER`).
#[derive(serde::Serialize, serde::Deserialize, Debug)]
pub struct NearlogClusterFile {
    pub controller: String,
    pub secret_file: PathBuf,
    pub peers: Vec<String>,
}

pub fn read_secret(path: &Path) -> anyhow::Result<Arc<Vec<u8>>> {
    let s = std::fs::read(path).with_context(|| format!("cannot read the cluster secret {}", path.display()))?;
    let s: Vec<u8> = s.trim_ascii().to_vec();
    anyhow::ensure!(!s.is_empty(), "cluster secret file {} is empty", path.display());
    Ok(Arc::new(s))
}

pub fn ensure_secret(path: &Path) -> anyhow::Result<Arc<Vec<u8>>> {
    if !path.exists() {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let hex: String = (0..32).map(|_| format!("{:02x}", rand::random::<u8>())).collect();
        let mut f = std::fs::OpenOptions::new().create_new(true).write(true).mode(0o600).open(path)?;
        f.write_all(hex.as_bytes())?;
        f.sync_all()?;
    }
    read_secret(path)
}

/// The LD_PRELOAD shim next to this executable (where `cargo build -p nearlog-preload` puts it).
pub fn default_shim() -> anyhow::Result<PathBuf> {
    Ok(std::env::current_exe()?.parent().context("executable has no directory")?.join("libnearlog_preload.so"))
}

/// A running `nearlog up` cluster: the controller and 3 log peers, each its own process
/// (`understudy nearlog controller|peer`, logs in `DIR/logs/`), restarted when one exits
/// ([`NearlogUp::supervise`]), stopped (SIGTERM) when dropped.
pub struct NearlogUp {
    pub controller: String,
    pub peers: Vec<String>,
    /// `DIR/nearlog-cluster.json`, for `UNDERSTUDY_NEARLOG_CLUSTER`.
    pub cluster_file: PathBuf,
    dir: PathBuf,
    /// The controller (index 0), then the peers.
    sup: Supervisor,
}

/// Peers `nearlog up` runs.
const UP_PEERS: usize = 3;
/// How long `nearlog up` waits for its peers to register.
const UP_READY_TIMEOUT: Duration = Duration::from_secs(60);

/// `addr` if it can be bound now (the last run's address, free again), else a free port.
fn same_or_free(addr: Option<&str>) -> anyhow::Result<String> {
    if let Some(a) = addr {
        if std::net::TcpListener::bind(a).is_ok() {
            return Ok(a.to_string());
        }
    }
    Ok(format!("127.0.0.1:{}", wire::ports::free_loopback_port()?))
}

/// Starts a controller and 3 peers (each lending `region_bytes`), each its own process, state
/// and secret in `dir`; returns once the peers registered and the cluster file is written. The
/// controller listens on `port` (0: the last run's address if free, else any); each peer at
/// its last address if free. Each peer keeps its id in `DIR/nearlog-peer-N.id`: restarted
/// (by the supervisor or a new `nearlog up`), the controller knows it as the same peer (memory
/// empty) rather than a fourth one beside a dead one.
pub async fn up(dir: &Path, region_bytes: u64, port: u16) -> anyhow::Result<NearlogUp> {
    std::fs::create_dir_all(dir.join("logs")).with_context(|| format!("cannot create {}", dir.display()))?;
    let dir = std::fs::canonicalize(dir)?;
    let secret_file = dir.join("secret");
    let secret = ensure_secret(&secret_file)?;
    let cluster = dir.join("nearlog-cluster.json");
    // A restart on the same DIR comes back at the addresses of the last run where they
    // are free (an application still running keeps reaching them), else at new ones.
    let last: Option<NearlogClusterFile> = std::fs::read(&cluster).ok().and_then(|b| serde_json::from_slice(&b).ok());
    let controller = match port {
        0 => same_or_free(last.as_ref().map(|l| l.controller.as_str()))?,
        p => format!("127.0.0.1:{p}"),
    };
    let sf = secret_file.to_string_lossy().into_owned();
    let mut daemons = vec![Daemon {
        what: "controller".into(),
        args: ["nearlog", "controller", "--dir", &dir.to_string_lossy(), "--listen", &controller, "--secret-file", &sf].map(String::from).to_vec(),
        log: dir.join("logs/controller.log"),
        child: None,
    }];
    let mut peers = Vec::new();
    for i in 0..UP_PEERS {
        let addr = same_or_free(last.as_ref().and_then(|c| c.peers.get(i)).map(String::as_str))?;
        let id_file = dir.join(format!("nearlog-peer-{i}.id")).to_string_lossy().into_owned();
        let region = region_bytes.to_string();
        daemons.push(Daemon {
            what: format!("peer {i}"),
            args: ["nearlog", "peer", "--listen", &addr, "--controller", &controller, "--secret-file", &sf, "--region-bytes", &region, "--id-file", &id_file]
                .map(String::from)
                .to_vec(),
            log: dir.join(format!("logs/peer-{i}.log")),
            child: None,
        });
        peers.push(addr);
    }
    let mut up = NearlogUp { controller: controller.clone(), peers: peers.clone(), cluster_file: cluster.clone(), dir: dir.clone(), sup: Supervisor::new(Some(RestartPolicy::default()), vec![]) };
    for mut d in daemons {
        d.child = Some(proc::spawn_self(&d.args, &d.log, &[])?);
        up.sup.daemons.push(d);
    }
    let daemons = std::mem::take(&mut up.sup.daemons);
    up.sup = Supervisor::new(Some(RestartPolicy::default()), daemons);
    up.write_pids()?;
    // Wait until the 3 peers registered; a daemon that exits meanwhile fails the start.
    let deadline = Instant::now() + UP_READY_TIMEOUT;
    loop {
        for d in &mut up.sup.daemons {
            if let Some(Ok(Some(st))) = d.child.as_mut().map(|c| c.try_wait()) {
                anyhow::bail!("{} exited during start-up ({}): {} (log: {})", d.what, proc::describe_status(st), proc::last_error(&d.log), d.log.display());
            }
        }
        if let Ok(::nearlog::proto::CtlReply::Status(s)) = ::nearlog::driver::server::ctl_call(&controller, &secret, &::nearlog::proto::CtlRequest::Status).await {
            if peers.iter().all(|p| s.peers.values().any(|i| &i.addr == p && i.live)) {
                break;
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "the log peers did not register within {UP_READY_TIMEOUT:?}; see the logs in {}", dir.join("logs").display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cf = NearlogClusterFile { controller, secret_file, peers };
    let tmp = dir.join("nearlog-cluster.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&cf)?)?;
    std::fs::rename(&tmp, &cluster)?;
    Ok(up)
}

impl NearlogUp {
    /// Restarts a daemon that exited, at its address and (a peer) under its id, after a
    /// backoff; gives up on one that keeps failing ([`crate::supervise`]).
    pub fn supervise(&mut self) -> anyhow::Result<Vec<Event>> {
        let events = self.sup.poll();
        if events.iter().any(|e| matches!(e, Event::Restarted { .. })) {
            self.write_pids()?;
        }
        Ok(events)
    }

    /// Whether a daemon kept failing and was given up on.
    pub fn gave_up(&self) -> bool {
        self.sup.gave_up()
    }

    /// The pid of the controller (0) or of peer `i` (`i + 1`), while it runs.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.sup.pid(i)
    }

    /// `DIR/pids`: one `NAME PID` line per running daemon (`controller`, `peer-N`).
    fn write_pids(&self) -> anyhow::Result<()> {
        let text: String = (0..self.sup.daemons.len())
            .filter_map(|i| self.sup.pid(i).map(|p| format!("{} {p}\n", if i == 0 { "controller".to_string() } else { format!("peer-{}", i - 1) })))
            .collect();
        let p = self.dir.join("pids");
        std::fs::write(p.with_extension("tmp"), text)?;
        std::fs::rename(p.with_extension("tmp"), p)?;
        Ok(())
    }

    /// Stops every daemon (SIGTERM, then SIGKILL after [`proc::STOP_GRACE`]).
    pub fn stop(&mut self) {
        let n = self.sup.daemons.len();
        proc::stop_children(&mut self.sup.take_children(0..n), proc::STOP_GRACE);
    }
}

impl Drop for NearlogUp {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A controller and 3 log peers, each its own process (`understudy nearlog controller|peer`), so
/// each peer's memory can be measured alone; killed with their process groups when dropped.
pub struct LogCluster {
    pub controller: KillOnDrop,
    pub peers: Vec<(KillOnDrop, String)>,
    /// `DIR/nearlog-cluster.json`, for the shim.
    pub cluster_file: PathBuf,
    pub controller_addr: String,
    pub secret: std::sync::Arc<Vec<u8>>,
    /// Bytes each peer lends.
    pub region_bytes: u64,
}

/// Starts a [`LogCluster`] with its state in `dir`; returns once the peers registered.
pub fn start_log_cluster(rt: &tokio::runtime::Runtime, dir: &Path, region_bytes: u64) -> anyhow::Result<LogCluster> {
    std::fs::create_dir_all(dir)?;
    let dir = dir.canonicalize()?;
    let (controller, line) = spawn_self_until(&["nearlog", "controller", "--listen", "127.0.0.1:0", "--dir"], &[&dir], "nearlog controller listening on ", Duration::from_secs(30))?;
    let controller_addr = line.trim_start_matches("nearlog controller listening on ").trim().to_string();
    let secret_file = dir.join("secret");
    let secret = read_secret(&secret_file)?;
    let mut peers = vec![];
    for _ in 0..3 {
        let region = region_bytes.to_string();
        let (p, line) = spawn_self_until(
            &["nearlog", "peer", "--listen", "127.0.0.1:0", "--controller", &controller_addr, "--region-bytes", &region, "--secret-file"],
            &[&secret_file],
            "nearlog peer listening on ",
            Duration::from_secs(30),
        )?;
        let addr = line.trim_start_matches("nearlog peer listening on ").split(',').next().unwrap_or("").to_string();
        peers.push((p, addr));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(::nearlog::proto::CtlReply::Status(s)) = rt.block_on(::nearlog::driver::server::ctl_call(&controller_addr, &secret, &::nearlog::proto::CtlRequest::Status)) {
            if peers.iter().all(|(_, a)| s.peers.values().any(|i| &i.addr == a)) {
                break;
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "the log peers did not register with the controller");
        std::thread::sleep(Duration::from_millis(50));
    }
    let cluster_file = dir.join("nearlog-cluster.json");
    let cf = NearlogClusterFile { controller: controller_addr.clone(), secret_file, peers: peers.iter().map(|(_, a)| a.clone()).collect() };
    std::fs::write(&cluster_file, serde_json::to_vec_pretty(&cf)?)?;
    Ok(LogCluster { controller, peers, cluster_file, controller_addr, secret, region_bytes })
}
