//! `understudy bench failover scenarios`: end-to-end failover of a real application (the SQLite
//! front on an ext4 volume) under REDS, speculative and oracle, measured from the client side.
//!
//! Each run: a fresh volume, `understudy failover run` as its own process (its peak RSS is the
//! monitor's memory), the load generator through the endpoint, an unclean crash (SIGKILL of the
//! whole primary), and the client's longest gap without an acknowledged commit as the failover
//! latency; every run also checks that no acknowledged commit was lost. Variants alternate ABBA
//! over the rounds.
//!
//! A never-failed run under the same load gives §6.5's baseline for the throughput right after a
//! promotion. The five Figure 6 scenarios are then composed as the paper composed them (§6.4:
//! "we simulated various failover scenarios ... recovery latencies picked from §6.3"): each
//! policy's fixed cost is its measured client outage less the application recovery within it
//! (and, for REDS, less the short timeout it ran with); a scenario adds its timeout (REDS) and
//! its recovery latency on the volume the policy recovers on — plain for REDS and the oracle,
//! the super child for speculative, the general clone for speculative-on-general. Short and
//! long recoveries (small WAL + clean stop, large WAL + SIGKILL) are measured in the same run
//! by [`super::recovery::measure`] or read from a `bench failover recovery` report. In the
//! false-positive scenario the primary returns after 15 s, so speculative and the oracle cost
//! at most that; REDS has committed to a restart.

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
    /// Take the short and long recovery latencies of the Figure 6 composition from this JSON
    /// report of `bench failover recovery` (PostgreSQL if it has it, else SQLite) instead of
    /// measuring them in this run (which uses SQLite with --quick, PostgreSQL otherwise).
    #[arg(long, value_name = "FILE")]
    pub recovery: Option<PathBuf>,
}

use super::recovery::Latencies;

/// Short (small WAL, clean stop) and long (large WAL, SIGKILL) recovery latencies.
fn recovery_inputs(a: &BenchArgs, cluster_file: &Path, dir: &Path) -> anyhow::Result<(Latencies, Latencies, String)> {
    if let Some(f) = &a.recovery {
        let text = std::fs::read_to_string(f).with_context(|| format!("cannot read {}", f.display()))?;
        let last = text.lines().rev().find(|l| l.trim_start().starts_with('{')).context("no JSON line in the recovery report")?;
        let v: serde_json::Value = serde_json::from_str(last).context("the recovery report is not JSON")?;
        anyhow::ensure!(v["bench"] == "failover.recovery", "{} is not a `bench failover recovery` report", f.display());
        for app in ["postgres", "sqlite"] {
            let get = |cell: &str, c: &str| v["figures"][format!("{app}.{cell}.{c}.app_recovery_latency_ms_mean")].as_f64();
            let lat = |cell: &str| -> Option<Latencies> {
                Some(Latencies { plain_ms: get(cell, "plain")?, super_ms: get(cell, "super")?, general_ms: get(cell, "general")? })
            };
            if let (Some(s), Some(l)) = (lat("small_wal.clean"), lat("large_wal.unclean")) {
                return Ok((s, l, format!("{app} from {}", f.display())));
            }
        }
        anyhow::bail!("{} has no small_wal.clean and large_wal.unclean cells", f.display());
    }
    let (app, large) = if a.quick { ("sqlite", super::recovery::LARGE_WAL_BYTES_QUICK) } else { ("postgres", super::recovery::LARGE_WAL_BYTES) };
    // postgres runs unprivileged: it must reach its data directory under here.
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let rt = crate::runtime()?;
    let short = rt.block_on(super::recovery::measure(cluster_file, dir, app, false, super::recovery::SMALL_WAL_BYTES, false))?;
    let long = rt.block_on(super::recovery::measure(cluster_file, dir, app, true, large, true))?;
    Ok((short, long, format!("{app} measured in this run")))
}

const VARIANTS: [&str; 3] = ["reds", "speculative", "oracle"];
/// The REDS timeout the real runs use; the scenarios add the paper's timeouts instead.
const REDS_REAL_TIMEOUT_MS: u64 = 2_000;
const PING_INTERVAL_MS: u64 = 200;
const TRANSIENT_MS: f64 = 15_000.0;

