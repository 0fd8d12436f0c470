//! Time to recovery against a latency SLO, as CANDStore defines it (§7.5), with its CSV and
//! timeline plots.
//!
//! The paper: "tail/median latency is measured on a 100 ms non-overlapping sliding window, and
//! TTR is calculated to be the end of the first window that achieves latency within the SLO such
//! that all following windows do not have latency higher than the SLO". So TTR runs from the
//! failure instant to the *end* of the first in-SLO window after which every window stays in SLO
//! (a window is only known to be in SLO once it has ended). [`Ttr::Recovered`] also carries that
//! window's start, for readers who count from there.
//!
//! Rules the paper leaves implicit, as the spec (e) settles them:
//! - A window with no completions violates the SLO: an outage is not "no latency".
//! - The SLO is a multiple of the same run's steady state: the median, over the complete
//!   windows of a steady span before the failure, of the windows' percentile.
//! - Windows considered are those ending after the failure, up to the end of the run; if the
//!   last of them violates the SLO (or there is none) the run never recovered, which is reported
//!   as such rather than as a number.

use crate::latency_window::{Percentile, WindowStats};
use crate::{line_plot, write_csv, Error, Scale, Series};
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A latency objective on one per-window percentile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slo {
    pub percentile: Percentile,
    pub bound_us: u64,
}

impl Slo {
    /// In SLO: something completed in the window, and its percentile is within the bound.
    pub fn met_by(&self, window: &WindowStats) -> bool {
        self.percentile
            .of(window)
            .is_some_and(|value| window.count > 0 && value <= self.bound_us)
    }

    /// `multiple` × the steady percentile of `windows` over `steady` (see [`steady_state_us`]);
    /// `None` if the steady span has no complete window with completions.
    pub fn from_steady(
        windows: &[WindowStats],
        percentile: Percentile,
        steady: Range<Duration>,
        multiple: f64,
    ) -> Option<Slo> {
        let steady_us = steady_state_us(windows, percentile, steady)?;
        Some(Slo {
            percentile,
            bound_us: (steady_us as f64 * multiple).round() as u64,
        })
    }
}

/// The median over the windows lying entirely within `steady` that saw completions, of their
/// `percentile`; `None` if there is no such window. The median, not the mean, so one hiccup in
/// the warm phase does not loosen every SLO.
pub fn steady_state_us(
    windows: &[WindowStats],
    percentile: Percentile,
    steady: Range<Duration>,
) -> Option<u64> {
    let mut values: Vec<u64> = windows
        .iter()
        .filter(|w| w.start >= steady.start && w.end <= steady.end)
        .filter_map(|w| percentile.of(w))
        .collect();
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    // The lower median of an even count: the steadier of the two middle windows.
    Some(values[(values.len() - 1) / 2])
}

/// The outcome of a TTR computation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Ttr {
    /// In SLO from the end of window `window` (index into the windows given) to the end of the
    /// run; `ttr` is from the failure to that window's end.
    Recovered {
        ttr: Duration,
        window: usize,
        window_start: Duration,
        window_end: Duration,
    },
    /// The last window after the failure violates the SLO (or no window ended after it): the
    /// run did not recover within the measurement. `last_violation_end` is the end of the last
    /// violating window, `None` when there was no window to judge.
    NotRecovered {
        windows_after_failure: usize,
        last_violation_end: Option<Duration>,
    },
}

impl Ttr {
    /// The TTR, if the run recovered.
    pub fn duration(&self) -> Option<Duration> {
        match self {
            Ttr::Recovered { ttr, .. } => Some(*ttr),
            Ttr::NotRecovered { .. } => None,
        }
    }
}

