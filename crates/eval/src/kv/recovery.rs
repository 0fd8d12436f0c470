//! `understudy bench kv recovery`: recovery after a node failure (HEAL §IX), HEAL against the
//! full-copy and reactive-log baselines; with `--sweep`, HEAL's recovery latency against the EFN
//! for every persistency model and its breakdown for 3, 4 and 5 nodes (HEAL §IX, Figs. 7-8).
//! The group is a [`testbed::kv::LocalKv`].

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

use ::kv::leaderless::driver::KvCluster;
use ::kv::Model;
use testbed::kv::{parse_model, wait_all_serving, LocalKv, Recovery, UpArgs};
use testbed::proc;

#[derive(Args, Debug)]
pub struct KvRecoveryArgs {
    /// A short run (under a minute) that still measures every figure.
    #[arg(long)]
    pub quick: bool,
    /// Where CSVs and plots go [default: target/bench/kv].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Nodes in the group.
    #[arg(long, default_value_t = 5)]
    pub nodes: u32,
    /// Preloaded keys (default: 2000 with --quick, 1100000 without: over 1 GiB of values per
    /// node). Larger stores are refused when the nodes would not fit in the machine's memory.
    #[arg(long)]
    pub keys: Option<u64>,
    /// Value size of the preloaded records and of the writes.
    #[arg(long, default_value_t = 1000)]
    pub value_bytes: usize,
    /// Execution with fewer nodes, in seconds (default: 2 with --quick, 60 without).
    #[arg(long)]
    pub efn_s: Option<u64>,
    /// Runs per scheme, interleaved (default: 1 with --quick, 3 without).
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Closed-loop clients.
    #[arg(long, default_value_t = 16)]
    pub clients: usize,
    /// Key distribution of the load (YCSB-B: 95% reads, 5% updates): `zipfian` is YCSB's
    /// scrambled zipfian with --theta, `uniform` picks every key alike.
    #[arg(long, default_value = "zipfian", value_parser = ["zipfian", "uniform"])]
    pub distribution: String,
    /// Zipfian constant of the load (YCSB's default 0.99).
    #[arg(long, default_value_t = ycsb::choosers::DEFAULT_THETA)]
    pub theta: f64,
    /// Updates among the load's operations, in percent (YCSB-B: 5).
    #[arg(long, default_value_t = 5)]
    pub write_percent: u32,
    /// Load before the failure-free window that precedes the kill, in seconds (default: 2
    /// with --quick, 10 without).
    #[arg(long)]
    pub warmup_s: Option<u64>,
    /// Failure-free throughput windows just before the kill and just after the recovery has
    /// settled, in seconds each (default: 2 with --quick, 5 without); their mean is the
    /// failure-free throughput a run's loss is measured against.
    #[arg(long)]
    pub baseline_window_s: Option<u64>,
    /// Persistency model of the scheme comparison.
    #[arg(long, default_value = "synch", value_parser = parse_model)]
    pub model: Model,
    /// Missed_updates cap of every node (also the memory figure's allowance).
    #[arg(long, default_value_t = 64 << 20)]
    pub missed_updates_cap_bytes: usize,
    /// Recovery catch-up window, in chunks: credited to the Buddy plus received and still
    /// persisting (1: strictly one chunk at a time; at most 64).
    #[arg(long, default_value_t = 16)]
    pub catchup_chunks_in_flight: usize,
    /// Schemes to run (default: all three; the cross-scheme ratios need all three).
    #[arg(long, value_delimiter = ',', value_enum)]
    pub schemes: Option<Vec<Recovery>>,
    /// Instead of the scheme comparison: HEAL's recovery latency against the EFN for every
    /// persistency model, and the 3/4/5-node breakdown.
    #[arg(long)]
    pub sweep: bool,
    /// EFN periods of the sweep, in seconds (default: 1 with --quick; 1,10,60 without).
    #[arg(long, value_delimiter = ',')]
    pub sweep_efn_s: Option<Vec<u64>>,
    /// Preloaded keys of the sweep (default: 2000 with --quick, 100000 without).
    #[arg(long)]
    pub sweep_keys: Option<u64>,
}


/// One recovery run's setting.
#[derive(Clone, Copy, Debug)]
struct RunSpec {
    scheme: Recovery,
    model: Model,
    nodes: u32,
    keys: u64,
    efn: Duration,
}

/// Runs the experiment `a` asks for: the scheme comparison, or with `--sweep` the EFN sweep.
pub fn run(a: &KvRecoveryArgs) -> anyhow::Result<bench::Report> {
    if a.sweep {
        recovery_sweep(a)
    } else {
        recovery_bench(a)
    }
}

