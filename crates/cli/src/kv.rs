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
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Subcommand, ValueEnum};

use ::kv::leaderless::core::cm::CmParams;
use ::kv::leaderless::core::node::NodeParams;
use ::kv::leaderless::driver::{CmConfig, KvCluster, NodeConfig};
use ::kv::Model;

use testbed::cluster_file;
use testbed::kv::{load_cluster, parse_model, wait_all_serving, LocalKv, Recovery, UpArgs, CLUSTER_FILE, DEFAULT_DIR};
use testbed::proc;

#[derive(Subcommand, Debug)]
pub enum KvCmd {
    /// Run one replica of a leaderless (Hermes-style) group, or one node of a witness KV.
    ///
    /// Leaderless: keeps its emulated persistent memory in DIR/pm.log (O_DSYNC appends, one GDP
    /// flag per entry), serves clients and peers on --listen, and obeys the configuration the CM
    /// sends. A node restarted on an existing log recovers through HEAL before serving again.
    ///
    /// Witness (--protocol witness --role head|backup): the group's layout is node 0 the first
    /// primary, nodes 1..=B the backups (--backups B), the rest witnesses; the leader is elected
    /// among the heads. NVMM is emulated in --pmem-dir (default under /dev/shm: survives SIGKILL,
    /// not power loss); a backup's SSD log is DIR/ssd-*.log, written and read O_DIRECT (DIR must
    /// be on a disk). A node restarted on its files is rebuilt from them.
    Node(NodeArgs),
    /// Run the configuration manager: heartbeats, failure detection, epochs, re-adding nodes.
    ///
    /// Its configuration is durable in DIR/cm.state (replaced atomically); a restarted CM
    /// carries on from it. With --store etcd://..., run two or three CMs: they stand for
    /// leadership in the control store, only the leader heartbeats the nodes (nodes follow
    /// whichever CM heartbeats them: they need no CM address), its configuration is kept as
    /// keys written under the election's guard, and a standby takes over, from that
    /// configuration, about one --election-ttl-ms after the leader dies.
    Cm(CmArgs),
    /// Start a local group (CM + N nodes) on loopback and stay in the foreground until Ctrl-C.
    ///
    /// Creates DIR with a random cluster secret, one data directory per node, logs under
    /// DIR/logs/, the process ids in DIR/pids and DIR/kv-cluster.json for clients. A node that
    /// exits (e.g. `kill -9`) is restarted on its log after --restart-after-ms and recovers
    /// through HEAL while the others keep serving; the CM, after 250 ms on DIR/cm/cm.state.
    /// Each wait doubles for further exits within a minute (at most 4 s); a daemon that exits a
    /// 6th time within a minute is given up, and `kv up` stops the group and exits non-zero.
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
    /// Show every node of a witness-KV group: role, term, leader, commit index, recovery, and
    /// the bytes it holds per tier with its resident memory.
    ///
    /// Columns: NVMM-TBL is the key and value tables (NVMM hash tables in the paper, DRAM hash
    /// tables here), NVMM-RING the log/buffer ring bytes in use, DRAM the backup index,
    /// popularity list and log slots, SSD the segment files (live bytes in parentheses), RSS
    /// the process's resident set and RSS/HEAP its private part over the DRAM and NVMM-table
    /// bytes. Exits 1 if a node does not answer (after printing the others).
    Status {
        /// Print JSON ({"nodes": [...], "unreachable": [...]}) instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        conn: KvConn,
    },
    /// Change a witness-KV group's membership and wait until the change commits.
    ///
    /// The change goes to the serving leader (the client follows its hints) and is answered
    /// once its log entry commits, so "done" survives any failover; a refused change (one that
    /// would leave no value holder, move two voters at once, remove the leader...) exits
    /// non-zero with the reason; while another change is still uncommitted (perhaps the
    /// leader's own: it replaces members lost for 3 s by spares on its own) the request is
    /// retried until --timeout-ms. `show` prints every node's view instead.
    Reconfig(ReconfigArgs),
}

