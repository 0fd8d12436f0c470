//! Bad input: random and mutated bytes fed to the log reader and the network decoder never
//! panic, and a node core fed malformed client requests answers with an error and changes
//! nothing.

use kv::log::{self, LogRecord};
use kv::msg::*;
use kv::node::{NodeCore, NodeParams, Output};
use kv::runtime::NetMsg;
use proptest::prelude::*;

proptest! {
    #[test]
    fn log_reader_survives_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
        let (recs, valid) = log::decode_all(&bytes);
        prop_assert!(valid <= bytes.len());
        let _ = log::rebuild(&recs);
    }

    #[test]
    fn log_reader_keeps_the_valid_prefix(cut in 0usize..200, flip in 0usize..200) {
        let recs = [
            LogRecord::Boot { node: 1 },
            LogRecord::Put { key: b"a".to_vec(), ts: Ts { version: 1, node: 1 }, value: vec![7; 50] },
            LogRecord::Mark { key: b"a".to_vec(), ts: Ts { version: 1, node: 1 } },
        ];
        let mut bytes: Vec<u8> = recs.iter().flat_map(log::encode).collect();
        let n = bytes.len();
        bytes.truncate(n - cut.min(n));
        if !bytes.is_empty() {
            let i = flip % bytes.len();
            bytes[i] ^= 0x5a;
        }
        let (got, _) = log::decode_all(&bytes);
        // Whatever survives is a prefix of what was written.
        prop_assert!(got.len() <= recs.len());
        prop_assert_eq!(&recs[..got.len()], &got[..]);
    }

    #[test]
    fn net_decoder_survives_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = wire::decode_payload::<NetMsg>(&bytes);
    }
}

#[test]
fn malformed_client_requests_are_refused_without_effect() {
    let mut n = NodeCore::new(NodeParams::new(0, Model::Synch), Default::default());
    n.on_heartbeat(
        0,
        Heartbeat {
            seq: 1,
            config: Config::genesis(1),
        },
    );
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
        n.on_client(1, tag, op);
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
    n.on_heartbeat(
        0,
        Heartbeat {
            seq: 1,
            config: Config::genesis(2),
        },
    );
    let _ = n.take_outputs();
    n.on_peer(
        1,
        1,
        PeerMsg::Inv {
            epoch: 7,
            key: b"k".to_vec(),
            ts: Ts {
                version: 1,
                node: 1,
            },
            value: b"v".to_vec(),
        },
    );
    assert!(n.take_outputs().is_empty());
    assert_eq!(n.counters.refused_epoch, 1);
    assert_eq!(n.keys(), 0);
}