struct RunResult {
    gap_ms: f64,
    /// Client commits/s in the settle time (2 s; 1 s with --quick) before the crash and after
    /// service resumed.
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

/// The application the demo fails over (the benchmark's runs use SQLite).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoApp {
    /// The SQLite front (python3's sqlite3): works on a fresh machine.
    #[default]
    Sqlite,
    /// Debian's PostgreSQL server, unmodified (needs the postgresql package).
    Postgres,
}

impl DemoApp {
    fn title(self) -> &'static str {
        match self {
            DemoApp::Sqlite => "SQLite behind its network front",
            DemoApp::Postgres => "PostgreSQL (Debian's, unmodified)",
        }
    }

    fn short(self) -> &'static str {
        match self {
            DemoApp::Sqlite => "SQLite",
            DemoApp::Postgres => "PostgreSQL",
        }
    }

    fn volume_size(self) -> &'static str {
        match self {
            DemoApp::Sqlite => "128M",
            DemoApp::Postgres => "256M",
        }
    }

    fn command(self, exe: &Path) -> serde_json::Value {
        match self {
            DemoApp::Sqlite => serde_json::json!([exe, "failover", "sqlite-front", "--db", "{mount}/app.db", "--port", "{port}"]),
            DemoApp::Postgres => serde_json::json!([exe, "failover", "postgres", "--data", "{mount}/pgdata", "--port", "{port}"]),
        }
    }

    fn health(self) -> serde_json::Value {
        match self {
            DemoApp::Sqlite => serde_json::json!({ "send": "PING", "expect": "PONG", "timeout_ms": 1000 }),
            DemoApp::Postgres => serde_json::json!({ "postgres": {}, "send": "SELECT 1", "expect": "1", "timeout_ms": 1000 }),
        }
    }

    fn target(self) -> ::failover::load::Target {
        match self {
            DemoApp::Sqlite => ::failover::load::Target::Line,
            DemoApp::Postgres => ::failover::load::Target::Postgres(Default::default()),
        }
    }

    /// What it needs that a fresh machine may lack, said plainly.
    fn check_installed(self) -> anyhow::Result<()> {
        match self {
            DemoApp::Sqlite => {
                ::failover::spec::find_program("python3").context("the SQLite demo needs python3 (apt-get install python3)")?;
            }
            DemoApp::Postgres => {
                super::postgres::find_bin_dir()
                    .context("PostgreSQL is not installed (apt-get install postgresql, or scripts/install-deps); `understudy demo` without --app postgres shows SQLite")?;
            }
        }
        Ok(())
    }
}

/// How long the load runs before the crash and after the outcome, and how long throughput is
/// averaged over on each side of the outage (2 s; 1 s with `--quick`).
#[derive(Clone, Copy)]
struct Settle(Duration);

impl Settle {
    fn new(quick: bool) -> Settle {
        Settle(Duration::from_secs(if quick { 1 } else { 2 }))
    }

    fn ms(self) -> u64 {
        self.0.as_millis() as u64
    }
}

/// The load with no failure at all (settle, then three times as long measured): the
/// never-failed instance of §6.5.
fn run_never_failed(cluster_file: &Path, dir: &Path, verbose: u8, settle: Settle) -> anyhow::Result<RunResult> {
    run_inner(cluster_file, dir, "speculative", 0, verbose, false, false, settle, DemoApp::Sqlite)
}

#[allow(clippy::too_many_arguments)]
fn run_one(cluster_file: &Path, dir: &Path, variant: &str, round: usize, verbose: u8, tell: bool, settle: Settle, app: DemoApp) -> anyhow::Result<RunResult> {
    run_inner(cluster_file, dir, variant, round, verbose, tell, true, settle, app)
}

