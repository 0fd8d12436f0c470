//! Blocking (std-only) client transport: framed messages over `TcpStream` and the client side of
//! `wire::auth`'s mutual HMAC handshake. Used by the LD_PRELOAD shim, which must not start a
//! tokio runtime inside an application; it speaks exactly the protocol of `wire::auth::accept`.
//!
//! A connection runs over mutual TLS when this process's link setting wants it for the dialed
//! address (`UNDERSTUDY_LINK_TLS*`, [`wire::link`]; off the machine by default once certificate
//! files are given), as the daemons' links do: rustls is synchronous at its core, so a
//! [`Conn`] is a `rustls::StreamOwned` over the `TcpStream` (no runtime, no thread).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use serde::{de::DeserializeOwned, Serialize};
use wire::auth::{check_server_proof, client_answer, HELLO_BYTES, PROOF_BYTES};
use wire::tls::rustls;
use wire::WireError;

/// A blocking nearlog connection: plain TCP, or TLS over TCP (the client side, or the server
/// side of a log peer's data-path thread).
pub enum Conn {
    Plain(TcpStream),
    TlsClient(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
    TlsServer(Box<rustls::StreamOwned<rustls::ServerConnection, TcpStream>>),
}

impl Conn {
    /// The TCP stream under the connection (socket options, `poll`).
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Conn::Plain(s) => s,
            Conn::TlsClient(t) => &t.sock,
            Conn::TlsServer(t) => &t.sock,
        }
    }

    pub fn is_tls(&self) -> bool {
        !matches!(self, Conn::Plain(_))
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        self.tcp().set_read_timeout(t)
    }

    /// One read for a caller that found the socket readable (`poll`): at most one `read`
    /// system call, so it does not block once the kernel's bytes are taken. On TLS: the
    /// plaintext the session holds already, else one read of TLS bytes; if they complete no
    /// record of data (part of a record, a session ticket), `WouldBlock`: nothing yet, not an
    /// end. Ok(0): the peer closed.
    pub fn read_ready(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Conn::Plain(s) => s.read(buf),
            Conn::TlsClient(t) => read_tls_once(&mut t.conn, &mut t.sock, buf),
            Conn::TlsServer(t) => read_tls_once(&mut t.conn, &mut t.sock, buf),
        }
    }

    /// Plaintext the TLS session has decrypted and not handed out yet: the socket does not show
    /// it to `poll`, so a reader asks here before it waits.
    pub fn buffered_plaintext(&mut self) -> usize {
        let state = match self {
            Conn::Plain(_) => return 0,
            Conn::TlsClient(t) => t.conn.process_new_packets(),
            Conn::TlsServer(t) => t.conn.process_new_packets(),
        };
        state.map(|s| s.plaintext_bytes_to_read()).unwrap_or(0)
    }

    /// Whether encrypted bytes wait to go out (see [`Conn::send_ready`]).
    pub fn tls_pending(&self) -> bool {
        match self {
            Conn::Plain(_) => false,
            Conn::TlsClient(t) => t.conn.wants_write(),
            Conn::TlsServer(t) => t.conn.wants_write(),
        }
    }

    /// Sends what the socket takes of `buf` without blocking (`MSG_DONTWAIT`: the socket
    /// itself stays blocking for the calls that wait for a reply); the bytes of `buf` consumed.
    /// On TLS the consumed bytes are encrypted into the session, which sends what the socket
    /// takes and keeps the rest ([`Conn::tls_pending`]) for the next call, which sends it
    /// first. `WouldBlock` never escapes: it means "later".
    pub fn send_ready(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let fd = self.as_raw_fd();
        let mut sock = DontWait(fd);
        let (conn, sock): (&mut dyn TlsSend, _) = match self {
            Conn::Plain(_) => {
                let mut done = 0;
                while done < buf.len() {
                    match sock.write(&buf[done..]) {
                        Ok(n) => done += n,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) => return Err(e),
                    }
                }
                return Ok(done);
            }
            Conn::TlsClient(t) => (&mut t.conn, &mut sock),
            Conn::TlsServer(t) => (&mut t.conn, &mut sock),
        };
        let mut done = 0;
        loop {
            while conn.wants_write() {
                match conn.write_tls(sock) {
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(done),
                    Err(e) => return Err(e),
                }
            }
            if done == buf.len() {
                return Ok(done);
            }
            // Takes up to the session's buffer limit; the loop sends it and comes back.
            let n = conn.write_plain(&buf[done..])?;
            if n == 0 {
                return Ok(done);
            }
            done += n;
        }
    }
}

