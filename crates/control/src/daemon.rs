//! [`Daemon`]: the shape every control process with standbys shares (the volume metadata
//! service, the kv CM, the nearlog controller, the failover monitor): open the store with the
//! cluster check, stand for election until leading, keep the lease on a thread of its own, and
//! run the store's requests there.
//!
//! Why a thread of its own: the lease renewal must run whatever the daemon's own runtime is
//! doing (a monitor loop that blocks for a while, a metadata service whose workers wait inside
//! a synchronous save). A one-thread runtime on a dedicated thread drives the renewal and every
//! store request ([`Daemon::call`]); the daemon's runtime only awaits the answers.
//!
//! Policy on a lost leadership is the caller's (step down and stand again, or exit and let a
//! supervisor restart it as a standby); [`Daemon::lost`] says when and why.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use crate::{Error, Leadership, Result, Store};

/// Wait before standing again after a candidacy was lost to an unreachable store: short against
/// any lease TTL, long enough not to spin on a store that is down.
pub const RESTAND_AFTER_MS: u64 = 200;

/// Where a daemon keeps its state and how it stands for leadership.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// The store's address (`etcd://...`, or an embedded directory).
    pub store_url: String,
    /// The cluster name in the store's keys.
    pub cluster: String,
    /// The cluster's identity: a store holding another one is refused.
    pub cluster_id: String,
    /// The election every daemon of this kind stands in.
    pub election: String,
    /// The election lease: a leader that cannot renew it for this long stops acting; a standby
    /// takes over about this long after the leader died.
    pub election_ttl: Duration,
    /// What this daemon tells others when it leads (its serving address, or a name).
    pub advertise: String,
}

/// The cluster id a daemon of `system` derives from the cluster secret: two clusters with
/// different secrets never share one store's keys under one name. A checksum of the secret, not
/// the secret: the store's readers need not know it.
pub fn cluster_id_from_secret(system: &str, secret: &[u8]) -> String {
    let mut salted = format!("understudy-{system}-cluster-id:").into_bytes();
    salted.extend_from_slice(secret);
    format!("{system}-{:08x}", crc32c::crc32c(&salted))
}

