//! Machines on one box: a test bed of "hosts", each a Linux network namespace with its own
//! address, its own processes and its own network link, so a test can lose a whole machine or
//! cut it off (issue 24 item 5: etcd members, metadata services, shards... one per host).
//!
//! **What a host is.** A network namespace (`/run/netns/ushb-PID-START-SEQ-hI`) with loopback up
//! and one interface, `eth0`, holding `10.214.Y.(I+1)/24`. Its `eth0` is one end of a veth pair;
//! the other end is a port of a bridge (`br0`) that lives in a namespace of its own, the bed's
//! *switch* (`…-swY`). Nothing is added to the root namespace: no address, no route, no
//! interface, so a bed never disturbs the machine or another bed (two beds are two separate
//! switches, and also get different /24s, `Y` chosen free under a lock, so logs never mix them).
//! A process runs on a host when it was started by [`Host::command`]: the child joins the
//! namespace with `setns(2)` between fork and exec (see there why not `ip netns exec`). The test
//! process itself can open sockets on a host with [`Host::run_in`].
//!
//! **Loss and partition.** [`Hosts::kill_host`] first takes the host's switch port down (so the
//! FINs and RSTs the kernel sends for the sockets of killed processes never reach anyone: a dead
//! machine says nothing), then SIGKILLs every process whose `/proc/PID/ns/net` is the host's
//! namespace, until none is left. [`Hosts::partition`] takes the port down and leaves the
//! processes running; [`Hosts::heal`] brings it up. Either way the peers' packets vanish (their
//! connections time out, ARP fails), and the cut host sees its carrier gone. [`Hosts::restart_host`]
//! is a reboot: the namespace is made afresh (same name, address and MAC; no socket, no process,
//! no neighbour table), plugged in again.
//!
//! **What is realistic and what is not.** Real: separate addresses, routing and sockets per host;
//! packets between hosts cross a real bridge; a lost host's connections die silently and its
//! processes are really gone; a partition is two-sided (timeouts on both sides, not refusals).
//! Not real: every host shares the kernel, the clock (no clock skew, no pause of a whole host —
//! SIGSTOP its processes for that), the CPU and the file system (a "lost" host's data directory
//! is still there, which is how a restarted host finds its disk; a test that wants a lost disk
//! deletes it). The link has no delay or loss: this kernel has no `tc netem`; add delay in user
//! space. A partition cuts a host from all others at once; a cut between two given hosts would
//! need bridge filter rules (`nft` bridge family works here once Debian's `nftables` is
//! installed; not used, so the bed needs only `ip`).
//!
//! **Leftovers.** Names carry the creating process's pid and start time. [`Hosts::create`] first
//! sweeps ([`sweep_stale`]) every bed whose process is gone (a test run that was SIGKILLed):
//! kills what still runs in its hosts, deletes its namespaces. Drop removes everything the bed
//! made, on panic too. The namespace lock is failover's ([`failover::netns::lock`]): one lock for
//! every namespace Understudy makes on a machine.

use std::net::Ipv4Addr;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// Every namespace of a bed starts with this ("Understudy host bed"); failover's are `usfo-`.
pub const PREFIX: &str = "ushb";
/// Beds take /24s from 10.214.0.0/16 (failover's instance links use 10.213.0.0/16).
pub const SUBNET: [u8; 2] = [10, 214];
/// At most this many beds at once on one machine (one /24 each).
pub const MAX_BEDS: u32 = 256;
/// At most this many hosts in one bed: host I has address .(I+1) of the bed's /24.
pub const MAX_HOSTS_PER_BED: usize = 250;
const _: () = assert!(MAX_HOSTS_PER_BED + 1 < 255, "host addresses stay below the broadcast address");
/// How long killing a host's processes may take before it is reported as an error.
pub const KILL_TIMEOUT: Duration = Duration::from_secs(10);
/// Deadline of one `ip` command.
pub const IP_TIMEOUT: Duration = failover::netns::IP_TIMEOUT;
/// How long [`Hosts::heal`] waits for a port's carrier to come back.
pub const CARRIER_TIMEOUT: Duration = Duration::from_secs(3);

/// Beds made by this process so far: names stay unique among parallel tests of one process.
static BED_SEQ: AtomicU32 = AtomicU32::new(0);

fn ip(args: &[&str]) -> anyhow::Result<String> {
    failover::pool::teardown::run_bounded("ip", args, IP_TIMEOUT).map_err(anyhow::Error::msg)
}

