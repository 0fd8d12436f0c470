//! `understudy bench volume cow`: the disk-level experiments of SpecREDS §6.2 (Figure 4a, 4b and
//! the dirty-bit overhead), on a running cluster.
//!
//! Three variants are measured in one run, interleaved batch by batch ([`balanced_order`]: every
//! variant follows every other equally often) so machine noise and one variant's background
//! work hit them alike:
//! * **plain** — in-place writes to a volume whose objects all exist;
//! * **super** — writes to a collocated `super` child, each to an object the child has not
//!   copied yet (a local copy on each replica, then the write);
//! * **general** — writes to an rbd-style general clone, each to an object not yet copied up (a
//!   read of the parent object across the network, an object-map update serialised per volume,
//!   then a full-object write to the clone's own shards).
//!
//! After each batch of child writes the child is collapsed (promoted: the parent stays silent)
//! and the next round works on a fresh child of the promoted volume, so every measured COW write
//! hits a not-yet-copied object however long the run. Plain writes get the same care: within a
//! round each goes to an object no earlier write of the round touched.
//!
//! Before every measured point (a write size, a depth) the benchmark waits until the shards'
//! background disk work has settled ([`settle`]): the slot refill after the fill or after a
//! burst of copies, garbage collection. Background work the measured writes cause themselves
//! still lands in their point; the backlog of earlier steps does not, so the first point after
//! `super` (depth 1) is not penalised for what the fill or the previous round left behind.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bench::{LatencyRecorder, Progress, Report, Scale, Series};
use blockdev::BlockDev;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use volume::driver::client::{Cluster, Volume};
use volume::driver::meta::{MetaReq, MetaResp};

pub const WRITE_SIZES_BYTES: [u32; 5] = [4096, 8192, 16384, 32768, 65536];
pub const DEPTHS: [usize; 6] = [1, 2, 4, 8, 16, 32];
const VARIANTS: [&str; 3] = ["plain", "super", "general"];

#[derive(Debug, Clone)]
pub struct CowOptions {
    pub quick: bool,
    pub object_size_bytes: u32,
    /// Writes per variant per write size (a) and per depth (b).
    pub writes_per_point: usize,
    /// Seconds per variant per round of the IOPS experiment (d), and rounds.
    pub iops_seconds: u64,
    pub iops_rounds: usize,
    /// The most [`settle`] waits before a point (it is measured anyway after that).
    pub settle_max_s: u64,
    /// Process ids of the shards (when they run as processes on this machine): [`settle`]
    /// watches their disk writes. Empty: no settling.
    pub shard_pids: Vec<u32>,
    /// The shards' Prometheus endpoints (`host:port`): their store and disk counters are read
    /// around every batch of the deep points ([`COUNTED_DEPTHS`]) and reported per variant.
    /// Empty: no counters.
    pub shard_metrics: Vec<String>,
}

impl CowOptions {
    pub fn new(quick: bool) -> Self {
        // Quick: 48 writes per point (six ABBA batches of eight at depth 1, four batches at
        // depth 32), four rounds of two 2-second IOPS windows; the volumes are then 25 MiB each, which keeps the fill,
        // the settling after it and the removal of the cluster's files short on a shared disk.
        if quick {
            CowOptions { quick, object_size_bytes: 64 * 1024, writes_per_point: 48, iops_seconds: 2, iops_rounds: 4, settle_max_s: 10, shard_pids: vec![], shard_metrics: vec![] }
        } else {
            // Full: 1000 writes per point (five rounds of 200 a variant), ten 6-second IOPS
            // rounds: ≈ 15 min on a shared 2-core machine (2000 a point took over 20 min there).
            CowOptions { quick, object_size_bytes: 64 * 1024, writes_per_point: 1000, iops_seconds: 6, iops_rounds: 10, settle_max_s: 60, shard_pids: vec![], shard_metrics: vec![] }
        }
    }

    /// Objects in the volume: enough distinct objects per round for every measured COW write.
    fn objects(&self) -> u64 {
        let per_round = (WRITE_SIZES_BYTES.len() * self.batch_writes())
            .max(DEPTHS.iter().map(|&d| d * self.depth_batches(d)).sum::<usize>());
        per_round as u64 + 16
    }

    /// Writes per variant per point in one round; rounds repeat until `writes_per_point`.
    fn batch_writes(&self) -> usize {
        self.writes_per_point.min(200)
    }

    /// Batches per depth in one round: about `batch_writes` writes at every depth, at least
    /// four (with two, one stall of the machine decides a deep point's mean).
    fn depth_batches(&self, depth: usize) -> usize {
        (self.batch_writes() / depth).max(4)
    }
}

/// The state of the three variants: a plain volume, a base volume with its current super child
/// (the base itself is never written while it has a child, or collapse would rightly reject the
/// child), and a second base with its current general clone (a volume has clones of one kind).
struct Variants {
    cluster: Arc<Cluster>,
    plain: String,
    base: String,
    /// The first base's name, from which children are named.
    base_name: String,
    general_base: String,
    round: usize,
    object_size: u32,
    /// Objects of the plain volume (index 0), the current super child (1) and general clone (2)
    /// not yet written in this round.
    fresh: [Vec<u64>; 3],
    vols: [Option<Volume>; 3],
}

impl Variants {
    async fn meta(&self, req: MetaReq) -> anyhow::Result<MetaResp> {
        self.cluster.meta(req).await
    }

