//! [`ControllerCore`]: the nearlog metadata (SplitFT's controller): log peers and their free
//! space, which file lives on which peers, and each file's epoch. Every change is persisted
//! through a [`MetaStore`] *before* it is answered, so a controller restart loses nothing
//! (in particular an epoch is never handed out twice).

use std::collections::{BTreeMap, BTreeSet};

use crate::proto::{ControllerState, CtlReply, CtlRequest, Epoch, FileGrant, FileId, FileMeta, PeerAddr, PeerId, PeerInfo};
use crate::store::{MetaStore, StoreError};

/// Longest file key accepted (a path).
pub const MAX_KEY_BYTES: usize = 4096;
/// Most replicas a file may ask for.
pub const MAX_REPLICAS: u32 = 7;
/// Most file ids one peer heartbeat may list.
pub const MAX_HEARTBEAT_FILES: usize = 100_000;

/// A file key is a path: 1..=MAX_KEY_BYTES bytes.
fn check_key(k: &str) -> Result<(), String> {
    if k.is_empty() || k.len() > MAX_KEY_BYTES {
        Err(format!("file key must be 1..={MAX_KEY_BYTES} bytes"))
    } else {
        Ok(())
    }
}

/// The peer with the most free space (ties: lowest id) not already holding `m`.
fn pick_peer(free: &BTreeMap<PeerId, u64>, m: &FileMeta) -> Option<PeerId> {
    free.iter().filter(|(id, _)| !m.peers.contains(id) && !m.prev_peers.contains(id)).max_by_key(|(&id, &f)| (f, std::cmp::Reverse(id))).map(|(&id, _)| id)
}

/// Places `m` on `to` instead of `from`; the set the last committed epoch ran on stays the
/// recovery set until a Base commits on the new one.
fn replace_peer(m: &mut FileMeta, from: PeerId, to: PeerId) {
    if m.prev_peers.is_empty() {
        m.prev_peers = m.peers.clone();
    }
    for p in m.peers.iter_mut() {
        if *p == from {
            *p = to;
        }
    }
    m.placed_at = m.epoch;
}

/// Default of `--peer-lease-ms`: a peer silent for this long is lost (five missed heartbeats at
/// `HEARTBEAT_INTERVAL_MS` = 1 s: one slow heartbeat on a loaded machine is not a loss).
pub const DEFAULT_PEER_LEASE_MS: u64 = 5000;

/// What the controller is told: a request, the passing of time, or the end of a move it asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CtlInput {
    Request(CtlRequest),
    /// Time passed (the driver ticks a few times per lease): leases are checked, lost peers
    /// replaced.
    Tick,
    /// The driver's mover of `key` (a [`CtlOutput::Move`]) ended; on failure the next tick
    /// asks again.
    MoveEnded { key: String, ok: bool },
    /// The peers' liveness registrations in the control store, read now: peer → lease id
    /// (`nearlog peer --store`). See [`ControllerCore`] on leases.
    Leases { live: BTreeMap<PeerId, i64> },
}

/// What the controller asks of its driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CtlOutput {
    /// The answer to a [`CtlInput::Request`] (exactly one each, in order).
    Reply(CtlReply),
    /// `peer` was silent past its lease: it is no longer live.
    PeerLost { peer: PeerId, silent_ms: u64 },
    /// A lost peer reported again (its files replaced meanwhile are not its any more).
    PeerBack { peer: PeerId },
    /// Move `key` onto its new placement (the same mover as `nearlog reclaim`), `lost`
    /// replaced by `to` (`to` = `lost`: a retry of a pending move). Then
    /// [`CtlInput::MoveEnded`].
    Move { key: String, lost: PeerId, to: PeerId },
    /// `key` stays on the lost `peer` (reported once per peer and file until something changes).
    CannotReplace { peer: PeerId, key: String, reason: String },
    /// A replacement could not be persisted: nothing changed; the next tick tries again.
    Error(String),
}

/// The controller: inputs through [`ControllerCore::handle`] (`now_ms` from the driver's
/// monotonic clock), outputs from [`ControllerCore::take_outputs`],
/// [`ControllerCore::check_invariants`] after every input in debug builds.
///
/// Liveness is a lease per peer (ZooKeeper's ephemeral node, as SplitFT keeps its peers): a
/// registration or heartbeat renews it; a peer silent past `peer_lease_ms` is lost and the
/// controller replaces it on every file placed on it, the way `Reclaim` does (the old set
/// stays the recovery set until a Base commits on the new one). A file is only re-placed while
/// a majority of its recovery set is not lost (else no mover could recover it, and the change
/// would only hide the loss), onto a live peer with room outside the file's sets. The lost peer
/// is not marked draining: if it comes back (restarted empty, or after a partition) it is an
/// ordinary peer again, and its heartbeat releases the copies it still holds of files placed
/// elsewhere. Leases are soft state: after a controller restart every peer gets a full lease
/// from the first tick.
///
/// **Store leases** (issue 24 §3): a peer started with `--store` keeps its lease in the control
/// store (`live/peer/<id>`, renewed by the peer; an etcd lease, ZooKeeper's ephemeral node
/// proper), and the driver feeds the listing in ([`CtlInput::Leases`]). A peer once listed is
/// *leased*: from then on the store alone says whether it is live — gone from the listing, it is
/// lost at once (the store already waited its TTL), and only listed again is it back; its
/// heartbeats keep its soft state but no longer its liveness (else a peer cut off from the
/// store but not from the controller would flap). A peer never listed keeps the heartbeat
/// lease: that is the embedded default's path, where the store is a directory locked by the
/// controller's process, which peers in other processes cannot register in. A controller that
/// cannot read the store gets no listing and decides nothing about leased peers meanwhile.
pub struct ControllerCore<S: MetaStore> {
    state: ControllerState,
    store: S,
    /// Outputs not yet taken by the driver.
    out: Vec<CtlOutput>,
    /// The time of the last input.
    now_ms: u64,
    /// 0: no lease (peers are never declared lost).
    peer_lease_ms: u64,
    /// Time of the first input (a peer not heard since then is counted from it).
    started_ms: Option<u64>,
    /// When each peer last registered or heartbeated.
    heard_ms: BTreeMap<PeerId, u64>,
    /// Peers silent past their lease.
    lost: BTreeSet<PeerId>,
    /// Files whose move was handed to the driver and has not ended.
    moving: BTreeSet<String>,
    /// Files this controller re-placed whose move is not complete: asked for again after a
    /// failed mover even if the lost peer came back meanwhile (else the move would wait for
    /// the writer's next open).
    replaced: BTreeSet<String>,
    /// (peer, file) pairs already reported as [`CtlOutput::CannotReplace`].
    reported: BTreeSet<(PeerId, String)>,
    /// Peers seen in the store's listing since this controller started: their liveness is the
    /// listing's.
    leased: BTreeSet<PeerId>,
}

