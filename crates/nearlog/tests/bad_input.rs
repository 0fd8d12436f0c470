//! Bad input against real running daemons (the tokio peer and controller on loopback):
//!
//! - `garbage_frames_are_refused_and_other_clients_keep_being_served` (proptest): random bytes,
//!   frames with a bad checksum, oversized length headers, well-framed garbage and truncated
//!   frames sent to a peer and to the controller after a correct handshake: a complete bad
//!   frame closes that connection, and a well-behaved client on another connection is
//!   answered after every case.
//! - `a_misbehaving_peer_is_detected_and_ignored`: a file written to three real peers is
//!   recovered with one of them replaced by a fake peer that answers garbage bytes, claims a
//!   more advanced copy and serves truncated or corrupt data, or answers with stale epochs;
//!   recovery returns exactly the written content from the two honest peers, and writes go on.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nearlog::driver::blocking;
use nearlog::core::file_client::{ClientConfig, FileClient};
use nearlog::core::controller::ControllerCore;
use nearlog::store::MemStore;
use nearlog::driver::mover::Driver;
use nearlog::proto::{CtlReply, CtlRequest, FileGrant, Holding, Op, PeerAddr, PeerReply, PeerRequest, MAX_FRAME_BYTES};
use proptest::prelude::*;

const SECRET: &[u8] = b"bad-input-test-secret";

struct Daemons {
    rt: tokio::runtime::Runtime,
    controller: String,
    peers: Vec<String>,
}

fn bind(rt: &tokio::runtime::Runtime) -> (tokio::net::TcpListener, String) {
    let l = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let a = l.local_addr().unwrap().to_string();
    (l, a)
}

fn start(npeers: usize) -> Daemons {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let secret = Arc::new(SECRET.to_vec());
    let (cl, controller) = bind(&rt);
    rt.spawn(nearlog::driver::server::run_controller(cl, ControllerCore::open(MemStore::default()).unwrap(), secret.clone()));
    let mut peers = Vec::new();
    for _ in 0..npeers {
        let (l, a) = bind(&rt);
        rt.spawn(nearlog::driver::server::run_peer(l, a.clone(), controller.clone(), secret.clone(), 16 << 20));
        peers.push(a);
    }
    Daemons { rt, controller, peers }
}

fn connect(addr: &str) -> TcpStream {
    match blocking::connect(addr, SECRET, Duration::from_secs(5)).unwrap() {
        blocking::Conn::Plain(s) => s,
        _ => panic!("this test runs without link TLS"),
    }
}

/// After sending a complete bad frame the server must close the connection (EOF or reset)
/// rather than answer it or hang.
fn expect_closed(mut s: TcpStream) -> Result<(), TestCaseError> {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return Ok(()),
            // An error reply before the close is fine; keep reading until the close.
            Ok(_) if Instant::now() < deadline => continue,
            Ok(_) => return Err(TestCaseError::fail("connection still open after a bad frame")),
        }
    }
}

#[derive(Debug, Clone)]
enum Bad {
    /// Random bytes (may look like a frame header announcing more bytes: then we close).
    Random(Vec<u8>),
    /// A correct header whose checksum does not match the payload.
    WrongCrc(Vec<u8>),
    /// A header announcing more than `MAX_FRAME_BYTES`.
    Oversized(u32),
    /// A correctly framed payload that is not a request.
    Garbage(Vec<u8>),
    /// A valid request frame cut short, then the client goes away.
    Truncated(usize),
}

fn frame(payload: &[u8], crc: u32) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    f.extend_from_slice(&crc.to_le_bytes());
    f.extend_from_slice(payload);
    f
}

fn bad_strategy() -> impl Strategy<Value = Bad> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..3000).prop_map(Bad::Random),
        proptest::collection::vec(any::<u8>(), 1..3000).prop_map(Bad::WrongCrc),
        ((MAX_FRAME_BYTES as u32 + 1)..u32::MAX).prop_map(Bad::Oversized),
        proptest::collection::vec(any::<u8>(), 1..200).prop_map(Bad::Garbage),
        (1usize..40).prop_map(Bad::Truncated),
    ]
}

