//! `understudy bench control failover` (issue 24 item 8): how long the control plane on etcd
//! takes to serve again when the machine of one of its leaders dies, against the embedded
//! backend's restart under `up`, and what an open volume's writer sees meanwhile.
//!
//! **Placement.** Each host loss runs on a fresh bed of four network-namespace hosts
//! ([`testbed::hosts`]): hosts 0-2 each hold an etcd member and one instance of every daemon of
//! the part measured (a metadata service and a shard; a kv node and a CM; a nearlog controller
//! and a log peer), host 3 holds the clients (this process's measuring threads enter its
//! namespace, so every socket they open is the client host's). The daemon on host 0 is started
//! first and waited for as leader, the others stand by; then host 0 is lost
//! ([`Hosts::kill_host`]: link cut, every process SIGKILLed), which takes the leader, an etcd
//! member and a data-path daemon with it, as a real machine's loss would. This is a minimal
//! placement of its own, kept small; `testbed::hostbed` is the general one.
//!
//! **What is measured.** From just before the kill to the next decision served by a survivor:
//! a volume create (metadata service), the dead node's removal written to etcd by the new CM
//! (kv: the reconfiguration a lost node needs), a log file's open granted (nearlog controller).
//! The probes dial only the surviving leaders' addresses, each attempt bounded, so what is timed
//! is when the system could serve, not how long a client's list takes to skip a dead address.
//! Medians and spread (min, max) over the repetitions; each takeover's ratio to the election
//! lease TTL. Beside them: the embedded backend's restart (SIGKILL of the metadata service under
//! `understudy volume up` until a create is served, of the CM under `kv up` until a put and a
//! get are served, of the controller under `nearlog up` until an open is granted), super and collapse latency with the
//! metadata service on etcd against the embedded store (two clusters side by side on loopback,
//! requests interleaved A B A B), and the longest gap between acknowledged writes of a writer on
//! an open volume when the metadata leader's host (with a shard) dies, against the same gap
//! when only a shard's process dies (interleaved with the host losses, one fresh bed each).
//! The volume bed is deployed as on etcd: shards keep leases (`--store`) and the writer's client
//! follows the election, so both leave the dead leader's silent links when the election key
//! changes instead of waiting out the shards' 5 s metadata-link silence (without `--store` the
//! stall was 7.3 s against a 2.3 s takeover, debug build, load 7).
//!
//! The failover monitor's takeover and the failover primary's host loss run on
//! `testbed::hostbed` with the `failover_hosts` test's scenario: see `control/failover_monitor.rs`.

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use blockdev::BlockDev;
use clap::{Args, ValueEnum};
use futures::StreamExt;
use testbed::etcd::{EtcdCluster, MemberPlace};
use testbed::hosts::Hosts;

mod failover_monitor;
mod nearlog_peer;
use volume::driver::client::Cluster;
use volume::driver::leader::LeaderWatch;
use volume::driver::meta::{MetaReq, MetaResp, DEFAULT_OBJECT_SIZE_BYTES, META_ELECTION};

/// Default election lease of every leader measured (the daemons' `--election-ttl-ms`).
pub const DEFAULT_ELECTION_TTL_MS: u64 = 2000;
/// Servers of a bed (each an etcd member and one of every daemon); one more host holds clients.
pub const SERVER_HOSTS: usize = 3;
/// How long a part may take to come up (etcd healthy, leader elected, daemons registered).
pub const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// After the kill, how long a decision may take before the repetition is reported failed.
pub const DECISION_TIMEOUT: Duration = Duration::from_secs(45);
/// Bound of one probe attempt (connect + request): a survivor that does not lead answers
/// nothing or refuses; the next attempt comes 20 ms later.
pub const PROBE_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
/// Pause between probe attempts.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(20);
/// The shards' failure detector at the metadata service (`--down-after-ms`): generous against a
/// loaded 2-core machine's stalls, short beside the 30 s client I/O timeout.
pub const DOWN_AFTER_MS: u64 = 1500;
/// The kv CM's failure timeout for a node (`--failure-timeout-ms`) and its start-up grace.
pub const KV_FAILURE_TIMEOUT_MS: u64 = 1000;
/// The kv nodes' read lease (`--lease-ms`).
pub const KV_NODE_LEASE_MS: u64 = 300;
/// The writer's block and the volume it writes once each, front to back.
pub const WRITE_BLOCK_BYTES: u64 = 4096;
pub const WRITER_VOLUME_BYTES: u64 = 256 << 20;
/// Bound of the read-back of a loss's acknowledged blocks, and reads in flight meanwhile.
pub const VERIFY_TIMEOUT: Duration = Duration::from_secs(30);
pub const VERIFY_READS_IN_FLIGHT: usize = 32;
/// The writer keeps writing this long after its stall ended (so the stall is seen to end).
pub const AFTER_STALL: Duration = Duration::from_secs(1);
/// Super+collapse pairs per variant in the etcd-vs-embedded comparison. A pair takes ~0.1 s; six
/// (the old quick count) left the etcd/embedded ratio to one or two fsyncs' luck on a loaded
/// machine (1.66 and 0.85 in two runs a minute apart, load 5-6).
pub const LATENCY_PAIRS_QUICK: usize = 20;
pub const LATENCY_PAIRS_FULL: usize = 40;
/// Repetitions of each loss.
pub const REPS_QUICK: usize = 1;
pub const REPS_FULL: usize = 5;

/// What a run measures; all by default.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Part {
    /// The metadata leader's host lost: takeover and the open volume's I/O stall.
    Meta,
    /// A shard's process killed: the open volume's I/O stall (the baseline of the host loss).
    Shard,
    /// The kv CM leader's host lost: until the dead node is removed by the new CM.
    KvCm,
    /// The nearlog controller leader's host lost: until a log file's open is granted.
    NearlogController,
    /// The embedded metadata service SIGKILLed under `understudy volume up`: until a create.
    Embedded,
    /// Super and collapse latency, metadata service on etcd against the embedded store.
    Latency,
    /// The failover primary's host lost: until the promoted primary serves.
    FailoverHost,
    /// The host of the leading failover monitor and of the primary lost: until the standby promotes.
    FailoverMonitor,
    /// A log peer's host lost: until its files are re-replicated on a spare peer.
    NearlogPeer,
}

#[derive(Args, Debug)]
pub struct FailoverArgs {
    /// A short run (one repetition of each loss, few latency samples) that still measures every
    /// figure.
    #[arg(long)]
    pub quick: bool,
    /// Where plots (SVG, PNG) and raw samples (CSV) go [default: target/bench/control].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Repetitions of each loss [default: 5; with --quick 1].
    #[arg(long, value_name = "N")]
    pub reps: Option<usize>,
    /// Measure only these parts (comma-separated) [default: all].
    #[arg(long, value_enum, value_delimiter = ',', value_name = "PART")]
    pub only: Vec<Part>,
    /// Election lease TTL of every leader (etcd leases are whole seconds).
    #[arg(long, value_name = "MS", default_value_t = DEFAULT_ELECTION_TTL_MS)]
    pub election_ttl_ms: u64,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim().to_string()
}

