//! Framing, checksums, size limits and authentication shared by every Understudy protocol.
//!
//! A frame is `len: u32 LE | crc32c(payload): u32 LE | payload`, the payload a postcard-encoded
//! message. Frames larger than the reader's limit, or whose checksum does not match, are refused
//! with an error (the connection is then closed by the caller): a peer speaking nonsense never
//! crashes a server. Connections begin with a mutual challenge-response over a cluster secret
//! ([`auth`]), so a stranger on the network cannot read or write.

pub mod auth;
pub mod link;
pub mod listen;
pub mod metrics;
pub mod ports;
pub mod tls;

use serde::{de::DeserializeOwned, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Bytes of the frame header (length + checksum).
pub const FRAME_HEADER_BYTES: usize = 8;
/// Default largest payload accepted: a 4 MiB object plus headroom.
pub const MAX_FRAME_PAYLOAD_BYTES: usize = 4 * 1024 * 1024 + 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("connection closed")]
    Closed,
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("frame of {len} bytes exceeds the limit of {limit} bytes")]
    TooLarge { len: usize, limit: usize },
    #[error("frame checksum mismatch (got {got:#010x}, want {want:#010x})")]
    Checksum { got: u32, want: u32 },
    #[error("malformed message: {0}")]
    Decode(String),
    #[error("authentication failed: {0}")]
    Auth(String),
    #[error("TLS: {0}")]
    Tls(String),
}

/// Encodes `msg` as one frame.
pub fn encode_frame<M: Serialize>(msg: &M) -> Result<Vec<u8>, WireError> {
    let header = vec![0u8; FRAME_HEADER_BYTES];
    let mut out = postcard::to_extend(msg, header).map_err(|e| WireError::Decode(e.to_string()))?;
    let payload_len = out.len() - FRAME_HEADER_BYTES;
    let crc = crc32c::crc32c(&out[FRAME_HEADER_BYTES..]);
    out[0..4].copy_from_slice(&(payload_len as u32).to_le_bytes());
    out[4..8].copy_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// Decodes a payload (the part after the header) into a message.
pub fn decode_payload<M: DeserializeOwned>(payload: &[u8]) -> Result<M, WireError> {
    postcard::from_bytes(payload).map_err(|e| WireError::Decode(e.to_string()))
}

/// Checks a frame header against the limit and returns the payload length and checksum.
pub fn parse_header(header: &[u8; FRAME_HEADER_BYTES], limit: usize) -> Result<(usize, u32), WireError> {
    let len = u32::from_le_bytes(header[0..4].try_into().unwrap()) as usize;
    let crc = u32::from_le_bytes(header[4..8].try_into().unwrap());
    if len > limit {
        return Err(WireError::TooLarge { len, limit });
    }
    Ok((len, crc))
}

/// Decodes one whole frame held in memory (header and payload).
pub fn decode_frame<M: DeserializeOwned>(frame: &[u8], limit: usize) -> Result<M, WireError> {
    if frame.len() < FRAME_HEADER_BYTES {
        return Err(WireError::Decode("frame shorter than its header".into()));
    }
    let (len, want) = parse_header(frame[..FRAME_HEADER_BYTES].try_into().unwrap(), limit)?;
    let payload = &frame[FRAME_HEADER_BYTES..];
    if payload.len() != len {
        return Err(WireError::Decode(format!("frame says {len} payload bytes, has {}", payload.len())));
    }
    let got = crc32c::crc32c(payload);
    if got != want {
        return Err(WireError::Checksum { got, want });
    }
    decode_payload(payload)
}

/// Reads one frame and decodes it.
pub async fn read_msg<M: DeserializeOwned, R: AsyncRead + Unpin>(r: &mut R, limit: usize) -> Result<M, WireError> {
    let mut header = [0u8; FRAME_HEADER_BYTES];
    match r.read_exact(&mut header).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(WireError::Closed),
        Err(e) => return Err(e.into()),
    }
    let (len, want) = parse_header(&header, limit)?;
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).await?;
    let got = crc32c::crc32c(&payload);
    if got != want {
        return Err(WireError::Checksum { got, want });
    }
    decode_payload(&payload)
}

/// Encodes and writes one frame (not flushed: callers using a BufWriter flush when idle).
pub async fn write_msg<M: Serialize, W: AsyncWrite + Unpin>(w: &mut W, msg: &M) -> Result<(), WireError> {
    let frame = encode_frame(msg)?;
    w.write_all(&frame).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    enum Msg {
        A { x: u64, data: Vec<u8> },
        B(String),
    }

    #[test]
    fn roundtrip() {
        let m = Msg::A { x: 7, data: vec![1, 2, 3] };
        let f = encode_frame(&m).unwrap();
        assert_eq!(decode_frame::<Msg>(&f, 1024).unwrap(), m);
    }

    #[test]
    fn corrupt_checksum_is_refused() {
        let mut f = encode_frame(&Msg::B("hello".into())).unwrap();
        let last = f.len() - 1;
        f[last] ^= 0xff;
        assert!(matches!(decode_frame::<Msg>(&f, 1024), Err(WireError::Checksum { .. })));
    }

    #[test]
    fn oversized_is_refused() {
        let f = encode_frame(&Msg::A { x: 1, data: vec![0; 2000] }).unwrap();
        assert!(matches!(decode_frame::<Msg>(&f, 1000), Err(WireError::TooLarge { .. })));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_frame::<Msg>(&bytes, 1 << 20);
        }

        #[test]
        fn arbitrary_payload_with_valid_crc_never_panics(payload in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut f = vec![0u8; 8];
            f[0..4].copy_from_slice(&(payload.len() as u32).to_le_bytes());
            f[4..8].copy_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
            f.extend_from_slice(&payload);
            let _ = decode_frame::<Msg>(&f, 1 << 20);
        }
    }
}
