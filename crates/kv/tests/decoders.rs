//! Bad input: random and mutated bytes fed to the log reader and the network decoder never
//! panic, and a node core fed malformed client requests answers with an error and changes
//! nothing.

use kv::leaderless::core::node::{NodeCore, NodeInput, NodeParams, Output};
use kv::leaderless::driver::NetMsg;
use kv::leaderless::proto::*;
use kv::pmlog::{self, LogRecord};
use proptest::prelude::*;

proptest! {
    #[test]
    fn log_reader_survives_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
        let (recs, valid) = pmlog::decode_all(&bytes);
        prop_assert!(valid <= bytes.len());
        let _ = pmlog::rebuild(&recs);
    }

    #[test]
    fn log_reader_keeps_the_valid_prefix(cut in 0usize..200, flip in 0usize..200) {
        let recs = [
            LogRecord::Boot { node: 1 },
            LogRecord::Put { key: b"a".to_vec(), ts: Ts { version: 1, node: 1 }, value: vec![7; 50] },
            LogRecord::Mark { key: b"a".to_vec(), ts: Ts { version: 1, node: 1 } },
        ];
        let mut bytes: Vec<u8> = recs.iter().flat_map(pmlog::encode).collect();
        let n = bytes.len();
        bytes.truncate(n - cut.min(n));
        if !bytes.is_empty() {
            let i = flip % bytes.len();
            bytes[i] ^= 0x5a;
        }
        let (got, _) = pmlog::decode_all(&bytes);
        // Whatever survives is a prefix of what was written.
        prop_assert!(got.len() <= recs.len());
        prop_assert_eq!(&recs[..got.len()], &got[..]);
    }

    #[test]
    fn net_decoder_survives_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = wire::decode_payload::<NetMsg>(&bytes);
    }

    /// A node's connections decode catch-up chunks without copying them out of the frame;
    /// on any input, on inputs that start like a chunk, and on real chunks with a byte
    /// changed and their end cut, that path agrees with the plain decoder.
    #[test]
    fn chunk_decoder_agrees_with_the_plain_one(
        bytes in proptest::collection::vec(any::<u8>(), 0..2048),
        kind in 0u8..3,
        at in any::<usize>(),
        xor in any::<u8>(),
        cut in 0usize..64,
    ) {
        let bytes = match kind {
            0 => bytes,
            1 => {
                let mut v = postcard::to_stdvec(&catchup_resp(1, Chunk::default())).unwrap();
                v.truncate(2);
                v.extend_from_slice(&bytes);
                v
            }
            _ => {
                let mut v = postcard::to_stdvec(&catchup_resp(1, sample_chunk())).unwrap();
                let i = at % v.len();
                v[i] ^= xor;
                v.truncate(v.len() - cut.min(v.len()));
                v
            }
        };
        let plain = wire::decode_payload::<NetMsg>(&bytes);
        let taken = kv::leaderless::driver::decode_net_payload(&mut bytes.clone());
        prop_assert_eq!(format!("{plain:?}"), format!("{taken:?}"));
    }
}

fn catchup_resp(stream: u64, entries: Chunk) -> NetMsg {
    NetMsg::Peer(PeerMsg::CatchUpResp {
        epoch: 7,
        stream,
        from: Cursor::Key(Some(b"user12".to_vec())),
        next: Some(Cursor::Key(Some(b"user99".to_vec()))),
        full_copy: true,
        entries,
    })
}

fn sample_chunk() -> Chunk {
    let entries: Vec<Entry> = (0..50u64)
        .map(|i| Entry {
            key: format!("user{i}").into_bytes(),
            ts: Ts {
                version: i + 1,
                node: 2,
            },
            value: vec![i as u8; 100 + i as usize],
            committed: i % 3 != 0,
        })
        .collect();
    Chunk::from_entries(&entries)
}

