//! The recovery policy (`node/recovery.rs`): the Φ-accrual timeouts, popularity and the
//! popular-keys-first BatchPull, the BatchPull pacing, and how each `--recovery` scheme
//! differs from `cand`.

use super::*;
use crate::witness::core::node::{Recovery, RecoveryStats, HOT_CURSOR};
use crate::witness::proto::{Entry, PeerBody};

/// Values big enough that the backup's log spans several BatchPulls of 16 KiB.
const VALUE_PAD_BYTES: usize = 1000;

fn value(i: usize) -> String {
    format!("v{i}-{}", "x".repeat(VALUE_PAD_BYTES))
}

fn key(i: usize) -> String {
    format!("k{i:02}")
}

/// Deterministic popularity (nothing sampled) unless a test turns it on.
fn with(rec: Recovery) -> Params {
    Params {
        recovery: rec,
        popularity_sample_probability: 0.0,
        ..params()
    }
}

/// Starts a primary + backup + witness group and writes `n` keys, written back to SSD.
fn loaded(p: Params, n: usize) -> Router {
    let mut r = Router::with_params(Config::standard(1, 1), p); // P=0, B=1, W=2
    let p = r.wait_serving();
    assert_eq!(p, 0);
    for i in 0..n {
        assert_eq!(r.put(p, &key(i), &value(i)), Some(ClientReply::PutOk));
    }
    r.run_for(60);
    assert!(r.node(1).written_back_through() >= n as u64, "written back");
    r
}

/// A PriorityPull or popular-keys BatchPull scans only the buffer slots not yet written
/// back, not the whole recent-index window (before, each pull cost O(window) on the backup's
/// one task): with the window full of written-back slots, the scan is empty.
#[test]
fn pulls_scan_only_the_unwritten_buffer() {
    let n = 40;
    let mut r = loaded(with(Recovery::Cand), n);
    let b = r.node(1);
    assert!(b.written_back_through() >= n as u64);
    assert_eq!(b.pull_scan_slots(), 0, "every written-back slot is skipped");
    // A new version (maybe not written back yet: the linger holds it) adds at most itself.
    assert_eq!(r.put(0, &key(3), "fresh"), Some(ClientReply::PutOk));
    assert!(r.node(1).pull_scan_slots() <= 1, "only the unwritten tail is scanned");
    // Versions that are only in the buffer are still what a pull finds (the failover tests
    // check the values end to end): nothing written back is lost from the scan.
    r.run_for(60);
    assert_eq!(r.node(1).pull_scan_slots(), 0);
}

fn stats_of(r: &Router, id: NodeId) -> RecoveryStats {
    r.stats.iter().find(|(i, _)| *i == id).unwrap().1.clone()
}

#[test]
fn recovery_scheme_names_round_trip() {
    for s in Recovery::ALL {
        assert_eq!(s.name().parse::<Recovery>(), Ok(s));
        assert_eq!(s.to_string(), s.name());
    }
    assert!("fast".parse::<Recovery>().is_err());
}

/// The silence after which a witness fed heartbeats `gaps_ms` apart (repeated for 2 s)
/// stands for election.
fn election_after_silence_ms(gaps_ms: &[u64], p: Params) -> u64 {
    let mut c = WitnessCore::new(2, Config::standard(1, 1), p, 0).unwrap();
    let mut now = 0u64;
    let pump = |c: &mut WitnessCore, now: u64, input: Input| {
        let mut inputs = vec![input];
        while let Some(i) = inputs.pop() {
            c.handle(now, i);
            for o in c.take_outputs() {
                if let Output::PmemAppend { seq, .. } = o {
                    inputs.push(Input::PmemPersisted { seq });
                }
            }
        }
    };
    let heartbeat = |sent_us: u64| Input::Peer {
        from: 0,
        msg: PeerMsg {
            term: 1,
            epoch: 1,
            body: PeerBody::AppendEntries {
                leader: 0,
                prev_index: 0,
                prev_term: 0,
                entries: vec![],
                commit: 0,
                sent_us,
            },
        },
    };
    let mut last = 0;
    for gap in gaps_ms.iter().cycle() {
        if now > 2_000 * MS {
            break;
        }
        for _ in 0..*gap {
            now += MS;
            pump(&mut c, now, Input::Tick);
        }
        pump(&mut c, now, heartbeat(now));
        last = now;
        assert_eq!(c.role(), RoleKind::Follower, "elected while heard at {now}");
    }
    while c.role() == RoleKind::Follower {
        now += MS;
        assert!(now < last + 5_000 * MS, "never stood for election");
        pump(&mut c, now, Input::Tick);
    }
    (now - last) / MS
}

