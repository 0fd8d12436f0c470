//! `understudy kv ...`: the leaderless replicated KV store with HEAL recovery (crate `kv`).
//!
//! * `kv node --protocol leaderless`: one replica (a process per node);
//! * `kv cm`: the configuration manager (a separate process: it dials every node, sends
//!   heartbeats with the configuration, removes silent nodes and re-adds returning ones);
//! * `kv up`: CM + N nodes on loopback as child processes, in the foreground; a node that dies
//!   is restarted on its durable log after `--restart-after-ms` and comes back through HEAL;
//! * `kv get` / `kv put`: a client, finding the group through `kv-cluster.json`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Subcommand, ValueEnum};

use ::kv::cm::CmParams;
use ::kv::node::NodeParams;
use ::kv::runtime::{CmConfig, KvCluster, KvClusterFile, NodeConfig};
use ::kv::Model;

use crate::cluster_file;
use crate::proc;

pub const CLUSTER_FILE: &str = "kv-cluster.json";
pub const PIDS_FILE: &str = "pids";
const DEFAULT_DIR: &str = "understudy-kv";

#[derive(Subcommand, Debug)]
pub enum KvCmd {
    /// Run one replica of a leaderless (Hermes-style) group.
    ///
    /// Keeps its emulated persistent memory in DIR/pm.log (O_DSYNC appends, one GDP flag per
    /// entry), serves clients and peers on --listen, and obeys the configuration the CM sends.
    /// A node restarted on an existing log recovers through HEAL before serving again.
    Node(NodeArgs),
    /// Run the configuration manager: heartbeats, failure detection, epochs, re-adding nodes.
    ///
    /// Its configuration is durable in DIR/cm.state (replaced atomically); a restarted CM
    /// carries on from it.
    Cm(CmArgs),
    /// Start a local group (CM + N nodes) on loopback and stay in the foreground until Ctrl-C.
    ///
    /// Creates DIR with a random cluster secret, one data directory per node, logs under
    /// DIR/logs/, the process ids in DIR/pids and DIR/kv-cluster.json for clients. A node that
    /// exits (e.g. `kill -9`) is restarted on its log after --restart-after-ms and recovers
    /// through HEAL while the others keep serving.
    Up(UpArgs),
    /// Read a key (prints the value, or exits 1 if the key does not exist).
    Get {
        key: String,
        #[command(flatten)]
        conn: KvConn,
    },
    /// Write a key.
    Put {
        key: String,
        value: String,
        #[command(flatten)]
        conn: KvConn,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Protocol {
    /// Hermes-style INV/ACK/VAL with HEAL recovery.
    Leaderless,
}

#[derive(Args, Debug, Clone)]
pub struct KvConn {
    /// The file written by `understudy kv up`.
    #[arg(long, env = "UNDERSTUDY_KV_CLUSTER", value_name = "FILE")]
    pub cluster: Option<PathBuf>,
}

fn parse_model(s: &str) -> Result<Model, String> {
    s.parse()
}

/// `ID=ADDR,ID=ADDR,...`
fn parse_addrs(s: &str) -> anyhow::Result<BTreeMap<u32, SocketAddr>> {
    let mut out = BTreeMap::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        let (id, addr) = part.split_once('=').with_context(|| format!("{part:?} is not ID=ADDR"))?;
        let id: u32 = id.trim().parse().with_context(|| format!("bad node id in {part:?}"))?;
        let addr: SocketAddr = addr.trim().parse().with_context(|| format!("bad address in {part:?}"))?;
        if out.insert(id, addr).is_some() {
            bail!("node {id} listed twice");
        }
    }
    let n = out.len() as u32;
    if n < 2 || out.keys().copied().ne(0..n) {
        bail!("nodes must be numbered 0..N-1 with N >= 2 (got {:?})", out.keys().collect::<Vec<_>>());
    }
    Ok(out)
}

#[derive(Args, Debug)]
pub struct NodeArgs {
    /// The replication protocol.
    #[arg(long, value_enum, default_value = "leaderless")]
    pub protocol: Protocol,
    /// This node's id (0..N-1).
    #[arg(long)]
    pub id: u32,
    /// Every node of the group: ID=ADDR,ID=ADDR,... (this node's own entry is its listen address).
    #[arg(long)]
    pub peers: String,
    /// Data directory (created if missing).
    #[arg(long, value_name = "DIR")]
    pub data: PathBuf,
    #[arg(long, value_name = "FILE")]
    pub secret_file: PathBuf,
    /// Persistency model: synch, strict, read-enforced, eventual or scope (same for the group).
    #[arg(long, default_value = "synch", value_parser = parse_model)]
    pub model: Model,
    /// Extra latency added to every durable append, to model NVM (microseconds).
    #[arg(long, default_value_t = 0)]
    pub persist_latency_us: u64,
    /// Coordinator re-broadcasts INV after this long without every ACK.
    #[arg(long, default_value_t = 20)]
    pub inv_ack_timeout_ms: u64,
    /// Follower resends its ACK, then replays the write, after this long without VAL.
    #[arg(long, default_value_t = 40)]
    pub ack_val_timeout_ms: u64,
    /// Read lease after each CM heartbeat; must match the CM's.
    #[arg(long, default_value_t = 300)]
    pub lease_ms: u64,
    /// Missed_updates cap; past it recovery falls back to a full copy.
    #[arg(long, default_value_t = 256 << 20)]
    pub missed_updates_cap_bytes: usize,
    /// Serve Prometheus metrics on this address.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<SocketAddr>,
}

#[derive(Args, Debug)]
pub struct CmArgs {
    /// Every node of the group: ID=ADDR,ID=ADDR,...
    #[arg(long)]
    pub nodes: String,
    #[arg(long, value_name = "DIR")]
    pub data: PathBuf,
    #[arg(long, value_name = "FILE")]
    pub secret_file: PathBuf,
    /// Heartbeat period (the paper uses 4 ms).
    #[arg(long, default_value_t = 4)]
    pub heartbeat_interval_ms: u64,
    /// A node silent this long is removed (after its lease has run out).
    #[arg(long, default_value_t = 500)]
    pub failure_timeout_ms: u64,
    /// Must match the nodes' --lease-ms.
    #[arg(long, default_value_t = 300)]
    pub lease_ms: u64,
    /// Minimum execution with fewer nodes before a returning node is re-added.
    #[arg(long, default_value_t = 0)]
    pub efn_ms: u64,
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<SocketAddr>,
}

#[derive(Args, Debug)]
pub struct UpArgs {
    /// Data directory of the whole group.
    #[arg(long, default_value = DEFAULT_DIR, value_name = "DIR")]
    pub dir: PathBuf,
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
}

pub fn run(cmd: KvCmd, verbose: u8) -> anyhow::Result<()> {
    match cmd {
        KvCmd::Node(a) => {
            crate::init_logging(verbose, "info");
            crate::runtime()?.block_on(node(a))
        }
        KvCmd::Cm(a) => {
            crate::init_logging(verbose, "info");
            crate::runtime()?.block_on(cm(a))
        }
        KvCmd::Up(a) => {
            crate::init_logging(verbose, "info");
            up(a, verbose)
        }
        KvCmd::Get { key, conn } => {
            crate::init_logging(verbose, "warn");
            crate::runtime()?.block_on(async {
                let c = connect(&conn)?;
                match c.get(key.as_bytes()).await? {
                    Some(v) => {
                        println!("{}", String::from_utf8_lossy(&v));
                        Ok(())
                    }
                    None => {
                        eprintln!("key {key:?} not found");
                        std::process::exit(1)
                    }
                }
            })
        }
        KvCmd::Put { key, value, conn } => {
            crate::init_logging(verbose, "warn");
            crate::runtime()?.block_on(async {
                let c = connect(&conn)?;
                c.put(key.as_bytes(), value.as_bytes()).await?;
                Ok(())
            })
        }
    }
}

pub fn load_cluster(path: &Path) -> anyhow::Result<(KvClusterFile, Vec<u8>)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read {} (start a group with `understudy kv up`, or pass --cluster)", path.display()))?;
    let f: KvClusterFile = serde_json::from_str(&text).with_context(|| format!("{} is not a kv cluster file", path.display()))?;
    let secret = cluster_file::read_secret(&f.secret_file)?;
    Ok((f, secret))
}

