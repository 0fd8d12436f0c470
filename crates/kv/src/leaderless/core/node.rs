//! The sans-I/O replica: Hermes-style writes (§II-B), the five persistency models (Table I,
//! §V-E), replays (§V-F, Table III) and the HEAL recovery of Fig. 4 (§V-C), as one deterministic
//! state machine.
//!
//! Inputs: [`NodeCore::on_peer`], [`NodeCore::on_heartbeat`] (the CM's configuration),
//! [`NodeCore::on_client`], [`NodeCore::on_persisted`] (a durable append finished) and
//! [`NodeCore::tick`] (time passes). Outputs, drained with [`NodeCore::take_outputs`], must be
//! carried out in order: [`Output::Persist`] and [`Output::Mark`] go to the same log, in order.
//!
//! Per key a node keeps the newest timestamp and value it has applied, whether that version is
//! *valid* (committed: readable), whether it is *gdp* (globally durable, known from ACK_P / VAL_P),
//! the newest timestamp made locally durable, and at most one write it coordinates (a client
//! write, or a replay of someone else's write with its original timestamp).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::hash::{Hash, Hasher};

use std::sync::Arc;

use crate::pmlog::{ChunkPuts, LogChunk, LogCursor, LogRecord, LogState};
use crate::leaderless::proto::*;

/// Tunables of a node, with units in their names.
#[derive(Clone, Debug)]
pub struct NodeParams {
    pub id: NodeId,
    pub model: Model,
    /// Coordinator: re-broadcast INV (same timestamp) after this long without every ACK.
    pub inv_ack_timeout_us: u64,
    /// Follower: after this long invalid, resend the ACK; after twice as long, replay the write.
    pub ack_val_timeout_us: u64,
    /// Reads and new writes are served only within this long after this node sent the ack that
    /// the CM's last heartbeat naming it active echoes ([`Heartbeat::lease_ref`]); the CM waits
    /// longer than this after its last heartbeat before removing a silent node.
    pub lease_us: u64,
    /// The `lease_ref` of this core's first ack; each next ack takes the next number. A driver
    /// starting a core (a restart, or a reload after removal) must give it a value above every
    /// ref an earlier core of this node issued, or the CM's echo of an old ack could anchor the
    /// new core's lease: the runtime uses the wall clock in microseconds.
    pub first_lease_ref: u64,
    /// Recovery steps (Recov_start, CatchUp_req) are retried after this long without progress.
    pub recovery_retry_us: u64,
    /// Missed_updates cap: past it the buffer is dropped and recovery falls back to full copy.
    pub missed_updates_cap_bytes: usize,
    /// CatchUp_resp is cut into messages of at most this many bytes of entries.
    pub max_catchup_chunk_bytes: usize,
    /// The catch-up window, in chunks: granted to the Buddy (credits) and received but not yet
    /// durable in our log, together, at most (1 = strictly one chunk at a time; at most
    /// [`MAX_CATCHUP_CHUNKS_PER_REQ`]). Bounds the recovering node's unpersisted copy to about
    /// this many times `max_catchup_chunk_bytes`.
    pub max_catchup_chunks_in_flight: usize,
    /// Client operations queued behind invalid keys, in total.
    pub max_pending_client_ops: usize,
    /// Writes remembered per scope until its PERSIST.
    pub max_scope_writes: usize,
    /// How a returning node is brought up to date (HEAL, or the full-copy baseline).
    pub recovery: RecoveryScheme,
    /// Deliberately broken variant for `tests/model_check.rs` (shows the checker can fail): the
    /// coordinator does not wait for its followers' ACKs. Never set outside that test.
    #[doc(hidden)]
    pub fault_skip_ack_wait: bool,
}

/// Recovery scheme of the group (set the same on every node).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecoveryScheme {
    /// HEAL: the Buddy sends its Missed_updates (newest per key) and judges Partially_persisted.
    Heal,
    /// Baseline (Hermes-style): the recoverer streams its whole store to a new node (the
    /// drivers give the returning node an empty log: `FileLog::reset_as_new_node`), which makes
    /// every entry it receives durable.
    FullCopy,
    /// Baseline (ZooKeeper-style, §II-C): the recovering node sends the last configuration it
    /// was complete in (its newest `Epoch` log record); a peer reads its durable log from that
    /// point and streams every update, redundant ones included, until it reaches the end; the
    /// recovering node makes every one durable, as a ZooKeeper follower logs each transaction.
    /// Falls back to a full copy when the peer's log no longer reaches back that far.
    ReactiveLog,
}

impl RecoveryScheme {
    pub fn name(self) -> &'static str {
        match self {
            RecoveryScheme::Heal => "heal",
            RecoveryScheme::FullCopy => "full-copy",
            RecoveryScheme::ReactiveLog => "reactive-log",
        }
    }
}

impl NodeParams {
    /// Whether a node that was a member before (`booted`) returns as a new node with an empty
    /// log: the full-copy baseline's returning node (see [`RecoveryScheme::FullCopy`]). The
    /// drivers replace its log with one holding only its `Boot` record before the core starts.
    pub fn returns_as_new_node(&self, booted: bool) -> bool {
        booted && self.drops_state_on_return()
    }

    /// Whether this group's returning nodes drop their durable state (the full-copy
    /// baseline): only then do the drivers need to know, before rebuilding a node's log,
    /// whether it was a member.
    pub fn drops_state_on_return(&self) -> bool {
        self.recovery == RecoveryScheme::FullCopy
    }

    pub fn new(id: NodeId, model: Model) -> Self {
        NodeParams {
            id,
            model,
            inv_ack_timeout_us: 20_000,
            ack_val_timeout_us: 40_000,
            lease_us: 200_000,
            first_lease_ref: 1,
            recovery_retry_us: 200_000,
            missed_updates_cap_bytes: 64 << 20,
            max_catchup_chunk_bytes: 1 << 20,
            max_catchup_chunks_in_flight: 4,
            max_pending_client_ops: 10_000,
            max_scope_writes: 100_000,
            recovery: RecoveryScheme::Heal,
            fault_skip_ack_wait: false,
        }
    }
}

/// Timing of one HEAL recovery (the breakdown of Fig. 8), in microseconds of the driver's clock.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryStats {
    pub start_to_ack_us: u64,
    pub catchup_to_resp_us: u64,
    pub apply_to_end_us: u64,
    pub entries_received: u64,
    pub entries_applied: u64,
    pub bytes_received: u64,
    pub full_copy: bool,
    pub partially_persisted: u64,
    /// CatchUp_resp chunks received.
    pub chunks: u64,
    /// From the first CatchUp_resp to the last chunk's arrival (part of `apply_to_end_us`; the
    /// rest is waiting for the log to make the last chunks durable).
    pub transfer_us: u64,
    /// Time the Buddy had no credit because the whole window was received chunks still being
    /// persisted (the log, not the Buddy, was the bottleneck).
    pub window_stall_us: u64,
    /// CatchUp_req and CatchUp_credit messages sent, and the time from each that found the
    /// Buddy without credit to the next chunk, summed (the Buddy's queue, its chunk building and
    /// the network: what the recovering node waited for).
    pub requests: u64,
    pub request_wait_us: u64,
}

impl RecoveryStats {
    pub fn total_us(&self) -> u64 {
        self.start_to_ack_us + self.catchup_to_resp_us + self.apply_to_end_us
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    Send {
        to: NodeId,
        msg: PeerMsg,
    },
    ToCm(HeartbeatAck),
    /// Append durably, then call [`NodeCore::on_persisted`] with `seq`.
    Persist {
        seq: u64,
        rec: LogRecord,
    },
    /// Append a catch-up chunk's records durably, in order, then call
    /// [`NodeCore::on_persisted`] with `seq` (one append, one completion per chunk).
    PersistChunk {
        seq: u64,
        puts: ChunkPuts,
    },
    /// Append without waiting (a GDP flag, an `Epoch` record).
    Mark(LogRecord),
    /// Read the durable log at `cursor` (about `max_bytes` of updates, after every append
    /// output so far), then call [`NodeCore::on_log_read`] with `to` and `cursor`.
    ReadLog {
        to: NodeId,
        cursor: LogCursor,
        max_bytes: usize,
    },
    Reply {
        tag: u64,
        result: ClientResult,
    },
    /// This node was removed from the configuration: drop this core and build a new one from
    /// the log (its volatile state may be stale; it must recover like a restarted node).
    Reload,
    Recovered(RecoveryStats),
}

/// Counters for metrics and tests.
#[derive(Clone, Debug, Default)]
pub struct NodeCounters {
    pub refused_epoch: u64,
    pub replays_started: u64,
    pub inv_rebroadcasts: u64,
    pub writes_committed: u64,
    pub reads_served: u64,
    pub missed_updates_overflows: u64,
    pub catchup_served: u64,
}

#[derive(Clone, Debug)]
struct Coord {
    ts: Ts,
    value: Vec<u8>,
    client: Option<u64>,
    scope: Option<u64>,
    acks_c: BTreeSet<NodeId>,
    acks_p: BTreeSet<NodeId>,
    local_p: bool,
    replied: bool,
    val_c_sent: bool,
    deadline_us: u64,
    /// INV re-broadcasts so far: each waits twice as long as the one before (up to
    /// `MAX_INV_BACKOFF_SHIFT` doublings), so an overloaded group is not buried under them.
    retries: u32,
}

/// INV→ACK re-broadcasts back off exponentially up to `inv_ack_timeout_us << this`.
pub const MAX_INV_BACKOFF_SHIFT: u32 = 4;

#[derive(Clone, Debug, Default)]
struct KeyState {
    ts: Ts,
    value: Vec<u8>,
    valid: bool,
    gdp: bool,
    marked: Ts,
    durable: Ts,
    deadline_us: u64,
    timeouts: u32,
    /// Boxed: most keys have none, and every key pays for the slot.
    coord: Option<Box<Coord>>,
    pending_p: Vec<(NodeId, Ts)>,
    waiting: VecDeque<(u64, ClientOp)>,
}

#[derive(Clone, Debug)]
struct PersistOp {
    writes: Vec<(Vec<u8>, Ts)>,
    client: u64,
    acks: BTreeSet<NodeId>,
    deadline_us: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Phase {
    Start {
        acked: BTreeSet<NodeId>,
    },
    /// Stream `stream` from `buddy` is open (`open`; otherwise one is opened once the window
    /// has room) and its next chunk starts at `cursor`; `granted` chunks are credited to the
    /// Buddy and not received yet. `granted` plus the received chunks still being persisted
    /// (`Recov::chunks_unpersisted`) never exceed the window.
    CatchUp {
        buddy: NodeId,
        stream: u64,
        cursor: Cursor,
        open: bool,
        granted: u32,
    },
    Applying,
}

#[derive(Clone, Debug)]
struct Recov {
    phase: Phase,
    started_us: u64,
    acked_us: u64,
    resp_us: u64,
    deadline_us: u64,
    outstanding: BTreeSet<u64>,
    /// Per received chunk that is not yet durable, in cursor order: its log appends still out.
    chunks_unpersisted: VecDeque<BTreeSet<u64>>,
    /// Since when the Buddy has had no credit because of a full window (statistics only).
    stalled_since_us: Option<u64>,
    /// When credit went to a Buddy that had none, until its next chunk (statistics only).
    request_sent_us: Option<u64>,
    stats: RecoveryStats,
}

#[derive(Clone, Debug)]
enum Mode {
    /// Not (yet) a member: restarted on durable state, or never joined.
    Down,
    Member,
    Recovering(Box<Recov>),
    /// HEAL finished (Recov_end sent); waiting for the CM to make it active.
    Recovered,
}

#[derive(Clone, Debug, Default)]
struct Missed {
    recording: bool,
    overflowed: bool,
    /// Key to its newest update, in key order (a Buddy's chunks walk it in order), keys inline
    /// like the store's: recording a key already in the buffer allocates nothing.
    keys: BTreeMap<StoreKey, MissedUpdate>,
    bytes: usize,
}

/// The newest update of a key in Missed_updates: the store's version of the key, kept here
/// too (recorded wherever the store's version changes) so that a Buddy builds its chunks from
/// the buffer alone, without a lookup in the store per key (on a store of a million keys, a
/// large part of a chunk's build). Its bytes count against the buffer's cap.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
struct MissedUpdate {
    ts: Ts,
    value: Vec<u8>,
}

impl MissedUpdate {
    /// Bytes accounted against the Missed_updates cap.
    fn size(key_len: usize, value_len: usize) -> usize {
        key_len + value_len + 24
    }
}

/// A Buddy's chunk buffer is allocated up front up to this size (a larger chunk grows).
const MAX_CHUNK_PREALLOC_BYTES: usize = 4 << 20;

/// A key of the store, held inline up to 24 bytes (YCSB's `user` + 19 digits fit): a B-tree
/// lookup then compares keys inside its nodes instead of following a pointer per comparison to
/// a separate allocation (on a store of a million keys, that halves the cost of a lookup, which
/// dominates applying a catch-up), and a short key costs no allocation of its own.
type StoreKey = smallvec::SmallVec<[u8; 24]>;

/// (key, timestamp) pairs: a Partially_persisted list, the writes of a scope.
type KeyVersions = Vec<(Vec<u8>, Ts)>;

/// A key-ordered catch-up stream a Buddy serves (HEAL or full copy).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct KeyStream {
    stream: u64,
    /// The next chunk starts after this key (`None`: at the first).
    after: Option<Vec<u8>>,
    partially: KeyVersions,
    full_copy: bool,
    /// Chunks the recovering node has granted and not been sent yet.
    credits: u32,
    /// Chunks sent so far (their sizes ramp up: [`catchup_chunk_bytes`]).
    sent: u32,
}

/// A reactive-log catch-up stream a Buddy serves: the log is read by the driver, one chunk per
/// [`Output::ReadLog`], one read at a time.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct LogStream {
    stream: u64,
    /// Where the next read starts (the one in progress, if `reading`).
    cursor: LogCursor,
    /// Judged with the first chunk (taken then).
    partially: KeyVersions,
    /// Chunks granted and not sent yet (the one being read included).
    credits: u32,
    reading: bool,
    /// Chunks read so far (their sizes ramp up: [`catchup_chunk_bytes`]).
    sent: u32,
}

/// One replica. See the module docs.
#[derive(Clone)]
pub struct NodeCore {
    p: NodeParams,
    config: Config,
    mode: Mode,
    booted: bool,
    lease_until_us: u64,
    /// The ref the next ack to the CM takes.
    next_lease_ref: u64,
    /// Acks sent to the CM lately, oldest first: (lease_ref, when sent). An echoed ref found
    /// here anchors the lease; entries older than a lease anchor nothing and are dropped, and at
    /// most [`MAX_LEASE_REFS`] are kept.
    lease_refs: VecDeque<(u64, u64)>,
    store: BTreeMap<StoreKey, KeyState>,
    /// Keys with a coordinated write or not valid: the ones timers look at.
    unsettled: BTreeSet<Vec<u8>>,
    partially: Vec<(Vec<u8>, Ts)>,
    missed: Missed,
    next_seq: u64,
    inflight: BTreeMap<u64, (Vec<u8>, Ts)>,
    /// Durable appends of whole catch-up chunks ([`Output::PersistChunk`]): their Puts, and
    /// their offsets in key order. A chunk's keys take `durable` when applied and are not
    /// looked up again when it completes: until then [`Self::chunk_pending`] finds them here (a
    /// binary search per chunk) and their durability is not relied on.
    inflight_batches: BTreeMap<u64, (ChunkPuts, Vec<u32>)>,
    /// Keys whose durability was asked for while a pending chunk held them: what the chunk's
    /// completion looks at (owed ACK_Ps, a replay's local persist).
    durable_watch: BTreeSet<Vec<u8>>,
    pending_client_ops: usize,
    /// Keys with client ops queued (`KeyState::waiting` not empty): what a heartbeat re-serves,
    /// without a walk over the whole store.
    waiting_keys: BTreeSet<Vec<u8>>,
    scopes: BTreeMap<u64, Vec<(Vec<u8>, Ts)>>,
    persist_ops: BTreeMap<u64, PersistOp>,
    next_persist_id: u64,
    /// Scope PERSISTs of other coordinators waiting for local durability: (from, id, writes).
    persist_waits: Vec<(NodeId, u64, KeyVersions)>,
    /// Client tags seen lately: a request delivered twice must not write twice.
    recent_tags: BTreeSet<u64>,
    recent_order: VecDeque<u64>,
    /// Newest `Epoch` record in the log (reactive-log baseline only).
    last_epoch: u64,
    /// Reactive-log catch-up streams being served, per recovering node.
    log_reads: BTreeMap<NodeId, LogStream>,
    /// Key-ordered catch-up streams being served (HEAL or full copy), per recovering node: one
    /// chunk per credit, one per [`NodeCore::pump`].
    streams: BTreeMap<NodeId, KeyStream>,
    /// Id of the next catch-up stream this node opens as a recovering node.
    next_stream: u64,
    out: Vec<Output>,
    pub counters: NodeCounters,
}

