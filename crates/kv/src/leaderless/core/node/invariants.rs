//! The node's invariants, checked after every input in debug builds and after every step of the
//! simulation; the deep (store-walking) check only in simulations and model tests.

use super::*;

impl NodeCore {
    /// After every input in debug builds: the epoch never decreases, and the invariants hold.
    #[cfg(debug_assertions)]
    pub(super) fn check_after_input(&self, epoch_before: u64) {
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
    /// every step of the simulation. Long on purpose: a flat list of independent checks, each
    /// naming its rule (splitting it would only scatter the list).
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
}
