//! The shards' counters traced over a recovery: a thread scrapes every shard's Prometheus
//! endpoint every few ms (wall-clock stamped), so the counters' deltas can be cut at the
//! recovery's own phase boundaries (attach, the application's boot, SQLite's open, serving).
//! It answers "what did the shards do while the backup recovered": first writes of the child
//! (copy-on-write) and their disk time, in-place writes, reads, slots the refill made (the
//! pre-stocking `super` asks for), disk-queue waits.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Counters summed over the shards: metric name with its labels other than `shard`.
pub type Counters = BTreeMap<String, f64>;

/// One scrape of every shard: all answers in by `t1` (unix ms).
#[derive(Clone, Debug)]
struct Scrape {
    t1: f64,
    c: Counters,
}

/// Longest a shard may take to answer one scrape.
const SCRAPE_TIMEOUT: Duration = Duration::from_millis(500);
/// Most scrapes one trace keeps (a 25 ms interval: ten minutes), so a stuck run cannot grow it
/// without bound.
const MAX_SCRAPES: usize = 24_000;

fn now_ms() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

/// Parses a Prometheus text exposition into `out`, summing over the `shard` label.
pub fn add_exposition(text: &str, out: &mut Counters) {
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        let Some((name, value)) = line.rsplit_once(' ') else { continue };
        let Ok(v) = value.parse::<f64>() else { continue };
        let key = match name.split_once('{') {
            Some((n, labels)) => {
                let rest: Vec<&str> = labels.trim_end_matches('}').split(',').filter(|l| !l.starts_with("shard=")).collect();
                if rest.is_empty() {
                    n.to_string()
                } else {
                    format!("{n}{{{}}}", rest.join(","))
                }
            }
            None => name.to_string(),
        };
        *out.entry(key).or_insert(0.0) += v;
    }
}

/// Every shard's metrics, summed; `None` if one did not answer (a partial sum would read as
/// counters going backwards).
pub fn scrape(addrs: &[String]) -> Option<Counters> {
    let mut sum = Counters::new();
    for addr in addrs {
        let sa: std::net::SocketAddr = addr.parse().ok()?;
        let mut s = TcpStream::connect_timeout(&sa, SCRAPE_TIMEOUT).ok()?;
        s.set_read_timeout(Some(SCRAPE_TIMEOUT)).ok()?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        let body = text.split_once("\r\n\r\n").map_or(text.as_str(), |(_, b)| b);
        add_exposition(body, &mut sum);
    }
    Some(sum)
}

/// What the shards did between two scrapes (their counters' increase).
pub fn work_between(before: &Counters, after: &Counters) -> PhaseWork {
    let d: Counters = after.iter().filter(|(k, _)| k.contains("_total")).map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0))).collect();
    PhaseWork::of(&d)
}

/// A running trace; [`Tracer::finish`] stops it.
pub struct Tracer {
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<Vec<Scrape>>,
}

impl Tracer {
    pub fn start(addrs: Vec<String>, interval: Duration) -> Tracer {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut out = vec![];
            loop {
                if let Some(c) = scrape(&addrs) {
                    if out.len() < MAX_SCRAPES {
                        out.push(Scrape { t1: now_ms(), c });
                    }
                }
                // One more scrape after the stop, so the trace covers the stop's time.
                if s.load(Ordering::Relaxed) {
                    break;
                }
                std::thread::sleep(interval);
            }
            out
        });
        Tracer { stop, handle }
    }

    pub fn finish(self) -> Trace {
        self.stop.store(true, Ordering::Relaxed);
        Trace { scrapes: self.handle.join().unwrap_or_default() }
    }
}

/// The scrapes of one trace.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    scrapes: Vec<Scrape>,
}

impl Trace {
    /// The counters as they stood at `t`: the last scrape wholly answered by then (the first
    /// scrape if none was).
    fn at(&self, t: f64) -> Option<&Counters> {
        self.scrapes.iter().rev().find(|s| s.t1 <= t).or(self.scrapes.first()).map(|s| &s.c)
    }

    /// Counter deltas between `from` and `to` (unix ms), cut at the scrapes nearest before each
    /// (so consecutive phases add up to the whole).
    pub fn delta(&self, from: f64, to: f64) -> Counters {
        let (Some(a), Some(b)) = (self.at(from), self.at(to)) else { return Counters::new() };
        b.iter().filter(|(k, _)| k.contains("_total")).map(|(k, v)| (k.clone(), v - a.get(k).copied().unwrap_or(0.0))).collect()
    }

    /// Median time between scrapes (ms): how finely phases can be told apart.
    pub fn resolution_ms(&self) -> f64 {
        let mut d: Vec<f64> = self.scrapes.windows(2).map(|w| w[1].t1 - w[0].t1).collect();
        d.sort_by(f64::total_cmp);
        d.get(d.len() / 2).copied().unwrap_or(f64::NAN)
    }
}

/// What the shards did in one phase of a recovery (all replicas' work counted).
#[derive(Clone, Debug, Default)]
pub struct PhaseWork {
    /// First writes of a `super` child to an object, and their disk time (loading the parent's
    /// sectors; writing and syncing the child's).
    pub cow_first_writes: f64,
    pub cow_load_us: f64,
    pub cow_commit_us: f64,
    /// Writes to objects the volume already has, and their time.
    pub in_place_writes: f64,
    pub in_place_us: f64,
    /// Disk reads and their run time.
    pub reads: f64,
    pub read_us: f64,
    /// Apply commands (every replica's) and their run time, copy-on-write ones apart.
    pub applies: f64,
    pub apply_us: f64,
    pub apply_cow: f64,
    pub apply_cow_us: f64,
    /// Slots created on a write's path (pool dry), slots the refill made and its time.
    pub slots_inline: f64,
    pub refill_slots: f64,
    pub refill_us: f64,
    /// fdatasyncs of mutating commands.
    pub fdatasyncs: f64,
    /// Time disk commands waited for a disk slot and a thread.
    pub disk_wait_us: f64,
    /// Disk commands slower than the shard's slow threshold.
    pub slow_disk_ops: f64,
}

