//! `understudy failover ...`: the failure monitor and its helpers (crate `failover`).
//!
//! * `run SPEC`: start the primary from the spec on its volume, serve the client endpoint, ping,
//!   and fail over by the spec's policy; events go to stdout as JSON lines; a control address
//!   takes fault injections and status requests;
//! * `run SPEC --store URL`: the same monitor as one of two or three on the control store, only
//!   the elected one acting, its state as keys, the endpoint a process of its own;
//! * `endpoint`: a client endpoint that follows the primary the leading monitor publishes;
//! * `agent`: one per host, starts and kills the instances of `run --agents` on its host;
//! * `inject`, `status`: talk to a running monitor's control address;
//! * `load`: the SQLite front's load generator and checker;
//! * `sqlite-front`: the SQLite front itself (python3 + the sqlite3 module);
//! * `postgres`: Debian's PostgreSQL server as an instance's application.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use ::failover::driver::Control;
use ::failover::pool::{LocalPool, LocalPoolConfig};
use ::failover::spec::Spec;
use tokio::sync::mpsc;

use crate::ConnArgs;

pub use eval::failover::demo::DemoApp;

/// The failover part of `understudy demo`: SQLite (or PostgreSQL) failed over speculatively,
/// as a timeline.
pub fn demo(verbose: u8, app: DemoApp) -> anyhow::Result<()> {
    eval::failover::demo::demo(verbose, app)
}

/// `understudy bench failover ...`.
#[derive(Subcommand, Debug)]
pub enum FailoverBench {
    /// End-to-end failover latency of REDS, speculative and oracle, live (SpecREDS Figure 6,
    /// §6.4), and §6.5's throughput after promotion and extra instance time.
    ///
    /// The five scenarios of Figure 6 (medium and short REDS timeouts, long and short
    /// recovery, a false positive whose network cut heals) each as a real failure under each
    /// policy's own monitor with its real timeout: the SQLite front on an ext4 volume, the
    /// load through the endpoint, SIGKILL of the whole primary (or its link cut); the failover
    /// latency is the client's longest time without an acknowledged commit, and every failure
    /// checks that no acknowledged commit was lost. Recovery length is the scenario's recovery
    /// time (after SQLite's own) spent by every instance started after the failure. After the
    /// speculative promotions, garbage collection is waited for and the promoted instance's
    /// throughput compared with a never-failed one's. Also the monitor's peak RSS. Speculative
    /// on a general clone (Figure 6's rbd-clone bars) is composed, not live (the monitor
    /// speculates on super only): after each speculative failure a twin primary is crashed
    /// the same way and backups are started on a general clone and on a super child of its
    /// crashed volume; speculative's live outage plus their difference is reported as
    /// `speculative_general_composed`. Times are scaled down with --quick. Needs root,
    /// /dev/fuse, losetup, python3, iproute2.
    Scenarios(eval::failover::scenarios::ScenarioArgs),
    /// Application recovery latency on the plain volume, a super clone and a general clone
    /// (SpecREDS §6.3), for PostgreSQL, SQLite and MariaDB (RocksDB), after clean and unclean
    /// failures, with a small and a large WAL left to recover.
    ///
    /// Per application and WAL size: one primary on a fresh ext4 volume; load until the WAL
    /// since the last checkpoint reaches the size (PostgreSQL: max_wal_size set to leave it;
    /// SQLite: automatic checkpoints off for the large WAL; MariaDB: RocksDB memtables larger than
    /// the WAL); then a failure (SIGKILL of the whole
    /// instance, or a clean stop) and the application started on a super child, on a general
    /// clone and on the volume itself, each timed from its start to its first good health check.
    /// Needs root, /dev/fuse, losetup, python3, PostgreSQL, MariaDB.
    Recovery(eval::failover::recovery::RecoveryArgs),
}

pub fn bench(b: FailoverBench, verbose: u8) -> anyhow::Result<bench::Report> {
    match b {
        FailoverBench::Scenarios(a) => eval::failover::scenarios::run(a, verbose),
        FailoverBench::Recovery(a) => eval::failover::recovery::run(a, verbose),
    }
}

