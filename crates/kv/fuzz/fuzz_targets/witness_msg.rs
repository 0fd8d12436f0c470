//! A witness-KV node's network input: arbitrary bytes through the frame, `NetMsg`, peer and
//! client decoders; whatever decodes is delivered to a real primary + backup + witness group
//! (`kv::witness::fuzzing`) from every member and a stranger. Nothing may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kv::witness::fuzzing::run_bytes(data));
