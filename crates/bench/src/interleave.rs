//! Measuring variants alternately, so that noise and drift on a shared machine hit them alike.

/// Runs `rounds` rounds of `measure(variant)` for each of `variants` variants and returns the
/// results as `results[variant][round]`.
///
/// Rounds alternate direction (ABBA: `0 1 | 1 0 | 0 1 | ...`), so no variant always runs first
/// or right after the same neighbour, and a drift that is linear in time (a warming cache, a
/// neighbour's build winding down) adds the same total to every variant over an even number of
/// rounds. Keep each call short next to the drift (one batch of operations, not a whole run),
/// and compute ratios from these interleaved results, never from runs measured one after the
/// other.
pub fn run_interleaved<T>(
    rounds: usize,
    variants: usize,
    mut measure: impl FnMut(usize) -> T,
) -> Vec<Vec<T>> {
    let mut results: Vec<Vec<T>> = (0..variants).map(|_| Vec::with_capacity(rounds)).collect();
    for round in 0..rounds {
        for step in 0..variants {
            let variant = if round % 2 == 0 {
                step
            } else {
                variants - 1 - step
            };
            results[variant].push(measure(variant));
        }
    }
    results
}

/// The ABBA order of `run_interleaved` as a list of variant indices, for callers whose
/// measurements are asynchronous and so cannot be a plain closure.
pub fn interleaved_order(rounds: usize, variants: usize) -> Vec<usize> {
    let mut order = Vec::with_capacity(rounds * variants);
    run_interleaved(rounds, variants, |v| order.push(v));
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abba_order_cancels_linear_drift() {
        let mut order = Vec::new();
        let mut clock = 0u64;
        let results = run_interleaved(4, 2, |variant| {
            order.push(variant);
            clock += 1;
            clock // a "measurement" that drifts linearly with time
        });
        assert_eq!(order, vec![0, 1, 1, 0, 0, 1, 1, 0]);
        assert_eq!(
            results[0].iter().sum::<u64>(),
            results[1].iter().sum::<u64>()
        );
        assert_eq!(results[0].len(), 4);
    }

    #[test]
    fn three_variants_reverse_on_odd_rounds() {
        let mut order = Vec::new();
        run_interleaved(2, 3, |variant| order.push(variant));
        assert_eq!(order, vec![0, 1, 2, 2, 1, 0]);
    }
}