impl<S: MetaStore> ControllerCore<S> {
    pub fn open(mut store: S) -> Result<ControllerCore<S>, StoreError> {
        let mut state = store.load()?.unwrap_or(ControllerState { next_peer: 1, next_file: 1, ..Default::default() });
        // Nobody has reported to this controller yet.
        for p in state.peers.values_mut() {
            p.live = false;
        }
        Ok(ControllerCore {
            state,
            store,
            out: Vec::new(),
            now_ms: 0,
            peer_lease_ms: DEFAULT_PEER_LEASE_MS,
            started_ms: None,
            heard_ms: BTreeMap::new(),
            lost: BTreeSet::new(),
            moving: BTreeSet::new(),
            replaced: BTreeSet::new(),
            reported: BTreeSet::new(),
            leased: BTreeSet::new(),
        })
    }

    /// Sets the peer lease (0: peers are never declared lost, nothing is replaced automatically).
    pub fn with_peer_lease_ms(mut self, ms: u64) -> Self {
        self.peer_lease_ms = ms;
        self
    }

    pub fn peer_lease_ms(&self) -> u64 {
        self.peer_lease_ms
    }

    /// Peers silent past their lease.
    pub fn lost_peers(&self) -> &BTreeSet<PeerId> {
        &self.lost
    }

    pub fn state(&self) -> &ControllerState {
        &self.state
    }

    fn grant(&self, key: &str, m: &FileMeta) -> FileGrant {
        let addrs = |ids: &[PeerId]| -> Vec<PeerAddr> {
            ids.iter().map(|&id| PeerAddr { id, addr: self.state.peers.get(&id).map(|p| p.addr.clone()).unwrap_or_default() }).collect()
        };
        FileGrant { key: key.to_string(), file: m.file, epoch: m.epoch, initialized: m.initialized, peers: addrs(&m.peers), recover_from: addrs(&m.prev_peers) }
    }

    /// Keys of the files whose placement or pending move involves `peer`.
    pub fn files_on(&self, peer: PeerId) -> Vec<String> {
        self.state.files.iter().filter(|(_, m)| m.peers.contains(&peer) || m.prev_peers.contains(&peer)).map(|(k, _)| k.clone()).collect()
    }


    /// Applies one input at `now_ms` (outputs wait in [`ControllerCore::take_outputs`]); a
    /// change is persisted before the reply (on a failed save the in-memory state is rolled
    /// back and the request fails). In debug builds, then: a file's epoch never went back, and
    /// [`ControllerCore::check_invariants`].
    pub fn handle(&mut self, now_ms: u64, input: CtlInput) {
        self.now_ms = self.now_ms.max(now_ms);
        self.started_ms.get_or_insert(self.now_ms);
        match input {
            CtlInput::Request(req) => {
                let reply = self.handle_input(req);
                self.out.push(CtlOutput::Reply(reply));
            }
            CtlInput::Tick => self.tick(),
            CtlInput::MoveEnded { key, ok } => {
                self.moving.remove(&key);
                if !ok {
                    // Its lost peer may be reported again with what stops it now.
                    self.reported.retain(|(_, k)| *k != key);
                }
            }
            CtlInput::Leases { live } => self.on_leases(live),
        }
    }

    /// The store's listing of live peers (see the type's doc on store leases); lost peers are
    /// replaced at once.
    fn on_leases(&mut self, live: BTreeMap<PeerId, i64>) {
        for &id in live.keys() {
            self.leased.insert(id);
            self.heard_ms.insert(id, self.now_ms);
            if self.lost.remove(&id) {
                self.reported.retain(|(p, _)| *p != id);
                if let Some(p) = self.state.peers.get_mut(&id) {
                    // Its registration or next heartbeat made it live in the state; the store
                    // said so only now.
                    p.live = true;
                }
                self.out.push(CtlOutput::PeerBack { peer: id });
            }
        }
        let gone: Vec<PeerId> = self.leased.iter().filter(|id| !live.contains_key(id)).copied().collect();
        for id in gone {
            if self.lost.insert(id) {
                let silent = self.now_ms.saturating_sub(self.heard_ms.get(&id).copied().unwrap_or(self.now_ms));
                if let Some(p) = self.state.peers.get_mut(&id) {
                    p.live = false;
                }
                self.out.push(CtlOutput::PeerLost { peer: id, silent_ms: silent });
            }
        }
        self.replace_lost();
    }

    /// The outputs made since the last call, in order.
    pub fn take_outputs(&mut self) -> Vec<CtlOutput> {
        std::mem::take(&mut self.out)
    }

    /// `handle(now, Request(req))` at the last input's time, and the reply it made (other
    /// outputs stay queued): what a simulation does with each request.
    pub fn reply_to(&mut self, req: CtlRequest) -> CtlReply {
        self.handle(self.now_ms, CtlInput::Request(req));
        let i = self.out.iter().rposition(|o| matches!(o, CtlOutput::Reply(_))).expect("a request gets one reply");
        let CtlOutput::Reply(r) = self.out.remove(i) else { unreachable!() };
        r
    }

    /// Lease expiry and replacement of lost peers (see the type's doc).
    fn tick(&mut self) {
        if self.peer_lease_ms == 0 && self.leased.is_empty() {
            return;
        }
        let start = self.started_ms.unwrap_or(self.now_ms);
        for (&id, p) in self.state.peers.iter_mut() {
            if self.leased.contains(&id) || self.peer_lease_ms == 0 {
                // Its liveness is the store's listing (or no lease at all).
                continue;
            }
            let silent = self.now_ms.saturating_sub(self.heard_ms.get(&id).copied().unwrap_or(start));
            if silent > self.peer_lease_ms && self.lost.insert(id) {
                p.live = false;
                self.out.push(CtlOutput::PeerLost { peer: id, silent_ms: silent });
            }
        }
        self.replace_lost();
    }

