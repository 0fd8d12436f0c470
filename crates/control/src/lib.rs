//! The control-plane store: where the metadata service, the kv configuration manager, the
//! nearlog controller and the failover monitor keep their state, elect their leader and see who
//! is alive (issue 24).
//!
//! Two backends behind one API ([`Store`]):
//!
//! * **embedded** (`file:DIR` or a plain path, the default): one file per key under a directory,
//!   written crash-safe (temp file, fsync, rename, fsync of the directory), an exclusive `flock`
//!   so two processes never write one directory, and revisions emulated (a durable counter) so a
//!   transaction guarded by a revision means the same as on etcd. Leases live in the memory of
//!   the one process that holds the lock: that process is the only writer, so it is always the
//!   leader of every election it runs, and a key written under a lease is deleted when the lease
//!   is not kept alive (checked on every operation) or when the store is next opened (the
//!   process that held its lease is gone).
//! * **etcd** (`etcd://h1:2379,h2:2379,h3:2379`): Debian's etcd 3.4 through its v3 JSON gateway
//!   (the same gRPC service, served as JSON over HTTP/1.1 on the client port), failing over
//!   between the listed endpoints.
//!
//! ## Why the JSON gateway and not the `etcd-client` crate
//!
//! Measured in session 20 (dev profile, `CARGO_INCREMENTAL=0`, on the 2-core machine shared with
//! other builds): adding `etcd-client` 0.14 to a crate that already had tokio compiled 140 more
//! units (42 crates new to this workspace's lock: tonic, prost, hyper, h2, tower, axum...) and a
//! `protoc` run, in 69.8 s wall and 134 s of summed compile time (load 1.1 before, 4.1 after);
//! this crate on the gateway compiles in 2.5 s after `cargo clean -p control` (load 9.7), with no
//! crate new to the workspace. CI runs on 2 cores with a 30-minute bound on the test suite, and
//! builds the tests at least once per run: a minute per build for the client is not worth what it
//! adds here. The gateway needs nothing new: the requests are
//! JSON (`serde_json`, already here) with base64 keys (`base64`, already here) over a small
//! HTTP/1.1 client on tokio ([`http`], one connection per request, `Connection: close`). The
//! protocol features Understudy needs (range, put, delete, txn with compares, lease grant,
//! keepalive, revoke) are all unary calls on the gateway (a keepalive is one message of the
//! stream, answered and closed); watch is not used (callers poll a prefix, which a control plane
//! whose decisions are guarded by revisions can afford). What is given up: gRPC's connection
//! reuse and streaming watch; etcd 3.5+ keeps the gateway, so an upgrade does not break this.
//!
//! ## Keys
//!
//! One key per object: `/understudy/<cluster>/<system>/<kind>/<id>` ([`Store::key`]), e.g.
//! `/understudy/prod/volume/vol/db1`. A value is at most [`MAX_VALUE_BYTES`] (etcd refuses a
//! request over 1.5 MiB); a transaction's values together at most [`MAX_TXN_BYTES`]. Reserved
//! systems: `election` (campaign keys), `live` (liveness registrations), and the key
//! `/understudy/<cluster>/cluster-id`, written at first use: a store that already holds another
//! cluster's id under that name is refused ([`Error::ForeignCluster`]), never shared.
//!
//! ## Decisions are transactions
//!
//! [`Store::txn`] applies its operations only if every [`Compare`] holds, atomically; the
//! callers guard each decision by what they read (a key's mod revision, or an epoch value).
//! [`Leadership::txn`] adds the guard "my election key still exists with my create revision",
//! so a deposed leader's write fails with [`Error::Deposed`], distinct from a failed compare of
//! the caller's own.

pub mod daemon;
mod embedded;
mod etcd;
pub mod election;
pub mod http;
pub mod renewal;
mod types;

pub use daemon::{Daemon, DaemonConfig};
pub use election::{Leadership, LeaseKeeper, LeaseValidity, Registration};
pub use types::*;

use std::sync::Arc;
use std::time::Duration;

