//! Bad input for the witness KV: random bytes and real messages with bytes changed go through
//! every decoder a node runs, and whatever decodes is delivered to a real primary + backup +
//! witness group from every member and a stranger (`kv::witness::fuzzing`, the same body as the
//! cargo-fuzz target `witness_msg`). Nothing may panic, every core checks its invariants after
//! every input, and the group still serves afterwards.

use kv::witness::driver::NetMsg;
use kv::witness::fuzzing::{decode_all, run_bytes, Group};
use kv::witness::proto::{self, ClientReply, ClientReq, Entry, Op, PeerBody, PeerMsg};
use proptest::prelude::*;

/// Real messages of every kind a node sends, as seeds for mutation.
fn samples() -> Vec<Vec<u8>> {
    let e = |index: u64| Entry {
        term: 1,
        index,
        op: Op::Put {
            key: b"k".to_vec(),
            value: Some(vec![7; 40].into()),
        },
    };
    let bodies = vec![
        PeerBody::AppendEntries {
            leader: 0,
            prev_index: 0,
            prev_term: 0,
            entries: vec![e(1), e(2)],
            commit: 1,
            sent_us: 5,
        },
        PeerBody::AppendAck {
            success: true,
            match_index: 2,
            sent_us: 5,
            durable: 2,
            want_snapshot: false,
        },
        PeerBody::RequestVote {
            candidate: 2,
            last_index: 2,
            last_term: 1,
        },
        PeerBody::Vote {
            granted: true,
            last_index: 2,
            last_term: 1,
            in_lease: false,
            config: None,
        },
        PeerBody::Snapshot {
            last_index: 2,
            last_term: 1,
            config: kv::witness::core::config::Config::standard(1, 1),
            offset: 0,
            keys: vec![(serde_bytes::ByteBuf::from(b"k".to_vec()), kv::witness::proto::Stamp { term: 1, index: 1 })],
            done: true,
        },
        PeerBody::SnapshotAck { last_index: 2, next_offset: 1, installed: true },
        PeerBody::Refill {
            last_index: 2,
            last_term: 1,
            config: kv::witness::core::config::Config::standard(1, 1),
            offset: 0,
            entries: vec![e(1)],
            done: true,
        },
        PeerBody::RefillAck { last_index: 2, next_offset: 1, installed: true },
        PeerBody::RequestLog { index: 1 },
        PeerBody::LogReply {
            index: 1,
            entry: Some(e(1)),
            gone: false,
        },
        PeerBody::BatchPull {
            stream: 1,
            cursor: 0,
        },
        PeerBody::BatchPullReply {
            stream: 1,
            entries: vec![e(1)],
            next_cursor: 4096,
            done: false,
        },
        PeerBody::BatchPullAbort { stream: 1 },
        PeerBody::PriorityPull {
            id: 1,
            key: serde_bytes::ByteBuf::from(b"k".to_vec()),
        },
        PeerBody::PriorityPullReply {
            id: 1,
            entries: vec![e(1)],
        },
        PeerBody::Popularity {
            keys: vec![(serde_bytes::ByteBuf::from(b"k".to_vec()), 3)],
        },
    ];
    let mut out: Vec<Vec<u8>> = bodies
        .into_iter()
        .flat_map(|body| {
            let m = PeerMsg {
                term: 1,
                epoch: 1,
                body,
            };
            [proto::encode(&m), proto::encode(&NetMsg::Peer(m))]
        })
        .collect();
    out.push(proto::encode(&ClientReq::Put {
        key: b"k".to_vec(),
        value: b"v".to_vec(),
    }));
    out.push(proto::encode(&NetMsg::Req {
        id: 1,
        req: ClientReq::Get { key: b"k".to_vec() },
    }));
    // Membership requests (`kv reconfig`): a change, and a view any node answers.
    out.push(proto::encode(&NetMsg::Req {
        id: 2,
        req: ClientReq::Reconfigure(kv::witness::core::config::Change::Add {
            id: 7,
            kind: kv::witness::core::config::Kind::Head,
        }),
    }));
    out.push(proto::encode(&NetMsg::Req {
        id: 3,
        req: ClientReq::Membership,
    }));
    // The status request and its reply (issue 25 item 10): the reply's strings and counters
    // are the longest client reply a node sends without a value.
    out.push(proto::encode(&NetMsg::Req {
        id: 2,
        req: ClientReq::Status,
    }));
    // As a client reads it: a NetMsg (what `decode_all` tries), mutated by the test below.
    out.push(proto::encode(&NetMsg::Resp { id: 2, reply: ClientReply::Status(Box::new(proto::StatusReport {
        id: 2,
        kind: "head".into(),
        role: "leader".into(),
        term: 3,
        leader: Some(2),
        keys: 7,
        tiers: proto::TierReport {
            nvmm_key_table_bytes: 1 << 20,
            ssd_allocated_bytes: 1 << 30,
            ..Default::default()
        },
        rss_bytes: 1 << 25,
        ..Default::default()
    })) }));
    out
}

