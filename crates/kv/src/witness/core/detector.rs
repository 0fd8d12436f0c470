//! The Φ-accrual failure detector behind the soft and hard timeouts (paper §5.1–§5.2, spec M16).
//!
//! CANDStore starts proactive recovery (BatchPull of the hot log) on a *soft* timeout and an
//! election on a *hard* one. The paper gives no values and recommends the Φ-accrual detector of
//! Hayashibara et al. (SRDS'04) with one Φ threshold per timeout. Φ is the negative decimal
//! logarithm of the probability that a heartbeat still arrives this late, given the recent
//! inter-arrival times modelled as a normal distribution: Φ = 1 means a 10 % chance the leader is
//! fine, Φ = 8 one in 10⁸. So the detector adapts to the link and the leader's load: a slow but
//! live leader whose heartbeats jitter widens the distribution and pushes both timeouts out.
//!
//! Two floors guard the statistics: a timeout never fires before its absolute floor in
//! milliseconds (the spec's calibrated soft ≈ 30 ms, hard ≈ 150 ms), so a tiny variance (a quiet
//! loopback) cannot turn a few milliseconds of delay into an election; and the standard deviation
//! is never taken below `std_dev_min_ms`. Until `samples_min` intervals have been seen (a quiet
//! start, or just after [`Detector::reset`]) the floors alone decide, like plain timeouts.
//!
//! Sans-I/O: time is an input (`now_us`, the same monotonic microseconds the cores'
//! `handle(now_us, input)` receive); nothing here reads a clock. The configuration is in
//! milliseconds, the unit operators set timeouts in.

use std::collections::VecDeque;

/// How strongly the leader is suspected at one instant. Ordered: `Hard` implies `Soft`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Suspicion {
    /// Heard from recently enough: nothing to do (and abort a proactive pull if one runs).
    Trusted,
    /// Past the soft threshold: start (or keep) the proactive BatchPull (§5.1).
    Soft,
    /// Past the hard threshold: start an election (§5.3).
    Hard,
}

/// Detector settings. Both Φ thresholds and both floors must hold for a timeout to fire.
#[derive(Clone, Debug, PartialEq)]
pub struct DetectorConfig {
    /// Φ at which the soft timeout fires (3: a one-in-a-thousand chance the leader is fine; a
    /// false soft timeout only costs a little network and disk).
    pub phi_soft: f64,
    /// Φ at which the hard timeout fires (8, Akka's and Cassandra's default: elections are
    /// disruptive, so false positives must be rare).
    pub phi_hard: f64,
    /// The soft timeout never fires sooner than this after the last arrival.
    pub soft_floor_ms: u64,
    /// The hard timeout never fires sooner than this after the last arrival.
    pub hard_floor_ms: u64,
    /// The leader's heartbeat period. Arrivals closer together than half of it (AppendEntries
    /// under load, which also prove life, M11) merge into one sample, so a burst of Puts does
    /// not teach the detector a sub-millisecond mean that the next idle heartbeat would violate.
    pub heartbeat_interval_ms: u64,
    /// Lower bound on the standard deviation, against a near-zero variance on a quiet link.
    pub std_dev_min_ms: u64,
    /// Most inter-arrival intervals kept; older ones are forgotten, so the estimate follows the
    /// leader's current behaviour (Hayashibara's fixed window; Akka keeps 1000).
    pub window_samples_max: usize,
    /// Fewest intervals before Φ is trusted; below this only the floors decide.
    pub samples_min: usize,
}

impl Default for DetectorConfig {
    /// The spec's timeouts (heartbeats every 5 ms, soft ≈ 30 ms, hard ≈ 150 ms) as floors.
    fn default() -> Self {
        DetectorConfig {
            phi_soft: 3.0,
            phi_hard: 8.0,
            soft_floor_ms: 30,
            hard_floor_ms: 150,
            heartbeat_interval_ms: 5,
            std_dev_min_ms: 2,
            window_samples_max: 1000,
            samples_min: 8,
        }
    }
}

/// A detector configuration that cannot work; the message says which setting to change.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DetectorConfigError {
    #[error("phi_soft ({soft}) must be positive and below phi_hard ({hard}), both finite")]
    PhiOrder { soft: f64, hard: f64 },
    #[error("soft_floor_ms ({soft}) must be at most hard_floor_ms ({hard})")]
    FloorOrder { soft: u64, hard: u64 },
    #[error("{name} must be at least 1")]
    Zero { name: &'static str },
    #[error("samples_min ({min}) must be at most window_samples_max ({max})")]
    SamplesMin { min: usize, max: usize },
}

