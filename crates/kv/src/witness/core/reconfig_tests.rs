//! Unit tests of membership changes (M22–M24, `core/reconfig.rs`) on the in-test router of
//! `core/tests.rs`.

use super::*;
use crate::witness::core::config::{Change, Kind, Member};

/// Members lose a voting member after this long (≥ the election timeout, as validated).
const LOST_US: u64 = 300 * MS;

fn lost_params() -> Params {
    Params {
        member_lost_us: LOST_US,
        ..params()
    }
}

/// A router over `cfg` with `spares` named in the members' configuration and running as
/// idle processes that know only themselves (as the driver would start a spare).
fn with_spares(mut cfg: Config, spares: &[(NodeId, Kind)]) -> Router {
    for &(id, kind) in spares {
        cfg.spares.push(Member {
            id,
            kind,
            voting: false,
        });
    }
    let p = lost_params();
    let mut r = Router::with_params(cfg.clone(), p.clone());
    for &(id, kind) in spares {
        let mut own = cfg.clone();
        own.epoch = 0; // older than any real configuration: the leader's messages win
        own.members.push(Member {
            id,
            kind,
            voting: false,
        });
        r.nodes
            .insert(id, WitnessCore::new(id, own, p.clone(), r.now).unwrap());
        r.alive.insert(id);
    }
    r
}

fn reconfigure(r: &mut Router, node: NodeId, change: Change) -> Option<String> {
    r.feed(node, Input::Reconfigure(change));
    r.node(node).last_reconfig_error().map(str::to_string)
}

fn cfg_of(r: &Router, id: NodeId) -> Config {
    r.node(id).config().clone()
}

#[test]
fn manual_changes_replicate_and_bad_ones_are_refused() {
    let mut r = Router::with_params(Config::standard(1, 1), lost_params()); // P0 B1 W2
    let p = r.wait_serving();
    assert_eq!(r.put(p, "a", "1"), Some(ClientReply::PutOk));
    let follower = if p == 0 { 2 } else { 0 };
    assert_eq!(
        reconfigure(&mut r, follower, Change::EndSubstitute).as_deref(),
        Some("not the serving leader")
    );
    let e = reconfigure(&mut r, p, Change::Remove { id: p }).unwrap();
    assert!(e.contains("cannot remove"), "{e}");
    let e = reconfigure(
        &mut r,
        p,
        Change::Add {
            id: 1,
            kind: Kind::Head,
        },
    )
    .unwrap();
    assert!(e.contains("already a member"), "{e}");
    assert_eq!(cfg_of(&r, p).epoch, 1, "a refused change changes nothing");
    // A witness 7 (not running) joins non-voting: the entry commits on P + B alone.
    assert_eq!(
        reconfigure(
            &mut r,
            p,
            Change::Add {
                id: 7,
                kind: Kind::Head
            }
        ),
        None
    );
    // A second change before the first commits is refused.
    let e = reconfigure(&mut r, p, Change::Remove { id: 7 }).unwrap();
    assert!(e.contains("not committed yet"), "{e}");
    assert!(r.run_until(500, |r| [0, 1, 2]
        .iter()
        .all(|&i| r.node(i).config().epoch == 2)));
    assert!(r.node(1).config().member(7).is_some());
    assert_eq!(r.put(p, "a", "2"), Some(ClientReply::PutOk));
    assert_eq!(r.get(p, "a"), val("2"));
}

#[test]
fn lost_backup_is_substituted_and_the_substitute_keeps_values() {
    // P0 B1 B2 W3 W4 (N = 2); backup 2 dies for good.
    let mut r = Router::with_params(Config::standard(2, 2), lost_params());
    let p = r.wait_serving();
    assert_eq!(p, 0);
    assert_eq!(r.put(p, "old", "o"), Some(ClientReply::PutOk));
    r.crash(2);
    // Writes stall (backup 2 is in the commit quorum), then continue once witness 3
    // substitutes for it (M22).
    let tag = r.submit(
        p,
        ClientReq::Put {
            key: b"k".to_vec(),
            value: b"v1".to_vec(),
        },
    );
    r.run_for(100);
    assert!(!r.replies.contains_key(&tag), "committed without backup 2");
    assert!(r.run_until(1_000, |r| r.replies.contains_key(&tag)));
    assert_eq!(r.replies.remove(&tag), Some(ClientReply::PutOk));
    let c = cfg_of(&r, p);
    assert_eq!(c.substitute, Some(3));
    assert!(!c.is_voter(2));
    assert!(r.now >= LOST_US, "substituted before the bound");
    assert_eq!(r.put(p, "k", "v2"), Some(ClientReply::PutOk));
    r.run_for(20);
    // The substitute holds the values written since it joined the quorum.
    assert_eq!(r.node(3).local_value(b"k").map(|x| x.1), Some(&b"v2"[..]));
    assert_eq!(
        r.node(4).local_value(b"k"),
        None,
        "a plain witness keeps no values"
    );
    // The primary dies too: a witness takes over and serves old and new values.
    r.crash(0);
    let l = r.wait_serving();
    assert!(l == 3 || l == 4, "leader {l}");
    assert_eq!(r.get(l, "k"), val("v2"));
    assert_eq!(r.get(l, "old"), val("o"));
    assert_backups_never_ran(&r, &[1, 2]);
}