fn send_bad(addr: &str, bad: &Bad, valid: &[u8]) -> Result<(), TestCaseError> {
    let mut s = connect(addr);
    match bad {
        Bad::Random(b) => {
            let _ = s.write_all(b);
            drop(s);
        }
        Bad::WrongCrc(p) => {
            let _ = s.write_all(&frame(p, crc32c::crc32c(p) ^ 1));
            expect_closed(s)?;
        }
        Bad::Oversized(n) => {
            let mut f = n.to_le_bytes().to_vec();
            f.extend_from_slice(&[0; 4]);
            let _ = s.write_all(&f);
            expect_closed(s)?;
        }
        Bad::Garbage(p) => {
            // Postcard may decode some byte strings as a request: only check the server lives.
            let _ = s.write_all(&frame(p, crc32c::crc32c(p)));
            drop(s);
        }
        Bad::Truncated(n) => {
            let _ = s.write_all(&valid[..(*n).min(valid.len() - 1)]);
            drop(s);
        }
    }
    Ok(())
}

#[test]
fn garbage_frames_are_refused_and_other_clients_keep_being_served() {
    let d = start(1);
    let good_peer = std::cell::RefCell::new(connect(&d.peers[0]));
    let good_ctl = std::cell::RefCell::new(connect(&d.controller));
    let peer_valid = blocking::encode(&PeerRequest::Stats).unwrap();
    let ctl_valid = blocking::encode(&CtlRequest::Status).unwrap();
    let cases: u32 = std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(48);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() });
    runner
        .run(&(bad_strategy(), any::<bool>()), |(bad, to_peer)| {
            if to_peer {
                send_bad(&d.peers[0], &bad, &peer_valid)?;
            } else {
                send_bad(&d.controller, &bad, &ctl_valid)?;
            }
            let r: PeerReply = blocking::call(&mut *good_peer.borrow_mut(), &PeerRequest::Stats, MAX_FRAME_BYTES).map_err(|e| TestCaseError::fail(format!("peer stopped serving: {e}")))?;
            prop_assert!(matches!(r, PeerReply::Stats { .. }), "peer answered {:?}", r);
            let r: CtlReply = blocking::call(&mut *good_ctl.borrow_mut(), &CtlRequest::Status, MAX_FRAME_BYTES).map_err(|e| TestCaseError::fail(format!("controller stopped serving: {e}")))?;
            prop_assert!(matches!(r, CtlReply::Status(_)), "controller answered {:?}", r);
            Ok(())
        })
        .unwrap();
    // New connections are still accepted after all that.
    let mut s = connect(&d.peers[0]);
    let r: PeerReply = blocking::call(&mut s, &PeerRequest::Stats, MAX_FRAME_BYTES).unwrap();
    assert!(matches!(r, PeerReply::Stats { .. }));
    drop(d.rt);
}

#[derive(Clone, Copy, Debug)]
enum Liar {
    /// Answers every request with random bytes.
    Garbage,
    /// Claims the most advanced copy, then serves it truncated.
    Truncated,
    /// Claims the most advanced copy, then serves bytes that do not match their checksums.
    Corrupt,
    /// Answers with an old epoch (probes, acks) and never holds this epoch's state.
    StaleEpochs,
}

