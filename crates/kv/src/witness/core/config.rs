//! Group membership of the witness KV (paper §3, §4.1, §6; spec M2, M4, M12, M22).
//!
//! A member is a *head* (the primary or a witness: it may lead) or a *backup* (NVMM buffer +
//! SSD logs: it votes and acks but never runs, M12), and voting or non-voting (a new backup joins
//! non-voting and is promoted once caught up, M22). The commit quorum is the leader plus **every**
//! voting backup (M4), not a majority: a committed entry is then on every voting backup, which
//! is what lets a reconciling leader drop an entry any voting backup lacks (M14 ii). A witness
//! named as `substitute` stands in for a failed backup in the commit quorum (M22).
//!
//! This version keeps the configuration fixed for a core's life (one epoch); joint
//! configurations and membership changes (M22–M24) are not implemented yet.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::witness::proto::NodeId;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    /// Primary or witness: keeps the key→stamp table (and, as primary, values); may be elected.
    Head,
    /// NVMM buffer, SSD logs and index: votes and persists, never a candidate.
    Backup,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub id: NodeId,
    pub kind: Kind,
    pub voting: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Config {
    pub epoch: u64,
    pub members: Vec<Member>,
    /// A witness standing in for a failed backup in the commit quorum (M22). It must then
    /// receive full entries.
    pub substitute: Option<NodeId>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("node {0} is listed twice")]
    Duplicate(NodeId),
    #[error("a group needs at least one voting head (someone must be able to lead)")]
    NoHead,
    #[error("substitute {0} is not a voting head")]
    BadSubstitute(NodeId),
}

impl Config {
    /// The usual layout (M2): node 0 the first primary, then `backups` backups, then `witnesses`
    /// witnesses, all voting, epoch 1.
    pub fn standard(backups: u32, witnesses: u32) -> Config {
        let mut members = vec![Member {
            id: 0,
            kind: Kind::Head,
            voting: true,
        }];
        for i in 0..backups {
            members.push(Member {
                id: 1 + i,
                kind: Kind::Backup,
                voting: true,
            });
        }
        for i in 0..witnesses {
            members.push(Member {
                id: 1 + backups + i,
                kind: Kind::Head,
                voting: true,
            });
        }
        Config {
            epoch: 1,
            members,
            substitute: None,
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut seen = BTreeSet::new();
        for m in &self.members {
            if !seen.insert(m.id) {
                return Err(ConfigError::Duplicate(m.id));
            }
        }
        if !self
            .members
            .iter()
            .any(|m| m.kind == Kind::Head && m.voting)
        {
            return Err(ConfigError::NoHead);
        }
        if let Some(s) = self.substitute {
            if !self
                .member(s)
                .is_some_and(|m| m.kind == Kind::Head && m.voting)
            {
                return Err(ConfigError::BadSubstitute(s));
            }
        }
        Ok(())
    }

    pub fn member(&self, id: NodeId) -> Option<&Member> {
        self.members.iter().find(|m| m.id == id)
    }

    pub fn kind(&self, id: NodeId) -> Option<Kind> {
        self.member(id).map(|m| m.kind)
    }

    pub fn ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.members.iter().map(|m| m.id)
    }

    pub fn voters(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.members.iter().filter(|m| m.voting).map(|m| m.id)
    }

    pub fn is_voter(&self, id: NodeId) -> bool {
        self.member(id).is_some_and(|m| m.voting)
    }

    /// Voting backups: the members every commit and every reconciliation must hear from.
    pub fn voting_backups(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.members
            .iter()
            .filter(|m| m.voting && m.kind == Kind::Backup)
            .map(|m| m.id)
    }

    /// Backups (voting or not) a new primary may pull values from.
    pub fn backups(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.members
            .iter()
            .filter(|m| m.kind == Kind::Backup)
            .map(|m| m.id)
    }

    /// Who must hold an entry, persisted, for `leader` to commit it (M4, M22): the leader, every
    /// voting backup and the substitute witness if any.
    pub fn commit_quorum(&self, leader: NodeId) -> BTreeSet<NodeId> {
        let mut q: BTreeSet<NodeId> = self.voting_backups().collect();
        q.insert(leader);
        if let Some(s) = self.substitute {
            q.insert(s);
        }
        q
    }

    /// Votes (the candidate's own included) that win an election: a majority of voters.
    pub fn election_quorum(&self) -> usize {
        self.voters().count() / 2 + 1
    }

    /// Only voting heads may stand for election; a backup never does (M12).
    pub fn may_stand(&self, id: NodeId) -> bool {
        self.member(id)
            .is_some_and(|m| m.voting && m.kind == Kind::Head)
    }

    /// Whether `id` must receive values in its AppendEntries (backups and the substitute).
    pub fn gets_values(&self, id: NodeId) -> bool {
        self.kind(id) == Some(Kind::Backup) || self.substitute == Some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quorums_of_the_standard_layouts() {
        // P+B+W (the paper's evaluation, N = 1).
        let c = Config::standard(1, 1);
        c.validate().unwrap();
        assert_eq!(c.commit_quorum(0), BTreeSet::from([0, 1]));
        assert_eq!(c.election_quorum(), 2);
        assert!(c.may_stand(0) && c.may_stand(2));
        assert!(!c.may_stand(1), "a backup never runs");
        // N = 2: P, B1, B2, W1, W2. The commit quorum (leader + all voting backups) is a
        // majority, so it meets every election majority.
        let c = Config::standard(2, 2);
        assert_eq!(c.commit_quorum(3), BTreeSet::from([1, 2, 3]));
        assert_eq!(c.election_quorum(), 3);
        assert!(!c.may_stand(1) && !c.may_stand(2));
        assert!(c.gets_values(1) && !c.gets_values(3));
    }

    #[test]
    fn substitute_joins_the_commit_quorum_and_non_voters_do_not() {
        let mut c = Config::standard(2, 2);
        c.members[2].voting = false; // backup 2 failed / not yet caught up
        c.substitute = Some(3);
        c.validate().unwrap();
        assert_eq!(c.commit_quorum(0), BTreeSet::from([0, 1, 3]));
        assert!(c.gets_values(3));
        assert_eq!(c.election_quorum(), 3); // 4 voters
        c.substitute = Some(1);
        assert_eq!(c.validate(), Err(ConfigError::BadSubstitute(1)));
    }
}