#[test]
fn spare_backup_catches_up_is_promoted_and_the_substitute_steps_back() {
    // P0 B1 W2, spare backup 3. Backup 1 dies for good.
    let mut r = with_spares(Config::standard(1, 1), &[(3, Kind::Backup)]);
    let p = r.wait_serving();
    for i in 0..20 {
        assert_eq!(
            r.put(p, &format!("k{}", i % 7), &format!("v{i}")),
            Some(ClientReply::PutOk)
        );
    }
    r.crash(1);
    // Substitute → add 3 → 3 catches up (values from the primary's table) → promoted → the
    // substitute ends → backup 1 leaves.
    let done = r.run_until(5_000, |r| {
        let c = r.node(0).config();
        c.member(1).is_none() && c.is_voter(3) && c.substitute.is_none()
    });
    assert!(done, "config {:?}", cfg_of(&r, 0));
    assert!(r.node(0).counters.reconfigs >= 5);
    assert_eq!(r.put(p, "new", "n"), Some(ClientReply::PutOk));
    r.run_for(100); // writeback on backup 3
                    // The primary dies: witness 2 takes over and pulls every value from backup 3 alone.
    r.crash(0);
    let l = r.wait_serving();
    assert_eq!(l, 2);
    assert_eq!(r.get(l, "new"), val("n"));
    for k in 0..7 {
        let last = (0..20).filter(|i| i % 7 == k).max().unwrap();
        assert_eq!(r.get(l, &format!("k{k}")), val(&format!("v{last}")));
    }
    assert_backups_never_ran(&r, &[1, 3]);
}

#[test]
fn spare_witness_replaces_a_lost_witness() {
    // P0 B1 W2, spare witness 3. Witness 2 dies for good (M23): no change is needed to make
    // progress, but a spare restores fault tolerance.
    let mut r = with_spares(Config::standard(1, 1), &[(3, Kind::Head)]);
    let p = r.wait_serving();
    assert_eq!(r.put(p, "a", "1"), Some(ClientReply::PutOk));
    r.crash(2);
    assert_eq!(
        r.put(p, "a", "2"),
        Some(ClientReply::PutOk),
        "writes never stall"
    );
    let done = r.run_until(5_000, |r| {
        let c = r.node(0).config();
        c.member(2).is_none() && c.is_voter(3)
    });
    assert!(done, "config {:?}", cfg_of(&r, 0));
    assert_eq!(r.node(3).key_stamp(b"a"), r.node(0).key_stamp(b"a"));
    // Fault tolerance is back: the primary dies and the replacement takes over.
    // The leader may die before witness 3 hears of its promotion: 3 still runs (late), adopts
    // backup 1's log with the promoting entry its refusal carries, and wins (etcd#10998).
    r.crash(0);
    let l = r.wait_serving();
    assert_eq!(l, 3);
    assert_eq!(r.get(l, "a"), val("2"));
}

#[test]
fn old_primary_rejoins_as_a_witness_without_values() {
    let mut r = Router::with_params(Config::standard(1, 1), lost_params()); // P0 B1 W2
    let p = r.wait_serving();
    assert_eq!(p, 0);
    assert_eq!(r.put(p, "a", "1"), Some(ClientReply::PutOk));
    assert!(r.node(0).local_value(b"a").is_some());
    r.isolate(0);
    assert!(r.run_until(2_000, |r| r.node(2).is_serving()));
    assert_eq!(r.put(2, "a", "2"), Some(ClientReply::PutOk));
    r.cut.clear();
    assert!(r.run_until(1_000, |r| r.node(0).leader_hint() == Some(2)));
    r.run_for(50);
    let old = r.node(0);
    assert_eq!(old.role(), RoleKind::Follower);
    assert_eq!(old.local_value(b"a"), None, "values dropped (M24)");
    assert_eq!(old.key_stamp(b"a"), r.node(2).key_stamp(b"a"), "keys kept");
    assert_eq!(old.counters.values_dropped_as_witness, 1);
    assert_eq!(r.get(2, "a"), val("2"));
}

