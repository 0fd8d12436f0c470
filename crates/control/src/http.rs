//! The smallest HTTP/1.1 client etcd's JSON gateway needs: one `POST` of a JSON body per
//! connection (`Connection: close`), the answer read to its end (plain or chunked).
//!
//! Why one connection per request: it keeps the client a page long and its failure modes plain
//! (a request either reached a member or did not); a control-plane decision costs one loopback or
//! LAN connect more, far below etcd's own fsync.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The largest answer read (a listing of many objects of up to 1 MiB each is refused above this,
/// with an error, rather than buffered without bound).
pub const MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;

/// How far a request got when it failed: callers may retry a request that was never sent.
#[derive(Debug)]
pub enum HttpError {
    /// No connection (refused, unreachable, timed out connecting): nothing was sent.
    Connect(String),
    /// The request was (perhaps) sent but no complete answer came.
    AfterSend(String),
}

/// An answer: status code and body.
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

/// POSTs `body` (JSON) to `http://{host_port}{path}`, connecting within `connect_timeout` and
/// with the whole exchange bounded by `timeout`.
pub async fn post(host_port: &str, path: &str, body: &[u8], connect_timeout: Duration, timeout: Duration) -> Result<Response, HttpError> {
    let mut stream = match tokio::time::timeout(connect_timeout, TcpStream::connect(host_port)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(HttpError::Connect(e.to_string())),
        Err(_) => return Err(HttpError::Connect(format!("no connection within {} ms", connect_timeout.as_millis()))),
    };
    let _ = stream.set_nodelay(true);
    let exchange = async {
        let head = format!("POST {path} HTTP/1.1\r\nHost: {host_port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body).await?;
        let mut answer = Vec::new();
        let mut chunk = [0u8; 16 * 1024];
        loop {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            if answer.len() + n > MAX_RESPONSE_BYTES {
                return Err(std::io::Error::other(format!("answer over MAX_RESPONSE_BYTES ({MAX_RESPONSE_BYTES})")));
            }
            answer.extend_from_slice(&chunk[..n]);
        }
        Ok::<_, std::io::Error>(answer)
    };
    let answer = match tokio::time::timeout(timeout, exchange).await {
        Ok(Ok(a)) => a,
        Ok(Err(e)) => return Err(HttpError::AfterSend(e.to_string())),
        Err(_) => return Err(HttpError::AfterSend(format!("no answer within {} ms", timeout.as_millis()))),
    };
    parse(&answer).map_err(HttpError::AfterSend)
}

/// Parses a complete HTTP/1.1 answer (read until the server closed).
pub fn parse(answer: &[u8]) -> Result<Response, String> {
    let end = answer.windows(4).position(|w| w == b"\r\n\r\n").ok_or("answer without a complete header")?;
    let head = std::str::from_utf8(&answer[..end]).map_err(|_| "header is not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let status: u16 = status_line.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let mut chunked = false;
    let mut length: Option<usize> = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else { continue };
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") && value.eq_ignore_ascii_case("chunked") {
            chunked = true;
        } else if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.parse().map_err(|_| format!("bad Content-Length {value:?}"))?);
        }
    }
    let rest = &answer[end + 4..];
    let body = if chunked {
        dechunk(rest)?
    } else if let Some(n) = length {
        if rest.len() < n {
            return Err(format!("answer cut short: {} of {n} body bytes", rest.len()));
        }
        rest[..n].to_vec()
    } else {
        rest.to_vec()
    };
    Ok(Response { status, body })
}

fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    loop {
        let eol = rest.windows(2).position(|w| w == b"\r\n").ok_or("chunk size line cut short")?;
        let size_text = std::str::from_utf8(&rest[..eol]).map_err(|_| "chunk size is not UTF-8")?;
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16).map_err(|_| format!("bad chunk size {size_text:?}"))?;
        rest = &rest[eol + 2..];
        if size == 0 {
            return Ok(body);
        }
        if rest.len() < size + 2 {
            return Err("chunk cut short".into());
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked_answers() {
        let plain = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";
        let r = parse(plain).unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"hello"[..]));
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\na\r\n0123456789\r\n0\r\n\r\n";
        let r = parse(chunked).unwrap();
        assert_eq!(r.body, b"abc0123456789");
        assert!(parse(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nshort").is_err());
        assert!(parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab").is_err());
        assert!(parse(b"garbage").is_err());
    }
}