    /// Starts a round: a fresh super child and general clone of the base volume.
    async fn begin_round(&mut self, objects: u64, rng: &mut rand::rngs::StdRng) -> anyhow::Result<()> {
        self.round += 1;
        // Named after the first base, not the current one (a promoted child): names stay short
        // however many rounds run.
        let child = format!("{}.super-{}", self.base_name, self.round);
        let general = format!("{}.general-{}", self.base_name, self.round);
        self.meta(MetaReq::Super { parent: self.base.clone(), child: child.clone() }).await?;
        self.meta(MetaReq::CloneGeneral { parent: self.general_base.clone(), child: general.clone() }).await?;
        self.vols = [
            Some(self.cluster.open(&self.plain).await?),
            Some(self.cluster.open(&child).await?),
            Some(self.cluster.open(&general).await?),
        ];
        for f in &mut self.fresh {
            *f = (0..objects).collect();
            f.shuffle(rng);
        }
        Ok(())
    }

    /// Ends a round: the child is promoted (the base stayed silent) and becomes the base; the
    /// general clone is deleted; waits for garbage collection so the next round starts clean.
    async fn end_round(&mut self) -> anyhow::Result<()> {
        let child = self.vols[1].as_ref().unwrap().record().name.clone();
        let general = self.vols[2].as_ref().unwrap().record().name.clone();
        self.vols = [None, None, None];
        match self.meta(MetaReq::Collapse { child: child.clone() }).await? {
            MetaResp::Collapsed { outcome: volume::types::CollapseOutcome::Promoted, .. } => {}
            other => anyhow::bail!("collapse of {child} with a silent parent did not promote: {other:?}"),
        }
        self.base = child;
        self.meta(MetaReq::Delete { name: general }).await?;
        self.cluster.wait_for_jobs().await
    }

    fn take_fresh(&mut self, variant: usize, n: usize) -> anyhow::Result<Vec<u64>> {
        let f = &mut self.fresh[variant];
        anyhow::ensure!(f.len() >= n, "ran out of uncopied objects (internal sizing error)");
        Ok(f.split_off(f.len() - n))
    }
}

/// Waits until the shards' background disk work has settled: none of them has written a byte
/// (`write_bytes` of `/proc/PID/io`, counted when pages are dirtied) for [`SETTLE_QUIET_MS`].
/// Gives up after `max_s` seconds (the point is then measured anyway). Returns seconds waited.
/// Bytes the processes `pids` have written to storage so far (`write_bytes` of `/proc/PID/io`),
/// or `None` if one cannot be read.
fn written_bytes(pids: &[u32]) -> Option<u64> {
    pids.iter()
        .map(|pid| {
            let io = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
            io.lines().find_map(|l| l.strip_prefix("write_bytes:")).and_then(|v| v.trim().parse::<u64>().ok())
        })
        .sum()
}

pub async fn settle(pids: &[u32], max_s: u64) -> f64 {
    let start = Instant::now();
    let written = || written_bytes(pids);
    let Some(mut last) = written() else { return 0.0 };
    let mut quiet_since = Instant::now();
    while quiet_since.elapsed() < Duration::from_millis(SETTLE_QUIET_MS) && start.elapsed() < Duration::from_secs(max_s) {
        tokio::time::sleep(Duration::from_millis(SETTLE_POLL_MS)).await;
        let now = written().unwrap_or(last);
        if now != last {
            last = now;
            quiet_since = Instant::now();
        }
    }
    start.elapsed().as_secs_f64()
}

/// How long the shards must not write for [`settle`], and how often it looks.
const SETTLE_QUIET_MS: u64 = 300;
const SETTLE_POLL_MS: u64 = 50;

/// The order of the variants' batches at one point: `rows` rows, each one batch of every
/// variant, taken in turn from a Williams design for three variants (both 3×3 Latin squares,
/// one mirrored). Every variant follows every other equally often and each holds each
/// position in a row equally often. The background work a batch leaves behind (the slot
/// refill after a general clone's copy-ups, for one) lands on whichever batch comes next, so
/// with plain ABBA (0 1 2 2 1 0 …) the general clone's batches were followed only by its own
/// and by super's, never by plain's: its refill was charged to super alone.
fn balanced_order(rows: usize) -> Vec<usize> {
    const WILLIAMS: [[usize; 3]; 6] = [[0, 1, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0], [0, 2, 1], [1, 0, 2]];
    (0..rows).flat_map(|r| WILLIAMS[r % WILLIAMS.len()]).collect()
}

/// Depths at which the shards' counters are read around every batch (reading them costs a few
/// loopback HTTP requests per batch, kept off the many batches of the shallow points).
pub const COUNTED_DEPTHS: [usize; 3] = [8, 16, 32];

/// The shards' metrics summed over the shards: key = metric name with its labels other than
/// `shard` (e.g. `understudy_shard_disk_kind_ops_total{kind="apply"}`). Shards that do not
/// answer are left out.
async fn scrape(addrs: &[String]) -> BTreeMap<String, f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sum = BTreeMap::new();
    for addr in addrs {
        let body = async {
            let mut s = tokio::net::TcpStream::connect(addr).await?;
            s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").await?;
            let mut out = String::new();
            s.read_to_string(&mut out).await?;
            std::io::Result::Ok(out)
        };
        let Ok(Ok(text)) = tokio::time::timeout(Duration::from_secs(5), body).await else { continue };
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((name, value)) = line.rsplit_once(' ') else { continue };
            let Ok(v) = value.parse::<f64>() else { continue };
            let key = match name.split_once('{') {
                Some((n, labels)) => {
                    let rest: Vec<&str> = labels.trim_end_matches('}').split(',').filter(|l| !l.starts_with("shard=")).collect();
                    if rest.is_empty() { n.to_string() } else { format!("{n}{{{}}}", rest.join(",")) }
                }
                None => name.to_string(),
            };
            *sum.entry(key).or_insert(0.0) += v;
        }
    }
    sum
}