    /// Re-places the files of lost peers (see the type's doc).
    fn replace_lost(&mut self) {
        let files = &self.state.files;
        self.replaced.retain(|k| files.get(k).is_some_and(|m| !m.prev_peers.is_empty()));
        if self.lost.is_empty() && self.replaced.is_empty() {
            return;
        }
        let before = self.state.clone();
        let mut moves = Vec::new();
        let s = &mut self.state;
        let lost = &self.lost;
        // Room on live peers, charged one byte per file placed this tick (per-file sizes are
        // not known here; the writer relocates a file that meets a full region).
        let mut free: BTreeMap<PeerId, u64> = s
            .peers
            .iter()
            .filter(|(id, p)| p.live && !p.draining && !lost.contains(id))
            .map(|(&id, p)| (id, p.region_bytes.saturating_sub(p.used_bytes)))
            .filter(|&(_, f)| f > 0)
            .collect();
        for (key, m) in s.files.iter_mut() {
            if self.moving.contains(key) {
                continue;
            }
            let Some(&gone) = m.peers.iter().find(|id| lost.contains(id)) else {
                // A pending move off a lost peer (or one we re-placed) whose mover failed:
                // ask again.
                let gone = m.prev_peers.iter().find(|id| lost.contains(id));
                let gone = gone.or_else(|| m.prev_peers.iter().find(|id| !m.peers.contains(id)).filter(|_| self.replaced.contains(key)));
                if let Some(&gone) = gone {
                    moves.push(CtlOutput::Move { key: key.clone(), lost: gone, to: gone });
                }
                continue;
            };
            let recovery = if m.prev_peers.is_empty() { &m.peers } else { &m.prev_peers };
            let up = recovery.iter().filter(|id| !lost.contains(id)).count();
            let reason = if up < recovery.len() / 2 + 1 {
                Some(format!("only {up} of its {} recovery peers {recovery:?} are live: a majority is needed to recover it", recovery.len()))
            } else {
                match pick_peer(&free, m) {
                    None => Some("no live log peer outside its set has room (start another peer)".to_string()),
                    Some(to) => {
                        replace_peer(m, gone, to);
                        let f = free.get_mut(&to).unwrap();
                        *f -= 1;
                        if *f == 0 {
                            free.remove(&to);
                        }
                        moves.push(CtlOutput::Move { key: key.clone(), lost: gone, to });
                        None
                    }
                }
            };
            if let Some(reason) = reason {
                if self.reported.insert((gone, key.clone())) {
                    self.out.push(CtlOutput::CannotReplace { peer: gone, key: key.clone(), reason });
                }
            }
        }
        if moves.is_empty() {
            return;
        }
        if self.state != before {
            if let Err(e) = self.store.save(&self.state) {
                self.state = before;
                self.out.push(CtlOutput::Error(format!("cannot persist the replacement of lost peers: {e}")));
                return;
            }
        }
        for mv in moves {
            if let CtlOutput::Move { key, .. } = &mv {
                self.moving.insert(key.clone());
                self.replaced.insert(key.clone());
            }
            self.out.push(mv);
        }
        #[cfg(debug_assertions)]
        self.check_invariants();
    }

    /// A registration or heartbeat of `peer`: its lease renewed.
    fn heard(&mut self, peer: PeerId) {
        if self.leased.contains(&peer) {
            // Its silence counts from its last listing in the store.
            if self.lost.contains(&peer) {
                // Only the store's listing brings a leased peer back.
                if let Some(p) = self.state.peers.get_mut(&peer) {
                    p.live = false;
                }
            }
            return;
        }
        self.heard_ms.insert(peer, self.now_ms);
        if self.lost.remove(&peer) {
            self.reported.retain(|(p, _)| *p != peer);
            self.out.push(CtlOutput::PeerBack { peer });
        }
    }

    fn handle_input(&mut self, req: CtlRequest) -> CtlReply {
        if !self.store.may_serve() {
            return CtlReply::Error("this controller's leadership has lapsed: ask the others".into());
        }
        let before = self.state.clone();
        let (reply, changed) = self.apply(req);
        if changed {
            if let Err(e) = self.store.save(&self.state) {
                self.state = before;
                return CtlReply::Error(format!("cannot persist controller state: {e}"));
            }
        }
        #[cfg(debug_assertions)]
        {
            // An epoch is never handed out twice: a file's epoch never goes back.
            let old: BTreeMap<FileId, Epoch> = before.files.values().map(|m| (m.file, m.epoch)).collect();
            for (key, m) in &self.state.files {
                if old.get(&m.file).is_some_and(|e| m.epoch < *e) {
                    panic!("controller: invariant `a file's epoch never decreases` broken: {key} (file {}) went from epoch {} to {}", m.file, old[&m.file], m.epoch);
                }
            }
            self.check_invariants();
        }
        reply
    }

    /// Panics, naming the invariant and the state, if the controller's state breaks a rule the
    /// module doc states. O(files × replicas): the state is small and `handle` already clones it
    /// whole. Run after every request in debug builds and after every step of the simulations.
    pub fn check_invariants(&self) {
        let s = &self.state;
        let broken = |what: &str, state: String| -> ! { panic!("controller: invariant `{what}` broken: {state}") };
        // Ids are handed out once: every id in use is below the next.
        if let Some(p) = s.peers.keys().find(|p| **p >= s.next_peer) {
            broken("peer ids are below next_peer", format!("peer {p}, next {}", s.next_peer));
        }
        // A peer silent past its lease is not live.
        if let Some(p) = self.lost.iter().find(|p| s.peers.get(p).is_some_and(|i| i.live)) {
            broken("a lost peer is not live", format!("peer {p}"));
        }
        let mut ids = BTreeMap::new();
        for (key, m) in &s.files {
            if m.file >= s.next_file {
                broken("file ids are below next_file", format!("{key}: file {}, next {}", m.file, s.next_file));
            }
            if let Some(other) = ids.insert(m.file, key) {
                broken("one key per file id", format!("file {} under {other} and {key}", m.file));
            }
            // The writer's epoch and the placement's are epochs handed out for this file.
            if m.owner_epoch > m.epoch || m.placed_at > m.epoch {
                broken("owner_epoch and placed_at are at most the file's epoch", format!("{key}: {m:?}"));
            }
            // A placement names each peer once.
            for set in [&m.peers, &m.prev_peers] {
                if (1..set.len()).any(|i| set[..i].contains(&set[i])) {
                    broken("a placement names each peer once", format!("{key}: {m:?}"));
                }
            }
        }
    }

