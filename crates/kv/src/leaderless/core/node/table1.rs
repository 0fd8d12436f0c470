//! Table I of HEAL as data: for each persistency model (under linearizable consistency), what a
//! follower acknowledges, and what the coordinator of a write does once every other member's
//! ACK_C — and then every ACK_P plus its own persist — has arrived. The write path
//! ([`NodeCore::advance`], [`NodeCore::ack`]) reads its row; it holds no per-model code.

use super::*;

/// How far a coordinated write has got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    /// Every other member's ACK_C (consistency: the update is applied everywhere).
    AllAckC,
    /// Every ACK_C and every ACK_P, and the coordinator's own persist (durable everywhere).
    AllAckCP,
}

/// What the coordinator does on reaching a stage. A step that does not end the write fires once
/// (it sets the coordinator's `replied` / `val_c_sent`); the last step ends it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Step {
    pub at: Stage,
    /// Answer the client.
    pub reply: bool,
    /// Broadcast one VAL with these halves (consistency, persistency). Its consistency half
    /// makes the key readable (valid); its persistency half makes it globally durable (GDP).
    pub val: Option<(bool, bool)>,
    /// The write is over: the coordinator drops it.
    pub done: bool,
}

/// What a follower sends for an update it applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FollowerAck {
    /// One ACK carrying both halves, once the update is durable (Synch).
    Combined,
    /// ACK_C at once, ACK_P once durable.
    Split,
    /// ACK_C only: durability is asked for per scope, by PERSIST (Scope).
    ConsistencyOnly,
}

/// One row of Table I.
#[derive(Clone, Copy, Debug)]
pub(super) struct Rules {
    pub follower_ack: FollowerAck,
    /// The coordinator's steps, in order.
    pub steps: &'static [Step],
    /// Writes belong to a client's scope and are made durable by its PERSIST, not one by one.
    pub scoped_persist: bool,
    /// Persistence runs in the background, off the critical path: a recovering node does not wait
    /// for its own log appends of the catch-up before it ends recovery.
    pub background_persist: bool,
}

impl Rules {
    /// The coordinator waits for the followers' ACK_Ps (a step at [`Stage::AllAckCP`]).
    pub fn waits_for_ack_p(&self) -> bool {
        self.steps.iter().any(|s| s.at == Stage::AllAckCP)
    }
}

const fn step(at: Stage, reply: bool, val: Option<(bool, bool)>, done: bool) -> Step {
    Step {
        at,
        reply,
        val,
        done,
    }
}

use Stage::{AllAckC, AllAckCP};

/// ⟨Lin, Synch⟩: answered, readable and durable together, once everything is durable.
const SYNCH: Rules = Rules {
    follower_ack: FollowerAck::Combined,
    steps: &[step(AllAckCP, true, Some((true, true)), true)],
    scoped_persist: false,
    background_persist: false,
};
/// ⟨Lin, Strict⟩: readable at VAL_C; answered (and VAL_P) once everything is durable.
const STRICT: Rules = Rules {
    follower_ack: FollowerAck::Split,
    steps: &[
        step(AllAckC, false, Some((true, false)), false),
        step(AllAckCP, true, Some((false, true)), true),
    ],
    scoped_persist: false,
    background_persist: false,
};
/// ⟨Lin, REnf⟩: answered at all ACK_Cs; readable (and durable) only once everything is durable.
const READ_ENFORCED: Rules = Rules {
    follower_ack: FollowerAck::Split,
    steps: &[
        step(AllAckC, true, None, false),
        step(AllAckCP, false, Some((true, true)), true),
    ],
    scoped_persist: false,
    background_persist: false,
};
/// ⟨Lin, Event⟩: answered and readable at all ACK_Cs; VAL_P tracks durability in the background.
const EVENTUAL: Rules = Rules {
    follower_ack: FollowerAck::Split,
    steps: &[
        step(AllAckC, true, Some((true, false)), false),
        step(AllAckCP, false, Some((false, true)), true),
    ],
    scoped_persist: false,
    background_persist: true,
};
/// ⟨Lin, Scope⟩: like Eventual per write, ended at all ACK_Cs; durability per scope by PERSIST.
const SCOPE: Rules = Rules {
    follower_ack: FollowerAck::ConsistencyOnly,
    steps: &[step(AllAckC, true, Some((true, false)), true)],
    scoped_persist: true,
    background_persist: false,
};

/// The row of Table I for `model`.
pub(super) fn rules(model: Model) -> &'static Rules {
    match model {
        Model::Synch => &SYNCH,
        Model::Strict => &STRICT,
        Model::ReadEnforced => &READ_ENFORCED,
        Model::Eventual => &EVENTUAL,
        Model::Scope => &SCOPE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row ends the write exactly once, in its last step, and makes the key readable once.
    #[test]
    fn every_row_ends_once_and_validates_once() {
        for m in Model::ALL {
            let r = rules(m);
            let ends: Vec<bool> = r.steps.iter().map(|s| s.done).collect();
            assert_eq!(ends.last(), Some(&true), "{m}");
            assert_eq!(ends.iter().filter(|d| **d).count(), 1, "{m}");
            let validates = r
                .steps
                .iter()
                .filter(|s| s.val.is_some_and(|v| v.0))
                .count();
            assert_eq!(validates, 1, "{m}");
            let replies = r.steps.iter().filter(|s| s.reply).count();
            assert_eq!(replies, 1, "{m}");
            // Durability (a VAL_P) is announced per write unless writes are scoped.
            let gdp = r.steps.iter().any(|s| s.val.is_some_and(|v| v.1));
            assert_eq!(gdp, !r.scoped_persist, "{m}");
        }
    }
}
