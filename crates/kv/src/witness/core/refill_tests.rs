//! Unit tests of the value refill of a backup behind the truncated log (`core/refill.rs`), on
//! the in-test router of `core/tests.rs`.

use super::*;
use crate::witness::core::page;
use crate::witness::proto::Stamp;

/// Members lose a voting member after this long (≥ the election timeout, as validated).
const LOST_US: u64 = 300 * MS;
const KEEP: usize = 16;
/// Keys per refill chunk: small, so a transfer spans many messages and can be raced.
const CHUNK_KEYS: usize = 4;

fn refill_params() -> Params {
    Params {
        member_lost_us: LOST_US,
        log_keep_entries: KEEP,
        snapshot_chunk_keys: CHUNK_KEYS,
        ..params()
    }
}

/// Writes `rounds` versions of keys `r0..r{keys}` (`v{round}`), one key at a time.
fn put_rounds(r: &mut Router, p: NodeId, keys: usize, rounds: std::ops::Range<usize>) {
    for round in rounds {
        for k in 0..keys {
            assert_eq!(
                r.put(p, &format!("r{k}"), &format!("v{round}")),
                Some(ClientReply::PutOk),
                "r{k} round {round}"
            );
        }
    }
}

/// The value a backup's SSD holds for `key` (its indexed version), read back from its pages.
fn backup_value(r: &Router, b: NodeId, key: &[u8]) -> Option<(Stamp, Vec<u8>)> {
    let loc = r.node(b).backup_index_loc(key)?;
    let (off, len) = loc.page_span();
    let bytes = r.ssd[&b].read(loc.seg, off, len as u32).unwrap();
    let e = page::entry_at(loc, &bytes).expect("the indexed entry decodes");
    Some((e.stamp(), e.value()?.to_vec()))
}

/// Backup `b` holds, for every key of leader `l`'s table, exactly the leader's version.
fn assert_backup_matches(r: &Router, b: NodeId, l: NodeId, keys: &[String]) {
    for k in keys {
        let key = k.as_bytes();
        let (ls, lv) = r
            .node(l)
            .local_value(key)
            .expect("the leader holds the value");
        assert_eq!(
            r.node(l).key_stamp(key),
            Some(ls),
            "{k}: leader value current"
        );
        let got = backup_value(r, b, key);
        assert_eq!(got, Some((ls, lv.to_vec())), "{k} on backup {b}");
    }
}

fn keys(n: usize) -> Vec<String> {
    (0..n).map(|k| format!("r{k}")).collect()
}

/// Isolates backup `b` until the leader `p` no longer holds its log back, writes `rounds`
/// rounds over `n` keys meanwhile, then heals: the leader's log starts past the backup's.
fn fall_behind(r: &mut Router, p: NodeId, b: NodeId, n: usize, rounds: std::ops::Range<usize>) {
    r.isolate(b);
    r.run_for(LOST_US / MS + 50);
    put_rounds(r, p, n, rounds);
    assert!(
        r.node(p).log_base_index() > r.node(b).last_index(),
        "the leader's log (base {}) still reaches the backup's end ({})",
        r.node(p).log_base_index(),
        r.node(b).last_index()
    );
    r.cut.clear();
}

#[test]
fn a_backup_behind_the_truncated_log_is_refilled_then_promoted() {
    let mut r = Router::with_params(Config::standard(1, 1), refill_params()); // P0 B1 W2
    let p = r.wait_serving();
    put_rounds(&mut r, p, 10, 0..2);
    // Keys r10..r29 are first written while backup 1 is away: only the refill brings them.
    fall_behind(&mut r, p, 1, 30, 2..8);
    assert!(r.run_until(2_000, |r| r.node(1).counters.refills_installed == 1));
    assert_eq!(r.node(0).counters.refills_sent, 1);
    assert!(r.run_until(500, |r| r.node(1).commit_index()
        == r.node(0).commit_index()));
    assert_backup_matches(&r, 1, 0, &keys(30));
    // Caught up, it votes again and the substitute steps back (M22/M23).
    assert!(r.run_until(2_000, |r| {
        let c = r.node(0).config();
        c.substitute.is_none() && c.member(1).is_some_and(|m| m.voting)
    }));
    // Log shipping goes on from the refill's index: a new version reaches its SSD.
    assert_eq!(r.put(p, "r3", "after"), Some(ClientReply::PutOk));
    assert!(r.run_until(500, |r| backup_value(r, 1, b"r3")
        .is_some_and(|(_, v)| v == b"after")));
    r.crash(0);
    let l = r.wait_serving();
    assert_eq!(l, 2);
    assert_eq!(r.get(l, "r3"), val("after"));
    for k in 10..30 {
        assert_eq!(r.get(l, &format!("r{k}")), val("v7"), "r{k}");
    }
}