fn recovery_bench(a: &KvRecoveryArgs) -> anyhow::Result<bench::Report> {
    let keys = a.keys.unwrap_or(if a.quick { 2_000 } else { 1_100_000 });
    let efn = Duration::from_secs(a.efn_s.unwrap_or(if a.quick { 2 } else { 60 }));
    let rounds = a.rounds.unwrap_or(if a.quick { 1 } else { 3 });
    anyhow::ensure!(rounds > 0, "--rounds must be at least 1");
    anyhow::ensure!(a.write_percent <= 100, "--write-percent is a percentage (0..=100)");
    if a.distribution == "zipfian" {
        ycsb::ScrambledZipfian::new(keys.max(1), a.theta).map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    check_memory_for_store(a.nodes, keys, a.value_bytes, a.missed_updates_cap_bytes as u64)?;
    let out = bench::out_dir("kv", a.out.clone())?;
    let mut report = bench::Report::new("kv.recovery", a.quick);
    let all = [Recovery::Heal, Recovery::FullCopy, Recovery::ReactiveLog];
    let mut schemes: Vec<Recovery> = a.schemes.clone().unwrap_or(all.to_vec());
    if let Some(w) = schemes.iter().find(|s| !s.is_leaderless()) {
        anyhow::bail!("--schemes {} is a witness-KV scheme: see `bench kv ttr`", w.name());
    }
    schemes.sort_by_key(|s| all.iter().position(|x| x == s));
    schemes.dedup();
    anyhow::ensure!(!schemes.is_empty(), "--schemes needs at least one scheme");
    let mut results: BTreeMap<&'static str, Vec<RunResult>> = BTreeMap::new();
    let mut csv_rows = Vec::new();
    for (round, v) in bench::interleaved_order(rounds, schemes.len()).into_iter().enumerate() {
        let scheme = schemes[v];
        eprintln!(
            "run {}/{}: {} ({} nodes, {} keys x {} B, EFN {:?}, model {})",
            round + 1, rounds * schemes.len(), scheme.name(), a.nodes, keys, a.value_bytes, efn, a.model
        );
        let spec = RunSpec { scheme, model: a.model, nodes: a.nodes, keys, efn };
        let r = recovery_run(a, spec)?;
        r.log();
        for (i, w) in r.windows.iter().enumerate() {
            csv_rows.push(vec![scheme.name().to_string(), round.to_string(), format!("{:.2}", (i as u64 * LOSS_WINDOW_MS) as f64 / 1000.0), w.to_string()]);
        }
        results.entry(scheme.name()).or_default().push(r);
    }
    bench::write_csv(&out.join("recovery_throughput.csv"), &["scheme", "run", "t_s", "ops_in_10ms"], csv_rows)?;
    // Fig. 7-like: throughput over time, aligned on the kill, per scheme (first run of each).
    let series: Vec<bench::Series> = schemes
        .iter()
        .map(|s| {
            let r = &results[s.name()][0];
            // Plotted in 100 ms windows (ten of the measured ones), aligned on the kill.
            let per = (100 / LOSS_WINDOW_MS) as usize;
            let k = (r.kill_window / per) as f64;
            bench::Series {
                name: s.name().to_string(),
                points: r.windows.chunks(per).enumerate().map(|(i, w)| ((i as f64 - k) / 10.0, w.iter().sum::<u64>() as f64 * 10.0)).collect(),
            }
        })
        .collect();
    bench::line_plot(
        &out.join("recovery_throughput"),
        &format!("Throughput around a node failure ({keys} keys, EFN {} s)", efn.as_secs()),
        "time since the kill (s)",
        "completed operations / s",
        &series,
        bench::Scale::Linear,
    )?;
    let mean = |v: &[RunResult], f: &dyn Fn(&RunResult) -> f64| v.iter().map(f).sum::<f64>() / v.len() as f64;
    for &s in &schemes {
        let key = figure_key(s);
        let v = &results[s.name()];
        report.figure(&format!("{key}.recovery_latency_ms"), mean(v, &|r| r.recovery_ms))?;
        report.figure(&format!("{key}.start_to_ack_ms"), mean(v, &|r| r.start_to_ack_ms))?;
        report.figure(&format!("{key}.catchup_to_resp_ms"), mean(v, &|r| r.catchup_to_resp_ms))?;
        report.figure(&format!("{key}.apply_to_end_ms"), mean(v, &|r| r.apply_to_end_ms))?;
        report.figure(&format!("{key}.transfer_ms"), mean(v, &|r| r.transfer_ms))?;
        report.figure(&format!("{key}.recovery_bytes"), mean(v, &|r| r.bytes as f64))?;
        report.figure(&format!("{key}.recovery_entries_count"), mean(v, &|r| r.entries as f64))?;
        report.figure(&format!("{key}.recovery_log_durable_bytes"), mean(v, &|r| r.log_durable_bytes))?;
        report.figure(&format!("{key}.fell_back_to_full_copy_ratio"), mean(v, &|r| r.full_copy as u8 as f64))?;
        report.figure(&format!("{key}.throughput_before_ops_per_s"), mean(v, &|r| r.before_ops_per_s))?;
        report.figure(&format!("{key}.throughput_after_ops_per_s"), mean(v, &|r| r.after_ops_per_s))?;
        report.figure(&format!("{key}.throughput_failure_free_ops_per_s"), mean(v, &|r| r.failure_free()))?;
        report.figure(&format!("{key}.throughput_efn_tail_ops_per_s"), mean(v, &|r| r.efn_tail_ops_per_s))?;
        report.figure(&format!("{key}.failure_throughput_lost_s"), mean(v, &|r| r.failure_lost_s))?;
        report.figure(&format!("{key}.throughput_lost_s"), mean(v, &|r| r.lost_s()))?;
        report.figure(&format!("{key}.throughput_lost_ratio"), mean(v, &|r| r.lost_fraction()))?;
        report.figure(&format!("{key}.loss_span_s"), mean(v, &|r| r.span_s))?;
        report.figure(&format!("{key}.recovery_throughput_lost_s"), mean(v, &|r| r.recovery_lost_s()))?;
        report.figure(&format!("{key}.load_average_1m_ratio"), mean(v, &|r| r.load_avg))?;
        // Per round, so a noisy round shows.
        for (i, r) in v.iter().enumerate() {
            let p = format!("{key}.round{}", i + 1);
            report.figure(&format!("{p}.recovery_latency_ms"), r.recovery_ms)?;
            report.figure(&format!("{p}.apply_to_end_ms"), r.apply_to_end_ms)?;
            report.figure(&format!("{p}.recovery_entries_count"), r.entries as f64)?;
            report.figure(&format!("{p}.throughput_before_ops_per_s"), r.before_ops_per_s)?;
            report.figure(&format!("{p}.throughput_after_ops_per_s"), r.after_ops_per_s)?;
            report.figure(&format!("{p}.throughput_efn_tail_ops_per_s"), r.efn_tail_ops_per_s)?;
            report.figure(&format!("{p}.throughput_lost_s"), r.lost_s())?;
            report.figure(&format!("{p}.recovery_throughput_lost_s"), r.recovery_lost_s())?;
            report.figure(&format!("{p}.load_average_1m_ratio"), r.load_avg)?;
        }
        report.figure(&format!("{key}.missed_updates_bytes"), mean(v, &|r| r.missed_updates_bytes as f64))?;
        report.figure(&format!("{key}.node_rss_bytes"), mean(v, &|r| r.rss_bytes as f64))?;
        report.figure(&format!("{key}.node_peak_rss_bytes"), mean(v, &|r| r.peak_rss_bytes as f64))?;
    }
    let stored = stored_bytes(keys, a.value_bytes);
    report.figure("store.per_node_bytes", stored as f64)?;
    report.figure("store.missed_updates_cap_bytes", a.missed_updates_cap_bytes as f64)?;
    report.figure("catchup.chunks_in_flight_count", a.catchup_chunks_in_flight as f64)?;
    if schemes.len() < all.len() {
        eprintln!("note: not every scheme ran: no cross-scheme ratios");
        return Ok(report);
    }
    // Memory: a live node (the Buddy) at the end of the EFN, when its Missed_updates buffer is
    // fullest, against what it stores plus the buffer's cap (target: at most 1.5).
    let h = &results["heal"];
    let f = &results["full-copy"];
    let rl = &results["reactive-log"];
    let allowance = (stored + a.missed_updates_cap_bytes as u64) as f64;
    report.ratio("memory.rss_vs_stored_plus_cap", mean(h, &|r| r.rss_bytes as f64), allowance)?;
    report.ratio("memory.peak_rss_vs_stored_plus_cap", mean(h, &|r| r.peak_rss_bytes as f64), allowance)?;
    report.ratio("fullcopy_vs_heal.recovery_latency", mean(f, &|r| r.recovery_ms), mean(h, &|r| r.recovery_ms))?;
    report.ratio("reactive_vs_heal.recovery_latency", mean(rl, &|r| r.recovery_ms), mean(h, &|r| r.recovery_ms))?;
    // Throughput lost: the work lost to the failure from the kill to the end of the recovery,
    // each part against the nearest rate of its own run (see `RunResult`), in seconds of that
    // rate: the schemes' spans differ by their recovery latency, so lost work, not a fraction
    // of each span, compares them (as the paper's degradation over one run of fixed length
    // does). Also over the recovery alone, the part the scheme decides.
    let lost_ratio = |report: &mut bench::Report, name: &str, a: f64, b: f64| -> anyhow::Result<()> {
        if b <= 0.0 {
            eprintln!("note: {name}: the baseline lost no work ({b:.3} s), the ratio means nothing");
        }
        if b != 0.0 {
            report.ratio(name, a, b)?;
        }
        Ok(())
    };
    lost_ratio(&mut report, "heal_vs_fullcopy.throughput_lost", mean(h, &|r| r.lost_s()), mean(f, &|r| r.lost_s()))?;
    lost_ratio(&mut report, "heal_vs_reactive.throughput_lost", mean(h, &|r| r.lost_s()), mean(rl, &|r| r.lost_s()))?;
    lost_ratio(&mut report, "heal_vs_fullcopy.recovery_throughput_lost", mean(h, &|r| r.recovery_lost_s()), mean(f, &|r| r.recovery_lost_s()))?;
    lost_ratio(&mut report, "heal_vs_reactive.recovery_throughput_lost", mean(h, &|r| r.recovery_lost_s()), mean(rl, &|r| r.recovery_lost_s()))?;
    // The load, so the figures say what they were measured under.
    report.figure("load.zipfian_theta_ratio", if a.distribution == "zipfian" { a.theta } else { 0.0 })?;
    report.figure("load.write_percent", a.write_percent as f64)?;
    report.figure("load.clients_count", a.clients as f64)?;
    // Closed loop: each client sends its next operation when the last is answered.
    report.figure("load.closed_loop_ratio", 1.0)?;
    report.figure("load.loss_window_ms", LOSS_WINDOW_MS as f64)?;
    let all: Vec<f64> = results.values().flatten().map(|r| r.failure_free()).collect();
    report.figure("load.failure_free_ops_per_s", all.iter().sum::<f64>() / all.len().max(1) as f64)?;
    report.figure("load.rounds_count", rounds as f64)?;
    report.figure("load.efn_s", efn.as_secs_f64())?;
    Ok(report)
}

/// HEAL's recovery latency against the EFN per persistency model (Fig. 7 style), and the
/// Start_to_ACK / CatchUp_to_Resp / Apply_to_end breakdown for 3, 4 and 5 nodes (Fig. 8).
fn recovery_sweep(a: &KvRecoveryArgs) -> anyhow::Result<bench::Report> {
    let keys = a.sweep_keys.unwrap_or(if a.quick { 2_000 } else { 100_000 });
    let efns: Vec<u64> = a.sweep_efn_s.clone().unwrap_or(if a.quick { vec![1] } else { vec![1, 10, 60] });
    anyhow::ensure!(!efns.is_empty() && efns.iter().all(|e| *e > 0), "--sweep-efn-s needs positive seconds");
    let out = bench::out_dir("kv", a.out.clone())?;
    let mut report = bench::Report::new("kv.recovery_sweep", a.quick);
    let mut rows = Vec::new();
    let mut series = Vec::new();
    // Interleave models within each EFN so drift hits them alike.
    let mut by_model: BTreeMap<&'static str, Vec<(f64, f64)>> = BTreeMap::new();
    for &efn in &efns {
        for model in Model::ALL {
            eprintln!("sweep: {model}, EFN {efn} s, {} nodes, {keys} keys", a.nodes);
            let spec = RunSpec { scheme: Recovery::Heal, model, nodes: a.nodes, keys, efn: Duration::from_secs(efn) };
            let r = recovery_run(a, spec)?;
            r.log();
            let m = model_key(model);
            report.figure(&format!("sweep.{m}.efn_{efn}s.recovery_latency_ms"), r.recovery_ms)?;
            report.figure(&format!("sweep.{m}.efn_{efn}s.missed_updates_bytes"), r.missed_updates_bytes as f64)?;
            rows.push(vec![model.name().to_string(), a.nodes.to_string(), efn.to_string(), format!("{:.3}", r.recovery_ms),
                format!("{:.3}", r.start_to_ack_ms), format!("{:.3}", r.catchup_to_resp_ms), format!("{:.3}", r.apply_to_end_ms),
                r.entries.to_string(), r.missed_updates_bytes.to_string()]);
            by_model.entry(model.name()).or_default().push((efn as f64, r.recovery_ms));
        }
    }
    for (name, pts) in by_model {
        series.push(bench::Series { name: name.to_string(), points: pts });
    }
    bench::line_plot(
        &out.join("recovery_vs_efn"),
        &format!("HEAL recovery latency against EFN ({} nodes, {keys} keys)", a.nodes),
        "EFN (s)",
        "recovery latency (ms)",
        &series,
        bench::Scale::Linear,
    )?;
    // Breakdown for 3, 4 and 5 nodes at the middle EFN, Synch.
    let efn = efns[efns.len() / 2];
    let groups = ["3 nodes", "4 nodes", "5 nodes"];
    let mut parts = [Vec::new(), Vec::new(), Vec::new()];
    for n in [3u32, 4, 5] {
        eprintln!("breakdown: {n} nodes, EFN {efn} s");
        let spec = RunSpec { scheme: Recovery::Heal, model: Model::Synch, nodes: n, keys, efn: Duration::from_secs(efn) };
        let r = recovery_run(a, spec)?;
        r.log();
        for (i, (name, v)) in [("start_to_ack_ms", r.start_to_ack_ms), ("catchup_to_resp_ms", r.catchup_to_resp_ms), ("apply_to_end_ms", r.apply_to_end_ms)]
            .into_iter()
            .enumerate()
        {
            report.figure(&format!("breakdown.{n}_nodes.{name}"), v)?;
            parts[i].push(v);
        }
        report.figure(&format!("breakdown.{n}_nodes.recovery_latency_ms"), r.recovery_ms)?;
        rows.push(vec!["synch".into(), n.to_string(), efn.to_string(), format!("{:.3}", r.recovery_ms),
            format!("{:.3}", r.start_to_ack_ms), format!("{:.3}", r.catchup_to_resp_ms), format!("{:.3}", r.apply_to_end_ms),
            r.entries.to_string(), r.missed_updates_bytes.to_string()]);
    }
    let [p0, p1, p2] = parts;
    bench::bar_plot(
        &out.join("recovery_breakdown"),
        &format!("HEAL recovery breakdown (synch, EFN {efn} s, {keys} keys)"),
        "replication group",
        "ms",
        &groups,
        &[
            bench::BarSeries { name: "Start_to_ACK".into(), values: p0 },
            bench::BarSeries { name: "CatchUp_to_Resp".into(), values: p1 },
            bench::BarSeries { name: "Apply_to_end".into(), values: p2 },
        ],
    )?;
    bench::write_csv(
        &out.join("recovery_sweep.csv"),
        &["model", "nodes", "efn_s", "recovery_ms", "start_to_ack_ms", "catchup_to_resp_ms", "apply_to_end_ms", "entries", "missed_updates_bytes"],
        rows,
    )?;
    Ok(report)
}

/// A scheme's name in figure keys.
fn figure_key(r: Recovery) -> &'static str {
    match r {
        Recovery::Heal => "heal",
        Recovery::FullCopy => "fullcopy",
        Recovery::ReactiveLog => "reactive",
        other => other.name(), // witness-KV schemes: not run by this bench
    }
}