/// Credits a Buddy holds for one stream at most, and the largest catch-up window (a request or
/// credit grants as many as the recovering node's window has room for).
pub const MAX_CATCHUP_CHUNKS_PER_REQ: u32 = 64;

/// The first chunk of a catch-up stream holds at most this many bytes of entries, each next one
/// twice as many, up to `max_catchup_chunk_bytes`: the recovering node starts applying and
/// logging after a small chunk's build and transfer instead of a full one's (the pipeline's
/// fill time is part of every recovery's latency), while later chunks keep the per-chunk
/// costs low.
pub const FIRST_CATCHUP_CHUNK_BYTES: usize = 64 << 10;

/// Bytes of entries the chunk after `sent` earlier ones of a stream may hold.
fn catchup_chunk_bytes(max_bytes: usize, sent: u32) -> usize {
    let ramped = (FIRST_CATCHUP_CHUNK_BYTES as u64).saturating_mul(1 << sent.min(40));
    ramped.min(max_bytes as u64) as usize
}

/// Client tags remembered for duplicate suppression.
pub const RECENT_CLIENT_TAGS: usize = 4096;

/// Acks to the CM remembered for lease anchoring (one per heartbeat: 1,024 cover a lease of
/// some seconds at the paper's 4 ms heartbeat).
pub const MAX_LEASE_REFS: usize = 1024;

impl NodeCore {
    /// A node starting on what its log holds. It serves nothing until a configuration admits
    /// it: as a genesis member if its log has never booted, otherwise through HEAL recovery.
    pub fn new(p: NodeParams, log: LogState) -> Self {
        let partially = log
            .partially
            .iter()
            .map(|(k, (ts, _))| (k.clone(), *ts))
            .collect();
        let (booted, last_epoch) = (log.booted, log.last_epoch);
        let next_lease_ref = p.first_lease_ref.max(1);
        // Built in one go from the sorted base: full tree nodes (a store-sized saving over
        // node-by-node inserts), and the scaffolding is one large block, handed back whole.
        let store: BTreeMap<StoreKey, KeyState> = log
            .base
            .into_iter()
            .map(|(k, (ts, v))| {
                let ks = KeyState {
                    ts,
                    value: v,
                    valid: true,
                    gdp: false,
                    marked: ts,
                    durable: ts,
                    ..Default::default()
                };
                (StoreKey::from_slice(&k), ks)
            })
            .collect();
        NodeCore {
            config: Config {
                epoch: 0,
                nodes: Vec::new(),
                active: BTreeSet::new(),
                recovering: BTreeSet::new(),
            },
            p,
            mode: Mode::Down,
            booted,
            lease_until_us: 0,
            next_lease_ref,
            lease_refs: VecDeque::new(),
            store,
            unsettled: BTreeSet::new(),
            partially,
            missed: Missed::default(),
            next_seq: 0,
            inflight: BTreeMap::new(),
            inflight_batches: BTreeMap::new(),
            durable_watch: BTreeSet::new(),
            pending_client_ops: 0,
            waiting_keys: BTreeSet::new(),
            scopes: BTreeMap::new(),
            persist_ops: BTreeMap::new(),
            next_persist_id: 0,
            persist_waits: Vec::new(),
            recent_tags: BTreeSet::new(),
            recent_order: VecDeque::new(),
            last_epoch,
            log_reads: BTreeMap::new(),
            streams: BTreeMap::new(),
            next_stream: 1,
            out: Vec::new(),
            counters: NodeCounters::default(),
        }
    }

    pub fn id(&self) -> NodeId {
        self.p.id
    }
    pub fn model(&self) -> Model {
        self.p.model
    }
    pub fn epoch(&self) -> u64 {
        self.config.epoch
    }
    pub fn config(&self) -> &Config {
        &self.config
    }
    pub fn take_outputs(&mut self) -> Vec<Output> {
        std::mem::take(&mut self.out)
    }
    pub fn is_member_mode(&self) -> bool {
        matches!(self.mode, Mode::Member)
    }
    pub fn is_recovering(&self) -> bool {
        matches!(self.mode, Mode::Recovering(_) | Mode::Recovered)
    }
    /// Whether client operations are accepted now.
    pub fn serving(&self, now_us: u64) -> bool {
        matches!(self.mode, Mode::Member)
            && self.config.active.contains(&self.p.id)
            && now_us < self.lease_until_us
    }
    /// Bytes the Missed_updates buffer accounts for.
    pub fn missed_updates_bytes(&self) -> usize {
        self.missed.bytes
    }
    pub fn missed_updates_keys(&self) -> usize {
        self.missed.keys.len()
    }
    pub fn keys(&self) -> usize {
        self.store.len()
    }
    /// Volatile (timestamp, valid) of every key, for invariant checks.
    pub fn snapshot(&self) -> BTreeMap<Vec<u8>, (Ts, bool, Vec<u8>)> {
        self.store
            .iter()
            .filter(|(_, k)| k.ts != Ts::default())
            .map(|(key, k)| (key.to_vec(), (k.ts, k.valid, k.value.clone())))
            .collect()
    }
    /// Hashes the protocol state for model checking (`tests/model_check.rs`): everything that
    /// decides future behaviour except timers, the lease, counters and drained outputs, which the
    /// checker abstracts (it fires timeouts by jumping time past every deadline). Timeout counts
    /// are hashed saturated at 2 since only `== 1` matters.
    pub fn model_fingerprint<H: Hasher>(&self, h: &mut H) {
        let c = &self.config;
        (c.epoch, &c.nodes, &c.active, &c.recovering, self.booted).hash(h);
        match &self.mode {
            Mode::Down => 0u8.hash(h),
            Mode::Member => 1u8.hash(h),
            Mode::Recovering(r) => (2u8, &r.phase, &r.outstanding, &r.chunks_unpersisted).hash(h),
            Mode::Recovered => 3u8.hash(h),
        }
        for (key, k) in &self.store {
            (
                key,
                k.ts,
                &k.value,
                k.valid,
                k.gdp,
                k.marked,
                k.durable,
                k.timeouts.min(2),
            )
                .hash(h);
            match &k.coord {
                None => 0u8.hash(h),
                Some(co) => {
                    (
                        1u8, co.ts, &co.value, co.client, co.scope, &co.acks_c, &co.acks_p,
                    )
                        .hash(h);
                    (co.local_p, co.replied, co.val_c_sent).hash(h);
                }
            }
            (
                &k.pending_p,
                k.waiting.iter().map(|(t, _)| *t).collect::<Vec<_>>(),
            )
                .hash(h);
        }
        (&self.unsettled, &self.partially).hash(h);
        (
            self.missed.recording,
            self.missed.overflowed,
            &self.missed.keys,
        )
            .hash(h);
        (
            self.next_seq,
            &self.inflight,
            &self.inflight_batches,
            &self.durable_watch,
            self.pending_client_ops,
            &self.scopes,
        )
            .hash(h);
        for (id, op) in &self.persist_ops {
            (id, &op.writes, op.client, &op.acks).hash(h);
        }
        (self.next_persist_id, &self.persist_waits, &self.recent_tags).hash(h);
        (
            self.last_epoch,
            &self.log_reads,
            &self.streams,
            self.next_stream,
        )
            .hash(h);
    }
    /// The protocol state of one key, for diagnosing a failing simulation seed.
    #[doc(hidden)]
    pub fn debug_key(&self, key: &[u8]) -> String {
        let Some(k) = self.store.get(key) else {
            return "absent".into();
        };
        format!(
            "ts {} valid {} gdp {} durable {} marked {} timeouts {} deadline {} coord {:?} pending_p {:?} waiting {} unsettled {} mode {:?}",
            k.ts, k.valid, k.gdp, k.durable, k.marked, k.timeouts, k.deadline_us,
            k.coord.as_ref().map(|c| (c.ts, c.client, &c.acks_c, &c.acks_p, c.local_p, c.replied, c.val_c_sent, c.deadline_us)),
            k.pending_p, k.waiting.len(), self.unsettled.contains(key), self.mode
        )
    }
    /// Volatile timestamp of `key` (default if absent), for invariant checks.
    pub fn key_ts(&self, key: &[u8]) -> Ts {
        self.store.get(key).map(|k| k.ts).unwrap_or_default()
    }
    /// Bytes of keys and values held.
    pub fn stored_bytes(&self) -> usize {
        self.store
            .iter()
            .map(|(k, s)| k.len() + s.value.len())
            .sum()
    }

    fn others(&self) -> Vec<NodeId> {
        let me = self.p.id;
        self.config.members().filter(|&n| n != me).collect()
    }

    fn send(&mut self, to: NodeId, msg: PeerMsg) {
        self.out.push(Output::Send { to, msg });
    }

    fn broadcast(&mut self, msg: PeerMsg) {
        for n in self.others() {
            self.send(n, msg.clone());
        }
    }

