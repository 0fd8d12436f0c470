//! Feeds arbitrary bytes to the NBD parsers: `parse_request_header` + `plan_request` on every
//! 28-byte window, and the handshake parsers on the whole input. None may panic, and a planned
//! READ/WRITE must be within the device and the request limit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nbd::proto::*;

const LIMITS: RequestLimits = RequestLimits {
    max_request_bytes: 32 << 20,
    max_discard_payload_bytes: 64 << 20,
};

fuzz_target!(|data: &[u8]| {
    let export_size_bytes = 1u64 << 30;
    for window in data
        .windows(REQUEST_HEADER_BYTES)
        .step_by(REQUEST_HEADER_BYTES)
    {
        if let Ok(header) = parse_request_header(window) {
            if let RequestPlan::Execute(
                Command::Read {
                    offset,
                    length_bytes,
                }
                | Command::Write {
                    offset,
                    length_bytes,
                    ..
                },
            ) = plan_request(&header, export_size_bytes, &LIMITS)
            {
                assert!(length_bytes <= LIMITS.max_request_bytes);
                assert!(offset + length_bytes as u64 <= export_size_bytes);
            }
        }
    }
    let _ = parse_client_flags(data);
    let _ = parse_option_header(data);
    let _ = parse_info_request(data);
    let _ = parse_export_name(data);
});
