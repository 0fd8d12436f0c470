//! `understudy nearlog ...`: the near-compute log daemons (log peer, controller) and `up`, a
//! local controller + 3 peers for trying the LD_PRELOAD shim.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, Subcommand};

use ::nearlog::controller::{ControllerCore, JsonFileStore};

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
    /// answer, so a restart loses nothing.
    Controller(ControllerArgs),
    /// A local controller and 3 log peers on loopback, in the foreground until Ctrl-C.
    ///
    /// Writes DIR/nearlog-cluster.json (controller address, secret file) for the shim:
    /// `UNDERSTUDY_NEARLOG_CLUSTER=DIR/nearlog-cluster.json LD_PRELOAD=libnearlog_preload.so APP`.
    Up(UpArgs),
    /// Take a log peer's lent memory back: its files move to other peers, then it frees it.
    ///
    /// The controller places every file of the peer on another peer with room (the old set
    /// stays the recovery set until the move completes); this command then moves each file
    /// (new epoch, recovery from a majority, the new peer brought up to date), and waits until
    /// the peer reports that it holds nothing. Application writers fenced by a move continue
    /// at a newer epoch after a short pause. Needs one peer beyond each file's replica count.
    Reclaim(ReclaimArgs),
}

#[derive(Args, Debug)]
pub struct ReclaimArgs {
    /// Controller address.
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
    /// Controller address.
    #[arg(long)]
    pub controller: String,
    /// File holding the cluster secret.
    #[arg(long)]
    pub secret_file: PathBuf,
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

pub async fn run(cmd: NearlogCmd) -> anyhow::Result<()> {
    match cmd {
        NearlogCmd::Peer(a) => {
            let secret = read_secret(&a.secret_file)?;
            let l = tokio::net::TcpListener::bind(&a.listen).await.with_context(|| format!("cannot listen on {}", a.listen))?;
            let addr = l.local_addr()?.to_string();
            println!("nearlog peer listening on {addr}, region {} bytes", a.region_bytes);
            tokio::select! {
                r = ::nearlog::server::run_peer(l, addr, a.controller, secret, a.region_bytes) => r?,
                _ = tokio::signal::ctrl_c() => {}
            }
            Ok(())
        }
        NearlogCmd::Controller(a) => {
            std::fs::create_dir_all(&a.dir).with_context(|| format!("cannot create {}", a.dir.display()))?;
            let secret = ensure_secret(&a.secret_file.clone().unwrap_or_else(|| a.dir.join("secret")))?;
            let core = ControllerCore::open(JsonFileStore::new(&a.dir))?;
            let l = tokio::net::TcpListener::bind(&a.listen).await.with_context(|| format!("cannot listen on {}", a.listen))?;
            println!("nearlog controller listening on {}", l.local_addr()?);
            tokio::select! {
                r = ::nearlog::server::run_controller(l, core, secret) => r?,
                _ = tokio::signal::ctrl_c() => {}
            }
            Ok(())
        }
        NearlogCmd::Reclaim(a) => {
            let secret = read_secret(&a.secret_file)?;
            let moved = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<String>> {
                let peer = match a.peer.parse::<::nearlog::proto::PeerId>() {
                    Ok(id) => id,
                    Err(_) => match ::nearlog::mover::ctl_call(&a.controller, &secret, &::nearlog::proto::CtlRequest::Status).map_err(anyhow::Error::msg)? {
                        ::nearlog::proto::CtlReply::Status(st) => {
                            *st.peers.iter().find(|(_, p)| p.addr == a.peer).with_context(|| format!("no peer at {}", a.peer))?.0
                        }
                        other => anyhow::bail!("unexpected answer {other:?}"),
                    },
                };
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(a.timeout_secs);
                ::nearlog::mover::reclaim(&a.controller, &secret, peer, deadline).map_err(anyhow::Error::msg)
            })
            .await??;
            println!("reclaimed: {} file(s) moved: {moved:?}", moved.len());
            Ok(())
        }
        NearlogCmd::Up(a) => {
            std::fs::create_dir_all(&a.dir).with_context(|| format!("cannot create {}", a.dir.display()))?;
            let dir = std::fs::canonicalize(&a.dir)?;
            let secret_file = dir.join("secret");
            let secret = ensure_secret(&secret_file)?;
            let core = ControllerCore::open(JsonFileStore::new(&dir))?;
            let cl = tokio::net::TcpListener::bind(("127.0.0.1", a.port)).await?;
            let controller = cl.local_addr()?.to_string();
            tokio::spawn(::nearlog::server::run_controller(cl, core, secret.clone()));
            let mut peers = Vec::new();
            for _ in 0..3 {
                let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                let addr = l.local_addr()?.to_string();
                peers.push(addr.clone());
                tokio::spawn(::nearlog::server::run_peer(l, addr, controller.clone(), secret.clone(), a.region_bytes));
            }
            // Wait until the 3 peers registered.
            for _ in 0..100 {
                if let Ok(::nearlog::proto::CtlReply::Status(s)) = ::nearlog::server::ctl_call(&controller, &secret, &::nearlog::proto::CtlRequest::Status).await {
                    if peers.iter().all(|p| s.peers.values().any(|i| &i.addr == p)) {
                        break;
                    }
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            let cluster = dir.join("nearlog-cluster.json");
            let cf = NearlogClusterFile { controller: controller.clone(), secret_file, peers: peers.clone() };
            let tmp = dir.join("nearlog-cluster.json.tmp");
            std::fs::write(&tmp, serde_json::to_vec_pretty(&cf)?)?;
            std::fs::rename(&tmp, &cluster)?;
            println!("nearlog controller {controller}");
            for p in &peers {
                println!("nearlog peer {p}");
            }
            println!("cluster file {}", cluster.display());
            println!("ready");
            tokio::signal::ctrl_c().await?;
            Ok(())
        }
    }
}

// ---------------------------------------------------------------------------------------------
// `understudy bench nearlog apps`

#[derive(Subcommand, Debug)]
pub enum NearlogBench {
    /// Redis (appendfsync always) and SQLite (WAL, synchronous=FULL): strong, weak, nearlog.
    ///
    /// strong: the log fsync'd to the storage directory; weak: not synced (Redis appendfsync
    /// no, SQLite synchronous=OFF); nearlog: fsync'd through the LD_PRELOAD shim to 3 log peers
    /// (`understudy nearlog up` as a child). Redis SET throughput and latency at 1, 8 and 50
    /// clients, SQLite single-writer inserts, write+fsync latency of 64 B against a loopback TCP
    /// round trip measured in the same run, peak RSS of the peers' process and of redis-server.
    /// Needs redis-server, python3 and the shim (cargo build --release -p nearlog-preload).
    Apps(AppsBenchArgs),
}

/// Options of `understudy bench nearlog apps`.
#[derive(Args, Debug)]
pub struct AppsBenchArgs {
    /// A short run (under a minute) that still measures every figure.
    #[arg(long)]
    pub quick: bool,
    /// Where the raw samples (CSV) go [default: target/bench/nearlog].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// The LD_PRELOAD shim [default: libnearlog_preload.so next to this executable].
    #[arg(long, env = "UNDERSTUDY_NEARLOG_SHIM")]
    pub shim: Option<PathBuf>,
    /// Directory standing for disaggregated storage (bulk files, and the WAL of `strong`/`weak`)
    /// [default: a temporary directory under the current directory].
    #[arg(long)]
    pub storage: Option<PathBuf>,
}

struct BenchEnv {
    shim: PathBuf,
    cluster_file: PathBuf,
}

impl BenchEnv {
    fn apply(&self, c: &mut std::process::Command, patterns: &str) {
        c.env("LD_PRELOAD", &self.shim).env("UNDERSTUDY_NEARLOG_CLUSTER", &self.cluster_file).env("UNDERSTUDY_NEARLOG_PATTERNS", patterns);
    }
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Setup {
    Strong,
    Weak,
    Nearlog,
}

impl Setup {
    fn name(self) -> &'static str {
        match self {
            Setup::Strong => "strong",
            Setup::Weak => "weak",
            Setup::Nearlog => "nearlog",
        }
    }
}

struct KillOnDrop(std::process::Child);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn rss_bytes(pid: u32, field: &str) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with(field))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024.0)
}

