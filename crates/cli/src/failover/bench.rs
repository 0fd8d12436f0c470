//! `understudy bench failover scenarios`: end-to-end failover of a real application (the SQLite
//! front on an ext4 volume) under REDS, speculative and oracle, measured from the client side.
//!
//! Each run: a fresh volume, `understudy failover run` as its own process (its peak RSS is the
//! monitor's memory), the load generator through the endpoint, an unclean crash (SIGKILL of the
//! whole primary), and the client's longest gap without an acknowledged commit as the failover
//! latency; every run also checks that no acknowledged commit was lost. Variants alternate ABBA
//! over the rounds.
//!
//! The Figure 6 scenarios are then composed as the paper composed them (§6.4: "we simulated
//! various failover scenarios ... recovery latencies picked from §6.3"): REDS with a timeout T
//! costs T plus its measured restart (its client gap minus the short timeout it ran with);
//! speculative and oracle cost what they measured; in the false-positive scenario the primary
//! returns after 15 s, so speculative and oracle cost at most that, REDS commits to a restart.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

use crate::up::{LocalCluster, UpConfig, READY_TIMEOUT};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// A short run (one round of each policy).
    #[arg(long)]
    pub quick: bool,
    /// Where plots and CSV go [default: target/bench/failover].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Rounds of each policy [default: 1 with --quick, else 3].
    #[arg(long)]
    pub rounds: Option<usize>,
}

const VARIANTS: [&str; 3] = ["reds", "speculative", "oracle"];
/// The REDS timeout the real runs use; the scenarios add the paper's timeouts instead.
const REDS_REAL_TIMEOUT_MS: u64 = 2_000;
const PING_INTERVAL_MS: u64 = 200;
const TRANSIENT_MS: f64 = 15_000.0;

struct RunResult {
    gap_ms: f64,
    /// Client commits/s in the 2 s before the crash and in the 2 s after service resumed.
    before_ops_per_s: f64,
    after_ops_per_s: f64,
    /// Time two instances were held at once (backup started → old primary released).
    overlap_s: f64,
    app_recovery_ms: f64,
    monitor_rss_bytes: u64,
    ops_per_window: Vec<u64>,
    window_ms: u64,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn peak_rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

fn narrate(e: &serde_json::Value) {
    let mut fields = e.as_object().cloned().unwrap_or_default();
    let t = fields.remove("t_ms").and_then(|v| v.as_f64()).unwrap_or(0.0);
    let name = fields.remove("event").and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
    let rest: Vec<String> = fields.iter().map(|(k, v)| format!("{k}={}", v.as_str().map(str::to_string).unwrap_or(v.to_string()))).collect();
    println!("  {:>7.2} s  monitor: {name:<16} {}", t / 1000.0, rest.join(" "));
}

fn wait_event(
    rx: &Receiver<serde_json::Value>,
    seen: &mut Vec<serde_json::Value>,
    names: &[&str],
    timeout: Duration,
    tell: bool,
) -> anyhow::Result<serde_json::Value> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let e = rx.recv_timeout(left).map_err(|_| anyhow::anyhow!("no {names:?} event within {timeout:?} (events: {seen:?})"))?;
        if tell && e["event"] != "ready" {
            narrate(&e);
        }
        seen.push(e.clone());
        if names.iter().any(|n| e["event"] == *n) {
            return Ok(e);
        }
        anyhow::ensure!(e["event"] != "gave_up", "the monitor gave up: {e}");
    }
}

/// Stops the monitor process on every path out of a run.
struct MonitorProc(std::process::Child);

