//! Identifiers, the cluster map, placement, and the messages shards, clients and the metadata
//! service exchange.

use serde::{Deserialize, Serialize};

pub type ShardId = u32;
/// Unique id of one volume incarnation (a parent or a child made by `super`).
pub type VolId = u64;
/// Allocation table id: the placement key that a parent and its `super` child share, so a child
/// object always lives on the shards of its parent object (collocated clone, §4.2.1).
pub type TableId = u64;
pub type Epoch = u64;
pub type ReqId = u64;

/// Version of one stored object: the epoch of the primary that wrote it and a per-object counter.
/// Only one shard is primary of a slot in an epoch, so a version names one content: a replica
/// whose version differs from what the primary expects holds something else and is refilled.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Version {
    pub epoch: Epoch,
    pub seq: u64,
}

/// Object number of a volume's tracking object (dirty bit, allow-write bit).
pub const TRACK_OBJNO: u64 = u64::MAX;
/// Object number of a general clone's object map (the rbd-style baseline).
pub const OBJECT_MAP_OBJNO: u64 = u64::MAX - 1;
/// Largest object size a volume may use.
pub const MAX_OBJECT_SIZE_BYTES: u32 = 4 * 1024 * 1024;

/// The name of one stored object: which allocation table and slot, and which volume owns it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjKey {
    pub table: TableId,
    pub objno: u64,
    pub owner: VolId,
}

impl ObjKey {
    pub fn slot(&self) -> Slot {
        Slot { table: self.table, objno: self.objno }
    }
}

/// A placement slot: every object of a table with this number lives on the same shards.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot {
    pub table: TableId,
    pub objno: u64,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardState {
    /// Serves as primary and replica.
    Up,
    /// Restarted or replaced: receives new writes, catches up by re-replication, is never primary.
    Recovering,
    /// Presumed dead: nothing is sent to it and nobody waits for it.
    Down,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ShardInfo {
    pub id: ShardId,
    pub addr: String,
    pub state: ShardState,
    /// The shard holds every acknowledged write of its objects: it was never marked down since
    /// it last caught up. A shard that is not in sync may lead only after catching up from the
    /// in-sync shards, so a whole-cluster restart never lets a stale copy win.
    #[serde(default)]
    pub in_sync: bool,
}

/// The cluster map: which shards exist, where, and in which state. Changed only by the metadata
/// service, which bumps `epoch` on every change.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ClusterMap {
    pub epoch: Epoch,
    pub replicas: u32,
    pub shards: Vec<ShardInfo>,
}

impl ClusterMap {
    pub fn state(&self, id: ShardId) -> ShardState {
        self.shards.iter().find(|s| s.id == id).map(|s| s.state).unwrap_or(ShardState::Down)
    }

    pub fn addr(&self, id: ShardId) -> Option<&str> {
        self.shards.iter().find(|s| s.id == id).map(|s| s.addr.as_str())
    }

    /// The `replicas` shards a slot lives on, best first: rendezvous hashing over all shards,
    /// up or not, so a shard's death does not move data and its replacement (same id) refills
    /// exactly its old objects.
    pub fn placement(&self, slot: Slot) -> Vec<ShardId> {
        let mut scored: Vec<(u64, ShardId)> =
            self.shards.iter().map(|s| (rendezvous_score(slot, s.id), s.id)).collect();
        scored.sort_unstable_by(|a, b| b.cmp(a));
        scored.into_iter().take(self.replicas as usize).map(|(_, id)| id).collect()
    }

    /// The acting primary of a slot: the first up shard of its placement.
    pub fn primary(&self, slot: Slot) -> Option<ShardId> {
        self.placement(slot).into_iter().find(|&id| self.state(id) == ShardState::Up)
    }
}

/// splitmix64: a fast, well-mixed hash for placement.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn rendezvous_score(slot: Slot, shard: ShardId) -> u64 {
    mix(mix(slot.table ^ mix(slot.objno)) ^ (shard as u64).wrapping_mul(0x2545_f491_4f6c_dd1d))
}