fn model_key(m: Model) -> &'static str {
    match m {
        Model::Synch => "synch",
        Model::Strict => "strict",
        Model::ReadEnforced => "read_enforced",
        Model::Eventual => "eventual",
        Model::Scope => "scope",
    }
}


struct RunResult {
    recovery_ms: f64,
    start_to_ack_ms: f64,
    catchup_to_resp_ms: f64,
    apply_to_end_ms: f64,
    /// Part of `apply_to_end_ms`: first CatchUp_resp to the last chunk's arrival.
    transfer_ms: f64,
    entries: u64,
    bytes: u64,
    chunks: u64,
    full_copy: bool,
    /// Bytes the recovering node's log made durable from its restart to the end of the
    /// recovery (the catch-up's records, and its shadow writes meanwhile).
    log_durable_bytes: f64,
    /// Failure-free throughput in the windows just before the kill and just after the
    /// recovery settled, and the group's rate in the last window of the EFN (before the restart).
    before_ops_per_s: f64,
    after_ops_per_s: f64,
    efn_tail_ops_per_s: f64,
    /// Work lost from the kill to the recovery's start (detection, EFN, the node's restart on
    /// its log: the same for every scheme), in seconds of this run's pre-failure rate: that
    /// rate times the span minus the operations completed, summed over 10 ms windows
    /// (negative where the group did more).
    failure_lost_s: f64,
    /// The same over the recovery alone (re-admission to its end, as the node stamps it), in
    /// seconds of the EFN-tail rate: the loss the scheme itself causes, against the rate of
    /// the group it interrupts, measured seconds before.
    recovery_lost_s: f64,
    /// Kill to the end of the recovery, in seconds.
    span_s: f64,
    /// The machine's 1-minute load average when the node had recovered.
    load_avg: f64,
    /// A live node's (the Buddy's) resident memory and peak at the end of the EFN.
    rss_bytes: u64,
    peak_rss_bytes: u64,
    missed_updates_bytes: u64,
    /// Completed operations per [`LOSS_WINDOW_MS`] window from the start of the load.
    windows: Vec<u64>,
    kill_window: usize,
}