/// Counter deltas accumulated over a variant's batches at one depth, and the gauges' peaks.
#[derive(Default, Clone)]
struct CounterDeltas {
    writes: u64,
    delta: BTreeMap<String, f64>,
    peak: BTreeMap<String, f64>,
}

impl CounterDeltas {
    fn add(&mut self, before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>, writes: usize) {
        self.writes += writes as u64;
        for (k, a) in after {
            if k.ends_with("_total") || k.contains("_total{") {
                *self.delta.entry(k.clone()).or_insert(0.0) += a - before.get(k).copied().unwrap_or(0.0);
            } else {
                let p = self.peak.entry(k.clone()).or_insert(f64::MIN);
                *p = p.max(*a).max(before.get(k).copied().unwrap_or(f64::MIN));
            }
        }
    }

    fn d(&self, k: &str) -> f64 {
        self.delta.get(k).copied().unwrap_or(0.0)
    }

    /// Figures under `prefix`: per measured write, and mean times per operation.
    fn report(&self, prefix: &str, report: &mut Report) -> anyhow::Result<()> {
        if self.writes == 0 || self.delta.is_empty() {
            return Ok(());
        }
        let w = self.writes as f64;
        let per_write = [
            ("applies", "understudy_store_applies_total"),
            ("cow_first_writes", "understudy_store_cow_first_writes_total"),
            ("slots_from_pool", "understudy_store_slots_from_pool_total"),
            ("slots_from_reserve", "understudy_store_slots_from_reserve_total"),
            ("slots_created_inline", "understudy_shard_slow_allocations_total"),
            ("fdatasyncs", "understudy_store_write_fdatasyncs_total"),
            ("dir_fsyncs", "understudy_store_write_dir_fsyncs_total"),
            ("refill_slots", "understudy_store_refill_slots_total"),
            ("refill_batches", "understudy_store_refill_batches_total"),
            ("refill_batches_while_serving", "understudy_store_refill_batches_while_serving_total"),
            ("slow_disk_ops", "understudy_shard_slow_disk_ops_total"),
            // With the shards' journal on (zero without): records, the shared syncs that made
            // them durable, and the slot files checkpoints synced later.
            ("journal_records", "understudy_journal_records_total"),
            ("journal_syncs", "understudy_journal_syncs_total"),
            ("journal_checkpoint_files_synced", "understudy_journal_checkpoint_files_synced_total"),
            ("journal_full_waits", "understudy_journal_full_waits_total"),
        ];
        for (name, key) in per_write {
            report.figure(&format!("{prefix}.{name}_per_write_count"), self.d(key) / w)?;
        }
        let ops: f64 = self.delta.iter().filter(|(k, _)| k.starts_with("understudy_shard_disk_kind_ops_total")).map(|(_, v)| v).sum();
        let mean = |us: f64, n: f64| if n > 0.0 { us / n } else { 0.0 };
        report.figure(&format!("{prefix}.disk_wait_us_mean"), mean(self.d("understudy_shard_disk_wait_us_total"), ops))?;
        for kind in ["apply", "apply-cow"] {
            let n = self.d(&format!("understudy_shard_disk_kind_ops_total{{kind=\"{kind}\"}}"));
            let us = self.d(&format!("understudy_shard_disk_kind_run_us_total{{kind=\"{kind}\"}}"));
            if n > 0.0 {
                report.figure(&format!("{prefix}.{}.disk_run_us_mean", kind.replace('-', "_")), us / n)?;
            }
        }
        let cow = self.d("understudy_store_cow_first_writes_total");
        if cow > 0.0 {
            report.figure(&format!("{prefix}.cow_load_us_mean"), self.d("understudy_store_cow_load_us_total") / cow)?;
            report.figure(&format!("{prefix}.cow_commit_us_mean"), self.d("understudy_store_cow_commit_us_total") / cow)?;
        }
        let inplace = self.d("understudy_store_in_place_writes_total");
        if inplace > 0.0 {
            report.figure(&format!("{prefix}.in_place_us_mean"), self.d("understudy_store_in_place_us_total") / inplace)?;
        }
        report.figure(&format!("{prefix}.refill_per_write_us"), self.d("understudy_store_refill_us_total") / w)?;
        for g in ["understudy_shard_background_tasks_waiting", "understudy_shard_ops_in_flight"] {
            if let Some(p) = self.peak.get(g) {
                report.figure(&format!("{prefix}.{}_peak_count", g.trim_start_matches("understudy_shard_")), *p)?;
            }
        }
        Ok(())
    }
}