    /// One request's reply, and whether the state changed (then `handle_input` persists it).
    /// One arm per request; the requests with decisions of their own have a method each.
    fn apply(&mut self, req: CtlRequest) -> (CtlReply, bool) {
        let s = &mut self.state;
        match req {
            CtlRequest::RegisterPeer { addr, region_bytes, known_as } => {
                let (reply, changed) = self.register_peer(addr, region_bytes, known_as);
                if let CtlReply::Registered { peer } = reply {
                    self.heard(peer);
                }
                (reply, changed)
            }
            CtlRequest::PeerHeartbeat { peer, used_bytes, files } => {
                let (reply, changed) = self.peer_heartbeat(peer, used_bytes, files);
                if matches!(reply, CtlReply::Heartbeat { .. }) {
                    self.heard(peer);
                }
                (reply, changed)
            }
            CtlRequest::Reclaim { peer } => self.reclaim(peer),
            CtlRequest::Move { key } => match s.files.get_mut(&key) {
                Some(m) if !m.prev_peers.is_empty() => {
                    m.epoch += 1;
                    let m = m.clone();
                    (CtlReply::Granted(self.grant(&key, &m)), true)
                }
                Some(_) => (CtlReply::Error(format!("{key} has no pending move")), false),
                None => (CtlReply::Error(format!("unknown file {key}")), false),
            },
            CtlRequest::Resume { key, epoch } => match s.files.get_mut(&key) {
                Some(m) if m.owner_epoch == epoch => {
                    m.epoch += 1;
                    m.owner_epoch = m.epoch;
                    let m = m.clone();
                    (CtlReply::Granted(self.grant(&key, &m)), true)
                }
                Some(m) => (CtlReply::Error(format!("{key} was opened by another writer (epoch {}) since epoch {epoch}", m.owner_epoch)), false),
                None => (CtlReply::Error(format!("unknown file {key}")), false),
            },
            CtlRequest::Relocate { key, epoch, full } => self.relocate(key, epoch, full),
            CtlRequest::Open { key, replicas } => self.open_file(key, replicas),
            CtlRequest::Initialized { key, epoch } => match s.files.get_mut(&key) {
                Some(m) if m.epoch == epoch => {
                    let mut changed = !m.initialized;
                    m.initialized = true;
                    if epoch > m.placed_at && !m.prev_peers.is_empty() {
                        // The Base committed on a majority of the new set: the move is done.
                        m.prev_peers.clear();
                        changed = true;
                    }
                    (CtlReply::Ok, changed)
                }
                Some(m) => (CtlReply::Error(format!("epoch {epoch} is stale (file is at {})", m.epoch)), false),
                None => (CtlReply::Error(format!("unknown file {key}")), false),
            },
            CtlRequest::Remove { key } => match s.files.remove(&key) {
                Some(m) => (CtlReply::Forgotten(Some(self.grant(&key, &m))), true),
                None => (CtlReply::Forgotten(None), false),
            },
            CtlRequest::Rename { from, to } => {
                if let Err(e) = check_key(&to) {
                    return (CtlReply::Error(e), false);
                }
                let Some(m) = s.files.remove(&from) else { return (CtlReply::Forgotten(None), false) };
                let old = s.files.insert(to.clone(), m);
                (CtlReply::Forgotten(old.map(|o| self.grant(&to, &o))), true)
            }
            CtlRequest::Status => (CtlReply::Status(self.state.clone()), false),
            CtlRequest::Lookup { key } => (CtlReply::Found(self.state.files.get(&key).map(|m| self.grant(&key, m))), false),
            CtlRequest::Reseed { key } => self.reseed(key),
        }
    }

    /// A peer registers: a new id, or its old one if it is the same peer restarted.
    fn register_peer(&mut self, addr: String, region_bytes: u64, known_as: Option<PeerId>) -> (CtlReply, bool) {
        let s = &mut self.state;
        if addr.is_empty() || addr.len() > 256 {
            return (CtlReply::Error("peer address must be 1..=256 bytes".into()), false);
        }
        // The same peer restarted (its identity file names an id we know, or, without
        // one, it came back at the same address): its memory is gone; it keeps its id,
        // and its files stay placed on it (recovery never counts a peer without a copy
        // as a witness). A returning peer at a new address takes the new one.
        let returning = match known_as {
            Some(id) if s.peers.contains_key(&id) => Some(id),
            _ => s.peers.iter().find(|(_, p)| p.addr == addr).map(|(&id, _)| id),
        };
        if let Some(id) = returning {
            let p = s.peers.get_mut(&id).unwrap();
            p.addr = addr;
            p.region_bytes = region_bytes;
            p.used_bytes = 0;
            p.live = true;
            return (CtlReply::Registered { peer: id }, true);
        }
        let id = s.next_peer;
        s.next_peer += 1;
        s.peers.insert(id, PeerInfo { addr, region_bytes, used_bytes: 0, draining: false, live: true });
        (CtlReply::Registered { peer: id }, true)
    }

    /// A peer's heartbeat: refreshes its soft state, and names the files it may free.
    fn peer_heartbeat(&mut self, peer: PeerId, used_bytes: u64, files: Vec<FileId>) -> (CtlReply, bool) {
        let s = &mut self.state;
        if files.len() > MAX_HEARTBEAT_FILES {
            return (CtlReply::Error(format!("heartbeat lists more than {MAX_HEARTBEAT_FILES} files")), false);
        }
        let Some(p) = s.peers.get_mut(&peer) else {
            return (CtlReply::Error(format!("unknown peer {peer}: register first")), false);
        };
        // Not persisted: free space and liveness are soft state, refreshed by every heartbeat.
        p.used_bytes = used_bytes;
        p.live = true;
        let draining = p.draining;
        // A file the peer holds but no placement (current or pending-move) names it for
        // is garbage: removed, renamed over, moved away, or a Drop that never arrived.
        let placed: BTreeMap<FileId, &FileMeta> = s.files.values().map(|m| (m.file, m)).collect();
        let release = files
            .into_iter()
            .filter(|f| placed.get(f).is_none_or(|m| !m.peers.contains(&peer) && !m.prev_peers.contains(&peer)))
            .collect();
        (CtlReply::Heartbeat { release, draining }, false)
    }

    /// Plans and records the move of every file off `peer` (all or nothing).
    fn reclaim(&mut self, peer: PeerId) -> (CtlReply, bool) {
        let s = &mut self.state;
        if !s.peers.contains_key(&peer) {
            return (CtlReply::Error(format!("unknown peer {peer}")), false);
        }
        let mut changed = !s.peers[&peer].draining;
        // Plan every move before changing anything: all or nothing.
        let mut free: BTreeMap<PeerId, u64> = s
            .peers
            .iter()
            .filter(|(&id, p)| id != peer && !p.draining)
            .map(|(&id, p)| (id, p.region_bytes.saturating_sub(p.used_bytes)))
            .collect();
        let mut plan = Vec::new();
        for (key, m) in s.files.iter().filter(|(_, m)| m.peers.contains(&peer)) {
            let Some(to) = pick_peer(&free, m) else {
                return (CtlReply::Error(format!("no other log peer can take {key} (start another peer, then reclaim again)")), false);
            };
            // Count the file's size against the chosen peer (approximated by the
            // reclaimed peer's whole use: we do not know per-file sizes here).
            *free.get_mut(&to).unwrap() = free[&to].saturating_sub(1);
            plan.push((key.clone(), to));
        }
        s.peers.get_mut(&peer).unwrap().draining = true;
        for (key, to) in plan {
            let m = s.files.get_mut(&key).unwrap();
            replace_peer(m, peer, to);
            changed = true;
        }
        let pending = s.files.iter().filter(|(_, m)| m.prev_peers.contains(&peer)).map(|(k, _)| k.clone()).collect();
        (CtlReply::Reclaiming { pending }, changed)
    }

