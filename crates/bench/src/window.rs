//! Throughput per time window, for timelines such as the throughput drop during a failover.

use std::time::Duration;

/// Most windows one [`WindowedCounter`] holds (8 MiB of counts): 29 hours of 100 ms windows.
pub const WINDOWS_MAX: usize = 1 << 20;

/// Counts operation completions per fixed window of time since a start the caller chooses
/// (typically one `Instant` shared by all client threads, or virtual time in a simulation).
/// Windows in which nothing completed count zero, so a stall shows as a gap in the timeline.
#[derive(Clone, Debug)]
pub struct WindowedCounter {
    window: Duration,
    ops_per_window: Vec<u64>,
}

impl WindowedCounter {
    /// A counter of `window`-long windows (e.g. 100 ms). Panics if `window` is zero.
    pub fn new(window: Duration) -> WindowedCounter {
        assert!(
            !window.is_zero(),
            "a throughput window must be longer than zero"
        );
        WindowedCounter {
            window,
            ops_per_window: Vec::new(),
        }
    }

    /// Records one operation completed `since_start` after the start.
    pub fn record(&mut self, since_start: Duration) {
        self.record_n(since_start, 1);
    }

    /// Records `ops` operations completed together `since_start` after the start.
    ///
    /// Panics past [`WINDOWS_MAX`] windows: the window is too short for the run.
    pub fn record_n(&mut self, since_start: Duration, ops: u64) {
        let index = (since_start.as_nanos() / self.window.as_nanos()) as usize;
        assert!(
            index < WINDOWS_MAX,
            "completion at {since_start:?} is past {WINDOWS_MAX} windows of {:?}; use a longer window",
            self.window
        );
        if index >= self.ops_per_window.len() {
            self.ops_per_window.resize(index + 1, 0);
        }
        self.ops_per_window[index] += ops;
    }

    /// Adds the counts of `other`, which must use the same window and start.
    pub fn merge(&mut self, other: &WindowedCounter) {
        assert_eq!(
            self.window, other.window,
            "merging counters of different windows"
        );
        if other.ops_per_window.len() > self.ops_per_window.len() {
            self.ops_per_window.resize(other.ops_per_window.len(), 0);
        }
        for (mine, theirs) in self.ops_per_window.iter_mut().zip(&other.ops_per_window) {
            *mine += theirs;
        }
    }

    /// Operations recorded in all windows.
    pub fn count(&self) -> u64 {
        self.ops_per_window.iter().sum()
    }

    /// Throughput of each window, from the start to the last window with a completion. The last
    /// window may have been cut short by the end of the run, which makes it read low.
    pub fn ops_per_s(&self) -> Vec<f64> {
        let window_s = self.window.as_secs_f64();
        self.ops_per_window
            .iter()
            .map(|&ops| ops as f64 / window_s)
            .collect()
    }

    /// `(window start in seconds, ops/s)` per window, ready for [`crate::line_plot`].
    pub fn timeline(&self) -> Vec<(f64, f64)> {
        let window_s = self.window.as_secs_f64();
        self.ops_per_s()
            .into_iter()
            .enumerate()
            .map(|(i, rate)| (i as f64 * window_s, rate))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_window_with_gaps() {
        let mut counter = WindowedCounter::new(Duration::from_millis(100));
        for ms in [0, 10, 99, 100, 350] {
            counter.record(Duration::from_millis(ms));
        }
        counter.record_n(Duration::from_millis(399), 2);
        assert_eq!(counter.count(), 7);
        assert_eq!(counter.ops_per_s(), vec![30.0, 10.0, 0.0, 30.0]);
        assert_eq!(counter.timeline()[3], (0.30000000000000004, 30.0));
    }

    #[test]
    fn merge_aligns_windows() {
        let mut a = WindowedCounter::new(Duration::from_secs(1));
        a.record(Duration::from_millis(500));
        let mut b = WindowedCounter::new(Duration::from_secs(1));
        b.record(Duration::from_millis(700));
        b.record(Duration::from_millis(2100));
        a.merge(&b);
        assert_eq!(a.ops_per_s(), vec![2.0, 0.0, 1.0]);
    }

    #[test]
    #[should_panic(expected = "use a longer window")]
    fn refuses_more_than_the_window_limit() {
        let mut counter = WindowedCounter::new(Duration::from_millis(1));
        counter.record(Duration::from_millis(WINDOWS_MAX as u64));
    }
}
