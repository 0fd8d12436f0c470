//! `understudy bench volume ceph`: Understudy's volume beside a real single-node Ceph cluster.
//!
//! Brings up Ceph from Debian's packages without scripts and without touching `/etc/ceph`: one
//! `ceph-mon` and one `ceph-osd` (BlueStore on a sparse file) under a temporary directory with
//! their own conf file, generated cephx keyring and a free loopback port; no `ceph-mgr` (pools,
//! images, snapshots and clones do not need one). Then fio — the same client on both systems —
//! measures 4 KiB random writes at depth 1 (latency) and depth 32 (IOPS) on an rbd image, an rbd
//! clone whose writes each hit an object not yet copied up, Understudy's plain volume and its
//! `super` child, variants interleaved round by round. Every Ceph process is killed by PID when
//! [`CephCluster`] is dropped, also on error.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, ensure, Context};
use base64::Engine as _;
use rand::RngCore;

use crate::bench_cmds::CommonArgs;

/// Debian packages the Ceph side needs (`ceph-mgr` and `rbd-nbd` are not used).
pub const CEPH_PACKAGES: &str = "ceph-mon ceph-osd ceph-common";
/// Both systems use this object size, so a copy-up copies the same amount of data.
const OBJECT_SIZE_BYTES: u64 = 64 << 10;
const WRITE_BYTES: u64 = 4 << 10;
/// The region random writes on plain images go to (pre-written, so no write allocates).
const PLAIN_REGION_BYTES: u64 = 256 << 20;
/// BlueStore's block file (sparse; only what is written takes disk space).
const OSD_BLOCK_BYTES: u64 = 12 << 30;
/// ceph-osd's memory target (its minimum is 896 MiB).
const OSD_MEMORY_TARGET_BYTES: u64 = 1 << 30;
const CEPH_CMD_TIMEOUT_S: u64 = 120;
const OSD_UP_TIMEOUT: Duration = Duration::from_secs(180);
const POOL: &str = "understudy-bench";

/// One cephx entity of the generated keyring.
pub struct KeyringEntry {
    pub entity: &'static str,
    pub key: String,
    pub caps: &'static [(&'static str, &'static str)],
}

/// A cephx secret as Ceph prints it: base64 of the encoded `CryptoKey` — type (1, AES) as u16,
/// creation time as u32 seconds and u32 nanoseconds, the secret's length as u16, the secret; all
/// little-endian (what `ceph-authtool --gen-key` writes).
pub fn cephx_key(secret: [u8; 16], created_secs: u32) -> String {
    let mut b = Vec::with_capacity(28);
    b.extend_from_slice(&1u16.to_le_bytes());
    b.extend_from_slice(&created_secs.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&16u16.to_le_bytes());
    b.extend_from_slice(&secret);
    base64::engine::general_purpose::STANDARD.encode(b)
}

/// The keyring for the mon's mkfs; the mon imports every entity in it with its caps, so the
/// admin client and osd.0 need no further `ceph auth` calls.
pub fn keyring_entries(mut random: impl FnMut() -> [u8; 16], created_secs: u32) -> Vec<KeyringEntry> {
    let mut entry = |entity, caps| KeyringEntry { entity, key: cephx_key(random(), created_secs), caps };
    vec![
        entry("mon.", &[("mon", "allow *")]),
        entry("client.admin", &[("mon", "allow *"), ("osd", "allow *"), ("mgr", "allow *"), ("mds", "allow *")]),
        entry("osd.0", &[("mon", "allow profile osd"), ("mgr", "allow profile osd"), ("osd", "allow *")]),
    ]
}

pub fn render_keyring(entries: &[KeyringEntry]) -> String {
    let mut s = String::new();
    for e in entries {
        s += &format!("[{}]\n\tkey = {}\n", e.entity, e.key);
        for (service, cap) in e.caps {
            s += &format!("\tcaps {service} = \"{cap}\"\n");
        }
    }
    s
}

