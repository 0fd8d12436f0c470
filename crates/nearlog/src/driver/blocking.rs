//! Blocking (std-only) client transport: framed messages over `TcpStream` and the client side of
//! `wire::auth`'s mutual HMAC handshake. Used by the LD_PRELOAD shim, which must not start a
//! tokio runtime inside an application; it speaks exactly the protocol of `wire::auth::accept`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde::{de::DeserializeOwned, Serialize};
use wire::auth::{check_server_proof, client_answer, HELLO_BYTES, PROOF_BYTES};
use wire::WireError;

/// Client side of `wire::auth`: returns once the server proved it knows `secret`.
pub fn auth_connect(s: &mut TcpStream, secret: &[u8]) -> Result<(), WireError> {
    let mut hello = [0u8; HELLO_BYTES];
    s.read_exact(&mut hello).map_err(|_| WireError::Auth("peer closed during handshake".into()))?;
    let (answer, want) = client_answer(&hello, secret)?;
    s.write_all(&answer)?;
    let mut server_mac = [0u8; PROOF_BYTES];
    s.read_exact(&mut server_mac).map_err(|_| WireError::Auth("server refused our cluster secret".into()))?;
    check_server_proof(&server_mac, &want)
}

/// Connects, authenticates and sets TCP_NODELAY (records are small and latency-bound).
pub fn connect(addr: &str, secret: &[u8], timeout: Duration) -> Result<TcpStream, WireError> {
    use std::net::ToSocketAddrs;
    let sa = addr.to_socket_addrs()?.next().ok_or_else(|| WireError::Decode(format!("cannot resolve {addr}")))?;
    let mut s = TcpStream::connect_timeout(&sa, timeout)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    auth_connect(&mut s, secret)?;
    Ok(s)
}

/// How long a controller call waits, in all, for one of several listed controllers to accept
/// while none does (a standby takes over about one election lease after the leader died: 2 s
/// by default); then the caller gets the error (EIO in the shim). Bounded, and paid once per
/// outage, not per call: the shim blocks inside applications, and one `open` asks the
/// controller several times.
pub const CONTROLLER_FAILOVER_WAIT_MS: u64 = 10_000;
/// The connect timeout of [`connect_any`]'s first round over several controller addresses.
/// Hundreds of times a connect and handshake to a live controller on a host of its own.
pub const CONTROLLER_FIRST_ROUND_CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// Pause between two rounds over the controller list.
pub const CONTROLLER_RETRY_PAUSE_MS: u64 = 200;

/// When a wait for a listed controller last ran out (in this process): until a controller
/// answers again, calls try each address once and fail at once.
static CONTROLLERS_DOWN: std::sync::Mutex<bool> = std::sync::Mutex::new(false);

