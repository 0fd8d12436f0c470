//! Leader election and liveness, on leases (as etcd's `concurrency` package does it, and as
//! ZooKeeper's ephemeral nodes do liveness).
//!
//! * [`Store::campaign`]: each candidate writes `/understudy/<cluster>/election/<name>/<lease>`
//!   under its own lease; the leader is the candidate whose key has the lowest create revision
//!   ([`leader_of`]), so leadership passes in order of arrival and a candidate becomes leader
//!   only after every earlier key is gone (deleted, or its lease expired). Candidates poll the
//!   election prefix (every [`poll_interval`]) rather than watch it.
//! * [`Leadership::txn`]: every write of a leader carries the guard "my election key exists with
//!   my create revision". A leader whose lease expired (it stalled, or was cut off) has lost its
//!   key, so its writes fail with [`Error::Deposed`] even if it has not noticed yet.
//! * [`LeaseKeeper`]: renews a lease every third of its TTL in a background task, the driver of
//!   [`crate::renewal::Renewal`] (the decisions). It declares the lease lost when etcd says it
//!   expired, or when no renewal succeeded for a whole TTL counted from the *sending* of the last
//!   successful one (etcd renewed it no earlier than that, so it may expire from then on): the
//!   holder stops acting before anyone else can take over (self-fencing, as Patroni demotes a
//!   primary that cannot reach its store).
//! * [`Store::register`]: a liveness key `/understudy/<cluster>/live/<kind>/<id>` holding the
//!   member's address under a lease; [`Store::live`] lists the members whose leases are alive.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::renewal::{Input, Output, Renewal};
use crate::{check_segment, Compare, Error, KeyValue, LeaseId, Op, Result, Store, TxnOutcome};

/// How often a candidate looks at the election again: a tenth of the TTL, so a takeover adds
/// little to the TTL, within bounds that neither spin nor lag.
pub fn poll_interval(ttl: Duration) -> Duration {
    (ttl / 10).clamp(Duration::from_millis(50), Duration::from_millis(500))
}

/// The leader among an election's candidate keys: the lowest create revision.
pub fn leader_of(candidates: &[KeyValue]) -> Option<&KeyValue> {
    candidates.iter().min_by_key(|kv| kv.create_revision)
}

/// Renews a lease in the background until dropped, stopped, or the lease is lost.
pub struct LeaseKeeper {
    store: Store,
    lease: LeaseId,
    lost: watch::Receiver<Option<String>>,
    task: JoinHandle<()>,
    validity: LeaseValidity,
}

/// Whether a lease may still be held, readable from any thread at the cost of a clock read:
/// the renewal core's deadline, published after every input it takes (0 once lost), so a
/// holder can tell its lease ran out before the renewal task has run again (a process woken
/// from a pause runs its request handlers and its timers in no set order).
#[derive(Clone, Debug)]
pub struct LeaseValidity {
    /// µs after `base`.
    valid_until_us: Arc<AtomicU64>,
    base: Instant,
}

impl LeaseValidity {
    pub fn is_valid(&self) -> bool {
        (self.base.elapsed().as_micros() as u64) < self.valid_until_us.load(Ordering::Acquire)
    }
}

