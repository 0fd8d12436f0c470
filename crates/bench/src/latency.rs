//! Latency histograms in microseconds.

use hdrhistogram::Histogram;
use std::time::Duration;

/// Significant decimal digits kept by [`LatencyRecorder`]: values are exact below 2,048 µs and
/// within 0.1 % above.
const SIGNIFICANT_DIGITS: u8 = 3;

/// An HDR histogram of latencies in microseconds that grows to fit any value it is given.
#[derive(Clone, Debug)]
pub struct LatencyRecorder {
    histogram: Histogram<u64>,
}

/// The usual latency statistics of one recorder, in microseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LatencySummary {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
}

impl Default for LatencyRecorder {
    fn default() -> Self {
        Self::new()
    }
}

impl LatencyRecorder {
    pub fn new() -> LatencyRecorder {
        let histogram = Histogram::new(SIGNIFICANT_DIGITS).expect("3 significant digits is valid");
        LatencyRecorder { histogram }
    }

    pub fn record_us(&mut self, latency_us: u64) {
        // `record` grows the histogram; it fails only above i64::MAX / 2 µs (~146,000 years).
        if self.histogram.record(latency_us).is_err() {
            self.histogram.saturating_record(latency_us);
        }
    }

    /// Records a duration, truncated to whole microseconds (sub-microsecond latencies count as 0).
    pub fn record(&mut self, latency: Duration) {
        self.record_us(u64::try_from(latency.as_micros()).unwrap_or(u64::MAX));
    }

    /// Adds every sample of `other`, e.g. to combine the recorders of several client threads.
    pub fn merge(&mut self, other: &LatencyRecorder) {
        self.histogram
            .add(&other.histogram)
            .expect("an auto-resizing histogram accepts any other histogram");
    }

    pub fn count(&self) -> u64 {
        self.histogram.len()
    }

    /// Mean latency; 0 when empty.
    pub fn mean_us(&self) -> f64 {
        self.histogram.mean()
    }

    /// The latency at or below which `percentile` percent (0–100) of samples lie; 0 when empty.
    pub fn percentile_us(&self, percentile: f64) -> u64 {
        // 99.9 / 100 is 0.9990000000000001 in floating point, which would make p99.9 of 1000
        // samples the 1000th rather than the 999th; rounding to 9 decimals gives 0.999.
        let quantile = (percentile * 1e7).round() / 1e9;
        self.histogram.value_at_quantile(quantile)
    }

    /// Largest latency recorded (to the histogram's precision); 0 when empty.
    pub fn max_us(&self) -> u64 {
        self.histogram.max()
    }

    pub fn summary(&self) -> LatencySummary {
        LatencySummary {
            count: self.count(),
            mean_us: self.mean_us(),
            p50_us: self.percentile_us(50.0),
            p90_us: self.percentile_us(90.0),
            p99_us: self.percentile_us(99.0),
            p999_us: self.percentile_us(99.9),
            max_us: self.max_us(),
        }
    }

    /// The empirical CDF as `(latency_us, fraction of samples at or below it)`, one point per
    /// distinct recorded value (bucket), ascending; ready for [`crate::cdf_plot`].
    pub fn cdf_points(&self) -> Vec<(f64, f64)> {
        self.histogram
            .iter_recorded()
            .map(|step| (step.value_iterated_to() as f64, step.quantile()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_to_thousand() -> LatencyRecorder {
        let mut recorder = LatencyRecorder::new();
        for us in 1..=1000 {
            recorder.record_us(us);
        }
        recorder
    }

    #[test]
    fn percentiles_of_known_samples() {
        let recorder = one_to_thousand();
        let summary = recorder.summary();
        assert_eq!(summary.count, 1000);
        assert!((summary.mean_us - 500.5).abs() < 1e-9);
        assert_eq!(summary.p50_us, 500);
        assert_eq!(summary.p90_us, 900);
        assert_eq!(summary.p99_us, 990);
        assert_eq!(summary.p999_us, 999);
        assert_eq!(summary.max_us, 1000);
        assert_eq!(recorder.percentile_us(100.0), 1000);
    }

    #[test]
    fn large_values_keep_three_significant_digits() {
        let mut recorder = LatencyRecorder::new();
        recorder.record(Duration::from_secs(12)); // far beyond the initial range: auto-resize
        let max_us = recorder.max_us() as f64;
        assert!((max_us - 12e6).abs() / 12e6 < 1e-3, "{max_us}");
    }

    #[test]
    fn merge_adds_samples() {
        let mut a = one_to_thousand();
        let mut b = LatencyRecorder::new();
        b.record(Duration::from_micros(2000));
        a.merge(&b);
        assert_eq!(a.count(), 1001);
        assert_eq!(a.max_us(), 2000);
    }

    #[test]
    fn cdf_points_ascend_to_one() {
        let mut recorder = LatencyRecorder::new();
        for us in [10, 10, 10, 20] {
            recorder.record_us(us);
        }
        assert_eq!(recorder.cdf_points(), vec![(10.0, 0.75), (20.0, 1.0)]);
        assert!(LatencyRecorder::new().cdf_points().is_empty());
    }
}
