//! The ZooKeeper client wire protocol (jute binary records), sans-I/O: bytes in, values out.
//!
//! Every message is a frame `int32 length (big-endian) | payload`. A session opens with a
//! `ConnectRequest` / `ConnectResponse`; after that each request is `RequestHeader{xid, type}`
//! plus a body, and each reply `ReplyHeader{xid, zxid, err}` plus a body. Jute encodes ints and
//! longs big-endian, booleans as one byte, strings and buffers as an int32 length (-1: null) and
//! the bytes, vectors as an int32 count and the elements. Only what the benchmark needs is
//! here: create, setData, getData, ping and closeSession.

use crate::ZkError;

/// Frames larger than this are refused (ZooKeeper's own `jute.maxbuffer` default is 1 MiB of
/// data; a reply adds a header and a stat).
pub const MAX_FRAME_BYTES: usize = (1 << 20) + 4096;

/// Operation codes (`ZooDefs.OpCode`).
pub mod op {
    pub const CREATE: i32 = 1;
    pub const GET_DATA: i32 = 4;
    pub const SET_DATA: i32 = 5;
    pub const PING: i32 = 11;
    pub const CLOSE_SESSION: i32 = -11;
}

/// Reserved xids: the server's watch notifications and ping replies.
pub const XID_NOTIFICATION: i32 = -1;
pub const XID_PING: i32 = -2;

/// Error codes of a reply (`KeeperException.Code`) the client names.
pub mod err {
    pub const OK: i32 = 0;
    pub const NO_NODE: i32 = -101;
    pub const NODE_EXISTS: i32 = -110;
    pub const BAD_VERSION: i32 = -103;
    pub const SESSION_EXPIRED: i32 = -112;
}

/// A short name for an error code, for messages.
pub fn error_name(code: i32) -> &'static str {
    match code {
        0 => "ok",
        -1 => "system error",
        -4 => "connection loss",
        -7 => "operation timeout",
        -8 => "bad arguments",
        -101 => "no node",
        -102 => "no auth",
        -103 => "bad version",
        -110 => "node exists",
        -112 => "session expired",
        -118 => "session moved",
        -119 => "not read-only",
        _ => "unknown error",
    }
}

/// `OPEN_ACL_UNSAFE`: all permissions for `world:anyone`.
const PERMS_ALL: i32 = 31;

/// A request the client sends after the session is open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// A persistent znode with an open ACL.
    Create {
        path: String,
        data: Vec<u8>,
    },
    /// `version` -1 matches any version.
    SetData {
        path: String,
        data: Vec<u8>,
        version: i32,
    },
    GetData {
        path: String,
    },
    Ping,
    CloseSession,
}

impl Request {
    pub fn op_code(&self) -> i32 {
        match self {
            Request::Create { .. } => op::CREATE,
            Request::SetData { .. } => op::SET_DATA,
            Request::GetData { .. } => op::GET_DATA,
            Request::Ping => op::PING,
            Request::CloseSession => op::CLOSE_SESSION,
        }
    }
}

/// The metadata ZooKeeper keeps per znode.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    pub czxid: i64,
    pub mzxid: i64,
    pub ctime: i64,
    pub mtime: i64,
    pub version: i32,
    pub cversion: i32,
    pub aversion: i32,
    pub ephemeral_owner: i64,
    pub data_length: i32,
    pub num_children: i32,
    pub pzxid: i64,
}

/// What the server sent back for one request (or a notification, `xid` -1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub xid: i32,
    /// The last zxid the server had applied when it answered.
    pub zxid: i64,
    pub err: i32,
    /// The body; decode it with [`Reply::created_path`], [`Reply::stat`] or [`Reply::data`]
    /// according to the request.
    pub body: Vec<u8>,
}

impl Reply {
    /// The path a create returned.
    pub fn created_path(&self) -> Result<String, ZkError> {
        let mut r = Reader::new(&self.body);
        r.string()
    }

    /// The stat a setData returned.
    pub fn stat(&self) -> Result<Stat, ZkError> {
        Reader::new(&self.body).stat()
    }

    /// The data and stat a getData returned.
    pub fn data(&self) -> Result<(Option<Vec<u8>>, Stat), ZkError> {
        let mut r = Reader::new(&self.body);
        let data = r.buffer()?;
        Ok((data, r.stat()?))
    }
}

/// The session the server granted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectResponse {
    pub protocol_version: i32,
    /// Negotiated session timeout; 0 means the server refused the session (expired).
    pub timeout_ms: i32,
    pub session_id: i64,
    pub passwd: Vec<u8>,
}

// ------------------------------------------------------------------------------ encoding

fn int(out: &mut Vec<u8>, v: i32) {
    out.extend_from_slice(&v.to_be_bytes());
}

fn long(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(&v.to_be_bytes());
}

