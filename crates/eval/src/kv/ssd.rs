//! `understudy bench kv ssd`: the CANDStore paper's Figure 8 (SSD read and write throughput by
//! block size, §7.6) on this machine's disk, through the backup's own SSD tier: a segment of
//! `kv::witness::store::ssdlog` opened `O_DIRECT`, read by the `io` pool (one worker per
//! request in flight, so the pool size is the queue depth), written by log appends each made
//! durable with `fdatasync` (what writeback does). Sequential and random reads at 4 KiB … 1 MiB
//! and queue depths 1, 4 (and 16 in the full run); writes at queue depth 1.
//!
//! It picks the two sizes the witness KV needs: the writeback batch (the smallest write size
//! within 90% of the best write throughput; the paper's 32 KB) and the BatchPull size (the
//! smallest sequential read size within 90% of the best at queue depth 1).
//!
//! Two more measurements the witness KV's tiers need: the latency of a 4 KiB PriorityPull
//! while a BatchPull stream (128 KiB, 2 in flight) runs through the same pool, unthrottled and
//! throttled to 25% of the best sequential read (the paper's ratio, §7.7), against the
//! PriorityPull alone; and the persist latency of the NVMM emulation, `--pmem shm` against the
//! power-safe `--pmem dsync`.
//!
//! Caveat: `O_DIRECT` keeps this kernel's page cache out, but a virtual disk's host may cache;
//! the figures are what this guest sees.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use rand::{Rng, SeedableRng};

use ::kv::witness::store::io::{IoClass, IoConfig, IoOp, IoPool, IoRequest};
use ::kv::witness::store::pmem::{PmemConfig, PmemMode, PmemRegion};
use ::kv::witness::store::ssdlog::{LogKind, LogTs, SsdConfig, SsdEntry, SsdLogs, PAGE_BYTES};

#[derive(Args, Debug)]
pub struct KvSsdArgs {
    /// A short run (under a minute) that still measures every figure.
    #[arg(long)]
    pub quick: bool,
    /// Where plots (SVG, PNG) and raw samples (CSV) go [default: target/bench/kv].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// A directory on the disk under test for the scratch segment (removed afterwards); tmpfs
    /// is refused.
    #[arg(long, value_name = "DIR", default_value = "/var/tmp")]
    pub dir: PathBuf,
    /// Size of the segment the reads run over, in MiB [default: 2048; 256 with --quick].
    #[arg(long)]
    pub file_mib: Option<u64>,
    /// Seconds measured per point [default: 2; 0.25 with --quick].
    #[arg(long)]
    pub point_s: Option<f64>,
}

/// One measured point.
#[derive(Clone, Debug)]
struct Point {
    pattern: &'static str,
    block_bytes: usize,
    qd: usize,
    mib_per_s: f64,
    ios: u64,
    p50_us: f64,
    p99_us: f64,
}

fn percentile_us(sorted_ns: &[u64], p: f64) -> f64 {
    if sorted_ns.is_empty() {
        return 0.0;
    }
    let i = ((sorted_ns.len() as f64 - 1.0) * p).round() as usize;
    sorted_ns[i] as f64 / 1e3
}

/// A key of 8 bytes and a value that makes the framed entry exactly `framed` bytes.
fn entry(i: u64, framed: usize) -> SsdEntry {
    let key = format!("{i:08}").into_bytes();
    let overhead = ::kv::witness::store::ssdlog::framed_len(&key, &[]);
    SsdEntry {
        key,
        ts: LogTs { term: 1, index: i },
        value: vec![(i % 251) as u8; framed - overhead],
    }
}

/// Entries that pack into exactly `bytes` (a page multiple): one entry per page, or one
/// entry of the whole block for blocks above a page.
fn batch(first: u64, bytes: usize) -> Vec<SsdEntry> {
    if bytes <= PAGE_BYTES {
        vec![entry(first, bytes)]
    } else {
        // An entry larger than a page starts on a page and owns its last page: exact.
        vec![entry(first, bytes.min(512 * 1024))]
            .into_iter()
            .cycle()
            .take(bytes.div_ceil(512 * 1024))
            .enumerate()
            .map(|(k, mut e)| {
                e.ts.index += k as u64;
                e
            })
            .collect()
    }
}

