//! `understudy bench failover scenarios`: SpecREDS Figure 6 (§6.4) and §6.5, live.
//!
//! Every scenario is a real failure of a real application under a real monitor with its real
//! timeout: the SQLite front on an ext4 volume, the load generator through the endpoint, and
//! for each policy a failure injected into its primary — SIGKILL of the whole instance, or, for
//! the false positive (IV), its network link cut for the transient time, after which the
//! primary answers again. The failover latency is the client's longest time without an
//! acknowledged commit; every failure checks that no acknowledged commit was lost and nothing
//! never attempted appears. Beside it, the monitor's own timeline (first missed ping → the
//! outcome that lets clients in again) and what separates the two: last acknowledgement →
//! fault, fault → first missed ping (detection), outcome → first acknowledgement.
//!
//! Monitors run side by side on one cluster (each its own volume, state and endpoint), started
//! together: REDS with the medium timeout (scenarios I, II), REDS with the short one (III–V),
//! speculative (falling back to REDS with the medium timeout after repeated aborts, §4.4),
//! oracle (told the future through its hint), and one that never fails. Each scenario runs the
//! policies one after another, in alternating order from scenario to scenario, so the
//! machine's noise hits them alike; `--scenario` runs a subset (e.g. `--scenario II`).
//! Recovery length is Figure 6's variable: SQLite's own recovery plus the scenario's recovery
//! time, which every instance started after the failure spends before serving (the bench
//! writes it to the file the front reads), the same for every policy. With `--quick` the times
//! are scaled down, and speculative and the oracle — which use no timeout — run scenarios I/III
//! and II/V as one failure each.
//!
//! §6.5: after each speculative promotion the bench waits for garbage collection to end (the
//! metadata service's job list empties) and reports how long that took; after scenario II's
//! (or the first, when II is not run) it compares the promoted instance's throughput with the
//! never-failed one's, both under the same load at the same time, window by window after a
//! warm-up, reporting every window and their median; and once more at the end (after the false
//! positive hit the same primary). It also reports the instance-seconds the backup was held
//! beside the primary per failure.
//!
//! Speculative on the general clone (Figure 6's rbd-clone bars) is composed, never live: see
//! [`GeneralTwin`] and [`composed_general_ms`].

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use serde_json::Value;

use ::failover::pool::InstancePool;

use testbed::failover::{logs_tail, MonitorGuard};
use testbed::proc::peak_rss_bytes;
use testbed::volume::{LocalCluster, UpConfig, READY_TIMEOUT};

#[derive(Args, Debug)]
pub struct ScenarioArgs {
    /// A short run (times scaled down; under a minute).
    #[arg(long)]
    pub quick: bool,
    /// Where plots and CSV go [default: target/bench/failover].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// The medium timeout of REDS (scenarios I, II) [default: 60000; 1500 with --quick].
    #[arg(long, value_name = "MS")]
    pub medium_timeout_ms: Option<u64>,
    /// The short timeout of REDS (scenarios III–V) [default: 5000; 300 with --quick].
    #[arg(long, value_name = "MS")]
    pub short_timeout_ms: Option<u64>,
    /// How long the false positive's network cut lasts (IV) [default: 15000; 1500 with --quick].
    #[arg(long, value_name = "MS")]
    pub transient_ms: Option<u64>,
    /// Long recovery: time an instance spends recovering after SQLite's own recovery
    /// (I, III, IV) [default: 30000; 2500 with --quick]. The paper's is about 70 s.
    #[arg(long, value_name = "MS")]
    pub long_recovery_ms: Option<u64>,
    /// Short recovery (II, V) [default: 5000; 200 with --quick]. The paper's is about 8 s.
    #[arg(long, value_name = "MS")]
    pub short_recovery_ms: Option<u64>,
    /// Run only these scenarios, e.g. `--scenario II` or `--scenario I,II` (I–V) [default: all].
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub scenario: Vec<String>,
    /// §6.5: windows in which the never-failed and the promoted instance run the same load side
    /// by side (after garbage collection ended and a warm-up window) [default: 30; 4 with
    /// --quick].
    #[arg(long, value_name = "N")]
    pub rounds: Option<usize>,
    /// §6.5: length of each of those windows [default: 2000; 500 with --quick].
    #[arg(long, value_name = "MS")]
    pub window_ms: Option<u64>,
    /// §6.3 inside this bench: after the scenarios, rounds of one crash of the oracle's primary
    /// (recovery on the plain volume) and one of speculative's (on the super child), in ABBA
    /// order, with no added recovery time; `super_vs_plain.app_recovery_latency` is the median
    /// of the rounds' ratios [default: 8; 2 with --quick; 0: the mean over the scenarios'
    /// crashes instead].
    #[arg(long, value_name = "N")]
    pub recovery_rounds: Option<usize>,
    /// During the recovery rounds, scrape every shard's counters this often and cut them at
    /// the recovery's phases (child first writes, in-place writes, reads, refill; 0: off)
    /// [default: 20].
    #[arg(long, value_name = "MS")]
    pub counter_interval_ms: Option<u64>,
    /// Before the recovery rounds, commits on both of their instances at once, so SQLite's WAL
    /// has reached its full size (1000 pages) and is reused: while it still grows, every
    /// commit's fsync is an ext4 journal transaction (~5 blocks), and a crash leaves hundreds
    /// of them for the next mount to replay through the volume; once it is reused, a commit
    /// adds none. 0: no warm-up (a fresh database's growth is measured) [default: 1200].
    #[arg(long, value_name = "N")]
    pub recovery_warmup_commits: Option<usize>,
}

/// The primary is pinged this often (the backup while it starts: `backup_ping_interval_ms`).
const PING_INTERVAL_MS: u64 = 200;
/// A health check that takes longer counts as missed (a cut link drops packets: no refusal).
/// Not shorter: on a loaded machine a shorter one misses pings of a healthy primary.
const HEALTH_TIMEOUT_MS: u64 = 1_000;
/// Commits acknowledged before a failure, and again after its outcome, to call the load flowing.
const FLOWING_COMMITS: usize = 10;
/// How long any one step may take at most.
const STEP_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Clone, Copy)]
struct Params {
    medium_ms: u64,
    short_ms: u64,
    transient_ms: u64,
    long_rec_ms: u64,
    short_rec_ms: u64,
    /// Load before a failure and after service resumed (the throughput windows).
    settle: Duration,
    /// The §6.5 throughput windows, and how many ABBA rounds of them.
    window: Duration,
    rounds: usize,
    /// Interleaved crash rounds of oracle (plain) and speculative (super).
    recovery_rounds: usize,
    /// Scrape interval of the shards' counters during those rounds (None: off).
    counter_interval: Option<Duration>,
    /// Commits on both recovery-round instances before the rounds.
    recovery_warmup_commits: usize,
}

impl Params {
    fn new(a: &ScenarioArgs) -> Params {
        let q = a.quick;
        Params {
            medium_ms: a.medium_timeout_ms.unwrap_or(if q { 1_500 } else { 60_000 }),
            short_ms: a.short_timeout_ms.unwrap_or(if q { 300 } else { 5_000 }),
            transient_ms: a.transient_ms.unwrap_or(if q { 1_500 } else { 15_000 }),
            long_rec_ms: a.long_recovery_ms.unwrap_or(if q { 2_500 } else { 30_000 }),
            short_rec_ms: a.short_recovery_ms.unwrap_or(if q { 200 } else { 5_000 }),
            settle: Duration::from_millis(if q { 300 } else { 1_000 }),
            // Short windows, many rounds: the machine's speed drifts over seconds (other work
            // on it), and the closer A and B are in time, the more alike that drift hits them.
            window: Duration::from_millis(a.window_ms.unwrap_or(if q { 500 } else { 2_000 })),
            rounds: a.rounds.unwrap_or(if q { 4 } else { 30 }).max(1),
            recovery_rounds: a.recovery_rounds.unwrap_or(if q { 2 } else { 8 }),
            counter_interval: Some(a.counter_interval_ms.unwrap_or(20)).filter(|&ms| ms > 0).map(Duration::from_millis),
            recovery_warmup_commits: a.recovery_warmup_commits.unwrap_or(1200),
        }
    }
}

struct Scen {
    name: &'static str,
    label: &'static str,
    recovery_ms: u64,
    /// The false positive: the primary's link is cut for this long, then it answers again.
    transient_ms: Option<u64>,
    /// With --quick, speculative and the oracle take this earlier scenario's failure (the
    /// same experiment for a policy without a timeout).
    same_as: Option<usize>,
}

/// The scenarios `--scenario` selects (indices into [`scenarios`]), all when none is named.
fn selected(names: &[String]) -> anyhow::Result<Vec<usize>> {
    const ROMAN: [&str; 5] = ["I", "II", "III", "IV", "V"];
    if names.is_empty() {
        return Ok((0..5).collect());
    }
    let mut v = vec![];
    for n in names {
        let n = n.trim();
        let i = ROMAN
            .iter()
            .position(|r| r.eq_ignore_ascii_case(n))
            .or_else(|| n.parse::<usize>().ok().filter(|k| (1..=5).contains(k)).map(|k| k - 1))
            .with_context(|| format!("--scenario {n:?}: scenarios are I, II, III, IV, V (or 1–5)"))?;
        if !v.contains(&i) {
            v.push(i);
        }
    }
    v.sort();
    Ok(v)
}

