//! A local leaderless KV group (HEAL): the nodes and the configuration manager as child
//! processes of this one, restarted when they exit if asked to; what `understudy kv up` runs and
//! what the KV benchmarks start.
//!
//! Layout of DIR: `secret`, `kv-cluster.json`, `pids`, `cm/`, `node-N/`, `logs/{cm,node-N}.log`.
//! The group's options ([`UpArgs`]) are a clap definition here because both `kv up` and the
//! benchmarks' pass-through node arguments (`--kv-arg`) parse them.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};

use ::kv::leaderless::driver::KvClusterFile;
use ::kv::Model;

use crate::cluster_file;
use crate::proc;
use crate::supervise::{Input, Output, RestartCore, RestartPolicy, State, RESTART_BACKOFF_FIRST};

pub const CLUSTER_FILE: &str = "kv-cluster.json";
pub const PIDS_FILE: &str = "pids";
pub const DEFAULT_DIR: &str = "understudy-kv";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Recovery {
    /// HEAL online incremental recovery.
    Heal,
    /// Baseline (Hermes-style): the returning node drops its log, as a new node replacing the
    /// failed one, and the recoverer streams it the whole store, all made durable.
    FullCopy,
    /// Baseline (ZooKeeper-style): a peer reads its durable log from the returning node's last
    /// configuration and streams every update since, redundant ones included; the returning
    /// node makes every one durable.
    ReactiveLog,
    /// Witness KV (its default; `heal` means this there): CANDStore's live recovery.
    Cand,
    /// Witness KV baseline: the same detection and election, then an unthrottled copy, serving
    /// nothing until it is done.
    Offline,
    /// Witness KV ablation: no PriorityPull (a Get on a missing key waits for the BatchPull).
    BatchOnly,
    /// Witness KV ablation: no pull before the election.
    NoProactive,
    /// Witness KV ablation: one SSD log on the backups instead of hot and cold.
    SingleLog,
    /// Witness KV ablation: no popularity sampling (BatchPull in log order).
    NoSampling,
    /// Witness KV baseline for the cost side: witnesses keep values too.
    FullReplica,
}

impl Recovery {
    /// The value of `--recovery` that selects this scheme.
    pub fn name(self) -> &'static str {
        match self {
            Recovery::Heal => "heal",
            Recovery::FullCopy => "full-copy",
            Recovery::ReactiveLog => "reactive-log",
            Recovery::Cand => "cand",
            Recovery::Offline => "offline",
            Recovery::BatchOnly => "batch-only",
            Recovery::NoProactive => "no-proactive",
            Recovery::SingleLog => "single-log",
            Recovery::NoSampling => "no-sampling",
            Recovery::FullReplica => "full-replica",
        }
    }

    /// The witness KV's scheme for this choice (`heal`, the flag's default, means `cand`).
    pub fn witness(self) -> anyhow::Result<kv::witness::core::node::Recovery> {
        use kv::witness::core::node::Recovery as W;
        match self {
            Recovery::Heal | Recovery::Cand => Ok(W::Cand),
            Recovery::Offline => Ok(W::Offline),
            Recovery::BatchOnly => Ok(W::BatchOnly),
            Recovery::NoProactive => Ok(W::NoProactive),
            Recovery::SingleLog => Ok(W::SingleLog),
            Recovery::NoSampling => Ok(W::NoSampling),
            Recovery::FullReplica => Ok(W::FullReplica),
            Recovery::FullCopy | Recovery::ReactiveLog => anyhow::bail!(
                "--recovery {} is a leaderless-KV scheme; the witness KV takes cand, offline, batch-only, no-proactive, single-log, no-sampling or full-replica",
                self.name()
            ),
        }
    }

    /// Whether this is a leaderless-KV (HEAL) scheme.
    pub fn is_leaderless(self) -> bool {
        matches!(self, Recovery::Heal | Recovery::FullCopy | Recovery::ReactiveLog)
    }
}

/// Node `i`'s events file in group directory `dir` (see `kv node --events`).
pub fn events_path(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("logs/node-{i}.events"))
}

