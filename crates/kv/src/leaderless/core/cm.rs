//! The sans-I/O configuration manager (§IV, §V-A, Fig. 2): heartbeats to every node, failure
//! detection by timeout, reconfiguration with a new epoch, the EFN period, and re-adding a
//! restarted node as a recovering ShadowReplica, then as active once it reports HEAL done.
//!
//! Leases: a node serves reads only within `lease_us` of sending the ack that the CM's last
//! heartbeat echoes ([`Heartbeat::lease_ref`]: the lease starts before the heartbeat was sent,
//! however late the node reads it). Before the CM publishes a configuration without a suspected
//! node it stops heartbeating it and waits until any lease that node could still hold has run
//! out (`lease_us + max_message_delay_us` after the last heartbeat sent to it), so a cut-off or
//! stopped node never serves a stale read.
//!
//! The configuration is durable: [`CmOutput::Persist`] comes before any heartbeat carrying it,
//! and the driver must make it durable before carrying out the outputs that follow.
//!
//! Silence is measured only while the CM listens. A CM that was not running (stopped by
//! `SIGSTOP`, descheduled on a loaded machine) heard nothing during that gap, and the acks the
//! nodes sent meanwhile still wait in its input queue: counting the gap as the nodes' silence
//! made a CM paused past the failure timeout suspect every node at once on waking (issue 22
//! §2). So failure detection runs on a *listening clock* that advances with the CM's own loop
//! (its ticks and inputs) but by at most [`CmCore::max_counted_gap_us`] per turn. And one
//! tick's evidence never removes a majority of the active nodes: when it would, the silent
//! nodes get one more failure timeout of listening first (a CM cut off from everyone sees the
//! same silence as a group that lost most of its nodes, and the first is far likelier).
//! Leases are not affected: they run in real time on the nodes, and the wait for a suspect's
//! lease stays in real time.

use std::collections::{BTreeMap, BTreeSet};

use crate::leaderless::proto::*;

#[derive(Clone, Debug)]
pub struct CmParams {
    pub heartbeat_interval_us: u64,
    /// A member silent this long is suspected failed.
    pub failure_timeout_us: u64,
    /// Must equal the nodes' `lease_us`.
    pub lease_us: u64,
    /// Bound on message delay assumed when waiting out a suspect's lease.
    pub max_message_delay_us: u64,
    /// Minimum execution with fewer nodes before a returning node is re-added (models the time
    /// a replacement takes to come online; 0 = re-add as soon as it asks).
    pub efn_min_us: u64,
    /// After the CM starts, a node it has not heard from yet is suspected only after this long
    /// (nodes may start after the CM, or take a while to read their logs).
    pub startup_grace_us: u64,
}

impl Default for CmParams {
    fn default() -> Self {
        CmParams {
            heartbeat_interval_us: 4_000,
            failure_timeout_us: 300_000,
            lease_us: 200_000,
            max_message_delay_us: 50_000,
            efn_min_us: 0,
            startup_grace_us: 10_000_000,
        }
    }
}

