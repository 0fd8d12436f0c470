//! Protocol behaviour checked byte by byte with a minimal in-test client.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use blockdev::{DevError, MemDev};
use common::*;
use nbd::proto::*;
use nbd::{MapExports, ServerConfig, SingleExport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MIB: u64 = 1 << 20;

fn single(size_bytes: u64) -> (TestServer, Arc<MemDev>) {
    let dev = Arc::new(MemDev::new(size_bytes));
    (
        TestServer::start(SingleExport::new("vol", dev.clone())),
        dev,
    )
}

#[test]
fn go_then_read_write_flush_trim_zeroes() {
    let (server, _dev) = single(4 * MIB);
    server.runtime.block_on(async {
        let mut c = Client::connect(server.addr, "vol").await.unwrap();
        assert_eq!(c.size_bytes, 4 * MIB);
        let want = NBD_FLAG_HAS_FLAGS
            | NBD_FLAG_SEND_FLUSH
            | NBD_FLAG_SEND_FUA
            | NBD_FLAG_SEND_TRIM
            | NBD_FLAG_SEND_WRITE_ZEROES
            | NBD_FLAG_CAN_MULTI_CONN;
        assert_eq!(c.transmission_flags, want);

        assert_eq!(c.write(4096, &[0xab; 8192]).await, 0);
        assert_eq!(c.read(4096, 8192).await.unwrap(), vec![0xab; 8192]);
        assert_eq!(
            c.call(NBD_CMD_WRITE, NBD_CMD_FLAG_FUA, 0, 3, &[1, 2, 3])
                .await
                .0,
            0
        );
        assert_eq!(c.read(0, 3).await.unwrap(), vec![1, 2, 3]);
        assert_eq!(c.call(NBD_CMD_FLUSH, 0, 0, 0, &[]).await.0, 0);
        assert_eq!(c.call(NBD_CMD_TRIM, 0, 4096, 4096, &[]).await.0, 0);
        assert_eq!(c.read(4096, 4096).await.unwrap(), vec![0; 4096]);
        let flags = NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FUA;
        assert_eq!(
            c.call(NBD_CMD_WRITE_ZEROES, flags, 8192, 4096, &[]).await.0,
            0
        );
        assert_eq!(c.read(4096, 8192).await.unwrap(), vec![0; 8192]);
        // Zero-length read at the very end is in range.
        assert_eq!(c.read(4 * MIB, 0).await.unwrap(), Vec::<u8>::new());
        c.disconnect().await;
    });
}

#[test]
fn out_of_range_and_oversized_requests_get_einval_and_the_stream_stays_in_sync() {
    let (server, dev) = single(4 * MIB);
    server.runtime.block_on(async {
        let mut c = Client::connect(server.addr, "vol").await.unwrap();
        assert_eq!(c.read(4 * MIB - 1, 2).await, Err(NBD_EINVAL));
        assert_eq!(c.read(u64::MAX, 1).await, Err(NBD_EINVAL));
        assert_eq!(c.write(4 * MIB, &[1]).await, NBD_EINVAL);
        assert_eq!(c.call(NBD_CMD_TRIM, 0, 4 * MIB, 1, &[]).await.0, NBD_EINVAL);
        assert_eq!(
            c.call(NBD_CMD_WRITE_ZEROES, 0, u64::MAX - 1, 10, &[])
                .await
                .0,
            NBD_EINVAL
        );
        // Unknown command and unknown flag.
        assert_eq!(c.call(5, 0, 0, 512, &[]).await.0, NBD_EINVAL);
        assert_eq!(
            c.call(NBD_CMD_READ, 1 << 9, 0, 512, &[]).await.0,
            NBD_EINVAL
        );
        // A read one byte over max_request_bytes.
        assert_eq!(c.read(0, (32 << 20) + 1).await, Err(NBD_EINVAL));
        // Still in sync after all that.
        assert_eq!(c.write(0, b"hello").await, 0);
        assert_eq!(c.read(0, 5).await.unwrap(), b"hello");
        c.disconnect().await;
    });
    let _ = dev;
}

#[test]
fn oversized_write_payload_is_discarded_or_the_connection_closed() {
    let dev = Arc::new(MemDev::new(64 * MIB));
    let config = ServerConfig {
        max_request_bytes: MIB as u32,
        max_discard_payload_bytes: 2 * MIB as u32,
        ..Default::default()
    };
    let server = TestServer::start_with(SingleExport::new("vol", dev), config);
    server.runtime.block_on(async {
        let mut c = Client::connect(server.addr, "vol").await.unwrap();
        // Within the discard limit: EINVAL, and the next request works.
        let payload = vec![7u8; (MIB + 1) as usize];
        assert_eq!(c.write(0, &payload).await, NBD_EINVAL);
        assert_eq!(c.read(0, 4).await.unwrap(), vec![0; 4]);
        // Above it: the server closes rather than read 3 MiB it will not use.
        c.send_request(NBD_CMD_WRITE, 0, 0, 3 * MIB as u32, &[])
            .await;
        assert!(
            is_closed(&mut c.stream, Duration::from_secs(5)).await,
            "server kept the connection"
        );
        // Other clients are unaffected.
        let mut c2 = Client::connect(server.addr, "vol").await.unwrap();
        assert_eq!(c2.write(0, b"ok").await, 0);
        c2.disconnect().await;
    });
}

#[test]
fn bad_request_magic_closes_only_that_connection() {
    let (server, _dev) = single(MIB);
    server.runtime.block_on(async {
        let mut good = Client::connect(server.addr, "vol").await.unwrap();
        let mut bad = Client::connect(server.addr, "vol").await.unwrap();
        let mut header = encode_request_header(&RequestHeader {
            flags: 0,
            kind: 0,
            cookie: 1,
            offset: 0,
            length: 1,
        });
        header[0] = 0;
        bad.stream.write_all(&header).await.unwrap();
        assert!(is_closed(&mut bad.stream, Duration::from_secs(5)).await);
        assert_eq!(good.write(0, b"still here").await, 0);
        good.disconnect().await;
    });
}

#[test]
fn device_errors_map_to_errnos() {
    let dev = Arc::new(FaultyDev::new(MIB));
    let server = TestServer::start(SingleExport::new("vol", dev.clone()));
    server.runtime.block_on(async {
        let mut c = Client::connect(server.addr, "vol").await.unwrap();
        let cases = [
            (DevError::OutOfRange("x".into()), NBD_EINVAL),
            (DevError::WriteRefused("fenced".into()), NBD_EPERM),
            (DevError::NoSpace("full".into()), NBD_ENOSPC),
            (DevError::Io("broken".into()), NBD_EIO),
        ];
        for (err, errno) in cases {
            *dev.fail_writes.lock().unwrap() = Some(err.clone());
            assert_eq!(c.write(0, &[1; 512]).await, errno, "{err:?}");
            assert_eq!(
                c.call(NBD_CMD_TRIM, 0, 0, 512, &[]).await.0,
                errno,
                "{err:?}"
            );
        }
        *dev.fail_writes.lock().unwrap() = None;
        dev.refuse_all_writes.store(false, Ordering::SeqCst);
        assert_eq!(c.write(0, &[1; 512]).await, 0);
        c.disconnect().await;
    });
}

#[test]
fn many_requests_in_flight_and_many_connections() {
    let (server, dev) = single(16 * MIB);
    server.runtime.block_on(async {
        let mut tasks = Vec::new();
        for conn in 0..8u64 {
            let addr = server.addr;
            tasks.push(tokio::spawn(async move {
                let mut c = Client::connect(addr, "vol").await.unwrap();
                // 300 pipelined writes (beyond the 64 in flight) before reading any reply.
                let mut cookies = std::collections::HashSet::new();
                for i in 0..300u64 {
                    let offset = (conn * 300 + i) * 4096;
                    let data = vec![(conn * 31 + i) as u8; 4096];
                    cookies.insert(c.send_request(NBD_CMD_WRITE, 0, offset, 4096, &data).await);
                }
                for _ in 0..300 {
                    let (errno, cookie, _) = c.read_reply(0).await.unwrap();
                    assert_eq!(errno, 0);
                    assert!(cookies.remove(&cookie), "unexpected cookie {cookie}");
                }
                // Pipelined reads: replies may come in any order; match them by cookie.
                let mut want = std::collections::HashMap::new();
                for i in 0..32u64 {
                    let offset = (conn * 300 + i) * 4096;
                    want.insert(
                        c.send_request(NBD_CMD_READ, 0, offset, 4096, &[]).await,
                        (conn * 31 + i) as u8,
                    );
                }
                for _ in 0..32 {
                    let (errno, cookie, data) = c.read_reply(4096).await.unwrap();
                    assert_eq!(errno, 0);
                    assert_eq!(data, vec![want[&cookie]; 4096]);
                }
                c.disconnect().await;
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
    let check = server
        .runtime
        .block_on(blockdev::BlockDev::read(&*dev, 7 * 300 * 4096, 4096))
        .unwrap();
    assert_eq!(check, vec![(7 * 31) as u8; 4096]);
}

#[test]
fn options_list_info_unsupported_unknown_and_abort() {
    let dev = Arc::new(MemDev::new(MIB));
    let exports = MapExports::new().with("a", dev.clone()).with("b", dev);
    let server = TestServer::start(exports);
    server.runtime.block_on(async {
        let mut s = TcpStream::connect(server.addr).await.unwrap();
        let hs_flags = greet(&mut s, NBD_FLAG_C_FIXED_NEWSTYLE).await.unwrap();
        assert_eq!(hs_flags, NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES);

        send_option(&mut s, NBD_OPT_LIST, &[]).await.unwrap();
        let mut names = Vec::new();
        loop {
            let r = read_option_reply(&mut s).await.unwrap();
            assert_eq!(r.option, NBD_OPT_LIST);
            if r.reply_type == NBD_REP_ACK {
                break;
            }
            assert_eq!(r.reply_type, NBD_REP_SERVER);
            names.push(String::from_utf8(r.data[4..].to_vec()).unwrap());
        }
        assert_eq!(names, ["a", "b"]);

        send_option(&mut s, NBD_OPT_LIST, &[1]).await.unwrap();
        assert_eq!(
            read_option_reply(&mut s).await.unwrap().reply_type,
            NBD_REP_ERR_INVALID
        );

        for option in [
            NBD_OPT_STRUCTURED_REPLY,
            NBD_OPT_STARTTLS,
            NBD_OPT_SET_META_CONTEXT,
            NBD_OPT_LIST_META_CONTEXT,
            4242,
        ] {
            send_option(&mut s, option, &[]).await.unwrap();
            let r = read_option_reply(&mut s).await.unwrap();
            assert_eq!((r.option, r.reply_type), (option, NBD_REP_ERR_UNSUP));
        }

        let info = |name: &str| {
            encode_info_request(&InfoRequest {
                name: name.into(),
                info_types: vec![NBD_INFO_NAME],
            })
        };
        send_option(&mut s, NBD_OPT_INFO, &info("nope"))
            .await
            .unwrap();
        assert_eq!(
            read_option_reply(&mut s).await.unwrap().reply_type,
            NBD_REP_ERR_UNKNOWN
        );
        send_option(&mut s, NBD_OPT_GO, &info("")).await.unwrap();
        assert_eq!(
            read_option_reply(&mut s).await.unwrap().reply_type,
            NBD_REP_ERR_UNKNOWN
        );
        send_option(&mut s, NBD_OPT_GO, &[0, 0, 0, 200, 1])
            .await
            .unwrap();
        assert_eq!(
            read_option_reply(&mut s).await.unwrap().reply_type,
            NBD_REP_ERR_INVALID
        );

        send_option(&mut s, NBD_OPT_INFO, &info("b")).await.unwrap();
        let mut infos = Vec::new();
        loop {
            let r = read_option_reply(&mut s).await.unwrap();
            if r.reply_type == NBD_REP_ACK {
                break;
            }
            assert_eq!(r.reply_type, NBD_REP_INFO);
            infos.push(r.data);
        }
        assert_eq!(
            infos[0],
            encode_info_export(MIB, TRANSMISSION_FLAGS).to_vec()
        );
        assert_eq!(infos[1], encode_info_block_size(1, 4096, 32 << 20).to_vec());
        assert_eq!(infos[2], [&NBD_INFO_NAME.to_be_bytes()[..], b"b"].concat());

        // Too much option data: refused, and the handshake goes on.
        send_option(&mut s, NBD_OPT_INFO, &vec![0u8; 100 << 10])
            .await
            .unwrap();
        assert_eq!(
            read_option_reply(&mut s).await.unwrap().reply_type,
            NBD_REP_ERR_TOO_BIG
        );

        send_option(&mut s, NBD_OPT_ABORT, &[]).await.unwrap();
        assert_eq!(
            read_option_reply(&mut s).await.unwrap().reply_type,
            NBD_REP_ACK
        );
        assert!(is_closed(&mut s, Duration::from_secs(5)).await);
    });
}

#[test]
fn export_name_with_and_without_zero_padding() {
    let (server, _dev) = single(MIB);
    server.runtime.block_on(async {
        for no_zeroes in [false, true] {
            let mut s = TcpStream::connect(server.addr).await.unwrap();
            let flags =
                NBD_FLAG_C_FIXED_NEWSTYLE | if no_zeroes { NBD_FLAG_C_NO_ZEROES } else { 0 };
            greet(&mut s, flags).await.unwrap();
            send_option(&mut s, NBD_OPT_EXPORT_NAME, b"vol")
                .await
                .unwrap();
            let mut reply = vec![0u8; 10 + if no_zeroes { 0 } else { 124 }];
            s.read_exact(&mut reply).await.unwrap();
            assert_eq!(
                reply,
                encode_export_name_reply(MIB, TRANSMISSION_FLAGS, no_zeroes)
            );
            // Transmission starts right after: a read of 4 bytes.
            s.write_all(&encode_request_header(&RequestHeader {
                flags: 0,
                kind: NBD_CMD_READ,
                cookie: 9,
                offset: 0,
                length: 4,
            }))
            .await
            .unwrap();
            let mut r = [0u8; 20];
            s.read_exact(&mut r).await.unwrap();
            assert_eq!(parse_simple_reply(&r).unwrap(), (0, 9));
        }
        // Unknown name: EXPORT_NAME has no error reply, so the connection closes.
        let mut s = TcpStream::connect(server.addr).await.unwrap();
        greet(&mut s, NBD_FLAG_C_FIXED_NEWSTYLE).await.unwrap();
        send_option(&mut s, NBD_OPT_EXPORT_NAME, b"nope")
            .await
            .unwrap();
        assert!(is_closed(&mut s, Duration::from_secs(5)).await);
        // Unknown client flags close the connection too.
        let mut s = TcpStream::connect(server.addr).await.unwrap();
        greet(&mut s, 1 << 7).await.unwrap();
        assert!(is_closed(&mut s, Duration::from_secs(5)).await);
    });
}

#[test]
fn handshake_timeout_and_connection_limit() {
    let dev = Arc::new(MemDev::new(MIB));
    let config = ServerConfig {
        handshake_timeout_ms: 200,
        max_connections: 2,
        ..Default::default()
    };
    let server = TestServer::start_with(SingleExport::new("vol", dev), config);
    server.runtime.block_on(async {
        let mut idle = TcpStream::connect(server.addr).await.unwrap();
        assert!(
            is_closed(&mut idle, Duration::from_secs(5)).await,
            "idle handshake not timed out"
        );

        let c1 = Client::connect(server.addr, "vol").await.unwrap();
        let c2 = Client::connect(server.addr, "vol").await.unwrap();
        let mut third = TcpStream::connect(server.addr).await.unwrap();
        assert!(
            is_closed(&mut third, Duration::from_secs(5)).await,
            "third connection served"
        );
        c1.disconnect().await;
        c2.disconnect().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let c3 = Client::connect(server.addr, "vol").await.unwrap();
        c3.disconnect().await;
    });
}

#[test]
fn serves_unix_sockets() {
    let dir = std::env::temp_dir().join(format!("nbd-unix-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("nbd.sock");
    let _ = std::fs::remove_file(&path);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let dev = Arc::new(MemDev::new(MIB));
        tokio::spawn(nbd::serve_unix(listener, SingleExport::new("vol", dev)));
        let mut s = tokio::net::UnixStream::connect(&path).await.unwrap();
        greet(&mut s, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES)
            .await
            .unwrap();
        send_option(&mut s, NBD_OPT_EXPORT_NAME, b"vol")
            .await
            .unwrap();
        let mut reply = [0u8; 10];
        s.read_exact(&mut reply).await.unwrap();
        let mut req = encode_request_header(&RequestHeader {
            flags: 0,
            kind: NBD_CMD_WRITE,
            cookie: 3,
            offset: 0,
            length: 2,
        })
        .to_vec();
        req.extend_from_slice(b"hi");
        s.write_all(&req).await.unwrap();
        let mut r = [0u8; 16];
        s.read_exact(&mut r).await.unwrap();
        assert_eq!(parse_simple_reply(&r).unwrap(), (0, 3));
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn in_flight_requests_reach_but_never_exceed_the_limit() {
    let dev = Arc::new(LatencyDev::new(16 * MIB, Duration::from_millis(250)));
    let server = TestServer::start(SingleExport::new("vol", dev.clone()));
    let limit = ServerConfig::default().max_in_flight_requests_per_connection as u64;
    assert_eq!(limit, 64);
    server.runtime.block_on(async {
        let mut c = Client::connect(server.addr, "vol").await.unwrap();
        for i in 0..200u64 {
            c.send_request(NBD_CMD_WRITE, 0, i * 4096, 4096, &[i as u8; 4096])
                .await;
        }
        for _ in 0..200 {
            assert_eq!(c.read_reply(0).await.unwrap().0, 0);
        }
        c.disconnect().await;
    });
    assert_eq!(
        dev.max_in_flight.load(Ordering::SeqCst),
        limit,
        "one connection should run exactly the limit at once"
    );
}

#[test]
fn disconnect_waits_for_requests_in_flight() {
    let dev = Arc::new(LatencyDev::new(MIB, Duration::from_millis(200)));
    let server = TestServer::start(SingleExport::new("vol", dev.clone()));
    server.runtime.block_on(async {
        let mut c = Client::connect(server.addr, "vol").await.unwrap();
        let cookie = c.send_request(NBD_CMD_WRITE, 0, 0, 4, b"last").await;
        c.send_request(NBD_CMD_DISC, 0, 0, 0, &[]).await;
        // The reply to the write still arrives before the server closes.
        let (errno, got, _) = c.read_reply(0).await.unwrap();
        assert_eq!((errno, got), (0, cookie));
        assert!(is_closed(&mut c.stream, Duration::from_secs(5)).await);

        // Closing the sending side between requests (no DISC) is treated the same way.
        let mut c = Client::connect(server.addr, "vol").await.unwrap();
        let cookie = c.send_request(NBD_CMD_WRITE, 0, 4, 4, b"half").await;
        c.stream.shutdown().await.unwrap();
        let (errno, got, _) = c.read_reply(0).await.unwrap();
        assert_eq!((errno, got), (0, cookie));
        assert!(is_closed(&mut c.stream, Duration::from_secs(5)).await);
    });
    assert_eq!(
        server
            .runtime
            .block_on(blockdev::BlockDev::read(&*dev, 0, 8))
            .unwrap(),
        b"lasthalf"
    );
}

#[test]
fn in_flight_buffer_bytes_are_bounded() {
    let dev = Arc::new(LatencyDev::new(16 * MIB, Duration::from_millis(250)));
    let config = ServerConfig {
        max_request_bytes: 64 << 10,
        max_in_flight_bytes_per_connection: 64 << 10,
        ..Default::default()
    };
    let server = TestServer::start_with(SingleExport::new("vol", dev.clone()), config);
    server.runtime.block_on(async {
        let mut c = Client::connect(server.addr, "vol").await.unwrap();
        for i in 0..64u64 {
            c.send_request(NBD_CMD_READ, 0, i * 4096, 4096, &[]).await;
        }
        for _ in 0..64 {
            assert_eq!(c.read_reply(4096).await.unwrap().0, 0);
        }
        c.disconnect().await;
    });
    // 64 KiB of buffers at 4 KiB each: at most 16 reads at once.
    assert_eq!(dev.max_in_flight.load(Ordering::SeqCst), 16);
}
