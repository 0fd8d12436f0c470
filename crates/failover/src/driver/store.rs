//! The monitor's state on the control store, when it runs with standbys (`failover run --store
//! URL`): what [`crate::journal`] keeps in a file, as keys written by the leader's guarded
//! transactions.
//!
//! Keys, under `/understudy/<cluster>/failover/`, one per object (never one blob):
//! * `epoch/<name>`: a counter, one more with every write below. Every write is one transaction
//!   guarded by the election ([`control::Leadership::txn`]) **and** by the epoch this monitor
//!   last read or wrote: a deposed monitor cannot write (its election key is gone), and a second
//!   writer outside the election is noticed instead of overwritten.
//! * `state/<name>`: the SpecREDS state machine's durable state ([`Record`]: the phase, with the
//!   backup being recovered and the collapse under way; the primary; the volume), written after
//!   every step and before its actions run, as the journal file is.
//! * `primary/<name>`: where clients go ([`PrimaryRecord`]), which the endpoints follow.
//!
//! A standby that takes over reads the state after winning (the old leader can no longer write)
//! and continues the state machine from it ([`crate::core::Monitor::recover`]): a failover in
//! flight resumes from its recorded phase, so it ends with exactly one of primary and backup
//! serving (the collapse decides; the volume service answers a repeated collapse with the
//! outcome already decided).

use control::{Compare, Daemon, Op};

use crate::journal::Record;
use crate::proto::PrimaryRecord;

/// The system segment of every key.
const SYSTEM: &str = "failover";

/// The election every monitor of one application stands in: `failover-<name>`.
pub fn election(name: &str) -> String {
    format!("failover-{name}")
}

/// The key of the endpoint record of application `name`.
pub fn primary_key(store: &control::Store, name: &str) -> String {
    store.key(SYSTEM, "primary", name)
}

fn state_key(store: &control::Store, name: &str) -> String {
    store.key(SYSTEM, "state", name)
}

fn epoch_key(store: &control::Store, name: &str) -> String {
    store.key(SYSTEM, "epoch", name)
}

#[derive(Debug, thiserror::Error)]
pub enum StoreJournalError {
    #[error("control store: {0}")]
    Store(#[from] control::Error),
    #[error("failover state key {key} in the control store is corrupt: {why}")]
    Corrupt { key: String, why: String },
    #[error("failover epoch of {name} in the control store is no longer {expected}: another writer outside the election; stepping down")]
    Raced { name: String, expected: u64 },
}

/// The state as stored: the journal's record and who wrote it.
#[derive(serde::Serialize, serde::Deserialize)]
struct Stored {
    #[serde(flatten)]
    record: Record,
    writer: i64,
}

/// The monitor's journal on the control store, for a leader.
pub struct StoreJournal {
    daemon: Daemon,
    name: String,
    /// The epoch as this leader last read or wrote it (0: never written).
    epoch: u64,
    /// The state read when this journal was opened.
    loaded: Option<Record>,
}

impl StoreJournal {
    /// Reads what the previous leader left (None: no monitor of `name` ever wrote).
    pub async fn open(daemon: Daemon, name: &str) -> Result<(StoreJournal, Option<Record>), StoreJournalError> {
        let store = daemon.store();
        let ek = epoch_key(store, name);
        let epoch = match store.get(&ek).await? {
            None => 0,
            Some(kv) => std::str::from_utf8(&kv.value)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| StoreJournalError::Corrupt { key: ek.clone(), why: format!("{:?} is not a number", String::from_utf8_lossy(&kv.value)) })?,
        };
        let sk = state_key(store, name);
        let record = match store.get(&sk).await? {
            None => None,
            Some(kv) => Some(serde_json::from_slice::<Stored>(&kv.value).map_err(|e| StoreJournalError::Corrupt { key: sk, why: e.to_string() })?.record),
        };
        Ok((StoreJournal { daemon, name: name.to_string(), epoch, loaded: record.clone() }, record))
    }

    /// The state read when this journal was opened (what the previous leader left).
    pub fn loaded(&self) -> Option<&Record> {
        self.loaded.as_ref()
    }

    pub fn daemon(&self) -> &Daemon {
        &self.daemon
    }

    /// The epoch of the last write this leader made or read.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Writes the state (after a step, before its actions).
    pub async fn save(&mut self, r: &Record) -> Result<(), StoreJournalError> {
        let v = serde_json::to_vec(&Stored { record: r.clone(), writer: self.daemon.fencing_token() }).expect("serialisable");
        let k = state_key(self.daemon.store(), &self.name);
        self.write(k, v).await
    }

    /// Publishes where clients go (the endpoints follow it).
    pub async fn publish(&mut self, p: &PrimaryRecord) -> Result<(), StoreJournalError> {
        let v = serde_json::to_vec(p).expect("serialisable");
        let k = primary_key(self.daemon.store(), &self.name);
        self.write(k, v).await
    }