impl LeaseKeeper {
    /// Starts renewing `lease` of `ttl` (renewals every `ttl / 3`), granted by a request sent at
    /// `granted_at` (the lease may expire from `granted_at + ttl` on, if not renewed).
    pub fn spawn(store: Store, lease: LeaseId, ttl: Duration, granted_at: Instant) -> LeaseKeeper {
        let (tx, lost) = watch::channel(None);
        let s = store.clone();
        let base = granted_at;
        let validity = LeaseValidity { valid_until_us: Arc::new(AtomicU64::new(ttl.as_micros() as u64)), base };
        let valid = validity.valid_until_us.clone();
        let task = tokio::spawn(async move {
            // The driver of `Renewal`: it sleeps, sends what it is told, and reports the answer.
            let us = |t: Instant| t.saturating_duration_since(base).as_micros() as u64;
            let mut core = Renewal::new(ttl.as_micros() as u64, 0);
            loop {
                valid.store(core.valid_until_us(), Ordering::Release);
                let outputs = core.take_outputs();
                if outputs.is_empty() {
                    tokio::time::sleep_until(base + Duration::from_micros(core.next_wakeup_us())).await;
                    core.handle(us(Instant::now()), Input::Tick);
                    continue;
                }
                for out in outputs {
                    match out {
                        Output::Renew => {
                            let sent = Instant::now();
                            let left = (base + Duration::from_micros(core.valid_until_us())).saturating_duration_since(sent);
                            let answer = match tokio::time::timeout(left, s.lease_keepalive(lease)).await {
                                Ok(Ok(())) => Input::Renewed { sent_at_us: us(sent) },
                                Ok(Err(Error::LeaseExpired(_))) => Input::Expired,
                                Ok(Err(e)) => {
                                    tracing::warn!("cannot renew lease {lease:x}: {e}");
                                    Input::Failed
                                }
                                Err(_) => Input::Failed,
                            };
                            core.handle(us(Instant::now()), answer);
                        }
                        Output::Lost(why) => {
                            valid.store(0, Ordering::Release);
                            let _ = tx.send(Some(format!("lease {lease:x}: {why}")));
                            return;
                        }
                    }
                }
            }
        });
        LeaseKeeper { store, lease, lost, task, validity }
    }

    /// Whether the lease may still be held: not known lost, and its deadline by this process's
    /// clock not passed.
    pub fn is_valid(&self) -> bool {
        self.lost_reason().is_none() && self.validity.is_valid()
    }

    /// A handle other threads can ask the same question with.
    pub fn validity(&self) -> LeaseValidity {
        self.validity.clone()
    }

    /// Until when the lease is surely valid (the send time of its last successful renewal plus
    /// its TTL; it may expire in the store from then on): a holder that fences itself earlier
    /// than that needs it.
    pub fn valid_until(&self) -> Instant {
        self.validity.base + Duration::from_micros(self.validity.valid_until_us.load(Ordering::Acquire))
    }

    pub fn lease(&self) -> LeaseId {
        self.lease
    }

    /// Why the lease was lost, if it was.
    pub fn lost_reason(&self) -> Option<String> {
        self.lost.borrow().clone()
    }

    /// Waits until the lease is lost; returns why.
    pub async fn lost(&self) -> String {
        let mut rx = self.lost.clone();
        loop {
            if let Some(why) = rx.borrow_and_update().clone() {
                return why;
            }
            if rx.changed().await.is_err() {
                // The task ended without a reason: it was stopped.
                return format!("renewal of lease {:x} stopped", self.lease);
            }
        }
    }

    /// Stops renewing without revoking: the lease expires after its TTL, as if this process had
    /// died.
    pub fn stop_renewing(&self) {
        self.task.abort();
    }

