//! Log truncation and key-table snapshots of the witness KV's heads (spec M24), as a part of
//! [`WitnessCore`] (a child module of `node`).
//!
//! A head's log is the only copy of nothing: every applied entry lives on in the key table
//! (and, at the primary, the value table), and on every backup's SSD. So a head drops the
//! applied prefix of its log, in memory and in its NVMM Log region (`PmemFree`), keeping
//! between `log_keep_entries` and twice that many applied entries, which bounds the region
//! however long the group runs. The leader also never drops an entry some live member does
//! not yet hold durably (a head: persisted; a backup: written back to SSD, so a backup that
//! loses its NVMM buffer can still be refilled from the log; TiKV's lesson: no log GC while a
//! voter lags). A member lost past `member_lost_us` no longer holds the prefix back.
//!
//! A head whose next entry is gone from the leader's log gets a snapshot instead: the key →
//! stamp table as of the leader's applied index, the configuration in force there, in chunks
//! of sorted keys, each acknowledged. Installing merges stamps by maximum (the table only ever
//! holds committed stamps, so the maximum is the newer), drops the log up to the snapshot
//! (keeping a matching suffix, as Raft does) and sets commit and applied to its index.
//!
//! A head's key table lives in DRAM (accounted as NVMM, spec (c)); what survives a restart is
//! its NVMM log. A head restarted from a truncated log therefore cannot rebuild the table and
//! must not lead: it says so in its acks (`want_snapshot`) and stands for nothing until the
//! leader's snapshot is installed.
//!
//! SIMPLIFIED: a backup too far behind a truncated log (a substituted-out backup returning
//! much later) is not refilled: it would need the values, which only the primary's table and
//! the other backups' SSDs hold; the replacement policy adds a spare instead.

use super::*;

/// One snapshot message's content.
#[derive(Clone, Debug)]
pub(super) struct Chunk {
    pub last_index: u64,
    pub last_term: u64,
    pub config: Config,
    pub offset: u64,
    pub keys: Vec<(ByteBuf, Stamp)>,
    pub done: bool,
}

/// A snapshot the leader is sending to one member.
#[derive(Clone, Debug)]
pub(super) struct Sending {
    last_index: u64,
    last_term: u64,
    config: Config,
    keys: Vec<(Vec<u8>, Stamp)>,
    offset: u64,
    sent_us: Option<u64>,
}

/// A snapshot being received.
#[derive(Clone, Debug)]
pub(super) struct Receiving {
    last_index: u64,
    keys: Vec<(Vec<u8>, Stamp)>,
}

#[derive(Clone, Debug, Default)]
pub(super) struct Snap {
    /// This head restarted from a truncated log and waits for a snapshot.
    pub needs: bool,
    /// Leader: through which index each member holds the log durably (from its acks).
    pub durable: BTreeMap<NodeId, u64>,
    pub sending: BTreeMap<NodeId, Sending>,
    pub receiving: Option<Receiving>,
}

impl WitnessCore {
    /// Whether this head is waiting for a snapshot (restarted from a truncated log).
    pub fn needs_snapshot(&self) -> bool {
        self.snap.needs
    }

    /// Index through which this head dropped its log (0: nothing dropped).
    pub fn log_base_index(&self) -> u64 {
        self.log.base_index
    }

    /// Entries this node holds in its in-memory log.
    pub fn log_len(&self) -> usize {
        self.log.slots.len()
    }

    /// What an ack tells the leader it may drop for this member.
    pub(super) fn durable_for_leader(&self, match_index: u64) -> u64 {
        if self.kind == Kind::Backup {
            self.backup.written_back_through.min(match_index)
        } else {
            match_index
        }
    }

    pub(super) fn snapshot_ack_info(
        &mut self,
        from: NodeId,
        success: bool,
        durable: u64,
        want_snapshot: bool,
    ) {
        if self.role != RoleKind::Leader {
            return;
        }
        if success {
            let d = self.snap.durable.entry(from).or_insert(0);
            *d = (*d).max(durable);
        }
        if want_snapshot {
            self.send_snapshot(from, true);
        }
    }

