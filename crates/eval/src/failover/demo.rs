//! The failover part of `understudy demo`: a real speculative failover of SQLite (or
//! PostgreSQL) under load, as a timeline. The monitor runs as a child process behind
//! [`testbed::failover::MonitorGuard`], which cleans up after it.

use std::path::Path;
use std::process::Command;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use anyhow::Context;
use testbed::failover::{logs_tail, start_monitor};
use testbed::volume::{LocalCluster, UpConfig, READY_TIMEOUT};

const PING_INTERVAL_MS: u64 = 200;
/// The REDS timeout of a demo run with the REDS policy.
const REDS_REAL_TIMEOUT_MS: u64 = 2_000;

struct RunResult {
    monitor_rss_bytes: u64,
    ops_per_window: Vec<u64>,
    window_ms: u64,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(wire::ports::free_loopback_port()?)
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
                testbed::postgres::find_bin_dir()
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
}

#[allow(clippy::too_many_arguments)]
fn run_one(cluster_file: &Path, dir: &Path, variant: &str, round: usize, verbose: u8, tell: bool, settle: Settle, app: DemoApp) -> anyhow::Result<RunResult> {
    run_inner(cluster_file, dir, variant, round, verbose, tell, settle, app)
}

#[allow(clippy::too_many_arguments)]
fn run_inner(
    cluster_file: &Path,
    dir: &Path,
    variant: &str,
    round: usize,
    verbose: u8,
    tell: bool,
    settle: Settle,
    app: DemoApp,
) -> anyhow::Result<RunResult> {
    let vol = format!("bench-{variant}-{round}");
    let run_dir = dir.join(format!("run-{vol}"));
    run_body(cluster_file, &run_dir, &vol, variant, round, tell, verbose, settle, app)
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
    let (monitor, rx) = start_monitor(&exe, &spec_path, run_dir, &control, cluster_file, verbose)?;
    let mut seen = vec![];
    wait_event(&rx, &mut seen, &["primary_up"], Duration::from_secs(180), tell)?;
    let control_addr = control.parse()?;
    let secret = testbed::cluster_file::resolve_secret(Some(cluster_file), None)?;
    if variant == "oracle" {
        // The evaluator knows the future: the primary will never come back.
        testbed::failover::control_request(control_addr, &secret, "hint never 0")?;
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
    testbed::failover::control_request(control_addr, &secret, "kill")?;
    if tell {
        println!("  {:>9} demo: SIGKILL of the whole primary (application and its volume server)", "");
    }
    let done = wait_event(&rx, &mut seen, &["promoted", "reds_restarted"], Duration::from_secs(300), tell)?;
    let rss = testbed::proc::peak_rss_bytes(monitor.pid()).unwrap_or(0);
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
    Ok(RunResult { monitor_rss_bytes: rss, ops_per_window: r.ops_per_window, window_ms: r.window_ms })
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
    let cluster_file = lc.info.dir.join(testbed::cluster_file::CLUSTER_FILE);
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