    /// One guarded write of `key` with the next epoch.
    async fn write(&mut self, key: String, value: Vec<u8>) -> Result<(), StoreJournalError> {
        let ek = epoch_key(self.daemon.store(), &self.name);
        let guard = match self.epoch {
            0 => Compare::absent(&ek),
            e => Compare::value(&ek, e.to_string().into_bytes()),
        };
        let next = self.epoch + 1;
        let ops = vec![Op::put(&ek, next.to_string().into_bytes()), Op::put(&key, value)];
        let out = self.daemon.call(move |_, lead| async move { lead.txn(vec![guard], ops).await }).await?;
        if !out.succeeded {
            return Err(StoreJournalError::Raced { name: self.name.clone(), expected: self.epoch });
        }
        self.epoch = next;
        Ok(())
    }

    /// Confirms in the store that this monitor still leads (a guarded write of nothing): for a
    /// loop that did not run for a while and may have outlived its lease unawares.
    pub async fn confirm(&self) -> Result<(), StoreJournalError> {
        self.daemon.call(|_, lead| async move { lead.txn(vec![], vec![]).await }).await?;
        Ok(())
    }
}

/// Reads the endpoint record of application `name` (None: nothing published yet).
pub async fn read_primary(store: &control::Store, name: &str) -> Result<Option<(PrimaryRecord, i64)>, StoreJournalError> {
    let k = primary_key(store, name);
    match store.get(&k).await? {
        None => Ok(None),
        Some(kv) => {
            let p = serde_json::from_slice(&kv.value).map_err(|e| StoreJournalError::Corrupt { key: k, why: e.to_string() })?;
            Ok(Some((p, kv.mod_revision)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::Monitor;
    use crate::proto::{InstanceId, MonitorConfig};
    use std::time::Duration;

    fn cfg(dir: &std::path::Path) -> control::DaemonConfig {
        control::DaemonConfig {
            store_url: dir.to_str().unwrap().to_string(),
            cluster: "t".into(),
            cluster_id: control::daemon::cluster_id_from_secret("failover", b"s"),
            election: election("db"),
            election_ttl: Duration::from_secs(2),
            advertise: "m1".into(),
        }
    }

    /// The state and the endpoint record round-trip as separate keys under the epoch guard; a
    /// write by someone else (the epoch moved) is refused and applies nothing; a deposed leader
    /// cannot write at all.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn state_round_trips_under_the_epoch_and_election_guards() {
        let dir = tempfile::tempdir().unwrap();
        let d = Daemon::lead(cfg(dir.path()), |_| {}).await.unwrap();
        let store = d.store().clone();
        let (mut j, none) = StoreJournal::open(d, "db").await.unwrap();
        assert!(none.is_none(), "an empty store has no state");
        let m = Monitor::new(MonitorConfig::default(), "db".into(), 0);
        let r = Record { config: m.config().clone(), state: m.durable().clone() };
        j.save(&r).await.unwrap();
        let p = PrimaryRecord { instance: Some(InstanceId(1)), addr: Some("10.0.0.2:5000".parse().unwrap()), frozen: false, writer: j.daemon().fencing_token() };
        j.publish(&p).await.unwrap();
        assert_eq!(j.epoch(), 2);
        assert_eq!(read_primary(&store, "db").await.unwrap().unwrap().0, p);
        assert_eq!(store.list(&store.prefix(SYSTEM, "state")).await.unwrap().len(), 1);

        // Someone outside the election moves the epoch: this leader's next write is refused
        // and the state stays what it was.
        store.put(&epoch_key(&store, "db"), b"7".to_vec()).await.unwrap();
        let mut r2 = r.clone();
        r2.state.failovers = 5;
        let e = j.save(&r2).await.unwrap_err();
        assert!(matches!(e, StoreJournalError::Raced { expected: 2, .. }), "{e}");

        // A fresh reader sees the last state written through the guard.
        let d = j.daemon;
        let (mut j, back) = StoreJournal::open(d, "db").await.unwrap();
        assert_eq!(back, Some(r.clone()));
        assert_eq!(j.epoch(), 7);
        j.confirm().await.unwrap();

        // Deposed (its lease not renewed past the TTL): every write fails as such.
        j.daemon().leadership().stop_renewing();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let e = j.save(&r2).await.unwrap_err();
        assert!(matches!(e, StoreJournalError::Store(control::Error::Deposed { .. })), "{e}");
        assert!(j.confirm().await.is_err());
        let sk = state_key(&store, "db");
        let stored: Stored = serde_json::from_slice(&store.get(&sk).await.unwrap().unwrap().value).unwrap();
        assert_eq!(stored.record, r);
    }
}
