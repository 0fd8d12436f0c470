//! The controller with standbys on the control store (`nearlog controller --store URL`): its
//! election, and its state as keys written by the leader's guarded transactions.
//!
//! The core's [`MetaStore`] is synchronous (it saves inside the core's lock, before the reply),
//! while the store is async. So the store, the candidacy and the lease renewal live on a thread
//! of their own with a one-thread runtime ([`ControlBridge`]): the renewal keeps running
//! whatever the controller's own runtime is doing, and a save is a request to that thread,
//! answered before the core replies.
//!
//! Keys (one per object, never one blob: etcd refuses requests over 1.5 MiB):
//! `nearlog/peer/<id>` (the peer's address, region and draining flag), `nearlog/file/<file id>`
//! (the file's key and placement: a path is too long and too free-form for a key segment), and
//! `nearlog/meta/counters` (the next peer and file ids). A save writes only the keys that
//! changed, in one transaction guarded by each touched key's mod revision as this leader last
//! read or wrote it, and by its election key ([`control::Leadership::txn`]): a deposed
//! controller, or a second writer outside the election, can never commit.

use std::collections::BTreeMap;
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use control::{Compare, Op};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use crate::proto::{ControllerState, FileId, FileMeta, PeerId, PeerInfo};
use crate::store::{MetaStore, StoreError};

/// The election every controller of one nearlog cluster stands in.
pub const CONTROLLER_ELECTION: &str = "nearlog-controller";
/// Longest wait for one save or load on the store before the request fails (the core rolls the
/// change back; the client retries or gets an error).
pub const STORE_CALL_TIMEOUT_MS: u64 = 10_000;
/// Saves waiting for the store thread (one per request in the core's lock: at most a few).
const STORE_QUEUE_LEN: usize = 64;

/// Where the controller keeps its state and how it stands for leadership.
#[derive(Clone, Debug)]
pub struct ControllerControl {
    pub store_url: String,
    pub cluster: String,
    pub cluster_id: String,
    /// The election lease: a leader that cannot renew it for this long stops; a standby takes
    /// over about this long after the leader died.
    pub election_ttl: Duration,
    /// What this controller tells others when it leads (its serving address).
    pub advertise: String,
}

/// The cluster id a controller derives from the cluster secret: two clusters with different
/// secrets never share one store's keys under one name. A checksum, not the secret: the store's
/// readers need not know it.
pub fn cluster_id_from_secret(secret: &[u8]) -> String {
    control::daemon::cluster_id_from_secret("nearlog", secret)
}

/// A file's key as stored: its path and placement.
#[derive(Serialize, Deserialize)]
struct StoredFile {
    key: String,
    meta: FileMeta,
}

#[derive(Serialize, Deserialize)]
struct Counters {
    next_peer: PeerId,
    next_file: FileId,
}

enum Call {
    Load(oneshot::Sender<Result<Option<ControllerState>, String>>),
    Save(ControllerState, oneshot::Sender<Result<(), String>>),
}

/// The store thread's handle. Dropping it ends the thread (its lease is then not renewed).
pub struct ControlBridge {
    calls: mpsc::Sender<Call>,
    validity: control::LeaseValidity,
    lost: std::sync::Arc<std::sync::Mutex<Option<std_mpsc::Receiver<String>>>>,
}