fn buffer(out: &mut Vec<u8>, b: &[u8]) {
    int(out, b.len() as i32);
    out.extend_from_slice(b);
}

/// Wraps a payload into a frame (length prefix).
fn frame(payload: Vec<u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 4);
    int(&mut out, payload.len() as i32);
    out.extend_from_slice(&payload);
    out
}

/// The framed `ConnectRequest` of a new session (no previous session, no read-only mode).
pub fn encode_connect(timeout_ms: i32) -> Vec<u8> {
    let mut p = Vec::with_capacity(45);
    int(&mut p, 0); // protocolVersion
    long(&mut p, 0); // lastZxidSeen
    int(&mut p, timeout_ms);
    long(&mut p, 0); // sessionId
    buffer(&mut p, &[0u8; 16]); // passwd
    p.push(0); // readOnly
    frame(p)
}

/// The framed request with header `xid`. Refuses paths and data the server would refuse.
pub fn encode_request(xid: i32, req: &Request) -> Result<Vec<u8>, ZkError> {
    let mut p = Vec::new();
    int(&mut p, xid);
    int(&mut p, req.op_code());
    let check_path = |path: &str| {
        if !path.starts_with('/') || (path.len() > 1 && path.ends_with('/')) || path.contains("//")
        {
            return Err(ZkError::BadArgument(format!(
                "{path:?} is not a ZooKeeper path"
            )));
        }
        Ok(())
    };
    let check_data = |data: &[u8]| {
        if data.len() > MAX_DATA_BYTES {
            return Err(ZkError::BadArgument(format!(
                "{} bytes of data; ZooKeeper takes at most {MAX_DATA_BYTES}",
                data.len()
            )));
        }
        Ok(())
    };
    match req {
        Request::Create { path, data } => {
            check_path(path)?;
            check_data(data)?;
            buffer(&mut p, path.as_bytes());
            buffer(&mut p, data);
            int(&mut p, 1); // one ACL
            int(&mut p, PERMS_ALL);
            buffer(&mut p, b"world");
            buffer(&mut p, b"anyone");
            int(&mut p, 0); // flags: persistent
        }
        Request::SetData {
            path,
            data,
            version,
        } => {
            check_path(path)?;
            check_data(data)?;
            buffer(&mut p, path.as_bytes());
            buffer(&mut p, data);
            int(&mut p, *version);
        }
        Request::GetData { path } => {
            check_path(path)?;
            buffer(&mut p, path.as_bytes());
            p.push(0); // no watch
        }
        Request::Ping | Request::CloseSession => {}
    }
    Ok(frame(p))
}

/// The most data one znode holds (ZooKeeper's `jute.maxbuffer` default, less room for the
/// request around it).
pub const MAX_DATA_BYTES: usize = 1_000_000;

// ------------------------------------------------------------------------------ decoding

