//! `understudy bench kv zookeeper`: a real ZooKeeper 3-server ensemble (Debian's `zookeeper`)
//! beside a local HEAL KV group, each losing one replica for the same EFN under the same fixed
//! write rate (HEAL §IX-D, Fig. 9). Measured per system: the catch-up time of the replica from
//! its restart until it serves the latest state, split into restart → listening and
//! listening → caught up.
//!
//! * ZooKeeper: a follower is killed (or stopped); on restart it elects, reports its last zxid
//!   to the leader and is synchronised from the leader's log (reactive, §II-C). It has caught
//!   up when `srvr` on it reports a zxid at least the leader's (the leader is polled first).
//! * HEAL: the last node is killed (or stopped); on restart the CM re-admits it and it
//!   recovers through HEAL as a ShadowReplica, answering NotServing until Recov_end. It has
//!   caught up when it serves a read itself (reads are linearizable, so it serves the latest).
//!   The recovery latency the node reports (re-admission → Recov_end) is recorded too.
//!
//! Writes go to the surviving replicas only (open loop at --write-rate, up to --max-inflight in
//! flight; a write that finds no free slot is counted as skipped), so both systems see the same
//! stream. Rounds of the two systems alternate.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, ValueEnum};

use ::kv::leaderless::driver::KvCluster;
use bench::LatencyRecorder;
use zk::{srvr, Ensemble, EnsembleOptions, ServerState, ZkClient};

use testbed::kv::{wait_all_serving, LocalKv};
use super::ycsb::{bench_dir, log_len, recovery_line, up_args};

/// Throughput windows.
const WINDOW: Duration = Duration::from_millis(100);
/// Longest run the window array covers.
const WINDOWS_MAX: usize = 100_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Fault {
    /// SIGKILL, then the process is started again on its durable state.
    Kill,
    /// SIGSTOP, then SIGCONT (no process start in the measurement).
    Stop,
}

#[derive(Args, Debug)]
pub struct KvZkArgs {
    /// A short run (under a minute) that still measures every figure.
    #[arg(long)]
    pub quick: bool,
    /// Where plots (SVG, PNG) and raw samples (CSV) go [default: target/bench/kv].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Time the replica stays down (the EFN period), in seconds [default: 60; 3 with --quick].
    #[arg(long)]
    pub efn_s: Option<f64>,
    /// Fixed write rate offered to both systems (writes per second).
    #[arg(long, default_value_t = 200)]
    pub write_rate: u64,
    /// Writes in flight at most; a write due while all are busy is skipped (and counted).
    #[arg(long, default_value_t = 256)]
    pub max_inflight: usize,
    /// Keys (znodes) written round robin.
    #[arg(long, default_value_t = 1000)]
    pub keys: u64,
    /// Bytes per written value.
    #[arg(long, default_value_t = 256)]
    pub value_bytes: usize,
    /// Rounds per system, alternating [default: 2; 1 with --quick].
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Nodes of the HEAL group (ZooKeeper always runs 3 servers).
    #[arg(long, default_value_t = 3)]
    pub nodes: u32,
    /// How the replica fails.
    #[arg(long, value_enum, default_value = "kill")]
    pub fault: Fault,
    /// Writes before the failure, in seconds [default: 5; 2 with --quick].
    #[arg(long)]
    pub warmup_s: Option<f64>,
    /// Failure detection timeout of the HEAL group's CM (its read lease is half of it). Writes
    /// stall from the failure until the CM removes the node (all live replicas must ACK).
    #[arg(long, default_value_t = 1000)]
    pub failure_timeout_ms: u64,
    /// Persistency model of the HEAL group (synch: every replica persists before a write is
    /// acknowledged, as ZooKeeper's quorum fsyncs its log).
    #[arg(long, default_value = "synch")]
    pub model: String,
}

/// One system's writes: a HEAL client over the surviving nodes, or ZooKeeper sessions on the
/// surviving servers (round robin).
#[derive(Clone)]
enum Writer {
    Heal(KvCluster),
    Zk(Arc<Vec<ZkClient>>),
}

impl Writer {
    async fn write(&self, n: u64, key: u64, value: &[u8]) -> anyhow::Result<()> {
        match self {
            Writer::Heal(c) => Ok(c.put(format!("k{key:08}").as_bytes(), value).await?),
            Writer::Zk(cs) => {
                let c = &cs[(n % cs.len() as u64) as usize];
                c.set_data(&format!("/understudy/k{key:08}"), value).await?;
                Ok(())
            }
        }
    }

