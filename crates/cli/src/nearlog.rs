//! `understudy nearlog ...`: the near-compute log daemons (log peer, controller) and `up`, a
//! local controller + 3 peers for trying the LD_PRELOAD shim.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Subcommand};

use ::nearlog::core::controller::ControllerCore;
use ::nearlog::store::JsonFileStore;
use testbed::nearlog::{default_shim, ensure_secret, read_secret, NearlogClusterFile};

/// How often `nearlog up` looks for daemons that exited.
const UP_SUPERVISE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

#[derive(Subcommand, Debug)]
pub enum NearlogCmd {
    /// Run a log peer: lend --region-bytes of memory to replicated log files.
    ///
    /// Registers with the controller (and re-registers after a restart: its memory is then
    /// empty and clients re-base it), answers records, probes and fetches from clients. An op
    /// that does not fit in the region is refused loudly, never applied short.
    Peer(PeerArgs),
    /// Run the controller: peers, their free space, file placement and epochs in DIR.
    ///
    /// State lives in DIR/nearlog-controller.json, replaced atomically (fsync) before any
    /// answer, so a restart loses nothing. With --store etcd://..., run two or three
    /// controllers: they stand for leadership, the leader alone listens and keeps the state in
    /// the store (one key per peer and per file, each write guarded by its election), a
    /// standby takes over about one election lease after the leader dies.
    Controller(ControllerArgs),
    /// A local controller and 3 log peers on loopback, in the foreground until Ctrl-C.
    ///
    /// Each is its own process (`nearlog controller`, `nearlog peer`; logs in DIR/logs/); one
    /// that exits is started again at its address after a backoff (250 ms, doubled for each
    /// further exit within a minute, at most 4 s), a peer under its id with empty memory; one
    /// that exits a 6th time within a minute is given up and `nearlog up` exits non-zero.
    ///
    /// Writes DIR/nearlog-cluster.json (controller address, secret file) for the shim:
    /// `UNDERSTUDY_NEARLOG_CLUSTER=DIR/nearlog-cluster.json LD_PRELOAD=libnearlog_preload.so APP`.
    ///
    /// Restarted on the same DIR, the peers come back as the same peers (ids kept in
    /// DIR/nearlog-peer-N.id) and, where the ports are free, the controller and peers at their
    /// previous addresses. Their memory is empty: a file written before cannot be opened until
    /// `nearlog reseed` writes its local copy back to them.
    Up(UpArgs),
    /// Restore the local copies of every log file the cluster holds under DIR, before an
    /// application starts there (a new machine, or a stale local directory).
    ///
    /// An application that finds its logs by listing a directory (RocksDB's WAL directory)
    /// cannot ask for a file whose name it does not see: this brings every replicated log file
    /// under DIR back to its replicated content (missing files created; shorter, longer or
    /// different ones rewritten), each opened once through the shim, which takes a new epoch and
    /// so fences any writer still running. Run it before the application, never while it runs.
    Restore(RestoreArgs),
    /// Internal (run by `restore` under the shim): open each path once as a log file.
    #[command(hide = true)]
    OpenLogs { paths: Vec<PathBuf> },
    /// Take a log peer's lent memory back: its files move to other peers, then it frees it.
    ///
    /// The controller places every file of the peer on another peer with room (the old set
    /// stays the recovery set until the move completes); this command then moves each file
    /// (new epoch, recovery from a majority, the new peer brought up to date), and waits until
    /// the peer reports that it holds nothing. Application writers fenced by a move continue
    /// at a newer epoch after a short pause. Needs one peer beyond each file's replica count.
    Reclaim(ReclaimArgs),
    /// Re-seed log files whose peers lost them from their local copies (after every peer of a
    /// file restarted: a peer keeps files in memory only).
    ///
    /// Opening such a file fails at once with "the log peers lost this file": no majority can
    /// vouch for its acknowledged writes, and only the local copy on this machine is left. If
    /// you accept what that copy holds (it has every write the application made here, unless
    /// this machine crashed and lost unsynced data), this command makes it the file's content:
    /// it checks that the peers did lose the file (refused if a majority still holds it, or if
    /// they do not answer, unless --force), places the file on live peers at a new epoch
    /// (older writers are fenced; old copies are never read again) and writes the local copy to
    /// a majority of them. Run it before the application opens the file, never while it runs.
    Reseed(ReseedArgs),
}

