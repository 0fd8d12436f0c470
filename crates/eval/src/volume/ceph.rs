//! `understudy bench volume ceph`: Understudy's volume beside a real single-node Ceph cluster.
//!
//! Brings up Ceph from Debian's packages without scripts and without touching `/etc/ceph`: one
//! `ceph-mon` and one `ceph-osd` per replica (each BlueStore on a sparse file of its own; pool
//! size = replicas, min_size as Ceph's default, replicas placed on distinct OSDs of the one
//! host) under a temporary directory with their own conf file, generated cephx keyring and a
//! free loopback port; no `ceph-mgr` (pools, images, snapshots and clones do not need one).
//! Understudy's cluster keeps the same number of replicas. Then fio — the same client on both
//! systems — measures 4 KiB random writes at depth 1 (latency) and depth 32 (IOPS) on an rbd
//! image, an rbd clone whose writes each hit an object not yet copied up, Understudy's plain
//! volume and its `super` child, variants interleaved round by round. Every Ceph process is
//! killed by PID when [`CephCluster`] is dropped, also on error and after Ctrl-C (the first
//! SIGINT or SIGTERM ends the run at the next step); the daemons run in their own process
//! group with SIGKILL as their parent-death signal, so they do not outlive a killed bench.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, ensure, Context};
use base64::Engine as _;
use rand::RngCore;

use super::CommonArgs;

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
/// Bound on one fio job (the longest, a full run's clone at depth 1 on a loaded machine, takes
/// well under a minute).
const FIO_TIMEOUT_S: u64 = 600;
const OSD_UP_TIMEOUT: Duration = Duration::from_secs(180);
const POOL: &str = "understudy-bench";