/// Issues `targets.len()` writes of `size` bytes in batches of `depth` concurrent writes, each to
/// a random aligned offset of its target object; returns each write's latency.
async fn write_batches(
    vol: &Volume,
    object_size: u32,
    targets: &[u64],
    size: u32,
    depth: usize,
    rng: &mut rand::rngs::StdRng,
) -> anyhow::Result<Vec<Duration>> {
    let mut lat = Vec::with_capacity(targets.len());
    for batch in targets.chunks(depth) {
        let writes: Vec<(u64, Vec<u8>)> = batch
            .iter()
            .map(|&objno| {
                let slots = object_size / size;
                let offset = objno * object_size as u64 + rng.gen_range(0..slots) as u64 * size as u64;
                (offset, vec![rng.gen::<u8>() | 1; size as usize])
            })
            .collect();
        let futs = writes.into_iter().map(|(offset, data)| async move {
            let t = Instant::now();
            vol.write(offset, data).await.map(|_| t.elapsed())
        });
        for r in futures::future::join_all(futs).await {
            lat.push(r.map_err(|e| anyhow::anyhow!("benchmark write failed: {e}"))?);
        }
    }
    Ok(lat)
}

/// What one window of the parent-IOPS experiment (d) measured.
struct IopsWindow {
    ops_per_s: f64,
    /// Completions per [`TIMELINE_BUCKET_MS`] since the window's start.
    timeline: bench::WindowedCounter,
    latency: LatencyRecorder,
}

/// Buckets of the parent-IOPS timelines: fine enough to see the cost of one super / collapse.
const TIMELINE_BUCKET_MS: u64 = 10;

/// Random 4 KiB writes at `depth` for `seconds` from `start`; returns completed writes per
/// second, their timeline and latencies.
async fn iops(vol: &Volume, start: Instant, seconds: u64, depth: usize, seed: u64) -> anyhow::Result<IopsWindow> {
    let size = vol.size_bytes();
    let end = start + Duration::from_secs(seconds);
    let workers = (0..depth).map(|w| async move {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ w as u64);
        let mut timeline = bench::WindowedCounter::new(Duration::from_millis(TIMELINE_BUCKET_MS));
        let mut latency = LatencyRecorder::default();
        while Instant::now() < end {
            let offset = rng.gen_range(0..size / 4096) * 4096;
            let t = Instant::now();
            vol.write(offset, vec![0x5a; 4096]).await.map_err(|e| anyhow::anyhow!("benchmark write failed: {e}"))?;
            latency.record(t.elapsed());
            timeline.record(start.elapsed());
        }
        anyhow::Ok((timeline, latency))
    });
    let mut timeline = bench::WindowedCounter::new(Duration::from_millis(TIMELINE_BUCKET_MS));
    let mut latency = LatencyRecorder::default();
    for r in futures::future::join_all(workers).await {
        let (t, l) = r?;
        timeline.merge(&t);
        latency.merge(&l);
    }
    Ok(IopsWindow { ops_per_s: timeline.count() as f64 / start.elapsed().as_secs_f64(), timeline, latency })
}

/// The filled plain volume the experiment leaves behind (every object written), for the fio
/// comparison that follows it: a volume whose blocks exist, like fio's laid-out local file.
#[derive(Debug, Clone)]
pub struct PlainVolume {
    pub name: String,
    pub size_bytes: u64,
}