    /// Drops the applied prefix of a head's log (see the module doc).
    pub(super) fn maybe_compact(&mut self) {
        if self.kind != Kind::Head || self.snap.needs {
            return;
        }
        let keep = self.p.log_keep_entries as u64;
        if self.applied <= self.log.base_index + 2 * keep {
            return;
        }
        let mut target = self.applied - keep;
        if self.lead.is_some() {
            let me = self.id;
            let members: Vec<NodeId> = self.cfg.ids().filter(|&m| m != me).collect();
            for m in members {
                if !self.member_lost(m) {
                    target = target.min(self.snap.durable.get(&m).copied().unwrap_or(0));
                }
            }
        }
        // Keep the last entry: a restart then tells a truncated log from an empty one.
        target = target.min(self.log.last_index().saturating_sub(1));
        if target <= self.log.base_index {
            return;
        }
        self.drop_prefix(target);
    }

    fn drop_prefix(&mut self, through: u64) {
        while self.log.base_index < through {
            let Some(s) = self.log.slots.pop_front() else {
                break;
            };
            self.log.base_index += 1;
            self.log.base_term = s.term();
        }
        self.out.push(Output::PmemFree {
            region: Region::Log,
            through_index: through,
        });
    }

    /// Leader: (re)sends the current chunk of a snapshot to `to`, starting one if none is in
    /// flight. `now_anyway` restarts a stale one at once (the member asked for it).
    pub(super) fn send_snapshot(&mut self, to: NodeId, now_anyway: bool) {
        if self.role != RoleKind::Leader || self.cfg.kind(to) != Some(Kind::Head) {
            self.counters.values_unavailable += 1;
            return;
        }
        if !now_anyway && self.member_lost(to) {
            return; // a copy of the table for nobody: it is made when the member is back
        }
        let now = self.now;
        let retry = self.p.pull_retry_us;
        let base = self.log.base_index;
        // A new copy when none is in flight, or the one in flight is behind the log and was
        // not started (a transfer under way is finished first; the rest follows by log).
        let fresh = self.snap.sending.get(&to).is_none_or(|s| {
            s.last_index < base && s.offset == 0 && s.sent_us.is_none_or(|t| now >= t + retry)
        });
        if fresh {
            let mut keys: Vec<(Vec<u8>, Stamp)> = self
                .head
                .keys
                .iter()
                .map(|(k, s)| (k.clone(), *s))
                .collect();
            keys.sort_unstable();
            let last_index = self.applied;
            let Some(last_term) = self.log.term_at(last_index) else {
                return;
            };
            let config = self
                .reconf
                .history
                .iter()
                .rev()
                .find(|(i, _)| *i <= last_index)
                .map_or_else(|| self.cfg.clone(), |(_, c)| c.clone());
            self.counters.snapshots_sent += 1;
            self.snap.sending.insert(
                to,
                Sending {
                    last_index,
                    last_term,
                    config,
                    keys,
                    offset: 0,
                    sent_us: None,
                },
            );
        }
        let retry = self.p.pull_retry_us;
        let chunk = self.p.snapshot_chunk_keys;
        let s = self.snap.sending.get_mut(&to).unwrap();
        if s.sent_us.is_some_and(|t| now < t + retry) {
            return;
        }
        s.sent_us = Some(now);
        let from = (s.offset as usize).min(s.keys.len());
        let to_i = (from + chunk).min(s.keys.len());
        let body = PeerBody::Snapshot {
            last_index: s.last_index,
            last_term: s.last_term,
            config: s.config.clone(),
            offset: from as u64,
            keys: s.keys[from..to_i]
                .iter()
                .map(|(k, st)| (ByteBuf::from(k.clone()), *st))
                .collect(),
            done: to_i == s.keys.len(),
        };
        self.send(to, body);
    }

    pub(super) fn on_snapshot_ack(
        &mut self,
        from: NodeId,
        last_index: u64,
        next_offset: u64,
        installed: bool,
    ) {
        let Some(s) = self.snap.sending.get_mut(&from) else {
            return;
        };
        if s.last_index != last_index {
            return;
        }
        if installed {
            self.snap.sending.remove(&from);
            let d = self.snap.durable.entry(from).or_insert(0);
            *d = (*d).max(last_index);
            if let Some(l) = self.lead.as_mut() {
                let m = l.matched.entry(from).or_insert(0);
                *m = (*m).max(last_index);
                l.next.insert(from, last_index + 1);
            }
            self.send_append(from, last_index + 1);
            return;
        }
        s.offset = next_offset;
        s.sent_us = None;
        self.send_snapshot(from, false);
    }