#[test]
fn phi_detector_waits_longer_for_a_jittery_leader_within_the_ceiling() {
    // Steady 5 ms heartbeats: Φ is huge at the floor, so the floor (150 ms + this witness's
    // rank jitter of 20–31 ms) decides, as with the fixed timeout.
    let steady = election_after_silence_ms(&[5], params());
    assert!((150..=185).contains(&steady), "steady: {steady} ms");
    // Gaps of 5 and 120 ms (mean 62, sd 57): a 150 ms silence is not unusual for this leader;
    // Φ reaches 8 only at about 360 ms.
    let jittery = election_after_silence_ms(&[5, 120], params());
    assert!((250..450).contains(&jittery), "jittery: {jittery} ms");
    // A threshold Φ never reaches: the ceiling (3 × 150 ms) still replaces the leader.
    let p = Params {
        phi_hard: 1e9,
        ..params()
    };
    let capped = election_after_silence_ms(&[5, 120], p);
    assert!((450..=452).contains(&capped), "ceiling: {capped} ms");
}

#[test]
fn no_proactive_pulls_nothing_before_the_election_and_cand_does() {
    for (scheme, want) in [(Recovery::Cand, 1), (Recovery::NoProactive, 0)] {
        let mut r = loaded(with(scheme), 20);
        // Silent past the soft timeout, short of the hard one.
        r.isolate(0);
        r.run_for(60);
        assert_eq!(r.node(2).counters.proactive_started, want, "{scheme}");
        r.cut.clear();
        r.run_for(20);
        assert_eq!(r.node(2).counters.proactive_aborted, want, "{scheme}");
        assert!(r.node(0).is_serving(), "{scheme}: nobody else was elected");
    }
}

/// Feeds `backup` a BatchPull from node 2 (a stream of this test's own) and returns its
/// reply's entries and next cursor.
fn batch_pull(r: &mut Router, backup: NodeId, cursor: u64) -> (Vec<Entry>, u64) {
    const STREAM: u64 = 999_999;
    let term = r.node(backup).term();
    let body = PeerBody::BatchPull {
        stream: STREAM,
        cursor,
    };
    let msg = PeerMsg {
        term,
        epoch: 1,
        body,
    };
    r.feed(backup, Input::Peer { from: 2, msg });
    for _ in 0..20 {
        for (to, input) in std::mem::take(&mut r.later) {
            if let Input::Peer { msg, .. } = &input {
                if let PeerBody::BatchPullReply {
                    stream: STREAM,
                    entries,
                    next_cursor,
                    ..
                } = &msg.body
                {
                    return (entries.clone(), *next_cursor);
                }
            }
            if to == backup {
                r.feed(to, input); // its SSD reads
            } else {
                r.later.push_back((to, input));
            }
        }
    }
    panic!("no BatchPull reply");
}

fn keys_of(entries: &[Entry]) -> Vec<String> {
    entries
        .iter()
        .filter_map(|e| e.key().map(|k| String::from_utf8_lossy(k).into_owned()))
        .collect()
}

