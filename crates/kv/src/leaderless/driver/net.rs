//! The wire between nodes, the CM and clients: the handshake, [`NetMsg`] frames, the
//! per-peer writer and the frame reader (with the zero-copy path for catch-up chunks).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::leaderless::proto::*;
use crate::pmlog::{self};

use super::*;

/// Largest frame a node or client accepts (a CatchUp_resp chunk or a maximal value, plus room).
pub const MAX_FRAME_BYTES: usize = 4 * 1024 * 1024;
/// Messages queued per peer connection before new ones are dropped (the protocol retransmits).
pub const PEER_QUEUE_MSGS: usize = 65_536;
/// Requests a client connection may have in flight.
pub const CLIENT_INFLIGHT_MAX: usize = 4096;
/// Inputs (peer messages, client requests, log completions) queued for a node's core. Past it
/// the connections' readers wait, so TCP pushes back on the senders rather than the queue
/// adding latency without bound.
pub const INPUT_QUEUE_MSGS: usize = 8192;
/// Read buffer of a node's inbound connection.
pub const CONN_READ_BUFFER_BYTES: usize = 64 << 10;
/// Queued frames to one connection are coalesced into writes of about this many bytes at most.
pub const CONN_WRITE_BATCH_BYTES: usize = 1 << 20;
/// Kernel send (outbound) and receive (inbound) buffer of a connection between nodes: room for
/// a few whole catch-up chunks, so a chunk goes out in one write rather than in many hand-offs
/// between two busy processes (capped by `net.core.wmem_max` / `rmem_max`).
pub const PEER_SOCKET_BUFFER_BYTES: usize = 4 << 20;
/// Period of a node's timer checks.
pub const NODE_TICK_MS: u64 = 5;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Hello {
    Peer(NodeId),
    Cm,
    Client,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum NetMsg {
    Hello(Hello),
    Peer(PeerMsg),
    Hb(Heartbeat),
    HbAck(HeartbeatAck),
    Req { id: u64, op: ClientOp },
    Resp { id: u64, result: ClientResult },
}

#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error(transparent)]
    Wire(#[from] wire::WireError),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("log error: {0}")]
    Log(#[from] pmlog::LogError),
    #[error("no node answered: {0}")]
    Unavailable(String),
    #[error("request refused: {0}")]
    Refused(String),
    #[error("timed out after {0:?} (the operation may or may not have taken effect)")]
    Timeout(Duration),
    /// The control store's errors name the store and what to do.
    #[error(transparent)]
    Control(#[from] control::Error),
}

pub(super) async fn handshake_client<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    secret: &[u8],
    hello: Hello,
) -> Result<(), KvError> {
    wire::auth::connect(s, secret).await?;
    wire::write_msg(s, &NetMsg::Hello(hello)).await?;
    // Over TLS a write may leave its last record in the session until a flush.
    tokio::io::AsyncWriteExt::flush(s).await?;
    Ok(())
}

/// Connects to `addr`, over TLS when this process's link setting asks for it
/// ([`wire::link::process`]), and identifies itself as `hello`.
pub(super) async fn dial(addr: SocketAddr, secret: &[u8], hello: Hello, sndbuf_bytes: Option<usize>) -> Result<wire::link::Link, KvError> {
    let s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    if let Some(b) = sndbuf_bytes {
        set_socket_buffer(&s, libc::SO_SNDBUF, b);
    }
    let mut s = wire::link::connect(s, wire::link::process()?).await?;
    handshake_client(&mut s, secret, hello).await?;
    Ok(s)
}

pub(super) async fn peer_writer(
    me: NodeId,
    addr: SocketAddr,
    secret: Vec<u8>,
    mut rx: mpsc::Receiver<PeerMsg>,
    stats: Arc<NodeStats>,
) {
    let mut backoff = Duration::from_millis(2);
    loop {
        let conn = dial(addr, &secret, Hello::Peer(me), Some(PEER_SOCKET_BUFFER_BYTES));
        let s = match tokio::time::timeout(Duration::from_secs(2), conn).await {
            Ok(Ok(s)) => s,
            _ => {
                // Messages for an unreachable peer are dropped; the protocol retransmits.
                while rx.try_recv().is_ok() {}
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(20));
                continue;
            }
        };
        backoff = Duration::from_millis(2);
        let (_r, mut w) = s.into_split();
        if let FramesEnd::QueueClosed =
            write_frames(&mut w, &mut rx, NetMsg::Peer, Some(&stats)).await
        {
            return;
        }
    }
}

/// Sets a socket buffer size (`SO_SNDBUF` or `SO_RCVBUF`). Best effort: a refusal only costs
/// speed.
pub(super) fn set_socket_buffer(s: &TcpStream, opt: libc::c_int, bytes: usize) {
    use std::os::fd::AsRawFd;
    let v = bytes.min(libc::c_int::MAX as usize) as libc::c_int;
    // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from a pointer to a live local c_int;
    // the fd is owned by `s`, which is open for the duration of the call.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            &v as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        tracing::debug!(
            "setsockopt({opt}, {bytes}): {}",
            std::io::Error::last_os_error()
        );
    }
}