impl PhaseWork {
    pub fn of(d: &Counters) -> PhaseWork {
        let g = |k: &str| d.get(k).copied().unwrap_or(0.0);
        let kind = |m: &str, k: &str| g(&format!("understudy_shard_disk_kind_{m}_total{{kind=\"{k}\"}}"));
        PhaseWork {
            cow_first_writes: g("understudy_store_cow_first_writes_total"),
            cow_load_us: g("understudy_store_cow_load_us_total"),
            cow_commit_us: g("understudy_store_cow_commit_us_total"),
            in_place_writes: g("understudy_store_in_place_writes_total"),
            in_place_us: g("understudy_store_in_place_us_total"),
            reads: kind("ops", "read") + kind("ops", "read-all"),
            read_us: kind("run_us", "read") + kind("run_us", "read-all"),
            applies: kind("ops", "apply"),
            apply_us: kind("run_us", "apply"),
            apply_cow: kind("ops", "apply-cow"),
            apply_cow_us: kind("run_us", "apply-cow"),
            slots_inline: g("understudy_shard_slow_allocations_total"),
            refill_slots: g("understudy_store_refill_slots_total"),
            refill_us: g("understudy_store_refill_us_total"),
            fdatasyncs: g("understudy_store_write_fdatasyncs_total"),
            disk_wait_us: g("understudy_shard_disk_wait_us_total"),
            slow_disk_ops: g("understudy_shard_slow_disk_ops_total"),
        }
    }

    /// (name with its unit, value) pairs, for figures.
    pub fn fields(&self) -> [(&'static str, f64); 17] {
        [
            ("cow_first_writes_count", self.cow_first_writes),
            ("cow_load_us", self.cow_load_us),
            ("cow_commit_us", self.cow_commit_us),
            ("in_place_writes_count", self.in_place_writes),
            ("in_place_us", self.in_place_us),
            ("reads_count", self.reads),
            ("read_us", self.read_us),
            ("applies_count", self.applies),
            ("apply_us", self.apply_us),
            ("apply_cow_count", self.apply_cow),
            ("apply_cow_us", self.apply_cow_us),
            ("slots_inline_count", self.slots_inline),
            ("refill_slots_count", self.refill_slots),
            ("refill_us", self.refill_us),
            ("fdatasyncs_count", self.fdatasyncs),
            ("disk_wait_us", self.disk_wait_us),
            ("slow_disk_ops_count", self.slow_disk_ops),
        ]
    }

    /// One line: `cow 12 (load 0.3 + commit 25.1 ms) in-place 3 (2.0 ms) reads 40 (4.1 ms) …`.
    pub fn line(&self) -> String {
        format!(
            "cow {:.0} (load {:.1} + commit {:.1} ms) in-place {:.0} ({:.1} ms) reads {:.0} ({:.1} ms) apply {:.0} ({:.1} ms) apply-cow {:.0} ({:.1} ms) fdatasyncs {:.0} inline slots {:.0} refill {:.0} slots ({:.1} ms) disk wait {:.1} ms",
            self.cow_first_writes,
            self.cow_load_us / 1000.0,
            self.cow_commit_us / 1000.0,
            self.in_place_writes,
            self.in_place_us / 1000.0,
            self.reads,
            self.read_us / 1000.0,
            self.applies,
            self.apply_us / 1000.0,
            self.apply_cow,
            self.apply_cow_us / 1000.0,
            self.fdatasyncs,
            self.slots_inline,
            self.refill_slots,
            self.refill_us / 1000.0,
            self.disk_wait_us / 1000.0,
        )
    }
}

/// The phases a recovery's shard work is cut into (see [`super::breakdown`]).
pub const PHASES: [&str; 4] = ["attach", "boot", "app_open", "serving"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expositions_sum_over_shards_and_deltas_cut_at_scrapes() {
        let mut c = Counters::new();
        add_exposition("# HELP x\nunderstudy_store_cow_first_writes_total{shard=\"1\"} 3\n", &mut c);
        add_exposition("understudy_store_cow_first_writes_total{shard=\"2\"} 4\nunderstudy_shard_disk_kind_ops_total{shard=\"2\",kind=\"read\"} 7\n", &mut c);
        assert_eq!(c["understudy_store_cow_first_writes_total"], 7.0);
        assert_eq!(c["understudy_shard_disk_kind_ops_total{kind=\"read\"}"], 7.0);
        let mk = |t: f64, n: f64| Scrape { t1: t, c: [("understudy_store_cow_first_writes_total".to_string(), n)].into() };
        let tr = Trace { scrapes: vec![mk(10.0, 1.0), mk(20.0, 5.0), mk(30.0, 6.0), mk(40.0, 9.0)] };
        let d = |a, b| PhaseWork::of(&tr.delta(a, b)).cow_first_writes;
        assert_eq!(d(15.0, 35.0), 5.0);
        assert_eq!(d(15.0, 25.0) + d(25.0, 35.0), d(15.0, 35.0));
        assert_eq!(d(0.0, 100.0), 8.0);
        assert!((tr.resolution_ms() - 10.0).abs() < 1e-9);
        // Every field makes a valid figure name, alone and with a statistic.
        for (n, _) in PhaseWork::default().fields() {
            for name in [format!("a.shards.{n}"), format!("a.shards.recovery.{n}_p50")] {
                assert!(bench::check_figure_name(&name).is_ok(), "{name}");
            }
        }
    }
}