/// Runs the whole experiment and fills `report`.
pub async fn run(cluster: Arc<Cluster>, opts: &CowOptions, out: &Path, report: &mut Report) -> anyhow::Result<PlainVolume> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    let mut phase = Instant::now();
    let objects = opts.objects();
    let size_bytes = objects * opts.object_size_bytes as u64;
    let base = format!("bench-cow-{}", std::process::id());
    let plain = format!("bench-plain-{}", std::process::id());
    let general_base = format!("bench-general-{}", std::process::id());
    // Fill every object so the clones have something to copy and plain writes overwrite.
    let mut progress = Progress::new(3 * objects, "filling the volumes");
    for name in [&plain, &base, &general_base] {
        cluster
            .meta(MetaReq::Create { name: name.clone(), size_bytes, object_size_bytes: opts.object_size_bytes })
            .await
            .context("creating the benchmark volumes")?;
        let vol = cluster.open(name).await?;
        let chunk = 32;
        let all: Vec<u64> = (0..objects).collect();
        for batch in all.chunks(chunk) {
            let futs = batch.iter().map(|&o| vol.write(o * opts.object_size_bytes as u64, vec![0xa5; opts.object_size_bytes as usize]));
            for r in futures::future::join_all(futs).await {
                r.map_err(|e| anyhow::anyhow!("filling: {e}"))?;
            }
            progress.inc(batch.len() as u64);
        }
    }
    progress.finish();
    report.figure("phase.fill_s", phase.elapsed().as_secs_f64())?;
    phase = Instant::now();

    let plain_volume = PlainVolume { name: plain.clone(), size_bytes };
    let mut v = Variants { cluster: cluster.clone(), plain, base_name: base.clone(), base, general_base, round: 0, object_size: opts.object_size_bytes, fresh: Default::default(), vols: [None, None, None] };
    let mut by_size: BTreeMap<(usize, u32), LatencyRecorder> = BTreeMap::new();
    let mut by_depth: BTreeMap<(usize, u32), LatencyRecorder> = BTreeMap::new();
    let mut samples: Vec<Vec<String>> = vec![];
    let mut settle_s = 0.0;
    let mut counters: BTreeMap<(usize, usize), CounterDeltas> = BTreeMap::new();

    // (a) single COW writes of each size at depth 1, and (b) 4 KiB COW writes at each depth.
    let rounds = opts.writes_per_point.div_ceil(opts.batch_writes());
    let mut progress = Progress::new((rounds * 2) as u64, "COW latency rounds");
    for _ in 0..rounds {
        v.begin_round(objects, &mut rng).await?;
        for &size in &WRITE_SIZES_BYTES {
            settle_s += settle(&opts.shard_pids, opts.settle_max_s).await;
            // Small batches, interleaved across variants.
            let per_batch = 8;
            for variant in balanced_order(opts.batch_writes() / per_batch) {
                let targets = v.take_fresh(variant, per_batch)?;
                let vol = v.vols[variant].as_ref().unwrap();
                for l in write_batches(vol, v.object_size, &targets, size, 1, &mut rng).await? {
                    by_size.entry((variant, size)).or_default().record(l);
                    samples.push(vec!["size".into(), VARIANTS[variant].into(), size.to_string(), "1".into(), l.as_micros().to_string()]);
                }
            }
        }
        v.end_round().await?;
        progress.inc(1);
        v.begin_round(objects, &mut rng).await?;
        for &depth in &DEPTHS {
            settle_s += settle(&opts.shard_pids, opts.settle_max_s).await;
            let counted = COUNTED_DEPTHS.contains(&depth) && !opts.shard_metrics.is_empty();
            for variant in balanced_order(opts.depth_batches(depth)) {
                let targets = v.take_fresh(variant, depth)?;
                let vol = v.vols[variant].as_ref().unwrap();
                let before = if counted { Some(scrape(&opts.shard_metrics).await) } else { None };
                let lats = write_batches(vol, v.object_size, &targets, 4096, depth, &mut rng).await?;
                if let Some(before) = before {
                    let after = scrape(&opts.shard_metrics).await;
                    counters.entry((variant, depth)).or_default().add(&before, &after, lats.len());
                }
                for l in lats {
                    by_depth.entry((variant, depth as u32)).or_default().record(l);
                    samples.push(vec!["depth".into(), VARIANTS[variant].into(), "4096".into(), depth.to_string(), l.as_micros().to_string()]);
                }
            }
        }
        v.end_round().await?;
        progress.inc(1);
    }
    progress.finish();
    report.figure("phase.cow_latency_s", phase.elapsed().as_secs_f64())?;
    phase = Instant::now();

    // (d) parent IOPS at depth 32 with super invoked every second, against none.
    let d = parent_iops(&cluster, &v.base, opts, &mut rng, &mut settle_s, out).await?;
    cluster.wait_for_jobs().await?;
    report.figure("phase.parent_iops_s", phase.elapsed().as_secs_f64())?;

    report.figure("settle_wait_s", settle_s)?;

    // Figures, ratios, CSV and plots.
    let mean = |m: &BTreeMap<_, LatencyRecorder>, k| m.get(&k).map(|r: &LatencyRecorder| r.mean_us()).unwrap_or(f64::NAN);
    for (i, name) in VARIANTS.iter().enumerate() {
        for &size in &WRITE_SIZES_BYTES {
            report.latency(&format!("{name}.size_sweep.write_{}k.depth1.latency", size / 1024), &by_size[&(i, size)].summary())?;
        }
        for &depth in &DEPTHS {
            report.latency(&format!("{name}.write_4k.depth{depth}.latency"), &by_depth[&(i, depth as u32)].summary())?;
        }
    }
    d.report(report)?;
    for ((variant, depth), c) in &counters {
        c.report(&format!("{}.write_4k.depth{depth}.shard", VARIANTS[*variant]), report)?;
    }
    // Depth 1 of (a) and (b) measure the same thing (single 4 KiB writes to uncopied objects,
    // after the shards settled): the ratio takes the samples of both.
    let both = |variant: usize| {
        let mut r = by_size[&(variant, 4096)].clone();
        r.merge(&by_depth[&(variant, 1)]);
        r.mean_us()
    };
    report.ratio("super_vs_plain.write_4k.depth1.latency", both(1), both(0))?;
    // Medians too: on a loaded machine a few stalls of seconds decide a mean of 128 writes.
    let both_p50 = |variant: usize| {
        let mut r = by_size[&(variant, 4096)].clone();
        r.merge(&by_depth[&(variant, 1)]);
        r.percentile_us(50.0) as f64
    };
    report.ratio("super_vs_plain.write_4k.depth1.latency_p50", both_p50(1), both_p50(0))?;
    report.ratio(
        "super_vs_plain.write_4k.depth32.latency_p50",
        by_depth[&(1, 32)].percentile_us(50.0) as f64,
        by_depth[&(0, 32)].percentile_us(50.0) as f64,
    )?;
    report.ratio("super_vs_plain.size_sweep.write_4k.depth1.latency", mean(&by_size, (1, 4096)), mean(&by_size, (0, 4096)))?;
    report.ratio("super_vs_plain.depth_sweep.write_4k.depth1.latency", mean(&by_depth, (1, 1)), mean(&by_depth, (0, 1)))?;
    report.ratio("super_vs_plain.write_4k.depth32.latency", mean(&by_depth, (1, 32)), mean(&by_depth, (0, 32)))?;
    report.ratio("general_vs_super.write_4k.depth32.latency", mean(&by_depth, (2, 32)), mean(&by_depth, (1, 32)))?;
    report.ratio("general_vs_super.write_4k.depth1.latency", mean(&by_size, (2, 4096)), mean(&by_size, (1, 4096)))?;
    for (i, name) in VARIANTS.iter().enumerate() {
        report.ratio(&format!("{name}.write_4k.depth32_vs_depth1.latency"), mean(&by_depth, (i, 32)), mean(&by_depth, (i, 1)))?;
    }
    report.ratio(
        "super_vs_plain.write_4k.depth32_vs_depth1.latency",
        mean(&by_depth, (1, 32)) / mean(&by_depth, (1, 1)),
        mean(&by_depth, (0, 32)) / mean(&by_depth, (0, 1)),
    )?;

    bench::write_csv(&out.join("cow_latency.csv"), &["experiment", "variant", "write_bytes", "depth", "latency_us"], samples)?;
    let size_series: Vec<Series> = VARIANTS
        .iter()
        .enumerate()
        .map(|(i, n)| Series { name: n.to_string(), points: WRITE_SIZES_BYTES.iter().map(|&s| ((s / 1024) as f64, mean(&by_size, (i, s)) / 1000.0)).collect() })
        .collect();
    bench::line_plot(&out.join("fig4a_cow_latency_by_size"), "Single COW write latency (depth 1)", "write size (KiB)", "mean latency (ms)", &size_series, Scale::Log)?;
    let depth_series: Vec<Series> = VARIANTS
        .iter()
        .enumerate()
        .map(|(i, n)| Series { name: n.to_string(), points: DEPTHS.iter().map(|&d| (d as f64, mean(&by_depth, (i, d as u32)) / 1000.0)).collect() })
        .collect();
    bench::line_plot(&out.join("fig4b_cow_latency_by_depth"), "4 KiB COW write latency by writes in flight", "writes in flight", "mean latency (ms)", &depth_series, Scale::Log)?;
    Ok(plain_volume)
}