/// Reads jute values from a payload, refusing truncated or inconsistent input.
struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Reader { buf, at: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ZkError> {
        if self.buf.len() - self.at < n {
            return Err(ZkError::Protocol(format!(
                "record truncated: {n} bytes needed at offset {} of {}",
                self.at,
                self.buf.len()
            )));
        }
        let s = &self.buf[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn int(&mut self) -> Result<i32, ZkError> {
        Ok(i32::from_be_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn long(&mut self) -> Result<i64, ZkError> {
        Ok(i64::from_be_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    fn buffer(&mut self) -> Result<Option<Vec<u8>>, ZkError> {
        let n = self.int()?;
        if n < 0 {
            return Ok(None);
        }
        Ok(Some(self.take(n as usize)?.to_vec()))
    }

    fn string(&mut self) -> Result<String, ZkError> {
        let b = self.buffer()?.unwrap_or_default();
        String::from_utf8(b).map_err(|_| ZkError::Protocol("a string is not UTF-8".into()))
    }

    fn stat(&mut self) -> Result<Stat, ZkError> {
        Ok(Stat {
            czxid: self.long()?,
            mzxid: self.long()?,
            ctime: self.long()?,
            mtime: self.long()?,
            version: self.int()?,
            cversion: self.int()?,
            aversion: self.int()?,
            ephemeral_owner: self.long()?,
            data_length: self.int()?,
            num_children: self.int()?,
            pzxid: self.long()?,
        })
    }
}

/// Decodes a `ConnectResponse` payload (the frame's length already removed).
pub fn decode_connect_response(payload: &[u8]) -> Result<ConnectResponse, ZkError> {
    let mut r = Reader::new(payload);
    Ok(ConnectResponse {
        protocol_version: r.int()?,
        timeout_ms: r.int()?,
        session_id: r.long()?,
        passwd: r.buffer()?.unwrap_or_default(),
        // A trailing readOnly byte may follow; it is not needed.
    })
}

/// Decodes a reply payload: the header, and the rest as the body.
pub fn decode_reply(payload: &[u8]) -> Result<Reply, ZkError> {
    let mut r = Reader::new(payload);
    let xid = r.int()?;
    let zxid = r.long()?;
    let err = r.int()?;
    Ok(Reply {
        xid,
        zxid,
        err,
        body: payload[r.at..].to_vec(),
    })
}

/// Splits a byte stream into frame payloads, refusing lengths that are negative or above
/// `max_frame_bytes` (the connection must then be closed).
#[derive(Debug)]
pub struct FrameSplitter {
    buf: Vec<u8>,
    max_frame_bytes: usize,
}

impl FrameSplitter {
    pub fn new(max_frame_bytes: usize) -> Self {
        FrameSplitter {
            buf: Vec::new(),
            max_frame_bytes,
        }
    }

    /// Adds received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete frame's payload, if one has arrived.
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>, ZkError> {
        if self.buf.len() < 4 {
            return Ok(None);
        }
        let n = i32::from_be_bytes(self.buf[..4].try_into().expect("4 bytes"));
        if n < 0 || n as usize > self.max_frame_bytes {
            return Err(ZkError::Protocol(format!(
                "frame of {n} bytes (the limit is {} bytes)",
                self.max_frame_bytes
            )));
        }
        let n = n as usize;
        if self.buf.len() < 4 + n {
            return Ok(None);
        }
        let payload = self.buf[4..4 + n].to_vec();
        self.buf.drain(..4 + n);
        Ok(Some(payload))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_request_layout() {
        let f = encode_connect(4000);
        // length | version 0 | lastZxid 0 | timeout | session 0 | passwd (16) | readOnly
        assert_eq!(f.len(), 4 + 4 + 8 + 4 + 8 + 4 + 16 + 1);
        assert_eq!(&f[..4], &(f.len() as i32 - 4).to_be_bytes());
        assert_eq!(&f[16..20], &4000i32.to_be_bytes());
    }

    #[test]
    fn set_data_layout() {
        let f = encode_request(
            7,
            &Request::SetData {
                path: "/a".into(),
                data: b"xy".to_vec(),
                version: -1,
            },
        )
        .unwrap();
        let mut want = vec![];
        int(&mut want, 7);
        int(&mut want, op::SET_DATA);
        buffer(&mut want, b"/a");
        buffer(&mut want, b"xy");
        int(&mut want, -1);
        assert_eq!(f, frame(want));
    }

    #[test]
    fn bad_paths_and_data_are_refused() {
        for p in ["a", "/a/", "//a", ""] {
            assert!(
                encode_request(1, &Request::GetData { path: p.into() }).is_err(),
                "{p:?}"
            );
        }
        let big = vec![0u8; MAX_DATA_BYTES + 1];
        assert!(encode_request(
            1,
            &Request::Create {
                path: "/a".into(),
                data: big
            }
        )
        .is_err());
    }

    #[test]
    fn reply_round_trip() {
        let mut p = vec![];
        int(&mut p, 3);
        long(&mut p, 0x1_0000_0005);
        int(&mut p, 0);
        buffer(&mut p, b"/node");
        let r = decode_reply(&p).unwrap();
        assert_eq!((r.xid, r.zxid, r.err), (3, 0x1_0000_0005, 0));
        assert_eq!(r.created_path().unwrap(), "/node");
    }

    #[test]
    fn truncated_and_oversized_input_is_an_error() {
        assert!(decode_reply(&[0, 0, 0]).is_err());
        let mut s = FrameSplitter::new(16);
        s.push(&100i32.to_be_bytes());
        assert!(s.next_frame().is_err());
        let mut s = FrameSplitter::new(16);
        s.push(&(-1i32).to_be_bytes());
        assert!(s.next_frame().is_err());
        let mut s = FrameSplitter::new(16);
        s.push(&3i32.to_be_bytes());
        s.push(&[1, 2]);
        assert_eq!(s.next_frame().unwrap(), None);
        s.push(&[3, 9]);
        assert_eq!(s.next_frame().unwrap(), Some(vec![1, 2, 3]));
        let r = Reply {
            xid: 1,
            zxid: 1,
            err: 0,
            body: vec![0, 0, 0, 9, 1],
        };
        assert!(r.created_path().is_err());
        assert!(r.stat().is_err());
    }

    proptest::proptest! {
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)) {
            let _ = decode_reply(&bytes);
            let _ = decode_connect_response(&bytes);
            let r = Reply { xid: 0, zxid: 0, err: 0, body: bytes.clone() };
            let _ = r.data();
            let _ = r.stat();
            let _ = r.created_path();
            let mut s = FrameSplitter::new(64);
            s.push(&bytes);
            while let Ok(Some(_)) = s.next_frame() {}
        }
    }
}
