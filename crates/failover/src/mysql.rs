//! A tiny MySQL/MariaDB client: the classic protocol (handshake v10, `mysql_native_password`
//! with an empty password, text queries), nothing more. It is what the health check and the load
//! generator need to talk to an unmodified `mariadbd` through the endpoint.
//!
//! Every packet read is bounded by [`MAX_PACKET_BYTES`]; every call by the caller's timeout.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Largest packet accepted (one packet: no multi-packet results are needed here).
pub const MAX_PACKET_BYTES: usize = (1 << 24) - 1;
/// Largest result (all rows of one query) accepted.
pub const MAX_RESULT_BYTES: usize = 256 << 20;

#[derive(Debug, thiserror::Error)]
pub enum MyError {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("timed out")]
    Timeout,
    #[error("server error {code} ({state}): {message}")]
    Server { code: u16, state: String, message: String },
    #[error("protocol: {0}")]
    Protocol(String),
}

const CLIENT_LONG_PASSWORD: u32 = 1;
const CLIENT_PROTOCOL_41: u32 = 0x200;
const CLIENT_TRANSACTIONS: u32 = 0x2000;
const CLIENT_SECURE_CONNECTION: u32 = 0x8000;
const CLIENT_PLUGIN_AUTH: u32 = 0x80000;

pub struct MyConn {
    s: BufReader<TcpStream>,
    timeout: Duration,
    seq: u8,
}

pub type Row = Vec<Option<String>>;

impl MyConn {
    /// Connects as `user` with an empty password.
    pub async fn connect(addr: SocketAddr, user: &str, timeout: Duration) -> Result<MyConn, MyError> {
        let s = tokio::time::timeout(timeout, TcpStream::connect(addr)).await.map_err(|_| MyError::Timeout)??;
        let _ = s.set_nodelay(true);
        let mut c = MyConn { s: BufReader::new(s), timeout, seq: 0 };
        let hello = c.read_packet().await?;
        match hello.first() {
            Some(10) => {}
            Some(0xff) => return Err(server_error(&hello)),
            other => return Err(MyError::Protocol(format!("unexpected handshake version {other:?}"))),
        }
        let mut r = vec![];
        let caps = CLIENT_LONG_PASSWORD | CLIENT_PROTOCOL_41 | CLIENT_TRANSACTIONS | CLIENT_SECURE_CONNECTION | CLIENT_PLUGIN_AUTH;
        r.extend_from_slice(&caps.to_le_bytes());
        r.extend_from_slice(&(MAX_PACKET_BYTES as u32).to_le_bytes());
        r.push(45); // utf8mb4_general_ci
        r.extend_from_slice(&[0; 23]);
        r.extend_from_slice(user.as_bytes());
        r.push(0);
        r.push(0); // empty auth response: no password
        r.extend_from_slice(b"mysql_native_password\0");
        c.write_packet(&r).await?;
        loop {
            let p = c.read_packet().await?;
            match p.first() {
                Some(0x00) => return Ok(c),
                Some(0xff) => return Err(server_error(&p)),
                // Auth switch (or more data): the answer for an empty password is empty.
                Some(0xfe) | Some(0x01) => c.write_packet(&[]).await?,
                other => return Err(MyError::Protocol(format!("unexpected auth reply {other:?}"))),
            }
        }
    }

    async fn write_packet(&mut self, payload: &[u8]) -> Result<(), MyError> {
        let mut b = Vec::with_capacity(payload.len() + 4);
        b.extend_from_slice(&(payload.len() as u32).to_le_bytes()[..3]);
        b.push(self.seq);
        self.seq = self.seq.wrapping_add(1);
        b.extend_from_slice(payload);
        tokio::time::timeout(self.timeout, async {
            self.s.get_mut().write_all(&b).await?;
            self.s.get_mut().flush().await
        })
        .await
        .map_err(|_| MyError::Timeout)??;
        Ok(())
    }

