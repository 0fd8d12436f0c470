//! `understudy bench ycsb redis`: YCSB workloads A–F (and the TAO-like mix) through the
//! project's own driver (crate `ycsb`) against a private `redis-server` it starts and stops.
//!
//! Figures are named `SETUP.WORKLOAD.cCLIENTS.PHASE...`, e.g.
//! `redis.a.c8.run.read.latency_us_p99` or `redis_aof_always.a.c8.run.throughput_ops_per_s`,
//! so runs of several setups and client counts can share one report.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use ycsb::redis::{AppendFsync, RedisOptions, RedisServer, RedisServerOptions, RedisTarget};
use ycsb::{KeyFormat, PhaseSummary, RequestDistribution, RunConfig, Runner, WorkloadSpec};

#[derive(Subcommand, Debug)]
pub enum YcsbBench {
    /// YCSB core workloads (or the TAO-like mix) against a private redis-server.
    ///
    /// Starts redis-server on a free loopback port with its data in a temporary directory under
    /// ./target/bench-redis (append-only file optional), loads the records with --clients
    /// closed-loop clients, runs the workload, checks that every value read back is one the
    /// driver wrote for that key, and prints throughput and per-operation latency percentiles
    /// as the last line of stdout (BENCH.md JSON). Plots and CSV go to --out. Workload E's scans
    /// are emulated with a sorted-set index of the keys (ZRANGEBYLEX + MGET), which inserts
    /// maintain with a second command.
    Redis(RedisArgs),
}

#[derive(Args, Debug)]
pub struct RedisArgs {
    /// Workload: a (50/50 read/update), b (95/5), c (read only), d (read latest), e (short
    /// scans), f (read-modify-write), or tao (social graph, 80 % reads).
    #[arg(long, default_value = "a")]
    pub workload: String,
    /// Closed-loop clients, each with one request in flight on its own connection.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// A short run (well under a minute) that still measures every figure.
    #[arg(long)]
    pub quick: bool,
    /// Where plots (SVG, PNG) and raw samples (CSV) go [default: target/bench/ycsb].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Records loaded before the run [default: 100000; 5000 with --quick].
    #[arg(long)]
    pub records: Option<u64>,
    /// Operations of the run phase [default: 1000000; 20000 with --quick].
    #[arg(long)]
    pub operations: Option<u64>,
    /// Stop the run phase after this many seconds even if operations remain [default: 120;
    /// 15 with --quick].
    #[arg(long)]
    pub duration_s: Option<u64>,
    #[command(flatten)]
    pub shape: WorkloadArgs,
    /// Redis keeps an append-only file (appendonly yes).
    #[arg(long)]
    pub appendonly: bool,
    /// When Redis fsyncs the append-only file (with --appendonly).
    #[arg(long, default_value = "everysec", value_parser = ["always", "everysec", "no"])]
    pub appendfsync: String,
    /// The redis-server executable.
    #[arg(long, default_value = "redis-server")]
    pub redis_server: PathBuf,
}

/// The workload options every YCSB bench shares (`bench ycsb redis`, `bench kv ycsb`).
#[derive(Args, Debug)]
pub struct WorkloadArgs {
    /// Request distribution: uniform, zipfian (YCSB's scrambled zipfian), zipfian-plain or
    /// latest [default: the workload's own].
    #[arg(long)]
    pub distribution: Option<String>,
    /// Zipfian constant θ of the skewed distributions (YCSB: 0.99).
    #[arg(long, default_value_t = 0.99)]
    pub theta: f64,
    /// Fields per record; a value is field-count × field-length bytes.
    #[arg(long, default_value_t = 10)]
    pub field_count: usize,
    /// Bytes per field.
    #[arg(long, default_value_t = 100)]
    pub field_length: usize,
    /// Fixed key size in bytes, zero-padded [default: YCSB's variable-length `user<number>`].
    #[arg(long)]
    pub key_size: Option<usize>,
    /// Seed of every client's operation and key sequence.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

impl WorkloadArgs {
    /// Applies these options to `spec` (a named workload with its counts set) and validates it.
    pub fn apply(&self, mut spec: WorkloadSpec) -> anyhow::Result<WorkloadSpec> {
        spec.request_distribution = match &self.distribution {
            Some(name) => RequestDistribution::parse(name, self.theta)?,
            None => spec.request_distribution.with_theta(self.theta),
        };
        spec.field_count = self.field_count;
        spec.field_length_bytes = self.field_length;
        spec.key_format = KeyFormat { key_size_bytes: self.key_size, ..spec.key_format };
        spec.validate()?;
        Ok(spec)
    }
}

pub fn run(cmd: YcsbBench) -> anyhow::Result<()> {
    match cmd {
        YcsbBench::Redis(a) => redis(a),
    }
}

fn build_spec(a: &RedisArgs) -> anyhow::Result<WorkloadSpec> {
    let mut spec = WorkloadSpec::by_name(&a.workload)?;
    spec.record_count = a.records.unwrap_or(if a.quick { 5_000 } else { 100_000 });
    spec.operation_count = Some(a.operations.unwrap_or(if a.quick { 20_000 } else { 1_000_000 }));
    a.shape.apply(spec)
}

fn redis(a: RedisArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.clients >= 1, "--clients must be at least 1");
    let spec = build_spec(&a)?;
    let duration = Duration::from_secs(a.duration_s.unwrap_or(if a.quick { 15 } else { 120 }));
    let out = bench::out_dir("ycsb", a.out.clone())?;
    // On the work disk, not a tmpfs: with --appendonly the fsyncs must reach a real disk.
    let work = std::env::current_dir()?.join("target").join("bench-redis");
    std::fs::create_dir_all(&work).with_context(|| format!("cannot create {}", work.display()))?;
    let dir = tempfile::Builder::new()
        .prefix("understudy-ycsb-")
        .tempdir_in(&work)
        .context("cannot create a temporary directory")?;
    let appendfsync = match a.appendfsync.as_str() {
        "always" => AppendFsync::Always,
        "no" => AppendFsync::No,
        _ => AppendFsync::Everysec,
    };
    let server = RedisServer::start(&RedisServerOptions {
        binary: a.redis_server.clone(),
        appendonly: a.appendonly,
        appendfsync,
        dir: Some(dir.path().to_path_buf()),
        ready_timeout: Duration::from_secs(20),
        ..RedisServerOptions::default()
    })?;
    let options = RedisOptions { scan_index: spec.has_scans(), ..RedisOptions::default() };
    let config = RunConfig { seed: a.shape.seed, max_duration: Some(duration), ..RunConfig::default() };
    eprintln!(
        "ycsb {}: redis-server pid {} on {}; {} records of {} bytes, {} operations (at most {} s), {} clients",
        spec.name,
        server.pid(),
        server.addr(),
        spec.record_count,
        spec.value_size_bytes(),
        spec.operation_count.unwrap_or(0),
        duration.as_secs(),
        a.clients
    );
    let addr = server.addr();
    let clients = a.clients;
    let runner = Runner::new(spec)?;
    let (load, run) = crate::runtime()?.block_on(async {
        let mut targets = Vec::with_capacity(clients);
        for _ in 0..clients {
            targets.push(RedisTarget::connect(addr, options.clone()).await?);
        }
        let (targets, load) = runner.load(targets, &config).await?;
        eprintln!("load: {} inserts in {:.1} s", load.completed_ops(), load.elapsed.as_secs_f64());
        let (_, run) = runner.run(targets, &config).await?;
        eprintln!(
            "run: {} operations in {:.1} s ({:.0} ops/s)",
            run.completed_ops(),
            run.elapsed.as_secs_f64(),
            run.throughput_ops_per_s()
        );
        anyhow::Ok((load, run))
    })?;
    drop(server);

