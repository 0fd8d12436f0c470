//! Latency percentiles and throughput per fixed time window, for SLO timelines around a failure
//! (CANDStore §7.5: p99.9 and p50 over non-overlapping 100 ms windows).

use crate::Error;
use hdrhistogram::Histogram;
use std::time::Duration;

/// The window of CANDStore's evaluation (§7.5).
pub const LATENCY_WINDOW_DEFAULT: Duration = Duration::from_millis(100);

/// Most windows one [`WindowedLatency`] holds: 30 minutes of 100 ms windows. Each window that
/// saw a completion holds one histogram of at most ~15 KiB (latencies up to seconds at
/// [`WINDOW_SIGNIFICANT_DIGITS`]), so the cap bounds memory at ~270 MB even if every window is
/// busy; a benchmark run lasts minutes.
pub const LATENCY_WINDOWS_MAX: usize = 18_000;

/// Significant digits per window histogram: values are exact below 256 µs and within 1 % above.
/// Two, not the three of [`crate::LatencyRecorder`]: a window is judged against an SLO that is a
/// multiple (≥ 1.5×) of a steady percentile, where 1 % does not change a verdict, and it makes
/// each window's histogram ~8× smaller.
pub const WINDOW_SIGNIFICANT_DIGITS: u8 = 2;

/// One HDR histogram of latencies (µs) per fixed window of completion time since a start the
/// caller chooses (one `Instant` shared by all clients, or virtual time in a simulation).
///
/// Many client tasks record into one each (no lock on the hot path) and [`WindowedLatency::merge`]
/// them at the end; or share one behind a mutex. An operation counts in the window in which it
/// completes, retries included (spec (e)). Samples past the cap are not stored but counted
/// ([`WindowedLatency::samples_past_cap`]); asking for windows past the cap is an error, so no
/// window silently reads empty.
#[derive(Clone, Debug)]
pub struct WindowedLatency {
    window: Duration,
    windows_max: usize,
    /// Index i covers completions in [i × window, (i + 1) × window); `None` until one arrives.
    histograms: Vec<Option<Histogram<u64>>>,
    samples_past_cap: u64,
}

/// The statistics of one window. Percentiles are `None` when nothing completed in it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WindowStats {
    pub start: Duration,
    pub end: Duration,
    /// Operations completed in the window.
    pub count: u64,
    pub ops_per_s: f64,
    pub p50_us: Option<u64>,
    pub p99_us: Option<u64>,
    pub p999_us: Option<u64>,
    pub max_us: Option<u64>,
}

/// Which per-window percentile an SLO bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Percentile {
    P50,
    P99,
    P999,
}

impl Percentile {
    /// This percentile of `window`, `None` if the window is empty.
    pub fn of(self, window: &WindowStats) -> Option<u64> {
        match self {
            Percentile::P50 => window.p50_us,
            Percentile::P99 => window.p99_us,
            Percentile::P999 => window.p999_us,
        }
    }

    /// The statistic suffix of figure names (`p50`, `p99`, `p999`).
    pub fn name(self) -> &'static str {
        match self {
            Percentile::P50 => "p50",
            Percentile::P99 => "p99",
            Percentile::P999 => "p999",
        }
    }
}

impl WindowedLatency {
    /// Windows of `window` (e.g. [`LATENCY_WINDOW_DEFAULT`]), at most [`LATENCY_WINDOWS_MAX`].
    pub fn new(window: Duration) -> WindowedLatency {
        WindowedLatency::with_cap(window, LATENCY_WINDOWS_MAX)
    }

    /// Windows of `window`, at most `windows_max` of them. Panics if either is zero.
    pub fn with_cap(window: Duration, windows_max: usize) -> WindowedLatency {
        assert!(
            !window.is_zero(),
            "a latency window must be longer than zero"
        );
        assert!(
            windows_max > 0,
            "a windowed latency needs room for a window"
        );
        WindowedLatency {
            window,
            windows_max,
            histograms: Vec::new(),
            samples_past_cap: 0,
        }
    }

    pub fn window(&self) -> Duration {
        self.window
    }

    /// Records one operation that completed `completed` after the start and took `latency`.
    pub fn record(&mut self, completed: Duration, latency: Duration) {
        self.record_us(
            completed,
            u64::try_from(latency.as_micros()).unwrap_or(u64::MAX),
        );
    }

    /// Records one operation that completed `completed` after the start and took `latency_us`.
    pub fn record_us(&mut self, completed: Duration, latency_us: u64) {
        let index = completed.as_nanos() / self.window.as_nanos();
        if index >= self.windows_max as u128 {
            self.samples_past_cap += 1;
            return;
        }
        let histogram = self.histogram_mut(index as usize);
        if histogram.record(latency_us).is_err() {
            histogram.saturating_record(latency_us);
        }
    }

    fn histogram_mut(&mut self, index: usize) -> &mut Histogram<u64> {
        if index >= self.histograms.len() {
            self.histograms.resize(index + 1, None);
        }
        self.histograms[index].get_or_insert_with(|| {
            Histogram::new(WINDOW_SIGNIFICANT_DIGITS).expect("2 significant digits is valid")
        })
    }