pub(super) enum FramesEnd {
    QueueClosed,
    WriteFailed,
}

/// Writes `rx`'s messages to `w` as frames until the queue closes or a write fails. Whatever is
/// queued goes out in one write (up to about [`CONN_WRITE_BATCH_BYTES`]): a busy connection
/// costs a syscall per batch, not per message. Frames are encoded straight into one reused
/// buffer (a catch-up chunk is about a MiB: no buffer of its own, no copy into the batch).
pub(super) async fn write_frames<T, W: AsyncWrite + Unpin>(
    w: &mut W,
    rx: &mut mpsc::Receiver<T>,
    wrap: impl Fn(T) -> NetMsg,
    stats: Option<&NodeStats>,
) -> FramesEnd {
    use tokio::io::AsyncWriteExt;
    let mut buf: Vec<u8> = Vec::new();
    // Catch-up chunks are timed (encode, write) for the recovery's breakdown.
    let mut chunks = 0u64;
    let push = |buf: &mut Vec<u8>, m: NetMsg| -> u64 {
        match stats {
            Some(s) if matches!(m, NetMsg::Peer(PeerMsg::CatchUpResp { .. })) => {
                let t = Instant::now();
                push_frame(buf, &m);
                add_us(&s.catchup_encode_us, t);
                1
            }
            _ => {
                push_frame(buf, &m);
                0
            }
        }
    };
    while let Some(m) = rx.recv().await {
        buf.clear();
        chunks += push(&mut buf, wrap(m));
        while buf.len() < CONN_WRITE_BATCH_BYTES {
            let Ok(m) = rx.try_recv() else { break };
            chunks += push(&mut buf, wrap(m));
        }
        let t = Instant::now();
        // The flush costs nothing on plain TCP; over TLS it sends the batch's last record.
        if w.write_all(&buf).await.is_err() || w.flush().await.is_err() {
            return FramesEnd::WriteFailed;
        }
        if let Some(s) = stats.filter(|_| chunks > 0) {
            add_us(&s.catchup_write_us, t);
            s.catchup_chunks_sent
                .fetch_add(std::mem::take(&mut chunks), Ordering::Relaxed);
        }
        if buf.capacity() > 2 * (CONN_WRITE_BATCH_BYTES + MAX_FRAME_BYTES) {
            buf = Vec::new(); // an outsized batch's memory is not kept
        }
    }
    FramesEnd::QueueClosed
}

/// Appends `msg` to `buf` as one `wire` frame (`len | crc32c | postcard`), encoded in place.
pub(super) fn push_frame(buf: &mut Vec<u8>, msg: &NetMsg) {
    let start = buf.len();
    buf.extend_from_slice(&[0u8; wire::FRAME_HEADER_BYTES]);
    let taken = std::mem::take(buf);
    // Encoding a NetMsg into a Vec cannot fail.
    *buf = postcard::to_extend(msg, taken).expect("a NetMsg always encodes");
    let body = start + wire::FRAME_HEADER_BYTES;
    let crc = crc32c::crc32c(&buf[body..]);
    let len = (buf.len() - body) as u32;
    buf[start..start + 4].copy_from_slice(&len.to_le_bytes());
    buf[start + 4..body].copy_from_slice(&crc.to_le_bytes());
}