#[test]
fn a_truncated_configuration_entry_is_undone() {
    // The primary appends a change that never commits (backup 1 holds its persists back and
    // then the primary is cut off); the witness that takes over never saw it, and the old
    // primary's conflicting suffix, the configuration entry included, is truncated.
    let mut r = Router::with_params(Config::standard(1, 1), lost_params()); // P0 B1 W2
    let p = r.wait_serving();
    assert_eq!(p, 0);
    assert_eq!(r.put(p, "a", "1"), Some(ClientReply::PutOk));
    r.cut.insert((0, 1));
    r.cut.insert((0, 2));
    assert_eq!(
        reconfigure(
            &mut r,
            0,
            Change::Add {
                id: 7,
                kind: Kind::Head
            }
        ),
        None
    );
    assert_eq!(cfg_of(&r, 0).epoch, 2, "in force once appended");
    r.isolate(0);
    assert!(r.run_until(2_000, |r| r.node(2).is_serving()));
    r.cut.clear();
    assert!(r.run_until(1_000, |r| r.node(0).leader_hint() == Some(2)
        && r.node(0).commit_index() == r.node(2).commit_index()));
    assert_eq!(cfg_of(&r, 0).epoch, 1, "the uncommitted change was undone");
    assert!(cfg_of(&r, 0).member(7).is_none());
}

// ---- log truncation and snapshots (M24, core/snapshot.rs) ----

const KEEP: usize = 16;

fn small_log_params() -> Params {
    Params {
        log_keep_entries: KEEP,
        ..lost_params()
    }
}

fn put_many(r: &mut Router, p: NodeId, n: usize) {
    for i in 0..n {
        assert_eq!(
            r.put(p, &format!("k{}", i % 10), &format!("v{i}")),
            Some(ClientReply::PutOk),
            "put {i}"
        );
    }
}

/// The newest value of each of the 10 keys after `put_many(n)`.
fn check_all(r: &mut Router, l: NodeId, n: usize) {
    for k in 0..10 {
        let last = (0..n).filter(|i| i % 10 == k).max().unwrap();
        assert_eq!(r.get(l, &format!("k{k}")), val(&format!("v{last}")), "k{k}");
    }
}

#[test]
fn long_run_keeps_every_head_log_and_its_nvmm_region_bounded() {
    let mut r = Router::with_params(Config::standard(1, 1), small_log_params()); // P0 B1 W2
    let p = r.wait_serving();
    put_many(&mut r, p, 400);
    r.run_for(50);
    for h in [0, 2] {
        let n = r.node(h);
        assert!(n.log_base_index() > 300, "head {h} never truncated");
        assert!(
            n.log_len() <= 2 * KEEP + 8,
            "head {h} holds {}",
            n.log_len()
        );
        // What its NVMM Log region still holds (the router applies every PmemFree).
        let live = r.pmem[&h].1.len();
        assert!(live <= 2 * KEEP + 8, "head {h} region holds {live} entries");
    }
    r.crash(0);
    let l = r.wait_serving();
    assert_eq!(l, 2);
    check_all(&mut r, l, 400);
}

#[test]
fn a_witness_behind_the_truncated_log_gets_a_snapshot() {
    let mut r = Router::with_params(Config::standard(1, 1), small_log_params()); // P0 B1 W2
    let p = r.wait_serving();
    put_many(&mut r, p, 20);
    r.isolate(2);
    // Witness 2 is lost past `member_lost_us`: it no longer holds the log back.
    r.run_for(LOST_US / MS + 50);
    put_many(&mut r, p, 200);
    assert!(r.node(0).log_base_index() > r.node(2).last_index());
    r.cut.clear();
    assert!(r.run_until(1_000, |r| r.node(2).counters.snapshots_installed == 1));
    assert!(r.run_until(200, |r| r.node(2).commit_index()
        == r.node(0).commit_index()));
    for k in 0..10 {
        let key = format!("k{k}").into_bytes();
        assert_eq!(r.node(2).key_stamp(&key), r.node(0).key_stamp(&key));
    }
    assert_eq!(r.node(0).counters.snapshots_sent, 1);
    r.crash(0);
    let l = r.wait_serving();
    assert_eq!(l, 2);
    check_all(&mut r, l, 200);
}

