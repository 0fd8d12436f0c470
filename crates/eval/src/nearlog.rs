//! `understudy bench nearlog ...`: SplitFT's evaluation (slides: "Insert-only workload",
//! "RocksDB Latency vs. Throughput", "YCSB Throughput", "Application recovery time with 60MB of
//! log") on this machine.
//!
//! Every scenario runs on a *testbed*: a local Understudy cluster (4 shards, 3 replicas, child
//! processes) with one volume attached as ext4 (`volume attach --foreground`: FUSE + loop +
//! mkfs.ext4), which holds every bulk file and the logs of `strong` and `weak`; and a nearlog
//! controller with 3 log peers, each its own process (so each peer's memory is measured alone).
//! The three setups of an application differ only in how its log is made durable:
//! - `strong`: the log fsync'd to the volume (Redis `appendfsync always`, SQLite
//!   `synchronous=FULL`, RocksDB `WriteOptions.sync`);
//! - `weak`: the log written to the volume and never synced (`appendfsync no`,
//!   `synchronous=OFF`, `sync=false`): fast, and a crash loses acknowledged writes;
//! - `nearlog`: as `strong`, under the LD_PRELOAD shim, which replicates the log files to the
//!   3 peers and makes their fsync free.
//!
//! Latency settings: `local` (the volume as it is on this machine: shards fdatasync to the local
//! disk) and `cloud` (shards add 0.5 ms per write and 1 ms per flush before acking, EBS gp3's
//! order). Figures of `local` carry no prefix (`nearlog_vs_strong.redis.c1.throughput`); figures
//! of `cloud` are prefixed `cloud_disk.`. Every figure names the client count (`cN`). Setups are
//! measured in interleaved rounds (ABBA, BENCH.md) within each application and client count.
//!
//! This file holds what the three experiments share (their options, the testbed, the setups and
//! each application's load); [`apps`], [`ycsb`] and [`recovery`] are the experiments.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};

use testbed::nearlog::{default_shim, start_log_cluster, LogCluster};
use ::ycsb::redis::{BlockingClient, Reply};
use testbed::proc::{app_command, KillOnDrop};
use testbed::volume::{start_attached, AttachedVolume};

pub mod apps;
pub mod recovery;
pub mod ycsb;