impl Drop for MonitorProc {
    fn drop(&mut self) {
        crate::proc::signal(self.0.id(), libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(60);
        while matches!(self.0.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn run_one(cluster_file: &Path, dir: &Path, variant: &str, round: usize, verbose: u8, tell: bool) -> anyhow::Result<RunResult> {
    let exe = std::env::current_exe()?;
    let vol = format!("bench-{variant}-{round}");
    let cli = |args: &[&str]| -> anyhow::Result<String> {
        let o = Command::new(&exe).args(args).arg("--cluster").arg(cluster_file).output()?;
        anyhow::ensure!(o.status.success(), "`understudy {}`: {}", args.join(" "), String::from_utf8_lossy(&o.stderr).trim());
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    };
    cli(&["volume", "create", &vol, "--size", "128M"])?;
    let run_dir = dir.join(format!("run-{variant}-{round}"));
    std::fs::create_dir_all(&run_dir)?;
    let port = free_port()?;
    let control = format!("127.0.0.1:{}", free_port()?);
    let spec = serde_json::json!({
        "volume": vol,
        "state_dir": run_dir.join("state"),
        "mkfs": true,
        "app": { "command": [exe, "failover", "sqlite-front", "--db", "{mount}/app.db", "--port", "{port}"] },
        "health": { "send": "PING", "expect": "PONG", "timeout_ms": 1000 },
        "endpoint": { "listen": format!("127.0.0.1:{port}") },
        "monitor": {
            "policy": variant,
            "ping_interval_ms": PING_INTERVAL_MS,
            "reds_timeout_ms": if variant == "reds" { REDS_REAL_TIMEOUT_MS } else { 600_000 },
            "healthy_timeout_ms": 120_000,
        },
    });
    let spec_path = run_dir.join("spec.json");
    std::fs::write(&spec_path, serde_json::to_vec_pretty(&spec)?)?;
    let mut cmd = Command::new(&exe);
    cmd.args(["failover", "run"]).arg(&spec_path).args(["--control", &control, "--cluster"]).arg(cluster_file);
    if verbose > 0 {
        cmd.arg(format!("-{}", "v".repeat(verbose as usize)));
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(std::fs::File::create(run_dir.join("monitor.err"))?))
        .spawn()
        .context("cannot start `understudy failover run`")?;
    let out = child.stdout.take().unwrap();
    let monitor = MonitorProc(child);
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                if tx.send(v).is_err() {
                    return;
                }
            }
        }
    });
    let mut seen = vec![];
    wait_event(&rx, &mut seen, &["primary_up"], Duration::from_secs(180), tell)?;
    let control_addr = control.parse()?;
    if variant == "oracle" {
        // The evaluator knows the future: the primary will never come back.
        super::control_request(control_addr, "hint never 0")?;
    }
    // The client: load through the endpoint in its own runtime.
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let endpoint: std::net::SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let load = std::thread::spawn(move || -> anyhow::Result<(::failover::load::LoadResult, ::failover::load::Verdict)> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        rt.block_on(async {
            let r = ::failover::load::run_load(endpoint, &::failover::load::Target::Line, Duration::from_secs(600), 100, async {
                let _ = stop_rx.await;
            })
            .await;
            let v = ::failover::load::verify(endpoint, &::failover::load::Target::Line, &r, Duration::from_secs(60)).await.map_err(anyhow::Error::msg)?;
            Ok((r, v))
        })
    });
    std::thread::sleep(Duration::from_secs(2));
    super::control_request(control_addr, "kill")?;
    if tell {
        println!("  {:>9} demo: SIGKILL of the whole primary (application and its volume server)", "");
    }
    let done = wait_event(&rx, &mut seen, &["promoted", "reds_restarted"], Duration::from_secs(300), tell)?;
    let rss = peak_rss_bytes(monitor.0.id()).unwrap_or(0);
    std::thread::sleep(Duration::from_secs(2));
    let _ = stop_tx.send(());
    let (r, v) = load.join().map_err(|_| anyhow::anyhow!("the load thread panicked"))??;
    anyhow::ensure!(
        v.missing.is_empty() && v.unexpected.is_empty(),
        "{variant}: acknowledged commits lost {:?} or rows never attempted {:?}",
        v.missing,
        v.unexpected
    );
    // App recovery: the last backup start before the outcome to its first good health check.
    let t = |e: &serde_json::Value| e["t_ms"].as_f64().unwrap_or(f64::NAN);
    let started = seen.iter().rev().find(|e| e["event"] == "backup_started").map(t).unwrap_or(f64::NAN);
    let healthy = seen.iter().rev().find(|e| e["event"] == "backup_healthy").map(t).unwrap_or(f64::NAN);
    eprintln!(
        "failover bench: {variant} round {round}: {} after {:.0} ms of client outage (app recovery {:.0} ms, {} commits checked)",
        done["event"].as_str().unwrap_or("?"),
        r.max_gap_ms,
        healthy - started,
        v.acked
    );
    drop(monitor);
    if tell {
        println!(
            "  client: {} commits acknowledged, all {} present after the failover, none unexpected; \
             longest outage {:.2} s (from {:.2} s to {:.2} s after the load began)",
            v.acked,
            v.acked,
            r.max_gap_ms as f64 / 1000.0,
            r.gap_start_ms as f64 / 1000.0,
            r.gap_end_ms as f64 / 1000.0
        );
    }
    let rate = |from_ms: u64, to_ms: u64| {
        let n = r.acked.iter().filter(|(_, t)| *t >= from_ms && *t < to_ms).count();
        n as f64 * 1000.0 / (to_ms.saturating_sub(from_ms)).max(1) as f64
    };
    let before = rate(r.gap_start_ms.saturating_sub(2_000), r.gap_start_ms);
    let after = rate(r.gap_end_ms, r.gap_end_ms + 2_000);
    // REDS and the oracle fence before they start: no overlap. Speculative holds the backup
    // from its start until the old primary is released at promotion.
    let overlap_s = if variant == "speculative" { (t(&done) - started) / 1000.0 } else { 0.0 };
    Ok(RunResult {
        before_ops_per_s: before,
        after_ops_per_s: after,
        overlap_s,
        gap_ms: r.max_gap_ms as f64, app_recovery_ms: healthy - started, monitor_rss_bytes: rss, ops_per_window: r.ops_per_window, window_ms: r.window_ms })
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