/// Stands in `election` until leading, standing again when the candidacy is lost to an
/// unreachable store (any other error is returned). `on_standing` is told each time it stands.
pub async fn campaign_until_leading(store: &Store, election: &str, advertise: &str, ttl: Duration, mut on_standing: impl FnMut(Option<&Error>)) -> Result<Leadership> {
    on_standing(None);
    loop {
        match store.campaign(election, advertise, ttl).await {
            Ok(l) => return Ok(l),
            Err(e @ (Error::LeaseExpired(_) | Error::Unavailable { .. } | Error::Uncertain { .. })) => {
                on_standing(Some(&e));
                tokio::time::sleep(Duration::from_millis(RESTAND_AFTER_MS)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// A leading daemon: its store, its leadership, and the thread that keeps both.
pub struct Daemon {
    store: Store,
    lead: Arc<Leadership>,
    rt: tokio::runtime::Handle,
    ttl: Duration,
    /// Dropped with the daemon: the store thread's runtime ends, and with it the renewal.
    _stop: oneshot::Sender<()>,
}

impl Daemon {
    /// Opens the store and stands for leadership on a thread of its own; returns once this
    /// daemon leads (a standby waits here), or the store cannot be opened or refuses us.
    /// `on_standing` is told (on the store thread) each time the daemon stands.
    pub async fn lead(cfg: DaemonConfig, on_standing: impl FnMut(Option<&Error>) + Send + 'static) -> Result<Daemon> {
        let (led_tx, led_rx) = oneshot::channel::<Result<(Store, Arc<Leadership>, tokio::runtime::Handle)>>();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let thread_name = format!("{}-store", cfg.election);
        let ttl = cfg.election_ttl;
        std::thread::Builder::new()
            .name(thread_name)
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = led_tx.send(Err(Error::Io { path: "store thread runtime".into(), source: e }));
                        return;
                    }
                };
                let handle = rt.handle().clone();
                rt.block_on(async move {
                    let led = async {
                        let store = Store::open(&cfg.store_url, &cfg.cluster, &cfg.cluster_id).await?;
                        let lead = campaign_until_leading(&store, &cfg.election, &cfg.advertise, cfg.election_ttl, on_standing).await?;
                        Ok((store, Arc::new(lead), handle))
                    };
                    let led: Result<_> = led.await;
                    let leading = led.is_ok();
                    if led_tx.send(led).is_err() || !leading {
                        return;
                    }
                    // Drives the renewal and the calls until the daemon is dropped.
                    let _ = stop_rx.await;
                });
            })
            .map_err(|e| Error::Io { path: "store thread".into(), source: e })?;
        let (store, lead, rt) = led_rx.await.map_err(|_| Error::Io { path: "store thread".into(), source: std::io::Error::other("the store thread ended") })??;
        Ok(Daemon { store, lead, rt, ttl, _stop: stop_tx })
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn leadership(&self) -> &Arc<Leadership> {
        &self.lead
    }

    /// This leader's fencing token (its election key's create revision).
    pub fn fencing_token(&self) -> i64 {
        self.lead.fencing_token()
    }

    /// The election lease's TTL.
    pub fn leadership_ttl(&self) -> Duration {
        self.ttl
    }

    pub fn is_leader(&self) -> bool {
        self.lead.is_leader()
    }

    /// Runs `f` with the store and the leadership on the store thread; returns its result.
    pub async fn call<T, F, Fut>(&self, f: F) -> T
    where
        T: Send + 'static,
        F: FnOnce(Store, Arc<Leadership>) -> Fut,
        Fut: Future<Output = T> + Send + 'static,
    {
        let fut = f(self.store.clone(), self.lead.clone());
        self.rt.spawn(fut).await.expect("store calls do not panic")
    }

    /// Waits until leadership is lost; returns why.
    pub async fn lost(&self) -> String {
        let lead = self.lead.clone();
        self.rt.spawn(async move { lead.lost().await }).await.unwrap_or_else(|e| format!("the store thread ended: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_ids_differ_by_system_and_secret() {
        let a = cluster_id_from_secret("failover", b"s1");
        assert!(a.starts_with("failover-") && a.len() == "failover-".len() + 8, "{a}");
        assert_eq!(a, cluster_id_from_secret("failover", b"s1"));
        assert_ne!(a, cluster_id_from_secret("failover", b"s2"));
        assert_ne!(a[9..], cluster_id_from_secret("kv", b"s1")[3..]);
        // The ids the daemons derived before this helper existed (stores already hold them).
        let old = |salt: &[u8], prefix: &str, secret: &[u8]| {
            let mut v = salt.to_vec();
            v.extend_from_slice(secret);
            format!("{prefix}-{:08x}", crc32c::crc32c(&v))
        };
        assert_eq!(cluster_id_from_secret("kv", b"s1"), old(b"understudy-kv-cluster-id:", "kv", b"s1"));
        assert_eq!(cluster_id_from_secret("volume", b"s1"), old(b"understudy-volume-cluster-id:", "volume", b"s1"));
        assert_eq!(cluster_id_from_secret("nearlog", b"s1"), old(b"understudy-nearlog-cluster-id:", "nearlog", b"s1"));
    }

    /// On an embedded store (one process: always the leader), the daemon leads, calls run on
    /// its thread with the guard, and a second daemon on the same directory is refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_daemon_leads_and_its_calls_are_guarded() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = DaemonConfig {
            store_url: dir.path().to_str().unwrap().to_string(),
            cluster: "t".into(),
            cluster_id: cluster_id_from_secret("t", b"x"),
            election: "t-el".into(),
            election_ttl: Duration::from_secs(2),
            advertise: "me".into(),
        };
        let stood = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let s2 = stood.clone();
        let d = Daemon::lead(cfg.clone(), move |_| {
            s2.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        })
        .await
        .unwrap();
        assert_eq!(stood.load(std::sync::atomic::Ordering::Relaxed), 1, "stood once");
        assert!(d.is_leader());
        let key = d.store().key("t", "k", "a");
        let k2 = key.clone();
        let rev = d.call(move |_, lead| async move { lead.put(&k2, b"v".to_vec()).await }).await.unwrap();
        assert!(rev > 0);
        assert_eq!(d.store().get(&key).await.unwrap().unwrap().value, b"v");
        let e = Daemon::lead(cfg, |_| {}).await.err().expect("a second writer of one directory is refused");
        assert!(matches!(e, Error::Locked { .. }), "{e}");
        // Stopping the renewal loses the leadership: lost() says so, and writes are refused.
        d.leadership().stop_renewing();
        let why = tokio::time::timeout(Duration::from_secs(10), d.lost()).await.unwrap();
        assert!(!why.is_empty());
        // Past the TTL the election key is gone.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let k3 = key.clone();
        let e = d.call(move |_, lead| async move { lead.put(&k3, b"w".to_vec()).await }).await.unwrap_err();
        assert!(matches!(e, Error::Deposed { .. }), "{e}");
    }
}