fn connect(conn: &KvConn) -> anyhow::Result<KvCluster> {
    let path = conn.cluster.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_DIR).join(CLUSTER_FILE));
    let (f, secret) = load_cluster(&path)?;
    Ok(KvCluster::new(f.nodes.values().copied().collect(), secret))
}

async fn node(a: NodeArgs) -> anyhow::Result<()> {
    let Protocol::Leaderless = a.protocol;
    let peers = parse_addrs(&a.peers)?;
    let listen = *peers.get(&a.id).with_context(|| format!("--peers has no entry for this node's id {}", a.id))?;
    let secret = cluster_file::read_secret(&a.secret_file)?;
    let mut p = NodeParams::new(a.id, a.model);
    p.inv_ack_timeout_us = a.inv_ack_timeout_ms * 1000;
    p.ack_val_timeout_us = a.ack_val_timeout_ms * 1000;
    p.lease_us = a.lease_ms * 1000;
    p.missed_updates_cap_bytes = a.missed_updates_cap_bytes;
    let cfg = NodeConfig {
        params: p,
        listen,
        peers,
        data_dir: a.data,
        secret,
        extra_persist_latency: Duration::from_micros(a.persist_latency_us),
        metrics: a.metrics,
    };
    tokio::select! {
        r = ::kv::runtime::run_node(cfg) => r.map_err(|e| anyhow::anyhow!(e)),
        s = proc::shutdown_signal() => { tracing::info!("{s}: stopping"); Ok(()) }
    }
}