#[derive(Subcommand, Debug)]
pub enum NearlogBench {
    /// Insert-only: Redis, SQLite and RocksDB, strong vs weak vs nearlog, bulk files on a volume.
    ///
    /// Redis SET (appendfsync always) and RocksDB puts (synced WAL) at 1, 8 and 50 clients,
    /// SQLite autocommit inserts (WAL, synchronous=FULL) with one writer; write+fsync latency of
    /// 64 B through the shim against a loopback TCP round trip measured in the same run; the
    /// peers' memory against their lent region and the shim's addition to a process's resident
    /// memory. Plots latency against throughput per application. Needs redis-server, python3,
    /// cc and librocksdb-dev, and the shim (cargo build --release -p nearlog-preload).
    Apps(AppsBenchArgs),
    /// YCSB A–F over Redis through the project's driver: strong vs weak vs nearlog.
    ///
    /// Records are loaded with appendfsync no (not measured), then the setup's appendfsync is
    /// set and the run phase measured; every read is checked against what the driver wrote.
    Ycsb(YcsbBenchArgs),
    /// Recovery of a 60 MB log from the peers (empty local directory) against reading 60 MB
    /// from the volume, and RocksDB's restart with a 60 MB WAL (nearlog vs strong).
    Recovery(RecoveryBenchArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LatencyChoice {
    /// The volume as it is on this machine.
    Local,
    /// Shards add 0.5 ms per write and 1 ms per flush (a cloud disk).
    Cloud,
    /// Both, one after the other.
    Both,
}

/// Options every `bench nearlog` scenario takes.
#[derive(Args, Debug)]
pub struct CommonArgs {
    /// A short run (about a minute) that still measures every figure (latency setting `local`
    /// unless --latency says otherwise).
    #[arg(long)]
    pub quick: bool,
    /// Where plots (SVG, PNG) and raw samples (CSV) go [default: target/bench/nearlog].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// The LD_PRELOAD shim [default: libnearlog_preload.so next to this executable].
    #[arg(long, env = "UNDERSTUDY_NEARLOG_SHIM")]
    pub shim: Option<PathBuf>,
    /// Disk latency of the volume's shards [default: local with --quick, both otherwise].
    #[arg(long, value_enum)]
    pub latency: Option<LatencyChoice>,
    /// Interleaved rounds of the setups [default: 1 with --quick, 2 otherwise; `apps` runs Redis
    /// at 50 or more clients at least 5 and takes its ratios from the median round].
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Seconds of one measured run [default: 0.75 with --quick, 8 otherwise].
    #[arg(long)]
    pub secs: Option<f64>,
    /// A plain directory instead of an Understudy volume for the bulk files and the logs of
    /// strong/weak (for machines without FUSE or loop devices; --latency is then ignored).
    #[arg(long, value_name = "DIR")]
    pub storage: Option<PathBuf>,
    /// Bytes each of the 3 log peers lends.
    #[arg(long, default_value_t = 256 << 20)]
    pub region_bytes: u64,
}

#[derive(Args, Debug)]
pub struct AppsBenchArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Applications to run (comma-separated; a subset leaves the others' figures out).
    #[arg(long, value_delimiter = ',', default_value = "redis,sqlite,rocksdb")]
    pub apps: Vec<String>,
    /// Client counts of Redis and RocksDB (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8,50")]
    pub clients: Vec<usize>,
    /// Also drive Redis at 50 or more clients with `redis-benchmark` (Debian's redis-tools: one
    /// thread, the clients' connections on one epoll loop, SET of 100 B to random keys) and report
    /// `redis_benchmark.*` figures and ratios beside the built-in load's. The built-in load (one
    /// OS thread per client, blocking round trips) takes most of a core on a 2-core machine that
    /// Redis and the log peers share; redis-benchmark's one thread takes far less, as a load from
    /// other machines would.
    #[arg(long)]
    pub redis_benchmark: bool,
}

#[derive(Args, Debug)]
pub struct YcsbBenchArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Closed-loop clients.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Records loaded before each run [default: 2000 with --quick, 20000 otherwise].
    #[arg(long)]
    pub records: Option<u64>,
    /// Workloads (comma-separated).
    #[arg(long, default_value = "a,b,c,d,e,f")]
    pub workloads: String,
}

#[derive(Args, Debug)]
pub struct RecoveryBenchArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Bytes of log to recover.
    #[arg(long, default_value_t = 60_000_000)]
    pub log_bytes: u64,
}

pub fn bench(b: NearlogBench, _verbose: u8) -> anyhow::Result<bench::Report> {
    match b {
        NearlogBench::Apps(a) => apps::run(a),
        NearlogBench::Ycsb(a) => ycsb::run(a),
        NearlogBench::Recovery(a) => recovery::run(a),
    }
}

// ---------------------------------------------------------------------------------------------
// Setups, processes, testbed

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Setup {
    Strong,
    Weak,
    Nearlog,
}

const SETUPS: [Setup; 3] = [Setup::Strong, Setup::Weak, Setup::Nearlog];

impl Setup {
    fn name(self) -> &'static str {
        match self {
            Setup::Strong => "strong",
            Setup::Weak => "weak",
            Setup::Nearlog => "nearlog",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Latency {
    Local,
    Cloud,
}

impl Latency {
    /// Prefix of every figure measured under this setting.
    fn prefix(self) -> &'static str {
        match self {
            Latency::Local => "",
            Latency::Cloud => "cloud_disk.",
        }
    }
    fn name(self) -> &'static str {
        match self {
            Latency::Local => "local",
            Latency::Cloud => "cloud",
        }
    }
    fn shard_args(self) -> Vec<String> {
        match self {
            Latency::Local => vec![],
            Latency::Cloud => ["--inject-write-latency-us", "500", "--inject-flush-latency-us", "1000"].map(String::from).to_vec(),
        }
    }
}

fn settings(c: &CommonArgs) -> Vec<Latency> {
    match c.latency.unwrap_or(if c.quick { LatencyChoice::Local } else { LatencyChoice::Both }) {
        LatencyChoice::Local => vec![Latency::Local],
        LatencyChoice::Cloud => vec![Latency::Cloud],
        LatencyChoice::Both => vec![Latency::Local, Latency::Cloud],
    }
}

/// The longest an application run to completion ([`output_bounded`]) may take.
const APP_RUN_TIMEOUT: Duration = Duration::from_secs(900);

/// Runs an [`app_command`] to completion with its output captured, killing its process group
/// if it takes longer than [`APP_RUN_TIMEOUT`].
fn output_bounded(c: &mut Command) -> anyhow::Result<std::process::Output> {
    testbed::proc::output_bounded(c, APP_RUN_TIMEOUT)
}