#[derive(Subcommand, Debug)]
pub enum FailoverCmd {
    /// Run an application from SPEC with the failure monitor (REDS, speculative or oracle).
    ///
    /// Starts the primary instance (its volume attached as ext4 at STATE_DIR/mnt/i1), points the
    /// endpoint (spec `endpoint.listen`) at it once its health check passes, and pings it every
    /// `monitor.ping_interval_ms`. On a failure: REDS waits `reds_timeout_ms`, kills the
    /// primary and restarts on the same volume; speculative supers the volume at the first
    /// missed ping, starts a backup on the child and collapses once it is healthy — promoted:
    /// the endpoint moves to the backup and the old primary is killed; rejected (the primary
    /// wrote): the backup is dropped. State survives a restart of this command
    /// (STATE_DIR/monitor.json). Events are printed as JSON lines. Ctrl-C stops every instance
    /// cleanly. Needs root, /dev/fuse, losetup and mount (as `volume attach`).
    ///
    /// With --store etcd://...: run two or three monitors (on the hosts that can start the
    /// application); they stand for election in the control store and only the leader acts.
    /// Its state (the phase of the failover, the primary, the volume) and the endpoint's target
    /// are keys written by guarded transactions; a standby takes over within the election TTL,
    /// adopts the running instances from STATE_DIR and resumes any failover in flight. The
    /// endpoint is not served by the monitor: run `failover endpoint` (one or more). A leader
    /// that loses its lease, or whose write is refused, exits with status 3 leaving the
    /// instances running (restart it: it stands by).
    Run(RunArgs),
    /// The failover agent of one host: starts and kills instances there for `failover run --agents`.
    ///
    /// Run one per host that can run the application (root, /dev/fuse, losetup, as `volume
    /// attach`). It registers HOST at --listen in the control store under a lease of
    /// --lease-ttl-ms, so the monitor places the primary and its backup on different live hosts
    /// and sees a host's death as its lease expiring. It serves the leading monitor's start,
    /// kill, stop, pause and cut requests (each idempotent) to clients that know the cluster
    /// secret; instances are reached at --listen's address. An agent that loses its lease kills
    /// every instance on its host (the monitor counts them fenced) and registers again; Ctrl-C
    /// stops them cleanly, then deregisters. Prints JSON lines: `ready`, `fenced` when it was.
    Agent(AgentArgs),
    /// A client endpoint that follows the leading monitor's primary on the control store.
    ///
    /// Listens on --listen and forwards every client connection to the primary the leading
    /// `failover run --store` publishes for --name (read every 50 ms): re-pointed, its
    /// connections to the old primary severed, when the monitor fails over; held while the
    /// monitor freezes it before a collapse. It keeps serving the current primary while no
    /// monitor runs. Prints JSON lines: `ready`, then `endpoint` at each change.
    Endpoint(EndpointArgs),
    /// Inject a fault into the current primary of a running monitor: kill, stop, pause MS, cut MS.
    ///
    /// kill: SIGKILL of the whole instance (every process of its application, and its volume
    /// server; no flush); stop: clean shutdown and unmount; pause: the whole instance stopped
    /// (its application frozen, its volume server SIGSTOPped) for MS milliseconds (0: for good);
    /// cut: its network link cut for MS milliseconds (0: for good).
    Inject(InjectArgs),
    /// Show a running monitor's state (JSON).
    Status(ControlArgs),
    /// Tell an oracle monitor (evaluation only) the future of the failure to come.
    ///
    /// BACK is `never` or how long after the first missed ping the primary answers again;
    /// RECOVERY_MS how long a restart would take. The oracle waits for the primary when that
    /// is sooner, else fences it and restarts at the first missed ping (no timeout).
    Hint(HintArgs),
    /// Load generator (SQLite front or --postgres): insert through the endpoint, then check.
    ///
    /// Inserts fresh ids one at a time for --duration-ms, recording every acknowledged one and
    /// the longest gap without acknowledgements (when throughput dropped to zero and resumed),
    /// then reads the table through the endpoint and checks that every acknowledged id is there
    /// and nothing never attempted. Prints JSON; exits 1 if the check fails.
    Load(LoadArgs),
    /// The SQLite front: SQLite (WAL, synchronous=FULL) behind a one-line-per-request TCP server.
    SqliteFront(testbed::sqlite_front::FrontArgs),
    /// PostgreSQL (Debian's, unmodified) as an instance's application: initdb on first start,
    /// then `postgres` as an unprivileged user on 127.0.0.1:PORT.
    ///
    /// For a spec's `app.command`: `["understudy", "failover", "postgres", "--data",
    /// "{mount}/pgdata", "--port", "{port}"]`, with `[health] postgres = {}` (a read-only
    /// `SELECT 1`). SIGTERM is a fast shutdown.
    Postgres(testbed::postgres::PgArgs),
    /// MariaDB (Debian's, unmodified; RocksDB engine when mariadb-plugin-rocksdb is installed)
    /// as an instance's application: mariadb-install-db on first start, then `mariadbd` on
    /// 127.0.0.1:PORT.
    ///
    /// For a spec's `app.command`: `["understudy", "failover", "mariadb", "--data",
    /// "{mount}/mysql", "--port", "{port}"]`, with `[health] mysql = {}` (a read-only
    /// `SELECT 1`).
    Mariadb(testbed::mariadb::MariaArgs),
    /// A real speculative failover on a throw-away cluster, as a timeline.
    ///
    /// SQLite (or, with --app postgres, PostgreSQL) under load on an ext4 volume, the primary
    /// killed (SIGKILL), the backup recovering on a super child and promoted by collapse; prints
    /// the monitor's events and the client's throughput, plots it, and checks every
    /// acknowledged commit. Needs root, /dev/fuse, losetup, python3 (and postgresql for
    /// --app postgres).
    Demo(DemoArgs),
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// The spec file (TOML if it ends in .toml, else JSON).
    pub spec: PathBuf,
    /// Serve control requests (faults, status) on this address; clients must prove they know
    /// the cluster secret.
    #[arg(long, value_name = "ADDR")]
    pub control: Option<SocketAddr>,
    #[command(flatten)]
    pub store: StoreArgs,
    /// The election lease with --store: a leader not renewing it for this long stops acting; a
    /// standby takes over about this long after the leader dies (etcd rounds it up to whole
    /// seconds).
    #[arg(long, default_value_t = 2000, requires = "store")]
    pub election_ttl_ms: u64,
    /// The name this monitor gives when it leads (default: HOST:pid:PID).
    #[arg(long, value_name = "NAME", requires = "store")]
    pub advertise: Option<String>,
    /// With --store: start every instance through the failover agents registered on the store
    /// (`failover agent`, one per host), the backup on another host than the primary, rather
    /// than as this monitor's own processes.
    #[arg(long, requires = "store")]
    pub agents: bool,
}

