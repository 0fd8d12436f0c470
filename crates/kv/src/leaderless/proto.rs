//! Protocol types (HEAL): persistency models, configurations and every message exchanged
//! between nodes, the configuration manager (CM) and clients.
//!
//! Keys and values are (de)serialised as byte strings (`serde_bytes`): the same postcard bytes
//! as a sequence of `u8`, copied whole rather than element by element.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

pub use crate::pmlog::record::{
    Chunk, ChunkError, Entry, EntryRef, NodeId, Ts, CHUNK_ENTRY_HEADER_BYTES, MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
};

/// The persistency model paired with linearizable consistency (Table I). One per cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Model {
    /// ⟨Lin, Synch⟩: a follower persists before its (single) ACK; the client is answered once
    /// every replica has applied and persisted; VAL makes the key readable and durable.
    Synch,
    /// ⟨Lin, Strict⟩: ACK_C / ACK_P and VAL_C / VAL_P; readable at VAL_C, client answered only
    /// when every replica persisted (all ACK_Ps).
    Strict,
    /// ⟨Lin, REnf⟩: client answered at all ACK_Cs; the key becomes readable only at the VAL
    /// sent once every replica persisted (all ACK_Ps).
    ReadEnforced,
    /// ⟨Lin, Event⟩: client answered and key readable at all ACK_Cs; persistence in the
    /// background (its ACK_P / VAL_P only track global durability for HEAL's bookkeeping).
    Eventual,
    /// ⟨Lin, Scope⟩: like Eventual per write; a client's `PERSIST` of a scope is answered once
    /// every replica persisted every write of the scope ([ACK_P]sc, then [VAL_P]sc).
    Scope,
}

impl Model {
    pub const ALL: [Model; 5] = [
        Model::Synch,
        Model::Strict,
        Model::ReadEnforced,
        Model::Eventual,
        Model::Scope,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Model::Synch => "synch",
            Model::Strict => "strict",
            Model::ReadEnforced => "read-enforced",
            Model::Eventual => "eventual",
            Model::Scope => "scope",
        }
    }
}

impl fmt::Display for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Model {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "synch" | "sync" | "synchronous" => Ok(Model::Synch),
            "strict" => Ok(Model::Strict),
            "read-enforced" | "readenforced" | "renf" => Ok(Model::ReadEnforced),
            "eventual" | "event" => Ok(Model::Eventual),
            "scope" => Ok(Model::Scope),
            _ => Err(format!(
                "unknown persistency model {s:?}: use synch, strict, read-enforced, eventual or scope"
            )),
        }
    }
}

/// A configuration of the replication group, numbered by its epoch. `active` nodes serve
/// clients; `recovering` nodes are ShadowReplicas (they take part in writes, serve no client);
/// every node of `nodes` in neither set is absent (failed, the group runs with fewer nodes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Config {
    pub epoch: u64,
    pub nodes: Vec<NodeId>,
    pub active: BTreeSet<NodeId>,
    pub recovering: BTreeSet<NodeId>,
}

impl Config {
    /// The genesis configuration: every node active at epoch 1.
    pub fn genesis(n: u32) -> Self {
        Config {
            epoch: 1,
            nodes: (0..n).collect(),
            active: (0..n).collect(),
            recovering: BTreeSet::new(),
        }
    }

    /// Nodes that take part in writes (active and recovering).
    pub fn members(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes
            .iter()
            .copied()
            .filter(|n| self.active.contains(n) || self.recovering.contains(n))
    }

    pub fn is_member(&self, n: NodeId) -> bool {
        self.active.contains(&n) || self.recovering.contains(&n)
    }

    /// True when some node is absent or recovering: the Missed_updates buffers are needed.
    pub fn degraded(&self) -> bool {
        self.active.len() < self.nodes.len()
    }
}

/// Where a catch-up stream continues.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Cursor {
    /// HEAL (Missed_updates and Partially_persisted) or a full copy: keys after this one
    /// (`None`: from the first).
    Key(Option<Vec<u8>>),
    /// Reactive log (§II-C): a point in the sender's durable log.
    Log(crate::pmlog::LogCursor),
}

