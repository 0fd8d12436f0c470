//! Key choosers: zipfian (plain and YCSB's scrambled), uniform and latest.
//!
//! Every chooser is a pure function of the random numbers it is given: it owns no generator,
//! so a client's seeded RNG makes its whole key sequence reproducible.
//!
//! **Zipfian sampling.** YCSB draws zipfian ranks with the method of Gray et al. ("Quickly
//! generating billion-record synthetic databases", SIGMOD'94), which is exact only for ranks 1
//! and 2, needs ζ(n, θ) summed over all n items (YCSB hard-codes ζ(10^10, 0.99) for that
//! reason) and breaks at θ = 1. We use rejection-inversion sampling instead (W. Hörmann and
//! G. Derflinger, "Rejection-inversion to generate variates from monotone discrete
//! distributions", ACM TOMACS 1996): exact for every rank, any θ > 0 (CANDStore's evaluation
//! uses θ = 1.1), O(1) per sample with no table, and changing the item count costs one `powf`,
//! which is what workload D's growing key space needs. [`zeta`] computes ζ(n, θ) in O(1000)
//! steps for any n (Euler–Maclaurin), for expected frequencies in tests and reports.

use rand::Rng;

use crate::keys::fnv_hash64;
use crate::ConfigError;

/// The item count of YCSB's scrambled zipfian: ranks are drawn over 10^10 items and hashed
/// into the key space, so the popular keys are scattered and the tail is nearly uniform.
pub const SCRAMBLED_ZIPFIAN_ITEMS: u64 = 10_000_000_000;

/// YCSB's default zipfian constant.
pub const DEFAULT_THETA: f64 = 0.99;

/// Zipf's law over ranks `1..=items`: P(k) = k^-θ / ζ(items, θ).
#[derive(Clone, Debug)]
pub struct Zipfian {
    items: u64,
    theta: f64,
    /// H(1.5) - h(1): the lower end of the integral the uniform variate is drawn over.
    h_integral_x1: f64,
    /// H(items + 0.5): the upper end; the only constant that depends on the item count.
    h_integral_items: f64,
    /// Below this distance to the rounded value, a sample is accepted without the full test.
    squeeze: f64,
}

impl Zipfian {
    /// Zipf over `items >= 1` ranks with exponent `theta > 0` (finite).
    pub fn new(items: u64, theta: f64) -> Result<Zipfian, ConfigError> {
        if items == 0 {
            return Err(ConfigError::new(
                "a zipfian chooser needs at least one item",
            ));
        }
        if !(theta.is_finite() && theta > 0.0) {
            return Err(ConfigError::new(format!(
                "zipfian theta {theta}: must be a finite number above 0 (YCSB uses 0.99)"
            )));
        }
        let mut z = Zipfian {
            items,
            theta,
            h_integral_x1: 0.0,
            h_integral_items: 0.0,
            squeeze: 0.0,
        };
        z.h_integral_x1 = z.h_integral(1.5) - 1.0;
        z.squeeze = 2.0 - z.h_integral_inverse(z.h_integral(2.5) - z.h(2.0));
        z.set_items(items);
        Ok(z)
    }

    pub fn items(&self) -> u64 {
        self.items
    }

    pub fn theta(&self) -> f64 {
        self.theta
    }

    /// Changes the number of items (grown by inserts, for workload D's "latest") in O(1).
    pub fn set_items(&mut self, items: u64) {
        assert!(items >= 1, "a zipfian chooser needs at least one item");
        self.items = items;
        self.h_integral_items = self.h_integral(items as f64 + 0.5);
    }

    /// A rank in `1..=items`; rank 1 is the most popular.
    pub fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> u64 {
        loop {
            let u = self.h_integral_items
                + rng.gen::<f64>() * (self.h_integral_x1 - self.h_integral_items);
            let x = self.h_integral_inverse(u);
            let k = ((x + 0.5) as u64).clamp(1, self.items);
            let kf = k as f64;
            // Accept if u falls in k's share [H(k + 1/2) - h(k), H(k + 1/2)] of the hat.
            if kf - x <= self.squeeze || u >= self.h_integral(kf + 0.5) - self.h(kf) {
                return k;
            }
        }
    }

    /// The exact probability of `rank` (1-based).
    pub fn probability(&self, rank: u64) -> f64 {
        if rank == 0 || rank > self.items {
            return 0.0;
        }
        (rank as f64).powf(-self.theta) / zeta(self.items, self.theta)
    }

    /// h(x) = x^-θ, the unnormalised density.
    fn h(&self, x: f64) -> f64 {
        (-self.theta * x.ln()).exp()
    }