#[derive(Args, Debug)]
pub struct AgentArgs {
    /// The control store the monitors run on (etcd://H:P[,H:P...], or an embedded directory).
    #[arg(long, value_name = "URL")]
    pub store: String,
    /// The cluster name in the control store's keys (as the monitors were given).
    #[arg(long, value_name = "NAME", default_value = "failover")]
    pub store_cluster: String,
    /// This host's name, unique among the agents.
    #[arg(long, value_name = "NAME")]
    pub host: String,
    /// Where the monitor reaches this agent (a specific address: this host's instances are
    /// reached at the same one).
    #[arg(long, value_name = "ADDR")]
    pub listen: SocketAddr,
    /// Mount points, logs and instance tables of this host's instances (a restarted agent
    /// adopts the instances found there).
    #[arg(long, value_name = "DIR")]
    pub state_dir: PathBuf,
    /// The registration's lease: the monitor counts this host's instances gone (fenced) this
    /// long after it dies, and the agent kills them itself when it cannot renew it for this
    /// long — so it should outlast the store's own hiccups (an etcd leader election).
    #[arg(long, default_value_t = 10_000)]
    pub lease_ttl_ms: u64,
}

/// Where the monitors of an application keep their state with standbys.
#[derive(Args, Debug)]
pub struct StoreArgs {
    /// Run with standbys on this control store (etcd://H:P[,H:P...], or an embedded directory):
    /// only the elected monitor acts. Without it: alone, on STATE_DIR/monitor.json.
    #[arg(long, value_name = "URL")]
    pub store: Option<String>,
    /// The cluster name in the control store's keys (one store may hold several clusters).
    #[arg(long, value_name = "NAME", default_value = "failover")]
    pub store_cluster: String,
    /// The application's name in the control store's keys (default: the spec's volume).
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
}

