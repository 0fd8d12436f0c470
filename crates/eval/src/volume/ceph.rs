//! `understudy bench volume ceph`: Understudy's volume beside a real single-node Ceph cluster.
//!
//! Brings up Ceph ([`testbed::ceph::CephCluster`]: one `ceph-mon` and one `ceph-osd` per
//! replica) in a temporary directory; Understudy's cluster keeps the same number of replicas. Then fio — the same client on both
//! systems — measures 4 KiB random writes at depth 1 (latency) and depth 32 (IOPS) on an rbd
//! image, an rbd clone whose writes each hit an object not yet copied up, Understudy's plain
//! volume and its `super` child, variants interleaved round by round. Every Ceph process is
//! killed by PID when the cluster is dropped, also on error and after Ctrl-C (the first SIGINT or
//! SIGTERM ends the run at the next step).

use std::path::Path;
use std::process::Stdio;
use std::time::Instant;

use anyhow::{bail, ensure, Context};

use super::CommonArgs;
use crate::fio::FioWrites;
use testbed::ceph::{catch_interrupts, check_interrupted, missing_packages, timeout_cmd, CephCluster, CEPH_PACKAGES, POOL};

#[derive(clap::Args, Debug)]
pub struct CephArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Copies of every object on both systems: Ceph runs this many OSDs with pool size this
    /// (min_size as Ceph's default: size - size/2), Understudy's cluster this many replicas. 1 is
    /// the comparison made before: one OSD, pool size 1
    #[arg(long, default_value_t = 3, value_name = "N")]
    pub replicas: u32,
}

/// Both systems use this object size, so a copy-up copies the same amount of data.
const OBJECT_SIZE_BYTES: u64 = 64 << 10;
const WRITE_BYTES: u64 = 4 << 10;
/// The region random writes on plain images go to (pre-written, so no write allocates).
const PLAIN_REGION_BYTES: u64 = 256 << 20;
/// Bound on one fio job (the longest, a full run's clone at depth 1 on a loaded machine, takes
/// well under a minute).
const FIO_TIMEOUT_S: u64 = 600;

