//! Protocol types: timestamps, persistency models, configurations and every message exchanged
//! between nodes, the configuration manager (CM) and clients.
//!
//! Keys and values are (de)serialised as byte strings (`serde_bytes`): the same postcard bytes
//! as a sequence of `u8`, copied whole rather than element by element.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A replica's id; dense from 0 within a replication group.
pub type NodeId = u32;

/// Largest key accepted from a client.
pub const MAX_KEY_BYTES: usize = 1024;
/// Largest value accepted from a client.
pub const MAX_VALUE_BYTES: usize = 1024 * 1024;

/// Lamport timestamp of a record (§II-B): higher version is newer, ties broken by node id.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Ts {
    pub version: u64,
    pub node: NodeId,
}

impl fmt::Display for Ts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "<{},{}>", self.version, self.node)
    }
}

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

/// A record version (what a [`Chunk`] holds, owned).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    #[serde(with = "serde_bytes")]
    pub key: Vec<u8>,
    pub ts: Ts,
    #[serde(with = "serde_bytes")]
    pub value: Vec<u8>,
    /// Committed (valid) at the sender; an uncommitted entry is installed invalid and replayed.
    pub committed: bool,
}

impl Entry {
    pub fn size_bytes(&self) -> usize {
        self.key.len() + self.value.len() + 24
    }
}

/// A record version borrowed from a [`Chunk`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryRef<'a> {
    pub key: &'a [u8],
    pub ts: Ts,
    pub value: &'a [u8],
    pub committed: bool,
}

impl EntryRef<'_> {
    pub fn to_entry(&self) -> Entry {
        Entry {
            key: self.key.to_vec(),
            ts: self.ts,
            value: self.value.to_vec(),
            committed: self.committed,
        }
    }
}

/// Bytes of a [`Chunk`] entry's fixed fields: key length, version, node, flags, value length.
pub const CHUNK_ENTRY_HEADER_BYTES: usize = 2 + 8 + 4 + 1 + 4;

/// The entries of one CatchUp_resp packed into one byte string, so a chunk is built with one
/// allocation (a store lookup and a copy per entry), travels as one frame with one checksum,
/// and is applied and logged from borrowed slices (no allocation per entry on either side).
/// Per entry: `key_len: u16 LE | key | version: u64 LE | node: u32 LE | flags: u8 (bit 0:
/// committed) | value_len: u32 LE | value`.
///
/// A received chunk may keep the whole frame it arrived in ([`Chunk::in_frame`]): its entries
/// are `buf[start..]`, taken from the socket's read buffer without a copy.
#[derive(Clone, Default)]
pub struct Chunk {
    buf: Vec<u8>,
    start: usize,
}

impl std::fmt::Debug for Chunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Chunk").field(&self.bytes()).finish()
    }
}

impl PartialEq for Chunk {
    fn eq(&self, other: &Self) -> bool {
        self.bytes() == other.bytes()
    }
}

impl Eq for Chunk {}

impl std::hash::Hash for Chunk {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.bytes().hash(h)
    }
}

impl Serialize for Chunk {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(self.bytes())
    }
}

impl<'de> Deserialize<'de> for Chunk {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let buf = serde_bytes::ByteBuf::deserialize(d)?.into_vec();
        Ok(Chunk { buf, start: 0 })
    }
}

/// A malformed [`Chunk`] (from a peer: the chunk is dropped whole).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("malformed catch-up chunk at byte {at}: {what}")]
pub struct ChunkError {
    pub at: usize,
    pub what: &'static str,
}

impl Chunk {
    pub fn with_capacity(bytes: usize) -> Self {
        Chunk {
            buf: Vec::with_capacity(bytes),
            start: 0,
        }
    }

    /// The chunk whose entries are `frame[start..end]`, keeping the frame's buffer.
    pub fn in_frame(mut frame: Vec<u8>, start: usize, end: usize) -> Self {
        assert!(
            start <= end && end <= frame.len(),
            "a chunk lies within its frame"
        );
        frame.truncate(end);
        if frame.capacity() > 2 * end + 4096 {
            // A buffer grown by an earlier, larger frame: not held for as long as the chunk.
            frame.shrink_to_fit();
        }
        Chunk { buf: frame, start }
    }

