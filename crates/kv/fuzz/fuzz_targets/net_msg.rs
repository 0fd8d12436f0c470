//! A node's network input: arbitrary bytes through the frame decoder (header, checksum, size
//! limit) and the `NetMsg` payload decoders (plain, and a connection's in-place one); whatever
//! decodes is delivered to a real node core, a member of a 3-node group, as a peer message
//! from each other node or as a client request.
//! Nothing may panic.
#![no_main]

use kv::leaderless::proto::{Config, Heartbeat, Model};
use kv::leaderless::core::node::{NodeCore, NodeInput, NodeParams};
use kv::leaderless::driver::{NetMsg, MAX_FRAME_BYTES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let framed = wire::decode_frame::<NetMsg>(data, MAX_FRAME_BYTES).ok();
    let raw = wire::decode_payload::<NetMsg>(data).ok();
    // As a node's connection decodes a payload (a catch-up chunk taken in place).
    let in_place = kv::leaderless::driver::decode_net_payload(&mut data.to_vec()).ok();
    for m in [framed, raw, in_place].into_iter().flatten() {
        let mut n = NodeCore::new(NodeParams::new(0, Model::Synch), Default::default());
        n.handle(0, NodeInput::Heartbeat(Heartbeat { seq: 1, config: Config::genesis(3), lease_ref: 0 }));
        let lease_ref = n.last_lease_ref();
        n.handle(0, NodeInput::Heartbeat(Heartbeat { seq: 2, config: Config::genesis(3), lease_ref }));
        let _ = n.take_outputs();
        match m {
            NetMsg::Peer(p) => {
                for from in [1, 2, 7] {
                    n.handle(10, NodeInput::Peer { from, msg: p.clone() });
                    let _ = n.take_outputs();
                }
            }
            NetMsg::Req { op, .. } => n.handle(10, NodeInput::Client { tag: 1, op }),
            NetMsg::Hb(hb) => n.handle(10, NodeInput::Heartbeat(hb)),
            NetMsg::Hello(_) | NetMsg::HbAck(_) | NetMsg::Resp { .. } => {}
        }
        n.handle(1_000_000, NodeInput::Tick);
        let _ = n.take_outputs();
    }
});