#[derive(Args, Debug)]
pub struct ReconfigArgs {
    pub action: ReconfigAction,
    /// The node the change is about (add, remove, promote, demote; the backup for substitute).
    pub id: Option<u32>,
    /// add: the new member's kind (its process must run as that --role).
    #[arg(long, value_enum)]
    pub kind: Option<WitnessRole>,
    /// substitute: the voting witness that stands in for the backup ID.
    #[arg(long, value_name = "ID")]
    pub witness: Option<u32>,
    /// Give up waiting for a leader to take the change after this long.
    #[arg(long, default_value_t = 10_000)]
    pub timeout_ms: u64,
    #[command(flatten)]
    pub conn: KvConn,
}

/// A membership step of the witness KV (CANDStore M22–M24).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ReconfigAction {
    /// ID joins non-voting, as --kind (it catches up; the leader promotes it once caught up).
    Add,
    /// Member ID leaves.
    Remove,
    /// Member ID votes.
    Promote,
    /// Member ID stops voting.
    Demote,
    /// The voting witness --witness stands in for the voting backup ID in the commit quorum.
    Substitute,
    /// The substitute goes back to being a plain witness.
    EndSubstitute,
    /// Print every node's configuration, the leader it follows and whether it serves.
    Show,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Protocol {
    /// Hermes-style INV/ACK/VAL with HEAL recovery.
    Leaderless,
    /// CANDStore's witness KV: one primary, backups (NVMM buffer + SSD log), witnesses (keys
    /// and timestamps only); a witness takes over and serves at once when the primary fails.
    Witness,
}

/// A witness-KV node's kind (`--protocol witness`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WitnessRole {
    /// The primary (node 0) or a witness: keeps keys and timestamps, may lead.
    Head,
    /// NVMM buffer in front of an SSD log: votes and persists, never leads.
    Backup,
}



/// The node's recovery scheme for a `--recovery` choice.
fn scheme(r: Recovery) -> anyhow::Result<::kv::leaderless::core::node::RecoveryScheme> {
    Ok(match r {
        Recovery::Heal => ::kv::leaderless::core::node::RecoveryScheme::Heal,
        Recovery::FullCopy => ::kv::leaderless::core::node::RecoveryScheme::FullCopy,
        Recovery::ReactiveLog => ::kv::leaderless::core::node::RecoveryScheme::ReactiveLog,
        other => anyhow::bail!(
            "--recovery {} is a witness-KV scheme (--protocol witness); the leaderless KV takes heal, full-copy or reactive-log",
            other.name()
        ),
    })
}