/// Cycles of [`super_every_second`], the latency of its control requests, and when each step
/// ran (offsets from the start of the IOPS window).
#[derive(Default)]
struct ControlLatency {
    cycles: u64,
    super_: LatencyRecorder,
    collapse: LatencyRecorder,
    /// `(step, from, to)`: `super` (request to reply), `collapse_gc` (collapse request to the
    /// end of garbage collection).
    steps: Vec<(&'static str, Duration, Duration)>,
}

impl ControlLatency {
    fn merge(&mut self, o: &ControlLatency) {
        self.cycles += o.cycles;
        self.super_.merge(&o.super_);
        self.collapse.merge(&o.collapse);
    }
}

/// Every second: `super` the volume, then collapse the child a second later (the parent keeps
/// writing, so it is rejected and discarded). Returns the cycles completed, the latencies of
/// `super` and `collapse`, and when each step ran relative to `start`.
async fn super_every_second(cluster: Arc<Cluster>, base: String, start: Instant, stop: Arc<std::sync::atomic::AtomicBool>) -> anyhow::Result<ControlLatency> {
    let mut lat = ControlLatency::default();
    let mut n = 0;
    let parent = cluster.open(&base).await?;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        n += 1;
        let child = format!("{base}.dirty-{n}");
        let t = Instant::now();
        cluster.meta(MetaReq::Super { parent: base.clone(), child: child.clone() }).await?;
        lat.super_.record(t.elapsed());
        lat.steps.push(("super", t - start, start.elapsed()));
        tokio::time::sleep(Duration::from_secs(1).saturating_sub(t.elapsed())).await;
        // The benchmark's writers may not have had a write acknowledged since `super` returned
        // (on a loaded machine `super` can take the whole second): one parent write of our own
        // makes the child dirty for sure, so the collapse below rejects it as intended.
        parent.write(0, vec![0x5a; 4096]).await.map_err(|e| anyhow::anyhow!("parent write after super failed: {e}"))?;
        let t = Instant::now();
        match cluster.meta(MetaReq::Collapse { child: child.clone() }).await? {
            MetaResp::Collapsed { outcome: volume::types::CollapseOutcome::Rejected, .. } => {}
            other => anyhow::bail!("collapse while the parent writes must reject, got {other:?}"),
        }
        lat.collapse.record(t.elapsed());
        cluster.wait_for_jobs().await?;
        lat.steps.push(("collapse_gc", t - start, start.elapsed()));
        lat.cycles += 1;
    }
    Ok(lat)
}

/// The steps of a super cycle whose cost (d) attributes, and the rest of a window.
const STEPS: [&str; 3] = ["super", "collapse_gc", "between"];

/// What the parent-IOPS experiment (d) measured: each round's two windows, and where the
/// super windows lost writes.
#[derive(Default)]
struct ParentIops {
    plain: Vec<f64>,
    supers: Vec<f64>,
    control: ControlLatency,
    plain_latency: LatencyRecorder,
    super_latency: LatencyRecorder,
    /// Writes the super windows completed fewer than their round's plain window would have in
    /// the same time, per step of the cycle, and the writes that window would have completed.
    lost: [f64; 3],
    expected: f64,
    /// Bytes the shards wrote to storage in the plain and the super windows, and the parent
    /// writes of those windows (0 bytes when `/proc/PID/io` cannot be read).
    disk_bytes: [u64; 2],
    writes: [u64; 2],
}