/// Whether beds can be made here (root and working `ip netns`); the error says why not.
pub fn available() -> anyhow::Result<()> {
    failover::netns::available().map_err(anyhow::Error::from)
}

/// What a host is doing now, as the bed made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostState {
    Up,
    /// Link cut, processes running.
    Partitioned,
    /// Link cut, every process killed (until [`Hosts::restart_host`]).
    Down,
}

/// One host of a bed. Borrowed from [`Hosts::host`]; its namespace name and address stay the
/// same across a restart.
pub struct Host {
    index: usize,
    ns: String,
    /// The switch's end of the host's veth pair (a name inside the switch namespace only).
    port: String,
    addr: Ipv4Addr,
    /// Children started by [`Host::spawn`]: reaped when the host is killed or the bed dropped.
    children: Mutex<Vec<Child>>,
    state: Mutex<HostState>,
}

impl Host {
    pub fn index(&self) -> usize {
        self.index
    }

    /// The host's address (on `eth0`, in the bed's /24).
    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    /// The network namespace's name (`ip -n NAME …`, `ip netns exec NAME …`).
    pub fn namespace(&self) -> &str {
        &self.ns
    }

    fn ns_path(&self) -> String {
        format!("/run/netns/{}", self.ns)
    }

    /// A command that runs `program` on this host. The child joins the namespace with
    /// `setns(2)` in `pre_exec`, by name at spawn time (so a command made before a restart
    /// lands in the new namespace). Not `ip netns exec`: that also unshares the mount namespace
    /// and remounts `/sys`, so mounts made later (FUSE, loop) would not be shared with the
    /// program, and it costs one more exec. The PID the caller sees is the program's own.
    ///
    /// The command is otherwise plain: add a process group or a parent-death signal
    /// ([`crate::proc::own_group_dying_with_parent`]) as wanted. Whoever spawns it, its
    /// processes are found by their namespace when the host is killed; spawn through
    /// [`Host::spawn`] to have the child reaped too.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        command_in(&self.ns, program.as_ref())
    }

    /// An owned handle on this host for [`crate::etcd::EtcdCluster::start_with`] (and anything
    /// else that outlives the borrow of the bed): it starts programs and opens sockets here.
    pub fn place(&self) -> HostPlace {
        HostPlace { ns: self.ns.clone() }
    }

    /// Spawns `cmd` (made by [`Host::command`]) and keeps the child, so it is reaped when the
    /// host is killed or the bed dropped. Returns its PID.
    pub fn spawn(&self, cmd: &mut Command) -> anyhow::Result<u32> {
        let child = cmd.spawn().with_context(|| format!("cannot start {:?} on host {} ({})", cmd.get_program(), self.index, self.addr))?;
        let pid = child.id();
        self.children.lock().unwrap().push(child);
        Ok(pid)
    }

    /// Runs `f` on a thread that lives in this host's namespace: sockets it opens belong to the
    /// host (and stay usable from any thread afterwards). The test process itself is not a
    /// process of the host: [`Hosts::kill_host`] does not close such sockets, the cut link
    /// silences them.
    pub fn run_in<T: Send>(&self, f: impl FnOnce() -> T + Send) -> anyhow::Result<T> {
        run_in_ns(&self.ns, f)
    }

    /// Live processes of this host (whose `/proc/PID/ns/net` is its namespace).
    pub fn pids(&self) -> Vec<u32> {
        pids_in(&self.ns_path())
    }

    pub fn state(&self) -> HostState {
        *self.state.lock().unwrap()
    }

    /// SIGKILLs every process of the host and reaps the tracked children, until none is left.
    fn kill_all(&self) -> anyhow::Result<Vec<u32>> {
        let killed = kill_in(&self.ns_path(), KILL_TIMEOUT)?;
        for mut c in self.children.lock().unwrap().drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
        Ok(killed)
    }
}

/// [`Host::command`] for the namespace named `ns`.
fn command_in(ns: &str, program: &std::ffi::OsStr) -> Command {
    let path = std::ffi::CString::new(format!("/run/netns/{ns}")).expect("namespace names hold no NUL");
    let mut c = Command::new(program);
    // SAFETY: only async-signal-safe calls (open, setns, close) between fork and exec; the
    // path was allocated before the fork.
    unsafe {
        c.pre_exec(move || {
            let fd = libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let r = libc::setns(fd, libc::CLONE_NEWNET);
            let e = std::io::Error::last_os_error();
            libc::close(fd);
            if r != 0 {
                return Err(e);
            }
            Ok(())
        });
    }
    c
}

