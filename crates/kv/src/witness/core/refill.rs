//! Refilling a backup that fell behind a truncated log (M24), as a part of [`WitnessCore`]
//! (a child module of `node`, like `snapshot.rs`).
//!
//! A head behind the leader's dropped log prefix gets the key table (`snapshot.rs`); a backup
//! must hold every value, so it gets the leader's *value* table instead: one full Put per key,
//! at the key's newest stamp, in chunks of sorted keys (at most `snapshot_chunk_keys` keys and
//! about `refill_chunk_bytes` bytes each). The leader keeps only the sorted key list (keys, no
//! values) and one chunk; the backup writes each chunk to its SSD logs (hot or cold as
//! writeback would place it) and acknowledges it only once it is durable, so the transfer is
//! paced by the backup's disk (stop and wait: one chunk in flight; an unanswered chunk is
//! re-sent after `pull_retry_us`). When the last chunk is durable the backup restarts its log
//! at the refill's index `S` (the leader's applied index when the refill began) and the leader
//! resumes log shipping from `S + 1`.
//!
//! **Why this is safe against writes racing the transfer.** The leader reads each value when
//! it builds the chunk, not at `S`, and only a value whose stamp equals the key table's (a
//! committed, applied version; a recovering leader that lacks a value sends nothing for it
//! and waits). So each key arrives at its version as of `S` or a newer committed one. Every
//! write after `S` then reaches the backup by the log from `S + 1`, in order, and is written
//! back under the same rule as every version on a backup: the index keeps the highest stamp
//! (M5), so a value newer than the refill's stamp wins and a refill version never replaces a
//! newer one. Keys first written after `S` are not in the list and come by the log. A version
//! superseded before its key was sent is never needed: every pull is stamp-checked against the
//! witness's newer key stamp (M18). The leader never drops its log past what this backup holds
//! durably while the backup is live (`maybe_compact`), so `S + 1` is still in its log at the end.
//!
//! **Why a crash of either side is safe.** Refill versions are written with their own page
//! kind (`page::KIND_REFILL_PUT`): a restart indexes them but never counts their indexes as
//! part of the backup's log, so a backup that crashed mid-refill comes back at the log it held
//! before, and the leader starts the refill again (its acks say where it is). A backup that
//! finished (its NVMM buffer then holds entries past `S` while its SSD log ends below `S`)
//! restarts its log at the first buffered index - 1 (`refill_restored`). A new leader starts
//! its own refill (a different `S`); what the old one wrote stays valid (committed versions).
//! GC keeps the page kind when it moves a refill version.

use super::*;

/// One refill message's content.
#[derive(Clone, Debug)]
pub(super) struct Chunk {
    pub last_index: u64,
    pub last_term: u64,
    pub config: Config,
    pub offset: u64,
    pub entries: Vec<Entry>,
    pub done: bool,
}

/// A refill the leader is sending to one backup.
#[derive(Clone, Debug)]
struct Sending {
    last_index: u64,
    last_term: u64,
    config: Config,
    /// The keys of the value table when the refill began, sorted (no values: each is read
    /// when its chunk is built).
    keys: Vec<Vec<u8>>,
    /// Keys the backup holds durably.
    offset: u64,
    sent_us: Option<u64>,
}

/// A chunk the backup is writing to SSD.
#[derive(Clone, Debug)]
struct Writing {
    from: NodeId,
    last_index: u64,
    last_term: u64,
    config: Config,
    next_offset: u64,
    done: bool,
    writes: Vec<SsdWriteReq>,
    placed: Vec<(Entry, Loc)>,
}

#[derive(Clone, Debug, Default)]
pub(super) struct Refill {
    sending: BTreeMap<NodeId, Sending>,
    /// Backup: the refill being received, (its index, keys durable so far).
    receiving: Option<(u64, u64)>,
    writing: Option<Writing>,
}

impl WitnessCore {
    /// Backup: the refill being received, (its index, keys durable so far) (tests, status).
    pub fn refill_receiving(&self) -> Option<(u64, u64)> {
        self.refill.receiving
    }

    /// Where a backup's indexed version of `key` is on its SSD (tests read it back).
    pub fn backup_index_loc(&self, key: &[u8]) -> Option<Loc> {
        self.backup.index.get(key).map(|(_, l)| *l)
    }

    /// A backup writing a refill chunk (its writeback waits: see `install_refill`).
    pub(super) fn refill_writing(&self) -> bool {
        self.refill.writing.is_some()
    }

    /// This head just won an election: a refill it sent in an earlier term is not resumed
    /// (its backup may have moved on under another leader); each starts afresh.
    pub(super) fn refill_on_lead(&mut self) {
        self.refill.sending.clear();
    }

