//! `understudy bench <area> <scenario>`: benchmarks as commands, per `BENCH.md`.
//!
//! Each one brings up a throw-away local cluster (real processes on loopback), measures, and
//! prints one JSON line on stdout (progress on stderr; plots, CSV in `--out`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use volume::driver::client::Cluster;

use testbed::cluster_file::ClusterInfo;

use anyhow::Context;
use testbed::proc::peak_rss_bytes;
use clap::{Args, Subcommand};

use testbed::volume::{LocalCluster, UpConfig, READY_TIMEOUT};

#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Benchmarks of the volume layer (SpecREDS §6.2).
    #[command(subcommand)]
    Volume(VolumeBench),
    /// YCSB workloads through the project's own driver (crate ycsb).
    #[command(subcommand)]
    Ycsb(eval::ycsb::YcsbBench),
    /// Benchmarks of speculative failover (SpecREDS §6.3–6.5).
    #[command(subcommand)]
    Failover(crate::failover::FailoverBench),
    /// Benchmarks of the leaderless KV store (HEAL §IX).
    #[command(subcommand)]
    Kv(crate::kv::KvBench),
    /// Benchmarks of the near-compute log (SplitFT).
    #[command(subcommand)]
    Nearlog(crate::nearlog::NearlogBench),
}

#[derive(Subcommand, Debug)]
pub enum VolumeBench {
    /// Copy-on-write cost of super against a plain volume and an rbd-style general clone.
    ///
    /// (a) single COW write latency for 4–64 KiB writes; (b) 4 KiB COW latency at 1–32 writes in
    /// flight — every measured clone write hits an object not yet copied; (d) the parent's 4 KiB
    /// IOPS at depth 32 with `super` invoked every second, against none. Also the plain volume's
    /// 4 KiB IOPS through fio's NBD engine next to fio on a local file with --fdatasync=1, and
    /// the peak resident memory of shards and client. Variants are interleaved batch by batch.
    Cow(CommonArgs),
    /// Replay of a real application's recovery on plain, super and general clone (Figure 4c/4d).
    ///
    /// Loads SQLite (WAL mode, synchronous=FULL) on an ext4 volume attached through FUSE and a
    /// loop device, kills it with SIGKILL mid-load, and records the block trace of its recovery
    /// on a re-attached volume (integrity and every acknowledged row are checked); then replays
    /// the trace on the plain volume, a fresh super child and a fresh general clone, interleaved,
    /// and reports read and write latency percentiles. Needs root, /dev/fuse, sqlite3, python3.
    RecoveryTrace(CommonArgs),
    /// Understudy beside a real single-node Ceph 16.2 (rbd and rbd clone), measured with fio.
    ///
    /// Starts ceph-mon and one ceph-osd per replica (each BlueStore on a file of its own; pool
    /// size 3 and min_size 2 by default, Ceph's defaults, beside Understudy's 3 replicas) in a
    /// temporary directory, then measures 4 KiB random-write latency at depth 1 and IOPS at depth 32 on an rbd image
    /// (64 KiB and 4 MiB objects), an rbd clone (every write a copy-up), Understudy's plain
    /// volume and its super child — fio's rbd engine for Ceph, its NBD engine for Understudy,
    /// variants interleaved. Needs Debian's ceph-mon, ceph-osd and ceph-common (not installed
    /// by scripts/install-deps): apt-get install --no-install-recommends ceph-mon ceph-osd ceph-common.
    Ceph(crate::ceph_bench::CephArgs),
}

#[derive(Args, Debug)]
pub struct CommonArgs {
    /// A short run (under a minute) that still measures every figure.
    #[arg(long)]
    pub quick: bool,
    /// Where plots (SVG, PNG) and raw samples (CSV) go [default: target/bench/volume].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Storage shards of the throw-away cluster.
    #[arg(long, default_value_t = 4)]
    pub shards: u32,
    /// Keep the cluster's data directory (for inspecting logs).
    #[arg(long)]
    pub keep: bool,
    /// The shards' write-ahead journal (`understudy shard --journal`) [default: the shard's].
    #[arg(long, value_enum, value_name = "ON|OFF")]
    pub shard_journal: Option<crate::daemons::OnOff>,
}

impl CommonArgs {
    /// Replicas of the throw-away cluster: `up`'s default, or one per shard if fewer shards.
    pub fn default_replicas(&self) -> u32 {
        testbed::volume::DEFAULT_REPLICAS.min(self.shards)
    }
}

