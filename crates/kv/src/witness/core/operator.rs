//! An operator's membership requests (`understudy kv reconfig`), as a part of [`WitnessCore`]
//! (a child module of `node`, like `reconfig.rs`).
//!
//! A [`ClientReq::Reconfigure`] goes through the same gate as the automatic policy
//! ([`WitnessCore::propose_config`]: only the serving leader, one uncommitted change at a time,
//! [`Config::apply`]'s safety checks) and is answered only once its entry commits, so an
//! operator who is told "done" can rely on the new configuration surviving any failover. A
//! refused change gets the reason (`Invalid`); "another change is pending" and "not serving
//! yet" are `Unavailable`, which the client retries until its deadline (the automatic policy
//! may have just proposed a step of its own). A leader that loses its leadership before the
//! entry commits answers `Indeterminate`: the change may or may not take effect.

use super::*;

impl WitnessCore {
    pub(super) fn on_client_reconfigure(&mut self, tag: u64, change: Change) {
        let reply = |c: &mut Self, reply| c.out.push(Output::Reply { tag, reply });
        if !matches!(self.role, RoleKind::Leader | RoleKind::Provisional) {
            let hint = self.leader_hint.filter(|&h| h != self.id);
            return reply(self, ClientReply::NotLeader { hint });
        }
        match self.propose_config(&change) {
            Ok(index) => {
                // `propose_config` refuses while a change is uncommitted, so nothing waits.
                debug_assert!(self.reconf.operator_waiting.is_none());
                self.reconf.operator_waiting = Some((index, self.term, tag));
            }
            Err(ReconfigError::NotLeader | ReconfigError::Pending(_)) => {
                reply(self, ClientReply::Unavailable)
            }
            Err(e) => {
                self.reconf.last_error = Some(e.to_string());
                reply(self, ClientReply::Invalid(format!("change refused: {e}")))
            }
        }
    }

    pub(super) fn on_client_membership(&mut self, tag: u64) {
        let leading = self.role == RoleKind::Leader;
        let reply = ClientReply::Membership {
            config: self.cfg.clone(),
            leader: if leading {
                Some(self.id)
            } else {
                self.leader_hint
            },
            serving: self.is_serving(),
        };
        self.out.push(Output::Reply { tag, reply });
    }

    /// After every input: answers the operator's change once it committed, or once this node
    /// no longer leads the term that proposed it.
    pub(super) fn operator_answer(&mut self) {
        let Some((index, term, tag)) = self.reconf.operator_waiting else {
            return;
        };
        let reply = if self.role == RoleKind::Leader && self.term == term {
            if self.commit < index {
                return;
            }
            match self.log.entry(index).map(|e| &e.op) {
                Some(Op::Config(c)) => ClientReply::Reconfigured(c.clone()),
                // Dropped from the log already (it is committed): what is in force now.
                _ => ClientReply::Reconfigured(self.cfg.clone()),
            }
        } else {
            ClientReply::Indeterminate
        };
        self.reconf.operator_waiting = None;
        self.out.push(Output::Reply { tag, reply });
    }
}
