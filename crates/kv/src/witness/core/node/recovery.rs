//! Recovery policy of [`WitnessCore`] (paper §5, spec M15–M17, M20 and the baselines of issue
//! 25 item 5): the Φ-accrual soft and hard timeouts, popularity sampling on the primary and the
//! backups' popular list that orders BatchPull, the BatchPull rate limit, and the recovery
//! scheme (`--recovery`) that switches each mechanism on or off.
//!
//! Kept apart from `node.rs` so the replication and storage paths there stay about replication
//! and storage; everything here is reached through a handful of hooks in those paths.
//!
//! Hot-first BatchPull without stream state on the backup: a BatchPull cursor with
//! [`HOT_CURSOR`] set means "position `cursor & !HOT_CURSOR` in the backup's popular list".
//! The backup answers such a request with the current values (NVMM buffer versions plus the
//! SSD page group its index names) of the next few popular keys, and, once the list is
//! exhausted, with `next_cursor = 0`: the ordinary log scan from the start. The list may change
//! between requests (a new popularity shipment); that only changes which keys come early,
//! never what is installed (every entry is stamp-checked) nor completion (the log scan and the
//! missing set decide that).

use std::collections::{BTreeSet, HashMap, HashSet};

use rand::rngs::StdRng;
use rand::SeedableRng;
use serde_bytes::ByteBuf;

use super::*;
use crate::witness::core::detector::{Detector, DetectorConfig, Suspicion};
use crate::witness::core::popularity::{
    LruConfig, PopularityLru, PopularitySampler, SamplerConfig,
};

/// A BatchPull cursor in the popular-keys phase (see the module docs). Log offsets never
/// reach 2⁶³ bytes, so the bit is free.
pub const HOT_CURSOR: u64 = 1 << 63;

/// The read size an `offline` backup uses for BatchPull: large sequential reads, the disk's
/// best throughput, well under [`crate::witness::proto::MAX_PEER_MSG_BYTES`] per reply.
pub const OFFLINE_BATCH_PULL_BYTES: usize = 1 << 20;

/// How a new primary recovers (`--recovery`): CANDStore and the baselines it is compared with
/// (issue 25 item 5). Every node of a group must run the same scheme.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Recovery {
    /// Everything on: proactive pull on the soft timeout, popular keys first, PriorityPull on
    /// a miss, rate-limited BatchPull.
    #[default]
    Cand,
    /// The strongest fair offline restore: the same detection and election, then an
    /// unthrottled pull in large sequential reads, serving nothing (`Unavailable`) until the
    /// missing set is empty.
    Offline,
    /// No PriorityPull: a Get on a missing key waits for the BatchPull to bring it.
    BatchOnly,
    /// No pull before the election (the soft timeout is off).
    NoProactive,
    /// The backup keeps one SSD log instead of hot and cold ones (`WitnessCore::new` sets
    /// `Params::ssd_logs` to `SsdLogs::Single`).
    SingleLog,
    /// No popularity sampling: BatchPull in log order.
    NoSampling,
    /// Witnesses keep values too (the 3× layout, for the cost side): little or nothing is
    /// missing after an election.
    FullReplica,
}

impl Recovery {
    pub const ALL: [Recovery; 7] = [
        Recovery::Cand,
        Recovery::Offline,
        Recovery::BatchOnly,
        Recovery::NoProactive,
        Recovery::SingleLog,
        Recovery::NoSampling,
        Recovery::FullReplica,
    ];