/// Runs (d): `opts.iops_rounds` rounds, each a plain window and a super-every-second window of
/// `opts.iops_seconds` back to back (ABBA: every other round starts with the super window), so a
/// round's two windows see the same machine. A round's ratio is its plain IOPS over its super
/// IOPS; the figure is the median of the rounds' ratios, which one stall of the shared machine
/// in one window cannot move. Writes the per-10 ms timelines and the cycle steps as CSV.
async fn parent_iops(
    cluster: &Arc<Cluster>,
    base: &str,
    opts: &CowOptions,
    rng: &mut rand::rngs::StdRng,
    settle_s: &mut f64,
    out: &Path,
) -> anyhow::Result<ParentIops> {
    let mut d = ParentIops::default();
    let mut timeline_rows = vec![];
    let mut step_rows = vec![];
    let mut progress = Progress::new((opts.iops_rounds * 2) as u64, "parent IOPS, super every second");
    for round in 0..opts.iops_rounds {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        let mut windows: [Option<IopsWindow>; 2] = [None, None];
        let mut steps = vec![];
        for variant in order {
            *settle_s += settle(&opts.shard_pids, opts.settle_max_s).await;
            let vol = cluster.open(base).await?;
            let seed = rng.gen();
            let disk_before = written_bytes(&opts.shard_pids);
            let start = Instant::now();
            let mut disk_after = None;
            let w = if variant == 0 {
                let w = iops(&vol, start, opts.iops_seconds, 32, seed).await?;
                disk_after = written_bytes(&opts.shard_pids);
                w
            } else {
                let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
                let supers = tokio::spawn(super_every_second(cluster.clone(), base.to_string(), start, stop.clone()));
                let r = iops(&vol, start, opts.iops_seconds, 32, seed).await;
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                if r.is_ok() {
                    disk_after = written_bytes(&opts.shard_pids);
                }
                // The cycle under way ends (its collapse and GC) before the next window.
                let mut cycles = supers.await??;
                let w = r?;
                anyhow::ensure!(cycles.cycles > 0, "no super cycle completed during the IOPS run");
                steps = std::mem::take(&mut cycles.steps);
                d.control.merge(&cycles);
                w
            };
            if let (Some(a), Some(b)) = (disk_before, disk_after) {
                d.disk_bytes[variant] += b.saturating_sub(a);
            }
            d.writes[variant] += w.timeline.count();
            for (i, rate) in w.timeline.ops_per_s().iter().enumerate() {
                let t_ms = i as u64 * TIMELINE_BUCKET_MS;
                timeline_rows.push(vec![round.to_string(), ["plain", "super_every_1s"][variant].into(), t_ms.to_string(), format!("{rate:.0}")]);
            }
            windows[variant] = Some(w);
            progress.inc(1);
        }
        let [Some(plain), Some(sup)] = windows else { unreachable!("both windows ran") };
        // Where the super window lost writes: per step, the plain window's rate over the step's
        // time minus what the super window completed in it.
        let bucket = Duration::from_millis(TIMELINE_BUCKET_MS);
        let window = Duration::from_secs(opts.iops_seconds);
        let counts = sup.timeline.ops_per_s().iter().map(|r| r * bucket.as_secs_f64()).collect::<Vec<f64>>();
        let mut step_of = vec![2usize; window.as_millis().div_ceil(bucket.as_millis()) as usize];
        for (name, from, to) in &steps {
            let k = STEPS.iter().position(|s| s == name).expect("a known step");
            // A super's permission round trips follow its reply: its step runs 100 ms longer.
            let to = if *name == "super" { *to + Duration::from_millis(100) } else { *to };
            let (a, b) = ((from.as_millis() / bucket.as_millis()) as usize, to.as_millis().div_ceil(bucket.as_millis()) as usize);
            for s in step_of.iter_mut().take(b).skip(a) {
                *s = (*s).min(k);
            }
            step_rows.push(vec![round.to_string(), name.to_string(), from.as_millis().to_string(), to.as_millis().to_string()]);
        }
        let per_bucket = plain.ops_per_s * bucket.as_secs_f64();
        let mut lost = [0.0; 3];
        for (i, &k) in step_of.iter().enumerate() {
            lost[k] += per_bucket - counts.get(i).copied().unwrap_or(0.0);
        }
        let expected = per_bucket * step_of.len() as f64;
        eprintln!(
            "round {round}: plain {:.0} IOPS, super every 1 s {:.0} IOPS (plain/super {:.3}); super window lost {:.1}% in super steps, {:.1}% in collapse+GC, {:.1}% between",
            plain.ops_per_s,
            sup.ops_per_s,
            plain.ops_per_s / sup.ops_per_s,
            100.0 * lost[0] / expected,
            100.0 * lost[1] / expected,
            100.0 * lost[2] / expected,
        );
        for (t, l) in d.lost.iter_mut().zip(lost) {
            *t += l;
        }
        d.expected += expected;
        d.plain.push(plain.ops_per_s);
        d.supers.push(sup.ops_per_s);
        d.plain_latency.merge(&plain.latency);
        d.super_latency.merge(&sup.latency);
    }
    progress.finish();
    bench::write_csv(&out.join("parent_iops_timeline.csv"), &["round", "variant", "t_ms", "ops_per_s"], timeline_rows)?;
    bench::write_csv(&out.join("parent_iops_steps.csv"), &["round", "step", "from_ms", "to_ms"], step_rows)?;
    Ok(d)
}