/// Reads one frame into `buf` (its spare capacity: not zeroed first) and decodes it; the same
/// checks as [`wire::read_msg`]. A catch-up chunk keeps the frame's buffer (see
/// [`decode_catchup_resp`]), so the next frame gets a new one; any other frame leaves it for
/// reuse.
pub(super) async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    limit: usize,
    decode_us: Option<&AtomicU64>,
) -> Result<NetMsg, wire::WireError> {
    use tokio::io::AsyncReadExt;
    let mut header = [0u8; wire::FRAME_HEADER_BYTES];
    match r.read_exact(&mut header).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(wire::WireError::Closed)
        }
        Err(e) => return Err(e.into()),
    }
    let (len, want) = wire::parse_header(&header, limit)?;
    buf.clear();
    buf.reserve(len);
    while buf.len() < len {
        let missing = (len - buf.len()) as u64;
        if (&mut *r).take(missing).read_buf(buf).await? == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
    }
    let t = Instant::now();
    let got = crc32c::crc32c(buf);
    if got != want {
        return Err(wire::WireError::Checksum { got, want });
    }
    let m = decode_net_payload(buf);
    if let (Some(c), Ok(NetMsg::Peer(PeerMsg::CatchUpResp { .. }))) = (decode_us, &m) {
        add_us(c, t);
    }
    m
}

/// Decodes a frame's payload as a node's connection does: a catch-up chunk takes `payload`'s
/// buffer ([`decode_catchup_resp`]), any other message is decoded from it.
pub fn decode_net_payload(payload: &mut Vec<u8>) -> Result<NetMsg, wire::WireError> {
    decode_catchup_resp(payload).unwrap_or_else(|| wire::decode_payload(payload))
}

/// A `CatchUpResp`'s fields in the order `PeerMsg::CatchUpResp` encodes them, its entries
/// borrowed from the frame (checked against the real message by a test).
#[derive(Deserialize)]
pub(super) struct CatchUpRespHead<'a> {
    epoch: u64,
    stream: u64,
    from: Cursor,
    next: Option<Cursor>,
    full_copy: bool,
    entries: &'a [u8],
}

/// The first two bytes of every encoded `NetMsg::Peer(PeerMsg::CatchUpResp { .. })`: the
/// variant indices (postcard varints, one byte each below 128).
pub(super) fn catchup_resp_prefix() -> [u8; 2] {
    static PREFIX: std::sync::OnceLock<[u8; 2]> = std::sync::OnceLock::new();
    *PREFIX.get_or_init(|| {
        let sample = NetMsg::Peer(PeerMsg::CatchUpResp {
            epoch: 0,
            stream: 0,
            from: Cursor::Key(None),
            next: None,
            full_copy: false,
            entries: Chunk::default(),
        });
        let b = postcard::to_stdvec(&sample).expect("a NetMsg always encodes");
        assert!(b[0] < 0x80 && b[1] < 0x80, "variant indices of one byte");
        [b[0], b[1]]
    })
}

/// Decodes the payload `frame` if it is a catch-up chunk (`None` otherwise), taking `frame`'s
/// buffer as the chunk's instead of copying a MiB of entries out of it (on a recovering node,
/// decoding took 22–69 ms of a ~50 MB HEAL catch-up with that copy, 2.4–9.1 ms without).
pub(super) fn decode_catchup_resp(frame: &mut Vec<u8>) -> Option<Result<NetMsg, wire::WireError>> {
    if !frame.starts_with(&catchup_resp_prefix()) {
        return None;
    }
    let head: CatchUpRespHead<'_> = match postcard::from_bytes(&frame[2..]) {
        Ok(h) => h,
        Err(e) => return Some(Err(wire::WireError::Decode(e.to_string()))),
    };
    // The entries are borrowed from `frame`; checked rather than trusted, as a peer's bytes.
    let start = (head.entries.as_ptr() as usize).checked_sub(frame.as_ptr() as usize);
    let Some((start, end)) = start
        .map(|s| (s, s + head.entries.len()))
        .filter(|&(_, end)| end <= frame.len())
    else {
        let e = "catch-up entries outside their frame".to_string();
        return Some(Err(wire::WireError::Decode(e)));
    };
    let CatchUpRespHead {
        epoch,
        stream,
        from,
        next,
        full_copy,
        ..
    } = head;
    let entries = Chunk::in_frame(std::mem::take(frame), start, end);
    Some(Ok(NetMsg::Peer(PeerMsg::CatchUpResp {
        epoch,
        stream,
        from,
        next,
        full_copy,
        entries,
    })))
}