    /// The writer at `epoch` met a full region on `full`: the file grows onto a peer with room.
    fn relocate(&mut self, key: String, epoch: Epoch, full: PeerId) -> (CtlReply, bool) {
        let s = &mut self.state;
        // Never onto a lost peer: the file would sit on a dead peer and a second loss of its
        // set would leave no majority.
        let lost = &self.lost;
        let free: BTreeMap<PeerId, u64> = s
            .peers
            .iter()
            .filter(|(&id, p)| id != full && !p.draining && !lost.contains(&id))
            .map(|(&id, p)| (id, p.region_bytes.saturating_sub(p.used_bytes)))
            .collect();
        match s.files.get_mut(&key) {
            Some(m) if m.owner_epoch == epoch => {
                if m.peers.contains(&full) {
                    let Some(to) = pick_peer(&free, m) else {
                        return (CtlReply::Error(format!("no log peer has room for {key}: every region is full")), false);
                    };
                    replace_peer(m, full, to);
                }
                m.epoch += 1;
                m.owner_epoch = m.epoch;
                let m = m.clone();
                (CtlReply::Granted(self.grant(&key, &m)), true)
            }
            Some(m) => (CtlReply::Error(format!("{key} was opened by another writer (epoch {}) since epoch {epoch}", m.owner_epoch)), false),
            None => (CtlReply::Error(format!("unknown file {key}")), false),
        }
    }

    /// An open: placement on first open, a new epoch every time.
    fn open_file(&mut self, key: String, replicas: u32) -> (CtlReply, bool) {
        let s = &mut self.state;
        if let Err(e) = check_key(&key) {
            return (CtlReply::Error(e), false);
        }
        if replicas == 0 || replicas > MAX_REPLICAS {
            return (CtlReply::Error(format!("replicas must be 1..={MAX_REPLICAS}")), false);
        }
        if !s.files.contains_key(&key) {
            if (s.peers.len() as u32) < replicas {
                return (CtlReply::Error(format!("{replicas} log peers needed, {} registered", s.peers.len())), false);
            }
            // Placement: live peers first (one that has not reported since we started
            // may be gone for good), then the most free space (ties: lowest id).
            let mut by_free: Vec<(PeerId, u64, bool)> = s
                .peers
                .iter()
                .filter(|(_, p)| !p.draining)
                .map(|(&id, p)| (id, p.region_bytes.saturating_sub(p.used_bytes), p.live))
                .collect();
            if (by_free.len() as u32) < replicas {
                return (CtlReply::Error(format!("{replicas} log peers needed, {} not being reclaimed", by_free.len())), false);
            }
            by_free.sort_by_key(|&(id, free, live)| (!live, std::cmp::Reverse(free), id));
            let peers = by_free.iter().take(replicas as usize).map(|&(id, _, _)| id).collect();
            let file = s.next_file;
            s.next_file += 1;
            s.files.insert(key.clone(), FileMeta { file, epoch: 0, peers, initialized: false, prev_peers: Vec::new(), placed_at: 0, owner_epoch: 0 });
        }
        let m = s.files.get_mut(&key).unwrap();
        m.epoch += 1;
        m.owner_epoch = m.epoch;
        let m = m.clone();
        (CtlReply::Granted(self.grant(&key, &m)), true)
    }