/// The largest value one key may hold: well below etcd's default request limit of 1.5 MiB
/// (`--max-request-bytes`), leaving room for the key and the rest of the request.
pub const MAX_VALUE_BYTES: usize = 1024 * 1024;
/// The largest sum of the values one transaction may write (the same request limit).
pub const MAX_TXN_BYTES: usize = 1024 * 1024;
/// The longest key, in bytes (the embedded backend names a file after it; a file name is at
/// most 255 bytes).
pub const MAX_KEY_BYTES: usize = 240;
/// How long opening an etcd store may take before it reports the endpoints unreachable.
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors of the store. Every one names what failed and, where it helps, what to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("bad store address {0:?}: expected a directory path, file:DIR, or etcd://HOST:PORT[,HOST:PORT...]")]
    BadUrl(String),
    #[error("bad key {key:?}: {why}")]
    BadKey { key: String, why: &'static str },
    #[error("value of {key} is {bytes} bytes, over the limit of {limit} bytes (etcd refuses requests over 1.5 MiB): store large objects as several keys")]
    ValueTooLarge { key: String, bytes: usize, limit: usize },
    #[error("embedded store {dir} is in use by another process (its lock file is held): run one control process per directory, or use etcd for several")]
    Locked { dir: String },
    #[error("store {store} belongs to cluster id {found}, not this cluster's id {ours} (name {cluster}): refusing to share it; point this cluster at its own store")]
    ForeignCluster { store: String, cluster: String, found: String, ours: String },
    #[error("etcd unreachable at {endpoints} (after {waited_ms} ms): {last}")]
    Unavailable { endpoints: String, waited_ms: u64, last: String },
    #[error("etcd request to {endpoint} failed after it was sent ({why}); it may or may not have been applied: re-read before retrying")]
    Uncertain { endpoint: String, why: String },
    #[error("etcd at {endpoint} answered error {code}: {message}")]
    Etcd { endpoint: String, code: i64, message: String },
    #[error("lease {0:x} has expired")]
    LeaseExpired(i64),
    #[error("no longer leader of {election}: its election key is gone (lease expired or revoked); current leader: {}", leader.as_deref().unwrap_or("none"))]
    Deposed { election: String, leader: Option<String> },
    #[error("embedded store {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("embedded store file {path} is corrupt: {why}")]
    Corrupt { path: String, why: String },
    #[error("etcd at {endpoint} sent an answer that could not be read: {why}")]
    Protocol { endpoint: String, why: String },
}

pub type Result<T> = std::result::Result<T, Error>;

/// A handle on the control-plane store; cheap to clone (the clones share one backend). An
/// embedded store's directory lock is released when the last clone is gone, including those
/// held by lease renewal tasks ([`LeaseKeeper`]), which the runtime drops at its next turn.
#[derive(Clone)]
pub struct Store {
    backend: Backend,
    cluster: Arc<str>,
}

#[derive(Clone)]
enum Backend {
    Embedded(Arc<embedded::Embedded>),
    Etcd(Arc<etcd::Etcd>),
}

impl Store {
    /// Opens the store at `url` for cluster `cluster` (the name in every key) whose identity is
    /// `cluster_id` (unique per cluster, e.g. made when the cluster was created): writes the id at
    /// first use, refuses a store holding another id. An etcd store unreachable for
    /// [`OPEN_TIMEOUT`] is an [`Error::Unavailable`].
    pub async fn open(url: &str, cluster: &str, cluster_id: &str) -> Result<Store> {
        check_segment(cluster)?;
        let backend = if let Some(list) = url.strip_prefix("etcd://") {
            let endpoints: Vec<String> = list.split(',').map(|s| s.trim().trim_end_matches('/').to_string()).filter(|s| !s.is_empty()).collect();
            if endpoints.is_empty() || endpoints.iter().any(|e| e.contains('/')) {
                return Err(Error::BadUrl(url.to_string()));
            }
            Backend::Etcd(Arc::new(etcd::Etcd::new(endpoints)))
        } else {
            let dir = url.strip_prefix("file:").unwrap_or(url);
            if dir.is_empty() || dir.contains("://") {
                return Err(Error::BadUrl(url.to_string()));
            }
            Backend::Embedded(Arc::new(embedded::Embedded::open(std::path::Path::new(dir))?))
        };
        let store = Store { backend, cluster: cluster.into() };
        store.claim(url, cluster_id).await?;
        Ok(store)
    }

