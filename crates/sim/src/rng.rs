//! [`SimRng`]: the one source of randomness in a simulation, reproducible from a `u64` seed.

use rand::seq::SliceRandom;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A seeded ChaCha8 random number generator with the helpers simulations need.
///
/// Every random choice in a run (network delays, drops, crash outcomes, workload) should come from
/// one `SimRng` or from children made with [`SimRng::fork`], so one seed replays the run exactly.
/// It also implements [`RngCore`], so `rand::Rng` methods work on it.
#[derive(Clone, Debug)]
pub struct SimRng {
    inner: ChaCha8Rng,
}

impl SimRng {
    /// A generator whose whole output is determined by `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            inner: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// True with probability `p`. `chance(0.0)` is always false, `chance(1.0)` always true.
    ///
    /// Panics if `p` is not within `0.0..=1.0` (a configuration bug, not a simulated fault).
    pub fn chance(&mut self, p: f64) -> bool {
        assert!(
            (0.0..=1.0).contains(&p),
            "probability {p} is outside 0.0..=1.0"
        );
        self.inner.gen_bool(p)
    }

    /// A uniform value in `lo..=hi` (both ends **inclusive**, so `range_u64(5, 5) == 5`).
    ///
    /// Panics if `lo > hi`.
    pub fn range_u64(&mut self, lo: u64, hi: u64) -> u64 {
        assert!(lo <= hi, "range_u64: lo ({lo}) > hi ({hi})");
        self.inner.gen_range(lo..=hi)
    }

    /// A uniformly chosen element, or `None` if `items` is empty.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        items.choose(&mut self.inner)
    }

    /// Shuffles `items` in place (uniform permutation).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        items.shuffle(&mut self.inner);
    }

    /// A child generator seeded from this one's output. The child's stream is independent of the
    /// parent's later output, and forking is itself deterministic: the same parent state always
    /// yields the same child. Use one child per component (network, each disk, workload) so that
    /// adding random draws to one component does not perturb the others.
    pub fn fork(&mut self) -> SimRng {
        let mut seed = [0u8; 32];
        self.inner.fill_bytes(&mut seed);
        Self {
            inner: ChaCha8Rng::from_seed(seed),
        }
    }
}

impl RngCore for SimRng {
    fn next_u32(&mut self) -> u32 {
        self.inner.next_u32()
    }
    fn next_u64(&mut self) -> u64 {
        self.inner.next_u64()
    }
    fn fill_bytes(&mut self, dest: &mut [u8]) {
        self.inner.fill_bytes(dest)
    }
    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), rand::Error> {
        self.inner.try_fill_bytes(dest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draws(rng: &mut SimRng) -> Vec<u64> {
        (0..16).map(|_| rng.next_u64()).collect()
    }

    #[test]
    fn same_seed_same_stream_different_seed_different_stream() {
        assert_eq!(draws(&mut SimRng::new(7)), draws(&mut SimRng::new(7)));
        assert_ne!(draws(&mut SimRng::new(7)), draws(&mut SimRng::new(8)));
    }

    #[test]
    fn fork_is_deterministic_and_independent_of_parent() {
        let (mut a, mut b) = (SimRng::new(1), SimRng::new(1));
        let (mut child_a, mut child_b) = (a.fork(), b.fork());
        assert_eq!(draws(&mut child_a), draws(&mut child_b));
        assert_ne!(draws(&mut a.fork()), draws(&mut a));
    }

    #[test]
    fn helpers_respect_their_bounds() {
        let mut rng = SimRng::new(3);
        assert!((0..100).all(|_| !rng.chance(0.0)) && (0..100).all(|_| rng.chance(1.0)));
        let values: Vec<u64> = (0..1000).map(|_| rng.range_u64(10, 12)).collect();
        assert!(values.iter().all(|v| (10..=12).contains(v)));
        assert!(
            values.contains(&10) && values.contains(&12),
            "both ends are inclusive"
        );
        assert_eq!(rng.range_u64(5, 5), 5);
        assert_eq!(rng.pick::<u8>(&[]), None);
        assert_eq!(rng.pick(&[9]), Some(&9));
        let mut items: Vec<u32> = (0..50).collect();
        rng.shuffle(&mut items);
        assert_ne!(items, (0..50).collect::<Vec<_>>());
        items.sort();
        assert_eq!(items, (0..50).collect::<Vec<_>>());
    }

    #[test]
    #[should_panic(expected = "outside 0.0..=1.0")]
    fn chance_rejects_bad_probability() {
        SimRng::new(0).chance(1.5);
    }
}