pub fn scenarios(a: BenchArgs, verbose: u8) -> anyhow::Result<()> {
    let rounds = a.rounds.unwrap_or(if a.quick { 1 } else { 3 }).max(1);
    let out = bench::out_dir("failover", a.out.clone())?;
    let base = std::env::current_dir()?.join("target").join("bench-clusters");
    std::fs::create_dir_all(&base)?;
    let dir = tempfile::Builder::new().prefix("understudy-failover-").tempdir_in(&base)?;
    let rt = crate::runtime()?;
    let mut lc = LocalCluster::start(&UpConfig { dir: dir.path().join("cluster"), shards: 4, replicas: 3, port_base: 0, verbose })?;
    rt.block_on(lc.wait_ready(READY_TIMEOUT, false))?;
    let cluster_file = lc.info.dir.join(crate::cluster_file::CLUSTER_FILE);
    lc.info.save(&cluster_file)?;
    let mut results: Vec<Vec<RunResult>> = (0..VARIANTS.len()).map(|_| vec![]).collect();
    for (i, v) in bench::interleaved_order(rounds, VARIANTS.len()).into_iter().enumerate() {
        let round = i / VARIANTS.len();
        results[v].push(run_one(&cluster_file, dir.path(), VARIANTS[v], round, verbose, false)?);
    }
    lc.stop();

    let gap = |v: usize| mean(&results[v].iter().map(|r| r.gap_ms).collect::<Vec<_>>());
    let (reds_gap, spec_gap, oracle_gap) = (gap(0), gap(1), gap(2));
    let plain_rec = mean(&results[0].iter().chain(&results[2]).map(|r| r.app_recovery_ms).collect::<Vec<_>>());
    let super_rec = mean(&results[1].iter().map(|r| r.app_recovery_ms).collect::<Vec<_>>());
    let reds_restart = (reds_gap - REDS_REAL_TIMEOUT_MS as f64).max(0.0);
    let rss = results.iter().flatten().map(|r| r.monitor_rss_bytes).max().unwrap_or(0);

    let mut report = bench::Report::new("failover.scenarios", a.quick);
    report.figure("reds.unclean.failover_latency_ms_mean", reds_gap)?;
    report.figure("reds.unclean.timeout_ms", REDS_REAL_TIMEOUT_MS as f64)?;
    report.figure("reds.unclean.restart_latency_ms_mean", reds_restart)?;
    report.figure("speculative.unclean.failover_latency_ms_mean", spec_gap)?;
    report.figure("oracle.unclean.failover_latency_ms_mean", oracle_gap)?;
    report.figure("plain.unclean.app_recovery_latency_ms_mean", plain_rec)?;
    report.figure("super.unclean.app_recovery_latency_ms_mean", super_rec)?;
    report.figure("monitor.rss_peak_bytes", rss as f64)?;
    for (v, name) in VARIANTS.iter().enumerate() {
        let before = mean(&results[v].iter().map(|r| r.before_ops_per_s).collect::<Vec<_>>());
        let after = mean(&results[v].iter().map(|r| r.after_ops_per_s).collect::<Vec<_>>());
        report.figure(&format!("{name}.before_crash.throughput_ops_per_s_mean"), before)?;
        report.figure(&format!("{name}.after_failover.throughput_ops_per_s_mean"), after)?;
        if before > 0.0 {
            report.ratio(&format!("{name}.after_failover_vs_before_crash.throughput"), after, before)?;
        }
    }
    report.figure(
        "speculative.extra_instance_time_per_failure_s_mean",
        mean(&results[1].iter().map(|r| r.overlap_s).collect::<Vec<_>>()),
    )?;
    // Figure 6, short recovery (the measured one): II medium timeout, IV false positive, V short.
    let scen = [
        ("scenario_ii_timeout_60s", 60_000.0 + reds_restart, spec_gap, oracle_gap),
        ("scenario_iv_timeout_5s_false_positive_15s", 5_000.0 + reds_restart, spec_gap.min(TRANSIENT_MS), oracle_gap.min(TRANSIENT_MS)),
        ("scenario_v_timeout_5s", 5_000.0 + reds_restart, spec_gap, oracle_gap),
    ];
    let mut worst = 0.0f64;
    for (name, reds, spec, oracle) in scen {
        report.figure(&format!("{name}.reds.failover_latency_ms"), reds)?;
        report.figure(&format!("{name}.speculative.failover_latency_ms"), spec)?;
        report.figure(&format!("{name}.oracle.failover_latency_ms"), oracle)?;
        worst = worst.max(report.ratio(&format!("{name}.speculative_vs_oracle.failover_latency"), spec, oracle)?);
    }
    report.ratio("speculative_vs_oracle.failover_latency.worst", worst, 1.0)?;
    report.ratio("reds_60s_vs_speculative.failover_latency", 60_000.0 + reds_restart, spec_gap)?;
    report.ratio("super_vs_plain.app_recovery_latency", super_rec, plain_rec)?;

    // The client's throughput around the crash, per policy (first round).
    let series: Vec<bench::Series> = VARIANTS
        .iter()
        .zip(&results)
        .map(|(name, rs)| {
            let r = &rs[0];
            let per_s = 1000.0 / r.window_ms as f64;
            bench::Series {
                name: name.to_string(),
                points: r.ops_per_window.iter().enumerate().map(|(i, n)| ((i as u64 * r.window_ms) as f64 / 1000.0, *n as f64 * per_s)).collect(),
            }
        })
        .collect();
    let _ = bench::line_plot(&out.join("throughput"), "SQLite front: commits through the endpoint, SIGKILL at 2 s", "time (s)", "commits/s", &series, bench::Scale::Linear);
    let rows = series.iter().flat_map(|s| s.points.iter().map(move |(x, y)| vec![s.name.clone(), format!("{x:.1}"), format!("{y:.0}")]));
    bench::write_csv(&out.join("throughput.csv"), &["policy", "time_s", "commits_per_s"], rows)?;
    eprintln!("plots and samples in {}", out.display());
    report.print();
    Ok(())
}