/// A fake log peer: the real handshake, then lies according to `mode`.
fn start_liar(rt: &tokio::runtime::Runtime, mode: Liar) -> String {
    let (l, addr) = bind(rt);
    rt.spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else { return };
            tokio::spawn(async move {
                use tokio::io::AsyncWriteExt;
                if wire::auth::accept(&mut s, SECRET).await.is_err() {
                    return;
                }
                let mut n = 0u64;
                loop {
                    let Ok(req) = wire::read_msg::<PeerRequest, _>(&mut s, MAX_FRAME_BYTES).await else { return };
                    n += 1;
                    // The most advanced copy a peer could hold: the previous epoch, many ops.
                    let req_epoch = match &req {
                        PeerRequest::Probe { epoch, .. } | PeerRequest::Fetch { epoch, .. } => *epoch,
                        _ => 1,
                    };
                    let big = Holding { epoch: req_epoch.saturating_sub(1).max(1), seq: 1_000_000, size: 10_000 };
                    let rep = match (mode, req) {
                        (Liar::Garbage, _) => {
                            let junk: Vec<u8> = (0..64).map(|i| (i as u64 * 31 + n) as u8).collect();
                            let _ = s.write_all(&junk).await;
                            continue;
                        }
                        (Liar::Truncated | Liar::Corrupt, PeerRequest::Probe { file, epoch }) => PeerReply::Probed { file, epoch, holding: Some(big) },
                        (Liar::Truncated, PeerRequest::Fetch { file, offset, .. }) => {
                            let data = vec![7u8; 100];
                            PeerReply::Data { file, offset, block_crcs: vec![crc32c::crc32c(&data)], data, holding: big }
                        }
                        (Liar::Corrupt, PeerRequest::Fetch { file, offset, .. }) => {
                            let data = vec![9u8; 4096];
                            PeerReply::Data { file, offset, block_crcs: vec![0xdead_beef; 3], data, holding: big }
                        }
                        (Liar::StaleEpochs, PeerRequest::Probe { file, .. }) => PeerReply::Probed { file, epoch: 1, holding: Some(big) },
                        // Acks from the future: more ops than the client ever sent.
                        (Liar::Truncated | Liar::Corrupt, PeerRequest::Record { file, epoch, seq, .. }) => PeerReply::Ack { file, epoch, applied_seq: seq + 1000 },
                        (_, PeerRequest::Record { file, .. }) => PeerReply::Ack { file, epoch: 1, applied_seq: 999 },
                        (_, PeerRequest::Stage { file, epoch, offset, .. }) => PeerReply::Staged { file, epoch, offset },
                        (_, PeerRequest::StageCopy { file, epoch, .. }) => PeerReply::Staged { file, epoch, offset: 0 },
                        (Liar::Corrupt, PeerRequest::Sums { file, offset, .. }) => PeerReply::Sums { file, offset, block_crcs: vec![0xdead_beef; 3], holding: big },
                        (_, PeerRequest::Fetch { file, .. } | PeerRequest::Sums { file, .. }) => PeerReply::Refused { file, reason: "no".into() },
                        (_, PeerRequest::Drop { file, .. }) => PeerReply::Dropped { file },
                        (_, PeerRequest::Stats) => PeerReply::Stats { region_bytes: 0, used_bytes: 0, files: 0 },
                    };
                    if wire::write_msg(&mut s, &rep).await.is_err() || s.flush().await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

fn grant(epoch: u64, addrs: &[String], initialized: bool) -> FileGrant {
    FileGrant {
        key: "/f.log".into(),
        file: 42,
        epoch,
        peers: addrs.iter().enumerate().map(|(i, a)| PeerAddr { id: i as u32 + 1, addr: a.clone() }).collect(),
        initialized,
        recover_from: Vec::new(),
    }
}

fn open(d: &mut Driver, g: &FileGrant) -> FileClient {
    d.learn(g);
    let mut c = FileClient::open(g.file, g.epoch, g.peers.iter().map(|p| p.id).collect(), g.initialized, Vec::new(), ClientConfig::default(), d.now_us());
    d.run(&mut c, Instant::now() + Duration::from_secs(20), |c| c.is_ready()).unwrap();
    c
}

#[test]
fn a_misbehaving_peer_is_detected_and_ignored() {
    let d = start(3);
    // The content: 20 KiB over several writes, on all three honest peers.
    let mut want = Vec::new();
    let mut drv = Driver::new(SECRET);
    let mut c = open(&mut drv, &grant(1, &d.peers, false));
    for i in 0..5u8 {
        let chunk = vec![i + 1; 4000 + i as usize * 17];
        c.submit(Op::write(want.len() as u64, chunk.clone())).unwrap();
        want.extend_from_slice(&chunk);
    }
    drv.run(&mut c, Instant::now() + Duration::from_secs(20), |c| c.fully_replicated()).unwrap();
    drop(c);
    let mut epoch = 1;
    for mode in [Liar::Garbage, Liar::Truncated, Liar::Corrupt, Liar::StaleEpochs] {
        epoch += 1;
        // Peer 3 is replaced by the liar (as if its address now led to a misbehaving process).
        let liar = start_liar(&d.rt, mode);
        let addrs = vec![d.peers[0].clone(), d.peers[1].clone(), liar];
        let mut drv = Driver::new(SECRET);
        let mut c = open(&mut drv, &grant(epoch, &addrs, true));
        let got = c.take_recovered().unwrap();
        assert_eq!(got.len(), want.len(), "{mode:?}: recovered length");
        assert!(got == want, "{mode:?}: recovered content differs");
        // Writes go on with the two honest peers (the liar's acks never count for more).
        let extra = vec![0xabu8; 1000];
        c.submit(Op::write(want.len() as u64, extra.clone())).unwrap();
        drv.run(&mut c, Instant::now() + Duration::from_secs(20), |c| c.acked_seq() >= c.last_seq()).unwrap();
        want.extend_from_slice(&extra);
    }
    drop(d.rt);
}
