//! A real single-node Ceph cluster from Debian's packages, without scripts and without touching
//! `/etc/ceph`: one `ceph-mon` and one `ceph-osd` per replica (each BlueStore on a sparse file of
//! its own; pool size = replicas, min_size as Ceph's default, replicas placed on distinct OSDs of
//! the one host) under a directory with its own conf file, generated cephx keyring and a free
//! loopback port; no `ceph-mgr` (pools, images, snapshots and clones do not need one). Every Ceph
//! process is killed by PID when [`CephCluster`] is dropped, also on error and after Ctrl-C (the
//! first SIGINT or SIGTERM ends the run at the next step, see [`catch_interrupts`]); the daemons
//! run in their own process group with SIGKILL as their parent-death signal, so they do not
//! outlive a killed benchmark.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, ensure, Context};
use base64::Engine as _;
use rand::RngCore;

/// Debian packages the Ceph side needs (`ceph-mgr` and `rbd-nbd` are not used).
pub const CEPH_PACKAGES: &str = "ceph-mon ceph-osd ceph-common";
/// BlueStore's block file (sparse; only what is written takes disk space).
const OSD_BLOCK_BYTES: u64 = 12 << 30;
/// ceph-osd's memory target (its minimum is 896 MiB).
const OSD_MEMORY_TARGET_BYTES: u64 = 1 << 30;
const CEPH_CMD_TIMEOUT_S: u64 = 120;
const OSD_UP_TIMEOUT: Duration = Duration::from_secs(180);
/// The pool the cluster makes for the benchmark's images.
pub const POOL: &str = "understudy-bench";

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
    wire::ports::free_loopback_port().context("cannot find a free loopback port")
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
pub fn catch_interrupts() {
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

pub fn check_interrupted() -> anyhow::Result<()> {
    ensure!(!INTERRUPTED.load(Ordering::SeqCst), "interrupted");
    Ok(())
}

/// `timeout --kill-after=5 TIMEOUT_S PROG`, told SIGTERM if the bench dies (it passes the
/// signal on to PROG: a client of a Ceph killed with the bench would otherwise hang until its
/// timeout).
pub fn timeout_cmd(prog: &str, timeout_s: u64) -> Command {
    let mut cmd = Command::new("timeout");
    cmd.args(["--kill-after=5", &timeout_s.to_string(), prog]);
    // (timeout puts itself in a process group of its own anyway.)
    crate::proc::own_group_dying_with_parent(&mut cmd, libc::SIGTERM);
    cmd
}

/// Runs `prog args` under coreutils' `timeout`; returns stdout, or the error with stderr.
pub fn run_tool(prog: &str, args: &[&str], timeout_s: u64) -> anyhow::Result<String> {
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

pub fn missing_packages() -> Vec<&'static str> {
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
        crate::proc::own_group_dying_with_parent(&mut cmd, libc::SIGKILL);
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
}
