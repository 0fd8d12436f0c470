//! The NBD wire format: constants, and pure parsers and encoders over byte slices.
//!
//! Nothing here does I/O, so every function can be fed arbitrary bytes by property tests and by
//! the fuzz target in `crates/nbd/fuzz`. Parsers never panic: short or malformed input is an
//! [`ParseError`]. All integers on the wire are big-endian.
//!
//! Reference: the NBD protocol document (`doc/proto.md` in the NetworkBlockDevice/nbd repository).

use blockdev::DevError;

// ---- Handshake -------------------------------------------------------------------------------

/// `"NBDMAGIC"`: the first eight bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `"IHAVEOPT"`: sent by the server after `NBD_MAGIC`, and by the client before every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic that starts every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

/// Handshake flag (server): fixed newstyle negotiation is supported.
pub const NBD_FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag (server): the client may ask to skip the 124 zero bytes after EXPORT_NAME.
pub const NBD_FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const NBD_FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: do not send the 124 zero bytes after EXPORT_NAME.
pub const NBD_FLAG_C_NO_ZEROES: u32 = 1 << 1;
/// Every client flag this server understands; any other bit makes it close the connection.
pub const KNOWN_CLIENT_FLAGS: u32 = NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES;

pub const NBD_OPT_EXPORT_NAME: u32 = 1;
pub const NBD_OPT_ABORT: u32 = 2;
pub const NBD_OPT_LIST: u32 = 3;
pub const NBD_OPT_STARTTLS: u32 = 5;
pub const NBD_OPT_INFO: u32 = 6;
pub const NBD_OPT_GO: u32 = 7;
pub const NBD_OPT_STRUCTURED_REPLY: u32 = 8;
pub const NBD_OPT_LIST_META_CONTEXT: u32 = 9;
pub const NBD_OPT_SET_META_CONTEXT: u32 = 10;

pub const NBD_REP_ACK: u32 = 1;
pub const NBD_REP_SERVER: u32 = 2;
pub const NBD_REP_INFO: u32 = 3;
const NBD_REP_FLAG_ERROR: u32 = 1 << 31;
pub const NBD_REP_ERR_UNSUP: u32 = NBD_REP_FLAG_ERROR | 1;
pub const NBD_REP_ERR_POLICY: u32 = NBD_REP_FLAG_ERROR | 2;
pub const NBD_REP_ERR_INVALID: u32 = NBD_REP_FLAG_ERROR | 3;
pub const NBD_REP_ERR_TLS_REQD: u32 = NBD_REP_FLAG_ERROR | 5;
pub const NBD_REP_ERR_UNKNOWN: u32 = NBD_REP_FLAG_ERROR | 6;
pub const NBD_REP_ERR_TOO_BIG: u32 = NBD_REP_FLAG_ERROR | 9;

pub const NBD_INFO_EXPORT: u16 = 0;
pub const NBD_INFO_NAME: u16 = 1;
pub const NBD_INFO_DESCRIPTION: u16 = 2;
pub const NBD_INFO_BLOCK_SIZE: u16 = 3;

/// Longest export name the protocol allows (strings "MUST be no longer than 4096 bytes").
pub const MAX_EXPORT_NAME_BYTES: usize = 4096;
/// Bytes of zero padding after the EXPORT_NAME reply unless NO_ZEROES was negotiated.
pub const EXPORT_NAME_ZERO_PAD_BYTES: usize = 124;
/// Bytes of an option header: `IHAVEOPT | option u32 | length u32`.
pub const OPTION_HEADER_BYTES: usize = 16;

// ---- Transmission ----------------------------------------------------------------------------

pub const NBD_FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const NBD_FLAG_READ_ONLY: u16 = 1 << 1;
pub const NBD_FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const NBD_FLAG_SEND_FUA: u16 = 1 << 3;
pub const NBD_FLAG_SEND_TRIM: u16 = 1 << 5;
pub const NBD_FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const NBD_FLAG_CAN_MULTI_CONN: u16 = 1 << 8;