    /// Writes the cluster id at first use; refuses a store holding another one.
    async fn claim(&self, url: &str, ours: &str) -> Result<()> {
        let key = format!("/understudy/{}/cluster-id", self.cluster);
        let deadline = tokio::time::Instant::now() + OPEN_TIMEOUT;
        let found = match self.get_until(&key, deadline).await? {
            Some(kv) => kv.value,
            None => {
                let out = self.txn(vec![Compare::absent(&key)], vec![Op::put(&key, ours.as_bytes().to_vec())]).await?;
                if out.succeeded {
                    return Ok(());
                }
                self.get(&key).await?.map(|kv| kv.value).unwrap_or_default()
            }
        };
        if found != ours.as_bytes() {
            return Err(Error::ForeignCluster {
                store: url.to_string(),
                cluster: self.cluster.to_string(),
                found: String::from_utf8_lossy(&found).into_owned(),
                ours: ours.to_string(),
            });
        }
        Ok(())
    }

    async fn get_until(&self, key: &str, deadline: tokio::time::Instant) -> Result<Option<KeyValue>> {
        match &self.backend {
            Backend::Embedded(e) => blocking(e, key.to_string(), |e, key| e.get(&key)).await,
            Backend::Etcd(e) => Ok(e.range(key, false, Some(deadline)).await?.into_iter().next()),
        }
    }

    /// The cluster name this store was opened for.
    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// The key of object `id` of kind `kind` of subsystem `system`:
    /// `/understudy/<cluster>/<system>/<kind>/<id>`.
    pub fn key(&self, system: &str, kind: &str, id: &str) -> String {
        format!("/understudy/{}/{system}/{kind}/{id}", self.cluster)
    }

    /// The prefix of every object of `kind` in `system` (for [`Store::list`]).
    pub fn prefix(&self, system: &str, kind: &str) -> String {
        format!("/understudy/{}/{system}/{kind}/", self.cluster)
    }

    pub async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        check_key(key)?;
        match &self.backend {
            Backend::Embedded(e) => blocking(e, key.to_string(), |e, key| e.get(&key)).await,
            Backend::Etcd(e) => Ok(e.range(key, false, None).await?.into_iter().next()),
        }
    }

    /// Every key starting with `prefix`, in key order.
    pub async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>> {
        check_key(prefix)?;
        match &self.backend {
            Backend::Embedded(e) => blocking(e, prefix.to_string(), |e, prefix| e.list(&prefix)).await,
            Backend::Etcd(e) => e.range(prefix, true, None).await,
        }
    }

    /// Waits until the keys under `prefix` differ from `previous` (a key written, added or
    /// deleted), looking every `interval`; returns the new listing, or None after `timeout`.
    /// Polling stands in for etcd's watch, which the JSON gateway only streams: a control plane
    /// whose decisions are guarded by revisions loses nothing by seeing a change late.
    pub async fn poll_prefix(&self, prefix: &str, previous: &[KeyValue], interval: Duration, timeout: Duration) -> Result<Option<Vec<KeyValue>>> {
        let same = |a: &[KeyValue], b: &[KeyValue]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.key == y.key && x.mod_revision == y.mod_revision);
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let now = self.list(prefix).await?;
            if !same(&now, previous) {
                return Ok(Some(now));
            }
            if tokio::time::Instant::now() + interval > deadline {
                return Ok(None);
            }
            tokio::time::sleep(interval).await;
        }
    }

    /// Writes `key` unconditionally; returns the store's revision after the write.
    pub async fn put(&self, key: &str, value: Vec<u8>) -> Result<i64> {
        Ok(self.txn(vec![], vec![Op::put(key, value)]).await?.revision)
    }

    /// Deletes `key` (nothing if absent); returns the store's revision after the delete.
    pub async fn delete(&self, key: &str) -> Result<i64> {
        Ok(self.txn(vec![], vec![Op::delete(key)]).await?.revision)
    }

    /// Applies `then` if every compare holds, atomically. `succeeded` says which happened.
    pub async fn txn(&self, compares: Vec<Compare>, then: Vec<Op>) -> Result<TxnOutcome> {
        self.txn_reading(compares, then, None).await
    }

    /// [`Store::txn`], and when the compares fail, the current value of `on_failure_get`
    /// (read in the same atomic step).
    pub(crate) async fn txn_reading(&self, compares: Vec<Compare>, then: Vec<Op>, on_failure_get: Option<String>) -> Result<TxnOutcome> {
        check_txn(&compares, &then)?;
        match &self.backend {
            Backend::Embedded(e) => blocking(e, (compares, then, on_failure_get), |e, (c, t, f)| e.txn(&c, &t, f.as_deref())).await,
            Backend::Etcd(e) => e.txn(&compares, &then, on_failure_get.as_deref()).await,
        }
    }

    /// A new lease of `ttl` (rounded up to whole seconds, at least 1, as etcd's are).
    pub async fn lease_grant(&self, ttl: Duration) -> Result<LeaseId> {
        let secs = ttl_secs(ttl);
        match &self.backend {
            Backend::Embedded(e) => blocking(e, secs, |e, secs| e.lease_grant(secs)).await,
            Backend::Etcd(e) => e.lease_grant(secs).await,
        }
    }

    /// Renews lease `id` for its full TTL; [`Error::LeaseExpired`] if it is gone.
    pub async fn lease_keepalive(&self, id: LeaseId) -> Result<()> {
        match &self.backend {
            Backend::Embedded(e) => blocking(e, id, |e, id| e.lease_keepalive(id)).await,
            Backend::Etcd(e) => e.lease_keepalive(id).await,
        }
    }

    /// Ends lease `id` now, deleting its keys.
    pub async fn lease_revoke(&self, id: LeaseId) -> Result<()> {
        match &self.backend {
            Backend::Embedded(e) => blocking(e, id, |e, id| e.lease_revoke(id)).await,
            Backend::Etcd(e) => e.lease_revoke(id).await,
        }
    }

    /// Whether this is the etcd backend (several processes may share it).
    pub fn is_etcd(&self) -> bool {
        matches!(self.backend, Backend::Etcd(_))
    }
}