/// The plain volume through real clients, after [`run`] on a cluster that serves NBD at
/// `nbd_addr`: fio's NBD engine against fio on a local file in `dir`, 4 KiB random writes at
/// depth 32, into `report` (`plain.fio_nbd.*`, `local_file.fio_fdatasync.*`, their ratio).
pub fn fio_figures(plain: &PlainVolume, nbd_addr: &str, dir: &Path, quick: bool, report: &mut Report) -> anyhow::Result<()> {
    let fio_started = Instant::now();
    // The plain volume through a real client: fio's NBD engine, 4 KiB random writes, depth 32,
    // on the benchmark's filled plain volume (every object exists, as every block of fio's
    // laid-out local file below does).
    let seconds = if quick { 2 } else { 10 };
    let size = format!("--size={}", plain.size_bytes);
    let uri = format!("nbd://{}/{}", nbd_addr, plain.name);
    let nbd_iops = fio_iops(&["--ioengine=nbd", &format!("--uri={uri}"), "--iodepth=32", &size], seconds)?;
    report.figure("plain.fio_nbd.write_4k.depth32.iops", nbd_iops)?;
    // fio on a local file of the same size in the same directory, every write followed by
    // fdatasync.
    let file = dir.join("fio-local.dat");
    let local_iops = fio_iops(
        &["--ioengine=psync", &format!("--filename={}", file.display()), "--fdatasync=1", "--numjobs=32", &size, "--group_reporting"],
        seconds,
    )?;
    report.figure("local_file.fio_fdatasync.write_4k.depth32.iops", local_iops)?;
    report.ratio("local_file_vs_plain.fio.write_4k.depth32.iops", local_iops, nbd_iops)?;
    report.figure("phase.fio_s", fio_started.elapsed().as_secs_f64())?;
    eprintln!("fio runs: done in {:.1} s", fio_started.elapsed().as_secs_f64());
    Ok(())
}

/// Runs fio's 4 KiB random-write job with `args` for `seconds`; returns its write IOPS.
fn fio_iops(args: &[&str], seconds: u64) -> anyhow::Result<f64> {
    let out = std::process::Command::new("fio")
        .args(["--name=bench", "--rw=randwrite", "--bs=4k", "--time_based", &format!("--runtime={seconds}"), "--output-format=json", "--verify_state_save=0"])
        .args(args)
        .output()
        .context("cannot run fio (install it: apt-get install fio)")?;
    anyhow::ensure!(out.status.success(), "fio failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    crate::fio::write_iops(&out.stdout)
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_batch_order_lets_every_variant_follow_every_other_equally_often() {
        let order = balanced_order(6);
        assert_eq!(order.len(), 18);
        let mut follows = [[0usize; 3]; 3];
        for row in order.chunks(3) {
            for w in row.windows(2) {
                follows[w[0]][w[1]] += 1;
            }
        }
        for (a, row) in follows.iter().enumerate() {
            for (b, &n) in row.iter().enumerate() {
                assert_eq!(n, if a == b { 0 } else { 2 }, "{follows:?}");
            }
        }
        // Each variant once per row, and in each position of a row twice.
        for v in 0..3 {
            assert!(order.chunks(3).all(|r| r.iter().filter(|&&x| x == v).count() == 1));
            for pos in 0..3 {
                assert_eq!(order.chunks(3).filter(|r| r[pos] == v).count(), 2);
            }
        }
    }
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

impl ParentIops {
    fn report(&self, report: &mut Report) -> anyhow::Result<()> {
        let avg = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
        report.figure("plain.parent.write_4k.depth32.iops", avg(&self.plain))?;
        report.figure("super_every_1s.parent.write_4k.depth32.iops", avg(&self.supers))?;
        report.figure("super_every_1s.rounds.count", self.plain.len() as f64)?;
        report.figure("super_every_1s.cycles.count", self.control.cycles as f64)?;
        report.latency("plain.parent.write_4k.depth32.latency", &self.plain_latency.summary())?;
        report.latency("super_every_1s.parent.write_4k.depth32.latency", &self.super_latency.summary())?;
        // `super` and `collapse` as the metadata service's clients see them, while the parent
        // writes at depth 32 (so every super registers a child of a busy volume).
        report.latency("super_every_1s.super.latency", &self.control.super_.summary())?;
        report.latency("super_every_1s.collapse.latency", &self.control.collapse.summary())?;
        let ratios: Vec<f64> = self.plain.iter().zip(&self.supers).map(|(p, s)| p / s).collect();
        for (i, (p, s)) in self.plain.iter().zip(&self.supers).enumerate() {
            report.figure(&format!("plain.parent.round{i}.write_4k.depth32.iops"), *p)?;
            report.figure(&format!("super_every_1s.parent.round{i}.write_4k.depth32.iops"), *s)?;
            report.ratio(&format!("plain_vs_super_every_1s.parent.round{i}.iops"), *p, *s)?;
        }
        // The median of the rounds' ratios (each from two adjacent windows), as a ratio over 1.
        // Plain over super, as named: above 1 the parent loses IOPS to the super cycles.
        report.ratio("plain_vs_super_every_1s.parent.iops", median(&ratios), 1.0)?;
        // The same the other way up (the parent's IOPS with super every second as a share of
        // its plain IOPS), for reading "within 5%" as ≥ 0.95.
        let inverse: Vec<f64> = ratios.iter().map(|r| 1.0 / r).collect();
        report.ratio("super_every_1s_vs_plain.parent.iops", median(&inverse), 1.0)?;
        for (v, name) in ["plain", "super_every_1s"].iter().enumerate() {
            if self.writes[v] > 0 && self.disk_bytes[v] > 0 {
                report.figure(&format!("{name}.parent.shard_disk_write_per_write_bytes"), self.disk_bytes[v] as f64 / self.writes[v] as f64)?;
            }
        }
        for (k, name) in STEPS.iter().enumerate() {
            report.figure(&format!("super_every_1s.parent.lost_writes.{name}_percent"), 100.0 * self.lost[k] / self.expected)?;
        }
        Ok(())
    }
}
