//! Popularity sampling on the primary and the popularity LRU on each backup (paper §3.3–§3.4,
//! §5.1; spec M10, M15–M16).
//!
//! The primary samples the keys it serves with a small probability p (the paper's 0.001; the
//! bench uses 0.02 because this machine serves ~50–100 k ops/s, not ~3 M) and ships the sampled
//! keys every few seconds. Each backup folds them into a fixed-size LRU popular list. The list
//! decides placement (an entry of a popular key goes to the hot NVMM buffer and hot SSD log, M6,
//! M9) and the order of a proactive BatchPull: most popular first (M15), so the recovering
//! witness gets the keys that will be asked for first.
//!
//! Design choices the paper leaves open:
//! - The sampler draws a geometric *skip* (how many requests pass before the next sample) rather
//!   than one coin per request: the same distribution, one RNG draw per sample instead of per
//!   Get on the hot path.
//! - Samples are aggregated per key between shipments (`(key, count)`), so a hot key costs one
//!   entry per batch, not one per sample, and the counts carry frequency to the backup. The
//!   batch holds at most `batch_keys_max` distinct keys; samples of further keys are dropped and
//!   counted (sampling is best-effort by nature; dropping loses no data, only a hint).
//! - The LRU evicts by recency (the paper's "LRU": a key nobody has asked for lately leaves) but
//!   *orders* by an aged count, so "most popular first" means frequent, not merely last sampled.
//!   Every `halve_every_batches` batches all counts halve, so a shifted hot set overtakes the old
//!   one within a few shipments.
//! - Everything is deterministic given the injected RNG (ordered maps, ties broken by recency
//!   then key), so simulations replay from a seed.

use rand::RngCore;
use std::collections::BTreeMap;

/// Settings of the primary's sampler.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    /// Chance that one served request is sampled, in [0, 1].
    pub probability: f64,
    /// How often sampled keys are shipped to the backups.
    pub ship_interval_ms: u64,
    /// Most distinct keys one shipment holds (bounds memory and message size).
    pub batch_keys_max: usize,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            probability: 0.001,
            ship_interval_ms: 2000,
            batch_keys_max: 4096,
        }
    }
}

/// Settings of a backup's popularity LRU.
#[derive(Clone, Debug, PartialEq)]
pub struct LruConfig {
    /// Most keys the popular list holds; the least recently sampled is evicted beyond it.
    pub entries_max: usize,
    /// Counts halve after this many applied batches (ageing), so popularity follows the
    /// workload.
    pub halve_every_batches: u32,
}

impl Default for LruConfig {
    fn default() -> Self {
        LruConfig {
            entries_max: 65_536,
            halve_every_batches: 8,
        }
    }
}

/// A sampler or LRU setting that cannot work.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PopularityConfigError {
    #[error("sampling probability {0} must be a number in [0, 1]")]
    Probability(f64),
    #[error("{name} must be at least 1")]
    Zero { name: &'static str },
}

/// The primary's sampler of served keys, with an injected RNG (seeded in tests and simulation).
#[derive(Clone, Debug)]
pub struct PopularitySampler<K, R> {
    config: SamplerConfig,
    rng: R,
    /// Requests still to pass before the next sample.
    skip: u64,
    batch: BTreeMap<K, u32>,
    last_ship_us: u64,
    served: u64,
    sampled: u64,
    dropped_samples: u64,
}

impl<K: Ord + Clone, R: RngCore> PopularitySampler<K, R> {
    /// A sampler whose first shipment falls due `ship_interval_ms` after `now_us`.
    pub fn new(config: SamplerConfig, rng: R, now_us: u64) -> Result<Self, PopularityConfigError> {
        if !(0.0..=1.0).contains(&config.probability) {
            return Err(PopularityConfigError::Probability(config.probability));
        }
        if config.batch_keys_max == 0 {
            return Err(PopularityConfigError::Zero {
                name: "batch_keys_max",
            });
        }
        let mut sampler = PopularitySampler {
            config,
            rng,
            skip: 0,
            batch: BTreeMap::new(),
            last_ship_us: now_us,
            served: 0,
            sampled: 0,
            dropped_samples: 0,
        };
        sampler.skip = sampler.draw_skip();
        Ok(sampler)
    }