impl DetectorConfig {
    pub fn validate(&self) -> Result<(), DetectorConfigError> {
        let phis_ok = self.phi_soft.is_finite()
            && self.phi_hard.is_finite()
            && self.phi_soft > 0.0
            && self.phi_soft < self.phi_hard;
        if !phis_ok {
            return Err(DetectorConfigError::PhiOrder {
                soft: self.phi_soft,
                hard: self.phi_hard,
            });
        }
        if self.soft_floor_ms > self.hard_floor_ms {
            return Err(DetectorConfigError::FloorOrder {
                soft: self.soft_floor_ms,
                hard: self.hard_floor_ms,
            });
        }
        for (name, value) in [
            ("heartbeat_interval_ms", self.heartbeat_interval_ms),
            ("std_dev_min_ms", self.std_dev_min_ms),
            ("window_samples_max", self.window_samples_max as u64),
            ("samples_min", self.samples_min as u64),
        ] {
            if value == 0 {
                return Err(DetectorConfigError::Zero { name });
            }
        }
        if self.samples_min > self.window_samples_max {
            return Err(DetectorConfigError::SamplesMin {
                min: self.samples_min,
                max: self.window_samples_max,
            });
        }
        Ok(())
    }
}

/// Φ-accrual detector of one leader, with a soft and a hard threshold.
#[derive(Clone, Debug)]
pub struct Detector {
    config: DetectorConfig,
    /// Inter-arrival intervals in µs, oldest first; at most `window_samples_max`.
    intervals_us: VecDeque<u64>,
    /// Exact sums over `intervals_us` (integers, so millions of updates accumulate no error).
    sum_us: u128,
    sum_sq_us2: u128,
    /// The last arrival of any proof of life: the gap is measured from here.
    last_arrival_us: u64,
    /// The arrival that opened the interval being measured (arrivals within half a heartbeat
    /// period of it merged into it).
    last_sample_us: u64,
}

impl Detector {
    /// A detector that counts the leader as just heard at `now_us` (so a leader that never
    /// speaks is suspected at the floors, counted from here).
    pub fn new(config: DetectorConfig, now_us: u64) -> Result<Detector, DetectorConfigError> {
        config.validate()?;
        Ok(Detector {
            intervals_us: VecDeque::with_capacity(config.window_samples_max.min(1024)),
            config,
            sum_us: 0,
            sum_sq_us2: 0,
            last_arrival_us: now_us,
            last_sample_us: now_us,
        })
    }

    pub fn config(&self) -> &DetectorConfig {
        &self.config
    }

    /// Forgets the history, e.g. when a new leader is learnt (the old one's timing says nothing
    /// about it); the new leader counts as heard at `now_us`.
    pub fn reset(&mut self, now_us: u64) {
        self.intervals_us.clear();
        self.sum_us = 0;
        self.sum_sq_us2 = 0;
        self.last_arrival_us = now_us;
        self.last_sample_us = now_us;
    }

    /// A heartbeat (or any message proving the leader alive) arrived at `now_us`. An arrival
    /// earlier than the last one (a driver reordering timestamps) counts as at the last one.
    pub fn heartbeat(&mut self, now_us: u64) {
        let now_us = now_us.max(self.last_arrival_us);
        self.last_arrival_us = now_us;
        let interval_us = now_us - self.last_sample_us;
        if interval_us < self.config.heartbeat_interval_ms * 1000 / 2 {
            return;
        }
        self.last_sample_us = now_us;
        if self.intervals_us.len() == self.config.window_samples_max {
            let old = self.intervals_us.pop_front().expect("window is full");
            self.sum_us -= u128::from(old);
            self.sum_sq_us2 -= u128::from(old) * u128::from(old);
        }
        self.intervals_us.push_back(interval_us);
        self.sum_us += u128::from(interval_us);
        self.sum_sq_us2 += u128::from(interval_us) * u128::from(interval_us);
    }

    /// Intervals currently in the window.
    pub fn samples(&self) -> usize {
        self.intervals_us.len()
    }

