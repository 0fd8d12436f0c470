//! The metadata service's network input: arbitrary bytes through every decoder its connections
//! use (frame, `Hello`, control requests, a shard link's `Msg`, and the client side's replies),
//! and well-formed hostile requests through the wire round trip. Nothing may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volume::fuzzing::Bytes;
use volume::driver::meta::{MetaReq, MetaResp};
use volume::types::{Hello, Msg};

fuzz_target!(|data: &[u8]| {
    let _ = wire::decode_frame::<MetaReq>(data, wire::MAX_FRAME_PAYLOAD_BYTES);
    let _ = wire::decode_frame::<Hello>(data, 1024);
    let _ = wire::decode_payload::<MetaReq>(data);
    let _ = wire::decode_payload::<MetaResp>(data);
    let _ = wire::decode_payload::<Msg>(data);
    let mut b = Bytes::new(data);
    while !b.is_empty() {
        let req = b.meta_req();
        let frame = wire::encode_frame(&req).expect("every request encodes");
        let back: MetaReq = wire::decode_frame(&frame, wire::MAX_FRAME_PAYLOAD_BYTES).expect("an encoded request decodes");
        assert_eq!(back, req, "wire round trip");
    }
});
