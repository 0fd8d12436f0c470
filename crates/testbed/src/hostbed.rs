//! Three machines on one box, each running its share of every control plane (issue 24 items 5
//! and 7): the placement the host-loss tests and `bench control failover` share.
//!
//! A [`HostBed`] is a [`Hosts`] bed of [`SERVER_HOSTS`] server hosts plus one client host
//! ([`CLIENT_HOST`], never killed: the test's own clients run there), and a real 3-member etcd
//! cluster, one member per server host. On it each system is started on demand, spread so that
//! every server host `i` runs one of each daemon, bound to the host's own address:
//!
//! | system | per server host `i` | names (logs: `DIR/NAME.log`) |
//! |---|---|---|
//! | [`HostBed::start_volume`] | a metadata service (`--store`, standby or leader), a shard | `meta-hI`, `shard-hI` |
//! | [`HostBed::start_kv`] | a kv node, a CM (`--store`) | `kv-node-hI`, `kv-cm-hI` |
//! | [`HostBed::start_nearlog`] | a log peer, a controller (`--store`) | `nl-peer-hI`, `nl-ctl-hI` |
//!
//! Every system shares the bed's secret; each keeps its keys under its own cluster name in the
//! one etcd. Which daemon leads is etcd's choice: find it with the system's election key
//! (`control::Store::observe`) and map it to a host with [`HostBed::host_of`]; the leaders'
//! names carry their host (`meta-hI`, `kv-cm-hI`; a controller leads under its address).
//!
//! **Where the caller runs.** Nothing is reachable from the root namespace (the bed adds
//! nothing there): clients must run in the client host, [`HostBed::in_client`] (a thread in its
//! namespace; threads it spawns, e.g. a tokio runtime's, inherit the namespace). Daemons get a
//! parent-death signal tied to the *thread* that starts them: start the bed and its systems
//! from a thread that outlives them (the test's, or the `in_client` closure that runs the
//! whole test). Dropping the bed kills every process of every host and removes its directory.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::Context;

use crate::etcd::{EtcdCluster, MemberPlace};
use crate::hosts::{Host, Hosts};

/// Server hosts: each runs an etcd member and one daemon of each kind.
pub const SERVER_HOSTS: usize = 3;
/// The index of the client host: the test's clients (and the nearlog shim's writers) run there.
pub const CLIENT_HOST: usize = SERVER_HOSTS;
/// The election lease of every leader (metadata service, CM, controller): etcd's minimum with
/// its default timings, short enough for tests.
pub const ELECTION_TTL: Duration = Duration::from_secs(2);
/// A shard the metadata service has not heard from this long is down: generous against a
/// loaded 2-core machine (no false failovers), short enough for a test.
pub const SHARD_DOWN_AFTER_MS: u64 = 3000;
/// The kv nodes' read lease (the CM's heartbeats renew it).
pub const KV_NODE_LEASE_MS: u64 = 300;
/// A kv node silent this long is removed by the CM (generous: a loaded machine stalls).
pub const KV_FAILURE_TIMEOUT_MS: u64 = 3000;
/// A log peer silent this long is lost at the nearlog controller.
pub const NEARLOG_PEER_LEASE_MS: u64 = 2000;
/// Memory each log peer lends to log files.
pub const NEARLOG_REGION_BYTES: u64 = 64 << 20;

/// Set (to anything) to keep the bed's directory (logs, data) when it is dropped.
pub const KEEP_ENV: &str = "UNDERSTUDY_HOSTBED_KEEP";

/// One daemon the bed started.
struct Daemon {
    name: String,
    host: usize,
    child: Child,
}

/// The bed: hosts, etcd, the daemons started on them, a directory for their data and logs.
pub struct HostBed {
    bin: PathBuf,
    dir: PathBuf,
    secret: Vec<u8>,
    daemons: Mutex<Vec<Daemon>>,
    etcd: EtcdCluster,
    // Last: dropping it kills whatever still runs on the hosts.
    hosts: Hosts,
}

/// The volume system's daemons: where its metadata services and shards listen.
#[derive(Clone, Debug)]
pub struct VolumeSys {
    /// Every metadata service's address, host by host: what shards and clients are given.
    pub metas: Vec<String>,
    /// Shard `i` (on host `i`) listens here.
    pub shards: Vec<String>,
}

impl VolumeSys {
    /// The `--meta` list: every service's address, comma-separated.
    pub fn meta_list(&self) -> String {
        self.metas.join(",")
    }
}