    /// Mean inter-arrival time in ms, or `None` before the first interval.
    pub fn mean_ms(&self) -> Option<f64> {
        let n = self.intervals_us.len();
        (n > 0).then(|| self.sum_us as f64 / n as f64 / 1000.0)
    }

    /// Standard deviation of the intervals in ms, at least `std_dev_min_ms`; `None` before the
    /// first interval.
    pub fn std_dev_ms(&self) -> Option<f64> {
        let n = self.intervals_us.len() as f64;
        let mean_us = self.mean_ms()? * 1000.0;
        let variance_us2 = (self.sum_sq_us2 as f64 / n - mean_us * mean_us).max(0.0);
        Some((variance_us2.sqrt() / 1000.0).max(self.config.std_dev_min_ms as f64))
    }

    /// Milliseconds since the last arrival.
    pub fn silence_ms(&self, now_us: u64) -> f64 {
        now_us.saturating_sub(self.last_arrival_us) as f64 / 1000.0
    }

    /// Φ at `now_us`, or `None` while fewer than `samples_min` intervals are known.
    pub fn phi(&self, now_us: u64) -> Option<f64> {
        if self.intervals_us.len() < self.config.samples_min {
            return None;
        }
        Some(phi(
            self.silence_ms(now_us),
            self.mean_ms()?,
            self.std_dev_ms()?,
        ))
    }

    /// How strongly the leader is suspected at `now_us`.
    pub fn suspicion(&self, now_us: u64) -> Suspicion {
        let silence_ms = self.silence_ms(now_us);
        let phi = self.phi(now_us);
        // Without enough samples Φ is unknown, and the floors act alone.
        let past = |threshold: f64, floor_ms: u64| {
            silence_ms >= floor_ms as f64 && phi.is_none_or(|phi| phi >= threshold)
        };
        if past(self.config.phi_hard, self.config.hard_floor_ms) {
            Suspicion::Hard
        } else if past(self.config.phi_soft, self.config.soft_floor_ms) {
            Suspicion::Soft
        } else {
            Suspicion::Trusted
        }
    }

    /// The window is bounded and its sums match its contents.
    pub fn check_invariants(&self) {
        assert!(self.intervals_us.len() <= self.config.window_samples_max);
        assert!(self.last_sample_us <= self.last_arrival_us);
        if cfg!(debug_assertions) {
            let sum: u128 = self.intervals_us.iter().map(|&i| u128::from(i)).sum();
            let sum_sq: u128 = self
                .intervals_us
                .iter()
                .map(|&i| u128::from(i) * u128::from(i))
                .sum();
            assert_eq!((sum, sum_sq), (self.sum_us, self.sum_sq_us2));
        }
    }
}