/// [`Host::run_in`] for the namespace named `ns`.
fn run_in_ns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> anyhow::Result<T> {
    let fd = failover::netns::open(ns)?;
    std::thread::scope(|s| {
        let h = s.spawn(move || {
            use std::os::fd::AsRawFd;
            // Only this thread changes namespace (allowed for network namespaces in a
            // multi-threaded process); it ends with `f`.
            failover::netns::enter(fd.as_raw_fd()).map(|_| f())
        });
        match h.join() {
            Ok(r) => r.with_context(|| format!("cannot enter namespace {ns}")),
            Err(p) => std::panic::resume_unwind(p),
        }
    })
}

/// A host by its namespace's name, owned: what [`Host::place`] gives out. Like
/// [`Host::command`], it finds the namespace by name when used, so after a
/// [`Hosts::restart_host`] it starts programs in the new one.
#[derive(Clone, Debug)]
pub struct HostPlace {
    ns: String,
}

impl crate::etcd::Place for HostPlace {
    fn command(&self, program: &std::ffi::OsStr) -> Command {
        command_in(&self.ns, program)
    }

    fn connect(&self, to: std::net::SocketAddr, timeout: Duration) -> std::io::Result<std::net::TcpStream> {
        run_in_ns(&self.ns, || std::net::TcpStream::connect_timeout(&to, timeout)).map_err(std::io::Error::other)?
    }
}

/// An etcd member on this host, listening on its address.
impl From<&Host> for crate::etcd::MemberPlace {
    fn from(h: &Host) -> Self {
        crate::etcd::MemberPlace::new(h.addr.to_string(), std::sync::Arc::new(h.place()))
    }
}

/// A bed of hosts on one bridge. Dropping it kills every process on its hosts and deletes its
/// namespaces (and with them the veths and the bridge).
pub struct Hosts {
    bed: String,
    switch: String,
    subnet: [u8; 3],
    hosts: Vec<Host>,
}

impl Hosts {
    /// Makes a bed of `n` hosts, all up and reachable from each other. Sweeps the beds of dead
    /// processes first.
    pub fn create(n: usize) -> anyhow::Result<Hosts> {
        if n == 0 || n > MAX_HOSTS_PER_BED {
            bail!("a bed has 1 to {MAX_HOSTS_PER_BED} hosts, not {n}");
        }
        let me = std::process::id();
        let start = start_time(me).context("cannot read this process's start time from /proc/self/stat")?;
        let bed = format!("{PREFIX}-{me}-{start}-{}", BED_SEQ.fetch_add(1, Ordering::Relaxed));
        let mut hosts;
        {
            // The sweep, the choice of a free /24 and the switch that records it are one step,
            // so two beds never take the same /24.
            let _l = failover::netns::lock()?;
            sweep_stale_locked()?;
            let names = failover::netns::list()?;
            let used: Vec<u32> = names.iter().filter(|n| n.starts_with(&format!("{PREFIX}-"))).filter_map(|n| n.rsplit_once("-sw")?.1.parse().ok()).collect();
            let y = (0..MAX_BEDS).find(|y| !used.contains(y)).with_context(|| format!("all {MAX_BEDS} beds' /24s of {}.{}.0.0/16 are in use", SUBNET[0], SUBNET[1]))?;
            hosts = Hosts { switch: format!("{bed}-sw{y}"), bed, subnet: [SUBNET[0], SUBNET[1], y as u8], hosts: vec![] };
            ip(&["netns", "add", &hosts.switch])?;
        }
        // From here on, an error drops `hosts`, which deletes whatever was made.
        ip(&["-n", &hosts.switch, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &hosts.switch, "link", "set", "br0", "up"])?;
        for i in 0..n {
            let [a, b, c] = hosts.subnet;
            let host = Host {
                index: i,
                ns: format!("{}-h{i}", hosts.bed),
                port: format!("h{i}"),
                addr: Ipv4Addr::new(a, b, c, i as u8 + 1),
                children: Mutex::new(vec![]),
                state: Mutex::new(HostState::Up),
            };
            ip(&["netns", "add", &host.ns])?;
            hosts.hosts.push(host);
            hosts.plug(i)?;
        }
        tracing::debug!(bed = %hosts.bed, subnet = ?hosts.subnet, n, "host bed made");
        Ok(hosts)
    }

