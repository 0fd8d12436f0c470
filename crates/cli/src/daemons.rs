//! The daemons: `meta`, `shard`, `nbd`. Each runs until SIGTERM or Ctrl-C.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

use testbed::cluster_file::read_secret;
use crate::exports::ClusterExports;
use testbed::volume::OnOff;
use testbed::proc::shutdown_signal;

#[derive(Args, Debug)]
pub struct MetaArgs {
    /// Directory of the metadata state (created if missing), when it runs alone (without --store).
    #[arg(long, value_name = "DIR", required_unless_present = "store")]
    pub dir: Option<PathBuf>,
    /// Run with standbys on this control store (etcd://H:P[,H:P...]): only the elected service
    /// listens and serves, its state kept as keys in the store. Give shards and clients every
    /// service's address (--meta A,B). Without it: alone, on DIR/meta.json.
    #[arg(long, value_name = "URL")]
    pub store: Option<String>,
    /// The cluster name in the control store's keys (one store may hold several clusters).
    #[arg(long, value_name = "NAME", default_value = "volume")]
    pub store_cluster: String,
    /// The election lease: a leader not renewing it for this long stops serving (exits); a
    /// standby takes over about this long after the leader dies (etcd rounds it up to whole
    /// seconds).
    #[arg(long, default_value_t = 2000)]
    pub election_ttl_ms: u64,
    /// The name this service gives when it leads (default: its --listen address).
    #[arg(long, value_name = "NAME")]
    pub advertise: Option<String>,
    /// With --store: the metadata directory of a service that ran alone; the first leader that
    /// finds no volume metadata in the store imports its meta.json (ignored once the store
    /// holds some).
    #[arg(long, value_name = "DIR", requires = "store")]
    pub import_from: Option<PathBuf>,
    /// Address to listen on for shards and clients.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7700")]
    pub listen: SocketAddr,
    /// Copies of every object (used when the state is created; fixed afterwards).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub replicas: u32,
    /// File holding the cluster secret shared by every process of the cluster.
    #[arg(long, value_name = "FILE")]
    pub secret_file: PathBuf,
    /// How often every shard is pinged.
    #[arg(long, default_value_t = 250, value_name = "MS")]
    pub ping_interval_ms: u64,
    /// A shard silent for this long is marked down (I/O moves to the other replicas).
    #[arg(long, default_value_t = 3000, value_name = "MS")]
    pub down_after_ms: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<SocketAddr>,
}

#[derive(Args, Debug)]
pub struct ShardArgs {
    /// Shard id, unique in the cluster; a replacement shard reuses the id of the one it replaces.
    #[arg(long)]
    pub id: u32,
    /// Data directory (objects are files under DIR/objects).
    #[arg(long, value_name = "DIR")]
    pub dir: PathBuf,
    /// Address to listen on for clients and peer shards.
    #[arg(long, value_name = "ADDR")]
    pub listen: SocketAddr,
    /// Address others reach this shard at (default: the listen address).
    #[arg(long, value_name = "ADDR")]
    pub advertise: Option<String>,
    /// Address of the metadata service (several, comma-separated, when it runs with standbys:
    /// the leader is the one that answers).
    #[arg(long, value_name = "ADDR[,ADDR...]")]
    pub meta: String,
    /// File holding the cluster secret.
    #[arg(long, value_name = "FILE")]
    pub secret_file: PathBuf,
    /// Create the data directory if it does not exist (a new or replacement shard).
    #[arg(long)]
    pub create: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<SocketAddr>,
    /// Benchmarks: add this much latency to every write before it is acknowledged (a cloud
    /// disk: about 500 for EBS gp3).
    #[arg(long, value_name = "US", default_value_t = 0)]
    pub inject_write_latency_us: u64,
    /// Benchmarks: add this much latency for the flush that makes every write durable (every
    /// acknowledged write is flushed; about 1000 for EBS gp3).
    #[arg(long, value_name = "US", default_value_t = 0)]
    pub inject_flush_latency_us: u64,
    /// Write-ahead journal: `on` makes each write's record durable by one fdatasync of a journal
    /// file shared with the writes waiting (group commit), then writes the slot file, which a
    /// background checkpoint syncs; `off` makes each write durable by its slot file's own
    /// fdatasync (the default: on this project's loaded 2-core machines the journal's A/B runs
    /// were mixed, its depth-32 latency worse). A journal left
    /// by an earlier run is replayed at start either way.
    #[arg(long, value_enum, value_name = "ON|OFF", default_value_t = OnOff::Off)]
    pub journal: OnOff,
    /// Size of the journal file (written with zeroes when it is made).
    #[arg(long, value_name = "MIB", default_value_t = volume::store::DEFAULT_JOURNAL_BYTES >> 20, value_parser = clap::value_parser!(u64).range(16..=4096))]
    pub journal_mib: u64,
    /// Keep a liveness lease in this control store (etcd://H:P[,H:P...], the metadata services'
    /// --store): the metadata leader marks the shard down once its lease expires, and the shard
    /// refuses client I/O (fences itself) when it cannot renew the lease, a third of the TTL
    /// before the lease may expire. Without it: liveness by the metadata link alone.
    #[arg(long, value_name = "URL")]
    pub store: Option<String>,
    /// The cluster name in the control store's keys (the metadata services' --store-cluster).
    #[arg(long, value_name = "NAME", default_value = "volume")]
    pub store_cluster: String,
    /// The liveness lease's TTL (with --store; etcd rounds it up to whole seconds): the shard is
    /// marked down about this long after it stops renewing.
    #[arg(long, value_name = "MS", default_value_t = 3000)]
    pub lease_ttl_ms: u64,
}