impl RunResult {
    fn failure_free(&self) -> f64 {
        (self.before_ops_per_s + self.after_ops_per_s) / 2.0
    }
    /// Work lost from the kill to the end of the recovery, in seconds of the rate each part
    /// is measured against (see the fields): drift-robust, each part against a rate of its
    /// own run measured next to it.
    fn lost_s(&self) -> f64 {
        self.failure_lost_s + self.recovery_lost_s
    }
    fn recovery_lost_s(&self) -> f64 {
        self.recovery_lost_s
    }
    /// Lost operations as a fraction of what the span would have done failure-free.
    fn lost_fraction(&self) -> f64 {
        if self.span_s > 0.0 { self.lost_s() / self.span_s } else { 0.0 }
    }
    fn log(&self) {
        eprintln!(
            "  recovered in {:.1} ms (start_to_ack {:.1}, catchup_to_resp {:.1}, apply_to_end {:.1} ms of which transfer {:.1}; {} entries, {} bytes, {} chunks, full copy {}); failure-free {:.0}/{:.0} ops/s before/after, {:.0} ops/s at the end of the EFN; lost kill..end of recovery {:.2} s of throughput ({:.1}% of the {:.1} s span), of which during the recovery {:.3} s; buddy RSS {} MiB (peak {} MiB), Missed_updates {} KiB; load average {:.2}",
            self.recovery_ms, self.start_to_ack_ms, self.catchup_to_resp_ms, self.apply_to_end_ms, self.transfer_ms, self.entries, self.bytes,
            self.chunks, self.full_copy, self.before_ops_per_s, self.after_ops_per_s, self.efn_tail_ops_per_s, self.lost_s(),
            self.lost_fraction() * 100.0, self.span_s, self.recovery_lost_s(), self.rss_bytes >> 20, self.peak_rss_bytes >> 20,
            self.missed_updates_bytes >> 10, self.load_avg
        );
    }
}