#[derive(Args, Debug, Clone)]
pub struct KvConn {
    /// The file written by `understudy kv up`.
    #[arg(long, env = "UNDERSTUDY_KV_CLUSTER", value_name = "FILE")]
    pub cluster: Option<PathBuf>,
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
    /// Recovery catch-up window, in chunks: credited to the Buddy plus received and still
    /// persisting (1: strictly one chunk at a time; at most 64).
    #[arg(long, default_value_t = 16)]
    pub catchup_chunks_in_flight: usize,
    /// Recovery scheme (the same on every node): heal or a baseline for the leaderless KV; for
    /// --protocol witness cand (what heal means there), offline or an ablation.
    #[arg(long, value_enum, default_value = "heal")]
    pub recovery: Recovery,
    /// Serve Prometheus metrics on this address.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<SocketAddr>,
    /// Witness KV: this node's kind; must agree with its id in the layout (see --backups).
    #[arg(long, value_enum, required_if_eq("protocol", "witness"))]
    pub role: Option<WitnessRole>,
    /// Witness KV: the number of backups (nodes 1..=N); the other nodes after 0 are witnesses,
    /// except the spares (the last nodes of --peers).
    #[arg(long, default_value_t = 1)]
    pub backups: u32,
    /// Witness KV: the last N nodes of --peers are spare witnesses: idle until the leader adds
    /// one in place of a member lost for longer than the loss bound (so fault tolerance comes
    /// back without an operator), or an operator adds one (`kv reconfig add`).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub spares: u32,
    /// Witness KV: spare backups, the N nodes of --peers before the spare witnesses.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub spare_backups: u32,
    /// Witness KV: the directory of the emulated NVMM regions (default:
    /// /dev/shm/understudy-witness-<node id>-<hash of --data>).
    #[arg(long, value_name = "DIR")]
    pub pmem_dir: Option<PathBuf>,
    /// Witness KV: a head that hears no leader for this long stands for election.
    #[arg(long, default_value_t = 150)]
    pub election_timeout_ms: u64,
    /// Witness KV: the designated successor that hears no leader for this long starts pulling
    /// the backups' logs ahead of the election (proactive recovery); 0 = never (the values are
    /// then pulled after the election, on demand and in the background). Default: a fifth of
    /// --election-timeout-ms.
    #[arg(long)]
    pub soft_timeout_ms: Option<u64>,
    /// Witness KV: the share of served requests whose key the primary samples for the
    /// backups' popular list (M10; hot keys are pulled first after a failover). The paper
    /// samples 0.1 % at ~3 M ops/s; a store serving far fewer requests needs a larger share
    /// for as many samples per second.
    #[arg(long, value_name = "P", default_value_t = ::kv::witness::core::node::Params::default().popularity_sample_probability)]
    pub sample_probability: f64,
    /// Append structured events (one versioned JSON object per line; today one per completed
    /// recovery, with its breakdown) to this file.
    #[arg(long, value_name = "FILE")]
    pub events: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct CmArgs {
    /// Every node of the group: ID=ADDR,ID=ADDR,...
    #[arg(long)]
    pub nodes: String,
    /// Where the CM keeps its state file when it runs alone (without --store).
    #[arg(long, value_name = "DIR", required_unless_present = "store")]
    pub data: Option<PathBuf>,
    /// Run with standbys on this control store (etcd://H:P[,H:P...], or an embedded
    /// directory): only the elected CM acts. Without it: alone, on DIR/cm.state.
    #[arg(long, value_name = "URL")]
    pub store: Option<String>,
    /// The cluster name in the control store's keys (one store may hold several clusters).
    #[arg(long, value_name = "NAME", default_value = "kv")]
    pub store_cluster: String,
    /// The election lease: a leader not renewing it for this long stops acting; a standby
    /// takes over about this long after the leader dies (etcd rounds it up to whole seconds,
    /// and to at least its own minimum: 2 s with its default timings).
    #[arg(long, default_value_t = 2000)]
    pub election_ttl_ms: u64,
    /// The name this CM gives when it leads (default: HOST:pid:PID).
    #[arg(long, value_name = "NAME")]
    pub advertise: Option<String>,
    #[arg(long, value_name = "FILE")]
    pub secret_file: PathBuf,
    /// Heartbeat period (the paper uses 4 ms; 10 by default to spare a shared machine).
    #[arg(long, default_value_t = 10)]
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
    /// After the CM starts, a node not heard from yet is suspected only after this long (a node
    /// reads its whole log before it answers: raise it for large stores).
    #[arg(long, default_value_t = 30_000)]
    pub startup_grace_ms: u64,
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<SocketAddr>,
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
                if let Some(mut w) = connect_witness(&conn)? {
                    return match w.get(key.as_bytes()).await? {
                        Some(v) => {
                            println!("{}", String::from_utf8_lossy(&v));
                            Ok(())
                        }
                        None => {
                            eprintln!("key {key:?} not found");
                            std::process::exit(1)
                        }
                    };
                }
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
        KvCmd::Reconfig(a) => {
            crate::init_logging(verbose, "warn");
            crate::runtime()?.block_on(reconfig(a))
        }
        KvCmd::Status { json, conn } => {
            crate::init_logging(verbose, "warn");
            crate::runtime()?.block_on(status(&conn, json))
        }
        KvCmd::Put { key, value, conn } => {
            crate::init_logging(verbose, "warn");
            crate::runtime()?.block_on(async {
                if let Some(mut w) = connect_witness(&conn)? {
                    return Ok(w.put(key.as_bytes(), value.as_bytes()).await?);
                }
                let c = connect(&conn)?;
                c.put(key.as_bytes(), value.as_bytes()).await?;
                Ok(())
            })
        }
    }
}