/// Samples each peer's resident memory against the bytes it holds (as heartbeated to the
/// controller) while a scenario runs.
struct PeerMemory {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<(f64, f64)>>,
}

impl PeerMemory {
    fn start(rt: &tokio::runtime::Runtime, lb: &LogCluster) -> PeerMemory {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let pids: Vec<(u32, String)> = lb.peers.iter().map(|(p, a)| (p.0.id(), a.clone())).collect();
        let (addr, secret, handle) = (lb.controller_addr.clone(), lb.secret.clone(), rt.handle().clone());
        let s2 = stop.clone();
        let thread = std::thread::spawn(move || {
            // (max over samples of rss - held, max held)
            let (mut over, mut held_max) = (f64::MIN, 0f64);
            while !s2.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(Ok(::nearlog::proto::CtlReply::Status(s))) = handle
                    .block_on(async { tokio::time::timeout(Duration::from_secs(2), ::nearlog::driver::server::ctl_call(&addr, &secret, &::nearlog::proto::CtlRequest::Status)).await })
                {
                    for (pid, a) in &pids {
                        let held = s.peers.values().find(|i| &i.addr == a).map(|i| i.used_bytes as f64).unwrap_or(0.0);
                        if let Some(rss) = testbed::proc::rss_bytes(*pid).map(|b| b as f64) {
                            over = over.max(rss - held);
                            held_max = held_max.max(held);
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(250));
            }
            (over, held_max)
        });
        PeerMemory { stop, thread: Some(thread) }
    }

    /// Peer memory figures: peak RSS, lent region, RSS beyond the bytes held.
    fn finish(mut self, lb: &LogCluster, pfx: &str, report: &mut bench::Report) -> anyhow::Result<()> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (over, held) = self.thread.take().unwrap().join().map_err(|_| anyhow::anyhow!("memory sampler panicked"))?;
        let hwm = lb.peers.iter().filter_map(|(p, _)| testbed::proc::peak_rss_bytes(p.0.id()).map(|b| b as f64)).fold(0f64, f64::max);
        report.figure(&format!("{pfx}peer.peak_rss_bytes"), hwm)?;
        report.figure(&format!("{pfx}peer.region_bytes"), lb.region_bytes as f64)?;
        report.figure(&format!("{pfx}peer.peak_rss_over_region_bytes"), hwm - lb.region_bytes as f64)?;
        if over > f64::MIN {
            report.figure(&format!("{pfx}peer.rss_over_held_bytes_max"), over)?;
            report.figure(&format!("{pfx}peer.held_bytes_max"), held)?;
        }
        eprintln!("peers: peak RSS {:.1} MiB, region {:.0} MiB, RSS beyond held bytes at most {:.1} MiB", hwm / 1048576.0, lb.region_bytes as f64 / 1048576.0, over / 1048576.0);
        if let Some(r) = testbed::proc::peak_rss_bytes(lb.controller.0.id()).map(|b| b as f64) {
            report.figure(&format!("{pfx}controller.peak_rss_bytes"), r)?;
        }
        Ok(())
    }
}

/// Everything one latency setting needs.
struct Testbed {
    latency: Latency,
    /// Where applications keep their files (on the volume's ext4, or the plain directory).
    storage: PathBuf,
    shim: PathBuf,
    log: LogCluster,
    // Dropped after `log` (fields drop in order): the volume outlives the peers.
    _volume: Option<AttachedVolume>,
}

impl Testbed {
    fn start(c: &CommonArgs, rt: &tokio::runtime::Runtime, tmp: &Path, latency: Latency, volume_size: &str) -> anyhow::Result<Testbed> {
        let shim = match &c.shim {
            Some(s) => s.clone(),
            None => default_shim()?,
        };
        anyhow::ensure!(shim.exists(), "no shim at {} (build it: cargo build --release -p nearlog-preload)", shim.display());
        let dir = tmp.join(latency.name());
        std::fs::create_dir_all(&dir)?;
        // Absolute: the shim matches its patterns against absolute paths.
        let dir = dir.canonicalize()?;
        let (volume, storage) = match &c.storage {
            Some(s) => {
                let d = s.join(format!("nearlog-bench-{}", latency.name()));
                std::fs::create_dir_all(&d)?;
                (None, d.canonicalize()?)
            }
            None => {
                eprintln!("[{}] starting a 4-shard cluster and attaching a {volume_size} volume as ext4", latency.name());
                let v = start_attached(rt, &dir, &latency.shard_args(), volume_size)?;
                let s = v.mount.join("storage");
                std::fs::create_dir_all(&s)?;
                (Some(v), s)
            }
        };
        let log = start_log_cluster(rt, &dir.join("nearlog"), c.region_bytes)?;
        Ok(Testbed { latency, storage, shim, log, _volume: volume })
    }