/// A minimal blocking RESP client (SET/PING), enough for the load.
struct Resp {
    w: std::net::TcpStream,
    r: std::io::BufReader<std::net::TcpStream>,
}

impl Resp {
    fn connect(port: u16) -> anyhow::Result<Resp> {
        let start = std::time::Instant::now();
        loop {
            match std::net::TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => {
                    s.set_nodelay(true)?;
                    return Ok(Resp { r: std::io::BufReader::new(s.try_clone()?), w: s });
                }
                Err(_) if start.elapsed() < std::time::Duration::from_secs(30) => std::thread::sleep(std::time::Duration::from_millis(20)),
                Err(e) => anyhow::bail!("redis on port {port} not reachable: {e}"),
            }
        }
    }
    fn cmd(&mut self, args: &[&[u8]]) -> anyhow::Result<String> {
        use std::io::{BufRead, Write};
        let mut m = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            m.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            m.extend_from_slice(a);
            m.extend_from_slice(b"\r\n");
        }
        self.w.write_all(&m)?;
        let mut line = String::new();
        self.r.read_line(&mut line)?;
        Ok(line.trim_end().to_string())
    }
}

fn redis_run(env: &BenchEnv, setup: Setup, storage: &Path, clients: usize, secs: f64, samples: &mut Vec<(String, usize, u64)>) -> anyhow::Result<(f64, bench::LatencySummary, Option<f64>)> {
    let dir = storage.join(format!("redis-{}-c{clients}", setup.name()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut c = std::process::Command::new("redis-server");
    let fsync = if setup == Setup::Weak { "no" } else { "always" };
    c.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--dir"])
        .arg(&dir)
        .args(["--appendonly", "yes", "--appendfsync", fsync, "--save", "", "--daemonize", "no", "--logfile", "", "--maxclients", "1000"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit());
    if setup == Setup::Nearlog {
        env.apply(&mut c, "*.incr.aof");
    }
    let server = KillOnDrop(c.spawn().context("cannot start redis-server (Debian package redis-server)")?);
    let pid = server.0.id();
    // Wait until it answers.
    let mut probe = Resp::connect(port)?;
    while probe.cmd(&[b"PING"])?.starts_with("-LOADING") {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs_f64(secs);
    let value = vec![b'v'; 100];
    let handles: Vec<_> = (0..clients)
        .map(|t| {
            let value = value.clone();
            std::thread::spawn(move || -> anyhow::Result<(u64, bench::LatencyRecorder)> {
                let mut c = Resp::connect(port)?;
                let mut rec = bench::LatencyRecorder::new();
                let mut n = 0u64;
                while std::time::Instant::now() < deadline {
                    let key = format!("k{t}:{n}");
                    let t0 = std::time::Instant::now();
                    let r = c.cmd(&[b"SET", key.as_bytes(), &value])?;
                    anyhow::ensure!(r == "+OK", "SET answered {r}");
                    rec.record(t0.elapsed());
                    n += 1;
                }
                Ok((n, rec))
            })
        })
        .collect();
    let start = std::time::Instant::now();
    let mut total = 0;
    let mut rec = bench::LatencyRecorder::new();
    for h in handles {
        let (n, r) = h.join().map_err(|_| anyhow::anyhow!("client thread panicked"))??;
        total += n;
        rec.merge(&r);
    }
    let elapsed = start.elapsed().as_secs_f64().max(secs);
    let rss = rss_bytes(pid, "VmRSS:");
    samples.push((format!("redis.{}", setup.name()), clients, total));
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
    Ok((total as f64 / elapsed, rec.summary(), rss))
}

const SQLITE_LOAD: &str = r#"
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("PRAGMA synchronous=" + sys.argv[2])
db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB)")
secs = float(sys.argv[3])
v = b"x" * 100
n = 0
lat = []
end = time.perf_counter() + secs
start = time.perf_counter()
while True:
    t0 = time.perf_counter()
    if t0 >= end:
        break
    db.execute("INSERT INTO t (v) VALUES (?)", (v,))
    lat.append(time.perf_counter() - t0)
    n += 1
el = time.perf_counter() - start
lat.sort()
print(n / el, lat[len(lat) // 2] * 1e6)
"#;

const WRITE_FSYNC: &str = r#"
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
lat = []
buf = b"r" * 64
for i in range(int(sys.argv[2])):
    t0 = time.perf_counter_ns()
    os.write(fd, buf)
    os.fsync(fd)
    lat.append(time.perf_counter_ns() - t0)
lat.sort()
print(lat[len(lat) // 2] / 1000.0)
"#;

fn python(env: Option<(&BenchEnv, &str)>, script: &str, args: &[String]) -> anyhow::Result<String> {
    let mut c = std::process::Command::new("python3");
    c.arg("-c").arg(script).args(args);
    if let Some((e, pat)) = env {
        e.apply(&mut c, pat);
    }
    let out = c.output().context("cannot run python3")?;
    anyhow::ensure!(out.status.success(), "python3 failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Median TCP round trip on loopback (64-byte ping-pong), microseconds.
fn loopback_rtt_us(rounds: usize) -> anyhow::Result<f64> {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = l.accept()?;
        s.set_nodelay(true)?;
        let mut b = [0u8; 64];
        loop {
            if s.read_exact(&mut b).is_err() {
                return Ok(());
            }
            s.write_all(&b)?;
        }
    });
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let mut rec = bench::LatencyRecorder::new();
    let mut b = [7u8; 64];
    for _ in 0..rounds {
        let t0 = std::time::Instant::now();
        s.write_all(&b)?;
        s.read_exact(&mut b)?;
        rec.record_us(t0.elapsed().as_nanos() as u64 / 1000);
    }
    drop(s);
    let _ = echo.join();
    Ok(rec.summary().p50_us as f64)
}

pub fn bench_apps(a: AppsBenchArgs) -> anyhow::Result<()> {
    let shim = match a.shim {
        Some(s) => s,
        None => std::env::current_exe()?.parent().unwrap().join("libnearlog_preload.so"),
    };
    anyhow::ensure!(shim.exists(), "no shim at {} (build it: cargo build --release -p nearlog-preload)", shim.display());
    let out = bench::out_dir("nearlog", a.out.clone())?;
    let tmp = match &a.storage {
        Some(d) => tempfile::Builder::new().prefix("nearlog-bench-").tempdir_in(d)?,
        None => tempfile::Builder::new().prefix("nearlog-bench-").tempdir_in(".")?,
    };
    let storage = tmp.path().join("storage");
    std::fs::create_dir_all(&storage)?;
    // Log peers and controller: `understudy nearlog up` as a child (so its memory is its own).
    let mut up = std::process::Command::new(std::env::current_exe()?);
    up.args(["nearlog", "up", "--dir"]).arg(tmp.path().join("cluster")).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::null());
    let mut child = KillOnDrop(up.spawn()?);
    {
        use std::io::BufRead;
        let mut lines = std::io::BufReader::new(child.0.stdout.take().unwrap()).lines();
        loop {
            let l = lines.next().context("nearlog up exited")??;
            if l == "ready" {
                break;
            }
        }
        std::thread::spawn(move || for _ in lines {});
    }
    let env = BenchEnv { shim, cluster_file: tmp.path().join("cluster/nearlog-cluster.json") };
    let mut report = bench::Report::new("nearlog.apps", a.quick);
    let secs = if a.quick { 2.0 } else { 10.0 };
    let setups = [Setup::Strong, Setup::Weak, Setup::Nearlog];
    let mut samples = Vec::new();

    let rtt = loopback_rtt_us(if a.quick { 2000 } else { 20000 })?;
    report.figure("loopback.rtt.latency_us_p50", rtt)?;
    eprintln!("loopback rtt p50 {rtt} us");

    // write+fsync of 64 B through the shim, and to the storage directory for comparison.
    let n = if a.quick { 500 } else { 5000 }.to_string();
    let near_wf: f64 = python(Some((&env, "*.nlog")), WRITE_FSYNC, &[storage.join("x.nlog").display().to_string(), n.clone()])?.parse()?;
    let strong_wf: f64 = python(None, WRITE_FSYNC, &[storage.join("y.log").display().to_string(), n])?.parse()?;
    report.figure("nearlog.write_fsync.latency_us_p50", near_wf)?;
    report.figure("strong.write_fsync.latency_us_p50", strong_wf)?;
    report.ratio("nearlog_vs_loopback_rtt.write_fsync.latency_p50", near_wf, rtt)?;
    report.ratio("nearlog_vs_strong.write_fsync.latency_p50", near_wf, strong_wf)?;
    eprintln!("write+fsync p50: nearlog {near_wf} us, strong {strong_wf} us");

    // Redis: SET at 1, 8, 50 clients; setups alternate within each client count.
    let mut tput = std::collections::BTreeMap::new();
    for clients in [1usize, 8, 50] {
        for s in setups {
            let (ops, lat, rss) = redis_run(&env, s, &storage, clients, secs, &mut samples)?;
            eprintln!("redis {} c{clients}: {ops:.0} ops/s, p50 {} us", s.name(), lat.p50_us);
            report.figure(&format!("redis.{}.c{clients}.throughput_ops_per_s", s.name()), ops)?;
            report.latency(&format!("redis.{}.c{clients}.set.latency", s.name()), &lat)?;
            if let (Some(rss), 1) = (rss, clients) {
                report.figure(&format!("redis.{}.c1.server_rss_bytes", s.name()), rss)?;
            }
            tput.insert((s.name(), clients), ops);
        }
    }
    for c in [1usize, 8, 50] {
        report.ratio(&format!("nearlog_vs_strong.redis.c{c}.throughput"), tput[&("nearlog", c)], tput[&("strong", c)])?;
        report.ratio(&format!("nearlog_vs_weak.redis.c{c}.throughput"), tput[&("nearlog", c)], tput[&("weak", c)])?;
    }

    // SQLite: one writer, autocommit inserts.
    let mut sq = std::collections::BTreeMap::new();
    for s in setups {
        let db = storage.join(format!("sqlite-{}.db", s.name()));
        let sync = if s == Setup::Weak { "OFF" } else { "FULL" };
        let e = if s == Setup::Nearlog { Some((&env, "*-wal")) } else { None };
        let line = python(e, SQLITE_LOAD, &[db.display().to_string(), sync.into(), secs.to_string()])?;
        let mut it = line.split_whitespace();
        let ops: f64 = it.next().context("sqlite output")?.parse()?;
        let p50: f64 = it.next().context("sqlite output")?.parse()?;
        eprintln!("sqlite {}: {ops:.0} inserts/s, p50 {p50:.0} us", s.name());
        report.figure(&format!("sqlite.{}.c1.throughput_ops_per_s", s.name()), ops)?;
        report.figure(&format!("sqlite.{}.c1.insert.latency_us_p50", s.name()), p50)?;
        sq.insert(s.name(), ops);
    }
    report.ratio("nearlog_vs_strong.sqlite.c1.throughput", sq["nearlog"], sq["strong"])?;
    report.ratio("nearlog_vs_weak.sqlite.c1.throughput", sq["nearlog"], sq["weak"])?;

    // Memory: the process holding the controller and the 3 peers (their regions hold the logs).
    if let Some(hwm) = rss_bytes(child.0.id(), "VmHWM:") {
        report.figure("peers.controller_and_3_peers.peak_rss_bytes", hwm)?;
    }
    let rows: Vec<Vec<String>> = samples.iter().map(|(n, c, ops)| vec![n.clone(), c.to_string(), ops.to_string()]).collect();
    let _ = bench::write_csv(&out.join("apps.csv"), &["setup", "clients", "ops"], rows);
    drop(child);
    report.print();
    Ok(())
}