fn scenarios(p: &Params) -> Vec<Scen> {
    vec![
        Scen { name: "scenario_i_timeout_medium_long_recovery", label: "I medium long", recovery_ms: p.long_rec_ms, transient_ms: None, same_as: None },
        Scen { name: "scenario_ii_timeout_medium_short_recovery", label: "II medium short", recovery_ms: p.short_rec_ms, transient_ms: None, same_as: None },
        Scen { name: "scenario_iii_timeout_short_long_recovery", label: "III short long", recovery_ms: p.long_rec_ms, transient_ms: None, same_as: Some(0) },
        Scen {
            name: "scenario_iv_timeout_short_false_positive",
            label: "IV short FP",
            recovery_ms: p.long_rec_ms,
            transient_ms: Some(p.transient_ms),
            same_as: None,
        },
        Scen { name: "scenario_v_timeout_short_short_recovery", label: "V short short", recovery_ms: p.short_rec_ms, transient_ms: None, same_as: Some(1) },
    ]
}

/// One `understudy failover run` of the bench, with its event stream.
struct Mon {
    name: &'static str,
    policy: &'static str,
    guard: MonitorGuard,
    rx: Receiver<Value>,
    seen: Vec<Value>,
    control: SocketAddr,
    /// The cluster secret its control port asks for.
    secret: Vec<u8>,
    endpoint: SocketAddr,
    run_dir: PathBuf,
    delay_file: PathBuf,
    /// Suspicions of a primary that was not failed (missed pings on a loaded machine).
    spurious: usize,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(wire::ports::free_loopback_port()?)
}

impl Mon {
    fn start(cluster_file: &Path, dir: &Path, name: &'static str, policy: &'static str, reds_timeout_ms: u64, verbose: u8) -> anyhow::Result<Mon> {
        let exe = std::env::current_exe()?;
        let vol = format!("fig6-{name}");
        let o = Command::new(&exe).args(["volume", "create", &vol, "--size", "128M", "--cluster"]).arg(cluster_file).output()?;
        anyhow::ensure!(o.status.success(), "creating volume {vol}: {}", String::from_utf8_lossy(&o.stderr).trim());
        let run_dir = dir.join(format!("run-{name}"));
        std::fs::create_dir_all(&run_dir)?;
        let delay_file = run_dir.join("recovery_delay_ms");
        let endpoint: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let control: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let spec = serde_json::json!({
            "volume": vol,
            "state_dir": run_dir.join("state"),
            "mkfs": true,
            "app": { "command": [exe, "failover", "sqlite-front", "--db", "{mount}/app.db", "--port", "{port}", "--startup-delay-file", delay_file] },
            "health": { "send": "PING", "expect": "PONG", "timeout_ms": HEALTH_TIMEOUT_MS },
            "endpoint": { "listen": endpoint },
            "monitor": {
                "policy": policy,
                "ping_interval_ms": PING_INTERVAL_MS,
                "reds_timeout_ms": reds_timeout_ms,
                "healthy_timeout_ms": 600_000,
            },
        });
        let spec_path = run_dir.join("spec.json");
        std::fs::write(&spec_path, serde_json::to_vec_pretty(&spec)?)?;
        let (guard, rx) = testbed::failover::start_monitor(&exe, &spec_path, &run_dir, &control.to_string(), cluster_file, verbose)?;
        let secret = testbed::cluster_file::resolve_secret(Some(cluster_file), None)?;
        Ok(Mon { name, policy, guard, rx, seen: vec![], control, secret, endpoint, run_dir, delay_file, spurious: 0 })
    }

    fn wait(&mut self, names: &[&str], timeout: Duration) -> anyhow::Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let e = self.rx.recv_timeout(left).map_err(|_| anyhow::anyhow!("{}: no {names:?} event within {timeout:?} (events: {:?})", self.name, self.seen))?;
            self.seen.push(e.clone());
            if names.iter().any(|n| e["event"] == *n) {
                return Ok(e);
            }
            anyhow::ensure!(e["event"] != "gave_up", "{}: the monitor gave up: {e}", self.name);
        }
    }

    fn control(&self, line: &str) -> anyhow::Result<String> {
        testbed::failover::control_request(self.control, &self.secret, line)
    }

    /// Errors of this monitor's run, with its logs.
    fn context(&self, e: anyhow::Error) -> anyhow::Error {
        e.context(format!("monitor {} failed; its logs:{}", self.name, logs_tail(&self.run_dir)))
    }
}

/// The load through one endpoint in its own thread and runtime.
struct Load {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    handle: std::thread::JoinHandle<anyhow::Result<(::failover::load::LoadResult, ::failover::load::Verdict)>>,
    acked: Arc<AtomicUsize>,
    /// Wall-clock time (ms) of the load's start: its acknowledgement times count from here.
    start_unix_ms: Arc<std::sync::atomic::AtomicU64>,
}