/// Median, min and max of `v` (not empty).
fn spread(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    let med = if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 };
    (med, s[0], s[n - 1])
}

fn figure_spread(report: &mut bench::Report, prefix: &str, v: &[f64]) -> anyhow::Result<f64> {
    let (med, min, max) = spread(v);
    report.figure(&format!("{prefix}_p50"), med)?;
    report.figure(&format!("{prefix}_min"), min)?;
    report.figure(&format!("{prefix}_max"), max)?;
    Ok(med)
}

/// Runs `f` on a thread that lives in network namespace `ns`; threads it starts (a tokio
/// runtime's workers) are born there too, so every socket of the measurement is the client
/// host's. Processes it starts die with it (their parent-death signal is this thread's).
fn in_namespace<T: Send>(ns: &str, f: impl FnOnce() -> anyhow::Result<T> + Send) -> anyhow::Result<T> {
    let fd = failover::netns::open(ns)?;
    std::thread::scope(|s| {
        let h = s.spawn(move || {
            failover::netns::enter(fd.as_raw_fd()).with_context(|| format!("cannot enter namespace {ns}"))?;
            f()
        });
        match h.join() {
            Ok(r) => r,
            Err(p) => std::panic::resume_unwind(p),
        }
    })
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?)
}

/// A bed for one host loss: four hosts, an etcd member on each server host, a temp dir with
/// the cluster secret, free ports.
struct Bed {
    hosts: Hosts,
    dir: tempfile::TempDir,
    secret: Vec<u8>,
    secret_file: PathBuf,
    exe: PathBuf,
    // Dropped before `hosts` (which kills whatever runs on them).
    etcd: Option<EtcdCluster>,
}