    /// The operator accepts the local copy: the file is placed on live peers at a new epoch.
    fn reseed(&mut self, key: String) -> (CtlReply, bool) {
        let s = &mut self.state;
        let Some(m) = s.files.get(&key) else { return (CtlReply::Error(format!("unknown file {key}")), false) };
        let usable = |id: &PeerId| s.peers.get(id).is_some_and(|p| p.live && !p.draining);
        // Its current peers where they are live (a restarted peer keeps its id), the
        // rest from the live peers with the most free space (ties: lowest id).
        let mut peers: Vec<PeerId> = m.peers.iter().copied().filter(usable).collect();
        let mut others: Vec<(PeerId, u64)> = s
            .peers
            .iter()
            .filter(|(id, _)| usable(id) && !peers.contains(id))
            .map(|(&id, p)| (id, p.region_bytes.saturating_sub(p.used_bytes)))
            .collect();
        others.sort_by_key(|&(id, free)| (std::cmp::Reverse(free), id));
        let want = m.peers.len();
        peers.extend(others.iter().map(|&(id, _)| id).take(want.saturating_sub(peers.len())));
        if peers.len() < want {
            let live = s.peers.values().filter(|p| p.live && !p.draining).count();
            return (CtlReply::Error(format!("re-seeding {key} needs {want} live log peers, {live} are up (start more peers, then try again)")), false);
        }
        let m = s.files.get_mut(&key).unwrap();
        m.epoch += 1;
        m.owner_epoch = m.epoch;
        m.peers = peers;
        // The old set's copies are gone or not wanted: nothing to recover from, no move.
        m.prev_peers.clear();
        m.placed_at = m.epoch;
        m.initialized = false;
        let m = m.clone();
        (CtlReply::Granted(self.grant(&key, &m)), true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{JsonFileStore, MemStore};
    use std::path::Path;

    fn ctl(dir: &Path) -> ControllerCore<JsonFileStore> {
        ControllerCore::open(JsonFileStore::new(dir)).unwrap()
    }

    #[test]
    fn placement_epochs_and_restart_lose_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = ctl(dir.path());
        for (i, region) in [(1, 100), (2, 300), (3, 200), (4, 50)] {
            let r = c.reply_to(CtlRequest::RegisterPeer { addr: format!("p{i}"), region_bytes: region, known_as: None });
            assert_eq!(r, CtlReply::Registered { peer: i });
        }
        let CtlReply::Granted(g) = c.reply_to(CtlRequest::Open { key: "/a.log".into(), replicas: 3 }) else { panic!() };
        assert_eq!((g.epoch, g.initialized), (1, false));
        assert_eq!(g.peers.iter().map(|p| p.id).collect::<Vec<_>>(), vec![2, 3, 1], "most free space first");
        assert_eq!(c.reply_to(CtlRequest::Initialized { key: "/a.log".into(), epoch: 1 }), CtlReply::Ok);
        drop(c);
        let mut c = ctl(dir.path());
        let CtlReply::Granted(g2) = c.reply_to(CtlRequest::Open { key: "/a.log".into(), replicas: 3 }) else { panic!() };
        assert_eq!((g2.file, g2.epoch, g2.initialized), (g.file, 2, true));
        assert!(matches!(c.reply_to(CtlRequest::Initialized { key: "/a.log".into(), epoch: 1 }), CtlReply::Error(_)));
        let CtlReply::Forgotten(None) = c.reply_to(CtlRequest::Rename { from: "/a.log".into(), to: "/b.log".into() }) else { panic!() };
        let CtlReply::Forgotten(Some(f)) = c.reply_to(CtlRequest::Remove { key: "/b.log".into() }) else { panic!() };
        assert_eq!(f.file, g.file);
    }

    #[test]
    fn reclaim_moves_files_resume_and_relocate_and_heartbeats_release() {
        let mut c = ControllerCore::open(MemStore::default()).unwrap();
        for i in 1..=4 {
            c.reply_to(CtlRequest::RegisterPeer { addr: format!("p{i}"), region_bytes: 1000, known_as: None });
        }
        let CtlReply::Granted(g) = c.reply_to(CtlRequest::Open { key: "k".into(), replicas: 3 }) else { panic!() };
        assert_eq!(g.peers.iter().map(|p| p.id).collect::<Vec<_>>(), vec![1, 2, 3]);
        c.reply_to(CtlRequest::Initialized { key: "k".into(), epoch: 1 });
        // Reclaim peer 1: placed on 4; the old set stays the recovery set.
        let CtlReply::Reclaiming { pending } = c.reply_to(CtlRequest::Reclaim { peer: 1 }) else { panic!() };
        assert_eq!(pending, vec!["k".to_string()]);
        let m = c.state().files["k"].clone();
        assert_eq!((m.peers.clone(), m.prev_peers.clone()), (vec![4, 2, 3], vec![1, 2, 3]));
        // Peer 1 keeps the file while the move is pending.
        let hb = |c: &mut ControllerCore<MemStore>, peer| c.reply_to(CtlRequest::PeerHeartbeat { peer, used_bytes: 10, files: vec![m.file, 99] });
        assert_eq!(hb(&mut c, 1), CtlReply::Heartbeat { release: vec![99], draining: true });
        // A mover's epoch does not take ownership; the fenced writer (owner epoch 1) resumes.
        let CtlReply::Granted(mv) = c.reply_to(CtlRequest::Move { key: "k".into() }) else { panic!() };
        assert_eq!((mv.epoch, mv.recover_from.len()), (2, 3));
        let CtlReply::Granted(w) = c.reply_to(CtlRequest::Resume { key: "k".into(), epoch: 1 }) else { panic!() };
        assert_eq!(w.epoch, 3);
        assert!(matches!(c.reply_to(CtlRequest::Initialized { key: "k".into(), epoch: 2 }), CtlReply::Error(_)), "the mover's epoch is stale");
        assert_eq!(c.reply_to(CtlRequest::Initialized { key: "k".into(), epoch: 3 }), CtlReply::Ok);
        assert!(c.state().files["k"].prev_peers.is_empty(), "move done");
        assert_eq!(hb(&mut c, 1), CtlReply::Heartbeat { release: vec![m.file, 99], draining: true });
        assert!(matches!(c.reply_to(CtlRequest::Resume { key: "k".into(), epoch: 1 }), CtlReply::Error(_)), "an old owner cannot resume");
        // No new placement on a draining peer; a relocation needs a peer with room outside the set.
        assert!(matches!(c.reply_to(CtlRequest::Relocate { key: "k".into(), epoch: 3, full: 2 }), CtlReply::Error(_)));
        c.reply_to(CtlRequest::RegisterPeer { addr: "p5".into(), region_bytes: 1000, known_as: None });
        let CtlReply::Granted(r) = c.reply_to(CtlRequest::Relocate { key: "k".into(), epoch: 3, full: 2 }) else { panic!() };
        assert_eq!(r.peers.iter().map(|p| p.id).collect::<Vec<_>>(), vec![4, 5, 3]);
        assert_eq!(r.recover_from.iter().map(|p| p.id).collect::<Vec<_>>(), vec![4, 2, 3]);
        // Reclaiming with no peer left to take the file fails and changes nothing.
        let before = c.state().clone();
        assert!(matches!(c.reply_to(CtlRequest::Reclaim { peer: 3 }), CtlReply::Error(_)));
        assert_eq!(c.state(), &before);
    }

    #[test]
    fn a_returning_peer_keeps_its_id_and_a_reseed_places_on_live_peers_at_a_new_epoch() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = ctl(dir.path());
        for i in 1..=3 {
            assert_eq!(c.reply_to(CtlRequest::RegisterPeer { addr: format!("a{i}"), region_bytes: 1000, known_as: None }), CtlReply::Registered { peer: i });
        }
        let CtlReply::Granted(g) = c.reply_to(CtlRequest::Open { key: "k".into(), replicas: 3 }) else { panic!() };
        assert_eq!(c.reply_to(CtlRequest::Initialized { key: "k".into(), epoch: g.epoch }), CtlReply::Ok);
        // The controller restarts: nobody is live until they report.
        drop(c);
        let mut c = ctl(dir.path());
        assert!(c.state().peers.values().all(|p| !p.live));
        // Peers 1 and 2 come back at new addresses with their ids; an unknown id is a new peer.
        assert_eq!(c.reply_to(CtlRequest::RegisterPeer { addr: "b1".into(), region_bytes: 1000, known_as: Some(1) }), CtlReply::Registered { peer: 1 });
        assert_eq!(c.reply_to(CtlRequest::RegisterPeer { addr: "b2".into(), region_bytes: 1000, known_as: Some(2) }), CtlReply::Registered { peer: 2 });
        assert_eq!(c.reply_to(CtlRequest::RegisterPeer { addr: "b4".into(), region_bytes: 1000, known_as: Some(9) }), CtlReply::Registered { peer: 4 });
        assert_eq!(c.state().peers.len(), 4);
        assert_eq!(c.state().peers[&1].addr, "b1");
        // Re-seed: the live ones of its peers kept, the dead one (3) replaced by a live one.
        let CtlReply::Granted(r) = c.reply_to(CtlRequest::Reseed { key: "k".into() }) else { panic!() };
        assert_eq!(r.peers.iter().map(|p| (p.id, p.addr.as_str())).collect::<Vec<_>>(), vec![(1, "b1"), (2, "b2"), (4, "b4")]);
        assert!(r.epoch > g.epoch && !r.initialized && r.recover_from.is_empty());
        assert!(matches!(c.reply_to(CtlRequest::Initialized { key: "k".into(), epoch: g.epoch }), CtlReply::Error(_)), "old epochs are stale");
        assert_eq!(c.reply_to(CtlRequest::Initialized { key: "k".into(), epoch: r.epoch }), CtlReply::Ok);
        assert!(c.state().files["k"].initialized);
        assert!(matches!(c.reply_to(CtlRequest::Reseed { key: "nope".into() }), CtlReply::Error(_)));
        // Too few live peers: refused, nothing changed.
        drop(c);
        let mut c = ctl(dir.path());
        c.reply_to(CtlRequest::RegisterPeer { addr: "b1".into(), region_bytes: 1000, known_as: Some(1) });
        let before = c.state().clone();
        assert!(matches!(c.reply_to(CtlRequest::Reseed { key: "k".into() }), CtlReply::Error(e) if e.contains("live")));
        assert_eq!(c.state(), &before);
    }