/// Resolution of the throughput windows the lost work is summed over.
const LOSS_WINDOW_MS: u64 = 10;

fn bench_key(i: u64) -> Vec<u8> {
    format!("user{i:010}").into_bytes()
}

/// The memory target: a node's resident memory stays within this many times the bytes it
/// stores, plus its Missed_updates cap.
const NODE_MEMORY_PER_STORED_BYTE: f64 = 1.5;

/// Refuses a store the machine cannot hold on every node at once (each node may reach the
/// memory target), before minutes of preloading end in the kernel killing a node.
fn check_memory_for_store(nodes: u32, keys: u64, value_bytes: usize, cap_bytes: u64) -> anyhow::Result<()> {
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
    });
    match available {
        Some(bytes) => store_fits_in_memory(nodes, keys, value_bytes, cap_bytes, bytes),
        None => Ok(()), // not Linux: nothing to check against
    }
}

/// [`check_memory_for_store`] against `available` bytes; the error names the largest `--keys`
/// that fits.
fn store_fits_in_memory(nodes: u32, keys: u64, value_bytes: usize, cap_bytes: u64, available: u64) -> anyhow::Result<()> {
    let per_node = stored_bytes(keys, value_bytes) as f64 * NODE_MEMORY_PER_STORED_BYTE + cap_bytes as f64;
    let need = per_node * nodes as f64;
    if need > available as f64 {
        let per_key = stored_bytes(1, value_bytes) as f64 * NODE_MEMORY_PER_STORED_BYTE;
        let fits = ((available as f64 / nodes as f64 - cap_bytes as f64).max(0.0) / per_key) as u64;
        anyhow::bail!(
            "{nodes} nodes holding {keys} keys of {value_bytes} B need up to {:.1} GiB of memory ({NODE_MEMORY_PER_STORED_BYTE}x the store plus the Missed_updates cap, per node); {:.1} GiB is available: pass --keys {fits} or less",
            need / (1u64 << 30) as f64,
            available as f64 / (1u64 << 30) as f64
        );
    }
    Ok(())
}

fn stored_bytes(keys: u64, value_bytes: usize) -> u64 {
    keys * (bench_key(0).len() + value_bytes) as u64
}

/// The snapshot every node's log starts from: `keys` committed records. Built once per size
/// and kept next to the bench clusters (each run copies it).
fn preload_image(work: &Path, keys: u64, value_bytes: usize) -> anyhow::Result<PathBuf> {
    use std::io::Write;
    let path = work.join(format!("preload-{keys}x{value_bytes}.log"));
    if path.exists() {
        return Ok(path);
    }
    let tmp = path.with_extension("tmp");
    let mut f = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&tmp)?);
    let ts = ::kv::Ts { version: 1, node: 0 };
    for i in 0..keys {
        let key = bench_key(i);
        let mut value = vec![b'x'; value_bytes];
        value[..8.min(value_bytes)].copy_from_slice(&i.to_le_bytes()[..8.min(value_bytes)]);
        f.write_all(&::kv::pmlog::encode(&::kv::pmlog::LogRecord::Put { key: key.clone(), ts, value }))?;
        f.write_all(&::kv::pmlog::encode(&::kv::pmlog::LogRecord::Mark { key, ts }))?;
    }
    f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}