impl Load {
    fn start(endpoint: SocketAddr) -> Load {
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let acked = Arc::new(AtomicUsize::new(0));
        let a = acked.clone();
        let start_unix_ms = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let su = start_unix_ms.clone();
        let handle = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(async {
                su.store(::failover::proto::now_unix_ms(), Ordering::Relaxed);
                let target = ::failover::load::Target::Line;
                let stop = async {
                    let _ = stop_rx.await;
                };
                let r = ::failover::load::run_load_observed(endpoint, &target, STEP_TIMEOUT, 100, stop, |n, _| a.store(n, Ordering::Relaxed)).await;
                let v = ::failover::load::verify(endpoint, &target, &r, Duration::from_secs(60)).await.map_err(anyhow::Error::msg)?;
                Ok((r, v))
            })
        });
        Load { stop: Some(stop_tx), handle, acked, start_unix_ms }
    }

    fn acked(&self) -> usize {
        self.acked.load(Ordering::Relaxed)
    }

    fn wait_acked(&self, n: usize, what: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + STEP_TIMEOUT;
        while self.acked() < n {
            anyhow::ensure!(!self.handle.is_finished(), "{what}: the load stopped");
            anyhow::ensure!(Instant::now() < deadline, "{what}: {} of {n} commits acknowledged within {STEP_TIMEOUT:?}", self.acked());
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    /// Stops the load and checks the table: every acknowledged commit, nothing else.
    fn finish(mut self, what: &str) -> anyhow::Result<::failover::load::LoadResult> {
        let _ = self.stop.take().map(|s| s.send(()));
        let (r, v) = self.handle.join().map_err(|_| anyhow::anyhow!("the load thread panicked"))??;
        anyhow::ensure!(v.missing.is_empty() && v.unexpected.is_empty(), "{what}: acknowledged commits lost {:?} or rows never attempted {:?}", v.missing, v.unexpected);
        Ok(r)
    }
}

/// Commits per second of `r` between two times (ms since its start).
fn rate(r: &::failover::load::LoadResult, from_ms: u64, to_ms: u64) -> f64 {
    let n = r.acked.iter().filter(|(_, t)| *t >= from_ms && *t < to_ms).count();
    n as f64 * 1000.0 / to_ms.saturating_sub(from_ms).max(1) as f64
}

/// What one failure under one policy measured.
#[derive(Clone, Debug)]
struct Sample {
    outcome: String,
    gap_ms: f64,
    before_ops_per_s: f64,
    after_ops_per_s: f64,
    /// Backup started → its first good health check, less the scenario's recovery time (the
    /// volume's attach and SQLite's own recovery).
    app_recovery_ms: f64,
    /// First missed ping → backup started (speculative: super; REDS/oracle: the fence).
    detect_to_start_ms: f64,
    /// Backup healthy → the outcome (speculative: freeze, collapse, re-point, old primary
    /// stopped; REDS/oracle: re-point).
    healthy_to_outcome_ms: f64,
    /// Time a backup ran beside the primary (speculative only).
    extra_instance_s: f64,
    /// The monitor's own failover timeline: first missed ping → the outcome that lets clients
    /// in again (promoted, REDS restarted, or the primary answering again).
    monitor_ms: f64,
    /// The client's outage = last ack → fault (`pre_fault_ms`) + fault → first missed ping
    /// (`detect_ms`) + `monitor_ms` + outcome event → first ack (`resume_ms`; negative when
    /// the client was served before the monitor reported: speculative reports `promoted` once
    /// the old primary is also stopped, after the endpoint was re-pointed).
    pre_fault_ms: f64,
    detect_ms: f64,
    resume_ms: f64,
    /// Where `app_recovery_ms` went (crashes only).
    breakdown: Option<super::breakdown::Breakdown>,
    /// What the shards did in each phase of that recovery ([`super::shardtrace::PHASES`]),
    /// when traced.
    shard_work: Option<Vec<super::shardtrace::PhaseWork>>,
    /// Rows the recovered instance's SQLite table held when it opened (its open scans them).
    table_rows: f64,
    /// When the outcome was seen.
    outcome_at: Instant,
    ops_per_window: Vec<u64>,
    window_ms: u64,
}

fn t_of(events: &[Value], name: &str) -> f64 {
    events.iter().rev().find(|e| e["event"] == name).and_then(|e| e["t_ms"].as_f64()).unwrap_or(f64::NAN)
}

/// One failure of scenario `s` under monitor `m`; with `trace` (the shards' metrics
/// addresses), the shards' counters are traced around it.
fn run_failure(m: &mut Mon, s: &Scen, p: &Params, trace: Option<&[String]>) -> anyhow::Result<Sample> {
    std::fs::write(&m.delay_file, s.recovery_ms.to_string())?;
    let load = Load::start(m.endpoint);
    load.wait_acked(FLOWING_COMMITS, "before the failure")?;
    std::thread::sleep(p.settle);
    // A speculation that a spurious suspicion started (a healthy primary missing a ping on a
    // loaded machine) ends first: the failure is to meet a monitor at rest.
    let deadline = Instant::now() + STEP_TIMEOUT;
    let mut waited = false;
    loop {
        let st: Value = serde_json::from_str(&m.control("status")?)?;
        if st["state"]["phase"] == "Normal" {
            break;
        }
        waited = true;
        anyhow::ensure!(Instant::now() < deadline, "{}: not at rest within {STEP_TIMEOUT:?}: {}", m.name, st["state"]["phase"]);
        std::thread::sleep(Duration::from_millis(50));
    }
    if waited {
        eprintln!("failover bench: {} waited for a spurious speculation to end before the failure", m.name);
    }
    // Whatever the monitor said since its last failure (a healthy primary suspected on a
    // loaded machine) is not this failure's.
    while let Ok(e) = m.rx.try_recv() {
        if e["event"] == "suspected" {
            m.spurious += 1;
        }
        m.seen.push(e);
    }
    let from = m.seen.len();
    if m.policy == "oracle" {
        // The evaluator knows the future: when (if ever) the primary answers again. Told just
        // before the failure (told earlier, it would act on a healthy primary's missed ping).
        let back = s.transient_ms.map_or("never".to_string(), |t| t.to_string());
        m.control(&format!("hint {back} {}", s.recovery_ms))?;
    }
    let tracer = trace.zip(p.counter_interval).map(|(a, i)| super::shardtrace::Tracer::start(a.to_vec(), i));
    let fault_unix_ms = ::failover::proto::now_unix_ms() as f64;
    match s.transient_ms {
        Some(t) => m.control(&format!("cut {t}"))?,
        None => m.control("kill")?,
    };
    let outcomes: &[&str] = match (m.policy, s.transient_ms.is_some()) {
        (_, false) => &["promoted", "reds_restarted"],
        ("reds", true) => &["reds_restarted"],
        ("oracle", true) => &["primary_answered"],
        (_, true) => &["aborted", "promoted"],
    };
    let done = m.wait(outcomes, STEP_TIMEOUT)?;
    let outcome_at = Instant::now();
    let trace = tracer.map(|t| t.finish());
    let n = load.acked();
    load.wait_acked(n + FLOWING_COMMITS, "after the outcome")?;
    std::thread::sleep(p.settle);
    let load_start = load.start_unix_ms.load(Ordering::Relaxed) as f64;
    let r = load.finish(&format!("{} {}", m.name, s.name))?;
    let ev = &m.seen[from..];
    let unix_of = |names: &[&str]| ev.iter().find(|e| names.iter().any(|n| e["event"] == *n)).and_then(|e| e["unix_ms"].as_f64()).unwrap_or(f64::NAN);
    let suspected_unix = unix_of(&["suspected"]);
    let back_unix = unix_of(&["promoted", "reds_restarted", "primary_answered"]);
    // The outage is the longest gap between acknowledgements that ends after the fault (not
    // the longest of the run, which a stall of a loaded machine before the fault can be; not
    // merely the one around the fault's timestamp, which a request that was answered just as
    // the fault took hold splits).
    let fault_rel = fault_unix_ms - load_start;
    let times: Vec<f64> = r.acked.iter().map(|(_, t)| *t as f64).collect();
    let (gap_start, gap_end) = times
        .windows(2)
        .map(|w| (w[0], w[1]))
        .filter(|(_, b)| *b > fault_rel)
        .fold((f64::NAN, f64::NAN), |best, g| if best.0.is_nan() || g.1 - g.0 > best.1 - best.0 { g } else { best });
    let (last_ack_unix, first_ack_unix) = (load_start + gap_start, load_start + gap_end);
    if r.max_gap_ms as f64 > gap_end - gap_start {
        eprintln!(
            "failover bench: {} {}: the load's longest gap ({} ms, {} → {} ms) was not the failure's ({:.0} ms)",
            m.name,
            s.name,
            r.max_gap_ms,
            r.gap_start_ms,
            r.gap_end_ms,
            gap_end - gap_start
        );
    }
    let started = t_of(ev, "backup_started");
    let healthy = t_of(ev, "backup_healthy");
    let breakdown = recovery_breakdown(m, ev, s.recovery_ms as f64);
    let shard_work = trace.as_ref().and_then(|tr| {
        let b = recovery_bounds(m, ev, s.recovery_ms as f64)?;
        Some(b.windows(2).map(|w| super::shardtrace::PhaseWork::of(&tr.delta(w[0], w[1]))).collect::<Vec<_>>())
    });
    let outcome_t = done["t_ms"].as_f64().unwrap_or(f64::NAN);
    let extra = match m.policy {
        "speculative" if started.is_finite() => (outcome_t - started) / 1000.0,
        _ => 0.0,
    };
    let sample = Sample {
        outcome: done["event"].as_str().unwrap_or("?").to_string(),
        gap_ms: gap_end - gap_start,
        before_ops_per_s: rate(&r, (gap_start as u64).saturating_sub(p.settle.as_millis() as u64), gap_start as u64),
        after_ops_per_s: rate(&r, gap_end as u64, gap_end as u64 + p.settle.as_millis() as u64),
        app_recovery_ms: healthy - started - s.recovery_ms as f64,
        detect_to_start_ms: started - t_of(ev, "suspected"),
        healthy_to_outcome_ms: outcome_t - healthy,
        extra_instance_s: extra,
        monitor_ms: back_unix - suspected_unix,
        pre_fault_ms: fault_unix_ms - last_ack_unix,
        detect_ms: suspected_unix - fault_unix_ms,
        resume_ms: first_ack_unix - back_unix,
        breakdown,
        shard_work,
        table_rows: recovered_rows(m, ev).unwrap_or(f64::NAN),
        outcome_at,
        ops_per_window: r.ops_per_window.clone(),
        window_ms: r.window_ms,
    };
    eprintln!(
        "failover bench: {:<12} {:<42} {:<16} client outage {:>6.0} ms = last ack→fault {:>3.0} + fault→suspected {:>4.0} + monitor {:>6.0} + →first ack {:>4.0} (monitor: suspected→start {:>4.0}, start→healthy {:>5.0} = recovery {} + {:>4.0}, healthy→outcome {:>4.0}) {} commits",
        m.name,
        s.name,
        sample.outcome,
        sample.gap_ms,
        sample.pre_fault_ms,
        sample.detect_ms,
        sample.monitor_ms,
        sample.resume_ms,
        sample.detect_to_start_ms,
        healthy - started,
        s.recovery_ms,
        sample.app_recovery_ms,
        sample.healthy_to_outcome_ms,
        r.acked.len()
    );
    if let Some(b) = &sample.breakdown {
        eprintln!(
            "failover bench: {:<12} {:<42} start→healthy less recovery {:.0} ms ({} rows at open): {}",
            m.name,
            s.name,
            sample.app_recovery_ms,
            sample.table_rows,
            b.line()
        );
    }
    if let (Some(w), Some(tr)) = (&sample.shard_work, &trace) {
        for (phase, pw) in super::shardtrace::PHASES.iter().zip(w) {
            eprintln!("failover bench: {:<12} shards during {phase:<8} (±{:.0} ms): {}", m.name, tr.resolution_ms(), pw.line());
        }
    }
    Ok(sample)
}

/// Where the recovery of the instance this failure started went (the instance serves now).
fn recovery_breakdown(m: &Mon, ev: &[Value], delay_ms: f64) -> Option<super::breakdown::Breakdown> {
    let r = last_recovery(m, ev)?;
    super::breakdown::of(r.started_ms, r.healthy_ms, &r.timing, &r.log, delay_ms)
}

/// The last backup start this failure made: when it started and became healthy (unix ms), the
/// pool's timing of its start, and its log file.
struct LastRecovery {
    started_ms: f64,
    healthy_ms: f64,
    timing: ::failover::pool::StartTiming,
    log: PathBuf,
}

fn last_recovery(m: &Mon, ev: &[Value]) -> Option<LastRecovery> {
    let started = ev.iter().rev().find(|e| e["event"] == "backup_started")?;
    let healthy = ev.iter().rev().find(|e| e["event"] == "backup_healthy")?;
    let id = started["instance"].as_u64()?;
    let st: Value = serde_json::from_str(&m.control("status").ok()?).ok()?;
    let inst = st["instances"].as_array()?.iter().find(|i| i["id"].as_u64() == Some(id))?;
    Some(LastRecovery {
        started_ms: started["unix_ms"].as_f64()?,
        healthy_ms: healthy["unix_ms"].as_f64()?,
        timing: serde_json::from_value(inst["start"].clone()).ok()?,
        log: m.run_dir.join("state").join("logs").join(format!("i{id}.log")),
    })
}

/// Rows the SQLite front of the instance this failure started found at its open.
fn recovered_rows(m: &Mon, ev: &[Value]) -> Option<f64> {
    let id = ev.iter().rev().find(|e| e["event"] == "backup_started")?["instance"].as_u64()?;
    super::breakdown::sqlite_rows(&m.run_dir.join("state").join("logs").join(format!("i{id}.log")))
}

/// The phase bounds of the recovery this failure started ([`super::breakdown::phase_bounds`]).
fn recovery_bounds(m: &Mon, ev: &[Value], delay_ms: f64) -> Option<[f64; 5]> {
    let r = last_recovery(m, ev)?;
    super::breakdown::phase_bounds(r.started_ms, r.healthy_ms, &r.timing, &r.log, delay_ms)
}

/// Waits until the metadata service has no job left (garbage collection ended); returns how
/// long that took.
fn wait_gc_end(cluster_file: &Path) -> anyhow::Result<Duration> {
    let t0 = Instant::now();
    let rt = crate::runtime()?;
    rt.block_on(async {
        let cluster = testbed::cluster_file::Target::resolve(Some(&cluster_file), None, None)?.connect().await?;
        loop {
            match cluster.meta(volume::driver::meta::MetaReq::Jobs).await? {
                volume::driver::meta::MetaResp::Jobs(j) if j.is_empty() => return Ok(t0.elapsed()),
                volume::driver::meta::MetaResp::Jobs(_) => {}
                other => anyhow::bail!("unexpected answer to Jobs: {other:?}"),
            }
            anyhow::ensure!(t0.elapsed() < STEP_TIMEOUT, "garbage collection still running after {STEP_TIMEOUT:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
}

fn mean(v: impl IntoIterator<Item = f64>) -> f64 {
    let v: Vec<f64> = v.into_iter().filter(|x| x.is_finite()).collect();
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

const POLICIES: [&str; 3] = ["reds", "speculative", "oracle"];

fn median(v: &[f64]) -> f64 {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

pub fn run(a: ScenarioArgs, verbose: u8) -> anyhow::Result<bench::Report> {
    let p = Params::new(&a);
    let scen = scenarios(&p);
    let chosen = selected(&a.scenario)?;
    let out = bench::out_dir("failover", a.out.clone())?;
    let base = std::env::current_dir()?.join("target").join("bench-clusters");
    std::fs::create_dir_all(&base)?;
    let dir = tempfile::Builder::new().prefix("understudy-failover-").tempdir_in(&base)?;
    let rt = crate::runtime()?;
    // Shards serve their metrics, for the recovery rounds' counter trace.
    let mut lc = LocalCluster::start_full(&UpConfig { dir: dir.path().join("cluster"), shards: 4, replicas: 3, port_base: 0, verbose }, &[], true)?;
    rt.block_on(lc.wait_ready(READY_TIMEOUT, false))?;
    let cluster_file = lc.info.dir.join(testbed::cluster_file::CLUSTER_FILE);
    lc.info.save(&cluster_file)?;
    let t0 = Instant::now();
    let shard_metrics: Vec<String> = lc.info.shards.iter().filter_map(|s| s.metrics.clone()).collect();
    let r = measure(&a, &p, &scen, &chosen, &cluster_file, &shard_metrics, dir.path(), verbose);
    lc.stop();
    let m = r?;
    eprintln!("failover bench: measured in {:.1} s", t0.elapsed().as_secs_f64());
    report(&a, &p, &scen, &out, m)
}

/// §6.5 after garbage collection ended: rounds of windows on the never-failed instance (A) and
/// the promoted one (B), A B B A, so a drift of the machine's speed hits both alike.
struct Rounds {
    /// Per window: (A, B) in commits/s over the same interval.
    rounds: Vec<(f64, f64)>,
    /// The scenario whose promotion it follows.
    after: &'static str,
    /// The shards' work over the measured windows (both volumes).
    work: Option<super::shardtrace::PhaseWork>,
}

impl Rounds {
    fn ratios(&self) -> Vec<f64> {
        self.rounds.iter().map(|(a, b)| b / a).collect()
    }
}

struct Measured {
    /// [scenario][policy]; None for scenarios not run.
    samples: Vec<Vec<Option<Sample>>>,
    rss_bytes: u64,
    rounds: Option<Rounds>,
    /// (speculative's primary, never-failed) at the end, after the false positive.
    end_ops_per_s: Option<(f64, f64)>,
    gc_end_ms: f64,
    spurious: usize,
    /// The interleaved recovery rounds: per round (plain, super) samples.
    recovery: Vec<(Sample, Sample)>,
    /// Seconds the recovery rounds' warm-up took (0: none).
    warmup_s: f64,
    /// Per scenario: backups' start → healthy (general clone, super child) on clones of the
    /// same crashed volume of the twin (ms), for the composed speculative-on-the-general-clone
    /// figure.
    general_ms: Vec<Option<(f64, f64)>>,
}

/// §6.5 after garbage collection ended: the never-failed instance (A) and the promoted one
/// (B) under the same load at the same time — one closed-loop client each, both started and
/// warmed up (their first commits and one window discarded) before the first window — then
/// `rounds` consecutive windows, each giving both rates over the same wall-clock interval,
/// so a drift of the machine's speed (other work on it) hits both alike. With the shards'
/// metrics, their counters over the measured windows tell whether the promoted volume still
/// does copy-on-write work (first writes of a child) while measured.
/// Per window (never-failed, promoted) commits/s, and the shards' work over the windows.
type SideBySide = (Vec<(f64, f64)>, Option<super::shardtrace::PhaseWork>);

fn side_by_side(nf: &Mon, promoted: &Mon, windows: usize, window: Duration, shard_metrics: &[String]) -> anyhow::Result<SideBySide> {
    let (la, lb) = (Load::start(nf.endpoint), Load::start(promoted.endpoint));
    la.wait_acked(FLOWING_COMMITS, "never-failed throughput").map_err(|e| nf.context(e))?;
    lb.wait_acked(FLOWING_COMMITS, "promoted throughput").map_err(|e| promoted.context(e))?;
    std::thread::sleep(window);
    let before = super::shardtrace::scrape(shard_metrics);
    let mut out = vec![];
    for _ in 0..windows {
        let (a0, b0, t0) = (la.acked(), lb.acked(), Instant::now());
        std::thread::sleep(window);
        let (a1, b1, secs) = (la.acked(), lb.acked(), t0.elapsed().as_secs_f64());
        out.push(((a1 - a0) as f64 / secs, (b1 - b0) as f64 / secs));
    }
    let after = super::shardtrace::scrape(shard_metrics);
    la.finish(&format!("{} throughput windows", nf.name)).map_err(|e| nf.context(e))?;
    lb.finish(&format!("{} throughput windows", promoted.name)).map_err(|e| promoted.context(e))?;
    let work = before.zip(after).map(|(b, a)| super::shardtrace::work_between(&b, &a));
    Ok((out, work))
}

fn abba(mons: &[Mon], p: &Params, after: &'static str, shard_metrics: &[String]) -> anyhow::Result<Rounds> {
    let (nf, promoted) = (&mons[4], &mons[2]);
    let (rounds, work) = side_by_side(nf, promoted, p.rounds, p.window, shard_metrics)?;
    for (r, (a, b)) in rounds.iter().enumerate() {
        eprintln!("failover bench: §6.5 window {}: never-failed {a:.1} / promoted {b:.1} commits/s side by side: promoted/never-failed {:.3}", r + 1, b / a);
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    eprintln!("failover bench: §6.5 load {}", load.split_whitespace().take(3).collect::<Vec<_>>().join(" "));
    if let Some(w) = &work {
        eprintln!("failover bench: §6.5 shards while measured: {}", w.line());
    }
    Ok(Rounds { rounds, after, work })
}

#[allow(clippy::too_many_arguments)]
fn measure(
    a: &ScenarioArgs,
    p: &Params,
    scen: &[Scen],
    chosen: &[usize],
    cluster_file: &Path,
    shard_metrics: &[String],
    dir: &Path,
    verbose: u8,
) -> anyhow::Result<Measured> {
    // All monitors at once: they boot in parallel, then idle (pings only) between failures.
    // Speculative falls back to REDS with the medium timeout (after repeated aborts, §4.4).
    // The recovery rounds (§6.3 here) get a pair of their own, started with the others: the
    // same fresh table on both volumes and the same load from then on. (On the scenarios'
    // speculative and oracle monitors the tables differed — the §6.5 windows add thousands of
    // rows to the promoted one — and SQLite's open scans the table: a longer open that was
    // the table's, not the clone's.)
    let mut specs: Vec<(&'static str, &'static str, u64)> = vec![
        ("reds_medium", "reds", p.medium_ms),
        ("reds_short", "reds", p.short_ms),
        ("speculative", "speculative", p.medium_ms),
        ("oracle", "oracle", 600_000),
        ("never_failed", "speculative", 600_000),
    ];
    if p.recovery_rounds > 0 {
        specs.extend([("rec_plain", "oracle", 600_000), ("rec_super", "speculative", 600_000)]);
    }
    // Speculative's twin for the composed general-clone figure ([`GeneralTwin`]): last.
    specs.push(("general_twin", "oracle", 600_000));
    let mut mons = vec![];
    for (name, policy, timeout) in specs {
        mons.push(Mon::start(cluster_file, dir, name, policy, timeout, verbose)?);
    }
    for m in &mut mons {
        if let Err(e) = m.wait(&["primary_up"], STEP_TIMEOUT) {
            return Err(m.context(e));
        }
    }
    eprintln!(
        "failover bench: {} monitors up; scenarios {:?} (timeouts {} / {} ms, recovery {} / {} ms, transient {} ms)",
        mons.len(),
        chosen.iter().map(|&i| scen[i].label).collect::<Vec<_>>(),
        p.medium_ms,
        p.short_ms,
        p.long_rec_ms,
        p.short_rec_ms,
        p.transient_ms
    );
    let mut samples: Vec<Vec<Option<Sample>>> = scen.iter().map(|_| vec![None, None, None]).collect();
    let twin_i = mons.len() - 1;
    let mut twin = GeneralTwin::new(cluster_file, dir, &mons[twin_i])?;
    let mut general_ms: Vec<Option<(f64, f64)>> = scen.iter().map(|_| None).collect();
    let mut gc_ms = vec![];
    let mut rounds = None;
    // §6.5 follows scenario II's promotion, or the first one when II is not run.
    let rounds_after = if chosen.contains(&1) { Some(1) } else { None };
    for (k, &si) in chosen.iter().enumerate() {
        let s = &scen[si];
        // Alternate the policies' order from scenario to scenario.
        let order: Vec<usize> = if k % 2 == 0 { vec![0, 1, 2] } else { vec![2, 1, 0] };
        for pi in order {
            let mi = match pi {
                0 if si < 2 => 0,
                0 => 1,
                1 => 2,
                _ => 3,
            };
            if let (true, Some(same), true) = (a.quick, s.same_as, pi != 0) {
                if let Some(x) = samples[same][pi].clone() {
                    samples[si][pi] = Some(x);
                    if pi == 1 {
                        general_ms[si] = general_ms[same];
                    }
                    continue;
                }
            }
            let m = &mut mons[mi];
            let r = run_failure(m, s, p, None).map_err(|e| m.context(e))?;
            if pi == 1 && r.outcome == "promoted" {
                // §6.5: how long after the promotion garbage collection hands the parent's
                // objects over (no job left in the metadata service).
                wait_gc_end(cluster_file)?;
                gc_ms.push(r.outcome_at.elapsed().as_secs_f64() * 1000.0);
                if rounds.is_none() && rounds_after.is_none_or(|x| x == si) {
                    rounds = Some(abba(&mons, p, s.name, shard_metrics)?);
                }
            }
            samples[si][pi] = Some(r);
            if pi == 1 {
                // Right after speculative's failure: its twin's crash, recovered on a
                // general clone.
                let m = &mut mons[twin_i];
                general_ms[si] = Some(twin.measure(m, s, p, k % 2 == 0).map_err(|e| m.context(e))?);
            }
        }
    }
    drop(twin);
    // The same promoted primary once more at the end, after the false positive's cut and
    // abort (IV) hit it, beside the never-failed one — once no garbage collection is left.
    let mut end_ops_per_s = None;
    if chosen.contains(&3) && rounds.is_some() {
        let gc = wait_gc_end(cluster_file)?;
        eprintln!("failover bench: no job left {:.0} ms after the last scenario", gc.as_secs_f64() * 1000.0);
        let (w, _) = side_by_side(&mons[4], &mons[2], 2, p.window, shard_metrics)?;
        let end_nf = mean(w.iter().map(|x| x.0));
        let end_spec = mean(w.iter().map(|x| x.1));
        eprintln!("failover bench: at the end: promoted (after IV) {end_spec:.1} / never-failed {end_nf:.1} commits/s");
        end_ops_per_s = Some((end_spec, end_nf));
    }
    // §6.3 here: the same application and the same load, one crash of each volume kind per
    // round, ABBA, so the machine's drift hits both alike.
    let mut recovery = vec![];
    let mut warmup_s = 0.0;
    if p.recovery_rounds > 0 && p.recovery_warmup_commits > 0 {
        // Both fresh databases to their steady state, side by side: until SQLite's WAL is
        // full-size and reused, each commit grows it and its fsync commits an ext4 journal
        // transaction, so a crash leaves ~5 journal blocks per commit since the last mount for
        // the next mount to replay (measured: ~1000 shard reads and 0.6–1 s of ext4 mount per
        // round on fresh volumes, 60 ms once the WAL is reused).
        let t = Instant::now();
        let pair = &mons[5..7];
        let loads: Vec<Load> = pair.iter().map(|m| Load::start(m.endpoint)).collect();
        for (l, m) in loads.iter().zip(pair) {
            l.wait_acked(p.recovery_warmup_commits, "recovery rounds' warm-up").map_err(|e| m.context(e))?;
        }
        for (l, m) in loads.into_iter().zip(pair) {
            l.finish(&format!("{} warm-up", m.name)).map_err(|e| m.context(e))?;
        }
        // The warm-up's own journal transactions are still in the journal (jbd2 moves its
        // tail lazily): the first round would replay them. A freeze checkpoints the journal
        // (FIFREEZE → jbd2_journal_flush), as a round's replay would have; both alike.
        for m in pair {
            let st: Value = serde_json::from_str(&m.control("status")?)?;
            let id = st["state"]["primary"].as_u64().with_context(|| format!("{}: no primary in {st}", m.name))?;
            let dir = m.run_dir.join("state").join("mnt").join(format!("i{id}"));
            // Both bounded, and the thaw tried even when the freeze failed: a file system left
            // frozen would hang its application for good.
            let dir_arg = dir.to_string_lossy();
            let frozen = ::failover::pool::teardown::run_bounded("fsfreeze", &["--freeze", &dir_arg], ::failover::pool::teardown::COMMAND_TIMEOUT);
            let thawed = ::failover::pool::teardown::run_bounded("fsfreeze", &["--unfreeze", &dir_arg], ::failover::pool::teardown::COMMAND_TIMEOUT);
            frozen.and(thawed).map_err(|e| anyhow::anyhow!("checkpointing the journal of {}: {e}", dir.display()))?;
        }
        warmup_s = t.elapsed().as_secs_f64();
        eprintln!("failover bench: recovery rounds' warm-up: {} commits on each of rec_plain and rec_super in {warmup_s:.1} s", p.recovery_warmup_commits);
    }
    if p.recovery_rounds > 0 {
        let crash = Scen { name: "recovery_round", label: "recovery round", recovery_ms: 0, transient_ms: None, same_as: None };
        let mut pending: [Vec<Sample>; 2] = [vec![], vec![]];
        for (k, v) in bench::interleaved_order(p.recovery_rounds, 2).into_iter().enumerate() {
            let m = &mut mons[if v == 0 { 5 } else { 6 }];
            let r = run_failure(m, &crash, p, Some(shard_metrics)).map_err(|e| m.context(e))?;
            if v == 1 && r.outcome == "promoted" {
                wait_gc_end(cluster_file)?;
            }
            pending[v].push(r);
            if k % 2 == 1 {
                let (plain, sup) = (pending[0].pop().expect("one each"), pending[1].pop().expect("one each"));
                let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
                eprintln!(
                    "failover bench: recovery round {}: plain {:.0} ms ({} rows) / super {:.0} ms ({} rows): super/plain {:.3} (load {})",
                    recovery.len() + 1,
                    plain.app_recovery_ms,
                    plain.table_rows,
                    sup.app_recovery_ms,
                    sup.table_rows,
                    sup.app_recovery_ms / plain.app_recovery_ms,
                    load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
                );
                recovery.push((plain, sup));
            }
        }
    }
    let spurious = mons.iter().map(|m| m.spurious).sum::<usize>() + mons.iter_mut().map(|m| std::iter::from_fn(|| m.rx.try_recv().ok()).filter(|e| e["event"] == "suspected").count()).sum::<usize>();
    let rss_bytes = mons.iter().map(|m| peak_rss_bytes(m.guard.pid()).unwrap_or(0)).max().unwrap_or(0);
    // Stop them all (instances stopped cleanly, volumes detached) before the cluster goes.
    drop(mons);
    Ok(Measured { samples, rss_bytes, rounds, end_ops_per_s, spurious, gc_end_ms: mean(gc_ms), recovery, warmup_s, general_ms })
}

/// A figure that may be missing (an event the monitor did not report): left out with a note
/// rather than failing the whole report.
fn figure_if(report: &mut bench::Report, name: &str, v: f64) -> anyhow::Result<()> {
    if v.is_finite() {
        report.figure(name, v)?;
    } else {
        eprintln!("failover bench: {name} not measured (an event is missing)");
    }
    Ok(())
}

fn report(a: &ScenarioArgs, p: &Params, scen: &[Scen], out: &Path, m: Measured) -> anyhow::Result<bench::Report> {
    let mut report = bench::Report::new("failover.scenarios", a.quick);
    for (k, v) in [("medium_timeout_ms", p.medium_ms), ("short_timeout_ms", p.short_ms), ("transient_ms", p.transient_ms), ("long_recovery_ms", p.long_rec_ms), ("short_recovery_ms", p.short_rec_ms)] {
        report.figure(&format!("params.{k}"), v as f64)?;
    }
    report.figure("params.throughput_window_ms", p.window.as_millis() as f64)?;
    // Scenarios measured (under every policy).
    let run: Vec<usize> = (0..scen.len()).filter(|&si| m.samples[si].iter().all(Option::is_some)).collect();
    let get = |si: usize, pi: usize| m.samples[si][pi].as_ref().expect("measured");
    let mut bars: Vec<bench::BarSeries> = POLICIES.iter().map(|p| bench::BarSeries { name: p.to_string(), values: vec![] }).collect();
    let mut worst = 0.0f64;
    for &si in &run {
        let s = &scen[si];
        for (pi, pol) in POLICIES.iter().enumerate() {
            let x = get(si, pi);
            // The client's outage (Figure 6), and where it went: the monitor's own timeline
            // and what lies around it.
            report.figure(&format!("{}.{pol}.failover_latency_ms", s.name), x.gap_ms)?;
            figure_if(&mut report, &format!("{}.{pol}.monitor_failover_ms", s.name), x.monitor_ms)?;
            figure_if(&mut report, &format!("{}.{pol}.client_minus_monitor_ms", s.name), x.gap_ms - x.monitor_ms)?;
            figure_if(&mut report, &format!("{}.{pol}.fault_to_suspected_ms", s.name), x.detect_ms)?;
            figure_if(&mut report, &format!("{}.{pol}.outcome_to_first_ack_ms", s.name), x.resume_ms)?;
            figure_if(&mut report, &format!("{}.{pol}.last_ack_to_fault_ms", s.name), x.pre_fault_ms)?;
            bars[pi].values.push(x.gap_ms / 1000.0);
        }
        let [reds, spec, oracle] = [0, 1, 2].map(|pi| get(si, pi).gap_ms);
        report.figure(&format!("{}.speculative.extra_instance_s", s.name), get(si, 1).extra_instance_s)?;
        worst = worst.max(report.ratio(&format!("{}.speculative_vs_oracle.failover_latency", s.name), spec, oracle)?);
        report.ratio(&format!("{}.reds_vs_speculative.failover_latency", s.name), reds, spec)?;
    }
    if !run.is_empty() {
        report.ratio("speculative_vs_oracle.failover_latency.worst", worst, 1.0)?;
    }
    // Speculative on the general clone: composed (see [`GeneralTwin`]), never a live failover.
    let spec_h2o = mean(run.iter().filter(|&&si| get(si, 1).outcome == "promoted").map(|&si| get(si, 1).healthy_to_outcome_ms));
    let general: Vec<(usize, (f64, f64), f64)> =
        run.iter().filter_map(|&si| m.general_ms[si].map(|g| (si, g, composed_general_ms(get(si, 1), g, spec_h2o)))).collect();
    let mut general_bars = bench::BarSeries { name: "speculative on general clone (composed)".into(), values: vec![] };
    for &(si, (g, sup), composed) in &general {
        let s = &scen[si];
        figure_if(&mut report, &format!("{}.speculative.backup_start_to_healthy_ms", s.name), get(si, 1).app_recovery_ms + s.recovery_ms as f64)?;
        report.figure(&format!("{}.general_twin.general.backup_start_to_healthy_ms", s.name), g)?;
        report.figure(&format!("{}.general_twin.super.backup_start_to_healthy_ms", s.name), sup)?;
        report.ratio(&format!("{}.general_twin.general_vs_super.backup_start_to_healthy", s.name), g, sup)?;
        figure_if(&mut report, &format!("{}.speculative_general_composed.failover_latency_ms", s.name), composed)?;
        if composed.is_finite() {
            report.ratio(&format!("speculative_general_vs_speculative.failover_latency.{}", s.name), composed, get(si, 1).gap_ms)?;
        }
        general_bars.values.push(composed / 1000.0);
    }
    if general.len() == run.len() && !run.is_empty() {
        bars.push(general_bars);
    }
    // REDS with a 60 s timeout against speculative, short recovery (II): live when the medium
    // timeout is 60 s; with other timeouts, REDS's measured restart cost after its timeout
    // plus 60 s.
    if run.contains(&1) {
        let (reds_ii, spec_ii) = (get(1, 0).gap_ms, get(1, 1).gap_ms);
        report.ratio("reds_60s_vs_speculative.failover_latency", 60_000.0 + (reds_ii - p.medium_ms as f64), spec_ii)?;
    }
    // Where the time goes, per policy, over the failures that were crashes.
    let kills: Vec<usize> = run.iter().copied().filter(|&si| scen[si].transient_ms.is_none()).collect();
    if !kills.is_empty() {
        for (pi, pol) in POLICIES.iter().enumerate() {
            let avg = |f: fn(&Sample) -> f64| mean(kills.iter().map(|&si| f(get(si, pi))));
            report.figure(&format!("{pol}.crash.detect_to_backup_start_ms_mean"), avg(|s| s.detect_to_start_ms))?;
            report.figure(&format!("{pol}.crash.app_recovery_latency_ms_mean"), avg(|s| s.app_recovery_ms))?;
            // Where it went, part by part (the breakdown of every crash that has one).
            let parts: Vec<[f64; 10]> = kills.iter().filter_map(|&si| get(si, pi).breakdown.as_ref().map(|b| b.values())).collect();
            if !parts.is_empty() {
                for (k, name) in super::breakdown::PARTS.iter().enumerate() {
                    report.figure(&format!("{pol}.crash.recovery.{name}_ms_mean"), mean(parts.iter().map(|p| p[k])))?;
                }
            }
            report.figure(&format!("{pol}.crash.healthy_to_outcome_ms_mean"), avg(|s| s.healthy_to_outcome_ms))?;
            figure_if(&mut report, &format!("{pol}.crash.client_minus_monitor_ms_mean"), avg(|s| s.gap_ms - s.monitor_ms))?;
            report.figure(&format!("{pol}.crash.before.throughput_ops_per_s_mean"), avg(|s| s.before_ops_per_s))?;
            report.figure(&format!("{pol}.crash.right_after.throughput_ops_per_s_mean"), avg(|s| s.after_ops_per_s))?;
        }
        // Application recovery on the super child (speculative) against the plain volume
        // (oracle), both from a SIGKILL, less the scenario's recovery time.
        let rec = |pi: usize| mean(kills.iter().map(|&si| get(si, pi).app_recovery_ms));
        if m.recovery.is_empty() {
            report.ratio("super_vs_plain.app_recovery_latency", rec(1), rec(2))?;
        } else {
            report.ratio("scenarios.super_vs_plain.app_recovery_latency.of_means", rec(1), rec(2))?;
        }
    }
    if !m.recovery.is_empty() {
        // The interleaved rounds: the median of the rounds' ratios is the headline.
        let ratios: Vec<f64> = m.recovery.iter().map(|(a, b)| b.app_recovery_ms / a.app_recovery_ms).collect();
        for (i, ((a, b), r)) in m.recovery.iter().zip(&ratios).enumerate() {
            report.figure(&format!("recovery_rounds.round_{}.plain.app_recovery_latency_ms", i + 1), a.app_recovery_ms)?;
            report.figure(&format!("recovery_rounds.round_{}.super.app_recovery_latency_ms", i + 1), b.app_recovery_ms)?;
            report.ratio(&format!("recovery_rounds.round_{}.super_vs_plain.app_recovery_latency", i + 1), *r, 1.0)?;
        }
        report.figure("recovery_rounds.rounds_count", ratios.len() as f64)?;
        report.figure("recovery_rounds.warmup_commits_count", p.recovery_warmup_commits as f64)?;
        report.figure("recovery_rounds.warmup_s", m.warmup_s)?;
        let rows = |pick: usize| median(&m.recovery.iter().map(|x| if pick == 0 { x.0.table_rows } else { x.1.table_rows }).collect::<Vec<_>>());
        report.figure("recovery_rounds.plain.table_rows_count_p50", rows(0))?;
        report.figure("recovery_rounds.super.table_rows_count_p50", rows(1))?;
        let plain: Vec<f64> = m.recovery.iter().map(|x| x.0.app_recovery_ms).collect();
        let sup: Vec<f64> = m.recovery.iter().map(|x| x.1.app_recovery_ms).collect();
        report.figure("recovery_rounds.plain.app_recovery_latency_ms_p50", median(&plain))?;
        report.figure("recovery_rounds.super.app_recovery_latency_ms_p50", median(&sup))?;
        report.ratio("recovery_rounds.super_vs_plain.app_recovery_latency.of_medians", median(&sup), median(&plain))?;
        report.ratio("super_vs_plain.app_recovery_latency", median(&ratios), 1.0)?;
        // Where the time went, per part: medians over the rounds.
        for (kind, pick) in [("plain", 0usize), ("super", 1)] {
            let parts: Vec<[f64; 10]> =
                m.recovery.iter().filter_map(|x| if pick == 0 { &x.0 } else { &x.1 }.breakdown.as_ref().map(|b| b.values())).collect();
            for (k, name) in super::breakdown::PARTS.iter().enumerate() {
                let v: Vec<f64> = parts.iter().map(|p| p[k]).collect();
                if !v.is_empty() {
                    report.figure(&format!("recovery_rounds.{kind}.{name}_ms_p50"), median(&v))?;
                }
            }
            // What the shards did (every replica's work), per phase and over the whole
            // recovery: medians over the rounds.
            let works: Vec<&Vec<super::shardtrace::PhaseWork>> =
                m.recovery.iter().filter_map(|x| if pick == 0 { &x.0 } else { &x.1 }.shard_work.as_ref()).collect();
            if !works.is_empty() {
                report.figure(&format!("recovery_rounds.{kind}.shards.traced_count"), works.len() as f64)?;
                let field_names = super::shardtrace::PhaseWork::default().fields().map(|(n, _)| n);
                for (fi, fname) in field_names.iter().enumerate() {
                    let whole: Vec<f64> = works.iter().map(|w| w.iter().map(|pw| pw.fields()[fi].1).sum()).collect();
                    report.figure(&format!("recovery_rounds.{kind}.shards.recovery.{fname}_p50"), median(&whole))?;
                    for (ph, phase) in super::shardtrace::PHASES.iter().enumerate() {
                        let v: Vec<f64> = works.iter().filter_map(|w| w.get(ph)).map(|pw| pw.fields()[fi].1).collect();
                        report.figure(&format!("recovery_rounds.{kind}.shards.{phase}.{fname}_p50"), median(&v))?;
                    }
                }
            }
        }
    }
    if !run.is_empty() {
        report.figure("speculative.extra_instance_time_per_failure_s_mean", mean(run.iter().map(|&si| get(si, 1).extra_instance_s)))?;
    }
    // §6.5.
    report.figure("speculative.gc_end_after_promotion_ms_mean", m.gc_end_ms)?;
    if let Some(r) = &m.rounds {
        let ratios = r.ratios();
        for (i, ((a_ops, b_ops), ratio)) in r.rounds.iter().zip(&ratios).enumerate() {
            report.figure(&format!("after_promotion.round_{}.never_failed.throughput_ops_per_s", i + 1), *a_ops)?;
            report.figure(&format!("after_promotion.round_{}.promoted.throughput_ops_per_s", i + 1), *b_ops)?;
            report.ratio(&format!("after_promotion.round_{}.promoted_vs_never_failed.throughput", i + 1), *ratio, 1.0)?;
        }
        report.figure("never_failed.throughput_ops_per_s_mean", mean(r.rounds.iter().map(|x| x.0)))?;
        report.figure("speculative.after_gc.throughput_ops_per_s_mean", mean(r.rounds.iter().map(|x| x.1)))?;
        report.figure("after_promotion.rounds_count", ratios.len() as f64)?;
        if let Some(w) = &r.work {
            for (name, v) in w.fields() {
                report.figure(&format!("after_promotion.shards.{name}"), v)?;
            }
        }
        // The name, and the one the earlier runs used.
        let med = median(&ratios);
        report.ratio("after_promotion_vs_never_failed", med, 1.0)?;
        report.ratio("speculative.after_promotion_vs_never_failed.throughput", med, 1.0)?;
        eprintln!("failover bench: §6.5 after {}'s promotion, GC over: promoted/never-failed median {med:.3} over rounds {ratios:.3?}", r.after);
        if !kills.is_empty() {
            let right_after = mean(kills.iter().map(|&si| get(si, 1).after_ops_per_s));
            report.ratio("speculative.right_after_promotion_vs_never_failed.throughput", right_after, mean(r.rounds.iter().map(|x| x.0)))?;
        }
    }
    if let Some((end_spec, end_nf)) = m.end_ops_per_s {
        report.figure("speculative.end_after_false_positive.throughput_ops_per_s", end_spec)?;
        report.figure("never_failed.end.throughput_ops_per_s", end_nf)?;
        report.ratio("speculative.end_after_false_positive_vs_never_failed.throughput", end_spec, end_nf)?;
    }
    report.figure("monitor.rss_peak_bytes", m.rss_bytes as f64)?;
    report.figure("monitors.spurious_suspicions_count", m.spurious as f64)?;
    report.figure("monitor.rss_peak_mib", m.rss_bytes as f64 / 1048576.0)?;

    let labels: Vec<&str> = run.iter().map(|&si| scen[si].label).collect();
    let _ = bench::bar_plot(&out.join("figure6"), "End-to-end failover latency, live (general clone: composed) (SpecREDS Figure 6)", "scenario (timeout, recovery)", "seconds", &labels, &bars);
    // The client's throughput around the crash, per policy: scenario II (or the first run).
    if let Some(&tsi) = run.iter().find(|&&si| si == 1).or(run.first()) {
        let series: Vec<bench::Series> = POLICIES
            .iter()
            .enumerate()
            .map(|(pi, name)| {
                let r = get(tsi, pi);
                let per_s = 1000.0 / r.window_ms.max(1) as f64;
                bench::Series {
                    name: name.to_string(),
                    points: r.ops_per_window.iter().enumerate().map(|(i, n)| ((i as u64 * r.window_ms) as f64 / 1000.0, *n as f64 * per_s)).collect(),
                }
            })
            .collect();
        let title = format!("SQLite front: commits through the endpoint ({})", scen[tsi].label);
        let _ = bench::line_plot(&out.join("throughput"), &title, "time (s)", "commits/s", &series, bench::Scale::Linear);
        let rows = series.iter().flat_map(|s| s.points.iter().map(move |(x, y)| vec![s.name.clone(), format!("{x:.1}"), format!("{y:.0}")]));
        bench::write_csv(&out.join("throughput.csv"), &["policy", "time_s", "commits_per_s"], rows)?;
    }
    let rows = run.iter().flat_map(|&si| {
        POLICIES.iter().enumerate().map(move |(pi, pol)| {
            let x = get(si, pi);
            vec![
                scen[si].name.to_string(),
                pol.to_string(),
                x.outcome.clone(),
                format!("{:.0}", x.gap_ms),
                format!("{:.0}", x.monitor_ms),
                format!("{:.0}", x.pre_fault_ms),
                format!("{:.0}", x.detect_ms),
                format!("{:.0}", x.resume_ms),
                format!("{:.0}", x.detect_to_start_ms),
                format!("{:.0}", x.app_recovery_ms),
                format!("{:.0}", x.healthy_to_outcome_ms),
            ]
        })
    });
    let rows = rows.chain(general.iter().map(|&(si, (g, _), composed)| {
        let x = get(si, 1);
        vec![
            scen[si].name.to_string(),
            "speculative_general_composed".to_string(),
            "composed".to_string(),
            format!("{composed:.0}"),
            String::new(),
            format!("{:.0}", x.pre_fault_ms),
            format!("{:.0}", x.detect_ms),
            format!("{:.0}", x.resume_ms),
            format!("{:.0}", x.detect_to_start_ms),
            format!("{:.0}", g - scen[si].recovery_ms as f64),
            String::new(),
        ]
    }));
    bench::write_csv(
        &out.join("figure6.csv"),
        &[
            "scenario",
            "policy",
            "outcome",
            "failover_latency_ms",
            "monitor_failover_ms",
            "last_ack_to_fault_ms",
            "fault_to_suspected_ms",
            "outcome_to_first_ack_ms",
            "detect_to_start_ms",
            "app_recovery_ms",
            "healthy_to_outcome_ms",
        ],
        rows,
    )?;
    eprintln!("plots and samples in {}", out.display());
    Ok(report)
}

/// Speculative on the general clone (Figure 6's SpecREDS (rbd-clone)), **composed**, as the
/// paper itself composed Figure 6 from §6.3's recovery latencies: the monitor speculates on
/// `super` only (a general clone has no collapse, so no safe promotion while the primary may
/// still write the parent its clone reads through to). Per scenario, a twin of speculative's
/// primary (the same application, the same load, the same scenario's recovery time, its own
/// oracle monitor told to wait) is crashed the same way; a backup is then started on a
/// general clone of that crashed volume by this process's own instance pool and timed from
/// its start (attach included) to its first good health check — as the monitor times a
/// backup. The composed outage is speculative's live one with its backup's start → healthy
/// replaced by that (see [`composed_general_ms`]). The clone's instance is then killed, the
/// clone deleted, and the twin's monitor restarts its primary on the volume (REDS).
struct GeneralTwin {
    rt: tokio::runtime::Runtime,
    pool: Arc<::failover::pool::LocalPool>,
    volumes: ::failover::driver::Volumes,
    health: ::failover::spec::HealthSpec,
    next_id: u64,
}

impl GeneralTwin {
    fn new(cluster_file: &Path, dir: &Path, twin: &Mon) -> anyhow::Result<GeneralTwin> {
        let rt = crate::runtime()?;
        let exe = std::env::current_exe()?;
        let command: Vec<String> = [
            exe.to_string_lossy().as_ref(),
            "failover",
            "sqlite-front",
            "--db",
            "{mount}/app.db",
            "--port",
            "{port}",
            "--startup-delay-file",
            twin.delay_file.to_string_lossy().as_ref(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let (pool, volumes) = rt.block_on(async {
            let cluster = testbed::cluster_file::Target::resolve(Some(&cluster_file), None, None)?.connect().await?;
            let (tx, mut rx) = tokio::sync::mpsc::channel::<::failover::Input>(64);
            // Its instances exit because this bench kills them: nothing to act on.
            tokio::spawn(async move { while rx.recv().await.is_some() {} });
            let pool = ::failover::pool::LocalPool::new(
                ::failover::pool::LocalPoolConfig {
                    exe: exe.clone(),
                    conn_args: vec!["--cluster".into(), cluster_file.to_string_lossy().into_owned()],
                    state_dir: dir.join("general-twin"),
                    app: ::failover::spec::AppSpec { command, env: Default::default(), stop_grace_ms: 10_000 },
                    mkfs_first: false,
                    attach_timeout: STEP_TIMEOUT,
                    netns: false,
                },
                tx,
            )?;
            anyhow::Ok((Arc::new(pool), ::failover::driver::Volumes { cluster }))
        })?;
        let health = ::failover::spec::HealthSpec { send: Some("PING".into()), expect: Some("PONG".into()), command: None, postgres: None, mysql: None, timeout_ms: HEALTH_TIMEOUT_MS };
        Ok(GeneralTwin { rt, pool, volumes, health, next_id: 100 })
    }

    /// One crash of the twin's primary under load; then a backup on a general clone of the
    /// crashed volume and one on a super child of it (aborted afterwards: the parent is
    /// kept), one after the other from the same crashed state, in the order `general_first`
    /// says. Returns their start → healthy (general, super) in ms.
    fn measure(&mut self, twin: &mut Mon, s: &Scen, p: &Params, general_first: bool) -> anyhow::Result<(f64, f64)> {
        std::fs::write(&twin.delay_file, s.recovery_ms.to_string())?;
        let load = Load::start(twin.endpoint);
        load.wait_acked(FLOWING_COMMITS, "twin before the crash")?;
        std::thread::sleep(p.settle);
        while let Ok(e) = twin.rx.try_recv() {
            twin.seen.push(e);
        }
        // The twin's monitor waits (its primary "comes back" long after any recovery): the
        // crashed volume stays as the crash left it while its clones recover.
        twin.control("hint 600000 1000000000")?;
        twin.control("kill")?;
        let st: Value = serde_json::from_str(&twin.control("status")?)?;
        let parent = st["state"]["volume"].as_str().context("twin: no volume in its status")?.to_string();
        let mut r = (f64::NAN, f64::NAN);
        let mut err = None;
        for general in if general_first { [true, false] } else { [false, true] } {
            match self.recover_on_clone(&parent, general) {
                Ok(ms) if general => r.0 = ms,
                Ok(ms) => r.1 = ms,
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        // The twin's monitor restarts its primary on the volume (REDS), once it noticed.
        twin.wait(&["suspected"], STEP_TIMEOUT)?;
        twin.control("hint never 0")?;
        twin.wait(&["reds_restarted"], STEP_TIMEOUT)?;
        let n = load.acked();
        load.wait_acked(n + FLOWING_COMMITS, "twin after its restart")?;
        load.finish(&format!("{} {}", twin.name, s.name))?;
        if let Some(e) = err {
            return Err(e);
        }
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        eprintln!(
            "failover bench: {:<12} {:<42} backups on clones of the same crashed volume, start→healthy: general {:.0} ms, super {:.0} ms (recovery {} ms each; {} first; load {})",
            twin.name,
            s.name,
            r.0,
            r.1,
            s.recovery_ms,
            if general_first { "general" } else { "super" },
            load.split_whitespace().next().unwrap_or("?")
        );
        Ok(r)
    }

    /// A backup on a general clone (or a super child) of `parent`, timed from its start to
    /// its first good health check; then killed and its clone deleted (the child aborted).
    fn recover_on_clone(&mut self, parent: &str, general: bool) -> anyhow::Result<f64> {
        self.next_id += 1;
        let kind = if general { "general" } else { "super" };
        let (id, child) = (::failover::InstanceId(self.next_id), format!("{parent}.{kind}-{}", self.next_id));
        let (pool, volumes, health) = (self.pool.clone(), &self.volumes, &self.health);
        self.rt.block_on(async {
            if general {
                match volumes.cluster.meta(volume::driver::meta::MetaReq::CloneGeneral { parent: parent.into(), child: child.clone() }).await {
                    Ok(volume::driver::meta::MetaResp::Volume(_)) => {}
                    Ok(other) => anyhow::bail!("general clone of {parent}: unexpected answer {other:?}"),
                    Err(e) => anyhow::bail!("general clone of {parent}: {e:#}"),
                }
            } else {
                match volumes.super_(parent, &child).await {
                    ::failover::Input::SuperDone { .. } => {}
                    other => anyhow::bail!("super of {parent}: {other:?}"),
                }
            }
            let t0 = Instant::now();
            let r = async {
                let addr = pool.start(id, &child).await.with_context(|| format!("starting an instance on {child}"))?;
                loop {
                    if ::failover::health::health_check(health, addr, id).await {
                        return anyhow::Ok(t0.elapsed().as_secs_f64() * 1000.0);
                    }
                    anyhow::ensure!(pool.pids(id).is_some_and(|(app, _)| ::failover::pool::pid_alive(app)), "the instance on {child} exited before it was healthy");
                    anyhow::ensure!(t0.elapsed() < STEP_TIMEOUT, "the instance on {child} not healthy within {STEP_TIMEOUT:?}");
                    // The monitor pings a starting backup this often.
                    tokio::time::sleep(Duration::from_millis(25)).await;
                }
            }
            .await;
            // Whatever happened: the instance gone and its volume detached before the clone goes.
            let killed = pool.kill(id).await;
            let gone = if general {
                volumes.cluster.meta(volume::driver::meta::MetaReq::Delete { name: child.clone() }).await.map(|_| ())
            } else {
                match volumes.drop_child(parent, &child).await {
                    ::failover::Input::ChildDropped { .. } => Ok(()),
                    other => Err(anyhow::anyhow!("{other:?}")),
                }
            };
            let ms = r?;
            killed.with_context(|| format!("stopping the instance on {child}"))?;
            gone.with_context(|| format!("deleting {child}"))?;
            anyhow::Ok(ms)
        })
    }
}

impl Drop for GeneralTwin {
    fn drop(&mut self) {
        let pool = self.pool.clone();
        self.rt.block_on(async move {
            for id in pool.instances() {
                let _ = pool.kill(id).await;
            }
        });
    }
}

/// Speculative on the general clone, composed from speculative's live failure `x` and the
/// twin's backups on clones of one crashed volume (`twin`: start → healthy on the general
/// clone and on the super child, the scenario's recovery time included in both): the same
/// detection, the same start of the backup, the same steps after it is healthy (speculative's
/// collapse, re-point and fence stand in for the general clone's fence and re-point) and the
/// same wait for the client's next commit; only the backup's recovery differs, by what the
/// general clone took more than the super child from the same crashed state. For a false
/// positive that speculative aborted (no recovery of its own to adjust), the general clone's
/// backup would have been promoted only had it been healthy (the twin's start → healthy) before
/// the primary answered again (`healthy_to_outcome_ms`: speculative's, from its crashes).
fn composed_general_ms(x: &Sample, twin: (f64, f64), healthy_to_outcome_ms: f64) -> f64 {
    let (general, sup) = twin;
    if x.outcome == "promoted" {
        return x.gap_ms + (general - sup);
    }
    // From the fault: when the general clone's backup would have been healthy, and when the
    // primary answered again.
    let healthy = x.detect_ms + x.detect_to_start_ms + general;
    let back = x.detect_ms + x.monitor_ms;
    if healthy < back {
        x.pre_fault_ms + healthy + healthy_to_outcome_ms + x.resume_ms
    } else {
        x.gap_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(outcome: &str, gap_ms: f64, app_recovery_ms: f64) -> Sample {
        Sample {
            outcome: outcome.into(),
            gap_ms,
            before_ops_per_s: 0.0,
            after_ops_per_s: 0.0,
            app_recovery_ms,
            detect_to_start_ms: 50.0,
            healthy_to_outcome_ms: 30.0,
            extra_instance_s: 0.0,
            monitor_ms: gap_ms - 300.0,
            pre_fault_ms: 10.0,
            detect_ms: 200.0,
            resume_ms: 90.0,
            breakdown: None,
            shard_work: None,
            table_rows: 0.0,
            outcome_at: Instant::now(),
            ops_per_window: vec![],
            window_ms: 100,
        }
    }

    #[test]
    fn the_composed_general_clone_outage_replaces_only_the_backups_recovery() {
        // Promoted: 5000 ms outage; from the twin's crashed volume the general clone's backup
        // took 700 ms more than the super child's.
        let x = sample("promoted", 5_000.0, 400.0);
        assert_eq!(composed_general_ms(&x, (3_100.0, 2_400.0), 30.0), 5_700.0);
        // A false positive speculative aborted: the primary answered 200 + 14_700 ms after
        // the fault. A backup healthy later than that changes nothing; one healthy sooner is
        // promoted (speculative's healthy → outcome, then the client's wait).
        let fp = sample("aborted", 15_000.0, f64::NAN);
        assert_eq!(composed_general_ms(&fp, (31_000.0, 30_900.0), 30.0), 15_000.0);
        assert_eq!(composed_general_ms(&fp, (1_500.0, 1_400.0), 30.0), 10.0 + 200.0 + 50.0 + 1_500.0 + 30.0 + 90.0);
    }
}
