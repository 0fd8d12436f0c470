//! Arbitrary bytes, cut into length-prefixed pieces, each decoded as a controller request and
//! applied to a controller core (in-memory store) that starts with peers and files. Nothing may
//! panic, and every file stays placed on distinct, known peers.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nearlog::core::controller::ControllerCore;
use nearlog::store::MemStore;
use nearlog::proto::CtlRequest;

fuzz_target!(|data: &[u8]| {
    let mut c = ControllerCore::open(MemStore::default()).unwrap();
    for i in 0..4 {
        c.reply_to(CtlRequest::RegisterPeer { addr: format!("p{i}"), region_bytes: 1 << 20, known_as: None });
    }
    c.reply_to(CtlRequest::Open { key: "/a.log".into(), replicas: 3 });
    let mut rest = data;
    while rest.len() >= 2 {
        let n = (u16::from_le_bytes([rest[0], rest[1]]) as usize).min(rest.len() - 2);
        let piece = &rest[2..2 + n];
        rest = &rest[2 + n..];
        if let Ok(req) = wire::decode_payload::<CtlRequest>(piece) {
            let _ = c.reply_to(req);
        }
    }
    for m in c.state().files.values() {
        let mut ps = m.peers.clone();
        ps.sort_unstable();
        ps.dedup();
        assert_eq!(ps.len(), m.peers.len(), "a file placed twice on one peer: {m:?}");
        assert!(m.peers.iter().all(|p| c.state().peers.contains_key(p)), "placed on an unknown peer: {m:?}");
    }
});