pub fn parse_model(s: &str) -> Result<Model, String> {
    s.parse()
}

/// The replication protocol of a local group (`kv up --protocol`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum UpProtocol {
    /// HEAL: N leaderless nodes and a CM.
    Leaderless,
    /// CANDStore's witness KV: a primary, --backups backups and --witnesses witnesses (see
    /// `testbed::kv_witness`); --nodes and the HEAL options do not apply.
    Witness,
}

#[derive(Args, Debug)]
pub struct UpArgs {
    /// Data directory of the whole group.
    #[arg(long, default_value = DEFAULT_DIR, value_name = "DIR")]
    pub dir: PathBuf,
    /// The replication protocol.
    #[arg(long, value_enum, default_value = "leaderless")]
    pub protocol: UpProtocol,
    /// Witness KV: backups (NVMM buffer + SSD log each).
    #[arg(long, default_value_t = 1)]
    pub backups: u32,
    /// Witness KV: witnesses (keys and timestamps only; one takes over when the primary fails).
    #[arg(long, default_value_t = 1)]
    pub witnesses: u32,
    /// Witness KV: spare witnesses, started idle; the leader adds one in place of a witness
    /// (or the primary) lost for longer than the loss bound, so fault tolerance comes back
    /// without an operator.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub spares: u32,
    /// Witness KV: spare backups (added in place of a lost backup, after a witness stood in).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub spare_backups: u32,
    /// Witness KV: passed to every node as --soft-timeout-ms (0: no pulling before the election).
    #[arg(long, value_name = "MS")]
    pub soft_timeout_ms: Option<u64>,
    /// Witness KV: passed to every node as --sample-probability.
    #[arg(long, value_name = "P")]
    pub sample_probability: Option<f64>,
    /// Nodes in the replication group (3, 4 or 5 in the paper).
    #[arg(long, default_value_t = 5)]
    pub nodes: u32,
    #[arg(long, default_value = "synch", value_parser = parse_model)]
    pub model: Model,
    /// Nodes listen on PORT_BASE.. (0: free ports chosen at start, kept in DIR/kv-cluster.json).
    #[arg(long, default_value_t = 7800)]
    pub port_base: u16,
    /// Restart a node that exited after this long (0: leave it down).
    #[arg(long, default_value_t = 1000)]
    pub restart_after_ms: u64,
    /// Extra latency per durable append (microseconds), passed to every node.
    #[arg(long, default_value_t = 0)]
    pub persist_latency_us: u64,
    /// Minimum EFN before a returning node is re-added (passed to the CM).
    #[arg(long, default_value_t = 0)]
    pub efn_ms: u64,
    /// Missed_updates cap per node.
    #[arg(long, default_value_t = 256 << 20)]
    pub missed_updates_cap_bytes: usize,
    /// Recovery catch-up window, in chunks: credited to the Buddy plus received and still
    /// persisting (1: strictly one chunk at a time; at most 64).
    #[arg(long, default_value_t = 16)]
    pub catchup_chunks_in_flight: usize,
    /// Recovery scheme: heal or a baseline for the leaderless KV; for --protocol witness cand
    /// (what heal means there), offline or an ablation, passed to every node.
    #[arg(long, value_enum, default_value = "heal")]
    pub recovery: Recovery,
    /// Failure detection timeout passed to the CM (raise it on a loaded machine).
    #[arg(long, default_value_t = 500)]
    pub failure_timeout_ms: u64,
    /// Read lease passed to the CM and every node (below --failure-timeout-ms).
    #[arg(long, default_value_t = 300)]
    pub lease_ms: u64,
    /// Startup grace passed to the CM (raise it for large stores: nodes read their logs first).
    #[arg(long, default_value_t = 30_000)]
    pub startup_grace_ms: u64,
}

pub fn load_cluster(path: &Path) -> anyhow::Result<(KvClusterFile, Vec<u8>)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read {} (start a group with `understudy kv up`, or pass --cluster)", path.display()))?;
    let f: KvClusterFile = serde_json::from_str(&text).with_context(|| format!("{} is not a kv cluster file", path.display()))?;
    let secret = cluster_file::read_secret(&f.secret_file)?;
    Ok((f, secret))
}

