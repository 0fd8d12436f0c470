//! Arbitrary bytes, cut into length-prefixed pieces, each decoded as a peer request (postcard,
//! as inside a `wire` frame) and applied to one log peer core with a small region, and decoded
//! as a peer reply and fed to a client recovering a file. Nothing may panic; the peer never
//! uses more than its region; every frame header is parsed within the size limit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nearlog::core::file_client::{ClientConfig, FileClient, Input};
use nearlog::core::peer::PeerCore;
use nearlog::proto::{PeerReply, PeerRequest, MAX_FRAME_BYTES};

const REGION_BYTES: u64 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let mut peer = PeerCore::new(REGION_BYTES);
    let mut client = FileClient::open(1, 2, vec![1, 2, 3], true, Vec::new(), ClientConfig::default(), 0);
    let mut rest = data;
    while rest.len() >= 2 {
        let n = (u16::from_le_bytes([rest[0], rest[1]]) as usize).min(rest.len() - 2);
        let piece = &rest[2..2 + n];
        rest = &rest[2 + n..];
        if piece.len() >= wire::FRAME_HEADER_BYTES {
            if let Ok((len, _)) = wire::parse_header(piece[..wire::FRAME_HEADER_BYTES].try_into().unwrap(), MAX_FRAME_BYTES) {
                assert!(len <= MAX_FRAME_BYTES);
            }
        }
        if let Ok(req) = wire::decode_payload::<PeerRequest>(piece) {
            let _ = peer.reply_to(req);
            assert!(peer.used_bytes() <= REGION_BYTES, "peer exceeded its region");
        }
        if let Ok(rep) = wire::decode_payload::<PeerReply>(piece) {
            client.handle(Input::Reply { peer: 1 + (n % 3) as u32, reply: rep });
            client.handle(Input::Tick { now_us: n as u64 * 1000 });
            let _ = client.take_outputs();
        }
    }
});