    /// The name on the command line (`--recovery <name>`).
    pub fn name(self) -> &'static str {
        match self {
            Recovery::Cand => "cand",
            Recovery::Offline => "offline",
            Recovery::BatchOnly => "batch-only",
            Recovery::NoProactive => "no-proactive",
            Recovery::SingleLog => "single-log",
            Recovery::NoSampling => "no-sampling",
            Recovery::FullReplica => "full-replica",
        }
    }

    /// Proactive BatchPull on the soft timeout (M15). Not for full-replica either: its
    /// witnesses already hold the values.
    pub fn proactive(self) -> bool {
        !matches!(
            self,
            Recovery::Offline | Recovery::NoProactive | Recovery::FullReplica
        )
    }

    /// PriorityPull of a missing key a Get asks for (M18).
    pub fn priority_pull(self) -> bool {
        !matches!(self, Recovery::Offline | Recovery::BatchOnly)
    }

    /// Popularity sampling and popular-keys-first BatchPull (M10, M15).
    pub fn sampling(self) -> bool {
        !matches!(self, Recovery::Offline | Recovery::NoSampling)
    }

    /// Clients are served while values are still missing (live recovery, M17).
    pub fn serves_while_missing(self) -> bool {
        self != Recovery::Offline
    }

    /// BatchPull is paced (M20): only the offline restore runs flat out.
    pub fn rate_limited(self) -> bool {
        self != Recovery::Offline
    }

    /// Heads receive and keep values.
    pub fn full_replica(self) -> bool {
        self == Recovery::FullReplica
    }
}

impl std::fmt::Display for Recovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown recovery scheme {0:?} (one of cand, offline, batch-only, no-proactive, single-log, no-sampling, full-replica)")]
pub struct UnknownRecovery(pub String);

impl std::str::FromStr for Recovery {
    type Err = UnknownRecovery;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Recovery::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| UnknownRecovery(s.to_string()))
    }
}

/// The leader-side BatchPull pacing (M20): a token bucket in bytes with an AIMD rate. The
/// paper's full copy ran at about a quarter of the SSD's line rate so that PriorityPulls stay
/// fast; a fixed quarter is wrong on a disk shared with seven other processes, so the rate
/// halves whenever a PriorityPull takes longer than its target and creeps back up otherwise.
#[derive(Clone, Debug)]
pub(super) struct PullRate {
    /// The current rate; `u64::MAX` = unlimited.
    pub(super) bytes_per_s: u64,
    tokens_bytes: u64,
    refilled_us: u64,
}

impl PullRate {
    fn new(p: &Params, now_us: u64) -> PullRate {
        let bytes_per_s = if p.batch_pull_bytes_per_s == 0 || !p.recovery.rate_limited() {
            u64::MAX
        } else {
            p.batch_pull_bytes_per_s
        };
        PullRate {
            bytes_per_s,
            tokens_bytes: p.batch_pull_bytes as u64,
            refilled_us: now_us,
        }
    }

    /// Takes `cost` bytes if the bucket holds them. The bucket holds at most two requests'
    /// worth, so an idle stream cannot save up a burst that would starve PriorityPulls.
    fn try_take(&mut self, now_us: u64, cost: u64) -> bool {
        if self.bytes_per_s == u64::MAX {
            return true;
        }
        let dt = now_us.saturating_sub(self.refilled_us);
        self.refilled_us = now_us;
        let add = (u128::from(self.bytes_per_s) * u128::from(dt) / 1_000_000) as u64;
        self.tokens_bytes = self.tokens_bytes.saturating_add(add).min(2 * cost);
        if self.tokens_bytes >= cost {
            self.tokens_bytes -= cost;
            true
        } else {
            false
        }
    }

    /// One PriorityPull answered after `latency_us`.
    fn observe(&mut self, p: &Params, latency_us: u64) {
        if self.bytes_per_s == u64::MAX || p.priority_pull_target_us == 0 {
            return;
        }
        let max = p.batch_pull_bytes_per_s;
        let min = p.batch_pull_bytes_per_s_min.min(max).max(1);
        self.bytes_per_s = if latency_us > p.priority_pull_target_us {
            (self.bytes_per_s / 2).max(min)
        } else {
            self.bytes_per_s.saturating_add(max / 16).min(max)
        };
    }
}

/// A popular-keys BatchPull answer waiting for its SSD reads.
#[derive(Clone, Debug)]
pub(super) struct HotBatch {
    to: NodeId,
    stream: u64,
    next_cursor: u64,
    reads_left: usize,
    entries: Vec<Entry>,
}