impl fmt::Display for Ttr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ttr::Recovered {
                ttr, window_end, ..
            } => write!(
                f,
                "recovered: TTR {:.3} s (in SLO from {:.3} s on)",
                ttr.as_secs_f64(),
                window_end.as_secs_f64()
            ),
            Ttr::NotRecovered {
                windows_after_failure: 0,
                ..
            } => write!(f, "not recovered: no complete window after the failure"),
            Ttr::NotRecovered {
                windows_after_failure,
                last_violation_end,
            } => write!(
                f,
                "not recovered: the last of {windows_after_failure} windows after the failure \
                 (ending at {:.3} s) violates the SLO",
                last_violation_end.unwrap_or_default().as_secs_f64()
            ),
        }
    }
}

/// TTR of `slo` after a failure at `failure` (or from any instant, e.g. the election, for
/// "TTR from the election"), over consecutive `windows` from [`crate::WindowedLatency::windows`].
pub fn time_to_recovery(windows: &[WindowStats], failure: Duration, slo: &Slo) -> Ttr {
    let first_after = windows.partition_point(|w| w.end <= failure);
    let after = &windows[first_after..];
    let last_violation = after.iter().rposition(|w| !slo.met_by(w));
    let recovered_at = match last_violation {
        None => 0,
        Some(last) => last + 1,
    };
    match after.get(recovered_at) {
        Some(window) => Ttr::Recovered {
            ttr: window.end - failure,
            window: first_after + recovered_at,
            window_start: window.start,
            window_end: window.end,
        },
        None => Ttr::NotRecovered {
            windows_after_failure: after.len(),
            last_violation_end: last_violation.map(|i| after[i].end),
        },
    }
}

/// One point of a TTR-against-SLO curve (Figures 9 and 10).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TtrPoint {
    pub multiple: f64,
    pub slo: Slo,
    pub ttr: Ttr,
}

/// TTR for each SLO `multiples[i]` × the steady percentile over `steady`; empty if the steady
/// span has no completions.
pub fn ttr_curve(
    windows: &[WindowStats],
    failure: Duration,
    percentile: Percentile,
    steady: Range<Duration>,
    multiples: &[f64],
) -> Vec<TtrPoint> {
    multiples
        .iter()
        .filter_map(|&multiple| {
            let slo = Slo::from_steady(windows, percentile, steady.clone(), multiple)?;
            let ttr = time_to_recovery(windows, failure, &slo);
            Some(TtrPoint { multiple, slo, ttr })
        })
        .collect()
}

/// Mean throughput of the windows lying entirely within `span`; `None` if there are none. For
/// `cand_vs_steady.throughput_after_election` (first 2 s after the election against before the
/// kill).
pub fn mean_ops_per_s(windows: &[WindowStats], span: Range<Duration>) -> Option<f64> {
    let inside: Vec<f64> = windows
        .iter()
        .filter(|w| w.start >= span.start && w.end <= span.end)
        .map(|w| w.ops_per_s)
        .collect();
    (!inside.is_empty()).then(|| inside.iter().sum::<f64>() / inside.len() as f64)
}

/// Writes the windows of several schemes to one CSV, one row per (scheme, window); empty
/// windows have empty percentile fields.
pub fn write_windows_csv(path: &Path, schemes: &[(&str, &[WindowStats])]) -> Result<(), Error> {
    let header = [
        "scheme",
        "window_start_s",
        "window_end_s",
        "ops",
        "ops_per_s",
        "p50_us",
        "p99_us",
        "p999_us",
        "max_us",
    ];
    let optional = |value: Option<u64>| value.map_or_else(String::new, |v| v.to_string());
    let rows = schemes.iter().flat_map(|(scheme, windows)| {
        windows.iter().map(move |w| {
            vec![
                scheme.to_string(),
                format!("{:.3}", w.start.as_secs_f64()),
                format!("{:.3}", w.end.as_secs_f64()),
                w.count.to_string(),
                format!("{:.1}", w.ops_per_s),
                optional(w.p50_us),
                optional(w.p99_us),
                optional(w.p999_us),
                optional(w.max_us),
            ]
        })
    });
    write_csv(path, &header, rows)
}