#[derive(Args, Debug)]
pub struct EndpointArgs {
    /// The control store the monitors run on (etcd://H:P[,H:P...], or an embedded directory).
    #[arg(long, value_name = "URL")]
    pub store: String,
    /// The cluster name in the control store's keys (as the monitors were given).
    #[arg(long, value_name = "NAME", default_value = "failover")]
    pub store_cluster: String,
    /// The application's name in the control store's keys (as the monitors use: by default the
    /// spec's volume).
    #[arg(long, value_name = "NAME")]
    pub name: String,
    /// Where clients connect.
    #[arg(long, value_name = "ADDR")]
    pub listen: SocketAddr,
}

#[derive(Args, Debug)]
pub struct ControlArgs {
    /// The monitor's --control address (the cluster secret comes from --secret-file, else
    /// from the cluster file).
    #[arg(long, value_name = "ADDR")]
    pub control: SocketAddr,
}

#[derive(Args, Debug)]
pub struct InjectArgs {
    #[command(flatten)]
    pub c: ControlArgs,
    /// kill, stop, pause or cut.
    pub fault: String,
    /// How long a pause or cut lasts (0: for good).
    #[arg(default_value_t = 0)]
    pub duration_ms: u64,
}

#[derive(Args, Debug)]
pub struct HintArgs {
    #[command(flatten)]
    pub c: ControlArgs,
    /// `never`, or milliseconds from the first missed ping until the primary answers again.
    pub back: String,
    /// How long a restart of the application would take, in milliseconds.
    #[arg(default_value_t = 0)]
    pub recovery_ms: u64,
}

#[derive(Args, Debug)]
pub struct LoadArgs {
    /// The client endpoint.
    #[arg(long, value_name = "ADDR")]
    pub endpoint: SocketAddr,
    #[arg(long, default_value_t = 10_000)]
    pub duration_ms: u64,
    /// Throughput window.
    #[arg(long, default_value_t = 100)]
    pub window_ms: u64,
    /// How long the final check may wait for the endpoint.
    #[arg(long, default_value_t = 60_000)]
    pub verify_timeout_ms: u64,
    /// Print progress to stderr, `{"acked":N,"t_ms":T}`, at most every N ms (0: never). The
    /// load stops early, then checks, on SIGTERM or Ctrl-C.
    #[arg(long, default_value_t = 0)]
    pub progress_ms: u64,
    /// Speak PostgreSQL (user and database `postgres`, trust) instead of the SQLite front's
    /// protocol: autocommit inserts into table `commits`.
    #[arg(long)]
    pub postgres: bool,
    /// Speak MySQL/MariaDB (user root, no password): inserts into `understudy.commits`.
    #[arg(long, conflicts_with = "postgres")]
    pub mysql: bool,
}

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// The application failed over.
    #[arg(long, value_enum, default_value_t = DemoApp::Sqlite)]
    pub app: DemoApp,
}

pub fn run(conn: &ConnArgs, cmd: FailoverCmd, verbose: u8) -> anyhow::Result<()> {
    match cmd {
        FailoverCmd::Run(a) => run_monitor(conn, a),
        FailoverCmd::Endpoint(a) => run_endpoint(conn, a),
        FailoverCmd::Agent(a) => run_agent(conn, a),
        FailoverCmd::Inject(a) => {
            let reply = testbed::failover::control_request(a.c.control, &control_secret(conn)?, &format!("{} {}", a.fault, a.duration_ms))?;
            println!("{reply}");
            Ok(())
        }
        FailoverCmd::Status(a) => {
            println!("{}", testbed::failover::control_request(a.control, &control_secret(conn)?, "status")?);
            Ok(())
        }
        FailoverCmd::Hint(a) => {
            anyhow::ensure!(a.back == "never" || a.back.parse::<u64>().is_ok(), "BACK must be `never` or milliseconds, not {:?}", a.back);
            println!("{}", testbed::failover::control_request(a.c.control, &control_secret(conn)?, &format!("hint {} {}", a.back, a.recovery_ms))?);
            Ok(())
        }
        FailoverCmd::Load(a) => load(a),
        FailoverCmd::SqliteFront(a) => testbed::sqlite_front::run(a),
        FailoverCmd::Postgres(a) => testbed::postgres::run(a),
        FailoverCmd::Mariadb(a) => testbed::mariadb::run(a),
        FailoverCmd::Demo(a) => eval::failover::demo::demo(verbose, a.app),
    }
}

