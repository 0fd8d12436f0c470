//! Shard membership as a deterministic state machine (no sockets, no clock): which shards are
//! up, recovering or down in the cluster map, and when a returning shard may lead again.
//!
//! Inputs (each with the driver's monotonic clock, µs): a shard's control link opened (it
//! registered) or closed, an answer heard on a link, a shard's report that it caught up
//! ([`Msg::Recovered`]), and a tick at the ping interval. Outputs: a new cluster map (the driver
//! has the metadata core save it, then pushes it to every shard) and pings to send.
//!
//! The rules (SpecREDS §4.4 needs that no stale copy ever leads):
//! * A shard is marked **down** (and no longer in sync: writes go on without it) when its control
//!   link ends — a killed shard's kernel closes it, so every write to one of its slots stops
//!   waiting at once — or after `down_after_us` without an answer on its link.
//! * A shard that registers again, or answers again on the same link after it was marked down
//!   (it was stalled, not dead), is marked **recovering**: it may have missed writes while down
//!   and re-replicates before it leads.
//! * A recovering shard becomes **up** (and in sync) when it reports, at the map's current epoch,
//!   that it caught up — if it was in sync already, or once every shard that may hold writes it
//!   missed is up: every in-sync shard, and every shard marked down *after* it (writes went on
//!   on that one while this one was down; its own in-sync flag was cleared when it went down
//!   too). Then each of its slots had a primary holding every acknowledged write to catch up
//!   from. (It repeats its report; once the others are up, the new epoch restarts its recovery
//!   and the next report counts.) The order of going down is a strict order, so shards waiting
//!   on each other always make progress; a fresh disk holds nothing and waits for the others.
//!   The order is kept in memory: after a restart of the service only the in-sync flags count.
//! * After a restart of the metadata service nobody is known alive: every shard is marked down,
//!   keeping its in-sync flag, so a stale shard cannot win a whole-cluster restart
//!   ([`mark_all_down_after_restart`]).
//!
//! Silence is measured only while the service listens (issue 22 §2, as the kv configuration
//! manager does): a metadata service that did not run (stopped by `SIGSTOP`, descheduled on a
//! loaded machine) heard nothing during that gap, and the answers the shards sent meanwhile still
//! wait in its sockets. Counting the gap as the shards' silence marked every shard down at once
//! on waking. So the failure detector runs on a *listening clock* that advances with the inputs
//! but by at most [`Membership::max_counted_gap_us`] per input.
//!
//! **Leases** (issue 24 §3): a shard started with `--store` keeps a liveness lease in the control
//! store (`live/shard/<id>`, an etcd key under a lease it renews) and says so when it registers
//! (`leased`). The driver reads the store's live registrations and feeds them in
//! ([`MemberInput::Leases`]); for a leased shard, the lease is a second failure detector *in
//! addition to* its link, not instead of it: a shard is alive only while both say so. Why both:
//! the link is the fastest detector of a killed process (its kernel resets the link at once,
//! where a lease needs its whole TTL), and the pings catch a shard that stalled while its lease
//! still runs; the lease catches what the link cannot tell, a shard cut off from the control
//! store, which fences itself (stops acting as primary, see `core::shard`) before its lease can
//! expire here: marking it down when the lease goes moves its slots to shards that can take
//! writes, instead of leaving them with a primary that refuses them. And the lease is the same
//! for every metadata leader, where a link is one leader's. A shard seen under a *new* lease
//! lost the old one (and may have fenced itself meanwhile): it is marked down, then recovers as a
//! restarted one does, so it never leads on writes it refused. A shard registered without a lease
//! keeps the link-only rules.
//!
//! Every change bumps the map's epoch. [`Membership::check_invariants`] runs after every input in
//! debug builds: epochs only grow and every change of the map bumps it; a shard without a control
//! link is down (so one marked down stays down until it reconnects); an up shard is in sync (a
//! shard that is not in sync never leads); a down shard comes back only through recovering.

use std::collections::BTreeMap;

use crate::types::*;

/// The driver's number for one control link (a registration), so that the end of a link that a
/// newer registration already replaced changes nothing.
pub type LinkId = u64;

