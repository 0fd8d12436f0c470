//! Messages of the witness KV (CANDStore, paper §3–§5, Fig 5), imported by the core and by the
//! drivers, never by each other.
//!
//! Every peer message travels in a [`PeerMsg`] envelope carrying the sender's Raft `term` and
//! the configuration `epoch` it acts under, so a receiver can refuse a stale sender before it
//! looks at the body. Timestamps are logical, `(term, index)` of the log entry that wrote the
//! key ([`Stamp`]): the witness's key table maps each key to the stamp of its newest committed
//! Put, and that stamp is the oracle every served value is checked against (spec M18).
//!
//! Encoding is postcard, as in the rest of `kv`; keys and values are `serde_bytes`.

use serde::{Deserialize, Serialize};

pub use crate::pmlog::record::{NodeId, MAX_KEY_BYTES, MAX_VALUE_BYTES};

/// Largest encoded peer message a decoder accepts: a BatchPull reply carries at most
/// `BATCH_PULL_MAX_BYTES` of entries plus framing.
pub const MAX_PEER_MSG_BYTES: usize = 4 << 20;
/// Largest encoded client request or reply.
pub const MAX_CLIENT_MSG_BYTES: usize = MAX_KEY_BYTES + MAX_VALUE_BYTES + 64;

/// A key's logical timestamp: the (term, index) of the log entry that wrote it. Ordered by
/// term, then index; along one Raft log both grow together, so this is also log order.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Stamp {
    pub term: u64,
    pub index: u64,
}

impl Stamp {
    /// "Never written": below every real stamp (real indexes start at 1).
    pub const ZERO: Stamp = Stamp { term: 0, index: 0 };
}

/// A member's kind (paper §3). Defined here, with [`Member`] and [`Config`], because a
/// configuration travels in the log ([`Op::Config`]); `core::config` holds their logic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    /// Primary or witness: keeps the key→stamp table (and, as primary, values); may be elected.
    Head,
    /// NVMM buffer, SSD logs and index: votes and persists, never a candidate.
    Backup,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub id: NodeId,
    pub kind: Kind,
    pub voting: bool,
}

/// The group's membership at one epoch (quorums and rules in `core::config`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Config {
    pub epoch: u64,
    pub members: Vec<Member>,
    /// A witness standing in for a failed backup in the commit quorum (M22). It must then
    /// receive full entries.
    pub substitute: Option<NodeId>,
    /// Nodes not yet members that the leader may add on its own to replace a lost member
    /// (M23/M24: fault tolerance comes back by itself). Naming them in the configuration
    /// makes the choice part of the replicated state: a spare is used once.
    #[serde(default)]
    pub spares: Vec<Member>,
}

/// One membership step (M22–M24), as the automatic policy or an operator (`kv reconfig`)
/// proposes it. Each changes the voter set by at most one node; see `core::reconfig` for why
/// that suffices here (and `core::config` for the checks).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Change {
    /// A new member joins non-voting (a replacement witness or backup catching up, M22). A
    /// spare of that id is taken off the spare list.
    Add { id: NodeId, kind: Kind },
    /// A member leaves (a lost witness once its replacement votes; a failed backup).
    Remove { id: NodeId },
    /// Promote (a caught-up member, M22) or demote a member. A kind never changes: a
    /// member's kind is which engine its process runs.
    SetVoting { id: NodeId, voting: bool },
    /// M22: the voting backup `backup` stops voting and the witness `witness` takes its place
    /// in the commit quorum (Cheap Paxos), in one step: the voters lose one node and the
    /// commit quorum swaps one member, so writes continue without the failed backup.
    Substitute { backup: NodeId, witness: NodeId },
    /// The substitute goes back to being a plain witness (a backup votes again).
    EndSubstitute,
}