    /// Stops renewing and revokes the lease now (its keys disappear at once).
    pub async fn revoke(self) -> Result<()> {
        self.task.abort();
        match self.store.lease_revoke(self.lease).await {
            Err(Error::LeaseExpired(_)) => Ok(()),
            other => other,
        }
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Leadership of one election, held while its lease is renewed.
pub struct Leadership {
    store: Store,
    election: String,
    key: String,
    create_revision: i64,
    keeper: LeaseKeeper,
}

impl Leadership {
    /// The election's name.
    pub fn election(&self) -> &str {
        &self.election
    }

    /// This leader's election key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The create revision of this leader's election key: it grows with every new leader of the
    /// election, so it serves as a fencing token (an epoch) for whoever takes this leader's
    /// orders outside the store.
    pub fn fencing_token(&self) -> i64 {
        self.create_revision
    }

    /// False once the lease is lost or its deadline has passed by this process's clock (the
    /// holder must stop acting as leader), even if the renewal task has not run since.
    pub fn is_leader(&self) -> bool {
        self.keeper.is_valid()
    }

    /// Waits until leadership is lost; returns why.
    pub async fn lost(&self) -> String {
        self.keeper.lost().await
    }

    /// [`Leadership::is_leader`] for another thread or runtime (a request handler).
    pub fn validity(&self) -> LeaseValidity {
        self.keeper.validity()
    }

    /// [`Store::txn`] guarded by this leadership: [`Error::Deposed`] if the election key is gone
    /// (whatever the caller's own compares say); otherwise the outcome of those compares.
    pub async fn txn(&self, compares: Vec<Compare>, then: Vec<Op>) -> Result<TxnOutcome> {
        if let Some(why) = self.keeper.lost_reason() {
            tracing::debug!("leadership of {} lost: {why}", self.election);
            return Err(self.deposed().await);
        }
        let mut guarded = compares;
        guarded.push(Compare::create_revision(&self.key, self.create_revision));
        let out = self.store.txn_reading(guarded, then, Some(self.key.clone())).await?;
        if !out.succeeded && out.failure_read.as_ref().map(|kv| kv.create_revision) != Some(self.create_revision) {
            return Err(self.deposed().await);
        }
        Ok(out)
    }

    /// A guarded unconditional write.
    pub async fn put(&self, key: &str, value: Vec<u8>) -> Result<i64> {
        Ok(self.txn(vec![], vec![Op::put(key, value)]).await?.revision)
    }

    /// A guarded delete.
    pub async fn delete(&self, key: &str) -> Result<i64> {
        Ok(self.txn(vec![], vec![Op::delete(key)]).await?.revision)
    }

    async fn deposed(&self) -> Error {
        let leader = self.store.observe(&self.election).await.ok().flatten();
        Error::Deposed { election: self.election.clone(), leader }
    }

    /// Stops renewing the lease without revoking it (as a crashed leader would): for tests and
    /// for a leader that wants to fence itself without reaching the store.
    pub fn stop_renewing(&self) {
        self.keeper.stop_renewing();
    }

    /// Gives leadership up now: the next candidate takes over without waiting for the TTL.
    pub async fn resign(self) -> Result<()> {
        self.keeper.revoke().await
    }
}

/// A liveness registration, present in [`Store::live`] while its lease is renewed.
pub struct Registration {
    key: String,
    keeper: LeaseKeeper,
}

impl Registration {
    pub fn key(&self) -> &str {
        &self.key
    }
    /// Waits until the registration's lease is lost; returns why.
    pub async fn lost(&self) -> String {
        self.keeper.lost().await
    }
    pub fn is_live(&self) -> bool {
        self.keeper.is_valid()
    }
    /// Why the registration's lease was lost, if it was.
    pub fn lost_reason(&self) -> Option<String> {
        self.keeper.lost_reason()
    }
    /// The lease the registration lives under (a new registration has a new one).
    pub fn lease(&self) -> LeaseId {
        self.keeper.lease()
    }
    /// Until when the registration is surely live (see [`LeaseKeeper::valid_until`]).
    pub fn valid_until(&self) -> Instant {
        self.keeper.valid_until()
    }
    /// Stops renewing (the key disappears after the TTL), as if this member had died.
    pub fn stop_renewing(&self) {
        self.keeper.stop_renewing();
    }
    /// Removes the registration now.
    pub async fn deregister(self) -> Result<()> {
        self.keeper.revoke().await
    }
}

impl Store {
    fn election_prefix(&self, name: &str) -> String {
        format!("/understudy/{}/election/{name}/", self.cluster())
    }

    /// Stands in election `name` with address `addr` (what [`Store::observe`] tells others) and
    /// waits until this candidate leads. A standby waits here; wrap it in a timeout or a select
    /// to give up. Leadership lasts while the lease of `ttl` is renewed.
    pub async fn campaign(&self, name: &str, addr: &str, ttl: Duration) -> Result<Leadership> {
        check_segment(name)?;
        let granted_at = Instant::now();
        let lease = self.lease_grant(ttl).await?;
        let key = format!("{}{lease:x}", self.election_prefix(name));
        let out = self.txn(vec![Compare::absent(&key)], vec![Op::put_leased(&key, addr.as_bytes().to_vec(), lease)]).await?;
        if !out.succeeded {
            return Err(Error::BadKey { key, why: "campaign key already exists (lease ids are unique: another process reuses this lease?)" });
        }
        let keeper = LeaseKeeper::spawn(self.clone(), lease, ttl, granted_at);
        let create_revision = out.revision;
        let prefix = self.election_prefix(name);
        loop {
            let candidates = self.list(&prefix).await?;
            match leader_of(&candidates) {
                Some(kv) if kv.key == key => {
                    return Ok(Leadership { store: self.clone(), election: name.to_string(), key, create_revision, keeper });
                }
                _ if !candidates.iter().any(|kv| kv.key == key) => return Err(Error::LeaseExpired(lease)),
                _ => {}
            }
            tokio::select! {
                _ = tokio::time::sleep(poll_interval(ttl)) => {}
                why = keeper.lost() => {
                    tracing::warn!("campaign in {name} lost its lease: {why}");
                    return Err(Error::LeaseExpired(lease));
                }
            }
        }
    }

    /// The address of election `name`'s current leader, if any (for "not leader, try X").
    pub async fn observe(&self, name: &str) -> Result<Option<String>> {
        check_segment(name)?;
        let candidates = self.list(&self.election_prefix(name)).await?;
        Ok(leader_of(&candidates).map(|kv| String::from_utf8_lossy(&kv.value).into_owned()))
    }

    /// The current leader's election key of election `name`, if any: its value is the leader's
    /// address, its key changes with every new leader (a restarted one included), so followers
    /// that must leave an old leader compare keys.
    pub async fn leader(&self, name: &str) -> Result<Option<KeyValue>> {
        check_segment(name)?;
        let candidates = self.list(&self.election_prefix(name)).await?;
        Ok(leader_of(&candidates).cloned())
    }

    /// Registers member `id` of `kind` at `addr` as live for as long as its lease of `ttl` is
    /// renewed (a ZooKeeper ephemeral node). A second registration of one id replaces the first.
    pub async fn register(&self, kind: &str, id: &str, addr: &str, ttl: Duration) -> Result<Registration> {
        check_segment(kind)?;
        check_segment(id)?;
        let granted_at = Instant::now();
        let lease = self.lease_grant(ttl).await?;
        let key = self.key("live", kind, id);
        self.txn(vec![], vec![Op::put_leased(&key, addr.as_bytes().to_vec(), lease)]).await?;
        Ok(Registration { key, keeper: LeaseKeeper::spawn(self.clone(), lease, ttl, granted_at) })
    }

    /// The live members of `kind`: (id, address), in id order.
    pub async fn live(&self, kind: &str) -> Result<Vec<(String, String)>> {
        check_segment(kind)?;
        let prefix = self.prefix("live", kind);
        Ok(self
            .list(&prefix)
            .await?
            .into_iter()
            .map(|kv| (kv.key[prefix.len()..].to_string(), String::from_utf8_lossy(&kv.value).into_owned()))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(key: &str, create: i64) -> KeyValue {
        KeyValue { key: key.into(), value: vec![], create_revision: create, mod_revision: create, version: 1, lease: 1 }
    }

    #[test]
    fn the_earliest_candidate_leads() {
        assert!(leader_of(&[]).is_none());
        let c = [kv("/e/b", 7), kv("/e/a", 9), kv("/e/c", 3)];
        assert_eq!(leader_of(&c).unwrap().key, "/e/c");
    }

    #[test]
    fn poll_interval_is_bounded() {
        assert_eq!(poll_interval(Duration::from_secs(2)), Duration::from_millis(200));
        assert_eq!(poll_interval(Duration::from_millis(100)), Duration::from_millis(50));
        assert_eq!(poll_interval(Duration::from_secs(60)), Duration::from_millis(500));
    }
}