/// Transmission flags this server advertises for every export. `CAN_MULTI_CONN` holds because a
/// FLUSH on any connection flushes the whole device (and [`blockdev::BlockDev`] writes are
/// durable when they complete).
pub const TRANSMISSION_FLAGS: u16 = NBD_FLAG_HAS_FLAGS
    | NBD_FLAG_SEND_FLUSH
    | NBD_FLAG_SEND_FUA
    | NBD_FLAG_SEND_TRIM
    | NBD_FLAG_SEND_WRITE_ZEROES
    | NBD_FLAG_CAN_MULTI_CONN;

pub const NBD_REQUEST_MAGIC: u32 = 0x2560_9513;
pub const NBD_SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Bytes of a request header.
pub const REQUEST_HEADER_BYTES: usize = 28;
/// Bytes of a simple reply header.
pub const SIMPLE_REPLY_HEADER_BYTES: usize = 16;

pub const NBD_CMD_READ: u16 = 0;
pub const NBD_CMD_WRITE: u16 = 1;
pub const NBD_CMD_DISC: u16 = 2;
pub const NBD_CMD_FLUSH: u16 = 3;
pub const NBD_CMD_TRIM: u16 = 4;
pub const NBD_CMD_WRITE_ZEROES: u16 = 6;

pub const NBD_CMD_FLAG_FUA: u16 = 1 << 0;
pub const NBD_CMD_FLAG_NO_HOLE: u16 = 1 << 1;

pub const NBD_EPERM: u32 = 1;
pub const NBD_EIO: u32 = 5;
pub const NBD_EINVAL: u32 = 22;
pub const NBD_ENOSPC: u32 = 28;

/// Maps a device error to the errno an NBD client sees.
pub fn errno_for(err: &DevError) -> u32 {
    match err {
        DevError::OutOfRange(_) => NBD_EINVAL,
        DevError::WriteRefused(_) => NBD_EPERM,
        DevError::NoSpace(_) => NBD_ENOSPC,
        DevError::Io(_) => NBD_EIO,
    }
}

/// Why a byte slice could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("need {need} bytes, got {got}")]
    Short { need: usize, got: usize },
    #[error("bad magic {got:#x}, expected {want:#x}")]
    BadMagic { got: u64, want: u64 },
    #[error("malformed: {0}")]
    Malformed(String),
}

fn need(bytes: &[u8], n: usize) -> Result<(), ParseError> {
    if bytes.len() < n {
        Err(ParseError::Short {
            need: n,
            got: bytes.len(),
        })
    } else {
        Ok(())
    }
}

fn be_u16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn be_u64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

// ---- Handshake parsing -----------------------------------------------------------------------

/// The greeting the server sends first: `NBDMAGIC | IHAVEOPT | handshake flags`.
pub fn encode_greeting() -> [u8; 18] {
    let mut out = [0u8; 18];
    out[0..8].copy_from_slice(&NBD_MAGIC.to_be_bytes());
    out[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    out[16..18].copy_from_slice(&(NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES).to_be_bytes());
    out
}

/// Client flags (the 4 bytes after the greeting). Unknown bits are an error: the spec tells the
/// server to close the connection.
pub fn parse_client_flags(bytes: &[u8]) -> Result<u32, ParseError> {
    need(bytes, 4)?;
    let flags = be_u32(bytes, 0);
    if flags & !KNOWN_CLIENT_FLAGS != 0 {
        return Err(ParseError::Malformed(format!(
            "unknown client flags {flags:#x}"
        )));
    }
    Ok(flags)
}

/// `IHAVEOPT | option | length`, the header of every option the client sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub length_bytes: u32,
}

