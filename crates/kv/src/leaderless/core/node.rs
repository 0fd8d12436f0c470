//! The sans-I/O replica: Hermes-style writes (§II-B), the five persistency models (Table I,
//! §V-E), replays (§V-F, Table III) and the HEAL recovery of Fig. 4 (§V-C), as one deterministic
//! state machine.
//!
//! One entry point, [`NodeCore::handle`]`(now_us, `[`NodeInput`]`)`: a peer's message, the CM's
//! heartbeat (the configuration), a client's operation, durable appends finished, a log read
//! done, a tick (time passes), a pump (send credited catch-up chunks). Outputs, drained with
//! [`NodeCore::take_outputs`], must be carried out in order: [`Output::Persist`] and
//! [`Output::Mark`] go to the same log, in order. [`NodeCore::check_invariants`] runs after every
//! input in debug builds; [`NodeCore::check_invariants_deep`] (a walk over the store) only in
//! the simulation and the model check.
//!
//! One state machine, its methods in files by concern: `write` (the write path), `table1` (the
//! five persistency models as data), `persist` (log appends, GDP marks, Scope's PERSIST),
//! `recovery` (the recovering node's side of HEAL), `catchup` (the Buddy's streaming),
//! `baselines` (reactive log and full copy), `invariants`; configuration, timers and message
//! dispatch stay here.
//!
//! Per key a node keeps the newest timestamp and value it has applied, whether that version is
//! *valid* (committed: readable), whether it is *gdp* (globally durable, known from ACK_P / VAL_P),
//! the newest timestamp made locally durable, and at most one write it coordinates (a client
//! write, or a replay of someone else's write with its original timestamp).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::hash::{Hash, Hasher};

use std::sync::Arc;

use crate::leaderless::proto::*;
use crate::pmlog::{ChunkPuts, LogChunk, LogCursor, LogRecord, LogState};

// One state machine, its methods split into files by concern (impl blocks across files).
mod baselines;
mod catchup;
mod invariants;
mod persist;
mod recovery;
mod table1;
mod write;

use table1::{FollowerAck, Stage};

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
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
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

/// Everything that can happen to a node: the input of [`NodeCore::handle`].
#[derive(Clone, Debug)]
pub enum NodeInput {
    /// A client operation; the answer comes as [`Output::Reply`] with the same `tag`.
    Client { tag: u64, op: ClientOp },
    /// A message from another node.
    Peer { from: NodeId, msg: PeerMsg },
    /// A heartbeat from the CM carrying its configuration.
    Heartbeat(Heartbeat),
    /// Durable appends finished ([`Output::Persist`] / [`Output::PersistChunk`] seqs; several
    /// for a group commit): the same as one input per seq, except that the follow-ups that
    /// look at everything (scope PERSIST waits, the recovery's next CatchUp_req) run once, after
    /// all of them.
    Persisted(Vec<u64>),
    /// Time passes: retransmissions, replays, recovery retries.
    Tick,
    /// Send the next chunk of every catch-up stream that has credit. A driver gives it between
    /// inputs while [`NodeCore::wants_pump`] (and at once when no input waits).
    Pump,
    /// The driver read the log for `to` (see [`Output::ReadLog`]).
    LogRead {
        to: NodeId,
        cursor: LogCursor,
        chunk: LogChunk,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    Send {
        to: NodeId,
        msg: PeerMsg,
    },
    ToCm(HeartbeatAck),
    /// Append durably, then give [`NodeInput::Persisted`] with `seq`.
    Persist {
        seq: u64,
        rec: LogRecord,
    },
    /// Append a catch-up chunk's records durably, in order, then call
    /// [`NodeInput::Persisted`] with `seq` (one append, one completion per chunk).
    PersistChunk {
        seq: u64,
        puts: ChunkPuts,
    },
    /// Append without waiting (a GDP flag, an `Epoch` record).
    Mark(LogRecord),
    /// Read the durable log at `cursor` (about `max_bytes` of updates, after every append
    /// output so far), then give [`NodeInput::LogRead`] with `to` and `cursor`.
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
    /// chunk per credit, one per [`NodeInput::Pump`].
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
    /// The one entry point: an input at time `now_us` (the driver's clock, in µs; time is a
    /// parameter rather than an input of its own because every input needs it — leases,
    /// deadlines — and [`NodeInput::Tick`] says only that time passed). Outputs accumulate for
    /// [`Self::take_outputs`]; in debug builds the invariants are checked after every input.
    pub fn handle(&mut self, now_us: u64, input: NodeInput) {
        #[cfg(debug_assertions)]
        let epoch_before = self.config.epoch;
        match input {
            NodeInput::Client { tag, op } => self.on_client_input(now_us, tag, op),
            NodeInput::Peer { from, msg } => self.on_peer_input(now_us, from, msg),
            NodeInput::Heartbeat(hb) => self.on_heartbeat_input(now_us, hb),
            NodeInput::Persisted(seqs) => self.on_persisted_many_input(now_us, seqs),
            NodeInput::Tick => self.tick_input(now_us),
            NodeInput::Pump => self.pump_input(now_us),
            NodeInput::LogRead { to, cursor, chunk } => {
                self.on_log_read_input(now_us, to, cursor, chunk)
            }
        }
        #[cfg(debug_assertions)]
        self.check_after_input(epoch_before);
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

    fn status(&self) -> NodeStatus {
        match self.mode {
            Mode::Down => NodeStatus::WantsJoin,
            Mode::Recovered => NodeStatus::Recovered,
            Mode::Member | Mode::Recovering(_) => NodeStatus::Member,
        }
    }

    // ---------------------------------------------------------------- configuration

    fn mode_name(&self) -> &'static str {
        match &self.mode {
            Mode::Down => "Down",
            Mode::Member => "Member",
            Mode::Recovering(_) => "Recovering",
            Mode::Recovered => "Recovered",
        }
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
        self.adopt_buffers();
        self.restart_in_flight(now_us);
    }

    /// After adopting a configuration: the reactive baseline's epoch record, and the
    /// Missed_updates buffer started, kept or dropped.
    fn adopt_buffers(&mut self) {
        let active = self.config.active.contains(&self.p.id);
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
    }

    /// After adopting a configuration: in-flight writes and PERSISTs restart with the new
    /// membership, and recovering nodes get our Recov_start answer at once.
    fn restart_in_flight(&mut self, now_us: u64) {
        let me = self.p.id;
        let active = self.config.active.contains(&me);
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

    // ---------------------------------------------------------------- peer messages

    /// A message from another node, dispatched by kind. One arm per message of the protocol,
    /// so the whole of what a node does on receipt reads in one place (long on purpose, like
    /// raft.go's `Step`); the work of each arm lives in the files by concern.
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

    fn tick_input(&mut self, now_us: u64) {
        if matches!(self.mode, Mode::Down) {
            return;
        }
        let epoch = self.config.epoch;
        let me = self.p.id;
        let keys: Vec<Vec<u8>> = self.unsettled.iter().cloned().collect();
        let others = self.others();
        let needs_p = table1::rules(self.p.model).waits_for_ack_p();
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
}

#[cfg(test)]
mod tests;