/// The cluster secret the monitor's control port asks for: `--secret-file`, else the cluster
/// file's (`--cluster`, $UNDERSTUDY_CLUSTER, or the default one).
fn control_secret(conn: &ConnArgs) -> anyhow::Result<Vec<u8>> {
    testbed::cluster_file::resolve_secret(conn.cluster.as_deref(), conn.secret_file.as_deref())
}

/// Arguments that let `understudy volume attach/detach` find the same cluster.
fn conn_args(conn: &ConnArgs) -> Vec<String> {
    let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf()).to_string_lossy().into_owned();
    let mut v = vec![];
    if let Some(c) = &conn.cluster {
        v.extend(["--cluster".to_string(), abs(c)]);
    }
    if let Some(m) = &conn.meta {
        v.extend(["--meta".to_string(), m.clone()]);
    }
    if let Some(s) = &conn.secret_file {
        v.extend(["--secret-file".to_string(), abs(s)]);
    }
    if conn.cluster.is_none() && (conn.meta.is_none() || conn.secret_file.is_none()) {
        let default = Path::new(testbed::cluster_file::DEFAULT_DIR).join(testbed::cluster_file::CLUSTER_FILE);
        v.extend(["--cluster".to_string(), abs(&default)]);
    }
    v
}

fn run_monitor(conn: &ConnArgs, a: RunArgs) -> anyhow::Result<()> {
    let mut spec = Spec::load(&a.spec)?;
    std::fs::create_dir_all(&spec.state_dir).with_context(|| format!("cannot create state_dir {}", spec.state_dir.display()))?;
    spec.state_dir = spec.state_dir.canonicalize()?;
    let target = conn.target()?;
    let rt = crate::runtime()?;
    rt.block_on(async {
        let cluster = target.connect().await?;
        // With the control store: stand for election first; a standby waits here, and touches
        // neither the instances nor the state until it leads.
        let store = match &a.store.store {
            None => None,
            Some(url) => Some(lead_on_store(&spec, &a, url, &target.secret).await?),
        };
        // A missing volume is the commonest mistake: say so before starting anything.
        let journal = ::failover::journal::FileJournal::new(&spec.state_dir.join("monitor.json"));
        let stored = match &store {
            Some(j) => j.loaded().map(|r| r.state.volume.clone()),
            None => journal.load()?.map(|r| r.state.volume),
        };
        let volume = stored.unwrap_or_else(|| spec.volume.clone());
        cluster.volume_info(&volume).await.with_context(|| {
            format!("volume {volume:?} of the spec: create it first (`understudy volume create {volume} --size 1G`, then run with `mkfs = true`)")
        })?;
        let (netns, why_not) = ::failover::netns::resolve(spec.network.namespaces)?;
        if let Some(w) = why_not {
            eprintln!("understudy failover: {w}");
        }
        // On the store the endpoints are processes of their own (`failover endpoint`).
        let endpoint = match store {
            Some(_) => None,
            None => Some(Arc::new(
                ::failover::endpoint::Proxy::bind(spec.endpoint.listen, None)
                    .await
                    .with_context(|| format!("cannot listen on the endpoint address {}", spec.endpoint.listen))?,
            )),
        };
        let (inputs_tx, inputs_rx) = mpsc::channel(::failover::driver::INPUT_QUEUE);
        let pool = match (&store, a.agents) {
            (Some(j), true) => {
                let name = a.store.name.clone().unwrap_or_else(|| spec.volume.clone());
                let remote = Arc::new(::failover::agent::RemotePool::new(::failover::agent::RemotePoolConfig {
                    store: j.daemon().store().clone(),
                    leadership: j.daemon().leadership().clone(),
                    name,
                    app: spec.app.clone(),
                    mkfs_first: spec.mkfs,
                    secret: target.secret.clone(),
                    start_timeout: Duration::from_secs(330),
                }));
                let agents = remote.live_agents().await.map_err(anyhow::Error::msg)?;
                eprintln!("understudy failover: instances run on the failover agents; live now: {agents:?}");
                let adopted = remote.adopt().await.map_err(anyhow::Error::msg)?;
                if !adopted.is_empty() {
                    eprintln!("understudy failover: found the instances the previous leader placed: {adopted:?}");
                }
                ::failover::driver::AnyPool::Remote(remote)
            }
            _ => {
                let pool = Arc::new(LocalPool::new(
                    LocalPoolConfig {
                        exe: std::env::current_exe()?,
                        conn_args: conn_args(conn),
                        state_dir: spec.state_dir.clone(),
                        app: spec.app.clone(),
                        mkfs_first: spec.mkfs,
                        attach_timeout: Duration::from_secs(300),
                        netns,
                    },
                    inputs_tx.clone(),
                )?);
                // Which way a killed instance dies whole (its cgroup, or its process tree): said once.
                eprintln!("understudy failover: {}", pool.containment().describe());
                let adopted = pool.adopt().await;
                if !adopted.is_empty() {
                    eprintln!("understudy failover: adopted the instances left running by the previous run: {adopted:?}");
                }
                ::failover::driver::AnyPool::Local(pool)
            }
        };
        let (control_tx, control_rx) = mpsc::channel::<Control>(64);
        let control_addr = match a.control {
            Some(addr) => {
                let l = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on --control {addr}"))?;
                let local = l.local_addr()?;
                tokio::spawn(::failover::driver::serve_control(l, target.secret.clone(), wire::link::process()?.cloned(), control_tx));
                Some(local)
            }
            None => None,
        };
        let start = std::time::Instant::now();
        let ready = serde_json::json!({
            "event": "ready", "endpoint": endpoint.as_ref().map(|e| e.local_addr()), "control": control_addr,
            "state_dir": spec.state_dir, "policy": spec.monitor.policy, "pid": std::process::id(),
            "netns": netns,
        });
        println!("{ready}");
        let _ = std::io::stdout().flush();
        let on_event = move |e: &::failover::Event| {
            let mut v = serde_json::to_value(e).unwrap();
            v["t_ms"] = serde_json::json!(start.elapsed().as_millis() as u64);
            // Wall-clock time too, to line events up with what other processes saw (the
            // bench's fault injections and client acknowledgements).
            v["unix_ms"] = serde_json::json!(::failover::proto::now_unix_ms());
            println!("{v}");
            let _ = std::io::stdout().flush();
        };
        let shutdown = async {
            let sig = testbed::proc::shutdown_signal().await;
            eprintln!("understudy failover: {sig} received: stopping every instance");
        };
        let r = ::failover::driver::run(
            &spec,
            ::failover::driver::Parts { cluster, pool, inputs: inputs_rx, inputs_tx, endpoint, control: control_rx, store },
            on_event,
            shutdown,
        )
        .await;
        match r {
            Ok(d) => {
                eprintln!("understudy failover: stopped; the volume is {} ({} failovers)", d.volume, d.failovers);
                Ok(())
            }
            Err(::failover::driver::DriverError::SteppedDown(why)) => {
                // Out at once, without stopping the instances: the next leader adopts them.
                eprintln!("understudy failover: no longer the leader: {why}; exiting with the instances left running (restart to stand by)");
                let _ = std::io::stderr().flush();
                std::process::exit(STEPPED_DOWN_EXIT);
            }
            Err(e) => Err(anyhow::Error::from(e)),
        }
    })
}

