//! A blocking RESP client over std TCP, one command in flight, with the same encoder, parser and
//! limits as the async [`super::RedisTarget`]: for load generators that run one OS thread per
//! client (the nearlog experiments) and for tests.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::{encode_command, parse_reply, Limits, Reply};

/// Bytes read from the socket at a time.
const READ_CHUNK_BYTES: usize = 16 << 10;

/// How often a refused connection is tried again while the server starts.
const CONNECT_RETRY_MS: u64 = 20;

pub struct BlockingClient {
    stream: TcpStream,
    /// Bytes received but not yet parsed; bounded by the limits (one reply at a time).
    buffer: Vec<u8>,
    out: Vec<u8>,
    /// What one read fills; only the bytes read are copied into `buffer` (replies are small:
    /// a load thread should not clear a large buffer per command).
    chunk: Box<[u8]>,
    limits: Limits,
}

impl BlockingClient {
    /// Connects to `addr`, trying again for up to `wait` while the connection is refused (a
    /// server still starting).
    pub fn connect(addr: impl ToSocketAddrs + Copy, wait: Duration) -> io::Result<BlockingClient> {
        let start = Instant::now();
        loop {
            match TcpStream::connect(addr) {
                Ok(stream) => {
                    stream.set_nodelay(true)?;
                    return Ok(BlockingClient {
                        stream,
                        buffer: Vec::new(),
                        out: Vec::new(),
                        chunk: vec![0; READ_CHUNK_BYTES].into_boxed_slice(),
                        limits: Limits::default(),
                    });
                }
                Err(_) if start.elapsed() < wait => std::thread::sleep(Duration::from_millis(CONNECT_RETRY_MS)),
                Err(e) => return Err(e),
            }
        }
    }

    /// Sends one command and waits for its reply.
    pub fn call(&mut self, args: &[&[u8]]) -> io::Result<Reply> {
        self.send(args)?;
        self.reply()
    }

    /// Sends one command without waiting for its reply (read it with [`Self::reply`]).
    pub fn send(&mut self, args: &[&[u8]]) -> io::Result<()> {
        self.out.clear();
        encode_command(&mut self.out, args);
        self.stream.write_all(&self.out)
    }

    /// Reads the next reply. A reply that breaks the protocol or a limit is `InvalidData`; the
    /// connection is then out of step and should be dropped.
    pub fn reply(&mut self) -> io::Result<Reply> {
        loop {
            match parse_reply(&self.buffer, &self.limits) {
                Ok(Some((reply, used))) => {
                    self.buffer.drain(..used);
                    return Ok(reply);
                }
                Ok(None) => {}
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
            }
            let n = self.stream.read(&mut self.chunk)?;
            self.buffer.extend_from_slice(&self.chunk[..n]);
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the server closed the connection"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a scripted server: pipelined replies split across reads are parsed in order, and
    /// a reply that breaks the protocol is an error, not a panic or a hang.
    #[test]
    fn replies_in_pieces_and_nonsense() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = [0u8; 256];
            let _ = s.read(&mut buf).unwrap();
            for piece in [&b"+O"[..], b"K\r\n$3\r", b"\nabc\r\n", b"?nonsense\r\n"] {
                s.write_all(piece).unwrap();
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        let mut c = BlockingClient::connect(addr, Duration::from_secs(5)).unwrap();
        assert_eq!(c.call(&[b"SET", b"k", b"v"]).unwrap(), Reply::Simple("OK".into()));
        assert_eq!(c.reply().unwrap(), Reply::Bulk(Some(b"abc".to_vec())));
        assert_eq!(c.reply().unwrap_err().kind(), io::ErrorKind::InvalidData);
        server.join().unwrap();
    }
}
