//! The metadata service's protocol: its persistent state ([`MetaState`]: volumes, the cluster
//! map, jobs) and the control requests and replies ([`MetaReq`], [`MetaResp`]). The
//! deterministic core ([`crate::core::meta`]) and the tokio driver
//! ([`crate::driver::meta`]) both import it, never each other's internals.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::types::*;

pub const DEFAULT_OBJECT_SIZE_BYTES: u32 = 64 * 1024;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Layout {
    /// A plain volume, or a collocated `super` child (then `VolRef::parent` is set until GC ends).
    Plain,
    /// The rbd-style general clone baseline: own table, copy-up from the parent across the
    /// network, an object-map update per copied object.
    GeneralClone { parent: VolRef },
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct VolumeRec {
    pub name: String,
    pub vol: VolRef,
    pub size_bytes: u64,
    pub layout: Layout,
    /// Name of this volume's `super` child while the superposition lasts.
    pub super_child: Option<String>,
    /// For a `super` child: its parent's name until collapse.
    pub super_parent: Option<String>,
    pub created_unix_ms: u64,
    /// A `super` child recorded before the tracking shard confirmed it: `Info` does not show
    /// it (no client may open it yet), and a restarted metadata service finishes or undoes it.
    #[serde(default)]
    pub super_pending: bool,
    /// A super child whose collapse was asked for but is not decided (or not recorded) yet,
    /// because the tracking shard did not answer in time: the service keeps asking it, with
    /// backoff, until it answers — also after a restart of the service.
    #[serde(default)]
    pub collapsing: bool,
}

impl VolumeRec {
    /// A volume that is nobody's super parent or child (yet).
    pub fn new(name: String, vol: VolRef, size_bytes: u64, layout: Layout, created_unix_ms: u64) -> Self {
        VolumeRec { name, vol, size_bytes, layout, super_child: None, super_parent: None, created_unix_ms, super_pending: false, collapsing: false }
    }
}

/// A decided collapse, kept so that a client that lost its connection mid-`collapse` and asks
/// again learns the outcome instead of "not a super child".
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct CollapseRec {
    pub child: String,
    pub child_id: VolId,
    pub outcome: CollapseOutcome,
}

/// How many decided collapses [`MetaState::collapsed`] remembers (the oldest go first).
pub const MAX_COLLAPSE_RECORDS: usize = 64;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Job {
    /// Garbage collection after collapse, then clearing the tracking object.
    Gc { table: TableId, parent: VolId, child: VolId, promoted: bool, child_name: Option<String> },
    /// Deleting a volume's objects.
    Delete { table: TableId, owner: VolId, drop_table: bool },
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct MetaState {
    pub next_id: u64,
    pub map: ClusterMap,
    pub volumes: BTreeMap<String, VolumeRec>,
    pub jobs: Vec<Job>,
    /// The last decided collapses, newest last (at most [`MAX_COLLAPSE_RECORDS`]).
    #[serde(default)]
    pub collapsed: Vec<CollapseRec>,
}

impl MetaState {
    pub fn new(replicas: u32) -> Self {
        Self::with_map(ClusterMap { epoch: 1, replicas, shards: vec![] })
    }

    /// An empty state over `map`.
    pub fn with_map(map: ClusterMap) -> Self {
        MetaState { next_id: 1, map, volumes: BTreeMap::new(), jobs: vec![], collapsed: vec![] }
    }
}

/// Requests of control clients (the CLI, volume clients, the NBD server).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum MetaReq {
    GetMap,
    Create { name: String, size_bytes: u64, object_size_bytes: u32 },
    Delete { name: String },
    List,
    Info { name: String },
    Resize { name: String, size_bytes: u64 },
    /// Creates a collocated clone of `parent` named `child` and starts tracking parent writes.
    Super { parent: String, child: String },
    Collapse { child: String },
    /// Ends a superposition without promoting: the child is rejected and garbage-collected, the
    /// parent keeps (or gets back) permission to write. Answers the parent's record. An error
    /// for a volume that is not a super child, or whose collapse already promoted it.
    Abort { child: String },
    /// The rbd-style baseline clone.
    CloneGeneral { parent: String, child: String },
    /// Jobs (GC, deletes) still running.
    Jobs,
}

impl MetaReq {
    /// True for a request that changes nothing: asking it twice is harmless, so a client may
    /// ask again when its answer does not come.
    pub fn is_read_only(&self) -> bool {
        matches!(self, MetaReq::GetMap | MetaReq::List | MetaReq::Info { .. } | MetaReq::Jobs)
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum MetaResp {
    Map(ClusterMap),
    Volume(VolumeRec),
    Volumes(Vec<VolumeRec>),
    Collapsed { outcome: CollapseOutcome, volume: Option<VolumeRec> },
    Jobs(Vec<Job>),
    Done,
    Err(String),
}