async fn cm(a: CmArgs) -> anyhow::Result<()> {
    let nodes = parse_addrs(&a.nodes)?;
    let secret = cluster_file::read_secret(&a.secret_file)?;
    anyhow::ensure!(a.failure_timeout_ms >= a.lease_ms, "--failure-timeout-ms must be at least --lease-ms");
    let cfg = CmConfig {
        params: CmParams {
            heartbeat_interval_us: a.heartbeat_interval_ms * 1000,
            failure_timeout_us: a.failure_timeout_ms * 1000,
            lease_us: a.lease_ms * 1000,
            max_message_delay_us: 100_000,
            efn_min_us: a.efn_ms * 1000,
        },
        nodes,
        data_dir: a.data,
        secret,
        metrics: a.metrics,
    };
    tokio::select! {
        r = ::kv::runtime::run_cm(cfg) => r.map_err(|e| anyhow::anyhow!(e)),
        s = proc::shutdown_signal() => { tracing::info!("{s}: stopping"); Ok(()) }
    }
}

/// A local group of child processes (what `kv up` runs; also used by the benchmark).
pub struct LocalKv {
    pub dir: PathBuf,
    pub file: KvClusterFile,
    pub secret: Vec<u8>,
    node_args: Vec<Vec<String>>,
    cm_args: Vec<String>,
    pub children: Vec<(String, Option<Child>)>,
    down_since: Vec<Option<Instant>>,
}

