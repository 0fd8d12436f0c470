//! `understudy bench kv ycsb`: YCSB workloads A–F and the TAO-like mix through the project's
//! own driver (crate `ycsb`) against a local HEAL KV group (HEAL §IX uses YCSB with zipfian
//! keys and TAOBench), optionally with one node killed mid-run and restarted on its log, so the
//! throughput timeline shows HEAL's recovery under load.
//!
//! [`HealTarget`] is the `ycsb::KvTarget` of the KV store: each closed-loop client has its own
//! connection to one node, which coordinates its writes (leaderless: any node does), and moves
//! to the next node when its node refuses (not serving, e.g. recovering) or is unreachable.
//! Also home to the helpers the ZooKeeper comparison ([`super::zookeeper`]) shares: starting a group
//! through `kv up`'s own argument parser, and timing a restarted node until it serves.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Parser};

use ::kv::leaderless::proto::{ClientOp, ClientResult};
use ::kv::leaderless::driver::KvClient;
use ycsb::{KvTarget, PhaseSummary, RunConfig, Runner, TargetError, WorkloadSpec};

use testbed::kv::{wait_all_serving, LocalKv, UpArgs};

// ------------------------------------------------------------------------------ target

/// One YCSB client's connection to the group.
pub struct HealTarget {
    addrs: Arc<Vec<SocketAddr>>,
    secret: Arc<Vec<u8>>,
    node: usize,
    conn: Option<KvClient>,
    /// Wait for one answer before trying another node.
    pub request_timeout: Duration,
    /// Give up on an operation (an error for the runner) after retrying this long.
    pub retry_for: Duration,
}

impl HealTarget {
    /// A client whose first node is `addrs[home % len]`; it connects on first use.
    pub fn new(addrs: Arc<Vec<SocketAddr>>, secret: Arc<Vec<u8>>, home: usize) -> HealTarget {
        let node = home % addrs.len().max(1);
        HealTarget {
            addrs,
            secret,
            node,
            conn: None,
            request_timeout: Duration::from_secs(2),
            retry_for: Duration::from_secs(30),
        }
    }

    fn next_node(&mut self) {
        self.conn = None;
        self.node = (self.node + 1) % self.addrs.len();
    }