/// `kv reconfig`: one membership change through the leader, or every node's view.
async fn reconfig(a: ReconfigArgs) -> anyhow::Result<()> {
    use ::kv::witness::core::config::{Change, Kind};
    let mut w = connect_witness(&a.conn)?
        .context("kv reconfig changes witness-KV groups; this cluster file describes a leaderless group (its CM manages membership)")?;
    w.deadline = Duration::from_millis(a.timeout_ms);
    let id = || a.id.with_context(|| format!("{:?} needs the node's ID", a.action));
    let change = match a.action {
        ReconfigAction::Show => {
            let path = a.conn.cluster.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_DIR).join(CLUSTER_FILE));
            let (f, _) = testbed::kv_witness::WitnessClusterFile::load(&path)?.context("not a witness cluster file")?;
            for &n in f.nodes.keys() {
                match w.membership(n).await {
                    Ok((c, leader, serving)) => {
                        let l = leader.map_or("none".to_string(), |l| l.to_string());
                        println!("node {n}: leader {l}{}; {}", if serving { " (this node, serving)" } else { "" }, describe(&c));
                    }
                    Err(e) => println!("node {n}: no answer ({e})"),
                }
            }
            return Ok(());
        }
        ReconfigAction::Add => {
            let id = id()?;
            let kind = match a.kind.context("add needs --kind head|backup (which --role the node runs)")? {
                WitnessRole::Head => Kind::Head,
                WitnessRole::Backup => Kind::Backup,
            };
            Change::Add { id, kind }
        }
        ReconfigAction::Remove => Change::Remove { id: id()? },
        ReconfigAction::Promote => Change::SetVoting { id: id()?, voting: true },
        ReconfigAction::Demote => Change::SetVoting { id: id()?, voting: false },
        ReconfigAction::Substitute => {
            Change::Substitute { backup: id()?, witness: a.witness.context("substitute needs --witness ID")? }
        }
        ReconfigAction::EndSubstitute => Change::EndSubstitute,
    };
    match w.reconfigure(change.clone()).await {
        Ok(c) => {
            println!("committed: {}", describe(&c));
            Ok(())
        }
        Err(::kv::witness::driver::WitnessError::Refused(why)) => bail!("{change:?} refused: {why}"),
        Err(e) => Err(anyhow::anyhow!(e).context(format!("{change:?} not confirmed"))),
    }
}

/// One line: `epoch E: 0 head voting, 1 backup voting, ...; substitute none; spares 3 head`.
fn describe(c: &::kv::witness::core::config::Config) -> String {
    let kind = |k: ::kv::witness::core::config::Kind| if k == ::kv::witness::core::config::Kind::Head { "head" } else { "backup" };
    let members: Vec<String> = c
        .members
        .iter()
        .map(|m| format!("{} {} {}", m.id, kind(m.kind), if m.voting { "voting" } else { "non-voting" }))
        .collect();
    let spares: Vec<String> = c.spares.iter().map(|m| format!("{} {}", m.id, kind(m.kind))).collect();
    format!(
        "epoch {}: {}; substitute {}; spares {}",
        c.epoch,
        members.join(", "),
        c.substitute.map_or("none".to_string(), |s| s.to_string()),
        if spares.is_empty() { "none".to_string() } else { spares.join(", ") }
    )
}

/// `kv status`: one status request to every node of a witness group.
async fn status(conn: &KvConn, json: bool) -> anyhow::Result<()> {
    let Some(mut w) = connect_witness(conn)? else {
        bail!("`kv status` reads witness-KV groups; this cluster file describes a leaderless group (its nodes serve Prometheus metrics with --metrics)");
    };
    let all = w.all_status().await;
    let unreachable: Vec<(u32, String)> =
        all.iter().filter_map(|(id, r)| r.as_ref().err().map(|e| (*id, e.to_string()))).collect();
    let nodes: Vec<&::kv::witness::proto::StatusReport> = all.iter().filter_map(|(_, r)| r.as_ref().ok()).collect();
    if json {
        let v = serde_json::json!({
            "nodes": nodes,
            "unreachable": unreachable.iter().map(|(id, e)| serde_json::json!({"id": id, "error": e})).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", status_table(&nodes));
        for (id, e) in &unreachable {
            println!("node {id}: no answer: {e}");
        }
    }
    if !unreachable.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}

/// The `kv status` table (sizes in MiB).
fn status_table(nodes: &[&::kv::witness::proto::StatusReport]) -> String {
    use std::fmt::Write;
    let mib = |b: u64| format!("{:.1}", b as f64 / (1u64 << 20) as f64);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<4} {:<6} {:<11} {:>5} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>18} {:>9} {:>8}",
        "NODE", "KIND", "ROLE", "TERM", "LEADER", "COMMIT", "KEYS", "VALUES", "NVMM-TBL", "NVMM-RING", "DRAM", "SSD (LIVE) MiB", "RSS", "RSS/HEAP"
    );
    for s in nodes {
        let t = &s.tiers;
        let mut role = s.role.clone();
        if s.recovering {
            role = format!("{role}*{}", s.missing_keys);
        }
        let heap = t.in_heap_bytes();
        let private = s.rss_bytes.saturating_sub(s.rss_shared_bytes);
        let ratio = if heap > 0 { format!("{:.2}", private as f64 / heap as f64) } else { "-".into() };
        let _ = writeln!(
            out,
            "{:<4} {:<6} {:<11} {:>5} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>18} {:>9} {:>8}",
            s.id,
            s.kind,
            role,
            s.term,
            s.leader.map_or("-".into(), |l| l.to_string()),
            s.commit,
            s.keys,
            s.values,
            mib(t.nvmm_key_table_bytes + t.nvmm_value_table_bytes),
            mib(t.nvmm_buffer_used_bytes),
            mib(t.dram_bytes()),
            format!("{} ({})", mib(t.ssd_allocated_bytes), mib(t.ssd_live_bytes)),
            mib(s.rss_bytes),
            ratio,
        );
    }
    if nodes.iter().any(|s| s.recovering) {
        out.push_str("ROLE*N: leading and recovering, N keys still to pull\n");
    }
    out
}