/// Restores the same snapshot into every node's log.
fn preload(image: &Path, dir: &Path, nodes: u32) -> anyhow::Result<()> {
    for n in 0..nodes {
        let d = dir.join(format!("node-{n}"));
        std::fs::create_dir_all(&d)?;
        std::fs::copy(image, d.join("pm.log")).with_context(|| format!("copying the preloaded store to {}", d.display()))?;
    }
    // Durable before the run, as a node's store is: otherwise the first sync of a node's log
    // during the run would write back its whole copy.
    for n in 0..nodes {
        std::fs::File::open(dir.join(format!("node-{n}/pm.log")))?.sync_all()?;
    }
    Ok(())
}

/// Reads a gauge from a node's metrics endpoint.
async fn scrape_gauge(addr: SocketAddr, name: &str) -> Option<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr)).await.ok()?.ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").await.ok()?;
    let mut body = String::new();
    tokio::time::timeout(Duration::from_secs(2), s.read_to_string(&mut body)).await.ok()?.ok()?;
    body.lines().find(|l| l.starts_with(name) && l[name.len()..].starts_with(' ')).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
}

const BENCH_CLUSTER_PREFIX: &str = "understudy-kv-bench-";
/// The pid of the bench a cluster directory belongs to.
const BENCH_OWNER_FILE: &str = "bench.pid";

