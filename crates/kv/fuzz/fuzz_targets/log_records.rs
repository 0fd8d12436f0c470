//! A node's persistent-memory log as it may be found after a crash or corruption: arbitrary
//! bytes through the whole-image decoder, the streaming reader and the marker scan; the records
//! that survive rebuild a state a node core then starts on. Nothing may panic.
#![no_main]

use kv::pmlog;
use kv::leaderless::proto::Model;
use kv::leaderless::core::node::{NodeCore, NodeInput, NodeParams};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (recs, valid) = pmlog::decode_all(data);
    assert!(valid <= data.len());
    let mut streamed = Vec::new();
    let n = pmlog::stream_records(data, |r, _| streamed.push(r)).expect("reading from memory");
    assert_eq!(n as usize, valid);
    assert_eq!(streamed, recs);
    let _ = pmlog::scan_markers(data);
    let st = pmlog::rebuild(&recs);
    let mut core = NodeCore::new(NodeParams::new(0, Model::Synch), st);
    core.handle(1_000_000, NodeInput::Tick);
    let _ = core.take_outputs();
});