/// The witness client when the cluster file describes a witness group.
fn connect_witness(conn: &KvConn) -> anyhow::Result<Option<::kv::witness::driver::WitnessClient>> {
    let path = conn.cluster.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_DIR).join(CLUSTER_FILE));
    Ok(testbed::kv_witness::WitnessClusterFile::load(&path)?.map(|(f, secret)| f.client(secret)))
}

fn connect(conn: &KvConn) -> anyhow::Result<KvCluster> {
    let path = conn.cluster.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_DIR).join(CLUSTER_FILE));
    let (f, secret) = load_cluster(&path)?;
    Ok(KvCluster::new(f.nodes.values().copied().collect(), secret))
}

async fn node(a: NodeArgs) -> anyhow::Result<()> {
    crate::daemons::link_tls_at_start()?;
    if let Protocol::Witness = a.protocol {
        return witness_node(a).await;
    }
    let peers = parse_addrs(&a.peers)?;
    let listen = *peers.get(&a.id).with_context(|| format!("--peers has no entry for this node's id {}", a.id))?;
    let secret = cluster_file::read_secret(&a.secret_file)?;
    let mut p = NodeParams::new(a.id, a.model);
    p.inv_ack_timeout_us = a.inv_ack_timeout_ms * 1000;
    p.ack_val_timeout_us = a.ack_val_timeout_ms * 1000;
    p.lease_us = a.lease_ms * 1000;
    p.missed_updates_cap_bytes = a.missed_updates_cap_bytes;
    anyhow::ensure!(a.catchup_chunks_in_flight >= 1, "--catchup-chunks-in-flight must be at least 1");
    p.max_catchup_chunks_in_flight = a.catchup_chunks_in_flight;
    p.recovery = scheme(a.recovery)?;
    let cfg = NodeConfig {
        params: p,
        listen,
        peers,
        data_dir: a.data,
        secret,
        extra_persist_latency: Duration::from_micros(a.persist_latency_us),
        metrics: a.metrics,
        events: a.events,
    };
    tokio::select! {
        r = ::kv::leaderless::driver::run_node(cfg) => r.map_err(|e| anyhow::anyhow!(e)),
        s = proc::shutdown_signal() => { tracing::info!("{s}: stopping"); Ok(()) }
    }
}