    fn persist(&mut self, key: &[u8], ts: Ts, value: &[u8]) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.inflight.insert(seq, (key.to_vec(), ts));
        self.out.push(Output::Persist {
            seq,
            rec: LogRecord::Put {
                key: key.to_vec(),
                ts,
                value: value.to_vec(),
            },
        });
        seq
    }

    fn status(&self) -> NodeStatus {
        match self.mode {
            Mode::Down => NodeStatus::WantsJoin,
            Mode::Recovered => NodeStatus::Recovered,
            Mode::Member | Mode::Recovering(_) => NodeStatus::Member,
        }
    }

    /// Records that `key` now has version `ts` with `value` in the store (called wherever the
    /// store's version of a key changes).
    fn record_missed(&mut self, key: &[u8], ts: Ts, value: &[u8]) {
        if !self.missed.recording || self.missed.overflowed {
            return;
        }
        let size = MissedUpdate::size(key.len(), value.len());
        let old = match self.missed.keys.get_mut(key) {
            Some(m) => {
                let old = MissedUpdate::size(key.len(), m.value.len());
                m.ts = ts;
                m.value.clear();
                m.value.extend_from_slice(value);
                old
            }
            None => {
                let m = MissedUpdate {
                    ts,
                    value: value.to_vec(),
                };
                self.missed.keys.insert(StoreKey::from_slice(key), m);
                0
            }
        };
        self.missed.bytes = self.missed.bytes + size - old;
        if self.missed.bytes > self.p.missed_updates_cap_bytes {
            // Past the cap the buffer is useless: drop it, the Buddy will send a full copy.
            self.missed.overflowed = true;
            self.missed.keys.clear();
            self.missed.bytes = 0;
            self.counters.missed_updates_overflows += 1;
        }
    }

    /// Sets the GDP flag of the current version in the log once it is committed or durable.
    fn mark_if_needed(&mut self, key: &[u8]) {
        let Some(k) = self.store.get_mut(key) else {
            return;
        };
        if (k.valid || k.gdp) && k.marked < k.ts && k.ts != Ts::default() {
            k.marked = k.ts;
            let ts = k.ts;
            self.out.push(Output::Mark(LogRecord::Mark {
                key: key.to_vec(),
                ts,
            }));
        }
    }

    // ---------------------------------------------------------------- configuration

    /// After every input in debug builds: the epoch never decreases, and the invariants hold.
    #[cfg(debug_assertions)]
    fn check_after_input(&self, epoch_before: u64) {
        assert!(
            self.config.epoch >= epoch_before,
            "node {}: invariant `the configuration epoch never decreases` broken: {epoch_before} -> {}",
            self.p.id,
            self.config.epoch
        );
        self.check_invariants();
    }

    /// Panics, naming the invariant and the state, if the node's state breaks a rule the module
    /// and field docs state. Cheap: O(keys with queued client ops + unsettled keys + in-flight
    /// appends), never a walk over the store. Run after every input in debug builds and after
    /// every step of the simulation.
    pub fn check_invariants(&self) {
        let me = self.p.id;
        let broken = |what: &str, state: String| -> ! {
            panic!("node {me}: invariant `{what}` broken: {state}")
        };
        // Membership: a node serves as a member only while the configuration lists it as a
        // member that is not recovering; a recovering node is not in the active set.
        let (member, active, recovering) = (
            self.config.is_member(me),
            self.config.active.contains(&me),
            self.config.recovering.contains(&me),
        );
        match &self.mode {
            Mode::Member if !member || recovering => broken(
                "a Member node is a member of its configuration, not recovering",
                format!("{:?}", self.config),
            ),
            Mode::Recovering(_) | Mode::Recovered if !member || active => broken(
                "a recovering node is a member and not active",
                format!("{:?} in {:?}", self.mode_name(), self.config),
            ),
            _ => {}
        }
        // Leases: no lease without an ack it counts from; refs strictly increase (looked up by
        // binary search); at most MAX_LEASE_REFS remembered.
        if self.lease_refs.len() > MAX_LEASE_REFS {
            broken(
                "lease refs within MAX_LEASE_REFS",
                format!("{}", self.lease_refs.len()),
            );
        }
        if self
            .lease_refs
            .iter()
            .zip(self.lease_refs.iter().skip(1))
            .any(|(a, b)| a.0 >= b.0)
        {
            broken(
                "lease refs strictly increase",
                format!("{:?}", self.lease_refs),
            );
        }
        if self
            .lease_refs
            .back()
            .is_some_and(|(r, _)| *r >= self.next_lease_ref)
        {
            broken(
                "lease refs are below the next one",
                format!(
                    "next {} refs {:?}",
                    self.next_lease_ref,
                    self.lease_refs.back()
                ),
            );
        }
        // Client operations: queued ones within max_pending_client_ops, each on a key listed in
        // waiting_keys; duplicate suppression within RECENT_CLIENT_TAGS.
        if self.pending_client_ops > self.p.max_pending_client_ops.max(1) {
            broken(
                "queued client ops within max_pending_client_ops",
                format!(
                    "{} > {}",
                    self.pending_client_ops, self.p.max_pending_client_ops
                ),
            );
        }
        let queued: usize = self
            .waiting_keys
            .iter()
            .map(|k| self.store.get(&k[..]).map_or(0, |ks| ks.waiting.len()))
            .sum();
        if queued != self.pending_client_ops {
            broken(
                "pending_client_ops counts the ops queued on waiting_keys",
                format!("counted {} queued {queued}", self.pending_client_ops),
            );
        }
        if self.recent_tags.len() != self.recent_order.len()
            || self.recent_order.len() > RECENT_CLIENT_TAGS
        {
            broken(
                "recent client tags within RECENT_CLIENT_TAGS, set and order alike",
                format!(
                    "set {} order {}",
                    self.recent_tags.len(),
                    self.recent_order.len()
                ),
            );
        }
        // Unsettled keys (those timers look at) are keys of the store.
        if let Some(k) = self
            .unsettled
            .iter()
            .find(|k| !self.store.contains_key(&k[..]))
        {
            broken(
                "unsettled keys are in the store",
                format!("{:?}", String::from_utf8_lossy(k)),
            );
        }
        // Scopes hold at most max_scope_writes writes each.
        if let Some((id, w)) = self
            .scopes
            .iter()
            .find(|(_, w)| w.len() > self.p.max_scope_writes.max(1))
        {
            broken(
                "scope writes within max_scope_writes",
                format!("scope {id}: {}", w.len()),
            );
        }
        // Log appends in flight were issued (seqs below the next).
        if let Some(seq) = self
            .inflight
            .keys()
            .chain(self.inflight_batches.keys())
            .find(|s| **s >= self.next_seq)
        {
            broken(
                "appends in flight were issued",
                format!("seq {seq}, next {}", self.next_seq),
            );
        }
        // Missed_updates: an overflowed buffer is dropped; otherwise it stays within its cap;
        // it holds nothing unless recording.
        let m = &self.missed;
        if m.overflowed && (m.bytes != 0 || !m.keys.is_empty()) {
            broken(
                "an overflowed Missed_updates buffer is empty",
                format!("{} bytes, {} keys", m.bytes, m.keys.len()),
            );
        }
        if m.bytes > self.p.missed_updates_cap_bytes {
            broken(
                "Missed_updates within missed_updates_cap_bytes",
                format!("{} > {}", m.bytes, self.p.missed_updates_cap_bytes),
            );
        }
        if !m.recording && !m.keys.is_empty() {
            broken(
                "Missed_updates holds updates only while recording",
                format!("{} keys", m.keys.len()),
            );
        }
        // Catch-up: the window (chunks granted plus received and not yet durable) never exceeds
        // max_catchup_chunks_in_flight; a Buddy holds at most MAX_CATCHUP_CHUNKS_PER_REQ credits.
        if let Mode::Recovering(r) = &self.mode {
            if let Phase::CatchUp { granted, .. } = &r.phase {
                let used = *granted as usize + r.chunks_unpersisted.len();
                if used > self.window_chunks() as usize {
                    broken(
                        "catch-up window within max_catchup_chunks_in_flight",
                        format!(
                            "granted {granted} + unpersisted {} > {}",
                            r.chunks_unpersisted.len(),
                            self.window_chunks()
                        ),
                    );
                }
            }
        }
        for (to, st) in &self.streams {
            if st.credits > MAX_CATCHUP_CHUNKS_PER_REQ {
                broken(
                    "a Buddy's credits within MAX_CATCHUP_CHUNKS_PER_REQ",
                    format!("stream to {to}: {}", st.credits),
                );
            }
        }
        for (to, st) in &self.log_reads {
            if st.credits > MAX_CATCHUP_CHUNKS_PER_REQ {
                broken(
                    "a Buddy's credits within MAX_CATCHUP_CHUNKS_PER_REQ",
                    format!("log stream to {to}: {}", st.credits),
                );
            }
        }
    }

    /// The checks that walk the whole store (O(keys)): too dear after every input of a real
    /// node, run by the simulation (a few keys) after every step. Also runs
    /// [`Self::check_invariants`].
    pub fn check_invariants_deep(&self) {
        self.check_invariants();
        let me = self.p.id;
        let broken = |what: &str, state: String| -> ! {
            panic!("node {me}: invariant `{what}` broken: {state}")
        };
        for (key, k) in &self.store {
            // Timers look only at unsettled keys: a key with a coordinated write, or invalid,
            // must be one, or nothing would ever retry or replay it.
            if (k.coord.is_some() || !k.valid) && !self.unsettled.contains(&key[..]) {
                broken(
                    "a key with a coordinated write or not valid is unsettled",
                    self.debug_key(key),
                );
            }
            // A heartbeat re-serves only waiting_keys: a key with queued ops must be one.
            if !k.waiting.is_empty() && !self.waiting_keys.contains(&key[..]) {
                broken(
                    "a key with queued client ops is in waiting_keys",
                    self.debug_key(key),
                );
            }
        }
        // Missed_updates accounts exactly the updates it holds.
        if !self.missed.overflowed {
            let bytes: usize = self
                .missed
                .keys
                .iter()
                .map(|(k, u)| MissedUpdate::size(k.len(), u.value.len()))
                .sum();
            if bytes != self.missed.bytes {
                broken(
                    "Missed_updates bytes account its updates",
                    format!("counted {} held {bytes}", self.missed.bytes),
                );
            }
        }
    }

    fn mode_name(&self) -> &'static str {
        match &self.mode {
            Mode::Down => "Down",
            Mode::Member => "Member",
            Mode::Recovering(_) => "Recovering",
            Mode::Recovered => "Recovered",
        }
    }

    /// A heartbeat from the CM carrying its configuration.
    pub fn on_heartbeat(&mut self, now_us: u64, hb: Heartbeat) {
        #[cfg(debug_assertions)]
        let epoch_before = self.config.epoch;
        self.on_heartbeat_input(now_us, hb);
        #[cfg(debug_assertions)]
        self.check_after_input(epoch_before);
    }

    fn on_heartbeat_input(&mut self, now_us: u64, hb: Heartbeat) {
        let me = self.p.id;
        if hb.config.epoch > self.config.epoch {
            self.adopt(now_us, hb.config.clone());
        }
        if hb.config.epoch == self.config.epoch && self.config.is_member(me) {
            // The lease counts from when we sent the ack this heartbeat echoes, not from now:
            // the CM sent the heartbeat after it got that ack, and waits out a lease from its
            // last heartbeat before removing us, so the lease ends in time even if this
            // heartbeat waited in our socket while we were stopped.
            if let Some(sent) = self.lease_anchor(hb.lease_ref) {
                self.lease_until_us = self.lease_until_us.max(sent + self.p.lease_us);
            }
        }
        let ack = HeartbeatAck {
            node: me,
            epoch: self.config.epoch,
            seq: hb.seq,
            status: self.status(),
            lease_ref: self.next_ack_ref(now_us),
        };
        self.out.push(Output::ToCm(ack));
        if matches!(self.mode, Mode::Member) {
            self.serve_all_waiting(now_us);
        }
    }

    /// When we sent the ack named `lease_ref`, if it is one of this core's recent acks.
    fn lease_anchor(&self, lease_ref: u64) -> Option<u64> {
        let i = self
            .lease_refs
            .binary_search_by_key(&lease_ref, |(r, _)| *r)
            .ok()?;
        Some(self.lease_refs[i].1)
    }

    /// The ref of an ack sent now, remembered for [`Self::lease_anchor`].
    fn next_ack_ref(&mut self, now_us: u64) -> u64 {
        let r = self.next_lease_ref;
        self.next_lease_ref += 1;
        while self.lease_refs.len() >= MAX_LEASE_REFS
            || self
                .lease_refs
                .front()
                .is_some_and(|(_, t)| t + self.p.lease_us < now_us)
        {
            self.lease_refs.pop_front();
        }
        self.lease_refs.push_back((r, now_us));
        r
    }

    /// The ref of this core's newest ack (0: none yet): what a CM that got it echoes.
    pub fn last_lease_ref(&self) -> u64 {
        self.lease_refs.back().map_or(0, |(r, _)| *r)
    }

    fn adopt(&mut self, now_us: u64, cfg: Config) {
        let me = self.p.id;
        self.config = cfg;
        // Every configuration change restarts a recovery, which asks again.
        self.streams.clear();
        let member = self.config.is_member(me);
        let active = self.config.active.contains(&me);
        let recovering = self.config.recovering.contains(&me);
        match &self.mode {
            Mode::Down => {
                if active && !self.booted {
                    // Genesis: a node that never booted and was never removed (it is still
                    // listed active) missed nothing: no write completes without its ACK. The
                    // Boot record goes to the log before anything this node acks.
                    for k in self.store.values_mut() {
                        k.gdp = true; // the shared initial state is durable everywhere
                    }
                    self.booted = true;
                    let seq = self.next_seq;
                    self.next_seq += 1;
                    self.out.push(Output::Persist {
                        seq,
                        rec: LogRecord::Boot { node: me },
                    });
                    self.mode = Mode::Member;
                } else if recovering {
                    let boot = if !self.booted {
                        self.booted = true;
                        let seq = self.next_seq;
                        self.next_seq += 1;
                        self.out.push(Output::Persist {
                            seq,
                            rec: LogRecord::Boot { node: me },
                        });
                        Some(seq)
                    } else {
                        None
                    };
                    self.start_recovery(now_us);
                    if let (Some(seq), Mode::Recovering(r)) = (boot, &mut self.mode) {
                        // Recov_end only once the Boot record is durable.
                        r.outstanding.insert(seq);
                    }
                }
                // Listed active but restarted: stay down; the CM removes us on WantsJoin.
            }
            Mode::Member => {
                if !member || recovering {
                    self.reload();
                    return;
                }
            }
            Mode::Recovering(_) => {
                if !member {
                    self.reload();
                    return;
                }
                if active {
                    self.mode = Mode::Member;
                } else {
                    // The configuration changed under the recovery: redo it (§VI, TL5).
                    self.start_recovery(now_us);
                }
            }
            Mode::Recovered => {
                if !member {
                    self.reload();
                    return;
                }
                if active {
                    self.mode = Mode::Member;
                }
            }
        }
        if matches!(self.mode, Mode::Down) {
            return;
        }
        if self.p.recovery == RecoveryScheme::ReactiveLog
            && matches!(self.mode, Mode::Member)
            && active
            && self.config.epoch > self.last_epoch
        {
            // The reactive baseline's log id: every update applied from now on follows it.
            self.last_epoch = self.config.epoch;
            let whole = !self.config.degraded();
            self.out.push(Output::Mark(LogRecord::Epoch {
                epoch: self.config.epoch,
                whole,
            }));
        }
        // Missed_updates: seeded with everything not yet globally durable when the group first
        // loses a node, then fed by every update applied while it runs degraded.
        if matches!(self.mode, Mode::Member) {
            if self.config.degraded() {
                if !self.missed.recording {
                    self.missed.recording = true;
                    let seeds: Vec<(Vec<u8>, Ts, Vec<u8>)> = self
                        .store
                        .iter()
                        .filter(|(_, k)| !k.gdp && k.ts != Ts::default())
                        .map(|(key, k)| (key.to_vec(), k.ts, k.value.clone()))
                        .collect();
                    for (k, ts, v) in seeds {
                        self.record_missed(&k, ts, &v);
                    }
                }
            } else {
                self.missed = Missed::default();
            }
        } else if self.config.degraded() {
            // A recovering node does not know what happened while it was away, so its buffer
            // cannot be trusted if it is later asked to be someone's Buddy: it answers with a
            // full copy instead (rare: concurrent failures, §VI).
            self.missed.recording = true;
            self.missed.overflowed = true;
            self.missed.keys.clear();
            self.missed.bytes = 0;
        }
        // In-flight writes and PERSISTs restart with the new membership (same timestamps).
        let keys: Vec<Vec<u8>> = self.unsettled.iter().cloned().collect();
        let epoch = self.config.epoch;
        for key in keys {
            let k = self.store.get_mut(&key[..]).unwrap();
            if let Some(c) = &mut k.coord {
                c.acks_c.clear();
                c.acks_p.clear();
                c.retries = 0;
                c.deadline_us = now_us + self.p.inv_ack_timeout_us;
                let msg = PeerMsg::Inv {
                    epoch,
                    key: key.clone(),
                    ts: c.ts,
                    value: c.value.clone(),
                };
                self.broadcast(msg);
                self.advance(now_us, &key);
            } else if !k.valid {
                // The coordinator may be gone (Table III): react soon.
                k.deadline_us = now_us + self.p.ack_val_timeout_us / 2 + (me as u64) * 1_000;
                k.timeouts = k.timeouts.max(1);
            }
        }
        let ids: Vec<u64> = self.persist_ops.keys().copied().collect();
        for id in ids {
            let op = self.persist_ops.get_mut(&id).unwrap();
            op.acks.clear();
            op.deadline_us = now_us + self.p.inv_ack_timeout_us;
            let msg = PeerMsg::PersistReq {
                epoch,
                id,
                writes: op.writes.clone(),
            };
            self.broadcast(msg);
            self.check_persist_op(id);
        }
        if matches!(self.mode, Mode::Member) && active {
            // What a Recov_start would be answered with, sent as soon as we know: a recovering
            // node that adopted this configuration before us would otherwise have its
            // Recov_start refused (an epoch we do not know yet) and wait for its retry.
            let recovering: Vec<NodeId> = self
                .config
                .recovering
                .iter()
                .copied()
                .filter(|n| *n != me)
                .collect();
            for n in recovering {
                self.send(n, PeerMsg::RecovStartAck { epoch });
            }
        }
    }

    fn reload(&mut self) {
        // Queued client ops were never started: tell their clients to go elsewhere. Writes in
        // flight get no answer (their outcome is unknown).
        let mut replies = Vec::new();
        for key in std::mem::take(&mut self.waiting_keys) {
            if let Some(k) = self.store.get_mut(&key[..]) {
                replies.extend(k.waiting.drain(..).map(|(tag, _)| tag));
            }
        }
        self.pending_client_ops = 0;
        for tag in replies {
            self.out.push(Output::Reply {
                tag,
                result: ClientResult::NotServing,
            });
        }
        self.mode = Mode::Down;
        self.out.push(Output::Reload);
    }

    // ---------------------------------------------------------------- clients

    /// A client operation; the answer comes as [`Output::Reply`] with the same `tag`.
    pub fn on_client(&mut self, now_us: u64, tag: u64, op: ClientOp) {
        #[cfg(debug_assertions)]
        let epoch_before = self.config.epoch;
        self.on_client_input(now_us, tag, op);
        #[cfg(debug_assertions)]
        self.check_after_input(epoch_before);
    }

    fn on_client_input(&mut self, now_us: u64, tag: u64, op: ClientOp) {
        if !self.recent_tags.insert(tag) {
            return; // a duplicate delivery of a request already taken
        }
        self.recent_order.push_back(tag);
        if self.recent_order.len() > RECENT_CLIENT_TAGS {
            let old = self.recent_order.pop_front().unwrap();
            self.recent_tags.remove(&old);
        }
        let bad = match &op {
            ClientOp::Get { key } => key.len() > MAX_KEY_BYTES || key.is_empty(),
            ClientOp::Put { key, value, .. } => {
                key.len() > MAX_KEY_BYTES || key.is_empty() || value.len() > MAX_VALUE_BYTES
            }
            ClientOp::Persist { .. } => false,
        };
        if bad {
            self.reply(
                tag,
                ClientResult::Invalid(format!(
                "key must be 1..={MAX_KEY_BYTES} bytes and value at most {MAX_VALUE_BYTES} bytes"
            )),
            );
            return;
        }
        if !self.serving(now_us) {
            self.reply(tag, ClientResult::NotServing);
            return;
        }
        if let ClientOp::Persist { scope } = op {
            self.start_persist(now_us, tag, scope);
            return;
        }
        let key = match &op {
            ClientOp::Get { key } | ClientOp::Put { key, .. } => key.clone(),
            ClientOp::Persist { .. } => unreachable!(),
        };
        let ready = match self.store.get(&key[..]) {
            None => true,
            Some(k) => k.valid && k.waiting.is_empty() && !self.coord_blocks(k),
        };
        if ready {
            self.execute(now_us, tag, op);
        } else if self.pending_client_ops >= self.p.max_pending_client_ops {
            self.reply(tag, ClientResult::Busy);
        } else {
            self.pending_client_ops += 1;
            self.store
                .get_mut(&key[..])
                .unwrap()
                .waiting
                .push_back((tag, op));
            self.waiting_keys.insert(key);
        }
    }

    fn coord_blocks(&self, k: &KeyState) -> bool {
        match &k.coord {
            None => false,
            // A write waiting only for its background durability does not block the next one.
            Some(c) => !(c.replied && c.val_c_sent),
        }
    }

    fn reply(&mut self, tag: u64, result: ClientResult) {
        self.out.push(Output::Reply { tag, result });
    }

    fn execute(&mut self, now_us: u64, tag: u64, op: ClientOp) {
        match op {
            ClientOp::Get { key } => {
                self.counters.reads_served += 1;
                let v = self
                    .store
                    .get(&key[..])
                    .filter(|k| k.ts != Ts::default())
                    .map(|k| k.value.clone());
                self.reply(tag, ClientResult::Value(v));
            }
            ClientOp::Put { key, value, scope } => {
                if self.p.model == Model::Scope {
                    if let Some(s) = scope {
                        let n = self.scopes.get(&s).map_or(0, |v| v.len());
                        if n >= self.p.max_scope_writes {
                            self.reply(tag, ClientResult::Busy);
                            return;
                        }
                    }
                }
                let me = self.p.id;
                let k = self
                    .store
                    .entry(StoreKey::from_slice(&key))
                    .or_insert_with(|| KeyState {
                        valid: true,
                        ..Default::default()
                    });
                let ts = Ts {
                    version: k.ts.version + 1,
                    node: me,
                };
                k.ts = ts;
                k.value = value.clone();
                k.valid = false;
                k.gdp = false;
                k.timeouts = 0;
                k.deadline_us = u64::MAX;
                k.coord = Some(Box::new(Coord {
                    ts,
                    value: value.clone(),
                    client: Some(tag),
                    scope: if self.p.model == Model::Scope {
                        scope
                    } else {
                        None
                    },
                    acks_c: BTreeSet::new(),
                    acks_p: BTreeSet::new(),
                    local_p: false,
                    replied: false,
                    val_c_sent: false,
                    deadline_us: now_us + self.p.inv_ack_timeout_us,
                    retries: 0,
                }));
                self.unsettled.insert(key.clone());
                self.persist(&key, ts, &value);
                self.record_missed(&key, ts, &value);
                let msg = PeerMsg::Inv {
                    epoch: self.config.epoch,
                    key: key.clone(),
                    ts,
                    value,
                };
                self.broadcast(msg);
                self.advance(now_us, &key);
            }
            ClientOp::Persist { .. } => unreachable!(),
        }
    }

    fn serve_waiting(&mut self, now_us: u64, key: &[u8]) {
        loop {
            let Some(k) = self.store.get_mut(key) else {
                return;
            };
            if !k.valid || self.coord_blocks_key(key) {
                return;
            }
            let k = self.store.get_mut(key).unwrap();
            let Some((tag, op)) = k.waiting.pop_front() else {
                return;
            };
            if k.waiting.is_empty() {
                self.waiting_keys.remove(key);
            }
            self.pending_client_ops -= 1;
            if !self.serving(now_us) {
                self.reply(tag, ClientResult::NotServing);
                continue;
            }
            self.execute(now_us, tag, op);
        }
    }

    fn coord_blocks_key(&self, key: &[u8]) -> bool {
        self.store.get(key).is_some_and(|k| self.coord_blocks(k))
    }

    fn serve_all_waiting(&mut self, now_us: u64) {
        if self.pending_client_ops == 0 {
            return;
        }
        let keys: Vec<Vec<u8>> = self.waiting_keys.iter().cloned().collect();
        for key in keys {
            self.serve_waiting(now_us, &key);
        }
    }

    fn start_persist(&mut self, now_us: u64, tag: u64, scope: u64) {
        if self.p.model != Model::Scope {
            // Every other model makes writes durable on its own schedule: nothing to wait for
            // beyond what each write's answer already promised.
            self.reply(tag, ClientResult::Done);
            return;
        }
        let writes = self.scopes.remove(&scope).unwrap_or_default();
        let id = self.next_persist_id;
        self.next_persist_id += 1;
        self.persist_ops.insert(
            id,
            PersistOp {
                writes: writes.clone(),
                client: tag,
                acks: BTreeSet::new(),
                deadline_us: now_us + self.p.inv_ack_timeout_us,
            },
        );
        let msg = PeerMsg::PersistReq {
            epoch: self.config.epoch,
            id,
            writes,
        };
        self.broadcast(msg);
        self.check_persist_op(id);
    }

    fn all_durable(&self, writes: &[(Vec<u8>, Ts)]) -> bool {
        writes.iter().all(|(k, ts)| {
            self.store.get(&k[..]).is_some_and(|s| s.durable >= *ts) && !self.chunk_pending(k)
        })
    }

    fn check_persist_op(&mut self, id: u64) {
        let Some(op) = self.persist_ops.get(&id) else {
            return;
        };
        let others = self.others();
        if !others.iter().all(|n| op.acks.contains(n)) || !self.all_durable(&op.writes) {
            return;
        }
        let op = self.persist_ops.remove(&id).unwrap();
        self.reply(op.client, ClientResult::Done);
        let msg = PeerMsg::PersistVal {
            epoch: self.config.epoch,
            writes: op.writes.clone(),
        };
        self.broadcast(msg);
        self.apply_persist_val(&op.writes);
    }

    fn apply_persist_val(&mut self, writes: &[(Vec<u8>, Ts)]) {
        for (key, ts) in writes {
            if let Some(k) = self.store.get_mut(&key[..]) {
                if k.ts == *ts {
                    k.gdp = true;
                }
            }
            self.mark_if_needed(key);
        }
    }

    // ---------------------------------------------------------------- write protocol

    /// Moves a coordinated write forward according to the model (Table I).
    fn advance(&mut self, now_us: u64, key: &[u8]) {
        if self.store.get(key).is_none_or(|k| k.coord.is_none()) {
            return;
        }
        let others = self.others();
        let model = self.p.model;
        let epoch = self.config.epoch;
        let Some(k) = self.store.get_mut(key) else {
            return;
        };
        let Some(c) = &mut k.coord else { return };
        let skip = self.p.fault_skip_ack_wait;
        let all_c = skip || others.iter().all(|n| c.acks_c.contains(n));
        let all_p = (skip || others.iter().all(|n| c.acks_p.contains(n))) && c.local_p;
        let ts = c.ts;
        let mut reply = None;
        let mut vals: Vec<(bool, bool)> = Vec::new();
        let mut validate = false;
        let mut gdp = false;
        let mut done = false;
        match model {
            Model::Synch => {
                if all_c && all_p {
                    reply = c.client.take();
                    vals.push((true, true));
                    validate = true;
                    gdp = true;
                    done = true;
                }
            }
            Model::Strict => {
                if all_c && !c.val_c_sent {
                    c.val_c_sent = true;
                    vals.push((true, false));
                    validate = true;
                }
                if all_c && all_p {
                    reply = c.client.take();
                    vals.push((false, true));
                    gdp = true;
                    done = true;
                }
            }
            Model::ReadEnforced => {
                if all_c && !c.replied {
                    c.replied = true;
                    reply = c.client.take();
                }
                if all_c && all_p {
                    vals.push((true, true));
                    validate = true;
                    gdp = true;
                    done = true;
                }
            }
            Model::Eventual => {
                if all_c && !c.val_c_sent {
                    c.val_c_sent = true;
                    c.replied = true;
                    reply = c.client.take();
                    vals.push((true, false));
                    validate = true;
                }
                if all_c && all_p {
                    vals.push((false, true));
                    gdp = true;
                    done = true;
                }
            }
            Model::Scope => {
                if all_c {
                    c.val_c_sent = true;
                    c.replied = true;
                    reply = c.client.take();
                    vals.push((true, false));
                    validate = true;
                    done = true;
                }
            }
        }
        let scope = c.scope;
        if done {
            k.coord = None;
        }
        let _ = now_us;
        if let Some(tag) = reply {
            self.counters.writes_committed += 1;
            if let Some(s) = scope {
                self.scopes.entry(s).or_default().push((key.to_vec(), ts));
            }
            self.reply(tag, ClientResult::Done);
        }
        for (c, p) in vals {
            self.broadcast(PeerMsg::Val {
                epoch,
                key: key.to_vec(),
                ts,
                c,
                p,
            });
        }
        let k = self.store.get_mut(key).unwrap();
        if k.ts == ts {
            if validate {
                k.valid = true;
            }
            if gdp {
                k.gdp = true;
            }
        }
        self.mark_if_needed(key);
        self.settle(now_us, key);
    }

    /// Drops a key from the timer set once nothing is pending on it, and serves queued ops.
    fn settle(&mut self, now_us: u64, key: &[u8]) {
        if let Some(k) = self.store.get(key) {
            if k.valid && k.coord.is_none() {
                self.unsettled.remove(key);
            }
            if k.valid {
                self.serve_waiting(now_us, key);
            }
        }
    }

    /// Sends the ACK(s) a follower owes for `ts` of `key` now, queueing the persistency half.
    fn ack(&mut self, to: NodeId, key: &[u8], ts: Ts) {
        let model = self.p.model;
        let epoch = self.config.epoch;
        let pending = self.chunk_pending(key);
        if pending {
            self.durable_watch.insert(key.to_vec());
        }
        let k = self.store.get_mut(key).unwrap();
        let durable = k.durable >= ts && !pending;
        let msg = |p: bool| PeerMsg::Ack {
            epoch,
            key: key.to_vec(),
            ts,
            c: true,
            p,
        };
        // Synch: one ACK carrying both halves, once durable. Scope: the consistency half only.
        // The others: the consistency half now, the persistency half once durable.
        let mut out = None;
        match model {
            Model::Scope => out = Some(msg(false)),
            _ if durable => out = Some(msg(true)),
            _ => {
                if !k.pending_p.contains(&(to, ts)) {
                    k.pending_p.push((to, ts));
                }
                if model != Model::Synch {
                    out = Some(msg(false));
                }
            }
        }
        if let Some(m) = out {
            self.send(to, m);
        }
    }

    /// Applies a version to the volatile store if it is newer. Returns the seq of its durable
    /// append if it was applied.
    fn apply_newer(
        &mut self,
        now_us: u64,
        key: &[u8],
        ts: Ts,
        value: &[u8],
        valid: bool,
    ) -> Option<u64> {
        // Looked up before inserting: most updates are to keys we hold (no key allocation).
        if self.store.get(key).is_some_and(|k| ts <= k.ts) {
            return None;
        }
        let k = match self.store.get_mut(key) {
            Some(k) => k,
            None => self
                .store
                .entry(StoreKey::from_slice(key))
                .or_insert_with(|| KeyState {
                    valid: true,
                    ..Default::default()
                }),
        };
        k.ts = ts;
        k.value = value.to_vec();
        k.valid = valid;
        k.gdp = false;
        k.timeouts = 0;
        k.deadline_us = now_us + self.p.ack_val_timeout_us;
        if k.coord.as_ref().is_some_and(|c| c.client.is_none()) {
            // A replay of an older version is moot now.
            k.coord = None;
        }
        if !valid {
            self.unsettled.insert(key.to_vec());
        }
        let seq = self.persist(key, ts, value);
        self.record_missed(key, ts, value);
        Some(seq)
    }

    /// A message from another node.
    pub fn on_peer(&mut self, now_us: u64, from: NodeId, msg: PeerMsg) {
        #[cfg(debug_assertions)]
        let epoch_before = self.config.epoch;
        self.on_peer_input(now_us, from, msg);
        #[cfg(debug_assertions)]
        self.check_after_input(epoch_before);
    }

    fn on_peer_input(&mut self, now_us: u64, from: NodeId, msg: PeerMsg) {
        if msg.epoch() != self.config.epoch {
            self.counters.refused_epoch += 1;
            return;
        }
        if matches!(self.mode, Mode::Down) || !self.config.is_member(from) {
            return;
        }
        match msg {
            PeerMsg::Inv { key, ts, value, .. } => {
                if key.is_empty() || key.len() > MAX_KEY_BYTES || value.len() > MAX_VALUE_BYTES {
                    return;
                }
                self.apply_newer(now_us, &key, ts, &value, false);
                self.ack(from, &key, ts);
            }
            PeerMsg::Ack { key, ts, c, p, .. } => {
                let Some(k) = self.store.get_mut(&key[..]) else {
                    return;
                };
                match &mut k.coord {
                    Some(co) if co.ts == ts => {
                        if c {
                            co.acks_c.insert(from);
                        }
                        if p {
                            co.acks_p.insert(from);
                        }
                        self.advance(now_us, &key);
                    }
                    _ => {
                        // A late ACK for a write already finished here: repeat its VAL. The
                        // persistency half only to an ACK_P: `gdp` may date from an earlier
                        // epoch whose members did not include the sender (a recovering node
                        // acking a replay), and a VAL_P must not reach a replica whose NVM does
                        // not hold the version yet (Table IV, 3b). Its ACK_P follows once it
                        // has persisted, and gets the VAL_P then.
                        if k.ts == ts && k.valid {
                            let p = k.gdp && p;
                            let epoch = self.config.epoch;
                            self.send(
                                from,
                                PeerMsg::Val {
                                    epoch,
                                    key,
                                    ts,
                                    c: true,
                                    p,
                                },
                            );
                        }
                    }
                }
            }
            PeerMsg::Val { key, ts, c, p, .. } => {
                let Some(k) = self.store.get_mut(&key[..]) else {
                    return;
                };
                if k.ts != ts {
                    return;
                }
                if c {
                    k.valid = true;
                }
                if p {
                    k.gdp = true;
                }
                self.mark_if_needed(&key);
                self.settle(now_us, &key);
            }
            PeerMsg::PersistReq { id, writes, .. } => {
                if self.all_durable(&writes) {
                    let epoch = self.config.epoch;
                    self.send(from, PeerMsg::PersistAck { epoch, id });
                } else if self.persist_waits.len() < self.p.max_pending_client_ops
                    && !self
                        .persist_waits
                        .iter()
                        .any(|(f, i, _)| *f == from && *i == id)
                {
                    self.persist_waits.push((from, id, writes));
                }
            }
            PeerMsg::PersistAck { id, .. } => {
                if let Some(op) = self.persist_ops.get_mut(&id) {
                    op.acks.insert(from);
                    self.check_persist_op(id);
                }
            }
            PeerMsg::PersistVal { writes, .. } => self.apply_persist_val(&writes),
            PeerMsg::RecovStart { .. } => {
                let epoch = self.config.epoch;
                self.send(from, PeerMsg::RecovStartAck { epoch });
            }
            PeerMsg::RecovStartAck { .. } => self.on_recov_start_ack(now_us, from),
            PeerMsg::CatchUpReq {
                stream,
                partially,
                cursor,
                chunks,
                ..
            } => self.on_catchup_req(from, stream, partially, cursor, chunks),
            PeerMsg::CatchUpCredit { stream, chunks, .. } => {
                self.on_catchup_credit(from, stream, chunks)
            }
            PeerMsg::CatchUpResp {
                stream,
                from: at,
                next,
                full_copy,
                entries,
                ..
            } => self.on_catchup_resp(now_us, from, stream, at, next, full_copy, entries),
            PeerMsg::RecovEnd { .. } => {
                let others_whole = self
                    .config
                    .nodes
                    .iter()
                    .all(|n| *n == from || self.config.active.contains(n));
                if others_whole && matches!(self.mode, Mode::Member) {
                    // Recovery complete and nobody else absent: the buffer has done its job.
                    self.missed.keys.clear();
                    self.missed.bytes = 0;
                    self.missed.overflowed = false;
                }
            }
        }
    }

    /// A durable append finished.
    pub fn on_persisted(&mut self, now_us: u64, seq: u64) {
        self.on_persisted_many(now_us, [seq]);
    }

    /// Several durable appends finished (a group commit): the same as [`Self::on_persisted`]
    /// for each in turn, except that the follow-ups that look at everything (scope PERSIST
    /// waits, the recovery's next CatchUp_req) run once, after all of them.
    pub fn on_persisted_many(&mut self, now_us: u64, seqs: impl IntoIterator<Item = u64>) {
        #[cfg(debug_assertions)]
        let epoch_before = self.config.epoch;
        self.on_persisted_many_input(now_us, seqs);
        #[cfg(debug_assertions)]
        self.check_after_input(epoch_before);
    }

    fn on_persisted_many_input(&mut self, now_us: u64, seqs: impl IntoIterator<Item = u64>) {
        let mut next_chunk = false;
        let mut check_recovery = false;
        let mut any_put = false;
        let mut chunk_done = false;
        for seq in seqs {
            // Not a Put: the Boot record of a node recovering on its first start waits here.
            if let Some((key, ts)) = self.inflight.remove(&seq) {
                any_put = true;
                self.put_durable(now_us, &key, ts);
            } else if self.inflight_batches.remove(&seq).is_some() {
                // Its keys took `durable` when applied; only the ones someone asked about
                // need a look.
                any_put = true;
                chunk_done = true;
            }
            let (n, c) = self.recovery_seq_durable(seq);
            next_chunk |= n;
            check_recovery |= c;
        }
        if chunk_done && !self.durable_watch.is_empty() {
            let watched: Vec<Vec<u8>> = self
                .durable_watch
                .iter()
                .filter(|k| !self.chunk_pending(k))
                .cloned()
                .collect();
            for key in watched {
                self.durable_watch.remove(&key);
                let durable = self.store.get(&key[..]).map(|k| k.durable);
                if let Some(d) = durable {
                    self.put_durable(now_us, &key, d);
                }
            }
        }
        if any_put {
            self.after_puts_durable();
        }
        if next_chunk {
            self.grant_credit(now_us);
        }
        if check_recovery {
            self.maybe_finish_recovery(now_us);
        }
    }

    /// Whether a catch-up chunk applied to `key` is not durable yet (then the key's `durable`
    /// is not: see `inflight_batches`).
    fn chunk_pending(&self, key: &[u8]) -> bool {
        self.inflight_batches
            .values()
            .any(|(puts, index)| puts.index_contains(index, key))
    }

    /// Append `(key, ts)` is durable: owed ACK_Ps go, a coordinated write may advance.
    fn put_durable(&mut self, now_us: u64, key: &[u8], ts: Ts) {
        let epoch = self.config.epoch;
        let model = self.p.model;
        let down = matches!(self.mode, Mode::Down);
        let pending = self.chunk_pending(key);
        if pending {
            self.durable_watch.insert(key.to_vec());
        }
        let Some(k) = self.store.get_mut(key) else {
            return;
        };
        if ts > k.durable {
            k.durable = ts;
        }
        // While a pending chunk holds the key, only this append is known durable.
        let durable = if pending { ts } else { k.durable };
        let mut ready = Vec::new();
        if !k.pending_p.is_empty() {
            let (r, rest): (Vec<_>, Vec<_>) =
                k.pending_p.drain(..).partition(|(_, t)| *t <= durable);
            k.pending_p = rest;
            ready = r;
        }
        let coord = match &mut k.coord {
            Some(c) => {
                if c.ts <= durable {
                    c.local_p = true;
                }
                true
            }
            None => false,
        };
        if !down {
            for (to, t) in ready {
                let c = model == Model::Synch;
                self.send(
                    to,
                    PeerMsg::Ack {
                        epoch,
                        key: key.to_vec(),
                        ts: t,
                        c,
                        p: true,
                    },
                );
            }
        }
        if coord {
            self.advance(now_us, key);
        }
    }

    /// After durable Puts: scope PERSISTs waiting for local durability, our own PERSISTs.
    fn after_puts_durable(&mut self) {
        let epoch = self.config.epoch;
        if !self.persist_waits.is_empty() {
            let waits = std::mem::take(&mut self.persist_waits);
            for (from, id, writes) in waits {
                if self.all_durable(&writes) {
                    self.send(from, PeerMsg::PersistAck { epoch, id });
                } else {
                    self.persist_waits.push((from, id, writes));
                }
            }
        }
        if !self.persist_ops.is_empty() {
            let ids: Vec<u64> = self.persist_ops.keys().copied().collect();
            for id in ids {
                self.check_persist_op(id);
            }
        }
    }

    /// Log append `seq` is durable, as far as recovery is concerned. Returns (a chunk became
    /// durable: the next may be requested, nothing is outstanding any more: recovery may end).
    fn recovery_seq_durable(&mut self, seq: u64) -> (bool, bool) {
        let mut check_recovery = false;
        let mut next_chunk = false;
        if let Mode::Recovering(r) = &mut self.mode {
            if r.outstanding.remove(&seq) && r.outstanding.is_empty() {
                check_recovery = true;
            }
            // A seq belongs to at most one chunk; a chunk that became durable frees a slot.
            if let Some(i) = r.chunks_unpersisted.iter().position(|c| c.contains(&seq)) {
                r.chunks_unpersisted[i].remove(&seq);
                if r.chunks_unpersisted[i].is_empty() {
                    r.chunks_unpersisted.remove(i);
                    next_chunk = true;
                }
            }
        }
        (next_chunk, check_recovery)
    }

    /// Time passes: retransmissions, replays, recovery retries.
    pub fn tick(&mut self, now_us: u64) {
        #[cfg(debug_assertions)]
        let epoch_before = self.config.epoch;
        self.tick_input(now_us);
        #[cfg(debug_assertions)]
        self.check_after_input(epoch_before);
    }

    fn tick_input(&mut self, now_us: u64) {
        if matches!(self.mode, Mode::Down) {
            return;
        }
        let epoch = self.config.epoch;
        let me = self.p.id;
        let keys: Vec<Vec<u8>> = self.unsettled.iter().cloned().collect();
        let others = self.others();
        let needs_p = self.p.model != Model::Scope;
        for key in keys {
            let pending = self.chunk_pending(&key);
            let Some(k) = self.store.get_mut(&key[..]) else {
                continue;
            };
            if let Some(c) = &mut k.coord {
                if now_us >= c.deadline_us {
                    // §V-F1: re-send the INV with the original timestamp, to the followers
                    // whose ACKs are missing (the others have it), backing off each time.
                    c.retries = c.retries.saturating_add(1);
                    c.deadline_us = now_us
                        + (self.p.inv_ack_timeout_us << c.retries.min(MAX_INV_BACKOFF_SHIFT));
                    let missing: Vec<NodeId> = others
                        .iter()
                        .copied()
                        .filter(|n| !c.acks_c.contains(n) || (needs_p && !c.acks_p.contains(n)))
                        .collect();
                    let msg = PeerMsg::Inv {
                        epoch,
                        key: key.clone(),
                        ts: c.ts,
                        value: c.value.clone(),
                    };
                    self.counters.inv_rebroadcasts += 1;
                    for n in missing {
                        self.out.push(Output::Send {
                            to: n,
                            msg: msg.clone(),
                        });
                    }
                }
                continue;
            }
            if k.valid {
                self.unsettled.remove(&key);
                continue;
            }
            if now_us < k.deadline_us {
                continue;
            }
            k.timeouts += 1;
            k.deadline_us = now_us + self.p.ack_val_timeout_us;
            let coord = k.ts.node;
            let ts = k.ts;
            if k.timeouts == 1 && coord != me && self.config.is_member(coord) {
                self.ack(coord, &key, ts);
            } else {
                // The coordinator is gone or silent: take over with its timestamp (Table III).
                let local_p = k.durable >= ts && !pending;
                if pending {
                    self.durable_watch.insert(key.clone());
                }
                k.coord = Some(Box::new(Coord {
                    ts,
                    value: k.value.clone(),
                    client: None,
                    scope: None,
                    acks_c: BTreeSet::new(),
                    acks_p: BTreeSet::new(),
                    local_p,
                    replied: true,
                    val_c_sent: false,
                    deadline_us: now_us + self.p.inv_ack_timeout_us,
                    retries: 0,
                }));
                self.counters.replays_started += 1;
                let msg = PeerMsg::Inv {
                    epoch,
                    key: key.clone(),
                    ts,
                    value: k.value.clone(),
                };
                self.broadcast(msg);
                self.advance(now_us, &key);
            }
        }
        let ids: Vec<u64> = self.persist_ops.keys().copied().collect();
        for id in ids {
            let op = self.persist_ops.get_mut(&id).unwrap();
            if now_us >= op.deadline_us {
                op.deadline_us = now_us + self.p.inv_ack_timeout_us;
                let msg = PeerMsg::PersistReq {
                    epoch,
                    id,
                    writes: op.writes.clone(),
                };
                self.broadcast(msg);
            }
        }
        self.recovery_tick(now_us);
    }

    // ---------------------------------------------------------------- HEAL recovery

    fn start_recovery(&mut self, now_us: u64) {
        let r = Recov {
            phase: Phase::Start {
                acked: BTreeSet::new(),
            },
            started_us: now_us,
            acked_us: 0,
            resp_us: 0,
            deadline_us: now_us + self.start_retry_us(),
            outstanding: BTreeSet::new(),
            chunks_unpersisted: VecDeque::new(),
            stalled_since_us: None,
            request_sent_us: None,
            stats: RecoveryStats {
                partially_persisted: self.partially.len() as u64,
                ..Default::default()
            },
        };
        self.mode = Mode::Recovering(Box::new(r));
        let epoch = self.config.epoch;
        // Step 1: Recov_start to every active node.
        let active: Vec<NodeId> = self
            .config
            .active
            .iter()
            .copied()
            .filter(|n| *n != self.p.id)
            .collect();
        for n in active {
            self.send(n, PeerMsg::RecovStart { epoch });
        }
        self.on_recov_start_ack_check(now_us);
    }

    /// Recov_start is retried sooner than the other steps: a live node that has not yet adopted
    /// the configuration re-adding us refuses it (other epoch), and learns it within a
    /// heartbeat.
    fn start_retry_us(&self) -> u64 {
        self.p.recovery_retry_us.min(self.p.inv_ack_timeout_us)
    }

    fn on_recov_start_ack(&mut self, now_us: u64, from: NodeId) {
        if let Mode::Recovering(r) = &mut self.mode {
            if let Phase::Start { acked } = &mut r.phase {
                acked.insert(from);
            }
        }
        self.on_recov_start_ack_check(now_us);
    }

    fn buddy(&self) -> Option<NodeId> {
        // Static choice: the next node after us that is active; re-chosen if it is not.
        let n = self.config.nodes.len() as u32;
        (1..n)
            .map(|i| (self.p.id + i) % n)
            .find(|c| self.config.active.contains(c))
    }

    /// Where the catch-up stream starts for this group's scheme.
    fn first_cursor(&self) -> Cursor {
        match self.p.recovery {
            RecoveryScheme::ReactiveLog => Cursor::Log(LogCursor {
                since_epoch: self.last_epoch,
                gen: 0,
                pos: None,
            }),
            RecoveryScheme::Heal | RecoveryScheme::FullCopy => Cursor::Key(None),
        }
    }

    fn on_recov_start_ack_check(&mut self, now_us: u64) {
        let me = self.p.id;
        let active: Vec<NodeId> = self
            .config
            .active
            .iter()
            .copied()
            .filter(|n| *n != me)
            .collect();
        let buddy = self.buddy();
        let cursor = self.first_cursor();
        let Mode::Recovering(r) = &mut self.mode else {
            return;
        };
        let Phase::Start { acked } = &r.phase else {
            return;
        };
        if !active.iter().all(|n| acked.contains(n)) {
            return;
        }
        let Some(buddy) = buddy else { return };
        r.acked_us = now_us;
        r.stats.start_to_ack_us = now_us - r.started_us;
        r.phase = Phase::CatchUp {
            buddy,
            stream: 0,
            cursor,
            open: false,
            granted: 0,
        };
        // Step 2: CatchUp_req with the Partially_persisted list.
        self.grant_credit(now_us);
    }

    /// The catch-up window in chunks (see [`NodeParams::max_catchup_chunks_in_flight`]).
    fn window_chunks(&self) -> u32 {
        (self.p.max_catchup_chunks_in_flight as u32).clamp(1, MAX_CATCHUP_CHUNKS_PER_REQ)
    }

    /// Gives the Buddy as much of the window as is free: opens the stream (CatchUp_req) if it
    /// is not open, or sends CatchUp_credit. Credit goes in batches of a quarter of the window
    /// while the Buddy still holds some (fewer messages), at once when it holds none.
    fn grant_credit(&mut self, now_us: u64) {
        let epoch = self.config.epoch;
        let retry = self.p.recovery_retry_us;
        let window = self.window_chunks();
        let Mode::Recovering(r) = &mut self.mode else {
            return;
        };
        let Phase::CatchUp {
            buddy,
            stream,
            cursor,
            open,
            granted,
        } = &mut r.phase
        else {
            return;
        };
        let used = *granted + r.chunks_unpersisted.len() as u32;
        let free = window.saturating_sub(used);
        if free == 0 {
            if *granted == 0 {
                r.stalled_since_us.get_or_insert(now_us);
            }
            return;
        }
        if *open && *granted > 0 && free < (window / 4).max(1) {
            return;
        }
        if let Some(t) = r.stalled_since_us.take() {
            r.stats.window_stall_us += now_us.saturating_sub(t);
        }
        if *granted == 0 {
            r.request_sent_us = Some(now_us);
        }
        *granted += free;
        r.deadline_us = now_us + retry;
        r.stats.requests += 1;
        let to = *buddy;
        if *open {
            let stream = *stream;
            self.send(
                to,
                PeerMsg::CatchUpCredit {
                    epoch,
                    stream,
                    chunks: free,
                },
            );
        } else {
            *open = true;
            *stream = self.next_stream;
            self.next_stream += 1;
            let (stream, cursor) = (*stream, cursor.clone());
            let partially = self.partially.clone();
            self.send(
                to,
                PeerMsg::CatchUpReq {
                    epoch,
                    stream,
                    partially,
                    cursor,
                    chunks: free,
                },
            );
        }
    }

    fn on_catchup_req(
        &mut self,
        from: NodeId,
        stream: u64,
        partially: Vec<(Vec<u8>, Ts)>,
        cursor: Cursor,
        chunks: u32,
    ) {
        if !matches!(self.mode, Mode::Member) || !self.config.active.contains(&self.p.id) {
            return;
        }
        if partially.len() > self.p.max_pending_client_ops.max(1 << 16) {
            return; // not a list a crash can leave behind: refuse rather than work on it
        }
        self.counters.catchup_served += 1;
        // Never more than the largest window a node may be configured with.
        let credits = chunks.clamp(1, MAX_CATCHUP_CHUNKS_PER_REQ);
        // A new request replaces any stream of the node (it gave up on it).
        self.streams.remove(&from);
        self.log_reads.remove(&from);
        match cursor {
            Cursor::Key(after) => {
                let full_copy = self.missed.overflowed
                    || !self.missed.recording
                    || self.p.recovery != RecoveryScheme::Heal;
                // The first chunk now, the rest one per `pump`: the recovering node applies and
                // persists each while the next is read here, and our own clients are served
                // between chunks.
                self.streams.insert(
                    from,
                    KeyStream {
                        stream,
                        after,
                        partially,
                        full_copy,
                        credits,
                        sent: 0,
                    },
                );
                self.stream_chunk(from);
            }
            Cursor::Log(lc) => {
                // Reactive: the durable log is read from the point (by the driver, off the
                // protocol path), then answered in `on_log_read`, which reads on while the
                // stream has credit. One read at a time per recovering node.
                let max_bytes = catchup_chunk_bytes(self.p.max_catchup_chunk_bytes, 0);
                self.log_reads.insert(
                    from,
                    LogStream {
                        stream,
                        cursor: lc.clone(),
                        partially,
                        credits,
                        reading: true,
                        sent: 0,
                    },
                );
                self.out.push(Output::ReadLog {
                    to: from,
                    cursor: lc,
                    max_bytes,
                });
            }
        }
    }

    /// More credit for the stream `stream` of node `from`, if it is the one being served.
    fn on_catchup_credit(&mut self, from: NodeId, stream: u64, chunks: u32) {
        if let Some(st) = self.streams.get_mut(&from).filter(|st| st.stream == stream) {
            st.credits = st
                .credits
                .saturating_add(chunks)
                .min(MAX_CATCHUP_CHUNKS_PER_REQ);
            return;
        }
        let max_bytes = self.p.max_catchup_chunk_bytes;
        if let Some(ls) = self
            .log_reads
            .get_mut(&from)
            .filter(|ls| ls.stream == stream)
        {
            let max_bytes = catchup_chunk_bytes(max_bytes, ls.sent);
            ls.credits = ls
                .credits
                .saturating_add(chunks)
                .min(MAX_CATCHUP_CHUNKS_PER_REQ);
            if !ls.reading && ls.credits > 0 {
                ls.reading = true;
                let cursor = ls.cursor.clone();
                self.out.push(Output::ReadLog {
                    to: from,
                    cursor,
                    max_bytes,
                });
            }
        }
    }

    /// Whether a key-ordered catch-up stream is open here (possibly waiting for credit).
    pub fn serves_catchup(&self) -> bool {
        !self.streams.is_empty()
    }

    /// Whether [`Self::pump`] has work (catch-up chunks credited and not sent yet).
    pub fn wants_pump(&self) -> bool {
        self.streams.values().any(|st| st.credits > 0)
    }

    /// Sends the next chunk of every catch-up stream that has credit. A driver calls it between
    /// inputs while [`Self::wants_pump`] (and at once when no input waits).
    pub fn pump(&mut self, _now_us: u64) {
        #[cfg(debug_assertions)]
        let epoch_before = self.config.epoch;
        self.pump_input(_now_us);
        #[cfg(debug_assertions)]
        self.check_after_input(epoch_before);
    }

    fn pump_input(&mut self, _now_us: u64) {
        let to: Vec<NodeId> = self
            .streams
            .iter()
            .filter(|(_, st)| st.credits > 0)
            .map(|(n, _)| *n)
            .collect();
        for n in to {
            self.stream_chunk(n);
        }
    }

    fn stream_chunk(&mut self, to: NodeId) {
        if !matches!(self.mode, Mode::Member) || !self.config.active.contains(&self.p.id) {
            self.streams.clear();
            return;
        }
        let Some(st) = self.streams.get(&to) else {
            return;
        };
        if st.credits == 0 {
            return;
        }
        let max_bytes = catchup_chunk_bytes(self.p.max_catchup_chunk_bytes, st.sent);
        let (entries, next) =
            self.key_chunk(st.after.as_deref(), &st.partially, st.full_copy, max_bytes);
        let st = self.streams.get_mut(&to).unwrap();
        st.credits -= 1;
        st.sent += 1;
        let (stream, full_copy) = (st.stream, st.full_copy);
        let from = Cursor::Key(match &next {
            Some(Cursor::Key(k)) => std::mem::replace(&mut st.after, k.clone()),
            _ => self.streams.remove(&to).unwrap().after, // the last chunk: the stream ends
        });
        let epoch = self.config.epoch;
        self.send(
            to,
            PeerMsg::CatchUpResp {
                epoch,
                stream,
                from,
                next,
                full_copy,
                entries,
            },
        );
    }

    /// The next chunk after `after` of a key-ordered copy: every key of the store (a full
    /// copy), or HEAL's Missed_updates plus the Partially_persisted keys. The current version
    /// of each key is the newest update to it; a Partially_persisted entry is judged by
    /// sending ours: the recovering node keeps its own only if ours equals it. Built straight
    /// into the chunk's bytes: a copy per entry (HEAL's from the buffer, with a store lookup
    /// only for keys with a write in flight), one allocation per chunk.
    fn key_chunk(
        &self,
        after: Option<&[u8]>,
        partially: &[(Vec<u8>, Ts)],
        full: bool,
        max_bytes: usize,
    ) -> (Chunk, Option<Cursor>) {
        use std::ops::Bound;
        let lower = match after {
            Some(k) => Bound::Excluded(k),
            None => Bound::Unbounded,
        };
        let mut chunk = Chunk::with_capacity(
            max_bytes.min(MAX_CHUNK_PREALLOC_BYTES) + CHUNK_ENTRY_HEADER_BYTES + MAX_KEY_BYTES,
        );
        let mut add = |key: &[u8], ts: Ts, value: &[u8], valid: bool| -> bool {
            if ts != Ts::default() {
                chunk.push(key, ts, value, valid);
            }
            chunk.len_bytes() >= max_bytes
        };
        let last = if full {
            // The store in key order: no lookup per entry.
            let mut last = None;
            for (key, k) in self.store.range::<[u8], _>((lower, Bound::Unbounded)) {
                if add(key, k.ts, &k.value, k.valid) {
                    last = Some(key.to_vec());
                    break;
                }
            }
            last
        } else {
            let mut extra: Vec<&[u8]> = partially
                .iter()
                .map(|(k, _)| k.as_slice())
                .filter(|k| after.is_none_or(|a| *k > a))
                .collect();
            extra.sort_unstable();
            extra.dedup();
            let missed = self
                .missed
                .keys
                .range::<[u8], _>((lower, Bound::Unbounded))
                .map(|(k, m)| (k.as_slice(), m));
            let mut last = None;
            for (key, m) in (MergeKeys {
                a: missed.peekable(),
                b: extra.into_iter().peekable(),
            }) {
                // A buffered key with nothing unsettled is valid (an invalid key is always
                // unsettled) at the buffer's version: no store lookup. A write in flight, or a
                // Partially_persisted key the buffer lacks, is read from the store.
                let (ts, value, valid) = match m {
                    Some(m) if !self.unsettled.contains(key) => {
                        debug_assert_eq!(
                            self.store.get(key).map(|k| (k.ts, &k.value[..], k.valid)),
                            Some((m.ts, &m.value[..], true)),
                            "Missed_updates out of step with the store"
                        );
                        (m.ts, &m.value[..], true)
                    }
                    _ => match self.store.get(key) {
                        Some(k) => (k.ts, &k.value[..], k.valid),
                        None => continue,
                    },
                };
                if add(key, ts, value, valid) {
                    last = Some(key.to_vec());
                    break;
                }
            }
            last
        };
        (chunk, last.map(|k| Cursor::Key(Some(k))))
    }

    /// The driver read the log for `to` (see [`Output::ReadLog`]).
    pub fn on_log_read(&mut self, _now_us: u64, to: NodeId, cursor: LogCursor, chunk: LogChunk) {
        #[cfg(debug_assertions)]
        let epoch_before = self.config.epoch;
        self.on_log_read_input(_now_us, to, cursor, chunk);
        #[cfg(debug_assertions)]
        self.check_after_input(epoch_before);
    }

    fn on_log_read_input(&mut self, _now_us: u64, to: NodeId, cursor: LogCursor, chunk: LogChunk) {
        match self.log_reads.get(&to) {
            Some(ls) if ls.reading && ls.cursor == cursor => {}
            _ => return,
        }
        if !matches!(self.mode, Mode::Member) || !self.config.active.contains(&self.p.id) {
            self.log_reads.remove(&to);
            return;
        }
        let ls = self.log_reads.get_mut(&to).unwrap();
        ls.reading = false;
        ls.credits = ls.credits.saturating_sub(1);
        ls.sent += 1;
        let (stream, credits, sent) = (ls.stream, ls.credits, ls.sent);
        let partially = std::mem::take(&mut ls.partially);
        let epoch = self.config.epoch;
        let from = Cursor::Log(cursor.clone());
        if !chunk.found {
            // Our log does not reach back to where the node left: send a snapshot instead, on
            // as a key stream with the credit left.
            self.log_reads.remove(&to);
            let max_bytes = catchup_chunk_bytes(self.p.max_catchup_chunk_bytes, sent - 1);
            let (entries, next) = self.key_chunk(None, &[], true, max_bytes);
            if let Some(Cursor::Key(after)) = &next {
                self.streams.insert(
                    to,
                    KeyStream {
                        stream,
                        after: after.clone(),
                        partially: Vec::new(),
                        full_copy: true,
                        credits,
                        sent,
                    },
                );
            }
            self.send(
                to,
                PeerMsg::CatchUpResp {
                    epoch,
                    stream,
                    from,
                    next,
                    full_copy: true,
                    entries,
                },
            );
            return;
        }
        let LogChunk {
            mut entries,
            unmarked,
            gen,
            next_pos,
            at_end,
            ..
        } = chunk;
        for at in unmarked {
            // The log's flag was past this read (or lost): committed if the store holds a
            // newer version, or this one valid.
            let at = at as usize;
            let (e, _) = entries.entry_at(at).expect("offsets the log read gave");
            let committed = self
                .store
                .get(e.key)
                .is_some_and(|k| e.ts < k.ts || (e.ts == k.ts && k.valid));
            if committed {
                entries.set_committed(at);
            }
        }
        if cursor.pos.is_none() {
            // The first chunk also judges the Partially_persisted entries (like ZooKeeper's
            // TRUNC of a learner's uncommitted tail).
            for (key, _) in partially {
                if let Some(k) = self.store.get(&key[..]).filter(|k| k.ts != Ts::default()) {
                    entries.push(&key, k.ts, &k.value, k.valid);
                }
            }
        }
        let next_lc = LogCursor {
            since_epoch: cursor.since_epoch,
            gen,
            pos: Some(next_pos),
        };
        let next = (!at_end).then_some(Cursor::Log(next_lc.clone()));
        self.send(
            to,
            PeerMsg::CatchUpResp {
                epoch,
                stream,
                from,
                next,
                full_copy: false,
                entries,
            },
        );
        if at_end {
            self.log_reads.remove(&to);
            return;
        }
        let ls = self.log_reads.get_mut(&to).unwrap();
        ls.cursor = next_lc.clone();
        if credits > 0 {
            // Read on from where this chunk ended.
            ls.reading = true;
            let max_bytes = catchup_chunk_bytes(self.p.max_catchup_chunk_bytes, sent);
            self.out.push(Output::ReadLog {
                to,
                cursor: next_lc,
                max_bytes,
            });
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn on_catchup_resp(
        &mut self,
        now_us: u64,
        from: NodeId,
        stream: u64,
        at: Cursor,
        next: Option<Cursor>,
        full_copy: bool,
        entries: Chunk,
    ) {
        {
            let Mode::Recovering(r) = &mut self.mode else {
                return;
            };
            let Phase::CatchUp {
                buddy,
                stream: open_stream,
                cursor,
                open,
                granted,
            } = &mut r.phase
            else {
                return;
            };
            if *buddy != from || *open_stream != stream || !*open || *cursor != at || *granted == 0
            {
                return; // a duplicate, out of order, or of a stream we gave up on
            }
            if let Err(e) = entries.validate() {
                // Dropped whole, as if lost: the stream stalls and is asked for again.
                tracing::warn!(from, "refusing a catch-up chunk: {e}");
                return;
            }
            *granted -= 1;
            r.deadline_us = now_us + self.p.recovery_retry_us;
            if r.resp_us == 0 {
                r.resp_us = now_us;
                r.stats.catchup_to_resp_us = now_us - r.acked_us;
            }
            r.stats.chunks += 1;
            if let Some(t) = r.request_sent_us.take() {
                r.stats.request_wait_us += now_us.saturating_sub(t);
            }
            r.stats.full_copy |= full_copy;
            r.stats.bytes_received += entries.len_bytes() as u64;
        }
        // Step 3: apply, never resurrecting a version older than what we hold (ShadowReplica
        // writes may have overtaken it). The chunk's records go to the log as one append,
        // encoded from the chunk's own bytes by the log's thread.
        let entries = Arc::new(entries);
        // A key stream's chunk is in key order already (each key once); a log stream's is not.
        let sorted = matches!(at, Cursor::Key(_));
        // The baselines make every entry they receive durable, redundant ones included: the
        // full copy's new node takes the whole store into its NVM, and ZooKeeper's follower
        // appends every transaction of the leader's log it is sent (§II-C, §IX-D). HEAL's
        // entries carry no redundancy, and its own full-copy fallback keeps the node's state.
        let log_every_entry = self.p.recovery != RecoveryScheme::Heal;
        let (mut received, mut applied_n) = (0u64, 0u64);
        let mut seqs = Vec::new();
        let mut applied = Vec::new();
        for item in entries.iter() {
            let Ok((at, e)) = item else { break }; // validated above
            received += 1;
            match self.apply_catchup_entry(now_us, e) {
                CatchUpApply::Stale => {
                    if log_every_entry {
                        applied.push(at as u32);
                    }
                }
                CatchUpApply::Batched => {
                    applied_n += 1;
                    applied.push(at as u32);
                }
                CatchUpApply::Alone(seq) => {
                    applied_n += 1;
                    seqs.push(seq);
                }
            }
        }
        if !applied.is_empty() {
            let seq = self.next_seq;
            self.next_seq += 1;
            let puts = ChunkPuts {
                chunk: entries,
                applied,
            };
            let index = if sorted {
                puts.applied.clone()
            } else {
                puts.key_index()
            };
            self.inflight_batches.insert(seq, (puts.clone(), index));
            self.out.push(Output::PersistChunk { seq, puts });
            seqs.push(seq);
        }
        let eventual = self.p.model == Model::Eventual;
        let Mode::Recovering(r) = &mut self.mode else {
            return;
        };
        r.stats.entries_received += received;
        r.stats.entries_applied += applied_n;
        if !eventual {
            // Under Eventual the NVM copy is made in the background, off the critical path.
            r.outstanding.extend(seqs.iter().copied());
        }
        // The chunk holds its window slot until it is durable: the Buddy's reads and the
        // transfer of the next chunks overlap our log appends of this one, and the copy never
        // runs more than the window ahead of our log.
        if !seqs.is_empty() {
            r.chunks_unpersisted.push_back(seqs.into_iter().collect());
        }
        let Phase::CatchUp { cursor, .. } = &mut r.phase else {
            return;
        };
        match next {
            None => {
                r.stats.transfer_us = now_us - r.resp_us;
                r.phase = Phase::Applying;
                self.maybe_finish_recovery(now_us);
            }
            Some(n) => {
                *cursor = n;
                self.grant_credit(now_us);
            }
        }
    }

    /// Applies one catch-up entry if it is newer than what we hold. A key with nothing in
    /// flight (no coordinated write, no queued op or owed ACK_P, currently valid) — nearly every
    /// key of a catch-up — takes one store lookup and no allocation: the value is copied into
    /// the held buffer, and the entry's Put (and the Mark of a committed entry) go to the
    /// chunk's single append, encoded from the chunk. Any other key takes the general path of
    /// an INV plus a VAL ([`Self::apply_newer`], [`Self::mark_if_needed`], [`Self::settle`]),
    /// with its own append.
    fn apply_catchup_entry(&mut self, now_us: u64, e: EntryRef<'_>) -> CatchUpApply {
        let EntryRef {
            key,
            ts,
            value,
            committed,
        } = e;
        let deadline_us = now_us + self.p.ack_val_timeout_us;
        let quiet = |k: &KeyState| {
            k.coord.is_none() && k.waiting.is_empty() && k.pending_p.is_empty() && k.valid
        };
        match self.store.get_mut(key) {
            Some(k) if ts <= k.ts => return CatchUpApply::Stale,
            Some(k) if quiet(k) => {
                k.ts = ts;
                // The old value's buffer takes the new bytes (no allocation when it is large
                // enough, the usual case), unless it would be kept oversized.
                if k.value.capacity() >= value.len() && k.value.capacity() <= 2 * value.len() {
                    k.value.clear();
                    k.value.extend_from_slice(value);
                } else {
                    k.value = value.to_vec();
                }
                k.valid = committed;
                k.gdp = false;
                k.timeouts = 0;
                k.deadline_us = deadline_us;
                // As `mark_if_needed`: a committed version gets its GDP flag (`marked` is at
                // most the old version, older than this one).
                if committed {
                    k.marked = ts;
                }
                // Durable once the chunk is (see `inflight_batches`).
                k.durable = ts;
            }
            Some(_) => {
                // Newer than ours (checked above), so applied; its append is the one to await.
                let Some(seq) = self.apply_newer(now_us, key, ts, value, committed) else {
                    return CatchUpApply::Stale;
                };
                if committed {
                    self.mark_if_needed(key);
                    self.settle(now_us, key);
                }
                return CatchUpApply::Alone(seq);
            }
            None => {
                let k = KeyState {
                    ts,
                    value: value.to_vec(),
                    valid: committed,
                    marked: if committed { ts } else { Ts::default() },
                    durable: ts,
                    deadline_us,
                    ..Default::default()
                };
                self.store.insert(StoreKey::from_slice(key), k);
            }
        }
        if !committed {
            self.unsettled.insert(key.to_vec());
        }
        self.record_missed(key, ts, value);
        CatchUpApply::Batched
    }

    fn maybe_finish_recovery(&mut self, now_us: u64) {
        let Mode::Recovering(r) = &mut self.mode else {
            return;
        };
        if r.phase != Phase::Applying || !r.outstanding.is_empty() {
            return;
        }
        r.stats.apply_to_end_us = now_us - r.resp_us.max(r.acked_us);
        let stats = r.stats.clone();
        self.mode = Mode::Recovered;
        self.partially.clear();
        let epoch = self.config.epoch;
        self.broadcast(PeerMsg::RecovEnd { epoch });
        self.out.push(Output::Recovered(stats));
        let lease_ref = self.next_ack_ref(now_us);
        self.out.push(Output::ToCm(HeartbeatAck {
            node: self.p.id,
            epoch,
            seq: 0,
            status: NodeStatus::Recovered,
            lease_ref,
        }));
    }

    fn recovery_tick(&mut self, now_us: u64) {
        let retry = self.p.recovery_retry_us;
        let start_retry = self.start_retry_us();
        let buddy_now = self.buddy();
        let Mode::Recovering(r) = &mut self.mode else {
            return;
        };
        if now_us < r.deadline_us {
            return;
        }
        r.deadline_us = now_us + retry;
        match &mut r.phase {
            Phase::Start { acked } => {
                r.deadline_us = now_us + start_retry;
                let epoch = self.config.epoch;
                let missing: Vec<NodeId> = self
                    .config
                    .active
                    .iter()
                    .copied()
                    .filter(|n| *n != self.p.id && !acked.contains(n))
                    .collect();
                for n in missing {
                    self.send(n, PeerMsg::RecovStart { epoch });
                }
            }
            Phase::CatchUp {
                buddy,
                cursor,
                open,
                granted,
                ..
            } => {
                if *granted == 0 {
                    return; // waiting for our own log, not for the Buddy
                }
                // No chunk for a while: open a new stream where we are, possibly from a
                // different Buddy (a dead one's stream is gone); already applied entries are
                // harmless. Credit of the old stream is void.
                if let Some(b) = buddy_now {
                    if b != *buddy {
                        if let Cursor::Log(lc) = cursor {
                            lc.pos = None; // a log position means nothing in another node's log
                        }
                    }
                    *buddy = b;
                }
                *open = false;
                *granted = 0;
                self.grant_credit(now_us);
            }
            Phase::Applying => {}
        }
    }
}

/// What became of one catch-up entry.
enum CatchUpApply {
    /// Not newer than what we hold: dropped.
    Stale,
    /// Applied; its records are in the chunk's batch.
    Batched,
    /// Applied through the general path, with an append of its own.
    Alone(u64),
}

/// Merges the Missed_updates buffer's keys (ascending, with their updates) with other
/// ascending keys, each key once (with its update if the buffer has it).
struct MergeKeys<'a, A, B>
where
    A: Iterator<Item = (&'a [u8], &'a MissedUpdate)>,
    B: Iterator<Item = &'a [u8]>,
{
    a: std::iter::Peekable<A>,
    b: std::iter::Peekable<B>,
}

impl<'a, A, B> Iterator for MergeKeys<'a, A, B>
where
    A: Iterator<Item = (&'a [u8], &'a MissedUpdate)>,
    B: Iterator<Item = &'a [u8]>,
{
    type Item = (&'a [u8], Option<&'a MissedUpdate>);
    fn next(&mut self) -> Option<Self::Item> {
        let a = |x: Option<(&'a [u8], &'a MissedUpdate)>| x.map(|(k, m)| (k, Some(m)));
        match (self.a.peek(), self.b.peek()) {
            (Some((x, _)), Some(y)) => {
                if x < y {
                    a(self.a.next())
                } else if y < x {
                    self.b.next().map(|k| (k, None))
                } else {
                    self.b.next();
                    a(self.a.next())
                }
            }
            (Some(_), None) => a(self.a.next()),
            (None, _) => self.b.next().map(|k| (k, None)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(epoch: u64, active: &[NodeId], recovering: &[NodeId]) -> Config {
        Config {
            epoch,
            nodes: vec![0, 1, 2],
            active: active.iter().copied().collect(),
            recovering: recovering.iter().copied().collect(),
        }
    }

    fn persist_all(n: &mut NodeCore, now: u64) {
        loop {
            let seqs: Vec<u64> = n
                .take_outputs()
                .into_iter()
                .filter_map(|o| match o {
                    Output::Persist { seq, .. } | Output::PersistChunk { seq, .. } => Some(seq),
                    _ => None,
                })
                .collect();
            if seqs.is_empty() {
                return;
            }
            for s in seqs {
                n.on_persisted(now, s);
            }
        }
    }

    /// Issue 22 §2 (found by the simulator's node pauses): a node stopped past its lease read,
    /// when continued, the heartbeats that had waited in its socket and took a lease from now,
    /// while the CM had already removed it and the others had written without it: it served
    /// stale reads until the heartbeat of the new configuration came through. The lease counts
    /// from when the node sent the ack the heartbeat echoes.
    #[test]
    fn a_heartbeat_read_late_gives_no_lease_past_its_echo() {
        let lease = NodeParams::new(0, Model::Synch).lease_us;
        let mut n = NodeCore::new(NodeParams::new(0, Model::Synch), LogState::default());
        let config = cfg(1, &[0, 1, 2], &[]);
        let hb = |seq, lease_ref| Heartbeat {
            seq,
            config: config.clone(),
            lease_ref,
        };
        n.on_heartbeat(0, hb(0, 0));
        persist_all(&mut n, 0);
        assert!(!n.serving(1), "no ack echoed yet: no lease");
        let first = n.last_lease_ref();
        n.on_heartbeat(1_000, hb(1, first));
        assert!(
            n.serving(2_000) && !n.serving(lease),
            "lease from the ack at 0"
        );
        // Stopped from 2 ms to 10 leases; the heartbeat sent at 3 ms is read on waking.
        let second = n.last_lease_ref();
        let woke = 10 * lease;
        n.on_heartbeat(woke, hb(2, second));
        assert!(!n.serving(woke), "a heartbeat read late extends nothing");
        // A fresh heartbeat, echoing the ack sent on waking, gives the lease back.
        let third = n.last_lease_ref();
        n.on_heartbeat(woke + 1_000, hb(3, third));
        assert!(n.serving(woke + 2_000));
        // An echo of an ack this core never sent (an earlier core's) anchors nothing.
        let mut m = NodeCore::new(NodeParams::new(0, Model::Synch), LogState::default());
        m.on_heartbeat(0, hb(0, 0));
        persist_all(&mut m, 0);
        m.on_heartbeat(1_000, hb(1, first + 1_000));
        assert!(!m.serving(2_000));
    }

    /// Regression for the model-check finding (MODEL_EAGER_TIMEOUTS=1, Strict and Eventual):
    /// a write made globally durable in epoch 2 (members 1, 2) gets a late ACK with only
    /// ACK_C from node 0, which came back as a recovering node in epoch 3 and has not
    /// persisted the version. The repeated VAL must not carry VAL_P (Table IV, 3b); the
    /// node's ACK_P, once it persisted, gets it.
    #[test]
    fn late_ack_c_from_recovering_node_gets_no_val_p() {
        for model in [Model::Strict, Model::Eventual, Model::ReadEnforced] {
            let mut n = NodeCore::new(NodeParams::new(1, model), LogState::default());
            n.on_heartbeat(
                0,
                Heartbeat {
                    seq: 0,
                    config: cfg(1, &[0, 1, 2], &[]),
                    lease_ref: n.last_lease_ref(),
                },
            );
            persist_all(&mut n, 0);
            n.on_heartbeat(
                1,
                Heartbeat {
                    seq: 1,
                    config: cfg(2, &[1, 2], &[]),
                    lease_ref: n.last_lease_ref(),
                },
            );
            n.take_outputs();
            let key = b"b".to_vec();
            n.on_client(
                2,
                7,
                ClientOp::Put {
                    key: key.clone(),
                    value: b"v".to_vec(),
                    scope: None,
                },
            );
            persist_all(&mut n, 2);
            let ts = Ts {
                version: 1,
                node: 1,
            };
            n.on_peer(
                3,
                2,
                PeerMsg::Ack {
                    epoch: 2,
                    key: key.clone(),
                    ts,
                    c: true,
                    p: true,
                },
            );
            let outs = n.take_outputs();
            assert!(
                outs.contains(&Output::Reply {
                    tag: 7,
                    result: ClientResult::Done
                }),
                "{model}: write done in epoch 2: {outs:?}"
            );
            n.on_heartbeat(
                4,
                Heartbeat {
                    seq: 2,
                    config: cfg(3, &[1, 2], &[0]),
                    lease_ref: n.last_lease_ref(),
                },
            );
            n.take_outputs();
            let val_to_0 = |outs: Vec<Output>| -> Vec<(bool, bool)> {
                outs.into_iter()
                    .filter_map(|o| match o {
                        Output::Send {
                            to: 0,
                            msg: PeerMsg::Val { c, p, .. },
                        } => Some((c, p)),
                        _ => None,
                    })
                    .collect()
            };
            n.on_peer(
                5,
                0,
                PeerMsg::Ack {
                    epoch: 3,
                    key: key.clone(),
                    ts,
                    c: true,
                    p: false,
                },
            );
            assert_eq!(val_to_0(n.take_outputs()), vec![(true, false)], "{model}");
            n.on_peer(
                6,
                0,
                PeerMsg::Ack {
                    epoch: 3,
                    key: key.clone(),
                    ts,
                    c: false,
                    p: true,
                },
            );
            assert_eq!(val_to_0(n.take_outputs()), vec![(true, true)], "{model}");
        }
    }

    fn entry(key: &str, version: u64) -> Entry {
        Entry {
            key: key.as_bytes().to_vec(),
            ts: Ts { version, node: 2 },
            value: b"v".to_vec(),
            committed: true,
        }
    }

    fn key_cursor(after: Option<&str>) -> Cursor {
        Cursor::Key(after.map(|a| a.as_bytes().to_vec()))
    }

    /// Node 0 returns in epoch 2 (members 1, 2) and gets both Recov_start ACKs: its Buddy is 1.
    fn recovering_node(window: usize) -> (NodeCore, Vec<Output>) {
        recovering_node_with(window, RecoveryScheme::Heal, LogState::default())
    }

    fn recovering_node_with(
        window: usize,
        scheme: RecoveryScheme,
        st: LogState,
    ) -> (NodeCore, Vec<Output>) {
        let mut p = NodeParams::new(0, Model::Strict);
        p.max_catchup_chunks_in_flight = window;
        p.recovery = scheme;
        let mut n = NodeCore::new(p, st);
        n.on_heartbeat(
            0,
            Heartbeat {
                seq: 0,
                config: cfg(2, &[1, 2], &[0]),
                lease_ref: n.last_lease_ref(),
            },
        );
        let mut outs = n.take_outputs();
        n.on_peer(1, 1, PeerMsg::RecovStartAck { epoch: 2 });
        n.on_peer(1, 2, PeerMsg::RecovStartAck { epoch: 2 });
        outs.extend(n.take_outputs());
        (n, outs)
    }

    /// (to, stream, cursor, chunks) of every CatchUp_req.
    fn catchup_reqs(outs: &[Output]) -> Vec<(NodeId, u64, Cursor, u32)> {
        outs.iter()
            .filter_map(|o| match o {
                Output::Send {
                    to,
                    msg:
                        PeerMsg::CatchUpReq {
                            stream,
                            cursor,
                            chunks,
                            ..
                        },
                } => Some((*to, *stream, cursor.clone(), *chunks)),
                _ => None,
            })
            .collect()
    }

    /// (stream, chunks) of every CatchUp_credit.
    fn credits(outs: &[Output]) -> Vec<(u64, u32)> {
        outs.iter()
            .filter_map(|o| match o {
                Output::Send {
                    msg: PeerMsg::CatchUpCredit { stream, chunks, .. },
                    ..
                } => Some((*stream, *chunks)),
                _ => None,
            })
            .collect()
    }

    fn persists(outs: &[Output]) -> Vec<u64> {
        outs.iter()
            .filter_map(|o| match o {
                Output::Persist {
                    seq,
                    rec: LogRecord::Put { .. },
                }
                | Output::PersistChunk { seq, .. } => Some(*seq),
                _ => None,
            })
            .collect()
    }

    fn sent_recov_end(outs: &[Output]) -> bool {
        outs.iter().any(|o| {
            matches!(
                o,
                Output::Send {
                    msg: PeerMsg::RecovEnd { .. },
                    ..
                }
            )
        })
    }

    fn resp(stream: u64, from: Option<&str>, next: Option<&str>, entries: Vec<Entry>) -> PeerMsg {
        PeerMsg::CatchUpResp {
            epoch: 2,
            stream,
            from: key_cursor(from),
            next: next.map(|n| key_cursor(Some(n))),
            full_copy: false,
            entries: Chunk::from_entries(&entries),
        }
    }

    /// The chunk format: what is pushed comes back, in order, with its offsets; truncated,
    /// oversized or flagged-wrong bytes are refused, never a panic.
    #[test]
    fn chunk_round_trips_and_refuses_malformed_bytes() {
        let es = vec![
            entry("a", 1),
            Entry {
                key: vec![7; MAX_KEY_BYTES],
                ts: Ts {
                    version: u64::MAX,
                    node: 9,
                },
                value: vec![1; 3000],
                committed: false,
            },
            entry("c", 3),
        ];
        let c = Chunk::from_entries(&es);
        assert_eq!(c.validate(), Ok(3));
        assert_eq!(c.to_entries().unwrap(), es);
        let offs: Vec<usize> = c.iter().map(|r| r.unwrap().0).collect();
        assert_eq!(offs[0], 0);
        assert_eq!(c.entry_at(offs[2]).unwrap().0.to_entry(), es[2]);
        let bytes = postcard::to_allocvec(&c).unwrap();
        assert_eq!(postcard::from_bytes::<Chunk>(&bytes).unwrap(), c);
        let raw = |b: Vec<u8>| -> Chunk {
            postcard::from_bytes(&postcard::to_allocvec(&serde_bytes::ByteBuf::from(b)).unwrap())
                .unwrap()
        };
        let good: Vec<u8> = postcard::from_bytes::<serde_bytes::ByteBuf>(&bytes)
            .unwrap()
            .into_vec();
        for cut in 1..good.len() {
            let r = raw(good[..cut].to_vec()).validate();
            assert!(r.is_err() || offs.contains(&cut), "cut at {cut}: {r:?}");
        }
        let mut flags = good.clone();
        flags[2 + 1 + 12] = 2; // the first entry's flags
        assert!(raw(flags).validate().is_err());
        let mut empty_key = good.clone();
        empty_key[0] = 0;
        assert!(raw(empty_key).validate().is_err());
        let mut huge: Vec<u8> = Vec::new();
        huge.extend_from_slice(&1u16.to_le_bytes());
        huge.push(b'k');
        huge.extend_from_slice(&[0; 13]);
        huge.extend_from_slice(&(MAX_VALUE_BYTES as u32 + 1).to_le_bytes());
        assert!(raw(huge).validate().is_err());
    }

    /// A window of 3: the stream opens with 3 credits; chunks arrive back to back; a chunk
    /// made durable frees a slot and, the Buddy holding no credit, a credit of 1 goes at once
    /// (no new request: no round trip); late, duplicated, reordered and other streams' replies
    /// are ignored (they never roll a key back); Recov_end waits for every chunk to be durable.
    #[test]
    fn catchup_pipelines_within_window_and_ends_only_when_durable() {
        let (mut n, outs) = recovering_node(3);
        let boot: Vec<u64> = outs
            .iter()
            .filter_map(|o| match o {
                Output::Persist {
                    seq,
                    rec: LogRecord::Boot { .. },
                } => Some(*seq),
                _ => None,
            })
            .collect();
        let reqs = catchup_reqs(&outs);
        assert_eq!(reqs.len(), 1);
        let (to, st, cursor, chunks) = reqs[0].clone();
        assert_eq!(
            (to, cursor, chunks),
            (1, key_cursor(None), 3),
            "the whole window in one request"
        );
        let mut unpersisted = Vec::new();
        for (i, (from, next, e)) in [
            (None, "a", entry("a", 5)),
            (Some("a"), "b", entry("b", 5)),
            (Some("b"), "c", entry("c", 5)),
        ]
        .into_iter()
        .enumerate()
        {
            n.on_peer(10 + i as u64, 1, resp(st, from, Some(next), vec![e]));
            let outs = n.take_outputs();
            let p = persists(&outs);
            assert_eq!(p.len(), 1, "chunk {i} applied and persisted: {outs:?}");
            unpersisted.extend(p);
            assert!(
                catchup_reqs(&outs).is_empty() && credits(&outs).is_empty(),
                "chunk {i}: window full"
            );
        }
        // A late duplicate of chunk 1 carrying an older version of "a", a reply for a cursor
        // not asked for, a chunk of another stream and a fourth chunk past the credit change
        // nothing.
        n.on_peer(20, 1, resp(st, None, Some("a"), vec![entry("a", 3)]));
        n.on_peer(
            20,
            1,
            resp(st, Some("c"), Some("d"), vec![entry("d", 1)]).clone(),
        );
        n.on_peer(
            20,
            1,
            resp(st + 7, Some("c"), Some("d"), vec![entry("d", 1)]),
        );
        assert!(n.take_outputs().is_empty());
        assert!(!n.store.contains_key(b"d".as_slice()));
        // Chunk 2 becomes durable first: a slot frees and a credit of 1 goes at once.
        n.on_persisted(21, unpersisted[1]);
        let outs = n.take_outputs();
        assert!(
            catchup_reqs(&outs).is_empty(),
            "the stream stays open: {outs:?}"
        );
        assert_eq!(credits(&outs), vec![(st, 1)]);
        // Last chunk: applied; Recov_end waits for all chunks and the Boot record.
        n.on_peer(
            22,
            1,
            PeerMsg::CatchUpResp {
                epoch: 2,
                stream: st,
                from: key_cursor(Some("c")),
                next: None,
                full_copy: false,
                entries: Chunk::from_entries(&[entry("c", 9), entry("a", 2)]),
            },
        );
        let outs = n.take_outputs();
        assert_eq!(
            persists(&outs).len(),
            1,
            "older version of a is not applied: {outs:?}"
        );
        unpersisted.extend(persists(&outs));
        assert!(!sent_recov_end(&outs));
        for s in boot
            .iter()
            .chain(&unpersisted)
            .filter(|s| **s != unpersisted[1])
        {
            assert!(
                !sent_recov_end(&n.take_outputs()),
                "Recov_end before every chunk is durable"
            );
            n.on_persisted(23, *s);
        }
        let outs = n.take_outputs();
        assert!(sent_recov_end(&outs), "{boot:?} {unpersisted:?} {outs:?}");
        assert!(n.is_recovering() || matches!(n.mode, Mode::Recovered));
        let a = n.store.get(b"a".as_slice()).unwrap();
        assert_eq!(
            a.ts,
            Ts {
                version: 5,
                node: 2
            },
            "a is never rolled back"
        );
    }

    /// HEAL logs only the entries it applies; the baselines log every entry they receive,
    /// redundant ones included (the stale one is still not applied).
    #[test]
    fn baselines_log_redundant_entries_heal_does_not() {
        for (scheme, logged) in [
            (RecoveryScheme::Heal, 1),
            (RecoveryScheme::FullCopy, 2),
            (RecoveryScheme::ReactiveLog, 2),
        ] {
            let mut st = LogState::default();
            st.base.insert(
                b"a".to_vec(),
                (
                    Ts {
                        version: 5,
                        node: 2,
                    },
                    b"new".to_vec(),
                ),
            );
            let (mut n, outs) = recovering_node_with(1, scheme, st);
            // A key stream for HEAL and the full copy, a log stream for the reactive log: the
            // same entries answer either, the older "a" redundant.
            let (_, stream, cursor, _) = catchup_reqs(&outs)[0].clone();
            n.on_peer(
                10,
                1,
                PeerMsg::CatchUpResp {
                    epoch: 2,
                    stream,
                    from: cursor,
                    next: None,
                    full_copy: false,
                    entries: Chunk::from_entries(&[entry("a", 3), entry("b", 4)]),
                },
            );
            let outs = n.take_outputs();
            let puts: usize = outs
                .iter()
                .filter_map(|o| match o {
                    Output::PersistChunk { puts, .. } => Some(
                        puts.records()
                            .iter()
                            .filter(|r| matches!(r, LogRecord::Put { .. }))
                            .count(),
                    ),
                    _ => None,
                })
                .sum();
            assert_eq!(puts, logged, "{scheme:?}: {outs:?}");
            assert_eq!(
                n.store.get(b"a".as_slice()).unwrap().ts.version,
                5,
                "{scheme:?}: the stale entry is not applied"
            );
            assert_eq!(n.store.get(b"b".as_slice()).unwrap().ts.version, 4);
        }
    }

    fn full_copy_buddy(keys: usize, chunk_bytes: usize) -> NodeCore {
        let mut p = NodeParams::new(1, Model::Strict);
        p.max_catchup_chunk_bytes = chunk_bytes;
        p.recovery = RecoveryScheme::FullCopy; // every key is sent
        let mut st = LogState::default();
        for i in 0..keys {
            st.base.insert(
                format!("k{i:04}").into_bytes(),
                (
                    Ts {
                        version: 1,
                        node: 1,
                    },
                    vec![i as u8; 10],
                ),
            );
        }
        let mut n = NodeCore::new(p, st);
        n.on_heartbeat(
            0,
            Heartbeat {
                seq: 0,
                config: cfg(2, &[1, 2], &[0]),
                lease_ref: n.last_lease_ref(),
            },
        );
        n.take_outputs();
        n
    }

    /// A Buddy sends one chunk per credit, back to back, each naming where the next starts;
    /// with no credit left the stream waits (open) for CatchUp_credit; credit for another
    /// stream is ignored; a new request replaces the stream; it ends at the end.
    #[test]
    fn buddy_streams_one_chunk_per_credit() {
        let mut n = full_copy_buddy(5, 1); // one entry per chunk: k0000..k0004
        let resps = |outs: Vec<Output>| -> Vec<(u64, Cursor, Option<Cursor>, usize)> {
            outs.into_iter()
                .filter_map(|o| match o {
                    Output::Send {
                        to: 0,
                        msg:
                            PeerMsg::CatchUpResp {
                                stream,
                                from,
                                next,
                                entries,
                                ..
                            },
                    } => Some((stream, from, next, entries.validate().unwrap())),
                    _ => None,
                })
                .collect()
        };
        let pumped = |n: &mut NodeCore| {
            let mut outs = n.take_outputs();
            while n.wants_pump() {
                n.pump(1);
                outs.extend(n.take_outputs());
            }
            outs
        };
        let k = |i: usize| key_cursor(Some(&format!("k{i:04}")));
        n.on_peer(
            1,
            0,
            PeerMsg::CatchUpReq {
                epoch: 2,
                stream: 4,
                partially: vec![],
                cursor: key_cursor(None),
                chunks: 2,
            },
        );
        assert_eq!(resps(n.take_outputs()).len(), 1, "the first chunk at once");
        assert!(n.wants_pump());
        assert_eq!(resps(pumped(&mut n)), vec![(4, k(0), Some(k(1)), 1)]);
        assert!(!n.wants_pump(), "no credit left");
        n.on_peer(
            2,
            0,
            PeerMsg::CatchUpCredit {
                epoch: 2,
                stream: 3,
                chunks: 5,
            },
        );
        assert!(!n.wants_pump(), "credit of another stream");
        n.on_peer(
            2,
            0,
            PeerMsg::CatchUpCredit {
                epoch: 2,
                stream: 4,
                chunks: 2,
            },
        );
        assert_eq!(
            resps(pumped(&mut n)),
            vec![(4, k(1), Some(k(2)), 1), (4, k(2), Some(k(3)), 1)]
        );
        // A retry from k(1) replaces the stream.
        n.on_peer(
            3,
            0,
            PeerMsg::CatchUpReq {
                epoch: 2,
                stream: 5,
                partially: vec![],
                cursor: k(1),
                chunks: 9,
            },
        );
        let got = resps(pumped(&mut n));
        // k0002, k0003, k0004, then an empty last chunk (a full chunk always names a next).
        assert_eq!(got.len(), 4, "stops at the end: {got:?}");
        assert!(got.iter().all(|g| g.0 == 5));
        assert_eq!(got[3].2, None);
        assert!(n.streams.is_empty(), "the ended stream is dropped");
        n.on_peer(
            4,
            0,
            PeerMsg::CatchUpCredit {
                epoch: 2,
                stream: 5,
                chunks: 2,
            },
        );
        assert!(!n.wants_pump() && n.take_outputs().is_empty());
    }

    /// A stream's chunks ramp up from [`FIRST_CATCHUP_CHUNK_BYTES`], doubling, to the
    /// configured size, and restart small when a retry replaces the stream.
    #[test]
    fn catchup_chunks_ramp_up_to_the_configured_size() {
        let max = 2 * FIRST_CATCHUP_CHUNK_BYTES;
        let entry_bytes = CHUNK_ENTRY_HEADER_BYTES + 5 + 10; // "k0000" and a 10-byte value
        let mut n = full_copy_buddy(9999, max);
        let sizes = |n: &mut NodeCore| -> Vec<usize> {
            let mut outs = n.take_outputs();
            while n.wants_pump() {
                n.pump(1);
                outs.extend(n.take_outputs());
            }
            outs.into_iter()
                .filter_map(|o| match o {
                    Output::Send {
                        msg: PeerMsg::CatchUpResp { entries, .. },
                        ..
                    } => Some(entries.len_bytes()),
                    _ => None,
                })
                .collect()
        };
        let req = |stream| PeerMsg::CatchUpReq {
            epoch: 2,
            stream,
            partially: vec![],
            cursor: key_cursor(None),
            chunks: 5,
        };
        n.on_peer(1, 0, req(1));
        let got = sizes(&mut n);
        // 9999 entries, 340 KB: 64 KiB, then 128 KiB chunks. A chunk closes with the entry
        // that reaches its limit.
        assert_eq!(got.len(), 4, "{got:?}");
        for (i, limit) in [1, 2, 2].into_iter().enumerate() {
            let limit = limit * FIRST_CATCHUP_CHUNK_BYTES;
            assert!(
                got[i] >= limit && got[i] < limit + entry_bytes,
                "chunk {i}: {} bytes, limit {limit}",
                got[i]
            );
        }
        n.on_peer(2, 0, req(2));
        let again = sizes(&mut n);
        assert_eq!(again[0], got[0], "a new stream starts small again");
        assert_eq!(
            catchup_chunk_bytes(1000, 0),
            1000,
            "never above the configured size"
        );
        assert!(
            catchup_chunk_bytes(usize::MAX, 1000) >= catchup_chunk_bytes(usize::MAX, 10),
            "no overflow"
        );
    }

    /// A window of 1 is the strictly serial copy: the next chunk only once this one is durable.
    #[test]
    fn catchup_window_of_one_waits_for_durability() {
        let (mut n, outs) = recovering_node(1);
        let st = catchup_reqs(&outs)[0].1;
        assert_eq!(catchup_reqs(&outs)[0].3, 1);
        n.on_peer(
            10,
            1,
            resp(st, None, Some("a"), vec![entry("a", 1), entry("b", 1)]),
        );
        let outs = n.take_outputs();
        let seqs = persists(&outs);
        assert_eq!(seqs.len(), 1, "a chunk's records are one append: {outs:?}");
        let recs = outs.iter().find_map(|o| match o {
            Output::PersistChunk { puts, .. } => Some(puts.records().len()),
            _ => None,
        });
        assert_eq!(recs, Some(4), "a Put and a Mark per committed entry");
        assert!(credits(&outs).is_empty());
        n.on_persisted(11, seqs[0] + 100);
        assert!(
            credits(&n.take_outputs()).is_empty(),
            "another append's completion is not enough"
        );
        n.on_persisted(12, seqs[0]);
        assert_eq!(credits(&n.take_outputs()), vec![(st, 1)]);
    }

    /// A key of a key-ordered chunk takes its durable version when applied, without a second
    /// lookup when the chunk completes, so until then nothing may rely on it: an INV of that
    /// version gets its ACK_P only once the chunk is durable, while a newer version's own
    /// append is enough for its ACK_P.
    #[test]
    fn pending_chunk_defers_ack_p_until_durable() {
        let (mut n, outs) = recovering_node(4);
        let st = catchup_reqs(&outs)[0].1;
        n.on_peer(
            10,
            1,
            resp(st, None, Some("b"), vec![entry("a", 5), entry("b", 5)]),
        );
        let chunk_seq = persists(&n.take_outputs())[0];
        let ack_ps = |outs: &[Output]| -> Vec<(Vec<u8>, Ts)> {
            outs.iter()
                .filter_map(|o| match o {
                    Output::Send {
                        to: 2,
                        msg:
                            PeerMsg::Ack {
                                key, ts, p: true, ..
                            },
                    } => Some((key.clone(), *ts)),
                    _ => None,
                })
                .collect()
        };
        // A replay of a's version by node 2: the chunk holding it is not durable yet.
        let v5 = Ts {
            version: 5,
            node: 2,
        };
        n.on_peer(
            11,
            2,
            PeerMsg::Inv {
                epoch: 2,
                key: b"a".to_vec(),
                ts: v5,
                value: b"v".to_vec(),
            },
        );
        let outs = n.take_outputs();
        assert!(
            ack_ps(&outs).is_empty(),
            "no ACK_P before the chunk is durable: {outs:?}"
        );
        // A newer version of b: its own append makes it durable, chunk or not.
        let v6 = Ts {
            version: 6,
            node: 2,
        };
        n.on_peer(
            12,
            2,
            PeerMsg::Inv {
                epoch: 2,
                key: b"b".to_vec(),
                ts: v6,
                value: b"w".to_vec(),
            },
        );
        let b_seq = persists(&n.take_outputs())[0];
        n.on_persisted(13, b_seq);
        assert_eq!(ack_ps(&n.take_outputs()), vec![(b"b".to_vec(), v6)]);
        // The chunk completes: a's owed ACK_P goes.
        n.on_persisted(14, chunk_seq);
        assert_eq!(ack_ps(&n.take_outputs()), vec![(b"a".to_vec(), v5)]);
        assert!(n.durable_watch.is_empty());
    }

    /// A Buddy and a recovering node wired together, with a log that completes one append only
    /// every few steps (a slow receiver): the Buddy is never sent more than the window ahead
    /// of the log (chunks in flight plus received-not-durable never exceed it), the stream is
    /// opened once and fed by credits, and the whole store arrives.
    #[test]
    fn credit_flow_with_a_slow_receiver() {
        const KEYS: usize = 400;
        let window = 4usize;
        let mut buddy = full_copy_buddy(KEYS, 100); // about 3 entries per chunk
        let (mut rec, outs) = recovering_node(window);
        let mut to_buddy: VecDeque<PeerMsg> = VecDeque::new();
        let mut to_rec: VecDeque<PeerMsg> = VecDeque::new();
        let mut log: VecDeque<u64> = VecDeque::new();
        let (mut reqs, mut credit_msgs, mut ended) = (0, 0, false);
        let mut route = |outs: Vec<Output>,
                         to_buddy: &mut VecDeque<PeerMsg>,
                         log: &mut VecDeque<u64>,
                         ended: &mut bool| {
            for o in outs {
                match o {
                    Output::Send { to: 1, msg } => {
                        match &msg {
                            PeerMsg::CatchUpReq { .. } => reqs += 1,
                            PeerMsg::CatchUpCredit { .. } => credit_msgs += 1,
                            PeerMsg::RecovEnd { .. } => *ended = true,
                            _ => {}
                        }
                        to_buddy.push_back(msg);
                    }
                    Output::Persist { seq, .. } | Output::PersistChunk { seq, .. } => {
                        log.push_back(seq)
                    }
                    _ => {}
                }
            }
        };
        route(outs, &mut to_buddy, &mut log, &mut ended);
        let mut now = 10;
        for step in 0..100_000 {
            now += 1;
            if let Some(m) = to_buddy.pop_front() {
                buddy.on_peer(now, 0, m);
            }
            if buddy.wants_pump() {
                buddy.pump(now);
            }
            for o in buddy.take_outputs() {
                if let Output::Send { to: 0, msg } = o {
                    to_rec.push_back(msg);
                }
            }
            if let Some(m) = to_rec.pop_front() {
                rec.on_peer(now, 1, m);
            }
            // The log: one append completes every 7th step.
            if step % 7 == 0 {
                if let Some(seq) = log.pop_front() {
                    rec.on_persisted(now, seq);
                }
            }
            route(rec.take_outputs(), &mut to_buddy, &mut log, &mut ended);
            let in_flight = to_rec
                .iter()
                .filter(|m| matches!(m, PeerMsg::CatchUpResp { .. }))
                .count();
            let unpersisted = match &rec.mode {
                Mode::Recovering(r) => r.chunks_unpersisted.len(),
                _ => 0,
            };
            assert!(in_flight + unpersisted <= window, "step {step}: {in_flight} chunks in flight and {unpersisted} not durable, window {window}");
            if ended {
                break;
            }
        }
        assert!(ended, "the catch-up finished");
        assert_eq!(reqs, 1, "one stream, opened once: credits, not round trips");
        assert!(credit_msgs > 10, "fed by credits: {credit_msgs}");
        for i in 0..KEYS {
            let k = format!("k{i:04}");
            assert_eq!(
                rec.key_ts(k.as_bytes()),
                Ts {
                    version: 1,
                    node: 1
                },
                "{k}"
            );
        }
    }

    /// A Buddy that dies mid-stream: no chunk comes for `recovery_retry_us` while credit is
    /// out, so the recovering node opens a new stream where it is (late chunks of the old one
    /// are ignored); once the CM removes the dead Buddy, recovery restarts with the next one,
    /// which completes it.
    #[test]
    fn buddy_dying_mid_stream_is_replaced() {
        let window = 4;
        let (mut rec, outs) = recovering_node(window);
        let (_, st, _, _) = catchup_reqs(&outs)[0].clone();
        rec.on_peer(
            10,
            1,
            resp(st, None, Some("k0000"), vec![entry("k0000", 1)]),
        );
        let outs = rec.take_outputs();
        let s0 = persists(&outs);
        rec.on_persisted(11, s0[0]);
        rec.take_outputs();
        // Buddy 1 falls silent. Before the retry timeout nothing happens; after it, a new
        // stream from where we are.
        let retry = rec.p.recovery_retry_us;
        rec.tick(12 + retry / 2);
        assert!(catchup_reqs(&rec.take_outputs()).is_empty());
        rec.tick(12 + retry);
        let reqs = catchup_reqs(&rec.take_outputs());
        assert_eq!(reqs.len(), 1);
        let (to, st2, cursor, chunks) = reqs[0].clone();
        assert!(st2 != st);
        assert_eq!(
            (to, cursor, chunks),
            (1, key_cursor(Some("k0000")), window as u32)
        );
        // A late chunk of the dead stream is ignored.
        rec.on_peer(
            13 + retry,
            1,
            resp(st, Some("k0000"), Some("k0001"), vec![entry("k0001", 1)]),
        );
        assert!(rec.take_outputs().is_empty());
        // The CM removes node 1: recovery restarts (§VI) with Buddy 2, which streams its store.
        rec.on_heartbeat(
            20 + retry,
            Heartbeat {
                seq: 1,
                config: Config {
                    epoch: 3,
                    nodes: vec![0, 1, 2],
                    active: [2].into(),
                    recovering: [0].into(),
                },
                lease_ref: rec.last_lease_ref(),
            },
        );
        rec.take_outputs();
        rec.on_peer(21 + retry, 2, PeerMsg::RecovStartAck { epoch: 3 });
        let reqs = catchup_reqs(&rec.take_outputs());
        assert_eq!(reqs.len(), 1);
        let (to, st3, _, _) = reqs[0].clone();
        assert_eq!(to, 2, "the next active node is the Buddy");
        let chunk = Chunk::from_entries(&[entry("k0000", 1), entry("k0001", 2)]);
        rec.on_peer(
            22 + retry,
            2,
            PeerMsg::CatchUpResp {
                epoch: 3,
                stream: st3,
                from: key_cursor(None),
                next: None,
                full_copy: true,
                entries: chunk,
            },
        );
        let mut outs = rec.take_outputs();
        for _ in 0..10 {
            for s in outs
                .iter()
                .filter_map(|o| match o {
                    Output::Persist { seq, .. } | Output::PersistChunk { seq, .. } => Some(*seq),
                    _ => None,
                })
                .collect::<Vec<_>>()
            {
                rec.on_persisted(23 + retry, s);
            }
            let more = rec.take_outputs();
            if sent_recov_end(&more) {
                outs = more;
                break;
            }
            outs = more;
        }
        assert!(
            sent_recov_end(&outs),
            "recovery completed through the new Buddy"
        );
        assert_eq!(
            rec.key_ts(b"k0001"),
            Ts {
                version: 2,
                node: 2
            }
        );
    }

    /// The invariant checks can fail: a core whose state breaks one panics naming it.
    #[test]
    fn check_invariants_names_a_broken_invariant() {
        let mut n = NodeCore::new(NodeParams::new(0, Model::Synch), LogState::default());
        n.check_invariants();
        n.pending_client_ops = 3; // counted, yet no op queued on any key
        let e = std::panic::catch_unwind(|| n.check_invariants()).unwrap_err();
        let msg = e.downcast_ref::<String>().unwrap();
        assert!(
            msg.contains("pending_client_ops counts the ops queued"),
            "{msg}"
        );
        let mut n = NodeCore::new(NodeParams::new(0, Model::Synch), LogState::default());
        n.config = cfg(2, &[1, 2], &[0]);
        n.mode = Mode::Member; // a Member the configuration lists as recovering
        let e = std::panic::catch_unwind(|| n.check_invariants()).unwrap_err();
        let msg = e.downcast_ref::<String>().unwrap();
        assert!(
            msg.contains("a Member node is a member of its configuration"),
            "{msg}"
        );
    }
}