/// A catch-up chunk decoded in place of its frame is the message that was sent: every field,
/// every entry, and the frame's buffer is taken (not copied) as the chunk's.
#[test]
fn a_chunk_is_decoded_in_its_frame() {
    for chunk in [sample_chunk(), Chunk::default()] {
        let sent = catchup_resp(3, chunk.clone());
        let mut frame = postcard::to_stdvec(&sent).unwrap();
        // The entries are the frame's last bytes: in place, they end where the frame does.
        let frame_end = frame.as_ptr().wrapping_add(frame.len());
        let got = kv::leaderless::driver::decode_net_payload(&mut frame).unwrap();
        assert!(frame.is_empty(), "the buffer went to the chunk");
        assert_eq!(format!("{got:?}"), format!("{sent:?}"));
        let NetMsg::Peer(PeerMsg::CatchUpResp {
            entries: got_chunk, ..
        }) = got
        else {
            panic!("not a chunk: {got:?}");
        };
        assert_eq!(got_chunk.to_entries(), chunk.to_entries());
        assert_eq!(
            got_chunk.bytes().as_ptr_range().end,
            frame_end,
            "entries read in place"
        );
    }
    // Any other message leaves the buffer for the next frame.
    let mut frame = postcard::to_stdvec(&NetMsg::Peer(PeerMsg::RecovEnd { epoch: 4 })).unwrap();
    let got = kv::leaderless::driver::decode_net_payload(&mut frame).unwrap();
    assert!(matches!(got, NetMsg::Peer(PeerMsg::RecovEnd { epoch: 4 })));
    assert!(!frame.is_empty());
}

#[test]
fn malformed_client_requests_are_refused_without_effect() {
    let mut n = NodeCore::new(NodeParams::new(0, Model::Synch), Default::default());
    // Twice: the second heartbeat echoes the first's ack, which anchors the lease.
    for seq in 1..=2 {
        n.handle(
            0,
            NodeInput::Heartbeat(Heartbeat {
                seq,
                config: Config::genesis(1),
                lease_ref: n.last_lease_ref(),
            }),
        );
    }
    let _ = n.take_outputs();
    for (tag, op) in [
        (
            1,
            ClientOp::Put {
                key: vec![],
                value: b"x".to_vec(),
                scope: None,
            },
        ),
        (
            2,
            ClientOp::Put {
                key: vec![b'k'; MAX_KEY_BYTES + 1],
                value: b"x".to_vec(),
                scope: None,
            },
        ),
        (
            3,
            ClientOp::Put {
                key: b"k".to_vec(),
                value: vec![0; MAX_VALUE_BYTES + 1],
                scope: None,
            },
        ),
        (4, ClientOp::Get { key: vec![] }),
    ] {
        n.handle(1, NodeInput::Client { tag, op });
        let outs = n.take_outputs();
        assert!(
            matches!(
                outs.as_slice(),
                [Output::Reply {
                    result: ClientResult::Invalid(_),
                    ..
                }]
            ),
            "request {tag}: {outs:?}"
        );
    }
    assert_eq!(n.keys(), 0);
}

#[test]
fn messages_of_another_epoch_are_refused() {
    let mut n = NodeCore::new(NodeParams::new(0, Model::Synch), Default::default());
    // Twice: the second heartbeat echoes the first's ack, which anchors the lease.
    for seq in 1..=2 {
        n.handle(
            0,
            NodeInput::Heartbeat(Heartbeat {
                seq,
                config: Config::genesis(2),
                lease_ref: n.last_lease_ref(),
            }),
        );
    }
    let _ = n.take_outputs();
    n.handle(
        1,
        NodeInput::Peer {
            from: 1,
            msg: PeerMsg::Inv {
                epoch: 7,
                key: b"k".to_vec(),
                ts: Ts {
                    version: 1,
                    node: 1,
                },
                value: b"v".to_vec(),
            },
        },
    );
    assert!(n.take_outputs().is_empty());
    assert_eq!(n.counters.refused_epoch, 1);
    assert_eq!(n.keys(), 0);
}