async fn witness_node(a: NodeArgs) -> anyhow::Result<()> {
    use ::kv::witness::core::config::Kind;
    use ::kv::witness::core::node::Params;
    let peers = parse_addrs(&a.peers)?;
    let listen = *peers.get(&a.id).with_context(|| format!("--peers has no entry for this node's id {}", a.id))?;
    let spares = a.spares + a.spare_backups;
    anyhow::ensure!((peers.len() as u32) > spares, "--spares {} and --spare-backups {} leave no member among the {} nodes of --peers", a.spares, a.spare_backups, peers.len());
    let n = peers.len() as u32 - spares;
    anyhow::ensure!(a.backups >= 1 && a.backups + 1 < n, "--backups {} leaves no witness in a group of {n} members (node 0 is the primary, then backups, then witnesses, then spares)", a.backups);
    let cfg = witness_layout(a.backups, n - 1 - a.backups, a.spare_backups, a.spares);
    let cfg = spare_view(cfg, a.id);
    let kind = cfg.kind(a.id).with_context(|| format!("node {} is not in the layout", a.id))?;
    let want = match a.role.context("--role is required with --protocol witness")? {
        WitnessRole::Head => Kind::Head,
        WitnessRole::Backup => Kind::Backup,
    };
    anyhow::ensure!(kind == want, "node {} is a {kind:?} in the layout of {n} nodes with --backups {}, not a {want:?}", a.id, a.backups);
    let mut params = Params { election_timeout_us: a.election_timeout_ms * 1000, ..Params::default() };
    // Keep the lease and the soft timeout inside a shorter election timeout (M3, M16).
    params.lease_us = params.lease_us.min(params.election_timeout_us * 2 / 3);
    params.soft_timeout_us = match a.soft_timeout_ms {
        Some(ms) => ms * 1000,
        None => params.soft_timeout_us.min(params.election_timeout_us / 5),
    };
    params.recovery = a.recovery.witness()?;
    anyhow::ensure!(
        (0.0..=1.0).contains(&a.sample_probability),
        "--sample-probability {} is not a probability (0 to 1)",
        a.sample_probability
    );
    params.popularity_sample_probability = a.sample_probability;
    params.validate().map_err(|e| anyhow::anyhow!("--election-timeout-ms: {e}"))?;
    let pmem_dir = a.pmem_dir.clone().unwrap_or_else(|| {
        let abs = std::path::absolute(&a.data).unwrap_or_else(|_| a.data.clone());
        let h = fnv1a(abs.to_string_lossy().as_bytes());
        PathBuf::from("/dev/shm").join(format!("understudy-witness-{}-{h:08x}", a.id))
    });
    let secret = cluster_file::read_secret(&a.secret_file)?;
    let cfg = ::kv::witness::driver::WitnessNodeConfig {
        id: a.id,
        cfg,
        params,
        listen,
        peers,
        data_dir: a.data,
        pmem_dir,
        pmem_log_bytes: ::kv::witness::driver::LOG_PMEM_BYTES_DEFAULT,
        secret,
    };
    tokio::select! {
        r = ::kv::witness::driver::run_node(cfg) => r.map_err(|e| anyhow::anyhow!(e)),
        s = proc::shutdown_signal() => { tracing::info!("{s}: stopping"); Ok(()) }
    }
}

/// The group's bootstrap configuration: `Config::standard` (node 0 the primary, then the
/// backups, then the witnesses) and, after them, the spares: backups first, then witnesses.
fn witness_layout(backups: u32, witnesses: u32, spare_backups: u32, spare_witnesses: u32) -> ::kv::witness::core::config::Config {
    use ::kv::witness::core::config::{Config, Kind, Member};
    let mut cfg = Config::standard(backups, witnesses);
    let first = 1 + backups + witnesses;
    for i in 0..spare_backups + spare_witnesses {
        let kind = if i < spare_backups { Kind::Backup } else { Kind::Head };
        cfg.spares.push(Member { id: first + i, kind, voting: false });
    }
    cfg
}

/// What a node starts from: a member the group's configuration; a spare the same with itself
/// as a non-voting member at epoch 0, older than any configuration a leader sends, so the
/// leader's messages (which name it once it is added) replace it.
fn spare_view(mut cfg: ::kv::witness::core::config::Config, id: u32) -> ::kv::witness::core::config::Config {
    if let Some(m) = cfg.spares.iter().find(|m| m.id == id).copied() {
        cfg.epoch = 0;
        cfg.members.push(m);
    }
    cfg
}

/// FNV-1a: a stable name for a data directory's NVMM (not a security measure).
fn fnv1a(b: &[u8]) -> u32 {
    b.iter().fold(0x811c_9dc5u32, |h, &x| (h ^ x as u32).wrapping_mul(0x0100_0193))
}

/// The bound on message delay the CM assumes when waiting out a node's lease.
const MAX_MESSAGE_DELAY_MS: u64 = 100;