impl Bed {
    fn create(prefix: &str) -> anyhow::Result<Bed> {
        testbed::hosts::available().context("`bench control failover` needs network namespaces (root and `ip netns`)")?;
        let hosts = Hosts::create(SERVER_HOSTS + 1)?;
        let dir = tempfile::Builder::new().prefix(&format!("understudy-cbench-{prefix}-")).tempdir()?;
        let secret = format!("cbench-{}-{:x}", std::process::id(), rand::random::<u64>()).into_bytes();
        let secret_file = dir.path().join("secret");
        std::fs::write(&secret_file, &secret)?;
        std::fs::set_permissions(&secret_file, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        Ok(Bed { hosts, dir, secret, secret_file, exe: std::env::current_exe()?, etcd: None })
    }

    fn client_ns(&self) -> String {
        self.hosts.host(SERVER_HOSTS).namespace().to_string()
    }

    /// Starts the etcd members, one per server host (from the calling thread: they die with it).
    fn start_etcd(&mut self) -> anyhow::Result<String> {
        let places: Vec<MemberPlace> = (0..SERVER_HOSTS).map(|i| MemberPlace::from(self.hosts.host(i))).collect();
        let etcd = EtcdCluster::start_with(places)?;
        let url = etcd.url();
        self.etcd = Some(etcd);
        Ok(url)
    }

    /// `understudy ARGS` on host `i`, output to `<name>.log`; returns its pid.
    fn spawn(&self, i: usize, name: &str, args: &[String]) -> anyhow::Result<u32> {
        let log = std::fs::File::create(self.dir.path().join(format!("{name}.log")))?;
        let mut cmd = self.hosts.host(i).command(&self.exe);
        cmd.args(args).stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
        testbed::proc::own_group_dying_with_parent(&mut cmd, libc::SIGKILL);
        self.hosts.host(i).spawn(&mut cmd)
    }

    fn log_tail(&self, name: &str) -> String {
        testbed::proc::tail(&self.dir.path().join(format!("{name}.log")), 8)
    }

    fn sf(&self) -> String {
        self.secret_file.display().to_string()
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        drop(self.etcd.take());
    }
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

/// Polls `f` every [`PROBE_INTERVAL`] until it holds or `timeout` passes; `what` names it in
/// the error.
async fn until<F, Fut>(timeout: Duration, what: impl Fn() -> String, mut f: F) -> anyhow::Result<Instant>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if f().await {
            return Ok(Instant::now());
        }
        if Instant::now() > deadline {
            bail!("{} not within {timeout:?}", what());
        }
        tokio::time::sleep(PROBE_INTERVAL).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Volumes: the metadata service's takeover and the open volume's stall.

/// One writer's acknowledged writes: when each was acknowledged, and what it wrote where.
#[derive(Default)]
struct Acks {
    at: Vec<Instant>,
    blocks: BTreeMap<u64, u64>,
    errors: u64,
}

fn block(seq: u64) -> Vec<u8> {
    seq.to_le_bytes().iter().copied().cycle().take(WRITE_BLOCK_BYTES as usize).collect()
}

/// The longest gap between consecutive acknowledged writes that ends after `kill`.
fn longest_gap_after(at: &[Instant], kill: Instant) -> Duration {
    at.windows(2).filter(|w| w[1] > kill).map(|w| w[1] - w[0]).max().unwrap_or_default()
}

/// Result of one volume loss.
struct VolumeLoss {
    /// Kill to the next create served (host loss only).
    decision: Option<Duration>,
    /// None: the writer got no acknowledgement for [`DECISION_TIMEOUT`] after the loss.
    stall: Option<Duration>,
    lost_writes: u64,
    /// Acknowledged blocks whose read did not answer within [`VERIFY_TIMEOUT`].
    unreadable_writes: u64,
    acked: usize,
    /// Acknowledgement times relative to the kill, seconds.
    timeline: Vec<f64>,
    /// When the writer was stopped, seconds after the kill (the timeline's end: a stall that
    /// never ended shows as zeros up to here).
    observed_s: f64,
    load: String,
}

/// A volume bed: etcd, a metadata service and a shard per server host, a writer on host 3;
/// then host 0 lost (`host_loss`) or shard 1's process killed. The bed is torn down after.
fn volume_loss(ttl: Duration, host_loss: bool, keep_logs: &Path) -> anyhow::Result<VolumeLoss> {
    let mut bed = Bed::create(if host_loss { "meta" } else { "shard" })?;
    let ns = bed.client_ns();
    in_namespace(&ns, move || {
        let url = bed.start_etcd()?;
        let rt = runtime()?;
        let ports = wire::ports::free_loopback_ports(2 * SERVER_HOSTS)?;
        let meta_addr = |i: usize| format!("{}:{}", bed.hosts.addr(i), ports[i]);
        let metas: Vec<String> = (0..SERVER_HOSTS).map(meta_addr).collect();
        let all = metas.join(",");
        let survivors = metas[1..].join(",");
        let meta_args = |i: usize| {
            s(&[
                "volume", "meta", "--store", &url, "--listen", &metas[i], "--advertise", &metas[i], "--secret-file", &bed.sf(),
                "--election-ttl-ms", &ttl.as_millis().to_string(), "--replicas", "2", "--ping-interval-ms", "100",
                "--down-after-ms", &DOWN_AFTER_MS.to_string(),
            ])
        };
        rt.block_on(async {
            let store = control::Store::open(&url, "volume", &volume::driver::meta::cluster_id_from_secret(&bed.secret)).await?;
            bed.spawn(0, "meta-0", &meta_args(0))?;
            until(READY_TIMEOUT, || format!("meta-h0 leading: {}", bed.log_tail("meta-0")), || async {
                store.observe(META_ELECTION).await.ok().flatten().as_deref() == Some(metas[0].as_str())
            })
            .await?;
            for i in 1..SERVER_HOSTS {
                bed.spawn(i, &format!("meta-{i}"), &meta_args(i))?;
            }
            let mut shard_pids = vec![];
            for i in 0..SERVER_HOSTS {
                let listen = format!("{}:{}", bed.hosts.addr(i), ports[SERVER_HOSTS + i]);
                let args = s(&[
                    "volume", "shard", "--id", &i.to_string(), "--dir", &bed.path(&format!("shard-{i}")), "--listen", &listen, "--meta", &all,
                    "--secret-file", &bed.sf(), "--create", "--store", &url,
                ]);
                shard_pids.push(bed.spawn(i, &format!("shard-{i}"), &args)?);
            }
            // The writer follows the election as the shards do (`--store`): when the leader's
            // host is lost, nothing waits for its silent links to time out.
            let cluster_id = volume::driver::meta::cluster_id_from_secret(&bed.secret);
            let c = Cluster::connect_following(&all, &bed.secret, LeaderWatch::spawn(url.clone(), "volume".into(), cluster_id)).await?;
            until(READY_TIMEOUT, || "three shards up".to_string(), || async {
                matches!(c.meta(MetaReq::GetMap).await, Ok(MetaResp::Map(m)) if m.shards.len() == SERVER_HOSTS && m.shards.iter().all(|s| s.state == volume::types::ShardState::Up))
            })
            .await?;
            c.meta(MetaReq::Create { name: "vol".into(), size_bytes: WRITER_VOLUME_BYTES, object_size_bytes: DEFAULT_OBJECT_SIZE_BYTES }).await?;
            let vol = Arc::new(c.open("vol").await?);

            // The writer: one block at a time, each offset once, every acknowledgement timed.
            let acks: Arc<Mutex<Acks>> = Arc::default();
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let writer = {
                let (vol, acks, stop) = (vol.clone(), acks.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut seq = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let off = seq * WRITE_BLOCK_BYTES;
                        if off >= WRITER_VOLUME_BYTES {
                            break;
                        }
                        seq += 1;
                        let ok = vol.write(off, block(seq)).await.is_ok();
                        let mut a = acks.lock().unwrap();
                        if ok {
                            a.at.push(Instant::now());
                            a.blocks.insert(off, seq);
                        } else {
                            a.errors += 1;
                        }
                    }
                })
            };
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let load = load();
            let kill = Instant::now();
            let decision = if host_loss {
                bed.hosts.kill_host(0)?;
                let mut n = 0u32;
                let at = until(DECISION_TIMEOUT, || format!("a create served by a standby (meta-1: {})", bed.log_tail("meta-1")), || {
                    n += 1;
                    let (survivors, secret) = (survivors.clone(), bed.secret.clone());
                    async move {
                        let attempt = async {
                            let c = Cluster::connect(&survivors, &secret).await.ok()?;
                            let r = c.meta(MetaReq::Create { name: format!("probe-{n}"), size_bytes: 8 << 20, object_size_bytes: DEFAULT_OBJECT_SIZE_BYTES }).await;
                            matches!(r, Ok(MetaResp::Volume(_))).then_some(())
                        };
                        matches!(tokio::time::timeout(PROBE_ATTEMPT_TIMEOUT, attempt).await, Ok(Some(())))
                    }
                })
                .await?;
                eprintln!("  a standby served a create {:.0} ms after the kill", ms(at - kill));
                Some(at - kill)
            } else {
                anyhow::ensure!(testbed::proc::signal(shard_pids[1], libc::SIGKILL), "shard 1 was not running");
                None
            };
            // A stall still under way now ends with an acknowledgement after it; one more second
            // of writes after that shows it ended (the longest gap is taken at the end).
            let checkpoint = Instant::now();
            let resumed = until(DECISION_TIMEOUT, || "the open volume's writer acknowledged after the loss".to_string(), || {
                let a = acks.lock().unwrap().at.last().copied();
                tracing::debug!(last_ack_after_kill_ms = ?a.map(|t| t.checked_duration_since(kill).map(ms)), "waiting for the writer");
                async move { a.is_some_and(|t| t >= checkpoint + AFTER_STALL) }
            })
            .await;
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let stall = match resumed {
                Ok(_) => {
                    writer.await?;
                    true
                }
                Err(e) => {
                    // A write that never returns is the finding: reported, not waited for; the
                    // daemons' logs are kept for whoever looks into it.
                    writer.abort();
                    std::fs::create_dir_all(keep_logs)?;
                    for entry in std::fs::read_dir(bed.dir.path())?.flatten() {
                        if entry.path().extension().is_some_and(|x| x == "log") {
                            std::fs::copy(entry.path(), keep_logs.join(entry.file_name()))?;
                        }
                    }
                    eprintln!("  the writer is stuck: {e:#}; the daemons' logs are in {}", keep_logs.display());
                    false
                }
            };
            let observed_s = kill.elapsed().as_secs_f64();
            let a = std::mem::take(&mut *acks.lock().unwrap());
            let stall = stall.then(|| longest_gap_after(&a.at, kill));
            // Every acknowledged block reads back, through a fresh client of the survivors: a
            // block that reads otherwise is lost; one whose read does not answer (its object's
            // replicas still mapped to the dead shard) is unreadable, not known lost.
            let reader = Arc::new(Cluster::connect(if host_loss { &survivors } else { &all }, &bed.secret).await?.open("vol").await?);
            let verify_deadline = tokio::time::Instant::now() + VERIFY_TIMEOUT;
            let results: Vec<Option<bool>> = futures::stream::iter(a.blocks.iter().map(|(&off, &seq)| {
                let reader = reader.clone();
                async move {
                    let read = tokio::time::timeout(PROBE_ATTEMPT_TIMEOUT, reader.read(off, WRITE_BLOCK_BYTES as u32));
                    match tokio::time::timeout_at(verify_deadline, read).await {
                        Ok(Ok(Ok(b))) => Some(b == block(seq)),
                        _ => None,
                    }
                }
            }))
            .buffer_unordered(VERIFY_READS_IN_FLIGHT)
            .collect()
            .await;
            let lost = results.iter().filter(|r| **r == Some(false)).count() as u64;
            let unreadable = results.iter().filter(|r| r.is_none()).count() as u64;
            let timeline = a.at.iter().map(|t| if *t >= kill { (*t - kill).as_secs_f64() } else { -(kill - *t).as_secs_f64() }).collect();
            eprintln!(
                "{}: {}stall {}, {} writes acknowledged ({} errors), {lost} lost, {unreadable} unreadable; load {load}",
                if host_loss { "metadata leader's host lost" } else { "shard process killed" },
                decision.map(|d| format!("create served after {:.0} ms, ", ms(d))).unwrap_or_default(),
                stall.map(|s| format!("{:.0} ms", ms(s))).unwrap_or_else(|| format!("over {DECISION_TIMEOUT:?} (stuck)")),
                a.at.len(),
                a.errors
            );
            Ok(VolumeLoss { decision, stall, lost_writes: lost, unreadable_writes: unreadable, acked: a.at.len(), timeline, observed_s, load })
        })
    })
}