/// The recovery policy's state in one node (every kind carries all of it; each part is used
/// by the kinds that need it).
#[derive(Clone, Debug)]
pub(super) struct RecoveryState {
    /// Heads: the Φ-accrual detector of the current leader (M16).
    detector: Detector,
    /// The (term, leader) the detector is measuring.
    measuring: Option<(u64, NodeId)>,
    /// Heads, while leading: the sampler of served keys (M10).
    sampler: PopularitySampler<Vec<u8>, StdRng>,
    /// Backups: the popular list from the primary's shipments.
    /// Backups: the popular list (M10), which orders BatchPull and places writebacks hot or
    /// cold.
    pub(super) lru: PopularityLru<Vec<u8>>,
    /// Recovering heads: the BatchPull pacing (M20).
    pub(super) rate: PullRate,
    /// Backups: popular-keys BatchPull answers waiting for reads, by group id.
    hot: HashMap<u64, HotBatch>,
    pub(super) counters: RecoveryCounters,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryCounters {
    /// Popularity messages sent (one per backup per shipment).
    pub popularity_shipped: u64,
    pub popularity_received: u64,
    /// Popular-keys BatchPull answers a backup began.
    pub hot_batches_served: u64,
    /// Times a due BatchPull request was held back by the pacing (once per input it waited).
    pub batch_pulls_paced: u64,
    /// Client requests refused `Unavailable` by the offline scheme while values were missing.
    pub gets_refused_offline: u64,
}

pub(super) fn detector_config(p: &Params) -> DetectorConfig {
    let ms = |us: u64| us.div_ceil(1000).max(1);
    DetectorConfig {
        phi_soft: p.phi_soft,
        phi_hard: p.phi_hard,
        soft_floor_ms: ms(p.soft_timeout_us).min(ms(p.election_timeout_us)),
        hard_floor_ms: ms(p.election_timeout_us),
        heartbeat_interval_ms: ms(p.heartbeat_us),
        ..DetectorConfig::default()
    }
}

impl RecoveryState {
    pub(super) fn new(id: NodeId, p: &Params, now_us: u64) -> Result<Self, ParamsError> {
        let detector = Detector::new(detector_config(p), now_us)
            .map_err(|e| ParamsError::Recovery(e.to_string()))?;
        let probability = if p.recovery.sampling() {
            p.popularity_sample_probability
        } else {
            0.0
        };
        let sampler = PopularitySampler::new(
            SamplerConfig {
                probability,
                ship_interval_ms: p.popularity_ship_interval_us.div_ceil(1000),
                batch_keys_max: p.popularity_batch_keys_max,
            },
            // Seeded by node id: a simulation replays exactly.
            StdRng::seed_from_u64(0x5EED_0000 ^ u64::from(id)),
            now_us,
        )
        .map_err(|e| ParamsError::Recovery(e.to_string()))?;
        let lru = PopularityLru::new(LruConfig {
            entries_max: p.popular_keys_max,
            ..LruConfig::default()
        })
        .map_err(|e| ParamsError::Recovery(e.to_string()))?;
        Ok(RecoveryState {
            detector,
            measuring: None,
            sampler,
            lru,
            rate: PullRate::new(p, now_us),
            hot: HashMap::new(),
            counters: RecoveryCounters::default(),
        })
    }

    pub(super) fn check_invariants(&self) {
        self.detector.check_invariants();
        self.sampler.check_invariants();
        self.lru.check_invariants();
        for h in self.hot.values() {
            assert!(h.reads_left > 0, "a finished popular-keys batch kept");
        }
    }
}

/// Orders BatchPull cursors: every popular-list position comes before every log offset, so a
/// late reply to an earlier request never moves a stream back.
pub(super) fn cursor_max(a: u64, b: u64) -> u64 {
    let rank = |c: u64| (c & HOT_CURSOR == 0, c & !HOT_CURSOR);
    if rank(b) > rank(a) {
        b
    } else {
        a
    }
}

impl WitnessCore {
    pub fn recovery_counters(&self) -> &RecoveryCounters {
        &self.rec.counters
    }

    /// The current BatchPull rate in bytes per second (`u64::MAX`: unlimited).
    pub fn batch_pull_rate_bytes_per_s(&self) -> u64 {
        self.rec.rate.bytes_per_s
    }