/// One cephx entity of the generated keyring.
pub struct KeyringEntry {
    pub entity: String,
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
/// admin client and the OSDs (`osd.0` .. `osd.{osds-1}`) need no further `ceph auth` calls.
pub fn keyring_entries(mut random: impl FnMut() -> [u8; 16], created_secs: u32, osds: u32) -> Vec<KeyringEntry> {
    let mut entry = |entity: String, caps| KeyringEntry { entity, key: cephx_key(random(), created_secs), caps };
    let mut entries = vec![
        entry("mon.".into(), &[("mon", "allow *")]),
        entry("client.admin".into(), &[("mon", "allow *"), ("osd", "allow *"), ("mgr", "allow *"), ("mds", "allow *")]),
    ];
    for id in 0..osds {
        entries.push(entry(format!("osd.{id}"), &[("mon", "allow profile osd"), ("mgr", "allow profile osd"), ("osd", "allow *")]));
    }
    entries
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

/// Ceph's default min_size for a pool of `size` replicas (`osd_pool_default_min_size` 0 means
/// this): writes go on while a majority of the copies is up.
pub fn ceph_min_size(size: u32) -> u32 {
    size - size / 2
}

/// The cluster's conf file: everything under `dir`, loopback only, pools of `replicas` copies on
/// distinct OSDs of the one host (CRUSH chooses leaves of type 0, OSDs, not hosts).
pub fn render_conf(fsid: &str, mon_port: u16, dir: &Path, replicas: u32) -> String {
    let d = dir.display();
    let min_size = ceph_min_size(replicas);
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
osd_pool_default_size = {replicas}
osd_pool_default_min_size = {min_size}
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
    /// (name, process): "mon.a", "osd.0", ...
    children: Vec<(String, Child)>,
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

/// Set by the first SIGINT or SIGTERM during the bench; checked after every external command.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
    let msg = b"\ninterrupted: stopping Ceph and the cluster after the current step (again to quit at once)\n";
    // SAFETY: write(2) is async-signal-safe; the buffer is a static byte string.
    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
}

/// From now on the first SIGINT or SIGTERM only sets [`INTERRUPTED`] (so the bench stops its
/// daemons and removes its directory); a second one has the default effect.
fn catch_interrupts() {
    // SAFETY: the handler only stores an atomic and calls write(2), both async-signal-safe.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t;
        sa.sa_flags = libc::SA_RESETHAND | libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        for sig in [libc::SIGINT, libc::SIGTERM] {
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

fn check_interrupted() -> anyhow::Result<()> {
    ensure!(!INTERRUPTED.load(Ordering::SeqCst), "interrupted");
    Ok(())
}

/// `timeout --kill-after=5 TIMEOUT_S PROG`, told SIGTERM if the bench dies (it passes the
/// signal on to PROG: a client of a Ceph killed with the bench would otherwise hang until its
/// timeout).
fn timeout_cmd(prog: &str, timeout_s: u64) -> Command {
    let mut cmd = Command::new("timeout");
    cmd.args(["--kill-after=5", &timeout_s.to_string(), prog]);
    // (timeout puts itself in a process group of its own anyway.)
    testbed::proc::own_group_dying_with_parent(&mut cmd, libc::SIGTERM);
    cmd
}

/// Runs `prog args` under coreutils' `timeout`; returns stdout, or the error with stderr.
fn run_tool(prog: &str, args: &[&str], timeout_s: u64) -> anyhow::Result<String> {
    let out = timeout_cmd(prog, timeout_s)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {prog}"))?;
    check_interrupted()?;
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
    /// Starts ceph-mon and `osds` ceph-osds under `dir` (created) and creates the benchmark
    /// pool with `osds` replicas.
    pub fn start(dir: &Path, osds: u32) -> anyhow::Result<CephCluster> {
        let mut missing = missing_packages();
        missing.dedup();
        if !missing.is_empty() {
            bail!(
                "Ceph is not installed (missing {}); install it with:\n  apt-get install -y --no-install-recommends {CEPH_PACKAGES}",
                missing.join(", ")
            );
        }
        ensure!(osds >= 1, "Ceph needs at least one OSD");
        for sub in ["run", "log", "crash"].into_iter().map(String::from).chain((0..osds).map(|id| format!("osd-{id}"))) {
            std::fs::create_dir_all(dir.join(&sub)).with_context(|| format!("cannot create {}", dir.join(&sub).display()))?;
        }
        let fsid = uuid_v4(random16());
        let port = free_port()?;
        let conf = dir.join("ceph.conf");
        std::fs::write(&conf, render_conf(&fsid, port, dir, osds))?;
        let created = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs() as u32;
        std::fs::write(dir.join("keyring"), render_keyring(&keyring_entries(random16, created, osds)))?;
        let mut c = CephCluster { dir: dir.to_path_buf(), conf, children: Vec::new() };
        let conf_s = c.conf.display().to_string();

        // Monitor: a monmap naming just mon.a on our port, mkfs importing the keyring, start.
        let monmap = dir.join("monmap").display().to_string();
        let addr = format!("[v2:127.0.0.1:{port}]");
        run_tool("monmaptool", &["--create", "--fsid", &fsid, "--addv", "a", &addr, &monmap], 60)?;
        let keyring = dir.join("keyring").display().to_string();
        run_tool("ceph-mon", &["-c", &conf_s, "--mkfs", "-i", "a", "--monmap", &monmap, "--keyring", &keyring], 60)?;
        c.spawn("mon.a", "ceph-mon", &["-c", &conf_s, "-f", "-i", "a"])?;
        c.ceph(&["mon", "stat"]).context("ceph-mon did not answer")?;

        // OSDs: register each UUID, mkfs them all at once (each creates its BlueStore block
        // file), start them, wait until all are up.
        let mut uuids = Vec::new();
        for expected in 0..osds {
            let uuid = uuid_v4(random16());
            let id = c.ceph(&["osd", "new", &uuid])?;
            ensure!(id.trim() == expected.to_string(), "`ceph osd new` gave id {:?}, expected {expected}", id.trim());
            uuids.push(uuid);
        }
        std::thread::scope(|s| {
            let mkfs: Vec<_> = uuids
                .iter()
                .enumerate()
                .map(|(id, uuid)| {
                    let (conf_s, id) = (&conf_s, id.to_string());
                    s.spawn(move || run_tool("ceph-osd", &["-c", conf_s, "-i", &id, "--mkfs", "--osd-uuid", uuid], 300))
                })
                .collect();
            mkfs.into_iter().try_for_each(|h| h.join().expect("ceph-osd --mkfs thread panicked").map(|_| ()))
        })?;
        for id in 0..osds {
            let id = id.to_string();
            c.spawn(&format!("osd.{id}"), "ceph-osd", &["-c", &conf_s, "-f", "-i", &id])?;
        }
        let deadline = Instant::now() + OSD_UP_TIMEOUT;
        loop {
            let stat: serde_json::Value = serde_json::from_str(&c.ceph(&["osd", "stat", "-f", "json"])?).context("`ceph osd stat` JSON")?;
            if stat["num_up_osds"].as_u64() == Some(osds as u64) {
                break;
            }
            c.check_alive()?;
            ensure!(Instant::now() < deadline, "the ceph-osds did not all come up within {OSD_UP_TIMEOUT:?}; see {}", dir.join("log").display());
            std::thread::sleep(Duration::from_millis(500));
        }
        c.ceph(&["osd", "pool", "create", POOL, "16", "16", "replicated"])?;
        c.ceph(&["osd", "pool", "application", "enable", POOL, "rbd"])?;
        Ok(c)
    }

    /// The benchmark pool's `size` or `min_size`, as the monitor has it.
    pub fn pool_value(&self, key: &str) -> anyhow::Result<u64> {
        let v: serde_json::Value = serde_json::from_str(&self.ceph(&["osd", "pool", "get", POOL, key, "-f", "json"])?).context("`ceph osd pool get` JSON")?;
        v[key].as_u64().with_context(|| format!("`ceph osd pool get {POOL} {key}` gave no number: {v}"))
    }

    /// Starts a daemon in its own process group (a terminal's Ctrl-C reaches only the bench,
    /// which stops it) that the kernel SIGKILLs if the bench dies first.
    fn spawn(&mut self, name: &str, prog: &str, args: &[&str]) -> anyhow::Result<()> {
        let log = std::fs::File::create(self.dir.join("log").join(format!("{name}.stderr")))?;
        let mut cmd = Command::new(prog);
        cmd.args(args).stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
        testbed::proc::own_group_dying_with_parent(&mut cmd, libc::SIGKILL);
        let child = cmd.spawn().with_context(|| format!("cannot start {prog}"))?;
        self.children.push((name.to_string(), child));
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

    /// PIDs of the daemons whose names start with `prefix` ("mon.", "osd.").
    pub fn pids(&self, prefix: &str) -> Vec<u32> {
        self.children.iter().filter(|(n, _)| n.starts_with(prefix)).map(|(_, c)| c.id()).collect()
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
    let out = timeout_cmd("fio", FIO_TIMEOUT_S)
        .args(["--name=bench", "--bs=4k", "--output-format=json", "--lat_percentiles=1", "--randrepeat=0", "--verify_state_save=0"])
        .args(args)
        .env("CEPH_CONF", ceph_conf)
        .stdin(Stdio::null())
        .output()
        .context("cannot run fio (install it: apt-get install fio)")?;
    check_interrupted()?;
    ensure!(out.status.success(), "fio {} failed ({}): {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr).trim());
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

pub fn run(a: CephArgs, verbose: u8) -> anyhow::Result<()> {
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
            3,
        );
        let keys: std::collections::HashSet<_> = entries.iter().map(|e| e.key.clone()).collect();
        assert_eq!(keys.len(), 5, "every entity gets its own secret");
        let ring = render_keyring(&entries);
        for section in ["[mon.]", "[client.admin]", "[osd.0]", "[osd.1]", "[osd.2]", "caps mon = \"allow profile osd\""] {
            assert!(ring.contains(section), "{section} missing from\n{ring}");
        }
        assert!(!ring.contains("[osd.3]"));
        let conf = render_conf("f", 4242, Path::new("/tmp/x"), 3);
        assert!(conf.contains("mon_host = [v2:127.0.0.1:4242]"));
        // Every OSD gets its own data directory and block file.
        assert!(conf.contains("osd_data = /tmp/x/osd-$id\n"));
        assert!(conf.contains("bluestore_block_path = /tmp/x/osd-$id-block.img"));
        // Ceph's defaults for a replicated pool; copies on distinct OSDs of the one host.
        assert!(conf.contains("osd_pool_default_size = 3\n"));
        assert!(conf.contains("osd_pool_default_min_size = 2\n"));
        assert!(conf.contains("osd_crush_chooseleaf_type = 0\n"));
        assert!(!conf.contains("/etc/ceph"));
        let one = render_conf("f", 4242, Path::new("/tmp/x"), 1);
        assert!(one.contains("osd_pool_default_size = 1\n") && one.contains("osd_pool_default_min_size = 1\n"));
        assert!(one.contains("mon_allow_pool_size_one = true"));
    }

    #[test]
    fn min_size_is_cephs_default() {
        assert_eq!([1, 2, 3, 4, 5].map(ceph_min_size), [1, 1, 2, 2, 3]);
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
