//! Hostile input on the wire, against a real running cluster (in-process services, real sockets,
//! real files): random, truncated, oversized and corrupt frames, and well-formed but hostile
//! messages, sent to the metadata service and to every shard, before and after authenticating.
//! Each must get an error reply or a closed connection, never a crash, and a well-behaved client
//! keeps being served throughout (checked after every case, on every object of its volume).
//! Also the same hostile message scripts against the sans-I/O shard core directly (what the
//! cargo-fuzz target `shard_msg` runs).
//!
//! Cases: `PROPTEST_CASES` (default 40 for the live cluster, 10x that for the core).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use blockdev::BlockDev;
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use volume::driver::client::{Cluster, Volume};
use volume::fuzzing::{Bytes, CoreHarness};
use volume::driver::meta::{MetaReq, MetaResp};
use volume::core::shard::request_id;
use volume::types::{Hello, Msg};

const SECRET: &[u8] = b"bad-frames-secret";
const GOOD_VOLUME_BYTES: u64 = 1 << 20;
const OBJECT_BYTES: u32 = 65536;
/// How long a server may take to answer or close; the shard's handshake limit is 5 s.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(8);

static PANICS: AtomicUsize = AtomicUsize::new(0);

fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// What a case sends.
#[derive(Debug, Clone)]
enum Attack {
    /// Bytes instead of the handshake.
    Stranger(Vec<u8>),
    /// After a valid handshake: a byte stream instead of frames.
    Garbage(Vec<u8>),
    /// A valid frame of these bytes with its checksum broken.
    BadChecksum(Vec<u8>),
    /// A frame header announcing more than the limit.
    Oversized(u32),
    /// A hostile message's frame cut short, then the connection half-closed.
    Truncated(Vec<u8>, usize),
    /// Well-formed hostile messages (made from these bytes), each expecting its reply.
    Hostile(Vec<u8>),
}

fn attack() -> impl Strategy<Value = Attack> {
    let bytes = proptest::collection::vec(any::<u8>(), 0..600);
    prop_oneof![
        bytes.clone().prop_map(Attack::Stranger),
        bytes.clone().prop_map(Attack::Garbage),
        bytes.clone().prop_map(Attack::BadChecksum),
        (wire::MAX_FRAME_PAYLOAD_BYTES as u32 + 1..=u32::MAX).prop_map(Attack::Oversized),
        (bytes.clone(), any::<usize>()).prop_map(|(b, cut)| Attack::Truncated(b, cut)),
        bytes.clone().prop_map(Attack::Hostile),
        bytes.prop_map(Attack::Hostile),
    ]
}

