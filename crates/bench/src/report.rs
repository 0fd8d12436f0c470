//! The last line of a benchmark's stdout: one JSON object (see `BENCH.md`).

use crate::{Error, LatencySummary};
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::Write;
use std::process::Command;

/// Units a figure name may end in: its last word, as in `latency_us` or `throughput_ops_per_s`.
pub const UNIT_SUFFIXES: &[&str] = &[
    "ns",
    "us",
    "ms",
    "s",
    "ops_per_s",
    "iops",
    "bytes",
    "kib",
    "mib",
    "gib",
    "bytes_per_s",
    "mib_per_s",
    "count",
    "ratio",
    "percent",
];

/// Statistics that may follow the unit, as in `latency_us_p99` (the unit then comes last but one).
pub const STATISTIC_SUFFIXES: &[&str] = &[
    "mean", "min", "max", "stddev", "p50", "p90", "p95", "p99", "p999", "p9999",
];

/// The final JSON object of a benchmark run.
///
/// Figures and ratios are kept sorted by name, so two runs print their keys in the same order.
/// Invalid input is refused with an [`Error`] and nothing is recorded: a name that breaks the
/// naming rules, a value that is NaN or infinite, a name recorded twice, and a ratio whose
/// denominator is zero.
#[derive(Debug, Serialize)]
pub struct Report {
    bench: String,
    quick: bool,
    figures: BTreeMap<String, f64>,
    ratios: BTreeMap<String, f64>,
    /// Figures and ratios a run promises but could not measure, each with the reason (a
    /// missing baseline, a run that never recovered): named so a reader sees the gap instead
    /// of a number made up to fill it. Left out of the JSON when empty.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    absent: BTreeMap<String, String>,
    env: Env,
}

/// Where the run happened; `hostname` and `kernel` are left out when they cannot be read.
#[derive(Debug, Serialize)]
struct Env {
    cores: usize,
    git: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    hostname: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kernel: Option<String>,
}

impl Report {
    /// A report for benchmark `bench` (e.g. `"volume.cow"`), with `env` read from this machine:
    /// available cores, the short git commit of the current directory (`-dirty` appended when
    /// tracked files have changes, `"unknown"` outside a repository), hostname and kernel.
    pub fn new(bench: &str, quick: bool) -> Report {
        Report {
            bench: bench.to_string(),
            quick,
            figures: BTreeMap::new(),
            ratios: BTreeMap::new(),
            absent: BTreeMap::new(),
            env: Env {
                cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
                git: git_commit().unwrap_or_else(|| "unknown".to_string()),
                hostname: read_trimmed("/proc/sys/kernel/hostname"),
                kernel: read_trimmed("/proc/sys/kernel/osrelease"),
            },
        }
    }

    /// Records a measured figure, e.g. `figure("plain.write_4k.depth1.latency_us_mean", 812.0)`.
    pub fn figure(&mut self, name: &str, value: f64) -> Result<(), Error> {
        check_figure_name(name)?;
        if !value.is_finite() {
            return Err(Error::NotFinite {
                name: name.to_string(),
                value,
            });
        }
        insert_new(&mut self.figures, name, value)
    }

    /// Records `<prefix>_us_{mean,p50,p90,p99,p999,max}` from a latency summary, e.g. prefix
    /// `"plain.write_4k.depth1.latency"`. Refuses an empty summary.
    pub fn latency(&mut self, prefix: &str, summary: &LatencySummary) -> Result<(), Error> {
        if summary.count == 0 {
            return Err(Error::EmptyLatency {
                name: prefix.to_string(),
            });
        }
        let stats = [
            ("mean", summary.mean_us),
            ("p50", summary.p50_us as f64),
            ("p90", summary.p90_us as f64),
            ("p99", summary.p99_us as f64),
            ("p999", summary.p999_us as f64),
            ("max", summary.max_us as f64),
        ];
        for (stat, value) in stats {
            self.figure(&format!("{prefix}_us_{stat}"), value)?;
        }
        Ok(())
    }

    /// Records the ratio `numerator / denominator` under a unitless name and returns it, e.g.
    /// `ratio("super_vs_plain.write_4k.depth1.latency", super_us, plain_us)`. Both must be
    /// figures measured in this run, variants interleaved (see [`crate::run_interleaved`]).
    /// Refuses a zero or non-finite denominator and a non-finite numerator.
    pub fn ratio(&mut self, name: &str, numerator: f64, denominator: f64) -> Result<f64, Error> {
        check_ratio_name(name)?;
        for value in [numerator, denominator] {
            if !value.is_finite() {
                return Err(Error::NotFinite {
                    name: name.to_string(),
                    value,
                });
            }
        }
        if denominator == 0.0 {
            return Err(Error::ZeroDenominator {
                name: name.to_string(),
                numerator,
            });
        }
        let ratio = numerator / denominator;
        insert_new(&mut self.ratios, name, ratio)?;
        Ok(ratio)
    }

