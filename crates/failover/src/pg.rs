//! A tiny PostgreSQL client: the frontend/backend protocol 3.0, startup with `trust`
//! authentication and the simple query protocol, nothing more. It is what the health check
//! (`SELECT 1`, read-only) and the load generator need to talk to an unmodified `postgres`
//! through the endpoint, without a driver crate.
//!
//! Every message read is bounded by [`MAX_MESSAGE_BYTES`]; every call by the caller's timeout.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Largest backend message accepted (a `SELECT id FROM commits` row is a few bytes; the limit
/// only stops a confused peer from making us allocate without bound).
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;
/// Largest result (all rows of one query) accepted.
pub const MAX_RESULT_BYTES: usize = 256 << 20;

#[derive(Debug, thiserror::Error)]
pub enum PgError {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("timed out")]
    Timeout,
    /// An `ErrorResponse`: SQLSTATE and message (e.g. 57P03 "the database system is starting up").
    #[error("server error {code}: {message}")]
    Server { code: String, message: String },
    #[error("protocol: {0}")]
    Protocol(String),
    #[error("authentication method {0} is not supported (use trust)")]
    Auth(i32),
}

impl PgError {
    /// A unique violation: the row was inserted before (a retried id that had in fact committed).
    pub fn is_unique_violation(&self) -> bool {
        matches!(self, PgError::Server { code, .. } if code == "23505")
    }
}

/// One connection.
pub struct PgConn {
    s: BufReader<TcpStream>,
    timeout: Duration,
}

/// One row: each column as text (None: NULL).
pub type Row = Vec<Option<String>>;

impl PgConn {
    /// Connects and authenticates (trust) as `user` to `database`; each step within `timeout`.
    pub async fn connect(addr: SocketAddr, user: &str, database: &str, timeout: Duration) -> Result<PgConn, PgError> {
        let s = tokio::time::timeout(timeout, TcpStream::connect(addr)).await.map_err(|_| PgError::Timeout)??;
        let _ = s.set_nodelay(true);
        let mut c = PgConn { s: BufReader::new(s), timeout };
        let mut body = Vec::new();
        body.extend_from_slice(&196_608i32.to_be_bytes()); // protocol 3.0
        for (k, v) in [("user", user), ("database", database), ("application_name", "understudy")] {
            body.extend_from_slice(k.as_bytes());
            body.push(0);
            body.extend_from_slice(v.as_bytes());
            body.push(0);
        }
        body.push(0);
        let mut msg = ((body.len() + 4) as i32).to_be_bytes().to_vec();
        msg.extend_from_slice(&body);
        c.write(&msg).await?;
        loop {
            let (t, b) = c.read_msg().await?;
            match t {
                b'R' => {
                    let code = i32::from_be_bytes(b.get(..4).ok_or_else(|| PgError::Protocol("short auth message".into()))?.try_into().unwrap());
                    if code != 0 {
                        return Err(PgError::Auth(code));
                    }
                }
                b'E' => return Err(server_error(&b)),
                b'Z' => return Ok(c),
                // ParameterStatus, BackendKeyData, NoticeResponse
                _ => {}
            }
        }
    }

    async fn write(&mut self, b: &[u8]) -> Result<(), PgError> {
        tokio::time::timeout(self.timeout, async {
            self.s.get_mut().write_all(b).await?;
            self.s.get_mut().flush().await
        })
        .await
        .map_err(|_| PgError::Timeout)??;
        Ok(())
    }

    async fn read_msg(&mut self) -> Result<(u8, Vec<u8>), PgError> {
        tokio::time::timeout(self.timeout, async {
            let t = self.s.read_u8().await?;
            let len = self.s.read_i32().await?;
            if len < 4 || len as usize - 4 > MAX_MESSAGE_BYTES {
                return Err(PgError::Protocol(format!("message length {len} out of bounds")));
            }
            let mut b = vec![0; len as usize - 4];
            self.s.read_exact(&mut b).await?;
            Ok((t, b))
        })
        .await
        .map_err(|_| PgError::Timeout)?
    }

    /// Runs `sql` (simple query protocol, autocommit) and returns the rows of its last
    /// statement. Returns once the server is ready for the next query: for an `INSERT` that
    /// means the commit is durable (synchronous_commit = on).
    pub async fn query(&mut self, sql: &str) -> Result<Vec<Row>, PgError> {
        let mut msg = vec![b'Q'];
        msg.extend_from_slice(&((sql.len() + 5) as i32).to_be_bytes());
        msg.extend_from_slice(sql.as_bytes());
        msg.push(0);
        self.write(&msg).await?;
        let mut rows = vec![];
        let mut total = 0usize;
        let mut err = None;
        loop {
            let (t, b) = self.read_msg().await?;
            match t {
                b'T' => rows.clear(),
                b'D' => {
                    total += b.len();
                    if total > MAX_RESULT_BYTES {
                        return Err(PgError::Protocol(format!("result larger than {MAX_RESULT_BYTES} bytes")));
                    }
                    rows.push(parse_row(&b)?);
                }
                b'E' => err = Some(server_error(&b)),
                b'Z' => return err.map_or(Ok(rows), Err),
                // CommandComplete, EmptyQueryResponse, NoticeResponse, ParameterStatus
                _ => {}
            }
        }
    }

    /// Ends the session politely.
    pub async fn close(mut self) {
        let _ = self.write(&[b'X', 0, 0, 0, 4]).await;
    }
}

fn parse_row(b: &[u8]) -> Result<Row, PgError> {
    let bad = || PgError::Protocol("malformed DataRow".into());
    let n = i16::from_be_bytes(b.get(..2).ok_or_else(bad)?.try_into().unwrap());
    let mut at = 2;
    let mut row = Vec::with_capacity(n.max(0) as usize);
    for _ in 0..n {
        let len = i32::from_be_bytes(b.get(at..at + 4).ok_or_else(bad)?.try_into().unwrap());
        at += 4;
        if len < 0 {
            row.push(None);
        } else {
            let v = b.get(at..at + len as usize).ok_or_else(bad)?;
            row.push(Some(String::from_utf8_lossy(v).into_owned()));
            at += len as usize;
        }
    }
    Ok(row)
}

fn server_error(b: &[u8]) -> PgError {
    let (mut code, mut message) = (String::new(), String::new());
    for field in b.split(|c| *c == 0) {
        match field.first() {
            Some(b'C') => code = String::from_utf8_lossy(&field[1..]).into_owned(),
            Some(b'M') => message = String::from_utf8_lossy(&field[1..]).into_owned(),
            _ => {}
        }
    }
    PgError::Server { code, message }
}

/// Quotes a string as an SQL literal.
pub fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_and_errors_parse() {
        let mut b = 2i16.to_be_bytes().to_vec();
        b.extend_from_slice(&1i32.to_be_bytes());
        b.push(b'7');
        b.extend_from_slice(&(-1i32).to_be_bytes());
        assert_eq!(parse_row(&b).unwrap(), vec![Some("7".into()), None]);
        assert!(parse_row(&b[..5]).is_err());
        let e = server_error(b"SFATAL\0C57P03\0Mthe database system is starting up\0\0");
        assert_eq!(e.to_string(), "server error 57P03: the database system is starting up");
        assert_eq!(literal("it's"), "'it''s'");
    }
}
