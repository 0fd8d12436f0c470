//! Group membership of the witness KV (paper §3, §4.1, §6; spec M2, M4, M12, M22).
//!
//! A member is a *head* (the primary or a witness: it may lead) or a *backup* (NVMM buffer +
//! SSD logs: it votes and acks but never runs, M12), and voting or non-voting (a new backup joins
//! non-voting and is promoted once caught up, M22). The commit quorum is the leader plus **every**
//! voting backup (M4), not a majority: a committed entry is then on every voting backup, which
//! is what lets a reconciling leader drop an entry any voting backup lacks (M14 ii). A witness
//! named as `substitute` stands in for a failed backup in the commit quorum (M22).
//!
//! Membership changes (M22–M24) are single steps ([`Change`], [`Config::apply`]) replicated as
//! log entries; why one step at a time is safe here is argued in `core::reconfig`.

use std::collections::BTreeSet;

use crate::witness::proto::NodeId;
pub use crate::witness::proto::{Change, Config, Kind, Member};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("node {0} is listed twice")]
    Duplicate(NodeId),
    #[error("a group needs at least one voting head (someone must be able to lead)")]
    NoHead,
    #[error("substitute {0} is not a voting head")]
    BadSubstitute(NodeId),
    #[error("node {0} is not a member")]
    NotMember(NodeId),
    #[error("node {0} is already a member")]
    AlreadyMember(NodeId),
    #[error("the change moves {0} voters at once; one at a time keeps every old and new majority overlapping")]
    TooManyVoters(usize),
    #[error("the commit quorum ({0} nodes) would no longer be a majority of the {1} voters")]
    QuorumNotMajority(usize, usize),
    #[error("a substitute ({0}) is already in place")]
    SubstituteInPlace(NodeId),
    #[error("{0} is not a voting backup")]
    NotVotingBackup(NodeId),
    #[error("no voting backup or substitute would be left: acknowledged values would live only in the leader's DRAM")]
    NoValueHolder,
}