    /// Requests before the next sample: geometric with success probability p, by inversion.
    fn draw_skip(&mut self) -> u64 {
        let p = self.config.probability;
        if p >= 1.0 {
            return 0;
        }
        if p <= 0.0 {
            return u64::MAX;
        }
        // U uniform in (0, 1]: 53 random bits, plus one so that ln(U) is finite.
        let u = ((self.rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
        let skip = (u.ln() / (1.0 - p).ln()).floor();
        if skip >= u64::MAX as f64 {
            u64::MAX
        } else {
            skip as u64
        }
    }

    /// The primary served a request for `key`. Borrowed (`&[u8]` for `Vec<u8>` keys), so the
    /// ~99 % of requests not sampled cost no allocation.
    pub fn on_served<Q>(&mut self, key: &Q)
    where
        K: std::borrow::Borrow<Q>,
        Q: Ord + ToOwned<Owned = K> + ?Sized,
    {
        self.served += 1;
        if self.skip > 0 {
            self.skip -= 1;
            return;
        }
        self.skip = self.draw_skip();
        self.sampled += 1;
        if let Some(count) = self.batch.get_mut(key) {
            *count = count.saturating_add(1);
        } else if self.batch.len() < self.config.batch_keys_max {
            self.batch.insert(key.to_owned(), 1);
        } else {
            self.dropped_samples += 1;
        }
    }

    /// The shipment due at `now_us`, most sampled first, or `None` if it is not yet time or
    /// nothing was sampled.
    pub fn take_due(&mut self, now_us: u64) -> Option<Vec<(K, u32)>> {
        let due = now_us.saturating_sub(self.last_ship_us) >= self.config.ship_interval_ms * 1000;
        if !due || self.batch.is_empty() {
            return None;
        }
        self.last_ship_us = now_us;
        let mut keys: Vec<(K, u32)> = std::mem::take(&mut self.batch).into_iter().collect();
        // Stable sort over key order: ties stay in key order, so shipments are deterministic.
        keys.sort_by_key(|&(_, count)| std::cmp::Reverse(count));
        Some(keys)
    }

    /// Requests seen, samples taken, and samples dropped for a full batch.
    pub fn counters(&self) -> (u64, u64, u64) {
        (self.served, self.sampled, self.dropped_samples)
    }

    pub fn check_invariants(&self) {
        assert!(self.batch.len() <= self.config.batch_keys_max);
        assert!(self.sampled <= self.served);
        assert!(self.dropped_samples <= self.sampled);
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct LruEntry {
    /// Aged sample count: the popularity order.
    count: u64,
    /// When the key was last sampled (a sequence number): the eviction order.
    recency: u64,
}

/// A backup's bounded popular list: membership by recency (LRU), order by aged sample count.
#[derive(Clone, Debug)]
pub struct PopularityLru<K> {
    config: LruConfig,
    entries: BTreeMap<K, LruEntry>,
    by_recency: BTreeMap<u64, K>,
    next_recency: u64,
    batches_applied: u64,
}

impl<K: Ord + Clone> PopularityLru<K> {
    pub fn new(config: LruConfig) -> Result<Self, PopularityConfigError> {
        for (name, value) in [
            ("entries_max", config.entries_max as u64),
            ("halve_every_batches", u64::from(config.halve_every_batches)),
        ] {
            if value == 0 {
                return Err(PopularityConfigError::Zero { name });
            }
        }
        Ok(PopularityLru {
            config,
            entries: BTreeMap::new(),
            by_recency: BTreeMap::new(),
            next_recency: 0,
            batches_applied: 0,
        })
    }

    /// Folds in one shipment from the primary ([`PopularitySampler::take_due`]).
    pub fn apply(&mut self, batch: &[(K, u32)]) {
        // Least sampled first, so the most sampled keys of the batch end up the most recent
        // and a batch larger than the list evicts its own coldest keys.
        let mut order: Vec<&(K, u32)> = batch.iter().collect();
        order.sort_by_key(|&&(_, count)| count);
        for (key, count) in order {
            let recency = self.next_recency;
            self.next_recency += 1;
            match self.entries.get_mut(key) {
                Some(entry) => {
                    self.by_recency.remove(&entry.recency);
                    entry.count = entry.count.saturating_add(u64::from(*count));
                    entry.recency = recency;
                }
                None => {
                    let entry = LruEntry {
                        count: u64::from(*count),
                        recency,
                    };
                    self.entries.insert(key.clone(), entry);
                }
            }
            self.by_recency.insert(recency, key.clone());
            while self.entries.len() > self.config.entries_max {
                let (_, oldest) = self.by_recency.pop_first().expect("entries are not empty");
                self.entries.remove(&oldest);
            }
        }
        self.batches_applied += 1;
        if self
            .batches_applied
            .is_multiple_of(u64::from(self.config.halve_every_batches))
        {
            for entry in self.entries.values_mut() {
                entry.count /= 2;
            }
        }
    }

    /// Whether `key` is on the popular list: its entries go to the hot buffer and hot log.
    pub fn is_popular(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The `n` most popular keys, most popular first (ties: the more recently sampled first):
    /// the order of a proactive BatchPull.
    pub fn hottest(&self, n: usize) -> Vec<K> {
        let mut ranked: Vec<(&K, &LruEntry)> = self.entries.iter().collect();
        ranked.sort_by_key(|(_, entry)| std::cmp::Reverse((entry.count, entry.recency)));
        ranked
            .into_iter()
            .take(n)
            .map(|(key, _)| key.clone())
            .collect()
    }

    /// The list is bounded and its two maps describe the same entries.
    pub fn check_invariants(&self) {
        assert!(self.entries.len() <= self.config.entries_max);
        assert_eq!(self.entries.len(), self.by_recency.len());
        for (recency, key) in &self.by_recency {
            assert_eq!(self.entries[key].recency, *recency);
            assert!(*recency < self.next_recency);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// A Zipfian(θ) stream over `items` keys by inversion of the exact CDF; rank r is key
    /// `(r * 7919) % items`, so neither key order nor insertion order matches popularity.
    struct Zipf {
        cdf: Vec<f64>,
        items: u64,
    }

    impl Zipf {
        fn new(items: u64, theta: f64) -> Zipf {
            let weights: Vec<f64> = (1..=items).map(|r| 1.0 / (r as f64).powf(theta)).collect();
            let total: f64 = weights.iter().sum();
            let mut acc = 0.0;
            let cdf = weights
                .iter()
                .map(|w| {
                    acc += w / total;
                    acc
                })
                .collect();
            Zipf { cdf, items }
        }

        fn rank(&self, rng: &mut impl Rng) -> u64 {
            let u: f64 = rng.gen();
            self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1) as u64
        }

        fn key_of_rank(&self, rank: u64) -> u64 {
            (rank * 7919) % self.items
        }
    }

    #[test]
    fn zipfian_stream_hot_keys_come_out_first() {
        let zipf = Zipf::new(10_000, 0.99);
        let config = SamplerConfig {
            probability: 0.01,
            // ~100 samples per shipment: one shipment alone ranks the top keys poorly, so
            // the order must come from the counts accumulated (and aged) across shipments.
            ship_interval_ms: 10,
            batch_keys_max: 4096,
        };
        let mut sampler = PopularitySampler::new(config, StdRng::seed_from_u64(1), 0).unwrap();
        let mut lru = PopularityLru::new(LruConfig {
            entries_max: 500,
            halve_every_batches: 8,
        })
        .unwrap();
        let mut workload = StdRng::seed_from_u64(2);
        // 1 M Gets, one per µs: a hundred shipments.
        for now_us in 0..1_000_000u64 {
            sampler.on_served(&zipf.key_of_rank(zipf.rank(&mut workload)));
            if let Some(batch) = sampler.take_due(now_us) {
                lru.apply(&batch);
                lru.check_invariants();
            }
            if now_us % 100_000 == 0 {
                sampler.check_invariants();
            }
        }
        assert!(lru.len() <= 500);
        let hottest = lru.hottest(20);
        let rank_of = |key: u64| {
            (0..zipf.items)
                .find(|&r| zipf.key_of_rank(r) == key)
                .unwrap()
        };
        let ranks: Vec<u64> = hottest.iter().map(|&k| rank_of(k)).collect();
        // Bounds that hold across workload seeds (1–8 checked), and that ordering by recency
        // alone (the last shipment's order) breaks for every one of them: the hottest key
        // leads, the first five are from the true top six, the first ten from the top 25.
        assert_eq!(ranks[0], 0, "{ranks:?}");
        assert!(ranks[..5].iter().all(|&r| r < 6), "{ranks:?}");
        assert!(ranks[..10].iter().all(|&r| r < 25), "{ranks:?}");
        // The true top 10 are all among the first 20 pulled.
        for rank in 0..10 {
            assert!(ranks.contains(&rank), "rank {rank} missing from {ranks:?}");
        }
        // Cold keys are not popular: of the 5000 coldest, barely any made the list.
        let cold_listed = (5_000..10_000)
            .filter(|&r| lru.is_popular(&zipf.key_of_rank(r)))
            .count();
        assert!(cold_listed < 100, "{cold_listed}");
    }

    #[test]
    fn sampling_rate_follows_p() {
        for (p, expected) in [(0.0, 0), (1.0, 200_000), (0.02, 4_000)] {
            let config = SamplerConfig {
                probability: p,
                ..SamplerConfig::default()
            };
            let mut sampler = PopularitySampler::new(config, StdRng::seed_from_u64(9), 0).unwrap();
            for i in 0..200_000u64 {
                sampler.on_served(&(i % 100));
            }
            let (served, sampled, dropped) = sampler.counters();
            assert_eq!((served, dropped), (200_000, 0));
            // Binomial(200 000, 0.02): σ ≈ 63, so ±10 % is over 6σ.
            let slack = expected / 10;
            assert!(
                sampled.abs_diff(expected) <= slack,
                "p {p}: {sampled} samples"
            );
        }
    }

    #[test]
    fn shipments_are_due_on_interval_and_bounded() {
        let config = SamplerConfig {
            probability: 1.0,
            ship_interval_ms: 10,
            batch_keys_max: 3,
        };
        let mut sampler = PopularitySampler::new(config, StdRng::seed_from_u64(0), 0).unwrap();
        for key in [5u32, 5, 9, 1, 7, 7, 5] {
            sampler.on_served(&key);
        }
        sampler.check_invariants();
        assert_eq!(sampler.take_due(9_999), None, "not due before 10 ms");
        // Key 7 did not fit in a batch of 3 distinct keys: its two samples are counted dropped.
        assert_eq!(sampler.take_due(10_000), Some(vec![(5, 3), (1, 1), (9, 1)]));
        assert_eq!(sampler.counters(), (7, 7, 2));
        assert_eq!(sampler.take_due(30_000), None, "nothing sampled since");
        let bad = SamplerConfig {
            probability: 1.5,
            ..SamplerConfig::default()
        };
        assert_eq!(
            PopularitySampler::<u32, _>::new(bad, StdRng::seed_from_u64(0), 0).unwrap_err(),
            PopularityConfigError::Probability(1.5)
        );
    }

    #[test]
    fn lru_evicts_least_recent_and_ageing_lets_a_new_hot_set_lead() {
        let mut lru = PopularityLru::new(LruConfig {
            entries_max: 3,
            halve_every_batches: 1,
        })
        .unwrap();
        lru.apply(&[(1u32, 100), (2, 50), (3, 10)]);
        assert_eq!(lru.hottest(3), vec![1, 2, 3]);
        // Key 4 arrives: 3 was the least recently sampled (the coldest of the first batch was
        // applied first), so it goes, even though the list orders by count.
        lru.apply(&[(4, 1)]);
        lru.check_invariants();
        assert!(!lru.is_popular(&3) && lru.is_popular(&4));
        // Counts halve after every batch: 1 is at 25 now. Key 2 becomes the hot one.
        for _ in 0..3 {
            lru.apply(&[(2, 40), (1, 1)]);
        }
        assert_eq!(lru.hottest(1), vec![2]);
        assert_eq!(lru.len(), 3);
        assert_eq!(
            PopularityLru::<u32>::new(LruConfig {
                entries_max: 0,
                ..LruConfig::default()
            })
            .unwrap_err(),
            PopularityConfigError::Zero {
                name: "entries_max"
            }
        );
    }
}