    let setup = if a.appendonly { format!("redis_aof_{}", a.appendfsync) } else { "redis".to_string() };
    let prefix = format!("{setup}.{}.c{clients}", runner.spec().name);
    let mut report = bench::Report::new("ycsb.redis", a.quick);
    load.add_to_report(&format!("{prefix}.load"), &mut report)?;
    run.add_to_report(&format!("{prefix}.run"), &mut report)?;
    write_samples(&out, &prefix, &run, &[])?;
    eprintln!("plots and samples in {}", out.display());
    report.print();
    ensure_reads_checked(&load, &run)
}

/// Fails the bench (after its figures were printed) if any read found a missing record or a
/// value the driver never wrote: such figures are not valid.
pub fn ensure_reads_checked(load: &PhaseSummary, run: &PhaseSummary) -> anyhow::Result<()> {
    for (phase, s) in [("load", load), ("run", run)] {
        anyhow::ensure!(
            s.all_reads_checked_ok(),
            "{phase}: {} records missing and {} values not written by the driver (first: {:?}); \
             the figures above are not valid",
            s.missing_count,
            s.corrupt_count,
            s.first_problems
        );
    }
    Ok(())
}

/// The run's throughput timeline and latency CDFs, as CSV and plots.
/// Writes a run's throughput windows and latency CDFs (CSV and plots) under `out`. `marks`
/// are events drawn as vertical lines on the throughput plot (label, time in seconds).
pub fn write_samples(out: &Path, prefix: &str, run: &PhaseSummary, marks: &[(String, f64)]) -> anyhow::Result<()> {
    let stem = prefix.replace('.', "-");
    let window_s = run.window.as_secs_f64();
    let timeline: Vec<(f64, f64)> = run
        .window_ops_per_s()
        .into_iter()
        .enumerate()
        .map(|(i, rate)| (i as f64 * window_s, rate))
        .collect();
    bench::write_csv(
        &out.join(format!("{stem}-throughput.csv")),
        &["window_start_s", "throughput_ops_per_s"],
        timeline.iter().map(|(t, r)| vec![format!("{t:.1}"), format!("{r:.0}")]),
    )?;
    let mut cdf_rows = vec![];
    let mut cdfs = vec![];
    for (label, stats) in &run.ops {
        let points = stats.latency.cdf_points();
        cdf_rows.extend(points.iter().map(|(us, f)| vec![label.to_string(), format!("{us}"), format!("{f:.6}")]));
        cdfs.push(bench::Series { name: label.to_string(), points });
    }
    bench::write_csv(&out.join(format!("{stem}-latency-cdf.csv")), &["operation", "latency_us", "fraction"], cdf_rows)?;
    if timeline.len() >= 2 {
        let top = timeline.iter().map(|p| p.1).fold(0.0, f64::max);
        let mut series = vec![bench::Series { name: "all operations".into(), points: timeline }];
        for (name, t) in marks {
            series.push(bench::Series { name: format!("{name} ({t:.2} s)"), points: vec![(*t, 0.0), (*t, top)] });
        }
        bench::line_plot(
            &out.join(format!("{stem}-throughput")),
            &format!("{prefix}: throughput per 100 ms"),
            "time (s)",
            "operations per second",
            &series,
            bench::Scale::Linear,
        )?;
    }
    if !cdfs.is_empty() {
        bench::cdf_plot(
            &out.join(format!("{stem}-latency-cdf")),
            &format!("{prefix}: latency"),
            "latency (µs)",
            &cdfs,
            bench::Scale::Log,
        )?;
    }
    Ok(())
}