pub fn parse_option_header(bytes: &[u8]) -> Result<OptionHeader, ParseError> {
    need(bytes, OPTION_HEADER_BYTES)?;
    let magic = be_u64(bytes, 0);
    if magic != IHAVEOPT {
        return Err(ParseError::BadMagic {
            got: magic,
            want: IHAVEOPT,
        });
    }
    Ok(OptionHeader {
        option: be_u32(bytes, 8),
        length_bytes: be_u32(bytes, 12),
    })
}

pub fn encode_option_header(h: &OptionHeader) -> [u8; OPTION_HEADER_BYTES] {
    let mut out = [0u8; OPTION_HEADER_BYTES];
    out[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
    out[8..12].copy_from_slice(&h.option.to_be_bytes());
    out[12..16].copy_from_slice(&h.length_bytes.to_be_bytes());
    out
}

/// Parses an export name (EXPORT_NAME data, or the name inside INFO/GO data).
pub fn parse_export_name(bytes: &[u8]) -> Result<String, ParseError> {
    if bytes.len() > MAX_EXPORT_NAME_BYTES {
        return Err(ParseError::Malformed(format!(
            "export name of {} bytes exceeds {MAX_EXPORT_NAME_BYTES}",
            bytes.len()
        )));
    }
    if bytes.contains(&0) {
        return Err(ParseError::Malformed("export name contains NUL".into()));
    }
    String::from_utf8(bytes.to_vec())
        .map_err(|_| ParseError::Malformed("export name is not UTF-8".into()))
}

/// The data of NBD_OPT_INFO and NBD_OPT_GO: an export name and the info types requested.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    pub info_types: Vec<u16>,
}

/// Parses `name length u32 | name | count u16 | count × info type u16`; the lengths must
/// account for every byte.
pub fn parse_info_request(bytes: &[u8]) -> Result<InfoRequest, ParseError> {
    need(bytes, 4)?;
    let name_bytes = be_u32(bytes, 0) as usize;
    let rest = &bytes[4..];
    if name_bytes > rest.len() {
        return Err(ParseError::Malformed(format!(
            "name length {name_bytes} exceeds the {} bytes left",
            rest.len()
        )));
    }
    let name = parse_export_name(&rest[..name_bytes])?;
    let rest = &rest[name_bytes..];
    need(rest, 2)?;
    let count = be_u16(rest, 0) as usize;
    let rest = &rest[2..];
    if rest.len() != count * 2 {
        return Err(ParseError::Malformed(format!(
            "{count} info requests need {} bytes, got {}",
            count * 2,
            rest.len()
        )));
    }
    let info_types = rest
        .chunks_exact(2)
        .map(|c| u16::from_be_bytes([c[0], c[1]]))
        .collect();
    Ok(InfoRequest { name, info_types })
}

pub fn encode_info_request(req: &InfoRequest) -> Vec<u8> {
    let mut out = Vec::with_capacity(6 + req.name.len() + 2 * req.info_types.len());
    out.extend_from_slice(&(req.name.len() as u32).to_be_bytes());
    out.extend_from_slice(req.name.as_bytes());
    out.extend_from_slice(&(req.info_types.len() as u16).to_be_bytes());
    for t in &req.info_types {
        out.extend_from_slice(&t.to_be_bytes());
    }
    out
}

/// Where a handshake stands with TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsState {
    /// The server offers no TLS: plain NBD.
    Off,
    /// The server requires TLS and the client has not upgraded yet (the spec's FORCEDTLS).
    Required,
    /// The connection runs over TLS.
    Established,
}

