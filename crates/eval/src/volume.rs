//! The volume experiments of SpecREDS §6.2: the disk-level copy-on-write latency and IOPS
//! (Figure 4a, 4b) and the replay of a real database recovery (Figure 4c, 4d); beside them,
//! Understudy against a real single-node Ceph ([`ceph`]). [`on_cluster`] runs one on a
//! throw-away [`testbed::volume::LocalCluster`].

pub mod ceph;
pub mod cow;
pub mod recovery_trace;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use testbed::cluster_file::ClusterInfo;
use testbed::proc::peak_rss_bytes;
use testbed::volume::{LocalCluster, UpConfig, READY_TIMEOUT};
use volume::driver::client::Cluster;
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
    pub shard_journal: Option<testbed::volume::OnOff>,
}

impl CommonArgs {
    /// Replicas of the throw-away cluster: `up`'s default, or one per shard if fewer shards.
    pub fn default_replicas(&self) -> u32 {
        testbed::volume::DEFAULT_REPLICAS.min(self.shards)
    }
}


/// Runs `body` on a throw-away local cluster of `replicas` copies per object, then adds the peak
/// resident memory of the shards and of this client to its report.
pub fn on_cluster<F, Fut>(a: &CommonArgs, replicas: u32, bench_name: &str, verbose: u8, body: F) -> anyhow::Result<bench::Report>
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
    Ok(report)
}

/// `bench volume cow` on a throw-away cluster.
pub fn cow_main(a: CommonArgs, verbose: u8) -> anyhow::Result<bench::Report> {
    let quick = a.quick;
    on_cluster(&a, a.default_replicas(), "volume.cow", verbose, |cluster, info, out, dir, mut report| async move {
        let mut opts = cow::CowOptions::new(quick);
        opts.shard_pids = info.shards.iter().map(|s| s.pid).collect();
        opts.shard_metrics = info.shards.iter().filter_map(|s| s.metrics.clone()).collect();
        let plain = cow::run(cluster.clone(), &opts, &out, &mut report).await?;
        cow::fio_figures(&plain, &info.nbd.addr, &dir, quick, &mut report)?;
        Ok(report)
    })
}

/// `bench volume recovery-trace` on a throw-away cluster.
pub fn recovery_trace_main(a: CommonArgs, verbose: u8) -> anyhow::Result<bench::Report> {
    let quick = a.quick;
    on_cluster(&a, a.default_replicas(), "volume.recovery_trace", verbose, |cluster, _info, out, _dir, mut report| async move {
        recovery_trace::run(cluster, quick, &out, &mut report).await?;
        Ok(report)
    })
}

/// A directory on the work disk (not tmpfs), so shards and fio measure the same disk.
fn work_dir() -> anyhow::Result<PathBuf> {
    let d = std::env::current_dir()?.join("target").join("bench-clusters");
    std::fs::create_dir_all(&d).with_context(|| format!("cannot create {}", d.display()))?;
    Ok(d)
}