    /// Adds every sample of `other`, which must use the same window and start.
    pub fn merge(&mut self, other: &WindowedLatency) {
        assert_eq!(
            self.window, other.window,
            "merging latencies of different windows"
        );
        for (index, theirs) in other.histograms.iter().enumerate() {
            if let Some(theirs) = theirs.as_ref().filter(|_| index < self.windows_max) {
                self.histogram_mut(index)
                    .add(theirs)
                    .expect("an auto-resizing histogram accepts any other histogram");
            } else if let Some(theirs) = theirs {
                self.samples_past_cap += theirs.len();
            }
        }
        self.samples_past_cap += other.samples_past_cap;
    }

    /// Samples that completed past the last window the cap allows, and were not stored.
    pub fn samples_past_cap(&self) -> u64 {
        self.samples_past_cap
    }

    /// Operations recorded in all windows.
    pub fn count(&self) -> u64 {
        self.histograms.iter().flatten().map(|h| h.len()).sum()
    }

    /// The statistics of every *complete* window from the start to `run_end`, empty windows
    /// included (a stall shows as windows with no completions). A window cut short by the end of
    /// the run is left out: its few completions would misrepresent it. Errs if `run_end` is past
    /// the cap.
    pub fn windows(&self, run_end: Duration) -> Result<Vec<WindowStats>, Error> {
        let complete = (run_end.as_nanos() / self.window.as_nanos()) as usize;
        if complete > self.windows_max {
            return Err(Error::WindowCap {
                run_end,
                window: self.window,
                windows_max: self.windows_max,
            });
        }
        let window_s = self.window.as_secs_f64();
        Ok((0..complete)
            .map(|i| {
                let histogram = self.histograms.get(i).and_then(Option::as_ref);
                let count = histogram.map_or(0, |h| h.len());
                let at = |percentile: f64| {
                    let h = histogram.filter(|h| !h.is_empty())?;
                    // As LatencyRecorder::percentile_us: 99.9 / 100 is 0.9990000000000001.
                    Some(h.value_at_quantile((percentile * 1e7).round() / 1e9))
                };
                let at_index =
                    |i: usize| Duration::from_nanos((self.window.as_nanos() * i as u128) as u64);
                WindowStats {
                    start: at_index(i),
                    end: at_index(i + 1),
                    count,
                    ops_per_s: count as f64 / window_s,
                    p50_us: at(50.0),
                    p99_us: at(99.0),
                    p999_us: at(99.9),
                    max_us: histogram.filter(|h| !h.is_empty()).map(|h| h.max()),
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn percentiles_and_throughput_per_window() {
        let mut latency = WindowedLatency::new(LATENCY_WINDOW_DEFAULT);
        // Window 0: 1000 completions of 1..=1000 µs; window 1: nothing; window 2: one of 7 µs.
        for us in 1..=1000 {
            latency.record_us(MS * (us as u32 % 100), us);
        }
        latency.record(MS * 250, Duration::from_micros(7));
        // The run ended 30 ms into window 3: it is cut short and left out.
        let windows = latency.windows(MS * 330).unwrap();
        assert_eq!(windows.len(), 3);
        let first = &windows[0];
        assert_eq!(
            (first.start, first.end, first.count),
            (Duration::ZERO, MS * 100, 1000)
        );
        assert_eq!(first.ops_per_s, 10_000.0);
        // Two significant digits: exact below 256 µs, within 1 % above.
        let p50 = first.p50_us.unwrap();
        let p999 = first.p999_us.unwrap();
        assert!(p50.abs_diff(500) <= 5, "{p50}");
        assert!(p999.abs_diff(999) <= 10, "{p999}");
        assert_eq!(windows[1].count, 0);
        assert_eq!(
            (windows[1].p50_us, windows[1].p999_us, windows[1].max_us),
            (None, None, None)
        );
        assert_eq!(windows[2].p999_us, Some(7));
        assert_eq!(latency.count(), 1001);
    }

    #[test]
    fn merge_of_many_clients_equals_one_recorder() {
        let mut all = WindowedLatency::new(MS * 10);
        let mut merged = WindowedLatency::new(MS * 10);
        for client in 0..8u64 {
            let mut mine = WindowedLatency::new(MS * 10);
            for i in 0..500u64 {
                let completed = Duration::from_micros(client * 7 + i * 97);
                let latency_us = 10 + (i * client) % 300;
                mine.record_us(completed, latency_us);
                all.record_us(completed, latency_us);
            }
            merged.merge(&mine);
        }
        let end = Duration::from_micros(8 * 7 + 500 * 97);
        assert_eq!(merged.windows(end).unwrap(), all.windows(end).unwrap());
        assert_eq!(merged.count(), 4000);
    }

    #[test]
    fn the_cap_bounds_windows_and_says_so() {
        let mut latency = WindowedLatency::with_cap(MS * 100, 10);
        latency.record_us(MS * 999, 5);
        latency.record_us(MS * 1000, 5);
        latency.record_us(Duration::from_secs(3600), 5);
        assert_eq!(latency.samples_past_cap(), 2);
        assert_eq!(latency.count(), 1);
        assert!(latency.histograms.len() <= 10);
        assert_eq!(latency.windows(MS * 1000).unwrap().len(), 10);
        let error = latency.windows(MS * 1100).unwrap_err();
        assert!(matches!(error, Error::WindowCap { .. }), "{error}");
        // Merging into a smaller cap counts what does not fit.
        let mut small = WindowedLatency::with_cap(MS * 100, 5);
        small.merge(&latency);
        assert_eq!((small.count(), small.samples_past_cap()), (0, 3));
    }
}