/// What the server does with an option, given where the handshake stands with TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsGate {
    /// Handle the option as without TLS.
    Serve,
    /// Acknowledge, then run the TLS handshake on the connection.
    StartTls,
    /// Reply with this error reply type and message, then read the next option.
    Refuse(u32, &'static str),
    /// Close the connection without a reply (the option has no error reply).
    Close(&'static str),
}

/// The NBD spec's rules for TLS (its "TLS support" section): while TLS is required and not
/// negotiated every option but STARTTLS and ABORT gets NBD_REP_ERR_TLS_REQD, and EXPORT_NAME,
/// which has no error reply, ends the connection; STARTTLS carries no data, is refused once
/// TLS runs, and is unsupported by a server without TLS.
pub fn tls_gate(state: TlsState, option: u32, length_bytes: u32) -> TlsGate {
    match (option, state) {
        (NBD_OPT_STARTTLS, TlsState::Off) => TlsGate::Refuse(NBD_REP_ERR_UNSUP, "this server offers no TLS"),
        (NBD_OPT_STARTTLS, TlsState::Established) => TlsGate::Refuse(NBD_REP_ERR_INVALID, "TLS is already established"),
        (NBD_OPT_STARTTLS, TlsState::Required) if length_bytes != 0 => {
            TlsGate::Refuse(NBD_REP_ERR_INVALID, "NBD_OPT_STARTTLS takes no data")
        }
        (NBD_OPT_STARTTLS, TlsState::Required) => TlsGate::StartTls,
        (NBD_OPT_ABORT, _) | (_, TlsState::Off | TlsState::Established) => TlsGate::Serve,
        (NBD_OPT_EXPORT_NAME, TlsState::Required) => {
            TlsGate::Close("NBD_OPT_EXPORT_NAME before NBD_OPT_STARTTLS on a server that requires TLS")
        }
        (_, TlsState::Required) => TlsGate::Refuse(NBD_REP_ERR_TLS_REQD, "this server requires TLS: send NBD_OPT_STARTTLS first"),
    }
}

/// One option reply: `magic | option | reply type | length | data`.
pub fn encode_option_reply(option: u32, reply_type: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(20 + data.len());
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// An option reply as a client sees it (used by tests and by clients).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionReply {
    pub option: u32,
    pub reply_type: u32,
    pub data: Vec<u8>,
}

/// Parses one option reply from the start of `bytes`; returns it and the bytes it used.
pub fn parse_option_reply(bytes: &[u8]) -> Result<(OptionReply, usize), ParseError> {
    need(bytes, 20)?;
    let magic = be_u64(bytes, 0);
    if magic != OPTION_REPLY_MAGIC {
        return Err(ParseError::BadMagic {
            got: magic,
            want: OPTION_REPLY_MAGIC,
        });
    }
    let len = be_u32(bytes, 16) as usize;
    need(bytes, 20 + len)?;
    let reply = OptionReply {
        option: be_u32(bytes, 8),
        reply_type: be_u32(bytes, 12),
        data: bytes[20..20 + len].to_vec(),
    };
    Ok((reply, 20 + len))
}

/// NBD_REP_INFO data for NBD_INFO_EXPORT: `type | size u64 | transmission flags u16`.
pub fn encode_info_export(size_bytes: u64, transmission_flags: u16) -> [u8; 12] {
    let mut out = [0u8; 12];
    out[0..2].copy_from_slice(&NBD_INFO_EXPORT.to_be_bytes());
    out[2..10].copy_from_slice(&size_bytes.to_be_bytes());
    out[10..12].copy_from_slice(&transmission_flags.to_be_bytes());
    out
}

/// NBD_REP_INFO data for NBD_INFO_BLOCK_SIZE: `type | minimum | preferred | maximum` (u32 each).
pub fn encode_info_block_size(min_bytes: u32, preferred_bytes: u32, max_bytes: u32) -> [u8; 14] {
    let mut out = [0u8; 14];
    out[0..2].copy_from_slice(&NBD_INFO_BLOCK_SIZE.to_be_bytes());
    out[2..6].copy_from_slice(&min_bytes.to_be_bytes());
    out[6..10].copy_from_slice(&preferred_bytes.to_be_bytes());
    out[10..14].copy_from_slice(&max_bytes.to_be_bytes());
    out
}

/// The reply to NBD_OPT_EXPORT_NAME: `size u64 | transmission flags u16 | [124 zero bytes]`.
pub fn encode_export_name_reply(
    size_bytes: u64,
    transmission_flags: u16,
    no_zeroes: bool,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(10 + EXPORT_NAME_ZERO_PAD_BYTES);
    out.extend_from_slice(&size_bytes.to_be_bytes());
    out.extend_from_slice(&transmission_flags.to_be_bytes());
    if !no_zeroes {
        out.extend_from_slice(&[0u8; EXPORT_NAME_ZERO_PAD_BYTES]);
    }
    out
}

// ---- Transmission parsing --------------------------------------------------------------------

/// A request header: `magic u32 | flags u16 | type u16 | cookie u64 | offset u64 | length u32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub kind: u16,
    /// Opaque to the server ("handle" in older versions of the spec); echoed in the reply.
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

pub fn parse_request_header(bytes: &[u8]) -> Result<RequestHeader, ParseError> {
    need(bytes, REQUEST_HEADER_BYTES)?;
    let magic = be_u32(bytes, 0);
    if magic != NBD_REQUEST_MAGIC {
        return Err(ParseError::BadMagic {
            got: magic as u64,
            want: NBD_REQUEST_MAGIC as u64,
        });
    }
    Ok(RequestHeader {
        flags: be_u16(bytes, 4),
        kind: be_u16(bytes, 6),
        cookie: be_u64(bytes, 8),
        offset: be_u64(bytes, 16),
        length: be_u32(bytes, 24),
    })
}

pub fn encode_request_header(h: &RequestHeader) -> [u8; REQUEST_HEADER_BYTES] {
    let mut out = [0u8; REQUEST_HEADER_BYTES];
    out[0..4].copy_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&h.flags.to_be_bytes());
    out[6..8].copy_from_slice(&h.kind.to_be_bytes());
    out[8..16].copy_from_slice(&h.cookie.to_be_bytes());
    out[16..24].copy_from_slice(&h.offset.to_be_bytes());
    out[24..28].copy_from_slice(&h.length.to_be_bytes());
    out
}

