//! `understudy bench kv ttr`: CANDStore's time to repair (§7.5, §7.7, Figures 9 and 10) on
//! this machine. A primary, a backup and a witness run as real processes on loopback (`kv up
//! --protocol witness`); the shard is loaded through the witness client; 8 closed-loop clients
//! run YCSB-C and YCSB-B (θ = 0.99, 1 KiB values) with one latency histogram per 100 ms window;
//! after the warm-up the primary is killed with SIGKILL and the witness takes over. TTR, as the
//! paper defines it, runs from the kill to the end of the first window in SLO after which every
//! window stays in SLO ([`bench::time_to_recovery`]); the SLOs are multiples of the same run's
//! steady-state p99.9 and p50 (the median of the windows before the kill).
//!
//! Schemes are rows of [`SCHEMES`]: a name and the extra `kv up` arguments that select it, so a
//! scheme is nothing but how its group is started. The runs interleave (round 1: cand, offline,
//! …; round 2: cand, offline, …) so drift on the shared machine hits every scheme alike. A
//! scheme whose arguments `kv up` refuses, or that `kv up` accepts but does not hand to its
//! nodes, is never run as something else: asked for by name it is an error; in the default set
//! it is reported absent, with the reason, and so is every ratio that needs it.
//!
//! What is measured and how:
//! - the election and the end of live recovery are the new leader's own log lines (`term T
//!   Leader`, `recovered: …`), watched from the kill on (5 ms polling, far below a 100 ms window);
//!   the full-copy time is kill → `recovered` (the missing set empty, M19);
//! - `cand_vs_steady.throughput_after_election`: mean throughput of the windows in the first 2 s
//!   after the election over the steady windows before the kill;
//! - the paper-style offline bound (§7.7): the shard's logical bytes ÷ this run's best sequential
//!   `O_DIRECT` read ([`super::ssd::best_sequential_read_mib_per_s`], measured before any group
//!   starts so nothing else is on the disk);
//! - cost per GB: after the cells, an N = 2 cand group (primary, 2 backups, 2 witnesses) is
//!   loaded with the headline shard and left to write back; every node then answers a status
//!   request (`kv status`) with its tier bytes, and [`super::cost`] prices them (`cost.n2.*`).
//!   Only if that group cannot be measured are the ratios the spec's estimate, and the report
//!   says so under `absent` (`cost.live_tier_bytes`);
//! - node RSS against accounted bytes: every node's status just before the kill (`loaded`) and
//!   after the new primary's recovery (`recovered`): private RSS (statm resident − shared: the
//!   NVMM rings are shared memory) over its DRAM and NVMM-table bytes,
//!   `<cell>.<scheme>.node<i>.<phase>.rss_vs_tier.bytes`; `node_rss_vs_tier.bytes` is the worst
//!   node of cand's headline runs.
//!
//! The exact ratio names of issue 25 (`offline_vs_cand.ttr_p999`, …) take the least favourable
//! workload of the run's headline cells (YCSB-C and YCSB-B at θ = 0.99 and `--value-bytes`), so
//! a target met by the name is met by both workloads; each cell's own ratio is reported beside
//! it under the cell's prefix.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

use ::kv::witness::driver::{WitnessClient, WitnessError};
use ::kv::witness::proto::StatusReport;
use bench::{Percentile, Series, WindowStats};
use testbed::kv::UpArgs;
use testbed::kv_witness::LocalWitnessKv;
use ycsb::{KvTarget, RunConfig, Runner, TargetError, WorkloadSpec};

use super::cost::{self, LayoutEstimate, PAPER_PRICES};
use super::ycsb::{bench_dir, up_args};

// ------------------------------------------------------------------------------ schemes

/// One recovery scheme: how its group is started.
#[derive(Clone, Copy, Debug)]
pub struct Scheme {
    pub name: &'static str,
    /// Appended to `kv up --protocol witness`; every node must receive them.
    pub up_args: &'static [&'static str],
}

/// Every scheme of issue 25 item 5. `cand` is the binary's default; `no-proactive` is the soft
/// timeout switched off (what exists today); the rest select `kv node --recovery <name>`, and
/// run as soon as the binary accepts it.
pub const SCHEMES: &[Scheme] = &[
    Scheme {
        name: "cand",
        up_args: &[],
    },
    Scheme {
        name: "offline",
        up_args: &["--recovery", "offline"],
    },
    Scheme {
        name: "no-proactive",
        up_args: &["--soft-timeout-ms", "0"],
    },
    Scheme {
        name: "batch-only",
        up_args: &["--recovery", "batch-only"],
    },
    Scheme {
        name: "single-log",
        up_args: &["--recovery", "single-log"],
    },
    Scheme {
        name: "no-sampling",
        up_args: &["--recovery", "no-sampling"],
    },
    Scheme {
        name: "full-replica",
        up_args: &["--recovery", "full-replica"],
    },
];

pub fn scheme(name: &str) -> anyhow::Result<&'static Scheme> {
    SCHEMES.iter().find(|s| s.name == name).with_context(|| {
        format!(
            "unknown scheme {name:?}; the schemes are {}",
            SCHEMES
                .iter()
                .map(|s| s.name)
                .collect::<Vec<_>>()
                .join(", ")
        )
    })
}

/// `kv up`'s arguments for a throw-away P + B + W group of `scheme` in `dir`, parsed by `kv
/// up`'s own parser: an argument this binary does not know is refused here, with its message.
/// The popularity sampling share the bench runs with (see `group_args`).
const BENCH_SAMPLE_PROBABILITY: &str = "0.02";

fn group_args(dir: &Path, s: &Scheme) -> anyhow::Result<UpArgs> {
    let mut extra: Vec<String> = [
        "--protocol",
        "witness",
        "--backups",
        "1",
        "--witnesses",
        "1",
        // The spec's bench setting (candstore.md, warm start): this machine serves ~35 k
        // ops/s against the paper's ~3 M, so 0.1 % would sample too few keys to rank; the
        // same for every scheme (no-sampling turns sampling off by its own flag).
        "--sample-probability",
        BENCH_SAMPLE_PROBABILITY,
    ]
    .map(String::from)
    .to_vec();
    extra.extend(s.up_args.iter().map(|a| a.to_string()));
    up_args(dir, 3, &extra).with_context(|| {
        format!(
            "scheme {}: this binary's `kv up --protocol witness` refuses `{}` (not built yet?)",
            s.name,
            s.up_args.join(" ")
        )
    })
}

/// Checks that every live node of `lk` was started with `scheme`'s arguments, in order: a
/// flag `kv up` parses but does not pass on would otherwise run cand under another name.
fn ensure_nodes_run(lk: &LocalWitnessKv, s: &Scheme) -> anyhow::Result<()> {
    if s.up_args.is_empty() {
        return Ok(());
    }
    for i in 0..lk.children.len() {
        let Some(pid) = lk.pid(i) else { continue };
        let raw = std::fs::read(format!("/proc/{pid}/cmdline"))
            .with_context(|| format!("reading node {i}'s command line"))?;
        let args: Vec<&[u8]> = raw.split(|b| *b == 0).collect();
        let want: Vec<&[u8]> = s.up_args.iter().map(|a| a.as_bytes()).collect();
        anyhow::ensure!(
            args.windows(want.len()).any(|w| w == want.as_slice()),
            "scheme {}: node {i} was started without `{}`: `kv up` accepted it but does not pass it \
             to its nodes, so this run would measure cand under another name",
            s.name,
            s.up_args.join(" ")
        );
    }
    Ok(())
}