    #[test]
    fn bad_requests_are_refused_and_failed_saves_roll_back() {
        let mut c = ControllerCore::open(MemStore::default()).unwrap();
        assert!(matches!(c.reply_to(CtlRequest::Open { key: "k".into(), replicas: 3 }), CtlReply::Error(_)), "no peers");
        assert!(matches!(c.reply_to(CtlRequest::Open { key: "".into(), replicas: 1 }), CtlReply::Error(_)));
        c.reply_to(CtlRequest::RegisterPeer { addr: "p".into(), region_bytes: 1, known_as: None });
        c.store.fail_saves = true;
        assert!(matches!(c.reply_to(CtlRequest::Open { key: "k".into(), replicas: 1 }), CtlReply::Error(_)));
        assert!(c.state().files.is_empty());
    }

    /// 4 peers (lease 3000 ms) heard at t=0 and a file on 1, 2, 3 with its Base committed.
    fn leased() -> (ControllerCore<MemStore>, String) {
        let mut c = ControllerCore::open(MemStore::default()).unwrap().with_peer_lease_ms(3000);
        for i in 1..=4 {
            c.handle(0, CtlInput::Request(CtlRequest::RegisterPeer { addr: format!("p{i}"), region_bytes: 1000, known_as: None }));
        }
        let CtlReply::Granted(g) = c.reply_to(CtlRequest::Open { key: "k".into(), replicas: 3 }) else { panic!() };
        assert_eq!(g.peers.iter().map(|p| p.id).collect::<Vec<_>>(), vec![1, 2, 3]);
        c.reply_to(CtlRequest::Initialized { key: "k".into(), epoch: g.epoch });
        c.take_outputs();
        (c, "k".into())
    }

    fn beat(c: &mut ControllerCore<MemStore>, now: u64, peers: &[PeerId]) {
        for &peer in peers {
            c.handle(now, CtlInput::Request(CtlRequest::PeerHeartbeat { peer, used_bytes: 10, files: vec![] }));
        }
    }

    #[test]
    fn a_peer_silent_past_its_lease_is_replaced_and_comes_back_empty() {
        let (mut c, k) = leased();
        let file = c.state().files[&k].file;
        // Peer 1 falls silent at t=0; the others heartbeat every second.
        for t in (1000..=3000).step_by(1000) {
            beat(&mut c, t, &[2, 3, 4]);
            c.handle(t, CtlInput::Tick);
        }
        assert!(c.take_outputs().iter().all(|o| matches!(o, CtlOutput::Reply(_))), "within its lease: nothing");
        beat(&mut c, 3500, &[2, 3, 4]);
        c.handle(3500, CtlInput::Tick);
        let outs: Vec<CtlOutput> = c.take_outputs().into_iter().filter(|o| !matches!(o, CtlOutput::Reply(_))).collect();
        assert_eq!(outs, vec![CtlOutput::PeerLost { peer: 1, silent_ms: 3500 }, CtlOutput::Move { key: k.clone(), lost: 1, to: 4 }]);
        let m = c.state().files[&k].clone();
        assert_eq!((m.peers.clone(), m.prev_peers.clone()), (vec![4, 2, 3], vec![1, 2, 3]), "the old set recovers until a Base commits");
        assert!(!c.state().peers[&1].live && !c.state().peers[&1].draining);
        assert_eq!(c.store.saved.as_ref().unwrap().files[&k].peers, vec![4, 2, 3], "persisted");
        // No second move while the first runs; a failed one is asked for again.
        c.handle(4000, CtlInput::Tick);
        assert!(c.take_outputs().is_empty());
        c.handle(4100, CtlInput::MoveEnded { key: k.clone(), ok: false });
        c.handle(4200, CtlInput::Tick);
        assert_eq!(c.take_outputs(), vec![CtlOutput::Move { key: k.clone(), lost: 1, to: 1 }]);
        // Failed again, and peer 1 is back meanwhile: the pending move is still asked for.
        c.handle(4210, CtlInput::MoveEnded { key: k.clone(), ok: false });
        c.handle(4220, CtlInput::Request(CtlRequest::PeerHeartbeat { peer: 1, used_bytes: 10, files: vec![file] }));
        c.handle(4230, CtlInput::Tick);
        let outs = c.take_outputs();
        assert!(outs.contains(&CtlOutput::PeerBack { peer: 1 }) && outs.contains(&CtlOutput::Move { key: k.clone(), lost: 1, to: 1 }), "{outs:?}");
        assert!(c.lost_peers().is_empty());
        // The mover (or the resumed writer) commits a Base on the new set: the move is done.
        let CtlReply::Granted(mv) = c.reply_to(CtlRequest::Move { key: k.clone() }) else { panic!() };
        assert_eq!(c.reply_to(CtlRequest::Initialized { key: k.clone(), epoch: mv.epoch }), CtlReply::Ok);
        c.handle(4300, CtlInput::MoveEnded { key: k.clone(), ok: true });
        c.handle(4400, CtlInput::Tick);
        assert!(c.take_outputs().is_empty(), "nothing left on the lost peer");
        // Peer 1 comes back (after a partition, still holding its copy): it is told to
        // release it, is not draining, and may hold new files.
        let r = c.reply_to(CtlRequest::PeerHeartbeat { peer: 1, used_bytes: 10, files: vec![file] });
        assert_eq!(r, CtlReply::Heartbeat { release: vec![file], draining: false });
        assert!(c.state().peers[&1].live && c.lost_peers().is_empty());
        assert!(c.files_on(1).is_empty());
    }