    /// Records that figure or ratio `name` was not measured in this run, and why. A later
    /// reason for the same name replaces the earlier one.
    pub fn absent(&mut self, name: &str, reason: &str) {
        self.absent.insert(name.to_string(), reason.to_string());
    }

    /// The report as one line of JSON, without a trailing newline.
    pub fn to_json_line(&self) -> String {
        // Cannot fail: every value is a finite f64, a string, a bool or an integer.
        serde_json::to_string(self).expect("a report serializes to JSON")
    }

    /// Prints the report as exactly one line on stdout. Call it last: `BENCH.md` requires the
    /// JSON object to be the last line of stdout.
    pub fn print(&self) {
        let mut stdout = std::io::stdout().lock();
        // Printing is the benchmark's whole output; like println!, a closed stdout is fatal.
        writeln!(stdout, "{}", self.to_json_line()).expect("write the report to stdout");
        stdout.flush().expect("flush the report to stdout");
    }
}

/// Checks a figure name: dotted path segments of ASCII letters, digits, `_` and `-`, the last
/// ending in a unit from [`UNIT_SUFFIXES`], optionally followed by one statistic from
/// [`STATISTIC_SUFFIXES`]. Accepts `write_4k.latency_us_p99`, `scan.throughput_ops_per_s`;
/// refuses `write_4k.latency_p99` (no unit) and `write_4k.us_latency` (unit not last).
pub fn check_figure_name(name: &str) -> Result<(), Error> {
    match last_segment(name) {
        Some(last) if ends_with_unit(strip_statistic(last)) => Ok(()),
        _ => Err(Error::FigureName {
            name: name.to_string(),
        }),
    }
}

/// Checks a ratio name: dotted path segments as for figures, the last naming a quantity but no
/// unit attached to it (`latency`, `iops`; not `latency_us`).
pub fn check_ratio_name(name: &str) -> Result<(), Error> {
    let unit_attached = |last: &str| {
        let word = strip_statistic(last);
        ends_with_unit(word) && UNIT_SUFFIXES.iter().all(|unit| word != *unit)
    };
    match last_segment(name) {
        Some(last) if !unit_attached(last) => Ok(()),
        _ => Err(Error::RatioName {
            name: name.to_string(),
        }),
    }
}

/// The last segment of a well-formed dotted path, or `None` if any segment is malformed.
fn last_segment(name: &str) -> Option<&str> {
    let well_formed = |segment: &str| {
        !segment.is_empty()
            && segment
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    };
    name.split('.')
        .all(well_formed)
        .then(|| name.rsplit('.').next())
        .flatten()
}

fn strip_statistic(word: &str) -> &str {
    STATISTIC_SUFFIXES
        .iter()
        .find_map(|stat| word.strip_suffix(stat)?.strip_suffix('_'))
        .unwrap_or(word)
}

fn ends_with_unit(word: &str) -> bool {
    UNIT_SUFFIXES.iter().any(|unit| {
        word.strip_suffix(unit)
            .is_some_and(|rest| rest.is_empty() || rest.ends_with('_'))
    })
}

fn insert_new(map: &mut BTreeMap<String, f64>, name: &str, value: f64) -> Result<(), Error> {
    if map.contains_key(name) {
        return Err(Error::Duplicate {
            name: name.to_string(),
        });
    }
    map.insert(name.to_string(), value);
    Ok(())
}