/// How a volume is laid out, as a client names it in every I/O.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct VolRef {
    pub id: VolId,
    pub table: TableId,
    pub object_size_bytes: u32,
    /// Set for a `super` child until garbage collection has handed it every parent object.
    pub parent: Option<VolId>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum IoOp {
    Read { offset: u32, len: u32 },
    Write { offset: u32, #[serde(with = "serde_bytes")] data: Vec<u8> },
    /// Write zeroes (also used for trim: reads of a trimmed range return zeroes).
    Zero { offset: u32, len: u32 },
}

/// A mutation as replicated from primary to replicas.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum RepOp {
    Write { offset: u32, #[serde(with = "serde_bytes")] data: Vec<u8> },
    Zero { offset: u32, len: u32 },
    /// Replace the whole object.
    Put { #[serde(with = "serde_bytes")] data: Vec<u8> },
}

/// Contents of a table's tracking object, replicated like every object.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct TableTrack {
    pub current: Option<TrackState>,
    /// Parents whose child was promoted: their writes are refused for ever.
    pub fenced_parents: Vec<VolId>,
}

/// Tracking state of one `super` as kept in the tracking object.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct TrackState {
    pub parent: VolId,
    pub child: VolId,
    /// A parent write was allowed after `super`.
    pub dirty: bool,
    /// Parent writes may still be allowed; off once the child is promoted.
    pub allow_write: bool,
    pub phase: Phase,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Superposed,
    Promoted,
    Aborted,
}

/// A data shard's view of a parent volume that has a `super` child.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrackEntry {
    /// Every parent write must first ask the tracking shard.
    Tracked { table: TableId, child: VolId },
    /// The tracking shard already allowed a parent write (the dirty bit is set).
    Granted { table: TableId, child: VolId },
    /// The child was promoted: parent writes fail.
    Fenced { table: TableId, child: VolId },
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IoErr {
    #[error("stale cluster map (shard has epoch {0})")]
    StaleEpoch(Epoch),
    #[error("not the primary of this object")]
    NotPrimary,
    #[error("shard not ready, retry")]
    NotReady,
    #[error("write refused: {0}")]
    WriteRefused(String),
    #[error("no space left on shard {0}")]
    NoSpace(ShardId),
    #[error("I/O error: {0}")]
    Io(String),
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("collapse refused: {0}")]
    CollapseRefused(String),
    /// The shard cannot renew its liveness lease in the control store and refuses I/O until
    /// the metadata service re-admits it (its slots move elsewhere meanwhile): retried.
    #[error("{0}")]
    Fenced(String),
}

