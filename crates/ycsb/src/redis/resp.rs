//! RESP2, the Redis serialization protocol, as far as a key-value client needs it: commands as
//! arrays of bulk strings, and a sans-I/O reply parser over a byte buffer with limits.

/// One reply of a Redis server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// `+OK`
    Simple(String),
    /// `-ERR ...`: the server refused the command.
    Error(String),
    /// `:42`
    Integer(i64),
    /// `$3\r\nfoo` or the null bulk string `$-1`.
    Bulk(Option<Vec<u8>>),
    /// `*2\r\n...` or the null array `*-1`.
    Array(Option<Vec<Reply>>),
}

/// Limits on what the parser accepts, so a broken or hostile server cannot make the client
/// allocate without bound.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Largest bulk string (Redis itself allows 512 MiB).
    pub max_bulk_bytes: usize,
    /// Most elements of one array.
    pub max_array_len: usize,
    /// Longest header line (type byte, number or simple string, CRLF).
    pub max_line_bytes: usize,
    /// Deepest nesting of arrays.
    pub max_depth: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_bulk_bytes: 64 << 20,
            max_array_len: 1 << 20,
            max_line_bytes: 64 << 10,
            max_depth: 8,
        }
    }
}

/// A reply that breaks the protocol or a limit; the connection cannot be used further.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("unknown reply type byte {0:#04x}")]
    UnknownType(u8),
    #[error("malformed reply line {0:?}")]
    BadLine(String),
    #[error("{what} of {len} exceeds the limit of {limit}")]
    TooLarge {
        what: &'static str,
        len: usize,
        limit: usize,
    },
    #[error("bulk string not terminated by CRLF")]
    BadTerminator,
}

/// Appends `args` as a RESP array of bulk strings (how clients send commands).
pub fn encode_command(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for arg in args {
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

/// Parses one reply from the front of `buf`: `Ok(Some((reply, bytes used)))`, `Ok(None)` if
/// `buf` holds only part of a reply (read more and call again), or the error.
pub fn parse_reply(buf: &[u8], limits: &Limits) -> Result<Option<(Reply, usize)>, ProtocolError> {
    parse_at(buf, 0, limits, 0)
}

fn line<'a>(
    buf: &'a [u8],
    at: usize,
    limits: &Limits,
) -> Result<Option<(&'a [u8], usize)>, ProtocolError> {
    let rest = &buf[at..];
    let scan = &rest[..rest.len().min(limits.max_line_bytes)];
    match scan.windows(2).position(|w| w == b"\r\n") {
        Some(end) => Ok(Some((&rest[..end], at + end + 2))),
        None if rest.len() >= limits.max_line_bytes => Err(ProtocolError::TooLarge {
            what: "a reply line",
            len: rest.len(),
            limit: limits.max_line_bytes,
        }),
        None => Ok(None),
    }
}

fn number(text: &[u8]) -> Result<i64, ProtocolError> {
    std::str::from_utf8(text)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| ProtocolError::BadLine(String::from_utf8_lossy(text).into_owned()))
}

