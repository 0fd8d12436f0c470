//! `WitnessCore`: the sans-I/O state machine of one witness-KV node (paper §3–§5; spec (c)).
//!
//! One type for every node kind; the kind (head or backup) is fixed by the configuration, the
//! role (follower, candidate, provisional leader, leader) is dynamic. A head that wins an
//! election becomes the primary: a witness holds keys and stamps only, so it serves at once
//! and pulls values from the backups (live recovery, M17–M19) while checking every value it
//! serves against its key table.
//!
//! Driver contract (the storage helper's driver in `witness/store/` carries these out):
//! - Outputs are carried out in order.
//! - [`Output::PmemAppend`] appends `rec` (postcard of [`PmemRecord`]) to the node's NVMM region;
//!   when it is durable the driver gives [`Input::PmemPersisted`] with its `seq`. Persists are
//!   reported in order: `PmemPersisted{seq}` means every append with a smaller seq is durable
//!   too (true of an append-only NVMM log with in-order fences, and of group commit).
//! - [`Output::PmemTruncate`] drops the region's entry records with index ≥ `from_index` (a
//!   Raft conflict); [`Output::PmemFree`] drops a backup buffer's entry records with index ≤
//!   `through_index` (written back to SSD). Neither needs an answer.
//! - [`Output::SsdWrite`] writes `bytes` at `off` of segment `seg` of log `log` (creating the
//!   segment file if it is new; page aligned, a whole number of 4 KiB pages), syncs it, then
//!   gives [`Input::SsdWritten`]. [`Output::SsdRead`] reads `len` bytes at `off` of `seg` with
//!   priority `class`, then gives [`Input::SsdRead`] (an error as `Err`, a short read past the
//!   end zero-filled). [`Output::SsdFree`] deletes a segment (GC made it unreferenced; no read
//!   of it is in flight). Both logs use the one format of [`super::page`]; the core picks every
//!   segment and offset ([`super::ssd`]).
//! - Time comes only as the `now_us` of [`WitnessCore::handle`]; give [`Input::Tick`] at least
//!   every `Params::heartbeat_us / 2`.
//!
//! Membership changes (M22–M24) live in `reconfig.rs`, log truncation and key-table snapshots
//! in `snapshot.rs`, the recovery policy (detector, popularity, pacing, schemes) in
//! `node/recovery.rs` (child modules of this one: they share the core's state); the backup's
//! SSD segments and GC rule in `super::ssd`.
//!
//! Simplified in this version (each marked `SIMPLIFIED` where it lives): a backup has one
//! worker (M7).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use super::config::{Change, Config, ConfigError, Kind, Member};
use recovery::RecoveryState;
pub use recovery::{
    Recovery, RecoveryCounters, UnknownRecovery, HOT_CURSOR, OFFLINE_BATCH_PULL_BYTES,
};

mod recovery;
pub use super::page::Loc;
use super::page::{self, PAGE_BYTES};
use super::ssd::Space;
pub use super::ssd::{IoClass, SsdLog, SsdLogs};
use crate::witness::proto::{
    ClientReply, ClientReq, Entry, NodeId, Op, PeerBody, PeerMsg, Stamp, MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
};

#[path = "reconfig.rs"]
mod reconfig;
#[path = "snapshot.rs"]
mod snapshot;
#[path = "refill.rs"]
mod refill;
#[path = "operator.rs"]
mod operator;
mod status;
use super::tiers::CountedMap;
pub use reconfig::ReconfigError;

/// Tunables. Every bound has its unit in its name.
#[derive(Clone, Debug)]
pub struct Params {
    /// Leader heartbeat (empty AppendEntries) period, also the retransmission period (M11).
    pub heartbeat_us: u64,
    /// The hard timeout: a head that has heard no leader for this long stands for election.
    pub election_timeout_us: u64,
    /// Spread between heads' timeouts; the lowest-id witness waits least (the designated
    /// successor, spec M15 Decide).
    pub election_jitter_us: u64,
    /// Leader lease (M3): a voter that heard a live leader refuses votes for this long.
    pub lease_us: u64,
    /// Worst clock-rate difference over a lease; the leader's lease ends this much early.
    pub clock_drift_us: u64,
    /// Writeback batch (M8: the SSD's best block size, 32 KiB in the paper).
    pub writeback_batch_bytes: usize,
    /// A partial batch of committed entries is written back after waiting this long.
    pub writeback_linger_us: u64,
    /// One BatchPull read (M17).
    pub batch_pull_bytes: usize,
    /// A PriorityPull or BatchPull with no answer is re-sent after this long.
    pub pull_retry_us: u64,
    /// PriorityPulls in flight at once (spec M18 `max_pending_pulls`).
    pub max_pending_pulls: usize,
    /// Gets waiting for a pulled value, over all keys; past it a Get is refused `Unavailable`.
    pub max_pending_gets: usize,
    /// Entries per AppendEntries message.
    pub append_max_entries: usize,
    /// Entries a backup remembers by index after writeback, to answer RequestLog (M14).
    pub recent_index_window_entries: usize,
    /// The soft timeout (M15/M16): the designated successor that has heard no leader for this
    /// long starts pulling the backup's log ahead of the election. 0 disables proactive pulls.
    pub soft_timeout_us: u64,
    /// Proactively pulled bytes kept at most (spec M15 `proactive_bytes_max`).
    pub proactive_bytes_max: usize,
    /// The recovery scheme (`--recovery`, issue 25 item 5); the same on every node.
    pub recovery: Recovery,
    /// Φ at which the soft timeout fires once the soft floor (`soft_timeout_us`) has passed.
    pub phi_soft: f64,
    /// Φ at which the hard timeout fires once the hard floor (`election_timeout_us`) has passed.
    pub phi_hard: f64,
    /// The Φ detector may push a timeout out to at most this many times its floor: a leader
    /// whose heartbeats jitter is still replaced within a bound.
    pub suspicion_ceiling_factor: u64,
    /// Chance that the primary samples one served request's key (M10).
    pub popularity_sample_probability: f64,
    /// How often the primary ships sampled keys to the backups.
    pub popularity_ship_interval_us: u64,
    /// Distinct keys one shipment aggregates at most.
    pub popularity_batch_keys_max: usize,
    /// Encoded key bytes one Popularity message carries at most (most sampled kept).
    pub popularity_msg_bytes_max: usize,
    /// Keys a backup's popular list holds.
    pub popular_keys_max: usize,
    /// Popular keys a backup answers per BatchPull in the popular-keys phase.
    pub hot_pull_keys_per_batch: usize,
    /// BatchPull pacing ceiling (M20); 0 = unlimited. The `offline` scheme is never paced.
    pub batch_pull_bytes_per_s: u64,
    /// The adaptive rate never falls below this.
    pub batch_pull_bytes_per_s_min: u64,
    /// A PriorityPull answered slower than this halves the BatchPull rate; 0 = fixed rate.
    pub priority_pull_target_us: u64,
    /// A voting member the serving leader has not heard from for this long is lost: a backup
    /// is substituted by a witness, a spare replaces it (M22–M24). 0 disables the automatic
    /// membership policy (changes then come only from `Input::Reconfigure`).
    pub member_lost_us: u64,
    /// A head keeps between this many and twice this many applied entries of its log (in
    /// memory and in its NVMM Log region) and drops older ones once every live member holds
    /// them durably (M24); a head behind the dropped prefix gets a snapshot of the key table.
    pub log_keep_entries: usize,
    /// Keys per snapshot message (a key is at most `MAX_KEY_BYTES`, so a chunk stays far
    /// below `MAX_PEER_MSG_BYTES`).
    pub snapshot_chunk_keys: usize,
    /// Bytes of values per refill message (`core/refill.rs`), at least one entry; far below
    /// `MAX_PEER_MSG_BYTES`, and what a backup writes to SSD per acknowledged step.
    pub refill_chunk_bytes: usize,
    /// How a backup places entries on SSD: hot and cold logs by popularity (M10), or one log
    /// (the `single-log` ablation).
    pub ssd_logs: SsdLogs,
    /// A segment is sealed once a batch would take it past this (a page multiple, < 4 GiB:
    /// a BatchPull cursor is `segment << 32 | offset`).
    pub ssd_segment_bytes: u64,
    /// The SSD space a backup may use; GC (M9) runs while less than `gc_free_min_bytes` of it
    /// is free.
    pub ssd_capacity_bytes: u64,
    pub gc_free_min_bytes: u64,
    /// Largest write one GC pass issues at once.
    pub gc_write_bytes: usize,
    /// Deliberately broken behaviour for the model check only (`tests/model_check_witness.rs`
    /// must catch each); always `WitnessFault::None` outside it.
    #[doc(hidden)]
    pub fault: WitnessFault,
}

/// Deliberately broken variants of the protocol (spec (d)), each of which the model check must
/// catch. Test-only: nothing outside `tests/model_check_witness.rs` sets one.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WitnessFault {
    #[default]
    None,
    /// Commit on a majority of voters instead of the leader plus every voting backup (M4):
    /// a write acknowledged with only a witness's ack is lost when the primary fails.
    MajorityQuorum,
    /// Install a pulled value as the key's current one without comparing its stamp with the
    /// key table's (M18): a stale version is served.
    InstallWithoutStampCheck,
    /// Grant votes within the leader lease (M3): a new leader is elected while the old one
    /// still holds a lease and may serve a stale read.
    NoLeaseWait,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            heartbeat_us: 5_000,
            election_timeout_us: 150_000,
            election_jitter_us: 20_000,
            lease_us: 100_000,
            clock_drift_us: 10_000,
            writeback_batch_bytes: 32 << 10,
            writeback_linger_us: 20_000,
            batch_pull_bytes: 128 << 10,
            pull_retry_us: 50_000,
            max_pending_pulls: 64,
            max_pending_gets: 4096,
            append_max_entries: 256,
            recent_index_window_entries: 1 << 16,
            soft_timeout_us: 30_000,
            proactive_bytes_max: 64 << 20,
            recovery: Recovery::Cand,
            phi_soft: 3.0,
            phi_hard: 8.0,
            suspicion_ceiling_factor: 3,
            popularity_sample_probability: 0.01,
            popularity_ship_interval_us: 1_000_000,
            popularity_batch_keys_max: 4096,
            popularity_msg_bytes_max: 256 << 10,
            popular_keys_max: 65_536,
            hot_pull_keys_per_batch: 64,
            batch_pull_bytes_per_s: 256 << 20,
            batch_pull_bytes_per_s_min: 8 << 20,
            priority_pull_target_us: 5_000,
            member_lost_us: 3_000_000,
            log_keep_entries: 4096,
            snapshot_chunk_keys: 1024,
            refill_chunk_bytes: 1 << 20,
            ssd_logs: SsdLogs::HotCold,
            ssd_segment_bytes: 64 << 20,
            ssd_capacity_bytes: 1 << 40,
            gc_free_min_bytes: 256 << 20,
            gc_write_bytes: 256 << 10,
            fault: WitnessFault::None,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParamsError {
    #[error("lease_us + clock_drift_us ({0} µs) must be below election_timeout_us ({1} µs) (M3)")]
    LeaseTooLong(u64, u64),
    #[error("heartbeat_us ({0}) must be below lease_us ({1}) or no lease is ever renewed")]
    HeartbeatTooSlow(u64, u64),
    #[error("soft_timeout_us ({0}) must be below election_timeout_us ({1}) (M16)")]
    SoftAfterHard(u64, u64),
    #[error("{0} must be positive")]
    Zero(&'static str),
    #[error("member_lost_us ({0}) must be at least election_timeout_us ({1}): a member is not lost before a leader would be")]
    LostBeforeTimeout(u64, u64),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("node {0} is not in the configuration")]
    NotMember(NodeId),
    #[error("recovery settings: {0}")]
    Recovery(String),
    #[error("ssd_segment_bytes ({0}) must be a positive multiple of 4096 below 4 GiB")]
    SegmentBytes(u64),
}

impl Params {
    pub fn validate(&self) -> Result<(), ParamsError> {
        if self.lease_us + self.clock_drift_us >= self.election_timeout_us {
            return Err(ParamsError::LeaseTooLong(
                self.lease_us + self.clock_drift_us,
                self.election_timeout_us,
            ));
        }
        if self.soft_timeout_us >= self.election_timeout_us {
            return Err(ParamsError::SoftAfterHard(
                self.soft_timeout_us,
                self.election_timeout_us,
            ));
        }
        if self.member_lost_us != 0 && self.member_lost_us < self.election_timeout_us {
            return Err(ParamsError::LostBeforeTimeout(
                self.member_lost_us,
                self.election_timeout_us,
            ));
        }
        if self.heartbeat_us >= self.lease_us {
            return Err(ParamsError::HeartbeatTooSlow(
                self.heartbeat_us,
                self.lease_us,
            ));
        }
        if self.ssd_segment_bytes == 0
            || !self.ssd_segment_bytes.is_multiple_of(PAGE_BYTES as u64)
            || self.ssd_segment_bytes >= 1 << 32
        {
            return Err(ParamsError::SegmentBytes(self.ssd_segment_bytes));
        }
        for (v, name) in [
            (self.gc_write_bytes, "gc_write_bytes"),
            (self.popular_keys_max, "popular_keys_max"),
            (self.max_pending_pulls, "max_pending_pulls"),
            (self.log_keep_entries, "log_keep_entries"),
            (self.snapshot_chunk_keys, "snapshot_chunk_keys"),
            (self.refill_chunk_bytes, "refill_chunk_bytes"),
            (self.append_max_entries, "append_max_entries"),
            (self.batch_pull_bytes, "batch_pull_bytes"),
            (self.writeback_batch_bytes, "writeback_batch_bytes"),
            (
                self.recent_index_window_entries,
                "recent_index_window_entries",
            ),
        ] {
            if v == 0 {
                return Err(ParamsError::Zero(name));
            }
        }
        Ok(())
    }
}

/// What a node's durable tiers held at a restart (see [`WitnessCore::restore`]).
#[derive(Clone, Debug, Default)]
pub struct Durable {
    /// The last `PmemRecord::Meta`: (term, voted_for).
    pub meta: Option<(u64, Option<NodeId>)>,
    /// Live entry records of the node's Log (head) or Buffer (backup) region, by index.
    pub entries: Vec<Entry>,
    /// A backup's SSD segments as found (any order): their whole bytes from offset 0.
    pub ssd: Vec<DurableSeg>,
}

