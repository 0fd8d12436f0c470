//! Property tests that throw arbitrary bytes at a live server over TCP: during the handshake,
//! as options after a valid greeting, and as requests after a valid GO. After every case the
//! server must have closed or finished the bad connection, and a well-behaved client must
//! still be served correctly.

mod common;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use blockdev::MemDev;
use common::*;
use nbd::proto::*;
use nbd::{ServerConfig, SingleExport};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const DEV_SIZE_BYTES: u64 = 1 << 20;
/// How long a fuzzed connection may take to be closed by the server after the client's EOF.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);

fn server() -> &'static TestServer {
    static SERVER: OnceLock<TestServer> = OnceLock::new();
    SERVER.get_or_init(|| {
        let dev = Arc::new(MemDev::new(DEV_SIZE_BYTES));
        // Small limits so that fuzzed lengths reach them.
        let config = ServerConfig {
            max_request_bytes: 64 << 10,
            max_discard_payload_bytes: 128 << 10,
            max_option_bytes: 8 << 10,
            max_in_flight_requests_per_connection: 8,
            max_in_flight_bytes_per_connection: 128 << 10,
            handshake_timeout_ms: 10_000,
            ..Default::default()
        };
        TestServer::start_with(SingleExport::new("vol", dev), config)
    })
}

#[derive(Debug, Clone)]
enum Prefix {
    /// Nothing: the fuzzed bytes are the client's first bytes.
    None,
    /// Greeting read and valid client flags sent: the fuzzed bytes are options.
    Greeted,
    /// NBD_OPT_GO done: the fuzzed bytes are transmission requests.
    Transmission,
}

/// A request whose header is well-formed but whose fields are arbitrary.
fn request_bytes() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<u16>().prop_map(|f| f & 0x1f),
        0u16..9,
        prop_oneof![Just(0u64), 0..DEV_SIZE_BYTES + 10, any::<u64>()],
        prop_oneof![0u32..5000, 60_000u32..140_000, any::<u32>()],
        proptest::collection::vec(any::<u8>(), 0..6000),
        any::<bool>(),
    )
        .prop_map(|(flags, kind, offset, length, payload, with_payload)| {
            let mut out = encode_request_header(&RequestHeader {
                flags,
                kind,
                cookie: 1,
                offset,
                length,
            })
            .to_vec();
            if with_payload {
                out.extend_from_slice(&payload);
            }
            out
        })
}

/// An option with a valid magic but arbitrary number and data.
fn option_bytes() -> impl Strategy<Value = Vec<u8>> {
    (
        0u32..12,
        proptest::collection::vec(any::<u8>(), 0..64),
        prop_oneof![Just(None), Just(Some(20_000u32))],
    )
        .prop_map(|(option, data, claimed_len)| {
            let len = claimed_len.unwrap_or(data.len() as u32);
            let mut out = encode_option_header(&OptionHeader {
                option,
                length_bytes: len,
            })
            .to_vec();
            out.extend_from_slice(&data);
            out
        })
}

fn fuzz_case() -> impl Strategy<Value = (Prefix, Vec<u8>)> {
    let raw = proptest::collection::vec(any::<u8>(), 0..512);
    prop_oneof![
        raw.clone().prop_map(|b| (Prefix::None, b)),
        raw.clone().prop_map(|b| (Prefix::Greeted, b)),
        raw.prop_map(|b| (Prefix::Transmission, b)),
        proptest::collection::vec(option_bytes(), 1..8).prop_map(|v| (Prefix::Greeted, v.concat())),
        proptest::collection::vec(request_bytes(), 1..12)
            .prop_map(|v| (Prefix::Transmission, v.concat())),
    ]
}

async fn run_case(prefix: Prefix, bytes: Vec<u8>) -> Result<(), String> {
    let addr = server().addr;
    let mut s = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    match prefix {
        Prefix::None => {}
        Prefix::Greeted => {
            greet(&mut s, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES)
                .await
                .map_err(|e| e.to_string())?;
        }
        Prefix::Transmission => {
            greet(&mut s, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES)
                .await
                .map_err(|e| e.to_string())?;
            send_option(&mut s, NBD_OPT_EXPORT_NAME, b"vol")
                .await
                .map_err(|e| e.to_string())?;
            let mut reply = [0u8; 10];
            s.read_exact(&mut reply).await.map_err(|e| e.to_string())?;
        }
    }
    let (mut rd, mut wr) = s.into_split();
    // Drain whatever the server says while we write, so neither side blocks the other.
    let drain = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    });
    let _ = wr.write_all(&bytes).await; // the server may already have closed
    let _ = wr.shutdown().await;
    tokio::time::timeout(CLOSE_TIMEOUT, drain)
        .await
        .map_err(|_| format!("server did not close a fuzzed connection within {CLOSE_TIMEOUT:?}"))?
        .map_err(|e| e.to_string())?;

    // A well-behaved client is still served, and correctly.
    let mut c = Client::connect(addr, "vol").await?;
    let offset = 4096 * (bytes.len() as u64 % 200);
    let data: Vec<u8> = (0..4096u32)
        .map(|i| (i as u8) ^ (bytes.len() as u8))
        .collect();
    if c.write(offset, &data).await != 0 {
        return Err("good client's write failed".into());
    }
    if c.read(offset, 4096).await != Ok(data) {
        return Err("good client read back wrong data".into());
    }
    c.disconnect().await;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn live_server_survives_arbitrary_bytes((prefix, bytes) in fuzz_case()) {
        let result = server().runtime.block_on(run_case(prefix, bytes));
        prop_assert!(result.is_ok(), "{}", result.unwrap_err());
    }
}
