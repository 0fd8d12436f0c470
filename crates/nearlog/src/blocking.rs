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

/// One frame (`wire` framing) holding `msg`.
pub fn encode<M: Serialize>(msg: &M) -> Result<Vec<u8>, WireError> {
    wire::encode_frame(msg)
}

/// Appends one frame holding `msg` to `out` (the batch buffer of a connection).
pub fn encode_into<M: Serialize>(msg: &M, out: &mut Vec<u8>) -> Result<(), WireError> {
    let payload = postcard::to_allocvec(msg).map_err(|e| WireError::Decode(e.to_string()))?;
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
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
    buf: Vec<u8>,
    at: usize,
    /// Read target, zeroed once.
    chunk: Vec<u8>,
}

/// Bytes asked for per `read`.
const FILL_BYTES: usize = 256 * 1024;

impl FrameReader {
    /// One `read` (blocks if nothing is available). Ok(0): the peer closed the connection.
    pub fn fill(&mut self, s: &mut TcpStream) -> std::io::Result<usize> {
        if self.at > 0 && self.at == self.buf.len() {
            self.buf.clear();
            self.at = 0;
        } else if self.at > FILL_BYTES {
            self.buf.drain(..self.at);
            self.at = 0;
        }
        if self.chunk.is_empty() {
            self.chunk = vec![0; FILL_BYTES];
        }
        let n = s.read(&mut self.chunk)?;
        self.buf.extend_from_slice(&self.chunk[..n]);
        Ok(n)
    }

    /// The next complete frame in the buffer, if any.
    pub fn next<M: DeserializeOwned>(&mut self, limit: usize) -> Result<Option<M>, WireError> {
        let rest = &self.buf[self.at..];
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