    /// Creates every key (znodes must exist before setData).
    async fn setup(&self, keys: u64, value: &[u8]) -> anyhow::Result<()> {
        if let Writer::Zk(cs) = self {
            cs[0].upsert("/understudy", b"").await?;
        }
        let next = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let (w, next, value) = (self.clone(), next.clone(), value.to_vec());
            tasks.push(tokio::spawn(async move {
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    if k >= keys {
                        return anyhow::Ok(());
                    }
                    match &w {
                        Writer::Heal(_) => w.write(k, k, &value).await?,
                        Writer::Zk(cs) => {
                            cs[(k % cs.len() as u64) as usize]
                                .upsert(&format!("/understudy/k{k:08}"), &value)
                                .await?;
                        }
                    }
                }
            }));
        }
        for t in tasks {
            t.await??;
        }
        Ok(())
    }
}

/// What the open-loop driver saw.
struct Load {
    start: Instant,
    stop: AtomicBool,
    windows: Vec<AtomicU64>,
    latency: Mutex<LatencyRecorder>,
    done: AtomicU64,
    errors: AtomicU64,
    skipped: AtomicU64,
    first_error: Mutex<Option<String>>,
}

impl Load {
    fn completed_between(&self, from: Duration, to: Duration) -> u64 {
        let (a, b) = (
            (from.as_millis() / WINDOW.as_millis()) as usize,
            (to.as_millis() / WINDOW.as_millis()) as usize,
        );
        self.windows[a.min(WINDOWS_MAX)..b.min(WINDOWS_MAX)]
            .iter()
            .map(|w| w.load(Ordering::Relaxed))
            .sum()
    }
}