async fn cm(a: CmArgs) -> anyhow::Result<()> {
    crate::daemons::link_tls_at_start()?;
    let nodes = parse_addrs(&a.nodes)?;
    let secret = cluster_file::read_secret(&a.secret_file)?;
    anyhow::ensure!(a.failure_timeout_ms >= a.lease_ms, "--failure-timeout-ms must be at least --lease-ms");
    let control = match &a.store {
        None => None,
        Some(url) => {
            // A new leader has not heartbeated anyone yet: what keeps a node's lease from the old
            // leader from outliving its removal is the grace before the new leader suspects
            // anyone (see CmCore: a node never heard from is suspected only after it).
            anyhow::ensure!(
                a.startup_grace_ms >= a.lease_ms + MAX_MESSAGE_DELAY_MS,
                "--startup-grace-ms must be at least --lease-ms + {MAX_MESSAGE_DELAY_MS} with --store (a new leader waits out the old one's leases)"
            );
            anyhow::ensure!(a.election_ttl_ms >= 1000, "--election-ttl-ms must be at least 1000 (etcd leases are whole seconds)");
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            Some(::kv::leaderless::driver::CmControl {
                store_url: url.clone(),
                cluster: a.store_cluster.clone(),
                cluster_id: ::kv::leaderless::driver::cluster_id_from_secret(&secret),
                election_ttl: Duration::from_millis(a.election_ttl_ms),
                advertise: a.advertise.clone().unwrap_or_else(|| format!("{}:pid:{}", host.trim(), std::process::id())),
            })
        }
    };
    let cfg = CmConfig {
        params: CmParams {
            heartbeat_interval_us: a.heartbeat_interval_ms * 1000,
            failure_timeout_us: a.failure_timeout_ms * 1000,
            lease_us: a.lease_ms * 1000,
            max_message_delay_us: MAX_MESSAGE_DELAY_MS * 1000,
            efn_min_us: a.efn_ms * 1000,
            startup_grace_us: a.startup_grace_ms * 1000,
        },
        nodes,
        data_dir: a.data.unwrap_or_default(),
        secret,
        metrics: a.metrics,
        control,
    };
    tokio::select! {
        r = ::kv::leaderless::driver::run_cm(cfg) => r.map_err(|e| anyhow::anyhow!(e)),
        s = proc::shutdown_signal() => { tracing::info!("{s}: stopping"); Ok(()) }
    }
}



fn up(a: UpArgs, verbose: u8) -> anyhow::Result<()> {
    if a.protocol == testbed::kv::UpProtocol::Witness {
        return up_witness(a, verbose);
    }
    scheme(a.recovery)?; // a witness-KV scheme: refused before any node starts
    let mut lk = LocalKv::start(&a)?;
    let rt = crate::runtime()?;
    let ready = rt
        .block_on(wait_all_serving(&lk.file, &lk.secret, Duration::from_secs(60)))
        .with_context(|| format!("see {}/logs/", lk.dir.display()))?;
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
                    // Restarting it again would only hide a broken disk or configuration.
                    if lk.gave_up() {
                        lk.stop();
                        anyhow::bail!("a daemon of the group keeps failing (see above); stopped the group");
                    }
                }
            }
        }
        Ok::<_, anyhow::Error>(())
    })?;
    lk.stop();
    Ok(())
}

fn up_witness(a: UpArgs, _verbose: u8) -> anyhow::Result<()> {
    let mut lk = testbed::kv_witness::LocalWitnessKv::start(&a)?;
    let rt = crate::runtime()?;
    let ready = rt
        .block_on(lk.wait_serving(Duration::from_secs(60)))
        .with_context(|| format!("see {}/logs/", lk.dir.display()))?;
    println!(
        "witness kv group of {} nodes (primary, {} backup(s), {} witness(es)) serving after {:.1} s",
        lk.file.nodes.len(),
        a.backups,
        a.witnesses,
        ready.as_secs_f64()
    );
    for (i, addr) in &lk.file.nodes {
        let members = 1 + a.backups + a.witnesses;
        let role = match *i {
            0 => "primary",
            i if i <= a.backups => "backup",
            i if i < members => "witness",
            i if i < members + a.spare_backups => "spare backup",
            _ => "spare witness",
        };
        println!("  node {i}  {role:13} {addr}   log {}/logs/node-{i}.log", lk.dir.display());
    }
    println!("  cluster file  {}", lk.dir.join(CLUSTER_FILE).display());
    println!("try: understudy kv put hello world --cluster {0}; understudy kv get hello --cluster {0}", lk.dir.join(CLUSTER_FILE).display());
    rt.block_on(async {
        let stop = proc::shutdown_signal();
        tokio::pin!(stop);
        loop {
            tokio::select! {
                s = &mut stop => { eprintln!("{s}: stopping the group"); break; }
                _ = tokio::time::sleep(Duration::from_millis(100)) => {
                    for n in lk.reap() {
                        eprintln!("{n}");
                    }
                }
            }
        }
    });
    lk.stop();
    Ok(())
}