fn git_commit() -> Option<String> {
    let git = |args: &[&str]| {
        let output = Command::new("git").args(args).output().ok()?;
        output
            .status
            .success()
            .then(|| String::from_utf8_lossy(&output.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short", "HEAD"])?;
    let dirty =
        git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    Some(if dirty {
        format!("{commit}-dirty")
    } else {
        commit
    })
}

fn read_trimmed(path: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    Some(text.trim().to_string()).filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn json_line_parses_back_with_the_bench_md_keys() {
        let mut report = Report::new("volume.cow", true);
        report
            .figure("plain.write_4k.depth1.latency_us_mean", 812.0)
            .unwrap();
        report
            .figure("super.write_4k.depth1.latency_us_mean", 871.0)
            .unwrap();
        let ratio = report
            .ratio("super_vs_plain.write_4k.depth1.latency", 871.0, 812.0)
            .unwrap();
        assert!((ratio - 871.0 / 812.0).abs() < 1e-12);

        let line = report.to_json_line();
        assert!(!line.contains('\n'));
        let json: Value = serde_json::from_str(&line).unwrap();
        let keys: Vec<&str> = json
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(keys.len(), 5);
        for key in ["bench", "quick", "figures", "ratios", "env"] {
            assert!(keys.contains(&key), "missing {key} in {line}");
        }
        assert_eq!(json["bench"], "volume.cow");
        assert_eq!(json["quick"], true);
        assert_eq!(
            json["figures"]["plain.write_4k.depth1.latency_us_mean"],
            812.0
        );
        let parsed_ratio = json["ratios"]["super_vs_plain.write_4k.depth1.latency"]
            .as_f64()
            .unwrap();
        assert!((parsed_ratio - ratio).abs() < 1e-12);
        assert!(json["env"]["cores"].as_u64().unwrap() >= 1);
        assert!(!json["env"]["git"].as_str().unwrap().is_empty());
    }

    #[test]
    fn ratio_with_zero_or_non_finite_denominator_is_refused_and_not_recorded() {
        let mut report = Report::new("t", false);
        assert!(matches!(
            report.ratio("a_vs_b.x", 1.0, 0.0),
            Err(Error::ZeroDenominator { .. })
        ));
        assert!(matches!(
            report.ratio("a_vs_b.x", 1.0, -0.0),
            Err(Error::ZeroDenominator { .. })
        ));
        assert!(matches!(
            report.ratio("a_vs_b.x", 1.0, f64::NAN),
            Err(Error::NotFinite { .. })
        ));
        assert!(matches!(
            report.ratio("a_vs_b.x", f64::INFINITY, 2.0),
            Err(Error::NotFinite { .. })
        ));
        let json: Value = serde_json::from_str(&report.to_json_line()).unwrap();
        assert_eq!(json["ratios"], serde_json::json!({}));
    }

    #[test]
    fn figures_refuse_non_finite_values_and_duplicates() {
        let mut report = Report::new("t", false);
        assert!(matches!(
            report.figure("x.latency_us", f64::NAN),
            Err(Error::NotFinite { .. })
        ));
        report.figure("x.latency_us", 1.0).unwrap();
        assert!(matches!(
            report.figure("x.latency_us", 2.0),
            Err(Error::Duplicate { .. })
        ));
    }

    #[test]
    fn figure_names_need_a_unit_last_ratio_names_none() {
        for good in [
            "plain.write_4k.depth1.latency_us_mean",
            "latency_us_p999",
            "scan.throughput_ops_per_s",
            "object_size_bytes",
            "failover.downtime_ms",
            "gc.reclaimed_count",
            "cache.hit_percent",
        ] {
            check_figure_name(good).unwrap();
            assert!(
                check_ratio_name(good).is_err(),
                "{good} has a unit, not a ratio name"
            );
        }
        for bad in [
            "write_4k.latency",
            "write_4k.latency_p99",
            "write_4k.us_latency",
            "write_4k.latency_us.",
            ".latency_us",
            "write 4k.latency_us",
            "write_4k.latencyus",
            "",
        ] {
            assert!(check_figure_name(bad).is_err(), "{bad:?} accepted");
        }
        check_ratio_name("super_vs_plain.write_4k.depth1.latency").unwrap();
        check_ratio_name("super_vs_plain.latency_p99").unwrap();
        // A bare unit word names a quantity: a figure, and also a ratio of two such figures.
        check_figure_name("ycsb-A.iops").unwrap();
        check_ratio_name("plain_vs_super_every_1s.parent.iops").unwrap();
        assert!(check_ratio_name("plain_vs_super.parent.write_iops").is_err());
        assert!(check_ratio_name("a..b").is_err());
    }

    #[test]
    fn latency_summary_becomes_unit_suffixed_figures() {
        let mut recorder = crate::LatencyRecorder::new();
        for us in 1..=100 {
            recorder.record_us(us);
        }
        let mut report = Report::new("t", false);
        report
            .latency("plain.read.latency", &recorder.summary())
            .unwrap();
        let json: Value = serde_json::from_str(&report.to_json_line()).unwrap();
        let figures = json["figures"].as_object().unwrap();
        assert_eq!(figures.len(), 6);
        assert_eq!(figures["plain.read.latency_us_p50"], 50.0);
        assert_eq!(figures["plain.read.latency_us_max"], 100.0);

        let empty = crate::LatencyRecorder::new().summary();
        assert!(matches!(
            report.latency("e.latency", &empty),
            Err(Error::EmptyLatency { .. })
        ));
    }
}