/// Draws `<stem>_latency` (p50 and p99.9 per window and scheme, µs) and `<stem>_throughput`
/// (ops/s per window and scheme), each with the failure marked as a vertical line, as SVG and
/// PNG; returns the four paths. A window's point sits at its end, where its verdict is known.
/// Empty windows have no latency point (the line joins across them), so read the latency
/// timeline beside the throughput one, where they show as zero.
pub fn write_timeline_plots(
    stem: &Path,
    title: &str,
    schemes: &[(&str, &[WindowStats])],
    failure: Duration,
) -> Result<Vec<PathBuf>, Error> {
    let point = |w: &WindowStats, value: Option<u64>| {
        (w.end.as_secs_f64(), value.map_or(f64::NAN, |v| v as f64))
    };
    let mut latency = Vec::new();
    let mut throughput = Vec::new();
    for (scheme, windows) in schemes {
        for (percentile, label) in [(Percentile::P50, "p50"), (Percentile::P999, "p99.9")] {
            latency.push(Series {
                name: format!("{scheme} {label}"),
                points: windows.iter().map(|w| point(w, percentile.of(w))).collect(),
            });
        }
        throughput.push(Series {
            name: scheme.to_string(),
            points: windows
                .iter()
                .map(|w| (w.end.as_secs_f64(), w.ops_per_s))
                .collect(),
        });
    }
    let mut paths = Vec::new();
    for (suffix, y_label, mut series) in [
        ("latency", "latency per window (µs)", latency),
        ("throughput", "throughput per window (ops/s)", throughput),
    ] {
        series.push(failure_marker(&series, failure));
        let mut path = stem.as_os_str().to_owned();
        path.push(format!("_{suffix}"));
        let plot_title = format!("{title}: {suffix}");
        paths.extend(line_plot(
            Path::new(&path),
            &plot_title,
            "time since start (s)",
            y_label,
            &series,
            Scale::Linear,
        )?);
    }
    Ok(paths)
}