impl IoErr {
    /// Errors a client should retry after refreshing its map or waiting briefly.
    pub fn is_retryable(&self) -> bool {
        matches!(self, IoErr::StaleEpoch(_) | IoErr::NotPrimary | IoErr::NotReady | IoErr::Fenced(_))
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollapseOutcome {
    /// The parent stayed clean: parent writes are now refused and the child is the volume.
    Promoted,
    /// The parent was written after `super`: the child is discarded.
    Rejected,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum ReplyBody {
    Done,
    Data(#[serde(with = "serde_bytes")] Vec<u8>),
    Collapse(CollapseOutcome),
    Granted(bool),
    /// Recovery: objects (and versions) a peer holds as primary in slots the asker belongs to.
    Objects { objects: Vec<(ObjKey, Version)>, tracks: Vec<(VolId, TrackEntry)>, retired: Vec<VolId>, more: bool },
    Object { version: Version, #[serde(with = "serde_bytes")] data: Vec<u8> },
    /// Replica → primary: my copy differs from what you expect; send the whole object.
    NeedFull,
}

/// Every message of the volume protocol. Requests carry a `req` id that their reply echoes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Client → primary: one I/O within one object.
    Io { req: ReqId, epoch: Epoch, vol: VolRef, objno: u64, op: IoOp },
    /// Primary → replica.
    Rep {
        req: ReqId,
        epoch: Epoch,
        key: ObjKey,
        prev_version: Version,
        version: Version,
        op: RepOp,
        /// Copy-on-write source: the parent and the version of its object the primary copied.
        cow_from: Option<(VolId, Version)>,
    },
    /// Data shard → tracking shard: may this parent be written?
    Permission { req: ReqId, epoch: Epoch, table: TableId, parent: VolId },
    /// Metadata → tracking shard: register a super child.
    Super { req: ReqId, epoch: Epoch, table: TableId, parent: VolId, child: VolId },
    /// Tracking shard → every shard: track writes to `parent`.
    Track { req: ReqId, epoch: Epoch, parent: VolId, entry: TrackEntry },
    /// Metadata → tracking shard.
    Collapse { req: ReqId, epoch: Epoch, table: TableId, child: VolId },
    /// Metadata → tracking shard: forget a finished super (after GC) so another can follow.
    EndSuper { req: ReqId, epoch: Epoch, table: TableId, child: VolId },
    /// Metadata → every shard: garbage-collect after collapse.
    /// Every shard not down at `epoch` must acknowledge it at that epoch, so a shard that comes
    /// back later learns the result from its peers' lists.
    Gc { req: ReqId, epoch: Epoch, table: TableId, parent: VolId, child: VolId, promoted: bool },
    /// Metadata → every shard: delete every object of a volume.
    /// With `drop_table`, the table's tracking object goes too (no volume uses the table any more).
    DeleteVolume { req: ReqId, epoch: Epoch, table: TableId, owner: VolId, drop_table: bool },
    /// Recovering shard → peer.
    ListObjects { req: ReqId, epoch: Epoch, after: Option<ObjKey> },
    /// New primary → replica, before the first operation on a slot in an epoch: which objects of
    /// the slot do you hold, at which versions?
    SlotVersions { req: ReqId, epoch: Epoch, slot: Slot },
    /// Primary → replica: delete an object the primary does not have (an unacknowledged write
    /// of a former primary).
    RepDelete { req: ReqId, epoch: Epoch, key: ObjKey },
    /// Primary → replica during slot synchronisation: take this copy, whatever you hold.
    RepSync { req: ReqId, epoch: Epoch, key: ObjKey, version: Version, #[serde(with = "serde_bytes")] data: Vec<u8> },
    /// Primary → replica: garbage-collect the slot as the primary did (hand `from`'s object to
    /// `to`, or delete it when `to` is `None`).
    RepCollect { req: ReqId, epoch: Epoch, slot: Slot, from: VolId, to: Option<VolId> },
    /// Recovering shard → primary: the whole object.
    Pull { req: ReqId, epoch: Epoch, key: ObjKey },
    /// Metadata → shard: a new cluster map.
    Map(ClusterMap),
    /// Shard → metadata: recovery finished at this epoch.
    Recovered { shard: ShardId, epoch: Epoch },
    /// Shard → metadata, first on its link: who it is and where it listens; `boot_id` changes on
    /// every start, so the metadata service knows a restarted shard must re-replicate; `fresh`
    /// says it started with no objects at all (a new or replacement disk).
    /// `leased`: it keeps a liveness lease in the control store (`volume shard --store`), and
    /// counts as alive only while the store lists it.
    Register { shard: ShardId, addr: String, boot_id: u64, fresh: bool, leased: bool },
    /// Metadata → shard: liveness probe, answered with `Done`.
    Ping { req: ReqId },
    Reply { req: ReqId, result: Result<ReplyBody, IoErr> },
}

/// First frame on every connection after authentication: who is speaking.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Hello {
    /// A volume client (or, towards the metadata service, a control client).
    Client,
    /// A shard: towards another shard, its replication link; towards the metadata service, its
    /// control link (the first message then is `Msg::Register`).
    Shard(ShardId),
}
