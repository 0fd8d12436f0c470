//! The write path (HEAL §II-B, Hermes): a client's GET / PUT / PERSIST, the coordinator's INV,
//! the followers' ACKs, and the coordinator moving a write on by the rules of Table I
//! ([`super::table1`]); a newer version applied to the volatile store.

use super::*;

impl NodeCore {
    pub(super) fn on_client_input(&mut self, now_us: u64, tag: u64, op: ClientOp) {
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

    pub(super) fn coord_blocks(&self, k: &KeyState) -> bool {
        match &k.coord {
            None => false,
            // A write waiting only for its background durability does not block the next one.
            Some(c) => !(c.replied && c.val_c_sent),
        }
    }

    pub(super) fn reply(&mut self, tag: u64, result: ClientResult) {
        self.out.push(Output::Reply { tag, result });
    }

    pub(super) fn execute(&mut self, now_us: u64, tag: u64, op: ClientOp) {
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
                if table1::rules(self.p.model).scoped_persist {
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
                    scope: if table1::rules(self.p.model).scoped_persist {
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

    pub(super) fn serve_waiting(&mut self, now_us: u64, key: &[u8]) {
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

    pub(super) fn coord_blocks_key(&self, key: &[u8]) -> bool {
        self.store.get(key).is_some_and(|k| self.coord_blocks(k))
    }

    pub(super) fn serve_all_waiting(&mut self, now_us: u64) {
        if self.pending_client_ops == 0 {
            return;
        }
        let keys: Vec<Vec<u8>> = self.waiting_keys.iter().cloned().collect();
        for key in keys {
            self.serve_waiting(now_us, &key);
        }
    }

    /// Moves a coordinated write forward according to the model (Table I).
    pub(super) fn advance(&mut self, now_us: u64, key: &[u8]) {
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
        for step in table1::rules(model).steps {
            let reached = match step.at {
                Stage::AllAckC => all_c,
                Stage::AllAckCP => all_c && all_p,
            };
            // A step that does not end the write fires once: until its reply or VAL_C is out.
            let first =
                (step.reply && !c.replied) || (step.val.is_some_and(|v| v.0) && !c.val_c_sent);
            if !reached || !(step.done || first) {
                continue;
            }
            if step.reply {
                c.replied = true;
                reply = c.client.take();
            }
            if let Some((val_c, val_p)) = step.val {
                if val_c {
                    c.val_c_sent = true;
                    validate = true;
                }
                gdp |= val_p;
                vals.push((val_c, val_p));
            }
            done |= step.done;
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
    pub(super) fn settle(&mut self, now_us: u64, key: &[u8]) {
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
    pub(super) fn ack(&mut self, to: NodeId, key: &[u8], ts: Ts) {
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
        match table1::rules(model).follower_ack {
            FollowerAck::ConsistencyOnly => out = Some(msg(false)),
            _ if durable => out = Some(msg(true)),
            ack => {
                if !k.pending_p.contains(&(to, ts)) {
                    k.pending_p.push((to, ts));
                }
                if ack != FollowerAck::Combined {
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
    pub(super) fn apply_newer(
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
}