impl ControlBridge {
    /// Opens the store and stands for leadership on a thread of its own; returns once this
    /// controller leads (or the store cannot be opened: the error).
    pub fn lead(ctl: ControllerControl) -> Result<(ControlBridge, i64), String> {
        let (calls_tx, mut calls_rx) = mpsc::channel::<Call>(STORE_QUEUE_LEN);
        let (led_tx, led_rx) = std_mpsc::channel::<Result<(i64, control::LeaseValidity), String>>();
        let (lost_tx, lost_rx) = std_mpsc::channel::<String>();
        std::thread::Builder::new()
            .name("nearlog-control-store".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = led_tx.send(Err(format!("cannot start the store thread's runtime: {e}")));
                        return;
                    }
                };
                rt.block_on(async move {
                    let store = match control::Store::open(&ctl.store_url, &ctl.cluster, &ctl.cluster_id).await {
                        Ok(s) => s,
                        Err(e) => {
                            let _ = led_tx.send(Err(format!("control store {}: {e}", ctl.store_url)));
                            return;
                        }
                    };
                    let standing = |lost: Option<&control::Error>| match lost {
                        None => println!("nearlog controller: standing for leadership of {CONTROLLER_ELECTION} as {}", ctl.advertise),
                        // The store was out of reach long enough to lose the candidacy.
                        Some(e) => println!("nearlog controller: candidacy lost ({e}); standing again"),
                    };
                    let lead = match control::daemon::campaign_until_leading(&store, CONTROLLER_ELECTION, &ctl.advertise, ctl.election_ttl, standing).await {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = led_tx.send(Err(format!("campaign on {}: {e}", ctl.store_url)));
                            return;
                        }
                    };
                    let _ = led_tx.send(Ok((lead.fencing_token(), lead.validity())));
                    let mut keys = Keys { store: &store, revs: BTreeMap::new(), values: BTreeMap::new() };
                    let why = loop {
                        tokio::select! {
                            why = lead.lost() => break why,
                            call = calls_rx.recv() => match call {
                                None => break "the controller stopped".to_string(),
                                Some(Call::Load(reply)) => {
                                    let _ = reply.send(keys.load().await);
                                }
                                Some(Call::Save(state, reply)) => {
                                    let r = keys.save(&lead, &state).await;
                                    let failed = r.as_ref().err().cloned();
                                    let _ = reply.send(r);
                                    if let Some(e) = failed {
                                        // A failed guarded write: deposed, another writer, or the
                                        // store unreachable with the outcome unknown. Either way
                                        // what this leader believes may not be what is stored:
                                        // step down rather than serve on.
                                        break format!("a guarded write failed: {e}");
                                    }
                                }
                            }
                        }
                    };
                    let _ = lost_tx.send(why);
                    let _ = lead.resign().await;
                });
            })
            .map_err(|e| format!("cannot start the store thread: {e}"))?;
        let (token, validity) = led_rx.recv().map_err(|_| "the store thread ended".to_string())??;
        Ok((ControlBridge { calls: calls_tx, validity, lost: std::sync::Arc::new(std::sync::Mutex::new(Some(lost_rx))) }, token))
    }

    /// The core's store: saves go to the store thread.
    pub fn meta_store(&self) -> BridgeStore {
        BridgeStore { calls: self.calls.clone(), validity: self.validity.clone() }
    }

    /// Waits (on a blocking thread) until leadership is lost; returns why.
    pub async fn lost(&self) -> String {
        let rx = self.lost.lock().unwrap().take();
        let Some(rx) = rx else { return "leadership already reported lost".into() };
        tokio::task::spawn_blocking(move || rx.recv().unwrap_or_else(|_| "the store thread ended".into())).await.unwrap_or_else(|e| e.to_string())
    }
}

/// The [`MetaStore`] of a controller that leads on the control store.
pub struct BridgeStore {
    calls: mpsc::Sender<Call>,
    validity: control::LeaseValidity,
}

fn store_err(why: String) -> StoreError {
    StoreError::Io { path: "control store".into(), source: std::io::Error::other(why) }
}

impl BridgeStore {
    fn call<T>(&self, make: impl FnOnce(oneshot::Sender<Result<T, String>>) -> Call) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.calls.try_send(make(tx)).map_err(|e| store_err(format!("store thread not taking requests: {e}")))?;
        // Waits without a runtime: the core calls this inside its lock, on any thread.
        let deadline = std::time::Instant::now() + Duration::from_millis(STORE_CALL_TIMEOUT_MS);
        let mut rx = rx;
        loop {
            match rx.try_recv() {
                Ok(r) => return r.map_err(store_err),
                Err(oneshot::error::TryRecvError::Closed) => return Err(store_err("the store thread ended (leadership lost)".into())),
                Err(oneshot::error::TryRecvError::Empty) if std::time::Instant::now() >= deadline => {
                    return Err(store_err(format!("no answer from the control store within {STORE_CALL_TIMEOUT_MS} ms")))
                }
                Err(oneshot::error::TryRecvError::Empty) => std::thread::sleep(Duration::from_micros(200)),
            }
        }
    }
}

