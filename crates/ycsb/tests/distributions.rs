//! The key choosers against their definitions, statistically, at fixed seeds: each test fails
//! on a wrong distribution (a different θ, an off-by-one rank, a wrong normalisation).

use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use ycsb::{
    fnv_hash64, zeta, KeyChooser, RequestDistribution, ScrambledZipfian, SkewedLatest, Zipfian,
};

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// Pearson's χ² of observed counts against expected probabilities over `n` samples.
fn chi_square(observed: &[u64], expected_p: &[f64], n: u64) -> f64 {
    observed
        .iter()
        .zip(expected_p)
        .map(|(&o, &p)| {
            let e = p * n as f64;
            (o as f64 - e).powi(2) / e
        })
        .sum()
}

/// An upper bound for χ² with `df` degrees of freedom that a correct sampler exceeds with
/// probability about 1e-6 (Wilson–Hilferty, z = 4.75).
fn chi_square_limit(df: usize) -> f64 {
    let k = df as f64;
    let z = 4.75;
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

fn zipf_counts(z: &Zipfian, samples: u64, seed: u64) -> Vec<u64> {
    let mut counts = vec![0u64; z.items() as usize];
    let mut r = rng(seed);
    for _ in 0..samples {
        let k = z.sample(&mut r);
        assert!((1..=z.items()).contains(&k));
        counts[(k - 1) as usize] += 1;
    }
    counts
}

#[test]
fn zeta_matches_direct_sums_and_ycsb_constant() {
    for theta in [0.5, 0.99, 1.0, 1.1, 2.0] {
        let direct: f64 = (1..=200_000u64).map(|k| (k as f64).powf(-theta)).sum();
        let fast = zeta(200_000, theta);
        assert!(
            (direct - fast).abs() / direct < 1e-11,
            "θ {theta}: {direct} vs {fast}"
        );
    }
    // YCSB's ScrambledZipfianGenerator hard-codes ζ(10^10, 0.99) = 26.46902820178302.
    let z = zeta(10_000_000_000, 0.99);
    assert!((z - 26.469_028_201_783_02).abs() < 1e-7, "{z}");
}

#[test]
fn zipfian_099_rank_frequency_matches_zipfs_law() {
    let (n, samples) = (1000u64, 1_000_000u64);
    let z = Zipfian::new(n, 0.99).unwrap();
    let counts = zipf_counts(&z, samples, 42);
    let expected: Vec<f64> = (1..=n).map(|k| z.probability(k)).collect();
    let chi2 = chi_square(&counts, &expected, samples);
    assert!(chi2 < chi_square_limit(n as usize - 1), "χ² {chi2}");
    // The head, rank by rank, within 1 % (rank 1 has ~133,000 samples: 1 σ ≈ 0.25 %).
    for k in 1..=10 {
        let got = counts[k - 1] as f64 / samples as f64;
        let want = expected[k - 1];
        assert!((got / want - 1.0).abs() < 0.01, "rank {k}: {got} vs {want}");
    }
    // The rank-frequency slope on log-log axes over ranks 1..100 is -θ.
    let points: Vec<(f64, f64)> = (1..=100)
        .map(|k| ((k as f64).ln(), (counts[k - 1] as f64).ln()))
        .collect();
    let mx = points.iter().map(|p| p.0).sum::<f64>() / 100.0;
    let my = points.iter().map(|p| p.1).sum::<f64>() / 100.0;
    let slope = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum::<f64>()
        / points.iter().map(|p| (p.0 - mx).powi(2)).sum::<f64>();
    assert!((slope + 0.99).abs() < 0.02, "slope {slope}");
}

#[test]
fn zipfian_wrong_theta_would_be_caught() {
    // The same test statistic rejects samples of θ = 0.9 as θ = 0.99: the test has power.
    let (n, samples) = (1000u64, 1_000_000u64);
    let sampled = Zipfian::new(n, 0.9).unwrap();
    let claimed = Zipfian::new(n, 0.99).unwrap();
    let counts = zipf_counts(&sampled, samples, 42);
    let expected: Vec<f64> = (1..=n).map(|k| claimed.probability(k)).collect();
    assert!(chi_square(&counts, &expected, samples) > 10.0 * chi_square_limit(n as usize - 1));
}

#[test]
fn zipfian_other_thetas_match() {
    for (theta, n) in [(0.5, 100u64), (1.0, 100), (1.1, 200), (2.5, 50)] {
        let samples = 300_000;
        let z = Zipfian::new(n, theta).unwrap();
        let counts = zipf_counts(&z, samples, 7);
        // Merge the tail so every cell expects at least 20 samples.
        let (mut obs, mut exp) = (vec![], vec![]);
        let (mut o_acc, mut e_acc) = (0u64, 0.0);
        for k in 1..=n {
            o_acc += counts[(k - 1) as usize];
            e_acc += z.probability(k);
            if e_acc * samples as f64 >= 20.0 || k == n {
                obs.push(o_acc);
                exp.push(e_acc);
                (o_acc, e_acc) = (0, 0.0);
            }
        }
        let chi2 = chi_square(&obs, &exp, samples);
        assert!(
            chi2 < chi_square_limit(obs.len() - 1),
            "θ {theta}: χ² {chi2} over {} cells",
            obs.len()
        );
    }
}

#[test]
fn zipfian_over_ten_billion_items_has_the_right_head() {
    // Correct for large item counts: no table, the head follows 1/ζ(10^10, θ).
    let z = Zipfian::new(10_000_000_000, 0.99).unwrap();
    let samples = 1_000_000u64;
    let mut r = rng(9);
    let mut head = [0u64; 5];
    let mut beyond_billion = 0u64;
    for _ in 0..samples {
        let k = z.sample(&mut r);
        if k <= 5 {
            head[(k - 1) as usize] += 1;
        }
        if k > 1_000_000_000 {
            beyond_billion += 1;
        }
    }
    let zn = zeta(10_000_000_000, 0.99);
    for k in 1..=5u64 {
        let want = (k as f64).powf(-0.99) / zn;
        let got = head[(k - 1) as usize] as f64 / samples as f64;
        let sd = (want * (1.0 - want) / samples as f64).sqrt();
        assert!((got - want).abs() < 5.0 * sd, "rank {k}: {got} vs {want}");
    }
    // P(rank > 10^9) = 1 - ζ(10^9)/ζ(10^10).
    let want = 1.0 - zeta(1_000_000_000, 0.99) / zn;
    let got = beyond_billion as f64 / samples as f64;
    assert!(
        (got - want).abs() < 5.0 * (want / samples as f64).sqrt(),
        "{got} vs {want}"
    );
}

#[test]
fn zipfian_item_count_grows_incrementally() {
    let mut z = Zipfian::new(10, 0.99).unwrap();
    z.set_items(1000);
    let grown = zipf_counts(&z, 300_000, 3);
    let fresh = Zipfian::new(1000, 0.99).unwrap();
    let expected: Vec<f64> = (1..=1000).map(|k| fresh.probability(k)).collect();
    let chi2 = chi_square(&grown, &expected, 300_000);
    assert!(chi2 < chi_square_limit(999), "χ² {chi2}");
}

#[test]
fn scrambled_zipfian_matches_hashed_ranks() {
    // Expected probability of key b: the sum of P(rank) over ranks hashing to b. Ranks up to
    // 10^6 are summed exactly; the rest (about half the mass) is spread evenly, which FNV's
    // scattering makes true to far below the test's resolution.
    let (items, samples) = (1000u64, 1_000_000u64);
    let s = ScrambledZipfian::new(items, 0.99).unwrap();
    let zn = zeta(10_000_000_000, 0.99);
    let mut expected = vec![0.0; items as usize];
    let mut head_mass = 0.0;
    for rank in 1..=1_000_000u64 {
        let p = (rank as f64).powf(-0.99) / zn;
        expected[(fnv_hash64(rank - 1) % items) as usize] += p;
        head_mass += p;
    }
    for e in &mut expected {
        *e += (1.0 - head_mass) / items as f64;
    }
    let mut counts = vec![0u64; items as usize];
    let mut r = rng(11);
    for _ in 0..samples {
        counts[s.sample(&mut r) as usize] += 1;
    }
    let chi2 = chi_square(&counts, &expected, samples);
    assert!(chi2 < chi_square_limit(items as usize - 1), "χ² {chi2}");
    // The most popular key is where rank 1 lands, as in YCSB.
    let top = counts
        .iter()
        .enumerate()
        .max_by_key(|(_, c)| **c)
        .unwrap()
        .0 as u64;
    assert_eq!(top, s.keynum_of_rank(1));
    assert_eq!(s.keynum_of_rank(1), fnv_hash64(0) % items);
}

#[test]
fn uniform_is_flat() {
    let mut chooser = KeyChooser::new(RequestDistribution::Uniform, 100, 0).unwrap();
    let mut counts = vec![0u64; 100];
    let mut r = rng(5);
    for _ in 0..200_000 {
        counts[chooser.next(&mut r, 99) as usize] += 1;
    }
    let chi2 = chi_square(&counts, &[0.01; 100], 200_000);
    assert!(chi2 < chi_square_limit(99), "χ² {chi2}");
}

#[test]
fn latest_favours_the_newest_records_as_they_arrive() {
    let mut latest = SkewedLatest::new(0.99).unwrap();
    let mut r = rng(13);
    for last in [999u64, 1999, 5000] {
        let samples = 200_000u64;
        let items = last + 1;
        let mut by_age = vec![0u64; items as usize];
        for _ in 0..samples {
            let k = latest.sample(&mut r, last);
            assert!(k <= last);
            by_age[(last - k) as usize] += 1;
        }
        let z = Zipfian::new(items, 0.99).unwrap();
        // Ages 0..9 (newest first) carry zipfian shares, each within 5 σ.
        for age in 0..10u64 {
            let want = z.probability(age + 1);
            let got = by_age[age as usize] as f64 / samples as f64;
            let sd = (want * (1.0 - want) / samples as f64).sqrt();
            assert!(
                (got - want).abs() < 5.0 * sd,
                "last {last} age {age}: {got} vs {want}"
            );
        }
        // The oldest record (key 0) can be chosen; YCSB's own generator never picks it.
        assert!(z.probability(items) > 0.0);
    }
}

#[test]
fn choosers_are_deterministic_per_seed() {
    for d in [
        RequestDistribution::Uniform,
        RequestDistribution::ScrambledZipfian { theta: 0.99 },
        RequestDistribution::Zipfian { theta: 1.1 },
        RequestDistribution::Latest { theta: 0.9 },
    ] {
        let draw = |seed| {
            let mut c = KeyChooser::new(d, 10_000, 100).unwrap();
            let mut r = rng(seed);
            (0..1000).map(|_| c.next(&mut r, 9_999)).collect::<Vec<_>>()
        };
        assert_eq!(draw(1), draw(1), "{d:?}");
        assert_ne!(draw(1), draw(2), "{d:?}");
    }
}

#[test]
fn bad_parameters_are_refused() {
    assert!(Zipfian::new(0, 0.99).is_err());
    assert!(Zipfian::new(10, 0.0).is_err());
    assert!(Zipfian::new(10, f64::NAN).is_err());
    assert!(RequestDistribution::parse("hotspot", 0.99).is_err());
}

proptest! {
    #[test]
    fn zipfian_samples_stay_in_range(items in 1u64..=u64::MAX / 4, theta in 0.01f64..5.0, seed in any::<u64>()) {
        let z = Zipfian::new(items, theta).unwrap();
        let mut r = rng(seed);
        for _ in 0..50 {
            let k = z.sample(&mut r);
            prop_assert!((1..=items).contains(&k));
        }
    }

    #[test]
    fn choosers_never_pick_uninserted_keys(loaded in 1u64..5000, extra in 0u64..5000, seed in any::<u64>(), which in 0usize..4) {
        let d = [
            RequestDistribution::Uniform,
            RequestDistribution::ScrambledZipfian { theta: 0.99 },
            RequestDistribution::Zipfian { theta: 0.99 },
            RequestDistribution::Latest { theta: 0.99 },
        ][which];
        let mut c = KeyChooser::new(d, loaded, extra).unwrap();
        let mut r = rng(seed);
        let last = loaded - 1;
        for _ in 0..100 {
            prop_assert!(c.next(&mut r, last) <= last);
        }
    }
}
