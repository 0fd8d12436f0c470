//! Persistence: appends to the persistent-memory log and their completions (the local
//! durability point), the GDP marks, and Scope's PERSIST of a client's scope (HEAL §V-E).

use super::*;

impl NodeCore {
    pub(super) fn persist(&mut self, key: &[u8], ts: Ts, value: &[u8]) -> u64 {
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

    /// Sets the GDP flag of the current version in the log once it is committed or durable.
    pub(super) fn mark_if_needed(&mut self, key: &[u8]) {
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

    pub(super) fn start_persist(&mut self, now_us: u64, tag: u64, scope: u64) {
        if !table1::rules(self.p.model).scoped_persist {
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

    pub(super) fn all_durable(&self, writes: &[(Vec<u8>, Ts)]) -> bool {
        writes.iter().all(|(k, ts)| {
            self.store.get(&k[..]).is_some_and(|s| s.durable >= *ts) && !self.chunk_pending(k)
        })
    }

    pub(super) fn check_persist_op(&mut self, id: u64) {
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

    pub(super) fn apply_persist_val(&mut self, writes: &[(Vec<u8>, Ts)]) {
        for (key, ts) in writes {
            if let Some(k) = self.store.get_mut(&key[..]) {
                if k.ts == *ts {
                    k.gdp = true;
                }
            }
            self.mark_if_needed(key);
        }
    }

    pub(super) fn on_persisted_many_input(
        &mut self,
        now_us: u64,
        seqs: impl IntoIterator<Item = u64>,
    ) {
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
    pub(super) fn chunk_pending(&self, key: &[u8]) -> bool {
        self.inflight_batches
            .values()
            .any(|(puts, index)| puts.index_contains(index, key))
    }

    /// Append `(key, ts)` is durable: owed ACK_Ps go, a coordinated write may advance.
    pub(super) fn put_durable(&mut self, now_us: u64, key: &[u8], ts: Ts) {
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
                let c = table1::rules(model).follower_ack == FollowerAck::Combined;
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
    pub(super) fn after_puts_durable(&mut self) {
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
    pub(super) fn recovery_seq_durable(&mut self, seq: u64) -> (bool, bool) {
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
}