/// A vertical line at the failure from zero to the highest point of `series`.
fn failure_marker(series: &[Series], failure: Duration) -> Series {
    let top = series
        .iter()
        .flat_map(|s| &s.points)
        .map(|&(_, y)| y)
        .filter(|y| y.is_finite())
        .fold(0.0, f64::max);
    let x = failure.as_secs_f64();
    Series {
        name: format!("failure ({x:.2} s)"),
        points: vec![(x, 0.0), (x, if top > 0.0 { top } else { 1.0 })],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::test_dir;
    use crate::WindowedLatency;

    const W: Duration = Duration::from_millis(100);

    /// Synthetic 100 ms windows with the given p99.9 (µs; `None` = nothing completed) and p50
    /// a tenth of it.
    fn windows(p999s: &[Option<u64>]) -> Vec<WindowStats> {
        p999s
            .iter()
            .enumerate()
            .map(|(i, &p999)| WindowStats {
                start: W * i as u32,
                end: W * (i as u32 + 1),
                count: if p999.is_some() { 1000 } else { 0 },
                ops_per_s: if p999.is_some() { 10_000.0 } else { 0.0 },
                p50_us: p999.map(|v| v / 10),
                p99_us: p999,
                p999_us: p999,
                max_us: p999,
            })
            .collect()
    }

    const SLO_300: Slo = Slo {
        percentile: Percentile::P999,
        bound_us: 300,
    };

    #[test]
    fn ttr_ends_at_the_first_window_that_stays_in_slo() {
        // Steady 100 µs for 1 s; failure at 1.05 s; bad until the window ending at 1.6 s.
        let mut p999s = vec![Some(100); 10];
        p999s.extend([
            Some(5000),
            Some(900),
            Some(400),
            Some(350),
            Some(301),
            Some(250),
        ]);
        p999s.extend(vec![Some(200); 10]);
        let windows = windows(&p999s);
        let failure = Duration::from_millis(1050);
        let ttr = time_to_recovery(&windows, failure, &SLO_300);
        assert_eq!(
            ttr,
            Ttr::Recovered {
                ttr: Duration::from_millis(550),
                window: 15,
                window_start: Duration::from_millis(1500),
                window_end: Duration::from_millis(1600),
            }
        );
        assert!(ttr.to_string().contains("TTR 0.550 s"), "{ttr}");
        // A looser SLO recovers sooner; one looser than everything recovers in the failure's
        // own window.
        let loose = Slo {
            bound_us: 1000,
            ..SLO_300
        };
        assert_eq!(
            time_to_recovery(&windows, failure, &loose).duration(),
            Some(Duration::from_millis(150))
        );
        let looser = Slo {
            bound_us: 10_000,
            ..SLO_300
        };
        assert_eq!(
            time_to_recovery(&windows, failure, &looser).duration(),
            Some(Duration::from_millis(50))
        );
    }

    #[test]
    fn a_single_late_bad_window_moves_ttr() {
        let mut p999s = vec![Some(100); 10];
        p999s.extend([Some(5000), Some(200), Some(200), Some(200)]);
        p999s.extend([Some(200), Some(200), Some(200), Some(200)]);
        let failure = Duration::from_millis(1000);
        let before = time_to_recovery(&windows(&p999s), failure, &SLO_300);
        assert_eq!(before.duration(), Some(Duration::from_millis(200)));
        // One window at 1.6–1.7 s over the SLO: recovery is only after it.
        p999s[16] = Some(301);
        let after = time_to_recovery(&windows(&p999s), failure, &SLO_300);
        assert_eq!(after.duration(), Some(Duration::from_millis(800)));
    }

    #[test]
    fn empty_windows_during_an_outage_are_out_of_slo() {
        // Nothing completes from 1.0 to 1.5 s (the old primary is dead, nobody serves); the
        // completions that do arrive are fast.
        let mut p999s = vec![Some(100); 10];
        p999s.extend([None, None, None, None, None]);
        p999s.extend(vec![Some(100); 5]);
        let ttr = time_to_recovery(&windows(&p999s), Duration::from_millis(1000), &SLO_300);
        assert_eq!(ttr.duration(), Some(Duration::from_millis(600)));
        // An empty window never meets an SLO, however loose.
        let empty = windows(&[None])[0];
        assert!(!Slo {
            bound_us: u64::MAX,
            ..SLO_300
        }
        .met_by(&empty));
    }

    #[test]
    fn never_recovering_is_reported_not_a_number() {
        let mut p999s = vec![Some(100); 10];
        p999s.extend([Some(500), Some(200), Some(500)]);
        let ttr = time_to_recovery(&windows(&p999s), Duration::from_millis(1000), &SLO_300);
        assert_eq!(
            ttr,
            Ttr::NotRecovered {
                windows_after_failure: 3,
                last_violation_end: Some(Duration::from_millis(1300)),
            }
        );
        assert_eq!(ttr.duration(), None);
        assert!(ttr.to_string().starts_with("not recovered"), "{ttr}");
        // Nothing ended after the failure: nothing to judge.
        let ttr = time_to_recovery(&windows(&p999s), Duration::from_millis(1300), &SLO_300);
        assert_eq!(
            ttr,
            Ttr::NotRecovered {
                windows_after_failure: 0,
                last_violation_end: None
            }
        );
        assert!(ttr.to_string().contains("no complete window"), "{ttr}");
    }

    #[test]
    fn slo_is_a_multiple_of_the_steady_median() {
        // Warm-up hiccup at 0.0–0.1 s and a stall at 0.3 s inside the steady span; the median
        // of the steady windows' p99.9 ignores both.
        let p999s = [
            Some(9000),
            Some(100),
            Some(120),
            None,
            Some(110),
            Some(4000),
            Some(5000),
        ];
        let windows = windows(&p999s);
        let steady = Duration::from_millis(100)..Duration::from_millis(500);
        assert_eq!(
            steady_state_us(&windows, Percentile::P999, steady.clone()),
            Some(110)
        );
        assert_eq!(
            steady_state_us(&windows, Percentile::P50, steady.clone()),
            Some(11)
        );
        let slo = Slo::from_steady(&windows, Percentile::P999, steady.clone(), 4.0).unwrap();
        assert_eq!(
            slo,
            Slo {
                percentile: Percentile::P999,
                bound_us: 440
            }
        );
        assert_eq!(
            steady_state_us(&windows, Percentile::P999, W * 3..W * 4),
            None
        );
        // The curve: TTR falls as the SLO loosens.
        let curve = ttr_curve(&windows, W * 5, Percentile::P999, steady, &[1.5, 50.0]);
        assert_eq!(curve.len(), 2);
        assert_eq!(curve[0].ttr.duration(), None);
        assert_eq!(curve[1].ttr.duration(), Some(W));
        assert_eq!(mean_ops_per_s(&windows, W * 2..W * 5), Some(20_000.0 / 3.0));
    }

    #[test]
    fn recorded_windows_feed_ttr_csv_and_plots() {
        let mut cand = WindowedLatency::new(W);
        let mut offline = WindowedLatency::new(W);
        let ms = Duration::from_millis;
        for t in 0..3000u64 {
            // 1 op per ms at 50 µs; after the failure at 1 s: offline serves nothing until
            // 2.2 s, cand serves slowly until 1.4 s.
            let latency_us = |recovered_at| {
                if t < 1000 || t >= recovered_at {
                    50
                } else {
                    5000
                }
            };
            if !(1000..2200).contains(&t) {
                offline.record_us(ms(t), latency_us(2200));
            }
            cand.record_us(ms(t), latency_us(1400));
        }
        let end = ms(3000);
        let (cand, offline) = (cand.windows(end).unwrap(), offline.windows(end).unwrap());
        let slo = Slo::from_steady(&cand, Percentile::P999, ms(0)..ms(1000), 4.0).unwrap();
        // The end of the first good window: 1.5 s and 2.3 s.
        assert_eq!(
            time_to_recovery(&cand, ms(1000), &slo).duration(),
            Some(ms(500))
        );
        assert_eq!(
            time_to_recovery(&offline, ms(1000), &slo).duration(),
            Some(ms(1300))
        );

        let dir = test_dir("ttr");
        let csv = dir.join("windows.csv");
        write_windows_csv(&csv, &[("cand", &cand), ("offline", &offline)]).unwrap();
        let text = std::fs::read_to_string(&csv).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1 + 30 + 30);
        assert_eq!(
            lines[0],
            "scheme,window_start_s,window_end_s,ops,ops_per_s,p50_us,p99_us,p999_us,max_us"
        );
        assert_eq!(lines[1], "cand,0.000,0.100,100,1000.0,50,50,50,50");
        // Offline's outage windows: no completions, empty percentiles.
        assert_eq!(lines[31 + 15], "offline,1.500,1.600,0,0.0,,,,");

        let paths = write_timeline_plots(
            &dir.join("timeline"),
            "YCSB-C, SIGKILL of the primary",
            &[("cand", &cand), ("offline", &offline)],
            ms(1000),
        )
        .unwrap();
        assert_eq!(paths.len(), 4);
        let svg = std::fs::read_to_string(&paths[0]).unwrap();
        for text in [
            "cand p99.9",
            "offline p50",
            "failure (1.00 s)",
            "latency per window",
        ] {
            assert!(
                svg.contains(text),
                "{text} missing from {}",
                paths[0].display()
            );
        }
        assert!(
            paths[3].ends_with("timeline_throughput.png"),
            "{:?}",
            paths[3]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