/// Runs an embedded-store call, which may fsync, off the async workers.
async fn blocking<A: Send + 'static, T: Send + 'static>(e: &Arc<embedded::Embedded>, arg: A, f: impl FnOnce(&embedded::Embedded, A) -> Result<T> + Send + 'static) -> Result<T> {
    let e = e.clone();
    tokio::task::spawn_blocking(move || f(&e, arg)).await.expect("embedded store calls do not panic")
}

fn ttl_secs(ttl: Duration) -> i64 {
    (ttl.as_millis().div_ceil(1000) as i64).max(1)
}

/// A cluster name, system, kind or id: one key segment.
pub(crate) fn check_segment(s: &str) -> Result<()> {
    if s.is_empty() || s.contains('/') {
        return Err(Error::BadKey { key: s.to_string(), why: "a key segment must be non-empty and hold no '/'" });
    }
    check_chars(s)
}

fn check_chars(key: &str) -> Result<()> {
    if !key.bytes().all(|b| b.is_ascii_alphanumeric() || b"._:@=/-".contains(&b)) {
        return Err(Error::BadKey { key: key.to_string(), why: "keys hold only ASCII letters, digits and . _ : @ = / -" });
    }
    Ok(())
}

pub(crate) fn check_key(key: &str) -> Result<()> {
    if !key.starts_with('/') {
        return Err(Error::BadKey { key: key.to_string(), why: "a key starts with '/'" });
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(Error::BadKey { key: key.to_string(), why: "longer than MAX_KEY_BYTES (240)" });
    }
    check_chars(key)
}

fn check_txn(compares: &[Compare], then: &[Op]) -> Result<()> {
    let mut total = 0usize;
    for c in compares {
        check_key(&c.key)?;
    }
    for op in then {
        match op {
            Op::Put { key, value, .. } => {
                check_key(key)?;
                if value.len() > MAX_VALUE_BYTES {
                    return Err(Error::ValueTooLarge { key: key.clone(), bytes: value.len(), limit: MAX_VALUE_BYTES });
                }
                total += value.len();
                if total > MAX_TXN_BYTES {
                    return Err(Error::ValueTooLarge { key: key.clone(), bytes: total, limit: MAX_TXN_BYTES });
                }
            }
            Op::Delete { key } => check_key(key)?,
        }
    }
    Ok(())
}