    /// How strongly this head suspects the leader now (M16): the Φ-accrual detector with the
    /// fixed timeouts as floors, and `suspicion_ceiling_factor` times them as ceilings (a
    /// leader whose heartbeats jitter a lot widens the distribution; it must still be
    /// replaced within a bound).
    pub fn suspicion(&self) -> Suspicion {
        // Every arrival the detector sees also sets `heard_leader_us`, and so does a vote
        // grant, which the detector does not see.
        let silence_us = self.now.saturating_sub(self.heard_leader_us.unwrap_or(0));
        let c = self.p.suspicion_ceiling_factor.max(1);
        let mut s = self.rec.detector.suspicion(self.now);
        // Hearing a leader (or granting a vote) counts even where the detector did not see it.
        if silence_us < self.p.soft_timeout_us {
            s = Suspicion::Trusted;
        } else if silence_us < self.p.election_timeout_us {
            s = s.min(Suspicion::Soft);
        }
        if silence_us >= self.p.election_timeout_us.saturating_mul(c) {
            s = Suspicion::Hard;
        } else if self.p.soft_timeout_us > 0
            && silence_us >= self.p.soft_timeout_us.saturating_mul(c)
        {
            s = s.max(Suspicion::Soft);
        }
        s
    }

    /// Hook: a valid AppendEntries of the current leader arrived (any AppendEntries is proof
    /// of life, M11). A new leader resets the detector: the old one's timing says nothing.
    pub(super) fn rec_leader_heard(&mut self, term: u64, leader: NodeId) {
        if self.rec.measuring == Some((term, leader)) {
            self.rec.detector.heartbeat(self.now);
        } else {
            self.rec.measuring = Some((term, leader));
            self.rec.detector.reset(self.now);
        }
    }

    /// Hook for the election timer: the hard timeout has passed its floor (the election
    /// deadline); stand only if the detector agrees, or as a candidate (a split vote).
    pub(super) fn rec_hard_timeout(&self) -> bool {
        self.role == RoleKind::Candidate
            || self.rec.measuring.is_none()
            || self.suspicion() == Suspicion::Hard
    }

    /// Hook for the proactive pull: the soft timeout has fired.
    pub(super) fn rec_soft_timeout(&self) -> bool {
        self.p.soft_timeout_us > 0
            && self.p.recovery.proactive()
            && self.suspicion() >= Suspicion::Soft
    }

    /// Hook: the serving leader served a request for `key`.
    pub(super) fn rec_sample(&mut self, key: &[u8]) {
        if self.p.recovery.sampling() {
            self.rec.sampler.on_served(key);
        }
    }

    /// Hook for the leader's tick: ship the sampled keys when due (M10), most sampled first,
    /// cut to `popularity_msg_bytes_max` so a shipment is one bounded message.
    pub(super) fn rec_ship_popularity(&mut self) {
        if self.role != RoleKind::Leader || !self.p.recovery.sampling() {
            return;
        }
        let Some(batch) = self.rec.sampler.take_due(self.now) else {
            return;
        };
        let mut bytes = 0usize;
        let keys: Vec<(ByteBuf, u32)> = batch
            .into_iter()
            .take_while(|(k, _)| {
                bytes += k.len() + 8;
                bytes <= self.p.popularity_msg_bytes_max
            })
            .map(|(k, n)| (ByteBuf::from(k), n))
            .collect();
        if keys.is_empty() {
            return;
        }
        let backups: Vec<NodeId> = self
            .cfg
            .members
            .iter()
            .filter(|m| m.kind == Kind::Backup)
            .map(|m| m.id)
            .collect();
        for b in backups {
            self.rec.counters.popularity_shipped += 1;
            self.send(b, PeerBody::Popularity { keys: keys.clone() });
        }
    }

    /// Hook: a backup got a popularity shipment. Only a head's is taken (it is a hint, from
    /// the primary; a stale one only reorders a later pull).
    pub(super) fn rec_on_popularity(&mut self, from: NodeId, keys: Vec<(ByteBuf, u32)>) {
        if self.kind != Kind::Backup || self.cfg.kind(from) != Some(Kind::Head) {
            return;
        }
        let batch: Vec<(Vec<u8>, u32)> = keys
            .into_iter()
            .filter(|(k, _)| !k.is_empty() && k.len() <= MAX_KEY_BYTES)
            .map(|(k, n)| (k.into_vec(), n))
            .collect();
        self.rec.counters.popularity_received += 1;
        self.rec.lru.apply(&batch);
    }

