//! A node's persistent-memory log as it may be found after a crash or corruption: arbitrary
//! bytes through the whole-image decoder, the streaming reader and the marker scan; the records
//! that survive rebuild a state a node core then starts on. Nothing may panic.
#![no_main]

use kv::log;
use kv::msg::Model;
use kv::node::{NodeCore, NodeParams};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (recs, valid) = log::decode_all(data);
    assert!(valid <= data.len());
    let mut streamed = Vec::new();
    let n = log::stream_records(data, |r, _| streamed.push(r)).expect("reading from memory");
    assert_eq!(n as usize, valid);
    assert_eq!(streamed, recs);
    let _ = log::scan_markers(data);
    let st = log::rebuild(&recs);
    let mut core = NodeCore::new(NodeParams::new(0, Model::Synch), st);
    core.tick(1_000_000);
    let _ = core.take_outputs();
});