/// A simple reply header: `magic u32 | error u32 | cookie u64` (read data follows on success).
pub fn encode_simple_reply(errno: u32, cookie: u64) -> [u8; SIMPLE_REPLY_HEADER_BYTES] {
    let mut out = [0u8; SIMPLE_REPLY_HEADER_BYTES];
    out[0..4].copy_from_slice(&NBD_SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&errno.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out
}

/// Parses a simple reply header; returns `(errno, cookie)`.
pub fn parse_simple_reply(bytes: &[u8]) -> Result<(u32, u64), ParseError> {
    need(bytes, SIMPLE_REPLY_HEADER_BYTES)?;
    let magic = be_u32(bytes, 0);
    if magic != NBD_SIMPLE_REPLY_MAGIC {
        return Err(ParseError::BadMagic {
            got: magic as u64,
            want: NBD_SIMPLE_REPLY_MAGIC as u64,
        });
    }
    Ok((be_u32(bytes, 4), be_u64(bytes, 8)))
}

/// A request the server will carry out against the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read {
        offset: u64,
        length_bytes: u32,
    },
    /// `length_bytes` of payload follow the header.
    Write {
        offset: u64,
        length_bytes: u32,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        length_bytes: u32,
        fua: bool,
    },
    WriteZeroes {
        offset: u64,
        length_bytes: u32,
        fua: bool,
    },
}

/// What the connection must do with one request header: a pure decision, made before any
/// payload is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestPlan {
    /// Carry the command out (reading its payload first if it is a write).
    Execute(Command),
    /// Reply with `errno`, after reading and discarding `discard_payload_bytes` (a refused
    /// write's payload, read in small chunks so it is never held in memory).
    Reject {
        errno: u32,
        discard_payload_bytes: u32,
    },
    /// NBD_CMD_DISC: finish the requests in flight, then close.
    Disconnect,
    /// The stream can no longer be trusted (e.g. a write payload too large to skip): close now.
    Close(String),
}