/// The kv group's daemons.
#[derive(Clone, Debug)]
pub struct KvSys {
    /// Node `i` (on host `i`) listens here.
    pub nodes: Vec<std::net::SocketAddr>,
}

/// The nearlog cluster's daemons, and the cluster file the shim reads.
#[derive(Clone, Debug)]
pub struct NearlogSys {
    /// Controller `i` (on host `i`) listens here when it leads; it leads under this address.
    pub controllers: Vec<String>,
    /// Log peer `i` (on host `i`) listens here.
    pub peers: Vec<String>,
    /// `{"controller": every controller, "secret_file", "peers": []}`: the shim's
    /// `UNDERSTUDY_NEARLOG_CLUSTER`.
    pub cluster_file: PathBuf,
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

impl HostBed {
    /// Makes the hosts and starts etcd (one member per server host), waiting until it is
    /// healthy. `bin` is the `understudy` executable the daemons run (in a cargo test,
    /// `env!("CARGO_BIN_EXE_understudy")`). Needs root ([`crate::hosts::available`]).
    pub fn start(bin: &Path) -> anyhow::Result<HostBed> {
        let hosts = Hosts::create(SERVER_HOSTS + 1)?;
        let dir = std::env::temp_dir().join(format!("{}-dir", hosts.name()));
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot make {}", dir.display()))?;
        let etcd = EtcdCluster::start_with(
            (0..SERVER_HOSTS)
                .map(|i| MemberPlace::from(hosts.host(i)))
                .collect(),
        );
        let etcd = match etcd {
            Ok(e) => e,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e.context("etcd on the bed's hosts"));
            }
        };
        let secret = format!("hostbed-{}-{:x}", hosts.name(), rand::random::<u64>()).into_bytes();
        let bed = HostBed {
            bin: bin.to_path_buf(),
            dir,
            secret,
            daemons: Mutex::new(vec![]),
            etcd,
            hosts,
        };
        let sf = bed.secret_file();
        std::fs::write(&sf, &bed.secret)?;
        std::fs::set_permissions(&sf, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        Ok(bed)
    }

    /// The `understudy` executable the daemons run.
    pub fn bin(&self) -> &Path {
        &self.bin
    }

    pub fn hosts(&self) -> &Hosts {
        &self.hosts
    }

    pub fn host(&self, i: usize) -> &Host {
        self.hosts.host(i)
    }

    /// The client host (never killed by the bed's tests).
    pub fn client(&self) -> &Host {
        self.hosts.host(CLIENT_HOST)
    }

    pub fn etcd(&self) -> &EtcdCluster {
        &self.etcd
    }

    pub fn etcd_mut(&mut self) -> &mut EtcdCluster {
        &mut self.etcd
    }

    /// `etcd://…` of the bed's cluster (reachable from the hosts only).
    pub fn store_url(&self) -> String {
        self.etcd.url()
    }