    /// H(x) = ∫₁ˣ t^-θ dt = (x^(1-θ) - 1) / (1 - θ), and ln x at θ = 1, written so that it is
    /// accurate for θ near 1.
    fn h_integral(&self, x: f64) -> f64 {
        let log_x = x.ln();
        expm1_over_x((1.0 - self.theta) * log_x) * log_x
    }

    /// The inverse of H.
    fn h_integral_inverse(&self, y: f64) -> f64 {
        let t = (y * (1.0 - self.theta)).max(-1.0);
        (log1p_over_x(t) * y).exp()
    }
}

/// (e^x - 1) / x, continuous at 0.
fn expm1_over_x(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.exp_m1() / x
    } else {
        1.0 + x * 0.5 * (1.0 + x / 3.0 * (1.0 + x * 0.25))
    }
}

/// ln(1 + x) / x, continuous at 0.
fn log1p_over_x(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.ln_1p() / x
    } else {
        1.0 - x * (0.5 - x * (1.0 / 3.0 - x * 0.25))
    }
}

/// ζ(n, θ) = Σ_{k=1..n} k^-θ, exact to about 1e-12 relative for any n: the first terms are
/// summed, the rest by Euler–Maclaurin (integral, end corrections, two Bernoulli terms).
pub fn zeta(n: u64, theta: f64) -> f64 {
    const DIRECT: u64 = 1000;
    let term = |k: f64| k.powf(-theta);
    if n <= DIRECT {
        return (1..=n).map(|k| term(k as f64)).sum();
    }
    let head: f64 = (1..DIRECT).map(|k| term(k as f64)).sum();
    let (m, nf) = (DIRECT as f64, n as f64);
    let integral = if (theta - 1.0).abs() < 1e-12 {
        (nf / m).ln()
    } else {
        (nf.powf(1.0 - theta) - m.powf(1.0 - theta)) / (1.0 - theta)
    };
    // f'(x) = -θ x^(-θ-1); f'''(x) = -θ(θ+1)(θ+2) x^(-θ-3).
    let d1 = |x: f64| -theta * x.powf(-theta - 1.0);
    let d3 = |x: f64| -theta * (theta + 1.0) * (theta + 2.0) * x.powf(-theta - 3.0);
    head + integral + (term(m) + term(nf)) / 2.0 + (d1(nf) - d1(m)) / 12.0
        - (d3(nf) - d3(m)) / 720.0
}

/// Uniform over `lo..=hi`.
#[derive(Clone, Copy, Debug)]
pub struct Uniform {
    pub lo: u64,
    pub hi: u64,
}

impl Uniform {
    pub fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> u64 {
        rng.gen_range(self.lo..=self.hi)
    }
}

/// YCSB's scrambled zipfian over key numbers `0..items`: a zipfian rank over
/// [`SCRAMBLED_ZIPFIAN_ITEMS`] items, hashed with FNV and reduced modulo `items`.
#[derive(Clone, Debug)]
pub struct ScrambledZipfian {
    items: u64,
    ranks: Zipfian,
}

impl ScrambledZipfian {
    pub fn new(items: u64, theta: f64) -> Result<ScrambledZipfian, ConfigError> {
        if items == 0 {
            return Err(ConfigError::new(
                "a zipfian chooser needs at least one item",
            ));
        }
        Ok(ScrambledZipfian {
            items,
            ranks: Zipfian::new(SCRAMBLED_ZIPFIAN_ITEMS, theta)?,
        })
    }

    /// The key number of a zipfian rank (1-based): where rank 1, the most popular, lands.
    pub fn keynum_of_rank(&self, rank: u64) -> u64 {
        fnv_hash64(rank - 1) % self.items
    }

    pub fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> u64 {
        self.keynum_of_rank(self.ranks.sample(rng))
    }

    pub fn ranks(&self) -> &Zipfian {
        &self.ranks
    }
}

/// YCSB's "latest": zipfian over the inserted records, the newest the most popular.
#[derive(Clone, Debug)]
pub struct SkewedLatest {
    ranks: Zipfian,
}

impl SkewedLatest {
    pub fn new(theta: f64) -> Result<SkewedLatest, ConfigError> {
        Ok(SkewedLatest {
            ranks: Zipfian::new(1, theta)?,
        })
    }

    /// A key number in `0..=last`, where `last` is the newest fully inserted key number.
    pub fn sample<R: Rng + ?Sized>(&mut self, rng: &mut R, last: u64) -> u64 {
        // One item more than YCSB, which draws from 0..last and so never picks key 0.
        let items = last + 1;
        if self.ranks.items() != items {
            self.ranks.set_items(items);
        }
        last - (self.ranks.sample(rng) - 1)
    }
}