// ------------------------------------------------------------------------------ benchmark

#[derive(Subcommand, Debug)]
pub enum KvBench {
    /// Recovery after a node failure (HEAL §IX): HEAL against the full-copy and reactive-log
    /// baselines.
    ///
    /// Each run: a group on loopback with a preloaded store (every node's log restored from the
    /// same snapshot), closed-loop clients with a YCSB-B mix (95% reads, 5% writes, zipfian
    /// keys by default); one node is killed with SIGKILL, stays down for the EFN period, and is
    /// restarted on its log. Measured: the recovery latency the recovering node reports (from
    /// its re-admission to Recov_end, broken into Start_to_ACK / CatchUp_to_Resp /
    /// Apply_to_end), the bytes it received, the work lost (failure-free rate from the windows
    /// adjacent to the failure, minus the operations completed, in 10 ms windows) from the kill
    /// to the end of the recovery and over the recovery alone, and a live node's resident memory
    /// against the bytes it stores plus its Missed_updates cap. The three schemes alternate
    /// runs on the same store, load and EFN. The baselines are the paper's: the full copy
    /// replaces the failed node with a new one (its log restarts empty) that makes the whole
    /// store it receives durable (§III, §IX); the reactive log makes every update it is sent
    /// durable, redundant ones included, as a ZooKeeper follower logs the leader's transactions
    /// (§II-C). HEAL makes durable only what the node missed. With --sweep: HEAL's recovery
    /// latency against the EFN for every persistency model, and its breakdown for 3, 4 and 5
    /// nodes (Figs. 7-8).
    Recovery(eval::kv::recovery::KvRecoveryArgs),
    /// YCSB A-F and the TAO-like mix through the project's driver against a local group, with
    /// latency histograms, 100 ms throughput windows and, with --kill-at-s, a node killed and
    /// recovered mid-run (see eval::kv::ycsb).
    Ycsb(eval::kv::ycsb::KvYcsbArgs),
    /// A real ZooKeeper 3-server ensemble beside a HEAL group: one replica down for the same EFN
    /// under the same write rate; catch-up time of each (see eval::kv::zookeeper).
    Zookeeper(eval::kv::zookeeper::KvZkArgs),
    /// The witness KV's SSD tier on this disk (CANDStore Fig 8): O_DIRECT sequential and random
    /// read throughput by block size (4 KiB to 1 MiB) and queue depth through the backup's I/O
    /// pool, and durable appends by batch size; picks the writeback batch and BatchPull sizes
    /// (see eval::kv::ssd).
    Ssd(eval::kv::ssd::KvSsdArgs),
    /// The witness KV's time to repair (CANDStore §7.5, Figs 9-10): primary, backup and witness
    /// on loopback, a loaded shard, 8 closed-loop clients (YCSB-C and B, θ 0.99), SIGKILL of the
    /// primary after the warm-up; TTR per scheme against SLOs that are multiples of the run's
    /// steady p99.9 and p50, over 100 ms windows, schemes interleaved (see eval::kv::ttr).
    Ttr(eval::kv::ttr::KvTtrArgs),
}

pub fn bench(b: KvBench, verbose: u8) -> anyhow::Result<()> {
    let report = match b {
        KvBench::Recovery(a) => eval::kv::recovery::run(&a)?,
        KvBench::Zookeeper(a) => eval::kv::zookeeper::bench(a, verbose)?,
        KvBench::Ssd(a) => eval::kv::ssd::run(&a)?,
        KvBench::Ttr(a) => eval::kv::ttr::run(&a)?,
        // Prints its report itself, before its check of the reads can fail.
        KvBench::Ycsb(a) => return eval::kv::ycsb::bench(a, verbose),
    };
    report.print();
    Ok(())
}