/// Everything that can happen to the CM: the input of [`CmCore::handle`].
#[derive(Clone, Debug)]
pub enum CmInput {
    /// A node's answer to a heartbeat.
    Ack(HeartbeatAck),
    /// Time passes: failure detection, heartbeats, the EFN period.
    Tick,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CmOutput {
    /// Make this configuration durable before carrying out later outputs.
    Persist(Config),
    Send {
        to: NodeId,
        hb: Heartbeat,
    },
    /// A human-readable note for logs.
    Note(String),
}

pub struct CmCore {
    p: CmParams,
    config: Config,
    /// The listening clock (see the module docs): microseconds the CM has been running.
    listened_us: u64,
    /// Real time of the CM's last turn (a tick or an input).
    last_turn_us: u64,
    /// Per node, the listening clock when the CM last heard from it.
    last_heard_us: BTreeMap<NodeId, u64>,
    /// Silent nodes given one more failure timeout because a majority of the active nodes was
    /// silent with them: the listening clock before which each is not suspected (its
    /// `last_heard_us` stays, so the longest silent is still known).
    not_suspected_before: BTreeMap<NodeId, u64>,
    last_sent_us: BTreeMap<NodeId, u64>,
    /// Per node, the `lease_ref` of the newest ack received: echoed in its heartbeats.
    lease_refs: BTreeMap<NodeId, u64>,
    suspects: BTreeSet<NodeId>,
    removed_at_us: BTreeMap<NodeId, u64>,
    /// Started from a saved configuration (a takeover or a restart): the nodes not heard from
    /// since. Once a majority of the active nodes has answered, the cluster is evidently
    /// running (a takeover, not a cold start of everyone): the rest get one failure timeout
    /// from then instead of the whole start-up grace. Empty otherwise.
    unheard_since_takeover: BTreeSet<NodeId>,
    next_hb_us: u64,
    seq: u64,
    out: Vec<CmOutput>,
}

impl CmCore {
    /// Starts from the durable configuration, or creates the genesis one for `nodes` nodes.
    pub fn new(p: CmParams, durable: Option<Config>, nodes: u32, now_us: u64) -> Self {
        let mut out = Vec::new();
        let durable_nodes = durable
            .as_ref()
            .map(|c| c.nodes.iter().copied().collect::<BTreeSet<_>>());
        let config = match durable {
            Some(c) => c,
            None => {
                let c = Config::genesis(nodes);
                out.push(CmOutput::Persist(c.clone()));
                c
            }
        };
        // The listening clock starts at 0: a node not heard yet is silent from then on, once
        // the grace (less the failure timeout) has passed.
        let last_heard_us = config
            .nodes
            .iter()
            .map(|n| (*n, p.startup_grace_us.saturating_sub(p.failure_timeout_us)))
            .collect();
        let removed_at_us = config
            .nodes
            .iter()
            .filter(|n| !config.is_member(**n))
            .map(|n| (*n, now_us))
            .collect();
        let unheard_since_takeover = match &durable_nodes {
            Some(nodes) => nodes.clone(),
            None => BTreeSet::new(),
        };
        CmCore {
            p,
            config,
            listened_us: 0,
            last_turn_us: now_us,
            last_heard_us,
            not_suspected_before: BTreeMap::new(),
            last_sent_us: BTreeMap::new(),
            lease_refs: BTreeMap::new(),
            suspects: BTreeSet::new(),
            removed_at_us,
            unheard_since_takeover,
            next_hb_us: now_us,
            seq: 0,
            out,
        }
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Members suspected failed, each to be removed once its lease has run out.
    pub fn suspects(&self) -> &BTreeSet<NodeId> {
        &self.suspects
    }

    pub fn take_outputs(&mut self) -> Vec<CmOutput> {
        std::mem::take(&mut self.out)
    }

    /// The most one turn of the CM's loop adds to the listening clock: twice the heartbeat
    /// interval (a tick a little late counts in full), or an eighth of the failure timeout if
    /// more (a loaded machine's scheduling delays of some milliseconds count too, while one
    /// stall never costs a node more than an eighth of its timeout).
    pub fn max_counted_gap_us(&self) -> u64 {
        (2 * self.p.heartbeat_interval_us).max(self.p.failure_timeout_us / 8)
    }

    /// The listening clock: how long the CM has been running and able to hear the nodes.
    pub fn listened_us(&self) -> u64 {
        self.listened_us
    }

    /// Called at every turn of the CM's loop: advances the listening clock.
    fn turn(&mut self, now_us: u64) {
        let gap = now_us.saturating_sub(self.last_turn_us);
        self.last_turn_us = self.last_turn_us.max(now_us);
        let counted = gap.min(self.max_counted_gap_us());
        if gap >= self.p.failure_timeout_us / 2 {
            self.out.push(CmOutput::Note(format!(
                "the CM did not run for {} ms: that time is not counted as the nodes' silence",
                gap / 1000
            )));
        }
        self.listened_us += counted;
    }

    fn publish(&mut self, now_us: u64, why: String) {
        self.config.epoch += 1;
        self.out.push(CmOutput::Persist(self.config.clone()));
        self.out.push(CmOutput::Note(format!(
            "epoch {}: {why}; active {:?}, recovering {:?}",
            self.config.epoch, self.config.active, self.config.recovering
        )));
        // Tell everyone at once rather than at the next heartbeat.
        self.next_hb_us = now_us;
    }

    fn remove(&mut self, now_us: u64, n: NodeId, why: &str) {
        self.config.active.remove(&n);
        self.config.recovering.remove(&n);
        self.suspects.remove(&n);
        self.removed_at_us.insert(n, now_us);
        self.publish(now_us, format!("node {n} removed ({why})"));
    }

    /// After an input (debug builds): the epoch did not go back, and every invariant holds.
    #[cfg(debug_assertions)]
    fn check_after_input(&self, epoch_before: u64) {
        assert!(
            self.config.epoch >= epoch_before,
            "CM: invariant `the epoch never decreases` broken: {epoch_before} -> {}",
            self.config.epoch
        );
        self.check_invariants();
    }

    /// The one entry point: an input at time `now_us` (µs, the driver's clock; a parameter as in
    /// [`crate::leaderless::core::node::NodeCore::handle`]). Outputs accumulate for
    /// [`Self::take_outputs`]; in debug builds the invariants are checked after every input.
    pub fn handle(&mut self, now_us: u64, input: CmInput) {
        #[cfg(debug_assertions)]
        let epoch_before = self.config.epoch;
        match input {
            CmInput::Ack(ack) => self.on_ack_input(now_us, ack),
            CmInput::Tick => self.tick_input(now_us),
        }
        #[cfg(debug_assertions)]
        self.check_after_input(epoch_before);
    }

    fn on_ack_input(&mut self, now_us: u64, ack: HeartbeatAck) {
        self.turn(now_us);
        let n = ack.node;
        if !self.config.nodes.contains(&n) {
            return;
        }
        if self.suspects.contains(&n) {
            // Once suspected, a node comes back only through recovery.
            return;
        }
        self.last_heard_us.insert(n, self.listened_us);
        self.not_suspected_before.remove(&n);
        self.on_heard_since_takeover(n);
        // The newest received, not the largest: a restarted node's refs start over elsewhere.
        self.lease_refs.insert(n, ack.lease_ref);
        match ack.status {
            NodeStatus::WantsJoin => {
                if self.config.active.len() == 1 && self.config.active.contains(&n) {
                    // The last active node restarted: the group's state is in its log alone;
                    // nothing can be recovered from peers. Keep it (it cannot serve: it is Down).
                    return;
                }
                if self.config.is_member(n) && ack.epoch < self.config.epoch {
                    // An answer to an older configuration (e.g. the one that removed it).
                    return;
                }
                if self.config.is_member(n) {
                    // It restarted and lost its volatile state: it has no lease to wait out.
                    self.remove(now_us, n, "restarted");
                } else if now_us
                    >= self.removed_at_us.get(&n).copied().unwrap_or(0) + self.p.efn_min_us
                {
                    self.config.recovering.insert(n);
                    self.publish(now_us, format!("node {n} recovering"));
                }
            }
            NodeStatus::Recovered => {
                if self.config.recovering.contains(&n) && ack.epoch == self.config.epoch {
                    self.config.recovering.remove(&n);
                    self.config.active.insert(n);
                    self.publish(now_us, format!("node {n} recovered"));
                }
            }
            NodeStatus::Member => {}
        }
    }

    /// Panics, naming the invariant and the state, if the CM's state breaks a rule the module
    /// doc states. O(nodes). Run after every input in debug builds and after every step of the
    /// simulation.
    pub fn check_invariants(&self) {
        let c = &self.config;
        let broken = |what: &str| -> ! {
            panic!(
                "CM: invariant `{what}` broken: {c:?}, suspects {:?}, deferred {:?}",
                self.suspects, self.not_suspected_before
            )
        };
        if !c.active.is_disjoint(&c.recovering) {
            broken("a recovering node is not in the active set");
        }
        if c.active
            .iter()
            .chain(&c.recovering)
            .any(|n| !c.nodes.contains(n))
        {
            broken("active and recovering nodes are nodes of the group");
        }
        if !c.nodes.is_empty() && c.active.is_empty() {
            broken("the last active node is never removed");
        }
        if self
            .unheard_since_takeover
            .iter()
            .any(|n| !c.nodes.contains(n))
        {
            broken("nodes not heard since the takeover are nodes of the group");
        }
        if self.suspects.iter().any(|n| !c.is_member(*n)) {
            broken("suspects are members (a removed node is no longer suspected)");
        }
        if self
            .suspects
            .iter()
            .any(|n| self.not_suspected_before.contains_key(n))
        {
            broken("a suspect is not also deferred");
        }
    }

    /// True if `n` is the only active node: it is never removed (nobody could recover from the
    /// others), so it is never suspected either (suspicion stops its heartbeats, and a node
    /// without heartbeats learns no configuration and holds no lease).
    fn last_active(&self, n: NodeId) -> bool {
        self.config.active.len() == 1 && self.config.active.contains(&n)
    }

    /// A takeover from a saved configuration needs no start-up grace once the cluster is seen
    /// running: the live nodes answer the first heartbeat at once, so a majority of the active
    /// nodes heard means the silent ones are silent, not slow to start. They are then owed what
    /// any member is owed, one failure timeout of listening (their leases from the previous CM
    /// are waited out anyway: a suspect is removed only a lease after this CM's last heartbeat
    /// to it, which follows the takeover). A cold start of everyone (nobody answers at first)
    /// keeps the whole grace: nodes read their logs before they answer.
    fn on_heard_since_takeover(&mut self, n: NodeId) {
        if !self.unheard_since_takeover.remove(&n) {
            return;
        }
        let active = self.config.active.len();
        let heard = self
            .config
            .active
            .iter()
            .filter(|a| !self.unheard_since_takeover.contains(a))
            .count();
        if 2 * heard <= active {
            return;
        }
        let unheard = std::mem::take(&mut self.unheard_since_takeover);
        for u in &unheard {
            if let Some(h) = self.last_heard_us.get_mut(u) {
                *h = (*h).min(self.listened_us);
            }
        }
        if !unheard.is_empty() {
            self.out.push(CmOutput::Note(format!(
                "a majority of the active nodes answered the new CM: nodes {unheard:?}, not heard \
                 yet, get one failure timeout instead of the start-up grace"
            )));
        }
    }

    fn tick_input(&mut self, now_us: u64) {
        self.turn(now_us);
        // Failure detection, on the listening clock.
        let listened = self.listened_us;
        let quiet: Vec<NodeId> = self
            .config
            .members()
            .filter(|n| !self.suspects.contains(n) && !self.last_active(*n))
            .filter(|n| {
                let heard = self.last_heard_us.get(n).copied().unwrap_or(0);
                listened >= heard + self.p.failure_timeout_us
            })
            .collect();
        let active = self.config.active.len();
        let quiet_active = self
            .config
            .active
            .iter()
            .filter(|n| self.suspects.contains(n) || quiet.contains(n))
            .count();
        let mass = active > 1 && 2 * quiet_active > active;
        let mut deferred = Vec::new();
        for n in quiet {
            match self.not_suspected_before.get(&n).copied() {
                Some(t) if listened < t => continue,
                None if mass => {
                    // A majority of the active nodes silent: more likely the CM's own trouble
                    // than theirs. One more failure timeout of listening before suspecting.
                    let t = listened + self.p.failure_timeout_us;
                    self.not_suspected_before.insert(n, t);
                    deferred.push(n);
                }
                _ => {
                    self.not_suspected_before.remove(&n);
                    self.suspects.insert(n);
                    self.out.push(CmOutput::Note(format!("node {n} suspected")));
                }
            }
        }
        if !deferred.is_empty() {
            self.out.push(CmOutput::Note(format!(
                "nodes {deferred:?} silent with {quiet_active} of {active} active nodes: \
                 listening one more failure timeout before suspecting them"
            )));
        }
        // Suspects whose lease has run out, the longest silent first: if one must be kept (the
        // last active node), it is the one heard from last.
        let mut ready: Vec<NodeId> = self
            .suspects
            .iter()
            .copied()
            .filter(|n| {
                let sent = self.last_sent_us.get(n).copied().unwrap_or(0);
                now_us >= sent + self.p.lease_us + self.p.max_message_delay_us
            })
            .collect();
        ready.sort_by_key(|n| (self.last_heard_us.get(n).copied().unwrap_or(0), *n));
        for n in ready {
            if self.last_active(n) {
                // Kept: it must not stay suspected, or it would get no heartbeat again (no lease,
                // no new configuration: it could neither serve nor let anyone recover, and its
                // acks would be ignored). It starts afresh.
                self.suspects.remove(&n);
                self.last_heard_us.insert(n, self.listened_us);
                self.out.push(CmOutput::Note(format!(
                    "node {n} no longer suspected: it is the last active node"
                )));
                continue;
            }
            if self.config.is_member(n) {
                self.remove(now_us, n, "silent");
            } else {
                self.suspects.remove(&n);
            }
        }
        if now_us >= self.next_hb_us {
            self.next_hb_us = now_us + self.p.heartbeat_interval_us;
            self.seq += 1;
            let nodes = self.config.nodes.clone();
            for n in nodes {
                if self.suspects.contains(&n) {
                    continue;
                }
                self.last_sent_us.insert(n, now_us);
                self.out.push(CmOutput::Send {
                    to: n,
                    hb: Heartbeat {
                        seq: self.seq,
                        config: self.config.clone(),
                        lease_ref: self.lease_refs.get(&n).copied().unwrap_or(0),
                    },
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const N: u32 = 5;

    fn params() -> CmParams {
        CmParams {
            heartbeat_interval_us: 10_000,
            failure_timeout_us: 500_000,
            lease_us: 300_000,
            max_message_delay_us: 100_000,
            efn_min_us: 0,
            startup_grace_us: 1_000_000,
        }
    }

    fn ack(node: NodeId, epoch: u64) -> HeartbeatAck {
        HeartbeatAck {
            node,
            epoch,
            seq: 0,
            status: NodeStatus::Member,
            lease_ref: 0,
        }
    }

    /// Runs the CM from `from` to `to` (exclusive) in 10 ms turns; the nodes of `alive` answer
    /// every turn. Returns the heartbeats sent, per node, and the notes.
    fn run(
        cm: &mut CmCore,
        from: u64,
        to: u64,
        alive: &[NodeId],
    ) -> (BTreeMap<NodeId, usize>, Vec<String>) {
        let mut sent = BTreeMap::new();
        let mut notes = Vec::new();
        let mut t = from;
        while t < to {
            cm.handle(t, CmInput::Tick);
            let epoch = cm.config().epoch;
            for n in alive {
                cm.handle(t, CmInput::Ack(ack(*n, epoch)));
            }
            for o in cm.take_outputs() {
                match o {
                    CmOutput::Send { to, .. } => *sent.entry(to).or_default() += 1,
                    CmOutput::Note(n) => notes.push(n),
                    CmOutput::Persist(_) => {}
                }
            }
            t += 10_000;
        }
        (sent, notes)
    }

    fn notes(cm: &mut CmCore) -> Vec<String> {
        cm.take_outputs()
            .into_iter()
            .filter_map(|o| match o {
                CmOutput::Note(n) => Some(n),
                _ => None,
            })
            .collect()
    }

    /// Issue 22 §2: stopped for 0.6 s (longer than the failure timeout) the CM woke up, took its
    /// own silence for the nodes', suspected all five and removed four.
    #[test]
    fn a_paused_cm_does_not_take_its_own_silence_for_the_nodes() {
        let all: Vec<NodeId> = (0..N).collect();
        for pause_us in [600_000, 1_500_000, 30_000_000] {
            let mut cm = CmCore::new(params(), None, N, 0);
            run(&mut cm, 0, 2_000_000, &all);
            assert_eq!(cm.config().epoch, 1);
            // The pause: no turn at all. On waking the tick comes before the queued acks.
            let woke = 2_000_000 + pause_us;
            cm.handle(woke, CmInput::Tick);
            let n = notes(&mut cm);
            assert!(
                !n.iter()
                    .any(|n| n.contains("suspected") || n.contains("removed")),
                "paused {pause_us} us: {n:?}"
            );
            assert!(n.iter().any(|n| n.contains("did not run")), "{n:?}");
            let (_, n) = run(&mut cm, woke + 10_000, woke + 3_000_000, &all);
            assert_eq!(cm.config().epoch, 1, "paused {pause_us} us: {n:?}");
        }
    }

    /// A CM descheduled again and again (a loaded machine): every 0.6 s it runs once, its tick
    /// first, then the acks that waited. Its stalls are not the nodes' silence.
    #[test]
    fn repeated_stalls_of_the_cm_are_not_the_nodes_silence() {
        let all: Vec<NodeId> = (0..N).collect();
        let mut cm = CmCore::new(params(), None, N, 0);
        run(&mut cm, 0, 2_000_000, &all);
        let mut t = 2_000_000;
        for _ in 0..10 {
            t += 600_000;
            cm.handle(t, CmInput::Tick);
            let epoch = cm.config().epoch;
            for n in &all {
                cm.handle(t + 1, CmInput::Ack(ack(*n, epoch)));
            }
        }
        let n = notes(&mut cm);
        assert!(!n.iter().any(|n| n.contains("suspected")), "{n:?}");
        assert_eq!(cm.config().epoch, 1);
    }

    /// One crashed node is still suspected after one failure timeout and removed once its lease
    /// has run out.
    #[test]
    fn a_silent_node_is_removed_after_its_timeout_and_lease() {
        let mut cm = CmCore::new(params(), None, N, 0);
        run(&mut cm, 0, 2_000_000, &[0, 1, 2, 3, 4]);
        let (sent, n) = run(&mut cm, 2_000_000, 2_480_000, &[0, 1, 2, 3]);
        assert!(n.is_empty(), "{n:?}");
        assert!(sent[&4] > 0);
        run(&mut cm, 2_540_000, 3_000_000, &[0, 1, 2, 3]);
        assert_eq!(cm.config().active, [0, 1, 2, 3].into());
    }

    /// Issue 24 (host loss): a standby CM taking over from the saved configuration applied the
    /// whole start-up grace (10 s here) before suspecting the node whose host died with the old
    /// leader. The four live nodes answer at once: the dead one is removed after one failure
    /// timeout and its lease, well before the grace.
    #[test]
    fn a_takeover_with_a_majority_answering_removes_a_dead_node_without_the_startup_grace() {
        let p = CmParams {
            startup_grace_us: 10_000_000,
            ..params()
        };
        let saved = Config::genesis(N);
        let start = 50_000_000;
        let mut cm = CmCore::new(p, Some(saved), N, start);
        let (_, n) = run(&mut cm, start, start + 3_000_000, &[0, 1, 2, 3]);
        assert_eq!(cm.config().active, [0, 1, 2, 3].into(), "{n:?}");
        assert!(
            n.iter()
                .any(|n| n.contains("instead of the start-up grace")),
            "{n:?}"
        );
    }

    /// A cold start of everyone from the saved configuration keeps the grace: nodes still
    /// reading their logs, a minority answering, are not removed for it.
    #[test]
    fn a_restart_from_a_saved_configuration_with_a_minority_answering_keeps_the_grace() {
        let p = CmParams {
            startup_grace_us: 10_000_000,
            ..params()
        };
        let mut cm = CmCore::new(p, Some(Config::genesis(N)), N, 0);
        let (_, n) = run(&mut cm, 0, 8_000_000, &[0, 1]);
        assert_eq!(cm.config().epoch, 1, "{n:?}");
        // The rest come up in time: from then on the grace no longer matters.
        run(&mut cm, 8_000_000, 12_000_000, &[0, 1, 2, 3, 4]);
        assert_eq!(cm.config().epoch, 1);
    }

    /// A majority of the active nodes silent on one tick's evidence is listened to for one
    /// more failure timeout; still silent then, it is removed, all but the last active node,
    /// which is kept heartbeated (no lease, no configuration and no recovery otherwise).
    #[test]
    fn majority_silence_is_confirmed_and_the_last_active_node_keeps_its_heartbeats() {
        let mut cm = CmCore::new(params(), None, N, 0);
        run(&mut cm, 0, 2_000_000, &[0, 1, 2, 3, 4]);
        // Nodes 0, 1, 2 stop answering at 2.0 s: not suspected at 2.5 s...
        let (_, n) = run(&mut cm, 2_000_000, 2_600_000, &[3, 4]);
        assert!(!n.iter().any(|n| n.contains("suspected")), "{n:?}");
        assert!(
            n.iter().any(|n| n.contains("one more failure timeout")),
            "{n:?}"
        );
        assert_eq!(cm.config().epoch, 1);
        // ...but after one more timeout (and their leases) they are removed.
        run(&mut cm, 2_600_000, 3_600_000, &[3, 4]);
        assert_eq!(cm.config().active, [3, 4].into());

        // Now everyone falls silent: 3 and 4 (a majority of the active) are confirmed, then 3
        // (heard from no later than 4) is removed and 4 is kept.
        let mut cm = CmCore::new(params(), None, N, 0);
        run(&mut cm, 0, 2_000_000, &[0, 1, 2, 3, 4]);
        run(&mut cm, 2_000_000, 2_010_000, &[4]);
        let (_, n) = run(&mut cm, 2_010_000, 4_000_000, &[]);
        assert_eq!(cm.config().active, [4].into(), "{n:?}");
        let (sent, n) = run(&mut cm, 4_000_000, 5_000_000, &[]);
        assert_eq!(
            sent.get(&4),
            Some(&100),
            "the last active node is heartbeated: {n:?}"
        );
        // It answers: the group goes on (the others rejoin through recovery).
        let mut t = 5_000_000;
        cm.handle(t, CmInput::Tick);
        let e = cm.config().epoch;
        for n in 0..4 {
            cm.handle(
                t,
                CmInput::Ack(HeartbeatAck {
                    node: n,
                    epoch: e,
                    seq: 0,
                    status: NodeStatus::WantsJoin,
                    lease_ref: 0,
                }),
            );
        }
        cm.handle(t, CmInput::Ack(ack(4, e)));
        assert_eq!(cm.config().recovering, [0, 1, 2, 3].into());
        for _ in 0..100 {
            t += 10_000;
            cm.handle(t, CmInput::Tick);
            cm.handle(t, CmInput::Ack(ack(4, cm.config().epoch)));
        }
        assert_eq!(cm.config().active, [4].into());
        assert!(!notes(&mut cm)
            .iter()
            .any(|n| n.contains("node 4 suspected")));
    }

    /// The invariant checks can fail: a CM whose state breaks one panics naming it.
    #[test]
    fn check_invariants_names_a_broken_invariant() {
        let mut cm = CmCore::new(params(), None, N, 0);
        cm.check_invariants();
        cm.config.recovering.insert(1); // node 1 both active and recovering
        let e = std::panic::catch_unwind(|| cm.check_invariants()).unwrap_err();
        let msg = e.downcast_ref::<String>().unwrap();
        assert!(
            msg.contains("a recovering node is not in the active set"),
            "{msg}"
        );
    }
}