// ------------------------------------------------------------------------------ target

/// One closed-loop client: the witness client, which follows `NotLeader{hint}` and retries
/// `Unavailable` (a provisional or offline-recovering leader) until its deadline.
struct WitnessTarget(WitnessClient);

/// How long one operation may retry through a failover before it counts as an error: well
/// past an offline recovery of the quick shard, so an outage shows as empty windows and then
/// late completions (what a patient client sees), not as a flood of errors.
const OP_DEADLINE: Duration = Duration::from_secs(120);

fn target_error(e: WitnessError) -> TargetError {
    match e {
        WitnessError::Refused(m) => TargetError::Store(m),
        other => TargetError::Io(other.to_string()),
    }
}

impl KvTarget for WitnessTarget {
    fn name(&self) -> &'static str {
        "witness-kv"
    }

    async fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, TargetError> {
        self.0.get(key).await.map_err(target_error)
    }

    /// A put whose outcome is unknown (the leader lost its leadership, or the connection
    /// broke after sending) is sent again, as a patient client would: every value the driver
    /// writes for a key is valid for it, so a put that did land twice upsets no check, and its
    /// latency includes the retries (spec (e)). On a loaded machine a spurious election during
    /// the load would otherwise fail the run.
    async fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), TargetError> {
        let start = Instant::now();
        loop {
            match self.0.put(key, value).await {
                Err(WitnessError::Indeterminate(_)) if start.elapsed() < OP_DEADLINE => continue,
                r => return r.map_err(target_error),
            }
        }
    }
}

fn targets(lk: &LocalWitnessKv, n: usize) -> Vec<WitnessTarget> {
    (0..n)
        .map(|_| {
            let mut c = lk.file.client(lk.secret.clone());
            c.deadline = OP_DEADLINE;
            WitnessTarget(c)
        })
        .collect()
}

// ------------------------------------------------------------------------------ arguments

#[derive(Args, Debug)]
pub struct KvTtrArgs {
    /// A short run that still measures every figure (512 MiB shard, one round, short phases).
    #[arg(long)]
    pub quick: bool,
    /// Also the paper's grid: YCSB-B and C × θ ∈ {0.9, 0.99, 1.1} × values of 512 B, 1 KiB and
    /// 4 KiB (Figures 9 and 10).
    #[arg(long)]
    pub sweep: bool,
    /// Where plots (SVG, PNG) and raw samples (CSV) go [default: target/bench/kv].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Schemes to compare, comma-separated: cand, offline, no-proactive, batch-only,
    /// single-log, no-sampling, full-replica [default: all; those this binary cannot start are
    /// reported absent].
    #[arg(long, value_delimiter = ',')]
    pub schemes: Vec<String>,
    /// Logical bytes loaded (keys and values), in MiB [default: 4096; 512 with --quick].
    #[arg(long)]
    pub shard_mib: Option<u64>,
    /// Bytes per value of the headline cells.
    #[arg(long, default_value_t = 1024)]
    pub value_bytes: usize,
    /// Closed-loop clients during the measured run, one request in flight each.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Clients loading the shard (the load is not measured; more clients load it sooner).
    #[arg(long, default_value_t = 32)]
    pub load_clients: usize,
    /// Seconds of steady load before the kill; the SLOs come from their windows after the
    /// first second [default: 10; 4 with --quick].
    #[arg(long)]
    pub warmup_s: Option<f64>,
    /// Seconds measured after the kill [default: 60; 8 with --quick].
    #[arg(long)]
    pub after_kill_s: Option<f64>,
    /// Rounds; each figure is the median over them (the paper: 3) [default: 3; 1 with --quick].
    #[arg(long)]
    pub rounds: Option<usize>,
    /// A directory on the disk under test for the sequential-read measurement of the offline
    /// bound (tmpfs is refused).
    #[arg(long, value_name = "DIR", default_value = "/var/tmp")]
    pub ssd_dir: PathBuf,
    /// Size of that measurement's scratch file, in MiB [default: 1024; 128 with --quick].
    #[arg(long)]
    pub ssd_file_mib: Option<u64>,
    /// Seed of every client's operation and key sequence.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// SLO multiples of the steady p99.9 on the Figure 9 curves; 4× is the headline.
pub const P999_MULTIPLES: &[f64] = &[1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0];
/// SLO multiples of the steady p50 on the Figure 10 curves; 1.5× is the headline.
pub const P50_MULTIPLES: &[f64] = &[1.25, 1.5, 2.0, 3.0, 4.0];
const HEADLINE_P999: f64 = 4.0;
const HEADLINE_P50: f64 = 1.5;
/// The span after the election whose throughput is compared with the steady state.
const AFTER_ELECTION: Duration = Duration::from_secs(2);
/// The first second of the run is left out of the steady state (connections, caches).
const STEADY_SKIP: Duration = Duration::from_secs(1);
/// How often the new leader's log is read for its election and recovery lines.
const LOG_POLL: Duration = Duration::from_millis(5);

/// One experiment cell: a workload, a skew and a value size.
#[derive(Clone, Debug, PartialEq)]
struct Cell {
    workload: &'static str,
    theta: f64,
    value_bytes: usize,
}

impl Cell {
    /// `c.theta0_99.v1024`: a figure-name prefix (no dot inside a segment).
    fn label(&self) -> String {
        let theta = format!("{}", self.theta).replace('.', "_");
        format!("{}.theta{theta}.v{}", self.workload, self.value_bytes)
    }
}

// ------------------------------------------------------------------------------ one run

/// What one run of one scheme measured. Times are since the start of the run phase.
#[derive(Clone, Debug)]
struct RunOut {
    windows: Vec<WindowStats>,
    failure: Duration,
    election: Option<Duration>,
    recovered: Option<Duration>,
    load_ops_per_s: f64,
    /// Node id and resident bytes, just before the kill.
    rss: Vec<(usize, u64)>,
    /// Every node's status (tier bytes, RSS) just before the kill, after the load settled.
    status_loaded: Statuses,
    /// Every node's status once the new primary reported its recovery done (empty if it did
    /// not within the run); the killed node is an error.
    status_recovered: Statuses,
    errors: u64,
    reads_problem: Option<String>,
    /// Leaderships taken (any head's `term T Leader` lines) between the start of the run
    /// phase and the kill: nonzero means a spurious election disturbed the steady state.
    warmup_elections: u64,
}

/// A status request to every node: (node, its report or why there is none).
type Statuses = Vec<(usize, Result<StatusReport, String>)>;

async fn statuses(lk: &LocalWitnessKv) -> Statuses {
    let mut c = lk.file.client(lk.secret.clone());
    c.all_status()
        .await
        .into_iter()
        .map(|(id, r)| (id as usize, r.map_err(|e| e.to_string())))
        .collect()
}

struct Plan {
    records: u64,
    warmup: Duration,
    after_kill: Duration,
    clients: usize,
    load_clients: usize,
    seed: u64,
}

fn spec_of(cell: &Cell, records: u64) -> anyhow::Result<WorkloadSpec> {
    let mut spec = WorkloadSpec::by_name(cell.workload)?;
    spec.record_count = records;
    // The duration bounds the run; the count only has to outlast it.
    spec.operation_count = Some(1_000_000_000);
    spec.field_count = 1;
    spec.field_length_bytes = cell.value_bytes;
    spec.request_distribution = spec.request_distribution.with_theta(cell.theta);
    spec.validate()?;
    Ok(spec)
}

/// Copies the `node-*.log` files of `from` into `to` (best effort: a missing log costs only
/// the copy, never the run).
fn keep_logs(from: &Path, to: &Path) {
    let Ok(entries) = std::fs::read_dir(from) else { return };
    if std::fs::create_dir_all(to).is_err() {
        return;
    }
    for e in entries.flatten() {
        let _ = std::fs::copy(e.path(), to.join(e.file_name()));
    }
}

/// The lines of `path` past byte `from` (a node writes lines whole; a torn last one waits).
fn log_since(path: &Path, from: u64) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(text.get(from as usize..).unwrap_or_default()).into_owned();
    super::ycsb::complete_lines(&text).to_string()
}

