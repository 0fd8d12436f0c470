//! HEAL recovery, the recovering node's side (HEAL §V-B/C, Fig. 4): the Missed_updates buffer
//! kept while a peer is away, Recov_start to every active node, the Buddy, the catch-up pulled
//! one credited chunk at a time and applied, and Recov_end.

use super::*;

impl NodeCore {
    /// Records that `key` now has version `ts` with `value` in the store (called wherever the
    /// store's version of a key changes).
    pub(super) fn record_missed(&mut self, key: &[u8], ts: Ts, value: &[u8]) {
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

    pub(super) fn start_recovery(&mut self, now_us: u64) {
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
    pub(super) fn start_retry_us(&self) -> u64 {
        self.p.recovery_retry_us.min(self.p.inv_ack_timeout_us)
    }

    pub(super) fn on_recov_start_ack(&mut self, now_us: u64, from: NodeId) {
        if let Mode::Recovering(r) = &mut self.mode {
            if let Phase::Start { acked } = &mut r.phase {
                acked.insert(from);
            }
        }
        self.on_recov_start_ack_check(now_us);
    }

    pub(super) fn buddy(&self) -> Option<NodeId> {
        // Static choice: the next node after us that is active; re-chosen if it is not.
        let n = self.config.nodes.len() as u32;
        (1..n)
            .map(|i| (self.p.id + i) % n)
            .find(|c| self.config.active.contains(c))
    }

    /// Where the catch-up stream starts for this group's scheme.
    pub(super) fn first_cursor(&self) -> Cursor {
        match self.p.recovery {
            RecoveryScheme::ReactiveLog => Cursor::Log(LogCursor {
                since_epoch: self.last_epoch,
                gen: 0,
                pos: None,
            }),
            RecoveryScheme::Heal | RecoveryScheme::FullCopy => Cursor::Key(None),
        }
    }

    pub(super) fn on_recov_start_ack_check(&mut self, now_us: u64) {
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
    pub(super) fn window_chunks(&self) -> u32 {
        (self.p.max_catchup_chunks_in_flight as u32).clamp(1, MAX_CATCHUP_CHUNKS_PER_REQ)
    }

    /// Gives the Buddy as much of the window as is free: opens the stream (CatchUp_req) if it
    /// is not open, or sends CatchUp_credit. Credit goes in batches of a quarter of the window
    /// while the Buddy still holds some (fewer messages), at once when it holds none.
    pub(super) fn grant_credit(&mut self, now_us: u64) {
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

    /// A catch-up chunk from the Buddy (HEAL §V-C, Fig. 4 steps 2-3): checked against the
    /// stream, applied without resurrecting older versions, logged as one append, and the
    /// window moved on. Kept whole (about 125 lines): its numbered steps share the chunk's
    /// batch and the stream's state.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_catchup_resp(
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
        let background = table1::rules(self.p.model).background_persist;
        let Mode::Recovering(r) = &mut self.mode else {
            return;
        };
        r.stats.entries_received += received;
        r.stats.entries_applied += applied_n;
        if !background {
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
    pub(super) fn apply_catchup_entry(&mut self, now_us: u64, e: EntryRef<'_>) -> CatchUpApply {
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

    pub(super) fn maybe_finish_recovery(&mut self, now_us: u64) {
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

    pub(super) fn recovery_tick(&mut self, now_us: u64) {
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
pub(super) enum CatchUpApply {
    /// Not newer than what we hold: dropped.
    Stale,
    /// Applied; its records are in the chunk's batch.
    Batched,
    /// Applied through the general path, with an append of its own.
    Alone(u64),
}