/// A status reply survives the trip, and its decoder refuses what is not one.
#[test]
fn a_status_reply_round_trips_and_garbage_is_an_error() {
    let s = proto::StatusReport {
        id: 1,
        kind: "backup".into(),
        role: "follower".into(),
        written_back_through: 9,
        ..Default::default()
    };
    let bytes = proto::encode(&ClientReply::Status(Box::new(s.clone())));
    assert_eq!(
        proto::decode_client_reply(&bytes).unwrap(),
        ClientReply::Status(Box::new(s))
    );
    for cut in 1..bytes.len() {
        // A truncated reply is an error, never a panic (it may decode as a shorter message).
        let _ = proto::decode_client_reply(&bytes[..cut]);
    }
    assert!(proto::decode_client_reply(&[0xff; 8]).is_err());
}

#[test]
fn every_sample_decodes() {
    // The mutation test below is only worth something if its seeds reach the cores.
    for s in samples() {
        assert!(!decode_all(&s).is_empty(), "{s:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        run_bytes(&bytes);
    }

    #[test]
    fn mutated_messages_never_panic(which in any::<prop::sample::Index>(), at in any::<prop::sample::Index>(), xor in 1u8.., cut in 0usize..8) {
        let all = samples();
        let mut m = all[which.index(all.len())].clone();
        let i = at.index(m.len());
        m[i] ^= xor;
        m.truncate(m.len() - cut.min(m.len() / 2));
        run_bytes(&m);
    }
}

/// Hostile but well-formed messages from a stranger and from members in a later term: the group
/// may change leader but still serves a put and reads it back.
#[test]
fn the_group_serves_after_hostile_messages() {
    let mut g = Group::new();
    for s in samples() {
        for m in decode_all(&s) {
            if let NetMsg::Peer(p) = m {
                for to in g.ids() {
                    g.peer(to, 99, p.clone());
                    let mut later = p.clone();
                    later.term += 3;
                    g.peer(to, 2, later);
                }
            }
        }
    }
    let mut leader = None;
    for _ in 0..2_000 {
        g.tick(1_000);
        leader = g.leader();
        if leader.is_some() {
            break;
        }
    }
    let leader = leader.expect("no leader 2 s after the hostile messages");
    let put = g.client(
        leader,
        ClientReq::Put {
            key: b"after".to_vec(),
            value: b"ok".to_vec(),
        },
    );
    for _ in 0..200 {
        g.tick(1_000);
    }
    assert_eq!(
        g.reply(put),
        Some(&ClientReply::PutOk),
        "the put after the hostile messages"
    );
    let get = g.client(
        leader,
        ClientReq::Get {
            key: b"after".to_vec(),
        },
    );
    for _ in 0..200 {
        g.tick(1_000);
    }
    assert_eq!(
        g.reply(get),
        Some(&ClientReply::Value(Some(serde_bytes::ByteBuf::from(
            b"ok".to_vec()
        ))))
    );
}

/// Found by `mutated_messages_never_panic` (an AppendEntries whose entry at a committed index
/// had another term made the follower assert "conflicts at committed index" and crash): such a
/// message is refused and counted, the follower's log keeps the committed entry, and the group
/// serves on.
#[test]
fn an_append_rewriting_a_committed_index_is_refused() {
    let mut g = Group::new();
    let leader = g.leader().unwrap();
    let follower = g
        .ids()
        .into_iter()
        .find(|&i| i != leader && g.node(i).commit_index() >= 1)
        .expect("a follower knows index 1 committed");
    let before = g.node(follower).counters().refused_peer_msgs;
    let term = g.node(leader).term();
    let forged = Entry {
        term: term + 1,
        index: 1,
        op: Op::Put {
            key: b"k".to_vec(),
            value: Some(b"forged".to_vec().into()),
        },
    };
    let msg = PeerMsg {
        term: term + 1,
        epoch: 1,
        body: PeerBody::AppendEntries {
            leader,
            prev_index: 0,
            prev_term: 0,
            entries: vec![forged],
            commit: 1,
            sent_us: 0,
        },
    };
    g.peer(follower, leader, msg);
    assert_eq!(g.node(follower).counters().refused_peer_msgs, before + 1);
    assert_eq!(
        g.node(follower).term(),
        term,
        "a refused message changes nothing, not even the term"
    );
    let get = g.client(leader, ClientReq::Get { key: b"k".to_vec() });
    for _ in 0..50 {
        g.tick(1_000);
    }
    assert_eq!(
        g.reply(get),
        Some(&ClientReply::Value(Some(serde_bytes::ByteBuf::from(
            b"v".to_vec()
        ))))
    );
}