/// Limits that [`plan_request`] enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Largest READ or WRITE accepted; larger ones get EINVAL.
    pub max_request_bytes: u32,
    /// Largest refused WRITE payload the server reads and throws away to stay in sync with the
    /// stream; a larger one (more likely a corrupt stream than a real request) closes the
    /// connection.
    pub max_discard_payload_bytes: u32,
}

/// Decides what to do with a request header, given the export size. Never panics.
pub fn plan_request(
    h: &RequestHeader,
    export_size_bytes: u64,
    limits: &RequestLimits,
) -> RequestPlan {
    let fua = h.flags & NBD_CMD_FLAG_FUA != 0;
    let in_range = blockdev::check_range(export_size_bytes, h.offset, h.length as u64).is_ok();
    let reject = |discard: u32| RequestPlan::Reject {
        errno: NBD_EINVAL,
        discard_payload_bytes: discard,
    };
    match h.kind {
        NBD_CMD_WRITE => {
            // The payload follows whatever we decide: refuse it without losing our place.
            let bad_flags = h.flags & !(NBD_CMD_FLAG_FUA) != 0;
            if h.length > limits.max_request_bytes || !in_range || bad_flags {
                if h.length > limits.max_discard_payload_bytes {
                    return RequestPlan::Close(format!(
                        "write payload of {} bytes exceeds both max_request_bytes {} and the \
                         {}-byte discard limit",
                        h.length, limits.max_request_bytes, limits.max_discard_payload_bytes
                    ));
                }
                return reject(h.length);
            }
            RequestPlan::Execute(Command::Write {
                offset: h.offset,
                length_bytes: h.length,
                fua,
            })
        }
        NBD_CMD_READ => {
            if h.length > limits.max_request_bytes || !in_range || h.flags & !NBD_CMD_FLAG_FUA != 0
            {
                return reject(0);
            }
            RequestPlan::Execute(Command::Read {
                offset: h.offset,
                length_bytes: h.length,
            })
        }
        NBD_CMD_DISC => RequestPlan::Disconnect,
        NBD_CMD_FLUSH => {
            if h.flags != 0 {
                return reject(0);
            }
            RequestPlan::Execute(Command::Flush)
        }
        NBD_CMD_TRIM => {
            if !in_range || h.flags & !NBD_CMD_FLAG_FUA != 0 {
                return reject(0);
            }
            RequestPlan::Execute(Command::Trim {
                offset: h.offset,
                length_bytes: h.length,
                fua,
            })
        }
        NBD_CMD_WRITE_ZEROES => {
            if !in_range || h.flags & !(NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_NO_HOLE) != 0 {
                return reject(0);
            }
            // NO_HOLE only forbids punching a hole; BlockDev::write_zeroes never promises one.
            RequestPlan::Execute(Command::WriteZeroes {
                offset: h.offset,
                length_bytes: h.length,
                fua,
            })
        }
        // Unknown commands (CACHE, BLOCK_STATUS, ... which we do not advertise) carry no
        // payload we know of: EINVAL, as the spec asks.
        _ => reject(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_gate_follows_the_spec() {
        use TlsState::*;
        // Without TLS, only STARTTLS is refused (unsupported); everything else is served.
        for o in [NBD_OPT_EXPORT_NAME, NBD_OPT_ABORT, NBD_OPT_LIST, NBD_OPT_INFO, NBD_OPT_GO, 99] {
            assert_eq!(tls_gate(Off, o, 0), TlsGate::Serve);
            assert_eq!(tls_gate(Established, o, 0), TlsGate::Serve);
        }
        assert!(matches!(tls_gate(Off, NBD_OPT_STARTTLS, 0), TlsGate::Refuse(NBD_REP_ERR_UNSUP, _)));
        // TLS required: STARTTLS upgrades, ABORT is honoured, EXPORT_NAME closes, the rest
        // is refused with TLS_REQD.
        assert_eq!(tls_gate(Required, NBD_OPT_STARTTLS, 0), TlsGate::StartTls);
        assert!(matches!(tls_gate(Required, NBD_OPT_STARTTLS, 4), TlsGate::Refuse(NBD_REP_ERR_INVALID, _)));
        assert_eq!(tls_gate(Required, NBD_OPT_ABORT, 0), TlsGate::Serve);
        assert!(matches!(tls_gate(Required, NBD_OPT_EXPORT_NAME, 4), TlsGate::Close(_)));
        for o in [NBD_OPT_LIST, NBD_OPT_INFO, NBD_OPT_GO, NBD_OPT_STRUCTURED_REPLY, 99] {
            assert!(matches!(tls_gate(Required, o, 0), TlsGate::Refuse(NBD_REP_ERR_TLS_REQD, _)), "option {o}");
        }
        // Once TLS runs, a second STARTTLS is invalid.
        assert!(matches!(tls_gate(Established, NBD_OPT_STARTTLS, 0), TlsGate::Refuse(NBD_REP_ERR_INVALID, _)));
    }
    use proptest::prelude::*;

    const LIMITS: RequestLimits = RequestLimits {
        max_request_bytes: 32 << 20,
        max_discard_payload_bytes: 64 << 20,
    };

    #[test]
    fn request_roundtrip() {
        let h = RequestHeader {
            flags: 1,
            kind: NBD_CMD_WRITE,
            cookie: 7,
            offset: 4096,
            length: 512,
        };
        assert_eq!(parse_request_header(&encode_request_header(&h)), Ok(h));
    }

    #[test]
    fn bad_magic_and_short_input_are_errors() {
        let mut b = encode_request_header(&RequestHeader {
            flags: 0,
            kind: 0,
            cookie: 0,
            offset: 0,
            length: 0,
        });
        b[0] ^= 1;
        assert!(matches!(
            parse_request_header(&b),
            Err(ParseError::BadMagic { .. })
        ));
        assert!(matches!(
            parse_request_header(&b[..10]),
            Err(ParseError::Short { .. })
        ));
    }

    #[test]
    fn plans_at_the_limits() {
        let size = 1 << 30;
        let h = |kind, offset, length| RequestHeader {
            flags: 0,
            kind,
            cookie: 1,
            offset,
            length,
        };
        // Exactly max_request_bytes is fine, one more is EINVAL.
        assert!(matches!(
            plan_request(&h(NBD_CMD_READ, 0, 32 << 20), size, &LIMITS),
            RequestPlan::Execute(_)
        ));
        assert_eq!(
            plan_request(&h(NBD_CMD_READ, 0, (32 << 20) + 1), size, &LIMITS),
            RequestPlan::Reject {
                errno: NBD_EINVAL,
                discard_payload_bytes: 0
            }
        );
        // An oversized write is discarded up to the discard limit, beyond it the stream closes.
        assert_eq!(
            plan_request(&h(NBD_CMD_WRITE, 0, (32 << 20) + 1), size, &LIMITS),
            RequestPlan::Reject {
                errno: NBD_EINVAL,
                discard_payload_bytes: (32 << 20) + 1
            }
        );
        assert!(matches!(
            plan_request(&h(NBD_CMD_WRITE, 0, (64 << 20) + 1), size, &LIMITS),
            RequestPlan::Close(_)
        ));
        // Out of range, including offset overflow.
        assert_eq!(
            plan_request(&h(NBD_CMD_READ, size - 1, 2), size, &LIMITS),
            RequestPlan::Reject {
                errno: NBD_EINVAL,
                discard_payload_bytes: 0
            }
        );
        assert_eq!(
            plan_request(&h(NBD_CMD_TRIM, u64::MAX, 2), size, &LIMITS),
            RequestPlan::Reject {
                errno: NBD_EINVAL,
                discard_payload_bytes: 0
            }
        );
        assert_eq!(
            plan_request(&h(NBD_CMD_WRITE, u64::MAX, 8), size, &LIMITS),
            RequestPlan::Reject {
                errno: NBD_EINVAL,
                discard_payload_bytes: 8
            }
        );
        assert_eq!(
            plan_request(&h(NBD_CMD_DISC, 0, 0), size, &LIMITS),
            RequestPlan::Disconnect
        );
        assert_eq!(
            plan_request(&h(99, 0, 0), size, &LIMITS),
            RequestPlan::Reject {
                errno: NBD_EINVAL,
                discard_payload_bytes: 0
            }
        );
    }

    #[test]
    fn info_request_roundtrip_and_errors() {
        let req = InfoRequest {
            name: "vol".into(),
            info_types: vec![NBD_INFO_BLOCK_SIZE, 1],
        };
        assert_eq!(parse_info_request(&encode_info_request(&req)), Ok(req));
        // Name length past the end.
        assert!(parse_info_request(&[0, 0, 0, 9, b'a', 0, 0]).is_err());
        // Trailing garbage.
        assert!(parse_info_request(&[0, 0, 0, 0, 0, 0, 1]).is_err());
        // Odd number of info bytes.
        assert!(parse_info_request(&[0, 0, 0, 0, 0, 1, 0]).is_err());
    }

    #[test]
    fn dev_errors_map_to_errnos() {
        assert_eq!(errno_for(&DevError::OutOfRange(String::new())), 22);
        assert_eq!(errno_for(&DevError::WriteRefused(String::new())), 1);
        assert_eq!(errno_for(&DevError::NoSpace(String::new())), 28);
        assert_eq!(errno_for(&DevError::Io(String::new())), 5);
    }

    proptest! {
        #[test]
        fn parsers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse_client_flags(&bytes);
            let _ = parse_option_header(&bytes);
            let _ = parse_info_request(&bytes);
            let _ = parse_export_name(&bytes);
            let _ = parse_option_reply(&bytes);
            let _ = parse_simple_reply(&bytes);
            if let Ok(h) = parse_request_header(&bytes) {
                let _ = plan_request(&h, 1 << 20, &LIMITS);
            }
        }

        #[test]
        fn executed_requests_are_in_range_and_bounded(
            flags in any::<u16>(), kind in 0u16..10, offset in any::<u64>(), length in any::<u32>(),
            size in 0u64..(1 << 40),
        ) {
            let h = RequestHeader { flags, kind, cookie: 0, offset, length };
            match plan_request(&h, size, &LIMITS) {
                RequestPlan::Execute(Command::Read { offset, length_bytes })
                | RequestPlan::Execute(Command::Write { offset, length_bytes, .. }) => {
                    prop_assert!(length_bytes <= LIMITS.max_request_bytes);
                    prop_assert!(offset.checked_add(length_bytes as u64).is_some_and(|e| e <= size));
                }
                RequestPlan::Execute(Command::Trim { offset, length_bytes, .. })
                | RequestPlan::Execute(Command::WriteZeroes { offset, length_bytes, .. }) => {
                    prop_assert!(offset.checked_add(length_bytes as u64).is_some_and(|e| e <= size));
                }
                RequestPlan::Reject { discard_payload_bytes, .. } => {
                    prop_assert!(discard_payload_bytes <= LIMITS.max_discard_payload_bytes);
                    prop_assert!(discard_payload_bytes == 0 || kind == NBD_CMD_WRITE);
                }
                _ => {}
            }
        }

        #[test]
        fn request_header_roundtrips(flags in any::<u16>(), kind in any::<u16>(), cookie in any::<u64>(),
                                     offset in any::<u64>(), length in any::<u32>()) {
            let h = RequestHeader { flags, kind, cookie, offset, length };
            prop_assert_eq!(parse_request_header(&encode_request_header(&h)), Ok(h));
        }
    }
}