    /// With store leases a peer is lost when the store stops listing it, whatever its
    /// heartbeats say, and back only when listed again; peers never listed keep the heartbeat
    /// lease.
    #[test]
    fn a_peer_gone_from_the_store_is_replaced_at_once_and_only_the_store_brings_it_back() {
        let (mut c, k) = leased();
        let leases = |ids: &[PeerId]| CtlInput::Leases { live: ids.iter().map(|&id| (id, 100 + id as i64)).collect() };
        c.handle(500, leases(&[1, 2, 3]));
        // Peer 4 is not in the store: its heartbeats are its lease. The others' heartbeats
        // stop, their listing goes on: nobody is lost.
        for t in (1000..=6000).step_by(1000) {
            beat(&mut c, t, &[4]);
            c.handle(t, leases(&[1, 2, 3]));
            c.handle(t, CtlInput::Tick);
        }
        assert!(c.take_outputs().iter().all(|o| matches!(o, CtlOutput::Reply(_))), "leased peers live by the listing alone");
        // Peer 1's lease expires in the store, though it still heartbeats: lost and replaced now.
        beat(&mut c, 6100, &[1, 4]);
        c.handle(6200, leases(&[2, 3]));
        let outs: Vec<CtlOutput> = c.take_outputs().into_iter().filter(|o| !matches!(o, CtlOutput::Reply(_))).collect();
        assert_eq!(outs, vec![CtlOutput::PeerLost { peer: 1, silent_ms: 200 }, CtlOutput::Move { key: k.clone(), lost: 1, to: 4 }]);
        assert!(!c.state().peers[&1].live);
        // Its heartbeat does not bring it back; its listing does.
        beat(&mut c, 6300, &[1, 4]);
        assert!(c.lost_peers().contains(&1) && !c.state().peers[&1].live);
        c.handle(6400, CtlInput::MoveEnded { key: k.clone(), ok: true });
        c.handle(6500, leases(&[1, 2, 3]));
        assert!(c.take_outputs().contains(&CtlOutput::PeerBack { peer: 1 }));
        assert!(c.lost_peers().is_empty() && c.state().peers[&1].live);
        // Peer 4, unleased, still expires by its heartbeats.
        c.handle(12_000, leases(&[1, 2, 3]));
        c.handle(12_000, CtlInput::Tick);
        assert!(c.lost_peers().contains(&4), "{:?}", c.lost_peers());
    }

    #[test]
    fn heartbeats_in_time_keep_every_peer_and_a_zero_lease_never_expires() {
        let (mut c, _) = leased();
        for t in (500..=20_000).step_by(500) {
            beat(&mut c, t, &[1, 2, 3, 4]);
            c.handle(t, CtlInput::Tick);
        }
        assert!(c.take_outputs().iter().all(|o| matches!(o, CtlOutput::Reply(_))));
        assert_eq!(c.state().files["k"].peers, vec![1, 2, 3]);
        let (c0, _) = leased();
        let mut c0 = c0.with_peer_lease_ms(0);
        c0.handle(1_000_000, CtlInput::Tick);
        assert!(c0.take_outputs().is_empty() && c0.lost_peers().is_empty());
    }

    #[test]
    fn no_spare_peer_or_no_live_majority_moves_nothing_and_says_why() {
        // No spare: peer 4 is gone too.
        let (mut c, k) = leased();
        beat(&mut c, 3500, &[2, 3]);
        c.handle(3500, CtlInput::Tick);
        let before = c.state().clone();
        let outs = c.take_outputs();
        assert!(outs.contains(&CtlOutput::PeerLost { peer: 1, silent_ms: 3500 }) && outs.contains(&CtlOutput::PeerLost { peer: 4, silent_ms: 3500 }));
        assert!(outs.iter().any(|o| matches!(o, CtlOutput::CannotReplace { peer: 1, key, reason } if *key == k && reason.contains("no live log peer"))), "{outs:?}");
        assert!(!outs.iter().any(|o| matches!(o, CtlOutput::Move { .. })));
        assert_eq!(c.state().files[&k].peers, vec![1, 2, 3]);
        assert!(c.lost_peers().contains(&1) && !c.state().peers[&1].live);
        // Said once, not at every tick.
        beat(&mut c, 4000, &[2, 3]);
        c.handle(4000, CtlInput::Tick);
        assert!(!c.take_outputs().iter().any(|o| matches!(o, CtlOutput::CannotReplace { .. })));
        assert_eq!(c.state(), &before);
        // A writer meeting a full region is not relocated onto the lost spare (4).
        let w = c.state().files[&k].owner_epoch;
        assert!(matches!(c.reply_to(CtlRequest::Relocate { key: k.clone(), epoch: w, full: 3 }), CtlReply::Error(e) if e.contains("no log peer has room")));
        // A new peer with room arrives: the file moves to it.
        c.handle(4500, CtlInput::Request(CtlRequest::RegisterPeer { addr: "p5".into(), region_bytes: 1000, known_as: None }));
        c.handle(4500, CtlInput::Tick);
        assert!(c.take_outputs().contains(&CtlOutput::Move { key: k.clone(), lost: 1, to: 5 }));

        // No live majority: peers 1 and 2 of the file lost, 4 has room: not re-placed (a mover
        // could not recover it; the loss stays visible).
        let (mut c, k) = leased();
        beat(&mut c, 3500, &[3, 4]);
        c.handle(3500, CtlInput::Tick);
        let outs = c.take_outputs();
        assert!(outs.iter().any(|o| matches!(o, CtlOutput::CannotReplace { peer: 1, reason, .. } if reason.contains("majority"))), "{outs:?}");
        assert!(!outs.iter().any(|o| matches!(o, CtlOutput::Move { .. })));
        assert_eq!(c.state().files[&k].peers, vec![1, 2, 3]);
    }

    /// The invariant checks can fail: a controller whose state breaks one panics naming it.
    #[test]
    fn check_invariants_names_a_broken_invariant() {
        let mut c = ControllerCore::open(MemStore::default()).unwrap();
        c.check_invariants();
        c.state.next_file = 0; // an id in use at or above the next one handed out
        c.state.files.insert("k".into(), FileMeta { file: 0, epoch: 1, peers: vec![], initialized: false, prev_peers: vec![], placed_at: 0, owner_epoch: 1 });
        let e = std::panic::catch_unwind(|| c.check_invariants()).unwrap_err();
        let msg = e.downcast_ref::<String>().unwrap();
        assert!(msg.contains("file ids are below next_file"), "{msg}");
    }
}
