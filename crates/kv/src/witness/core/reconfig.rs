//! Membership changes of the witness KV at run time (spec M22–M24), as a part of
//! [`WitnessCore`] (a child module of `node`, so it shares the core's state).
//!
//! A change is an [`Op::Config`] log entry. Every member uses the newest configuration in its
//! log, committed or not (Raft §4.1), and falls back to the previous one when a conflicting
//! suffix is truncated. The leader proposes one [`Change`] at a time, only once its own
//! term's first entry has committed and no earlier configuration entry is uncommitted.
//!
//! **Why single steps are safe here, without joint consensus.** [`Config::apply`] admits only
//! changes that add or remove at most one voter, and that keep the commit quorum (leader +
//! every voting backup + the substitute) a majority of the voters whenever it was one (true of
//! every standard layout, N backups and N witnesses). Then for two consecutive configurations
//! C and C' (voter sets of size n and n ± 1):
//! 1. Any majority of C and any majority of C' share a voter (Raft's single-server argument:
//!    ⌊n/2⌋+1 + ⌊(n+1)/2⌋ > n), so two leaders of one term, one counting votes in C and one in
//!    C', cannot both win: election safety holds across the change.
//! 2. An entry committed under C is on C's commit quorum, itself a majority of C, so every
//!    election majority of C or C' contains a voter holding it; that voter grants only to a
//!    candidate whose log is at least as up to date (or, as a backup, makes it adopt its index
//!    and reconcile, M13/M14). Leader completeness therefore survives the change.
//! 3. The reconciliation rule (M14 ii: an entry a voting backup lacks was never committed)
//!    needs every committed entry on every voting backup. A backup becomes voting only when
//!    it holds everything the leader had committed (`matched ≥ commit`), and every entry
//!    committed after the promotion entry is appended needs it (the new configuration counts
//!    from its append on). A backup that stops voting (M22) only shrinks the set asked.
//! 4. The Ongaro rule (raft-dev, 2015): a leader changes the configuration only after an entry
//!    of its own term has committed, so a change proposed by a deposed leader of an older term
//!    cannot be combined with another leader's change into two steps that are not adjacent.
//!
//! **M22, a substitute.** A witness named `substitute` joins the commit quorum. From the
//! configuration entry on it receives and persists full entries and keeps their values once
//! applied (its value table then holds every value written since); entries committed before
//! that reach it key-only (their values are on the primary and the other backups).
//!
//! **Automatic policy** ([`WitnessCore::reconfig_policy`], on the serving leader's tick, one
//! step per committed configuration): a voting member not heard for `Params::member_lost_us`
//! is lost. A lost voting backup is substituted by a live witness; a spare (named in the
//! configuration) replaces a lost member: it joins non-voting, catches up through the log (a
//! backup gets each key's newest value from the leader's value table, superseded versions
//! key-only), then the lost member is removed and the spare promoted once `matched ≥ commit`;
//! the substitute ends once the voting backups alone keep the quorum a majority.

use super::*;
use crate::witness::core::config::Change;