/// The last lines of a run's logs (the monitor's and its instances'), for an error report: a
/// failed run is otherwise hard to diagnose once its directory is gone.
fn logs_tail(run_dir: &Path) -> String {
    const TAIL_LINES: usize = 15;
    let mut files = vec![run_dir.join("monitor.err")];
    if let Ok(rd) = std::fs::read_dir(run_dir.join("state").join("logs")) {
        let mut logs: Vec<_> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
        logs.sort();
        files.extend(logs);
    }
    let mut out = String::new();
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else { continue };
        let lines: Vec<&str> = text.lines().collect();
        let tail = &lines[lines.len().saturating_sub(TAIL_LINES)..];
        out.push_str(&format!("\n--- {} (last {} lines)\n{}", f.display(), tail.len(), tail.join("\n")));
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn run_inner(
    cluster_file: &Path,
    dir: &Path,
    variant: &str,
    round: usize,
    verbose: u8,
    tell: bool,
    crash: bool,
    settle: Settle,
    app: DemoApp,
) -> anyhow::Result<RunResult> {
    let vol = format!("bench-{variant}-{round}{}", if crash { "" } else { "-nofail" });
    let run_dir = dir.join(format!("run-{vol}"));
    run_body(cluster_file, &run_dir, &vol, variant, round, tell, crash, verbose, settle, app)
        .map_err(|e| e.context(format!("run {vol} failed; its logs:{}", logs_tail(&run_dir))))
}

#[allow(clippy::too_many_arguments)]
fn run_body(
    cluster_file: &Path,
    run_dir: &Path,
    vol: &str,
    variant: &str,
    round: usize,
    tell: bool,
    crash: bool,
    verbose: u8,
    settle: Settle,
    app: DemoApp,
) -> anyhow::Result<RunResult> {
    let exe = std::env::current_exe()?;
    let cli = |args: &[&str]| -> anyhow::Result<String> {
        let o = Command::new(&exe).args(args).arg("--cluster").arg(cluster_file).output()?;
        anyhow::ensure!(o.status.success(), "`understudy {}`: {}", args.join(" "), String::from_utf8_lossy(&o.stderr).trim());
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    };
    cli(&["volume", "create", vol, "--size", app.volume_size()])?;
    std::fs::create_dir_all(run_dir)?;
    let port = free_port()?;
    let control = format!("127.0.0.1:{}", free_port()?);
    let spec = serde_json::json!({
        "volume": vol,
        "state_dir": run_dir.join("state"),
        "mkfs": true,
        "app": { "command": app.command(&exe) },
        "health": app.health(),
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
    let target = app.target();
    let load = std::thread::spawn(move || -> anyhow::Result<(::failover::load::LoadResult, ::failover::load::Verdict)> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        rt.block_on(async {
            let r = ::failover::load::run_load(endpoint, &target, Duration::from_secs(600), 100, async {
                let _ = stop_rx.await;
            })
            .await;
            let v = ::failover::load::verify(endpoint, &target, &r, Duration::from_secs(60)).await.map_err(anyhow::Error::msg)?;
            Ok((r, v))
        })
    });
    std::thread::sleep(settle.0);
    if !crash {
        std::thread::sleep(settle.0 * 3);
        let rss = peak_rss_bytes(monitor.0.id()).unwrap_or(0);
        let _ = stop_tx.send(());
        let (r, v) = load.join().map_err(|_| anyhow::anyhow!("the load thread panicked"))??;
        anyhow::ensure!(v.missing.is_empty() && v.unexpected.is_empty(), "never-failed run lost commits: {v:?}");
        let n = r.acked.iter().filter(|(_, t)| *t >= settle.ms() && *t < settle.ms() * 4).count();
        let rate = n as f64 / (settle.0.as_secs_f64() * 3.0);
        return Ok(RunResult {
            gap_ms: r.max_gap_ms as f64,
            before_ops_per_s: rate,
            after_ops_per_s: rate,
            overlap_s: 0.0,
            app_recovery_ms: f64::NAN,
            monitor_rss_bytes: rss,
            ops_per_window: r.ops_per_window,
            window_ms: r.window_ms,
        });
    }
    super::control_request(control_addr, "kill")?;
    if tell {
        println!("  {:>9} demo: SIGKILL of the whole primary (application and its volume server)", "");
    }
    let done = wait_event(&rx, &mut seen, &["promoted", "reds_restarted"], Duration::from_secs(300), tell)?;
    let rss = peak_rss_bytes(monitor.0.id()).unwrap_or(0);
    std::thread::sleep(settle.0);
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
    let before = rate(r.gap_start_ms.saturating_sub(settle.ms()), r.gap_start_ms);
    let after = rate(r.gap_end_ms, r.gap_end_ms + settle.ms());
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
    let settle = Settle::new(a.quick);
    let mut results: Vec<Vec<RunResult>> = (0..VARIANTS.len()).map(|_| vec![]).collect();
    for (i, v) in bench::interleaved_order(rounds, VARIANTS.len()).into_iter().enumerate() {
        let round = i / VARIANTS.len();
        results[v].push(run_one(&cluster_file, dir.path(), VARIANTS[v], round, verbose, false, settle, DemoApp::Sqlite)?);
    }
    let never_failed = run_never_failed(&cluster_file, dir.path(), verbose, settle);
    let recov = never_failed.and_then(|nf| Ok((nf, recovery_inputs(&a, &cluster_file, dir.path())?)));
    lc.stop();
    let (never_failed, (short, long, recovery_source)) = recov?;
    eprintln!("failover bench: Figure 6 recovery latencies: {recovery_source}: short {short:?}, long {long:?}");

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
    let overlap_ms = mean(&results[1].iter().map(|r| r.overlap_s * 1000.0).collect::<Vec<_>>());
    report.figure("speculative.extra_instance_time_per_failure_s_mean", overlap_ms / 1000.0)?;
    // §6.5: throughput right after the promotion against an instance that never failed (same
    // load, same time since its start).
    report.figure("never_failed.throughput_ops_per_s_mean", never_failed.after_ops_per_s)?;
    report.figure("monitor.never_failed.rss_peak_bytes", never_failed.monitor_rss_bytes as f64)?;
    let spec_after = mean(&results[1].iter().map(|r| r.after_ops_per_s).collect::<Vec<_>>());
    if never_failed.after_ops_per_s > 0.0 {
        report.ratio("speculative.after_promotion_vs_never_failed.throughput", spec_after, never_failed.after_ops_per_s)?;
    }

    // Figure 6, composed as §6.4 did: each policy's fixed costs measured above (detection,
    // attach, collapse, re-point: its client outage less the application's recovery in it),
    // plus the recovery latency of the scenario on the volume the policy recovers on.
    let nonneg = |x: f64| if x.is_finite() { x.max(0.0) } else { 0.0 };
    let reds_over = nonneg(reds_gap - REDS_REAL_TIMEOUT_MS as f64 - mean(&results[0].iter().map(|r| r.app_recovery_ms).collect::<Vec<_>>()));
    let spec_over = nonneg(spec_gap - super_rec);
    let oracle_over = nonneg(oracle_gap - mean(&results[2].iter().map(|r| r.app_recovery_ms).collect::<Vec<_>>()));
    // Speculative holds the backup from its start (`detect` after the crash) until promotion
    // (its recovery plus `post`: collapse, re-point, kill), or until the primary returns.
    let detect = nonneg(spec_gap - overlap_ms);
    let post = nonneg(overlap_ms - super_rec);
    report.figure("reds.fixed_cost_ms", reds_over)?;
    report.figure("speculative.fixed_cost_ms", spec_over)?;
    report.figure("oracle.fixed_cost_ms", oracle_over)?;
    for (name, l) in [("short_recovery", short), ("long_recovery", long)] {
        report.figure(&format!("{name}.plain.app_recovery_latency_ms"), l.plain_ms)?;
        report.figure(&format!("{name}.super.app_recovery_latency_ms"), l.super_ms)?;
        report.figure(&format!("{name}.general.app_recovery_latency_ms"), l.general_ms)?;
    }
    struct Scen {
        name: &'static str,
        label: &'static str,
        timeout_ms: f64,
        rec: Latencies,
        back_ms: Option<f64>,
    }
    let scen = [
        Scen { name: "scenario_i_timeout_60s_long_recovery", label: "I 60s long", timeout_ms: 60_000.0, rec: long, back_ms: None },
        Scen { name: "scenario_ii_timeout_60s", label: "II 60s short", timeout_ms: 60_000.0, rec: short, back_ms: None },
        Scen { name: "scenario_iii_timeout_5s_long_recovery", label: "III 5s long", timeout_ms: 5_000.0, rec: long, back_ms: None },
        Scen { name: "scenario_iv_timeout_5s_false_positive_15s", label: "IV 5s FP 15s", timeout_ms: 5_000.0, rec: long, back_ms: Some(TRANSIENT_MS) },
        Scen { name: "scenario_v_timeout_5s", label: "V 5s short", timeout_ms: 5_000.0, rec: short, back_ms: None },
    ];
    let policies = ["reds", "speculative", "speculative_general", "oracle"];
    let mut bars: Vec<bench::BarSeries> = policies.iter().map(|p| bench::BarSeries { name: p.to_string(), values: vec![] }).collect();
    let mut worst = 0.0f64;
    for s in &scen {
        let cap = |x: f64| s.back_ms.map_or(x, |b| x.min(b));
        // REDS commits to the restart at its timeout, primary back or not (a false positive).
        let reds = s.timeout_ms + reds_over + s.rec.plain_ms;
        let spec = cap(spec_over + s.rec.super_ms);
        let spec_general = cap(spec_over + s.rec.general_ms);
        let oracle = cap(oracle_over + s.rec.plain_ms);
        let extra = |rec_ms: f64| match s.back_ms {
            Some(b) if spec_over + rec_ms > b => nonneg(b - detect),
            _ => rec_ms + post,
        };
        for (i, v) in [reds, spec, spec_general, oracle].into_iter().enumerate() {
            report.figure(&format!("{}.{}.failover_latency_ms", s.name, policies[i]), v)?;
            bars[i].values.push(v / 1000.0);
        }
        report.figure(&format!("{}.speculative.extra_instance_s", s.name), extra(s.rec.super_ms) / 1000.0)?;
        report.figure(&format!("{}.speculative_general.extra_instance_s", s.name), extra(s.rec.general_ms) / 1000.0)?;
        worst = worst.max(report.ratio(&format!("{}.speculative_vs_oracle.failover_latency", s.name), spec, oracle)?);
        report.ratio(&format!("{}.reds_vs_speculative.failover_latency", s.name), reds, spec)?;
    }
    let labels: Vec<&str> = scen.iter().map(|s| s.label).collect();
    let _ = bench::bar_plot(&out.join("figure6"), "End-to-end failover latency (SpecREDS Figure 6)", "scenario (timeout, recovery)", "seconds", &labels, &bars);
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
    let title = format!("SQLite front: commits through the endpoint, SIGKILL at {} s", settle.0.as_secs());
    let _ = bench::line_plot(&out.join("throughput"), &title, "time (s)", "commits/s", &series, bench::Scale::Linear);
    let rows = series.iter().flat_map(|s| s.points.iter().map(move |(x, y)| vec![s.name.clone(), format!("{x:.1}"), format!("{y:.0}")]));
    bench::write_csv(&out.join("throughput.csv"), &["policy", "time_s", "commits_per_s"], rows)?;
    eprintln!("plots and samples in {}", out.display());
    report.print();
    Ok(())
}

/// `understudy failover demo`: a real speculative failover of SQLite (or PostgreSQL), as a
/// timeline.
pub fn demo(verbose: u8, app: DemoApp) -> anyhow::Result<()> {
    app.check_installed()?;
    let base = std::env::temp_dir();
    let dir = tempfile::Builder::new().prefix("understudy-failover-demo-").tempdir_in(&base)?;
    // PostgreSQL runs unprivileged: it must reach its data directory on the instance's mount.
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    println!("Understudy failover demo: {} on an ext4 volume, speculative policy", app.title());
    let rt = crate::runtime()?;
    let mut lc = LocalCluster::start(&UpConfig { dir: dir.path().join("cluster"), shards: 4, replicas: 3, port_base: 0, verbose })?;
    rt.block_on(lc.wait_ready(READY_TIMEOUT, false))?;
    let cluster_file = lc.info.dir.join(crate::cluster_file::CLUSTER_FILE);
    lc.info.save(&cluster_file)?;
    println!("  cluster up: 4 shards, 3 replicas; a client inserts rows through the endpoint, one at a time");
    let r = run_one(&cluster_file, dir.path(), "speculative", 0, verbose, true, Settle::new(false), app);
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
    let title = format!("Speculative failover of {}: client commits/s", app.short());
    if let Ok([svg, _]) = bench::line_plot(&out.join("demo-throughput"), &title, "time (s)", "commits/s", &series, bench::Scale::Linear) {
        println!("  plot: {}", svg.display());
    }
    println!("demo ok: the backup was promoted, no acknowledged commit was lost, the monitor used {:.1} MiB", r.monitor_rss_bytes as f64 / 1048576.0);
    Ok(())
}