    /// Follower head: a chunk of the leader's snapshot.
    pub(super) fn on_snapshot(&mut self, from: NodeId, term: u64, c: Chunk) {
        if term < self.term || self.kind != Kind::Head {
            return;
        }
        // What an honest leader's snapshot always satisfies (as `append_is_coherent` for
        // AppendEntries): not a second leader in this node's term, no entry of a later term
        // than the message, stamps within the snapshot, a valid configuration. Anything else
        // is refused and counted, never asserted: one bad peer must not crash the group.
        let own_term_leader = term == self.term && matches!(self.role, RoleKind::Leader | RoleKind::Provisional);
        let stamps_ok = c.keys.iter().all(|(_, st)| st.term <= c.last_term && st.index <= c.last_index);
        if own_term_leader || c.last_term > term || !stamps_ok || c.config.validate().is_err() {
            self.counters.refused_peer_msgs += 1;
            return;
        }
        if term > self.term || self.role != RoleKind::Follower {
            self.step_down(term);
        }
        self.note_leader(term, from);
        self.reconf_follow(from);
        self.leader_hint = Some(from);
        self.heard_leader_us = Some(self.now);
        self.reset_election_timer();
        let ack = |me: &mut Self, next_offset: u64, installed: bool| {
            me.send(
                from,
                PeerBody::SnapshotAck {
                    last_index: c.last_index,
                    next_offset,
                    installed,
                },
            );
        };
        if c.last_index <= self.commit && !self.snap.needs {
            return ack(self, 0, true); // nothing new in it
        }
        let r = match self.snap.receiving.take() {
            Some(r) if r.last_index == c.last_index => r,
            _ => Receiving {
                last_index: c.last_index,
                keys: Vec::new(),
            },
        };
        let mut r = r;
        if c.offset != r.keys.len() as u64 {
            let have = r.keys.len() as u64;
            self.snap.receiving = Some(r);
            return ack(self, have, false); // resend from where this head is
        }
        r.keys
            .extend(c.keys.into_iter().map(|(k, s)| (k.into_vec(), s)));
        if !c.done {
            let have = r.keys.len() as u64;
            self.snap.receiving = Some(r);
            return ack(self, have, false);
        }
        self.install_snapshot(c.last_index, c.last_term, c.config, r.keys);
        ack(self, 0, true);
    }

    fn install_snapshot(
        &mut self,
        index: u64,
        term: u64,
        cfg: Config,
        keys: Vec<(Vec<u8>, Stamp)>,
    ) {
        if index < self.log.base_index {
            return; // older than what this head already dropped: it asks again if it needs
        }
        for (k, st) in keys {
            let mut e = self.head.keys.get_or_insert(k, Stamp::ZERO);
            *e = (*e).max(st);
        }
        // A mismatch at `index` means `index` is past this head's commit (committed entries
        // match everywhere), so dropping the whole log loses nothing committed.
        if self.log.term_at(index) == Some(term) && index <= self.log.last_index() {
            // The log goes on past the snapshot and matches it: keep that suffix.
            self.drop_prefix(index);
        } else {
            let last = self.log.last_index();
            self.log = Log {
                base_index: index,
                base_term: term,
                slots: VecDeque::new(),
            };
            self.unpersisted.clear();
            self.persisted = index;
            self.out.push(Output::PmemFree {
                region: Region::Log,
                through_index: index.max(last),
            });
        }
        self.commit = self.commit.max(index);
        self.applied = self.applied.max(index);
        self.persisted = self.persisted.max(index.min(self.log.last_index()));
        self.leader_match = self.leader_match.max(index);
        self.reconf.history = vec![(index, cfg.clone())];
        self.cfg = cfg;
        self.snap.needs = false;
        self.counters.snapshots_installed += 1;
        self.reset_election_timer();
    }
}