/// Removes the cluster directories of benches that are gone (interrupted or killed: a run's
/// directory is removed when it ends, but not when the bench dies), each several GiB of logs.
fn remove_abandoned_clusters(work: &Path) {
    let Ok(entries) = std::fs::read_dir(work) else { return };
    for e in entries.flatten() {
        let path = e.path();
        if !e.file_name().to_string_lossy().starts_with(BENCH_CLUSTER_PREFIX) {
            continue;
        }
        let owner = std::fs::read_to_string(path.join(BENCH_OWNER_FILE)).ok().and_then(|s| s.trim().parse::<u32>().ok());
        // A directory without an owner is being set up, or was left by an older bench: only a
        // dead owner's is removed.
        if owner.is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
            eprintln!("removing {} (left by an interrupted bench)", path.display());
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

fn recovery_run(a: &KvRecoveryArgs, spec: RunSpec) -> anyhow::Result<RunResult> {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    let RunSpec { scheme, model, nodes, keys, efn } = spec;
    let work = std::env::current_dir()?.join("target").join("bench-clusters");
    std::fs::create_dir_all(&work)?;
    remove_abandoned_clusters(&work);
    let image = preload_image(&work, keys, a.value_bytes)?;
    let tmp = tempfile::Builder::new().prefix(BENCH_CLUSTER_PREFIX).tempdir_in(&work)?;
    let dir = tmp.path().to_path_buf();
    std::fs::write(dir.join(BENCH_OWNER_FILE), std::process::id().to_string())?;
    preload(&image, &dir, nodes)?;
    let up = UpArgs {
        dir: dir.clone(),
        protocol: testbed::kv::UpProtocol::Leaderless,
        backups: 1,
        witnesses: 1,
        spares: 0,
        spare_backups: 0,
        soft_timeout_ms: None,
        sample_probability: None,
        nodes,
        model,
        port_base: 0,
        restart_after_ms: 0,
        persist_latency_us: 0,
        efn_ms: 0,
        missed_updates_cap_bytes: a.missed_updates_cap_bytes,
        catchup_chunks_in_flight: a.catchup_chunks_in_flight,
        recovery: scheme,
        // Copies stream in bounded chunks and never starve heartbeats; still generous for a
        // loaded shared machine.
        failure_timeout_ms: 1500,
        lease_ms: 700,
        // Every node reads its whole log (the store) before it answers the CM.
        startup_grace_ms: 3_600_000,
    };
    let mut lk = LocalKv::start(&up)?;
    let rt = crate::runtime()?;
    let victim = (nodes - 1) as usize;
    // The victim's Buddy: the next node after it that is active (node 0 here).
    let buddy = 0usize;
    let res = rt.block_on(async {
        let c = KvCluster::new(lk.file.nodes.values().copied().collect(), lk.secret.clone());
        // Every node reads its whole log before it serves: allow for a large store.
        wait_all_serving(&lk.file, &lk.secret, Duration::from_secs(1800)).await?;
        // Load: YCSB-B (95% reads, 5% updates by default) over the preloaded keys, closed
        // loop; completed operations counted in 10 ms windows (an hour of them at most).
        let windows: Arc<Vec<AtomicU64>> = Arc::new((0..3_600_000 / LOSS_WINDOW_MS).map(|_| AtomicU64::new(0)).collect());
        let stop = Arc::new(AtomicBool::new(false));
        let t0 = Instant::now();
        // The recovering node stamps the end of its recovery in wall-clock time.
        let t0_unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let mut tasks = Vec::new();
        let zipf = (a.distribution == "zipfian")
            .then(|| ycsb::ScrambledZipfian::new(keys, a.theta))
            .transpose()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        for cl in 0..a.clients {
            let c = c.clone();
            let windows = windows.clone();
            let stop = stop.clone();
            let value_bytes = a.value_bytes;
            let zipf = zipf.clone();
            let write_percent = a.write_percent as u64;
            tasks.push(tokio::spawn(async move {
                use rand::{Rng, SeedableRng};
                let mut rng = rand::rngs::StdRng::seed_from_u64(0x4845_414c ^ cl as u64);
                let mut n: u64 = 0;
                while !stop.load(Ordering::Relaxed) {
                    let keynum = match &zipf {
                        Some(z) => z.sample(&mut rng),
                        None => rng.gen_range(0..keys),
                    };
                    let key = bench_key(keynum);
                    n += 1;
                    let ok = if rng.gen_range(0..100) < write_percent {
                        let mut value = vec![b'y'; value_bytes];
                        value[..8.min(value_bytes)].copy_from_slice(&(n ^ (cl as u64) << 48).to_le_bytes()[..8.min(value_bytes)]);
                        c.put(&key, &value).await.is_ok()
                    } else {
                        c.get(&key).await.is_ok()
                    };
                    if ok {
                        let w = (t0.elapsed().as_millis() / LOSS_WINDOW_MS as u128) as usize;
                        if w < windows.len() {
                            windows[w].fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
        let warm = Duration::from_secs(a.warmup_s.unwrap_or(if a.quick { 2 } else { 10 }));
        let base_win = Duration::from_secs(a.baseline_window_s.unwrap_or(if a.quick { 2 } else { 5 }).max(1));
        tokio::time::sleep(warm + base_win).await;
        let kill_at = t0.elapsed();
        lk.kill9(victim)?;
        // The EFN is the execution with fewer nodes: it starts when the CM has removed the
        // victim (failure detection comes first).
        let cm_log = dir.join("logs/cm.log");
        let removed = format!("node {victim} removed");
        let deadline = Instant::now() + Duration::from_secs(60);
        while !std::fs::read_to_string(&cm_log).unwrap_or_default().contains(&removed) {
            anyhow::ensure!(Instant::now() < deadline, "the CM did not remove node {victim} within 60 s; see {}", cm_log.display());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(efn).await;
        // The Buddy's memory and Missed_updates at their fullest, just before the restart.
        let (rss, peak) = lk.pid(buddy).map(|p| (proc::rss_bytes(p).unwrap_or(0), proc::peak_rss_bytes(p).unwrap_or(0))).unwrap_or((0, 0));
        let missed = match lk.metrics.get(buddy).copied().flatten() {
            Some(m) => scrape_gauge(m, "kv_missed_updates_bytes").await.unwrap_or(f64::NAN),
            None => f64::NAN,
        };
        let restart_at = t0.elapsed();
        let events = crate::kv::events_path(&dir, victim);
        let events_from = std::fs::metadata(&events).map(|m| m.len()).unwrap_or(0);
        lk.restart_node(victim)?;
        let log = dir.join(format!("logs/node-{victim}.log"));
        let deadline = Instant::now() + Duration::from_secs(3600);
        // The node reports its recovery as a structured event (not a log line to scrape).
        let rec = loop {
            if let Some(r) = crate::kv::last_recovery(&events, events_from)? {
                break r;
            }
            anyhow::ensure!(Instant::now() < deadline, "node {victim} did not recover within an hour; see {}", log.display());
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let seen_at = t0.elapsed();
        eprintln!("  node {victim}: recovered in {:.3} ms: {:?}", rec.total_us as f64 / 1000.0, rec.stats);
        // The Buddy's side of the catch-up (its chunk building, encoding and socket writes).
        let buddy_log = std::fs::read_to_string(dir.join(format!("logs/node-{buddy}.log"))).unwrap_or_default();
        if let Some(l) = super::ycsb::complete_lines(&buddy_log).lines().rfind(|l| l.starts_with("catch-up served:")) {
            eprintln!("  node {buddy}: {l}");
        }
        let load_avg = load_average_1m();
        // The recovery's span on the load's clock: its end as the node stamped it (the log is
        // polled every 20 ms), its start that much earlier.
        let recovered_at = Some(Duration::from_micros(rec.ended_unix_us).saturating_sub(t0_unix)).filter(|d| *d <= seen_at).unwrap_or(seen_at);
        let recovery_start = recovered_at.saturating_sub(Duration::from_micros(rec.total_us));
        // One second for the group to settle (the CM activates the node, its clients return),
        // then the failure-free window after the failure.
        let settled_at = recovered_at + Duration::from_secs(1);
        tokio::time::sleep_until((Instant::now() + (settled_at + base_win).saturating_sub(t0.elapsed())).into()).await;
        let end = t0.elapsed();
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            let _ = t.await;
        }
        let w: Vec<u64> = windows.iter().take((end.as_millis() / LOSS_WINDOW_MS as u128) as usize).map(|x| x.load(Ordering::Relaxed)).collect();
        let win = |d: Duration| ((d.as_millis() / LOSS_WINDOW_MS as u128) as usize).min(w.len());
        let per_s = 1000.0 / LOSS_WINDOW_MS as f64;
        // Failure-free throughput: the windows adjacent to this run's failure, before the kill
        // and after the recovery has settled, so drift of the shared machine hits both alike.
        let rate = |from: Duration, to: Duration| {
            let s = &w[win(from)..win(to)];
            s.iter().sum::<u64>() as f64 / s.len().max(1) as f64 * per_s
        };
        let before_ops_per_s = rate(kill_at.saturating_sub(base_win), kill_at);
        let after_ops_per_s = rate(settled_at, settled_at + base_win);
        // The group's rate at the end of the EFN (the last window before the restart): what
        // the surviving nodes did just before the recovery began.
        let efn_tail_ops_per_s = rate(restart_at.saturating_sub(base_win), restart_at);
        // Lost work from `from` to `to` against a reference rate: what that rate would have
        // completed in those windows minus what was completed (not clipped: a window above the
        // rate counts against the loss), in seconds of that rate. Each part of the span is
        // measured against the rate nearest to it, within this run: the load's rate drifts
        // by tens of percent over a minute on a shared machine (and between runs), which a
        // single reference for a span that includes the whole EFN would count as loss.
        let lost_s = |from: Duration, to: Duration, reference: f64| {
            let span = &w[win(from)..win(to).min(w.len())];
            (reference / per_s * span.len() as f64 - span.iter().sum::<u64>() as f64) / reference.max(f64::MIN_POSITIVE)
        };
        let span_s = recovered_at.saturating_sub(kill_at).as_secs_f64();
        // The failure (detection, EFN, the node's restart on its log) is the same for every
        // scheme: against the pre-failure rate. The recovery (re-admission to its end, as the
        // node stamps it) is the scheme's own: against the EFN-tail rate.
        let failure_lost_s = lost_s(kill_at, recovery_start, before_ops_per_s);
        let recovery_lost_s = lost_s(recovery_start, recovered_at + Duration::from_millis(LOSS_WINDOW_MS), efn_tail_ops_per_s);
        let kill_window = win(kill_at);
        Ok::<_, anyhow::Error>(Measured {
            rec,
            before_ops_per_s,
            after_ops_per_s,
            efn_tail_ops_per_s,
            failure_lost_s,
            recovery_lost_s,
            span_s,
            load_avg,
            rss,
            peak,
            missed,
            windows: w,
            kill_window,
        })
    });
    lk.stop();
    let m = match res {
        Ok(r) => r,
        Err(e) => {
            let kept = tmp.keep();
            return Err(e.context(format!("logs kept in {}/logs", kept.display())));
        }
    };
    let (r, ms) = (&m.rec.stats, |us: u64| us as f64 / 1000.0);
    Ok(RunResult {
        recovery_ms: ms(m.rec.total_us),
        start_to_ack_ms: ms(r.start_to_ack_us),
        catchup_to_resp_ms: ms(r.catchup_to_resp_us),
        apply_to_end_ms: ms(r.apply_to_end_us),
        transfer_ms: ms(r.transfer_us),
        entries: r.entries_received,
        bytes: r.bytes_received,
        chunks: r.chunks,
        full_copy: r.full_copy,
        log_durable_bytes: m.rec.log_durable_bytes as f64,
        before_ops_per_s: m.before_ops_per_s,
        after_ops_per_s: m.after_ops_per_s,
        efn_tail_ops_per_s: m.efn_tail_ops_per_s,
        failure_lost_s: m.failure_lost_s,
        recovery_lost_s: m.recovery_lost_s,
        span_s: m.span_s,
        load_avg: m.load_avg,
        rss_bytes: m.rss,
        peak_rss_bytes: m.peak,
        missed_updates_bytes: if m.missed.is_finite() { m.missed as u64 } else { 0 },
        windows: m.windows,
        kill_window: m.kill_window,
    })
}

/// What one run's load measured (see [`RunResult`]).
struct Measured {
    rec: crate::kv::Recovered,
    before_ops_per_s: f64,
    after_ops_per_s: f64,
    efn_tail_ops_per_s: f64,
    failure_lost_s: f64,
    recovery_lost_s: f64,
    span_s: f64,
    load_avg: f64,
    rss: u64,
    peak: u64,
    missed: f64,
    windows: Vec<u64>,
    kill_window: usize,
}

/// The 1-minute load average of the machine (`/proc/loadavg`), 0 if unreadable.
fn load_average_1m() -> f64 {
    std::fs::read_to_string("/proc/loadavg").ok().and_then(|s| s.split_whitespace().next()?.parse().ok()).unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_is_refused_past_the_memory_and_the_error_names_what_fits() {
        let gib = 1u64 << 30;
        let cap = 64 << 20;
        // 1.1 M keys: 1.14 GB per node, 1.77 GB with the target's allowance and the cap.
        assert!(store_fits_in_memory(5, 1_100_000, 1000, cap, 20 * gib).is_ok());
        let err = store_fits_in_memory(5, 1_100_000, 1000, cap, 8 * gib).unwrap_err().to_string();
        let fits: u64 = err.rsplit("--keys ").next().unwrap().split_whitespace().next().unwrap().parse().unwrap();
        assert!(fits < 1_100_000 && fits > 900_000, "{err}");
        assert!(store_fits_in_memory(5, fits, 1000, cap, 8 * gib).is_ok(), "the named size fits: {err}");
        assert!(store_fits_in_memory(5, fits + 1000, 1000, cap, 8 * gib).is_err());
        // Not even an empty store fits: zero keys named, never a negative count.
        let err = store_fits_in_memory(5, 10, 1000, cap, 100 << 20).unwrap_err().to_string();
        assert!(err.contains("--keys 0 "), "{err}");
    }

    #[test]
    fn a_half_written_log_line_is_not_read() {
        use crate::kv::ycsb::complete_lines;
        let text = "a\nrecovered: node 2 in 1.0 ms (full_copy ";
        assert_eq!(complete_lines(text), "a\n");
        assert_eq!(complete_lines("no newline yet"), "");
        assert_eq!(complete_lines("x\ny\n"), "x\ny\n");
        assert!(!complete_lines(text).lines().any(|l| l.starts_with("recovered: node")));
    }

    #[test]
    fn only_clusters_of_dead_benches_are_removed() {
        let work = tempfile::tempdir().unwrap();
        let mk = |name: &str, owner: Option<u32>| {
            let d = work.path().join(name);
            std::fs::create_dir_all(d.join("node-0")).unwrap();
            if let Some(pid) = owner {
                std::fs::write(d.join(BENCH_OWNER_FILE), pid.to_string()).unwrap();
            }
            d
        };
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead_pid = child.id();
        child.wait().unwrap();
        let dead = mk(&format!("{BENCH_CLUSTER_PREFIX}dead"), Some(dead_pid));
        let live = mk(&format!("{BENCH_CLUSTER_PREFIX}live"), Some(std::process::id()));
        let unowned = mk(&format!("{BENCH_CLUSTER_PREFIX}new"), None);
        let other = mk("something-else", Some(dead_pid));
        remove_abandoned_clusters(work.path());
        assert!(!dead.exists());
        assert!(live.exists() && unowned.exists() && other.exists());
    }
}