// ---------------------------------------------------------------------------------------------
// kv: the CM's takeover, until the lost node is removed.

fn kv_cm_loss(ttl: Duration) -> anyhow::Result<(Duration, String)> {
    let mut bed = Bed::create("kvcm")?;
    let ns = bed.client_ns();
    in_namespace(&ns, move || {
        let url = bed.start_etcd()?;
        let rt = runtime()?;
        let ports = wire::ports::free_loopback_ports(SERVER_HOSTS)?;
        let addrs: Vec<std::net::SocketAddr> = (0..SERVER_HOSTS).map(|i| std::net::SocketAddr::new(bed.hosts.addr(i).into(), ports[i])).collect();
        let nodes = addrs.iter().enumerate().map(|(i, a)| format!("{i}={a}")).collect::<Vec<_>>().join(",");
        for i in 0..SERVER_HOSTS {
            let args = s(&[
                "kv", "node", "--id", &i.to_string(), "--peers", &nodes, "--data", &bed.path(&format!("node-{i}")), "--secret-file", &bed.sf(),
                "--lease-ms", &KV_NODE_LEASE_MS.to_string(),
            ]);
            bed.spawn(i, &format!("node-{i}"), &args)?;
        }
        let cm_args = |i: usize| {
            s(&[
                "kv", "cm", "--nodes", &nodes, "--secret-file", &bed.sf(), "--store", &url, "--election-ttl-ms", &ttl.as_millis().to_string(),
                "--advertise", &format!("cm-h{i}"), "--lease-ms", &KV_NODE_LEASE_MS.to_string(),
                "--failure-timeout-ms", &KV_FAILURE_TIMEOUT_MS.to_string(), "--startup-grace-ms", &KV_FAILURE_TIMEOUT_MS.to_string(),
            ])
        };
        rt.block_on(async {
            let store = control::Store::open(&url, "kv", &kv::leaderless::driver::cluster_id_from_secret(&bed.secret)).await?;
            bed.spawn(0, "cm-0", &cm_args(0))?;
            until(READY_TIMEOUT, || format!("cm-h0 leading: {}", bed.log_tail("cm-0")), || async {
                store.observe(kv::leaderless::driver::CM_ELECTION).await.ok().flatten().as_deref() == Some("cm-h0")
            })
            .await?;
            for i in 1..SERVER_HOSTS {
                bed.spawn(i, &format!("cm-{i}"), &cm_args(i))?;
            }
            let client = kv::leaderless::driver::KvCluster::new(addrs.clone(), bed.secret.clone());
            until(READY_TIMEOUT, || "the kv group serving".to_string(), || async { client.put(b"warmup", b"1").await.is_ok() && client.get(b"warmup").await.is_ok() }).await?;
            let epoch_key = store.key("kv", "cm", "epoch");
            let node0_key = store.key("kv", "node", "00000");
            let epoch_before = store.get(&epoch_key).await?.map(|kv| kv.value).unwrap_or_default();
            // A client load through the takeover (the group serves it; its history is the kv
            // tests' concern, not timed here).
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let load_task = {
                let (client, stop) = (client.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut n = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        n += 1;
                        let k = format!("k{}", n % 16);
                        let _ = tokio::time::timeout(Duration::from_secs(1), client.put(k.as_bytes(), &n.to_le_bytes())).await;
                        let _ = tokio::time::timeout(Duration::from_secs(1), client.get(k.as_bytes())).await;
                    }
                })
            };
            tokio::time::sleep(Duration::from_millis(1000)).await;
            let load = load();
            let kill = Instant::now();
            bed.hosts.kill_host(0)?;
            let at = until(DECISION_TIMEOUT, || format!("node 0 removed by a new CM (cm-1: {})", bed.log_tail("cm-1")), || async {
                let epoch = store.get(&epoch_key).await.ok().flatten().map(|kv| kv.value);
                let n0 = store.get(&node0_key).await.ok().flatten().map(|kv| kv.value);
                epoch.is_some_and(|e| e != epoch_before) && n0.as_deref() == Some(b"removed".as_slice())
            })
            .await?;
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            load_task.await?;
            eprintln!("kv CM leader's host lost: node 0 removed after {:.0} ms; load {load}", ms(at - kill));
            Ok((at - kill, load))
        })
    })
}

// ---------------------------------------------------------------------------------------------
// nearlog: the controller's takeover, until a log file's open is granted.

fn nearlog_open(addr: &str, secret: &[u8], key: &str) -> bool {
    use nearlog::proto::{CtlReply, CtlRequest};
    let Ok(mut s) = nearlog::driver::blocking::connect(addr, secret, PROBE_ATTEMPT_TIMEOUT) else { return false };
    let _ = s.set_read_timeout(Some(PROBE_ATTEMPT_TIMEOUT));
    matches!(
        nearlog::driver::blocking::call::<_, CtlReply>(&mut s, &CtlRequest::Open { key: key.to_string(), replicas: 2 }, nearlog::proto::MAX_FRAME_BYTES),
        Ok(CtlReply::Granted(_))
    )
}

fn live_peers(addr: &str, secret: &[u8]) -> usize {
    use nearlog::proto::{CtlReply, CtlRequest};
    let Ok(mut s) = nearlog::driver::blocking::connect(addr, secret, PROBE_ATTEMPT_TIMEOUT) else { return 0 };
    let _ = s.set_read_timeout(Some(PROBE_ATTEMPT_TIMEOUT));
    match nearlog::driver::blocking::call::<_, CtlReply>(&mut s, &CtlRequest::Status, nearlog::proto::MAX_FRAME_BYTES) {
        Ok(CtlReply::Status(st)) => st.peers.values().filter(|p| p.live).count(),
        _ => 0,
    }
}