    /// Runs `op`, moving to another node while nodes refuse it or are unreachable. A write
    /// whose answer was lost is sent again (to another node) with the same value: every value
    /// the driver writes for a key is valid for it, so a duplicate does not upset the checks.
    async fn op(&mut self, op: ClientOp) -> Result<ClientResult, TargetError> {
        let start = Instant::now();
        let mut last = String::new();
        loop {
            if self.conn.as_ref().is_none_or(|c| c.is_closed()) {
                match KvClient::connect(self.addrs[self.node], &self.secret).await {
                    Ok(mut c) => {
                        c.timeout = self.request_timeout;
                        self.conn = Some(c);
                    }
                    Err(e) => {
                        last = format!("{}: {e}", self.addrs[self.node]);
                        self.next_node();
                    }
                }
            }
            if let Some(c) = &self.conn {
                match c.call(op.clone()).await {
                    Ok(ClientResult::NotServing) => {
                        last = format!("{} not serving", self.addrs[self.node]);
                        self.next_node();
                    }
                    Ok(ClientResult::Busy) => last = format!("{} busy", self.addrs[self.node]),
                    Ok(ClientResult::Invalid(e)) => return Err(TargetError::Store(e)),
                    Ok(r) => return Ok(r),
                    Err(e) => {
                        last = format!("{}: {e}", self.addrs[self.node]);
                        self.next_node();
                    }
                }
            }
            if start.elapsed() > self.retry_for {
                return Err(TargetError::Io(format!(
                    "no node answered within {:?}; last: {last}",
                    self.retry_for
                )));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

impl KvTarget for HealTarget {
    fn name(&self) -> &'static str {
        "heal-kv"
    }

    async fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, TargetError> {
        match self.op(ClientOp::Get { key: key.to_vec() }).await? {
            ClientResult::Value(v) => Ok(v),
            other => Err(TargetError::Store(format!(
                "unexpected answer to a get: {other:?}"
            ))),
        }
    }

    async fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), TargetError> {
        match self
            .op(ClientOp::Put {
                key: key.to_vec(),
                value: value.to_vec(),
                scope: None,
            })
            .await?
        {
            ClientResult::Done => Ok(()),
            other => Err(TargetError::Store(format!(
                "unexpected answer to a put: {other:?}"
            ))),
        }
    }
}

// ------------------------------------------------------------------------------ shared helpers

/// `kv up`'s arguments for a throw-away group in `dir` on free ports, no automatic restarts,
/// plus `extra` flags — parsed by `kv up`'s own parser, so its defaults apply to the rest.
pub(crate) fn up_args(dir: &Path, nodes: u32, extra: &[String]) -> anyhow::Result<UpArgs> {
    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        up: UpArgs,
    }
    let mut argv: Vec<String> = ["up", "--dir"].map(String::from).to_vec();
    argv.push(dir.to_string_lossy().into_owned());
    argv.extend([
        "--nodes".to_string(),
        nodes.to_string(),
        "--port-base".into(),
        "0".into(),
        "--restart-after-ms".into(),
        "0".into(),
    ]);
    argv.extend(extra.iter().cloned());
    Ok(Wrap::try_parse_from(argv)
        .map_err(|e| anyhow::anyhow!("kv group arguments: {e}"))?
        .up)
}

/// A fresh directory for a benchmark group under ./target/bench-clusters (a real disk: the
/// nodes' logs must really be synced).
pub(crate) fn bench_dir(prefix: &str) -> anyhow::Result<tempfile::TempDir> {
    let work = std::env::current_dir()?
        .join("target")
        .join("bench-clusters");
    std::fs::create_dir_all(&work).with_context(|| format!("cannot create {}", work.display()))?;
    Ok(tempfile::Builder::new().prefix(prefix).tempdir_in(&work)?)
}

/// Polls node `addr` until it serves a read itself; returns when it did. A recovering node
/// (HEAL's ShadowReplica) answers NotServing until its Recov_end.
pub(crate) async fn wait_node_serving(
    addr: SocketAddr,
    secret: &[u8],
    timeout: Duration,
) -> anyhow::Result<Instant> {
    Ok(wait_node_listening_then_serving(addr, secret, timeout).await?.1)
}

/// Like [`wait_node_serving`], also returning when the node first accepted a connection (it
/// listens before it serves: the gap is its recovery as clients see it).
pub(crate) async fn wait_node_listening_then_serving(
    addr: SocketAddr,
    secret: &[u8],
    timeout: Duration,
) -> anyhow::Result<(Instant, Instant)> {
    let start = Instant::now();
    let mut listening = None;
    loop {
        if let Ok(mut c) = KvClient::connect(addr, secret).await {
            let listening = *listening.get_or_insert_with(Instant::now);
            c.timeout = Duration::from_secs(1);
            loop {
                match c
                    .call(ClientOp::Get {
                        key: b"__understudy_ready".to_vec(),
                    })
                    .await
                {
                    Ok(ClientResult::Value(_)) => return Ok((listening, Instant::now())),
                    Ok(_) => {}
                    Err(_) => break,
                }
                anyhow::ensure!(
                    start.elapsed() < timeout,
                    "node {addr} did not serve within {timeout:?}"
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        anyhow::ensure!(
            start.elapsed() < timeout,
            "node {addr} did not serve within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A recovered node's report of its HEAL recovery (its `recovered` event), if it made one.
#[derive(Clone, Debug, Default)]
pub(crate) struct RecoveryLine {
    pub total_ms: Option<f64>,
    pub start_to_ack_us: Option<f64>,
    pub catchup_to_resp_us: Option<f64>,
    pub apply_to_end_us: Option<f64>,
}

/// The complete lines of a log read while its node may still be writing: up to the last newline
/// (a node writes a long line to stderr in several pieces, so a reader can catch half of one).
pub(crate) fn complete_lines(text: &str) -> &str {
    &text[..text.rfind('\n').map_or(0, |i| i + 1)]
}

/// The last recovery node `i` of group directory `dir` reported in its events file after byte
/// `from` (see [`log_len`]).
pub(crate) fn recovery_line(dir: &Path, i: usize, from: u64) -> Option<RecoveryLine> {
    let r = match crate::kv::last_recovery(&crate::kv::events_path(dir, i), from) {
        Ok(r) => r?,
        Err(e) => {
            eprintln!("warning: {e:#}");
            return None;
        }
    };
    let us = |v: u64| Some(v as f64);
    Some(RecoveryLine {
        total_ms: Some(r.total_us as f64 / 1000.0),
        start_to_ack_us: us(r.stats.start_to_ack_us),
        catchup_to_resp_us: us(r.stats.catchup_to_resp_us),
        apply_to_end_us: us(r.stats.apply_to_end_us),
    })
}

/// Size of node `i`'s events file so far (to read only what a restart adds).
pub(crate) fn log_len(dir: &Path, i: usize) -> u64 {
    std::fs::metadata(crate::kv::events_path(dir, i))
        .map(|m| m.len())
        .unwrap_or(0)
}

// ------------------------------------------------------------------------------ benchmark

#[derive(Args, Debug)]
pub struct KvYcsbArgs {
    /// Workload: a (50/50 read/update), b (95/5), c (read only), d (read latest), f
    /// (read-modify-write), or tao (social graph, 80 % reads). E needs ordered scans, which the
    /// KV store does not offer.
    #[arg(long, default_value = "b")]
    pub workload: String,
    /// Closed-loop clients, each with one request in flight on its own connection; client i
    /// starts on node i mod N.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// A short run (well under a minute) that still measures every figure.
    #[arg(long)]
    pub quick: bool,
    /// Where plots (SVG, PNG) and raw samples (CSV) go [default: target/bench/kv].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Nodes in the group.
    #[arg(long, default_value_t = 5)]
    pub nodes: u32,
    /// Persistency model of the group: synch, strict, read-enforced, eventual or scope.
    #[arg(long, default_value = "synch")]
    pub model: String,
    /// Records loaded before the run [default: 100000; 2000 with --quick].
    #[arg(long)]
    pub records: Option<u64>,
    /// Operations of the run phase [default: 1000000, or unbounded with --kill-at-s; 20000 with
    /// --quick].
    #[arg(long)]
    pub operations: Option<u64>,
    /// Stop the run phase after this many seconds [default: 60; 10 with --quick].
    #[arg(long)]
    pub duration_s: Option<u64>,
    #[command(flatten)]
    pub shape: crate::ycsb::WorkloadArgs,
    /// Kill the last node with SIGKILL this many seconds into the run phase, restart it on its
    /// log after --down-s, and measure until it serves again (HEAL recovery under load).
    #[arg(long)]
    pub kill_at_s: Option<f64>,
    /// How long the killed node stays down (the EFN period), in seconds.
    #[arg(long, default_value_t = 2.0)]
    pub down_s: f64,
    /// Failure detection timeout of the CM.
    #[arg(long, default_value_t = 1500)]
    pub failure_timeout_ms: u64,
    /// Read lease of the CM and nodes (below --failure-timeout-ms).
    #[arg(long, default_value_t = 800)]
    pub lease_ms: u64,
}

fn build_spec(a: &KvYcsbArgs) -> anyhow::Result<WorkloadSpec> {
    let mut spec = WorkloadSpec::by_name(&a.workload)?;
    anyhow::ensure!(
        !spec.has_scans(),
        "workload {} issues scans, and the HEAL KV store keeps no key order to scan; use a, b, c, d, f or tao",
        a.workload
    );
    spec.record_count = a.records.unwrap_or(if a.quick { 2_000 } else { 100_000 });
    let default_ops = match (a.quick, a.kill_at_s.is_some()) {
        (true, _) => 20_000,
        // The duration bounds a run with a failure; the count only sizes the key space.
        (false, true) => 100_000_000,
        (false, false) => 1_000_000,
    };
    spec.operation_count = Some(a.operations.unwrap_or(default_ops));
    a.shape.apply(spec)
}

/// When the failure happened, relative to the start of the run phase.
struct FaultTimes {
    kill_s: f64,
    restart_s: f64,
    serving_s: f64,
    recovery: Option<RecoveryLine>,
}

pub fn bench(a: KvYcsbArgs, _verbose: u8) -> anyhow::Result<()> {
    anyhow::ensure!(a.clients >= 1, "--clients must be at least 1");
    anyhow::ensure!(
        (3..=16).contains(&a.nodes),
        "--nodes must be between 3 and 16"
    );
    let spec = build_spec(&a)?;
    let mut duration_s = a.duration_s.unwrap_or(if a.quick { 10 } else { 60 }) as f64;
    if let Some(k) = a.kill_at_s {
        anyhow::ensure!(
            k > 0.0 && a.down_s >= 0.0,
            "--kill-at-s must be positive and --down-s not negative"
        );
        if a.quick && a.duration_s.is_none() {
            duration_s = duration_s.max(k + a.down_s + 4.0);
        }
        anyhow::ensure!(
            k + a.down_s + 1.0 < duration_s,
            "the run ({duration_s} s) must outlast the kill at {k} s plus {} s down by more than a second; raise --duration-s",
            a.down_s
        );
    }
    let out = bench::out_dir("kv", a.out.clone())?;
    let tmp = bench_dir("understudy-kv-ycsb-")?;
    let dir = tmp.path().to_path_buf();
    let extra: Vec<String> = [
        "--model",
        &a.model,
        "--failure-timeout-ms",
        &a.failure_timeout_ms.to_string(),
        "--lease-ms",
        &a.lease_ms.to_string(),
    ]
    .map(String::from)
    .to_vec();
    let up = up_args(&dir, a.nodes, &extra)?;
    let mut lk = LocalKv::start(&up)?;
    let addrs: Arc<Vec<SocketAddr>> = Arc::new(lk.file.nodes.values().copied().collect());
    let secret = Arc::new(lk.secret.clone());
    let victim = a.nodes as usize - 1;
    let config = RunConfig {
        seed: a.shape.seed,
        max_duration: Some(Duration::from_secs_f64(duration_s)),
        // Through a failure, operations that time out are counted, not fatal.
        max_errors: if a.kill_at_s.is_some() {
            u64::MAX
        } else {
            1000
        },
        ..RunConfig::default()
    };
    eprintln!(
        "kv ycsb {}: {} nodes ({}), {} records of {} bytes, at most {} operations in {duration_s} s, {} clients{}",
        spec.name,
        a.nodes,
        a.model,
        spec.record_count,
        spec.value_size_bytes(),
        spec.operation_count.unwrap_or(0),
        a.clients,
        a.kill_at_s.map(|k| format!(", node {victim} killed at {k} s for {} s", a.down_s)).unwrap_or_default()
    );
    let clients = a.clients;
    let runner = Runner::new(spec)?;
    let rt = crate::runtime()?;
    let result = rt.block_on(async {
        wait_all_serving(&lk.file, &lk.secret, Duration::from_secs(120)).await?;
        let targets: Vec<HealTarget> = (0..clients)
            .map(|i| HealTarget::new(addrs.clone(), secret.clone(), i))
            .collect();
        let (targets, load) = runner.load(targets, &config).await?;
        eprintln!(
            "load: {} inserts in {:.1} s",
            load.completed_ops(),
            load.elapsed.as_secs_f64()
        );
        let t0 = Instant::now();
        let fault = async {
            let Some(kill_at) = a.kill_at_s else {
                return Ok(None);
            };
            tokio::time::sleep(Duration::from_secs_f64(kill_at)).await;
            let log_from = log_len(&dir, victim);
            lk.kill9(victim)?;
            let kill_s = t0.elapsed().as_secs_f64();
            eprintln!("node {victim} killed at {kill_s:.2} s");
            tokio::time::sleep(Duration::from_secs_f64(a.down_s)).await;
            lk.restart_node(victim)?;
            let restarted = Instant::now();
            let restart_s = t0.elapsed().as_secs_f64();
            let serving =
                wait_node_serving(addrs[victim], &secret, Duration::from_secs(120)).await?;
            let serving_s = serving.duration_since(t0).as_secs_f64();
            eprintln!(
                "node {victim} restarted at {restart_s:.2} s, serving again after {:.1} ms",
                serving.duration_since(restarted).as_secs_f64() * 1000.0
            );
            // The node prints its recovery line when it ends the recovery; give it a moment.
            let mut recovery = None;
            for _ in 0..100 {
                recovery = recovery_line(&dir, victim, log_from);
                if recovery.is_some() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            anyhow::Ok(Some(FaultTimes {
                kill_s,
                restart_s,
                serving_s,
                recovery,
            }))
        };
        let (run, fault) = tokio::join!(runner.run(targets, &config), fault);
        let (_, run) = run?;
        let fault = fault?;
        eprintln!(
            "run: {} operations in {:.1} s ({:.0} ops/s), {} errors",
            run.completed_ops(),
            run.elapsed.as_secs_f64(),
            run.throughput_ops_per_s(),
            run.errors_count
        );
        anyhow::Ok((load, run, fault))
    });
    let rss = lk.pid(0).and_then(testbed::proc::rss_bytes).unwrap_or(0);
    lk.stop();
    let (load, run, fault) = match result {
        Ok(r) => r,
        Err(e) => {
            let kept = tmp.keep();
            return Err(e.context(format!("logs kept in {}/logs", kept.display())));
        }
    };

    let prefix = format!("heal.{}.c{clients}", runner.spec().name);
    let mut report = bench::Report::new("kv.ycsb", a.quick);
    load.add_to_report(&format!("{prefix}.load"), &mut report)?;
    run.add_to_report(&format!("{prefix}.run"), &mut report)?;
    report.figure("node0.rss_bytes", rss as f64)?;
    if let Some(f) = &fault {
        add_fault_figures(&mut report, f, &run)?;
    }
    let marks: Vec<(String, f64)> = fault
        .as_ref()
        .map(|f| {
            vec![
                ("node killed".to_string(), f.kill_s),
                ("node restarted".to_string(), f.restart_s),
                ("node serving again".to_string(), f.serving_s),
            ]
        })
        .unwrap_or_default();
    crate::ycsb::write_samples(&out, &prefix, &run, &marks)?;
    eprintln!("plots and samples in {}", out.display());
    report.print();
    crate::ycsb::ensure_reads_checked(&load, &run)
}

/// Mean throughput of the complete windows between `from_s` and `to_s`.
fn mean_rate(rates: &[f64], window_s: f64, from_s: f64, to_s: f64) -> Option<f64> {
    let first = (from_s / window_s).ceil() as usize;
    let last = ((to_s / window_s).floor() as usize).min(rates.len());
    (first < last).then(|| rates[first..last].iter().sum::<f64>() / (last - first) as f64)
}

fn add_fault_figures(
    report: &mut bench::Report,
    f: &FaultTimes,
    run: &PhaseSummary,
) -> anyhow::Result<()> {
    report.figure("kill.at_s", f.kill_s)?;
    report.figure("kill.down_s", f.restart_s - f.kill_s)?;
    report.figure(
        "kill.restart_to_serving_ms",
        (f.serving_s - f.restart_s) * 1000.0,
    )?;
    if let Some(r) = &f.recovery {
        for (name, v) in [
            ("kill.heal.recovery_latency_ms", r.total_ms),
            ("kill.heal.start_to_ack_us", r.start_to_ack_us),
            ("kill.heal.catchup_to_resp_us", r.catchup_to_resp_us),
            ("kill.heal.apply_to_end_us", r.apply_to_end_us),
        ] {
            if let Some(v) = v {
                report.figure(name, v)?;
            }
        }
    }
    let rates = run.window_ops_per_s();
    let w = run.window.as_secs_f64();
    let end = rates.len() as f64 * w;
    let spans = [
        (
            "kill.before.throughput_ops_per_s",
            (f.kill_s - 2.0).max(0.0),
            f.kill_s,
        ),
        ("kill.down.throughput_ops_per_s", f.kill_s, f.restart_s),
        (
            "kill.recovering.throughput_ops_per_s",
            f.restart_s,
            f.serving_s,
        ),
        ("kill.after.throughput_ops_per_s", f.serving_s + 0.5, end),
    ];
    for (name, from, to) in spans {
        if let Some(v) = mean_rate(&rates, w, from, to) {
            report.figure(name, v)?;
        }
    }
    Ok(())
}

