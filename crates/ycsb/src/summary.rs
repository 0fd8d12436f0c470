//! What one phase measured, and its BENCH.md figures.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bench::{LatencyRecorder, Report, WindowedCounter, WindowedLatency};

/// The load phase inserts the records; the run phase issues the workload's mix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Load,
    Run,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Load => "load",
            Phase::Run => "run",
        }
    }
}

/// One operation type's completions (latency of each) and failures.
#[derive(Clone, Debug, Default)]
pub struct OpStats {
    /// Latency of every operation that got an answer from the store.
    pub latency: LatencyRecorder,
    /// Operations the store failed (connection or store errors); not in `latency`.
    pub errors: u64,
}

/// The results of one phase, merged over all clients.
#[derive(Clone, Debug)]
pub struct PhaseSummary {
    pub phase: Phase,
    pub clients: usize,
    /// From the start of the phase until the last client finished.
    pub elapsed: Duration,
    /// Per operation label (`read`, `update`, ..., or TAO's `obj_get`, ...).
    pub ops: BTreeMap<&'static str, OpStats>,
    /// Completions per window (100 ms by default) since the start of the phase.
    pub windows: WindowedCounter,
    /// Latency percentiles per window (the same windows), when [`crate::RunConfig`] asked for
    /// them: what a time to recovery is computed from (`bench::time_to_recovery`).
    pub latency_windows: Option<WindowedLatency>,
    /// When the phase started: windows count from here, so a failure injected at an `Instant`
    /// sits at `failure - started` on the timeline.
    pub started: Instant,
    pub window: Duration,
    /// Reads of a record that must exist which found nothing: a lost write.
    pub missing_count: u64,
    /// Values that are not what the driver wrote for that key (or of the wrong length), and
    /// scans that returned keys out of order.
    pub corrupt_count: u64,
    pub errors_count: u64,
    /// The first few problems (errors, missing or corrupt records), for the log.
    pub first_problems: Vec<String>,
}

/// Problems kept verbatim per phase; the rest are only counted.
pub(crate) const PROBLEMS_KEPT: usize = 8;

impl PhaseSummary {
    /// Operations that completed (errors excluded).
    pub fn completed_ops(&self) -> u64 {
        self.ops.values().map(|s| s.latency.count()).sum()
    }

    /// Completed operations per second over the whole phase.
    pub fn throughput_ops_per_s(&self) -> f64 {
        let s = self.elapsed.as_secs_f64();
        if s > 0.0 {
            self.completed_ops() as f64 / s
        } else {
            0.0
        }
    }

    /// Throughput of each complete window (the last, cut short by the end, is left out).
    pub fn window_ops_per_s(&self) -> Vec<f64> {
        let complete = (self.elapsed.as_nanos() / self.window.as_nanos().max(1)) as usize;
        let mut rates = self.windows.ops_per_s();
        rates.resize(complete, 0.0);
        rates
    }

    /// Whether every value read back was one the driver wrote, and no record was lost.
    pub fn all_reads_checked_ok(&self) -> bool {
        self.missing_count == 0 && self.corrupt_count == 0
    }

    /// All latencies merged.
    pub fn all_latency(&self) -> LatencyRecorder {
        let mut all = LatencyRecorder::new();
        for s in self.ops.values() {
            all.merge(&s.latency);
        }
        all
    }

    /// Adds this phase's figures under `prefix` (e.g. `"redis.a.run"`):
    /// `PREFIX.throughput_ops_per_s`, `PREFIX.ops_count`, `PREFIX.errors_count`,
    /// `PREFIX.missing_count`, `PREFIX.corrupt_count`, `PREFIX.elapsed_s`,
    /// `PREFIX.window.throughput_ops_per_s_{min,p50,max}` (100 ms windows, when at least one
    /// complete window), and per operation `PREFIX.OP.ops_count` and
    /// `PREFIX.OP.latency_us_{mean,p50,p90,p99,p999,max}`.
    pub fn add_to_report(&self, prefix: &str, report: &mut Report) -> Result<(), bench::Error> {
        report.figure(
            &format!("{prefix}.throughput_ops_per_s"),
            self.throughput_ops_per_s(),
        )?;
        report.figure(&format!("{prefix}.ops_count"), self.completed_ops() as f64)?;
        report.figure(&format!("{prefix}.errors_count"), self.errors_count as f64)?;
        report.figure(
            &format!("{prefix}.missing_count"),
            self.missing_count as f64,
        )?;
        report.figure(
            &format!("{prefix}.corrupt_count"),
            self.corrupt_count as f64,
        )?;
        report.figure(&format!("{prefix}.elapsed_s"), self.elapsed.as_secs_f64())?;
        let mut rates = self.window_ops_per_s();
        if !rates.is_empty() {
            rates.sort_by(f64::total_cmp);
            let at = |q: f64| rates[((rates.len() - 1) as f64 * q).round() as usize];
            report.figure(
                &format!("{prefix}.window.throughput_ops_per_s_min"),
                at(0.0),
            )?;
            report.figure(
                &format!("{prefix}.window.throughput_ops_per_s_p50"),
                at(0.5),
            )?;
            report.figure(
                &format!("{prefix}.window.throughput_ops_per_s_max"),
                at(1.0),
            )?;
        }
        for (label, stats) in &self.ops {
            let count = stats.latency.count();
            report.figure(&format!("{prefix}.{label}.ops_count"), count as f64)?;
            if count > 0 {
                report.latency(
                    &format!("{prefix}.{label}.latency"),
                    &stats.latency.summary(),
                )?;
            }
        }
        Ok(())
    }
}
