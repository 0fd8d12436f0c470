//! The benchmark harness shared by every `understudy bench <area> <scenario>` command.
//!
//! Not a paper section but the means by which the evaluations of SpecREDS, SplitFT, HEAL and
//! CANDStore are reproduced, following `BENCH.md`: progress on stderr, raw samples as CSV and
//! plots as SVG + PNG in the output directory, and as the last line of stdout one JSON object of
//! figures (with units) and ratios (without). It depends on no other workspace
//! crate, so every subsystem can depend on it.
//!
//! - [`Report`]: the final JSON line; checks names ([`check_figure_name`]) and refuses ratios
//!   with a zero or non-finite denominator.
//! - [`LatencyRecorder`] / [`LatencySummary`]: an HDR histogram in microseconds.
//! - [`WindowedCounter`]: ops/s per time window, for throughput timelines during failover.
//! - [`WindowedLatency`]: one HDR histogram per time window (p50/p99/p99.9 and ops/s per window),
//!   and [`time_to_recovery`]: CANDStore's TTR against an SLO relative to the run's steady state,
//!   with [`write_windows_csv`] and [`write_timeline_plots`].
//! - [`run_interleaved`]: measures variants alternately (ABBA) so that machine noise and drift
//!   hit them alike, which is what makes ratios hold on a shared machine.
//! - [`out_dir`], [`write_csv`]: where raw samples go.
//! - [`line_plot`], [`cdf_plot`], [`bar_plot`]: plots with a bundled font, so PNG text renders
//!   on any machine without system fonts.
//! - [`Progress`]: a progress bar on a terminal, plain lines otherwise.
//!
//! # Example
//!
//! ```
//! use bench::{run_interleaved, LatencyRecorder, Report};
//! use std::time::Instant;
//!
//! # fn main() -> Result<(), bench::Error> {
//! let mut recorders = [LatencyRecorder::new(), LatencyRecorder::new()];
//! // Variant 0 and 1 alternate, round by round, in ABBA order.
//! run_interleaved(4, 2, |variant| {
//!     let started = Instant::now();
//!     std::hint::black_box((0..1000 * (variant + 1)).sum::<usize>());
//!     recorders[variant].record(started.elapsed());
//! });
//! let mut report = Report::new("example.sum", true);
//! report.latency("small.sum.latency", &recorders[0].summary())?;
//! report.latency("large.sum.latency", &recorders[1].summary())?;
//! report.ratio("large_vs_small.sum.latency", recorders[1].mean_us(), recorders[0].mean_us())?;
//! report.print(); // {"bench":"example.sum","quick":true,"figures":{...},"ratios":{...},"env":{...}}
//! # Ok(())
//! # }
//! ```

mod interleave;
mod latency;
mod latency_window;
mod output;
mod plot;
mod progress;
mod report;
mod ttr;
mod window;

pub use interleave::{interleaved_order, run_interleaved};
pub use latency::{LatencyRecorder, LatencySummary};
pub use latency_window::{
    Percentile, WindowStats, WindowedLatency, LATENCY_WINDOWS_MAX, LATENCY_WINDOW_DEFAULT,
    WINDOW_SIGNIFICANT_DIGITS,
};
pub use output::{out_dir, write_csv};
pub use plot::{bar_plot, cdf_plot, line_plot, BarSeries, Scale, Series, PLOT_SIZE_PX};
pub use progress::Progress;
pub use report::{check_figure_name, check_ratio_name, Report, STATISTIC_SUFFIXES, UNIT_SUFFIXES};
pub use ttr::{
    mean_ops_per_s, steady_state_us, time_to_recovery, ttr_curve, write_timeline_plots,
    write_windows_csv, Slo, Ttr, TtrPoint,
};
pub use window::{WindowedCounter, WINDOWS_MAX};

use std::path::PathBuf;

/// What can go wrong while reporting a benchmark; each message says what to fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "figure name {name:?} must be a dotted path whose last word is a unit from \
         bench::UNIT_SUFFIXES, optionally followed by a statistic from bench::STATISTIC_SUFFIXES \
         (e.g. \"plain.write_4k.latency_us_p99\")"
    )]
    FigureName { name: String },
    #[error(
        "ratio name {name:?} must be a dotted path without a unit (a ratio of two figures in \
         the same unit has none), e.g. \"super_vs_plain.write_4k.latency\""
    )]
    RatioName { name: String },
    #[error("{name}: value {value} is not a finite number; did the benchmark measure anything?")]
    NotFinite { name: String, value: f64 },
    #[error(
        "ratio {name}: denominator is zero (numerator {numerator}); the baseline measured \
         nothing, so no ratio can be given"
    )]
    ZeroDenominator { name: String, numerator: f64 },
    #[error("{name} is recorded twice in one report; give each measurement its own name")]
    Duplicate { name: String },
    #[error("{name}: the latency recorder is empty; the benchmark completed no operations")]
    EmptyLatency { name: String },
    #[error("cannot write {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the run ends at {run_end:?}, past the {windows_max} windows of {window:?} a windowed \
         latency holds; use a longer window or a shorter run"
    )]
    WindowCap {
        run_end: std::time::Duration,
        window: std::time::Duration,
        windows_max: usize,
    },
    #[error("cannot draw plot {path}: {message}")]
    Plot { path: PathBuf, message: String },
}