#[derive(Args, Debug)]
pub struct NbdArgs {
    /// Address of the metadata service (several, comma-separated, when it runs with standbys:
    /// the leader is the one that answers).
    #[arg(long, value_name = "ADDR[,ADDR...]")]
    pub meta: String,
    /// File holding the cluster secret.
    #[arg(long, value_name = "FILE")]
    pub secret_file: PathBuf,
    /// TCP address to serve NBD on.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:10809")]
    pub listen: SocketAddr,
    /// Also serve on this Unix socket (a stale socket file is replaced).
    #[arg(long, value_name = "PATH")]
    pub unix: Option<PathBuf>,
    /// Bytes of WRITE payloads being received at once, across all connections (at least the
    /// 32 MiB largest request); a connection waits for room before reading its payload, so
    /// clients stalled mid-write cannot make the server hold more.
    #[arg(long, value_name = "BYTES", default_value_t = nbd::ServerConfig::default().max_incomplete_request_bytes)]
    pub max_incomplete_request_bytes: u32,
    /// Require TLS (NBD_OPT_STARTTLS, as qemu's tls-creds-x509 and libnbd's nbds:// speak it) on
    /// every connection, TCP and Unix socket, or serve plain NBD [default: require when
    /// --tls-cert is given, else off].
    #[arg(long, value_enum, value_name = "REQUIRE|OFF")]
    pub tls: Option<NbdTls>,
    /// The server's certificate chain (PEM, leaf first).
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates that chain to this CA (PEM).
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Allow plain NBD on an address that is not loopback (anyone who reaches it reads and
    /// writes every volume).
    #[arg(long)]
    pub insecure: bool,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum NbdTls {
    Require,
    Off,
}

/// The NBD server's TLS files, if it requires TLS; refuses contradictory options and plain
/// NBD on an address other than loopback without --insecure. Runs before anything binds or
/// connects, so a refused configuration changes nothing.
pub fn nbd_tls(a: &NbdArgs) -> anyhow::Result<Option<wire::tls::ServerFiles>> {
    let mode = a.tls.unwrap_or(if a.tls_cert.is_some() { NbdTls::Require } else { NbdTls::Off });
    match mode {
        NbdTls::Require => {
            let (Some(cert), Some(key)) = (&a.tls_cert, &a.tls_key) else {
                anyhow::bail!("--tls=require needs --tls-cert FILE and --tls-key FILE (and --tls-ca FILE to require client certificates)");
            };
            Ok(Some(wire::tls::ServerFiles { cert: cert.clone(), key: key.clone(), client_ca: a.tls_ca.clone() }))
        }
        NbdTls::Off => {
            anyhow::ensure!(
                a.tls_cert.is_none() && a.tls_key.is_none() && a.tls_ca.is_none(),
                "--tls-cert, --tls-key and --tls-ca need TLS on: drop --tls=off (or the files)"
            );
            anyhow::ensure!(
                a.listen.ip().is_loopback() || a.insecure,
                "refusing plain NBD on {}, which is not a loopback address: anyone who reaches it could read and write \
                 every volume. Give --tls-cert FILE --tls-key FILE (and --tls-ca FILE for client certificates), or \
                 --insecure to serve it plain anyway",
                a.listen
            );
            Ok(None)
        }
    }
}

/// Checks this process's cluster-link TLS setting (`UNDERSTUDY_LINK_TLS*`, see
/// [`wire::link::process`]) before a daemon serves, so a bad one stops it with its reason
/// instead of failing every link; says when links leave the machine over TLS.
pub(crate) fn link_tls_at_start() -> anyhow::Result<()> {
    if let Some(t) = wire::link::process()? {
        tracing::info!("cluster links over TLS ({:?})", t.policy());
    }
    Ok(())
}

/// Runs `fut` until it ends or a stop signal arrives.
async fn until_signal(name: &str, fut: impl std::future::Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    tokio::select! {
        r = fut => r,
        sig = shutdown_signal() => {
            tracing::info!("{name}: {sig} received, stopping");
            Ok(())
        }
    }
}

pub async fn meta(a: MetaArgs) -> anyhow::Result<()> {
    let secret = read_secret(&a.secret_file)?;
    link_tls_at_start()?;
    anyhow::ensure!(a.ping_interval_ms > 0 && a.down_after_ms > a.ping_interval_ms, "--down-after-ms must exceed --ping-interval-ms");
    let max_ping = volume::driver::shard::MAX_META_PING_INTERVAL;
    anyhow::ensure!(
        a.ping_interval_ms <= max_ping.as_millis() as u64,
        "--ping-interval-ms must be at most {} (shards take a service silent for {:?} as gone)",
        max_ping.as_millis(),
        volume::driver::shard::META_SILENCE_TIMEOUT
    );
    tracing::info!(listen = %a.listen, dir = ?a.dir, store = ?a.store, "metadata service starting");
    let control = match &a.store {
        None => None,
        Some(url) => {
            anyhow::ensure!(a.election_ttl_ms >= 1000, "--election-ttl-ms must be at least 1000 (etcd leases are whole seconds)");
            Some(volume::driver::meta::MetaControl {
                store_url: url.clone(),
                cluster: a.store_cluster.clone(),
                cluster_id: volume::driver::meta::cluster_id_from_secret(&secret),
                election_ttl: std::time::Duration::from_millis(a.election_ttl_ms),
                advertise: a.advertise.clone().unwrap_or_else(|| a.listen.to_string()),
                import_from: a.import_from.clone(),
            })
        }
    };
    let opts = volume::driver::meta::MetaOptions {
        listen: a.listen,
        dir: a.dir.unwrap_or_default(),
        control,
        replicas: a.replicas,
        secret,
        ping_interval_ms: a.ping_interval_ms,
        down_after_ms: a.down_after_ms,
        metrics: a.metrics,
    };
    until_signal("metadata service", volume::driver::meta::run_meta(opts)).await
}

pub async fn shard(a: ShardArgs) -> anyhow::Result<()> {
    let secret = read_secret(&a.secret_file)?;
    link_tls_at_start()?;
    tracing::info!(id = a.id, listen = %a.listen, dir = %a.dir.display(), meta = %a.meta, "shard starting");
    let lease = match &a.store {
        None => None,
        Some(url) => {
            anyhow::ensure!(url.starts_with("etcd://"), "--store {url:?}: a shard's lease must be in a store the metadata services share: etcd://H:P[,H:P...]");
            anyhow::ensure!(a.lease_ttl_ms >= 1000, "--lease-ttl-ms must be at least 1000 (etcd leases are whole seconds)");
            Some(volume::driver::shard::ShardLease {
                store_url: url.clone(),
                cluster: a.store_cluster.clone(),
                cluster_id: volume::driver::meta::cluster_id_from_secret(&secret),
                ttl: Duration::from_millis(a.lease_ttl_ms),
            })
        }
    };
    let opts = volume::driver::shard::ShardOptions {
        lease,
        id: a.id,
        listen: a.listen,
        advertise: a.advertise,
        data_dir: a.dir,
        meta_addr: a.meta,
        secret,
        create: a.create,
        metrics: a.metrics,
        injected: volume::driver::shard::InjectedLatency { write_us: a.inject_write_latency_us, flush_us: a.inject_flush_latency_us },
        journal_bytes: (a.journal == OnOff::On).then_some(a.journal_mib << 20),
    };
    until_signal("shard", volume::driver::shard::run_shard(opts)).await
}

/// How long the NBD server keeps trying to reach the metadata service at start.
const NBD_META_WAIT: Duration = Duration::from_secs(60);

pub async fn nbd(a: NbdArgs) -> anyhow::Result<()> {
    let tls = match nbd_tls(&a)? {
        Some(files) => Some(wire::tls::acceptor(&files)?),
        None => None,
    };
    let secret = read_secret(&a.secret_file)?;
    link_tls_at_start()?;
    if tls.is_none() && !a.listen.ip().is_loopback() {
        tracing::warn!("serving plain NBD on {} (--insecure): anyone who reaches it can read and write every volume", a.listen);
    }
    let tcp = tokio::net::TcpListener::bind(a.listen).await.with_context(|| format!("cannot listen on {}", a.listen))?;
    let unix = match &a.unix {
        Some(path) => {
            if path.exists() {
                use std::os::unix::fs::FileTypeExt;
                let meta = std::fs::symlink_metadata(path)?;
                anyhow::ensure!(meta.file_type().is_socket(), "{} exists and is not a socket", path.display());
                std::fs::remove_file(path)?;
            }
            Some(tokio::net::UnixListener::bind(path).with_context(|| format!("cannot listen on {}", path.display()))?)
        }
        None => None,
    };
    let serve = async {
        // The metadata service may still be starting.
        let deadline = Instant::now() + NBD_META_WAIT;
        let cluster = loop {
            match testbed::cluster_file::connect(&a.meta, &secret).await {
                Ok(c) => break c,
                Err(e) if Instant::now() < deadline && !format!("{e:#}").contains("secret") => {
                    tracing::info!("waiting for the metadata service: {e:#}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(e),
            }
        };
        let config = nbd::ServerConfig {
            // The process's connection limit (UNDERSTUDY_MAX_CONNECTIONS, capped by the
            // descriptor limit), as every daemon's.
            max_connections: wire::listen::ConnLimit::process().max() as u32,
            // A handshake is milliseconds of work plus opening the volume through the metadata
            // service: twice the authentication deadline of the other daemons' ports.
            handshake_timeout_ms: 2 * wire::listen::AUTH_DEADLINE.as_millis() as u64,
            max_incomplete_request_bytes: a.max_incomplete_request_bytes,
            ..nbd::ServerConfig::default()
        };
        let mut server = nbd::Server::with_config(ClusterExports::new(cluster), config);
        let scheme = if let Some(acceptor) = tls.clone() {
            server = server.with_tls(acceptor);
            "nbds"
        } else {
            "nbd"
        };
        let server = Arc::new(server);
        tracing::info!(listen = %a.listen, unix = ?a.unix, "NBD server ready: {scheme}://{}/<volume>", a.listen);
        match unix {
            Some(u) => {
                tokio::try_join!(server.clone().serve_tcp(tcp), server.serve_unix(u))?;
            }
            None => server.serve_tcp(tcp).await?,
        }
        Ok(())
    };
    let r = until_signal("NBD server", serve).await;
    if let Some(p) = &a.unix {
        let _ = std::fs::remove_file(p);
    }
    r
}

#[cfg(test)]
mod nbd_tls_tests {
    use super::*;

    fn args(listen: &str, tls: Option<NbdTls>, files: [Option<&str>; 3], insecure: bool) -> NbdArgs {
        let [cert, key, ca] = files.map(|f| f.map(PathBuf::from));
        NbdArgs {
            meta: "127.0.0.1:1".into(),
            secret_file: "s".into(),
            listen: listen.parse().unwrap(),
            unix: None,
            max_incomplete_request_bytes: 1,
            tls,
            tls_cert: cert,
            tls_key: key,
            tls_ca: ca,
            insecure,
        }
    }

    #[test]
    fn plain_nbd_only_on_loopback_unless_insecure() {
        let none = [None; 3];
        assert_eq!(nbd_tls(&args("127.0.0.1:10809", None, none, false)).unwrap(), None);
        assert_eq!(nbd_tls(&args("[::1]:10809", Some(NbdTls::Off), none, false)).unwrap(), None);
        for addr in ["0.0.0.0:10809", "192.0.2.7:10809", "[::]:10809"] {
            let e = nbd_tls(&args(addr, None, none, false)).unwrap_err().to_string();
            assert!(e.contains("not a loopback address") && e.contains("--insecure"), "{e}");
            assert_eq!(nbd_tls(&args(addr, None, none, true)).unwrap(), None);
        }
        let files = [Some("c.pem"), Some("k.pem"), Some("ca.pem")];
        let want = wire::tls::ServerFiles { cert: "c.pem".into(), key: "k.pem".into(), client_ca: Some("ca.pem".into()) };
        assert_eq!(nbd_tls(&args("0.0.0.0:10809", None, files, false)).unwrap(), Some(want.clone()));
        assert_eq!(nbd_tls(&args("0.0.0.0:10809", Some(NbdTls::Require), files, false)).unwrap(), Some(want));
    }

    #[test]
    fn contradictory_tls_options_are_refused() {
        let e = nbd_tls(&args("127.0.0.1:1", Some(NbdTls::Require), [None; 3], false)).unwrap_err().to_string();
        assert!(e.contains("--tls-cert") && e.contains("--tls-key"), "{e}");
        let e = nbd_tls(&args("127.0.0.1:1", None, [Some("c.pem"), None, None], false)).unwrap_err().to_string();
        assert!(e.contains("--tls-key"), "{e}");
        let e = nbd_tls(&args("127.0.0.1:1", Some(NbdTls::Off), [Some("c"), Some("k"), None], false)).unwrap_err().to_string();
        assert!(e.contains("--tls=off"), "{e}");
        let e = nbd_tls(&args("127.0.0.1:1", None, [None, None, Some("ca")], false)).unwrap_err().to_string();
        assert!(e.contains("--tls-ca"), "{e}");
    }
}