/// The exit status of a monitor that stopped leading (its instances left to the next leader).
pub const STEPPED_DOWN_EXIT: i32 = 3;

/// Stands for the election of the spec's application on the control store until leading, then
/// reads the state the previous leader left. Prints `standing` (JSON) when it stands and
/// `leading` once it leads.
async fn lead_on_store(spec: &Spec, a: &RunArgs, url: &str, secret: &[u8]) -> anyhow::Result<::failover::driver::store::StoreJournal> {
    anyhow::ensure!(a.election_ttl_ms >= 1000, "--election-ttl-ms must be at least 1000 (etcd leases are whole seconds)");
    let name = a.store.name.clone().unwrap_or_else(|| spec.volume.clone());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let advertise = a.advertise.clone().unwrap_or_else(|| format!("{}:pid:{}", host.trim(), std::process::id()));
    let cfg = control::DaemonConfig {
        store_url: url.to_string(),
        cluster: a.store.store_cluster.clone(),
        cluster_id: control::daemon::cluster_id_from_secret("failover", secret),
        election: ::failover::driver::store::election(&name),
        election_ttl: Duration::from_millis(a.election_ttl_ms),
        advertise: advertise.clone(),
    };
    let election = cfg.election.clone();
    let print = move |v: serde_json::Value| {
        println!("{v}");
        let _ = std::io::stdout().flush();
    };
    let (name2, adv2) = (name.clone(), advertise.clone());
    let daemon = control::Daemon::lead(cfg, move |lost| {
        let why = lost.map(|e| e.to_string());
        println!("{}", serde_json::json!({"event": "standing", "election": election, "name": name2, "advertise": adv2, "after": why, "pid": std::process::id(), "unix_ms": ::failover::proto::now_unix_ms()}));
        let _ = std::io::stdout().flush();
    })
    .await
    .with_context(|| format!("control store {url}"))?;
    let token = daemon.fencing_token();
    let (journal, rec) = ::failover::driver::store::StoreJournal::open(daemon, &name).await?;
    print(serde_json::json!({
        "event": "leading", "name": name, "advertise": advertise, "fencing_token": token, "epoch": journal.epoch(),
        "phase": rec.as_ref().map(|r| format!("{:?}", r.state.phase)), "pid": std::process::id(), "unix_ms": ::failover::proto::now_unix_ms(),
    }));
    Ok(journal)
}