// `Change` travels in a client request (`kv reconfig`), so it is defined in `proto`.

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
            spares: Vec::new(),
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

    /// The configuration after `change`, at the next epoch, or why the change is refused.
    /// Beyond [`Config::validate`]: at most one voter added or removed, and, when this
    /// configuration's commit quorum is a majority of its voters, so is the new one's (the
    /// overlap argument of `core::reconfig` rests on it).
    pub fn apply(&self, change: &Change) -> Result<Config, ConfigError> {
        let mut c = self.clone();
        c.epoch += 1;
        match *change {
            Change::Add { id, kind } => {
                if self.member(id).is_some() {
                    return Err(ConfigError::AlreadyMember(id));
                }
                c.spares.retain(|m| m.id != id);
                c.members.push(Member {
                    id,
                    kind,
                    voting: false,
                });
            }
            Change::Remove { id } => {
                if self.member(id).is_none() {
                    return Err(ConfigError::NotMember(id));
                }
                c.members.retain(|m| m.id != id);
                if c.substitute == Some(id) {
                    c.substitute = None;
                }
            }
            Change::SetVoting { id, voting } => {
                let m = c
                    .members
                    .iter_mut()
                    .find(|m| m.id == id)
                    .ok_or(ConfigError::NotMember(id))?;
                m.voting = voting;
                if !voting && c.substitute == Some(id) {
                    c.substitute = None;
                }
            }
            Change::Substitute { backup, witness } => {
                if let Some(s) = self.substitute {
                    return Err(ConfigError::SubstituteInPlace(s));
                }
                let b = c
                    .members
                    .iter_mut()
                    .find(|m| m.id == backup && m.kind == Kind::Backup && m.voting)
                    .ok_or(ConfigError::NotVotingBackup(backup))?;
                b.voting = false;
                c.substitute = Some(witness);
            }
            Change::EndSubstitute => c.substitute = None,
        }
        c.validate()?;
        let old: BTreeSet<NodeId> = self.voters().collect();
        let new: BTreeSet<NodeId> = c.voters().collect();
        let moved = old.symmetric_difference(&new).count();
        if moved > 1 {
            return Err(ConfigError::TooManyVoters(moved));
        }
        let holders = |x: &Config| x.voting_backups().count() + x.substitute.iter().count();
        if holders(self) > 0 && holders(&c) == 0 {
            return Err(ConfigError::NoValueHolder);
        }
        if self.quorum_is_majority() && !c.quorum_is_majority() {
            return Err(ConfigError::QuorumNotMajority(
                c.voting_backups().count() + c.substitute.iter().count() + 1,
                c.voters().count(),
            ));
        }
        Ok(c)
    }

    /// Whether the commit quorum (any voting head leading) is a majority of the voters: then
    /// every election majority meets every commit quorum.
    pub fn quorum_is_majority(&self) -> bool {
        let q = self.voting_backups().count() + self.substitute.iter().count() + 1;
        2 * q > self.voters().count()
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

    /// Heads that may start an election: voting heads, and a non-voting head that may have
    /// been promoted without hearing of it; it wins only once it is a voter (see
    /// `core::reconfig`).
    pub fn may_run(&self, id: NodeId) -> bool {
        self.kind(id) == Some(Kind::Head)
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

    #[test]
    fn changes_move_one_voter_and_keep_the_quorum_a_majority() {
        let c = Config::standard(2, 2); // P0 B1 B2 W3 W4
        assert!(c.quorum_is_majority());
        // M22: backup 2 lost, witness 3 substitutes: voters 0,1,3,4; quorum {L,1,3}.
        let s = c
            .apply(&Change::Substitute {
                backup: 2,
                witness: 3,
            })
            .unwrap();
        assert_eq!(s.epoch, 2);
        assert_eq!(s.commit_quorum(0), BTreeSet::from([0, 1, 3]));
        assert_eq!(s.election_quorum(), 3);
        assert!(s.quorum_is_majority());
        assert_eq!(
            s.apply(&Change::Substitute {
                backup: 1,
                witness: 4
            }),
            Err(ConfigError::SubstituteInPlace(3))
        );
        // A replacement backup 5 joins non-voting, then is promoted, then the substitute ends.
        let a = s
            .apply(&Change::Add {
                id: 5,
                kind: Kind::Backup,
            })
            .unwrap();
        assert!(!a.is_voter(5) && a.gets_values(5));
        let p = a
            .apply(&Change::SetVoting {
                id: 5,
                voting: true,
            })
            .unwrap();
        assert_eq!(p.commit_quorum(0), BTreeSet::from([0, 1, 3, 5]));
        let e = p.apply(&Change::EndSubstitute).unwrap();
        assert_eq!(e.commit_quorum(0), BTreeSet::from([0, 1, 5]));
        // Dropping a substitute that holds the quorum up is refused: {L,1} of 4 voters.
        assert!(matches!(
            s.apply(&Change::EndSubstitute),
            Err(ConfigError::QuorumNotMajority(2, 4))
        ));
        // P0 B1 W2 with witness 2 substituting for backup 1: removing witness 2 would leave
        // the leader the only holder of values.
        let n1 = Config::standard(1, 1)
            .apply(&Change::Substitute {
                backup: 1,
                witness: 2,
            })
            .unwrap();
        assert_eq!(
            n1.apply(&Change::Remove { id: 2 }),
            Err(ConfigError::NoValueHolder)
        );
        // N = 2: a lost substitute may leave (backup 1 still holds every value).
        let r = s.apply(&Change::Remove { id: 3 }).unwrap();
        assert_eq!(r.commit_quorum(0), BTreeSet::from([0, 1]));
        // Bad input is an error and changes nothing.
        assert_eq!(
            c.apply(&Change::Remove { id: 9 }),
            Err(ConfigError::NotMember(9))
        );
        assert_eq!(
            c.apply(&Change::Add {
                id: 1,
                kind: Kind::Head
            }),
            Err(ConfigError::AlreadyMember(1))
        );
        assert_eq!(
            c.apply(&Change::Substitute {
                backup: 3,
                witness: 4
            }),
            Err(ConfigError::NotVotingBackup(3))
        );
    }
}