    /// Leader: (re)sends the current chunk of a refill to backup `to`, starting one if none is
    /// in flight (see the module doc). `now_anyway`: the backup asked (it is live).
    pub(super) fn send_refill(&mut self, to: NodeId, now_anyway: bool) {
        if self.role != RoleKind::Leader {
            return;
        }
        if !now_anyway && self.member_lost(to) {
            // No copy of the table for nobody; but a backup never speaks first (it never
            // runs), so an empty AppendEntries at the log's base asks it to: its refusal
            // says it is back, and the refill starts at the next heartbeat.
            let (prev_index, prev_term, commit) =
                (self.log.base_index, self.log.base_term, self.commit);
            let sent_us = self.now;
            let leader = self.id;
            self.send(
                to,
                PeerBody::AppendEntries {
                    leader,
                    prev_index,
                    prev_term,
                    entries: vec![],
                    commit,
                    sent_us,
                },
            );
            return;
        }
        let now = self.now;
        let retry = self.p.pull_retry_us;
        let base = self.log.base_index;
        let fresh = self.refill.sending.get(&to).is_none_or(|s| {
            s.last_index < base && s.offset == 0 && s.sent_us.is_none_or(|t| now >= t + retry)
        });
        if fresh {
            if self.in_recovery() {
                // This leader still pulls values it lacks: nothing to copy yet.
                self.counters.values_unavailable += 1;
                return;
            }
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
            let mut keys: Vec<Vec<u8>> = self.head.keys.keys().cloned().collect();
            keys.sort_unstable();
            self.counters.refills_sent += 1;
            self.refill.sending.insert(
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
        let (max_keys, max_bytes) = (self.p.snapshot_chunk_keys, self.p.refill_chunk_bytes);
        let s = self.refill.sending.get_mut(&to).unwrap();
        if s.sent_us.is_some_and(|t| now < t + retry) {
            return;
        }
        let mut entries = Vec::new();
        let mut bytes = 0usize;
        let mut i = (s.offset as usize).min(s.keys.len());
        while i < s.keys.len() && entries.len() < max_keys {
            let k = &s.keys[i];
            let ks = self.head.keys.get(k).copied();
            let Some((vs, v)) = self.head.values.get(k).filter(|(vs, _)| Some(*vs) == ks) else {
                break; // a value this leader lacks (it recovers it first)
            };
            let e = Entry {
                index: vs.index,
                term: vs.term,
                op: Op::Put {
                    key: k.clone(),
                    value: Some(ByteBuf::from(v.clone())),
                },
            };
            if !entries.is_empty() && bytes + e.approx_bytes() > max_bytes {
                break;
            }
            bytes += e.approx_bytes();
            entries.push(e);
            i += 1;
        }
        if entries.is_empty() && i < s.keys.len() {
            self.counters.values_unavailable += 1;
            return;
        }
        s.sent_us = Some(now);
        let body = PeerBody::Refill {
            last_index: s.last_index,
            last_term: s.last_term,
            config: s.config.clone(),
            offset: s.offset,
            entries,
            done: i == s.keys.len(),
        };
        self.send(to, body);
    }

    pub(super) fn on_refill_ack(
        &mut self,
        from: NodeId,
        last_index: u64,
        next_offset: u64,
        installed: bool,
    ) {
        let Some(s) = self.refill.sending.get_mut(&from) else {
            return;
        };
        if s.last_index != last_index {
            return;
        }
        if installed {
            self.refill.sending.remove(&from);
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
        s.offset = next_offset.min(s.keys.len() as u64);
        s.sent_us = None;
        self.send_refill(from, false);
    }

    /// Backup: a chunk of the leader's refill.
    pub(super) fn on_refill(&mut self, from: NodeId, term: u64, c: Chunk) {
        if term < self.term || self.kind != Kind::Backup {
            return;
        }
        // What an honest leader's refill always satisfies: full Puts of no later term than
        // the message, no other leader known in its term, a valid configuration. Anything
        // else is refused and counted, never asserted: one bad peer must not crash the group.
        let entries_ok = c.entries.iter().all(|e| {
            e.term <= term
                && e.index > 0
                && matches!(&e.op, Op::Put { key, value: Some(v) }
                    if key.len() <= MAX_KEY_BYTES && v.len() <= MAX_VALUE_BYTES)
        });
        let other_leader = self.leaders_seen.get(&term).is_some_and(|&l| l != from);
        if c.last_term > term || !entries_ok || other_leader || c.config.validate().is_err() {
            self.counters.refused_peer_msgs += 1;
            return;
        }
        if term > self.term || self.role != RoleKind::Follower {
            self.step_down(term);
        }
        self.note_leader(term, from);
        self.leader_hint = Some(from);
        self.heard_leader_us = Some(self.now);
        let ack = |me: &mut Self, next_offset: u64, installed: bool| {
            me.send(
                from,
                PeerBody::RefillAck {
                    last_index: c.last_index,
                    next_offset,
                    installed,
                },
            );
        };
        if c.last_index <= self.commit {
            return ack(self, 0, true); // this backup's log already holds it all
        }
        if self.refill.writing.is_some() || self.backup.wb_in_flight.is_some() {
            return; // busy: the leader re-sends after `pull_retry_us`
        }
        let have = match self.refill.receiving {
            Some((li, n)) if li == c.last_index => n,
            _ => 0,
        };
        self.refill.receiving = Some((c.last_index, have));
        if c.offset != have {
            return ack(self, have, false); // resend from where this backup is
        }
        let mut w = Writing {
            from,
            last_index: c.last_index,
            last_term: c.last_term,
            config: c.config,
            next_offset: have + c.entries.len() as u64,
            done: c.done,
            writes: Vec::new(),
            placed: Vec::new(),
        };
        let mut by_log: [Vec<Entry>; 2] = Default::default();
        for e in c.entries {
            by_log[self.place(&e) as usize].push(e);
        }
        for (log, es) in [SsdLog::Hot, SsdLog::Cold].into_iter().zip(by_log) {
            if es.is_empty() {
                continue;
            }
            let tags = vec![true; es.len()];
            let (req, locs) = self.write_batch_tagged(log, &es, &tags, IoClass::Writeback);
            w.writes.push(req);
            w.placed.extend(es.into_iter().zip(locs));
        }
        let empty = w.writes.is_empty();
        self.refill.writing = Some(w);
        if empty {
            self.refill_chunk_durable();
        }
    }

    /// Backup: an SSD write finished. `false`: not one of the refill's.
    pub(super) fn on_refill_written(&mut self, id: u64, result: &Result<(), String>) -> bool {
        let Some(w) = self.refill.writing.as_mut() else {
            return false;
        };
        let Some(at) = w.writes.iter().position(|x| x.id == id) else {
            return false;
        };
        if result.is_err() {
            // Retried unchanged under a new id, as writeback does.
            let n = self.next_io_id();
            let w = self.refill.writing.as_mut().unwrap();
            self.backup.space.written(w.writes[at].seg, id, Some(n));
            let x = &mut w.writes[at];
            x.id = n;
            let out = Output::SsdWrite {
                id: n,
                seg: x.seg,
                log: x.log,
                off: x.off,
                bytes: x.bytes.clone(),
                class: IoClass::Writeback,
            };
            self.out.push(out);
            return true;
        }
        self.backup.space.written(w.writes[at].seg, id, None);
        w.writes.remove(at);
        if w.writes.is_empty() {
            self.refill_chunk_durable();
        }
        true
    }

    /// The chunk is durable: index its versions (the highest stamp wins, M5) and acknowledge.
    fn refill_chunk_durable(&mut self) {
        let w = self.refill.writing.take().unwrap();
        let b = &mut self.backup;
        for (e, loc) in &w.placed {
            let (Some(key), st) = (e.key(), e.stamp()) else {
                continue;
            };
            // A copy, then `insert`: the same on a plain map and on a byte-counting one.
            match b.index.get(key).copied() {
                Some(cur) if cur.0 >= st => {}
                cur => {
                    if let Some((_, old)) = cur {
                        b.space.drop_ref(old);
                    }
                    b.space.add_ref(*loc);
                    b.index.insert(key.to_vec(), (st, *loc));
                }
            }
        }
        self.refill.receiving = Some((w.last_index, w.next_offset));
        let installed = w.done && w.last_index > self.commit;
        if installed {
            self.install_refill(w.last_index, w.last_term, w.config);
        }
        let body = PeerBody::RefillAck {
            last_index: w.last_index,
            next_offset: w.next_offset,
            installed: w.done,
        };
        self.send(w.from, body);
    }

    /// Every value of refill `index` is durable here: the log restarts at `index` (what it
    /// held is older, so nothing of it is needed: its values are superseded or on SSD).
    fn install_refill(&mut self, index: u64, term: u64, cfg: Config) {
        let old_last = self.log.last_index();
        let mut log = Log {
            base_index: index,
            base_term: term,
            slots: VecDeque::new(),
        };
        std::mem::swap(&mut self.log, &mut log);
        self.drop_window_refs(log.slots);
        self.unpersisted.clear();
        self.persisted = index;
        self.out.push(Output::PmemFree {
            region: Region::Buffer,
            through_index: index.max(old_last),
        });
        self.backup.written_back_through = self.backup.written_back_through.max(index);
        self.commit = self.commit.max(index);
        self.applied = self.applied.max(index);
        self.leader_match = self.leader_match.max(index);
        self.reconf.history = vec![(index, cfg.clone())];
        self.cfg = cfg;
        self.refill.receiving = None;
        self.counters.refills_installed += 1;
    }

    fn drop_window_refs(&mut self, slots: VecDeque<Slot>) {
        for s in slots {
            if let Slot::Flushed { loc: Some(l), .. } = s {
                self.backup.space.drop_ref(l);
                self.backup.slot_refs -= 1;
            }
        }
    }

    /// Restart of a backup whose NVMM buffer starts past its SSD log + 1: only a finished
    /// refill leaves such a gap (entries reach the buffer only after their predecessor, and
    /// leave it only once written back), so the log restarts just before the buffer.
    pub(super) fn refill_restored(&mut self, log: &mut Log, index: u64, term: u64) {
        let old = std::mem::replace(
            log,
            Log {
                base_index: index,
                base_term: term,
                slots: VecDeque::new(),
            },
        );
        self.drop_window_refs(old.slots);
        self.backup.written_back_through = index;
        self.commit = index;
        self.applied = index;
    }
}