    /// Makes host `i`'s veth pair (its namespace exists), addresses it and brings it up.
    fn plug(&self, i: usize) -> anyhow::Result<()> {
        let h = &self.hosts[i];
        let sw = self.switch.as_str();
        // A fixed MAC, as a real NIC keeps across a reboot: the other hosts' neighbour entries
        // for the address stay right after a restart (a new random MAC would leave their
        // frames going to the old one until their entries time out, seconds).
        let [a, b, c, d] = h.addr.octets();
        let mac = format!("02:00:{a:02x}:{b:02x}:{c:02x}:{d:02x}");
        ip(&["-n", sw, "link", "add", &h.port, "type", "veth", "peer", "name", "eth0", "address", &mac, "netns", &h.ns])?;
        ip(&["-n", sw, "link", "set", &h.port, "master", "br0", "up"])?;
        ip(&["-n", &h.ns, "addr", "add", &format!("{}/24", h.addr), "dev", "eth0"])?;
        ip(&["-n", &h.ns, "link", "set", "eth0", "up"])?;
        ip(&["-n", &h.ns, "link", "set", "lo", "up"])?;
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// The bed's name, the prefix of all its namespaces.
    pub fn name(&self) -> &str {
        &self.bed
    }

    /// The bed's network (`10.214.Y.0`, a /24).
    pub fn subnet(&self) -> Ipv4Addr {
        let [a, b, c] = self.subnet;
        Ipv4Addr::new(a, b, c, 0)
    }

    /// The switch namespace's name (holds `br0` and a port `hI` per host).
    pub fn switch_namespace(&self) -> &str {
        &self.switch
    }

    pub fn host(&self, i: usize) -> &Host {
        &self.hosts[i]
    }

    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> Ipv4Addr {
        self.hosts[i].addr
    }

    fn set_port(&self, i: usize, up: bool) -> anyhow::Result<()> {
        let h = &self.hosts[i];
        ip(&["-n", &self.switch, "link", "set", &h.port, if up { "up" } else { "down" }])?;
        if up {
            // The carrier comes back asynchronously; until then packets are still dropped.
            let deadline = Instant::now() + CARRIER_TIMEOUT;
            while !ip(&["-n", &h.ns, "-o", "link", "show", "eth0"])?.contains("state UP") {
                if Instant::now() >= deadline {
                    bail!("host {i}'s eth0 has no carrier {CARRIER_TIMEOUT:?} after its port came up");
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            // Resolutions that failed during the cut would hold the first packets back: start
            // them afresh on every host.
            for o in &self.hosts {
                let _ = ip(&["-n", &o.ns, "neigh", "flush", "dev", "eth0"]);
            }
        }
        Ok(())
    }

    /// The machine is gone: its link is cut first (nothing its dying processes' sockets send
    /// gets out), then every process of the host is SIGKILLed until none is left. Returns the
    /// PIDs killed.
    pub fn kill_host(&self, i: usize) -> anyhow::Result<Vec<u32>> {
        self.set_port(i, false)?;
        *self.hosts[i].state.lock().unwrap() = HostState::Down;
        let killed = self.hosts[i].kill_all()?;
        tracing::debug!(bed = %self.bed, host = i, ?killed, "host killed");
        Ok(killed)
    }

    /// Cuts host `i` off from every other host; its processes keep running.
    pub fn partition(&self, i: usize) -> anyhow::Result<()> {
        self.set_port(i, false)?;
        let mut s = self.hosts[i].state.lock().unwrap();
        if *s == HostState::Up {
            *s = HostState::Partitioned;
        }
        Ok(())
    }

    /// Restores a partitioned host's link (waits until it carries).
    pub fn heal(&self, i: usize) -> anyhow::Result<()> {
        if self.hosts[i].state() == HostState::Down {
            bail!("host {i} is down: restart it, a heal would bring back a machine with no processes but its old sockets");
        }
        self.set_port(i, true)?;
        *self.hosts[i].state.lock().unwrap() = HostState::Up;
        Ok(())
    }

    /// A reboot: whatever still runs on host `i` is killed, its namespace is made afresh (same
    /// name and address; no socket, connection or neighbour entry survives) and plugged in.
    pub fn restart_host(&self, i: usize) -> anyhow::Result<()> {
        let h = &self.hosts[i];
        self.set_port(i, false)?;
        h.kill_all()?;
        // Deleting the switch's end destroys the pair at once (a namespace's devices go
        // asynchronously, and the port's name is reused just below).
        ip(&["-n", &self.switch, "link", "delete", &h.port])?;
        failover::netns::delete(&h.ns)?;
        ip(&["netns", "add", &h.ns])?;
        self.plug(i)?;
        *h.state.lock().unwrap() = HostState::Up;
        Ok(())
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // No lock here: the names are this bed's own, and a sweep never touches a live process's.
        for h in &self.hosts {
            if let Err(e) = h.kill_all() {
                eprintln!("warning: host bed {}: {e:#}", self.bed);
            }
            if let Err(e) = failover::netns::delete(&h.ns) {
                eprintln!("warning: host bed {}: {e}", self.bed);
            }
        }
        if let Err(e) = failover::netns::delete(&self.switch) {
            eprintln!("warning: host bed {}: {e}", self.bed);
        }
    }
}

/// The start time of process `pid` (clock ticks since boot, field 22 of `/proc/PID/stat`):
/// with the pid, it names one process for good (pids are reused, start times with them not).
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name start at field 3.
    stat.rsplit_once(')')?.1.split_whitespace().nth(22 - 3)?.parse().ok()
}

/// Live processes whose network namespace is the one bound at `ns_path`. Zombies have none
/// (their namespaces were released at exit), so they are not listed.
fn pids_in(ns_path: &str) -> Vec<u32> {
    let Ok(target) = std::fs::metadata(ns_path) else { return vec![] };
    let me = std::process::id();
    let Ok(dir) = std::fs::read_dir("/proc") else { return vec![] };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| *p != me)
        .filter(|p| std::fs::metadata(format!("/proc/{p}/ns/net")).is_ok_and(|m| m.dev() == target.dev() && m.ino() == target.ino()))
        .collect()
}

/// SIGKILLs every process in the namespace at `ns_path` until none is left (a process may fork
/// between a scan and the kill: scan again). Returns every PID killed.
fn kill_in(ns_path: &str, timeout: Duration) -> anyhow::Result<Vec<u32>> {
    let deadline = Instant::now() + timeout;
    let mut killed = vec![];
    loop {
        let pids = pids_in(ns_path);
        if pids.is_empty() {
            return Ok(killed);
        }
        for p in &pids {
            crate::proc::signal(*p, libc::SIGKILL);
            if !killed.contains(p) {
                killed.push(*p);
            }
        }
        if Instant::now() >= deadline {
            bail!("processes {pids:?} still live in {ns_path} {timeout:?} after SIGKILL");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Whether the process that made bed namespace `name` (`ushb-PID-START-…`) is gone.
fn owner_gone(name: &str) -> bool {
    let mut f = name.split('-').skip(1);
    let (Some(Ok(pid)), Some(Ok(start))) = (f.next().map(str::parse::<u32>), f.next().map(str::parse::<u64>)) else {
        // Not a name this module makes: not ours to delete.
        return false;
    };
    start_time(pid) != Some(start)
}

/// Deletes every bed namespace whose process is gone (a test run that was killed), after
/// killing whatever still runs in it. Returns their names.
pub fn sweep_stale() -> anyhow::Result<Vec<String>> {
    let _l = failover::netns::lock()?;
    sweep_stale_locked()
}

fn sweep_stale_locked() -> anyhow::Result<Vec<String>> {
    let mut gone = vec![];
    for n in failover::netns::list()?.into_iter().filter(|n| n.starts_with(&format!("{PREFIX}-")) && owner_gone(n)) {
        kill_in(&format!("/run/netns/{n}"), KILL_TIMEOUT)?;
        failover::netns::delete(&n)?;
        gone.push(n);
    }
    if !gone.is_empty() {
        tracing::info!(?gone, "stale host-bed namespaces of dead processes deleted");
    }
    Ok(gone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_live_processes_are_kept_and_of_dead_ones_swept() {
        let me = std::process::id();
        let start = start_time(me).unwrap();
        assert!(!owner_gone(&format!("{PREFIX}-{me}-{start}-0-h1")));
        // Same pid, another start time: the pid was reused, the bed's process is gone.
        assert!(owner_gone(&format!("{PREFIX}-{me}-{}-0-h1", start + 1)));
        // A name this module does not make is never taken for stale.
        assert!(!owner_gone(&format!("{PREFIX}-probe-1")));
        // Interface names fit IFNAMSIZ (15 characters).
        assert!(format!("h{}", MAX_HOSTS_PER_BED - 1).len() <= 15);
    }
}