/// One SSD segment file at a restart.
#[derive(Clone, Debug)]
pub struct DurableSeg {
    pub seg: u64,
    pub log: SsdLog,
    pub bytes: Vec<u8>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RestoreError {
    #[error(transparent)]
    Params(#[from] ParamsError),
    #[error("the durable log has a hole at index {0}")]
    Hole(u64),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Region {
    /// Raft term and vote.
    Meta,
    /// A head's log (key-only entries).
    Log,
    /// A backup's NVMM buffer (full entries until written back, M6).
    Buffer,
}

/// What a `PmemAppend` record holds (postcard-encoded in `rec`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PmemRecord {
    Meta {
        term: u64,
        voted_for: Option<NodeId>,
    },
    Entry(Entry),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoleKind {
    Follower,
    Candidate,
    /// Won the election, reconciling by RequestLog; commits and serves nothing (M14).
    Provisional,
    Leader,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryStats {
    pub started_us: u64,
    pub finished_us: u64,
    pub missing_at_start: u64,
    pub batch_entries: u64,
    pub priority_pulls: u64,
    pub installed: u64,
    /// Entries pulled before the election (M15) and installed at its start.
    pub proactive_installed: u64,
    pub gets_served_after_pull: u64,
    /// Gets answered at once during the recovery (the value was already here).
    pub gets_hit: u64,
    /// PriorityPulls answered, with their total and largest latency: what a miss costs.
    pub priority_pulls_answered: u64,
    pub priority_pull_latency_us_total: u64,
    pub priority_pull_latency_us_max: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    Peer {
        from: NodeId,
        msg: PeerMsg,
    },
    Client {
        tag: u64,
        req: ClientReq,
    },
    PmemPersisted {
        seq: u64,
    },
    SsdWritten {
        id: u64,
        result: Result<(), String>,
    },
    SsdRead {
        id: u64,
        result: Result<Vec<u8>, String>,
    },
    Tick,
    /// An operator's membership change (M22–M24); refused unless this node is the serving
    /// leader with no configuration change pending (see [`WitnessCore::last_reconfig_error`]).
    Reconfigure(Change),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    Send {
        to: NodeId,
        msg: PeerMsg,
    },
    PmemAppend {
        seq: u64,
        region: Region,
        rec: Vec<u8>,
    },
    PmemTruncate {
        region: Region,
        from_index: u64,
    },
    PmemFree {
        region: Region,
        through_index: u64,
    },
    SsdWrite {
        id: u64,
        seg: u64,
        log: SsdLog,
        off: u64,
        bytes: Vec<u8>,
        class: IoClass,
    },
    SsdRead {
        id: u64,
        seg: u64,
        off: u64,
        len: u32,
        class: IoClass,
    },
    SsdFree {
        seg: u64,
    },
    Reply {
        tag: u64,
        reply: ClientReply,
    },
    Role {
        term: u64,
        role: RoleKind,
        leader: Option<NodeId>,
    },
    /// A new leader holds every committed value (its missing set is empty, M19): from here it
    /// serves every Get locally. Given once per leadership, at once when nothing was missing.
    Recovered(RecoveryStats),
}

#[derive(Clone, Debug)]
enum Slot {
    Entry(Entry),
    /// Adopted from a voting backup's vote reply (M13): the index exists, its content is not
    /// known here; never counted as held, resolved by reconciliation.
    Unknown {
        term: u64,
    },
    /// A backup's entry written back to SSD, with where it is (Noops included: the window of
    /// recent indexes must survive GC and a restart). Its location is a reference of its
    /// segment (see `ssd::Space`).
    Flushed {
        term: u64,
        loc: Option<Loc>,
    },
}

impl Slot {
    fn term(&self) -> u64 {
        match self {
            Slot::Entry(e) => e.term,
            Slot::Unknown { term } | Slot::Flushed { term, .. } => *term,
        }
    }
}

/// A Raft log from `base_index + 1`; a backup trims written-back slots past its recent-index
/// window (they are committed, so they match every leader).
#[derive(Clone, Debug, Default)]
struct Log {
    base_index: u64,
    base_term: u64,
    slots: VecDeque<Slot>,
}

impl Log {
    fn last_index(&self) -> u64 {
        self.base_index + self.slots.len() as u64
    }
    fn last_term(&self) -> u64 {
        self.slots.back().map_or(self.base_term, Slot::term)
    }
    fn slot(&self, i: u64) -> Option<&Slot> {
        if i <= self.base_index {
            return None;
        }
        self.slots.get((i - self.base_index - 1) as usize)
    }
    fn slot_mut(&mut self, i: u64) -> Option<&mut Slot> {
        if i <= self.base_index {
            return None;
        }
        self.slots.get_mut((i - self.base_index - 1) as usize)
    }
    fn entry(&self, i: u64) -> Option<&Entry> {
        match self.slot(i) {
            Some(Slot::Entry(e)) => Some(e),
            _ => None,
        }
    }
    /// The term at `i` when known (0 for index 0).
    fn term_at(&self, i: u64) -> Option<u64> {
        if i == 0 {
            return Some(0);
        }
        if i == self.base_index {
            return Some(self.base_term);
        }
        match self.slot(i)? {
            Slot::Unknown { .. } => None,
            s => Some(s.term()),
        }
    }
    /// Raft's consistency check for AppendEntries. Trimmed indexes are committed, so match.
    fn matches(&self, index: u64, term: u64) -> bool {
        index <= self.base_index || self.term_at(index) == Some(term)
    }
    fn truncate_from(&mut self, i: u64) {
        let keep = i.saturating_sub(self.base_index + 1) as usize;
        self.slots.truncate(keep);
    }
    fn push(&mut self, s: Slot) {
        self.slots.push_back(s);
    }
}

#[derive(Clone, Debug)]
struct PullState {
    key: Vec<u8>,
    sent_us: u64,
}

#[derive(Clone, Debug)]
struct BatchStream {
    id: u64,
    to: NodeId,
    cursor: u64,
    in_flight_since: Option<u64>,
    done: bool,
}

/// A designated successor's proactive pull after a soft timeout (M15): entries of the backup's
/// log, newest per key, kept until this head wins (then installed, stamp-checked) or hears the
/// leader again (then aborted and dropped).
#[derive(Clone, Debug)]
struct Proactive {
    stream: BatchStream,
    entries: HashMap<Vec<u8>, Entry>,
    bytes: usize,
    /// `proactive_bytes_max` reached: pulling stops, what is held is kept.
    full: bool,
}

/// Missing keys one pass over the key table collects for the end of a recovery (M19): the
/// stream has passed them all by then, so few are left; a bound keeps a pathological case
/// (pulls that keep finding older versions) from building a copy of the key set.
const LEFTOVER_SCAN_KEYS_MAX: usize = 65_536;

/// The new primary's live recovery (M17–M19).
#[derive(Clone, Debug)]
struct LiveRecovery {
    /// What the BatchPull stream left (M19): found by one scan of the key table when the
    /// stream ends (the missing set itself is [`Head::missing`], a count), pulled in order; a
    /// key no longer missing by then is skipped. Rescanned only if it runs dry while keys are
    /// still missing (a pull that found only an older version).
    leftover: Vec<Vec<u8>>,
    pending_gets: HashMap<Vec<u8>, Vec<u64>>,
    pending_get_count: usize,
    pulls: HashMap<u64, PullState>,
    pull_by_key: HashMap<Vec<u8>, u64>,
    batch: BatchStream,
    stats: RecoveryStats,
}

/// Reconciliation (M14): for each index of (commit, last] the answer of every voting backup.
#[derive(Clone, Debug)]
struct Recon {
    lo: u64,
    hi: u64,
    answers: BTreeMap<u64, BTreeMap<NodeId, Option<Entry>>>,
    asked_us: u64,
}

#[derive(Clone, Debug)]
struct Lead {
    next: BTreeMap<NodeId, u64>,
    matched: BTreeMap<NodeId, u64>,
    /// Per voter, the latest round (leader send time) it answered in this term (M3).
    acked_round_us: BTreeMap<NodeId, u64>,
    lease_until_us: u64,
    /// Nothing is served before the leader's first entry of its term commits.
    noop_index: Option<u64>,
    pending_puts: BTreeMap<u64, u64>,
    recon: Option<Recon>,
    recovery: Option<LiveRecovery>,
    last_heartbeat_us: u64,
    lease_lost_since_us: Option<u64>,
}

/// A head's state machine: the key table (the oracle, M1) and the value table.
///
/// Written only through its methods, which keep [`Head::missing`]: the number of keys whose
/// value is older than the key table's stamp. A new primary's recovery (M19) needs that set's
/// size at every step and its members only once the BatchPull stream has passed; a set built
/// at the election cost a pass over every key while nothing was served (135 ms for 250 k
/// keys, more as the shard grows), where a count kept at each write costs O(1).
#[derive(Clone, Debug, Default)]
struct Head {
    keys: CountedMap<Stamp>,
    values: CountedMap<(Stamp, Vec<u8>)>,
    missing: usize,
}

impl Head {
    fn is_missing(&self, key: &[u8]) -> bool {
        let ks = self.keys.get(key).copied().unwrap_or(Stamp::ZERO);
        self.values.get(key).map_or(Stamp::ZERO, |v| v.0) < ks
    }

    /// Runs `f` on the tables and adjusts the count for `key`, the one key `f` changes.
    fn update(&mut self, key: &[u8], f: impl FnOnce(&mut Self)) {
        let before = self.is_missing(key);
        f(self);
        match (before, self.is_missing(key)) {
            (false, true) => self.missing += 1,
            (true, false) => self.missing -= 1,
            _ => {}
        }
    }

    /// Raises `key`'s stamp in the key table (never lowers it).
    fn raise_key(&mut self, key: &[u8], st: Stamp) {
        self.update(key, |h| {
            let mut e = h.keys.get_or_insert(key.to_vec(), Stamp::ZERO);
            *e = (*e).max(st);
        });
    }

    fn set_value(&mut self, key: &[u8], st: Stamp, value: Vec<u8>) {
        self.update(key, |h| {
            h.values.insert(key.to_vec(), (st, value));
        });
    }

    /// Drops every value (an old primary serving as a witness, M24).
    fn clear_values(&mut self) {
        self.values.clear_and_free();
        self.missing = self.keys.values().filter(|&&ks| ks > Stamp::ZERO).count();
    }

    /// Up to `max` missing keys, by a pass over the key table.
    fn scan_missing(&self, max: usize) -> Vec<Vec<u8>> {
        self.keys
            .keys()
            .filter(|k| self.is_missing(k))
            .take(max)
            .cloned()
            .collect()
    }

    /// The count against a recount (deep invariants: O(keys)).
    fn check_missing(&self) {
        let n = self.keys.keys().filter(|k| self.is_missing(k)).count();
        assert_eq!(self.missing, n, "missing-key count drifted from the tables");
    }
}

#[derive(Clone, Debug)]
enum ReadFor {
    PriorityPull {
        to: NodeId,
        id: u64,
        key: Vec<u8>,
        buffered: Vec<Entry>,
        /// Where the read starts (the page the index names).
        off: u64,
    },
    RequestLog {
        to: NodeId,
        index: u64,
        loc: Loc,
    },
    BatchPull {
        to: NodeId,
        stream: u64,
        seg: u64,
        off: u64,
        len: u32,
    },
    /// One page group of a popular-keys BatchPull answer (`recovery.rs`).
    HotBatch {
        group: u64,
        /// Where the read pages start (entries are checked against their place).
        off: u64,
    },
    /// A GC pass's read of its victim (M9).
    Gc,
}

/// A backup's engine (M5–M10). SIMPLIFIED: one worker (M7).
#[derive(Clone, Debug)]
struct Backup {
    /// DRAM index key → (stamp, location) of the newest written-back version. Every location
    /// is a reference of its segment in `space`.
    index: CountedMap<(Stamp, Loc)>,
    /// Segments of the hot and cold logs and their live bytes.
    space: Space,
    /// Flushed slots of the recent-log window that hold a location (references too).
    slot_refs: u64,
    written_back_through: u64,
    /// The writeback in flight (at most one).
    wb_in_flight: Option<WbBatch>,
    /// The GC pass in flight (at most one).
    gc: Option<GcPass>,
    eligible_since_us: Option<u64>,
    /// SSD reads in flight: io id → (what for, segment read).
    reads: HashMap<u64, (ReadFor, u64)>,
}

impl Backup {
    fn new() -> Self {
        Backup {
            index: CountedMap::default(),
            space: Space::default(),
            slot_refs: 0,
            written_back_through: 0,
            wb_in_flight: None,
            gc: None,
            eligible_since_us: None,
            reads: HashMap::new(),
        }
    }
}

/// One SSD write of a batch (writeback or GC), kept to retry it unchanged.
#[derive(Clone, Debug)]
struct SsdWriteReq {
    id: u64,
    seg: u64,
    log: SsdLog,
    off: u64,
    bytes: Vec<u8>,
}

/// A writeback batch: its SSD writes (one per log it touches) and the buffer range it empties.
#[derive(Clone, Debug)]
struct WbBatch {
    writes: Vec<SsdWriteReq>,
    /// Entries with their locations.
    placed: Vec<(Entry, Loc)>,
    /// Last buffer index the batch covers.
    through: u64,
}

/// A GC pass (M9): read the victim, rewrite what is referenced, move the references, free it.
#[derive(Clone, Debug)]
struct GcPass {
    victim: u64,
    /// The rewrites in flight.
    writes: Vec<SsdWriteReq>,
    /// Rewritten entries: (entry, old location, new location).
    moved: Vec<(Entry, Loc, Loc)>,
    /// Every rewrite is durable and the references moved; waiting for reads of the victim.
    freeing: bool,
}

#[derive(Clone, Debug, Default)]
pub struct Counters {
    pub votes_refused_in_lease: u64,
    pub adoptions: u64,
    pub reconciled_dropped: u64,
    pub gets_refused_no_lease: u64,
    pub values_unavailable: u64,
    pub writebacks: u64,
    pub ssd_errors: u64,
    pub gc_passes: u64,
    pub gc_segments_freed: u64,
    pub gc_bytes_rewritten: u64,
    /// Entries GC moved from the cold log to the hot one (a key became popular, M10).
    pub gc_moved_to_hot: u64,
    pub proactive_started: u64,
    pub proactive_aborted: u64,
    /// Peer messages refused because they contradict the protocol (an AppendEntries rewriting
    /// a committed index, a second leader in this node's own term, entries out of order or
    /// of a later term than their message). Links are authenticated and checksummed, so an
    /// honest peer never sends one: each is a bug or a peer speaking nonsense, and refusing it
    /// (rather than asserting) keeps one bad peer from crashing the group.
    pub refused_peer_msgs: u64,
    pub snapshots_sent: u64,
    pub snapshots_installed: u64,
    /// Value refills of a backup behind the truncated log (`core/refill.rs`).
    pub refills_sent: u64,
    pub refills_installed: u64,
    /// Membership changes this node proposed on its own (M22–M24).
    pub reconfigs: u64,
    /// Times this head, an old primary, dropped its value table to serve as a witness (M24).
    pub values_dropped_as_witness: u64,
    /// Times this leader stepped down because no quorum renewed its lease for an election
    /// timeout (CheckQuorum).
    pub quorum_lost_step_downs: u64,
}

#[derive(Clone)]
enum Deferred {
    Send(NodeId, PeerMsg),
}

/// `Clone` so a model checker can branch on a core's state (tests/model_check_witness.rs).
#[derive(Clone)]
pub struct WitnessCore {
    id: NodeId,
    kind: Kind,
    cfg: Config,
    p: Params,
    now: u64,
    term: u64,
    voted_for: Option<NodeId>,
    role: RoleKind,
    leader_hint: Option<NodeId>,
    log: Log,
    commit: u64,
    applied: u64,
    /// Highest index persisted in NVMM (matching the current log).
    persisted: u64,
    /// Highest index verified to match the current leader in this term.
    leader_match: u64,
    leader_sent_us: u64,
    heard_leader_us: Option<u64>,
    election_deadline_us: u64,
    votes: BTreeSet<NodeId>,
    vote_round_us: u64,
    next_seq: u64,
    next_io: u64,
    /// Appended log records not yet reported durable: (seq, through index, term at it).
    unpersisted: VecDeque<(u64, u64, u64)>,
    /// A Meta record not yet durable: every send waits for it (a vote or term must be durable
    /// before anyone hears of it).
    meta_pending: Option<u64>,
    deferred: Vec<Deferred>,
    head: Head,
    lead: Option<Lead>,
    backup: Backup,
    leaders_seen: BTreeMap<u64, NodeId>,
    proactive: Option<Proactive>,
    /// Detector, popularity and pacing (`recovery.rs`).
    rec: RecoveryState,
    reconf: reconfig::Reconf,
    snap: snapshot::Snap,
    refill: refill::Refill,
    pub counters: Counters,
    out: Vec<Output>,
}

/// Terms for which the local ≤1-leader check remembers a leader.
const LEADERS_SEEN_TERMS_MAX: usize = 64;

fn mix(a: u64, b: u64) -> u64 {
    let mut x = a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_add(0xD1B5_4A32_D192_ED03);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^ (x >> 29)
}

impl WitnessCore {
    pub fn new(id: NodeId, cfg: Config, mut p: Params, now_us: u64) -> Result<Self, ParamsError> {
        p.validate()?;
        cfg.validate()?;
        let kind = cfg.kind(id).ok_or(ParamsError::NotMember(id))?;
        if p.recovery == Recovery::SingleLog {
            // The single-log ablation (issue 25 item 5): one SSD log, no hot/cold placement.
            p.ssd_logs = SsdLogs::Single;
        }
        let rec = RecoveryState::new(id, &p, now_us)?;
        let backup = Backup::new();
        let mut c = WitnessCore {
            id,
            kind,
            cfg,
            p,
            now: now_us,
            term: 0,
            voted_for: None,
            role: RoleKind::Follower,
            leader_hint: None,
            log: Log::default(),
            commit: 0,
            applied: 0,
            persisted: 0,
            leader_match: 0,
            leader_sent_us: 0,
            heard_leader_us: None,
            election_deadline_us: 0,
            votes: BTreeSet::new(),
            vote_round_us: 0,
            next_seq: 1,
            next_io: 1,
            unpersisted: VecDeque::new(),
            meta_pending: None,
            deferred: Vec::new(),
            head: Head::default(),
            lead: None,
            backup,
            leaders_seen: BTreeMap::new(),
            proactive: None,
            rec,
            reconf: reconfig::Reconf::default(),
            snap: snapshot::Snap::default(),
            refill: refill::Refill::default(),
            counters: Counters::default(),
            out: Vec::new(),
        };
        c.reconf_init();
        c.reset_election_timer();
        Ok(c)
    }

    /// Rebuilds a node after a restart from what its NVMM and SSD hold (spec (d): "a backup
    /// restart that rebuilds its index from segments plus the NVMM buffer"). The driver replays
    /// its regions, applying `PmemTruncate` and `PmemFree` as it did live, and passes:
    /// the last Meta record, the live entry records of the Log/Buffer region in index order,
    /// and (backups) every SSD segment's bytes. A torn batch at a segment's end (a crash during
    /// a writeback, before its `SsdWritten`) is ignored: its entries are still in the buffer.
    ///
    /// A head comes back as a follower with its key-only log and learns the commit index from
    /// the next leader (its value table is DRAM: an old primary returns without values). A
    /// backup takes everything on SSD as committed (only committed entries are written back).
    pub fn restore(
        id: NodeId,
        cfg: Config,
        p: Params,
        now_us: u64,
        durable: Durable,
    ) -> Result<Self, RestoreError> {
        let mut c = WitnessCore::new(id, cfg, p, now_us)?;
        if let Some((term, voted_for)) = durable.meta {
            c.term = term;
            c.voted_for = voted_for;
        }
        let mut log = Log::default();
        // Configuration entries written back to SSD (a backup's newest one is in force).
        let mut configs: Vec<(u64, Config)> = Vec::new();
        if c.kind == Kind::Backup {
            configs = c.restore_ssd(&mut log, durable.ssd);
        }
        let mut needs_snapshot = false;
        if c.kind == Kind::Head {
            // A head's NVMM log starts past index 1 only if it was truncated (M24; a head
            // always keeps its last entry, so an empty log after a vote is one too): its key
            // table cannot be rebuilt from it, and it waits for the leader's snapshot.
            let first = durable.entries.first().map(|e| e.index);
            needs_snapshot = first.map_or(durable.meta.is_some_and(|m| m.0 > 0), |f| f > 1);
            if let Some(f) = first.filter(|&f| f > 1) {
                log.base_index = f - 1;
            }
        }
        if c.kind == Kind::Backup {
            let last = log.last_index();
            if let Some(f) = durable.entries.iter().find(|e| e.index > last) {
                if f.index > last + 1 {
                    c.refill_restored(&mut log, f.index - 1, f.term);
                }
            }
        }
        for e in durable.entries {
            if e.index <= log.last_index() {
                continue; // written back and not yet freed when the node stopped
            }
            if let Op::Config(cf) = &e.op {
                configs.push((e.index, cf.clone()));
            }
            if e.index != log.last_index() + 1 {
                return Err(RestoreError::Hole(log.last_index() + 1));
            }
            log.push(Slot::Entry(e));
        }
        c.persisted = log.last_index();
        c.log = log;
        c.snap.needs = needs_snapshot;
        c.reconf_restore(configs);
        c.reset_election_timer();
        Ok(c)
    }

    // ---- accessors (tests, status, drivers) ----

    pub fn id(&self) -> NodeId {
        self.id
    }
    pub fn term(&self) -> u64 {
        self.term
    }
    pub fn role(&self) -> RoleKind {
        self.role
    }
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    pub fn commit_index(&self) -> u64 {
        self.commit
    }
    pub fn last_index(&self) -> u64 {
        self.log.last_index()
    }
    pub fn leader_hint(&self) -> Option<NodeId> {
        self.leader_hint
    }
    /// Serving as leader: elected, reconciled and its first entry committed.
    pub fn is_serving(&self) -> bool {
        self.role == RoleKind::Leader
            && self
                .lead
                .as_ref()
                .is_some_and(|l| l.noop_index.is_some_and(|n| n <= self.commit))
    }
    pub fn in_recovery(&self) -> bool {
        self.lead.as_ref().is_some_and(|l| l.recovery.is_some())
    }
    pub fn missing_keys(&self) -> usize {
        self.lead
            .as_ref()
            .and_then(|l| l.recovery.as_ref())
            .map_or(0, |_| self.head.missing)
    }
    /// The key table's stamp for `key` (heads).
    pub fn key_stamp(&self, key: &[u8]) -> Option<Stamp> {
        self.head.keys.get(key).copied()
    }
    /// The locally held value and its stamp (heads).
    pub fn local_value(&self, key: &[u8]) -> Option<(Stamp, &[u8])> {
        self.head.values.get(key).map(|(s, v)| (*s, v.as_slice()))
    }
    /// The backup's indexed stamp for `key`.
    pub fn backup_index_stamp(&self, key: &[u8]) -> Option<Stamp> {
        self.backup.index.get(key).map(|(s, _)| *s)
    }
    /// The log holding a backup's indexed version of `key` (M10).
    pub fn backup_index_log(&self, key: &[u8]) -> Option<SsdLog> {
        let (_, loc) = self.backup.index.get(key)?;
        self.backup.space.seg(loc.seg).map(|g| g.log)
    }
    /// Bytes a backup's SSD segments take (what GC keeps under `ssd_capacity_bytes`).
    pub fn ssd_used_bytes(&self) -> u64 {
        self.backup.space.used_bytes()
    }
    /// The leader's lease end (0 when not leading).
    pub fn lease_until_us(&self) -> u64 {
        self.lead.as_ref().map_or(0, |l| l.lease_until_us)
    }
    pub fn written_back_through(&self) -> u64 {
        self.backup.written_back_through
    }

    pub fn take_outputs(&mut self) -> Vec<Output> {
        std::mem::take(&mut self.out)
    }

    // ---- the one entry point ----

    pub fn handle(&mut self, now_us: u64, input: Input) {
        #[cfg(debug_assertions)]
        let before = (self.commit, self.term, self.backup.written_back_through);
        self.now = self.now.max(now_us);
        match input {
            Input::Peer { from, msg } => self.on_peer(from, msg),
            Input::Client { tag, req } => self.on_client(tag, req),
            Input::PmemPersisted { seq } => self.on_persisted(seq),
            Input::SsdWritten { id, result } => self.on_ssd_written(id, result),
            Input::SsdRead { id, result } => self.on_ssd_read(id, result),
            Input::Tick => self.on_tick(),
            Input::Reconfigure(change) => self.on_reconfigure(change),
        }
        self.after_input();
        #[cfg(debug_assertions)]
        {
            assert!(self.commit >= before.0, "commit index decreased");
            assert!(self.term >= before.1, "term decreased");
            assert!(
                self.backup.written_back_through >= before.2,
                "writeback went backwards"
            );
            self.check_invariants();
        }
    }

    /// Cheap invariants, run after every input in debug builds. What the tests rely on:
    pub fn check_invariants(&self) {
        // The missing count is recounted in the deep check; here only its bound.
        assert!(self.head.missing <= self.head.keys.len(), "more keys missing than known");
        // Election safety, part 1: only voting heads ever lead, only heads run (M12).
        if self.role != RoleKind::Follower {
            let ok = if self.role == RoleKind::Candidate {
                self.cfg.may_run(self.id)
            } else {
                self.cfg.may_stand(self.id)
            };
            assert!(ok, "node {} ({:?}) is {:?}", self.id, self.kind, self.role);
        }
        // Election safety, part 2, as seen locally: at most one leader per term.
        // (`leaders_seen` is filled when a leader is heard; a conflict panics there.)
        assert!(self.applied <= self.commit, "applied past commit");
        self.rec.check_invariants();
        assert!(self.commit <= self.log.last_index(), "commit past the log");
        // Every committed index is known here (no Unknown slot at or below commit).
        if let Some(Slot::Unknown { .. }) = self.log.slot(self.commit) {
            panic!("commit {} is an unknown (adopted) slot", self.commit);
        }
        if let Some(l) = &self.lead {
            assert!(matches!(
                self.role,
                RoleKind::Leader | RoleKind::Provisional
            ));
            // Provisional quiet: nothing of this term is appended, so nothing can commit.
            if l.recon.is_some() {
                assert!(l.noop_index.is_none() && l.pending_puts.is_empty());
            }
        }
        if self.kind == Kind::Backup {
            // A backup never writes back an uncommitted entry (M8).
            let b = &self.backup;
            assert!(
                b.written_back_through <= self.commit,
                "wrote back past commit"
            );
            if let Some(w) = &b.wb_in_flight {
                assert!(w.through <= self.commit, "writeback batch past commit");
            }
            // GC (M9): every index and window location is a counted reference of a segment
            // that exists (a reference into a freed segment panics where it is taken), and a
            // segment is freed only with none (`Space::free`).
            b.space.check_invariants();
            assert_eq!(
                b.space.refs_total(),
                b.index.len() as u64 + b.slot_refs,
                "SSD references out of step with the index and the window"
            );
            if let Some(g) = &b.gc {
                assert!(b.space.seg(g.victim).is_some(), "GC victim already freed");
                assert!(!b.space.is_active(g.victim), "GC of an active segment");
            }
        }
    }

    /// Expensive checks for simulations and tests: the value table never runs ahead of the
    /// key table (installs never pass the oracle), and the missing set is exact.
    pub fn check_invariants_deep(&self) {
        self.check_invariants();
        self.check_tiers_deep();
        if self.kind == Kind::Backup {
            // Pulls scan only `unflushed_slots`: nothing before it may still be an entry.
            let skipped = self.log.slots.len() - self.unflushed_slots().count();
            assert!(
                self.log.slots.iter().take(skipped).all(|s| !matches!(s, Slot::Entry(_))),
                "an entry at or below written_back_through"
            );
            // The reference counts are exact: recount them from the index and the window.
            let b = &self.backup;
            let mut refs: HashMap<u64, (u64, u64)> = HashMap::new();
            let locs = b
                .index
                .values()
                .map(|(_, l)| *l)
                .chain(self.log.slots.iter().filter_map(|s| match s {
                    Slot::Flushed { loc, .. } => *loc,
                    _ => None,
                }));
            for l in locs {
                let seg = b.space.seg(l.seg);
                assert!(seg.is_some(), "location {l:?} in a freed segment");
                assert!(
                    l.off + l.len as u64 <= seg.unwrap().end,
                    "location {l:?} past its segment"
                );
                let r = refs.entry(l.seg).or_default();
                r.0 += 1;
                r.1 += l.len as u64;
            }
            for (s, g) in b.space.segs() {
                assert_eq!(
                    (g.refs, g.live_bytes),
                    refs.get(&s).copied().unwrap_or_default(),
                    "segment {s} accounting"
                );
            }
        }
        for (k, (vs, _)) in &self.head.values {
            let ks = self.head.keys.get(k).copied().unwrap_or(Stamp::ZERO);
            if self.role == RoleKind::Leader {
                assert!(*vs <= ks, "value stamp {vs:?} above key table {ks:?}");
            }
        }
        self.head.check_missing();
    }

    // ---- plumbing ----

    fn msg(&self, body: PeerBody) -> PeerMsg {
        PeerMsg {
            term: self.term,
            epoch: self.cfg.epoch,
            body,
        }
    }

    fn send(&mut self, to: NodeId, body: PeerBody) {
        let msg = self.msg(body);
        if self.meta_pending.is_some() {
            self.deferred.push(Deferred::Send(to, msg));
        } else {
            self.out.push(Output::Send { to, msg });
        }
    }

    fn pmem_append(&mut self, region: Region, rec: &PmemRecord) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.out.push(Output::PmemAppend {
            seq,
            region,
            rec: crate::witness::proto::encode(rec),
        });
        seq
    }

    fn persist_meta(&mut self) {
        let rec = PmemRecord::Meta {
            term: self.term,
            voted_for: self.voted_for,
        };
        let seq = self.pmem_append(Region::Meta, &rec);
        self.meta_pending = Some(seq);
    }

    fn log_region(&self) -> Region {
        if self.kind == Kind::Backup {
            Region::Buffer
        } else {
            Region::Log
        }
    }

    /// Appends an entry to the local log and NVMM (heads persist key-only records).
    fn append_local(&mut self, e: Entry) {
        debug_assert_eq!(e.index, self.log.last_index() + 1);
        // A substitute persists values too (M22 Decide).
        let rec = if self.cfg.gets_values(self.id) {
            e.clone()
        } else {
            e.key_only()
        };
        let region = self.log_region();
        let seq = self.pmem_append(region, &PmemRecord::Entry(rec));
        self.unpersisted.push_back((seq, e.index, e.term));
        let cfg = match &e.op {
            Op::Config(c) => Some((e.index, c.clone())),
            _ => None,
        };
        self.log.push(Slot::Entry(e));
        if let Some((i, c)) = cfg {
            self.config_appended(i, c);
        }
    }

    fn truncate_local(&mut self, from: u64) {
        if from > self.log.last_index() {
            return;
        }
        assert!(from > self.commit, "truncating committed index {from}");
        self.log.truncate_from(from);
        self.persisted = self.persisted.min(from - 1);
        self.leader_match = self.leader_match.min(from - 1);
        let region = self.log_region();
        self.out.push(Output::PmemTruncate {
            region,
            from_index: from,
        });
        self.config_truncated(from);
    }

    fn set_role(&mut self, role: RoleKind) {
        if self.role != role {
            self.role = role;
            self.out.push(Output::Role {
                term: self.term,
                role,
                leader: self.leader_hint,
            });
        }
    }

    fn note_leader(&mut self, term: u64, leader: NodeId) {
        if let Some(prev) = self.leaders_seen.insert(term, leader) {
            assert_eq!(prev, leader, "two leaders in term {term}");
        }
        while self.leaders_seen.len() > LEADERS_SEEN_TERMS_MAX {
            self.leaders_seen.pop_first();
        }
    }

    fn reset_election_timer(&mut self) {
        if !self.cfg.may_run(self.id) || self.snap.needs {
            self.election_deadline_us = u64::MAX;
            return;
        }
        // A non-voting head runs only to learn of a promotion it missed, after the voters,
        // and never before it has followed a leader (a spare waiting to be added would only
        // inflate its term, and its first ack would then depose the leader that adds it).
        let late = if self.cfg.may_stand(self.id) {
            0
        } else if self.heard_leader_us.is_some() {
            self.p.election_timeout_us
        } else {
            self.election_deadline_us = u64::MAX;
            return;
        };
        // The designated successor (lowest-id witness) waits least; the primary's own slot
        // counts like any head. A per-term component breaks repeated split votes.
        let rank = self
            .cfg
            .members
            .iter()
            .filter(|m| m.voting && m.kind == Kind::Head && m.id < self.id)
            .count() as u64;
        let j = self.p.election_jitter_us.max(1);
        let jitter = rank * j + mix(self.id as u64, self.term) % (j / 2 + 1);
        self.election_deadline_us = self.now + self.p.election_timeout_us + jitter + late;
    }

    /// A higher term seen: become a follower of it.
    fn step_down(&mut self, term: u64) {
        if term > self.term {
            self.term = term;
            self.voted_for = None;
            self.persist_meta();
            self.leader_hint = None;
            self.leader_match = 0;
            // Rounds are the leader's clock: never echo one leader's time to another.
            self.leader_sent_us = 0;
        }
        if let Some(l) = self.lead.take() {
            for (_, tag) in l.pending_puts {
                self.out.push(Output::Reply {
                    tag,
                    reply: ClientReply::Indeterminate,
                });
            }
            if let Some(r) = l.recovery {
                for tags in r.pending_gets.into_values() {
                    for tag in tags {
                        self.out.push(Output::Reply {
                            tag,
                            reply: ClientReply::NotLeader { hint: None },
                        });
                    }
                }
            }
        }
        self.votes.clear();
        self.set_role(RoleKind::Follower);
    }

    fn after_input(&mut self) {
        if self.kind == Kind::Backup {
            self.maybe_writeback();
            self.maybe_gc();
        }
        if self.role == RoleKind::Leader {
            self.advance_commit();
        }
        self.apply_committed();
        self.operator_answer();
        self.maybe_compact();
        if self.role == RoleKind::Leader {
            self.drive_recovery();
        }
    }

    // ---- inputs ----

    fn on_persisted(&mut self, seq: u64) {
        let mut through = None;
        while let Some(&(s, idx, term)) = self.unpersisted.front() {
            if s > seq {
                break;
            }
            self.unpersisted.pop_front();
            if self.log.term_at(idx) == Some(term) || idx <= self.log.base_index {
                through = Some(idx);
            }
        }
        if let Some(t) = through {
            self.persisted = self.persisted.max(t.min(self.log.last_index()));
        }
        if self.meta_pending.is_some_and(|m| m <= seq) {
            self.meta_pending = None;
            for d in std::mem::take(&mut self.deferred) {
                let Deferred::Send(to, msg) = d;
                // A deferred message of an older term is stale; send it anyway only if the
                // term did not move on (receivers would refuse it otherwise).
                if msg.term == self.term {
                    self.out.push(Output::Send { to, msg });
                }
            }
        }
        if self.role == RoleKind::Follower {
            if let Some(leader) = self.leader_hint {
                if through.is_some() {
                    self.send_ack(leader, true);
                }
            }
        }
    }

    fn send_ack(&mut self, leader: NodeId, success: bool) {
        let match_index = if success {
            self.leader_match.min(self.persisted)
        } else {
            // The leader probes again below this: the last index this head can vouch for (its
            // adopted, content-less slots excluded), so one refusal skips them all.
            let last = self.log.last_index();
            (self.log.base_index + 1..=last)
                .find(|&i| matches!(self.log.slot(i), Some(Slot::Unknown { .. })))
                .map_or(last, |i| i - 1)
        };
        let sent_us = self.leader_sent_us;
        self.send(
            leader,
            PeerBody::AppendAck {
                success,
                match_index,
                sent_us,
                durable: self.durable_for_leader(match_index),
                want_snapshot: self.snap.needs,
            },
        );
    }

    fn on_tick(&mut self) {
        match self.role {
            RoleKind::Leader | RoleKind::Provisional => {
                self.heard_leader_us = Some(self.now);
                let due = self
                    .lead
                    .as_ref()
                    .is_some_and(|l| self.now >= l.last_heartbeat_us + self.p.heartbeat_us);
                if due {
                    self.heartbeat();
                }
                self.reconfig_policy();
                self.check_quorum();
                self.rec_ship_popularity();
                if self.role == RoleKind::Provisional {
                    self.recon_retry();
                }
            }
            RoleKind::Follower | RoleKind::Candidate => {
                if self.now >= self.election_deadline_us && self.rec_hard_timeout() {
                    self.start_election();
                }
                self.drive_proactive();
            }
        }
    }

    /// A leader that has not renewed its lease for a whole election timeout steps down
    /// (CheckQuorum): the rest of the group has moved on or is unreachable.
    fn check_quorum(&mut self) {
        let Some(l) = self.lead.as_mut() else { return };
        if self.now < l.lease_until_us {
            l.lease_lost_since_us = None;
            return;
        }
        let since = *l.lease_lost_since_us.get_or_insert(self.now);
        if self.now >= since + self.p.election_timeout_us {
            self.counters.quorum_lost_step_downs += 1;
            let t = self.term;
            self.step_down(t);
            self.reset_election_timer();
        }
    }

    // ---- election (M12, M13, M3) ----

    fn start_election(&mut self) {
        if !self.cfg.may_run(self.id) || self.snap.needs {
            return; // a backup never runs (M12); nor a head whose key table is incomplete
        }
        self.term += 1;
        self.voted_for = Some(self.id);
        self.leader_hint = None;
        self.persist_meta();
        self.votes = BTreeSet::from([self.id]);
        self.vote_round_us = self.now;
        self.set_role(RoleKind::Candidate);
        self.reset_election_timer();
        let (li, lt) = (self.log.last_index(), self.log.last_term());
        let voters: Vec<NodeId> = self.cfg.voters().filter(|&v| v != self.id).collect();
        for v in voters {
            self.send(
                v,
                PeerBody::RequestVote {
                    candidate: self.id,
                    last_index: li,
                    last_term: lt,
                },
            );
        }
        self.maybe_win();
    }

    fn on_request_vote(&mut self, from: NodeId, term: u64, last_index: u64, last_term: u64) {
        let (my_li, my_lt) = (self.log.last_index(), self.log.last_term());
        let config = self.pending_config_entry();
        let refuse = |c: &mut Self, in_lease: bool| {
            c.send(
                from,
                PeerBody::Vote {
                    granted: false,
                    last_index: my_li,
                    last_term: my_lt,
                    in_lease,
                    config,
                },
            );
        };
        // A member that is not a voter here still grants: the candidate may already hold the
        // entry that promoted it (etcd#10998, raft-rs#57); the candidate counts only its own
        // configuration's voters.
        if !self.cfg.may_stand(from) {
            return refuse(self, false);
        }
        if term < self.term {
            return refuse(self, false);
        }
        // M3: a voter that heard a live leader within the lease refuses without moving its
        // term, so the old leader's lease (counted from rounds this voter answered) holds.
        let in_lease = self
            .heard_leader_us
            .is_some_and(|h| self.now < h + self.p.lease_us)
            && !(term == self.term && self.voted_for == Some(from))
            && self.p.fault != WitnessFault::NoLeaseWait;
        if in_lease {
            self.counters.votes_refused_in_lease += 1;
            return refuse(self, true);
        }
        if term > self.term {
            self.step_down(term);
        }
        let up_to_date = (last_term, last_index) >= (my_lt, my_li);
        let free = self.voted_for.is_none() || self.voted_for == Some(from);
        if up_to_date && free {
            if self.voted_for != Some(from) {
                self.voted_for = Some(from);
                self.persist_meta();
            }
            // Granting counts as hearing a leader: this voter now refuses others for a lease,
            // which is what the new leader's first lease rests on.
            self.heard_leader_us = Some(self.now);
            self.reset_election_timer();
            self.send(
                from,
                PeerBody::Vote {
                    granted: true,
                    last_index: my_li,
                    last_term: my_lt,
                    in_lease: false,
                    config: None,
                },
            );
        } else {
            refuse(self, false);
        }
    }

    fn on_vote(
        &mut self,
        from: NodeId,
        granted: bool,
        last_index: u64,
        last_term: u64,
        in_lease: bool,
        config: Option<Entry>,
    ) {
        if self.role != RoleKind::Candidate {
            return;
        }
        if granted {
            self.votes.insert(from);
            self.maybe_win();
            return;
        }
        // M13 index adoption, only from a voting backup and only on a log refusal: take the
        // backup's (last_term, last_index); everything past our commit becomes unknown, to be
        // reconciled from the backups if we win.
        if !in_lease
            && self.cfg.kind(from) == Some(Kind::Backup)
            && self.cfg.is_voter(from)
            && (last_term, last_index) > (self.log.last_term(), self.log.last_index())
            && last_index >= self.commit
        {
            self.counters.adoptions += 1;
            let c = self.commit;
            self.truncate_local(c + 1);
            for _ in c + 1..=last_index {
                self.log.push(Slot::Unknown { term: last_term });
            }
            self.adopt_config(config);
            // Run again soon: with the adopted log the backup can now grant.
            self.election_deadline_us = self.now + self.p.heartbeat_us;
        }
    }

    fn maybe_win(&mut self) {
        let granted = self.votes.iter().filter(|v| self.cfg.is_voter(**v)).count();
        if self.role != RoleKind::Candidate
            || !self.cfg.may_stand(self.id)
            || granted < self.cfg.election_quorum()
        {
            return;
        }
        self.leader_hint = Some(self.id);
        self.note_leader(self.term, self.id);
        let voters: Vec<NodeId> = self.votes.iter().copied().collect();
        let mut lead = Lead {
            next: BTreeMap::new(),
            matched: BTreeMap::new(),
            acked_round_us: BTreeMap::new(),
            lease_until_us: 0,
            noop_index: None,
            pending_puts: BTreeMap::new(),
            recon: None,
            recovery: None,
            last_heartbeat_us: 0,
            lease_lost_since_us: None,
        };
        for v in voters {
            if v != self.id && self.cfg.is_voter(v) {
                lead.acked_round_us.insert(v, self.vote_round_us);
            }
        }
        for m in self.cfg.ids().filter(|&m| m != self.id) {
            lead.next.insert(m, self.commit + 1);
            lead.matched.insert(m, 0);
        }
        self.lead = Some(lead);
        self.reconf_on_lead();
        self.update_lease();
        // M14: the range past our commit is reconciled with every voting backup before this
        // leader appends (and so commits) anything.
        let (lo, hi) = (self.commit + 1, self.log.last_index());
        if lo <= hi && self.cfg.voting_backups().next().is_some() {
            self.set_role(RoleKind::Provisional);
            self.lead.as_mut().unwrap().recon = Some(Recon {
                lo,
                hi,
                answers: BTreeMap::new(),
                asked_us: self.now,
            });
            self.recon_ask_all();
        } else {
            self.set_role(RoleKind::Leader);
            self.begin_term();
        }
    }

    // ---- reconciliation (M14) ----

    fn recon_ask_all(&mut self) {
        let Some(r) = self.lead.as_ref().and_then(|l| l.recon.as_ref()) else {
            return;
        };
        let (lo, hi) = (r.lo, r.hi);
        let backups: Vec<NodeId> = self.cfg.voting_backups().collect();
        let mut asks = Vec::new();
        for i in lo..=hi {
            for &b in &backups {
                let answered = r.answers.get(&i).is_some_and(|a| a.contains_key(&b));
                if !answered {
                    asks.push((b, i));
                }
            }
        }
        for (b, i) in asks {
            self.send(b, PeerBody::RequestLog { index: i });
        }
        self.lead.as_mut().unwrap().recon.as_mut().unwrap().asked_us = self.now;
    }

    fn recon_retry(&mut self) {
        let due = self
            .lead
            .as_ref()
            .and_then(|l| l.recon.as_ref())
            .is_some_and(|r| self.now >= r.asked_us + self.p.pull_retry_us);
        if due {
            self.recon_ask_all();
        }
    }

    fn on_log_reply(&mut self, from: NodeId, index: u64, entry: Option<Entry>, gone: bool) {
        if self.role != RoleKind::Provisional || !self.cfg.voting_backups().any(|b| b == from) {
            return;
        }
        if gone {
            // SIMPLIFIED: a witness that lags beyond the backups' recent-index window cannot
            // reconcile; it gives up leadership (safe; a fresher head will win later).
            let t = self.term;
            self.step_down(t);
            self.reset_election_timer();
            return;
        }
        let lead = self.lead.as_mut().unwrap();
        let r = lead.recon.as_mut().unwrap();
        if index < r.lo || index > r.hi {
            return;
        }
        r.answers.entry(index).or_default().insert(from, entry);
        self.recon_try_finish();
    }

    /// Decides the range once every voting backup answered every index: keep the longest prefix
    /// on which all voting backups hold the same entry; drop the rest. An entry missing from a
    /// voting backup (or held differently) was never committed, because a commit needs every
    /// voting backup (M4, M14 ii). Keeping only entries all backups agree on keeps this log
    /// matching theirs (Raft's log-matching property), so they can be re-replicated as is.
    fn recon_try_finish(&mut self) {
        let nb = self.cfg.voting_backups().count();
        let r = self.lead.as_ref().unwrap().recon.as_ref().unwrap();
        let mut kept: Vec<Entry> = Vec::new();
        let mut complete = true;
        for i in r.lo..=r.hi {
            let Some(a) = r.answers.get(&i) else {
                complete = false;
                break;
            };
            // A null from any backup already decides: drop from here, whoever else answers.
            if a.values().any(|e| e.is_none()) {
                break;
            }
            if a.len() < nb {
                complete = false;
                break;
            }
            // Prefer a full copy: a backup that caught up after joining holds superseded
            // committed versions key-only (their values are not needed, see `catch_up_copy`).
            let first = a
                .values()
                .flatten()
                .find(|e| e.is_full())
                .unwrap_or_else(|| a.values().next().unwrap().as_ref().unwrap());
            if a.values().any(|e| e.as_ref().unwrap().term != first.term) || first.index != i {
                break;
            }
            kept.push(first.clone());
        }
        if !complete {
            return;
        }
        let (lo, hi) = (r.lo, r.hi);
        self.lead.as_mut().unwrap().recon = None;
        self.counters.reconciled_dropped += hi + 1 - lo - kept.len() as u64;
        // Replace the range by the kept entries (full, from the backups). A configuration
        // entry in it is undone and redone: judge this head's standing once, after.
        self.reconf.replaying = true;
        self.truncate_local(lo);
        for e in kept {
            self.append_local(e);
        }
        self.reconf.replaying = false;
        if !self.cfg.may_stand(self.id) {
            let t = self.term;
            self.step_down(t);
            self.reset_election_timer();
            return;
        }
        self.set_role(RoleKind::Leader);
        self.begin_term();
    }

    /// A leader starts its term with a Noop; nothing is served until it commits (M14 Decide).
    fn begin_term(&mut self) {
        let idx = self.log.last_index() + 1;
        let e = Entry {
            index: idx,
            term: self.term,
            op: Op::Noop,
        };
        self.append_local(e);
        let l = self.lead.as_mut().unwrap();
        l.noop_index = Some(idx);
        self.heartbeat();
    }

    // ---- replication ----

    fn heartbeat(&mut self) {
        let peers: Vec<NodeId> = self.cfg.ids().filter(|&m| m != self.id).collect();
        if let Some(l) = self.lead.as_mut() {
            l.last_heartbeat_us = self.now;
        }
        for p in peers {
            // Retransmit from the last acknowledged index: covers lost messages.
            let from = self.retransmit_from(p);
            self.send_append(p, from);
        }
    }

    /// Where a retransmission to `p` starts: after its acknowledged prefix; for a member that
    /// gets values, never at or below the commit index (every voting backup holds committed
    /// entries, and this head keeps no values for them once applied).
    ///
    /// A member that has not acknowledged anything in this term is probed where `next` says
    /// (Raft's nextIndex: the commit index + 1 at the election, lowered by each refusal), not
    /// from index 1: below this head's truncated log that would mean a copy of the whole key
    /// table, and a new leader made one for the dead old primary at every heartbeat retry —
    /// a sort of every key in the node's one task while clients waited.
    fn retransmit_from(&self, p: NodeId) -> u64 {
        let l = self.lead.as_ref().unwrap();
        let matched = l.matched.get(&p).copied().unwrap_or(0);
        let m = if matched == 0 {
            l.next.get(&p).copied().unwrap_or(1)
        } else {
            matched + 1
        };
        if self.cfg.kind(p) == Some(Kind::Backup) && self.cfg.is_voter(p) {
            m.max(self.commit + 1)
        } else {
            m
        }
    }

    fn send_append(&mut self, to: NodeId, from: u64) {
        if self.role == RoleKind::Provisional {
            // Provisional quiet: heartbeats only (lease and authority), anchored at the
            // commit index, which every member that has it holds identically.
            let prev_index = self.commit;
            let prev_term = self.log.term_at(prev_index).unwrap_or(0);
            let (sent_us, commit) = (self.now, self.commit);
            self.send(
                to,
                PeerBody::AppendEntries {
                    leader: self.id,
                    prev_index,
                    prev_term,
                    entries: vec![],
                    commit,
                    sent_us,
                },
            );
            return;
        }
        let last = self.log.last_index();
        let from = from.max(1).min(last + 1);
        if from <= self.log.base_index && self.kind == Kind::Head {
            // Dropped from this head's log (M24): the member gets the key table instead.
            return self.send_snapshot(to, false);
        }
        let prev_index = from - 1;
        let Some(prev_term) = self.log.term_at(prev_index) else {
            return;
        };
        let values = self.cfg.gets_values(to);
        // full-replica: heads get values where this head still has them (the 3× layout).
        let values_if_held = self.p.recovery.full_replica() && self.cfg.kind(to) == Some(Kind::Head);
        let mut entries = Vec::new();
        let mut i = from;
        while i <= last && entries.len() < self.p.append_max_entries {
            let Some(e) = self.log.entry(i) else { break };
            if values {
                if e.is_full() {
                    entries.push(e.clone());
                } else if let Some(c) = self.catch_up_copy(to, e) {
                    entries.push(c);
                } else {
                    // A backup this far behind needs a value this head does not hold (yet:
                    // it is recovering); it waits.
                    self.counters.values_unavailable += 1;
                    break;
                }
            } else if values_if_held {
                entries.push(e.clone());
            } else {
                entries.push(e.key_only());
            }
            i += 1;
        }
        let sent = entries.len() as u64;
        let sent_us = self.now;
        let commit = self.commit;
        self.send(
            to,
            PeerBody::AppendEntries {
                leader: self.id,
                prev_index,
                prev_term,
                entries,
                commit,
                sent_us,
            },
        );
        if let Some(l) = self.lead.as_mut() {
            l.next.insert(to, from + sent);
        }
    }

    /// What an honest leader's AppendEntries always satisfies, checked before it changes
    /// anything: no second leader in this node's own term, entries contiguous after
    /// `prev_index` and of no later term than the message, and no different entry at an index
    /// this node knows committed (Raft's Leader Completeness: a leader holds every committed
    /// entry).
    fn append_is_coherent(
        &self,
        term: u64,
        prev_index: u64,
        prev_term: u64,
        entries: &[Entry],
    ) -> Result<(), &'static str> {
        if term == self.term && matches!(self.role, RoleKind::Leader | RoleKind::Provisional) {
            return Err("a second leader in this node's term");
        }
        if prev_term > term {
            return Err("prev_term above the message's term");
        }
        let mut last_term = prev_term;
        for (k, e) in entries.iter().enumerate() {
            if e.index != prev_index + 1 + k as u64 {
                return Err("entries not contiguous after prev_index");
            }
            if e.term > term || e.term < last_term {
                return Err("entry terms out of order");
            }
            last_term = e.term;
            if e.index <= self.commit {
                let same = match self.log.slot(e.index) {
                    Some(Slot::Unknown { .. }) => false,
                    Some(slot) => slot.term() == e.term,
                    None => e.index <= self.log.base_index,
                };
                if !same {
                    return Err("a different entry at a committed index");
                }
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)] // the fields of one AppendEntries
    fn on_append(
        &mut self,
        from: NodeId,
        term: u64,
        prev_index: u64,
        prev_term: u64,
        entries: Vec<Entry>,
        leader_commit: u64,
        sent_us: u64,
    ) {
        if term < self.term {
            let li = self.log.last_index();
            self.send(
                from,
                PeerBody::AppendAck {
                    success: false,
                    match_index: li,
                    sent_us,
                    durable: 0,
                    want_snapshot: false,
                },
            );
            return;
        }
        // The reason `append_is_coherent` gives is for a debugger; the count is what is kept.
        if self.append_is_coherent(term, prev_index, prev_term, &entries).is_err() {
            self.counters.refused_peer_msgs += 1;
            return;
        }
        if term > self.term || self.role != RoleKind::Follower {
            self.step_down(term);
        }
        self.note_leader(term, from);
        self.rec_leader_heard(term, from);
        self.reconf_follow(from);
        self.leader_hint = Some(from);
        self.heard_leader_us = Some(self.now);
        if let Some(p) = self.proactive.take() {
            // A false soft timeout (the leader was only slow) or another head won: the backup
            // stops the stream and resumes GC; the pulled data is dropped (M15).
            self.counters.proactive_aborted += 1;
            let stream = p.stream.id;
            self.send(p.stream.to, PeerBody::BatchPullAbort { stream });
        }
        self.leader_sent_us = self.leader_sent_us.max(sent_us);
        self.reset_election_timer();
        // An adopted slot (M13) has a term but no known content: it cannot anchor the Log
        // Matching check, or a heartbeat whose prev lands on one would move the commit index
        // over an entry this head never held.
        let prev_unknown = matches!(self.log.slot(prev_index), Some(Slot::Unknown { .. }));
        if prev_index > self.log.last_index() || !self.log.matches(prev_index, prev_term) || prev_unknown {
            self.send_ack(from, false);
            return;
        }
        let mut verified = prev_index;
        for e in entries {
            let i = e.index;
            if i != verified + 1 {
                break; // malformed; keep what is verified
            }
            let same = match self.log.slot(i) {
                Some(Slot::Unknown { .. }) => false,
                Some(s) => s.term() == e.term,
                None => i <= self.log.base_index,
            };
            if !same {
                // `append_is_coherent` refused any rewrite of a committed index.
                debug_assert!(
                    i > self.commit,
                    "leader {from} conflicts at committed index {i}"
                );
                self.truncate_local(i);
                let stored = if self.cfg.gets_values(self.id) || self.p.recovery.full_replica() {
                    e
                } else {
                    e.key_only()
                };
                self.append_local(stored);
            }
            verified = i;
        }
        self.leader_match = self.leader_match.max(verified);
        let new_commit = leader_commit.min(verified);
        if new_commit > self.commit {
            self.commit = new_commit;
        }
        self.send_ack(from, true);
    }

    fn on_append_ack(&mut self, from: NodeId, success: bool, match_index: u64, sent_us: u64) {
        let Some(l) = self.lead.as_mut() else { return };
        if self.cfg.is_voter(from) {
            let a = l.acked_round_us.entry(from).or_insert(0);
            *a = (*a).max(sent_us);
        }
        if self.role == RoleKind::Provisional {
            self.update_lease();
            return;
        }
        if success {
            let m = l.matched.entry(from).or_insert(0);
            *m = (*m).max(match_index);
        } else {
            // Retry from where the follower's log ends, or one below the last try.
            let cur = l.next.get(&from).copied().unwrap_or(1);
            let next = (match_index + 1).min(cur.saturating_sub(1)).max(1);
            l.next.insert(from, next);
            let floor = self.retransmit_from(from);
            let n = next.max(if self.cfg.gets_values(from) { floor } else { 1 });
            self.lead.as_mut().unwrap().next.insert(from, n);
            self.send_append(from, n);
        }
        self.update_lease();
    }

    /// M3: the lease runs to (the newest round a majority of voters answered) + lease − drift.
    fn update_lease(&mut self) {
        let q = self.cfg.election_quorum();
        let Some(l) = self.lead.as_mut() else { return };
        let cfg = &self.cfg;
        let mut rounds: Vec<u64> = l
            .acked_round_us
            .iter()
            .filter(|(v, _)| cfg.is_voter(**v))
            .map(|(_, r)| *r)
            .collect();
        rounds.sort_unstable_by(|a, b| b.cmp(a));
        let need = q.saturating_sub(1); // the leader counts itself
        let round = if need == 0 {
            Some(self.now)
        } else {
            rounds.get(need - 1).copied()
        };
        if let Some(r) = round {
            let until = (r + self.p.lease_us).saturating_sub(self.p.clock_drift_us);
            l.lease_until_us = l.lease_until_us.max(until);
        }
    }

    fn lease_valid(&self) -> bool {
        self.lead
            .as_ref()
            .is_some_and(|l| self.now < l.lease_until_us)
    }

    /// Commit: the highest index of this term held persisted by the leader and every member of
    /// the commit quorum (M4).
    fn advance_commit(&mut self) {
        let Some(l) = self.lead.as_ref() else { return };
        let quorum = self.cfg.commit_quorum(self.id);
        if self.p.fault == WitnessFault::MajorityQuorum {
            // Broken on purpose (model check): the median of the voters' persisted indexes.
            let mut m: Vec<u64> = self
                .cfg
                .voters()
                .map(|v| {
                    if v == self.id {
                        self.persisted
                    } else {
                        l.matched.get(&v).copied().unwrap_or(0)
                    }
                })
                .collect();
            m.sort_unstable_by(|a, b| b.cmp(a));
            let c = m[self.cfg.election_quorum() - 1];
            if c > self.commit && self.log.term_at(c) == Some(self.term) {
                self.commit = c;
            }
            return;
        }
        let mut c = self.persisted;
        for q in quorum {
            if q != self.id {
                c = c.min(l.matched.get(&q).copied().unwrap_or(0));
            }
        }
        if c > self.commit && self.log.term_at(c) == Some(self.term) {
            self.commit = c;
        }
    }

    fn apply_committed(&mut self) {
        while self.applied < self.commit {
            let i = self.applied + 1;
            let Some(Slot::Entry(e)) = self.log.slot(i).cloned() else {
                // Backups track commit for writeback only; heads hold every committed entry.
                assert!(
                    self.kind == Kind::Backup || i <= self.log.base_index,
                    "hole at {i}"
                );
                self.applied = i;
                continue;
            };
            self.applied = i;
            if self.kind == Kind::Backup {
                continue;
            }
            if let Op::Put { key, value } = &e.op {
                let st = e.stamp();
                debug_assert!(self.head.keys.get(key).is_none_or(|&p| p < st));
                self.head.raise_key(key, st);
                if let Some(v) = value {
                    let cur = self.head.values.get(key).map_or(Stamp::ZERO, |x| x.0);
                    if st > cur {
                        self.head.set_value(key, st, v.to_vec());
                    }
                }
                // Values of applied entries live in the value table (and on every backup).
                if let Some(Slot::Entry(le)) = self.log.slot_mut(i) {
                    *le = le.key_only();
                }
                let key = key.clone();
                self.answer_waiting_gets(&key);
            }
            if let Some(l) = self.lead.as_mut() {
                if let Some(tag) = l.pending_puts.remove(&i) {
                    self.out.push(Output::Reply {
                        tag,
                        reply: ClientReply::PutOk,
                    });
                }
                if l.noop_index == Some(i) {
                    self.start_recovery_if_needed();
                }
            }
        }
    }

    // ---- clients ----

    fn on_client(&mut self, tag: u64, req: ClientReq) {
        let reply = |c: &mut Self, reply| c.out.push(Output::Reply { tag, reply });
        match &req {
            ClientReq::Reconfigure(change) => {
                return self.on_client_reconfigure(tag, change.clone())
            }
            ClientReq::Membership => return self.on_client_membership(tag),
            ClientReq::Status => return self.on_status(tag),
            ClientReq::Get { key } | ClientReq::Put { key, .. } => {
                if key.is_empty() || key.len() > MAX_KEY_BYTES {
                    return reply(
                        self,
                        ClientReply::Invalid(format!("key of {} bytes", key.len())),
                    );
                }
            }
        }
        if let ClientReq::Put { value, .. } = &req {
            if value.len() > MAX_VALUE_BYTES {
                return reply(
                    self,
                    ClientReply::Invalid(format!("value of {} bytes", value.len())),
                );
            }
        }
        if !matches!(self.role, RoleKind::Leader | RoleKind::Provisional) {
            let hint = self.leader_hint.filter(|&h| h != self.id);
            return reply(self, ClientReply::NotLeader { hint });
        }
        if !self.is_serving() || self.rec_refuses_clients() {
            return reply(self, ClientReply::Unavailable);
        }
        match &req {
            ClientReq::Get { key } | ClientReq::Put { key, .. } => self.rec_sample(key),
            ClientReq::Reconfigure(_) | ClientReq::Membership => {} // answered at the top
            ClientReq::Status => {}
        }
        match req {
            ClientReq::Put { key, value } => {
                let e = Entry {
                    index: self.log.last_index() + 1,
                    term: self.term,
                    op: Op::Put {
                        key,
                        value: Some(ByteBuf::from(value)),
                    },
                };
                let idx = e.index;
                self.append_local(e);
                self.lead.as_mut().unwrap().pending_puts.insert(idx, tag);
                let peers: Vec<NodeId> = self.cfg.ids().filter(|&m| m != self.id).collect();
                for p in peers {
                    let n = self.lead.as_ref().unwrap().next[&p];
                    self.send_append(p, n);
                }
            }
            ClientReq::Get { key } => self.on_get(tag, key),
            ClientReq::Reconfigure(_) | ClientReq::Membership => {} // answered at the top
            ClientReq::Status => {} // answered at the top
        }
    }

    fn on_get(&mut self, tag: u64, key: Vec<u8>) {
        if !self.lease_valid() {
            // M3: without a live lease a newer leader may exist; never answer from here.
            self.counters.gets_refused_no_lease += 1;
            self.out.push(Output::Reply {
                tag,
                reply: ClientReply::NotLeader { hint: None },
            });
            return;
        }
        let Some(&ks) = self.head.keys.get(&key) else {
            // Absent from the key table: never written (M18 Decide), no pull.
            self.out.push(Output::Reply {
                tag,
                reply: ClientReply::Value(None),
            });
            return;
        };
        if let Some((vs, v)) = self.head.values.get(&key) {
            if *vs == ks {
                let v = v.clone();
                if let Some(r) = self.lead.as_mut().and_then(|l| l.recovery.as_mut()) {
                    r.stats.gets_hit += 1;
                }
                self.out.push(Output::Reply {
                    tag,
                    reply: ClientReply::Value(Some(ByteBuf::from(v))),
                });
                return;
            }
        }
        // A miss: the value is on the backups (M18). Wait for a pull.
        let max_gets = self.p.max_pending_gets;
        let Some(r) = self.lead.as_mut().and_then(|l| l.recovery.as_mut()) else {
            // Cannot happen: a leader with a stale value is always recovering.
            self.out.push(Output::Reply {
                tag,
                reply: ClientReply::Unavailable,
            });
            return;
        };
        if r.pending_get_count >= max_gets {
            self.out.push(Output::Reply {
                tag,
                reply: ClientReply::Unavailable,
            });
            return;
        }
        r.pending_get_count += 1;
        r.pending_gets.entry(key.clone()).or_default().push(tag);
        if self.p.recovery.priority_pull() {
            self.start_pull(&key);
        }
    }

    /// Answers the Gets waiting on `key` if the local value now carries the key table's stamp.
    fn answer_waiting_gets(&mut self, key: &[u8]) {
        let ks = self.head.keys.get(key).copied();
        let local = self.head.values.get(key).cloned();
        let lease = self.lease_valid();
        let Some(r) = self.lead.as_mut().and_then(|l| l.recovery.as_mut()) else {
            return;
        };
        let ok = match (ks, &local) {
            (Some(ks), Some((vs, _))) => *vs == ks,
            (None, _) => true,
            _ => false,
        };
        if !ok {
            return;
        }
        let Some(tags) = r.pending_gets.remove(key) else {
            return;
        };
        r.pending_get_count -= tags.len();
        r.stats.gets_served_after_pull += tags.len() as u64;
        for tag in tags {
            let reply = if !lease {
                ClientReply::NotLeader { hint: None }
            } else {
                ClientReply::Value(local.as_ref().map(|(_, v)| ByteBuf::from(v.clone())))
            };
            self.out.push(Output::Reply { tag, reply });
        }
    }

    // ---- live recovery (M17–M19), leader side ----

    fn start_recovery_if_needed(&mut self) {
        let pre = self.proactive.take();
        let mut pre_installed = 0;
        if let Some(p) = &pre {
            for e in p.entries.values() {
                if self.install(e) {
                    pre_installed += 1;
                }
            }
        }
        if self.head.missing == 0 {
            // Nothing to pull (a fresh group, or reconciliation brought every newest value).
            self.out.push(Output::Recovered(RecoveryStats {
                started_us: self.now,
                finished_us: self.now,
                proactive_installed: pre_installed,
                ..Default::default()
            }));
            return;
        }
        let Some(to) = self.cfg.voting_backups().next() else {
            return;
        };
        // The value table grows from (nearly) nothing to every key during the recovery: each
        // doubling rehashed every value installed so far in the node's one task (stalls of
        // 100-300 ms at 512 k keys, while clients waited); one allocation now instead.
        self.head.values.reserve(self.head.missing);
        let id = self.next_io_id();
        let n = self.head.missing as u64;
        let start = self.rec_stream_start();
        self.lead.as_mut().unwrap().recovery = Some(LiveRecovery {
            leftover: Vec::new(),
            pending_gets: HashMap::new(),
            pending_get_count: 0,
            pulls: HashMap::new(),
            pull_by_key: HashMap::new(),
            // Continue the proactive stream where it stopped (the same backup log).
            batch: match pre {
                Some(p) if p.stream.to == to => BatchStream {
                    id,
                    to,
                    cursor: p.stream.cursor,
                    in_flight_since: None,
                    done: p.stream.done,
                },
                _ => BatchStream {
                    id,
                    to,
                    cursor: start,
                    in_flight_since: None,
                    done: false,
                },
            },
            stats: RecoveryStats {
                started_us: self.now,
                missing_at_start: n,
                proactive_installed: pre_installed,
                ..Default::default()
            },
        });
    }

    fn next_io_id(&mut self) -> u64 {
        let id = self.next_io;
        self.next_io += 1;
        id
    }

    fn start_pull(&mut self, key: &[u8]) {
        let max = self.p.max_pending_pulls;
        let backups: Vec<NodeId> = self.cfg.voting_backups().collect();
        if backups.is_empty() {
            return;
        }
        let id = self.next_io_id();
        let now = self.now;
        let Some(r) = self.lead.as_mut().and_then(|l| l.recovery.as_mut()) else {
            return;
        };
        if r.pull_by_key.contains_key(key) || r.pulls.len() >= max {
            return;
        }
        // Spread PriorityPulls over the backups (§5.4).
        let to = backups[(id as usize) % backups.len()];
        r.pulls.insert(
            id,
            PullState {
                key: key.to_vec(),
                sent_us: now,
            },
        );
        r.pull_by_key.insert(key.to_vec(), id);
        r.stats.priority_pulls += 1;
        self.send(
            to,
            PeerBody::PriorityPull {
                id,
                key: ByteBuf::from(key.to_vec()),
            },
        );
    }

    /// Installs a pulled entry iff local stamp < its stamp ≤ the key table's (M18 Decide): a
    /// pulled value never lowers a key's stamp and never runs ahead of what is committed.
    fn install(&mut self, e: &Entry) -> bool {
        let (Some(key), Some(v)) = (e.key(), e.value()) else {
            return false;
        };
        let Some(&ks) = self.head.keys.get(key) else {
            return false;
        };
        let mut st = e.stamp();
        let cur = self.head.values.get(key).map_or(Stamp::ZERO, |x| x.0);
        if self.p.fault == WitnessFault::InstallWithoutStampCheck {
            // Broken on purpose (model check): whatever arrives is taken as the current value.
            st = ks;
        } else if !(cur < st && st <= ks) {
            return false;
        }
        self.head.set_value(key, st, v.to_vec());
        if let Some(r) = self.lead.as_mut().and_then(|l| l.recovery.as_mut()) {
            r.stats.installed += 1;
        }
        true
    }

    fn on_priority_pull_reply(&mut self, id: u64, entries: Vec<Entry>) {
        let Some(r) = self.lead.as_mut().and_then(|l| l.recovery.as_mut()) else {
            return;
        };
        let Some(p) = r.pulls.remove(&id) else { return };
        r.pull_by_key.remove(&p.key);
        let latency_us = self.now.saturating_sub(p.sent_us);
        r.stats.priority_pulls_answered += 1;
        r.stats.priority_pull_latency_us_total += latency_us;
        r.stats.priority_pull_latency_us_max = r.stats.priority_pull_latency_us_max.max(latency_us);
        self.rec_priority_latency(latency_us);
        for e in &entries {
            self.install(e);
        }
        let mut keys: Vec<Vec<u8>> = entries
            .iter()
            .filter_map(|e| e.key().map(<[u8]>::to_vec))
            .collect();
        keys.push(p.key.clone());
        keys.sort();
        keys.dedup();
        for k in keys {
            self.answer_waiting_gets(&k);
        }
        // Still waiting (the backup had only an older version): retried by `drive_recovery`
        // after `pull_retry_us`, never answered stale.
    }

    fn on_batch_reply(&mut self, stream: u64, entries: Vec<Entry>, next_cursor: u64, done: bool) {
        if let Some(p) = self.proactive.as_mut() {
            if p.stream.id == stream && p.stream.in_flight_since.is_some() {
                p.stream.in_flight_since = None;
                p.stream.cursor = recovery::cursor_max(p.stream.cursor, next_cursor);
                p.stream.done = done;
                for e in entries {
                    let (Some(k), true) = (e.key(), e.value().is_some()) else {
                        continue;
                    };
                    let newer = p.entries.get(k).is_none_or(|o| o.stamp() < e.stamp());
                    if newer {
                        p.bytes += e.approx_bytes();
                        p.entries.insert(k.to_vec(), e);
                    }
                }
                p.full = p.bytes >= self.p.proactive_bytes_max;
                return;
            }
        }
        let Some(r) = self.lead.as_mut().and_then(|l| l.recovery.as_mut()) else {
            return;
        };
        if r.batch.id != stream || r.batch.in_flight_since.is_none() {
            return;
        }
        r.batch.in_flight_since = None;
        r.batch.cursor = recovery::cursor_max(r.batch.cursor, next_cursor);
        r.batch.done = done;
        r.stats.batch_entries += entries.len() as u64;
        for e in &entries {
            self.install(e);
        }
        let mut keys: Vec<Vec<u8>> = entries
            .iter()
            .filter_map(|e| e.key().map(<[u8]>::to_vec))
            .collect();
        keys.sort();
        keys.dedup();
        for k in keys {
            self.answer_waiting_gets(&k);
        }
    }

    /// Keeps the BatchPull stream going (one read in flight, paced: M20, `recovery.rs`),
    /// retries lost pulls, pulls what the stream left (M19) and ends recovery when nothing is
    /// missing.
    fn drive_recovery(&mut self) {
        if !self.is_serving() {
            return;
        }
        let now = self.now;
        let retry = self.p.pull_retry_us;
        let priority = self.p.recovery.priority_pull();
        let due = self
            .lead
            .as_ref()
            .and_then(|l| l.recovery.as_ref())
            .is_some_and(|r| {
                !r.batch.done && r.batch.in_flight_since.is_none_or(|t| now >= t + retry)
            });
        // The pacing (M20, `recovery.rs`) is asked only when a request is due, so an idle
        // stream spends no tokens.
        let paced_ok = due && self.rec_may_batch_pull();
        let max_pulls = self.p.max_pending_pulls;
        let leftover_dry = self
            .lead
            .as_ref()
            .and_then(|l| l.recovery.as_ref())
            .is_some_and(|r| r.batch.done && r.leftover.is_empty() && r.pulls.is_empty());
        // The stream has passed every key: what it left, by one pass over the key table
        // (again only if that list runs dry, and every pull came back, with keys still
        // missing: a pass per input would stall the node as surely as the old set did).
        let rescan = (leftover_dry && self.head.missing > 0)
            .then(|| self.head.scan_missing(LEFTOVER_SCAN_KEYS_MAX));
        let head = &self.head;
        let Some(r) = self.lead.as_mut().and_then(|l| l.recovery.as_mut()) else {
            return;
        };
        if let Some(keys) = rescan {
            r.leftover = keys;
        }
        let mut sends = Vec::new();
        if paced_ok {
            r.batch.in_flight_since = Some(now);
            sends.push((
                r.batch.to,
                PeerBody::BatchPull {
                    stream: r.batch.id,
                    cursor: r.batch.cursor,
                },
            ));
        }
        let stale: Vec<u64> = r
            .pulls
            .iter()
            .filter(|(_, p)| now >= p.sent_us + retry)
            .map(|(id, _)| *id)
            .collect();
        let mut again: Vec<Vec<u8>> = Vec::new();
        for id in stale {
            let p = r.pulls.remove(&id).unwrap();
            r.pull_by_key.remove(&p.key);
            again.push(p.key);
        }
        // Keys with waiting Gets first, then (after the stream ends) the leftovers. batch-only
        // pulls a key a Get waits on only once the stream has passed it by.
        for k in r.pending_gets.keys() {
            if (priority || r.batch.done) && !r.pull_by_key.contains_key(k) {
                again.push(k.clone());
            }
        }
        if r.batch.done {
            // Keys no longer missing (a Put, a pull) leave the list as it is walked.
            while r.pull_by_key.len() + again.len() < max_pulls {
                let Some(k) = r.leftover.pop() else { break };
                if head.is_missing(&k) && !r.pull_by_key.contains_key(&k) {
                    again.push(k);
                }
            }
        }
        let finished = r.batch.done && head.missing == 0 && r.pending_gets.is_empty();
        for (to, body) in sends {
            self.send(to, body);
        }
        again.sort();
        again.dedup();
        for k in again {
            self.start_pull(&k);
        }
        if finished {
            let mut r = self.lead.as_mut().unwrap().recovery.take().unwrap();
            r.stats.finished_us = now;
            self.out.push(Output::Recovered(r.stats));
        }
    }

    /// M15: the designated successor (the lowest-id voting head other than the last leader)
    /// starts pulling once the leader has been silent for the soft timeout, and keeps one
    /// BatchPull in flight until the stream ends or the byte cap is reached.
    fn drive_proactive(&mut self) {
        if self.kind != Kind::Head || (self.proactive.is_none() && !self.rec_soft_timeout()) {
            return;
        }
        let now = self.now;
        if self.proactive.is_none() {
            let Some(h) = self.heard_leader_us else {
                return;
            };
            let Some(last) = self.leader_hint else { return };
            if now < h + self.p.soft_timeout_us || last == self.id {
                return;
            }
            let start = self.rec_stream_start();
            let successor = self
                .cfg
                .members
                .iter()
                .filter(|m| m.voting && m.kind == Kind::Head && m.id != last)
                .map(|m| m.id)
                .min();
            if successor != Some(self.id) {
                return;
            }
            let Some(to) = self.cfg.voting_backups().next() else {
                return;
            };
            let id = self.next_io_id();
            self.counters.proactive_started += 1;
            self.proactive = Some(Proactive {
                stream: BatchStream {
                    id,
                    to,
                    cursor: start,
                    in_flight_since: None,
                    done: false,
                },
                entries: HashMap::new(),
                bytes: 0,
                full: false,
            });
        }
        let retry = self.p.pull_retry_us;
        let p = self.proactive.as_mut().unwrap();
        if p.stream.done || p.full {
            return;
        }
        if p.stream.in_flight_since.is_none_or(|t| now >= t + retry) && self.rec_may_batch_pull() {
            let p = self.proactive.as_mut().unwrap();
            p.stream.in_flight_since = Some(now);
            let (to, stream, cursor) = (p.stream.to, p.stream.id, p.stream.cursor);
            self.send(to, PeerBody::BatchPull { stream, cursor });
        }
    }

    // ---- backup side (M5–M10, M14, M17, M18) ----

    /// Rebuilds the backup's SSD state at a restart: every segment is scanned in the one page
    /// format and sealed; the index takes the newest version of each key (the same rule as
    /// live writeback; equal stamps = a GC copy, the later segment wins); the recent-index
    /// window is the contiguous run of indexes ending at the newest one found (GC keeps the
    /// window's entries, so indexes below it may be gone).
    /// Returns the configuration entries found (SIMPLIFIED: one GC dropped, once out of the
    /// recent-index window, is not found; the backup then starts from the configuration it
    /// was given and learns the newer one from the leader's log).
    fn restore_ssd(&mut self, log: &mut Log, mut segs: Vec<DurableSeg>) -> Vec<(u64, Config)> {
        let mut configs = Vec::new();
        segs.sort_by_key(|d| d.seg);
        let mut by_index: BTreeMap<u64, (u64, Loc)> = BTreeMap::new();
        let mut newest: HashMap<Vec<u8>, (Stamp, Loc)> = HashMap::new();
        for d in segs {
            let (decoded, valid) = page::decode_pages_tagged(d.seg, 0, &d.bytes);
            self.backup.space.restore_seg(d.seg, d.log, valid as u64);
            for (loc, e, refill) in decoded {
                if let Op::Config(cf) = &e.op {
                    configs.push((e.index, cf.clone()));
                }
                if let Some(k) = e.key() {
                    let st = e.stamp();
                    match newest.get_mut(k) {
                        Some(cur) if cur.0 <= st => *cur = (st, loc),
                        Some(_) => {}
                        None => {
                            newest.insert(k.to_vec(), (st, loc));
                        }
                    }
                }
                if !refill {
                    // A refill version is indexed, never part of the log (`refill.rs`).
                    by_index.insert(e.index, (e.term, loc));
                }
            }
        }
        for (k, (st, loc)) in newest {
            self.backup.space.add_ref(loc);
            self.backup.index.insert(k, (st, loc));
        }
        let Some((&last, _)) = by_index.last_key_value() else {
            return configs;
        };
        let window = self.p.recent_index_window_entries as u64;
        let mut first = last;
        while first > 1 && last - first + 1 < window && by_index.contains_key(&(first - 1)) {
            first -= 1;
        }
        log.base_index = first - 1;
        // The term before the window, if GC kept it; else the window's first (terms never
        // decrease along the log, and indexes at or below the base always match).
        log.base_term = by_index
            .get(&(first - 1))
            .or_else(|| by_index.get(&first))
            .map_or(0, |x| x.0);
        for (_, (term, loc)) in by_index.range(first..) {
            self.backup.space.add_ref(*loc);
            self.backup.slot_refs += 1;
            log.push(Slot::Flushed {
                term: *term,
                loc: Some(*loc),
            });
        }
        self.backup.written_back_through = last;
        self.commit = last;
        self.applied = last;
        configs
    }

    /// Issues an SSD read and remembers what it is for (and that `seg` is being read, so GC
    /// does not free it under the read).
    fn ssd_read(&mut self, why: ReadFor, seg: u64, off: u64, len: u32, class: IoClass) {
        let id = self.next_io_id();
        self.backup.space.read_started(seg);
        self.backup.reads.insert(id, (why, seg));
        self.out.push(Output::SsdRead {
            id,
            seg,
            off,
            len,
            class,
        });
    }

    /// Which log an entry goes to (M10): a popular key's to the hot one.
    fn place(&self, e: &Entry) -> SsdLog {
        match (self.p.ssd_logs, e.key()) {
            (SsdLogs::Single, _) => SsdLog::Hot,
            (SsdLogs::HotCold, Some(k)) if self.rec.lru.is_popular(&k.to_vec()) => {
                SsdLog::Hot
            }
            (SsdLogs::HotCold, _) => SsdLog::Cold,
        }
    }

    /// Packs `entries` as one batch at the end of `log` and issues the write.
    fn write_batch(
        &mut self,
        log: SsdLog,
        entries: &[Entry],
        class: IoClass,
    ) -> (SsdWriteReq, Vec<Loc>) {
        self.write_batch_tagged(log, entries, &[], class)
    }

    /// [`Self::write_batch`] with `refill[i]` marking entry `i` a refill version (missing:
    /// a log entry).
    fn write_batch_tagged(
        &mut self,
        log: SsdLog,
        entries: &[Entry],
        refill: &[bool],
        class: IoClass,
    ) -> (SsdWriteReq, Vec<Loc>) {
        let len = page::packed_len(entries) as u64;
        let id = self.next_io_id();
        let (seg, off) = self
            .backup
            .space
            .alloc(log, len, self.p.ssd_segment_bytes, id);
        let mut b = page::BatchBuilder::new(seg, off);
        let locs = entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                b.push_tagged(e, refill.get(i).copied().unwrap_or(false))
                    .expect("entries are within the limits the leader checked")
            })
            .collect();
        let (bytes, _) = b.finish();
        debug_assert_eq!(bytes.len() as u64, len);
        self.out.push(Output::SsdWrite {
            id,
            seg,
            log,
            off,
            bytes: bytes.clone(),
            class,
        });
        (
            SsdWriteReq {
                id,
                seg,
                log,
                off,
                bytes,
            },
            locs,
        )
    }

    fn on_request_log(&mut self, from: NodeId, index: u64) {
        if self.kind != Kind::Backup {
            return;
        }
        if index > self.log.last_index() {
            return self.send(
                from,
                PeerBody::LogReply {
                    index,
                    entry: None,
                    gone: false,
                },
            );
        }
        if index <= self.log.base_index {
            return self.send(
                from,
                PeerBody::LogReply {
                    index,
                    entry: None,
                    gone: true,
                },
            );
        }
        match self.log.slot(index).cloned() {
            Some(Slot::Entry(e)) => {
                // Only what is persisted counts as held (the ack rule).
                let entry = (index <= self.persisted).then_some(e);
                self.send(
                    from,
                    PeerBody::LogReply {
                        index,
                        entry,
                        gone: false,
                    },
                );
            }
            Some(Slot::Flushed { term, loc: None }) => {
                let e = Entry {
                    index,
                    term,
                    op: Op::Noop,
                };
                self.send(
                    from,
                    PeerBody::LogReply {
                        index,
                        entry: Some(e),
                        gone: false,
                    },
                );
            }
            Some(Slot::Flushed { loc: Some(loc), .. }) => {
                let (off, len) = loc.page_span();
                self.ssd_read(
                    ReadFor::RequestLog {
                        to: from,
                        index,
                        loc,
                    },
                    loc.seg,
                    off,
                    len as u32,
                    IoClass::PriorityPull,
                );
            }
            Some(Slot::Unknown { .. }) | None => self.send(
                from,
                PeerBody::LogReply {
                    index,
                    entry: None,
                    gone: false,
                },
            ),
        }
    }

    /// The buffer's slots that may still hold an entry: those past the written-back prefix
    /// (writeback turns every `Entry` up to `written_back_through` into `Flushed`). Pulls scan
    /// only these, not the whole recent-index window (up to `recent_index_window_entries`
    /// slots), which made every PriorityPull cost O(window) on the backup's one task.
    fn unflushed_slots(&self) -> impl Iterator<Item = &Slot> {
        let from = self
            .backup
            .written_back_through
            .saturating_sub(self.log.base_index)
            .min(self.log.slots.len() as u64) as usize;
        self.log.slots.range(from..)
    }

    /// How many buffer slots a pull scans (tests, status).
    pub fn pull_scan_slots(&self) -> usize {
        self.unflushed_slots().count()
    }

    /// The persisted versions of `key` in the NVMM buffer, oldest first.
    fn buffered_versions(&self, key: &[u8]) -> Vec<Entry> {
        self.unflushed_slots()
            .filter_map(|s| match s {
                Slot::Entry(e) if e.key() == Some(key) && e.index <= self.persisted => {
                    Some(e.clone())
                }
                _ => None,
            })
            .collect()
    }

    fn on_priority_pull(&mut self, from: NodeId, id: u64, key: Vec<u8>) {
        if self.kind != Kind::Backup {
            return;
        }
        // The NVMM buffer first: the index is updated only at writeback, so an SSD-only lookup
        // could miss the newest committed version (M18 Decide).
        let buffered = self.buffered_versions(&key);
        match self.backup.index.get(&key).map(|x| x.1) {
            Some(loc) => {
                // The whole page(s) holding the entry: its neighbours come free (§5.3).
                let (off, len) = loc.page_span();
                self.ssd_read(
                    ReadFor::PriorityPull {
                        to: from,
                        id,
                        key,
                        buffered,
                        off,
                    },
                    loc.seg,
                    off,
                    len as u32,
                    IoClass::PriorityPull,
                );
            }
            None => self.send(
                from,
                PeerBody::PriorityPullReply {
                    id,
                    entries: buffered,
                },
            ),
        }
    }

    /// The next place a BatchPull stream at `cursor` (`segment << 32 | offset`) reads: the
    /// first segment at or after the cursor's with durable bytes past it. Segments are read in
    /// id order over both logs; a segment freed by GC is skipped (its live entries were
    /// rewritten into newer segments, so the stream meets them later); what is written to a
    /// segment the stream has passed is newer than the stream and PriorityPulled if needed.
    fn batch_pull_next(&self, cursor: u64) -> Option<(u64, u64, u64)> {
        let (cseg, coff) = (cursor >> 32, cursor & 0xffff_ffff);
        let sp = &self.backup.space;
        let mut seg = sp.first_from(cseg)?;
        let mut off = if seg == cseg { coff } else { 0 };
        loop {
            let end = sp.durable_end(seg);
            if off < end {
                return Some((seg, off, end));
            }
            seg = sp.first_from(seg + 1)?;
            off = 0;
        }
    }

    fn on_batch_pull(&mut self, from: NodeId, stream: u64, cursor: u64) {
        if self.kind != Kind::Backup {
            return;
        }
        if cursor & recovery::HOT_CURSOR != 0 {
            return self.rec_hot_batch_pull(from, stream, cursor);
        }
        let Some((seg, off, end)) = self.batch_pull_next(cursor) else {
            return self.send(
                from,
                PeerBody::BatchPullReply {
                    stream,
                    entries: vec![],
                    next_cursor: cursor,
                    done: true,
                },
            );
        };
        let len = (self.rec_batch_read_bytes() as u64).min(end - off);
        let len = len.div_ceil(PAGE_BYTES as u64) * PAGE_BYTES as u64;
        self.ssd_read(
            ReadFor::BatchPull {
                to: from,
                stream,
                seg,
                off,
                len: len as u32,
            },
            seg,
            off,
            len as u32,
            IoClass::BatchPull,
        );
    }

    fn on_ssd_read(&mut self, id: u64, result: Result<Vec<u8>, String>) {
        let Some((purpose, seg)) = self.backup.reads.remove(&id) else {
            return;
        };
        self.backup.space.read_done(seg);
        if result.is_err() {
            self.counters.ssd_errors += 1;
        }
        match purpose {
            ReadFor::HotBatch { group, off } => self.rec_on_hot_read(group, seg, off, result),
            ReadFor::PriorityPull {
                to,
                id,
                key,
                mut buffered,
                off,
            } => {
                if let Ok(bytes) = &result {
                    buffered.extend(
                        page::decode_pages(seg, off, bytes)
                            .0
                            .into_iter()
                            .map(|x| x.1),
                    );
                }
                // Versions still in the buffer now (a writeback may have moved the key).
                buffered.extend(self.buffered_versions(&key));
                // An error answers what the buffer has; the primary retries (never stale).
                self.send(
                    to,
                    PeerBody::PriorityPullReply {
                        id,
                        entries: buffered,
                    },
                );
            }
            ReadFor::RequestLog { to, index, loc } => {
                let entry = result
                    .ok()
                    .and_then(|b| page::entry_at(loc, &b))
                    .filter(|e| e.index == index);
                // A read error is not "absent": answer nothing, the leader asks again.
                if let Some(e) = entry {
                    let entry = Some(e);
                    self.send(
                        to,
                        PeerBody::LogReply {
                            index,
                            entry,
                            gone: false,
                        },
                    );
                }
            }
            ReadFor::BatchPull {
                to,
                stream,
                seg,
                off,
                len,
            } => {
                let Ok(bytes) = result else { return };
                let (decoded, valid) = page::decode_pages(seg, off, &bytes);
                if decoded.is_empty() {
                    if let Some(n) = page::cut_off_len(&bytes).filter(|n| *n > len as usize) {
                        // An entry longer than the read: read exactly its pages.
                        return self.ssd_read(
                            ReadFor::BatchPull {
                                to,
                                stream,
                                seg,
                                off,
                                len: n as u32,
                            },
                            seg,
                            off,
                            n as u32,
                            IoClass::BatchPull,
                        );
                    }
                }
                let entries: Vec<Entry> = decoded.into_iter().map(|x| x.1).collect();
                // Nothing decodable here (a torn or corrupt tail): on to the next segment.
                let next_cursor = if entries.is_empty() {
                    (seg + 1) << 32
                } else {
                    seg << 32 | (off + valid as u64)
                };
                let done = entries.is_empty() && self.batch_pull_next(next_cursor).is_none();
                self.send(
                    to,
                    PeerBody::BatchPullReply {
                        stream,
                        entries,
                        next_cursor,
                        done,
                    },
                );
            }
            ReadFor::Gc => self.on_gc_read(seg, result),
        }
        self.gc_try_free();
    }

    /// M8: walk the buffer in order; once a batch of *committed, persisted* entries is ready
    /// (or a partial one has waited `writeback_linger_us`), write it to SSD, each entry to the
    /// log its key's popularity picks (M10): one write per log the batch touches.
    fn maybe_writeback(&mut self) {
        if self.backup.wb_in_flight.is_some() || self.refill_writing() {
            return;
        }
        let limit = self.commit.min(self.persisted);
        let from = self.backup.written_back_through + 1;
        if from > limit {
            self.backup.eligible_since_us = None;
            return;
        }
        let mut bytes = 0usize;
        let mut through = self.backup.written_back_through;
        let mut entries = Vec::new();
        let mut i = from;
        while i <= limit {
            match self.log.slot(i) {
                Some(Slot::Entry(e)) => {
                    // Noops are written too: the SSD log then holds every written-back index,
                    // so a restarted backup rebuilds its recent-index window by scanning it.
                    bytes += e.approx_bytes();
                    entries.push(e.clone());
                }
                _ => break,
            }
            through = i;
            i += 1;
            if bytes >= self.p.writeback_batch_bytes {
                break;
            }
        }
        let since = *self.backup.eligible_since_us.get_or_insert(self.now);
        if bytes < self.p.writeback_batch_bytes && self.now < since + self.p.writeback_linger_us {
            return;
        }
        self.backup.eligible_since_us = None;
        debug_assert!(through <= self.commit, "writeback of an uncommitted entry");
        if entries.is_empty() {
            self.finish_writeback(through, &[]);
            return;
        }
        let mut by_log: [Vec<Entry>; 2] = Default::default();
        for e in entries {
            by_log[self.place(&e) as usize].push(e);
        }
        let mut writes = Vec::new();
        let mut placed = Vec::new();
        for (log, es) in [SsdLog::Hot, SsdLog::Cold].into_iter().zip(by_log) {
            if es.is_empty() {
                continue;
            }
            let (w, locs) = self.write_batch(log, &es, IoClass::Writeback);
            writes.push(w);
            placed.extend(es.into_iter().zip(locs));
        }
        self.backup.wb_in_flight = Some(WbBatch {
            writes,
            placed,
            through,
        });
    }

    /// A write of a writeback batch or a GC pass completed. A failed write is retried with
    /// the same bytes at the same place: the index names those pages only after a successful,
    /// synced write.
    fn on_ssd_written(&mut self, id: u64, result: Result<(), String>) {
        let ok = result.is_ok();
        if !ok {
            self.counters.ssd_errors += 1;
        }
        if self.on_refill_written(id, &result) {
            return;
        }
        let new_id = (!ok).then(|| self.next_io_id());
        let b = &mut self.backup;
        let (writes, class) = match (&mut b.wb_in_flight, &mut b.gc) {
            (Some(w), _) if w.writes.iter().any(|x| x.id == id) => {
                (&mut w.writes, IoClass::Writeback)
            }
            (_, Some(g)) if g.writes.iter().any(|x| x.id == id) => (&mut g.writes, IoClass::Gc),
            _ => return,
        };
        let at = writes.iter().position(|x| x.id == id).unwrap();
        b.space.written(writes[at].seg, id, new_id);
        if let Some(n) = new_id {
            let w = &mut writes[at];
            w.id = n;
            let out = Output::SsdWrite {
                id: n,
                seg: w.seg,
                log: w.log,
                off: w.off,
                bytes: w.bytes.clone(),
                class,
            };
            self.out.push(out);
            return;
        }
        writes.remove(at);
        if !writes.is_empty() {
            return;
        }
        if class == IoClass::Writeback {
            let w = b.wb_in_flight.take().unwrap();
            self.counters.writebacks += 1;
            self.finish_writeback(w.through, &w.placed);
        } else {
            self.gc_rewritten();
        }
    }

    /// Index update (only if the new stamp ≥ the indexed one, M5), then the NVMM copies go.
    fn finish_writeback(&mut self, through: u64, placed: &[(Entry, Loc)]) {
        let b = &mut self.backup;
        let mut locs: HashMap<u64, Loc> = HashMap::new();
        for (e, loc) in placed {
            locs.insert(e.index, *loc);
            let Some(key) = e.key() else {
                continue; // a Noop: in the log, not in the index
            };
            let st = e.stamp();
            // A copy, not `get_mut`: the index's byte counters settle when its borrow ends.
            match b.index.get(key).copied() {
                Some(cur) if cur.0 <= st => {
                    b.space.drop_ref(cur.1);
                    b.space.add_ref(*loc);
                    *b.index.get_mut(key).expect("present above") = (st, *loc);
                }
                Some(_) => {}
                None => {
                    b.space.add_ref(*loc);
                    b.index.insert(key.to_vec(), (st, *loc));
                }
            }
        }
        for i in b.written_back_through + 1..=through {
            if let Some(s @ Slot::Entry(_)) = self.log.slot_mut(i) {
                let term = s.term();
                let loc = locs.get(&i).copied();
                if let Some(l) = loc {
                    b.space.add_ref(l);
                    b.slot_refs += 1;
                }
                *s = Slot::Flushed { term, loc };
            }
        }
        b.written_back_through = through;
        self.out.push(Output::PmemFree {
            region: Region::Buffer,
            through_index: through,
        });
        // Forget written-back indexes past the recent-index window.
        while self.log.slots.len() > self.p.recent_index_window_entries
            && self.log.base_index < b.written_back_through
        {
            let s = self.log.slots.pop_front().unwrap();
            if let Slot::Flushed { loc: Some(l), .. } = s {
                b.space.drop_ref(l);
                b.slot_refs -= 1;
            }
            self.log.base_index += 1;
            self.log.base_term = s.term();
        }
    }

    /// M9: while free SSD space is under `gc_free_min_bytes`, collect the segment with the
    /// fewest live bytes: read it (GC class, the lowest), rewrite what the index or the window
    /// still references, move the references, then free it.
    fn maybe_gc(&mut self) {
        if self.backup.gc.is_some() {
            return self.gc_try_free();
        }
        let sp = &self.backup.space;
        if sp.used_bytes() + self.p.gc_free_min_bytes <= self.p.ssd_capacity_bytes {
            return;
        }
        let Some(victim) = sp.victim() else { return };
        let end = sp.durable_end(victim);
        self.counters.gc_passes += 1;
        self.backup.gc = Some(GcPass {
            victim,
            writes: Vec::new(),
            moved: Vec::new(),
            freeing: false,
        });
        if end == 0 {
            return self.gc_rewritten();
        }
        self.ssd_read(ReadFor::Gc, victim, 0, end as u32, IoClass::Gc);
    }

    fn on_gc_read(&mut self, victim: u64, result: Result<Vec<u8>, String>) {
        if self.backup.gc.as_ref().map(|g| g.victim) != Some(victim) {
            return;
        }
        let Ok(bytes) = result else {
            // Try again (perhaps another victim) at a later input.
            self.backup.gc = None;
            return;
        };
        let from_log = self.backup.space.seg(victim).map(|g| g.log);
        let mut by_log: [Vec<(Entry, Loc)>; 2] = Default::default();
        let mut refills: HashSet<Loc> = HashSet::new();
        for (loc, e, refill) in page::decode_pages_tagged(victim, 0, &bytes).0 {
            if refill {
                refills.insert(loc);
            }
            let by_index = e
                .key()
                .and_then(|k| self.backup.index.get(k))
                .is_some_and(|(_, l)| *l == loc);
            let by_slot = matches!(self.log.slot(e.index),
                Some(Slot::Flushed { loc: Some(l), .. }) if *l == loc);
            if !by_index && !by_slot {
                continue; // stale: a newer version is indexed, and the window has moved on
            }
            // A superseded version kept only for the window is never hot.
            let log = match (by_index, self.p.ssd_logs) {
                (true, _) | (false, SsdLogs::Single) => self.place(&e),
                (false, SsdLogs::HotCold) => SsdLog::Cold,
            };
            if log == SsdLog::Hot && from_log == Some(SsdLog::Cold) {
                self.counters.gc_moved_to_hot += 1;
            }
            by_log[log as usize].push((e, loc));
        }
        for (log, live) in [SsdLog::Hot, SsdLog::Cold].into_iter().zip(by_log) {
            let mut batch: Vec<(Entry, Loc)> = Vec::new();
            let mut it = live.into_iter().peekable();
            while let Some(x) = it.next() {
                batch.push(x);
                let full = page::packed_len(batch.iter().map(|x| &x.0)) >= self.p.gc_write_bytes;
                if full || it.peek().is_none() {
                    let es: Vec<Entry> = batch.iter().map(|x| x.0.clone()).collect();
                    // A moved refill version stays one (`refill.rs`).
                    let tags: Vec<bool> = batch.iter().map(|x| refills.contains(&x.1)).collect();
                    let (w, locs) = self.write_batch_tagged(log, &es, &tags, IoClass::Gc);
                    self.counters.gc_bytes_rewritten += w.bytes.len() as u64;
                    let g = self.backup.gc.as_mut().unwrap();
                    g.writes.push(w);
                    g.moved.extend(
                        batch
                            .drain(..)
                            .zip(locs)
                            .map(|((e, old), new)| (e, old, new)),
                    );
                }
            }
        }
        if self.backup.gc.as_ref().unwrap().writes.is_empty() {
            self.gc_rewritten();
        }
    }

    /// Every rewrite of the GC pass is durable: the references move to the copies (only those
    /// still pointing at the victim: a newer version written back meanwhile stays), then the
    /// victim is freed once nothing reads it.
    fn gc_rewritten(&mut self) {
        let Some(mut g) = self.backup.gc.take() else {
            return;
        };
        let b = &mut self.backup;
        for (e, old, new) in g.moved.drain(..) {
            if let Some(mut cur) = e.key().and_then(|k| b.index.get_mut(k)) {
                if cur.1 == old {
                    cur.1 = new;
                    b.space.drop_ref(old);
                    b.space.add_ref(new);
                }
            }
            if let Some(Slot::Flushed { loc: Some(l), .. }) = self.log.slot_mut(e.index) {
                if *l == old {
                    *l = new;
                    b.space.drop_ref(old);
                    b.space.add_ref(new);
                }
            }
        }
        g.freeing = true;
        b.gc = Some(g);
        self.gc_try_free();
    }

    fn gc_try_free(&mut self) {
        let Some(v) = self
            .backup
            .gc
            .as_ref()
            .filter(|g| g.freeing)
            .map(|g| g.victim)
        else {
            return;
        };
        let sp = &mut self.backup.space;
        if sp.seg(v).is_some_and(|g| g.refs > 0) {
            // References the scan could not decode (a corrupt page): keep the segment.
            sp.mark_gc_stuck(v);
            self.counters.ssd_errors += 1;
            self.backup.gc = None;
            return;
        }
        if !sp.freeable(v) {
            return; // a read of it is still in flight
        }
        sp.free(v);
        self.backup.gc = None;
        self.counters.gc_segments_freed += 1;
        self.out.push(Output::SsdFree { seg: v });
    }

    // ---- dispatch ----

    fn on_peer(&mut self, from: NodeId, msg: PeerMsg) {
        // Terms, not epochs, order leaders; a sender outside this node's configuration is
        // heard only if it knows a newer configuration (a leader adding this node).
        if self.cfg.member(from).is_none() && msg.epoch <= self.cfg.epoch {
            return;
        }
        self.reconf_heard(from);
        let term = msg.term;
        match msg.body {
            PeerBody::RequestVote {
                candidate,
                last_index,
                last_term,
            } => {
                if candidate == from {
                    self.on_request_vote(from, term, last_index, last_term);
                }
            }
            PeerBody::Snapshot {
                last_index,
                last_term,
                config,
                offset,
                keys,
                done,
            } => {
                if self.cfg.may_stand(from) {
                    let snap = snapshot::Chunk {
                        last_index,
                        last_term,
                        config,
                        offset,
                        keys,
                        done,
                    };
                    self.on_snapshot(from, term, snap);
                }
            }
            PeerBody::Refill {
                last_index,
                last_term,
                config,
                offset,
                entries,
                done,
            } => {
                if self.cfg.may_stand(from) {
                    let c = refill::Chunk {
                        last_index,
                        last_term,
                        config,
                        offset,
                        entries,
                        done,
                    };
                    self.on_refill(from, term, c);
                }
            }
            PeerBody::AppendEntries {
                leader,
                prev_index,
                prev_term,
                entries,
                commit,
                sent_us,
            } => {
                if leader == from && self.cfg.may_stand(from) {
                    self.on_append(from, term, prev_index, prev_term, entries, commit, sent_us);
                }
            }
            body => {
                // Replies and pulls: a higher term deposes us; a lower one is stale.
                if term > self.term {
                    self.step_down(term);
                    self.reset_election_timer();
                }
                let same = term == self.term;
                match body {
                    PeerBody::Vote {
                        granted,
                        last_index,
                        last_term,
                        in_lease,
                        config,
                    } => {
                        if same {
                            self.on_vote(from, granted, last_index, last_term, in_lease, config)
                        } else if !granted && !in_lease && term < self.term {
                            // An old refusal: still a fact about the backup's log.
                        }
                    }
                    PeerBody::AppendAck {
                        success,
                        match_index,
                        sent_us,
                        durable,
                        want_snapshot,
                    } if same => {
                        self.snapshot_ack_info(from, success, durable, want_snapshot);
                        self.on_append_ack(from, success, match_index, sent_us)
                    }
                    PeerBody::SnapshotAck {
                        last_index,
                        next_offset,
                        installed,
                    } if same => self.on_snapshot_ack(from, last_index, next_offset, installed),
                    PeerBody::RefillAck {
                        last_index,
                        next_offset,
                        installed,
                    } if same => self.on_refill_ack(from, last_index, next_offset, installed),
                    PeerBody::RequestLog { index } if same => self.on_request_log(from, index),
                    PeerBody::LogReply { index, entry, gone } if same => {
                        self.on_log_reply(from, index, entry, gone)
                    }
                    PeerBody::PriorityPull { id, key } if same => {
                        self.on_priority_pull(from, id, key.into_vec())
                    }
                    PeerBody::PriorityPullReply { id, entries } if same => {
                        self.on_priority_pull_reply(id, entries)
                    }
                    // BatchPull streams carry data only (every entry is stamp-checked at install),
                    // so they run across terms: a proactive pull starts in the old term.
                    PeerBody::BatchPull { stream, cursor } => {
                        self.on_batch_pull(from, stream, cursor)
                    }
                    PeerBody::BatchPullReply {
                        stream,
                        entries,
                        next_cursor,
                        done,
                    } => self.on_batch_reply(stream, entries, next_cursor, done),
                    PeerBody::BatchPullAbort { stream } => self.rec_on_abort(stream),
                    PeerBody::Popularity { keys } => self.rec_on_popularity(from, keys),
                    _ => {}
                }
            }
        }
    }
}