#[test]
fn a_head_restarted_from_a_truncated_log_stands_only_after_a_snapshot() {
    let mut r = Router::with_params(Config::standard(1, 1), small_log_params()); // P0 B1 W2
    let p = r.wait_serving();
    put_many(&mut r, p, 200);
    r.run_for(20);
    r.crash(2);
    r.restart(2);
    assert!(
        r.node(2).needs_snapshot(),
        "its NVMM log starts past index 1"
    );
    assert!(r.run_until(500, |r| !r.node(2).needs_snapshot()));
    assert_eq!(r.node(2).counters.snapshots_installed, 1);
    for k in 0..10 {
        let key = format!("k{k}").into_bytes();
        assert_eq!(r.node(2).key_stamp(&key), r.node(0).key_stamp(&key));
    }
    r.crash(0);
    let l = r.wait_serving();
    assert_eq!(l, 2);
    check_all(&mut r, l, 200);
}

#[test]
fn a_lost_substitute_leaves_and_writes_go_on() {
    // P0 B1 B2 W3 W4: backup 2 dies, witness 3 substitutes, then witness 3 dies too.
    let mut r = Router::with_params(Config::standard(2, 2), lost_params());
    let p = r.wait_serving();
    r.crash(2);
    assert!(r.run_until(1_000, |r| r.node(0).config().substitute == Some(3)));
    assert_eq!(r.put(p, "a", "1"), Some(ClientReply::PutOk));
    r.crash(3);
    let tag = r.submit(
        p,
        ClientReq::Put {
            key: b"a".to_vec(),
            value: b"2".to_vec(),
        },
    );
    assert!(r.run_until(1_000, |r| r.replies.contains_key(&tag)));
    assert_eq!(r.replies.remove(&tag), Some(ClientReply::PutOk));
    let c = cfg_of(&r, 0);
    assert!(c.member(3).is_none() && c.substitute.is_none(), "{c:?}");
    assert_eq!(c.commit_quorum(0), BTreeSet::from([0, 1]));
    // Backup 1 alone holds the values: the primary dies and witness 4 serves them.
    r.crash(0);
    let l = r.wait_serving();
    assert_eq!(l, 4);
    assert_eq!(r.get(l, "a"), val("2"));
}

// ---- operator requests (`kv reconfig`, core/operator.rs) ----

#[test]
fn an_operator_change_is_answered_once_committed_and_a_refusal_says_why() {
    let mut r = Router::with_params(Config::standard(1, 1), lost_params()); // P0 B1 W2
    let p = r.wait_serving();
    let add7 = ClientReq::Reconfigure(Change::Add {
        id: 7,
        kind: Kind::Head,
    });
    assert_eq!(
        r.call(2, add7.clone(), 10),
        Some(ClientReply::NotLeader { hint: Some(p) })
    );
    // Backup 1 holds its acks back: the entry cannot commit, so no answer yet, and a second
    // change meanwhile is told to come back.
    r.hold_persist.insert(1);
    let tag = r.submit(p, add7);
    r.run_for(30);
    assert!(!r.replies.contains_key(&tag), "answered before the entry committed");
    assert_eq!(
        r.call(p, ClientReq::Reconfigure(Change::Remove { id: 2 }), 5),
        Some(ClientReply::Unavailable)
    );
    r.hold_persist.clear();
    let held = std::mem::take(&mut r.held);
    for (n, seq) in held {
        r.feed(n, Input::PmemPersisted { seq });
    }
    assert!(r.run_until(500, |r| r.replies.contains_key(&tag)));
    match r.replies.remove(&tag) {
        Some(ClientReply::Reconfigured(c)) => {
            assert_eq!(c.member(7).map(|m| m.voting), Some(false));
            assert!(r.node(p).commit_index() > 0 && r.node(p).config() == &c);
        }
        other => panic!("{other:?}"),
    }
    let e = match r.call(p, ClientReq::Reconfigure(Change::Remove { id: p }), 10) {
        Some(ClientReply::Invalid(e)) => e,
        other => panic!("{other:?}"),
    };
    assert!(e.contains("cannot remove"), "{e}");
    // Any node tells its view.
    assert!(r.run_until(200, |r| r.node(2).config().member(7).is_some()));
    match r.call(2, ClientReq::Membership, 10) {
        Some(ClientReply::Membership {
            config,
            leader,
            serving,
        }) => {
            assert!(config.member(7).is_some());
            assert_eq!((leader, serving), (Some(p), false));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_operator_change_at_a_deposed_leader_is_indeterminate() {
    let mut r = Router::with_params(Config::standard(1, 1), lost_params()); // P0 B1 W2
    let p = r.wait_serving();
    assert_eq!(p, 0);
    r.isolate(0);
    let tag = r.submit(0, ClientReq::Reconfigure(Change::EndSubstitute));
    assert!(r.run_until(2_000, |r| r.serving() == Some(2)));
    r.cut.clear();
    assert!(r.run_until(500, |r| r.replies.contains_key(&tag)));
    assert_eq!(r.replies.remove(&tag), Some(ClientReply::Indeterminate));
}