#[test]
fn writes_racing_a_refill_win_over_the_refilled_versions() {
    let mut r = Router::with_params(Config::standard(1, 1), refill_params()); // P0 B1 W2
    let p = r.wait_serving();
    fall_behind(&mut r, p, 1, 40, 0..3);
    // Once a few chunks are durable on the backup, overwrite keys already sent (r0, r1),
    // keys not sent yet (r38, r39) and add a new key, while the transfer runs.
    assert!(r.run_until(2_000, |r| r
        .node(1)
        .refill_receiving()
        .is_some_and(|(_, n)| n >= 2 * CHUNK_KEYS as u64)));
    assert_eq!(
        r.node(1).counters.refills_installed,
        0,
        "the transfer is under way"
    );
    let racing = [
        ("r0", "race0"),
        ("r1", "race1"),
        ("r38", "race38"),
        ("r39", "race39"),
        ("new", "n"),
    ];
    let tags: Vec<u64> = racing
        .iter()
        .map(|(k, v)| {
            r.submit(
                p,
                ClientReq::Put {
                    key: k.as_bytes().to_vec(),
                    value: v.as_bytes().to_vec(),
                },
            )
        })
        .collect();
    assert!(r.run_until(500, |r| tags.iter().all(|t| r.replies.contains_key(t))));
    assert_eq!(
        r.node(1).counters.refills_installed,
        0,
        "the racing writes committed before the transfer ended (make it longer)"
    );
    for t in tags {
        assert_eq!(r.replies.remove(&t), Some(ClientReply::PutOk));
    }
    assert!(r.run_until(2_000, |r| r.node(1).counters.refills_installed == 1));
    assert!(r.run_until(500, |r| r.node(1).commit_index()
        == r.node(0).commit_index()
        && r.node(1).written_back_through() == r.node(0).commit_index()));
    let mut all = keys(40);
    all.push("new".into());
    assert_backup_matches(&r, 1, 0, &all);
    for (k, v) in racing {
        assert_eq!(
            backup_value(&r, 1, k.as_bytes()).unwrap().1,
            v.as_bytes(),
            "{k}"
        );
    }
}

#[test]
fn a_backup_crashed_mid_refill_restarts_at_its_old_log_and_is_refilled_again() {
    let mut r = Router::with_params(Config::standard(1, 1), refill_params()); // P0 B1 W2
    let p = r.wait_serving();
    put_rounds(&mut r, p, 10, 0..1);
    let old_last = r.node(1).last_index();
    fall_behind(&mut r, p, 1, 40, 1..4);
    assert!(r.run_until(2_000, |r| r
        .node(1)
        .refill_receiving()
        .is_some_and(|(_, n)| n >= 2 * CHUNK_KEYS as u64)));
    r.crash(1);
    r.restart(1);
    // The refill versions on its SSD are indexed but never pass for log it holds.
    assert!(
        r.node(1).last_index() <= old_last,
        "restarted at {} past its old log end {old_last}",
        r.node(1).last_index()
    );
    assert!(r.node(1).backup_index_stamp(b"r0").is_some());
    assert!(r.run_until(3_000, |r| r.node(1).counters.refills_installed == 1));
    // The restarted backup knows no refill: it asks for key 0 and the leader's transfer (of
    // the same index) starts over from there.
    assert_eq!(r.node(0).counters.refills_sent, 1);
    assert!(r.run_until(500, |r| r.node(1).commit_index()
        == r.node(0).commit_index()));
    assert_backup_matches(&r, 1, 0, &keys(40));
    // A restart after the refill (its buffer now starts past its SSD log) keeps its place.
    assert_eq!(r.put(p, "r5", "after"), Some(ClientReply::PutOk));
    r.run_for(5);
    let (commit, wb) = (r.node(1).commit_index(), r.node(1).written_back_through());
    r.crash(1);
    r.restart(1);
    assert!(
        r.node(1).last_index() >= wb,
        "restart lost its place ({wb} written back)"
    );
    assert!(r.run_until(1_000, |r| r.node(1).commit_index() >= commit
        && r.node(1).written_back_through() == r.node(0).commit_index()));
    assert_eq!(
        r.node(1).counters.refills_installed,
        0,
        "no second refill was needed"
    );
    assert_backup_matches(&r, 1, 0, &keys(40));
}

#[test]
fn a_leader_crashed_mid_refill_is_replaced_and_the_new_leader_refills() {
    // P0 B1 W2 W3: witness 2 substitutes for backup 1; with 3 voting heads, witness 2 can be
    // elected once the primary dies mid-refill.
    let mut r = Router::with_params(Config::standard(1, 2), refill_params());
    let p = r.wait_serving();
    assert_eq!(p, 0);
    put_rounds(&mut r, p, 10, 0..1);
    fall_behind(&mut r, p, 1, 40, 1..4);
    assert!(r.run_until(2_000, |r| r
        .node(1)
        .refill_receiving()
        .is_some_and(|(_, n)| n >= 2 * CHUNK_KEYS as u64)));
    r.crash(0);
    let l = r.wait_serving();
    assert_ne!(l, 0);
    // The new leader recovers its values, then refills the backup with its own copy.
    assert!(r.run_until(5_000, |r| r.node(1).counters.refills_installed == 1));
    assert!(r.node(l).counters.refills_sent >= 1);
    assert!(r.run_until(1_000, |r| r.node(1).commit_index()
        == r.node(l).commit_index()));
    for k in 0..40 {
        assert_eq!(r.get(l, &format!("r{k}")), val("v3"), "r{k}");
    }
    assert_backup_matches(&r, 1, l, &keys(40));
}