/// Node-to-node messages. Every one carries the sender's epoch; a receiver refuses messages of
/// any other epoch (the sender retries after it learns the current configuration).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerMsg {
    Inv {
        epoch: u64,
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
        ts: Ts,
        #[serde(with = "serde_bytes")]
        value: Vec<u8>,
    },
    /// `c`: applied to volatile memory (ACK_C); `p`: persisted (ACK_P). Synch sends both at once.
    Ack {
        epoch: u64,
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
        ts: Ts,
        c: bool,
        p: bool,
    },
    /// `c`: VAL_C (readable); `p`: VAL_P (globally durable).
    Val {
        epoch: u64,
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
        ts: Ts,
        c: bool,
        p: bool,
    },
    /// [PERSIST]sc fan-out: the writes of a scope, to be acknowledged once durable.
    PersistReq {
        epoch: u64,
        id: u64,
        writes: Vec<(Vec<u8>, Ts)>,
    },
    /// [ACK_P]sc.
    PersistAck {
        epoch: u64,
        id: u64,
    },
    /// [VAL_P]sc.
    PersistVal {
        epoch: u64,
        writes: Vec<(Vec<u8>, Ts)>,
    },
    RecovStart {
        epoch: u64,
    },
    RecovStartAck {
        epoch: u64,
    },
    /// Opens catch-up stream `stream` at `cursor` with `chunks` credits, carrying the
    /// recovering node's Partially_persisted list. The Buddy sends one chunk per credit, back to
    /// back (each reply names the next cursor), and keeps the stream open at zero credit;
    /// [`PeerMsg::CatchUpCredit`] grants more, one per chunk the recovering node has made
    /// durable, before the granted ones run out: the Buddy never waits for a round trip, and
    /// the copy never runs more than the window ahead of the recovering node's log. A new
    /// request replaces the stream (a retry, possibly to a new Buddy).
    CatchUpReq {
        epoch: u64,
        stream: u64,
        partially: Vec<(Vec<u8>, Ts)>,
        cursor: Cursor,
        chunks: u32,
    },
    /// More credit for an open stream (ignored for any other stream).
    CatchUpCredit {
        epoch: u64,
        stream: u64,
        chunks: u32,
    },
    /// One chunk of stream `stream`, starting at `from`: at most about
    /// `max_catchup_chunk_bytes` of entries, and where the next starts (`None`: done).
    CatchUpResp {
        epoch: u64,
        stream: u64,
        from: Cursor,
        next: Option<Cursor>,
        full_copy: bool,
        entries: Chunk,
    },
    RecovEnd {
        epoch: u64,
    },
}

impl PeerMsg {
    pub fn epoch(&self) -> u64 {
        match self {
            PeerMsg::Inv { epoch, .. }
            | PeerMsg::Ack { epoch, .. }
            | PeerMsg::Val { epoch, .. }
            | PeerMsg::PersistReq { epoch, .. }
            | PeerMsg::PersistAck { epoch, .. }
            | PeerMsg::PersistVal { epoch, .. }
            | PeerMsg::RecovStart { epoch }
            | PeerMsg::RecovStartAck { epoch }
            | PeerMsg::CatchUpReq { epoch, .. }
            | PeerMsg::CatchUpCredit { epoch, .. }
            | PeerMsg::CatchUpResp { epoch, .. }
            | PeerMsg::RecovEnd { epoch } => *epoch,
        }
    }
}

/// CM to node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub seq: u64,
    pub config: Config,
    /// The `lease_ref` of the newest ack the CM had received from this node when it sent this
    /// heartbeat (0: none). The node's lease counts from when it sent that ack, a time known to
    /// come before this heartbeat was sent, however late the heartbeat is read (a node stopped
    /// by `SIGSTOP` reads a backlog of old heartbeats when it is continued).
    pub lease_ref: u64,
}

/// What a node tells the CM about itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeStatus {
    /// Serving (or about to): a member that has not lost its volatile state.
    Member,
    /// Restarted on its durable state (or removed): must recover before serving.
    WantsJoin,
    /// Recovering node that has finished HEAL (Recov_end sent).
    Recovered,
}

/// Node to CM.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatAck {
    pub node: NodeId,
    pub epoch: u64,
    pub seq: u64,
    pub status: NodeStatus,
    /// Names this ack for the node (unique across its restarts): the CM echoes it in its next
    /// heartbeats ([`Heartbeat::lease_ref`]).
    pub lease_ref: u64,
}

/// A client operation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClientOp {
    Get {
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
    },
    /// `scope`: under the Scope model, the scope this write belongs to (per coordinator node).
    Put {
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
        #[serde(with = "serde_bytes")]
        value: Vec<u8>,
        scope: Option<u64>,
    },
    /// [PERSIST]sc: answered once every write of the scope coordinated here is durable everywhere.
    Persist { scope: u64 },
}

/// The answer to a client operation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClientResult {
    Value(#[serde(with = "serde_bytes")] Option<Vec<u8>>),
    Done,
    /// This node does not serve clients now (absent, recovering, no lease): nothing was done,
    /// try another node.
    NotServing,
    /// Too many operations queued here: nothing was done, retry later.
    Busy,
    /// The request was malformed (oversized key or value): nothing was done.
    Invalid(String),
}