    async fn read_packet(&mut self) -> Result<Vec<u8>, MyError> {
        let (seq, p) = tokio::time::timeout(self.timeout, async {
            let mut h = [0u8; 4];
            self.s.read_exact(&mut h).await?;
            let len = u32::from_le_bytes([h[0], h[1], h[2], 0]) as usize;
            if len >= MAX_PACKET_BYTES {
                return Err(MyError::Protocol("multi-packet payloads are not supported".into()));
            }
            let mut p = vec![0; len];
            self.s.read_exact(&mut p).await?;
            Ok((h[3], p))
        })
        .await
        .map_err(|_| MyError::Timeout)??;
        self.seq = seq.wrapping_add(1);
        Ok(p)
    }

    /// Runs one statement (autocommit) and returns its rows. For an `INSERT` the OK packet
    /// comes after the commit is durable (flush at commit = 1).
    pub async fn query(&mut self, sql: &str) -> Result<Vec<Row>, MyError> {
        self.seq = 0;
        let mut p = vec![0x03];
        p.extend_from_slice(sql.as_bytes());
        self.write_packet(&p).await?;
        let first = self.read_packet().await?;
        match first.first() {
            Some(0x00) => return Ok(vec![]),
            Some(0xff) => return Err(server_error(&first)),
            _ => {}
        }
        let (ncols, _) = lenenc_int(&first, 0).ok_or_else(|| MyError::Protocol("bad column count".into()))?;
        for _ in 0..ncols {
            self.read_packet().await?;
        }
        let eof = self.read_packet().await?;
        if eof.first() != Some(&0xfe) {
            return Err(MyError::Protocol("no EOF after column definitions".into()));
        }
        let mut rows = vec![];
        let mut total = 0;
        loop {
            let p = self.read_packet().await?;
            match p.first() {
                Some(0xfe) if p.len() < 9 => return Ok(rows),
                Some(0xff) => return Err(server_error(&p)),
                _ => {}
            }
            total += p.len();
            if total > MAX_RESULT_BYTES {
                return Err(MyError::Protocol(format!("result larger than {MAX_RESULT_BYTES} bytes")));
            }
            let mut at = 0;
            let mut row = Vec::with_capacity(ncols as usize);
            for _ in 0..ncols {
                if p.get(at) == Some(&0xfb) {
                    row.push(None);
                    at += 1;
                    continue;
                }
                let (len, n) = lenenc_int(&p, at).ok_or_else(|| MyError::Protocol("bad row".into()))?;
                at += n;
                let v = p.get(at..at + len as usize).ok_or_else(|| MyError::Protocol("short row".into()))?;
                row.push(Some(String::from_utf8_lossy(v).into_owned()));
                at += len as usize;
            }
            rows.push(row);
        }
    }

    pub async fn close(mut self) {
        self.seq = 0;
        let _ = self.write_packet(&[0x01]).await;
    }
}

/// A length-encoded integer at `at`: (value, bytes used).
fn lenenc_int(b: &[u8], at: usize) -> Option<(u64, usize)> {
    let first = *b.get(at)?;
    let le = |n: usize| -> Option<u64> {
        let s = b.get(at + 1..at + 1 + n)?;
        let mut v = [0u8; 8];
        v[..n].copy_from_slice(s);
        Some(u64::from_le_bytes(v))
    };
    Some(match first {
        x if x < 0xfb => (x as u64, 1),
        0xfc => (le(2)?, 3),
        0xfd => (le(3)?, 4),
        0xfe => (le(8)?, 9),
        _ => return None,
    })
}

fn server_error(p: &[u8]) -> MyError {
    let code = p.get(1..3).map(|c| u16::from_le_bytes([c[0], c[1]])).unwrap_or(0);
    let (state, msg) = if p.get(3) == Some(&b'#') {
        (String::from_utf8_lossy(p.get(4..9).unwrap_or_default()).into_owned(), p.get(9..).unwrap_or_default())
    } else {
        (String::new(), p.get(3..).unwrap_or_default())
    };
    MyError::Server { code, state, message: String::from_utf8_lossy(msg).into_owned() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lenenc_and_errors_parse() {
        assert_eq!(lenenc_int(&[5], 0), Some((5, 1)));
        assert_eq!(lenenc_int(&[0xfc, 1, 2], 0), Some((0x201, 3)));
        assert_eq!(lenenc_int(&[0xfc, 1], 0), None);
        let e = server_error(b"\xff\x15\x04#28000Access denied");
        assert_eq!(e.to_string(), "server error 1045 (28000): Access denied");
    }
}