#[derive(Args, Debug)]
pub struct ReseedArgs {
    /// The log files to re-seed (their local copies; the path the application opens).
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
    /// The cluster file (`nearlog-cluster.json` of `nearlog up`, or one written by hand).
    #[arg(long, env = "UNDERSTUDY_NEARLOG_CLUSTER")]
    pub cluster: PathBuf,
    /// Re-seed even if the peers still hold the file or do not answer (their content is
    /// replaced by the local copy).
    #[arg(long)]
    pub force: bool,
    /// Give up (exit non-zero) if a file is not re-seeded within this many seconds.
    #[arg(long, default_value_t = 60)]
    pub timeout_secs: u64,
}

/// `path` made absolute and normalised the way the shim names log files (`.` and `..`
/// resolved lexically, symlinks kept): the file's key at the controller.
fn log_key(path: &Path) -> anyhow::Result<String> {
    use std::path::Component;
    let abs = if path.is_absolute() { path.to_path_buf() } else { std::env::current_dir()?.join(path) };
    let mut out = PathBuf::from("/");
    for c in abs.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out.into_os_string().into_string().map_err(|p| anyhow::anyhow!("{} is not UTF-8", PathBuf::from(p).display()))
}

async fn reseed(a: ReseedArgs) -> anyhow::Result<()> {
    let cf: NearlogClusterFile = serde_json::from_slice(&std::fs::read(&a.cluster).with_context(|| format!("cannot read {}", a.cluster.display()))?)
        .with_context(|| format!("{} is not a nearlog cluster file", a.cluster.display()))?;
    let secret = read_secret(&cf.secret_file)?;
    let mut failed = 0;
    for path in a.paths {
        let key = log_key(&path)?;
        anyhow::ensure!(path.is_file(), "{} has no local copy here (nothing to re-seed from)", path.display());
        let (controller, secret, force, k) = (cf.controller.clone(), secret.clone(), a.force, key.clone());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(a.timeout_secs);
        let done = tokio::task::spawn_blocking(move || ::nearlog::driver::reseed::reseed(&controller, &secret, &k, || std::fs::read(&path), force, deadline)).await?;
        match done {
            Ok(r) => println!("re-seeded {key}: {} bytes from the local copy, on log peers {:?} at epoch {}", r.bytes, r.peers, r.epoch),
            Err(e) => {
                eprintln!("cannot re-seed {key}: {e}");
                failed += 1;
            }
        }
    }
    anyhow::ensure!(failed == 0, "{failed} file(s) not re-seeded");
    Ok(())
}

#[derive(Args, Debug)]
pub struct RestoreArgs {
    /// Directory whose log files to restore (created if missing).
    pub dir: PathBuf,
    /// The cluster file (`nearlog-cluster.json` of `nearlog up`, or one written by hand).
    #[arg(long, env = "UNDERSTUDY_NEARLOG_CLUSTER")]
    pub cluster: PathBuf,
    /// The LD_PRELOAD shim [default: libnearlog_preload.so next to this executable].
    #[arg(long, env = "UNDERSTUDY_NEARLOG_SHIM")]
    pub shim: Option<PathBuf>,
}

/// The opt-in open flag of the shim (`nearlog_preload::O_NCL`).
const O_NCL: libc::c_int = 0o40000000;

async fn restore(a: RestoreArgs) -> anyhow::Result<()> {
    let shim = match a.shim {
        Some(s) => s,
        None => default_shim()?,
    };
    anyhow::ensure!(shim.exists(), "no shim at {} (build it: cargo build --release -p nearlog-preload)", shim.display());
    let cf: NearlogClusterFile = serde_json::from_slice(&std::fs::read(&a.cluster).with_context(|| format!("cannot read {}", a.cluster.display()))?)
        .with_context(|| format!("{} is not a nearlog cluster file", a.cluster.display()))?;
    let secret = read_secret(&cf.secret_file)?;
    std::fs::create_dir_all(&a.dir).with_context(|| format!("cannot create {}", a.dir.display()))?;
    let dir = std::fs::canonicalize(&a.dir)?;
    let prefix = format!("{}/", dir.display());
    let st = match ::nearlog::driver::server::ctl_call(&cf.controller, &secret, &::nearlog::proto::CtlRequest::Status).await {
        Ok(::nearlog::proto::CtlReply::Status(s)) => s,
        Ok(other) => anyhow::bail!("controller {} answered Status with {other:?}", cf.controller),
        Err(e) => anyhow::bail!("controller {} unreachable: {e}", cf.controller),
    };
    let keys: Vec<&String> = st.files.keys().filter(|k| k.starts_with(&prefix)).collect();
    if keys.is_empty() {
        println!("no replicated log files under {}", dir.display());
        return Ok(());
    }
    let out = std::process::Command::new(std::env::current_exe()?)
        .args(["nearlog", "open-logs"])
        .args(&keys)
        .env("LD_PRELOAD", &shim)
        .env("UNDERSTUDY_NEARLOG_CLUSTER", &a.cluster)
        .env_remove("UNDERSTUDY_NEARLOG_PATTERNS")
        .output()
        .context("cannot run the restore helper")?;
    // The shim's lines (one per recovered file) go to our stderr.
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    anyhow::ensure!(out.status.success(), "restoring the log files under {} failed", dir.display());
    println!("restored {} log files under {}", keys.len(), dir.display());
    Ok(())
}