/// Configurations kept by a core: the newest committed one plus any appended after it.
#[derive(Clone, Debug, Default)]
pub(super) struct Reconf {
    /// (index of the configuration entry, configuration), ascending; the first is the one in
    /// force at the log's start (index 0 for the bootstrap configuration).
    pub history: Vec<(u64, Config)>,
    /// The serving leader's last message from each member (for `member_lost_us`).
    pub heard_us: BTreeMap<NodeId, u64>,
    /// Set while this head leads and keeps a full value table; a head that then follows a
    /// newer leader drops it (M24).
    pub was_primary: bool,
    /// Why the last requested change was refused (status and tests).
    pub last_error: Option<String>,
    /// Reconciliation is replacing its range (configurations undone, then redone).
    pub replaying: bool,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReconfigError {
    #[error("not the serving leader")]
    NotLeader,
    #[error("a configuration change at index {0} is not committed yet")]
    Pending(u64),
    #[error("the leader cannot remove or demote itself")]
    Leader,
    #[error(transparent)]
    Config(#[from] ConfigError),
}

impl WitnessCore {
    /// The configuration in force here (the newest in this node's log).
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Why the last requested or automatic change was refused, if it was.
    pub fn last_reconfig_error(&self) -> Option<&str> {
        self.reconf.last_error.as_deref()
    }

    pub(super) fn reconf_init(&mut self) {
        self.reconf.history = vec![(0, self.cfg.clone())];
    }

    /// Rebuilds the history from the configuration entries found at restart.
    pub(super) fn reconf_restore(&mut self, found: Vec<(u64, Config)>) {
        for (i, c) in found {
            self.reconf.history.push((i, c.clone()));
            self.cfg = c;
        }
        self.reconf_prune();
    }

    /// A configuration entry was appended to the local log: it is in force from now on.
    pub(super) fn config_appended(&mut self, index: u64, cfg: Config) {
        self.reconf.history.push((index, cfg.clone()));
        self.cfg = cfg;
        self.reconf_prune();
        self.config_took_effect();
    }

    /// The log lost its suffix from `from` (a Raft conflict): configurations appended there
    /// are undone.
    pub(super) fn config_truncated(&mut self, from: u64) {
        let before = self.cfg.epoch;
        while self.reconf.history.len() > 1 && self.reconf.history.last().unwrap().0 >= from {
            self.reconf.history.pop();
        }
        self.cfg = self.reconf.history.last().unwrap().1.clone();
        if self.cfg.epoch != before {
            self.config_took_effect();
        }
    }

    fn reconf_prune(&mut self) {
        let c = self.commit;
        let h = &mut self.reconf.history;
        while h.len() > 1 && h[1].0 <= c {
            h.remove(0);
        }
    }

    /// Follow-ups of a configuration change on this node's own state.
    fn config_took_effect(&mut self) {
        let allowed = match self.role {
            RoleKind::Follower => true,
            RoleKind::Candidate => self.cfg.may_run(self.id),
            RoleKind::Leader | RoleKind::Provisional => self.cfg.may_stand(self.id),
        };
        if !allowed && !self.reconf.replaying {
            let t = self.term;
            self.step_down(t);
        }
        if self.role != RoleKind::Candidate {
            // A promotion (or a removal) changes when, or whether, this node runs.
            self.reset_election_timer();
        }
        if let Some(l) = self.lead.as_mut() {
            let now = self.now;
            for m in self.cfg.ids().filter(|&m| m != self.id) {
                l.next.entry(m).or_insert(1);
                l.matched.entry(m).or_insert(0);
                self.reconf.heard_us.entry(m).or_insert(now);
            }
        }
    }

    /// A backup's newest configuration entry past its commit index (for its vote refusals).
    pub(super) fn pending_config_entry(&self) -> Option<Entry> {
        if self.kind != Kind::Backup {
            return None;
        }
        let (i, c) = self.reconf.history.last()?;
        if *i <= self.commit {
            return None;
        }
        Some(Entry {
            index: *i,
            term: self.log.term_at(*i)?,
            op: Op::Config(c.clone()),
        })
    }

    /// A candidate that adopted a backup's log (M13) takes the configuration entry the
    /// backup's refusal carried: the slot is no longer unknown and the configuration is in
    /// force (reconciliation confirms or drops it with the rest of the range, M14).
    pub(super) fn adopt_config(&mut self, e: Option<Entry>) {
        let Some(e) = e else { return };
        let Op::Config(c) = &e.op else { return };
        let ok =
            e.index > self.commit && matches!(self.log.slot(e.index), Some(Slot::Unknown { .. }));
        if !ok {
            return;
        }
        let (i, c) = (e.index, c.clone());
        *self.log.slot_mut(i).unwrap() = Slot::Entry(e);
        // Later configuration entries in force here (none: the range past commit is unknown).
        self.config_appended(i, c);
    }

    /// Index of the newest configuration entry (0: the bootstrap one).
    fn config_index(&self) -> u64 {
        self.reconf.history.last().map_or(0, |h| h.0)
    }

    /// A leader proposes `change` (manual input or the automatic policy).
    pub fn propose_config(&mut self, change: &Change) -> Result<u64, ReconfigError> {
        if !self.is_serving() {
            return Err(ReconfigError::NotLeader);
        }
        let ci = self.config_index();
        if ci > self.commit {
            return Err(ReconfigError::Pending(ci));
        }
        match *change {
            Change::Remove { id } | Change::SetVoting { id, voting: false } if id == self.id => {
                return Err(ReconfigError::Leader);
            }
            _ => {}
        }
        let next = self.cfg.apply(change)?;
        let e = Entry {
            index: self.log.last_index() + 1,
            term: self.term,
            op: Op::Config(next),
        };
        let idx = e.index;
        self.append_local(e);
        let peers: Vec<NodeId> = self.cfg.ids().filter(|&m| m != self.id).collect();
        for p in peers {
            let n = self
                .lead
                .as_ref()
                .unwrap()
                .next
                .get(&p)
                .copied()
                .unwrap_or(1);
            self.send_append(p, n);
        }
        Ok(idx)
    }

    pub(super) fn on_reconfigure(&mut self, change: Change) {
        self.reconf.last_error = self.propose_config(&change).err().map(|e| e.to_string());
    }

    /// Any message from `from` (the leader's liveness view of its members).
    pub(super) fn reconf_heard(&mut self, from: NodeId) {
        if self.lead.is_some() {
            self.reconf.heard_us.insert(from, self.now);
        }
    }

    /// This head just won an election: every member starts with a fresh grace period (a
    /// follower never hears the others, so older times say nothing).
    pub(super) fn reconf_on_lead(&mut self) {
        let now = self.now;
        self.reconf.heard_us = self.cfg.ids().map(|m| (m, now)).collect();
        self.reconf.was_primary = true;
    }

    /// This head follows `leader` in `term` (M24): an old primary becomes a plain witness and
    /// drops its value table (the key table stays: it is the oracle); a substitute keeps the
    /// values it must hold.
    pub(super) fn reconf_follow(&mut self, leader: NodeId) {
        if leader != self.id && self.reconf.was_primary {
            self.reconf.was_primary = false;
            if self.kind == Kind::Head && !self.cfg.gets_values(self.id) {
                self.head.values.clear_and_free();
                // Entries not applied yet still carry the values this head wrote as leader.
                for i in self.applied + 1..=self.log.last_index() {
                    if let Some(Slot::Entry(e)) = self.log.slot_mut(i) {
                        if e.value().is_some() {
                            *e = e.key_only();
                        }
                    }
                }
                self.counters.values_dropped_as_witness += 1;
            }
        }
    }

    /// The copy of a committed entry, whose value this leader has stripped, for a member that
    /// gets values: a substitute gets it key-only (it keeps values only from its entry on); a
    /// backup catching up gets the key's newest version with the value from the value table
    /// and a superseded version key-only (no read ever needs it: every pull is stamp-checked
    /// against a newer key stamp). `None`: this leader lacks the value (it is recovering).
    pub(super) fn catch_up_copy(&self, to: NodeId, e: &Entry) -> Option<Entry> {
        let key = e.key()?;
        if self.cfg.kind(to) == Some(Kind::Head) {
            return Some(e.key_only());
        }
        let st = e.stamp();
        match self.head.values.get(key) {
            Some((vs, v)) if *vs == st => Some(Entry {
                index: e.index,
                term: e.term,
                op: Op::Put {
                    key: key.to_vec(),
                    value: Some(ByteBuf::from(v.clone())),
                },
            }),
            _ if self.head.keys.get(key).is_some_and(|ks| *ks > st) => Some(e.key_only()),
            _ => None,
        }
    }

    /// The serving leader has not heard from `id` for `member_lost_us` (never, when 0).
    pub(super) fn member_lost(&self, id: NodeId) -> bool {
        let bound = self.p.member_lost_us;
        bound != 0
            && self
                .reconf
                .heard_us
                .get(&id)
                .is_some_and(|&h| self.now >= h.saturating_add(bound))
    }

    fn caught_up(&self, id: NodeId) -> bool {
        !self.member_lost(id)
            && self
                .lead
                .as_ref()
                .is_some_and(|l| l.matched.get(&id).copied().unwrap_or(0) >= self.commit)
    }

    /// One step of the automatic policy (see the module doc); at most one proposal per call.
    pub(super) fn reconfig_policy(&mut self) {
        if self.p.member_lost_us == 0 || !self.is_serving() || self.config_index() > self.commit {
            return;
        }
        let Some(change) = self.next_change() else {
            return;
        };
        match self.propose_config(&change) {
            Ok(_) => self.counters.reconfigs += 1,
            Err(e) => self.reconf.last_error = Some(e.to_string()),
        }
    }

    fn next_change(&self) -> Option<Change> {
        let cfg = &self.cfg;
        let me = self.id;
        let ok = |c: &Change| cfg.apply(c).is_ok();
        let lost_voters: Vec<Member> = cfg
            .members
            .iter()
            .filter(|m| m.voting && m.id != me && self.member_lost(m.id))
            .copied()
            .collect();
        // 1. A lost voting backup: a live witness takes its place in the commit quorum (M22).
        if cfg.substitute.is_none() {
            for b in lost_voters.iter().filter(|m| m.kind == Kind::Backup) {
                let w = cfg
                    .members
                    .iter()
                    .filter(|m| m.voting && m.kind == Kind::Head && m.id != me)
                    .filter(|m| !self.member_lost(m.id))
                    .map(|m| m.id)
                    .min();
                if let Some(witness) = w {
                    let c = Change::Substitute {
                        backup: b.id,
                        witness,
                    };
                    if ok(&c) {
                        return Some(c);
                    }
                }
            }
        }
        // 1b. A lost substitute leaves (when the voting backups still make a majority quorum
        //     and hold the values), so writes go on; a spare may replace it later.
        if let Some(sub) = cfg.substitute.filter(|&s| self.member_lost(s)) {
            let c = Change::Remove { id: sub };
            if ok(&c) {
                return Some(c);
            }
        }
        // 2. A lost voting head with a caught-up non-voting head to take its seat: remove it
        //    first (the voters shrink by one), then 3. promotes the replacement.
        let spare_ready = |kind: Kind| {
            cfg.members
                .iter()
                .any(|m| !m.voting && m.kind == kind && self.caught_up(m.id))
        };
        for h in lost_voters.iter().filter(|m| m.kind == Kind::Head) {
            if spare_ready(Kind::Head) && cfg.substitute != Some(h.id) {
                let c = Change::Remove { id: h.id };
                if ok(&c) {
                    return Some(c);
                }
            }
        }
        // 3. Promote a caught-up non-voting member (never while a lost voter of its kind still
        //    holds a seat: that one goes first).
        for m in cfg.members.iter().filter(|m| !m.voting) {
            let waiting = lost_voters.iter().any(|l| l.kind == m.kind);
            if m.kind == Kind::Head && waiting {
                continue;
            }
            if self.caught_up(m.id) {
                let c = Change::SetVoting {
                    id: m.id,
                    voting: true,
                };
                if ok(&c) {
                    return Some(c);
                }
            }
        }
        // 4. The substitute steps back once the voting backups alone make a majority quorum.
        if cfg.substitute.is_some() && !lost_voters.iter().any(|m| m.kind == Kind::Backup) {
            let c = Change::EndSubstitute;
            if ok(&c) {
                return Some(c);
            }
        }
        // 5. A lost member without a replacement joining: add a spare of its kind.
        let lost_any: Vec<Member> = cfg
            .members
            .iter()
            .filter(|m| m.id != me && self.member_lost(m.id))
            .copied()
            .collect();
        for l in &lost_any {
            let joining = cfg
                .members
                .iter()
                .any(|m| !m.voting && m.kind == l.kind && !self.member_lost(m.id));
            // A lost backup is replaced once a witness substitutes for it (and only until its
            // replacement votes, which ends the substitution); a lost head while it votes.
            let wanted = match l.kind {
                Kind::Backup => !l.voting && cfg.substitute.is_some(),
                Kind::Head => l.voting,
            };
            if joining || !wanted {
                continue;
            }
            if let Some(s) = cfg.spares.iter().find(|s| s.kind == l.kind) {
                return Some(Change::Add {
                    id: s.id,
                    kind: s.kind,
                });
            }
        }
        // 6. A lost non-voting backup whose replacement now votes leaves the group.
        for l in lost_any
            .iter()
            .filter(|m| !m.voting && m.kind == Kind::Backup)
        {
            let replaced = cfg.substitute.is_none();
            if replaced {
                let c = Change::Remove { id: l.id };
                if ok(&c) {
                    return Some(c);
                }
            }
        }
        None
    }
}