    /// The directory of the daemons' data and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn secret(&self) -> &[u8] {
        &self.secret
    }

    pub fn secret_file(&self) -> PathBuf {
        self.dir.join("secret")
    }

    /// Runs `f` on a thread in the client host's namespace (its sockets, and those of threads
    /// it spawns, are the client host's).
    pub fn in_client<T: Send>(&self, f: impl FnOnce() -> T + Send) -> anyhow::Result<T> {
        self.client().run_in(f)
    }

    /// `address:port` → the host whose address it is (a server host or the client).
    pub fn host_of(&self, addr: &str) -> Option<usize> {
        let ip: IpAddr = addr
            .rsplit_once(':')
            .map_or(addr, |(h, _)| h)
            .parse()
            .ok()?;
        self.hosts
            .hosts()
            .iter()
            .position(|h| IpAddr::V4(h.addr()) == ip)
    }

    /// A free port on host `i`'s address, as `address:port`. Free on loopback is free in a
    /// fresh namespace too (as etcd's members are placed).
    fn addr_on(&self, i: usize) -> anyhow::Result<String> {
        Ok(format!(
            "{}:{}",
            self.host(i).addr(),
            wire::ports::free_loopback_port()?
        ))
    }

    /// Starts `understudy ARGS` on host `host` as daemon `name`: output to `DIR/NAME.log`, its
    /// own process group, SIGKILL when the calling thread ends. Returns its pid.
    pub fn spawn(&self, host: usize, name: &str, args: &[String]) -> anyhow::Result<u32> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log(name))?;
        let mut cmd = self.host(host).command(&self.bin);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        crate::proc::own_group_dying_with_parent(&mut cmd, libc::SIGKILL);
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {name} on host {host}"))?;
        let pid = child.id();
        self.daemons.lock().unwrap().push(Daemon {
            name: name.to_string(),
            host,
            child,
        });
        Ok(pid)
    }

    /// Daemon `name`'s log file.
    pub fn log(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.log"))
    }

    /// The last `lines` lines of daemon `name`'s log.
    pub fn tail(&self, name: &str, lines: usize) -> String {
        crate::proc::tail(&self.log(name), lines)
    }

    /// Daemon `name`'s pid (the last started under that name).
    pub fn pid(&self, name: &str) -> Option<u32> {
        self.daemons
            .lock()
            .unwrap()
            .iter()
            .rev()
            .find(|d| d.name == name)
            .map(|d| d.child.id())
    }

    /// How daemon `name` (the last started under that name) exited; None while it runs.
    pub fn exit_status(&self, name: &str) -> Option<ExitStatus> {
        let mut ds = self.daemons.lock().unwrap();
        let d = ds.iter_mut().rev().find(|d| d.name == name)?;
        d.child.try_wait().ok().flatten()
    }

    /// The names of the daemons started on host `i`.
    pub fn daemons_on(&self, i: usize) -> Vec<String> {
        self.daemons
            .lock()
            .unwrap()
            .iter()
            .filter(|d| d.host == i)
            .map(|d| d.name.clone())
            .collect()
    }

    /// Host `i` dies ([`Hosts::kill_host`]: link cut, every process SIGKILLed, its etcd member
    /// too); the bed reaps its daemons. Returns the pids killed.
    pub fn kill_host(&self, i: usize) -> anyhow::Result<Vec<u32>> {
        let killed = self.hosts.kill_host(i)?;
        for d in self
            .daemons
            .lock()
            .unwrap()
            .iter_mut()
            .filter(|d| d.host == i)
        {
            let _ = d.child.kill();
            let _ = d.child.wait();
        }
        Ok(killed)
    }

    /// Cuts host `i` off from every other (its processes run on).
    pub fn partition(&self, i: usize) -> anyhow::Result<()> {
        self.hosts.partition(i)
    }

    /// Restores a partitioned host's link.
    pub fn heal(&self, i: usize) -> anyhow::Result<()> {
        self.hosts.heal(i)
    }

    /// One metadata service (`meta-hI`, election TTL [`ELECTION_TTL`], 2 replicas per object)
    /// and one shard (`shard-hI`, id I) per server host, every one given every service's
    /// address. Returns at once: the caller waits for the leader and the shards.
    pub fn start_volume(&self) -> anyhow::Result<VolumeSys> {
        let metas: Vec<String> = (0..SERVER_HOSTS)
            .map(|i| self.addr_on(i))
            .collect::<anyhow::Result<_>>()?;
        let shards: Vec<String> = (0..SERVER_HOSTS)
            .map(|i| self.addr_on(i))
            .collect::<anyhow::Result<_>>()?;
        let sys = VolumeSys { metas, shards };
        let (url, sf) = (self.store_url(), self.secret_file().display().to_string());
        for (i, listen) in sys.metas.iter().enumerate() {
            let name = format!("meta-h{i}");
            let args = strings(&[
                "volume",
                "meta",
                "--store",
                &url,
                "--listen",
                listen,
                "--advertise",
                &name,
                "--secret-file",
                &sf,
                "--election-ttl-ms",
                &ELECTION_TTL.as_millis().to_string(),
                "--replicas",
                "2",
                "--ping-interval-ms",
                "100",
                "--down-after-ms",
                &SHARD_DOWN_AFTER_MS.to_string(),
            ]);
            self.spawn(i, &name, &args)?;
        }
        for (i, listen) in sys.shards.iter().enumerate() {
            let d = self.dir.join(format!("shard-h{i}"));
            let args = strings(&[
                "volume",
                "shard",
                "--id",
                &i.to_string(),
                "--dir",
                &d.display().to_string(),
                "--listen",
                listen,
                "--meta",
                &sys.meta_list(),
                "--secret-file",
                &sf,
                "--create",
            ]);
            self.spawn(i, &format!("shard-h{i}"), &args)?;
        }
        Ok(sys)
    }

    /// One kv node (`kv-node-hI`, id I) and one CM (`kv-cm-hI`, leading as `kv-cm-hI`) per
    /// server host. Returns at once.
    pub fn start_kv(&self) -> anyhow::Result<KvSys> {
        let nodes: Vec<std::net::SocketAddr> = (0..SERVER_HOSTS)
            .map(|i| Ok(self.addr_on(i)?.parse()?))
            .collect::<anyhow::Result<_>>()?;
        let list = nodes
            .iter()
            .enumerate()
            .map(|(i, a)| format!("{i}={a}"))
            .collect::<Vec<_>>()
            .join(",");
        let (url, sf) = (self.store_url(), self.secret_file().display().to_string());
        for i in 0..SERVER_HOSTS {
            let data = self.dir.join(format!("kv-node-h{i}"));
            let args = strings(&[
                "kv",
                "node",
                "--id",
                &i.to_string(),
                "--peers",
                &list,
                "--data",
                &data.display().to_string(),
                "--secret-file",
                &sf,
                "--lease-ms",
                &KV_NODE_LEASE_MS.to_string(),
            ]);
            self.spawn(i, &format!("kv-node-h{i}"), &args)?;
        }
        for i in 0..SERVER_HOSTS {
            let name = format!("kv-cm-h{i}");
            let args = strings(&[
                "kv",
                "cm",
                "--nodes",
                &list,
                "--secret-file",
                &sf,
                "--store",
                &url,
                "--election-ttl-ms",
                &ELECTION_TTL.as_millis().to_string(),
                "--advertise",
                &name,
                "--lease-ms",
                &KV_NODE_LEASE_MS.to_string(),
                "--failure-timeout-ms",
                &KV_FAILURE_TIMEOUT_MS.to_string(),
                "--startup-grace-ms",
                "10000",
            ]);
            self.spawn(i, &name, &args)?;
        }
        Ok(KvSys { nodes })
    }

    /// One log peer (`nl-peer-hI`, [`NEARLOG_REGION_BYTES`], its id kept in a file) and one
    /// controller (`nl-ctl-hI`, peer lease [`NEARLOG_PEER_LEASE_MS`]) per server host, and the
    /// cluster file naming every controller. Returns at once.
    pub fn start_nearlog(&self) -> anyhow::Result<NearlogSys> {
        let controllers: Vec<String> = (0..SERVER_HOSTS)
            .map(|i| self.addr_on(i))
            .collect::<anyhow::Result<_>>()?;
        let peers: Vec<String> = (0..SERVER_HOSTS)
            .map(|i| self.addr_on(i))
            .collect::<anyhow::Result<_>>()?;
        let all = controllers.join(",");
        let (url, sf) = (self.store_url(), self.secret_file().display().to_string());
        for (i, listen) in controllers.iter().enumerate() {
            let d = self.dir.join(format!("nl-ctl-h{i}"));
            let args = strings(&[
                "nearlog",
                "controller",
                "--listen",
                listen,
                "--store",
                &url,
                "--election-ttl-ms",
                &ELECTION_TTL.as_millis().to_string(),
                "--peer-lease-ms",
                &NEARLOG_PEER_LEASE_MS.to_string(),
                "--dir",
                &d.display().to_string(),
                "--secret-file",
                &sf,
            ]);
            self.spawn(i, &format!("nl-ctl-h{i}"), &args)?;
        }
        for (i, listen) in peers.iter().enumerate() {
            let id = self.dir.join(format!("nl-peer-h{i}.id"));
            let args = strings(&[
                "nearlog",
                "peer",
                "--listen",
                listen,
                "--controller",
                &all,
                "--region-bytes",
                &NEARLOG_REGION_BYTES.to_string(),
                "--secret-file",
                &sf,
                "--id-file",
                &id.display().to_string(),
            ]);
            self.spawn(i, &format!("nl-peer-h{i}"), &args)?;
        }
        let cluster_file = self.dir.join("nearlog-cluster.json");
        let cf = serde_json::json!({"controller": all, "secret_file": sf, "peers": []});
        std::fs::write(&cluster_file, cf.to_string())?;
        Ok(NearlogSys {
            controllers,
            peers,
            cluster_file,
        })
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> Ipv4Addr {
        self.hosts.addr(i)
    }
}

impl Drop for HostBed {
    fn drop(&mut self) {
        // A failed test's evidence: the directory goes with the bed.
        if std::thread::panicking() {
            for d in self.daemons.lock().unwrap().iter() {
                eprintln!(
                    "--- {} (host {}), last lines of its log:\n{}",
                    d.name,
                    d.host,
                    crate::proc::tail(&self.log(&d.name), 12)
                );
            }
        }
        for d in self.daemons.lock().unwrap().iter_mut() {
            let _ = d.child.kill();
            let _ = d.child.wait();
        }
        if std::env::var_os(KEEP_ENV).is_some() {
            eprintln!(
                "host bed: {KEEP_ENV} set, logs and data kept in {}",
                self.dir.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
