//! The shard's network input: arbitrary bytes through every decoder a shard connection uses
//! (frame header and checksum, `Hello`, `Msg`), then the same bytes as a script of well-formed
//! but hostile messages fed to a real shard core over the store on the simulator's disk.
//! Nothing may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volume::fuzzing::CoreHarness;
use volume::types::{Hello, Msg, ReplyBody};

fuzz_target!(|data: &[u8]| {
    let _ = wire::decode_frame::<Msg>(data, wire::MAX_FRAME_PAYLOAD_BYTES);
    let _ = wire::decode_frame::<Hello>(data, 1024);
    let _ = wire::decode_payload::<Msg>(data);
    let _ = wire::decode_payload::<Hello>(data);
    let _ = wire::decode_payload::<ReplyBody>(data);
    CoreHarness::run_script(data);
});