/// The sending half of a TLS session of either side.
trait TlsSend {
    fn wants_write(&self) -> bool;
    fn write_tls(&mut self, to: &mut DontWait) -> std::io::Result<usize>;
    fn write_plain(&mut self, buf: &[u8]) -> std::io::Result<usize>;
}

impl<C, D> TlsSend for C
where
    C: std::ops::DerefMut<Target = rustls::ConnectionCommon<D>>,
{
    fn wants_write(&self) -> bool {
        (**self).wants_write()
    }
    fn write_tls(&mut self, to: &mut DontWait) -> std::io::Result<usize> {
        (**self).write_tls(to)
    }
    fn write_plain(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        (**self).writer().write(buf)
    }
}

/// A socket written with `MSG_DONTWAIT | MSG_NOSIGNAL`: a full socket is `WouldBlock`, a closed
/// one an error (never SIGPIPE inside an application).
struct DontWait(RawFd);

impl Write for DontWait {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        loop {
            // SAFETY: sending from a valid buffer within its bounds on our own connection's fd.
            let n = unsafe { libc::send(self.0, buf.as_ptr() as *const libc::c_void, buf.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// [`Conn::read_ready`] on a TLS session of either side.
fn read_tls_once<D>(conn: &mut rustls::ConnectionCommon<D>, sock: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut read = false;
    loop {
        match conn.reader().read(buf) {
            Ok(n) => return Ok(n), // 0: the peer's close_notify
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        if read {
            return Err(std::io::Error::new(std::io::ErrorKind::WouldBlock, "no complete TLS record yet"));
        }
        read = true;
        let n = loop {
            match conn.read_tls(sock) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                r => break r?,
            }
        };
        if n == 0 {
            return Ok(0);
        }
        if let Err(e) = conn.process_new_packets() {
            // The alert that tells the peer why is sent on a best-effort basis.
            let _ = conn.write_tls(sock);
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e));
        }
    }
}

impl AsRawFd for Conn {
    fn as_raw_fd(&self) -> RawFd {
        self.tcp().as_raw_fd()
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Conn::Plain(s) => s.read(buf),
            Conn::TlsClient(t) => t.read(buf),
            Conn::TlsServer(t) => t.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Conn::Plain(s) => s.write(buf),
            Conn::TlsClient(t) => t.write(buf),
            Conn::TlsServer(t) => t.write(buf),
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match self {
            Conn::Plain(s) => s.write_all(buf),
            // StreamOwned::write only encrypts into the session's buffer and sends what the
            // socket takes; flush sends the rest (a frame must be out when a call waits for
            // its reply).
            Conn::TlsClient(t) => {
                t.write_all(buf)?;
                t.flush()
            }
            Conn::TlsServer(t) => {
                t.write_all(buf)?;
                t.flush()
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Conn::Plain(s) => s.flush(),
            Conn::TlsClient(t) => t.flush(),
            Conn::TlsServer(t) => t.flush(),
        }
    }
}

/// Client side of `wire::auth`: returns once the server proved it knows `secret`.
pub fn auth_connect(s: &mut impl ReadWrite, secret: &[u8]) -> Result<(), WireError> {
    let mut hello = [0u8; HELLO_BYTES];
    s.read_exact(&mut hello).map_err(|_| WireError::Auth("peer closed during handshake".into()))?;
    let (answer, want) = client_answer(&hello, secret)?;
    s.write_all(&answer)?;
    let mut server_mac = [0u8; PROOF_BYTES];
    s.read_exact(&mut server_mac).map_err(|_| WireError::Auth("server refused our cluster secret".into()))?;
    check_server_proof(&server_mac, &want)
}

/// A byte stream both ways (a [`Conn`], or a bare `TcpStream` in tests).
pub trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// This process's link TLS setting (`UNDERSTUDY_LINK_TLS*`, read once), or why it is unusable.
pub fn link_tls() -> Result<Option<&'static wire::link::LinkTls>, WireError> {
    wire::link::process()
}

/// Client side of TLS over `sock` when `tls` wants it for the peer `sock` is connected to:
/// the handshake completes here (bounded by the socket's timeouts), so a refused certificate
/// shows as this call's error.
pub fn tls_connect(sock: TcpStream, tls: Option<&wire::link::LinkTls>) -> Result<Conn, WireError> {
    let peer = sock.peer_addr()?;
    let Some(t) = tls.filter(|t| t.wants_tls(peer)) else { return Ok(Conn::Plain(sock)) };
    let name = rustls::pki_types::ServerName::IpAddress(peer.ip().into());
    let conn = rustls::ClientConnection::new(t.client_config().clone(), name).map_err(|e| WireError::Tls(format!("TLS to {peer}: {e}")))?;
    let mut s = rustls::StreamOwned::new(conn, sock);
    while s.conn.is_handshaking() {
        s.conn.complete_io(&mut s.sock).map_err(|e| WireError::Tls(format!("TLS to {peer}: {e}")))?;
    }
    Ok(Conn::TlsClient(Box::new(s)))
}

/// Connects (TLS as this process's link setting wants it, [`link_tls`]), authenticates and sets
/// TCP_NODELAY (records are small and latency-bound).
pub fn connect(addr: &str, secret: &[u8], timeout: Duration) -> Result<Conn, WireError> {
    use std::net::ToSocketAddrs;
    let tls = link_tls()?;
    let sa = addr.to_socket_addrs()?.next().ok_or_else(|| WireError::Decode(format!("cannot resolve {addr}")))?;
    let s = TcpStream::connect_timeout(&sa, timeout)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let mut s = tls_connect(s, tls)?;
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
pub fn connect_any(list: &str, secret: &[u8], timeout: Duration) -> Result<Conn, WireError> {
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

pub fn send<M: Serialize>(s: &mut impl Write, msg: &M) -> Result<(), WireError> {
    s.write_all(&wire::encode_frame(msg)?)?;
    Ok(())
}

pub fn recv<M: DeserializeOwned>(s: &mut impl Read, limit: usize) -> Result<M, WireError> {
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
pub fn call<Q: Serialize, A: DeserializeOwned>(s: &mut impl ReadWrite, req: &Q, limit: usize) -> Result<A, WireError> {
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
    /// On TLS `WouldBlock` means no data yet ([`Conn::read_ready`]).
    pub fn fill(&mut self, s: &mut Conn) -> std::io::Result<usize> {
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
            match s.read_ready(&mut self.buf[self.end..]) {
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

    /// A TestPki in a temp dir: this process's link identity under `policy`, and the server side
    /// of a blocking TLS session for the test's end.
    fn pki(policy: wire::link::LinkPolicy) -> (tempfile::TempDir, wire::link::LinkTls, std::sync::Arc<rustls::ServerConfig>) {
        let d = tempfile::tempdir().unwrap();
        let p = wire::tls::TestPki::write(d.path());
        let files = p.server_files(true);
        (d, wire::link::LinkTls::from_files(&files, policy).unwrap(), wire::tls::server_config(&files).unwrap())
    }

    /// The frame reader and the non-blocking sender over TLS: frames split anywhere across
    /// records and reads (`read_ready` says WouldBlock, never "closed", while a record is
    /// incomplete), a send larger than the socket takes at once goes out over later calls, and
    /// a plain client is refused by the TLS server.
    #[test]
    fn tls_frames_split_anywhere_and_sends_that_do_not_block() {
        const BIG_BYTES: usize = 32 << 20;
        let (_d, tls, srv_cfg) = pki(wire::link::LinkPolicy::Always);
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let msgs: Vec<Vec<u8>> = [10usize, 3 * FILL_BYTES + 17, 1, 0, 700].iter().map(|&n| (0..n).map(|i| (i % 251) as u8).collect()).collect();
        let sent = msgs.clone();
        let w = std::thread::spawn(move || {
            let (sock, _) = l.accept().unwrap();
            let mut s = rustls::StreamOwned::new(rustls::ServerConnection::new(srv_cfg.clone()).unwrap(), sock);
            let mut bytes = Vec::new();
            for m in &sent {
                encode_into(m, &mut bytes).unwrap();
            }
            // Odd-sized records with pauses: frames, headers and records arrive split.
            for piece in bytes.chunks(40_000 - 3) {
                s.write_all(piece).unwrap();
                s.flush().unwrap();
                std::thread::sleep(Duration::from_millis(2));
            }
            // Then it takes a large message from the client, slowly at first.
            std::thread::sleep(Duration::from_millis(300));
            let big: Vec<u8> = recv(&mut s, BIG_BYTES + 64).unwrap();
            send(&mut s, &(big.len() as u64)).unwrap();
            // A plain client on the same listener gets no session.
            let (sock, _) = l.accept().unwrap();
            let mut s = rustls::StreamOwned::new(rustls::ServerConnection::new(srv_cfg).unwrap(), sock);
            let mut b = [0u8; 1];
            s.read(&mut b).is_err()
        });
        let sock = TcpStream::connect(addr).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut s = tls_connect(sock, Some(&tls)).unwrap();
        assert!(s.is_tls());
        let mut r = FrameReader::default();
        let mut got: Vec<Vec<u8>> = Vec::new();
        let mut would_block = 0;
        while got.len() < msgs.len() {
            let mut pf = libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            if s.buffered_plaintext() == 0 {
                // SAFETY: one valid pollfd.
                assert!(unsafe { libc::poll(&mut pf, 1, 20_000) } > 0, "nothing within 20 s after {} frames", got.len());
            }
            match r.fill(&mut s) {
                Ok(n) => assert!(n > 0, "closed early after {} frames", got.len()),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => would_block += 1,
                Err(e) => panic!("{e}"),
            }
            while let Some(m) = r.next::<Vec<u8>>(crate::proto::MAX_FRAME_BYTES).unwrap() {
                got.push(m);
            }
        }
        assert_eq!(got, msgs);
        eprintln!("{would_block} reads completed no record");
        // More than the loopback socket buffers (a few MiB) take while the server sleeps.
        let big = encode(&vec![7u8; BIG_BYTES]).unwrap();
        let mut at = s.send_ready(&big).unwrap();
        assert!(at < big.len() || s.tls_pending(), "{BIG_BYTES} bytes went out at once while the peer slept");
        let t0 = std::time::Instant::now();
        while at < big.len() || s.tls_pending() {
            assert!(t0.elapsed() < Duration::from_secs(30), "the send never finished");
            let mut pf = libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut pf, 1, 1000) };
            at += s.send_ready(&big[at..]).unwrap();
        }
        let n: u64 = recv(&mut s, 1024).unwrap();
        assert_eq!(n, BIG_BYTES as u64);
        // A plain client: the server's handshake fails on its bytes.
        let mut plain = TcpStream::connect(addr).unwrap();
        plain.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let _ = plain.write_all(&encode(&crate::proto::PeerRequest::Stats).unwrap());
        assert!(w.join().unwrap(), "the TLS server read a plain client's bytes as data");
    }

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
        let mut s = Conn::Plain(l.accept().unwrap().0);
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