pub fn run(cmd: BenchCmd, verbose: u8) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::Volume(VolumeBench::Cow(a)) => volume_cow(a, verbose),
        BenchCmd::Volume(VolumeBench::RecoveryTrace(a)) => volume_recovery_trace(a, verbose),
        BenchCmd::Ycsb(cmd) => eval::ycsb::run(cmd),
        BenchCmd::Failover(b) => crate::failover::bench(b, verbose),
        BenchCmd::Kv(b) => crate::kv::bench(b, verbose),
        BenchCmd::Nearlog(b) => crate::nearlog::bench(b, verbose),
        BenchCmd::Volume(VolumeBench::Ceph(a)) => crate::ceph_bench::run(a, verbose),
    }
}

/// Runs `body` on a throw-away local cluster of `replicas` copies per object, then adds the peak
/// resident memory of the shards and of this client and prints the report.
pub(crate) fn on_cluster<F, Fut>(a: &CommonArgs, replicas: u32, bench_name: &str, verbose: u8, body: F) -> anyhow::Result<()>
where
    F: FnOnce(Arc<Cluster>, ClusterInfo, PathBuf, PathBuf, bench::Report) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bench::Report>>,
{
    let started = Instant::now();
    let out = bench::out_dir("volume", a.out.clone())?;
    let dir = tempfile::Builder::new().prefix("understudy-bench-").tempdir_in(work_dir()?).context("cannot create a temporary directory")?;
    let rt = crate::runtime()?;
    let cfg = UpConfig { dir: dir.path().to_path_buf(), shards: a.shards, replicas, port_base: 0, verbose };
    // Shards serve metrics: benchmarks read their store and disk counters.
    let shard_args: Vec<String> = a.shard_journal.iter().flat_map(|j| ["--journal".to_string(), j.as_arg().to_string()]).collect();
    let mut lc = LocalCluster::start_full(&cfg, &shard_args, true)?;
    let mut report = bench::Report::new(bench_name, a.quick);
    if let Some(j) = a.shard_journal {
        eprintln!("shards' journal: {}", j.as_arg());
    }
    let result = rt.block_on(async {
        let cluster = lc.wait_ready(READY_TIMEOUT, false).await?;
        report.figure("phase.cluster_start_s", started.elapsed().as_secs_f64())?;
        eprintln!("cluster ready in {:.1} s", started.elapsed().as_secs_f64());
        body(cluster, lc.info.clone(), out.clone(), dir.path().to_path_buf(), report).await
    });
    // The shards are still running: their peak memory is still there to read.
    let shard_rss = lc.info.shards.iter().filter_map(|s| peak_rss_bytes(s.pid)).max();
    let stopping = Instant::now();
    lc.stop();
    if a.keep {
        eprintln!("cluster data kept in {}", dir.keep().display());
    } else {
        let _ = dir.close();
    }
    eprintln!("cluster stopped and removed in {:.1} s", stopping.elapsed().as_secs_f64());
    let mut report = result?;
    if let Some(rss) = shard_rss {
        report.figure("shard.rss_peak_bytes", rss as f64)?;
    }
    if let Some(rss) = peak_rss_bytes(std::process::id()) {
        report.figure("client.rss_peak_bytes", rss as f64)?;
    }
    eprintln!("plots and samples in {}", out.display());
    report.print();
    Ok(())
}

fn volume_cow(a: CommonArgs, verbose: u8) -> anyhow::Result<()> {
    let quick = a.quick;
    on_cluster(&a, a.default_replicas(), "volume.cow", verbose, |cluster, info, out, dir, mut report| async move {
        let mut opts = eval::volume::cow::CowOptions::new(quick);
        opts.shard_pids = info.shards.iter().map(|s| s.pid).collect();
        opts.shard_metrics = info.shards.iter().filter_map(|s| s.metrics.clone()).collect();
        let plain = eval::volume::cow::run(cluster.clone(), &opts, &out, &mut report).await?;
        eval::volume::cow::fio_figures(&plain, &info.nbd.addr, &dir, quick, &mut report)?;
        Ok(report)
    })
}

fn volume_recovery_trace(a: CommonArgs, verbose: u8) -> anyhow::Result<()> {
    let quick = a.quick;
    on_cluster(&a, a.default_replicas(), "volume.recovery_trace", verbose, |cluster, _info, out, _dir, mut report| async move {
        eval::volume::recovery_trace::run(cluster, quick, &out, &mut report).await?;
        Ok(report)
    })
}

/// A directory on the work disk (not tmpfs), so shards and fio measure the same disk.
fn work_dir() -> anyhow::Result<PathBuf> {
    let d = std::env::current_dir()?.join("target").join("bench-clusters");
    std::fs::create_dir_all(&d).with_context(|| format!("cannot create {}", d.display()))?;
    Ok(d)
}