/// Reads until the server closes the connection (or resets it); fails on a timeout. Returns the
/// bytes it sent before closing.
async fn until_closed(s: &mut TcpStream) -> Result<Vec<u8>, String> {
    let mut got = vec![];
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(ANSWER_TIMEOUT, s.read(&mut buf)).await {
            Err(_) => return Err(format!("the server neither answered nor closed within {ANSWER_TIMEOUT:?}")),
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

async fn authed(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    wire::auth::connect(&mut s, SECRET).await.unwrap();
    wire::write_msg(&mut s, &Hello::Client).await.unwrap();
    s
}

/// Sends one attack to the service at `addr` (`to_meta`: the metadata service, else a shard)
/// and checks the answer: replies that decode, then a close — or, for hostile messages, one
/// well-formed reply per request.
async fn run_attack(addr: &str, to_meta: bool, attack: &Attack) -> Result<(), String> {
    match attack {
        Attack::Stranger(bytes) => {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let _ = s.write_all(bytes).await;
            let _ = s.shutdown().await;
            until_closed(&mut s).await?;
        }
        Attack::Garbage(bytes) => {
            let mut s = authed(addr).await;
            let _ = s.write_all(bytes).await;
            let _ = s.shutdown().await;
            until_closed(&mut s).await?;
        }
        Attack::BadChecksum(bytes) => {
            let mut s = authed(addr).await;
            let mut frame = (bytes.len() as u32).to_le_bytes().to_vec();
            frame.extend_from_slice(&(crc32c::crc32c(bytes) ^ 1).to_le_bytes());
            frame.extend_from_slice(bytes);
            let _ = s.write_all(&frame).await;
            // No shutdown: the server must close on its own.
            let answer = until_closed(&mut s).await?;
            if !answer.is_empty() {
                return Err(format!("a frame with a bad checksum was answered ({} bytes)", answer.len()));
            }
        }
        Attack::Oversized(len) => {
            let mut s = authed(addr).await;
            let mut header = len.to_le_bytes().to_vec();
            header.extend_from_slice(&[0; 4]);
            let _ = s.write_all(&header).await;
            let answer = until_closed(&mut s).await?;
            if !answer.is_empty() {
                return Err("an oversized frame was answered".into());
            }
        }
        Attack::Truncated(bytes, cut) => {
            let mut b = Bytes::new(bytes);
            let frame = if to_meta { wire::encode_frame(&b.meta_req()) } else { wire::encode_frame(&b.msg(&[])) }.unwrap();
            let mut s = authed(addr).await;
            let _ = s.write_all(&frame[..cut % frame.len()]).await;
            let _ = s.shutdown().await;
            let answer = until_closed(&mut s).await?;
            if !answer.is_empty() {
                return Err("a truncated frame was answered".into());
            }
        }
        Attack::Hostile(bytes) => {
            let mut b = Bytes::new(bytes);
            let mut s = authed(addr).await;
            for _ in 0..6 {
                if b.is_empty() {
                    break;
                }
                if to_meta {
                    let req = b.meta_req();
                    wire::write_msg(&mut s, &req).await.unwrap();
                    let resp: MetaResp = tokio::time::timeout(Duration::from_secs(60), wire::read_msg(&mut s, wire::MAX_FRAME_PAYLOAD_BYTES))
                        .await
                        .map_err(|_| format!("no answer to {req:?}"))?
                        .map_err(|e| format!("{req:?}: {e}"))?;
                    let _ = resp;
                } else {
                    let msg = b.msg(&[]);
                    wire::write_msg(&mut s, &msg).await.unwrap();
                    let Some(req) = request_id(&msg) else { continue };
                    let reply: Msg = tokio::time::timeout(ANSWER_TIMEOUT, wire::read_msg(&mut s, wire::MAX_FRAME_PAYLOAD_BYTES))
                        .await
                        .map_err(|_| format!("no reply to {msg:?}"))?
                        .map_err(|e| format!("{msg:?}: {e}"))?;
                    match reply {
                        Msg::Reply { req: r, .. } if r == req => {}
                        other => return Err(format!("{msg:?} was answered with {other:?}")),
                    }
                }
            }
        }
    }
    Ok(())
}

/// The well-behaved client: writes a fresh pattern to every object of its volume and reads it
/// back.
async fn still_served(c: &Arc<Cluster>, v: &Volume, round: u8) -> Result<(), String> {
    let check = async {
        for objno in 0..GOOD_VOLUME_BYTES / OBJECT_BYTES as u64 {
            let off = objno * OBJECT_BYTES as u64 + (round as u64 % 16) * 4096;
            let data = vec![round | 1; 4096];
            v.write(off, data.clone()).await.map_err(|e| format!("good write: {e}"))?;
            let got = v.read(off, 4096).await.map_err(|e| format!("good read: {e}"))?;
            if got != data {
                return Err(format!("object {objno} reads back other bytes"));
            }
        }
        match c.meta(MetaReq::Info { name: "good-volume".into() }).await {
            Ok(MetaResp::Volume(_)) => Ok(()),
            other => Err(format!("metadata service: {other:?}")),
        }
    };
    tokio::time::timeout(Duration::from_secs(60), check).await.map_err(|_| "the good client was not served within 60 s".to_string())?
}

#[test]
fn hostile_frames_get_an_error_or_a_close_and_others_keep_being_served() {
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        prev(info);
    }));
    let dir = std::env::temp_dir().join(format!("understudy-bad-frames-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (c, v, meta_addr, shard_addrs) = rt.block_on(async {
        let c = volume::testkit::start_in_process(&dir, 3, SECRET).await.unwrap();
        // Volumes the hostile ids (mostly 0..3) may hit, so the good volume's id is past them.
        for i in 0..4 {
            c.meta(MetaReq::Create { name: format!("decoy-{i}"), size_bytes: 1 << 20, object_size_bytes: OBJECT_BYTES }).await.unwrap();
        }
        c.meta(MetaReq::Create { name: "good-volume".into(), size_bytes: GOOD_VOLUME_BYTES, object_size_bytes: OBJECT_BYTES }).await.unwrap();
        let v = c.open("good-volume").await.unwrap();
        assert!(v.record().vol.id > 4);
        // Every shard's address, from the metadata service's map.
        let shards: Vec<String> = match c.meta(MetaReq::GetMap).await.unwrap() {
            MetaResp::Map(m) => m.shards.iter().map(|s| s.addr.clone()).collect(),
            other => panic!("GetMap answered {other:?}"),
        };
        assert_eq!(shards.len(), 3, "{shards:?}");
        (c.clone(), v, c.meta_addr().to_string(), shards)
    });
    let round = AtomicUsize::new(0);
    let config = ProptestConfig { cases: cases(40), failure_persistence: None, ..ProptestConfig::default() };
    proptest!(config, |(target in 0..4usize, attack in attack())| {
        let round = round.fetch_add(1, Ordering::SeqCst) as u8;
        let (addr, to_meta) = if target == 0 { (meta_addr.clone(), true) } else { (shard_addrs[target - 1].clone(), false) };
        let r = rt.block_on(async {
            run_attack(&addr, to_meta, &attack).await?;
            still_served(&c, &v, round).await
        });
        prop_assert!(r.is_ok(), "{} {:?}: {}", if to_meta { "metadata service" } else { "shard" }, attack, r.unwrap_err());
        prop_assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a server task panicked");
    });
    drop(rt);
    let _ = std::fs::remove_dir_all(&dir);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(40) * 10, failure_persistence: None, ..ProptestConfig::default() })]

    /// The fuzz target's scripts against the sans-I/O shard core (over the store on the simulator's disk):
    /// no panic, and every message survives the wire round trip exactly.
    #[test]
    fn hostile_message_scripts_never_panic_the_shard_core(bytes in proptest::collection::vec(any::<u8>(), 0..2000)) {
        CoreHarness::run_script(&bytes);
    }

    /// Arbitrary bytes through every decoder of the volume protocol: an error, never a panic.
    #[test]
    fn arbitrary_bytes_never_panic_a_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let _ = wire::decode_frame::<Msg>(&bytes, wire::MAX_FRAME_PAYLOAD_BYTES);
        let _ = wire::decode_payload::<Msg>(&bytes);
        let _ = wire::decode_payload::<Hello>(&bytes);
        let _ = wire::decode_payload::<MetaReq>(&bytes);
        let _ = wire::decode_payload::<MetaResp>(&bytes);
    }
}
