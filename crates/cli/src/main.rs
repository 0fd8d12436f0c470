//! `understudy`: the one binary of the project.
//!
//! * daemons: `meta` (metadata service), `shard` (storage shard), `nbd` (NBD server exporting
//!   every volume by name) — see [`daemons`];
//! * `up`: a whole local cluster on loopback, as child processes of itself — see [`up`];
//! * client commands: `volume ...` and `status`, which find the cluster through its
//!   `cluster.json` — see [`volume_cmds`] and [`attach`];
//! * `demo`: super and collapse, both ways, through a real NBD client — see [`demo`];
//! * `bench`: benchmarks on throw-away clusters — see [`bench_cmds`].
//!
//! Errors reach the user as one line (`error: ...`) and a non-zero exit code.

mod attach;
mod bench_cmds;
mod daemons;
mod demo;
mod exports;
mod failover;
mod kv;
mod nearlog;
mod size;
mod up;
mod volume_cmds;

use std::path::PathBuf;

use clap::{ArgAction, Args, Parser, Subcommand};

/// Cheap high availability for storage: four systems in one binary.
///
/// `volume`: replicated block volumes with instant `super` clones and atomic `collapse`
/// (SpecREDS); `failover`: a monitor that recovers an application speculatively on a `super`
/// child while its primary may still come back (SpecREDS); `nearlog`: small synchronous log
/// writes replicated to spare memory on log peers, through an LD_PRELOAD shim (SplitFT); `kv`: a
/// leaderless replicated key-value store with online incremental recovery (HEAL), and, being
/// built, the primary / backup / witness KV (CANDStore: `kv up --protocol witness`).
///
/// Start a local volume cluster with `understudy volume up`, then create volumes and attach them
/// over NBD (`qemu-io -f raw nbd://127.0.0.1:7701/NAME`) or as a mounted ext4 file system
/// (`understudy volume attach NAME --mount DIR --mkfs`). `understudy demo` shows super and
/// collapse end to end with nothing to set up; `understudy bench AREA EXPERIMENT` reproduces
/// the papers' experiments.
///
/// Logs go to stderr; RUST_LOG (e.g. RUST_LOG=volume=debug) overrides -v.
#[derive(Parser, Debug)]
#[command(name = "understudy", version, propagate_version = true, max_term_width = 100)]
struct Cli {
    /// More log output on stderr: -v info, -vv debug, -vvv trace (RUST_LOG overrides).
    #[arg(short, long, action = ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Replicated block volumes (SpecREDS): the daemons, a local cluster, and the client commands.
    ///
    /// `up` starts a whole local cluster; `meta`, `shard` and `nbd` run its daemons one by one.
    /// The client commands (status, create, list, super, collapse, attach, …) find the cluster
    /// through --cluster (default ./understudy-data/cluster.json, or $UNDERSTUDY_CLUSTER),
    /// written by `understudy volume up`; --meta and --secret-file point at any other cluster.
    /// The connection options go after the command (`volume create NAME --cluster FILE`) or
    /// before it (`volume --cluster FILE create NAME`).
    Volume {
        #[command(flatten)]
        conn: VolumeConn,
        #[command(subcommand)]
        cmd: VolumeCmd,
    },
    /// Speculative failover of an application on a volume: monitor, instance pool, endpoint.
    ///
    /// `failover run SPEC` runs an application instance on a volume behind a stable client
    /// endpoint and fails it over (REDS, speculative or oracle policy) when its health check
    /// fails; `inject` and `status` talk to a running monitor; `load` and `sqlite-front` are
    /// the bundled test application and its client.
    Failover {
        #[command(flatten)]
        conn: ConnArgs,
        #[command(subcommand)]
        cmd: failover::FailoverCmd,
    },
    /// Near-compute log (SplitFT): log peers, controller, a local cluster for the LD_PRELOAD shim.
    #[command(subcommand)]
    Nearlog(nearlog::NearlogCmd),
    /// Leaderless replicated key-value store with HEAL recovery: node, cm, up, get, put.
    #[command(subcommand)]
    Kv(kv::KvCmd),
    /// Super and collapse, both ways, on a throw-away local cluster, as a timeline.
    ///
    /// Brings up a cluster in a fresh temporary directory, creates a volume and writes to it
    /// with qemu-io over NBD, runs `super`, writes to the child as a recovering application
    /// would while the parent stays silent, and collapses: the child is promoted (checked by
    /// reading it back; a parent write now fails). Then a second round where the parent keeps
    /// writing after `super`: collapse rejects the child and the parent keeps its writes.
    /// Cleans everything up; exits 0 only if every check held. Needs qemu-io (qemu-utils).
    Demo(demo::DemoArgs),
    /// Benchmarks, each on a throw-away local cluster; the last line of stdout is JSON.
    ///
    /// `--quick` finishes in about a minute and still measures every figure; without it the
    /// run reproduces the paper's experiment at the largest size this machine allows.
    #[command(subcommand)]
    Bench(bench_cmds::BenchCmd),
    // The volume commands that were top-level before the tree had one branch per system; kept,
    // hidden, so scripts keep working. Each is exactly its `volume …` namesake.
    /// Same as `understudy volume meta`.
    #[command(hide = true)]
    Meta(daemons::MetaArgs),
    /// Same as `understudy volume shard`.
    #[command(hide = true)]
    Shard(daemons::ShardArgs),
    /// Same as `understudy volume nbd`.
    #[command(hide = true)]
    Nbd(daemons::NbdArgs),
    /// Same as `understudy volume up`.
    #[command(hide = true)]
    Up(up::UpArgs),
    /// Same as `understudy volume status`.
    #[command(hide = true)]
    Status {
        #[command(flatten)]
        conn: ConnArgs,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// How client commands find the cluster.
#[derive(Args, Debug, Clone)]
pub struct ConnArgs {
    /// The cluster file written by `understudy volume up`.
    #[arg(long, global = true, env = "UNDERSTUDY_CLUSTER", value_name = "FILE")]
    pub cluster: Option<PathBuf>,
    /// Address of the metadata service (instead of the one in the cluster file).
    #[arg(long, global = true, value_name = "ADDR")]
    pub meta: Option<String>,
    /// File holding the cluster secret (instead of the one in the cluster file).
    #[arg(long, global = true, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
}

impl ConnArgs {
    /// The cluster these options name (see [`testbed::cluster_file::Target::resolve`]).
    pub fn target(&self) -> anyhow::Result<testbed::cluster_file::Target> {
        testbed::cluster_file::Target::resolve(self.cluster.as_deref(), self.meta.as_deref(), self.secret_file.as_deref())
    }
}

/// How a volume client command finds the cluster: the same options as [`ConnArgs`], given to one
/// command (not global: the daemons under `volume` have their own `--meta` and `--secret-file`).
#[derive(Args, Debug, Clone, Default)]
pub struct VolumeConn {
    /// The cluster file written by `understudy volume up` [default: $UNDERSTUDY_CLUSTER, else
    /// ./understudy-data/cluster.json].
    #[arg(long, value_name = "FILE")]
    pub cluster: Option<PathBuf>,
    /// Address of the metadata service (instead of the one in the cluster file).
    #[arg(long, value_name = "ADDR")]
    pub meta: Option<String>,
    /// File holding the cluster secret (instead of the one in the cluster file).
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
}

impl VolumeConn {
    /// The options given after the command, each falling back to the one given before it
    /// (`volume --cluster F create …`), the cluster file then to $UNDERSTUDY_CLUSTER.
    fn over(&self, before: &VolumeConn) -> ConnArgs {
        self.over_env(before, std::env::var_os("UNDERSTUDY_CLUSTER"))
    }

    /// [`Self::over`] with the environment's cluster file given: an option on the command line,
    /// before or after the command, beats the variable (with `env` on the options at both levels
    /// the variable filled the command's own option and beat an explicit one before it).
    fn over_env(&self, before: &VolumeConn, env_cluster: Option<std::ffi::OsString>) -> ConnArgs {
        ConnArgs {
            cluster: self
                .cluster
                .clone()
                .or_else(|| before.cluster.clone())
                .or_else(|| env_cluster.filter(|v| !v.is_empty()).map(PathBuf::from)),
            meta: self.meta.clone().or_else(|| before.meta.clone()),
            secret_file: self.secret_file.clone().or_else(|| before.secret_file.clone()),
        }
    }
}

impl VolumeCmd {
    /// The connection options of a client command (the daemons and `up` have none).
    fn conn(&self) -> Option<&VolumeConn> {
        match self {
            VolumeCmd::Up(_) | VolumeCmd::Meta(_) | VolumeCmd::Shard(_) | VolumeCmd::Nbd(_) => None,
            VolumeCmd::Status { conn, .. }
            | VolumeCmd::List { conn, .. }
            | VolumeCmd::Info { conn, .. }
            | VolumeCmd::Delete { conn, .. }
            | VolumeCmd::Collapse { conn, .. }
            | VolumeCmd::CloneGeneral { conn, .. } => Some(conn),
            VolumeCmd::Create(a) => Some(&a.conn),
            VolumeCmd::Resize(a) => Some(&a.conn),
            VolumeCmd::Super(a) => Some(&a.conn),
            VolumeCmd::Attach(a) => Some(&a.conn),
            VolumeCmd::Detach(a) => Some(&a.conn),
        }
    }
}

#[derive(Subcommand, Debug)]
enum VolumeCmd {
    /// Start a local cluster on loopback (metadata service, shards, NBD server) and stay in the
    /// foreground until Ctrl-C.
    ///
    /// From nothing it creates DIR, a random cluster secret (DIR/secret, mode 0600), one data
    /// directory per process and their logs under DIR/logs/; it waits until every shard is up,
    /// prints the endpoints and writes them to DIR/cluster.json, which the client commands
    /// read. Running it again on the same DIR reuses the data, the secret and the ports.
    /// Ports: metadata PORT_BASE, NBD PORT_BASE+1, shards PORT_BASE+2 onwards (--port-base 0
    /// picks free ports). A daemon that exits is started again on its data and address (the
    /// others keep serving meanwhile; open volumes' I/O does not need the metadata service).
    Up(up::UpArgs),
    /// Run the metadata service (volumes, cluster map, super/collapse orchestration).
    ///
    /// Keeps its state in DIR/meta.json (replaced atomically on every change), listens for
    /// shards and control clients on ADDR, pings every shard and marks one down after
    /// --down-after-ms without an answer, or at once when its link closes (a killed shard).
    /// With --store etcd://..., run two or three: they stand for leadership in the control
    /// store; only the leader listens on its ADDR and serves, keeping its state there as keys
    /// (one per volume, job and collapse record); a standby takes over about one
    /// --election-ttl-ms after the leader dies, and a leader that loses its lease exits (status
    /// 75). Stops on SIGTERM or Ctrl-C.
    Meta(daemons::MetaArgs),
    /// Run a storage shard.
    ///
    /// Stores objects as files under DIR, registers with the metadata service at --meta and
    /// serves clients and peer shards on --listen. The data directory must exist unless
    /// --create is given; a restarted shard (or a replacement with the same --id and an empty
    /// directory) re-replicates what it missed before it serves as a primary again.
    Shard(daemons::ShardArgs),
    /// Run an NBD server exporting every volume by name.
    ///
    /// A client names the volume in its URI: `nbd://HOST:PORT/VOLUME` (or
    /// `nbd+unix:///VOLUME?socket=PATH` with --unix). Each connection opens the volume through
    /// the metadata service; writes to a parent fenced by `collapse` fail with EPERM.
    Nbd(daemons::NbdArgs),
    /// Show the cluster map (shards, their states, the epoch) and the jobs in progress.
    Status {
        #[command(flatten)]
        conn: VolumeConn,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Create a volume.
    ///
    /// Sizes take binary units: 512, 4K, 64KiB, 1G, 1.5T (K = 1024). A volume is thin: no
    /// space is used until it is written.
    Create(volume_cmds::CreateArgs),
    /// List volumes.
    List {
        #[command(flatten)]
        conn: VolumeConn,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one volume: size, object size, id, table, super parent or child.
    Info {
        name: String,
        #[command(flatten)]
        conn: VolumeConn,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Delete a volume and (asynchronously) every object of it.
    Delete {
        name: String,
        #[command(flatten)]
        conn: VolumeConn,
    },
    /// Grow a volume (shrinking is refused: it would discard data).
    Resize(volume_cmds::ResizeArgs),
    /// Make an instant collocated copy-on-write child of PARENT; prints the child's name.
    ///
    /// O(1): the child reuses the parent's allocation table, so its objects live on the very
    /// shards of its parent's and a copy-on-write is a local copy. Until `collapse`, the
    /// parent's first write on each shard sets the dirty bit. The child's default name is
    /// PARENT.super-N (the smallest unused N).
    Super(volume_cmds::SuperArgs),
    /// Decide between a super child and its parent, atomically; prints `promoted` or `rejected`.
    ///
    /// promoted: the parent was not written after `super`: parent writes now fail and the child
    /// is the volume (under the child's name). rejected: the parent was written: the child is
    /// discarded and the parent goes on. Garbage collection then runs in the background.
    /// A broken connection or an undecided collapse (tracking shard silent) is asked again for
    /// up to two minutes; collapsing again prints the outcome already decided.
    Collapse {
        child: String,
        #[command(flatten)]
        conn: VolumeConn,
    },
    /// Make an rbd-style general clone CHILD of PARENT (the baseline super is compared with).
    ///
    /// The child gets its own allocation table: objects placed independently of the parent's,
    /// copy-up across the network and an object-map update per copied object.
    CloneGeneral {
        parent: String,
        child: String,
        #[command(flatten)]
        conn: VolumeConn,
    },
    /// Attach a volume as a mounted file system: FUSE file → loop device → [mkfs.ext4] → mount.
    ///
    /// By default a background helper process serves the FUSE file (its pid and log are kept
    /// under /run/understudy/attach/, or $XDG_RUNTIME_DIR when not root) and this command
    /// returns once the file system is mounted; `understudy volume detach DIR` unmounts it and
    /// stops the helper. With --foreground the command itself serves the file until Ctrl-C or
    /// `detach`. Needs root, /dev/fuse, losetup and mount.
    Attach(attach::AttachArgs),
    /// Undo `volume attach`: unmount DIR, release the loop device, stop the FUSE helper.
    Detach(attach::DetachArgs),
}

fn init_logging(verbose: u8, default_level: &str) {
    use tracing_subscriber::EnvFilter;
    let level = match verbose {
        0 => default_level,
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = match std::env::var("RUST_LOG") {
        Ok(s) if !s.is_empty() => EnvFilter::new(s),
        _ => EnvFilter::new(level),
    };
    use std::io::IsTerminal;
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal()).init();
}

/// Client commands die quietly when their output pipe closes (`understudy volume list | head`),
/// like other Unix tools, instead of panicking on EPIPE. Daemons keep Rust's default (ignored).
fn restore_sigpipe() {
    // SAFETY: resetting a signal disposition to its default before any thread is started.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}

/// The runtime of a storage shard and of the NBD server: one thread for the async work (their
/// disk commands run on blocking threads all the same). A local cluster runs several of these
/// processes on a few cores; with a worker thread per core each, every message handed between
/// tasks could wake another worker thread, and thread wakeups and switches were the biggest
/// CPU cost per write in a profile of 4 KiB writes at depth 32.
fn io_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Volume { conn, cmd } => run_volume(&conn, cmd, cli.verbose),
        Cmd::Meta(a) => run_volume(&VolumeConn::default(), VolumeCmd::Meta(a), cli.verbose),
        Cmd::Shard(a) => run_volume(&VolumeConn::default(), VolumeCmd::Shard(a), cli.verbose),
        Cmd::Nbd(a) => run_volume(&VolumeConn::default(), VolumeCmd::Nbd(a), cli.verbose),
        Cmd::Up(a) => run_volume(&VolumeConn::default(), VolumeCmd::Up(a), cli.verbose),
        Cmd::Status { conn, json } => {
            let conn = VolumeConn { cluster: conn.cluster, meta: conn.meta, secret_file: conn.secret_file };
            run_volume(&VolumeConn::default(), VolumeCmd::Status { conn, json }, cli.verbose)
        }
        Cmd::Demo(a) => {
            init_logging(cli.verbose, "warn");
            demo::demo(a, cli.verbose)
        }
        Cmd::Failover { conn, cmd } => {
            init_logging(cli.verbose, "warn,fuser=error");
            failover::run(&conn, cmd, cli.verbose)
        }
        Cmd::Nearlog(cmd) => {
            init_logging(cli.verbose, "info");
            runtime()?.block_on(nearlog::run(cmd))
        }
        Cmd::Bench(cmd) => {
            init_logging(cli.verbose, "warn");
            bench_cmds::run(cmd, cli.verbose)
        }
        Cmd::Kv(cmd) => kv::run(cmd, cli.verbose),
    }
}

/// `understudy volume …`; `before` holds the connection options given before the command.
fn run_volume(before: &VolumeConn, cmd: VolumeCmd, verbose: u8) -> anyhow::Result<()> {
    let conn = cmd.conn().map(|c| c.over(before)).unwrap_or_else(|| VolumeConn::default().over(before));
    match cmd {
        VolumeCmd::Meta(a) => {
            init_logging(verbose, "info");
            runtime()?.block_on(daemons::meta(a))
        }
        VolumeCmd::Shard(a) => {
            init_logging(verbose, "info");
            io_runtime()?.block_on(daemons::shard(a))
        }
        VolumeCmd::Nbd(a) => {
            init_logging(verbose, "info");
            io_runtime()?.block_on(daemons::nbd(a))
        }
        VolumeCmd::Up(a) => {
            init_logging(verbose, "info");
            up::up(a, verbose)
        }
        VolumeCmd::Status { json, .. } => {
            restore_sigpipe();
            init_logging(verbose, "warn");
            runtime()?.block_on(volume_cmds::status(&conn, json))
        }
        cmd => {
            let foreground_attach = matches!(&cmd, VolumeCmd::Attach(a) if a.foreground || a.helper);
            if !foreground_attach {
                restore_sigpipe();
            }
            // fuser warns about every xattr it does not implement: keep its errors only.
            init_logging(verbose, if foreground_attach { "info,fuser=error" } else { "warn" });
            match cmd {
                VolumeCmd::Attach(a) => attach::attach(&conn, a, verbose),
                VolumeCmd::Detach(a) => attach::detach(a),
                cmd => runtime()?.block_on(volume_cmds::run(&conn, cmd)),
            }
        }
    }
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        // One line: the error and its causes, outermost first.
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn every_command_has_help() {
        fn walk(cmd: &clap::Command, path: &str) {
            for sub in cmd.get_subcommands() {
                if sub.get_name() == "help" {
                    continue;
                }
                let p = format!("{path} {}", sub.get_name());
                assert!(sub.get_about().is_some(), "`{p}` has no one-line description");
                walk(sub, &p);
            }
        }
        walk(&Cli::command(), "understudy");
    }

    fn parse(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("understudy").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?} does not parse: {e}"))
    }

    /// The old top-level volume commands are hidden aliases: each parses to exactly what its
    /// `volume …` namesake parses to, and none is listed in the help.
    #[test]
    fn old_top_level_volume_commands_are_hidden_aliases() {
        let cases: [&[&str]; 5] = [
            &["meta", "--dir", "d", "--secret-file", "s", "--listen", "127.0.0.1:1"],
            &["shard", "--id", "3", "--dir", "d", "--listen", "127.0.0.1:2", "--meta", "127.0.0.1:1", "--secret-file", "s", "--create"],
            &["nbd", "--meta", "127.0.0.1:1", "--secret-file", "s"],
            &["up", "--dir", "d", "--shards", "4"],
            &["status", "--cluster", "c.json", "--json"],
        ];
        for old in cases {
            let new: Vec<&str> = std::iter::once("volume").chain(old.iter().copied()).collect();
            let (Cli { cmd: old_cmd, .. }, Cli { cmd: new_cmd, .. }) = (parse(old), parse(&new));
            let Cmd::Volume { cmd: new_cmd, .. } = new_cmd else { panic!("{new:?} is not a volume command") };
            let old_text = format!("{old_cmd:?}");
            let new_text = format!("{new_cmd:?}").replace("VolumeConn", "ConnArgs");
            assert_eq!(old_text, new_text, "`{}` and `{}` differ", old.join(" "), new.join(" "));
        }
        let help = Cli::command().render_help().to_string();
        for hidden in ["meta", "shard", "nbd", "up", "status"] {
            assert!(!help.lines().any(|l| l.trim_start().starts_with(&format!("{hidden} "))), "`{hidden}` is listed:\n{help}");
        }
    }

    /// A volume client command takes the connection options after its name or before it; after
    /// wins, and each option falls back on its own.
    #[test]
    fn volume_connection_options_go_before_or_after_the_command() {
        let conn_of = |args: &[&str]| match parse(args).cmd {
            Cmd::Volume { conn, cmd } => cmd.conn().cloned().unwrap_or_default().over(&conn),
            other => panic!("{other:?}"),
        };
        let after = conn_of(&["volume", "create", "v", "--size", "1M", "--cluster", "a.json"]);
        assert_eq!(after.cluster.as_deref(), Some(std::path::Path::new("a.json")));
        let before = conn_of(&["volume", "--cluster", "b.json", "create", "v", "--size", "1M"]);
        assert_eq!(before.cluster.as_deref(), Some(std::path::Path::new("b.json")));
        let both = conn_of(&["volume", "--cluster", "b.json", "--meta", "m:1", "collapse", "c", "--cluster", "a.json"]);
        assert_eq!(both.cluster.as_deref(), Some(std::path::Path::new("a.json")));
        assert_eq!(both.meta.as_deref(), Some("m:1"));
        // An option given on the command line, before or after the command, beats
        // $UNDERSTUDY_CLUSTER; the variable fills in only where neither names a cluster file.
        let parsed = |args: &[&str]| match parse(args).cmd {
            Cmd::Volume { conn, cmd } => (cmd.conn().cloned().unwrap_or_default(), conn),
            other => panic!("{other:?}"),
        };
        let env = Some(std::ffi::OsString::from("env.json"));
        let (after, before) = parsed(&["volume", "--cluster", "b.json", "list"]);
        assert_eq!(after.over_env(&before, env.clone()).cluster.as_deref(), Some(std::path::Path::new("b.json")));
        let (after, before) = parsed(&["volume", "list", "--cluster", "a.json"]);
        assert_eq!(after.over_env(&before, env.clone()).cluster.as_deref(), Some(std::path::Path::new("a.json")));
        let (after, before) = parsed(&["volume", "list"]);
        assert_eq!(after.over_env(&before, env).cluster.as_deref(), Some(std::path::Path::new("env.json")));
        // Every client command takes them, even one that needs no cluster (scripts pass them to
        // all): `volume detach DIR --cluster F` was refused once the options stopped being global.
        let detach = conn_of(&["volume", "detach", "/mnt/x", "--cluster", "a.json"]);
        assert_eq!(detach.cluster.as_deref(), Some(std::path::Path::new("a.json")));
        // A daemon's own --meta is the daemon's, not a connection option.
        match parse(&["volume", "nbd", "--meta", "127.0.0.1:9", "--secret-file", "s"]).cmd {
            Cmd::Volume { conn, cmd: VolumeCmd::Nbd(a) } => {
                assert_eq!(a.meta, "127.0.0.1:9");
                assert!(conn.meta.is_none());
            }
            other => panic!("{other:?}"),
        }
    }

    /// The reference of every command, as `--help` prints it, in one Markdown page.
    fn commands_markdown() -> String {
        fn walk(cmd: &mut clap::Command, path: &str, out: &mut String) {
            let about = cmd.get_about().map(|a| a.to_string()).unwrap_or_default();
            out.push_str(&format!("\n## `{path}`\n\n{about}\n\n```text\n"));
            let help = cmd.render_long_help().to_string();
            // Trailing spaces vary with clap's padding; they carry nothing.
            for line in help.trim_end().lines() {
                out.push_str(line.trim_end());
                out.push('\n');
            }
            out.push_str("```\n");
            // Hidden commands (the old top-level volume commands) are aliases: documented once,
            // in the page's opening, not as a second copy of their `volume …` sections.
            let names: Vec<String> = cmd
                .get_subcommands()
                .filter(|s| !s.is_hide_set())
                .map(|s| s.get_name().to_string())
                .filter(|n| n != "help")
                .collect();
            for name in names {
                let sub = cmd.find_subcommand_mut(&name).expect("listed subcommand");
                walk(sub, &format!("{path} {name}"), out);
            }
        }
        let mut cmd = Cli::command().term_width(100).bin_name("understudy");
        cmd.build();
        let mut out = String::from(
            "# Command reference\n\nEvery `understudy` command and its options, as `--help` prints \
             them. Generated from the CLI definition: after changing a command, run\n\
             `UPDATE_DOCS=1 cargo test -p understudy --bin understudy commands_doc` to refresh \
             this page.\n\n\
             `understudy meta`, `shard`, `nbd`, `up` and `status` still work as before, unlisted: each \
             is exactly its `understudy volume …` namesake.\n",
        );
        let mut body = String::new();
        walk(&mut cmd, "understudy", &mut body);
        // An index: one link per command, to its heading's anchor.
        out.push('\n');
        for heading in body.lines().filter_map(|l| l.strip_prefix("## `")) {
            let path = heading.trim_end_matches('`');
            let anchor = path.replace(' ', "-");
            let depth = path.matches(' ').count();
            out.push_str(&format!("{}- [`{path}`](#{anchor})\n", "  ".repeat(depth)));
        }
        out.push_str(&body);
        out
    }

    /// docs/commands.md documents every command; it must match the CLI as built.
    #[test]
    fn commands_doc_is_current() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/commands.md");
        let generated = commands_markdown();
        if std::env::var_os("UPDATE_DOCS").is_some() {
            std::fs::write(&path, &generated).expect("write docs/commands.md");
            return;
        }
        let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            on_disk == generated,
            "docs/commands.md is out of date with the CLI; refresh it with \
             `UPDATE_DOCS=1 cargo test -p understudy --bin understudy commands_doc`"
        );
    }
}