/// How long an agent that lost its lease waits between attempts to register again.
const AGENT_REREGISTER_MS: u64 = 500;

/// `failover agent`: this host's instances for the monitor, registered under a lease.
fn run_agent(conn: &ConnArgs, a: AgentArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!a.listen.ip().is_unspecified(), "--listen must be this host's own address (instances are reached at it), not {}", a.listen.ip());
    anyhow::ensure!(a.lease_ttl_ms >= 1000, "--lease-ttl-ms must be at least 1000 (etcd leases are whole seconds)");
    let secret = control_secret(conn)?;
    std::fs::create_dir_all(&a.state_dir).with_context(|| format!("cannot create --state-dir {}", a.state_dir.display()))?;
    let state_dir = a.state_dir.canonicalize()?;
    let rt = crate::runtime()?;
    rt.block_on(async {
        let store = control::Store::open(&a.store, &a.store_cluster, &control::daemon::cluster_id_from_secret("failover", &secret))
            .await
            .with_context(|| format!("control store {}", a.store))?;
        let agent = Arc::new(::failover::agent::Agent::new(::failover::agent::AgentConfig {
            exe: std::env::current_exe()?,
            conn_args: conn_args(conn),
            state_dir,
            link_ip: a.listen.ip(),
            attach_timeout: Duration::from_secs(300),
        })?);
        let adopted = agent.adopt_all().await;
        let l = tokio::net::TcpListener::bind(a.listen).await.with_context(|| format!("cannot listen on --listen {}", a.listen))?;
        let addr = l.local_addr()?;
        tokio::spawn(::failover::agent::server::serve(l, secret.clone(), agent.clone()));
        // Registered only once it serves: a monitor that sees the key can reach it.
        let reg = store
            .register(::failover::agent::proto::AGENT_KIND, &a.host, &addr.to_string(), Duration::from_millis(a.lease_ttl_ms))
            .await
            .with_context(|| format!("registering host {} in the control store", a.host))?;
        println!("{}", serde_json::json!({"event": "ready", "host": a.host, "listen": addr, "key": reg.key(), "adopted": adopted, "pid": std::process::id()}));
        let _ = std::io::stdout().flush();
        let shutdown = testbed::proc::shutdown_signal();
        tokio::pin!(shutdown);
        let mut reg = reg;
        loop {
            tokio::select! {
                why = reg.lost() => {
                    // The monitor counts this host's instances fenced once the lease is gone:
                    // they must not serve on (Patroni's demotion of a leader that cannot renew).
                    agent.fence_all().await;
                    println!("{}", serde_json::json!({"event": "fenced", "host": a.host, "why": why, "unix_ms": ::failover::proto::now_unix_ms()}));
                    let _ = std::io::stdout().flush();
                    eprintln!("understudy failover agent: lease lost ({why}): every instance here killed; registering again");
                }
                sig = &mut shutdown => {
                    eprintln!("understudy failover agent: {sig} received: stopping every instance here");
                    agent.stop_all().await;
                    let _ = reg.deregister().await;
                    return Ok(());
                }
            }
            // Back in service once the store answers again (with no instance: the monitor
            // places new ones).
            reg = loop {
                match store.register(::failover::agent::proto::AGENT_KIND, &a.host, &addr.to_string(), Duration::from_millis(a.lease_ttl_ms)).await {
                    Ok(r) => break r,
                    Err(e) => {
                        eprintln!("understudy failover agent: registering again: {e}");
                        tokio::time::sleep(Duration::from_millis(AGENT_REREGISTER_MS)).await;
                    }
                }
            };
            println!("{}", serde_json::json!({"event": "ready", "host": a.host, "listen": addr, "key": reg.key(), "adopted": [], "pid": std::process::id()}));
            let _ = std::io::stdout().flush();
        }
    })
}

