//! The server bounds the bytes it holds for incomplete requests across all connections: clients
//! that send the header of a large WRITE and part of its payload, then stall, do not grow the
//! server's memory beyond the budget, and a stalled one is cut off so a good client is served.
//!
//! One test in this file: it reads the resident size of its own process (the server runs
//! in-process on its own runtime), which other tests in the same binary would disturb.

mod common;

use std::time::{Duration, Instant};

use blockdev::MemDev;
use common::*;
use nbd::proto::*;
use nbd::{ServerConfig, SingleExport};
use tokio::io::AsyncWriteExt;

/// Connections each stalling inside a WRITE's payload.
const STALLED: usize = 8;
/// Each sends the header of a write of this size...
const WRITE_BYTES: u32 = 32 << 20;
/// ...and this much of its payload.
const SENT_BYTES: usize = 24 << 20;

fn vm_rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let l = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[test]
fn stalled_partial_writes_do_not_grow_memory_past_the_budget() {
    let config = ServerConfig { request_payload_timeout_ms: 1_000, ..ServerConfig::default() };
    let budget = config.max_incomplete_request_bytes as u64;
    let server = TestServer::start_with(SingleExport::new("d", std::sync::Arc::new(MemDev::new(64 << 20))), config);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let addr = server.addr;
    rt.block_on(async move {
        // A warm-up request so that the runtime's own buffers are in the baseline.
        let mut c = Client::connect(addr, "d").await.unwrap();
        assert_eq!(c.write(0, &[7u8; 4096]).await, 0);
        let base = vm_rss_bytes();

        let payload = std::sync::Arc::new(vec![0x5au8; SENT_BYTES]);
        let mut sends = Vec::new();
        for _ in 0..STALLED {
            let mut s = Client::connect(addr, "d").await.unwrap();
            let payload = payload.clone();
            // The header, then part of the payload (a server applying backpressure leaves it in
            // the socket's buffers: the write then times out, which is fine).
            sends.push(tokio::spawn(async move {
                let h = RequestHeader { flags: 0, kind: NBD_CMD_WRITE, cookie: 1, offset: 0, length: WRITE_BYTES };
                s.stream.write_all(&encode_request_header(&h)).await.unwrap();
                let _ = tokio::time::timeout(Duration::from_secs(2), s.stream.write_all(&payload)).await;
                s
            }));
        }
        let mut stalled = Vec::new();
        for t in sends {
            stalled.push(t.await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let grown = vm_rss_bytes().saturating_sub(base);
        // Without a bound it grows by STALLED x SENT_BYTES (192 MiB); allow the budget, one more
        // request's worth and slack for buffers and the allocator.
        let bound = budget + (WRITE_BYTES as u64) + (32 << 20);
        assert!(
            grown < bound,
            "the server's RSS grew by {} MiB with {STALLED} stalled partial writes (bound {} MiB)",
            grown >> 20,
            bound >> 20
        );
        // A good client is served while the stalled ones are still connected: the stalled
        // connections are cut off after the payload timeout and their budget freed.
        let t0 = Instant::now();
        let errno = tokio::time::timeout(Duration::from_secs(20), c.write(4096, &[9u8; 4096])).await.expect("a good client's write was not served");
        assert_eq!(errno, 0);
        assert_eq!(c.read(4096, 4096).await.unwrap(), vec![9u8; 4096]);
        eprintln!("good write served after {:?}; RSS grew {} MiB (bound {} MiB)", t0.elapsed(), grown >> 20, bound >> 20);
        drop(stalled);
    });
}