/// Which key a request goes to (YCSB's `requestdistribution`), with its parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RequestDistribution {
    /// Uniform over the loaded records (YCSB: inserted records are never chosen).
    Uniform,
    /// YCSB's "zipfian": scrambled zipfian over the loaded records plus the inserts expected
    /// in the run.
    ScrambledZipfian { theta: f64 },
    /// Zipfian by key number: key number 0 (the first loaded) is the most popular.
    Zipfian { theta: f64 },
    /// YCSB's "latest": the most recently inserted records are the most popular.
    Latest { theta: f64 },
}

impl RequestDistribution {
    /// Parses `uniform`, `zipfian` (scrambled, as in YCSB), `zipfian-plain` and `latest`, with
    /// `theta` for the skewed ones.
    pub fn parse(name: &str, theta: f64) -> Result<RequestDistribution, ConfigError> {
        Ok(match name {
            "uniform" => RequestDistribution::Uniform,
            "zipfian" | "scrambled-zipfian" => RequestDistribution::ScrambledZipfian { theta },
            "zipfian-plain" => RequestDistribution::Zipfian { theta },
            "latest" => RequestDistribution::Latest { theta },
            other => {
                return Err(ConfigError::new(format!(
                    "unknown request distribution {other:?}: use uniform, zipfian, \
                     zipfian-plain or latest"
                )))
            }
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            RequestDistribution::Uniform => "uniform",
            RequestDistribution::ScrambledZipfian { .. } => "zipfian",
            RequestDistribution::Zipfian { .. } => "zipfian-plain",
            RequestDistribution::Latest { .. } => "latest",
        }
    }

    /// The same distribution with another θ (uniform has none).
    pub fn with_theta(self, theta: f64) -> RequestDistribution {
        match self {
            RequestDistribution::Uniform => RequestDistribution::Uniform,
            RequestDistribution::ScrambledZipfian { .. } => {
                RequestDistribution::ScrambledZipfian { theta }
            }
            RequestDistribution::Zipfian { .. } => RequestDistribution::Zipfian { theta },
            RequestDistribution::Latest { .. } => RequestDistribution::Latest { theta },
        }
    }
}

/// A key chooser built from a [`RequestDistribution`] for one client.
#[derive(Clone, Debug)]
pub enum KeyChooser {
    Uniform(Uniform),
    ScrambledZipfian(ScrambledZipfian),
    Zipfian(Zipfian),
    Latest(SkewedLatest),
}

/// Redraws before a chooser that keeps picking not-yet-inserted keys falls back to a modulo.
const REDRAWS_MAX: u32 = 1000;

impl KeyChooser {
    /// A chooser over `loaded` records with `expected_inserts` more expected during the run
    /// (YCSB sizes its zipfian over both, with a factor of 2 on the inserts as slack).
    pub fn new(
        distribution: RequestDistribution,
        loaded: u64,
        expected_inserts: u64,
    ) -> Result<KeyChooser, ConfigError> {
        if loaded == 0 {
            return Err(ConfigError::new("the record count must be at least 1"));
        }
        let items = loaded.saturating_add(expected_inserts.saturating_mul(2));
        Ok(match distribution {
            RequestDistribution::Uniform => KeyChooser::Uniform(Uniform {
                lo: 0,
                hi: loaded - 1,
            }),
            RequestDistribution::ScrambledZipfian { theta } => {
                KeyChooser::ScrambledZipfian(ScrambledZipfian::new(items, theta)?)
            }
            RequestDistribution::Zipfian { theta } => {
                KeyChooser::Zipfian(Zipfian::new(items, theta)?)
            }
            RequestDistribution::Latest { theta } => KeyChooser::Latest(SkewedLatest::new(theta)?),
        })
    }

    /// A key number in `0..=last`, `last` being the newest fully inserted key number. Like
    /// YCSB, draws beyond `last` (keys not inserted yet) are drawn again.
    pub fn next<R: Rng + ?Sized>(&mut self, rng: &mut R, last: u64) -> u64 {
        for _ in 0..REDRAWS_MAX {
            let keynum = match self {
                KeyChooser::Uniform(u) => u.sample(rng),
                KeyChooser::ScrambledZipfian(z) => z.sample(rng),
                KeyChooser::Zipfian(z) => z.sample(rng) - 1,
                KeyChooser::Latest(l) => l.sample(rng, last),
            };
            if keynum <= last {
                return keynum;
            }
        }
        rng.gen_range(0..=last)
    }
}