/// What a log entry does. Single-key Put only (paper §2.4: no delete, no scan); `Noop` is the
/// entry a new leader appends in its own term so that earlier entries commit (Raft §5.4.2).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    Noop,
    /// A membership change (M22–M24): takes effect on every member as soon as it is appended
    /// (Raft §4.1), so at most one may be uncommitted at a time (see `core::reconfig`). It
    /// goes in full to every member, witnesses included (spec M22 Decide).
    Config(Config),
    Put {
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
        /// `None` in the copy a witness receives and keeps (key and stamp only, M4); `Some` in
        /// the leader's and the backups' copies.
        value: Option<serde_bytes::ByteBuf>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub index: u64,
    pub term: u64,
    pub op: Op,
}

impl Entry {
    pub fn stamp(&self) -> Stamp {
        Stamp {
            term: self.term,
            index: self.index,
        }
    }
    pub fn key(&self) -> Option<&[u8]> {
        match &self.op {
            Op::Put { key, .. } => Some(key),
            Op::Noop | Op::Config(_) => None,
        }
    }
    pub fn value(&self) -> Option<&[u8]> {
        match &self.op {
            Op::Put { value, .. } => value.as_deref().map(|v| v.as_slice()),
            Op::Noop | Op::Config(_) => None,
        }
    }
    /// True when this copy can be sent to a backup (a Put carries its value; a Noop has none).
    pub fn is_full(&self) -> bool {
        match &self.op {
            Op::Noop | Op::Config(_) => true,
            Op::Put { value, .. } => value.is_some(),
        }
    }
    /// The copy a witness receives: the key and stamp, without the value (M4).
    pub fn key_only(&self) -> Entry {
        match &self.op {
            Op::Noop | Op::Config(_) => self.clone(),
            Op::Put { key, .. } => Entry {
                index: self.index,
                term: self.term,
                op: Op::Put {
                    key: key.clone(),
                    value: None,
                },
            },
        }
    }
    /// Payload bytes, for the byte bounds of batches and replies.
    pub fn approx_bytes(&self) -> usize {
        24 + match &self.op {
            Op::Noop => 0,
            Op::Config(c) => 16 * c.members.len(),
            Op::Put { key, value } => key.len() + value.as_ref().map_or(0, |v| v.len()),
        }
    }
}

/// The envelope of every node-to-node message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerMsg {
    /// The sender's current Raft term.
    pub term: u64,
    /// The configuration epoch the sender acts under (static in this version: see
    /// `core::config`).
    pub epoch: u64,
    pub body: PeerBody,
}