fn nearlog_controller_loss(ttl: Duration) -> anyhow::Result<(Duration, String)> {
    let mut bed = Bed::create("nlctl")?;
    let ns = bed.client_ns();
    in_namespace(&ns, move || {
        let url = bed.start_etcd()?;
        let ports = wire::ports::free_loopback_ports(2 * SERVER_HOSTS)?;
        let ctls: Vec<String> = (0..SERVER_HOSTS).map(|i| format!("{}:{}", bed.hosts.addr(i), ports[i])).collect();
        let all = ctls.join(",");
        let ctl_args = |i: usize| {
            s(&[
                "nearlog", "controller", "--listen", &ctls[i], "--store", &url, "--election-ttl-ms", &ttl.as_millis().to_string(),
                "--peer-lease-ms", &ttl.as_millis().to_string(), "--dir", &bed.path(&format!("ctl-{i}")), "--secret-file", &bed.sf(),
            ])
        };
        let wait = |what: &str, f: &dyn Fn() -> bool| -> anyhow::Result<Instant> {
            let deadline = Instant::now() + READY_TIMEOUT;
            while !f() {
                anyhow::ensure!(Instant::now() < deadline, "{what} not within {READY_TIMEOUT:?}");
                std::thread::sleep(PROBE_INTERVAL);
            }
            Ok(Instant::now())
        };
        std::fs::create_dir_all(bed.path("ctl-0"))?;
        bed.spawn(0, "ctl-0", &ctl_args(0))?;
        wait("controller 0 serving", &|| nearlog_open(&ctls[0], &bed.secret, "/bench/warmup.log") || live_peers(&ctls[0], &bed.secret) > 0 || {
            // Without peers an open is refused; a status answer is enough.
            use nearlog::proto::{CtlReply, CtlRequest};
            nearlog::driver::blocking::connect(&ctls[0], &bed.secret, PROBE_ATTEMPT_TIMEOUT)
                .ok()
                .and_then(|mut s| nearlog::driver::blocking::call::<_, CtlReply>(&mut s, &CtlRequest::Status, nearlog::proto::MAX_FRAME_BYTES).ok())
                .is_some()
        })?;
        for i in 1..SERVER_HOSTS {
            std::fs::create_dir_all(bed.path(&format!("ctl-{i}")))?;
            bed.spawn(i, &format!("ctl-{i}"), &ctl_args(i))?;
        }
        for i in 0..SERVER_HOSTS {
            let listen = format!("{}:{}", bed.hosts.addr(i), ports[SERVER_HOSTS + i]);
            let args = s(&["nearlog", "peer", "--listen", &listen, "--controller", &all, "--region-bytes", &(16u64 << 20).to_string(), "--secret-file", &bed.sf()]);
            bed.spawn(i, &format!("peer-{i}"), &args)?;
        }
        wait("three live log peers", &|| live_peers(&ctls[0], &bed.secret) == SERVER_HOSTS)?;
        anyhow::ensure!(nearlog_open(&ctls[0], &bed.secret, "/bench/before.log"), "controller 0 does not grant an open");
        let load = load();
        let kill = Instant::now();
        bed.hosts.kill_host(0)?;
        let deadline = kill + DECISION_TIMEOUT;
        let mut n = 0;
        let at = loop {
            n += 1;
            if ctls[1..].iter().any(|a| nearlog_open(a, &bed.secret, &format!("/bench/after-{n}.log"))) {
                break Instant::now();
            }
            anyhow::ensure!(Instant::now() < deadline, "no open granted by a standby within {DECISION_TIMEOUT:?}: {}", bed.log_tail("ctl-1"));
            std::thread::sleep(PROBE_INTERVAL);
        };
        eprintln!("nearlog controller leader's host lost: an open granted after {:.0} ms; load {load}", ms(at - kill));
        Ok((at - kill, load))
    })
}

// ---------------------------------------------------------------------------------------------
// On loopback: the embedded backend's restart, and super/collapse latency etcd vs embedded.

/// Every process started on this machine, killed by PID when dropped.
#[derive(Default)]
struct Local(Vec<std::process::Child>);