fn open_logs(paths: &[PathBuf]) -> anyhow::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    // Without the shim O_NCL is ignored and nothing would be recovered: refuse.
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    anyhow::ensure!(maps.contains("nearlog_preload"), "open-logs must run under the nearlog shim (LD_PRELOAD)");
    for p in paths {
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let c = std::ffi::CString::new(p.as_os_str().as_bytes())?;
        // SAFETY: a valid NUL-terminated path; the fd is closed right away.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC | O_NCL, 0o644) };
        anyhow::ensure!(fd >= 0, "cannot restore {}: {}", p.display(), std::io::Error::last_os_error());
        // SAFETY: closing the fd opened above.
        unsafe { libc::close(fd) };
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct ReclaimArgs {
    /// Controller address, or every controller's, comma-separated (A,B,...): the one that
    /// answers (only the leader listens) is used.
    #[arg(long)]
    pub controller: String,
    /// File holding the cluster secret.
    #[arg(long)]
    pub secret_file: PathBuf,
    /// The peer's id (as printed by the controller's status / in its log), or its address.
    #[arg(long)]
    pub peer: String,
    /// Give up (exit non-zero) if the moves are not done within this many seconds.
    #[arg(long, default_value_t = 120)]
    pub timeout_secs: u64,
}

#[derive(Args, Debug)]
pub struct PeerArgs {
    /// Bytes of memory lent to log files (K/M/G suffixes are not parsed: plain bytes).
    #[arg(long, default_value_t = 256 << 20)]
    pub region_bytes: u64,
    /// Address to serve clients on.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Controller address, or every controller's, comma-separated (A,B,...): the one that
    /// answers (only the leader listens) is used.
    #[arg(long)]
    pub controller: String,
    /// File holding the cluster secret.
    #[arg(long)]
    pub secret_file: PathBuf,
    /// Keep the id the controller gives this peer in FILE (created if missing): restarted, the
    /// peer comes back as the same peer (its memory empty), also at another address, instead
    /// of a new one beside a dead one.
    #[arg(long)]
    pub id_file: Option<PathBuf>,
    /// Keep a liveness lease in this control store (etcd://H:P[,H:P...], the controllers'
    /// --store): the leading controller takes the peer for lost once the lease expires and
    /// moves its files to live peers. Without it: liveness by heartbeats (--peer-lease-ms).
    #[arg(long, value_name = "URL")]
    pub store: Option<String>,
    /// The cluster name in the control store's keys (the controllers' --store-cluster).
    #[arg(long, value_name = "NAME", default_value = "nearlog")]
    pub store_cluster: String,
    /// The liveness lease's TTL (with --store; etcd rounds it up to whole seconds).
    #[arg(long, value_name = "MS", default_value_t = 3000)]
    pub lease_ttl_ms: u64,
}

#[derive(Args, Debug)]
pub struct ControllerArgs {
    /// Directory of the controller's state (created if missing).
    #[arg(long)]
    pub dir: PathBuf,
    /// Address to serve on.
    #[arg(long, default_value = "127.0.0.1:7801")]
    pub listen: String,
    /// File holding the cluster secret [default: DIR/secret, created if missing].
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    /// A log peer silent (no heartbeat, sent every second) for this long is lost: the
    /// controller moves each file placed on it to a live peer with room, as `nearlog reclaim`
    /// does, while a majority of the file's peers is live. 0: never (an operator reclaims).
    #[arg(long, default_value_t = ::nearlog::core::controller::DEFAULT_PEER_LEASE_MS)]
    pub peer_lease_ms: u64,
    /// Run with standbys on this control store (etcd://H:P[,H:P...], or an embedded
    /// directory): controllers stand for leadership, only the leader listens and serves, and
    /// the state lives in the store (DIR then only holds the secret). Give peers and the
    /// cluster file every controller's address (A,B,...): they use the one that answers.
    /// Without it: alone, on DIR/nearlog-controller.json.
    #[arg(long, value_name = "URL")]
    pub store: Option<String>,
    /// The cluster name in the control store's keys (one store may hold several clusters).
    #[arg(long, value_name = "NAME", default_value = "nearlog")]
    pub store_cluster: String,
    /// The election lease: a leader not renewing it for this long stops (the process exits);
    /// a standby takes over about this long after the leader dies (etcd rounds it up to whole
    /// seconds, and to at least its own minimum: 2 s with its default timings).
    #[arg(long, default_value_t = 2000)]
    pub election_ttl_ms: u64,
}

#[derive(Args, Debug)]
pub struct UpArgs {
    /// Directory for the controller state, the secret and the cluster file.
    #[arg(long, default_value = "./nearlog-data")]
    pub dir: PathBuf,
    /// Bytes each of the 3 peers lends.
    #[arg(long, default_value_t = 256 << 20)]
    pub region_bytes: u64,
    /// Controller port (0: any free port).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
}

/// `nearlog controller --store URL`: stands for leadership; while a standby it does not listen
/// (peers and shims get "connection refused" at once and try the next address); once leader it
/// loads the state from the store, listens and serves; when it loses its lease (or a guarded
/// write fails) the process exits at once, so nothing it still holds can be served or
/// committed (a supervisor restarts it as a standby).
async fn run_controller_standby(a: &ControllerArgs, url: &str, secret: std::sync::Arc<Vec<u8>>) -> anyhow::Result<()> {
    use ::nearlog::driver::control_store::{ControlBridge, ControllerControl};
    anyhow::ensure!(a.election_ttl_ms >= 1000, "--election-ttl-ms must be at least 1000 (etcd leases are whole seconds)");
    // Checked before standing: a leader that cannot bind its address would hold the election
    // while nobody serves.
    let probe = std::net::TcpListener::bind(&a.listen).with_context(|| format!("cannot listen on {}", a.listen))?;
    let advertise = probe.local_addr()?.to_string();
    drop(probe);
    let ctl = ControllerControl {
        store_url: url.to_string(),
        cluster: a.store_cluster.clone(),
        cluster_id: ::nearlog::driver::control_store::cluster_id_from_secret(&secret),
        election_ttl: std::time::Duration::from_millis(a.election_ttl_ms),
        advertise: advertise.clone(),
    };
    println!("nearlog controller standing by on {url} (will serve on {advertise})");
    let (bridge, token) = tokio::task::spawn_blocking(move || ControlBridge::lead(ctl)).await?.map_err(anyhow::Error::msg)?;
    let store = bridge.meta_store();
    // Every peer gets a whole lease from now: the core counts silence from its first input.
    let core = tokio::task::spawn_blocking(move || ControllerCore::open(store)).await??.with_peer_lease_ms(a.peer_lease_ms);
    let l = tokio::net::TcpListener::bind(&advertise).await.with_context(|| format!("cannot listen on {advertise}"))?;
    println!("nearlog controller leading (fencing token {token}): {} peers, {} files; listening on {}", core.state().peers.len(), core.state().files.len(), l.local_addr()?);
    // Peers started with --store keep their leases in etcd. An embedded store is a directory
    // this process holds locked: no peer can register there, so they keep heartbeats.
    let leases = if url.starts_with("etcd://") {
        Some(control::Store::open(url, &a.store_cluster, &::nearlog::driver::control_store::cluster_id_from_secret(&secret)).await?)
    } else {
        None
    };
    tokio::select! {
        r = ::nearlog::driver::server::run_controller_with(l, core, secret, leases) => r?,
        why = bridge.lost() => {
            println!("nearlog controller: leadership lost ({why}): stopping");
            std::process::exit(3);
        }
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}

pub async fn run(cmd: NearlogCmd) -> anyhow::Result<()> {
    match cmd {
        NearlogCmd::Peer(a) => {
            crate::daemons::link_tls_at_start()?;
            let secret = read_secret(&a.secret_file)?;
            let l = tokio::net::TcpListener::bind(&a.listen).await.with_context(|| format!("cannot listen on {}", a.listen))?;
            let addr = l.local_addr()?.to_string();
            println!("nearlog peer listening on {addr}, region {} bytes", a.region_bytes);
            let lease = match &a.store {
                None => None,
                Some(url) => {
                    anyhow::ensure!(url.starts_with("etcd://"), "--store {url:?}: a peer's lease must be in a store the controllers share: etcd://H:P[,H:P...]");
                    anyhow::ensure!(a.lease_ttl_ms >= 1000, "--lease-ttl-ms must be at least 1000 (etcd leases are whole seconds)");
                    Some(::nearlog::driver::server::PeerLease {
                        store_url: url.clone(),
                        cluster: a.store_cluster.clone(),
                        cluster_id: ::nearlog::driver::control_store::cluster_id_from_secret(&secret),
                        ttl: std::time::Duration::from_millis(a.lease_ttl_ms),
                    })
                }
            };
            tokio::select! {
                r = ::nearlog::driver::server::run_peer_leased(l, addr, a.controller, secret, a.region_bytes, a.id_file, lease) => r?,
                _ = tokio::signal::ctrl_c() => {}
            }
            Ok(())
        }
        NearlogCmd::Controller(a) => {
            crate::daemons::link_tls_at_start()?;
            std::fs::create_dir_all(&a.dir).with_context(|| format!("cannot create {}", a.dir.display()))?;
            let secret = ensure_secret(&a.secret_file.clone().unwrap_or_else(|| a.dir.join("secret")))?;
            if let Some(url) = &a.store {
                return run_controller_standby(&a, url, secret).await;
            }
            let core = ControllerCore::open(JsonFileStore::new(&a.dir))?.with_peer_lease_ms(a.peer_lease_ms);
            let l = tokio::net::TcpListener::bind(&a.listen).await.with_context(|| format!("cannot listen on {}", a.listen))?;
            println!("nearlog controller listening on {}", l.local_addr()?);
            tokio::select! {
                r = ::nearlog::driver::server::run_controller(l, core, secret) => r?,
                _ = tokio::signal::ctrl_c() => {}
            }
            Ok(())
        }
        NearlogCmd::Reclaim(a) => {
            let secret = read_secret(&a.secret_file)?;
            let moved = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<String>> {
                let peer = match a.peer.parse::<::nearlog::proto::PeerId>() {
                    Ok(id) => id,
                    Err(_) => match ::nearlog::driver::mover::ctl_call(&a.controller, &secret, &::nearlog::proto::CtlRequest::Status).map_err(anyhow::Error::msg)? {
                        ::nearlog::proto::CtlReply::Status(st) => {
                            *st.peers.iter().find(|(_, p)| p.addr == a.peer).with_context(|| format!("no peer at {}", a.peer))?.0
                        }
                        other => anyhow::bail!("unexpected answer {other:?}"),
                    },
                };
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(a.timeout_secs);
                ::nearlog::driver::mover::reclaim(&a.controller, &secret, peer, deadline).map_err(anyhow::Error::msg)
            })
            .await??;
            println!("reclaimed: {} file(s) moved: {moved:?}", moved.len());
            Ok(())
        }
        NearlogCmd::Up(a) => {
            crate::daemons::link_tls_at_start()?;
            let mut up = testbed::nearlog::up(&a.dir, a.region_bytes, a.port).await?;
            println!("nearlog controller {}", up.controller);
            for p in &up.peers {
                println!("nearlog peer {p}");
            }
            println!("cluster file {}", up.cluster_file.display());
            println!("ready");
            let signal = testbed::proc::shutdown_signal();
            tokio::pin!(signal);
            loop {
                tokio::select! {
                    sig = &mut signal => {
                        eprintln!("nearlog up: {sig} received, stopping");
                        break;
                    }
                    _ = tokio::time::sleep(UP_SUPERVISE_INTERVAL) => {
                        for e in up.supervise()? {
                            eprintln!("nearlog up: {e}");
                        }
                        // Restarting it again would only hide a broken disk or configuration.
                        if up.gave_up() {
                            up.stop();
                            anyhow::bail!("a daemon keeps failing (see above); stopped the cluster");
                        }
                    }
                }
            }
            up.stop();
            Ok(())
        }
        NearlogCmd::Restore(a) => restore(a).await,
        NearlogCmd::Reseed(a) => reseed(a).await,
        NearlogCmd::OpenLogs { paths } => open_logs(&paths),
    }
}

pub use eval::nearlog::{bench, NearlogBench};