    /// The entries' bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[self.start..]
    }

    pub fn from_entries<'a>(entries: impl IntoIterator<Item = &'a Entry>) -> Self {
        let mut c = Chunk::default();
        for e in entries {
            c.push(&e.key, e.ts, &e.value, e.committed);
        }
        c
    }

    /// Appends an entry. Keys and values are bounded by [`MAX_KEY_BYTES`] and
    /// [`MAX_VALUE_BYTES`] everywhere they enter a node, so their lengths fit the fields.
    pub fn push(&mut self, key: &[u8], ts: Ts, value: &[u8], committed: bool) {
        debug_assert!(key.len() <= u16::MAX as usize && value.len() <= u32::MAX as usize);
        let b = &mut self.buf;
        b.reserve(CHUNK_ENTRY_HEADER_BYTES + key.len() + value.len());
        b.extend_from_slice(&(key.len() as u16).to_le_bytes());
        b.extend_from_slice(key);
        b.extend_from_slice(&ts.version.to_le_bytes());
        b.extend_from_slice(&ts.node.to_le_bytes());
        b.push(committed as u8);
        b.extend_from_slice(&(value.len() as u32).to_le_bytes());
        b.extend_from_slice(value);
    }

    pub fn len_bytes(&self) -> usize {
        self.bytes().len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes().is_empty()
    }

    /// The entry at byte `at` and where the next starts.
    pub fn entry_at(&self, at: usize) -> Result<(EntryRef<'_>, usize), ChunkError> {
        let b = self.bytes();
        let err = |what| ChunkError { at, what };
        let take = |pos: usize, n: usize| -> Result<&[u8], ChunkError> {
            b.get(pos..pos.checked_add(n).ok_or(err("length overflow"))?)
                .ok_or(err("truncated entry"))
        };
        let klen = u16::from_le_bytes(take(at, 2)?.try_into().unwrap()) as usize;
        let key = take(at + 2, klen)?;
        let mut pos = at + 2 + klen;
        let f = take(pos, 8 + 4 + 1 + 4)?;
        let version = u64::from_le_bytes(f[0..8].try_into().unwrap());
        let node = u32::from_le_bytes(f[8..12].try_into().unwrap());
        let flags = f[12];
        let vlen = u32::from_le_bytes(f[13..17].try_into().unwrap()) as usize;
        pos += 17;
        if flags > 1 {
            return Err(err("unknown flags"));
        }
        if key.is_empty() || key.len() > MAX_KEY_BYTES || vlen > MAX_VALUE_BYTES {
            return Err(err("key or value out of bounds"));
        }
        let value = take(pos, vlen)?;
        Ok((
            EntryRef {
                key,
                ts: Ts { version, node },
                value,
                committed: flags == 1,
            },
            pos + vlen,
        ))
    }

    /// Sets the committed flag of the entry at byte `at`, an offset [`Chunk::push`] or
    /// [`Chunk::iter`] gave (anything else is a bug: panics).
    pub fn set_committed(&mut self, at: usize) {
        let (e, _) = self.entry_at(at).expect("an entry's offset");
        let flags = self.start + at + 2 + e.key.len() + 8 + 4;
        self.buf[flags] = 1;
    }

    /// Checks every entry; returns how many there are.
    pub fn validate(&self) -> Result<usize, ChunkError> {
        let (mut at, mut n) = (0, 0);
        while at < self.len_bytes() {
            at = self.entry_at(at)?.1;
            n += 1;
        }
        Ok(n)
    }

    /// The entries with their byte offsets, stopping at the first malformed one.
    pub fn iter(&self) -> impl Iterator<Item = Result<(usize, EntryRef<'_>), ChunkError>> + '_ {
        let mut at = 0;
        let mut failed = false;
        std::iter::from_fn(move || {
            if failed || at >= self.len_bytes() {
                return None;
            }
            match self.entry_at(at) {
                Ok((e, next)) => {
                    let here = at;
                    at = next;
                    Some(Ok((here, e)))
                }
                Err(e) => {
                    failed = true;
                    Some(Err(e))
                }
            }
        })
    }

    pub fn to_entries(&self) -> Result<Vec<Entry>, ChunkError> {
        self.iter().map(|r| r.map(|(_, e)| e.to_entry())).collect()
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