impl Local {
    fn spawn(&mut self, exe: &Path, dir: &Path, name: &str, args: &[String]) -> anyhow::Result<u32> {
        let log = std::fs::File::create(dir.join(format!("{name}.log")))?;
        let mut cmd = std::process::Command::new(exe);
        cmd.args(args).stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
        testbed::proc::own_group_dying_with_parent(&mut cmd, libc::SIGKILL);
        let c = cmd.spawn()?;
        let pid = c.id();
        self.0.push(c);
        Ok(pid)
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        for c in &mut self.0 {
            // Its own process group (`up` has children of its own): the whole group goes.
            // SAFETY: kill(2) on the group of a child of ours, not yet reaped.
            unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `understudy volume up` (embedded store, supervised daemons): SIGKILL its metadata service,
/// time until a create is served again.
fn embedded_restart() -> anyhow::Result<(Duration, String)> {
    let dir = tempfile::Builder::new().prefix("understudy-cbench-up-").tempdir()?;
    let exe = std::env::current_exe()?;
    let mut procs = Local::default();
    let data = dir.path().join("data");
    procs.spawn(&exe, dir.path(), "up", &s(&["volume", "up", "--dir", &data.display().to_string(), "--port-base", "0", "--shards", "3"]))?;
    let rt = runtime()?;
    rt.block_on(async {
        let file = data.join(testbed::cluster_file::CLUSTER_FILE);
        let info = {
            let deadline = Instant::now() + READY_TIMEOUT;
            loop {
                if let Ok(i) = testbed::cluster_file::ClusterInfo::load(&file) {
                    if testbed::proc::alive(i.meta.pid) {
                        break i;
                    }
                }
                anyhow::ensure!(Instant::now() < deadline, "`volume up` not ready: {}", testbed::proc::tail(&dir.path().join("up.log"), 8));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        let secret = testbed::cluster_file::read_secret(&data.join(testbed::cluster_file::SECRET_FILE))?;
        let create = |name: String| {
            let (addr, secret) = (info.meta.addr.clone(), secret.clone());
            async move {
                let attempt = async {
                    let c = Cluster::connect(&addr, &secret).await.ok()?;
                    matches!(c.meta(MetaReq::Create { name, size_bytes: 8 << 20, object_size_bytes: DEFAULT_OBJECT_SIZE_BYTES }).await, Ok(MetaResp::Volume(_))).then_some(())
                };
                matches!(tokio::time::timeout(PROBE_ATTEMPT_TIMEOUT, attempt).await, Ok(Some(())))
            }
        };
        until(READY_TIMEOUT, || "`volume up` serving a create".to_string(), || create("warmup".into())).await?;
        let load = load();
        let kill = Instant::now();
        anyhow::ensure!(testbed::proc::signal(info.meta.pid, libc::SIGKILL), "the metadata service was not running");
        let mut n = 0;
        let at = until(DECISION_TIMEOUT, || format!("a create after the restart: {}", testbed::proc::tail(&dir.path().join("up.log"), 8)), || {
            n += 1;
            create(format!("after-{n}"))
        })
        .await?;
        eprintln!("embedded: `volume up` restarted its metadata service, create served {:.0} ms after the SIGKILL; load {load}", ms(at - kill));
        Ok((at - kill, load))
    })
}

/// `NAME PID` from a supervisor's `DIR/pids`, if that daemon runs.
fn pid_of(pids: &Path, name: &str) -> Option<u32> {
    let text = std::fs::read_to_string(pids).ok()?;
    let pid = text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())?;
    testbed::proc::alive(pid).then_some(pid)
}

/// Waits until `DIR/pids` names a running `name` other than `old`.
fn wait_pid(pids: &Path, name: &str, old: Option<u32>, log: &Path) -> anyhow::Result<u32> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Some(p) = pid_of(pids, name).filter(|p| Some(*p) != old) {
            return Ok(p);
        }
        anyhow::ensure!(Instant::now() < deadline, "no running {name} in {} within {READY_TIMEOUT:?}: {}", pids.display(), testbed::proc::tail(log, 8));
        std::thread::sleep(PROBE_INTERVAL);
    }
}

/// `understudy kv up` (embedded CM state, supervised daemons): SIGKILL its CM, time until the
/// supervisor runs a new one and the group serves a put and a get through it (reads need the
/// CM's leases).
fn embedded_kv_restart() -> anyhow::Result<(Duration, String)> {
    let dir = tempfile::Builder::new().prefix("understudy-cbench-kvup-").tempdir()?;
    let exe = std::env::current_exe()?;
    let mut procs = Local::default();
    let data = dir.path().join("data");
    let up_log = dir.path().join("up.log");
    procs.spawn(&exe, dir.path(), "up", &s(&["kv", "up", "--dir", &data.display().to_string(), "--port-base", "0"]))?;
    let pids = data.join(testbed::kv::PIDS_FILE);
    let cm = wait_pid(&pids, "cm", None, &up_log)?;
    let (file, secret) = {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            match testbed::kv::load_cluster(&data.join(testbed::kv::CLUSTER_FILE)) {
                Ok(f) => break f,
                Err(e) => anyhow::ensure!(Instant::now() < deadline, "`kv up` wrote no cluster file: {e:#}: {}", testbed::proc::tail(&up_log, 8)),
            }
            std::thread::sleep(PROBE_INTERVAL);
        }
    };
    let client = kv::leaderless::driver::KvCluster::new(file.nodes.values().copied().collect(), secret);
    let rt = runtime()?;
    rt.block_on(async {
        let serves = |n: u64| {
            let client = client.clone();
            async move {
                let op = async { client.put(b"probe", &n.to_le_bytes()).await.is_ok() && client.get(b"probe").await.is_ok() };
                tokio::time::timeout(PROBE_ATTEMPT_TIMEOUT, op).await.unwrap_or(false)
            }
        };
        until(READY_TIMEOUT, || "`kv up` serving".to_string(), || serves(0)).await?;
        let load = load();
        let kill = Instant::now();
        anyhow::ensure!(testbed::proc::signal(cm, libc::SIGKILL), "the CM was not running");
        let pids2 = pids.clone();
        let log2 = up_log.clone();
        tokio::task::spawn_blocking(move || wait_pid(&pids2, "cm", Some(cm), &log2)).await??;
        let mut n = 0;
        let at = until(DECISION_TIMEOUT, || "the group serving after the CM's restart".to_string(), || {
            n += 1;
            serves(n)
        })
        .await?;
        eprintln!("embedded: `kv up` restarted its CM, put+get served {:.0} ms after the SIGKILL; load {load}", ms(at - kill));
        Ok((at - kill, load))
    })
}

/// `understudy nearlog up` (controller and peers as supervised processes): SIGKILL the
/// controller, time until a log file's open is granted again.
fn embedded_nearlog_restart() -> anyhow::Result<(Duration, String)> {
    let dir = tempfile::Builder::new().prefix("understudy-cbench-nlup-").tempdir()?;
    let exe = std::env::current_exe()?;
    let mut procs = Local::default();
    let data = dir.path().join("data");
    let up_log = dir.path().join("up.log");
    procs.spawn(&exe, dir.path(), "up", &s(&["nearlog", "up", "--dir", &data.display().to_string(), "--region-bytes", &(16u64 << 20).to_string()]))?;
    let pids = data.join("pids");
    let ctl = wait_pid(&pids, "controller", None, &up_log)?;
    let (addr, secret) = {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let f: Option<serde_json::Value> = std::fs::read(data.join("nearlog-cluster.json")).ok().and_then(|b| serde_json::from_slice(&b).ok());
            if let Some(addr) = f.as_ref().and_then(|f| f["controller"].as_str()) {
                break (addr.to_string(), testbed::cluster_file::read_secret(&data.join("secret"))?);
            }
            anyhow::ensure!(Instant::now() < deadline, "`nearlog up` wrote no cluster file: {}", testbed::proc::tail(&up_log, 8));
            std::thread::sleep(PROBE_INTERVAL);
        }
    };
    let deadline = Instant::now() + READY_TIMEOUT;
    while !nearlog_open(&addr, &secret, "/bench/before.log") {
        anyhow::ensure!(Instant::now() < deadline, "`nearlog up` grants no open: {}", testbed::proc::tail(&up_log, 8));
        std::thread::sleep(PROBE_INTERVAL);
    }
    let load = load();
    let kill = Instant::now();
    anyhow::ensure!(testbed::proc::signal(ctl, libc::SIGKILL), "the controller was not running");
    let mut n = 0;
    let at = loop {
        n += 1;
        if nearlog_open(&addr, &secret, &format!("/bench/after-{n}.log")) {
            break Instant::now();
        }
        anyhow::ensure!(kill.elapsed() < DECISION_TIMEOUT, "no open granted after the controller's restart: {}", testbed::proc::tail(&up_log, 8));
        std::thread::sleep(PROBE_INTERVAL);
    };
    eprintln!("embedded: `nearlog up` restarted its controller, an open granted {:.0} ms after the SIGKILL; load {load}", ms(at - kill));
    Ok((at - kill, load))
}