    /// The backup's popular list, most popular first (tests, status).
    pub fn popular_keys(&self, n: usize) -> Vec<Vec<u8>> {
        self.rec.lru.hottest(n)
    }

    /// Where a new BatchPull stream starts: the popular keys first, unless sampling is off.
    pub(super) fn rec_stream_start(&self) -> u64 {
        if self.p.recovery.sampling() {
            HOT_CURSOR
        } else {
            0
        }
    }

    /// Hook for sending a BatchPull request: whether the pacing allows one now.
    pub(super) fn rec_may_batch_pull(&mut self) -> bool {
        let cost = self.p.batch_pull_bytes as u64;
        let ok = self.rec.rate.try_take(self.now, cost);
        if !ok {
            self.rec.counters.batch_pulls_paced += 1;
        }
        ok
    }

    /// Hook: a PriorityPull was answered after `latency_us` (the adaptive rate's signal).
    pub(super) fn rec_priority_latency(&mut self, latency_us: u64) {
        self.rec.rate.observe(&self.p, latency_us);
    }

    /// Hook for a client request at a serving leader: whether the scheme refuses it (the
    /// offline restore serves nothing until the missing set is empty).
    pub(super) fn rec_refuses_clients(&mut self) -> bool {
        let refuse = !self.p.recovery.serves_while_missing() && self.in_recovery();
        if refuse {
            self.rec.counters.gets_refused_offline += 1;
        }
        refuse
    }

    /// The BatchPull read size a backup uses.
    pub(super) fn rec_batch_read_bytes(&self) -> usize {
        if self.p.recovery == Recovery::Offline {
            OFFLINE_BATCH_PULL_BYTES.max(self.p.batch_pull_bytes)
        } else {
            self.p.batch_pull_bytes
        }
    }

    /// Backup: a BatchPull in the popular-keys phase (see the module docs).
    pub(super) fn rec_hot_batch_pull(&mut self, from: NodeId, stream: u64, cursor: u64) {
        let pos = (cursor & !HOT_CURSOR) as usize;
        let n = self.p.hot_pull_keys_per_batch.max(1);
        let ranked = self.rec.lru.hottest(pos.saturating_add(n));
        let keys: Vec<Vec<u8>> = ranked.into_iter().skip(pos).collect();
        if keys.is_empty() {
            // The list is done (or empty: nothing sampled): the log scan from its start, in
            // this same request, so an empty list costs no round trip.
            return self.on_batch_pull(from, stream, 0);
        }
        // Pages to read, within one BatchPull's bytes (at least one span).
        let budget = self.p.batch_pull_bytes as u64;
        let mut spans: BTreeSet<(u64, u64, usize)> = BTreeSet::new();
        let mut bytes = 0u64;
        let mut taken = 0usize;
        for k in &keys {
            if let Some((_, loc)) = self.backup.index.get(k) {
                let (off, len) = loc.page_span();
                let span = (loc.seg, off, len);
                if !spans.contains(&span) {
                    if !spans.is_empty() && bytes + len as u64 > budget {
                        break;
                    }
                    bytes += len as u64;
                    spans.insert(span);
                }
            }
            taken += 1;
        }
        let wanted: HashSet<&[u8]> = keys[..taken].iter().map(Vec::as_slice).collect();
        let entries: Vec<Entry> = self
            .unflushed_slots()
            .filter_map(|s| match s {
                Slot::Entry(e)
                    if e.index <= self.persisted && e.key().is_some_and(|k| wanted.contains(k)) =>
                {
                    Some(e.clone())
                }
                _ => None,
            })
            .collect();
        let next_cursor = HOT_CURSOR | (pos + taken) as u64;
        self.rec.counters.hot_batches_served += 1;
        if spans.is_empty() {
            return self.send(
                from,
                PeerBody::BatchPullReply {
                    stream,
                    entries,
                    next_cursor,
                    done: false,
                },
            );
        }
        let group = self.next_io_id();
        self.rec.hot.insert(
            group,
            HotBatch {
                to: from,
                stream,
                next_cursor,
                reads_left: spans.len(),
                entries,
            },
        );
        for (seg, off, len) in spans {
            self.ssd_read(ReadFor::HotBatch { group, off }, seg, off, len as u32, IoClass::BatchPull);
        }
    }