impl LocalKv {
    pub fn start(a: &UpArgs) -> anyhow::Result<LocalKv> {
        anyhow::ensure!((2..=16).contains(&a.nodes), "--nodes must be between 2 and 16");
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
                    let ls: Vec<std::net::TcpListener> =
                        (0..a.nodes).map(|_| std::net::TcpListener::bind("127.0.0.1:0")).collect::<Result<_, _>>()?;
                    ls.iter().map(|l| l.local_addr().unwrap().port()).collect()
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
        ];
        let node_args: Vec<Vec<String>> = (0..a.nodes)
            .map(|i| {
                vec![
                    "kv".into(), "node".into(), "--protocol".into(), "leaderless".into(),
                    "--id".into(), i.to_string(), "--peers".into(), peers.clone(),
                    "--data".into(), dir.join(format!("node-{i}")).to_string_lossy().into_owned(),
                    "--secret-file".into(), sf.clone(), "--model".into(), a.model.name().into(),
                    "--persist-latency-us".into(), a.persist_latency_us.to_string(),
                    "--missed-updates-cap-bytes".into(), a.missed_updates_cap_bytes.to_string(),
                ]
            })
            .collect();
        let mut me = LocalKv {
            dir: dir.clone(),
            file,
            secret,
            node_args,
            cm_args,
            children: Vec::new(),
            down_since: vec![None; a.nodes as usize],
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

    /// Reaps exited nodes and restarts those down for `restart_after`. Returns notes.
    pub fn supervise(&mut self, restart_after: Option<Duration>) -> anyhow::Result<Vec<String>> {
        let mut notes = Vec::new();
        let n = self.node_args.len();
        for i in 0..n {
            if let Some(c) = &mut self.children[i].1 {
                if let Ok(Some(st)) = c.try_wait() {
                    notes.push(format!("node-{i} exited ({})", proc::describe_status(st)));
                    self.children[i].1 = None;
                    self.down_since[i] = Some(Instant::now());
                }
            }
            if let (None, Some(t), Some(after)) = (&self.children[i].1, self.down_since[i], restart_after) {
                if t.elapsed() >= after {
                    let c = self.spawn_node(i)?;
                    notes.push(format!("node-{i} restarted on its log (pid {})", c.id()));
                    self.children[i].1 = Some(c);
                    self.down_since[i] = None;
                    self.write_pids()?;
                }
            }
        }
        if let Some(c) = &mut self.children[n].1 {
            if let Ok(Some(st)) = c.try_wait() {
                notes.push(format!("cm exited ({}); restarting it on its durable state", proc::describe_status(st)));
                self.children[n].1 = Some(proc::spawn_self(&self.cm_args, &self.dir.join("logs/cm.log"), &[])?);
                self.write_pids()?;
            }
        }
        Ok(notes)
    }

    pub fn stop(&mut self) {
        let mut live: Vec<(String, Child)> =
            self.children.iter_mut().filter_map(|(n, c)| c.take().map(|c| (n.clone(), c))).collect();
        proc::stop_children(&mut live, Duration::from_secs(5));
    }
}

impl Drop for LocalKv {
    fn drop(&mut self) {
        self.stop();
    }
}

fn up(a: UpArgs, _verbose: u8) -> anyhow::Result<()> {
    let mut lk = LocalKv::start(&a)?;
    let rt = crate::runtime()?;
    let ready = rt.block_on(async {
        let c = KvCluster::new(lk.file.nodes.values().copied().collect(), lk.secret.clone());
        let start = Instant::now();
        loop {
            if c.get(b"__understudy_ready").await.is_ok() {
                return Ok(start.elapsed());
            }
            if start.elapsed() > Duration::from_secs(30) {
                bail!("the group did not start serving within 30 s; see {}/logs/", lk.dir.display());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })?;
    println!("kv group of {} nodes ({} persistency) serving after {:.1} s", a.nodes, a.model, ready.as_secs_f64());
    for (i, addr) in &lk.file.nodes {
        println!("  node {i}  {addr}   log {}/logs/node-{i}.log", lk.dir.display());
    }
    println!("  cluster file  {}", lk.dir.join(CLUSTER_FILE).display());
    println!("try: understudy kv put hello world --cluster {0}; understudy kv get hello --cluster {0}", lk.dir.join(CLUSTER_FILE).display());
    let restart = (a.restart_after_ms > 0).then(|| Duration::from_millis(a.restart_after_ms));
    rt.block_on(async {
        let stop = proc::shutdown_signal();
        tokio::pin!(stop);
        loop {
            tokio::select! {
                s = &mut stop => { eprintln!("{s}: stopping the group"); break; }
                _ = tokio::time::sleep(Duration::from_millis(100)) => {
                    for n in lk.supervise(restart)? {
                        eprintln!("{n}");
                    }
                }
            }
        }
        Ok::<_, anyhow::Error>(())
    })?;
    lk.stop();
    Ok(())
}
