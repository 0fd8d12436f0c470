//! The nearlog links over mutual TLS (`UNDERSTUDY_LINK_TLS=always`, this test binary's whole
//! process, with a certificate from a throw-away CA), against the real tokio controller and
//! peers on loopback and the blocking clients of the shim and the mover:
//!
//! `nearlog_links_run_over_tls_and_refuse_plain_clients`: the peers register and heartbeat
//! with the controller over TLS; a file is written to three peers and recovered from them
//! (blocking clients, TLS sessions handed to the peers' data-path threads); a plain client is
//! refused by a peer and by the controller, and a client of another CA too.
//!
//! One test in this binary on purpose: the link setting is read once per process.

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nearlog::core::controller::ControllerCore;
use nearlog::core::file_client::{ClientConfig, FileClient};
use nearlog::driver::blocking;
use nearlog::driver::mover::Driver;
use nearlog::proto::{CtlReply, CtlRequest, FileGrant, Op, PeerAddr, PeerReply, PeerRequest, MAX_FRAME_BYTES};
use nearlog::store::MemStore;

const SECRET: &[u8] = b"link-tls-test-secret";

fn bind(rt: &tokio::runtime::Runtime) -> (tokio::net::TcpListener, String) {
    let l = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let a = l.local_addr().unwrap().to_string();
    (l, a)
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
    d.run(&mut c, Instant::now() + Duration::from_secs(30), |c| c.is_ready()).unwrap();
    c
}

/// A plain (or foreign-TLS) client's attempt: connect and run the secret handshake; the error.
fn refused(addr: &str, tls: Option<&wire::link::LinkTls>) -> Option<String> {
    let s = TcpStream::connect(addr).unwrap();
    // Past the server's handshake deadline (wire::listen::AUTH_DEADLINE, 5 s): a server that
    // waits for a ClientHello that never comes closes the connection by then.
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut c = match blocking::tls_connect(s, tls) {
        Ok(c) => c,
        Err(e) => return Some(e.to_string()),
    };
    if let Err(e) = blocking::auth_connect(&mut c, SECRET) {
        return Some(e.to_string());
    }
    let _ = c.write_all(&blocking::encode(&PeerRequest::Stats).unwrap());
    blocking::recv::<PeerReply>(&mut c, MAX_FRAME_BYTES).err().map(|e| e.to_string())
}

#[test]
fn nearlog_links_run_over_tls_and_refuse_plain_clients() {
    let dir = tempfile::tempdir().unwrap();
    let pki = wire::tls::TestPki::write(&dir.path().join("pki"));
    let other = wire::tls::TestPki::write(&dir.path().join("other"));
    // Before anything reads it (once per process): every link of this process is TLS.
    std::env::set_var(wire::link::LINK_TLS_ENV, "always");
    std::env::set_var(wire::link::LINK_TLS_CERT_ENV, pki.path("server-cert.pem"));
    std::env::set_var(wire::link::LINK_TLS_KEY_ENV, pki.path("server-key.pem"));
    std::env::set_var(wire::link::LINK_TLS_CA_ENV, pki.path("ca-cert.pem"));
    assert!(blocking::link_tls().unwrap().is_some(), "the link setting is on");

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let secret = Arc::new(SECRET.to_vec());
    let (cl, controller) = bind(&rt);
    rt.spawn(nearlog::driver::server::run_controller(cl, ControllerCore::open(MemStore::default()).unwrap(), secret.clone()));
    let mut peers = Vec::new();
    for _ in 0..3 {
        let (l, a) = bind(&rt);
        rt.spawn(nearlog::driver::server::run_peer(l, a.clone(), controller.clone(), secret.clone(), 16 << 20));
        peers.push(a);
    }

    // Peer -> controller (tokio client) and shim -> controller (blocking client) over TLS.
    let t0 = Instant::now();
    loop {
        let mut c = blocking::connect(&controller, SECRET, Duration::from_secs(10)).unwrap();
        assert!(c.is_tls(), "a controller link on loopback under `always` is plain");
        let CtlReply::Status(st) = blocking::call(&mut c, &CtlRequest::Status, MAX_FRAME_BYTES).unwrap() else { panic!("no status") };
        if st.peers.len() == 3 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{} of 3 peers registered over TLS within 30 s", st.peers.len());
        std::thread::sleep(Duration::from_millis(100));
    }

    // A file written to the three peers and recovered from them, over TLS.
    let mut want = Vec::new();
    let mut drv = Driver::new(SECRET);
    let mut c = open(&mut drv, &grant(1, &peers, false));
    for i in 0..5u8 {
        // The last write is larger than one TLS record (16 KiB) and one read buffer.
        let chunk = vec![i + 1; if i == 4 { 200_000 } else { 4000 + i as usize * 17 }];
        c.submit(Op::write(want.len() as u64, chunk.clone())).unwrap();
        want.extend_from_slice(&chunk);
    }
    drv.run(&mut c, Instant::now() + Duration::from_secs(30), |c| c.fully_replicated()).unwrap();
    drop(c);
    drop(drv);
    let mut drv = Driver::new(SECRET);
    let mut c = open(&mut drv, &grant(2, &peers, true));
    let got = c.take_recovered().unwrap();
    assert!(got == want, "recovered {} bytes over TLS, wrote {}", got.len(), want.len());

    // Refused: a plain client, by a peer and by the controller; a client of another CA.
    for addr in [&peers[0], &controller] {
        let e = refused(addr, None);
        assert!(e.is_some(), "a plain client was served by {addr} on a TLS link");
        let foreign = wire::link::LinkTls::from_files(&other.server_files(true), wire::link::LinkPolicy::Always).unwrap();
        let e = refused(addr, Some(&foreign));
        assert!(e.is_some(), "a client of another CA was served by {addr}");
    }
    // And the TLS client is still served after those attempts.
    let mut s = blocking::connect(&peers[0], SECRET, Duration::from_secs(10)).unwrap();
    assert!(s.is_tls());
    let r: PeerReply = blocking::call(&mut s, &PeerRequest::Stats, MAX_FRAME_BYTES).unwrap();
    assert!(matches!(r, PeerReply::Stats { .. }));
    drop(rt);
}