    fn shim_env(&self, c: &mut Command, patterns: &str) {
        c.env("LD_PRELOAD", &self.shim).env("UNDERSTUDY_NEARLOG_CLUSTER", &self.log.cluster_file).env("UNDERSTUDY_NEARLOG_PATTERNS", patterns);
    }

    /// A fresh directory for one run on the storage (a new name every time: a log file the
    /// peers still held under an old name would otherwise be recovered into the new run).
    fn run_dir(&self, name: &str) -> anyhow::Result<PathBuf> {
        static RUN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let d = self.storage.join(format!("{name}-{}", RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
        std::fs::create_dir_all(&d)?;
        Ok(d)
    }

    /// Removes a run's directory; for nearlog, through the shim, so the unlinks of its log files
    /// reach the controller and free the peers' memory.
    fn remove_run_dir(&self, dir: &Path, setup: Setup, patterns: &str) -> anyhow::Result<()> {
        if setup == Setup::Nearlog {
            python(Some((self, patterns)), "import shutil, sys; shutil.rmtree(sys.argv[1])", &[dir.display().to_string()])?;
        }
        let _ = std::fs::remove_dir_all(dir);
        Ok(())
    }

    fn what(&self) -> String {
        match (&self._volume, self.latency) {
            (None, _) => "plain directory".into(),
            (Some(_), Latency::Local) => "volume, local disk latency".into(),
            (Some(_), Latency::Cloud) => "volume, +0.5 ms/write +1 ms/flush".into(),
        }
    }
}

/// One measured run, or a setup's runs merged (`rounds`: each run's ops/s, in order).
#[derive(Default)]
struct Runs {
    ops: u64,
    secs: f64,
    lat: bench::LatencyRecorder,
    rounds: Vec<f64>,
}

impl Runs {
    fn add(&mut self, ops: u64, secs: f64, lat: &bench::LatencyRecorder) {
        self.ops += ops;
        self.secs += secs;
        self.lat.merge(lat);
        self.rounds.push(ops as f64 / secs.max(1e-9));
    }
    fn ops_per_s(&self) -> f64 {
        self.ops as f64 / self.secs.max(1e-9)
    }
}

/// Runs `f` for every setup, `rounds` times, in ABBA order; merged per setup.
fn interleaved(rounds: usize, mut f: impl FnMut(Setup) -> anyhow::Result<Runs>) -> anyhow::Result<BTreeMap<Setup, Runs>> {
    let mut out: BTreeMap<Setup, Runs> = BTreeMap::new();
    for v in bench::interleaved_order(rounds, SETUPS.len()) {
        let s = SETUPS[v];
        let r = f(s)?;
        out.entry(s).or_default().add(r.ops, r.secs, &r.lat);
    }
    Ok(out)
}

fn read_lat_file(path: &Path) -> anyhow::Result<bench::LatencyRecorder> {
    let b = std::fs::read(path).with_context(|| format!("latency samples {}", path.display()))?;
    let mut rec = bench::LatencyRecorder::new();
    for c in b.chunks_exact(4) {
        rec.record_us(u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u64);
    }
    Ok(rec)
}

// ---------------------------------------------------------------------------------------------
// Redis

/// Redis on `port` through the one blocking RESP client (`ycsb::redis`), waiting up to 30 s
/// for it to accept.
fn redis_client(port: u16) -> anyhow::Result<BlockingClient> {
    BlockingClient::connect(("127.0.0.1", port), Duration::from_secs(30)).with_context(|| format!("redis on port {port} not reachable"))
}

/// Whether a reply is `+OK`.
fn is_ok(r: &Reply) -> bool {
    matches!(r, Reply::Simple(s) if s == "OK")
}

const REDIS_LOGS: &str = "*.incr.aof";

/// redis-server for a setup, its data in `dir`; returns the guard and the port once it answers.
fn start_redis(tb: &Testbed, setup: Setup, dir: &Path) -> anyhow::Result<(KillOnDrop, u16)> {
    let port = wire::ports::free_loopback_port()?;
    let mut c = app_command("redis-server");
    let fsync = if setup == Setup::Weak { "no" } else { "always" };
    c.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--dir"])
        .arg(dir)
        .args(["--appendonly", "yes", "--appendfsync", fsync, "--save", "", "--daemonize", "no", "--logfile", "", "--maxclients", "1000"])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    if setup == Setup::Nearlog {
        tb.shim_env(&mut c, REDIS_LOGS);
    }
    let server = KillOnDrop(c.spawn().context("cannot start redis-server (Debian package redis-server)")?);
    let mut probe = redis_client(port)?;
    while matches!(probe.call(&[b"PING"])?, Reply::Error(e) if e.starts_with("LOADING")) {
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((server, port))
}

fn redis_run(tb: &Testbed, setup: Setup, clients: usize, secs: f64) -> anyhow::Result<Runs> {
    let dir = tb.run_dir(&format!("redis-{}-c{clients}", setup.name()))?;
    let (server, port) = start_redis(tb, setup, &dir)?;
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let handles: Vec<_> = (0..clients)
        .map(|t| {
            std::thread::spawn(move || -> anyhow::Result<(u64, bench::LatencyRecorder)> {
                let value = vec![b'v'; 100];
                let mut c = redis_client(port)?;
                let mut rec = bench::LatencyRecorder::new();
                let mut n = 0u64;
                while Instant::now() < deadline {
                    let key = format!("k{t}:{n}");
                    let t0 = Instant::now();
                    let r = c.call(&[b"SET", key.as_bytes(), &value])?;
                    anyhow::ensure!(is_ok(&r), "SET answered {r:?}");
                    rec.record(t0.elapsed());
                    n += 1;
                }
                Ok((n, rec))
            })
        })
        .collect();
    let start = Instant::now();
    let mut out = Runs::default();
    for h in handles {
        let (n, r) = h.join().map_err(|_| anyhow::anyhow!("client thread panicked"))??;
        out.ops += n;
        out.lat.merge(&r);
    }
    out.secs = start.elapsed().as_secs_f64().max(secs);
    drop(server);
    tb.remove_run_dir(&dir, setup, REDIS_LOGS)?;
    Ok(out)
}

/// Commands Redis on `port` processed so far (`INFO stats`).
fn redis_commands(probe: &mut BlockingClient) -> anyhow::Result<u64> {
    let body = match probe.call(&[b"INFO", b"stats"])? {
        Reply::Bulk(Some(body)) => body,
        other => anyhow::bail!("INFO answered {other:?}"),
    };
    let text = String::from_utf8_lossy(&body);
    let n = text.lines().find_map(|l| l.strip_prefix("total_commands_processed:")).context("INFO stats without total_commands_processed")?;
    Ok(n.trim().parse()?)
}

/// Redis at `clients` connections driven by `redis-benchmark` (SET, 100 B values, random keys)
/// for `secs`: the throughput is Redis's own count of commands over that window, after a short
/// warm-up (redis-benchmark reports only at its end). No latencies: the run is cut off.
fn redis_benchmark_run(tb: &Testbed, setup: Setup, clients: usize, secs: f64) -> anyhow::Result<Runs> {
    let dir = tb.run_dir(&format!("redis-benchmark-{}-c{clients}", setup.name()))?;
    let (server, port) = start_redis(tb, setup, &dir)?;
    let mut probe = redis_client(port)?;
    let mut c = app_command("redis-benchmark");
    c.args(["-h", "127.0.0.1", "-p", &port.to_string(), "-c", &clients.to_string(), "-t", "set", "-d", "100", "-r", "100000000", "-n", "2000000000", "-q"])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let load = KillOnDrop(c.spawn().context("cannot start redis-benchmark (Debian package redis-tools)")?);
    std::thread::sleep(REDIS_BENCHMARK_WARMUP);
    let (c0, t0) = (redis_commands(&mut probe)?, Instant::now());
    std::thread::sleep(Duration::from_secs_f64(secs));
    let (c1, el) = (redis_commands(&mut probe)?, t0.elapsed().as_secs_f64());
    drop(load);
    drop(server);
    tb.remove_run_dir(&dir, setup, REDIS_LOGS)?;
    // The probe's own INFO is one of the commands counted.
    Ok(Runs { ops: c1.saturating_sub(c0 + 1), secs: el, ..Runs::default() })
}

/// redis-benchmark's connections are made and its first requests answered before the window.
const REDIS_BENCHMARK_WARMUP: Duration = Duration::from_millis(200);

// ---------------------------------------------------------------------------------------------
// SQLite and the write+fsync probe (python3)

const SQLITE_LOAD: &str = r#"
import sqlite3, sys, time, array
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("PRAGMA synchronous=" + sys.argv[2])
db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB)")
secs = float(sys.argv[3])
v = b"x" * 100
lat = array.array("I")
end = time.perf_counter() + secs
start = time.perf_counter()
while True:
    t0 = time.perf_counter()
    if t0 >= end:
        break
    db.execute("INSERT INTO t (v) VALUES (?)", (v,))
    lat.append(int((time.perf_counter() - t0) * 1e6))
el = time.perf_counter() - start
with open(sys.argv[4], "wb") as f:
    lat.tofile(f)
print(len(lat), el)
"#;

/// write(64 B) + fsync and a 64-byte loopback TCP round trip, timed by one compiled program (no
/// interpreter around either call) with one clock, N each, interleaved in 10 blocks so both see
/// the same machine load. The round trip's other end is a child process the program forks (a
/// process of its own with a blocking read/write loop and TCP_NODELAY, as a log peer's
/// connection thread); its reply is waited for as the shim waits for acks (polled without
/// sleeping, yielding, for `UNDERSTUDY_NEARLOG_SPIN_US`, default 50 µs, then blocking), so the
/// client's own wake-up is left out of both alike. Args: path, N, and `rtt` to time round trips
/// too. Prints both medians in µs (the round trip's 0 without `rtt`) and the process's peak RSS
/// in bytes.
const WRITE_FSYNC_C: &str = r#"
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
static long long now_ns(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000LL + t.tv_nsec; }
static int cmp(const void *a, const void *b) { long long x = *(const long long *)a, y = *(const long long *)b; return (x > y) - (x < y); }
int main(int argc, char **argv) {
    if (argc < 3) return 2;
    int fd = open(argv[1], O_WRONLY | O_CREAT | O_APPEND, 0644), n = atoi(argv[2]), one = 1, s = -1;
    pid_t echo = -1;
    if (fd < 0) { perror("open"); return 1; }
    if (argc > 3 && strcmp(argv[3], "rtt") == 0) {
        struct sockaddr_in a = {0};
        socklen_t al = sizeof a;
        a.sin_family = AF_INET; a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        int l = socket(AF_INET, SOCK_STREAM, 0);
        if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) != 0 || listen(l, 1) != 0 || getsockname(l, (struct sockaddr *)&a, &al) != 0) { perror("listen"); return 1; }
        echo = fork();
        if (echo == 0) {
            int c = accept(l, 0, 0);
            char b[64];
            setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            for (;;) {
                for (int got = 0; got < 64;) { ssize_t r = read(c, b + got, 64 - got); if (r <= 0) _exit(0); got += r; }
                if (write(c, b, 64) != 64) _exit(0);
            }
        }
        close(l);
        s = socket(AF_INET, SOCK_STREAM, 0);
        if (echo < 0 || s < 0 || connect(s, (struct sockaddr *)&a, sizeof a) != 0) { perror("echo"); return 1; }
        setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    long long *wf = calloc(n, sizeof *wf), *rtt = calloc(n, sizeof *rtt);
    long long spin_ns = getenv("UNDERSTUDY_NEARLOG_SPIN_US") ? atoll(getenv("UNDERSTUDY_NEARLOG_SPIN_US")) * 1000 : 50000;
    char buf[64] = {'r'};
    int k = 0, j = 0, blocks = 10;
    for (int b = 0; b < blocks; b++) {
        for (int i = 0; i < n / blocks; i++) {
            long long t0 = now_ns();
            if (write(fd, buf, 64) != 64 || fsync(fd) != 0) { perror("write+fsync"); return 1; }
            wf[k++] = now_ns() - t0;
        }
        for (int i = 0; s >= 0 && i < n / blocks; i++) {
            long long t0 = now_ns();
            if (send(s, buf, 64, 0) != 64) { perror("send"); return 1; }
            struct pollfd p = {s, POLLIN, 0};
            while (poll(&p, 1, 0) == 0 && now_ns() < t0 + spin_ns) sched_yield();
            for (int got = 0; got < 64;) { ssize_t r = recv(s, buf + got, 64 - got, 0); if (r <= 0) { perror("recv"); return 1; } got += r; }
            rtt[j++] = now_ns() - t0;
        }
    }
    if (echo > 0) { close(s); waitpid(echo, 0, 0); }
    qsort(wf, k, sizeof *wf, cmp);
    qsort(rtt, j, sizeof *rtt, cmp);
    long long hwm_kb = 0;
    char line[256];
    FILE *st = fopen("/proc/self/status", "r");
    while (st && fgets(line, sizeof line, st)) if (strncmp(line, "VmHWM:", 6) == 0) hwm_kb = atoll(line + 6);
    printf("%.2f %.2f %lld\n", wf[k / 2] / 1000.0, j ? rtt[j / 2] / 1000.0 : 0.0, hwm_kb * 1024);
    return 0;
}
"#;

/// Runs of the write+fsync timer per latency setting (odd: the median run is reported).
const TIMER_RUNS: usize = 5;

/// Compiles [`WRITE_FSYNC_C`] into `dir`.
fn build_write_fsync_c(dir: &Path) -> anyhow::Result<PathBuf> {
    let src = dir.join("write_fsync.c");
    let bin = dir.join("write_fsync");
    std::fs::write(&src, WRITE_FSYNC_C)?;
    let out = Command::new("cc").args(["-O2", "-o"]).arg(&bin).arg(&src).output().context("cannot run cc (Debian package gcc)")?;
    anyhow::ensure!(out.status.success(), "compiling the write+fsync timer failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(bin)
}

fn python(tb: Option<(&Testbed, &str)>, script: &str, args: &[String]) -> anyhow::Result<String> {
    let mut c = app_command("python3");
    c.arg("-c").arg(script).args(args);
    if let Some((t, pat)) = tb {
        t.shim_env(&mut c, pat);
    }
    let out = output_bounded(&mut c).context("cannot run python3")?;
    anyhow::ensure!(out.status.success(), "python3 failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn sqlite_run(tb: &Testbed, setup: Setup, secs: f64) -> anyhow::Result<Runs> {
    let dir = tb.run_dir(&format!("sqlite-{}", setup.name()))?;
    let db = dir.join("db.sqlite");
    let lat = dir.join("lat.bin");
    let sync = if setup == Setup::Weak { "OFF" } else { "FULL" };
    let e = if setup == Setup::Nearlog { Some((tb, "*-wal")) } else { None };
    let line = python(e, SQLITE_LOAD, &[db.display().to_string(), sync.into(), secs.to_string(), lat.display().to_string()])?;
    let mut it = line.split_whitespace();
    let ops: u64 = it.next().context("sqlite output")?.parse()?;
    let el: f64 = it.next().context("sqlite output")?.parse()?;
    let rec = read_lat_file(&lat)?;
    tb.remove_run_dir(&dir, setup, "*-wal")?;
    Ok(Runs { ops, secs: el, lat: rec, ..Runs::default() })
}

// ---------------------------------------------------------------------------------------------
// RocksDB (a small C program against Debian's librocksdb: testbed::rocksdb)

use testbed::rocksdb::build_rocksdb_load;

fn rocksdb_run(tb: &Testbed, bin: &Path, setup: Setup, clients: usize, secs: f64) -> anyhow::Result<Runs> {
    let dir = tb.run_dir(&format!("rocksdb-{}-c{clients}", setup.name()))?;
    let db = dir.join("db");
    let wal = dir.join("wal");
    std::fs::create_dir_all(&wal)?;
    let lat = dir.join("lat.bin");
    let mut c = app_command(bin);
    let sync = if setup == Setup::Weak { "0" } else { "1" };
    c.arg("bench").arg(&db).arg(&wal).args([sync, &clients.to_string(), &secs.to_string(), "100"]).arg(&lat);
    if setup == Setup::Nearlog {
        tb.shim_env(&mut c, &format!("{}/*.log", wal.display()));
    }
    let out = output_bounded(&mut c).context("cannot run the RocksDB load program")?;
    anyhow::ensure!(out.status.success(), "RocksDB load failed: {}", String::from_utf8_lossy(&out.stderr));
    let line = String::from_utf8_lossy(&out.stdout);
    let mut it = line.split_whitespace();
    let ops: u64 = it.next().context("rocksdb output")?.parse()?;
    let el: f64 = it.next().context("rocksdb output")?.parse()?;
    let rec = read_lat_file(&lat)?;
    tb.remove_run_dir(&dir, setup, &format!("{}/*.log", wal.display()))?;
    Ok(Runs { ops, secs: el, lat: rec, ..Runs::default() })
}

// ---------------------------------------------------------------------------------------------
// What the experiments share: run lengths and rounds, and how runs become figures

/// Seconds of one measured run with --quick: 21 runs of the apps bench plus their start-up and a
/// volume's attach and detach must stay within a minute on a loaded 2-core machine.
const QUICK_SECS: f64 = 0.75;

/// Redis at this many clients or more: nearlog against weak is a target close to 1 (0.9), on 2
/// cores shared by Redis, its 3 log peers and the load generator; one short run of each swung
/// it from 0.71 to 1.02 at load. So at least CONTENDED_ROUNDS interleaved rounds run and the
/// ratios are the median round's.
const CONTENDED_CLIENTS: usize = 50;
const CONTENDED_ROUNDS: usize = 5;

fn params(c: &CommonArgs) -> (usize, f64) {
    (c.rounds.unwrap_or(if c.quick { 1 } else { 2 }).max(1), c.secs.unwrap_or(if c.quick { QUICK_SECS } else { 8.0 }))
}

/// Records throughput and latency of every setup and the nearlog ratios; returns plot points.
fn record_runs(report: &mut bench::Report, pfx: &str, app: &str, clients: usize, runs: &BTreeMap<Setup, Runs>, tb: &Testbed) -> anyhow::Result<()> {
    for (s, r) in runs {
        let name = format!("{pfx}{app}.{}.c{clients}", s.name());
        report.figure(&format!("{name}.throughput_ops_per_s"), r.ops_per_s())?;
        report.latency(&format!("{name}.write.latency"), &r.lat.summary())?;
        eprintln!("[{}] {app} {} c{clients}: {:.0} ops/s, p50 {} us, p99 {} us", tb.what(), s.name(), r.ops_per_s(), r.lat.percentile_us(50.0), r.lat.percentile_us(99.0));
    }
    record_ratios(report, pfx, app, clients, runs, tb)
}

/// The nearlog ratios against strong and weak, from the median round.
fn record_ratios(report: &mut bench::Report, pfx: &str, app: &str, clients: usize, runs: &BTreeMap<Setup, Runs>, tb: &Testbed) -> anyhow::Result<()> {
    for other in [Setup::Strong, Setup::Weak] {
        let (near, base, each) = median_round(&runs[&Setup::Nearlog], &runs[&other]);
        let name = format!("nearlog_vs_{}.{app}.c{clients}.throughput", other.name());
        report.ratio(&format!("{pfx}{name}"), near, base)?;
        if each.len() > 1 {
            eprintln!("[{}] {name}: {:.3} (the median round; each round: {})", tb.what(), near / base, each.join(", "));
        }
    }
    Ok(())
}

/// Throughputs and the nearlog ratios (median round) of runs without latencies.
fn record_throughputs(report: &mut bench::Report, pfx: &str, app: &str, clients: usize, runs: &BTreeMap<Setup, Runs>, tb: &Testbed) -> anyhow::Result<()> {
    for (s, r) in runs {
        report.figure(&format!("{pfx}{app}.{}.c{clients}.throughput_ops_per_s", s.name()), r.ops_per_s())?;
        eprintln!("[{}] {app} {} c{clients}: {:.0} ops/s", tb.what(), s.name(), r.ops_per_s());
    }
    record_ratios(report, pfx, app, clients, runs, tb)
}

/// The ops/s of `a` and `b` in the round whose ratio a/b is the median (the lower middle one
/// for an even count), and every round's ratio: rounds are interleaved, so a round compares
/// runs close in time, and one noisy window on a shared machine does not decide the figure.
fn median_round(a: &Runs, b: &Runs) -> (f64, f64, Vec<String>) {
    let mut pairs: Vec<(f64, f64)> = a.rounds.iter().copied().zip(b.rounds.iter().copied()).collect();
    let each = pairs.iter().map(|(x, y)| format!("{:.3}", x / y.max(1e-9))).collect();
    pairs.sort_by(|p, q| (p.0 / p.1.max(1e-9)).total_cmp(&(q.0 / q.1.max(1e-9))));
    let (x, y) = pairs[(pairs.len() - 1) / 2];
    (x, y, each)
}

/// (throughput, mean latency) points per setup, one per client count.
type PlotLines = BTreeMap<Setup, Vec<(f64, f64)>>;