/// A local group of child processes (what `kv up` runs; also used by the benchmark).
pub struct LocalKv {
    pub dir: PathBuf,
    pub file: KvClusterFile,
    pub secret: Vec<u8>,
    node_args: Vec<Vec<String>>,
    cm_args: Vec<String>,
    pub children: Vec<(String, Option<Child>)>,
    /// Restart decisions of [`LocalKv::supervise`]: the nodes' (backoff from its
    /// `restart_after`) and the CM's (from [`RESTART_BACKOFF_FIRST`]: the nodes stop serving a
    /// lease after the CM is gone, so it comes back first), made on its first call.
    restarts: Option<(RestartCore, RestartCore)>,
    /// Each node's metrics endpoint (free loopback ports chosen at start).
    pub metrics: Vec<Option<SocketAddr>>,
}

impl LocalKv {
    pub fn start(a: &UpArgs) -> anyhow::Result<LocalKv> {
        anyhow::ensure!((2..=16).contains(&a.nodes), "--nodes must be between 2 and 16");
        anyhow::ensure!(a.lease_ms < a.failure_timeout_ms, "--lease-ms must be below --failure-timeout-ms");
        let dir = a.dir.clone();
        std::fs::create_dir_all(dir.join("logs")).with_context(|| format!("cannot create {}", dir.display()))?;
        let secret_file = dir.join("secret");
        cluster_file::ensure_secret(&secret_file)?;
        let secret = cluster_file::read_secret(&secret_file)?;
        let cf = dir.join(CLUSTER_FILE);
        // Reuse the ports of an earlier run on the same DIR.
        let nodes: BTreeMap<u32, SocketAddr> = match load_cluster(&cf) {
            Ok((f, _)) if f.nodes.len() == a.nodes as usize => f.nodes,
            _ => {
                let ports: Vec<u16> = if a.port_base == 0 {
                    // Below the ephemeral range: a port from bind(:0) was taken by an unrelated
                    // outgoing connection before the node bound it (a node that never served).
                    wire::ports::free_loopback_ports(a.nodes as usize)?
                } else {
                    (0..a.nodes as u16).map(|i| a.port_base + i).collect()
                };
                (0..a.nodes).map(|i| (i, SocketAddr::from(([127, 0, 0, 1], ports[i as usize])))).collect()
            }
        };
        let file = KvClusterFile { model: a.model.to_string(), nodes: nodes.clone(), secret_file: secret_file.canonicalize()? };
        let tmp = cf.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_string_pretty(&file)?)?;
        std::fs::rename(&tmp, &cf)?;
        let peers: String = nodes.iter().map(|(i, a)| format!("{i}={a}")).collect::<Vec<_>>().join(",");
        let sf = secret_file.to_string_lossy().into_owned();
        let cm_args = vec![
            "kv".into(), "cm".into(), "--nodes".into(), peers.clone(),
            "--data".into(), dir.join("cm").to_string_lossy().into_owned(),
            "--secret-file".into(), sf.clone(), "--efn-ms".into(), a.efn_ms.to_string(),
            "--failure-timeout-ms".into(), a.failure_timeout_ms.to_string(),
            "--lease-ms".into(), a.lease_ms.to_string(),
            "--startup-grace-ms".into(), a.startup_grace_ms.to_string(),
        ];
        let metrics: Vec<Option<SocketAddr>> =
            wire::ports::free_loopback_ports(a.nodes as usize)?.into_iter().map(|p| Some(SocketAddr::from(([127, 0, 0, 1], p)))).collect();
        let node_args: Vec<Vec<String>> = (0..a.nodes)
            .map(|i| {
                let mut v: Vec<String> = vec![
                    "kv".into(), "node".into(), "--protocol".into(), "leaderless".into(),
                    "--id".into(), i.to_string(), "--peers".into(), peers.clone(),
                    "--data".into(), dir.join(format!("node-{i}")).to_string_lossy().into_owned(),
                    "--secret-file".into(), sf.clone(), "--model".into(), a.model.name().into(),
                    "--persist-latency-us".into(), a.persist_latency_us.to_string(),
                    "--missed-updates-cap-bytes".into(), a.missed_updates_cap_bytes.to_string(),
                    "--catchup-chunks-in-flight".into(), a.catchup_chunks_in_flight.to_string(),
                    "--recovery".into(), a.recovery.name().into(),
                    "--lease-ms".into(), a.lease_ms.to_string(),
                ];
                if let Some(m) = metrics[i as usize] {
                    v.extend(["--metrics".into(), m.to_string()]);
                }
                v.extend(["--events".into(), events_path(&dir, i as usize).to_string_lossy().into_owned()]);
                v
            })
            .collect();
        let mut me = LocalKv {
            dir: dir.clone(),
            file,
            secret,
            node_args,
            cm_args,
            children: Vec::new(),
            restarts: None,
            metrics,
        };
        for i in 0..a.nodes as usize {
            let c = me.spawn_node(i)?;
            me.children.push((format!("node-{i}"), Some(c)));
        }
        let cm = proc::spawn_self(&me.cm_args, &dir.join("logs/cm.log"), &[])?;
        me.children.push(("cm".into(), Some(cm)));
        me.write_pids()?;
        Ok(me)
    }

    /// Restarts node `i` now if it is not running.
    pub fn restart_node(&mut self, i: usize) -> anyhow::Result<()> {
        if let Some(c) = &mut self.children[i].1 {
            if let Ok(None) = c.try_wait() {
                return Ok(());
            }
        }
        let c = self.spawn_node(i)?;
        self.children[i].1 = Some(c);
        self.write_pids()
    }

    /// Kills node `i` with SIGKILL and reaps it.
    pub fn kill9(&mut self, i: usize) -> anyhow::Result<()> {
        if let Some(mut c) = self.children[i].1.take() {
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }

    pub fn pid(&self, i: usize) -> Option<u32> {
        self.children[i].1.as_ref().map(|c| c.id())
    }

    fn spawn_node(&self, i: usize) -> anyhow::Result<Child> {
        proc::spawn_self(&self.node_args[i], &self.dir.join(format!("logs/node-{i}.log")), &[])
    }

    pub fn write_pids(&self) -> anyhow::Result<()> {
        let text: String = self
            .children
            .iter()
            .filter_map(|(n, c)| c.as_ref().map(|c| format!("{n} {}\n", c.id())))
            .collect();
        let p = self.dir.join(PIDS_FILE);
        std::fs::write(p.with_extension("tmp"), text)?;
        std::fs::rename(p.with_extension("tmp"), p)?;
        Ok(())
    }

    /// Reaps exited daemons and starts them again on their data: a node after `restart_after`
    /// (None: left down), doubled for each further exit within a minute, the CM after
    /// [`RESTART_BACKOFF_FIRST`]; one that exits a 6th time within a minute is given up
    /// ([`LocalKv::gave_up`]). Returns one note per exit, restart or giving up.
    pub fn supervise(&mut self, restart_after: Option<Duration>) -> anyhow::Result<Vec<String>> {
        let n = self.node_args.len();
        let (mut nodes, mut cm) = self.restarts.take().unwrap_or_else(|| {
            let node_policy = RestartPolicy { backoff_first: restart_after.unwrap_or(RESTART_BACKOFF_FIRST), ..Default::default() };
            (RestartCore::new(node_policy, n), RestartCore::new(RestartPolicy::default(), 1))
        });
        let notes = self.supervise_with(&mut nodes, &mut cm, restart_after);
        self.restarts = Some((nodes, cm));
        notes
    }

    fn supervise_with(&mut self, nodes: &mut RestartCore, cm: &mut RestartCore, restart_after: Option<Duration>) -> anyhow::Result<Vec<String>> {
        let n = self.node_args.len();
        let now = Instant::now();
        let mut notes = Vec::new();
        for i in 0..=n {
            let Some(c) = &mut self.children[i].1 else { continue };
            let Ok(Some(st)) = c.try_wait() else { continue };
            self.children[i].1 = None;
            let what = self.children[i].0.clone();
            let log = log_of(&self.dir, n, i);
            let reason = proc::last_error(&log);
            let (core, k) = if i < n { (&mut *nodes, i) } else { (&mut *cm, 0) };
            if i < n && restart_after.is_none() {
                notes.push(format!("{what} exited ({}): {reason}; left down", proc::describe_status(st)));
                continue;
            }
            core.handle(now, Input::Exited(k));
            match core.state(k) {
                State::RestartAt(t) => notes.push(format!(
                    "{what} exited ({}): {reason}; restarting it on its durable state in {} ms",
                    proc::describe_status(st),
                    t.saturating_duration_since(now).as_millis()
                )),
                _ => notes.push(format!(
                    "{what} keeps failing ({} exits within {} s), last: {reason}; not restarting it again (log: {})",
                    core.exits_in_window(k),
                    core.policy().window.as_secs(),
                    log.display()
                )),
            }
            core.take_outputs();
        }
        let mut due = vec![];
        for (core, base) in [(&mut *nodes, 0), (&mut *cm, n)] {
            core.handle(now, Input::Tick);
            due.extend(core.take_outputs().into_iter().filter_map(|o| match o {
                Output::Restart(k) => Some(base + k),
                Output::GaveUp { .. } => None,
            }));
        }
        for i in due {
            let started = if i < n { self.spawn_node(i) } else { proc::spawn_self(&self.cm_args, &self.log_of(i), &[]) };
            match started {
                Ok(c) => {
                    notes.push(format!("{} restarted (pid {})", self.children[i].0, c.id()));
                    self.children[i].1 = Some(c);
                    self.write_pids()?;
                }
                // Counted as an exit: retried after the next backoff, given up if it persists.
                Err(e) => {
                    let (core, k) = if i < n { (&mut *nodes, i) } else { (&mut *cm, 0) };
                    core.handle(now, Input::Exited(k));
                    core.take_outputs();
                    notes.push(format!("{} could not be started again: {e:#}", self.children[i].0));
                }
            }
        }
        Ok(notes)
    }

    /// Whether a daemon kept failing and was given up on (`kv up` then stops, non-zero).
    pub fn gave_up(&self) -> bool {
        let Some((nodes, cm)) = &self.restarts else { return false };
        (0..self.node_args.len()).any(|i| nodes.state(i) == State::GaveUp) || cm.state(0) == State::GaveUp
    }

    /// The log file of daemon `i` (nodes, then the CM).
    fn log_of(&self, i: usize) -> PathBuf {
        log_of(&self.dir, self.node_args.len(), i)
    }

    pub fn stop(&mut self) {
        let mut live: Vec<(String, Child)> =
            self.children.iter_mut().filter_map(|(n, c)| c.take().map(|c| (n.clone(), c))).collect();
        proc::stop_children(&mut live, Duration::from_secs(5));
    }
}

/// The log file of daemon `i` of a group of `nodes` nodes in `dir` (nodes, then the CM).
fn log_of(dir: &Path, nodes: usize, i: usize) -> PathBuf {
    if i < nodes {
        dir.join(format!("logs/node-{i}.log"))
    } else {
        dir.join("logs/cm.log")
    }
}

impl Drop for LocalKv {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Waits until every node serves a read itself (all nodes active, none recovering).
pub async fn wait_all_serving(file: &KvClusterFile, secret: &[u8], timeout: Duration) -> anyhow::Result<Duration> {
    use ::kv::leaderless::proto::{ClientOp, ClientResult};
    let start = Instant::now();
    for addr in file.nodes.values() {
        loop {
            let ok = match ::kv::leaderless::driver::KvClient::connect(*addr, secret).await {
                Ok(c) => matches!(c.call(ClientOp::Get { key: b"__understudy_ready".to_vec() }).await, Ok(ClientResult::Value(_))),
                Err(_) => false,
            };
            if ok {
                break;
            }
            if start.elapsed() > timeout {
                bail!("node {addr} did not start serving within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(start.elapsed())
}
