//! The sans-I/O configuration manager (§IV, §V-A, Fig. 2): heartbeats to every node, failure
//! detection by timeout, reconfiguration with a new epoch, the EFN period, and re-adding a
//! restarted node as a recovering ShadowReplica, then as active once it reports HEAL done.
//!
//! Leases: a node serves reads only within `lease_us` of a heartbeat it received. Before the CM
//! publishes a configuration without a suspected node it stops heartbeating it and waits until
//! any lease that node could still hold has run out (`lease_us + max_message_delay_us` after the
//! last heartbeat sent to it), so a cut-off node never serves a stale read.
//!
//! The configuration is durable: [`CmOutput::Persist`] comes before any heartbeat carrying it,
//! and the driver must make it durable before carrying out the outputs that follow.

use std::collections::{BTreeMap, BTreeSet};

use crate::msg::*;

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
    last_heard_us: BTreeMap<NodeId, u64>,
    last_sent_us: BTreeMap<NodeId, u64>,
    suspects: BTreeSet<NodeId>,
    removed_at_us: BTreeMap<NodeId, u64>,
    next_hb_us: u64,
    seq: u64,
    out: Vec<CmOutput>,
}

impl CmCore {
    /// Starts from the durable configuration, or creates the genesis one for `nodes` nodes.
    pub fn new(p: CmParams, durable: Option<Config>, nodes: u32, now_us: u64) -> Self {
        let mut out = Vec::new();
        let config = match durable {
            Some(c) => c,
            None => {
                let c = Config::genesis(nodes);
                out.push(CmOutput::Persist(c.clone()));
                c
            }
        };
        let last_heard_us = config
            .nodes
            .iter()
            .map(|n| {
                (
                    *n,
                    now_us + p.startup_grace_us.saturating_sub(p.failure_timeout_us),
                )
            })
            .collect();
        let removed_at_us = config
            .nodes
            .iter()
            .filter(|n| !config.is_member(**n))
            .map(|n| (*n, now_us))
            .collect();
        CmCore {
            p,
            config,
            last_heard_us,
            last_sent_us: BTreeMap::new(),
            suspects: BTreeSet::new(),
            removed_at_us,
            next_hb_us: now_us,
            seq: 0,
            out,
        }
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn take_outputs(&mut self) -> Vec<CmOutput> {
        std::mem::take(&mut self.out)
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

    pub fn on_ack(&mut self, now_us: u64, ack: HeartbeatAck) {
        let n = ack.node;
        if !self.config.nodes.contains(&n) {
            return;
        }
        if self.suspects.contains(&n) {
            // Once suspected, a node comes back only through recovery.
            return;
        }
        self.last_heard_us.insert(n, now_us);
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

    pub fn tick(&mut self, now_us: u64) {
        // Failure detection.
        let members: Vec<NodeId> = self.config.members().collect();
        for n in members {
            let heard = self.last_heard_us.get(&n).copied().unwrap_or(0);
            if !self.suspects.contains(&n) && now_us >= heard + self.p.failure_timeout_us {
                self.suspects.insert(n);
                self.out.push(CmOutput::Note(format!("node {n} suspected")));
            }
        }
        let ready: Vec<NodeId> = self
            .suspects
            .iter()
            .copied()
            .filter(|n| {
                let sent = self.last_sent_us.get(n).copied().unwrap_or(0);
                now_us >= sent + self.p.lease_us + self.p.max_message_delay_us
            })
            .collect();
        for n in ready {
            if self.config.active.len() == 1 && self.config.active.contains(&n) {
                // Never remove the last active node: nobody could recover from the others.
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
                    },
                });
            }
        }
    }
}
