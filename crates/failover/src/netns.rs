//! Network namespaces for instances (Linux, root): each instance's application runs in its own
//! network namespace, joined to the host by a veth pair with a /30 from [`SUBNET`], like a small
//! host of its own. A network cut-off is then the instance's link going down
//! (`ip link set … down`): the application keeps running and — its volume being served from the
//! host, where the attach helper stays — keeps writing its disk, exactly as a real host that lost
//! its network but not its storage (the case collapse must abort).
//!
//! Only the application joins the namespace (`setns(2)` between fork and exec), so it sees the
//! host's mount table, including the instance's FUSE + loop + ext4 mount made just before.
//!
//! Names carry [`PREFIX`], so namespaces a crashed run left behind are recognised:
//! [`sweep_stale`] deletes every such namespace no process lives in. Creation, address
//! allocation and the sweep hold one lock file ([`LOCK_FILE`]), so concurrent monitors on one
//! machine never pick the same addresses or sweep a namespace being set up.

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Every namespace and veth Understudy makes starts with this.
pub const PREFIX: &str = "usfo";
/// Instance links take /30s from 10.213.0.0/16: 16384 instances at once on one machine.
pub const SUBNET: [u8; 2] = [10, 213];
pub const MAX_LINKS: u32 = 1 << 14;
/// Serialises namespace set-up and sweeps across processes (flock).
pub const LOCK_FILE: &str = "/run/understudy-netns.lock";

/// Whether instances run in their own network namespaces (spec `[network] namespaces`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum NetnsMode {
    /// On when running as root and `ip netns` works; otherwise off, with a message saying why.
    #[default]
    Auto,
    /// Required: starting fails with a clear error where namespaces cannot be made.
    On,
    /// Off: instances share the host's network; a cut is done by the pool's proxy link.
    Off,
}

/// One instance's namespace and link.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct NetnsLink {
    /// Namespace name (`/run/netns/NAME`).
    pub name: String,
    /// The host end of the veth pair.
    pub host_if: String,
    /// The end inside the namespace (what a cut takes down).
    pub ns_if: String,
    pub host_addr: Ipv4Addr,
    /// The application listens here (`{host}`, `UNDERSTUDY_HOST`).
    pub ns_addr: Ipv4Addr,
}

#[derive(Debug, thiserror::Error)]
#[error("network namespace: {0}")]
pub struct NetnsError(pub String);

/// Deadline of one `ip` command.
pub const IP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long [`lock`] waits for another holder at most.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(60);

fn ip(args: &[&str]) -> Result<String, NetnsError> {
    crate::pool::teardown::run_bounded("ip", args, IP_TIMEOUT).map_err(NetnsError)
}

/// Held while namespaces are made or swept (an exclusive `flock` on [`LOCK_FILE`]).
pub struct Lock(#[allow(dead_code)] std::fs::File);

pub fn lock() -> Result<Lock, NetnsError> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(LOCK_FILE)
        .map_err(|e| NetnsError(format!("cannot open {LOCK_FILE}: {e}")))?;
    // Polled, not blocking: a holder that is stuck is reported, not waited on for ever.
    let deadline = Instant::now() + LOCK_TIMEOUT;
    loop {
        // SAFETY: flock(2) on a file descriptor we own; released when the file is closed.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(Lock(f));
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(NetnsError(format!("cannot lock {LOCK_FILE}: {e}")));
        }
        if Instant::now() >= deadline {
            return Err(NetnsError(format!("{LOCK_FILE} still held by another process after {LOCK_TIMEOUT:?}")));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Whether namespaces can be used here; the error says why not.
pub fn available() -> Result<(), NetnsError> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(NetnsError("not running as root".into()));
    }
    let probe = format!("{PREFIX}-probe-{}", std::process::id());
    // Under the lock: the probe namespace has no process in it, and a concurrent sweep (another
    // monitor starting) would take it for stale and delete it half-way through the probe.
    let _l = lock()?;
    ip(&["netns", "add", &probe])?;
    let r = ip(&["-n", &probe, "link", "set", "lo", "up"]);
    ip(&["netns", "delete", &probe])?;
    r.map(|_| ())
}