fn write_point(
    logs: &SsdLogs,
    bytes: usize,
    dur: Duration,
    cap_bytes: u64,
) -> anyhow::Result<Point> {
    let mut lat = Vec::new();
    let t0 = Instant::now();
    let mut written = 0u64;
    let mut i = 0;
    while t0.elapsed() < dur && written < cap_bytes {
        let b = batch(i, bytes);
        i += b.len() as u64;
        let s = Instant::now();
        logs.append(LogKind::Hot, &b)?;
        lat.push(s.elapsed().as_nanos() as u64);
        written += bytes as u64;
    }
    let secs = t0.elapsed().as_secs_f64();
    lat.sort_unstable();
    Ok(Point {
        pattern: "write",
        block_bytes: bytes,
        qd: 1,
        mib_per_s: written as f64 / (1 << 20) as f64 / secs,
        ios: lat.len() as u64,
        p50_us: percentile_us(&lat, 0.5),
        p99_us: percentile_us(&lat, 0.99),
    })
}

fn read_point(
    logs: &Arc<SsdLogs>,
    seg: u64,
    file_bytes: u64,
    bytes: usize,
    qd: usize,
    random: bool,
    dur: Duration,
) -> anyhow::Result<Point> {
    let cfg = IoConfig {
        workers: qd,
        in_flight_max: [qd; 4],
        batch_pull_bytes_per_s: None,
        ..Default::default()
    };
    let (sub, done, pool) = IoPool::spawn(logs.clone(), cfg);
    let blocks = file_bytes / bytes as u64;
    anyhow::ensure!(
        blocks > 0,
        "the segment is smaller than one {bytes} B block"
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x55d ^ bytes as u64 ^ (qd as u64) << 32);
    let mut cursor = 0u64;
    let mut next = |id: u64| {
        let block = if random {
            rng.gen_range(0..blocks)
        } else {
            let b = cursor % blocks;
            cursor += 1;
            b
        };
        IoRequest {
            id,
            class: IoClass::BatchPull,
            op: IoOp::Read {
                seg,
                off: block * bytes as u64,
                len: bytes,
            },
        }
    };
    let t0 = Instant::now();
    let mut outstanding = 0;
    let mut id = 0;
    for _ in 0..qd {
        sub.submit(next(id))?;
        id += 1;
        outstanding += 1;
    }
    let mut lat = Vec::new();
    while outstanding > 0 {
        let c = done.recv().context("the I/O pool stopped")?;
        outstanding -= 1;
        c.result.with_context(|| format!("read of {bytes} B"))?;
        lat.push(c.service.as_nanos() as u64);
        if t0.elapsed() < dur {
            sub.submit(next(id))?;
            id += 1;
            outstanding += 1;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    drop(sub);
    pool.join();
    lat.sort_unstable();
    Ok(Point {
        pattern: if random { "rand_read" } else { "seq_read" },
        block_bytes: bytes,
        qd,
        mib_per_s: lat.len() as f64 * bytes as f64 / (1 << 20) as f64 / secs,
        ios: lat.len() as u64,
        p50_us: percentile_us(&lat, 0.5),
        p99_us: percentile_us(&lat, 0.99),
    })
}

/// PriorityPull latency (submission to completion: the queueing a Get sees) of random 4 KiB
/// page reads, one at a time, while BatchPull streams `pull_bytes` sequential reads with
/// `pull_qd` in flight through the same pool (none if `pull_qd` is 0), at `rate` bytes/s
/// (`None`: unthrottled). Returns the latencies (ns) and BatchPull's MiB/s.
#[allow(clippy::too_many_arguments)]
fn priority_under_pull(
    logs: &Arc<SsdLogs>,
    seg: u64,
    file_bytes: u64,
    pull_bytes: usize,
    pull_qd: usize,
    rate: Option<u64>,
    dur: Duration,
    seed: u64,
) -> anyhow::Result<(Vec<u64>, f64)> {
    let cfg = IoConfig {
        workers: pull_qd + 1,
        in_flight_max: [1, 1, pull_qd.max(1), 1],
        batch_pull_bytes_per_s: rate,
        batch_pull_burst_bytes: pull_bytes as u64,
        ..Default::default()
    };
    let (sub, done, pool) = IoPool::spawn(logs.clone(), cfg);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let pages = file_bytes / PAGE_BYTES as u64;
    let pulls = file_bytes / pull_bytes as u64;
    let mut cursor = 0u64;
    let mut id = 0u64;
    let t0 = Instant::now();
    let mut pull = |id: u64| {
        let off = cursor % pulls * pull_bytes as u64;
        cursor += 1;
        IoRequest {
            id,
            class: IoClass::BatchPull,
            op: IoOp::Read {
                seg,
                off,
                len: pull_bytes,
            },
        }
    };
    for _ in 0..pull_qd {
        sub.submit(pull(id))?;
        id += 1;
    }
    // Let the stream reach the disk before the first PriorityPull.
    std::thread::sleep(Duration::from_millis(20));
    let prio = |id: u64, rng: &mut rand::rngs::StdRng| IoRequest {
        id: id | 1 << 63,
        class: IoClass::PriorityPull,
        op: IoOp::Read {
            seg,
            off: rng.gen_range(0..pages) * PAGE_BYTES as u64,
            len: PAGE_BYTES,
        },
    };
    sub.submit(prio(id, &mut rng))?;
    id += 1;
    let (mut outstanding_pulls, mut prio_out) = (pull_qd, true);
    let (mut lat, mut pulled) = (Vec::new(), 0u64);
    let pull_t0 = Instant::now();
    while outstanding_pulls > 0 || prio_out {
        let c = done.recv().context("the I/O pool stopped")?;
        c.result.context("a read")?;
        let running = t0.elapsed() < dur;
        if c.class == IoClass::PriorityPull {
            lat.push((c.queued + c.service).as_nanos() as u64);
            prio_out = running;
            if running {
                sub.submit(prio(id, &mut rng))?;
                id += 1;
            }
        } else {
            pulled += pull_bytes as u64;
            outstanding_pulls -= 1;
            if running {
                sub.submit(pull(id))?;
                id += 1;
                outstanding_pulls += 1;
            }
        }
    }
    let pull_mib_s = pulled as f64 / (1 << 20) as f64 / pull_t0.elapsed().as_secs_f64();
    drop(sub);
    pool.join();
    Ok((lat, pull_mib_s))
}

/// Persist latencies (ns) of `pmem` appends of `bytes` for `dur`.
fn pmem_persists(
    dir: &std::path::Path,
    mode: PmemMode,
    bytes: usize,
    dur: Duration,
) -> anyhow::Result<Vec<u64>> {
    let path = dir.join(format!("pmem-{mode:?}"));
    let cfg = PmemConfig {
        mode,
        capacity_bytes: 64 << 20,
        persist_ns: 0,
    };
    let mut r = PmemRegion::open(&path, &cfg)?;
    let payload = vec![0x5a; bytes];
    let (mut lat, t0) = (Vec::new(), Instant::now());
    let mut seq = 0;
    while t0.elapsed() < dur {
        seq += 1;
        if r.used_bytes() + 2 * bytes as u64 > r.capacity_bytes() {
            r.truncate_through(seq - 1)?;
        }
        let s = Instant::now();
        r.append(seq, &payload)?;
        lat.push(s.elapsed().as_nanos() as u64);
    }
    drop(r);
    std::fs::remove_file(&path)?;
    lat.sort_unstable();
    Ok(lat)
}

/// The smallest block size whose throughput is within `frac` of the best among `pts`.
fn pick(pts: &[&Point], frac: f64) -> usize {
    let best = pts.iter().map(|p| p.mib_per_s).fold(0.0, f64::max);
    pts.iter()
        .filter(|p| p.mib_per_s >= frac * best)
        .map(|p| p.block_bytes)
        .min()
        .unwrap_or(PAGE_BYTES)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// The best sequential `O_DIRECT` read throughput of this disk, in MiB/s, over a scratch
/// segment of `file_mib` MiB in `dir` (removed afterwards): 128 KiB and 1 MiB reads at queue
/// depths 1 and 4, `point` each. The paper's offline-recovery bound divides the shard's bytes
/// by this (§7.7); `bench kv ttr` measures it in its own run so the bound fits this machine now.
pub fn best_sequential_read_mib_per_s(
    dir: &std::path::Path,
    file_mib: u64,
    point: Duration,
) -> anyhow::Result<f64> {
    let scratch = tempfile::tempdir_in(dir)
        .with_context(|| format!("a scratch directory in {}", dir.display()))?;
    let file_bytes = file_mib << 20;
    let (logs, _) = SsdLogs::open(
        scratch.path(),
        SsdConfig {
            segment_max_bytes: file_bytes + (4 << 20),
        },
    )?;
    let mut i = 0;
    for _ in 0..file_mib {
        let b = batch(i, 1 << 20);
        i += b.len() as u64;
        logs.append(LogKind::Cold, &b)?;
    }
    let (seg, seg_bytes) = logs.segments(LogKind::Cold)[0];
    anyhow::ensure!(
        seg_bytes == file_bytes,
        "the read segment holds {seg_bytes} B, not {file_bytes}"
    );
    let logs = Arc::new(logs);
    let mut best: f64 = 0.0;
    for bs in [128 << 10, 1 << 20] {
        for qd in [1, 4] {
            let p = read_point(&logs, seg, file_bytes, bs, qd, false, point)?;
            best = best.max(p.mib_per_s);
        }
    }
    Ok(best)
}

pub fn run(a: &KvSsdArgs) -> anyhow::Result<bench::Report> {
    let file_mib = a.file_mib.unwrap_or(if a.quick { 256 } else { 2048 });
    let point = Duration::from_secs_f64(a.point_s.unwrap_or(if a.quick { 0.25 } else { 2.0 }));
    let kib = |k: usize| k * 1024;
    let sizes: Vec<usize> = if a.quick {
        [4, 32, 128, 1024].map(kib).to_vec()
    } else {
        [4, 8, 16, 32, 64, 128, 256, 512, 1024].map(kib).to_vec()
    };
    let depths: &[usize] = if a.quick { &[1, 4] } else { &[1, 4, 16] };
    let out = bench::out_dir("kv", a.out.clone())?;
    let scratch = tempfile::tempdir_in(&a.dir)
        .with_context(|| format!("a scratch directory in {}", a.dir.display()))?;
    let file_bytes = file_mib << 20;
    let (logs, _) = SsdLogs::open(
        scratch.path(),
        SsdConfig {
            segment_max_bytes: file_bytes + (4 << 20),
        },
    )?;
    eprintln!("kv ssd: load before: {}", loadavg());
    // Writes first (each point into a fresh hot segment, deleted after it).
    let mut points = Vec::new();
    let write_cap = (file_bytes / 4).max(16 << 20);
    for &bs in &sizes {
        let p = write_point(&logs, bs, point, write_cap)?;
        eprintln!(
            "kv ssd: write {:>5} KiB: {:8.1} MiB/s",
            bs / 1024,
            p.mib_per_s
        );
        points.push(p);
        logs.seal(LogKind::Hot);
        for (seg, _) in logs.segments(LogKind::Hot) {
            logs.delete_segment(seg)?;
        }
    }
    // The read segment: 1 MiB batches.
    let fill = Instant::now();
    let mut i = 0;
    for _ in 0..file_mib {
        let b = batch(i, 1 << 20);
        i += b.len() as u64;
        logs.append(LogKind::Cold, &b)?;
    }
    let (seg, seg_bytes) = logs.segments(LogKind::Cold)[0];
    anyhow::ensure!(
        seg_bytes == file_bytes,
        "the read segment holds {seg_bytes} B, not {file_bytes}"
    );
    eprintln!(
        "kv ssd: wrote the {file_mib} MiB read segment in {:.1} s",
        fill.elapsed().as_secs_f64()
    );
    let logs = Arc::new(logs);
    // Sequential and random alternate at each size and depth, so drift hits both alike.
    for &bs in &sizes {
        for &qd in depths {
            for random in [false, true] {
                let p = read_point(&logs, seg, file_bytes, bs, qd, random, point)?;
                eprintln!(
                    "kv ssd: {:9} {:>5} KiB qd{qd:<2}: {:8.1} MiB/s p50 {:7.1} us",
                    p.pattern,
                    bs / 1024,
                    p.mib_per_s,
                    p.p50_us
                );
                points.push(p);
            }
        }
    }
    // PriorityPull under a BatchPull stream (§7.7, M20): alone, unthrottled, and at 25% of the
    // best sequential read (the paper's 201 s vs 50.6 s), interleaved A B C C B A.
    let best_seq = points
        .iter()
        .filter(|p| p.pattern == "seq_read")
        .map(|p| p.mib_per_s)
        .fold(0.0, f64::max);
    let pull_bytes = 128 * 1024;
    let quarter = (best_seq * 0.25 * (1 << 20) as f64) as u64;
    let variants: [(&str, usize, Option<u64>); 3] = [
        ("alone", 0, None),
        ("unthrottled", 2, None),
        ("throttled_25pct", 2, Some(quarter.max(1 << 20))),
    ];
    let mut prio: [(Vec<u64>, Vec<f64>); 3] = Default::default();
    for (round, v) in [0, 1, 2, 2, 1, 0].into_iter().enumerate() {
        let (name, qd, rate) = variants[v];
        let (lat, mib) = priority_under_pull(
            &logs,
            seg,
            file_bytes,
            pull_bytes,
            qd,
            rate,
            point,
            round as u64,
        )?;
        eprintln!(
            "kv ssd: priority pull, batch pull {name}: {} reads, batch pull {mib:.1} MiB/s",
            lat.len()
        );
        prio[v].0.extend(lat);
        prio[v].1.push(mib);
    }
    // NVMM persists: the shm emulation against the power-safe dsync file.
    let shm_lat = pmem_persists(std::path::Path::new("/dev/shm"), PmemMode::Shm, 1024, point)?;
    let dsync_lat = pmem_persists(scratch.path(), PmemMode::Dsync, 1024, point)?;
    eprintln!("kv ssd: load after: {}", loadavg());
    let mut report = bench::Report::new("kv.ssd", a.quick);
    for (v, (name, qd, _)) in variants.iter().enumerate() {
        let lat = &mut prio[v].0;
        lat.sort_unstable();
        report.figure(
            &format!("priority_pull.batch_{name}.latency_us_p50"),
            percentile_us(lat, 0.5),
        )?;
        report.figure(
            &format!("priority_pull.batch_{name}.latency_us_p99"),
            percentile_us(lat, 0.99),
        )?;
        if *qd > 0 {
            let mib = prio[v].1.iter().sum::<f64>() / prio[v].1.len() as f64;
            report.figure(&format!("batch_pull.{name}.throughput_mib_per_s"), mib)?;
        }
    }
    let p99 = |v: usize| percentile_us(&prio[v].0, 0.99);
    report.ratio(
        "unthrottled_vs_throttled.priority_pull.latency_p99",
        p99(1),
        p99(2),
    )?;
    report.ratio(
        "throttled_vs_alone.priority_pull.latency_p99",
        p99(2),
        p99(0),
    )?;
    for (name, lat) in [("shm", &shm_lat), ("dsync", &dsync_lat)] {
        report.figure(
            &format!("pmem.{name}.persist_1kib.latency_us_p50"),
            percentile_us(lat, 0.5),
        )?;
        report.figure(
            &format!("pmem.{name}.persist_1kib.latency_us_p99"),
            percentile_us(lat, 0.99),
        )?;
    }
    report.ratio(
        "dsync_vs_shm.pmem.persist_1kib.latency_p50",
        percentile_us(&dsync_lat, 0.5),
        percentile_us(&shm_lat, 0.5).max(0.001),
    )?;
    report.figure("file_bytes", file_bytes as f64)?;
    for p in &points {
        let name = format!("{}.bs_{}kib.qd{}", p.pattern, p.block_bytes / 1024, p.qd);
        report.figure(&format!("{name}.throughput_mib_per_s"), p.mib_per_s)?;
        report.figure(&format!("{name}.latency_us_p50"), p.p50_us)?;
        report.figure(&format!("{name}.latency_us_p99"), p.p99_us)?;
    }
    let find = |pat: &str, bs: usize, qd: usize| {
        points
            .iter()
            .find(|p| p.pattern == pat && p.block_bytes == bs && p.qd == qd)
            .map(|p| p.mib_per_s)
    };
    if let (Some(r), Some(s)) = (find("rand_read", 4096, 1), find("seq_read", 4096, 1)) {
        report.ratio("rand_vs_seq.read.bs_4kib.qd1.throughput", r, s)?;
    }
    let writes: Vec<&Point> = points.iter().filter(|p| p.pattern == "write").collect();
    let seq1: Vec<&Point> = points
        .iter()
        .filter(|p| p.pattern == "seq_read" && p.qd == 1)
        .collect();
    report.figure("pick.writeback_batch_bytes", pick(&writes, 0.9) as f64)?;
    report.figure("pick.batch_pull_bytes", pick(&seq1, 0.9) as f64)?;
    report.figure("seq_read.best.throughput_mib_per_s", best_seq)?;
    bench::write_csv(
        &out.join("ssd.csv"),
        &[
            "pattern",
            "block_bytes",
            "qd",
            "throughput_mib_per_s",
            "ios",
            "latency_us_p50",
            "latency_us_p99",
        ],
        points.iter().map(|p| {
            vec![
                p.pattern.to_string(),
                p.block_bytes.to_string(),
                p.qd.to_string(),
                format!("{:.2}", p.mib_per_s),
                p.ios.to_string(),
                format!("{:.1}", p.p50_us),
                format!("{:.1}", p.p99_us),
            ]
        }),
    )?;
    let mut series = Vec::new();
    for pat in ["seq_read", "rand_read", "write"] {
        for &qd in depths {
            let pts: Vec<(f64, f64)> = points
                .iter()
                .filter(|p| p.pattern == pat && p.qd == qd)
                .map(|p| ((p.block_bytes / 1024) as f64, p.mib_per_s))
                .collect();
            if !pts.is_empty() {
                series.push(bench::Series {
                    name: format!("{pat} qd{qd}"),
                    points: pts,
                });
            }
        }
    }
    bench::line_plot(
        &out.join("ssd_throughput"),
        "O_DIRECT throughput by block size through the backup's SSD tier (cf. CANDStore Fig 8)",
        "block size (KiB)",
        "MiB/s",
        &series,
        bench::Scale::Log,
    )?;
    eprintln!("plots and samples in {}", out.display());
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_ssd_bench_runs_small_and_reports_every_point() {
        let out = tempfile::tempdir_in("/var/tmp").unwrap();
        let a = KvSsdArgs {
            quick: true,
            out: Some(out.path().to_path_buf()),
            dir: PathBuf::from("/var/tmp"),
            file_mib: Some(8),
            point_s: Some(0.02),
        };
        let r = run(&a).unwrap();
        let v: serde_json::Value = serde_json::from_str(&r.to_json_line()).unwrap();
        let f = &v["figures"];
        for name in [
            "write.bs_32kib.qd1.throughput_mib_per_s",
            "seq_read.bs_1024kib.qd4.throughput_mib_per_s",
            "rand_read.bs_4kib.qd1.latency_us_p50",
            "pick.writeback_batch_bytes",
            "pick.batch_pull_bytes",
            "priority_pull.batch_throttled_25pct.latency_us_p99",
            "batch_pull.unthrottled.throughput_mib_per_s",
            "pmem.dsync.persist_1kib.latency_us_p50",
        ] {
            assert!(f[name].as_f64().is_some_and(|x| x > 0.0), "{name}: {f}");
        }
        assert!(out.path().join("ssd.csv").exists());
        // tmpfs is refused with the tier's own error.
        let shm = KvSsdArgs {
            dir: PathBuf::from("/dev/shm"),
            ..a
        };
        let e = run(&shm).err().unwrap();
        assert!(format!("{e:#}").contains("O_DIRECT"), "{e:#}");
    }
}