/// Runs one scheme once; the nodes' logs are copied to `logs_to` (the election, recovery and
/// its counters are in them: what a person reads when a figure looks wrong).
fn run_one(cell: &Cell, s: &Scheme, plan: &Plan, logs_to: &Path) -> anyhow::Result<RunOut> {
    let tmp = bench_dir("understudy-kv-ttr-")?;
    let up = group_args(tmp.path(), s)?;
    let mut lk = LocalWitnessKv::start(&up)?;
    let result = run_group(&mut lk, cell, s, plan);
    lk.stop();
    keep_logs(&tmp.path().join("logs"), logs_to);
    match result {
        Ok(r) => Ok(r),
        Err(e) => {
            let kept = tmp.keep();
            Err(e.context(format!(
                "{} {}: logs kept in {}/logs",
                cell.label(),
                s.name,
                kept.display()
            )))
        }
    }
}

fn run_group(
    lk: &mut LocalWitnessKv,
    cell: &Cell,
    s: &Scheme,
    plan: &Plan,
) -> anyhow::Result<RunOut> {
    ensure_nodes_run(lk, s)?;
    let backups = lk.file.backups as usize;
    let logs_dir = lk.dir.join("logs");
    let log_of = |i: usize| logs_dir.join(format!("node-{i}.log"));
    let rt = crate::runtime()?;
    rt.block_on(async {
        lk.wait_serving(Duration::from_secs(60)).await?;
        let load_runner = Runner::new(spec_of(cell, plan.records)?)?;
        let config = RunConfig {
            seed: plan.seed,
            max_duration: Some(plan.warmup + plan.after_kill),
            window: bench::LATENCY_WINDOW_DEFAULT,
            max_errors: u64::MAX,
            latency_windows: true,
        };
        let (_, load) = load_runner
            .load(targets(lk, plan.load_clients), &config)
            .await?;
        eprintln!(
            "kv ttr: {} {}: loaded {} records in {:.1} s",
            cell.label(),
            s.name,
            load.completed_ops(),
            load.elapsed.as_secs_f64()
        );
        anyhow::ensure!(
            load.errors_count == 0,
            "the load failed {} inserts (first: {:?})",
            load.errors_count,
            load.first_problems
        );
        let settle_t0 = Instant::now();
        let leader = settle(lk, &log_of).await?;
        if settle_t0.elapsed() > Duration::from_secs(1) {
            eprintln!(
                "kv ttr: {} {}: the lead moved during the load; waited {:.1} s for node {leader} to end its recovery",
                cell.label(),
                s.name,
                settle_t0.elapsed().as_secs_f64()
            );
        }
        let heads: Vec<usize> = (0..lk.children.len()).filter(|&i| i == 0 || i > backups).collect();
        let leaderships = |heads: &[usize]| -> u64 {
            heads.iter().map(|&i| log_since(&log_of(i), 0).matches(" Leader (").count() as u64).sum()
        };
        let leaderships_at_run = leaderships(&heads);
        let runner = Runner::new(spec_of(cell, plan.records)?)?;
        let run_targets = targets(lk, plan.clients);
        let deadline = plan.warmup + plan.after_kill;
        let fault = async {
            tokio::time::sleep(plan.warmup).await;
            let rss: Vec<(usize, u64)> = (0..lk.children.len())
                .filter_map(|i| Some((i, testbed::proc::rss_bytes(lk.pid(i)?)?)))
                .collect();
            // The primary is whoever leads now: on a loaded machine a spurious election in the
            // warm-up may have moved the lead off node 0, and killing a follower measures
            // nothing.
            let mut probe = lk.file.client(lk.secret.clone());
            probe.deadline = OP_DEADLINE;
            probe
                .get(b"__understudy_probe")
                .await
                .context("finding the leader before the kill")?;
            let victim = probe.leader_guess() as usize;
            // The heads that may take over, and where their logs stand now.
            let logs: Vec<PathBuf> = (0..lk.children.len())
                .filter(|&i| i != victim && (i == 0 || i > backups) && lk.pid(i).is_some())
                .map(log_of)
                .collect();
            let from: Vec<u64> = logs
                .iter()
                .map(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
                .collect();
            let warmup_elections = leaderships(&heads).saturating_sub(leaderships_at_run);
            let status_loaded = statuses(lk).await;
            lk.kill9(victim)?;
            let killed = Instant::now();
            eprintln!(
                "kv ttr: {} {}: primary (node {victim}) killed",
                cell.label(),
                s.name
            );
            let (mut election, mut recovered) = (None, None);
            let stop = killed + deadline.saturating_sub(plan.warmup);
            while Instant::now() < stop && recovered.is_none() {
                tokio::time::sleep(LOG_POLL).await;
                for (p, &from) in logs.iter().zip(&from) {
                    let text = log_since(p, from);
                    if election.is_none() && text.contains(" Leader (") {
                        election = Some(Instant::now());
                    }
                    if recovered.is_none() && text.contains(": recovered:") {
                        recovered = Some(Instant::now());
                    }
                }
            }
            anyhow::Ok((killed, election, recovered, rss, warmup_elections, status_loaded))
        };
        let (run, fault) = tokio::join!(runner.run(run_targets, &config), fault);
        let (_, run) = run?;
        let (killed, election, recovered, rss, warmup_elections, status_loaded) = fault?;
        // After the run, so the request does not disturb its windows.
        let status_recovered = if recovered.is_some() {
            statuses(lk).await
        } else {
            Vec::new()
        };
        let since = |t: Instant| t.saturating_duration_since(run.started);
        let windows = run
            .latency_windows
            .as_ref()
            .context("the runner kept no latency windows")?
            .windows(run.elapsed)?;
        let reads_problem = crate::ycsb::ensure_reads_checked(&load, &run)
            .err()
            .map(|e| e.to_string());
        eprintln!(
            "kv ttr: {} {}: {} operations in {:.1} s, {} errors; election {}, recovered {}",
            cell.label(),
            s.name,
            run.completed_ops(),
            run.elapsed.as_secs_f64(),
            run.errors_count,
            election.map_or("not seen".into(), |t| format!(
                "{:.2} s after the kill",
                (t - killed).as_secs_f64()
            )),
            recovered.map_or("not seen".into(), |t| format!(
                "{:.2} s after the kill",
                (t - killed).as_secs_f64()
            )),
        );
        anyhow::Ok(RunOut {
            windows,
            failure: since(killed),
            election: election.map(since),
            recovered: recovered.map(since),
            load_ops_per_s: load.throughput_ops_per_s(),
            rss,
            status_loaded,
            status_recovered,
            errors: run.errors_count,
            reads_problem,
            warmup_elections,
        })
    })
}

/// Longest wait for a settled leader after the load: a spurious election under load makes a
/// witness lead, and it then pulls the whole shard; measuring the steady state during that pull
/// would set every SLO against a recovering node.
const SETTLE_MAX: Duration = Duration::from_secs(600);

/// Waits until the node that leads has ended its own recovery (its log's last `term T Leader`
/// line is followed by `recovered:`; the first primary logs both at once) and returns it.
async fn settle(lk: &LocalWitnessKv, log_of: &dyn Fn(usize) -> PathBuf) -> anyhow::Result<usize> {
    let t0 = Instant::now();
    loop {
        let mut probe = lk.file.client(lk.secret.clone());
        probe.deadline = OP_DEADLINE;
        probe
            .get(b"__understudy_probe")
            .await
            .context("finding the leader after the load")?;
        let leader = probe.leader_guess() as usize;
        let log = log_since(&log_of(leader), 0);
        let settled = log
            .rfind(" Leader (")
            .is_some_and(|at| log[at..].contains(": recovered:"));
        if settled {
            return Ok(leader);
        }
        anyhow::ensure!(
            t0.elapsed() < SETTLE_MAX,
            "node {leader} took the lead during the load and did not end its recovery within {SETTLE_MAX:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ------------------------------------------------------------------------------ analysis

/// A run's derived figures (seconds and ops/s; `None`: not measured or never recovered).
#[derive(Clone, Debug, Default)]
struct Derived {
    steady_p999_us: Option<f64>,
    steady_p50_us: Option<f64>,
    steady_ops_per_s: Option<f64>,
    /// (multiple, TTR from the kill) on each curve.
    p999: Vec<(f64, Option<f64>)>,
    p50: Vec<(f64, Option<f64>)>,
    election_s: Option<f64>,
    full_copy_s: Option<f64>,
    after_election_ops_per_s: Option<f64>,
}

fn steady_span(r: &RunOut) -> std::ops::Range<Duration> {
    STEADY_SKIP..r.failure
}

fn derive(r: &RunOut) -> Derived {
    let steady = steady_span(r);
    let curve = |p: Percentile, multiples: &[f64]| -> Vec<(f64, Option<f64>)> {
        bench::ttr_curve(&r.windows, r.failure, p, steady.clone(), multiples)
            .into_iter()
            .map(|pt| (pt.multiple, pt.ttr.duration().map(|d| d.as_secs_f64())))
            .collect()
    };
    let secs_after_kill =
        |t: Option<Duration>| t.map(|t| t.saturating_sub(r.failure).as_secs_f64());
    Derived {
        steady_p999_us: bench::steady_state_us(&r.windows, Percentile::P999, steady.clone())
            .map(|v| v as f64),
        steady_p50_us: bench::steady_state_us(&r.windows, Percentile::P50, steady.clone())
            .map(|v| v as f64),
        steady_ops_per_s: bench::mean_ops_per_s(&r.windows, steady.clone()),
        p999: curve(Percentile::P999, P999_MULTIPLES),
        p50: curve(Percentile::P50, P50_MULTIPLES),
        election_s: secs_after_kill(r.election),
        full_copy_s: secs_after_kill(r.recovered),
        after_election_ops_per_s: r
            .election
            .and_then(|e| bench::mean_ops_per_s(&r.windows, e..e + AFTER_ELECTION)),
    }
}

/// The median of `values`, a missing value counting as larger than any (a run that did not
/// recover is the worst run); `None` when the median itself is missing.
fn median(values: &[Option<f64>]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().map(|x| x.unwrap_or(f64::INFINITY)).collect();
    v.sort_by(f64::total_cmp);
    let m = *v.get((v.len().max(1) - 1) / 2)?;
    m.is_finite().then_some(m)
}

/// Per-figure medians over a scheme's rounds.
fn median_of(runs: &[Derived]) -> Derived {
    let m = |f: fn(&Derived) -> Option<f64>| median(&runs.iter().map(f).collect::<Vec<_>>());
    let curve = |pick: fn(&Derived) -> &Vec<(f64, Option<f64>)>| -> Vec<(f64, Option<f64>)> {
        let Some(first) = runs.first() else {
            return vec![];
        };
        pick(first)
            .iter()
            .enumerate()
            .map(|(i, (multiple, _))| {
                let at: Vec<Option<f64>> = runs
                    .iter()
                    .map(|r| pick(r).get(i).and_then(|p| p.1))
                    .collect();
                (*multiple, median(&at))
            })
            .collect()
    };
    Derived {
        steady_p999_us: m(|d| d.steady_p999_us),
        steady_p50_us: m(|d| d.steady_p50_us),
        steady_ops_per_s: m(|d| d.steady_ops_per_s),
        p999: curve(|d| &d.p999),
        p50: curve(|d| &d.p50),
        election_s: m(|d| d.election_s),
        full_copy_s: m(|d| d.full_copy_s),
        after_election_ops_per_s: m(|d| d.after_election_ops_per_s),
    }
}

fn at_multiple(curve: &[(f64, Option<f64>)], multiple: f64) -> Option<f64> {
    curve.iter().find(|(m, _)| *m == multiple).and_then(|p| p.1)
}

/// `x1_5` for 1.5: a multiple as a figure-name segment.
fn multiple_label(m: f64) -> String {
    format!("x{m}").replace('.', "_")
}

// ------------------------------------------------------------------------------ the command

pub fn run(a: &KvTtrArgs) -> anyhow::Result<bench::Report> {
    anyhow::ensure!(
        a.clients >= 1 && a.load_clients >= 1,
        "--clients and --load-clients must be at least 1"
    );
    anyhow::ensure!(a.value_bytes >= 1, "--value-bytes must be at least 1");
    let shard_mib = a.shard_mib.unwrap_or(if a.quick { 512 } else { 4096 });
    anyhow::ensure!(shard_mib >= 1, "--shard-mib must be at least 1");
    let warmup = Duration::from_secs_f64(a.warmup_s.unwrap_or(if a.quick { 4.0 } else { 10.0 }));
    let after_kill =
        Duration::from_secs_f64(a.after_kill_s.unwrap_or(if a.quick { 8.0 } else { 60.0 }));
    anyhow::ensure!(
        warmup >= STEADY_SKIP + Duration::from_millis(500),
        "--warmup-s must be at least 1.5: the steady state is measured from 1 s to the kill"
    );
    anyhow::ensure!(
        after_kill >= Duration::from_secs(1),
        "--after-kill-s must be at least 1"
    );
    let rounds = a.rounds.unwrap_or(if a.quick { 1 } else { 3 });
    anyhow::ensure!(rounds >= 1, "--rounds must be at least 1");
    let out = bench::out_dir("kv", a.out.clone())?;

    // Schemes: named ones must start; the default set runs those that can and names the rest.
    let mut report = bench::Report::new("kv.ttr", a.quick);
    let probe = bench_dir("understudy-kv-ttr-probe-")?;
    let mut schemes: Vec<&Scheme> = Vec::new();
    if a.schemes.is_empty() {
        for s in SCHEMES {
            match group_args(probe.path(), s) {
                Ok(_) => schemes.push(s),
                Err(e) => {
                    // clap's message spans lines and ends in a hint about --help: one line here.
                    let why = format!("{e:#}");
                    let why = why.split("For more information").next().unwrap_or_default();
                    let why = why.split_whitespace().collect::<Vec<_>>().join(" ");
                    eprintln!("kv ttr: skipping {}: {why}", s.name);
                    report.absent(&format!("scheme.{}", s.name), &why);
                }
            }
        }
    } else {
        for name in &a.schemes {
            let s = scheme(name)?;
            group_args(probe.path(), s)?;
            anyhow::ensure!(
                !schemes.iter().any(|x| x.name == s.name),
                "scheme {name} named twice"
            );
            schemes.push(s);
        }
    }
    drop(probe);
    anyhow::ensure!(
        schemes.iter().any(|s| s.name == "cand"),
        "the schemes must include cand: every ratio is against it"
    );

    let headline: Vec<Cell> = ["c", "b"]
        .map(|workload| Cell {
            workload,
            theta: 0.99,
            value_bytes: a.value_bytes,
        })
        .to_vec();
    let mut cells = headline.clone();
    if a.sweep {
        for value_bytes in [512, 1024, 4096] {
            for workload in ["b", "c"] {
                for theta in [0.9, 0.99, 1.1] {
                    let c = Cell {
                        workload,
                        theta,
                        value_bytes,
                    };
                    if !cells.contains(&c) {
                        cells.push(c);
                    }
                }
            }
        }
    }

    // The offline bound's denominator, before any group uses the disk.
    let ssd_mib = a.ssd_file_mib.unwrap_or(if a.quick { 128 } else { 1024 });
    let seq_read = super::ssd::best_sequential_read_mib_per_s(
        &a.ssd_dir,
        ssd_mib,
        Duration::from_secs_f64(if a.quick { 0.25 } else { 1.0 }),
    )
    .context("measuring the sequential read of the offline bound")?;
    eprintln!(
        "kv ttr: best sequential O_DIRECT read {seq_read:.0} MiB/s (load {})",
        loadavg()
    );
    report.figure("offline_bound.seq_read_mib_per_s", seq_read)?;

    let mut problems = Vec::new();
    let mut rss_worst: Option<(f64, String)> = None;
    let mut headline_derived: Vec<(Cell, Vec<(&'static str, Derived)>)> = Vec::new();
    for cell in &cells {
        let records = ((shard_mib << 20) / (cell.value_bytes as u64 + KEY_BYTES_ESTIMATE)).max(1);
        let plan = Plan {
            records,
            warmup,
            after_kill,
            clients: a.clients,
            load_clients: a.load_clients,
            seed: a.seed,
        };
        // Interleaved: every round runs every scheme once, in the same order.
        let mut runs: Vec<Vec<RunOut>> = vec![Vec::new(); schemes.len()];
        for round in 0..rounds {
            for (i, s) in schemes.iter().enumerate() {
                eprintln!(
                    "kv ttr: {} round {} of {rounds}: {} (load {})",
                    cell.label(),
                    round + 1,
                    s.name,
                    loadavg()
                );
                let logs_to = out.join("logs").join(format!("{}_{}_round{}", cell.label(), s.name, round + 1));
                let r = run_one(cell, s, &plan, &logs_to)?;
                if let Some(p) = &r.reads_problem {
                    problems.push(format!(
                        "{} {} round {}: {p}",
                        cell.label(),
                        s.name,
                        round + 1
                    ));
                }
                runs[i].push(r);
            }
        }
        let derived = report_cell(&mut report, &out, cell, records, &schemes, &runs)?;
        if headline.contains(cell) {
            // Every round and node of the headline cells, both phases: the bound holds for all.
            let cand = schemes.iter().position(|s| s.name == "cand");
            for r in cand.map_or(&[][..], |i| &runs[i][..]) {
                if let Some((ratio, at)) = worst_rss_ratio(r) {
                    if rss_worst.as_ref().is_none_or(|(w, _)| ratio > *w) {
                        rss_worst = Some((ratio, format!("{} {at}", cell.label())));
                    }
                }
            }
            headline_derived.push((cell.clone(), derived));
        }
    }
    // Cost per GB from the tier bytes an N = 2 group reports live after the headline load.
    let cost_records = ((shard_mib << 20) / (a.value_bytes as u64 + KEY_BYTES_ESTIMATE)).max(1);
    let cost_plan = Plan {
        records: cost_records,
        warmup,
        after_kill,
        clients: a.clients,
        load_clients: a.load_clients,
        seed: a.seed,
    };
    eprintln!(
        "kv ttr: cost: an N = 2 group (P + 2 B + 2 W) loaded with {cost_records} records (load {})",
        loadavg()
    );
    let live = cost_run(a.value_bytes, &cost_plan);
    if let Err(e) = &live {
        eprintln!("kv ttr: cost: no live tier bytes ({e:#}); falling back to the estimate");
    }
    headline_ratios(
        &mut report,
        &headline_derived,
        shard_mib,
        a.value_bytes,
        seq_read,
        live,
        rss_worst,
    )?;
    eprintln!(
        "kv ttr: plots and samples in {} (load {})",
        out.display(),
        loadavg()
    );
    if !problems.is_empty() {
        report.print();
        anyhow::bail!(
            "reads came back wrong, so the figures above are not valid: {}",
            problems.join("; ")
        );
    }
    Ok(report)
}

/// YCSB's keys are `user` and up to 20 digits; the shard's record count uses this average so
/// the loaded logical bytes come near `--shard-mib` (the report gives the exact figure).
const KEY_BYTES_ESTIMATE: u64 = 23;

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// Writes one cell's figures, CSV and plots; returns each scheme's medians.
fn report_cell(
    report: &mut bench::Report,
    out: &Path,
    cell: &Cell,
    records: u64,
    schemes: &[&Scheme],
    runs: &[Vec<RunOut>],
) -> anyhow::Result<Vec<(&'static str, Derived)>> {
    let label = cell.label();
    let stem = label.replace('.', "_");
    report.figure(&format!("{label}.records_count"), records as f64)?;
    let mut medians = Vec::new();
    let mut csv_rows = Vec::new();
    for (s, runs) in schemes.iter().zip(runs) {
        let derived: Vec<Derived> = runs.iter().map(derive).collect();
        for (round, d) in derived.iter().enumerate() {
            for (p, curve, steady) in [
                ("p999", &d.p999, d.steady_p999_us),
                ("p50", &d.p50, d.steady_p50_us),
            ] {
                for (m, ttr) in curve {
                    csv_rows.push(vec![
                        s.name.to_string(),
                        (round + 1).to_string(),
                        p.to_string(),
                        m.to_string(),
                        steady.map_or(String::new(), |v| format!("{:.0}", v * m)),
                        ttr.map_or(String::new(), |t| format!("{t:.3}")),
                    ]);
                }
            }
        }
        let m = median_of(&derived);
        let name = |f: &str| format!("{label}.{}.{f}", s.name);
        let put = |report: &mut bench::Report,
                   f: &str,
                   v: Option<f64>,
                   why: &str|
         -> anyhow::Result<()> {
            match v {
                Some(v) => report.figure(&name(f), v)?,
                None => report.absent(&name(f), why),
            }
            Ok(())
        };
        let never =
            "the run did not get back within the SLO before it ended (raise --after-kill-s)";
        put(
            report,
            "steady.latency_us_p999",
            m.steady_p999_us,
            "no window before the kill",
        )?;
        put(
            report,
            "steady.latency_us_p50",
            m.steady_p50_us,
            "no window before the kill",
        )?;
        put(
            report,
            "steady.throughput_ops_per_s",
            m.steady_ops_per_s,
            "no window before the kill",
        )?;
        for (m_, ttr) in &m.p999 {
            put(
                report,
                &format!("slo_p999_{}.ttr_s", multiple_label(*m_)),
                *ttr,
                never,
            )?;
        }
        for (m_, ttr) in &m.p50 {
            put(
                report,
                &format!("slo_p50_{}.ttr_s", multiple_label(*m_)),
                *ttr,
                never,
            )?;
        }
        put(
            report,
            "election_s",
            m.election_s,
            "the new leader's log never said it leads",
        )?;
        put(
            report,
            "full_copy_s",
            m.full_copy_s,
            "the new leader did not report the end of recovery before the run ended",
        )?;
        put(
            report,
            "after_election.throughput_ops_per_s",
            m.after_election_ops_per_s,
            "no election seen, or the run ended within 2 s of it",
        )?;
        let load: Vec<Option<f64>> = runs.iter().map(|r| Some(r.load_ops_per_s)).collect();
        put(report, "load.throughput_ops_per_s", median(&load), "")?;
        let elections: Vec<Option<f64>> = runs
            .iter()
            .map(|r| Some(r.warmup_elections as f64))
            .collect();
        put(report, "warmup.elections_count", median(&elections), "")?;
        let errors: Vec<Option<f64>> = runs.iter().map(|r| Some(r.errors as f64)).collect();
        put(report, "run.errors_count", median(&errors), "")?;
        if let Some(first) = runs.first() {
            for (node, rss) in &first.rss {
                report.figure(&name(&format!("node{node}.rss_bytes")), *rss as f64)?;
            }
            for (phase, st) in [
                ("loaded", &first.status_loaded),
                ("recovered", &first.status_recovered),
            ] {
                report_statuses(report, &name(""), phase, st)?;
            }
        }
        medians.push((s.name, m));
    }
    bench::write_csv(
        &out.join(format!("kv_ttr_{stem}_ttr.csv")),
        &[
            "scheme",
            "round",
            "percentile",
            "slo_multiple",
            "slo_us",
            "ttr_s",
        ],
        csv_rows.into_iter(),
    )?;
    let first: Vec<(&str, &[WindowStats])> = schemes
        .iter()
        .zip(runs)
        .filter_map(|(s, r)| Some((s.name, r.first()?.windows.as_slice())))
        .collect();
    bench::write_windows_csv(&out.join(format!("kv_ttr_{stem}_windows.csv")), &first)?;
    let failure = runs
        .first()
        .and_then(|r| r.first())
        .map_or(Duration::ZERO, |r| r.failure);
    bench::write_timeline_plots(
        &out.join(format!("kv_ttr_{stem}_timeline")),
        &format!(
            "YCSB-{} theta={} {} B values, SIGKILL of the primary (round 1)",
            cell.workload.to_uppercase(),
            cell.theta,
            cell.value_bytes
        ),
        &first,
        failure,
    )?;
    for (p, what, pick) in [
        (
            "p999",
            "99.9% tail latency SLO (Fig. 9)",
            (|d: &Derived| d.p999.clone()) as fn(&Derived) -> Vec<(f64, Option<f64>)>,
        ),
        ("p50", "median latency SLO (Fig. 10)", |d: &Derived| {
            d.p50.clone()
        }),
    ] {
        let series: Vec<Series> = medians
            .iter()
            .map(|(name, d)| Series {
                name: name.to_string(),
                points: pick(d)
                    .into_iter()
                    .map(|(m, t)| (m, t.unwrap_or(f64::NAN)))
                    .collect(),
            })
            .collect();
        bench::line_plot(
            &out.join(format!("kv_ttr_{stem}_{p}")),
            &format!(
                "TTR for a {what}, YCSB-{} theta={} {} B (no point: never recovered)",
                cell.workload.to_uppercase(),
                cell.theta,
                cell.value_bytes
            ),
            "SLO (× the run's steady-state value)",
            "TTR (s)",
            &series,
            bench::Scale::Linear,
        )?;
    }
    Ok(medians)
}

/// One run's node statuses under `<prefix>node<i>.<phase>.`: tier bytes as charged (DRAM,
/// NVMM, SSD), the private RSS and `rss_vs_tier.bytes` (private RSS over the DRAM and NVMM-table
/// bytes: what the heap should hold; the NVMM rings are shared memory and not in it).
fn report_statuses(
    report: &mut bench::Report,
    prefix: &str,
    phase: &str,
    st: &Statuses,
) -> anyhow::Result<()> {
    for (node, r) in st {
        let name = |f: &str| format!("{prefix}node{node}.{phase}.{f}");
        match r {
            Ok(s) => {
                let t = &s.tiers;
                report.figure(&name("tier_dram_bytes"), t.dram_bytes() as f64)?;
                report.figure(&name("tier_nvmm_bytes"), t.nvmm_bytes() as f64)?;
                report.figure(&name("tier_ssd_bytes"), t.ssd_bytes() as f64)?;
                let private = s.rss_bytes.saturating_sub(s.rss_shared_bytes);
                report.figure(&name("rss_private_bytes"), private as f64)?;
                if t.in_heap_bytes() > 0 && private > 0 {
                    report.ratio(
                        &name("rss_vs_tier.bytes"),
                        private as f64,
                        t.in_heap_bytes() as f64,
                    )?;
                }
            }
            Err(e) => report.absent(&name("status"), &format!("no status: {e}")),
        }
    }
    Ok(())
}

/// The worst `rss_vs_tier.bytes` of one run's statuses: (ratio, which node and phase).
fn worst_rss_ratio(r: &RunOut) -> Option<(f64, String)> {
    let mut worst: Option<(f64, String)> = None;
    for (phase, st) in [
        ("loaded", &r.status_loaded),
        ("recovered", &r.status_recovered),
    ] {
        for (node, s) in st {
            let Ok(s) = s else { continue };
            let heap = s.tiers.in_heap_bytes();
            let private = s.rss_bytes.saturating_sub(s.rss_shared_bytes);
            if heap == 0 || private == 0 {
                continue;
            }
            let ratio = private as f64 / heap as f64;
            if worst.as_ref().is_none_or(|(w, _)| ratio > *w) {
                worst = Some((
                    ratio,
                    format!("node {node} ({} {}, {phase})", s.kind, s.role),
                ));
            }
        }
    }
    worst
}

/// Cost per GB from live tier bytes (issue 25 item 10): a cand group of the N = 2 layout
/// (primary, 2 backups, 2 witnesses) loaded with the headline cell's shard, left to write back,
/// then asked for every node's status. No kill, no measured run: only the bytes matter.
fn cost_run(value_bytes: usize, plan: &Plan) -> anyhow::Result<Vec<StatusReport>> {
    let tmp = bench_dir("understudy-kv-cost-")?;
    let extra: Vec<String> = [
        "--protocol",
        "witness",
        "--backups",
        "2",
        "--witnesses",
        "2",
    ]
    .map(String::from)
    .to_vec();
    let up = up_args(tmp.path(), 5, &extra)?;
    let mut lk = LocalWitnessKv::start(&up)?;
    let cell = Cell {
        workload: "c",
        theta: 0.99,
        value_bytes,
    };
    let rt = crate::runtime()?;
    let r = rt.block_on(async {
        lk.wait_serving(Duration::from_secs(60)).await?;
        let runner = Runner::new(spec_of(&cell, plan.records)?)?;
        let config = RunConfig {
            seed: plan.seed,
            max_duration: None,
            window: bench::LATENCY_WINDOW_DEFAULT,
            max_errors: u64::MAX,
            latency_windows: false,
        };
        let (_, load) = runner
            .load(targets(&lk, plan.load_clients), &config)
            .await?;
        anyhow::ensure!(
            load.errors_count == 0,
            "the cost group's load failed {} inserts",
            load.errors_count
        );
        // Writeback done on every backup, so SSD holds the shard and the buffers are drained.
        let t0 = Instant::now();
        loop {
            let st = statuses(&lk).await;
            let all: Vec<StatusReport> = st
                .into_iter()
                .map(|(i, r)| r.map_err(|e| anyhow::anyhow!("node {i}: {e}")))
                .collect::<anyhow::Result<_>>()?;
            // ... and the primary serves with its whole table: a spurious election under the
            // load makes a witness lead, and its table is full only when its recovery ends.
            let leader_full = all.iter().any(|s| {
                s.role == "leader" && s.serving && !s.recovering && s.values >= plan.records
            });
            let done = leader_full
                && all
                    .iter()
                    .filter(|s| s.kind == "backup")
                    .all(|s| s.written_back_through >= s.commit && s.keys >= plan.records);
            if done {
                return anyhow::Ok(all);
            }
            anyhow::ensure!(
                t0.elapsed() < SETTLE_MAX,
                "the cost group's backups did not write back within {SETTLE_MAX:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    lk.stop();
    r
}

/// The ratios under issue 25's exact names, over the headline cells (least favourable cell),
/// each cell's own beside it, the offline bound and the cost estimate.
fn headline_ratios(
    report: &mut bench::Report,
    cells: &[(Cell, Vec<(&'static str, Derived)>)],
    shard_mib: u64,
    value_bytes: usize,
    seq_read_mib_per_s: f64,
    live: anyhow::Result<Vec<StatusReport>>,
    rss_worst: Option<(f64, String)>,
) -> anyhow::Result<()> {
    let get = |schemes: &[(&'static str, Derived)], name: &str| {
        schemes
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, d)| d.clone())
    };
    type Pick = fn(&Derived) -> Option<f64>;
    let ttr999: Pick = |d| at_multiple(&d.p999, HEADLINE_P999);
    let ttr50: Pick = |d| at_multiple(&d.p50, HEADLINE_P50);
    let copy: Pick = |d| d.full_copy_s;
    // (name, numerator scheme, pick, denominator scheme, pick, the larger value is the worse)
    let specs: [(&str, &str, Pick, &str, Pick, bool); 4] = [
        (
            "offline_vs_cand.ttr_p999",
            "offline",
            ttr999,
            "cand",
            ttr999,
            false,
        ),
        (
            "offline_vs_cand.ttr_p50",
            "offline",
            ttr50,
            "cand",
            ttr50,
            false,
        ),
        (
            "cand_vs_offline.full_copy_time",
            "cand",
            copy,
            "offline",
            copy,
            true,
        ),
        (
            "cand_vs_steady.throughput_after_election",
            "cand",
            |d| d.after_election_ops_per_s,
            "cand",
            |d| d.steady_ops_per_s,
            false,
        ),
    ];
    for (name, num_scheme, num, den_scheme, den, larger_worse) in specs {
        let mut worst: Option<f64> = None;
        let mut missing = None;
        for (cell, schemes) in cells {
            let cell_name = format!("{}.{name}", cell.label());
            let pair = (get(schemes, num_scheme), get(schemes, den_scheme));
            let value = match pair {
                (None, _) | (_, None) => {
                    Err(format!("scheme {} did not run (see absent scheme.*)", if pair.0.is_none() { num_scheme } else { den_scheme }))
                }
                (Some(n), Some(d)) => match (num(&n), den(&d)) {
                    (Some(x), Some(y)) if y > 0.0 => Ok((x, y)),
                    (x, y) => Err(format!(
                        "{}: a figure is missing (never recovered, or not seen before the run                          ended) or zero: {num_scheme} {x:?}, {den_scheme} {y:?}",
                        cell.label()
                    )),
                },
            };
            match value {
                Ok((x, y)) => {
                    let r = report.ratio(&cell_name, x, y)?;
                    worst = Some(match worst {
                        None => r,
                        Some(w) if larger_worse => w.max(r),
                        Some(w) => w.min(r),
                    });
                }
                Err(why) => {
                    report.absent(&cell_name, &why);
                    missing.get_or_insert(why);
                }
            }
        }
        match (missing, worst) {
            (None, Some(w)) => {
                report.ratio(name, w, 1.0)?;
            }
            (Some(why), _) => {
                report.absent(name, &format!("{why} (needed for every headline cell)"))
            }
            (None, None) => report.absent(name, "no headline cell ran"),
        }
    }

    // The paper-style offline bound: the shard's bytes at this disk's best sequential read.
    let logical = (shard_mib << 20) as f64;
    let bound_s = logical / (seq_read_mib_per_s * (1 << 20) as f64);
    report.figure("offline_bound.shard_bytes", logical)?;
    report.figure("offline_bound.full_copy_s", bound_s)?;
    // The slowest headline cell's full copy, if every one ended.
    let copies: Option<Vec<f64>> = cells
        .iter()
        .map(|(_, s)| get(s, "cand").and_then(|d| d.full_copy_s))
        .collect();
    match copies.filter(|c| !c.is_empty()) {
        Some(c) => {
            let slowest = c.into_iter().fold(0.0, f64::max);
            report.ratio("cand_vs_offline_bound.full_copy_time", slowest, bound_s)?;
        }
        None => report.absent(
            "cand_vs_offline_bound.full_copy_time",
            "cand's full copy did not end within a headline run",
        ),
    }

    // Cost: from the tier bytes the N = 2 group's nodes reported live; the spec's estimate
    // only if that group could not be measured, and then said so.
    let records = ((shard_mib << 20) / (value_bytes as u64 + KEY_BYTES_ESTIMATE)).max(1);
    let logical = records * (value_bytes as u64 + KEY_BYTES_ESTIMATE);
    let live_group = live.and_then(|reports| {
        for r in &reports {
            let t = &r.tiers;
            let name = |f: &str| format!("cost.n2.node{}.{f}", r.id);
            report.figure(&name("tier_dram_bytes"), t.dram_bytes() as f64)?;
            report.figure(&name("tier_nvmm_bytes"), t.nvmm_bytes() as f64)?;
            report.figure(&name("tier_ssd_bytes"), t.ssd_bytes() as f64)?;
            let private = r.rss_bytes.saturating_sub(r.rss_shared_bytes);
            report.figure(&name("rss_private_bytes"), private as f64)?;
            if t.in_heap_bytes() > 0 && private > 0 {
                report.ratio(
                    &name("rss_vs_tier.bytes"),
                    private as f64,
                    t.in_heap_bytes() as f64,
                )?;
            }
        }
        cost::group_from_reports(&reports, logical)
    });
    let comparison = match live_group {
        Ok(group) => {
            report.figure("cost.n2.logical_bytes", logical as f64)?;
            let c = cost::compare(&group, &PAPER_PRICES)?;
            report.figure("cost.n2.cand_usd_per_gb_ratio", c.cand_usd_per_gb)?;
            c
        }
        Err(e) => {
            let estimate = LayoutEstimate {
                key_bytes: KEY_BYTES_ESTIMATE,
                value_bytes: value_bytes as u64,
                ..LayoutEstimate::SPEC_1KIB_N2
            };
            let c = cost::compare(&estimate.group(records), &PAPER_PRICES)?;
            report.figure("cost.estimate.cand_usd_per_gb_ratio", c.cand_usd_per_gb)?;
            report.absent(
                "cost.live_tier_bytes",
                &format!(
                    "the N = 2 group's live tier bytes could not be read ({e:#}): the cost_per_gb \
                     ratios are eval::kv::cost's spec ESTIMATE (N = 2 layout, this run's key and value \
                     sizes, the paper's prices)"
                ),
            );
            c
        }
    };
    for (name, value) in comparison.ratios() {
        report.ratio(name, value, 1.0)?;
    }
    // Node RSS against accounted tier bytes: the worst node of cand's headline runs.
    match rss_worst {
        Some((ratio, at)) => {
            eprintln!("kv ttr: the highest private RSS over accounted bytes: {ratio:.2} at {at}");
            report.ratio("node_rss_vs_tier.bytes", ratio, 1.0)?;
        }
        None => report.absent(
            "node_rss_vs_tier.bytes",
            "no cand run of a headline cell returned node statuses",
        ),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_millis(100);

    /// Windows of `p999` µs each (`None`: nothing completed), p50 a tenth of it.
    fn windows(p999s: &[Option<u64>]) -> Vec<WindowStats> {
        p999s
            .iter()
            .enumerate()
            .map(|(i, &p)| WindowStats {
                start: W * i as u32,
                end: W * (i as u32 + 1),
                count: if p.is_some() { 100 } else { 0 },
                ops_per_s: if p.is_some() { 1000.0 } else { 0.0 },
                p50_us: p.map(|v| v / 10),
                p99_us: p,
                p999_us: p,
                max_us: p,
            })
            .collect()
    }

    #[test]
    fn derived_figures_come_from_the_windows() {
        // 2 s steady at 100 µs, the kill at 2.0 s, 0.5 s of nothing, 0.5 s at 1000 µs, then
        // steady again: TTR at 4× (400 µs) ends with the first good window after 3.0 s.
        let mut p: Vec<Option<u64>> = vec![Some(100); 20];
        p.extend([None; 5]);
        p.extend([Some(1000); 5]);
        p.extend([Some(100); 10]);
        let r = RunOut {
            windows: windows(&p),
            failure: Duration::from_secs(2),
            election: Some(Duration::from_millis(2300)),
            recovered: Some(Duration::from_millis(3500)),
            load_ops_per_s: 1.0,
            rss: vec![],
            status_loaded: vec![],
            status_recovered: vec![],
            errors: 0,
            reads_problem: None,
            warmup_elections: 0,
        };
        let d = derive(&r);
        assert_eq!(d.steady_p999_us, Some(100.0));
        assert_eq!(d.steady_p50_us, Some(10.0));
        let ttr4 = at_multiple(&d.p999, 4.0).unwrap();
        assert!((ttr4 - 1.1).abs() < 1e-9, "{ttr4}");
        // 16× = 1600 µs: the slow windows are in SLO, the empty ones are not.
        let ttr16 = at_multiple(&d.p999, 16.0).unwrap();
        assert!((ttr16 - 0.6).abs() < 1e-9, "{ttr16}");
        assert!((d.election_s.unwrap() - 0.3).abs() < 1e-9);
        assert!((d.full_copy_s.unwrap() - 1.5).abs() < 1e-9);
        // The 2 s after the election (2.3 s) hold the whole windows 2.3–4.0 s (the run ends at
        // 4.0): two empty, then 15 busy.
        let after = d.after_election_ops_per_s.unwrap();
        assert!((after - 1000.0 * 15.0 / 17.0).abs() < 1e-6, "{after}");
        assert_eq!(d.steady_ops_per_s, Some(1000.0));
    }

    #[test]
    fn a_run_that_never_recovers_is_missing_not_a_number() {
        let mut p: Vec<Option<u64>> = vec![Some(100); 20];
        p.extend([None; 10]);
        let r = RunOut {
            windows: windows(&p),
            failure: Duration::from_secs(2),
            election: None,
            recovered: None,
            load_ops_per_s: 1.0,
            rss: vec![],
            status_loaded: vec![],
            status_recovered: vec![],
            errors: 0,
            reads_problem: None,
            warmup_elections: 0,
        };
        let d = derive(&r);
        assert!(d.p999.iter().all(|(_, t)| t.is_none()));
        assert_eq!(d.election_s, None);
        assert_eq!(median(&[Some(1.0), None, Some(3.0)]), Some(3.0));
        assert_eq!(median(&[Some(1.0), None, None]), None);
        assert_eq!(median(&[Some(2.0)]), Some(2.0));
    }

    #[test]
    fn a_scheme_kv_up_refuses_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let bogus = Scheme {
            name: "bogus",
            up_args: &["--recovery", "no-such-recovery"],
        };
        let e = format!("{:#}", group_args(dir.path(), &bogus).unwrap_err());
        assert!(
            e.contains("scheme bogus") && e.contains("refuses `--recovery no-such-recovery`"),
            "{e}"
        );
        let cand = group_args(dir.path(), scheme("cand").unwrap()).unwrap();
        assert_eq!((cand.backups, cand.witnesses), (1, 1));
        let np = group_args(dir.path(), scheme("no-proactive").unwrap()).unwrap();
        assert_eq!(np.soft_timeout_ms, Some(0));
    }

    #[test]
    fn every_scheme_has_up_arguments_and_names_are_figure_segments() {
        for s in SCHEMES {
            assert!(
                bench::check_figure_name(&format!("c.{}.full_copy_s", s.name)).is_ok(),
                "{}",
                s.name
            );
        }
        assert!(scheme("nope")
            .unwrap_err()
            .to_string()
            .contains("cand, offline"));
        assert_eq!(multiple_label(1.5), "x1_5");
        assert_eq!(
            Cell {
                workload: "c",
                theta: 0.99,
                value_bytes: 1024
            }
            .label(),
            "c.theta0_99.v1024"
        );
        for m in P999_MULTIPLES.iter().chain(P50_MULTIPLES) {
            let name = format!(
                "c.theta0_99.v1024.cand.slo_p999_{}.ttr_s",
                multiple_label(*m)
            );
            assert!(bench::check_figure_name(&name).is_ok(), "{name}");
        }
    }
}