/// The controller address that answered [`connect_any`] last in this process, tried first the
/// next time. Trying the list in its given order cost every call a whole connect timeout while
/// the first address's host was dead (a dead host refuses nothing: its port does not answer),
/// and a shim that asks the controller often (opening a file, reading one back) took minutes.
static LAST_ANSWERED: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// Connects to the first of `list` (controller addresses separated by commas; a single address
/// is a list of one) that accepts and authenticates. Only the leading controller listens (a
/// standby refuses the connection at once), so no "not leader" reply is needed: whichever
/// answers leads, or led until its lease ran out, after which it exits and its connections
/// close. With several addresses, rounds repeat for up to [`CONTROLLER_FAILOVER_WAIT_MS`] (a
/// takeover in progress); a single address is tried once, as before standbys existed.
pub fn connect_any(list: &str, secret: &[u8], timeout: Duration) -> Result<TcpStream, WireError> {
    let mut addrs: Vec<&str> = list.split(',').map(str::trim).filter(|a| !a.is_empty()).collect();
    // The controller that answered last goes first: it most likely still leads.
    if let Some(last) = LAST_ANSWERED.lock().unwrap_or_else(|e| e.into_inner()).as_deref() {
        if let Some(i) = addrs.iter().position(|a| *a == last) {
            addrs[..=i].rotate_right(1);
        }
    }
    if addrs.is_empty() {
        return Err(WireError::Decode(format!("no controller address in {list:?}")));
    }
    let down = |d: bool| *CONTROLLERS_DOWN.lock().unwrap_or_else(|e| e.into_inner()) = d;
    let wait = addrs.len() > 1 && !*CONTROLLERS_DOWN.lock().unwrap_or_else(|e| e.into_inner());
    let deadline = std::time::Instant::now() + Duration::from_millis(if wait { CONTROLLER_FAILOVER_WAIT_MS } else { 0 });
    let mut round = 0;
    loop {
        let mut errors = Vec::new();
        // The first round over several addresses is optimistic: a dead host's address costs
        // the short timeout, not `timeout` (issue 24: every fresh process under the shim paid
        // 5 s on its first call while the first listed controller's host was dead). A live
        // leader too slow for it is dialled again, patiently, in the next round.
        let this_timeout = if round == 0 && wait { timeout.min(CONTROLLER_FIRST_ROUND_CONNECT_TIMEOUT) } else { timeout };
        round += 1;
        for a in &addrs {
            match connect(a, secret, this_timeout) {
                Ok(s) => {
                    down(false);
                    *LAST_ANSWERED.lock().unwrap_or_else(|e| e.into_inner()) = Some(a.to_string());
                    return Ok(s);
                }
                Err(e) => errors.push(format!("{a}: {e}")),
            }
        }
        if std::time::Instant::now() + Duration::from_millis(CONTROLLER_RETRY_PAUSE_MS) >= deadline {
            if addrs.len() == 1 {
                return Err(WireError::Io(std::io::Error::other(errors.remove(0))));
            }
            down(true);
            let waited = if wait { format!(" within {CONTROLLER_FAILOVER_WAIT_MS} ms") } else { " (none answered the last wait either)".into() };
            return Err(WireError::Io(std::io::Error::other(format!("no controller answered{waited}: {}", errors.join("; ")))));
        }
        std::thread::sleep(Duration::from_millis(CONTROLLER_RETRY_PAUSE_MS));
    }
}

/// One frame (`wire` framing) holding `msg`.
pub fn encode<M: Serialize>(msg: &M) -> Result<Vec<u8>, WireError> {
    wire::encode_frame(msg)
}

/// Appends one frame holding `msg` to `out` (the batch buffer of a connection).
/// The payload is serialised in place (no buffer of its own per message), then the header is
/// filled in: the same bytes as `wire::encode_frame`.
pub fn encode_into<M: Serialize>(msg: &M, out: &mut Vec<u8>) -> Result<(), WireError> {
    let start = out.len();
    out.extend_from_slice(&[0; wire::FRAME_HEADER_BYTES]);
    if let Err(e) = postcard::to_io(msg, &mut *out) {
        out.truncate(start);
        return Err(WireError::Decode(e.to_string()));
    }
    let body = start + wire::FRAME_HEADER_BYTES;
    let len = (out.len() - body) as u32;
    let crc = crc32c::crc32c(&out[body..]);
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    out[start + 4..body].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

pub fn send<M: Serialize>(s: &mut TcpStream, msg: &M) -> Result<(), WireError> {
    s.write_all(&wire::encode_frame(msg)?)?;
    Ok(())
}

pub fn recv<M: DeserializeOwned>(s: &mut TcpStream, limit: usize) -> Result<M, WireError> {
    let mut header = [0u8; wire::FRAME_HEADER_BYTES];
    match s.read_exact(&mut header) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(WireError::Closed),
        Err(e) => return Err(e.into()),
    }
    let (len, want) = wire::parse_header(&header, limit)?;
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload)?;
    let got = crc32c::crc32c(&payload);
    if got != want {
        return Err(WireError::Checksum { got, want });
    }
    wire::decode_payload(&payload)
}

/// One request, one reply (the controller protocol).
pub fn call<Q: Serialize, A: DeserializeOwned>(s: &mut TcpStream, req: &Q, limit: usize) -> Result<A, WireError> {
    send(s, req)?;
    recv(s, limit)
}

/// Reads replies in bulk: one `read` takes every frame the kernel has, then they are parsed
/// from the buffer (instead of two reads and a poll per frame).
#[derive(Default, Debug)]
pub struct FrameReader {
    /// Received bytes not parsed yet are `buf[at..end]`; `read` fills `buf[end..]` directly.
    buf: Vec<u8>,
    at: usize,
    end: usize,
}