fn parse_at(
    buf: &[u8],
    at: usize,
    limits: &Limits,
    depth: usize,
) -> Result<Option<(Reply, usize)>, ProtocolError> {
    if at >= buf.len() {
        return Ok(None);
    }
    if depth > limits.max_depth {
        return Err(ProtocolError::TooLarge {
            what: "array nesting",
            len: depth,
            limit: limits.max_depth,
        });
    }
    let kind = buf[at];
    let Some((text, next)) = line(buf, at + 1, limits)? else {
        return Ok(None);
    };
    let text_string = || String::from_utf8_lossy(text).into_owned();
    match kind {
        b'+' => Ok(Some((Reply::Simple(text_string()), next))),
        b'-' => Ok(Some((Reply::Error(text_string()), next))),
        b':' => Ok(Some((Reply::Integer(number(text)?), next))),
        b'$' => {
            let len = number(text)?;
            if len == -1 {
                return Ok(Some((Reply::Bulk(None), next)));
            }
            let len = usize::try_from(len).map_err(|_| ProtocolError::BadLine(text_string()))?;
            if len > limits.max_bulk_bytes {
                return Err(ProtocolError::TooLarge {
                    what: "a bulk string",
                    len,
                    limit: limits.max_bulk_bytes,
                });
            }
            let end = next + len;
            if buf.len() < end + 2 {
                return Ok(None);
            }
            if &buf[end..end + 2] != b"\r\n" {
                return Err(ProtocolError::BadTerminator);
            }
            Ok(Some((Reply::Bulk(Some(buf[next..end].to_vec())), end + 2)))
        }
        b'*' => {
            let len = number(text)?;
            if len == -1 {
                return Ok(Some((Reply::Array(None), next)));
            }
            let len = usize::try_from(len).map_err(|_| ProtocolError::BadLine(text_string()))?;
            if len > limits.max_array_len {
                return Err(ProtocolError::TooLarge {
                    what: "an array",
                    len,
                    limit: limits.max_array_len,
                });
            }
            // Elements are at least 3 bytes each; never reserve more than the buffer could hold.
            let mut items = Vec::with_capacity(len.min((buf.len() - next) / 3 + 1));
            let mut pos = next;
            for _ in 0..len {
                match parse_at(buf, pos, limits, depth + 1)? {
                    Some((item, after)) => {
                        items.push(item);
                        pos = after;
                    }
                    None => return Ok(None),
                }
            }
            Ok(Some((Reply::Array(Some(items)), pos)))
        }
        other => Err(ProtocolError::UnknownType(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn encode_reply(reply: &Reply, out: &mut Vec<u8>) {
        match reply {
            Reply::Simple(s) => out.extend_from_slice(format!("+{s}\r\n").as_bytes()),
            Reply::Error(s) => out.extend_from_slice(format!("-{s}\r\n").as_bytes()),
            Reply::Integer(i) => out.extend_from_slice(format!(":{i}\r\n").as_bytes()),
            Reply::Bulk(None) => out.extend_from_slice(b"$-1\r\n"),
            Reply::Bulk(Some(b)) => {
                out.extend_from_slice(format!("${}\r\n", b.len()).as_bytes());
                out.extend_from_slice(b);
                out.extend_from_slice(b"\r\n");
            }
            Reply::Array(None) => out.extend_from_slice(b"*-1\r\n"),
            Reply::Array(Some(items)) => {
                out.extend_from_slice(format!("*{}\r\n", items.len()).as_bytes());
                for i in items {
                    encode_reply(i, out);
                }
            }
        }
    }

    fn reply_strategy() -> impl Strategy<Value = Reply> {
        let leaf = prop_oneof![
            "[a-zA-Z0-9 ]{0,20}".prop_map(Reply::Simple),
            "[a-zA-Z0-9 ]{0,20}".prop_map(Reply::Error),
            any::<i64>().prop_map(Reply::Integer),
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..64))
                .prop_map(Reply::Bulk),
        ];
        leaf.prop_recursive(3, 32, 6, |inner| {
            proptest::option::of(proptest::collection::vec(inner, 0..6)).prop_map(Reply::Array)
        })
    }

    proptest! {
        #[test]
        fn replies_round_trip_and_every_prefix_is_incomplete(reply in reply_strategy()) {
            let mut bytes = vec![];
            encode_reply(&reply, &mut bytes);
            let limits = Limits::default();
            prop_assert_eq!(parse_reply(&bytes, &limits).unwrap(), Some((reply, bytes.len())));
            for cut in 0..bytes.len() {
                prop_assert_eq!(parse_reply(&bytes[..cut], &limits).unwrap(), None);
            }
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse_reply(&bytes, &Limits::default());
        }
    }

    #[test]
    fn limits_are_enforced() {
        let limits = Limits {
            max_bulk_bytes: 10,
            max_array_len: 2,
            max_line_bytes: 16,
            max_depth: 1,
        };
        assert!(matches!(
            parse_reply(b"$11\r\n", &limits),
            Err(ProtocolError::TooLarge { .. })
        ));
        assert!(matches!(
            parse_reply(b"*3\r\n", &limits),
            Err(ProtocolError::TooLarge { .. })
        ));
        assert!(matches!(
            parse_reply(b"+aaaaaaaaaaaaaaaaaaaa", &limits),
            Err(ProtocolError::TooLarge { .. })
        ));
        assert!(matches!(
            parse_reply(b"*1\r\n*1\r\n*1\r\n:1\r\n", &limits),
            Err(ProtocolError::TooLarge { .. })
        ));
        assert_eq!(
            parse_reply(b"$3\r\nabcXY", &limits),
            Err(ProtocolError::BadTerminator)
        );
        assert_eq!(
            parse_reply(b"?x\r\n", &limits),
            Err(ProtocolError::UnknownType(b'?'))
        );
        assert!(matches!(
            parse_reply(b":x\r\n", &limits),
            Err(ProtocolError::BadLine(_))
        ));
    }

    #[test]
    fn commands_are_arrays_of_bulk_strings() {
        let mut out = vec![];
        encode_command(&mut out, &[b"SET", b"k", b"v\r\n"]);
        assert_eq!(
            out,
            b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\nv\r\n\r\n".to_vec()
        );
    }
}