impl PeerBody {
    /// The message's name, for logs (a slow input names what it was).
    pub fn name(&self) -> &'static str {
        match self {
            PeerBody::AppendEntries { .. } => "AppendEntries",
            PeerBody::AppendAck { .. } => "AppendAck",
            PeerBody::Snapshot { .. } => "Snapshot",
            PeerBody::SnapshotAck { .. } => "SnapshotAck",
            PeerBody::RequestVote { .. } => "RequestVote",
            PeerBody::Vote { .. } => "Vote",
            PeerBody::RequestLog { .. } => "RequestLog",
            PeerBody::LogReply { .. } => "LogReply",
            PeerBody::BatchPull { .. } => "BatchPull",
            PeerBody::BatchPullReply { .. } => "BatchPullReply",
            PeerBody::BatchPullAbort { .. } => "BatchPullAbort",
            PeerBody::PriorityPull { .. } => "PriorityPull",
            PeerBody::PriorityPullReply { .. } => "PriorityPullReply",
            PeerBody::Popularity { .. } => "Popularity",
            PeerBody::Refill { .. } => "Refill",
            PeerBody::RefillAck { .. } => "RefillAck",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerBody {
    /// Leader → every member (Fig 5). Backups get full entries, witnesses key-only ones. With no
    /// entries it is the heartbeat (M11) and renews the leader's lease.
    AppendEntries {
        leader: NodeId,
        prev_index: u64,
        prev_term: u64,
        entries: Vec<Entry>,
        /// The leader's commit index: a backup writes back only entries at or below it (M8).
        commit: u64,
        /// The leader's clock when it sent this round; echoed in the ack so the leader knows
        /// which round a majority answered (its lease starts at that send time, M3).
        sent_us: u64,
    },
    AppendAck {
        success: bool,
        /// On success, the highest index this follower holds *persisted* matching the leader.
        /// On failure, the follower's last index (where the leader retries from).
        match_index: u64,
        sent_us: u64,
        /// Through which index the leader may drop its log for this member: a head's
        /// persisted match, a backup's written-back index (M24 log truncation).
        durable: u64,
        /// A head restarted from a truncated log: its key table is incomplete until a
        /// snapshot arrives.
        want_snapshot: bool,
    },
    /// Leader → a head too far behind its truncated log (M24): the key→stamp table as of
    /// `last_index`, in chunks of sorted keys from `offset`.
    Snapshot {
        last_index: u64,
        last_term: u64,
        config: Config,
        offset: u64,
        keys: Vec<(serde_bytes::ByteBuf, Stamp)>,
        done: bool,
    },
    /// Keys of snapshot `last_index` received so far; `installed` once it is in force.
    SnapshotAck {
        last_index: u64,
        next_offset: u64,
        installed: bool,
    },
    /// Heads only (a backup never runs, M12).
    RequestVote {
        candidate: NodeId,
        last_index: u64,
        last_term: u64,
    },
    Vote {
        granted: bool,
        /// The voter's log end, so a refused witness can adopt it (M13).
        last_index: u64,
        last_term: u64,
        /// Refused only because the voter heard from a live leader within the lease (M3); such
        /// a refusal says nothing about logs and is never adopted from.
        in_lease: bool,
        /// A backup's refusal carries its newest configuration entry past its commit index, so
        /// a head that adopts this log (M13) also learns a membership change it missed: a
        /// witness promoted while the leader died would otherwise never stand (etcd#10998).
        config: Option<Entry>,
    },
    /// Provisional leader → voting backups (M14): the entry at `index`.
    RequestLog {
        index: u64,
    },
    /// `entry: None` = this backup holds no entry at `index` (so it was never committed, M14 ii).
    /// `gone: true` = the index is older than the backup's recent-index window: unknown.
    LogReply {
        index: u64,
        entry: Option<Entry>,
        gone: bool,
    },
    /// New primary → backup (M15/M17): the next batch of the backup's SSD log from `cursor`
    /// (a byte offset in its log; 0 = the beginning).
    BatchPull {
        stream: u64,
        cursor: u64,
    },
    BatchPullReply {
        stream: u64,
        entries: Vec<Entry>,
        next_cursor: u64,
        /// Everything up to the log's end has been sent (a reply with no entries, as Squall).
        done: bool,
    },
    /// Stop a BatchPull stream (the witness heard the primary again, M15).
    BatchPullAbort {
        stream: u64,
    },
    /// New primary → backup on a Get miss (M18): every version of `key` the backup holds in its
    /// NVMM buffer, plus the SSD page its index names (the whole page: spatial locality).
    PriorityPull {
        id: u64,
        key: serde_bytes::ByteBuf,
    },
    PriorityPullReply {
        id: u64,
        entries: Vec<Entry>,
    },
    /// Primary → backups, every few seconds: sampled popular keys (M10) with their sample
    /// counts, most sampled first.
    Popularity {
        keys: Vec<(serde_bytes::ByteBuf, u32)>,
    },
    /// Leader → a backup too far behind its truncated log (M24, `core/refill.rs`): the
    /// leader's value table as of `last_index`, one full Put per key at the key's newest
    /// stamp (which may be past `last_index`: a write racing the transfer), in chunks of
    /// sorted keys from key number `offset`.
    Refill {
        last_index: u64,
        last_term: u64,
        config: Config,
        offset: u64,
        entries: Vec<Entry>,
        done: bool,
    },
    /// Keys of refill `last_index` durable on the backup's SSD so far; `installed` once the
    /// backup's log restarts at `last_index`.
    RefillAck {
        last_index: u64,
        next_offset: u64,
        installed: bool,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClientReq {
    Get {
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
    },
    /// An operator's membership change (`kv reconfig`): the serving leader proposes it and
    /// answers [`ClientReply::Reconfigured`] once its entry commits, `Invalid` with the reason
    /// if the change is refused, `Unavailable` while another change is still uncommitted.
    Reconfigure(Change),
    /// This node's view of the membership (any node answers; nothing changes).
    Membership,
    Put {
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
        #[serde(with = "serde_bytes")]
        value: Vec<u8>,
    },
    /// What the node is and holds (`kv status`, `bench kv ttr`'s cost per GB): answered by any
    /// node, leader or not, and never changes anything.
    Status,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClientReply {
    /// A Get's answer (`None`: the key was never written).
    Value(Option<serde_bytes::ByteBuf>),
    PutOk,
    /// A [`ClientReq::Reconfigure`] committed: the configuration its entry put in force.
    Reconfigured(Config),
    /// The answer to [`ClientReq::Membership`]: the configuration in force at this node, the
    /// leader it follows (itself when leading) and whether it serves as leader.
    Membership {
        config: Config,
        leader: Option<NodeId>,
        serving: bool,
    },
    /// This node is not the serving leader; try `hint` (the leader it last heard from) if any.
    NotLeader {
        hint: Option<NodeId>,
    },
    /// A leader that cannot serve yet (provisional, or a bound is full): retry here later.
    Unavailable,
    /// The Put was appended but this node lost leadership before it committed: it may or may
    /// not take effect.
    Indeterminate,
    /// A malformed request (too large a key or value).
    Invalid(String),
    /// The answer to [`ClientReq::Status`].
    Status(Box<StatusReport>),
}

/// One node's state and tier bytes, as `kv status` prints it (issue 25 item 10).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReport {
    pub id: NodeId,
    /// "head" or "backup" (the configuration's kind of this node).
    pub kind: String,
    /// "follower", "candidate", "provisional" or "leader".
    pub role: String,
    pub term: u64,
    /// The leader this node last heard from (itself when leading).
    pub leader: Option<NodeId>,
    pub commit: u64,
    pub last_index: u64,
    /// Leading, reconciled and its first entry committed.
    pub serving: bool,
    /// Leading and still pulling values from the backups (M17–M19).
    pub recovering: bool,
    /// Keys whose value this leader still has to pull (0 when not recovering).
    pub missing_keys: u64,
    /// Entries of the key table (heads) or of the SSD index (backups).
    pub keys: u64,
    /// Entries of the value table (a primary; 0 on a witness and a backup).
    pub values: u64,
    /// Entries a backup has written back to SSD through (its index is current to here).
    pub written_back_through: u64,
    pub tiers: TierReport,
    /// The process's resident set (`/proc/self/statm`), and of it the pages shared with files
    /// and shm (the NVMM rings): `rss_bytes - rss_shared_bytes` is the private memory the DRAM
    /// and NVMM-table bytes stand for.
    pub rss_bytes: u64,
    pub rss_shared_bytes: u64,
}

/// Bytes a node holds, by tier (the paper's prices apply per tier: DRAM, NVMM, SSD).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierReport {
    /// A head's key → stamp table (an NVMM hash table in the paper; see `core::tiers`).
    pub nvmm_key_table_bytes: u64,
    /// A primary's value table (NVMM in the paper).
    pub nvmm_value_table_bytes: u64,
    /// The NVMM log/buffer ring: bytes between its head and tail (live records).
    pub nvmm_buffer_used_bytes: u64,
    /// The NVMM rings as mapped (provisioned), used or not.
    pub nvmm_buffer_mapped_bytes: u64,
    /// A backup's index key → (stamp, SSD location).
    pub dram_index_bytes: u64,
    pub dram_popularity_bytes: u64,
    /// The in-memory Raft log's slot array.
    pub dram_log_bytes: u64,
    /// Bytes of the entries a backup's index points at (the newest version of every key).
    pub ssd_live_bytes: u64,
    /// Bytes the segment files take (live, stale versions GC has not reclaimed, page padding).
    pub ssd_allocated_bytes: u64,
}

impl TierReport {
    /// DRAM charged at the DRAM price.
    pub fn dram_bytes(&self) -> u64 {
        self.dram_index_bytes + self.dram_popularity_bytes + self.dram_log_bytes
    }
    /// NVMM charged at the NVMM price: the tables and the buffer bytes in use. The mapped ring
    /// is a fixed provision (256 MiB by default) sized for writeback lag, not for the data; at
    /// the paper's scale it is noise, at a test's scale it would be most of the bill.
    pub fn nvmm_bytes(&self) -> u64 {
        self.nvmm_key_table_bytes + self.nvmm_value_table_bytes + self.nvmm_buffer_used_bytes
    }
    /// SSD charged at the SSD price: what the files take.
    pub fn ssd_bytes(&self) -> u64 {
        self.ssd_allocated_bytes
    }
    /// The bytes the process's private memory should hold: DRAM and the NVMM tables (which
    /// are DRAM hash tables on this machine), not the shm rings nor SSD.
    pub fn in_heap_bytes(&self) -> u64 {
        self.dram_bytes() + self.nvmm_key_table_bytes + self.nvmm_value_table_bytes
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("message of {0} bytes exceeds the limit of {1} bytes")]
    TooLarge(usize, usize),
    #[error("malformed message: {0}")]
    Malformed(#[from] postcard::Error),
}

pub fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    postcard::to_allocvec(msg).expect("witness messages always serialise")
}

pub fn decode_peer(bytes: &[u8]) -> Result<PeerMsg, DecodeError> {
    if bytes.len() > MAX_PEER_MSG_BYTES {
        return Err(DecodeError::TooLarge(bytes.len(), MAX_PEER_MSG_BYTES));
    }
    Ok(postcard::from_bytes(bytes)?)
}

pub fn decode_client_req(bytes: &[u8]) -> Result<ClientReq, DecodeError> {
    if bytes.len() > MAX_CLIENT_MSG_BYTES {
        return Err(DecodeError::TooLarge(bytes.len(), MAX_CLIENT_MSG_BYTES));
    }
    Ok(postcard::from_bytes(bytes)?)
}

pub fn decode_client_reply(bytes: &[u8]) -> Result<ClientReply, DecodeError> {
    if bytes.len() > MAX_CLIENT_MSG_BYTES {
        return Err(DecodeError::TooLarge(bytes.len(), MAX_CLIENT_MSG_BYTES));
    }
    Ok(postcard::from_bytes(bytes)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_messages_round_trip() {
        let e = Entry {
            index: 7,
            term: 2,
            op: Op::Put {
                key: b"k".to_vec(),
                value: Some(serde_bytes::ByteBuf::from(b"v".to_vec())),
            },
        };
        let msgs = vec![
            PeerBody::AppendEntries {
                leader: 1,
                prev_index: 6,
                prev_term: 2,
                entries: vec![e.clone(), e.key_only()],
                commit: 5,
                sent_us: 10,
            },
            PeerBody::Vote {
                granted: false,
                last_index: 9,
                last_term: 3,
                in_lease: false,
                config: None,
            },
            PeerBody::LogReply {
                index: 7,
                entry: Some(e.clone()),
                gone: false,
            },
            PeerBody::PriorityPull {
                id: 3,
                key: serde_bytes::ByteBuf::from(b"k".to_vec()),
            },
        ];
        for body in msgs {
            let m = PeerMsg {
                term: 4,
                epoch: 1,
                body,
            };
            assert_eq!(decode_peer(&encode(&m)).unwrap(), m);
        }
        assert_eq!(e.key_only().value(), None);
        assert_eq!(e.value(), Some(&b"v"[..]));
    }

    #[test]
    fn bad_bytes_are_an_error_not_a_panic() {
        assert!(decode_peer(&[0xff, 0xff, 0xff]).is_err());
        assert!(decode_client_req(&[9]).is_err());
        let big = vec![0u8; MAX_PEER_MSG_BYTES + 1];
        assert!(matches!(
            decode_peer(&big),
            Err(DecodeError::TooLarge(_, _))
        ));
    }
}