/// Offers `rate` writes per second to `writer` until `load.stop`.
fn drive(
    writer: Writer,
    rate: u64,
    keys: u64,
    value_bytes: usize,
    inflight: usize,
) -> (Arc<Load>, tokio::task::JoinHandle<()>) {
    let load = Arc::new(Load {
        start: Instant::now(),
        stop: AtomicBool::new(false),
        windows: (0..WINDOWS_MAX).map(|_| AtomicU64::new(0)).collect(),
        latency: Mutex::new(LatencyRecorder::new()),
        done: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        skipped: AtomicU64::new(0),
        first_error: Mutex::new(None),
    });
    let l = load.clone();
    let task = tokio::spawn(async move {
        let slots = Arc::new(tokio::sync::Semaphore::new(inflight));
        let period = Duration::from_secs_f64(1.0 / rate as f64);
        let mut n: u64 = 0;
        while !l.stop.load(Ordering::Relaxed) {
            n += 1;
            tokio::time::sleep_until((l.start + period.mul_f64(n as f64)).into()).await;
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                l.skipped.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let (w, l) = (writer.clone(), l.clone());
            tokio::spawn(async move {
                let mut value = vec![b'v'; value_bytes];
                let tag = n.to_le_bytes();
                value[..tag.len().min(value_bytes)]
                    .copy_from_slice(&tag[..tag.len().min(value_bytes)]);
                let t = Instant::now();
                match w.write(n, n % keys, &value).await {
                    Ok(()) => {
                        l.latency.lock().unwrap().record(t.elapsed());
                        l.done.fetch_add(1, Ordering::Relaxed);
                        let i = (l.start.elapsed().as_millis() / WINDOW.as_millis()) as usize;
                        if i < WINDOWS_MAX {
                            l.windows[i].fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Err(e) => {
                        l.errors.fetch_add(1, Ordering::Relaxed);
                        l.first_error
                            .lock()
                            .unwrap()
                            .get_or_insert_with(|| format!("{e:#}"));
                    }
                }
                drop(permit);
            });
        }
        // Let the writes in flight finish.
        let _ = slots.acquire_many(inflight as u32).await;
    });
    (load, task)
}

/// One round's measurements (times from the start of the write load).
#[derive(Debug, Default)]
struct Round {
    kill_s: f64,
    restart_s: f64,
    listen_s: f64,
    caught_up_s: f64,
    /// HEAL only: what the node reports (re-admission → Recov_end).
    node_recovery_ms: Option<f64>,
    /// ZooKeeper only: transactions the follower missed (leader's zxid at restart − its own).
    missed_txns: Option<f64>,
    efn_writes: u64,
    windows: Vec<u64>,
    latency: LatencyRecorder,
    errors: u64,
    skipped: u64,
    done: u64,
    elapsed_s: f64,
}

impl Round {
    fn catchup_ms(&self) -> f64 {
        (self.caught_up_s - self.restart_s) * 1000.0
    }
    fn listen_ms(&self) -> f64 {
        (self.listen_s - self.restart_s) * 1000.0
    }
    fn listen_to_catchup_ms(&self) -> f64 {
        (self.caught_up_s - self.listen_s) * 1000.0
    }
}

fn finish_load(load: &Load, r: &mut Round) {
    let end = load.start.elapsed();
    r.elapsed_s = end.as_secs_f64();
    r.windows = load.windows[..((end.as_millis() / WINDOW.as_millis()) as usize).min(WINDOWS_MAX)]
        .iter()
        .map(|w| w.load(Ordering::Relaxed))
        .collect();
    r.latency = load.latency.lock().unwrap().clone();
    r.errors = load.errors.load(Ordering::Relaxed);
    r.skipped = load.skipped.load(Ordering::Relaxed);
    r.done = load.done.load(Ordering::Relaxed);
    r.efn_writes = load.completed_between(
        Duration::from_secs_f64(r.kill_s),
        Duration::from_secs_f64(r.restart_s),
    );
    if let Some(e) = load.first_error.lock().unwrap().as_ref() {
        eprintln!("  {} writes failed; the first: {e}", r.errors);
    }
}

struct Plan {
    efn: Duration,
    warmup: Duration,
    tail: Duration,
    rate: u64,
    keys: u64,
    value_bytes: usize,
    inflight: usize,
    fault: Fault,
}

const CATCHUP_TIMEOUT: Duration = Duration::from_secs(600);

async fn zk_round(p: &Plan, dir: PathBuf) -> anyhow::Result<Round> {
    let mut e = Ensemble::start(EnsembleOptions::new(dir.clone()))?;
    let leader = e.wait_ready(Duration::from_secs(180)).await?;
    let victim = (leader + 1) % e.len();
    let live: Vec<usize> = (0..e.len()).filter(|&i| i != victim).collect();
    let mut clients = Vec::new();
    for &i in &live {
        clients.push(
            ZkClient::connect(
                e.client_addr(i),
                Duration::from_secs(10),
                Duration::from_secs(30),
            )
            .await?,
        );
    }
    let writer = Writer::Zk(Arc::new(clients));
    writer
        .setup(p.keys, &vec![b'v'; p.value_bytes])
        .await
        .context("creating the znodes")?;
    let zxid_of = |addr: SocketAddr| async move {
        match srvr(addr, Duration::from_secs(1)).await {
            Ok(ServerState::Serving { zxid, .. }) => Some(zxid),
            _ => None,
        }
    };
    let (load, task) = drive(writer, p.rate, p.keys, p.value_bytes, p.inflight);
    let mut r = Round::default();
    let res = async {
        tokio::time::sleep(p.warmup).await;
        let before = zxid_of(e.client_addr(victim)).await;
        match p.fault {
            Fault::Kill => e.kill(victim)?,
            Fault::Stop => e.signal(victim, libc::SIGSTOP)?,
        }
        r.kill_s = load.start.elapsed().as_secs_f64();
        tokio::time::sleep(p.efn).await;
        let leader_at_restart = zxid_of(e.client_addr(leader)).await;
        match p.fault {
            Fault::Kill => e.restart(victim)?,
            Fault::Stop => e.signal(victim, libc::SIGCONT)?,
        }
        let restarted = Instant::now();
        r.restart_s = load.start.elapsed().as_secs_f64();
        if let (Some(b), Some(l)) = (before, leader_at_restart) {
            // Same epoch (upper 32 bits): the counter difference is the transactions missed.
            if b >> 32 == l >> 32 {
                r.missed_txns = Some((l - b) as f64);
            }
        }
        let mut listening = None;
        loop {
            let target = zxid_of(e.client_addr(leader)).await;
            if let Ok(state) = srvr(e.client_addr(victim), Duration::from_secs(1)).await {
                listening.get_or_insert_with(Instant::now);
                if let (ServerState::Serving { zxid, .. }, Some(t)) = (state, target) {
                    if zxid >= t {
                        break;
                    }
                }
            }
            anyhow::ensure!(
                restarted.elapsed() < CATCHUP_TIMEOUT,
                "the ZooKeeper follower did not catch up within {CATCHUP_TIMEOUT:?}; see {}",
                e.log_path(victim).display()
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        r.caught_up_s = load.start.elapsed().as_secs_f64();
        r.listen_s = listening
            .map(|t| t.duration_since(load.start).as_secs_f64())
            .unwrap_or(r.caught_up_s);
        tokio::time::sleep(p.tail).await;
        anyhow::Ok(())
    }
    .await;
    load.stop.store(true, Ordering::Relaxed);
    let _ = task.await;
    finish_load(&load, &mut r);
    res.with_context(|| format!("ZooKeeper logs in {}/zk-*/server.log", dir.display()))?;
    Ok(r)
}

async fn heal_round(p: &Plan, lk: &mut LocalKv, model_nodes: u32) -> anyhow::Result<Round> {
    wait_all_serving(&lk.file, &lk.secret, Duration::from_secs(180)).await?;
    let addrs: Vec<SocketAddr> = lk.file.nodes.values().copied().collect();
    let victim = model_nodes as usize - 1;
    let live: Vec<SocketAddr> = addrs
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != victim)
        .map(|(_, a)| *a)
        .collect();
    let writer = Writer::Heal(KvCluster::new(live, lk.secret.clone()));
    writer
        .setup(p.keys, &vec![b'v'; p.value_bytes])
        .await
        .context("writing the keys")?;
    let (load, task) = drive(writer, p.rate, p.keys, p.value_bytes, p.inflight);
    let mut r = Round::default();
    let dir = lk.dir.clone();
    let secret = lk.secret.clone();
    let res = async {
        tokio::time::sleep(p.warmup).await;
        let log_from = log_len(&dir, victim);
        let pid = lk.pid(victim).context("the victim node is not running")?;
        match p.fault {
            Fault::Kill => lk.kill9(victim)?,
            Fault::Stop => anyhow::ensure!(
                testbed::proc::signal(pid, libc::SIGSTOP),
                "cannot stop node {victim}"
            ),
        }
        r.kill_s = load.start.elapsed().as_secs_f64();
        tokio::time::sleep(p.efn).await;
        match p.fault {
            Fault::Kill => lk.restart_node(victim)?,
            Fault::Stop => anyhow::ensure!(
                testbed::proc::signal(pid, libc::SIGCONT),
                "cannot continue node {victim}"
            ),
        }
        r.restart_s = load.start.elapsed().as_secs_f64();
        let (listening, _) =
            super::ycsb::wait_node_listening_then_serving(addrs[victim], &secret, CATCHUP_TIMEOUT)
                .await
                .with_context(|| format!("node {victim} did not serve again after its restart"))?;
        r.caught_up_s = load.start.elapsed().as_secs_f64();
        r.listen_s = listening.duration_since(load.start).as_secs_f64();
        for _ in 0..200 {
            if let Some(l) = recovery_line(&dir, victim, log_from) {
                r.node_recovery_ms = l.total_ms;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(p.tail).await;
        anyhow::Ok(())
    }
    .await;
    load.stop.store(true, Ordering::Relaxed);
    let _ = task.await;
    finish_load(&load, &mut r);
    res?;
    Ok(r)
}

const SYSTEMS: [&str; 2] = ["heal", "zookeeper"];

pub fn bench(a: KvZkArgs, _verbose: u8) -> anyhow::Result<bench::Report> {
    anyhow::ensure!(
        a.write_rate >= 1 && a.write_rate <= 100_000,
        "--write-rate must be between 1 and 100000 writes per second"
    );
    anyhow::ensure!(a.keys >= 1, "--keys must be at least 1");
    anyhow::ensure!(
        a.failure_timeout_ms >= 100,
        "--failure-timeout-ms must be at least 100"
    );
    anyhow::ensure!(
        (1..=4096).contains(&a.max_inflight),
        "--max-inflight must be between 1 and 4096"
    );
    anyhow::ensure!(
        (8..=zk::jute::MAX_DATA_BYTES).contains(&a.value_bytes),
        "--value-bytes must be between 8 and {}",
        zk::jute::MAX_DATA_BYTES
    );
    anyhow::ensure!(
        (3..=16).contains(&a.nodes),
        "--nodes must be between 3 and 16"
    );
    let efn_s = a.efn_s.unwrap_or(if a.quick { 3.0 } else { 60.0 });
    let warmup_s = a.warmup_s.unwrap_or(if a.quick { 2.0 } else { 5.0 });
    anyhow::ensure!(
        efn_s >= 0.0 && efn_s.is_finite() && warmup_s >= 0.0 && warmup_s.is_finite(),
        "--efn-s and --warmup-s must be finite and not negative"
    );
    let rounds = a.rounds.unwrap_or(if a.quick { 1 } else { 2 });
    anyhow::ensure!(rounds >= 1, "--rounds must be at least 1");
    // Fail early, with the install line, if ZooKeeper is missing.
    let jar = zk::ensemble::DEBIAN_ZOOKEEPER_JAR;
    anyhow::ensure!(
        std::path::Path::new(jar).exists(),
        "{jar} not found; {}",
        zk::ensemble::INSTALL_HINT
    );
    let plan = Plan {
        efn: Duration::from_secs_f64(efn_s),
        warmup: Duration::from_secs_f64(warmup_s),
        tail: Duration::from_secs(1),
        rate: a.write_rate,
        keys: a.keys,
        value_bytes: a.value_bytes,
        inflight: a.max_inflight,
        fault: a.fault,
    };
    let out = bench::out_dir("kv", a.out.clone())?;
    let rt = crate::runtime()?;
    let mut results: [Vec<Round>; 2] = [vec![], vec![]];
    for (i, v) in bench::interleaved_order(rounds, SYSTEMS.len())
        .into_iter()
        .enumerate()
    {
        eprintln!(
            "run {}/{}: {} ({:?} of one replica for {efn_s} s under {} writes/s of {} B over {} keys)",
            i + 1,
            rounds * SYSTEMS.len(),
            SYSTEMS[v],
            a.fault,
            a.write_rate,
            a.value_bytes,
            a.keys
        );
        let tmp = bench_dir(if v == 0 {
            "understudy-kvzk-heal-"
        } else {
            "understudy-kvzk-zk-"
        })?;
        let r = if v == 0 {
            let extra: Vec<String> = [
                "--model",
                &a.model,
                "--failure-timeout-ms",
                &a.failure_timeout_ms.to_string(),
                "--lease-ms",
                &(a.failure_timeout_ms / 2).to_string(),
            ]
            .map(String::from)
            .to_vec();
            let mut lk = LocalKv::start(&up_args(tmp.path(), a.nodes, &extra)?)?;
            let r = rt.block_on(heal_round(&plan, &mut lk, a.nodes));
            lk.stop();
            r
        } else {
            rt.block_on(zk_round(&plan, tmp.path().to_path_buf()))
        };
        let r = match r {
            Ok(r) => r,
            Err(e) => {
                let kept = tmp.keep();
                return Err(e.context(format!("files kept in {}", kept.display())));
            }
        };
        eprintln!(
            "  caught up {:.1} ms after the restart (listening after {:.1} ms, then {:.1} ms){}; {} writes during the EFN, {} done, {} failed, {} skipped",
            r.catchup_ms(),
            r.listen_ms(),
            r.listen_to_catchup_ms(),
            r.node_recovery_ms.map(|m| format!("; node-reported HEAL recovery {m:.1} ms")).unwrap_or_default(),
            r.efn_writes,
            r.done,
            r.errors,
            r.skipped
        );
        results[v].push(r);
    }

    let mut report = bench::Report::new("kv.zookeeper", a.quick);
    report.figure("efn_s", efn_s)?;
    report.figure("offered_write_rate_ops_per_s", a.write_rate as f64)?;
    report.figure("value_bytes", a.value_bytes as f64)?;
    let mean =
        |v: &[Round], f: &dyn Fn(&Round) -> f64| v.iter().map(f).sum::<f64>() / v.len() as f64;
    let mut csv = Vec::new();
    for (s, name) in SYSTEMS.iter().enumerate() {
        let v = &results[s];
        report.figure(
            &format!("{name}.catchup_latency_ms"),
            mean(v, &Round::catchup_ms),
        )?;
        report.figure(
            &format!("{name}.restart_to_listen_ms"),
            mean(v, &Round::listen_ms),
        )?;
        report.figure(
            &format!("{name}.listen_to_catchup_ms"),
            mean(v, &Round::listen_to_catchup_ms),
        )?;
        report.figure(
            &format!("{name}.efn_writes_count"),
            mean(v, &|r| r.efn_writes as f64),
        )?;
        report.figure(
            &format!("{name}.write_errors_count"),
            v.iter().map(|r| r.errors as f64).sum(),
        )?;
        report.figure(
            &format!("{name}.write_skipped_count"),
            v.iter().map(|r| r.skipped as f64).sum(),
        )?;
        report.figure(
            &format!("{name}.write_throughput_ops_per_s"),
            v.iter().map(|r| r.done as f64).sum::<f64>()
                / v.iter().map(|r| r.elapsed_s).sum::<f64>(),
        )?;
        let mut lat = LatencyRecorder::new();
        for r in v {
            lat.merge(&r.latency);
        }
        if lat.count() > 0 {
            report.latency(&format!("{name}.write.latency"), &lat.summary())?;
        }
        let reported: Vec<f64> = v.iter().filter_map(|r| r.node_recovery_ms).collect();
        if !reported.is_empty() {
            report.figure(
                &format!("{name}.recovery_latency_ms"),
                reported.iter().sum::<f64>() / reported.len() as f64,
            )?;
        }
        let missed: Vec<f64> = v.iter().filter_map(|r| r.missed_txns).collect();
        if !missed.is_empty() {
            report.figure(
                &format!("{name}.missed_txns_count"),
                missed.iter().sum::<f64>() / missed.len() as f64,
            )?;
        }
        for (round, r) in v.iter().enumerate() {
            for (i, w) in r.windows.iter().enumerate() {
                csv.push(vec![
                    name.to_string(),
                    round.to_string(),
                    format!("{:.1}", i as f64 * 0.1),
                    (w * 10).to_string(),
                ]);
            }
        }
    }
    let (h, z) = (&results[0], &results[1]);
    report.ratio(
        "zookeeper_vs_heal.recovery_latency",
        mean(z, &Round::catchup_ms),
        mean(h, &Round::catchup_ms),
    )?;
    report.ratio(
        "zookeeper_vs_heal.listen_to_catchup.recovery_latency",
        mean(z, &Round::listen_to_catchup_ms),
        mean(h, &Round::listen_to_catchup_ms),
    )?;
    bench::write_csv(
        &out.join("zookeeper_vs_heal_throughput.csv"),
        &["system", "run", "t_s", "writes_per_s"],
        csv,
    )?;
    plots(&out, h, z)?;
    eprintln!("plots and samples in {}", out.display());
    Ok(report)
}

fn plots(out: &std::path::Path, h: &[Round], z: &[Round]) -> anyhow::Result<()> {
    let mut series = Vec::new();
    for (name, r) in [("HEAL", &h[0]), ("ZooKeeper", &z[0])] {
        // Aligned on the failure so both timelines share the x axis.
        let points = r
            .windows
            .iter()
            .enumerate()
            .map(|(i, w)| (i as f64 * 0.1 - r.kill_s, *w as f64 * 10.0))
            .collect();
        series.push(bench::Series {
            name: format!("{name} writes/s"),
            points,
        });
        let top = r.windows.iter().copied().max().unwrap_or(0) as f64 * 10.0;
        for (what, t) in [("restarted", r.restart_s), ("caught up", r.caught_up_s)] {
            series.push(bench::Series {
                name: format!("{name} {what} ({:+.2} s)", t - r.kill_s),
                points: vec![(t - r.kill_s, 0.0), (t - r.kill_s, top)],
            });
        }
    }
    bench::line_plot(
        &out.join("zookeeper_vs_heal_throughput"),
        "writes completed per 100 ms, one replica down then back (first run)",
        "time since the failure (s)",
        "writes per second",
        &series,
        bench::Scale::Linear,
    )?;
    let mean =
        |v: &[Round], f: &dyn Fn(&Round) -> f64| v.iter().map(f).sum::<f64>() / v.len() as f64;
    bench::bar_plot(
        &out.join("zookeeper_vs_heal_catchup"),
        "replica catch-up after the EFN: restart -> serving the latest state",
        "system",
        "milliseconds",
        &["HEAL", "ZooKeeper"],
        &[
            bench::BarSeries {
                name: "restart -> listening".into(),
                values: vec![mean(h, &Round::listen_ms), mean(z, &Round::listen_ms)],
            },
            bench::BarSeries {
                name: "listening -> caught up".into(),
                values: vec![
                    mean(h, &Round::listen_to_catchup_ms),
                    mean(z, &Round::listen_to_catchup_ms),
                ],
            },
            bench::BarSeries {
                name: "total".into(),
                values: vec![mean(h, &Round::catchup_ms), mean(z, &Round::catchup_ms)],
            },
        ],
    )?;
    Ok(())
}