#[test]
fn primary_ships_popularity_and_the_backup_answers_popular_keys_first() {
    let p = Params {
        popularity_sample_probability: 1.0,
        popularity_ship_interval_us: 50 * MS,
        ..with(Recovery::Cand)
    };
    let mut r = loaded(p, 40);
    for _ in 0..20 {
        assert_eq!(r.get(0, &key(37)), val(&value(37)));
    }
    for _ in 0..5 {
        assert_eq!(r.get(0, &key(21)), val(&value(21)));
    }
    r.run_for(120);
    assert!(r.node(0).recovery_counters().popularity_shipped >= 1);
    assert!(r.node(1).recovery_counters().popularity_received >= 1);
    let hot = r.node(1).popular_keys(2);
    assert_eq!(hot, vec![key(37).into_bytes(), key(21).into_bytes()]);
    // The popular-keys phase: both hot keys in the first reply, the cursor still in the phase.
    let (entries, next) = batch_pull(&mut r, 1, HOT_CURSOR);
    let ks = keys_of(&entries);
    assert!(
        ks.contains(&key(37)) && ks.contains(&key(21)),
        "hot reply: {ks:?}"
    );
    assert_ne!(next & HOT_CURSOR, 0);
    // Past the list (every key was sampled at its Put, so all 40 are on it, the rest after
    // the two hot ones): the log scan follows in the same request.
    let mut cursor = next;
    let mut last = entries;
    for _ in 0..10 {
        if cursor & HOT_CURSOR == 0 {
            break;
        }
        (last, cursor) = batch_pull(&mut r, 1, cursor);
    }
    assert_eq!(cursor & HOT_CURSOR, 0, "the popular list ends in the log scan");
    assert_eq!(keys_of(&last).first(), Some(&key(0)), "from the log's start");
    // The log scan itself is in log order: k00 first, k37 not in the first 16 KiB.
    let (entries, _) = batch_pull(&mut r, 1, 0);
    let ks = keys_of(&entries);
    assert_eq!(ks.first(), Some(&key(0)));
    assert!(!ks.contains(&key(37)), "log order: {ks:?}");
}

/// After the primary fails, with BatchPull paced slowly: which of the hot and a cold key the
/// new primary holds when it starts serving.
fn holds_when_serving(scheme: Recovery) -> (bool, bool, RecoveryStats) {
    let p = Params {
        popularity_sample_probability: 1.0,
        popularity_ship_interval_us: 50 * MS,
        batch_pull_bytes_per_s: 32 << 10,
        priority_pull_target_us: 0,
        ..with(scheme)
    };
    let mut r = loaded(p, 40);
    for _ in 0..20 {
        assert_eq!(r.get(0, &key(37)), val(&value(37)));
    }
    r.run_for(120);
    r.crash(0);
    let w = r.wait_serving();
    assert_eq!(w, 2);
    let hot = r.node(w).local_value(key(37).as_bytes()).is_some();
    // k00 is the first in log order and the last of the popular list (sampled once, at its
    // Put, the longest ago).
    let cold = r.node(w).local_value(key(0).as_bytes()).is_some();
    assert!(r.run_until(5_000, |r| r.recovered.contains(&2)), "{scheme}");
    (hot, cold, stats_of(&r, 2))
}

#[test]
fn cand_holds_the_hot_key_at_the_election_and_no_sampling_pulls_in_log_order() {
    let (hot, cold, st) = holds_when_serving(Recovery::Cand);
    assert!(hot && !cold, "cand: hot {hot} cold {cold} {st:?}");
    assert!(st.proactive_installed > 0);
    let (hot, cold, st) = holds_when_serving(Recovery::NoSampling);
    assert!(
        !hot && cold,
        "no-sampling starts at the log's start: {st:?}"
    );
}

#[test]
fn batch_pull_is_paced_and_priority_pulls_still_answer_at_once() {
    let run = |rate: u64| {
        let p = Params {
            batch_pull_bytes_per_s: rate,
            priority_pull_target_us: 0,
            ..with(Recovery::NoProactive)
        };
        let mut r = loaded(p, 40);
        r.crash(0);
        let w = r.wait_serving();
        // A Get of a key the stream reaches last is answered by a PriorityPull meanwhile.
        let t0 = r.now;
        assert_eq!(r.get(w, &key(39)), val(&value(39)));
        let get_ms = (r.now - t0) / MS;
        assert!(r.run_until(10_000, |r| r.recovered.contains(&2)));
        let st = stats_of(&r, 2);
        let paced = r.node(2).recovery_counters().batch_pulls_paced;
        ((st.finished_us - st.started_us) / MS, get_ms, paced)
    };
    let (fast_ms, fast_get_ms, fast_paced) = run(0);
    let (slow_ms, slow_get_ms, slow_paced) = run(32 << 10);
    assert_eq!(fast_paced, 0);
    assert!(slow_paced > 0);
    // ~45 KiB at 32 KiB/s after a first 16 KiB: about a second, against a few ms.
    assert!(fast_ms < 200, "unpaced copy took {fast_ms} ms");
    assert!(slow_ms >= 600, "paced copy took {slow_ms} ms");
    assert!(
        fast_get_ms <= 20 && slow_get_ms <= 20,
        "{fast_get_ms} {slow_get_ms}"
    );
}