#[derive(Debug, Clone)]
pub struct MembershipConfig {
    /// How often the driver ticks (and so pings every shard), µs.
    pub ping_interval_us: u64,
    /// A shard silent this long on its link (listening time) is marked down, µs.
    pub down_after_us: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemberInput {
    /// A shard registered over a new control link.
    LinkOpened {
        shard: ShardId,
        link: LinkId,
        addr: String,
        boot_id: u64,
        fresh: bool,
        /// The shard keeps a liveness lease in the control store: it is alive only while the
        /// store lists it ([`MemberInput::Leases`]).
        leased: bool,
    },
    /// The shards' live registrations in the control store, read now: shard → lease id. A
    /// leased shard missing here, or listed under another lease than before, is marked down.
    Leases { live: BTreeMap<ShardId, i64> },
    /// A control link ended (the shard died, or dropped the link); `why` is for the log.
    LinkClosed {
        shard: ShardId,
        link: LinkId,
        why: String,
    },
    /// An answer (to a ping or anything else) arrived from the shard.
    Heard { shard: ShardId },
    /// The shard reports it caught up at `epoch`.
    Recovered { shard: ShardId, epoch: Epoch },
    /// The ping interval passed: check silences, ping every linked shard.
    Tick,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemberOutput {
    /// The map changed: make it durable, then push it to the shards. `why` is for the log.
    SetMap { map: ClusterMap, why: String },
    /// Send a ping over the shard's link.
    Ping { shard: ShardId },
}

#[derive(Debug, Clone)]
struct Link {
    id: LinkId,
    boot_id: u64,
    /// Listening time of the last answer (or of the registration).
    last_heard_us: u64,
    /// The shard keeps a lease in the control store.
    leased: bool,
}

pub struct Membership {
    cfg: MembershipConfig,
    map: ClusterMap,
    links: BTreeMap<ShardId, Link>,
    /// The listening clock (see the module doc), µs.
    listened_us: u64,
    last_input_us: u64,
    out: Vec<MemberOutput>,
    /// The map as of the last invariant check.
    checked: ClusterMap,
    /// When each shard was last marked down (a sequence number), for the rule of who may lead:
    /// a shard marked down later may hold writes an earlier one missed. Absent: not known to
    /// hold anything the others lack (never marked down here, or a fresh disk).
    down_order: BTreeMap<ShardId, u64>,
    next_down: u64,
    /// The live registrations last read from the control store (None: not read yet, so no
    /// leased shard is known alive).
    leases: Option<BTreeMap<ShardId, i64>>,
    /// The lease each shard was last seen alive under: a different one later means the shard
    /// lost this one in between.
    seen_lease: BTreeMap<ShardId, i64>,
}

/// After a restart of the metadata service nobody is known alive: none leads until it registers
/// again. Marks every shard down, keeping its in-sync flag (a stale shard must not win a
/// whole-cluster restart). Returns whether the map changed (its epoch is then bumped).
pub fn mark_all_down_after_restart(map: &mut ClusterMap) -> bool {
    let mut changed = false;
    for sh in map
        .shards
        .iter_mut()
        .filter(|sh| sh.state != ShardState::Down)
    {
        sh.state = ShardState::Down;
        changed = true;
    }
    if changed {
        map.epoch += 1;
    }
    changed
}

impl Membership {
    /// A core over `map`, with no shard linked yet: every shard in `map` must be down (see
    /// [`mark_all_down_after_restart`]) until it registers.
    pub fn new(cfg: MembershipConfig, map: ClusterMap, now_us: u64) -> Self {
        let m = Membership {
            cfg,
            checked: map.clone(),
            map,
            links: BTreeMap::new(),
            listened_us: 0,
            last_input_us: now_us,
            out: vec![],
            down_order: BTreeMap::new(),
            next_down: 1,
            leases: None,
            seen_lease: BTreeMap::new(),
        };
        #[cfg(debug_assertions)]
        m.check_invariants();
        m
    }

    /// A core over a cluster already running (a simulation's start): each of `links` — (shard,
    /// link, boot id) — is registered and counts as heard now.
    pub fn linked(
        cfg: MembershipConfig,
        map: ClusterMap,
        now_us: u64,
        links: &[(ShardId, LinkId, u64)],
    ) -> Self {
        let mut m = Membership {
            cfg,
            checked: map.clone(),
            map,
            links: BTreeMap::new(),
            listened_us: 0,
            last_input_us: now_us,
            out: vec![],
            down_order: BTreeMap::new(),
            next_down: 1,
            leases: None,
            seen_lease: BTreeMap::new(),
        };
        for &(shard, id, boot_id) in links {
            m.links.insert(
                shard,
                Link {
                    id,
                    boot_id,
                    last_heard_us: 0,
                    leased: false,
                },
            );
        }
        #[cfg(debug_assertions)]
        m.check_invariants();
        m
    }

    /// The map as this core decided it (the driver's store may still be saving it).
    pub fn map(&self) -> &ClusterMap {
        &self.map
    }

    /// The listening clock: how long the service has been running and able to hear shards, µs.
    pub fn listened_us(&self) -> u64 {
        self.listened_us
    }

    /// The most one input adds to the listening clock: twice the ping interval (a tick a little
    /// late counts in full), or an eighth of `down_after_us` if more (a loaded machine's
    /// scheduling delays count too, while one stall never costs a shard more than an eighth of
    /// its timeout).
    pub fn max_counted_gap_us(&self) -> u64 {
        (2 * self.cfg.ping_interval_us).max(self.cfg.down_after_us / 8)
    }

    pub fn take_outputs(&mut self) -> Vec<MemberOutput> {
        std::mem::take(&mut self.out)
    }

    pub fn handle(&mut self, now_us: u64, input: MemberInput) {
        let gap = now_us.saturating_sub(self.last_input_us);
        self.last_input_us = self.last_input_us.max(now_us);
        self.listened_us += gap.min(self.max_counted_gap_us());
        match input {
            MemberInput::LinkOpened {
                shard,
                link,
                addr,
                boot_id,
                fresh,
                leased,
            } => self.on_link_opened(shard, link, addr, boot_id, fresh, leased),
            MemberInput::Leases { live } => self.on_leases(live),
            MemberInput::LinkClosed { shard, link, why } => {
                if self.links.get(&shard).is_some_and(|l| l.id == link) {
                    self.links.remove(&shard);
                    self.mark_down(shard, &format!("its control link ended ({why})"));
                }
            }
            MemberInput::Heard { shard } => {
                if let Some(l) = self.links.get_mut(&shard) {
                    l.last_heard_us = self.listened_us;
                }
            }
            MemberInput::Recovered { shard, epoch } => self.on_recovered(shard, epoch),
            MemberInput::Tick => self.on_tick(),
        }
        #[cfg(debug_assertions)]
        self.check_invariants();
        if self.checked != self.map {
            self.checked = self.map.clone();
        }
    }

    fn changed(&mut self, why: String) {
        self.map.epoch += 1;
        self.out.push(MemberOutput::SetMap {
            map: self.map.clone(),
            why,
        });
    }

    fn on_link_opened(
        &mut self,
        id: ShardId,
        link: LinkId,
        addr: String,
        boot_id: u64,
        fresh: bool,
        leased: bool,
    ) {
        let restarted = self.links.get(&id).is_none_or(|l| l.boot_id != boot_id);
        self.links.insert(
            id,
            Link {
                id: link,
                boot_id,
                last_heard_us: self.listened_us,
                leased,
            },
        );
        // A leased shard whose lease the store does not list (yet) stays down: the tick brings
        // it to recovering once the lease shows.
        let lease_ok = self.lease_ok(id);
        let changed = match self.map.shards.iter().position(|s| s.id == id) {
            None => {
                self.map.shards.push(ShardInfo {
                    id,
                    addr,
                    state: if lease_ok { ShardState::Recovering } else { ShardState::Down },
                    in_sync: false,
                });
                self.map.shards.sort_by_key(|s| s.id);
                true
            }
            Some(i) => {
                let s = &mut self.map.shards[i];
                let mut changed = s.addr != addr;
                s.addr = addr;
                if fresh {
                    // A new disk under an old id holds nothing it used to: it re-replicates
                    // (a fresh disk comes with a new process, so it is recovering below anyway),
                    // and it holds no write another shard missed.
                    self.down_order.remove(&id);
                    if s.in_sync {
                        s.in_sync = false;
                        changed = true;
                    }
                }
                // A restarted shard may have missed writes and lost unsynced ones: it
                // re-replicates before it may lead again.
                if !lease_ok {
                    // Not alive by its lease: it stays (or goes) down. Going down from up or
                    // recovering happens through `mark_down` below, which keeps the order.
                } else if restarted
                    || s.state == ShardState::Down
                    || (s.state == ShardState::Up && !s.in_sync)
                {
                    changed |= s.state != ShardState::Recovering;
                    s.state = ShardState::Recovering;
                }
                changed
            }
        };
        if changed {
            let now = if lease_ok { "recovering" } else { "down until its lease in the control store shows" };
            self.changed(format!("shard {id} registered, {now}"));
        }
        if !lease_ok {
            self.mark_down(id, "it registered, but its lease is not in the control store");
        }
    }

    /// Whether `id` is alive as far as its lease goes: not leased, or listed in the store under
    /// the lease it was last seen alive under.
    fn lease_ok(&self, id: ShardId) -> bool {
        let leased = self.links.get(&id).is_some_and(|l| l.leased);
        !leased || self.leases.as_ref().and_then(|m| m.get(&id)).is_some_and(|l| self.seen_lease.get(&id).is_none_or(|s| s == l))
    }

    fn on_leases(&mut self, live: BTreeMap<ShardId, i64>) {
        let leased: Vec<ShardId> = self.links.iter().filter(|(_, l)| l.leased).map(|(id, _)| *id).collect();
        for id in leased {
            match (live.get(&id), self.seen_lease.get(&id)) {
                (None, _) => self.mark_down(id, "its lease in the control store expired"),
                (Some(now), Some(before)) if now != before => {
                    // Whatever state it is in: it lost a lease in between, so it may have
                    // fenced itself and refused writes its replicas took.
                    self.mark_down(id, "it holds a new lease in the control store: it lost the old one");
                }
                _ => {}
            }
        }
        for (id, l) in &live {
            self.seen_lease.insert(*id, *l);
        }
        self.seen_lease.retain(|id, _| live.contains_key(id));
        self.leases = Some(live);
    }

    fn mark_down(&mut self, id: ShardId, why: &str) {
        if let Some(s) = self
            .map
            .shards
            .iter_mut()
            .find(|s| s.id == id && s.state != ShardState::Down)
        {
            s.state = ShardState::Down;
            s.in_sync = false;
            self.down_order.insert(id, self.next_down);
            self.next_down += 1;
            self.changed(format!("shard {id} down: {why}"));
        }
    }

    fn on_recovered(&mut self, shard: ShardId, epoch: Epoch) {
        if self.map.epoch != epoch {
            return;
        }
        let mine = self.down_order.get(&shard).copied().unwrap_or(0);
        let may_hold_missed_writes =
            |s: &ShardInfo| s.in_sync || self.down_order.get(&s.id).is_some_and(|&d| d > mine);
        let others_up = self
            .map
            .shards
            .iter()
            .filter(|s| s.id != shard && may_hold_missed_writes(s))
            .all(|s| s.state == ShardState::Up);
        if let Some(s) = self.map.shards.iter_mut().find(|s| {
            s.id == shard && s.state == ShardState::Recovering && (s.in_sync || others_up)
        }) {
            s.state = ShardState::Up;
            s.in_sync = true;
            self.down_order.remove(&shard);
            self.changed(format!("shard {shard} recovered, up"));
        }
    }

    fn on_tick(&mut self) {
        let mut why = vec![];
        for s in self.map.shards.iter_mut() {
            let leased = self.links.get(&s.id).is_some_and(|l| l.leased);
            let lease_ok = !leased
                || self.leases.as_ref().and_then(|m| m.get(&s.id)).is_some_and(|l| self.seen_lease.get(&s.id) == Some(l));
            let alive = lease_ok
                && self
                    .links
                    .get(&s.id)
                    .is_some_and(|l| self.listened_us - l.last_heard_us < self.cfg.down_after_us);
            if !alive && s.state != ShardState::Down {
                let what = if lease_ok { "missed its pings" } else { "has no live lease in the control store" };
                why.push(format!("shard {} {what}: down", s.id));
                s.state = ShardState::Down;
                s.in_sync = false;
                self.down_order.insert(s.id, self.next_down);
                self.next_down += 1;
            } else if alive && s.state == ShardState::Down {
                // It answers again on the same link: it was stalled, not dead. It may have
                // missed writes while down, so it re-replicates before it leads again.
                why.push(format!(
                    "shard {} answers its pings again: recovering",
                    s.id
                ));
                s.state = ShardState::Recovering;
            }
        }
        if !why.is_empty() {
            self.changed(why.join("; "));
        }
        for &shard in self.links.keys() {
            self.out.push(MemberOutput::Ping { shard });
        }
    }

    /// [`Self::check_invariants`]: this core has no check too costly for every input (the one
    /// API of the volume's cores, see [`crate::core`]).
    pub fn check_invariants_deep(&self) {
        self.check_invariants();
    }

    /// Panics if an invariant of the module doc does not hold. Run after every input in debug
    /// builds.
    pub fn check_invariants(&self) {
        let (old, new) = (&self.checked, &self.map);
        assert!(
            new.epoch >= old.epoch,
            "the map's epoch went back from {} to {}",
            old.epoch,
            new.epoch
        );
        assert!(
            new.epoch > old.epoch || new.shards == old.shards,
            "the map changed without a new epoch: {old:?} -> {new:?}"
        );
        assert!(
            new.shards.windows(2).all(|w| w[0].id < w[1].id),
            "shards not sorted by id, or twice: {new:?}"
        );
        for s in &new.shards {
            assert!(
                self.links.contains_key(&s.id) || s.state == ShardState::Down,
                "shard {} has no control link, yet is {:?}",
                s.id,
                s.state
            );
            assert!(
                s.state != ShardState::Up || s.in_sync,
                "shard {} is up (may lead) but not in sync: {new:?}",
                s.id
            );
            if old.state(s.id) == ShardState::Down && old.shards.iter().any(|o| o.id == s.id) {
                assert!(
                    s.state != ShardState::Up,
                    "shard {} went from down to up without recovering",
                    s.id
                );
            }
        }
        assert!(
            self.links
                .keys()
                .all(|id| new.shards.iter().any(|s| s.id == *id)),
            "a linked shard is not in the map"
        );
        for s in &new.shards {
            let leased = self.links.get(&s.id).is_some_and(|l| l.leased);
            if leased && s.state != ShardState::Down {
                let live = self.leases.as_ref().and_then(|m| m.get(&s.id));
                assert!(
                    live.is_some() && live == self.seen_lease.get(&s.id),
                    "leased shard {} is {:?} without its lease live in the store",
                    s.id,
                    s.state
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PING: u64 = 100_000;
    const DOWN_AFTER: u64 = 3_000_000;

    fn cfg() -> MembershipConfig {
        MembershipConfig {
            ping_interval_us: PING,
            down_after_us: DOWN_AFTER,
        }
    }

    fn up(id: ShardId) -> ShardInfo {
        ShardInfo {
            id,
            addr: format!("s{id}"),
            state: ShardState::Up,
            in_sync: true,
        }
    }

    /// Three shards up, each on link `id` with boot id `id`, at time 0.
    fn cluster() -> Membership {
        let map = ClusterMap {
            epoch: 7,
            replicas: 3,
            shards: (0..3).map(up).collect(),
        };
        Membership::linked(cfg(), map, 0, &[(0, 0, 0), (1, 1, 1), (2, 2, 2)])
    }

    fn maps(m: &mut Membership) -> Vec<ClusterMap> {
        m.take_outputs()
            .into_iter()
            .filter_map(|o| {
                if let MemberOutput::SetMap { map, .. } = o {
                    Some(map)
                } else {
                    None
                }
            })
            .collect()
    }

    /// Ticks at the ping interval from `from` up to `to`; `answer` says which shards answer.
    fn run(m: &mut Membership, from: u64, to: u64, answer: &[ShardId]) {
        let mut t = from;
        while t <= to {
            m.handle(t, MemberInput::Tick);
            for &s in answer {
                m.handle(t + 1, MemberInput::Heard { shard: s });
            }
            t += PING;
        }
    }

    #[test]
    fn a_killed_shard_is_down_at_once_and_a_silent_one_within_the_timeout() {
        let mut m = cluster();
        m.handle(
            50,
            MemberInput::LinkClosed {
                shard: 1,
                link: 1,
                why: "reset".into(),
            },
        );
        let ms = maps(&mut m);
        assert_eq!(ms.len(), 1);
        assert_eq!(
            (ms[0].epoch, ms[0].state(1), ms[0].shards[1].in_sync),
            (8, ShardState::Down, false)
        );

        // Shard 2 stops answering (stalled, link open): down after DOWN_AFTER, not before.
        run(&mut m, PING, DOWN_AFTER - PING, &[0]);
        assert_eq!(
            m.map().state(2),
            ShardState::Up,
            "marked down before its timeout"
        );
        run(&mut m, DOWN_AFTER, DOWN_AFTER + 2 * PING, &[0]);
        assert_eq!(
            m.map().state(2),
            ShardState::Down,
            "not marked down within its timeout"
        );
        assert_eq!(m.map().state(0), ShardState::Up);
    }

    #[test]
    fn the_end_of_a_replaced_link_changes_nothing() {
        let mut m = cluster();
        m.handle(
            10,
            MemberInput::LinkOpened {
                shard: 1,
                link: 9,
                addr: "s1".into(),
                boot_id: 1,
                fresh: false,
                leased: false,
            },
        );
        assert!(
            maps(&mut m).is_empty(),
            "a new link of the same process changes nothing"
        );
        m.handle(
            20,
            MemberInput::LinkClosed {
                shard: 1,
                link: 1,
                why: "old".into(),
            },
        );
        assert!(maps(&mut m).is_empty());
        assert_eq!(m.map().state(1), ShardState::Up);
    }

    #[test]
    fn a_returning_shard_recovers_and_is_up_only_once_in_sync() {
        let mut m = cluster();
        m.handle(
            10,
            MemberInput::LinkClosed {
                shard: 1,
                link: 1,
                why: "killed".into(),
            },
        );
        m.handle(
            20,
            MemberInput::LinkOpened {
                shard: 1,
                link: 5,
                addr: "s1".into(),
                boot_id: 77,
                fresh: false,
                leased: false,
            },
        );
        let ms = maps(&mut m);
        assert_eq!(ms.last().unwrap().state(1), ShardState::Recovering);
        let epoch = m.map().epoch;
        // A report at an old epoch does not count; nor do pings answered.
        m.handle(
            30,
            MemberInput::Recovered {
                shard: 1,
                epoch: epoch - 1,
            },
        );
        run(&mut m, 40, 40 + 5 * PING, &[0, 1, 2]);
        assert_eq!(m.map().state(1), ShardState::Recovering);
        m.handle(1_000_000, MemberInput::Recovered { shard: 1, epoch });
        assert_eq!(
            (m.map().state(1), m.map().shards[1].in_sync, m.map().epoch),
            (ShardState::Up, true, epoch + 1)
        );
    }

    #[test]
    fn a_stalled_shard_that_answers_again_recovers_before_it_leads() {
        let mut m = cluster();
        run(&mut m, PING, DOWN_AFTER + 2 * PING, &[0, 1]);
        assert_eq!(m.map().state(2), ShardState::Down);
        run(
            &mut m,
            DOWN_AFTER + 3 * PING,
            DOWN_AFTER + 5 * PING,
            &[0, 1, 2],
        );
        assert_eq!(
            (m.map().state(2), m.map().shards[2].in_sync),
            (ShardState::Recovering, false)
        );
    }

    #[test]
    fn a_shard_that_missed_writes_may_lead_only_once_every_in_sync_shard_is_up() {
        let mut m = cluster();
        // Shard 1 dies (not in sync any more), then the service restarts: everyone down, 0 and
        // 2 still in sync.
        m.handle(
            10,
            MemberInput::LinkClosed {
                shard: 1,
                link: 1,
                why: "killed".into(),
            },
        );
        let mut map = m.map().clone();
        assert!(mark_all_down_after_restart(&mut map));
        assert!(map.shards.iter().all(|s| s.state == ShardState::Down));
        assert_eq!(
            map.shards.iter().map(|s| s.in_sync).collect::<Vec<_>>(),
            [true, false, true]
        );
        let mut m = Membership::new(cfg(), map, 0);
        for (s, link) in [(1, 11), (0, 10)] {
            m.handle(
                100,
                MemberInput::LinkOpened {
                    shard: s,
                    link,
                    addr: format!("s{s}"),
                    boot_id: link,
                    fresh: false,
                    leased: false,
                },
            );
        }
        // The stale shard reports first: shard 2 (in sync) is not up, so it may not lead.
        let e = m.map().epoch;
        m.handle(200, MemberInput::Recovered { shard: 1, epoch: e });
        assert_eq!(
            m.map().state(1),
            ShardState::Recovering,
            "a stale shard led while an in-sync one was away"
        );
        // The in-sync shard 0 may lead at once; then shard 2 returns and recovers.
        m.handle(300, MemberInput::Recovered { shard: 0, epoch: e });
        assert_eq!(m.map().state(0), ShardState::Up);
        m.handle(
            400,
            MemberInput::LinkOpened {
                shard: 2,
                link: 12,
                addr: "s2".into(),
                boot_id: 12,
                fresh: false,
                leased: false,
            },
        );
        let e = m.map().epoch;
        m.handle(500, MemberInput::Recovered { shard: 1, epoch: e });
        assert_eq!(
            m.map().state(1),
            ShardState::Recovering,
            "shard 2 is in sync and only recovering"
        );
        m.handle(600, MemberInput::Recovered { shard: 2, epoch: e });
        let e = m.map().epoch;
        m.handle(700, MemberInput::Recovered { shard: 1, epoch: e });
        assert_eq!(
            (m.map().state(1), m.map().shards[1].in_sync),
            (ShardState::Up, true)
        );
    }

    #[test]
    fn a_fresh_disk_under_an_old_id_is_not_in_sync() {
        let mut m = cluster();
        m.handle(
            10,
            MemberInput::LinkOpened {
                shard: 2,
                link: 3,
                addr: "s2".into(),
                boot_id: 99,
                fresh: true,
                leased: false,
            },
        );
        assert_eq!(
            (m.map().state(2), m.map().shards[2].in_sync),
            (ShardState::Recovering, false)
        );
    }

    /// Found by the simulation once it ran this core (seed 106): shard 0 stalls and is marked
    /// down (writes go on on shards 1 and 2), then the links of 1 and 2 break and they are
    /// marked down too — not in sync either. Shard 0 answers again and reports it caught up:
    /// with no in-sync shard left, "every in-sync shard is up" held vacuously and the stale
    /// shard led, losing the writes that only 1 and 2 hold.
    #[test]
    fn a_stale_shard_does_not_lead_while_shards_that_went_down_after_it_are_away() {
        let mut m = cluster();
        run(&mut m, PING, DOWN_AFTER + 2 * PING, &[1, 2]);
        assert_eq!(m.map().state(0), ShardState::Down);
        let t = DOWN_AFTER + 3 * PING;
        m.handle(
            t,
            MemberInput::LinkClosed {
                shard: 1,
                link: 1,
                why: "broke".into(),
            },
        );
        m.handle(
            t,
            MemberInput::LinkClosed {
                shard: 2,
                link: 2,
                why: "broke".into(),
            },
        );
        run(&mut m, t + PING, t + 3 * PING, &[0]);
        assert_eq!(m.map().state(0), ShardState::Recovering);
        let e = m.map().epoch;
        m.handle(t + 4 * PING, MemberInput::Recovered { shard: 0, epoch: e });
        assert_eq!(
            m.map().state(0),
            ShardState::Recovering,
            "a stale shard leads while the shards holding its missed writes are away: {:?}",
            m.map()
        );
        // 1 and 2 return; 2 went down last and may lead first, then 1, then 0.
        for s in [1, 2] {
            m.handle(
                t + 5 * PING,
                MemberInput::LinkOpened {
                    shard: s,
                    link: 10 + s as u64,
                    addr: format!("s{s}"),
                    boot_id: s as u64,
                    fresh: false,
                    leased: false,
                },
            );
        }
        let e = m.map().epoch;
        m.handle(t + 6 * PING, MemberInput::Recovered { shard: 1, epoch: e });
        m.handle(t + 6 * PING, MemberInput::Recovered { shard: 0, epoch: e });
        assert_eq!(
            (m.map().state(0), m.map().state(1)),
            (ShardState::Recovering, ShardState::Recovering)
        );
        m.handle(t + 6 * PING, MemberInput::Recovered { shard: 2, epoch: e });
        assert_eq!(m.map().state(2), ShardState::Up);
        let e = m.map().epoch;
        m.handle(t + 7 * PING, MemberInput::Recovered { shard: 0, epoch: e });
        assert_eq!(
            m.map().state(0),
            ShardState::Recovering,
            "shard 1 went down after shard 0 and is not up yet"
        );
        m.handle(t + 7 * PING, MemberInput::Recovered { shard: 1, epoch: e });
        let e = m.map().epoch;
        m.handle(t + 8 * PING, MemberInput::Recovered { shard: 0, epoch: e });
        assert!(
            m.map()
                .shards
                .iter()
                .all(|s| s.state == ShardState::Up && s.in_sync),
            "{:?}",
            m.map()
        );
    }

    /// Issue 22 §2 in the volume service: a metadata service stopped past `down_after` (SIGSTOP,
    /// a loaded machine) took its own silence for the shards' and marked every shard down at
    /// once on waking, before reading the answers waiting in its sockets.
    #[test]
    fn a_paused_metadata_service_does_not_take_its_own_silence_for_the_shards() {
        for pause_us in [2 * DOWN_AFTER, 10 * DOWN_AFTER, 3_600_000_000] {
            let mut m = cluster();
            run(&mut m, PING, 2_000_000, &[0, 1, 2]);
            // The pause: no turn at all. On waking the tick comes before the waiting answers.
            let woke = 2_000_000 + pause_us;
            m.handle(woke, MemberInput::Tick);
            assert_eq!(
                m.map()
                    .shards
                    .iter()
                    .filter(|s| s.state != ShardState::Up)
                    .count(),
                0,
                "paused {pause_us} us: {:?}",
                m.map()
            );
            run(&mut m, woke + 1, woke + 5 * PING, &[0, 1, 2]);
            assert_eq!(m.map().epoch, 7, "paused {pause_us} us: {:?}", m.map());
            // A shard that really stays silent is still marked down, within its timeout of
            // listening.
            run(
                &mut m,
                woke + 6 * PING,
                woke + DOWN_AFTER + 8 * PING,
                &[0, 1],
            );
            assert_eq!(m.map().state(2), ShardState::Down, "paused {pause_us} us");
        }
    }

    fn leases(ids: &[(ShardId, i64)]) -> MemberInput {
        MemberInput::Leases { live: ids.iter().copied().collect() }
    }

    /// Three leased shards registered, their leases listed, each recovered: all up.
    fn leased_cluster() -> Membership {
        let map = ClusterMap { epoch: 1, replicas: 3, shards: vec![] };
        let mut m = Membership::new(cfg(), map, 0);
        for s in 0..3 {
            m.handle(10 + s as u64, MemberInput::LinkOpened { shard: s, link: s as u64, addr: format!("s{s}"), boot_id: 1, fresh: true, leased: true });
            assert_eq!(m.map().state(s), ShardState::Down, "a leased shard with no lease listed is not alive");
        }
        m.handle(100, leases(&[(0, 100), (1, 101), (2, 102)]));
        run(&mut m, PING, PING, &[0, 1, 2]);
        for s in 0..3 {
            assert_eq!(m.map().state(s), ShardState::Recovering, "{:?}", m.map());
        }
        for s in 0..3 {
            let epoch = m.map().epoch;
            m.handle(2 * PING + s as u64, MemberInput::Recovered { shard: s, epoch });
        }
        assert!(m.map().shards.iter().all(|s| s.state == ShardState::Up), "{:?}", m.map());
        m.take_outputs();
        m
    }

    /// A leased shard is down once its lease is gone from the store, though its link answers;
    /// it comes back (recovering) under a new lease; a lease renewed all along changes nothing.
    #[test]
    fn a_leased_shard_is_down_when_its_lease_expires_and_recovers_under_a_new_one() {
        let mut m = leased_cluster();
        let epoch = m.map().epoch;
        m.handle(3 * PING, leases(&[(0, 100), (1, 101), (2, 102)]));
        run(&mut m, 3 * PING, 5 * PING, &[0, 1, 2]);
        assert_eq!(m.map().epoch, epoch, "nothing changed: {:?}", m.map());

        // Shard 1 is cut off from the store: its lease expires; its link still answers.
        m.handle(6 * PING, leases(&[(0, 100), (2, 102)]));
        assert_eq!(m.map().state(1), ShardState::Down, "{:?}", m.map());
        run(&mut m, 6 * PING, 10 * PING, &[0, 1, 2]);
        assert_eq!(m.map().state(1), ShardState::Down, "its answers alone do not bring it back");
        // It registers again under a new lease: recovering at the next tick, then up.
        m.handle(11 * PING, leases(&[(0, 100), (1, 201), (2, 102)]));
        run(&mut m, 11 * PING, 11 * PING, &[0, 1, 2]);
        assert_eq!(m.map().state(1), ShardState::Recovering, "{:?}", m.map());
        let e = m.map().epoch;
        m.handle(12 * PING, MemberInput::Recovered { shard: 1, epoch: e });
        assert_eq!(m.map().state(1), ShardState::Up);

        // Shard 2's lease is replaced between two reads (the expiry went unseen): it lost the
        // old one, so it goes down and recovers all the same.
        m.take_outputs();
        m.handle(13 * PING, leases(&[(0, 100), (1, 201), (2, 302)]));
        assert_eq!(m.map().state(2), ShardState::Down, "{:?}", m.map());
        run(&mut m, 13 * PING, 13 * PING, &[0, 1, 2]);
        assert_eq!(m.map().state(2), ShardState::Recovering, "{:?}", m.map());
        assert_eq!(m.map().state(0), ShardState::Up);
    }

    /// A shard registered without a lease keeps the link-only rules whatever the store lists.
    #[test]
    fn an_unleased_shard_ignores_the_store() {
        let mut m = cluster();
        m.handle(50, leases(&[]));
        run(&mut m, PING, 5 * PING, &[0, 1, 2]);
        assert!(m.map().shards.iter().all(|s| s.state == ShardState::Up), "{:?}", m.map());
    }
}
