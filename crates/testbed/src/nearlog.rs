//! A local near-compute log cluster (SplitFT): a controller and 3 log peers as tasks of this
//! process, what `understudy nearlog up` runs, and the cluster file the LD_PRELOAD shim reads.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use std::time::{Duration, Instant};

use anyhow::Context;

use crate::proc::{spawn_self_until, KillOnDrop};
use ::nearlog::core::controller::ControllerCore;
use ::nearlog::store::JsonFileStore;

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

/// A running `nearlog up` cluster: its tasks live on the caller's tokio runtime.
pub struct NearlogUp {
    pub controller: String,
    pub peers: Vec<String>,
    /// `DIR/nearlog-cluster.json`, for `UNDERSTUDY_NEARLOG_CLUSTER`.
    pub cluster_file: PathBuf,
}

/// Starts a controller and 3 peers (each lending `region_bytes`) in this process, state and
/// secret in `dir`; returns once the peers registered (or after about 5 s) and the cluster file
/// is written. The controller listens on `port` (0: the last run's address if free, else any).
pub async fn up(dir: &Path, region_bytes: u64, port: u16) -> anyhow::Result<NearlogUp> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let dir = std::fs::canonicalize(dir)?;
    let secret_file = dir.join("secret");
    let secret = ensure_secret(&secret_file)?;
    let core = ControllerCore::open(JsonFileStore::new(&dir))?;
    let cluster = dir.join("nearlog-cluster.json");
    // A restart on the same DIR comes back at the addresses of the last run where they
    // are free (an application still running keeps reaching them), else at new ones.
    let last: Option<NearlogClusterFile> = std::fs::read(&cluster).ok().and_then(|b| serde_json::from_slice(&b).ok());
    let cl = match (port, &last) {
        (0, Some(last)) => match tokio::net::TcpListener::bind(last.controller.as_str()).await {
            Ok(l) => l,
            Err(_) => tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?,
        },
        (port, _) => tokio::net::TcpListener::bind(("127.0.0.1", port)).await?,
    };
    let controller = cl.local_addr()?.to_string();
    tokio::spawn(::nearlog::driver::server::run_controller(cl, core, secret.clone()));
    let mut peers = Vec::new();
    for i in 0..3 {
        let before = last.as_ref().and_then(|c| c.peers.get(i));
        let l = match before {
            Some(b) => match tokio::net::TcpListener::bind(b.as_str()).await {
                Ok(l) => l,
                Err(_) => tokio::net::TcpListener::bind("127.0.0.1:0").await?,
            },
            None => tokio::net::TcpListener::bind("127.0.0.1:0").await?,
        };
        let addr = l.local_addr()?.to_string();
        peers.push(addr.clone());
        // Each peer keeps its id in DIR: restarted, the controller knows it as the same
        // peer (memory empty) rather than a fourth one beside a dead one.
        let id_file = dir.join(format!("nearlog-peer-{i}.id"));
        tokio::spawn(::nearlog::driver::server::run_peer_as(l, addr, controller.clone(), secret.clone(), region_bytes, Some(id_file)));
    }
    // Wait until the 3 peers registered.
    for _ in 0..100 {
        if let Ok(::nearlog::proto::CtlReply::Status(s)) = ::nearlog::driver::server::ctl_call(&controller, &secret, &::nearlog::proto::CtlRequest::Status).await {
            if peers.iter().all(|p| s.peers.values().any(|i| &i.addr == p && i.live)) {
                break;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let cf = NearlogClusterFile { controller: controller.clone(), secret_file, peers: peers.clone() };
    let tmp = dir.join("nearlog-cluster.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&cf)?)?;
    std::fs::rename(&tmp, &cluster)?;
    Ok(NearlogUp { controller, peers, cluster_file: cluster })
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