/// Super and collapse latency, microseconds, per variant: `etcd` (a 3-member etcd on loopback,
/// metadata service `--store etcd://`) and `embedded` (`--dir`), each with three shards, the
/// two clusters side by side and their requests interleaved A B A B (order flipped each round).
fn latency(pairs: usize) -> anyhow::Result<(BTreeMap<&'static str, (Vec<f64>, Vec<f64>)>, String)> {
    let dir = tempfile::Builder::new().prefix("understudy-cbench-lat-").tempdir()?;
    let exe = std::env::current_exe()?;
    let secret = format!("cbench-lat-{:x}", rand::random::<u64>()).into_bytes();
    let sf = dir.path().join("secret");
    std::fs::write(&sf, &secret)?;
    std::fs::set_permissions(&sf, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    let sf = sf.display().to_string();
    let etcd = EtcdCluster::start(3)?;
    let mut procs = Local::default();
    let ports = wire::ports::free_loopback_ports(8)?;
    let mut metas = BTreeMap::new();
    for (v, variant) in ["etcd", "embedded"].into_iter().enumerate() {
        let meta = format!("127.0.0.1:{}", ports[4 * v]);
        let mut args = s(&["volume", "meta", "--listen", &meta, "--secret-file", &sf, "--replicas", "2"]);
        if variant == "etcd" {
            args.extend(s(&["--store", &etcd.url(), "--election-ttl-ms", &DEFAULT_ELECTION_TTL_MS.to_string()]));
        } else {
            args.extend(s(&["--dir", &dir.path().join("meta-embedded").display().to_string()]));
        }
        procs.spawn(&exe, dir.path(), &format!("meta-{variant}"), &args)?;
        for i in 0..3 {
            let listen = format!("127.0.0.1:{}", ports[4 * v + 1 + i]);
            let d = dir.path().join(format!("shard-{variant}-{i}")).display().to_string();
            procs.spawn(&exe, dir.path(), &format!("shard-{variant}-{i}"), &s(&["volume", "shard", "--id", &i.to_string(), "--dir", &d, "--listen", &listen, "--meta", &meta, "--secret-file", &sf, "--create"]))?;
        }
        metas.insert(variant, meta);
    }
    let rt = runtime()?;
    let out = rt.block_on(async {
        let mut clusters = BTreeMap::new();
        for (variant, meta) in &metas {
            let deadline = Instant::now() + READY_TIMEOUT;
            let c = loop {
                if let Ok(c) = Cluster::connect(meta, &secret).await {
                    if matches!(c.meta(MetaReq::GetMap).await, Ok(MetaResp::Map(m)) if m.shards.len() == 3 && m.shards.iter().all(|s| s.state == volume::types::ShardState::Up)) {
                        break c;
                    }
                }
                anyhow::ensure!(Instant::now() < deadline, "the {variant} cluster not ready: {}", testbed::proc::tail(&dir.path().join(format!("meta-{variant}.log")), 8));
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            clusters.insert(*variant, c);
        }
        let load = load();
        let mut samples: BTreeMap<&'static str, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
        for round in 0..pairs {
            let order: Vec<&'static str> = if round % 2 == 0 { vec!["etcd", "embedded"] } else { vec!["embedded", "etcd"] };
            for variant in order {
                let c = &clusters[variant];
                let (p, ch) = (format!("p{round}"), format!("p{round}-c"));
                c.meta(MetaReq::Create { name: p.clone(), size_bytes: 8 << 20, object_size_bytes: DEFAULT_OBJECT_SIZE_BYTES }).await?;
                let vol = c.open(&p).await?;
                vol.write(0, block(round as u64 + 1)).await?;
                let t = Instant::now();
                let r = c.meta(MetaReq::Super { parent: p.clone(), child: ch.clone() }).await?;
                let sup = t.elapsed();
                anyhow::ensure!(matches!(r, MetaResp::Volume(_)), "super on {variant}: {r:?}");
                drop(vol);
                let child = c.open(&ch).await?;
                child.write(WRITE_BLOCK_BYTES, block(round as u64 + 2)).await?;
                drop(child);
                let t = Instant::now();
                let r = c.collapse(&ch, Duration::from_secs(30)).await?;
                let col = t.elapsed();
                anyhow::ensure!(matches!(r, MetaResp::Collapsed { .. }), "collapse on {variant}: {r:?}");
                let e = samples.entry(variant).or_default();
                e.0.push(sup.as_secs_f64() * 1e6);
                e.1.push(col.as_secs_f64() * 1e6);
            }
        }
        Ok((samples, load))
    });
    drop(procs);
    drop(etcd);
    out
}

// ---------------------------------------------------------------------------------------------

/// `understudy bench control failover`.
pub fn failover_main(a: FailoverArgs) -> anyhow::Result<bench::Report> {
    let out = bench::out_dir("control", a.out.clone())?;
    let reps = a.reps.unwrap_or(if a.quick { REPS_QUICK } else { REPS_FULL });
    anyhow::ensure!(reps >= 1, "--reps must be at least 1");
    anyhow::ensure!(a.election_ttl_ms >= 1000, "--election-ttl-ms must be at least 1000 (etcd leases are whole seconds)");
    let ttl = Duration::from_millis(a.election_ttl_ms);
    let want = |p: Part| a.only.is_empty() || a.only.contains(&p);
    let mut report = bench::Report::new("control.failover", a.quick);
    // Runs that failed: the others are measured all the same.
    let mut failures: Vec<String> = vec![];
    report.figure("lease_ttl_ms", ms(ttl))?;
    let mut csv: Vec<Vec<String>> = vec![];
    let mut row = |part: &str, rep: usize, what: &str, v: f64, load: &str| csv.push(vec![part.into(), rep.to_string(), what.into(), format!("{v:.1}"), load.into()]);

    // Host losses and shard deaths interleaved, one fresh bed each.
    let (mut decisions, mut stalls, mut shard_stalls, mut lost, mut unreadable) = (vec![], vec![], vec![], 0u64, 0u64);
    // Losses after which the writer got no acknowledgement within DECISION_TIMEOUT.
    let mut stuck: BTreeMap<&str, u64> = BTreeMap::new();
    let mut timelines: Vec<bench::Series> = vec![];
    for rep in 0..reps {
        for (part, host_loss) in [(Part::Meta, true), (Part::Shard, false)] {
            if !want(part) {
                continue;
            }
            eprintln!("{} {}/{reps}", if host_loss { "metadata leader's host loss" } else { "shard process kill" }, rep + 1);
            let r = match volume_loss(ttl, host_loss, &out.join(format!("stuck-{}-rep{rep}", if host_loss { "host_loss" } else { "shard_kill" }))) {
                Ok(r) => r,
                Err(e) => {
                    failed(&mut failures, &format!("{part:?} repetition {rep}"), e);
                    continue;
                }
            };
            lost += r.lost_writes;
            unreadable += r.unreadable_writes;
            if let Some(d) = r.decision {
                decisions.push(ms(d));
                row("meta", rep, "decision_ms", ms(d), &r.load);
            }
            let part_name = if host_loss { "meta" } else { "shard" };
            match r.stall {
                Some(st) => {
                    if host_loss { &mut stalls } else { &mut shard_stalls }.push(ms(st));
                    row(part_name, rep, "io_stall_ms", ms(st), &r.load);
                }
                None => {
                    *stuck.entry(part_name).or_default() += 1;
                    row(part_name, rep, "writer_stuck", 1.0, &r.load);
                }
            }
            row(if host_loss { "meta" } else { "shard" }, rep, "acked_writes", r.acked as f64, &r.load);
            if rep == 0 {
                // Acknowledged writes per 100 ms, around the kill.
                let mut bins: BTreeMap<i64, f64> = BTreeMap::new();
                for t in &r.timeline {
                    *bins.entry((t * 10.0).floor() as i64).or_default() += 1.0;
                }
                let (lo, hi) = (bins.keys().next().copied().unwrap_or(0), (r.observed_s * 10.0).floor() as i64);
                let points = (lo..=hi).map(|b| (b as f64 / 10.0, bins.get(&b).copied().unwrap_or(0.0) * 10.0)).collect();
                timelines.push(bench::Series { name: if host_loss { "metadata leader's host lost".into() } else { "shard process killed".into() }, points });
                bench::write_csv(
                    &out.join(format!("writer_timeline_{}.csv", if host_loss { "host_loss" } else { "shard_kill" })),
                    &["ack_s_since_kill"],
                    r.timeline.iter().map(|t| vec![format!("{t:.4}")]),
                )?;
            }
        }
    }
    if !decisions.is_empty() {
        let med = figure_spread(&mut report, "takeover.meta.decision_ms", &decisions)?;
        report.ratio("takeover_vs_lease_ttl.meta", med, ms(ttl))?;
    }
    // A stall that never ended has no length: the count of such losses stands beside the
    // median of those that ended, and the figure is absent when none ended.
    if !stalls.is_empty() {
        let stall = figure_spread(&mut report, "volume.host_loss.io_stall.gap_ms", &stalls)?;
        report.figure("volume.host_loss.io_stall_ms", stall)?;
    }
    if !shard_stalls.is_empty() {
        let med = figure_spread(&mut report, "volume.shard_failover.io_stall.gap_ms", &shard_stalls)?;
        report.figure("volume.shard_failover_ms", med)?;
    }
    if want(Part::Meta) {
        report.figure("volume.host_loss.writer_stuck_count", stuck.get("meta").copied().unwrap_or(0) as f64)?;
    }
    if want(Part::Shard) {
        report.figure("volume.shard_failover.writer_stuck_count", stuck.get("shard").copied().unwrap_or(0) as f64)?;
    }
    if want(Part::Meta) || want(Part::Shard) {
        report.figure("volume.lost_writes_count", lost as f64)?;
        report.figure("volume.unreadable_writes_count", unreadable as f64)?;
    }
    if !timelines.is_empty() {
        bench::line_plot(
            &out.join("writer_timeline"),
            "Acknowledged writes of an open volume's writer around the loss",
            "seconds since the kill",
            "acknowledged writes per second (100 ms bins)",
            &timelines,
            bench::Scale::Linear,
        )?;
    }

    for (part, name) in [(Part::KvCm, "kv_cm"), (Part::NearlogController, "nearlog_controller")] {
        if !want(part) {
            continue;
        }
        let mut v = vec![];
        for rep in 0..reps {
            eprintln!("{name} leader's host loss {}/{reps}", rep + 1);
            let (d, load) = match if part == Part::KvCm { kv_cm_loss(ttl) } else { nearlog_controller_loss(ttl) } {
                Ok(x) => x,
                Err(e) => {
                    failed(&mut failures, &format!("{name} repetition {rep}"), e);
                    continue;
                }
            };
            v.push(ms(d));
            row(name, rep, "decision_ms", ms(d), &load);
        }
        if !v.is_empty() {
            let med = figure_spread(&mut report, &format!("takeover.{name}.decision_ms"), &v)?;
            report.ratio(&format!("takeover_vs_lease_ttl.{name}"), med, ms(ttl))?;
        }
    }

    if want(Part::Embedded) {
        type Restart = fn() -> anyhow::Result<(Duration, String)>;
        let kinds: [(&str, &str, Restart); 3] = [
            ("meta", "volume up", embedded_restart),
            ("kv_cm", "kv up", embedded_kv_restart),
            ("nearlog_controller", "nearlog up", embedded_nearlog_restart),
        ];
        for (name, up, f) in kinds {
            let mut v = vec![];
            for rep in 0..reps {
                eprintln!("embedded restart under `{up}` {}/{reps}", rep + 1);
                let (d, load) = match f() {
                    Ok(x) => x,
                    Err(e) => {
                        failed(&mut failures, &format!("embedded {name} repetition {rep}"), e);
                        continue;
                    }
                };
                v.push(ms(d));
                row(&format!("embedded_{name}"), rep, "restart_ms", ms(d), &load);
            }
            if !v.is_empty() {
                figure_spread(&mut report, &format!("embedded.{name}.restart_ms"), &v)?;
            }
        }
    }

    if want(Part::Latency) {
        let pairs = if a.quick { LATENCY_PAIRS_QUICK } else { LATENCY_PAIRS_FULL };
        eprintln!("super and collapse latency, etcd vs embedded, {pairs} rounds interleaved");
        let (samples, load) = match latency(pairs) {
            Ok(x) => x,
            Err(e) => {
                failed(&mut failures, "latency", e);
                (BTreeMap::new(), String::new())
            }
        };
        let mut p50 = BTreeMap::new();
        for (variant, (sup, col)) in &samples {
            for (op, v) in [("super", sup), ("collapse", col)] {
                let med = figure_spread(&mut report, &format!("{variant}.{op}.latency_us"), v)?;
                p50.insert((*variant, op), med);
                for (i, x) in v.iter().enumerate() {
                    row(&format!("{variant}_{op}"), i, "latency_us", *x, &load);
                }
            }
        }
        for op in ["super", "collapse"] {
            if let (Some(e), Some(b)) = (p50.get(&("etcd", op)), p50.get(&("embedded", op))) {
                report.ratio(&format!("etcd_vs_embedded.{op}_latency"), *e, *b)?;
            }
        }
    }

    if want(Part::NearlogPeer) {
        csv.extend(nearlog_peer::measure(reps, &mut report, &mut failures)?);
    }
    csv.extend(failover_monitor::measure(reps, ttl, want(Part::FailoverHost), want(Part::FailoverMonitor), &mut report, &mut failures)?);
    bench::write_csv(&out.join("samples.csv"), &["part", "rep", "what", "value", "loadavg"], csv)?;
    eprintln!("plots and samples in {}", out.display());
    if !failures.is_empty() {
        // What was measured is kept (the report is stdout's last line all the same); the run
        // still fails, naming every run that did.
        report.figure("failed_runs_count", failures.len() as f64)?;
        report.print();
        bail!("{} run(s) failed: {}", failures.len(), failures.join("; "));
    }
    Ok(report)
}

/// Notes a failed run: said on stderr now, and failing the benchmark at its end.
fn failed(failures: &mut Vec<String>, what: &str, e: anyhow::Error) {
    eprintln!("{what} failed: {e:#}");
    failures.push(format!("{what}: {e:#}"));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_is_median_min_max() {
        assert_eq!(spread(&[3.0, 1.0, 2.0]), (2.0, 1.0, 3.0));
        assert_eq!(spread(&[4.0, 1.0, 2.0, 3.0]), (2.5, 1.0, 4.0));
        assert_eq!(spread(&[7.0]), (7.0, 7.0, 7.0));
    }

    #[test]
    fn the_longest_gap_is_the_one_across_the_kill() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // A long gap before the kill does not count; the one spanning it does.
        let acks = [at(0), at(900), at(1000), at(1010), at(1500), at(1510)];
        assert_eq!(longest_gap_after(&acks, at(1005)), Duration::from_millis(490));
        assert_eq!(longest_gap_after(&acks, at(2000)), Duration::ZERO);
    }
}