/// `understudy failover demo`: a real speculative failover of SQLite, as a timeline.
pub fn demo(verbose: u8) -> anyhow::Result<()> {
    let base = std::env::temp_dir();
    let dir = tempfile::Builder::new().prefix("understudy-failover-demo-").tempdir_in(&base)?;
    println!("Understudy failover demo: SQLite behind its network front on an ext4 volume, speculative policy");
    let rt = crate::runtime()?;
    let mut lc = LocalCluster::start(&UpConfig { dir: dir.path().join("cluster"), shards: 4, replicas: 3, port_base: 0, verbose })?;
    rt.block_on(lc.wait_ready(READY_TIMEOUT, false))?;
    let cluster_file = lc.info.dir.join(crate::cluster_file::CLUSTER_FILE);
    lc.info.save(&cluster_file)?;
    println!("  cluster up: 4 shards, 3 replicas; a client inserts rows through the endpoint, one at a time");
    let r = run_one(&cluster_file, dir.path(), "speculative", 0, verbose, true);
    lc.stop();
    let r = r?;
    println!("  client throughput (commits/s per {} ms; the kill is at 2 s):", r.window_ms);
    let peak = r.ops_per_window.iter().copied().max().unwrap_or(1).max(1);
    let per_s = 1000.0 / r.window_ms as f64;
    for (i, n) in r.ops_per_window.iter().enumerate().step_by(2) {
        let bar = "#".repeat((*n as usize * 50).div_ceil(peak as usize));
        println!("  {:>6.1} s {:>6.0} {bar}", (i as u64 * r.window_ms) as f64 / 1000.0, *n as f64 * per_s);
    }
    let out = bench::out_dir("failover", None)?;
    let series = vec![bench::Series {
        name: "speculative".into(),
        points: r.ops_per_window.iter().enumerate().map(|(i, n)| ((i as u64 * r.window_ms) as f64 / 1000.0, *n as f64 * per_s)).collect(),
    }];
    if let Ok([svg, _]) = bench::line_plot(&out.join("demo-throughput"), "Speculative failover of SQLite: client commits/s", "time (s)", "commits/s", &series, bench::Scale::Linear) {
        println!("  plot: {}", svg.display());
    }
    println!("demo ok: the backup was promoted, no acknowledged commit was lost, the monitor used {:.1} MiB", r.monitor_rss_bytes as f64 / 1048576.0);
    Ok(())
}