impl MetaStore for BridgeStore {
    fn load(&mut self) -> Result<Option<ControllerState>, StoreError> {
        self.call(Call::Load)
    }
    fn save(&mut self, state: &ControllerState) -> Result<(), StoreError> {
        let s = state.clone();
        self.call(move |tx| Call::Save(s, tx))
    }
    fn may_serve(&self) -> bool {
        self.validity.is_valid()
    }
}

/// The state's keys as this leader last read or wrote them.
struct Keys<'a> {
    store: &'a control::Store,
    /// Mod revision of each key (absent: not in the store).
    revs: BTreeMap<String, i64>,
    /// Value of each key, to write only what changed.
    values: BTreeMap<String, Vec<u8>>,
}

impl Keys<'_> {
    fn encode(&self, state: &ControllerState) -> BTreeMap<String, Vec<u8>> {
        let mut m = BTreeMap::new();
        for (id, p) in &state.peers {
            // Used bytes and liveness are soft state (every heartbeat changes them): not stored.
            let p = PeerInfo { used_bytes: 0, live: false, ..p.clone() };
            m.insert(self.store.key("nearlog", "peer", &id.to_string()), serde_json::to_vec(&p).expect("encodes"));
        }
        for (key, meta) in &state.files {
            let v = serde_json::to_vec(&StoredFile { key: key.clone(), meta: meta.clone() }).expect("encodes");
            m.insert(self.store.key("nearlog", "file", &meta.file.to_string()), v);
        }
        let c = Counters { next_peer: state.next_peer, next_file: state.next_file };
        m.insert(self.store.key("nearlog", "meta", "counters"), serde_json::to_vec(&c).expect("encodes"));
        m
    }

    async fn load(&mut self) -> Result<Option<ControllerState>, String> {
        let mut state = ControllerState::default();
        self.revs.clear();
        self.values.clear();
        let ck = self.store.key("nearlog", "meta", "counters");
        let Some(c) = self.store.get(&ck).await.map_err(|e| e.to_string())? else { return Ok(None) };
        let bad = |k: &str, e: serde_json::Error| format!("nearlog state key {k} in the control store is corrupt: {e}");
        let counters: Counters = serde_json::from_slice(&c.value).map_err(|e| bad(&ck, e))?;
        state.next_peer = counters.next_peer;
        state.next_file = counters.next_file;
        self.revs.insert(ck.clone(), c.mod_revision);
        self.values.insert(ck, c.value);
        let pp = self.store.prefix("nearlog", "peer");
        for kv in self.store.list(&pp).await.map_err(|e| e.to_string())? {
            let id = kv.key[pp.len()..].parse().map_err(|_| format!("bad peer key {} in the control store", kv.key))?;
            let p: PeerInfo = serde_json::from_slice(&kv.value).map_err(|e| bad(&kv.key, e))?;
            state.peers.insert(id, p);
            self.revs.insert(kv.key.clone(), kv.mod_revision);
            self.values.insert(kv.key, kv.value);
        }
        for kv in self.store.list(&self.store.prefix("nearlog", "file")).await.map_err(|e| e.to_string())? {
            let f: StoredFile = serde_json::from_slice(&kv.value).map_err(|e| bad(&kv.key, e))?;
            state.files.insert(f.key, f.meta);
            self.revs.insert(kv.key.clone(), kv.mod_revision);
            self.values.insert(kv.key, kv.value);
        }
        Ok(Some(state))
    }

    async fn save(&mut self, lead: &control::Leadership, state: &ControllerState) -> Result<(), String> {
        let want = self.encode(state);
        let mut compares = Vec::new();
        let mut ops = Vec::new();
        for (k, v) in &want {
            if self.values.get(k) != Some(v) {
                compares.push(Compare::mod_revision(k, self.revs.get(k).copied().unwrap_or(0)));
                ops.push(Op::put(k, v.clone()));
            }
        }
        let gone: Vec<String> = self.values.keys().filter(|k| !want.contains_key(*k)).cloned().collect();
        for k in &gone {
            compares.push(Compare::mod_revision(k, self.revs[k]));
            ops.push(Op::delete(k));
        }
        if ops.is_empty() {
            return Ok(());
        }
        let out = lead.txn(compares, ops).await.map_err(|e| e.to_string())?;
        if !out.succeeded {
            return Err("nearlog state in the control store changed under this leader: another writer outside the election".into());
        }
        for (k, v) in want {
            if self.values.get(&k) != Some(&v) {
                self.revs.insert(k.clone(), out.revision);
                self.values.insert(k, v);
            }
        }
        for k in gone {
            self.values.remove(&k);
            self.revs.remove(&k);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> ControllerState {
        let mut s = ControllerState { next_peer: 3, next_file: 2, ..Default::default() };
        for id in 1..=2 {
            s.peers.insert(id, PeerInfo { addr: format!("127.0.0.1:{id}"), region_bytes: 1 << 20, used_bytes: 7, draining: false, live: true });
        }
        let meta = FileMeta { file: 1, epoch: 1, peers: vec![1, 2], initialized: true, prev_peers: vec![], placed_at: 1, owner_epoch: 1 };
        s.files.insert("/a/b.log".into(), meta);
        s
    }

    #[tokio::test]
    async fn state_is_one_key_per_object_written_under_guards() {
        let dir = tempfile::tempdir().unwrap();
        let store = control::Store::open(dir.path().to_str().unwrap(), "t", "id").await.unwrap();
        let lead = store.campaign(CONTROLLER_ELECTION, "me", Duration::from_secs(2)).await.unwrap();
        let mut keys = Keys { store: &store, revs: BTreeMap::new(), values: BTreeMap::new() };
        assert!(keys.load().await.unwrap().is_none(), "an empty store has no state");
        let mut s = state();
        keys.save(&lead, &s).await.unwrap();
        assert_eq!(store.list(&store.prefix("nearlog", "peer")).await.unwrap().len(), 2);
        assert_eq!(store.list(&store.prefix("nearlog", "file")).await.unwrap().len(), 1);

        // A heartbeat's soft state (used bytes, liveness) writes nothing.
        let rev = store.get(&store.key("nearlog", "peer", "1")).await.unwrap().unwrap().mod_revision;
        s.peers.get_mut(&1).unwrap().used_bytes = 99;
        keys.save(&lead, &s).await.unwrap();
        assert_eq!(store.get(&store.key("nearlog", "peer", "1")).await.unwrap().unwrap().mod_revision, rev);

        // A new leader loads what was kept (soft state cleared).
        let mut again = Keys { store: &store, revs: BTreeMap::new(), values: BTreeMap::new() };
        let loaded = again.load().await.unwrap().unwrap();
        assert_eq!(loaded.files, s.files);
        assert_eq!((loaded.next_peer, loaded.next_file), (3, 2));
        assert_eq!(loaded.peers[&1].addr, s.peers[&1].addr);

        // A removed file's key is deleted.
        s.files.clear();
        keys.save(&lead, &s).await.unwrap();
        assert!(store.list(&store.prefix("nearlog", "file")).await.unwrap().is_empty());

        // Someone else changed a key this leader is about to write: the write fails, nothing
        // is applied.
        store.put(&store.key("nearlog", "peer", "2"), b"{}".to_vec()).await.unwrap();
        s.peers.get_mut(&2).unwrap().draining = true;
        s.next_file = 9;
        let e = keys.save(&lead, &s).await.unwrap_err();
        assert!(e.contains("another writer"), "{e}");
        assert_eq!(store.get(&store.key("nearlog", "peer", "2")).await.unwrap().unwrap().value, b"{}");
        let c: Counters = serde_json::from_slice(&store.get(&store.key("nearlog", "meta", "counters")).await.unwrap().unwrap().value).unwrap();
        assert_eq!(c.next_file, 2);

        // A leader whose election key is gone cannot write at all.
        lead.stop_renewing();
        store.delete(lead.key()).await.unwrap();
        s.next_file = 10;
        let mut fresh = Keys { store: &store, revs: BTreeMap::new(), values: BTreeMap::new() };
        // The foreign write left a value that is no peer: a clear error, not a guess.
        let e = fresh.load().await.unwrap_err();
        assert!(e.contains("peer/2") && e.contains("corrupt"), "{e}");
        store.put(&store.key("nearlog", "peer", "2"), serde_json::to_vec(&s.peers[&2]).unwrap()).await.unwrap();
        fresh.load().await.unwrap();
        let e = fresh.save(&lead, &s).await.unwrap_err();
        assert!(e.contains("no longer leader"), "{e}");
    }
}