/// Bytes the reply buffer holds (one `read` asks for what is free of it); a larger frame grows
/// it to that frame's size while it arrives.
const FILL_BYTES: usize = 64 * 1024;

impl FrameReader {
    /// One `read` (blocks if nothing is available). Ok(0): the peer closed the connection.
    pub fn fill(&mut self, s: &mut TcpStream) -> std::io::Result<usize> {
        if self.at == self.end {
            (self.at, self.end) = (0, 0);
            if self.buf.len() > FILL_BYTES {
                self.buf = Vec::new();
            }
        }
        if self.buf.is_empty() {
            self.buf = vec![0; FILL_BYTES];
        }
        // Room for the whole frame that is arriving (its header says how long it is).
        let pending = self.end - self.at;
        let want = if pending >= wire::FRAME_HEADER_BYTES {
            let len = u32::from_le_bytes(self.buf[self.at..self.at + 4].try_into().unwrap()) as usize;
            wire::FRAME_HEADER_BYTES + len.min(crate::proto::MAX_FRAME_BYTES)
        } else {
            wire::FRAME_HEADER_BYTES
        };
        if self.buf.len() - self.at < want.max(pending + 1) || self.end == self.buf.len() {
            self.buf.copy_within(self.at..self.end, 0);
            (self.at, self.end) = (0, pending);
            if self.buf.len() < want {
                self.buf.resize(want, 0);
            }
        }
        if self.end == self.buf.len() {
            self.buf.resize(self.end + FILL_BYTES, 0); // never a read into no room (= closed)
        }
        // A signal to the application (SIGCHLD, a timer) is no reason to drop the connection.
        let n = loop {
            match s.read(&mut self.buf[self.end..]) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                r => break r?,
            }
        };
        self.end += n;
        Ok(n)
    }

    /// The next complete frame in the buffer, if any.
    pub fn next<M: DeserializeOwned>(&mut self, limit: usize) -> Result<Option<M>, WireError> {
        let rest = &self.buf[self.at..self.end];
        if rest.len() < wire::FRAME_HEADER_BYTES {
            return Ok(None);
        }
        let header: [u8; wire::FRAME_HEADER_BYTES] = rest[..wire::FRAME_HEADER_BYTES].try_into().unwrap();
        let (len, want) = wire::parse_header(&header, limit)?;
        if rest.len() - wire::FRAME_HEADER_BYTES < len {
            return Ok(None);
        }
        let payload = &rest[wire::FRAME_HEADER_BYTES..wire::FRAME_HEADER_BYTES + len];
        let got = crc32c::crc32c(payload);
        if got != want {
            return Err(WireError::Checksum { got, want });
        }
        let m = wire::decode_payload(payload)?;
        self.at += wire::FRAME_HEADER_BYTES + len;
        Ok(Some(m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_reader_reassembles_small_and_large_frames_split_anywhere() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let msgs: Vec<Vec<u8>> = [10usize, 3 * FILL_BYTES + 17, 1, FILL_BYTES - 9, 2 * FILL_BYTES, 0, 700].iter().map(|&n| (0..n).map(|i| (i % 251) as u8).collect()).collect();
        let sent = msgs.clone();
        let w = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            let mut bytes = Vec::new();
            for m in &sent {
                encode_into(m, &mut bytes).unwrap();
            }
            // Odd-sized pieces with pauses: frames and headers arrive split.
            for piece in bytes.chunks(40_000 - 3) {
                s.write_all(piece).unwrap();
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        let (mut s, _) = l.accept().unwrap();
        let mut r = FrameReader::default();
        let mut got: Vec<Vec<u8>> = Vec::new();
        while got.len() < msgs.len() {
            assert!(r.fill(&mut s).unwrap() > 0, "closed early after {} frames", got.len());
            while let Some(m) = r.next::<Vec<u8>>(crate::proto::MAX_FRAME_BYTES).unwrap() {
                got.push(m);
            }
        }
        w.join().unwrap();
        assert_eq!(got, msgs);
        assert!(r.buf.len() <= FILL_BYTES + crate::proto::MAX_FRAME_BYTES);
    }
}
