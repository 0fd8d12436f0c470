//! `understudy up`: a local cluster on loopback, as child processes of this one, in the
//! foreground until Ctrl-C. The cluster itself is [`testbed::volume::LocalCluster`].

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Args;
use testbed::cluster_file::{self, ClusterInfo, CLUSTER_FILE};
use testbed::proc;
use testbed::supervise::{Event, RestartPolicy, RESTART_BACKOFF_FIRST};
use testbed::volume::{LocalCluster, UpConfig, DEFAULT_PORT_BASE, DEFAULT_REPLICAS, DEFAULT_SHARDS, READY_TIMEOUT};

/// How often `up` looks for daemons that exited (and so the least gap before a restart).
const SUPERVISE_INTERVAL: Duration = Duration::from_millis(100);

#[derive(Args, Debug)]
pub struct UpArgs {
    /// Data directory of the cluster (created if missing, reused if present).
    #[arg(long, value_name = "DIR", default_value = cluster_file::DEFAULT_DIR)]
    pub dir: PathBuf,
    /// Number of storage shards [default: 4, or as in DIR/cluster.json].
    #[arg(long)]
    pub shards: Option<u32>,
    /// Copies of every object, fixed when DIR is first used [default: 3].
    #[arg(long)]
    pub replicas: Option<u32>,
    /// First TCP port: metadata on it, NBD on +1, shards on +2 onwards; 0 picks free ports
    /// [default: 7700, or as in DIR/cluster.json].
    #[arg(long, value_name = "PORT")]
    pub port_base: Option<u16>,
    /// Restart a daemon that exited after MS, doubled for each further exit within a minute
    /// (at most 4 s); one that exits a 6th time within a minute is given up and `up` exits
    /// non-zero. 0: leave an exited daemon down.
    #[arg(long, value_name = "MS", default_value_t = RESTART_BACKOFF_FIRST.as_millis() as u64)]
    pub restart_after_ms: u64,
}

/// Settings for `up`: explicit flags first, then the previous run's cluster.json, then defaults.
fn resolve(a: &UpArgs, verbose: u8) -> anyhow::Result<UpConfig> {
    let previous = {
        let p = a.dir.join(CLUSTER_FILE);
        if p.exists() {
            Some(ClusterInfo::load(&p)?)
        } else {
            None
        }
    };
    Ok(UpConfig {
        dir: a.dir.clone(),
        shards: a.shards.or(previous.as_ref().map(|p| p.shards.len() as u32)).unwrap_or(DEFAULT_SHARDS),
        replicas: a.replicas.or(previous.as_ref().map(|p| p.replicas)).unwrap_or(DEFAULT_REPLICAS),
        port_base: a.port_base.or(previous.as_ref().map(|p| p.port_base)).unwrap_or(DEFAULT_PORT_BASE),
        verbose,
    })
}

fn print_endpoints(info: &ClusterInfo, elapsed: Duration, default_dir: bool) {
    let cluster_file = info.dir.join(CLUSTER_FILE);
    println!("Understudy cluster up in {:.1} s, data in {}", elapsed.as_secs_f64(), info.dir.display());
    println!("  metadata service  {}", info.meta.addr);
    println!("  NBD server        nbd://{}/<volume>  (unix socket {})", info.nbd.addr, info.nbd.unix_socket.display());
    for s in &info.shards {
        println!("  shard {:<11} {}  (data {})", s.id, s.addr, s.dir.display());
    }
    println!("  replicas          {}", info.replicas);
    println!("  secret file       {}", info.secret_file.display());
    println!("  cluster file      {}", cluster_file.display());
    println!("  logs              {}", info.dir.join("logs").display());
    println!();
    if !default_dir {
        println!("Point the client commands at this cluster:");
        println!("  export UNDERSTUDY_CLUSTER={}", cluster_file.display());
    }
    println!("Create a volume and use it:");
    println!("  understudy volume create vol1 --size 1G");
    println!("  qemu-io -f raw -c 'write -P 0xab 0 64k' {}", info.nbd_uri("vol1"));
    println!("  understudy volume attach vol1 --mount /mnt/vol1 --mkfs");
    println!("Ctrl-C stops the cluster.");
}

pub fn up(a: UpArgs, verbose: u8) -> anyhow::Result<()> {
    let cfg = resolve(&a, verbose)?;
    let default_dir = a.dir == Path::new(cluster_file::DEFAULT_DIR);
    let rt = crate::runtime()?;
    let start = Instant::now();
    let mut lc = LocalCluster::start(&cfg)?;
    lc.set_restart((a.restart_after_ms > 0).then(|| RestartPolicy { backoff_first: Duration::from_millis(a.restart_after_ms), ..Default::default() }));
    let cluster_path = lc.info.dir.join(CLUSTER_FILE);
    let result: anyhow::Result<&'static str> = rt.block_on(async {
        let signal = proc::shutdown_signal();
        tokio::pin!(signal);
        tokio::select! {
            r = lc.wait_ready(READY_TIMEOUT, true) => { r?; }
            sig = &mut signal => anyhow::bail!("{sig} received during start-up; stopped"),
        }
        lc.info.save(&cluster_path)?;
        print_endpoints(&lc.info, start.elapsed(), default_dir);
        loop {
            tokio::select! {
                sig = &mut signal => return Ok(sig),
                _ = tokio::time::sleep(SUPERVISE_INTERVAL) => {
                    // A daemon that exits is started again on its data (the metadata service
                    // on its state file, a shard on its store); the others keep serving
                    // meanwhile: tearing the cluster down would turn one daemon's crash into
                    // the loss of every volume. Only one that keeps failing ends `up`.
                    let events = lc.supervise();
                    for e in &events {
                        eprintln!("understudy up: {e}");
                    }
                    if events.iter().any(|e| matches!(e, Event::Restarted { .. })) {
                        // The cluster serves on; only the pids the file shows are stale.
                        if let Err(e) = lc.info.save(&cluster_path) {
                            eprintln!("understudy up: cannot update {}: {e:#}", cluster_path.display());
                        }
                    }
                    if lc.gave_up() {
                        anyhow::bail!("a daemon keeps failing (see above); stopped the cluster");
                    }
                }
            }
        }
    });
    if let Ok(sig) = &result {
        eprintln!("understudy up: {sig} received, stopping the cluster");
    }
    for (what, status) in lc.stop() {
        tracing::debug!("{what}: {status}");
    }
    result.map(|_| eprintln!("understudy up: stopped"))
}