/// `failover endpoint`: a proxy that follows the primary record on the control store.
fn run_endpoint(conn: &ConnArgs, a: EndpointArgs) -> anyhow::Result<()> {
    let secret = control_secret(conn)?;
    let rt = crate::runtime()?;
    rt.block_on(async {
        let store = control::Store::open(&a.store, &a.store_cluster, &control::daemon::cluster_id_from_secret("failover", &secret))
            .await
            .with_context(|| format!("control store {}", a.store))?;
        let proxy = Arc::new(::failover::endpoint::Proxy::bind(a.listen, None).await.with_context(|| format!("cannot listen on --listen {}", a.listen))?);
        println!("{}", serde_json::json!({"event": "ready", "endpoint": proxy.local_addr(), "name": a.name, "pid": std::process::id()}));
        let _ = std::io::stdout().flush();
        let on_change = |p: &::failover::proto::PrimaryRecord| {
            let mut v = serde_json::to_value(p).unwrap();
            v["event"] = serde_json::json!("endpoint");
            v["unix_ms"] = serde_json::json!(::failover::proto::now_unix_ms());
            println!("{v}");
            let _ = std::io::stdout().flush();
        };
        tokio::select! {
            _ = ::failover::endpoint::follow(store, a.name.clone(), proxy.clone(), on_change) => {}
            sig = testbed::proc::shutdown_signal() => eprintln!("understudy failover endpoint: {sig} received: stopping"),
        }
        Ok(())
    })
}

fn load(a: LoadArgs) -> anyhow::Result<()> {
    let rt = crate::runtime()?;
    rt.block_on(async {
        let stop = async {
            testbed::proc::shutdown_signal().await;
        };
        let target = if a.postgres {
            ::failover::load::Target::Postgres(Default::default())
        } else if a.mysql {
            ::failover::load::Target::Mysql(Default::default())
        } else {
            ::failover::load::Target::Line
        };
        let progress_ms = a.progress_ms;
        let mut last_shown: Option<u64> = None;
        let on_ack = move |n: usize, t_ms: u64| {
            if progress_ms == 0 || last_shown.is_some_and(|l| t_ms < l + progress_ms) {
                return;
            }
            last_shown = Some(t_ms);
            eprintln!("{}", serde_json::json!({ "acked": n, "t_ms": t_ms }));
        };
        let r = ::failover::load::run_load_observed(a.endpoint, &target, Duration::from_millis(a.duration_ms), a.window_ms, stop, on_ack).await;
        let v = ::failover::load::verify(a.endpoint, &target, &r, Duration::from_millis(a.verify_timeout_ms)).await.map_err(anyhow::Error::msg)?;
        let ok = v.missing.is_empty() && v.unexpected.is_empty();
        let out = serde_json::json!({
            "ok": ok,
            "verdict": v,
            "acked": r.acked.len(),
            "attempted": r.attempted_max,
            "errors": r.errors,
            "duration_ms": r.duration_ms,
            "max_gap_ms": r.max_gap_ms,
            "gap_start_ms": r.gap_start_ms,
            "gap_end_ms": r.gap_end_ms,
            "window_ms": r.window_ms,
            "ops_per_window": r.ops_per_window,
        });
        println!("{out}");
        anyhow::ensure!(ok, "acknowledged commits missing {:?} or unexpected rows {:?}", v.missing, v.unexpected);
        Ok(())
    })
}