#[test]
fn offline_serves_nothing_until_the_copy_is_done() {
    // Against live recovery without the proactive pull (cand's would leave little missing).
    for scheme in [Recovery::NoProactive, Recovery::Offline] {
        let mut r = loaded(with(scheme), 40);
        r.crash(0);
        let w = r.wait_serving();
        assert!(r.node(w).in_recovery(), "{scheme}");
        let tag = r.submit(
            w,
            ClientReq::Get {
                key: key(39).into_bytes(),
            },
        );
        if scheme == Recovery::Offline {
            assert_eq!(r.replies.remove(&tag), Some(ClientReply::Unavailable));
            assert_eq!(r.node(2).counters.proactive_started, 0);
        } else {
            assert!(r.run_until(50, |r| r.replies.contains_key(&tag)));
            assert_eq!(r.replies.remove(&tag), val(&value(39)), "{scheme}");
        }
        assert!(r.run_until(5_000, |r| r.recovered.contains(&2)));
        assert_eq!(
            r.get(w, &key(39)),
            val(&value(39)),
            "{scheme} after the copy"
        );
        let st = stats_of(&r, 2);
        if scheme == Recovery::Offline {
            assert_eq!(st.priority_pulls, 0, "{st:?}");
        }
    }
}

#[test]
fn batch_only_waits_for_the_stream_instead_of_a_priority_pull() {
    for scheme in [Recovery::NoProactive, Recovery::BatchOnly] {
        let p = Params {
            batch_pull_bytes_per_s: 32 << 10,
            priority_pull_target_us: 0,
            soft_timeout_us: 0,
            ..with(scheme)
        };
        let mut r = loaded(p, 40);
        r.crash(0);
        let w = r.wait_serving();
        let tag = r.submit(
            w,
            ClientReq::Get {
                key: key(39).into_bytes(),
            },
        );
        let quick = r.run_until(50, |r| r.replies.contains_key(&tag));
        assert_eq!(quick, scheme != Recovery::BatchOnly, "{scheme}");
        assert!(r.run_until(5_000, |r| r.replies.contains_key(&tag)));
        assert_eq!(r.replies.remove(&tag), val(&value(39)), "{scheme}");
        assert!(r.run_until(5_000, |r| r.recovered.contains(&2)));
        let st = stats_of(&r, 2);
        assert_eq!(
            st.priority_pulls == 0,
            scheme == Recovery::BatchOnly,
            "{st:?}"
        );
    }
}

#[test]
fn full_replica_witness_holds_every_value_and_recovers_at_once() {
    for scheme in [Recovery::NoProactive, Recovery::FullReplica] {
        let mut r = loaded(with(scheme), 20);
        let held = r
            .node(2)
            .local_value(key(5).as_bytes())
            .map(|(_, v)| v.to_vec());
        let full = scheme == Recovery::FullReplica;
        assert_eq!(held, full.then(|| value(5).into_bytes()), "{scheme}");
        r.crash(0);
        r.wait_serving();
        assert!(r.run_until(5_000, |r| r.recovered.contains(&2)));
        let st = stats_of(&r, 2);
        assert_eq!(st.missing_at_start == 0, full, "{scheme}: {st:?}");
        for i in 0..20 {
            assert_eq!(r.get(2, &key(i)), val(&value(i)), "{scheme}");
        }
    }
}