    /// Backup: one read of a popular-keys batch finished. A read error leaves those keys to
    /// the log scan (never answered as absent: BatchPull only ever adds).
    pub(super) fn rec_on_hot_read(&mut self, group: u64, seg: u64, off: u64, result: Result<Vec<u8>, String>) {
        let Some(h) = self.rec.hot.get_mut(&group) else {
            return; // the stream was aborted
        };
        if let Ok(bytes) = result {
            h.entries.extend(page::decode_pages(seg, off, &bytes).0.into_iter().map(|(_, e)| e));
        }
        h.reads_left -= 1;
        if h.reads_left > 0 {
            return;
        }
        let h = self.rec.hot.remove(&group).unwrap();
        self.send(
            h.to,
            PeerBody::BatchPullReply {
                stream: h.stream,
                entries: h.entries,
                next_cursor: h.next_cursor,
                done: false,
            },
        );
    }

    /// Backup: the witness stopped a stream (it heard the leader again, M15): drop what is
    /// still being read for it. SIMPLIFIED: GC is not paused for a stream, so there is nothing
    /// to resume.
    pub(super) fn rec_on_abort(&mut self, stream: u64) {
        self.rec.hot.retain(|_, h| h.stream != stream);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paced(rate: u64) -> Params {
        Params {
            batch_pull_bytes: 100,
            batch_pull_bytes_per_s: rate,
            batch_pull_bytes_per_s_min: rate / 8,
            priority_pull_target_us: 5_000,
            ..Params::default()
        }
    }

    #[test]
    fn pull_rate_is_a_bounded_token_bucket() {
        let p = paced(1_000); // 1000 B/s, requests of 100 B: one per 100 ms
        let mut r = PullRate::new(&p, 0);
        assert!(r.try_take(0, 100), "starts with one request's worth");
        assert!(!r.try_take(0, 100));
        assert!(!r.try_take(99_000, 100));
        assert!(r.try_take(100_000, 100));
        // A long idle time saves up at most two requests.
        assert!(r.try_take(10_000_000, 100));
        assert!(r.try_take(10_000_000, 100));
        assert!(!r.try_take(10_000_000, 100));
        // Unlimited, and never paced for offline.
        let mut u = PullRate::new(&paced(0), 0);
        assert!((0..100).all(|_| u.try_take(0, 100)));
        let off = Params {
            recovery: Recovery::Offline,
            ..paced(1_000)
        };
        let mut o = PullRate::new(&off, 0);
        assert!((0..100).all(|_| o.try_take(0, 100)));
    }

    #[test]
    fn pull_rate_halves_on_slow_priority_pulls_and_recovers() {
        let p = paced(1_600);
        let mut r = PullRate::new(&p, 0);
        r.observe(&p, 6_000);
        assert_eq!(r.bytes_per_s, 800);
        for _ in 0..10 {
            r.observe(&p, 50_000);
        }
        assert_eq!(r.bytes_per_s, 200, "never below the floor");
        for _ in 0..100 {
            r.observe(&p, 1_000);
        }
        assert_eq!(r.bytes_per_s, 1_600, "never above the ceiling");
        let fixed = Params {
            priority_pull_target_us: 0,
            ..p.clone()
        };
        r.observe(&fixed, 1_000_000);
        assert_eq!(r.bytes_per_s, 1_600, "target 0: a fixed rate");
    }

    #[test]
    fn cursors_order_popular_positions_before_log_offsets() {
        assert_eq!(cursor_max(HOT_CURSOR | 3, 0), 0);
        assert_eq!(cursor_max(0, HOT_CURSOR | 3), 0);
        assert_eq!(cursor_max(HOT_CURSOR | 3, HOT_CURSOR | 5), HOT_CURSOR | 5);
        assert_eq!(cursor_max(4096, 8192), 8192);
        assert_eq!(cursor_max(8192, HOT_CURSOR), 8192);
    }
}