/// Resolves a mode: `Ok(true)` to use namespaces, `Ok(false)` with the reason printed for auto,
/// an error for `On` where they do not work.
pub fn resolve(mode: NetnsMode) -> Result<(bool, Option<String>), NetnsError> {
    match mode {
        NetnsMode::Off => Ok((false, None)),
        NetnsMode::On => available().map(|_| (true, None)).map_err(|e| NetnsError(format!("`network.namespaces = \"on\"` but {}", e.0))),
        NetnsMode::Auto => match available() {
            Ok(()) => Ok((true, None)),
            Err(e) => Ok((false, Some(format!("instances share the host's network (no namespaces: {}); a cut is simulated by the pool's proxy", e.0)))),
        },
    }
}

/// A short tag naming one pool (from its state directory), so namespaces of concurrent
/// monitors never clash and a test can find its own.
pub fn tag_for(state_dir: &std::path::Path) -> String {
    // FNV-1a, 32 bits: stable across runs and Rust versions.
    let mut h: u32 = 0x811c_9dc5;
    for b in state_dir.as_os_str().as_encoded_bytes() {
        h ^= *b as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    format!("{h:08x}")
}

/// The namespace name of instance `instance` of the pool tagged `tag`.
pub fn name_for(tag: &str, instance: &str) -> String {
    format!("{PREFIX}-{tag}-{instance}")
}

fn link_addrs(k: u32) -> (Ipv4Addr, Ipv4Addr) {
    let base = k * 4;
    let (hi, lo) = ((base >> 8) as u8, (base & 0xff) as u8);
    (Ipv4Addr::new(SUBNET[0], SUBNET[1], hi, lo + 1), Ipv4Addr::new(SUBNET[0], SUBNET[1], hi, lo + 2))
}

/// Makes namespace `name` with a veth pair and a free /30. Call with the [`lock`] held. A
/// namespace of that name left over (a crashed run) is replaced.
pub fn create(name: &str, _lock: &Lock) -> Result<NetnsLink, NetnsError> {
    if list()?.iter().any(|n| n == name) {
        delete(name)?;
    }
    let used = ip(&["-o", "-4", "addr", "show"])?;
    let k = (0..MAX_LINKS)
        .find(|k| {
            let (h, _) = link_addrs(*k);
            let host_if = format!("{PREFIX}{k}h");
            !used.contains(&format!(" {h}/")) && !used.contains(&format!(" {host_if} ")) && !used.contains(&format!(" {host_if}@"))
        })
        .ok_or_else(|| NetnsError(format!("all {MAX_LINKS} instance links in {}.{}.0.0/16 are in use", SUBNET[0], SUBNET[1])))?;
    let (host_addr, ns_addr) = link_addrs(k);
    let link = NetnsLink { name: name.into(), host_if: format!("{PREFIX}{k}h"), ns_if: format!("{PREFIX}{k}n"), host_addr, ns_addr };
    // A host veth of that name without an address (an interrupted set-up): remove it first.
    let _ = ip(&["link", "delete", &link.host_if]);
    fence_subnet()?;
    let r = (|| {
        ip(&["netns", "add", name])?;
        ip(&["link", "add", &link.host_if, "type", "veth", "peer", "name", &link.ns_if])?;
        ip(&["link", "set", &link.ns_if, "netns", name])?;
        ip(&["addr", "add", &format!("{host_addr}/30"), "dev", &link.host_if])?;
        ip(&["link", "set", &link.host_if, "up"])?;
        ip(&["-n", name, "addr", "add", &format!("{ns_addr}/30"), "dev", &link.ns_if])?;
        ip(&["-n", name, "link", "set", &link.ns_if, "up"])?;
        ip(&["-n", name, "link", "set", "lo", "up"])?;
        Ok(())
    })();
    if let Err(e) = r {
        let _ = ip(&["link", "delete", &link.host_if]);
        let _ = delete(name);
        return Err(e);
    }
    tracing::debug!(?link, "network namespace made");
    Ok(link)
}

/// Makes the whole of [`SUBNET`] unreachable on the host (an `unreachable` route, idempotent)
/// below the instances' own /30 routes: an address whose namespace is gone (a fenced or stopped
/// instance) is then refused at once, instead of its packets leaving through the host's default
/// route — to a private address that is no target of ours — and a connection hanging until it
/// times out.
pub fn fence_subnet() -> Result<(), NetnsError> {
    ip(&["route", "replace", "unreachable", &format!("{}.{}.0.0/16", SUBNET[0], SUBNET[1])]).map(|_| ())
}

/// Cuts (`up = false`) or restores the instance's link: the namespace's end of the veth goes
/// down, so nothing reaches the namespace and nothing leaves it. The host end stays up and keeps
/// its route: packets to the instance vanish (connections time out, as to a host that lost its
/// network) rather than being refused at once or leaking out of the host's default route.
pub fn set_link(link: &NetnsLink, up: bool) -> Result<(), NetnsError> {
    ip(&["-n", &link.name, "link", "set", &link.ns_if, if up { "up" } else { "down" }])?;
    if up {
        // The carrier comes back asynchronously; until then packets are still dropped. Wait
        // (bounded) so a healed link carries at once.
        let state = format!("/sys/class/net/{}/operstate", link.host_if);
        let deadline = std::time::Instant::now() + CARRIER_TIMEOUT;
        while std::fs::read_to_string(&state).is_ok_and(|s| s.trim() != "up") && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        // Address resolutions left pending by the cut would hold the first packets back for
        // up to a second: start them afresh, on both ends.
        let _ = ip(&["neigh", "flush", "dev", &link.host_if]);
        let _ = ip(&["-n", &link.name, "neigh", "flush", "dev", &link.ns_if]);
    }
    Ok(())
}

/// How long restoring a link waits for its carrier.
pub const CARRIER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// Deletes a namespace (its veth pair goes with it); a missing one is fine.
pub fn delete(name: &str) -> Result<(), NetnsError> {
    match ip(&["netns", "delete", name]) {
        Ok(_) => Ok(()),
        Err(_) if !list()?.iter().any(|n| n == name) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Names of every network namespace (ours or not).
pub fn list() -> Result<Vec<String>, NetnsError> {
    Ok(ip(&["netns", "list"])?.lines().filter_map(|l| l.split_whitespace().next()).map(str::to_string).collect())
}

/// Processes living in namespace `name`.
pub fn pids(name: &str) -> Vec<u32> {
    ip(&["netns", "pids", name]).map(|s| s.split_whitespace().filter_map(|p| p.parse().ok()).collect()).unwrap_or_default()
}

/// Deletes every namespace named with [`PREFIX`] (and `tag`, when given) that no process lives
/// in: those crashed runs left. Returns their names.
pub fn sweep_stale(tag: Option<&str>) -> Result<Vec<String>, NetnsError> {
    let _l = lock()?;
    let want = match tag {
        Some(t) => format!("{PREFIX}-{t}-"),
        None => format!("{PREFIX}-"),
    };
    let mut gone = vec![];
    for n in list()?.into_iter().filter(|n| n.starts_with(&want)) {
        if pids(&n).is_empty() {
            delete(&n)?;
            gone.push(n);
        }
    }
    Ok(gone)
}

/// Kills every process in the namespaces of pool `tag` and deletes them (tests' clean-up).
pub fn destroy_all(tag: &str) -> Vec<String> {
    let Ok(_l) = lock() else { return vec![] };
    let want = format!("{PREFIX}-{tag}-");
    let mut gone = vec![];
    for n in list().unwrap_or_default().into_iter().filter(|n| n.starts_with(&want)) {
        for p in pids(&n) {
            // SAFETY: kill(2) of a process in a namespace this pool made; no memory involved.
            unsafe { libc::kill(p as libc::pid_t, libc::SIGKILL) };
        }
        let _ = delete(&n);
        gone.push(n);
    }
    gone
}

/// An open handle of namespace `name`, for [`enter`] in a child before exec.
pub fn open(name: &str) -> Result<OwnedFd, NetnsError> {
    let path = format!("/run/netns/{name}");
    std::fs::File::open(&path).map(OwnedFd::from).map_err(|e| NetnsError(format!("cannot open {path}: {e}")))
}

/// Joins the network namespace `fd` (for `Command::pre_exec`; async-signal-safe: one syscall).
pub fn enter(fd: libc::c_int) -> std::io::Result<()> {
    // SAFETY: setns(2) on a namespace file descriptor we hold open; it changes only this
    // (forked, single-threaded) process's network namespace.
    if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_names_are_distinct_and_short() {
        let (h0, n0) = link_addrs(0);
        assert_eq!((h0, n0), (Ipv4Addr::new(10, 213, 0, 1), Ipv4Addr::new(10, 213, 0, 2)));
        let (h, n) = link_addrs(MAX_LINKS - 1);
        assert_eq!((h, n), (Ipv4Addr::new(10, 213, 255, 253), Ipv4Addr::new(10, 213, 255, 254)));
        // Interface names fit IFNAMSIZ (15 characters).
        assert!(format!("{PREFIX}{}h", MAX_LINKS - 1).len() <= 15);
        let a = tag_for(std::path::Path::new("/tmp/a/failover"));
        assert_ne!(a, tag_for(std::path::Path::new("/tmp/b/failover")));
        assert_eq!(name_for(&a, "i3"), format!("usfo-{a}-i3"));
    }

    #[test]
    fn off_needs_nothing() {
        assert_eq!(resolve(NetnsMode::Off).unwrap(), (false, None));
        // Auto never fails: it falls back with the reason, or uses namespaces.
        let (on, why) = resolve(NetnsMode::Auto).unwrap();
        assert!(on != why.is_some(), "{on} {why:?}");
    }

    /// `available` probes with a namespace nothing lives in; a sweep at the same time (another
    /// monitor starting) used to take it for stale and delete it half-way through the probe,
    /// and the probe then reported namespaces unusable. Root only.
    #[test]
    fn probes_survive_concurrent_sweeps() {
        if available().is_err() {
            eprintln!("skipped: network namespaces are not available here");
            return;
        }
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let sweeps = std::sync::Arc::new(AtomicUsize::new(0));
        let sweeper = {
            let (stop, sweeps) = (stop.clone(), sweeps.clone());
            // Sweeps only probe namespaces ("usfo-probe-…"), so other tests' are left alone.
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    sweep_stale(Some("probe")).expect("sweep");
                    sweeps.fetch_add(1, Ordering::SeqCst);
                }
            })
        };
        let r: Vec<_> = (0..15).map(|_| available()).collect();
        stop.store(true, Ordering::SeqCst);
        sweeper.join().unwrap();
        assert!(sweeps.load(Ordering::SeqCst) > 0);
        for e in r {
            e.expect("a probe raced a sweep");
        }
    }

    /// A real namespace: made, reachable across its link, cut, restored, swept. Root only.
    #[test]
    fn namespace_link_cut_and_sweep() {
        if available().is_err() {
            eprintln!("skipped: network namespaces are not available here");
            return;
        }
        let tag = format!("t{:07x}", std::process::id());
        let name = name_for(&tag, "i1");
        struct Gone(String);
        impl Drop for Gone {
            fn drop(&mut self) {
                let _ = delete(&self.0);
            }
        }
        let _gone = Gone(name.clone());
        let link = {
            let l = lock().unwrap();
            create(&name, &l).unwrap()
        };
        // From the host: a refused connection means the namespace answered across the link;
        // any other error (unreachable, timeout) that nothing got through.
        let reaches = || {
            let addr = std::net::SocketAddr::from((link.ns_addr, 9));
            match std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_millis(500)) {
                Err(e) => e.kind() == std::io::ErrorKind::ConnectionRefused,
                Ok(s) => panic!("nothing listens in the namespace, yet {addr} answered (from {:?})", s.local_addr()),
            }
        };
        assert!(reaches(), "the host reaches the namespace across its link");
        set_link(&link, false).unwrap();
        assert!(!reaches(), "a cut link carries nothing");
        set_link(&link, true).unwrap();
        assert!(reaches(), "a restored link carries again");
        // Nothing lives in it: a sweep deletes it, and its veth with it.
        assert_eq!(sweep_stale(Some(&tag)).unwrap(), vec![name.clone()]);
        assert!(!list().unwrap().contains(&name));
        // The kernel dismantles a deleted namespace's devices in the background.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while ip(&["link", "show", &link.host_if]).is_ok() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(ip(&["link", "show", &link.host_if]).is_err(), "the veth went with the namespace");
        // Its address is now unreachable on the host, not sent out of the default route.
        let addr = std::net::SocketAddr::from((link.ns_addr, 9));
        let e = std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(5)).expect_err("a deleted namespace answered");
        assert_ne!(e.kind(), std::io::ErrorKind::TimedOut, "packets to a deleted namespace went somewhere: {e}");
        assert_eq!(e.raw_os_error(), Some(libc::EHOSTUNREACH), "{e}");
    }
}