/// A version-4 UUID in its usual text form.
pub fn uuid_v4(mut b: [u8; 16]) -> String {
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

/// The cluster's conf file: everything under `dir`, loopback only, one replica.
pub fn render_conf(fsid: &str, mon_port: u16, dir: &Path) -> String {
    let d = dir.display();
    format!(
        "[global]
fsid = {fsid}
mon_host = [v2:127.0.0.1:{mon_port}]
mon_initial_members = a
ms_bind_ipv4 = true
ms_bind_ipv6 = false
ms_bind_msgr1 = false
auth_cluster_required = cephx
auth_service_required = cephx
auth_client_required = cephx
keyring = {d}/keyring
run_dir = {d}/run
log_file = {d}/log/$name.log
crash_dir = {d}/crash
mon_data = {d}/mon-$id
osd_data = {d}/osd-$id
osd_objectstore = bluestore
bluestore_block_path = {d}/osd-$id-block.img
bluestore_block_create = true
bluestore_block_size = {OSD_BLOCK_BYTES}
bluestore_block_db_create = false
bluestore_block_wal_create = false
osd_memory_target = {OSD_MEMORY_TARGET_BYTES}
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 16
osd_pool_default_pgp_num = 16
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
mon_allow_pool_size_one = true
mon_allow_pool_delete = true
mon_warn_on_pool_no_redundancy = false

[mon]
admin_socket = {d}/run/$name.asok

[osd]
admin_socket = {d}/run/$name.asok
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1

[client]
admin_socket =
# No client-side cache: like Understudy, a write is acknowledged once the store has it.
rbd_cache = false
"
    )
}

/// A single-node Ceph cluster in a directory; its processes are killed by PID on drop.
pub struct CephCluster {
    pub dir: PathBuf,
    pub conf: PathBuf,
    children: Vec<(&'static str, Child)>,
}

impl Drop for CephCluster {
    fn drop(&mut self) {
        for (name, child) in self.children.iter_mut().rev() {
            // SIGKILL: the data is thrown away anyway.
            if let Err(e) = child.kill() {
                tracing::warn!("cannot kill {name} (pid {}): {e}", child.id());
            }
            let _ = child.wait();
        }
    }
}

fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("cannot bind a free loopback port")?;
    Ok(l.local_addr()?.port())
}

fn random16() -> [u8; 16] {
    let mut b = [0u8; 16];
    rand::thread_rng().fill_bytes(&mut b);
    b
}

/// Runs `prog args` under coreutils' `timeout`; returns stdout, or the error with stderr.
fn run_tool(prog: &str, args: &[&str], timeout_s: u64) -> anyhow::Result<String> {
    let out = Command::new("timeout")
        .args(["--kill-after=5", &timeout_s.to_string(), prog])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {prog}"))?;
    if !out.status.success() {
        bail!(
            "`{prog} {}` failed ({}{}): {}",
            args.join(" "),
            out.status,
            if out.status.code() == Some(124) { ", timed out" } else { "" },
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn missing_packages() -> Vec<&'static str> {
    let have = |bin: &str| std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()).any(|p| p.join(bin).is_file());
    [("ceph-mon", "ceph-mon"), ("ceph-osd", "ceph-osd"), ("ceph", "ceph-common"), ("rbd", "ceph-common"), ("monmaptool", "ceph-common")]
        .into_iter()
        .filter(|(bin, _)| !have(bin))
        .map(|(_, pkg)| pkg)
        .collect()
}

impl CephCluster {
    /// Starts ceph-mon and ceph-osd under `dir` (created) and creates the benchmark pool.
    pub fn start(dir: &Path) -> anyhow::Result<CephCluster> {
        let mut missing = missing_packages();
        missing.dedup();
        if !missing.is_empty() {
            bail!(
                "Ceph is not installed (missing {}); install it with:\n  apt-get install -y --no-install-recommends {CEPH_PACKAGES}",
                missing.join(", ")
            );
        }
        for sub in ["run", "log", "crash", "osd-0"] {
            std::fs::create_dir_all(dir.join(sub)).with_context(|| format!("cannot create {}", dir.join(sub).display()))?;
        }
        let fsid = uuid_v4(random16());
        let port = free_port()?;
        let conf = dir.join("ceph.conf");
        std::fs::write(&conf, render_conf(&fsid, port, dir))?;
        let created = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs() as u32;
        std::fs::write(dir.join("keyring"), render_keyring(&keyring_entries(random16, created)))?;
        let mut c = CephCluster { dir: dir.to_path_buf(), conf, children: Vec::new() };
        let conf_s = c.conf.display().to_string();

        // Monitor: a monmap naming just mon.a on our port, mkfs importing the keyring, start.
        let monmap = dir.join("monmap").display().to_string();
        let addr = format!("[v2:127.0.0.1:{port}]");
        run_tool("monmaptool", &["--create", "--fsid", &fsid, "--addv", "a", &addr, &monmap], 60)?;
        let keyring = dir.join("keyring").display().to_string();
        run_tool("ceph-mon", &["-c", &conf_s, "--mkfs", "-i", "a", "--monmap", &monmap, "--keyring", &keyring], 60)?;
        c.spawn("ceph-mon", &["-c", &conf_s, "-f", "-i", "a"])?;
        c.ceph(&["mon", "stat"]).context("ceph-mon did not answer")?;

        // OSD 0: register its UUID, mkfs (creates the BlueStore block file), start, wait for up.
        let osd_uuid = uuid_v4(random16());
        let id = c.ceph(&["osd", "new", &osd_uuid])?;
        ensure!(id.trim() == "0", "`ceph osd new` gave id {:?}, expected 0", id.trim());
        run_tool("ceph-osd", &["-c", &conf_s, "-i", "0", "--mkfs", "--osd-uuid", &osd_uuid], 300)?;
        c.spawn("ceph-osd", &["-c", &conf_s, "-f", "-i", "0"])?;
        let deadline = Instant::now() + OSD_UP_TIMEOUT;
        loop {
            let stat: serde_json::Value = serde_json::from_str(&c.ceph(&["osd", "stat", "-f", "json"])?).context("`ceph osd stat` JSON")?;
            if stat["num_up_osds"].as_u64() == Some(1) {
                break;
            }
            c.check_alive()?;
            ensure!(Instant::now() < deadline, "ceph-osd did not come up within {OSD_UP_TIMEOUT:?}; see {}", dir.join("log").display());
            std::thread::sleep(Duration::from_millis(500));
        }
        c.ceph(&["osd", "pool", "create", POOL, "16", "16", "replicated"])?;
        c.ceph(&["osd", "pool", "application", "enable", POOL, "rbd"])?;
        Ok(c)
    }

    fn spawn(&mut self, prog: &'static str, args: &[&str]) -> anyhow::Result<()> {
        let log = std::fs::File::create(self.dir.join("log").join(format!("{prog}.stderr")))?;
        let child = Command::new(prog)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot start {prog}"))?;
        self.children.push((prog, child));
        Ok(())
    }

    fn check_alive(&mut self) -> anyhow::Result<()> {
        for (name, child) in &mut self.children {
            if let Some(status) = child.try_wait()? {
                bail!("{name} exited ({status}); see {}", self.dir.join("log").display());
            }
        }
        Ok(())
    }

    /// Runs the `ceph` CLI against this cluster.
    pub fn ceph(&self, args: &[&str]) -> anyhow::Result<String> {
        let conf = self.conf.display().to_string();
        let mut all = vec!["-c", &conf, "--connect-timeout", "60"];
        all.extend_from_slice(args);
        run_tool("ceph", &all, CEPH_CMD_TIMEOUT_S)
    }

    /// Runs the `rbd` CLI against this cluster's pool.
    pub fn rbd(&self, args: &[&str]) -> anyhow::Result<String> {
        let conf = self.conf.display().to_string();
        let mut all = vec!["-c", &conf, "-p", POOL];
        all.extend_from_slice(args);
        run_tool("rbd", &all, CEPH_CMD_TIMEOUT_S)
    }

    pub fn pid(&self, prog: &str) -> Option<u32> {
        self.children.iter().find(|(n, _)| *n == prog).map(|(_, c)| c.id())
    }
}

/// What one fio job measured for its writes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FioWrites {
    pub ios: u64,
    pub runtime_ms: u64,
    pub lat_mean_us: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
}

/// Parses fio's `--output-format=json --lat_percentiles=1` output (notes before the JSON are
/// skipped): the first job's write count, run time and total (submission to completion) latency.
pub fn parse_fio_writes(stdout: &[u8]) -> anyhow::Result<FioWrites> {
    let text = String::from_utf8_lossy(stdout);
    let start = text.find('{').context("fio printed no JSON")?;
    let v: serde_json::Value = serde_json::from_str(&text[start..]).context("fio's JSON output")?;
    let w = &v["jobs"][0]["write"];
    let ios = w["total_ios"].as_u64().context("fio's JSON has no write.total_ios")?;
    ensure!(ios > 0, "fio measured no writes");
    let lat = &w["lat_ns"];
    let pct = |p: &str| lat["percentile"][p].as_f64().map(|ns| ns / 1e3).with_context(|| format!("fio's JSON has no write.lat_ns percentile {p}"));
    Ok(FioWrites {
        ios,
        runtime_ms: w["runtime"].as_u64().context("fio's JSON has no write.runtime")?.max(1),
        lat_mean_us: lat["mean"].as_f64().context("fio's JSON has no write.lat_ns.mean")? / 1e3,
        lat_p50_us: pct("50.000000")?,
        lat_p99_us: pct("99.000000")?,
    })
}

/// Runs one fio job (4 KiB writes) with `args`; `ceph_conf` is set as `CEPH_CONF` for the rbd engine.
fn fio(args: &[String], ceph_conf: &Path) -> anyhow::Result<FioWrites> {
    let out = Command::new("fio")
        .args(["--name=bench", "--bs=4k", "--output-format=json", "--lat_percentiles=1", "--randrepeat=0", "--verify_state_save=0"])
        .args(args)
        .env("CEPH_CONF", ceph_conf)
        .stdin(Stdio::null())
        .output()
        .context("cannot run fio (install it: apt-get install fio)")?;
    ensure!(out.status.success(), "fio {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    parse_fio_writes(&out.stdout)
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

fn peak_rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

pub fn run(a: CommonArgs, verbose: u8) -> anyhow::Result<()> {
    // Fail before starting anything when Ceph is missing.
    let missing = missing_packages();
    if !missing.is_empty() {
        bail!("this benchmark needs Ceph (missing {}); install it with:\n  apt-get install -y --no-install-recommends {CEPH_PACKAGES}", missing.join(", "));
    }
    let quick = a.quick;
    crate::bench_cmds::on_cluster(&a, "volume.ceph", verbose, |cluster, info, _out, dir, mut report| async move {
        let plan = Plan::new(quick);
        let region = plan.clone_region_bytes();
        eprintln!("starting ceph-mon and ceph-osd in {}", dir.join("ceph").display());
        let ceph = CephCluster::start(&dir.join("ceph"))?;
        let conf = ceph.conf.clone();
        let obj = format!("{}K", OBJECT_SIZE_BYTES >> 10);
        let plain_mib = (PLAIN_REGION_BYTES >> 20).to_string();
        let region_mib = (region >> 20).to_string();
        ceph.rbd(&["create", "--size", &plain_mib, "--object-size", &obj, "plain"])?;
        ceph.rbd(&["create", "--size", &plain_mib, "--object-size", "4M", "plain4m"])?;
        ceph.rbd(&["create", "--size", &region_mib, "--object-size", &obj, "parent"])?;
        // Understudy: the same three volumes (it needs no 4 MiB-object twin).
        let create = |name: &str, size_bytes: u64| volume::meta::MetaReq::Create { name: name.into(), size_bytes, object_size_bytes: OBJECT_SIZE_BYTES as u32 };
        cluster.meta(create("plain", PLAIN_REGION_BYTES)).await?;
        cluster.meta(create("parent", region)).await?;
        let nbd = |name: &str| Target::Nbd(format!("nbd://{}/{name}", info.nbd.addr));
        eprintln!("pre-writing images ({} MiB plain, {} MiB parent on each system)", plain_mib, region_mib);
        for t in [Target::Rbd("plain".into()), Target::Rbd("plain4m".into()), Target::Rbd("parent".into()), nbd("plain"), nbd("parent")] {
            let bytes = if matches!(&t, Target::Rbd(n) | Target::Nbd(n) if n.ends_with("parent")) { region } else { PLAIN_REGION_BYTES };
            prefill(&t, bytes, &conf)?;
        }
        ceph.rbd(&["snap", "create", "parent@base"])?;
        ceph.rbd(&["snap", "protect", "parent@base"])?;
        ceph.rbd(&["clone", &format!("{POOL}/parent@base"), &format!("{POOL}/child")])?;
        cluster.meta(volume::meta::MetaReq::Super { parent: "parent".into(), child: "child".into() }).await?;

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
            d32.insert(v.name, iops(&r32));
        }
        report.ratio("understudy_vs_rbd.write_4k.depth1.latency", d1["plain"], d1["rbd"])?;
        report.ratio("understudy_vs_rbd.write_4k.depth32.iops", d32["plain"], d32["rbd"])?;
        report.ratio("super_vs_rbd_clone.write_4k.depth1.latency", d1["super"], d1["rbd_clone"])?;
        report.ratio("super_vs_rbd_clone.write_4k.depth32.iops", d32["super"], d32["rbd_clone"])?;
        report.ratio("understudy_vs_rbd_4m.write_4k.depth1.latency", d1["plain"], d1["rbd_4m"])?;
        report.ratio("understudy_vs_rbd_4m.write_4k.depth32.iops", d32["plain"], d32["rbd_4m"])?;
        report.figure("understudy.replicas_count", info.replicas as f64)?;
        report.figure("ceph.replicas_count", 1.0)?;
        report.figure("object_size_bytes", OBJECT_SIZE_BYTES as f64)?;
        for prog in ["ceph-osd", "ceph-mon"] {
            if let Some(rss) = ceph.pid(prog).and_then(peak_rss_bytes) {
                report.figure(&format!("{}.rss_peak_bytes", prog.replace('-', "_")), rss as f64)?;
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
    fn cephx_key_has_cephs_layout() {
        let k = cephx_key([7u8; 16], 0x01020304);
        // 28 bytes encode to 40 base64 characters; type 1 makes every Ceph key start with "AQ".
        assert_eq!(k.len(), 40);
        assert!(k.starts_with("AQ"));
        let raw = base64::engine::general_purpose::STANDARD.decode(&k).unwrap();
        assert_eq!(&raw[..2], &[1, 0]);
        assert_eq!(&raw[2..6], &[4, 3, 2, 1]);
        assert_eq!(&raw[10..12], &[16, 0]);
        assert_eq!(&raw[12..], &[7u8; 16]);
    }

    #[test]
    fn keyring_and_conf_name_what_the_daemons_need() {
        let mut n = 0u8;
        let entries = keyring_entries(
            || {
                n += 1;
                [n; 16]
            },
            1,
        );
        let keys: std::collections::HashSet<_> = entries.iter().map(|e| e.key.clone()).collect();
        assert_eq!(keys.len(), 3, "every entity gets its own secret");
        let ring = render_keyring(&entries);
        for section in ["[mon.]", "[client.admin]", "[osd.0]", "caps mon = \"allow profile osd\""] {
            assert!(ring.contains(section), "{section} missing from\n{ring}");
        }
        let conf = render_conf("f", 4242, Path::new("/tmp/x"));
        assert!(conf.contains("mon_host = [v2:127.0.0.1:4242]"));
        assert!(conf.contains("bluestore_block_path = /tmp/x/osd-$id-block.img"));
        assert!(conf.contains("osd_pool_default_size = 1"));
        assert!(!conf.contains("/etc/ceph"));
    }

    #[test]
    fn uuid_is_version_4() {
        let u = uuid_v4([0xff; 16]);
        assert_eq!(u, "ffffffff-ffff-4fff-bfff-ffffffffffff");
    }

    #[test]
    fn fio_writes_are_parsed_and_combined() {
        let json = br#"fio: note
{"jobs": [{"write": {"total_ios": 100, "runtime": 2000, "iops": 50.0,
  "lat_ns": {"mean": 2000000.0, "percentile": {"50.000000": 1900000, "99.000000": 5000000}}}}]}"#;
        let r = parse_fio_writes(json).unwrap();
        assert_eq!(r, FioWrites { ios: 100, runtime_ms: 2000, lat_mean_us: 2000.0, lat_p50_us: 1900.0, lat_p99_us: 5000.0 });
        let s = FioWrites { ios: 300, runtime_ms: 1000, lat_mean_us: 1000.0, lat_p50_us: 900.0, lat_p99_us: 3000.0 };
        let c = combine(&[r, s]).unwrap();
        assert_eq!(c.ios, 400);
        assert_eq!(c.lat_mean_us, 1250.0);
        assert_eq!(iops(&c), 400.0 / 3.0);
        assert!(parse_fio_writes(br#"{"jobs": [{"write": {"total_ios": 0}}]}"#).is_err());
        assert!(parse_fio_writes(b"no json").is_err());
        assert!(combine(&[]).is_none());
    }
}