/// Φ of a silence of `elapsed` given intervals ~ N(mean, std_dev), all in the same unit. Uses
/// the logistic approximation of the normal CDF that Akka's detector uses (error below 1.4e-4),
/// computed from the tail so Φ stays finite and monotone far beyond the mean.
fn phi(elapsed: f64, mean: f64, std_dev: f64) -> f64 {
    let y = (elapsed - mean) / std_dev;
    let e = (-y * (1.5976 + 0.070566 * y * y)).exp();
    if elapsed > mean {
        // P(later) = e / (1 + e); for huge y, e underflows to 0 and Φ is +∞, which still
        // compares correctly against every threshold.
        -(e / (1.0 + e)).log10()
    } else {
        -(1.0 - 1.0 / (1.0 + e)).log10()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    const MS: u64 = 1000;

    fn checked(detector: &Detector) -> &Detector {
        detector.check_invariants();
        detector
    }

    /// The first instants (scanned each ms from `from_us`) at which soft and hard fire.
    fn first_firing(
        detector: &Detector,
        from_us: u64,
        until_us: u64,
    ) -> (Option<u64>, Option<u64>) {
        let mut soft = None;
        let mut hard = None;
        for now_us in (from_us..=until_us).step_by(MS as usize) {
            let level = detector.suspicion(now_us);
            if level >= Suspicion::Soft && soft.is_none() {
                soft = Some(now_us);
            }
            if level == Suspicion::Hard {
                hard = Some(now_us);
                break;
            }
        }
        (soft, hard)
    }

    #[test]
    fn phi_grows_with_silence_and_matches_the_normal_tail() {
        // One standard deviation past the mean: P = 0.1587, Φ = 0.80.
        assert!(
            (phi(15.0, 10.0, 5.0) - 0.7995).abs() < 0.01,
            "{}",
            phi(15.0, 10.0, 5.0)
        );
        // At the mean: P = 0.5, Φ = 0.30.
        assert!((phi(10.0, 10.0, 5.0) - 0.301).abs() < 0.01);
        let mut last = 0.0;
        for elapsed in 0..200 {
            let value = phi(elapsed as f64, 10.0, 2.0);
            assert!(value >= last, "Φ fell at {elapsed}: {value} < {last}");
            last = value;
        }
        assert!(phi(1e6, 10.0, 2.0).is_infinite());
    }

    #[test]
    fn steady_heartbeats_never_fire() {
        // The defaults from a cold start; then floors so low that only Φ can hold a firing back
        // (checked once Φ is known: before that the floors alone decide).
        let low_floors = DetectorConfig {
            soft_floor_ms: 1,
            hard_floor_ms: 2,
            ..DetectorConfig::default()
        };
        for config in [DetectorConfig::default(), low_floors] {
            let mut detector = Detector::new(config, 0).unwrap();
            // 5 ms heartbeats, each up to 0.5 ms early or late, for 20 s, checked each 0.5 ms.
            let mut rng = rand::rngs::StdRng::seed_from_u64(7);
            let mut next_us = 5 * MS;
            let mut now_us = 0;
            while now_us < 20_000 * MS {
                if now_us >= next_us {
                    detector.heartbeat(now_us);
                    next_us = now_us + 5 * MS + rng.gen_range(0..=MS) - MS / 2;
                }
                if detector.phi(now_us).is_some() || detector.config().soft_floor_ms > 1 {
                    assert_eq!(
                        checked(&detector).suspicion(now_us),
                        Suspicion::Trusted,
                        "fired at {now_us} µs, Φ {:?}",
                        detector.phi(now_us)
                    );
                }
                now_us += MS / 2;
            }
            assert!(detector.samples() > 900);
        }
    }

    #[test]
    fn a_gap_fires_soft_before_hard_and_not_before_the_floors() {
        let mut detector = Detector::new(DetectorConfig::default(), 0).unwrap();
        let mut now_us = 0;
        for _ in 0..200 {
            now_us += 5 * MS;
            detector.heartbeat(now_us);
        }
        let last_us = now_us;
        let (soft, hard) = first_firing(checked(&detector), last_us, last_us + 10_000 * MS);
        let soft = soft.expect("a silent leader is suspected");
        let hard = hard.expect("a silent leader is declared failed");
        assert!(soft < hard, "soft {soft} hard {hard}");
        // The heartbeats were regular, so the floors decide: exactly 30 and 150 ms.
        assert_eq!(soft - last_us, 30 * MS);
        assert_eq!(hard - last_us, 150 * MS);
        // Hearing the leader again clears both.
        detector.heartbeat(hard + MS);
        assert_eq!(detector.suspicion(hard + 2 * MS), Suspicion::Trusted);

        // With floors out of the way Φ alone orders them too, and later than the floors would.
        let config = DetectorConfig {
            soft_floor_ms: 1,
            hard_floor_ms: 1,
            ..DetectorConfig::default()
        };
        let mut detector = Detector::new(config, 0).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut now_us = 0;
        for _ in 0..200 {
            now_us += rng.gen_range(5 * MS..=15 * MS);
            detector.heartbeat(now_us);
        }
        let (soft, hard) = first_firing(&detector, now_us, now_us + 10_000 * MS);
        let (soft, hard) = (soft.unwrap() - now_us, hard.unwrap() - now_us);
        assert!(soft < hard, "soft {soft} hard {hard}");
        assert!(soft > 10 * MS && hard < 200 * MS, "soft {soft} hard {hard}");
    }

    #[test]
    fn slow_but_alive_leader_does_not_fire_hard() {
        // Hard floor 40 ms: a plain 40 ms timeout would fire on every long gap below.
        let config = DetectorConfig {
            soft_floor_ms: 20,
            hard_floor_ms: 40,
            ..DetectorConfig::default()
        };
        let mut detector = Detector::new(config, 0).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut now_us = 0;
        let mut gaps_over_floor = 0;
        // A loaded leader: heartbeats 5–40 ms apart, and one in ten delayed to 50–80 ms.
        for beat in 0..3000 {
            let gap_us = if rng.gen_bool(0.1) {
                rng.gen_range(50 * MS..=80 * MS)
            } else {
                rng.gen_range(5 * MS..=40 * MS)
            };
            // Check each ms of the silence, after a warm-up to learn the leader's rhythm.
            if beat >= 100 {
                for t in (MS..gap_us).step_by(MS as usize) {
                    let level = detector.suspicion(now_us + t);
                    assert_ne!(
                        level,
                        Suspicion::Hard,
                        "hard at {t} µs into a {gap_us} µs gap"
                    );
                }
                gaps_over_floor += usize::from(gap_us > 40 * MS);
            }
            now_us += gap_us;
            detector.heartbeat(now_us);
            checked(&detector);
        }
        // Soft may fire now and then (that is its job); the point is that hard does not.
        assert!(gaps_over_floor > 200, "{gaps_over_floor}");
    }

    #[test]
    fn window_is_bounded_and_forgets_old_behaviour() {
        let config = DetectorConfig {
            window_samples_max: 100,
            soft_floor_ms: 1,
            hard_floor_ms: 1,
            ..DetectorConfig::default()
        };
        let mut detector = Detector::new(config, 0).unwrap();
        let mut now_us = 0;
        // A slow leader first (50 ms), then a fast one (5 ms) for a full window.
        for _ in 0..500 {
            now_us += 50 * MS;
            detector.heartbeat(now_us);
            assert!(checked(&detector).samples() <= 100);
        }
        assert!((detector.mean_ms().unwrap() - 50.0).abs() < 1e-9);
        // A 40 ms silence is normal for the slow leader...
        assert_eq!(detector.suspicion(now_us + 40 * MS), Suspicion::Trusted);
        for _ in 0..100 {
            now_us += 5 * MS;
            detector.heartbeat(now_us);
        }
        assert_eq!(detector.samples(), 100);
        // ...but not for the fast one: the 50 ms intervals have left the window.
        assert!((detector.mean_ms().unwrap() - 5.0).abs() < 1e-9);
        assert_eq!(detector.suspicion(now_us + 40 * MS), Suspicion::Hard);
    }

    #[test]
    fn quiet_start_uses_the_floors_and_bursts_merge() {
        let mut detector = Detector::new(DetectorConfig::default(), 1_000 * MS).unwrap();
        assert_eq!(detector.phi(1_000 * MS), None);
        let (soft, hard) = first_firing(&detector, 1_000 * MS, 2_000 * MS);
        assert_eq!((soft, hard), (Some(1_030 * MS), Some(1_150 * MS)));
        // A 2 ms burst of AppendEntries 10 µs apart is one arrival for the statistics (arrivals
        // within half the 5 ms heartbeat period merge), but each one resets the silence.
        for i in 0..200 {
            detector.heartbeat(2_000 * MS + i * 10);
        }
        assert_eq!(detector.samples(), 1);
        assert_eq!(detector.silence_ms(2_000 * MS + 1_990), 0.0);
        detector.reset(3_000 * MS);
        assert_eq!(
            (detector.samples(), detector.suspicion(3_001 * MS)),
            (0, Suspicion::Trusted)
        );
    }

    #[test]
    fn bad_configurations_are_refused() {
        let bad = |config: DetectorConfig| Detector::new(config, 0).unwrap_err();
        let base = DetectorConfig::default();
        assert!(matches!(
            bad(DetectorConfig {
                phi_soft: 9.0,
                ..base.clone()
            }),
            DetectorConfigError::PhiOrder { .. }
        ));
        assert!(matches!(
            bad(DetectorConfig {
                phi_hard: f64::NAN,
                ..base.clone()
            }),
            DetectorConfigError::PhiOrder { .. }
        ));
        assert!(matches!(
            bad(DetectorConfig {
                soft_floor_ms: 200,
                ..base.clone()
            }),
            DetectorConfigError::FloorOrder { .. }
        ));
        assert_eq!(
            bad(DetectorConfig {
                window_samples_max: 0,
                ..base.clone()
            }),
            DetectorConfigError::Zero {
                name: "window_samples_max"
            }
        );
        assert!(matches!(
            bad(DetectorConfig {
                samples_min: 2000,
                ..base
            }),
            DetectorConfigError::SamplesMin { .. }
        ));
    }
}