/// Runs one fio job (4 KiB writes) with `args`; `ceph_conf` is set as `CEPH_CONF` for the rbd engine.
fn fio(args: &[String], ceph_conf: &Path) -> anyhow::Result<FioWrites> {
    let out = timeout_cmd("fio", FIO_TIMEOUT_S)
        .args(["--name=bench", "--bs=4k", "--output-format=json", "--lat_percentiles=1", "--randrepeat=0", "--verify_state_save=0"])
        .args(args)
        .env("CEPH_CONF", ceph_conf)
        .stdin(Stdio::null())
        .output()
        .context("cannot run fio (install it: apt-get install fio)")?;
    check_interrupted()?;
    ensure!(out.status.success(), "fio {} failed ({}): {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr).trim());
    crate::fio::first_job_writes(&out.stdout)
}

/// Where fio writes: an rbd image through librbd or an Understudy volume through NBD.
#[derive(Clone)]
enum Target {
    Rbd(String),
    Nbd(String),
}

impl Target {
    fn engine_args(&self) -> Vec<String> {
        match self {
            Target::Rbd(image) => vec!["--ioengine=rbd".into(), "--clientname=admin".into(), format!("--pool={POOL}"), format!("--rbdname={image}")],
            Target::Nbd(uri) => vec!["--ioengine=nbd".into(), format!("--uri={uri}")],
        }
    }
}

/// One measured system: plain images get random writes over a pre-written region for a fixed
/// time; clones get one 4 KiB write per object (`rw=write:60k`), each in an object not written
/// since the clone was made, so every write is a copy-up.
struct Variant {
    name: &'static str,
    target: Target,
    clone: bool,
    /// Next never-written object of a clone.
    next_object: u64,
    depth1: Vec<FioWrites>,
    depth32: Vec<FioWrites>,
}

struct Plan {
    rounds: usize,
    plain_seconds: u64,
    clone_writes_depth1: u64,
    clone_writes_depth32: u64,
}

impl Plan {
    fn new(quick: bool) -> Plan {
        if quick {
            Plan { rounds: 2, plain_seconds: 3, clone_writes_depth1: 200, clone_writes_depth32: 1000 }
        } else {
            Plan { rounds: 4, plain_seconds: 10, clone_writes_depth1: 1000, clone_writes_depth32: 4000 }
        }
    }
    /// Bytes of parent every clone needs: one object per measured write.
    fn clone_region_bytes(&self) -> u64 {
        self.rounds as u64 * (self.clone_writes_depth1 + self.clone_writes_depth32) * OBJECT_SIZE_BYTES
    }
}

impl Variant {
    fn measure(&mut self, plan: &Plan, depth: u32, conf: &Path) -> anyhow::Result<()> {
        let mut args = self.target.engine_args();
        args.push(format!("--iodepth={depth}"));
        if self.clone {
            let writes = if depth == 1 { plan.clone_writes_depth1 } else { plan.clone_writes_depth32 };
            args.push(format!("--rw=write:{}k", (OBJECT_SIZE_BYTES - WRITE_BYTES) >> 10));
            args.push(format!("--offset={}", self.next_object * OBJECT_SIZE_BYTES));
            args.push(format!("--size={}", writes * OBJECT_SIZE_BYTES));
            self.next_object += writes;
        } else {
            args.extend(["--rw=randwrite".into(), "--norandommap".into(), format!("--size={PLAIN_REGION_BYTES}")]);
            args.extend(["--time_based".into(), format!("--runtime={}", plan.plain_seconds)]);
        }
        let r = fio(&args, conf).with_context(|| format!("{} at depth {depth}", self.name))?;
        eprintln!("  {:<10} depth {depth:>2}: {:>6} writes, {:>8.0} IOPS, mean {:>8.0} us", self.name, r.ios, r.ios as f64 * 1e3 / r.runtime_ms as f64, r.lat_mean_us);
        if depth == 1 { &mut self.depth1 } else { &mut self.depth32 }.push(r);
        Ok(())
    }
}

/// Sequential 1 MiB writes over `[0, bytes)` so that every object exists.
fn prefill(target: &Target, bytes: u64, conf: &Path) -> anyhow::Result<()> {
    let mut args = target.engine_args();
    args.extend(["--rw=write".into(), "--bs=1M".into(), "--iodepth=8".into(), format!("--size={bytes}")]);
    fio(&args, conf).map(|_| ())
}

/// Totals of several rounds: latency mean weighted by writes, percentiles averaged over rounds
/// (fio reports them per run), IOPS as all writes over all run time.
pub fn combine(runs: &[FioWrites]) -> Option<FioWrites> {
    let ios: u64 = runs.iter().map(|r| r.ios).sum();
    if ios == 0 {
        return None;
    }
    let n = runs.len() as f64;
    Some(FioWrites {
        ios,
        runtime_ms: runs.iter().map(|r| r.runtime_ms).sum(),
        lat_mean_us: runs.iter().map(|r| r.lat_mean_us * r.ios as f64).sum::<f64>() / ios as f64,
        lat_p50_us: runs.iter().map(|r| r.lat_p50_us).sum::<f64>() / n,
        lat_p99_us: runs.iter().map(|r| r.lat_p99_us).sum::<f64>() / n,
    })
}

fn iops(r: &FioWrites) -> f64 {
    r.ios as f64 * 1e3 / r.runtime_ms as f64
}

pub fn run(a: CephArgs, verbose: u8) -> anyhow::Result<bench::Report> {
    // Fail before starting anything on bad options or when Ceph is missing.
    let replicas = a.replicas;
    ensure!((1..=a.common.shards).contains(&replicas), "--replicas must be between 1 and --shards ({})", a.common.shards);
    let missing = missing_packages();
    if !missing.is_empty() {
        bail!("this benchmark needs Ceph (missing {}); install it with:\n  apt-get install -y --no-install-recommends {CEPH_PACKAGES}", missing.join(", "));
    }
    let quick = a.common.quick;
    catch_interrupts();
    super::on_cluster(&a.common, replicas, "volume.ceph", verbose, |cluster, info, _out, dir, mut report| async move {
        check_interrupted()?;
        let plan = Plan::new(quick);
        let region = plan.clone_region_bytes();
        let started = Instant::now();
        eprintln!("starting ceph-mon and {replicas} ceph-osd in {}", dir.join("ceph").display());
        let ceph = CephCluster::start(&dir.join("ceph"), replicas)?;
        let (size, min_size) = (ceph.pool_value("size")?, ceph.pool_value("min_size")?);
        ensure!(size == replicas as u64, "Ceph's pool has size {size}, not {replicas}");
        eprintln!("ceph ready in {:.1} s: {replicas} OSDs, pool size {size}, min_size {min_size}", started.elapsed().as_secs_f64());
        report.figure("phase.ceph_start_s", started.elapsed().as_secs_f64())?;
        let conf = ceph.conf.clone();
        let obj = format!("{}K", OBJECT_SIZE_BYTES >> 10);
        let plain_mib = (PLAIN_REGION_BYTES >> 20).to_string();
        let region_mib = (region >> 20).to_string();
        ceph.rbd(&["create", "--size", &plain_mib, "--object-size", &obj, "plain"])?;
        ceph.rbd(&["create", "--size", &plain_mib, "--object-size", "4M", "plain4m"])?;
        ceph.rbd(&["create", "--size", &region_mib, "--object-size", &obj, "parent"])?;
        // Understudy: the same three volumes (it needs no 4 MiB-object twin).
        let create = |name: &str, size_bytes: u64| volume::driver::meta::MetaReq::Create { name: name.into(), size_bytes, object_size_bytes: OBJECT_SIZE_BYTES as u32 };
        cluster.meta(create("plain", PLAIN_REGION_BYTES)).await?;
        cluster.meta(create("parent", region)).await?;
        let nbd = |name: &str| Target::Nbd(format!("nbd://{}/{name}", info.nbd.addr));
        eprintln!("pre-writing images ({} MiB plain, {} MiB parent on each system)", plain_mib, region_mib);
        let prefill_started = Instant::now();
        for t in [Target::Rbd("plain".into()), Target::Rbd("plain4m".into()), Target::Rbd("parent".into()), nbd("plain"), nbd("parent")] {
            let bytes = if matches!(&t, Target::Rbd(n) | Target::Nbd(n) if n.ends_with("parent")) { region } else { PLAIN_REGION_BYTES };
            prefill(&t, bytes, &conf)?;
        }
        ceph.rbd(&["snap", "create", "parent@base"])?;
        ceph.rbd(&["snap", "protect", "parent@base"])?;
        ceph.rbd(&["clone", &format!("{POOL}/parent@base"), &format!("{POOL}/child")])?;
        cluster.meta(volume::driver::meta::MetaReq::Super { parent: "parent".into(), child: "child".into() }).await?;
        report.figure("phase.prefill_s", prefill_started.elapsed().as_secs_f64())?;

        let variant = |name, target, clone| Variant { name, target, clone, next_object: 0, depth1: vec![], depth32: vec![] };
        let mut variants = vec![
            variant("rbd", Target::Rbd("plain".into()), false),
            variant("rbd_4m", Target::Rbd("plain4m".into()), false),
            variant("rbd_clone", Target::Rbd("child".into()), true),
            variant("plain", nbd("plain"), false),
            variant("super", nbd("child"), true),
        ];
        for (i, v) in bench::interleaved_order(plan.rounds, variants.len()).into_iter().enumerate() {
            if i % variants.len() == 0 {
                eprintln!("round {}/{}", i / variants.len() + 1, plan.rounds);
            }
            variants[v].measure(&plan, 1, &conf)?;
            variants[v].measure(&plan, 32, &conf)?;
        }

        let mut d1 = std::collections::BTreeMap::new();
        let mut d1_p50 = std::collections::BTreeMap::new();
        let mut d32 = std::collections::BTreeMap::new();
        for v in &variants {
            let r1 = combine(&v.depth1).context("no depth-1 runs")?;
            let r32 = combine(&v.depth32).context("no depth-32 runs")?;
            let p = format!("{}.write_4k.depth1.latency_us", v.name);
            report.figure(&format!("{p}_mean"), r1.lat_mean_us)?;
            report.figure(&format!("{p}_p50"), r1.lat_p50_us)?;
            report.figure(&format!("{p}_p99"), r1.lat_p99_us)?;
            report.figure(&format!("{}.write_4k.depth32.iops", v.name), iops(&r32))?;
            report.figure(&format!("{}.write_4k.depth32.latency_us_mean", v.name), r32.lat_mean_us)?;
            d1.insert(v.name, r1.lat_mean_us);
            d1_p50.insert(v.name, r1.lat_p50_us);
            d32.insert(v.name, iops(&r32));
        }
        report.ratio("understudy_vs_rbd.write_4k.depth1.latency", d1["plain"], d1["rbd"])?;
        report.ratio("understudy_vs_rbd.write_4k.depth32.iops", d32["plain"], d32["rbd"])?;
        report.ratio("super_vs_rbd_clone.write_4k.depth1.latency", d1["super"], d1["rbd_clone"])?;
        report.ratio("super_vs_rbd_clone.write_4k.depth32.iops", d32["super"], d32["rbd_clone"])?;
        report.ratio("understudy_vs_rbd_4m.write_4k.depth1.latency", d1["plain"], d1["rbd_4m"])?;
        report.ratio("understudy_vs_rbd_4m.write_4k.depth32.iops", d32["plain"], d32["rbd_4m"])?;
        // The means above take every stall of a loaded 2-core machine; the medians do not.
        report.ratio("understudy_vs_rbd.write_4k.depth1.latency_p50", d1_p50["plain"], d1_p50["rbd"])?;
        report.ratio("super_vs_rbd_clone.write_4k.depth1.latency_p50", d1_p50["super"], d1_p50["rbd_clone"])?;
        report.figure("understudy.replicas_count", info.replicas as f64)?;
        report.figure("ceph.replicas_count", size as f64)?;
        report.figure("ceph.min_size_count", min_size as f64)?;
        report.figure("ceph.osds_count", replicas as f64)?;
        report.figure("object_size_bytes", OBJECT_SIZE_BYTES as f64)?;
        // The largest daemon of each kind (as shard.rss_peak_bytes is the largest shard).
        for (prefix, name) in [("osd.", "ceph_osd"), ("mon.", "ceph_mon")] {
            if let Some(rss) = ceph.pids(prefix).into_iter().filter_map(testbed::proc::peak_rss_bytes).max() {
                report.figure(&format!("{name}.rss_peak_bytes"), rss as f64)?;
            }
        }
        drop(ceph);
        Ok(report)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fio_writes_are_parsed_and_combined() {
        let json = br#"fio: note
{"jobs": [{"write": {"total_ios": 100, "runtime": 2000, "iops": 50.0,
  "lat_ns": {"mean": 2000000.0, "percentile": {"50.000000": 1900000, "99.000000": 5000000}}}}]}"#;
        let r = crate::fio::first_job_writes(json).unwrap();
        assert_eq!(r, FioWrites { ios: 100, runtime_ms: 2000, lat_mean_us: 2000.0, lat_p50_us: 1900.0, lat_p99_us: 5000.0 });
        let s = FioWrites { ios: 300, runtime_ms: 1000, lat_mean_us: 1000.0, lat_p50_us: 900.0, lat_p99_us: 3000.0 };
        let c = combine(&[r, s]).unwrap();
        assert_eq!(c.ios, 400);
        assert_eq!(c.lat_mean_us, 1250.0);
        assert_eq!(iops(&c), 400.0 / 3.0);
        assert!(crate::fio::first_job_writes(br#"{"jobs": [{"write": {"total_ios": 0}}]}"#).is_err());
        assert!(crate::fio::first_job_writes(b"no json").is_err());
        assert!(combine(&[]).is_none());
    }
}
